// Paged attention of a span on the CPU: the rows of one sequence's chunk over its cached prefix (a decode
// with its draft tokens, a prefill chunk), sharing every key and value load between the rows.
//
// Registered as torch.ops.kvfleet.paged_span_attention_cpu (an opaque op, like paged_attention_cpu).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "panel_tile.h"
#include "softmax.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

namespace {

using kvfleet_attn::softmax_numerator;

// ---- spans: the rows of one sequence's chunk over its cached prefix (decodes with drafts) ----------
//
// Row i of the span attends the first prefix + i + 1 tokens. The per-row kernel above reads every key
// and value once per row; a span of R rows instead shares them: per kv head its keys are transposed
// once into 16-key panels [ceil(L / 16), D, 16] (L: the last row's context), then each tile of up to
// kRows (AVX2: 6, AVX-512: 14) of the span's R x G query vectors (G heads per kv head) computes its
// scores as a kRows x 16 register-blocked product per panel (panel_tile.h's tile, shared with the panel
// linear), soft-maxes each vector over its own context, and accumulates V, 16 of the D
// values at a time, from the value panels. float32 query and cache only (the caller's choice). The P.V
// pass of a tile runs over its last vector's context with zero weights past each vector's own, so a NaN
// or inf in the value of position t reaches the rows that attend t and also the earlier rows of the
// tiles that hold one of them (0 * NaN); SDPA's math path spreads it to every row of the span, the
// per-row kernel to the rows that attend t only.

using kvfleet_panel::kRows;  // query vectors per tile

// out, q: [T, num_heads, head_dim] float32 (head_dim contiguous, a multiple of 16); k_cache, v_cache:
// float32 [num_blocks, block_size, num_kv_heads, head_dim] contiguous; block_table: [>= ceil((prefix +
// q_len) / block_size)] int64. Rows q_start .. q_start + q_len - 1 of out are written.
void paged_span_attention_cpu(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_table, int64_t q_start,
                              int64_t q_len, int64_t prefix_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat && q.stride(2) == 1 && out.stride(2) == 1,
              "paged_span_attention_cpu: q and out must be float32 [T, num_heads, head_dim], head_dim contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == at::kFloat,
              "paged_span_attention_cpu: k_cache and v_cache must be contiguous float32 [num_blocks, block_size, "
              "num_kv_heads, head_dim]");
  const int64_t H = q.size(1), D = q.size(2), BS = k_cache.size(1), KVH = k_cache.size(2), NB = k_cache.size(0);
  TORCH_CHECK(D == k_cache.size(3) && D % 16 == 0 && H % KVH == 0,
              "paged_span_attention_cpu: head_dim must match the cache and be a multiple of 16, num_heads a multiple "
              "of num_kv_heads");
  TORCH_CHECK(q_len >= 1 && prefix_len >= 0 && q_start >= 0 && q_start + q_len <= q.size(0),
              "paged_span_attention_cpu: rows [", q_start, ", ", q_start + q_len, ") outside the ", q.size(0),
              " rows of q");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1 && block_table.is_contiguous(),
              "paged_span_attention_cpu: block_table must be a contiguous int64 vector");
  const int64_t L = prefix_len + q_len, nblk = (L + BS - 1) / BS;
  TORCH_CHECK(block_table.size(0) >= nblk, "paged_span_attention_cpu: prefix_len + q_len = ", prefix_len, " + ",
              q_len, " outside the ", block_table.size(0), " blocks of block_table");
  const int64_t* tab = block_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < nblk; ++b)
    TORCH_CHECK(tab[b] >= 0 && tab[b] < NB, "paged_span_attention_cpu: block id ", tab[b], " outside [0, ", NB, ")");

  const int64_t G = H / KVH, NVEC = q_len * G, tiles = (NVEC + kRows - 1) / kRows;
  const int64_t P = (L + 15) / 16, tok_stride = KVH * D;
  const float* kb = k_cache.data_ptr<float>();
  const float* vb = v_cache.data_ptr<float>();
  std::vector<int64_t> off(L);  // token t's offset in the cache, kv head 0
  for (int64_t t = 0; t < L; ++t) off[t] = tab[t / BS] * BS * tok_stride + (t % BS) * tok_stride;
  // per kv head: keys as 16-key panels kt [KVH][P][D][16] (zero past L), values as 16-column panels
  // vt [KVH][D / 16][L][16], both contiguous, so the tiles below stream them (built in parallel over heads
  // and 16-token groups; the tiles of a head read them again from cache: the caller bounds L,
  // cpu_backend.SPAN_MAX_CONTEXT)
  const int64_t DC = D / 16;
  std::unique_ptr<float[]> kt(new float[KVH * P * D * 16]), vt(new float[KVH * DC * L * 16]);
  at::parallel_for(0, KVH * P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kh = item / P, p = item % P;
      float* panel = kt.get() + item * D * 16;
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t t = p * 16 + j;
        if (t < L) {
          const float* k = kb + off[t] + kh * D;
          const float* v = vb + off[t] + kh * D;
          for (int64_t d = 0; d < D; ++d) panel[d * 16 + j] = k[d];
          for (int64_t c = 0; c < DC; ++c)
            std::memcpy(vt.get() + ((kh * DC + c) * L + t) * 16, v + c * 16, 16 * sizeof(float));
        } else {
          for (int64_t d = 0; d < D; ++d) panel[d * 16 + j] = 0.f;
        }
      }
    }
  });
  const float sc = static_cast<float>(scale);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1), o_s0 = out.stride(0), o_s1 = out.stride(1);
  at::parallel_for(0, KVH * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(kRows * D), s(kRows * P * 16), o(kRows * 16), inv(kRows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kh = item / tiles, v0 = (item % tiles) * kRows, nv = std::min<int64_t>(kRows, NVEC - v0);
      // vector v: row v / G of the span, head kh * G + v % G
      for (int64_t i = 0; i < nv; ++i) {
        const int64_t r = (v0 + i) / G, h = kh * G + (v0 + i) % G;
        const float* src = qp + (q_start + r) * q_s0 + h * q_s1;
        for (int64_t d = 0; d < D; ++d) qf[i * D + d] = src[d] * sc;
      }
      const int64_t Lt = prefix_len + (v0 + nv - 1) / G + 1, Pt = (Lt + 15) / 16, ld = Pt * 16;
      const auto fn = kvfleet_panel::kTiles<float>[nv];  // no bias, scale or prefetch: 16 columns as they are
      for (int64_t p = 0; p < Pt; ++p)
        fn(qf.data(), D, kt.get() + (kh * P + p) * D * 16, D, s.data() + p * 16, ld, 16, nullptr, nullptr, nullptr, false);
      for (int64_t i = 0; i < nv; ++i) {
        const int64_t Li = prefix_len + (v0 + i) / G + 1;
        float* si = s.data() + i * ld;
        inv[i] = 1.f / softmax_numerator(si, Li);
        std::fill(si + Li, si + ld, 0.f);  // keys past this row's context weigh nothing
      }
      for (int64_t c = 0; c < D; c += 16) {
        fn(s.data(), ld, vt.get() + (kh * DC + c / 16) * L * 16, Lt, o.data(), 16, 16, nullptr, nullptr, nullptr, false);
        for (int64_t i = 0; i < nv; ++i) {
          const int64_t r = (v0 + i) / G, h = kh * G + (v0 + i) % G;
          float* dst = op + (q_start + r) * o_s0 + h * o_s1 + c;
          for (int64_t d = 0; d < 16; ++d) dst[d] = o[i * 16 + d] * inv[i];
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet, m) {
  m.def(
      "paged_span_attention_cpu(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "int q_start, int q_len, int prefix_len, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet, CPU, m) {
  m.impl("paged_span_attention_cpu", &paged_span_attention_cpu);
}
