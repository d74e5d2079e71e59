// Attention of a few new queries over a row's committed cache slots, reading only the slots that hold tokens.
//
// XLA:CPU runs the cache products of `jaxspec.model._attention` as batched library products over every slot of the
// cache (up to the bucket size, whatever a row's length), with a transposed copy of the values and one small product
// per (row, key/value head): at batch 16 and 128 slots about 40 ms of a 200 ms step on the 2-core EPYC. This kernel
// reads each row's keys and values once, up to its length, for all its queries (T new tokens x G query heads per
// key/value head), with a vectorised exponential. Built with small_product.cc (jaxspec/kernels/__init__.py).
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

struct Shapes {
  int64_t b, t, k, g, h, s;
};

// One (row, key/value head): its T x G queries over the row's first `length` slots and the new tokens they may see.
// scores: scratch of T G x (length + T) floats.
void attend_head(const Shapes& d, const float* q, const float* cache_k, const float* cache_v, int64_t length,
                 const float* new_k, const float* new_v, const bool* mask, float* out, int64_t bi, int64_t ki,
                 std::vector<float>& scores) {
  const int64_t h = d.h, queries = d.t * d.g, width = length + d.t;
  scores.assign(queries * width, 0.0f);
  const float* keys = cache_k + (bi * d.k + ki) * d.s * h;    // [S, h]
  const float* values = cache_v + (bi * d.k + ki) * d.s * h;  // [S, h]
  auto query = [&](int64_t t, int64_t g) { return q + (((bi * d.t + t) * d.k + ki) * d.g + g) * h; };
  auto new_row = [&](const float* x, int64_t u) { return x + ((bi * d.t + u) * d.k + ki) * h; };
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
  // scores: each key read once for all the queries
  for (int64_t s = 0; s < length; ++s) {
    const float* key = keys + s * h;
    for (int64_t t = 0; t < d.t; ++t)
      for (int64_t g = 0; g < d.g; ++g) scores[(t * d.g + g) * width + s] = dot(query(t, g), key);
  }
  const float hidden = -INFINITY;
  for (int64_t t = 0; t < d.t; ++t) {
    for (int64_t u = 0; u < d.t; ++u) {
      const bool seen = mask[(bi * d.t + t) * d.t + u];
      for (int64_t g = 0; g < d.g; ++g)
        scores[(t * d.g + g) * width + length + u] = seen ? dot(query(t, g), new_row(new_k, u)) : hidden;
    }
  }
  // softmax of each query's scores (a query sees at least itself, so every maximum is finite)
  for (int64_t r = 0; r < queries; ++r) {
    float* row = scores.data() + r * width;
    float top = -INFINITY;
    for (int64_t i = 0; i < width; ++i) top = std::max(top, row[i]);
    const __m256 top8 = _mm256_set1_ps(top);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= width; i += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + i), top8));
      _mm256_storeu_ps(row + i, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = horizontal_sum(sum8);
    for (; i < width; ++i) {
      row[i] = row[i] == hidden ? 0.0f : std::exp(row[i] - top);
      sum += row[i];
    }
    const float inverse = 1.0f / sum;
    for (i = 0; i < width; ++i) row[i] *= inverse;
  }
  // out = probabilities x values: each value row read once for all the queries
  for (int64_t r = 0; r < queries; ++r) std::fill(out + r * h, out + (r + 1) * h, 0.0f);  // out: [T G, h] scratch
  auto accumulate = [&](const float* value, int64_t column) {
    for (int64_t r = 0; r < queries; ++r) {
      const float p = scores[r * width + column];
      float* o = out + r * h;
      if (vectorised) {
        const __m256 p8 = _mm256_set1_ps(p);
        for (int64_t i = 0; i < h; i += 8)
          _mm256_storeu_ps(o + i, _mm256_fmadd_ps(p8, _mm256_loadu_ps(value + i), _mm256_loadu_ps(o + i)));
      } else {
        for (int64_t i = 0; i < h; ++i) o[i] += p * value[i];
      }
    }
  };
  for (int64_t s = 0; s < length; ++s) accumulate(values + s * h, s);
  for (int64_t u = 0; u < d.t; ++u) accumulate(new_row(new_v, u), length + u);
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
  // a task of a few thousand multiply-adds is not worth a hand-over to another thread
  const int64_t per_task = work->d.t * work->d.g * work->d.h * (work->d.s + work->d.t);
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
