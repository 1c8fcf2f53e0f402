# SPDX-License-Identifier: Apache-2.0
"""Our push connector on vLLM 0.32.0 (``ExtNixlPushConnector``, beside vLLM's own
``NixlPushConnector``): a 1P1D push deployment answers what one 0.32 engine answers."""

from __future__ import annotations

from pathlib import Path

import pytest
from pd_helpers import OTHER_PIN, deployment, run_all
from support import pin_python

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def test_push_outputs_equal_single_engine_on_032(
    tiny_model: Path, prompts, reference_032, tmp_path
) -> None:
    """``reference_032``: one 0.32 engine's outputs (conftest.py starts that engine
    beside the session's single engine)."""
    py = str(pin_python(OTHER_PIN))
    for dep in deployment(
        "push", tiny_model, tmp_path / "push", python=py, connector="ExtNixlPushConnector"
    ):
        assert run_all(dep.url, prompts, concurrency=1) == reference_032
        assert run_all(dep.url, prompts, concurrency=4) == reference_032
