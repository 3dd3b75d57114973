"""Resident memory of a kvfleet-server process on the bundled SmolLM2-135M-Instruct, started as a new
user would (``kvfleet-server --kv-cache-memory-bytes 67108864`` plus the flags of each row), after
/health is 200 and one completion has been served: VmRSS (now) and VmHWM (peak) from /proc.
Writes JSON under benchmarks/results/.

    python benchmarks/server_rss.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "server"))
from server_fixtures import start_server  # noqa: E402  (the tests' server start-up: waits for /health, fails fast)

CONFIGS = {"default (packed GGUF, bf16)": [], "--quantization gguf --dtype float32": ["--quantization", "gguf", "--dtype", "float32"],
           "--quantization fp8 --kv-cache-dtype fp8": ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]}


def measure(extra: list[str]) -> dict:
    srv = start_server(["--kv-cache-memory-bytes", "67108864", *extra],
                       os.path.join(tempfile.gettempdir(), "kvfleet_server_rss.log"), ready_timeout=300)
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hello, my name is", "max_tokens": 16},
                       timeout=300)
        r.raise_for_status()
        with open(f"/proc/{srv.proc.pid}/status") as f:
            st = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                  if k in ("VmRSS", "VmHWM")}
        return {"rss_bytes": st["VmRSS"], "peak_rss_bytes": st["VmHWM"]}
    finally:
        srv.stop()


def main() -> int:
    out = {}
    for name, extra in CONFIGS.items():
        out[name] = measure(extra)
        print(f"{name:<45} RSS {out[name]['rss_bytes'] / 1e6:7.1f} MB   peak {out[name]['peak_rss_bytes'] / 1e6:7.1f} MB",
              flush=True)
    path = os.path.join(os.path.dirname(__file__), "results", "server_rss.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"kv_cache_memory_bytes": 67108864, "results": out}, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
