"""Loader errors name what was expected: unknown architecture, missing file, missing tensor, wrong shape."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfleet_server.errors import UnsupportedFeatureError
from kvfleet_server.model.checkpoint import ModelLoadError
from kvfleet_server.model.loader import load_model


def _copy(src, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    return dst


def test_missing_dir_or_config(tmp_path):
    with pytest.raises(ModelLoadError, match="model directory with config.json or a .gguf file"):
        load_model(str(tmp_path / "nope"), torch.float32, "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="expected config.json"):
        load_model(str(tmp_path / "empty"), torch.float32, "cpu")


def test_unknown_architecture(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MambaForCausalLM"], "mamba"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedFeatureError, match="LlamaForCausalLM"):
        load_model(str(d), torch.float32, "cpu")


def test_missing_weights_file(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(str(d), torch.float32, "cpu")


@pytest.mark.parametrize("edit, error", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "model.layers.1.mlp.up_proj.weight"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 60)}),
     r"o_proj.weight has shape \[64, 60\], expected \[64, 64\]"),
], ids=["missing_tensor", "wrong_shape"])
def test_bad_checkpoint_tensor(tiny_llama_dir, tmp_path, edit, error):
    d = _copy(tiny_llama_dir, tmp_path)
    st = str(d / "model.safetensors")
    tensors = load_file(st)
    edit(tensors)
    save_file(tensors, st)
    with pytest.raises(ModelLoadError, match=error):
        load_model(str(d), torch.float32, "cpu")
