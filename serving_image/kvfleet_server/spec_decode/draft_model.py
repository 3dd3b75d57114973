"""A separate, smaller draft model with the same tokenizer (vLLM's ``draft_model`` method).

Its KV cache is its own set of tensors with the same block geometry as the target's and the same
block ids: a sequence's blocks hold the target's and the draft's K/V of the same positions, so the
draft's memory is in the one block-pool accounting (the pool is sized for both: per-token bytes add
up) and is freed with the sequence. ``Sequence.num_draft_computed`` tracks how many leading
positions hold draft KV: the first proposal of a sequence (and after a preemption) computes the
draft's KV of the whole prefix; rollback of rejected drafts clamps it to the verified length.
"""

from __future__ import annotations

from ..executor.model_runner import ModelRunner, kv_bytes_per_token
from ..sequence import TokenSpan
from .drafting import draft_autoregressive
from .proposer import DraftRequest, Drafts, Proposer


class DraftModelProposer(Proposer):
    def __init__(self, model, model_config, dtype, device: str):
        self.model = model
        self.dtype = dtype
        self.device = device
        self.backend = None  # the target's attention backend, set by bind()
        c = model_config
        self.extra_kv_bytes_per_token = kv_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads,
                                                           c.head_dim, dtype)
        self.runner: ModelRunner | None = None

    def bind(self, runner: ModelRunner) -> None:
        self.backend = runner.backend  # the target's attention backend (--attention-backend)
        self.runner = ModelRunner(self.model, runner.num_blocks, runner.block_size, self.device, self.dtype,
                                  self.backend)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(copies)

    def propose(self, reqs: list[DraftRequest]) -> list[Drafts]:
        def first(r: DraftRequest) -> TokenSpan:
            seq = r.seq
            p = seq.num_computed_tokens
            start = min(seq.num_draft_computed, p)
            return TokenSpan(seq.token_ids[start:p + 1], start, r.block_table, "last")

        out = draft_autoregressive(reqs, first, self.runner.execute, self.runner.compute_logits)
        for r, d in zip(reqs, out):
            # draft KV now covers the last token and every draft but the final one
            r.seq.num_draft_computed = r.seq.num_computed_tokens + max(len(d.token_ids), 1)
        return out
