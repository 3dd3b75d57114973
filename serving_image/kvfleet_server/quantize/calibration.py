"""Calibration for offline quantization: a fixed text every machine has and the input second
moments H = Σ xᵀx of every decoder projection over it.

The default text is the docstrings of stdlib modules — not ``pydoc_data.topics``, the text the
accuracy benchmarks score — so an accuracy figure is never measured on the calibration data.
"""

from __future__ import annotations

import importlib

import torch

#: stdlib modules whose docstrings make the default calibration text
CALIBRATION_MODULES = ("argparse", "asyncio", "collections", "csv", "dataclasses", "datetime", "decimal",
                       "functools", "http.client", "itertools", "json", "logging", "pathlib", "random", "re",
                       "sqlite3", "statistics", "string", "subprocess", "textwrap", "threading", "typing",
                       "unittest", "urllib.request", "zipfile", "tarfile", "shutil", "pickle", "heapq")


def calibration_text() -> str:
    """The default calibration text: the docstrings of ``CALIBRATION_MODULES``, joined (about 8,000 tokens
    for SmolLM2's tokenizer)."""
    return "\n\n".join(d for m in CALIBRATION_MODULES if (d := importlib.import_module(m).__doc__))


def collect_hessians(llm, windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Run the float model of ``llm`` (an ``LLM`` built with ``cpu_weight_prepack=False``) over the
    token ``windows`` and return, for every decoder projection (``layers.{i}.qkv_proj``, ``o_proj``,
    ``gate_up_proj``, ``down_proj``), H = Σ xᵀx over all calibration tokens: [K, K] float64, K the
    projection's input features."""
    from ..evaluate import score_windows
    from ..model.layers.embedding import VocabEmbedding
    from ..model.layers.linear import Linear

    hess: dict[str, torch.Tensor] = {}
    hooks = []
    for name, m in llm.engine.model.named_modules():
        if isinstance(m, Linear) and not isinstance(m, VocabEmbedding) and name.startswith("layers."):
            def hook(mod, inputs, name=name):
                x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
                hess[name] = hess[name] + x.T @ x if name in hess else x.T @ x
            hooks.append(m.register_forward_pre_hook(hook))
    try:
        llm.engine.kv.pool.reset_prefix_cache()  # every window computed, none served from the cache
        score_windows(llm, windows)
    finally:
        for h in hooks:
            h.remove()
    return hess
