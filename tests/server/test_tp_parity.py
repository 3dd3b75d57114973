"""Tensor parallelism on random-weight Llama models (must-show 2): TP = 2 and 4 with 8 query / 2 KV
heads (KV-head replication at TP = 4) and 8 / 8 heads at TP = 2 give the logits of TP = 1 (float32; the
all-reduce order moves the last bits only), and greedy generation gives the same tokens; so do int8,
int4 and fp8 weights quantized at load, and an FP8 checkpoint. A model with
9 query heads is refused at TP = 2 with the numbers, before any worker starts.

Ranks 1..N-1 are real worker processes (gloo on the CPU), one intra-op thread each."""

from __future__ import annotations

import pytest
import torch

from tiny_models import _save_tiny
from kvfleet_server import EngineConfig, LLMEngine, SamplingParams
from kvfleet_server.sequence import Request, ScheduledSeq, Sequence
from kvfleet_server.errors import UnsupportedFeatureError

IDS = [5, 17, 923, 4410, 88, 12000, 301, 7, 7, 9, 45000, 1234, 16, 2048, 99, 3, 600, 42, 420, 4242, 31, 8,
       77, 1500, 9000, 3, 3, 3, 123, 456, 789]
PROMPTS = [IDS[:7], IDS, IDS[3:25], [11, 12, 13]]


@pytest.fixture(scope="module")
def heads_8_2(tmp_path_factory, hf_tokenizer_dir):
    return _save_tiny("llama", str(tmp_path_factory.mktemp("h8_2")), hf_tokenizer_dir,
                      num_attention_heads=8, num_key_value_heads=2)


@pytest.fixture(scope="module")
def heads_8_8(tmp_path_factory, hf_tokenizer_dir):
    return _save_tiny("qwen2", str(tmp_path_factory.mktemp("h8_8")), hf_tokenizer_dir,
                      num_attention_heads=8, num_key_value_heads=8)


def engine(model_dir: str, tp: int, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, tensor_parallel_size=tp, dtype="float32", device="cpu",
                                  kv_cache_memory_bytes=(2 << 20) // tp, num_threads=1, **kw))


def logits_and_tokens(model_dir: str, tp: int, **kw):
    """Logits of every prompt position (chunked prefill + decodes through the paged cache) and greedy
    generations with their logprobs."""
    eng = engine(model_dir, tp, **kw)
    try:
        assert eng.tp.world_size == tp and len(eng.workers.pids() if eng.workers else []) == tp - 1
        req = Request("probe", None, IDS, SamplingParams(), 0.0, 1)
        seq = Sequence(req, 0, IDS, None)
        rows = []
        for n in (12, 9, 1, 1, 8):
            eng.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, n)
            batch = eng.runner.execute([ScheduledSeq(seq, n).span(eng.kv.block_ids(seq.seq_id))])
            rows.append(eng.runner.compute_logits(batch, list(range(n))))
            seq.num_computed_tokens += n
        eng.kv.free(seq.seq_id)
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"g{i}", p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1))
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0]
        gens = [(outs[f"g{i}"].token_ids, [lp[t].logprob for lp, t in zip(outs[f"g{i}"].logprobs,
                                                                           outs[f"g{i}"].token_ids)])
                for i in range(len(PROMPTS))]
        return torch.cat(rows), gens
    finally:
        eng.shutdown()


def _compare(ref, got):
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)
    for (rt, rl), (gt, gl) in zip(ref[1], got[1]):
        assert gt == rt
        torch.testing.assert_close(torch.tensor(gl), torch.tensor(rl), atol=1e-4, rtol=0)


def test_gqa_8_2_at_tp_2_and_4_matches_tp_1(heads_8_2):
    ref = logits_and_tokens(heads_8_2, 1)
    for tp in (2, 4):  # TP = 4 > 2 KV heads: each KV head replicated on 2 ranks
        _compare(ref, logits_and_tokens(heads_8_2, tp))


def test_an_fp8_checkpoint_shards_with_its_scales(heads_8_2, tmp_path):
    """A serialized FP8 checkpoint (kvfleet-quantize): each rank cuts the stored codes and their
    per-channel scales (column-parallel: the scales follow their rows; row-parallel: every rank keeps
    the whole rows' scales), giving TP = 1's logits and tokens."""
    from kvfleet_server.quantize.cli import main as quantize_main

    out = str(tmp_path / "fp8")
    assert quantize_main(["--model", heads_8_2, "--output", out, "--rounding", "rtn"]) == 0
    ref = logits_and_tokens(out, 1)
    _compare(logits_and_tokens(heads_8_2, 1, quantization="fp8"), ref)  # the same model as quantized at load
    _compare(ref, logits_and_tokens(out, 2))


def test_mha_8_8_with_qkv_bias_and_tied_embeddings_at_tp_2_matches_tp_1(heads_8_8):
    _compare(logits_and_tokens(heads_8_8, 1), logits_and_tokens(heads_8_8, 2))


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_quantized_weights_shard_with_their_scales(heads_8_2, quantization):
    """Quantized at load per rank: per-output-channel scales (int8, fp8) follow their rows through the
    column-parallel split, int4's groups of 32 along K stay whole through the row-parallel split."""
    _compare(logits_and_tokens(heads_8_2, 1, quantization=quantization),
             logits_and_tokens(heads_8_2, 2, quantization=quantization))


def test_nine_heads_at_tp_2_refused_with_the_numbers(tmp_path, hf_tokenizer_dir):
    d = _save_tiny("llama", str(tmp_path / "h9"), hf_tokenizer_dir, hidden_size=72, num_attention_heads=9,
                   num_key_value_heads=3)
    with pytest.raises(UnsupportedFeatureError, match=r"tensor_parallel_size=2 does not divide "
                                                      r"num_attention_heads=9.*possible sizes: \[1, 3, 9\]"):
        engine(d, 2)
