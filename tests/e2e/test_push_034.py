# SPDX-License-Identifier: Apache-2.0
"""Our push connector on vLLM 0.34.0 with real engines: a 1P1D push deployment answers
what one 0.34.0 engine answers, and D computes no prompt of its own. The 0.34.0 CPU env
(docs/environments.md) serves with vLLM 0.34.0's standalone CPU model runner and the
0.34.0 CPU kernels it needs, built from the release's sources (tools/cpu_standin.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from pd_helpers import (
    TEST_EXTRA_CONFIG,
    local_prompt_tokens,
    make_prompts,
    run_all,
    start_together,
)
from support import pin_python

from devkit.launch.client import complete
from devkit.launch.pd import PDConfig, PDDeployment

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PIN = "0.34.0"


def test_push_outputs_equal_single_engine_on_034(
    tiny_model: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    """The single engine starts beside P and D (on P's core: an engine's start keeps
    one core busy) and stops once it answered."""
    py = str(pin_python(PIN))
    one = PDDeployment(
        PDConfig(mode="single", model=str(tiny_model), d_cpu=0, run_dir=tmp_path / "one",
                 python=py)
    )  # fmt: skip
    push = PDDeployment(
        PDConfig(mode="push", model=str(tiny_model), run_dir=tmp_path / "push", python=py,
                 connector="ExtNixlPushConnector", extra_config=dict(TEST_EXTRA_CONFIG))
    )  # fmt: skip
    errors = start_together(one, push)
    try:
        for error in errors:
            if error is not None:
                raise error
        reference = run_all(one.url, prompts, concurrency=1)
        one.stop()
        assert run_all(push.url, prompts, concurrency=1) == reference
        assert run_all(push.url, prompts, concurrency=4) == reference
        # D computed none of new prompts but the last token of each: their KV was pushed
        fresh = make_prompts(seed=77)
        assert push.decode is not None
        sent = functools.partial(_complete_each, push.url, fresh)
        assert local_prompt_tokens(push.decode.url, sent) <= len(fresh)
    finally:
        one.stop()
        push.stop()


def _complete_each(url: str, prompts: list[list[int]]) -> None:
    for p in prompts:
        complete(url, p, max_tokens=2)
