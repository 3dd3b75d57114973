"""The Proposer interface: how the engine asks a speculative method for draft tokens.

Each step the scheduler reserves KV slots for up to k drafts per decoding sequence; the engine then
asks the proposer for drafts (``propose``), the runner computes the target's logits at the last token
and every draft in one pass, and sample/rejection.py accepts a prefix of them (rejection sampling:
Leviathan et al. 2023, Chen et al. 2023).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..engine.scheduler import Sequence


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


class Proposer(ABC):
    """A speculative method. ``extra_kv_bytes_per_token`` is KV memory the method keeps per token in
    the shared block pool (a draft model's own cache), so that the pool is sized for both."""

    extra_kv_bytes_per_token: int = 0

    @abstractmethod
    def propose(self, reqs: list[DraftRequest]) -> list[Drafts]:
        """Drafts for each request, in order."""

    def bind(self, runner) -> None:
        """Called once the target's ModelRunner (and so the block pool size) exists."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of the method's own KV blocks (same block ids as the target's)."""
