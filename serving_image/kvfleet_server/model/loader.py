"""Load a Llama-family model from a Hugging Face directory (config.json + safetensors, sharded or
not) or from a single GGUF file (metadata + tensors, kept packed or dequantized with the ``gguf`` package).

Weights end up equal to what transformers loads from the same files: for llama GGUFs the
Q/K row permutation applied by llama.cpp's converter is reversed (as transformers'
``LlamaTensorProcessor`` does; on packed tensors the rows, i.e. output channels, are permuted whole).

Loading goes through each parameter's ``weight_loader`` (fused q/k/v and gate/up arrive as shards),
then every ``Linear``'s quant method converts its weights (``process_weights_after_loading``).
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import torch

from ..errors import UnsupportedFeatureError
from . import MODEL_REGISTRY, ModelConfig
from .config import SUPPORTED_ARCHITECTURES
from .layers.linear import Linear
from .layers.quant import QuantConfig
from ..checkpoint_quantization import check_quantization_flag, checkpoint_quantization
from .layers.quant.gguf import PACKED_TYPES, GGUFTensor

logger = logging.getLogger(__name__)

GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
GGUF_DEQUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K", "Q8_K")


class ModelLoadError(ValueError):
    """A model file is missing or does not match what the architecture expects."""


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


# ---------------------------------------------------------------------------------------------
# HF directory
# ---------------------------------------------------------------------------------------------
def read_hf_config(model_dir: str) -> ModelConfig:
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"expected config.json in model directory {model_dir!r}")
    with open(cfg_path) as f:
        raw = json.load(f)
    quantization = checkpoint_quantization(raw, model_dir)
    cfg = ModelConfig.from_hf_dict(raw)
    cfg.checkpoint_quantization = quantization
    return cfg


class LazyTensor:
    """One safetensors tensor read on demand (tensor parallelism: each rank reads only its slices).

    ``shape`` without reading; ``narrow(dim, start, length)`` reads that slice only (a torch.Tensor);
    ``materialize()`` (or ``float()``) reads it whole.
    """

    def __init__(self, handle, name: str):
        self._handle, self.name = handle, name
        sl = handle.get_slice(name)
        self.shape = tuple(sl.get_shape())
        self.dtype_name = sl.get_dtype()  # safetensors' name: "F32", "BF16", "F8_E4M3", …

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._handle.get_slice(self.name)[tuple(index)]

    def materialize(self) -> torch.Tensor:
        return self._handle.get_tensor(self.name)

    def float(self) -> torch.Tensor:
        return self.materialize().float()


def materialize(t):
    """A torch.Tensor for ``t`` (a LazyTensor is read whole; anything else is returned as is)."""
    return t.materialize() if isinstance(t, LazyTensor) else t


def read_hf_tensors(model_dir: str, lazy: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards listed by model.safetensors.index.json
    (``lazy``: as ``LazyTensor``s over the open files, read slice by slice while loading)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(
            f"expected model.safetensors or model.safetensors.index.json in {model_dir!r} (no *.safetensors found)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            raise ModelLoadError(f"expected weight shard {name!r} listed in the index at {path!r}")
        if lazy:
            handle = safe_open(path, framework="pt")
            tensors.update({k: LazyTensor(handle, k) for k in handle.keys()})
        else:
            tensors.update(load_file(path))
    return tensors


def hf_kv_cache_scales(cfg: ModelConfig, t: dict[str, torch.Tensor]) -> dict[int, tuple[float, float]]:
    """Per-layer FP8 KV-cache scales of a checkpoint (``self_attn.k_scale`` / ``v_scale``, vLLM's and
    llm-compressor's names): {layer: (k_scale, v_scale)}; empty when the checkpoint has none."""
    out = {}
    for i in range(cfg.num_hidden_layers):
        a = f"model.layers.{i}.self_attn."
        k, v = t.get(a + "k_scale"), t.get(a + "v_scale")
        if k is not None and v is not None:
            out[i] = (float(k.float().max()), float(v.float().max()))
    return out


def hf_to_kvfleet(cfg: ModelConfig, t: dict[str, torch.Tensor]) -> dict[str, list]:
    """Map HF parameter names to kvfleet's: {name: [tensor]} or, for fused layers, the list of shards."""
    get = _getter(t, "HF checkpoint")
    out = {"embed_tokens.weight": [get("model.embed_tokens.weight")], "norm.weight": [get("model.norm.weight")]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = [t.get("lm_head.weight", out["embed_tokens.weight"][0])]
    for i in range(cfg.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        layer = {
            "q": get(a + "q_proj.weight"), "k": get(a + "k_proj.weight"), "v": get(a + "v_proj.weight"),
            "o": get(a + "o_proj.weight"), "gate": get(p + "mlp.gate_proj.weight"),
            "up": get(p + "mlp.up_proj.weight"), "down": get(p + "mlp.down_proj.weight"),
            "in_norm": get(p + "input_layernorm.weight"), "post_norm": get(p + "post_attention_layernorm.weight"),
        }
        if cfg.attention_bias:
            layer.update(qb=get(a + "q_proj.bias"), kb=get(a + "k_proj.bias"), vb=get(a + "v_proj.bias"))
        out.update(_layer_params(i, layer))
        if cfg.checkpoint_quantization == "fp8":  # each projection's weight_scale, in the fused order
            for fused, names in FUSED_HF_PROJECTIONS.items():
                out[f"layers.{i}.{fused}.weight_scale"] = [get(p + n + ".weight_scale") for n in names]
    _check_fp8_dtypes(cfg, out)
    return out


def _dtype_name(t) -> str:
    """safetensors' dtype name of a checkpoint tensor ("F8_E4M3", "F32", …)."""
    if isinstance(t, LazyTensor):
        return t.dtype_name
    return {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}.get(t.dtype, str(t.dtype))


def _check_fp8_dtypes(cfg: ModelConfig, params: dict[str, list]) -> None:
    """An FP8 checkpoint's projection weights must be float8_e4m3fn, and no other tensor may be float8
    (a float8 lm_head or embedding has no scale here). Raises ModelLoadError naming the tensor."""
    fp8 = cfg.checkpoint_quantization == "fp8"
    for name, shards in params.items():
        want = fp8 and name.startswith("layers.") and name.endswith("_proj.weight")
        for t in shards:
            got = _dtype_name(t)
            if want and got != "F8_E4M3":
                raise ModelLoadError(f"tensor {name} of an FP8 checkpoint has dtype {got}, expected float8_e4m3fn "
                                     "(F8_E4M3)")
            if not want and got.startswith("F8"):
                raise ModelLoadError(f"tensor {name} has dtype {got}: float8 is supported only for the decoder "
                                     "projections of an FP8 checkpoint (with their weight_scale)")


#: kvfleet's fused projections and the HF tensors they hold, in row order
FUSED_HF_PROJECTIONS = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                        "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                        "down_proj": ("mlp.down_proj",)}


# ---------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------
class _ArrayGGUFReader:
    """Factory for a ``gguf.GGUFReader`` whose metadata parse reads a plain ndarray view of the mapping.

    ``GGUFReader`` slices its ``np.memmap`` once per value (≈700k slices for a 49k-token vocabulary);
    each memmap slice pays ``memmap.__array_finalize__``, which made one parse of SmolLM2's GGUF
    take ~1.5 s. Slicing an ``np.asarray`` view of the same mapping gives identical values (zero
    copy, still backed by the file) in ~0.5 s. Tensor ``data`` fields are plain ndarrays over the map.
    """

    _cls = None

    @classmethod
    def open(cls, path: str):
        if cls._cls is None:
            from gguf import GGUFReader

            class Reader(GGUFReader):
                _plain = None
                _plain_of = None

                def _get(self, offset, dtype, count=1, override_order=None):
                    if self._plain_of is not self.data:
                        self._plain, self._plain_of = np.asarray(self.data), self.data
                    count = int(count)
                    end = offset + np.dtype(dtype).itemsize * count
                    arr = self._plain[offset:end].view(dtype=dtype)[:count]
                    return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

            cls._cls = Reader
        return cls._cls(path)


def open_gguf(path: str):
    """Parse a GGUF file's header, metadata and tensor table once (tensor data stays memory-mapped).

    Returns a ``gguf.GGUFReader``; share it between ``read_gguf_config`` and ``read_gguf_tensors``.
    Raises ModelLoadError when the file is not a readable GGUF.
    """
    try:
        return _ArrayGGUFReader.open(path)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path!r}: {e}") from e


class GGUFModelFile:
    """One GGUF model file, read once for the engine's config, tokenizer architecture and weights.

    Its ModelConfig, GGUF architecture and tensors come from the GGUF cache (``gguf_cache.py``) when an
    earlier start saved them, else from one parse (``open_gguf``), whose decoded tensors are then
    saved for the next start (with ``save``; tensor-parallel workers other than rank 0 do not save).

    Args:
        path: the .gguf file.
        packed: keep Q4_0/Q4_1/Q8_0 matrices packed (``--quantization gguf``) instead of dequantizing.
        save: write a cache entry after a parse.
    Raises ModelLoadError (not a readable GGUF) or UnsupportedFeatureError (architecture, rope scaling).
    """

    def __init__(self, path: str, packed: bool = False, save: bool = True):
        from . import gguf_cache

        self.path, self.packed, self._save = path, packed, save
        self._source = gguf_cache.Source.of(path, packed)  # the file's identity before it is read
        self.reader = None
        self._tensors = None
        hit = gguf_cache.load(self._source)
        if hit is not None:
            self.config, self.architecture, self._tensors = hit
            self.from_cache = True
        else:
            self.reader = open_gguf(path)
            self.config = read_gguf_config(self.reader)
            self.architecture = _field(self.reader, "general.architecture")
            self.from_cache = False

    def tensors(self) -> dict[str, torch.Tensor | GGUFTensor]:
        """``read_gguf_tensors``' result (float32 tensors; ``GGUFTensor`` blocks when ``packed``). Hands
        them over once: the object keeps no reference, so the copy into the model is the only one left."""
        from . import gguf_cache

        if self._tensors is not None:
            t, self._tensors = self._tensors, None
            return t
        if self.reader is None:
            raise RuntimeError(f"the tensors of {self.path} were already handed over")
        t = read_gguf_tensors(self.reader, self.config, packed=self.packed)
        if self._save:
            gguf_cache.save(self._source, self.config, self.architecture, t)
        return t

    def close(self) -> None:
        """Drop the file mapping and any tensors not handed over."""
        self.reader = self._tensors = None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def read_gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise UnsupportedFeatureError(
            f"not supported yet: GGUF architecture {arch!r}; expected one of {list(GGUF_ARCHS)}"
        )
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = g("vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = None
    stype = g("rope.scaling.type")
    if stype == "linear":
        scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    elif stype not in (None, "none"):
        raise UnsupportedFeatureError(f"not supported yet: GGUF rope scaling type {stype!r}")
    if "rope_freqs.weight" in names:
        rf = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        scaling = {"rope_type": "freq_factors", "factors": np.asarray(rf.data, dtype=np.float32).tolist()}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=GGUF_ARCHS[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_hidden_layers=int(g("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("rope.dimension_count", hidden // heads)) if arch == "llama" else hidden // heads,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(g("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        eos_token_ids=[] if eos is None else [int(eos)],
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
    )


def _reverse_llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf Q/K permutation (rows grouped per head, halves interleaved)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_gguf_tensors(reader, cfg: ModelConfig, packed: bool = False) -> dict[str, torch.Tensor | GGUFTensor]:
    """Tensors of a GGUF file: float32 (dequantized), or with ``packed`` a ``GGUFTensor`` in its file
    encoding for the types the gguf quant method keeps packed (Q4_0, Q4_1, Q8_0)."""
    from gguf import dequantize

    out = {}
    llama = cfg.architecture == "LlamaForCausalLM"
    for t in reader.tensors:
        if t.tensor_type.name not in GGUF_DEQUANT_TYPES:
            raise UnsupportedFeatureError(
                f"not supported yet: GGUF tensor type {t.tensor_type.name} for {t.name}; "
                f"expected one of {list(GGUF_DEQUANT_TYPES)}"
            )
        if packed and t.tensor_type.name in PACKED_TYPES and t.data.ndim == 2:
            raw = t.data
            if llama and ".attn_q." in t.name:
                raw = _reverse_llama_permute(raw, cfg.num_attention_heads)
            elif llama and ".attn_k." in t.name:
                raw = _reverse_llama_permute(raw, cfg.num_key_value_heads)
            out[t.name] = GGUFTensor(t.tensor_type.name, raw, (int(t.shape[1]), int(t.shape[0])))
            continue
        w = dequantize(t.data, t.tensor_type)
        if llama and ".attn_q." in t.name:
            w = _reverse_llama_permute(w, cfg.num_attention_heads)
        elif llama and ".attn_k." in t.name:
            w = _reverse_llama_permute(w, cfg.num_key_value_heads)
        if w.dtype != np.float32 or not w.flags.writeable or not w.flags.c_contiguous:
            w = np.array(w, dtype=np.float32)  # F32/F16 tensors come back as views of the read-only map
        out[t.name] = torch.from_numpy(w)
    return out


def gguf_to_kvfleet(cfg: ModelConfig, t: dict) -> dict[str, list]:
    get = _getter(t, "GGUF file")
    out = {"embed_tokens.weight": [get("token_embd.weight")], "norm.weight": [get("output_norm.weight")]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = [get("output.weight")]
    for i in range(cfg.num_hidden_layers):
        b = f"blk.{i}."
        layer = {
            "q": get(b + "attn_q.weight"), "k": get(b + "attn_k.weight"), "v": get(b + "attn_v.weight"),
            "o": get(b + "attn_output.weight"), "gate": get(b + "ffn_gate.weight"), "up": get(b + "ffn_up.weight"),
            "down": get(b + "ffn_down.weight"), "in_norm": get(b + "attn_norm.weight"),
            "post_norm": get(b + "ffn_norm.weight"),
        }
        if cfg.attention_bias:
            layer.update(qb=get(b + "attn_q.bias"), kb=get(b + "attn_k.bias"), vb=get(b + "attn_v.bias"))
        out.update(_layer_params(i, layer))
    return out


# ---------------------------------------------------------------------------------------------
# common
# ---------------------------------------------------------------------------------------------
def _getter(t: dict[str, torch.Tensor], where: str):
    def get(name: str) -> torch.Tensor:
        if name not in t:
            raise ModelLoadError(f"expected tensor {name!r} in the {where}; it is missing")
        return t[name]

    return get


def _layer_params(i: int, p: dict) -> dict[str, list]:
    """kvfleet names of one decoder layer → its checkpoint tensors (fused layers: one per shard)."""
    pre = f"layers.{i}."
    out = {
        pre + "qkv_proj.weight": [p["q"], p["k"], p["v"]],
        pre + "o_proj.weight": [p["o"]],
        pre + "gate_up_proj.weight": [p["gate"], p["up"]],
        pre + "down_proj.weight": [p["down"]],
        pre + "input_layernorm.weight": [p["in_norm"]],
        pre + "post_attention_layernorm.weight": [p["post_norm"]],
    }
    if "qb" in p:
        out[pre + "qkv_proj.bias"] = [p["qb"], p["kb"], p["vb"]]
    return out


def _shape(shards: list) -> tuple[int, ...]:
    """Shape of the concatenation of shards along the output rows."""
    shapes = [tuple(s.shape) for s in shards]
    if len(shapes) == 1:
        return shapes[0]
    return (sum(s[0] for s in shapes), *shapes[0][1:]) if len({s[1:] for s in shapes}) == 1 else tuple(shapes)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """kvfleet parameter name → the shape the architecture gives it ([out, in] for weights; fused layers
    whole), every parameter of an unquantized model: embedding, lm_head (untied), norms, projections, biases."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    expected = {"embed_tokens.weight": (cfg.vocab_size, d), "norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        expected["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}."
        expected.update({
            pre + "qkv_proj.weight": (q + 2 * kv, d), pre + "o_proj.weight": (d, q),
            pre + "gate_up_proj.weight": (2 * cfg.intermediate_size, d),
            pre + "down_proj.weight": (d, cfg.intermediate_size),
            pre + "input_layernorm.weight": (d,), pre + "post_attention_layernorm.weight": (d,),
        })
        if cfg.attention_bias:
            expected[pre + "qkv_proj.bias"] = (q + 2 * kv,)
    return expected


def _check_shapes(cfg: ModelConfig, params: dict[str, list]) -> None:
    """Compare each source tensor with what the architecture expects (``expected_shapes``)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    for name, shape in expected_shapes(cfg).items():
        got = _shape(params[name])
        if got != shape:
            raise ModelLoadError(
                f"tensor {name} has shape {list(got)}, expected {list(shape)} for {cfg.architecture} "
                f"(hidden_size={d}, heads={cfg.num_attention_heads}, kv_heads={cfg.num_key_value_heads}, "
                f"head_dim={hd}, intermediate_size={cfg.intermediate_size}, vocab_size={cfg.vocab_size})"
            )


def load_model_config(path: str, gguf: GGUFModelFile | None = None) -> ModelConfig:
    """Read only the architecture config of a model directory or GGUF file.

    ``gguf``: the already read GGUF file (``GGUFModelFile(path)``) to reuse instead of reading ``path`` again.
    """
    if is_gguf(path):  # without ``gguf``: the header only (no tensor is read, nor the GGUF cache's entry)
        return gguf.config if gguf is not None else read_gguf_config(open_gguf(path))
    if os.path.isdir(path):
        return read_hf_config(path)
    raise ModelLoadError(f"expected a model directory with config.json or a .gguf file, got {path!r}")


def load_model(path: str, dtype: torch.dtype, device: str, max_positions: int | None = None,
               gguf: GGUFModelFile | None = None, quantization: str | None = None, tp=None):
    """Load weights into kvfleet's model.

    ``tp``: a ``TPGroup`` (rank r of N): the model is built with rank r's shard and every ``Linear``'s
    weight_loader keeps only that rank's slice of each checkpoint tensor (the group need not be
    connected yet).

    ``gguf``: the already read GGUF file (``GGUFModelFile(path, packed=quantization == "gguf")``) to reuse
    instead of reading ``path`` again; its tensors are handed over to the model.
    ``quantization``: None (model dtype), "fp8" | "int8" | "int4" (quantized at load from the float
    weights; a GGUF file is dequantized first), or "gguf" (a .gguf file's Q4_0/Q4_1/Q8_0 tensors kept packed).

    Returns (model in eval mode on ``device`` with ``dtype`` activations, ModelConfig); the model's
    ``kv_cache_scales`` holds the checkpoint's FP8 KV-cache scales per layer ({} when none).
    Raises ModelLoadError (missing file or tensor, wrong shape) or UnsupportedFeatureError
    (unknown architecture, tensor type or rope scaling, an already-quantized checkpoint format,
    gguf quantization of a non-GGUF model).
    """
    kv_scales: dict[int, tuple[float, float]] = {}
    if is_gguf(path):
        packed = quantization == "gguf"
        gguf = gguf if gguf is not None else GGUFModelFile(path, packed)
        if gguf.packed != packed:
            raise ValueError(f"GGUFModelFile(packed={gguf.packed}) given for quantization={quantization!r}")
        cfg = gguf.config
        params = gguf_to_kvfleet(cfg, gguf.tensors())
    elif os.path.isdir(path):
        if quantization == "gguf":
            raise UnsupportedFeatureError(
                f"not supported: quantization='gguf' needs a .gguf model file, got the directory {path!r}")
        cfg = read_hf_config(path)
        # tensor parallelism: a rank reads its slices only, not N copies of the checkpoint in host memory
        tensors = read_hf_tensors(path, lazy=tp is not None and tp.is_parallel)
        kv_scales = hf_kv_cache_scales(cfg, tensors)
        params = hf_to_kvfleet(cfg, tensors)
        del tensors
    else:
        raise ModelLoadError(f"expected a model directory with config.json or a .gguf file, got {path!r}")
    if cfg.architecture not in MODEL_REGISTRY:
        raise UnsupportedFeatureError(
            f"not supported yet: architecture {cfg.architecture}; expected one of {list(SUPPORTED_ARCHITECTURES)}"
        )
    _check_shapes(cfg, params)
    check_quantization_flag(quantization, cfg.checkpoint_quantization, path)
    serialized = cfg.checkpoint_quantization is not None
    method = cfg.checkpoint_quantization if serialized else quantization
    model = _build(cfg, dtype, device, QuantConfig(method, dtype, serialized), tp)
    _load_weights(model, params)
    del params
    for m in model.modules():
        if isinstance(m, Linear):
            m.process_weights_after_loading()
    model.init_rope(max_positions or cfg.max_position_embeddings, device)
    model.kv_cache_scales = kv_scales
    model.eval()
    return model, cfg


def _build(cfg: ModelConfig, dtype: torch.dtype, device: str, qc: QuantConfig, tp=None) -> torch.nn.Module:
    """The model with uninitialized parameters in ``dtype`` on ``device`` (no init kernels run)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = MODEL_REGISTRY[cfg.architecture](cfg, max_positions=1, quant_config=qc, tp=tp)
    finally:
        torch.set_default_dtype(old)
    return model


def _load_weights(model: torch.nn.Module, params: dict[str, list]) -> None:
    """Copy each checkpoint tensor into its parameter through the parameter's ``weight_loader``
    (shard i of a fused layer into its rows). Every parameter must be covered."""
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(params))
    if missing:
        raise ModelLoadError(f"expected checkpoint tensors for {missing[:5]}; they are missing")
    with torch.no_grad():
        for name, shards in params.items():
            param = own[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.copy_(materialize(shards[0]))
            elif len(shards) == 1:
                loader(param, shards[0])
            else:
                for i, shard in enumerate(shards):
                    loader(param, shard, i)

