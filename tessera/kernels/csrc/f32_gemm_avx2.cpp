// linear_f32's GEMM for CPUs with AVX2 + FMA and no AVX-512 (Zen 3): register tiles of up to 6
// rows x 16 columns (12 accumulators of the 16 ymm registers), each output a fused multiply-add
// chain over k in order from 0, then + bias (or + 0: -0 stores as +0), exactly the portable
// loop's arithmetic, so a row's result is the same alone, in any batch and on any machine.
//
// Why: the portable loop keeps 4 rows x 64 columns of accumulators, 32 ymm registers on AVX2:
// GCC spilled them and the kernel ran at ~80 GFLOP/s at 32 and 256 rows (MKL: 100 and 170).
//
// The weight is packed in panels of 64 columns, [np / 64, k, 64]: a panel is contiguous, so a
// decode call streams each thread's share of the weights in order, and a prefill call sweeps all
// its row tiles over one panel while it sits in L2.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "avx2_kernels.h"
#include "silu_rows.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace {

constexpr int kPanel = 64;  // columns per packed panel

// The weight lines a thread reads next, handed to the prefetcher one per k by the tiles of more
// than one row (see f32_gemm).
struct Ahead {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t every = 0;  // a line at the k steps where (k & every) == 0 (every + 1 a power of two)
};

// What a tile stores. kPlain: its columns as they are. A gate_up weight packed in pairs
// (tessera/kernels/linear.py: 8 gate rows then the same 8 up rows, in turn) gives even vectors of
// gate and odd vectors of up columns: kPairsSplit stores them to out's gate and up halves (the
// plain [M, 2 x inter] output), kPairsSilu stores silu(gate) * up (silu_mul of that output).
enum Store { kPlain, kPairsSplit, kPairsSilu };

// A tile's accumulators to out (+ bias; see Store).
template <int R, int V, Store S>
inline void store(__m256 (&acc)[R][V], const float* bias, float* out, int64_t ldo, int cols, const float* up_bias,
                  int64_t up_off) {
  if constexpr (S != kPlain) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < V / 2; ++j) {
        const __m256 g = _mm256_add_ps(acc[r][2 * j], bias ? _mm256_loadu_ps(bias + 8 * j) : _mm256_setzero_ps());
        const __m256 u = _mm256_add_ps(acc[r][2 * j + 1], bias ? _mm256_loadu_ps(up_bias + 8 * j) : _mm256_setzero_ps());
        if constexpr (S == kPairsSilu) {
          _mm256_storeu_ps(out + r * ldo + 8 * j, _mm256_mul_ps(silu8(g), u));
        } else {
          _mm256_storeu_ps(out + r * ldo + 8 * j, g);
          _mm256_storeu_ps(out + r * ldo + up_off + 8 * j, u);
        }
      }
    return;
  }
  // Full tiles store straight from the registers (+ bias, or + 0 as the scalar path adds it): the
  // scalar copy below cost ~2% of a 512-row prefill linear (Zen 3, same process, alternating).
  if (cols >= 8 * V) {
    __m256 bv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) bv[v] = bias ? _mm256_loadu_ps(bias + 8 * v) : _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) _mm256_storeu_ps(out + r * ldo + 8 * v, _mm256_add_ps(acc[r][v], bv[v]));
    return;
  }
  // Out of the registers with constant indices only (a variable index into acc put it on the
  // stack, stored at every k), then to the output's valid columns.
  alignas(32) float res[R][8 * V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) _mm256_store_ps(res[r] + 8 * v, acc[r][v]);
  const int valid = std::min(cols, 8 * V);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < valid; ++c) out[r * ldo + c] = res[r][c] + (bias ? bias[c] : 0.f);
}

// The weights a tile reads: float32 panels [np / 64, k, 64], or a GGUF file's own blocks of the
// same W in panel order (tessera/quant/gguf_f32_blocks.py), 32 k of a panel's 64 columns a block:
//   kQ4, 1280 bytes: d, m float16 [64], then codes [32 k][8 lanes] uint32, nibble v of lane l
//        column 8 v + l's 4-bit q; W = d q + m (Q4_1; Q4_0 as m = -8 d);
//   kQ8, 2176 bytes: d float16 [64], then codes int8 [32 k][64 columns]; W = d q;
//   kQ4F, 1536 bytes: kQ4 with d and m float32 (Q4_K: d = d sc, m = -dmin mn, both exact);
//   kQ8F16, 16 k a block, 1280 bytes: d float32 [64], then codes int8 [16 k][64] (Q6_K: d = d sc,
//        exact, and W = fl(d q) rounds once, as the loader's product does);
//   kQ8M, 2560 bytes: d, m float32 [64], then codes int8 [32 k][64]; W = d q + m (Q5_1; Q5_K as
//        d = d sc, m = -dmin mn: 5-bit codes, d q exact).
// A block's W is rebuilt in registers with the loader's arithmetic: gguf.quants' numpy computes
// fl(fl(d q) + m) and d q, where d q is exact (11 + 4 or 8 significant bits; Q4_K's d sc q 21),
// so fma(q, d, m) and q * d give the float32 weight's bits, and the FMA chain over k is the float32
// panel's: the same output bits from 0.63 (Q4), 0.75 (Q4F) or 1.06 (Q8) bytes a weight, not 4.
enum Format { kF32, kQ4, kQ8, kQ4F, kQ8F16, kQ8M };
template <int F>
constexpr int64_t kBlock = F == kQ8F16 ? 16 : 32;  // k a block
template <int F>
constexpr int64_t kScaleBytes = F == kQ4 ? 256 : F == kQ8 ? 128 : F == kQ4F || F == kQ8M ? 512 : 256;
template <int F>
constexpr int64_t kBlockBytes = kScaleBytes<F> + kBlock<F> * (F == kQ4 || F == kQ4F ? 32 : 64);

template <int F>
constexpr int64_t panel_bytes(int64_t k) {
  if constexpr (F == kF32) return k * kPanel * static_cast<int64_t>(sizeof(float));
  return k / kBlock<F> * kBlockBytes<F>;
}

// acc[r][v] += x[r][kk] * W[kk][8 (v0 + v) ..] over one block of k, kk from k0, W rebuilt from
// the block's codes (see Format). The scales go through the stack once a block, as float32.
//
// A Q4 vector's codes are not shifted down: vector v takes its nibble in place, q 16^v (an AND,
// then an exact conversion: at most 4 significant bits), against d 16^-v (exact: a power of two,
// and d 2^-24 stays normal): the product is q d, exact, so the FMA with m rounds as the loader's
// d q + m did. The top nibble (v = 7) would be negative as int32: it is shifted down instead. The
// shifts had been half of the rebuild's vector operations. Top: the tile's last vector is v = 7
// (a compile-time case: as a run-time test GCC branched at every vector).
template <int R, int V, int F, bool Top>
inline void block_sums(const float* x, int64_t ldx, int64_t k0, const uint8_t* blk, int v0, __m256 (&acc)[R][V]) {
  constexpr bool kNibbles = F == kQ4 || F == kQ4F;
  constexpr bool kHasM = kNibbles || F == kQ8M;
  // vector v's d (and m: a row of 64 further on), as float32
  auto scale = [&](int v, int row) {
    if constexpr (F == kQ4F || F == kQ8F16 || F == kQ8M) return _mm256_loadu_ps(reinterpret_cast<const float*>(blk) + 64 * row + 8 * (v0 + v));
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk) + 8 * row + v0 + v));
  };
  alignas(32) float d[V][8], m[V][8];
  alignas(32) int32_t mask[V][8];
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) {
    __m256 dv = scale(v, 0);
    if constexpr (kNibbles) {
      const int place = v0 + v;  // the vector's nibble in a code word
      if (!(Top && v == V - 1)) {
        dv = _mm256_mul_ps(dv, _mm256_set1_ps(1.0f / static_cast<float>(1 << (4 * place))));
        _mm256_store_si256(reinterpret_cast<__m256i*>(mask[v]), _mm256_set1_epi32(0xF << (4 * place)));
      }
    }
    if constexpr (kHasM) _mm256_store_ps(m[v], scale(v, 1));
    _mm256_store_ps(d[v], dv);
  }
#pragma GCC unroll 4
  for (int j = 0; j < kBlock<F>; ++j) {
    __m256i word;
    if constexpr (kNibbles) word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kScaleBytes<F> + 32 * j));
    // Each vector's weights are rebuilt and used at once (all V rebuilt first, then the FMAs, had
    // GCC keep V weights and their scales live beside the accumulators: spills at every k).
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      __m256 w;
      if constexpr (kNibbles) {
        const __m256i q = Top && v == V - 1
                              ? _mm256_srli_epi32(word, 28)
                              : _mm256_and_si256(word, _mm256_load_si256(reinterpret_cast<const __m256i*>(mask[v])));
        w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_load_ps(d[v]), _mm256_load_ps(m[v]));
      } else {
        const auto* codes = reinterpret_cast<const __m128i*>(blk + kScaleBytes<F> + 64 * j + 8 * (v0 + v));
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(codes)));
        if constexpr (kHasM) {
          w = _mm256_fmadd_ps(q, _mm256_load_ps(d[v]), _mm256_load_ps(m[v]));
        } else {
          w = _mm256_mul_ps(q, _mm256_load_ps(d[v]));
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * ldx + k0 + j), w, acc[r][v]);
    }
  }
}

// Rows [0, R) x panel columns [8 v0, 8 (v0 + V)) of out: x rows at stride ldx, w the panel (its
// first byte, of the format F). For pairs, out, bias and up_bias point at the tile's first pair's
// gate column (up_off: from a gate column of out to its up column, kPairsSplit), and the tile is
// whole (V even, 64-column panels).
template <int R, int V, Store S, int F>
inline void tile(const float* x, int64_t ldx, const void* panel, int v0, int64_t k, const float* bias, float* out,
                 int64_t ldo, int cols, Ahead& ahead, const float* up_bias = nullptr, int64_t up_off = 0) {
  __m256 acc[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  if constexpr (F != kF32) {
    const auto* blk = static_cast<const uint8_t*>(panel);
    constexpr bool kNibbles = F == kQ4 || F == kQ4F;
    for (int64_t k0 = 0; k0 < k; k0 += kBlock<F>, blk += kBlockBytes<F>) {
      if (kNibbles && v0 + V == 8) {  // (Top only matters to the nibbles)
        block_sums<R, V, F, kNibbles>(x, ldx, k0, blk, v0, acc);
      } else {
        block_sums<R, V, F, false>(x, ldx, k0, blk, v0, acc);
      }
    }
    store<R, V, S>(acc, bias, out, ldo, cols, up_bias, up_off);
    return;
  }
  const float* w = static_cast<const float*>(panel) + 8 * v0;
  // (in locals: through the reference, the cursor was stored and reloaded at every k, a chain
  // longer than the k step's FMAs)
  const char* next = ahead.next;
  const char* const end = ahead.end;
  const int64_t every = ahead.every;
  // Four k steps an iteration: the loop's own instructions (the counter, the row pointers, the
  // branch) had been a third of a six-row step's 31 for its 12 FMAs, near the core's dispatch
  // width. Zen 3, the default model's 121 linears, unrolled by 1 / 2 / 4 / 8 alternating in one
  // process: 32 rows 54.5 / 53.4 / 52.1 / 53.1 ms, 256 rows 401 / 395 / 392 / 390, 512 rows 784 /
  // 777 / 773 / 773. The same FMAs in the same order.
#pragma GCC unroll 4
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* wk = w + kk * kPanel;
    // Every cache line of the tile's row 16 k ahead (V / 2 lines of 64 bytes): a one-row decode
    // tile reads the whole panel row, 4 lines a k; prefetching only its first line left the
    // other three to the hardware prefetcher (23.4-25.3 against 21.1-23.0 ms a token, default
    // model at one row, Zen 3, session 32; 8 and 32 rows ahead were no better than 16).
#pragma GCC unroll 4
    for (int v = 0; v < V; v += 2) _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * kPanel + 8 * v), _MM_HINT_T0);
    if constexpr (R > 1) {
      if ((kk & every) == 0 && next < end) {
        _mm_prefetch(next, _MM_HINT_T1);
        next += 64;
      }
    }
    __m256 wv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) wv[v] = _mm256_loadu_ps(wk + 8 * v);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + kk);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
  ahead.next = next;
  store<R, V, S>(acc, bias, out, ldo, cols, up_bias, up_off);
}

// R rows over vectors [vb, ve) of a panel (8 columns each), V vectors a tile, R x V <= 12
// accumulators.
template <int R, Store S, int F>
inline void rows_over_panel(const float* x, int64_t ldx, const void* w, int64_t k, const float* bias, float* out,
                            int64_t ldo, int cols, int vb, int ve, Ahead& ahead, const float* up_bias = nullptr,
                            int64_t up_off = 0) {
  // where vector v0's tile stores: column 8 v0 of the panel, or (pairs) its pair v0 / 2's gate column
  constexpr int kPer = S == kPlain ? 8 : 4;
  for (int v0 = vb; v0 < ve && 8 * v0 < cols; ) {
    const float* b = bias ? bias + kPer * v0 : nullptr;
    const float* ub = up_bias ? up_bias + kPer * v0 : nullptr;
    float* o = out + kPer * v0;
    const int left = cols - 8 * v0;
    if constexpr (R == 1) {
      if (ve - v0 >= 8) {
        tile<1, 8, S, F>(x, ldx, w, v0, k, b, o, ldo, left, ahead, ub, up_off);
        v0 += 8;
      } else {
        tile<1, 4, S, F>(x, ldx, w, v0, k, b, o, ldo, left, ahead, ub, up_off);
        v0 += 4;
      }
    } else {
      constexpr int V = R == 2 ? 4 : 2;
      tile<R, V, S, F>(x, ldx, w, v0, k, b, o, ldo, left, ahead, ub, up_off);
      v0 += V;
    }
  }
}

}  // namespace

namespace {

// Work items are (panel, column half, row group), panel-major, shared out as contiguous ranges:
// a thread's consecutive items reuse one panel from L2. Halves where there are few panels (a
// 576-column linear has 9: 5 against 4 left a thread idle a ninth of the call), row groups of
// 48 above 48 rows (prefill chunks). Who computes an output never changes its arithmetic.
// Pairs (S != kPlain): n = 2 x inter columns packed in pairs, n a multiple of 64 (whole panels); a
// panel's 32 pairs are gate (and up) columns [32 p, 32 p + 32).
template <Store S, int F = kF32>
void gemm(const float* x, const void* wt, const float* bias, float* out, int64_t m, int64_t n, int64_t np, int64_t k) {
  constexpr int64_t kRowGroup = 48;
  const int64_t ldo = S == kPairsSilu ? n / 2 : n;
  const int64_t panels = np / kPanel;
  const int64_t halves = panels < 16 ? 2 : 1;
  const int64_t groups = m <= kRowGroup ? 1 : (m + kRowGroup - 1) / kRowGroup;
  const int64_t group_rows = m <= kRowGroup ? m : kRowGroup;
  at::parallel_for(0, panels * halves * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item % groups, ph = item / groups, p = ph / halves;
      int64_t h = ph % halves;
      const int64_t col0 = p * kPanel;
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - col0));
      const int64_t out0 = S == kPlain ? col0 : p * kPanel / 2;  // the panel's first output column
      int vb = static_cast<int>(h * (8 / halves)), ve = vb + static_cast<int>(8 / halves);
      // At up to 6 rows (one row group and one row tile: each weight line is read once), a
      // thread whose range holds both halves of a panel (item + 1 is the other half) runs them
      // as one item that reads the panel's 4 lines of a k row in turn. As halves, the first read
      // 2 lines of every 4 and prefetched the others. Zen 3, one row, the decoder stack's calls
      // (profiler, us): qkv 78-80 -> 73-75, o 49-50 -> 46, down 124-126 -> 115-116. Not above 6
      // rows: at 32, down's whole panel (k = 1536, 393 KB) and x outgrew the L2 (441 -> 461 us).
      if (halves == 2 && m <= 6 && h == 0 && item + 1 < end) {
        ve = 8, h = 1, ++item;  // h = 1: the item ends its panel, so the look-ahead is the next one
      }
      if (cols <= 8 * vb) continue;
      const char* w = static_cast<const char*>(wt) + p * panel_bytes<F>(k);
      const float* b = bias ? bias + out0 : nullptr;
      const float* ub = S != kPlain && bias ? bias + n / 2 + out0 : nullptr;
      const int64_t up_off = S == kPairsSplit ? n / 2 : 0;
      // The weights this thread reads next go towards L2 while these rows are computed, a line a
      // k: the first row tile over a panel reads it from memory one line a k per 16 columns,
      // too few lines in flight for the memory's latency. "Next" is the panel itself during its
      // first item (the second half's lines), else the next panel during this panel's last item
      // (prefill chunks reuse a panel over row groups: the items between prefetch nothing).
      // Zen 3, the default model's 121 linears from memory, alternating builds: 8 rows 34-36 ->
      // 26-29 ms, 32 rows 67-76 -> 59-66 ms, 1 and 2 rows unchanged; two lines a k, or T0 / T2
      // hints, were no better.
      Ahead ahead;
      if (halves == 2 && h == 0 && g == 0) {
        ahead.next = w;
      } else if (h == halves - 1 && g == groups - 1 && p + 1 < panels) {
        ahead.next = w + panel_bytes<F>(k);
      }
      // The lines go out spread over the item, not as fast as its k steps run: a line every
      // `every` k steps, about the item's tile sweeps over k (6-row tiles, 16 columns each) per
      // 4 lines of a panel's k row, as a power of two up to 8. At a line every k step the first
      // quarter or sixth of an item had issued them all, faster than the core's misses drain, and
      // the tiles' own loads (L2 hits) waited behind them. Zen 3, the 121 linears from memory,
      // alternating processes: 32 rows 64.1-64.7 -> 56.2 ms, 8 rows 30.9-31.6 -> 29.3, 256 rows
      // unchanged (benchmarks/linears.py --dtype float32).
      const int64_t r_end = std::min(m, (g + 1) * group_rows);
      int64_t r0 = g * group_rows;
      if (ahead.next) {
        ahead.end = ahead.next + panel_bytes<F>(k);
        const int64_t sweeps = (r_end - r0 + 5) / 6 * ((ve - vb) / 2);
        int64_t every = 1;
        while (every * 2 <= std::min<int64_t>(sweeps / 4, 8)) every *= 2;
        ahead.every = every - 1;
      }
      // Blocks: 4-row tiles first (8 accumulators, each vector's rebuild shared by 4 rows). At 6
      // rows the tile's scales and masks no longer fit beside its 12 accumulators: Zen 3, the
      // default model's layers at 8 rows 24.2 ms in 6 + 2-row tiles, 18.9 in two 4-row tiles.
      if constexpr (F != kF32) {
        for (; r0 + 4 <= r_end; r0 += 4)
          rows_over_panel<4, S, F>(x + r0 * k, k, w, k, b, out + r0 * ldo + out0, ldo, cols, vb, ve, ahead, ub, up_off);
      }
      for (; r0 + 6 <= r_end; r0 += 6)
        rows_over_panel<6, S, F>(x + r0 * k, k, w, k, b, out + r0 * ldo + out0, ldo, cols, vb, ve, ahead, ub, up_off);
      const float* xr = x + r0 * k;
      float* o = out + r0 * ldo + out0;
      switch (r_end - r0) {
        case 5: rows_over_panel<5, S, F>(xr, k, w, k, b, o, ldo, cols, vb, ve, ahead, ub, up_off); break;
        case 4: rows_over_panel<4, S, F>(xr, k, w, k, b, o, ldo, cols, vb, ve, ahead, ub, up_off); break;
        case 3: rows_over_panel<3, S, F>(xr, k, w, k, b, o, ldo, cols, vb, ve, ahead, ub, up_off); break;
        case 2: rows_over_panel<2, S, F>(xr, k, w, k, b, o, ldo, cols, vb, ve, ahead, ub, up_off); break;
        case 1: rows_over_panel<1, S, F>(xr, k, w, k, b, o, ldo, cols, vb, ve, ahead, ub, up_off); break;
        default: break;
      }
    }
  });
}

}  // namespace

namespace tessera_avx2 {

void f32_gemm(const float* x, const float* wt, const float* bias, float* out, int64_t m, int64_t n, int64_t np,
              int64_t k) {
  gemm<kPlain>(x, wt, bias, out, m, n, np, k);
}

void f32_gemm_pairs(const float* x, const float* wt, const float* bias, float* out, int64_t m, int64_t n, int64_t k,
                    bool silu) {
  if (silu) {
    gemm<kPairsSilu>(x, wt, bias, out, m, n, n, k);
  } else {
    gemm<kPairsSplit>(x, wt, bias, out, m, n, n, k);
  }
}

// fn(std::integral_constant<int, F>) for f32_gemm_blocks' format number (0-4), returning its result.
template <typename Fn>
auto with_format(int format, Fn&& fn) {
  switch (format) {
    case 0: return fn(std::integral_constant<int, kQ4>());
    case 1: return fn(std::integral_constant<int, kQ8>());
    case 2: return fn(std::integral_constant<int, kQ4F>());
    case 3: return fn(std::integral_constant<int, kQ8F16>());
    default: return fn(std::integral_constant<int, kQ8M>());
  }
}

int64_t f32_block_k(int format) {
  return with_format(format, [](auto tag) { return kBlock<decltype(tag)::value>; });
}

int64_t f32_block_bytes(int format) {
  return with_format(format, [](auto tag) { return kBlockBytes<decltype(tag)::value>; });
}

void f32_gemm_blocks(const float* x, const uint8_t* blocks, int format, const float* bias, float* out, int64_t m,
                     int64_t n, int64_t np, int64_t k, int store) {
  with_format(format, [&](auto tag) {
    constexpr int F = decltype(tag)::value;
    if (store == 0) gemm<kPlain, F>(x, blocks, bias, out, m, n, np, k);
    if (store == 1) gemm<kPairsSplit, F>(x, blocks, bias, out, m, n, np, k);
    if (store == 2) gemm<kPairsSilu, F>(x, blocks, bias, out, m, n, np, k);
  });
}

}  // namespace tessera_avx2

#pragma GCC pop_options
