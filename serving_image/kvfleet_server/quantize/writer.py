"""Write an FP8 checkpoint from a float Hugging Face checkpoint: every decoder projection's weight
as float8_e4m3fn with its per-output-channel ``weight_scale`` [N, 1] float32, everything else (embedding,
norms, lm_head, biases) copied unchanged, in compressed-tensors' ``FP8_DYNAMIC`` layout
(``format: float-quantized``, dynamic per-token activation scales, ``lm_head`` ignored): what
llm-compressor writes and vLLM and kvfleet load (``checkpoint_quantization.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch

from ..model.hf_reader import FUSED_HF_PROJECTIONS

#: HF projection names → the kvfleet projection whose inputs they see (the calibration's H)
HF_PROJECTIONS = {hf: fused for fused, names in FUSED_HF_PROJECTIONS.items() for hf in names}
_WEIGHT = re.compile(r"model\.layers\.(\d+)\.(" + "|".join(re.escape(k) for k in HF_PROJECTIONS) + r")\.weight$")
#: files of a checkpoint directory that are not copied (rewritten or replaced)
_NOT_COPIED = re.compile(r".*\.(safetensors|bin|pt|pth|gguf|h5|msgpack|ckpt)$|.*\.index\.json$|config\.json$|"
                         r"kvfleet_quantize\.json$")


def fp8_dynamic_quantization_config() -> dict:
    """config.json's ``quantization_config`` of an FP8_DYNAMIC checkpoint (compressed-tensors)."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
               "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
               "observer_kwargs": {}}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True,
            "group_size": None, "block_structure": None, "actorder": None, "observer": None, "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def quantize_tensors(tensors: dict[str, torch.Tensor], round_fn) -> dict[str, torch.Tensor]:
    """A float checkpoint's tensors with each decoder projection weight replaced by ``round_fn(layer,
    kvfleet projection name, w [N, K] float32)`` → (w8 [N, K] float8_e4m3fn, scale [N] float32), stored as
    ``…weight`` and ``…weight_scale`` [N, 1]; all other tensors unchanged (pure)."""
    out = {}
    for name, t in tensors.items():
        m = _WEIGHT.match(name)
        if m is None:
            out[name] = t
            continue
        w8, s = round_fn(int(m.group(1)), HF_PROJECTIONS[m.group(2)], t.float())
        out[name] = w8.contiguous()
        out[name[:-len("weight")] + "weight_scale"] = s.float().reshape(-1, 1).contiguous()
    return out


def write_fp8_checkpoint(src_dir: str, out_dir: str, tensors: dict[str, torch.Tensor], info: dict) -> None:
    """Write ``tensors`` (from ``quantize_tensors``) as ``out_dir``/model.safetensors, the source's
    config.json with the FP8_DYNAMIC ``quantization_config``, the source's other files (tokenizer,
    chat template, generation config) copied, and ``kvfleet_quantize.json`` (``info``: how it was made)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(src_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = fp8_dynamic_quantization_config()
    for name in os.listdir(src_dir):
        if not _NOT_COPIED.match(name) and os.path.isfile(os.path.join(src_dir, name)):
            shutil.copy2(os.path.join(src_dir, name), os.path.join(out_dir, name))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(out_dir, "kvfleet_quantize.json"), "w") as f:
        json.dump(info, f, indent=1)
