"""FP8 checkpoints (issue 11): ``kvfleet-quantize`` writes compressed-tensors FP8_DYNAMIC checkpoints
(GPTQ or round-to-nearest onto the fp8 method's grid) and the engine serves them as stored — a
round-to-nearest checkpoint computes exactly what ``--quantization fp8`` computes at load, vLLM's
per-tensor ``fp8`` checkpoints load too, and other quantized formats are refused by name."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvfleet_server import LLM, SamplingParams
from kvfleet_server.errors import UnsupportedFeatureError
from kvfleet_server.model.layers.quant.fp8 import quantize_per_channel_fp8
from kvfleet_server.quantize.cli import main as quantize_main
from kvfleet_server.quantize.gptq import gptq_fp8, output_error
from kvfleet_server.quantize.writer import fp8_dynamic_quantization_config

FP8_DYNAMIC = fp8_dynamic_quantization_config()
PROMPTS = [[5, 17, 923, 4410, 88, 120, 301, 7, 7, 9], [11, 12, 13], list(range(300, 340))]


def llm(model: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    return LLM(model, device="cpu", kv_cache_memory_bytes=4 << 20, **kw)


def scores_and_tokens(m: LLM):
    """Prompt logprobs of every prompt token and 12 greedy tokens per prompt."""
    outs = m.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0))
    lps = [[e[t].logprob for t, e in zip(p[1:], o.prompt_logprobs[1:])] for p, o in zip(PROMPTS, outs)]
    return lps, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def rtn_dir(tiny_llama_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fp8_rtn"))
    assert quantize_main(["--model", tiny_llama_dir, "--output", out, "--rounding", "rtn"]) == 0
    return out


def test_the_checkpoint_is_compressed_tensors_fp8_dynamic(rtn_dir, tiny_llama_dir):
    qc = json.load(open(os.path.join(rtn_dir, "config.json")))["quantization_config"]
    assert (qc["quant_method"], qc["format"], qc["ignore"]) == ("compressed-tensors", "float-quantized", ["lm_head"])
    g = qc["config_groups"]["group_0"]
    assert g["weights"]["strategy"] == "channel" and g["input_activations"]["dynamic"] is True
    with safe_open(os.path.join(rtn_dir, "model.safetensors"), "pt") as f:
        w, s = f.get_tensor("model.layers.0.self_attn.k_proj.weight"), f.get_tensor("model.layers.0.self_attn.k_proj.weight_scale")
        assert w.dtype == torch.float8_e4m3fn and s.shape == (w.shape[0], 1) and s.dtype == torch.float32
        assert f.get_tensor("lm_head.weight").dtype == torch.float32  # ignored: kept as it was
    assert os.path.isfile(os.path.join(rtn_dir, "tokenizer.json"))  # the source's other files are copied


def test_a_round_to_nearest_checkpoint_serves_exactly_what_quantization_fp8_computes(rtn_dir, tiny_llama_dir):
    online = llm(tiny_llama_dir, quantization="fp8")
    ref_scores, ref_tokens = scores_and_tokens(online)
    served = llm(rtn_dir)  # no flag: the fp8 method is found from config.json
    assert served.engine.quantization == "fp8" and served.engine.weight_bytes == online.engine.weight_bytes
    scores, tokens = scores_and_tokens(served)
    assert tokens == ref_tokens and scores == ref_scores  # the same codes and scales: bit-identical
    assert scores_and_tokens(llm(rtn_dir, quantization="fp8")) == (scores, tokens)  # the flag is accepted


def test_gptq_rounding_lowers_the_layer_output_error_on_the_same_grid():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g)
    x = torch.randn(2048, 24, generator=g) @ torch.randn(24, 96, generator=g) + 0.1 * torch.randn(2048, 96, generator=g)
    h = x.double().T @ x.double()  # correlated inputs: where error compensation pays
    rtn8, rtn_s = quantize_per_channel_fp8(w)
    q8, s = gptq_fp8(w, h)
    assert q8.dtype == torch.float8_e4m3fn and torch.equal(s, rtn_s)  # the same per-channel scales
    assert not torch.equal(q8.view(torch.uint8), rtn8.view(torch.uint8))
    assert output_error(w, q8, s, h) < 0.7 * output_error(w, rtn8, rtn_s, h)
    with pytest.raises(ValueError, match=r"hessian has shape \[24, 24\], expected \[96, 96\]"):
        gptq_fp8(w, h[:24, :24])


def test_a_gptq_checkpoint_from_the_cli_serves_with_the_same_scales(tiny_llama_dir, rtn_dir, tmp_path, capsys):
    out = str(tmp_path / "gptq")
    assert quantize_main(["--model", tiny_llama_dir, "--output", out, "--calibration-tokens", "512",
                          "--calibration-window", "128"]) == 0
    assert "gptq rounding, 512 calibration tokens" in capsys.readouterr().out
    info = json.load(open(os.path.join(out, "kvfleet_quantize.json")))
    assert (info["rounding"], info["calibration_tokens"]) == ("gptq", 512)
    a, b = load_file(os.path.join(out, "model.safetensors")), load_file(os.path.join(rtn_dir, "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(a[name + "_scale"], b[name + "_scale"])
    assert not torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8))
    m = llm(out)
    assert m.engine.quantization == "fp8"
    assert all(len(t) == 12 for t in scores_and_tokens(m)[1])


def test_vllm_per_tensor_fp8_checkpoints_load_with_one_scale_per_shard(tiny_llama_dir, tmp_path):
    # AutoFP8 / vLLM "fp8": one scale per checkpoint tensor; q, k and v keep their own in the fused qkv_proj
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "dequantized"
    for d in (fp8_dir, ref_dir):
        shutil.copytree(tiny_llama_dir, d)
        for f in d.glob("*.safetensors*"):
            f.unlink()
    tensors, fp8, ref = load_file_all(tiny_llama_dir), {}, {}
    for name, t in tensors.items():
        if ".layers." in name and name.endswith("proj.weight"):
            s = t.float().abs().max() / 448
            q = (t.float() / s).to(torch.float8_e4m3fn)
            fp8[name], fp8[name + "_scale"], ref[name] = q, s.reshape(()), q.float() * s
        else:
            fp8[name] = ref[name] = t
    save_file(fp8, str(fp8_dir / "model.safetensors"))
    save_file(ref, str(ref_dir / "model.safetensors"))
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (fp8_dir / "config.json").write_text(json.dumps(cfg))
    got_scores, got_tokens = scores_and_tokens(llm(str(fp8_dir)))
    ref_scores, ref_tokens = scores_and_tokens(llm(str(ref_dir)))
    assert got_tokens == ref_tokens
    torch.testing.assert_close(torch.tensor(sum(got_scores, [])), torch.tensor(sum(ref_scores, [])),
                               atol=1e-4, rtol=0)  # upcast-then-scale vs pre-scaled float weights


def load_file_all(d: str) -> dict[str, torch.Tensor]:
    from kvfleet_server.model.hf_reader import read_hf_tensors

    return read_hf_tensors(d)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}},
      "ignore": ["lm_head"]}, "compressed-tensors format='pack-quantized' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                       "strategy": "block"}}},
      "ignore": ["lm_head"]}, r"weights.strategy='block'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, r"weight_block_size=\[128, 128\]"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq' is not supported"),
    # compressed-tensors keys kvfleet would not honour are refused, never ignored
    ({**FP8_DYNAMIC, "transform_config": {"config_groups": {}}}, "transform_config is not supported"),
    ({**FP8_DYNAMIC, "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]},
     r"ignore=\['model.layers.0.mlp.down_proj'\]: decoder projections left in float"),
    ({**FP8_DYNAMIC, "config_groups": {"group_0": {**FP8_DYNAMIC["config_groups"]["group_0"],
                                                   "targets": ["Linear", "Embedding"]}}},
     r"targets=\['Linear', 'Embedding'\]"),
    ({**FP8_DYNAMIC, "config_groups": [1]}, "config_groups is list, expected an object"),
    ({"quant_method": "fp8", "ignored_layers": ["model.layers.3.self_attn.o_proj"]}, "ignored_layers="),
])
def test_other_quantized_checkpoints_are_refused_by_name(tiny_llama_dir, tmp_path, qc, match):
    d = tmp_path / "q"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedFeatureError, match=match):
        llm(str(d))


def test_another_quantization_flag_on_an_fp8_checkpoint_is_refused(rtn_dir, tmp_path, capsys):
    from kvfleet_server.cli import main as server_main

    with pytest.raises(UnsupportedFeatureError, match="quantization='int8' for .* whose weights are already fp8"):
        llm(rtn_dir, quantization="int8", dtype="bfloat16")
    assert server_main(["--model", rtn_dir, "--quantization", "int4"]) == 2  # before any weight is read
    err = capsys.readouterr().err
    assert "quantization='int4'" in err and "pass --quantization fp8 or none" in err
    assert quantize_main(["--model", rtn_dir, "--output", str(tmp_path / "again")]) == 2
    assert "is already quantized (fp8)" in capsys.readouterr().err


@pytest.mark.parametrize("extra, match", [
    (["--calibration-tokens", "256"], r"--calibration-tokens \(256\) must be at least --calibration-window \(512\)"),
    (["--calibration-window", "0"], "which must be positive"),
    (["--calibration-file", "SHORT"], "the calibration text .* has \\d+ tokens; at least --calibration-window 512"),
    (["--output-is-source"], "is the --model directory"),
    (["--output-has-weights"], "already holds weights"),
])
def test_kvfleet_quantize_refuses_bad_flags_before_calibrating(tiny_llama_dir, tmp_path, capsys, extra, match):
    out = tmp_path / "out"
    if extra == ["--calibration-file", "SHORT"]:
        (tmp_path / "short.txt").write_text("too short to calibrate on")
        extra = ["--calibration-file", str(tmp_path / "short.txt")]
    elif extra == ["--output-is-source"]:
        out, extra = tiny_llama_dir, []
    elif extra == ["--output-has-weights"]:
        out.mkdir()
        (out / "model.safetensors.index.json").write_text("{}")
        extra = []
    assert quantize_main(["--model", tiny_llama_dir, "--output", str(out), *extra]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_float8_tensors_outside_the_projections_or_in_another_format_are_refused(rtn_dir, tmp_path):
    for name, dtype, match in [("lm_head.weight", torch.float8_e4m3fn, "lm_head.weight has dtype F8_E4M3: float8 "
                                "is supported only for the decoder projections"),
                               ("model.layers.0.mlp.up_proj.weight", torch.float8_e5m2,
                                "layers.0.gate_up_proj.weight of an FP8 checkpoint has dtype F8_E5M2")]:
        d = tmp_path / name
        shutil.copytree(rtn_dir, d)
        t = load_file(str(d / "model.safetensors"))
        t[name] = t[name].float().to(dtype)
        save_file(t, str(d / "model.safetensors"))
        with pytest.raises(ValueError, match=match):
            llm(str(d))


def test_kvfleet_server_serves_the_checkpoint_to_the_openai_client(rtn_dir, tmp_path):
    from server_fixtures import openai_client, running_server

    with running_server(["--model", rtn_dir, "--kv-cache-dtype", "fp8", "--kv-cache-memory-bytes", str(4 << 20),
                         "--shutdown-timeout", "5"], str(tmp_path / "server.log")) as srv:
        r = openai_client(srv).completions.create(model=rtn_dir, prompt="Hello", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        assert "weights: fp8" in srv.log()
