"""Fixtures for operator tests: a KMock API-server emulator on 127.0.0.1 and a kubeconfig for it.

``emulator``   ApiServerEmulator serving on loopback, resources registered (kmock_support).
``kubeconfig`` KUBECONFIG pointing at it (the operator's login handler and ``kube.login`` read it).
``api``        a kvfleet_operator.kube.KubeClient talking to it (what tests use to act as kubectl), with a
               token of its own so that ``emulator.writes`` tells its writes from the operator's.
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


@pytest.fixture()
def features_landed(monkeypatch):
    from kvfleet_server import unsupported

    monkeypatch.setattr(unsupported, "ENGINE_REFUSALS", ())


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
