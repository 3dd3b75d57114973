// A decoder layer's element-wise work on the CPU, one pass over memory per op instead of one per
// torch operator (RMSNorm alone is seven): vLLM's CPU kernels rms_norm, fused_add_rms_norm,
// rotary_embedding (rotate-half, the Llama/NeoX layout) and silu_and_mul. Math in float32 whatever the
// activation dtype (float32, bfloat16, float16), as transformers' RMSNorm does; rows spread over torch's
// OpenMP pool (at::parallel_for) once a call is large enough to pay for it.
//
// Registered as torch.ops.kvfleet.{rms_norm_cpu, fused_add_rms_norm_cpu, rotary_embedding_cpu,
// silu_and_mul_cpu}; the torch versions in model/layers/layer_ops.py are the reference. The KV write of a
// step, reshape_and_cache_cpu, is here too (its reference: attention/torch_ref.py write_kv).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "vec_avx2.h"

namespace {

constexpr int64_t kGrainElems = 1 << 15;  // below ~32K elements a call runs on the calling thread

inline int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems));
}

template <typename T>
inline float f32(T x) { return static_cast<float>(x); }

// y[i] = w[i] * (x[i] * inv_rms), inv_rms = 1 / sqrt(mean(x^2) + eps); transformers' order of rounding
template <typename T>
inline void rms_row(T* y, const T* x, const T* w, int64_t H, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += f32(x[i]) * f32(x[i]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) y[i] = static_cast<T>(f32(w[i]) * f32(static_cast<T>(f32(x[i]) * r)));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name, " must be a CPU [T, hidden] tensor ",
              "with a contiguous last dim");
}

template <typename F>
void dispatch_float(at::ScalarType st, const char* op, F&& f) {
  switch (st) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", st);
  }
}

// out = rms_norm(x) * weight; x, out: [T, hidden]; weight: [hidden]
void rms_norm_cpu(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
                  out.scalar_type() == x.scalar_type(),
              "rms_norm_cpu: out [T, hidden], weight [hidden], one dtype");
  const int64_t T = x.size(0), H = x.size(1);
  dispatch_float(x.scalar_type(), "rms_norm_cpu", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* xp = x.data_ptr<T_>();
    const T_* wp = weight.data_ptr<T_>();
    T_* yp = out.data_ptr<T_>();
    const int64_t xs = x.stride(0), ys = out.stride(0);
    at::parallel_for(0, T, grain_rows(H), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) rms_row(yp + t * ys, xp + t * xs, wp, H, static_cast<float>(eps));
    });
  });
}

// residual += x (the new residual stream), then out = rms_norm(residual) * weight — the residual add
// before a layer's norm, in one pass. x, residual, out: [T, hidden]; residual is updated in place.
void fused_add_rms_norm_cpu(at::Tensor out, at::Tensor residual, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  check_rows(residual, "residual");
  TORCH_CHECK(out.sizes() == x.sizes() && residual.sizes() == x.sizes() && weight.dim() == 1 &&
                  weight.size(0) == x.size(1) && weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
                  out.scalar_type() == x.scalar_type() && residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm_cpu: out, residual, x [T, hidden], weight [hidden], one dtype");
  const int64_t T = x.size(0), H = x.size(1);
  dispatch_float(x.scalar_type(), "fused_add_rms_norm_cpu", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* xp = x.data_ptr<T_>();
    const T_* wp = weight.data_ptr<T_>();
    T_* rp = residual.data_ptr<T_>();
    T_* yp = out.data_ptr<T_>();
    const int64_t xs = x.stride(0), rs = residual.stride(0), ys = out.stride(0);
    at::parallel_for(0, T, grain_rows(H), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        T_* r = rp + t * rs;
        const T_* xi = xp + t * xs;
        for (int64_t i = 0; i < H; ++i) r[i] = static_cast<T_>(f32(r[i]) + f32(xi[i]));
        rms_row(yp + t * ys, r, wp, H, static_cast<float>(eps));
      }
    });
  });
}

// In place, rotate-half RoPE (Su et al. 2021; the Llama / GPT-NeoX layout) on query and key:
// x[:h] <- x[:h] cos[:h] - x[h:] sin[:h], x[h:] <- x[h:] cos[h:] + x[:h] sin[h:], h = head_dim / 2.
// q: [T, heads, head_dim], k: [T, kv_heads, head_dim] (strided views of the fused qkv output are fine);
// cos, sin: [T, head_dim] in q's dtype, positions already looked up.
void rotary_embedding_cpu(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  for (const auto* t : {&q, &k})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->stride(2) == 1 && t->scalar_type() == q.scalar_type(),
                "rotary_embedding_cpu: q and k must be [T, heads, head_dim] with a contiguous head_dim, one dtype");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D, "rotary_embedding_cpu: q and k disagree on T or head_dim");
  TORCH_CHECK(D % 2 == 0, "rotary_embedding_cpu: head_dim must be even, got ", D);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(),
              "rotary_embedding_cpu: cos and sin must be contiguous [T, head_dim] in q's dtype");
  const int64_t half = D / 2, Hq = q.size(1), Hk = k.size(1);
  dispatch_float(q.scalar_type(), "rotary_embedding_cpu", [&](auto tag) {
    using T_ = decltype(tag);
    T_* qp = q.data_ptr<T_>();
    T_* kp = k.data_ptr<T_>();
    const T_* cp = cos.data_ptr<T_>();
    const T_* sp = sin.data_ptr<T_>();
    auto rotate = [&](T_* x, const T_* c, const T_* s) {
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = f32(x[i]), b = f32(x[i + half]);
        // each product rounded to the dtype first, as torch's x * cos + rotate_half(x) * sin
        const float lo = f32(static_cast<T_>(a * f32(c[i]))) + f32(static_cast<T_>(-b * f32(s[i])));
        const float hi = f32(static_cast<T_>(b * f32(c[i + half]))) + f32(static_cast<T_>(a * f32(s[i + half])));
        x[i] = static_cast<T_>(lo);
        x[i + half] = static_cast<T_>(hi);
      }
    };
    at::parallel_for(0, T, grain_rows((Hq + Hk) * D), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const T_* c = cp + t * D;
        const T_* s = sp + t * D;
        for (int64_t h = 0; h < Hq; ++h) rotate(qp + t * q.stride(0) + h * q.stride(1), c, s);
        for (int64_t h = 0; h < Hk; ++h) rotate(kp + t * k.stride(0) + h * k.stride(1), c, s);
      }
    });
  });
}

// out = silu(x[:, :I]) * x[:, I:], silu(g) = g / (1 + e^-g); x: [T, 2I] (the fused gate_up output),
// out: [T, I]
void silu_and_mul_cpu(at::Tensor out, const at::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.size(1) % 2 == 0 && out.size(0) == x.size(0) && out.size(1) == x.size(1) / 2 &&
                  out.scalar_type() == x.scalar_type(),
              "silu_and_mul_cpu: x [T, 2I] and out [T, I], one dtype");
  const int64_t T = x.size(0), I = out.size(1);
  dispatch_float(x.scalar_type(), "silu_and_mul_cpu", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* xp = x.data_ptr<T_>();
    T_* op = out.data_ptr<T_>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    at::parallel_for(0, T, grain_rows(2 * I), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const T_* g = xp + t * xs;
        const T_* u = g + I;
        T_* y = op + t * os;
        int64_t i = 0;
#ifdef KVFLEET_AVX2
        if constexpr (std::is_same_v<T_, float>) {
          const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
          for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(one, kvfleet_vec::exp8(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(y + i, _mm256_mul_ps(sg, _mm256_loadu_ps(u + i)));
          }
        }
#endif
        for (; i < I; ++i) {
          const float gi = f32(g[i]);
          y[i] = static_cast<T_>(f32(static_cast<T_>(gi / (1.f + std::exp(-gi)))) * f32(u[i]));
        }
      }
    });
  });
}

// k_cache/v_cache viewed as [num_slots, num_kv_heads * head_dim]: row slots[t] = k[t] / v[t] (vLLM's
// reshape_and_cache); a negative slot (PAD_SLOT_ID) writes nothing. One memcpy per row instead of
// index_copy_'s TensorIterator set-up, which costs ~50 us for a decode step's few rows.
void reshape_and_cache_cpu(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                           const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "reshape_and_cache_cpu: k, v [T, num_kv_heads, head_dim] and contiguous caches "
              "[num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(),
              "reshape_and_cache_cpu: k, v and the caches must share a dtype");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "reshape_and_cache_cpu: each row of k and v must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1 &&
                  slots.size(0) == k.size(0),
              "reshape_and_cache_cpu: slots must be contiguous int64 [T]");
  const int64_t T = k.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)  // every slot in range before any write
    TORCH_CHECK(sp[t] < num_slots, "reshape_and_cache_cpu: slot ", sp[t], " outside [0, ", num_slots, ")");
  const int64_t row_bytes = k.size(1) * k.size(2) * k.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  at::parallel_for(0, T, std::max<int64_t>(1, (kGrainElems * 4) / row_bytes), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (sp[t] < 0) continue;
      std::memcpy(kc + sp[t] * row_bytes, kp + t * ks, row_bytes);
      std::memcpy(vc + sp[t] * row_bytes, vp + t * vs, row_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet, m) {
  m.def("rms_norm_cpu(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm_cpu(Tensor(a!) out, Tensor(b!) residual, Tensor x, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding_cpu(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul_cpu(Tensor(a!) out, Tensor x) -> ()");
  m.def("reshape_and_cache_cpu(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet, CPU, m) {
  m.impl("rms_norm_cpu", &rms_norm_cpu);
  m.impl("fused_add_rms_norm_cpu", &fused_add_rms_norm_cpu);
  m.impl("rotary_embedding_cpu", &rotary_embedding_cpu);
  m.impl("silu_and_mul_cpu", &silu_and_mul_cpu);
  m.impl("reshape_and_cache_cpu", &reshape_and_cache_cpu);
}
