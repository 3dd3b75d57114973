"""The one ``Linear`` of kvfleet's models: y = x Wᵀ + b with W stored however its ``QuantMethod`` says,
plus, with --enable-lora, each row's adapter delta (``lora.py``).

Shape after vLLM's ``LinearBase`` + ``LinearMethodBase`` (vllm/model_executor/layers/linear.py):
the layer knows its logical sizes and its fused output shards (q/k/v, gate/up); the quant method
owns the parameters (``create_weights``), turns loaded checkpoint tensors into its kernel's layout
(``process_weights_after_loading``) and runs the matmul (``apply``). Every parameter carries a
``weight_loader(param, loaded, shard_id)`` that copies one checkpoint tensor into its rows, so the
model code never branches on the format.

Tensor parallelism (Megatron-LM's split, Shoeybi et al. 2019; vLLM's Column/RowParallelLinear): a
column-parallel Linear is built with ``column_slices`` — for each fused output shard, the (first row,
rows) of the checkpoint tensor this rank keeps — and a row-parallel one with ``row_slice``, the (first
column, columns) of the input it keeps; its partial products are summed by one all-reduce in
``forward`` (the bias, if any, added once after it). The sizes the quant method sees are the local
ones, and every ``weight_loader`` first cuts the checkpoint tensor with ``tp_slice`` (along the
parameter's ``output_dim`` / ``input_dim`` tags: per-channel scales and zero points follow their rows;
packed GGUF tensors are cut at block boundaries). Quantize-at-load methods quantize the local shard.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn


def set_weight_attrs(param: torch.Tensor, **attrs) -> None:
    """Attach loading metadata (``weight_loader``, ``output_dim``, ``input_dim``) to a parameter."""
    for k, v in attrs.items():
        setattr(param, k, v)


class QuantMethod(ABC):
    """How one Linear stores and multiplies its weight.

    Subclasses set ``name`` and implement the three hooks. A method that converts float weights
    (fp8/int8/int4 "online" quantization) lets the default float ``create_weights`` and
    ``weight_loader`` load the checkpoint, then quantizes in ``process_weights_after_loading``.
    """

    name = "abstract"
    #: process_weights_after_loading reads ``layer.row_absmax`` (per-output-channel scales over whole rows);
    #: only then does a row-parallel shard read its full checkpoint rows to compute them
    uses_row_absmax: bool = False

    def create_weights(self, layer: "Linear", input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register ``layer.weight`` [sum(output_sizes), input_size] in ``params_dtype``; fused shards are
        loaded into consecutive row ranges by ``weight_loader``."""
        w = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(w, weight_loader=layer.weight_loader, output_dim=0, input_dim=1)
        layer.register_parameter("weight", w)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        """Convert the loaded weight into the kernel's layout (default: keep it)."""

    @abstractmethod
    def apply(self, layer: "Linear", x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [T, input_size] → [T, output_size] in x's dtype."""

    def embedding(self, layer: "Linear", ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] int64 of the weight as [T, input_size] (vocabulary embeddings)."""
        return F.embedding(ids, layer.weight)


class UnquantizedLinearMethod(QuantMethod):
    """Weight stored in the model dtype; ``F.linear``."""

    name = "unquantized"

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight, bias)


class Linear(nn.Module):
    """y = x Wᵀ + b over a flat token batch.

    Args:
        input_size: K, features in.
        output_sizes: output rows of each fused shard (e.g. [q, k, v]); their sum is N.
        bias: whether the layer has a bias [N] (kept in the model dtype whatever the method).
        quant_method: storage + kernel; None → unquantized.
        prefix: the layer's name in the model (``layers.3.qkv_proj``), for log and error messages.
    Shapes: forward x [T, K] → [T, N].
    """

    def __init__(self, input_size: int, output_sizes: int | list[int], bias: bool = False,
                 quant_method: QuantMethod | None = None, params_dtype: torch.dtype | None = None,
                 prefix: str = "", tp=None, column_slices: list[tuple[int, int]] | None = None,
                 row_slice: tuple[int, int] | None = None):
        super().__init__()
        self.tp = tp
        self.column_slices = list(column_slices) if column_slices is not None else None
        self.row_slice = row_slice
        #: row-parallel: absmax of each output row over all input columns, [output_size] float32
        #: (set while loading; None otherwise)
        self.row_absmax: torch.Tensor | None = None
        self.row_absmax_device = torch.get_default_device()
        if self.column_slices is not None:
            output_sizes = [rows for _, rows in self.column_slices]
        if row_slice is not None:
            input_size = row_slice[1]
        self.input_size = input_size
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.output_size = sum(self.output_sizes)
        self.prefix = prefix
        #: LoRA adapter slots (``layers/lora.py``: ``attach_lora``; None without --enable-lora)
        self.lora = None
        self.quant_method = quant_method or UnquantizedLinearMethod()
        dtype = params_dtype or torch.get_default_dtype()
        self.quant_method.create_weights(self, input_size, self.output_sizes, dtype)
        if bias:
            b = nn.Parameter(torch.empty(self.output_size, dtype=dtype), requires_grad=False)
            set_weight_attrs(b, weight_loader=self.weight_loader, output_dim=0, input_dim=None)
            self.register_parameter("bias", b)
        else:
            self.register_parameter("bias", None)

    def shard_offset(self, shard_id: int | None) -> tuple[int, int]:
        """(first row, rows) of fused shard ``shard_id`` (None: the whole layer)."""
        if shard_id is None:
            return 0, self.output_size
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]

    def tp_slice(self, loaded, shard_id: int | None = None, output_dim: int | None = 0, input_dim: int | None = 1):
        """The part of checkpoint tensor ``loaded`` (torch.Tensor, or anything with ``narrow(dim, start,
        length)`` such as a packed GGUF tensor) that this rank keeps: rows ``column_slices[shard_id]``
        along ``output_dim`` (zero-padded past the end: the vocabulary's last shard), columns
        ``row_slice`` along ``input_dim``. Unchanged without tensor parallelism."""
        if self.column_slices is not None and output_dim is not None:
            start, rows = self.column_slices[shard_id or 0]
            loaded = narrow_padded(loaded, output_dim, start, rows)
        if self.row_slice is not None and input_dim is not None:
            needs_absmax = self.quant_method.uses_row_absmax and loaded.dim() == 2
            if needs_absmax and hasattr(loaded, "materialize"):  # a lazily read tensor: read this one whole
                loaded = loaded.materialize()
            if needs_absmax and isinstance(loaded, torch.Tensor):
                # per-output-channel scales of a quantize-at-load method span the whole row, not the
                # rank's columns: the same scales (and quantized values) as without tensor parallelism
                self.row_absmax = loaded.float().abs().amax(dim=input_dim).to(self.row_absmax_device)
            loaded = loaded.narrow(input_dim, *self.row_slice)
        return loaded.materialize() if hasattr(loaded, "materialize") else loaded

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """Copy checkpoint tensor ``loaded`` (this rank's ``tp_slice`` of it) into ``param``'s rows of
        shard ``shard_id`` along ``param.output_dim`` (the whole parameter when the dim is None).
        Raises ValueError naming the layer on a shape mismatch."""
        loaded = self.tp_slice(loaded, shard_id, getattr(param, "output_dim", None), getattr(param, "input_dim", None))
        dim = getattr(param, "output_dim", None)
        target = param.data
        if dim is not None:
            start, size = self.shard_offset(shard_id)
            target = target.narrow(dim, start, size)
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"{self.prefix or 'Linear'}: checkpoint tensor of shape {list(loaded.shape)} does not fit "
                             f"{'shard ' + str(shard_id) if shard_id is not None else 'parameter'} of shape "
                             f"{list(target.shape)}")
        target.copy_(loaded)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)
        self.row_absmax = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, input_size (this rank's)] → [T, output_size (this rank's; the full output for a
        row-parallel layer, summed over the ranks)], plus each row's LoRA delta (``self.lora``), added
        before the row-parallel all-reduce so that it sums the ranks' partial deltas too."""
        reduce = self.row_slice is not None and self.tp is not None and self.tp.is_parallel
        y = self.quant_method.apply(self, x, None if reduce else self.bias)
        if self.lora is not None:
            y = self.lora.apply(x, y)
        if not reduce:
            return y
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        tp = ""
        if self.column_slices is not None:
            tp = f", column-parallel {self.column_slices}"
        elif self.row_slice is not None:
            tp = f", row-parallel {self.row_slice}"
        return f"in={self.input_size}, out={self.output_sizes}, quant={self.quant_method.name}{tp}"


def narrow_padded(t, dim: int, start: int, length: int):
    """``t.narrow(dim, start, length)``, zero-padded when ``start + length`` runs past ``t``'s end."""
    have = t.shape[dim]
    if start + length <= have:
        return t.narrow(dim, start, length)
    part = t.narrow(dim, start, max(0, have - start))
    if hasattr(part, "pad"):
        return part.pad(dim, length)
    shape = list(part.shape)
    shape[dim] = length - part.shape[dim]
    return torch.cat([part, part.new_zeros(shape)], dim)
