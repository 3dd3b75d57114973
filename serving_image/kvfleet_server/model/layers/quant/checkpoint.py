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

from ....errors import UnsupportedFeatureError

#: what kvfleet loads from a float checkpoint (quantized at load) — for the error message
_LOADS = ("kvfleet loads float (fp32/bf16/fp16) safetensors checkpoints (quantized at load with --quantization "
          "fp8/int8/int4), FP8 checkpoints (compressed-tensors float-quantized, or quant_method 'fp8' per-tensor) "
          "and GGUF files")


def checkpoint_quantization(hf_config: dict, path: str) -> str | None:
    """The quantization method a checkpoint's weights are stored in: None for a float checkpoint, "fp8"
    for a supported FP8 one. Raises UnsupportedFeatureError naming the format and the field otherwise."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        _refuse(path, "quantization_config is not an object")
    fmt = str(qc.get("quant_method") or qc.get("format") or "unknown")
    if fmt == "compressed-tensors":
        _check_compressed_tensors(qc, path)
        return "fp8"
    if fmt == "fp8":
        if qc.get("weight_block_size"):
            _refuse(path, f"quant_method='fp8' with weight_block_size={qc['weight_block_size']} (block-wise FP8 "
                          "scales) is not supported yet; per-tensor and per-channel scales are")
        return "fp8"
    _refuse(path, f"quantization_config.quant_method={fmt!r} is not supported")


def check_quantization_flag(flag: str | None, stored: str | None, path: str) -> None:
    """Raise UnsupportedFeatureError naming ``--quantization`` when it asks for another method than the
    one the checkpoint's weights are stored in (``stored``, from ``checkpoint_quantization``)."""
    if stored is not None and flag not in (None, stored):
        raise UnsupportedFeatureError(
            f"not supported: quantization={flag!r} for {path!r}, whose weights are already {stored} "
            f"(quantization_config in config.json): pass --quantization {stored} or none")


def _check_compressed_tensors(qc: dict, path: str) -> None:
    if qc.get("format") != "float-quantized":
        _refuse(path, f"compressed-tensors format={qc.get('format')!r} is not supported (only 'float-quantized': "
                      "FP8 weights)")
    groups = qc.get("config_groups") or {}
    if not groups:
        _refuse(path, "compressed-tensors quantization_config has no config_groups")
    for name, g in groups.items():
        w = (g or {}).get("weights") or {}
        where = f"compressed-tensors config_groups.{name}.weights"
        if w.get("type") != "float" or w.get("num_bits") != 8:
            _refuse(path, f"{where}: type={w.get('type')!r}, num_bits={w.get('num_bits')!r} is not supported "
                          "(only 8-bit float weights)")
        if w.get("strategy") not in ("channel", "tensor") or w.get("symmetric") is False:
            _refuse(path, f"{where}.strategy={w.get('strategy')!r} (symmetric={w.get('symmetric')!r}) is not "
                          "supported (only symmetric 'channel' or 'tensor' scales)")
        if "Linear" not in (g.get("targets") or []):
            _refuse(path, f"compressed-tensors config_groups.{name}.targets={g.get('targets')!r}: only groups "
                          "that target 'Linear' are supported")
        a = g.get("input_activations")
        if a and (a.get("type") != "float" or a.get("num_bits") != 8):
            _refuse(path, f"compressed-tensors config_groups.{name}.input_activations: type={a.get('type')!r}, "
                          f"num_bits={a.get('num_bits')!r} is not supported (only 8-bit float or none)")
    ignore = list(qc.get("ignore") or [])
    if "lm_head" not in ignore:
        _refuse(path, "compressed-tensors checkpoints with a quantized lm_head are not supported (expected "
                      "'lm_head' in ignore)")
    if set(ignore) - {"lm_head", "model.embed_tokens"}:
        _refuse(path, f"compressed-tensors ignore={ignore}: decoder projections left in float among FP8 ones are "
                      "not supported (every decoder Linear must be FP8)")


def _refuse(path: str, why: str):
    raise UnsupportedFeatureError(f"not supported: checkpoint {path!r} is already quantized: {why}; {_LOADS}")
