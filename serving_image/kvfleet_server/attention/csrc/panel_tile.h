// The register-blocked micro-kernel kvfleet's CPU kernels share: rows of x times one panel of 16 columns
// stored [K][16] contiguous — the panel linear's weights (linear_cpu.cpp) and the span attention
// kernel's key and value panels (paged_span_attention_cpu.cpp). The outer product of BLIS / GotoBLAS
// (Goto & van de Geijn 2008), in one of three builds chosen by the compiler's target (cpu_ext.py builds
// the one the CPU reports):
//   - AVX-512 (x86-64-v4): 14 rows x 16 columns, one zmm accumulator per row (14 of the 32 registers);
//     per k one load of the panel's row (one 64-byte line) and fourteen broadcast FMAs — the load and
//     FMA ports both near their peak, where the AVX2 tile is held to 6 rows by its 16 registers;
//   - AVX2 + FMA (x86-64-v3): 6 rows x 16 columns, 12 ymm accumulators, per k two loads of the panel,
//     six broadcasts of x and twelve FMAs;
//   - portable: the same sums in scalar loops.
// Both vector builds accumulate each output in float32 in k order with one FMA per term, so the AVX-512
// and AVX2 tiles give the same bits (the portable build's scalar loops multiply and add separately).
#pragma once

#include <cstdint>

#include "vec_avx2.h"

#if defined(__AVX512F__) && defined(KVFLEET_AVX2)
#define KVFLEET_AVX512 1
#endif

namespace kvfleet_panel {

constexpr int64_t kPanel = 16;                   // output columns per panel
#ifdef KVFLEET_AVX512
constexpr int kRows = 14;                        // rows of x per micro-kernel tile
#else
constexpr int kRows = 6;
#endif

#ifdef KVFLEET_AVX512
// one row's accumulator: out[0:ncols] = a (* scale) (+ bias), the same operations in the same order as
// the AVX2 build's store_row; scale, when given, holds 16 values (padded to whole panels), bias ncols
inline void store_row16(float* out, __m512 a, int ncols, const float* bias, const float* scale) {
  if (scale) a = _mm512_mul_ps(a, _mm512_loadu_ps(scale));
  const __mmask16 m = static_cast<__mmask16>(ncols >= kPanel ? 0xFFFFu : (1u << ncols) - 1u);
  if (bias) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(m, bias));
  _mm512_mask_storeu_ps(out, m, a);
}

// 16 weights of row k of a panel as one float32 vector: float32 as stored, int8 widened exactly
inline __m512 load_w16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load_w16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
#endif

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

// a row's first ncols values into two accumulators (zero past ncols)
inline void load_row(const float* in, __m256& a0, __m256& a1, int ncols) {
  if (ncols == kPanel) {
    a0 = _mm256_loadu_ps(in);
    a1 = _mm256_loadu_ps(in + 8);
    return;
  }
  alignas(32) float buf[kPanel] = {0.f};
  for (int j = 0; j < ncols; ++j) buf[j] = in[j];
  a0 = _mm256_load_ps(buf);
  a1 = _mm256_load_ps(buf + 8);
}

// 16 weights of row k of a panel as two float32 vectors: float32 as stored, int8 widened exactly
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
// int8 (quantized, `scale` per column); `next` (or null) is prefetched alongside. x is either rows ldx
// apart (XS 0) or packed k-major, x(r, k) at x[k * XS + r] (`pack_rows`): one stream of contiguous
// broadcasts instead of MR strided ones. With acc_in the sums start from y's values (the
// partial sums of the k before, stored by a call with null bias and scale: float32 stored and reloaded
// exactly, so splitting K gives the same bits). The accumulators are named locals (an array of them is
// spilled to the stack every k by GCC).
// the k loop of tile's vector builds around KVFLEET_STEP, with `next`'s line k prefetched when given
#define KVFLEET_K_LOOP                                                              \
  if (next) {                                                                       \
    for (int64_t k = 0; k < K; ++k) {                                               \
      _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T1); \
      KVFLEET_STEP                                                                  \
    }                                                                               \
  } else {                                                                          \
    for (int64_t k = 0; k < K; ++k) {                                               \
      KVFLEET_STEP                                                                  \
    }                                                                               \
  }

template <int MR, typename W, int XS = 0>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t K, float* y, int64_t ldy, int ncols,
                 const float* bias, const float* scale, const W* next, bool acc_in = false) {
#define KVFLEET_XAT(r) (XS ? x + k * XS + (r) : x + (r) * ldx + k)
#if defined(KVFLEET_AVX512)
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0,
         c9 = c0, c10 = c0, c11 = c0, c12 = c0, c13 = c0;
  if (acc_in) {
    const __mmask16 m = static_cast<__mmask16>(ncols >= kPanel ? 0xFFFFu : (1u << ncols) - 1u);
#define KVFLEET_LOAD(r) \
  if constexpr (MR > r) c##r = _mm512_maskz_loadu_ps(m, y + r * ldy);
    KVFLEET_LOAD(0) KVFLEET_LOAD(1) KVFLEET_LOAD(2) KVFLEET_LOAD(3) KVFLEET_LOAD(4) KVFLEET_LOAD(5) KVFLEET_LOAD(6)
    KVFLEET_LOAD(7) KVFLEET_LOAD(8) KVFLEET_LOAD(9) KVFLEET_LOAD(10) KVFLEET_LOAD(11) KVFLEET_LOAD(12)
    KVFLEET_LOAD(13)
#undef KVFLEET_LOAD
  }
#define KVFLEET_ROW(r) \
  if constexpr (MR > r) c##r = _mm512_fmadd_ps(_mm512_set1_ps(*KVFLEET_XAT(r)), w0, c##r);
#define KVFLEET_STEP                                                                                   \
  const __m512 w0 = load_w16(w + k * kPanel);                                                          \
  KVFLEET_ROW(0) KVFLEET_ROW(1) KVFLEET_ROW(2) KVFLEET_ROW(3) KVFLEET_ROW(4) KVFLEET_ROW(5) KVFLEET_ROW(6) \
  KVFLEET_ROW(7) KVFLEET_ROW(8) KVFLEET_ROW(9) KVFLEET_ROW(10) KVFLEET_ROW(11) KVFLEET_ROW(12) KVFLEET_ROW(13)
  KVFLEET_K_LOOP
#undef KVFLEET_STEP
#undef KVFLEET_ROW
#define KVFLEET_STORE(r) \
  if constexpr (MR > r) store_row16(y + r * ldy, c##r, ncols, bias, scale);
  KVFLEET_STORE(0) KVFLEET_STORE(1) KVFLEET_STORE(2) KVFLEET_STORE(3) KVFLEET_STORE(4) KVFLEET_STORE(5)
  KVFLEET_STORE(6) KVFLEET_STORE(7) KVFLEET_STORE(8) KVFLEET_STORE(9) KVFLEET_STORE(10) KVFLEET_STORE(11)
  KVFLEET_STORE(12) KVFLEET_STORE(13)
#undef KVFLEET_STORE
#elif defined(KVFLEET_AVX2)
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
         c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  if (acc_in) {
    load_row(y, c00, c01, ncols);
    if constexpr (MR > 1) load_row(y + ldy, c10, c11, ncols);
    if constexpr (MR > 2) load_row(y + 2 * ldy, c20, c21, ncols);
    if constexpr (MR > 3) load_row(y + 3 * ldy, c30, c31, ncols);
    if constexpr (MR > 4) load_row(y + 4 * ldy, c40, c41, ncols);
    if constexpr (MR > 5) load_row(y + 5 * ldy, c50, c51, ncols);
  }
#define KVFLEET_ROW(r)                                                     \
  if constexpr (MR > r) {                                                  \
    const __m256 xb = _mm256_broadcast_ss(KVFLEET_XAT(r));                 \
    c##r##0 = kvfleet_vec::fmadd(xb, w0, c##r##0);                         \
    c##r##1 = kvfleet_vec::fmadd(xb, w1, c##r##1);                         \
  }
#define KVFLEET_STEP                                                       \
  __m256 w0, w1;                                                           \
  load_w(w + k * kPanel, w0, w1);                                          \
  KVFLEET_ROW(0) KVFLEET_ROW(1) KVFLEET_ROW(2) KVFLEET_ROW(3) KVFLEET_ROW(4) KVFLEET_ROW(5)
  KVFLEET_K_LOOP
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
    if (acc_in) for (int j = 0; j < ncols; ++j) acc[j] = y[r * ldy + j];
    for (int64_t k = 0; k < K; ++k) {
      const float xv = XS ? x[k * XS + r] : x[r * ldx + k];
      for (int j = 0; j < kPanel; ++j) acc[j] += xv * static_cast<float>(w[k * kPanel + j]);
    }
    for (int j = 0; j < ncols; ++j) y[r * ldy + j] = acc[j] * (scale ? scale[j] : 1.f) + (bias ? bias[j] : 0.f);
  }
#endif
#undef KVFLEET_XAT
}
#undef KVFLEET_K_LOOP

// rows x[0:mr, 0:K] (ldx apart) → dst[k * xs + r]: the k-major layout of tile<MR, W, xs> and tile2
inline void pack_rows(const float* x, int64_t ldx, int mr, int64_t K, float* dst, int xs) {
  for (int r = 0; r < mr; ++r) {
    const float* src = x + r * ldx;
    for (int64_t k = 0; k < K; ++k) dst[k * xs + r] = src[k];
  }
}

#ifdef KVFLEET_AVX512
constexpr int kRows2 = 12;  // rows of x per tile2

// tile over two adjacent panels (32 columns; the second's first ncols1 written), the AVX-512 build's
// linear micro-kernel: 24 accumulators, per k two loads of the panels and twelve broadcasts for
// twenty-four FMAs — the FMA ports, not the loads, set the pace (tile's one panel needs 15 loads for
// 14 FMAs). x packed k-major with stride kRows2; acc_in, bias and scale as tile's (bias and scale
// cover both panels: 32 values); `next` (or null) is the first of the next two panels, prefetched.
template <int MR, typename W>
inline void tile2(const float* x, const W* wa, const W* wb, int64_t K, float* y, int64_t ldy, int ncols1,
                  const float* bias, const float* scale, const W* next, bool acc_in) {
  __m512 a0 = _mm512_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0, a4 = a0,
         b4 = a0, a5 = a0, b5 = a0, a6 = a0, b6 = a0, a7 = a0, b7 = a0, a8 = a0, b8 = a0, a9 = a0, b9 = a0,
         a10 = a0, b10 = a0, a11 = a0, b11 = a0;
  const __mmask16 m1 = static_cast<__mmask16>(ncols1 >= kPanel ? 0xFFFFu : (1u << ncols1) - 1u);
#define KVFLEET_ALL(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)
  if (acc_in) {
#define KVFLEET_LOAD(r)                                          \
  if constexpr (MR > r) {                                        \
    a##r = _mm512_loadu_ps(y + r * ldy);                         \
    b##r = _mm512_maskz_loadu_ps(m1, y + r * ldy + kPanel);      \
  }
    KVFLEET_ALL(KVFLEET_LOAD)
#undef KVFLEET_LOAD
  }
#define KVFLEET_ROW(r)                                           \
  if constexpr (MR > r) {                                        \
    const __m512 xb = _mm512_set1_ps(x[k * kRows2 + r]);         \
    a##r = _mm512_fmadd_ps(xb, wa0, a##r);                       \
    b##r = _mm512_fmadd_ps(xb, wb0, b##r);                       \
  }
  if (next) {  // the next two panels, one line each per k (decode: the weight stream is the bottleneck)
    const W* next1 = next + (wb - wa);
    for (int64_t k = 0; k < K; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next1 + k * kPanel), _MM_HINT_T1);
      const __m512 wa0 = load_w16(wa + k * kPanel), wb0 = load_w16(wb + k * kPanel);
      KVFLEET_ALL(KVFLEET_ROW)
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      const __m512 wa0 = load_w16(wa + k * kPanel), wb0 = load_w16(wb + k * kPanel);
      KVFLEET_ALL(KVFLEET_ROW)
    }
  }
#undef KVFLEET_ROW
#define KVFLEET_STORE(r)                                                                              \
  if constexpr (MR > r) {                                                                             \
    store_row16(y + r * ldy, a##r, kPanel, bias, scale);                                              \
    store_row16(y + r * ldy + kPanel, b##r, ncols1, bias ? bias + kPanel : nullptr, scale ? scale + kPanel : nullptr); \
  }
  KVFLEET_ALL(KVFLEET_STORE)
#undef KVFLEET_STORE
#undef KVFLEET_ALL
}

template <typename W>
using Tile2Fn = void (*)(const float*, const W*, const W*, int64_t, float*, int64_t, int, const float*, const float*,
                         const W*, bool);
template <typename W>
constexpr Tile2Fn<W> kTiles2[kRows2 + 1] = {nullptr,       tile2<1, W>,  tile2<2, W>, tile2<3, W>, tile2<4, W>,
                                            tile2<5, W>,   tile2<6, W>,  tile2<7, W>, tile2<8, W>, tile2<9, W>,
                                            tile2<10, W>, tile2<11, W>, tile2<12, W>};
#endif

template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, float*, int64_t, int, const float*, const float*,
                        const W*, bool);
// kTiles<W, XS>[mr]: the tile of mr rows, 1 <= mr <= min(kRows, XS or kRows)
template <typename W, int XS = 0>
constexpr TileFn<W> kTiles[kRows + 1] = {nullptr, tile<1, W, XS>, tile<2, W, XS>, tile<3, W, XS>, tile<4, W, XS>,
                                         tile<5, W, XS>, tile<6, W, XS>
#ifdef KVFLEET_AVX512
                                         , tile<7, W, XS>, tile<8, W, XS>, tile<9, W, XS>, tile<10, W, XS>,
                                         tile<11, W, XS>, tile<12, W, XS>, tile<13, W, XS>, tile<14, W, XS>
#endif
};

}  // namespace kvfleet_panel
