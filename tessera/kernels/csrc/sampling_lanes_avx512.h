// sampling_rows.h's 16-lane operations on AVX-512 (included inside sampling.cpp's AVX-512
// target region and a namespace of its own; sampling_lanes_avx2.h is the AVX2 twin, the same IEEE
// operation per lane and the same reduction trees, so both give the same bits).
struct VF { __m512 v; };
struct VI { __m512i v; };
using VM = __mmask16;
struct VD { __m512d lo, hi; };  // float64 sums of lanes 0-7 and 8-15

// 16 lanes at a time, a mask for the tail.
inline VM tail_mask(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<VM>((1u << left) - 1); }
inline VF vset1(float x) { return {_mm512_set1_ps(x)}; }
inline VF vzero() { return {_mm512_setzero_ps()}; }
inline VF vload(VM m, const float* p) { return {_mm512_maskz_loadu_ps(m, p)}; }  // 0 outside m
inline void vstore(float* p, VM m, VF x) { _mm512_mask_storeu_ps(p, m, x.v); }
inline void vstore16(float* p, VF x) { _mm512_storeu_ps(p, x.v); }
inline VF vadd(VF a, VF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VF vsub(VF a, VF b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline VF vmul(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VF vdiv(VF a, VF b) { return {_mm512_div_ps(a.v, b.v)}; }
inline VF vmask_max(VF acc, VM m, VF x) { return {_mm512_mask_max_ps(acc.v, m, acc.v, x.v)}; }
inline VF vmask_add(VF acc, VM m, VF x) { return {_mm512_mask_add_ps(acc.v, m, acc.v, x.v)}; }
inline VF vkeep(VM m, VF x) { return {_mm512_maskz_mov_ps(m, x.v)}; }  // 0 outside m
inline VM vlt(VF a, VF b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ); }
inline VM vle(VF a, VF b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LE_OQ); }
inline VM vgt(VF a, VF b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ); }
inline float vreduce_max(VF a) { return _mm512_reduce_max_ps(a.v); }
inline float vreduce_add(VF a) { return _mm512_reduce_add_ps(a.v); }
inline VD vd_zero() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
inline void vd_add(VD& s, VF w) {  // each lane widened to float64 and added to its own sum
  s.lo = _mm512_add_pd(s.lo, _mm512_cvtps_pd(_mm512_castps512_ps256(w.v)));
  s.hi = _mm512_add_pd(s.hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w.v), 1))));
}
inline double vd_sum(const VD& s) { return _mm512_reduce_add_pd(_mm512_add_pd(s.lo, s.hi)); }

// e^x for x <= 0, 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor
// polynomial (relative error under 2e-7, a few float32 ulps: the sampled distribution moves by
// less than that), scaled by 2^n with vscalefps, which gives exactly 0 below float32's range.
// -inf (a masked token) is clamped first, so it too gives exactly 0.
inline VF vexp_nonpositive(VF v) {
  const __m512 x = _mm512_max_ps(v.v, _mm512_set1_ps(kExpClamp));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);  // ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  return {_mm512_scalef_ps(p, n)};
}

// A distance below the maximum (nats) as its nucleus bucket, min(d x per_nat, last) truncated;
// min returns its second operand for a NaN: such a token lands in the last bucket.
inline VI vbucket(VF d, float per_nat, float last) {
  return {_mm512_cvttps_epi32(_mm512_min_ps(_mm512_mul_ps(d.v, _mm512_set1_ps(per_nat)), _mm512_set1_ps(last)))};
}
inline VM vieq(VI a, int32_t b) { return _mm512_cmpeq_epi32_mask(a.v, _mm512_set1_epi32(b)); }
inline VM vile(VI a, int32_t b) { return _mm512_cmp_epi32_mask(a.v, _mm512_set1_epi32(b), _MM_CMPINT_LE); }
inline void vstore_i16(int32_t* p, VI a) { _mm512_storeu_si512(p, a.v); }

// seeded_uniforms' uint32 hash and its uniforms.
inline VI vi_set1(int32_t x) { return {_mm512_set1_epi32(x)}; }
inline VI vi_iota(int32_t base) {
  return {_mm512_add_epi32(_mm512_set1_epi32(base), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))};
}
inline VI vi_xor(VI a, VI b) { return {_mm512_xor_si512(a.v, b.v)}; }
inline VI vi_srl(VI a, int s) { return {_mm512_srli_epi32(a.v, s)}; }
inline VI vi_mul(VI a, int32_t b) { return {_mm512_mullo_epi32(a.v, _mm512_set1_epi32(b))}; }
inline VF vi_to_float(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
// 16 token ids (int64, each < 2^31) as 16 int32 lanes (0 outside m).
inline VI vi_ids(const int64_t* p, VM m) {
  const __m256i lo = _mm512_cvtepi64_epi32(_mm512_maskz_loadu_epi64(static_cast<__mmask8>(m), p));
  const __m256i hi = _mm512_cvtepi64_epi32(_mm512_maskz_loadu_epi64(static_cast<__mmask8>(m >> 8), p + 8));
  return {_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)};
}
