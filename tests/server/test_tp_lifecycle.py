"""Tensor-parallel lifecycle with real processes (must-show 3): a kvfleet-server at TP = 2 on the tiny
random Llama (rank 0 = the server, rank 1 = a spawned worker, one thread each), checked through the
process table (psutil).

* SIGTERM mid-stream: the stream finishes, the server exits 0 and no worker is left;
* SIGKILL of rank 0: no worker is alive 5 s later;
* SIGKILL of the worker: /health turns 503 naming the rank, the server exits non-zero and logs the rank;
* a worker that cannot start (its CPU binding is invalid): start-up ends with the worker's error, exit 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil

from server_fixtures import free_port, start_server

TP = ["--tensor-parallel-size", "2", "--num-threads", "1", "--max-model-len", "512",
      "--kv-cache-memory-bytes", "2000000", "--served-model-name", "tiny"]


def worker_pids(server_pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(server_pid).children(recursive=True)
            if "kvfleet_server.executor.workers" in " ".join(p.cmdline())]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_dead(pids: list[int], within: float) -> list[int]:
    """pids still alive after ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_sigterm_mid_stream_drains_then_every_worker_exits(tiny_llama_dir, tmp_path):
    srv = start_server(["--model", tiny_llama_dir, *TP, "--shutdown-timeout", "60"], str(tmp_path / "s.log"))
    try:
        workers = worker_pids(srv.proc.pid)
        assert len(workers) == 1 and alive(workers[0])
        body = {"model": "tiny", "prompt": "a story", "max_tokens": 60, "ignore_eos": True, "stream": True}
        tokens, finish, done = 0, None, False
        with httpx.Client(timeout=120) as c, c.stream("POST", srv.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    ch = json.loads(line[6:])["choices"][0]
                    tokens += 1
                    finish = ch["finish_reason"] or finish
                    if tokens == 3:
                        srv.proc.send_signal(signal.SIGTERM)
        assert (finish, done) == ("length", True)
        assert srv.proc.wait(60) == 0, srv.log()
        assert wait_dead(workers, 5) == []
    finally:
        srv.stop()


def test_health_is_503_until_every_rank_is_loaded(tiny_llama_dir, tmp_path):
    log = tmp_path / "s.log"
    port = free_port()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvfleet_server.cli", "--host", "127.0.0.1", "--port", str(port),
                                 "--model", tiny_llama_dir, *TP], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        codes: list[int] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                codes.append(httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code)
            except httpx.HTTPError:
                pass
            if codes and codes[-1] == 200:
                break
            time.sleep(0.02)
        text = log.read_text()
        assert codes and codes[-1] == 200 and 503 in codes, (codes[-5:], text)
        assert "rank1 kvfleet.workers: shard loaded" in text  # the worker had loaded when /health turned 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_sigkill_of_rank_0_leaves_no_worker_after_5_s(tiny_llama_dir, tmp_path):
    srv = start_server(["--model", tiny_llama_dir, *TP], str(tmp_path / "s.log"))
    try:
        workers = worker_pids(srv.proc.pid)
        assert workers and all(alive(p) for p in workers)
        srv.proc.kill()
        srv.proc.wait()
        assert wait_dead(workers, 5) == [], "workers outlived rank 0"
    finally:
        srv.stop()


def test_sigkill_of_rank_0_while_the_worker_loads_leaves_no_worker_after_5_s(tiny_llama_dir):
    """Before the process groups exist nothing but the control socket tells the worker rank 0 is gone."""
    proc = subprocess.Popen([sys.executable, "-m", "kvfleet_server.cli", "--host", "127.0.0.1", "--port",
                             str(free_port()), "--model", tiny_llama_dir, *TP],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        workers: list[int] = []
        deadline = time.monotonic() + 60
        while not workers and time.monotonic() < deadline and proc.poll() is None:
            workers = worker_pids(proc.pid)
            time.sleep(0.01)
        assert workers, "no worker was spawned"
        proc.kill()
        proc.wait()
        assert wait_dead(workers, 5) == [], "a loading worker outlived rank 0"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_dead_worker_makes_health_503_and_the_server_exit_non_zero(tiny_llama_dir, tmp_path):
    srv = start_server(["--model", tiny_llama_dir, *TP], str(tmp_path / "s.log"))
    try:
        (worker,) = worker_pids(srv.proc.pid)
        ok = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4},
                        timeout=60)
        assert ok.status_code == 200
        os.kill(worker, signal.SIGKILL)
        seen = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and seen is None and srv.proc.poll() is None:
            try:
                r = httpx.get(srv.url + "/health", timeout=2)
                if r.status_code == 503:
                    seen = r.json()["error"]["message"]
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        assert seen is not None and "rank 1" in seen, srv.log()
        assert srv.proc.wait(30) == 1
        assert f"tensor-parallel worker rank 1 (pid {worker}) died" in srv.log()
    finally:
        srv.stop()


def test_worker_that_cannot_start_ends_start_up_with_its_error(tiny_llama_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|4000", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvfleet_server.cli", "--host", "127.0.0.1", "--port", str(port),
                             "--model", tiny_llama_dir, *TP], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=120)  # a hang fails here
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out
    assert "tensor-parallel rank 1 failed to start: OSError" in out and "cannot bind to CPUs [4000]" in out, out


def test_the_operators_rendered_tp_flags_start_a_tp_server(tiny_llama_dir, tmp_path):
    """Contract with the operator: the flags it renders for engine.tensorParallelSize 2 start a serving
    TP server. Only what this GPU-less machine needs is replaced: the model path (a local tiny model),
    --device cpu and a small KV pool; --host/--port come from start_server."""
    from kvfleet_operator import render

    obj = {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "tp", "namespace": "ns", "uid": "u-1", "generation": 1},
           "spec": {"model": {"uri": "hf://org/tiny"}, "engine": {"tensorParallelSize": 2, "maxModelLen": 512}}}
    args = render.render(obj).deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    replace = {"--model": tiny_llama_dir, "--device": "cpu"}
    drop = {"--host", "--port"}
    out, i = [], 0
    while i < len(args):
        name = args[i]
        takes_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        value = args[i + 1] if takes_value else None
        if name not in drop:
            out += [name] + ([replace.get(name, value)] if takes_value else [])
        i += 2 if takes_value else 1
    served = args[args.index("--served-model-name") + 1]
    srv = start_server([*out, "--kv-cache-memory-bytes", "2000000", "--num-threads", "1"], str(tmp_path / "s.log"))
    try:
        assert len(worker_pids(srv.proc.pid)) == 1
        r = httpx.post(srv.url + "/v1/completions", json={"model": served, "prompt": "hi", "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        assert srv.stop() == 0, srv.log()
