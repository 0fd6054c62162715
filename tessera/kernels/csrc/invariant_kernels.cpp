// Batch-invariant CPU kernels: a linear layer and paged attention whose result for one row
// (token) never depends on how many other rows run with it.
//
// Why: oneDNN/MKL pick their GEMM kernel and its blocking from the shape, so a token's hidden
// state rounds differently in a batch of 1, 17 or 512 rows; in bf16 that flips greedy tokens
// (a prefix-cache hit answered differently from a miss). Here every output element is reduced
// in one fixed order whatever M is:
//   * linear_amx:  bf16 x bf16 -> fp32 on AMX tiles, K walked in 32-wide steps in order, rows
//                  independent (a tile row of C depends only on the same row of A).
//   * linear_f32:  fp32 FMA chains over K in order, vectorized across output columns.
//   * paged_attention: each (token, KV head) walks its own context block by block (online
//                  softmax in fp32), reading K/V in place through the block table; decode rows,
//                  prefill rows and speculative verification rows run the same code.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

bool amx_permitted() {
  // Linux hands out AMX tile state only on request, once per process.
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (16 x 16 fp32), 4-5: A (16 rows x 32 bf16), 6-7: B (16 k-pairs x 16 cols x 2).
__attribute__((target("amx-tile,amx-bf16"))) void configure_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

__attribute__((target("avx512f,avx512bf16"))) inline void store_row_bf16(
    const float* c, const float* bias, at::BFloat16* out, int n) {
  // n <= 16 columns of one C tile row, plus bias, rounded to bf16 (nearest even).
  __mmask16 mask = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  __m512 v = _mm512_loadu_ps(c);
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
  __m256bh h = _mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(reinterpret_cast<void*>(out), mask, reinterpret_cast<__m256i&>(h));
}

// C[M, N] = A[Mp, Kp] (bf16, rows padded to 32, K to 32) x B (VNNI-packed [Np/16][Kp/2][16][2]).
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16"))) void amx_gemm(
    const at::BFloat16* a, const at::BFloat16* b, const float* bias, at::BFloat16* out, int64_t m,
    int64_t mp, int64_t n, int64_t np, int64_t kp) {
  const int64_t n_pairs = np / 32, m_pairs = mp / 32, k_steps = kp / 32;
  const int64_t b_block = (kp / 2) * 32;  // bf16 elements of one 16-column block
  at::parallel_for(0, n_pairs, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float c[4][16 * 16];
    for (int64_t np_i = begin; np_i < end; ++np_i) {
      const at::BFloat16* b0 = b + (2 * np_i) * b_block;
      const at::BFloat16* b1 = b0 + b_block;
      for (int64_t mp_i = 0; mp_i < m_pairs; ++mp_i) {
        const at::BFloat16* a0 = a + (2 * mp_i) * 16 * kp;
        const at::BFloat16* a1 = a0 + 16 * kp;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t ks = 0; ks < k_steps; ++ks) {
          _tile_loadd(4, a0 + ks * 32, kp * 2);
          _tile_loadd(5, a1 + ks * 32, kp * 2);
          _tile_loadd(6, b0 + ks * 16 * 32, 64);
          _tile_loadd(7, b1 + ks * 16 * 32, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        for (int q = 0; q < 4; ++q) {
          const int64_t row0 = (2 * mp_i + q / 2) * 16, col0 = (2 * np_i + q % 2) * 16;
          if (col0 >= n) continue;
          const int cols = static_cast<int>(std::min<int64_t>(16, n - col0));
          for (int r = 0; r < 16 && row0 + r < m; ++r)
            store_row_bf16(c[q] + r * 16, bias ? bias + col0 : nullptr, out + (row0 + r) * n + col0, cols);
        }
      }
    }
    _tile_release();
  });
}

at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t n) {
  TORCH_CHECK(amx_permitted(), "linear_amx: the kernel did not get AMX tile state from the OS");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "linear_amx: bf16 only");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2, "linear_amx: bad packed weight");
  const int64_t np = packed.size(0) * 16, kp = packed.size(1) * 2;
  auto rows = x.reshape({-1, x.size(-1)});
  const int64_t m = rows.size(0), k = rows.size(1);
  TORCH_CHECK(k <= kp && np >= n, "linear_amx: x has ", k, " features, the packed weight ", kp);
  const int64_t mp = std::max<int64_t>(32, (m + 31) / 32 * 32);
  auto a = at::zeros({mp, kp}, x.options());
  a.narrow(0, 0, m).narrow(1, 0, k).copy_(rows);
  auto out = at::empty({m, n}, x.options());
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) bias_f = bias->to(at::kFloat).contiguous();
  amx_gemm(a.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(),
           bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, out.data_ptr<at::BFloat16>(), m, mp, n, np, kp);
  auto shape = x.sizes().vec();
  shape.back() = n;
  return out.view(shape);
}

// fp32: out[m, n] = sum_k x[m, k] * wt[k, n] in k order, 64 columns x 4 rows at a time.
// wt is the weight transposed and padded to [K, Np] with Np a multiple of 64.
void f32_gemm(const float* x, const float* wt, const float* bias, float* out, int64_t m, int64_t n, int64_t np,
              int64_t k) {
  constexpr int kCols = 64, kRows = 4;
  const int64_t col_blocks = np / kCols;
  at::parallel_for(0, col_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t cb = begin; cb < end; ++cb) {
      const int64_t col0 = cb * kCols;
      const int64_t cols = std::min<int64_t>(kCols, n - col0);
      if (cols <= 0) continue;
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r0));
        float acc[kRows][kCols] = {};
        for (int64_t kk = 0; kk < k; ++kk) {
          const float* w = wt + kk * np + col0;
          for (int r = 0; r < kRows; ++r) {
            // Rows past m compute on row 0's data and are discarded: the same instruction
            // stream for every row, so a row's result does not depend on its neighbours.
            const float xv = x[(r0 + (r < rows ? r : 0)) * k + kk];
#pragma omp simd
            for (int j = 0; j < kCols; ++j) acc[r][j] = std::fma(xv, w[j], acc[r][j]);
          }
        }
        for (int r = 0; r < rows; ++r)
          for (int64_t j = 0; j < cols; ++j) out[(r0 + r) * n + col0 + j] = acc[r][j] + (bias ? bias[col0 + j] : 0.f);
      }
    }
  });
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& wt, const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && wt.scalar_type() == at::kFloat, "linear_f32: float32 only");
  auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t m = rows.size(0), k = rows.size(1);
  TORCH_CHECK(wt.size(0) == k && wt.size(1) % 64 == 0 && wt.size(1) >= n, "linear_f32: bad packed weight");
  auto out = at::empty({m, n}, x.options());
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) bias_f = bias->to(at::kFloat).contiguous();
  f32_gemm(rows.data_ptr<float>(), wt.data_ptr<float>(), bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
           out.data_ptr<float>(), m, n, wt.size(1), k);
  auto shape = x.sizes().vec();
  shape.back() = n;
  return out.view(shape);
}

template <typename T>
inline float to_f32(T v) {
  return static_cast<float>(v);
}

template <typename T>
inline void load_row(const T* src, float* dst, int d) {
  for (int i = 0; i < d; ++i) dst[i] = to_f32(src[i]);
}

// bf16 -> fp32 is a 16-bit shift: written on integers so the compiler vectorizes it (the bit
// cast goes through memcpy: a float read of a uint32 store would break strict aliasing).
inline void load_row(const at::BFloat16* src, float* dst, int d) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int i = 0; i < d; ++i) {
    const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    dst[i] = f;
  }
}

constexpr int kLanes = 16;   // key positions scored together (one AVX-512 register of fp32)
constexpr int kTileQ = 16;   // query tokens of one sequence sharing a K/V tile load

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// exp for the softmax on 16 lanes at once, the same arithmetic in every call: 2^n times a
// degree-6 polynomial of the reduced argument. Lanes at or below -87 (masked: -inf) give 0.
inline v16f softmax_exp(v16f x) {
  const v16f lo = x > -87.0f ? x : (v16f){} - 87.0f;
  const v16f xc = lo < 88.0f ? lo : (v16f){} + 88.0f;
  const v16f shifter = (v16f){} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const v16f n = (xc * 1.44269504088896341f + shifter) - shifter;
  v16f r = xc - n * 0.693145751953125f;
  r = r - n * 1.428606765330187e-06f;
  v16f p = (v16f){} + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + (r + 1.0f);
  v16i bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += __builtin_convertvector(n, v16i) << 23;
  v16f e;
  std::memcpy(&e, &bits, sizeof(e));
  return x > -87.0f ? e : (v16f){};
}

inline float softmax_exp_scalar(float x) {
  v16f v = (v16f){} + x;
  return softmax_exp(v)[0];
}

struct Workspace {
  std::vector<float> q, acc, kb, vb, mx, den;
};

// Sum of 16 lanes as a fixed tree (8 + 4 + 2 + 1).
inline float lane_sum(v16f a) {
  v16f b = a + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  b = b + __builtin_shufflevector(b, b, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  b = b + __builtin_shufflevector(b, b, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  b = b + __builtin_shufflevector(b, b, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return b[0];
}

// q . k over D floats: 16 lanes of partial products in d order, then the lane tree.
template <int D>
inline float dot(const float* q, const float* k) {
  v16f acc;
  std::memcpy(&acc, q, 64);
  v16f kv;
  std::memcpy(&kv, k, 64);
  acc = acc * kv;
  for (int c = 16; c < D; c += 16) {
    v16f qv;
    std::memcpy(&qv, q + c, 64);
    std::memcpy(&kv, k + c, 64);
    acc = qv * kv + acc;
  }
  return lane_sum(acc);
}

// One tile: `rows` = tq tokens x g heads of one sequence against KV head kvh. Each row walks its
// own context in absolute 16-position tiles [16c, 16c + 16): a score per key (dot above), lanes
// past the row's context masked, online softmax, then P.V with keys in order. The same
// instructions run for a row whatever tile it is in, so its result is batch-invariant.
template <typename T, int D>
void attend_tile(const T* q, int64_t q_stride_tok, const T* k_cache, const T* v_cache, const int32_t* table,
                 const int32_t* ctx, int tq, int64_t block_size, int64_t hkv, int64_t kvh, int g, float scale,
                 T* out, int64_t out_stride_tok, Workspace& ws) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  const int rows = tq * g;
  ws.q.resize(static_cast<size_t>(rows) * D);
  ws.acc.assign(static_cast<size_t>(rows) * D, 0.f);
  ws.kb.resize(static_cast<size_t>(kLanes) * D);
  ws.vb.resize(static_cast<size_t>(kLanes) * D);
  ws.mx.assign(rows, -std::numeric_limits<float>::infinity());
  ws.den.assign(rows, 0.f);
  float* qs = ws.q.data();
  float* acc = ws.acc.data();
  float* kb = ws.kb.data();
  float* vb = ws.vb.data();
  int64_t max_ctx = 0;
  for (int t = 0; t < tq; ++t) {
    max_ctx = std::max<int64_t>(max_ctx, ctx[t]);
    for (int h = 0; h < g; ++h) {
      float* dst = qs + (t * g + h) * D;
      load_row(q + t * q_stride_tok + h * D, dst, D);
      for (int i = 0; i < D; ++i) dst[i] *= scale;
    }
  }
  const int64_t row_stride = hkv * D;
  const bool tile_in_one_block = block_size % kLanes == 0;
  alignas(64) float sc[kLanes];
  for (int64_t start = 0; start < max_ctx; start += kLanes) {
    const int64_t avail = std::min<int64_t>(kLanes, max_ctx - start);
    const int64_t base = static_cast<int64_t>(table[start / block_size]) * block_size + start % block_size;
    for (int j = 0; j < kLanes; ++j) {
      float* krow = kb + j * D;
      float* vrow = vb + j * D;
      if (j < avail) {
        const int64_t pos = start + j;
        const int64_t slot = tile_in_one_block
                                 ? base + j
                                 : static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
        load_row(k_cache + slot * row_stride + kvh * D, krow, D);
        load_row(v_cache + slot * row_stride + kvh * D, vrow, D);
      } else {
        std::memset(krow, 0, sizeof(float) * D);
        std::memset(vrow, 0, sizeof(float) * D);
      }
    }
    for (int t = 0; t < tq; ++t) {
      const int64_t valid = static_cast<int64_t>(ctx[t]) - start;
      if (valid <= 0) continue;
      for (int h = 0; h < g; ++h) {
        const int r = t * g + h;
        const float* qr = qs + r * D;
        for (int j = 0; j < kLanes; ++j) sc[j] = dot<D>(qr, kb + j * D);
        float bm = ws.mx[r];
        for (int j = 0; j < kLanes; ++j) {
          if (j >= valid) sc[j] = -std::numeric_limits<float>::infinity();
          bm = std::max(bm, sc[j]);
        }
        const float corr = softmax_exp_scalar(ws.mx[r] - bm);
        v16f sv;
        std::memcpy(&sv, sc, sizeof(sv));
        sv = softmax_exp(sv - bm);
        ws.den[r] = std::fma(ws.den[r], corr, lane_sum(sv));
        ws.mx[r] = bm;
        float* ar = acc + r * D;
        for (int c = 0; c < D; c += 16) {
          v16f a;
          std::memcpy(&a, ar + c, 64);
          a = a * corr;
          for (int j = 0; j < kLanes; ++j) {
            v16f vv;
            std::memcpy(&vv, vb + j * D + c, 64);
            a = sv[j] * vv + a;
          }
          std::memcpy(ar + c, &a, 64);
        }
      }
    }
  }
  for (int t = 0; t < tq; ++t)
    for (int h = 0; h < g; ++h) {
      const int r = t * g + h;
      const float inv = ws.den[r] > 0.f ? 1.f / ws.den[r] : 0.f;
      T* dst = out + t * out_stride_tok + h * D;
      for (int i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[r * D + i] * inv);
    }
}

template <typename T, int D>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& tables, const at::Tensor& seq_idx, const at::Tensor& ctx_len,
                          int64_t block_size, double scale, at::Tensor& out) {
  const int64_t t = q.size(0), h = q.size(1), hkv = k_cache.size(1);
  const int g = static_cast<int>(h / hkv);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* sp = seq_idx.data_ptr<int32_t>();
  const int32_t* cp = ctx_len.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t max_blocks = tables.size(1);
  // Tiles: runs of up to kTileQ consecutive tokens of one sequence (a prefill span's rows).
  std::vector<int64_t> tile_start;
  for (int64_t i = 0; i < t;) {
    tile_start.push_back(i);
    int64_t j = i + 1;
    while (j < t && j - i < kTileQ && sp[j] == sp[i]) ++j;
    i = j;
  }
  tile_start.push_back(t);
  const int64_t num_tiles = static_cast<int64_t>(tile_start.size()) - 1;
  at::parallel_for(0, num_tiles * hkv, 1, [&](int64_t begin, int64_t end) {
    thread_local Workspace ws;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = item / hkv, kvh = item % hkv;
      const int64_t first = tile_start[tile];
      const int tq = static_cast<int>(tile_start[tile + 1] - first);
      attend_tile<T, D>(qp + (first * h + kvh * g) * D, h * D, kp, vp, tp + static_cast<int64_t>(sp[first]) * max_blocks,
                        cp + first, tq, block_size, hkv, kvh, g, static_cast<float>(scale),
                        op + (first * h + kvh * g) * D, h * D, ws);
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_idx, const at::Tensor& ctx_len,
                           int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "paged_attention: q [T,H,d], caches [S,Hkv,d]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_attention: q and the caches must share a dtype");
  const int64_t d = q.size(2), h = q.size(1), hkv = k_cache.size(1);
  TORCH_CHECK(h % hkv == 0, "paged_attention: H must be a multiple of Hkv");
  auto qc = q.contiguous();
  auto tables = block_tables.to(at::kInt).contiguous();
  auto seqs = seq_idx.to(at::kInt).contiguous();
  auto ctx = ctx_len.to(at::kInt).contiguous();
  auto out = at::empty({q.size(0), h * d}, q.options());
  auto run = [&](auto tag, auto dim) {
    using T = decltype(tag);
    paged_attention_impl<T, decltype(dim)::value>(qc, k_cache, v_cache, tables, seqs, ctx, block_size, scale, out);
  };
#define TESSERA_DISPATCH_D(T)                                                            \
  switch (d) {                                                                           \
    case 64: run(T{}, std::integral_constant<int, 64>{}); break;                         \
    case 128: run(T{}, std::integral_constant<int, 128>{}); break;                       \
    case 256: run(T{}, std::integral_constant<int, 256>{}); break;                       \
    case 32: run(T{}, std::integral_constant<int, 32>{}); break;                         \
    case 16: run(T{}, std::integral_constant<int, 16>{}); break;                         \
    case 80: run(T{}, std::integral_constant<int, 80>{}); break;                         \
    case 96: run(T{}, std::integral_constant<int, 96>{}); break;                         \
    default: TORCH_CHECK(false, "paged_attention: head_dim ", d, " not in 16/32/64/80/96/128/256"); \
  }
  if (q.scalar_type() == at::kBFloat16) {
    TESSERA_DISPATCH_D(at::BFloat16)
  } else if (q.scalar_type() == at::kFloat) {
    TESSERA_DISPATCH_D(float)
  } else if (q.scalar_type() == at::kHalf) {
    TESSERA_DISPATCH_D(at::Half)
  } else {
    TORCH_CHECK(false, "paged_attention: dtype ", q.scalar_type(), " not supported");
  }
#undef TESSERA_DISPATCH_D
  return out;
}

}  // namespace

TORCH_LIBRARY(tessera_inv, m) {
  m.def("linear_amx(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor wt, Tensor? bias, int n) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_idx, "
        "Tensor ctx_len, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tessera_inv, CPU, m) {
  m.impl("linear_amx", &linear_amx);
  m.impl("linear_f32", &linear_f32);
  m.impl("paged_attention", &paged_attention);
}
