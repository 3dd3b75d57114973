"""Read a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) and check it against
the base model; keep recently used adapters in host memory (vLLM's ``--max-cpu-loras`` LRU).

A PEFT adapter (Hu et al. 2021, "LoRA"; the Hugging Face PEFT format) stores, per targeted projection,
``base_model.model.<module>.lora_A.weight`` [r, in] and ``.lora_B.weight`` [out, r]; the adapted weight
is W + scale·B·A with scale = lora_alpha / r (rsLoRA, ``use_rslora``: lora_alpha / √r, Kalajdzievski
2023). kvfleet applies it to the seven Llama projections; the module names below are the checkpoint's.

Errors are ``LoRAError`` (a ValueError) naming the field and the limit: the server turns them into
HTTP 400 (runtime loading) or exit 2 (``--lora-modules`` at start-up).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .config import ModelConfig

#: PEFT module name → (kvfleet Linear, output shard of that fused Linear)
TARGET_MODULES = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.[\w-]+)?\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served: the message names the field (or file) and the limit."""

    def __init__(self, message: str, param: str = "lora_path", status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass
class LoRAAdapter:
    """One adapter's weights in host memory.

    Attributes:
        name: the name requests select it by (the ``model`` field).
        rank: r, the adapter's rank (≤ --max-lora-rank).
        scale: lora_alpha / r, or lora_alpha / √r with rsLoRA; applied as y += scale·(x Aᵀ) Bᵀ.
        weights: (layer index, PEFT module name) → (A [r, in], B [out, r]), float32, full (unsharded) size.
    """

    name: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT module name → (in features, out features) of the base model's projection."""
    d, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, inter), "up_proj": (d, inter), "down_proj": (inter, d)}


def read_adapter_config(path: str) -> dict:
    """The adapter's ``adapter_config.json`` as a dict. Raises LoRAError (404 when the directory or file
    is missing, 400 when it is not a LoRA config kvfleet serves)."""
    if not os.path.isdir(path):
        raise LoRAError(f"lora_path {path!r} is not a directory (a PEFT adapter: {CONFIG_FILE} + {WEIGHTS_FILE})",
                        status=404)
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise LoRAError(f"{CONFIG_FILE} is missing in lora_path {path!r}", status=404)
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{CONFIG_FILE} in {path!r} cannot be read: {exc}") from exc
    if not isinstance(raw, dict):
        raise LoRAError(f"{CONFIG_FILE} in {path!r} must hold a JSON object")
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"peft_type {raw.get('peft_type')!r} is not supported (only LORA)", param="peft_type")
    for field, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (embeddings / lm_head)"),
                        ("rank_pattern", "per-module ranks (rank_pattern)"),
                        ("alpha_pattern", "per-module alphas (alpha_pattern)")):
        if raw.get(field):
            raise LoRAError(f"{field}: {what} is not supported", param=field)
    if raw.get("bias", "none") not in ("none", None):
        raise LoRAError(f"bias {raw['bias']!r} is not supported (only 'none')", param="bias")
    return raw


def load_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check the PEFT adapter at ``path`` against base model ``cfg``.

    Raises LoRAError when: the directory or a file is missing (404); r is not in [1, ``max_rank``]
    (--max-lora-rank); a target module is not one of the seven Llama projections (``target_modules``);
    a tensor's shape does not fit the base model (e.g. an adapter for another hidden size); a layer index is
    past the model's layers; lora_A or lora_B of a module is missing.
    """
    raw = read_adapter_config(path)
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"r must be a positive integer, got {rank!r}", param="r")
    if rank > max_rank:
        raise LoRAError(f"adapter {name!r}: r={rank} exceeds --max-lora-rank {max_rank}", param="r")
    targets = raw.get("target_modules") or []
    if not isinstance(targets, str) and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise LoRAError(f"target_modules must be a list of module names or a string, got {targets!r}",
                        param="target_modules")
    if isinstance(targets, str):
        targets = [] if targets == "all-linear" else [targets] if targets in TARGET_MODULES else targets
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise LoRAError(f"target_modules {unknown} are not supported (LoRA applies to "
                            f"{', '.join(TARGET_MODULES)})", param="target_modules")
    alpha = raw.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAError(f"lora_alpha must be a finite number, got {alpha!r}", param="lora_alpha")
    scale = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise LoRAError(f"{WEIGHTS_FILE} is missing in lora_path {path!r}", status=404)
    from safetensors.torch import load_file

    try:
        tensors = load_file(weights_path)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise LoRAError(f"{WEIGHTS_FILE} in {path!r} cannot be read: {exc}") from exc
    shapes = module_shapes(cfg)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            module = key.split(".lora_")[0].rsplit(".", 1)[-1] if ".lora_" in key else key
            raise LoRAError(f"tensor {key!r}: module {module!r} is not supported (LoRA applies to "
                            f"{', '.join(TARGET_MODULES)}; embeddings and lm_head are not)", param="target_modules")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if not t.is_floating_point() or not torch.isfinite(t).all():
            raise LoRAError(f"tensor {key!r} must hold finite floating-point values (dtype {t.dtype})",
                            param="lora_path")
        if which in parts.get((layer, module), {}):
            raise LoRAError(f"tensor {key!r}: a second lora_{which} of layers.{layer}.{module}", param="lora_path")
        if module not in TARGET_MODULES:
            raise LoRAError(f"tensor {key!r}: module {module!r} is not supported (LoRA applies to "
                            f"{', '.join(TARGET_MODULES)})", param="target_modules")
        if layer >= cfg.num_hidden_layers:
            raise LoRAError(f"tensor {key!r}: layer {layer} is past the base model's {cfg.num_hidden_layers} layers",
                            param="lora_path")
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(t.shape) != want:
            raise LoRAError(f"tensor {key!r} has shape {list(t.shape)}; the base model's {module} with r={rank} "
                            f"needs {list(want)} (an adapter for a different model?)", param="lora_path")
        parts.setdefault((layer, module), {})[which] = t.float()
    weights = {}
    for (layer, module), ab in parts.items():
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise LoRAError(f"layers.{layer}.{module}: lora_{missing} is missing in {WEIGHTS_FILE}", param="lora_path")
        weights[(layer, module)] = (ab["A"], ab["B"])
    if not weights:
        raise LoRAError(f"{WEIGHTS_FILE} in {path!r} holds no LoRA tensor", param="lora_path")
    return LoRAAdapter(name, rank, float(scale), weights)


class AdapterCache:
    """Adapters kept in host memory, least recently used evicted past ``capacity`` (``--max-cpu-loras``).
    Each rank keeps its own: a miss reads the adapter from disk again (``load_adapter``)."""

    def __init__(self, capacity: int, cfg: ModelConfig, max_rank: int):
        self.capacity = max(1, capacity)
        self.cfg = cfg
        self.max_rank = max_rank
        self._adapters: OrderedDict[tuple[str, int], LoRAAdapter] = OrderedDict()

    def get(self, lora) -> LoRAAdapter:
        """The adapter of ``lora`` (a ``sequence.LoRARequest``; read from its path on a miss), keyed by its
        name and id: a name loaded again from another path is another adapter. Raises LoRAError."""
        key = (lora.name, lora.lora_int_id)
        adapter = self._adapters.get(key)
        if adapter is None:
            adapter = load_adapter(lora.name, lora.path, self.cfg, self.max_rank)
            self._adapters[key] = adapter
            while len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)
        self._adapters.move_to_end(key)
        return adapter

    def names(self) -> list[str]:
        """Names of the adapters held, least recently used first."""
        return [name for name, _ in self._adapters]
