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

#include "panel_tile.h"

namespace {

constexpr int64_t kMaxXBlockBytes = 192 * 1024;  // rows of x held in L2 while every panel passes
using kvfleet_panel::kPanel;
using kvfleet_panel::kRows;
using kvfleet_panel::kTiles;

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
