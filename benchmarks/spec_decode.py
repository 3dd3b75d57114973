"""Speculative decoding benchmark on the real model (issue 10): output tokens/s with and without
speculation, side by side in one run, per method, at concurrency 1 and 8, on two workloads:

- input-grounded: rewrite / repeat / edit prompts whose answers copy spans of the prompt (passages of
  the Python reference manual from the stdlib's ``pydoc_data.topics``, present on every machine);
- open-ended: short stories and explanations (little to copy).

Greedy decoding until EOS or ``--max-tokens`` (the outputs with and without speculation are compared token
for token), prompts in the model's own chat template (SmolLM2 adds its system prompt). For each row
the plain and the speculative engine run in adjacent pairs on the same prompts, ``--reps`` pairs or more
until each engine ran ``--min-seconds`` (at most 4 × reps), an even number, every other pair speculative
first (ABBA, so order effects cancel; prefix cache reset before each run, so both pay the same prefills); the table
reports the median tokens/s of each, the median of the pairs' ratios (and of their decode-only tokens/s
ratios: steps that computed no prompt token), the mean
acceptance length (tokens emitted per verification, bonus token included) and the
draft acceptance rate. JSON goes to benchmarks/results/spec_decode.json.
With ``--vllm-python`` (``benchmarks/_vllm.py``) the n-gram rows at concurrency 1 also run vLLM's CPU engine
on the same prompt token ids, weights and threads, without and with its n-gram proposer (``--vllm-num-speculative-tokens``
drafts, prompt lookup 2-5), as many alternating runs as kvfleet's pairs, and print both engines' speculative wall
seconds and the token identity with kvfleet's outputs.

    python benchmarks/spec_decode.py                   # every method, 4-12 pairs per row, up to 128 tokens
    python benchmarks/spec_decode.py --quick           # 2 pairs per row, up to 32 output tokens
    python benchmarks/spec_decode.py --methods ngram --reps 5
    python benchmarks/spec_decode.py --methods ngram --concurrency 1 --vllm-python /opt/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import _vllm
from _common import print_cpu

OPEN = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain why the sky is blue to a ten-year-old.", "Describe your ideal weekend in the mountains.",
        "Write a poem about autumn leaves.", "What are three tips for learning a new language?",
        "Tell me about the history of the bicycle.", "Write a letter to a friend you have not seen in years.",
        "Describe how bread is made, step by step."]
GROUNDED = ["Repeat the following text exactly, word for word:\n\n{}",
            "Copy this paragraph verbatim:\n\n{}",
            "Rewrite the following text, keeping every sentence unchanged:\n\n{}",
            "Here is a passage. Write it out again exactly as it is.\n\n{}"]

# disable_by_batch_size 4: on this CPU a forward pass costs about linearly in its tokens beyond a couple of
# rows (compute-bound), so verifying 1 + k tokens for 8 sequences costs more than the accepted drafts save
B = 4
METHODS = {
    # up to 16 drafts: the scheduler verifies as many as the sequence's acceptance pays for (DraftGate)
    "ngram": {"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
              "disable_by_batch_size": B},
    "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 3, "num_draft_layers": 24,
                   "disable_by_batch_size": B},
    "draft_model(self)": {"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 3,
                          "disable_by_batch_size": B},
    "draft_model(random)": {"method": "draft_model", "model": "RANDOM", "num_speculative_tokens": 3,
                            "disable_by_batch_size": B},
}


def passages(n: int) -> list[str]:
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        text = " ".join(topics[key].split())
        if len(text) > 600:
            cut = text[:420]
            out.append(cut[: cut.rfind(".") + 1] or cut)
        if len(out) == n:
            return out
    return out


def workloads(tokenizer) -> dict[str, list[str]]:
    def chat(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)

    return {"input-grounded": [chat(GROUNDED[i % 4].format(p)) for i, p in enumerate(passages(8))],
            "open-ended": [chat(q) for q in OPEN]}


def random_draft_dir(path: str) -> str:
    """A random-weight 2-layer Llama with SmolLM2's vocabulary and tokenizer files (a draft that rarely agrees)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvfleet_server.config import bundled_model_path

    gguf = bundled_model_path()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path)
    AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(path)
    return path


def run(eng, prompts: list[str], concurrency: int, max_tokens: int, tag: str):
    """All prompts, ``concurrency`` at a time. Returns (tokens/s, decode tokens/s, outputs, drafts, draft
    tokens, accepted); decode tokens/s counts only the steps that computed no prompt token (the prefills
    are the same work with and without speculation)."""
    from kvfleet_server import SamplingParams

    eng.kv.pool.reset_prefix_cache()
    p = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs, queue = {}, list(enumerate(prompts))
    drafts = draft_toks = accepted = tokens = 0
    dec_tokens, dec_time = 0, 0.0
    t0 = time.perf_counter()
    live = 0
    while queue or eng.has_unfinished():
        while queue and live < concurrency:
            i, prompt = queue.pop(0)
            eng.add_request(f"{tag}-{i}", prompt, p)
            live += 1
        ts = time.perf_counter()
        for o in eng.step():
            if o.finished:
                outs[int(o.request_id.rsplit("-", 1)[1])] = o.outputs[0].token_ids
                tokens += len(o.outputs[0].token_ids)
                live -= 1
        it = eng.last_iteration
        if not it.num_prompt_tokens:
            dec_tokens += it.num_generation_tokens
            dec_time += time.perf_counter() - ts
        drafts += it.num_drafts
        draft_toks += it.num_draft_tokens
        accepted += it.num_accepted_tokens
    return (tokens / (time.perf_counter() - t0), dec_tokens / dec_time if dec_time else 0.0,
            [outs[i] for i in range(len(prompts))], drafts, draft_toks, accepted)


def vllm_row(args, plain, prompts: list[str], kv_plain: list, kv_spec: list, pairs: int, kv_spec_s: float) -> dict:
    """vLLM's CPU engine on the same prompts (token ids), weights and threads, one prompt at a time, without and
    with its n-gram proposer (``--vllm-num-speculative-tokens`` drafts, prompt lookup 2-5), alternating, as many
    runs as kvfleet's pairs; the median wall seconds of each (``benchmarks/_vllm.py``)."""
    ids = [plain.tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    from kvfleet_server.config import resolve_model

    ngram = {"method": "ngram", "num_speculative_tokens": args.vllm_num_speculative_tokens,
             "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    engine = {"dtype": "float32", "max_model_len": 1024, "seed": 0}
    job = {"kind": "sequential", "model": _vllm.hf_checkpoint(resolve_model(plain.config.model)), "prompts": ids,
           "max_tokens": args.max_tokens, "ignore_eos": False, "repeats": pairs, "engine": engine,
           "speculative_configs": {"plain": None, "ngram": ngram}}
    with _vllm.Job(args.vllm_python, job, args.threads) as j:
        out = j.read()
    p_s = statistics.median(r["seconds"] for r in out["plain"]["runs"])
    s_s = statistics.median(r["seconds"] for r in out["ngram"]["runs"])
    n_p, n_s = out["plain"]["runs"][0]["output_tokens"], out["ngram"]["runs"][0]["output_tokens"]
    return dict(version=out["version"], speculative_config=ngram, plain_s=round(p_s, 3),
                spec_s=round(s_s, 3), plain_tok_s=round(n_p / p_s, 2), spec_tok_s=round(n_s / s_s, 2),
                ratio=round(p_s / s_s, 3), kvfleet_spec_s=round(kv_spec_s, 3),
                plain_same=sum(a == b for a, b in zip(kv_plain, out["plain"]["token_ids"])),
                spec_same=sum(a == b for a, b in zip(kv_spec, out["ngram"]["token_ids"])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--reps", type=int, default=3, help="pairs of runs per row, at least (rounded up to even)")
    ap.add_argument("--min-seconds", type=float, default=30.0,
                    help="more pairs of runs (up to 4x --reps) until each engine ran a row this long")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--num-prompts-c1", type=int, default=8, help="prompts run one at a time at concurrency 1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--break-even-floor", action="store_true",
                    help="pin every method's acceptance cut-off at the floor, DraftGate.MIN_ACCEPTANCE (not the break-even): what a method's "
                         "drafts do when they are verified, not whether they pay")
    _vllm.add_argument(ap)
    ap.add_argument("--vllm-num-speculative-tokens", type=int, default=4,
                    help="vLLM's n-gram drafts per step (its prompt lookup 2-5 tokens, as kvfleet's)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "spec_decode.json"))
    args = ap.parse_args()
    cpu = print_cpu()
    if args.quick:
        args.reps, args.max_tokens, args.min_seconds = 1, 32, 0.0
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    torch.set_num_threads(args.threads)
    from kvfleet_server import EngineConfig, LLMEngine
    from kvfleet_server.spec_decode.gate import DraftGate

    base_kw = dict(dtype="float32", device="cpu", num_threads=args.threads, max_model_len=1024)
    plain = LLMEngine(EngineConfig(**base_kw))
    wl = workloads(plain.tokenizer)
    rows = []
    print(f"{'method':<20} {'workload':<15} {'conc':>4} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
          f"{'decode ratio':>12} {'accept len':>10} {'accept %':>8} {'same':>5}")
    for name in args.methods:
        spec = dict(METHODS[name])
        if args.break_even_floor:
            spec["min_acceptance"] = DraftGate.MIN_ACCEPTANCE
        if spec.get("model") == "RANDOM":
            spec["model"] = random_draft_dir(os.path.join(os.path.dirname(args.out), ".random_draft"))
        eng = LLMEngine(EngineConfig(**base_kw, speculative_config=spec))
        for wname, prompts in wl.items():
            for conc in args.concurrency:
                ps = prompts[: args.num_prompts_c1] if conc == 1 else prompts[:conc]
                a_rates, b_rates, a_dec, b_dec, same, stats = [], [], [], [], True, [0, 0, 0]
                r, secs, kv_spec_s = 0, {plain: 0.0, eng: 0.0}, []
                # an even number of pairs, at least --reps, more (up to 4x) until each engine ran --min-seconds
                while r < args.reps or r % 2 or (min(secs.values()) < args.min_seconds and r < 4 * args.reps):
                    # ABBA: odd pairs run the speculative engine first, so order effects cancel
                    res = {}
                    for e in (plain, eng) if r % 2 == 0 else (eng, plain):
                        t = time.perf_counter()
                        res[e] = run(e, ps, conc, args.max_tokens, f"{'p' if e is plain else 's'}{r}")
                        secs[e] += time.perf_counter() - t
                    (a, ad, a_out, *_), (b, bd, b_out, d, dt, acc) = res[plain], res[eng]
                    r += 1
                    a_rates.append(a)
                    b_rates.append(b)
                    a_dec.append(ad)
                    b_dec.append(bd)
                    same &= a_out == b_out
                    kv_spec_s.append(sum(len(o) for o in b_out) / b)
                    stats = [stats[0] + d, stats[1] + dt, stats[2] + acc]
                pa, pb = statistics.median(a_rates), statistics.median(b_rates)
                da, db = statistics.median(a_dec), statistics.median(b_dec)
                # the ratio of each adjacent pair of runs, then their median (robust to the load drifting);
                # a decode rate of 0 means no decode-only step was timed in that run
                ratio = statistics.median(y / x for x, y in zip(a_rates, b_rates))
                dec_pairs = [y / x for x, y in zip(a_dec, b_dec) if x and y]
                dec_ratio = statistics.median(dec_pairs) if dec_pairs else None
                row = dict(method=name, speculative_config=METHODS[name], workload=wname, concurrency=conc,
                           plain_tok_s=round(pa, 2), spec_tok_s=round(pb, 2), ratio=round(ratio, 3),
                           plain_decode_tok_s=round(da, 2), spec_decode_tok_s=round(db, 2),
                           decode_ratio=None if dec_ratio is None else round(dec_ratio, 3), pairs=r,
                           mean_acceptance_length=round(1 + stats[2] / stats[0], 3) if stats[0] else None,
                           draft_acceptance_rate=round(stats[2] / stats[1], 3) if stats[1] else None,
                           identical_outputs=same, plain_runs=[round(x, 2) for x in a_rates],
                           spec_runs=[round(x, 2) for x in b_rates], plain_decode_runs=[round(x, 2) for x in a_dec],
                           spec_decode_runs=[round(x, 2) for x in b_dec])
                rows.append(row)
                al = f"{row['mean_acceptance_length']:.2f}" if stats[0] else "-"
                ar = f"{100 * row['draft_acceptance_rate']:.0f}" if stats[1] else "-"
                print(f"{name:<20} {wname:<15} {conc:>4} {pa:>11.2f} {pb:>10.2f} {ratio:>6.2f} "
                      f"{'-' if dec_ratio is None else f'{dec_ratio:.2f}':>12} {al:>10} {ar:>8} "
                      f"{str(same):>5}", flush=True)
                if args.vllm_python and name == "ngram" and conc == 1:
                    row["vllm"] = vllm_row(args, plain, ps, a_out, b_out, r, statistics.median(kv_spec_s))
                    v = row["vllm"]
                    print(f"{'  vLLM ' + v['version']:<20} {wname:<15} {conc:>4} {v['plain_tok_s']:>11.2f} "
                          f"{v['spec_tok_s']:>10.2f} {v['ratio']:>6.2f}  wall s: kvfleet spec {v['kvfleet_spec_s']:.2f} "
                          f"vs vLLM spec {v['spec_s']:.2f} ({v['kvfleet_spec_s'] / v['spec_s']:.2f}x); same tokens "
                          f"as kvfleet: plain {v['plain_same']}/{len(ps)}, spec {v['spec_same']}/{len(ps)}", flush=True)
        del eng
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(cpu=cpu, command=" ".join(["python"] + sys.argv), reps=args.reps, min_seconds=args.min_seconds,
                       ratio="median over the pairs of runs of spec tok/s / plain tok/s (ABBA order)",
                       min_acceptance_floor=DraftGate.MIN_ACCEPTANCE,
                       max_tokens=args.max_tokens,
                       break_even_floor=args.break_even_floor,
                       threads=args.threads, rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
