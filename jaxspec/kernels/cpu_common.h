// What jaxspec's CPU kernels share: whether the CPU has AVX-512, a bfloat16 widened to float32, a horizontal sum of 8
// lanes, and running a call's work on XLA's intra-op pool.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include <immintrin.h>

#include "xla/ffi/api/ffi.h"

namespace jaxspec {

// The kernels are built for AVX2 and run their AVX-512 loops (`__attribute__((target("avx512f")))`) where this holds.
inline const bool kHasAvx512 = __builtin_cpu_supports("avx512f");

// A bfloat16 (its bits) as the float32 it stands for: the high half of a float32, so exact.
inline float bfloat16_to_float(uint16_t value) {
  const uint32_t bits = uint32_t(value) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

inline float horizontal_sum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_hadd_ps(a, a);
  a = _mm_hadd_ps(a, a);
  return _mm_cvtss_f32(a);
}

// Runs work->run() on the caller and on `helpers` tasks scheduled on XLA's intra-op pool, then waits until
// work->done reaches `items`. Work::run takes items (chunks of rows, heads) until none is left, so a task that starts
// after the last was taken does nothing and the caller waits only for the items, never for the tasks. The wait
// spins briefly, then gives the core away (with other processes on the cores, a helper may be waiting for the very
// core this loop would hold).
template <typename Work>
void run_on_pool(xla::ffi::ThreadPool& pool, const std::shared_ptr<Work>& work, int64_t helpers, int64_t items) {
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->run(); });
  work->run();
  for (int spins = 0; work->done.load(std::memory_order_acquire) < items; ++spins) {
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace jaxspec
