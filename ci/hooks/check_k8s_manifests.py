#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Validate Kubernetes manifests against the JSON schemas of one Kubernetes version,
offline (the schemas ship inside ``kubernetes-validate``).

Strict: an unknown field fails, and so does a kind or apiVersion that has no schema
(``kubernetes-validate``'s own command only warns about those). Run by the
``k8s-manifests`` pre-commit hook, which installs the pinned ``kubernetes-validate``.

    check_k8s_manifests.py [--kubernetes-version 1.33] FILE...
"""

from __future__ import annotations

import argparse
import sys

import kubernetes_validate
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

#: The Kubernetes API version the manifests must be valid for.
KUBERNETES_VERSION = "1.33"


def check_file(path: str, version: str) -> list[str]:
    """Problems of one file (empty: every document validated)."""
    try:
        with open(path, encoding="utf-8") as f:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        return [f"{path}: cannot read YAML: {e}"]
    if not docs:
        return [f"{path}: no Kubernetes object"]
    problems = []
    for doc in docs:
        if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
            problems.append(f"{path}: a document without kind/apiVersion")
            continue
        name = f"{doc['kind']}/{(doc.get('metadata') or {}).get('name', '?')}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path) or "(top)"
            problems.append(f"{path}: {name}: {where}: {e.message}")
        except SchemaNotFoundError as e:
            problems.append(f"{path}: {name}: {e.message}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubernetes-version", default=KUBERNETES_VERSION)
    parser.add_argument("files", nargs="*")
    args = parser.parse_args(argv)
    problems = [p for path in args.files for p in check_file(path, args.kubernetes_version)]
    for p in problems:
        print(p)
    if not problems:
        print(f"{len(args.files)} manifest file(s) valid for Kubernetes {args.kubernetes_version}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
