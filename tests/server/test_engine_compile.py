"""torch.compile'd decoder layers (model/compile.py) give the tokens the eager model gives.

- the real SmolLM2 GGUF in float32, greedy, prompts of the peer workload's shape (20-200 tokens): compiled
  tokens == eager tokens, and serving many batch sizes compiles nothing after the start-up warm-up;
- the tiny random Llama under a random mixed batch (shared prefixes → prefix-cache hits, a small pool →
  preemption, chunked prefill, greedy and seeded sampling, n > 1): compiled == eager request by request;
- the quantized linears (int8, int4) and the FP8 KV cache's rotation compile too: compiled == eager.

On the CPU engines run eagerly by default (compilation level 0); these tests ask for level 3
while they build their compiled engines. Each compiled engine is built once per module.
"""

from __future__ import annotations

import random

import pytest

from kvfleet_server import LLM, EngineConfig, LLMEngine, SamplingParams

from engine_helpers import run_to_completion

BS = 4
PER_BLOCK = BS * 2 * 2 * 2 * 16 * 4  # bytes of one block of the tiny Llama (float32)


O3 = {"level": 3}  # on the CPU the default is eager (level 0): these tests ask for compilation

def _compiled(build):
    return build()


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_compiled_greedy_equals_eager_on_real_model():
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(20, 200))] for _ in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=512)
    before = _unique_graphs()
    compiled = _compiled(lambda: LLM("smollm2", compilation_config=O3, **kw))
    graphs = _unique_graphs()
    assert compiled.engine.model.compiled and graphs > before  # really compiled (graphs traced at start-up)
    got = [o.outputs[0].token_ids for o in compiled.generate(prompts, sp)]
    assert _unique_graphs() == graphs, "a batch size recompiled after the warm-up"
    del compiled
    eager = LLM("smollm2", enforce_eager=True, **kw)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, sp)]
    assert got == want


def _mixed_batch(eng) -> tuple[dict, int, int]:
    """Random requests added while stepping; returns (finals, preemptions, prefix-cache hit tokens)."""
    rng = random.Random(7)
    shared = [rng.randrange(100, 40000) for _ in range(11)]
    preempt = hits = 0
    pending = []
    for i in range(14):
        prompt = (shared if i % 3 else []) + [rng.randrange(100, 40000) for _ in range(rng.randint(1, 18))]
        n = 2 if i % 5 == 4 else 1
        params = SamplingParams(n=n, temperature=0 if i % 2 else 0.8, seed=i, max_tokens=rng.randint(4, 14),
                                ignore_eos=True)
        eng.add_request(f"r{i}", prompt, params)
        pending += eng.step()
        preempt += eng.last_iteration.num_preemptions
        hits += eng.last_iteration.prefix_cache_hits

    def count(e):
        nonlocal preempt, hits
        preempt += e.last_iteration.num_preemptions
        hits += e.last_iteration.prefix_cache_hits

    return run_to_completion(eng, on_step=count, first_outputs=pending), preempt, hits


def test_compiled_engine_equals_eager_on_mixed_batch_with_prefix_hits_and_preemption(tiny_llama_dir):
    kw = dict(model=tiny_llama_dir, dtype="float32", device="cpu", block_size=BS,
              kv_cache_memory_bytes=24 * PER_BLOCK, max_num_batched_tokens=16, max_num_seqs=6)
    compiled = _compiled(lambda: LLMEngine(EngineConfig(compilation_config=O3, **kw)))
    assert compiled.model.compiled
    graphs = _unique_graphs()
    got, preempt, hits = _mixed_batch(compiled)
    assert _unique_graphs() == graphs, "a batch size recompiled after the warm-up"
    want, _, _ = _mixed_batch(LLMEngine(EngineConfig(enforce_eager=True, **kw)))
    assert preempt > 0 and hits > 0  # the batch did reach the paths under test
    assert set(got) == set(want) == {f"r{i}" for i in range(14)}
    for rid in want:
        assert [c.token_ids for c in got[rid].outputs] == [c.token_ids for c in want[rid].outputs], rid


@pytest.mark.parametrize("quantization, kv_cache_dtype", [("int8", "auto"), ("int4", "auto"), (None, "fp8")])
def test_quantized_linears_compile(tiny_llama_dir, quantization, kv_cache_dtype):
    """int8 / int4 linears and the FP8 KV cache's Hadamard rotation compile: compiled == eager, and the
    start-up warm-up traced the graphs serving uses (no recompile)."""
    kw = dict(model=tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory_bytes=4 << 20,
              quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    prompts = [[5, 6, 7, 8, 9], list(range(200, 231)), [42] * 3]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def generate(eng):
        for i, p in enumerate(prompts):
            eng.add_request(f"q{i}", p, sp)
        return {r: o.outputs[0].token_ids for r, o in run_to_completion(eng).items()}

    compiled = _compiled(lambda: LLMEngine(EngineConfig(compilation_config=O3, **kw)))
    assert compiled.model.compiled
    graphs = _unique_graphs()
    got = generate(compiled)
    assert _unique_graphs() == graphs, "a batch size recompiled after the warm-up"
    assert got == generate(LLMEngine(EngineConfig(enforce_eager=True, **kw)))


@pytest.mark.slow
def test_tensor_parallel_linears_compile(tiny_llama_dir):
    """TP=2 over gloo: every rank compiles its layers (the row-parallel all-reduce inside the compiled
    piece); the tokens equal the eager TP engine's."""
    kw = dict(model=tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory_bytes=4 << 20,
              tensor_parallel_size=2, num_threads=1)
    prompts = [[5, 6, 7, 8, 9], list(range(200, 231))]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def generate(eng):
        try:
            for i, p in enumerate(prompts):
                eng.add_request(f"t{i}", p, sp)
            return {r: o.outputs[0].token_ids for r, o in run_to_completion(eng).items()}
        finally:
            eng.shutdown()

    compiled = _compiled(lambda: LLMEngine(EngineConfig(compilation_config=O3, **kw)))
    assert compiled.model.compiled
    graphs = _unique_graphs()
    got = generate(compiled)
    assert _unique_graphs() == graphs, "a batch size recompiled after the warm-up"
    assert got == generate(LLMEngine(EngineConfig(enforce_eager=True, **kw)))


def test_compilation_level_defaults_and_flags():
    from kvfleet_server.flags import parse_flags

    assert EngineConfig(device="cpu").resolved_compilation_level() == 0  # measured: no gain on the CPU
    assert EngineConfig(device="cuda").resolved_compilation_level() == 3
    assert EngineConfig(device="cuda", enforce_eager=True).resolved_compilation_level() == 0
    assert parse_flags(["-O3"]).compilation_config == {"level": 3}
    assert parse_flags(["--compilation-config", '{"level": 0}']).compilation_config == {"level": 0}
    for bad in ({"level": 2}, {"mode": 3}):
        with pytest.raises(ValueError, match="compilation_config"):
            EngineConfig(compilation_config=bad)
