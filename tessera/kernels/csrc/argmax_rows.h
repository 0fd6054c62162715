// Greedy sampling inside a linear's store epilogue, shared by the bf16 kernel
// (invariant_kernels.cpp: linear_bf16_argmax), the quantized one (invariant_qgemm.cpp:
// qgemm_f32 with argmax, the tied lm_head from a GGUF's Q8_0 blocks) and the int8-activation
// lm_heads (tessera/quant/csrc/gemv_x8.h: q4x8_logits, q8x8_logits): each row's first maximum of
// the logits it stores, so the [rows, vocab] logits are not read again. One header staged into
// the three libraries' builds (tessera/native.py compiles the .cpp sources only).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>
#include <vector>

namespace {

// Each row's first maximum over the values a call stores. A parallel chunk (a contiguous run of
// tasks, columns in increasing order for each row it touches) keeps, per row and per lane of 16,
// the largest value seen and the column it was first seen at (a strict > keeps the first); at its
// end a row's lanes reduce to (max, smallest column holding it), which is the chunk's first
// maximum. Chunks then merge per row in task order, again with a strict >. The result is
// torch.argmax's over the stored values, except that NaN never wins (argmax returns a NaN's index).
struct ArgmaxChunk {
  std::vector<float> value;
  std::vector<int32_t> index;
  std::vector<uint8_t> seen;
  // ArgmaxCollector::chunk sets these: where each stored 16 columns' maximum goes (keep_maxima),
  // and whether the first maxima are tracked at all.
  float* maxima = nullptr;
  int64_t maxima_stride = 0;
  bool ids = true;
  explicit ArgmaxChunk(int64_t m)
      : value(m * 16, -std::numeric_limits<float>::infinity()), index(m * 16, 0), seen(m, 0) {}
  // Empty again, for the next run of tasks.
  void reset() {
    std::fill(value.begin(), value.end(), -std::numeric_limits<float>::infinity());
    std::fill(index.begin(), index.end(), 0);
    std::fill(seen.begin(), seen.end(), 0);
  }
};

struct ArgmaxPartial {
  int64_t begin, row;
  float value;
  int32_t index;
};

class ArgmaxCollector {
 public:
  explicit ArgmaxCollector(int64_t m) : m_(m) {}
  int64_t rows() const { return m_; }

  // Also (or, with ids false, only) each row's maximum of every 16 stored columns into
  // maxima[row * stride + column / 16], NaN where one of them is NaN: the column maxima a sampler's
  // head pass would otherwise read the whole logits for (tessera_inv::linear_bf16_maxima).
  void keep_maxima(float* maxima, int64_t stride, bool ids) {
    maxima_ = maxima;
    stride_ = stride;
    ids_ = ids;
  }
  // A new chunk of this collector's kind (every kernel takes its chunks from here).
  ArgmaxChunk* chunk() const {
    auto* c = new ArgmaxChunk(ids_ ? m_ : 0);
    c->maxima = maxima_;
    c->maxima_stride = stride_;
    c->ids = ids_;
    return c;
  }

  void add(int64_t begin, const ArgmaxChunk& chunk) {
    if (!chunk.ids) return;
    std::vector<ArgmaxPartial> mine;
    for (int64_t r = 0; r < m_; ++r) {
      if (!chunk.seen[r]) continue;
      float best = chunk.value[r * 16];
      int32_t at = chunk.index[r * 16];
      for (int l = 1; l < 16; ++l) {
        const float v = chunk.value[r * 16 + l];
        const int32_t i = chunk.index[r * 16 + l];
        if (v > best || (v == best && i < at)) best = v, at = i;
      }
      mine.push_back({begin, r, best, at});
    }
    std::lock_guard<std::mutex> lock(mu_);
    parts_.insert(parts_.end(), mine.begin(), mine.end());
  }

  void finish(int64_t* out) {
    std::sort(parts_.begin(), parts_.end(), [](const ArgmaxPartial& a, const ArgmaxPartial& b) {
      return a.row != b.row ? a.row < b.row : a.begin < b.begin;
    });
    std::vector<float> best(m_, -std::numeric_limits<float>::infinity());
    std::fill(out, out + m_, 0);
    for (const auto& p : parts_)
      if (p.value > best[p.row]) best[p.row] = p.value, out[p.row] = p.index;
  }

 private:
  int64_t m_;
  float* maxima_ = nullptr;
  int64_t stride_ = 0;
  bool ids_ = true;
  std::mutex mu_;
  std::vector<ArgmaxPartial> parts_;
};

// The same row rounded to bf16, then widened to fp32: exactly the bf16 output's .float(), without
// a second pass over [M, N] (the logits: 32 x 49152 at a decode step).
// With `chunk`, the stored values also update row `row`'s running first maximum (ArgmaxChunk);
// `col` is the first of the n columns. A null `out` stores nothing: the ids alone (a greedy step
// that reads no logits skips writing [rows, vocab] floats: 6 MiB at 32 rows of a 49k vocabulary).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void store_row_bf16_as_f32(const float* c, const float* bias, float* out, int n,
                                  ArgmaxChunk* chunk = nullptr, int64_t row = 0, int64_t col = 0) {
  __mmask16 mask = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  __m512 v = _mm512_loadu_ps(c);
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
  const __m256bh h = _mm512_cvtneps_pbh(v);
  const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h)), 16));
  if (out) _mm512_mask_storeu_ps(out, mask, w);
  if (!chunk) return;
  if (chunk->maxima) {
    const bool nan = _mm512_mask_cmp_ps_mask(mask, w, w, _CMP_UNORD_Q) != 0;
    chunk->maxima[row * chunk->maxima_stride + col / 16] =
        nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_mask_reduce_max_ps(mask, w);
  }
  if (!chunk->ids) return;
  chunk->seen[row] = 1;
  float* best = chunk->value.data() + row * 16;
  const __m512 cur = _mm512_loadu_ps(best);
  const __mmask16 gt = _mm512_mask_cmp_ps_mask(mask, w, cur, _CMP_GT_OQ);  // NaN: never greater
  if (!gt) return;
  _mm512_storeu_ps(best, _mm512_mask_blend_ps(gt, cur, w));
  const __m512i cols = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(col)),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  _mm512_mask_storeu_epi32(chunk->index.data() + row * 16, gt, cols);
}

}  // namespace
