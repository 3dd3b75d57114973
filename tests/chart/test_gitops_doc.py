"""docs/gitops.md: its Argo CD Applications order CRDs before custom resources and configure the
chart with values the chart accepts (rendered here with the real Helm)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from .conftest import CHART, render_chart

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "gitops.md"


def _docs(kind):
    out = []
    for block in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S):
        out += [d for d in yaml.safe_load_all(block) if isinstance(d, dict) and d.get("kind") == kind]
    return out


@pytest.fixture(scope="module")
def apps():
    apps = {a["metadata"]["name"]: a for a in _docs("Application")}
    assert set(apps) == {"kvfleet-operator", "llm-models"}
    for app in apps.values():
        assert app["apiVersion"] == "argoproj.io/v1alpha1"
        assert app["metadata"]["namespace"] == "argocd"
    return apps


def _wave(app):
    return int(app["metadata"].get("annotations", {}).get("argocd.argoproj.io/sync-wave", "0"))


def test_crds_and_operator_sync_before_models(apps):
    assert _wave(apps["kvfleet-operator"]) < _wave(apps["llm-models"])
    assert "SkipDryRunOnMissingResource=true" in apps["llm-models"]["spec"]["syncPolicy"]["syncOptions"]


def test_server_side_apply(apps):
    for app in apps.values():
        assert "ServerSideApply=true" in app["spec"]["syncPolicy"]["syncOptions"]
    assert apps["llm-models"]["metadata"]["annotations"]["argocd.argoproj.io/compare-options"] == "ServerSideDiff=true"


def test_operator_application_values_are_accepted_by_the_chart(apps, helm, tmp_path):
    source = apps["kvfleet-operator"]["spec"]["source"]
    assert source["path"] == "charts/kvfleet" and (REPO / source["path"] / "Chart.yaml").is_file()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert source["targetRevision"] == f"v{chart['version']}"
    values = source["helm"]["valuesObject"]
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())

    def merged(base, over):
        out = dict(base)
        for k, v in over.items():
            out[k] = merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
        return out

    jsonschema.validate(merged(defaults, values), json.loads((CHART / "values.schema.json").read_text()))
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    manifests = render_chart(helm, values=[path], namespace=apps["kvfleet-operator"]["spec"]["destination"]["namespace"])
    assert any(m["kind"] == "ServiceMonitor" for m in manifests)
    dep = next(m for m in manifests if m["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":" + values["image"]["tag"])


def test_doc_explains_outofsync():
    text = DOC.read_text()
    for phrase in ("never writes an InferenceService's spec", "Defaults come from the CRD's schema",
                   "autoscaler scales the Deployment"):
        assert phrase in text
