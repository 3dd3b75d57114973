// Float32 y = x Wᵀ + b on the CPU over a weight packed once into column panels: W [N, K] is stored as
// Wp [P, K, 16], P = ceil(N / 16), panel p holding output columns 16p .. 16p + 15 (zero rows past N), so
// one panel streams from memory as a single contiguous run of K x 64 bytes.
//
// The micro-kernels are the register-blocked outer products of BLIS / GotoBLAS (Goto & van de Geijn 2008,
// "Anatomy of high-performance matrix multiplication"), panel_tile.h: in the AVX-512 build, 12 rows of
// x times two panels (tile2: 24 zmm accumulators); in the AVX2 build, 6 rows times one panel (12 ymm
// accumulators); the portable build runs the same sums in scalar loops. Rows of x are packed k-major
// per tile (GotoBLAS's packed A), so the broadcasts read one contiguous stream. Decode's few rows: the
// threads split the panels, each streaming one contiguous range with the next panels prefetched into L2
// one 64-byte line per k, so the weight stream — what decode is bound by: every step reads every
// weight — runs at the memory's rate. Prefill's many rows: the threads split the rows, and K is taken in
// chunks (run_panels) sized for the caches.
//
// Accumulation is float32 in k order, one FMA chain per output in either vector build, whatever the tile
// or thread count (the portable build multiplies and adds separately): the result agrees with F.linear
// to float32 rounding (tests/server/test_cpu_linear.py checks it against float64), and the AVX-512 and
// AVX2 builds give the same bits (tests/server/test_cpu_isa_variants.py).
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
#include <unistd.h>
#include <vector>

#include "panel_tile.h"

namespace {

constexpr int64_t kKc = 1024;  // K per pass at most (a pair of panels' chunk: 128 KB, from L2)

// bytes of packed x each thread keeps in L2 while every panel passes over it: half the core's L2
// (glibc reports it; 1 MB where it does not). Measured on the Xeon of cpu_prepack.LAYOUT_BY_ISA with
// SmolLM2-135M's shapes at 2048 rows: 256 KB blocks 0.83x oneDNN, 1 MB 0.90x.
int64_t x_block_bytes() {
  static const int64_t bytes = [] {
    long l2 = -1;
#ifdef _SC_LEVEL2_CACHE_SIZE
    l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return l2 > 0 ? std::max<int64_t>(128 * 1024, l2 / 2) : int64_t{1} << 20;
  }();
  return bytes;
}
using kvfleet_panel::kPanel;
using kvfleet_panel::kRows;
using kvfleet_panel::kTiles;

// The AVX-512 build packs rows k-major, runs two panels per micro-kernel call and splits prefill's rows
// over the threads. The AVX2 and portable builds keep the layout they were measured fastest with on the
// AMD EPYC (cpu_prepack.LAYOUT_BY_ISA): x read in place, one panel per call, panels split over the
// threads, 192 KB blocks of rows (forcing the AVX2 build on the Xeon, packing and splitting rows were
// 4 % slower end to end, benchmarks/offline_throughput.py).
#ifdef KVFLEET_AVX512
constexpr int kGroup = 2;                   // panels per micro-kernel call: tile2
constexpr int kTileRows = kvfleet_panel::kRows2;
constexpr bool kPackRows = true;
#else
constexpr int kGroup = 1;                   // tile
constexpr int kTileRows = kRows;
constexpr bool kPackRows = false;
#endif

// y [M, n] = x [M, K] . Wp (* scales) (+ bias) over P panels of K x 16 weights of type W, in GotoBLAS's
// loop order. Rows are taken in blocks and packed k-major tile by tile (pack_rows: the micro-kernel's
// broadcasts read one contiguous stream, GotoBLAS's packed A). Threads split the block's tiles when
// there are many (prefill: each thread packs and reads its own rows and writes its own rows of y, a
// block of them held in L2; K in chunks of at most kKc, so the panels' chunk stays in L2 while it
// passes over the thread's tiles), and the panels otherwise (decode: each thread streams its own contiguous
// run of weights, the step's bottleneck, the next panels prefetched; K whole).
template <typename W>
void run_panels(const float* xp, int64_t M, int64_t K, const W* wptr, int64_t P, int64_t n, const float* sp,
                const float* bp, float* yp) {
  constexpr int rows = kTileRows;
  const int64_t threads = at::get_num_threads();
  const bool split_rows = kPackRows && M >= 4 * rows * threads;
  const int64_t chunks = split_rows ? (K + kKc - 1) / kKc : 1, kc = (K + chunks - 1) / chunks;
  const int64_t block = std::max<int64_t>(
      rows, ((kPackRows ? x_block_bytes() : 192 * 1024) * (split_rows ? threads : 1) /
             (kc * static_cast<int64_t>(sizeof(float)))) / rows * rows);
  // the packed block: up to kKeepFloats kept per calling thread across calls, so a call neither
  // zero-fills nor page-faults a fresh buffer; a larger block (many threads, large K) gets a buffer of
  // its own for this call
  constexpr size_t kKeepFloats = size_t{4} << 20;  // 16 MB
  const size_t need = kPackRows ? static_cast<size_t>(std::min(block, M) + rows) * K : 0;
  thread_local std::vector<float> kept;
  std::vector<float> once;
  if (need <= kKeepFloats) {
    if (kept.size() < need) kept.resize(need);
  } else {
    once.resize(need);
  }
  float* const buf = need <= kKeepFloats ? kept.data() : once.data();  // the lambdas run on other threads:
                                                                         // their own thread_local is not this
  std::vector<int64_t> starts;
  auto pack = [&](int64_t t0, int64_t t1) {
    if (!kPackRows) return;
    for (int64_t t = t0; t < t1; ++t) {
      kvfleet_panel::pack_rows(xp + starts[t] * K, K, static_cast<int>(starts[t + 1] - starts[t]), K,
                               buf + t * K * rows, rows);
    }
  };
  // panels p .. p + kGroup - 1 (fewer at the end) over tiles [t0, t1), k in [k0, k1); partial sums go to
  // y unscaled (a chunk after the first starts from them), bias and scale come with the last chunk
  auto group = [&](int64_t p, int64_t t0, int64_t t1, int64_t k0, int64_t k1, const W* next) {
    const bool last = k1 == K;
    const W* w = wptr + p * K * kPanel + k0 * kPanel;
    const float* b = bp && last ? bp + p * kPanel : nullptr;
    const float* s = sp && last ? sp + p * kPanel : nullptr;
    // tile t's rows from k0: packed (k-major, `rows` apart per k) or in place (rows K apart)
    auto x_at = [&](int64_t t) { return kPackRows ? buf + t * K * rows + k0 * rows : xp + starts[t] * K + k0; };
#ifdef KVFLEET_AVX512
    if (p + 1 < P) {
      const int ncols1 = static_cast<int>(std::min<int64_t>(kPanel, n - (p + 1) * kPanel));
      for (int64_t t = t0; t < t1; ++t) {
        const int mr = static_cast<int>(starts[t + 1] - starts[t]);
        kvfleet_panel::kTiles2<W>[mr](x_at(t), w, w + K * kPanel, k1 - k0, yp + starts[t] * n + p * kPanel,
                                      n, ncols1, b, s, t == t0 ? next : nullptr, k0 > 0);
      }
      return;
    }
#endif
    const int ncols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
    for (int64_t t = t0; t < t1; ++t) {
      const int mr = static_cast<int>(starts[t + 1] - starts[t]);
      kTiles<W, kPackRows ? rows : 0>[mr](x_at(t), K, w, k1 - k0, yp + starts[t] * n + p * kPanel, n, ncols, b, s,
                          t == t0 ? next : nullptr, k0 > 0);
    }
  };
  const int64_t groups = (P + kGroup - 1) / kGroup;
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    // the block's rows in ceil(rows / tile rows) tiles of near-equal size (32 rows, 6-row tiles:
    // 6 6 5 5 5 5, not 6 6 6 6 6 2: a thin last tile re-reads the panel for little work)
    const int64_t tiles = (m1 - m0 + rows - 1) / rows, base = (m1 - m0) / tiles, extra = (m1 - m0) % tiles;
    starts.assign(1, m0);
    for (int64_t t = 0; t < tiles; ++t) starts.push_back(starts.back() + base + (t < extra));
    if (split_rows) {
      at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
        pack(t0, t1);
        for (int64_t k0 = 0; k0 < K; k0 += kc) {
          for (int64_t g = 0; g < groups; ++g) group(g * kGroup, t0, t1, k0, std::min(K, k0 + kc), nullptr);
        }
      });
    } else {
      pack(0, tiles);
      at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g) {
          const W* next = g + 1 < g1 ? wptr + (g + 1) * kGroup * K * kPanel : nullptr;
          group(g * kGroup, 0, tiles, 0, K, next);
        }
      });
    }
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
