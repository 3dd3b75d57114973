"""``make demo``: kvfleet-server on the bundled SmolLM2-135M-Instruct, one chat completion, clean stop.

    python -m kvfleet_server.demo             # server demo: launch, wait for /health, ask, print, SIGTERM
    python -m kvfleet_server.demo --offline   # the offline LLM API, no server (run_offline)

The server demo is what a pod does: it starts ``kvfleet-server`` on 127.0.0.1 (a free port), waits until
/health answers 200 (that is when a request would be served), sends a chat completion with the official
``openai`` client, prints the answer, then sends SIGTERM and waits for the graceful drain to exit 0.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time

QUESTION = "What is the capital of France? Answer in one sentence."

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



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ready(proc: subprocess.Popen, url: str, timeout_s: float = 300.0) -> float:
    """Poll ``url``/health until 200; returns seconds waited. Raises RuntimeError if the server exits or times out."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"kvfleet-server exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"kvfleet-server not ready after {timeout_s:.0f}s")


def run_server_demo(model: str = "smollm2", question: str = QUESTION, max_tokens: int = 64) -> int:
    """Launch kvfleet-server, ask one chat question with the openai client, print the answer, stop it (SIGTERM)."""
    import openai

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvfleet_server.cli", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "2048", "--disable-uvicorn-access-log", "--shutdown-timeout", "10"]
    print(f"$ kvfleet-server --model {model} --host 127.0.0.1 --port {port}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    try:
        waited = wait_until_ready(proc, url)
        print(f"server ready: /health 200 after {waited:.1f}s", flush=True)
        client = openai.OpenAI(base_url=url + "/v1", api_key="demo", max_retries=0, timeout=120)
        served = model  # vLLM's rule: the model is served under the --model string (the README's snippet)
        print(f"\nuser> {question}", flush=True)
        t1 = time.monotonic()
        reply = client.chat.completions.create(model=served, messages=[{"role": "user", "content": question}],
                                               max_tokens=max_tokens, temperature=0)
        answer = reply.choices[0].message.content
        print(f"{served}> {answer}", flush=True)
        print(f"\n({reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} generated tokens in "
              f"{time.monotonic() - t1:.2f}s; finish_reason={reply.choices[0].finish_reason})", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported, then the server is stopped
        print(f"demo failed: {exc}", file=sys.stderr)
        proc.kill()
        proc.wait()
        return 1
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    print(f"server stopped (SIGTERM, exit status {rc}) after {time.monotonic() - t0:.1f}s in all", flush=True)
    return 0 if rc == 0 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfleet_server.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--offline", action="store_true", help="use the offline LLM API instead of the server")
    p.add_argument("--model", default=None, help="model directory or .gguf (default: the bundled SmolLM2)")
    p.add_argument("--question", default=QUESTION, help="what the server demo asks")
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args(argv)
    if args.offline:
        run_offline(args.model, args.max_tokens)
        return 0
    return run_server_demo(args.model or "smollm2", args.question, args.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
