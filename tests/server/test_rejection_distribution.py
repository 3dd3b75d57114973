"""Must-show 5 (issue 37), speculative verification itself (sample/rejection.py): for fixed target
distributions p_j and draft distributions q_j, every draft length k = 1..3 and every position j = 0..k
(j = k: the bonus token after all drafts are accepted), the token emitted at position j, among the runs
that reach it, is distributed as p_j (chi-square), and a draft at position j is accepted with probability
sum_x min(p_j(x), q_j(x)) (Leviathan et al. 2023, Theorem 3.5 / Chen et al. 2023). Positive controls: each
broken rule (resample from p after a rejection, a wrong acceptance ratio, a greedy bonus token) fails."""

from __future__ import annotations

import pytest
import torch

from kvfleet_server import SamplingParams
from kvfleet_server.sample import rejection
from kvfleet_server.sample.sampler import SampleRow

V = 6
N = 12_000
ALPHA = 1e-4
P = torch.tensor([[0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
                  [0.05, 0.10, 0.40, 0.05, 0.30, 0.10],
                  [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
                  [0.10, 0.05, 0.05, 0.30, 0.20, 0.30]], dtype=torch.float64)
Q = torch.tensor([[0.10, 0.40, 0.10, 0.30, 0.05, 0.05],
                  [0.30, 0.10, 0.20, 0.20, 0.10, 0.10],
                  [0.05, 0.05, 0.50, 0.20, 0.10, 0.10]], dtype=torch.float64)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    exp = probs * counts.sum()
    stat = ((counts.double() - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2.0, dtype=torch.float64), stat / 2))


def _run(k: int, seed: int = 0):
    """Emitted tokens per position [k + 1, V] counts and accepted-draft counts per position."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(Q[j].float(), N, replacement=True, generator=g) for j in range(k)], 1)
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(seed + 1)
    spans = [rejection.VerifySpan([SampleRow(params, [0], [], gen, [])] * (k + 1), d, Q[:k].float())
             for d in drafts.tolist()]
    logits = P[: k + 1].log().float().repeat(N, 1)
    counts = torch.zeros(k + 1, V, dtype=torch.long)
    accepted = torch.zeros(k, dtype=torch.long)
    for res in rejection.verify(logits, spans):
        for j, t in enumerate(res.token_ids):
            counts[j, t] += 1
        accepted[: res.num_accepted] += 1
    return counts, accepted


def _worst_pvalue(k: int) -> tuple[float, dict]:
    counts, accepted = _run(k)
    pvals = {}
    reached = N
    for j in range(k + 1):
        assert counts[j].sum() == reached
        pvals[f"position {j}"] = _chi2_pvalue(counts[j], P[j])
        if j < k:
            a = float((torch.minimum(P[j], Q[j])).sum())  # acceptance probability
            pvals[f"accept {j}"] = _chi2_pvalue(torch.tensor([accepted[j], reached - accepted[j]]),
                                                torch.tensor([a, 1 - a], dtype=torch.float64))
            reached = int(accepted[j])
    return min(pvals.values()), pvals


@pytest.mark.parametrize("k", [1, 2, 3])
def test_every_position_and_the_bonus_token_follow_the_target(k):
    worst, pvals = _worst_pvalue(k)
    assert worst > ALPHA, pvals


BROKEN = {
    "resample from p after a rejection": ("residual_distribution", lambda p, q: p),
    "accept with q/p instead of p/q": ("accept_probability", lambda p_x, q_x: torch.clamp(q_x / p_x, max=1.0)),
    "accept with p alone": ("accept_probability", lambda p_x, q_x: p_x),
}


@pytest.mark.parametrize("rule", list(BROKEN))
def test_broken_rule_is_detected(rule, monkeypatch):
    name, fn = BROKEN[rule]
    monkeypatch.setattr(rejection, name, fn)
    assert _worst_pvalue(3)[0] < ALPHA


def test_greedy_bonus_token_is_detected(monkeypatch):
    """The bonus token drawn as argmax(p_k) instead of from p_k: the bonus position fails."""
    real = rejection.sample_from
    monkeypatch.setattr(rejection, "sample_from",
                        lambda p, g: p.argmax() if torch.allclose(p.double(), P[2]) else real(p, g))
    _, pvals = _worst_pvalue(2)
    assert pvals["position 2"] < ALPHA and pvals["position 0"] > ALPHA
