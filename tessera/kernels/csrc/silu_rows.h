// silu(gate) as the fused ops compute it, shared by silu_mul (fused_ops.cpp) and the gate_up
// linears that apply it in their store epilogue (invariant_kernels.cpp: linear_bf16_silu;
// invariant_qgemm.cpp: qgemm_silu, kqgemm_silu), so they give the same bits: exp by a fixed
// polynomial, then g / (1 + exp(-g)) in fp32. Callers round the result to their dtype and multiply
// by up (store_silu_row for the epilogues).
#pragma once

#include <immintrin.h>

namespace {

// exp(x): 2^n times a degree-6 polynomial of the reduced argument (libm's expf is scalar).
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.3981999507e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23));
  return _mm512_castsi512_ps(bits);
}

// silu(g) = g / (1 + exp(-g)), unrounded fp32 (-g as 0 - g: +0 for g = 0).
__attribute__((target("avx512f"))) inline __m512 silu16(__m512 g) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// exp16 and silu16 on 8 lanes (AVX2 + FMA, CPUs without AVX-512): the same clamps, reduction,
// polynomial and scaling, op for op, so the same bits (fused_avx2.cpp; paged_attention.cpp's
// softmax_exp8 masks it).
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.3981999507e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23));
  return _mm256_castsi256_ps(bits);
}

__attribute__((target("avx2,fma"))) inline __m256 silu8(__m256 g) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// 16 floats rounded to bf16 (nearest even) and widened back.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline __m512 bf16_round16(__m512 v) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h)), 16));
}

// 16 columns of silu(gate) * up from fp32 rows of gate and up, into bf16 `out`: each rounded to
// bf16 first, as the bf16 gate_up output silu_mul reads, then silu_mul's arithmetic.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void store_silu_row(const float* gate,
                                                                                          const float* up, void* out) {
  const __m512 act = bf16_round16(silu16(bf16_round16(_mm512_loadu_ps(gate))));
  const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(act, bf16_round16(_mm512_loadu_ps(up))));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<const __m256i&>(h));
}

}  // namespace
