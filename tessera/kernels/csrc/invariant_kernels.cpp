// Batch-invariant CPU kernels: a linear layer and paged attention whose result for one row
// (token) never depends on how many other rows run with it.
//
// Why: oneDNN/MKL pick their GEMM kernel and its blocking from the shape, so a token's hidden
// state rounds differently in a batch of 1, 17 or 512 rows; in bf16 that flips greedy tokens
// (a prefix-cache hit answered differently from a miss). Here every output element is reduced
// in one fixed order whatever M is:
//   * linear_bf16: bf16 x bf16 -> fp32, one of two arithmetics per machine: AMX tiles where the
//                  CPU has them (K walked in 32-wide steps in order, a tile row of C depends only
//                  on the same row of A), else AVX-512 BF16 dot products (Zen 4/5: one VDPBF16PS
//                  chain per output over the K pairs in order). The two round differently, so a
//                  machine always takes the same one; tests run both where they can.
//   * linear_f32:  fp32 FMA chains over K in order, vectorized across output columns (register
//                  tiles on AVX2 without AVX-512: f32_gemm_avx2.cpp); weight in 64-column panels.
//   * linear_bf16_argmax: linear_bf16's fp32 output (the logits) and each row's first maximum,
//                  found in the store epilogue while the values are in registers: greedy
//                  sampling without a second pass over [M, vocab] (1.2 ms of a 32-row decode
//                  step re-read 6.3 MB of logits that had just left the caches).
//   * linear_bf16_silu: a gate_up linear with silu(gate) * up in its store epilogue (AMX), the
//                  bits of silu_mul(linear_bf16(...)) without the [M, 2 x inter] output.
// paged_attention (the same op library) lives in paged_attention.cpp.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "argmax_rows.h"
#include "avx2_kernels.h"
#include "silu_rows.h"

namespace {

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

bool amx_permitted() {
  // Linux hands out AMX tile state only on request, once per process.
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

// AVX-512 BF16 code generation whatever -march=native says (the library also builds on Zen 3);
// linear_bf16 takes this path only where the CPU has AVX-512 BF16. The AMX section below calls
// the row stores too (its target is a superset, so they inline there).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

inline void store_row_bf16(
    const float* c, const float* bias, at::BFloat16* out, int n) {
  // n <= 16 columns of one C tile row, plus bias, rounded to bf16 (nearest even).
  __mmask16 mask = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  __m512 v = _mm512_loadu_ps(c);
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
  __m256bh h = _mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(reinterpret_cast<void*>(out), mask, reinterpret_cast<__m256i&>(h));
}

// One register tile of the AVX-512 kernel: R rows x C 16-column blocks, every output its own
// VDPBF16PS chain over the K pairs 0, 1, ... in order, from zero. Nothing a lane computes depends
// on R, C or where the tile sits, so a row's result is the same in any batch; the tile shape only
// decides how many loads each multiply shares (C weight vectors per pair, one broadcast per row).
// Never inlined: inside avx512_gemm's loops GCC spilled the short tail tile's accumulators (the
// 2-row tile of a 32-row linear took twice as long there, 8% of the linear).
// With Prefetch, also the pf_lines cache lines from pf (weights the thread reads next) into L2,
// spread evenly over the K pairs: see avx512_gemm.
template <int R, int C, bool Prefetch>
__attribute__((noinline)) void dp_tile(const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t b_block, int64_t pairs,
             const float* bias, at::BFloat16* out, float* out_f32, int64_t ldo, int64_t cols,
             ArgmaxChunk* chunk, int64_t row0, int64_t col0, const char* pf, int64_t pf_lines) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t pf_per_pair = Prefetch ? (pf_lines + pairs - 1) / pairs : 0;
  for (int64_t p = 0; p < pairs; ++p) {
    if constexpr (Prefetch) {
      const char* line = pf + p * pf_per_pair * 64;
      for (int64_t q = 0; q < pf_per_pair; ++q) _mm_prefetch(line + q * 64, _MM_HINT_T1);
    }
    __m512bh w[C];
    for (int c = 0; c < C; ++c)
      w[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + c * b_block + p * 32));
    for (int r = 0; r < R; ++r) {
      int32_t pairbits;  // the row's K pair as one 32-bit lane (memcpy: a broadcast load, no aliasing)
      std::memcpy(&pairbits, a + r * lda + 2 * p, 4);
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pairbits));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, w[c]);
    }
  }
  alignas(64) float row[16];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C && c * 16 < cols; ++c) {
      const int n = static_cast<int>(std::min<int64_t>(16, cols - c * 16));
      _mm512_store_ps(row, acc[r][c]);
      if (out_f32 || chunk)  // logits (out_f32 null: the ids only)
        store_row_bf16_as_f32(row, bias ? bias + c * 16 : nullptr, out_f32 ? out_f32 + r * ldo + c * 16 : nullptr, n,
                              chunk, row0 + r, col0 + c * 16);
      else
        store_row_bf16(row, bias ? bias + c * 16 : nullptr, out + r * ldo + c * 16, n);
    }
}

template <int C>
void dp_rows(int rows, const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t b_block, int64_t pairs,
             const float* bias, at::BFloat16* out, float* out_f32, int64_t ldo, int64_t cols,
             ArgmaxChunk* chunk, int64_t row0, int64_t col0, const char* pf, int64_t pf_lines) {
#define TESSERA_DP_TILE(R)                                                                                  \
  (pf_lines > 0 ? dp_tile<R, C, true> : dp_tile<R, C, false>)(a, lda, b, b_block, pairs, bias, out, out_f32, ldo, \
                                                               cols, chunk, row0, col0, pf, pf_lines)
  switch (rows) {
    case 6: TESSERA_DP_TILE(6); break;
    case 5: TESSERA_DP_TILE(5); break;
    case 4: TESSERA_DP_TILE(4); break;
    case 3: TESSERA_DP_TILE(3); break;
    case 2: TESSERA_DP_TILE(2); break;
    default: TESSERA_DP_TILE(1); break;
  }
#undef TESSERA_DP_TILE
}

constexpr int kTileRows = 6, kTileBlocks = 4, kTaskRows = 96;  // 24 accumulators + 4 weight vectors
// Calls of at most this many rows (decode steps) take one 16-column block at a time, not
// kTileBlocks: a block's weights are one run of memory, and four read at once were four streams a
// thread in a call bound by the memory. AMD EPYC Zen 4 (model 17), the default model's bf16 step
// from its bf16 weights (TESSERA_GGUF_CODES=0), the two alternating in one process, ms: 1 sequence
// 7.50-7.83 -> 6.84-7.04, 4 9.76-10.21 -> 9.45-9.78, 8 13.7-14.6 -> 13.3-13.4; 2 the same within
// noise. Each output's chain over K is the same either way: the same bits.
constexpr int64_t kOneBlockRows = 8;
// Row tasks of at most this many tiles (48 rows) prefetch the next weights (avx512_gemm). More
// rows gain nothing: a 64-row step no faster, 256 rows 1-5% slower (Zen 4, model 17).
constexpr int64_t kPrefetchTiles = 8;

// How avx512_gemm splits C over `threads`: `row_shares` x `col_shares` parts of equal size (to a
// 6-row tile and a 16-column block), the split with the smallest largest part, fewest row shares
// on a tie (each row share reads the weights again). On 2 threads every linear of the default
// model is split by columns: 18 / 18 blocks of a 576-column one, at 1, 32 or 256 rows.
struct GemmSplit {
  int64_t row_shares, col_shares, tiles_per_share;
};

GemmSplit split_gemm(int64_t m, int64_t blocks, int64_t threads, int64_t tile_rows) {
  const int64_t tiles = (m + tile_rows - 1) / tile_rows;
  GemmSplit best{1, std::max<int64_t>(1, std::min(threads, blocks)), tiles};
  int64_t best_cost = -1;
  for (int64_t r = 1; r <= std::min(threads, tiles); ++r) {
    const int64_t c = std::max<int64_t>(1, std::min(threads / r, blocks));
    const int64_t per = (tiles + r - 1) / r, cost = per * ((blocks + c - 1) / c);
    if (best_cost < 0 || cost < best_cost) best = {r, c, per}, best_cost = cost;
  }
  return best;
}

// C[M, N] = A[M, K] x B (the AMX kernel's VNNI packing: for 16 columns and a K pair, one zmm).
// Each thread takes one part of split_gemm (a run of rows x a run of 16-column blocks) and walks
// it in tasks of 4 blocks x 96 rows; inside, 6-row tiles stream the task's weights from L2 (the
// first tile from memory), each over all of K. Parts of equal size, because tasks of unequal cost
// dealt out by count left a thread idle: (96-row task) x (4 blocks) tasks went 13 / 14, 22 / 23
// and 72 / 72 to 2 threads at a 256-token prefill, and the thread holding the short last row
// task waited 8-22% of each linear (libgomp's barrier took 13% of a prefill's samples); at 32
// rows the 9 tasks of a 576-column linear went 4 / 5.
void avx512_gemm(const at::BFloat16* a, int64_t lda, const at::BFloat16* b, const float* bias, at::BFloat16* out,
                 float* out_f32, int64_t m, int64_t n, int64_t pairs, int64_t kp, ArgmaxCollector* argmax) {
  const int64_t b_block = (kp / 2) * 32, blocks = (n + 15) / 16;
  const GemmSplit split = split_gemm(m, blocks, at::get_num_threads(), kTileRows);
  at::parallel_for(0, split.row_shares * split.col_shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) {
      const int64_t share = part % split.col_shares;
      const int64_t b0 = share * blocks / split.col_shares, b1 = (share + 1) * blocks / split.col_shares;
      const int64_t m0 = part / split.col_shares * split.tiles_per_share * kTileRows;
      const int64_t m1 = std::min(m, m0 + split.tiles_per_share * kTileRows);
      if (b0 >= b1 || m0 >= m1) continue;
      std::unique_ptr<ArgmaxChunk> chunk(argmax ? argmax->chunk() : nullptr);
      for (int64_t r_task = m0; r_task < m1; r_task += kTaskRows) {
        const int64_t r_end = std::min(m1, r_task + kTaskRows);
        const int64_t tiles = (r_end - r_task + kTileRows - 1) / kTileRows;
        const bool prefetch_next = tiles >= 2 && tiles <= kPrefetchTiles;  // see below
        const int64_t step_blocks = m <= kOneBlockRows ? 1 : kTileBlocks;
        for (int64_t cb = b0; cb < b1; cb += step_blocks) {
          const int64_t col0 = cb * 16;
          const int blocks_here = static_cast<int>(std::min<int64_t>(step_blocks, b1 - cb));
          const int64_t cols = std::min<int64_t>(n - col0, blocks_here * 16);
          const at::BFloat16* bt = b + cb * b_block;
          const float* bs = bias ? bias + col0 : nullptr;
          // At decode sizes (2 to kPrefetchTiles tiles a task) the task's first tile streams its
          // weights from memory and the others read them from L2 while the cores' memory
          // bandwidth idles: those later tiles prefetch the run of blocks this thread reads
          // next (its next 4 blocks, or its first again for the next row task), an equal slice
          // each, so the next task's first tile finds its weights in L2 too.
          int64_t next_cb = -1;  // none
          if (prefetch_next) next_cb = cb + step_blocks < b1 ? cb + step_blocks : (r_end < m1 ? b0 : -1);
          const char* next_w = next_cb < 0 ? nullptr : reinterpret_cast<const char*>(b + next_cb * b_block);
          const int64_t next_lines = next_cb < 0 ? 0
              : std::min<int64_t>(step_blocks, b1 - next_cb) * b_block * static_cast<int64_t>(sizeof(at::BFloat16)) / 64;
          for (int64_t r0 = r_task; r0 < r_end; r0 += kTileRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kTileRows, r_end - r0));
            const at::BFloat16* ar = a + r0 * lda;
            at::BFloat16* o = out ? out + r0 * n + col0 : nullptr;
            float* of = out_f32 ? out_f32 + r0 * n + col0 : nullptr;
            const int64_t tile = (r0 - r_task) / kTileRows;  // lines [l0, l1) of the next run
            const int64_t l0 = tile == 0 ? 0 : (tile - 1) * next_lines / (tiles - 1);
            const int64_t l1 = tile == 0 ? 0 : tile * next_lines / (tiles - 1);
            const char* pf = next_w ? next_w + l0 * 64 : nullptr;
            const int64_t pl = l1 - l0;
#define TESSERA_DP_ROWS(C) dp_rows<C>(rows, ar, lda, bt, b_block, pairs, bs, o, of, n, cols, chunk.get(), r0, col0, pf, pl)
            switch (blocks_here) {
              case 4: TESSERA_DP_ROWS(4); break;
              case 3: TESSERA_DP_ROWS(3); break;
              case 2: TESSERA_DP_ROWS(2); break;
              default: TESSERA_DP_ROWS(1); break;
            }
#undef TESSERA_DP_ROWS
          }
        }
      }
      // Keyed by the first column block: a row's parts then merge in column order (first maximum).
      if (chunk) argmax->add(b0, *chunk);
    }
  });
}

at::Tensor avx512_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n, bool f32_out, ArgmaxCollector* argmax, bool store = true) {
  const int64_t np = packed.size(0) * 16, kp = packed.size(1) * 2;
  auto rows = x.reshape({-1, x.size(-1)});
  const int64_t m = rows.size(0), k = rows.size(1);
  TORCH_CHECK(k <= kp && np >= n, "linear_bf16: x has ", k, " features, the packed weight ", kp);
  // Rows are read a K pair (4 bytes) at a time, pairs 0 .. k/2 - 1 (the packed weight is zero past
  // k): x as it is when k is even and rows are dense, else a zero-padded copy (odd k).
  const int64_t pairs = (k + 1) / 2;
  const at::BFloat16* a_ptr;
  int64_t lda;
  at::Tensor padded;
  if (k % 2 == 0 && rows.stride(1) == 1 && rows.stride(0) % 2 == 0) {
    a_ptr = rows.data_ptr<at::BFloat16>();
    lda = rows.stride(0);
  } else {
    padded = at::zeros({m, 2 * pairs}, x.options());
    padded.narrow(1, 0, k).copy_(rows);
    a_ptr = padded.data_ptr<at::BFloat16>();
    lda = 2 * pairs;
  }
  const int64_t n_out = store ? n : 0;
  auto out = at::empty({m, n_out}, x.options().dtype(f32_out ? at::kFloat : at::kBFloat16));
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) bias_f = bias->to(at::kFloat).contiguous();
  if (m > 0)
    avx512_gemm(a_ptr, lda, packed.data_ptr<at::BFloat16>(), bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
                f32_out ? nullptr : out.data_ptr<at::BFloat16>(), f32_out && store ? out.data_ptr<float>() : nullptr,
                m, n, pairs, kp, argmax);
  auto shape = x.sizes().vec();
  shape.back() = n_out;
  return out.view(shape);
}

#pragma GCC pop_options

// AMX and AVX-512 code generation for the bf16 kernel whatever -march=native says, so the library
// also builds on CPUs without them (Zen 3); tessera.kernels.linear only calls it where the CPU
// has AMX. A pragma rather than attributes: the parallel_for lambdas must get the target too.
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (16 x 16 fp32), 4-5: A (16 rows x 32 bf16), 6-7: B (16 k-pairs x 16 cols x 2).
void configure_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC does not see ldtilecfg read its operand and may drop the stores above without this
  // (it did in paged_attention.cpp: SIGILL at the first tile instruction).
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// B tiles (1 KiB each) ahead of the one being loaded. 4, not 8: one process alternating the two on
// an Intel Xeon with AMX (model 167), a decode token's 121 linears ran 2-3% faster at 1 and 32 rows
// (11.65 -> 11.41 ms, 13.1 -> 12.8), twice; 2-3 and 6 were between, 16 slower.
constexpr int64_t kPrefetch = 4;

// Tile ks + kPrefetch of the pair's two column blocks; past the pair's last tile, the same tile
// of the next pair's blocks (the next task's, in the packed order): both of them, so the next
// pair's first tiles are on their way too (without the skip, b0's overrun fetched b1's first
// tiles late, while b1's fetched only the next b0).
// With gated (linear_bf16_silu: b0 a gate block, b1 its up block, each pair's next block right
// after it) the overrun already lands in the next pair's blocks: no skip.
inline void prefetch_tiles(const at::BFloat16* b0, const at::BFloat16* b1, int64_t ks, int64_t k_steps,
                           bool gated = false) {
  const int64_t skip = !gated && ks + kPrefetch >= k_steps ? k_steps * 16 * 32 : 0;  // one block: b0 -> next b0
  const char* p0 = reinterpret_cast<const char*>(b0 + (ks + kPrefetch) * 16 * 32 + skip);
  const char* p1 = reinterpret_cast<const char*>(b1 + (ks + kPrefetch) * 16 * 32 + skip);
  for (int line = 0; line < 1024; line += 64) {
    _mm_prefetch(p0 + line, _MM_HINT_T0);
    _mm_prefetch(p1 + line, _MM_HINT_T0);
  }
}

// Rows of A one task keeps in L2 while it walks column pairs: above this a task per column pair
// would re-read all of A from memory (M = 2048 ran at half oneDNN's rate).
constexpr int64_t kRowBlockBytes = 768 << 10;

// Tile groups (of 16 rows) per row block: the fewest equal blocks that each fit kRowBlockBytes,
// rounded to whole 32-row groups.
int64_t row_block_tiles(int64_t m_tiles, int64_t kp) {
  const int64_t cap = std::max<int64_t>(2, kRowBlockBytes / (16 * kp * 2) / 2 * 2);
  const int64_t blocks = (m_tiles + cap - 1) / cap;
  const int64_t per = (m_tiles + blocks - 1) / blocks;
  return (per + 1) / 2 * 2;
}

// C[M, N] = A[Mp, Kp] (bf16, rows padded to 16, K to 32) x B (VNNI-packed [Np/16][Kp/2][16][2]).
// Tasks are (row block) x (column pair), row block outermost, so a thread's run of tasks walks
// column pairs over one block of A held in L2. Rows go 32 at a time (two A tiles share each B
// tile); a last group of at most 16 rows uses one A tile and half the tile products. Either way a
// C tile row is its A row times B, summed over K in the same order, so neither the blocking nor
// the grouping ever changes a row's result.
// out is bf16, or (out_f32 set instead) fp32 holding the bf16-rounded values.
// gated (linear_bf16_silu; B a gate_up weight of n = 2 x inter columns, inter a multiple of 16,
// no bias): pair j is gate block j and up block inter / 16 + j, and the epilogue stores
// silu(gate) * up into out [m, inter] as silu_mul does it from the bf16 gate_up output.
void amx_gemm(
    const at::BFloat16* a, const at::BFloat16* b, const float* bias, at::BFloat16* out, float* out_f32, int64_t m,
    int64_t mp, int64_t n, int64_t np, int64_t kp, ArgmaxCollector* argmax, bool gated = false) {
  const int64_t n_pairs = gated ? n / 32 : np / 32, m_tiles = mp / 16, k_steps = kp / 32;
  const int64_t b_block = (kp / 2) * 32;  // bf16 elements of one 16-column block
  const int64_t block_tiles = row_block_tiles(m_tiles, kp);
  const int64_t row_blocks = (m_tiles + block_tiles - 1) / block_tiles;
  at::parallel_for(0, row_blocks * n_pairs, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float c[4][16 * 16];
    std::unique_ptr<ArgmaxChunk> chunk(argmax ? argmax->chunk() : nullptr);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t np_i = task % n_pairs, mt0 = (task / n_pairs) * block_tiles;
      const int64_t mt_end = std::min(m_tiles, mt0 + block_tiles);
      const at::BFloat16* b0 = b + (gated ? np_i : 2 * np_i) * b_block;
      const at::BFloat16* b1 = gated ? b0 + n_pairs * b_block : b0 + b_block;
      for (int64_t mt = mt0; mt < mt_end; mt += 2) {
        const bool two = mt + 1 < mt_end;
        const at::BFloat16* a0 = a + mt * 16 * kp;
        const at::BFloat16* a1 = a0 + 16 * kp;
        _tile_zero(0);
        _tile_zero(1);
        // A block's first row group streams B from memory: prefetch it kPrefetch tiles ahead (the
        // tile loads alone leave too few misses in flight to reach the bandwidth at decode sizes).
        const bool stream = mt == mt0;
        if (two) {
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t ks = 0; ks < k_steps; ++ks) {
            if (stream) prefetch_tiles(b0, b1, ks, k_steps, gated);
            _tile_loadd(4, a0 + ks * 32, kp * 2);
            _tile_loadd(5, a1 + ks * 32, kp * 2);
            _tile_loadd(6, b0 + ks * 16 * 32, 64);
            _tile_loadd(7, b1 + ks * 16 * 32, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        } else {
          for (int64_t ks = 0; ks < k_steps; ++ks) {
            if (stream) prefetch_tiles(b0, b1, ks, k_steps, gated);
            _tile_loadd(4, a0 + ks * 32, kp * 2);
            _tile_loadd(6, b0 + ks * 16 * 32, 64);
            _tile_loadd(7, b1 + ks * 16 * 32, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
          }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        if (two) {
          _tile_stored(2, c[2], 64);
          _tile_stored(3, c[3], 64);
        }
        if (gated) {  // C tiles 0 / 2: gate, 1 / 3: up, of rows 0-15 / 16-31
          for (int q = 0; q < (two ? 4 : 2); q += 2)
            for (int r = 0; r < 16 && (mt + q / 2) * 16 + r < m; ++r)
              store_silu_row(c[q] + r * 16, c[q + 1] + r * 16, out + ((mt + q / 2) * 16 + r) * n_pairs * 16 + np_i * 16);
          continue;
        }
        for (int q = 0; q < (two ? 4 : 2); ++q) {
          const int64_t row0 = (mt + q / 2) * 16, col0 = (2 * np_i + q % 2) * 16;
          if (col0 >= n) continue;
          const int cols = static_cast<int>(std::min<int64_t>(16, n - col0));
          for (int r = 0; r < 16 && row0 + r < m; ++r) {
            if (out_f32 || chunk)  // logits (out_f32 null: the ids only)
              store_row_bf16_as_f32(c[q] + r * 16, bias ? bias + col0 : nullptr,
                                    out_f32 ? out_f32 + (row0 + r) * n + col0 : nullptr, cols, chunk.get(), row0 + r,
                                    col0);
            else
              store_row_bf16(c[q] + r * 16, bias ? bias + col0 : nullptr, out + (row0 + r) * n + col0, cols);
          }
        }
      }
    }
    _tile_release();
    if (chunk) argmax->add(begin, *chunk);
  });
}

bool cpu_has_amx_bf16() {
  static const bool has = __builtin_cpu_supports("amx-bf16") && amx_permitted();
  return has;
}

// store false (with argmax): the ids only, the logits [M, 0].
at::Tensor linear_bf16_impl(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t n, bool f32_out, int64_t arithmetic, ArgmaxCollector* argmax,
                            bool gated = false, bool store = true) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "linear_bf16: bf16 only");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2, "linear_bf16: bad packed weight");
  // arithmetic: -1 the machine's (AMX where it has it), 0 AVX-512 BF16, 1 AMX (an error without it).
  const bool amx = arithmetic < 0 ? cpu_has_amx_bf16() : arithmetic == 1;
  TORCH_CHECK(!amx || cpu_has_amx_bf16(), "linear_bf16: AMX asked for, and this CPU or the OS does not give it");
  TORCH_CHECK(amx || __builtin_cpu_supports("avx512bf16"), "linear_bf16: this CPU has neither AMX nor AVX-512 BF16");
  TORCH_CHECK(store || argmax, "linear_bf16: nothing to return without the logits or their argmax");
  if (!amx) return avx512_linear(x, packed, bias, n, f32_out, argmax, store);
  const int64_t np = packed.size(0) * 16, kp = packed.size(1) * 2;
  auto rows = x.reshape({-1, x.size(-1)});
  const int64_t m = rows.size(0), k = rows.size(1);
  TORCH_CHECK(k <= kp && np >= n, "linear_bf16: x has ", k, " features, the packed weight ", kp);
  const int64_t mp = std::max<int64_t>(16, (m + 15) / 16 * 16);
  // Tiles read whole 16-row groups of K-padded rows: x itself when it already has that shape,
  // else a copy in a reused per-thread buffer (no allocation per call). Only the rows' K padding
  // is zeroed: the rows past m are read into C rows that are never stored, so whatever an earlier
  // call left there changes nothing (zeroing them, through a from_blob/narrow/copy_, had cost a
  // one-row decode ~2-4 us a linear).
  const at::BFloat16* a_ptr;
  static thread_local std::vector<at::BFloat16> scratch;
  if (mp == m && kp == k && rows.is_contiguous()) {
    a_ptr = rows.data_ptr<at::BFloat16>();
  } else {
    if (static_cast<int64_t>(scratch.size()) < mp * kp) scratch.resize(mp * kp);
    const auto src = rows.contiguous();
    const at::BFloat16* sp = src.data_ptr<at::BFloat16>();
    at::BFloat16* dst = scratch.data();
    for (int64_t r = 0; r < m; ++r) {
      std::memcpy(static_cast<void*>(dst + r * kp), sp + r * k, sizeof(at::BFloat16) * k);
      if (kp > k) std::memset(static_cast<void*>(dst + r * kp + k), 0, sizeof(at::BFloat16) * (kp - k));
    }
    a_ptr = scratch.data();
  }
  const int64_t n_out = !store ? 0 : gated ? n / 2 : n;
  auto out = at::empty({m, n_out}, x.options().dtype(f32_out ? at::kFloat : at::kBFloat16));
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) bias_f = bias->to(at::kFloat).contiguous();
  amx_gemm(a_ptr, packed.data_ptr<at::BFloat16>(), bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
           f32_out ? nullptr : out.data_ptr<at::BFloat16>(), f32_out && store ? out.data_ptr<float>() : nullptr, m, mp,
           n, np, kp, argmax, gated);
  auto shape = x.sizes().vec();
  shape.back() = n_out;
  return out.view(shape);
}

// silu(x W_gate^T) * (x W_up^T) from a fused gate_up weight (n = 2 x inter columns, gate first):
// silu_mul(linear_bf16(x, packed, None, n)) bit for bit. On AMX the silu runs in the GEMM's store
// epilogue (amx_gemm gated), so the [M, n] gate_up output is never stored and read back: at a
// 256-token prefill that was 1.5 MB a layer, half of each row written by the other core. Elsewhere
// (AVX-512 BF16, or inter not a multiple of 16) the two ops in turn.
at::Tensor linear_bf16_silu(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t arithmetic) {
  const bool amx = arithmetic < 0 ? cpu_has_amx_bf16() : arithmetic == 1;
  if (amx && n % 32 == 0 && packed.dim() == 4 && packed.size(0) * 16 == n)
    return linear_bf16_impl(x, packed, c10::nullopt, n, false, arithmetic, nullptr, true);
  static const auto silu_mul =
      c10::Dispatcher::singleton().findSchemaOrThrow("tessera_inv::silu_mul", "").typed<at::Tensor(const at::Tensor&)>();
  return silu_mul.call(linear_bf16_impl(x, packed, c10::nullopt, n, false, arithmetic, nullptr).contiguous());
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t n, bool f32_out, int64_t arithmetic) {
  return linear_bf16_impl(x, packed, bias, n, f32_out, arithmetic, nullptr);
}

// (fp32 logits as linear_bf16(..., f32_out=True) stores them, each row's first maximum); with
// logits false the logits are not stored ([..., 0]): the ids of a step that reads nothing else.
std::tuple<at::Tensor, at::Tensor> linear_bf16_argmax(const at::Tensor& x, const at::Tensor& packed,
                                                      const c10::optional<at::Tensor>& bias, int64_t n,
                                                      int64_t arithmetic, bool logits) {
  const int64_t m = x.numel() / std::max<int64_t>(1, x.size(-1));
  ArgmaxCollector argmax(m);
  auto out = linear_bf16_impl(x, packed, bias, n, true, arithmetic, &argmax, false, logits);
  auto shape = x.sizes().vec();
  shape.pop_back();
  auto ids = at::empty(shape, x.options().dtype(at::kLong));
  if (m > 0) argmax.finish(ids.data_ptr<int64_t>());
  return {out, ids};
}

// (fp32 logits as linear_bf16(..., f32_out=True) stores them, each row's maximum of every 16 of
// them [M, ceil(n / 16)], NaN where one of the 16 is NaN), from the store epilogue: what a top-k /
// top-p draw's head pass reads instead of the logits the lm_head has just written past the caches
// (tessera.engine.candidates.draw_kept).
std::tuple<at::Tensor, at::Tensor> linear_bf16_maxima(const at::Tensor& x, const at::Tensor& packed,
                                                      const c10::optional<at::Tensor>& bias, int64_t n,
                                                      int64_t arithmetic) {
  TORCH_CHECK(x.dim() == 2, "linear_bf16_maxima: x must be [M, K]");
  const int64_t m = x.size(0), blocks = (n + 15) / 16;
  auto maxima = at::empty({m, blocks}, x.options().dtype(at::kFloat));
  ArgmaxCollector collector(m);
  collector.keep_maxima(maxima.data_ptr<float>(), blocks, false);
  auto out = linear_bf16_impl(x, packed, bias, n, true, arithmetic, &collector);
  return {out, maxima};
}

#pragma GCC pop_options

// AVX2 without AVX-512 (Zen 3): the float32 linears run f32_gemm_avx2.cpp's register tiles (the
// same arithmetic); the loop below keeps 4 x 64 accumulators, which spill there.
bool avx2_tiles() {
  static const bool yes = !__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
                          __builtin_cpu_supports("fma");
  return yes;
}

// fp32: out[m, n] = sum_k x[m, k] * wt[k, n] in k order, 64 columns x 4 rows at a time.
// wt is the weight in panels of 64 columns, [Np / 64, K, 64], Np = N padded to a multiple of 64.
void f32_gemm(const float* x, const float* wt, const float* bias, float* out, int64_t m, int64_t n, int64_t np,
              int64_t k) {
  if (avx2_tiles()) return tessera_avx2::f32_gemm(x, wt, bias, out, m, n, np, k);
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
          const float* w = wt + (cb * k + kk) * kCols;  // panel cb's row kk
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

// x's rows [M, K] (any leading shape) times a weight into a new float32 [.., n_out] output:
// gemm(rows, m, k, bias or nullptr, out) fills it.
template <typename Gemm>
at::Tensor f32_rows_call(const char* name, const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t n_out,
                         Gemm&& gemm) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": float32 only");
  auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t m = rows.size(0), k = rows.size(1);
  auto out = at::empty({m, n_out}, x.options());
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) bias_f = bias->to(at::kFloat).contiguous();
  gemm(rows.data_ptr<float>(), m, k, bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, out.data_ptr<float>());
  auto shape = x.sizes().vec();
  shape.back() = n_out;
  return out.view(shape);
}

// The same with wt a float32 panel weight [np / 64, k, 64].
template <typename Gemm>
at::Tensor f32_linear_call(const char* name, const at::Tensor& x, const at::Tensor& wt,
                           const c10::optional<at::Tensor>& bias, int64_t n_out, Gemm&& gemm) {
  TORCH_CHECK(wt.scalar_type() == at::kFloat && wt.dim() == 3 && wt.size(1) == x.size(-1) && wt.size(2) == 64, name,
              ": bad packed weight (float32 panels [np / 64, k, 64])");
  return f32_rows_call(name, x, bias, n_out, gemm);
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& wt, const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(wt.dim() == 3 && wt.size(0) * 64 >= n, "linear_f32: the packed weight has fewer than ", n, " columns");
  return f32_linear_call("linear_f32", x, wt, bias, n, [&](const float* rows, int64_t m, int64_t k, const float* b,
                                                            float* out) {
    f32_gemm(rows, wt.data_ptr<float>(), b, out, m, n, wt.size(0) * 64, k);
  });
}

// A gate_up weight of n = 2 x inter columns packed in pairs (linear.py's _pack with pairs: 8 gate
// rows, then the same 8 up rows, in turn), on the AVX2 tiles only: the plain [.., n] output (gate,
// then up), or with silu the [.., inter] silu(gate) * up, silu_mul's arithmetic, stored from the
// registers: the [M, n] output is neither written nor read back (silu_mul alone was 3% of a
// float32 prefill on a Zen 3).
at::Tensor linear_f32_pairs(const at::Tensor& x, const at::Tensor& wt, const c10::optional<at::Tensor>& bias, int64_t n,
                            bool silu) {
  TORCH_CHECK(avx2_tiles(), "linear_f32_pairs: the paired layout is the AVX2 tiles' (CPUs without AVX-512)");
  TORCH_CHECK(n % 64 == 0 && wt.dim() == 3 && wt.size(0) * 64 == n,
              "linear_f32_pairs: a paired weight of n = 2 x inter columns, inter a multiple of 32");
  return f32_linear_call("linear_f32_pairs", x, wt, bias, silu ? n / 2 : n,
                         [&](const float* rows, int64_t m, int64_t k, const float* b, float* out) {
                           tessera_avx2::f32_gemm_pairs(rows, wt.data_ptr<float>(), b, out, m, n, k, silu);
                         });
}

// x [.., k] times a GGUF file's blocks of W in panel order (uint8 [np / 64, k / 32, block bytes],
// tessera/quant/gguf_f32_blocks.py), format 0 Q4_0 / Q4_1, 1 Q8_0 / Q5_0, 2 Q4_K, 3 Q6_K (16 k a
// block), 4 Q5_1 / Q5_K; store 0 plain, 1 and 2 a gate_up in pairs (as linear_f32_pairs with silu
// false and true). AVX2 tiles only: linear_f32's (and linear_f32_pairs') bits on the float32
// weight the loader made of those blocks.
at::Tensor linear_f32_blocks(const at::Tensor& x, const at::Tensor& blocks, const c10::optional<at::Tensor>& bias,
                             int64_t n, int64_t format, int64_t store) {
  TORCH_CHECK(avx2_tiles(), "linear_f32_blocks: the AVX2 tiles' kernel (CPUs without AVX-512)");
  TORCH_CHECK(format >= 0 && format <= 4,
              "linear_f32_blocks: format 0 (Q4_0 / Q4_1), 1 (Q8_0, Q5_0), 2 (Q4_K), 3 (Q6_K) or 4 (Q5_1, Q5_K)");
  TORCH_CHECK(store >= 0 && store <= 2, "linear_f32_blocks: store 0, 1 or 2");
  const int64_t block_k = tessera_avx2::f32_block_k(static_cast<int>(format));
  const int64_t bytes = tessera_avx2::f32_block_bytes(static_cast<int>(format));
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.size(2) == bytes &&
                  blocks.is_contiguous() && blocks.size(0) * 64 >= n && (store == 0 || blocks.size(0) * 64 == n),
              "linear_f32_blocks: blocks must be contiguous uint8 [np / 64, k / ", block_k, ", ", bytes, "] covering ", n,
              " columns");
  const int64_t k = x.size(-1);
  TORCH_CHECK(blocks.size(1) * block_k == k, "linear_f32_blocks: the blocks hold k = ", blocks.size(1) * block_k,
              ", x has ", k);
  return f32_rows_call("linear_f32_blocks", x, bias, store == 2 ? n / 2 : n,
                         [&](const float* rows, int64_t m, int64_t kk, const float* b, float* out) {
                           tessera_avx2::f32_gemm_blocks(rows, blocks.data_ptr<uint8_t>(), static_cast<int>(format), b, out, m, n,
                                                         blocks.size(0) * 64, kk, static_cast<int>(store));
                         });
}

}  // namespace

TORCH_LIBRARY(tessera_inv, m) {
  m.def("linear_bf16(Tensor x, Tensor packed, Tensor? bias, int n, bool f32_out=False, int arithmetic=-1) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor wt, Tensor? bias, int n) -> Tensor");
  m.def("linear_f32_pairs(Tensor x, Tensor wt, Tensor? bias, int n, bool silu) -> Tensor");
  m.def("linear_f32_blocks(Tensor x, Tensor blocks, Tensor? bias, int n, int format, int store) -> Tensor");
  m.def("linear_bf16_maxima(Tensor x, Tensor packed, Tensor? bias, int n, int arithmetic=-1) -> (Tensor, Tensor)");
  m.def("linear_bf16_argmax(Tensor x, Tensor packed, Tensor? bias, int n, int arithmetic=-1, bool logits=True) "
        "-> (Tensor, Tensor)");
  m.def("linear_bf16_silu(Tensor x, Tensor packed, int n, int arithmetic=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(tessera_inv, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_f32_pairs", &linear_f32_pairs);
  m.impl("linear_f32_blocks", &linear_f32_blocks);
  m.impl("linear_bf16_argmax", &linear_bf16_argmax);
  m.impl("linear_bf16_maxima", &linear_bf16_maxima);
  m.impl("linear_bf16_silu", &linear_bf16_silu);
}
