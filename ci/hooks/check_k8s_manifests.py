#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Validate Kubernetes manifests against the JSON schemas of one Kubernetes version,
offline (the schemas ship inside ``kubernetes-validate``).

Strict: an unknown field fails, and so does a kind or apiVersion that has no schema
(``kubernetes-validate``'s own command only warns about those). Run by the
``k8s-manifests`` pre-commit hook, which installs the pinned ``kubernetes-validate``.

A ``kustomization.yaml`` is rendered (:func:`render_kustomization`: the subset of
kustomize that deploy/k8s uses: ``resources`` and RFC 6902 ``patches`` with a kind and
name target) and every object it yields is validated, so an overlay's patches are
checked as applied. tests/unit/test_k8s_manifests.py checks that the rendering is
kustomize's where ``kubectl`` is installed.

    check_k8s_manifests.py [--kubernetes-version 1.33] FILE...
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

#: The Kubernetes API version the manifests must be valid for.
KUBERNETES_VERSION = "1.33"


KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches"}


class RenderError(Exception):
    """A kustomization this renderer cannot render (or kustomize would refuse)."""


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"bad JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _step(node: Any, key: str) -> Any:
    if isinstance(node, list):
        return node[int(key)]
    return node[key]


def apply_json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """``doc`` with RFC 6902 ``add``/``replace``/``remove``/``test`` ``ops`` applied."""
    out = copy.deepcopy(doc)
    for op in ops:
        *parents, last = _pointer(op["path"])
        try:
            node = out
            for key in parents:
                node = _step(node, key)
            kind = op["op"]
            if kind == "test":
                if _step(node, last) != op["value"]:
                    raise RenderError(f"test failed at {op['path']}: {_step(node, last)!r}")
            elif kind == "add" and isinstance(node, list):
                node.insert(len(node) if last == "-" else int(last), op["value"])
            elif kind == "add" or (kind == "replace" and _step(node, last) is not None):
                node[int(last) if isinstance(node, list) else last] = op["value"]
            elif kind == "remove":
                del node[int(last) if isinstance(node, list) else last]
            else:
                raise RenderError(f"unsupported op {op!r}")
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise RenderError(f"{op['op']} {op['path']}: no such place ({e!r})") from e
    return out


def render_kustomization(directory: Path) -> list[dict[str, Any]]:
    """The objects ``directory/kustomization.yaml`` yields, patches applied."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - KUSTOMIZATION_KEYS
    if unknown:
        raise RenderError(f"{directory}: unsupported kustomization keys {sorted(unknown)}")
    objects: list[dict[str, Any]] = []
    for resource in spec.get("resources", []):
        path = (directory / resource).resolve()
        if path.is_dir():
            objects += render_kustomization(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for patch in spec.get("patches", []):
        target = patch["target"]
        if set(target) - {"kind", "name"}:
            raise RenderError(f"{directory}: unsupported patch target {target}")
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        hits = [
            i
            for i, o in enumerate(objects)
            if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]
        ]
        if len(hits) != 1:
            raise RenderError(f"{directory}: patch target {target} matches {len(hits)} objects")
        objects[hits[0]] = apply_json_patch(objects[hits[0]], ops)
    return objects


def _check_objects(where: str, docs: list[Any], version: str) -> list[str]:
    # imported here: the tests import the renderer from an env without the validator
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    problems = []
    for doc in docs:
        if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
            problems.append(f"{where}: a document without kind/apiVersion")
            continue
        name = f"{doc['kind']}/{(doc.get('metadata') or {}).get('name', '?')}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            place = ".".join(str(p) for p in e.path) or "(top)"
            problems.append(f"{where}: {name}: {place}: {e.message}")
        except SchemaNotFoundError as e:
            problems.append(f"{where}: {name}: {e.message}")
    return problems


def check_file(path: str, version: str) -> list[str]:
    """Problems of one file (empty: every document validated)."""
    try:
        with open(path, encoding="utf-8") as f:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        return [f"{path}: cannot read YAML: {e}"]
    if not docs:
        return [f"{path}: no Kubernetes object"]
    if Path(path).name == "kustomization.yaml":
        try:
            rendered = render_kustomization(Path(path).parent)
        except (RenderError, OSError, yaml.YAMLError, KeyError) as e:
            return [f"{path}: cannot render: {e}"]
        return _check_objects(f"{path} (rendered)", rendered, version)
    return _check_objects(path, docs, version)


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
