"""Start-up time of kvfleet-server: launch → /health 200 for the bundled model, five ways, in one run.

- cold: torch.compile'd layers with empty caches (fresh compile, tokenizer and GGUF caches:
  ``TORCHINDUCTOR_CACHE_DIR``, ``KVFLEET_TOKENIZER_CACHE``, ``KVFLEET_GGUF_CACHE``);
- warm: compiled, with the caches the cold start filled (a restart);
- eager-cold: ``--enforce-eager`` (no compilation) with empty tokenizer and GGUF caches (a first start);
- eager: ``--enforce-eager``, a restart (the caches eager-cold filled);
- default: the bundled model with no flags at all (on the CPU: eager, the GGUF's Q4_1 weights kept packed,
  bfloat16 activations), a restart (its GGUF cache entry written by an untimed first launch).

All but default run float32 (the GGUF dequantized: the peer workload's engine). The C++ CPU kernels
are built before (``make`` builds them at install), in every mode.

The modes alternate for ``--repeats`` rounds (each cold round gets its own empty caches); the median of
each is printed and written to benchmarks/results/startup.json. Targets of issue 16: warm ≤ 10 s,
cold ≤ 60 s, eager ≤ 6 s (a restart).

    python benchmarks/startup.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from _common import write_json


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_health(args: list[str], env: dict, timeout: float = 600.0) -> float:
    """Seconds from spawning the server to its first /health 200; the server is stopped after."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvfleet_server.cli", "--host", "127.0.0.1", "--port", str(port), *args]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env})
    try:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"not healthy after {timeout}s")
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    base = ["--model", args.model, "--dtype", "float32"]
    times: dict[str, list[float]] = {"cold": [], "warm": [], "eager-cold": [], "eager": [], "default": []}
    env: dict[str, str] = {}

    def caches(d: str) -> dict[str, str]:
        return {"TORCHINDUCTOR_CACHE_DIR": d + "-inductor", "KVFLEET_TOKENIZER_CACHE": d + "-tokenizers",
                "KVFLEET_GGUF_CACHE": d + "-gguf"}

    with tempfile.TemporaryDirectory() as tmp:
        shared = caches(os.path.join(tmp, "default"))
        time_to_health(["--model", args.model], env | shared)  # untimed: fills default's caches
        for r in range(args.repeats):
            compiled = base + ["-O3"]  # the CPU's default is eager (level 0)
            cold = caches(os.path.join(tmp, f"compiled{r}"))
            times["cold"].append(time_to_health(compiled, env | cold))  # nothing cached yet
            times["warm"].append(time_to_health(compiled, env | cold))
            eager = caches(os.path.join(tmp, f"eager{r}"))
            times["eager-cold"].append(time_to_health(base + ["--enforce-eager"], env | eager))
            times["eager"].append(time_to_health(base + ["--enforce-eager"], env | eager))
            times["default"].append(time_to_health(["--model", args.model], env | shared))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}s" for k, v in times.items()), flush=True)
    res = {"model": args.model, "repeats": args.repeats, "seconds": times, "loadavg": os.getloadavg(),
           "median_s": {k: statistics.median(v) for k, v in times.items()},
           "targets_s": {"warm": 10, "cold": 60, "eager": 6}}
    print("median launch → /health 200: " + ", ".join(f"{k} {v:.1f}s" for k, v in res["median_s"].items()))
    out = write_json(res, "startup", args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
