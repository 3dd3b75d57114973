"""EngineConfig resolution: bundled model aliases, served name, dtype/device defaults."""

from __future__ import annotations

import os

import pytest
import torch

from kvfleet_server import EngineConfig
from kvfleet_server.config import resolve_model
from kvfleet_server.errors import UnsupportedFeatureError


def test_bundled_model_aliases():
    path = resolve_model(None)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert resolve_model("smollm2") == resolve_model("SmolLM2") == path
    assert resolve_model("/some/dir") == "/some/dir"
    # vLLM's rule: the served name is the --model string as given
    assert EngineConfig().resolved_served_name() == "smollm2"
    assert EngineConfig(model="smollm2").resolved_served_name() == "smollm2"
    assert EngineConfig(model="/models/llama-3").resolved_served_name() == "/models/llama-3"
    assert EngineConfig(model="/m/tiny.gguf").resolved_served_name() == "/m/tiny.gguf"
    assert EngineConfig(served_model_name="x").resolved_served_name() == "x"


def test_dtype_defaults_on_cpu():
    cfg = EngineConfig(device="cpu", model="/models/some-hf-dir")
    assert cfg.resolved_device() == "cpu" and cfg.resolved_dtype() == torch.float32
    assert EngineConfig(device="cpu", model="/m/dir", quantization="fp8").resolved_dtype() == torch.float32
    # packed int8/int4/GGUF kernels are vectorized for bfloat16 activations: auto picks bfloat16
    bundled = EngineConfig(device="cpu")
    assert bundled.resolved_quantization() == "gguf" and bundled.resolved_dtype() == torch.bfloat16
    assert EngineConfig(device="cpu", model="/m/dir", quantization="int4").resolved_dtype() == torch.bfloat16
    assert EngineConfig(device="cpu", dtype="float32").resolved_dtype() == torch.float32
    assert EngineConfig(device="cpu", dtype="float32").resolved_quantization() is None  # dequantized, as before
    assert EngineConfig(device="cpu", dtype="bfloat16").resolved_dtype() == torch.bfloat16
    with pytest.raises(UnsupportedFeatureError, match="float16 on CPU"):
        EngineConfig(device="cpu", dtype="float16")  # refused at validation, before the server binds its port
    if not torch.cuda.is_available():
        with pytest.raises(UnsupportedFeatureError, match="float16 on CPU"):
            EngineConfig(device="auto", dtype="float16").resolved_dtype()  # auto resolved to cpu


def test_bfloat16_engine_runs(tiny_engine_factory):
    from kvfleet_server import SamplingParams

    eng = tiny_engine_factory(dtype="bfloat16", block_size=4)
    assert eng.runner.kv_caches[0][0].dtype == torch.bfloat16
    eng.add_request("a", [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    out = []
    while eng.has_unfinished():
        out += eng.step()
    assert len(out[-1].outputs[0].token_ids) == 5
