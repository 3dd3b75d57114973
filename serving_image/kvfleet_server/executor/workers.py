"""Tensor-parallel worker processes: ranks 1..N-1 of a tensor-parallel engine (rank 0 is the engine's
own process), and the lifecycle rules that keep them from hanging or outliving the server.

Each worker is a fresh interpreter (``python -m kvfleet_server.executor.workers --fd FD``; a fork of a
process that has touched CUDA or OpenMP is unsafe) holding one device (``cuda:r``) or, on the CPU, its
own intra-op threads and, when the machine has a core per rank, its own cores. Rank 0 talks to it over
two channels:

* a control socket (``socket.socketpair``, one per worker): the start-up order, then "loaded" or the
  worker's error, then rank 0's "connect"; afterwards only its closing matters — EOF on the worker's side means rank 0 is gone
  (even after SIGKILL: the kernel closes the socket), and the worker exits at once; EOF on rank 0's side
  means the worker died, and ``WorkerGroup.watch`` reports which rank.
* the process groups (``distributed.TPGroup``): the per-step broadcast, all-reduce and logits gather.

Start-up (``WorkerGroup.start`` → ``wait_loaded`` → ``join``): every rank loads its shard in parallel
(rank 0 also its draft model, if any); the process groups are joined only once every worker has said
"loaded" and rank 0 is done loading (a worker waits for rank 0's "connect" however long that takes:
the rendezvous itself has a 120 s timeout), so rendezvous never waits on a worker that crashed — a worker that fails sends its traceback (or dies: EOF) and start-up
ends with "tensor-parallel rank r failed to start: ..." instead of a hang.

The parent-death signal (prctl PR_SET_PDEATHSIG) is not used: it fires when the *thread* that spawned
the child exits, and the server builds its engine in a loading thread that ends after start-up.

CPU placement (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``): "auto" (default) gives each worker rank its own
slice of the usable cores when there are at least N of them (rank 0 stays unbound: it also runs the
scheduler, the sampler and the HTTP server); "nobind" binds nothing; an explicit list such as
"0-3|4-7" binds rank r (rank 0 included) to the r-th set. Each rank runs ``num_threads`` intra-op
threads (default: its core slice, else usable CPUs // N, at least 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

logger = logging.getLogger("kvfleet.workers")

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
STOP_GRACE_S = 5.0


class WorkerStartupError(RuntimeError):
    """A tensor-parallel worker could not start (its message names the rank and the cause)."""


# --------------------------------------------------------------------------------------------- placement
def parse_cpu_list(text: str) -> set[int]:
    """"0-3,8" → {0, 1, 2, 3, 8}. Raises ValueError naming the text."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                cpus.update(range(lo, hi + 1))
            else:
                cpus.add(int(part))
        except ValueError:
            raise ValueError(f"{BIND_ENV}: bad CPU list {text!r} (expected e.g. '0-3,8')") from None
    if not cpus:
        raise ValueError(f"{BIND_ENV}: empty CPU list in {text!r}")
    return cpus


def cpu_plan(world_size: int, usable: list[int], bind: str | None, num_threads: int | None
             ) -> list[tuple[set[int] | None, int]]:
    """(cores to bind or None, intra-op threads) for each rank on the CPU.

    ``bind``: the VLLM_CPU_OMP_THREADS_BIND value ("auto" when None). Raises ValueError for a list
    whose number of entries differs from ``world_size``.
    """
    bind = (bind or "auto").strip()
    n, cpus = world_size, sorted(usable)
    if bind == "nobind":
        sets: list[set[int] | None] = [None] * n
    elif bind == "auto":
        k = len(cpus) // n
        sets = [None] + [set(cpus[r * k:(r + 1) * k]) for r in range(1, n)] if k >= 1 else [None] * n
    else:
        entries = bind.split("|")
        if len(entries) != n:
            raise ValueError(f"{BIND_ENV}={bind!r} has {len(entries)} CPU sets for tensor_parallel_size={n}; "
                             f"give one per rank, separated by '|'")
        sets = [parse_cpu_list(e) for e in entries]
    default = max(1, len(cpus) // n)
    return [(s, num_threads or (len(s) if s else default)) for s in sets]


def apply_cpu_placement(cores: set[int] | None, threads: int) -> None:
    """Bind this process to ``cores`` (if any) and set torch's intra-op threads. OSError names the cores."""
    import torch

    if cores:
        try:
            os.sched_setaffinity(0, cores)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot bind to CPUs {sorted(cores)} ({BIND_ENV}): {exc.strerror}") from None
    torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------- rank 0 side
@dataclass
class WorkerInfo:
    rank: int
    proc: subprocess.Popen
    conn: Connection
    loaded: bool = False
    report: dict | None = None


class WorkerGroup:
    """Ranks 1..N-1 of a tensor-parallel engine, seen from rank 0.

    Args:
        config: the EngineConfig (sent to every worker as a dict).
        world_size: N.
        device_type: "cpu" or "cuda" (rank r uses ``cuda:r``).
        placement: ``cpu_plan`` output (CPU only; ignored on CUDA).
    """

    def __init__(self, config, world_size: int, device_type: str, placement=None):
        self.config = config
        self.world_size = world_size
        self.device_type = device_type
        self.placement = placement or [(None, 1)] * world_size
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.workers: list[WorkerInfo] = []
        self._stopping = False
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        """Spawn ranks 1..N-1; each starts loading its shard at once."""
        cfg = dataclasses.asdict(self.config)
        for rank in range(1, self.world_size):
            parent, child = socket.socketpair()
            cores, threads = self.placement[rank]
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
            cmd = [sys.executable, "-m", "kvfleet_server.executor.workers", "--fd", str(child.fileno()),
                   "--rank", str(rank)]
            proc = subprocess.Popen(cmd, pass_fds=[child.fileno()], env=env)
            child.close()
            conn = Connection(parent.detach())
            conn.send({"config": cfg, "rank": rank, "world_size": self.world_size, "init_method": self.init_method,
                       "device": f"cuda:{rank}" if self.device_type == "cuda" else "cpu",
                       "cores": sorted(cores) if cores else None, "threads": threads})
            self.workers.append(WorkerInfo(rank, proc, conn))
            logger.info("tensor-parallel rank %d: pid %d%s", rank, proc.pid,
                        f", CPUs {sorted(cores)}" if cores else "")

    def wait_loaded(self, timeout_s: float = 3600.0) -> list[dict]:
        """Block until every worker reported "loaded"; returns their reports (rank order).

        Raises WorkerStartupError as soon as one worker reports an error or exits (the others are
        stopped), or when ``timeout_s`` passes.
        """
        deadline = time.monotonic() + timeout_s
        pending = {w.conn: w for w in self.workers}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                ranks = sorted(w.rank for w in pending.values())
                raise WorkerStartupError(f"tensor-parallel rank(s) {ranks} not loaded after {timeout_s:.0f}s")
            for conn in wait(list(pending), timeout=left):
                w = pending[conn]
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    code = _wait_code(w.proc)
                    self.stop()
                    raise WorkerStartupError(
                        f"tensor-parallel rank {w.rank} (pid {w.proc.pid}) exited with code {code} while starting; "
                        f"see its log lines above") from None
                if kind == "error":
                    self.stop()
                    raise WorkerStartupError(f"tensor-parallel rank {w.rank} failed to start: {payload}")
                w.loaded, w.report = True, payload
                del pending[conn]
        return [w.report for w in self.workers]

    def join(self, tp) -> None:
        """Rank 0, after ``wait_loaded`` and its own loading: tell every worker to join the process groups,
        then join them (``tp``: rank 0's TPGroup)."""
        for w in self.workers:
            w.conn.send(("connect", None))
        tp.connect(self.init_method)

    def watch(self, on_death) -> None:
        """Call ``on_death(rank, pid, exit_code)`` (from a daemon thread) when a worker dies, unless it
        was stopped by ``stop()``."""

        def run():
            conns = {w.conn: w for w in self.workers}
            while conns:
                for conn in wait(list(conns)):
                    w = conns.pop(conn)
                    try:
                        conn.recv()
                        conns[conn] = w  # unexpected message: keep watching
                        continue
                    except (EOFError, OSError):
                        pass
                    if self._stopping:
                        return
                    on_death(w.rank, w.proc.pid, _wait_code(w.proc))
                    return

        self._watcher = threading.Thread(target=run, name="kvfleet-tp-watch", daemon=True)
        self._watcher.start()

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def stop(self, grace_s: float = STOP_GRACE_S) -> list[int | None]:
        """Tell every worker to exit, wait up to ``grace_s``, SIGKILL the rest; returns the exit codes
        (idempotent)."""
        if self in _GROUPS:
            _GROUPS.remove(self)
        if self._stopping and all(w.proc.returncode is not None for w in self.workers):
            return [w.proc.returncode for w in self.workers]
        self._stopping = True
        for w in self.workers:
            try:
                w.conn.send(("stop", None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + grace_s
        codes = []
        for w in self.workers:
            try:
                codes.append(w.proc.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank %d (pid %d) did not exit in %.0fs: killed", w.rank, w.proc.pid,
                               grace_s)
                w.proc.kill()
                codes.append(w.proc.wait())
            try:
                w.conn.close()
            except OSError:
                pass
        return codes


def start_workers(config, device_type: str) -> WorkerGroup:
    """Spawn ranks 1..N-1 for ``config.tensor_parallel_size`` = N and place rank 0 (this process).

    Raises ValueError naming the numbers when CUDA has fewer than N devices, or for a bad
    VLLM_CPU_OMP_THREADS_BIND. The workers are stopped at interpreter exit if nobody stopped them.
    """
    import atexit

    import torch

    n = config.tensor_parallel_size
    placement = None
    if device_type == "cuda":
        have = torch.cuda.device_count()
        if have < n:
            raise ValueError(f"tensor_parallel_size={n} needs {n} CUDA devices, {have} visible")
    else:
        placement = cpu_plan(n, sorted(os.sched_getaffinity(0)), os.environ.get(BIND_ENV), config.num_threads)
        if placement[0][0]:
            apply_cpu_placement(*placement[0])
    group = WorkerGroup(config, n, device_type, placement)
    _GROUPS.append(group)
    if len(_GROUPS) == 1:
        atexit.register(stop_all_workers)
    group.start()
    return group


_GROUPS: list[WorkerGroup] = []


def stop_all_workers() -> None:
    """Stop every worker group this process started (at exit, and on a fatal error)."""
    while _GROUPS:
        _GROUPS.pop().stop()


def _wait_code(proc: subprocess.Popen, timeout: float = 5.0):
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


# --------------------------------------------------------------------------------------------- worker side
_connect_order = threading.Event()  # rank 0's "connect": it is done loading, the groups can form


def _watch_parent(conn: Connection) -> None:
    """Exit this worker when rank 0 closes the control socket (it died or said "stop"); pass on its
    "connect"."""
    try:
        while True:
            kind, _ = conn.recv()
            if kind == "stop":
                os._exit(0)
            if kind == "connect":
                _connect_order.set()
    except (EOFError, OSError):
        pass
    logging.getLogger("kvfleet.workers").error("rank 0 is gone: exiting")
    os._exit(3)


def worker_main(conn: Connection) -> int:
    """Body of ranks 1..N-1: place, load the shard, report, join the groups, size the KV pool, serve."""
    try:
        order = conn.recv()
    except (EOFError, OSError):
        return 3
    rank = order["rank"]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    threading.Thread(target=_watch_parent, args=(conn,), name="kvfleet-parent-watch", daemon=True).start()
    try:
        import torch

        from ..config import EngineConfig
        from .engine_setup import build_shard, prepare_model, size_kv_pool
        from ..distributed import TPGroup

        apply_cpu_placement(set(order["cores"]) if order["cores"] else None, order["threads"])
        config = EngineConfig(**order["config"])
        if order["device"].startswith("cuda"):
            torch.cuda.set_device(order["device"])
        tp = TPGroup(rank, order["world_size"], torch.device(order["device"]))
        t0 = time.monotonic()
        model, _, _ = build_shard(config, tp)
        load_s = time.monotonic() - t0
        logger.info("shard loaded in %.2fs", load_s)
        conn.send(("loaded", {"rank": rank, "pid": os.getpid(), "load_s": load_s}))
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then exit non-zero
        traceback.print_exc()
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        return 1
    _connect_order.wait()
    tp.connect(order["init_method"])
    runner, _ = size_kv_pool(config, model, tp)
    prepare_model(config, model, tp)
    with torch.inference_mode():
        while runner.serve(tp.broadcast_object()):
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="kvfleet tensor-parallel worker (started by rank 0)")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)  # shown in the process table
    args = p.parse_args(argv)
    return worker_main(Connection(args.fd))


if __name__ == "__main__":
    sys.exit(main())
