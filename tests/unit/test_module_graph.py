# SPDX-License-Identifier: Apache-2.0
"""``vllm_ext/nixl_push`` imports form no cycle, and nothing the writer thread runs
imports the worker (the writer gets a ``WriterContext``, never the worker)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import vllm_ext.nixl_push as pkg

PKG = "vllm_ext.nixl_push"
SRC = Path(pkg.__file__).parent
#: What runs on the writer thread (and what it imports): none of it may know the worker.
WRITER_SIDE = (
    "writer", "registrations", "writes", "dlinks", "context", "layouts", "lifecycle",
    "send_lifecycle", "matching", "messages",
)  # fmt: skip


def _imports(module: str) -> tuple[set[str], set[str]]:
    """The nixl_push modules ``module`` imports: (at run time, only for type checking)."""
    tree = ast.parse((SRC / f"{module}.py").read_text())
    runtime: set[str] = set()
    typing_only: set[str] = set()

    def visit(node: ast.AST, typing: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing)
            return
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            within = node.module == PKG  # from vllm_ext.nixl_push import x
            names = [f"{PKG}.{a.name}" for a in node.names] if within else [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.startswith(PKG + "."):
                (typing_only if typing else runtime).add(name.removeprefix(PKG + ".").split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child, typing)

    visit(tree, False)
    return runtime, typing_only - runtime


def _graph() -> dict[str, tuple[set[str], set[str]]]:
    return {p.stem: _imports(p.stem) for p in SRC.glob("*.py") if p.stem != "__init__"}


def test_the_runtime_import_graph_has_no_cycle() -> None:
    graph = {m: runtime for m, (runtime, _) in _graph().items()}
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, f"import cycle: {' -> '.join((*path, m))}"
        if m in done:
            return
        for dep in graph.get(m, ()):
            visit(dep, (*path, m))
        done.add(m)

    for m in graph:
        visit(m, ())


def test_nothing_on_the_writer_side_imports_the_worker() -> None:
    graph = _graph()
    for m in WRITER_SIDE:
        runtime, typing_only = graph[m]
        assert "worker" not in runtime | typing_only, f"{m} imports the worker"
    reachable: set[str] = set()
    todo = ["writer"]
    while todo:
        m = todo.pop()
        if m not in reachable:
            reachable.add(m)
            todo += graph[m][0]
    assert "worker" not in reachable and "connector" not in reachable
    assert "writer" in graph["worker"][0]  # the worker builds the writer, not the reverse


def test_the_writer_imports_without_the_worker() -> None:
    code = (
        "import sys, vllm_ext.nixl_push.writer\n"
        "assert 'vllm_ext.nixl_push.worker' not in sys.modules, 'the writer loaded the worker'\n"
        "assert 'vllm_ext.nixl_push.scheduler' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
