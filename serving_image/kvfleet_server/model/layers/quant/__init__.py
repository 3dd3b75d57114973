"""Weight quantization methods and the per-model choice of which layer gets which.

``QuantConfig(method, act_dtype)`` hands each layer of the model its ``QuantMethod``:
- None: every Linear unquantized (model dtype).
- "fp8" / "int8" / "int4": every decoder Linear quantized at load from float weights; the
  embedding and lm_head stay in the model dtype (as vLLM does for fp8).
- "gguf": every Linear, the lm_head and the embedding keep their GGUF encoding (``gguf.py``).

Checkpoints already quantized: FP8 ones are loaded as they are stored (``QuantConfig(..., serialized=True)``),
other formats are refused by name (``kvfleet_server.checkpoint_quantization``).
"""

from __future__ import annotations

import torch

from ....config import QUANTIZATION_CHOICES as QUANTIZATION_METHODS
from ....errors import UnsupportedFeatureError
from ..linear import QuantMethod, UnquantizedLinearMethod
from .fp8 import cuda_supports_scaled_mm


class QuantConfig:
    """Which QuantMethod each layer of a model gets.

    Args:
        method: None or one of QUANTIZATION_METHODS.
        act_dtype: the model (activation) dtype.
        serialized: the checkpoint already stores the decoder Linears in ``method``'s format (an FP8
            checkpoint: ``kvfleet_server.checkpoint_quantization``), loaded as they are instead of quantized.
    """

    def __init__(self, method: str | None, act_dtype: torch.dtype, serialized: bool = False):
        if method is not None and method not in QUANTIZATION_METHODS:
            raise UnsupportedFeatureError(
                f"not supported: quantization={method!r}; expected one of {list(QUANTIZATION_METHODS)}")
        if serialized and method != "fp8":
            raise UnsupportedFeatureError(f"not supported: a serialized {method!r} checkpoint (only fp8)")
        self.method = method
        self.act_dtype = act_dtype
        self.serialized = serialized

    def linear_method(self) -> QuantMethod:
        """Method of a decoder projection (qkv_proj, o_proj, gate_up_proj, down_proj)."""
        if self.method == "fp8":
            from .fp8 import Fp8LinearMethod
            return Fp8LinearMethod(self.act_dtype, serialized=self.serialized)
        if self.method == "int8":
            from .int8 import Int8LinearMethod
            return Int8LinearMethod(self.act_dtype)
        if self.method == "int4":
            from .int4 import Int4LinearMethod
            return Int4LinearMethod(self.act_dtype)
        if self.method == "gguf":
            from .gguf import GGUFLinearMethod
            return GGUFLinearMethod(self.act_dtype)
        return UnquantizedLinearMethod()

    def lm_head_method(self) -> QuantMethod:
        return self.linear_method() if self.method == "gguf" else UnquantizedLinearMethod()

    def embedding_method(self) -> QuantMethod:
        if self.method == "gguf":
            from .gguf import GGUFLinearMethod
            return GGUFLinearMethod(self.act_dtype, for_embedding=True)
        return UnquantizedLinearMethod()


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's weights as stored: every parameter and persistent or packed buffer
    (quantized weights, scales, zero points, oneDNN-prepacked weights), excluding the rope cos/sin tables."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        key = id(t) if t.is_mkldnn else t.data_ptr()  # an opaque oneDNN tensor has no data pointer
        if name.startswith("rope_") or key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def quantization_note(method: str | None, device: str) -> str:
    """What the method's kernels do on ``device`` (for the start-up log line)."""
    if method == "fp8":
        if cuda_supports_scaled_mm(torch.device(device)):
            return "; fp8 W8A8 through torch._scaled_mm (dynamic per-token activation scales)"
        return ("; fp8 weight-only (FP8 storage, upcast per matmul): torch._scaled_mm needs CUDA compute "
                "capability >= 8.9")
    if method in ("int8", "int4", "gguf") and device == "cpu":
        return "; CPU weight-only kernels (vectorized for bfloat16 activations)"
    if method in ("int8", "int4", "gguf"):
        return "; weight-only, dequantized per matmul on this device"
    return ""
