"""What cache-aware routing buys across replicas of kvfleet's engine: round-robin (what a Service does) against
the endpoint picker's prefix-affinity rule, on a multi-tenant workload (docs/routing.md).

Three real ``kvfleet-server`` processes on 127.0.0.1 (``--num-threads 1`` each, ``--kv-events-config`` on),
a KV pool holding ``--kv-prompts`` system prompts each (default 4 of the 8: a replica cannot keep every
tenant's prefix, as on a real fleet), and a workload of ``--tenants`` distinct system
prompts of ``--prompt-tokens`` tokens, chosen per request with Zipf weights 1/k^s, each followed by a short
question; the same requests, in the same order, at the same ``--concurrency``, go through each policy on
fresh replicas (cold caches):

- ``round-robin``: request i goes to replica i mod 3;
- ``affinity``: the EPP's documented scoring (llm-d-router 0.10 default profile, the one kvfleet's operator
  renders): score = 3 x prefix + 2 x queue + 2 x KV, highest wins (ties at random), where prefix = the
  request's leading full blocks the replica holds / its full blocks (``prefix-cache-scorer``), queue =
  (max waiting - waiting) / (max - min) over the replicas, 1 when equal (``queue-scorer``), KV = 1 -
  vllm:kv_cache_usage_perc (``kv-cache-utilization-scorer``). Which blocks a replica holds comes from its
  own KV events (BlockStored / BlockRemoved / AllBlocksCleared), keyed by token content and parent chain as
  llm-d's precise prefix-cache producer keys them; waiting requests and KV usage from each replica's
  /metrics, read every 100 ms (the picker's metrics refresh).

Reported side by side, with ratios: output tok/s, TTFT p50 / p99 (client-side, first streamed token), and
the prefix-cache hit rate (vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total summed over the
replicas, in tokens). Writes benchmarks/results/routing.json (and the replicas' logs next to it).

    python benchmarks/routing.py                                        # the docs' figures (run alone)
    python benchmarks/routing.py --requests 24 --prompt-tokens 256 --tenants 4   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import sys
import threading
import time

import httpx
import msgspec
import zmq
from prometheus_client.parser import text_string_to_metric_families

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "server"))
sys.path.insert(0, HERE)

from _common import RESULTS, write_json  # noqa: E402
from kvfleet_server.bench import WORDS, percentile  # noqa: E402
from kvfleet_server.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from server_fixtures import free_port, start_server  # noqa: E402

REPLICAS = 3
PROBE_KV_BYTES = 64 << 20  # the first replica's KV pool, to measure bytes per token
WEIGHTS = {"prefix": 3.0, "queue": 2.0, "kv": 2.0}  # llm-d-router's default profile (routing.WEIGHTS)
METRICS_PERIOD_S = 0.1
ROOT = b"\0" * 16


def block_key(parent: bytes, tokens) -> bytes:
    """The index key of one block: its tokens chained on its parent's key (llm-d keys blocks by content)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(int(t).to_bytes(4, "little") for t in tokens))
    return h.digest()


def request_keys(tokens: list[int], block_size: int) -> list[bytes]:
    keys, parent = [], ROOT
    for i in range(len(tokens) // block_size):
        parent = block_key(parent, tokens[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys


class BlockIndex:
    """Which replica holds which block, from each replica's KV events (a SUB socket per replica, one thread)."""

    def __init__(self, ports: list[int]):
        self.lock = threading.Lock()
        self.holders: dict[bytes, set[int]] = {}
        self.engine_keys: list[dict[bytes, bytes]] = [{} for _ in ports]  # engine block hash -> key, per replica
        self.last_seq = [-1] * len(ports)
        self.gaps = 0
        self.events = 0
        ctx = zmq.Context.instance()
        self.socks = []
        for port in ports:
            s = ctx.socket(zmq.SUB)
            s.setsockopt_string(zmq.SUBSCRIBE, "kv@")
            s.connect(f"tcp://127.0.0.1:{port}")
            self.socks.append(s)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for s in self.socks:
            poller.register(s, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(100):
                r = self.socks.index(sock)
                _, seq, payload = sock.recv_multipart()
                seq = int.from_bytes(seq, "big")
                if self.last_seq[r] >= 0 and seq != self.last_seq[r] + 1:
                    self.gaps += 1
                self.last_seq[r] = seq
                with self.lock:
                    for e in self.decoder.decode(payload).events:
                        self._apply(r, e)

    def _apply(self, r: int, e) -> None:
        self.events += 1
        keys = self.engine_keys[r]
        if isinstance(e, BlockStored):
            parent = ROOT if e.parent_block_hash is None else keys.get(e.parent_block_hash)
            if parent is None:
                return  # its parent was never seen: the chain cannot be keyed
            bs = e.block_size
            for i, h in enumerate(e.block_hashes):
                parent = block_key(parent, e.token_ids[i * bs:(i + 1) * bs])
                keys[h] = parent
                self.holders.setdefault(parent, set()).add(r)
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                key = keys.pop(h, None)
                if key is not None:
                    self.holders.get(key, set()).discard(r)
        elif isinstance(e, AllBlocksCleared):
            for key in keys.values():
                self.holders.get(key, set()).discard(r)
            keys.clear()

    def matched(self, keys: list[bytes], replicas: int) -> list[int]:
        """Leading blocks of ``keys`` each replica holds (prefix-cache-scorer's longest consecutive match)."""
        out = []
        with self.lock:
            for r in range(replicas):
                n = 0
                for k in keys:
                    if r not in self.holders.get(k, ()):
                        break
                    n += 1
                out.append(n)
        return out

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        for s in self.socks:
            s.close(linger=0)


class MetricsPoller:
    """vllm:num_requests_waiting and vllm:kv_cache_usage_perc of every replica, every METRICS_PERIOD_S."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.waiting = [0.0] * len(urls)
        self.usage = [0.0] * len(urls)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self.stop.is_set():
                for i, url in enumerate(self.urls):
                    try:
                        m = scrape(client, url)
                    except httpx.HTTPError:
                        continue
                    self.waiting[i] = m.get("vllm:num_requests_waiting", 0.0)
                    self.usage[i] = m.get("vllm:kv_cache_usage_perc", 0.0)
                self.stop.wait(METRICS_PERIOD_S)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)


def scrape(client: httpx.Client, url: str) -> dict[str, float]:
    """/metrics as {name: value} (one series per name: one model per server)."""
    return {s.name: s.value for f in text_string_to_metric_families(client.get(url + "/metrics").text)
            for s in f.samples}


def affinity_choice(matched: list[int], total: int, waiting: list[float], usage: list[float],
                    rng: random.Random) -> int:
    """The EPP's weighted sum of prefix, queue and KV-usage scores; the highest wins, ties at random."""
    lo, hi = min(waiting), max(waiting)
    scores = []
    for r in range(len(matched)):
        prefix = matched[r] / total if total else 0.0
        queue = 1.0 if hi == lo else (hi - waiting[r]) / (hi - lo)
        scores.append(WEIGHTS["prefix"] * prefix + WEIGHTS["queue"] * queue + WEIGHTS["kv"] * (1.0 - usage[r]))
    best = max(scores)
    return rng.choice([r for r, s in enumerate(scores) if s >= best - 1e-9])


def build_workload(url: str, args) -> tuple[list[dict], dict]:
    """Requests as token ids (the same bytes reach every replica): a tenant's system prompt + a question."""
    rng = random.Random(args.seed)
    with httpx.Client(timeout=60) as client:
        def tokenize(text: str, special: bool) -> list[int]:
            r = client.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": special})
            r.raise_for_status()
            return r.json()["tokens"]

        systems = []
        for t in range(args.tenants):
            text = f"You are the assistant of tenant {t}. Reference material: " + \
                " ".join(rng.choice(WORDS) for _ in range(args.prompt_tokens * 2))
            systems.append(tokenize(text, True)[:args.prompt_tokens])
        weights = [1.0 / (k + 1) ** args.zipf for k in range(args.tenants)]
        requests = []
        for _ in range(args.requests):
            tenant = rng.choices(range(args.tenants), weights)[0]
            q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(args.question_words[0], args.question_words[1])))
            tokens = systems[tenant] + tokenize(f"\n\nQuestion: {q}?\nAnswer:", False)
            requests.append({"tenant": tenant, "tokens": tokens})
    counts = [sum(r["tenant"] == t for r in requests) for t in range(args.tenants)]
    return requests, {"requests_per_tenant": counts,
                      "prompt_tokens_mean": sum(len(r["tokens"]) for r in requests) / len(requests)}


async def run_policy(policy: str, urls: list[str], requests: list[dict], args, block_size: int,
                     index: BlockIndex | None, poller: MetricsPoller | None) -> dict:
    rng = random.Random(args.seed + 1)
    sem = asyncio.Semaphore(args.concurrency)
    results: list[dict] = [None] * len(requests)  # type: ignore[list-item]
    chosen = [0] * len(urls)

    async def one(i: int, req: dict, client: httpx.AsyncClient) -> None:
        async with sem:
            if policy == "round-robin":
                r = i % len(urls)
            else:
                keys = request_keys(req["tokens"], block_size)
                r = affinity_choice(index.matched(keys, len(urls)), len(keys), list(poller.waiting),
                                    list(poller.usage), rng)
            chosen[r] += 1
            body = {"model": "bench", "prompt": req["tokens"], "max_tokens": args.output_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            ttft, out = None, 0
            async with client.stream("POST", urls[r] + "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    obj = json.loads(line[5:])
                    if obj.get("usage"):
                        out = obj["usage"]["completion_tokens"]
                    if ttft is None and any(c.get("text") for c in obj.get("choices") or []):
                        ttft = time.perf_counter() - t0
            results[i] = {"replica": r, "tenant": req["tenant"], "ttft_s": ttft, "e2e_s": time.perf_counter() - t0,
                          "output_tokens": out}

    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0),
                                 limits=httpx.Limits(max_connections=args.concurrency * 2)) as client:
        t0 = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):  # dispatched in order: request i is routed when a slot frees
            tasks.append(asyncio.create_task(one(i, req, client)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    return {"policy": policy, "duration_s": duration, "requests_per_replica": chosen,
            "output_tokens": sum(r["output_tokens"] for r in results),
            "output_tok_s": sum(r["output_tokens"] for r in results) / duration,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99), "_requests": results}


def start_replicas(args, tag: str, count: int = REPLICAS) -> tuple[list, list[int]]:
    servers, ports = [], []
    try:
        for i in range(count):
            port = free_port()
            cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "topic": f"kv@r{i}@bench"}
            flags = ["--model", args.model, "--served-model-name", "bench", "--num-threads", "1",
                     "--block-size", str(args.block_size), "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
                     "--max-num-seqs", str(args.max_num_seqs), "--kv-events-config", json.dumps(cfg),
                     "--disable-uvicorn-access-log", "--disable-log-stats", *args.server_arg]
            log = os.path.join(RESULTS, f"routing_{tag}_replica{i}.log")
            servers.append(start_server(flags, log, ready_timeout=600))
            ports.append(port)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers, ports


def measure(policy: str, requests: list[dict], args) -> dict:
    servers, ports = start_replicas(args, policy)
    urls = [s.url for s in servers]
    index = BlockIndex(ports)
    poller = MetricsPoller(urls) if policy == "affinity" else None
    time.sleep(0.5)  # the subscriptions reach the replicas before the first event
    try:
        with httpx.Client(timeout=10) as client:
            before = [scrape(client, u) for u in urls]
            info = [s for f in text_string_to_metric_families(client.get(urls[0] + "/metrics").text)
                    for s in f.samples if s.name == "vllm:cache_config_info"][0].labels
        res = asyncio.run(run_policy(policy, urls, requests, args, int(info["block_size"]), index, poller))
        with httpx.Client(timeout=10) as client:
            after = [scrape(client, u) for u in urls]
        hits = sum(a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"] for a, b in zip(after, before))
        queries = sum(a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"]
                      for a, b in zip(after, before))
        res.update({"prefix_cache_hit_rate": hits / queries if queries else float("nan"),
                    "prefix_cache_hit_tokens": hits, "prefix_cache_query_tokens": queries,
                    "kv_capacity_tokens": int(info["num_gpu_blocks"]) * int(info["block_size"]),
                    "kv_events": index.events, "kv_event_seq_gaps": index.gaps})
    finally:
        if poller is not None:
            poller.close()
        index.close()
        for s in servers:
            s.stop()
    return res


def format_table(runs: dict, args, workload: dict) -> str:
    rr, af = runs["round-robin"], runs["affinity"]
    cap = rr["kv_capacity_tokens"]
    lines = [f"{REPLICAS} replicas x 1 thread, {args.model}; {args.tenants} tenants x {args.prompt_tokens}-token system "
             f"prompts, Zipf s={args.zipf}, {args.requests} requests, concurrency {args.concurrency}, "
             f"{args.output_tokens} output tokens; KV pool {cap} tokens per replica "
             f"({cap / args.prompt_tokens:.1f} system prompts)",
             f"{'':24}{'round-robin':>14}{'affinity':>14}{'ratio':>10}"]
    rows = [("output tok/s", "output_tok_s", af["output_tok_s"] / rr["output_tok_s"], "{:.2f}"),
            ("TTFT p50 (s)", "ttft_p50_s", rr["ttft_p50_s"] / af["ttft_p50_s"], "{:.3f}"),
            ("TTFT p99 (s)", "ttft_p99_s", rr["ttft_p99_s"] / af["ttft_p99_s"], "{:.3f}"),
            ("prefix-cache hit rate", "prefix_cache_hit_rate",
             af["prefix_cache_hit_rate"] / rr["prefix_cache_hit_rate"] if rr["prefix_cache_hit_rate"] else float("inf"),
             "{:.3f}")]
    for label, key, ratio, fmt in rows:
        lines.append(f"{label:24}{fmt.format(rr[key]):>14}{fmt.format(af[key]):>14}{ratio:>9.2f}x")
    lines.append(f"{'requests per replica':24}{str(rr['requests_per_replica']):>14}{str(af['requests_per_replica']):>14}")
    lines.append("ratio: affinity / round-robin for tok/s and hit rate, round-robin / affinity for TTFT "
                 "(above 1: affinity better)")
    lines.append(f"requests per tenant: {workload['requests_per_tenant']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="tokens of each tenant's system prompt")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--zipf", type=float, default=1.0, help="tenant k (1-based) is chosen with weight 1/k^s")
    ap.add_argument("--question-words", type=int, nargs=2, default=(8, 24), metavar=("MIN", "MAX"))
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-prompts", type=float, default=4.0,
                    help="each replica's KV pool holds this many system prompts (sized from the model's KV bytes "
                         "per token, measured on a first replica)")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="each replica's KV pool (overrides --kv-prompts)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--server-arg", action="append", default=[], help="extra kvfleet-server flag (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    res = {"settings": {k: v for k, v in vars(args).items()}, "loadavg_before": os.getloadavg(), "runs": {}}
    sizing = args.kv_cache_memory_bytes is None
    if sizing:
        args.kv_cache_memory_bytes = PROBE_KV_BYTES
    probe_bytes = args.kv_cache_memory_bytes
    servers, _ = start_replicas(args, "tokenizer", count=1)  # tokenizes the workload, measures KV bytes per token
    try:
        requests, workload = build_workload(servers[0].url, args)
        with httpx.Client(timeout=10) as client:
            info = [s for f in text_string_to_metric_families(client.get(servers[0].url + "/metrics").text)
                    for s in f.samples if s.name == "vllm:cache_config_info"][0].labels
    finally:
        for s in servers:
            s.stop()
    bytes_per_token = probe_bytes / (int(info["num_gpu_blocks"]) * int(info["block_size"]))
    if sizing:
        blocks = -(-int(args.kv_prompts * args.prompt_tokens) // args.block_size)
        args.kv_cache_memory_bytes = int(blocks * args.block_size * bytes_per_token) + 1
    workload["kv_bytes_per_token"] = bytes_per_token
    res["settings"]["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    res["workload"] = workload
    for policy in ("round-robin", "affinity"):
        print(f"running {policy} ...", file=sys.stderr, flush=True)
        res["runs"][policy] = measure(policy, requests, args)
    res["loadavg_after"] = os.getloadavg()
    table = format_table(res["runs"], args, workload)
    res["table"] = table
    print(table)
    print("wrote", write_json(res, "routing", args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
