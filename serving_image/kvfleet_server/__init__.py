"""kvfleet_server: a paged-KV-cache LLM serving engine (offline ``LLM`` API + step-level ``LLMEngine``).

Imports are lazy so that ``import kvfleet_server`` stays light (no torch until used).
"""

from __future__ import annotations

from .errors import EngineDeadError, InvalidRequestError, PromptTooLongError, UnsupportedFeatureError
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
    "InvalidRequestError", "PromptTooLongError", "UnsupportedFeatureError", "EngineDeadError",
]

_LAZY = {"LLM": ".llm", "LLMEngine": ".engine.llm_engine", "EngineConfig": ".config"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'kvfleet_server' has no attribute {name!r}")
