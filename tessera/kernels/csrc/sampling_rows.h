// sampling.cpp's vectorized ops, written once on 16-lane operations (VF, VI, VM, VD and the v*
// functions): sampling.cpp includes this file twice, inside the AVX-512 target region after
// sampling_lanes_avx512.h and inside the AVX2 + FMA region after sampling_lanes_avx2.h, each time
// in a namespace of its own, and calls the one the CPU has. The two lane files give every lane
// the same IEEE operations and every sum the same tree, so a row draws the same token on both.
// (No include guard and no #include: it is meant to be included twice, as above.)

constexpr int64_t kSumChunk = 256;  // exps summed in float32 per chunk, the chunks in float64

// The largest of row[0 .. n) (exact: a maximum rounds nothing).
inline float row_max(const float* row, int64_t n) {
  VF vm = vset1(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const VM mask = tail_mask(n - i);
    vm = vmask_max(vm, mask, vload(mask, row + i));
  }
  return vreduce_max(vm);
}

// The row's weights exp((x - max) / t) over [lo, hi), 16 at a time (a masked tail).
template <typename F>
inline void for_each_weight(const float* row, int64_t lo, int64_t hi, float mx, float inv_t, F&& f) {
  const VF vmax = vset1(mx), vinv = vset1(inv_t);
  for (int64_t i = lo; i < hi; i += 16) {
    const VM mask = tail_mask(hi - i);
    const VF x = vload(mask, row + i);
    f(i, vkeep(mask, vexp_nonpositive(vmul(vsub(x, vmax), vinv))));
  }
}

// A row's quotients q = x / t (float32, as torch's division rounds them) and weights
// exp(q - top) (top: the max of the quotients), 16 at a time, each block handed to f(i, mask, q, w);
// returns the weights' sum in float64. softmax_normalizers' terms and the nucleus ops' are these.
template <typename F>
inline double for_each_quotient_weight(const float* row, int64_t vocab, float t, float top, F&& f) {
  const VF vt = vset1(t), vtop = vset1(top);
  VD sum = vd_zero();
  for (int64_t i = 0; i < vocab; i += 16) {
    const VM mask = tail_mask(vocab - i);
    const VF q = vdiv(vload(mask, row + i), vt);
    const VF w = vkeep(mask, vexp_nonpositive(vsub(q, vtop)));
    vd_add(sum, w);
    f(i, mask, q, w);
  }
  return vd_sum(sum);
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
    VF acc = vzero();
    for_each_weight(row, c * kSumChunk, std::min(vocab, (c + 1) * kSumChunk), mx, inv_t,
                    [&](int64_t, VF w) { acc = vadd(acc, w); });
    sums[c] = vreduce_add(acc);
    total += sums[c];
  }
  double target = std::min(u * total, std::nextafter(total, 0.0));
  int64_t c = 0;
  while (c + 1 < chunks && (target >= sums[c] || sums[c] == 0.0)) target -= sums[c++];
  int64_t last_positive = -1;
  double run = 0.0;
  int64_t found = -1;
  alignas(64) float w16[16];
  for_each_weight(row, c * kSumChunk, std::min(vocab, (c + 1) * kSumChunk), mx, inv_t, [&](int64_t i, VF w) {
    if (found >= 0) return;
    vstore16(w16, w);
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
      sp[r] = for_each_quotient_weight(row, vocab, tp[r], top, [](int64_t, VM, VF, VF) {});
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

inline VI nucleus_bucket(VF d) { return vbucket(d, kNucleusBucketsPerNat, kNucleusBuckets - 1); }

// The row's tokens in bucket `b`, in (quotient descending, id ascending) order.
void bucket_members(const NucleusScratch& s, int64_t vocab, float top, int b, std::vector<NucleusMember>& out) {
  out.clear();
  const VF vtop = vset1(top);
  for (int64_t i = 0; i < vocab; i += 16) {
    const VM mask = tail_mask(vocab - i);
    const VF q = vload(mask, s.q.data() + i);
    for (VM in = mask & vieq(nucleus_bucket(vsub(vtop, q)), b); in; in &= in - 1) {
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
  const VF vtop = vset1(top), vcut = vset1(cut);
  alignas(64) int32_t b16[16];
  for (int64_t i = 0; i < vocab; i += 16) {
    const VM mask = tail_mask(vocab - i);
    const VF d = vsub(vtop, vload(mask, s.q.data() + i));
    const VF w = vload(mask, s.w.data() + i);
    VM in = mask & vlt(d, vcut) & vgt(w, vzero());
    if (!in) continue;
    vstore_i16(b16, nucleus_bucket(d));
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
  const VF vtop = vset1(top);
  s.q.resize(vocab);
  s.w.resize(vocab);
  VF near[kNucleusCuts];
  for (auto& n : near) n = vzero();
  const double total = for_each_quotient_weight(row, vocab, t, top, [&](int64_t i, VM mask, VF q, VF w) {
    vstore(s.q.data() + i, mask, q);
    vstore(s.w.data() + i, mask, w);
    const VF d = vsub(vtop, q);
    for (int c = 0; c < kNucleusCuts; ++c) near[c] = vmask_add(near[c], vlt(d, vset1(kNucleusCut[c])), w);
  });
  const double threshold = static_cast<double>(top_p - 1e-6f) * total;  // kept_head's rounding of p - 1e-6
  // The nearest cut whose (float32-summed, so 1% short of it to be sure) mass reaches the
  // threshold; if rounding still leaves the histogram short of it, every token is taken.
  float cut = std::numeric_limits<float>::infinity();
  for (int c = 0; c < kNucleusCuts; ++c)
    if (0.99 * vreduce_add(near[c]) >= threshold) {
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
      const VF vtop = vset1(n.top), vd_max = vset1(d_max);
      auto& out_ids = ids[r];
      auto& out_w = weights[r];
      for (int64_t i = 0; i < vocab; i += 16) {
        const VM mask = tail_mask(vocab - i);
        const VF d = vsub(vtop, vload(mask, s.q.data() + i));
        const VI bucket = nucleus_bucket(d);
        VM in = mask & vile(bucket, n.edge_bucket) & vle(d, vd_max);
        const VM at_edge = vieq(bucket, n.edge_bucket);
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
inline VI mix32(VI x) {
  x = vi_xor(x, vi_srl(x, 16));
  x = vi_mul(x, 0x7FEB352D);
  x = vi_xor(x, vi_srl(x, 15));
  x = vi_mul(x, 0x5BD1E995);
  return vi_xor(x, vi_srl(x, 16));
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
      const VI k0 = vi_set1(static_cast<int32_t>(kp[2 * r])), k1 = vi_set1(static_cast<int32_t>(kp[2 * r + 1]));
      for (int64_t i = 0; i < width; i += 16) {
        const VM mask = tail_mask(width - i);
        const VI token = tp ? vi_ids(tp + r * width + i, mask) : vi_iota(static_cast<int32_t>(i));
        const VI bits = vi_srl(mix32(vi_xor(mix32(vi_xor(token, k0)), k1)), 9);
        // 23 bits, + 0.5, / 2^23: each step exact in float32, so u < 1.
        const VF u = vmul(vadd(vi_to_float(bits), vset1(0.5f)), vset1(1.0f / (1 << 23)));
        vstore(op + r * width + i, mask, u);
      }
    }
  });
  return out;
}
