// A llama-family model's decoder stack for one step in one call: per layer add_rms_norm, the
// fused qkv linear, rotary_kv (rotary on q and k, then the cache write), paged_attention, the o
// linear, add_rms_norm, gate_up, silu_mul (in gate_up's epilogue for a bf16 weight:
// linear_bf16_silu; for quantized tiles and GGUF blocks on bf16 x tessera_qgemm's qgemm_silu /
// kqgemm_silu) and down; then the final norm.
//
// Why: the Python module path makes about 25 calls into torch per layer (module calls, views,
// op dispatch with schema parsing); at a batch-1 decode step of a 30-layer model that is several
// milliseconds against 16 of kernels. Here the same ops run through the C++ dispatcher (handles
// looked up once), with the same arguments in the same order (rotary and write_kv as one op,
// rotary_kv, with the same arithmetic), so every result is bit for bit the module path's: the
// tests compare the two. The profiler still sees each op.
//
// Inputs (tessera/model/native_stack.py builds them): per layer the two norm weights in `norms`;
// per linear (qkv, o, gate_up, down of each layer) five tensor slots (kLinearSlots) in `lin_tensors` and two
// ints in `lin_meta` (kind, format: stack_common.h lists the kinds); an optional qkv bias per
// layer, the KV cache pair per layer in `kv`, and the step's rotary tables, slots and attention
// plan (the tensors tessera/attention/invariant_cpu.py's _kernel_plan makes). dims = (heads, kv
// heads, head_dim, hidden, intermediate); windows = each layer's sliding window (0 = none).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "stack_common.h"

namespace {

// silu(gate) * up of a fused gate_up of kind 2, 3 or 4 (its blocks) on bf16 x: the quantized
// kernel's gated call (tessera_qgemm::qgemm_silu / kqgemm_silu), silu_mul of its output bit for bit,
// with the silu in the store epilogue at decode sizes on AMX.
at::Tensor gated_quant_linear(const at::Tensor& x, const c10::List<OptTensor>& t, int64_t i, int64_t kind,
                              int64_t fmt, int64_t n) {
  const auto get = [&](int64_t j) { return t.get(i + j); };
  if (kind == 2) {
    static const auto qgemm_silu = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 const OptTensor&, int64_t, int64_t, int64_t)>("tessera_qgemm::qgemm_silu");
    return qgemm_silu.call(x, *get(0), *get(1), get(2), fmt, n, x.size(1));
  }
  static const auto kqgemm_silu = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, const OptTensor&, int64_t, int64_t, int64_t)>(
      "tessera_qgemm::kqgemm_silu");
  if (kind == 4) return kqgemm_silu.call(x, *get(1), *get(2), *get(3), get(4), fmt, n, x.size(1));
  return kqgemm_silu.call(x, *get(0), *get(1), *get(2), get(3), fmt, n, x.size(1));
}

at::Tensor decoder_stack(const at::Tensor& hidden, at::TensorList norms, const c10::List<OptTensor>& lin_tensors,
                         at::IntArrayRef lin_meta, const c10::List<OptTensor>& qkv_bias,
                         at::TensorList kv, const at::Tensor& final_norm, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& block_tables,
                         const at::Tensor& token_row, const at::Tensor& token_ctx, at::IntArrayRef dims,
                         at::IntArrayRef windows, int64_t block_size, double scale, double eps) {
  static const auto norm = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptTensor&,
                                                                 const at::Tensor&, double)>("tessera_inv::add_rms_norm");
  static const auto rotary_kv = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              int64_t, int64_t, int64_t, at::Tensor&, at::Tensor&, const at::Tensor&)>(
      "tessera_inv::rotary_kv");
  const auto& attention = paged_attention_op();
  static const auto silu_mul = op<at::Tensor(const at::Tensor&)>("tessera_inv::silu_mul");
  static const auto bf16_linear_silu = op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t)>(
      "tessera_inv::linear_bf16_silu");
  static const auto f32_pairs = op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t, bool)>(
      "tessera_inv::linear_f32_pairs");
  static const auto f32_blocks = op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t, int64_t,
                                               int64_t)>("tessera_inv::linear_f32_blocks");

  check_stack_step("decoder_stack", hidden, dims);
  const int64_t h = dims[0], hkv = dims[1], d = dims[2], hidden_size = dims[3], inter = dims[4];
  const int64_t layers = static_cast<int64_t>(windows.size());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(lin_tensors.size()) == 4 * kLinearSlots * layers &&
                  static_cast<int64_t>(lin_meta.size()) == 8 * layers && static_cast<int64_t>(kv.size()) == 2 * layers &&
                  static_cast<int64_t>(qkv_bias.size()) == layers,
              "decoder_stack: per layer 2 norms, 4 linears (5 tensor slots, kind and format each), a bias slot, "
              "a K/V pair and a window");
  const bool bf16 = hidden.scalar_type() == at::kBFloat16;
  const StackLinears lin{lin_tensors, lin_meta};
  // Linear j (0 qkv, 1 o, 2 gate_up, 3 down) of layer l.
  auto linear = [&](int64_t l, int64_t j, const at::Tensor& x, const OptTensor& bias, int64_t n) {
    return lin(4 * l + j, x, bias, n);
  };
  const int64_t qkv_n = (h + 2 * hkv) * d;
  const OptTensor none;
  at::Tensor x = hidden, residual;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = norms.data() + 2 * l;
    at::Tensor normed;
    // The first layer's residual is its input (add_rms_norm without one returns x as the sum).
    std::tie(normed, residual) = norm.call(x, l == 0 ? none : OptTensor(residual), w[0], eps);
    const OptTensor bias = qkv_bias.get(l);
    const at::Tensor qkv = linear(l, 0, normed, bias, qkv_n);
    at::Tensor k_cache = kv[2 * l], v_cache = kv[2 * l + 1];
    // q rotated [T, h, d]; k rotated and v written into the caches (rotary then write_kv in one pass)
    const at::Tensor q = rotary_kv.call(qkv, cos, sin, positions, h, hkv, d, k_cache, v_cache, slots);
    const at::Tensor attn = attention.call(q, k_cache, v_cache, block_tables, token_row, token_ctx,
                                           block_size, scale, windows[l], none, none, -1);
    const at::Tensor o = linear(l, 1, attn, none, hidden_size);
    std::tie(normed, residual) = norm.call(o, OptTensor(residual), w[1], eps);
    // gate_up and silu_mul in one call (the silu in the GEMM's store epilogue: the same bits, no
    // [T, 2 * inter] output) where the bf16 weight serves it, where a float32 one is packed in
    // pairs, and where quantized tiles or GGUF blocks do on bf16 x; other float32 linears in turn
    const int64_t gi = 4 * l + 2;
    const auto [gkind, gfmt] = lin.call_kind(gi, normed);
    at::Tensor act;
    if (lin.takes_bf16(gi, normed, none))
      act = bf16_linear_silu.call(normed, *lin_tensors.get(kLinearSlots * gi), 2 * inter, -1);
    else if (gkind == 1 && gfmt >= 2 && (gfmt & 1))
      act = f32_blocks.call(normed, *lin_tensors.get(kLinearSlots * gi + 1), none, 2 * inter, (gfmt >> 1) - 1, 2);
    else if (gkind == 1 && gfmt == 1)
      act = f32_pairs.call(normed, *lin_tensors.get(kLinearSlots * gi), none, 2 * inter, true);
    else if (bf16 && inter % 16 == 0 && gkind >= 2 && gkind <= 4)
      act = gated_quant_linear(normed, lin_tensors, kLinearSlots * gi, gkind, gfmt, 2 * inter);
    else
      act = silu_mul.call(linear(l, 2, normed, none, 2 * inter));
    x = linear(l, 3, act, none, hidden_size);
  }
  return std::get<0>(norm.call(x, layers ? OptTensor(residual) : none, final_norm, eps));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera_inv, m) {
  // kv is written (each layer's write_kv), so the schema says so.
  m.def("decoder_stack(Tensor hidden, Tensor[] norms, Tensor?[] lin_tensors, int[] lin_meta, Tensor?[] qkv_bias, "
        "Tensor(a!)[] kv, Tensor final_norm, Tensor cos, Tensor sin, Tensor positions, Tensor slots, "
        "Tensor block_tables, Tensor token_row, Tensor token_ctx, int[] dims, int[] windows, int block_size, "
        "float scale, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(tessera_inv, CPU, m) {
  m.impl("decoder_stack", &decoder_stack);
}
