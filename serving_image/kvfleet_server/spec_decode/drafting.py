"""The autoregressive drafting loop shared by model-based proposers (draft_model, layer_skip).

Each round runs one forward pass of the drafter over every sequence still drafting (round 0: the
sequence's uncomputed-for-the-drafter tokens ending with its last token; later rounds: the previous
draft), then picks each sequence's next draft from the drafter's logits: argmax for greedy requests
(one-hot q), else a sample from the drafter's distribution after temperature / top-k / top-p / min-p
(q, used by rejection sampling), drawn with the sequence's own generator.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..executor.model_runner import StepBatch
from ..sequence import TokenSpan
from ..sample.sampler import filter_probs, sample_from
from .proposer import DraftRequest, Drafts


def draft_autoregressive(reqs: list[DraftRequest], first_span: Callable[[DraftRequest], TokenSpan],
                         run: Callable[[list[TokenSpan]], StepBatch],
                         compute_logits: Callable[[StepBatch, list[int]], torch.Tensor]) -> list[Drafts]:
    """Draft up to ``r.num_drafts`` tokens per request.

    Args:
        first_span: the tokens round 0 computes for a request (must end with its last token, with
            ``logits="last"``: its logits come with the pass).
        run: the drafter's forward pass over spans (writes its KV), returning hidden states.
        compute_logits: (batch, rows) → [len(rows), vocab] float32 (``ModelRunner.compute_logits``: under
            tensor parallelism every rank computes its vocabulary shard of the same rows).
    """
    toks: list[list[int]] = [[] for _ in reqs]
    qs: list[list[torch.Tensor]] = [[] for _ in reqs]
    for rnd in range(max((r.num_drafts for r in reqs), default=0)):
        live = [i for i, r in enumerate(reqs) if len(toks[i]) < r.num_drafts]
        if not live:
            break
        spans = []
        for i in live:
            r = reqs[i]
            if rnd == 0:
                spans.append(first_span(r))
            else:
                spans.append(TokenSpan([toks[i][-1]], r.seq.num_computed_tokens + rnd, r.block_table, "last"))
        batch = run(spans)
        logits = compute_logits(batch, batch.last_row)
        rand = [j for j, i in enumerate(live) if not reqs[i].seq.request.params.greedy]
        greedy_next = logits.argmax(-1).tolist()
        probs = filter_probs(logits[rand], [reqs[live[j]].seq.request.params for j in rand]) if rand else None
        for j, i in enumerate(live):
            if probs is None or j not in rand:
                toks[i].append(greedy_next[j])
            else:
                q = probs[rand.index(j)]
                toks[i].append(int(sample_from(q, reqs[i].seq.generator)))
                qs[i].append(q)
    return [Drafts(t, torch.stack(q) if q else None) for t, q in zip(toks, qs)]
