"""The kind e2e harness, checked without a cluster: run.sh parses and refuses to start without a
docker engine, the pytest e2e suite skips with its reason, the workflow is well-formed and pinned."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import render_chart

REPO = Path(__file__).resolve().parents[2]
RUN_SH = REPO / "e2e" / "run.sh"
WORKFLOWS = REPO / ".github" / "workflows"
SHA_PIN = re.compile(r"^[\w.-]+/[\w.-]+(/[\w./-]+)?@[0-9a-f]{40}$")


def _e2e_conftest():
    spec = importlib.util.spec_from_file_location("kvfleet_e2e_conftest_under_test", REPO / "e2e/conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- run.sh -------------------------------------------------------------------------------------

def test_run_sh_parses():
    subprocess.run(["bash", "-n", str(RUN_SH)], check=True)


def test_run_sh_is_executable_and_strict():
    assert os.access(RUN_SH, os.X_OK)
    text = RUN_SH.read_text()
    assert text.startswith("#!/usr/bin/env bash")
    assert "set -euo pipefail" in text


def test_run_sh_refuses_bad_usage():
    proc = subprocess.run(["bash", str(RUN_SH), "bogus"], capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert "usage:" in proc.stderr


def test_run_sh_preflight_names_what_is_missing(tmp_path):
    """With a PATH holding a docker whose engine is unreachable, `up` stops before doing anything."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "docker").write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    (fake / "docker").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(RUN_SH), "up"], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 1
    assert "docker engine not reachable" in proc.stderr
    assert "creating kind cluster" not in proc.stderr


def test_run_sh_failure_diagnoses_and_deletes_the_cluster(tmp_path):
    """`all` with an image build that fails: diagnostics are printed, the kind cluster is deleted
    (unless KEEP_CLUSTER=1) and the exit status is the build's."""
    fake = tmp_path / "bin"
    fake.mkdir()
    scripts = {
        "docker": 'case "$1" in info) echo 28.2.2;; build) echo "build broke" >&2; exit 3;; esac',
        "kind": 'echo "kind $*" >&2; [ "$1 $2" = "get clusters" ] && echo kvfleet-e2e; exit 0',
        "kubectl": 'echo "kubectl $*" >&2',
        "helm": 'echo "helm $*" >&2',
    }
    for name, body in scripts.items():
        (fake / name).write_text(f"#!/bin/sh\n{body}\n")
        (fake / name).chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(RUN_SH), "all"], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 3, proc.stderr
    assert "==> diagnostics" in proc.stderr and "kubectl --context kind-kvfleet-e2e get infsvc" in proc.stderr
    assert "kind delete cluster --name kvfleet-e2e" in proc.stderr
    assert "helm upgrade" not in proc.stderr  # stopped at the failure
    proc = subprocess.run(["bash", str(RUN_SH), "all"], capture_output=True, text=True, timeout=30,
                          env={**env, "KEEP_CLUSTER": "1"})
    assert proc.returncode == 3 and "kind delete cluster" not in proc.stderr


def test_run_sh_builds_what_the_sample_and_chart_use():
    text = RUN_SH.read_text()
    for path in ("operator/Dockerfile", "serving_image/Dockerfile.cpu", "e2e/kind-config.yaml", "charts/kvfleet"):
        assert path in text and (REPO / path).exists(), path
    sample = yaml.safe_load((REPO / "crds/samples/smollm2-135m-cpu.yaml").read_text())
    server_image = re.search(r'^SERVER_IMAGE="([^"]+)"', text, re.M).group(1)
    assert sample["spec"]["engine"]["image"] == server_image
    assert sample["spec"]["engine"].get("imagePullPolicy", "IfNotPresent") != "Always"  # kind-loaded image
    kind_cfg = yaml.safe_load((REPO / "e2e/kind-config.yaml").read_text())
    assert kind_cfg["kind"] == "Cluster" and kind_cfg["apiVersion"] == "kind.x-k8s.io/v1alpha4"


def test_run_sh_helm_flags_are_accepted_by_the_chart(helm):
    """The `--set` values run.sh installs the chart with pass the chart's values schema (a value
    the schema refuses, e.g. logLevel=verbose, would only fail in CI's kind cluster)."""
    text = RUN_SH.read_text()
    block = re.search(r'"\$HELM" upgrade --install (.*?)--wait', text, re.S).group(1)
    variables = dict(re.findall(r'^([A-Z_]+)="([^"$]+)"', text, re.M))
    sets = []
    for value in re.findall(r"--set (\S+)", block):
        value = value.replace('"', "")
        value = re.sub(r"\$\{(\w+)%%:\*\}", lambda m: variables[m.group(1)].split(":")[0], value)
        value = re.sub(r"\$\{(\w+)##\*:\}", lambda m: variables[m.group(1)].split(":")[1], value)
        assert "$" not in value, f"unresolved shell expansion in --set {value}"
        sets.append(value)
    assert any(s.startswith("image.repository=") for s in sets)
    manifests = render_chart(helm, sets=sets, namespace=variables["OPERATOR_NS"])
    dep = next(m for m in manifests if m["kind"] == "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["image"] == variables["OPERATOR_IMAGE"]
    assert container["imagePullPolicy"] == "Never"  # kind-loaded image
    # tests/e2e: the release is named so that the operator Deployment is "kvfleet".
    assert dep["metadata"]["name"] == variables["RELEASE"] == "kvfleet"


# --- the pytest e2e suite skips here, with its reason --------------------------------------------

def test_e2e_suite_skips_with_its_reason():
    conftest = _e2e_conftest()
    env = {k: v for k, v in os.environ.items() if k not in ("KVFLEET_E2E_CONTEXT", "KVFLEET_E2E_KUBECONFIG")}
    reason = conftest.e2e_skip_reason(env)
    if reason is None:  # pragma: no cover - only where docker, kind and a cluster are all there
        pytest.skip("docker, kind and KVFLEET_E2E_CONTEXT are all present: the e2e suite would run")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "e2e", "-q", "-rs", "-p", "no:cacheprovider"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"\b\d+ skipped\b", proc.stdout), proc.stdout
    assert "passed" not in proc.stdout and "failed" not in proc.stdout
    # the real-cluster suite (e2e/test_real_cluster.py) skips with its own reason
    assert "no real cluster: set KVFLEET_E2E_KUBECONFIG" in proc.stdout
    assert f"kvfleet e2e suite skipped: {reason}" in proc.stdout
    assert proc.stdout.count(f"e2e skipped: {reason}") >= 1  # the -rs summary


def test_skip_reasons(monkeypatch):
    conftest = _e2e_conftest()
    monkeypatch.setattr(conftest.shutil, "which", lambda name: None)
    assert "docker is not installed" in conftest.e2e_skip_reason({})

    def which(name):
        return None if name == "kind" else "/usr/bin/" + name

    class Ok:
        returncode, stdout, stderr = 0, "28.2.2\n", ""

    monkeypatch.setattr(conftest.shutil, "which", which)
    monkeypatch.setattr(conftest.subprocess, "run", lambda *a, **k: Ok())
    assert "kind is not installed" in conftest.e2e_skip_reason({})
    monkeypatch.setattr(conftest.shutil, "which", lambda name: "/usr/bin/" + name)
    assert "make e2e" in conftest.e2e_skip_reason({})
    assert conftest.e2e_skip_reason({"KVFLEET_E2E_CONTEXT": "kind-kvfleet-e2e"}) is None


def test_e2e_tests_are_all_marked():
    text = (REPO / "e2e/test_e2e.py").read_text()
    assert "pytestmark = pytest.mark.e2e" in text


# --- GitHub workflows ----------------------------------------------------------------------------

def _workflow(name):
    return yaml.safe_load((WORKFLOWS / name).read_text())


def _steps(wf):
    return [step for job in wf["jobs"].values() for step in job["steps"]]


@pytest.mark.parametrize("name", ["e2e.yml", "ci.yml"])
def test_workflow_structure(name):
    wf = _workflow(name)
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads the bare key `on` as True
    assert {"push", "pull_request"} <= set(on)
    assert wf["permissions"] == {"contents": "read"}
    for job in wf["jobs"].values():
        assert job["runs-on"].startswith("ubuntu-") and job["runs-on"] != "ubuntu-latest"
        assert 0 < job["timeout-minutes"] <= 120
        for step in job["steps"]:
            assert ("uses" in step) != ("run" in step), step
            if "uses" in step:
                assert SHA_PIN.match(step["uses"]), f"not pinned to a commit SHA: {step['uses']}"
            else:
                subprocess.run(["bash", "-n"], input=step["run"], text=True, check=True)


def test_e2e_workflow_runs_the_harness_on_kind():
    wf = _workflow("e2e.yml")
    steps = _steps(wf)
    uses = [s["uses"].split("@")[0] for s in steps if "uses" in s]
    assert uses[0] == "actions/checkout"
    assert "helm/kind-action" in uses
    kind_step = next(s for s in steps if s.get("uses", "").startswith("helm/kind-action"))
    assert kind_step["with"]["install_only"] is True  # run.sh creates the cluster with its own config
    runs = "\n".join(s.get("run", "") for s in steps)
    assert "e2e/run.sh" in runs
    # Diagnostics only on failure.
    for s in steps:
        if s.get("name", "").startswith(("Collect", "Upload")):
            assert s["if"] == "failure()"


def test_ci_workflow_runs_make_test():
    runs = "\n".join(s.get("run", "") for s in _steps(_workflow("ci.yml")))
    assert ".ci/run" in runs

