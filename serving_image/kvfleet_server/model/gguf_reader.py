"""Read a GGUF model file: its header and metadata (a faster ``gguf.GGUFReader``), the ModelConfig, the
tensors (dequantized, or kept packed for ``--quantization gguf``; llama's Q/K row permutation reversed as
transformers' ``LlamaTensorProcessor`` does) and the mapping of GGUF tensor names onto kvfleet's.
``GGUFModelFile`` reads one file once for the engine, through the GGUF cache (gguf_cache.py)."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import UnsupportedFeatureError
from . import ModelConfig
from .checkpoint import ModelLoadError, layer_params, tensor_getter
from .layers.quant.gguf import PACKED_TYPES, GGUFTensor

GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


GGUF_DEQUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K", "Q8_K")


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
    get = tensor_getter(t, "GGUF file")
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
        out.update(layer_params(i, layer))
    return out
