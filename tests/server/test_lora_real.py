"""LoRA on the real SmolLM2-135M-Instruct in float32 against the merged-weight reference: transformers running
the model with W + scale·B·A in every targeted projection (PEFT adapters made here: seeded random A and B,
large enough to change the greedy outputs).

- each adapter alone gives transformers' greedy tokens with the merged weights;
- the base model and three adapters mixed in one batch give each row its solo run's tokens;
- at tensor parallel 3 (real worker processes; SmolLM2's 9 heads do not split over 2 — TP 2 is checked on
  a tiny model with 8 heads) the mixed batch gives the TP 1 tokens, with the same tolerance as the TP
  suite (at most 1 of 16 sequences may part at a float32 near-tie);
- with int8 base weights (quantized at load) the adapter's effect is exact: the logits of int8 + adapter
  are as far from the float32 merged reference as int8's are from the float32 base (stated below), and
  far closer than the base model's logits are.
"""

from __future__ import annotations

import pytest
import torch

from kvfleet_server import EngineConfig, LLMEngine, SamplingParams
from kvfleet_server.sequence import Request, ScheduledSeq, Sequence
from lora_helpers import make_adapter, merge_adapter

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "List three colours:"]
MAX_TOKENS = 16
#: (name, r, alpha, targets, rsLoRA)
ADAPTERS = [("all7", 8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
            ("attn_rs", 16, 8, ("q_proj", "v_proj", "o_proj"), True),
            ("mlp4", 4, 8, ("gate_proj", "up_proj", "down_proj"), False)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, smollm2_f32_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(smollm2_f32_dir)
    d = tmp_path_factory.mktemp("smollm2_loras")
    return {name: make_adapter(str(d / name), cfg, r=r, alpha=alpha, targets=t, rslora=rs, seed=i, std=0.03)
            for i, (name, r, alpha, t, rs) in enumerate(ADAPTERS)}


def _hf_model(model_dir, adapter=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        merge_adapter(model, adapter)
    return model.eval()


@pytest.fixture(scope="module")
def reference(smollm2_f32_dir, adapters):
    """transformers' greedy tokens per (adapter or None, prompt), with the merged weights."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_f32_dir)
    out = {}
    for name in [None, *adapters]:
        model = _hf_model(smollm2_f32_dir, adapters.get(name))
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                     pad_token_id=tok.eos_token_id)
            out[(name, p)] = gen[0, ids.shape[1]:].tolist()
    return out


def _engine(model_dir, adapters, **kw) -> LLMEngine:
    kw.setdefault("max_loras", 3)
    return LLMEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu", kv_cache_memory_bytes=64 << 20,
                                  max_model_len=256, num_threads=1, enable_lora=True,
                                  lora_modules=[{"name": n, "path": p} for n, p in adapters.items()], **kw))


def _generate(eng: LLMEngine, jobs: list[tuple[str | None, str]]) -> dict:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, (name, p) in enumerate(jobs):
        eng.add_request(str(i), p, params, lora_request=eng.get_lora(name) if name else None)
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                out[jobs[int(o.request_id)]] = o.outputs[0].token_ids
    return out


def test_each_adapter_gives_the_merged_reference_and_mixing_changes_nothing(smollm2_f32_dir, adapters, reference):
    jobs = [(name, p) for name in [None, *adapters] for p in PROMPTS]
    for name in adapters:  # the adapters matter: each changes some greedy output
        assert any(reference[(name, p)] != reference[(None, p)] for p in PROMPTS), name
    eng = _engine(smollm2_f32_dir, adapters)
    try:
        free = eng.num_free_blocks
        solo = {}
        for job in jobs:
            solo.update(_generate(eng, [job]))
        assert solo == {job: reference[job] for job in jobs}
        mixed = _generate(eng, jobs)  # base + 3 adapters in one batch
        assert mixed == solo
        assert eng.num_free_blocks == free and not any(eng.lora._refs.values())
    finally:
        eng.shutdown()


def test_more_adapters_than_slots_all_serve_correctly(smollm2_f32_dir, adapters, reference):
    """--max-loras 1, --max-cpu-loras 1: the three adapters take the one slot in turn, re-read from disk."""
    eng = _engine(smollm2_f32_dir, adapters, max_loras=1, max_cpu_loras=1)
    try:
        free = eng.num_free_blocks
        jobs = [(name, p) for p in PROMPTS[:2] for name in [*adapters, None]]
        assert _generate(eng, jobs) == {job: reference[job] for job in jobs}
        assert eng.num_free_blocks == free and not any(eng.lora._refs.values())
    finally:
        eng.shutdown()


def test_tensor_parallel_3_mixed_adapters_match_tp1(smollm2_f32_dir, adapters, reference):
    jobs = [(name, p) for name in [None, *adapters] for p in PROMPTS]
    eng = _engine(smollm2_f32_dir, adapters, tensor_parallel_size=3)
    try:
        assert eng.tp.world_size == 3
        got = _generate(eng, jobs)
    finally:
        eng.shutdown()
    same = sum(got[j] == reference[j] for j in jobs)
    assert same >= len(jobs) - 1, f"{same}/{len(jobs)} sequences equal"


def test_tensor_parallel_2_on_a_tiny_model(tmp_path, hf_tokenizer_dir):
    from tiny_models import _save_tiny
    from transformers import AutoConfig

    d = _save_tiny("llama", str(tmp_path / "m"), hf_tokenizer_dir, num_attention_heads=8, num_key_value_heads=2)
    cfg = AutoConfig.from_pretrained(d)
    ads = {f"t{i}": make_adapter(str(tmp_path / f"t{i}"), cfg, r=4, alpha=16, std=0.4, seed=i) for i in range(2)}
    jobs = [(name, p) for name in [None, *ads] for p in PROMPTS[:3]]
    results = []
    for tp in (1, 2):
        eng = LLMEngine(EngineConfig(model=d, dtype="float32", device="cpu", kv_cache_memory_bytes=(2 << 20) // tp,
                                     tensor_parallel_size=tp, num_threads=1, enable_lora=True, max_loras=2,
                                     lora_modules=[{"name": n, "path": p} for n, p in ads.items()]))
        try:
            results.append(_generate(eng, jobs))
        finally:
            eng.shutdown()
    assert sum(results[0][j] == results[1][j] for j in jobs) >= len(jobs) - 1
    assert any(results[0][(n, p)] != results[0][(None, p)] for n in ads for p in PROMPTS[:3])


def _prompt_logits(eng: LLMEngine, ids: list[int], lora_name: str | None) -> torch.Tensor:
    """Logits [len(ids), vocab] of every prompt position, through the runner with the adapter's slot."""
    lora = eng.get_lora(lora_name) if lora_name else None
    req = Request("probe", None, ids, SamplingParams(), 0.0, 1, lora=lora)
    seq = Sequence(req, 0, ids, None)
    assert eng.lora.acquire(seq)
    eng.lora.before_forward()
    eng.kv.allocate_slots(seq.seq_id, 0, len(ids))
    batch = eng.runner.execute([ScheduledSeq(seq, len(ids)).span(eng.kv.block_ids(seq.seq_id), eng.lora.slot(seq))])
    logits = eng.runner.compute_logits(batch, list(range(len(ids))))
    eng.kv.free(seq.seq_id)
    eng.lora.release(seq)
    return logits


def test_int8_base_weights_with_an_adapter(smollm2_f32_dir, adapters):
    """Tolerance: max |logits(int8 + adapter) − logits(float32 merged)| ≤ 1.5 × max |logits(int8 base) −
    logits(float32 base)| + 0.05 over every position of two prompts — the adapter adds no error of its
    own beyond int8's — while the adapter's own effect (float32 merged vs base) is several times larger."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_f32_dir)
    ids = tok(PROMPTS[0] + " " + PROMPTS[2]).input_ids
    ref = {}
    for name in (None, "all7"):
        model = _hf_model(smollm2_f32_dir, adapters.get(name))
        with torch.no_grad():
            ref[name] = model(torch.tensor([ids])).logits[0].float()
    eng = _engine(smollm2_f32_dir, {"all7": adapters["all7"]}, quantization="int8")
    try:
        got = {name: _prompt_logits(eng, ids, name) for name in (None, "all7")}
    finally:
        eng.shutdown()
    int8_error = (got[None] - ref[None]).abs().max().item()
    lora_error = (got["all7"] - ref["all7"]).abs().max().item()
    effect = (ref["all7"] - ref[None]).abs().max().item()
    assert lora_error <= 1.5 * int8_error + 0.05, (lora_error, int8_error)
    assert effect > 3 * lora_error, (effect, lora_error)
