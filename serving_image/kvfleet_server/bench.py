"""``kvfleet-bench``: serving benchmark client for any OpenAI-compatible server (kvfleet, vLLM, SGLang...).

Sends N streaming requests at a Poisson arrival rate (``--request-rate``, requests/s; ``inf`` sends them
all at once) and/or under a concurrency cap (``--max-concurrency``), and reports, like vLLM's
``bench serve``: time to first token (TTFT), inter-token latency (ITL, gaps between streamed chunks),
end-to-end latency (E2E), each as mean/p50/p90/p99 in milliseconds, plus request and token throughput.

Datasets (seeded, no download):
- ``random``: prompts of random words, ``--input-len`` words ±``--range-ratio``, ``--output-len`` tokens
  (``ignore_eos`` so outputs have that length on servers that honour it).
- ``shared-prefix``: one long system prompt (``--prefix-len`` words) shared by every request plus a
  short random question (``--input-len`` words): the agent/RAG shape that prefix caching serves.
Token counts come from the server's usage (``stream_options.include_usage``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force education").split()


@dataclass
class BenchRequest:
    """One request of a dataset: chat messages (system + user) or a plain prompt, and max output tokens."""

    prompt: str
    system: str | None
    max_tokens: int


@dataclass
class RequestResult:
    """What one request measured. Times in seconds; ``itl`` lists the gaps between streamed chunks."""

    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0
    error: str = ""


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(n, 1)))


def make_dataset(name: str, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                 prefix_len: int = 512, seed: int = 0) -> list[BenchRequest]:
    """Build ``num`` requests of dataset ``name`` ("random" | "shared-prefix"); deterministic for a seed."""
    rng = random.Random(seed)
    lo, hi = max(1, int(input_len * (1 - range_ratio))), max(1, int(input_len * (1 + range_ratio)))
    if name == "random":
        return [BenchRequest(_words(rng, rng.randint(lo, hi)), None, output_len) for _ in range(num)]
    if name == "shared-prefix":
        system = "You are a helpful assistant. Reference material: " + _words(rng, prefix_len)
        return [BenchRequest("Question: " + _words(rng, rng.randint(lo, hi)) + "?", system, output_len)
                for _ in range(num)]
    raise ValueError(f"dataset must be 'random' or 'shared-prefix', got {name!r}")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] (numpy's default method); NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats_ms(values: list[float]) -> dict:
    ms = [v * 1000.0 for v in values]
    return {"mean": sum(ms) / len(ms) if ms else float("nan"), "p50": percentile(ms, 50),
            "p90": percentile(ms, 90), "p99": percentile(ms, 99)}


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Aggregate per-request results over a run of ``duration`` seconds into the report dict."""
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration if duration > 0 else float("nan"),
        "output_throughput": out_tok / duration if duration > 0 else float("nan"),
        "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else float("nan"),
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "itl_ms": _stats_ms([g for r in ok for g in r.itl]),
        "e2e_ms": _stats_ms([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }


async def _one(client, url: str, model: str, req: BenchRequest, endpoint: str, ignore_eos: bool,
               headers: dict) -> RequestResult:
    body: dict = {"model": model, "max_tokens": req.max_tokens, "stream": True, "temperature": 0.0,
                  "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        msgs = ([{"role": "system", "content": req.system}] if req.system else []) + [{"role": "user", "content": req.prompt}]
        body["messages"] = msgs
    else:
        body["prompt"] = (req.system + "\n\n" if req.system else "") + req.prompt
    res = RequestResult(ok=False, start=time.perf_counter())
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    res.error = str(obj["error"])[:200]
                    return res
                if obj.get("usage"):
                    res.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                    res.output_tokens = obj["usage"].get("completion_tokens", 0)
                text = ""
                for ch in obj.get("choices") or []:
                    text += (ch.get("delta") or {}).get("content") or ch.get("text") or ""
                if text:
                    t = time.perf_counter()
                    if last is None:
                        res.ttft = t - res.start
                    else:
                        res.itl.append(t - last)
                    last = t
                    chunks += 1
        res.e2e = time.perf_counter() - res.start
        res.output_tokens = res.output_tokens or chunks
        res.ok = last is not None
        if not res.ok:
            res.error = "no tokens streamed"
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


async def run_benchmark(base_url: str, model: str | None, requests: list[BenchRequest], *, endpoint: str = "completions",
                        request_rate: float = math.inf, max_concurrency: int | None = None, ignore_eos: bool = True,
                        api_key: str | None = None, seed: int = 0, progress: bool = True,
                        timeout_s: float = 600.0) -> dict:
    """Run the benchmark; returns the summary dict (see ``summarize``) plus the run's settings."""
    import httpx
    from tqdm.asyncio import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        if model is None:
            r = await client.get(f"{base}/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        url = f"{base}/v1/chat/completions" if endpoint == "chat" else f"{base}/v1/completions"
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        rng = random.Random(seed)
        bar = tqdm(total=len(requests), disable=not progress, desc="requests", file=sys.stderr)

        async def limited(req: BenchRequest) -> RequestResult:
            if sem is None:
                res = await _one(client, url, model, req, endpoint, ignore_eos, headers)
            else:
                async with sem:
                    res = await _one(client, url, model, req, endpoint, ignore_eos, headers)
            bar.update(1)
            return res

        t0 = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(limited(req)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    summary = summarize(results, duration)
    summary.update({"model": model, "endpoint": endpoint, "num_prompts": len(requests),
                    "request_rate": request_rate if math.isfinite(request_rate) else "inf",
                    "max_concurrency": max_concurrency, "base_url": base_url})
    summary["_results"] = [asdict(r) for r in results]
    return summary


def plot(summary: dict, path: str) -> None:
    """PNG: TTFT and E2E latency per request over the run, and the ITL distribution (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in summary["_results"] if r["ok"]]
    t0 = min((r["start"] for r in rs), default=0.0)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.scatter([r["start"] - t0 for r in rs], [r["ttft"] * 1000 for r in rs], s=8, label="TTFT")
    a.scatter([r["start"] - t0 for r in rs], [r["e2e"] * 1000 for r in rs], s=8, label="E2E")
    a.set_xlabel("request start (s)")
    a.set_ylabel("latency (ms)")
    a.legend()
    itl = [g * 1000 for r in rs for g in r["itl"]]
    b.hist(itl, bins=40)
    b.set_xlabel("inter-token latency (ms)")
    b.set_ylabel("count")
    fig.suptitle(f"{summary['model']} · {summary['completed']} requests · "
                 f"{summary['output_throughput']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="prompt (question) length in words")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.0, help="input length varies by ± this fraction")
    p.add_argument("--prefix-len", type=int, default=512, help="shared system prompt length in words")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrival rate, requests/s")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="write the JSON result here")
    p.add_argument("--plot", default=None, help="write a PNG plot here (matplotlib)")
    p.add_argument("--no-progress", action="store_true")
    return p


def format_report(s: dict) -> str:
    lines = [f"{'completed / failed':<32}{s['completed']} / {s['failed']}",
             f"{'duration (s)':<32}{s['duration_s']:.2f}",
             f"{'request throughput (req/s)':<32}{s['request_throughput']:.2f}",
             f"{'output throughput (tok/s)':<32}{s['output_throughput']:.1f}",
             f"{'total token throughput (tok/s)':<32}{s['total_token_throughput']:.1f}"]
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        m = s[key]
        lines.append(f"{name + ' ms mean/p50/p90/p99':<32}{m['mean']:.1f} / {m['p50']:.1f} / {m['p90']:.1f} / {m['p99']:.1f}")
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        print("error: --num-prompts, --input-len and --output-len must be at least 1", file=sys.stderr)
        return 2
    reqs = make_dataset(args.dataset, args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                        args.prefix_len, args.seed)
    summary = asyncio.run(run_benchmark(args.base_url, args.model, reqs, endpoint=args.endpoint,
                                        request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                                        ignore_eos=not args.no_ignore_eos, api_key=args.api_key, seed=args.seed,
                                        progress=not args.no_progress))
    summary["dataset"] = args.dataset
    print(format_report(summary))
    if args.plot:
        plot(summary, args.plot)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
