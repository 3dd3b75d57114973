"""``--generation-config auto|vllm|PATH``: the model's recommended sampling parameters as request defaults.

vLLM's meaning (``ModelConfig.get_diff_sampling_param`` and the OpenAI serving layer's ``get_max_tokens``):

- ``auto`` (the default): the model directory's ``generation_config.json``, read with transformers'
  ``GenerationConfig``; only the values that differ from transformers' defaults count
  (``to_diff_dict``), and of those ``temperature``, ``top_p``, ``top_k``, ``min_p``,
  ``repetition_penalty`` become the defaults of requests that leave them unset, and ``max_new_tokens``
  the default ``max_tokens``. A directory without the file has vLLM's neutral defaults. A ``.gguf``
  model uses llama.cpp's ``general.sampling.*`` metadata keys (``temp``, ``top_p``, ``top_k``,
  ``min_p``, ``penalty_repeat``) when the file has them, else vLLM's defaults;
- ``vllm``: vLLM's neutral defaults; the file is not read;
- a directory PATH: that directory's ``generation_config.json`` (it must exist); its
  ``max_new_tokens`` also caps the ``max_tokens`` a request asks for (vLLM's ``override_max_tokens``).

A field a request sets always wins over the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

#: generation_config.json keys vLLM applies (HF name → SamplingParams field)
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty"}
#: llama.cpp's GGUF sampling metadata (gguf.Keys.General.SAMPLING_*) → SamplingParams field
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
SPECIAL = ("auto", "vllm")


@dataclass(frozen=True)
class GenerationDefaults:
    """Request defaults from the model's generation config.

    Attributes:
        source: where they come from: "vllm" (none), a generation_config.json path or a .gguf path.
        params: SamplingParams field → value for fields a request leaves unset.
        max_tokens: ``max_tokens`` of a request that sets none (None: up to max_model_len).
        cap_max_tokens: ``max_tokens`` also caps a request's own value (a PATH, as in vLLM).
    """

    source: str = "vllm"
    params: dict = field(default_factory=dict)
    max_tokens: int | None = None
    cap_max_tokens: bool = False

    def resolve_max_tokens(self, requested: int | None) -> int | None:
        """The request's max_tokens after the defaults (None: up to max_model_len)."""
        if requested is None:
            return self.max_tokens
        if self.cap_max_tokens and self.max_tokens is not None:
            return min(requested, self.max_tokens)
        return requested

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.source == "vllm" or not (self.params or self.max_tokens is not None):
            return f"vLLM's defaults (nothing to apply from {self.source})" if self.source != "vllm" \
                else "vLLM's defaults (--generation-config vllm)"
        shown = dict(self.params)
        if self.max_tokens is not None:
            shown["max_tokens"] = self.max_tokens
        return (f"{shown} from {self.source}{' (max_tokens also caps requests)' if self.cap_max_tokens else ''}; "
                "fields a request sets win (--generation-config vllm ignores the file)")


def check_generation_config(value: str) -> None:
    """ValueError naming --generation-config unless ``value`` is auto, vllm or a directory holding
    generation_config.json."""
    if value in SPECIAL:
        return
    if not os.path.isfile(os.path.join(value, "generation_config.json")):
        raise ValueError(f"--generation-config must be 'auto', 'vllm' or a directory holding "
                         f"generation_config.json; {value!r} is none of these")


def read_generation_defaults(generation_config: str, model_path: str, gguf_reader=None) -> GenerationDefaults:
    """The request defaults of ``generation_config`` ("auto" | "vllm" | a directory) for the model at
    ``model_path`` (an HF directory or a .gguf file; ``gguf_reader``: its parsed ``gguf.GGUFReader`` if
    already open). Raises ValueError for a PATH without generation_config.json."""
    if generation_config == "vllm":
        return GenerationDefaults()
    if generation_config == "auto":
        if model_path.endswith(".gguf"):
            return _from_gguf(model_path, gguf_reader)
        if not os.path.isfile(os.path.join(model_path, "generation_config.json")):
            return GenerationDefaults(os.path.join(model_path, "generation_config.json"))
        return _from_hf_dir(model_path, cap=False)
    check_generation_config(generation_config)
    return _from_hf_dir(generation_config, cap=True)


def _from_hf_dir(directory: str, cap: bool) -> GenerationDefaults:
    from transformers import GenerationConfig

    diff = GenerationConfig.from_pretrained(directory).to_diff_dict()
    params = {ours: diff[hf] for hf, ours in HF_KEYS.items() if diff.get(hf) is not None}
    max_new = diff.get("max_new_tokens")
    return GenerationDefaults(os.path.join(directory, "generation_config.json"), params,
                              int(max_new) if max_new is not None else None, cap and max_new is not None)


def _from_gguf(path: str, reader=None) -> GenerationDefaults:
    if reader is None:
        import gguf

        reader = gguf.GGUFReader(path)
    params = {}
    for key, ours in GGUF_KEYS.items():
        f = reader.fields.get(key)
        if f is not None:
            value = f.contents()
            params[ours] = int(value) if ours == "top_k" else float(value)
    return GenerationDefaults(path, params)
