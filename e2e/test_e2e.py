"""End-to-end on a kind cluster prepared by e2e/run.sh (operator installed with the Helm chart).

The tests run in file order and share one InferenceService, the SmolLM2 CPU sample from
crds/samples: apply -> Ready -> a chat completion through the Service -> load that makes the
autoscaler add a replica -> delete -> the garbage collector removes every child.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "crds" / "samples" / "smollm2-135m-cpu.yaml"
NAMESPACE = "kvfleet-e2e"
OPERATOR_NS = "kvfleet-system"
READY_TIMEOUT_S = 900
SCALE_TIMEOUT_S = 420
GC_TIMEOUT_S = 180


def _sample() -> dict:
    return yaml.safe_load(SAMPLE.read_text())


def _name() -> str:
    return _sample()["metadata"]["name"]


def _get(kube, kind: str, name: str) -> dict:
    return json.loads(kube("get", kind, name, "-n", NAMESPACE, "-o", "json"))


def _wait_until(predicate, timeout_s: float, what: str, interval_s: float = 3.0):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")


@pytest.fixture(scope="module")
def applied(kube):
    kube("create", "namespace", NAMESPACE, check=False)
    kube("apply", "-n", NAMESPACE, "-f", str(SAMPLE))
    yield _name()
    kube("delete", "infsvc", _name(), "-n", NAMESPACE, "--ignore-not-found", "--wait=false", check=False)


@pytest.fixture(scope="module")
def endpoint(kube, applied):
    """http://127.0.0.1:PORT/v1 forwarded to the sample's Service."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    svc = _get(kube, "service", applied)
    target = svc["spec"]["ports"][0]["port"]
    proc = kube.popen("port-forward", "-n", NAMESPACE, f"svc/{applied}", f"{port}:{target}")
    try:
        line = proc.stdout.readline()
        assert "Forwarding from" in line, f"port-forward failed: {line}"
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_operator_is_running(kube):
    # e2e/run.sh installs the chart as release "kvfleet": the Deployment is named "kvfleet".
    kube("rollout", "status", "deployment/kvfleet", "-n", OPERATOR_NS, "--timeout=180s", timeout=200)
    dep = json.loads(kube("get", "deployment/kvfleet", "-n", OPERATOR_NS, "-o", "json"))
    assert dep["status"].get("readyReplicas") == dep["spec"]["replicas"] == 1


@pytest.mark.timeout(READY_TIMEOUT_S + 120)
def test_sample_becomes_ready(kube, applied):
    kube("wait", f"infsvc/{applied}", "-n", NAMESPACE, "--for=condition=Ready",
         f"--timeout={READY_TIMEOUT_S}s", timeout=READY_TIMEOUT_S + 30)
    isvc = _get(kube, "infsvc", applied)
    assert isvc["status"]["observedGeneration"] == isvc["metadata"]["generation"]
    assert isvc["status"]["url"] == f"http://{applied}.{NAMESPACE}.svc:8000/v1"
    for kind in ("deployment", "service"):
        child = _get(kube, kind, applied)
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref["kind"] == "InferenceService" and ref["uid"] == isvc["metadata"]["uid"]
        assert ref["controller"] is True
    # The operator never writes spec: what we applied is what is stored (defaults aside).
    assert isvc["spec"]["model"] == _sample()["spec"]["model"]


def test_chat_completion(endpoint, applied):
    from openai import OpenAI  # noqa: PLC0415

    client = OpenAI(base_url=endpoint, api_key="unused", timeout=120)
    models = [m.id for m in client.models.list().data]
    assert applied in models or "smollm2" in models, models
    reply = client.chat.completions.create(
        model=models[0], messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens > 0


@pytest.mark.timeout(SCALE_TIMEOUT_S + 120)
def test_load_triggers_scale_up(kube, endpoint, applied):
    patch = {"spec": {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2,
                                      "targetQueueLength": 1, "metricsIntervalSeconds": 5,
                                      "scaleUpStabilizationSeconds": 0}}}
    kube("patch", "infsvc", applied, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(patch))

    def scaled():
        dep = _get(kube, "deployment", applied)
        return dep["spec"]["replicas"] >= 2 and dep["spec"]["replicas"]

    from openai import AsyncOpenAI  # noqa: PLC0415

    async def load_until_scaled() -> int:
        client = AsyncOpenAI(base_url=endpoint, api_key="unused", timeout=300, max_retries=0)
        stop = asyncio.Event()

        async def worker():
            while not stop.is_set():
                try:
                    await client.completions.create(model=applied, prompt="Tell me a long story.",
                                                    max_tokens=256, temperature=0.8)
                except Exception:  # noqa: BLE001 - load generator: errors only slow it down
                    await asyncio.sleep(0.5)

        # More concurrent requests than maxNumSeqs (16) so requests queue: waiting > target 1.
        workers = [asyncio.create_task(worker()) for _ in range(48)]
        try:
            return await asyncio.to_thread(_wait_until, scaled, SCALE_TIMEOUT_S, "scale-up to 2 replicas")
        finally:
            stop.set()
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    replicas = asyncio.run(load_until_scaled())
    assert replicas == 2  # maxReplicas caps the decision
    isvc = _get(kube, "infsvc", applied)
    assert isvc["status"]["desiredReplicas"] == 2
    assert "replicas" not in isvc["spec"] or isvc["spec"]["replicas"] == _sample()["spec"]["replicas"]


def test_delete_removes_children(kube, applied):
    kube("delete", "infsvc", applied, "-n", NAMESPACE, "--wait=true", "--timeout=120s", timeout=150)
    selector = f"app.kubernetes.io/instance={applied}"

    def gone():
        left = kube("get", "deployments,services,poddisruptionbudgets,pods", "-n", NAMESPACE,
                    "-l", selector, "-o", "name").split()
        return not left or None

    _wait_until(gone, GC_TIMEOUT_S, "the garbage collector to remove the children")
