# SPDX-License-Identifier: Apache-2.0
"""Patch 0001 on the patched 0.23.0: the scheduler and the EngineCore busy loop keep
stepping while the KV connector has push work in flight, then idle."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import psutil
import pytest

HERE = Path(__file__).resolve().parent
CONNECTOR = {
    "kv_connector": "PushWorkConnector",
    "kv_connector_module_path": "push_work_connector",  # tests/patches/ on sys.path
    "kv_role": "kv_both",
}
BLOCK_SIZE = 128


def _vllm_config(model: Path, extra: dict | None = None):
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    return VllmConfig(
        model_config=ModelConfig(model=str(model), enforce_eager=True, max_model_len=512),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=512,
            max_model_len=512,
            is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=True,
        ),
        kv_transfer_config=KVTransferConfig(**CONNECTOR, kv_connector_extra_config=extra or {}),
    )


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_scheduler_has_requests_while_push_work_pending(tiny_model: Path) -> None:
    import torch
    from push_work_connector import PushWorkConnector
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config = _vllm_config(tiny_model)
    vllm_config.cache_config.num_gpu_blocks = 16
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64,
                             dtype=torch.bfloat16)  # fmt: skip
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=KVCacheConfig(
            num_blocks=16,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
        ),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
    )
    connector = scheduler.get_kv_connector()
    assert isinstance(connector, PushWorkConnector)

    assert not scheduler.has_requests()  # no request, no push work: idle
    connector.pending_steps = 3
    for _ in range(3):  # no request exists, yet the engine must keep stepping
        assert scheduler.get_num_unfinished_requests() == 0
        assert scheduler.has_requests()
        assert scheduler.schedule().total_num_scheduled_tokens == 0
    assert not scheduler.has_requests()  # the work cleared: idle again

    # Requests still count on their own.
    scheduler.add_request(
        Request("r0", [1, 2, 3], SamplingParams(max_tokens=1), pooling_params=None)
    )
    assert not scheduler.has_pending_push_work() and scheduler.has_requests()


def _events(report: Path) -> list[dict]:
    if not report.exists():
        return []
    return [json.loads(line) for line in report.read_text().splitlines()]


def _wait_idle(report: Path, quiet_s: float = 2.0, timeout_s: float = 60.0) -> list[dict]:
    """Wait until the engine stops stepping (no new event for ``quiet_s``)."""
    deadline = time.monotonic() + timeout_s
    seen, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = len(_events(report))
        if n != seen:
            seen, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return _events(report)
        time.sleep(0.1)
    raise AssertionError(f"the engine kept stepping for {timeout_s} s: {_events(report)[-5:]}")


def _run(engine, request_id: str, push_steps: int) -> None:
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=2, temperature=0.0,
        extra_args={"kv_transfer_params": {"push_steps": push_steps}},
    )  # fmt: skip
    engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(range(10, 40))), params)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(o.request_id == request_id and o.finished for o in engine.step()):
            return
    raise AssertionError(f"request {request_id} did not finish")


def _trailing_steps(events: list[dict]) -> list[dict]:
    """The scheduler steps after the last step that ran the model."""
    steps = [e for e in events if e["event"] == "schedule"]
    last = max(i for i, e in enumerate(steps) if e["tokens"] > 0)
    return steps[last + 1 :]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_engine_core_loop_steps_until_push_work_clears(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real EngineCore process (its real busy loop) with the test connector."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    push_steps = 5
    report = tmp_path / "steps.jsonl"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    engine = None
    try:
        engine = LLMEngine.from_engine_args(
            EngineArgs(
                model=str(tiny_model),
                enforce_eager=True,
                max_model_len=512,
                max_num_seqs=4,
                disable_hybrid_kv_cache_manager=True,
                disable_log_stats=True,
                kv_transfer_config=KVTransferConfig(
                    **CONNECTOR, kv_connector_extra_config={"report": str(report)}
                ),
            ),
            enable_multiprocessing=True,
        )
        # Started and idle: the loop waits for input, no step at all.
        assert [e for e in _wait_idle(report, 1.0) if e["event"] == "schedule"] == []

        # A request whose finish leaves push work in flight for `push_steps` steps.
        _run(engine, "with-push", push_steps)
        events = _wait_idle(report)
        trailing = _trailing_steps(events)
        assert [e["pending"] for e in trailing] == list(range(push_steps, 0, -1)), trailing
        assert all(e["tokens"] == 0 for e in trailing)
        # The worker side ran in every step (get_finished via kv_connector_no_forward).
        steps = [e for e in events if e["event"] == "schedule"]
        assert len([e for e in events if e["event"] == "worker"]) >= len(steps)
        # Empty steps are paced by the 1 ms sleep, not a hot loop, and then it idles.
        assert trailing[-1]["t"] - trailing[0]["t"] >= 0.001 * (push_steps - 1)

        # Control: the same request without push work leaves at most the one step
        # that returns the finished request id.
        n = len(events)
        _run(engine, "without-push", 0)
        control = _trailing_steps(_wait_idle(report)[n:])
        assert len(control) <= 1 and all(e["pending"] == 0 for e in control)
    finally:
        if engine is not None:
            engine.engine_core.shutdown()
        for child in psutil.Process().children(recursive=True):
            if child.pid not in before:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
