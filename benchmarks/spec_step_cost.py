"""Cost of verifying drafts (issue 10): one target pass over 1 + γ tokens per sequence against a plain
1-token decode step, on the real model, side by side in one run.

The speculative scheduler prices a step with γ drafts at 1 + γ·c plain decode steps, c = draft cost +
``spec_decode.proposer.VERIFY_COST`` (the break-even acceptance logged at start-up; DraftGate in
spec_decode/gate.py). This script measures the verify part of c on this machine: for B sequences
(batch 1 and 8) over a cached context of ``--context`` tokens it times the target's pass over each
sequence's last token plus γ draft tokens — attention over the paged cache in the backend the engine
picked, the logits of all 1 + γ rows, as a verification computes them — for γ in ``--drafts``, and
prints each pass's time, its ratio to γ = 0 and the cost per draft token (ratio − 1) / γ next to
``VERIFY_COST``. Positions past the context are rewritten on every call (no state carries over).

    python benchmarks/spec_step_cost.py                        # batch 1 and 8, 250-token contexts
    python benchmarks/spec_step_cost.py --context 1000 --repeats 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median_seconds, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=250, help="cached tokens per sequence")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--drafts", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.drafts = sorted(set(args.drafts) | {0})  # the plain pass first: every ratio is against it
    if len(args.drafts) == 1 or min(args.drafts) < 0:
        ap.error("--drafts: give one or more draft counts >= 1 (0, the plain pass, is always timed)")
    torch.set_num_threads(args.threads)
    from kvfleet_server import EngineConfig, LLMEngine
    from kvfleet_server.sequence import TokenSpan
    from kvfleet_server.spec_decode.proposer import VERIFY_COST

    max_len = args.context + max(args.drafts) + 1
    eng = LLMEngine(EngineConfig(dtype="float32", device="cpu", num_threads=args.threads,
                                 max_model_len=max(1024, max_len)))
    runner, bs = eng.runner, eng.runner.block_size
    per_seq = -(-max_len // bs)
    if per_seq * max(args.batch) > runner.num_blocks:
        ap.error(f"--context {args.context} x batch {max(args.batch)} needs {per_seq * max(args.batch)} KV blocks; "
                 f"the pool has {runner.num_blocks}")
    gen = torch.Generator().manual_seed(0)
    vocab = runner.model.config.vocab_size
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(max(args.batch))]
    prompts = [torch.randint(0, vocab, (max_len,), generator=gen).tolist() for _ in tables]
    for ids, table in zip(prompts, tables):  # the cached context every pass attends over
        runner.execute([TokenSpan(ids[: args.context], 0, table)])

    def verify(batch: int, gamma: int):
        spans = [TokenSpan(prompts[b][args.context : args.context + 1 + gamma], args.context, tables[b])
                 for b in range(batch)]

        def run():
            out = runner.execute(spans)
            runner.compute_logits(out)
        return run

    rows = []
    print(f"threads {args.threads}; context {args.context} tokens; median of {args.repeats} passes; "
          f"VERIFY_COST (cpu) = {VERIFY_COST['cpu']}")
    print(f"{'batch':>5} {'drafts':>6} {'pass ms':>8} {'vs plain':>8} {'per draft':>9}")
    for batch in args.batch:
        base = None
        for gamma in args.drafts:
            t = median_seconds(verify(batch, gamma), args.repeats, warmup=2)
            base = t if gamma == 0 else base
            ratio = t / base
            per = (ratio - 1) / gamma if gamma else None
            rows.append(dict(batch=batch, drafts=gamma, seconds=t, ratio=ratio, per_draft=per))
            print(f"{batch:5d} {gamma:6d} {t * 1e3:8.2f} {ratio:7.2f}x " + (f"{per:9.3f}" if gamma else f"{'-':>9s}"))
        per_draft = [r["per_draft"] for r in rows if r["batch"] == batch and r["drafts"]]
        print(f"{'':5s} median cost per draft at batch {batch}: {statistics.median(per_draft):.3f}")
    print("wrote", write_json(dict(args=vars(args), verify_cost=VERIFY_COST, rows=rows), "spec_step_cost", args.out))


if __name__ == "__main__":
    main()
