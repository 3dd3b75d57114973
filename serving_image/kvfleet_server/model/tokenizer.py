"""Tokenizer wrapper over Hugging Face ``tokenizers`` (through transformers' fast tokenizer, which
also builds tokenizers from GGUF metadata) plus the model's jinja2 chat template."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile

from ..errors import InvalidRequestError

log = logging.getLogger(__name__)


def tokenizer_cache_dir() -> str:
    """Where tokenizers built from GGUF metadata are kept: ``$KVFLEET_TOKENIZER_CACHE`` if set, else
    ``$XDG_CACHE_HOME/kvfleet/tokenizers`` (``~/.cache/kvfleet/tokenizers``)."""
    from .compile import kvfleet_cache_dir

    return kvfleet_cache_dir("tokenizers", "KVFLEET_TOKENIZER_CACHE")


def _gguf_cache_entry(path: str, architecture: str | None) -> str:
    """The cache folder of one GGUF's tokenizer: keyed by the file (absolute path, device, inode, size,
    mtime and ctime: a file rewritten with its old mtime restored still misses), its
    architecture and the transformers version that converted it, so a changed file or library rebuilds."""
    import transformers

    st = os.stat(path)
    key = "\0".join([os.path.abspath(path), str(st.st_dev), str(st.st_ino), str(st.st_size), str(st.st_mtime_ns),
                     str(st.st_ctime_ns), str(architecture), transformers.__version__])
    return os.path.join(tokenizer_cache_dir(), hashlib.sha1(key.encode()).hexdigest()[:16])


def _save_entry(hf, entry: str) -> None:
    """Save ``hf`` as cache entry ``entry``: written in a temporary folder beside it, made readable by
    all (a cache shared between users), then renamed into place (atomic: a concurrent start sees a whole
    entry or none). An entry folder without tokenizer.json (a removal cut short) is replaced."""
    os.makedirs(os.path.dirname(entry), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(entry), prefix=".tmp-")
    try:
        hf.save_pretrained(tmp)
        os.chmod(tmp, 0o755)
        for _ in range(2):
            try:
                os.rename(tmp, entry)
                return
            except OSError:
                if os.path.isfile(os.path.join(entry, "tokenizer.json")):
                    return  # another process saved it first
                shutil.rmtree(entry, ignore_errors=True)
        raise OSError(f"could not rename {tmp} to {entry}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a rename; removed after a failure


def _load_gguf_tokenizer(path: str, architecture: str | None):
    """transformers' tokenizer for a GGUF, from the cache when a previous start saved it (tokenizer.json:
    ~0.3 s) else converted from the GGUF's tokenizer.ggml.* metadata (~2.5 s for SmolLM2's 49,152 tokens
    and merges) and saved for the next start. A cache that cannot be written (read-only file system)
    only costs the conversion each start."""
    folder, name = os.path.dirname(path) or ".", os.path.basename(path)
    if architecture == "llama":
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as cls
    else:
        from transformers import AutoTokenizer as cls
    entry = _gguf_cache_entry(path, architecture)
    if os.path.isfile(os.path.join(entry, "tokenizer.json")):
        try:
            return cls.from_pretrained(entry)
        except Exception as exc:  # a damaged entry: rebuild it
            log.warning("tokenizer cache entry %s unreadable (%s); converting the GGUF's again", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
    hf = cls.from_pretrained(folder, gguf_file=name)
    try:
        _save_entry(hf, entry)
    except Exception as exc:  # the cache is an optimisation: never a reason not to start
        log.info("tokenizer cache not written (%s): the GGUF's tokenizer is converted at each start", exc)
    return hf


class Tokenizer:
    """encode / decode / apply_chat_template for one model.

    Attributes:
        eos_token_id: id that ends generation (None if the tokenizer has none).
        vocab_size: number of token ids (including added tokens).
        hf: the underlying transformers tokenizer.
    """

    def __init__(self, hf_tokenizer, eos_token_ids: list[int] | None = None):
        self.hf = hf_tokenizer
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None) or getattr(hf_tokenizer, "_tokenizer", None)
        eos = hf_tokenizer.eos_token_id
        self.eos_token_id: int | None = eos if eos is not None else (eos_token_ids[0] if eos_token_ids else None)
        ids = set(eos_token_ids or [])
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self.vocab_size: int = len(hf_tokenizer)
        self.all_special_ids: frozenset[int] = frozenset(hf_tokenizer.all_special_ids)

    @classmethod
    def from_path(cls, path: str, eos_token_ids: list[int] | None = None,
                  gguf_architecture: str | None = None) -> "Tokenizer":
        """Load from an HF directory (tokenizer.json / tokenizer_config.json) or a .gguf file.

        ``gguf_architecture``: the GGUF's ``general.architecture`` when the caller has already read it.
        For "llama" the tokenizer is built by the class ``AutoTokenizer`` would pick (transformers'
        generic ``TokenizersBackend``, from the GGUF's tokenizer.ggml.* metadata) without
        ``AutoTokenizer``'s extra full parse of the GGUF to build a model config: same tokenizer,
        ~2 s less start-up on SmolLM2. Other architectures go through ``AutoTokenizer``. A GGUF's
        converted tokenizer is cached on disk (``tokenizer_cache_dir``): a restart loads it in ~0.3 s.
        """
        if path.endswith(".gguf") and os.path.isfile(path):
            hf = _load_gguf_tokenizer(path, gguf_architecture)
        elif os.path.isdir(path):
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(path)
        else:
            raise FileNotFoundError(f"expected a tokenizer directory or a .gguf file, got {path!r}")
        return cls(hf, eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """Text of one token on its own (for logprobs)."""
        return self.decode([token_id], skip_special_tokens=False)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs):
        """Render ``messages`` with the model's chat template (jinja2), or ``chat_template=`` when given.

        Raises InvalidRequestError (param "messages") when the model has no template or the template
        itself raises (e.g. a role it does not support), with the template's own message.
        """
        if not (kwargs.get("chat_template") or self.chat_template):
            raise InvalidRequestError("this model has no chat template; use the completions API", param="messages")
        try:
            return self.hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs
            )
        except InvalidRequestError:
            raise
        except Exception as e:  # jinja2.TemplateError and friends: the template's own message
            raise InvalidRequestError(f"chat template error: {e}", param="messages") from e
