"""Speculative decoding under tensor parallelism (issue 10 x tensor parallelism): layer_skip and
draft_model at TP = 2 give the greedy tokens of TP = 1 without speculation, through n > 1 (copy-on-write
copies that every rank applies before the drafters read the KV), prefix-cache hits and preemption under a
small pool; the pool's reference counts hold after every step and every block is free at the end, and
the verification rows' logits come with the step (no second broadcast).

layer_skip's draft passes run on every rank (the target's own sharded first layers); a draft model is
unsharded and runs on rank 0 alone; verification rows' logits are computed with the step. Ranks 1..N-1
are real worker processes (gloo on the CPU), one intra-op thread each; random-weight model, float32.
ngram drafts need text that repeats, which a random model does not write: test_tp_smollm2.py checks
ngram at TP = 3 on the real model."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_all_blocks_free, run_to_completion
from kvfleet_server import EngineConfig, LLMEngine, SamplingParams
from spec_helpers import SpecStepChecker
from tiny_models import _save_tiny

pytestmark = pytest.mark.slow

PREAMBLE = [5, 17, 923, 4410, 88, 12000, 301, 7, 7, 9, 45000, 1234, 16, 2048, 99, 3, 600, 42]  # > 1 block
WORK = [
    (PREAMBLE + [11, 12, 13, 11, 12], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)),
    (PREAMBLE + [77, 1500, 9000], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2, logprobs=1)),
    ([3, 3, 3, 123, 456, 789, 3, 3], SamplingParams(temperature=0, max_tokens=28, ignore_eos=True, logprobs=1)),
]
BLOCK_BYTES_TP1 = 16 * 2 * 2 * 2 * 8 * 4  # 16 tokens x K+V x 2 layers x 2 KV heads x head_dim 8 x float32
KV_BLOCKS = 6  # the batch needs ~12 blocks at its peak: the scheduler preempts


@pytest.fixture(scope="module")
def heads_8_2(tmp_path_factory, hf_tokenizer_dir):
    return _save_tiny("llama", str(tmp_path_factory.mktemp("h8_2")), hf_tokenizer_dir,
                      num_attention_heads=8, num_key_value_heads=2)


def run(model: str, tp: int, spec: dict | None):
    # per rank: its shard of the target's KV, and on rank 0 the (unsharded) draft model's in the same blocks
    draft = BLOCK_BYTES_TP1 if spec and spec["method"] == "draft_model" else 0
    eng = LLMEngine(EngineConfig(model=model, tensor_parallel_size=tp, dtype="float32", device="cpu",
                                 kv_cache_memory_bytes=KV_BLOCKS * (BLOCK_BYTES_TP1 // tp + draft), num_threads=1,
                                 max_num_batched_tokens=32, speculative_config=spec))
    copies, messages = [], []
    real = eng.runner.copy_blocks_on_every_rank
    eng.runner.copy_blocks_on_every_rank = lambda c: (copies.extend(c), real(c))
    send = eng.runner.tp.broadcast_object
    eng.runner.tp.broadcast_object = lambda obj=None: (messages.append(obj[0]), send(obj))[1]
    try:
        assert eng.num_blocks == KV_BLOCKS
        assert len(eng.workers.pids() if eng.workers else []) == tp - 1
        eng.add_request("r0", *WORK[0])
        first = eng.step()  # cached before the request sharing its preamble arrives
        for i, w in enumerate(WORK[1:], 1):
            eng.add_request(f"r{i}", *w)
        check = SpecStepChecker()
        hits = []
        finals = run_to_completion(eng, on_step=lambda e: (check(e), hits.append(e.last_iteration.prefix_cache_hits)),
                                   first_outputs=first)
        assert_all_blocks_free(eng)
        outs = {(rid, c.index): (c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
                for rid, o in finals.items() for c in o.outputs}
        return outs, check, sum(hits), copies, messages
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def plain_tp1(heads_8_2):
    return run(heads_8_2, 1, None)


SPECS = {
    "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 3, "num_draft_layers": 1, "min_acceptance": 0},
    "draft_model": {"method": "draft_model", "model": "TARGET", "num_speculative_tokens": 3, "min_acceptance": 0},
}


@pytest.mark.parametrize("method", list(SPECS))
def test_speculation_at_tp2_gives_the_tokens_of_tp1(heads_8_2, plain_tp1, method):
    spec = dict(SPECS[method])
    if spec.get("model") == "TARGET":
        spec["model"] = heads_8_2  # the target as its own draft: every draft accepted, the KV paths exercised
    ref, _, ref_hits, _, _ = plain_tp1
    got, check, hits, copies, messages = run(heads_8_2, 2, spec)
    assert check.drafts > 0 and check.draft_tokens > check.drafts  # speculation ran, several drafts a step
    assert check.preemptions > 0 and hits > 0 and ref_hits > 0
    assert copies, "n = 2 forks share a partial block: its copy-on-write copy is applied on every rank"
    if method == "draft_model":
        assert check.accepted == check.draft_tokens  # the draft is the target: nothing rejected
    # a draft model's passes run on rank 0 alone; every draft pass's, sampling row's and verification row's
    # logits come with its pass: no step needs a second broadcast (ModelRunner.call, TokenSpan.logits)
    assert "row_logits" not in messages and "run" in messages, set(messages)
    assert got.keys() == ref.keys()
    for key, (toks, lps) in ref.items():
        assert got[key][0] == toks, key
        torch.testing.assert_close(torch.tensor(got[key][1]), torch.tensor(lps), atol=1e-4, rtol=0)
