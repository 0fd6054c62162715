// Fused elementwise ops of a Llama-family layer, one pass each instead of 5-10 aten ops:
//   * add_rms_norm: residual add + RMSNorm (x + r rounded to the model dtype, as HF does; the
//                   norm in fp32; bf16 rounds the normed row before scaling by the weight)
//   * rotary:       neox (rotate-half) rotary embedding of q and k, cos/sin read from the fp32
//                   tables at each token's position
//   * silu_mul:     silu(gate) * up over a fused [T, 2 * inter] gate_up output
//   * rotary_kv:    rotary on q and k of a fused qkv output, k and v written into the paged
//                   caches (the native decoder stack's rotary + write_kv)
//   * gemma_rms_norm: Gemma's RMSNorm, scaled by 1 + weight in fp32 before the one rounding
// Why: at batch 1 a decode step ran ~900 small aten ops; their dispatch, allocation and the
// extra passes over memory were a quarter of the step. Every op works row by row with the same
// instruction stream whatever the row count, so results stay batch-invariant.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "avx2_kernels.h"
#include "silu_rows.h"

namespace {

// slots as a long tensor of one cache slot per token, every slot checked against the cache's
// n_slots before anything is written (a refused call writes nothing): write_kv's and rotary_kv's.
at::Tensor checked_slots(const at::Tensor& slots, int64_t tokens, int64_t n_slots, const char* op) {
  auto idx = slots.to(at::kLong).contiguous();
  TORCH_CHECK(idx.dim() == 1 && idx.size(0) == tokens, op, ": one slot per token");
  const int64_t* sp = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < n_slots, op, ": slot ", sp[t], " outside the cache's ", n_slots);
  return idx;
}

}  // namespace

// AVX-512 (with bf16 conversions) for everything below, whatever -march=native says: the library
// must also build on CPUs without it (Zen 3), where tessera.kernels.fused() keeps the torch path.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace {

// 16 lanes at a time (AVX-512), a mask for the tail: the same instruction stream for every row.
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(at::BFloat16* p, __m512 v, __mmask16 m) {
  const __m256bh h = _mm512_cvtneps_pbh(v);  // round to nearest even, as torch's .to(bfloat16)
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<const __m256i&>(h));
}
// v rounded to the element type T (identity for float): where HF's bf16 code rounds, we round.
inline __m512 round16(__m512 v, const float*) { return v; }
inline __m512 round16(__m512 v, const at::BFloat16*) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h)), 16));
}

// Whether the AVX-512 code serves `dtype` here (else float32 takes fused_avx2.cpp's; anything
// else is refused, as tessera.kernels.fused() says).
bool avx512(at::ScalarType dtype) {
  static const bool bf16 = __builtin_cpu_supports("avx512bf16");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  TORCH_CHECK(bf16 || (avx2 && dtype == at::kFloat),
              "the fused ops need AVX-512 bf16, or AVX2 and FMA for float32 (tessera.kernels.fused() is False here)");
  return bf16;
}

constexpr int64_t kGrain = 16;  // rows per parallel task: small batches stay on one thread

// 1 / sqrt(mean of squares + eps) from 16 lanes of sums of squares, summed by a fixed tree (both
// norms below).
inline __m512 inv_rms(__m512 sq, int64_t d, float eps) {
  alignas(64) float part[16];
  _mm512_store_ps(part, sq);
  for (int step = 8; step > 0; step /= 2)
    for (int j = 0; j < step; ++j) part[j] += part[j + step];
  return _mm512_set1_ps(1.0f / std::sqrt(part[0] / static_cast<float>(d) + eps));
}

template <typename T>
void add_rms_norm_rows(const T* x, const T* res, const T* w, T* out, T* sum_out, int64_t rows, int64_t d,
                       float eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      T* o = out + r * d;
      T* s = sum_out ? sum_out + r * d : nullptr;
      // Lane j sums the squares of elements j, j + 16, ... in order; then a fixed tree.
      __m512 sq = _mm512_setzero_ps();
      for (int64_t i = 0; i < d; i += 16) {
        const __mmask16 m = tail_mask(d - i);
        __m512 v = load16(xr + i, m);
        if (res) {
          v = round16(_mm512_add_ps(v, load16(res + r * d + i, m)), xr);
          store16(s + i, v, m);
        }
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      const __m512 inv = inv_rms(sq, d, eps);
      const T* src = res ? s : xr;
      for (int64_t i = 0; i < d; i += 16) {
        const __mmask16 m = tail_mask(d - i);
        const __m512 normed = round16(_mm512_mul_ps(load16(src + i, m), inv), xr);
        store16(o + i, _mm512_mul_ps(normed, load16(w + i, m)), m);
      }
    }
  });
}

// x + residual (when given) then RMSNorm with weight. Returns (normed, x + residual); without a
// residual the second output is x itself.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  const bool wide = avx512(x.scalar_type());
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
      (wide ? add_rms_norm_rows<float> : tessera_avx2::add_rms_norm_rows)(x.data_ptr<float>(), has_res ? residual->data_ptr<float>() : nullptr,
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

// Gemma's RMSNorm row by row: x in float32, normalised, times `scale` (1 + weight, float32), rounded
// to x's dtype once (Gemma scales before rounding, Llama after: add_rms_norm). The squares summed
// as add_rms_norm sums them. 640-wide rows (Gemma 3 270M) in ~1 us against ~17 us for the torch
// ops of the module (rms_norm, mul, to: a decode step runs 108 of these norms).
template <typename T>
void gemma_rms_norm_rows(const T* x, const float* scale, T* out, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      T* o = out + r * d;
      __m512 sq = _mm512_setzero_ps();
      for (int64_t i = 0; i < d; i += 16) {
        const __m512 v = load16(xr + i, tail_mask(d - i));
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      const __m512 inv = inv_rms(sq, d, eps);
      for (int64_t i = 0; i < d; i += 16) {
        const __mmask16 m = tail_mask(d - i);
        store16(o + i, _mm512_mul_ps(_mm512_mul_ps(load16(xr + i, m), inv), load16(scale + i, m)), m);
      }
    }
  });
}

at::Tensor gemma_rms_norm(const at::Tensor& x, const at::Tensor& scale, double eps) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "gemma_rms_norm: needs AVX-512 BF16");
  TORCH_CHECK(x.is_contiguous() && scale.is_contiguous() && scale.scalar_type() == at::kFloat,
              "gemma_rms_norm: contiguous x and a contiguous float32 scale");
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  TORCH_CHECK(scale.numel() == d, "gemma_rms_norm: scale has ", scale.numel(), " elements, rows ", d);
  auto out = at::empty_like(x);
  AT_DISPATCH_SWITCH(x.scalar_type(), "gemma_rms_norm",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      gemma_rms_norm_rows(x.data_ptr<float>(), scale.data_ptr<float>(), out.data_ptr<float>(), rows, d,
                          static_cast<float>(eps));
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      gemma_rms_norm_rows(x.data_ptr<at::BFloat16>(), scale.data_ptr<float>(), out.data_ptr<at::BFloat16>(), rows, d,
                          static_cast<float>(eps));
    }));
  return out;
}

// One head's row rotated: o[i] and o[half + i] from x[i] and x[half + i] at the token's cos/sin.
template <typename T>
inline void rotate_head(const T* xr, const float* c, const float* s, T* o, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = tail_mask(half - i);
    // cos and sin in the model dtype, as the unfused path (and HF) uses them.
    const __m512 ci = round16(_mm512_maskz_loadu_ps(m, c + i), xr);
    const __m512 si = round16(_mm512_maskz_loadu_ps(m, s + i), xr);
    const __m512 x1 = load16(xr + i, m), x2 = load16(xr + half + i, m);
    store16(o + i, _mm512_fmsub_ps(x1, ci, _mm512_mul_ps(x2, si)), m);
    store16(o + half + i, _mm512_fmadd_ps(x2, ci, _mm512_mul_ps(x1, si)), m);
  }
}

template <typename T>
void rotary_rows(const T* x, int64_t row_stride, const float* cos, const float* sin, const int64_t* pos, T* out,
                 int64_t tokens, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h)
        rotate_head(x + t * row_stride + h * d, cos + pos[t] * half, sin + pos[t] * half, out + (t * heads + h) * d,
                    half);
  });
}

void check_rotary_args(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                       int64_t heads, int64_t d) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= heads * d, "rotary: x must be [T, >= heads * d]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(1) == d / 2, "rotary: cos/sin must be fp32 [positions, d / 2]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "rotary: positions must be long");
  TORCH_CHECK(positions.numel() == x.size(0), "rotary: one position per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary: position ", pos[t], " is past the table");
}

// Rotate the first `heads` heads of each token's row of x ([T, >= heads * d], rows may be
// strided: a view into the fused qkv output) at positions pos; returns [T, heads, d].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                  int64_t heads, int64_t d) {
  check_rotary_args(x, cos, sin, positions, heads, d);
  const bool wide = avx512(x.scalar_type());
  const int64_t tokens = x.size(0);
  auto out = at::empty({tokens, heads, d}, x.options());
  AT_DISPATCH_SWITCH(x.scalar_type(), "rotary",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      (wide ? rotary_rows<float> : tessera_avx2::rotary_rows)(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
                  positions.data_ptr<int64_t>(), out.data_ptr<float>(), tokens, heads, d);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      rotary_rows(x.data_ptr<at::BFloat16>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
                  positions.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), tokens, heads, d);
    }));
  return out;
}

template <typename T>
void rotary_kv_rows(const T* x, int64_t row_stride, const float* cos, const float* sin, const int64_t* pos,
                    const int64_t* slots, T* q_out, T* k_cache, T* v_cache, int64_t tokens, int64_t heads,
                    int64_t kv_heads, int64_t d) {
  const int64_t half = d / 2, kv_row = kv_heads * d;
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = x + t * row_stride;
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) rotate_head(xr + h * d, c, s, q_out + (t * heads + h) * d, half);
      T* k_dst = k_cache + slots[t] * kv_row;
      for (int64_t h = 0; h < kv_heads; ++h) rotate_head(xr + (heads + h) * d, c, s, k_dst + h * d, half);
      std::memcpy(v_cache + slots[t] * kv_row, xr + (heads + kv_heads) * d, sizeof(T) * kv_row);
    }
  });
}

// rotary and write_kv of a layer's fused qkv output ([T, >= (heads + 2 kv_heads) * d], rows may be
// strided) in one pass: q rotated into the result [T, heads, d], k rotated straight into
// k_cache[slots[t]] and v copied into v_cache[slots[t]] (caches [S, kv_heads, d]). The same
// arithmetic as rotary then write_kv, so the same bits. Why: at a 32-sequence decode step the two
// calls took ~44 us a layer (Intel Xeon model 167), the cache write on one thread, much of it
// the first touch of fresh cache lines and pages; here both threads share the tokens.
at::Tensor rotary_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                     int64_t heads, int64_t kv_heads, int64_t d, at::Tensor& k_cache, at::Tensor& v_cache,
                     const at::Tensor& slots) {
  check_rotary_args(qkv, cos, sin, positions, heads + 2 * kv_heads, d);
  const bool wide = avx512(qkv.scalar_type());
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.size(1) == kv_heads &&
              k_cache.size(2) == d && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "rotary_kv: caches must be contiguous [S, kv_heads, d]");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "rotary_kv: the caches must have qkv's dtype");
  const int64_t tokens = qkv.size(0);
  const auto idx = checked_slots(slots, tokens, k_cache.size(0), "rotary_kv");
  const int64_t* sp = idx.data_ptr<int64_t>();
  auto q = at::empty({tokens, heads, d}, qkv.options());
  AT_DISPATCH_SWITCH(qkv.scalar_type(), "rotary_kv",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      (wide ? rotary_kv_rows<float> : tessera_avx2::rotary_kv_rows)(qkv.data_ptr<float>(), qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
                     positions.data_ptr<int64_t>(), sp, q.data_ptr<float>(), k_cache.data_ptr<float>(),
                     v_cache.data_ptr<float>(), tokens, heads, kv_heads, d);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using B = at::BFloat16;
      rotary_kv_rows(qkv.data_ptr<B>(), qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
                     positions.data_ptr<int64_t>(), sp, q.data_ptr<B>(), k_cache.data_ptr<B>(), v_cache.data_ptr<B>(),
                     tokens, heads, kv_heads, d);
    }));
  return q;
}

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      for (int64_t i = 0; i < inter; i += 16) {
        const __mmask16 m = tail_mask(inter - i);
        const __m512 act = round16(silu16(load16(g + i, m)), g);  // silu rounds, then the product
        store16(o + i, _mm512_mul_ps(act, load16(u + i, m)), m);
      }
    }
  });
}

// silu(gate_up[:, :inter]) * gate_up[:, inter:] -> [T, inter].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  const bool wide = avx512(gate_up.scalar_type());
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "silu_mul: contiguous [T, 2 * inter] only");
  const int64_t inter = gate_up.size(-1) / 2, rows = inter ? gate_up.numel() / (2 * inter) : 0;
  auto shape = gate_up.sizes().vec();
  shape.back() = inter;
  auto out = at::empty(shape, gate_up.options());
  AT_DISPATCH_SWITCH(gate_up.scalar_type(), "silu_mul",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      (wide ? silu_mul_rows<float> : tessera_avx2::silu_mul_rows)(gate_up.data_ptr<float>(), out.data_ptr<float>(),
                                                                   rows, inter);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      silu_mul_rows(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, inter);
    }));
  return out;
}

}  // namespace

#pragma GCC pop_options

namespace {

// k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t] for every token: the paged cache write of a
// layer in one call (two index_copy_ calls cost ~30 us each at a 32-sequence step, nearly all of
// it dispatch). k and v are [T, Hkv, d] with each token's row contiguous (views into the fused
// qkv output are); the caches [slots, Hkv, d] contiguous. Plain copies: no CPU feature needed.
constexpr int64_t kWriteGrain = 64;  // tokens per task

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() &&
              k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(2), "write_kv: k, v [T, Hkv, d]; caches [S, Hkv, d]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type() &&
              k.scalar_type() == v.scalar_type(), "write_kv: k, v and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "write_kv: caches must be contiguous");
  const int64_t row = k.size(1) * k.size(2);
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "write_kv: each token's [Hkv, d] must be contiguous");
  const auto idx = checked_slots(slots, k.size(0), k_cache.size(0), "write_kv");
  const int64_t* sp = idx.data_ptr<int64_t>();
  const int64_t elt = k.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  // A prefill's rows in parallel: its slots are fresh cache lines (often fresh pages, faulted in
  // on this first write), so a 256-token layer took ~70 us on one thread (Intel Xeon model 167).
  // A decode's few rows stay on the calling thread (one task below kWriteGrain).
  at::parallel_for(0, k.size(0), kWriteGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + sp[t] * row * elt, kp + t * k.stride(0) * elt, row * elt);
      std::memcpy(vc + sp[t] * row * elt, vp + t * v.stride(0) * elt, row * elt);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera_inv, m) {
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("gemma_rms_norm(Tensor x, Tensor scale, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, Tensor positions, int heads, int head_dim) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, int heads, int kv_heads, int head_dim, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(tessera_inv, CPU, m) {
  m.impl("write_kv", &write_kv);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("gemma_rms_norm", &gemma_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_kv", &rotary_kv);
}
