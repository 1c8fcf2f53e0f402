# SPDX-License-Identifier: Apache-2.0
"""Fixtures for e2e tests: the prompt set and a single engine's reference outputs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_helpers import deployment, make_prompts, run_all

from vllm_ext.launch.pd import PDConfig, PDDeployment


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return make_prompts()


@pytest.fixture(scope="session")
def single_engine(tiny_model: Path, tmp_path_factory) -> Iterator[PDDeployment]:
    """One plain engine (same core count as each P/D engine), started once for every
    reference output of the session (it idles between them)."""
    cfg = PDConfig(mode="single", model=str(tiny_model), run_dir=tmp_path_factory.mktemp("single"))
    with PDDeployment(cfg) as dep:
        yield dep


@pytest.fixture(scope="session")
def push_1p1d(tiny_model: Path, tmp_path_factory) -> Iterator[PDDeployment]:
    """One push 1P1D (our proxy, test timeouts) for every module that only sends it
    requests (engines start in ~70 s here, so once)."""
    yield from deployment("push", tiny_model, tmp_path_factory.mktemp("push"))


@pytest.fixture(scope="session")
def reference(single_engine: PDDeployment, prompts: list[list[int]]) -> list[list[int]]:
    """Outputs of one plain engine for the prompt set."""
    return run_all(single_engine.url, prompts, concurrency=1)
