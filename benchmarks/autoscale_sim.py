"""Trace-driven autoscaling simulation: kvfleet's policy vs a fixed peak-sized fleet vs queue-only.

A simulated day of bursty arrivals is served by a fleet of replicas whose capacity model comes
from figures measured on kvfleet's own engine (``LLMEngine`` on the bundled SmolLM2-135M-Instruct;
``--measure`` re-measures them on this machine and writes ``benchmarks/results/engine_figures.json``;
otherwise the figures recorded in ``MEASURED_FIGURES`` below are used, with the command and machine
that produced them). The autoscalers run the real ``kvfleet_operator.autoscale.decide`` every 15 s.

Capacity model of one replica (continuous batching, vLLM-style):

* KV pool of ``num_blocks × block_size`` tokens (measured engine geometry at the configured
  ``kv_cache_memory_bytes``); a running request holds prompt + generated tokens; admission is FIFO
  while fewer than ``max_num_seqs`` run and the prompt fits in the free KV; when growth overflows
  the pool the newest request is preempted (recompute: back to the queue head, its KV freed).
* Time per engine step ``t(b) = a + c·b`` seconds for ``b`` running sequences (least squares over
  measured decode steps); each running sequence gains one token per step; prefill of admitted
  prompts costs ``prefill_s_per_token`` seconds of the replica's time first.
* ``vllm:kv_cache_usage_perc`` = tokens held / pool; ``num_requests_waiting`` = queue length.
* Time scale: this machine's CPU is no GPU, so the measured step times are multiplied by one
  factor chosen so that a single-sequence decode step takes ``--decode-step-ms`` (ASSUMPTION,
  default 25 ms, typical of an 8B model on one datacenter GPU); ``--decode-step-ms 0`` keeps the
  measured CPU times. Everything else (KV geometry, growth of step time with batch, prefill cost
  relative to a decode step) is as measured. Prefill on a GPU is relatively cheaper than on a
  CPU, so the model overstates prefill cost — equally for every policy.
* A new replica takes ``--startup-seconds`` (ASSUMPTION, default 180 s: GPU node scheduling,
  image pull, weight load — not measurable on this CPU machine) before it is Ready; it counts as a
  replica (holds its GPU) meanwhile. A removed replica stops receiving requests; its running and
  queued requests have ``--drain-timeout-seconds`` (``spec.engine.shutdownTimeoutSeconds``,
  default 30) to finish, the rest are cut (it counts as a replica until then).
* Which replica a scale-down removes: not-Ready ones first, then ``drain-aware`` (fewest running +
  queued requests, then least KV held — what the operator's pod-deletion-cost annotations make
  the ReplicaSet do) or ``random`` (the ReplicaSet's pick without them).
* Routing: each request goes to the Ready replica with the fewest requests (running + queued).

Policies: ``kvfleet`` (decide() with KV usage and queue, defaults of the CRD: target KV 0.8,
queue 5, scale-down window 300 s, starting replicas counted as capacity), with a drain-aware or a
random scale-down victim; ``kvfleet first pass`` (the same, but every scale-up held while any
replica starts: the rule before starting replicas were counted, ``first_pass_hold``); ``queue-only`` (decide() fed only
``vllm:num_requests_waiting``, with starting replicas *not* counted — how a KEDA/HPA rule on the
waiting queue behaves; it keeps decide()'s stabilization windows, step limit and scale-down
hysteresis, so it flaps less than a plain HPA rule would); ``fixed-peak`` (a constant fleet sized for the busiest 5 minutes).

Reported: replica-hours, fraction of requests whose queueing delay (arrival → first scheduled)
exceeds the TTFT target, p50/p99 queueing delay, scale events, reversals (a scale-up within one
scale-down window after a scale-down: flapping or a new burst), preemptions, requests cut by
scale-downs (still running or queued on a removed replica at its drain timeout) and the mean
drain seconds of a removed Ready replica.

Usage: ``python benchmarks/autoscale_sim.py [--measure] [--seed 0] [--hours 24]``; prints a table
and writes ``benchmarks/results/autoscale_sim.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvfleet_operator.autoscale import (AutoscalingPolicy, Decision, History, PodMetrics,
                                        PodObservation, decide)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
FIGURES_PATH = os.path.join(RESULTS, "engine_figures.json")
# Figures measured by `python benchmarks/autoscale_sim.py --measure` (kept here so a fresh clone
# reproduces the table without the 8-minute measurement; --measure replaces them).
MEASURED_FIGURES = {
    "command": "python benchmarks/autoscale_sim.py --measure --hours 2 --out /tmp/sim_probe.json",
    "machine": "x86_64  2 cpus",
    "model": "SmolLM2-135M-Instruct Q4_1 GGUF (dequantized to float32), CPU",
    "kv_cache_memory_bytes": 268435456,
    "num_blocks": 364,
    "block_size": 16,
    "max_num_seqs": 16,
    "decode_step_seconds_by_batch": {
        "1": 1.205382648499949,
        "2": 0.9845347479998736,
        "4": 0.9922462490000044,
        "8": 1.5243498684999395,
        "16": 2.1463393920000726
    },
    "step_fit_seconds": {
        "a": 0.9042381502290775,
        "c": 0.07521490822111145
    },
    "prefill_seconds_per_token": 0.031635831384765556,
    "load_seconds": 23.672832218000167,
    "note": "measured with the reference (PyTorch) attention on a 2-core CPU shared with other jobs; absolute times are slow and noisy, the simulation uses their shape (KV geometry, step time vs batch, prefill vs decode cost) rescaled by --decode-step-ms",
    "measured_at": "2026-11-29"
}


# ----------------------------------------------------------------------------- engine figures
def measure_engine(kv_bytes: int, max_num_seqs: int, threads: int | None) -> dict:
    """Measure decode step time vs batch size, prefill cost and KV geometry of the real engine."""
    from kvfleet_server import SamplingParams
    from kvfleet_server.config import EngineConfig
    from kvfleet_server.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model="smollm2", device="cpu", dtype="float32",
                                    kv_cache_memory_bytes=kv_bytes, max_num_seqs=max_num_seqs,
                                    max_model_len=2048, enable_prefix_caching=False,
                                    num_threads=threads))
    load_s = time.perf_counter() - t0
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)

    def prompt(n: int) -> list[int]:
        return [int(x) for x in rng.integers(100, vocab - 100, size=n)]

    decode: dict[int, float] = {}
    rid = 0
    for b in (1, 2, 4, 8, max_num_seqs):
        for _ in range(b):
            engine.add_request(f"r{rid}", prompt(16), SamplingParams(max_tokens=64, ignore_eos=True,
                                                                     temperature=0))
            rid += 1
        engine.step()  # prefill
        engine.step()
        times = []
        for _ in range(12):
            s = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - s)
        decode[b] = float(np.median(times))
        while engine.has_unfinished():
            engine.step()
    prefill = []
    for n in (256, 512):
        engine.add_request(f"p{rid}", prompt(n), SamplingParams(max_tokens=1, temperature=0))
        rid += 1
        s = time.perf_counter()
        engine.step()
        prefill.append((time.perf_counter() - s) / n)
        while engine.has_unfinished():
            engine.step()
    bs = np.array(sorted(decode), dtype=float)
    ts = np.array([decode[int(b)] for b in bs])
    c, a = np.polyfit(bs, ts, 1)
    return {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus".strip(),
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (dequantized to float32), CPU",
        "kv_cache_memory_bytes": kv_bytes, "num_blocks": engine.num_blocks,
        "block_size": engine.block_size, "max_num_seqs": max_num_seqs,
        "decode_step_seconds_by_batch": {str(k): v for k, v in decode.items()},
        "step_fit_seconds": {"a": float(max(a, 1e-4)), "c": float(max(c, 0.0))},
        "prefill_seconds_per_token": float(np.median(prefill)),
        "load_seconds": load_s,
    }


# ------------------------------------------------------------------------------------ trace
@dataclass
class Trace:
    arrival: np.ndarray  # seconds, sorted
    prompt: np.ndarray  # tokens
    output: np.ndarray  # tokens


def make_trace(seconds: float, peak_rate: float, seed: int, max_prompt: int, max_output: int) -> Trace:
    """Bursty day: two diurnal humps (night at 8% of peak), plus ~1 burst/hour of 2-12 min at
    1.5-2.5x the diurnal rate; Poisson arrivals; log-normal prompt/output lengths."""
    rng = np.random.default_rng(seed)
    dt = 1.0
    t = np.arange(0.0, seconds, dt)
    hours = t / 3600.0
    diurnal = 0.08 + 0.92 * np.clip(
        0.6 * np.exp(-((hours - 10.5) / 2.5) ** 2) + 1.0 * np.exp(-((hours - 15.5) / 3.0) ** 2), 0, 1)
    burst = np.ones_like(t)
    n_bursts = rng.poisson(seconds / 3600.0)
    for _ in range(n_bursts):
        start = rng.uniform(0, seconds)
        length = rng.uniform(120, 720)
        burst[(t >= start) & (t < start + length)] *= rng.uniform(1.5, 2.5)
    rate = peak_rate * diurnal * burst / max(1.0, float((diurnal * burst).max()))
    counts = rng.poisson(rate * dt)
    arrival = np.repeat(t, counts) + rng.uniform(0, dt, size=int(counts.sum()))
    arrival.sort()
    n = arrival.size
    prompt = np.clip(rng.lognormal(math.log(300), 0.7, n), 16, max_prompt).astype(int)
    output = np.clip(rng.lognormal(math.log(120), 0.6, n), 8, max_output).astype(int)
    return Trace(arrival, prompt, output)


# ----------------------------------------------------------------------------- fleet model
@dataclass
class Replica:
    created: float
    ready_at: float
    draining: bool = False
    drain_started: float = 0.0  # when the scale-down removed it (its SIGTERM)
    queue: deque = field(default_factory=deque)  # request ids (FIFO); preempted go to the front
    running: list = field(default_factory=list)  # [rid, remaining_out, kv_tokens]
    kv_used: float = 0.0
    debt: float = 0.0  # prefill time owed from earlier steps (seconds)

    def load(self) -> int:
        return len(self.queue) + len(self.running)


@dataclass
class SimResult:
    name: str
    replica_hours: float = 0.0
    peak_replicas: int = 0
    scale_events: int = 0
    scale_ups: int = 0
    scale_downs: int = 0
    preemptions: int = 0
    reversals: int = 0  # scale-ups within one scale-down window after a scale-down (flapping)
    cut: int = 0  # requests still on a removed replica at its drain timeout (aborted)
    drain_seconds: float = 0.0  # summed over removed Ready replicas: removal -> empty or cut
    victims: int = 0  # Ready replicas removed by scale-downs
    queue_delays: list = field(default_factory=list)
    timeline: list = field(default_factory=list)  # (t, replicas, ready, waiting)


def first_pass_hold(d: Decision, policy: AutoscalingPolicy) -> Decision:
    """kvfleet's first autoscaling pass, for comparison: every scale-up is held while any replica
    is starting (the rule ``decide`` had before starting replicas were counted as capacity)."""
    if d.direction != "up" or d.starting == 0:
        return d
    held = max(d.current_replicas, policy.min_replicas)  # the bounds were honoured even then
    return dataclasses.replace(d, desired_replicas=held, changed=held != d.current_replicas,
                               direction="up" if held > d.current_replicas else "none",
                               code="ReplicasStarting")


def simulate(name: str, trace: Trace, fig: dict, *, policy: AutoscalingPolicy | None,
             initial: int, startup_s: float, dt: float, queue_only: bool,
             interval: float = 15.0, hold_while_starting: bool = False,
             victim: str = "drain-aware", drain_timeout_s: float = 30.0, seed: int = 0) -> SimResult:
    """Serve ``trace`` with a fleet scaled by ``policy`` (None: a fixed fleet of ``initial``).

    victim: which Ready replicas a scale-down removes — "drain-aware" (fewest running + queued
    requests, then least KV held: what the pod-deletion-cost annotations make the ReplicaSet do)
    or "random" (the ReplicaSet's choice without them). Not-Ready replicas always go first. A
    removed replica gets no new requests; its running and queued ones have ``drain_timeout_s``
    (``spec.engine.shutdownTimeoutSeconds``, default 30) to finish, the rest are cut (counted in
    ``cut``; a cut request that never started counts as queued until the cut).
    hold_while_starting: emulate the first pass's hold (``first_pass_hold``)."""
    if victim not in ("drain-aware", "random"):
        raise ValueError(f"victim={victim!r}: must be 'drain-aware' or 'random'")
    rng = np.random.default_rng(seed)
    K = fig["num_blocks"] * fig["block_size"]
    S = fig["max_num_seqs"]
    a, c = fig["step_fit_seconds"]["a"], fig["step_fit_seconds"]["c"]
    pf = fig["prefill_seconds_per_token"]
    res = SimResult(name)
    replicas: list[Replica] = [Replica(created=-1e9, ready_at=-1e9) for _ in range(initial)]
    history = History()
    first_sched = np.full(trace.arrival.size, np.nan)
    prompt_len = trace.prompt.astype(float)  # grows when a preempted request is recomputed
    n, i_arr = trace.arrival.size, 0
    horizon = float(trace.arrival[-1]) + 1.0 if n else 0.0
    next_tick = interval
    last_down = -math.inf
    now = 0.0
    while now < horizon or any(r.load() for r in replicas):
        end = now + dt
        ready = [r for r in replicas if r.ready_at <= now and not r.draining]
        # Route arrivals of this step.
        while i_arr < n and trace.arrival[i_arr] < end:
            if ready:
                target = min(ready, key=Replica.load)
            else:  # no Ready replica (only while the first one starts): wait at the oldest one
                target = min((r for r in replicas if not r.draining), key=lambda r: r.created)
            target.queue.append(i_arr)
            i_arr += 1
        # Serve.
        for r in replicas:
            if r.ready_at > now:
                continue
            budget = dt - r.debt
            # Admission (FIFO, head-of-line): seats and free KV for the prompt.
            while r.queue and len(r.running) < S:
                rid = r.queue[0]
                need = prompt_len[rid]
                if r.kv_used + need > K:
                    break
                r.queue.popleft()
                r.running.append([rid, float(trace.output[rid]), need])
                r.kv_used += need
                budget -= need * pf
                if np.isnan(first_sched[rid]):
                    first_sched[rid] = max(now, trace.arrival[rid])
            r.debt = max(0.0, -budget)
            if not r.running or budget <= 0:
                continue
            b = len(r.running)
            tokens = budget / (a + c * b)
            done = []
            for item in r.running:
                step = min(tokens, item[1])
                item[1] -= step
                item[2] += step
                r.kv_used += step
                if item[1] <= 1e-9:
                    done.append(item)
            for item in done:
                r.running.remove(item)
                r.kv_used -= item[2]
            while r.kv_used > K and len(r.running) > 1:  # preempt the newest (recompute later)
                pre = r.running.pop()
                r.kv_used -= pre[2]
                prompt_len[pre[0]] = pre[2]
                # remaining output stays; it re-enters at the head of the queue
                trace.output[pre[0]] = max(1, int(math.ceil(pre[1])))
                r.queue.appendleft(pre[0])
                res.preemptions += 1
        for r in replicas:
            if not r.draining:
                continue
            if r.load() == 0:
                res.drain_seconds += end - r.drain_started
            elif end - r.drain_started >= drain_timeout_s:  # the drain timeout: abort the rest
                res.cut += r.load()
                res.drain_seconds += end - r.drain_started
                for rid in r.queue:
                    if np.isnan(first_sched[rid]):
                        first_sched[rid] = end
                r.queue.clear()
                r.running.clear()
                r.kv_used = 0.0
        replicas = [r for r in replicas if not (r.draining and r.load() == 0)]
        res.replica_hours += len(replicas) * dt / 3600.0
        res.peak_replicas = max(res.peak_replicas, len(replicas))
        now = end
        # Controller tick.
        if policy is not None and now >= next_tick:
            next_tick += interval
            active = [r for r in replicas if not r.draining]
            pods = []
            for r in active:
                if r.ready_at <= now:
                    m = PodMetrics(kv_cache_usage=None if queue_only else min(1.0, r.kv_used / K),
                                   num_requests_waiting=float(len(r.queue)),
                                   num_requests_running=float(len(r.running)))
                    pods.append(PodObservation("r", True, now - r.created, False, m))
                else:
                    pods.append(PodObservation("r", False, now - r.created, False, None))
            d = decide(policy, len(active), pods, history, now)
            if hold_while_starting:
                d = first_pass_hold(d, policy)
            history = d.history
            if d.changed:
                res.scale_events += 1
                if d.desired_replicas > len(active):
                    res.scale_ups += 1
                    if now - last_down <= policy.scale_down_stabilization_seconds:
                        res.reversals += 1
                    for _ in range(d.desired_replicas - len(active)):
                        replicas.append(Replica(created=now, ready_at=now + startup_s))
                else:
                    res.scale_downs += 1
                    last_down = now
                    excess = len(active) - d.desired_replicas
                    # Like a ReplicaSet: not-ready pods go first, then by deletion cost (least
                    # loaded, least KV) or, without costs, an arbitrary Ready pod.
                    if victim == "drain-aware":
                        def rank(r: Replica) -> tuple:
                            return (r.ready_at <= now, r.load(), r.kv_used)
                    else:
                        noise = {id(r): rng.random() for r in active}

                        def rank(r: Replica) -> tuple:
                            return (r.ready_at <= now, noise[id(r)])
                    for r in sorted(active, key=rank)[:excess]:
                        if r.ready_at > now:
                            replicas.remove(r)
                        else:
                            r.draining, r.drain_started = True, now
                            res.victims += 1
            if int(now) % 60 == 0:
                res.timeline.append((now, len(replicas), sum(r.ready_at <= now for r in replicas),
                                     sum(len(r.queue) for r in replicas)))
    delays = first_sched - trace.arrival
    res.queue_delays = delays[~np.isnan(delays)].tolist()
    return res


def replica_rate(fig: dict, mean_prompt: float, mean_output: float) -> float:
    """Requests/s one replica sustains at its best batch (KV- or seat-limited)."""
    K = fig["num_blocks"] * fig["block_size"]
    held = mean_prompt + mean_output / 2  # mean KV tokens of a running request
    b = max(1, min(fig["max_num_seqs"], int(0.9 * K / held)))
    a, c = fig["step_fit_seconds"]["a"], fig["step_fit_seconds"]["c"]
    per_request = mean_output * (a + c * b) / b + mean_prompt * fig["prefill_seconds_per_token"]
    return 1.0 / per_request


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measure", action="store_true", help="re-measure the engine figures here")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=256 * 2**20)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads when measuring")
    p.add_argument("--decode-step-ms", type=float, default=25.0,
                   help="ASSUMED single-sequence decode step of a replica (rescales measured times; 0: as measured)")
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-replicas", type=float, default=10.0,
                   help="size the trace so its busiest 5 minutes need about this many replicas")
    p.add_argument("--max-replicas", type=int, default=16)
    p.add_argument("--startup-seconds", type=float, default=180.0,
                   help="ASSUMED time from scale-up to Ready (GPU scheduling, image pull, weight load)")
    p.add_argument("--drain-timeout-seconds", type=float, default=30.0,
                   help="a removed replica's drain time before its requests are cut "
                        "(spec.engine.shutdownTimeoutSeconds, default 30)")
    p.add_argument("--ttft-target", type=float, default=1.0,
                   help="queueing-delay target in seconds (TTFT budget before prefill)")
    p.add_argument("--dt", type=float, default=0.5, help="simulation step (seconds)")
    p.add_argument("--no-ablations", dest="ablations", action="store_false",
                   help="no ablation rows")
    p.add_argument("--out", default=os.path.join(RESULTS, "autoscale_sim.json"))
    args = p.parse_args(argv)

    os.makedirs(RESULTS, exist_ok=True)
    if args.measure:
        fig = measure_engine(args.kv_cache_memory_bytes, args.max_num_seqs, args.threads)
        with open(FIGURES_PATH, "w") as f:
            json.dump(fig, f, indent=2)
    else:
        fig = MEASURED_FIGURES
    measured = fig
    if args.decode_step_ms > 0:
        scale = args.decode_step_ms / 1000.0 / fig["step_fit_seconds"]["a"]
        fig = {**fig, "time_scale": scale,
               "step_fit_seconds": {k: v * scale for k, v in fig["step_fit_seconds"].items()},
               "prefill_seconds_per_token": fig["prefill_seconds_per_token"] * scale}
    K = fig["num_blocks"] * fig["block_size"]
    max_prompt, max_output = min(1500, K // 3), 512

    # Size the trace: its busiest 5 minutes need ~peak_replicas replicas.
    probe = make_trace(args.hours * 3600, 1.0, args.seed, max_prompt, max_output)
    rate1 = replica_rate(fig, float(probe.prompt.mean()), float(probe.output.mean()))
    counts = np.histogram(probe.arrival, bins=np.arange(0, args.hours * 3600 + 300, 300))[0]
    peak5 = counts.max() / 300.0
    peak_rate = args.peak_replicas * rate1 / peak5
    trace_args = (args.hours * 3600, peak_rate, args.seed, max_prompt, max_output)
    fixed_n = int(math.ceil(args.peak_replicas))

    policy = AutoscalingPolicy(min_replicas=1, max_replicas=args.max_replicas, startup_timeout_seconds=1800)
    queue_policy = AutoscalingPolicy(min_replicas=1, max_replicas=args.max_replicas,
                                     startup_timeout_seconds=0)  # starting pods not counted
    runs = [
        ("kvfleet (starting counted, drain-aware)", dict(policy=policy, initial=1, queue_only=False)),
        ("kvfleet (starting counted, random victim)",
         dict(policy=policy, initial=1, queue_only=False, victim="random")),
        ("kvfleet first pass (hold, drain-aware)",
         dict(policy=policy, initial=1, queue_only=False, hold_while_starting=True)),
        ("kvfleet first pass (hold, random victim)",
         dict(policy=policy, initial=1, queue_only=False, hold_while_starting=True, victim="random")),
        ("queue-only (waiting >= 5, KEDA/HPA-style)", dict(policy=queue_policy, initial=1, queue_only=True,
                                                           victim="random")),
        (f"fixed, sized for peak ({fixed_n} replicas)", dict(policy=None, initial=fixed_n, queue_only=False)),
    ]
    if args.ablations:
        runs += [
            ("  ablation: kvfleet, targetKVCacheUsage 0.6",
             dict(policy=dataclasses.replace(policy, target_kv_cache_usage=0.6), initial=1, queue_only=False)),
            ("  ablation: kvfleet, starting not counted",
             dict(policy=dataclasses.replace(policy, startup_timeout_seconds=0), initial=1, queue_only=False)),
        ]
    rows = []
    wall = time.perf_counter()
    for name, kw in runs:
        trace = make_trace(*trace_args)  # fresh copy (the model mutates outputs on preemption)
        r = simulate(name, trace, fig, startup_s=args.startup_seconds, dt=args.dt,
                     drain_timeout_s=args.drain_timeout_seconds, seed=args.seed, **kw)
        d = np.array(r.queue_delays)
        rows.append({
            "policy": name, "replica_hours": round(r.replica_hours, 1),
            "requests": int(d.size),
            "frac_queue_delay_over_target": float((d > args.ttft_target).mean()) if d.size else 0.0,
            "queue_delay_p50_s": float(np.percentile(d, 50)) if d.size else 0.0,
            "queue_delay_p99_s": float(np.percentile(d, 99)) if d.size else 0.0,
            "scale_events": r.scale_events, "reversals": r.reversals, "scale_ups": r.scale_ups, "scale_downs": r.scale_downs,
            "peak_replicas": r.peak_replicas, "preemptions": r.preemptions,
            "requests_cut": r.cut, "scale_down_victims": r.victims,
            "drain_seconds_per_victim": r.drain_seconds / r.victims if r.victims else 0.0,
            "timeline_per_minute": r.timeline,
        })
    wall = time.perf_counter() - wall

    print(f"measured ({measured['model']}; {measured['machine']}): step t(b) = "
          f"{measured['step_fit_seconds']['a'] * 1e3:.0f} ms + {measured['step_fit_seconds']['c'] * 1e3:.1f} ms x b, "
          f"prefill {measured['prefill_seconds_per_token'] * 1e3:.1f} ms/token")
    print(f"simulated replica (x{fig.get('time_scale', 1.0):.4f} time scale): step t(b) = "
          f"{fig['step_fit_seconds']['a'] * 1e3:.1f} ms + {fig['step_fit_seconds']['c'] * 1e3:.2f} ms x b; "
          f"prefill {fig['prefill_seconds_per_token'] * 1e3:.3f} ms/token; KV pool {K} tokens; "
          f"max_num_seqs {fig['max_num_seqs']}; one replica sustains {rate1:.2f} req/s")
    print(f"trace: {args.hours:g} h, {rows[0]['requests']} requests, peak {peak_rate:.2f} req/s "
          f"(busiest 5 min ~ {args.peak_replicas:g} replicas); startup {args.startup_seconds:g} s "
          f"(assumed); TTFT target {args.ttft_target:g} s queueing delay; sim {wall:.0f} s")
    hdr = (f"{'policy':46s} {'replica-h':>9s} {'>TTFT':>7s} {'p50 q':>7s} {'p99 q':>7s} {'events':>6s} "
           f"{'revers':>6s} {'peak':>4s} {'cut':>5s} {'drain s':>7s}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['policy']:46s} {r['replica_hours']:9.1f} {100 * r['frac_queue_delay_over_target']:6.2f}% "
              f"{r['queue_delay_p50_s']:6.2f}s {r['queue_delay_p99_s']:6.1f}s {r['scale_events']:6d} "
              f"{r['reversals']:6d} {r['peak_replicas']:4d} {r['requests_cut']:5d} "
              f"{r['drain_seconds_per_victim']:7.1f}")
    out = {"engine_figures_measured": measured, "replica_model": fig, "args": vars(args), "peak_rate_rps": peak_rate,
           "replica_rate_rps": rate1, "results": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
