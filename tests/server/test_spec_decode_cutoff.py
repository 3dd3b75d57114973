"""The cost-aware acceptance cut-off and the scheduling of drafts (issue 10: "no method slower than 0.95x";
drafts never cost another sequence its step): the break-even acceptance rate is the draft's cost plus the
verification's, a method that cannot pay does not speculate, probes verify one draft, what one sequence
learned applies to the next, and drafts come from what is left after every running sequence's own token."""

from __future__ import annotations

import pytest
import torch

from kvfleet_server import SamplingParams
from kvfleet_server.sequence import Request, Sequence
from kvfleet_server.spec_decode.gate import DraftGate
from kvfleet_server.model.loader import load_model, load_model_config
from kvfleet_server.spec_decode import draft_cost
from kvfleet_server.spec_decode_config import SpeculativeConfig
from kvfleet_server.spec_decode.proposer import VERIFY_COST, break_even_acceptance, config_read_bytes, decode_read_bytes

from engine_helpers import assert_all_blocks_free, run_to_completion
from spec_helpers import greedy_with_step_counts

FLOOR = {"min_acceptance": 0.3}  # a 0.3 cut-off: the tiny model's drafts cost about a whole step: keep them drafting


def test_a_probe_verifies_one_draft_and_only_a_full_verification_resets_the_back_off():
    g = DraftGate(min_acceptance=0.5)
    assert g.open(0) and g.num_drafts(4) == 4
    g.update(1, 4, 0)
    assert not g.open(8) and g.open(9) and g.num_drafts(4) == 1
    g.update(9, 1, 0)  # a failed probe doubles the back-off
    assert not g.open(24) and g.open(25) and g.backoff == 32
    g.update(25, 1, 1)  # a probe that pays brings k drafts back, the back-off stays
    assert g.num_drafts(4) == 4 and g.backoff == 32
    g.update(26, 4, 4)  # a full verification that pays resets it
    assert g.backoff == DraftGate.FIRST_BACKOFF


def expected_speedup(a: float, g: int, c: float) -> float:
    """Leviathan et al. 2023, eq. for the expected tokens per step over its cost, for γ = g drafts."""
    return (1 - a ** (g + 1)) / ((1 - a) * (1 + g * c))


def test_the_draft_length_grows_on_verbatim_copies_and_shrinks_when_drafts_are_rejected():
    g = DraftGate(min_acceptance=0.3, token_cost=0.1)
    first = g.num_drafts(16)
    assert 1 < first < 16  # the prior (3 of 4) does not bet on 16 drafts
    lengths = []
    for step in range(1, 4):  # every draft accepted: the estimate climbs, the length with it
        d = g.num_drafts(16)
        g.update(step, d, d)
        lengths.append(g.num_drafts(16))
    assert lengths == sorted(lengths) and lengths[-1] == 16 and lengths[0] > first
    # the copy ends: one draft of each verification accepted shortens the drafts, then the cut-off closes
    d = g.num_drafts(16)
    g.update(4, d, 1)
    assert g.open(5) and g.num_drafts(16) < 16
    # the chosen length is the formula's argmax for the gate's estimate
    a = g.alpha
    assert g.num_drafts(16) == max(range(1, 17), key=lambda n: expected_speedup(a, n, 0.1))
    g.update(5, g.num_drafts(16), 1)
    assert not g.open(6)


def test_a_free_draft_token_always_verifies_k():
    g = DraftGate(min_acceptance=0.3, token_cost=0.0)
    g.update(1, 4, 2)
    assert g.num_drafts(4) == 4 and g.num_drafts(16) == 16


def test_engine_drafts_grow_to_k_while_every_draft_is_accepted(tiny_engine_factory, tiny_llama_dir):
    """A sequence whose drafts are all accepted (the draft model is the target) verifies more drafts per
    step than its first verification did, up to k, with the plain engine's output."""
    eng = tiny_engine_factory(speculative_config={"method": "draft_model", "model": tiny_llama_dir,
                                                  "num_speculative_tokens": 8, **FLOOR})
    assert eng.spec.token_cost == pytest.approx(0.3)
    plain = tiny_engine_factory()
    out_plain, _ = greedy_with_step_counts(plain, [9, 10, 11, 12], 60)
    out, drafted = greedy_with_step_counts(eng, [9, 10, 11, 12], 60)
    assert out == out_plain
    counts = [c for c in drafted if c]
    assert 1 < counts[0] < 8 and 8 in counts and counts[:counts.index(8)] == sorted(counts[:counts.index(8)])
    assert_all_blocks_free(eng)


def test_draft_costs_follow_the_weights_read(tiny_engine_factory):
    m = tiny_engine_factory().model
    assert 0 < decode_read_bytes(m, 0) < decode_read_bytes(m, 1) < decode_read_bytes(m)
    layer_skip = SpeculativeConfig.from_dict({"method": "layer_skip", "num_draft_layers": 1,
                                              "num_speculative_tokens": 3})
    cfg = tiny_engine_factory().model_config
    assert draft_cost(layer_skip, m, cfg, torch.float32, 64) == pytest.approx(
        decode_read_bytes(m, 1) / decode_read_bytes(m))
    ngram = tiny_engine_factory(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert draft_cost(ngram.spec_config, m, cfg, torch.float32, 64) == 0.0
    assert ngram.spec.min_acceptance == DraftGate.MIN_ACCEPTANCE  # the floor over a 0.1 break-even
    assert VERIFY_COST["cpu"] < DraftGate.MIN_ACCEPTANCE


def test_a_gguf_drafts_config_is_read_from_its_header_alone(gguf_path, monkeypatch):
    # the draft's cost is known without reading a tensor: no GGUF cache entry, no weights
    from kvfleet_server.model import gguf_cache, gguf_reader

    want = gguf_reader.GGUFModelFile(gguf_path).config

    def no_tensors(*a, **kw):
        raise AssertionError("tensors were read")

    monkeypatch.setattr(gguf_cache, "load", no_tensors)
    monkeypatch.setattr(gguf_reader, "read_gguf_tensors", no_tensors)
    assert load_model_config(gguf_path) == want


def test_an_fp8_drafts_cost_counts_its_stored_bytes(tiny_llama_dir, tmp_path):
    from kvfleet_server.quantize.cli import main as quantize_main

    out = str(tmp_path / "fp8")
    assert quantize_main(["--model", tiny_llama_dir, "--output", out, "--rounding", "rtn"]) == 0
    model, _ = load_model(out, torch.bfloat16, "cpu")
    cfg = load_model_config(out)
    assert cfg.checkpoint_quantization == "fp8"
    assert config_read_bytes(cfg, 2) == decode_read_bytes(model) < config_read_bytes(load_model_config(tiny_llama_dir), 2)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_draft_models_cost_is_known_from_its_config_before_loading(fixture, dtype, request):
    # the pre-load estimate (attention bias for Qwen2, tied or separate head) is what the loaded model reads
    path = request.getfixturevalue(fixture)
    model, mcfg = load_model(path, dtype, "cpu")
    assert config_read_bytes(load_model_config(path), dtype.itemsize) == decode_read_bytes(model)


def test_a_method_that_cannot_pay_does_not_speculate(tiny_engine_factory, tiny_llama_dir, caplog, monkeypatch):
    # the target as its own draft: every draft accepted, yet each costs a whole decode step
    plain = tiny_engine_factory()
    import kvfleet_server.model.loader as loader

    def no_draft_weights(*a, **kw):
        raise AssertionError("the draft's weights were loaded")

    monkeypatch.setattr(loader, "load_model", no_draft_weights)  # the engine imported its own load_model
    with caplog.at_level("WARNING", logger="kvfleet.engine"):
        eng = tiny_engine_factory(speculative_config={"method": "draft_model", "model": tiny_llama_dir,
                                                      "num_speculative_tokens": 3})
    assert "a draft costs 1.00" in caplog.text and "break-even acceptance 1.10" in caplog.text
    assert "speculation is off, no draft loaded" in caplog.text
    # no drafter is built: no draft KV in the pool, no draft work per step
    assert eng.spec is None and eng.num_blocks == plain.num_blocks
    out_plain, _ = greedy_with_step_counts(plain, [9, 10, 11, 12], 40)
    out, drafted = greedy_with_step_counts(eng, [9, 10, 11, 12], 40)
    assert out == out_plain and sum(drafted) == 0


def test_a_costly_draft_backs_off_longer_so_failed_probes_stay_cheap():
    cheap, costly = DraftGate(0.3, token_cost=0.1), DraftGate(0.94, token_cost=0.94)
    assert cheap.backoff == DraftGate.FIRST_BACKOFF == 8
    assert costly.backoff == 24  # a failed one-draft probe every 24 steps costs 0.94 / 24 < 4 % of them
    costly.update(step=0, num_drafts=3, num_accepted=0)
    assert not costly.open(23) and costly.open(24) and costly.backoff == 48
    costly.update(step=24, num_drafts=1, num_accepted=0)
    assert costly.open(72) and not costly.open(71)
    assert DraftGate.max_inherited_backoff(0.94) == DraftGate.MAX_INHERITED_BACKOFF
    assert DraftGate.max_inherited_backoff(4.0) == DraftGate.initial_backoff(4.0) == 100


def test_a_new_sequence_starts_with_a_probe_and_the_learned_back_off_after_low_acceptance(tiny_engine_factory, tiny_qwen2_dir):
    # a draft model that disagrees with the target
    eng = tiny_engine_factory(speculative_config={"method": "draft_model", "model": tiny_qwen2_dir,
                                                  "num_speculative_tokens": 3, **FLOOR})
    eng.add_request("first", [5, 6, 7] * 6, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    run_to_completion(eng)
    assert eng.spec.acceptance_ema < eng.spec.min_acceptance
    # 40 tokens: k drafts at the first decode, failed probes 8 and 24 steps later: the back-off reached 64
    assert eng.spec.backoff == 8 * DraftGate.FIRST_BACKOFF
    eng.add_request("next", [5, 6, 7] * 6, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    counts = []
    run_to_completion(eng, on_step=lambda e: counts.append(e.last_iteration.num_draft_tokens))
    # one probe of one draft, then the inherited back-off (64 steps) outlasts the request: without the
    # inheritance it would probe again after 8 and 24 steps
    assert [c for c in counts if c] == [1]


def test_acceptance_that_recovers_is_picked_up_after_a_draft_that_never_agreed():
    """The decoder's gate bookkeeping (``SpecDecoder.num_drafts`` / ``SpecDecoder.rollback`` with no model):
    600 steps of a draft that never agrees drive the inherited back-off to its cap, then each 200-token
    request whose drafts are rejected for its first 2 tokens and accepted afterwards speculates again within
    the inherited back-off — the first one included — and what new sequences inherit goes back to the first
    back-off once a verification pays."""
    import types

    from kvfleet_server.spec_decode.decoder import SpecDecoder

    k = 3
    spec = SpecDecoder(SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k}),
                       types.SimpleNamespace(extra_kv_bytes_per_token=0), k, min_acceptance=0.3)
    kv = types.SimpleNamespace(truncate=lambda *a: None, blocks_for=lambda n: 0)
    step = 0

    def request(tokens, accept) -> int:
        nonlocal step
        req = Request("r", None, [1, 2], SamplingParams(temperature=0), 0.0, tokens + 8)
        seq = Sequence(req, 0, [1, 2, 3], None)  # a decoding sequence: one output token, one uncomputed
        seq.num_computed_tokens = 2
        verifications, out = 0, 1
        while out < tokens:
            step += 1
            d = spec.num_drafts(seq, budget=k, step=step)
            if d:
                a = accept(out, d)
                spec.rollback(seq, d, a, step, kv)
                seq.num_computed_tokens -= a  # the stub keeps the sequence at one uncomputed token
                verifications += 1
                out += 1 + a
            else:
                out += 1
        return verifications

    request(600, lambda out, d: 0)
    assert spec.backoff == DraftGate.MAX_INHERITED_BACKOFF and spec.acceptance_ema < 0.3
    counts = [request(200, lambda out, d: 0 if out < 2 else d) for _ in range(5)]
    assert all(c >= 30 for c in counts), counts  # ~50 verifications of 1 + 3 tokens each once drafts pay
    assert spec.backoff == DraftGate.FIRST_BACKOFF and spec.acceptance_ema > 0.9


def test_min_acceptance_overrides_the_cost_model(tiny_engine_factory, tiny_llama_dir):
    always = tiny_engine_factory(speculative_config={"method": "draft_model", "model": tiny_llama_dir,
                                                     "num_speculative_tokens": 3, "min_acceptance": 0})
    _, counts = greedy_with_step_counts(always, [9, 10, 11, 12], 30)
    assert sum(1 for c in counts if c) >= 5  # drafts every decode step (the target agrees with itself)
    for bad in (-0.1, 1.5, "high", True):
        with pytest.raises(ValueError, match=r"speculative_config.min_acceptance must be a number in \[0, 1\]"):
            tiny_engine_factory(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                    "min_acceptance": bad})


def test_n2_request_whose_last_prefill_chunk_is_one_token_forks_and_finishes(tiny_engine_factory):
    # a 17-token prompt in 16-token chunks: the last chunk is one token, before the first sample — a prefill,
    # not a decode: no drafts there, the request forks into its two samples and both finish
    eng = tiny_engine_factory(max_num_batched_tokens=16, speculative_config={
        "method": "layer_skip", "num_speculative_tokens": 3, "num_draft_layers": 1, "min_acceptance": 0})
    eng.add_request("a", list(range(20, 37)), SamplingParams(n=2, temperature=1.0, max_tokens=8, ignore_eos=True))
    out = run_to_completion(eng)["a"]
    assert out.finished and len(out.outputs) == 2 and all(len(c.token_ids) == 8 for c in out.outputs)
    assert out.metrics.first_token_time is not None and not eng.requests
    assert_all_blocks_free(eng)


def test_drafts_never_preempt_or_crowd_out_another_sequence(tiny_engine_factory):
    # budget 4: every running sequence gets its own token and a waiting one is admitted before any draft
    eng = tiny_engine_factory(max_num_batched_tokens=4, block_size=4, speculative_config={
        "method": "layer_skip", "num_speculative_tokens": 3, "num_draft_layers": 1, "min_acceptance": 0})
    for r in "abc":
        eng.add_request(r, [7, 8, 9], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    schedule, reserve = eng.scheduler.schedule, eng.spec.reserve
    steps, state = [], {}

    def checked():
        state["before"] = [s for s in eng.scheduler.running if s.num_uncomputed == 1 and s.num_output_tokens]
        state["waiting"] = len(eng.scheduler.waiting)
        out = schedule()
        assert not out.preempted
        return out

    def checked_reserve(sched, *args):  # draft slots are reserved after the scheduler placed everyone
        reserve(sched, *args)
        got = {s.seq.seq_id: s for s in sched.scheduled}
        assert all(s.seq_id in got for s in state["before"][:4])  # no decoding sequence skipped for drafts
        drafts = sum(s.max_drafts for s in sched.scheduled)
        waiting = state["waiting"]
        assert not (drafts and waiting and len(eng.scheduler.waiting) == waiting)  # no draft before admission
        steps.append(drafts)

    eng.scheduler.schedule, eng.spec.reserve = checked, checked_reserve
    finals = run_to_completion(eng)
    assert all(len(finals[r].outputs[0].token_ids) == 12 for r in "abc")
    assert sum(steps) > 0
    assert_all_blocks_free(eng)


def test_drafts_take_only_free_blocks(tiny_engine_factory):
    # 7 blocks: both sequences fit to their end (3 + 4 blocks) only without drafts; nobody is preempted for one
    per_block = 4 * 2 * 2 * 2 * 16 * 4  # block 4 tokens × (K, V) × layers × kv heads × head_dim × fp32
    eng = tiny_engine_factory(block_size=4, kv_cache_memory_bytes=7 * per_block, speculative_config={
        "method": "layer_skip", "num_speculative_tokens": 3, "num_draft_layers": 1, "min_acceptance": 0})
    eng.add_request("a", [7] * 7, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    eng.add_request("b", [8] * 9, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    preempted, drafted = [], []

    def on_step(e):
        preempted.append(e.last_iteration.num_preemptions)
        drafted.append(e.last_iteration.num_draft_tokens)

    run_to_completion(eng, on_step=on_step)
    assert sum(preempted) == 0 and sum(drafted) > 0
    assert_all_blocks_free(eng)


def test_seeded_random_requests_get_no_drafts(tiny_engine_factory):
    eng = tiny_engine_factory(speculative_config={"method": "layer_skip", "num_speculative_tokens": 3,
                                                  "num_draft_layers": 1, "min_acceptance": 0,
                                                  "disable_by_batch_size": 2})
    p = SamplingParams(temperature=0.8, seed=1234, max_tokens=20, ignore_eos=True)
    eng.add_request("alone", [11, 12, 13], p)
    counts = []
    alone = run_to_completion(eng, on_step=lambda e: counts.append(e.last_iteration.num_draft_tokens))
    assert sum(counts) == 0
    for i in range(3):
        eng.add_request(f"noise{i}", [20 + i] * 5, SamplingParams(temperature=0, max_tokens=15, ignore_eos=True))
    eng.add_request("batched", [11, 12, 13], p)
    assert run_to_completion(eng)["batched"].outputs[0].token_ids == alone["alone"].outputs[0].token_ids


def test_drafts_that_pay_keep_the_gate_open_between_the_break_even_and_the_old_floor():
    # n-gram on the CPU: break-even 0.1, cut-off at the floor. Verifications accepting 1 of 5 drafts (20 %)
    # emit 2 tokens for about 1.5 steps' cost: they pay, so the sequence keeps drafting (the 0.3 floor of
    # before closed it after two such verifications)
    cut = DraftGate.cut_off(break_even_acceptance(0.0, "cpu"))
    gate = DraftGate(cut, token_cost=VERIFY_COST["cpu"])
    for step in range(1, 21):
        assert gate.open(step)
        gate.update(step, 5, 1)
    old = DraftGate(0.3, token_cost=VERIFY_COST["cpu"])
    old.update(1, 5, 1)
    old.update(2, 5, 1)
    assert not old.open(3)
