"""The cost-aware acceptance cut-off of speculative decoding (issue 10: "no method slower than 0.95x"):
the break-even acceptance rate is the draft's cost plus the verification's, a method that cannot pay is
verified only on rare one-draft probes, and what one sequence learned applies to the next."""

from __future__ import annotations

import pytest

from kvfleet_server import SamplingParams
from kvfleet_server.engine.scheduler import DraftGate
from kvfleet_server.spec_decode.proposer import VERIFY_COST, decode_read_bytes

from engine_helpers import run_to_completion


def test_a_gate_that_cannot_pay_backs_off_long_and_probes_with_one_draft():
    g = DraftGate(min_acceptance=1.1, step=5)  # no acceptance rate can pay
    assert not g.open(5 + 255) and g.open(5 + 256) and g.num_drafts(4) == 1
    g.update(300, 1, 1)  # even a draft accepted is below a break-even above 1
    assert not g.open(300 + 255) and g.open(300 + 256) and g.num_drafts(4) == 1
    cheap = DraftGate(min_acceptance=0.5)
    cheap.update(1, 4, 0)
    assert cheap.open(9) and cheap.num_drafts(4) == 1
    cheap.update(9, 1, 1)  # a probe that pays: back to k drafts, short back-off
    assert cheap.num_drafts(4) == 4 and cheap.backoff == DraftGate.FIRST_BACKOFF


def test_draft_costs_follow_the_weights_read(tiny_engine_factory, tiny_llama_dir):
    eng = tiny_engine_factory(speculative_config={"method": "layer_skip", "num_speculative_tokens": 3,
                                                  "num_draft_layers": 1})
    m = eng.model
    head = decode_read_bytes(m, 0)
    full = decode_read_bytes(m)
    assert 0 < head < decode_read_bytes(m, 1) < full
    assert eng.proposer.draft_cost == pytest.approx(decode_read_bytes(m, 1) / full)
    assert eng.scheduler.spec_min_acceptance == pytest.approx(eng.proposer.draft_cost + VERIFY_COST["cpu"])
    ngram = tiny_engine_factory(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert ngram.proposer.draft_cost == 0.0
    assert ngram.scheduler.spec_min_acceptance == DraftGate.MIN_ACCEPTANCE  # the floor: 0.2 break-even


def test_a_full_size_draft_is_verified_only_on_rare_probes(tiny_engine_factory, tiny_llama_dir):
    # the target as its own draft: every draft accepted, yet each costs a whole decode step — no gain
    plain = tiny_engine_factory()
    eng = tiny_engine_factory(speculative_config={"method": "draft_model", "model": tiny_llama_dir,
                                                  "num_speculative_tokens": 3})
    assert eng.proposer.draft_cost == pytest.approx(1.0)
    outs, verified = [], []
    for e in (plain, eng):
        e.add_request("x", [9, 10, 11, 12], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
        count = []
        outs.append(run_to_completion(e, on_step=lambda e: count.append(e.last_iteration.num_draft_tokens))
                    ["x"].outputs[0].token_ids)
        verified.append(count)
    assert outs[0] == outs[1]
    drafted = [c for c in verified[1] if c]  # one one-draft probe per 256 steps
    assert drafted == [1], drafted


def test_a_new_sequence_starts_with_a_probe_after_low_acceptance(spec_break_even_floor, tiny_engine_factory,
                                                                tiny_qwen2_dir):
    # a draft model that disagrees with the target (break-even at the 30 % floor: k drafts at first)
    eng = tiny_engine_factory(speculative_config={"method": "draft_model", "model": tiny_qwen2_dir,
                                                  "num_speculative_tokens": 3})
    eng.add_request("first", [5, 6, 7] * 6, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    run_to_completion(eng)
    assert eng.scheduler.spec_acceptance_ema < DraftGate.MIN_ACCEPTANCE
    eng.add_request("next", [5, 6, 7] * 6, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    counts = []
    run_to_completion(eng, on_step=lambda e: counts.append(e.last_iteration.num_draft_tokens))
    assert [c for c in counts if c][:1] == [1]


def test_min_acceptance_overrides_the_cost_model(tiny_engine_factory, tiny_llama_dir):
    always = tiny_engine_factory(speculative_config={"method": "draft_model", "model": tiny_llama_dir,
                                                     "num_speculative_tokens": 3, "min_acceptance": 0})
    assert always.scheduler.spec_min_acceptance == 0.0
    always.add_request("x", [9, 10, 11, 12], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    counts = []
    run_to_completion(always, on_step=lambda e: counts.append(e.last_iteration.num_draft_tokens))
    assert sum(1 for c in counts if c) >= 5  # drafts every decode step (the target agrees with itself)
    for bad in (-0.1, 1.5, "high", True):
        with pytest.raises(ValueError, match=r"speculative_config.min_acceptance must be a number in \[0, 1\]"):
            tiny_engine_factory(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                    "min_acceptance": bad})
