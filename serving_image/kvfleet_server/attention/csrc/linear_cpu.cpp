// Float32 y = x Wᵀ + b on the CPU over a weight packed once into column panels: W [N, K] is stored as
// Wp [P, K, 16], P = ceil(N / 16), panel p holding output columns 16p .. 16p + 15 (zero rows past N), so
// one panel streams from memory as a single contiguous run of K x 64 bytes.
//
// The micro-kernel is the register-blocked outer product of BLIS / GotoBLAS (Goto & van de Geijn 2008,
// "Anatomy of high-performance matrix multiplication"): 6 rows of x times one 16-column panel, 12 AVX2
// accumulators, per k two loads of W, six broadcasts of x and twelve FMAs. While the first 6-row tile
// of a panel runs, the next panel is prefetched into L2 one 64-byte line per k, so the weight stream —
// what decode is bound by: every step reads every weight — runs at the memory's rate rather than
// stalling on each panel's first lines (oneDNN's and MKL's GEMMs reach about 9 of this machine's 23 GB/s
// at decode's 1-8 rows). Rows of x are taken in blocks that fit L2 (kMaxXBlockBytes), and panels are
// spread over torch's OpenMP pool (at::parallel_for: each thread streams one contiguous range).
//
// Accumulation is float32 in k order, one sum per output: the result agrees with F.linear to float32
// rounding (tests/server/test_cpu_linear.py checks it against float64). The portable build (no AVX2)
// runs the same loops in scalar code.
//
// Registered as torch.ops.kvfleet.linear_packed_cpu(x, wp, n, bias) -> Tensor; the packing is
// model/layers/cpu_prepack.py's pack_panels. The same loops serve int8 weights (--quantization int8 on
// the CPU): torch.ops.kvfleet.linear_packed_int8_cpu(x, wp int8 [P, K, 16], scales [P * 16], n, bias), each
// row of 16 weights widened to float32 in registers (a quarter of float32's bytes streamed).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "vec_avx2.h"

namespace {

constexpr int64_t kPanel = 16;                   // output columns per panel
constexpr int kRows = 6;                         // rows of x per micro-kernel tile
constexpr int64_t kMaxXBlockBytes = 192 * 1024;  // rows of x held in L2 while every panel passes

// y[r, 0:ncols] (+)= x[r, :] . panel for r < MR; `next` (or null) is prefetched alongside.
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

// y [M, n] = x [M, K] . Wp (* scales) (+ bias) over P panels of K x 16 weights of type W.
template <typename W>
void run_panels(const float* xp, int64_t M, int64_t K, const W* wptr, int64_t P, int64_t n, const float* sp,
                const float* bp, float* yp) {
  const int64_t block =
      std::max<int64_t>(kRows, (kMaxXBlockBytes / (K * static_cast<int64_t>(sizeof(float)))) / kRows * kRows);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const W* w = wptr + p * K * kPanel;
        const W* next = p + 1 < p1 ? w + K * kPanel : nullptr;
        const int ncols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
        const float* b = bp ? bp + p * kPanel : nullptr;
        const float* s = sp ? sp + p * kPanel : nullptr;
        // the block's rows in ceil(rows / 6) tiles of near-equal size (32 rows: 6 6 5 5 5 5, not
        // 6 6 6 6 6 2: a thin last tile re-reads the panel for little work)
        const int64_t tiles = (m1 - m0 + kRows - 1) / kRows, base = (m1 - m0) / tiles, extra = (m1 - m0) % tiles;
        for (int64_t t = 0, r = m0; t < tiles; ++t) {
          const int mr = static_cast<int>(base + (t < extra));
          kTiles<W>[mr](xp + r * K, K, w, K, yp + r * n + p * kPanel, n, ncols, b, s, t == 0 ? next : nullptr);
          r += mr;
        }
      }
    });
  }
}

// shared checks and set-up of both ops; returns y [M, n] (filled when M, n or K is 0)
at::Tensor prepare(const char* op, const at::Tensor& x, const at::Tensor& wp, at::ScalarType wtype, int64_t n,
                   const at::Tensor& bias, bool& done) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op, ": x must be [M, K] float32");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == kPanel && wp.scalar_type() == wtype && wp.is_contiguous(), op,
              ": wp must be contiguous [P, K, 16] ", c10::toString(wtype));
  const int64_t M = x.size(0), K = x.size(1), P = wp.size(0);
  TORCH_CHECK(wp.size(1) == K, op, ": x has K = ", K, ", the packed weight ", wp.size(1));
  TORCH_CHECK(n >= 0 && (n + kPanel - 1) / kPanel == P, op, ": n = ", n, " does not match ", P, " panels");
  if (bias.defined()) {
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.dim() == 1 && bias.numel() == n, op,
                ": bias must be [n] float32");
  }
  at::Tensor y = at::empty({M, n}, x.options());
  done = M == 0 || n == 0 || K == 0;
  if (M > 0 && n > 0 && K == 0) {
    if (bias.defined()) y.copy_(bias.expand({M, n})); else y.zero_();
  }
  return y;
}

at::Tensor optional_bias(const c10::optional<at::Tensor>& b) {
  return b.has_value() && b->defined() ? b->contiguous() : at::Tensor();
}

at::Tensor linear_packed_cpu(const at::Tensor& x_in, const at::Tensor& wp, int64_t n,
                             const c10::optional<at::Tensor>& bias_in) {
  const at::Tensor x = x_in.contiguous(), bias = optional_bias(bias_in);
  bool done;
  at::Tensor y = prepare("linear_packed_cpu", x, wp, at::kFloat, n, bias, done);
  if (!done) {
    run_panels<float>(x.data_ptr<float>(), x.size(0), x.size(1), wp.data_ptr<float>(), wp.size(0), n, nullptr,
                      bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>());
  }
  return y;
}

// int8 weights (W8A16/W8A32, one scale per output column): y = (x . q) * scales (+ bias), q widened to
// float32 exactly, accumulated by float32 FMAs in k order, scaled once per output
at::Tensor linear_packed_int8_cpu(const at::Tensor& x_in, const at::Tensor& wp, const at::Tensor& scales_in,
                                  int64_t n, const c10::optional<at::Tensor>& bias_in) {
  const at::Tensor x = x_in.contiguous(), bias = optional_bias(bias_in), scales = scales_in.contiguous();
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.numel() == wp.size(0) * kPanel,
              "linear_packed_int8_cpu: scales must be [P * 16] float32 (padded to whole panels)");
  bool done;
  at::Tensor y = prepare("linear_packed_int8_cpu", x, wp, at::kChar, n, bias, done);
  if (!done) {
    run_panels<int8_t>(x.data_ptr<float>(), x.size(0), x.size(1), wp.data_ptr<int8_t>(), wp.size(0), n,
                       scales.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr,
                       y.data_ptr<float>());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet, m) {
  m.def("linear_packed_cpu(Tensor x, Tensor wp, int n, Tensor? bias) -> Tensor");
  m.def("linear_packed_int8_cpu(Tensor x, Tensor wp, Tensor scales, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvfleet, CPU, m) {
  m.impl("linear_packed_cpu", &linear_packed_cpu);
  m.impl("linear_packed_int8_cpu", &linear_packed_int8_cpu);
}
