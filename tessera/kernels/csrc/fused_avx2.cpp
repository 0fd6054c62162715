// The fused elementwise ops of fused_ops.cpp for float32 on CPUs with AVX2 and FMA but no
// AVX-512 BF16 (Zen 3, older Intel): add_rms_norm, rotary (and rotary_kv's rotation) and
// silu_mul, each a 16-lane step as two 8-lane halves, with the same IEEE operation per lane
// and the same sums in the same order as the AVX-512 code (the sum of squares is 16 lanes in
// element order, then the fixed 8 + 4 + 2 + 1 tree; exp is the same polynomial), so a row's
// bits are those of the AVX-512 ops. fused_ops.cpp calls these where the CPU lacks AVX-512 BF16.
//
// Why: on Zen 3 (float32 by default) the module path ran each of these as 5-10 aten ops, and
// without them the native decoder stack (one call a step) could not run there at all.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "avx2_kernels.h"
#include "silu_rows.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace {

constexpr int64_t kGrain = 16;  // rows per parallel task, as fused_ops.cpp

// Lanes [0, left) of 8 (left may exceed 8 or be negative). Whole vectors take plain loads and
// stores; only a row's tail is masked (maskload reads zeros, maskstore skips the rest). VMASKMOVPS
// to memory is microcoded on AMD Zen, about a dozen cycles a store: with every vector masked, a
// 576-wide add_rms_norm row took ~1900 cycles on Zen 3 (prefill 512 x 576: 0.39 ms a call).
struct Lanes8 {
  __m256i mask;
  bool whole;
};
inline Lanes8 lanes8(int64_t left) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int n = static_cast<int>(left < 8 ? (left < 0 ? 0 : left) : 8);
  return {_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane), n == 8};
}
inline __m256 load8(const float* p, Lanes8 m) { return m.whole ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, m.mask); }
inline void store8(float* p, __m256 v, Lanes8 m) {
  if (m.whole) {
    _mm256_storeu_ps(p, v);
  } else {
    _mm256_maskstore_ps(p, m.mask, v);
  }
}

inline void rotate_head(const float* xr, const float* c, const float* s, float* o, int64_t half) {
  for (int64_t i = 0; i < half; i += 8) {
    const Lanes8 m = lanes8(half - i);
    const __m256 ci = load8(c + i, m), si = load8(s + i, m);
    const __m256 x1 = load8(xr + i, m), x2 = load8(xr + half + i, m);
    store8(o + i, _mm256_fmsub_ps(x1, ci, _mm256_mul_ps(x2, si)), m);
    store8(o + half + i, _mm256_fmadd_ps(x2, ci, _mm256_mul_ps(x1, si)), m);
  }
}

}  // namespace

namespace tessera_avx2 {

void add_rms_norm_rows(const float* x, const float* res, const float* w, float* out, float* sum_out, int64_t rows,
                       int64_t d, float eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * d;
      float* o = out + r * d;
      float* s = sum_out ? sum_out + r * d : nullptr;
      // Lanes 0-7 and 8-15 of the AVX-512 code's 16: element i adds to lane i % 16.
      __m256 sq[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t i = 0; i < d; i += 16)
        for (int hh = 0; hh < 2; ++hh) {
          const int64_t at = i + 8 * hh;
          const Lanes8 m = lanes8(d - at);
          __m256 v = load8(xr + at, m);
          if (res) {
            v = _mm256_add_ps(v, load8(res + r * d + at, m));
            store8(s + at, v, m);
          }
          sq[hh] = _mm256_fmadd_ps(v, v, sq[hh]);
        }
      alignas(32) float part[16];
      _mm256_store_ps(part, sq[0]);
      _mm256_store_ps(part + 8, sq[1]);
      for (int step = 8; step > 0; step /= 2)
        for (int j = 0; j < step; ++j) part[j] += part[j + step];
      const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(part[0] / static_cast<float>(d) + eps));
      const float* src = res ? s : xr;
      for (int64_t i = 0; i < d; i += 8) {
        const Lanes8 m = lanes8(d - i);
        store8(o + i, _mm256_mul_ps(_mm256_mul_ps(load8(src + i, m), inv), load8(w + i, m)), m);
      }
    }
  });
}

void rotary_rows(const float* x, int64_t row_stride, const float* cos, const float* sin, const int64_t* pos,
                 float* out, int64_t tokens, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h)
        rotate_head(x + t * row_stride + h * d, cos + pos[t] * half, sin + pos[t] * half, out + (t * heads + h) * d,
                    half);
  });
}

void rotary_kv_rows(const float* x, int64_t row_stride, const float* cos, const float* sin, const int64_t* pos,
                    const int64_t* slots, float* q_out, float* k_cache, float* v_cache, int64_t tokens, int64_t heads,
                    int64_t kv_heads, int64_t d) {
  const int64_t half = d / 2, kv_row = kv_heads * d;
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = x + t * row_stride;
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) rotate_head(xr + h * d, c, s, q_out + (t * heads + h) * d, half);
      float* k_dst = k_cache + slots[t] * kv_row;
      for (int64_t h = 0; h < kv_heads; ++h) rotate_head(xr + (heads + h) * d, c, s, k_dst + h * d, half);
      std::memcpy(v_cache + slots[t] * kv_row, xr + (heads + kv_heads) * d, sizeof(float) * kv_row);
    }
  });
}

void silu_mul_rows(const float* gu, float* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gu + r * 2 * inter;
      const float* u = g + inter;
      float* o = out + r * inter;
      for (int64_t i = 0; i < inter; i += 8) {
        const Lanes8 m = lanes8(inter - i);
        store8(o + i, _mm256_mul_ps(silu8(load8(g + i, m)), load8(u + i, m)), m);
      }
    }
  });
}

}  // namespace tessera_avx2

#pragma GCC pop_options
