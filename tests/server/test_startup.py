"""Cold-start shortcuts give the same model, config and tokenizer as the plain paths:
kvfleet's single GGUF parse (``open_gguf``) equals ``gguf.GGUFReader``, the GGUF tokenizer built
without AutoTokenizer's config parse equals transformers' AutoTokenizer one, and the engine reports
its start-up phases."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

STRINGS = [
    "Hello world",
    "héllo 🤖🎉 naïve café — 世界 你好 こんにちは",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces\t\ttabs\n\n\nnewlines  ",
    "<|endoftext|>after eos",
    "def f(x):\n    return x ** 2  # 😀",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say 你好 and 🤖"},
    {"role": "assistant", "content": "你好 🤖"},
    {"role": "user", "content": "again"},
]


@pytest.fixture(scope="module")
def readers(gguf_path):
    from gguf import GGUFReader

    from kvfleet_server.model.gguf_reader import open_gguf

    return GGUFReader(gguf_path), open_gguf(gguf_path)


def test_single_parse_reader_equals_gguf_reader(readers):
    ref, fast = readers
    assert list(fast.fields) == list(ref.fields)
    for name, f in ref.fields.items():
        g = fast.fields[name]
        assert (g.offset, g.types, g.data) == (f.offset, f.types, f.data), name
        assert all(np.array_equal(a, b) for a, b in zip(g.parts, f.parts)), name
    assert [t.name for t in fast.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(fast.tensors, ref.tensors):
        assert (a.tensor_type, a.data_offset, list(a.shape)) == (b.tensor_type, b.data_offset, list(b.shape))
        assert np.array_equal(a.data, b.data), a.name


def test_config_from_the_gguf_model_file_equals_a_fresh_parse(gguf_path, readers):
    from kvfleet_server.model.gguf_reader import GGUFModelFile, read_gguf_config
    from kvfleet_server.model.loader import load_model_config

    assert load_model_config(gguf_path, GGUFModelFile(gguf_path)) == read_gguf_config(readers[0])
    assert load_model_config(gguf_path) == read_gguf_config(readers[0])


def test_gguf_tensors_are_writable_float32_copies(readers):
    from kvfleet_server.model.gguf_reader import read_gguf_config, read_gguf_tensors

    reader = readers[1]
    tensors = read_gguf_tensors(reader, read_gguf_config(reader))
    f32 = [t for t in reader.tensors if t.tensor_type.name == "F32"]
    assert f32, "the bundled GGUF has F32 norm weights"
    for t in f32:
        w = tensors[t.name]
        assert w.dtype == torch.float32
        w.add_(0)  # writable: not a view of the read-only file mapping
        assert np.array_equal(w.numpy(), np.asarray(t.data, dtype=np.float32).reshape(w.shape))


@pytest.fixture(scope="module", params=["converted", "from the cache"])
def tokenizers(gguf_path, request, tmp_path_factory):
    """transformers' AutoTokenizer, and kvfleet's: converted from the GGUF (which saves it), or loaded back
    from the tokenizer cache by a second start."""
    from transformers import AutoTokenizer

    from kvfleet_server.model.tokenizer import Tokenizer

    ref = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    cache = tmp_path_factory.mktemp("tokenizers")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFLEET_TOKENIZER_CACHE", str(cache))
        tok = Tokenizer.from_path(gguf_path, gguf_architecture="llama")
        assert len(os.listdir(cache)) == 1 and os.path.isfile(cache / os.listdir(cache)[0] / "tokenizer.json")
        if request.param == "from the cache":
            tok = Tokenizer.from_path(gguf_path, gguf_architecture="llama")
            assert len(os.listdir(cache)) == 1
    return ref, tok


def test_tokenizer_cache_key_follows_the_file_and_an_unwritable_cache_only_costs_time(gguf_path, tmp_path,
                                                                                     monkeypatch):
    from kvfleet_server.model import tokenizer as tk

    monkeypatch.setenv("KVFLEET_TOKENIZER_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"  # the key reads only the file's metadata
    f.write_bytes(b"GGUF")
    a = tk._gguf_cache_entry(str(f), "llama")
    assert tk._gguf_cache_entry(gguf_path, "llama") != a  # another file
    assert tk._gguf_cache_entry(str(f), "qwen2") != a
    st = os.stat(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert tk._gguf_cache_entry(str(f), "llama") != a  # the file changed
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("KVFLEET_TOKENIZER_CACHE", str(blocker / "cache"))
    tok = tk.Tokenizer.from_path(gguf_path, gguf_architecture="llama")
    assert tok.encode("Hello world") and tok.vocab_size == 49152


def test_tokenizer_cache_failures_never_stop_a_start_and_leave_nothing_behind(gguf_path, tmp_path, monkeypatch):
    """A save that fails midway (any exception) still returns the tokenizer and leaves no temporary
    folder; an entry folder without tokenizer.json (a removal cut short) is replaced by a whole one."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    from kvfleet_server.model import tokenizer as tk

    cache = tmp_path / "cache"
    monkeypatch.setenv("KVFLEET_TOKENIZER_CACHE", str(cache))

    def broken(self, *a, **k):
        (__import__("pathlib").Path(a[0]) / "half-written").write_text("")
        raise TypeError("not JSON serializable")

    with monkeypatch.context() as m:
        m.setattr(TokenizersBackend, "save_pretrained", broken)
        tok = tk.Tokenizer.from_path(gguf_path, gguf_architecture="llama")
    assert tok.vocab_size == 49152 and os.listdir(cache) == []
    entry = tk._gguf_cache_entry(gguf_path, "llama")
    os.makedirs(os.path.join(entry, "stray"))
    tk.Tokenizer.from_path(gguf_path, gguf_architecture="llama")
    assert os.listdir(cache) == [os.path.basename(entry)] and os.path.isfile(os.path.join(entry, "tokenizer.json"))
    assert os.stat(entry).st_mode & 0o777 == 0o755


@pytest.mark.parametrize("text", STRINGS)
def test_fast_gguf_tokenizer_ids_equal_autotokenizer(tokenizers, text):
    ref, tok = tokenizers
    assert tok.encode(text) == ref.encode(text)
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    ids = ref.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_fast_gguf_tokenizer_chat_template_and_specials_equal_autotokenizer(tokenizers):
    ref, tok = tokenizers
    for gen in (True, False):
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=gen) == ref.apply_chat_template(
            MESSAGES, add_generation_prompt=gen, tokenize=False)
    assert tok.chat_template == ref.chat_template
    assert tok.vocab_size == len(ref)
    assert tok.eos_token_id == ref.eos_token_id
    assert tok.all_special_ids == frozenset(ref.all_special_ids)


def test_engine_reports_startup_phases(gguf_path):
    from kvfleet_server.config import EngineConfig
    from kvfleet_server.engine.llm_engine import LLMEngine

    llm = LLMEngine(EngineConfig(model=gguf_path, kv_cache_memory_bytes=16 * 2**20, max_model_len=256))
    timings = llm.startup_timings
    phases = [k for k in timings if k != "tokenizer (in a thread)"]
    assert phases[0] in ("gguf parse", "gguf cache read")  # the suite's GGUF cache may hold the file already
    assert phases[1:5] == ["config", "weights", "tokenizer wait", "kv_cache allocation"]
    assert timings["tokenizer (in a thread)"] > 0
    assert all(isinstance(v, float) and v >= 0 for v in timings.values())
    assert llm.tokenizer.encode("Hello") == llm.tokenizer.hf.encode("Hello")


def test_engine_on_hf_directory_has_no_gguf_phase(tiny_llama_dir):
    from kvfleet_server.config import EngineConfig
    from kvfleet_server.engine.llm_engine import LLMEngine

    llm = LLMEngine(EngineConfig(model=tiny_llama_dir, kv_cache_memory_bytes=2**20, max_model_len=64))
    assert not {"gguf parse", "gguf cache read"} & set(llm.startup_timings)
    assert {"config", "weights", "tokenizer wait", "kv_cache allocation"} <= set(llm.startup_timings)


def test_open_gguf_refuses_a_non_gguf_file_naming_it(tmp_path):
    from kvfleet_server.model.checkpoint import ModelLoadError
    from kvfleet_server.model.gguf_reader import open_gguf

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"NOTGGUF" + bytes(64))
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        open_gguf(str(bad))
