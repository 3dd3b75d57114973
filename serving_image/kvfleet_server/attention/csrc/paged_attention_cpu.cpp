// Paged attention on the CPU, reading K/V in place through block tables (no gather, no padding).
//
// One work item = one query row x its kv heads (x one kv head when there are fewer rows than twice the
// threads): the row's G = num_heads / num_kv_heads query heads share every K/V load (GQA), and a token's
// K/V row of all kv heads is read as one contiguous span. Scores over the row's visible keys are computed
// 8 keys at a time into a thread-local buffer, soft-maxed in float32, then V is accumulated in float32 —
// the two-pass form of vLLM's CPU paged attention (PagedAttention, Kwon et al. 2023); K and V are
// prefetched into L2 PREFETCH_TOKENS ahead of the keys being scored. The x86-64-v3 build runs the inner
// loops in AVX2 (vec_avx2.h), others in scalar loops. Work items are spread over torch's own OpenMP pool
// with at::parallel_for, so the kernel respects torch.set_num_threads.
//
// Registered as torch.ops.kvfleet.paged_attention_cpu (an opaque op; attention runs eagerly between compiled
// pieces). The span kernel (rows of one sequence sharing their keys) is paged_span_attention_cpu.cpp.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include "softmax.h"
#include "vec_avx2.h"

#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

namespace {

#ifdef KVFLEET_AVX2
using kvfleet_vec::fmadd;
using kvfleet_vec::hsum8x8;
#endif

// float32 view of one token's head_dim values: a float32 cache is read in place, other dtypes are
// converted into the scratch row (fp8 through a 256-entry table, cheaper than bit decoding).
template <typename T>
struct Loader {
  explicit Loader(float) {}
  inline const float* row(const T* p, float* scratch, int64_t D) const {
    for (int64_t d = 0; d < D; ++d) scratch[d] = static_cast<float>(p[d]);
    return scratch;
  }
};

template <>
struct Loader<float> {
  explicit Loader(float) {}
  inline const float* row(const float* p, float*, int64_t) const { return p; }
};

template <typename F8>
struct Fp8Loader {
  float lut[256];
  explicit Fp8Loader(float scale) {
    for (int b = 0; b < 256; ++b) {
      const uint8_t byte = static_cast<uint8_t>(b);
      F8 f;
      std::memcpy(&f, &byte, 1);
      const float x = static_cast<float>(f);
      lut[b] = std::isfinite(x) ? x * scale : 0.0f;  // NaN codes never written (values are clamped)
    }
  }
  inline const float* row(const uint8_t* p, float* scratch, int64_t D) const {
    for (int64_t d = 0; d < D; ++d) scratch[d] = lut[p[d]];
    return scratch;
  }
};

// Prefetch one token's head_dim values (64-byte lines), into L1 (LOCALITY 3) or L2 (LOCALITY 2).
template <int LOCALITY = 3, typename c_t>
inline void prefetch_row(const c_t* p, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(c_t)); b += 64) __builtin_prefetch(c + b, 0, LOCALITY);
}

// How many tokens ahead pass 1 prefetches K and V into L2 (V for pass 2). A decode step streams
// its K/V from memory: at ~15 cycles of work per token, 8 tokens ahead is shorter than one DRAM latency.
constexpr int64_t PREFETCH_TOKENS = 32;

// scores[t] = q . k_t for 8 key rows (float32, D values each)
inline void dot8(const float* q, const float* const* k, int64_t D, float* scores) {
#ifdef KVFLEET_AVX2
  if (D % 8 == 0) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j) acc[j] = fmadd(qv, _mm256_loadu_ps(k[j] + d), acc[j]);
    }
    _mm256_storeu_ps(scores, hsum8x8(acc));
    return;
  }
#endif
  for (int j = 0; j < 8; ++j) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; ++d) s += q[d] * k[j][d];
    scores[j] = s;
  }
}

using kvfleet_attn::softmax_numerator;

#ifdef KVFLEET_AVX2
// acc[g][:] = sum_t p[g][t] v_t for NG (<= 3) query heads, 32 of the D values at a time so that the
// NG x 4 accumulators stay in registers; each pass over the tokens reads a different 32 values of V (two
// 64-byte lines of a float32 cache), so for G <= 3 (SmolLM2: 3) V crosses memory once. A larger GQA
// group takes ceil(G / 3) such calls, each reading V again (from cache when the context is short).
template <int NG, typename RowFn>
inline void weighted_sum_v(const float* p, int64_t Lp, int64_t L, int64_t D, const RowFn& v_row, float* acc) {
  for (int64_t c = 0; c < D; c += 32) {
    __m256 a[NG][4];
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < 4; ++i) a[g][i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < L; ++t) {
      const float* v = v_row(t, c, 32);
      const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                   v3 = _mm256_loadu_ps(v + 24);
      for (int g = 0; g < NG; ++g) {
        const __m256 w = _mm256_broadcast_ss(p + g * Lp + t);
        a[g][0] = fmadd(w, v0, a[g][0]);
        a[g][1] = fmadd(w, v1, a[g][1]);
        a[g][2] = fmadd(w, v2, a[g][2]);
        a[g][3] = fmadd(w, v3, a[g][3]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(acc + g * D + c + 8 * i, a[g][i]);
  }
}
#endif

// the same for any D and G: every row of V once, the G accumulators in memory
template <typename RowFn>
inline void weighted_sum_v_scalar(const float* p, int64_t Lp, int64_t L, int64_t D, int64_t G, const RowFn& v_row,
                                  float* acc) {
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    const float* vt = v_row(t, 0, D);
    for (int64_t g = 0; g < G; ++g) {
      const float w = p[g * Lp + t];
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += w * vt[d];
    }
  }
}

template <typename q_t, typename c_t, typename load_t>
void attend(at::Tensor& out, const at::Tensor& q, const c_t* k_base, const c_t* v_base,
            const at::Tensor& k_cache, const at::Tensor& tables, const at::Tensor& rows,
            const at::Tensor& row_seq, const at::Tensor& row_len, double scale, const load_t& load_k,
            const load_t& load_v) {
  const int64_t R = rows.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH, W = tables.size(1);
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1), o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t tok_stride = KVH * D, blk_stride = BS * KVH * D;
  const q_t* qp = q.data_ptr<q_t>();
  q_t* op = out.data_ptr<q_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* rw = rows.data_ptr<int64_t>();
  const int64_t* rs = row_seq.data_ptr<int64_t>();
  const int64_t* rl = row_len.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);

  // A work item is one row's HPI kv heads: all of them (each token's K/V row is then read whole, one
  // contiguous stream per block) once there are enough rows to keep every thread busy, else one (a few
  // decodes still spread over the threads).
  const int64_t HPI = R >= 2 * at::get_num_threads() ? KVH : 1, items_per_row = KVH / HPI;
  at::parallel_for(0, R * items_per_row, 1, [&](int64_t begin, int64_t end) {
    // scores: HPI * G rows of Lp = L rounded up to 8 (pass 1 writes 8 at a time); scratch: 8 converted K rows
    std::vector<float> scores, qf(HPI * G * D), acc(G * D), scratch(8 * D), inv_sum(HPI * G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / items_per_row, kh0 = (item % items_per_row) * HPI;
      const int64_t row = rw[r], L = rl[r], Lp = (L + 7) / 8 * 8;
      const int64_t* table = tab + rs[r] * W;
      auto token = [&](const c_t* base, int64_t t) {  // kv head kh0's D values of token t (kh0 + i: + i * D)
        return base + table[t / BS] * blk_stride + (t % BS) * tok_stride + kh0 * D;
      };
      scores.resize(HPI * G * Lp);
      for (int64_t h = 0; h < HPI * G; ++h) {
        const q_t* src = qp + row * q_s0 + (kh0 * G + h) * q_s1;
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = static_cast<float>(src[d]) * sc;
      }
      // pass 1: scores[h][t] = q_h . k_t, 8 keys at a time (a short last group repeats its last key); K
      // and V are prefetched PREFETCH_TOKENS ahead into L2, so that pass 2 reads V from L2
      const int64_t span = HPI * D;  // the values of one token this item reads
      for (int64_t t = 0; t < std::min(L, PREFETCH_TOKENS); ++t) {
        prefetch_row<2>(token(k_base, t), span);
        prefetch_row<2>(token(v_base, t), span);
      }
      for (int64_t t0 = 0; t0 < L; t0 += 8) {
        const c_t* krow[8];
        for (int j = 0; j < 8; ++j) {
          krow[j] = token(k_base, std::min(t0 + j, L - 1));
          if (t0 + PREFETCH_TOKENS + j < L) {
            prefetch_row<2>(token(k_base, t0 + PREFETCH_TOKENS + j), span);
            prefetch_row<2>(token(v_base, t0 + PREFETCH_TOKENS + j), span);
          }
        }
        for (int64_t i = 0; i < HPI; ++i) {
          const float* k8[8];
          for (int j = 0; j < 8; ++j) k8[j] = load_k.row(krow[j] + i * D, scratch.data() + j * D, D);
          for (int64_t g = 0; g < G; ++g)
            dot8(qf.data() + (i * G + g) * D, k8, D, scores.data() + (i * G + g) * Lp + t0);
        }
      }
      for (int64_t h = 0; h < HPI * G; ++h) inv_sum[h] = 1.f / softmax_numerator(scores.data() + h * Lp, L);
      // pass 2, per kv head: acc[g] = sum_t p[g][t] v_t
      for (int64_t i = 0; i < HPI; ++i) {
        const float* p_i = scores.data() + i * G * Lp;
        auto v_row = [&](int64_t t, int64_t c, int64_t n) {  // values [c, c + n) of token t's V, as float32
          if (c == 0 && t + 4 < L) prefetch_row(token(v_base, t + 4) + i * D, D);
          return load_v.row(token(v_base, t) + i * D + c, scratch.data(), n);
        };
#ifdef KVFLEET_AVX2
        if (D % 32 == 0) {
          for (int64_t g0 = 0; g0 < G; g0 += 3) {
            const float* p = p_i + g0 * Lp;
            float* a = acc.data() + g0 * D;
            switch (std::min<int64_t>(3, G - g0)) {
              case 3: weighted_sum_v<3>(p, Lp, L, D, v_row, a); break;
              case 2: weighted_sum_v<2>(p, Lp, L, D, v_row, a); break;
              default: weighted_sum_v<1>(p, Lp, L, D, v_row, a);
            }
          }
        } else
#endif
          weighted_sum_v_scalar(p_i, Lp, L, D, G, v_row, acc.data());
        for (int64_t g = 0; g < G; ++g) {
          q_t* dst = op + row * o_s0 + ((kh0 + i) * G + g) * o_s1;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<q_t>(acc[g * D + d] * inv_sum[i * G + g]);
        }
      }
    }
  });
}

template <typename q_t>
void dispatch_cache(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& tables, const at::Tensor& rows, const at::Tensor& row_seq,
                    const at::Tensor& row_len, double scale, double k_scale, double v_scale) {
  const auto ct = k_cache.scalar_type();
  if (ct == at::kFloat8_e4m3fn || ct == at::kFloat8_e5m2) {
    const auto* kb = reinterpret_cast<const uint8_t*>(k_cache.data_ptr());
    const auto* vb = reinterpret_cast<const uint8_t*>(v_cache.data_ptr());
    if (ct == at::kFloat8_e4m3fn) {
      Fp8Loader<c10::Float8_e4m3fn> lk(k_scale), lv(v_scale);
      attend<q_t, uint8_t>(out, q, kb, vb, k_cache, tables, rows, row_seq, row_len, scale, lk, lv);
    } else {
      Fp8Loader<c10::Float8_e5m2> lk(k_scale), lv(v_scale);
      attend<q_t, uint8_t>(out, q, kb, vb, k_cache, tables, rows, row_seq, row_len, scale, lk, lv);
    }
  } else if (ct == at::kFloat) {
    Loader<float> l(1.f);
    attend<q_t, float>(out, q, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache, tables, rows,
                       row_seq, row_len, scale, l, l);
  } else if (ct == at::kBFloat16) {
    Loader<c10::BFloat16> l(1.f);
    attend<q_t, c10::BFloat16>(out, q, k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
                               k_cache, tables, rows, row_seq, row_len, scale, l, l);
  } else if (ct == at::kHalf) {
    Loader<c10::Half> l(1.f);
    attend<q_t, c10::Half>(out, q, k_cache.data_ptr<c10::Half>(), v_cache.data_ptr<c10::Half>(), k_cache,
                           tables, rows, row_seq, row_len, scale, l, l);
  } else {
    TORCH_CHECK(false, "paged_attention_cpu: unsupported KV cache dtype ", ct);
  }
}

// out, q: [T, num_heads, head_dim] (last dim contiguous); k_cache, v_cache: [num_blocks, block_size,
// num_kv_heads, head_dim] contiguous; tables: [S, W] int64 block ids; rows, row_seq, row_len: [R] int64 —
// row rows[r] of q/out attends the first row_len[r] tokens of sequence row_seq[r]'s block table.
// k_scale, v_scale multiply an FP8 cache's stored values (1 otherwise).
void paged_attention_cpu(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& rows,
                         const at::Tensor& row_seq, const at::Tensor& row_len, double scale, double k_scale,
                         double v_scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_attention_cpu runs on the CPU");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "head_dim must match and num_heads be a multiple of num_kv_heads");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need a contiguous head_dim");
  for (const auto* t : {&tables, &rows, &row_seq, &row_len})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "index tensors must be contiguous int64");
  TORCH_CHECK(tables.dim() == 2 && rows.size(0) == row_seq.size(0) && rows.size(0) == row_len.size(0),
              "tables must be [S, W] and rows, row_seq, row_len [R]");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out and q must share a dtype");
  // every index in range before any read: a bad table is an error, never an out-of-bounds access
  {
    const int64_t T = q.size(0), S = tables.size(0), W = tables.size(1);
    const int64_t NB = k_cache.size(0), BS = k_cache.size(1);
    const int64_t* tab = tables.data_ptr<int64_t>();
    const int64_t* rw = rows.data_ptr<int64_t>();
    const int64_t* rs = row_seq.data_ptr<int64_t>();
    const int64_t* rl = row_len.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows.size(0); ++r) {
      TORCH_CHECK(rw[r] >= 0 && rw[r] < T, "paged_attention_cpu: rows[", r, "] = ", rw[r], " outside [0, ", T, ")");
      TORCH_CHECK(rs[r] >= 0 && rs[r] < S, "paged_attention_cpu: row_seq[", r, "] = ", rs[r], " outside [0, ", S, ")");
      TORCH_CHECK(rl[r] >= 1 && rl[r] <= W * BS, "paged_attention_cpu: row_len[", r, "] = ", rl[r],
                  " outside [1, ", W * BS, "] (block table width x block size)");
      const int64_t* t = tab + rs[r] * W;
      for (int64_t b = 0; b < (rl[r] + BS - 1) / BS; ++b)
        TORCH_CHECK(t[b] >= 0 && t[b] < NB, "paged_attention_cpu: block id ", t[b], " outside [0, ", NB, ")");
    }
  }
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch_cache<float>(out, q, k_cache, v_cache, tables, rows, row_seq, row_len, scale, k_scale, v_scale);
      break;
    case at::kBFloat16:
      dispatch_cache<c10::BFloat16>(out, q, k_cache, v_cache, tables, rows, row_seq, row_len, scale, k_scale,
                                    v_scale);
      break;
    case at::kHalf:
      dispatch_cache<c10::Half>(out, q, k_cache, v_cache, tables, rows, row_seq, row_len, scale, k_scale,
                                v_scale);
      break;
    default:
      TORCH_CHECK(false, "paged_attention_cpu: unsupported query dtype ", q.scalar_type());
  }
}


}  // namespace

TORCH_LIBRARY(kvfleet, m) {
  m.def(
      "paged_attention_cpu(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, "
      "Tensor rows, Tensor row_seq, Tensor row_len, float scale, float k_scale, float v_scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet, CPU, m) {
  m.impl("paged_attention_cpu", &paged_attention_cpu);
}
