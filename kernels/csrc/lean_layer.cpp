// One decoder layer of a lean decode step as one call, or the whole decoder stack as one
// (paged_hf/worker/fast_paths/native_layer.py), and after the stack the model's final norm and LM head on the rows
// whose logits the step keeps (stack_tail.py).
//
// A lean layer (lean_layers.py) is a dozen compiled calls: RMSNorm, the q/k/v matmul, rotary + the K/V writes,
// decode attention, o_proj, the residual add + RMSNorm, gate/up, SiLU-and-multiply, down_proj and the residual
// add. At a few rows each call's kernel takes microseconds and its Python call (ctypes' argument conversion, the
// tensors' pointers and shapes, the buffers) several times that: ~100 us of a layer on the default model. Here
// the same entry points, with the same arguments in the same order, are called from C through the pointers the
// caller hands over once (LeanKernels, a LeanLayer per layer, a LeanStep per step): the same bits, one call.
//
// Every entry point returns 0 when done; the first non-zero status is returned as is.

#include <cstdint>
#include <cstring>

#include "vec_math.h"

namespace {

using RmsFn = int (*)(const void *, int64_t, void *, int64_t, const void *, int64_t, int64_t, double, int);
using AddRmsFn = int (*)(const void *, int64_t, const void *, int64_t, void *, void *, const void *, int64_t,
                         int64_t, double, int);
using SiluFn = int (*)(const void *, int64_t, const void *, int64_t, void *, int64_t, int64_t, int64_t, int);
using RotaryWriteFn = int (*)(void *, int64_t, const void *, const void *, int64_t, int64_t, int64_t, int64_t,
                              int64_t, int64_t, void *, void *, const int64_t *, int);
using GemmFn = int (*)(const void *, int64_t, int64_t, int64_t, const void *const *, const int64_t *,
                       const void *const *, int64_t, void *, int64_t, int);
// the decode kernel on q rows read in place (a bf16 model's entry point) and on contiguous q (float32's)
using DecodeRowsFn = int (*)(const void *, int64_t, const void *, const void *, const float *, const float *,
                             const int64_t *, const int64_t *, const int64_t *, void *, int64_t, int64_t, int64_t,
                             int64_t, int64_t, double, int64_t, double, int);
using DecodeFn = int (*)(const void *, const void *, const void *, const float *, const float *, const int64_t *,
                         const int64_t *, const int64_t *, void *, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                         int64_t, double, int);

}  // namespace

extern "C" {

// A linear's weights side by side (kernels/small_gemm.py's SmallLinear): the few-row loops' segments; `gemm`: the
// linear's own entry point of that signature (W4A8 panels, kernels/q4_panels.py), or null for the kernels' gemm.
struct LeanLinear {
  const void *const *weights;
  const int64_t *rows;
  const void *const *biases;
  int64_t count, in_features, out_features;
  void *gemm;
};

struct LeanKernels {
  void *rms, *add_rms, *silu, *rotary_write, *gemm;
};

// What a layer reads, fixed while its weights and cache stay.
struct LeanLayer {
  const void *norm0, *norm1;
  double eps0, eps1;
  LeanLinear qkv, o, gate_up, down;
  int64_t heads, kv_heads, head_dim;  // q's heads; k's and v's
  double scaling;
  void *key_cache, *value_cache;
  int64_t block_size;
  void *decode;  // DecodeRowsFn where `decode_in_place`, else DecodeFn
  int64_t decode_in_place;
};

// What every layer of the step shares: its rows, rotary tables, slots, the decode's sequences, the buffers.
struct LeanStep {
  int64_t tokens, hidden;
  const void *cos, *sin;
  const int64_t *slots, *block_tables, *context_lens, *seq_starts;
  int64_t num_seqs, max_blocks;
  void *normed, *residual, *rows, *query, *attended, *projected, *gate_up, *activated;
  int threads;
};

// The model's final RMSNorm and its LM head on the kept rows of the stack's output (stack_tail.py): each kept row
// normed on its own (RMSNorm is row by row: the bits of norming every row and keeping some), then the head.
struct LeanTail {
  const void *norm;
  double eps;
  LeanLinear head;
  const int64_t *kept;  // row indices, negative ones from the end (as torch indexes)
  int64_t count;
  void *normed, *logits;  // [count, hidden], [count, head.out_features]
};

}  // extern "C"

namespace {

int linear(const LeanKernels &k, const LeanLinear &w, const void *x, int64_t rows, void *y, int threads) {
  return reinterpret_cast<GemmFn>(w.gemm ? w.gemm : k.gemm)(x, w.in_features, rows, w.in_features, w.weights, w.rows, w.biases, w.count,
                                          y, w.out_features, threads);
}

// q's heads of `rows` attended over the layer's cache -> s.attended [tokens, heads, head_dim]
template <typename T>
int attend(const LeanLayer &l, const LeanStep &s) {
  const int64_t q_cols = l.heads * l.head_dim, stride = l.qkv.out_features;
  if (l.decode_in_place)
    return reinterpret_cast<DecodeRowsFn>(l.decode)(s.rows, stride, l.key_cache, l.value_cache, nullptr, nullptr,
                                                    s.block_tables, s.context_lens, s.seq_starts, s.attended,
                                                    s.num_seqs, s.max_blocks, l.heads, l.kv_heads, l.block_size,
                                                    l.scaling, 0, 0.0, s.threads);
  for (int64_t t = 0; t < s.tokens; ++t)  // q's columns as a contiguous copy, as DecodeRows makes it
    std::memcpy(static_cast<T *>(s.query) + t * q_cols, static_cast<const T *>(s.rows) + t * stride,
                q_cols * sizeof(T));
  return reinterpret_cast<DecodeFn>(l.decode)(s.query, l.key_cache, l.value_cache, nullptr, nullptr, s.block_tables,
                                              s.context_lens, s.seq_starts, s.attended, s.num_seqs, s.max_blocks,
                                              l.heads, l.kv_heads, l.block_size, l.scaling, 0, 0.0, s.threads);
}

// out = residual + out, rounded as torch adds two tensors of T
template <typename T>
void add_residual(const T *residual, T *out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    if constexpr (sizeof(T) == 2)
      out[i] = paged_hf::float_to_bf16(paged_hf::bf16_to_float(residual[i]) + paged_hf::bf16_to_float(out[i]));
    else
      out[i] = residual[i] + out[i];
  }
}

template <typename T>
int layer(const LeanKernels &k, const LeanLayer &l, const LeanStep &s, const void *x, void *out) {
  const int64_t n = s.tokens, h = s.hidden, inter = l.gate_up.out_features / 2;
  const int64_t q_cols = l.heads * l.head_dim, kv_cols = l.kv_heads * l.head_dim;
  const int th = s.threads;
  int status = reinterpret_cast<RmsFn>(k.rms)(x, h, s.normed, h, l.norm0, n, h, l.eps0, th);
  if (status == 0) status = linear(k, l.qkv, s.normed, n, s.rows, th);
  if (status == 0)
    status = reinterpret_cast<RotaryWriteFn>(k.rotary_write)(
        s.rows, l.qkv.out_features, s.cos, s.sin, l.head_dim, n, l.heads + l.kv_heads, l.head_dim, q_cols, kv_cols,
        l.key_cache, l.value_cache, s.slots, th);
  if (status == 0) status = attend<T>(l, s);
  if (status == 0) status = linear(k, l.o, s.attended, n, s.projected, th);
  if (status == 0)
    status = reinterpret_cast<AddRmsFn>(k.add_rms)(x, h, s.projected, h, s.residual, s.normed, l.norm1, n, h, l.eps1,
                                                   th);
  if (status == 0) status = linear(k, l.gate_up, s.normed, n, s.gate_up, th);
  if (status == 0) {
    const char *gate_up = static_cast<const char *>(s.gate_up);
    status = reinterpret_cast<SiluFn>(k.silu)(gate_up, 2 * inter, gate_up + inter * sizeof(T), 2 * inter,
                                              s.activated, inter, n, inter, th);
  }
  if (status == 0) status = linear(k, l.down, s.activated, n, out, th);
  if (status == 0) add_residual(static_cast<const T *>(s.residual), static_cast<T *>(out), n * h);
  return status;
}

// The decoder stack: layer after layer, each one's output the next one's input (two [tokens, hidden] buffers in
// turn), the last one's written to `out`. The same calls in the same order as one call per layer: the same bits.
template <typename T>
int stack(const LeanKernels &k, const LeanLayer *layers, int64_t count, const LeanStep &s, const void *x, void *out,
          void *buffers) {
  const int64_t bytes = s.tokens * s.hidden * static_cast<int64_t>(sizeof(T));
  const void *in = x;
  for (int64_t i = 0; i < count; ++i) {
    void *dst = i == count - 1 ? out : static_cast<char *>(buffers) + (i % 2) * bytes;
    const int status = layer<T>(k, layers[i], s, in, dst);
    if (status != 0) return status;
    in = dst;
  }
  return 0;
}

// A kept row index out of [-tokens, tokens): what torch's indexing would refuse.
constexpr int kTailIndexOutOfRange = -7;

template <typename T>
int tail(const LeanKernels &k, const LeanTail &t, const LeanStep &s, const void *hidden) {
  const int64_t h = s.hidden;
  for (int64_t i = 0; i < t.count; ++i) {
    const int64_t row = t.kept[i] < 0 ? t.kept[i] + s.tokens : t.kept[i];
    if (row < 0 || row >= s.tokens) return kTailIndexOutOfRange;
    const int status = reinterpret_cast<RmsFn>(k.rms)(static_cast<const T *>(hidden) + row * h, h,
                                                      static_cast<T *>(t.normed) + i * h, h, t.norm, 1, h, t.eps,
                                                      s.threads);
    if (status != 0) return status;
  }
  return linear(k, t.head, t.normed, t.count, t.logits, s.threads);
}

}  // namespace

extern "C" {

// The stack, then, where `t` is not null, its tail.
int lean_stack_float32(const LeanKernels *k, const LeanLayer *layers, int64_t count, const LeanStep *s,
                       const void *x, void *out, void *buffers, const LeanTail *t) {
  const int status = stack<float>(*k, layers, count, *s, x, out, buffers);
  return status != 0 || t == nullptr ? status : tail<float>(*k, *t, *s, out);
}

int lean_stack_bfloat16(const LeanKernels *k, const LeanLayer *layers, int64_t count, const LeanStep *s,
                        const void *x, void *out, void *buffers, const LeanTail *t) {
  const int status = stack<uint16_t>(*k, layers, count, *s, x, out, buffers);
  return status != 0 || t == nullptr ? status : tail<uint16_t>(*k, *t, *s, out);
}

int lean_layer_float32(const LeanKernels *k, const LeanLayer *l, const LeanStep *s, const void *x, void *out) {
  return layer<float>(*k, *l, *s, x, out);
}

int lean_layer_bfloat16(const LeanKernels *k, const LeanLayer *l, const LeanStep *s, const void *x, void *out) {
  return layer<uint16_t>(*k, *l, *s, x, out);
}
}
