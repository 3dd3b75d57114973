"""The chart's ValidatingAdmissionPolicy: the operator's ServiceAccount may change only pods'
controller.kubernetes.io/pod-deletion-cost annotation (issue 34, must-show 8).

The policy's CEL (match condition, variables, validations) is evaluated with cel-python the way the
API server evaluates it: the match conditions decide whether it applies, the variables are bound in
order under ``variables``, every validation must be true, and an evaluation error denies
(``failurePolicy: Fail``). Requests are built from a serving pod the operator renders: allowed
patches (set, change, remove the deletion cost) and forbidden ones (a label, the image, another
annotation, finalizers, ownerReferences, a non-integer cost, create, delete, a subresource).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml

from .conftest import render_chart

REPO = Path(__file__).resolve().parents[2]
COST = "controller.kubernetes.io/pod-deletion-cost"
OPERATOR = "system:serviceaccount:kvfleet-system:kvfleet"


@pytest.fixture(scope="module")
def policy(helm) -> dict:
    manifests = render_chart(helm)
    (vap,) = [m for m in manifests if m["kind"] == "ValidatingAdmissionPolicy"]
    (binding,) = [m for m in manifests if m["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"] == {"policyName": vap["metadata"]["name"], "validationActions": ["Deny"]}
    assert vap["spec"]["failurePolicy"] == "Fail"
    return vap


def _eval(env: celpy.Environment, expression: str, activation: dict[str, Any]) -> Any:
    try:
        return env.program(env.compile(expression)).evaluate(activation)
    except celpy.CELEvalError as exc:
        return exc


def admit(policy: dict, request: dict, old: dict | None, new: dict | None) -> list[str] | None:
    """None when the policy does not apply (a match condition is false), else the messages of the
    validations that deny the request (empty: admitted)."""
    env = celpy.Environment()
    activation: dict[str, Any] = {"request": celpy.json_to_cel(request), "object": celpy.json_to_cel(new),
                                  "oldObject": celpy.json_to_cel(old)}
    for cond in policy["spec"].get("matchConditions", []):
        result = _eval(env, cond["expression"], activation)
        assert not isinstance(result, Exception), (cond, result)
        if not result:
            return None
    variables: dict[Any, Any] = {}
    for var in policy["spec"].get("variables", []):
        activation["variables"] = celpy.celtypes.MapType(variables)
        variables[celpy.celtypes.StringType(var["name"])] = _eval(env, var["expression"], activation)
    activation["variables"] = celpy.celtypes.MapType(variables)
    denied = []
    for rule in policy["spec"]["validations"]:
        result = _eval(env, rule["expression"], activation)
        if isinstance(result, Exception) or not result:
            denied.append(rule["message"])
    return denied


@pytest.fixture(scope="module")
def pod() -> dict:
    """A serving pod as the ReplicaSet creates it from the operator's rendered template."""
    from kvfleet_operator import render

    sample = yaml.safe_load((REPO / "crds/samples/smollm2-135m-cpu.yaml").read_text())
    sample["metadata"].update(namespace="llm", uid="u-1")
    template = render.render(sample).deployment["spec"]["template"]
    meta = copy.deepcopy(template["metadata"])
    meta.update(name="smollm2-7d9f-abcde", namespace="llm", uid="p-1", labels={**meta["labels"],
                                                                              "pod-template-hash": "7d9f"},
                ownerReferences=[{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "smollm2-7d9f",
                                  "uid": "rs-1", "controller": True, "blockOwnerDeletion": True}])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": copy.deepcopy(template["spec"])}


def update(user: str = OPERATOR, sub: str | None = None) -> dict:
    req = {"operation": "UPDATE", "userInfo": {"username": user}, "namespace": "llm", "name": "smollm2-7d9f-abcde",
           "resource": {"group": "", "version": "v1", "resource": "pods"}}
    if sub is not None:
        req["subResource"] = sub
    return req


def changed(pod: dict, fn) -> dict:
    new = copy.deepcopy(pod)
    fn(new)
    return new


def with_cost(value: str):
    return lambda p: p["metadata"].setdefault("annotations", {}).__setitem__(COST, value)


def test_the_deletion_cost_may_be_set_changed_and_removed(policy, pod):
    costed = changed(pod, with_cost("3"))
    assert admit(policy, update(), pod, costed) == []  # set
    assert admit(policy, update(), costed, changed(costed, with_cost("-2"))) == []  # changed
    assert admit(policy, update(), costed, pod) == []  # removed
    assert admit(policy, update(), pod, pod) == []  # no change at all
    bare = changed(pod, lambda p: p["metadata"].pop("annotations"))
    assert admit(policy, update(), bare, changed(bare, with_cost("0"))) == []  # a pod without annotations


FORBIDDEN = {
    "label": (lambda p: p["metadata"]["labels"].__setitem__("app.kubernetes.io/instance", "other"),
              "the kvfleet operator may not change a pod's labels"),
    "label removed": (lambda p: p["metadata"]["labels"].pop("pod-template-hash"),
                      "the kvfleet operator may not change a pod's labels"),
    "image": (lambda p: p["spec"]["containers"][0].__setitem__("image", "evil/miner:latest"),
              "the kvfleet operator may not change a pod's spec"),
    "another annotation": (lambda p: p["metadata"]["annotations"].__setitem__("example.com/x", "1"),
                           "the kvfleet operator may change only the controller.kubernetes.io/pod-deletion-cost "
                           "annotation of a pod"),
    "an annotation changed": (lambda p: p["metadata"]["annotations"].__setitem__("prometheus.io/port", "1"),
                              "the kvfleet operator may change only the controller.kubernetes.io/pod-deletion-cost "
                              "annotation of a pod"),
    "an annotation removed": (lambda p: p["metadata"]["annotations"].pop("prometheus.io/scrape"),
                              "the kvfleet operator may change only the controller.kubernetes.io/pod-deletion-cost "
                              "annotation of a pod"),
    "finalizer": (lambda p: p["metadata"].__setitem__("finalizers", ["example.com/hold"]),
                  "the kvfleet operator may not change a pod's finalizers or ownerReferences"),
    "ownerReferences": (lambda p: p["metadata"].__setitem__("ownerReferences", []),
                        "the kvfleet operator may not change a pod's finalizers or ownerReferences"),
    "non-integer cost": (with_cost("cheap"), "controller.kubernetes.io/pod-deletion-cost must be an integer"),
}


@pytest.mark.parametrize("what", FORBIDDEN)
def test_any_other_change_is_denied(policy, pod, what):
    fn, message = FORBIDDEN[what]
    assert admit(policy, update(), pod, changed(pod, fn)) == [message]
    # ... also when made together with an allowed deletion-cost change
    both = changed(changed(pod, fn), with_cost("1")) if what != "non-integer cost" else changed(pod, fn)
    assert message in admit(policy, update(), pod, both)


def test_create_delete_and_subresources_are_denied(policy, pod):
    only_update = "the kvfleet operator may only update pods (no create, delete or subresource)"
    create = {**update(), "operation": "CREATE"}
    assert only_update in admit(policy, create, None, pod)
    delete = {**update(), "operation": "DELETE"}
    assert only_update in admit(policy, delete, pod, None)
    for sub in ("status", "ephemeralcontainers", "resize"):
        assert only_update in admit(policy, update(sub=sub), pod, changed(pod, with_cost("1")))
    assert admit(policy, update(sub=""), pod, changed(pod, with_cost("1"))) == []


def test_other_users_are_not_matched(policy, pod):
    image = changed(pod, FORBIDDEN["image"][0])
    for user in ("system:serviceaccount:kvfleet-system:other", "system:serviceaccount:llm:kvfleet", "admin"):
        assert admit(policy, update(user=user), pod, image) is None
    assert admit(policy, update(), pod, image) == [FORBIDDEN["image"][1]]


def test_the_policy_names_the_service_account_the_operator_runs_as(helm):
    manifests = render_chart(helm, namespace="ops", release="fleet", sets=["serviceAccount.name=op-sa"])
    (vap,) = [m for m in manifests if m["kind"] == "ValidatingAdmissionPolicy"]
    dep = next(m for m in manifests if m["kind"] == "Deployment")
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    assert sa == "op-sa"
    assert vap["spec"]["matchConditions"][0]["expression"] == \
        "request.userInfo.username == 'system:serviceaccount:ops:op-sa'"


def test_the_policy_can_be_disabled(helm):
    kinds = {m["kind"] for m in render_chart(helm, sets=["podPatchPolicy.enabled=false"])}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
