"""The chart's RBAC against the API calls the operator's code makes (rbac_analysis.py).

Sufficiency: every call (kopf handlers, the operator's client, kopf's own needs) is allowed in
every run mode the chart renders. Least privilege: nothing is granted that no call needs, nothing
on secrets, no wildcards. And the check is real: removing any single verb of any rendered rule
makes it fail, naming the code that needs it.
"""
from __future__ import annotations

import copy
import re
import textwrap
from pathlib import Path

import pytest

from . import rbac_analysis as ra
from .conftest import VALUES_ALL, render_chart

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "operator" / "kvfleet_operator"
MODES = {
    "all-namespaces+peering (default)": dict(sets=[]),
    "all-namespaces standalone": dict(sets=["peering.enabled=false"]),
    "named-namespaces+peering (values-all)": dict(values=[VALUES_ALL]),
    "named-namespaces standalone": dict(sets=["peering.enabled=false", "watchNamespaces={team-a,team-b}"]),
}
RBAC_KINDS = {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


@pytest.fixture(scope="module")
def code_requirements() -> list[ra.Requirement]:
    return ra.analyze_package(PACKAGE)


@pytest.fixture(scope="module")
def renders(helm) -> dict[str, list[dict]]:
    return {mode: render_chart(helm, **kw) for mode, kw in MODES.items()}


def _has(reqs, group, resource, verb):
    return any((r.group, r.resource, r.verb) == (group, resource, verb) for r in reqs)


# --- the analysis sees the operator's calls ------------------------------------------------------

def test_analysis_finds_the_operators_calls(code_requirements):
    reqs = code_requirements
    # kopf handlers on InferenceService (create/update/resume) and on the children (on.event)
    assert _has(reqs, "serving.kvfleet.dev", "inferenceservices", "watch")
    assert _has(reqs, "serving.kvfleet.dev", "inferenceservices", "patch")
    assert _has(reqs, "apps", "deployments", "watch")
    # the reconcile's client calls, resolved through the CHILDREN loop (paired group/plural)
    for group, plural in (("apps", "deployments"), ("", "services"), ("policy", "poddisruptionbudgets")):
        for verb in ("get", "create", "patch", "delete"):
            assert _has(reqs, group, plural, verb), (group, plural, verb)
    assert not _has(reqs, "apps", "services", "get")  # no cross-product of loop values
    assert _has(reqs, "serving.kvfleet.dev", "inferenceservices/status", "patch")
    every_source = {r.source.split(":")[0] for r in reqs}
    assert "kvfleet_operator/handlers.py" in every_source


def test_what_a_role_the_operator_writes_grants_is_required(code_requirements):
    """The endpoint picker's Role (routing.EPP_RULES): Kubernetes refuses a Role granting more than its writer
    holds, so each of its rules is a requirement of the operator (and the chart grants it)."""
    from kvfleet_operator import routing

    granted = [r for r in code_requirements if "EPP_RULES" in r.source]
    assert {(r.group, r.resource, r.verb) for r in granted} == {
        (g, res, v) for rule in routing.EPP_RULES for g in rule["apiGroups"] for res in rule["resources"]
        for v in rule["verbs"]}
    assert _has(granted, "llm-d.ai", "inferenceobjectives", "watch") and _has(granted, "", "pods", "get")


def test_analysis_covers_every_module_that_talks_to_the_api():
    """Each module that uses the client, declares kopf handlers or imports the kubernetes package
    yields requirements: a module whose calls the analysis cannot see would fail here."""
    talking = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name in ("kube.py", "__init__.py"):
            continue
        text = path.read_text()
        if re.search(r"get_client\(|@kopf\.(on\.\w+|daemon|timer|index)\(|"
                     r"^\s*(import|from) kubernetes\b", text, re.M):  # not kubernetes_validate
            talking.append(path.name)
            reqs = ra.analyze_source(text, f"kvfleet_operator.{path.stem}", filename=path.name)
            assert reqs, f"{path.name} talks to the API but the analysis found no call in it"
    assert {"handlers.py", "autoscaler.py", "peering.py"} <= set(talking)


# --- every mode: sufficient, minimal, no forbidden grants ---------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_rbac_covers_exactly_what_the_code_needs(renders, code_requirements, mode):
    missing, excess = ra.check(renders[mode], code_requirements, posting=ra.posts_log_events(PACKAGE))
    assert missing == [], "missing permissions:\n" + "\n".join(missing)
    assert excess == [], "granted but unused:\n" + "\n".join(excess)


@pytest.mark.parametrize("mode", MODES)
def test_no_secrets_no_wildcards(renders, mode):
    rules = [r for m in renders[mode] if m["kind"] in ("ClusterRole", "Role") for r in m["rules"]]
    assert rules
    assert ra.forbidden_grants(rules) == []


def test_event_posting_detection(tmp_path):
    (tmp_path / "a.py").write_text("def configure(settings):\n    settings.posting.loggers = True\n")
    assert ra.posts_log_events(tmp_path)
    (tmp_path / "a.py").write_text("def configure(settings):\n    settings.posting.level = 30\n")
    assert not ra.posts_log_events(tmp_path)
    reqs = ra.framework_requirements(cluster_wide=True, peering=False, posting=True)
    assert ("", "events", "create", "namespace") in {r.key() for r in reqs}


def test_forbidden_grants_are_detected():
    assert ra.forbidden_grants([{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}])
    assert ra.forbidden_grants([{"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["*"]}])
    assert ra.forbidden_grants([{"apiGroups": ["*"], "resources": ["pods"], "verbs": ["list"]}])
    assert ra.forbidden_grants([{"apiGroups": [""], "resources": ["*"], "verbs": ["list"]}])
    assert ra.forbidden_grants([{"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"],
                                 "verbs": ["escalate"]}])


# --- the check fails when a permission is removed ------------------------------------------------

def _without(manifests, kind, index, rule_index, verb):
    out = copy.deepcopy(manifests)
    obj = [m for m in out if m["kind"] == kind and not _for_people(m)][index]
    rule = obj["rules"][rule_index]
    rule["verbs"] = [v for v in rule["verbs"] if v != verb]
    return out, rule


def _for_people(m) -> bool:
    """The chart's aggregated kvfleet-edit / kvfleet-view roles: bound to no one by the chart (the
    built-in admin/edit/view roles pick them up), so not the operator's permissions."""
    return any(k.startswith("rbac.authorization.k8s.io/aggregate-to-") for k in (m["metadata"].get("labels") or {}))


def _all_rule_verbs(manifests):
    for kind in ("ClusterRole", "Role"):
        objs = [m for m in manifests if m["kind"] == kind and not _for_people(m)]
        for i, obj in enumerate(objs):
            for j, rule in enumerate(obj["rules"]):
                for verb in rule["verbs"]:
                    yield kind, i, j, verb


@pytest.mark.parametrize("mode", ["all-namespaces+peering (default)", "named-namespaces+peering (values-all)"])
def test_removing_any_single_permission_fails_the_check(renders, code_requirements, mode):
    manifests = renders[mode]
    cases = list(_all_rule_verbs(manifests))
    assert len(cases) > 20
    for kind, i, j, verb in cases:
        broken, rule = _without(manifests, kind, i, j, verb)
        missing, _ = ra.check(broken, code_requirements)
        resource = rule["resources"][0]
        assert any(m.startswith(f"{verb} ") and f"/{resource} " in m for m in missing), (
            f"dropping {verb} on {resource} from {kind} #{i} went unnoticed")


def test_finalizers_update_follows_block_owner_deletion(renders, code_requirements, monkeypatch):
    """Children carry blockOwnerDeletion: true (garbage collection in the foreground waits for them),
    which OwnerReferencesPermissionEnforcement (OpenShift) allows only with `update` on the owner's
    finalizers: granted because of that, and reported as unused if the children stopped setting it."""
    from kvfleet_operator import render

    manifests = renders["all-namespaces+peering (default)"]
    assert ("serving.kvfleet.dev", "inferenceservices/finalizers", "update", "namespace") in \
        {r.key() for r in ra.admission_requirements()}
    assert render.owner_reference({"metadata": {"name": "x", "uid": "u"}})["blockOwnerDeletion"] is True
    real = render.owner_reference
    monkeypatch.setattr(render, "owner_reference", lambda obj: {**real(obj), "blockOwnerDeletion": False})
    _, excess = ra.check(manifests, code_requirements)
    assert excess == ["update serving.kvfleet.dev/inferenceservices/finalizers"]


def test_missing_permission_names_the_code(renders, code_requirements):
    manifests = renders["all-namespaces+peering (default)"]
    role = next(m for m in manifests if m["kind"] == "ClusterRole" and not _for_people(m))
    broken = copy.deepcopy(manifests)
    broken_role = next(m for m in broken if m["kind"] == "ClusterRole" and not _for_people(m))
    broken_role["rules"] = [r for r in role["rules"] if r["resources"] != ["inferenceservices/status"]]
    missing, _ = ra.check(broken, code_requirements)
    assert any("patch serving.kvfleet.dev/inferenceservices/status" in m and "handlers.py" in m for m in missing)


def test_role_in_one_watched_namespace_is_not_enough(renders, code_requirements):
    manifests = [m for m in renders["named-namespaces+peering (values-all)"]
                 if not (m["kind"] in ("Role", "RoleBinding") and m["metadata"]["namespace"] == "llm-staging")]
    missing, _ = ra.check(manifests, code_requirements)
    assert any("pods" in m for m in missing)


def test_binding_to_another_service_account_grants_nothing(renders, code_requirements):
    manifests = copy.deepcopy(renders["all-namespaces+peering (default)"])
    for m in manifests:
        if m["kind"] == "ClusterRoleBinding":
            m["subjects"][0]["name"] = "someone-else"
    missing, _ = ra.check(manifests, code_requirements)
    assert len(missing) > 10


def test_cluster_wide_mode_needs_cluster_grants(renders, code_requirements):
    """Roles in some namespaces do not cover an operator that watches all namespaces."""
    manifests = copy.deepcopy(renders["all-namespaces+peering (default)"])
    crole = next(m for m in manifests if m["kind"] == "ClusterRole" and not _for_people(m))
    pods_rule = next(r for r in crole["rules"] if r["resources"] == ["pods"])
    crole["rules"].remove(pods_rule)
    manifests += [
        {"kind": "Role", "metadata": {"name": "r", "namespace": "x"}, "rules": [pods_rule]},
        {"kind": "RoleBinding", "metadata": {"name": "r", "namespace": "x"},
         "roleRef": {"kind": "Role", "name": "r"},
         "subjects": [{"kind": "ServiceAccount", "name": "kvfleet", "namespace": "kvfleet-system"}]},
    ]
    missing, _ = ra.check(manifests, code_requirements)
    assert any(m.startswith("list core/pods (cluster)") for m in missing)


# --- the analyser on small programs ------------------------------------------------------------

def _analyze(src: str) -> set[tuple[str, str, str, str]]:
    return {r.key() for r in ra.analyze_source(textwrap.dedent(src), "kvfleet_operator.synthetic_module")}


def test_paired_loop_values_and_subresources():
    got = _analyze("""
        from . import kube
        PAIRS = (("apps/v1", "deployments"), ("v1", "configmaps"))

        async def f(ns):
            client = kube.get_client()
            for av, plural in PAIRS:
                await client.get(av, plural, ns, "x")
            await client.patch("serving.kvfleet.dev/v1alpha1", "inferenceservices", ns, "x", {},
                               subresource="status")
            await client.list("v1", "pods", None)
    """)
    assert got == {("apps", "deployments", "get", "namespace"), ("", "configmaps", "get", "namespace"),
                   ("serving.kvfleet.dev", "inferenceservices/status", "patch", "namespace"),
                   ("", "pods", "list", "cluster")}


def test_annotated_client_parameter_and_conditional_locals():
    got = _analyze("""
        from . import kube
        G = "kopf.dev"

        async def f(client: kube.KubeClient, wide, names):
            targets = [("clusterkopfpeerings", None)] if wide else [("kopfpeerings", n) for n in names]
            for plural, ns in targets:
                await client.create(f"{G}/v1", plural, ns, {})
    """)
    assert got == {("kopf.dev", "clusterkopfpeerings", "create", "cluster"),
                   ("kopf.dev", "kopfpeerings", "create", "namespace")}


def test_unresolvable_client_call_is_an_error():
    with pytest.raises(ra.AnalysisError, match="cannot resolve|resolved to"):
        _analyze("""
            from . import kube

            async def f(plural):
                client = kube.get_client()
                await client.delete("v1", plural, "ns", "x")
        """)


def test_kopf_handlers_typed_client_and_events():
    got = _analyze("""
        import kopf
        import kubernetes

        @kopf.on.create("example.com", "v1", "widgets")
        def created(**_):
            kubernetes.client.CoreV1Api().list_namespaced_pod("ns")
            kubernetes.client.CustomObjectsApi().patch_namespaced_custom_object_status(
                "example.com", "v1", "ns", "widgets", "w", {})
            kopf.info({}, reason="R", message="m")

        @kopf.on.event("", "v1", "configmaps")
        def seen(**_):
            pass

        @kopf.timer("example.com/v1", "gadgets", interval=5)
        def tick(**_):
            kubernetes.client.AppsV1Api().read_namespaced_deployment_scale("d", "ns")
    """)
    assert got == {
        ("example.com", "widgets", "list", "namespace"), ("example.com", "widgets", "watch", "namespace"),
        ("example.com", "widgets", "patch", "namespace"),
        ("", "pods", "list", "namespace"), ("example.com", "widgets/status", "patch", "namespace"),
        ("", "events", "create", "namespace"),
        ("", "configmaps", "list", "namespace"), ("", "configmaps", "watch", "namespace"),
        ("example.com", "gadgets", "list", "namespace"), ("example.com", "gadgets", "watch", "namespace"),
        ("example.com", "gadgets", "patch", "namespace"),
        ("apps", "deployments/scale", "get", "namespace"),
    }


def test_helper_taking_the_client_and_resource_as_parameters_is_resolved_at_its_calls():
    # Must-show 6 of issue 17: such a call needing configmaps used to pass every static RBAC test
    got = _analyze("""
        from . import kube

        async def _read(c, av, plural, ns, name):
            return await c.get(av, plural, ns, name)

        async def f(ns):
            client = kube.get_client()
            await _read(client, "v1", "configmaps", ns, "x")
            await _read(client, av="apps/v1", plural="deployments", ns=ns, name="y")
    """)
    assert got == {("", "configmaps", "get", "namespace"), ("apps", "deployments", "get", "namespace")}


def test_helper_whose_resource_cannot_be_resolved_is_an_error():
    for source in ("""
        async def _read(c, av, plural):
            return await c.get(av, plural, "ns", "x")
    """, """
        async def _read(c, av, plural):
            return await c.get(av, plural, "ns", "x")

        async def f(client, args):
            await _read(client, *args)
    """):
        with pytest.raises(ra.AnalysisError, match="may be an API call|cannot resolve"):
            _analyze(source)


def test_a_hidden_limitranges_call_fails_the_chart_check(renders):
    """The mutation that used to pass: a helper call needing a resource nothing grants (limitranges)
    added to the operator's code."""
    mutated = (PACKAGE / "handlers.py").read_text() + textwrap.dedent("""

        async def _read_any(c, av, plural, ns, name):
            return await c.get(av, plural, ns, name)

        async def _settings(ns):
            return await _read_any(kube.get_client(), "v1", "limitranges", ns, "kvfleet-settings")
    """)
    reqs = [r for r in ra.analyze_package(PACKAGE) if not r.source.startswith("kvfleet_operator/handlers.py")]
    reqs += ra.analyze_source(mutated, "kvfleet_operator.handlers", filename="kvfleet_operator/handlers.py")
    missing, _ = ra.check(renders["all-namespaces+peering (default)"], reqs)
    assert any("limitranges" in m and "get" in m for m in missing), missing


def test_http_clients_and_dict_get_are_not_api_calls():
    got = _analyze("""
        import httpx

        async def f(urls, d):
            async with httpx.AsyncClient() as client:
                for url in urls:
                    await client.get(url)
            return d.get("key"), {}.get("v1")
    """)
    assert got == set()


def _fake_package(tmp_path, modules: dict[str, str]):
    pkg = tmp_path / "fakeop"
    pkg.mkdir()
    for name, src in modules.items():
        (pkg / f"{name}.py").write_text(textwrap.dedent(src))
    return pkg


HELPER = """
    async def write(client, action, api_version, plural, namespace, body):
        if action == "create":
            return await client.create(api_version, plural, namespace, body)
        elif action == "patch":
            return await client.patch(api_version, plural, namespace, body["name"], body)
        elif action == "delete":
            await client.delete(api_version, plural, namespace, body["name"])
"""


def test_a_helper_is_resolved_through_its_calls_in_other_modules(tmp_path):
    pkg = _fake_package(tmp_path, {"helper": HELPER, "user": """
        from . import helper
        async def go(client, body):
            await helper.write(client, "create", "batch/v1", "jobs", "ns", body)
        """, "other": """
        from fakeop import helper
        async def go(client, body, action):
            await helper.write(client, action, "v1", "secrets", "ns", body)
        """})
    keys = {(r.group, r.resource, r.verb) for r in ra.analyze_package(pkg, package="fakeop")}
    # the constant action keeps only its branch; an unknown one (and an absolute import) keeps every branch
    assert keys == {("batch", "jobs", "create"), ("", "secrets", "create"), ("", "secrets", "patch"),
                    ("", "secrets", "delete")}


def test_a_helper_used_other_than_by_a_call_is_an_error(tmp_path):
    pkg = _fake_package(tmp_path, {"helper": HELPER, "user": """
        from . import helper
        async def go(client, body):
            await helper.write(client, "create", "batch/v1", "jobs", "ns", body)
        async def hidden(client, body):
            w = helper.write
            await w(client, "create", "v1", "secrets", "ns", body)
        """})
    with pytest.raises(ra.AnalysisError, match="used other than by a call"):
        ra.analyze_package(pkg, package="fakeop")


def test_a_reassigned_guard_prunes_no_branch(tmp_path):
    pkg = _fake_package(tmp_path, {"helper": """
        async def write(client, action, api_version, plural, namespace, body):
            if action == "ensure":
                action = "create" if body else "patch"
            if action == "create":
                return await client.create(api_version, plural, namespace, body)
            return await client.patch(api_version, plural, namespace, body["name"], body)
        """, "user": """
        from . import helper
        async def go(client, body):
            await helper.write(client, "ensure", "batch/v1", "jobs", "ns", body)
        """})
    keys = {(r.group, r.resource, r.verb) for r in ra.analyze_package(pkg, package="fakeop")}
    assert keys == {("batch", "jobs", "create"), ("batch", "jobs", "patch")}
