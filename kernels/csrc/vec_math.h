// Vector math shared by the compiled kernels (paged_decode.cpp, paged_prefill.cpp): GCC vector extensions on
// 16 floats (one AVX-512 register), so the same code serves `__m512` and the decode kernel's own vector type.
#pragma once

#include <cstdint>

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
