// w @ x for a few columns of x, reading w once: the products of a verification of a few tokens on CPU.
//
// XLA:CPU multiplies one row with a matrix-vector loop that streams the weight at about the memory bandwidth, but
// 2-8 rows through a library matrix product that costs about as much as 2-4 such streams (docs/cpu-performance.md).
// This kernel streams each row of w once and multiplies it with all N columns of x (kept in L1): a verification
// of N <= 16 tokens reads the weights once. Built by jaxspec/kernels/__init__.py, called through XLA's FFI.
//
//   w: f32[out, in] (a FeatureMajorLayer matrix, or an embedding), x: f32[in, N], y: f32[out, N] = w @ x.
//   JaxspecBf16Product: the same with w bf16[out, in] (an EAGLE head stored in bfloat16), bit for bit the float32
//   kernel's products of w widened.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include <immintrin.h>

#include "xla/ffi/api/ffi.h"
#include "cpu_common.h"

namespace ffi = xla::ffi;

namespace {

using jaxspec::horizontal_sum;
using jaxspec::kHasAvx512;

constexpr int kMaxColumns = 16;
constexpr int64_t kChunkRows = 64;  // rows of w a task takes at a time

// The weights come as float32, or as bfloat16 (JaxspecBf16Product) widened in registers: a bfloat16 is the high half
// of a float32, so widening is exact, and the loops below take 8 or 16 weights in their natural order either way. A
// bfloat16 matrix thus gives, bit for bit, the products of its float32 copy while reading half the bytes.
inline float weight_at(const float* w, int64_t i) { return w[i]; }
inline float weight_at(const uint16_t* w, int64_t i) { return jaxspec::bfloat16_to_float(w[i]); }
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const uint16_t* w) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
__attribute__((target("avx512f"))) inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
__attribute__((target("avx512f"))) inline __m512 load16(const uint16_t* w) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// One row of w times G columns of x: yo[n] = w_row . xr[n] for n < G (xr is x transposed, [N, in], each column
// contiguous and kept in L1). The row is prefetched 4 KB ahead: on the 2-core EPYC that streams the weights at about
// XLA's matrix-vector bandwidth for one column, and keeps 2-4 within 1.25x of it (two rows at a time, or no
// prefetch, were 10-25% slower).
constexpr int64_t kPrefetchBytes = 4096;
constexpr int kGroup = 8;  // columns per pass over a row: 8 accumulators, one weight and one column register

template <typename W, int G>
void row_times_columns(const W* wo, const float* xr, float* yo, int64_t in, bool prefetch) {
  const int64_t vec_end = in - in % 8;
  __m256 acc[G];
  for (int n = 0; n < G; ++n) acc[n] = _mm256_setzero_ps();
  for (int64_t i = 0; i < vec_end; i += 8) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wo + i) + kPrefetchBytes, _MM_HINT_T0);
    const __m256 wv = load8(wo + i);
    for (int n = 0; n < G; ++n) acc[n] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr + n * in + i), acc[n]);
  }
  for (int n = 0; n < G; ++n) {
    float sum = horizontal_sum(acc[n]);
    for (int64_t i = vec_end; i < in; ++i) sum = std::fma(weight_at(wo, i), xr[n * in + i], sum);
    yo[n] = sum;
  }
}

// The same with 16-wide AVX-512 FMAs, for CPUs that have them (chosen at run time; the library is built for AVX2):
// half the loads and FMAs per weight, and the row prefetched into L2 (one prefetch per 64-byte line). On the 2-core
// Xeon (docs/cpu-performance.md) 10-30% faster than the 8-wide loop at 1-8 columns, and faster than XLA's own
// matrix-vector loop at one column; prefetching into L1, or two rows at a time, were slower.
template <typename W, int G>
__attribute__((target("avx512f"))) void row_times_columns_512(const W* wo, const float* xr, float* yo, int64_t in,
                                                               bool prefetch) {
  const int64_t vec_end = in - in % 16;
  __m512 acc[G];
  for (int n = 0; n < G; ++n) acc[n] = _mm512_setzero_ps();
  for (int64_t i = 0; i < vec_end; i += 16) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wo + i) + kPrefetchBytes, _MM_HINT_T1);
    const __m512 wv = load16(wo + i);
    for (int n = 0; n < G; ++n) acc[n] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xr + n * in + i), acc[n]);
  }
  for (int n = 0; n < G; ++n) {
    float sum = _mm512_reduce_add_ps(acc[n]);
    for (int64_t i = vec_end; i < in; ++i) sum = std::fma(weight_at(wo, i), xr[n * in + i], sum);
    yo[n] = sum;
  }
}

// R rows of w times G columns of x at once, 16 lanes at a time (AVX-512): R * G accumulators, so each weight load
// serves G FMAs and each column load R, where the one-row loop above loads a column for every FMA. The rows of the
// next tile are prefetched into L2 as this one's are read (prefetching 4 KB ahead within each row, as the one-row
// loop does, was slower here: 4 rows of 576 floats lie within 9 KB). On the 2-core Xeon, over SmolLM2's per-layer
// matrices (docs/cpu-performance.md, seventeenth pass): 10% faster than the one-row loop at 10-12 columns, and at 16
// faster than XLA's product, which ran 16 columns before: batch-16 decoding gains 11%. y is [out, columns]
// row-major: the tile writes y[r * columns + g]. 3 rows x 8 columns since the twentieth pass: on the 2-core EPYC,
// over matrices streamed from memory, 10-25% faster than 4 x 6 at 5-8 and 12-16 columns (16 = 8 + 8, two passes
// over the rows instead of three), level at 3; on the Xeon's cached matrices the shapes had run within 10%.
constexpr int kTileRows = 3;
constexpr int kTileColumns = 8;  // 24 accumulators, 3 weight registers and one column register of the 32
template <typename W, int R, int G>
__attribute__((target("avx512f"))) void tile_512(const W* w, const float* xr, float* y, int64_t in, int64_t columns,
                                                 bool prefetch) {
  const int64_t vec_end = in - in % 16;
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t i = 0; i < vec_end; i += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + (r + R) * in + i), _MM_HINT_T1);
      wv[r] = load16(w + r * in + i);
    }
    for (int g = 0; g < G; ++g) {
      const __m512 xv = _mm512_loadu_ps(xr + g * in + i);
      for (int r = 0; r < R; ++r) acc[r][g] = _mm512_fmadd_ps(wv[r], xv, acc[r][g]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) {
      float sum = _mm512_reduce_add_ps(acc[r][g]);
      for (int64_t i = vec_end; i < in; ++i) sum = std::fma(weight_at(w + r * in, i), xr[g * in + i], sum);
      y[r * columns + g] = sum;
    }
  }
}

template <typename W>
using TileKernel = void (*)(const W*, const float*, float*, int64_t, int64_t, bool);
template <typename W>
constexpr TileKernel<W> kTileKernels[kTileColumns + 1] = {
    nullptr, tile_512<W, kTileRows, 1>, tile_512<W, kTileRows, 2>, tile_512<W, kTileRows, 3>,
    tile_512<W, kTileRows, 4>, tile_512<W, kTileRows, 5>, tile_512<W, kTileRows, 6>, tile_512<W, kTileRows, 7>,
    tile_512<W, kTileRows, 8>};
// Which of the two loops runs is the caller's `tiles` (jaxspec.kernels.tiled_columns, measured once per machine):
// on the 2-core Xeon the one-row loop was the faster at 2-7 columns over the model's own matrices (425 MB,
// streamed from memory; 5 columns: 15.3 against 16.2 ms for SmolLM2's 120 products) and level at 8, the tiles from
// 9 on (docs/cpu-performance.md, seventeenth pass); on the 2-core EPYC the tiles win from 3 or 5 columns (twentieth).

template <typename W>
using RowKernel = void (*)(const W*, const float*, float*, int64_t, bool);
template <typename W>
constexpr RowKernel<W> kRowKernels[kGroup + 1] = {
    nullptr, row_times_columns<W, 1>, row_times_columns<W, 2>, row_times_columns<W, 3>, row_times_columns<W, 4>,
    row_times_columns<W, 5>, row_times_columns<W, 6>, row_times_columns<W, 7>, row_times_columns<W, 8>};
constexpr int kGroup512 = 16;  // AVX-512 has 32 registers: 16 accumulators, one weight and one column register
template <typename W>
constexpr RowKernel<W> kRowKernels512[kGroup512 + 1] = {
    nullptr, row_times_columns_512<W, 1>, row_times_columns_512<W, 2>, row_times_columns_512<W, 3>,
    row_times_columns_512<W, 4>, row_times_columns_512<W, 5>, row_times_columns_512<W, 6>,
    row_times_columns_512<W, 7>, row_times_columns_512<W, 8>, row_times_columns_512<W, 9>,
    row_times_columns_512<W, 10>, row_times_columns_512<W, 11>, row_times_columns_512<W, 12>,
    row_times_columns_512<W, 13>, row_times_columns_512<W, 14>, row_times_columns_512<W, 15>,
    row_times_columns_512<W, 16>};

// y[o, :] for o in [o0, o1): each row read from memory once, its columns in passes of up to 8 (the second pass
// reads the row from L1); with AVX-512 in one pass of up to 16, or with `tiles` in tiles of kTileRows rows (the
// columns in near-equal groups of at most kTileColumns, later groups reading the tile's rows from L1 or L2).
template <typename W>
void rows_times_columns(const W* w, const float* xr, float* y, int64_t in, int64_t columns, int64_t o0, int64_t o1,
                        bool tiles) {
  if (kHasAvx512 && tiles) {
    const int64_t groups = (columns + kTileColumns - 1) / kTileColumns;
    for (int64_t o = o0; o < o1;) {
      const int64_t rows = o + kTileRows <= o1 ? kTileRows : 1;
      for (int64_t k = 0, n0 = 0; k < groups; ++k) {
        const int64_t group = (columns - n0) / (groups - k);
        if (rows == kTileRows) {
          kTileKernels<W>[group](w + o * in, xr + n0 * in, y + o * columns + n0, in, columns, k == 0);
        } else {
          kRowKernels512<W>[group](w + o * in, xr + n0 * in, y + o * columns + n0, in, k == 0);
        }
        n0 += group;
      }
      o += rows;
    }
    return;
  }
  const int group_size = kHasAvx512 ? kGroup512 : kGroup;
  const RowKernel<W>* kernels = kHasAvx512 ? kRowKernels512<W> : kRowKernels<W>;
  for (int64_t o = o0; o < o1; ++o) {
    for (int64_t n0 = 0; n0 < columns; n0 += group_size) {
      const int64_t group = std::min<int64_t>(group_size, columns - n0);
      kernels[group](w + o * in, xr + n0 * in, y + o * columns + n0, in, n0 == 0);
    }
  }
}

// The chunks of one call, taken by the caller and by the tasks it schedules on XLA's intra-op pool. A task that
// starts after the last chunk was taken does nothing, so the caller waits only for the chunks, never for the tasks.
template <typename W>
struct Work {
  int64_t columns;
  bool tiles;
  const W* w;
  const float* xr;
  float* y;
  int64_t in, out, chunks;
  std::atomic<int64_t> next{0}, done{0};

  void run() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      const int64_t o0 = c * kChunkRows, o1 = std::min(out, o0 + kChunkRows);
      rows_times_columns(w, xr, y, in, columns, o0, o1, tiles);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// y = w @ x with w [out, in] (float32 or bfloat16 as uint16_t), x [in, N], y [out, N]; tiles: the 3-row tiles
// (AVX-512 only; else the one-row loop); `name` for the messages.
template <typename W>
ffi::Error product(ffi::ThreadPool& pool, const W* w, ffi::Span<const int64_t> w_dims, const float* xd,
                   ffi::Span<const int64_t> x_dims, float* y, bool tiles, const char* name) {
  if (w_dims.size() != 2 || x_dims.size() != 2 || w_dims[1] != x_dims[0]) {
    return ffi::Error::InvalidArgument(std::string(name) + ": expects w [out, in] and x [in, N]");
  }
  const int64_t out = w_dims[0], in = w_dims[1], columns = x_dims[1];
  if (columns < 1 || columns > kMaxColumns) {
    return ffi::Error::InvalidArgument(std::string(name) + ": x must have 1 to 16 columns");
  }
  // x transposed: [N, in], 64-byte aligned (a 16-lane load that straddles two cache lines costs two)
  std::unique_ptr<float, decltype(&std::free)> xr(
      static_cast<float*>(std::aligned_alloc(64, ((columns * in * sizeof(float) + 63) / 64) * 64)), &std::free);
  if (xr == nullptr) return ffi::Error(ffi::ErrorCode::kResourceExhausted, std::string(name) + ": out of memory");
  for (int64_t i = 0; i < in; ++i)
    for (int64_t n = 0; n < columns; ++n) xr.get()[n * in + i] = xd[i * columns + n];
  auto work = std::make_shared<Work<W>>();
  work->columns = columns;
  work->tiles = tiles;
  work->w = w;
  work->xr = xr.get();
  work->y = y;
  work->in = in;
  work->out = out;
  work->chunks = (out + kChunkRows - 1) / kChunkRows;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->chunks) - 1;
  jaxspec::run_on_pool(pool, work, helpers, work->chunks);
  return ffi::Error::Success();
}

ffi::Error SmallProduct(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> x,
                        ffi::ResultBuffer<ffi::F32> y, int32_t tiles) {
  return product(pool, w.typed_data(), w.dimensions(), x.typed_data(), x.dimensions(), y->typed_data(), tiles != 0,
                 "jaxspec_small_product");
}

ffi::Error Bf16Product(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> w, ffi::Buffer<ffi::F32> x,
                       ffi::ResultBuffer<ffi::F32> y, int32_t tiles) {
  return product(pool, reinterpret_cast<const uint16_t*>(w.untyped_data()), w.dimensions(), x.typed_data(),
                 x.dimensions(), y->typed_data(), tiles != 0, "jaxspec_bf16_product");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecSmallProduct, SmallProduct,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("tiles"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecBf16Product, Bf16Product,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("tiles"));
