"""Static RBAC analysis: which API calls does the operator make, and do rendered rules allow them?

Requirements come from three sources:

1. kopf handlers in the operator's modules (``@kopf.on.create(group, version, plural)`` …): kopf
   lists and watches the resource; handlers that track changes (resume/create/update/delete/field,
   timers, daemons) also make kopf patch the object (its annotations, finalizer).
2. Calls on the operator's Kubernetes client (``kvfleet_operator.kube.KubeClient``: get / list /
   create / patch / delete with ``api_version, plural`` and an optional ``subresource``), on the
   ``kubernetes`` package's typed APIs (``read_namespaced_pod``, ``patch_namespaced_custom_object``
   …) and kopf's event posting (``kopf.event/info/warn/exception``).
3. Roles the operator writes (``granted_rules``): Kubernetes lets a Role grant only permissions its
   creator holds (RBAC privilege-escalation prevention; the chart grants no ``escalate`` or ``bind``), so
   every rule of a module-level literal list of RBAC rules (dicts with ``apiGroups``, ``resources``,
   ``verbs``, e.g. ``routing.EPP_RULES``) is a requirement of the operator too.
4. kopf itself (``framework_requirements``), read from kopf's source: it lists/watches CRDs to
   discover resources (reactor/observation.py), lists/watches namespaces when it serves named
   namespaces rather than the whole cluster, keeps peering objects alive with patches
   (engines/peering.py), and posts log messages as Events only when the operator sets
   ``settings.posting.loggers = True`` (engines/posting.py; off by default in kopf 1.45).
4. The API server's admission (``admission_requirements``): the OwnerReferencesPermissionEnforcement
   plugin (on in OpenShift) lets a client create an object whose ownerReference sets
   ``blockOwnerDeletion: true`` only if it may ``update`` the owner's ``finalizers`` subresource; the
   reference the operator puts on its children is read from ``render.owner_reference``.

Call arguments are resolved statically: string constants, f-strings, attributes of the operator's
own modules (``api.PLURAL``), names bound by ``for``-loops or comprehensions over module-level
constants (each iteration's values stay paired), and a function's parameters through every call of
that function in the module (a helper ``_read(client, av, plural)`` is resolved at its call sites) and,
for a module-level function, in the package's other modules (``child_write.write(client, ..., av, plural)``).
A client call whose resource cannot be resolved is an ``AnalysisError``, and so is a call that may
be one: ``X.get/list/create/patch/delete(a, b, ...)`` on a receiver that is not known to be
something else, whose first argument cannot be resolved. The analysis never silently skips a call.

``Requirement.scope`` is ``"cluster"`` for cluster-scoped resources and calls across all namespaces,
``"namespace"`` for calls inside one watched namespace (kopf's watch scope follows the run mode).
"""
from __future__ import annotations

import ast
import importlib
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

API_VERSION_RE = re.compile(r"^(v1|[a-z0-9.-]+\.[a-z]+/v[0-9]+((alpha|beta)[0-9]+)?|[a-z0-9-]+/v[0-9]+((alpha|beta)[0-9]+)?)$")
CLIENT_VERBS = {"get": "get", "list": "list", "create": "create", "patch": "patch", "delete": "delete",
                "replace": "update", "update": "update", "watch": "watch"}
KOPF_CHANGE_HANDLERS = {"resume", "create", "update", "delete", "field", "timer", "daemon"}
KOPF_WATCH_ONLY_HANDLERS = {"event", "index"}
KOPF_EVENT_FUNCS = {"event", "info", "warn", "exception"}
# Cluster-scoped resources the operator could touch (everything else is namespaced).
CLUSTER_SCOPED = {("", "namespaces"), ("", "nodes"), ("apiextensions.k8s.io", "customresourcedefinitions"),
                  ("kopf.dev", "clusterkopfpeerings"), ("zalando.org", "clusterkopfpeerings"),
                  ("rbac.authorization.k8s.io", "clusterroles"), ("storage.k8s.io", "storageclasses")}
# kubernetes typed-client kinds (snake_case as in method names) -> (group, plural).
TYPED_KINDS = {
    "pod": ("", "pods"), "service": ("", "services"), "event": ("", "events"), "namespace": ("", "namespaces"),
    "config_map": ("", "configmaps"), "secret": ("", "secrets"), "endpoints": ("", "endpoints"),
    "persistent_volume_claim": ("", "persistentvolumeclaims"), "node": ("", "nodes"),
    "deployment": ("apps", "deployments"), "replica_set": ("apps", "replicasets"),
    "stateful_set": ("apps", "statefulsets"), "pod_disruption_budget": ("policy", "poddisruptionbudgets"),
    "lease": ("coordination.k8s.io", "leases"),
    "custom_resource_definition": ("apiextensions.k8s.io", "customresourcedefinitions"),
}
TYPED_VERBS = {"read": "get", "list": "list", "create": "create", "patch": "patch", "replace": "update",
               "delete": "delete", "watch": "watch"}
TYPED_RE = re.compile(r"^(read|list|create|patch|replace|delete|watch)_(namespaced_|cluster_)?"
                      r"(?P<kind>[a-z_]+?)(_for_all_namespaces)?(?P<sub>_status|_scale)?$")


class AnalysisError(Exception):
    """A Kubernetes API call the analysis cannot attribute to a resource (file:line in the message)."""


@dataclass(frozen=True, order=True)
class Requirement:
    group: str
    resource: str  # plural, or plural/subresource
    verb: str
    scope: str  # "cluster" or "namespace"
    source: str = ""  # where it comes from (file:line or "kopf: ..."), for messages only

    def key(self) -> tuple[str, str, str, str]:
        return (self.group, self.resource, self.verb, self.scope)


def _group_of(api_version: str) -> str:
    return "" if api_version == "v1" else api_version.rsplit("/", 1)[0]


def _scope(group: str, plural: str, all_namespaces: bool) -> str:
    return "cluster" if all_namespaces or (group, plural.split("/")[0]) in CLUSTER_SCOPED else "namespace"


# --------------------------------------------------------------------------------- value resolution
class _Unknown:
    """A value only known at run time (a parameter, a call's result, a runtime-filled list)."""

    def __repr__(self) -> str:
        return "<unknown>"


UNKNOWN = _Unknown()


class _Resolver:
    """Resolve expressions of one module to the list of values they can take.

    Names bound by enclosing for-loops and comprehensions are bound per iteration, so values
    unpacked from one item stay paired (``for kind, av, plural in CHILDREN``). Local assignments
    contribute every value they may assign (both arms of a conditional expression). Iterating over
    something unknown or empty binds the loop names to UNKNOWN once, so the loop body is still seen.
    """

    MAX_DEPTH = 8

    def __init__(self, tree: ast.Module, module_name: str, package: str,
                 registry: dict[str, "_Resolver"] | None = None):
        self.module_name = module_name
        self.tree = tree
        # every module of the package by name (analyze_package): a module-level function's parameters
        # are resolved through its calls in the other modules too (``child_write.write(client, ..., av, plural)``)
        self.registry = registry if registry is not None else {}
        self.registry[module_name] = self
        self.aliases: dict[str, str] = {}  # local name -> module name ("@name" -> "module:attr")
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
            relative = isinstance(node, ast.ImportFrom) and node.level == 1
            if (relative and node.module is None) or (isinstance(node, ast.ImportFrom) and node.level == 0
                                                      and node.module == package):
                for a in node.names:  # from . import mod / from kvfleet_operator import mod
                    self.aliases[a.asname or a.name] = f"{package}.{a.name}"
            elif relative or (isinstance(node, ast.ImportFrom) and node.level == 0
                              and (node.module or "").startswith(f"{package}.")):
                module = f"{package}.{node.module}" if relative else node.module
                for a in node.names:
                    self.aliases[f"@{a.asname or a.name}"] = f"{module}:{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        self._module = None
        # _call_site_envs per (function, depth): a function's callers are walked once, not once per
        # path that reaches it (the walk is otherwise exponential in the depth of helper chains)
        self._site_envs: dict[tuple[ast.AST, int], list[dict[str, Any]]] = {}
        # Module-level assignments (NAME = expr, A, B = x, y) evaluated statically first; the
        # imported module is only consulted for names built in other ways.
        self.module_assignments: dict[str, list[tuple[ast.AST, ast.AST]]] = {}
        for stmt in tree.body:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                [stmt.target] if isinstance(stmt, ast.AnnAssign) and stmt.value is not None else []
            for target in targets:
                for name in _target_names(target):
                    self.module_assignments.setdefault(name, []).append((target, stmt.value))

    def module(self):
        if self._module is None:
            try:
                self._module = importlib.import_module(self.module_name)
            except ImportError:
                self._module = object()
        return self._module

    # -- helpers
    def _function_of(self, node: ast.AST) -> ast.AST | None:
        cur = node
        while cur in self.parents:
            cur = self.parents[cur]
            if isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return cur
        return None

    def _local_assignments(self, name: str, at: ast.AST) -> list[ast.AST] | None:
        func = self._function_of(at)
        if func is None:
            return None
        params = {a.arg for a in [*func.args.args, *func.args.kwonlyargs, *func.args.posonlyargs]}
        values = []
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                values.append(node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name \
                    and node.value is not None:
                values.append(node.value)
        if values:
            return values
        return [] if name in params else None

    def _call_sites(self, func: ast.AST) -> list[ast.Call]:
        name = getattr(func, "name", None)
        return [n for n in self.parents if isinstance(n, ast.Call)
                and ((isinstance(n.func, ast.Name) and n.func.id == name)
                     or (isinstance(n.func, ast.Attribute) and n.func.attr == name))]

    def _call_site_envs(self, at: ast.AST, depth: int) -> list[dict[str, Any]]:
        """One binding of the enclosing function's parameters per way it is called in this module:
        each parameter bound to the argument of one call (evaluated where it is called), so values
        passed together stay paired. [{}] when the function is never called here (parameters unknown)."""
        func = self._function_of(at)
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or depth > self.MAX_DEPTH:
            return [{}]
        key = (func, depth)
        if key not in self._site_envs:
            self._site_envs[key] = self._walk_call_sites(func, depth)
        return [dict(env) for env in self._site_envs[key]]

    def _walk_call_sites(self, func: ast.FunctionDef | ast.AsyncFunctionDef, depth: int) -> list[dict[str, Any]]:
        positional = [a.arg for a in [*func.args.posonlyargs, *func.args.args]]
        if positional and positional[0] in ("self", "cls"):
            positional = positional[1:]
        defaults = dict(zip(reversed([a.arg for a in [*func.args.posonlyargs, *func.args.args]]),
                            reversed(func.args.defaults)))
        defaults.update({a.arg: d for a, d in zip(func.args.kwonlyargs, func.args.kw_defaults) if d is not None})
        names = positional + [a.arg for a in func.args.kwonlyargs]
        out: list[dict[str, Any]] = []
        sites = [(self, call, names) for call in self._call_sites(func) if self._function_of(call) is not func]
        passed = self._resource_parameters(func)
        if passed and self.parents.get(func) is self.tree:  # a module-level helper that passes the resource
            # on to the client: its calls from the package's other modules bind those parameters
            sites += [(other, call, [n for n in names if n in passed]) for other in self.registry.values()
                      if other is not self for call in other._calls_into(self.module_name, func.name)]
        for resolver, call, wanted in sites:
            starred = any(isinstance(a, ast.Starred) for a in call.args) or \
                any(k.arg is None for k in call.keywords)
            for env in resolver.environments(call, depth + 1):
                per_name: list[list[Any]] = []
                for name in names:
                    if name not in wanted:
                        per_name.append([UNKNOWN])
                        continue
                    arg = next((k.value for k in call.keywords if k.arg == name), None)
                    if arg is None and not starred and name in positional and positional.index(name) < len(call.args):
                        arg = call.args[positional.index(name)]
                    if arg is None and not starred:
                        arg, where = defaults.get(name), self
                    else:
                        where = resolver
                    per_name.append([UNKNOWN] if arg is None else where.eval(arg, env if where is resolver else {},
                                                                               depth + 1))
                out += [dict(zip(names, combo)) for combo in itertools.product(*per_name)]
        return out or [{}]

    @staticmethod
    def _resource_parameters(func: ast.AST) -> set[str]:
        """Parameters of ``func`` that it passes as the api_version, plural or subresource of a client call."""
        params = {a.arg for a in [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]}
        out = set()
        for n in ast.walk(func):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in CLIENT_VERBS:
                args = [*n.args[:2], *(k.value for k in n.keywords if k.arg in ("api_version", "plural", "subresource"))]
                out |= {a.id for a in args if isinstance(a, ast.Name) and a.id in params}
        if out:  # and the parameters that choose the call (``if action == "create": client.create(...)``)
            out |= {g for g, _ in (_guard(n.test) or (None, None) for n in ast.walk(func) if isinstance(n, ast.If))
                    if g in params}
        return out

    def guards_hold(self, env: dict[str, Any], at: ast.AST) -> bool:
        """Whether the ``if NAME == CONST`` / ``elif`` tests around ``at`` can hold with ``env``'s values
        (a test on an unknown value can)."""
        cur = at
        while cur in self.parents and not isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef)):
            parent = self.parents[cur]
            guard = _guard(parent.test) if isinstance(parent, ast.If) and cur is not parent.test else None
            if guard is not None and guard[0] in env and env[guard[0]] is not UNKNOWN \
                    and self._local_assignments(guard[0], at) == []:  # a parameter never reassigned
                if (env[guard[0]] == guard[1]) != (cur in parent.body):
                    return False
            cur = parent
        return True

    def _calls_into(self, module_name: str, func_name: str) -> list[ast.Call]:
        """Calls in this module of ``module_name.func_name`` (``mod.func(...)`` or an imported ``func(...)``).
        Any other use of it (an alias, a partial, a callback) is an AnalysisError: its calls could not be seen."""
        calls = []
        for n in self.parents:
            ref = (isinstance(n, ast.Attribute) and n.attr == func_name and isinstance(n.value, ast.Name)
                   and self.aliases.get(n.value.id) == module_name) or \
                (isinstance(n, ast.Name) and self.aliases.get(f"@{n.id}") == f"{module_name}:{func_name}")
            if not ref or isinstance(self.parents[n], (ast.alias, ast.ImportFrom)):
                continue
            call = self.parents[n]
            if not (isinstance(call, ast.Call) and call.func is n):
                raise AnalysisError(f"{self.module_name}:{getattr(n, 'lineno', '?')}: {module_name}.{func_name} "
                                    f"is used other than by a call; its resource arguments cannot be followed")
            calls.append(call)
        return calls

    def _parameter_values(self, name: str, at: ast.AST, depth: int) -> list[Any]:
        """Values of parameter ``name`` over the calls of its function (UNKNOWN when never called)."""
        return [env.get(name, UNKNOWN) for env in self._call_site_envs(at, depth)]

    # -- evaluation
    def eval(self, node: ast.AST, env: dict[str, Any], depth: int = 0) -> list[Any]:
        if depth > self.MAX_DEPTH:
            return [UNKNOWN]
        d = depth + 1
        if isinstance(node, ast.Constant):
            return [node.value]
        if isinstance(node, ast.Name):
            if node.id in env:
                return [env[node.id]]
            local = self._local_assignments(node.id, node)
            if local == []:
                return self._parameter_values(node.id, node, d)
            if local:
                return [v for expr in local for v in self.eval(expr, self._bindings(expr, d), d)]
            if node.id in self.module_assignments:
                out = []
                for target, value in self.module_assignments[node.id]:
                    for v in self.eval(value, {}, d):
                        bound: dict[str, Any] = {}
                        _bind(target, v, bound)
                        out.append(bound.get(node.id, UNKNOWN))
                return out
            imported = self.aliases.get(f"@{node.id}")
            if imported:
                mod, attr = imported.split(":")
                return [getattr(importlib.import_module(mod), attr, UNKNOWN)]
            return [getattr(self.module(), node.id, UNKNOWN)]
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in self.aliases:
            return [getattr(importlib.import_module(self.aliases[node.value.id]), node.attr, UNKNOWN)]
        if isinstance(node, ast.JoinedStr):
            out = [""]
            for v in node.values:
                parts = [str(v.value)] if isinstance(v, ast.Constant) else self.eval(v.value, env, d)
                out = [UNKNOWN if UNKNOWN in (a, b) else f"{a}{b}" for a in out for b in parts]
            return out
        if isinstance(node, (ast.Tuple, ast.List)):
            combos = itertools.product(*(self.eval(e, env, d) for e in node.elts))
            return [tuple(c) for c in combos]
        if isinstance(node, ast.IfExp):
            return self.eval(node.body, env, d) + self.eval(node.orelse, env, d)
        if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            envs = [dict(env)]
            for gen in node.generators:
                envs = [e2 for e in envs for e2 in self._iterate(gen.target, gen.iter, e, d)]
            return [tuple(v for e in envs for v in self.eval(node.elt, e, d))]
        return [UNKNOWN]

    def _iterate(self, target: ast.AST, iterable: ast.AST, env: dict[str, Any], depth: int) -> list[dict[str, Any]]:
        out = []
        for collection in self.eval(iterable, env, depth):
            items = list(collection) if isinstance(collection, (list, tuple, set, frozenset)) else []
            for item in items or [UNKNOWN]:
                bound = dict(env)
                _bind(target, item, bound)
                out.append(bound)
        return out

    def _bindings(self, node: ast.AST, depth: int = 0) -> list[dict[str, Any]] | dict[str, Any]:
        envs = self.environments(node, depth)
        return envs[0] if len(envs) == 1 else {}

    def environments(self, node: ast.AST, depth: int = 0) -> list[dict[str, Any]]:
        """Bindings of the loop / comprehension names around ``node``, one dict per iteration."""
        chain = []
        cur = node
        while cur in self.parents:
            parent = self.parents[cur]
            if isinstance(parent, (ast.For, ast.AsyncFor)) and cur is not parent.iter and cur is not parent.target:
                chain.append([(parent.target, parent.iter)])
            elif isinstance(parent, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)) \
                    and cur not in [g.iter for g in parent.generators]:
                chain.append([(g.target, g.iter) for g in parent.generators])
            if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
                break
            cur = parent
        envs = self._call_site_envs(node, depth)  # the function's parameters, per call, outermost
        for generators in reversed(chain):  # outermost first
            for target, iterable in generators:
                envs = [e2 for e in envs for e2 in self._iterate(target, iterable, e, depth)]
        return envs

    def joint(self, nodes: list[ast.AST | None], at: ast.AST) -> list[tuple[Any, ...]]:
        """Values of several expressions evaluated together (same loop iteration)."""
        out = []
        for env in self.environments(at):
            if not self.guards_hold(env, at):
                continue
            per_arg = [[None] if n is None else self.eval(n, env) for n in nodes]
            out += list(itertools.product(*per_arg))
        return out

    def values(self, node: ast.AST | None, at: ast.AST) -> list[Any]:
        return [combo[0] for combo in self.joint([node], at)]


def _guard(test: ast.AST) -> tuple[str, Any] | None:
    """(NAME, CONST) of an ``if NAME == CONST`` test, else None."""
    if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and len(test.ops) == 1 \
            and isinstance(test.ops[0], ast.Eq) and isinstance(test.comparators[0], ast.Constant):
        return test.left.id, test.comparators[0].value
    return None


def _target_names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for e in target.elts for n in _target_names(e)]
    return []


def _bind(target: ast.AST, value: Any, env: dict[str, Any]) -> None:
    if isinstance(target, ast.Name):
        env[target.id] = value
    elif isinstance(target, (ast.Tuple, ast.List)):
        if not isinstance(value, (tuple, list)) or len(value) != len(target.elts):
            value = [UNKNOWN] * len(target.elts)
        for t, v in zip(target.elts, value):
            _bind(t, v, env)


# ------------------------------------------------------------------------------------ the analysis
def _is_kopf(node: ast.AST, resolver: _Resolver) -> bool:
    return isinstance(node, ast.Name) and resolver.aliases.get(node.id) == "kopf"


def _kopf_handler(dec: ast.AST, resolver: _Resolver) -> tuple[str, ast.Call] | None:
    """('create', call) for @kopf.on.create(...), @kopf.timer(...), etc."""
    if not isinstance(dec, ast.Call) or not isinstance(dec.func, ast.Attribute):
        return None
    func = dec.func
    if isinstance(func.value, ast.Attribute) and func.value.attr == "on" and _is_kopf(func.value.value, resolver):
        return func.attr, dec
    if _is_kopf(func.value, resolver) and func.attr in {"timer", "daemon", "index"}:
        return func.attr, dec
    return None


def _handler_resource(call: ast.Call, resolver: _Resolver) -> tuple[str, str]:
    kw = {k.arg: k.value for k in call.keywords if k.arg in ("group", "version", "plural", "kind")}
    args = [resolver.values(a, call)[0] for a in call.args[:3]]
    if "plural" in kw or "kind" in kw:
        plural = resolver.values(kw.get("plural") or kw["kind"], call)[0]
        group = resolver.values(kw["group"], call)[0] if "group" in kw else ""
        return str(group), str(plural).lower()
    if len(args) == 3:
        return str(args[0]), str(args[2])
    if len(args) == 2:  # "group/version", "plural"
        return _group_of(str(args[0])), str(args[1])
    if len(args) == 1 and "." in str(args[0]):  # "plural.group"
        plural, group = str(args[0]).split(".", 1)
        return group, plural
    raise AnalysisError(f"cannot tell the resource of a kopf handler: {ast.unparse(call)}")


def _client_names(func: ast.AST, resolver: _Resolver) -> set[str]:
    """Local names bound to the operator's KubeClient in one function."""
    names: set[str] = set()
    if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for arg in [*func.args.args, *func.args.kwonlyargs]:
            if arg.annotation is not None and "KubeClient" in ast.unparse(arg.annotation):
                names.add(arg.arg)
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            callee = ast.unparse(node.value.func)
            if callee.endswith("get_client") or callee.endswith("KubeClient"):
                names.update(_target_names(node.targets[0]))
    return names


def _enclosing_function(node: ast.AST, resolver: _Resolver) -> ast.AST | None:
    cur = node
    while cur in resolver.parents:
        cur = resolver.parents[cur]
        if isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return cur
    return None


def _may_be_client(receiver: ast.AST, at: ast.AST, resolver: _Resolver) -> bool:
    """Whether a call's receiver could be the API client: it is not statically a plain value (a module
    constant such as a dict, a literal, a str)."""
    try:
        values = resolver.values(receiver, at)
    except (KeyError, TypeError, ValueError, AttributeError):
        return True
    return any(v is UNKNOWN or not isinstance(v, (dict, list, tuple, set, frozenset, str, bytes, int, float))
               for v in values)


def _client_call(call: ast.Call, resolver: _Resolver, where: str) -> list[Requirement]:
    func = call.func
    assert isinstance(func, ast.Attribute)
    verb = CLIENT_VERBS[func.attr]
    kw = {k.arg: k.value for k in call.keywords}
    av_node = call.args[0] if call.args else kw.get("api_version")
    plural_node = call.args[1] if len(call.args) > 1 else kw.get("plural")
    ns_node = call.args[2] if len(call.args) > 2 else kw.get("namespace")
    sub_node = kw.get("subresource") or (call.args[5] if func.attr == "patch" and len(call.args) > 5 else None)
    if av_node is None or plural_node is None:
        raise AnalysisError(f"{where}: client call without api_version/plural: {ast.unparse(call)}")
    try:
        combos = resolver.joint([av_node, plural_node, sub_node], call)
    except (KeyError, TypeError, ValueError) as exc:
        raise AnalysisError(f"{where}: cannot resolve the resource of {ast.unparse(call)} ({exc})") from None
    all_namespaces = isinstance(ns_node, ast.Constant) and ns_node.value is None
    reqs = []
    for av, plural, sub in combos:
        if not isinstance(av, str) or not API_VERSION_RE.match(av) or not isinstance(plural, str) \
                or not (sub is None or isinstance(sub, str)):
            raise AnalysisError(f"{where}: {ast.unparse(call)} resolved to {av!r}, {plural!r}")
        group = _group_of(av)
        resource = f"{plural}/{sub}" if sub else plural
        reqs.append(Requirement(group, resource, verb, _scope(group, plural, all_namespaces), where))
    return reqs


def _typed_call(call: ast.Call, resolver: _Resolver, where: str) -> list[Requirement]:
    func = call.func
    assert isinstance(func, ast.Attribute)
    m = TYPED_RE.match(func.attr)
    assert m is not None
    verb = TYPED_VERBS[func.attr.split("_", 1)[0]]
    kind, sub = m.group("kind"), (m.group("sub") or "").lstrip("_")
    all_namespaces = func.attr.endswith("_for_all_namespaces") or "_for_all_namespaces_" in func.attr
    if kind in ("custom_object", "cluster_custom_object"):
        kw = {k.arg: k.value for k in call.keywords}
        group = resolver.values(call.args[0] if call.args else kw["group"], call)[0]
        idx = 3 if "namespaced" in func.attr else 2
        plural = resolver.values(call.args[idx] if len(call.args) > idx else kw["plural"], call)[0]
        all_namespaces = all_namespaces or "cluster_custom_object" in func.attr
    elif kind in TYPED_KINDS:
        group, plural = TYPED_KINDS[kind]
    else:
        raise AnalysisError(f"{where}: unknown kubernetes typed-client kind in {func.attr}")
    resource = f"{plural}/{sub}" if sub else plural
    return [Requirement(group, resource, verb, _scope(group, plural, all_namespaces), where)]


def analyze_source(source: str, module_name: str, package: str = "kvfleet_operator",
                   filename: str = "<src>", resolver: _Resolver | None = None) -> list[Requirement]:
    """Requirements of one module's source (see the module docstring); ``resolver``: the module's
    resolver when it was built beside the package's other modules (``analyze_package``)."""
    if resolver is None:
        resolver = _Resolver(ast.parse(source, filename=filename), module_name, package)
    tree = resolver.tree
    reqs: list[Requirement] = []
    client_names_by_func: dict[ast.AST, set[str]] = {}
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                handler = _kopf_handler(dec, resolver)
                if handler is None or handler[0] in ("startup", "cleanup", "login", "probe"):
                    continue
                kind, call = handler
                if kind not in KOPF_CHANGE_HANDLERS | KOPF_WATCH_ONLY_HANDLERS:
                    raise AnalysisError(f"{where}: kopf.on.{kind} is not known to the RBAC analysis")
                group, plural = _handler_resource(call, resolver)
                verbs = ["list", "watch"] + (["patch"] if kind in KOPF_CHANGE_HANDLERS else [])
                src = f"{where} (@kopf.on.{kind})"
                reqs += [Requirement(group, plural, v, "namespace", src) for v in verbs]
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        func = node.func
        if _is_kopf(func.value, resolver) and func.attr in KOPF_EVENT_FUNCS:
            reqs.append(Requirement("", "events", "create", "namespace", f"{where} (kopf.{func.attr})"))
            continue
        if TYPED_RE.match(func.attr) and ("namespaced" in func.attr or "custom_object" in func.attr
                                          or func.attr.endswith("_for_all_namespaces")):
            reqs += _typed_call(node, resolver, where)
            continue
        if func.attr not in CLIENT_VERBS:
            continue
        enclosing = _enclosing_function(node, resolver)
        if enclosing is not None and enclosing not in client_names_by_func:
            client_names_by_func[enclosing] = _client_names(enclosing, resolver)
        known_client = (isinstance(func.value, ast.Name) and enclosing is not None
                        and func.value.id in client_names_by_func[enclosing])
        if known_client:
            reqs += _client_call(node, resolver, where)
            continue
        # An unknown receiver (a dict's .get, an httpx client...) counts only if it is clearly an
        # API call: its first argument is an API version. One whose first argument cannot be resolved
        # may be an API call (a helper taking the client and the resource as parameters): an error.
        if len(node.args) > 1:
            try:
                first = resolver.values(node.args[0], node)
            except (KeyError, TypeError, ValueError, AttributeError):
                first = [UNKNOWN]
            if all(isinstance(v, str) and API_VERSION_RE.match(v) for v in first):
                reqs += _client_call(node, resolver, where)
            elif any(v is UNKNOWN for v in first) and _may_be_client(func.value, node, resolver):
                raise AnalysisError(f"{where}: cannot resolve {ast.unparse(node)}: it may be an API call "
                                    f"(resolve its arguments or give the client a KubeClient annotation)")
    return reqs


def analyze_package(package_dir: Path, package: str = "kvfleet_operator",
                    skip: Iterable[str] = ("kube.py",)) -> list[Requirement]:
    """Requirements of every module of the operator package (kube.py is the client itself), the rules of
    the Roles it writes included (``granted_rules``)."""
    reqs: list[Requirement] = []
    paths = [p for p in sorted(package_dir.glob("*.py")) if p.name not in skip and p.name != "__init__.py"]
    registry: dict[str, _Resolver] = {}
    resolvers = [_Resolver(ast.parse(p.read_text(), filename=str(p)), f"{package}.{p.stem}", package, registry)
                 for p in paths]
    for path, resolver in zip(paths, resolvers):
        reqs += analyze_source("", resolver.module_name, package, filename=f"{package_dir.name}/{path.name}",
                               resolver=resolver)
        reqs += granted_rules(path, f"{package}.{path.stem}", filename=f"{package_dir.name}/{path.name}")
    return reqs


def _is_rbac_rules(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(r, dict) and {"apiGroups", "resources", "verbs"} <= set(r) for r in value)


def granted_rules(path: Path, module_name: str, filename: str = "<src>") -> list[Requirement]:
    """Every rule of the module's module-level RBAC rule lists (literal lists of rule dicts: what the Roles it
    writes grant), as namespaced requirements of the operator: it may only grant what it holds."""
    tree = ast.parse(path.read_text(), filename=filename)
    reqs = []
    for stmt in tree.body:
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
            continue
        try:
            value = ast.literal_eval(stmt.value)
        except ValueError:
            continue  # not a literal: not a rule list
        if _is_rbac_rules(value):
            name = ast.unparse(stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target)
            reqs += [Requirement(g, res, v, "namespace", f"{filename}: {name} (granted by a Role it writes)")
                     for rule in value for g in rule["apiGroups"] for res in rule["resources"] for v in rule["verbs"]]
    return reqs


def posts_log_events(package_dir: Path) -> bool:
    """Whether the operator turns on kopf's posting of log messages as Events
    (``settings.posting.loggers = True`` anywhere in the package)."""
    for path in package_dir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(ast.unparse(t).endswith("posting.loggers") for t in node.targets):
                if not (isinstance(node.value, ast.Constant) and node.value.value is False):
                    return True
    return False


def framework_requirements(*, cluster_wide: bool, peering: bool, posting: bool = False) -> list[Requirement]:
    """What kopf's runtime needs besides the handlers (kopf 1.45: reactor/observation.py,
    engines/peering.py, engines/posting.py)."""
    reqs = [Requirement("apiextensions.k8s.io", "customresourcedefinitions", v, "cluster",
                        "kopf: resource discovery") for v in ("list", "watch")]
    if not cluster_wide:
        reqs += [Requirement("", "namespaces", v, "cluster", "kopf: namespace observer")
                 for v in ("list", "watch")]
    if peering:
        plural, scope = ("clusterkopfpeerings", "cluster") if cluster_wide else ("kopfpeerings", "namespace")
        reqs += [Requirement("kopf.dev", plural, v, scope, "kopf: peering") for v in ("list", "watch", "patch")]
    if posting:
        reqs.append(Requirement("", "events", "create", "namespace", "kopf: event posting"))
    return reqs


def admission_requirements() -> list[Requirement]:
    """What admission plugins demand of the operator's creates (see the module doc, source 4)."""
    from kvfleet_operator import api, render

    ref = render.owner_reference({"metadata": {"name": "x", "uid": "u"}}) or {}
    if not ref.get("blockOwnerDeletion"):
        return []
    return [Requirement(api.GROUP, f"{api.PLURAL}/finalizers", "update", "namespace",
                        "OwnerReferencesPermissionEnforcement: children with blockOwnerDeletion "
                        "(kvfleet_operator/render.py owner_reference)")]


# --------------------------------------------------------------------------------- rendered RBAC
@dataclass(frozen=True)
class Grants:
    """Effective permissions of one ServiceAccount from rendered (Cluster)Roles and bindings."""

    cluster: tuple[dict, ...]  # rules valid in every namespace and for cluster-scoped resources
    by_namespace: dict[str, tuple[dict, ...]]

    def _allows(self, rules: Iterable[dict], group: str, resource: str, verb: str) -> bool:
        return any(group in r.get("apiGroups", []) and resource in r.get("resources", [])
                   and verb in r.get("verbs", []) for r in rules)

    def allows(self, req: Requirement, namespaces: Iterable[str] | None) -> bool:
        """Whether ``req`` is granted: cluster scope needs a ClusterRole binding; namespace scope
        needs it in every watched namespace (``namespaces`` None: all namespaces)."""
        if self._allows(self.cluster, req.group, req.resource, req.verb):
            return True
        if req.scope == "cluster" or namespaces is None:
            return False
        return all(self._allows(self.by_namespace.get(ns, ()), req.group, req.resource, req.verb)
                   for ns in namespaces)

    def all_rules(self) -> list[dict]:
        return [*self.cluster, *(r for rules in self.by_namespace.values() for r in rules)]


def grants_for(manifests: list[dict], sa_name: str, sa_namespace: str) -> Grants:
    """Collect the rules bound to ServiceAccount sa_namespace/sa_name."""
    cluster_roles = {m["metadata"]["name"]: m.get("rules", []) for m in manifests if m["kind"] == "ClusterRole"}
    roles = {(m["metadata"]["namespace"], m["metadata"]["name"]): m.get("rules", [])
             for m in manifests if m["kind"] == "Role"}

    def bound(binding):
        return any(s.get("kind") == "ServiceAccount" and s.get("name") == sa_name
                   and s.get("namespace") == sa_namespace for s in binding.get("subjects", []))

    cluster: list[dict] = []
    by_ns: dict[str, list[dict]] = {}
    for m in manifests:
        if m["kind"] == "ClusterRoleBinding" and bound(m):
            cluster += cluster_roles.get(m["roleRef"]["name"], [])
        elif m["kind"] == "RoleBinding" and bound(m):
            ns, ref = m["metadata"]["namespace"], m["roleRef"]
            rules = cluster_roles.get(ref["name"], []) if ref["kind"] == "ClusterRole" else roles.get((ns, ref["name"]), [])
            by_ns.setdefault(ns, []).extend(rules)
    return Grants(tuple(cluster), {k: tuple(v) for k, v in by_ns.items()})


def forbidden_grants(rules: Iterable[dict]) -> list[str]:
    """Rules that break the least-privilege policy: wildcards, secrets, privilege escalation."""
    problems = []
    for r in rules:
        text = f"{r}"
        if "*" in r.get("verbs", []) or "*" in r.get("resources", []) or "*" in r.get("apiGroups", []):
            problems.append(f"wildcard in {text}")
        if any(res == "secrets" or res.startswith("secrets/") for res in r.get("resources", [])):
            problems.append(f"secrets granted in {text}")
        if set(r.get("verbs", [])) & {"escalate", "bind", "impersonate"}:
            problems.append(f"privilege-escalation verb in {text}")
        if r.get("nonResourceURLs"):
            problems.append(f"nonResourceURLs in {text}")
    return problems


def applies(req: Requirement, *, cluster_wide: bool, peering: bool) -> bool:
    """Whether a requirement holds in this run mode. Peering objects are the one mode-dependent
    branch of the code: kopf uses ClusterKopfPeering when serving all namespaces and KopfPeering
    per namespace otherwise, none when standalone (kopf engines/peering.guess_selectors), and
    kvfleet_operator.peering.ensure_peering_objects creates the object on the same branches."""
    if req.group in ("kopf.dev", "zalando.org"):
        return peering and req.resource.startswith("clusterkopfpeerings") == cluster_wide
    return True


def check(manifests: list[dict], code_requirements: list[Requirement],
          posting: bool = False) -> tuple[list[str], list[str]]:
    """(missing, excess) for a rendered chart: requirements not granted, and granted
    (group, resource, verb) triples nothing requires (the code's, kopf's and admission's requirements).
    ``posting``: see ``posts_log_events``. Mode (watched namespaces, peering) is read
    from the operator Deployment's arguments, the ServiceAccount from its pod spec."""
    dep = next(m for m in manifests if m["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    cluster_wide = "--all-namespaces" in args or "-A" in args
    namespaces = None if cluster_wide else [a.split("=", 1)[1] for a in args if a.startswith("--namespace=")]
    peering = any(a.startswith("--peering") for a in args)
    grants = grants_for(manifests, pod["serviceAccountName"], dep["metadata"]["namespace"])
    framework = framework_requirements(cluster_wide=cluster_wide, peering=peering, posting=posting)
    reqs = [r for r in code_requirements + framework + admission_requirements()
            if applies(r, cluster_wide=cluster_wide, peering=peering)]
    reqs = [Requirement(r.group, r.resource, r.verb, "cluster" if cluster_wide else r.scope, r.source)
            for r in reqs]
    missing = sorted({f"{r.verb} {r.group or 'core'}/{r.resource} ({r.scope}) needed by {r.source}"
                      for r in reqs if not grants.allows(r, namespaces)})
    needed = {(r.group, r.resource, r.verb) for r in reqs}
    excess = sorted({f"{v} {g or 'core'}/{res}" for rule in grants.all_rules()
                     for g in rule.get("apiGroups", []) for res in rule.get("resources", [])
                     for v in rule.get("verbs", []) if (g, res, v) not in needed})
    return missing, excess
