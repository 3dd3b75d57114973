"""Unit tests of the pure apply planning (three-way merge patch) and of the status conditions."""
from __future__ import annotations

import json

from kvfleet_operator import apply, render
from kvfleet_operator import status as st


def test_create_then_noop_when_live_contains_desired():
    desired = {"metadata": {"name": "a", "labels": {"x": "1"}}, "spec": {"replicas": 2, "template": {"a": [1, 2]}}}
    action, body = apply.plan(desired, None)
    assert action == "create" and json.loads(body["metadata"]["annotations"][apply.LAST_APPLIED]) == {
        "metadata": {"labels": {"x": "1"}}, "spec": {"template": {"a": [1, 2]}}}
    live = json.loads(json.dumps(body))
    live["metadata"]["labels"]["other"] = "kept"  # labels and defaults added by others
    live["spec"]["progressDeadlineSeconds"] = 600
    live["status"] = {"replicas": 2}
    assert apply.plan(desired, live) == ("noop", None)


def test_patch_only_what_differs_and_remove_what_was_dropped():
    before = {"metadata": {"name": "a"}, "spec": {"nodeSelector": {"pool": "gpu", "zone": "a"}, "image": "x:1"}}
    _, live = apply.plan(before, None)
    live["spec"]["defaulted"] = "by-server"
    after = {"metadata": {"name": "a"}, "spec": {"nodeSelector": {"pool": "gpu"}, "image": "x:2"}}
    action, patch = apply.plan(after, live)
    assert action == "patch"
    assert patch["spec"] == {"nodeSelector": {"zone": None}, "image": "x:2"}  # defaulted field untouched
    assert "name" not in patch["metadata"]


def test_lists_are_replaced_whole_and_compared_element_wise():
    desired = {"spec": {"containers": [{"name": "c", "args": ["--a"]}]}}
    live = {"spec": {"containers": [{"name": "c", "args": ["--a"], "terminationMessagePath": "/dev/x"}]}}
    assert apply.three_way_patch({}, desired, live) == {}
    live["spec"]["containers"][0]["args"] = ["--b"]
    assert apply.three_way_patch({}, desired, live) == desired


def test_quantities_compare_by_value():
    assert apply.contains("1", "1000m") and apply.contains("1Gi", "1024Mi") and apply.contains("4", "4")
    assert not apply.contains("2", "1") and not apply.contains(4, "4") and not apply.contains("abc", "abd")


def test_replicas_not_recorded_so_autoscaler_changes_need_no_write():
    desired = {"metadata": {"name": "a"}, "spec": {"replicas": 1, "x": 1}}
    _, live = apply.plan(desired, None)
    live["spec"]["replicas"] = 3  # the autoscaler scaled; the reconcile renders the live count
    assert apply.plan({"metadata": {"name": "a"}, "spec": {"replicas": 3, "x": 1}}, live) == ("noop", None)


def test_controlled_by():
    owned = {"metadata": {"ownerReferences": [{"kind": "InferenceService", "uid": "u", "controller": True}]}}
    assert apply.controlled_by(owned, "u") and not apply.controlled_by(owned, "v")
    assert not apply.controlled_by({"metadata": {}}, "u")


def _dep(gen=1, observed=1, replicas=2, updated=2, ready=2, available=None, conditions=()):
    return {"metadata": {"generation": gen}, "status": {"observedGeneration": observed, "replicas": replicas,
                                                        "updatedReplicas": updated, "readyReplicas": ready,
                                                        "availableReplicas": ready if available is None else available,
                                                        "conditions": list(conditions)}}


def test_rollout_states():
    assert st.rollout(None, 1)[:3] == (False, True, "Creating")
    assert st.rollout(_dep(gen=2, observed=1), 2)[:3] == (False, True, "RollingOut")
    # a scale the controller has not observed yet (the autoscaler's, say) while this generation is
    # already serving: the pods still serve, Ready stays
    assert st.rollout(_dep(gen=2, observed=1), 3, serving=True)[:3] == (True, True, "Updating")
    assert st.rollout(_dep(gen=2, observed=1, ready=0), 3, serving=True)[:2] == (False, True)
    assert st.rollout(_dep(ready=0), 2)[:3] == (False, True, "WaitingForPods")
    # a scale-up of a serving generation stays Ready; a new generation is Ready only when all pods are
    assert st.rollout(_dep(replicas=3, updated=3, ready=2), 3, serving=True)[:3] == (True, True, "ScalingUp")
    assert st.rollout(_dep(replicas=3, updated=3, ready=2), 3)[:3] == (False, True, "ScalingUp")
    assert st.rollout(_dep(replicas=2, updated=1, ready=1), 2)[:2] == (False, True)  # old pods still serving
    assert st.rollout(_dep(replicas=2, updated=1, ready=2), 2, serving=True)[:2] == (False, True)
    # all new pods ready, but a pod of the old template is still there (terminating, or maxSurge): not done yet
    assert st.rollout(_dep(replicas=3, updated=2, ready=2), 2)[:3] == (False, True, "RollingOut")
    assert st.rollout(_dep(available=1), 2)[:2] == (False, True)  # ready but not yet available
    assert st.rollout(_dep(), 2)[:3] == (True, False, "Available")
    assert st.rollout(_dep(replicas=0, updated=0, ready=0), 0)[:3] == (False, False, "ScaledToZero")  # no pod: not Ready
    stuck = _dep(ready=0, conditions=[{"type": "Progressing", "reason": "ProgressDeadlineExceeded", "message": "m"}])
    assert st.rollout(stuck, 2)[:3] == (False, False, "ProgressDeadlineExceeded")
    # a stuck rollout of a new generation is not Ready although old pods are; a serving one stays Ready
    stuck = _dep(gen=3, observed=3, replicas=3, updated=1, ready=2,
                 conditions=[{"type": "Progressing", "reason": "ProgressDeadlineExceeded", "message": "m"}])
    assert st.rollout(stuck, 2)[:2] == (False, False)
    assert st.rollout(_dep(replicas=3, updated=3, ready=2, conditions=stuck["status"]["conditions"]), 3,
                      serving=True)[:2] == (True, False)


def test_ready_for_a_new_generation_waits_for_the_deployment_to_roll_it_out():
    """Must-show 1 of issue 34, pure part: whatever the previous status said, a new generation (or a
    pass that wrote the template) is Ready only once the Deployment reports the rollout done."""
    obj = {"metadata": {"generation": 1}, "status": {}}
    obj["status"] = st.compute_status(obj, _dep(), 2, "u", "m", "s", "t1", False, template_written=False)
    assert st.get_condition(obj["status"], "Ready")["status"] == "True"
    obj["metadata"]["generation"] = 2  # a spec change; the Deployment still reports the old rollout
    for dep in (_dep(gen=2, observed=1), _dep(gen=2, observed=2, replicas=2, updated=0),
                _dep(gen=2, observed=2, replicas=2, updated=1, ready=1),
                _dep(gen=2, observed=2, replicas=2, updated=2, ready=1),
                _dep(gen=2, observed=2, available=1)):
        for written in (True, False):
            new = st.compute_status(obj, dep, 2, "u", "m", "s", "t2", False, template_written=written)
            assert st.get_condition(new, "Ready")["status"] == "False", (dep, written)
    done = st.compute_status(obj, _dep(gen=2, observed=2), 2, "u", "m", "s", "t3", False, template_written=False)
    ready = st.get_condition(done, "Ready")
    assert (ready["status"], ready["observedGeneration"], ready["reason"]) == ("True", 2, "Available")


def test_replica_failure_is_degraded_with_the_message():
    quota = ('pods "m-7d9f-abcde" is forbidden: exceeded quota: gpu-quota, requested: requests.nvidia.com/gpu=4, '
             'used: requests.nvidia.com/gpu=4, limited: requests.nvidia.com/gpu=4')
    dep = _dep(replicas=0, updated=0, ready=0,
               conditions=[{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": quota}])
    new = st.compute_status({"metadata": {"generation": 1}}, dep, 2, "u", "m", "s", "t", False)
    d = st.get_condition(new, "Degraded")
    assert (d["status"], d["reason"], d["message"]) == ("True", "FailedCreate", quota)
    assert st.get_condition(new, "Ready")["status"] == "False"
    # a child write refused and a failing pod come first; a cleared ReplicaFailure clears Degraded
    other = st.compute_status({"metadata": {"generation": 1}}, dep, 2, "u", "m", "s", "t", False,
                              problem=("ChildCreateFailed", "create of Service refused"))
    assert st.get_condition(other, "Degraded")["reason"] == "ChildCreateFailed"
    dep["status"]["conditions"][0]["status"] = "False"
    assert st.get_condition(st.compute_status({"metadata": {"generation": 1}}, dep, 2, "u", "m", "s", "t", False),
                            "Degraded")["status"] == "False"


def test_conditions_keep_transition_time_and_foreign_types():
    conds = st.set_condition([{"type": "ScalingActive", "status": "True"}], "Ready", False, "R", "m", "t1", 1)
    conds = st.set_condition(conds, "Ready", False, "R2", "m2", "t2", 2)
    ready = st.get_condition({"conditions": conds}, "Ready")
    assert ready["lastTransitionTime"] == "t1" and ready["reason"] == "R2" and ready["observedGeneration"] == 2
    conds = st.set_condition(conds, "Ready", True, "Available", "ok", "t3", 2)
    assert st.get_condition({"conditions": conds}, "Ready")["lastTransitionTime"] == "t3"
    assert st.get_condition({"conditions": conds}, "ScalingActive") == {"type": "ScalingActive", "status": "True"}


def test_compute_status_and_idempotent_patch():
    obj = {"metadata": {"name": "a", "generation": 4}, "status": {}}
    new = st.compute_status(obj, _dep(), 2, "http://a.ns.svc:8000/v1", "m", render.selector_string("a"), "t", False)
    assert new["observedGeneration"] == 4 and new["desiredReplicas"] == 2 and new["readyReplicas"] == 2
    assert {c["type"]: c["status"] for c in new["conditions"]} == {"Ready": "True", "Progressing": "False",
                                                                    "Degraded": "False"}
    obj["status"] = new
    again = st.compute_status(obj, _dep(), 2, "http://a.ns.svc:8000/v1", "m", render.selector_string("a"), "t2", False)
    assert st.status_patch(obj["status"], again) == {}  # a second pass writes nothing
    # with autoscaling on, desiredReplicas belongs to the autoscaler once it wrote it
    obj["status"]["desiredReplicas"] = 5
    auto = st.compute_status(obj, _dep(), 2, "u", "m", "s", "t", True)
    assert "desiredReplicas" not in auto


def test_degraded_status():
    obj = {"metadata": {"generation": 2}, "status": {}}
    s = st.degraded_status(obj, "UnsupportedModelURI", "spec.model.uri: not supported yet", "t")
    conds = {c["type"]: c for c in s["conditions"]}
    assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == "UnsupportedModelURI"
    assert conds["Ready"]["status"] == "False" and conds["Progressing"]["status"] == "False"
    assert s["observedGeneration"] == 2


def test_degraded_keeps_ready_while_old_children_serve():
    """A later spec that cannot be realised leaves the running children alone: Ready stays True."""
    obj = {"metadata": {"generation": 3}, "status": {}}
    obj["status"] = st.compute_status(obj, _dep(), 2, "u", "m", "s", "t1", False)
    s = st.degraded_status(obj, "ChildInvalid", "the API server refused the Deployment", "t2")
    conds = {c["type"]: c for c in s["conditions"]}
    assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["lastTransitionTime"] == "t2"
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["lastTransitionTime"] == "t1"
    assert conds["Progressing"]["status"] == "False"


def test_ready_does_not_flap_on_unobserved_changes():
    """An autoscaler scale (not observed yet) keeps Ready=True; the pass right after a template patch
    (not observed yet either) keeps Ready=False: no True->False->True or False->True->False flaps."""
    obj = {"metadata": {"generation": 1}, "status": {}}
    obj["status"] = st.compute_status(obj, _dep(), 2, "u", "m", "s", "t1", True)
    assert st.get_condition(obj["status"], "Ready")["status"] == "True"
    scaled = st.compute_status(obj, _dep(gen=2, observed=1), 3, "u", "m", "s", "t2", True, template_written=False)
    assert st.get_condition(scaled, "Ready")["status"] == "True"
    assert st.get_condition(scaled, "Progressing")["status"] == "True"
    patched = st.compute_status(obj, _dep(gen=2, observed=1), 2, "u", "m", "s", "t2", False, template_written=True)
    assert st.get_condition(patched, "Ready")["status"] == "False"
    obj["status"] = patched
    after = st.compute_status(obj, _dep(gen=2, observed=1), 2, "u", "m", "s", "t3", False, template_written=False)
    assert st.get_condition(after, "Ready")["status"] == "False"
