# SPDX-License-Identifier: Apache-2.0
"""The two distributions stay layered: the runtime (``vllm_ext``, what vLLM loads and
operators run) imports nothing of the development kit (``devkit``), and no file of either
imports itself back through others (no cycle, counting imports inside functions too;
``if TYPE_CHECKING:`` blocks aside). Read from the source with ``ast``, so a lazy import
in a function that the tests never call is caught as well."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNTIME = "vllm_ext"
DEVKIT = "devkit"


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted name -> file, for every ``.py`` under ``root/<package>``."""
    out: dict[str, Path] = {}
    for pkg in packages:
        for path in (root / pkg).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports anywhere outside TYPE_CHECKING."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            subs = (f"{base}.{a.name}" for a in node.names)
            names = [sub if sub in modules else base for sub in subs]
        for dotted in names:
            target = known(dotted)
            if target and target != name:
                found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    modules = _modules(root, packages)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def back_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(runtime module, devkit module) for every import of the devkit by the runtime."""
    return sorted(
        (m, d)
        for m, deps in graph.items()
        if m.split(".")[0] == RUNTIME
        for d in deps
        if d.split(".")[0] == DEVKIT
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_runtime_imports_nothing_of_the_devkit() -> None:
    graph = import_graph(REPO, (RUNTIME, DEVKIT))
    assert sum(1 for m in graph if m.startswith(RUNTIME + ".")) > 40, "the walk found no runtime"
    assert sum(1 for m in graph if m.startswith(DEVKIT + ".")) > 40, "the walk found no devkit"
    assert not back_arrows(graph), f"runtime modules import the devkit: {back_arrows(graph)}"


def test_no_file_imports_itself_back() -> None:
    found = cycles(import_graph(REPO, (RUNTIME, DEVKIT)))
    assert not found, f"import cycles: {found}"


def test_the_runtime_distribution_ships_no_devkit() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == [
        RUNTIME,
        f"{RUNTIME}.*",
    ]
    for gone in ("testing", "bench", "launch", "bundle", "demo.py"):
        assert not (REPO / RUNTIME / gone).exists(), f"{RUNTIME}/{gone} is scaffolding"
    devkit = tomllib.loads((REPO / DEVKIT / "pyproject.toml").read_text())
    assert devkit["project"]["name"] == "vllm-ext-devkit"
    on_disk = {
        ".".join(p.parent.relative_to(REPO).parts) for p in (REPO / DEVKIT).rglob("__init__.py")
    }
    assert set(devkit["tool"]["setuptools"]["packages"]) == on_disk, "a devkit package unlisted"


def test_the_checks_find_a_back_arrow_and_a_cycle(tmp_path: Path) -> None:
    """The walk itself, on a made-up tree: a lazy runtime import of the devkit, a cycle
    through a function's import and a relative one, and a TYPE_CHECKING import left out."""
    files = {
        "vllm_ext/__init__.py": "",
        "vllm_ext/a.py": "def f():\n    from devkit.x import y\n",
        "vllm_ext/b.py": "from vllm_ext import c\n",
        "vllm_ext/c.py": "def g():\n    from . import b\n",
        "vllm_ext/d.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import vllm_ext.e\n"
        ),
        "vllm_ext/e.py": "import vllm_ext.d\n",
        "devkit/__init__.py": "",
        "devkit/x.py": "y = 1\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path, (RUNTIME, DEVKIT))
    assert back_arrows(graph) == [("vllm_ext.a", "devkit.x")]
    assert cycles(graph) == [["vllm_ext.b", "vllm_ext.c"]]
