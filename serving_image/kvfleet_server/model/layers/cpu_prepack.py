"""Float32 linears on the CPU with the weight packed once, after loading, for a faster kernel.

``F.linear`` on the CPU hands every call to MKL's GEMM, which re-packs the weight into its panel
layout on each call; at decode's few rows (M = 1-32 against a 576 x 1536 weight) that costs as much as
the arithmetic, and a decode step, which reads every weight, streams them at well under the memory's
rate. Two packed layouts, each with one copy of the weight (the float weight is released):

- ``PanelLinearMethod`` (where kvfleet's C++ kernels build with vector code, ``LAYOUT_BY_ISA``): W [N, K] as
  16-column panels [ceil(N / 16), K, 16] (``pack_panels``), multiplied by ``torch.ops.kvfleet.linear_packed_cpu``
  (attention/csrc/linear_cpu.cpp: register-blocked micro-kernels, 12 rows x 2 panels in the AVX-512 build,
  6 rows x 1 panel in the AVX2 build, rows packed k-major, the next panels prefetched).
- ``PrepackedLinearMethod`` (the fallback without the C++ library or AVX2): oneDNN's inner product over a
  weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``), what
  vLLM's CPU backend and Inductor's weight freezing do.

Float32 in, float32 accumulation and out: results agree with ``F.linear`` to float32 rounding, not bit
for bit (the sums are ordered differently); greedy tokens are compared with the unpacked path by
tests/server/test_cpu_prepack.py, the kernel with float64 by tests/server/test_cpu_linear.py.

Applied to every unquantized float32 ``Linear`` when the engine runs eagerly on the CPU
(``EngineConfig.cpu_weight_prepack``, default on; torch.compile at level 3 traces the plain layers
instead). A tied LM head (``model.lm_head`` None: the vocabulary embedding projects the logits) gets a
packed copy next to the float embedding that row lookups read: + vocab x hidden x 4 bytes (113 MB for
SmolLM2-135M), logged.
"""

from __future__ import annotations

import torch

from .embedding import VocabEmbedding
from .linear import Linear, UnquantizedLinearMethod


PANEL = 16  # output columns per panel: one AVX-512 or two AVX2 registers (attention/csrc/linear_cpu.cpp)


class PrepackedLinearMethod(UnquantizedLinearMethod):
    """y = x Wᵀ + b with W held as oneDNN's prepacked tensor ``layer.packed_weight`` [N, K] float32
    (an opaque ``torch._mkldnn`` layout). x: [T, K] float32 → [T, N] float32. Row lookups (a tied
    embedding's ``embedding``) read the float ``layer.weight``, kept only there."""

    name = "unquantized"

    @staticmethod
    def pack(w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w)

    def apply(self, layer, x, bias):
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, bias, "none", [], "")


class PanelLinearMethod(PrepackedLinearMethod):
    """y = x Wᵀ + b with W held as ``layer.packed_weight`` [ceil(N / 16), K, 16] float32 (``pack_panels``)
    and multiplied by kvfleet's AVX-512 or AVX2 kernel. x: [..., K] float32 → [..., N] float32."""

    @staticmethod
    def pack(w: torch.Tensor) -> torch.Tensor:
        return pack_panels(w)

    def apply(self, layer, x, bias):
        n = layer.output_size  # N: the panels' rows past it are padding
        y = torch.ops.kvfleet.linear_packed_cpu(x.reshape(-1, x.shape[-1]), layer.packed_weight, n, bias)
        return y.view(*x.shape[:-1], n)


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] float32 → [ceil(N / 16), K, 16]: panel p holds output columns 16p .. 16p + 15 (rows past N
    zero), k-major, so that one panel is one contiguous run of memory."""
    n, k = w.shape
    p = -(-n // PANEL)
    if n % PANEL:
        padded = w.new_zeros(p * PANEL, k)
        padded[:n] = w
        w = padded
    return w.reshape(p, PANEL, k).transpose(1, 2).contiguous()


#: The float32 linear layout each kernel build runs fastest, measured with benchmarks/cpu_linear.py (SmolLM2-
#: 135M's 120 decoder linears streamed from memory, 2 threads: rows 1-32 are decode) and
#: benchmarks/offline_throughput.py (end to end), both printing the CPU they ran on:
#:   x86-64-v4, Intel Xeon (Emerald Rapids, AVX-512 + AMX), 2026-12-06: panels 1.2-1.4x oneDNN at 1-32 rows,
#:     0.8-1.0x at prefill's 256-2048 rows;
#:   x86-64-v3, AMD EPYC (AVX2 build): 1.6x oneDNN at 1 row, 1.8x at 5, 1.3x at 32, 0.85-1.18x at 2048;
#:   x86-64 (the portable build's scalar loops): 3-13x slower than oneDNN.
#: A level not listed (armv8-a) takes oneDNN's layout.
LAYOUT_BY_ISA = {"x86-64-v4": "panels", "x86-64-v3": "panels", "x86-64": "onednn"}


def packed_method() -> type[PrepackedLinearMethod] | None:
    """The packed layout this machine runs fastest (``LAYOUT_BY_ISA`` for the level of the kernels that
    loaded), else oneDNN's where torch has it, else None."""
    from ...attention import cpu_ext

    if LAYOUT_BY_ISA.get(cpu_ext.isa_level()) == "panels" and cpu_ext.load() is not None:
        return PanelLinearMethod
    return PrepackedLinearMethod if torch.backends.mkldnn.is_available() else None


def _packable(m: torch.nn.Module) -> bool:
    if type(m.quant_method) is not UnquantizedLinearMethod:  # quantized methods hold no float ``weight``
        return False
    w = m.weight
    return w is not None and w.dtype == torch.float32 and w.device.type == "cpu"


def prepack_linears(model: torch.nn.Module,
                    method: type[PrepackedLinearMethod] | None = None) -> tuple[int, int]:
    """Swap each unquantized float32 ``Linear`` of ``model`` to ``method`` (default ``packed_method()``),
    releasing its float weight, and give a tied LM head (``model.lm_head`` None) a packed copy of the
    embedding. Returns (linears packed, bytes of the tied head's extra copy); (0, 0) when no packed
    layout runs here."""
    method = method or packed_method()
    count, extra = 0, 0
    if method is None:
        return count, extra
    for m in model.modules():
        if type(m) is Linear and _packable(m):
            packed = method.pack(m.weight.detach())
            del m.weight
            m.register_parameter("weight", None)
            m.register_buffer("packed_weight", packed, persistent=False)
            m.quant_method = method()
            count += 1
    emb = getattr(model, "embed_tokens", None)
    if hasattr(model, "lm_head") and model.lm_head is None and isinstance(emb, VocabEmbedding) and _packable(emb):
        emb.register_buffer("packed_weight", method.pack(emb.weight.detach()), persistent=False)
        emb.quant_method = method()
        extra = emb.packed_weight.numel() * emb.packed_weight.element_size()
    return count, extra
