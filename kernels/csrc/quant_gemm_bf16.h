// w4a16 on bf16 activations with AVX512-BF16 (included by quant_gemm.cpp when the build targets it): the weights'
// nibbles become bf16 values (integers 0..15 are exact in bf16) by two byte-table lookups, and vdpbf16ps takes
// 32 products a step straight from bf16 x, where the float32 path (quant_gemm_avx512.h) converts every nibble to
// a float with a permute and takes 16 products an FMA: that path is bound by those instructions at one row
// (~17 GB/s of int4 with the weights in cache on Zen 4), this one by the weights' bytes.
//
// One order of the float sums for any number of rows (a token's outputs must not depend on its batch): for output
// (row, channel), per 128 k (a chunk: one 64-byte load of the channel's packed weights), a 16-lane chunk sum from
// zero by four vdpbf16ps in order, then total = chunk * s + total with each lane's group scale (a lane covers 32
// k, one group: groups are multiples of 32), and at the end the 16 lanes of total summed in one fixed order. Only
// the order of the sums differs from the reference; the inputs are the bf16 activations themselves (the products
// are exact in float32). vdpbf16ps flushes denormal inputs and outputs to zero: activations below 1e-38 count 0.
// The zero points' part, sum_g s z (sum of x over group g), is taken off each output in the epilogue (the group
// sums of x in float32, in k order, once per call; the dot over groups 16 at a time, one fixed order), and the
// output is rounded to bf16 there (to nearest even, as torch's cast): no torch op before or after the call.
//
// Layouts: packed as quant_gemm.cpp (32-k blocks of 16 bytes, byte j: k = j low nibble, k = 16 + j high nibble),
// so a chunk's 128-bit lane l is block l, and the lookups give vector q of the chunk k = 32 l + 8 q + 0..7 in lane
// l; x is copied once per call into that order (`chunk_order`), zero padded to whole chunks.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include "vec_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace bf16w4 {

constexpr int64_t kChunk = 128;           // k per chunk: 64 bytes of a channel's packed weights
constexpr int kChannels = 4;              // channels per tile: the conversion of a chunk serves the tile's rows
constexpr int kRows = 4;                  // rows per tile
constexpr int64_t kBlockBytes = 128 << 10;  // the rows' x a row block keeps in L2 while every channel passes
// bytes prefetched ahead in a thread's stream of 1-2 rows (one channel at a time: 1.3x the 4 channels side by side
// at k = 2048 on Zen 4, the same at 8192, paired runs)
constexpr int64_t kFewAhead = 4096;

struct Args {
  const uint16_t *xc; int64_t kc;          // x in chunk order [m, kc], kc = k rounded up to kChunk
  const float *xsums;                      // [m, num_groups]: each row's sum over each group
  const uint8_t *packed; int64_t k;        // [n, k / 2]
  const float *s; int64_t num_groups;      // [n, num_groups]
  const __m512i *lane_groups;              // per chunk: lane j's group minus the chunk's first group
  const int64_t *first_group;              // per chunk
  const float *sz, *bias; uint16_t *out; int64_t out_stride;  // sz [n, num_groups]: s * z
  bool chunk_in_one_group;                 // groups a multiple of kChunk: every lane of a chunk has one scale
  int64_t ahead;                           // bytes prefetched ahead of a channel's chunk
};

// bf16(u) for u = 0..15, its low and its high bytes, as vpshufb tables (the same 16 bytes in each 128-bit lane)
struct Tables {
  __m512i low, high, nibble;
  Tables() {
    alignas(64) uint8_t lo[64], hi[64];
    for (int i = 0; i < 64; ++i) {
      const float value = float(i % 16);
      uint32_t bits;
      std::memcpy(&bits, &value, sizeof(bits));
      lo[i] = uint8_t(bits >> 16), hi[i] = uint8_t(bits >> 24);  // exact: at most 4 significant bits
    }
    low = _mm512_load_si512(lo), high = _mm512_load_si512(hi), nibble = _mm512_set1_epi8(0x0f);
  }
};

inline float bf16_value(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// x rows [m, k] (row stride x_stride) into chunk order: xc[i * kc + c + 32 q + 8 l + j] = x[i][c + 32 l + 8 q + j];
// and each row's group sums, the rows split over the threads (on one: 3-4% slower calls at 64-512 rows, Zen 4)
inline void chunk_order(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, int64_t kc, int64_t group,
                        uint16_t *xc, float *xsums, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (m > 1)
  for (int64_t i = 0; i < m; ++i) {
    const uint16_t *row = x + i * x_stride;
    for (int64_t g = 0; g < k / group; ++g) {
      float sum = 0.0f;
      for (int64_t at = g * group; at < (g + 1) * group; ++at) sum += bf16_value(row[at]);
      xsums[i * (k / group) + g] = sum;
    }
    for (int64_t c = 0; c < kc; c += kChunk)
      for (int q = 0; q < 4; ++q)
        for (int l = 0; l < 4; ++l) {
          const int64_t from = c + 32 * l + 8 * q;
          uint16_t *to = xc + i * kc + c + 32 * q + 8 * l;
          const int64_t live = std::max<int64_t>(0, std::min<int64_t>(8, k - from));
          std::memcpy(to, row + from, live * sizeof(uint16_t));
          std::fill(to + live, to + 8, uint16_t(0));
        }
  }
}

// a channel's chunk at k0 as four bf16 vectors, in x's chunk order
inline void weights(const Args &a, int64_t channel, int64_t k0, const Tables &t, __m512i w[4]) {
  const uint8_t *at = a.packed + channel * (a.k / 2) + k0 / 2;
  // ahead in the thread's stream: a few channels on (1-2 rows), or the same bytes of the channels two tiles on
  // (the channels of a tile are read side by side, which the hardware prefetchers follow poorly)
  _mm_prefetch(reinterpret_cast<const char *>(at + a.ahead), _MM_HINT_T0);
  const int64_t bytes = std::min<int64_t>(64, (a.k - k0) / 2);
  const __m512i packed = bytes == 64 ? _mm512_loadu_si512(at)
                                     : _mm512_maskz_loadu_epi8((__mmask64(1) << bytes) - 1, at);
  const __m512i lo = _mm512_and_si512(packed, t.nibble);
  const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), t.nibble);
  const __m512i lo_low = _mm512_shuffle_epi8(t.low, lo), lo_high = _mm512_shuffle_epi8(t.high, lo);
  const __m512i hi_low = _mm512_shuffle_epi8(t.low, hi), hi_high = _mm512_shuffle_epi8(t.high, hi);
  w[0] = _mm512_unpacklo_epi8(lo_low, lo_high);  // k = 32 l + 0..7: low nibbles of bytes 0..7
  w[1] = _mm512_unpackhi_epi8(lo_low, lo_high);  // 8..15
  w[2] = _mm512_unpacklo_epi8(hi_low, hi_high);  // 16..23: high nibbles of bytes 0..7
  w[3] = _mm512_unpackhi_epi8(hi_low, hi_high);  // 24..31
}

// the group scale of each lane of chunk c of a channel (lanes past the channel's groups: 0); one broadcast where
// the chunk lies in one group (groups of 128 and up: at one row the load and permute cost 2-10%, measured)
inline __m512 chunk_scales(const Args &a, int64_t channel, int64_t c) {
  const int64_t g0 = a.first_group[c];
  if (a.chunk_in_one_group) return _mm512_set1_ps(a.s[channel * a.num_groups + g0]);
  const int64_t count = std::min<int64_t>(4, a.num_groups - g0);
  const __m512 loaded = _mm512_maskz_loadu_ps(__mmask16((1u << count) - 1), a.s + channel * a.num_groups + g0);
  return _mm512_permutexvar_ps(a.lane_groups[c], loaded);
}

// sum_g s z (sum of x over group g) of an output, 16 groups at a time
inline float zero_part(const Args &a, int64_t row, int64_t channel) {
  const float *sz = a.sz + channel * a.num_groups, *sums = a.xsums + row * a.num_groups;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.num_groups; g += 16) {
    const __mmask16 live = a.num_groups - g >= 16 ? __mmask16(0xffff) : __mmask16((1u << (a.num_groups - g)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, sz + g), _mm512_maskz_loadu_ps(live, sums + g), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// outputs of rows m0 .. m0 + MR - 1 x channels n0 .. n0 + NC - 1
template <int MR, int NC>
void tile(const Args &a, const Tables &t, int64_t m0, int64_t n0) {
  __m512 total[MR][NC];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) total[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0, k0 = 0; k0 < a.k; ++c, k0 += kChunk) {
    for (int j = 0; j < NC; ++j) {
      __m512i w[4];
      weights(a, n0 + j, k0, t, w);
      const __m512 scale = chunk_scales(a, n0 + j, c);
      for (int i = 0; i < MR; ++i) {
        const uint16_t *x = a.xc + (m0 + i) * a.kc + k0;
        __m512 chunk = _mm512_setzero_ps();
        for (int q = 0; q < 4; ++q)
          chunk = _mm512_dpbf16_ps(chunk, (__m512bh)w[q], (__m512bh)_mm512_loadu_si512(x + 32 * q));
        total[i][j] = _mm512_fmadd_ps(chunk, scale, total[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) {
      const int64_t row = m0 + i, channel = n0 + j;
      float y = _mm512_reduce_add_ps(total[i][j]) - zero_part(a, row, channel);
      if (a.bias) y += a.bias[channel];
      a.out[row * a.out_stride + channel] = paged_hf::float_to_bf16(y);
    }
}

template <int MR>
inline void row_tile(const Args &a, const Tables &t, int64_t m0, int64_t n0, int nc) {
  switch (nc) {
    case 1: tile<MR, 1>(a, t, m0, n0); break;
    case 2: tile<MR, 2>(a, t, m0, n0); break;
    case 3: tile<MR, 3>(a, t, m0, n0); break;
    default: tile<MR, kChannels>(a, t, m0, n0);
  }
}

inline void any_tile(const Args &a, const Tables &t, int64_t m0, int mr, int64_t n0, int nc) {
  switch (mr) {
    case 1: row_tile<1>(a, t, m0, n0, nc); break;
    case 2: row_tile<2>(a, t, m0, n0, nc); break;
    case 3: row_tile<3>(a, t, m0, n0, nc); break;
    default: row_tile<kRows>(a, t, m0, n0, nc);
  }
}

// out [m, n] bf16 = w4a16 of x [m, k] bf16; sz [n, k / group] = s * z; xc: scratch of m * kc bf16
inline void linear(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint8_t *packed, const float *s,
                   int64_t group, const float *sz, const float *bias, int64_t n, uint16_t *out, int64_t out_stride,
                   uint16_t *xc, int threads) {
  static const Tables tables;
  const int64_t kc = (k + kChunk - 1) / kChunk * kChunk, chunks = kc / kChunk;
  std::vector<float> xsums(m * (k / group));
  chunk_order(x, x_stride, m, k, kc, group, xc, xsums.data(), threads);
  std::vector<__m512i> lane_groups(chunks);
  std::vector<int64_t> first_group(chunks);
  for (int64_t c = 0; c < chunks; ++c) {
    first_group[c] = c * kChunk / group;
    alignas(64) int32_t index[16];
    for (int lane = 0; lane < 16; ++lane)
      index[lane] = int32_t(std::min<int64_t>(3, (c * kChunk + 32 * (lane / 4)) / group - first_group[c]));
    lane_groups[c] = _mm512_load_si512(index);
  }
  const Args a{xc,  kc,   xsums.data(), packed, k, s, k / group, lane_groups.data(), first_group.data(),
               sz,  bias, out,          out_stride, group % kChunk == 0,
               m <= 2 ? kFewAhead : 2 * kChannels * k};
  // 1-2 rows: one channel a tile, so each thread reads one stream straight through its channels (no conversion to
  // share among rows); more rows: kChannels channels side by side, each chunk's x loads serving all of them
  const int64_t channels = m <= 2 ? 1 : kChannels;
  const int64_t block = std::max<int64_t>(kRows, kBlockBytes / (kc * 2) / kRows * kRows);
  const int64_t tiles = (n + channels - 1) / channels;
  for (int64_t b0 = 0; b0 < m; b0 += block) {
    const int64_t rows = std::min(block, m - b0);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t tile_index = 0; tile_index < tiles; ++tile_index) {
      const int64_t n0 = tile_index * channels;
      const int nc = int(std::min<int64_t>(channels, n - n0));
      for (int64_t m0 = b0; m0 < b0 + rows; m0 += kRows)
        any_tile(a, tables, m0, int(std::min<int64_t>(kRows, b0 + rows - m0)), n0, nc);
    }
  }
}

}  // namespace bf16w4
