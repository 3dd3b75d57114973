"""Process groups for tensor parallelism (torch.distributed) and the collectives the model uses.

Two groups per tensor-parallel set of N ranks, as vLLM keeps them:

* the *device group* carries the model's tensors: NCCL on CUDA, gloo on the CPU. Row-parallel layers
  all-reduce their partial sums in it; the vocab-parallel LM head gathers its logit shards to rank 0.
* the *CPU group* (always gloo) carries the control plane: rank 0's per-step batch broadcast
  (``broadcast_object``) and the start-up agreement on the KV pool size (``gather_object``). It keeps
  small Python objects off the GPU stream.

A rank builds its ``TPGroup`` first (rank, size, device: enough to build its model shard) and
``connect``s it once every rank has loaded. ``TPGroup`` is passed explicitly to the model (no
module-global state), so an engine with N = 1 and one with N = 3 can live in the same process one after
the other. With ``world_size == 1`` every collective is the identity and no torch.distributed call is
made.

``CommTimer`` accumulates the wall time spent in all-reduce / gather / broadcast (the benchmark breaks
step time down with it); on CUDA a timed collective synchronizes the device first, so timing is off
unless enabled.
"""

from __future__ import annotations

import datetime
import pickle
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommTimer:
    """Seconds and call counts of collectives since the last ``reset()`` (only while ``enabled``), and
    the bytes rank 0 broadcast (pickled step messages)."""

    enabled: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    broadcast_bytes: int = 0

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.broadcast_bytes = 0

    def add(self, kind: str, dt: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + dt
        self.calls[kind] = self.calls.get(kind, 0) + 1


@dataclass
class TPGroup:
    """One rank's view of its tensor-parallel group.

    Attributes:
        rank: this process's rank in [0, world_size); rank 0 runs the engine.
        world_size: N, the tensor-parallel size.
        device: torch device of this rank's shard ("cpu", "cuda:1", ...).
        device_group / cpu_group: torch.distributed process groups (None when world_size == 1).
        timer: CommTimer of this rank.
    """

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    device_group: object = None
    cpu_group: object = None
    timer: CommTimer = field(default_factory=CommTimer)

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    # ------------------------------------------------------------------ tensor collectives
    def _timed(self, kind: str, fn):
        if not self.timer.enabled:
            return fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        out = fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.timer.add(kind, time.perf_counter() - t)
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (any shape) over the ranks, in place; returns ``x``. Identity for N = 1."""
        if self.world_size == 1:
            return x
        self._timed("all_reduce", lambda: dist.all_reduce(x, group=self.device_group))
        return x

    def gather_to_rank0(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along ``dim`` on rank 0 (same shape on every rank).

        Returns the concatenation on rank 0 and None elsewhere; ``x`` itself for N = 1.
        """
        if self.world_size == 1:
            return x
        x = x.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            self._timed("gather", lambda: dist.gather(x, parts, dst=0, group=self.device_group))
            return torch.cat(parts, dim=dim)
        self._timed("gather", lambda: dist.gather(x, None, dst=0, group=self.device_group))
        return None

    # ------------------------------------------------------------------ control plane (CPU group)
    def broadcast_object(self, obj=None):
        """Rank 0 sends ``obj`` (picklable) to every rank; every rank returns it.

        Two gloo broadcasts: the pickle's length, then its bytes.
        """
        if self.world_size == 1:
            return obj

        def go():
            if self.rank == 0:
                data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
                if self.timer.enabled:
                    self.timer.broadcast_bytes += len(data)
                size = torch.tensor([len(data)], dtype=torch.int64)
                dist.broadcast(size, src=0, group=self.cpu_group)
                buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                dist.broadcast(buf, src=0, group=self.cpu_group)
                return obj
            size = torch.zeros(1, dtype=torch.int64)
            dist.broadcast(size, src=0, group=self.cpu_group)
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.broadcast(buf, src=0, group=self.cpu_group)
            return pickle.loads(buf.numpy().tobytes())

        return self._timed("broadcast", go)

    def gather_object(self, obj) -> list | None:
        """Every rank's ``obj`` as a list on rank 0 (None elsewhere); ``[obj]`` for N = 1."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        return out

    def connect(self, init_method: str, timeout_s: float = 120.0) -> None:
        """Join the N-rank group rendezvousing at ``init_method`` (e.g. ``tcp://127.0.0.1:29511``).

        NCCL is the device backend on CUDA, gloo on the CPU; the control group is always gloo. Blocks
        until every rank has joined or ``timeout_s`` passes (RuntimeError). Call only once every rank is
        known to be alive (``workers.WorkerGroup.wait_loaded``), so that it never waits on a dead peer.
        """
        if self.world_size == 1:
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        kwargs = {"device_id": self.device} if self.device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.world_size,
                                timeout=timeout, **kwargs)
        self.device_group = dist.group.WORLD
        self.cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD

    def destroy(self) -> None:
        """Leave the process groups (idempotent)."""
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.device_group = self.cpu_group = None
