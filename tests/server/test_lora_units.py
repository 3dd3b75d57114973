"""LoRA's parts without the real model: the fast multi-adapter path against the per-row reference, the PEFT
reader's refusals, the adapter slots' LRU rule, prefix-cache keys, and the tiny model end to end."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvfleet_server.model.layers.lora import LoRAMapping, lora_apply, lora_apply_grouped, lora_reference
from kvfleet_server.model.lora_checkpoint import AdapterCache, LoRAError, load_adapter
from kvfleet_server.sequence import LoRARequest, Request, hash_block_tokens
from kvfleet_server.sampling_params import SamplingParams
from lora_helpers import make_adapter


def test_many_adapters_take_the_grouped_path():
    m = LoRAMapping()
    m.set([i % 16 for i in range(32)])
    assert m.grouped is not None and m.grouped[1].shape == (32,)
    m.set([0] * 30 + [1, 2])  # one adapter dominates: padding would waste most rows
    assert m.grouped is None and len(m.segments) == 3


@pytest.mark.parametrize("seed", range(8))
def test_fast_path_equals_the_reference(seed):
    """Random shapes, ranks 1–64, mixed slots including the base model (−1), every slot or one."""
    g = torch.Generator().manual_seed(seed)
    T = int(torch.randint(1, 70, (1,), generator=g))
    fan_in, fan_out = (int(v) for v in torch.randint(1, 200, (2,), generator=g))
    R = int(torch.randint(1, 65, (1,), generator=g))
    S = int(torch.randint(1, 6, (1,), generator=g))
    a = torch.randn(S, R, fan_in, generator=g)
    b = torch.randn(S, fan_out, R, generator=g)
    x = torch.randn(T, fan_in, generator=g)
    y = torch.randn(T, fan_out, generator=g)
    balanced = [i % S for i in range(T)]  # every adapter present, evenly: the grouped path when S >= 3
    choices = [[-1] * T, [S - 1] * T, torch.randint(-1, S, (T,), generator=g).tolist(), balanced,
               [-1 if i % 3 == 0 else s for i, s in enumerate(balanced)]]
    for slots in choices:
        mapping = LoRAMapping()
        mapping.set(slots)
        want = lora_reference(x, y, a, b, torch.tensor(slots))
        got = (lora_apply_grouped(x, y.clone(), a, b, *mapping.grouped) if mapping.grouped is not None
               else lora_apply(x, y.clone(), a, b, mapping.segments))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        # both layouts compute the same: the per-adapter loop over the grouped mapping's rows
        segments = [(s, torch.tensor([t for t, v in enumerate(slots) if v == s])) for s in sorted(set(slots) - {-1})]
        torch.testing.assert_close(lora_apply(x, y.clone(), a, b, segments), want, rtol=1e-5, atol=1e-4)
    # a deliberately wrong fast path (every row given slot 0) is caught by the same comparison
    slots = [s if s != 0 else 1 for s in choices[2]] if S > 1 else [0] * T
    mapping = LoRAMapping()
    mapping.set([0 if s >= 0 else -1 for s in slots])
    if S > 1 and any(s > 0 for s in slots):
        bad = lora_apply(x, y.clone(), a, b, mapping.segments)
        assert not torch.allclose(bad, lora_reference(x, y, a, b, torch.tensor(slots)), atol=1e-3)


class _Cfg:
    hidden_size, num_attention_heads, num_key_value_heads, head_dim = 64, 4, 2, 16
    intermediate_size, num_hidden_layers = 128, 2


@pytest.fixture()
def model_cfg():
    from kvfleet_server.model import ModelConfig

    return ModelConfig("LlamaForCausalLM", 100, 64, 128, 2, 4, 2, 16)


def test_adapter_is_read_and_scaled(tmp_path, model_cfg):
    path = make_adapter(str(tmp_path / "a"), _Cfg, r=4, alpha=8)
    ad = load_adapter("a", path, model_cfg, max_rank=16)
    assert ad.rank == 4 and ad.scale == 2.0 and len(ad.weights) == 2 * 7
    assert ad.weights[(1, "down_proj")][0].shape == (4, 128)
    rs = load_adapter("b", make_adapter(str(tmp_path / "b"), _Cfg, r=4, alpha=8, rslora=True), model_cfg, 16)
    assert rs.scale == pytest.approx(8 / 2)


@pytest.mark.parametrize("case, field, status", [
    ("rank", "r", 400), ("target", "target_modules", 400), ("missing_dir", "lora_path", 404),
    ("missing_weights", "lora_path", 404), ("hidden", "lora_path", 400), ("dora", "use_dora", 400),
    ("lm_head", "target_modules", 400),
])
def test_bad_adapters_are_refused_naming_the_field(tmp_path, model_cfg, case, field, status):
    path = str(tmp_path / "a")
    if case == "rank":
        make_adapter(path, _Cfg, r=32)
    elif case == "target":
        make_adapter(path, _Cfg, extra_config={"target_modules": ["q_proj", "embed_tokens"]})
    elif case == "missing_dir":
        path = str(tmp_path / "nowhere")
    elif case == "missing_weights":
        make_adapter(path, _Cfg)
        os.remove(os.path.join(path, "adapter_model.safetensors"))
    elif case == "hidden":
        class Wide(_Cfg):
            hidden_size = 96
        make_adapter(path, Wide)
    elif case == "dora":
        make_adapter(path, _Cfg, extra_config={"use_dora": True})
    elif case == "lm_head":
        from safetensors.torch import save_file

        make_adapter(path, _Cfg)
        save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
                   "base_model.model.lm_head.lora_B.weight": torch.zeros(100, 8)},
                  os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(LoRAError) as e:
        load_adapter("a", path, model_cfg, max_rank=16)
    assert e.value.param == field and e.value.status == status, str(e.value)
    if case == "rank":
        assert "r=32 exceeds --max-lora-rank 16" in str(e.value)
    if case == "hidden":
        assert "shape" in str(e.value) and "needs" in str(e.value)


def test_host_cache_keeps_the_most_recent(tmp_path, model_cfg):
    paths = [make_adapter(str(tmp_path / f"a{i}"), _Cfg, seed=i) for i in range(3)]
    cache = AdapterCache(2, model_cfg, 16)
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    for i in (0, 1, 0, 2):
        cache.get(loras[i])
    assert cache.names() == ["a0", "a2"]


class _Runner:
    def __init__(self):
        self.calls = []
        self.adapters = self

    def get(self, lora):
        return None

    def call(self, method, *args):
        self.calls.append((method, *args))


def _seq(rid, lora):
    from kvfleet_server.sequence import Sequence

    req = Request(rid, None, [1, 2, 3], SamplingParams(), 0.0, 4, lora=lora)
    return Sequence(req, 0, [1, 2, 3], None)


def test_slots_are_lru_and_never_taken_from_a_running_sequence():
    from kvfleet_server.engine.lora import LoRAManager

    runner = _Runner()
    m = LoRAManager(max_loras=2, runner=runner)
    a, b, c = (m.add(n, f"/p/{n}") for n in "abc")
    sa, sb, sc, sa2 = _seq("1", a), _seq("2", b), _seq("3", c), _seq("4", a)
    assert m.acquire(sa) and m.acquire(sb)
    assert not m.acquire(sc)  # both slots held by running sequences
    assert m.acquire(sa2) and m.slot(sa2) == m.slot(sa)  # same adapter: same slot
    m.before_forward()
    assert [c[0] for c in runner.calls] == ["cache_lora"] * 3 + ["load_lora"] * 2  # every rank reads at add
    m.release(sb)
    assert m.acquire(sc) and m.slot(sc) == 1  # b's slot was idle: taken by c
    m.release(sc)
    m.release(sa)
    m.release(sa2)
    sb2 = _seq("5", b)
    assert m.acquire(sb2) and m.slot(sb2) == 0  # least recently used: a's slot (c's was used later)
    assert m.acquire(_seq("6", None)) and m.slot(_seq("7", None)) == -1


def test_salt_and_adapter_name_never_share_blocks():
    """vLLM issue 44701: an adapter and a cache_salt with the same text must key different blocks."""
    lora = LoRARequest("tenant", 1, "/p")
    keys = {
        "salt": Request("1", None, [1], SamplingParams(), 0, 1, cache_salt="tenant").hash_extra,
        "lora": Request("2", None, [1], SamplingParams(), 0, 1, lora=lora).hash_extra,
        "both": Request("3", None, [1], SamplingParams(), 0, 1, cache_salt="tenant", lora=lora).hash_extra,
        "none": Request("4", None, [1], SamplingParams(), 0, 1).hash_extra,
        "reloaded": Request("5", None, [1], SamplingParams(), 0, 1, lora=LoRARequest("tenant", 2, "/q")).hash_extra,
    }
    hashes = {k: hash_block_tokens(None, [1, 2, 3], v) for k, v in keys.items()}
    assert len(set(hashes.values())) == len(hashes)


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory, tiny_llama_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_llama_dir)
    d = tmp_path_factory.mktemp("tiny_loras")
    return [make_adapter(str(d / f"a{i}"), cfg, r=4 + 4 * i, alpha=16, std=0.4, seed=i) for i in range(3)]


def _run(eng, reqs):
    out = {}
    for rid, prompt, lora in reqs:
        eng.add_request(rid, prompt, SamplingParams(max_tokens=12, temperature=0), lora_request=lora)
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


def test_tiny_engine_mixed_batch_equals_solo_runs_and_returns_every_slot(tiny_engine_factory, tiny_adapters):
    mods = [{"name": f"a{i}", "path": p} for i, p in enumerate(tiny_adapters)]
    eng = tiny_engine_factory(enable_lora=True, max_loras=2, max_cpu_loras=2, lora_modules=mods)
    free = eng.num_free_blocks
    loras = [None] + [eng.get_lora(f"a{i}") for i in range(3)]
    prompts = ["The cat sat", "Once upon a time in a land", "1 2 3 4"]
    solo = {}
    for j, lora in enumerate(loras):
        for k, p in enumerate(prompts):
            solo.update(_run(eng, [(f"{j}-{k}", p, lora)]))
    base = [solo[f"0-{k}"] for k in range(3)]
    for j in range(1, 4):  # every adapter changes the greedy output of some prompt
        assert [solo[f"{j}-{k}"] for k in range(3)] != base
    # all at once: 3 adapters over 2 slots — the third waits for a slot, nothing is mixed up
    mixed = _run(eng, [(f"m{j}-{k}", p, lora) for j, lora in enumerate(loras) for k, p in enumerate(prompts)])
    assert {k[1:]: v for k, v in mixed.items()} == solo
    assert eng.num_free_blocks == free
    assert not any(eng.lora._refs.values()) and not eng.lora._held
    stats = eng.get_stats()
    assert stats.max_lora == 2 and stats.running_lora_adapters == ()


def _first_step_hits(eng, rid, prompt, lora=None, salt=None) -> int:
    eng.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0), lora_request=lora, cache_salt=salt)
    eng.step()
    hits = eng.last_iteration.prefix_cache_hits
    while eng.has_unfinished():
        eng.step()
    return hits


def test_the_same_prompt_under_two_adapters_shares_no_kv(tiny_engine_factory, tiny_adapters):
    eng = tiny_engine_factory(enable_lora=True, max_loras=2,
                              lora_modules=[{"name": "a0", "path": tiny_adapters[0]}])
    prompt = list(range(100, 180))  # 5 full blocks
    lora = eng.get_lora("a0")
    assert _first_step_hits(eng, "1", prompt, lora) == 0
    assert _first_step_hits(eng, "2", prompt) == 0  # the base model never reads the adapter's blocks
    assert _first_step_hits(eng, "3", prompt, salt="a0") == 0  # nor a salt named like the adapter
    assert _first_step_hits(eng, "4", prompt, lora) >= 64  # the adapter's own blocks are reused
    assert _first_step_hits(eng, "5", prompt) >= 64


def test_unknown_or_disabled_adapters_are_refused(tiny_engine_factory, tiny_adapters):
    from kvfleet_server.errors import InvalidRequestError

    eng = tiny_engine_factory()
    with pytest.raises(LoRAError, match="--enable-lora"):
        eng.add_lora("a0", tiny_adapters[0])
    with pytest.raises(InvalidRequestError, match="not loaded"):
        eng.add_request("x", "hi", SamplingParams(max_tokens=1), lora_request=LoRARequest("a0", 1, "/p"))
    eng = tiny_engine_factory(enable_lora=True, max_lora_rank=8)
    with pytest.raises(LoRAError, match="r=12 exceeds --max-lora-rank 8"):
        eng.add_lora("a2", tiny_adapters[2])
    eng.add_lora("a0", tiny_adapters[0])
    with pytest.raises(LoRAError, match="already been loaded"):
        eng.add_lora("a0", tiny_adapters[0])
    eng.remove_lora("a0")
    with pytest.raises(LoRAError) as e:
        eng.remove_lora("a0")
    assert e.value.status == 404
