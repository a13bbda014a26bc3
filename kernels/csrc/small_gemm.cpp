// Linears at one to a few rows (a decode step of one or a few requests): y = x W^T (+ b), each weight read once
// from memory at the read limit, in the layout the model has it (row-major [n, k], no copy).
//
// At a few rows a linear reads far more weight bytes than it computes: on the default model's shapes oneDNN's
// matmul reads a bf16 weight at ~18 GB/s at one row (its per-call work and its blocking for larger batches),
// where the machine reads ~25-45 GB/s. Here each thread streams its own rows of W: at one row of x one row of W
// after another (AVX-512; one stream per thread read 2-12% more GB/s than four interleaved on an AMD EPYC Zen 4),
// at more rows of x a few rows of W at once, every loaded vector used for all `m` rows of x (held in L1); the
// sums kept in float32 lanes and reduced once per output. Outputs round to bf16 to nearest even, as torch does.
//
// Two builds of the same loops, chosen by the CPU the library is compiled on (-march=native):
// - AVX-512: 64 bytes of each row per step; bf16 products use AVX512-BF16 (vdpbf16ps) where the CPU has it, else
//   bf16 widened to float32 and FMAs; float32 uses FMAs.
// - AVX2 + FMA (AMD Zen 2/3, Intel before Skylake-X): 8 floats per step, bf16 widened to float32, 16 registers.
//
// `segments`: several weights over the same x, their outputs side by side in y (the q/k/v or gate/up
// projections of one module as one call). Threads split the rows of all segments evenly.
//
// Elsewhere small_gemm_isa() says "" and the engine keeps oneDNN.

#include <cstdint>
#include <cstring>

#include "vec_math.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <omp.h>

namespace {

constexpr int kMaxRows = 8;  // rows of x per call
#ifndef PAGED_HF_AHEAD
#define PAGED_HF_AHEAD 8192
#endif
constexpr int kAhead = PAGED_HF_AHEAD;  // bytes each weight row's stream is prefetched ahead

struct Segments {
  const void *const *weights;  // [count] each [rows[s], k], row-major
  const int64_t *rows;         // [count]
  const void *const *biases;   // [count] each [rows[s]] or null
  int64_t count;
};

#if defined(__AVX512F__)  // 64 bytes of each row a step, masked tails

inline __m512 bf16_widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// acc += w . x over 32 bf16 pairs at once (16 float lanes).
inline __m512 dot32_bf16(__m512 acc, __m512i w, __m512i x) {
#if defined(__AVX512BF16__)
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
#else
  acc = _mm512_fmadd_ps(bf16_widen(_mm512_castsi512_si256(w)), bf16_widen(_mm512_castsi512_si256(x)), acc);
  return _mm512_fmadd_ps(bf16_widen(_mm512_extracti64x4_epi64(w, 1)), bf16_widen(_mm512_extracti64x4_epi64(x, 1)),
                         acc);
#endif
}

// R rows of W times M rows of x: out[i][r] = x[i] . W[r], float32 sums. Each step loads 64 bytes of x's rows
// once and of each weight row once; every weight vector meets every row of x.
template <int M, int R>
inline void tile_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, int64_t k, float (&out)[M][R]) {
  __m512 acc[M][R];
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; kk += 32) {
    const __mmask32 mask = k - kk >= 32 ? ~__mmask32(0) : (__mmask32(1) << (k - kk)) - 1;
    __m512i xv[M];
    for (int i = 0; i < M; ++i) xv[i] = _mm512_maskz_loadu_epi16(mask, x + i * x_stride + kk);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char *>(w + r * k + kk) + kAhead, _MM_HINT_T1);
      const __m512i wv = _mm512_maskz_loadu_epi16(mask, w + r * k + kk);
      for (int i = 0; i < M; ++i) acc[i][r] = dot32_bf16(acc[i][r], wv, xv[i]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
}

template <int M, int R>
inline void tile_f32(const float *x, int64_t x_stride, const float *w, int64_t k, float (&out)[M][R]) {
  __m512 acc[M][R];
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; kk += 16) {
    const __mmask16 mask = k - kk >= 16 ? __mmask16(0xffff) : __mmask16((1u << (k - kk)) - 1);
    __m512 xv[M];
    for (int i = 0; i < M; ++i) xv[i] = _mm512_maskz_loadu_ps(mask, x + i * x_stride + kk);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char *>(w + r * k + kk) + kAhead, _MM_HINT_T1);
      const __m512 wv = _mm512_maskz_loadu_ps(mask, w + r * k + kk);
      for (int i = 0; i < M; ++i) acc[i][r] = _mm512_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
}

// One row of W against one row of x: at one row of x a single stream of weights per thread, left to the hardware
// prefetchers, reads nearer the limit than R rows interleaved (or one row with the tiles' prefetch ahead). One sum
// per output in the tiles' order: a row's output has the same bits at one row of x as among several.
inline float row_dot(const uint16_t *x, const uint16_t *w, int64_t k) {
  __m512 sum = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + 32 <= k; kk += 32) sum = dot32_bf16(sum, _mm512_loadu_si512(w + kk), _mm512_loadu_si512(x + kk));
  if (kk < k) {
    const __mmask32 mask = (__mmask32(1) << (k - kk)) - 1;
    sum = dot32_bf16(sum, _mm512_maskz_loadu_epi16(mask, w + kk), _mm512_maskz_loadu_epi16(mask, x + kk));
  }
  return _mm512_reduce_add_ps(sum);
}

inline float row_dot(const float *x, const float *w, int64_t k) {
  __m512 sum = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + 16 <= k; kk += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(w + kk), _mm512_loadu_ps(x + kk), sum);
  if (kk < k) {
    const __mmask16 mask = __mmask16((1u << (k - kk)) - 1);
    sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, w + kk), _mm512_maskz_loadu_ps(mask, x + kk), sum);
  }
  return _mm512_reduce_add_ps(sum);
}

#else  // AVX2 + FMA

// acc[i][r] += x[i][kk:kk+8] . w[r][kk:kk+8] as floats (bf16 widened: its bits are a float's top half).
inline __m256 load8(const float *p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t *p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline float reduce8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <int M, int R, typename T>
inline void step8(const T *x, int64_t x_stride, const T *w, int64_t k, int64_t kk, __m256 (&acc)[M][R]) {
  __m256 xv[M];
  for (int i = 0; i < M; ++i) xv[i] = load8(x + i * x_stride + kk);
  for (int r = 0; r < R; ++r) {
    if ((kk * sizeof(T)) % 64 == 0) _mm_prefetch(reinterpret_cast<const char *>(w + r * k + kk) + kAhead, _MM_HINT_T1);
    const __m256 wv = load8(w + r * k + kk);
    for (int i = 0; i < M; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
  }
}

// R rows of W times M rows of x, 8 columns a step; the last k % 8 columns from zero-padded copies.
template <int M, int R, typename T>
inline void tile(const T *x, int64_t x_stride, const T *w, int64_t k, float (&out)[M][R]) {
  __m256 acc[M][R];
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  int64_t kk = 0;
  for (; kk + 8 <= k; kk += 8) step8<M, R>(x, x_stride, w, k, kk, acc);
  if (kk < k) {
    T xs[M][8] = {}, ws[R][8] = {};
    for (int64_t c = kk; c < k; ++c) {
      for (int i = 0; i < M; ++i) xs[i][c - kk] = x[i * x_stride + c];
      for (int r = 0; r < R; ++r) ws[r][c - kk] = w[r * k + c];
    }
    step8<M, R>(&xs[0][0], 8, &ws[0][0], 8, 0, acc);
  }
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) out[i][r] = reduce8(acc[i][r]);
}

template <int M, int R>
inline void tile_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, int64_t k, float (&out)[M][R]) {
  tile<M, R>(x, x_stride, w, k, out);
}
template <int M, int R>
inline void tile_f32(const float *x, int64_t x_stride, const float *w, int64_t k, float (&out)[M][R]) {
  tile<M, R>(x, x_stride, w, k, out);
}

#endif

template <typename T> inline float to_float(T v) {
  if constexpr (sizeof(T) == 2) return paged_hf::bf16_to_float(v); else return v;
}
template <typename T> inline T from_float(float v) {
  if constexpr (sizeof(T) == 2) return paged_hf::float_to_bf16(v); else return v;
}

// Rows [first, last) of one segment, written at column `column` of y.
template <typename T, int M>
void segment_rows(const T *x, int64_t x_stride, int64_t k, const T *w, const T *bias, int64_t first, int64_t last,
                  T *y, int64_t y_stride, int64_t column) {
#if defined(__AVX512F__)
  if constexpr (M == 1) {  // one row of W after another
    for (int64_t row = first; row < last; ++row) {
      const float b = bias != nullptr ? to_float(bias[row]) : 0.0f;
      y[column + row] = from_float<T>(row_dot(x, w + row * k, k) + b);
    }
    return;
  }
  constexpr int R = M <= 4 ? 4 : 2;  // accumulators: M * R (with M of x and one of W) of the 32 registers
#else
  constexpr int R = M <= 2 ? 4 : M <= 4 ? 2 : 1;  // of the 16 registers
#endif
  int64_t row = first;
  auto emit = [&](const auto &out, int rows) {
    for (int i = 0; i < M; ++i)
      for (int r = 0; r < rows; ++r) {
        const float b = bias != nullptr ? to_float(bias[row + r]) : 0.0f;
        y[i * y_stride + column + row + r] = from_float<T>(out[i][r] + b);
      }
  };
  for (; row + R <= last; row += R) {
    float out[M][R];
    if constexpr (sizeof(T) == 2) tile_bf16<M, R>(x, x_stride, w + row * k, k, out);
    else tile_f32<M, R>(x, x_stride, w + row * k, k, out);
    emit(out, R);
  }
  for (; row < last; ++row) {
    float out[M][1];
    if constexpr (sizeof(T) == 2) tile_bf16<M, 1>(x, x_stride, w + row * k, k, out);
    else tile_f32<M, 1>(x, x_stride, w + row * k, k, out);
    emit(out, 1);
  }
}

template <typename T, int M>
void gemm_rows(const T *x, int64_t x_stride, int64_t k, const Segments &s, T *y, int64_t y_stride, int64_t first,
               int64_t last) {
  int64_t start = 0;  // the first row of segment `seg` among all segments' rows
  for (int64_t seg = 0; seg < s.count && start < last; start += s.rows[seg], ++seg) {
    const int64_t lo = first > start ? first : start, hi = last < start + s.rows[seg] ? last : start + s.rows[seg];
    if (lo < hi)
      segment_rows<T, M>(x, x_stride, k, static_cast<const T *>(s.weights[seg]),
                         static_cast<const T *>(s.biases[seg]), lo - start, hi - start, y, y_stride, start);
  }
}

template <typename T>
int gemm(const T *x, int64_t x_stride, int64_t m, int64_t k, const Segments &s, T *y, int64_t y_stride, int threads) {
  if (m < 1 || m > kMaxRows || k < 1) return 2;
  int64_t total = 0;
  for (int64_t seg = 0; seg < s.count; ++seg) total += s.rows[seg];
  const int64_t align = 4;  // thread boundaries on whole tiles
#pragma omp parallel num_threads(threads)
  {
    const int64_t team = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t per = ((total + team - 1) / team + align - 1) / align * align;
    const int64_t first = id * per < total ? id * per : total, last = first + per < total ? first + per : total;
    switch (m) {
#define PAGED_HF_ROWS(M) case M: gemm_rows<T, M>(x, x_stride, k, s, y, y_stride, first, last); break;
      PAGED_HF_ROWS(1) PAGED_HF_ROWS(2) PAGED_HF_ROWS(3) PAGED_HF_ROWS(4)
      PAGED_HF_ROWS(5) PAGED_HF_ROWS(6) PAGED_HF_ROWS(7) PAGED_HF_ROWS(8)
#undef PAGED_HF_ROWS
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// What the loops compute with: "avx512_bf16" (bf16 products native), "avx512" or "avx2"; "" (not built here).
const char *small_gemm_isa() {
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#else
  return "avx2";
#endif
}

int small_gemm_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const void *const *weights,
                   const int64_t *rows, const void *const *biases, int64_t count, float *y, int64_t y_stride,
                   int threads) {
  return gemm<float>(x, x_stride, m, k, Segments{weights, rows, biases, count}, y, y_stride, threads);
}

int small_gemm_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const void *const *weights,
                    const int64_t *rows, const void *const *biases, int64_t count, uint16_t *y, int64_t y_stride,
                    int threads) {
  return gemm<uint16_t>(x, x_stride, m, k, Segments{weights, rows, biases, count}, y, y_stride, threads);
}
}

#else  // neither AVX-512 nor AVX2: nothing here; the engine keeps its GEMM (oneDNN)

extern "C" const char *small_gemm_isa() { return ""; }

#endif
