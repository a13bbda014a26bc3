// The AVX-512 paths of quant_gemm.cpp (included there when the build targets AVX512F + AVX512BW): w8a16 and w4a16
// for any number of rows, w8a8 (AVX512-VNNI) from 3 rows; 1-2 rows of w8a8 run quant_gemm.cpp's W8A8FewRows
// (vpdpbusd straight from the weight rows, no panel to lay out).
//
// Why panels: the AVX2 loops take the dot product of one weight row with one activation row along k, so each
// weight is converted once per 4 rows and every output ends in a horizontal sum. Here the weights of 32 output
// channels are transposed once per call (16 x 16 transposes of 32-bit words in registers) into a panel along k,
// and every row of the batch runs against it in register tiles: per k, two panel vectors and one broadcast value
// per row, two multiply-adds per row, no horizontal sums.
//   w8a8: the panel holds int8 weights + 128 as u8, 4 consecutive k per 32-bit lane (vpdpbusd's u8 x s8 layout),
//     the activations stay int8 and are broadcast 4 k at a time, 12 rows x 32 channels per tile. sum (w + 128) q_x
//     = sum w q_x + 128 sum q_x, so each row's sum of q_x (taken while quantizing) times 128 comes off: exact.
//   w8a16, w4a16: see "float32 sums" below.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace avx512 {

constexpr int kVnniTileRows = 12;    // activation rows per w8a8 register tile (24 accumulators of 32)
constexpr int kPanel = 32;            // output channels per panel: two vectors
constexpr int64_t kFloatChunk = 256;  // k per float panel: 32 KiB, kept in L1 while every row passes

// v, kept from being fused with the next operation (see quant_gemm.cpp's rounded())
inline __m512 kept(__m512 v) {
  asm("" : "+v"(v));
  return v;
}

inline __mmask16 lanes(int64_t count) {
  return count >= 16 ? __mmask16(0xffff) : count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1);
}

// each OpenMP thread's own 64-byte aligned scratch (slot: which of its buffers), grown as needed, kept between calls
template <int slot>
void *thread_buffer(size_t bytes) {
  static thread_local std::vector<char> buffer;
  if (buffer.size() < bytes + 64) buffer.resize(bytes + 64);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + (64 - at % 64) % 64;
}

// r[i] lane j <- r[j] lane i, 32-bit lanes
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + c], 128-bit lane L: column 4L + c of rows i..i+3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // gather the four row groups' 128-bit lanes of each column
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
}

// m rows in tiles of at most `most` rows, as even as that allows (16 rows in tiles of 12: 8 + 8, not 12 + 4, whose
// 4-row tile would leave the multiply-add units waiting on their latency)
struct Tiles {
  int64_t m; int most;
  int64_t count() const { return (m + most - 1) / most; }
  int64_t start(int64_t t) const { return t * m / count(); }
  int rows(int64_t t) const { return int(start(t + 1) - start(t)); }
};

// dispatch a run-time row count (1..MR) to the tile's compile-time one
template <template <int> class T, int MR, typename... A>
inline void by_rows(int mr, A &&...args) {
  if constexpr (MR > 0) {
    if (mr == MR) return T<MR>::run(args...);
    by_rows<T, MR - 1>(mr, args...);
  }
}

// --- per-token int8 quantization, 16 lanes (the same arithmetic as quant_gemm.cpp's scalar loop) -------------
// Q: int8_t (the VNNI path) or int16_t (the AVX2 loops); returns the row's sum of q
template <typename Q>
int32_t quantize_row(const float *x, int64_t k, int64_t kp, Q *q, float *scale) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16)
    amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes(k - i), x + i)));
  const float top = _mm512_reduce_max_ps(amax);
  const __m512 inv = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
  const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t i = 0; i < kp; i += 16) {  // kp: a multiple of 16; lanes past k load 0
    // cvtps rounds by MXCSR: to nearest even, as nearbyint and torch.round
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes(k - i), x + i), inv));
    v = _mm512_min_epi32(_mm512_max_epi32(v, low), high);
    sum = _mm512_add_epi32(sum, v);
    if constexpr (sizeof(Q) == 1)
      _mm_storeu_si128(reinterpret_cast<__m128i *>(q + i), _mm512_cvtepi32_epi8(v));
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i *>(q + i), _mm512_cvtepi32_epi16(v));
  }
  *scale = top / 127.0f;
  return _mm512_reduce_add_epi32(sum);
}

#if defined(__AVX512VNNI__)
// --- w8a8 on vpdpbusd --------------------------------------------------------------------------------------
// panel[d * 32 + c]: bytes k = 4d..4d+3 of channel c (c < nr; zeros past it) plus 128, as u8; rows up to kp / 4
// rounded up to 16 are written
inline void pack_vnni_panel(const int8_t *qw, int64_t kp, int nr, uint32_t *panel) {
  const int64_t words = kp / 4;
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int half = 0; half < 2; ++half)
    for (int64_t d0 = 0; d0 < words; d0 += 16) {
      const __mmask16 valid = lanes(words - d0);
      __m512i r[16];
      for (int c = 0; c < 16; ++c) {
        const int ch = half * 16 + c;
        const int8_t *at = qw + ch * kp + 4 * d0;
        r[c] = ch < nr ? _mm512_maskz_loadu_epi32(valid, at) : _mm512_setzero_si512();
        _mm_prefetch(reinterpret_cast<const char *>(at + 256), _MM_HINT_T0);  // 16 rows kilobytes apart: more
      }                                                                      // than the prefetchers follow
      transpose16(r);
      for (int i = 0; i < 16; ++i)  // all 16, past kp too: a constant count keeps r in registers
        _mm512_store_si512(panel + (d0 + i) * kPanel + half * 16, _mm512_xor_si512(r[i], flip));
    }
}

// rows m0..m0+rows-1 of x quantized (as quantize_row) and interleaved for the tile's broadcasts: the 4 bytes
// k = 4d..4d+3 of row i at words[m0 * kp / 4 + d * rows + i]; sums and scales per row
inline void quantize_interleaved(const float *x, int64_t x_stride, int64_t m0, int rows, int64_t k, int64_t kp,
                                 int32_t *words, int32_t *sums, float *scales) {
  auto *q = static_cast<int8_t *>(thread_buffer<3>(kp));
  int32_t *group = words + m0 * kp / 4;
  for (int i = 0; i < rows; ++i) {
    sums[m0 + i] = quantize_row(x + (m0 + i) * x_stride, k, kp, q, scales + m0 + i);
    for (int64_t d = 0; d < kp / 4; ++d) std::memcpy(group + d * rows + i, q + 4 * d, 4);
  }
}

struct VnniArgs {
  const int32_t *qx; const int32_t *qx_sums; const float *sx; int64_t kp;
  const float *sw, *bias; float *out; uint16_t *out_bf16; int64_t out_stride;  // out_bf16 set: out unused
};

// y's lanes rounded to bf16 (to nearest even, NaN kept: paged_hf::float_to_bf16 lane by lane, subnormals too, so
// a row's outputs are the same on every path), the first `live` stored at p
inline void store_bf16(uint16_t *p, __m512 y, int64_t live) {
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i half = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, half), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  _mm512_mask_cvtepi32_storeu_epi16(p, lanes(live), _mm512_mask_mov_epi32(rounded, nan, quiet));
}

template <int MR> struct VnniTile {
  static void run(const VnniArgs &a, const uint32_t *panel, int64_t m0, int64_t n0, int nr) {
    // int32 lanes, not __m512i's int64 ones: with a cast at every vpdpbusd GCC kept __m512i sums in memory
    typedef int32_t I32x16 __attribute__((vector_size(64)));
    I32x16 acc[MR][2];
    for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = I32x16{};
    const int32_t *qx = a.qx + m0 * a.kp / 4;
    for (int64_t d = 0; d < a.kp / 4; ++d) {
      const __m512i w0 = _mm512_load_si512(panel + d * kPanel), w1 = _mm512_load_si512(panel + d * kPanel + 16);
#pragma GCC unroll 12
      for (int i = 0; i < MR; ++i) {
        const __m512i b = _mm512_set1_epi32(qx[d * MR + i]);
        acc[i][0] = I32x16(_mm512_dpbusd_epi32(__m512i(acc[i][0]), w0, b));
        acc[i][1] = I32x16(_mm512_dpbusd_epi32(__m512i(acc[i][1]), w1, b));
      }
    }
    // y = (float(acc) * s_x) * s_w (+ bias), the reference's float32 steps one by one
    for (int i = 0; i < MR; ++i) {
      const __m512i shift = _mm512_set1_epi32(128 * a.qx_sums[m0 + i]);
      const __m512 sx = _mm512_set1_ps(a.sx[m0 + i]);
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v) {
        const __mmask16 mask = lanes(nr - 16 * v);
        const int64_t n = n0 + 16 * v;
        const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(__m512i(acc[i][v]), shift));
        __m512 y = kept(_mm512_mul_ps(kept(_mm512_mul_ps(f, sx)), _mm512_maskz_loadu_ps(mask, a.sw + n)));
        if (a.bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, a.bias + n));
        if (a.out_bf16)
          store_bf16(a.out_bf16 + (m0 + i) * a.out_stride + n, y, nr - 16 * v);
        else
          _mm512_mask_storeu_ps(a.out + (m0 + i) * a.out_stride + n, mask, y);
      }
    }
  }
};

// x [m, k] quantized into words [m * kp / 4] (quantize_interleaved), sums and scales [m]; then out = w8a8(x)
inline void w8a8_panels(const float *x, int64_t x_stride, int64_t k, const VnniArgs &a, int64_t m, const int8_t *qw,
                        int64_t n, int threads) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
#pragma omp parallel num_threads(threads)
  {
  const Tiles tiles{m, kVnniTileRows};
#pragma omp for schedule(static)
  for (int64_t t = 0; t < tiles.count(); ++t)
    quantize_interleaved(x, x_stride, tiles.start(t), tiles.rows(t), k, a.kp, const_cast<int32_t *>(a.qx),
                         const_cast<int32_t *>(a.qx_sums), const_cast<float *>(a.sx));
#pragma omp for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * kPanel;
    const int nr = int(std::min<int64_t>(kPanel, n - n0));
    auto *panel = static_cast<uint32_t *>(thread_buffer<0>((a.kp + 64) * kPanel));
    pack_vnni_panel(qw + n0 * a.kp, a.kp, nr, panel);
    for (int64_t t = 0; t < tiles.count(); ++t)
      by_rows<VnniTile, kVnniTileRows>(tiles.rows(t), a, panel, tiles.start(t), n0, nr);
  }
  }
}
#endif  // __AVX512VNNI__

// --- w8a16 and w4a16: float32 sums in one order for any number of rows ------------------------------------
// A token's outputs must not depend on the batch it came in: the engine's probe compares a model's own forward
// over a prompt with the engine's chunks and decodes (float64 test models: to 1e-6 of the logits). So every
// output is summed the same way for 1 row or 300: k in segments of 32, each summed from 0 by FMA in k order, the
// segments combined in k order (w8a16: added, the channel's scale applied at the end; w4a16: total = seg * s +
// total, s the scale of the segment's group, as the reference scales each group's sum, the zero points' share
// taken off at the end). Short chains also keep the sums as accurate as the AVX2 loops' 8-lane ones.
//   12 rows and more (kPanelRows): the weights of 32 channels as a float panel (per 256 k, in L1), run against
//     every row in tiles of 6 rows x 32 channels (12 totals + 12 segment sums in registers);
//   fewer rows: the same arithmetic straight from the transposed weights, 16 channels at a time and no panel
//     written, up to 4 segments in flight so the sums' latency does not bind a few rows.
// The weights are transposed as 32-bit words of their packed bytes (16 channels x 64 bytes at a time), then each
// word's bytes or nibbles are widened to floats: a quarter of the shuffles that transposing floats would take.
constexpr int kSegment = 32;
constexpr int kFloatRows = 6;
constexpr int kPanelRows = 12;  // measured: fewer rows run faster straight from the transposed weights

// W: the weights of 16 channels in blocks of W::kBlock k, transposed in registers:
//   load(n0, live, k, r): the block at k of channels n0..n0 + live - 1 (zeros past them and past the weights)
//   quad(r, s, q, v): the 16 channels' weights k + 32 s + 4 q + t, t < 4, as floats
// and where W::kScaled (int4; int8 weights have no scale inside the sum) the 16 channels' group scales:
//   scale(n0, live, k): of the group holding k; scales_by_group(n0, live, st): of every group
struct Int8Columns {  // int8 weights [n, kp]; the per-channel scale comes after the sum
  static constexpr int kBlock = 64;
  static constexpr bool kScaled = false;
  const int8_t *q; int64_t kp;
  void load(int64_t n0, int live, int64_t k, __m512i r[16]) const {
    const __mmask16 valid = lanes((kp - k) / 4);
    for (int c = 0; c < 16; ++c) {
      const int8_t *at = q + (n0 + c) * kp + k;
      r[c] = c < live ? _mm512_maskz_loadu_epi32(valid, at) : _mm512_setzero_si512();
      _mm_prefetch(reinterpret_cast<const char *>(at + 256), _MM_HINT_T0);  // 16 rows kilobytes apart: more
    }                                                                      // than the prefetchers follow
    transpose16(r);  // r[d], lane c: the bytes k + 4d .. k + 4d + 3 of channel c
  }
  static void quad(const __m512i r[16], int s, int q, __m512 v[4]) {
    const __m512i word = r[8 * s + q];
    v[0] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(word, 24), 24));
    v[1] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(word, 16), 24));
    v[2] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(word, 8), 24));
    v[3] = _mm512_cvtepi32_ps(_mm512_srai_epi32(word, 24));
  }
};

// int4 weights [n, k / 2]: a 32-k block of 16 bytes holds k = j in byte j's low nibble, k = 16 + j in its high one
struct Int4Columns {
  static constexpr int kBlock = 128;
  static constexpr bool kScaled = true;
  const uint8_t *packed; int64_t k; const float *s; int64_t num_groups, group;
  void load(int64_t n0, int live, int64_t at_k, __m512i r[16]) const {
    const __mmask16 valid = lanes((k - at_k) / 8);
    for (int c = 0; c < 16; ++c) {
      const uint8_t *at = packed + (n0 + c) * (k / 2) + at_k / 2;
      r[c] = c < live ? _mm512_maskz_loadu_epi32(valid, at) : _mm512_setzero_si512();
      // the same bytes of the next 16 channels (8 k bytes on): the block after this one, 16 rows read side by side,
      // which the prefetchers follow poorly (one row's next bytes: 9-11 GB/s of int4 at one row; this: 12)
      _mm_prefetch(reinterpret_cast<const char *>(at + 8 * k), _MM_HINT_T0);
    }
    transpose16(r);  // r[4b + d], lane c: bytes 4d .. 4d + 3 of the 32-k block b of channel c
  }
  // q < 4: low nibbles; else high ones. vpermps reads only an index's low 4 bits: a nibble to its float in one
  // instruction, no mask and no convert
  static void quad(const __m512i r[16], int s, int q, __m512 v[4]) {
    const __m512 floats = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i word = _mm512_srl_epi32(r[4 * s + q % 4], _mm_cvtsi32_si128(4 * (q / 4)));
    v[0] = _mm512_permutexvar_ps(word, floats);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(word, 8), floats);
    v[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(word, 16), floats);
    v[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(word, 24), floats);
  }
  // the scales of channels n0..n0 + 15, group by group: st[g * 16 + c] (zeros past live)
  void scales_by_group(int64_t n0, int live, float *st) const {
    for (int64_t g = 0; g < num_groups; ++g)
      for (int c = 0; c < 16; ++c) st[g * 16 + c] = c < live ? s[(n0 + c) * num_groups + g] : 0.0f;
  }
  __m512 scale(int64_t n0, int live, int64_t at_k) const {
    const int64_t g = std::min(num_groups - 1, at_k / group);  // past k (zero weights): any group
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(int32_t(num_groups)));
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes(live), rows, s + n0 * num_groups + g, 4);
  }
};

// a segment's sum into the total: w8a16 adds it, w4a16 scales it by its group's scale on the way
template <bool kScaled>
inline __m512 combine(__m512 segment, __m512 scale, __m512 total) {
  return kScaled ? _mm512_fmadd_ps(segment, scale, total) : _mm512_add_ps(total, segment);
}

struct FloatArgs {
  const float *x; int64_t x_stride, k;
  float *out; int64_t out_stride;
};

// the outputs of 16 channels from their totals: w8a16 y = total * s_w (+ bias), as the reference
struct W8A16Epilogue {
  const float *sw, *bias;
  __m512 operator()(__m512 total, int64_t, int64_t n, __mmask16 mask) const {
    __m512 y = kept(_mm512_mul_ps(total, _mm512_maskz_loadu_ps(mask, sw + n)));
    return bias ? _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, bias + n)) : y;
  }
};

// w4a16: y = total - zs (+ bias); zs [m, n] with the output's row stride (it may be the output itself)
struct W4A16Epilogue {
  const float *zs, *bias; int64_t stride;
  __m512 operator()(__m512 total, int64_t m, int64_t n, __mmask16 mask) const {
    __m512 y = _mm512_sub_ps(total, _mm512_maskz_loadu_ps(mask, zs + m * stride + n));
    return bias ? _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, bias + n)) : y;
  }
};

// --- fewer rows than kPanelRows: M rows x 16 channels, straight from the transposed weights --------------------
// Segments in flight, C per step: the FMA latency wants 8 chains and more, and each row's segments are chains of
// their own (combined in order after the step), so fewer rows keep more segments going (int8: from 2 blocks).
template <int M> constexpr int kChains = M <= 4 ? 4 : M <= 8 ? 2 : 1;  // measured: 8 for 1-2 rows is no faster

// xpad: the rows, zero padded to whole steps
template <int M> struct FewRows {
  template <typename W, typename E>
  static void run(const FloatArgs &a, const float *xpad, int64_t kpad, const W &w, const E &epilogue, int64_t n0,
                  int live) {
    constexpr int S = W::kBlock / kSegment, C = kChains<M>, B = C > S ? C / S : 1;
    __m512 total[M];
    for (int i = 0; i < M; ++i) total[i] = _mm512_setzero_ps();
    float *scales = nullptr;  // int4: one vector per group in L1 (a gather per segment held up the totals' chain)
    if constexpr (W::kScaled) {
      scales = static_cast<float *>(thread_buffer<6>(w.num_groups * 16 * sizeof(float)));
      w.scales_by_group(n0, live, scales);
    }
    __m512i r[B][16];
    for (int64_t first = 0; first * kSegment < a.k; first += C) {  // segments first .. first + C - 1
      const int64_t k0 = first * kSegment;
      if (k0 % W::kBlock == 0)
        for (int b = 0; b < B && k0 + b * W::kBlock < a.k; ++b) w.load(n0, live, k0 + b * W::kBlock, r[b]);
      const int s0 = int(first % S);  // C < S: where in its block the step starts
      __m512 seg[C][M];
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < M; ++i) seg[c][i] = _mm512_setzero_ps();
      const float *x = xpad + k0;
#pragma GCC unroll 1
      for (int q = 0; q < kSegment / 4; ++q)  // 4 k at a time: GCC schedules a whole unrolled block badly
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {  // the chains side by side
          if (k0 + c * kSegment >= a.k) break;  // the last step's segments past k
          __m512 v[4];
          W::quad(r[(s0 + c) / S], (s0 + c) % S, q, v);
          for (int t = 0; t < 4; ++t)
            for (int i = 0; i < M; ++i)
              seg[c][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * kpad + c * kSegment + 4 * q + t]), v[t], seg[c][i]);
        }
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        if (k0 + c * kSegment < a.k) {
          __m512 scale = _mm512_setzero_ps();
          if constexpr (W::kScaled) scale = _mm512_load_ps(scales + (k0 + c * kSegment) / w.group * 16);
          for (int i = 0; i < M; ++i) total[i] = combine<W::kScaled>(seg[c][i], scale, total[i]);
        }
    }
    const __mmask16 mask = lanes(live);
    for (int i = 0; i < M; ++i)
      _mm512_mask_storeu_ps(a.out + i * a.out_stride + n0, mask, epilogue(total[i], i, n0, mask));
  }
};

template <typename W, typename E>
void few_rows(const FloatArgs &a, int64_t m, const W &w, const E &epilogue, int64_t n, int threads) {
  const int64_t step = std::max<int64_t>(W::kBlock, kChains<1> * kSegment);  // the longest a step reads
  const int64_t kpad = (a.k + step - 1) / step * step;
  auto *xpad = static_cast<float *>(thread_buffer<4>(m * kpad * sizeof(float)));  // the calling thread's
  for (int64_t i = 0; i < m; ++i) {
    std::memcpy(xpad + i * kpad, a.x + i * a.x_stride, a.k * sizeof(float));
    std::fill(xpad + i * kpad + a.k, xpad + (i + 1) * kpad, 0.0f);
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n0 = 0; n0 < n; n0 += 16)
    by_rows<FewRows, kPanelRows - 1>(int(m), a, xpad, kpad, w, epilogue, n0, int(std::min<int64_t>(16, n - n0)));
}

// --- kPanelRows rows and more: panels ------------------------------------------------------------------------
// panel[k * 32 + c] = weight k0 + k of channel n0 + c as a float (k < kc rounded up to W::kBlock); scales[(k / 32)
// * 32 + c]: its segment's scale (int4)
template <typename W>
void pack(const W &w, int64_t n0, int nr, int64_t k0, int64_t kc, float *panel, float *scales) {
  for (int half = 0; half < 2; ++half) {
    const int live = std::max(0, std::min(16, nr - 16 * half));
    for (int64_t kb = 0; kb < kc; kb += W::kBlock) {
      __m512i r[16];
      w.load(n0 + 16 * half, live, k0 + kb, r);
      for (int s = 0; s < W::kBlock / kSegment; ++s)
        for (int q = 0; q < kSegment / 4; ++q) {
          __m512 v[4];
          W::quad(r, s, q, v);
          float *row = panel + (kb + s * kSegment + 4 * q) * kPanel + 16 * half;
          for (int t = 0; t < 4; ++t) _mm512_store_ps(row + t * kPanel, v[t]);
        }
      if constexpr (W::kScaled)
        for (int s = 0; s < W::kBlock / kSegment; ++s)
          _mm512_store_ps(scales + (kb / kSegment + s) * kPanel + 16 * half,
                          w.scale(n0 + 16 * half, live, k0 + kb + s * kSegment));
    }
  }
}

// A block of at most kRowBlock rows of x, interleaved per tile for its broadcasts: the tile of rows
// m0..m0+MR-1 (m0 within the block) keeps x[m0 + i][k] at xp[m0 * k_total + k * MR + i], one stream per tile
// where the rows themselves would be MR streams of 4 bytes each, kilobytes apart.
constexpr int64_t kRowBlock = 256;  // bounds the copy (8 MiB at k = 8192) and each thread's totals

struct RowBlock {
  const float *xp; int64_t first;  // the block's first row of x
};

inline void interleave_rows(const float *x, int64_t x_stride, int64_t k, int64_t m0, int rows, float *xp) {
  float *tile = xp + m0 * k;
  for (int64_t j = 0; j < k; ++j)
    for (int i = 0; i < rows; ++i) tile[j * rows + i] = x[(m0 + i) * x_stride + j];
}

// rows m0..m0+MR-1 of a block against the chunk [k0, k0 + kc) of a panel; the totals of earlier chunks wait in
// `totals` [rows, 32], the last chunk writes the outputs
template <int MR> struct FloatTile {
  template <typename W, typename E>
  static void run(const FloatArgs &a, const RowBlock &b, const W &, const E &epilogue, const float *panel,
                  const float *scales, float *totals, int64_t k0, int64_t kc, int64_t m0, int64_t n0, int nr) {
    __m512 total[MR][2];
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < 2; ++v)
        total[i][v] = k0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(totals + (m0 + i) * kPanel + 16 * v);
    const float *x = b.xp + m0 * a.k + k0 * MR;
    for (int64_t s0 = 0; s0 < kc; s0 += kSegment) {
      __m512 seg[MR][2];
      for (int i = 0; i < MR; ++i) seg[i][0] = seg[i][1] = _mm512_setzero_ps();
      for (int64_t k = s0; k < std::min(kc, s0 + kSegment); ++k) {
        __m512 w0 = _mm512_load_ps(panel + k * kPanel), w1 = _mm512_load_ps(panel + k * kPanel + 16);
        asm("" : "+v"(w0), "+v"(w1));  // in registers: GCC would fold the loads into every FMA, twice the loads
#pragma GCC unroll 6
        for (int i = 0; i < MR; ++i) {
          const __m512 xb = _mm512_set1_ps(x[k * MR + i]);
          seg[i][0] = _mm512_fmadd_ps(xb, w0, seg[i][0]);
          seg[i][1] = _mm512_fmadd_ps(xb, w1, seg[i][1]);
        }
      }
      __m512 scale0 = _mm512_setzero_ps(), scale1 = scale0;
      if constexpr (W::kScaled) {
        scale0 = _mm512_load_ps(scales + s0 / kSegment * kPanel);
        scale1 = _mm512_load_ps(scales + s0 / kSegment * kPanel + 16);
      }
      for (int i = 0; i < MR; ++i) {
        total[i][0] = combine<W::kScaled>(seg[i][0], scale0, total[i][0]);
        total[i][1] = combine<W::kScaled>(seg[i][1], scale1, total[i][1]);
      }
    }
    const bool last = k0 + kc >= a.k;
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v) {
        if (!last) {
          _mm512_store_ps(totals + (m0 + i) * kPanel + 16 * v, total[i][v]);
          continue;
        }
        const __mmask16 mask = lanes(nr - 16 * v);
        const int64_t m = b.first + m0 + i, n = n0 + 16 * v;
        if (mask) _mm512_mask_storeu_ps(a.out + m * a.out_stride + n, mask, epilogue(total[i][v], m, n, mask));
      }
  }
};

template <typename W, typename E>
void panels(const FloatArgs &a, int64_t m_total, const W &w, const E &epilogue, int64_t n, int threads) {
  const int64_t count = (n + kPanel - 1) / kPanel;
  for (int64_t first = 0; first < m_total; first += kRowBlock) {
    const int64_t m = std::min(kRowBlock, m_total - first);
    const Tiles tiles{m, kFloatRows};
    auto *xp = static_cast<float *>(thread_buffer<4>(m * a.k * sizeof(float)));  // the calling thread's
    const RowBlock block{xp, first};
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles.count(); ++t)
      interleave_rows(a.x + first * a.x_stride, a.x_stride, a.k, tiles.start(t), tiles.rows(t), xp);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < count; ++p) {
      const int64_t n0 = p * kPanel;
      const int nr = int(std::min<int64_t>(kPanel, n - n0));
      constexpr int64_t rows = kFloatChunk + 128;
      auto *panel = static_cast<float *>(thread_buffer<1>(rows * kPanel * sizeof(float)));
      auto *scales = static_cast<float *>(thread_buffer<5>(rows / kSegment * kPanel * sizeof(float)));
      auto *totals = static_cast<float *>(thread_buffer<2>(m * kPanel * sizeof(float)));
      for (int64_t k0 = 0; k0 < a.k; k0 += kFloatChunk) {
        const int64_t kc = std::min(kFloatChunk, a.k - k0);
        pack(w, n0, nr, k0, kc, panel, scales);
        for (int64_t t = 0; t < tiles.count(); ++t)
          by_rows<FloatTile, kFloatRows>(tiles.rows(t), a, block, w, epilogue, panel, scales, totals, k0, kc,
                                         tiles.start(t), n0, nr);
      }
    }
    }
  }
}

// out = w8a16 or w4a16 of x [m, k]
template <typename W, typename E>
void float_linear(const FloatArgs &a, int64_t m, const W &w, const E &epilogue, int64_t n, int threads) {
  if (m < kPanelRows) return few_rows(a, m, w, epilogue, n, threads);
  panels(a, m, w, epilogue, n, threads);
}

}  // namespace avx512
