// 8-lane float32 helpers for the x86-64-v3 build of kvfleet's CPU kernels (AVX2 + FMA). The portable
// build (x86-64, armv8-a) compiles none of this and takes each kernel's scalar loop.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#define KVFLEET_AVX2 1
#include <immintrin.h>

namespace kvfleet_vec {

inline __m256 fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }

// e^x for 8 lanes: x = n ln2 + r with |r| <= ln2/2, e^r from a degree-7 polynomial (Cephes' expf
// coefficients), times 2^n built in the exponent bits. Relative error ~2e-7 against expf; lanes below
// -87.3 give 0, lanes above 88 saturate at e^88, NaN stays NaN.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3365447505531f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  // NaN as the second operand: min/max return it, so a NaN input comes out NaN
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(lo, x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 split in two for exactness
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = fmadd(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = fmadd(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = fmadd(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = fmadd(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = fmadd(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = fmadd(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// lane j of the result = the sum of a[j]'s 8 lanes
inline __m256 hsum8x8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace kvfleet_vec
#endif
