// Batch-invariant paged attention for CPU (the op torch.ops.tessera_inv.paged_attention; the
// linear kernels of the same library are in invariant_kernels.cpp).
//
// Each (token, KV head) walks its own context block by block (online softmax in fp32), reading
// K/V in place through the block table; decode rows, prefill rows and speculative verification
// rows run the same code, so a row's result never depends on the batch or on chunk boundaries.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

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

TORCH_LIBRARY_FRAGMENT(tessera_inv, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_idx, "
        "Tensor ctx_len, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tessera_inv, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
