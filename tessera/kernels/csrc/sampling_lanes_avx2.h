// sampling_lanes_avx512.h's 16-lane operations on AVX2 + FMA (Zen 3): a lane vector is two 8-lane
// halves, a mask 16 bits as there (bit l = lane l). Every lane gets the same IEEE operation as
// the AVX-512 instruction gives it, and the sums the same trees as GCC's _mm512_reduce_add_ps /
// _pd, so both files give the same bits.
struct VF { __m256 lo, hi; };
struct VI { __m256i lo, hi; };
using VM = uint16_t;
struct VD { __m256d s[4]; };  // float64 sums of lanes 0-3, 4-7, 8-11, 12-15

// 8 mask bits as 8 all-ones / all-zeros int32 lanes.
inline __m256i lanes_of(unsigned bits) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), bit), bit);
}
inline VM mask_of(__m256 lo, __m256 hi) {
  return static_cast<VM>(_mm256_movemask_ps(lo) | (_mm256_movemask_ps(hi) << 8));
}

inline VM tail_mask(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<VM>((1u << left) - 1); }
inline VF vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline VF vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline VF vload(VM m, const float* p) {  // 0 outside m; masked-off lanes are never read
  if (m == 0xFFFF) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  return {_mm256_maskload_ps(p, lanes_of(m & 0xFF)), _mm256_maskload_ps(p + 8, lanes_of(m >> 8))};
}
inline void vstore16(float* p, VF x) {
  _mm256_storeu_ps(p, x.lo);
  _mm256_storeu_ps(p + 8, x.hi);
}
inline void vstore(float* p, VM m, VF x) {  // a whole vector plainly: VMASKMOVPS stores are microcoded on Zen
  if (m == 0xFFFF) return vstore16(p, x);
  _mm256_maskstore_ps(p, lanes_of(m & 0xFF), x.lo);
  _mm256_maskstore_ps(p + 8, lanes_of(m >> 8), x.hi);
}
inline VF vadd(VF a, VF b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline VF vsub(VF a, VF b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline VF vmul(VF a, VF b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline VF vdiv(VF a, VF b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline VF vselect(VM m, VF yes, VF no) {
  return {_mm256_blendv_ps(no.lo, yes.lo, _mm256_castsi256_ps(lanes_of(m & 0xFF))),
          _mm256_blendv_ps(no.hi, yes.hi, _mm256_castsi256_ps(lanes_of(m >> 8)))};
}
// vmaxps(acc, x): x where either is NaN, as the AVX-512 instruction
inline VF vmask_max(VF acc, VM m, VF x) { return vselect(m, {_mm256_max_ps(acc.lo, x.lo), _mm256_max_ps(acc.hi, x.hi)}, acc); }
inline VF vmask_add(VF acc, VM m, VF x) { return vselect(m, vadd(acc, x), acc); }
inline VF vkeep(VM m, VF x) { return vselect(m, x, vzero()); }
inline VM vlt(VF a, VF b) { return mask_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ)); }
inline VM vle(VF a, VF b) { return mask_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_LE_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_LE_OQ)); }
inline VM vgt(VF a, VF b) { return mask_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)); }
// _mm512_reduce_max_ps' tree and operand order (max returns its second operand for a NaN, so
// even a row with NaNs gets the same value)
inline float vreduce_max(VF a) {
  const __m256 m = _mm256_max_ps(a.hi, a.lo);
  const __m128 q = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
  const __m128 r = _mm_max_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_max_ps(r, _mm_shuffle_ps(r, r, _MM_SHUFFLE(0, 1, 0, 1))));
}
inline float vreduce_add(VF a) {  // _mm512_reduce_add_ps' tree: (l + l8), then (+ l4), (+ l2), (+ l1)
  const __m256 t = _mm256_add_ps(a.hi, a.lo);
  const __m128 u = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
  const __m128 v = _mm_add_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(v) + _mm_cvtss_f32(_mm_shuffle_ps(v, v, _MM_SHUFFLE(1, 1, 1, 1)));
}
inline VD vd_zero() { return {{_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()}}; }
inline void vd_add(VD& s, VF w) {
  s.s[0] = _mm256_add_pd(s.s[0], _mm256_cvtps_pd(_mm256_castps256_ps128(w.lo)));
  s.s[1] = _mm256_add_pd(s.s[1], _mm256_cvtps_pd(_mm256_extractf128_ps(w.lo, 1)));
  s.s[2] = _mm256_add_pd(s.s[2], _mm256_cvtps_pd(_mm256_castps256_ps128(w.hi)));
  s.s[3] = _mm256_add_pd(s.s[3], _mm256_cvtps_pd(_mm256_extractf128_ps(w.hi, 1)));
}
inline double vd_sum(const VD& s) {  // _mm512_reduce_add_pd(lo + hi)
  const __m256d t = _mm256_add_pd(_mm256_add_pd(s.s[1], s.s[3]), _mm256_add_pd(s.s[0], s.s[2]));
  const __m128d u = _mm_add_pd(_mm256_extractf128_pd(t, 1), _mm256_castpd256_pd128(t));
  return _mm_cvtsd_f64(u) + _mm_cvtsd_f64(_mm_unpackhi_pd(u, u));
}

// sampling_lanes_avx512.h's exp: the same clamp, reduction and polynomial; vscalefps' p x 2^n
// (one rounding) as p x 2^(n + 64), exact for every n >= -174 (the clamp keeps n >= -159), then
// x 2^-64, the one rounding (to a subnormal or 0 below float32's normal range).
inline __m256 exp8_nonpositive(__m256 v) {
  const __m256 x = _mm256_max_ps(v, _mm256_set1_ps(kExpClamp));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127 + 64)), 23);
  return _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_set1_ps(0x1p-64f));
}
inline VF vexp_nonpositive(VF v) { return {exp8_nonpositive(v.lo), exp8_nonpositive(v.hi)}; }

inline VI vbucket(VF d, float per_nat, float last) {
  const __m256 k = _mm256_set1_ps(per_nat), l = _mm256_set1_ps(last);
  return {_mm256_cvttps_epi32(_mm256_min_ps(_mm256_mul_ps(d.lo, k), l)),
          _mm256_cvttps_epi32(_mm256_min_ps(_mm256_mul_ps(d.hi, k), l))};
}
inline VM vieq(VI a, int32_t b) {
  const __m256i v = _mm256_set1_epi32(b);
  return mask_of(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a.lo, v)), _mm256_castsi256_ps(_mm256_cmpeq_epi32(a.hi, v)));
}
inline VM vile(VI a, int32_t b) {
  const __m256i v = _mm256_set1_epi32(b);
  return static_cast<VM>(~mask_of(_mm256_castsi256_ps(_mm256_cmpgt_epi32(a.lo, v)),
                                  _mm256_castsi256_ps(_mm256_cmpgt_epi32(a.hi, v))));
}
inline void vstore_i16(int32_t* p, VI a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a.lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 8), a.hi);
}

inline VI vi_set1(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline VI vi_iota(int32_t base) {
  const __m256i b = _mm256_set1_epi32(base);
  return {_mm256_add_epi32(b, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
          _mm256_add_epi32(b, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15))};
}
inline VI vi_xor(VI a, VI b) { return {_mm256_xor_si256(a.lo, b.lo), _mm256_xor_si256(a.hi, b.hi)}; }
inline VI vi_srl(VI a, int s) { return {_mm256_srli_epi32(a.lo, s), _mm256_srli_epi32(a.hi, s)}; }
inline VI vi_mul(VI a, int32_t b) {
  const __m256i v = _mm256_set1_epi32(b);
  return {_mm256_mullo_epi32(a.lo, v), _mm256_mullo_epi32(a.hi, v)};
}
inline VF vi_to_float(VI a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline VI vi_ids(const int64_t* p, VM m) {  // the low 32 bits of each id in m, 0 elsewhere
  alignas(32) int32_t v[16];
  for (int l = 0; l < 16; ++l) v[l] = (m >> l) & 1 ? static_cast<int32_t>(p[l]) : 0;
  return {_mm256_load_si256(reinterpret_cast<const __m256i*>(v)), _mm256_load_si256(reinterpret_cast<const __m256i*>(v + 8))};
}
