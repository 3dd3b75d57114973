"""e2e fixtures: skip (with the reason printed) unless docker, kind and the e2e cluster are there.

The cluster is prepared by ``e2e/run.sh up`` (kind cluster, both images, helm install) which then
runs these tests with ``KVFLEET_E2E_CONTEXT`` set to its kubectl context. On a machine without a
docker engine or kind, or where nobody ran run.sh, every test here is skipped and the reason is
printed in the terminal summary.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _k8s_tools():
    """tests/chart/k8s_tools.py (helm/kubectl from PyPI), loaded by path: e2e/ is not a package."""
    spec = importlib.util.spec_from_file_location("kvfleet_e2e_k8s_tools", REPO / "tests/chart/k8s_tools.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

_SKIP_REASON: list[str] = []


def e2e_skip_reason(environ=None) -> str | None:
    """Why the e2e suite cannot run here, or None when it can."""
    environ = os.environ if environ is None else environ
    if shutil.which("docker") is None:
        return "docker is not installed (no docker client on PATH)"
    try:
        info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"docker engine not reachable ({exc})"
    if info.returncode != 0 or not info.stdout.strip():
        detail = (info.stderr.strip().splitlines() or ["docker info failed"])[-1]
        return f"docker engine not reachable: {detail}"
    if shutil.which("kind") is None:
        return "kind is not installed (https://kind.sigs.k8s.io)"
    if not environ.get("KVFLEET_E2E_CONTEXT"):
        return "no e2e cluster: run `make e2e` (e2e/run.sh creates the kind cluster and runs these tests)"
    return None


def pytest_collection_modifyitems(config, items):
    e2e_items = [item for item in items if item.get_closest_marker("e2e")]
    if not e2e_items:
        return
    reason = e2e_skip_reason()
    if reason is None:
        return
    _SKIP_REASON.append(reason)
    marker = pytest.mark.skip(reason=f"e2e skipped: {reason}")
    for item in e2e_items:
        item.add_marker(marker)


def pytest_terminal_summary(terminalreporter):
    if _SKIP_REASON:
        terminalreporter.write_line(f"kvfleet e2e suite skipped: {_SKIP_REASON[0]}")


class Kube:
    """kubectl bound to the e2e cluster's context."""

    def __init__(self, context: str):
        self.context = context
        self.kubectl = shutil.which("kubectl") or str(_k8s_tools().tool_path("kubectl"))

    def __call__(self, *args: str, check: bool = True, timeout: float = 120, stdin: str | None = None) -> str:
        proc = subprocess.run([self.kubectl, "--context", self.context, *args], input=stdin,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    def popen(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([self.kubectl, "--context", self.context, *args],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="session")
def kube() -> Kube:
    return Kube(os.environ["KVFLEET_E2E_CONTEXT"])
