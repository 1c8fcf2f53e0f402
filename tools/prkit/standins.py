# SPDX-License-Identifier: Apache-2.0
"""Hub model stand-ins for the kit's ``pytest`` check.

vLLM's tests build a ``ModelConfig`` for Hugging Face hub ids (``facebook/opt-125m``
...). No hub is reachable here and the project downloads no model from one, so such a
test would fail on the base as on the branch and check nothing. The ids the run's test
folders name that :mod:`devkit.testing.hub_stand_in` knows get local stand-ins (the
real config's numbers, a word-level tokenizer, no weights), built once with the env's
interpreter (it has ``tokenizers``) into the kit's cache, and the test run's
``HF_HOME`` / ``HF_HUB_CACHE`` point at them (``HF_HUB_OFFLINE=1``)."""

from __future__ import annotations

import re
from pathlib import Path

from .common import REPO, Progress, run


def named_ids(paths: list[Path]) -> list[str]:
    """The hub ids with a stand-in that ``paths`` name (quoted): a folder's ``.py``
    files, or a test file and the helpers beside it (``utils.py``, ``conftest.py``:
    any ``.py`` file there that is no test module)."""
    from devkit.testing.hub_stand_in import CONFIGS  # the kit puts the repo on sys.path

    files: set[Path] = set()
    for p in paths:
        if p.is_dir():
            files.update(p.rglob("*.py"))
        else:
            files.add(p)
            files.update(f for f in p.parent.glob("*.py") if not f.name.startswith("test_"))
    text = "\n".join(f.read_text(errors="replace") for f in sorted(files))
    return [i for i in sorted(CONFIGS) if re.search(rf"[\"']{re.escape(i)}[\"']", text)]


def setup(
    python: Path, ids: list[str], cache: Path, progress: Progress
) -> tuple[dict[str, str], str]:
    """(env for the test run, a note for the report) with the stand-ins of ``ids``;
    ({}, why) when they could not be built (the tests then run without them)."""
    if not ids:
        return {}, ""
    args = [str(python), "-m", "devkit.testing.hub_stand_in", "--out", str(cache)]
    for i in ids:
        args += ["--id", i]
    res = run(args, REPO, {"PYTHONPATH": str(REPO)}, timeout=600)
    if res.returncode != 0 or not res.stdout.strip():
        why = (res.stderr.strip() or f"exit {res.returncode}")[-300:]
        progress(f"  the hub model stand-ins could not be built: {why}")
        # no stderr in the note: it goes into a PR description (local paths)
        return {}, "no local stand-ins for the hub models the tests name (the build failed)"
    home = Path(res.stdout.strip().splitlines()[-1])
    progress(f"  hub model stand-ins for {', '.join(ids)}: {home}")
    env = {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_HUB_OFFLINE": "1"}
    note = (
        f"the Hugging Face hub models the tests name ({', '.join(ids)}) are local "
        "stand-ins, each with its real config.json numbers (architecture, layers, "
        "heads, sizes) and a word-level tokenizer of its vocabulary size, no weights, "
        "in an offline Hugging Face cache: a test that loads weights cannot pass here"
    )
    return env, note


#: vLLM (0.34.0) refuses every engine config on an x86 CPU without triton-cpu.
TRITON_REFUSAL = "requires Triton (triton-cpu)"
TRITON_PLUGIN = "vllm_ext_triton_stand_in"
_TRITON_PLUGIN_SRC = '''\
"""pytest plugin of the vllm-ext PR kit: vLLM's CPU platform check sees Triton present
while it runs, so a config can be made on an x86 CPU without triton-cpu; anything
else that asks whether Triton is there is told it is not."""

from unittest import mock


def pytest_configure(config):
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        with mock.patch("vllm.triton_utils.HAS_TRITON", True):
            return check(cls, vllm_config)

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
'''


def write_triton_plugin(dest: Path) -> Path:
    """``dest`` holding the pytest plugin :data:`TRITON_PLUGIN` (for PYTHONPATH, with
    ``-p`` and that name)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / f"{TRITON_PLUGIN}.py").write_text(_TRITON_PLUGIN_SRC)
    return dest


def triton_stand_in(tree: Path, cuda: bool, dest: Path) -> tuple[str, str] | None:
    """(a PYTHONPATH entry holding :data:`TRITON_PLUGIN`, a note) where the tree's CPU
    platform refuses a config without triton-cpu and the run is on an x86 CPU; else
    None."""
    import platform

    cpu = tree / "vllm" / "platforms" / "cpu.py"
    if cuda or platform.machine().lower() not in ("x86_64", "amd64") or not cpu.is_file():
        return None
    if TRITON_REFUSAL not in cpu.read_text(errors="replace"):
        return None
    return str(write_triton_plugin(dest)), (
        "no triton-cpu here: vLLM's CPU platform check (which refuses a config on an x86 "
        "CPU without it) saw Triton present while it ran; all else saw it absent"
    )
