"""Must-show 1 (issue 10): greedy outputs are identical with speculative decoding on and off, on the
real SmolLM2-135M-Instruct in float32, for every method, over one mixed batch that has stop strings, an
EOS ending, max_tokens endings, n > 1, prefix-cache hits, preemption under a tiny pool and chunked
prefill. The pool's reference counts are checked after every step and every block is free at the end.

A divergence is tolerated only at a float rounding tie (top-2 logprobs of the plain run within 1e-4):
the verification pass computes a position in a longer span than a plain decode does.
"""

from __future__ import annotations

import pytest

from kvfleet_server import EngineConfig, LLMEngine, SamplingParams

from engine_helpers import assert_all_blocks_free, run_to_completion
from spec_helpers import SpecStepChecker

pytestmark = pytest.mark.slow

BLOCK = 16
KV_PER_TOKEN = 30 * 3 * 64 * 2 * 4  # SmolLM2: layers × kv heads × head_dim × (K, V) × fp32
NUM_BLOCKS = 16

PASSAGE = ("The harbor town of Westmere was founded in 1821 by fishermen from the northern coast. Its lighthouse, "
           "built of grey granite, still guides the ferries that cross the bay every morning at seven o'clock.")
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def _workload():
    g = dict(temperature=0.0, logprobs=2)
    return [
        ("copy", CHAT.format(f"Repeat this text word for word: {PASSAGE}"), SamplingParams(max_tokens=48, **g)),
        ("copy-prefix", CHAT.format(f"Repeat this text word for word: {PASSAGE} Thanks!"),  # prefix-cache hit
         SamplingParams(max_tokens=40, **g)),
        ("stop", CHAT.format(f"Repeat this text word for word: {PASSAGE}"),
         SamplingParams(max_tokens=60, stop=["lighthouse"], **g)),
        ("eos", CHAT.format("Say only the word yes."), SamplingParams(max_tokens=40, **g)),
        ("n2", CHAT.format(f"Summarize in one sentence: {PASSAGE}"), SamplingParams(max_tokens=32, n=2, **g)),
        ("open", "Once upon a time, in a small village, there lived", SamplingParams(max_tokens=32, **g)),
        ("list", "1, 2, 3, 4, 5, 6, 7, 8,", SamplingParams(max_tokens=36, stop_token_ids=[30], **g)),
    ]


def _run(spec: dict | None, gguf_path):
    eng = LLMEngine(EngineConfig(model=gguf_path, dtype="float32", device="cpu", block_size=BLOCK,
                                 kv_cache_memory_bytes=NUM_BLOCKS * BLOCK * KV_PER_TOKEN
                                 * (2 if spec and spec["method"] == "draft_model" else 1),
                                 max_num_batched_tokens=48, speculative_config=spec))
    assert eng.kv.num_blocks == NUM_BLOCKS
    work = _workload()
    eng.add_request(*work[0])
    first = eng.step()  # the first prompt is cached before the one sharing its prefix arrives
    for w in work[1:]:
        eng.add_request(*w)
    check = SpecStepChecker()
    hits = []
    finals = run_to_completion(eng, on_step=lambda e: (check(e), hits.append(e.last_iteration.prefix_cache_hits)),
                               first_outputs=first)
    assert_all_blocks_free(eng)
    return finals, check, sum(hits)


@pytest.fixture(scope="module")
def plain(gguf_path):
    return _run(None, gguf_path)


SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    # a 0.3 cut-off (the cost-aware one would switch these off on a CPU: see docs/spec_decode.md)
    "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 3, "num_draft_layers": 24, "min_acceptance": 0.3},
    "draft_model": {"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 3, "min_acceptance": 0.3},
}


@pytest.mark.parametrize("method", list(SPECS))
def test_greedy_identical_with_and_without_speculation(plain, gguf_path, method):
    base, base_check, base_hits = plain
    spec, check, hits = _run(SPECS[method], gguf_path)
    # the batch reached every path under test
    for c, h in ((base_check, base_hits), (check, hits)):
        assert c.preemptions > 0, "the tiny pool should force preemption"
        assert c.prompt_tokens_with_decodes > 0, "prefill chunks should share steps with decodes"
        assert h > 0, "the second copy prompt should hit the prefix cache"
    assert check.accepted > 0 and check.drafts > 0
    reasons = {(rid, c.finish_reason) for rid, o in base.items() for c in o.outputs}
    assert ("stop", "stop") in {(r, f) for r, f in reasons} and ("eos", "stop") in reasons
    assert ("copy-prefix", "length") in reasons
    assert base["stop"].outputs[0].stop_reason == "lighthouse"

    mismatches = []
    for rid, out in base.items():
        for a, b in zip(out.outputs, spec[rid].outputs):
            assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason) or a.token_ids != b.token_ids
            if a.token_ids != b.token_ids:
                k = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                         min(len(a.token_ids), len(b.token_ids)))
                top2 = sorted((lp.logprob for lp in a.logprobs[k].values()), reverse=True)[:2]
                mismatches.append((rid, a.index, k, top2[0] - top2[1]))
            else:
                assert a.text == b.text
                for la, lb in zip(a.logprobs, b.logprobs):  # logprobs of accepted drafts are the target's
                    assert la.keys() == lb.keys()
                    for t in la:
                        assert abs(la[t].logprob - lb[t].logprob) < 1e-3
    assert all(gap < 1e-4 for *_, gap in mismatches), mismatches
    assert len(mismatches) <= 1, mismatches
