// Vector math shared by the compiled kernels (paged_decode.cpp, paged_prefill.cpp): GCC vector extensions on
// 16 floats (one AVX-512 register), so the same code serves `__m512` and the decode kernel's own vector type.
#pragma once

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace paged_hf {

// exp(x) for x <= 0 (scores minus their max), 16 lanes at once: Cephes' expf polynomial on the remainder of
// x / ln 2, times 2^n built in the exponent bits. About 1 ulp; libm's expf is scalar and was ~40% of the work.
template <typename V> inline V exp_nonpositive(V x) {
  typedef int32_t I __attribute__((vector_size(64)));
  x = x < -87.0f ? V{} - 87.0f : x;  // exp(-87) ~ 1.6e-38: still a normal float, and nothing a softmax sees
  const V n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23 trick)
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;                 // x - n ln 2, in two parts
  V y = 1.9875691500e-4f * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const I two_to_n = (__builtin_convertvector(n, I) + 127) << 23;
  return y * reinterpret_cast<const V &>(two_to_n);
}

// cap * tanh(x / cap) (Gemma 2's soft-capping), 16 lanes: tanh|y| = (1 - e) / (1 + e) with e = exp(-2|y|).
template <typename V> inline V soft_cap(V x, float cap) {
  const V y = x / cap;
  const V magnitude = y < 0 ? -y : y;
  const V e = exp_nonpositive(-2.0f * magnitude);
  const V t = (1.0f - e) / (1.0f + e);
  return cap * (y < 0 ? -t : t);
}

}  // namespace paged_hf

namespace paged_hf {

// bfloat16 <-> float, 16 lanes at once and one at a time; rounding to nearest even as torch does (NaN stays NaN)
typedef float F16x __attribute__((vector_size(64)));

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float value;
  __builtin_memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  __builtin_memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

#if defined(__AVX512F__)
// one widening load and a shift (the generic code below compiles to four instructions and two lane moves)
inline F16x load_bf16x16(const uint16_t *p) {
  const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))), 16);
  return reinterpret_cast<const F16x &>(u);
}
#else
inline F16x load_bf16x16(const uint16_t *p) {
  typedef uint16_t H __attribute__((vector_size(32)));
  typedef uint32_t U __attribute__((vector_size(64)));
  H h;
  __builtin_memcpy(&h, p, sizeof(h));
  const U u = __builtin_convertvector(h, U) << 16;
  F16x v;
  __builtin_memcpy(&v, &u, sizeof(v));
  return v;
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// vcvtneps2bf16: round to nearest even and NaN made quiet, as below, in one instruction (subnormal floats, which
// no activation holds, go to zero)
inline void store_bf16x16(uint16_t *p, F16x v) {
  const __m256bh h = _mm512_cvtneps_pbh(reinterpret_cast<const __m512 &>(v));
  __builtin_memcpy(p, &h, sizeof(h));
}
#else
inline void store_bf16x16(uint16_t *p, F16x v) {
  typedef uint32_t U __attribute__((vector_size(64)));
  typedef uint16_t H __attribute__((vector_size(32)));
  U bits;
  __builtin_memcpy(&bits, &v, sizeof(bits));
  const U rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const U nan = (bits & 0x7fffffffu) > 0x7f800000u;  // all ones where v is NaN
  const H h = __builtin_convertvector((rounded & ~nan) | (((bits >> 16) | 0x40u) & nan), H);
  __builtin_memcpy(p, &h, sizeof(h));
}
#endif

// v rounded to bf16 and back to float (what torch's `.to(bfloat16)` between two float ops does)
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
inline F16x round_bf16(F16x v) {  // in registers: the rounding, a widening and a shift
  const __m256bh h = _mm512_cvtneps_pbh(reinterpret_cast<const __m512 &>(v));
  const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i &>(h)), 16);
  return reinterpret_cast<const F16x &>(u);
}
#else
inline F16x round_bf16(F16x v) {
  uint16_t h[16];
  store_bf16x16(h, v);
  return load_bf16x16(h);
}
#endif

}  // namespace paged_hf
