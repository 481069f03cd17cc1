// Helpers shared by the CPU kernels: the portable paths' vectors and bf16 widening (every level; gemm.cpp and
// prefill_attention.cpp), and the AVX-512 ones of the attention kernels (decode_attention.cpp,
// prefill_attention.cpp).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace tandem_simd {

// The portable paths' vectors (GCC vector extensions): the widest registers the build has, 8 floats in a ymm
// register where it has AVX (x86-64-v3: a * b + c contracts to one FMA), else SSE2's 4 in an xmm one.
#if defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));

// A value as fp32; exact for bf16, whose bits are the top half of its fp32.
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace tandem_simd

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

namespace tandem_simd {

// The first min(n, 16) lanes: the mask of a row's (possibly short) tail.
inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// VDPBF16PS on rows interleaved 16 bits at a time (unpacklo/hi_epi16, within each 128-bit lane) leaves a
// 32-element chunk's sums in unpack order: `lo` holds elements 0-3, 8-11, 16-19, 24-27, `hi` the other quads.
// These move a chunk, x0 = elements 0-15 and x1 = 16-31, between that order and the natural one.
inline void to_unpack_order(__m512 x0, __m512 x1, __m512& lo, __m512& hi) {
  lo = _mm512_permutex2var_ps(x0, _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27), x1);
  hi = _mm512_permutex2var_ps(x0, _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31), x1);
}
inline void from_unpack_order(__m512 lo, __m512 hi, __m512& x0, __m512& x1) {
  x0 = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), hi);
  x1 = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), hi);
}

// exp(x) for the softmax's x = score - max <= 0: Cody-Waite reduction by ln 2 and Cephes' degree-6 expf
// polynomial (about 1 ulp, like glibc's vector expf it replaces), 2^n applied by VSCALEFPS. Inputs below -100
// are clamped there (e^-100 is nothing next to the max's 1).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace tandem_simd
#endif
