"""Structured output inside the engine on the real SmolLM2 (offline LLMEngine): composition with preemption
under a tiny KV pool, n = 2 (forked matchers), prefix-cache hits; EOS only where the grammar ends; and
jump-forward (valid outputs, fewer forward passes, boundary retokenization, its metric counter)."""

import json
import sys

import jsonschema
import pytest

from kvfleet_server import EngineConfig, LLMEngine, SamplingParams
from kvfleet_server.sample.grammar import GrammarCompiler, SequenceGrammar
from kvfleet_server.sample.jump_forward import plan_jump_forward
from kvfleet_server.sampling_params import StructuredOutputsParams

from engine_helpers import assert_all_blocks_free, run_to_completion
from structured_schemas import make_schemas

pytestmark = pytest.mark.slow
SCHEMAS = make_schemas(50)


def _engine(**kw):
    kw.setdefault("kv_cache_memory_bytes", 64 << 20)
    kw.setdefault("max_model_len", 1024)
    return LLMEngine(EngineConfig(model="smollm2", device="cpu", dtype="float32", **kw))


@pytest.fixture(scope="module")
def engine():
    return _engine()


def _prompt(engine, text):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _add(engine, rid, i, **kw):
    prompt, schema = SCHEMAS[i]
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 0.0)
    engine.add_request(rid, _prompt(engine, prompt),
                       SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **kw),
                       add_special_tokens=False)
    return schema


def _check(out, schema):
    for c in out.outputs:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), schema)


def test_preemption_under_a_tiny_pool_keeps_outputs_valid():
    eng = _engine(kv_cache_memory_bytes=24 * 16 * 46080, max_model_len=384)  # 24 blocks of 16 tokens: 8 requests cannot all fit
    schemas = {f"r{i}": _add(eng, f"r{i}", i, temperature=1.0, seed=i) for i in range(8)}
    finals = run_to_completion(eng)
    assert eng.scheduler.num_preemptions_total > 0
    for rid, out in finals.items():
        _check(out, schemas[rid])
    assert_all_blocks_free(eng)


def test_n_2_forks_the_matcher(engine):
    schema = _add(engine, "n2", 3, n=2, temperature=1.0, seed=11)
    out = run_to_completion(engine)["n2"]
    assert len(out.outputs) == 2
    _check(out, schema)
    assert_all_blocks_free(engine)


def test_prefix_cache_hits_keep_outputs_valid_and_identical(engine):
    outs = []
    for k in range(2):
        schema = _add(engine, f"pc{k}", 5)
        outs.append(run_to_completion(engine)[f"pc{k}"])
    assert outs[1].num_cached_tokens > 0
    for out in outs:
        _check(out, schema)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_eos_only_where_the_grammar_can_end(engine):
    # without a grammar, this prompt ends after a few tokens; under the regex it must write all 12 digits
    p = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=r"\d{12}"))
    engine.add_request("eos", _prompt(engine, "Say OK."), p, add_special_tokens=False)
    c = run_to_completion(engine)["eos"].outputs[0]
    assert c.finish_reason == "stop" and len(c.text) == 12 and c.text.isdigit()


def test_max_tokens_cutting_json_is_length(engine):
    _add(engine, "cut", 0, max_tokens=5)
    c = run_to_completion(engine)["cut"].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5


# ------------------------------------------------------------------ jump-forward


def test_jump_forward_retokenizes_the_boundary(engine):
    """After ``{`` the grammar forces ``"name": "``; SmolLM2's tokenizer writes ``{"`` as one token, so
    the sampled ``{`` is replaced (the forced text tokenized on its own would give ``{`` + ``"``)."""
    tok = engine.tokenizer
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"name": {"type": "string"}},
                                         "required": ["name"]})
    compact = GrammarCompiler(tok.hf, engine.model_config.vocab_size, [2], any_whitespace=False)
    compact.compile(spec)
    g = SequenceGrammar(spec.compiled, [2])
    brace = tok.encode("{", add_special_tokens=False)
    assert len(brace) == 1 and g.accept(brace[0])
    assert g.forced_continuation() == '"name": "'
    plan = plan_jump_forward(g, tok, brace, budget=100)
    whole = tok.encode('{"name": "', add_special_tokens=False)
    naive = brace + tok.encode('"name": "', add_special_tokens=False)
    assert whole != naive[: len(whole)]  # the boundary matters for this tokenizer
    assert plan == whole[:-1]  # the tokenizer's own split; the last token is held back
    assert g.num_accepted == len(plan)
    assert g.accept(whole[-1])  # the grammar state is right after the plan


@pytest.fixture(scope="module")
def compact_engine():
    return _engine(structured_outputs_config={"disable_any_whitespace": True})


def _run(eng, jump, idx):
    eng.config.enable_jump_forward = jump
    passes = {}
    schemas = {f"j{jump}{i}": _add(eng, f"j{jump}{i}", i) for i in idx}
    jumped = 0

    def count(e):
        nonlocal jumped
        jumped += e.last_iteration.num_jump_forward_tokens

    # forward passes per request: steps in which it was scheduled
    orig = eng.scheduler.schedule

    def schedule():
        out = orig()
        for s in out.scheduled:
            rid = s.seq.request.request_id
            passes[rid] = passes.get(rid, 0) + 1
        return out

    eng.scheduler.schedule = schedule
    try:
        finals = run_to_completion(eng, on_step=count)
    finally:
        eng.scheduler.schedule = orig
    return finals, schemas, passes, jumped


def test_jump_forward_outputs_valid_with_fewer_forward_passes(compact_engine):
    idx = list(range(0, 50, 5))
    off, schemas_off, passes_off, j_off = _run(compact_engine, False, idx)
    on, schemas_on, passes_on, j_on = _run(compact_engine, True, idx)
    for finals, schemas in ((off, schemas_off), (on, schemas_on)):
        for rid, out in finals.items():
            _check(out, schemas[rid])
    assert j_off == 0 and j_on > 0
    assert sum(passes_on.values()) < sum(passes_off.values())
    same = sum(on[f"jTrue{i}"].outputs[0].text == off[f"jFalse{i}"].outputs[0].text for i in idx)
    print(f"\njump-forward: forward passes {sum(passes_off.values())} -> {sum(passes_on.values())}, "
          f"{j_on} tokens jumped, {same}/{len(idx)} greedy outputs equal to the run without it", file=sys.stderr)
    assert_all_blocks_free(compact_engine)


def test_speculative_engine_decodes_grammar_rows_without_drafts():
    # n-gram speculation on: a schema-constrained request decodes one token per step (its mask is per
    # position) while a plain request in the same batch verifies drafts; the JSON is still valid
    eng = _engine(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                      "prompt_lookup_max": 3})
    schema = _add(eng, "json", 0)
    text = "Repeat exactly: the quick brown fox jumps over the lazy dog. " * 3
    eng.add_request("plain", _prompt(eng, text), SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
                    add_special_tokens=False)
    drafted: dict[str, int] = {"json": 0, "plain": 0}
    reserve = eng.spec.reserve

    def spy(out, *args):  # the step's draft slots
        reserve(out, *args)
        for s in out.scheduled:
            drafted[s.seq.request.request_id] += s.max_drafts

    eng.spec.reserve = spy
    accepted = []
    finals = run_to_completion(eng, on_step=lambda e: accepted.append(e.last_iteration.num_accepted_tokens))
    accepted = sum(accepted)
    _check(finals["json"], schema)
    assert drafted["json"] == 0 and drafted["plain"] > 0 and accepted > 0
    assert_all_blocks_free(eng)
