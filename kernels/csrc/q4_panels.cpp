// W4A8 on 4-bit weights repacked into panels of 16 output channels (kernels/quant_linear.py: `repack_int4`,
// `Int4Linear(act_quant=True)`), as llama.cpp's Q4_0 x Q8_0 on its AVX-512 repacked Q4_0: every weight byte is read
// once, in the order it lies in memory, and one 512-bit load feeds 16 channels.
//
// Arithmetic (the torch reference is quant_linear.Int4Linear.reference with act_quant): each row of x is quantized
// per block of 32 k to int8, symmetric: a = max |x| over the block, q = round_half_even(x * (127 / a)) (0 where
// a = 0), s_x = a / 127. For output channel c and block b (in weight group g, groups are multiples of 32):
// d = sum q * u (exact int32), e = sum q (exact), t = float(d) - z[c][g] * float(e), and y = sum over b in k order of
// (s_x[b] * s[c][g]) * t (+ bias). The kernel's FMA rounds the last step once where the reference rounds twice:
// results equal up to that.
//
// Layout of a panel p (channels 16 p .. 16 p + 15) of a [n, k] weight: per block b, 256 bytes: for t = 0..3, 64
// bytes = for channel r = 0..15, 4 bytes: byte i holds u[k = 32 b + 8 t + i] in its low nibble and
// u[k = 32 b + 8 t + 4 + i] in its high nibble. So a 64-byte load masked to low nibbles is the 16 channels x 4 k of
// vpdpbusd's u8 operand, and the activations' 4 int8 of those k are broadcast to every channel. Scales and zeros
// (float16, as Q4_0's scales: float32 made them a fifth of the bytes read) per panel: [groups][16].
//
// Instruction sets, chosen at build (-march=native; the tests build the AVX2 loops with -mno-avx512f and the
// portable ones with -mno-avx2): AVX512-VNNI's vpdpbusd; AVX2 (with F16C) with vpmaddubsw + vpmaddwd (u <= 15 and
// |q| <= 127: a pair's sum stays far from int16's saturation) on the two halves of a panel; else plain loops.
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define Q4P_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q4P_VNNI 1
#endif
#endif

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kPanel = 16;      // channels per panel
constexpr int64_t kBlock = 32;  // k per activation block
constexpr int kMaxRows = 8;     // rows of x per pass over the weights

struct Weights {
  const uint8_t *panels;   // [n / 16, k / 32 * 256]
  const uint16_t *s, *z;   // [n / 16, groups * 16] float16 bits
  int64_t k, group;
};

struct Acts {               // x quantized: [m, k] int8, per block s_x and float(sum q)
  const int8_t *q;
  const float *sx, *sq;     // [m, k / 32]
  int64_t blocks;
};

float bf16_to_float(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// one row's blocks: q, s_x and float(sum q)
void quantize_row(const float *x, int64_t k, int8_t *q, float *sx, float *sq) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float *at = x + b * kBlock;
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(at[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const float r = std::nearbyint(at[i] * inv);  // the default rounding: half to even, as torch.round
      const int v = int(std::min(127.0f, std::max(-127.0f, r)));
      q[b * kBlock + i] = int8_t(v);
      sum += v;
    }
    sx[b] = amax / 127.0f;
    sq[b] = float(sum);
  }
}

#if Q4P_VNNI
// 16 float16 widened
__m512 halves16(const uint16_t *at) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(at)));
}

// outputs of MR rows x the 16 channels of panel p, as float32 [MR][16] in `y`
template <int MR>
void panel(const Weights &w, const Acts &a, int64_t p, float y[kMaxRows][kPanel]) {
  const int64_t groups = w.k / w.group, per_group = w.group / kBlock;
  const uint8_t *at = w.panels + p * (w.k / kBlock) * 256;
  const uint16_t *s = w.s + p * groups * kPanel, *z = w.z + p * groups * kPanel;
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __m512 total[MR];
  for (int i = 0; i < MR; ++i) total[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b, at += 256) {
    _mm_prefetch(reinterpret_cast<const char *>(at + 2048), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char *>(at + 2048 + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char *>(at + 2048 + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char *>(at + 2048 + 192), _MM_HINT_T0);
    __m512i acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      const __m512i packed = _mm512_loadu_si512(at + 64 * t);
      const __m512i lo = _mm512_and_si512(packed, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      for (int i = 0; i < MR; ++i) {
        const int32_t *xq = reinterpret_cast<const int32_t *>(a.q + i * a.blocks * kBlock + b * kBlock + 8 * t);
        acc[i] = _mm512_dpbusd_epi32(acc[i], lo, _mm512_set1_epi32(xq[0]));
        acc[i] = _mm512_dpbusd_epi32(acc[i], hi, _mm512_set1_epi32(xq[1]));
      }
    }
    const int64_t g = b / per_group;
    const __m512 scale = halves16(s + g * kPanel), zero = halves16(z + g * kPanel);
    for (int i = 0; i < MR; ++i) {
      const __m512 t = _mm512_fnmadd_ps(zero, _mm512_set1_ps(a.sq[i * a.blocks + b]), _mm512_cvtepi32_ps(acc[i]));
      total[i] = _mm512_fmadd_ps(t, _mm512_mul_ps(_mm512_set1_ps(a.sx[i * a.blocks + b]), scale), total[i]);
    }
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(y[i], total[i]);
}
#elif Q4P_AVX2
// 8 float16 widened (F16C)
__m256 halves8(const uint16_t *at) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(at))); }

// the AVX2 loops: the panel's two halves of 8 channels, vpmaddubsw + vpmaddwd for vpdpbusd
template <int MR>
void panel(const Weights &w, const Acts &a, int64_t p, float y[kMaxRows][kPanel]) {
  const int64_t groups = w.k / w.group, per_group = w.group / kBlock;
  const uint16_t *s = w.s + p * groups * kPanel, *z = w.z + p * groups * kPanel;
  const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; ++half) {
    const uint8_t *at = w.panels + p * (w.k / kBlock) * 256 + 32 * half;
    __m256 total[MR];
    for (int i = 0; i < MR; ++i) total[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.blocks; ++b, at += 256) {
      __m256i acc[MR];
      for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(at + 64 * t));
        const __m256i lo = _mm256_and_si256(packed, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
        for (int i = 0; i < MR; ++i) {
          const int32_t *xq = reinterpret_cast<const int32_t *>(a.q + i * a.blocks * kBlock + b * kBlock + 8 * t);
          const __m256i plo = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[0]));
          const __m256i phi = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[1]));
          acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_add_epi16(plo, phi), ones));
        }
      }
      const int64_t g = b / per_group;
      const __m256 scale = halves8(s + g * kPanel + 8 * half), zero = halves8(z + g * kPanel + 8 * half);
      for (int i = 0; i < MR; ++i) {
        const __m256 t = _mm256_fnmadd_ps(zero, _mm256_set1_ps(a.sq[i * a.blocks + b]), _mm256_cvtepi32_ps(acc[i]));
        total[i] = _mm256_fmadd_ps(t, _mm256_mul_ps(_mm256_set1_ps(a.sx[i * a.blocks + b]), scale), total[i]);
      }
    }
    for (int i = 0; i < MR; ++i) _mm256_storeu_ps(y[i] + 8 * half, total[i]);
  }
}
#else
float half_to_float(uint16_t bits) {
  _Float16 value;
  std::memcpy(&value, &bits, sizeof(value));
  return float(value);
}

// the portable loops, the same sums in the same order
template <int MR>
void panel(const Weights &w, const Acts &a, int64_t p, float y[kMaxRows][kPanel]) {
  const int64_t groups = w.k / w.group, per_group = w.group / kBlock;
  const uint16_t *s = w.s + p * groups * kPanel, *z = w.z + p * groups * kPanel;
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < kPanel; ++r) y[i][r] = 0.0f;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t *at = w.panels + (p * (w.k / kBlock) + b) * 256;
    const int64_t g = b / per_group;
    for (int i = 0; i < MR; ++i) {
      const int8_t *xq = a.q + i * a.blocks * kBlock + b * kBlock;
      for (int r = 0; r < kPanel; ++r) {
        int32_t d = 0;
        for (int t = 0; t < 4; ++t)
          for (int j = 0; j < 4; ++j) {
            const uint8_t byte = at[64 * t + 4 * r + j];
            d += int32_t(byte & 15) * xq[8 * t + j] + int32_t(byte >> 4) * xq[8 * t + 4 + j];
          }
        const float t = std::fma(-half_to_float(z[g * kPanel + r]), a.sq[i * a.blocks + b], float(d));
        y[i][r] = std::fma(t, a.sx[i * a.blocks + b] * half_to_float(s[g * kPanel + r]), y[i][r]);
      }
    }
  }
}
#endif

void any_panel(int mr, const Weights &w, const Acts &a, int64_t p, float y[kMaxRows][kPanel]) {
  switch (mr) {
    case 1: panel<1>(w, a, p, y); break;
    case 2: panel<2>(w, a, p, y); break;
    case 3: panel<3>(w, a, p, y); break;
    case 4: panel<4>(w, a, p, y); break;
    case 5: panel<5>(w, a, p, y); break;
    case 6: panel<6>(w, a, p, y); break;
    case 7: panel<7>(w, a, p, y); break;
    default: panel<kMaxRows>(w, a, p, y);
  }
}

// x [m, k] (bf16 bits where `bf16`, else float32; row stride x_stride) -> out [m, n] of the same dtype; scratch:
// q [m, k] int8, sx and sq [m, k / 32] float32
int linear(const void *x, int64_t x_stride, int bf16, int64_t m, const Weights &w, const void *bias, int64_t n,
           void *out, int64_t out_stride, int8_t *q, float *sx, float *sq, int threads) {
  if (w.k % kBlock || w.group % kBlock || w.k % w.group || n % kPanel) return 1;
  const int64_t blocks = w.k / kBlock;
  std::vector<float> widened(bf16 ? w.k : 0);
  for (int64_t i = 0; i < m; ++i) {
    const float *row = static_cast<const float *>(x) + i * x_stride;
    if (bf16) {
      const uint16_t *bits = static_cast<const uint16_t *>(x) + i * x_stride;
      for (int64_t j = 0; j < w.k; ++j) widened[j] = bf16_to_float(bits[j]);
      row = widened.data();
    }
    quantize_row(row, w.k, q + i * w.k, sx + i * blocks, sq + i * blocks);
  }
  const int64_t panels = n / kPanel;
  const int use = int(std::max<int64_t>(1, std::min<int64_t>(threads, panels / 4)));
#pragma omp parallel for num_threads(use) schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t m0 = 0; m0 < m; m0 += kMaxRows) {
      const int mr = int(std::min<int64_t>(kMaxRows, m - m0));
      const Acts a{q + m0 * w.k, sx + m0 * blocks, sq + m0 * blocks, blocks};
      float y[kMaxRows][kPanel];
      any_panel(mr, w, a, p, y);
      for (int i = 0; i < mr; ++i)
        for (int r = 0; r < kPanel; ++r) {
          const int64_t c = p * kPanel + r;
          float v = y[i][r];
          if (bf16) {
            if (bias) v += bf16_to_float(static_cast<const uint16_t *>(bias)[c]);
            static_cast<uint16_t *>(out)[(m0 + i) * out_stride + c] = paged_hf::float_to_bf16(v);
          } else {
            if (bias) v += static_cast<const float *>(bias)[c];
            static_cast<float *>(out)[(m0 + i) * out_stride + c] = v;
          }
        }
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// What a compiled caller hands over for one repacked linear (worker/fast_paths/native_layer.py).
struct Q4PanelLinear {
  const uint8_t *panels;
  const uint16_t *s, *z;  // float16 bits
  const void *bias;
  int64_t k, group, n;
};

int q4_panels_linear(const void *x, int64_t x_stride, int bf16, int64_t m, int64_t k, const uint8_t *panels,
                     const uint16_t *s, const uint16_t *z, int64_t group, const void *bias, int64_t n, void *out,
                     int64_t out_stride, int8_t *q, float *sx, float *sq, int threads) {
  return linear(x, x_stride, bf16, m, Weights{panels, s, z, k, group}, bias, n, out, out_stride, q, sx, sq, threads);
}

// The few-row linears' signature (kernels/small_gemm.py, called by csrc/lean_layer.cpp): weights[0] is a
// Q4PanelLinear (count 1, its bias its own); the scratch is the calling thread's.
int q4_panels_gemm(const void *x, int64_t x_stride, int bf16, int64_t m, int64_t k, const void *const *weights,
                   int64_t count, void *out, int64_t out_stride, int threads) {
  const Q4PanelLinear *l = static_cast<const Q4PanelLinear *>(weights[0]);
  if (count != 1 || k != l->k) return 1;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> sx, sq;
  q.resize(m * k), sx.resize(m * k / kBlock), sq.resize(m * k / kBlock);
  return linear(x, x_stride, bf16, m, Weights{l->panels, l->s, l->z, k, l->group}, l->bias, l->n, out, out_stride,
                q.data(), sx.data(), sq.data(), threads);
}

int q4_panels_gemm_bf16(const void *x, int64_t x_stride, int64_t m, int64_t k, const void *const *weights,
                        const int64_t *, const void *const *, int64_t count, void *out, int64_t out_stride,
                        int threads) {
  return q4_panels_gemm(x, x_stride, 1, m, k, weights, count, out, out_stride, threads);
}

int q4_panels_gemm_f32(const void *x, int64_t x_stride, int64_t m, int64_t k, const void *const *weights,
                       const int64_t *, const void *const *, int64_t count, void *out, int64_t out_stride,
                       int threads) {
  return q4_panels_gemm(x, x_stride, 0, m, k, weights, count, out, out_stride, threads);
}

const char *q4_panels_isa() {
#if Q4P_VNNI
  return "avx512_vnni";
#elif Q4P_AVX2
  return "avx2";
#else
  return "generic";
#endif
}

}  // extern "C"
