"""The Triton paged-attention kernels against the torch backend (the oracle) under the Triton
interpreter on the CPU, and a whole engine run with each backend.

TRITON_INTERPRET=1 must be set before triton is imported, so the interpreted runs happen in a
subprocess (triton_interp_worker.py) and this process's environment is never changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "triton_interp_worker.py")
TOL = {"float32": 1e-4, "bfloat16": 1e-2}


def _run(*args: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, WORKER, *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def kernel_results() -> list[dict]:
    return [json.loads(line) for line in _run("kernels").splitlines() if line.startswith("{")]


def test_kernels_match_torch_backend(kernel_results):
    """fp32 < 1e-4 and bf16 < 1e-2 relative error, decode / extend / mixed steps, GQA 1, 3, 4, 8, with
    non-contiguous and shared blocks and contexts not divisible by the block size; the KV write
    leaves the cache bit-identical to the oracle's (FP8 caches included)."""
    assert len(kernel_results) == 29
    seen = set()
    for r in kernel_results:
        assert r["rel_err"] < TOL[r["dtype"]], r
        assert r["cache_equal"], r
        seen.add((r["kind"], r["heads"] // r["kv_heads"], r["dtype"]))
    for kind in ("decode", "extend", "mixed"):
        for ratio in (1, 3, 4, 8):
            for dtype in TOL:
                assert (kind, ratio, dtype) in seen
    assert {r["kv_cache_dtype"] for r in kernel_results} == {"auto", "float8_e4m3fn", "float8_e5m2"}
    assert {r["num_splits"] for r in kernel_results} == {1, 2, 3}
    assert {r["head_dim"] for r in kernel_results} == {16, 24, 64}
    assert {r["block_size"] for r in kernel_results} == {4, 8, 16}


@pytest.mark.slow
def test_engine_greedy_tokens_triton_equal_torch(tiny_llama_dir):
    """LLM.generate on the tiny random Llama (GQA 4/2, head_dim 16), chunked prefill, prefix-cache hits:
    the same greedy tokens with --attention-backend triton (interpreted) as with torch, also when the
    decode steps go through the CUDA-graph path (padded batches; padded rows write no KV)."""
    out = json.loads(_run("engine", tiny_llama_dir).strip().splitlines()[-1])
    assert out["triton"] == out["torch"]
    assert out["triton_graphs"] == out["torch"]
    assert out["graph_sizes"], "no decode step took the graph path"
    assert all(len(t) == 6 for t in out["torch"])


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    from kvfleet_server.attention import resolve_attention_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend='triton' runs on CUDA.*TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", "cpu")
    from kvfleet_server.attention import cpu_ext

    assert resolve_attention_backend("auto", "cpu") == ("cpu" if cpu_ext.load() is not None else "torch")
    assert resolve_attention_backend("auto", "cuda") == "triton"
    assert resolve_attention_backend("torch", "cuda") == "torch"


def test_engine_refuses_triton_on_cpu(tiny_engine_factory, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        tiny_engine_factory(attention_backend="triton")


def test_config_and_flag_validation():
    from kvfleet_server.flags import FlagError, engine_config, parse_flags
    from kvfleet_server.config import EngineConfig

    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flashinfer")
    with pytest.raises(FlagError, match="--attention-backend"):
        parse_flags(["--attention-backend", "flashinfer"])
    cfg = engine_config(parse_flags(["--attention-backend", "torch", "--enforce-eager"]))
    assert (cfg.attention_backend, cfg.enforce_eager) == ("torch", True)
    assert (EngineConfig().attention_backend, EngineConfig().enforce_eager) == ("auto", False)
