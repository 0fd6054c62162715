// Weight-only quantized GEMV for a few activation rows (decode), AVX-512, threads over output rows.
//
// Each kernel reads its weight once in its stored format and multiplies it with up to
// kMaxRows float32 activation rows at a time, dequantizing in registers (float32 FMA, no int8
// activation rounding, so results equal x @ dequantize(W).T up to float32 summation order).
// Registered as torch ops tessera_gemv::{int8, q8_0, int4pack}, and {q4x8, q8x8} (with their
// lm_head forms q4x8_logits, q8x8_logits and embedding lookups q4x8_rows, q8x8_rows) from gemv_x8.h
// (GGUF blocks on int8 activations); the loader is tessera/quant/native_gemv.py, which falls back
// to the torch kernels when this fails to build.
//
// Formats (see the Python owners for the details):
//   int8     q int8 [N, K], scale f32 [N]:                    W = scale[n] * q            (quant/int8.py)
//   q8_0     codes int8 [N, K], d f16 [N, K / 32]:             W = d[n, k / 32] * q        (gguf Q8_0)
//   int4pack packed uint8 (torch's int4 CPU layout, 64-row blocks, k-major, row j low nibble,
//            row j + 32 high nibble), scales_zeros bf16 [K / g, N, 2] = (s, z): W = (q - 8) s + z

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

namespace {

constexpr int64_t kMaxRows = 8;

inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __m512 bf16x16_to_f32(const uint16_t* p) {  // 16 bf16 -> 16 float
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

void check_x(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "tessera_gemv: x must be contiguous float32 [M, ", k, "]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "tessera_gemv: x has ", x.size(0),
              " rows; at most ", kMaxRows);
}

// The int8 and Q8_0 kernels walk R rows together, so that M * R independent FMA chains hide
// the FMA latency (one row alone is a single dependent chain: a quarter of the FMA rate).
// Software prefetch this many bytes ahead of the weight bytes being read (PREFETCH_BYTES and
// PREFETCH_HINT come from native_gemv.py): one thread went from 6.6 to 7.9 GB/s of int8 weights.
constexpr int64_t kPrefetchBytes = PREFETCH_BYTES;

// Prefetch the `bytes` bytes that lie kPrefetchBytes past `at`, one line per 64 bytes.
inline void prefetch_ahead(const void* at, int64_t bytes) {
  const char* p = static_cast<const char*>(at) + kPrefetchBytes;
  for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(p + c, PREFETCH_HINT);
}

constexpr int rows_together(int m) { return m == 1 ? 8 : m == 2 ? 4 : m <= 4 ? 2 : 1; }

// ---- int8, per-row scale -------------------------------------------------------------------

template <int M, int R>
void int8_tile(const float* x, const int8_t* q, const float* scale, float* y, int64_t k, int64_t n, int64_t r) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < R; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    if ((i & 63) == 0) prefetch_ahead(q + r * k + i * R, 64 * R);  // the next R*64 bytes of this tile's span
    __m512 wv[R];
    for (int j = 0; j < R; ++j)
      wv[j] = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (r + j) * k + i))));
    for (int m = 0; m < M; ++m) {
      __m512 xv = _mm512_loadu_ps(x + m * k + i);
      for (int j = 0; j < R; ++j) acc[m][j] = _mm512_fmadd_ps(wv[j], xv, acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < R; ++j) {
      float s = _mm512_reduce_add_ps(acc[m][j]);
      for (int64_t t = i; t < k; ++t) s += float(q[(r + j) * k + t]) * x[m * k + t];
      y[m * n + r + j] = s * scale[r + j];
    }
}

template <int M>
void int8_rows(const float* x, const int8_t* q, const float* scale, float* y, int64_t k, int64_t n,
               int64_t r0, int64_t r1) {
  constexpr int R = rows_together(M);
  int64_t r = r0;
  for (; r + R <= r1; r += R) int8_tile<M, R>(x, q, scale, y, k, n, r);
  for (; r < r1; ++r) int8_tile<M, 1>(x, q, scale, y, k, n, r);
}

// ---- GGUF Q8_0: int8 codes, a float16 scale per 32 ------------------------------------------

template <int M, int R>
void q8_0_tile(const float* x, const int8_t* codes, const uint16_t* d, float* y, int64_t k, int64_t n, int64_t r) {
  const int64_t nb = k / 32;
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < R; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if ((b & 1) == 0) prefetch_ahead(codes + r * k + b * 32 * R, 64 * R);
    __m512 w0[R], w1[R], db[R];
    for (int j = 0; j < R; ++j) {
      const int8_t* wb = codes + (r + j) * k + b * 32;
      w0[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb))));
      w1[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 16))));
      db[j] = _mm512_set1_ps(f16_to_f32(d[(r + j) * nb + b]));
    }
    for (int m = 0; m < M; ++m) {
      const float* xb = x + m * k + b * 32;
      __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      for (int j = 0; j < R; ++j) {
        __m512 blk = _mm512_fmadd_ps(w1[j], x1, _mm512_mul_ps(w0[j], x0));
        acc[m][j] = _mm512_fmadd_ps(blk, db[j], acc[m][j]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < R; ++j) y[m * n + r + j] = _mm512_reduce_add_ps(acc[m][j]);
}

template <int M>
void q8_0_rows(const float* x, const int8_t* codes, const uint16_t* d, float* y, int64_t k, int64_t n,
               int64_t r0, int64_t r1) {
  constexpr int R = rows_together(M);
  int64_t r = r0;
  for (; r + R <= r1; r += R) q8_0_tile<M, R>(x, codes, d, y, k, n, r);
  for (; r < r1; ++r) q8_0_tile<M, 1>(x, codes, d, y, k, n, r);
}

// ---- int4 in torch's packed CPU layout ------------------------------------------------------

// One 64-row block: acc[m][4] collects the 64 outputs of activation row m.
template <int M>
void int4_block(const float* x, const float* xsum, const uint8_t* p, const uint16_t* sz, float* y, int64_t k,
                int64_t n, int64_t group, int64_t row0) {
  const int64_t groups = k / group;
  const __m512i low = _mm512_set1_epi32(0x0F);
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 aq[M][4];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 4; ++j) aq[m][j] = _mm512_setzero_ps();
    for (int64_t i = g * group; i < (g + 1) * group; ++i) {
      const uint8_t* b = p + i * 32;
      if ((i & 1) == 0) prefetch_ahead(b, 64);  // 32 bytes: rows 0..31 low nibbles, rows 32..63 high
      __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
      __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16)));
      __m512 q[4] = {_mm512_cvtepi32_ps(_mm512_and_si512(v0, low)), _mm512_cvtepi32_ps(_mm512_and_si512(v1, low)),
                     _mm512_cvtepi32_ps(_mm512_srli_epi32(v0, 4)), _mm512_cvtepi32_ps(_mm512_srli_epi32(v1, 4))};
      for (int m = 0; m < M; ++m) {
        __m512 xv = _mm512_set1_ps(x[m * k + i]);
        for (int j = 0; j < 4; ++j) aq[m][j] = _mm512_fmadd_ps(q[j], xv, aq[m][j]);
      }
    }
    // scales_zeros[g, row, (s, z)]: 64 rows = 128 bf16; split the pairs into s and z vectors.
    const uint16_t* s = sz + (g * n + row0) * 2;
    for (int j = 0; j < 4; ++j) {
      __m512 lo = bf16x16_to_f32(s + j * 32), hi = bf16x16_to_f32(s + j * 32 + 16);  // (s,z) x 8 each
      const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
      const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
      __m512 sc = _mm512_permutex2var_ps(lo, even, hi);
      __m512 zp = _mm512_permutex2var_ps(lo, odd, hi);
      __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), sc, zp);  // z - 8 s
      for (int m = 0; m < M; ++m) {
        acc[m][j] = _mm512_fmadd_ps(aq[m][j], sc, acc[m][j]);
        acc[m][j] = _mm512_fmadd_ps(off, _mm512_set1_ps(xsum[m * groups + g]), acc[m][j]);
      }
    }
  }
  // q[0] = rows 0..15, q[1] = rows 16..31, q[2] = rows 32..47, q[3] = rows 48..63.
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + m * n + row0 + j * 16, acc[m][j]);
}

// A tail block of rows stored in pairs (byte i at column k: row 2i low nibble, row 2i + 1 high).
void int4_tail(const float* x, int64_t mrows, const uint8_t* p, const uint16_t* sz, float* y, int64_t k,
               int64_t n, int64_t group, int64_t row0, int64_t rows) {
  for (int64_t m = 0; m < mrows; ++m)
    for (int64_t r = 0; r < rows; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < k / group; ++g) {
        float s = bf16_to_f32(sz[(g * n + row0 + r) * 2]), z = bf16_to_f32(sz[(g * n + row0 + r) * 2 + 1]);
        float part = 0.f;
        for (int64_t i = g * group; i < (g + 1) * group; ++i) {
          uint8_t byte = p[i * (rows / 2) + r / 2];
          float q = float((r & 1) ? (byte >> 4) : (byte & 15));
          part += ((q - 8.f) * s + z) * x[m * k + i];
        }
        total += part;
      }
      y[m * n + row0 + r] = total;
    }
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
    at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) { int8_rows<M>(xp, qp, sp, yp, k, n, r0, r1); });
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
    at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) { q8_0_rows<M>(xp, cp, dp, yp, k, n, r0, r1); });
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
  TORCH_CHECK(n % 16 == 0, "tessera_gemv.int4pack: N must be a multiple of 16");
  auto y = at::empty({m, n}, x.options());
  std::vector<float> xsum(m * groups, 0.f);  // per group, for the zero points
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < m * groups; ++i)
    for (int64_t t = 0; t < group; ++t) xsum[i] += xp[i * group + t];
  const float* xs = xsum.data();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint16_t* szp = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const int64_t blocks = n / 64;
  dispatch_rows<1>(m, [&]<int M>() {
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) int4_block<M>(xp, xs, pp + b * 64 * k / 2, szp, yp, k, n, group, b * 64);
    });
  });
  if (n > blocks * 64)
    int4_tail(xp, m, pp + blocks * 64 * k / 2, szp, yp, k, n, group, blocks * 64, n - blocks * 64);
  return y;
}

#include "gemv_x8.h"

}  // namespace

TORCH_LIBRARY(tessera_gemv, lib) {
  lib.def("int8(Tensor x, Tensor q, Tensor scale) -> Tensor");
  lib.def("q8_0(Tensor x, Tensor codes, Tensor d) -> Tensor");
  lib.def("int4pack(Tensor x, Tensor packed, Tensor scales_zeros, int group) -> Tensor");
  define_x8_ops(lib);  // gemv_x8.h's
}

TORCH_LIBRARY_IMPL(tessera_gemv, CPU, lib) {
  lib.impl("int8", &gemv_int8);
  lib.impl("q8_0", &gemv_q8_0);
  lib.impl("int4pack", &gemv_int4pack);
  impl_x8_ops(lib);
}
