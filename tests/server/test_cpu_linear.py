"""kvfleet's float32 panel linear on the CPU (attention/csrc/linear_cpu.cpp, model/layers/cpu_prepack.py's
``pack_panels``): against float64 over random shapes (row counts on both sides of the AVX2 build's 6-row
and the AVX-512 build's 12- and 14-row tiles, of the threads' split by rows and of an L2 block of rows;
column counts not a multiple of the 16-column panel or of a pair of panels; K down to 1 and past one
K chunk), with and without bias, strided and batched inputs, the same bits whatever the thread count
(split by panels or by rows, K whole or in chunks), and bad inputs refused by name. tests/server/
test_cpu_isa_variants.py runs this file again under every other build this CPU runs."""

from __future__ import annotations

import pytest
import torch

from kvfleet_server.attention import cpu_ext
from kvfleet_server.model.layers.cpu_prepack import PanelLinearMethod, pack_panels, prepack_linears
from kvfleet_server.model.layers.linear import Linear

pytestmark = pytest.mark.skipif(cpu_ext.load() is None, reason=f"CPU kernels not built: {cpu_ext.load_error()}")

EPS = torch.finfo(torch.float32).eps


def op(x, w, bias=None):
    return torch.ops.kvfleet.linear_packed_cpu(x, pack_panels(w), w.shape[0], bias)


def assert_close_to_float64(y, x, w, bias):
    """Within the deterministic bound of a float32 dot product of K terms summed in any order:
    |error| <= (K + 2)·eps·(|x|·|w|ᵀ + |b|) (Higham, "Accuracy and Stability of Numerical Algorithms", §3.1)."""
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    bound = (x.shape[1] + 2) * EPS * mag + 1e-30
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g} over the bound"
    assert float(err.max()) <= 1e-5 * max(1.0, float(ref.abs().max()))


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 12, 13, 15, 32, 97, 301])
@pytest.mark.parametrize("k,n", [(1, 3), (5, 16), (33, 17), (576, 40), (576, 960), (1536, 31)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_matches_float64(m, k, n, bias):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    assert_close_to_float64(op(x, w, b), x, w, b)


def test_rows_beyond_one_l2_block_and_strided_input():
    """K = 1536 puts 30 rows of x in one L2 block: 500 rows run 17 blocks; x a strided view."""
    g = torch.Generator().manual_seed(7)
    big = torch.randn(500, 3072, generator=g)
    x = big[:, ::2]
    w = torch.randn(100, 1536, generator=g) / 40
    b = torch.randn(100, generator=g)
    assert not x.is_contiguous()
    assert_close_to_float64(op(x, w, b), x, w, b)


def test_same_bits_whatever_the_thread_count():
    """Each output is one thread's sum in k order: the thread count changes which thread, not the sum."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3072 + 24, 576, generator=g)  # an odd number of panels: pairs and a single one
    before = torch.get_num_threads()
    try:
        for m in (9, 60, 150):  # 60 rows: the AVX-512 build splits rows on 1 thread, panels on 2
            x = torch.randn(m, 576, generator=g)
            torch.set_num_threads(1)
            one = op(x, w)
            torch.set_num_threads(2)
            two = op(x, w)
            assert torch.equal(one, two), m
            # and the same bits as the rows one at a time (decode's path: one tile, K whole)
            assert torch.equal(one, torch.cat([op(x[i:i + 1], w) for i in range(m)]))
        # K = 2049: the AVX-512 build's split by rows takes K in 3 passes, partial sums stored and reloaded
        w2, x2 = torch.randn(40, 2049, generator=g), torch.randn(150, 2049, generator=g)
        torch.set_num_threads(1)
        one = op(x2, w2)
        torch.set_num_threads(2)
        assert torch.equal(one, op(x2, w2)) and torch.equal(one, torch.cat([op(x2[i:i + 1], w2) for i in range(150)]))
    finally:
        torch.set_num_threads(before)


def test_empty_shapes():
    w = torch.randn(20, 8)
    assert op(torch.randn(0, 8), w).shape == (0, 20)
    b = torch.randn(5)
    assert torch.equal(op(torch.randn(3, 0), torch.randn(5, 0), b), b.expand(3, 5))


def test_packed_linear_layer_keeps_leading_dims():
    g = torch.Generator().manual_seed(1)
    lin = Linear(64, 24, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(24, 64, generator=g))
        lin.bias.copy_(torch.randn(24, generator=g))
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    assert prepack_linears(torch.nn.Sequential(lin), PanelLinearMethod) == (1, 0)
    assert lin.packed_weight.shape == (2, 64, 16) and lin.weight is None
    x = torch.randn(2, 3, 64, generator=g)
    y = lin(x)
    assert y.shape == (2, 3, 24)
    assert_close_to_float64(y.reshape(6, 24), x.reshape(6, 64), w, b)


@pytest.mark.parametrize("case,match", [
    ("k", "x has K = 7"), ("dtype", "x must be"), ("n", "does not match"), ("negative n", "does not match"),
    ("bias", "bias must be"), ("2-d bias", "bias must be"), ("layout", "wp must be")])
def test_bad_inputs_are_refused_by_name(case, match):
    x, w = torch.randn(2, 8), torch.randn(20, 8)
    wp, n, b = pack_panels(w), 20, None
    if case == "k":
        x = torch.randn(2, 7)
    elif case == "dtype":
        x = x.double()
    elif case == "n":
        n = 40
    elif case == "negative n":
        wp, n = wp[:0], -3
    elif case == "bias":
        b = torch.randn(19)
    elif case == "2-d bias":
        b = torch.randn(4, 5)
    else:
        wp = wp.transpose(0, 1)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.kvfleet.linear_packed_cpu(x, wp, n, b)


# --- int8 weights (--quantization int8 on the CPU) --------------------------------------------------------
def int8_op(x, q, s, bias=None):
    from kvfleet_server.model.layers.cpu_prepack import PANEL

    panels = pack_panels(q)
    padded = torch.zeros(panels.shape[0] * PANEL)
    padded[:q.shape[0]] = s
    return torch.ops.kvfleet.linear_packed_int8_cpu(x, panels, padded, q.shape[0], bias)


@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 32, 97, 301])
@pytest.mark.parametrize("k,n", [(1, 3), (33, 17), (576, 40), (1536, 31)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_panel_linear_matches_float64(m, k, n, bias):
    """y = (x . q) * s + b: float32 fused multiply-adds (one rounding per term), so the float64 bound of a
    float32 sum of K terms holds for the dequantized weight q · s."""
    g = torch.Generator().manual_seed(m * 1000 + k + n + 5)
    x = torch.randn(m, k, generator=g)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) / (127 * k ** 0.5)
    b = torch.randn(n, generator=g) if bias else None
    assert_close_to_float64(int8_op(x, q, s, b), x, q.double() * s.double()[:, None], b)


def test_int8_panel_linear_refuses_bad_inputs_by_name():
    q = torch.zeros(16, 8, dtype=torch.int8)
    panels = pack_panels(q)
    x = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.kvfleet.linear_packed_int8_cpu(x, panels, torch.zeros(15), 16, None)
    with pytest.raises(RuntimeError, match="int8|Char"):
        torch.ops.kvfleet.linear_packed_int8_cpu(x, panels.float(), torch.zeros(16), 16, None)
    with pytest.raises(RuntimeError, match="K = 4"):
        torch.ops.kvfleet.linear_packed_int8_cpu(torch.zeros(2, 4), panels, torch.zeros(16), 16, None)


def test_only_a_library_with_the_build_marker_is_loaded_directly(tmp_path, monkeypatch):
    """A link killed midway leaves a truncated .so (loading it can SIGBUS): only a build that finished,
    marked <name>.ok, is loaded without ninja's check."""
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    (tmp_path / "lib.so").write_bytes(b"\x7fELF truncated")
    assert cpu_ext._load_built(str(tmp_path), "lib") is False and loaded == []
    (tmp_path / "lib.ok").write_text("built\n")
    assert cpu_ext._load_built(str(tmp_path), "lib") is True
    assert loaded == [str(tmp_path / "lib.so")]
