"""The Proposer interface: how the engine asks a speculative method for draft tokens.

Each step the scheduler reserves KV slots for up to k drafts per decoding sequence; the engine then
asks the proposer for drafts (``propose``), the runner computes the target's logits at the last token
and every draft in one pass, and sample/rejection.py accepts a prefix of them (rejection sampling:
Leviathan et al. 2023, Chen et al. 2023).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..sequence import Sequence


@dataclass
class DraftRequest:
    """One decoding sequence asking for drafts.

    Attributes:
        seq: the sequence; its last token (position ``seq.num_computed_tokens``) has no KV yet.
        num_drafts: most draft tokens wanted (KV slots for them are allocated).
        block_table: the sequence's block ids (valid for positions < num_computed_tokens + 1 + num_drafts).
    """

    seq: Sequence
    num_drafts: int
    block_table: list[int]


@dataclass
class Drafts:
    """Draft tokens of one sequence.

    Attributes:
        token_ids: at most ``num_drafts`` proposed tokens (possibly none).
        probs: [len(token_ids), vocab] float32 draft distribution q each token was sampled from, or
            None when the drafts are deterministic (one-hot q: n-gram and greedy drafts).
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None


#: extra cost of one more token in the target's verification pass, relative to a 1-token decode step.
#: CPU: measured on SmolLM2-135M fp32, 2 threads, one sequence over 250 cached tokens
#: (benchmarks/spec_step_cost.py, 2026-12-04, with the span attention kernel): 1 + 4 tokens 1.17x a
#: 1-token pass, 1 + 8 tokens 1.51x, 1 + 16 tokens 2.0x — 0.04-0.07 per draft from 2 drafts on, 0.09-0.11
#: for a single draft; 0.1 keeps a margin (an ad-hoc replay priced by the measured table, not kept,
#: found the gate's choices at 0.1 as good as with the table: docs/spec_decode.md). At
#: batch 8 a draft per sequence costs ~0.34 of the batch's step (the linears are compute-bound past ~8
#: rows), which disable_by_batch_size covers. CUDA: a decode step is bound by reading the weights, extra
#: rows are nearly free at small batch (vLLM/SGLang measurements put it at a few percent).
VERIFY_COST = {"cpu": 0.1, "cuda": 0.05}


def break_even_acceptance(draft_cost: float, device: str) -> float:
    """Fraction of drafts that must be accepted for speculation to pay (see spec_decode/gate.py DraftGate)."""
    return draft_cost + VERIFY_COST.get(device, VERIFY_COST["cpu"])


def decode_read_bytes(model: torch.nn.Module, num_layers: int | None = None) -> int:
    """Weight bytes a decode step of ``model`` reads: its first ``num_layers`` decoder layers (all when
    None), the final norm and the LM head (the tied embedding when there is no separate head)."""
    from ..model.layers.quant import model_weight_bytes

    layers = model.layers if num_layers is None else model.layers[:num_layers]
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    return sum(model_weight_bytes(m) for m in layers) + model_weight_bytes(model.norm) + model_weight_bytes(head)


def config_read_bytes(cfg, itemsize: int) -> int:
    """What ``decode_read_bytes`` gives for a model of ``cfg`` (a ModelConfig) loaded with ``itemsize``-byte
    float weights, from the architecture's parameter shapes alone (``checkpoint.expected_shapes``) — before any
    weight is loaded: every parameter but the embedding, which only a tied model reads (as its LM head).
    An FP8 checkpoint (``cfg.checkpoint_quantization == "fp8"``) stores the decoder projections as 1-byte
    codes plus one float32 scale per output row."""
    from ..model.checkpoint import expected_shapes

    fp8 = cfg.checkpoint_quantization == "fp8"
    total = 0
    for name, shape in expected_shapes(cfg).items():
        if name == "embed_tokens.weight" and not cfg.tie_word_embeddings:
            continue
        if fp8 and name.startswith("layers.") and name.endswith("_proj.weight"):
            total += math.prod(shape) + 4 * shape[0]
        else:
            total += itemsize * math.prod(shape)
    return total


class Proposer(ABC):
    """A speculative method.

    Attributes:
        extra_kv_bytes_per_token: KV memory the method keeps per token in the shared block pool (a draft
            model's own cache), so that the pool is sized for both.
    """

    extra_kv_bytes_per_token: int = 0

    @abstractmethod
    def propose(self, reqs: list[DraftRequest]) -> list[Drafts]:
        """Drafts for each request, in order."""

    def bind(self, runner) -> None:
        """Called once the target's ModelRunner (and so the block pool size) exists."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of the method's own KV blocks (same block ids as the target's)."""
