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
    """The hub ids with a stand-in that the ``.py`` files of ``paths``' folders name
    (quoted): the tests' own files and the helpers beside them (``utils.py``)."""
    from devkit.testing.hub_stand_in import CONFIGS  # the kit puts the repo on sys.path

    folders = {p if p.is_dir() else p.parent for p in paths}
    text = "\n".join(
        f.read_text(errors="replace") for d in sorted(folders) for f in sorted(d.rglob("*.py"))
    )
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
        return {}, f"no local stand-ins for the hub models the tests name ({why})"
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
