// The soft-max numerator both CPU attention kernels use (paged_attention_cpu.cpp, paged_span_attention_cpu.cpp).
#pragma once

#include "vec_avx2.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace kvfleet_attn {

// s[0:L] <- exp(s - max(s)); returns sum(exp(s - max))
inline float softmax_numerator(float* s, int64_t L) {
  float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
  int64_t t = 0;
#ifdef KVFLEET_AVX2
  if (L >= 8) {
    __m256 mv = _mm256_set1_ps(m);
    for (; t + 8 <= L; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    m = kvfleet_vec::hmax(mv);
  }
  for (; t < L; ++t) m = std::max(m, s[t]);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (t = 0; t + 8 <= L; t += 8) {
    const __m256 e = kvfleet_vec::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, e);
    sv = _mm256_add_ps(sv, e);
  }
  sum = kvfleet_vec::hsum(sv);
#else
  for (; t < L; ++t) m = std::max(m, s[t]);
  t = 0;
#endif
  for (; t < L; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return sum;
}

}  // namespace kvfleet_attn
