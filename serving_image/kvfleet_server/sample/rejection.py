"""Verification of draft tokens (speculative decoding), lossless for greedy and random sampling.

Given the target's logits at a sequence's last token and at each of its k drafts (k + 1 rows), every
row is first turned into the target distribution p exactly as the plain sampler would at that position
(penalties over the output so far plus the drafts before the position, min_tokens masking, then
temperature / top-k / top-p / min-p: sampler.process_logits + filter_probs). Then:

- greedy: accept drafts while each equals the argmax of its row; the first mismatch is replaced by
  the argmax; when all k are accepted the last row's argmax is a bonus token;
- random (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et
  al. 2023): accept draft x with probability min(1, p(x) / q(x)); on rejection sample from
  norm(max(p − q, 0)) and stop; all accepted → sample a bonus token from the last row's p. The output
  is distributed exactly as sampling from p token by token. Deterministic drafts (n-gram, greedy
  drafters) have one-hot q.

Random numbers come from each sequence's own generator, so a seeded request is reproducible whatever
else is batched. Logprobs are the raw model log-probabilities of each emitted token (as in sampler.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampler import SampleRow, TokenLogprobs, filter_probs, process_logits, sample_from, token_logprobs


@dataclass
class VerifySpan:
    """One sequence's rows in the verification logits.

    Attributes:
        rows: k + 1 SampleRows, one per position (row j's history includes drafts[:j]).
        draft_ids: the k drafts.
        draft_probs: [k, V] draft distribution q, or None for one-hot (deterministic) drafts.
    """

    rows: list[SampleRow]
    draft_ids: list[int]
    draft_probs: torch.Tensor | None = None


@dataclass
class VerifyResult:
    """token_ids: accepted drafts then one target token (len = num_accepted + 1); logprobs aligned."""

    token_ids: list[int]
    num_accepted: int
    logprobs: list[TokenLogprobs | None]


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p − q, 0)) — where to sample from after a rejection. p, q: [V]. Falls back to p when
    p ≤ q everywhere (then a rejection has probability 0 anyway)."""
    r = (p - q).clamp_min(0)
    s = r.sum()
    return r / s if s > 0 else p


def accept_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for the drafted token x (q(x) > 0 since x was drawn from q)."""
    return torch.clamp(p_x / q_x, max=1.0)


def verify(logits: torch.Tensor, spans: list[VerifySpan]) -> list[VerifyResult]:
    """Accept a prefix of each span's drafts.

    Args:
        logits: [sum(k_i + 1), V] float32 target logits, spans' rows back to back (modified in place).
        spans: one per sequence.
    Returns:
        one VerifyResult per span.
    """
    rows = [r for sp in spans for r in sp.rows]
    assert logits.shape[0] == len(rows)
    want_lp = any(r.params.logprobs is not None for r in rows)
    raw_lp = torch.log_softmax(logits, dim=-1) if want_lp else None
    process_logits(logits, rows)
    argmax = logits.argmax(dim=-1)
    rand = [i for i, r in enumerate(rows) if not r.params.greedy]
    probs = filter_probs(logits[rand], [rows[i].params for i in rand]) if rand else None
    prob_row = {i: j for j, i in enumerate(rand)}
    argmax_l = argmax.tolist()

    chosen: list[int] = []
    results: list[tuple[int, int]] = []  # (first row, num emitted)
    start = 0
    for sp in spans:
        k = len(sp.draft_ids)
        greedy = sp.rows[0].params.greedy
        gen = sp.rows[0].generator
        out: list[int] = []
        for j in range(k + 1):
            row = start + j
            if greedy:
                tok = argmax_l[row]
                out.append(tok)
                if j < k and tok == sp.draft_ids[j]:
                    continue
                break
            p = probs[prob_row[row]]
            if j == k:  # every draft accepted: the bonus token
                out.append(int(sample_from(p, gen)))
                break
            x = sp.draft_ids[j]
            if sp.draft_probs is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            else:
                q = sp.draft_probs[j].to(p.dtype)
            u = torch.rand((), generator=gen, device=p.device)
            if u < accept_probability(p[x], q[x]):
                out.append(x)
                continue
            out.append(int(sample_from(residual_distribution(p, q), gen)))
            break
        results.append((start, len(out)))
        chosen.extend(out)
        start += k + 1

    # logprobs of the emitted tokens at their rows
    lp_rows = [s + j for s, n in results for j in range(n)]
    lps_flat: list[TokenLogprobs | None] = [None] * len(lp_rows)
    if raw_lp is not None:
        idx = torch.tensor(lp_rows, device=logits.device)
        lps_flat = token_logprobs(raw_lp[idx], torch.tensor(chosen, device=logits.device),
                                  [rows[i] for i in lp_rows])
    res, pos = [], 0
    for (s, n) in results:
        res.append(VerifyResult(chosen[pos : pos + n], n - 1, lps_flat[pos : pos + n]))
        pos += n
    return res
