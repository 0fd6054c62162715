// gemv.cpp's weight-only quantized GEMVs for CPUs with AVX2 + FMA and no AVX-512 (Zen 3): the
// same ops (tessera_gemv::{int8, q8_0, int4pack}) with the same schemas, formats and arithmetic
// kind (float32 FMA over weights dequantized in registers, no activation rounding), on 8-lane
// vectors; tessera/quant/native_gemv.py builds this file instead of gemv.cpp on such CPUs. The
// int4 layout is torch's on AVX2: 32-row blocks (k-major, byte j of column i holds row j in its
// low nibble and row j + 16 in its high one), a tail of rows in pairs.
//
// Why: without them a GGUF model's decode on Zen 3 ran torch's int4 kernel on bf16 activations
// and dequantized its Q8_0 lm_head to a float tile at every step (a third of the step).
//
// Both builds also carry tessera_gemv::{q4x8, q8x8} (and their _logits and _rows forms; gemv_x8.h), the GGUF mode's Q4_0/Q4_1 and
// Q8_0 on int8-quantized activations (llama.cpp's arithmetic, any row count; see
// tessera/quant/gguf_int8_activations.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "argmax_rows.h"  // the lm_head forms' greedy ids (gemv_x8.h), as the other libraries' kernels

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kBlockRows = 32;  // torch's int4 row block on AVX2

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline __m256 i8x8(const int8_t* p) {  // 8 int8 -> 8 float
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void check_x(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "tessera_gemv: x must be contiguous float32 [M, ", k, "]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "tessera_gemv: x has ", x.size(0), " rows; at most ",
              kMaxRows);
}

template <int M>
void dispatch_rows(int64_t m, auto&& fn) {
  if constexpr (M > kMaxRows) {
    TORCH_CHECK(false, "tessera_gemv: too many rows");
  } else if (m == M) {
    fn.template operator()<M>();
  } else {
    dispatch_rows<M + 1>(m, fn);
  }
}

// Weight rows walked together: R rows' independent chains per activation row hide the FMA latency.
constexpr int rows_together(int m) { return m == 1 ? 4 : m == 2 ? 2 : 1; }

// ---- int8 with a scale per row, and GGUF Q8_0 (a float16 d per 32): one weight row of 32 k
// at a time, 4 vectors, then per activation row a block dot (Q8_0: times d) into an accumulator.
template <int M, int R, bool Blocks>
void i8_tile(const float* x, const int8_t* q, const float* scale, const uint16_t* d, float* y, int64_t k, int64_t n,
             int64_t r) {
  const int64_t nb = k / 32;
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < R; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < R; ++j) {
      const int8_t* wb = q + (r + j) * k + b * 32;
      _mm_prefetch(reinterpret_cast<const char*>(wb) + 1024, _MM_HINT_T0);
      const __m256 w0 = i8x8(wb), w1 = i8x8(wb + 8), w2 = i8x8(wb + 16), w3 = i8x8(wb + 24);
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * k + b * 32;
        __m256 blk = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));
        blk = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), blk);
        blk = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), blk);
        blk = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), blk);
        if constexpr (Blocks) {
          acc[m][j] = _mm256_fmadd_ps(blk, _mm256_set1_ps(_cvtsh_ss(d[(r + j) * nb + b])), acc[m][j]);
        } else {
          acc[m][j] = _mm256_add_ps(blk, acc[m][j]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < R; ++j) {
      float s = hsum8(acc[m][j]);
      if constexpr (!Blocks) {
        for (int64_t t = nb * 32; t < k; ++t) s += float(q[(r + j) * k + t]) * x[m * k + t];
        s *= scale[r + j];
      }
      y[m * n + r + j] = s;
    }
}

template <int M, bool Blocks>
void i8_rows(const float* x, const int8_t* q, const float* scale, const uint16_t* d, float* y, int64_t k, int64_t n,
             int64_t r0, int64_t r1) {
  constexpr int R = rows_together(M);
  int64_t r = r0;
  for (; r + R <= r1; r += R) i8_tile<M, R, Blocks>(x, q, scale, d, y, k, n, r);
  for (; r < r1; ++r) i8_tile<M, 1, Blocks>(x, q, scale, d, y, k, n, r);
}

// ---- int4, torch's AVX2 packed layout: one 32-row block, acc[m][4] its 32 outputs of row m.
// Per group: sum_i q[i] x[i] in registers, then acc += that * s + (z - 8 s) * sum_i x[i].
template <int M>
void int4_block(const float* x, const float* xsum, const uint8_t* p, const uint16_t* sz, float* y, int64_t k,
                int64_t n, int64_t group, int64_t row0) {
  const int64_t groups = k / group;
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 aq[M][4];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 4; ++j) aq[m][j] = _mm256_setzero_ps();
    for (int64_t i = g * group; i < (g + 1) * group; ++i) {
      const uint8_t* b = p + i * (kBlockRows / 2);
      if ((i & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(b) + 1024, _MM_HINT_T0);
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
      const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
      const __m256 q[4] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * k + i);
        for (int j = 0; j < 4; ++j) aq[m][j] = _mm256_fmadd_ps(q[j], xv, aq[m][j]);
      }
    }
    // scales_zeros[g, row, (s, z)] for the block's 32 rows, as 4 vectors of s and of z - 8 s.
    alignas(32) float s[kBlockRows], off[kBlockRows];
    const uint16_t* pair = sz + (g * n + row0) * 2;
    for (int64_t t = 0; t < kBlockRows; ++t) {
      s[t] = bf16_to_f32(pair[2 * t]);
      off[t] = bf16_to_f32(pair[2 * t + 1]) - 8.f * s[t];
    }
    for (int j = 0; j < 4; ++j) {
      const __m256 sv = _mm256_load_ps(s + 8 * j), ov = _mm256_load_ps(off + 8 * j);
      for (int m = 0; m < M; ++m) {
        acc[m][j] = _mm256_fmadd_ps(aq[m][j], sv, acc[m][j]);
        acc[m][j] = _mm256_fmadd_ps(ov, _mm256_set1_ps(xsum[m * groups + g]), acc[m][j]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y + m * n + row0 + 8 * j, acc[m][j]);
}

// The rows past the last whole block, stored in pairs (byte i of column k: row 2i low, 2i + 1 high).
void int4_tail(const float* x, int64_t mrows, const uint8_t* p, const uint16_t* sz, float* y, int64_t k, int64_t n,
               int64_t group, int64_t row0, int64_t rows) {
  for (int64_t m = 0; m < mrows; ++m)
    for (int64_t r = 0; r < rows; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < k / group; ++g) {
        const float s = bf16_to_f32(sz[(g * n + row0 + r) * 2]), z = bf16_to_f32(sz[(g * n + row0 + r) * 2 + 1]);
        float part = 0.f;
        for (int64_t i = g * group; i < (g + 1) * group; ++i) {
          const uint8_t byte = p[i * (rows / 2) + r / 2];
          const float q = float((r & 1) ? (byte >> 4) : (byte & 15));
          part += ((q - 8.f) * s + z) * x[m * k + i];
        }
        total += part;
      }
      y[m * n + row0 + r] = total;
    }
}

at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  const int64_t n = q.size(0), k = q.size(1), m = x.size(0);
  check_x(x, k);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "tessera_gemv.int8: q must be contiguous int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == n, "tessera_gemv.int8: scale must be float32 [N]");
  auto y = at::empty({m, n}, x.options());
  const float *xp = x.data_ptr<float>(), *sp = scale.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  dispatch_rows<1>(m, [&]<int M>() {
    at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) { i8_rows<M, false>(xp, qp, sp, nullptr, yp, k, n, r0, r1); });
  });
  return y;
}

at::Tensor gemv_q8_0(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d) {
  const int64_t n = codes.size(0), k = codes.size(1), m = x.size(0);
  check_x(x, k);
  TORCH_CHECK(k % 32 == 0, "tessera_gemv.q8_0: K must be a multiple of 32");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous(), "tessera_gemv.q8_0: codes must be int8");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == n * k / 32,
              "tessera_gemv.q8_0: d must be contiguous float16 [N, K / 32]");
  auto y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  dispatch_rows<1>(m, [&]<int M>() {
    at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) { i8_rows<M, true>(xp, cp, nullptr, dp, yp, k, n, r0, r1); });
  });
  return y;
}

at::Tensor gemv_int4pack(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                         int64_t group) {
  const int64_t groups = scales_zeros.size(0), n = scales_zeros.size(1), k = groups * group, m = x.size(0);
  check_x(x, k);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == n * k / 2,
              "tessera_gemv.int4pack: packed must be contiguous uint8 with N * K / 2 bytes");
  TORCH_CHECK(scales_zeros.scalar_type() == at::kBFloat16 && scales_zeros.is_contiguous() &&
                  scales_zeros.size(2) == 2, "tessera_gemv.int4pack: scales_zeros must be bfloat16 [K / g, N, 2]");
  TORCH_CHECK(n % 2 == 0, "tessera_gemv.int4pack: N must be even");
  auto y = at::empty({m, n}, x.options());
  std::vector<float> xsum(m * groups, 0.f);  // per group, for the zero points
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < m * groups; ++i)
    for (int64_t t = 0; t < group; ++t) xsum[i] += xp[i * group + t];
  const float* xs = xsum.data();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint16_t* szp = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const int64_t blocks = n / kBlockRows, tail = n - blocks * kBlockRows;
  dispatch_rows<1>(m, [&]<int M>() {
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        int4_block<M>(xp, xs, pp + b * kBlockRows * k / 2, szp, yp, k, n, group, b * kBlockRows);
    });
  });
  if (tail) int4_tail(xp, m, pp + blocks * kBlockRows * k / 2, szp, yp, k, n, group, blocks * kBlockRows, tail);
  return y;
}

#include "gemv_x8.h"

}  // namespace

#pragma GCC pop_options

TORCH_LIBRARY(tessera_gemv, m) {
  m.def("int8(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("q8_0(Tensor x, Tensor codes, Tensor d) -> Tensor");
  m.def("int4pack(Tensor x, Tensor packed, Tensor scales_zeros, int group) -> Tensor");
  define_x8_ops(m);  // gemv_x8.h's
}

TORCH_LIBRARY_IMPL(tessera_gemv, CPU, m) {
  m.impl("int8", &gemv_int8);
  m.impl("q8_0", &gemv_q8_0);
  m.impl("int4pack", &gemv_int4pack);
  impl_x8_ops(m);
}
