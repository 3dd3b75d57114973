"""Structured output on the real model: constrained vs unconstrained, jump-forward on vs off, concurrency 1 and 8.

Workload: the first ``--num-requests`` schemas of tests/server/structured_schemas.py (nested objects, arrays,
enums, patterns, bounded numbers), their prompts through SmolLM2's chat template, greedy, max_tokens 200
(the unconstrained run generates exactly as many tokens per request as the constrained one, ignore_eos),
float32 on the CPU, one LLMEngine per JSON layout, in one process. For each mode it reports output tok/s,
forward passes per response (engine steps in which the request was scheduled), validity (jsonschema), the
grammar mask's share of step time (bitmask fill, measured in the engine, plus the bitmask apply on the
same batch shape, timed here), and for jump-forward how many greedy outputs equal the run without it.

Modes: ``unconstrained`` (same prompts, no grammar), ``constrained`` (jump-forward off), ``jump_forward``.
Layouts: ``compact`` (structured_outputs_config disable_any_whitespace: one fixed JSON layout, where the
grammar forces separators and keys) and ``any_whitespace`` (the default; whitespace makes little forced).

    python benchmarks/structured_output.py                    # 8 requests, 3 repeats, compact layout
    python benchmarks/structured_output.py --layouts any_whitespace --repeats 1
    python benchmarks/structured_output.py --quick            # 4 requests, 1 repeat
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

MAX_TOKENS = 200

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "server"))  # the shared schema set
from structured_schemas import make_schemas  # noqa: E402


def build(disable_any_whitespace: bool, threads: int):
    from kvfleet_server import EngineConfig, LLMEngine

    torch.set_num_threads(threads)
    return LLMEngine(EngineConfig(model="smollm2", device="cpu", dtype="float32", max_model_len=1024,
                                  kv_cache_memory_bytes=256 << 20, max_num_seqs=8,
                                  structured_outputs_config={"disable_any_whitespace": disable_any_whitespace}))


def run(engine, work, mode: str, concurrency: int, lengths: list[int] | None = None) -> dict:
    """One pass over ``work``; ``lengths``: per request output length of the unconstrained run (ignore_eos),
    so that it generates as many tokens as the constrained one."""
    from kvfleet_server import SamplingParams
    from kvfleet_server.sampling_params import StructuredOutputsParams

    engine.config.enable_jump_forward = mode == "jump_forward"
    engine.scheduler.max_num_seqs = concurrency
    engine.kv.pool.reset_prefix_cache()
    ids = []
    for i, (prompt, schema) in enumerate(work):
        so = StructuredOutputsParams(json=schema) if mode != "unconstrained" else None
        rid = f"{mode}-{concurrency}-{i}-{time.monotonic_ns()}"
        p = (SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True) if lengths else
             SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=so))
        engine.add_request(rid, engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]), p,
                           add_special_tokens=False)
        ids.append(rid)
    passes = dict.fromkeys(ids, 0)
    finals = {}
    step_s = mask_s = 0.0
    jumped = steps = 0
    schedule = engine.scheduler.schedule

    def counting_schedule():  # forward passes per request: steps that schedule it
        out = schedule()
        for rid in {s.seq.request.request_id for s in out.scheduled}:
            passes[rid] += 1
        return out

    engine.scheduler.schedule = counting_schedule
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished():
            ts = time.perf_counter()
            outs = engine.step()
            step_s += time.perf_counter() - ts
            it = engine.last_iteration
            mask_s += it.structured_output_mask_s
            jumped += it.num_jump_forward_tokens
            steps += 1
            for o in outs:
                if o.finished:
                    finals[o.request_id] = o
    finally:
        engine.scheduler.schedule = schedule
    wall = time.perf_counter() - t0
    outs = [finals[r].outputs[0] for r in ids]
    tokens = sum(len(c.token_ids) for c in outs)
    valid = 0
    if mode != "unconstrained":
        import jsonschema

        for c, (_, schema) in zip(outs, work):
            try:
                jsonschema.validate(json.loads(c.text), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    return {"mode": mode, "concurrency": concurrency, "seconds": wall, "output_tokens": tokens,
            "tok_per_s": tokens / wall, "forward_passes_per_response": statistics.mean(passes.values()),
            "valid": valid, "n": len(work), "jumped_tokens": jumped, "steps": steps,
            "mask_fill_share": mask_s / step_s if step_s else 0.0, "step_seconds": step_s,
            "texts": [c.text for c in outs], "token_ids": [c.token_ids for c in outs]}


def apply_cost(engine, rows: int, repeats: int = 200) -> float:
    """Seconds per bitmask apply on [rows, V] float32 logits (what sample() does each grammar step)."""
    from kvfleet_server.sample.grammar import allocate_bitmask, apply_bitmask

    V = engine.model_config.vocab_size
    logits = torch.randn(rows, V)
    bm = allocate_bitmask(rows, V)
    bm[:, ::3] = 0
    t0 = time.perf_counter()
    for _ in range(repeats):
        apply_bitmask(logits, bm, list(range(rows)))
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layouts", default="compact", help="comma-separated: compact, any_whitespace")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "structured_output.json"))
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.repeats, args.layouts = 4, 1, "compact"
    work = make_schemas(50)[: args.num_requests]
    report = {"machine": platform.platform(), "threads": args.threads, "num_requests": args.num_requests,
              "repeats": args.repeats, "layouts": {}}
    for layout in args.layouts.split(","):
        engine = build(layout == "compact", args.threads)
        results = {}
        for conc in (1, 8):
            for mode in ("constrained", "jump_forward", "unconstrained"):
                lengths = None
                if mode == "unconstrained":
                    lengths = [len(t) for t in results[("constrained", conc)]["token_ids"]]
                runs = [run(engine, work, mode, conc, lengths) for _ in range(args.repeats)]
                r = dict(runs[0])
                r["tok_per_s"] = statistics.median(x["tok_per_s"] for x in runs)
                r["seconds"] = statistics.median(x["seconds"] for x in runs)
                r["mask_fill_share"] = statistics.median(x["mask_fill_share"] for x in runs)
                results[(mode, conc)] = r
        apply8 = apply_cost(engine, 8)
        rows = []
        for conc in (1, 8):
            un, co, jf = (results[(m, conc)] for m in ("unconstrained", "constrained", "jump_forward"))
            same = sum(a == b for a, b in zip(co["texts"], jf["texts"]))
            step_per = co["step_seconds"] / co["steps"]
            mask_share = co["mask_fill_share"] + apply_cost(engine, conc) / step_per
            rows.append({
                "concurrency": conc,
                "tok_per_s": {m: results[(m, conc)]["tok_per_s"] for m in ("unconstrained", "constrained",
                                                                          "jump_forward")},
                "forward_passes_per_response": {m: results[(m, conc)]["forward_passes_per_response"]
                                                for m in ("unconstrained", "constrained", "jump_forward")},
                "valid": {"constrained": f"{co['valid']}/{co['n']}", "jump_forward": f"{jf['valid']}/{jf['n']}"},
                "jumped_tokens": jf["jumped_tokens"],
                "greedy_equal_with_and_without_jump_forward": f"{same}/{co['n']}",
                "ratio_forward_passes_constrained_over_jump_forward":
                    co["forward_passes_per_response"] / jf["forward_passes_per_response"],
                "ratio_tok_per_s_jump_forward_over_constrained": jf["tok_per_s"] / co["tok_per_s"],
                "ratio_tok_per_s_constrained_over_unconstrained": co["tok_per_s"] / un["tok_per_s"],
                "mask_share_of_step_time": mask_share,
            })
        report["layouts"][layout] = {"rows": rows, "apply_seconds_batch8": apply8}
        del engine
        for row in rows:
            c = row["concurrency"]
            print(f"[{layout}] concurrency {c}: tok/s " + ", ".join(f"{k} {v:.1f}" for k, v in row["tok_per_s"].items())
                  + "; passes/response " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                    row["forward_passes_per_response"].items())
                  + f"; jump-forward {row['ratio_forward_passes_constrained_over_jump_forward']:.2f}x fewer passes, "
                  f"{row['ratio_tok_per_s_jump_forward_over_constrained']:.2f}x tok/s; valid {row['valid']}; "
                  f"greedy equal {row['greedy_equal_with_and_without_jump_forward']}; "
                  f"mask {100 * row['mask_share_of_step_time']:.2f}% of step time", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
