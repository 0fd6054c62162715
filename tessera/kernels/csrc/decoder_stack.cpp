// A llama-family model's decoder stack for one step in one call: per layer add_rms_norm, the
// fused qkv linear, rotary on q and k, write_kv, paged_attention, the o linear, add_rms_norm,
// gate_up, silu_mul and down; then the final norm.
//
// Why: the Python module path makes about 25 calls into torch per layer (module calls, views,
// op dispatch with schema parsing); at a batch-1 decode step of a 30-layer model that is several
// milliseconds against 16 of kernels. Here the same ops run through the C++ dispatcher (handles
// looked up once), with the same arguments in the same order, so every result is bit for bit
// the module path's: the tests compare the two. The profiler still sees each op.
//
// Inputs (tessera/model/native_stack.py builds them): per layer six tensors in `layer_tensors`
// (input norm weight, qkv packed weight, o packed weight, post-attention norm weight, gate_up and
// down packed weights: the InvariantLinear buffers), an optional qkv bias per layer, the KV cache
// pair per layer in `kv`, and the step's rotary tables, slots and attention plan (the tensors
// tessera/attention/invariant_cpu.py's _kernel_plan makes). dims = (heads, kv heads, head_dim,
// hidden, intermediate); windows = each layer's sliding window (0 = none).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace {

using OptTensor = std::optional<at::Tensor>;

template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

at::Tensor decoder_stack(const at::Tensor& hidden, at::TensorList layer_tensors, const c10::List<OptTensor>& qkv_bias,
                         at::TensorList kv, const at::Tensor& final_norm, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& block_tables,
                         const at::Tensor& token_row, const at::Tensor& token_ctx, at::IntArrayRef dims,
                         at::IntArrayRef windows, int64_t block_size, double scale, double eps) {
  static const auto norm = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptTensor&,
                                                                 const at::Tensor&, double)>("tessera_inv::add_rms_norm");
  static const auto amx = op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t, bool)>(
      "tessera_inv::linear_amx");
  static const auto f32 = op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t)>(
      "tessera_inv::linear_f32");
  static const auto rotary = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           int64_t, int64_t)>("tessera_inv::rotary");
  static const auto write_kv = op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                       const at::Tensor&)>("tessera_inv::write_kv");
  static const auto attention = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double,
                                              int64_t, const OptTensor&, const OptTensor&, int64_t)>(
      "tessera_inv::paged_attention");
  static const auto silu_mul = op<at::Tensor(const at::Tensor&)>("tessera_inv::silu_mul");

  TORCH_CHECK(dims.size() == 5, "decoder_stack: dims = (heads, kv_heads, head_dim, hidden, intermediate)");
  const int64_t h = dims[0], hkv = dims[1], d = dims[2], hidden_size = dims[3], inter = dims[4];
  const int64_t layers = static_cast<int64_t>(windows.size());
  TORCH_CHECK(static_cast<int64_t>(layer_tensors.size()) == 6 * layers && static_cast<int64_t>(kv.size()) == 2 * layers &&
                  static_cast<int64_t>(qkv_bias.size()) == layers,
              "decoder_stack: 6 tensors, a bias slot, a K/V pair and a window per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == hidden_size && hidden.is_contiguous(),
              "decoder_stack: hidden must be contiguous [T, ", hidden_size, "]");
  const bool bf16 = hidden.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || hidden.scalar_type() == at::kFloat, "decoder_stack: bf16 (AMX) or float32 hidden states");
  auto linear = [&](const at::Tensor& x, const at::Tensor& w, const OptTensor& bias, int64_t n) {
    return bf16 ? amx.call(x, w, bias, n, false) : f32.call(x, w, bias, n);
  };
  const int64_t tokens = hidden.size(0), qkv_n = (h + 2 * hkv) * d;
  const OptTensor none;
  at::Tensor x = hidden, residual;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = layer_tensors.data() + 6 * l;
    at::Tensor normed;
    // The first layer's residual is its input (add_rms_norm without one returns x as the sum).
    std::tie(normed, residual) = norm.call(x, l == 0 ? none : OptTensor(residual), w[0], eps);
    const OptTensor bias = qkv_bias.get(l);
    const at::Tensor qkv = linear(normed, w[1], bias, qkv_n);
    const at::Tensor qk = rotary.call(qkv, cos, sin, positions, h + hkv, d);  // [T, h + hkv, d]
    const at::Tensor k = qk.narrow(1, h, hkv), v = qkv.narrow(1, (h + hkv) * d, hkv * d).view({tokens, hkv, d});
    at::Tensor k_cache = kv[2 * l], v_cache = kv[2 * l + 1];
    write_kv.call(k, v, k_cache, v_cache, slots);
    const at::Tensor attn = attention.call(qk.narrow(1, 0, h), k_cache, v_cache, block_tables, token_row, token_ctx,
                                           block_size, scale, windows[l], none, none, -1);
    const at::Tensor o = linear(attn, w[2], none, hidden_size);
    std::tie(normed, residual) = norm.call(o, OptTensor(residual), w[3], eps);
    const at::Tensor gate_up = linear(normed, w[4], none, 2 * inter);
    x = linear(silu_mul.call(gate_up), w[5], none, hidden_size);
  }
  return std::get<0>(norm.call(x, layers ? OptTensor(residual) : none, final_norm, eps));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera_inv, m) {
  m.def("decoder_stack(Tensor hidden, Tensor[] layer_tensors, Tensor?[] qkv_bias, Tensor[] kv, Tensor final_norm, "
        "Tensor cos, Tensor sin, Tensor positions, Tensor slots, Tensor block_tables, Tensor token_row, "
        "Tensor token_ctx, int[] dims, int[] windows, int block_size, float scale, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(tessera_inv, CPU, m) {
  m.impl("decoder_stack", &decoder_stack);
}
