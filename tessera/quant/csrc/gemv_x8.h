// GGUF blocks on int8-quantized activations (tessera_gemv::{q4x8, q8x8}; Q4_0 / Q4_1 / Q4_K on the
// first, Q8_0 / Q5_0 / Q6_K on the second: gguf_int8_activations.py): included inside the anonymous
// namespace of both builds of the tessera_gemv library, gemv.cpp (AVX-512 CPUs: Zen 4, Intel) and
// gemv_avx2.cpp (AVX2 + FMA without AVX-512: Zen 3), after their kMaxRows and dispatch_rows. The
// code is 8-lane (256-bit) int8 products: AVX2's VPMADDUBSW, or VPDPBUSD where the build has AVX-512
// VNNI (below). On Zen 4 it reads the default model's Q4_1 layers at the memory's rate (1.2-2.0 ms a
// token for the 120 layer linears against 4.7 for the grouped INT4 AVX-512 kernel: session 40), so
// both builds carry it.
#pragma once

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// ---- GGUF Q4_0 / Q4_1 blocks on int8 activations: the arithmetic llama.cpp and vLLM's GGUF kernels
// use. Each row of x is quantized per 32 (Q8_1): d_x = amax / 127, q_x = round(x / d_x) (ties to
// even), s_x = d_x sum q_x. A weight block is W = d q + m (Q4_0: m = -8 d) with codes q in 0..15, so
// W.x over the block is d d_x sum q q_x + m s_x: the integer sum in VPMADDUBSW (unsigned codes
// times signed activations, pairs into int16) and VPMADDWD, then an FMA per block.
//
// Layout (gguf_int8_activations.pack_q4x8 writes it): weight rows in groups of 8, and per group and block
// 128 bytes, four 32-byte vectors j: byte 4 i + t of vector j holds the code of row i at k = 8 j + t
// in its low nibble and at k = 8 j + 4 + t in its high one. So int32 lane i of a VPMADDWD sum is
// row i's dot product, against x's bytes [8 j, 8 j + 4) and [8 j + 4, 8 j + 8) broadcast to every
// lane; d and m are float16 [N / 8, K / 32, 8] (a group's 8 rows together). The 8 rows' results
// come out as one vector: no horizontal sums, and the scales of 8 rows are one load.
//
// Why: the float32 GEMV on dequantized codes needs 4 conversions and 4 FMAs per 32 weights and
// activation row; this needs 2 VPMADDUBSW and 2 adds per 32 weights, and a VPMADDWD, a conversion
// and two FMAs per block of 8 rows.
// Where the build has AVX-512 VNNI with 256-bit forms (Zen 4; -march=native), the int8 products
// are VPDPBUSD: four byte products summed into each int32 lane in one instruction, where AVX2 takes
// VPMADDUBSW, VPMADDWD and an add. The integer sums are the same, so are the results, bit for bit.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TESSERA_X8_VNNI 1
#else
#define TESSERA_X8_VNNI 0
#endif

struct QuantizedX {
  std::vector<int8_t> q;    // [M, K]
  std::vector<float> d, s;  // [M, K / 32]
  std::vector<uint8_t> u;   // [M, K]: q + 128 (VPDPBUSD's unsigned operand for signed weights; VNNI only)
};

inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_f32(const at::BFloat16* p) {  // bf16 -> float32 is exact: a 16-bit shift
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 floats rounded to bf16, nearest even as c10::BFloat16(float) does (a NaN as its 0x7FC0): the
// 16-bit results in the low halves of the 32-bit lanes.
inline __m256i round8_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(_mm256_set1_epi32(0x7FC0), r, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q)));
}

inline void store8_bf16(at::BFloat16* p, __m256 v) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round8_bf16(v), round8_bf16(v)), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// x quantized per 32 into the calling thread's buffers (reused from call to call: a step's ~120
// calls would otherwise each allocate and free them). T is float or at::BFloat16: a bf16 row is
// quantized from its exact float32 values, so it gives the codes its float32 copy would.
// with_unsigned: also fill u (q8x8's VPDPBUSD operand; q4x8 takes q itself).
template <typename T>
const QuantizedX& quantize_rows_q8_1(const T* x, int64_t m, int64_t k, bool with_unsigned) {
  const int64_t nb = k / 32;
  thread_local QuantizedX out;
  out.q.resize(m * k);
  out.d.resize(m * nb);
  out.s.resize(m * nb);
#if TESSERA_X8_VNNI
  out.u.resize(with_unsigned ? m * k : 0);
  uint8_t* u = with_unsigned ? out.u.data() : nullptr;
#else
  out.u.clear();
  uint8_t* u = nullptr;
  (void)with_unsigned;
#endif
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  // Blocks are independent: a prefill chunk's rows are quantized on every thread (on one, the
  // others waited: 3% of a gguf prefill's samples, Zen 4); a decode step's few stay on this one.
  // Pointers, not `out`: a thread_local named in the lambda would be each thread's own.
  int8_t* const qo = out.q.data();
  float *const d_out = out.d.data(), *const s_out = out.s.data();
  at::parallel_for(0, m * nb, 2048, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T* v = x + i * 32;
      __m256 f[4];
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        f[j] = load8_f32(v + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_and_ps(f[j], abs_mask));
      }
      __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      a = _mm_max_ps(a, _mm_movehl_ps(a, a));
      a = _mm_max_ss(a, _mm_shuffle_ps(a, a, 1));
      const float top = _mm_cvtss_f32(a), d = top / 127.f, id = top != 0.f ? 127.f / top : 0.f;
      __m256i qi[4];
      for (int j = 0; j < 4; ++j)
        qi[j] = _mm256_cvtps_epi32(
            _mm256_round_ps(_mm256_mul_ps(f[j], _mm256_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
      // int32 -> int8 in order: the packs interleave 128-bit lanes, the permute undoes it.
      const __m256i q16 = _mm256_packs_epi32(qi[0], qi[1]), q16b = _mm256_packs_epi32(qi[2], qi[3]);
      const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16, q16b), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qo + i * 32), q8);
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
      d_out[i] = d;
      s_out[i] = d * float(_mm_cvtsi128_si32(t));
      if (u)  // q + 128: the codes with their top bit flipped
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + i * 32),
                            _mm256_xor_si256(q8, _mm256_set1_epi8(static_cast<char>(0x80))));
    }
  });
  return out;
}

// A block's 8 scales (one per row of a group), from float16 (the file's own d, m) or float32 (the
// K-quants' products d * sc, exact in float32 but not in float16).
inline __m256 load_scales(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load_scales(const float* p) { return _mm256_loadu_ps(p); }

inline __m256i bcast4(const int8_t* p) {  // 4 bytes into every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Group g (8 weight rows) against M quantized activation rows, row i's 8 results stored at
// y + i * stride. The int16 sums of a block's 8 VPMADDUBSW products stay below 8 * 2 * 15 * 127 =
// 30480: no saturation.
template <int M, typename S>
void q4x8_group(const int8_t* xq, const float* xd, const float* xs, const uint8_t* w, const S* d, const S* mn,
                float* y, int64_t stride, int64_t k, int64_t g) {
  const int64_t nb = k / 32;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* wg = w + g * nb * 128;
  const S *dg = d + g * nb * 8, *mg = mn + g * nb * 8;
  __m256 acc[M], off[M];
  for (int i = 0; i < M; ++i) acc[i] = off[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i lo[4], hi[4];
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + b * 128 + 32 * j));
      lo[j] = _mm256_and_si256(v, low);
      hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    const __m256 dw = load_scales(dg + b * 8), mw = load_scales(mg + b * 8);
    for (int i = 0; i < M; ++i) {
      const int8_t* xb = xq + i * k + b * 32;
#if TESSERA_X8_VNNI
      // Two accumulators: VPDPBUSD's latency would otherwise chain the block's eight products.
      __m256i p = _mm256_setzero_si256(), p2 = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        p = _mm256_dpbusd_epi32(p, lo[j], bcast4(xb + 8 * j));
        p2 = _mm256_dpbusd_epi32(p2, hi[j], bcast4(xb + 8 * j + 4));
      }
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(p, p2));
#else
      __m256i p = _mm256_maddubs_epi16(lo[0], bcast4(xb));
      p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi[0], bcast4(xb + 4)));
      for (int j = 1; j < 4; ++j) {
        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(lo[j], bcast4(xb + 8 * j)));
        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi[j], bcast4(xb + 8 * j + 4)));
      }
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
#endif
      acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(xd[i * nb + b])), acc[i]);
      off[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[i * nb + b]), off[i]);
    }
  }
  for (int i = 0; i < M; ++i) _mm256_storeu_ps(y + i * stride, _mm256_add_ps(acc[i], off[i]));
}

#if TESSERA_X8_VNNI && defined(__AVX512F__) && defined(__AVX512BW__)
#define TESSERA_X8_PAIRS 1
template <typename S>  // two groups' 8 scales (float16 or float32), group g's in lanes 0-7
inline __m512 load_scales16(const S* p0, const S* p1) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(load_scales(p0)), load_scales(p1), 1);
}

// Groups g and g + 1 together (16 weight rows, group g's 8 in lanes 0-7): q4x8_group's arithmetic
// for each of the 16 output columns (the same integer sums, conversion, products and FMAs in the
// same block order: the same bits), on 512-bit vectors, so each activation row's broadcasts,
// scale products and FMAs serve twice the columns. Row i's 16 results are stored at y + i * stride.
// Only for calls of more than kPairMinRows rows (prefill chunks), where the kernel is bound by its
// instructions: 13-17% more GOP/s at 256 rows. A decode step's call streams the weights from
// memory, and reading two groups' blocks in turn (two streams a thread) made it slower there: Zen 4
// (model 17), the gguf engine's step, alternating in one process, 4.3-4.8 -> 5.3-5.9 ms at 1
// sequence, 6.9-7.3 -> 7.6-8.1 at 4, 11.7-12.1 -> 12.1-12.5 at 8, no change at 32.
constexpr int64_t kPairMinRows = 32;
template <int M, typename S>
void q4x8_pair(const int8_t* xq, const float* xd, const float* xs, const uint8_t* w, const S* d, const S* mn,
               float* y, int64_t stride, int64_t k, int64_t g) {
  const int64_t nb = k / 32;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* wg = w + g * nb * 128;
  const uint8_t* wh = wg + nb * 128;
  const S *dg = d + g * nb * 8, *mg = mn + g * nb * 8;
  __m512 acc[M], off[M];
  for (int i = 0; i < M; ++i) acc[i] = off[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i lo[4], hi[4];
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + b * 128 + 32 * j))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wh + b * 128 + 32 * j)), 1);
      lo[j] = _mm512_and_si512(v, low);
      hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 dw = load_scales16(dg + b * 8, dg + (nb + b) * 8), mw = load_scales16(mg + b * 8, mg + (nb + b) * 8);
    for (int i = 0; i < M; ++i) {
      const int8_t* xb = xq + i * k + b * 32;
      // Two accumulators, as in q4x8_group: one chain of eight was slower (VPDPBUSD's latency).
      __m512i p = _mm512_setzero_si512(), p2 = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        int32_t u0, u1;
        std::memcpy(&u0, xb + 8 * j, 4);
        std::memcpy(&u1, xb + 8 * j + 4, 4);
        p = _mm512_dpbusd_epi32(p, lo[j], _mm512_set1_epi32(u0));
        p2 = _mm512_dpbusd_epi32(p2, hi[j], _mm512_set1_epi32(u1));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(p, p2));
      acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(xd[i * nb + b])), acc[i]);
      off[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[i * nb + b]), off[i]);
    }
  }
  for (int i = 0; i < M; ++i) _mm512_storeu_ps(y + i * stride, _mm512_add_ps(acc[i], off[i]));
}
#else
#define TESSERA_X8_PAIRS 0
#endif

// Group g of a Q8_0 weight in the q8x8 layout (gguf_int8_activations.pack_q8x8) against M quantized
// activation rows: per group and block 256 bytes, eight 32-byte vectors j, byte 4 i + t of vector j
// row i's code at k = 4 j + t. VPMADDUBSW takes its unsigned operand first, so |w| meets x with w's
// sign (VPSIGNB), as llama.cpp does: pair sums of at most 2 * 128 * 127, no saturation, each
// vector's summed into int32. Scales (float16 or float32) per SUB weights: SUB = 32, d [N / 8, K / 32,
// 8] (Q8_0, Q5_0's codes less 16); SUB = 16, d [N / 8, K / 16, 8] (Q6_K's d * scale): vectors 0-3
// hold a block's first 16 weights, 4-7 the next, summed apart and scaled each by its own d.
template <int M, typename S, int SUB>
void q8x8_group(const int8_t* xq, const uint8_t* xu, const float* xd, const uint8_t* w, const S* d, float* y,
                int64_t stride, int64_t k, int64_t g) {
  static_assert(SUB == 32 || SUB == 16);
  constexpr int kParts = 32 / SUB, kVectors = 8 / kParts;
  const int64_t nb = k / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* wg = w + g * nb * 256;
  const S* dg = d + g * nb * kParts * 8;
  __m256 acc[M];
  for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int part = 0; part < kParts; ++part) {
      __m256i isum[M];
      for (int i = 0; i < M; ++i) isum[i] = _mm256_setzero_si256();
#if TESSERA_X8_VNNI
      // (q_x + 128) . w - 128 . w: the second sum is the weights' alone, one VPDPBUSD for all rows. Even
      // and odd vectors in two accumulators: VPDPBUSD's latency would chain a row's products.
      __m256i bias0 = _mm256_setzero_si256(), bias1 = _mm256_setzero_si256(), odd[M];
      for (int i = 0; i < M; ++i) odd[i] = _mm256_setzero_si256();
      const __m256i k128 = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int j = part * kVectors; j < (part + 1) * kVectors; j += 2) {
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + b * 256 + 32 * j));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + b * 256 + 32 * j + 32));
        bias0 = _mm256_dpbusd_epi32(bias0, k128, v0);
        bias1 = _mm256_dpbusd_epi32(bias1, k128, v1);
        for (int i = 0; i < M; ++i) {
          int32_t u0, u1;
          std::memcpy(&u0, xu + i * k + b * 32 + 4 * j, 4);
          std::memcpy(&u1, xu + i * k + b * 32 + 4 * j + 4, 4);
          isum[i] = _mm256_dpbusd_epi32(isum[i], _mm256_set1_epi32(u0), v0);
          odd[i] = _mm256_dpbusd_epi32(odd[i], _mm256_set1_epi32(u1), v1);
        }
      }
      const __m256i both = _mm256_add_epi32(bias0, bias1);
      for (int i = 0; i < M; ++i) isum[i] = _mm256_sub_epi32(_mm256_add_epi32(isum[i], odd[i]), both);
#else
      (void)xu;
      for (int j = part * kVectors; j < (part + 1) * kVectors; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + b * 256 + 32 * j));
        const __m256i a = _mm256_abs_epi8(v);
        for (int i = 0; i < M; ++i) {
          const __m256i sx = _mm256_sign_epi8(bcast4(xq + i * k + b * 32 + 4 * j), v);
          isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a, sx), ones));
        }
      }
#endif
      const __m256 dw = load_scales(dg + (b * kParts + part) * 8);
      for (int i = 0; i < M; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_mul_ps(dw, _mm256_set1_ps(xd[i * nb + b])), acc[i]);
    }
  }
  for (int i = 0; i < M; ++i) _mm256_storeu_ps(y + i * stride, acc[i]);
}

// An lm_head's call (x8_groups with `logits`): the bf16 output widened to float32 (forward(x).float()
// without the bf16 [M, N] between), stored unless `out` is null, and with `argmax` each row's first
// maximum of those values, found as each thread rounds its columns (greedy sampling need not read
// the logits again): the other kernels' ArgmaxCollector (argmax_rows.h), its chunks' lanes 0-7
// used. torch.argmax's index, except that a NaN never wins.
struct X8Logits {
  float* out = nullptr;                 // [M, N], or null: the ids alone
  ArgmaxCollector* argmax = nullptr;    // or null: the logits alone

  // Rows [m0, m0 + rows) x columns [c0, c1) of the float32 products, row i at y + i * stride; the
  // thread's chunk keeps each row's first maximum per lane (a strict >, so a lane keeps its first).
  void take(ArgmaxChunk* chunk, const float* y, int64_t stride, int64_t m0, int64_t rows, int64_t n, int64_t c0,
            int64_t c1) const {
    for (int64_t i = 0; i < rows; ++i) {
      float* best_at = chunk ? chunk->value.data() + 16 * (m0 + i) : nullptr;
      int32_t* index_at = chunk ? chunk->index.data() + 16 * (m0 + i) : nullptr;
      __m256 best = chunk ? _mm256_loadu_ps(best_at) : _mm256_setzero_ps();
      __m256i at = chunk ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(index_at)) : _mm256_setzero_si256();
      for (int64_t c = c0; c < c1; c += 8) {
        const __m256 w = _mm256_castsi256_ps(_mm256_slli_epi32(round8_bf16(_mm256_loadu_ps(y + i * stride + c - c0)), 16));
        if (out) _mm256_storeu_ps(out + (m0 + i) * n + c, w);
        if (!chunk) continue;
        const __m256 gt = _mm256_cmp_ps(w, best, _CMP_GT_OQ);  // NaN: never greater
        best = _mm256_blendv_ps(best, w, gt);
        const __m256i cols = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(c)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        at = _mm256_blendv_epi8(at, cols, _mm256_castps_si256(gt));
      }
      if (!chunk) continue;
      chunk->seen[m0 + i] = 1;
      _mm256_storeu_ps(best_at, best);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(index_at), at);
    }
  }
};

// x [M, K] against `groups` groups of 8 weight rows -> y [M, 8 groups] in x's dtype (float32 or
// bf16), any M: x is quantized once, then each thread walks its groups in tiles of about 16 KiB of
// codes (which stay in L1) and runs every chunk of up to kMaxRows activation rows over a tile:
// group(M, x codes, x codes + 128 (only with_unsigned: q8x8 on VPDPBUSD), d_x, s_x, y, stride, g,
// left) stores group g's results for row i at y + i * stride, and may take the next group too
// (left: groups left in the tile, g's included; q4x8_pair), returning how many it took. A row of
// the output depends only on its row of x (its own quantization, the same block order), so the
// result does not depend on the batch. A
// bf16 y is the float32 result rounded to nearest even (what .to(bfloat16) gives), tile by tile: a
// bf16 step's linear is one op, not three (a conversion each way cost more than a small call's
// kernel, its code cold after the weights streamed through the caches). With `logits` (bf16 x)
// the rounded values go to it instead (X8Logits) and the returned y is empty.
template <typename Group>
at::Tensor x8_groups(const at::Tensor& x, int64_t groups, int64_t k, int64_t group_bytes, bool with_unsigned,
                     Group&& group, X8Logits* logits = nullptr) {
  const int64_t m = x.size(0), n = 8 * groups, nb = k / 32;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const QuantizedX& xq = bf16 ? quantize_rows_q8_1(x.data_ptr<at::BFloat16>(), m, k, with_unsigned)
                              : quantize_rows_q8_1(x.data_ptr<float>(), m, k, with_unsigned);
  auto y = at::empty({logits ? 0 : m, n}, x.options());
  float* yf = bf16 ? nullptr : y.data_ptr<float>();
  at::BFloat16* yb = bf16 && !logits ? y.data_ptr<at::BFloat16>() : nullptr;
  const int8_t* q = xq.q.data();
  const uint8_t* u = xq.u.empty() ? nullptr : xq.u.data();
  const float *d = xq.d.data(), *s = xq.s.data();
  const int64_t tile = std::max<int64_t>(1, (16 << 10) / group_bytes);
  at::parallel_for(0, groups, 2, [&](int64_t g0, int64_t g1) {
    // A bf16 or logits call computes a tile's float32 products (a chunk of rows x the tile's
    // columns) into this thread's scratch, which stays in L1, and rounds them from there.
    thread_local std::vector<float> scratch;
    if (bf16) scratch.resize(kMaxRows * 8 * tile);
    std::unique_ptr<ArgmaxChunk> chunk(logits && logits->argmax ? logits->argmax->chunk() : nullptr);
    for (int64_t t0 = g0; t0 < g1; t0 += tile) {
      const int64_t t1 = std::min(t0 + tile, g1), width = 8 * (t1 - t0);
      for (int64_t m0 = 0; m0 < m; m0 += kMaxRows) {
        const int64_t rows = std::min(kMaxRows, m - m0), stride = bf16 ? width : n;
        float* base = bf16 ? scratch.data() : yf + m0 * n + 8 * t0;
        dispatch_rows<1>(rows, [&]<int M>() {
          for (int64_t g = t0; g < t1;)
            g += group.template operator()<M>(q + m0 * k, u ? u + m0 * k : nullptr, d + m0 * nb, s + m0 * nb,
                                              base + 8 * (g - t0), stride, g, t1 - g);
        });
        if (logits)
          logits->take(chunk.get(), base, stride, m0, rows, n, 8 * t0, 8 * t1);
        else if (bf16)
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t c = 0; c < width; c += 8)
              store8_bf16(yb + (m0 + i) * n + 8 * t0 + c, _mm256_loadu_ps(base + i * stride + c));
      }
    }
    if (chunk) logits->argmax->add(8 * g0, *chunk);
  });
  return y;
}

void check_x8(const char* op, const at::Tensor& x, int64_t k, const at::Tensor& qs, int64_t block_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.is_contiguous() && x.size(0) >= 1,
              "tessera_gemv.", op, ": x must be contiguous float32 or bfloat16 [M, ", k, "]");
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == block_bytes && qs.scalar_type() == at::kByte && qs.is_contiguous(),
              "tessera_gemv.", op, ": qs must be contiguous uint8 [N / 8, K / 32, ", block_bytes, "]");
}

template <typename S>
const S* scales_of(const at::Tensor& t) {
  if constexpr (std::is_same_v<S, float>) return t.data_ptr<float>();
  else return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
}

// Float16 (the file's d, m) or float32 scales (the K-quants' products): fn.template operator()<S>().
template <typename Fn>
at::Tensor with_scale_type(const at::Tensor& d, Fn&& fn) {
  if (d.scalar_type() == at::kFloat) return fn.template operator()<float>();
  return fn.template operator()<uint16_t>();
}

at::Tensor gemv_q4x8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mn,
                     X8Logits* logits = nullptr) {
  const int64_t groups = qs.size(0), nb = qs.size(1), k = 32 * nb;
  check_x8("q4x8", x, k, qs, 128);
  for (const at::Tensor* t : {&d, &mn})
    TORCH_CHECK((t->scalar_type() == at::kHalf || t->scalar_type() == at::kFloat) &&
                    t->scalar_type() == d.scalar_type() && t->is_contiguous() && t->numel() == 8 * groups * nb,
                "tessera_gemv.q4x8: d and m must be contiguous float16 or float32 (both the same) [N / 8, K / 32, 8]");
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  return with_scale_type(d, [&]<typename S>() {
    const S *dp = scales_of<S>(d), *mp = scales_of<S>(mn);
    return x8_groups(x, groups, k, nb * 128, false, [&]<int M>(const int8_t* xq, const uint8_t*, const float* xd, const float* xs,
                                                         float* y, int64_t stride, int64_t g, int64_t left) -> int64_t {
#if TESSERA_X8_PAIRS
      if (left >= 2 && x.size(0) > kPairMinRows) {
        q4x8_pair<M, S>(xq, xd, xs, qp, dp, mp, y, stride, k, g);
        return 2;
      }
#endif
      (void)left;
      q4x8_group<M, S>(xq, xd, xs, qp, dp, mp, y, stride, k, g);
      return 1;
    }, logits);
  });
}

// d [N / 8, K / 32, 8]: a scale per 32 weights; [N / 8, K / 16, 8]: per 16 (Q6_K).
at::Tensor gemv_q8x8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, X8Logits* logits = nullptr) {
  const int64_t groups = qs.size(0), nb = qs.size(1), k = 32 * nb;
  check_x8("q8x8", x, k, qs, 256);
  TORCH_CHECK((d.scalar_type() == at::kHalf || d.scalar_type() == at::kFloat) && d.is_contiguous() &&
                  (d.numel() == 8 * groups * nb || d.numel() == 16 * groups * nb),
              "tessera_gemv.q8x8: d must be contiguous float16 or float32 [N / 8, K / 32, 8] or [N / 8, K / 16, 8]");
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const bool per16 = d.numel() == 16 * groups * nb;
  return with_scale_type(d, [&]<typename S>() {
    const S* dp = scales_of<S>(d);
    return x8_groups(x, groups, k, nb * 256, true, [&]<int M>(const int8_t* xq, const uint8_t* xu, const float* xd, const float*,
                                                         float* y, int64_t stride, int64_t g, int64_t left) -> int64_t {
      (void)left;
      if (per16) q8x8_group<M, S, 16>(xq, xu, xd, qp, dp, y, stride, k, g);
      else q8x8_group<M, S, 32>(xq, xu, xd, qp, dp, y, stride, k, g);
      return 1;
    }, logits);
  });
}

// An lm_head's call on bf16 x (QuantLinear.logits_argmax): (its output widened to float32, or [M, 0]
// without `logits`; with `argmax` each row's first maximum of it, else [0]). call(X8Logits*) runs
// the kernel over its n output columns.
template <typename Call>
std::tuple<at::Tensor, at::Tensor> x8_logits(const at::Tensor& x, int64_t n, bool argmax, bool logits, Call&& call) {
  TORCH_CHECK(argmax || logits, "tessera_gemv: logits=False needs argmax=True");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "tessera_gemv: the logits ops take bf16 x [M, K]");
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, logits ? n : 0}, x.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({argmax ? m : 0}, x.options().dtype(at::kLong));
  ArgmaxCollector collector(m);
  X8Logits out{logits ? y.data_ptr<float>() : nullptr, argmax ? &collector : nullptr};
  call(&out);
  if (argmax && m > 0) collector.finish(ids.data_ptr<int64_t>());
  return {y, ids};
}

std::tuple<at::Tensor, at::Tensor> gemv_q4x8_logits(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                                                    const at::Tensor& mn, bool argmax, bool logits) {
  return x8_logits(x, 8 * qs.size(0), argmax, logits, [&](X8Logits* out) { gemv_q4x8(x, qs, d, mn, out); });
}

std::tuple<at::Tensor, at::Tensor> gemv_q8x8_logits(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                                                    bool argmax, bool logits) {
  return x8_logits(x, 8 * qs.size(0), argmax, logits, [&](X8Logits* out) { gemv_q8x8(x, qs, d, out); });
}

// ---- Rows of a weight (an embedding lookup into a tied table) ----------------------------------
// Rows `ids` of a q8x8 / q4x8 weight as float32 [R, K], each value as the layer's dequantize()
// makes it: q d, + m for q4x8. Every product q d is exact in float32 (at most 24 significant bits:
// an 11-bit float16 scale, Q4_K's d sc or Q6_K's d scale times the block's code), so q d + m
// rounds once, fused or not. One op for a decode step's lookup, where the torch form (gathers, unpacking,
// a multiply and an add) took ~0.1 ms.
template <typename S>
float scale_lane(const S* p, int64_t lane) {
  alignas(32) float v[8];
  _mm256_store_ps(v, load_scales(p));
  return v[lane];
}

const int64_t* checked_ids(const char* op, const at::Tensor& ids, int64_t rows) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "tessera_gemv.", op, ": ids must be contiguous int64 [R]");
  const int64_t* p = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < ids.numel(); ++r)
    TORCH_CHECK(p[r] >= 0 && p[r] < rows, "tessera_gemv.", op, ": row ", p[r], " is outside the ", rows, " rows of qs");
  return p;
}

at::Tensor rows_q8x8(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& ids) {
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == 256 && qs.scalar_type() == at::kByte && qs.is_contiguous(),
              "tessera_gemv.q8x8_rows: qs must be contiguous uint8 [N / 8, K / 32, 256]");
  const int64_t groups = qs.size(0), nb = qs.size(1), k = 32 * nb;
  TORCH_CHECK((d.scalar_type() == at::kHalf || d.scalar_type() == at::kFloat) && d.is_contiguous() &&
                  (d.numel() == 8 * groups * nb || d.numel() == 16 * groups * nb),
              "tessera_gemv.q8x8_rows: d must be contiguous float16 or float32 [N / 8, K / 32 or K / 16, 8]");
  const int64_t* id = checked_ids("q8x8_rows", ids, 8 * groups);
  const bool per16 = d.numel() == 16 * groups * nb;
  auto out = at::empty({ids.numel(), k}, qs.options().dtype(at::kFloat));
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  return with_scale_type(d, [&]<typename S>() {
    const S* dp = scales_of<S>(d);
    for (int64_t r = 0; r < ids.numel(); ++r) {
      const int64_t g = id[r] / 8, i = id[r] % 8;
      float* o = out.data_ptr<float>() + r * k;
      for (int64_t b = 0; b < nb; ++b) {
        // byte 4 i + t of vector j of block b: the row's code 4 j + t
        const int8_t* w = reinterpret_cast<const int8_t*>(qp + (g * nb + b) * 256) + 4 * i;
        const float d0 = scale_lane(dp + (per16 ? g * 2 * nb + 2 * b : g * nb + b) * 8, i);
        const float d1 = per16 ? scale_lane(dp + (g * 2 * nb + 2 * b + 1) * 8, i) : d0;
        for (int j = 0; j < 8; ++j)
          for (int t = 0; t < 4; ++t) o[32 * b + 4 * j + t] = static_cast<float>(w[32 * j + t]) * (j < 4 ? d0 : d1);
      }
    }
    return out;
  });
}

at::Tensor rows_q4x8(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mn, const at::Tensor& ids) {
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == 128 && qs.scalar_type() == at::kByte && qs.is_contiguous(),
              "tessera_gemv.q4x8_rows: qs must be contiguous uint8 [N / 8, K / 32, 128]");
  const int64_t groups = qs.size(0), nb = qs.size(1), k = 32 * nb;
  for (const at::Tensor* t : {&d, &mn})
    TORCH_CHECK((t->scalar_type() == at::kHalf || t->scalar_type() == at::kFloat) &&
                    t->scalar_type() == d.scalar_type() && t->is_contiguous() && t->numel() == 8 * groups * nb,
                "tessera_gemv.q4x8_rows: d and m must be contiguous float16 or float32 (both the same) [N / 8, K / 32, 8]");
  const int64_t* id = checked_ids("q4x8_rows", ids, 8 * groups);
  auto out = at::empty({ids.numel(), k}, qs.options().dtype(at::kFloat));
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  return with_scale_type(d, [&]<typename S>() {
    const S *dp = scales_of<S>(d), *mp = scales_of<S>(mn);
    for (int64_t r = 0; r < ids.numel(); ++r) {
      const int64_t g = id[r] / 8, i = id[r] % 8;
      float* o = out.data_ptr<float>() + r * k;
      for (int64_t b = 0; b < nb; ++b) {
        // byte 4 i + t of vector j of block b: the row's codes 8 j + t (low nibble), 8 j + 4 + t (high)
        const uint8_t* w = qp + (g * nb + b) * 128 + 4 * i;
        const float dv = scale_lane(dp + (g * nb + b) * 8, i), mv = scale_lane(mp + (g * nb + b) * 8, i);
        for (int j = 0; j < 4; ++j)
          for (int t = 0; t < 4; ++t) {
            const uint8_t c = w[32 * j + t];
            o[32 * b + 8 * j + t] = static_cast<float>(c & 15) * dv + mv;
            o[32 * b + 8 * j + 4 + t] = static_cast<float>(c >> 4) * dv + mv;
          }
      }
    }
    return out;
  });
}

// The ops above, as both builds register them (gemv.cpp, gemv_avx2.cpp): their schemas, then their
// CPU kernels.
void define_x8_ops(torch::Library& lib) {
  lib.def("q4x8(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor");
  lib.def("q8x8(Tensor x, Tensor qs, Tensor d) -> Tensor");
  lib.def("q4x8_logits(Tensor x, Tensor qs, Tensor d, Tensor m, bool argmax, bool logits=True) -> (Tensor, Tensor)");
  lib.def("q8x8_logits(Tensor x, Tensor qs, Tensor d, bool argmax, bool logits=True) -> (Tensor, Tensor)");
  lib.def("q4x8_rows(Tensor qs, Tensor d, Tensor m, Tensor ids) -> Tensor");
  lib.def("q8x8_rows(Tensor qs, Tensor d, Tensor ids) -> Tensor");
}

void impl_x8_ops(torch::Library& lib) {
  lib.impl("q4x8", [](const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
    return gemv_q4x8(x, qs, d, m);
  });
  lib.impl("q8x8", [](const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) { return gemv_q8x8(x, qs, d); });
  lib.impl("q4x8_logits", &gemv_q4x8_logits);
  lib.impl("q8x8_logits", &gemv_q8x8_logits);
  lib.impl("q4x8_rows", &rows_q4x8);
  lib.impl("q8x8_rows", &rows_q8x8);
}

#pragma GCC pop_options
