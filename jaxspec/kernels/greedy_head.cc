// The argmax of the logits E h for a few positions, from a bfloat16 copy of the output matrix E: the greedy next
// token of a CPU decoding step or verification (jaxspec.model.greedy_tokens) reading half the LM head's bytes.
//
//   screen: bf16[V, d] (E rounded), rows: f32[V, d] (E), h: f32[N, d] (final-normed, N <= 16), error: f32[]
//   -> tokens: s32[N], for each position n the token v with the largest exact_dot(rows[v], h[n]), the lowest v on ties.
//
// JaxspecSampledHead takes one more input, noise: f32[N, V], added to every logit before the argmax (temperature
// times Gumbel noise: the argmax is then a sample of softmax(logits / temperature); jaxspec.sampling.gumbel_noise).
//
// 1. Every screen row times every position (bfloat16 widened in registers), the rows split over XLA's intra-op pool;
//    each task keeps, per position, the kCandidates + 1 best screened logits it has seen.
// 2. The kCandidates best of each position scored again from their float32 rows by exact_dot.
// 3. The best of those is the answer when the next screened logit plus error * ||h[n]||_2 stays below it: `error`
//    bounds |screened - exact| per unit ||h|| for every token (jaxspec.model.HeadScreen), so no token outside the
//    candidates can reach it (with noise, the same holds for logit + noise, less a few units in the last place of
//    the sums, which the comparison leaves room for). Otherwise every row is scored by exact_dot for that position
//    (rare: the ninth-best logit within about one logit of the best).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include <immintrin.h>

#include "xla/ffi/api/ffi.h"
#include "cpu_common.h"

namespace ffi = xla::ffi;

namespace {

using jaxspec::horizontal_sum;
using jaxspec::kHasAvx512;

constexpr int kMaxPositions = 16;
constexpr int kCandidates = 8;  // scored in float32 per position (SCREEN_CANDIDATES in jaxspec/model.py)
constexpr int kKept = kCandidates + 1;  // the best left out bounds every token left out
constexpr int kGroup = 4;  // positions per pass over a row: 8 accumulators (later passes read the row from L1)
constexpr int64_t kChunkRows = 64;  // rows a task takes at a time

struct Best {  // the kKept largest (score, id) seen, in descending order
  float score[kKept];
  int32_t id[kKept];
  void clear() {
    std::fill(score, score + kKept, -std::numeric_limits<float>::infinity());
    std::fill(id, id + kKept, -1);
  }
  void offer(float s, int32_t v) {
    if (!(s > score[kKept - 1])) return;
    int j = kKept - 1;
    for (; j > 0 && s > score[j - 1]; --j) {
      score[j] = score[j - 1];
      id[j] = id[j - 1];
    }
    score[j] = s;
    id[j] = v;
  }
};

// exact_dot: the float32 logit of one row, always summed in this order (8 lanes, then the lanes, then the tail), so
// a token's exact logit is the same number whichever path scores it.
float exact_dot(const float* row, const float* h, int64_t d) {
  const int64_t vec_end = d - d % 8;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < vec_end; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(row + i), _mm256_loadu_ps(h + i), acc);
  float sum = horizontal_sum(acc);
  for (int64_t i = vec_end; i < d; ++i) sum = std::fma(row[i], h[i], sum);
  return sum;
}

constexpr int64_t kPrefetch = 2048;  // weights ahead (4 KB), as small_product.cc's stream

// Screened logits of one row for G positions. 16 bfloat16 weights per 256-bit load: shifted left by 16 bits, each
// 32-bit lane holds the even element as a float32; masked to its high half, the odd one. hs holds each position's h
// in that order (per 16 elements: the 8 even, then the 8 odd); the elements past the last 16 in natural order. Even
// and odd elements go to separate accumulators: two chains of FMAs per position (one chain's latency bound one
// position to 1.6 elements a cycle, below the memory's pace).
template <int G>
void screen_row(const uint16_t* w, const float* hs, int64_t d, float* out) {
  const int64_t blocks = d / 16;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 even_acc[G], odd_acc[G];
  for (int n = 0; n < G; ++n) even_acc[n] = odd_acc[n] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * b + kPrefetch), _MM_HINT_T0);
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * b));
    const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(packed, 16));
    const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(packed, high));
    for (int n = 0; n < G; ++n) {
      const float* hn = hs + n * d + 16 * b;
      even_acc[n] = _mm256_fmadd_ps(even, _mm256_loadu_ps(hn), even_acc[n]);
      odd_acc[n] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(hn + 8), odd_acc[n]);
    }
  }
  for (int n = 0; n < G; ++n) {
    float sum = horizontal_sum(_mm256_add_ps(even_acc[n], odd_acc[n]));
    for (int64_t i = 16 * blocks; i < d; ++i) sum = std::fma(jaxspec::bfloat16_to_float(w[i]), hs[n * d + i], sum);
    out[n] = sum;
  }
}

using RowScreen = void (*)(const uint16_t*, const float*, int64_t, float*);
constexpr RowScreen kRowScreens[kGroup + 1] = {nullptr, screen_row<1>, screen_row<2>, screen_row<3>, screen_row<4>};

// The same with 16-wide AVX-512 FMAs for R rows and G positions at once (chosen at run time where the CPU has
// them): each widened weight register serves G positions and each h register R rows, where `screen_row` loads h
// for every FMA. 32 bfloat16 weights per 512-bit load, split as above into the even and the odd elements; hs then
// holds each position's h per 32 elements as the 16 even, then the 16 odd (`screen_order`). The rows of the next
// tile are prefetched as this one's are read (as small_product.cc's tiles). out[r * kMaxPositions + g].
constexpr int kTileRows = 4;
constexpr int kTilePositions = 5;  // 20 accumulators, 8 widened weight registers and one h register of the 32
template <int R, int G>
__attribute__((target("avx512f"))) void screen_tile_512(const uint16_t* w, const float* hs, int64_t d, float* out) {
  const int64_t blocks = d / 32;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 even[R], odd[R];
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + R) * d + 32 * b), _MM_HINT_T1);
      const __m512i packed = _mm512_loadu_si512(w + r * d + 32 * b);
      even[r] = _mm512_castsi512_ps(_mm512_slli_epi32(packed, 16));
      odd[r] = _mm512_castsi512_ps(_mm512_and_si512(packed, high));
    }
    for (int g = 0; g < G; ++g) {
      const __m512 he = _mm512_loadu_ps(hs + g * d + 32 * b);
      for (int r = 0; r < R; ++r) acc[r][g] = _mm512_fmadd_ps(even[r], he, acc[r][g]);
      const __m512 ho = _mm512_loadu_ps(hs + g * d + 32 * b + 16);
      for (int r = 0; r < R; ++r) acc[r][g] = _mm512_fmadd_ps(odd[r], ho, acc[r][g]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) {
      float sum = _mm512_reduce_add_ps(acc[r][g]);
      for (int64_t i = 32 * blocks; i < d; ++i)
        sum = std::fma(jaxspec::bfloat16_to_float(w[r * d + i]), hs[g * d + i], sum);
      out[r * kMaxPositions + g] = sum;
    }
  }
}

constexpr RowScreen kTileScreens[kTilePositions + 1] = {
    nullptr, screen_tile_512<kTileRows, 1>, screen_tile_512<kTileRows, 2>, screen_tile_512<kTileRows, 3>,
    screen_tile_512<kTileRows, 4>, screen_tile_512<kTileRows, 5>};
constexpr RowScreen kRowTileScreens[kTilePositions + 1] = {
    nullptr, screen_tile_512<1, 1>, screen_tile_512<1, 2>, screen_tile_512<1, 3>, screen_tile_512<1, 4>,
    screen_tile_512<1, 5>};

// h in the screen's order: per `block` elements (16 for `screen_row`, 32 for `screen_tile_512`) the even elements,
// then the odd; the elements past the last whole block in natural order. hd: [N, d] -> hs: [N, d].
void screen_order(const float* hd, int64_t positions, int64_t d, int64_t block, float* hs) {
  for (int64_t n = 0; n < positions; ++n) {
    for (int64_t b = 0; b < d / block; ++b) {
      for (int64_t j = 0; j < block / 2; ++j) {
        hs[n * d + block * b + j] = hd[n * d + block * b + 2 * j];
        hs[n * d + block * b + block / 2 + j] = hd[n * d + block * b + 2 * j + 1];
      }
    }
    for (int64_t i = d - d % block; i < d; ++i) hs[n * d + i] = hd[n * d + i];
  }
}

struct Work {
  const uint16_t* screen;
  const float* hs;  // [N, d], each position in screen order
  const float* noise;  // [N, V] added to the logits, or nullptr
  int64_t d, vocab, positions, chunks;
  std::vector<Best> best;  // [tasks, N]: each task's own lists
  std::atomic<int64_t> next{0}, done{0}, tasks{0};

  void run() {
    const int64_t task = tasks.fetch_add(1);
    Best* mine = best.data() + task * positions;
    // rows in tiles of kTileRows with AVX-512 (the chunk's last few one at a time), one at a time without; the
    // positions in near-equal groups of at most as many as one pass takes
    const int64_t tile_rows = kHasAvx512 ? kTileRows : 1, most = kHasAvx512 ? kTilePositions : kGroup;
    const int64_t groups = (positions + most - 1) / most;
    float scores[kTileRows * kMaxPositions];  // [rows, positions]: screen_row and the tiles write row r at r * 16
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      const int64_t v1 = std::min(vocab, (c + 1) * kChunkRows);
      for (int64_t v = c * kChunkRows; v < v1;) {
        const int64_t rows = v + tile_rows <= v1 ? tile_rows : 1;
        const RowScreen* screens = !kHasAvx512 ? kRowScreens : rows == kTileRows ? kTileScreens : kRowTileScreens;
        for (int64_t k = 0, n0 = 0; k < groups; ++k) {
          const int64_t group = (positions - n0) / (groups - k);
          screens[group](screen + v * d, hs + n0 * d, d, scores + n0);
          n0 += group;
        }
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t n = 0; n < positions; ++n) {
            const float s = scores[r * kMaxPositions + n];
            mine[n].offer(noise ? s + noise[n * vocab + v + r] : s, static_cast<int32_t>(v + r));
          }
        }
        v += rows;
      }
      done.fetch_add(1, std::memory_order_release);  // publishes this chunk's offers with it
    }
  }
};

// The argmax of exact_dot(rows[v], h[n]) + noise[n, v] (noise nullptr: + 0) for each position n.
ffi::Error HeadArgmax(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> screen, ffi::Buffer<ffi::F32> rows,
                      ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::F32> error, const float* noise, int32_t* out) {
  const auto s_dims = screen.dimensions(), r_dims = rows.dimensions(), h_dims = h.dimensions();
  if (s_dims.size() != 2 || r_dims.size() != 2 || h_dims.size() != 2 || s_dims[0] != r_dims[0] ||
      s_dims[1] != r_dims[1] || h_dims[1] != s_dims[1] || error.element_count() != 1) {
    return ffi::Error::InvalidArgument("jaxspec_greedy_head: expects screen and rows [V, d], h [N, d], error []");
  }
  const int64_t vocab = s_dims[0], d = s_dims[1], positions = h_dims[0];
  if (positions < 1 || positions > kMaxPositions || vocab < kKept) {
    return ffi::Error::InvalidArgument("jaxspec_greedy_head: 1 to 16 positions and at least 9 tokens");
  }
  const float* hd = h.typed_data();
  std::vector<float> hs(positions * d);  // h in screen order
  screen_order(hd, positions, d, kHasAvx512 ? 32 : 16, hs.data());
  auto work = std::make_shared<Work>();
  work->screen = reinterpret_cast<const uint16_t*>(screen.untyped_data());
  work->hs = hs.data();
  work->noise = noise;
  work->d = d;
  work->vocab = vocab;
  work->positions = positions;
  work->chunks = (vocab + kChunkRows - 1) / kChunkRows;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->chunks) - 1;
  work->best.resize((helpers + 1) * positions);
  for (Best& b : work->best) b.clear();
  jaxspec::run_on_pool(pool, work, helpers, work->chunks);

  const float* e = rows.typed_data();
  const double bound = static_cast<double>(error.typed_data()[0]);
  for (int64_t n = 0; n < positions; ++n) {
    const float* gn = noise ? noise + n * vocab : nullptr;  // [V] or nullptr
    Best merged;
    merged.clear();
    for (int64_t t = 0; t <= helpers; ++t) {
      const Best& b = work->best[t * positions + n];
      for (int k = 0; k < kKept; ++k) merged.offer(b.score[k], b.id[k]);
    }
    const float* hn = hd + n * d;
    float best = -std::numeric_limits<float>::infinity();
    int32_t best_id = -1;
    for (int k = 0; k < kCandidates; ++k) {
      if (merged.id[k] < 0) continue;  // fewer scores than candidates were offered (NaN scores are never kept)
      float s = exact_dot(e + int64_t(merged.id[k]) * d, hn, d);
      if (gn) s += gn[merged.id[k]];
      if (s > best || (s == best && merged.id[k] < best_id)) {
        best = s;
        best_id = merged.id[k];
      }
    }
    double norm = 0.0;
    for (int64_t i = 0; i < d; ++i) norm += double(hn[i]) * double(hn[i]);
    const double next = merged.score[kCandidates];  // the best screened (+ noise) score left out
    const double rounding = gn ? 0x1p-22 * (std::fabs(next) + std::fabs(double(best))) : 0.0;  // of the + noise
    if (!(next + bound * std::sqrt(norm) + rounding < double(best))) {  // not certain: all rows
      best = -std::numeric_limits<float>::infinity();
      best_id = 0;
      for (int64_t v = 0; v < vocab; ++v) {
        float s = exact_dot(e + v * d, hn, d);
        if (gn) s += gn[v];
        if (s > best) {
          best = s;
          best_id = static_cast<int32_t>(v);
        }
      }
    }
    out[n] = best_id;
  }
  return ffi::Error::Success();
}

ffi::Error GreedyHead(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> screen, ffi::Buffer<ffi::F32> rows,
                      ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::F32> error, ffi::ResultBuffer<ffi::S32> tokens) {
  return HeadArgmax(pool, screen, rows, h, error, nullptr, tokens->typed_data());
}

ffi::Error SampledHead(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> screen, ffi::Buffer<ffi::F32> rows,
                       ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::F32> error, ffi::Buffer<ffi::F32> noise,
                       ffi::ResultBuffer<ffi::S32> tokens) {
  const auto n_dims = noise.dimensions();
  if (n_dims.size() != 2 || n_dims[0] != h.dimensions()[0] || n_dims[1] != screen.dimensions()[0]) {
    return ffi::Error::InvalidArgument("jaxspec_sampled_head: expects noise [N, V]");
  }
  return HeadArgmax(pool, screen, rows, h, error, noise.typed_data(), tokens->typed_data());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecGreedyHead, GreedyHead,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecSampledHead, SampledHead,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
