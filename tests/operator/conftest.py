"""Fixtures for operator tests: a KMock API-server emulator on 127.0.0.1 and a kubeconfig for it.

``emulator``   ApiServerEmulator serving on loopback, resources registered (kmock_support).
``kubeconfig`` KUBECONFIG pointing at it (the operator's login handler and ``kube.login`` read it).
``api``        a kvfleet_operator.kube.KubeClient talking to it (what tests use to act as kubectl), with a
               token of its own so that ``emulator.writes`` tells its writes from the operator's.
``fake_hub``   (session, autouse) a Hugging Face Hub on 127.0.0.1 (model_stores.FakeHub) holding the
               repositories the samples and tests name, with ``HF_ENDPOINT`` pointing at it: the reconcile
               pins hf:// revisions through it, as it would through huggingface.co.
``features_landed`` renders as if every feature of ``kvfleet_server.unsupported.ENGINE_REFUSALS`` had landed
               (the list emptied), to test how those fields are rendered; that render refuses them today is
               tests/operator/test_render_refusals.py's subject.
"""
from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator

import kmock
import kopf
import pytest

from kvfleet_operator import kube

from kmock_support import ApiServerEmulator, register_resources, write_kubeconfig
from model_stores import FakeHub, serve_app

#: repositories the samples and the operator tests name (tiny stand-ins: a config, a tokenizer, one shard, a GGUF)
HUB_REPOS = ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.3-70B-Instruct",
             "Qwen/Qwen2-0.5B", "a/b", "org/m")


@pytest.fixture(scope="session", autouse=True)
def fake_hub():
    import os

    hub = FakeHub()
    for repo in HUB_REPOS:
        hub.commit(repo, {"config.json": b"{}", "tokenizer.json": b"{}", "model.safetensors": b"\0" * 64,
                          "model-Q4_0.gguf": b"GGUF"})
    with serve_app(hub.app) as url:
        old = os.environ.get("HF_ENDPOINT")
        os.environ["HF_ENDPOINT"] = url
        try:
            yield hub
        finally:
            if old is None:
                os.environ.pop("HF_ENDPOINT", None)
            else:
                os.environ["HF_ENDPOINT"] = old


@pytest.fixture()
def features_landed(monkeypatch):
    from kvfleet_server import unsupported

    from kvfleet_operator import server_args

    monkeypatch.setattr(unsupported, "ENGINE_REFUSALS", ())
    server_args._refusal.cache_clear()  # its verdicts were taken with the list in place
    yield
    server_args._refusal.cache_clear()


@pytest.fixture()
async def emulator() -> AsyncIterator[ApiServerEmulator]:
    emu = ApiServerEmulator()
    register_resources(emu)
    async with emu, kmock.Server(emu):
        yield emu


@pytest.fixture()
def kubeconfig(emulator: ApiServerEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = write_kubeconfig(tmp_path / "kubeconfig", str(emulator.url))
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kube.set_credentials(None)
    return path


@pytest.fixture()
async def api(emulator: ApiServerEmulator, kubeconfig: Path) -> AsyncIterator[kube.KubeClient]:
    client = kube.KubeClient(kopf.ConnectionInfo(server=str(emulator.url).rstrip("/"), token="test-client-token"))
    yield client
    await client.close()
