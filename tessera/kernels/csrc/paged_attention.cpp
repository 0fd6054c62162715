// Batch-invariant paged attention for CPU (the op torch.ops.tessera_inv.paged_attention; the
// linear kernels of the same library are in invariant_kernels.cpp).
//
// The contract: a query row's output is a function of that row alone (its q, its context in the
// cache, its window), never of the batch, chunk boundaries or cache state. Each row walks its
// own context in absolute 16-position tiles [16c, 16c + 16), with an fp32 online softmax and a
// fixed polynomial exp; decode rows, prefill rows and speculative verification rows run the
// same arithmetic, so a token computed as a decode equals the same token computed in a prefill.
//
// Speed comes from sharing loads, never from changing a row's arithmetic:
// - a work item is up to 16 consecutive query tokens of one sequence x all KV heads: each K/V
//   tile's slot rows are read once, contiguously, and each KV head's part is converted to fp32
//   once for all its query heads (GQA) and tokens;
// - K tiles are transposed (kT[d][key]) so one FMA scores 16 keys; a row's score is 8 FMA
//   chains over d (d = 8i + l, chain l) summed in a fixed tree, whichever rows share the tile;
//   on AVX2 without AVX-512, float32 keys (bf16 keys of one or two tokens) are instead scored
//   from the cache rows in place, a key's 8 chains in the lanes of one register (score8_direct:
//   the same chains and tree, so the same bits);
// - a tile's keys are converted and transposed in registers (bf16: one 32-bit word transpose
//   per 32 d, the word's halves are d and d + 1), values converted as P.V reads them (bf16:
//   even/odd halves of each 32 d, the accumulator order restored at the end);
// - up to three query heads of one token share every kT and V load (same FMAs per row as alone);
// - work items are ordered by cost and pulled from a shared counter: the split over threads
//   changes only who computes a row, not how.
// Sliding windows: a row at position p reads keys [p - window + 1, p] only; tiles wholly behind
// every row's window are skipped and positions behind the window are never loaded (their block
// table entries may be block 0, released by the scheduler).
// Quantized caches (int8 / float8_e4m3fn codes with an fp32 scale per slot and KV head) are
// dequantized on load: key = float(code) * scale in fp32, the value tensor.dequantize gives.
// On CPUs with AMX, bf16 caches take a second fixed arithmetic (amx_attend_item below: scores and
// P.V as tile products over 256-key chunks); every row of every call on such a CPU takes it, so
// the contract holds there too. Without AMX but with AVX-512 BF16 (Zen 4/5) the scores of bf16
// rows come from bf16 pairs instead (score_rows_dp), and P.V too (pv_rows_dp: probabilities
// rounded to bf16, as on AMX), again for every row on such a CPU. `amx` = 0
// keeps the fp32 AVX-512 arithmetic, 1 / 2 require AMX / the pairs (tests run all three).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "silu_rows.h"

namespace {

constexpr int kLanes = 16;  // key positions per tile (one AVX-512 register of fp32)
constexpr int kTileQ = 16;  // query tokens of one sequence sharing a K/V tile load
// On the AMX path twice that: an item's V pairs and K tiles then serve 32 tokens' rows (prefill
// 256 0.398 -> 0.364 ms a layer, 512 1.20 -> 1.13; 48 and 64 no better; Intel Xeon model 167).
constexpr int kTileQAmx = 32;

typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));

// AVX2 + FMA without AVX-512 (Zen 3): a 16-lane vector is two 8-lane halves. GCC has no 64-byte
// vector mode there and lowers each v16f operation piece by piece through the stack; the hot
// code below (score_rows, pv_rows, load_k_tile, transpose16, softmax_step) works on the halves
// in registers instead, with the same IEEE operation per lane, so every result keeps its bits
// (only the speed changes).
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define TESSERA_AVX2_HALVES 1
typedef float v8f __attribute__((vector_size(32), aligned(4)));
inline __m256 lo8(v16f v) { return (__m256)__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
inline __m256 hi8(v16f v) { return (__m256)__builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
inline v16f join8(__m256 a, __m256 b) {
  return __builtin_shufflevector((v8f)a, (v8f)b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#endif

// ---- 16-lane fp32 primitives: AVX-512 where the CPU has it, the same IEEE ops lane by lane
// otherwise (so a machine without AVX-512 gets the same bits, only slower).

// One 64-byte load or store. With AVX-512, an intrinsic: GCC expands a 64-byte memcpy as two
// 32-byte moves through the stack on CPUs it tunes for 256-bit vectors (Intel server parts), and
// the 64-byte reload of two 32-byte stores misses store forwarding (a third of a prefill's
// attention time on an Intel Xeon with AMX, model 167).
inline v16f load16(const float* p) {
#if defined(__AVX512F__)
  return (v16f)_mm512_loadu_ps(p);
#elif defined(TESSERA_AVX2_HALVES)
  return join8(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
#else
  v16f v;
  std::memcpy(&v, p, 64);
  return v;
#endif
}
inline void store16(float* p, v16f v) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(p, (__m512)v);
#elif defined(TESSERA_AVX2_HALVES)
  _mm256_storeu_ps(p, lo8(v));
  _mm256_storeu_ps(p + 8, hi8(v));
#else
  std::memcpy(p, &v, 64);
#endif
}
inline v16f splat(float x) {  // a broadcast (not 0 + x: that costs an add per use and turns -0 into +0)
  return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

// v, unchanged, but in a register from here on: the compiler may not fold the load that made it
// into the instructions that use it (see score_rows).
inline v16f in_register(v16f v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#endif
  return v;
}

inline v16f fma16(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
  return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(TESSERA_AVX2_HALVES)
  return join8(_mm256_fmadd_ps(lo8(a), lo8(b), lo8(c)), _mm256_fmadd_ps(hi8(a), hi8(b), hi8(c)));
#else
  v16f r;
  for (int i = 0; i < 16; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

inline v16f fnma16(v16f a, v16f b, v16f c) {  // c - a * b, one rounding
#if defined(__AVX512F__)
  return (v16f)_mm512_fnmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(TESSERA_AVX2_HALVES)
  return join8(_mm256_fnmadd_ps(lo8(a), lo8(b), lo8(c)), _mm256_fnmadd_ps(hi8(a), hi8(b), hi8(c)));
#else
  v16f r;
  for (int i = 0; i < 16; ++i) r[i] = std::fma(-a[i], b[i], c[i]);
  return r;
#endif
}

inline v16f round16(v16f x) {  // to the nearest integer, ties to even
#if defined(__AVX512F__)
  return (v16f)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(TESSERA_AVX2_HALVES)
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return join8(_mm256_round_ps(lo8(x), kNearest), _mm256_round_ps(hi8(x), kNearest));
#else
  v16f r;
  for (int i = 0; i < 16; ++i) r[i] = std::nearbyint(x[i]);
  return r;
#endif
}

// Sum of 16 lanes as a fixed tree (8 + 4 + 2 + 1).
inline float lane_sum(v16f a) {
  v16f b = a + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  b = b + __builtin_shufflevector(b, b, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  b = b + __builtin_shufflevector(b, b, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  b = b + __builtin_shufflevector(b, b, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return b[0];
}

inline float lane_max(v16f a) {  // max is exact: any order gives the same value (a tree: short latency)
  a = a > __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)
          ? a : __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  a = a > __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)
          ? a : __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  a = a > __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
          ? a : __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return std::max(a[0], a[1]);
}

// exp on 16 lanes, the same arithmetic in every call: 2^n times a degree-6 polynomial of the
// reduced argument. Lanes at or below -87 (masked lanes are -inf) give exactly 0; exp(0) is 1.
inline v16f softmax_exp(v16f x) {
  const v16f lo = x > -87.0f ? x : splat(-87.0f);
  const v16f xc = lo < 88.0f ? lo : splat(88.0f);
  const v16f n = round16(xc * 1.44269504088896341f);
  v16f r = fnma16(n, splat(0.693145751953125f), xc);
  r = fnma16(n, splat(1.428606765330187e-06f), r);
  v16f p = splat(1.3981999507e-3f);
  p = fma16(p, r, splat(8.3334519073e-3f));
  p = fma16(p, r, splat(4.1665795894e-2f));
  p = fma16(p, r, splat(1.6666665459e-1f));
  p = fma16(p, r, splat(5.0000001201e-1f));
  p = fma16(p, r * r, r + 1.0f);
  v16i bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += __builtin_convertvector(n, v16i) << 23;  // times 2^n: n is in [-126, 127]
  v16f e;
  std::memcpy(&e, &bits, sizeof(e));
  return x > -87.0f ? e : (v16f){};
}

// ---- 16 cache elements to fp32 in a register (exact conversions; quantized codes times their
// scale). Read straight from the cache row: no fp32 staging copy of the tile.

typedef uint16_t v16u16 __attribute__((vector_size(32), aligned(2)));
typedef int8_t v16i8 __attribute__((vector_size(16), aligned(1)));
typedef uint8_t v16u8 __attribute__((vector_size(16), aligned(1)));
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4)));

template <typename C>
inline v16f load_f32(const C* src, float scale);

template <>
inline v16f load_f32<float>(const float* src, float) {
  return load16(src);
}

// bf16 -> fp32 is a 16-bit shift.
template <>
inline v16f load_f32<at::BFloat16>(const at::BFloat16* src, float) {
  v16u16 h;
  std::memcpy(&h, src, 32);
  const v16u bits = __builtin_convertvector(h, v16u) << 16;
  return (v16f)bits;  // a vector cast reinterprets the bits (a register move, not a stack copy)
}

template <>
inline v16f load_f32<at::Half>(const at::Half* src, float) {
#if defined(__AVX512F__)
  return (v16f)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
#elif defined(TESSERA_AVX2_HALVES)
  return join8(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))),
               _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 8))));
#else
  v16f v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(src[i]);
  return v;
#endif
}

template <>
inline v16f load_f32<int8_t>(const int8_t* src, float scale) {
  v16i8 c;
  std::memcpy(&c, src, 16);
  return __builtin_convertvector(c, v16f) * scale;
}

// float8_e4m3fn: s eeee mmm, bias 7, no infinities; subnormals (e = 0) are m * 2^-9. Integer
// and select ops on 16 lanes (c10's scalar conversion gives the same values).
template <>
inline v16f load_f32<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* src, float scale) {
  v16u8 c;
  std::memcpy(&c, src, 16);
  const v16u x = __builtin_convertvector(c, v16u);
  const v16u e = (x >> 3) & 15u, m = x & 7u, sign = (x & 0x80u) << 24;
  const v16u bits = sign | ((e + 120u) << 23) | (m << 20);
  const v16f normal = (v16f)bits;
  v16f sub = __builtin_convertvector(m, v16f) * 0x1p-9f;
  sub = sign != 0u ? -sub : sub;
  const v16f v = e != 0u ? normal : sub;
  return v * scale;
}

#if defined(TESSERA_AVX2_HALVES)
// In place: the 8 x 8 block r[i][k] becomes the old r[k][i].
__attribute__((always_inline)) inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
#endif

// In place: r[i][k] becomes the old r[k][i] (a 16 x 16 block of fp32 in registers). Always
// inlined: GCC 12 kept it a call, so every tile's 16 vectors went through the stack both ways
// (6% of a decode's samples; inlined, decode b32 x 320 0.41-0.45 -> 0.33-0.35 ms a layer, prefill
// 256 and 1024 3-14% less, three alternating processes, Zen 4).
__attribute__((always_inline)) inline void transpose16(v16f* rv) {
#if defined(__AVX512F__)
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = (__m512)rv[i];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    rv[i] = (v16f)_mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    rv[i + 8] = (v16f)_mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
#elif defined(TESSERA_AVX2_HALVES)
  // Four 8 x 8 blocks: the diagonal ones in place, the two others swap places.
  __m256 a[8], b[8], c[8], d[8];  // rows 0-7 low/high halves, rows 8-15 low/high halves
  for (int i = 0; i < 8; ++i) {
    a[i] = lo8(rv[i]), b[i] = hi8(rv[i]), c[i] = lo8(rv[i + 8]), d[i] = hi8(rv[i + 8]);
  }
  transpose8(a), transpose8(b), transpose8(c), transpose8(d);
  for (int i = 0; i < 8; ++i) {
    rv[i] = join8(a[i], c[i]);
    rv[i + 8] = join8(b[i], d[i]);
  }
#else
  for (int i = 0; i < 16; ++i)
    for (int k = i + 1; k < 16; ++k) std::swap(rv[i][k], rv[k][i]);
#endif
}

// One KV head's part of a tile: the keys converted and transposed in registers, 16 d at a time,
// into kT[d][key]. off[j] is key j's element offset in the cache, -1 for a position no row of
// the item reads (zeros: every row masks it).
template <typename C, int D>
inline void load_k_tile(const C* kc, const int64_t* off, const float* scale, float* kT) {
#if defined(TESSERA_AVX2_HALVES)
  // 8 keys x 8 d at a time, straight into kT: no 16-lane vector passes through memory.
  for (int c = 0; c < D; c += 8)
    for (int jb = 0; jb < kLanes; jb += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) {
        const int64_t o = off[jb + j];
        if (o < 0) {
          r[j] = _mm256_setzero_ps();
        } else if constexpr (std::is_same_v<C, float>) {
          r[j] = _mm256_loadu_ps(kc + o + c);
        } else if constexpr (std::is_same_v<C, at::BFloat16>) {
          const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kc + o + c));
          r[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        } else {
          // 16 elements converted (the tile row's next 8 d come along; cheap next to a miss)
          const v16f v = load_f32<C>(kc + o + (c & ~15), scale[jb + j]);
          r[j] = (c & 8) ? hi8(v) : lo8(v);
        }
      }
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kT + (c + i) * kLanes + jb, r[i]);
    }
#else
  for (int c = 0; c < D; c += 16) {
    v16f r[16];
    for (int j = 0; j < kLanes; ++j) r[j] = off[j] < 0 ? (v16f){} : load_f32<C>(kc + off[j] + c, scale[j]);
    transpose16(r);
    for (int i = 0; i < 16; ++i) store16(kT + (c + i) * kLanes, r[i]);
  }
#endif
}

// bf16 keys, head_dim a multiple of 32: a 32-bit word of a cache row is the pair (d, d + 1), so
// one 16 x 16 word transpose serves 32 d, and each transposed word vector splits into the fp32
// keys of d (low half << 16) and d + 1 (high half, low bits cleared). The same kT as above with
// half the shuffles and no widening conversions.
inline v16f bf16_lo(v16f w) { return (v16f)((v16u)w << 16); }
inline v16f bf16_hi(v16f w) { return (v16f)((v16u)w & 0xFFFF0000u); }

// With Words, the same transposed words stored as they are for score_rows_dp: word w (d = 2w,
// 2w + 1) of the 16 keys at kT + 16 w, no conversion.
template <int D, bool Words>
inline void load_k_tile_bf16(const at::BFloat16* kc, const int64_t* off, float* kT) {
  static_assert(D % 32 == 0, "pairs of d");
  for (int c = 0; c < D; c += 32) {
    v16f r[16];
    for (int j = 0; j < kLanes; ++j) r[j] = off[j] < 0 ? (v16f){} : load16(reinterpret_cast<const float*>(kc + off[j] + c));
    transpose16(r);
    for (int i = 0; i < 16; ++i) {
      if constexpr (Words) {
        store16(kT + (c / 2 + i) * kLanes, r[i]);
      } else {
        store16(kT + (c + 2 * i) * kLanes, bf16_lo(r[i]));
        store16(kT + (c + 2 * i + 1) * kLanes, bf16_hi(r[i]));
      }
    }
  }
}

// Whether C at head_dim D takes the paired-bf16 path: keys as above, and values read 32 at a
// time as even/odd halves, so the accumulators of a row hold, per 32 d, the 16 even d then the
// 16 odd d (unpaired_acc restores the order). Each d's arithmetic is unchanged: only the lane
// it sits in.
template <typename C, int D>
constexpr bool kPairedBf16 = std::is_same_v<C, at::BFloat16> && D % 32 == 0;

// ---- one tile's arithmetic for NR query rows (NR = 1..3: query heads of one token, so they
// share a valid key range). A row's operations do not depend on NR: grouping only shares loads.

// Scores of 16 keys: chain l (l = 0..7) accumulates q[d] * k[d] over d = l, l + 8, ... in
// order (the first a product, then FMAs); the chains are summed as ((0+4)+(2+6))+((1+5)+(3+7)).
//
// Each k vector is held in a register (in_register) so that the q broadcasts fold into the FMAs
// as {1to16} memory operands: one load of k per l for all NR rows. Left to itself, GCC 12 tuning
// for Zen (-march=native on Zen 4 tunes as znver3) folds the k load into every FMA instead and
// broadcasts q with a separate vbroadcastss each time: half of prefill attention's samples on
// that CPU, and 13-17% of prefill attention's time (same arithmetic, same bits).
#if defined(TESSERA_AVX2_HALVES)
// The 16 scores of a row as two 8-lane halves, kept in registers: a v16f built from them went to
// the stack lane by lane (vextractps) and back (a tenth of a decode's and prefill's attention
// samples, Zen 3).
struct Scores16 {
  __m256 lo, hi;
};

template <int D, int NR>
inline void score_rows_halves(const float* const* q, const float* kT, Scores16* out) {
  // Each row and each half of the 16 keys on its own: 8 chains in 8 registers.
  for (int r = 0; r < NR; ++r) {
    __m256 half[2];
    for (int hh = 0; hh < 2; ++hh) {
      __m256 a[8];
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) a[l] = _mm256_mul_ps(_mm256_set1_ps(q[r][l]), _mm256_loadu_ps(kT + l * 16 + 8 * hh));
#pragma GCC unroll 4
      for (int i = 8; i < D; i += 8) {
#pragma GCC unroll 8
        for (int l = 0; l < 8; ++l)
          a[l] = _mm256_fmadd_ps(_mm256_set1_ps(q[r][i + l]), _mm256_loadu_ps(kT + (i + l) * 16 + 8 * hh), a[l]);
      }
      const __m256 b0 = _mm256_add_ps(a[0], a[4]), b1 = _mm256_add_ps(a[1], a[5]);
      const __m256 b2 = _mm256_add_ps(a[2], a[6]), b3 = _mm256_add_ps(a[3], a[7]);
      half[hh] = _mm256_add_ps(_mm256_add_ps(b0, b2), _mm256_add_ps(b1, b3));
    }
    out[r] = {half[0], half[1]};
  }
}
#endif

// (On AVX2 score_rows_halves above: this loop's 16-lane vectors would go through the stack.)
template <int D, int NR>
inline void score_rows(const float* const* q, const float* kT, v16f* out) {
  v16f a[NR][8];
#pragma GCC unroll 8
  for (int l = 0; l < 8; ++l) {
    const v16f k = in_register(load16(kT + l * 16));
    for (int r = 0; r < NR; ++r) a[r][l] = splat(q[r][l]) * k;
  }
#pragma GCC unroll 4
  for (int i = 8; i < D; i += 8) {
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) {
      const v16f k = in_register(load16(kT + (i + l) * 16));
      for (int r = 0; r < NR; ++r) a[r][l] = fma16(splat(q[r][i + l]), k, a[r][l]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const v16f b0 = a[r][0] + a[r][4], b1 = a[r][1] + a[r][5], b2 = a[r][2] + a[r][6], b3 = a[r][3] + a[r][7];
    out[r] = (b0 + b2) + (b1 + b3);
  }
}

// The same 16 keys' scores from bf16 pairs (CPUs with AVX-512 BF16, bf16 q and cache, head_dim a
// multiple of 32): kw holds the tile's keys as 32-bit words (d, d + 1), word w of the 16 keys at
// kw + 16 w (load_k_tile_bf16<D, true>), qw[r] the row's raw bf16 q as the same words. Chain l (l = 0..3)
// accumulates words w = l, l + 4, ... in order with VDPBF16PS (per lane the pair's two products,
// each exact in fp32, added to the accumulator as the instruction defines it, denormals flushed);
// the chains are summed as (0 + 2) + (1 + 3) and the sum times the softmax scale. No fp32 copy of
// the keys is written or read back, and a row's arithmetic is the same whichever rows share its
// tile.
template <int D, int NR>
inline void score_rows_dp(const uint32_t* const* qw, const float* kw, float scale, v16f* out) {
#if defined(__AVX512BF16__)
  constexpr int kWords = D / 2;
  __m512 a[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int l = 0; l < 4; ++l) a[r][l] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int w = 0; w < kWords; w += 4) {
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) {
      const __m512bh k = (__m512bh)_mm512_loadu_ps(kw + (w + l) * 16);
      for (int r = 0; r < NR; ++r)
        a[r][l] = _mm512_dpbf16_ps(a[r][l], k, (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[r][w + l])));
    }
  }
  for (int r = 0; r < NR; ++r)
    out[r] = (v16f)_mm512_add_ps(_mm512_add_ps(a[r][0], a[r][2]), _mm512_add_ps(a[r][1], a[r][3])) * scale;
#else
  (void)qw, (void)kw, (void)scale, (void)out;
#endif
}

// The next tile's K and V rows for the work item's KV heads, handed to the prefetcher a line of
// each per step from inside the score and P.V loops (step(): one K and one V line), so the lines
// go out spread over the tile's compute at about the rate the core's misses drain. Used on AVX2
// (see attend_item); aim() points it at a tile, idle until then.
struct TilePrefetch {
  const char* k = nullptr;  // the cache tensors plus the item's first KV head's byte offset
  const char* v = nullptr;
  const int64_t* slots = nullptr;  // the tile's slots, -1 = none
  int64_t row_bytes = 0, lines = 0;  // bytes of a slot row; lines of each row to fetch
  int j = kLanes, line = 0;          // the next slot and line (j == kLanes: nothing left)

  void aim(const char* kc, const char* vc, const int64_t* tile_slots, int64_t row, int64_t head_offset,
           int64_t bytes) {
    k = kc + head_offset, v = vc + head_offset, slots = tile_slots, row_bytes = row;
    lines = (bytes + 63) / 64, line = 0, j = 0;
    while (j < kLanes && slots[j] < 0) ++j;
  }
  void idle() { j = kLanes; }
  __attribute__((always_inline)) void step() {
    if (j >= kLanes) return;
    const int64_t o = slots[j] * row_bytes + line * 64;
    _mm_prefetch(k + o, _MM_HINT_T1);
    _mm_prefetch(v + o, _MM_HINT_T1);
    if (++line == lines) {
      line = 0;
      do ++j; while (j < kLanes && slots[j] < 0);
    }
  }
};

#if defined(TESSERA_AVX2_HALVES)
// Scores straight from the cache rows, no transposed copy of the tile (float32 and bf16 caches on
// AVX2). A key's 8 chains are the 8 lanes of one register: lane l accumulates q[d] * k[d] over
// d = l, l + 8, ... in order (a product, then FMAs), exactly score_rows' chain l, and the lanes are
// summed in score_rows' tree ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)) by the shuffles below, so a
// score has the same bits either way. What it saves: load_k_tile's 8 x 8 transposes, its stores
// and score_rows' reloads of them, and a broadcast of q per FMA (a q vector serves 8 keys here).
template <typename C>
constexpr bool kDirectScores = std::is_same_v<C, float> || std::is_same_v<C, at::BFloat16>;

template <typename C>
inline __m256 key8(const C* p) {
  if constexpr (std::is_same_v<C, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// The chains' fixed tree, in two parts. Four keys' chain registers a[0..3] (lane l = chain l)
// -> their sums (0 + 4) + (2 + 6) and (1 + 5) + (3 + 7) as [key 0, 0, 2, 2 | 1, 1, 3, 3]: first
// lanes l + (l + 4) of two keys at once, t = [key 0's 4 sums | key 1's], then the pairs.
__attribute__((always_inline)) inline __m256 four_key_sums(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t0 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
  const __m256 t1 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
  return _mm256_add_ps(_mm256_shuffle_ps(t0, t1, 0x44), _mm256_shuffle_ps(t0, t1, 0xEE));
}
// Keys 0-3's and 4-7's four_key_sums -> the eight scores in key order (the two halves' sum gives
// keys [0, 2, 4, 6 | 1, 3, 5, 7]).
__attribute__((always_inline)) inline __m256 eight_scores(__m256 s0, __m256 s1) {
  return _mm256_permutevar8x32_ps(_mm256_hadd_ps(s0, s1), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// One row's scores of the 8 keys whose rows start at k[0..7] (head_dim D).
template <typename C, int D>
inline __m256 score8_direct(const float* q, const C* const* k, TilePrefetch& pf) {
  __m256 a[8];
  const __m256 q0 = _mm256_loadu_ps(q);
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) a[j] = _mm256_mul_ps(q0, key8(k[j]));
#pragma GCC unroll 4
  for (int i = 8; i < D; i += 8) {
    const __m256 qi = _mm256_loadu_ps(q + i);
    if (i & 8) pf.step();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qi, key8(k[j] + i), a[j]);
  }
  return eight_scores(four_key_sums(a[0], a[1], a[2], a[3]), four_key_sums(a[4], a[5], a[6], a[7]));
}

// Four keys (at k[0..3]) for NR rows side by side: each key vector loaded once for the NR rows
// (12 accumulators at NR = 3), the chains those of score8_direct; each row's four_key_sums to s.
template <typename C, int D, int NR>
inline void score4_rows(const float* const* q, const C* const* k, __m256* s, TilePrefetch& pf, bool steps_every_i) {
  __m256 a[NR][4];
  __m256 qv[NR];
  for (int r = 0; r < NR; ++r) qv[r] = _mm256_loadu_ps(q[r]);
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m256 kv = key8(k[j]);
    for (int r = 0; r < NR; ++r) a[r][j] = _mm256_mul_ps(qv[r], kv);
  }
#pragma GCC unroll 4
  for (int i = 8; i < D; i += 8) {
    if (steps_every_i || (i & 8)) pf.step();
    for (int r = 0; r < NR; ++r) {
      qv[r] = _mm256_loadu_ps(q[r] + i);
      asm("" : "+x"(qv[r]));  // and each row's q once for the four keys
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m256 kv = key8(k[j] + i);
      asm("" : "+x"(kv));  // in a register: one load of the key for the NR rows (GCC folded it into each FMA)
      for (int r = 0; r < NR; ++r) a[r][j] = _mm256_fmadd_ps(qv[r], kv, a[r][j]);
    }
  }
  for (int r = 0; r < NR; ++r) s[r] = four_key_sums(a[r][0], a[r][1], a[r][2], a[r][3]);
}

template <typename C, int D, int NR>
inline void score_rows_direct(const float* const* q, const C* const* k, Scores16* out, TilePrefetch& pf) {
  if constexpr (NR == 1) {
    out[0] = {score8_direct<C, D>(q[0], k, pf), score8_direct<C, D>(q[0], k + 8, pf)};
  } else {
    // The rows side by side, four keys at a time (score8_direct one row and eight keys at a time
    // loaded every key vector once a row): the same chains, sums and order, so the same bits.
    for (int half = 0; half < 2; ++half) {
      __m256 s0[NR], s1[NR];
      score4_rows<C, D, NR>(q, k + 8 * half, s0, pf, false);
      score4_rows<C, D, NR>(q, k + 8 * half + 4, s1, pf, NR > 2);
      for (int r = 0; r < NR; ++r) (half == 0 ? out[r].lo : out[r].hi) = eight_scores(s0[r], s1[r]);
    }
  }
}
#endif

#if defined(TESSERA_AVX2_HALVES)
// pv_rows' vectors a pass on AVX2: the most, up to 12 accumulators for the NR rows, that divide
// the head's kVecs vectors.
constexpr int pv_pass_vectors(int vecs, int nr) {
  int u = std::min(vecs, 12 / nr);
  while (vecs % u != 0) --u;
  return u;
}
#endif

// acc = acc * corr (skipped when corr is exactly 1: the same bits), then acc += p[j] * v[j] for
// the row's valid keys j in order, 16 output lanes at a time; V is converted as it is read
// (each converted vector serves all NR rows).
template <typename C, int D, int NR>
inline void pv_rows(float* const* acc, const float* const* p, const float* corr, const C* vc, const int64_t* off,
                    const float* scale, int j0, int j1, TilePrefetch& pf) {
  constexpr int kVec = D / 16;  // output vectors kept in registers per pass: all of a row if they fit
  constexpr int kGroup = kVec * NR <= 20 ? kVec : (kVec % 4 == 0 ? 4 : (kVec % 2 == 0 ? 2 : 1));
  static_assert(kVec % kGroup == 0, "pv_rows: passes must cover head_dim exactly");
  static_assert(!kPairedBf16<C, D> || kGroup % 2 == 0, "pv_rows: paired bf16 passes take whole pairs");
#if defined(TESSERA_AVX2_HALVES)
  // The rows side by side, kU vectors of 8 lanes of each a pass (NR x kU <= 12 accumulators): a
  // key's V vector, loaded and converted once, feeds NR independent FMA chains. Row by row (8
  // accumulators of one row a pass) each key waited on the FMA latency, 4 cycles. Every lane's
  // FMAs and their order are unchanged. The prefetcher gets the same steps a key as row by row
  // took (NR a key at head_dim 64), spread over the passes.
  constexpr int kVecs = D / 8;
  constexpr int kU = pv_pass_vectors(kVecs, NR);
  constexpr int kPasses = kVecs / kU;
  constexpr int kRowByRowPass = kVecs % 8 == 0 ? 8 : (kVecs % 4 == 0 ? 4 : 2);  // vectors, as it was
  constexpr int kSteps = NR * (kVecs / kRowByRowPass);  // prefetch steps a key, as row by row took
  for (int pass = 0; pass < kPasses; ++pass) {
    const int w0 = pass * kU;
    const int steps = kSteps / kPasses + (pass < kSteps % kPasses ? 1 : 0);
    __m256 a[NR][kU];
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < kU; ++u) {
        a[r][u] = _mm256_loadu_ps(acc[r] + 8 * (w0 + u));
        if (corr[r] != 1.f) a[r][u] = _mm256_mul_ps(a[r][u], _mm256_set1_ps(corr[r]));
      }
    for (int j = j0; j < j1; ++j) {
      for (int t = 0; t < steps; ++t) pf.step();
      __m256 pj[NR];
      for (int r = 0; r < NR; ++r) pj[r] = _mm256_set1_ps(p[r][j]);
      const C* vrow = vc + off[j];
      for (int u = 0; u < kU; ++u) {
        const int w = w0 + u, lane = 8 * w;  // the vector's first lane (accumulator order)
        __m256 v;
        if constexpr (kPairedBf16<C, D>) {
          // accumulator lanes: per 32 d the 16 even d (words' low halves), then the 16 odd d
          // (high halves); word m of the 32 d chunk holds d = 2m, 2m + 1
          const int chunk = lane / 32 * 32, part = lane % 32;
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow + chunk + 2 * (part % 16)));
          v = part < 16 ? _mm256_castsi256_ps(_mm256_slli_epi32(x, 16))
                        : _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
        } else if constexpr (std::is_same_v<C, float>) {
          v = _mm256_loadu_ps(vrow + lane);
        } else {
          const v16f v16 = load_f32<C>(vrow + 16 * (w / 2), scale[j]);
          v = (w & 1) ? hi8(v16) : lo8(v16);
        }
        for (int r = 0; r < NR; ++r) a[r][u] = _mm256_fmadd_ps(pj[r], v, a[r][u]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < kU; ++u) _mm256_storeu_ps(acc[r] + 8 * (w0 + u), a[r][u]);
  }
#else
  (void)pf;  // the AVX-512 path prefetches per KV head instead (attend_item)
  for (int c = 0; c < D; c += 16 * kGroup) {
    v16f a[NR][kGroup];
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < kGroup; ++u) {
        a[r][u] = load16(acc[r] + c + 16 * u);
        if (corr[r] != 1.f) a[r][u] = a[r][u] * corr[r];
      }
    for (int j = j0; j < j1; ++j) {
      const C* vrow = vc + off[j] + c;
      if constexpr (kPairedBf16<C, D>) {
        for (int u = 0; u < kGroup; u += 2) {
          const v16f w = load16(reinterpret_cast<const float*>(vrow + 16 * u));
          const v16f ve = bf16_lo(w), vo = bf16_hi(w);
          for (int r = 0; r < NR; ++r) {
            a[r][u] = fma16(splat(p[r][j]), ve, a[r][u]);
            a[r][u + 1] = fma16(splat(p[r][j]), vo, a[r][u + 1]);
          }
        }
      } else {
        for (int u = 0; u < kGroup; ++u) {
          const v16f v = load_f32<C>(vrow + 16 * u, scale[j]);
          for (int r = 0; r < NR; ++r) a[r][u] = fma16(splat(p[r][j]), v, a[r][u]);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < kGroup; ++u) store16(acc[r] + c + 16 * u, a[r][u]);
  }
#endif
}

// P.V of the pair arithmetic (bf16 cache and q, CPUs with AVX-512 BF16, head_dim a multiple of
// 32): the tile's probabilities rounded to bf16 (nearest even), as the AMX arithmetic rounds
// them, and summed two keys at a time with VDPBF16PS: per lane d, acc += p[j] v[j][d] + p[j+1]
// v[j+1][d] for the key pairs (j, j + 1) = (0, 1), (2, 3), ... in order, as the instruction
// defines the pair's sum. The pairs' words come from two V rows with a shift and a bit select
// each; the accumulators keep pv_rows' layout (per 32 d: the 16 even d, then the 16 odd d). A key
// no row of the tile reads (outside [j0, j1)) contributes a zero row, never a load. Half the
// multiply instructions of pv_rows: the decode's P.V had been two thirds of the tile's FMAs.
template <int D, int NR>
inline void pv_rows_dp(float* const* acc, const float* const* p, const float* corr, const at::BFloat16* vc,
                       const int64_t* off, int j0, int j1) {
#if defined(__AVX512BF16__)
  constexpr int kVec = D / 16;
  constexpr int kGroup = kVec * NR <= 20 ? kVec : (kVec % 4 == 0 ? 4 : 2);
  static_assert(kVec % kGroup == 0 && kGroup % 2 == 0, "pv_rows_dp: passes take whole 32-d chunks");
  uint32_t pw[NR][kLanes / 2];  // each row's probabilities as bf16 words (p[2m], p[2m + 1])
  for (int r = 0; r < NR; ++r) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(p[r]));
    std::memcpy(pw[r], &h, sizeof(pw[r]));
  }
  const __m512i low_half = _mm512_set1_epi32(0xFFFF);
  const int m0 = j0 / 2, m1 = (j1 + 1) / 2;
  for (int c = 0; c < D; c += 16 * kGroup) {
    __m512 a[NR][kGroup];
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < kGroup; ++u) {
        a[r][u] = _mm512_loadu_ps(acc[r] + c + 16 * u);
        if (corr[r] != 1.f) a[r][u] = _mm512_mul_ps(a[r][u], _mm512_set1_ps(corr[r]));
      }
    for (int m = m0; m < m1; ++m) {
      const int j = 2 * m;  // j < j1 and j + 1 >= j0 by the pair range
      const at::BFloat16* v0 = j >= j0 ? vc + off[j] + c : nullptr;
      const at::BFloat16* v1 = j + 1 < j1 ? vc + off[j + 1] + c : nullptr;
      for (int u = 0; u < kGroup; u += 2) {
        const __m512i x = v0 ? _mm512_loadu_si512(v0 + 16 * u) : _mm512_setzero_si512();
        const __m512i y = v1 ? _mm512_loadu_si512(v1 + 16 * u) : _mm512_setzero_si512();
        // 0xE4: low_half ? first : second, bit by bit.
        const __m512bh even = (__m512bh)_mm512_ternarylogic_epi32(x, _mm512_slli_epi32(y, 16), low_half, 0xE4);
        const __m512bh odd = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(x, 16), y, low_half, 0xE4);
        for (int r = 0; r < NR; ++r) {
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[r][m]));
          a[r][u] = _mm512_dpbf16_ps(a[r][u], even, pp);
          a[r][u + 1] = _mm512_dpbf16_ps(a[r][u + 1], odd, pp);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < kGroup; ++u) _mm512_storeu_ps(acc[r] + c + 16 * u, a[r][u]);
  }
#else
  (void)acc, (void)p, (void)corr, (void)vc, (void)off, (void)j0, (void)j1;
#endif
}

#if defined(TESSERA_AVX2_HALVES)
// softmax_exp on 8 lanes: silu_rows.h's exp8 (the same clamps, reduction, polynomial and
// scaling as softmax_exp; n is a whole number, so rounding or truncating it to an integer agree),
// then 0 where x is not above -87, as softmax_exp gives.
inline __m256 softmax_exp8(__m256 x) {
  return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GT_OQ), exp8(x));
}

// Online-softmax step of one row over its valid lanes [j0, j1) of a tile: new running max,
// the rescale factor of what was accumulated, the tile's probabilities into p.
// On AVX2 on the two halves in registers (the generic code went through the stack
// there: two thirds of the prefill kernel's samples on Zen 3). The max is exact in any order;
// the sum is lane_sum's tree ((i + 8), then (i + 4), (i + 2), (i + 1)), so the same bits.
inline float softmax_step(Scores16 s, int j0, int j1, float& mx, float& den, float* p) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 a0 = _mm256_set1_ps(static_cast<float>(j0)), a1 = _mm256_set1_ps(static_cast<float>(j1));
  __m256 h[2] = {s.lo, s.hi};
  for (int i = 0; i < 2; ++i) {
    const __m256 lane = _mm256_add_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps(8.0f * i));
    const __m256 valid = _mm256_and_ps(_mm256_cmp_ps(lane, a0, _CMP_GE_OQ), _mm256_cmp_ps(lane, a1, _CMP_LT_OQ));
    h[i] = _mm256_blendv_ps(ninf, h[i], valid);
  }
  __m256 m8 = _mm256_max_ps(h[0], h[1]);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float bm = std::max(mx, _mm_cvtss_f32(m4));
  const float corr = bm == mx ? 1.f : _mm256_cvtss_f32(softmax_exp8(_mm256_set1_ps(mx - bm)));
  const __m256 b = _mm256_set1_ps(bm);
  const __m256 e0 = softmax_exp8(_mm256_sub_ps(h[0], b)), e1 = softmax_exp8(_mm256_sub_ps(h[1], b));
  const __m256 c = _mm256_add_ps(e0, e1);
  __m128 d = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
  d = _mm_add_ps(d, _mm_movehl_ps(d, d));
  d = _mm_add_ss(d, _mm_shuffle_ps(d, d, 1));
  den = std::fma(den, corr, _mm_cvtss_f32(d));
  mx = bm;
  _mm256_storeu_ps(p, e0);
  _mm256_storeu_ps(p + 8, e1);
  return corr;
}
inline float softmax_step(v16f s, int j0, int j1, float& mx, float& den, float* p) {
  return softmax_step(Scores16{lo8(s), hi8(s)}, j0, j1, mx, den, p);
}
#else
inline float softmax_step(v16f s, int j0, int j1, float& mx, float& den, float* p) {
  const v16f lane = (v16f){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const float ninf = -std::numeric_limits<float>::infinity();
  s = (lane >= static_cast<float>(j0)) & (lane < static_cast<float>(j1)) ? s : splat(ninf);
  const float bm = std::max(mx, lane_max(s));
  const float corr = bm == mx ? 1.f : softmax_exp(splat(mx - bm))[0];
  const v16f e = softmax_exp(s - bm);
  den = std::fma(den, corr, lane_sum(e));
  mx = bm;
  store16(p, e);
  return corr;
}
#endif

// ---- Scores on AMX tiles (bf16 caches and queries, head_dim a multiple of 32, CPUs with AMX).
// A query row's score against 16 keys is one column of a tile product C = K (16 keys x 32 d, read
// from the cache rows in place) x Q^T (32 d x 16 query rows, VNNI pairs), summed over head_dim in
// 32-wide steps in order, then times the softmax scale. An element of C depends only on its key
// row and query column, so a row's scores are the same whichever rows share its tile (decode,
// prefill chunk or verification): the contract holds with one fixed arithmetic per CPU kind.
#if defined(__x86_64__)
bool cpu_has_amx() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    // Linux hands out AMX tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
    return tile && bf16 && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")

struct alignas(64) AmxConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows x 64 bytes: 0-3 C (fp32); scores: 4 keys, 5 Q^T; P.V: 6 P rows, 4, 5 and 7 V pairs.
void amx_begin() {
  AmxConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC does not see ldtilecfg read its operand and drops the stores above without this.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

void amx_end() { _tile_release(); }

// One tile product: a [16 keys][32 d] at stride a_stride bytes per key, b a 32 x 16 VNNI tile.
struct ScoreJob {
  const at::BFloat16* a;
  const at::BFloat16* b;
  float* c;
};

// NC (1..4) independent C tiles at once, each summed over ksteps 32-wide steps of d in order.
template <int NC>
void amx_score_group(const ScoreJob* jobs, int64_t a_stride, int ksteps) {
  if constexpr (NC > 0) _tile_zero(0);
  if constexpr (NC > 1) _tile_zero(1);
  if constexpr (NC > 2) _tile_zero(2);
  if constexpr (NC > 3) _tile_zero(3);
  for (int ks = 0; ks < ksteps; ++ks) {
    if constexpr (NC > 0) {
      _tile_loadd(4, jobs[0].a + ks * 32, a_stride);
      _tile_loadd(5, jobs[0].b + ks * 512, 64);
      _tile_dpbf16ps(0, 4, 5);
    }
    if constexpr (NC > 1) {
      _tile_loadd(4, jobs[1].a + ks * 32, a_stride);
      _tile_loadd(5, jobs[1].b + ks * 512, 64);
      _tile_dpbf16ps(1, 4, 5);
    }
    if constexpr (NC > 2) {
      _tile_loadd(4, jobs[2].a + ks * 32, a_stride);
      _tile_loadd(5, jobs[2].b + ks * 512, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (NC > 3) {
      _tile_loadd(4, jobs[3].a + ks * 32, a_stride);
      _tile_loadd(5, jobs[3].b + ks * 512, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  if constexpr (NC > 0) _tile_stored(0, jobs[0].c, 64);
  if constexpr (NC > 1) _tile_stored(1, jobs[1].c, 64);
  if constexpr (NC > 2) _tile_stored(2, jobs[2].c, 64);
  if constexpr (NC > 3) _tile_stored(3, jobs[3].c, 64);
}

void amx_scores(const ScoreJob* jobs, int n, int64_t a_stride, int ksteps) {
  for (int i = 0; i < n; i += 4) {
    switch (std::min(4, n - i)) {
      case 4: amx_score_group<4>(jobs + i, a_stride, ksteps); break;
      case 3: amx_score_group<3>(jobs + i, a_stride, ksteps); break;
      case 2: amx_score_group<2>(jobs + i, a_stride, ksteps); break;
      default: amx_score_group<1>(jobs + i, a_stride, ksteps); break;
    }
  }
}

// Column n of a C tile ([16 keys][16 columns] fp32): the 16 keys' scores of one query row.
v16f amx_column(const float* c, int n) {
  const __m512i idx = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  return (v16f)_mm512_i32gather_ps(idx, c + n, 4);
}

// P.V of a chunk on AMX: P rows (16 query rows x 32 keys per step, bf16) times V pairs (per step
// 16 key pairs x 16 columns x 2), summed over nks steps in order into NC C tiles of 16 columns.
template <int NC>
void amx_pv_group(const at::BFloat16* pa, const at::BFloat16* vb, int nks, int64_t chunk, float* out) {
  if constexpr (NC > 0) _tile_zero(0);
  if constexpr (NC > 1) _tile_zero(1);
  if constexpr (NC > 2) _tile_zero(2);
  if constexpr (NC > 3) _tile_zero(3);
  for (int ks = 0; ks < nks; ++ks) {
    _tile_loadd(6, pa + ks * 512, 64);
    if constexpr (NC > 0) { _tile_loadd(4, vb + ks * 512, 64); _tile_dpbf16ps(0, 6, 4); }
    if constexpr (NC > 1) { _tile_loadd(5, vb + chunk + ks * 512, 64); _tile_dpbf16ps(1, 6, 5); }
    if constexpr (NC > 2) { _tile_loadd(7, vb + 2 * chunk + ks * 512, 64); _tile_dpbf16ps(2, 6, 7); }
    if constexpr (NC > 3) { _tile_loadd(4, vb + 3 * chunk + ks * 512, 64); _tile_dpbf16ps(3, 6, 4); }
  }
  if constexpr (NC > 0) _tile_stored(0, out, 64);
  if constexpr (NC > 1) _tile_stored(1, out + 256, 64);
  if constexpr (NC > 2) _tile_stored(2, out + 512, 64);
  if constexpr (NC > 3) _tile_stored(3, out + 768, 64);
}

// nc chunks of 16 output columns; vb holds chunk c's steps at vb + c * nks * 512; out [nc][16][16].
void amx_pv(const at::BFloat16* pa, const at::BFloat16* vb, int nc, int nks, float* out) {
  const int64_t chunk = static_cast<int64_t>(nks) * 512;
  for (int c = 0; c < nc; c += 4) {
    switch (std::min(4, nc - c)) {
      case 4: amx_pv_group<4>(pa, vb + c * chunk, nks, chunk, out + c * 256); break;
      case 3: amx_pv_group<3>(pa, vb + c * chunk, nks, chunk, out + c * 256); break;
      case 2: amx_pv_group<2>(pa, vb + c * chunk, nks, chunk, out + c * 256); break;
      default: amx_pv_group<1>(pa, vb + c * chunk, nks, chunk, out + c * 256); break;
    }
  }
}

// V rows of one KV head as key pairs: step ks, pair j holds keys 32 ks + 2j and + 1 (off[] their
// element offsets, -1 = a key no row reads: zeros, since 0 x NaN from a released block is NaN).
// Chunk 2w gets d {0-3, 8-11, 16-19, 24-27} + 32w of both keys interleaved, chunk 2w + 1 the
// other 16 d of that 32 (vpunpck{l,h}wd work within 128-bit lanes); amx_unpermute undoes it.
// d 32w .. 32w + 31 of the two keys at element offsets o0, o1 interleaved: the first 16 pairs (as
// above) to lo, the other 16 to hi.
inline void amx_pair_slab(const at::BFloat16* vc, int64_t o0, int64_t o1, int w, at::BFloat16* lo,
                          at::BFloat16* hi) {
  const __m512i a = o0 < 0 ? _mm512_setzero_si512() : _mm512_loadu_si512(vc + o0 + 32 * w);
  const __m512i b = o1 < 0 ? _mm512_setzero_si512() : _mm512_loadu_si512(vc + o1 + 32 * w);
  _mm512_storeu_si512(lo, _mm512_unpacklo_epi16(a, b));
  _mm512_storeu_si512(hi, _mm512_unpackhi_epi16(a, b));
}

template <int D>
void amx_v_pairs(const at::BFloat16* vc, const int64_t* off, int nks, at::BFloat16* vb) {
  const int64_t chunk = static_cast<int64_t>(nks) * 512;
  for (int ks = 0; ks < nks; ++ks)
    for (int j = 0; j < 16; ++j) {
      at::BFloat16* row = vb + ks * 512 + j * 32;
      for (int w = 0; w < D / 32; ++w)
        amx_pair_slab(vc, off[ks * 32 + 2 * j], off[ks * 32 + 2 * j + 1], w, row + (2 * w) * chunk,
                      row + (2 * w + 1) * chunk);
    }
}

// One row tile's P.V with each 32-key step's V pairs made just before their products (decode: one
// row tile, so no other tile would reuse a whole chunk's pairs): per group of up to 4 column
// chunks, step ks's pairs go into a 4 KiB buffer that stays in L1 (amx_v_pairs' whole chunk, 32 KiB
// beside the score tiles, did not) and are multiplied at once. Per C tile the same P and V tiles,
// summed over the steps in the same order as amx_pv: the same bits.
template <int NC>
void amx_pv_stream_group(const at::BFloat16* vc, const int64_t* off, int nks, const at::BFloat16* pa, int w0,
                         float* out) {
  alignas(64) at::BFloat16 buf[2][NC * 512];
  if constexpr (NC > 0) _tile_zero(0);
  if constexpr (NC > 1) _tile_zero(1);
  if constexpr (NC > 2) _tile_zero(2);
  if constexpr (NC > 3) _tile_zero(3);
  for (int ks = 0; ks < nks; ++ks) {
    at::BFloat16* b = buf[ks & 1];
    for (int j = 0; j < 16; ++j)
      for (int w = 0; w < NC / 2; ++w)
        amx_pair_slab(vc, off[ks * 32 + 2 * j], off[ks * 32 + 2 * j + 1], w0 + w, b + (2 * w) * 512 + j * 32,
                      b + (2 * w + 1) * 512 + j * 32);
    _tile_loadd(6, pa + ks * 512, 64);
    if constexpr (NC > 0) { _tile_loadd(4, b, 64); _tile_dpbf16ps(0, 6, 4); }
    if constexpr (NC > 1) { _tile_loadd(5, b + 512, 64); _tile_dpbf16ps(1, 6, 5); }
    if constexpr (NC > 2) { _tile_loadd(7, b + 1024, 64); _tile_dpbf16ps(2, 6, 7); }
    if constexpr (NC > 3) { _tile_loadd(4, b + 1536, 64); _tile_dpbf16ps(3, 6, 4); }
  }
  if constexpr (NC > 0) _tile_stored(0, out, 64);
  if constexpr (NC > 1) _tile_stored(1, out + 256, 64);
  if constexpr (NC > 2) _tile_stored(2, out + 512, 64);
  if constexpr (NC > 3) _tile_stored(3, out + 768, 64);
}

template <int D>
void amx_pv_stream(const at::BFloat16* vc, const int64_t* off, int nks, const at::BFloat16* pa, float* out) {
  constexpr int nc = D / 16;  // even: D is a multiple of 32 here
  for (int c = 0; c < nc; c += 4) {
    if (nc - c >= 4)
      amx_pv_stream_group<4>(vc, off, nks, pa, c / 2, out + c * 256);
    else
      amx_pv_stream_group<2>(vc, off, nks, pa, c / 2, out + c * 256);
  }
}

// 16 fp32 probabilities to bf16 (round to nearest even), one P row.
void amx_store_p(const float* p, at::BFloat16* dst) {
  const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(p));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<const __m256i&>(h));
}

#pragma GCC pop_options
#else
bool cpu_has_amx() { return false; }
void amx_pv(const at::BFloat16*, const at::BFloat16*, int, int, float*) {}
template <int D>
void amx_v_pairs(const at::BFloat16*, const int64_t*, int, at::BFloat16*) {}
template <int D>
void amx_pv_stream(const at::BFloat16*, const int64_t*, int, const at::BFloat16*, float*) {}
void amx_store_p(const float*, at::BFloat16*) {}
void amx_begin() {}
void amx_end() {}
struct ScoreJob {
  const at::BFloat16* a;
  const at::BFloat16* b;
  float* c;
};
void amx_scores(const ScoreJob*, int, int64_t, int) {}
v16f amx_column(const float*, int) { return v16f{}; }
#endif

// The extension is built for the machine it runs on (-march=native), so the compiler's target is the CPU's.
constexpr bool cpu_has_dp() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

struct Workspace {
  std::vector<float> q, acc, mx, den, kT, p;
  std::vector<uint32_t> qw;  // the bf16-pair arithmetic: each row's raw q as 32-bit words (d, d + 1)
  // The AMX path: Q^T tiles per KV head, scores of a chunk, staged K rows, P rows, V pairs, P.V
  std::vector<at::BFloat16> bq, kstage, pa, vb;
  std::vector<float> cs, pv, corr;
  int nbt = 0;  // C tiles (16 query rows each) per KV head
  int64_t kvh0 = 0, kvh1 = 0;  // the work item's KV heads [kvh0, kvh1)
  int qh0 = 0, qh1 = 0;        // and of each, the query heads [qh0, qh1) of its g
  TilePrefetch pf;  // the next tile's rows (AVX2)
};

struct Problem {
  const void* k;
  const void* v;
  const float* k_scales;  // [slots, hkv] or null
  const float* v_scales;
  const int32_t* tables;
  int64_t max_blocks, block_size, hkv, window;  // window 0 = none
  int g;
  bool amx;  // the AMX arithmetic (bf16 q and cache, head_dim a multiple of 32)
  float scale;
  bool dp = false;  // the AVX-512 BF16 pair arithmetic for scores (same inputs, CPUs without AMX)
};

// Per 32 values: 16 even d then 16 odd d -> d order (n a multiple of 32).
inline void unpair_acc(float* acc, int64_t n) {
  for (int64_t c = 0; c < n; c += 32) {
    const v16f e = load16(acc + c), o = load16(acc + c + 16);
    const v16f lo = __builtin_shufflevector(e, o, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const v16f hi = __builtin_shufflevector(e, o, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    store16(acc + c, lo);
    store16(acc + c + 16, hi);
  }
}

// NR query heads (rows r, r + 1, ... of ws) of one token against one KV head's tile: kT the keys
// as fp32 (score_rows), or with Pairs their bf16 words (score_rows_dp, the raw q in ws.qw).
// kp: the tile's key rows for score_rows_direct (AVX2, float32 / bf16 caches), else null and kT used.
template <typename C, int D, int NR, bool Pairs>
inline void attend_rows(Workspace& ws, int64_t r, const float* kT, const C* const* kp, float scale, const C* vc,
                        const int64_t* off, const float* vscale, int j0, int j1) {
  float* ar[NR];
  float* pr[NR];
  const float* pc[NR];
  v16f sc[NR];
  float corr[NR];
  for (int u = 0; u < NR; ++u) {
    ar[u] = ws.acc.data() + (r + u) * D;
    pc[u] = pr[u] = ws.p.data() + u * kLanes;
  }
  if constexpr (Pairs) {
    const uint32_t* qr[NR];
    for (int u = 0; u < NR; ++u) qr[u] = ws.qw.data() + (r + u) * (D / 2);
    score_rows_dp<D, NR>(qr, kT, scale, sc);
    for (int u = 0; u < NR; ++u) corr[u] = softmax_step(sc[u], j0, j1, ws.mx[r + u], ws.den[r + u], pr[u]);
  } else {
    const float* qr[NR];
    for (int u = 0; u < NR; ++u) qr[u] = ws.q.data() + (r + u) * D;
#if defined(TESSERA_AVX2_HALVES)
    Scores16 s2[NR];  // two registers a row, not a v16f through the stack
    if constexpr (kDirectScores<C>) {
      if (kp) score_rows_direct<C, D, NR>(qr, kp, s2, ws.pf);
      else score_rows_halves<D, NR>(qr, kT, s2);
    } else {
      score_rows_halves<D, NR>(qr, kT, s2);
    }
    for (int u = 0; u < NR; ++u) corr[u] = softmax_step(s2[u], j0, j1, ws.mx[r + u], ws.den[r + u], pr[u]);
#else
    (void)kp;
    score_rows<D, NR>(qr, kT, sc);
    for (int u = 0; u < NR; ++u) corr[u] = softmax_step(sc[u], j0, j1, ws.mx[r + u], ws.den[r + u], pr[u]);
#endif
  }
  if constexpr (Pairs && std::is_same_v<C, at::BFloat16>)
    pv_rows_dp<D, NR>(ar, pc, corr, vc, off, j0, j1);
  else
    pv_rows<C, D, NR>(ar, pc, corr, vc, off, vscale, j0, j1, ws.pf);
}

// ---- The AMX arithmetic for a work item (bf16 caches, head_dim a multiple of 32, CPUs with
// AMX). Keys go in absolute chunks of kChunk positions: all scores of a chunk first (tile products,
// see above), then per row one online-softmax step over the whole chunk (its max, the rescale of
// what came before, probabilities by the fixed exp, their sum tile by tile in order), then
// P.V with the probabilities rounded to bf16, summed over the chunk in 32-key steps in order,
// and acc = acc x corr + P.V (one rounding). A row's arithmetic never depends on the rows beside
// it, so a decode equals the same token in a prefill chunk here too.
constexpr int64_t kChunk = 256;
constexpr int kChunkTiles = kChunk / kLanes;

template <int D>
void amx_attend_item(const Problem& pb, const int32_t* table, int tq, const int64_t* lo, const int64_t* hi,
                     int64_t lo_all, int64_t hi_all, Workspace& ws) {
  const int g = pb.g, nbt = ws.nbt;
  const int64_t hkv = pb.hkv, heads = hkv * g, row_stride = hkv * D, bs = pb.block_size;
  constexpr int nc = D / 16, ksteps = D / 32;
  const at::BFloat16* kc = static_cast<const at::BFloat16*>(pb.k);
  const at::BFloat16* vc = static_cast<const at::BFloat16*>(pb.v);
  const float ninf = -std::numeric_limits<float>::infinity();
  const v16f lane = (v16f){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  ws.cs.resize(static_cast<size_t>(hkv) * nbt * kChunkTiles * 256);
  ws.pa.resize(static_cast<size_t>(nbt) * (kChunkTiles / 2) * 512);
  ws.vb.resize(static_cast<size_t>(nc) * (kChunkTiles / 2) * 512);
  ws.pv.resize(static_cast<size_t>(nc) * 256);
  ws.corr.resize(static_cast<size_t>(nbt) * 16);
  int64_t slot[kChunk], off[kChunk];
  for (int64_t c0 = lo_all / kChunk * kChunk; c0 < hi_all; c0 += kChunk) {
    // Tiles [tf, tl] of the chunk hold keys some row reads; P.V runs over the 32-key steps
    // covering them (a tile of a step outside the range has p = 0 and zero V rows).
    const int tf = static_cast<int>(std::max<int64_t>(lo_all - c0, 0) / kLanes);
    const int tl = static_cast<int>((std::min<int64_t>(hi_all - c0, kChunk) - 1) / kLanes);
    const int ks0 = tf / 2, nks = tl / 2 - ks0 + 1;
    const int64_t k0 = c0 + ks0 * 32;  // position of the first key of step 0
    // A block at a time: one division per block, not per key (the 64-bit divisions were 4-8% of
    // a decode item's cycles).
    for (int i = 0; i < nks * 32;) {
      const int64_t pos = k0 + i, in_block = pos % bs;
      const int n = static_cast<int>(std::min<int64_t>(bs - in_block, nks * 32 - i));
      // (the table is read only for a block holding a key some row reads: past the context its
      // entries may not exist)
      const bool read = pos + n > lo_all && pos < hi_all;
      const int64_t base = read ? static_cast<int64_t>(table[pos / bs]) * bs + in_block : 0;
      for (int j = 0; j < n; ++j) slot[i + j] = pos + j < lo_all || pos + j >= hi_all ? -1 : base + j;
      i += n;
    }
    // The chunk's key rows, then its value rows, towards L2 before the tile loads ask for them: a
    // model's cache does not stay in the caches, and a walk through random blocks outruns the
    // hardware prefetcher at every block edge. (The values: decode b32 0.56 -> 0.54 ms a layer on
    // an Intel Xeon with AMX; the V loads were half the samples. Prefetching the next work item's
    // rows as well measured no better.)
    const int64_t pf0 = ws.kvh0 * D * 2, pf1 = ws.kvh1 * D * 2;  // the item's heads' bytes of a row
    for (int i = 0; i < nks * 32; ++i)
      if (slot[i] >= 0)
        for (int64_t b = pf0; b < pf1; b += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(kc + slot[i] * row_stride) + b, 0, 2);
    for (int i = 0; i < nks * 32; ++i)
      if (slot[i] >= 0)
        for (int64_t b = pf0; b < pf1; b += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(vc + slot[i] * row_stride) + b, 0, 2);
    // Scores: per tile, the keys in place when its 16 slots are consecutive, else staged.
    ScoreJob jobs[64];
    int njobs = 0;
    for (int i = tf; i <= tl; ++i) {
      const int64_t* sl = slot + (i - ks0 * 2) * kLanes;
      bool direct = sl[0] >= 0;
      for (int j = 1; j < kLanes && direct; ++j) direct = sl[j] == sl[0] + j;
      const at::BFloat16* base;
      if (direct) {
        base = kc + sl[0] * row_stride;
      } else {
        ws.kstage.resize(static_cast<size_t>(kChunkTiles) * kLanes * row_stride);
        at::BFloat16* stage = ws.kstage.data() + i * kLanes * row_stride;
        for (int j = 0; j < kLanes; ++j) {
          if (sl[j] < 0)
            std::memset(static_cast<void*>(stage + j * row_stride), 0, sizeof(at::BFloat16) * row_stride);
          else
            std::memcpy(static_cast<void*>(stage + j * row_stride), kc + sl[j] * row_stride,
                        sizeof(at::BFloat16) * row_stride);
        }
        base = stage;
      }
      for (int64_t kvh = ws.kvh0; kvh < ws.kvh1; ++kvh)
        for (int nb = 0; nb < nbt; ++nb) {
          jobs[njobs++] = {base + kvh * D, ws.bq.data() + (kvh * nbt + nb) * ksteps * 512,
                           ws.cs.data() + ((kvh * nbt + nb) * kChunkTiles + i) * 256};
          if (njobs == 64) {
            amx_scores(jobs, njobs, row_stride * 2, ksteps);
            njobs = 0;
          }
        }
    }
    if (njobs) amx_scores(jobs, njobs, row_stride * 2, ksteps);
    for (int64_t kvh = ws.kvh0; kvh < ws.kvh1; ++kvh) {
      for (int i = 0; i < nks * 32; ++i) off[i] = slot[i] < 0 ? -1 : slot[i] * row_stride + kvh * D;
      float* cs = ws.cs.data() + kvh * nbt * kChunkTiles * 256;
      // Many rows (a prefill item): transpose each C tile in place, so a row's 16 scores are one
      // load; few rows (a decode): gather the row's column. The same values either way.
      const bool transposed = tq * g > 8;
      if (transposed)
        for (int nb = 0; nb < nbt; ++nb)
          for (int i = tf; i <= tl; ++i) {
            float* tile = cs + (nb * kChunkTiles + i) * 256;
            v16f rv[16];
            for (int k = 0; k < 16; ++k) rv[k] = load16(tile + k * 16);
            transpose16(rv);
            for (int k = 0; k < 16; ++k) store16(tile + k * 16, rv[k]);
          }
      // Rows past the item's last (a decode's 13 of 16: the padding columns of Q^T) are skipped:
      // their P rows keep whatever finite values an earlier item left, and the C rows they make
      // are never read (each C row is its own P row times V), so nothing is zeroed for them.
      const int n_rows = std::min(nbt * 16, tq * g);
      for (int n = 0; n < n_rows; ++n) {
        // P row n of step ks: ws.pa[((n / 16) * nks + ks) * 512 + (n % 16) * 32 + key]
        at::BFloat16* prow = ws.pa.data() + (n / 16) * nks * 512 + (n % 16) * 32;
        const int t = n / g;
        v16f sc[kChunkTiles];
        float m = ninf;
        if (t < tq) {
          // The row's max lane by lane over the tiles, then across lanes once (max is exact, so
          // the order does not matter).
          v16f vm = splat(ninf);
          for (int i = tf; i <= tl; ++i) {
            const float first = static_cast<float>(lo[t] - (c0 + i * kLanes));
            const float end = static_cast<float>(hi[t] - (c0 + i * kLanes));
            const float* tile = cs + ((n / 16) * kChunkTiles + i) * 256;
            const v16f s = (transposed ? load16(tile + (n % 16) * 16) : amx_column(tile, n % 16)) * pb.scale;
            sc[i] = (lane >= first) & (lane < end) ? s : splat(ninf);
            vm = vm > sc[i] ? vm : sc[i];
          }
          m = lane_max(vm);
        }
        if (m == ninf) {  // no key of this row in the chunk: P = 0, no change
          for (int ks = 0; ks < nks; ++ks) std::memset(static_cast<void*>(prow + ks * 512), 0, 64);
          ws.corr[n] = 1.f;
          continue;
        }
        const int64_t r = t * heads + kvh * g + n % g;
        const float bm = std::max(ws.mx[r], m);
        const float corr = bm == ws.mx[r] ? 1.f : softmax_exp(splat(ws.mx[r] - bm))[0];
        v16f sum = {};
        alignas(64) float e[kLanes];
        for (int i = ks0 * 2; i < (ks0 + nks) * 2; ++i) {
          at::BFloat16* dst = prow + (i / 2 - ks0) * 512 + (i % 2) * 16;
          if (i < tf || i > tl) {
            std::memset(static_cast<void*>(dst), 0, 32);
            continue;
          }
          const v16f p = softmax_exp(sc[i] - bm);
          sum = sum + p;
          store16(e, p);
          amx_store_p(e, dst);
        }
        ws.den[r] = std::fma(ws.den[r], corr, lane_sum(sum));
        ws.mx[r] = bm;
        ws.corr[n] = corr;
      }
      // One row tile (a decode): each step's V pairs made as P.V reaches them; more (a prefill
      // item): the chunk's pairs once, reused by every row tile.
      const bool stream = nbt == 1;
      if (!stream) amx_v_pairs<D>(vc, off, nks, ws.vb.data());
      for (int nb = 0; nb < nbt; ++nb) {
        if (stream)
          amx_pv_stream<D>(vc, off, nks, ws.pa.data(), ws.pv.data());
        else
          amx_pv(ws.pa.data() + nb * nks * 512, ws.vb.data(), nc, nks, ws.pv.data());
        for (int m = 0; m < 16; ++m) {
          const int n = nb * 16 + m, t = n / g;
          if (t >= tq) break;
          float* acc = ws.acc.data() + (t * heads + kvh * g + n % g) * D;
          const v16f corr = splat(ws.corr[n]);
          for (int c = 0; c < nc; ++c)
            store16(acc + c * 16, fma16(load16(acc + c * 16), corr, load16(ws.pv.data() + c * 256 + m * 16)));
        }
      }
    }
  }
  // acc from amx_v_pairs' column order back to d order: per 32 d, the first 16 hold d
  // {0-3, 8-11, 16-19, 24-27}, the next 16 the rest.
  const int64_t total = tq * heads * D;
  for (int64_t c = 0; c < total; c += 32) {
    float tmp[32];
    for (int l = 0; l < 4; ++l)
      for (int i = 0; i < 4; ++i) {
        tmp[8 * l + i] = ws.acc[c + 4 * l + i];
        tmp[8 * l + 4 + i] = ws.acc[c + 16 + 4 * l + i];
      }
    std::memcpy(ws.acc.data() + c, tmp, sizeof(tmp));
  }
}

// One work item: tq tokens of the sequence whose block table is `table` (rows t * H + head of
// ws.q, already fp32 and scaled), all KV heads: a tile's K/V rows are read once, and each KV head's keys are converted and transposed once for
// its g query heads and all tq tokens. Leaves acc and den in ws.
template <typename C, int D>
void attend_item(const Problem& pb, const int32_t* table, const int32_t* ctx, int tq, Workspace& ws) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  const int g = pb.g;
  const int64_t hkv = pb.hkv, heads = hkv * g, rows = tq * heads;
  ws.acc.assign(static_cast<size_t>(rows) * D, 0.f);
  ws.mx.assign(rows, -std::numeric_limits<float>::infinity());
  ws.den.assign(rows, 0.f);
  ws.kT.resize(static_cast<size_t>(D) * kLanes);
  ws.p.resize(3 * kLanes);
  const C* kc = static_cast<const C*>(pb.k);
  const C* vc = static_cast<const C*>(pb.v);
  const bool scaled = pb.k_scales != nullptr;
  const int64_t row_stride = hkv * D, bs = pb.block_size;
  // Each token's keys are [lo, hi): its context, cut to its window.
  int64_t lo_all = std::numeric_limits<int64_t>::max(), hi_all = 0;
  int64_t lo[kTileQAmx], hi[kTileQAmx];
  for (int t = 0; t < tq; ++t) {
    hi[t] = ctx[t];
    lo[t] = pb.window > 0 ? std::max<int64_t>(0, hi[t] - pb.window) : 0;
    lo_all = std::min(lo_all, lo[t]);
    hi_all = std::max(hi_all, hi[t]);
  }
  if constexpr (std::is_same_v<C, at::BFloat16> && D % 32 == 0) {
    if (pb.amx) {
      amx_attend_item<D>(pb, table, tq, lo, hi, lo_all, hi_all, ws);
      return;
    }
  }
  float* kT = ws.kT.data();
  // slots[j] of the tile's positions some token reads (never one behind every window), -1 = none.
  auto tile_slots = [&](int64_t start, int64_t* slots) {
    for (int j = 0; j < kLanes; ++j) {
      const int64_t pos = start + j;
      slots[j] = pos < lo_all || pos >= hi_all ? -1 : static_cast<int64_t>(table[pos / bs]) * bs + pos % bs;
    }
  };
  // The next tile's key and value rows are prefetched towards L2 while this one is computed: a
  // model's cache does not stay in the caches, and the walk through shuffled blocks outruns the
  // hardware prefetcher at every block edge. Measured (AMD EPYC Zen 4, model 17; 30 caches in
  // turn, one process alternating): decode b32 0.87 -> 0.66 ms a layer, b1 0.062 -> 0.050; the K
  // and V loads had been two thirds of the kernel's samples. Into L1 (prefetcht0) gained nothing:
  // the prefetches then stalled on the L1's few miss buffers. Each KV head's turn prefetches that
  // head's bytes of the next tile (session 16): all heads' at once, at the tile's start, held a
  // fifth of the kernel's samples on the prefetches themselves (the miss buffers full, the
  // scores waiting behind them); spread over the heads, decode b32 x 320 0.579 -> 0.436 ms (8 of
  // 8 rounds), prefill and b1 unchanged (one item per KV head there, or compute-bound).
  // Not on CPUs without AVX-512 (Zen 3): there a head's burst stalled the core on its miss
  // buffers (12% of the kernel's samples; 3-5% faster without it, session 33). Instead the item's
  // heads' rows of the next tile go out a K and a V line at a time from inside the score and P.V
  // loops (ws.pf, TilePrefetch), spread over this tile's compute. A plain read of the same blocks
  // runs at 25-33 GB/s where the kernel had read 13.7: the misses, not the bandwidth, were the
  // bound. Zen 3, 30 caches in turn, modes alternating call by call in one process (ms a layer):
  // b32 x 320 1.146 -> 0.754 and 1.155 -> 0.750, b8 0.327 -> 0.224 and 0.316 -> 0.220, b1 0.073
  // -> 0.071; two tiles ahead, two lines a step or other hints were no better.
#if defined(__AVX512F__)
  constexpr bool kPrefetchNextTile = true;
#else
  constexpr bool kPrefetchNextTile = false;
#endif
  // One KV head's key (or value) rows of a tile, towards L2.
  auto prefetch_head = [&](const C* base, const int64_t* sl, int64_t kvh) {
    // GCC deletes a loop whose only statements are prefetches (they have no side effects, and
    // C++ lets it assume such a loop ends): an empty volatile asm keeps it.
    asm volatile("");
    const int64_t b0 = kvh * D * static_cast<int64_t>(sizeof(C)), b1 = b0 + D * static_cast<int64_t>(sizeof(C));
    for (int j = 0; j < kLanes; ++j)
      if (sl[j] >= 0)
        for (int64_t b = b0; b < b1; b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(base + sl[j] * row_stride) + b, _MM_HINT_T1);
  };
  int64_t slots[kLanes], next[kLanes], off[kLanes];
  float kscale[kLanes], vscale[kLanes];
  tile_slots(lo_all / kLanes * kLanes, next);
  for (int64_t start = lo_all / kLanes * kLanes; start < hi_all; start += kLanes) {
    std::copy(next, next + kLanes, slots);
    const bool has_next = start + kLanes < hi_all;
    if (has_next) tile_slots(start + kLanes, next);
#if defined(TESSERA_AVX2_HALVES)
    if (has_next) {
      const int64_t head_bytes = D * static_cast<int64_t>(sizeof(C));
      ws.pf.aim(reinterpret_cast<const char*>(kc), reinterpret_cast<const char*>(vc), next,
                row_stride * static_cast<int64_t>(sizeof(C)), ws.kvh0 * head_bytes, (ws.kvh1 - ws.kvh0) * head_bytes);
    } else {
      ws.pf.idle();
    }
#endif
    const bool prefetch = kPrefetchNextTile && has_next;
    for (int64_t kvh = ws.kvh0; kvh < ws.kvh1; ++kvh) {
      for (int j = 0; j < kLanes; ++j) {
        off[j] = slots[j] < 0 ? -1 : slots[j] * row_stride + kvh * D;
        kscale[j] = scaled && slots[j] >= 0 ? pb.k_scales[slots[j] * hkv + kvh] : 1.f;
        vscale[j] = scaled && slots[j] >= 0 ? pb.v_scales[slots[j] * hkv + kvh] : 1.f;
      }
      // Every token's query heads of this KV head against the tile, 3 heads at a time.
      const C* const* kp = nullptr;
#if defined(TESSERA_AVX2_HALVES)
      // Scores from the cache rows in place (score8_direct; the same bits as from kT). Float32 keys
      // always; bf16 keys only for one or two tokens, since each row converts the keys again: a
      // tile of 16 tokens does better with them converted once into kT. Zen 3, 30 caches in turn,
      // modes alternating in one process (ms a layer, old -> direct): float32 b1 x 320 0.100 ->
      // 0.087, b8 0.495 -> 0.431, b32 1.492 -> 1.307, prefill 256 1.360 -> 1.198; bf16 b32 1.656 ->
      // 1.342, its prefill 256 1.46 -> 1.50-1.55 (so not there).
      const C* krow[kLanes];
      if constexpr (kDirectScores<C>) {
        if (std::is_same_v<C, float> || tq <= 2) {
          // a position no row reads scores against zeros (every row masks it), as in kT
          alignas(64) static const C kZeroRow[256] = {};
          for (int j = 0; j < kLanes; ++j) krow[j] = off[j] < 0 ? kZeroRow : kc + off[j];
          kp = krow;
        }
      }
#endif
      auto attend_tokens = [&](auto pairs) {
        constexpr bool P = decltype(pairs)::value;
        for (int t = 0; t < tq; ++t) {
          const int j0 = static_cast<int>(std::max<int64_t>(lo[t] - start, 0));
          const int j1 = static_cast<int>(std::min<int64_t>(hi[t] - start, kLanes));
          if (j0 >= j1) continue;
          const int64_t r0 = t * heads + kvh * g;
          const int h1 = ws.qh1;
          int h = ws.qh0;
          for (; h + 3 <= h1; h += 3) attend_rows<C, D, 3, P>(ws, r0 + h, kT, kp, pb.scale, vc, off, vscale, j0, j1);
          if (h1 - h == 2) attend_rows<C, D, 2, P>(ws, r0 + h, kT, kp, pb.scale, vc, off, vscale, j0, j1);
          if (h1 - h == 1) attend_rows<C, D, 1, P>(ws, r0 + h, kT, kp, pb.scale, vc, off, vscale, j0, j1);
        }
      };
      // The next tile's rows of this head go out in two halves, each behind this tile's loads of
      // the same kind: its keys once this tile's keys are read, its values once the head's P.V has
      // read this tile's values. Issued ahead of a head's loads, the prefetches had filled the
      // miss queue those loads then waited in (a sixth of the kernel's samples sat on the burst's
      // first prefetch). AMD EPYC Zen 4 (model 17), 30 caches in turn, placements alternating in one
      // process, ms a layer: bf16-pair arithmetic b32 x 320 0.398-0.428 -> 0.360-0.389, b8 0.116 ->
      // 0.101; fp32 arithmetic b32 0.479-0.497 -> 0.409-0.434; b1 and prefill 256 unchanged. Keys
      // and values of a head together after its K loads, or after its P.V, were in between.
      if constexpr (kPairedBf16<C, D>) {
        if (pb.dp) {
          load_k_tile_bf16<D, true>(kc, off, kT);
          if (prefetch) prefetch_head(kc, next, kvh);
          attend_tokens(std::true_type{});
          if (prefetch) prefetch_head(vc, next, kvh);
          continue;
        }
        if (!kp) load_k_tile_bf16<D, false>(kc, off, kT);
      } else {
        if (!kp) load_k_tile<C, D>(kc, off, kscale, kT);
      }
      if (prefetch) prefetch_head(kc, next, kvh);
      attend_tokens(std::false_type{});
      if (prefetch) prefetch_head(vc, next, kvh);
    }
  }
  if constexpr (kPairedBf16<C, D>) unpair_acc(ws.acc.data(), rows * D);
}

using AttendFn = void (*)(const Problem&, const int32_t*, const int32_t*, int, Workspace&);

template <typename C>
AttendFn pick_head_dim(int64_t d) {
  switch (d) {
    case 16: return &attend_item<C, 16>;
    case 32: return &attend_item<C, 32>;
    case 64: return &attend_item<C, 64>;
    case 80: return &attend_item<C, 80>;
    case 96: return &attend_item<C, 96>;
    case 128: return &attend_item<C, 128>;
    case 256: return &attend_item<C, 256>;
    default: TORCH_CHECK(false, "paged_attention: head_dim ", d, " not in 16/32/64/80/96/128/256");
  }
  return nullptr;
}

// dst[i] = T(a[i] * inv), i < d (d a multiple of 16); bf16 rounds to nearest even in 16 lanes
// where the CPU converts in hardware (the scalar conversion was a sixth of a prefill's time).
// The instruction flushes a denormal result to zero, as the linears' outputs already do; an
// attention output is a weighted mean of values and never that small in practice.
template <typename T>
inline void store_row(const float* a, float inv, int64_t d, T* dst) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m512 s = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < d; i += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(a + i), s));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<const __m256i&>(h));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(a[i] * inv);
}

template <typename T>
void run(const at::Tensor& q, const Problem& pb, AttendFn attend, const int32_t* seq_idx, const int32_t* ctx,
         double scale, at::Tensor& out) {
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t qs = q.stride(0);  // a token's row: its heads are contiguous, tokens may be further apart
  const int g = pb.g;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // Work items: runs of up to kTileQ (AMX: kTileQAmx) consecutive tokens of one sequence (a prefill
  // span's rows) times KV heads, costliest first, pulled from a shared counter by the threads.
  const int64_t tile_q = pb.amx ? kTileQAmx : kTileQ;
  struct Item {
    int64_t first, cost;
    int tq;
    int64_t kvh0, kvh1;  // KV heads [kvh0, kvh1)
    int qh0, qh1;        // of each KV head, its query heads [qh0, qh1) of g
  };
  std::vector<Item> items;
  for (int64_t i = 0; i < t;) {
    int64_t j = i + 1;
    while (j < t && j - i < tile_q && seq_idx[j] == seq_idx[i]) ++j;
    int64_t lo = ctx[i], hi = ctx[i];
    for (int64_t x = i; x < j; ++x) {
      lo = std::min<int64_t>(lo, pb.window > 0 ? std::max<int64_t>(0, ctx[x] - pb.window) : 0);
      hi = std::max<int64_t>(hi, ctx[x]);
    }
    items.push_back({i, ((hi - lo) / kLanes + 1) * ((j - i) * g + 8), static_cast<int>(j - i), 0, pb.hkv, 0, g});
    i = j;
  }
  // Fewer items than threads (a decode of one or a few sequences): an item per KV head instead.
  // Each KV head's rows are computed alone either way (same arithmetic, same bits); only the
  // sharing of a slot's row between the heads' loads is given up.
  // Still fewer than threads (one KV head: MQA, Gemma 3's 270M; not on AMX, whose tile products
  // take a KV head's query heads together): each KV head's query heads in two halves. Each half
  // reads the head's whole K/V, the second time mostly from L3, and converts its key tiles again.
  // Gemma 3 270M's shape (4 query heads, 1 KV head, d 256), decode b1 x 500, AMD EPYC Zen 4:
  // 0.064-0.068 -> 0.051-0.057 ms a layer; SmolLM2's 3 KV heads over 2 threads lost by it
  // (0.029 -> 0.033), so it is only done where a thread would idle.
  const int64_t threads_max = at::get_num_threads();
  if ((pb.hkv > 1 || (g > 1 && !pb.amx)) && static_cast<int64_t>(items.size()) < threads_max) {
    const bool halves = g > 1 && !pb.amx && static_cast<int64_t>(items.size()) * pb.hkv < threads_max;
    const int mid = halves ? (g + 1) / 2 : g;
    std::vector<Item> split;
    for (const Item& it : items)
      for (int64_t kvh = 0; kvh < pb.hkv; ++kvh) {
        split.push_back({it.first, it.cost / pb.hkv * mid / g, it.tq, kvh, kvh + 1, 0, mid});
        if (halves) split.push_back({it.first, it.cost / pb.hkv * (g - mid) / g, it.tq, kvh, kvh + 1, mid, g});
      }
    items.swap(split);
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const float fscale = static_cast<float>(scale);
  auto work = [&](const Item& it, Workspace& ws) {
    const int64_t rows = it.tq * h;
    ws.kvh0 = it.kvh0;
    ws.kvh1 = it.kvh1;
    ws.qh0 = it.qh0;
    ws.qh1 = it.qh1;
    const int64_t head0 = it.kvh0 * g, head1 = it.kvh1 * g;  // the item's query heads
    if (pb.amx) {
      // Q^T tiles per KV head: column n = t * g + (head % g) holds the row's d as VNNI pairs,
      // tile (kvh, nb, ks) = 16 pairs x 16 columns x 2; unused columns are zero.
      const int64_t ksteps = d / 32;
      ws.nbt = static_cast<int>((it.tq * g + 15) / 16);
      const size_t bq_size = static_cast<size_t>(pb.hkv) * ws.nbt * ksteps * 512;
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        // Tile (kvh, nb, ks) is the transpose of its 16 columns' 32-bit words (d pairs) 16 ks ..
        // 16 ks + 15: 16 row loads, one 16 x 16 register transpose, 16 stores, padding columns
        // zero (the word-by-word copy it replaces was most of this function's time in a
        // prefill). Every word of the item's heads' tiles is written; the other heads' are unread.
        ws.bq.resize(bq_size);
        for (int64_t kvh = it.kvh0; kvh < it.kvh1; ++kvh)
          for (int nb = 0; nb < ws.nbt; ++nb) {
            at::BFloat16* tile = ws.bq.data() + (kvh * ws.nbt + nb) * ksteps * 512;
            for (int64_t ks = 0; ks < ksteps; ++ks) {
              v16f rv[16];
              for (int col = 0; col < 16; ++col) {
                const int64_t n = nb * 16 + col, t = n / g;
                rv[col] = t < it.tq ? load16(reinterpret_cast<const float*>(
                                          qp + (it.first + t) * qs + (kvh * g + n % g) * d + ks * 32))
                                    : v16f{};
              }
              transpose16(rv);
              for (int r = 0; r < 16; ++r) store16(reinterpret_cast<float*>(tile + ks * 512 + r * 32), rv[r]);
            }
          }
      } else {
        ws.bq.assign(bq_size, at::BFloat16(0.f));
        for (int64_t t = 0; t < it.tq; ++t)
          for (int64_t head = head0; head < head1; ++head) {
            const int64_t kvh = head / g, n = t * g + head % g, nb = n / 16, col = n % 16;
            const T* src = qp + (it.first + t) * qs + head * d;
            at::BFloat16* tile = ws.bq.data() + (kvh * ws.nbt + nb) * ksteps * 512;
            for (int64_t i = 0; i < d; ++i)
              tile[(i / 32) * 512 + ((i % 32) / 2) * 32 + col * 2 + i % 2] = static_cast<at::BFloat16>(src[i]);
          }
      }
    } else if (pb.dp) {
      // Raw bf16 q as words (d, d + 1); the scale multiplies the scores (score_rows_dp). pb.dp is
      // only set for bf16 q, so other instantiations never copy.
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        ws.qw.resize(static_cast<size_t>(rows) * d / 2);
        for (int64_t t = 0; t < it.tq; ++t)
          std::memcpy(ws.qw.data() + t * h * d / 2, qp + (it.first + t) * qs, static_cast<size_t>(h) * d * sizeof(T));
      }
    } else {
      ws.q.resize(static_cast<size_t>(rows) * d);
      for (int64_t r = 0; r < rows; ++r) {  // row t * H + head is q[first + t, head]
        const T* src = qp + (it.first + r / h) * qs + (r % h) * d;
        float* dst = ws.q.data() + r * d;
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]) * fscale;
      }
    }
    attend(pb, pb.tables + static_cast<int64_t>(seq_idx[it.first]) * pb.max_blocks, ctx + it.first, it.tq, ws);
    for (int64_t r = 0; r < rows; ++r) {
      if (r % h < head0 || r % h >= head1 || r % g < it.qh0 || r % g >= it.qh1) continue;  // row t * H + head
      const float inv = ws.den[r] > 0.f ? 1.f / ws.den[r] : 0.f;
      T* dst = op + (it.first * h + r) * d;
      const float* a = ws.acc.data() + r * d;
      store_row(a, inv, d, dst);
    }
  };
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) {
    thread_local Workspace ws;
    if (pb.amx) amx_begin();
    for (const Item& it : items) work(it, ws);
    if (pb.amx) amx_end();
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    thread_local Workspace ws;
    if (pb.amx) amx_begin();  // tile state is per thread
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) work(items[i], ws);
    if (pb.amx) amx_end();
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_idx, const at::Tensor& ctx_len,
                           int64_t block_size, double scale, int64_t window, const std::optional<at::Tensor>& k_scales,
                           const std::optional<at::Tensor>& v_scales, int64_t amx) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "paged_attention: q [T,H,d], caches [S,Hkv,d]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_attention: K and V caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  const int64_t d = q.size(2), h = q.size(1), hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == d && v_cache.size(2) == d, "paged_attention: q and caches differ in head_dim");
  TORCH_CHECK(h % hkv == 0, "paged_attention: H must be a multiple of Hkv");
  TORCH_CHECK(window >= 0, "paged_attention: window must be >= 0 (0 = none)");
  const auto cache_type = k_cache.scalar_type();
  const bool quantized = cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn;
  TORCH_CHECK(quantized == (k_scales.has_value() && v_scales.has_value()),
              "paged_attention: int8/fp8 caches need k_scales and v_scales (and only they take them)");
  TORCH_CHECK(quantized || cache_type == q.scalar_type(), "paged_attention: q and the caches must share a dtype");
  at::Tensor ks, vs;
  if (quantized) {
    ks = k_scales->to(at::kFloat).contiguous();
    vs = v_scales->to(at::kFloat).contiguous();
    TORCH_CHECK(ks.numel() == k_cache.size(0) * hkv && vs.numel() == ks.numel(),
                "paged_attention: scales must be [slots, Hkv, 1]");
  }
  // q is read a token's [H, d] row at a time: a view into the fused qkv output (rows further
  // apart than H * d) is read in place, without the copy q.contiguous() would make every call.
  auto qc = q.stride(2) == 1 && q.stride(1) == d && q.stride(0) >= h * d ? q : q.contiguous();
  auto tables = block_tables.to(at::kInt).contiguous();
  auto seqs = seq_idx.to(at::kInt).contiguous();
  auto ctx = ctx_len.to(at::kInt).contiguous();
  auto out = at::empty({q.size(0), h * d}, q.options());
  if (q.size(0) == 0) return out;
  Problem pb{k_cache.data_ptr(), v_cache.data_ptr(), quantized ? ks.data_ptr<float>() : nullptr,
             quantized ? vs.data_ptr<float>() : nullptr, tables.data_ptr<int32_t>(), tables.size(1), block_size,
             hkv, window, static_cast<int>(h / hkv), false, static_cast<float>(scale)};
  // amx (the arithmetic): -1 the CPU's best (AMX tiles, else AVX-512 BF16 pairs, else the fp32
  // AVX-512 one), 0 the fp32 AVX-512 arithmetic, 1 AMX required, 2 AVX-512 BF16 pairs required.
  // AMX and the pairs need bf16 q and cache and head_dim a multiple of 32; other calls take the fp32 one.
  const bool pairs_fit = cache_type == at::kBFloat16 && q.scalar_type() == at::kBFloat16 && d % 32 == 0;
  TORCH_CHECK(amx >= -1 && amx <= 2, "paged_attention: amx must be -1, 0, 1 or 2");
  TORCH_CHECK(amx != 1 || (pairs_fit && cpu_has_amx()), "paged_attention: amx=1 needs bf16 q and cache, head_dim a "
              "multiple of 32 and a CPU with AMX");
  TORCH_CHECK(amx != 2 || (pairs_fit && cpu_has_dp()), "paged_attention: amx=2 needs bf16 q and cache, head_dim a "
              "multiple of 32 and a CPU with AVX-512 BF16");
  pb.amx = (amx == -1 || amx == 1) && pairs_fit && cpu_has_amx();
  pb.dp = !pb.amx && (amx == -1 || amx == 2) && pairs_fit && cpu_has_dp();
  AttendFn attend = nullptr;
  switch (cache_type) {
    case at::kBFloat16: attend = pick_head_dim<at::BFloat16>(d); break;
    case at::kFloat: attend = pick_head_dim<float>(d); break;
    case at::kHalf: attend = pick_head_dim<at::Half>(d); break;
    case at::kChar: attend = pick_head_dim<int8_t>(d); break;
    case at::kFloat8_e4m3fn: attend = pick_head_dim<c10::Float8_e4m3fn>(d); break;
    default: TORCH_CHECK(false, "paged_attention: cache dtype ", cache_type, " not supported");
  }
  const int32_t* sp = seqs.data_ptr<int32_t>();
  const int32_t* cp = ctx.data_ptr<int32_t>();
  switch (q.scalar_type()) {
    case at::kBFloat16: run<at::BFloat16>(qc, pb, attend, sp, cp, scale, out); break;
    case at::kFloat: run<float>(qc, pb, attend, sp, cp, scale, out); break;
    case at::kHalf: run<at::Half>(qc, pb, attend, sp, cp, scale, out); break;
    default: TORCH_CHECK(false, "paged_attention: dtype ", q.scalar_type(), " not supported");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera_inv, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_idx, "
        "Tensor ctx_len, int block_size, float scale, int window=0, Tensor? k_scales=None, "
        "Tensor? v_scales=None, int amx=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(tessera_inv, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
