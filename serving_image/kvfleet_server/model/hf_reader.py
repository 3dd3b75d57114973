"""Read a Hugging Face model directory: config.json, the safetensors files (sharded or not; lazily, slice by
slice, for tensor parallelism), FP8 checkpoint scales, and the mapping of HF tensor names onto kvfleet's."""

from __future__ import annotations

import json
import os

import torch

from . import ModelConfig
from ..checkpoint_quantization import checkpoint_quantization
from .checkpoint import ModelLoadError, layer_params, tensor_getter

def read_hf_config(model_dir: str) -> ModelConfig:
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"expected config.json in model directory {model_dir!r}")
    with open(cfg_path) as f:
        raw = json.load(f)
    quantization = checkpoint_quantization(raw, model_dir)
    cfg = ModelConfig.from_hf_dict(raw)
    cfg.checkpoint_quantization = quantization
    return cfg


class LazyTensor:
    """One safetensors tensor read on demand (tensor parallelism: each rank reads only its slices).

    ``shape`` without reading; ``narrow(dim, start, length)`` reads that slice only (a torch.Tensor);
    ``materialize()`` (or ``float()``) reads it whole.
    """

    def __init__(self, handle, name: str):
        self._handle, self.name = handle, name
        sl = handle.get_slice(name)
        self.shape = tuple(sl.get_shape())
        self.dtype_name = sl.get_dtype()  # safetensors' name: "F32", "BF16", "F8_E4M3", …

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._handle.get_slice(self.name)[tuple(index)]

    def materialize(self) -> torch.Tensor:
        return self._handle.get_tensor(self.name)

    def float(self) -> torch.Tensor:
        return self.materialize().float()


def materialize(t):
    """A torch.Tensor for ``t`` (a LazyTensor is read whole; anything else is returned as is)."""
    return t.materialize() if isinstance(t, LazyTensor) else t


def read_hf_tensors(model_dir: str, lazy: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards listed by model.safetensors.index.json
    (``lazy``: as ``LazyTensor``s over the open files, read slice by slice while loading)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(
            f"expected model.safetensors or model.safetensors.index.json in {model_dir!r} (no *.safetensors found)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            raise ModelLoadError(f"expected weight shard {name!r} listed in the index at {path!r}")
        if lazy:
            handle = safe_open(path, framework="pt")
            tensors.update({k: LazyTensor(handle, k) for k in handle.keys()})
        else:
            tensors.update(load_file(path))
    return tensors


def hf_kv_cache_scales(cfg: ModelConfig, t: dict[str, torch.Tensor]) -> dict[int, tuple[float, float]]:
    """Per-layer FP8 KV-cache scales of a checkpoint (``self_attn.k_scale`` / ``v_scale``, vLLM's and
    llm-compressor's names): {layer: (k_scale, v_scale)}; empty when the checkpoint has none."""
    out = {}
    for i in range(cfg.num_hidden_layers):
        a = f"model.layers.{i}.self_attn."
        k, v = t.get(a + "k_scale"), t.get(a + "v_scale")
        if k is not None and v is not None:
            out[i] = (float(k.float().max()), float(v.float().max()))
    return out


def hf_to_kvfleet(cfg: ModelConfig, t: dict[str, torch.Tensor]) -> dict[str, list]:
    """Map HF parameter names to kvfleet's: {name: [tensor]} or, for fused layers, the list of shards."""
    get = tensor_getter(t, "HF checkpoint")
    out = {"embed_tokens.weight": [get("model.embed_tokens.weight")], "norm.weight": [get("model.norm.weight")]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = [t.get("lm_head.weight", out["embed_tokens.weight"][0])]
    for i in range(cfg.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        layer = {
            "q": get(a + "q_proj.weight"), "k": get(a + "k_proj.weight"), "v": get(a + "v_proj.weight"),
            "o": get(a + "o_proj.weight"), "gate": get(p + "mlp.gate_proj.weight"),
            "up": get(p + "mlp.up_proj.weight"), "down": get(p + "mlp.down_proj.weight"),
            "in_norm": get(p + "input_layernorm.weight"), "post_norm": get(p + "post_attention_layernorm.weight"),
        }
        if cfg.attention_bias:
            layer.update(qb=get(a + "q_proj.bias"), kb=get(a + "k_proj.bias"), vb=get(a + "v_proj.bias"))
        out.update(layer_params(i, layer))
        if cfg.checkpoint_quantization == "fp8":  # each projection's weight_scale, in the fused order
            for fused, names in FUSED_HF_PROJECTIONS.items():
                out[f"layers.{i}.{fused}.weight_scale"] = [get(p + n + ".weight_scale") for n in names]
    _check_fp8_dtypes(cfg, out)
    return out


def _dtype_name(t) -> str:
    """safetensors' dtype name of a checkpoint tensor ("F8_E4M3", "F32", …)."""
    if isinstance(t, LazyTensor):
        return t.dtype_name
    return {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}.get(t.dtype, str(t.dtype))


def _check_fp8_dtypes(cfg: ModelConfig, params: dict[str, list]) -> None:
    """An FP8 checkpoint's projection weights must be float8_e4m3fn, and no other tensor may be float8
    (a float8 lm_head or embedding has no scale here). Raises ModelLoadError naming the tensor."""
    fp8 = cfg.checkpoint_quantization == "fp8"
    for name, shards in params.items():
        want = fp8 and name.startswith("layers.") and name.endswith("_proj.weight")
        for t in shards:
            got = _dtype_name(t)
            if want and got != "F8_E4M3":
                raise ModelLoadError(f"tensor {name} of an FP8 checkpoint has dtype {got}, expected float8_e4m3fn "
                                     "(F8_E4M3)")
            if not want and got.startswith("F8"):
                raise ModelLoadError(f"tensor {name} has dtype {got}: float8 is supported only for the decoder "
                                     "projections of an FP8 checkpoint (with their weight_scale)")


#: kvfleet's fused projections and the HF tensors they hold, in row order
FUSED_HF_PROJECTIONS = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                        "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                        "down_proj": ("mlp.down_proj",)}
