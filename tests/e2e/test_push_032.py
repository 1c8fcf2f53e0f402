# SPDX-License-Identifier: Apache-2.0
"""Our push connector on vLLM 0.32.0 (``ExtNixlPushConnector``, beside vLLM's own
``NixlPushConnector``): a 1P1D push deployment answers what one 0.32 engine answers."""

from __future__ import annotations

from pathlib import Path

import pytest
from pd_helpers import deployment, run_all
from support import pin_python

from vllm_ext.launch.pd import PDConfig, PDDeployment

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
PIN = "0.32.0"


def test_push_outputs_equal_single_engine_on_032(tiny_model: Path, prompts, tmp_path) -> None:
    py = str(pin_python(PIN))
    cfg = PDConfig(mode="single", model=str(tiny_model), run_dir=tmp_path / "single", python=py)
    with PDDeployment(cfg) as dep:
        reference = run_all(dep.url, prompts, concurrency=1)
    for dep in deployment(
        "push", tiny_model, tmp_path / "push", python=py, connector="ExtNixlPushConnector"
    ):
        assert run_all(dep.url, prompts, concurrency=1) == reference
        assert run_all(dep.url, prompts, concurrency=4) == reference
