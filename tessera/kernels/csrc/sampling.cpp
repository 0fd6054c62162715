// The sampler's native ops (CPU, float32 logits), each one pass over a row instead of a dozen
// torch ops:
//   * head_topk:      the head of each row for top-k / top-p (tessera.engine.candidates.head_topk)
//   * kept_head:      the kept prefix of that head (tessera.engine.candidates._kept_within)
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
#include <functional>
#include <limits>
#include <utility>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kChunk = 64;

// With `temperature`, each row's taken values come back divided by its temperature (in float32,
// as torch divides) and ordered by (quotient descending, id ascending): the exact order the
// sampler's kept prefix needs (tessera.engine.candidates.head_in_order), which a torch sort of
// int64 keys gave at 0.36 ms of a 32-row step on bf16-rounded logits (ties widen the head).
std::tuple<at::Tensor, at::Tensor, at::Tensor> head_topk(const at::Tensor& x, int64_t width,
                                                         const c10::optional<at::Tensor>& temperature) {
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
      for (int64_t c = 0; c < full; ++c) {
        // 16 independent lanes, so the compiler keeps them in one vector register (a running
        // maximum of a single scalar is a reduction it will not vectorize without fast-math).
        float lane[16];
        for (int l = 0; l < 16; ++l) lane[l] = row[c * kChunk + l];
        for (int64_t i = 16; i < kChunk; i += 16)
          for (int l = 0; l < 16; ++l) lane[l] = row[c * kChunk + i + l] > lane[l] ? row[c * kChunk + i + l] : lane[l];
        float m = lane[0];
        for (int l = 1; l < 16; ++l) m = lane[l] > m ? lane[l] : m;
        maxima[c] = m;
      }
      if (full < num_chunks) {  // the short last chunk
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = full * kChunk; i < vocab; ++i) m = row[i] > m ? row[i] : m;
        maxima[full] = m;
      }
      order = maxima;
      std::nth_element(order.begin(), order.begin() + (width - 1), order.end(), std::greater<float>());
      const float b = order[width - 1];
      bounds[r] = b;
      auto& v = values[r];
      auto& id = ids[r];
      v.reserve(2 * width);
      id.reserve(2 * width);
      for (int64_t c = 0; c < num_chunks; ++c) {
        if (!(maxima[c] >= b)) continue;
        const int64_t lo = c * kChunk, hi = std::min(vocab, lo + kChunk);
        for (int64_t i = lo; i < hi; ++i)
          if (row[i] >= b) {
            v.push_back(row[i]);
            id.push_back(i);
          }
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kept_head(
    const at::Tensor& x, const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const at::Tensor& min_p, int64_t width, const at::Tensor& norm_max, const at::Tensor& norm_sum) {
  auto [scaled, ids, bound] = head_topk(x, width, temperature);
  return kept_in_head(scaled, ids, bound, temperature, top_k, top_p, min_p, x.size(1), norm_max, norm_sum);
}

// sample_softmax: AVX-512 whatever -march=native says (the library also builds on Zen 3, where
// tessera.kernels.fused() is false and the sampler keeps its torch path).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,fma")

constexpr int64_t kSumChunk = 256;  // exps summed in float32 per chunk, the chunks in float64

// e^x for x <= 0, 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor
// polynomial (relative error under 2e-7, a few float32 ulps: the sampled distribution moves by
// less than that), scaled by 2^n with vscalefps, which gives exactly 0 below float32's range.
// -inf (a masked token) is clamped first, so it too gives exactly 0.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-110.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 lanes at a time, a mask for the tail.
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }

// The largest of row[0 .. n) (exact: a maximum rounds nothing).
inline float row_max(const float* row, int64_t n) {
  __m512 vm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = tail_mask(n - i);
    vm = _mm512_mask_max_ps(vm, mask, vm, _mm512_maskz_loadu_ps(mask, row + i));
  }
  return _mm512_reduce_max_ps(vm);
}

// The row's weights exp((x - max) / t) over [lo, hi), 16 at a time (a masked tail).
template <typename F>
inline void for_each_weight(const float* row, int64_t lo, int64_t hi, float mx, float inv_t, F&& f) {
  const __m512 vmax = _mm512_set1_ps(mx), vinv = _mm512_set1_ps(inv_t);
  for (int64_t i = lo; i < hi; i += 16) {
    const __mmask16 mask = tail_mask(hi - i);
    const __m512 x = _mm512_maskz_loadu_ps(mask, row + i);
    const __m512 w = _mm512_maskz_mov_ps(mask, exp_nonpositive(_mm512_mul_ps(_mm512_sub_ps(x, vmax), vinv)));
    f(i, w);
  }
}

// A row's quotients q = x / t (float32, as torch's division rounds them) and weights
// exp(q - top) (top: the max of the quotients), 16 at a time, each block handed to f(i, mask, q, w);
// returns the weights' sum in float64. softmax_normalizers' terms and the nucleus ops' are these.
template <typename F>
inline double for_each_quotient_weight(const float* row, int64_t vocab, float t, float top, F&& f) {
  const __m512 vt = _mm512_set1_ps(t), vtop = _mm512_set1_ps(top);
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  for (int64_t i = 0; i < vocab; i += 16) {
    const __mmask16 mask = tail_mask(vocab - i);
    const __m512 q = _mm512_div_ps(_mm512_maskz_loadu_ps(mask, row + i), vt);
    const __m512 w = _mm512_maskz_mov_ps(mask, exp_nonpositive(_mm512_sub_ps(q, vtop)));
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(w)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1))));
    f(i, mask, q, w);
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
}

// One row's draw: the first token whose float64 cumulative weight exceeds u x the total, always
// one of weight > 0. Chunk sums first (float32 inside a chunk, float64 across), then the chunk
// that holds the target is summed again entry by entry.
int64_t draw_row(const float* row, int64_t vocab, float temperature, double u, std::vector<double>& sums) {
  const float mx = row_max(row, vocab);
  const float inv_t = 1.0f / temperature;
  const int64_t chunks = (vocab + kSumChunk - 1) / kSumChunk;
  sums.assign(chunks, 0.0);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    __m512 acc = _mm512_setzero_ps();
    for_each_weight(row, c * kSumChunk, std::min(vocab, (c + 1) * kSumChunk), mx, inv_t,
                    [&](int64_t, __m512 w) { acc = _mm512_add_ps(acc, w); });
    sums[c] = _mm512_reduce_add_ps(acc);
    total += sums[c];
  }
  double target = std::min(u * total, std::nextafter(total, 0.0));
  int64_t c = 0;
  while (c + 1 < chunks && (target >= sums[c] || sums[c] == 0.0)) target -= sums[c++];
  int64_t last_positive = -1;
  double run = 0.0;
  int64_t found = -1;
  alignas(64) float w16[16];
  for_each_weight(row, c * kSumChunk, std::min(vocab, (c + 1) * kSumChunk), mx, inv_t, [&](int64_t i, __m512 w) {
    if (found >= 0) return;
    _mm512_store_ps(w16, w);
    for (int l = 0; l < 16 && i + l < vocab; ++l) {
      if (w16[l] <= 0.0f) continue;
      last_positive = i + l;
      run += w16[l];
      if (run > target) { found = i + l; return; }
    }
  });
  // The chunk's entry-by-entry sum can round below its float32 sum: then its last weighted entry.
  return found >= 0 ? found : last_positive;
}

at::Tensor sample_softmax(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "sample_softmax: logits must be 2-D float32");
  const at::Tensor x = logits.contiguous();
  const at::Tensor t = temperature.to(at::kFloat).contiguous();
  const at::Tensor u = uniforms.to(at::kDouble).contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(t.numel() == rows && u.numel() == rows, "sample_softmax: one temperature and one uniform per row");
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  const float* tp = t.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> sums;
    for (int64_t r = begin; r < end; ++r) op[r] = draw_row(xp + r * vocab, vocab, tp[r], up[r], sums);
  });
  return out;
}

// softmax_normalizers: per row the max of x / t and the sum of exp(x / t - max), as
// tessera.engine.candidates._row_normalizers defines them (float32 quotients, as torch's
// division rounds them; the max of the rounded quotients), the exps summed in float64: each
// term within 3e-7 of its float64 exp, so the sum is too (the torch version's bound is 5e-7).
std::tuple<at::Tensor, at::Tensor> softmax_normalizers(const at::Tensor& logits, const at::Tensor& temperature) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "softmax_normalizers: logits must be 2-D float32");
  const at::Tensor x = logits.contiguous();
  const at::Tensor t = temperature.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(t.numel() == rows, "softmax_normalizers: one temperature per row");
  auto maxima = at::empty({rows}, x.options().dtype(at::kDouble));
  auto sums = at::empty({rows}, x.options().dtype(at::kDouble));
  const float* xp = x.data_ptr<float>();
  const float* tp = t.data_ptr<float>();
  double* mp = maxima.data_ptr<double>();
  double* sp = sums.data_ptr<double>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * vocab;
      const float top = row_max(row, vocab) / tp[r];  // = the max of the quotients: division is monotone
      mp[r] = top;
      sp[r] = for_each_quotient_weight(row, vocab, tp[r], top, [](int64_t, __mmask16, __m512, __m512) {});
    }
  });
  return {maxima, sums};
}

// sample_top_p: one token per row from the nucleus of softmax(logits / temperature), as
// kept_prefix + draw_from_prefix give it for a top-p-only row (no top-k, no min-p), without
// ordering the row: the nucleus is the shortest prefix, in (quotient descending, id ascending)
// order, whose mass before a token stays under top_p - 1e-6 (the first token always), and the
// token drawn is the first of that prefix whose cumulative mass exceeds u x the prefix's mass.
// Both are quantiles of the ordered row, so a histogram finds them: the quotients' distance below
// the row's maximum in buckets of 1/64 nat (a bucket's tokens all come after those of the bucket
// before it), each bucket's float64 mass, then only the one bucket the quantile falls in is
// sorted. The exps are softmax_normalizers' float32 terms (each within 3e-7 of float64's), as the
// nucleus of a top-p-only row was already measured against their sum. The fetch-and-widen path
// of kept_prefix sorted ever wider heads: a flat row (a 0.95 nucleus of thousands of tokens, as
// random or uncertain text gives) cost 14-18 ms of a 32-row step there.
constexpr int kNucleusBucketsPerNat = 64;
constexpr int kNucleusBuckets = kNucleusBucketsPerNat * 32;  // 32 nats; the rest share the last bucket
// Distances below the maximum (nats) whose masses the first pass sums: the histogram then only
// takes the tokens above the first of them that holds the nucleus (a few hundred in a model's
// row, where a whole-row histogram cost ~150 us a row: a scalar scatter into memory).
constexpr int kNucleusCuts = 6;
constexpr float kNucleusCut[kNucleusCuts] = {0.5f, 1.0f, 2.0f, 4.0f, 8.0f, 16.0f};

struct NucleusMember {
  float q;     // the quotient x / t
  int64_t id;
  float w;     // exp(q - max)
};

// One thread's buffers: the row's quotients and weights (from the first pass), the histogram,
// the sorted members of the nucleus' edge bucket and of the bucket the draw falls in.
struct NucleusScratch {
  std::vector<float> q, w;
  std::vector<double> mass;
  std::vector<NucleusMember> edge, drawn;
};

inline __m512i nucleus_bucket(__m512 d) {
  // min returns its second operand for a NaN: such a token lands in the last bucket.
  return _mm512_cvttps_epi32(
      _mm512_min_ps(_mm512_mul_ps(d, _mm512_set1_ps(kNucleusBucketsPerNat)), _mm512_set1_ps(kNucleusBuckets - 1)));
}

// The row's tokens in bucket `b`, in (quotient descending, id ascending) order.
void bucket_members(const NucleusScratch& s, int64_t vocab, float top, int b, std::vector<NucleusMember>& out) {
  out.clear();
  const __m512 vtop = _mm512_set1_ps(top);
  for (int64_t i = 0; i < vocab; i += 16) {
    const __mmask16 mask = tail_mask(vocab - i);
    const __m512 q = _mm512_maskz_loadu_ps(mask, s.q.data() + i);
    for (__mmask16 in = _mm512_mask_cmpeq_epi32_mask(mask, nucleus_bucket(_mm512_sub_ps(vtop, q)), _mm512_set1_epi32(b));
         in; in &= in - 1) {
      const int64_t j = i + __builtin_ctz(in);
      out.push_back({s.q[j], j, s.w[j]});
    }
  }
  std::sort(out.begin(), out.end(), [](const NucleusMember& x, const NucleusMember& y) {
    return x.q > y.q || (x.q == y.q && x.id < y.id);
  });
}

// The float64 masses of the buckets of the tokens less than `cut` nats below the maximum.
void nucleus_histogram(NucleusScratch& s, int64_t vocab, float top, float cut) {
  s.mass.assign(kNucleusBuckets, 0.0);
  const __m512 vtop = _mm512_set1_ps(top), vcut = _mm512_set1_ps(cut);
  alignas(64) int32_t b16[16];
  for (int64_t i = 0; i < vocab; i += 16) {
    const __mmask16 mask = tail_mask(vocab - i);
    const __m512 d = _mm512_sub_ps(vtop, _mm512_maskz_loadu_ps(mask, s.q.data() + i));
    const __m512 w = _mm512_maskz_loadu_ps(mask, s.w.data() + i);
    __mmask16 in = _mm512_mask_cmp_ps_mask(mask, d, vcut, _CMP_LT_OQ) &
                   _mm512_cmp_ps_mask(w, _mm512_setzero_ps(), _CMP_GT_OQ);
    if (!in) continue;
    _mm512_store_si512(b16, nucleus_bucket(d));
    for (; in; in &= in - 1) {
      const int l = __builtin_ctz(in);
      s.mass[b16[l]] += s.w[i + l];
    }
  }
}

// The first bucket whose end reaches `threshold` (its start's mass in `before`), or -1.
int nucleus_edge(const std::vector<double>& mass, double threshold, double& before) {
  before = 0.0;
  for (int b = 0; b < kNucleusBuckets; ++b) {
    if (before + mass[b] >= threshold) return b;
    before += mass[b];
  }
  return -1;
}

// A top-p-only row's nucleus: every bucket before `edge_bucket` is inside it, every one after it
// outside, and of the edge bucket's members (s.edge, sorted) the first `kept`; `before` is the mass
// of the buckets before the edge. s.q / s.w hold the row's quotients and weights.
struct Nucleus {
  float top;
  int edge_bucket;
  double before;
  size_t kept;
};

Nucleus find_nucleus(const float* row, int64_t vocab, float t, float top_p, NucleusScratch& s) {
  const float top = row_max(row, vocab) / t;  // the max of the quotients: division is monotone
  const __m512 vtop = _mm512_set1_ps(top);
  s.q.resize(vocab);
  s.w.resize(vocab);
  __m512 near[kNucleusCuts];
  for (auto& n : near) n = _mm512_setzero_ps();
  const double total = for_each_quotient_weight(row, vocab, t, top, [&](int64_t i, __mmask16 mask, __m512 q, __m512 w) {
    _mm512_mask_storeu_ps(s.q.data() + i, mask, q);
    _mm512_mask_storeu_ps(s.w.data() + i, mask, w);
    const __m512 d = _mm512_sub_ps(vtop, q);
    for (int c = 0; c < kNucleusCuts; ++c)
      near[c] = _mm512_mask_add_ps(near[c], _mm512_cmp_ps_mask(d, _mm512_set1_ps(kNucleusCut[c]), _CMP_LT_OQ), near[c], w);
  });
  const double threshold = static_cast<double>(top_p - 1e-6f) * total;  // kept_head's rounding of p - 1e-6
  // The nearest cut whose (float32-summed, so 1% short of it to be sure) mass reaches the
  // threshold; if rounding still leaves the histogram short of it, every token is taken.
  float cut = std::numeric_limits<float>::infinity();
  for (int c = 0; c < kNucleusCuts; ++c)
    if (0.99 * _mm512_reduce_add_ps(near[c]) >= threshold) {
      cut = kNucleusCut[c];
      break;
    }
  Nucleus n{top, 0, 0.0, 0};
  nucleus_histogram(s, vocab, top, cut);
  n.edge_bucket = nucleus_edge(s.mass, threshold, n.before);
  if (n.edge_bucket < 0 && cut != std::numeric_limits<float>::infinity()) {
    nucleus_histogram(s, vocab, top, std::numeric_limits<float>::infinity());
    n.edge_bucket = nucleus_edge(s.mass, threshold, n.before);
  }
  if (n.edge_bucket < 0) n.edge_bucket = kNucleusBuckets - 1;  // p within rounding of 1: every weighted token
  bucket_members(s, vocab, top, n.edge_bucket, s.edge);
  double run = n.before;
  while (n.kept < s.edge.size() && run < threshold) run += s.edge[n.kept++].w;
  if (n.edge_bucket == 0 && n.kept == 0 && !s.edge.empty()) n.kept = 1;  // the most likely token always survives
  return n;
}

int64_t nucleus_draw_row(const float* row, int64_t vocab, float t, float top_p, double u, NucleusScratch& s) {
  const Nucleus n = find_nucleus(row, vocab, t, top_p, s);
  double edge_mass = 0.0;
  for (size_t k = 0; k < n.kept; ++k) edge_mass += s.edge[k].w;
  const double nucleus = n.before + edge_mass;
  const double target = std::min(u * nucleus, std::nextafter(nucleus, 0.0));
  // The bucket holding the draw, then the token inside it.
  double at = 0.0;
  int b = 0;
  for (; b < n.edge_bucket; ++b) {
    if (at + s.mass[b] > target) break;
    at += s.mass[b];
  }
  const std::vector<NucleusMember>* members = &s.edge;
  size_t count = n.kept;
  if (b < n.edge_bucket) {
    bucket_members(s, vocab, n.top, b, s.drawn);
    members = &s.drawn;
    count = s.drawn.size();
  }
  int64_t last_positive = -1;
  for (size_t k = 0; k < count; ++k) {
    const NucleusMember& m = (*members)[k];
    if (m.w <= 0.0f) continue;
    last_positive = m.id;
    at += m.w;
    if (at > target) return m.id;
  }
  // The bucket's entry-by-entry sum can round below its bucket sum: then its last weighted token.
  return last_positive >= 0 ? last_positive : (s.edge.empty() ? 0 : s.edge.front().id);
}

at::Tensor sample_top_p(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_p,
                        const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "sample_top_p: logits must be 2-D float32");
  const at::Tensor x = logits.contiguous();
  const at::Tensor t = temperature.to(at::kFloat).contiguous(), p = top_p.to(at::kFloat).contiguous();
  const at::Tensor u = uniforms.to(at::kDouble).contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(t.numel() == rows && p.numel() == rows && u.numel() == rows,
              "sample_top_p: one temperature, top_p and uniform per row");
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float *xp = x.data_ptr<float>(), *tp = t.data_ptr<float>(), *pp = p.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    NucleusScratch scratch;
    for (int64_t r = begin; r < end; ++r) op[r] = nucleus_draw_row(xp + r * vocab, vocab, tp[r], pp[r], up[r], scratch);
  });
  return out;
}

// top_p_kept: a top-p-only row's kept tokens in id order, with their weights exp(q - max) (the
// float32 terms the nucleus was measured with, widened), after min-p: the tokens of the nucleus
// at most -log(min_p) nats below the maximum (p >= min_p * p_max, a prefix of the order too).
// For the rows sample_top_p cannot draw: seeded ones (their race needs the kept set, not an
// order) and min-p. Returns (ids [R, W] long, weights [R, W] float64, num_kept [R] long), padded
// to the widest row (id 0, weight 0).
std::tuple<at::Tensor, at::Tensor, at::Tensor> top_p_kept(const at::Tensor& logits, const at::Tensor& temperature,
                                                         const at::Tensor& top_p, const at::Tensor& min_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "top_p_kept: logits must be 2-D float32");
  const at::Tensor x = logits.contiguous();
  const at::Tensor t = temperature.to(at::kFloat).contiguous(), p = top_p.to(at::kFloat).contiguous();
  const at::Tensor mp = min_p.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(t.numel() == rows && p.numel() == rows && mp.numel() == rows,
              "top_p_kept: one temperature, top_p and min_p per row");
  const float *xp = x.data_ptr<float>(), *tp = t.data_ptr<float>(), *pp = p.data_ptr<float>();
  const float* mpp = mp.data_ptr<float>();
  std::vector<std::vector<int64_t>> ids(rows);
  std::vector<std::vector<float>> weights(rows);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    NucleusScratch s;
    for (int64_t r = begin; r < end; ++r) {
      const Nucleus n = find_nucleus(xp + r * vocab, vocab, tp[r], pp[r], s);
      // The edge bucket's last kept member, in the order: a member is kept when it is not after it.
      const bool edge_kept = n.kept > 0;
      const float q_last = edge_kept ? s.edge[n.kept - 1].q : 0.0f;
      const int64_t id_last = edge_kept ? s.edge[n.kept - 1].id : -1;
      const float d_max = mpp[r] > 0.0f ? -std::log(mpp[r]) : std::numeric_limits<float>::infinity();
      const __m512 vtop = _mm512_set1_ps(n.top);
      auto& out_ids = ids[r];
      auto& out_w = weights[r];
      for (int64_t i = 0; i < vocab; i += 16) {
        const __mmask16 mask = tail_mask(vocab - i);
        const __m512 d = _mm512_sub_ps(vtop, _mm512_maskz_loadu_ps(mask, s.q.data() + i));
        const __m512i bucket = nucleus_bucket(d);
        __mmask16 in = _mm512_mask_cmp_epi32_mask(mask, bucket, _mm512_set1_epi32(n.edge_bucket), _MM_CMPINT_LE) &
                       _mm512_cmp_ps_mask(d, _mm512_set1_ps(d_max), _CMP_LE_OQ);
        const __mmask16 at_edge = _mm512_cmpeq_epi32_mask(bucket, _mm512_set1_epi32(n.edge_bucket));
        for (; in; in &= in - 1) {
          const int l = __builtin_ctz(in);
          const int64_t j = i + l;
          const float q = s.q[j];
          if (((at_edge >> l) & 1) && !(edge_kept && (q > q_last || (q == q_last && j <= id_last))))
            continue;  // in the edge bucket, after its last kept member
          out_ids.push_back(j);
          out_w.push_back(s.w[j]);
        }
      }
      if (out_ids.empty()) {  // min-p below every nucleus token cannot happen (d = 0 for the top); NaN rows
        out_ids.push_back(s.edge.empty() ? 0 : s.edge.front().id);
        out_w.push_back(1.0f);
      }
    }
  });
  int64_t width = 1;
  for (const auto& v : ids) width = std::max<int64_t>(width, static_cast<int64_t>(v.size()));
  auto out_ids = at::zeros({rows, width}, x.options().dtype(at::kLong));
  auto out_w = at::zeros({rows, width}, x.options().dtype(at::kDouble));
  auto num_kept = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t *oi = out_ids.data_ptr<int64_t>(), *nk = num_kept.data_ptr<int64_t>();
  double* ow = out_w.data_ptr<double>();
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(ids[r].begin(), ids[r].end(), oi + r * width);
    std::copy(weights[r].begin(), weights[r].end(), ow + r * width);
    nk[r] = static_cast<int64_t>(ids[r].size());
  }
  return {out_ids, out_w, num_kept};
}

// seeded_uniforms: tessera.engine.sampler.seeded_noise's uniforms, u = (23 bits of
// mix(mix(t ^ k0) ^ k1) + 0.5) / 2^23 for token t of a row keyed (k0, k1), in exact uint32
// arithmetic (the torch version's int64 ops masked to 32 bits: the same values), 16 tokens at a
// time. ids [R, W] (the tokens to hash per row), or none: every token 0 .. vocab - 1. The torch
// version streams ~20 int64 ops over [R, vocab]: 10 ms of a 32-row seeded step.
inline __m512i mix32(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x5BD1E995));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// 16 token ids (int64, each < 2^31) as 16 int32 lanes.
inline __m512i load_ids32(const int64_t* p, __mmask16 mask) {
  const __m256i lo = _mm512_cvtepi64_epi32(_mm512_maskz_loadu_epi64(static_cast<__mmask8>(mask), p));
  const __m256i hi = _mm512_cvtepi64_epi32(_mm512_maskz_loadu_epi64(static_cast<__mmask8>(mask >> 8), p + 8));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

at::Tensor seeded_uniforms(const at::Tensor& keys, const c10::optional<at::Tensor>& ids, int64_t vocab) {
  TORCH_CHECK(keys.dim() == 2 && keys.size(1) == 2, "seeded_uniforms: keys must be [R, 2]");
  const at::Tensor k = keys.to(at::kLong).contiguous();
  const int64_t rows = k.size(0);
  at::Tensor t;
  if (ids.has_value() && ids->defined()) {
    t = ids->to(at::kLong).contiguous();
    TORCH_CHECK(t.dim() == 2 && t.size(0) == rows, "seeded_uniforms: ids must be [R, W]");
  }
  const int64_t width = t.defined() ? t.size(1) : vocab;
  auto out = at::empty({rows, width}, k.options().dtype(at::kFloat));
  const int64_t* kp = k.data_ptr<int64_t>();
  const int64_t* tp = t.defined() ? t.data_ptr<int64_t>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const __m512i k0 = _mm512_set1_epi32(static_cast<int32_t>(kp[2 * r])), k1 = _mm512_set1_epi32(static_cast<int32_t>(kp[2 * r + 1]));
      const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      for (int64_t i = 0; i < width; i += 16) {
        const __mmask16 mask = tail_mask(width - i);
        const __m512i token = tp ? load_ids32(tp + r * width + i, mask)
                                 : _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(i)), lane);
        const __m512i bits = _mm512_srli_epi32(mix32(_mm512_xor_si512(mix32(_mm512_xor_si512(token, k0)), k1)), 9);
        // 23 bits, + 0.5, / 2^23: each step exact in float32, so u < 1.
        const __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(bits), _mm512_set1_ps(0.5f)),
                                       _mm512_set1_ps(1.0f / (1 << 23)));
        _mm512_mask_storeu_ps(op + r * width + i, mask, u);
      }
    }
  });
  return out;
}

#pragma GCC pop_options

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera_inv, m) {
  m.def("head_topk(Tensor x, int width, Tensor? temperature=None) -> (Tensor, Tensor, Tensor)");
  m.def("kept_head(Tensor x, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, int width, "
        "Tensor norm_max, Tensor norm_sum) -> (Tensor, Tensor, Tensor, Tensor)");
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
  m.impl("kept_in_head", &kept_in_head);
  m.impl("sample_softmax", &sample_softmax);
  m.impl("softmax_normalizers", &softmax_normalizers);
  m.impl("sample_top_p", &sample_top_p);
  m.impl("seeded_uniforms", &seeded_uniforms);
  m.impl("top_p_kept", &top_p_kept);
}
