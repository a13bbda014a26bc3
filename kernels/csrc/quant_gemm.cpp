// Linears on quantized weights, float32 activations in and out (kernels/quant_linear.py holds the torch reference
// of each, which the tests compare these against):
//   w8a8:  int8 weights per output channel, activations quantized per token (dynamic, symmetric):
//          s_x = amax / 127, q_x = round_half_even(x * (127 / amax)) (0 for a zero row); the int32 sum of
//          q_x * q_w, then y = (float(acc) * s_x) * s_w (+ bias). Every step is the reference's own float32
//          operation, and the integer sum is exact: the outputs equal the reference's bit for bit.
//   w8a16: int8 weights per output channel, float activations: y = (sum_k x * float(q_w)) * s_w (+ bias).
//   w4a16: 4-bit weights u in groups along K with a scale s and a zero point z per group (w = (u - z) * s):
//          y = sum_g s[g] * (sum_{k in g} x * u) - zs (+ bias), where zs = sum_g s[g] * z[g] * (sum_{k in g} x) is
//          computed by the caller (one small matmul per call). Only the order of the float sums differs from the
//          reference: each weight is one cvt and one FMA, the scale one FMA per group.
//
// Instruction sets, chosen when the library is built (-march=native, kernels/native.py): AVX2 (+FMA) runs the
// int8 products as int16 pairs (vpmaddwd: exact; vpmaddubsw's u8 x s8 would saturate at 255 * 127 * 2 on full-
// range int8 weights) and the float paths on 8-lane FMAs; without AVX2 the same loops are plain C++. With
// AVX512F + AVX512BW the float paths, and with AVX512-VNNI w8a8 from kVnniFromRows rows, run quant_gemm_avx512.h's
// kernels instead (w8a8 on vpdpbusd: the same exact integers; the float paths: one order of their sums for any
// number of rows, see there); w8a8's 1-2 rows run W8A8FewRows (vpdpbusd on the weight rows as they are).
//
// Layouts (row-major): x [M, K] (row stride x_stride), out [M, N] (row stride out_stride);
//   w8: q_w [N, Kp] int8, Kp = K rounded up to 16 (zero padded), s_w [N];
//   w4: packed [N, K / 2] uint8, in blocks of 32 along K: byte j of a block holds k = j (low nibble) and
//       k = 16 + j (high nibble); s [N, K / group] float32; K a multiple of 32, group a multiple of 32.
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGED_HF_AVX2 1
#endif
#if PAGED_HF_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGED_HF_AVX512 1
#include "quant_gemm_avx512.h"
#if defined(__AVX512VNNI__)
#define PAGED_HF_VNNI 1
#endif
#if defined(__AVX512BF16__)
#define PAGED_HF_BF16 1
#include "quant_gemm_bf16.h"
#endif
#endif

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kMR = 4;                     // activation rows per register tile
constexpr int kNR = 3;                     // weight rows per register tile
constexpr int64_t kSerialWork = 1 << 18;   // multiply-adds below which one thread is faster than two
constexpr int64_t kPanelBytes = 256 << 10; // the activation block a thread keeps in its L2 cache
// rows from which w8a8 on vpdpbusd panels (quant_gemm_avx512.h) beats the AVX2 loops (measured): laying out a
// panel costs about what a few rows' products do, and fewer rows are bound by the weights' bytes anyway
constexpr int64_t kVnniFromRows = 3;

#if PAGED_HF_AVX2
// the sum of v's 8 lanes, in the order both float tiles have always used (halves, then pairs, then the two left)
inline float hsum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quad, _mm_shuffle_ps(quad, quad, 0x55)));
}
#endif

// v, kept from being fused with the next operation (-march=native lets GCC contract a * b + c into an FMA, whose
// single rounding the reference's separate multiply and add do not have)
inline float rounded(float v) {
#if defined(__x86_64__)
  asm("" : "+x"(v));
#else
  volatile float kept = v;
  v = kept;
#endif
  return v;
}

inline int threads_for(int64_t work, int threads) { return work < kSerialWork ? 1 : std::max(threads, 1); }

// --- per-token int8 quantization of the activations ---------------------------------------------------------
void quantize_row(const float *x, int64_t k, int64_t kp, int16_t *q, float *scale) {
#if PAGED_HF_AVX512
  avx512::quantize_row(x, k, kp, q, scale);
  return;
#endif
  float amax = 0.0f;
  for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t i = 0; i < k; ++i) {
    const float r = std::nearbyint(x[i] * inv);  // the default rounding mode: half to even, as torch.round
    q[i] = static_cast<int16_t>(std::min(127.0f, std::max(-127.0f, r)));
  }
  for (int64_t i = k; i < kp; ++i) q[i] = 0;
  *scale = amax / 127.0f;
}

// --- the integer dot products of a register tile: acc[i][j] = sum_k qx[i][k] * qw[j][k] ------------------------
template <int MR, int NR>
void int8_tile(const int16_t *qx, int64_t qx_stride, const int8_t *qw, int64_t kp, int32_t acc[kMR][kNR]) {
#if PAGED_HF_AVX2
  __m256i sums[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i][j] = _mm256_setzero_si256();
  for (int64_t k = 0; k < kp; k += 16) {
    __m256i w[NR];
    for (int j = 0; j < NR; ++j)
      w[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(qw + j * kp + k)));
    for (int i = 0; i < MR; ++i) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qx + i * qx_stride + k));
      for (int j = 0; j < NR; ++j) sums[i][j] = _mm256_add_epi32(sums[i][j], _mm256_madd_epi16(x, w[j]));
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sums[i][j]), _mm256_extracti128_si256(sums[i][j], 1));
      const __m128i quad = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
      acc[i][j] = _mm_cvtsi128_si32(_mm_add_epi32(quad, _mm_shuffle_epi32(quad, 0xb1)));
    }
#else
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      int32_t sum = 0;
      for (int64_t k = 0; k < kp; ++k) sum += int32_t(qx[i * qx_stride + k]) * int32_t(qw[j * kp + k]);
      acc[i][j] = sum;
    }
#endif
}

// --- float dot products of a register tile, the weights dequantized by W::load8 -------------------------------
// W: a view of NR weight rows that yields 8 consecutive dequantized weights of row j at k (k a multiple of 8).
template <int MR, int NR, typename W>
void float_tile(const float *x, int64_t x_stride, const W &w, int64_t k_begin, int64_t k_end, float acc[kMR][kNR]) {
#if PAGED_HF_AVX2
  __m256 sums[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i][j] = _mm256_setzero_ps();
  for (int64_t k = k_begin; k < k_end; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = w.load8(j, k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * x_stride + k);
      for (int j = 0; j < NR; ++j) sums[i][j] = _mm256_fmadd_ps(xv, wv[j], sums[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] += hsum8(sums[i][j]);
#else
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float sum = 0.0f;
      for (int64_t k = k_begin; k < k_end; k += 8) {
        float v[8];
        w.load8(j, k, v);
        for (int l = 0; l < 8; ++l) sum += x[i * x_stride + k + l] * v[l];
      }
      acc[i][j] += sum;
    }
#endif
}

// int8 weights, per-channel scale applied after the sum
struct Int8Rows {
  const int8_t *q;
  int64_t kp;
#if PAGED_HF_AVX2
  __m256 load8(int j, int64_t k) const {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(q + j * kp + k))));
  }
#else
  void load8(int j, int64_t k, float *v) const {
    for (int l = 0; l < 8; ++l) v[l] = float(q[j * kp + k + l]);
  }
#endif
};

// 4-bit weights: the tile's integer values u of 32 consecutive k (one packed block of 16 bytes), as floats
struct Int4Block {
#if PAGED_HF_AVX2
  __m256 v[4];  // k 0-7, 8-15, 16-23, 24-31
  explicit Int4Block(const uint8_t *bytes) {
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(bytes)));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(bytes + 8)));
    const __m256i mask = _mm256_set1_epi32(15);
    v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo, mask));
    v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask));
    v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4));
    v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4));
  }
#else
  float v[32];
  explicit Int4Block(const uint8_t *bytes) {
    for (int l = 0; l < 16; ++l) v[l] = float(bytes[l] & 15), v[16 + l] = float(bytes[l] >> 4);
  }
#endif
};

// y[i][j] += sum_g s[j][g] * (sum_{k in g} x[i][k] * u[j][k]) over the tile's rows; the zero points' part,
// sum_g s z sum_{k in g} x, is the caller's (it needs each group's sum of x once per row, not per weight row)
template <int MR, int NR>
void int4_tile(const float *x, int64_t x_stride, const uint8_t *packed, int64_t row_bytes, const float *s,
               int64_t num_groups, int64_t group, float acc[kMR][kNR]) {
#if PAGED_HF_AVX2
  __m256 total[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) total[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    __m256 part[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) part[i][j] = _mm256_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
      for (int j = 0; j < NR; ++j) {
        const Int4Block u(packed + j * row_bytes + k / 2);
        for (int i = 0; i < MR; ++i)
          for (int q = 0; q < 4; ++q)
            part[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * x_stride + k + 8 * q), u.v[q], part[i][j]);
      }
    }
    for (int j = 0; j < NR; ++j) {
      const __m256 scale = _mm256_set1_ps(s[j * num_groups + g]);
      for (int i = 0; i < MR; ++i) total[i][j] = _mm256_fmadd_ps(part[i][j], scale, total[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] += hsum8(total[i][j]);
#else
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float total = 0.0f;
      for (int64_t g = 0; g < num_groups; ++g) {
        float part = 0.0f;
        for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
          const Int4Block u(packed + j * row_bytes + k / 2);
          for (int l = 0; l < 32; ++l) part += x[i * x_stride + k + l] * u.v[l];
        }
        total += part * s[j * num_groups + g];
      }
      acc[i][j] += total;
    }
#endif
}

// --- the loops around the tiles ------------------------------------------------------------------------------
// Rows of x in blocks that stay in cache; each thread takes a contiguous range of weight rows (N) and runs
// every activation row of the block against it, kMR x kNR outputs at a time.
template <typename Tile>
void for_tiles(int64_t m, int64_t n, int64_t row_bytes, int threads, Tile tile) {
  const int64_t block = std::max<int64_t>(kMR, (kPanelBytes / std::max<int64_t>(row_bytes, 1)) / kMR * kMR);
  const int64_t n_tiles = (n + kNR - 1) / kNR;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < n_tiles; ++t) {
    const int64_t n0 = t * kNR, nr = std::min<int64_t>(kNR, n - n0);
    for (int64_t m_block = 0; m_block < m; m_block += block)
      for (int64_t m0 = m_block; m0 < std::min(m, m_block + block); m0 += kMR)
        tile(m0, int(std::min<int64_t>(kMR, m - m0)), n0, int(nr));
  }
}

// dispatch a run-time (mr, nr) to the compile-time tile sizes
template <template <int, int> class F, typename... A>
void by_size(int mr, int nr, A &&...args) {
#define PAGED_HF_CASE(MR)                                   \
  if (mr == MR) {                                           \
    if (nr == 3) return F<MR, 3>::run(args...);             \
    if (nr == 2) return F<MR, 2>::run(args...);             \
    return F<MR, 1>::run(args...);                          \
  }
  PAGED_HF_CASE(4) PAGED_HF_CASE(3) PAGED_HF_CASE(2) PAGED_HF_CASE(1)
#undef PAGED_HF_CASE
}

struct W8A8Args {
  const int16_t *qx; int64_t kp; const float *sx;
  const int8_t *qw; const float *sw; const float *bias;
  float *out; int64_t out_stride;
  const uint8_t *xu8 = nullptr;  // 1-2 rows on VNNI (W8A8FewRows): q_x + 128 as u8, [m, kp]
  uint16_t *out_bf16 = nullptr;  // set: the outputs rounded to bf16 there instead (out unused)

  // output (i, j) from its exact integer sum: the one epilogue of every w8a8 path
  void store(int32_t acc, int64_t i, int64_t j) const {
    float y = rounded(rounded(float(acc) * sx[i]) * sw[j]);
    if (bias) y += bias[j];
    if (out_bf16)
      out_bf16[i * out_stride + j] = paged_hf::float_to_bf16(y);
    else
      out[i * out_stride + j] = y;
  }
};

template <int MR, int NR> struct W8A8Tile {
  static void run(const W8A8Args &a, int64_t m0, int64_t n0) {
    int32_t acc[kMR][kNR];
    int8_tile<MR, NR>(a.qx + m0 * a.kp, a.kp, a.qw + n0 * a.kp, a.kp, acc);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) a.store(acc[i][j], m0 + i, n0 + j);
  }
};

#if PAGED_HF_VNNI
// w8a8's 1-2 rows on vpdpbusd: the activations + 128 as u8 (xu8 [m, kp]), the weights as they are (s8), so
// sum (q_x + 128) w = sum q_x w + 128 sum w, and each weight row's sum (vpdpbusd against ones) times 128 comes off:
// the same exact integers as every other path, the same epilogue as W8A8Tile. One weight row at a time, 128 bytes
// a step into two sets of sums: each thread reads one stream straight through its channels (on Zen 4, 1.4-2.3x
// the former 3 rows side by side with 64-byte steps), left to the hardware prefetchers (a software prefetch 4 KiB
// ahead cost 10-17% of a 1B model's batch-1 decode on Zen 4 where the host read fast, paired runs).

template <int MR> struct W8A8FewRows {
  static void run(const W8A8Args &a, int64_t j) {
    const __m512i ones = _mm512_set1_epi8(1), zero = _mm512_setzero_si512();
    __m512i sums[MR][2], wsums[2] = {zero, zero};
    for (int i = 0; i < MR; ++i) sums[i][0] = sums[i][1] = zero;
    const int8_t *row = a.qw + j * a.kp;
    int64_t k = 0;
    for (; k + 128 <= a.kp; k += 128) {
      for (int h = 0; h < 2; ++h) {
        const __m512i w = _mm512_loadu_si512(row + k + 64 * h);
        wsums[h] = _mm512_dpbusd_epi32(wsums[h], ones, w);
        for (int i = 0; i < MR; ++i)
          sums[i][h] = _mm512_dpbusd_epi32(sums[i][h], _mm512_loadu_si512(a.xu8 + i * a.kp + k + 64 * h), w);
      }
    }
    for (; k < a.kp; k += 64) {  // the last 16..112 bytes (kp is a multiple of 16)
      const __mmask64 live = a.kp - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (a.kp - k)) - 1;
      const __m512i w = _mm512_maskz_loadu_epi8(live, row + k);
      wsums[0] = _mm512_dpbusd_epi32(wsums[0], ones, w);
      for (int i = 0; i < MR; ++i)
        sums[i][0] = _mm512_dpbusd_epi32(sums[i][0], _mm512_maskz_loadu_epi8(live, a.xu8 + i * a.kp + k), w);
    }
    const int32_t shift = 128 * _mm512_reduce_add_epi32(_mm512_add_epi32(wsums[0], wsums[1]));
    for (int i = 0; i < MR; ++i)
      a.store(_mm512_reduce_add_epi32(_mm512_add_epi32(sums[i][0], sums[i][1])) - shift, i, j);
  }
};
#endif

struct FloatArgs {
  const float *x; int64_t x_stride, k;
  const float *bias; float *out; int64_t out_stride;
};

template <typename W> struct WeightRows;  // how a tile views NR weight rows starting at n0

template <> struct WeightRows<Int8Rows> {
  const int8_t *q; int64_t kp; const float *s;
  Int8Rows at(int64_t n0) const { return Int8Rows{q + n0 * kp, kp}; }
};

template <int MR, int NR> struct W8A16Tile {
  static void run(const FloatArgs &a, const WeightRows<Int8Rows> &w, int64_t m0, int64_t n0) {
    float acc[kMR][kNR] = {};
    float_tile<MR, NR>(a.x + m0 * a.x_stride, a.x_stride, w.at(n0), 0, a.k, acc);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) {
        float y = rounded(acc[i][j] * w.s[n0 + j]);
        if (a.bias) y += a.bias[n0 + j];
        a.out[(m0 + i) * a.out_stride + n0 + j] = y;
      }
  }
};

struct W4A16Args {
  const float *x; int64_t x_stride, k;
  const uint8_t *packed; const float *s; const float *zs;  // zs [m, n]: the zero points' part of each output
  int64_t num_groups, group;
  const float *bias; float *out; int64_t out_stride;
};

template <int MR, int NR> struct W4A16Tile {
  static void run(const W4A16Args &a, int64_t m0, int64_t n0) {
    float acc[kMR][kNR] = {};
    int4_tile<MR, NR>(a.x + m0 * a.x_stride, a.x_stride, a.packed + n0 * (a.k / 2), a.k / 2, a.s + n0 * a.num_groups,
                      a.num_groups, a.group, acc);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) {
        float y = acc[i][j] - a.zs[(m0 + i) * a.out_stride + n0 + j];
        if (a.bias) y += a.bias[n0 + j];
        a.out[(m0 + i) * a.out_stride + n0 + j] = y;
      }
  }
};

// bf16 rows x [m, k] as float32 rows [m, k]; times input_scale [k] where given, the product rounded to bf16 as
// the reference's `(x.float() * s).to(bfloat16)` rounds it (a SmoothQuant linear's input)
void widen_rows(const uint16_t *x, int64_t x_stride, const float *input_scale, int64_t m, int64_t k, float *out,
                int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (m > 1)
  for (int64_t i = 0; i < m; ++i) {
    const uint16_t *row = x + i * x_stride;
    float *to = out + i * k;
    if (!input_scale) {
      for (int64_t j = 0; j < k; ++j) to[j] = paged_hf::bf16_to_float(row[j]);
      continue;
    }
    for (int64_t j = 0; j < k; ++j)
      to[j] = paged_hf::bf16_to_float(paged_hf::float_to_bf16(paged_hf::bf16_to_float(row[j]) * input_scale[j]));
  }
}

// the w8a8 linear of float32 x into float32 out, or rounded to bf16 into out_bf16 where that is set
int w8a8(const float *x, int64_t x_stride, int64_t m, int64_t k, const int8_t *qw, const float *sw, const float *bias,
         int64_t n, int64_t kp, float *out, uint16_t *out_bf16, int64_t out_stride, int16_t *qx_scratch,
         float *sx_scratch, int threads) {
  if (kp % 16 || kp < k) return 1;
  const int used = threads_for(m * n * kp, threads);
#if PAGED_HF_VNNI
  if (m >= kVnniFromRows) {  // q_x (int8, m * kp bytes) in the scratch, each row's sum of q_x after it
    auto *words = reinterpret_cast<int32_t *>(qx_scratch);
    avx512::w8a8_panels(x, x_stride, k,
                        {words, words + m * kp / 4, sx_scratch, kp, sw, bias, out, out_bf16, out_stride}, m, qw, n,
                        used);
    return 0;
  }
#endif
#pragma omp parallel for num_threads(used) schedule(static) if (m > 1)
  for (int64_t i = 0; i < m; ++i) quantize_row(x + i * x_stride, k, kp, qx_scratch + i * kp, sx_scratch + i);
  W8A8Args args{qx_scratch, kp, sx_scratch, qw, sw, bias, out, out_stride};
  args.out_bf16 = out_bf16;
#if PAGED_HF_VNNI
  {  // 1-2 rows: q_x + 128 as u8, then vpdpbusd tiles
    std::vector<uint8_t> xu8(m * kp);
    for (int64_t i = 0; i < m * kp; ++i) xu8[i] = static_cast<uint8_t>(qx_scratch[i] + 128);
    args.xu8 = xu8.data();
#pragma omp parallel for num_threads(used) schedule(static)
    for (int64_t j = 0; j < n; ++j) m == 1 ? W8A8FewRows<1>::run(args, j) : W8A8FewRows<2>::run(args, j);
    return 0;
  }
#endif
  for_tiles(m, n, kp * 2, used, [&](int64_t m0, int mr, int64_t n0, int nr) {
    by_size<W8A8Tile>(mr, nr, args, m0, n0);
  });
  return 0;
}

}  // namespace

extern "C" {

// out [m, n] = the w8a8 linear of x [m, k]; qx_scratch [m, kp] int16 and sx_scratch [m] float: caller's memory
int w8a8_linear(const float *x, int64_t x_stride, int64_t m, int64_t k, const int8_t *qw, const float *sw,
                const float *bias, int64_t n, int64_t kp, float *out, int64_t out_stride, int16_t *qx_scratch,
                float *sx_scratch, int threads) {
  return w8a8(x, x_stride, m, k, qw, sw, bias, n, kp, out, nullptr, out_stride, qx_scratch, sx_scratch, threads);
}

// the same on bf16 x, times input_scale [k] first where given (nullptr: none), out [m, n] bf16: one call where a
// bf16 model's linear took three passes (the smoothing, the widening, the output's rounding); x32_scratch [m, k]
int w8a8_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const float *input_scale,
                     const int8_t *qw, const float *sw, const float *bias, int64_t n, int64_t kp, uint16_t *out,
                     int64_t out_stride, float *x32_scratch, int16_t *qx_scratch, float *sx_scratch, int threads) {
  widen_rows(x, x_stride, input_scale, m, k, x32_scratch, threads_for(m * k * 64, threads));
  return w8a8(x32_scratch, k, m, k, qw, sw, bias, n, kp, nullptr, out, out_stride, qx_scratch, sx_scratch, threads);
}

// A W8A8 linear of a bf16 model as the compiled decode layer calls it (csrc/lean_layer.cpp, the few-row loops'
// signature: weights[0] is a W8A8Linear, count 1): w8a8_linear_bf16 with the calling thread's scratch.
struct W8A8Linear {
  const int8_t *qw;
  const float *sw, *bias, *input_scale;  // bias float32 or null; input_scale [k] or null
  int64_t k, kp, n;
};

int w8a8_gemm_bf16(const void *x, int64_t x_stride, int64_t m, int64_t k, const void *const *weights,
                   const int64_t *, const void *const *, int64_t count, void *out, int64_t out_stride, int threads) {
  const W8A8Linear *l = static_cast<const W8A8Linear *>(weights[0]);
  if (count != 1 || k != l->k) return 1;
  thread_local std::vector<float> widened, sx;
  thread_local std::vector<int16_t> qx;
  widened.resize(m * k), qx.resize(m * l->kp), sx.resize(m);
  return w8a8_linear_bf16(static_cast<const uint16_t *>(x), x_stride, m, k, l->input_scale, l->qw, l->sw, l->bias,
                          l->n, l->kp, static_cast<uint16_t *>(out), out_stride, widened.data(), qx.data(), sx.data(),
                          threads);
}

// the per-token quantization alone (tests: its q and scales against the reference)
int quantize_rows(const float *x, int64_t x_stride, int64_t m, int64_t k, int64_t kp, int16_t *q, float *scales) {
  for (int64_t i = 0; i < m; ++i) quantize_row(x + i * x_stride, k, kp, q + i * kp, scales + i);
  return 0;
}

int w8a16_linear(const float *x, int64_t x_stride, int64_t m, int64_t k, const int8_t *qw, const float *sw,
                 const float *bias, int64_t n, int64_t kp, float *out, int64_t out_stride, int threads) {
  if (k % 8 || kp < k) return 1;
#if PAGED_HF_AVX512
  avx512::float_linear({x, x_stride, k, out, out_stride}, m, avx512::Int8Columns{qw, kp},
                       avx512::W8A16Epilogue{sw, bias}, n, threads_for(m * n * k, threads));
  return 0;
#endif
  const FloatArgs args{x, x_stride, k, bias, out, out_stride};
  const WeightRows<Int8Rows> rows{qw, kp, sw};
  for_tiles(m, n, k * 4, threads_for(m * n * k, threads), [&](int64_t m0, int mr, int64_t n0, int nr) {
    by_size<W8A16Tile>(mr, nr, args, rows, m0, n0);
  });
  return 0;
}

// zs [m, n]: sum_g s[n][g] * z[n][g] * (sum of x[m] over group g), the caller's (a small matmul); out may be zs
int w4a16_linear(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint8_t *packed, const float *s,
                 const float *zs, int64_t group, const float *bias, int64_t n, float *out, int64_t out_stride,
                 int threads) {
  if (k % 32 || group % 32 || k % group) return 1;
#if PAGED_HF_AVX512
  avx512::float_linear({x, x_stride, k, out, out_stride}, m, avx512::Int4Columns{packed, k, s, k / group, group},
                       avx512::W4A16Epilogue{zs, bias, out_stride}, n, threads_for(m * n * k, threads));
  return 0;
#endif
  const W4A16Args args{x, x_stride, k, packed, s, zs, k / group, group, bias, out, out_stride};
  for_tiles(m, n, k * 4, threads_for(m * n * k, threads), [&](int64_t m0, int mr, int64_t n0, int nr) {
    by_size<W4A16Tile>(std::min(mr, 2), nr, args, m0, n0);
    if (mr > 2) by_size<W4A16Tile>(mr - 2, nr, args, m0 + 2, n0);
  });
  return 0;
}

// w4a16 of bf16 x into bf16 out (their bits) with AVX512-BF16 (quant_gemm_bf16.h): the zero points' part from sz
// [n, k / group] = s * z, in the call; xc_scratch: m * (k rounded up to 128) bf16.
// 2: this build has no AVX512-BF16 (the caller runs w4a16_linear on x in float32)
int w4a16_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint8_t *packed,
                      const float *s, const float *sz, int64_t group, const float *bias, int64_t n, uint16_t *out,
                      int64_t out_stride, uint16_t *xc_scratch, int threads) {
#if PAGED_HF_BF16
  if (k % 32 || group % 32 || k % group) return 1;
  bf16w4::linear(x, x_stride, m, k, packed, s, group, sz, bias, n, out, out_stride, xc_scratch,
                 threads_for(m * n * k, threads));
  return 0;
#else
  (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)s, (void)sz, (void)group, (void)bias, (void)n;
  (void)out, (void)out_stride, (void)xc_scratch, (void)threads;
  return 2;
#endif
}

// A W4A16 linear of a bf16 model as the compiled decode layer calls it (csrc/lean_layer.cpp, the few-row loops'
// signature: weights[0] is a W4A16Linear, count 1): w4a16_linear_bf16 with the calling thread's scratch.
struct W4A16Linear {
  const uint8_t *packed;
  const float *s, *sz, *bias;  // scales and s * z [n, k / group]; bias float32 or null
  int64_t k, group, n;
};

int w4a16_gemm_bf16(const void *x, int64_t x_stride, int64_t m, int64_t k, const void *const *weights,
                    const int64_t *, const void *const *, int64_t count, void *out, int64_t out_stride, int threads) {
  const W4A16Linear *l = static_cast<const W4A16Linear *>(weights[0]);
  if (count != 1 || k != l->k) return 1;
  thread_local std::vector<uint16_t> chunked;  // x in the kernel's order: k rounded up to 128 per row
  chunked.resize(m * ((k + 127) / 128 * 128));
  return w4a16_linear_bf16(static_cast<const uint16_t *>(x), x_stride, m, k, l->packed, l->s, l->sz, l->group,
                           l->bias, l->n, static_cast<uint16_t *>(out), out_stride, chunked.data(), threads);
}

// 1 where w4a16_linear_bf16 runs (the build targets AVX512-BF16)
int quant_gemm_bf16(void) {
#if PAGED_HF_BF16
  return 1;
#else
  return 0;
#endif
}

// which instructions this build computes with (kernels/quant_gemm.py reports it)
const char *quant_gemm_isa() {
#if PAGED_HF_VNNI
  return "avx512_vnni";
#elif PAGED_HF_AVX512
  return "avx512";
#elif PAGED_HF_AVX2
  return "avx2";
#else
  return "generic";
#endif
}

}  // extern "C"
