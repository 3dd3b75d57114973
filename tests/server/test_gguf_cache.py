"""The GGUF cache (model/gguf_cache.py): a second start reads back exactly what the first start decoded
from the GGUF — config, architecture, float32 tensors and packed blocks — and the cache never stops a
start: a changed file misses, a damaged entry is parsed again, an unwritable folder is skipped."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    d = tmp_path / "gguf-cache"
    monkeypatch.setenv("KVFLEET_GGUF_CACHE", str(d))
    return d


@pytest.fixture()
def gguf_copy(gguf_path, tmp_path):
    p = tmp_path / "model.gguf"
    shutil.copyfile(gguf_path, p)
    return str(p)


def _same(a: dict, b: dict) -> None:
    from kvfleet_server.model.layers.quant.gguf import GGUFTensor

    assert sorted(a) == sorted(b)
    for name in a:
        x, y = a[name], b[name]
        assert type(x) is type(y), name
        if isinstance(x, GGUFTensor):
            assert (x.type_name, x.shape) == (y.type_name, y.shape), name
            assert x.raw.dtype == y.raw.dtype and np.array_equal(x.raw, y.raw), name
        else:
            assert x.dtype == y.dtype == torch.float32 and torch.equal(x, y), name


@pytest.mark.parametrize("packed", [False, True], ids=["dequantized", "packed"])
def test_second_read_comes_from_the_cache_and_equals_the_parse(cache, gguf_copy, packed):
    from kvfleet_server.model.gguf_reader import GGUFModelFile

    first = GGUFModelFile(gguf_copy, packed)
    assert not first.from_cache and first.reader is not None
    parsed = first.tensors()  # the miss saves the entry
    assert len(os.listdir(cache)) == 1
    second = GGUFModelFile(gguf_copy, packed)
    assert second.from_cache and second.reader is None  # the GGUF was not parsed
    assert (second.config, second.architecture) == (first.config, first.architecture) == (second.config, "llama")
    cached = second.tensors()
    _same(parsed, cached)
    if packed:
        assert any(type(t).__name__ == "GGUFTensor" for t in cached.values())
    with pytest.raises(RuntimeError, match="already handed over"):
        second.tensors()


@pytest.mark.parametrize("quantization", [None, "gguf"], ids=["float32", "packed"])
def test_models_from_the_cache_and_the_parse_hold_the_same_weights(cache, gguf_copy, quantization):
    from kvfleet_server.model.gguf_reader import GGUFModelFile
    from kvfleet_server.model.loader import load_model

    states = []
    for expect_cached in (False, True):
        g = GGUFModelFile(gguf_copy, packed=quantization == "gguf")
        assert g.from_cache is expect_cached
        model, _ = load_model(gguf_copy, torch.float32, "cpu", max_positions=64, gguf=g, quantization=quantization)
        states.append(model.state_dict())
    assert list(states[0]) == list(states[1])
    for name, t in states[0].items():
        assert torch.equal(t, states[1][name]), name


def test_a_changed_file_misses_and_replaces_its_old_entry(cache, gguf_copy):
    from kvfleet_server.model.gguf_reader import GGUFModelFile

    GGUFModelFile(gguf_copy).tensors()
    GGUFModelFile(gguf_copy, packed=True).tensors()
    assert len(os.listdir(cache)) == 2  # one entry per mode
    st = os.stat(gguf_copy)
    os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # "edited"
    g = GGUFModelFile(gguf_copy)
    assert not g.from_cache
    g.tensors()
    assert len(os.listdir(cache)) == 1  # both entries of the old file removed, the new one written
    assert GGUFModelFile(gguf_copy).from_cache
    assert not GGUFModelFile(gguf_copy, packed=True).from_cache


def test_a_file_replaced_while_it_is_read_is_not_cached_under_its_new_identity(cache, gguf_copy, tmp_path):
    from kvfleet_server.model.gguf_reader import GGUFModelFile

    other = tmp_path / "other.gguf"
    shutil.copyfile(gguf_copy, other)
    g = GGUFModelFile(gguf_copy)  # a miss: the file is mapped
    os.replace(other, gguf_copy)  # a model update lands during the start
    g.tensors()
    assert not GGUFModelFile(gguf_copy).from_cache


def test_a_file_rewritten_in_place_with_its_old_mtime_misses(cache, gguf_copy):
    from kvfleet_server.model.gguf_reader import GGUFModelFile

    GGUFModelFile(gguf_copy).tensors()
    st = os.stat(gguf_copy)
    with open(gguf_copy, "r+b") as f:  # same size, one byte of tensor data changed
        f.seek(st.st_size - 1)
        b = f.read(1)
        f.seek(st.st_size - 1)
        f.write(bytes([b[0] ^ 1]))
    os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns))  # cp -p / rsync -t / tar keep mtimes
    assert os.stat(gguf_copy).st_mtime_ns == st.st_mtime_ns
    assert not GGUFModelFile(gguf_copy).from_cache  # the ctime moved


def test_a_damaged_entry_is_parsed_again_and_rewritten(cache, gguf_copy, caplog):
    from kvfleet_server.model.gguf_reader import GGUFModelFile

    GGUFModelFile(gguf_copy).tensors()
    (entry,) = cache.iterdir()
    entry.write_bytes(entry.read_bytes()[: 1 << 20])  # cut short
    g = GGUFModelFile(gguf_copy)
    assert not g.from_cache and "unreadable" in caplog.text
    g.tensors()
    assert GGUFModelFile(gguf_copy).from_cache


def test_an_unwritable_cache_only_costs_the_parse(tmp_path, monkeypatch, gguf_copy):
    from kvfleet_server.model.gguf_reader import GGUFModelFile

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVFLEET_GGUF_CACHE", str(blocker / "cache"))
    g = GGUFModelFile(gguf_copy)
    assert g.tensors()["token_embd.weight"].dtype == torch.float32
    assert not GGUFModelFile(gguf_copy).from_cache


@pytest.mark.parametrize("off", ["off", "0", "false", "no"])
def test_cache_off(monkeypatch, gguf_copy, tmp_path, off):
    from kvfleet_server.model.gguf_reader import GGUFModelFile

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVFLEET_GGUF_CACHE", off)
    GGUFModelFile(gguf_copy).tensors()
    assert not GGUFModelFile(gguf_copy).from_cache
    assert not (tmp_path / off).exists()


def test_tensor_parallel_workers_do_not_write_entries(cache, gguf_copy):
    from kvfleet_server.model.gguf_reader import GGUFModelFile

    GGUFModelFile(gguf_copy, save=False).tensors()
    assert not cache.exists() or not os.listdir(cache)


def test_packed_file_for_a_float_load_is_refused(cache, gguf_copy):
    from kvfleet_server.model.gguf_reader import GGUFModelFile
    from kvfleet_server.model.loader import load_model

    with pytest.raises(ValueError, match="packed=True"):
        load_model(gguf_copy, torch.float32, "cpu", gguf=GGUFModelFile(gguf_copy, packed=True))
