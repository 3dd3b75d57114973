"""Must-show 6 (issue 37), unit part: top-k keeps exactly k tokens with ties broken by the lowest token id,
as argmax breaks them, on every sampler path (plain sampling, the speculative drafter's filter and
verification). Logits here have exact ties, as bfloat16 logits often do."""

from __future__ import annotations

import torch

from kvfleet_server import SamplingParams
from kvfleet_server.sample.rejection import VerifySpan, verify
from kvfleet_server.sample.sampler import SampleRow, filter_probs, sample

TIED = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 2.0, -1.0],
                     [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5],
                     [4.0, 1.0, 4.0, 1.0, 1.0, 1.0, 0.0]])


def _row(params: SamplingParams, seed: int | None = None) -> SampleRow:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SampleRow(params, [0], [], gen, [])


def test_top_k_keeps_exactly_k_lowest_ids_win():
    kept = lambda k: [set(torch.nonzero(r).flatten().tolist()) for r in  # noqa: E731
                      filter_probs(TIED.clone(), [SamplingParams(temperature=1.0, top_k=k)] * 3)]
    assert kept(1) == [{1}, {0}, {0}]
    assert kept(2) == [{1, 2}, {0, 1}, {0, 2}]
    assert kept(3) == [{1, 2, 4}, {0, 1, 2}, {0, 2, 1}]
    assert kept(4) == [{1, 2, 4, 3}, {0, 1, 2, 3}, {0, 2, 1, 3}]  # 3 and 5 tie at the 4th value: 3 wins
    assert kept(1) == [{i} for i in TIED.argmax(-1).tolist()]


def test_top_p_cut_inside_a_tie_keeps_the_lowest_ids():
    probs = filter_probs(TIED[1:2].clone(), [SamplingParams(temperature=1.0, top_p=0.3)])[0]
    assert torch.nonzero(probs).flatten().tolist() == [0, 1, 2]  # 3 x 1/7 reach 0.3; ids 0..2


def test_top_k_1_samples_the_argmax_for_every_seed():
    greedy = sample(TIED.clone(), [_row(SamplingParams(temperature=0.0))] * 3)[0]
    assert greedy == TIED.argmax(-1).tolist() == [1, 0, 0]
    for seed in range(50):
        for temp in (0.5, 1.0, 2.0):
            p = SamplingParams(temperature=temp, top_k=1, seed=seed)
            assert sample(TIED.clone(), [_row(p, seed + i) for i in range(3)])[0] == greedy


def test_bfloat16_logits_top_k_1_equals_argmax():
    """Random logits rounded to bfloat16 (a 49k vocabulary: SmolLM2's), many rows tie at the top."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(128, 49152, generator=g) * 3).to(torch.bfloat16).float()
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] == top2[:, 1]).sum() >= 3  # the case under test does occur
    p = SamplingParams(temperature=1.0, top_k=1)
    got = sample(logits.clone(), [_row(p, s) for s in range(128)])[0]
    assert got == logits.argmax(-1).tolist()


def test_verification_with_top_k_1_follows_argmax_through_ties():
    """A draft that is one of the tied top tokens but not the lowest id is rejected and replaced by the
    argmax; drafts equal to the argmax are accepted and the bonus token is the argmax."""
    logits = TIED.clone()  # rows: position 0, 1, bonus
    argmax = TIED.argmax(-1).tolist()  # [1, 0, 0]
    for seed in range(20):
        for drafts, want in (([argmax[0], argmax[1]], argmax), ([4, 0], [1]), ([1, 2], [1, 0])):
            p = SamplingParams(temperature=1.0, top_k=1, seed=seed)
            gen = torch.Generator().manual_seed(seed)
            rows = [SampleRow(p, [0], drafts[:j], gen, []) for j in range(3)]
            res = verify(logits.clone(), [VerifySpan(rows, drafts)])[0]
            assert res.token_ids == want
            g = SamplingParams(temperature=0.0)
            greedy = verify(logits.clone(), [VerifySpan([SampleRow(g, [0], drafts[:j], None, [])
                                                          for j in range(3)], drafts)])[0]
            assert greedy.token_ids == res.token_ids
