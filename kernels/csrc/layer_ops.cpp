// The elementwise ops of a decoder layer, each in one pass over memory instead of a chain of torch ops (HF's
// RMSNorm is 8 ops with two dtype casts in bf16; SiLU-and-multiply is 2 plus the slices of the fused gate/up):
//   rms_norm:  out = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)      (HF's LlamaRMSNorm)
//   silu_mul:  out = silu(gate) * up, row by row (gate and up: often the two halves of the fused gate/up output)
//   rotary:    x = x * cos + rotate_half(x) * sin, in place, for the first `heads` heads of each row (the q and k
//              heads of the fused q/k/v projection's output; HF's apply_rotary_pos_emb)
// Rounding follows the torch ops they replace: bf16 is computed in float and rounded where torch rounds (the
// normalized row before the weight, silu(gate) before the product); only the order of the mean's sum differs.
//
// Layouts: rows of `cols` contiguous elements, `*_stride` elements apart.
#include <omp.h>

#include <cmath>
#include <cstdint>

#include "vec_math.h"

namespace {

using paged_hf::F16x;

constexpr int64_t kSerialWork = 1 << 16;  // elements below which one thread beats the OpenMP region

// --- float and bf16 rows, 16 lanes at a time -------------------------------------------------------------------
template <typename T> inline F16x load16(const T *p);
template <> inline F16x load16<float>(const float *p) {
  F16x v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
template <> inline F16x load16<uint16_t>(const uint16_t *p) { return paged_hf::load_bf16x16(p); }

template <typename T> inline void store16(T *p, F16x v);
template <> inline void store16<float>(float *p, F16x v) { __builtin_memcpy(p, &v, sizeof(v)); }
template <> inline void store16<uint16_t>(uint16_t *p, F16x v) { paged_hf::store_bf16x16(p, v); }

inline float load1(const float *p) { return *p; }
inline float load1(const uint16_t *p) { return paged_hf::bf16_to_float(*p); }
inline void store1(float *p, float v) { *p = v; }
inline void store1(uint16_t *p, float v) { *p = paged_hf::float_to_bf16(v); }

// rounded to the storage dtype and back: what torch's `.to(dtype)` between two ops does
inline F16x round_as(const float *, F16x v) { return v; }
inline F16x round_as(const uint16_t *, F16x v) {
  uint16_t h[16];
  paged_hf::store_bf16x16(h, v);
  return paged_hf::load_bf16x16(h);
}
inline float round_as(const float *, float v) { return v; }
inline float round_as(const uint16_t *, float v) { return paged_hf::bf16_to_float(paged_hf::float_to_bf16(v)); }

template <typename T>
void rms_norm_row(const T *x, T *out, const T *weight, int64_t cols, double eps) {
  const int64_t vec = cols - cols % 16;
  F16x acc = {};
  for (int64_t k = 0; k < vec; k += 16) {
    const F16x v = load16(x + k);
    acc += v * v;
  }
  float sum = 0;
  for (int l = 0; l < 16; ++l) sum += acc[l];
  for (int64_t k = vec; k < cols; ++k) sum += load1(x + k) * load1(x + k);
  const float scale = 1.0f / std::sqrt(sum / static_cast<float>(cols) + static_cast<float>(eps));
  for (int64_t k = 0; k < vec; k += 16)
    store16(out + k, load16(weight + k) * round_as(x, load16(x + k) * scale));
  for (int64_t k = vec; k < cols; ++k) store1(out + k, load1(weight + k) * round_as(x, load1(x + k) * scale));
}

// silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|) (an argument <= 0: vec_math's polynomial holds)
inline F16x silu16(F16x g) {
  const F16x magnitude = g < 0 ? -g : g;
  const F16x e = paged_hf::exp_nonpositive(-magnitude);
  const F16x sigmoid = g < 0 ? e / (1.0f + e) : 1.0f / (1.0f + e);
  return g * sigmoid;
}

template <typename T>
void silu_mul_row(const T *gate, const T *up, T *out, int64_t cols) {
  const int64_t vec = cols - cols % 16;
  for (int64_t k = 0; k < vec; k += 16) store16(out + k, round_as(gate, silu16(load16(gate + k))) * load16(up + k));
  for (int64_t k = vec; k < cols; ++k) {
    const float g = load1(gate + k);
    store1(out + k, round_as(gate, g / (1.0f + std::exp(-g))) * load1(up + k));
  }
}

// rotate_half(x) = cat(-x2, x1); each product and the sum rounded as torch's three bf16 ops round them
template <typename T>
void rotary_row(T *row, const T *cos, const T *sin, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T *x = row + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = load1(x + i), x2 = load1(x + half + i);
      const float first = round_as(x, x1 * load1(cos + i)) + round_as(x, -x2 * load1(sin + i));
      const float second = round_as(x, x2 * load1(cos + half + i)) + round_as(x, x1 * load1(sin + half + i));
      store1(x + i, first);
      store1(x + half + i, second);
    }
  }
}

// --- float64 rows: the reference dtype, plain loops. HF's RMSNorm computes in float32 whatever the input, so
// the normalized row is float here too; the weight multiplies in double.
void rms_norm_row(const double *x, double *out, const double *weight, int64_t cols, double eps) {
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t k = 0; k < cols; ++k) sum += static_cast<float>(x[k]) * static_cast<float>(x[k]);
  const float scale = 1.0f / std::sqrt(sum / static_cast<float>(cols) + static_cast<float>(eps));
  for (int64_t k = 0; k < cols; ++k) out[k] = weight[k] * static_cast<double>(static_cast<float>(x[k]) * scale);
}

void silu_mul_row(const double *gate, const double *up, double *out, int64_t cols) {
  for (int64_t k = 0; k < cols; ++k) out[k] = gate[k] / (1.0 + std::exp(-gate[k])) * up[k];
}

void rotary_row(double *row, const double *cos, const double *sin, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    double *x = row + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const double x1 = x[i], x2 = x[half + i];
      x[i] = x1 * cos[i] + (-x2 * sin[i]);
      x[half + i] = x2 * cos[half + i] + x1 * sin[half + i];
    }
  }
}

template <typename F>
void for_rows(int64_t rows, int64_t cols, int threads, F row) {
  if (rows * cols < kSerialWork || threads <= 1 || rows == 1) {
    for (int64_t i = 0; i < rows; ++i) row(i);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; ++i) row(i);
}

template <typename T>
int rms_norm(const void *x, int64_t x_stride, void *out, int64_t out_stride, const void *weight, int64_t rows,
             int64_t cols, double eps, int threads) {
  const T *xs = static_cast<const T *>(x);
  T *outs = static_cast<T *>(out);
  const T *w = static_cast<const T *>(weight);
  for_rows(rows, cols, threads,
           [&](int64_t i) { rms_norm_row(xs + i * x_stride, outs + i * out_stride, w, cols, eps); });
  return 0;
}

template <typename T>
int silu_mul(const void *gate, int64_t gate_stride, const void *up, int64_t up_stride, void *out, int64_t out_stride,
             int64_t rows, int64_t cols, int threads) {
  const T *g = static_cast<const T *>(gate), *u = static_cast<const T *>(up);
  T *outs = static_cast<T *>(out);
  for_rows(rows, cols, threads,
           [&](int64_t i) { silu_mul_row(g + i * gate_stride, u + i * up_stride, outs + i * out_stride, cols); });
  return 0;
}

template <typename T>
int rotary(void *x, int64_t x_stride, const void *cos, const void *sin, int64_t cs_stride, int64_t rows,
           int64_t heads, int64_t head_dim, int threads) {
  T *xs = static_cast<T *>(x);
  const T *c = static_cast<const T *>(cos), *s = static_cast<const T *>(sin);
  for_rows(rows, heads * head_dim, threads,
           [&](int64_t i) { rotary_row(xs + i * x_stride, c + i * cs_stride, s + i * cs_stride, heads, head_dim); });
  return 0;
}

}  // namespace

#define PAGED_HF_LAYER_OPS(NAME, T)                                                                              \
  extern "C" int rms_norm_##NAME(const void *x, int64_t x_stride, void *out, int64_t out_stride,                \
                                 const void *weight, int64_t rows, int64_t cols, double eps, int threads) {     \
    return rms_norm<T>(x, x_stride, out, out_stride, weight, rows, cols, eps, threads);                         \
  }                                                                                                             \
  extern "C" int silu_mul_##NAME(const void *gate, int64_t gate_stride, const void *up, int64_t up_stride,     \
                                 void *out, int64_t out_stride, int64_t rows, int64_t cols, int threads) {      \
    return silu_mul<T>(gate, gate_stride, up, up_stride, out, out_stride, rows, cols, threads);                 \
  }                                                                                                             \
  extern "C" int rotary_##NAME(void *x, int64_t x_stride, const void *cos, const void *sin, int64_t cs_stride,  \
                               int64_t rows, int64_t heads, int64_t head_dim, int threads) {                   \
    return rotary<T>(x, x_stride, cos, sin, cs_stride, rows, heads, head_dim, threads);                         \
  }

PAGED_HF_LAYER_OPS(float32, float)
PAGED_HF_LAYER_OPS(bfloat16, uint16_t)
PAGED_HF_LAYER_OPS(float64, double)
