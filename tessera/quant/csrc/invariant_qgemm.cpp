// Batch-invariant quantized linear layers on AMX, or AVX-512 BF16 where the CPU has no AMX (Zen 4/5):
// one kernel for every row count, decode and prefill.
//
// Why: the torch kernels for quantized weights are picked by shape (`_weight_int8pack_mm` at a few
// rows, dequantize + GEMM above), so a token's result depended on how many tokens ran with it.
// Here a row's result is a function of that row and the weight only:
//   * the weight is stored in "tile order": per 16 output columns, per 32-wide K step, the 512
//     weights of one AMX B tile in VNNI order (k pair, column, parity);
//   * each tile is dequantized into bf16 in registers (W rounded to bf16, round to nearest even,
//     with bf16 activations; int8 codes are exact in bf16 and their per-row scale is applied to
//     the fp32 sum instead), then multiplied on AMX (TDPBF16PS) into fp32 C tiles, K steps in order;
//   * activation rows are padded to 16 with zeros; a C tile row depends only on the same A row.
//     float32 activations are split into hi + lo bf16 halves (x = hi + lo to about 16 bits), and
//     so is a dequantized weight that bf16 does not hold exactly; the three products that matter
//     go into the same C tile in a fixed order per K step (see column_pair).
//   * w8a8 (int8 x int8, TDPBSSD): integer sums are exact, so any order gives the same result.
//   * qgemm_logits / kqgemm_logits: an lm_head's fp32 logits and greedy ids from the store epilogue;
//     qgemm_silu / kqgemm_silu: a fused gate_up's silu(gate) * up from it (silu_mul's bits).
// M = 1 and M = 512 run the same instructions per output element; only how many A tiles there
// are changes. Without AMX the same dequantized B tiles are multiplied with VDPBF16PS (one chain
// per output over the k pairs in order, the same three products per K step), except INT4, whose
// exact codes are multiplied as they are with scale and zero applied per group (int4_avx512): a
// second arithmetic, rounding differently from the tiles, so a machine always takes one (w8a8
// stays AMX-only). Loader and packing: tessera/quant/invariant.py.
//
// Formats (codes per (column block nb, K step ks) tile, 16 columns x 32 k):
//   INT8  codes int8 [Nb, Kb, 16, 16, 2], scale f32 [Np] (after the sum)        W = scale[n] q
//   Q8_0  codes int8 as INT8, d f16 [Nb, Kb, 16]                                W = bf16(d q)
//   INT4  codes uint8 [Nb, Kb, 16, 16] (byte i of a k-pair row: element i low nibble, i + 16
//         high), scale, zero bf16 [Nb, G, 16] (group = K / G, a multiple of 32)  W = bf16((q - 8) s + z)
//   BF16  codes bf16 [Nb, Kb, 16, 16, 2] (already a B tile), optional remainder tiles as zero
//                                                                               W = codes (+ zero)
//   W8A8  codes int8 [Nb, K/64, 16, 16, 4], x int8 [M, Kp] with its own scale sx: y = sum * (sx * sw)
//   KQ    GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K with their bits rearranged, none added or lost (kqgemm):
//         codes uint8 as INT4 (the low 4 bits of each code), planes int32 [Nb, Kb, 16, P]
//         (P = 0..2: bit i of plane p is bit 4 + p of value i of a k-pair row), sup f16
//         [Nb, S, F, 16] (d, and dmin / m where F = 2, per super-block of K / S), sub [Nb, Kb, 2, 16] (Q4_K/Q5_K:
//         uint8 scale and min of the 32-wide sub-block; Q6_K: int8 scales of its two 16-wide halves)
//           Q4_0 W = d q - 8 d        Q4_1 W = d q + m (the Q5_1 kind with no plane)
//           Q5_0 W = d q - 16 d       Q5_1 W = d q + m       Q4_K/Q5_K W = (d sc) q - dmin mn
//           Q6_K W = (d sc) q - 32 (d sc)                     (each one fma in fp32, then bf16)
//         Every product before the fma is exact in fp32, so W equals gguf's float32 dequantization.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "argmax_rows.h"
#include "silu_rows.h"

namespace {

enum Format : int64_t { kInt8 = 0, kQ8_0 = 1, kInt4 = 2, kBf16 = 3, kKQ = 4 };
// The KQ kinds: how sup and sub make a column's scale s and offset z (W = fma(s, q, z)).
enum KQKind : int64_t { kQ5_0 = 0, kQ5_1 = 1, kQK = 2, kQ6_K = 3, kQ4_0 = 4 };

bool amx_permitted() {
  // Linux hands out AMX tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-1: C (16 x 16 fp32, two column blocks), 2-3: B remainders, 4: A hi, 5: A lo, 6-7: B.
// With m (at most 32 rows, column_pair_small), the A and C tiles hold only the call's rows: tiles
// 0-1 and 4 the first min(m, 16), 2-3 and 5 the rest.
__attribute__((target("amx-tile"))) void configure_tiles(int64_t m = 0) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  if (m > 0) {
    const uint8_t first = static_cast<uint8_t>(std::min<int64_t>(m, 16));
    const uint8_t second = static_cast<uint8_t>(std::max<int64_t>(std::min<int64_t>(m - 16, 16), 1));
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = first;
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = second;
  }
  // GCC does not see ldtilecfg read its operand and may drop the stores above without this
  // (it did in paged_attention.cpp: SIGILL at the first tile instruction).
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// A function of its own (as configure_tiles): the parallel_for lambdas that call it have no AMX
// target, and -march=native gives them none on a CPU without AMX.
__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

// Per-element expansion of 16 per-column values to the 32 elements of a VNNI row (col = i / 2).
__attribute__((target("avx512f"))) inline void expand_cols(__m512 v, __m512& lo, __m512& hi) {
  const __m512i idx_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i idx_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  lo = _mm512_permutexvar_ps(idx_lo, v);
  hi = _mm512_permutexvar_ps(idx_hi, v);
}

__attribute__((target("avx512f"))) inline __m512 bf16x16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 32 fp32 values (f0: elements 0..15, f1: 16..31) rounded to bf16 into hi; with lo, also the
// rounded remainder (w - hi is exact in fp32), so that hi + lo carries about 16 bits of w.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void store_bf16x32(uint16_t* hi, uint16_t* lo,
                                                                                __m512 f0, __m512 f1) {
  __m512bh b = _mm512_cvtne2ps_pbh(f1, f0);  // low half from f0 (elements 0..15), high from f1
  __m512i bi = reinterpret_cast<__m512i&>(b);
  _mm512_storeu_si512(hi, bi);
  if (lo) {
    __m512 b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(bi)), 16));
    __m512 b1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(bi, 1)), 16));
    __m512bh l = _mm512_cvtne2ps_pbh(_mm512_sub_ps(f1, b1), _mm512_sub_ps(f0, b0));
    _mm512_storeu_si512(lo, reinterpret_cast<__m512i&>(l));
  }
}

struct Weight {
  int64_t fmt, n, np, kp, groups;
  const void* codes;
  const void* scale;  // INT8: f32 [Np]; Q8_0: f16 [Nb, Kb, 16]; INT4: bf16 [Nb, G, 16]
  const void* zero;   // INT4: bf16 [Nb, G, 16]
  // KQ only (scale holds sup, groups its S): the extra bit planes and the sub-block scales.
  const int32_t* planes = nullptr;
  int64_t nplanes = 0, kind = 0, sup_fields = 1;
  const void* sub = nullptr;
};

// The scale group of K step ks, and the group row of linear tile t (block t / kb, step t % kb:
// t * groups / kb is block * groups + its step's group, as groups divides kb). Without the
// 64-bit divisions where every K step is its own group (GGUF Q4_0/Q4_1/Q5_0/Q5_1, 32-wide
// blocks): the prefetch of a decode's next tiles made eight of them a K step.
inline int64_t step_group(const Weight& w, int64_t kb, int64_t ks) { return w.groups == kb ? ks : ks * w.groups / kb; }
inline int64_t tile_group_row(const Weight& w, int64_t kb, int64_t t) { return w.groups == kb ? t : t * w.groups / kb; }

__attribute__((target("avx512f"))) inline __m512 f16x16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A KQ tile's per-column scale and offset for k-pair rows 0-7 (s0, z0) and 8-15 (s1, z1).
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void kq_scales(const Weight& w, int64_t nb, int64_t ks,
                                                                  __m512& s0, __m512& z0, __m512& s1, __m512& z1) {
  const int64_t kb = w.kp / 32, g = step_group(w, kb, ks);
  const uint16_t* sup = static_cast<const uint16_t*>(w.scale) + (nb * w.groups + g) * 16 * w.sup_fields;
  const __m512 d = f16x16(sup), second = w.sup_fields == 2 ? f16x16(sup + 16) : _mm512_setzero_ps();
  if (w.kind == kQ5_0 || w.kind == kQ5_1 || w.kind == kQ4_0) {
    s0 = s1 = d;
    z0 = z1 = w.kind == kQ5_1 ? second : _mm512_mul_ps(d, _mm512_set1_ps(w.kind == kQ5_0 ? -16.f : -8.f));
    return;
  }
  const int8_t* sub = static_cast<const int8_t*>(w.sub) + (nb * kb + ks) * 32;
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + 16));
  if (w.kind == kQK) {  // uint8 scale and min of the sub-block
    s0 = s1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(a)));
    z0 = z1 = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(second, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))));
  } else {  // Q6_K: int8 scales of the two halves, q - 32
    s0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)));
    s1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
    z0 = _mm512_mul_ps(s0, _mm512_set1_ps(-32.f));
    z1 = _mm512_mul_ps(s1, _mm512_set1_ps(-32.f));
  }
}

// Tile (nb, ks) of the weight as a bf16 B tile (512 values, VNNI order) into dst, and its
// remainder into lo when lo is given (float32 activations: W to about 16 bits). One function per
// format, inlined where it is used: column_pair_small calls them with lo = null and the format
// fixed, so a decode's tile runs none of the format's branches (at one row the called dequant_tile
// had taken ~40 ns a Q4_1 tile on an Intel Xeon with AMX, model 167; the same instructions alone in
// a loop 24).
template <bool Q8>
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) inline void int8_tile(
    const Weight& w, int64_t nb, int64_t ks, uint16_t* dst, uint16_t* lo) {
  const int64_t tile = nb * (w.kp / 32) + ks;
  const int8_t* src = static_cast<const int8_t*>(w.codes) + tile * 512;
  __m512 dlo = _mm512_set1_ps(1.f), dhi = dlo;
  if (Q8) {
    const uint16_t* d = static_cast<const uint16_t*>(w.scale) + tile * 16;
    expand_cols(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d))), dlo, dhi);
  }
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + r * 32));
    __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
    __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
    if (Q8) {  // d * q is exact in fp32 (11 x 8 bits); one rounding to bf16
      f0 = _mm512_mul_ps(f0, dlo);
      f1 = _mm512_mul_ps(f1, dhi);
    }
    store_bf16x32(dst + r * 32, lo ? lo + r * 32 : nullptr, f0, f1);
  }
}

__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) inline void int4_tile(
    const Weight& w, int64_t nb, int64_t ks, uint16_t* dst, uint16_t* lo) {
  const int64_t kb = w.kp / 32, tile = nb * kb + ks;
  const uint8_t* src = static_cast<const uint8_t*>(w.codes) + tile * 256;
  const int64_t g = step_group(w, kb, ks);  // the group this K step lies in
  const int64_t sidx = (nb * w.groups + g) * 16;
  __m512 slo, shi, zlo, zhi;
  expand_cols(bf16x16(static_cast<const uint16_t*>(w.scale) + sidx), slo, shi);
  expand_cols(bf16x16(static_cast<const uint16_t*>(w.zero) + sidx), zlo, zhi);
  // q - 8 as fp32 by a table lookup: vpermps reads only the low 4 bits of each index, so the
  // byte widened to 32 bits indexes by its low nibble and the same shifted by 4 by its high one
  // (no masks, no integer subtract, no conversion: 8 vector uops a row instead of 13, the
  // dequantization being the bound of a decode on AMX; the same values, so the same bits).
  const __m512 minus8 = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + r * 16)));
    const __m512 f0 = _mm512_permutexvar_ps(b, minus8), f1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), minus8);
    // (q - 8) * s is exact in fp32; + z rounds once (as the fma), then once more to bf16.
    store_bf16x32(dst + r * 32, lo ? lo + r * 32 : nullptr, _mm512_fmadd_ps(f0, slo, zlo),
                  _mm512_fmadd_ps(f1, shi, zhi));
  }
}

// Row r (k pair r: 32 values in VNNI order) of a KQ tile with P bit planes, as float32 (f0: values
// 0..15, f1: 16..31) before their rounding to bf16: the low 4 bits of each code by a lookup
// (vpermps reads only an index's low 4 bits: as INT4's, no masks and no conversion), the bit
// planes added as exact float adds, then fma(q, s, z) with the row's per-value scale and offset.
template <int P>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void kq_row(
    const uint8_t* src, const int32_t* planes, int r, __m512 slo, __m512 shi, __m512 zlo, __m512 zhi, __m512& f0,
    __m512& f1) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + r * 16)));
  __m512 v0 = _mm512_permutexvar_ps(b, iota), v1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), iota);
  for (int p = 0; p < P; ++p) {  // bit 4 + p of values 0..15 (low half), 16..31 (high)
    const uint32_t bits = static_cast<uint32_t>(planes[r * P + p]);
    const __m512 add = _mm512_set1_ps(static_cast<float>(16 << p));
    v0 = _mm512_mask_add_ps(v0, static_cast<__mmask16>(bits & 0xFFFF), v0, add);
    v1 = _mm512_mask_add_ps(v1, static_cast<__mmask16>(bits >> 16), v1, add);
  }
  f0 = _mm512_fmadd_ps(v0, slo, zlo);
  f1 = _mm512_fmadd_ps(v1, shi, zhi);
}

// A KQ tile with P bit planes.
template <int P>
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) inline void kq_tile(
    const Weight& w, int64_t nb, int64_t ks, uint16_t* dst, uint16_t* lo) {
  const int64_t tile = nb * (w.kp / 32) + ks;
  const uint8_t* src = static_cast<const uint8_t*>(w.codes) + tile * 256;
  const int32_t* planes = w.planes + tile * 16 * P;
  __m512 s0, z0, s1, z1, slo, shi, zlo, zhi;
  kq_scales(w, nb, ks, s0, z0, s1, z1);
  const bool halves = w.kind == kQ6_K;  // the only kind whose two halves scale differently
  expand_cols(s0, slo, shi);
  expand_cols(z0, zlo, zhi);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    if (r == 8 && halves) {
      expand_cols(s1, slo, shi);
      expand_cols(z1, zlo, zhi);
    }
    __m512 f0, f1;
    kq_row<P>(src, planes, r, slo, shi, zlo, zhi, f0, f1);
    store_bf16x32(dst + r * 32, lo ? lo + r * 32 : nullptr, f0, f1);
  }
}

// Calls fn with the inlined tile maker of w's format (the same for every tile of a call); w is
// quantized (BF16 weights are B tiles already and never made).
template <typename Fn>
__attribute__((always_inline)) inline void with_tile_maker(const Weight& w, const Fn& fn) {
  if (w.fmt == kInt8) return fn([&](int64_t nb, int64_t ks, uint16_t* d, uint16_t* l) { int8_tile<false>(w, nb, ks, d, l); });
  if (w.fmt == kQ8_0) return fn([&](int64_t nb, int64_t ks, uint16_t* d, uint16_t* l) { int8_tile<true>(w, nb, ks, d, l); });
  if (w.fmt == kInt4) return fn([&](int64_t nb, int64_t ks, uint16_t* d, uint16_t* l) { int4_tile(w, nb, ks, d, l); });
  if (w.nplanes == 0) return fn([&](int64_t nb, int64_t ks, uint16_t* d, uint16_t* l) { kq_tile<0>(w, nb, ks, d, l); });
  if (w.nplanes == 1) return fn([&](int64_t nb, int64_t ks, uint16_t* d, uint16_t* l) { kq_tile<1>(w, nb, ks, d, l); });
  return fn([&](int64_t nb, int64_t ks, uint16_t* d, uint16_t* l) { kq_tile<2>(w, nb, ks, d, l); });
}

// Any quantized format's tile (the whole-K paths: a call per tile is cheap next to their products).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void dequant_tile(const Weight& w, int64_t nb, int64_t ks,
                                                                       uint16_t* dst, uint16_t* lo) {
  with_tile_maker(w, [&](const auto& tile) { tile(nb, ks, dst, lo); });
}

// The activation rows as AMX A operands: rows 0..m-1 of bf16 [mp, kp], each row's K padding
// zeroed (the rows past m are left as they are: see run); fp32 x also gives lo.
__attribute__((target("avx512f,avx512bf16"))) void pack_a(const at::Tensor& x, int64_t m, int64_t k,
                                                            int64_t kp, uint16_t* hi, uint16_t* lo) {
  if (kp > k)
    for (int64_t r = 0; r < m; ++r) {
      std::fill(hi + r * kp + k, hi + (r + 1) * kp, 0);
      if (lo) std::fill(lo + r * kp + k, lo + (r + 1) * kp, 0);
    }
  if (x.scalar_type() == at::kBFloat16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    for (int64_t r = 0; r < m; ++r) std::memcpy(hi + r * kp, src + r * k, k * 2);
    return;
  }
  const float* src = x.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) {
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
      __m512 v = _mm512_loadu_ps(src + r * k + i);
      __m256bh h = _mm512_cvtneps_pbh(v);
      __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i&>(h)), 16));
      __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, back));  // exact difference, rounded once
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + r * kp + i), reinterpret_cast<__m256i&>(h));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + r * kp + i), reinterpret_cast<__m256i&>(l));
    }
    for (; i < k; ++i) {  // the same rounding, one element at a time (K not a multiple of 16)
      __m512 v = _mm512_set1_ps(src[r * k + i]);
      __m256bh h = _mm512_cvtneps_pbh(v);
      __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i&>(h)), 16));
      __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, back));
      hi[r * kp + i] = _mm256_extract_epi16(reinterpret_cast<__m256i&>(h), 0);
      lo[r * kp + i] = _mm256_extract_epi16(reinterpret_cast<__m256i&>(l), 0);
    }
  }
}

__attribute__((target("avx512f,avx512bf16"))) inline void store_row(const float* c, const float* scale,
                                                                      at::ScalarType dtype, void* out, int cols) {
  __mmask16 mask = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  __m512 v = _mm512_loadu_ps(c);
  if (scale) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale));
  if (dtype == at::kBFloat16) {
    __m256bh h = _mm512_cvtneps_pbh(v);
    _mm256_mask_storeu_epi16(out, mask, reinterpret_cast<__m256i&>(h));
  } else {
    _mm512_mask_storeu_ps(out, mask, v);
  }
}

// Where the bf16 B tiles of one column pair are: the weight itself (BF16 format) or bbuf, which
// dequant_pair fills with the pair's whole K once (every row tile then reuses it).
struct PairTiles {
  const uint16_t* hi;  // BF16: the codes; else bbuf
  const uint16_t* lo;  // BF16: the remainder tiles (or null); else unused
  bool direct;
  int per_step;  // bbuf: B tiles per K step: hi0, hi1 (, lo0, lo1)
  int64_t kb, nb0;
  const uint16_t* get(int64_t blk, int64_t ks, bool rem) const {
    if (direct) return (rem ? lo : hi) + ((nb0 + blk) * kb + ks) * 512;
    return hi + (ks * per_step + blk + (rem ? 2 : 0)) * 512;
  }
};

__attribute__((target("avx512f,avx512bw,avx512bf16"))) PairTiles dequant_pair(const Weight& w, int64_t pair,
                                                                              bool w_lo, uint16_t* bbuf) {
  const int64_t kb = w.kp / 32, nb0 = 2 * pair;
  const bool direct = w.fmt == kBf16;
  PairTiles t{direct ? static_cast<const uint16_t*>(w.codes) : bbuf, direct ? static_cast<const uint16_t*>(w.zero) : nullptr,
              direct, w_lo ? 4 : 2, kb, nb0};
  if (!direct)
    for (int64_t ks = 0; ks < kb; ++ks) {
      uint16_t* b = bbuf + ks * t.per_step * 512;
      dequant_tile(w, nb0, ks, b, w_lo ? b + 2 * 512 : nullptr);
      dequant_tile(w, nb0 + 1, ks, b + 512, w_lo ? b + 3 * 512 : nullptr);
    }
  return t;
}

// Where the AMX paths put a call's C tiles: [m, n] of x's dtype, or (logits, bf16 x) fp32
// holding the bf16-rounded values, each row's first maximum kept in chunk when it is set.
struct Out {
  void* ptr;
  at::ScalarType dtype;
  bool logits;
  ArgmaxChunk* chunk;
};

// One stored C tile (16 rows from m0 x column block nb, fp32) into out, the INT8 format's
// per-column scale applied; rows past m and columns past n are left alone.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void store_c_tile(
    const float* c, const Weight& w, int64_t nb, int64_t m0, int64_t m, const Out& out) {
  const int64_t col0 = nb * 16;
  if (col0 >= w.n) return;
  const int cols = static_cast<int>(std::min<int64_t>(16, w.n - col0));
  const float* scale = w.fmt == kInt8 ? static_cast<const float*>(w.scale) + col0 : nullptr;
  const int esize = out.dtype == at::kBFloat16 && !out.logits ? 2 : 4;
  for (int r = 0; r < 16 && m0 + r < m; ++r) {
    if (!out.logits) {
      store_row(c + r * 16, scale, out.dtype, static_cast<char*>(out.ptr) + ((m0 + r) * w.n + col0) * esize, cols);
      continue;
    }
    alignas(64) float scaled[16];
    const float* row = c + r * 16;
    if (scale) {
      _mm512_store_ps(scaled, _mm512_mul_ps(_mm512_loadu_ps(row), _mm512_loadu_ps(scale)));
      row = scaled;
    }
    store_row_bf16_as_f32(row, nullptr, out.ptr ? static_cast<float*>(out.ptr) + (m0 + r) * w.n + col0 : nullptr,
                          cols, out.chunk, m0 + r, col0);
  }
}

// One pair of column blocks (32 output columns) for every activation row. Per K step, in this
// order: C += A_hi B_hi; with a weight remainder C += A_hi B_lo; with an activation remainder
// C += A_lo B_hi (A_lo B_lo is below fp32 rounding and skipped).
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16"))) void column_pair(
    const Weight& w, int64_t pair, const uint16_t* a_hi, const uint16_t* a_lo, bool w_lo, int64_t m, int64_t mp,
    uint16_t* bbuf, const Out& out) {
  const int64_t kb = w.kp / 32, nb0 = 2 * pair;
  const int64_t stride = w.kp * 2;  // bytes per A row
  const PairTiles tiles = dequant_pair(w, pair, w_lo, bbuf);
  auto b_tile = [&](int64_t blk, int64_t ks, bool lo) { return tiles.get(blk, ks, lo); };
  alignas(64) float c[4][256];
  int64_t m0 = 0;
  // bf16 activations and weight: two row tiles share each K step's B tiles (4 products for 4 tile
  // loads, not 2 for 3); the remainders' products need the other tile registers.
  if (!w_lo && !a_lo)
    for (; m0 + 32 <= mp; m0 += 32) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t ks = 0; ks < kb; ++ks) {
        _tile_loadd(4, a_hi + m0 * w.kp + ks * 32, stride);
        _tile_loadd(5, a_hi + (m0 + 16) * w.kp + ks * 32, stride);
        _tile_loadd(6, b_tile(0, ks, false), 64);
        _tile_loadd(7, b_tile(1, ks, false), 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      for (int q = 0; q < 4; ++q) store_c_tile(c[q], w, nb0 + q % 2, m0 + (q / 2) * 16, m, out);
    }
  for (; m0 < mp; m0 += 16) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t ks = 0; ks < kb; ++ks) {
      _tile_loadd(4, a_hi + m0 * w.kp + ks * 32, stride);
      _tile_loadd(6, b_tile(0, ks, false), 64);
      _tile_loadd(7, b_tile(1, ks, false), 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (w_lo) {
        _tile_loadd(2, b_tile(0, ks, true), 64);
        _tile_loadd(3, b_tile(1, ks, true), 64);
        _tile_dpbf16ps(0, 4, 2);
        _tile_dpbf16ps(1, 4, 3);
      }
      if (a_lo) {
        _tile_loadd(5, a_lo + m0 * w.kp + ks * 32, stride);
        _tile_dpbf16ps(0, 5, 6);
        _tile_dpbf16ps(1, 5, 7);
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    for (int q = 0; q < 2; ++q) store_c_tile(c[q], w, nb0 + q, m0, m, out);
  }
}

// The weight bytes of tile (nb, ks + kAhead) and of block nb + 1's tile as far ahead towards L1:
// at decode sizes the dequantization waited on each new line of codes (perf on an Intel Xeon with
// AMX, model 167: the first instruction using each 64 bytes of codes carried the samples). The
// linear tile index runs on into the next block, so a pair's last steps fetch the start of the next
// pair's first block; past the weight's last tile it fetches that tile again.
constexpr int64_t kAhead = 2;
// And towards L2 kAheadL2 tiles ahead: the L1 prefetch alone leaves too few misses in flight
// (one process alternating, a token's 121 layers at one row: int4 10.0 -> 9.3 ms, Q8_0 11.0 ->
// 9.9; 32 rows 4%; 16 to 48 tiles ahead all alike).
constexpr int64_t kAheadL2 = kAhead + 24;

// Blocks nb0 and nb1 (nb0 + 1 for a column pair; a gate block and its up block for a gated one).
__attribute__((target("avx512f"))) inline void prefetch_pair_ahead(const Weight& w, int64_t nb0, int64_t nb1,
                                                                   int64_t ks) {
  const int64_t kb = w.kp / 32, last = (w.np / 16) * kb - 1;
  const int64_t t0 = std::min(nb0 * kb + ks + kAhead, last), t1 = std::min(nb1 * kb + ks + kAhead, last);
  const int64_t u0 = std::min(t0 + kAheadL2 - kAhead, last), u1 = std::min(t1 + kAheadL2 - kAhead, last);
  const bool q8 = w.fmt == kInt8 || w.fmt == kQ8_0;
  const int64_t tbytes = q8 ? 512 : 256;
  const char* codes = static_cast<const char*>(w.codes);
  // GCC may delete a loop whose only statements are prefetches (no side effects): keep it.
  asm volatile("");
  for (int64_t l = 0; l < tbytes; l += 64) {
    _mm_prefetch(codes + t0 * tbytes + l, _MM_HINT_T0);
    _mm_prefetch(codes + t1 * tbytes + l, _MM_HINT_T0);
    _mm_prefetch(codes + u0 * tbytes + l, _MM_HINT_T1);
    _mm_prefetch(codes + u1 * tbytes + l, _MM_HINT_T1);
  }
  if (w.fmt == kQ8_0) {  // d: 16 f16 per tile
    _mm_prefetch(static_cast<const char*>(w.scale) + t0 * 32, _MM_HINT_T0);
    _mm_prefetch(static_cast<const char*>(w.scale) + t1 * 32, _MM_HINT_T0);
  } else if (w.fmt == kInt4) {  // scale and zero: 16 bf16 per (block, group)
    const int64_t g = step_group(w, kb, std::min<int64_t>(ks + kAhead, kb - 1));
    for (const int64_t nb : {nb0, nb1}) {
      _mm_prefetch(static_cast<const char*>(w.scale) + (nb * w.groups + g) * 32, _MM_HINT_T0);
      _mm_prefetch(static_cast<const char*>(w.zero) + (nb * w.groups + g) * 32, _MM_HINT_T0);
    }
  } else if (w.fmt == kKQ) {  // the bit planes and sub-block scales of the tile
    for (const int64_t t : {t0, t1}) {
      if (w.nplanes) _mm_prefetch(reinterpret_cast<const char*>(w.planes + t * 16 * w.nplanes), _MM_HINT_T0);
      if (w.sub) _mm_prefetch(static_cast<const char*>(w.sub) + t * 32, _MM_HINT_T0);
    }
    // and the super-block's d (and m): a new line every tile where a super-block is 32 wide (Q4_1)
    const int64_t sup_bytes = 32 * w.sup_fields;
    const auto sup_line = [&](int64_t t) {
      return static_cast<const char*>(w.scale) + tile_group_row(w, kb, t) * sup_bytes;
    };
    _mm_prefetch(sup_line(t0), _MM_HINT_T0);
    _mm_prefetch(sup_line(t1), _MM_HINT_T0);
    _mm_prefetch(sup_line(u0), _MM_HINT_T1);
    _mm_prefetch(sup_line(u1), _MM_HINT_T1);
  }
}

// Decode sizes on AMX (at most 32 rows, bf16 activations, a quantized format): each K step's two
// tiles dequantized into a 2 KiB buffer that stays in L1 and multiplied at once, one or two row
// tiles into C tiles 0-1 and 2-3 (free: there is no remainder without float32 activations).
// column_pair's whole-K buffer went through L2 at K = 1536 and kept the dequantization of one
// step from overlapping the products of the last. The same B tiles, and per C tile the same
// products in the same order as column_pair's: the same bits. `tile(nb, ks, dst)` makes a B tile;
// the two blocks are nb0 and nb1, and `store(c, tiles)` gets the C tiles (c[0] and c[1] rows 0-15 of
// nb0 and nb1, c[2] and c[3] rows 16-31; tiles is 2 or 4).
template <typename Tile, typename Store>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16"))) void small_pair(
    const Weight& w, int64_t nb0, int64_t nb1, const uint16_t* a_hi, int64_t mp, const Tile& tile,
    const Store& store) {
  const int64_t kb = w.kp / 32;
  const int64_t stride = w.kp * 2;  // bytes per A row
  const bool two = mp > 16;
  alignas(64) uint16_t buf[2][2 * 512];
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t ks = 0; ks < kb; ++ks) {
    uint16_t* b = buf[ks & 1];
    prefetch_pair_ahead(w, nb0, nb1, ks);
    tile(nb0, ks, b);
    tile(nb1, ks, b + 512);
    _tile_loadd(4, a_hi + ks * 32, stride);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a_hi + 16 * w.kp + ks * 32, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[4][256];
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if (two) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
  store(c, two ? 4 : 2);
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16"))) void column_pair_small(
    const Weight& w, int64_t pair, const uint16_t* a_hi, int64_t m, int64_t mp, const Out& out) {
  const int64_t nb0 = 2 * pair;
  with_tile_maker(w, [&](const auto& tile) {
    small_pair(w, nb0, nb0 + 1, a_hi, mp, [&](int64_t nb, int64_t ks, uint16_t* d) { tile(nb, ks, d, nullptr); },
               [&](float (*c)[256], int tiles) {
                 for (int q = 0; q < tiles; ++q) store_c_tile(c[q], w, nb0 + q % 2, (q / 2) * 16, m, out);
               });
  });
}

// A fused gate_up weight's gate block j beside its up block j + nbk / 2 (the same B tiles, the same
// products), stored as silu(gate) * up: bf16 [m, nbk / 2 x 16], silu_mul's bits (store_silu_row;
// the INT8 format's per-column scale first, as store_c_tile applies it).
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16"))) void column_pair_gated(
    const Weight& w, int64_t j, int64_t nbk, const uint16_t* a_hi, int64_t m, int64_t mp, at::BFloat16* out) {
  const int64_t inter = nbk / 2 * 16;
  const float* scale = w.fmt == kInt8 ? static_cast<const float*>(w.scale) : nullptr;
  with_tile_maker(w, [&](const auto& tile) {
    small_pair(w, j, j + nbk / 2, a_hi, mp, [&](int64_t nb, int64_t ks, uint16_t* d) { tile(nb, ks, d, nullptr); },
               [&](float (*c)[256], int tiles) {
                 if (scale)
                   for (int q = 0; q < tiles; ++q) {
                     const __m512 sc = _mm512_loadu_ps(scale + (q % 2 ? j + nbk / 2 : j) * 16);
                     for (int r = 0; r < 16; ++r)
                       _mm512_store_ps(c[q] + r * 16, _mm512_mul_ps(_mm512_load_ps(c[q] + r * 16), sc));
                   }
                 for (int q = 0; q < tiles; q += 2)
                   for (int r = 0; r < 16 && (q / 2) * 16 + r < m; ++r)
                     store_silu_row(c[q] + r * 16, c[q + 1] + r * 16, out + ((q / 2) * 16 + r) * inter + j * 16);
               });
  });
}

// The fp32 accumulators of R rows (from r0) x B column blocks (from nb0) into out, the INT8
// format's per-column scale applied (the AVX-512 paths below share it).
template <int R, int B>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void store_acc(
    const Weight& w, const __m512 (&acc)[R][B], int64_t nb0, int64_t r0, void* out, at::ScalarType dtype) {
  const int esize = dtype == at::kBFloat16 ? 2 : 4;
  alignas(64) float row[16];
  for (int b = 0; b < B; ++b) {
    const int64_t col0 = (nb0 + b) * 16;
    if (col0 >= w.n) continue;
    const int cols = static_cast<int>(std::min<int64_t>(16, w.n - col0));
    const float* scale = w.fmt == kInt8 ? static_cast<const float*>(w.scale) + col0 : nullptr;
    for (int r = 0; r < R; ++r) {
      _mm512_store_ps(row, acc[r][b]);
      store_row(row, scale, dtype, static_cast<char*>(out) + ((r0 + r) * w.n + col0) * esize, cols);
    }
  }
}

// acc[r][b] += x[r] . wv[b] for one k pair: row r's pair at a + r * kp (two bf16, broadcast as one
// 32-bit lane), one VDPBF16PS per output.
template <int R, int B>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void dp_pair(
    __m512 (&acc)[R][B], const uint16_t* a, int64_t kp, const __m512bh* wv) {
  for (int r = 0; r < R; ++r) {
    int32_t pairbits;  // memcpy: a broadcast load, no aliasing
    std::memcpy(&pairbits, a + r * kp, 4);
    const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pairbits));
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
  }
}

// acc[r][b] += one K step of rows r0.. of a (from element k0, row stride kp) times the B tiles t[b]:
// per k pair in order, one VDPBF16PS per output. Every AVX-512 path below multiplies through it.
template <int R, int B>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void dp_step(
    __m512 (&acc)[R][B], const uint16_t* a, int64_t kp, int64_t r0, int64_t k0, const uint16_t* const* t) {
  for (int p = 0; p < 16; ++p) {
    __m512bh wv[B];
    for (int b = 0; b < B; ++b) wv[b] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(t[b] + p * 32));
    dp_pair<R, B>(acc, a + r0 * kp + k0 + 2 * p, kp, wv);
  }
}

// R rows (from r0) x B column blocks (from nb0) without AMX: per K step the products in
// column_pair's order (A_hi B_hi, A_hi B_lo, A_lo B_hi); tiles(ks, hi, lo) points hi[b] and lo[b]
// at the K step's tiles (lo read only with w_lo).
template <int R, int B, typename Tiles>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void dp_rows(
    const Weight& w, int64_t nb0, int64_t r0, const uint16_t* a_hi, const uint16_t* a_lo, bool w_lo, Tiles&& tiles,
    void* out, at::ScalarType dtype) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const uint16_t* hi[B];
  const uint16_t* lo[B];
  for (int64_t ks = 0; ks < w.kp / 32; ++ks) {
    tiles(ks, hi, lo);
    dp_step<R, B>(acc, a_hi, w.kp, r0, ks * 32, hi);
    if (w_lo) dp_step<R, B>(acc, a_hi, w.kp, r0, ks * 32, lo);
    if (a_lo) dp_step<R, B>(acc, a_lo, w.kp, r0, ks * 32, hi);
  }
  store_acc<R, B>(w, acc, nb0, r0, out, dtype);
}

// One column pair for every row: its whole K dequantized once (dequant_pair), 8-row tiles over it.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void column_pair_avx512(
    const Weight& w, int64_t pair, const uint16_t* a_hi, const uint16_t* a_lo, bool w_lo, int64_t m, uint16_t* bbuf,
    void* out, at::ScalarType dtype) {
  const PairTiles tiles = dequant_pair(w, pair, w_lo, bbuf);
  auto get = [&](int64_t ks, const uint16_t** hi, const uint16_t** lo) {
    for (int b = 0; b < 2; ++b) {
      hi[b] = tiles.get(b, ks, false);
      lo[b] = w_lo ? tiles.get(b, ks, true) : nullptr;
    }
  };
  constexpr int kRows = 8;  // 16 accumulators, 2 weight vectors
  for (int64_t r0 = 0; r0 < m; r0 += kRows) {
    switch (std::min<int64_t>(kRows, m - r0)) {
      case 8: dp_rows<8, 2>(w, tiles.nb0, r0, a_hi, a_lo, w_lo, get, out, dtype); break;
      case 7: dp_rows<7, 2>(w, tiles.nb0, r0, a_hi, a_lo, w_lo, get, out, dtype); break;
      case 6: dp_rows<6, 2>(w, tiles.nb0, r0, a_hi, a_lo, w_lo, get, out, dtype); break;
      case 5: dp_rows<5, 2>(w, tiles.nb0, r0, a_hi, a_lo, w_lo, get, out, dtype); break;
      case 4: dp_rows<4, 2>(w, tiles.nb0, r0, a_hi, a_lo, w_lo, get, out, dtype); break;
      case 3: dp_rows<3, 2>(w, tiles.nb0, r0, a_hi, a_lo, w_lo, get, out, dtype); break;
      case 2: dp_rows<2, 2>(w, tiles.nb0, r0, a_hi, a_lo, w_lo, get, out, dtype); break;
      default: dp_rows<1, 2>(w, tiles.nb0, r0, a_hi, a_lo, w_lo, get, out, dtype); break;
    }
  }
}

// Decode sizes (M <= 4) without AMX, where no direct path below makes the weight rows in registers
// (float32 activations, whose weights also need their remainder tiles; the BF16 format, read in
// place): B column blocks at once (B / 2 pairs), each K step's tiles dequantized into a small
// buffer that stays in L1 and multiplied at once, the rows' accumulators in
// registers over all of K: B independent chains per row instead of two, and no whole-K buffer
// through L2. The tiles hold dequant_tile's values and every output takes the same products in
// the same order as column_pair_avx512's, so both paths give the same bits (tests: M = 1..64, 100,
// 300).
template <int B>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void small_rows(
    int64_t m, const Weight& w, int64_t nb0, const uint16_t* a_hi, const uint16_t* a_lo, bool w_lo, uint16_t* buf,
    void* out, at::ScalarType dtype) {
  const int64_t kb = w.kp / 32;
  auto get = [&](int64_t ks, const uint16_t** hi, const uint16_t** lo) {
    for (int b = 0; b < B; ++b) {
      if (w.fmt == kBf16) {  // already B tiles: read in place
        hi[b] = static_cast<const uint16_t*>(w.codes) + ((nb0 + b) * kb + ks) * 512;
        lo[b] = w.zero ? static_cast<const uint16_t*>(w.zero) + ((nb0 + b) * kb + ks) * 512 : nullptr;
      } else {
        hi[b] = buf + b * 512;
        lo[b] = buf + (B + b) * 512;
        dequant_tile(w, nb0 + b, ks, buf + b * 512, w_lo ? buf + (B + b) * 512 : nullptr);
      }
    }
  };
  switch (m) {
    case 4: dp_rows<4, B>(w, nb0, 0, a_hi, a_lo, w_lo, get, out, dtype); break;
    case 3: dp_rows<3, B>(w, nb0, 0, a_hi, a_lo, w_lo, get, out, dtype); break;
    case 2: dp_rows<2, B>(w, nb0, 0, a_hi, a_lo, w_lo, get, out, dtype); break;
    default: dp_rows<1, B>(w, nb0, 0, a_hi, a_lo, w_lo, get, out, dtype); break;
  }
}

// INT8 and Q8_0 at decode sizes with bf16 activations: small_rows' products in its order, each
// k-pair row of a tile made into bf16 in a register as dequant_tile makes it (codes to fp32, times
// d for Q8_0, one rounding) and multiplied at once, without the store to and reload from L1.
// Measured (AMD EPYC Zen 4, the default model's matmuls at one row, one process alternating with
// the buffered path): Q8_0 9.2-13.3 -> 8.2-10.3 ms a token, int8 13.5 -> 10.6; in gguf mode the
// tied lm_head is Q8_0, a third of a token's bytes.
template <int R, int B>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void q8_rows_direct(
    const Weight& w, int64_t nb0, const uint16_t* a, void* out, at::ScalarType dtype) {
  const int64_t kb = w.kp / 32;
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t ks = 0; ks < kb; ++ks) {
    const int8_t* src[B];
    __m512 dlo[B], dhi[B];
    for (int b = 0; b < B; ++b) {
      const int64_t tile = (nb0 + b) * kb + ks;
      src[b] = static_cast<const int8_t*>(w.codes) + tile * 512;
      dlo[b] = dhi[b] = _mm512_set1_ps(1.f);
      if (w.fmt == kQ8_0)
        expand_cols(f16x16(static_cast<const uint16_t*>(w.scale) + tile * 16), dlo[b], dhi[b]);
    }
    for (int p = 0; p < 16; ++p) {
      __m512bh wv[B];
      for (int b = 0; b < B; ++b) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[b] + p * 32));
        __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
        __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
        if (w.fmt == kQ8_0) {
          f0 = _mm512_mul_ps(f0, dlo[b]);
          f1 = _mm512_mul_ps(f1, dhi[b]);
        }
        wv[b] = _mm512_cvtne2ps_pbh(f1, f0);
      }
      dp_pair<R, B>(acc, a + ks * 32 + 2 * p, w.kp, wv);
    }
  }
  store_acc<R, B>(w, acc, nb0, 0, out, dtype);
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) void q8_direct_block(
    int64_t rows, const Weight& w, int64_t nb, const uint16_t* a, void* out, at::ScalarType dtype) {
  switch (rows) {
    case 4: q8_rows_direct<4, 1>(w, nb, a, out, dtype); break;
    case 3: q8_rows_direct<3, 1>(w, nb, a, out, dtype); break;
    case 2: q8_rows_direct<2, 1>(w, nb, a, out, dtype); break;
    default: q8_rows_direct<1, 1>(w, nb, a, out, dtype); break;
  }
}

// The KQ formats (the layers' GGUF Q4/Q5 blocks) at decode sizes with bf16 activations, as
// q8_rows_direct: small_rows' products in its order, each k-pair row of a tile made in registers as
// kq_tile makes it (kq_row, one rounding to bf16) and multiplied at once, without the store to and
// reload from L1. Measured (AMD EPYC Zen 4, the default model's 120 Q4_1 layer linears, one process
// alternating with the buffered path, median of 15): 1 row 5.89-6.93 -> 5.15-5.37 ms, 4 rows
// 6.66-7.11 -> 6.12-6.36. B column blocks at a time; run's decode dispatch takes one (see there).
template <int R, int B, int P>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void kq_rows_direct(
    const Weight& w, int64_t nb0, const uint16_t* a, void* out, at::ScalarType dtype) {
  const int64_t kb = w.kp / 32;
  const bool halves = w.kind == kQ6_K;  // the only kind whose two halves scale differently
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t ks = 0; ks < kb; ++ks) {
    const uint8_t* src[B];
    const int32_t* planes[B];
    __m512 s1[B], z1[B], slo[B], shi[B], zlo[B], zhi[B];
    for (int b = 0; b < B; ++b) {
      const int64_t tile = (nb0 + b) * kb + ks;
      src[b] = static_cast<const uint8_t*>(w.codes) + tile * 256;
      planes[b] = w.planes + tile * 16 * P;
      __m512 s0, z0;
      kq_scales(w, nb0 + b, ks, s0, z0, s1[b], z1[b]);
      expand_cols(s0, slo[b], shi[b]);
      expand_cols(z0, zlo[b], zhi[b]);
    }
    for (int p = 0; p < 16; ++p) {
      if (p == 8 && halves)
        for (int b = 0; b < B; ++b) {
          expand_cols(s1[b], slo[b], shi[b]);
          expand_cols(z1[b], zlo[b], zhi[b]);
        }
      __m512bh wv[B];
      for (int b = 0; b < B; ++b) {
        __m512 f0, f1;
        kq_row<P>(src[b], planes[b], p, slo[b], shi[b], zlo[b], zhi[b], f0, f1);
        wv[b] = _mm512_cvtne2ps_pbh(f1, f0);
      }
      dp_pair<R, B>(acc, a + ks * 32 + 2 * p, w.kp, wv);
    }
  }
  store_acc<R, B>(w, acc, nb0, 0, out, dtype);
}

template <int P>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void kq_direct_rows(
    int64_t rows, const Weight& w, int64_t nb, const uint16_t* a, void* out, at::ScalarType dtype) {
  switch (rows) {
    case 8: kq_rows_direct<8, 1, P>(w, nb, a, out, dtype); break;
    case 7: kq_rows_direct<7, 1, P>(w, nb, a, out, dtype); break;
    case 6: kq_rows_direct<6, 1, P>(w, nb, a, out, dtype); break;
    case 5: kq_rows_direct<5, 1, P>(w, nb, a, out, dtype); break;
    case 4: kq_rows_direct<4, 1, P>(w, nb, a, out, dtype); break;
    case 3: kq_rows_direct<3, 1, P>(w, nb, a, out, dtype); break;
    case 2: kq_rows_direct<2, 1, P>(w, nb, a, out, dtype); break;
    default: kq_rows_direct<1, 1, P>(w, nb, a, out, dtype); break;
  }
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) void kq_direct_block(
    int64_t rows, const Weight& w, int64_t nb, const uint16_t* a, void* out, at::ScalarType dtype) {
  if (w.nplanes == 0) return kq_direct_rows<0>(rows, w, nb, a, out, dtype);
  if (w.nplanes == 1) return kq_direct_rows<1>(rows, w, nb, a, out, dtype);
  kq_direct_rows<2>(rows, w, nb, a, out, dtype);
}

constexpr int64_t kSmallRows = 4;
// The KQ direct path's rows (gguf_codes.CODES_MAX_ROWS_AVX512): at 5-8 rows it still beats the bf16
// weights (the default model's 120 layer linears at 5 / 6 / 8 rows 6.1 / 6.8 / 7.7 ms against 7.3 /
// 7.7 / 9.0, AMD EPYC Zen 4), where the Q8_0 lm_head no longer does (1.9 / 2.1 / 2.3 against 1.7 /
// 1.8 / 2.2: its codes stay at kSmallRows).
constexpr int64_t kKQDirectRows = 8;

// ---- INT4 without AMX: scale and zero per group applied to the partial sum ----------------------
// The codes q - 8 are exact in bf16, so the AVX-512 arithmetic multiplies them as they are and
// applies a group's scale and zero once per output: per group, part = VDPBF16PS chain of x with
// (q - 8) over the group's k pairs in order (per K step the hi products, then the lo ones), then
// acc = fma(part, s, acc), acc = fma(sum_x, z, acc), sum_x the row's fixed-order sum of x over the
// group. The same value as sum_k x (q - 8) s + z up to fp32 rounding (no bf16 rounding of W), with
// no per-weight fma or rounding: a nibble becomes its bf16 through one table lookup (vpermw).
// Every row count takes this arithmetic (it is the format's only AVX-512 one).

__attribute__((target("avx512f,avx512bw"))) inline __m512i int4_lut() {
  alignas(64) uint16_t t[32];
  for (int q = 0; q < 32; ++q) {
    const float v = static_cast<float>(q % 16 - 8);  // exact in bf16: the top 16 bits
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    t[q] = static_cast<uint16_t>(bits >> 16);
  }
  return _mm512_load_si512(t);
}

// One k-pair row of an INT4 tile (16 bytes: element i the low nibble of byte i, i + 16 the high
// one) as its 32 bf16 (q - 8), in a register: the 16 bytes widened twice, the second copy shifted
// down a nibble, then one table lookup. vpermw reads only an index's low 5 bits and the table
// repeats q - 8 over 16..31, so the first copy's high nibble needs no mask.
__attribute__((target("avx512f,avx512bw"))) inline __m512i int4_row_bf16(const uint8_t* src, __m512i lut) {
  const __m512i shifts = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                          0x0004000400040004, 0, 0, 0, 0);
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(src))));
  return _mm512_permutexvar_epi16(_mm512_srlv_epi16(b, shifts), lut);
}

// Tile (nb, ks) of an INT4 weight as bf16 (q - 8) in VNNI order (the B tile layout).
__attribute__((target("avx512f,avx512bw"))) void int4_codes_tile(const Weight& w, int64_t nb, int64_t ks,
                                                                   uint16_t* dst) {
  static const __m512i lut = int4_lut();
  const uint8_t* src = static_cast<const uint8_t*>(w.codes) + (nb * (w.kp / 32) + ks) * 256;
  for (int r = 0; r < 16; ++r) _mm512_storeu_si512(dst + r * 32, int4_row_bf16(src + r * 16, lut));
}

// Each row's sum of x over each group (hi + lo for float32 x), 16 lanes over the group's K in
// order, then a fixed tree: sums[r * groups + g].
__attribute__((target("avx512f,avx512bw"))) void int4_group_sums(const uint16_t* a_hi, const uint16_t* a_lo,
                                                                    int64_t m, int64_t kp, int64_t groups,
                                                                    float* sums) {
  const int64_t per = kp / groups;
  auto widen = [](const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(p))), 16));
  };
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = g * per; k < (g + 1) * per; k += 16) {
        __m512 v = widen(a_hi + r * kp + k);
        if (a_lo) v = _mm512_add_ps(v, widen(a_lo + r * kp + k));
        acc = _mm512_add_ps(acc, v);
      }
      alignas(64) float l[16];
      _mm512_store_ps(l, acc);
      float h8[8], h4[4];
      for (int i = 0; i < 8; ++i) h8[i] = l[i] + l[i + 8];
      for (int i = 0; i < 4; ++i) h4[i] = h8[i] + h8[i + 4];
      sums[r * groups + g] = (h4[0] + h4[2]) + (h4[1] + h4[3]);
    }
}

// Group g's partial sums into the accumulators: acc = fma(part, s, acc), then acc = fma(sum_x, z,
// acc), sum_x row r's sum over the group (sums[r * groups + g]).
template <int R, int B>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void int4_apply_group(
    const Weight& w, int64_t nb0, int64_t g, const float* sums, const __m512 (&part)[R][B], __m512 (&acc)[R][B]) {
  for (int b = 0; b < B; ++b) {
    const int64_t sidx = ((nb0 + b) * w.groups + g) * 16;
    const __m512 sv = bf16x16(static_cast<const uint16_t*>(w.scale) + sidx);
    const __m512 zv = bf16x16(static_cast<const uint16_t*>(w.zero) + sidx);
    for (int r = 0; r < R; ++r) {
      acc[r][b] = _mm512_fmadd_ps(part[r][b], sv, acc[r][b]);
      acc[r][b] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * w.groups + g]), zv, acc[r][b]);
    }
  }
}

// R rows (from r0) x B column blocks (from nb0) over all groups; tiles(ks, t) points t[0..B) at
// the K step's (q - 8) tiles.
template <int R, int B, typename Tiles>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void int4_rows(
    const Weight& w, int64_t nb0, int64_t r0, const uint16_t* a_hi, const uint16_t* a_lo, const float* sums,
    Tiles&& tiles, void* out, at::ScalarType dtype) {
  const int64_t kb = w.kp / 32, per = kb / w.groups;
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const uint16_t* t[B];
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 part[R][B];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) part[r][b] = _mm512_setzero_ps();
    for (int64_t ks = g * per; ks < (g + 1) * per; ++ks) {
      tiles(ks, t);
      dp_step<R, B>(part, a_hi, w.kp, r0, ks * 32, t);
      if (a_lo) dp_step<R, B>(part, a_lo, w.kp, r0, ks * 32, t);
    }
    int4_apply_group<R, B>(w, nb0, g, sums + r0 * w.groups, part, acc);
  }
  store_acc<R, B>(w, acc, nb0, r0, out, dtype);  // INT4: no per-column scale (w.fmt is not INT8)
}

// Decode sizes with bf16 activations: int4_rows' products in its order (per group, a chain over
// the K steps and their k pairs in order, then the same two fmas), each weight row turned into
// bf16 in a register as it is used. The L1 round trip of int4_codes_tile (a store and a reload of
// every weight vector) had cost more than the products at one row: the default model's matmuls
// at one row 8.2-10.8 -> 6.3-7.2 ms a token (AMD EPYC Zen 4, `benchmarks/gemv.py --act-dtype
// bfloat16`, two alternating pairs).
template <int R, int B>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void int4_rows_direct(
    const Weight& w, int64_t nb0, const uint16_t* a, const float* sums, void* out, at::ScalarType dtype) {
  static const __m512i lut = int4_lut();
  const int64_t kb = w.kp / 32, per = kb / w.groups;
  const uint8_t* src[B];
  for (int b = 0; b < B; ++b) src[b] = static_cast<const uint8_t*>(w.codes) + (nb0 + b) * kb * 256;
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 part[R][B];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) part[r][b] = _mm512_setzero_ps();
    for (int64_t p = g * per * 16; p < (g + 1) * per * 16; ++p) {  // k pairs of the group, in order
      __m512bh wv[B];
      for (int b = 0; b < B; ++b) wv[b] = reinterpret_cast<__m512bh>(int4_row_bf16(src[b] + p * 16, lut));
      dp_pair<R, B>(part, a + 2 * p, w.kp, wv);
    }
    int4_apply_group<R, B>(w, nb0, g, sums, part, acc);
  }
  store_acc<R, B>(w, acc, nb0, 0, out, dtype);
}

template <int B>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void int4_direct_tile(
    int64_t rows, const Weight& w, int64_t nb0, const uint16_t* a, const float* sums, void* out, at::ScalarType dtype) {
  switch (rows) {
    case 3: int4_rows_direct<3, B>(w, nb0, a, sums, out, dtype); break;
    case 2: int4_rows_direct<2, B>(w, nb0, a, sums, out, dtype); break;
    default: int4_rows_direct<1, B>(w, nb0, a, sums, out, dtype); break;
  }
}

template <int B, typename Tiles>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void int4_row_tile(
    int64_t rows, const Weight& w, int64_t nb0, int64_t r0, const uint16_t* a_hi, const uint16_t* a_lo,
    const float* sums, Tiles&& tiles, void* out, at::ScalarType dtype) {
  switch (rows) {  // B = 4: up to 3 rows (24 accumulators + 4 weights); B = 2: up to 6
    case 6: if constexpr (B <= 2) int4_rows<6, B>(w, nb0, r0, a_hi, a_lo, sums, tiles, out, dtype); break;
    case 5: if constexpr (B <= 2) int4_rows<5, B>(w, nb0, r0, a_hi, a_lo, sums, tiles, out, dtype); break;
    case 4: if constexpr (B <= 2) int4_rows<4, B>(w, nb0, r0, a_hi, a_lo, sums, tiles, out, dtype); break;
    case 3: int4_rows<3, B>(w, nb0, r0, a_hi, a_lo, sums, tiles, out, dtype); break;
    case 2: int4_rows<2, B>(w, nb0, r0, a_hi, a_lo, sums, tiles, out, dtype); break;
    default: int4_rows<1, B>(w, nb0, r0, a_hi, a_lo, sums, tiles, out, dtype); break;
  }
}

// The small-row paths' tasks: the column pairs [0, nbk / 2) in one even, contiguous share per
// thread (at::parallel_for's split), each share walked two pairs (four 16-column blocks) at a
// time; `tile(nb0, blocks)` gets blocks 4, or 2 for an odd share's last pair. Two-pair groups
// dealt out by count went 4 / 5 to two threads for a 576-column weight (9 groups): the o and down
// projections of a one-row decode ran on the longer share's time.
template <typename Tile>
void for_pair_groups(int64_t nbk, const Tile& tile) {
  at::parallel_for(0, nbk / 2, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p += 2) tile(2 * p, p + 2 <= p1 ? 4 : 2);
  });
}

// Every output of an INT4 weight without AMX. Up to 3 rows: two column pairs per task, with bf16
// activations a block at a time, each weight row made in a register as it is used
// (int4_rows_direct), with float32 ones each K step's four tiles made in an L1 buffer (read twice,
// for hi and lo); more rows: one pair per task, its whole K made once into bbuf and read by every
// 6-row tile.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void int4_avx512(
    const Weight& w, int64_t nbk, const uint16_t* a_hi, const uint16_t* a_lo, int64_t m, void* out,
    at::ScalarType dtype) {
  const int64_t kb = w.kp / 32;
  std::vector<float> sums(static_cast<size_t>(m * w.groups));
  int4_group_sums(a_hi, a_lo, m, w.kp, w.groups, sums.data());
  const float* sp = sums.data();
  if (m <= 3 && !a_lo) {
    // One column block at a time (one weight stream a thread), as run's direct decode:
    // `--quantization int4` on the default model, one sequence, 5.66-5.74 -> 5.17-5.21 ms a token
    // (Zen 4, alternating in one process).
    for_pair_groups(nbk, [&](int64_t nb0, int blocks) {
      for (int i = 0; i < blocks; ++i) int4_direct_tile<1>(m, w, nb0 + i, a_hi, sp, out, dtype);
    });
    return;
  }
  if (m <= 3) {
    for_pair_groups(nbk, [&](int64_t nb0, int blocks) {
      alignas(64) uint16_t buf[4 * 512];
      auto tiles = [&](int64_t ks, const uint16_t** t) {
        for (int b = 0; b < blocks; ++b) {
          int4_codes_tile(w, nb0 + b, ks, buf + b * 512);
          t[b] = buf + b * 512;
        }
      };
      if (blocks == 4)
        int4_row_tile<4>(m, w, nb0, 0, a_hi, a_lo, sp, tiles, out, dtype);
      else
        int4_row_tile<2>(m, w, nb0, 0, a_hi, a_lo, sp, tiles, out, dtype);
    });
    return;
  }
  at::parallel_for(0, nbk / 2, 1, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<uint16_t> bbuf;
    if (bbuf.size() < size_t(kb * 2 * 512)) bbuf.resize(kb * 2 * 512);
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t ks = 0; ks < kb; ++ks)
        for (int b = 0; b < 2; ++b) int4_codes_tile(w, 2 * p + b, ks, bbuf.data() + (ks * 2 + b) * 512);
      auto tiles = [&](int64_t ks, const uint16_t** t) {
        t[0] = bbuf.data() + ks * 2 * 512;
        t[1] = t[0] + 512;
      };
      for (int64_t r0 = 0; r0 < m; r0 += 6)
        int4_row_tile<2>(std::min<int64_t>(6, m - r0), w, 2 * p, r0, a_hi, a_lo, sp, tiles, out, dtype);
    }
  });
}

// -1 the machine's arithmetic (AMX where it has it), 0 AVX-512 BF16, 1 AMX: set_arithmetic lets
// tests run both on a CPU with AMX; the engine never changes it.
int64_t g_arithmetic = -1;

bool use_amx() {
  static const bool has = __builtin_cpu_supports("amx-bf16") && amx_permitted();
  TORCH_CHECK(g_arithmetic != 1 || has, "tessera_qgemm: AMX asked for, and this CPU or the OS does not give it");
  TORCH_CHECK(g_arithmetic == 1 || has || __builtin_cpu_supports("avx512bf16"),
              "tessera_qgemm: this CPU has neither AMX nor AVX-512 BF16");
  return g_arithmetic < 0 ? has : g_arithmetic == 1;
}

void set_arithmetic(int64_t arithmetic) {
  TORCH_CHECK(arithmetic >= -1 && arithmetic <= 1, "tessera_qgemm.set_arithmetic: -1, 0 or 1");
  g_arithmetic = arithmetic;
}

// The column pairs [0, pairs) of one call over its threads. Each thread walks an even contiguous
// share from its front (the order prefetch_pair_ahead reads ahead in); a thread whose share is done
// takes the back half of what another has left, as its share, and walks that from its front. Two
// equal static shares had ended ~5 us apart in a decode-size call (the threads' memory traffic is
// not shared evenly) and the call waited for the later one. Which thread computes a pair does not
// change its bits.
class PairQueue {
 public:
  PairQueue(int64_t pairs, int64_t threads) : shares_(new Share[threads]), threads_(threads) {
    for (int64_t i = 0; i < threads; ++i)
      shares_[i].range.store(pack(pairs * i / threads, pairs * (i + 1) / threads), std::memory_order_relaxed);
  }

  // The next pair for thread `self`, or -1 when every pair is taken.
  int64_t next(int64_t self) {
    Share& own = shares_[self];
    for (;;) {
      uint64_t r = own.range.load(std::memory_order_relaxed);
      while (front(r) < back(r))
        if (own.range.compare_exchange_weak(r, pack(front(r) + 1, back(r)), std::memory_order_relaxed)) return front(r);
      if (!steal(self)) return -1;
    }
  }

 private:
  struct alignas(64) Share {
    std::atomic<uint64_t> range;  // front | back << 32: the pairs [front, back) not yet taken
  };
  static uint64_t pack(uint64_t f, uint64_t b) { return f | b << 32; }
  static uint64_t front(uint64_t r) { return r & 0xffffffffu; }
  static uint64_t back(uint64_t r) { return r >> 32; }

  // The back half (rounded up) of the first other share with pairs left becomes self's share.
  bool steal(int64_t self) {
    for (int64_t j = 1; j < threads_; ++j) {
      Share& victim = shares_[(self + j) % threads_];
      uint64_t r = victim.range.load(std::memory_order_relaxed);
      while (front(r) < back(r)) {
        const uint64_t mid = front(r) + (back(r) - front(r)) / 2;
        if (victim.range.compare_exchange_weak(r, pack(front(r), mid), std::memory_order_relaxed)) {
          shares_[self].range.store(pack(mid, back(r)), std::memory_order_relaxed);
          return true;
        }
      }
    }
    return false;
  }

  std::unique_ptr<Share[]> shares_;
  int64_t threads_;
};

// Every column pair of the weight for every activation row of x (the caller checked w). With
// logits (bf16 x on AMX only): fp32 out holding the bf16-rounded values, and with argmax each
// row's first maximum of them (the chunks are runs of column pairs, in order); store false (with
// argmax): the maxima only, out [M, 0]. gated (decode sizes on AMX only: gated_of): silu(gate) * up
// of a fused gate_up weight, bf16 [M, n / 2].
at::Tensor run(const at::Tensor& x, const Weight& w, int64_t nbk, bool logits = false,
               ArgmaxCollector* argmax = nullptr, bool store = true, bool gated = false) {
  const int64_t n = w.n, kp = w.kp, kb = kp / 32, fmt = w.fmt, k = x.size(1), m = x.size(0);
  const int64_t mp = std::max<int64_t>(16, (m + 15) / 16 * 16);
  // The A operands, K padded with zeros, reused across calls (no per-call page faults). The rows
  // past m are not cleared: they only reach C rows that are never stored (and no per-row sum reads
  // them), so what an earlier call left there changes nothing; clearing all of them had been a
  // 16-row memset per call at one row.
  thread_local std::vector<uint16_t> abuf;
  const bool split = x.scalar_type() == at::kFloat;
  const size_t need = size_t(mp * kp) * (split ? 2 : 1);
  if (abuf.size() < need) abuf.resize(need);
  const bool amx = use_amx();
  // Decode sizes on AMX (column_pair_small) configure the A tiles to the call's rows, so bf16 x
  // whose rows need no K padding is read in place: no serial copy before the threads start.
  const bool small = amx && mp <= 32 && !split && fmt != kBf16;
  const uint16_t* a_hi = abuf.data();
  uint16_t* a_lo = split ? abuf.data() + mp * kp : nullptr;
  if (small && kp == k && m > 0)
    a_hi = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  else
    pack_a(x, m, k, kp, abuf.data(), a_lo);
  TORCH_CHECK(!gated || (small && n == w.np), "tessera_qgemm: a gated call takes the decode-size AMX path");
  const int64_t n_out = !store ? 0 : gated ? n / 2 : n;
  auto out = at::empty({m, n_out}, x.options().dtype(logits ? at::kFloat : x.scalar_type()));
  void* outp = store ? out.data_ptr() : nullptr;
  const at::ScalarType dtype = x.scalar_type();
  // float32 activations also take the weight's remainder where W is not exact in bf16.
  const bool w_lo = split && (fmt == kQ8_0 || fmt == kInt4 || fmt == kKQ || (fmt == kBf16 && w.zero));
  TORCH_CHECK(!logits || (amx && !split), "tessera_qgemm: logits from bf16 activations on AMX only");
  TORCH_CHECK(store || argmax, "tessera_qgemm: nothing to return without the logits or their argmax");
  if (!amx && fmt == kInt4) {
    int4_avx512(w, nbk, a_hi, a_lo, m, outp, dtype);
    return out;
  }
  // Decode sizes with bf16 x: each weight row made in registers as it is multiplied (INT8 and Q8_0
  // up to kSmallRows, the KQ formats up to kKQDirectRows), one column block at a time. A block's
  // tiles are one run of memory; four blocks at once (as here until session 44) were four streams a
  // thread, and this memory-bound call ran slower for it. AMD EPYC Zen 4 (model 17), the engine's
  // bf16 step on the default model's Q4_1 layers and Q8_0 lm_head, the two alternating in one
  // process, ms: 1 sequence 7.31-7.56 -> 6.31-6.39, 2 7.98-8.13 -> 7.14-7.25, 4 9.68-9.84 ->
  // 8.89-8.96, 6 11.4-11.5 -> 10.8-11.1, 8 12.4-14.1 -> 11.9-13.4; Gemma 3 270M (Q4_K_M) one
  // sequence 13.0-13.3 -> 11.2-11.5. The same products in the same order: the same bits.
  const bool q8_direct = m <= kSmallRows && (fmt == kInt8 || fmt == kQ8_0);
  const bool kq_direct = m <= kKQDirectRows && fmt == kKQ;
  if (!amx && !a_lo && (q8_direct || kq_direct)) {
    for_pair_groups(nbk, [&](int64_t nb0, int blocks) {
      for (int i = 0; i < blocks; ++i)
        (kq_direct ? kq_direct_block : q8_direct_block)(m, w, nb0 + i, a_hi, outp, dtype);
    });
    return out;
  }
  if (!amx && m <= kSmallRows) {
    // Two column pairs per task (four blocks; a share's last task may hold one pair).
    for_pair_groups(nbk, [&](int64_t nb0, int blocks) {
      alignas(64) uint16_t buf[8 * 512];
      if (blocks == 4)
        small_rows<4>(m, w, nb0, a_hi, a_lo, w_lo, buf, outp, dtype);
      else
        small_rows<2>(m, w, nb0, a_hi, a_lo, w_lo, buf, outp, dtype);
    });
    return out;
  }
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nbk / 2));
  PairQueue queue(nbk / 2, threads);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<uint16_t> bbuf;
    if (bbuf.size() < size_t(kb * 4 * 512)) bbuf.resize(kb * 4 * 512);
    if (amx) configure_tiles(small ? m : 0);
    std::unique_ptr<ArgmaxChunk> chunk(argmax ? argmax->chunk() : nullptr);
    const Out o{outp, dtype, logits, chunk.get()};
    int64_t run0 = -1, last = -2;  // the argmax chunk's run of consecutive pairs (none yet)
    for (int64_t self = t0; self < t1; ++self)
      for (int64_t p = queue.next(self); p >= 0; p = queue.next(self)) {
        if (chunk && p != last + 1) {
          if (run0 >= 0) argmax->add(run0, *chunk);
          chunk->reset();
          run0 = p;
        }
        last = p;
        if (!amx)
          column_pair_avx512(w, p, a_hi, a_lo, w_lo, m, bbuf.data(), outp, dtype);
        else if (gated)
          column_pair_gated(w, p, nbk, a_hi, m, mp, static_cast<at::BFloat16*>(outp));
        else if (small)
          column_pair_small(w, p, a_hi, m, mp, o);
        else
          column_pair(w, p, a_hi, a_lo, w_lo, m, mp, bbuf.data(), o);
      }
    if (amx) release_tiles();
    if (chunk && run0 >= 0) argmax->add(run0, *chunk);
  });
  return out;
}


// qgemm's weight, its tensors checked against fmt.
Weight checked_weight(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& zero, int64_t fmt, int64_t n, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.is_contiguous(), "tessera_qgemm: x must be contiguous [M, ", k, "]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "tessera_qgemm: x bf16 or fp32");
  TORCH_CHECK(codes.dim() >= 2 && codes.is_contiguous(), "tessera_qgemm: codes must be contiguous tiles");
  const int64_t nbk = codes.size(0), kb = codes.size(1), np = nbk * 16, kp = kb * 32;
  TORCH_CHECK(nbk % 2 == 0 && np >= n && kp >= k && kp - k < 32, "tessera_qgemm: tiles do not fit [", n, ", ", k, "]");
  Weight w{fmt, n, np, kp, 0, codes.data_ptr(), scale.data_ptr(), nullptr};
  if (fmt == kInt8) {
    TORCH_CHECK(codes.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat && scale.numel() == np,
                "tessera_qgemm int8: codes int8, scale float32 [Np]");
  } else if (fmt == kQ8_0) {
    TORCH_CHECK(codes.scalar_type() == at::kChar && scale.scalar_type() == at::kHalf && scale.numel() == np * kb,
                "tessera_qgemm q8_0: codes int8, d float16 [Nb, Kb, 16]");
  } else if (fmt == kInt4) {
    TORCH_CHECK(zero.has_value() && codes.scalar_type() == at::kByte && scale.scalar_type() == at::kBFloat16 &&
                    zero->scalar_type() == at::kBFloat16 && scale.dim() == 3 && zero->sizes() == scale.sizes(),
                "tessera_qgemm int4: codes uint8, scale and zero bf16 [Nb, G, 16]");
    w.groups = scale.size(1);
    w.zero = zero->data_ptr();
    TORCH_CHECK(kb % w.groups == 0, "tessera_qgemm int4: groups must be a whole number of 32-wide K steps");
  } else {
    TORCH_CHECK(fmt == kBf16 && codes.scalar_type() == at::kBFloat16, "tessera_qgemm: unknown format ", fmt);
    if (zero.has_value()) {  // the weight's remainder tiles (float32 activations)
      TORCH_CHECK(zero->sizes() == codes.sizes() && zero->scalar_type() == at::kBFloat16 && zero->is_contiguous(),
                  "tessera_qgemm bf16: the remainder tiles must match the codes");
      w.zero = zero->data_ptr();
    }
  }
  return w;
}

at::Tensor qgemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                 const c10::optional<at::Tensor>& zero, int64_t fmt, int64_t n, int64_t k) {
  return run(x, checked_weight(x, codes, scale, zero, fmt, n, k), codes.size(0));
}

// The logits of an lm_head from its quantized tiles: fp32 [M, n] holding the bf16-rounded values
// (as linear_bf16(..., f32_out=True) stores them: qgemm's bf16 output, widened), and with argmax
// each row's first maximum of them, found in the store epilogue (as linear_bf16_argmax); ids is
// empty without. bf16 x: the lm_head of a GGUF (Q8_0 blocks, in the bf16 engine or in gguf mode).
// Without AMX the other arithmetic's output is widened and torch.argmax finds the ids. With logits
// false (argmax true) the logits are [M, 0]: a greedy step that reads nothing else.
std::tuple<at::Tensor, at::Tensor> logits_of(const at::Tensor& x, const Weight& w, int64_t nbk, bool argmax,
                                             bool logits_too) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "tessera_qgemm: logits from bf16 x only");
  TORCH_CHECK(argmax || logits_too, "tessera_qgemm: logits=False needs argmax=True");
  const int64_t m = x.size(0);
  if (!use_amx()) {  // the AVX-512 arithmetic (no AMX, or a test's set_arithmetic(0)): its output widened
    at::Tensor logits = run(x, w, nbk).to(at::kFloat);
    at::Tensor ids = argmax ? logits.argmax(-1) : at::empty({0}, x.options().dtype(at::kLong));
    return {logits_too ? logits : logits.narrow(1, 0, 0), ids};
  }
  ArgmaxCollector collector(m);
  at::Tensor logits = run(x, w, nbk, true, argmax ? &collector : nullptr, logits_too);
  at::Tensor ids = at::empty({argmax ? m : 0}, x.options().dtype(at::kLong));
  if (argmax && m > 0) collector.finish(ids.data_ptr<int64_t>());
  return {logits, ids};
}

std::tuple<at::Tensor, at::Tensor> qgemm_logits(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                                const c10::optional<at::Tensor>& zero, int64_t fmt, int64_t n,
                                                int64_t k, bool argmax, bool logits) {
  return logits_of(x, checked_weight(x, codes, scale, zero, fmt, n, k), codes.size(0), argmax, logits);
}

// GGUF K-quant and Q5 weights (the KQ format above): kind 0 Q5_0, 1 Q5_1, 2 Q4_K / Q5_K, 3 Q6_K.
Weight checked_kq_weight(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& planes, const at::Tensor& sup,
                         const c10::optional<at::Tensor>& sub, int64_t kind, int64_t n, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.is_contiguous(), "tessera_qgemm: x must be contiguous [M, ", k, "]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "tessera_qgemm: x bf16 or fp32");
  TORCH_CHECK(codes.dim() == 4 && codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.size(2) == 16 &&
                  codes.size(3) == 16, "tessera_qgemm.kq: codes must be uint8 nibble tiles [Nb, Kb, 16, 16]");
  const int64_t nbk = codes.size(0), kb = codes.size(1), np = nbk * 16, kp = kb * 32;
  TORCH_CHECK(nbk % 2 == 0 && np >= n && kp == k, "tessera_qgemm.kq: tiles do not fit [", n, ", ", k, "]");
  TORCH_CHECK(kind >= kQ5_0 && kind <= kQ4_0, "tessera_qgemm.kq: unknown kind ", kind);
  TORCH_CHECK(planes.scalar_type() == at::kInt && planes.is_contiguous() && planes.dim() == 4 &&
                  planes.size(0) == nbk && planes.size(1) == kb && planes.size(2) == 16 && planes.size(3) <= 2,
              "tessera_qgemm.kq: planes must be int32 [Nb, Kb, 16, P <= 2]");
  const int64_t fields = (kind == kQ5_1 || kind == kQK) ? 2 : 1;
  TORCH_CHECK(sup.scalar_type() == at::kHalf && sup.is_contiguous() && sup.dim() == 4 && sup.size(0) == nbk &&
                  sup.size(2) == fields && sup.size(3) == 16 && kb % sup.size(1) == 0,
              "tessera_qgemm.kq: sup must be float16 [Nb, S, ", fields, ", 16] with S dividing K / 32");
  const bool has_sub = kind == kQK || kind == kQ6_K;
  TORCH_CHECK(!has_sub || (sub.has_value() && sub->is_contiguous() && sub->element_size() == 1 &&
                           sub->numel() == nbk * kb * 32),
              "tessera_qgemm.kq: Q4_K/Q5_K/Q6_K need sub, 1-byte [Nb, Kb, 2, 16]");
  Weight w{kKQ, n, np, kp, sup.size(1), codes.data_ptr(), sup.data_ptr(), nullptr};
  w.planes = planes.data_ptr<int32_t>();
  w.nplanes = planes.size(3);
  w.kind = kind;
  w.sup_fields = fields;
  w.sub = has_sub ? sub->data_ptr() : nullptr;
  return w;
}

at::Tensor kqgemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& planes, const at::Tensor& sup,
                  const c10::optional<at::Tensor>& sub, int64_t kind, int64_t n, int64_t k) {
  return run(x, checked_kq_weight(x, codes, planes, sup, sub, kind, n, k), codes.size(0));
}

// qgemm_logits for the KQ format (an lm_head of Q6_K or Q4_K blocks, as many K-quant files have).
std::tuple<at::Tensor, at::Tensor> kqgemm_logits(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& planes,
                                                 const at::Tensor& sup, const c10::optional<at::Tensor>& sub,
                                                 int64_t kind, int64_t n, int64_t k, bool argmax, bool logits) {
  return logits_of(x, checked_kq_weight(x, codes, planes, sup, sub, kind, n, k), codes.size(0), argmax, logits);
}

// ---- W8A8: int8 x int8 on AMX (TDPBSSD), exact int32 sums -----------------------------------

// Tiles 0-1: C int32, 4: A (16 rows x 64 int8), 6-7: B (16 k-quads x 16 cols x 4).
__attribute__((target("amx-tile,amx-int8,avx512f"))) at::Tensor w8a8_impl(const at::Tensor& qx,
                                                                          const at::Tensor& codes, int64_t n) {
  const int64_t nbk = codes.size(0), kb = codes.size(1), kp = kb * 64, m = qx.size(0);
  const int64_t mp = std::max<int64_t>(16, (m + 15) / 16 * 16), k = qx.size(1);
  thread_local std::vector<int8_t> abuf;
  if (abuf.size() < size_t(mp * kp)) abuf.resize(mp * kp);
  std::fill(abuf.begin(), abuf.begin() + mp * kp, 0);
  const int8_t* xs = qx.data_ptr<int8_t>();
  for (int64_t r = 0; r < m; ++r) std::memcpy(abuf.data() + r * kp, xs + r * k, k);
  const int8_t* a = abuf.data();
  const int8_t* b = codes.data_ptr<int8_t>();
  auto out = at::empty({m, n}, qx.options().dtype(at::kInt));
  int32_t* y = out.data_ptr<int32_t>();
  at::parallel_for(0, nbk / 2, 1, [&](int64_t p0, int64_t p1) {
    configure_tiles();
    alignas(64) int32_t c[2][256];
    for (int64_t p = p0; p < p1; ++p) {
      const int8_t* b0 = b + (2 * p) * kb * 1024;
      const int8_t* b1 = b0 + kb * 1024;
      for (int64_t m0 = 0; m0 < mp; m0 += 16) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t ks = 0; ks < kb; ++ks) {
          _tile_loadd(4, a + m0 * kp + ks * 64, kp);
          _tile_loadd(6, b0 + ks * 1024, 64);
          _tile_loadd(7, b1 + ks * 1024, 64);
          _tile_dpbssd(0, 4, 6);
          _tile_dpbssd(1, 4, 7);
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        for (int q = 0; q < 2; ++q) {
          const int64_t col0 = (2 * p + q) * 16;
          if (col0 >= n) continue;
          const int64_t cols = std::min<int64_t>(16, n - col0);
          for (int r = 0; r < 16 && m0 + r < m; ++r) std::memcpy(y + (m0 + r) * n + col0, c[q] + r * 16, cols * 4);
        }
      }
    }
    release_tiles();
  });
  return out;
}

at::Tensor w8a8(const at::Tensor& qx, const at::Tensor& codes, int64_t n) {
  TORCH_CHECK(amx_permitted(), "tessera_qgemm: the kernel did not get AMX tile state from the OS");
  TORCH_CHECK(qx.dim() == 2 && qx.scalar_type() == at::kChar && qx.is_contiguous(), "tessera_qgemm.w8a8: qx int8 [M, K]");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.size(0) % 2 == 0 &&
                  codes.size(0) * 16 >= n && codes.size(1) * 64 >= qx.size(1) && codes.size(1) * 64 - qx.size(1) < 64,
              "tessera_qgemm.w8a8: codes must be int8 tiles [Nb, K / 64, 16, 16, 4]");
  return w8a8_impl(qx, codes, n);
}

}  // namespace

// silu(gate) * up of a fused gate_up weight (n = 2 x inter columns, gate first; bf16 x):
// silu_mul(qgemm(x, ...)) bit for bit. At decode sizes on AMX the silu runs in the store epilogue
// (column_pair_gated), so the [M, n] gate_up output is not stored and read back, and the decoder
// stack makes one parallel call of the two; elsewhere the two in turn.
at::Tensor gated_of(const at::Tensor& x, const Weight& w, int64_t nbk) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "tessera_qgemm: the gated linear takes bf16 x");
  TORCH_CHECK(w.n % 32 == 0, "tessera_qgemm: a gated weight has 2 x inter columns, inter a multiple of 16");
  const int64_t m = x.size(0);
  if (use_amx() && m <= 32 && w.fmt != kBf16 && w.np == w.n) return run(x, w, nbk, false, nullptr, true, true);
  const at::Tensor y = run(x, w, nbk);
  const int64_t inter = w.n / 2;
  auto out = at::empty({m, inter}, x.options());
  const uint16_t* yp = reinterpret_cast<const uint16_t*>(y.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    alignas(64) float gate[16], up[16];
    const auto widen = [](const uint16_t* src, float* dst) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      _mm512_store_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    };
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < inter; i += 16) {
        widen(yp + r * w.n + i, gate);
        widen(yp + r * w.n + inter + i, up);
        store_silu_row(gate, up, op + r * inter + i);
      }
  });
  return out;
}

at::Tensor qgemm_silu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& zero, int64_t fmt, int64_t n, int64_t k) {
  return gated_of(x, checked_weight(x, codes, scale, zero, fmt, n, k), codes.size(0));
}

at::Tensor kqgemm_silu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& planes, const at::Tensor& sup,
                       const c10::optional<at::Tensor>& sub, int64_t kind, int64_t n, int64_t k) {
  return gated_of(x, checked_kq_weight(x, codes, planes, sup, sub, kind, n, k), codes.size(0));
}

TORCH_LIBRARY(tessera_qgemm, lib) {
  lib.def("qgemm(Tensor x, Tensor codes, Tensor scale, Tensor? zero, int fmt, int n, int k) -> Tensor");
  lib.def("qgemm_logits(Tensor x, Tensor codes, Tensor scale, Tensor? zero, int fmt, int n, int k, bool argmax, "
          "bool logits=True) -> (Tensor, Tensor)");
  lib.def("w8a8(Tensor qx, Tensor codes, int n) -> Tensor");
  lib.def("kqgemm(Tensor x, Tensor codes, Tensor planes, Tensor sup, Tensor? sub, int kind, int n, int k) -> Tensor");
  lib.def("qgemm_silu(Tensor x, Tensor codes, Tensor scale, Tensor? zero, int fmt, int n, int k) -> Tensor");
  lib.def("kqgemm_silu(Tensor x, Tensor codes, Tensor planes, Tensor sup, Tensor? sub, int kind, int n, int k) "
          "-> Tensor");
  lib.def("kqgemm_logits(Tensor x, Tensor codes, Tensor planes, Tensor sup, Tensor? sub, int kind, int n, int k, "
          "bool argmax, bool logits=True) -> (Tensor, Tensor)");
  lib.def("set_arithmetic(int arithmetic) -> ()", &set_arithmetic);  // no tensor: a catch-all kernel
}

TORCH_LIBRARY_IMPL(tessera_qgemm, CPU, lib) {
  lib.impl("qgemm", &qgemm);
  lib.impl("qgemm_logits", &qgemm_logits);
  lib.impl("w8a8", &w8a8);
  lib.impl("kqgemm", &kqgemm);
  lib.impl("kqgemm_logits", &kqgemm_logits);
  lib.impl("qgemm_silu", &qgemm_silu);
  lib.impl("kqgemm_silu", &kqgemm_silu);
}
