// What the native decoder stacks (decoder_stack.cpp: llama; gemma_stack.cpp: Gemma 3) share: the
// paged_attention handle, the checks of their common inputs, and their linears, as the stacks take
// them: per linear kLinearSlots (5) tensor slots in `lin_tensors` and two ints in `lin_meta`
// (kind, format), built by tessera/model/native_stack.py (_linear_spec). Kinds:
//   0 bf16 InvariantLinear: linear_bf16(x, packed)         1 fp32 InvariantLinear: linear_f32(x, wt)
//     (format 1: a gate_up packed in pairs, linear_f32_pairs, its SiLU in the store);
//   2 tessera_qgemm::qgemm(x, codes, scale, zero?, format)  3 tessera_qgemm::kqgemm(x, codes, planes,
//     sup, sub?, format) -- the quantized modules' batch-invariant kernels; their bias is added
//     after the product (QuantLinear does `y + bias`), a float linear's inside it;
//   4 bf16 InvariantLinear with its GGUF blocks (tessera/quant/gguf_codes.py): packed, then codes,
//     planes, sup, sub? (the K-quants' sub-block scales); format = the KQ kind + 256 x its
//     codes_max_rows: calls of up to that many rows
//     without a bias take kqgemm(the KQ kind) on the blocks, the others linear_bf16: the same bits
//     either way, fewer bytes at decode;
//   5, 6 GGUF blocks on int8 activations (x86 without AMX; tessera/quant/gguf_int8_activations.py):
//     tessera_gemv::q4x8(x, qs, d, m) and q8x8(x, qs, d) on x (float32 or bf16, the result in its
//     dtype), their columns past n (padding rows) dropped and their bias added after them, as the
//     modules do;
//   7 fp32 InvariantLinear with its GGUF blocks (tessera/quant/gguf_f32_blocks.py): packed, then
//     blocks; format = paired (1) + 2 x (1 + linear_f32_blocks' format). Calls of up to
//     kF32BlocksMaxRows rows take linear_f32_blocks, the others kind 1: the same bits either way.
// Every call is the op the module would call, with the same arguments, so the stacks give the
// module path's bits.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <utility>

namespace {

using OptTensor = std::optional<at::Tensor>;

// Tensor slots per linear in a stack's `lin_tensors` (native_stack.LINEAR_SLOTS): the most any kind
// takes (kind 4: packed, codes, planes, sup, sub), the unused ones None.
constexpr int64_t kLinearSlots = 5;

// As gguf_f32_blocks.BLOCKS_MAX_ROWS: the row counts kind 7 reads from the blocks.
constexpr int64_t kF32BlocksMaxRows = 8;

template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

// The quantized kernels live in another library (tessera_qgemm), loaded only where a linear uses
// them: look them up at their first use.
at::Tensor kq_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& planes, const at::Tensor& sup,
                     const OptTensor& sub, int64_t fmt, int64_t n) {
  static const auto kqgemm = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const OptTensor&, int64_t, int64_t, int64_t)>("tessera_qgemm::kqgemm");
  return kqgemm.call(x, codes, planes, sup, sub, fmt, n, x.size(1));
}

at::Tensor quant_linear(const at::Tensor& x, const c10::List<OptTensor>& t, int64_t i, int64_t kind, int64_t fmt,
                        int64_t n) {
  const auto get = [&](int64_t j) { return t.get(i + j); };
  if (kind == 2) {
    static const auto qgemm = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                                            int64_t, int64_t, int64_t)>("tessera_qgemm::qgemm");
    return qgemm.call(x, *get(0), *get(1), get(2), fmt, n, x.size(1));
  }
  if (kind == 5 || kind == 6) {  // tessera_gemv is another library too (native_gemv.py loads it)
    static const auto q4 = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
        "tessera_gemv::q4x8");
    static const auto q8 = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>("tessera_gemv::q8x8");
    // The kernels take x in float32 or bf16 and give y in x's dtype, as the modules do.
    const at::Tensor xc = x.contiguous();
    at::Tensor y = kind == 5 ? q4.call(xc, *get(0), *get(1), *get(2)) : q8.call(xc, *get(0), *get(1));
    return y.size(1) > n ? y.narrow(1, 0, n).contiguous() : y;
  }
  TORCH_CHECK(kind == 3, "native stack: unknown linear kind ", kind);
  return kq_linear(x, *get(0), *get(1), *get(2), get(3), fmt, n);
}

// tessera_inv::paged_attention, called the same way by both stacks.
const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const at::Tensor&, const at::Tensor&, int64_t, double, int64_t,
                                          const OptTensor&, const OptTensor&, int64_t)>&
paged_attention_op() {
  static const auto handle = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, const at::Tensor&, int64_t, double, int64_t,
                                           const OptTensor&, const OptTensor&, int64_t)>("tessera_inv::paged_attention");
  return handle;
}

// dims = (heads, kv heads, head_dim, hidden, intermediate), and hidden contiguous bf16 or float32
// [T, hidden]: what both stacks need of their step. `name` prefixes the error.
void check_stack_step(const char* name, const at::Tensor& hidden, at::IntArrayRef dims) {
  TORCH_CHECK(dims.size() == 5, name, ": dims = (heads, kv_heads, head_dim, hidden, intermediate)");
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == dims[3] && hidden.is_contiguous(),
              name, ": hidden must be contiguous [T, ", dims[3], "]");
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16 || hidden.scalar_type() == at::kFloat,
              name, ": bf16 or float32 hidden states");
}

// A stack's linears: (*this)(li, x, bias, n) is linear li's output [T, n] on x.
struct StackLinears {
  const c10::List<OptTensor>& tensors;
  at::IntArrayRef meta;

  // Whether linear li's call on x takes its bf16 packed weight: kind 0, and kind 4 above its
  // codes' row limit or with a bias (else its blocks).
  bool takes_bf16(int64_t li, const at::Tensor& x, const OptTensor& bias) const {
    const int64_t kind = meta[2 * li];
    return kind == 0 || (kind == 4 && (bias.has_value() || x.size(0) > (meta[2 * li + 1] >> 8)));
  }

  // (kind, format) of linear li's call on x: kind 7 as the float32 kind it is, its format (2 or
  // more) where it reads the blocks, else only the paired bit; kind 4 with its KQ kind alone.
  std::pair<int64_t, int64_t> call_kind(int64_t li, const at::Tensor& x) const {
    const int64_t kind = meta[2 * li], fmt = meta[2 * li + 1];
    if (kind == 4) return {4, fmt & 255};
    if (kind != 7) return {kind, fmt};
    return {1, x.size(0) <= kF32BlocksMaxRows ? fmt : fmt & 1};
  }

  at::Tensor slot(int64_t li, int64_t j) const { return *tensors.get(kLinearSlots * li + j); }

  at::Tensor operator()(int64_t li, const at::Tensor& x, const OptTensor& bias, int64_t n) const {
    static const auto bf16_linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t, bool,
                                                  int64_t)>("tessera_inv::linear_bf16");
    static const auto f32 = op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t)>(
        "tessera_inv::linear_f32");
    static const auto f32_pairs = op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
                                                bool)>("tessera_inv::linear_f32_pairs");
    static const auto f32_blocks = op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
                                                 int64_t, int64_t)>("tessera_inv::linear_f32_blocks");
    const auto [kind, fmt] = call_kind(li, x);
    if (takes_bf16(li, x, bias)) return bf16_linear.call(x, slot(li, 0), bias, n, false, -1);
    if (kind == 1 && fmt >= 2) return f32_blocks.call(x, slot(li, 1), bias, n, (fmt >> 1) - 1, fmt & 1);
    if (kind == 1 && fmt == 1) return f32_pairs.call(x, slot(li, 0), bias, n, false);
    if (kind == 1) return f32.call(x, slot(li, 0), bias, n);
    if (kind == 4)
      return kq_linear(x, slot(li, 1), slot(li, 2), slot(li, 3), tensors.get(kLinearSlots * li + 4), fmt, n);
    at::Tensor y = quant_linear(x, tensors, kLinearSlots * li, kind, fmt, n);
    return bias.has_value() ? y + *bias : y;
  }
};

}  // namespace
