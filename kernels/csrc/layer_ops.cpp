// The elementwise ops of a decoder layer, each in one pass over memory instead of a chain of torch ops (HF's
// RMSNorm is 8 ops with two dtype casts in bf16; SiLU-and-multiply is 2 plus the slices of the fused gate/up):
//   rms_norm:  out = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)      (HF's LlamaRMSNorm)
//   silu_mul:  out = silu(gate) * up, row by row (gate and up: often the two halves of the fused gate/up output)
//   rotary:    x = x * cos + rotate_half(x) * sin, in place, for the first `heads` heads of each row (the q and k
//              heads of the fused q/k/v projection's output; HF's apply_rotary_pos_emb)
//   rotary_write: the same, then each row's K and V to its slot in the paged cache (worker/lean_layers.py)
// Rounding follows the torch ops they replace: bf16 is computed in float and rounded where torch rounds (the
// normalized row before the weight, silu(gate) before the product); only the order of the mean's sum differs.
//
// Layouts: rows of `cols` contiguous elements, `*_stride` elements apart.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>

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
inline F16x round_as(const uint16_t *, F16x v) { return paged_hf::round_bf16(v); }
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

// residual + h rounded as torch's add rounds it (the decoder layer's residual stream), then its RMSNorm
template <typename T>
void add_rms_norm_row(const T *x, const T *h, T *sum, T *out, const T *weight, int64_t cols, double eps) {
  const int64_t vec = cols - cols % 16;
  for (int64_t k = 0; k < vec; k += 16) store16(sum + k, load16(x + k) + load16(h + k));
  for (int64_t k = vec; k < cols; ++k) store1(sum + k, load1(x + k) + load1(h + k));
  rms_norm_row(sum, out, weight, cols, eps);
}

// silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|) (an argument <= 0: vec_math's polynomial holds)
inline F16x silu16(F16x g) {
  const F16x magnitude = g < 0 ? -g : g;
  const F16x e = paged_hf::exp_nonpositive(-magnitude);
  const F16x sigmoid = (g < 0 ? e : F16x{} + 1.0f) / (1.0f + e);  // one division: e/(1+e) or 1/(1+e)
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

// a quantized linear's input scaled per channel (SmoothQuant), handed on in float: out = float(round_as(x, x * s)),
// as torch's `(x.float() * s).to(x.dtype)` then `.float()` (float64 rows: `x.float() * s`)
template <typename T>
void scale_row(const T *x, const float *s, float *out, int64_t cols) {
  const int64_t vec = cols - cols % 16;
  for (int64_t k = 0; k < vec; k += 16) store16(out + k, round_as(x, load16(x + k) * load16(s + k)));
  for (int64_t k = vec; k < cols; ++k) out[k] = round_as(x, load1(x + k) * s[k]);
}

// rotate_half(x) = cat(-x2, x1); each product and the sum rounded as torch's three bf16 ops round them. Sixteen
// pairs at a time where the half head is a multiple of 16 (head_dim 64, 128, ...), one at a time otherwise.
template <typename T>
void rotary_row(T *row, const T *cos, const T *sin, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2, vec = half - half % 16;
  for (int64_t h = 0; h < heads; ++h) {
    T *x = row + h * head_dim;
    for (int64_t i = 0; i < vec; i += 16) {
      const F16x x1 = load16(x + i), x2 = load16(x + half + i);
      const F16x first = round_as(x, x1 * load16(cos + i)) + round_as(x, -x2 * load16(sin + i));
      const F16x second = round_as(x, x2 * load16(cos + half + i)) + round_as(x, x1 * load16(sin + half + i));
      store16(x + i, first);
      store16(x + half + i, second);
    }
    for (int64_t i = vec; i < half; ++i) {
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

void add_rms_norm_row(const double *x, const double *h, double *sum, double *out, const double *weight,
                      int64_t cols, double eps) {
  for (int64_t k = 0; k < cols; ++k) sum[k] = x[k] + h[k];
  rms_norm_row(sum, out, weight, cols, eps);
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

// --- the greedy sampler's argmax: the first index of each row's maximum, a NaN counting as the maximum (torch.max's
// indices). Sixteen lanes keep their own best (strictly greater: a lane keeps its first), merged at the end.
template <typename T>
int64_t argmax_row(const T *x, int64_t cols) {
  typedef int32_t I __attribute__((vector_size(64)));
  const int64_t vec = cols - cols % 16;
  float value = -__builtin_inff();
  int64_t index = -1;
  bool nan = false;
  if (vec > 0) {
    const I lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    F16x best = load16(x);
    I where = lane, nans = best != best;
    for (int64_t k = 16; k < vec; k += 16) {
      const F16x v = load16(x + k);
      const I greater = v > best;  // NaN > best is false: best stays a number
      best = greater ? v : best;
      where = greater ? lane + static_cast<int32_t>(k) : where;
      nans |= v != v;
    }
    for (int l = 0; l < 16; ++l) {
      nan |= nans[l] != 0;
      if (index < 0 || best[l] > value || (best[l] == value && where[l] < index)) value = best[l], index = where[l];
    }
  }
  for (int64_t k = vec; k < cols; ++k) {
    const float v = load1(x + k);
    nan |= v != v;
    if (index < 0 || v > value) value = v, index = k;
  }
  if (nan)
    for (int64_t k = 0; k < cols; ++k)
      if (load1(x + k) != load1(x + k)) return k;
  return index;
}

int64_t argmax_row(const double *x, int64_t cols) {
  int64_t index = 0;
  for (int64_t k = 0; k < cols; ++k) {
    if (x[k] != x[k]) return k;
    if (x[k] > x[index]) index = k;
  }
  return index;
}

void scale_row(const double *x, const float *s, float *out, int64_t cols) {
  for (int64_t k = 0; k < cols; ++k) out[k] = static_cast<float>(x[k]) * s[k];
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
int add_rms_norm(const void *x, int64_t x_stride, const void *h, int64_t h_stride, void *sum, void *out,
                 const void *weight, int64_t rows, int64_t cols, double eps, int threads) {
  const T *xs = static_cast<const T *>(x), *hs = static_cast<const T *>(h), *w = static_cast<const T *>(weight);
  T *sums = static_cast<T *>(sum), *outs = static_cast<T *>(out);
  for_rows(rows, cols, threads, [&](int64_t i) {
    add_rms_norm_row(xs + i * x_stride, hs + i * h_stride, sums + i * cols, outs + i * cols, w, cols, eps);
  });
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

// a fused q/k/v output's rows into the paged cache: rotary on each row's first `heads` heads (q's and k's), then
// its K and V (kv_cols elements each, from key_start and key_start + kv_cols) to row slots[i] of the caches
template <typename T>
int rotary_write(void *x, int64_t x_stride, const void *cos, const void *sin, int64_t cs_stride, int64_t rows,
                 int64_t heads, int64_t head_dim, int64_t key_start, int64_t kv_cols, void *key_cache,
                 void *value_cache, const int64_t *slots, int threads) {
  T *xs = static_cast<T *>(x), *keys = static_cast<T *>(key_cache), *values = static_cast<T *>(value_cache);
  const T *c = static_cast<const T *>(cos), *s = static_cast<const T *>(sin);
  for_rows(rows, heads * head_dim, threads, [&](int64_t i) {
    T *row = xs + i * x_stride;
    rotary_row(row, c + i * cs_stride, s + i * cs_stride, heads, head_dim);
    std::memcpy(keys + slots[i] * kv_cols, row + key_start, kv_cols * sizeof(T));
    std::memcpy(values + slots[i] * kv_cols, row + key_start + kv_cols, kv_cols * sizeof(T));
  });
  return 0;
}

template <typename T>
int scale_rows(const void *x, int64_t x_stride, const float *s, float *out, int64_t rows, int64_t cols, int threads) {
  const T *xs = static_cast<const T *>(x);
  for_rows(rows, cols, threads, [&](int64_t i) { scale_row(xs + i * x_stride, s, out + i * cols, cols); });
  return 0;
}

template <typename T>
int argmax_rows(const void *x, int64_t x_stride, int64_t *out, int64_t rows, int64_t cols, int threads) {
  const T *xs = static_cast<const T *>(x);
  for_rows(rows, cols, threads, [&](int64_t i) { out[i] = argmax_row(xs + i * x_stride, cols); });
  return 0;
}

}  // namespace

// The paged cache's write: row i of src (row_bytes, src_stride bytes apart) to row slots[i] of dst, for rows
// whose elements are contiguous (a token's K or V heads), of any dtype
extern "C" int scatter_rows(const void *src, int64_t src_stride, void *dst, int64_t row_bytes, const int64_t *slots,
                            int64_t rows) {
  const char *from = static_cast<const char *>(src);
  char *to = static_cast<char *>(dst);
  for (int64_t i = 0; i < rows; ++i) std::memcpy(to + slots[i] * row_bytes, from + i * src_stride, row_bytes);
  return 0;
}

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
  }                                                                                                             \
  extern "C" int add_rms_norm_##NAME(const void *x, int64_t x_stride, const void *h, int64_t h_stride, void *sum, \
                                     void *out, const void *weight, int64_t rows, int64_t cols, double eps,      \
                                     int threads) {                                                              \
    return add_rms_norm<T>(x, x_stride, h, h_stride, sum, out, weight, rows, cols, eps, threads);               \
  }                                                                                                             \
  extern "C" int argmax_rows_##NAME(const void *x, int64_t x_stride, int64_t *out, int64_t rows, int64_t cols,  \
                                    int threads) {                                                              \
    return argmax_rows<T>(x, x_stride, out, rows, cols, threads);                                               \
  }                                                                                                             \
  extern "C" int rotary_write_##NAME(void *x, int64_t x_stride, const void *cos, const void *sin,               \
                                     int64_t cs_stride, int64_t rows, int64_t heads, int64_t head_dim,            \
                                     int64_t key_start, int64_t kv_cols, void *key_cache, void *value_cache,     \
                                     const int64_t *slots, int threads) {                                        \
    return rotary_write<T>(x, x_stride, cos, sin, cs_stride, rows, heads, head_dim, key_start, kv_cols, key_cache, \
                           value_cache, slots, threads);                                                          \
  }                                                                                                             \
  extern "C" int scale_rows_##NAME(const void *x, int64_t x_stride, const float *s, float *out, int64_t rows,    \
                                   int64_t cols, int threads) {                                                 \
    return scale_rows<T>(x, x_stride, s, out, rows, cols, threads);                                             \
  }

PAGED_HF_LAYER_OPS(float32, float)
PAGED_HF_LAYER_OPS(bfloat16, uint16_t)
PAGED_HF_LAYER_OPS(float64, double)
