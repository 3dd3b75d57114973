"""Pure, torch-free: which files of a model repository kvfleet-server needs (nothing else is fetched).

A Hugging Face repository or an S3 prefix often holds more than serving reads: Meta's Llama
repositories carry ``original/consolidated.*.pth`` (the same weights again, for Meta's own code),
others ``*.bin`` pickles, ONNX or GGUF exports beside the safetensors. The downloader
(``kvfleet_server.download``) and the operator's resolver both call ``select``:

- ``role="model"``: the top-level safetensors weights — the shards named by
  ``model.safetensors.index.json`` when it exists (so a stray ``consolidated.safetensors`` beside
  the shards is skipped, as vLLM does), else every top-level ``*.safetensors`` — plus the index,
  ``config.json``, ``generation_config.json`` and the tokenizer files;
- ``role="tokenizer"``: the tokenizer files only;
- ``role="adapter"``: a PEFT LoRA adapter's ``adapter_config.json`` and ``adapter_model.safetensors``;
- ``gguf_file``: that one ``.gguf`` file (it carries weights, config and tokenizer).

Tokenizer files: those transformers' tokenizers read (tokenizer.json, tokenizer_config.json,
tokenizer.model, special_tokens_map.json, added_tokens.json, vocab/merges files) and the chat
template files (chat_template.jinja, chat_template.json). Only top-level names count: nothing in
a subfolder is ever selected.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                   "chat_template.json")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
ROLES = ("model", "tokenizer", "adapter")


class NothingToServe(ValueError):
    """The listing holds none of the files serving needs (e.g. only ``*.bin`` or ``*.pth`` weights)."""


class FileMissing(NothingToServe):
    """The one file asked for (a .gguf path) is not in the listing."""


def small_files(names: Iterable[str], role: str = "model") -> list[str]:
    """The non-weight files of ``role`` present in ``names`` (config, tokenizer, index), sorted."""
    top = {n for n in names if "/" not in n}
    wanted = set(TOKENIZER_FILES) | (set(CONFIG_FILES) | {INDEX_FILE} if role == "model" else set())
    return sorted(top & wanted)


def select(names: Iterable[str], role: str = "model", gguf_file: str | None = None,
           index_weight_files: Iterable[str] | None = None) -> list[str]:
    """The files to fetch out of a repository listing ``names`` (paths relative to its root), sorted.

    ``index_weight_files``: the values of the index's ``weight_map`` when the index was read (the
    downloader reads it first); without it, every top-level ``*.safetensors`` counts. Raises
    ``NothingToServe`` (message names what the listing holds instead) when a model has no
    safetensors weights, a tokenizer no tokenizer file or an adapter lacks one of its two files; ``FileMissing`` when ``gguf_file`` is not in ``names``."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    names = sorted(set(names))
    if gguf_file is not None:
        if gguf_file not in names:
            ggufs = [n for n in names if n.endswith(".gguf")]
            raise FileMissing(f"no file {gguf_file!r} there; .gguf files present: "
                                 f"{', '.join(ggufs[:20]) if ggufs else 'none'}")
        return [gguf_file]
    if role == "adapter":
        missing = [f for f in ADAPTER_FILES if f not in names]
        if missing:
            raise NothingToServe(f"no {' or '.join(missing)} at the top level (a PEFT LoRA adapter)")
        return list(ADAPTER_FILES)
    small = small_files(names, role)
    if role == "tokenizer":
        if not small:
            raise NothingToServe("no tokenizer file (tokenizer.json, tokenizer.model, ...) at the top level")
        return small
    if index_weight_files is not None:
        weights = sorted(set(index_weight_files))
        missing = [w for w in weights if w not in names]
        if missing:
            raise NothingToServe(f"{INDEX_FILE} names shards that are not there: {', '.join(missing[:5])}")
    else:
        weights = [n for n in names if "/" not in n and n.endswith(".safetensors")]
    if not weights:
        others = sorted({n.rsplit(".", 1)[-1] for n in names if n.endswith((".bin", ".pth", ".pt", ".gguf"))})
        hint = f" (found .{', .'.join(others)} files: kvfleet-server loads safetensors, or one .gguf file " \
               f"named in the uri)" if others else ""
        raise NothingToServe(f"no safetensors weights at the top level{hint}")
    return sorted(set(small) | set(weights))


def s3_revision(etags: dict[str, str]) -> str:
    """The revision of the objects under an S3 prefix (name relative to it -> ETag): the first 40 hex
    digits of SHA-256 over their sorted ``name<TAB>ETag`` lines. Any object overwritten (new ETag),
    added or removed changes it; the operator pins it and the downloader insists on it."""
    text = "".join(f"{name}\t{etags[name].strip(chr(34))}\n" for name in sorted(etags))
    return hashlib.sha256(text.encode()).hexdigest()[:40]
