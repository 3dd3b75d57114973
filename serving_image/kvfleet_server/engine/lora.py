"""LoRAManager: LoRA's one engine-facing object — the adapters a server knows, and which of them occupy the
``--max-loras`` slots of the model's LoRA layers (vLLM's ``LRUCacheWorkerLoRAManager`` + its scheduler's
``max_loras`` rule).

- ``add`` / ``remove``: the registry (``--lora-modules`` at start-up, ``/v1/load_lora_adapter`` at run
  time). ``add`` reads and checks the adapter on rank 0, then every rank reads it into its host LRU.
- ``acquire`` / ``release``: the scheduler admits a sequence only when its adapter holds a slot or can
  get one — a free slot, else the least recently used slot no running sequence holds; a slot held by a
  running (or preempted-and-requeued, once admitted again) sequence is never taken. Base-model sequences
  always pass.
- ``before_forward``: the step's hook: loads the adapters newly given a slot (``ModelRunner.load_lora``,
  collective) before the forward pass; ``slot`` gives a sequence's slot for its ``TokenSpan``.
"""

from __future__ import annotations

import itertools
from collections import Counter

from ..model.lora_checkpoint import LoRAError
from ..sequence import LoRARequest, Sequence


class LoRAManager:
    """See the module docstring. ``max_loras`` 0: LoRA is off (every sequence is the base model's)."""

    def __init__(self, max_loras: int = 0, runner=None):
        self.max_loras = max_loras
        self.runner = runner
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        #: slot → the adapter in it (None: empty)
        self.slots: list[LoRARequest | None] = [None] * max_loras
        self._refs = Counter()  # slot → sequences holding it
        self._last_used: dict[int, int] = {}  # slot → step of last use (LRU)
        self._clock = itertools.count()
        self._pending: list[int] = []  # slots to load before the next forward pass
        self._held: dict[str, int] = {}  # seq_id → slot

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    # --- registry ------------------------------------------------------------------------------
    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Register adapter ``name`` at ``path`` (read and checked now; ``base_model_name``: its parent in
        /v1/models). Raises LoRAError: LoRA off, name taken (400), or a bad adapter
        (``lora_checkpoint.load_adapter``)."""
        if not self.enabled:
            raise LoRAError("LoRA adapters need --enable-lora", param="lora_name")
        if name in self.adapters:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        req = LoRARequest(name, next(self._ids), path, base_model_name)
        self.runner.adapters.get(req)  # validates on rank 0 first (a bad adapter never reaches the workers)
        self.runner.call("cache_lora", req)  # every rank reads it now, from the same files
        self.adapters[name] = req
        return req

    def remove(self, name: str) -> None:
        """Forget adapter ``name``: new requests cannot use it; sequences already admitted finish with it
        (its slot is reused once none holds it). Raises LoRAError (404) for an unknown name."""
        if name not in self.adapters:
            raise LoRAError(f"The lora adapter '{name}' cannot be found.", param="lora_name", status=404)
        req = self.adapters.pop(name)
        # the host copies stay (evicted by the LRU in time): sequences already queued with it still load it
        for slot, held in enumerate(self.slots):
            if held == req and not self._refs[slot]:
                self.slots[slot] = None
                self._pending = [s for s in self._pending if s != slot]

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    # --- slots (scheduler) ---------------------------------------------------------------------
    def acquire(self, seq: Sequence) -> bool:
        """Give ``seq``'s adapter a slot (or find it there) and count ``seq`` as holding it; False when
        every slot is held by other adapters' sequences. Base-model sequences: True."""
        lora = seq.request.lora
        if lora is None:
            return True
        if seq.seq_id in self._held:
            return True
        slot = self.slots.index(lora) if lora in self.slots else self._free_slot()
        if slot is None:
            return False
        if self.slots[slot] != lora:
            self.slots[slot] = lora
            self._pending.append(slot)
        self._refs[slot] += 1
        self._held[seq.seq_id] = slot
        self._last_used[slot] = next(self._clock)
        return True

    def release(self, seq: Sequence) -> None:
        """``seq`` no longer holds its slot (finished, aborted or preempted)."""
        slot = self._held.pop(seq.seq_id, None)
        if slot is not None:
            self._refs[slot] -= 1

    def slot(self, seq: Sequence) -> int:
        """``seq``'s adapter slot for its TokenSpan (−1: the base model)."""
        return self._held.get(seq.seq_id, -1)

    def _free_slot(self) -> int | None:
        free = [s for s, name in enumerate(self.slots) if name is None]
        if free:
            return free[0]
        idle = [s for s in range(self.max_loras) if not self._refs[s]]
        return min(idle, key=lambda s: self._last_used.get(s, -1)) if idle else None

    # --- the step's hook -----------------------------------------------------------------------
    def before_forward(self) -> None:
        """Load the adapters given a slot since the last pass into their slots (every rank)."""
        pending, self._pending = self._pending, []
        for slot in dict.fromkeys(pending):
            self.runner.call("load_lora", slot, self.slots[slot])

    # --- metrics -------------------------------------------------------------------------------
    def stats(self, scheduler) -> dict:
        """``SchedulerStats``' LoRA fields: max_lora and the adapter names of the running and waiting
        sequences (each once, in order); nothing without LoRA (no walk over the queues)."""
        if not self.enabled:
            return {}

        def names(seqs) -> tuple[str, ...]:
            return tuple(dict.fromkeys(s.request.lora.name for s in seqs if s.request.lora is not None))

        return {"max_lora": self.max_loras, "running_lora_adapters": names(scheduler.running),
                "waiting_lora_adapters": names(scheduler.waiting)}
