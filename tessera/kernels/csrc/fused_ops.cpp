// Fused elementwise ops of a Llama-family layer, one pass each instead of 5-10 aten ops:
//   * add_rms_norm: residual add + RMSNorm (x + r rounded to the model dtype, as HF does; the
//                   norm in fp32; bf16 rounds the normed row before scaling by the weight)
//   * rotary:       neox (rotate-half) rotary embedding of q and k, cos/sin read from the fp32
//                   tables at each token's position
//   * silu_mul:     silu(gate) * up over a fused [T, 2 * inter] gate_up output
// Why: at batch 1 a decode step ran ~900 small aten ops; their dispatch, allocation and the
// extra passes over memory were a quarter of the step. Every op works row by row with the same
// instruction stream whatever the row count, so results stay batch-invariant.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// fp32 -> bf16, round to nearest even (what torch's .to(bfloat16) does for finite values).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float round_to(float f, const float*) { return f; }
inline float round_to(float f, const at::BFloat16*) {
  const uint32_t bits = static_cast<uint32_t>(bf16_bits(f)) << 16;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(at::BFloat16* p, int64_t i, float v) { reinterpret_cast<uint16_t*>(p)[i] = bf16_bits(v); }

// exp(x) by 2^n times a degree-6 polynomial of the reduced argument; plain loops over float
// arrays so the compiler vectorizes them (libm's expf does not vectorize without -ffast-math).
inline float poly_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187e-06f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + (r + 1.0f);
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  float e;
  std::memcpy(&e, &bits, 4);
  return e;
}

constexpr int64_t kGrain = 16;  // rows per parallel task: small batches stay on one thread

template <typename T>
void add_rms_norm_rows(const T* x, const T* res, const T* w, T* out, T* sum_out, int64_t rows, int64_t d,
                       float eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      T* o = out + r * d;
      T* s = sum_out ? sum_out + r * d : nullptr;
      // 16 partial sums in a fixed order, then a fixed tree: the same for every row count.
      float part[16] = {};
      for (int64_t i = 0; i < d; ++i) {
        float v = load(xr, i);
        if (res) {
          v = round_to(v + load(res + r * d, i), xr);
          store(s, i, v);
        }
        part[i & 15] += v * v;
      }
      for (int step = 8; step > 0; step /= 2)
        for (int j = 0; j < step; ++j) part[j] += part[j + step];
      const float inv = 1.0f / std::sqrt(part[0] / static_cast<float>(d) + eps);
      const T* src = res ? s : xr;
      for (int64_t i = 0; i < d; ++i) store(o, i, round_to(round_to(load(src, i) * inv, xr) * load(w, i), xr));
    }
  });
}

// x + residual (when given) then RMSNorm with weight. Returns (normed, x + residual); without a
// residual the second output is x itself.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "add_rms_norm: contiguous tensors only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "add_rms_norm: x and weight dtypes differ");
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "add_rms_norm: bad residual");
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  TORCH_CHECK(weight.numel() == d, "add_rms_norm: weight has ", weight.numel(), " elements, rows ", d);
  auto out = at::empty_like(x);
  auto sum = has_res ? at::empty_like(x) : x;
  AT_DISPATCH_SWITCH(x.scalar_type(), "add_rms_norm",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      add_rms_norm_rows(x.data_ptr<float>(), has_res ? residual->data_ptr<float>() : nullptr,
                        weight.data_ptr<float>(), out.data_ptr<float>(), has_res ? sum.data_ptr<float>() : nullptr,
                        rows, d, static_cast<float>(eps));
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using B = at::BFloat16;
      add_rms_norm_rows(x.data_ptr<B>(), has_res ? residual->data_ptr<B>() : nullptr, weight.data_ptr<B>(),
                        out.data_ptr<B>(), has_res ? sum.data_ptr<B>() : nullptr, rows, d, static_cast<float>(eps));
    }));
  return {out, sum};
}

template <typename T>
void rotary_rows(const T* x, int64_t row_stride, const float* cos, const float* sin, const int64_t* pos, T* out,
                 int64_t tokens, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * row_stride + h * d;
        T* o = out + (t * heads + h) * d;
        for (int64_t i = 0; i < half; ++i) {
          // cos and sin in the model dtype, as the unfused path (and HF) uses them.
          const float ci = round_to(c[i], xr), si = round_to(s[i], xr);
          const float x1 = load(xr, i), x2 = load(xr, i + half);
          store(o, i, x1 * ci - x2 * si);
          store(o, i + half, x2 * ci + x1 * si);
        }
      }
    }
  });
}

// Rotate the first `heads` heads of each token's row of x ([T, >= heads * d], rows may be
// strided: a view into the fused qkv output) at positions pos; returns [T, heads, d].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                  int64_t heads, int64_t d) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= heads * d, "rotary: x must be [T, >= heads * d]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(1) == d / 2, "rotary: cos/sin must be fp32 [positions, d / 2]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "rotary: positions must be long");
  const int64_t tokens = x.size(0);
  TORCH_CHECK(positions.numel() == tokens, "rotary: one position per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary: position ", pos[t], " is past the table");
  auto out = at::empty({tokens, heads, d}, x.options());
  AT_DISPATCH_SWITCH(x.scalar_type(), "rotary",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      rotary_rows(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
                  positions.data_ptr<int64_t>(), out.data_ptr<float>(), tokens, heads, d);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      rotary_rows(x.data_ptr<at::BFloat16>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
                  positions.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), tokens, heads, d);
    }));
  return out;
}

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float gv = load(g, i);
        const float act = round_to(gv / (1.0f + poly_exp(-gv)), g);  // silu rounds, then the product
        store(o, i, act * load(u, i));
      }
    }
  });
}

// silu(gate_up[:, :inter]) * gate_up[:, inter:] -> [T, inter].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "silu_mul: contiguous [T, 2 * inter] only");
  const int64_t inter = gate_up.size(-1) / 2, rows = inter ? gate_up.numel() / (2 * inter) : 0;
  auto shape = gate_up.sizes().vec();
  shape.back() = inter;
  auto out = at::empty(shape, gate_up.options());
  AT_DISPATCH_SWITCH(gate_up.scalar_type(), "silu_mul",
    AT_DISPATCH_CASE(at::kFloat, [&] { silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inter); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      silu_mul_rows(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, inter);
    }));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera_inv, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, Tensor positions, int heads, int head_dim) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(tessera_inv, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_mul", &silu_mul);
}
