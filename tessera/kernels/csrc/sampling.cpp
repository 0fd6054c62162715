// The sampler's native ops (CPU, float32 logits), each one pass over a row instead of a dozen
// torch ops:
//   * head_topk:      the head of each row for top-k / top-p (tessera.engine.candidates.head_topk)
//   * kept_head:      the kept prefix of that head (tessera.engine.candidates._kept_within)
//   * draw_kept_head: kept_head and the inverse-CDF draw from it (tessera.engine.candidates.draw_kept)
//   * sample_softmax: one token per row from softmax(logits / temperature) by the inverse CDF of a
//                     given uniform (temperature-only rows: the API's default sampling)
//   * softmax_normalizers: each row's max and sum of exps, what a top-p-only nucleus is
//                     measured against (tessera.engine.candidates._row_normalizers)
//   * sample_top_p:   one token per top-p-only row (no top-k, no min-p) from its nucleus, found
//                     and drawn from by a histogram of the row's mass instead of a sorted head
//   * top_p_kept:     the same nucleus as a kept set (id order), min-p applied: seeded and min-p rows
//   * seeded_uniforms: the seeded race's hashed uniforms (tessera.engine.sampler.seeded_noise)
// Rows are independent, so a row's result never depends on its batch.
//
// head_topk keeps tessera.engine.candidates.head_topk's contract: at least `width` entries per
// row, every entry above bound[row] taken, every entry left out <= bound[row]. The torch version of
// the same algorithm (strided chunks' maxima by amax, topk over them, a gather of the chosen
// chunks, a nonzero compaction) was ~15 small ops and 1.2 ms of a 32-row step's 1.9 ms of top-k /
// top-p sampling (Zen 4, 49152-token vocabulary). Here each row is cut into contiguous 64-entry
// chunks: one pass takes every chunk's maximum, the bound is the width-th largest maximum (at
// least `width` entries, those maxima, reach it; an entry above it can only sit in a chunk whose
// maximum is above it), and the chunks whose maximum reaches the bound are scanned again, from
// cache, for their entries >= bound.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string_view>
#include <utility>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kChunk = 64;

// One 64-entry chunk's maximum: 16 lanes (lane l the running maximum of entries l, l + 16, ...,
// each step `x > lane ? x : lane`), then `m = lane > m ? lane : m` over lanes 0..15 in order. The
// lanes as two 8-float vectors (AVX): on AVX2 GCC had kept the 16-float array in scalars (vmaxss;
// head_topk took 206 us for 32 x 49152 against amax's 55, Zen 3). The lanes' maximum by a tree is the same
// value where no lane is NaN and it is not zero (the value is then unique; the loop's order only
// picks among NaNs and signed zeros), and the loop decides the rest.
inline float lanes_max_in_order(const float* lane) {
  float r = lane[0];
  for (int l = 1; l < 16; ++l) r = lane[l] > r ? lane[l] : r;
  return r;
}

inline float chunk_max(const float* p) {
  float lane[16];
#if defined(__AVX512F__)
  // The same 16 lanes in one vector: a quarter of the AVX path's ops per chunk.
  __m512 a = _mm512_loadu_ps(p);
  for (int64_t i = 16; i < kChunk; i += 16) a = _mm512_max_ps(_mm512_loadu_ps(p + i), a);
  const float m = _mm512_reduce_max_ps(a);
  if (_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) == 0 && m != 0.0f) return m;
  _mm512_storeu_ps(lane, a);
#elif defined(__AVX__)
  __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
  for (int64_t i = 16; i < kChunk; i += 16) {
    a = _mm256_max_ps(_mm256_loadu_ps(p + i), a);  // (x > lane) ? x : lane, as below
    b = _mm256_max_ps(_mm256_loadu_ps(p + i + 8), b);
  }
  __m256 t = _mm256_max_ps(a, b);
  t = _mm256_max_ps(t, _mm256_permute2f128_ps(t, t, 1));
  t = _mm256_max_ps(t, _mm256_permute_ps(t, 0x4E));
  t = _mm256_max_ps(t, _mm256_permute_ps(t, 0xB1));
  const float m = _mm256_cvtss_f32(t);
  const int nan = _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) | _mm256_movemask_ps(_mm256_cmp_ps(b, b, _CMP_UNORD_Q));
  if (nan == 0 && m != 0.0f) return m;
  _mm256_storeu_ps(lane, a);
  _mm256_storeu_ps(lane + 8, b);
#else
  for (int l = 0; l < 16; ++l) lane[l] = p[l];
  for (int64_t i = 16; i < kChunk; i += 16)
    for (int l = 0; l < 16; ++l) lane[l] = p[i + l] > lane[l] ? p[i + l] : lane[l];
#endif
  return lanes_max_in_order(lane);
}

// The width-th largest of v (the bound head_topk's chunks must reach): a min-heap of the largest
// `width` seen, which a value enters only when it beats the heap's least. nth_element over the
// 768 chunk maxima of a 49152-token row (unpredictable branches on every element) had been a
// third of head_topk's time once the chunk maxima came from the lm_head (Zen 4). The value is
// unique, so any exact selection gives the same bound; with a NaN among v (where neither
// ordering is well defined) it stays nth_element's.
inline float kth_largest(const std::vector<float>& v, int64_t width, std::vector<float>& scratch) {
  const auto greater = std::greater<float>();
  if (std::any_of(v.begin(), v.end(), [](float x) { return std::isnan(x); })) {
    scratch = v;
    std::nth_element(scratch.begin(), scratch.begin() + (width - 1), scratch.end(), greater);
    return scratch[width - 1];
  }
  scratch.assign(v.begin(), v.begin() + width);
  std::make_heap(scratch.begin(), scratch.end(), greater);  // the least of them in front
  for (size_t i = width; i < v.size(); ++i)
    if (v[i] > scratch.front()) {
      std::pop_heap(scratch.begin(), scratch.end(), greater);
      scratch.back() = v[i];
      std::push_heap(scratch.begin(), scratch.end(), greater);
    }
  return scratch.front();
}

// Entries lo..hi-1 of row that are >= b (never a NaN), appended to v and id in index order. With
// AVX-512 16 at a time (a compare and two compresses): the scalar loop's branch on every entry
// of the ~70 chunks a row scans was a fifth of head_topk's time (Zen 4).
inline void take_at_least(const float* row, int64_t lo, int64_t hi, float b, std::vector<float>& v,
                          std::vector<int64_t>& id) {
  int64_t i = lo;
#if defined(__AVX512F__)
  const __m512 bound = _mm512_set1_ps(b);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) float vals[16];
  alignas(64) int32_t idx[16];
  for (; i + 16 <= hi; i += 16) {
    const __mmask16 ge = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), bound, _CMP_GE_OQ);
    if (!ge) continue;
    // Compressed in registers, then stored whole: a compress straight to memory is microcoded on Zen 4.
    _mm512_store_ps(vals, _mm512_maskz_compress_ps(ge, _mm512_loadu_ps(row + i)));
    _mm512_store_si512(idx, _mm512_maskz_compress_epi32(ge, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(i)))));
    const int taken = __builtin_popcount(ge);
    for (int j = 0; j < taken; ++j) {
      v.push_back(vals[j]);
      id.push_back(idx[j]);
    }
  }
#endif
  for (; i < hi; ++i)
    if (row[i] >= b) {
      v.push_back(row[i]);
      id.push_back(i);
    }
}

// With `temperature`, each row's taken values come back divided by its temperature (in float32,
// as torch divides) and ordered by (quotient descending, id ascending): the exact order the
// sampler's kept prefix needs (tessera.engine.candidates.head_in_order), which a torch sort of
// int64 keys gave at 0.36 ms of a 32-row step on bf16-rounded logits (ties widen the head).
// maxima16 (optional, draw_kept_head's): each row's maximum of every 16 entries, NaN where one of
// them is NaN (tessera_inv::linear_bf16_maxima, from the lm_head's store epilogue). A 64-entry
// chunk's maximum is then the largest of its four, unless one is NaN or it is zero: only then is
// the chunk read, for chunk_max's own NaN and signed-zero order. Otherwise chunk_max would return
// that same value (its vector maximum, no lane NaN, not zero), so the head is the same.
std::tuple<at::Tensor, at::Tensor, at::Tensor> head_topk_with(const at::Tensor& x, int64_t width,
                                                              const c10::optional<at::Tensor>& temperature,
                                                              const float* maxima16) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "head_topk: x must be a 2-D float32 tensor");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), vocab = xc.size(1), num_chunks = (vocab + kChunk - 1) / kChunk;
  TORCH_CHECK(width >= 1 && width <= num_chunks, "head_topk: width ", width, " must be in [1, ", num_chunks,
              "] (the row's 64-entry chunks)");
  const float* data = xc.data_ptr<float>();
  std::vector<std::vector<float>> values(rows);
  std::vector<std::vector<int64_t>> ids(rows);
  auto bound = at::empty({rows}, xc.options());
  float* bounds = bound.data_ptr<float>();
  at::Tensor temps;
  if (temperature.has_value()) {
    temps = temperature->to(at::kFloat).contiguous();
    TORCH_CHECK(temps.numel() == rows, "head_topk: one temperature per row");
  }
  const float* tp = temps.defined() ? temps.data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> maxima(num_chunks), order(num_chunks);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = data + r * vocab;
      const int64_t full = vocab / kChunk;
      const float* hint = maxima16 ? maxima16 + r * ((vocab + 15) / 16) : nullptr;
      for (int64_t c = 0; c < full; ++c) {
        if (hint) {
          const float* h = hint + c * (kChunk / 16);
          const float m = std::max(std::max(h[0], h[1]), std::max(h[2], h[3]));
          if (!std::isnan(h[0]) && !std::isnan(h[1]) && !std::isnan(h[2]) && !std::isnan(h[3]) && m != 0.0f) {
            maxima[c] = m;
            continue;
          }
        }
        maxima[c] = chunk_max(row + c * kChunk);
      }
      if (full < num_chunks) {  // the short last chunk
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = full * kChunk; i < vocab; ++i) m = row[i] > m ? row[i] : m;
        maxima[full] = m;
      }
      const float b = kth_largest(maxima, width, order);
      bounds[r] = b;
      auto& v = values[r];
      auto& id = ids[r];
      v.reserve(2 * width);
      id.reserve(2 * width);
      if (hint) {
        // The chosen chunks were never read here: ask for all their lines first, so that the
        // misses overlap (~70 chunks a row at scattered places, 4 lines each).
        for (int64_t c = 0; c < num_chunks; ++c)
          if (maxima[c] >= b)
            for (int64_t l = 0; l < kChunk; l += 16) _mm_prefetch(reinterpret_cast<const char*>(row + c * kChunk + l), _MM_HINT_T0);
      }
      for (int64_t c = 0; c < num_chunks; ++c) {
        if (!(maxima[c] >= b)) continue;
        const int64_t lo = c * kChunk, hi = std::min(vocab, lo + kChunk);
        take_at_least(row, lo, hi, b, v, id);
      }
      if (tp) {
        const float t = tp[r];
        std::vector<std::pair<float, int64_t>> entries(v.size());
        for (size_t j = 0; j < v.size(); ++j) entries[j] = {v[j] / t, id[j]};  // -0.0 == 0.0: they tie
        std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) {
          return a.first > b.first || (a.first == b.first && a.second < b.second);
        });
        for (size_t j = 0; j < entries.size(); ++j) v[j] = entries[j].first, id[j] = entries[j].second;
      }
    }
  });
  int64_t width_out = 1;
  for (const auto& v : values) width_out = std::max<int64_t>(width_out, static_cast<int64_t>(v.size()));
  auto out_values = at::full({rows, width_out}, -std::numeric_limits<float>::infinity(), xc.options());
  auto out_ids = at::zeros({rows, width_out}, xc.options().dtype(at::kLong));
  float* ov = out_values.data_ptr<float>();
  int64_t* oi = out_ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(values[r].begin(), values[r].end(), ov + r * width_out);
    std::copy(ids[r].begin(), ids[r].end(), oi + r * width_out);
  }
  return {out_values, out_ids, bound};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> head_topk(const at::Tensor& x, int64_t width,
                                                         const c10::optional<at::Tensor>& temperature) {
  return head_topk_with(x, width, temperature, nullptr);
}

// kept_head: tessera.engine.candidates._kept_within for a native head, row by row: the head in
// (quotient, id) order (head_topk with the temperatures), then top-k, top-p (against the top-k
// mass, or for a top-p-only row against the whole row's (max, sum) given in norm_max/norm_sum),
// min-p and the exactness test, with the same arithmetic as the torch ops it replaces: float32
// exps of (s - s[0]) widened to float64 (float64 exps over the whole row's normalizer for top-p-
// only rows), a sequential float64 cumulative sum, top_p - 1e-6 rounded to float32. The head is
// padded to the batch's widest, as the torch version pads it (padding: weight 0, id 0).
// Returns (exact [R] bool, ids [R, W] long, weights [R, W] float64, num_kept [R] long).
// kept_in_head is the part after the head: it also takes a head the torch route fetched (a fetch
// too wide for head_topk's chunks), so that a row's weights come from this arithmetic whichever
// route its batch's fetch width took (the torch ops' float32 exp differs from std::exp in the last
// bit now and then: a row's sampling weights then depended on the rows beside it). bound: the
// head's raw-logit bound, none when the whole row was fetched.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kept_in_head(
    const at::Tensor& scaled_in, const at::Tensor& ids_in, const c10::optional<at::Tensor>& bound_in,
    const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
    int64_t vocab, const at::Tensor& norm_max, const at::Tensor& norm_sum) {
  TORCH_CHECK(scaled_in.dim() == 2 && scaled_in.scalar_type() == at::kFloat && ids_in.sizes() == scaled_in.sizes(),
              "kept_in_head: scaled [R, W] float32 and ids [R, W]");
  const at::Tensor scaled = scaled_in.contiguous(), ids = ids_in.to(at::kLong).contiguous();
  const bool whole_row = !bound_in.has_value() || !bound_in->defined();
  const at::Tensor bound = whole_row ? at::Tensor() : bound_in->to(at::kFloat).contiguous();
  const int64_t rows = scaled.size(0), w = scaled.size(1);
  const at::Tensor t = temperature.to(at::kFloat).contiguous(), k = top_k.to(at::kLong).contiguous();
  const at::Tensor p = top_p.to(at::kFloat).contiguous(), mp = min_p.to(at::kFloat).contiguous();
  const at::Tensor nmax = norm_max.to(at::kDouble).contiguous(), nsum = norm_sum.to(at::kDouble).contiguous();
  auto weights = at::empty({rows, w}, scaled.options().dtype(at::kDouble));
  auto num_kept = at::empty({rows}, ids.options());
  auto exact = at::empty({rows}, ids.options().dtype(at::kBool));
  const float *sp = scaled.data_ptr<float>(), *tp = t.data_ptr<float>();
  const float* bp = whole_row ? nullptr : bound.data_ptr<float>();
  const float *pp = p.data_ptr<float>(), *mpp = mp.data_ptr<float>();
  const int64_t* kp = k.data_ptr<int64_t>();
  const double *nmp = nmax.data_ptr<double>(), *nsp = nsum.data_ptr<double>();
  double* wp = weights.data_ptr<double>();
  int64_t* np = num_kept.data_ptr<int64_t>();
  bool* ep = exact.data_ptr<bool>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> cum(w);
    for (int64_t r = begin; r < end; ++r) {
      const float* s = sp + r * w;
      double* wt = wp + r * w;
      const int64_t top = kp[r];
      const float topp = pp[r];
      const bool limited = top < vocab, top_p_only = !limited && topp < 1.0f, all_in = topp >= 1.0f;
      const int64_t num_k = std::min<int64_t>(top, w);
      int64_t exact_len = vocab;  // a whole row is exact
      if (!whole_row) {
        const float edge = bp[r] / tp[r];  // entries strictly above it are the provably exact head
        exact_len = 0;
        for (int64_t j = 0; j < w; ++j) exact_len += s[j] > edge;
      }
      for (int64_t j = 0; j < w; ++j)
        wt[j] = top_p_only ? std::exp(static_cast<double>(s[j]) - nmp[r]) / nsp[r]
                           : static_cast<double>(std::exp(s[j] - s[0]));
      double run = 0.0;
      for (int64_t j = 0; j < w; ++j) cum[j] = run += wt[j];
      const double mass = top_p_only ? 1.0 : cum[std::max<int64_t>(num_k - 1, 0)];
      const double threshold = static_cast<double>(topp - 1e-6f);
      const double floor = static_cast<double>(mpp[r]) * wt[0];
      int64_t kept = 0, nucleus = 0;
      for (int64_t j = 0; j < w; ++j) {
        const bool in = j == 0 || all_in || (cum[j] - wt[j]) / mass < threshold;
        nucleus += in;
        kept += in && j < num_k && wt[j] >= floor;  // a prefix: every test is monotone along the row
      }
      kept = std::max<int64_t>(kept, 1);
      np[r] = kept;
      ep[r] = exact_len >= vocab || (limited && top <= exact_len) ||
              (!limited && (all_in || (topp < 1.0f && nucleus < exact_len)));
      for (int64_t j = kept; j < w; ++j) wt[j] = 0.0;
    }
  });
  return {exact, ids, weights, num_kept};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kept_head_with(
    const at::Tensor& x, const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const at::Tensor& min_p, int64_t width, const at::Tensor& norm_max, const at::Tensor& norm_sum,
    const float* maxima16) {
  auto [scaled, ids, bound] = head_topk_with(x, width, temperature, maxima16);
  return kept_in_head(scaled, ids, bound, temperature, top_k, top_p, min_p, x.size(1), norm_max, norm_sum);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kept_head(
    const at::Tensor& x, const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const at::Tensor& min_p, int64_t width, const at::Tensor& norm_max, const at::Tensor& norm_sum) {
  return kept_head_with(x, temperature, top_k, top_p, min_p, width, norm_max, norm_sum, nullptr);
}

// draw_kept_head: kept_head, then each exact row's token from its kept prefix by the inverse CDF
// of its uniform (tessera.engine.candidates._inverse_cdf): a sequential float64 cumulative sum,
// the target u * total kept below the total, the first position whose sum exceeds it. -1 for a
// row whose answer reaches past the exact head (the caller fetches it wider). One call instead of
// the kept prefix's [R, W] tensors, a torch cumsum and a searchsorted in Python: at a 32-row step
// right after the model those small ops ran 3-4x slower than in a loop (cold caches).
at::Tensor draw_kept_head(const at::Tensor& x, const at::Tensor& temperature, const at::Tensor& top_k,
                          const at::Tensor& top_p, const at::Tensor& min_p, int64_t width, const at::Tensor& norm_max,
                          const at::Tensor& norm_sum, const at::Tensor& uniforms,
                          const c10::optional<at::Tensor>& maxima16) {
  const int64_t rows = x.size(0);
  TORCH_CHECK(uniforms.numel() == rows, "draw_kept_head: one uniform per row");
  const float* hint = nullptr;
  if (maxima16.has_value() && maxima16->defined()) {
    TORCH_CHECK(x.dim() == 2 && maxima16->scalar_type() == at::kFloat && maxima16->is_contiguous() &&
                    maxima16->dim() == 2 && maxima16->size(0) == rows && maxima16->size(1) == (x.size(1) + 15) / 16,
                "draw_kept_head: maxima16 must be contiguous float32 [rows, ceil(vocab / 16)]");
    hint = maxima16->data_ptr<float>();
  }
  auto [exact, ids, weights, num_kept] =
      kept_head_with(x, temperature, top_k, top_p, min_p, width, norm_max, norm_sum, hint);
  const at::Tensor u = uniforms.to(at::kDouble).contiguous();
  auto tokens = at::empty({rows}, ids.options());
  const int64_t w = ids.size(1);
  const bool* ep = exact.data_ptr<bool>();
  const int64_t *ip = ids.data_ptr<int64_t>(), *np = num_kept.data_ptr<int64_t>();
  const double *wp = weights.data_ptr<double>(), *up = u.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    if (!ep[r]) {
      out[r] = -1;
      continue;
    }
    const double* wt = wp + r * w;
    const int64_t kept = np[r];  // the weights past it are 0: they add nothing to the sums
    double total = 0.0;
    for (int64_t j = 0; j < kept; ++j) total += wt[j];
    const double target = std::min(up[r] * total, std::nextafter(total, 0.0));
    double run = 0.0;
    int64_t at = kept - 1;
    for (int64_t j = 0; j < kept; ++j)
      if ((run += wt[j]) > target) {
        at = j;
        break;
      }
    out[r] = ip[r * w + at];
  }
  return tokens;
}

// The vectorized ops (sampling_rows.h) twice: on AVX-512 (sampling_lanes_avx512.h) and on
// AVX2 + FMA (sampling_lanes_avx2.h, Zen 3), whatever -march=native says; both give the same bits.
// The ops registered below call the one the CPU has. On Zen 3 the sampler had kept its torch
// paths: a 32-row float32 step's sampling took 16.2 ms for top-p-only rows and 2.6 ms for
// temperature-only ones, 3.2 and 0.87 ms here (engine_overhead.py, session 36).
// The exp of both lane files (vexp_nonpositive): x = n ln2 + r, ln2 in two parts, e^r by its
// degree-6 Taylor polynomial (highest degree first), e^x = 0 below the clamp.
constexpr float kExpClamp = -110.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187045e-06f;
constexpr float kExpPoly[7] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,fma")
namespace lanes512 {
#include "sampling_lanes_avx512.h"
#include "sampling_rows.h"
}  // namespace lanes512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace lanes256 {
#include "sampling_lanes_avx2.h"
#include "sampling_rows.h"
}  // namespace lanes256
#pragma GCC pop_options

// Whether the AVX-512 lanes run here; without them the AVX2 ones, which need AVX2 and FMA.
// TESSERA_SAMPLING_LANES=avx2 takes the AVX2 ones on an AVX-512 CPU too (the test comparing the two).
bool avx512_lanes(const char* op) {
  static const char* forced = std::getenv("TESSERA_SAMPLING_LANES");
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                             !(forced && std::string_view(forced) == "avx2");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  TORCH_CHECK(avx512 || avx2, op, ": needs a CPU with AVX2 and FMA (or AVX-512)");
  return avx512;
}

at::Tensor sample_softmax(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& uniforms) {
  return avx512_lanes("sample_softmax") ? lanes512::sample_softmax(logits, temperature, uniforms)
                                        : lanes256::sample_softmax(logits, temperature, uniforms);
}

std::tuple<at::Tensor, at::Tensor> softmax_normalizers(const at::Tensor& logits, const at::Tensor& temperature) {
  return avx512_lanes("softmax_normalizers") ? lanes512::softmax_normalizers(logits, temperature)
                                             : lanes256::softmax_normalizers(logits, temperature);
}

at::Tensor sample_top_p(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_p,
                        const at::Tensor& uniforms) {
  return avx512_lanes("sample_top_p") ? lanes512::sample_top_p(logits, temperature, top_p, uniforms)
                                      : lanes256::sample_top_p(logits, temperature, top_p, uniforms);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> top_p_kept(const at::Tensor& logits, const at::Tensor& temperature,
                                                         const at::Tensor& top_p, const at::Tensor& min_p) {
  return avx512_lanes("top_p_kept") ? lanes512::top_p_kept(logits, temperature, top_p, min_p)
                                    : lanes256::top_p_kept(logits, temperature, top_p, min_p);
}

at::Tensor seeded_uniforms(const at::Tensor& keys, const c10::optional<at::Tensor>& ids, int64_t vocab) {
  return avx512_lanes("seeded_uniforms") ? lanes512::seeded_uniforms(keys, ids, vocab)
                                         : lanes256::seeded_uniforms(keys, ids, vocab);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera_inv, m) {
  m.def("head_topk(Tensor x, int width, Tensor? temperature=None) -> (Tensor, Tensor, Tensor)");
  m.def("kept_head(Tensor x, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, int width, "
        "Tensor norm_max, Tensor norm_sum) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("draw_kept_head(Tensor x, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, int width, "
        "Tensor norm_max, Tensor norm_sum, Tensor uniforms, Tensor? maxima16=None) -> Tensor");
  m.def("kept_in_head(Tensor scaled, Tensor ids, Tensor? bound, Tensor temperature, Tensor top_k, Tensor top_p, "
        "Tensor min_p, int vocab, Tensor norm_max, Tensor norm_sum) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("sample_softmax(Tensor logits, Tensor temperature, Tensor uniforms) -> Tensor");
  m.def("softmax_normalizers(Tensor logits, Tensor temperature) -> (Tensor, Tensor)");
  m.def("sample_top_p(Tensor logits, Tensor temperature, Tensor top_p, Tensor uniforms) -> Tensor");
  m.def("seeded_uniforms(Tensor keys, Tensor? ids, int vocab) -> Tensor");
  m.def("top_p_kept(Tensor logits, Tensor temperature, Tensor top_p, Tensor min_p) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tessera_inv, CPU, m) {
  m.impl("head_topk", &head_topk);
  m.impl("kept_head", &kept_head);
  m.impl("draw_kept_head", &draw_kept_head);
  m.impl("kept_in_head", &kept_in_head);
  m.impl("sample_softmax", &sample_softmax);
  m.impl("softmax_normalizers", &softmax_normalizers);
  m.impl("sample_top_p", &sample_top_p);
  m.impl("seeded_uniforms", &seeded_uniforms);
  m.impl("top_p_kept", &top_p_kept);
}
