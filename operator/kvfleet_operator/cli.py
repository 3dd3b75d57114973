"""``kvfleet-operator``: run the operator, render an InferenceService's children, print the CRD.

    kvfleet-operator run [--namespace NS ... | --all-namespaces] [--liveness URL] [--metrics-port N]
                         [--peering NAME | --standalone] [--verbose]
    kvfleet-operator render FILE|- [--kubernetes-version X.Y]
                                        children as YAML (for review in GitOps pull requests)
    kvfleet-operator crd [--peering]    the InferenceService CRD (and kopf's peering CRDs)

Exit status: 0 ok, 2 invalid input (messages name the field).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import logging
import os
import sys
from typing import Any

import yaml

from . import api, routing, runtime

OPERATOR_MODULES = ("kvfleet_operator.handlers", "kvfleet_operator.autoscaler")


def operator_modules() -> list[str]:
    """Handler modules to load: the reconcile, and the autoscaler's timer when it is installed."""
    return [m for m in OPERATOR_MODULES if importlib.util.find_spec(m) is not None]


def _run(args: argparse.Namespace) -> int:
    import kopf

    from . import metrics, peering

    if args.namespace and args.all_namespaces:
        print("error: --namespace and --all-namespaces exclude each other", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for module in operator_modules():
        importlib.import_module(module)
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    peering.namespaces = list(args.namespace or [])
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness or None,
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        priority=peering.start_priority(),
    )
    return 0


class _PlainDumper(yaml.SafeDumper):
    """SafeDumper without &anchors/*aliases: rendered children share sub-objects (probe actions, env),
    and reviewers of a GitOps pull request should see every field spelled out."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _render(args: argparse.Namespace) -> int:
    from . import admission, cache, model_source, render, strict

    try:
        text = sys.stdin.read() if args.file == "-" else open(args.file, encoding="utf-8").read()
        docs = list(yaml.safe_load_all(text))
    except (OSError, UnicodeDecodeError) as exc:  # one line, no traceback
        print(f"error: {args.file}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}",
              file=sys.stderr)
        return 2
    except yaml.YAMLError as exc:
        print(f"error: {args.file}: not YAML: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    try:  # the per-GPU sizing the chart's servingDefaults give the operator, from the same variables
        defaults = dataclasses.replace(render.ServingDefaults.from_env(dict(os.environ)), image=args.serving_image,
                                       pull_policy=args.serving_image_pull_policy, vllm_image=args.vllm_image)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    version = strict.kubernetes_version(args.kubernetes_version)
    out: list[dict[str, Any]] = []
    failed = False
    for doc in docs:
        if not doc:
            continue
        if not isinstance(doc, dict) or doc.get("apiVersion") != api.API_VERSION or doc.get("kind") != api.KIND:
            got = f"{doc.get('apiVersion')} {doc.get('kind')}" if isinstance(doc, dict) else type(doc).__name__
            print(f"error: {args.file}: expected apiVersion {api.API_VERSION} kind {api.KIND}, got {got}",
                  file=sys.stderr)
            failed = True
            continue
        name = (doc.get("metadata") or {}).get("name", "?")
        errors = admission.validate(doc)
        if errors:
            for err in errors:
                print(f"error: {name}: {err}", file=sys.stderr)
            failed = True
            continue
        doc = admission.apply_defaults(doc, admission.schema())
        try:
            children = render.render(doc, defaults=defaults, kubernetes_version=version,
                                     routing_defaults=routing.RoutingDefaults(args.endpoint_picker_image))
        except render.Unrealisable as exc:
            print(f"error: {name}: {exc.reason}: {exc.message}", file=sys.stderr)
            failed = True
            continue
        out += [c for c in (children.deployment, children.service, children.pdb) if c is not None]
        if children.routing is not None:
            out += [getattr(children.routing, field) for field, _, _ in routing.KINDS
                    if getattr(children.routing, field) is not None]
        spec = render.parse_spec(doc)
        claim = cache.claim(doc, spec, None)  # a shared model cache: its claim and one download Job per source
        if claim is not None:
            dl = render.downloader(spec, defaults)
            out += [claim] + [cache.download_job(doc, spec, s, model_source.unpinned(s), dl, [], None,
                                                 render.pod_security_context()) for s in cache.downloaded(spec)]
    if out:
        sys.stdout.write("# Rendered by `kvfleet-operator render`; in a cluster each object also gets an\n"
                         "# ownerReference to its InferenceService, and hf:// / s3:// models are pinned to the\n"
                         "# commit (ETag digest) the operator resolves (status.model.revision) instead of the\n"
                         "# revision asked for.\n")
        sys.stdout.write(yaml.dump_all(out, Dumper=_PlainDumper, sort_keys=False, width=120))
    return 2 if failed else 0


def _crd(args: argparse.Namespace) -> int:
    from . import crdgen

    sys.stdout.write(crdgen.crd_yaml())
    if args.peering:
        sys.stdout.write("---\n" + crdgen.peering_yaml())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfleet-operator", description="kvfleet's Kubernetes operator.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the operator (kopf)")
    run.add_argument("--namespace", "-n", action="append", metavar="NS",
                     help="watch this namespace (repeatable; default: all namespaces)")
    run.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)")
    run.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", metavar="URL",
                     help="kopf liveness endpoint (default %(default)s; empty disables)")
    run.add_argument("--metrics-port", type=int, default=9090, metavar="PORT",
                     help="serve Prometheus /metrics on this port (default %(default)s; 0 disables)")
    group = run.add_mutually_exclusive_group()
    group.add_argument("--peering", default="kvfleet", metavar="NAME",
                       help="kopf peering object name (default %(default)s): only one operator replica acts")
    group.add_argument("--standalone", action="store_true", help="no peering (a single replica)")
    run.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    run.set_defaults(func=_run)
    render = sub.add_parser("render", help="print the children of an InferenceService YAML file")
    render.add_argument("file", metavar="FILE", help="InferenceService YAML (several documents allowed; - = stdin)")
    render.add_argument("--serving-image", default=os.environ.get("KVFLEET_SERVING_IMAGE") or api.DEFAULT_IMAGE,
                        help="image for specs without engine.image, as the chart's servingImage gives the operator "
                             "(default: env KVFLEET_SERVING_IMAGE, else %(default)s)")
    render.add_argument("--serving-image-pull-policy", choices=["Always", "IfNotPresent", "Never"],
                        default=os.environ.get("KVFLEET_SERVING_IMAGE_PULL_POLICY") or api.DEFAULT_PULL_POLICY,
                        help="pull policy for specs without engine.imagePullPolicy (default: %(default)s)")
    render.add_argument("--vllm-image", default=os.environ.get("KVFLEET_VLLM_IMAGE") or runtime.DEFAULT_VLLM_IMAGE,
                        help="image for specs with engine.runtime vllm and without engine.image, as the chart's "
                             "vllmImage gives the operator (default: env KVFLEET_VLLM_IMAGE, else %(default)s)")
    render.add_argument("--kubernetes-version", metavar="MAJOR.MINOR", default=None,
                        help="check the children against this Kubernetes version's schema, as the operator does "
                             "with its API server's (default: the newest kubernetes-validate knows; versions below "
                             "1.30, the oldest supported, count as 1.30)")
    render.add_argument("--endpoint-picker-image", default=routing.RoutingDefaults.from_env(dict(os.environ)).epp_image,
                        help="endpoint picker image for specs with spec.routing.inferencePool and no endpointPicker.image, "
                             "as the chart's routing.endpointPickerImage gives the operator (default: env "
                             "KVFLEET_EPP_IMAGE, else %(default)s)")
    render.set_defaults(func=_render)
    crd = sub.add_parser("crd", help="print the InferenceService CRD")
    crd.add_argument("--peering", action="store_true", help="also print kopf's peering CRDs")
    crd.set_defaults(func=_crd)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
