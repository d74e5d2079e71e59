// Attention of a few new queries over a row's committed cache slots, reading only the slots that hold tokens.
//
// XLA:CPU runs the cache products of `jaxspec.model._attention` as batched library products over every slot of the
// cache (up to the bucket size, whatever a row's length), with a transposed copy of the values and one small product
// per (row, key/value head): at batch 16 and 128 slots about 40 ms of a 200 ms step on the 2-core EPYC. This kernel
// reads each row's keys and values up to its length only: for each (row, key/value head) the scores of all its
// queries (T new tokens x G query heads), 8 keys at a time, their softmaxes with a vectorised exponential, then per
// query the values accumulated in registers (the second and later queries find the values in cache; a softmax
// fused into each query's value pass measured 5-10% slower at 8-16 queries). With AVX-512 the two passes take
// several queries per load of keys or values (`scores_512`, `values_512`). Built with small_product.cc
// (jaxspec/kernels/__init__.py).
//
//   q: f32[B, T, K, G, h] (scaled), cache_k, cache_v: f32[B, K, S, h], lengths: s32[B], new_k, new_v: f32[B, T, K, h],
//   mask: pred[B, T, T] (query t sees new token u) -> out: f32[B, T, K, G, h]
//   out[b, t, k, g] = softmax over (slots s < lengths[b], new tokens u with mask[b, t, u]) of q . key, times values.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include <immintrin.h>

#include "xla/ffi/api/ffi.h"
#include "cpu_common.h"

namespace ffi = xla::ffi;

namespace {

using jaxspec::horizontal_sum;
using jaxspec::kHasAvx512;

// exp(x) for 8 lanes, x <= 0 (scores minus their maximum): 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p a
// degree-6 polynomial (relative error about 2e-7); lanes below -87 give 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts (Cody-Waite)
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// The dot products of one query with 8 keys, as one vector: acc[j] holds key j's partial sums in 8 lanes; three rounds
// of pairwise horizontal adds and one add of the two halves leave key j's sum in lane j.
inline __m256 eight_sums(const __m256 acc[8]) {
  const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

struct Shapes {
  int64_t b, t, k, g, h, s;
};

// With AVX-512 (and a head size that is a multiple of 16) both passes take several queries per load of keys or
// values, where the AVX2 loops below load them again for every query: Q queries' scores over 8 keys (8 Q
// accumulators; each 16 lanes folded to 8, then `eight_sums`), and Q queries' outputs over the slots, 64 lanes a
// time (4 Q accumulators). queries: Q query rows [h]; block: 8 keys [8, h]; out: Q score rows at the block.
template <int Q>
__attribute__((target("avx512f"))) void scores_512(const float* const* queries, const float* block, int64_t h,
                                                   float* const* out) {
  __m512 acc[Q][8];
  for (int q = 0; q < Q; ++q)
    for (int j = 0; j < 8; ++j) acc[q][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < h; i += 16) {
    __m512 qv[Q];
    for (int q = 0; q < Q; ++q) qv[q] = _mm512_loadu_ps(queries[q] + i);
    for (int j = 0; j < 8; ++j) {
      const __m512 kv = _mm512_loadu_ps(block + j * h + i);
      for (int q = 0; q < Q; ++q) acc[q][j] = _mm512_fmadd_ps(qv[q], kv, acc[q][j]);
    }
  }
  for (int q = 0; q < Q; ++q) {
    __m256 folded[8];
    for (int j = 0; j < 8; ++j)
      folded[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[q][j]),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[q][j]), 1)));
    _mm256_storeu_ps(out[q], eight_sums(folded));
  }
}

// Q queries' outputs, lanes [i0, i0 + 64): out[q] = scale[q] * sum over columns c of probs[q][c] * value(c).
template <int Q, typename ValueRow>
__attribute__((target("avx512f"))) void values_512(const float* const* probs, int64_t width, const ValueRow& value_row,
                                                   int64_t i0, const float* scale, float* const* out) {
  __m512 acc[Q][4];
  for (int q = 0; q < Q; ++q)
    for (int j = 0; j < 4; ++j) acc[q][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < width; ++c) {
    const float* v = value_row(c) + i0;
    __m512 vv[4];
    for (int j = 0; j < 4; ++j) vv[j] = _mm512_loadu_ps(v + 16 * j);
    for (int q = 0; q < Q; ++q) {
      const __m512 p = _mm512_set1_ps(probs[q][c]);
      for (int j = 0; j < 4; ++j) acc[q][j] = _mm512_fmadd_ps(p, vv[j], acc[q][j]);
    }
  }
  for (int q = 0; q < Q; ++q)
    for (int j = 0; j < 4; ++j)
      _mm512_storeu_ps(out[q] + i0 + 16 * j, _mm512_mul_ps(acc[q][j], _mm512_set1_ps(scale[q])));
}

// One (row, key/value head): its T x G queries over the row's first `length` slots and the new tokens they may see.
// scores: scratch of T G x (length + T) floats; out: [T G, h].
void attend_head(const Shapes& d, const float* q, const float* cache_k, const float* cache_v, int64_t length,
                 const float* new_k, const float* new_v, const bool* mask, float* out, int64_t bi, int64_t ki,
                 std::vector<float>& scores) {
  const int64_t h = d.h, queries = d.t * d.g, width = length + d.t;
  scores.resize(queries * width);
  const float* keys = cache_k + (bi * d.k + ki) * d.s * h;    // [S, h]
  const float* values = cache_v + (bi * d.k + ki) * d.s * h;  // [S, h]
  auto query = [&](int64_t r) { return q + (((bi * d.t + r / d.g) * d.k + ki) * d.g + r % d.g) * h; };
  auto new_row = [&](const float* x, int64_t u) { return x + ((bi * d.t + u) * d.k + ki) * h; };
  auto value_row = [&](int64_t column) { return column < length ? values + column * h : new_row(new_v, column - length); };
  const bool vectorised = h % 8 == 0;
  auto dot = [&](const float* a, const float* c) {
    if (!vectorised) {
      float sum = 0.0f;
      for (int64_t i = 0; i < h; ++i) sum += a[i] * c[i];
      return sum;
    }
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(c));
    for (int64_t i = 8; i < h; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(c + i), acc);
    return horizontal_sum(acc);
  };
  // scores over the cache: 8 keys at a time for each query (the keys stay in L1 across the queries)
  const int64_t blocked = vectorised ? length - length % 8 : 0;
  const bool wide = kHasAvx512 && h % 16 == 0;  // the AVX-512 passes
  constexpr int kScoreQueries = 3;  // 24 accumulators
  for (int64_t s0 = 0; wide && s0 < blocked; s0 += 8) {
    for (int64_t r0 = 0; r0 < queries; r0 += kScoreQueries) {
      const int64_t n = std::min<int64_t>(kScoreQueries, queries - r0);
      const float* qs[kScoreQueries];
      float* outs[kScoreQueries];
      for (int64_t q = 0; q < n; ++q) {
        qs[q] = query(r0 + q);
        outs[q] = scores.data() + (r0 + q) * width + s0;
      }
      if (n == 3) scores_512<3>(qs, keys + s0 * h, h, outs);
      else if (n == 2) scores_512<2>(qs, keys + s0 * h, h, outs);
      else scores_512<1>(qs, keys + s0 * h, h, outs);
    }
  }
  for (int64_t s0 = 0; !wide && s0 < blocked; s0 += 8) {
    const float* block = keys + s0 * h;
    for (int64_t r = 0; r < queries; ++r) {
      const float* qr = query(r);
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t i = 0; i < h; i += 8) {
        const __m256 qv = _mm256_loadu_ps(qr + i);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(block + j * h + i), acc[j]);
      }
      _mm256_storeu_ps(scores.data() + r * width + s0, eight_sums(acc));
    }
  }
  for (int64_t s = blocked; s < length; ++s)
    for (int64_t r = 0; r < queries; ++r) scores[r * width + s] = dot(query(r), keys + s * h);
  const float hidden = -INFINITY;
  for (int64_t r = 0; r < queries; ++r) {
    const int64_t t = r / d.g;
    for (int64_t u = 0; u < d.t; ++u)
      scores[r * width + length + u] = mask[(bi * d.t + t) * d.t + u] ? dot(query(r), new_row(new_k, u)) : hidden;
  }
  // softmax of each query's scores, left unnormalised (a query sees at least itself, so every maximum is finite);
  // the values' sum is scaled by 1 / the sum below
  std::vector<float> inverse(queries);
  for (int64_t r = 0; r < queries; ++r) {
    float* row = scores.data() + r * width;
    int64_t i = 0;
    __m256 top8 = _mm256_set1_ps(hidden);
    for (; i + 8 <= width; i += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(row + i));
    __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
    top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
    top4 = _mm_max_ss(top4, _mm_shuffle_ps(top4, top4, 1));
    float top = _mm_cvtss_f32(top4);
    for (; i < width; ++i) top = std::max(top, row[i]);
    const __m256 top_all = _mm256_set1_ps(top);
    __m256 sum8 = _mm256_setzero_ps();
    for (i = 0; i + 8 <= width; i += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + i), top_all));
      _mm256_storeu_ps(row + i, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = horizontal_sum(sum8);
    for (; i < width; ++i) {
      row[i] = row[i] == hidden ? 0.0f : std::exp(row[i] - top);
      sum += row[i];
    }
    inverse[r] = 1.0f / sum;
  }
  // out = probabilities x values: 64 output lanes at a time held in registers over all the slots, for several
  // queries at once with AVX-512 (the lanes past the last 64 below), else for each query
  constexpr int kValueQueries = 6;  // 24 accumulators
  const int64_t wide_lanes = wide ? h - h % 64 : 0;
  for (int64_t r0 = 0; r0 < queries && wide_lanes > 0; r0 += kValueQueries) {
    const int64_t n = std::min<int64_t>(kValueQueries, queries - r0);
    const float* probs[kValueQueries];
    float* outs[kValueQueries];
    for (int64_t q = 0; q < n; ++q) {
      probs[q] = scores.data() + (r0 + q) * width;
      outs[q] = out + (r0 + q) * h;
    }
    const float* scale = inverse.data() + r0;
    for (int64_t i0 = 0; i0 < wide_lanes; i0 += 64) {
      switch (n) {
        case 6: values_512<6>(probs, width, value_row, i0, scale, outs); break;
        case 5: values_512<5>(probs, width, value_row, i0, scale, outs); break;
        case 4: values_512<4>(probs, width, value_row, i0, scale, outs); break;
        case 3: values_512<3>(probs, width, value_row, i0, scale, outs); break;
        case 2: values_512<2>(probs, width, value_row, i0, scale, outs); break;
        default: values_512<1>(probs, width, value_row, i0, scale, outs); break;
      }
    }
  }
  for (int64_t r = 0; r < queries; ++r) {
    const float* row = scores.data() + r * width;
    float* o = out + r * h;
    int64_t i0 = wide_lanes;
    if (vectorised && !wide) {
      const __m256 scale = _mm256_set1_ps(inverse[r]);
      for (; i0 + 64 <= h; i0 += 64) {
        __m256 acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
        for (int64_t c = 0; c < width; ++c) {
          const __m256 p = _mm256_set1_ps(row[c]);
          const float* v = value_row(c) + i0;
          for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * j), acc[j]);
        }
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(o + i0 + 8 * j, _mm256_mul_ps(acc[j], scale));
      }
    }
    for (int64_t i = i0; i < h; ++i) {  // what is left of the head (a head size that is not a multiple of 64)
      float sum = 0.0f;
      for (int64_t c = 0; c < width; ++c) sum += row[c] * value_row(c)[i];
      o[i] = sum * inverse[r];
    }
  }
}

struct Work {
  Shapes d;
  const float *q, *cache_k, *cache_v, *new_k, *new_v;
  const int32_t* lengths;
  const bool* mask;
  float* out;
  int64_t tasks;
  std::atomic<int64_t> next{0}, done{0};

  void run() {
    std::vector<float> scores, result(d.t * d.g * d.h);
    for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
      const int64_t bi = task / d.k, ki = task % d.k;
      const int64_t length = std::clamp<int64_t>(lengths[bi], 0, d.s);
      attend_head(d, q, cache_k, cache_v, length, new_k, new_v, mask, result.data(), bi, ki, scores);
      for (int64_t t = 0; t < d.t; ++t)  // result [T G, h] -> out[b, t, k, :, :]
        std::copy(result.data() + t * d.g * d.h, result.data() + (t + 1) * d.g * d.h,
                  out + ((bi * d.t + t) * d.k + ki) * d.g * d.h);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error CacheAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> cache_k,
                          ffi::Buffer<ffi::F32> cache_v, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::F32> new_k,
                          ffi::Buffer<ffi::F32> new_v, ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), cd = cache_k.dimensions(), vd = cache_v.dimensions(), nd = new_k.dimensions(),
             nvd = new_v.dimensions(), ld = lengths.dimensions(), md = mask.dimensions();
  const bool fits = qd.size() == 5 && cd.size() == 4 && cd[0] == qd[0] && cd[1] == qd[2] && cd[3] == qd[4] &&
                    vd.size() == 4 && std::equal(vd.begin(), vd.end(), cd.begin()) && nd.size() == 4 &&
                    nd[0] == qd[0] && nd[1] == qd[1] && nd[2] == qd[2] && nd[3] == qd[4] && nvd.size() == 4 &&
                    std::equal(nvd.begin(), nvd.end(), nd.begin()) && ld.size() == 1 && ld[0] == qd[0] &&
                    md.size() == 3 && md[0] == qd[0] && md[1] == qd[1] && md[2] == qd[1];
  if (!fits) {
    return ffi::Error::InvalidArgument(
        "jaxspec_cache_attention: expects q [B, T, K, G, h], the cache [B, K, S, h] twice, the new keys and values "
        "[B, T, K, h], lengths [B] and the mask [B, T, T]");
  }
  auto work = std::make_shared<Work>();
  work->d = Shapes{qd[0], qd[1], qd[2], qd[3], qd[4], cd[2]};
  work->q = q.typed_data();
  work->cache_k = cache_k.typed_data();
  work->cache_v = cache_v.typed_data();
  work->new_k = new_k.typed_data();
  work->new_v = new_v.typed_data();
  work->lengths = lengths.typed_data();
  work->mask = mask.typed_data();
  work->out = out->typed_data();
  work->tasks = work->d.b * work->d.k;
  // a hand-over to another thread takes a few microseconds: worth it from about 65,000 multiply-adds a call (scores
  // and values over the rows' real lengths, not the bucket)
  int64_t longest = 0;
  for (int64_t bi = 0; bi < work->d.b; ++bi) longest = std::max<int64_t>(longest, work->lengths[bi]);
  const int64_t per_task = 2 * work->d.t * work->d.g * work->d.h * (std::min(longest, work->d.s) + work->d.t);
  const int64_t helpers = per_task * work->tasks < (1 << 16) ? 0
                              : std::min<int64_t>(pool.num_threads(), work->tasks) - 1;
  jaxspec::run_on_pool(pool, work, helpers, work->tasks);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecCacheAttention, CacheAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
