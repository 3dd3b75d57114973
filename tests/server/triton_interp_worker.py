"""Run in a subprocess with TRITON_INTERPRET=1 (set by the caller before triton is imported): the
Triton kernels against the torch oracle on the CPU, and a whole engine run with each backend.

``python triton_interp_worker.py kernels`` prints one JSON object per case;
``python triton_interp_worker.py engine MODEL_DIR`` prints {"torch": tokens, "triton": tokens,
"triton_graphs": tokens, "graph_sizes": sizes launched}; "triton_graphs" runs the decode steps through
``DecodeGraphs`` (padded to the captured sizes, the replay replaced by the same forward) and checks that
every such step writes K/V only at its real rows' slots (the kernel skips PAD_SLOT_ID rows).
"""

from __future__ import annotations

import json
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before starting this script"
torch.set_num_threads(1)

def kernels() -> None:
    from kvfleet_server.attention.parity import GQA, SEQS, compare, make_case
    from kvfleet_server.attention.torch_ref import TorchAttentionBackend
    from kvfleet_server.attention.triton_backend import TritonAttentionBackend

    oracle = TorchAttentionBackend()
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, seqs in SEQS.items():
            for h, kvh in GQA:
                cases.append((name, seqs, h, kvh, 16, 8, dtype, None, 3))
    # other block sizes / head_dims (64; 24, not a power of two) / a single split / FP8 caches
    cases += [("decode", SEQS["decode"], 8, 2, 64, 16, torch.float32, None, 1),
              ("mixed", SEQS["mixed"], 4, 2, 16, 4, torch.float32, None, 2),
              ("mixed", SEQS["mixed"], 6, 2, 24, 8, torch.float32, None, 2),  # head_dim padded to 32
              ("mixed", SEQS["mixed"], 4, 2, 16, 8, torch.float32, torch.float8_e4m3fn, 3),
              ("mixed", SEQS["mixed"], 8, 2, 16, 8, torch.bfloat16, torch.float8_e5m2, 3)]
    for name, seqs, h, kvh, hd, bs, dtype, kvd, splits in cases:
        case = make_case(seqs, h, kvh, hd, bs, dtype, kv_cache_dtype=kvd, seed=len(seqs) + h)
        # 16-token K/V tiles: several tiles per split at these small contexts
        res = compare(TritonAttentionBackend(num_splits=splits, decode_block_n=16), oracle, case)
        print(json.dumps({"kind": name, "heads": h, "kv_heads": kvh, "head_dim": hd, "block_size": bs,
                          "dtype": str(dtype).removeprefix("torch."),
                          "kv_cache_dtype": str(kvd).removeprefix("torch.") if kvd else "auto",
                          "num_splits": splits, **res}), flush=True)


def engine(model_dir: str) -> None:
    from kvfleet_server import LLM, SamplingParams

    prompts = ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21", "Hi"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = {}
    for run in ("torch", "triton", "triton_graphs"):
        backend = run.split("_")[0]
        # block size 8 and a 16-token chunk budget: chunked prefill over cached blocks, decodes over
        # several blocks, prefix-cache hits for the repeated prompt
        llm = LLM(model=model_dir, dtype="float32", device="cpu", kv_cache_memory_bytes=2 << 20, block_size=8,
                  max_num_batched_tokens=16, attention_backend=backend)
        runner = llm.engine.runner
        assert runner.backend.name == backend
        if run == "triton_graphs":
            out["graph_sizes"] = _install_eager_graphs(runner)
        res = llm.generate(prompts + prompts[:1], params)
        out[run] = [r.outputs[0].token_ids for r in res]
    print(json.dumps(out))


def _install_eager_graphs(runner) -> list[int]:
    """DecodeGraphs on ``runner`` with eager launches; returns the list the launched sizes go into."""
    from kvfleet_server.executor.cuda_graphs import DecodeGraphs, capture_sizes

    graphs = DecodeGraphs(runner, capture_sizes(8), max_blocks_per_seq=32)
    graphs.use_eager()
    launched: list[int] = []
    real_run = runner.run

    def checked_run(inputs):
        before = [(k.clone(), v.clone()) for k, v, _ in runner.kv_caches]
        hidden = real_run(inputs)
        if graphs.can_run(inputs):
            launched.append(int(graphs.slot_mapping.ne(-1).sum()))
            for (k0, v0), (k, v, _) in zip(before, runner.kv_caches):
                changed = ((k0 != k).flatten(2).any(-1) | (v0 != v).flatten(2).any(-1)).flatten()
                written = set(changed.nonzero().flatten().tolist())
                assert written <= set(inputs.dec_slots), (written, inputs.dec_slots)
        return hidden

    runner.graphs, runner.run = graphs, checked_run
    return launched


if __name__ == "__main__":
    kernels() if sys.argv[1] == "kernels" else engine(sys.argv[2])
