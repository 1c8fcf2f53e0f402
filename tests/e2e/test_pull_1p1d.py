# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.23.0's own pull NixlConnector, 1P1D on CPU (needs patch 0003; the pull baseline)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_helpers import deployment, run_all

from devkit.launch.pd import PDDeployment

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def pull(tiny_model: Path, tmp_path_factory) -> Iterator[PDDeployment]:
    yield from deployment("pull", tiny_model, tmp_path_factory.mktemp("pull"))


@pytest.mark.parametrize("concurrency", [1, 8])
def test_pull_outputs_equal_single_engine(pull, prompts, reference, concurrency) -> None:
    assert run_all(pull.url, prompts, concurrency=concurrency) == reference
