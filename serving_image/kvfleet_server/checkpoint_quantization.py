"""Which already-quantized Hugging Face checkpoints kvfleet loads, read from config.json's
``quantization_config`` (pure: a dict in, a method name or an error out).

Loaded: FP8 weights (float8_e4m3fn) with per-output-channel or per-tensor scales, served by the fp8
method (``fp8.Fp8LinearMethod(serialized=True)``):
- compressed-tensors (llm-compressor's ``FP8_DYNAMIC`` / ``FP8`` schemes and ``kvfleet-quantize``):
  ``quant_method: "compressed-tensors"``, ``format: "float-quantized"``, every config group's
  ``weights`` 8-bit ``float``, symmetric, ``strategy`` "channel" (``weight_scale`` [N, 1]) or "tensor"
  (one scale per checkpoint tensor); ``lm_head`` in ``ignore``. Activation scales are dynamic per token
  on the ``torch._scaled_mm`` path whatever the checkpoint says (a static ``input_scale`` is not read).
- vLLM/AutoFP8's ``quant_method: "fp8"`` serialized checkpoints (per-tensor ``weight_scale``), not
  block-wise (``weight_block_size``).
Everything else that is already quantized (awq, gptq, int4/int8 compressed-tensors, bitsandbytes, …) is
refused by name.
"""

from __future__ import annotations

import re

from .errors import UnsupportedFeatureError

#: what kvfleet loads from a float checkpoint (quantized at load) — for the error message
_LOADS = ("kvfleet loads float (fp32/bf16/fp16) safetensors checkpoints (quantized at load with --quantization "
          "fp8/int8/int4), FP8 checkpoints (compressed-tensors float-quantized, or quant_method 'fp8' per-tensor) "
          "and GGUF files")


def checkpoint_quantization(hf_config: dict, path: str) -> str | None:
    """The quantization method a checkpoint's weights are stored in: None for a float checkpoint, "fp8"
    for a supported FP8 one. Raises UnsupportedFeatureError naming the format and the field otherwise
    (an allow-list: a key kvfleet would not honour is refused, never ignored)."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    qc = _obj(qc, "quantization_config", path)
    fmt = str(qc.get("quant_method") or qc.get("format") or "unknown")
    if fmt == "compressed-tensors":
        _check_compressed_tensors(qc, path)
        return "fp8"
    if fmt == "fp8":
        _check_vllm_fp8(qc, path)
        return "fp8"
    _refuse(path, f"quantization_config.quant_method={fmt!r} is not supported")


def check_quantization_flag(flag: str | None, stored: str | None, path: str) -> None:
    """Raise UnsupportedFeatureError naming ``--quantization`` when it asks for another method than the
    one the checkpoint's weights are stored in (``stored``, from ``checkpoint_quantization``)."""
    if stored is not None and flag not in (None, stored):
        raise UnsupportedFeatureError(
            f"not supported: quantization={flag!r} for {path!r}, whose weights are already {stored} "
            f"(quantization_config in config.json): pass --quantization {stored} or none")


def _check_vllm_fp8(qc: dict, path: str) -> None:
    """vLLM/AutoFP8 ``quant_method: "fp8"``: per-tensor e4m3 scales, every decoder projection in FP8."""
    if qc.get("weight_block_size"):
        _refuse(path, f"quant_method='fp8' with weight_block_size={qc['weight_block_size']} (block-wise FP8 "
                      "scales) is not supported yet; per-tensor and per-channel scales are")
    if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        _refuse(path, f"quantization_config.activation_scheme={qc['activation_scheme']!r} (expected 'dynamic' "
                      "or 'static')")
    for key in ("ignored_layers", "modules_to_not_convert"):
        _check_ignore(qc.get(key), f"quantization_config.{key}", path)


def _check_compressed_tensors(qc: dict, path: str) -> None:
    """compressed-tensors: FP8 weights (channel or tensor scales) on every decoder Linear, nothing else."""
    if qc.get("format") != "float-quantized":
        _refuse(path, f"compressed-tensors format={qc.get('format')!r} is not supported (only 'float-quantized': "
                      "FP8 weights)")
    for key in ("transform_config", "sparsity_config"):
        sub = qc.get(key)
        if sub and not (key == "sparsity_config" and _obj(sub, key, path).get("format") == "dense"):
            _refuse(path, f"compressed-tensors {key} is not supported (rotations and sparse layouts are not built)")
    kv = qc.get("kv_cache_scheme")
    if kv and (_obj(kv, "kv_cache_scheme", path).get("type") != "float" or kv.get("num_bits") != 8):
        _refuse(path, f"compressed-tensors kv_cache_scheme type={kv.get('type')!r}, num_bits={kv.get('num_bits')!r} "
                      "is not supported (only 8-bit float KV-cache scales)")
    groups = _obj(qc.get("config_groups") or {}, "config_groups", path)
    if not groups:
        _refuse(path, "compressed-tensors quantization_config has no config_groups")
    for name, g in groups.items():
        where = f"compressed-tensors config_groups.{name}"
        g = _obj(g, where, path)
        if g.get("targets") != ["Linear"]:
            _refuse(path, f"{where}.targets={g.get('targets')!r}: only ['Linear'] is supported")
        if g.get("format") not in (None, "float-quantized"):
            _refuse(path, f"{where}.format={g.get('format')!r} is not supported (only 'float-quantized')")
        if g.get("output_activations"):
            _refuse(path, f"{where}.output_activations is not supported")
        w = _obj(g.get("weights") or {}, where + ".weights", path)
        if w.get("type") != "float" or w.get("num_bits") != 8:
            _refuse(path, f"{where}.weights: type={w.get('type')!r}, num_bits={w.get('num_bits')!r} is not "
                          "supported (only 8-bit float weights)")
        if w.get("strategy") not in ("channel", "tensor") or w.get("symmetric") is False:
            _refuse(path, f"{where}.weights.strategy={w.get('strategy')!r} (symmetric={w.get('symmetric')!r}) is not "
                          "supported (only symmetric 'channel' or 'tensor' scales)")
        for key in ("dynamic", "group_size", "block_structure"):
            if w.get(key):
                _refuse(path, f"{where}.weights.{key}={w[key]!r} is not supported (static per-channel or "
                              "per-tensor weight scales only)")
        a = g.get("input_activations")
        if a and (_obj(a, where + ".input_activations", path).get("type") != "float" or a.get("num_bits") != 8):
            _refuse(path, f"{where}.input_activations: type={a.get('type')!r}, num_bits={a.get('num_bits')!r} is "
                          "not supported (only 8-bit float or none)")
    ignore = qc.get("ignore") or []
    if not any(_matches(e, "lm_head") for e in ignore):
        _refuse(path, "compressed-tensors checkpoints with a quantized lm_head are not supported (expected "
                      "'lm_head' in ignore)")
    _check_ignore(ignore, "compressed-tensors ignore", path)


def _matches(entry: str, name: str) -> bool:
    """compressed-tensors' module matching: a name, its last component, or ``re:<regex>``."""
    if entry.startswith("re:"):
        return re.fullmatch(entry[3:], name) is not None
    return entry == name or name.endswith("." + entry)


def _check_ignore(ignore, where: str, path: str) -> None:
    """Every entry may name only the lm_head or the embedding: decoder projections are all FP8."""
    others = [e for e in ignore or [] if not any(_matches(str(e), n) for n in ("lm_head", "model.embed_tokens"))]
    if others:
        _refuse(path, f"{where}={others}: decoder projections left in float among FP8 ones are not supported "
                      "(every decoder Linear must be FP8)")


def _obj(x, where: str, path: str) -> dict:
    if not isinstance(x, dict):
        _refuse(path, f"{where} is {type(x).__name__}, expected an object")
    return x


def _refuse(path: str, why: str):
    raise UnsupportedFeatureError(f"not supported: checkpoint {path!r} is already quantized: {why}; {_LOADS}")
