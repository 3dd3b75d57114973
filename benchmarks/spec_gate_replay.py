"""Replay of the n-gram drafter and the scheduler's acceptance cut-off over real greedy outputs (issue 10).

Greedy speculative decoding emits exactly the plain engine's tokens, so which drafts a policy would
verify, and how many of them would be accepted, follows from the plain outputs alone. This script
generates the spec_decode benchmark's prompts once with the plain engine (real SmolLM2, float32, greedy,
up to 128 tokens, one prompt at a time), then replays each sequence's decode through ``ngram_lookup``
and a ``DraftGate`` per cut-off floor, pricing a step whose proposer returned γ drafts at
1 + ``--row-cost``·γ decode steps. It prints the decode-only speed-up of each floor, of verifying every
proposal at full k (no cut-off) and of an oracle that verifies exactly the drafts that will be accepted.
It isolates the policy from the machine's noise; benchmarks/spec_decode.py measures the engine itself.

Simplifications: concurrency 1; every sequence starts with a fresh gate (the scheduler also lets a new
sequence inherit the last back-off while acceptance is low); a step's cost is linear in its drafts
(measured in the engine on this CPU, 2 threads, float32, 2026-12-03: 9 drafts 1.53x a plain decode step,
16 drafts 1.95x, about 0.06 per draft, fewer than 6 drafts less than that; with the span attention
kernel, the pass alone, benchmarks/spec_step_cost.py on 2026-12-04: 4 drafts 1.17x, 8 drafts 1.51x, 16
drafts 2.0x; an earlier measurement of the forward pass alone gave about 0.1 — run both).

    python benchmarks/spec_gate_replay.py
    python benchmarks/spec_gate_replay.py --floors 0.15 0.3 --row-cost 0.1
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spec_decode import METHODS, workloads  # noqa: E402


def accepted(proposal: list[int], truth: list[int]) -> int:
    """Leading drafts equal to the tokens greedy decoding emitted next."""
    a = 0
    while a < len(proposal) and a < len(truth) and proposal[a] == truth[a]:
        a += 1
    return a


def replay(prompt: list[int], output: list[int], policy, k: int, n_min: int, n_max: int, row_cost: float,
           max_tokens: int) -> tuple[int, float]:
    """(decode tokens, cost in plain decode steps) of one sequence under ``policy``: None verifies every
    proposal at k drafts, "oracle" exactly the accepted ones, else a DraftGate."""
    from kvfleet_server.spec_decode.ngram import ngram_lookup

    i, step, cost = 1, 0, 0.0  # output[0] came from the prefill
    while i < len(output):
        step += 1
        room = max_tokens - i - 1  # the scheduler's limit: every accepted draft plus the bonus token fit
        if policy is None or policy == "oracle":
            gamma = k
        else:
            gamma = policy.num_drafts(k) if policy.open(step) else 0
        proposal = ngram_lookup(prompt + output[:i], n_min, n_max, min(gamma, room)) if gamma and room else []
        a = accepted(proposal, output[i:])
        if policy == "oracle":
            proposal = proposal[:a]
        elif policy is not None and proposal:
            policy.update(step, len(proposal), a)
        cost += 1 + row_cost * len(proposal)
        i += a + 1
    return len(output) - 1, cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--floors", type=float, nargs="+", default=[0.1, 0.15, 0.2, 0.3])
    ap.add_argument("--row-cost", type=float, default=0.06, help="cost of one draft row, in plain decode steps")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kvfleet_server import LLM, SamplingParams
    from kvfleet_server.spec_decode.gate import DraftGate
    from kvfleet_server.spec_decode.proposer import VERIFY_COST, break_even_acceptance

    spec = METHODS["ngram"]
    k, n_min, n_max = spec["num_speculative_tokens"], spec["prompt_lookup_min"], spec["prompt_lookup_max"]
    break_even = break_even_acceptance(0.0, "cpu")  # an n-gram draft reads no weights
    llm = LLM(dtype="float32", device="cpu", num_threads=args.threads, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print(f"ngram k={k} lookup {n_min}-{n_max}; break-even {break_even:.2f} (VERIFY_COST {VERIFY_COST['cpu']}), "
          f"a draft row costs {args.row_cost} of a decode step; current floor {DraftGate.MIN_ACCEPTANCE}")
    print(f"{'workload':<15} {'policy':<26} {'decode speed-up':>15}")
    for name, prompts in workloads(llm.tokenizer).items():
        outs = [llm.generate(p, params)[0] for p in prompts]  # one at a time, as at concurrency 1
        seqs = [(o.prompt_token_ids, list(o.outputs[0].token_ids)) for o in outs]
        policies = [("no cut-off (always k)", lambda: None), ("oracle", lambda: "oracle")]
        policies += [(f"floor {f:.2f} (cut-off {DraftGate.cut_off(break_even, f):.2f})",
                      lambda f=f: DraftGate(DraftGate.cut_off(break_even, f), token_cost=break_even))
                     for f in args.floors]
        for label, make in policies:
            runs = [replay(list(p), o, make(), k, n_min, n_max, args.row_cost, args.max_tokens) for p, o in seqs]
            tokens, cost = sum(r[0] for r in runs), sum(r[1] for r in runs)
            print(f"{name:<15} {label:<26} {tokens / cost:>14.2f}x", flush=True)


if __name__ == "__main__":
    main()
