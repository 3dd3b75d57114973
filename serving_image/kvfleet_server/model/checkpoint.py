"""What every checkpoint reader shares: the load error, the model-file test, and kvfleet's parameter names
with the shapes the architecture gives them (a reader maps its tensors onto ``layer_params``; ``load_model``
checks them with ``check_shapes``)."""

from __future__ import annotations

import os

import torch

from . import ModelConfig

class ModelLoadError(ValueError):
    """A model file is missing or does not match what the architecture expects."""


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def tensor_getter(t: dict[str, torch.Tensor], where: str):
    def get(name: str) -> torch.Tensor:
        if name not in t:
            raise ModelLoadError(f"expected tensor {name!r} in the {where}; it is missing")
        return t[name]

    return get


def layer_params(i: int, p: dict) -> dict[str, list]:
    """kvfleet names of one decoder layer → its checkpoint tensors (fused layers: one per shard)."""
    pre = f"layers.{i}."
    out = {
        pre + "qkv_proj.weight": [p["q"], p["k"], p["v"]],
        pre + "o_proj.weight": [p["o"]],
        pre + "gate_up_proj.weight": [p["gate"], p["up"]],
        pre + "down_proj.weight": [p["down"]],
        pre + "input_layernorm.weight": [p["in_norm"]],
        pre + "post_attention_layernorm.weight": [p["post_norm"]],
    }
    if "qb" in p:
        out[pre + "qkv_proj.bias"] = [p["qb"], p["kb"], p["vb"]]
    return out


def _shape(shards: list) -> tuple[int, ...]:
    """Shape of the concatenation of shards along the output rows."""
    shapes = [tuple(s.shape) for s in shards]
    if len(shapes) == 1:
        return shapes[0]
    return (sum(s[0] for s in shapes), *shapes[0][1:]) if len({s[1:] for s in shapes}) == 1 else tuple(shapes)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """kvfleet parameter name → the shape the architecture gives it ([out, in] for weights; fused layers
    whole), every parameter of an unquantized model: embedding, lm_head (untied), norms, projections, biases."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    expected = {"embed_tokens.weight": (cfg.vocab_size, d), "norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        expected["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}."
        expected.update({
            pre + "qkv_proj.weight": (q + 2 * kv, d), pre + "o_proj.weight": (d, q),
            pre + "gate_up_proj.weight": (2 * cfg.intermediate_size, d),
            pre + "down_proj.weight": (d, cfg.intermediate_size),
            pre + "input_layernorm.weight": (d,), pre + "post_attention_layernorm.weight": (d,),
        })
        if cfg.attention_bias:
            expected[pre + "qkv_proj.bias"] = (q + 2 * kv,)
    return expected


def check_shapes(cfg: ModelConfig, params: dict[str, list]) -> None:
    """Compare each source tensor with what the architecture expects (``expected_shapes``)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    for name, shape in expected_shapes(cfg).items():
        got = _shape(params[name])
        if got != shape:
            raise ModelLoadError(
                f"tensor {name} has shape {list(got)}, expected {list(shape)} for {cfg.architecture} "
                f"(hidden_size={d}, heads={cfg.num_attention_heads}, kv_heads={cfg.num_key_value_heads}, "
                f"head_dim={hd}, intermediate_size={cfg.intermediate_size}, vocab_size={cfg.vocab_size})"
            )
