// The float32 kernels for CPUs with AVX2 + FMA and no AVX-512 BF16 (Zen 3): fused_avx2.cpp's row
// functions (arguments as fused_ops.cpp's functions of the same names, which call them) and
// f32_gemm_avx2.cpp's f32_gemm (invariant_kernels.cpp's linear_f32 calls it).
#pragma once

#include <cstdint>

namespace tessera_avx2 {

void add_rms_norm_rows(const float* x, const float* res, const float* w, float* out, float* sum_out, int64_t rows,
                       int64_t d, float eps);
void rotary_rows(const float* x, int64_t row_stride, const float* cos, const float* sin, const int64_t* pos,
                 float* out, int64_t tokens, int64_t heads, int64_t d);
void rotary_kv_rows(const float* x, int64_t row_stride, const float* cos, const float* sin, const int64_t* pos,
                    const int64_t* slots, float* q_out, float* k_cache, float* v_cache, int64_t tokens, int64_t heads,
                    int64_t kv_heads, int64_t d);
void silu_mul_rows(const float* gu, float* out, int64_t rows, int64_t inter);

// out[m, n] = x[m, k] @ W^T (+ bias) with wt the packed weight [np / 64, k, 64]: every output a
// fused multiply-add chain over k in order from 0, then + bias (or + 0), as linear_f32's portable
// loop computes it.
void f32_gemm(const float* x, const float* wt, const float* bias, float* out, int64_t m, int64_t n, int64_t np,
              int64_t k);
// The same for a gate_up weight of n = 2 x inter columns packed in pairs (8 gate rows, then the
// same 8 up rows, in turn; n a multiple of 64): out [m, n] in the plain order (gate, then up), or
// with silu, out [m, inter] = silu(gate) * up, silu_mul's arithmetic on that output.
void f32_gemm_pairs(const float* x, const float* wt, const float* bias, float* out, int64_t m, int64_t n, int64_t k,
                    bool silu);
// The same from a GGUF file's blocks of W in panel order ([np / 64, k / block k, block bytes];
// format 0 Q4 (Q4_0 / Q4_1), 1 Q8 (Q8_0, Q5_0), 2 Q4 with float32 scales (Q4_K), 3 Q8 with float32
// scales per 16 k (Q6_K), 4 Q8 with float32 d and m (Q5_1, Q5_K); f32_gemm_avx2.cpp's Format has
// the layouts), the same output bits as f32_gemm on the float32 weight the loader made of
// them. store: 0 the plain output, 1 and 2 a gate_up in pairs as f32_gemm_pairs without and with
// silu (then np = n).
void f32_gemm_blocks(const float* x, const uint8_t* blocks, int format, const float* bias, float* out, int64_t m,
                     int64_t n, int64_t np, int64_t k, int store);
// One block of format `format` (0-4): the k it covers and its bytes.
int64_t f32_block_k(int format);
int64_t f32_block_bytes(int format);

}  // namespace tessera_avx2
