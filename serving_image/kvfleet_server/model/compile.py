"""Piecewise compilation of the decoder layers with torch.compile (Inductor), as vLLM compiles its models.

Each layer is two pieces around its attention call (``llama.layer_pre_attention``: RMSNorm → qkv
projection → RoPE; ``llama.layer_post_attention``: o_proj + residual → RMSNorm → SwiGLU + residual).
Inductor fuses the element-wise work between the matmuls and removes most of the per-operator dispatch;
the attention backend stays an eager call between the pieces, so any ``AttentionBackend`` plugs in
unchanged and the torch reference backend remains the oracle.

- One compiled callable per piece serves every layer: dynamo inlines the layer module
  (``inline_inbuilt_nn_modules``), its weights become graph inputs and the same code is reused for all
  layers (PyTorch's "regional compilation" recipe).
- Dynamic token count: ``warm_up`` runs each piece at T = 1 (a graph of its own: dynamo specializes
  sizes 0 and 1) and at T = 2 with the token dimension marked dynamic (``torch._dynamo.mark_dynamic``),
  so every later batch size reuses one of the two graphs: no recompiles while serving.
- Artefacts cached on disk: Inductor's FX-graph cache and AOTAutograd cache under
  ``TORCHINDUCTOR_CACHE_DIR`` (default ``~/.cache/kvfleet/torch_compile``, or under ``XDG_CACHE_HOME``),
  so a restart re-traces (about a second) but does not run the C++ compiler again.

``--enforce-eager`` (``EngineConfig.enforce_eager``) skips all of this.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from .llama import layer_post_attention, layer_pre_attention

logger = logging.getLogger("kvfleet.engine")


def compile_cache_dir() -> str:
    """The on-disk cache of compiled artefacts: ``$TORCHINDUCTOR_CACHE_DIR`` if set, else
    ``$XDG_CACHE_HOME/kvfleet/torch_compile`` (``~/.cache/kvfleet/torch_compile``)."""
    return kvfleet_cache_dir("torch_compile", "TORCHINDUCTOR_CACHE_DIR")


def kvfleet_cache_dir(name: str, env: str) -> str:
    """A kvfleet on-disk cache: ``$env`` if set, else ``$XDG_CACHE_HOME/kvfleet/<name>``
    (``~/.cache/kvfleet/<name>``). Shared by the compile cache and the tokenizer cache."""
    if os.environ.get(env):
        return os.environ[env]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvfleet", name)


def compile_layers(model: torch.nn.Module) -> None:
    """Replace ``model.pieces`` with torch.compile'd versions of the two layer pieces (compiled lazily on
    first call; ``warm_up`` triggers it). Sets ``TORCHINDUCTOR_CACHE_DIR`` for this process when unset."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", compile_cache_dir())
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    # a recompile while serving would stall a step for seconds: there should be none (two graphs per
    # piece, see the module docstring); the limit only bounds a misuse
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    model.pieces = (torch.compile(layer_pre_attention, dynamic=None),
                    torch.compile(layer_post_attention, dynamic=None))
    model.compiled = True


@torch.inference_mode()
def warm_up(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> float:
    """Compile (or load from the cache) both pieces for T = 1 and for a dynamic T >= 2, by running them
    on zeros through layer 0. Collective under tensor parallelism (the row-parallel linears all-reduce):
    every rank calls it. Returns the seconds it took."""
    t = time.perf_counter()
    pre, post = model.pieces
    layer = model.layers[0]
    cfg = model.config
    for T in (2, 1):
        h = torch.zeros(T, cfg.hidden_size, dtype=dtype, device=device)
        cos = torch.ones(T, 1, cfg.head_dim, dtype=dtype, device=device)
        sin = torch.zeros(T, 1, cfg.head_dim, dtype=dtype, device=device)
        attn = torch.zeros(T, layer.num_heads, layer.head_dim, dtype=dtype, device=device)
        if T > 1:
            for x in (h, cos, sin, attn):
                torch._dynamo.mark_dynamic(x, 0)
        pre(layer, h, cos, sin)
        post(layer, h, attn)
    return time.perf_counter() - t
