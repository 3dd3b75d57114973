"""The Argo CD health check of InferenceService (docs/argocd/...) run with a real Lua (lupa).

Argo CD runs the script with the live object in the global ``obj`` and reads back a table
``{status=..., message=...}``. The fixtures follow Argo CD's own layout (health_test.yaml listing
testdata/*.yaml with the expected health), so the directory can be upstreamed as is.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

import lupa
import lupa.lua51
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHECK_DIR = REPO / "docs/argocd/resource_customizations/serving.kvfleet.dev/InferenceService"
HEALTH_LUA = CHECK_DIR / "health.lua"
ARGO_STATES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}


def run_health(obj: dict) -> dict:
    """Run health.lua on ``obj`` the way Argo CD does; return {'status', 'message'}."""
    # Argo CD embeds gopher-lua, a Lua 5.1: run the script on a Lua 5.1 too.
    lua = lupa.lua51.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(copy.deepcopy(obj), recursive=True)
    result = lua.execute(HEALTH_LUA.read_text())
    assert lupa.lua51.lua_type(result) == "table", "health.lua must return a table"
    return {"status": result["status"], "message": result["message"]}


def _cases():
    spec = yaml.safe_load((CHECK_DIR / "health_test.yaml").read_text())
    return [pytest.param(case, id=Path(case["inputPath"]).stem) for case in spec["tests"]]


@pytest.mark.parametrize("case", _cases())
def test_fixture(case):
    obj = yaml.safe_load((CHECK_DIR / case["inputPath"]).read_text())
    got = run_health(obj)
    assert got == case["healthStatus"]
    assert got["status"] in ARGO_STATES


def test_fixtures_cover_the_three_states():
    seen = {case.values[0]["healthStatus"]["status"] for case in _cases()}
    assert {"Healthy", "Progressing", "Degraded"} <= seen


def test_every_testdata_file_is_checked():
    listed = {Path(c.values[0]["inputPath"]).name for c in _cases()}
    on_disk = {p.name for p in (CHECK_DIR / "testdata").glob("*.yaml")}
    assert listed == on_disk


def _healthy_obj() -> dict:
    return yaml.safe_load((CHECK_DIR / "testdata/healthy.yaml").read_text())


def test_generation_bump_turns_healthy_into_progressing():
    obj = _healthy_obj()
    assert run_health(obj)["status"] == "Healthy"
    obj["metadata"]["generation"] += 1  # the user edited spec; the operator has not caught up
    assert run_health(obj)["status"] == "Progressing"
    obj["status"]["observedGeneration"] = obj["metadata"]["generation"]
    assert run_health(obj)["status"] == "Healthy"


def test_degraded_carries_the_operator_message():
    obj = _healthy_obj()
    for cond in obj["status"]["conditions"]:
        if cond["type"] == "Degraded":
            cond.update(status="True", reason="ImagePullFailed", message="image x:y not found")
    assert run_health(obj) == {"status": "Degraded", "message": "ImagePullFailed: image x:y not found"}


def test_ready_false_without_progressing_is_not_healthy():
    obj = _healthy_obj()
    for cond in obj["status"]["conditions"]:
        if cond["type"] == "Ready":
            cond.update(status="False", reason="NoReplicasReady", message="0 of 2 replicas ready")
    assert run_health(obj) == {"status": "Progressing", "message": "NoReplicasReady: 0 of 2 replicas ready"}


def test_gitops_doc_embeds_the_tested_script():
    """docs/gitops.md registers the health check in argocd-cm: it must be this very file."""
    doc = (REPO / "docs/gitops.md").read_text()
    key = "resource.customizations.health.serving.kvfleet.dev_InferenceService"
    embedded = []
    for block in re.findall(r"```yaml\n(.*?)```", doc, flags=re.S):
        for d in yaml.safe_load_all(block):
            if isinstance(d, dict) and d.get("kind") == "ConfigMap" and key in (d.get("data") or {}):
                embedded.append(d["data"][key])
    assert embedded == [HEALTH_LUA.read_text()], "docs/gitops.md must embed health.lua verbatim"
