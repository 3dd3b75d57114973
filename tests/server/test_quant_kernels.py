"""Must-show 3: every quantized Linear against a dequantized float reference over random shapes.

Tolerances: float32 activations — the method's output equals F.linear(x, W_deq) to 1e-4 relative
(W_deq: the method's own dequantized weight, so only summation order differs); bfloat16 / float16
activations — 1.5e-2 relative to max |y| (bf16 keeps 8 significant bits; the output is rounded
once). Quantization error of the stored weight against the original float weight is checked
separately, per format. K not divisible by the int4 group size (32) is PADDED with zero weights
before quantization, and the activations are zero-padded per call, so the
padding columns contribute nothing; GGUF formats have K a multiple of 32 by construction.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvfleet_server.model.layers.linear import Linear
from kvfleet_server.model.layers.quant import int4_layout
from kvfleet_server.model.layers.quant.fp8 import Fp8LinearMethod, upcast
from kvfleet_server.model.layers.quant.gguf import GGUFLinearMethod, GGUFTensor, unpack_blocks
from kvfleet_server.model.layers.quant.int4 import Int4LinearMethod
from kvfleet_server.model.layers.quant.int8 import Int8LinearMethod

SHAPES = [(1, 64, 32), (3, 96, 48), (7, 160, 64), (16, 40, 24), (5, 200, 100), (33, 32, 128)]  # (T, K, N)
ACT = [torch.float32, torch.bfloat16]


def _rel(y, ref):
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).item()


def _tol(dtype):
    return 1e-4 if dtype == torch.float32 else 1.5e-2


def _layer(method, K, N, w, sizes=None, bias=None):
    layer = Linear(K, sizes or N, bias=bias is not None, quant_method=method)
    with torch.no_grad():
        if sizes:
            start = 0
            for i, n in enumerate(sizes):
                layer.weight.weight_loader(layer.weight, w[start:start + n], i)
                start += n
        else:
            layer.weight.weight_loader(layer.weight, w)
        if bias is not None:
            layer.bias.copy_(bias)
    layer.process_weights_after_loading()
    return layer


def _deq_int8(layer):
    return Int8LinearMethod.dequantize(layer)


@pytest.mark.parametrize("T, K, N", SHAPES)
@pytest.mark.parametrize("act", ACT)
def test_int8_linear_matches_dequantized_reference(T, K, N, act):
    torch.manual_seed(T * 1000 + K + N)
    w = torch.randn(N, K)
    layer = _layer(Int8LinearMethod(act), K, N, w)
    q = getattr(layer, "qweight_panels", None)
    q = layer.qweight if q is None else q  # 16-column panels where kvfleet's AVX2 kernels run
    assert q.dtype == torch.int8 and layer.scales.shape == (N,)
    step = w.abs().amax(1, keepdim=True) / 127  # per channel: half a step, one with bf16-rounded scales
    assert ((_deq_int8(layer) - w).abs() <= step * (0.501 if act == torch.float32 else 1.01)).all()
    x = torch.randn(T, K).to(act)
    with torch.inference_mode():
        y = layer(x)
    assert y.dtype == act and y.shape == (T, N)
    assert _rel(y, F.linear(x.float(), _deq_int8(layer).to(act).float())) < _tol(act)


@pytest.mark.parametrize("T, K, N", SHAPES)
@pytest.mark.parametrize("act", ACT)
def test_int4_linear_matches_dequantized_reference(T, K, N, act):
    torch.manual_seed(T * 1000 + K + N + 1)
    w = torch.randn(N, K)
    layer = _layer(Int4LinearMethod(act), K, N, w)
    Kp = int4_layout.pad_k(K)
    assert layer.int4_k_padded == Kp and layer.int4_cpu_kernel == (act == torch.bfloat16 and N % 16 == 0)
    deq = int4_layout.dequantize(layer)
    assert deq.shape == (N, Kp)
    # half a quantization step of each group (range / 15 / 2), bf16-rounded scales on the kernel path
    step = (w.view(N, -1, 32) if K % 32 == 0 else F.pad(w, (0, Kp - K)).view(N, -1, 32))
    step = (step.amax(-1) - step.amin(-1)) / 15
    err = (deq[:, :K] - w).abs().view(N, -1) if K % 32 == 0 else (deq - F.pad(w, (0, Kp - K))).abs()
    assert (err.view(N, -1, 32) <= step[..., None] * 0.5 + step[..., None] * (0.05 if act != torch.float32 else 1e-4)
            + 1e-6).all()
    x = torch.randn(T, K).to(act)
    with torch.inference_mode():
        y = layer(x)
    assert y.dtype == act and y.shape == (T, N)
    assert _rel(y, F.linear(x.float(), deq[:, :K].to(act).float())) < _tol(act)


def test_int4_cpu_kernel_zero_point_convention():
    """tinygemm's CPU kernel computes w = (q − 8) · scale + zero: with zero = m + 8 s that is q · s + m."""
    torch.manual_seed(0)
    N, K = 64, 128
    q = torch.randint(0, 16, (N, K), dtype=torch.int32)
    s = torch.rand(N, K // 32) * 0.1 + 0.01
    m = torch.randn(N, K // 32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([s.t(), (m + 8 * s).t()], -1).contiguous()
    x = torch.randn(4, K)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
    ref = x @ (q.float().view(N, -1, 32) * s[..., None] + m[..., None]).view(N, K).t()
    assert _rel(y, ref) < 1e-5
    wrong = x @ (q.float().view(N, -1, 32) * s[..., None] + (m + 8 * s)[..., None]).view(N, K).t()
    assert _rel(wrong, ref) > 1e-2  # the test tells the two conventions apart


@pytest.mark.parametrize("T, K, N", SHAPES)
@pytest.mark.parametrize("act", ACT)
def test_fp8_weight_only_matches_dequantized_reference(T, K, N, act):
    torch.manual_seed(T * 1000 + K + N + 2)
    w = torch.randn(N, K)
    b = torch.randn(N)
    layer = _layer(Fp8LinearMethod(act), K, N, w, bias=b.to(act))
    assert layer.qweight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (N,)
    assert not layer.fp8_scaled_mm  # CPU: weight-only
    deq = layer.qweight.float() * layer.weight_scale[:, None]
    assert ((deq - w).abs() <= w.abs() * 2 ** -4 + 1e-3 * w.abs().amax(1, keepdim=True)).all()  # e4m3: 3 mantissa bits
    x = torch.randn(T, K).to(act)
    with torch.inference_mode():
        y = layer(x)
    assert _rel(y, F.linear(x.float(), deq, b)) < _tol(act) * (3 if act != torch.float32 else 1)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("act", ACT)
def test_fp8_lookup_table_upcast_equals_torch_cast(fp8, act):
    """The CPU lookup-table upcast gives torch's cast for every one of the 256 codes (NaN codes too)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(3).view(24, 32).view(fp8)
    got, want = upcast(codes, act), codes.to(act)
    assert got.dtype == act and got.shape == codes.shape
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(0), want.nan_to_num(0))


def test_fused_shards_keep_their_rows_and_scales():
    """q/k/v loaded as shards land in their row ranges; per-channel scales follow their rows."""
    torch.manual_seed(3)
    sizes = [48, 16, 16]
    w = torch.cat([torch.randn(48, 64) * 10, torch.randn(16, 64) * 0.01, torch.randn(16, 64)])
    layer = _layer(Int8LinearMethod(torch.float32), 64, 80, w, sizes=sizes)
    assert torch.allclose(_deq_int8(layer), w, rtol=0, atol=float(w.abs().max()) / 127)
    assert layer.scales[:48].min() > 100 * layer.scales[48:64].max()
    with pytest.raises(ValueError, match="does not fit shard 1"):
        Linear(64, sizes).weight_loader(Linear(64, sizes).weight, torch.zeros(15, 64), 1)


def _gguf_tensor(kind: str, w: np.ndarray) -> GGUFTensor:
    from gguf import GGMLQuantizationType, quants

    return GGUFTensor(kind, quants.quantize(w, GGMLQuantizationType[kind]), w.shape)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_unpack_is_the_gguf_package_dequantization(kind):
    rng = np.random.default_rng(5)
    t = _gguf_tensor(kind, rng.standard_normal((24, 96)).astype(np.float32))
    q, s, m = unpack_blocks(t)
    G = 96 // 32
    mine = q.float().view(24, G, 32) * s[..., None] + (m[..., None] if m.numel() else 0)
    assert torch.allclose(mine.view(24, 96), t.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("act", ACT)
@pytest.mark.parametrize("T, K, N", [(1, 64, 32), (9, 160, 96), (32, 96, 48)])
def test_gguf_packed_linear_matches_dequantized_gguf(kind, act, T, K, N):
    rng = np.random.default_rng(T + K + N)
    parts = [rng.standard_normal((n, K)).astype(np.float32) for n in (N // 2, N // 4, N - N // 2 - N // 4)]
    shards = [_gguf_tensor(kind, p) for p in parts]
    layer = Linear(K, [p.shape[0] for p in parts], quant_method=GGUFLinearMethod(act))
    for i, sh in enumerate(shards):
        layer.weight.weight_loader(layer.weight, sh, i)
    layer.process_weights_after_loading()
    assert layer.gguf_kind == ("q8" if kind == "Q8_0" else "q4")
    ref_w = torch.cat([sh.dequantize() for sh in shards])
    x = torch.randn(T, K).to(act)
    with torch.inference_mode():
        y = layer(x)
        emb = layer.quant_method.embedding(layer, torch.tensor([0, N - 1, 3]))
    if act == torch.float32:
        assert torch.allclose(y, x @ ref_w.t(), rtol=0, atol=1e-4 * float((x @ ref_w.t()).abs().max()))
    else:
        assert _rel(y, x.float() @ ref_w.to(act).float().t()) < _tol(act)
    assert _rel(emb, ref_w[[0, N - 1, 3]]) < (1e-6 if act == torch.float32 else _tol(act))


def test_gguf_mixed_or_other_types_fall_back_to_dequantized_float():
    rng = np.random.default_rng(1)
    a = _gguf_tensor("Q4_1", rng.standard_normal((32, 64)).astype(np.float32))
    b = _gguf_tensor("Q8_0", rng.standard_normal((32, 64)).astype(np.float32))
    layer = Linear(64, [32, 32], quant_method=GGUFLinearMethod(torch.float32))
    layer.weight.weight_loader(layer.weight, a, 0)
    layer.weight.weight_loader(layer.weight, b, 1)
    layer.process_weights_after_loading()
    assert layer.gguf_kind == "float"
    assert torch.equal(layer.weight, torch.cat([a.dequantize(), b.dequantize()]))
