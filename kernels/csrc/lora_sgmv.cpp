// Multi-LoRA for the linears of one packed step that read the same x, every adapter at once (Punica's SGMV on
// the CPU): for each member linear m (one alone, or q/k/v, or gate/up),
//   y_m[t] += B_m[slot(t)] @ (A_m[slot(t)] @ x[t])   for every token t of the step that has an adapter.
// Tokens come grouped by adapter slot (`order`, cut into segments by `seg_starts`), so a segment's A and B are
// read once per tile of kTile tokens and stay in cache, whatever the number of adapters in the step. The
// shrink (A @ x, rank r) and the expand (B @ t) sum in float (double for float64); bf16 outputs are rounded
// once, when the update is added. With AVX512-BF16 (compiled with -march=native on such a CPU) the bf16 shrink
// and expand run on vdpbf16ps, the expand with the rank vector rounded to bf16 (as a bf16 matmul's output is);
// elsewhere the rank vector stays in float. One call replaces the Python loop over slots (a gather, two small
// matmuls and an index_add_ per slot) that cost ~54,000 ops per step with 64 adapters; one call for a group of
// linears replaces one call each (a call's fixed cost, ctypes and checks in Python, is several us: 210 calls a
// step on the default model).
//
// Each slot's A and B are read where they lie, through a table of addresses per member (on a CPU the adapter's
// host copy is the slot: taking an adapter into a slot copies nothing).
//
// Layouts (row-major, contiguous but for the token strides of x and y):
//   x [num_tokens, in] (row stride x_stride); per member: y [num_tokens, out] (row stride y_stride),
//   a_table[slot] -> A [rank, in], bt_table[slot] -> Bt [rank, out] (B transposed: the expand runs along `out`),
//   ranks [num_slots] (0: the slot's adapter skips this linear); order [num_ordered], seg_slots [num_segments],
//   seg_starts [num_segments + 1] (offsets into order).
#include <omp.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int kTile = 4;        // tokens that share each load of A and B
constexpr int kRanks = 4;       // rows of A that share each load of x (kTile x kRanks accumulators in registers)
constexpr int kMaxRank = 128;   // the rank vector of a tile lives on the stack
constexpr int64_t kSerialWork = 1 << 17;  // multiply-adds below which one thread is faster than two

// The next work item's A and Bt, prefetched into L2 a few lines at a time from inside a decode token's loops
// (`ahead.step(n)`; tiles of several tokens find their factors in cache and leave it out). A decode step's
// factors come cold from memory, each adapter's once, in blocks of a few KB that the hardware prefetcher barely
// starts on before the item ends; issued this way, the next item's reads overlap this item's arithmetic. Into L2,
// not L1: prefetches into L1 hold its few miss buffers and measured no faster. AMD EPYC Zen 4, 64 decode tokens
// on 64 rank-8 adapters over 30 layers: ~20 ms -> ~15 ms a step.
struct Ahead {
  const char *next[2] = {nullptr, nullptr};  // A, then Bt
  int64_t left[2] = {0, 0};                  // bytes not yet prefetched
  int part = 2;                              // 2: nothing (left) to prefetch

  void start(const void *a, int64_t a_bytes, const void *bt, int64_t bt_bytes) {
    next[0] = static_cast<const char *>(a), next[1] = static_cast<const char *>(bt);
    left[0] = a_bytes, left[1] = bt_bytes;
    part = 0;
  }
  inline void step(int lines) {
    for (; lines > 0 && part < 2; --lines) {
      __builtin_prefetch(next[part], 0, 2);  // read, into L2 (prefetcht1)
      next[part] += 64;
      if ((left[part] -= 64) <= 0) ++part;
    }
  }
};
thread_local Ahead ahead;
constexpr int kAheadShrink = 4;  // lines prefetched per step of a shrink loop (one vector of x)
constexpr int kAheadExpand = 2;  // per step of an expand loop (one vector of outputs)

template <typename F>
struct Vec {
  static constexpr int kLanes = 64 / sizeof(F);
  typedef F V __attribute__((vector_size(64)));
};

// element i of a row, widened to the compute type
template <typename T, typename F> inline F load1(const T *p, int64_t i) { return static_cast<F>(p[i]); }
template <> inline float load1<uint16_t, float>(const uint16_t *p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// kLanes consecutive elements, widened to the compute type
template <typename T, typename F> inline typename Vec<F>::V loadv(const T *p) {
  typename Vec<F>::V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <> inline Vec<float>::V loadv<uint16_t, float>(const uint16_t *p) {
  typedef uint16_t H __attribute__((vector_size(32)));
  typedef uint32_t U __attribute__((vector_size(64)));
  H h;
  std::memcpy(&h, p, sizeof(h));
  const U u = __builtin_convertvector(h, U) << 16;
  Vec<float>::V v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

inline uint16_t to_bf16(float value) {  // round to nearest even, as torch does (NaN stays NaN)
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// y += delta for kLanes consecutive elements
template <typename T, typename F> inline void addv(T *p, typename Vec<F>::V delta) {
  typename Vec<F>::V v = loadv<T, F>(p) + delta;
  std::memcpy(p, &v, sizeof(v));
}
template <> inline void addv<uint16_t, float>(uint16_t *p, Vec<float>::V delta) {
#if defined(__AVX512BF16__)
  // vcvtneps2bf16 rounds 16 floats to nearest even (NaN kept) in one instruction
  const Vec<float>::V v = loadv<uint16_t, float>(p) + delta;
  __m512 m;
  std::memcpy(&m, &v, sizeof(m));
  const __m256bh h = _mm512_cvtneps_pbh(m);
  std::memcpy(p, &h, sizeof(h));
#else
  typedef uint32_t U __attribute__((vector_size(64)));
  typedef uint16_t H __attribute__((vector_size(32)));
  const Vec<float>::V v = loadv<uint16_t, float>(p) + delta;
  U bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const U rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;  // to nearest even, as to_bf16
  const U nan = (bits & 0x7fffffffu) > 0x7f800000u;               // all ones where v is NaN
  const H h = __builtin_convertvector((rounded & ~nan) | (((bits >> 16) | 0x40u) & nan), H);
  std::memcpy(p, &h, sizeof(h));
#endif
}
template <typename T, typename F> inline void add1(T *p, F delta) { *p = static_cast<T>(static_cast<F>(*p) + delta); }
template <> inline void add1<uint16_t, float>(uint16_t *p, float delta) { *p = to_bf16(load1<uint16_t, float>(p, 0) + delta); }

// dots[j][i] = arows[i] . rows[j] over `in` elements, for NT tokens: the shrink, kRanks rows of A sharing each
// load of x
template <int NT, typename T, typename F>
void shrink(const T *const *rows, const T *const *arows, int64_t in, F (&dots)[kTile][kRanks]) {
  using V = typename Vec<F>::V;
  constexpr int L = Vec<F>::kLanes;
  const int64_t vec_in = in - in % L;
  V acc[NT][kRanks] = {};
  for (int64_t k = 0; k < vec_in; k += L) {
    V xv[NT];
    for (int j = 0; j < NT; ++j) xv[j] = loadv<T, F>(rows[j] + k);
    if constexpr (NT == 1) ahead.step(kAheadShrink);
    for (int i = 0; i < kRanks; ++i) {
      const V av = loadv<T, F>(arows[i] + k);
      for (int j = 0; j < NT; ++j) acc[j][i] += av * xv[j];
    }
  }
  for (int j = 0; j < NT; ++j) {
    for (int i = 0; i < kRanks; ++i) {
      F sum = 0;
      for (int l = 0; l < L; ++l) sum += acc[j][i][l];
      for (int64_t k = vec_in; k < in; ++k) sum += load1<T, F>(arows[i], k) * load1<T, F>(rows[j], k);
      dots[j][i] = sum;
    }
  }
}

#if defined(__AVX512BF16__)
// Per 128-bit lane L: the four partial sums of v[0..3] over L's four floats, in that order (unpacks, shuffles and
// adds across four vectors at once: the first steps of a transposed reduction)
inline __m512 lane_sums4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  const __m512 p01 = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
  const __m512 p23 = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
  return _mm512_add_ps(_mm512_shuffle_ps(p01, p23, 0x44), _mm512_shuffle_ps(p01, p23, 0xEE));
}

// out[i] = the sum of v[i]'s 16 floats, for 16 vectors: ~45 instructions where 16 horizontal reductions take ~150
inline void sums16(const __m512 (&v)[16], float *out) {
  __m512 quad[4];
  for (int q = 0; q < 4; ++q) quad[q] = lane_sums4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
  // 128-bit lanes (0, 2) plus (1, 3) of two vectors at once, twice: lane q of the result holds quad[q]'s four totals
  const auto halves = [](__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  };
  _mm512_storeu_ps(out, halves(halves(quad[0], quad[1]), halves(quad[2], quad[3])));
}

// out[i] = the sum of v[i]'s 16 floats, for 4 vectors
inline void sums4(__m512 v0, __m512 v1, __m512 v2, __m512 v3, float *out) {
  const __m512 quad = lane_sums4(v0, v1, v2, v3);
  const __m128 sum = _mm_add_ps(_mm_add_ps(_mm512_extractf32x4_ps(quad, 0), _mm512_extractf32x4_ps(quad, 1)),
                                _mm_add_ps(_mm512_extractf32x4_ps(quad, 2), _mm512_extractf32x4_ps(quad, 3)));
  _mm_storeu_ps(out, sum);
}

// bf16 with AVX512-BF16: vdpbf16ps multiplies 32 bf16 pairs into 16 float sums, no widening of x and A first
template <int NT>
void shrink_bf16(const uint16_t *const *rows, const uint16_t *const *arows, int64_t in, float (&dots)[kTile][kRanks]) {
  static_assert(kRanks == 4 && (NT == 1 || NT == kTile) && kTile == 4, "the reductions below sum 4 or 16 vectors");
  const int64_t vec_in = in - in % 32;
  __m512 acc[NT * kRanks];  // token j, rank i at j * kRanks + i
  for (int n = 0; n < NT * kRanks; ++n) acc[n] = _mm512_setzero_ps();
  for (int64_t k = 0; k < vec_in; k += 32) {
    __m512bh xv[NT];
    for (int j = 0; j < NT; ++j) xv[j] = (__m512bh)_mm512_loadu_si512(rows[j] + k);
    if constexpr (NT == 1) ahead.step(kAheadShrink);
    for (int i = 0; i < kRanks; ++i) {
      const __m512bh av = (__m512bh)_mm512_loadu_si512(arows[i] + k);
      for (int j = 0; j < NT; ++j) acc[j * kRanks + i] = _mm512_dpbf16_ps(acc[j * kRanks + i], av, xv[j]);
    }
  }
  float sums[NT * kRanks];
  if constexpr (NT == 1) {
    sums4(acc[0], acc[1], acc[2], acc[3], sums);
  } else {
    sums16(acc, sums);
  }
  for (int j = 0; j < NT; ++j) {
    for (int i = 0; i < kRanks; ++i) {
      float sum = sums[j * kRanks + i];
      for (int64_t k = vec_in; k < in; ++k) sum += load1<uint16_t, float>(arows[i], k) * load1<uint16_t, float>(rows[j], k);
      dots[j][i] = sum;
    }
  }
}
#endif

// the shrink for NT tokens, on the CPU's fastest path for T
template <int NT, typename T, typename F>
inline void shrink_tokens(const T *const *rows, const T *const *arows, int64_t in, F (&dots)[kTile][kRanks]) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    shrink_bf16<NT>(rows, arows, in, dots);
    return;
  }
#endif
  shrink<NT, T, F>(rows, arows, in, dots);
}

#if defined(__AVX512BF16__)
// (bf16 t[2q], bf16 t[2q + 1]) as one 32-bit lane, the odd half 0 past the rank: what vdpbf16ps broadcasts
inline uint32_t rank_pair(const float *t, int64_t q, int64_t rank) {
  const uint32_t lo = to_bf16(t[2 * q]), hi = 2 * q + 1 < rank ? to_bf16(t[2 * q + 1]) : 0;
  return lo | hi << 16;
}

// the permutation that interleaves two rows' 16 elements: lane 2i row 2q's element i, lane 2i + 1 row 2q + 1's
inline __m512i pair_interleave() {
  alignas(64) int16_t order[32];
  for (int i = 0; i < 16; ++i) order[2 * i] = static_cast<int16_t>(i), order[2 * i + 1] = static_cast<int16_t>(32 + i);
  return _mm512_load_si512(order);
}

// Bt's rows 2q and 2q + 1 at outputs o .. o + 15, interleaved for vdpbf16ps (the odd row zero past the rank)
inline __m512bh row_pair(const uint16_t *bslot, int64_t q, int64_t rank, int64_t out, int64_t o, __m512i interleave) {
  const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(bslot + 2 * q * out + o));
  const __m256i odd = 2 * q + 1 < rank
                          ? _mm256_loadu_si256(reinterpret_cast<const __m256i *>(bslot + (2 * q + 1) * out + o))
                          : _mm256_setzero_si256();
  return (__m512bh)_mm512_permutex2var_epi16(_mm512_castsi256_si512(even), interleave, _mm512_castsi256_si512(odd));
}

// the outputs from `first` on (past the last full vector), one at a time
inline void expand_tail_bf16(const float (&t)[kTile][kMaxRank], int64_t rank, const uint16_t *bslot, int64_t first,
                             int64_t out, uint16_t *const *outs, int count) {
  for (int64_t o = first; o < out; ++o)
    for (int j = 0; j < count; ++j) {
      float sum = 0;
      for (int64_t r = 0; r < rank; ++r) sum += t[j][r] * load1<uint16_t, float>(bslot + r * out, o);
      add1<uint16_t, float>(outs[j] + o, sum);
    }
}

// The bf16 expand with AVX512-BF16: y[j][o] += sum over rank pairs of t[j][2p] B[2p][o] + t[j][2p+1] B[2p+1][o],
// 16 outputs and one pair per vdpbf16ps (rows 2p and 2p+1 interleaved in a register, the pair of t broadcast).
// The rank vector t is rounded to bf16 here (as a bf16 matmul rounds its output); the sums stay in float.
void expand_bf16(const float (&t)[kTile][kMaxRank], int64_t rank, const uint16_t *bslot, int64_t out,
                 uint16_t *const *outs, int count) {
  const int64_t pairs = (rank + 1) / 2;
  uint32_t tp[kTile][kMaxRank / 2 + 1];
  for (int j = 0; j < kTile; ++j)
    for (int64_t q = 0; q < pairs; ++q) tp[j][q] = j < count ? rank_pair(t[j], q, rank) : 0;
  const __m512i interleave = pair_interleave();
  const int64_t vec_out = out - out % 16;
  for (int64_t o = 0; o < vec_out; o += 16) {
    __m512 acc[kTile];
    for (int j = 0; j < kTile; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t q = 0; q < pairs; ++q) {
      const __m512bh both = row_pair(bslot, q, rank, out, o, interleave);
      for (int j = 0; j < kTile; ++j)
        acc[j] = _mm512_dpbf16_ps(acc[j], both, (__m512bh)_mm512_set1_epi32(static_cast<int>(tp[j][q])));
    }
    for (int j = 0; j < count; ++j) addv<uint16_t, float>(outs[j] + o, acc[j]);
  }
  expand_tail_bf16(t, rank, bslot, vec_out, out, outs, count);
}

// The bf16 expand of one token (a decode token alone on its adapter): the rank pairs outer, so each pair's two
// rows of Bt stream from memory once, in order, while the float sums of the whole output row stay in L1. The
// factors of a decode step's adapters come cold from memory (each adapter is read once a step); eight rows read
// side by side, 32 bytes at a time, kept the hardware prefetcher from running ahead. Same sums as expand_bf16.
void expand_bf16_one(const float (&t)[kTile][kMaxRank], int64_t rank, const uint16_t *bslot, int64_t out,
                     uint16_t *const *outs) {
  const int64_t vec_out = out - out % 16;
  static thread_local std::vector<float> sums;
  sums.assign(vec_out, 0.0f);
  const __m512i interleave = pair_interleave();
  for (int64_t q = 0; q < (rank + 1) / 2; ++q) {
    const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(rank_pair(t[0], q, rank)));
    for (int64_t o = 0; o < vec_out; o += 16) {
      ahead.step(kAheadExpand);
      _mm512_storeu_ps(sums.data() + o, _mm512_dpbf16_ps(_mm512_loadu_ps(sums.data() + o),
                                                         row_pair(bslot, q, rank, out, o, interleave), pair));
    }
  }
  for (int64_t o = 0; o < vec_out; o += 16) {
    Vec<float>::V v;
    std::memcpy(&v, sums.data() + o, sizeof(v));
    addv<uint16_t, float>(outs[0] + o, v);
  }
  expand_tail_bf16(t, rank, bslot, vec_out, out, outs, 1);
}
#endif

struct Step {
  int64_t in, out, x_stride, y_stride;
  const int64_t *ranks, *order, *seg_slots, *seg_starts;
};

// y[j] += sum_r t[j][r] * Bt[slot][r] for NT tokens: kChunks output vectors per rank row, so each broadcast of
// t[j][r] serves kChunks multiplies (a broadcast is a load: one per multiply made the expand load-bound)
template <int NT, typename T, typename F>
void expand(const F (&t)[kTile][kMaxRank], int64_t rank, const T *bslot, int64_t out, T *const *outs, int count) {
  using V = typename Vec<F>::V;
  constexpr int L = Vec<F>::kLanes;
  constexpr int kChunks = 3;
  int64_t o = 0;
  for (; o + kChunks * L <= out; o += kChunks * L) {
    if constexpr (NT == 1) ahead.step(kChunks * kAheadExpand);
    V acc[NT][kChunks] = {};
    for (int64_t r = 0; r < rank; ++r) {
      V b[kChunks];
      for (int c = 0; c < kChunks; ++c) b[c] = loadv<T, F>(bslot + r * out + o + c * L);
      for (int j = 0; j < NT; ++j) {
        const V tv = V{} + t[j][r];
        for (int c = 0; c < kChunks; ++c) acc[j][c] += tv * b[c];
      }
    }
    for (int j = 0; j < count; ++j)
      for (int c = 0; c < kChunks; ++c) addv<T, F>(outs[j] + o + c * L, acc[j][c]);
  }
  for (; o + L <= out; o += L) {
    V acc[NT] = {};
    for (int64_t r = 0; r < rank; ++r) {
      const V bv = loadv<T, F>(bslot + r * out + o);
      for (int j = 0; j < NT; ++j) acc[j] += t[j][r] * bv;
    }
    for (int j = 0; j < count; ++j) addv<T, F>(outs[j] + o, acc[j]);
  }
  for (; o < out; ++o) {
    for (int j = 0; j < count; ++j) {
      F sum = 0;
      for (int64_t r = 0; r < rank; ++r) sum += t[j][r] * load1<T, F>(bslot + r * out, o);
      add1<T, F>(outs[j] + o, sum);
    }
  }
}

// tokens order[first .. first + count) (count <= kTile), all on `slot`
template <typename T, typename F>
void apply_tile(const Step &s, const T *x, T *y, const T *const *a_table, const T *const *bt_table, int64_t slot,
                int64_t first, int count) {
  using V = typename Vec<F>::V;
  constexpr int L = Vec<F>::kLanes;
  const int64_t rank = s.ranks[slot];
  const T *rows[kTile];
  T *outs[kTile];
  for (int j = 0; j < count; ++j) {
    rows[j] = x + s.order[first + j] * s.x_stride;
    outs[j] = y + s.order[first + j] * s.y_stride;
  }
  for (int j = count; j < kTile; ++j) rows[j] = rows[0];  // a full tile always: fixed loops stay in registers
  F t[kTile][kMaxRank];
  for (int j = count; j < kTile; ++j)
    for (int64_t r = 0; r < rank; ++r) t[j][r] = 0;
  for (int64_t r0 = 0; r0 < rank; r0 += kRanks) {
    const T *arows[kRanks];
    for (int i = 0; i < kRanks; ++i) arows[i] = a_table[slot] + std::min<int64_t>(r0 + i, rank - 1) * s.in;
    F dots[kTile][kRanks];
    if (count == 1) {  // a decode token alone on its adapter: no padded rows
      shrink_tokens<1, T, F>(rows, arows, s.in, dots);
    } else {
      shrink_tokens<kTile, T, F>(rows, arows, s.in, dots);
    }
    for (int j = 0; j < count; ++j)
      for (int i = 0; i < kRanks && r0 + i < rank; ++i) t[j][r0 + i] = dots[j][i];
  }
  const T *bslot = bt_table[slot];
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (count == 1) {
      expand_bf16_one(t, rank, bslot, s.out, outs);
    } else {
      expand_bf16(t, rank, bslot, s.out, outs, count);
    }
    return;
  }
#endif
  if (count == 1) {
    expand<1, T, F>(t, rank, bslot, s.out, outs, count);
  } else {
    expand<kTile, T, F>(t, rank, bslot, s.out, outs, count);
  }
}

// One wrapped linear of a call: its slots' tables and its output (what `members` holds, kFields int64 per member)
constexpr int kFields = 6;
template <typename T>
struct Member {
  const T *const *a_table, *const *bt_table;
  const int64_t *ranks;
  int64_t out;
  T *y;
  int64_t y_stride;
};

template <typename T>
Member<T> member_at(const int64_t *members, int64_t m) {
  const int64_t *p = members + kFields * m;
  return Member<T>{reinterpret_cast<const T *const *>(p[0]), reinterpret_cast<const T *const *>(p[1]),
                   reinterpret_cast<const int64_t *>(p[2]), p[3], reinterpret_cast<T *>(p[4]), p[5]};
}

// Every member (linears that read the same x: q/k/v, gate/up, or one linear alone) in one parallel region: the
// work items are (tile of a segment, member) pairs, tile-major, so a tile's x rows stay in L1 across members. A
// thread takes its next item before it runs the current one, and prefetches that item's factors meanwhile (`Ahead`).
template <typename T, typename F>
int apply(const int64_t *members, int64_t num_members, const int64_t *segments, const T *x, int64_t x_stride,
          int64_t in, int num_threads) {
  const int64_t *order = reinterpret_cast<const int64_t *>(segments[0]);
  const int64_t *seg_slots = reinterpret_cast<const int64_t *>(segments[1]);
  const int64_t *seg_starts = reinterpret_cast<const int64_t *>(segments[2]);
  const int64_t num_segments = segments[3];
  static thread_local std::vector<int64_t> items;  // (segment, first ordered index, member) triples, flattened;
  items.clear();                                   // no malloc per call once it has grown
  int64_t work = 0;  // multiply-adds, to leave small calls on one thread (a fork and join cost ~ a few us)
  for (int64_t g = 0; g < num_segments; ++g) {
    const int64_t slot = seg_slots[g], count = seg_starts[g + 1] - seg_starts[g];
    for (int64_t i = seg_starts[g]; i < seg_starts[g + 1]; i += kTile)
      for (int64_t m = 0; m < num_members; ++m) {
        const int64_t *p = members + kFields * m;
        const int64_t rank = reinterpret_cast<const int64_t *>(p[2])[slot];
        if (rank == 0) continue;
        if (rank > kMaxRank) return 1;  // before any work: the caller's torch path then does it all
        items.insert(items.end(), {g, i, m});
        if (i == seg_starts[g]) work += count * rank * (in + p[3]);
      }
  }
  const int64_t num_items = static_cast<int64_t>(items.size()) / 3;
  const int64_t *item = items.data();  // the caller's: inside the region `items` would name each thread's own
  const int threads = work < kSerialWork ? 1 : static_cast<int>(std::min<int64_t>(num_threads, num_items));
  auto prefetch = [&](int64_t i) {
    const Member<T> mb = member_at<T>(members, item[3 * i + 2]);
    const int64_t slot = seg_slots[item[3 * i]], bytes = mb.ranks[slot] * static_cast<int64_t>(sizeof(T));
    ahead.start(mb.a_table[slot], bytes * in, mb.bt_table[slot], bytes * mb.out);
  };
  auto run = [&](int64_t i) {
    const int64_t g = item[3 * i], first = item[3 * i + 1];
    const Member<T> mb = member_at<T>(members, item[3 * i + 2]);
    const Step s{in, mb.out, x_stride, mb.y_stride, mb.ranks, order, seg_slots, seg_starts};
    const int count = static_cast<int>(std::min<int64_t>(kTile, seg_starts[g + 1] - first));
    apply_tile<T, F>(s, x, mb.y, mb.a_table, mb.bt_table, seg_slots[g], first, count);
  };
  // item i, with item `next` prefetched meanwhile where it reads its factors cold (the first tile of a segment;
  // the next tiles find them in cache)
  auto run_ahead = [&](int64_t i, int64_t next) {
    if (next < num_items && item[3 * next + 1] == seg_starts[item[3 * next]]) prefetch(next);
    run(i);
    ahead.part = 2;  // whatever was not prefetched in time is read anyway
  };
  if (threads <= 1) {  // no parallel region at all: even an inactive one costs a runtime call
    for (int64_t i = 0; i < num_items; ++i) run_ahead(i, i + 1);
    return 0;
  }
  // items taken one at a time as threads come free (items differ in cost: a cold decode item waits on memory),
  // each thread holding the next one it took while it runs the current one, to prefetch it
  std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(threads)
  {
    for (int64_t i = taken.fetch_add(1, std::memory_order_relaxed); i < num_items;) {
      const int64_t next = taken.fetch_add(1, std::memory_order_relaxed);
      run_ahead(i, next);
      i = next;
    }
  }
  return 0;
}

}  // namespace

// members: kFields int64 per member (A table, Bt table, ranks pointers, out, y pointer, y row stride); segments:
// 4 int64 (order, seg_slots, seg_starts pointers, num_segments). Returns 0 on success, 1 (nothing done) when a
// slot's rank exceeds kMaxRank (the caller then takes the torch path). Few arguments: ctypes converts each one on
// every call.
#define PAGED_HF_LORA_ENTRY(NAME, T, F)                                                                          \
  extern "C" int lora_sgmv_##NAME(const int64_t *members, int64_t num_members, const int64_t *segments,         \
                                  const T *x, int64_t x_stride, int64_t in, int num_threads) {                  \
    return apply<T, F>(members, num_members, segments, x, x_stride, in, num_threads);                           \
  }

PAGED_HF_LORA_ENTRY(float32, float, float)
PAGED_HF_LORA_ENTRY(float64, double, double)
PAGED_HF_LORA_ENTRY(bfloat16, uint16_t, float)
