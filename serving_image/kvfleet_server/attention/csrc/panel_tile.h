// The 6 x 16 register-blocked micro-kernel kvfleet's CPU kernels share: rows of x times one panel of
// 16 columns stored [K][16] contiguous — the panel linear's weights (linear_cpu.cpp) and the span
// attention kernel's key and value panels (paged_attention_cpu.cpp). The outer product of BLIS /
// GotoBLAS (Goto & van de Geijn 2008): 12 AVX2 accumulators, per k two loads of the panel, six
// broadcasts of x and twelve FMAs; the portable build runs the same sums in scalar loops.
#pragma once

#include <cstdint>

#include "vec_avx2.h"

namespace kvfleet_panel {

constexpr int64_t kPanel = 16;                   // output columns per panel
constexpr int kRows = 6;                         // rows of x per micro-kernel tile

#ifdef KVFLEET_AVX2
// one row's two accumulators: out[0:ncols] = (a0, a1) (* scale) (+ bias); scale, when given, holds 16
// values (the packed weight's per-column scales, padded to whole panels)
inline void store_row(float* out, __m256 a0, __m256 a1, int ncols, const float* bias, const float* scale) {
  if (scale) {
    a0 = _mm256_mul_ps(a0, _mm256_loadu_ps(scale));
    a1 = _mm256_mul_ps(a1, _mm256_loadu_ps(scale + 8));
  }
  if (ncols == kPanel) {
    if (bias) {
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(bias));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(bias + 8));
    }
    _mm256_storeu_ps(out, a0);
    _mm256_storeu_ps(out + 8, a1);
    return;
  }
  alignas(32) float buf[kPanel];
  _mm256_store_ps(buf, a0);
  _mm256_store_ps(buf + 8, a1);
  for (int j = 0; j < ncols; ++j) out[j] = buf[j] + (bias ? bias[j] : 0.f);
}
#endif

// 16 weights of row k of a panel as two float32 vectors: float32 as stored, int8 widened exactly
#ifdef KVFLEET_AVX2
inline void load_w(const float* w, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(w);
  w1 = _mm256_loadu_ps(w + 8);
}
inline void load_w(const int8_t* w, __m256& w0, __m256& w1) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
  w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
}
#endif

// y[r, 0:ncols] = (x[r, :] . panel) (* scale) (+ bias) for r < MR; W is float (the weight itself) or
// int8 (quantized, `scale` per column); `next` (or null) is prefetched alongside. The accumulators are
// named locals (an array of them is spilled to the stack every k by GCC).
template <int MR, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t K, float* y, int64_t ldy, int ncols,
                 const float* bias, const float* scale, const W* next) {
#ifdef KVFLEET_AVX2
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
         c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define KVFLEET_ROW(r)                                                     \
  if constexpr (MR > r) {                                                  \
    const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);                \
    c##r##0 = kvfleet_vec::fmadd(xb, w0, c##r##0);                         \
    c##r##1 = kvfleet_vec::fmadd(xb, w1, c##r##1);                         \
  }
#define KVFLEET_STEP                                                       \
  __m256 w0, w1;                                                           \
  load_w(w + k * kPanel, w0, w1);                                          \
  KVFLEET_ROW(0) KVFLEET_ROW(1) KVFLEET_ROW(2) KVFLEET_ROW(3) KVFLEET_ROW(4) KVFLEET_ROW(5)
  if (next) {
    for (int64_t k = 0; k < K; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T1);
      KVFLEET_STEP
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      KVFLEET_STEP
    }
  }
#undef KVFLEET_STEP
#undef KVFLEET_ROW
  store_row(y, c00, c01, ncols, bias, scale);
  if constexpr (MR > 1) store_row(y + ldy, c10, c11, ncols, bias, scale);
  if constexpr (MR > 2) store_row(y + 2 * ldy, c20, c21, ncols, bias, scale);
  if constexpr (MR > 3) store_row(y + 3 * ldy, c30, c31, ncols, bias, scale);
  if constexpr (MR > 4) store_row(y + 4 * ldy, c40, c41, ncols, bias, scale);
  if constexpr (MR > 5) store_row(y + 5 * ldy, c50, c51, ncols, bias, scale);
#else
  (void)next;
  for (int r = 0; r < MR; ++r) {
    float acc[kPanel] = {0.f};
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[r * ldx + k];
      for (int j = 0; j < kPanel; ++j) acc[j] += xv * static_cast<float>(w[k * kPanel + j]);
    }
    for (int j = 0; j < ncols; ++j) y[r * ldy + j] = acc[j] * (scale ? scale[j] : 1.f) + (bias ? bias[j] : 0.f);
  }
#endif
}

template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, float*, int64_t, int, const float*, const float*,
                        const W*);
template <typename W>
constexpr TileFn<W> kTiles[kRows + 1] = {nullptr,     tile<1, W>, tile<2, W>, tile<3, W>,
                                         tile<4, W>, tile<5, W>, tile<6, W>};

}  // namespace kvfleet_panel
