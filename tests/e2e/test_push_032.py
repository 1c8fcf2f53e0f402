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


@pytest.mark.slow
def test_pp2_producer_outputs_equal_single_engine_on_032(
    tiny_model: Path, prompts, reference_032, tmp_path
) -> None:
    """A P at ``--pipeline-parallel-size 2`` (the ``mp`` executor; stage 0 holds layers
    0-1, stage 1 layers 2-3) behind the proxy, a D at PP=1, on vLLM 0.32.0: each stage
    WRITEs its own layers into D's. Both stages share core 0 (P's), as on 0.23.0
    (``test_push_pp.py`` says why). P runs compiled, not with ``--enforce-eager``: vLLM
    0.32.0's CPU worker skips its warm-up pass in eager mode, so a stage after the first
    never allocates its buffer of intermediate tensors and fails its first forward pass
    (``assert self.intermediate_tensors is not None``), with or without a connector."""
    py = str(pin_python(OTHER_PIN))
    for dep in deployment(
        "push", tiny_model, tmp_path / "push-pp", python=py, connector="ExtNixlPushConnector",
        p_pp_size=2, p_cpu=0, p_extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|0"},
        p_enforce_eager=False,
    ):  # fmt: skip
        assert run_all(dep.url, prompts, concurrency=1) == reference_032
        assert run_all(dep.url, prompts, concurrency=4) == reference_032
        d_log = (dep.cfg.run_dir / "decode.log").read_text(errors="replace")
        for rank in (0, 1):  # D connected stage 0 (rank 0) and stage 1 (rank 1)
            assert f"push: connected {dep.p_engine_id} rank {rank}/1 (2 regions" in d_log
