"""Float32 linears on the CPU through oneDNN with the weight prepacked once, after loading.

``F.linear`` on the CPU hands every call to MKL's GEMM, which re-packs the weight into its panel
layout on each call; at the few-row shapes of decode and draft verification (M = 1-32 rows against a
576 x 1536 weight) that packing costs as much as the arithmetic. oneDNN's inner-product primitive takes
a weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) and
multiplies with ``torch.ops.mkldnn._linear_pointwise`` — what vLLM's CPU backend and Inductor's
weight freezing do. Float32 in, float32 accumulation and out: greedy tokens are compared with the
unpacked path by tests/server/test_cpu_prepack.py (the sums are ordered differently: results agree to
float32 rounding, not bit for bit).

Applied to every unquantized float32 ``Linear`` when the engine runs eagerly on the CPU
(``EngineConfig.cpu_weight_prepack``, default on; torch.compile at level 3 traces the plain layers
instead); the float weight is released, so memory stays one copy. A tied LM head (``model.lm_head``
None: the vocabulary embedding projects the logits) gets a packed copy next to the float embedding
that row lookups read: + vocab x hidden x 4 bytes (113 MB for SmolLM2-135M), logged, for a logits
projection measured 2x faster at 32 rows and 3.5x at 5 (benchmarks/cpu_linear.py).
"""

from __future__ import annotations

import torch

from .embedding import VocabEmbedding
from .linear import Linear, UnquantizedLinearMethod


class PrepackedLinearMethod(UnquantizedLinearMethod):
    """y = x Wᵀ + b with W held as oneDNN's prepacked tensor ``layer.packed_weight`` [N, K] float32
    (an opaque ``torch._mkldnn`` layout). x: [T, K] float32 → [T, N] float32. Row lookups (a tied
    embedding's ``embedding``) read the float ``layer.weight``, kept only there."""

    name = "unquantized"

    def apply(self, layer, x, bias):
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, bias, "none", [], "")


def can_prepack() -> bool:
    return torch.backends.mkldnn.is_available()


def _packable(m: torch.nn.Module) -> bool:
    if type(m.quant_method) is not UnquantizedLinearMethod:  # quantized methods hold no float ``weight``
        return False
    w = m.weight
    return w is not None and w.dtype == torch.float32 and w.device.type == "cpu"


def prepack_linears(model: torch.nn.Module) -> tuple[int, int]:
    """Swap each unquantized float32 ``Linear`` of ``model`` to ``PrepackedLinearMethod``, releasing its
    float weight, and give a tied LM head (``model.lm_head`` None) a packed copy of the embedding.
    Returns (linears packed, bytes of the tied head's extra copy)."""
    count, extra = 0, 0
    for m in model.modules():
        if type(m) is Linear and _packable(m):
            packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach())
            del m.weight
            m.register_parameter("weight", None)
            m.register_buffer("packed_weight", packed, persistent=False)
            m.quant_method = PrepackedLinearMethod()
            count += 1
    emb = getattr(model, "embed_tokens", None)
    if hasattr(model, "lm_head") and model.lm_head is None and isinstance(emb, VocabEmbedding) and _packable(emb):
        emb.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(emb.weight.detach()),
                            persistent=False)
        emb.quant_method = PrepackedLinearMethod()
        extra = emb.weight.numel() * emb.weight.element_size()
    return count, extra
