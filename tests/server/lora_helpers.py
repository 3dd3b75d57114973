"""PEFT-format LoRA adapters made in the tests (seeded random A and B), and the merged-weight reference:
transformers' model with W + scale·B·A in every targeted projection."""

from __future__ import annotations

import json
import math
import os

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def module_dims(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a transformers LlamaConfig-like object (hidden_size, heads…)."""
    d = cfg.hidden_size
    hd = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, inter), "up_proj": (d, inter), "down_proj": (inter, d)}


def make_adapter(path: str, cfg, r: int = 8, alpha: float = 16, targets=ALL_TARGETS, seed: int = 0,
                 std: float = 0.05, rslora: bool = False, layers=None, extra_config: dict | None = None) -> str:
    """Write a PEFT adapter (adapter_config.json + adapter_model.safetensors) for a model with config
    ``cfg``: A and B ~ N(0, std²), seeded. Returns ``path``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    dims = module_dims(cfg)
    tensors = {}
    for i in (range(cfg.num_hidden_layers) if layers is None else layers):
        for m in targets:
            fan_in, fan_out = dims[m]
            pre = f"base_model.model.model.layers.{i}.{_PARENT[m]}.{m}"
            tensors[pre + ".lora_A.weight"] = torch.randn(r, fan_in, generator=g) * std
            tensors[pre + ".lora_B.weight"] = torch.randn(fan_out, r, generator=g) * std
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
              "use_rslora": rslora, "bias": "none", "task_type": "CAUSAL_LM"} | (extra_config or {})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def merge_adapter(model, path: str) -> None:
    """Add scale·B·A of the adapter at ``path`` to ``model``'s (a transformers LlamaForCausalLM) weights."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            name = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            w = params[name]
            w += (scale * (b.double() @ a.double())).to(w.dtype)
