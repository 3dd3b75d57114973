"""``python -m kvfleet_server.demo --offline``: load the bundled SmolLM2-135M-Instruct with the offline
``LLM`` API on the CPU and print chat answers (the main job of ``make demo``)."""

from __future__ import annotations

import argparse
import time

DEMO_QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for writing clean Python code.",
    "Explain in two sentences what a KV cache is in LLM inference.",
]


def run_offline(model: str | None = None, max_tokens: int = 96, questions: list[str] | None = None) -> list[str]:
    """Answer each question with one batched ``LLM.chat`` call; prints and returns the answers."""
    from kvfleet_server import LLM, SamplingParams

    t0 = time.monotonic()
    llm = LLM(model=model)
    print(f"loaded {llm.engine.model_name} in {time.monotonic() - t0:.1f}s "
          f"({llm.engine.num_blocks} KV blocks of {llm.engine.block_size} tokens, max_model_len "
          f"{llm.engine.max_model_len})", flush=True)
    questions = questions or DEMO_QUESTIONS
    convs = [[{"role": "user", "content": q}] for q in questions]
    t0 = time.monotonic()
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    dt = time.monotonic() - t0
    answers = []
    ntok = 0
    for q, o in zip(questions, outs):
        c = o.outputs[0]
        ntok += len(c.token_ids)
        answers.append(c.text)
        print(f"\n>>> {q}\n{c.text.strip()}\n[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]")
    print(f"\n{len(questions)} answers, {ntok} tokens in {dt:.1f}s ({ntok / dt:.1f} tok/s, batched)")
    return answers


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvfleet_server.demo", description=__doc__)
    ap.add_argument("--offline", action="store_true", help="offline LLM API demo (no server)")
    ap.add_argument("--model", default=None, help="model directory or .gguf (default: bundled SmolLM2)")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    run_offline(args.model, args.max_tokens)


if __name__ == "__main__":
    main()
