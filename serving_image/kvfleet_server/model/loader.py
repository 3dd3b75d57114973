"""Load a Llama-family model from a Hugging Face directory (config.json + safetensors, sharded or
not: hf_reader.py) or from a single GGUF file (metadata + tensors, kept packed or dequantized with the
``gguf`` package: gguf_reader.py), checking every tensor's shape (checkpoint.py).

Weights end up equal to what transformers loads from the same files: for llama GGUFs the
Q/K row permutation applied by llama.cpp's converter is reversed (as transformers'
``LlamaTensorProcessor`` does; on packed tensors the rows, i.e. output channels, are permuted whole).

Loading goes through each parameter's ``weight_loader`` (fused q/k/v and gate/up arrive as shards),
then every ``Linear``'s quant method converts its weights (``process_weights_after_loading``).
"""

from __future__ import annotations

import logging
import os

import torch

from ..errors import UnsupportedFeatureError
from . import MODEL_REGISTRY, ModelConfig
from .config import SUPPORTED_ARCHITECTURES
from .layers.linear import Linear
from .layers.quant import QuantConfig
from ..checkpoint_quantization import check_quantization_flag
from .checkpoint import ModelLoadError, check_shapes, is_gguf
from .gguf_reader import GGUFModelFile, gguf_to_kvfleet, open_gguf, read_gguf_config
from .hf_reader import hf_kv_cache_scales, hf_to_kvfleet, materialize, read_hf_config, read_hf_tensors

logger = logging.getLogger(__name__)


def load_model_config(path: str, gguf: GGUFModelFile | None = None) -> ModelConfig:
    """Read only the architecture config of a model directory or GGUF file.

    ``gguf``: the already read GGUF file (``GGUFModelFile(path)``) to reuse instead of reading ``path`` again.
    """
    if is_gguf(path):  # without ``gguf``: the header only (no tensor is read, nor the GGUF cache's entry)
        return gguf.config if gguf is not None else read_gguf_config(open_gguf(path))
    if os.path.isdir(path):
        return read_hf_config(path)
    raise ModelLoadError(f"expected a model directory with config.json or a .gguf file, got {path!r}")


def load_model(path: str, dtype: torch.dtype, device: str, max_positions: int | None = None,
               gguf: GGUFModelFile | None = None, quantization: str | None = None, tp=None):
    """Load weights into kvfleet's model.

    ``tp``: a ``TPGroup`` (rank r of N): the model is built with rank r's shard and every ``Linear``'s
    weight_loader keeps only that rank's slice of each checkpoint tensor (the group need not be
    connected yet).

    ``gguf``: the already read GGUF file (``GGUFModelFile(path, packed=quantization == "gguf")``) to reuse
    instead of reading ``path`` again; its tensors are handed over to the model.
    ``quantization``: None (model dtype), "fp8" | "int8" | "int4" (quantized at load from the float
    weights; a GGUF file is dequantized first), or "gguf" (a .gguf file's Q4_0/Q4_1/Q8_0 tensors kept packed).

    Returns (model in eval mode on ``device`` with ``dtype`` activations, ModelConfig); the model's
    ``kv_cache_scales`` holds the checkpoint's FP8 KV-cache scales per layer ({} when none).
    Raises ModelLoadError (missing file or tensor, wrong shape) or UnsupportedFeatureError
    (unknown architecture, tensor type or rope scaling, an already-quantized checkpoint format,
    gguf quantization of a non-GGUF model).
    """
    kv_scales: dict[int, tuple[float, float]] = {}
    if is_gguf(path):
        packed = quantization == "gguf"
        gguf = gguf if gguf is not None else GGUFModelFile(path, packed)
        if gguf.packed != packed:
            raise ValueError(f"GGUFModelFile(packed={gguf.packed}) given for quantization={quantization!r}")
        cfg = gguf.config
        params = gguf_to_kvfleet(cfg, gguf.tensors())
    elif os.path.isdir(path):
        if quantization == "gguf":
            raise UnsupportedFeatureError(
                f"not supported: quantization='gguf' needs a .gguf model file, got the directory {path!r}")
        cfg = read_hf_config(path)
        # tensor parallelism: a rank reads its slices only, not N copies of the checkpoint in host memory
        tensors = read_hf_tensors(path, lazy=tp is not None and tp.is_parallel)
        kv_scales = hf_kv_cache_scales(cfg, tensors)
        params = hf_to_kvfleet(cfg, tensors)
        del tensors
    else:
        raise ModelLoadError(f"expected a model directory with config.json or a .gguf file, got {path!r}")
    if cfg.architecture not in MODEL_REGISTRY:
        raise UnsupportedFeatureError(
            f"not supported yet: architecture {cfg.architecture}; expected one of {list(SUPPORTED_ARCHITECTURES)}"
        )
    check_shapes(cfg, params)
    check_quantization_flag(quantization, cfg.checkpoint_quantization, path)
    serialized = cfg.checkpoint_quantization is not None
    method = cfg.checkpoint_quantization if serialized else quantization
    model = _build(cfg, dtype, device, QuantConfig(method, dtype, serialized), tp)
    _load_weights(model, params)
    del params
    for m in model.modules():
        if isinstance(m, Linear):
            m.process_weights_after_loading()
    model.init_rope(max_positions or cfg.max_position_embeddings, device)
    model.kv_cache_scales = kv_scales
    model.eval()
    return model, cfg


def _build(cfg: ModelConfig, dtype: torch.dtype, device: str, qc: QuantConfig, tp=None) -> torch.nn.Module:
    """The model with uninitialized parameters in ``dtype`` on ``device`` (no init kernels run)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = MODEL_REGISTRY[cfg.architecture](cfg, max_positions=1, quant_config=qc, tp=tp)
    finally:
        torch.set_default_dtype(old)
    return model


def _load_weights(model: torch.nn.Module, params: dict[str, list]) -> None:
    """Copy each checkpoint tensor into its parameter through the parameter's ``weight_loader``
    (shard i of a fused layer into its rows). Every parameter must be covered."""
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(params))
    if missing:
        raise ModelLoadError(f"expected checkpoint tensors for {missing[:5]}; they are missing")
    with torch.no_grad():
        for name, shards in params.items():
            param = own[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.copy_(materialize(shards[0]))
            elif len(shards) == 1:
                loader(param, shards[0])
            else:
                for i, shard in enumerate(shards):
                    loader(param, shard, i)
