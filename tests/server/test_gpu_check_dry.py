"""benchmarks/gpu/check.sh --dry-run: the GPU check's every section runs on the CPU (tiny shapes, Triton
interpreter) and writes its JSON and table; on a GPU the same script measures (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks/gpu/check.sh"), str(tmp_path), "--dry-run"],
                          env={**env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["dry_run"] is True
    assert {r["gqa"] for r in res["kernels"]} == {1, 4, 8}
    assert {r["dtype"] for r in res["kernels"]} == {"float32", "bfloat16", "float16", "bfloat16/fp8-kv",
                                                     "float16/fp8-kv"}
    assert len({r["block_size"] for r in res["kernels"]}) == 2
    assert all(r["cache_equal"] and r["ok"] for r in res["kernels"])
    assert [r["batch"] for r in res["decode"]] == [1, 2]
    assert res["prefill"]["tok_s"] > 0
    assert res["fp8"]["top1_agree"] > 0.5 and res["fp8"]["logits_rel_err"] < 0.1
    server = res["server"]
    assert server["ok"] and server["chunks"] == 16
    assert int(server["cache_config_info"]["num_gpu_blocks"]) > 0
    assert all(d["kv_usage"] > 0 for d in server["during"]) and server["kv_usage_idle"] == 0
    assert proc.stdout.strip().splitlines()[-1].startswith("targets (H200)")
