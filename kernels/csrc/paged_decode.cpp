// Attention read straight from the paged KV cache, no gathered copy: one query token per row, and a sequence
// may have several rows (a prompt chunk; speculative decoding's last token and drafts), which read its blocks
// once. A lone decode row goes through attend_rows; several rows, computed in float, through tiles (below).
//
// Why: the pure-PyTorch kernel first gathers each row's blocks into a dense buffer, so every K/V byte crosses
// memory three times (read, write, read again), and decode attention on a CPU is memory-bound. Here each
// block is read once, in place: blocks are the outer loop (K and V of a block are used together by an online
// softmax) and the next block is prefetched while this one is computed (blocks are scattered over the pool,
// the hardware prefetcher cannot guess them).
//
// Built at run time by kernels/native.py for the model's head_dim (-DPAGED_HF_HEAD_DIM), with -march=native,
// and loaded with ctypes. The OpenMP runtime it links is the one torch already loaded (same soname), so its
// threads are torch's own.
//
// Layouts, all contiguous: q, out [num_rows, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size,
// num_kv_heads, head_dim]; block_tables [num_seqs, max_blocks]; context_lens [num_rows]; seq_starts
// [num_seqs + 1] (the rows of a sequence are consecutive). window > 0 keeps the
// last `window` keys; softcap > 0 maps a score s to softcap * tanh(s / softcap).
//
// A quantized cache (int8, fp8 e4m3/e5m2; see kernels/quant.py) is read the same way: each value is widened to
// float in registers, and the scale of its (block, KV head) [num_blocks, num_kv_heads] is applied once per score
// (keys) and once per softmax weight (values), not per element; no dequantized copy exists.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec_math.h"

#ifndef PAGED_HF_HEAD_DIM
#error "compile with -DPAGED_HF_HEAD_DIM=<head_dim>"
#endif

namespace {

using paged_hf::exp_nonpositive;

constexpr int kMaxGroup = 8;  // query heads per KV head handled at once (their q lives in registers)

// 64 bytes of T (one AVX-512 register; GCC splits it on narrower machines).
template <typename T> struct Vec;
template <> struct Vec<float> {
  typedef float type __attribute__((vector_size(64), aligned(4)));
  static constexpr int lanes = 16;
  static float sum(type v) {
    typedef float half __attribute__((vector_size(32)));
    typedef float quarter __attribute__((vector_size(16)));
    half a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
             __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    quarter b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
  }
};
template <> struct Vec<double> {
  typedef double type __attribute__((vector_size(64), aligned(8)));
  static constexpr int lanes = 8;
  static double sum(type v) {
    typedef double half __attribute__((vector_size(32)));
    half a = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return (a[0] + a[2]) + (a[1] + a[3]);
  }
};

// Storage types of the KV cache. bf16/fp16 are widened to float in registers (bf16: the 16 bits become the top
// half of a float; fp16: a hardware conversion), so every product and sum is float32: the cache is read at half
// the bytes and nothing is lost that the float32 kernel keeps.
struct bf16 {
  uint16_t bits;
};
// Quantized storage: value = stored * scale of its (block, KV head).
struct fp8e4m3 {
  uint8_t bits;
};
struct fp8e5m2 {
  uint8_t bits;
};
template <typename S> struct Compute { typedef S type; };
template <> struct Compute<bf16> { typedef float type; };
template <> struct Compute<_Float16> { typedef float type; };
template <> struct Compute<int8_t> { typedef float type; };
template <> struct Compute<fp8e4m3> { typedef float type; };
template <> struct Compute<fp8e5m2> { typedef float type; };
template <typename S> constexpr bool kQuantized = std::is_same_v<S, int8_t> || std::is_same_v<S, fp8e4m3> ||
                                                  std::is_same_v<S, fp8e5m2>;

// 16 fp8 values to float: sign, exponent and mantissa moved into a float's fields (exponent bias and all), then
// one multiply by 2^(127 - bias) fixes the bias; subnormals come out right too (as float subnormals, scaled up).
template <int MantissaBits, int Bias> inline Vec<float>::type fp8_to_float(const uint8_t *src) {
  typedef uint8_t Bytes __attribute__((vector_size(16), aligned(1)));
  typedef uint32_t Wide __attribute__((vector_size(64)));
  Bytes b;
  std::memcpy(&b, src, sizeof(b));
  const Wide w = __builtin_convertvector(b, Wide);
  const Wide bits = ((w & 0x80u) << 24) | ((w & 0x7Fu) << (23 - MantissaBits));
  Vec<float>::type f;
  std::memcpy(&f, &bits, sizeof(f));
  return f * __builtin_ldexpf(1.0f, 127 - Bias);
}

// n vectors of compute type from n * lanes stored elements.
template <typename S, int N> inline void load(typename Vec<typename Compute<S>::type>::type (&dst)[N], const S *src) {
  using T = typename Compute<S>::type;
  constexpr int L = Vec<T>::lanes;
  if constexpr (std::is_same_v<S, T>) {
    std::memcpy(dst, src, sizeof(dst));
  } else if constexpr (std::is_same_v<S, bf16>) {
    typedef uint16_t Half __attribute__((vector_size(32), aligned(2)));  // T is float here: 16 lanes
    typedef uint32_t Wide __attribute__((vector_size(64)));
    for (int j = 0; j < N; ++j) {
      Half h;
      std::memcpy(&h, src + j * L, sizeof(h));
      const Wide w = __builtin_convertvector(h, Wide) << 16;
      std::memcpy(&dst[j], &w, sizeof(w));
    }
  } else if constexpr (std::is_same_v<S, int8_t>) {
    typedef int8_t Bytes __attribute__((vector_size(16), aligned(1)));
    for (int j = 0; j < N; ++j) {
      Bytes b;
      std::memcpy(&b, src + j * L, sizeof(b));
      dst[j] = __builtin_convertvector(b, typename Vec<T>::type);
    }
  } else if constexpr (std::is_same_v<S, fp8e4m3>) {
    for (int j = 0; j < N; ++j) dst[j] = fp8_to_float<3, 7>(&src[j * L].bits);
  } else if constexpr (std::is_same_v<S, fp8e5m2>) {
    for (int j = 0; j < N; ++j) dst[j] = fp8_to_float<2, 15>(&src[j * L].bits);
  } else {
    typedef _Float16 Half __attribute__((vector_size(32), aligned(2)));
    for (int j = 0; j < N; ++j) {
      Half h;
      std::memcpy(&h, src + j * L, sizeof(h));
      dst[j] = __builtin_convertvector(h, typename Vec<T>::type);
    }
  }
}

struct Batch {
  const int64_t *block_tables;  // [num_seqs, max_blocks]
  const int64_t *context_lens;  // [num_rows]
  const int64_t *seq_starts;    // [num_seqs + 1]: sequence s is the rows [seq_starts[s], seq_starts[s + 1])
  const float *k_scales, *v_scales;            // [num_blocks, num_kv_heads] for a quantized cache, else null
  int64_t num_seqs, max_blocks, num_heads, num_kv_heads, block_size, window;
  double scale, softcap;

  // The first key a row with `len` keys attends to (its window's start; 0 without a window).
  int64_t first_key(int64_t len) const { return window > 0 && len > window ? len - window : 0; }
};

// Into L2 (prefetcht1), not L1: a block's lines prefetched into L1 at once fill its few miss buffers and stall
// the current block's arithmetic. AMD EPYC Zen 4, bf16 cache, 64 sequences x 30 layers of the default model's
// shapes: 1.1x at 64 keys a sequence, 1.5x at 320 and 1,000, 1.36x for one sequence of 4,000 (same bits).
inline void prefetch(const void *data, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64)
    __builtin_prefetch(static_cast<const char *>(data) + offset, 0, 2);
}

// x[i] = exp(x[i] - shift) for i < n; returns their sum.
template <typename T> inline T exp_shifted(T *x, int64_t n, T shift) {
  T sum = 0;
  int64_t i = 0;
  if constexpr (sizeof(T) == sizeof(float)) {
    using V = typename Vec<T>::type;
    V sums{};
    for (; i + Vec<T>::lanes <= n; i += Vec<T>::lanes) {
      V v;
      std::memcpy(&v, x + i, sizeof(v));
      v = exp_nonpositive(v - shift);
      std::memcpy(x + i, &v, sizeof(v));
      sums += v;
    }
    sum = Vec<T>::sum(sums);
  }
  for (; i < n; ++i) sum += (x[i] = std::exp(x[i] - shift));
  return sum;
}

// Running softmax state of one query head: max score so far, sum of exp(score - max), and the weighted sum
// of values (in `out`).
template <typename T> struct Running {
  T max, sum;
};

// G query heads (sharing one KV head) against the keys [lo, hi) of one block: scores, online-softmax update,
// values. `scores` is scratch for [G][block_size]. K/V are stored as S, everything else is T; a quantized block's
// stored K/V are multiplied by k_scale/v_scale (1 otherwise, and then never used).
template <typename S, int G, typename T = typename Compute<S>::type>
void attend_block(const T *q, const S *keys, const S *values, int64_t token_stride, int64_t lo, int64_t hi,
                  const Batch &batch, Running<T> *state, T *out, T *scores, T k_scale, T v_scale) {
  using V = typename Vec<T>::type;
  constexpr int NV = PAGED_HF_HEAD_DIM / Vec<T>::lanes;
  const T softcap = static_cast<T>(batch.softcap);
  T scale = static_cast<T>(batch.scale);
  if constexpr (kQuantized<S>) scale *= k_scale;
  const int64_t bs = batch.block_size;
  V qv[G][NV];
  std::memcpy(qv, q, sizeof(qv));
  T block_max[G];
  for (int g = 0; g < G; ++g) block_max[g] = state[g].max;
  for (int64_t i = lo; i < hi; ++i) {
    V k[NV];
    load<S, NV>(k, keys + i * token_stride);
    for (int g = 0; g < G; ++g) {
      V dot = qv[g][0] * k[0];
      for (int j = 1; j < NV; ++j) dot += qv[g][j] * k[j];
      T score = Vec<T>::sum(dot) * scale;
      if (softcap > 0) score = softcap * std::tanh(score / softcap);
      scores[g * bs + i] = score;
      block_max[g] = score > block_max[g] ? score : block_max[g];
    }
  }
  V acc[G][NV];
  std::memcpy(acc, out, sizeof(acc));
  for (int g = 0; g < G; ++g) {  // rescale what was accumulated under the old max
    const T correction = std::exp(state[g].max - block_max[g]);
    const T block_sum = exp_shifted(scores + g * bs + lo, hi - lo, block_max[g]);
    state[g] = {block_max[g], state[g].sum * correction + block_sum};
    for (int j = 0; j < NV; ++j) acc[g][j] *= correction;
  }
  for (int64_t i = lo; i < hi; ++i) {
    V v[NV];
    load<S, NV>(v, values + i * token_stride);
    for (int g = 0; g < G; ++g) {
      T weight = scores[g * bs + i];
      if constexpr (kQuantized<S>) weight *= v_scale;
      for (int j = 0; j < NV; ++j) acc[g][j] += weight * v[j];
    }
  }
  std::memcpy(out, acc, sizeof(acc));
}

template <typename S, typename T = typename Compute<S>::type>
using BlockFn = void (*)(const T *, const S *, const S *, int64_t, int64_t, int64_t, const Batch &, Running<T> *, T *, T *,
                         T, T);

template <typename S> BlockFn<S> block_fn(int64_t group) {
  switch (group) {
    case 1: return attend_block<S, 1>;
    case 2: return attend_block<S, 2>;
    case 3: return attend_block<S, 3>;
    case 4: return attend_block<S, 4>;
    case 5: return attend_block<S, 5>;
    case 6: return attend_block<S, 6>;
    case 7: return attend_block<S, 7>;
    default: return attend_block<S, 8>;
  }
}

// One task: the query heads of one KV head, for the rows [r0, r1) of one sequence. A sequence's rows are its
// query tokens (one for a decode; its last token and its drafts in speculative decoding); they share the
// sequence's blocks, and row r attends to the first context_lens[r] tokens (causal: each later row sees one
// more). Blocks are the outer loop, so a block's K/V comes from memory once and from cache for the other rows.
// For each (row, head) the blocks and the arithmetic are those of a sequence with that row alone.
template <typename S, typename T = typename Compute<S>::type>
void attend_rows(const T *q, const S *k_cache, const S *v_cache, const int64_t *table, int64_t r0, int64_t r1,
                 int64_t kv_head, const Batch &batch, Running<T> *state, T *scores, T *out) {
  constexpr int64_t D = PAGED_HF_HEAD_DIM;
  const int64_t bs = batch.block_size, group = batch.num_heads / batch.num_kv_heads;
  const int64_t token_stride = batch.num_kv_heads * D, block_stride = bs * token_stride;
  int64_t first = INT64_MAX, last = -1;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t len = batch.context_lens[r];
    first = batch.first_key(len) / bs < first ? batch.first_key(len) / bs : first;
    last = (len - 1) / bs > last ? (len - 1) / bs : last;
    for (int64_t g = 0; g < group; ++g) state[(r - r0) * group + g] = {-INFINITY, 0};
    std::memset(out + (r * batch.num_heads + kv_head * group) * D, 0, sizeof(T) * group * D);
  }
  for (int64_t b = first; b <= last; ++b) {
    if (b < last) {
      for (int64_t t = 0; t < bs; ++t) {  // this KV head's slice of every token of the next block
        prefetch(k_cache + table[b + 1] * block_stride + t * token_stride + kv_head * D, D * sizeof(S));
        prefetch(v_cache + table[b + 1] * block_stride + t * token_stride + kv_head * D, D * sizeof(S));
      }
    }
    const S *keys = k_cache + table[b] * block_stride + kv_head * D;
    const S *values = v_cache + table[b] * block_stride + kv_head * D;
    T k_scale = 1, v_scale = 1;
    if constexpr (kQuantized<S>) {
      k_scale = batch.k_scales[table[b] * batch.num_kv_heads + kv_head];
      v_scale = batch.v_scales[table[b] * batch.num_kv_heads + kv_head];
    }
    const int64_t t0 = b * bs;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t len = batch.context_lens[r], start = batch.first_key(len);
      const int64_t lo = start > t0 ? start - t0 : 0, hi = len - t0 < bs ? len - t0 : bs;
      if (lo >= hi) continue;  // the block lies outside this row's window or past its last key
      for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {  // at most 8 query heads at once
        const int64_t head = kv_head * group + g0, heads = group - g0 < kMaxGroup ? group - g0 : kMaxGroup;
        const int64_t offset = (r * batch.num_heads + head) * D;
        block_fn<S>(heads)(q + offset, keys, values, token_stride, lo, hi, batch, state + (r - r0) * group + g0,
                           out + offset, scores, k_scale, v_scale);
      }
    }
  }
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t g = 0; g < group; ++g) {
      T *o = out + (r * batch.num_heads + kv_head * group + g) * D;
      for (int64_t d = 0; d < D; ++d) o[d] /= state[(r - r0) * group + g].sum;
    }
}

// --- Sequences of several rows: the rows in the vector lanes ------------------------------------------------
//
// attend_rows scores each (row, query head) against a key with a dot product and a horizontal sum, which costs
// about as much again as the dot product, once per row. A sequence with several rows (a request's last token and
// its drafts) instead goes through tiles of up to 48 (row, query head) pairs of one KV head, laid across the
// lanes of three vectors, dimension-major, as csrc/paged_prefill.cpp does in bf16: each key element is
// broadcast against the tile, and the online softmax runs lane-wise (one max and one exp per 16 pairs), so
// nothing is summed horizontally. Lane p of a tile is token p / G and query head p % G of the KV head's group.
// Float compute only; the float64 kernel keeps attend_rows.

constexpr int kLanes = Vec<float>::lanes;
constexpr int kTileVectors = 3;    // 48 (row, head) pairs per tile
constexpr int kTileMinPairs = 6;   // fewer pairs fill too few lanes to beat attend_rows (measured: 6 gains)
constexpr int kKeysAtOnce = 4;     // keys scored together (their broadcasts share the tile's query loads)
constexpr int kDimsAtOnce = 8;     // output dimensions accumulated together
constexpr float kMasked = -1e30f;  // a masked score: finite, so that max - max is never inf - inf
using VF = Vec<float>::type;
typedef int32_t VI __attribute__((vector_size(64), aligned(4)));  // like VF: any 4-byte address

// The work of one thread for one KV head of a sequence: the rows [first, first + count) by attend_rows, or as
// one tile the (row, head) pairs [first, first + count), pair row * G + g being query head g of the KV head's group.
struct Task {
  int64_t seq, kv_head, first, count;
  bool tiled;
};

// One thread's tile scratch: the tile's queries and running output (dimension-major, pairs in lanes), its
// softmax state, each pair's allowed key positions [lo, hi], a block's scores then weights, and a block's keys
// and values widened to float when the cache stores another type.
struct TileScratch {
  VF q[PAGED_HF_HEAD_DIM][kTileVectors], out[PAGED_HF_HEAD_DIM][kTileVectors];
  VF max[kTileVectors], sum[kTileVectors], correction[kTileVectors];
  VI lo[kTileVectors], hi[kTileVectors];
  VF *scores;                           // [block_size][kTileVectors]
  float *keys, *values;                 // [block_size][head_dim] each
  const float **key_rows, **value_rows;  // [block_size] each: the block's rows as float
};

// A TileScratch and its arrays in one allocation (free() releases it); null when out of memory.
TileScratch *new_tile_scratch(int64_t block_size) {
  const size_t bytes = sizeof(TileScratch) + sizeof(VF) * block_size * kTileVectors +
                       sizeof(float) * 2 * block_size * PAGED_HF_HEAD_DIM + sizeof(float *) * 2 * block_size;
  auto *w = static_cast<TileScratch *>(std::malloc(bytes));
  if (!w) return nullptr;
  w->scores = reinterpret_cast<VF *>(w + 1);
  w->keys = reinterpret_cast<float *>(w->scores + block_size * kTileVectors);
  w->values = w->keys + block_size * PAGED_HF_HEAD_DIM;
  w->key_rows = reinterpret_cast<const float **>(w->values + block_size * PAGED_HF_HEAD_DIM);
  w->value_rows = w->key_rows + block_size;
  return w;
}

// The tile's queries into the lanes, each pair's allowed keys, the running state reset. Lanes past the last
// pair hold zero queries and allow no key; whatever they accumulate (finite) is never written.
template <int R> void begin_tile(const float *q, const Task &t, const Batch &batch, TileScratch &w) {
  constexpr int64_t D = PAGED_HF_HEAD_DIM;
  const int64_t group = batch.num_heads / batch.num_kv_heads;
  float *packed = reinterpret_cast<float *>(w.q);
  int32_t lo[R * kLanes], hi[R * kLanes];
  for (int64_t p = 0; p < R * kLanes; ++p) {
    const int64_t v = p / kLanes, lane = p % kLanes;
    if (p >= t.count) {
      for (int64_t d = 0; d < D; ++d) packed[(d * kTileVectors + v) * kLanes + lane] = 0;
      lo[p] = 0, hi[p] = -1;
      continue;
    }
    const int64_t row = (t.first + p) / group, head = t.kv_head * group + (t.first + p) % group;
    const float *src = q + (row * batch.num_heads + head) * D;
    for (int64_t d = 0; d < D; ++d) packed[(d * kTileVectors + v) * kLanes + lane] = src[d];
    const int64_t len = batch.context_lens[row];
    hi[p] = static_cast<int32_t>(len - 1);
    lo[p] = static_cast<int32_t>(batch.first_key(len));
  }
  for (int v = 0; v < R; ++v) {
    std::memcpy(&w.lo[v], lo + v * kLanes, sizeof(VI));
    std::memcpy(&w.hi[v], hi + v * kLanes, sizeof(VI));
    w.max[v] = VF{} + kMasked;
    w.sum[v] = VF{};
    for (int64_t d = 0; d < D; ++d) w.out[d][v] = VF{};
  }
}

// scores[i][v] = scale * q . key i (soft-capped when asked), for the n keys given.
template <int R> void score_keys(const float *const *keys, int64_t n, float scale, float softcap, TileScratch &w) {
  for (int64_t i = 0; i < n; i += kKeysAtOnce) {
    const float *k[kKeysAtOnce];
    for (int j = 0; j < kKeysAtOnce; ++j) k[j] = keys[i + j < n ? i + j : i];
    VF acc[kKeysAtOnce][R] = {};
    for (int d = 0; d < PAGED_HF_HEAD_DIM; ++d)
      for (int v = 0; v < R; ++v) {
        const VF qv = w.q[d][v];
        for (int j = 0; j < kKeysAtOnce; ++j) acc[j][v] += qv * k[j][d];
      }
    for (int j = 0; j < kKeysAtOnce && i + j < n; ++j)
      for (int v = 0; v < R; ++v) {
        VF s = acc[j][v] * scale;
        if (softcap > 0) s = paged_hf::soft_cap(s, softcap);
        w.scores[(i + j) * kTileVectors + v] = s;
      }
  }
}

// Online softmax over the scores of the n keys from position `first`: masked (when some pair may not see all of
// them), new running max, the correction of what was accumulated, the scores turned into weights, running sums.
template <int R> void softmax_keys(int64_t first, int64_t n, bool masked, TileScratch &w) {
  for (int v = 0; v < R; ++v) {
    VF block_max = VF{} + kMasked;
    for (int64_t i = 0; i < n; ++i) {
      VF &s = w.scores[i * kTileVectors + v];
      if (masked) {
        const VI position = VI{} + static_cast<int32_t>(first + i);
        s = (w.lo[v] <= position) & (position <= w.hi[v]) ? s : VF{} + kMasked;
      }
      block_max = s > block_max ? s : block_max;
    }
    const VF new_max = w.max[v] > block_max ? w.max[v] : block_max;
    w.correction[v] = exp_nonpositive(w.max[v] - new_max);
    w.max[v] = new_max;
    VF sum{};
    for (int64_t i = 0; i < n; ++i) {
      VF &s = w.scores[i * kTileVectors + v];
      VF e = exp_nonpositive(s - new_max);
      if (masked) {
        const VI position = VI{} + static_cast<int32_t>(first + i);
        e = (w.lo[v] <= position) & (position <= w.hi[v]) ? e : VF{};
      }
      s = e;
      sum += e;
    }
    w.sum[v] = w.sum[v] * w.correction[v] + sum;
  }
}

// out[d][v] = out[d][v] * correction[v] + sum over the n keys of weight * value[d] (weights times v_scale).
template <int R> void accumulate_keys(const float *const *values, int64_t n, float v_scale, TileScratch &w) {
  for (int d0 = 0; d0 < PAGED_HF_HEAD_DIM; d0 += kDimsAtOnce) {
    VF acc[kDimsAtOnce][R];
    for (int j = 0; j < kDimsAtOnce; ++j)
      for (int v = 0; v < R; ++v) acc[j][v] = w.out[d0 + j][v] * w.correction[v];
    for (int64_t i = 0; i < n; ++i) {
      VF weight[R];
      for (int v = 0; v < R; ++v) weight[v] = w.scores[i * kTileVectors + v] * v_scale;
      const float *value = values[i] + d0;
      for (int j = 0; j < kDimsAtOnce; ++j)
        for (int v = 0; v < R; ++v) acc[j][v] += weight[v] * value[j];
    }
    for (int j = 0; j < kDimsAtOnce; ++j)
      for (int v = 0; v < R; ++v) w.out[d0 + j][v] = acc[j][v];
  }
}

// Rows [lo, hi) of a block as float rows: pointers into the cache, or into `widened` for another storage type.
template <typename S>
void float_rows(const S *block, int64_t token_stride, int64_t lo, int64_t hi, float *widened, const float **rows) {
  constexpr int NV = PAGED_HF_HEAD_DIM / kLanes;
  for (int64_t i = lo; i < hi; ++i) {
    if constexpr (std::is_same_v<S, float>) {
      rows[i - lo] = block + i * token_stride;
    } else {
      VF row[NV];
      load<S, NV>(row, block + i * token_stride);
      std::memcpy(widened + (i - lo) * PAGED_HF_HEAD_DIM, row, sizeof(row));
      rows[i - lo] = widened + (i - lo) * PAGED_HF_HEAD_DIM;
    }
  }
}

// One tile: its pairs against the keys any of them may see, block by block; then each pair's output.
template <typename S, int R>
void attend_tile(const float *q, const S *k_cache, const S *v_cache, const Task &t, const Batch &batch,
                 TileScratch &w, float *out) {
  constexpr int64_t D = PAGED_HF_HEAD_DIM;
  const int64_t bs = batch.block_size, token_stride = batch.num_kv_heads * D, block_stride = bs * token_stride;
  const int64_t *table = batch.block_tables + t.seq * batch.max_blocks;
  begin_tile<R>(q, t, batch, w);
  int64_t shortest = INT64_MAX, longest = 0;
  const int64_t group = batch.num_heads / batch.num_kv_heads;
  for (int64_t r = t.first / group; r <= (t.first + t.count - 1) / group; ++r) {
    shortest = batch.context_lens[r] < shortest ? batch.context_lens[r] : shortest;
    longest = batch.context_lens[r] > longest ? batch.context_lens[r] : longest;
  }
  // every pair sees the keys [first_key(longest), shortest); some see more, from first_key(shortest) to longest
  const int64_t seen_by_all = batch.first_key(longest), first = batch.first_key(shortest), last = (longest - 1) / bs;
  for (int64_t b = first / bs; b <= last; ++b) {
    if (b < last) {
      for (int64_t i = 0; i < bs; ++i) {
        prefetch(k_cache + table[b + 1] * block_stride + i * token_stride + t.kv_head * D, D * sizeof(S));
        prefetch(v_cache + table[b + 1] * block_stride + i * token_stride + t.kv_head * D, D * sizeof(S));
      }
    }
    const int64_t t0 = b * bs;
    const int64_t lo = first > t0 ? first - t0 : 0, hi = longest - t0 < bs ? longest - t0 : bs;
    float k_scale = 1, v_scale = 1;
    if constexpr (kQuantized<S>) {
      k_scale = batch.k_scales[table[b] * batch.num_kv_heads + t.kv_head];
      v_scale = batch.v_scales[table[b] * batch.num_kv_heads + t.kv_head];
    }
    float_rows<S>(k_cache + table[b] * block_stride + t.kv_head * D, token_stride, lo, hi, w.keys, w.key_rows);
    float_rows<S>(v_cache + table[b] * block_stride + t.kv_head * D, token_stride, lo, hi, w.values, w.value_rows);
    score_keys<R>(w.key_rows, hi - lo, static_cast<float>(batch.scale) * k_scale, static_cast<float>(batch.softcap), w);
    softmax_keys<R>(t0 + lo, hi - lo, t0 + lo < seen_by_all || t0 + hi > shortest, w);
    accumulate_keys<R>(w.value_rows, hi - lo, v_scale, w);
  }
  for (int64_t p = 0; p < t.count; ++p) {
    const int64_t v = p / kLanes, lane = p % kLanes;
    const int64_t row = (t.first + p) / group, head = t.kv_head * group + (t.first + p) % group;
    float *dst = out + (row * batch.num_heads + head) * D;
    const float inverse = 1.0f / w.sum[v][lane];
    for (int64_t d = 0; d < D; ++d) dst[d] = w.out[d][v][lane] * inverse;
  }
}

// The step's tasks: per sequence and KV head, its (row, head) pairs in tiles when it has several rows and
// enough pairs to fill lanes (split evenly into as few tiles as hold them), else its rows by attend_rows (a lone
// decode row reads its keys fastest there).
template <typename T> std::vector<Task> make_tasks(const Batch &batch) {
  constexpr int64_t kTilePairs = kTileVectors * kLanes;
  const int64_t group = batch.num_heads / batch.num_kv_heads;
  std::vector<Task> tasks;
  for (int64_t s = 0; s < batch.num_seqs; ++s) {
    const int64_t first = batch.seq_starts[s], rows = batch.seq_starts[s + 1] - first, pairs = rows * group;
    if (!std::is_same_v<T, float> || rows < 2 || pairs < kTileMinPairs) {
      for (int64_t kv_head = 0; kv_head < batch.num_kv_heads; ++kv_head)
        tasks.push_back({s, kv_head, first, rows, false});
      continue;
    }
    const int64_t tiles = (pairs + kTilePairs - 1) / kTilePairs, per_tile = (pairs + tiles - 1) / tiles;
    for (int64_t p = 0; p < pairs; p += per_tile)
      for (int64_t kv_head = 0; kv_head < batch.num_kv_heads; ++kv_head)
        tasks.push_back({s, kv_head, first * group + p, per_tile < pairs - p ? per_tile : pairs - p, true});
  }
  return tasks;
}

template <typename S, typename T = typename Compute<S>::type>
int paged_decode(const T *q, const S *k_cache, const S *v_cache, T *out, const Batch &batch, int num_threads) {
  if constexpr (PAGED_HF_HEAD_DIM % Vec<T>::lanes != 0) {
    return 2;  // this dtype's vectors do not tile head_dim (nothing else is instantiated for it)
  } else {
  const std::vector<Task> tasks = make_tasks<T>(batch);
  const int64_t group = batch.num_heads / batch.num_kv_heads;
  int64_t max_rows = 1;  // of an attend_rows task
  bool any_tiled = false;
  for (const Task &t : tasks) {
    max_rows = !t.tiled && t.count > max_rows ? t.count : max_rows;
    any_tiled = any_tiled || t.tiled;
  }
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    auto *state = static_cast<Running<T> *>(std::malloc(sizeof(Running<T>) * max_rows * group));
    auto *scores = static_cast<T *>(std::malloc(sizeof(T) * kMaxGroup * batch.block_size));
    TileScratch *tile = any_tiled ? new_tile_scratch(batch.block_size) : nullptr;
    const bool ready = state && scores && (tile || !any_tiled);
    if (!ready) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < tasks.size(); ++i) {
      if (!ready) continue;
      const Task &t = tasks[i];
      if constexpr (std::is_same_v<T, float>) {
        if (t.tiled) {
          switch ((t.count + kLanes - 1) / kLanes) {
            case 1: attend_tile<S, 1>(q, k_cache, v_cache, t, batch, *tile, out); break;
            case 2: attend_tile<S, 2>(q, k_cache, v_cache, t, batch, *tile, out); break;
            default: attend_tile<S, 3>(q, k_cache, v_cache, t, batch, *tile, out); break;
          }
          continue;
        }
      }
      attend_rows<S>(q, k_cache, v_cache, batch.block_tables + t.seq * batch.max_blocks, t.first, t.first + t.count,
                     t.kv_head, batch, state, scores, out);
    }
    std::free(state);
    std::free(scores);
    std::free(tile);
  }
  return failed;
  }
}

// A bf16 model's query rows read and its output rows written in bf16, for a cache whose compute type is float:
// the query widened into float scratch and the output rounded back (to nearest even, as torch's `.to` rounds)
// around the same kernel, instead of a torch cast before the call and a copy after it in every layer. Query row r
// (its heads one after the other) starts at q + r * q_row_stride: a slice of the fused q/k/v rows, read in place.
template <typename S>
int paged_decode_bf16_rows(const uint16_t *q, int64_t q_row_stride, const S *k_cache, const S *v_cache,
                           uint16_t *out, const Batch &batch, int num_threads) {
  static_assert(std::is_same_v<typename Compute<S>::type, float>);
  const int64_t rows = batch.seq_starts[batch.num_seqs], cols = batch.num_heads * PAGED_HF_HEAD_DIM;
  const int64_t vec = cols - cols % 16;
  float *q_float = static_cast<float *>(std::malloc(sizeof(float) * (rows * cols + 1)));
  float *out_float = static_cast<float *>(std::malloc(sizeof(float) * (rows * cols + 1)));
  int status = q_float && out_float ? 0 : 1;
  for (int64_t r = 0; status == 0 && r < rows; ++r) {
    const uint16_t *src = q + r * q_row_stride;
    float *dst = q_float + r * cols;
    for (int64_t i = 0; i < vec; i += 16) {
      const paged_hf::F16x v = paged_hf::load_bf16x16(src + i);
      std::memcpy(dst + i, &v, sizeof(v));
    }
    for (int64_t i = vec; i < cols; ++i) dst[i] = paged_hf::bf16_to_float(src[i]);
  }
  if (status == 0) status = paged_decode<S>(q_float, k_cache, v_cache, out_float, batch, num_threads);
  if (status == 0) {
    const int64_t n = rows * cols, n_vec = n - n % 16;
    for (int64_t i = 0; i < n_vec; i += 16) {
      paged_hf::F16x v;
      std::memcpy(&v, out_float + i, sizeof(v));
      paged_hf::store_bf16x16(out + i, v);
    }
    for (int64_t i = n_vec; i < n; ++i) out[i] = paged_hf::float_to_bf16(out_float[i]);
  }
  std::free(q_float);
  std::free(out_float);
  return status;
}

}  // namespace

// Entry points for ctypes. Returns 0 on success, 1 when scratch memory could not be allocated, 2 when the
// library was built for a head_dim this dtype cannot tile. q and out are in the compute type T (float for a
// bf16/fp16/int8/fp8 cache), k_cache and v_cache in the storage type S; k_scales and v_scales ([num_blocks,
// num_kv_heads] float32) for a quantized cache, else null. Sequence s is the rows [seq_starts[s], seq_starts[s+1]).
#define PAGED_HF_ENTRY(NAME, S, T)                                                                              \
  extern "C" int NAME(const T *q, const S *k_cache, const S *v_cache, const float *k_scales,                  \
                      const float *v_scales, const int64_t *block_tables, const int64_t *context_lens,         \
                      const int64_t *seq_starts, T *out, int64_t num_seqs, int64_t max_blocks,                 \
                      int64_t num_heads, int64_t num_kv_heads, int64_t block_size, double scale,               \
                      int64_t window, double softcap, int num_threads) {                                       \
    const Batch batch{block_tables, context_lens, seq_starts, k_scales, v_scales, num_seqs, max_blocks,        \
                      num_heads, num_kv_heads, block_size, window, scale, softcap};                            \
    return paged_decode<S>(q, k_cache, v_cache, out, batch, num_threads);                                     \
  }
PAGED_HF_ENTRY(paged_decode_float32, float, float)
PAGED_HF_ENTRY(paged_decode_float64, double, double)
PAGED_HF_ENTRY(paged_decode_bfloat16, bf16, float)
PAGED_HF_ENTRY(paged_decode_float16, _Float16, float)
PAGED_HF_ENTRY(paged_decode_int8, int8_t, float)
PAGED_HF_ENTRY(paged_decode_fp8_e4m3, fp8e4m3, float)
PAGED_HF_ENTRY(paged_decode_fp8_e5m2, fp8e5m2, float)

// The same with q and out in bf16 (a bf16 model), for the caches computed in float: q's rows q_row_stride
// elements apart, out contiguous [rows, num_heads, head_dim].
#define PAGED_HF_BF16_ROWS_ENTRY(NAME, S)                                                                        \
  extern "C" int NAME(const uint16_t *q, int64_t q_row_stride, const S *k_cache, const S *v_cache,             \
                      const float *k_scales, const float *v_scales, const int64_t *block_tables,               \
                      const int64_t *context_lens, const int64_t *seq_starts, uint16_t *out, int64_t num_seqs, \
                      int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,         \
                      double scale, int64_t window, double softcap, int num_threads) {                         \
    const Batch batch{block_tables, context_lens, seq_starts, k_scales, v_scales, num_seqs, max_blocks,        \
                      num_heads, num_kv_heads, block_size, window, scale, softcap};                            \
    return paged_decode_bf16_rows<S>(q, q_row_stride, k_cache, v_cache, out, batch, num_threads);             \
  }
PAGED_HF_BF16_ROWS_ENTRY(paged_decode_bfloat16_bf16_rows, bf16)
PAGED_HF_BF16_ROWS_ENTRY(paged_decode_int8_bf16_rows, int8_t)
PAGED_HF_BF16_ROWS_ENTRY(paged_decode_fp8_e4m3_bf16_rows, fp8e4m3)
PAGED_HF_BF16_ROWS_ENTRY(paged_decode_fp8_e5m2_bf16_rows, fp8e5m2)
