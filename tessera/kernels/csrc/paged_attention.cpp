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
// - two query heads of one token share every kT and V load (same FMAs per row as alone);
// - work items are ordered by cost and pulled from a shared counter: the split over threads
//   changes only who computes a row, not how.
// Sliding windows: a row at position p reads keys [p - window + 1, p] only; tiles wholly behind
// every row's window are skipped and positions behind the window are never loaded (their block
// table entries may be block 0, released by the scheduler).
// Quantized caches (int8 / float8_e4m3fn codes with an fp32 scale per slot and KV head) are
// dequantized on load: key = float(code) * scale in fp32, the value tensor.dequantize gives.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

namespace {

constexpr int kLanes = 16;  // key positions per tile (one AVX-512 register of fp32)
constexpr int kTileQ = 16;  // query tokens of one sequence sharing a K/V tile load

typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));

// ---- 16-lane fp32 primitives: AVX-512 where the CPU has it, the same IEEE ops lane by lane
// otherwise (so a machine without AVX-512 gets the same bits, only slower).

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, 64);
  return v;
}
inline void store16(float* p, v16f v) { std::memcpy(p, &v, 64); }
inline v16f splat(float x) { return (v16f){} + x; }

inline v16f fma16(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
  return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  v16f r;
  for (int i = 0; i < 16; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

inline v16f fnma16(v16f a, v16f b, v16f c) {  // c - a * b, one rounding
#if defined(__AVX512F__)
  return (v16f)_mm512_fnmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  v16f r;
  for (int i = 0; i < 16; ++i) r[i] = std::fma(-a[i], b[i], c[i]);
  return r;
#endif
}

inline v16f round16(v16f x) {  // to the nearest integer, ties to even
#if defined(__AVX512F__)
  return (v16f)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
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

inline float lane_max(v16f a) {  // max is exact: any order gives the same value
  float m = a[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, a[i]);
  return m;
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

// ---- cache rows to fp32 (exact conversions; quantized codes times their scale)

template <typename C>
inline void row_to_f32(const C* src, float* dst, int d, float scale, bool scaled);

template <>
inline void row_to_f32<float>(const float* src, float* dst, int d, float, bool) {
  std::memcpy(dst, src, sizeof(float) * d);
}

typedef uint16_t v16u16 __attribute__((vector_size(32), aligned(2)));
typedef int8_t v16i8 __attribute__((vector_size(16), aligned(1)));
typedef uint8_t v16u8 __attribute__((vector_size(16), aligned(1)));
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4)));

// bf16 -> fp32 is a 16-bit shift, 16 at a time (explicit vectors: the compiler cannot prove
// the rows do not overlap and would leave a plain loop scalar).
template <>
inline void row_to_f32<at::BFloat16>(const at::BFloat16* src, float* dst, int d, float, bool) {
  for (int i = 0; i < d; i += 16) {
    v16u16 h;
    std::memcpy(&h, src + i, 32);
    const v16u bits = __builtin_convertvector(h, v16u) << 16;
    std::memcpy(dst + i, &bits, 64);
  }
}

template <>
inline void row_to_f32<at::Half>(const at::Half* src, float* dst, int d, float, bool) {
  for (int i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void row_to_f32<int8_t>(const int8_t* src, float* dst, int d, float scale, bool) {
  for (int i = 0; i < d; i += 16) {
    v16i8 c;
    std::memcpy(&c, src + i, 16);
    store16(dst + i, __builtin_convertvector(c, v16f) * scale);
  }
}

// float8_e4m3fn: s eeee mmm, bias 7, no infinities; subnormals (e = 0) are m * 2^-9. Integer
// and select ops on 16 lanes (c10's scalar conversion gives the same values).
template <>
inline void row_to_f32<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* src, float* dst, int d, float scale, bool) {
  for (int i = 0; i < d; i += 16) {
    v16u8 c;
    std::memcpy(&c, src + i, 16);
    const v16u x = __builtin_convertvector(c, v16u);
    const v16u e = (x >> 3) & 15u, m = x & 7u, sign = (x & 0x80u) << 24;
    const v16u bits = sign | ((e + 120u) << 23) | (m << 20);
    v16f normal;
    std::memcpy(&normal, &bits, 64);
    v16f sub = __builtin_convertvector(m, v16f) * 0x1p-9f;
    sub = sign != 0u ? -sub : sub;
    const v16f v = e != 0u ? normal : sub;
    store16(dst + i, v * scale);
  }
}

// dst[i][k] = src[k][i] for a 16 x 16 block (src rows `ld` floats apart, dst rows 16).
inline void transpose16(const float* src, int64_t ld, float* dst) {
#if defined(__AVX512F__)
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld);
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
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + 16 * i, r[i]);
#else
  for (int i = 0; i < 16; ++i)
    for (int k = 0; k < 16; ++k) dst[i * 16 + k] = src[k * ld + i];
#endif
}

// ---- one tile's arithmetic for NR query rows (NR = 1 or 2: rows of one token, so they share a
// valid key range). A row's operations do not depend on NR: pairing only shares the loads.

// Scores of 16 keys: chain l (l = 0..7) accumulates q[d] * k[d] over d = l, l + 8, ... in
// order (the first a product, then FMAs); the chains are summed as ((0+4)+(2+6))+((1+5)+(3+7)).
template <int D, int NR>
inline void score_rows(const float* const* q, const float* kT, v16f* out) {
  v16f a[NR][8];
#pragma GCC unroll 8
  for (int l = 0; l < 8; ++l) {
    const v16f k = load16(kT + l * 16);
    for (int r = 0; r < NR; ++r) a[r][l] = splat(q[r][l]) * k;
  }
#pragma GCC unroll 4
  for (int i = 8; i < D; i += 8) {
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) {
      const v16f k = load16(kT + (i + l) * 16);
      for (int r = 0; r < NR; ++r) a[r][l] = fma16(splat(q[r][i + l]), k, a[r][l]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const v16f b0 = a[r][0] + a[r][4], b1 = a[r][1] + a[r][5], b2 = a[r][2] + a[r][6], b3 = a[r][3] + a[r][7];
    out[r] = (b0 + b2) + (b1 + b3);
  }
}

// acc = acc * corr (skipped when corr is exactly 1: the same bits), then acc += p[j] * v[j] for
// the row's valid keys j in order, 16 output lanes at a time.
template <int D, int NR>
inline void pv_rows(float* const* acc, const float* const* p, const float* corr, const float* vb, int j0, int j1) {
  constexpr int kGroup = D >= 64 ? 4 : D / 16;  // output vectors kept in registers per pass
  for (int c = 0; c < D; c += 16 * kGroup) {
    v16f a[NR][kGroup];
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < kGroup; ++u) {
        a[r][u] = load16(acc[r] + c + 16 * u);
        if (corr[r] != 1.f) a[r][u] = a[r][u] * corr[r];
      }
    for (int j = j0; j < j1; ++j) {
      const float* vrow = vb + j * D + c;
      for (int u = 0; u < kGroup; ++u) {
        const v16f v = load16(vrow + 16 * u);
        for (int r = 0; r < NR; ++r) a[r][u] = fma16(splat(p[r][j]), v, a[r][u]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < kGroup; ++u) store16(acc[r] + c + 16 * u, a[r][u]);
  }
}

// Online-softmax step of one row over its valid lanes [j0, j1) of a tile: new running max,
// the rescale factor of what was accumulated, the tile's probabilities into p.
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

struct Workspace {
  std::vector<float> q, acc, mx, den, krow, kT, vb, p;
};

struct Problem {
  const void* k;
  const void* v;
  const float* k_scales;  // [slots, hkv] or null
  const float* v_scales;
  const int32_t* tables;
  int64_t max_blocks, block_size, hkv, window;  // window 0 = none
  int g;
};

// One work item: tq tokens of the sequence whose block table is `table` (rows t * H + head of
// ws.q, already fp32 and scaled), all KV heads: a tile's K/V rows are read once, contiguously
// (slot-major), and each KV head's part serves its g query heads. Leaves acc and den in ws.
template <typename C, int D>
void attend_item(const Problem& pb, const int32_t* table, const int32_t* ctx, int tq, Workspace& ws) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  const int g = pb.g;
  const int64_t hkv = pb.hkv, heads = hkv * g, rows = tq * heads;
  ws.acc.assign(static_cast<size_t>(rows) * D, 0.f);
  ws.mx.assign(rows, -std::numeric_limits<float>::infinity());
  ws.den.assign(rows, 0.f);
  ws.krow.resize(static_cast<size_t>(kLanes) * D);
  ws.kT.resize(static_cast<size_t>(D) * kLanes);
  ws.vb.resize(static_cast<size_t>(kLanes) * D);
  ws.p.resize(2 * kLanes);
  const C* kc = static_cast<const C*>(pb.k);
  const C* vc = static_cast<const C*>(pb.v);
  const bool scaled = pb.k_scales != nullptr;
  const int64_t row_stride = hkv * D, bs = pb.block_size;
  // Each token's keys are [lo, hi): its context, cut to its window.
  int64_t lo_all = std::numeric_limits<int64_t>::max(), hi_all = 0;
  int64_t lo[kTileQ], hi[kTileQ];
  for (int t = 0; t < tq; ++t) {
    hi[t] = ctx[t];
    lo[t] = pb.window > 0 ? std::max<int64_t>(0, hi[t] - pb.window) : 0;
    lo_all = std::min(lo_all, lo[t]);
    hi_all = std::max(hi_all, hi[t]);
  }
  float* krow = ws.krow.data();
  float* kT = ws.kT.data();
  float* vb = ws.vb.data();
  int64_t slots[kLanes];
  auto slot_of = [&](int64_t pos) { return static_cast<int64_t>(table[pos / bs]) * bs + pos % bs; };
  for (int64_t start = lo_all / kLanes * kLanes; start < hi_all; start += kLanes) {
    // The positions some token of the item reads (never one behind every window): -1 = none.
    for (int j = 0; j < kLanes; ++j) {
      const int64_t pos = start + j;
      slots[j] = pos < lo_all || pos >= hi_all ? -1 : slot_of(pos);
    }
    for (int64_t kvh = 0; kvh < hkv; ++kvh) {
      for (int j = 0; j < kLanes; ++j) {
        if (slots[j] < 0) {
          std::memset(krow + j * D, 0, sizeof(float) * D);
          std::memset(vb + j * D, 0, sizeof(float) * D);
          continue;
        }
        const int64_t at = slots[j] * row_stride + kvh * D;
        const float ks = scaled ? pb.k_scales[slots[j] * hkv + kvh] : 1.f;
        const float vs = scaled ? pb.v_scales[slots[j] * hkv + kvh] : 1.f;
        row_to_f32<C>(kc + at, krow + j * D, D, ks, scaled);
        row_to_f32<C>(vc + at, vb + j * D, D, vs, scaled);
      }
      for (int c = 0; c < D; c += 16) transpose16(krow + c, D, kT + c * kLanes);
      for (int t = 0; t < tq; ++t) {
        const int j0 = static_cast<int>(std::max<int64_t>(lo[t] - start, 0));
        const int j1 = static_cast<int>(std::min<int64_t>(hi[t] - start, kLanes));
        if (j0 >= j1) continue;
        for (int h = 0; h < g;) {
          const int64_t r = t * heads + kvh * g + h;
          v16f sc[2];
          float corr[2];
          float* pr[2] = {ws.p.data(), ws.p.data() + kLanes};
          if (h + 1 < g) {
            const float* qr[2] = {ws.q.data() + r * D, ws.q.data() + (r + 1) * D};
            float* ar[2] = {ws.acc.data() + r * D, ws.acc.data() + (r + 1) * D};
            score_rows<D, 2>(qr, kT, sc);
            for (int u = 0; u < 2; ++u) corr[u] = softmax_step(sc[u], j0, j1, ws.mx[r + u], ws.den[r + u], pr[u]);
            const float* pc[2] = {pr[0], pr[1]};
            pv_rows<D, 2>(ar, pc, corr, vb, j0, j1);
            h += 2;
          } else {
            const float* qr[1] = {ws.q.data() + r * D};
            float* ar[1] = {ws.acc.data() + r * D};
            score_rows<D, 1>(qr, kT, sc);
            corr[0] = softmax_step(sc[0], j0, j1, ws.mx[r], ws.den[r], pr[0]);
            const float* pc[1] = {pr[0]};
            pv_rows<D, 1>(ar, pc, corr, vb, j0, j1);
            h += 1;
          }
        }
      }
    }
  }
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

template <typename T>
void run(const at::Tensor& q, const Problem& pb, AttendFn attend, const int32_t* seq_idx, const int32_t* ctx,
         double scale, at::Tensor& out) {
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2);
  const int g = pb.g;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // Work items: runs of up to kTileQ consecutive tokens of one sequence (a prefill span's rows)
  // times KV heads, costliest first, pulled from a shared counter by the threads.
  struct Item {
    int64_t first, cost;
    int tq;
  };
  std::vector<Item> items;
  for (int64_t i = 0; i < t;) {
    int64_t j = i + 1;
    while (j < t && j - i < kTileQ && seq_idx[j] == seq_idx[i]) ++j;
    int64_t lo = ctx[i], hi = ctx[i];
    for (int64_t x = i; x < j; ++x) {
      lo = std::min<int64_t>(lo, pb.window > 0 ? std::max<int64_t>(0, ctx[x] - pb.window) : 0);
      hi = std::max<int64_t>(hi, ctx[x]);
    }
    items.push_back({i, ((hi - lo) / kLanes + 1) * ((j - i) * g + 8), static_cast<int>(j - i)});
    i = j;
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const float fscale = static_cast<float>(scale);
  auto work = [&](const Item& it, Workspace& ws) {
    const int64_t rows = it.tq * h;
    ws.q.resize(static_cast<size_t>(rows) * d);
    for (int64_t r = 0; r < rows; ++r) {  // row t * H + head is q[first + t, head]
      const T* src = qp + (it.first * h + r) * d;
      float* dst = ws.q.data() + r * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]) * fscale;
    }
    attend(pb, pb.tables + static_cast<int64_t>(seq_idx[it.first]) * pb.max_blocks, ctx + it.first, it.tq, ws);
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = ws.den[r] > 0.f ? 1.f / ws.den[r] : 0.f;
      T* dst = op + (it.first * h + r) * d;
      const float* a = ws.acc.data() + r * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(a[i] * inv);
    }
  };
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) {
    thread_local Workspace ws;
    for (const Item& it : items) work(it, ws);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    thread_local Workspace ws;
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) work(items[i], ws);
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_idx, const at::Tensor& ctx_len,
                           int64_t block_size, double scale, int64_t window, const std::optional<at::Tensor>& k_scales,
                           const std::optional<at::Tensor>& v_scales) {
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
  auto qc = q.contiguous();
  auto tables = block_tables.to(at::kInt).contiguous();
  auto seqs = seq_idx.to(at::kInt).contiguous();
  auto ctx = ctx_len.to(at::kInt).contiguous();
  auto out = at::empty({q.size(0), h * d}, q.options());
  if (q.size(0) == 0) return out;
  Problem pb{k_cache.data_ptr(), v_cache.data_ptr(), quantized ? ks.data_ptr<float>() : nullptr,
             quantized ? vs.data_ptr<float>() : nullptr, tables.data_ptr<int32_t>(), tables.size(1), block_size,
             hkv, window, static_cast<int>(h / hkv)};
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
        "Tensor? v_scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tessera_inv, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
