"""Multi-LoRA for the one ``Linear``: every row of a batch applies its own adapter (or none).

Punica's semantics (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving"; vLLM's ``PunicaWrapper``):
y[t] += scale·(x[t] A[s]ᵀ) B[s]ᵀ with s = the slot of row t's adapter, a *shrink* (x Aᵀ: [T, in] → [T, r])
then an *expand* (· Bᵀ: [T, r] → [T, out]); rows of the base model (slot −1) are left alone.

Each LoRA-enabled ``Linear`` holds ``LoRAWeights``: ``max_loras`` slots of A [n_shards·R, in] and
B [out, n_shards·R] (R = --max-lora-rank; a fused Linear's shards — q/k/v, gate/up — each have their own
rank block, so B is block diagonal; a smaller r is zero-padded; the scale is folded into B). Tensor
parallelism follows the base weight: a column-parallel Linear keeps its rows of B, a row-parallel one its
columns of A, and its partial LoRA product is summed by the Linear's own all-reduce (the sum over ranks of
x_r A_rᵀ is x Aᵀ).

All LoRA Linears of a model share one ``LoRAMapping``: the step's row → slot map, set once per step by the
runner, laid out once: with at least three adapters in the step, one gather and one batched shrink and
expand over all of them (``lora_apply_grouped``), else one shrink and expand per adapter present
(``lora_apply``, SGMV-like) — never a loop over rows. ``lora_reference`` (BGMV-like: every row gathers its
own A and B) is the oracle the tests compare both with.
"""

from __future__ import annotations

import torch

from ..lora_checkpoint import TARGET_MODULES, LoRAAdapter
from .linear import narrow_padded


#: the grouped path (one batched shrink and expand over every adapter present) is taken when at least
#: this many adapters are present and padding each adapter's rows to the largest group at most doubles
#: the rows; otherwise one shrink and expand per adapter (few adapters, or a prefill dominated by one)
GROUPED_MIN_ADAPTERS = 3


class LoRAMapping:
    """The step's rows → adapter slots, shared by every LoRA ``Linear`` of a model.

    Two layouts of the same mapping (``set`` picks one):

    - ``segments``: (slot, rows) per slot present — rows None when every row uses that slot, else an int64
      index tensor [n]; base-model rows (slot −1) are in no segment;
    - ``grouped``: (first slot, gather [G·M], mask [G, M, 1]) for the slots first..first+G−1, each given M
      rows (its rows, padded with row 0 whose results the mask zeroes): one batched shrink and expand.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.segments: list[tuple[int, torch.Tensor | None]] = []
        self.grouped: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def set(self, token_slots: list[int]) -> None:
        """Row t of the next passes uses slot ``token_slots[t]`` (−1: the base model); an empty list: every
        row is the base model's."""
        self.segments = []
        self.grouped = None
        if not token_slots or max(token_slots) < 0:
            return
        rows: dict[int, list[int]] = {}
        for t, s in enumerate(token_slots):
            if s >= 0:
                rows.setdefault(s, []).append(t)
        if len(rows) == 1 and len(next(iter(rows.values()))) == len(token_slots):
            self.segments = [(next(iter(rows)), None)]
            return
        first, last = min(rows), max(rows)
        width = max(len(r) for r in rows.values())
        groups = last - first + 1
        if len(rows) >= GROUPED_MIN_ADAPTERS and groups * width <= 2 * sum(len(r) for r in rows.values()):
            gather, mask = [], []
            for s in range(first, last + 1):
                r = rows.get(s, [])
                gather += r + [0] * (width - len(r))
                mask += [1.0] * len(r) + [0.0] * (width - len(r))
            self.grouped = (first, torch.tensor(gather, dtype=torch.long, device=self.device),
                            torch.tensor(mask, device=self.device).view(groups, width, 1))
            return
        for s, r in sorted(rows.items()):
            self.segments.append((s, torch.tensor(r, dtype=torch.long, device=self.device)))


class LoRAWeights:
    """``max_loras`` adapter slots of one Linear (see the module docstring for the layout).

    Attributes:
        a: [max_loras, n_shards·R, in_local] in the model dtype.
        b: [max_loras, out_local, n_shards·R] in the model dtype, scale folded in.
        mapping: the model's shared ``LoRAMapping``.
    """

    def __init__(self, linear, max_loras: int, max_rank: int, mapping: LoRAMapping, dtype: torch.dtype,
                 device: torch.device):
        self.linear = linear
        self.max_rank = max_rank
        self.mapping = mapping
        n = len(linear.output_sizes)
        self.a = torch.zeros(max_loras, n * max_rank, linear.input_size, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, linear.output_size, n * max_rank, dtype=dtype, device=device)

    def set_slot(self, slot: int, shards: list[tuple[torch.Tensor, torch.Tensor] | None], scale: float) -> None:
        """Slot ``slot`` := the adapter's (A [r, in], B [out, r]) of each output shard (None: that shard has
        no LoRA), full checkpoint sizes: this rank's part is cut here, as the base weight is cut."""
        lin, R = self.linear, self.max_rank
        self.a[slot].zero_()
        self.b[slot].zero_()
        for i, ab in enumerate(shards):
            if ab is None:
                continue
            A, B = ab
            r = A.shape[0]
            if lin.row_slice is not None:  # row-parallel: this rank's input columns
                A = A.narrow(1, *lin.row_slice)
            if lin.column_slices is not None:  # column-parallel: this rank's output rows of the shard
                B = narrow_padded(B, 0, *lin.column_slices[i])
            first, rows = lin.shard_offset(i)
            self.a[slot, i * R : i * R + r] = A.to(self.a.dtype)
            self.b[slot, first : first + rows, i * R : i * R + r] = (B.float() * scale).to(self.b.dtype)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] + each row's adapter delta for x [T, in] (rows of the base model unchanged)."""
        grouped = self.mapping.grouped
        if grouped is not None:
            return lora_apply_grouped(x, y, self.a, self.b, *grouped)
        return lora_apply(x, y, self.a, self.b, self.mapping.segments)


def lora_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               segments: list[tuple[int, torch.Tensor | None]]) -> torch.Tensor:
    """The fast path: per adapter present, shrink then expand over its rows only (SGMV's grouping).

    x [T, in], y [T, out] (updated in place and returned), a [S, n·R, in], b [S, out, n·R],
    segments from ``LoRAMapping``."""
    for slot, rows in segments:
        if rows is None:
            y.addmm_(x @ a[slot].t(), b[slot].t())
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].t()) @ b[slot].t())
    return y


def lora_apply_grouped(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: int,
                       gather: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The fast path for many adapters (BGMV's batching over adapters): slots first..first+G−1, each with
    M gathered rows, one batched shrink and one batched expand. x [T, in], y [T, out] (updated in place
    and returned), a [S, n·R, in], b [S, out, n·R], gather [G·M], mask [G, M, 1] (``LoRAMapping``)."""
    groups, width = mask.shape[0], mask.shape[1]
    xs = x.index_select(0, gather).view(groups, width, -1)
    shrink = torch.bmm(xs, a.narrow(0, first, groups).transpose(1, 2)).mul_(mask)
    delta = torch.bmm(shrink, b.narrow(0, first, groups).transpose(1, 2))
    return y.index_add_(0, gather, delta.view(groups * width, -1))


def lora_reference(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   token_slots: torch.Tensor) -> torch.Tensor:
    """The oracle (BGMV's per-row gather): y + per row t with slot s ≥ 0, (x[t] a[s]ᵀ) b[s]ᵀ, in float32.
    Returns a new [T, out] float32 tensor."""
    s = token_slots.clamp(min=0)
    on = (token_slots >= 0).float()[:, None]
    shrink = torch.einsum("ti,tri->tr", x.float(), a[s].float())
    return y.float() + on * torch.einsum("tr,tor->to", shrink, b[s].float())


def attach_lora(model, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device | str
                ) -> LoRAMapping:
    """Give every decoder projection of ``model`` (LlamaForCausalLM) ``max_loras`` LoRA slots of rank
    ``max_rank`` in ``dtype`` (the activations' dtype) on ``device``; returns the shared mapping (also
    ``model.lora_mapping``)."""
    mapping = LoRAMapping(device)
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            lin = getattr(layer, name)
            lin.lora = LoRAWeights(lin, max_loras, max_rank, mapping, dtype, torch.device(device))
    model.lora_mapping = mapping
    return mapping


def set_adapter(model, slot: int, adapter: LoRAAdapter) -> None:
    """Slot ``slot`` of every LoRA Linear := ``adapter``'s weights (each PEFT module into its Linear's shard,
    ``TARGET_MODULES``)."""
    for i, layer in enumerate(model.layers):
        shards: dict[str, list] = {}
        for module, (linear, shard) in TARGET_MODULES.items():
            lin = getattr(layer, linear)
            shards.setdefault(linear, [None] * len(lin.output_sizes))[shard] = adapter.weights.get((i, module))
        for linear, parts in shards.items():
            getattr(layer, linear).lora.set_slot(slot, parts, adapter.scale)
