# SPDX-License-Identifier: Apache-2.0
"""Our push connector on vLLM 0.34.0 with real engines: a 1P1D push deployment answers
what one 0.34.0 engine answers. The 0.34.0 CPU env (docs/environments.md) has no
triton-cpu, and vLLM 0.34.0 refuses to configure an engine on an x86 CPU without it, so
no engine starts there: a strict xfail on exactly that, which turns into a failure
(XPASS) the day the env can serve."""

from __future__ import annotations

from pathlib import Path

import pytest
from pd_helpers import deployment, run_all
from support import pin_python

from devkit.launch.pd import PDConfig, PDDeployment
from devkit.launch.process import ProcessDied

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PIN = "0.34.0"
#: What vLLM 0.34.0 says (``CpuPlatform.check_and_update_config``) on an x86 CPU.
NO_TRITON_CPU = "vLLM on x86 CPUs requires Triton (triton-cpu)."


@pytest.mark.xfail(
    strict=True,
    raises=ProcessDied,
    reason=f"vLLM 0.34.0's CPU env has no triton-cpu: {NO_TRITON_CPU}",
)
def test_push_outputs_equal_single_engine_on_034(
    tiny_model: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    py = str(pin_python(PIN))
    try:
        cfg = PDConfig(mode="single", model=str(tiny_model), run_dir=tmp_path / "one", python=py)
        with PDDeployment(cfg) as one:
            reference = run_all(one.url, prompts, concurrency=1)
    except ProcessDied as e:
        assert NO_TRITON_CPU in str(e), str(e)[-2000:]  # any other death is a failure
        raise
    for dep in deployment(
        "push", tiny_model, tmp_path / "push", python=py, connector="ExtNixlPushConnector"
    ):
        assert run_all(dep.url, prompts, concurrency=1) == reference
        assert run_all(dep.url, prompts, concurrency=4) == reference
