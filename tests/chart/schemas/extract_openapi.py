"""Write one version's openAPIV3Schema of a published CRD as a JSON file of this directory.

    python tests/chart/schemas/extract_openapi.py CRD.yaml VERSION OUT.json --source "REPO@TAG:PATH"

The schema is copied verbatim (structural schema, CEL rules and all); ``source`` records where it came
from. ``tests/chart/crd_schemas.py`` validates objects against it the way the API server does.
"""
from __future__ import annotations

import argparse
import json

import yaml


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("crd")
    p.add_argument("version")
    p.add_argument("out")
    p.add_argument("--source", required=True, help="repository@tag:path the CRD was read from")
    a = p.parse_args()
    with open(a.crd) as f:
        crd = yaml.safe_load(f)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == a.version]
    doc = {"source": a.source, "group": crd["spec"]["group"], "version": a.version,
           "kind": crd["spec"]["names"]["kind"], "openAPIV3Schema": version["schema"]["openAPIV3Schema"]}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
