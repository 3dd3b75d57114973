"""charts/kvfleet/crds/ is the generated crds/ directory, byte for byte (Helm installs it first)."""
from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "crds"
CHART_CRDS = REPO / "charts" / "kvfleet" / "crds"


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.yaml"))}


def test_chart_crds_are_byte_identical_to_crds():
    source, chart = _files(SOURCE), _files(CHART_CRDS)
    assert "serving.kvfleet.dev_inferenceservices.yaml" in source
    assert sorted(chart) == sorted(source), "run `make manifests`"
    for name, data in source.items():
        assert chart[name] == data, f"charts/kvfleet/crds/{name} differs from crds/{name}: run `make manifests`"


def test_chart_crds_hold_only_crds():
    """Helm applies crds/ verbatim (no templating): nothing but CustomResourceDefinitions there."""
    for path in CHART_CRDS.glob("*"):
        assert path.suffix == ".yaml", path
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            assert doc["apiVersion"] == "apiextensions.k8s.io/v1" and doc["kind"] == "CustomResourceDefinition"
            assert "{{" not in path.read_text()


@pytest.mark.parametrize("path", sorted(CHART_CRDS.glob("*.yaml")), ids=lambda p: p.name)
def test_chart_crds_are_valid(path):
    for doc in yaml.safe_load_all(path.read_text()):
        if doc is not None:
            kubernetes_validate.validate(doc, "1.30.0", strict=True)
