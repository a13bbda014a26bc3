// Prefill attention in bfloat16 (multi-token queries: prompt chunks, speculative decoding's drafts) read
// straight from the paged KV cache, tiled like FlashAttention (online softmax over key blocks).
//
// Why: torch's CPU SDPA runs bf16 no faster than float32 (~90 GFLOP/s on 2 Zen 5 cores), while AVX512-BF16's
// `vdpbf16ps` multiplies 32 bf16 pairs exactly and adds them into 16 float32 sums per instruction. Scores,
// softmax and the output's sums are float32; only the softmax weights are rounded to bf16 before they weight
// the values (as FlashAttention does), with the row sums taken before that rounding.
//
// The query rows are the vector lanes: a tile holds up to 48 rows (16 per vector) of one KV head, row r being
// token r / G and query head r % G of that KV head's group of G. A key's bf16 pair (d, d+1) is broadcast from
// the cache as one 32-bit value against the tile's queries packed as pairs, so no key is transposed or copied,
// and every softmax step (max, exp, sums) runs across keys lane-wise: no horizontal sums. Values are packed per
// block of 32 keys as (key 2i, key 2i+1) pairs of each dimension, the layout `vdpbf16ps` sums over.
//
// Where the CPU has AMX (`paged_prefill_amx_bfloat16`), the same tiles' two products run on AMX tiles instead
// (amx_tiles.h): scores as keys x queries (the block's key rows, gathered from the cache, as the left operand,
// the packed queries as the right), so they land in the same layout and the same softmax serves both; the output
// as weights x values, with the weights transposed to one row per query row and the output kept row-major.
//
// Built at run time by kernels/native.py for the model's head_dim (-DPAGED_HF_HEAD_DIM), with -march=native.
// Without AVX512-BF16 only `paged_prefill_available` (returning 0) exists, and the caller keeps torch's SDPA.
//
// Layouts: q, out [tokens, num_heads, head_dim] with the given token and head strides (in elements, dimension
// contiguous); k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] contiguous; per chunk c its
// first row query_starts[c], query_lens[c] rows, context_lens[c] keys (the chunk's own included, already in the
// cache) and block_tables[c, :]. Query i of a chunk sits at position context_len - query_len + i (causal);
// window > 0 keeps the last `window` keys of each query; softcap > 0 maps a score s to softcap * tanh(s / softcap).
#include <cstdint>

#ifndef PAGED_HF_HEAD_DIM
#error "compile with -DPAGED_HF_HEAD_DIM=<head_dim>"
#endif

#ifndef __AVX512BF16__
extern "C" int paged_prefill_available() { return 0; }
#else
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "vec_math.h"

namespace {

using paged_hf::exp_nonpositive;
#ifdef PAGED_HF_AMX
namespace amx = paged_hf::amx;
#endif

constexpr int kDim = PAGED_HF_HEAD_DIM;
constexpr int kPairs = kDim / 2;  // bf16 pairs per query/key row
constexpr int kLanes = 16;        // float32 lanes: query rows per vector
constexpr int kMaxVectors = 3;    // row vectors per tile: 48 rows
constexpr int kKeyBlock = 32;     // keys per online-softmax step
constexpr int kKeysAtOnce = 4;    // keys scored together (their broadcasts share the tile's query loads)
constexpr int kDimsAtOnce = 8;    // output dimensions accumulated together
constexpr float kMasked = -1e30f;  // a masked score: finite, so that max - max is never inf - inf
static_assert(kDim % 32 == 0, "head_dim must be a multiple of 32");

struct Chunks {
  const uint16_t *q;
  int64_t q_token_stride, q_head_stride;
  const uint16_t *k_cache, *v_cache;
  const int64_t *block_tables, *query_starts, *query_lens, *context_lens;
  uint16_t *out;
  int64_t out_token_stride, out_head_stride;
  int64_t max_blocks, num_heads, num_kv_heads, block_size, window;
  float scale, softcap;
};

struct Tile {
  int64_t chunk, kv_head, first_token, tokens, cost;
};

// One thread's scratch, 64-byte aligned: the tile's packed queries, a key block's scores and bf16 weights, its
// packed values, the running output (transposed: dimension-major, rows in lanes) and softmax state.
struct alignas(64) Scratch {
  __m512i queries[kPairs][kMaxVectors];
  __m512 scores[kKeyBlock][kMaxVectors];
  __m512i weights[kKeyBlock / 2][kMaxVectors];
  uint32_t values[kKeyBlock / 2][kDim];
  __m512 out[kDim][kMaxVectors];
  __m512 max[kMaxVectors], sum[kMaxVectors], correction[kMaxVectors];
  __m512i lo[kMaxVectors], hi[kMaxVectors];  // each row's allowed key positions [lo, hi]
  __mmask16 allowed[kKeyBlock][kMaxVectors];
  uint16_t zeros[kDim];  // stands in for the keys past a chunk's end
  // AMX only: the block's keys (the scores' left operand), each query row's weights as key pairs (the output's
  // left operand) and the running output, row-major
  uint16_t key_rows[kKeyBlock][kDim];
  uint32_t weights_by_row[kMaxVectors][kLanes][kKeyBlock / 2];
  float out_rows[kMaxVectors * kLanes][kDim];
};

inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh &>(a), reinterpret_cast<__m512bh &>(b));
}

inline __m512i broadcast_pair(const uint16_t *pair) {
  int32_t bits;
  std::memcpy(&bits, pair, sizeof(bits));
  return _mm512_set1_epi32(bits);
}

// The tile's query rows as pairs: queries[p][v] lane l = (q[d = 2p], q[2p + 1]) of row 16 v + l; zeros past
// the last row (those lanes compute harmless finite garbage that is never written out).
template <int R> void pack_queries(const Chunks &c, const Tile &t, Scratch &w) {
  const int64_t group = c.num_heads / c.num_kv_heads, rows = t.tokens * group;
  uint32_t *packed = reinterpret_cast<uint32_t *>(w.queries);
  alignas(64) int32_t lo[R * kLanes], hi[R * kLanes];
  const int64_t offset = c.context_lens[t.chunk] - c.query_lens[t.chunk];
  for (int64_t r = 0; r < R * kLanes; ++r) {
    const int64_t v = r / kLanes, lane = r % kLanes;
    if (r >= rows) {
      for (int p = 0; p < kPairs; ++p) packed[(p * kMaxVectors + v) * kLanes + lane] = 0;
      lo[r] = 0, hi[r] = INT32_MAX;
      continue;
    }
    const int64_t token = t.first_token + r / group, head = t.kv_head * group + r % group;
    const uint16_t *row = c.q + (c.query_starts[t.chunk] + token) * c.q_token_stride + head * c.q_head_stride;
    for (int p = 0; p < kPairs; ++p) std::memcpy(&packed[(p * kMaxVectors + v) * kLanes + lane], row + 2 * p, 4);
    hi[r] = static_cast<int32_t>(offset + token);
    lo[r] = c.window > 0 ? static_cast<int32_t>(std::max<int64_t>(0, offset + token - c.window + 1)) : 0;
  }
  for (int v = 0; v < R; ++v) {
    w.lo[v] = _mm512_load_si512(lo + v * kLanes);
    w.hi[v] = _mm512_load_si512(hi + v * kLanes);
    w.max[v] = _mm512_set1_ps(kMasked);
    w.sum[v] = _mm512_setzero_ps();
  }
  for (int d = 0; d < kDim; ++d)
    for (int v = 0; v < R; ++v) w.out[d][v] = _mm512_setzero_ps();
}

// A raw score times the scale, soft-capped when asked.
inline __m512 scaled(const Chunks &c, __m512 s) {
  s = s * c.scale;
  return c.softcap > 0 ? paged_hf::soft_cap(s, c.softcap) : s;
}

// scores[i][v] = scale * q . k_i for the block's keys (rows in lanes), soft-capped when asked.
template <int R> void score_block(const Chunks &c, const uint16_t *const *keys, Scratch &w) {
  for (int i = 0; i < kKeyBlock; i += kKeysAtOnce) {
    __m512 acc[kKeysAtOnce][R];
    for (int j = 0; j < kKeysAtOnce; ++j)
      for (int v = 0; v < R; ++v) acc[j][v] = _mm512_setzero_ps();
    for (int p = 0; p < kPairs; ++p) {
      __m512i q[R];
      for (int v = 0; v < R; ++v) q[v] = w.queries[p][v];
      for (int j = 0; j < kKeysAtOnce; ++j) {
        const __m512i k = broadcast_pair(keys[i + j] + 2 * p);
        for (int v = 0; v < R; ++v) acc[j][v] = dot_pairs(acc[j][v], q[v], k);
      }
    }
    for (int j = 0; j < kKeysAtOnce; ++j)
      for (int v = 0; v < R; ++v) w.scores[i + j][v] = scaled(c, acc[j][v]);
  }
}

// Online softmax over the block's scores: masks (when the block is not allowed whole for every row), new
// running max, the correction of what was accumulated, bf16 weights interleaved by key pairs, running sums.
template <int R> void softmax_block(int64_t first_key, bool masked, Scratch &w) {
  if (masked)
    for (int i = 0; i < kKeyBlock; ++i) {
      const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(first_key + i));
      for (int v = 0; v < R; ++v) {
        const __mmask16 allowed = _mm512_cmple_epi32_mask(w.lo[v], key) & _mm512_cmple_epi32_mask(key, w.hi[v]);
        w.allowed[i][v] = allowed;
        w.scores[i][v] = _mm512_mask_blend_ps(allowed, _mm512_set1_ps(kMasked), w.scores[i][v]);
      }
    }
  // (key 2i, key 2i + 1) of each row next to each other: lane l of the result holds both keys' weights of row l
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int v = 0; v < R; ++v) {
    __m512 block_max = w.scores[0][v];
    for (int i = 1; i < kKeyBlock; ++i) block_max = _mm512_max_ps(block_max, w.scores[i][v]);
    const __m512 new_max = _mm512_max_ps(w.max[v], block_max);
    w.correction[v] = exp_nonpositive(w.max[v] - new_max);
    w.max[v] = new_max;
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < kKeyBlock; i += 2) {
      __m512 even = exp_nonpositive(w.scores[i][v] - new_max), odd = exp_nonpositive(w.scores[i + 1][v] - new_max);
      if (masked) {
        even = _mm512_maskz_mov_ps(w.allowed[i][v], even);
        odd = _mm512_maskz_mov_ps(w.allowed[i + 1][v], odd);
      }
      sum += even + odd;
      const __m512bh both = _mm512_cvtne2ps_pbh(odd, even);  // lanes 0-15: even keys, 16-31: odd keys
      w.weights[i / 2][v] = _mm512_permutexvar_epi16(interleave, reinterpret_cast<const __m512i &>(both));
    }
    w.sum[v] = w.sum[v] * w.correction[v] + sum;
  }
}

// values[i][d] = (v[key 2i][d], v[key 2i + 1][d]).
void pack_values(const uint16_t *const *values, Scratch &w) {
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                       37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int i = 0; i < kKeyBlock / 2; ++i)
    for (int d = 0; d < kDim; d += 32) {
      const __m512i even = _mm512_loadu_si512(values[2 * i] + d), odd = _mm512_loadu_si512(values[2 * i + 1] + d);
      _mm512_store_si512(&w.values[i][d], _mm512_permutex2var_epi16(even, low, odd));
      _mm512_store_si512(&w.values[i][d + 16], _mm512_permutex2var_epi16(even, high, odd));
    }
}

// out[d][v] = out[d][v] * correction[v] + sum over the block's keys of weight * value[d].
template <int R> void accumulate_block(int pairs, Scratch &w) {
  for (int d0 = 0; d0 < kDim; d0 += kDimsAtOnce) {
    __m512 acc[kDimsAtOnce][R];
    for (int j = 0; j < kDimsAtOnce; ++j)
      for (int v = 0; v < R; ++v) acc[j][v] = w.out[d0 + j][v] * w.correction[v];
    for (int i = 0; i < pairs; ++i) {
      __m512i weight[R];
      for (int v = 0; v < R; ++v) weight[v] = w.weights[i][v];
      for (int j = 0; j < kDimsAtOnce; ++j) {
        const __m512i value = _mm512_set1_epi32(static_cast<int32_t>(w.values[i][d0 + j]));
        for (int v = 0; v < R; ++v) acc[j][v] = dot_pairs(acc[j][v], weight[v], value);
      }
    }
    for (int j = 0; j < kDimsAtOnce; ++j)
      for (int v = 0; v < R; ++v) w.out[d0 + j][v] = acc[j][v];
  }
}

// Row r of the tile (`sums`: its output's float32 sums, 64-byte aligned) divided by its softmax sum, rounded to
// bf16, written to its place in `out`.
inline void store_row(const Chunks &c, const Tile &t, int64_t r, const float *sums, const Scratch &w) {
  const int64_t group = c.num_heads / c.num_kv_heads;
  const float inverse = 1.0f / w.sum[r / kLanes][r % kLanes];
  const int64_t token = t.first_token + r / group, head = t.kv_head * group + r % group;
  uint16_t *dst = c.out + (c.query_starts[t.chunk] + token) * c.out_token_stride + head * c.out_head_stride;
  for (int d = 0; d < kDim; d += kLanes) {
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_load_ps(sums + d) * inverse);
    std::memcpy(dst + d, &rounded, sizeof(rounded));
  }
}

// Each row's output (dimension-major in `out`: gathered row by row) written to its place.
template <int R> void write_rows(const Chunks &c, const Tile &t, Scratch &w) {
  alignas(64) float row[kDim];
  for (int64_t r = 0; r < t.tokens * (c.num_heads / c.num_kv_heads); ++r) {
    for (int d = 0; d < kDim; ++d) row[d] = w.out[d][r / kLanes][r % kLanes];
    store_row(c, t, r, row, w);
  }
}

// The AVX512-BF16 path: the functions above.
struct VectorPath {
  static void begin_thread() {}
  static void end_thread() {}
  template <int R> static void start(Scratch &) {}
  template <int R> static void score(const Chunks &c, const uint16_t *const *keys, Scratch &w) {
    score_block<R>(c, keys, w);
  }
  template <int R> static void accumulate(int pairs, Scratch &w) { accumulate_block<R>(pairs, w); }
  template <int R> static void write(const Chunks &c, const Tile &t, Scratch &w) { write_rows<R>(c, t, w); }
};

#ifdef PAGED_HF_AMX
// 16 x 16 32-bit elements: dst row j = column j of src (rows `src_stride` vectors apart).
inline void transpose16(const __m512i *src, int64_t src_stride, __m512i *dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(src + i * src_stride);
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: (a0 b0 a1 b1), (a2 b2 a3 b3)
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // per lane L: r[i + j] holds column 4 L + j of rows i .. i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // column 4 L + j: lane L of r[j], r[4 + j], r[8 + j], r[12 + j]
    const __m512i low = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), high = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i low2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
    const __m512i high2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    _mm512_store_si512(dst + j, _mm512_shuffle_i32x4(low, low2, 0x88));
    _mm512_store_si512(dst + 4 + j, _mm512_shuffle_i32x4(low, low2, 0xDD));
    _mm512_store_si512(dst + 8 + j, _mm512_shuffle_i32x4(high, high2, 0x88));
    _mm512_store_si512(dst + 12 + j, _mm512_shuffle_i32x4(high, high2, 0xDD));
  }
}

// The AMX path: tiles 0-2 sum the scores of 16 keys for each row vector (keys in the tile's rows, query rows in
// its columns: the layout of `scores`), then tiles 0-1 add weights x values into 16 rows x 32 dimensions.
struct AmxPath {
  static bool usable() { return amx::enable(); }
  static void begin_thread() { amx::configure(); }
  static void end_thread() { amx::release(); }

  template <int R> static void start(Scratch &w) { std::memset(w.out_rows, 0, sizeof(float) * R * kLanes * kDim); }

  template <int R> static void score(const Chunks &c, const uint16_t *const *keys, Scratch &w) {
    for (int i = 0; i < kKeyBlock; ++i) std::memcpy(w.key_rows[i], keys[i], sizeof(w.key_rows[i]));
    for (int first = 0; first < kKeyBlock; first += amx::kRows) {
      for (int v = 0; v < R; ++v) amx::zero(v);
      for (int p = 0; p < kPairs; p += amx::kRowBytes / 4) {  // 16 pairs (32 dimensions) a product
        amx::load(4, &w.key_rows[first][2 * p], sizeof(w.key_rows[0]));
        for (int v = 0; v < R; ++v) {
          amx::load(5 + v, &w.queries[p][v], sizeof(w.queries[0]));
          amx::dot(v);
        }
      }
      for (int v = 0; v < R; ++v) amx::store(v, &w.scores[first][v], sizeof(w.scores[0]));
    }
    for (int i = 0; i < kKeyBlock; ++i)
      for (int v = 0; v < R; ++v) w.scores[i][v] = scaled(c, w.scores[i][v]);
  }

  // out_rows = out_rows * correction + weights x values; every pair of the block (the weights past its keys are 0).
  template <int R> static void accumulate(int, Scratch &w) {
    for (int v = 0; v < R; ++v) {
      transpose16(&w.weights[0][v], kMaxVectors, reinterpret_cast<__m512i *>(w.weights_by_row[v]));
      alignas(64) float correction[kLanes];
      _mm512_store_ps(correction, w.correction[v]);
      for (int lane = 0; lane < kLanes; ++lane) {
        float *row = w.out_rows[v * kLanes + lane];
        for (int d = 0; d < kDim; d += kLanes)
          _mm512_store_ps(row + d, _mm512_load_ps(row + d) * correction[lane]);
      }
    }
    constexpr int64_t kRowStride = sizeof(w.out_rows[0]);
    for (int v = 0; v < R; ++v) {
      float *rows = w.out_rows[v * kLanes];
      amx::load(4, w.weights_by_row[v], sizeof(w.weights_by_row[v][0]));
      for (int d = 0; d < kDim; d += 2 * kLanes) {
        for (int j = 0; j < 2; ++j) {
          amx::load(j, rows + d + j * kLanes, kRowStride);
          amx::load(5 + j, &w.values[0][d + j * kLanes], sizeof(w.values[0]));
          amx::dot(j);
        }
        for (int j = 0; j < 2; ++j) amx::store(j, rows + d + j * kLanes, kRowStride);
      }
    }
  }

  template <int R> static void write(const Chunks &c, const Tile &t, Scratch &w) {
    for (int64_t r = 0; r < t.tokens * (c.num_heads / c.num_kv_heads); ++r) store_row(c, t, r, w.out_rows[r], w);
  }
};
#endif

// One tile: its rows against the keys any of them may see, block by block.
template <int R, typename Path> void attend_tile(const Chunks &c, const Tile &t, Scratch &w) {
  pack_queries<R>(c, t, w);
  Path::template start<R>(w);
  const int64_t offset = c.context_lens[t.chunk] - c.query_lens[t.chunk];
  const int64_t first = offset + t.first_token, last = first + t.tokens - 1;  // the tile's first and last positions
  const int64_t begin = c.window > 0 ? std::max<int64_t>(0, first - c.window + 1) : 0, end = last + 1;
  const int64_t lo_max = c.window > 0 ? std::max<int64_t>(0, last - c.window + 1) : 0;  // every row sees [lo_max, first]
  const int64_t *table = c.block_tables + t.chunk * c.max_blocks;
  const int64_t token_stride = c.num_kv_heads * kDim;
  const uint16_t *keys[kKeyBlock], *values[kKeyBlock];
  for (int64_t b0 = begin; b0 < end; b0 += kKeyBlock) {
    const int64_t count = std::min<int64_t>(kKeyBlock, end - b0);
    for (int i = 0; i < kKeyBlock; ++i) {
      if (i < count) {
        const int64_t pos = b0 + i;
        const int64_t slot = table[pos / c.block_size] * c.block_size + pos % c.block_size;
        keys[i] = c.k_cache + slot * token_stride + t.kv_head * kDim;
        values[i] = c.v_cache + slot * token_stride + t.kv_head * kDim;
      } else {
        keys[i] = values[i] = w.zeros;
      }
    }
    Path::template score<R>(c, keys, w);
    softmax_block<R>(b0, b0 < lo_max || b0 + kKeyBlock - 1 > first, w);
    pack_values(values, w);
    Path::template accumulate<R>(static_cast<int>((count + 1) / 2), w);
  }
  Path::template write<R>(c, t, w);
}

// The step's tiles: each chunk's tokens in runs of 48 / G (one KV head's rows of a tile), costliest first.
std::vector<Tile> make_tiles(const Chunks &c, int64_t num_chunks) {
  const int64_t group = c.num_heads / c.num_kv_heads;
  const int64_t tokens_per_tile = std::max<int64_t>(1, kMaxVectors * kLanes / group);
  std::vector<Tile> tiles;
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    const int64_t offset = c.context_lens[chunk] - c.query_lens[chunk];
    for (int64_t first = 0; first < c.query_lens[chunk]; first += tokens_per_tile) {
      const int64_t tokens = std::min(tokens_per_tile, c.query_lens[chunk] - first), end = offset + first + tokens;
      const int64_t keys = c.window > 0 ? std::min(end, c.window + tokens) : end;
      for (int64_t kv_head = 0; kv_head < c.num_kv_heads; ++kv_head)
        tiles.push_back({chunk, kv_head, first, tokens, keys * (tokens * group + kLanes - 1) / kLanes});
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile &a, const Tile &b) { return a.cost > b.cost; });
  return tiles;
}

// The step's tiles over the threads, each thread with its scratch (and, on AMX, its tile configuration).
template <typename Path> int attend(const Chunks &c, int64_t num_chunks, int num_threads) {
  if (c.num_heads / c.num_kv_heads > kMaxVectors * kLanes) return 2;
  const std::vector<Tile> tiles = make_tiles(c, num_chunks);
  const int64_t group = c.num_heads / c.num_kv_heads;
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    auto *w = static_cast<Scratch *>(std::aligned_alloc(alignof(Scratch), sizeof(Scratch)));
    if (!w) {
#pragma omp atomic write
      failed = 1;
    } else {
      std::memset(w->zeros, 0, sizeof(w->zeros));
      Path::begin_thread();
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < static_cast<int64_t>(tiles.size()); ++i) {
      if (!w) continue;
      const Tile &t = tiles[i];
      switch ((t.tokens * group + kLanes - 1) / kLanes) {
        case 1: attend_tile<1, Path>(c, t, *w); break;
        case 2: attend_tile<2, Path>(c, t, *w); break;
        default: attend_tile<3, Path>(c, t, *w); break;
      }
    }
    if (w) Path::end_thread();
    std::free(w);
  }
  return failed;
}

}  // namespace

extern "C" int paged_prefill_available() { return 1; }

// 1 where the AMX entry point exists and this process may use the tiles (asking Linux for them once).
extern "C" int paged_prefill_amx_available() {
#ifdef PAGED_HF_AMX
  static const bool usable = AmxPath::usable();
  return usable ? 1 : 0;
#else
  return 0;
#endif
}

#define PAGED_HF_PREFILL_ARGUMENTS                                                                               \
  const uint16_t *q, int64_t q_token_stride, int64_t q_head_stride, const uint16_t *k_cache,                       \
      const uint16_t *v_cache, const int64_t *block_tables, const int64_t *query_starts, const int64_t *query_lens, \
      const int64_t *context_lens, uint16_t *out, int64_t out_token_stride, int64_t out_head_stride,              \
      int64_t num_chunks, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,        \
      double scale, int64_t window, double softcap, int num_threads
#define PAGED_HF_CHUNKS                                                                                           \
  Chunks {                                                                                                        \
    q, q_token_stride, q_head_stride, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens, out, \
        out_token_stride, out_head_stride, max_blocks, num_heads, num_kv_heads, block_size, window,               \
        static_cast<float>(scale), static_cast<float>(softcap)                                                    \
  }

// Returns 0 on success, 1 when scratch memory could not be allocated, 2 when a KV head's query heads do not
// fit in a tile (more than 48).
extern "C" int paged_prefill_bfloat16(PAGED_HF_PREFILL_ARGUMENTS) {
  return attend<VectorPath>(PAGED_HF_CHUNKS, num_chunks, num_threads);
}

#ifdef PAGED_HF_AMX
// The same on AMX tiles; call only where paged_prefill_amx_available() said 1.
extern "C" int paged_prefill_amx_bfloat16(PAGED_HF_PREFILL_ARGUMENTS) {
  return attend<AmxPath>(PAGED_HF_CHUNKS, num_chunks, num_threads);
}
#endif
#endif
