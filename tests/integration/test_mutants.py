# SPDX-License-Identifier: Apache-2.0
"""The default run catches each hand-written mutant of the connector (mutants.py).

Each mutant is applied to a copy of ``vllm_ext`` that a child pytest imports first
(``PYTHONPATH``, and ``-P`` keeps the working directory off ``sys.path``;
``tests/conftest.py`` refuses to run if ``VLLM_EXT_MUTANT_ROOT`` names another copy
than the one imported); the tests in its ``caught_by`` must fail there.
A surviving mutant fails this test: the suite could not see that bug.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mutants import MUTANTS, Mutant, copy_package

import vllm_ext

ROOT = Path(__file__).resolve().parents[2]
#: pytest's exit code when tests ran and at least one failed
TESTS_FAILED = 1


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_default_run_catches_the_mutant(mutant: Mutant, tmp_path: Path) -> None:
    package = copy_package(Path(vllm_ext.__file__).parent, tmp_path)
    mutant.apply(package)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
        "VLLM_EXT_MUTANT_ROOT": str(package),
    }
    cmd = [
        sys.executable, "-P", "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
        "-p", "no:xdist", "-m", "not e2e and not slow", *mutant.caught_by,
    ]  # fmt: skip
    run = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=360, check=False
    )
    tail = "\n".join((run.stdout + run.stderr).splitlines()[-25:])
    assert run.returncode == TESTS_FAILED, (
        f"mutant {mutant.name} ({mutant.about}) survived {' '.join(mutant.caught_by)} "
        f"(pytest exit {run.returncode}):\n{tail}"
    )
