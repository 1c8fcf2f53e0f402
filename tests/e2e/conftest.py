# SPDX-License-Identifier: Apache-2.0
"""Fixtures for e2e tests: the prompt set and a single engine's reference outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
from pd_helpers import make_prompts, run_all

from vllm_ext.launch.pd import PDConfig, PDDeployment


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return make_prompts()


@pytest.fixture(scope="session")
def reference(tiny_model: Path, prompts: list[list[int]], tmp_path_factory) -> list[list[int]]:
    """Outputs of one plain engine (same core count as each P/D engine)."""
    cfg = PDConfig(mode="single", model=str(tiny_model), run_dir=tmp_path_factory.mktemp("single"))
    with PDDeployment(cfg) as dep:
        return run_all(dep.url, prompts, concurrency=1)
