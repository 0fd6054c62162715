// Gemma 3's decoder stack for one step in one call, as decoder_stack.cpp is llama's: per layer
// gemma_rms_norm, the fused qkv linear, gemma_rms_norm over each head of q and of k, rotary on q
// and k (the layer's local or global table), write_kv, paged_attention, the o linear,
// gemma_rms_norm and the residual add, gemma_rms_norm, gate_up, tanh GELU of the gate times up,
// down, gemma_rms_norm and the residual add; then the final norm. Each op is the one
// tessera/model/gemma3.py's modules call, with the same arguments (views included: the GELU reads
// the gate as a strided view of gate_up, as F.gelu does there), so the result is the module
// path's bit for bit: the tests compare the two.
//
// Why: the module path makes about 40 Python-level calls into torch per layer (108 norms a step
// at 18 layers); at a one-token decode step of Gemma 3 270M that was ~4 ms against ~11 of kernels.
//
// Inputs (tessera/model/gemma_stack.py builds them): per layer six norm scales (1 + weight, float32:
// input, q, k, post-attention, pre-feedforward, post-feedforward) in `norms`; per linear (qkv, o,
// gate_up, down of each layer) five tensor slots (kLinearSlots) and (kind, format) as stack_common.h takes them;
// the KV cache pair per layer in `kv`; both rotary tables (global, local); the step's positions,
// slots and attention plan. dims = (heads, kv heads, head_dim, hidden, intermediate); windows =
// each layer's sliding window (0 = none); local = whether a layer takes the local rotary table.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

#include "stack_common.h"

namespace {

at::Tensor gemma_stack(const at::Tensor& hidden, at::TensorList norms, const c10::List<OptTensor>& lin_tensors,
                       at::IntArrayRef lin_meta, at::TensorList kv, const at::Tensor& final_norm,
                       const at::Tensor& cos_global, const at::Tensor& sin_global, const at::Tensor& cos_local,
                       const at::Tensor& sin_local, const at::Tensor& positions, const at::Tensor& slots,
                       const at::Tensor& block_tables, const at::Tensor& token_row, const at::Tensor& token_ctx,
                       at::IntArrayRef dims, at::IntArrayRef windows, at::IntArrayRef local, int64_t block_size,
                       double scale, double eps) {
  static const auto norm = op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("tessera_inv::gemma_rms_norm");
  static const auto rotary = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           int64_t, int64_t)>("tessera_inv::rotary");
  static const auto write_kv = op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                       const at::Tensor&)>("tessera_inv::write_kv");
  const auto& attention = paged_attention_op();

  check_stack_step("gemma_stack", hidden, dims);
  const int64_t h = dims[0], hkv = dims[1], d = dims[2], hidden_size = dims[3], inter = dims[4];
  const int64_t layers = static_cast<int64_t>(windows.size());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 6 * layers &&
                  static_cast<int64_t>(lin_tensors.size()) == 4 * kLinearSlots * layers &&
                  static_cast<int64_t>(lin_meta.size()) == 8 * layers && static_cast<int64_t>(kv.size()) == 2 * layers &&
                  static_cast<int64_t>(local.size()) == layers,
              "gemma_stack: per layer 6 norm scales, 4 linears (5 tensor slots, kind and format each), a K/V pair, "
              "a window and a local flag");
  const StackLinears lin{lin_tensors, lin_meta};
  const int64_t tokens = hidden.size(0), qkv_n = (h + 2 * hkv) * d;
  const OptTensor none;
  at::Tensor x = hidden;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = norms.data() + 6 * l;
    const at::Tensor& cos = local[l] ? cos_local : cos_global;
    const at::Tensor& sin = local[l] ? sin_local : sin_global;
    const at::Tensor qkv = lin(4 * l, norm.call(x, w[0], eps), none, qkv_n);
    // Each head of q and k normed (a contiguous copy of the head slice, as GemmaRMSNorm makes),
    // then rotated as rows [T, heads * d].
    const at::Tensor qn = norm.call(qkv.narrow(1, 0, h * d).view({tokens, h, d}).contiguous(), w[1], eps);
    const at::Tensor kn = norm.call(qkv.narrow(1, h * d, hkv * d).view({tokens, hkv, d}).contiguous(), w[2], eps);
    const at::Tensor q = rotary.call(qn.view({tokens, h * d}), cos, sin, positions, h, d);
    const at::Tensor k = rotary.call(kn.view({tokens, hkv * d}), cos, sin, positions, hkv, d);
    const at::Tensor v = qkv.narrow(1, (h + hkv) * d, hkv * d).view({tokens, hkv, d});
    at::Tensor k_cache = kv[2 * l], v_cache = kv[2 * l + 1];
    write_kv.call(k, v, k_cache, v_cache, slots);
    const at::Tensor attn = attention.call(q, k_cache, v_cache, block_tables, token_row, token_ctx, block_size, scale,
                                           windows[l], none, none, -1);
    x = at::add(x, norm.call(lin(4 * l + 1, attn, none, hidden_size), w[3], eps));
    const at::Tensor gate_up = lin(4 * l + 2, norm.call(x, w[4], eps), none, 2 * inter);
    const at::Tensor act = at::mul(at::gelu(gate_up.narrow(1, 0, inter), "tanh"), gate_up.narrow(1, inter, inter));
    x = at::add(x, norm.call(lin(4 * l + 3, act, none, hidden_size), w[5], eps));
  }
  return norm.call(x, final_norm, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera_inv, m) {
  // kv is written (each layer's write_kv), so the schema says so.
  m.def("gemma_stack(Tensor hidden, Tensor[] norms, Tensor?[] lin_tensors, int[] lin_meta, Tensor(a!)[] kv, "
        "Tensor final_norm, Tensor cos_global, Tensor sin_global, Tensor cos_local, Tensor sin_local, "
        "Tensor positions, Tensor slots, Tensor block_tables, Tensor token_row, Tensor token_ctx, int[] dims, "
        "int[] windows, int[] local, int block_size, float scale, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(tessera_inv, CPU, m) {
  m.impl("gemma_stack", &gemma_stack);
}
