"""Batched token sampling with per-request parameters (runs on the model's device).

Order of operations per row (as in vLLM): raw log-probabilities (returned as logprobs) → grammar
bitmask of structured output (sample/grammar.py) → penalties (repetition: CTRL paper / HF, presence
and frequency: OpenAI) → min_tokens masking of EOS and stop_token_ids (unless the grammar allows
nothing else) → greedy argmax, or temperature → top-k → top-p → min-p → sampling with the row's
own ``torch.Generator`` (exponential race: argmax(p / q), q ~ Exp(1)), so a seeded request draws the
same numbers whatever else is in the batch.

Ties: logits are compared in float32 and every path breaks ties by the lowest token id, as
``torch.argmax`` does: top-k keeps exactly k tokens (a stable descending sort, not "every token at least
the k-th value"), so ``top_k=1`` is greedy argmax whatever the temperature. In bfloat16, exact ties
between the top logits are frequent (vLLM issue 5404 is the same bug).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling_params import SamplingParams
from .grammar import apply_bitmask


@dataclass
class SampleRow:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    stop_ids_for_min_tokens: list[int]


@dataclass
class TokenLogprobs:
    """Log-probability data of one sampled token: (chosen logprob, rank) and the top-k entries."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """In place on the rows that ask for a penalty; other rows are untouched. logits: [N, V]."""
    V = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(V, dtype=torch.bool, device=logits.device)
            ids = r.prompt_ids + r.output_ids
            if ids:
                seen[torch.tensor(ids, device=logits.device)] = True
            row = logits[i]
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            logits[i] = torch.where(seen, penalized, row)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and r.output_ids:
            counts = torch.bincount(torch.tensor(r.output_ids, device=logits.device), minlength=V)[:V]
            counts = counts.to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on rows that sample; returns float32 probabilities [M, V] (rows sum
    to 1). top-k keeps exactly k tokens and top-p a prefix of the same order: ties at the cut are broken by
    the lowest token id (a stable sort), as argmax breaks them, so ``top_k=1`` is argmax."""
    dev = logits.device
    logits = logits.float()
    temps = torch.tensor([p.temperature for p in params], device=dev, dtype=logits.dtype)
    logits = logits / temps[:, None]
    top_ks = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_ps = [p.top_p for p in params]
    if any(top_ks) or any(tp < 1.0 for tp in top_ps):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)
        V = logits.shape[1]
        keep = torch.ones_like(sorted_logits, dtype=torch.bool)
        if any(top_ks):
            k = torch.tensor([k if k else V for k in top_ks], device=dev)
            keep &= torch.arange(V, device=dev)[None, :] < k[:, None]
        if any(tp < 1.0 for tp in top_ps):
            probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(-1)
            cum = probs.cumsum(-1)
            tp = torch.tensor(top_ps, device=dev, dtype=probs.dtype)
            keep &= (cum - probs) < tp[:, None]  # keep the smallest prefix whose mass reaches top_p
            keep[:, 0] = True
        sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)
    probs = logits.softmax(-1)
    min_ps = [p.min_p for p in params]
    if any(mp > 0 for mp in min_ps):
        mp = torch.tensor(min_ps, device=dev, dtype=probs.dtype)
        probs = probs.masked_fill(probs < mp[:, None] * probs.max(-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)  # a distribution again (rejection sampling divides p by q)
    return probs


def sample(logits: torch.Tensor, rows: list[SampleRow],
           grammar_bitmask: tuple[torch.Tensor, list[int]] | None = None
           ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Choose one token per row.

    Args:
        logits: [N, V] float32 (modified in place).
        rows: per row parameters and history.
        grammar_bitmask: (int32 [N, ceil(V / 32)] bitmask, rows it applies to) for structured output.
    Returns:
        token ids (N ints) and, for rows asking for logprobs, TokenLogprobs (raw model log-probs).
    """
    want_lp = [r.params.logprobs is not None for r in rows]
    raw_lp = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
    process_logits(logits, rows, grammar_bitmask)

    tokens = logits.argmax(dim=-1)
    rand_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
    if rand_idx:
        probs = filter_probs(logits[rand_idx], [rows[i].params for i in rand_idx])
        chosen = [sample_from(probs[j], rows[i].generator) for j, i in enumerate(rand_idx)]
        tokens[torch.tensor(rand_idx, device=logits.device)] = torch.stack(chosen)
    return tokens.tolist(), token_logprobs(raw_lp, tokens, rows)


def process_logits(logits: torch.Tensor, rows: list[SampleRow], grammar_bitmask=None) -> torch.Tensor:
    """Grammar mask, penalties and min_tokens masking, in place. logits: [N, V] float32;
    ``grammar_bitmask``: (bitmask, rows) of the rows under a grammar, or None."""
    if grammar_bitmask is not None:
        apply_bitmask(logits, *grammar_bitmask)
    if any(r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
           for r in rows):
        apply_penalties(logits, rows)
    grammar_rows = set(grammar_bitmask[1]) if grammar_bitmask is not None else set()
    for i, r in enumerate(rows):
        if r.stop_ids_for_min_tokens and len(r.output_ids) < r.params.min_tokens:
            stop = torch.tensor(r.stop_ids_for_min_tokens, device=logits.device)
            kept = logits[i, stop].clone() if i in grammar_rows else None
            logits[i, stop] = float("-inf")
            if kept is not None and not torch.isfinite(logits[i]).any():  # the grammar allows only a stop
                logits[i, stop] = kept                                      # token: it wins
    return logits


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id (0-dim tensor) drawn from ``probs`` [V] (unnormalised is fine) with the row's generator.
    q is kept above 0 (``exponential_`` may return 0): 0 / 0 would be NaN, which argmax picks."""
    q = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return (probs / q).argmax()


def token_logprobs(raw_lp: torch.Tensor | None, tokens: torch.Tensor,
                   rows: list[SampleRow]) -> list[TokenLogprobs | None]:
    """Logprob, rank and top entries of each row's chosen token (rows asking for logprobs)."""
    N = len(rows)
    want_lp = [r.params.logprobs is not None for r in rows]
    lps: list[TokenLogprobs | None] = [None] * N
    if raw_lp is not None:
        idx = [i for i in range(N) if want_lp[i]]
        k = max(rows[i].params.logprobs for i in idx)
        sub = raw_lp[idx]
        chosen_t = tokens[idx]
        chosen_lp = sub.gather(1, chosen_t[:, None]).squeeze(1)
        ranks = (sub > chosen_lp[:, None]).sum(-1) + 1
        top_v, top_i = sub.topk(k, dim=-1) if k > 0 else (None, None)
        chosen_lp, ranks = chosen_lp.tolist(), ranks.tolist()
        top_v = top_v.tolist() if k > 0 else None
        top_i = top_i.tolist() if k > 0 else None
        for j, i in enumerate(idx):
            kk = rows[i].params.logprobs
            lps[i] = TokenLogprobs(
                chosen_lp[j], ranks[j], top_i[j][:kk] if kk else [], top_v[j][:kk] if kk else []
            )
    return lps


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> list[TokenLogprobs]:
    """Log-probs of the actual next prompt tokens. logits: [L, V] rows at positions p; next_ids[p]
    is the prompt token at p + 1."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    nxt = torch.tensor(next_ids, device=lp.device)
    chosen = lp.gather(1, nxt[:, None]).squeeze(1)
    ranks = ((lp > chosen[:, None]).sum(-1) + 1).tolist()
    chosen = chosen.tolist()
    if k > 0:
        tv, ti = lp.topk(k, dim=-1)
        tv, ti = tv.tolist(), ti.tolist()
    else:
        tv = ti = [[] for _ in next_ids]
    return [TokenLogprobs(chosen[j], ranks[j], ti[j], tv[j]) for j in range(len(next_ids))]
