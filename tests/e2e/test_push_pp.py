# SPDX-License-Identifier: Apache-2.0
"""Push from a pipeline-parallel producer (S-PP-1..3) on real vLLM 0.23.0 CPU engines.

P runs the tiny 4-layer model with ``--pipeline-parallel-size 2`` (the ``mp``
executor; stage 0 owns layers 0-1, stage 1 layers 2-3); D runs it with PP=1.
Both stages share core 0 and D has core 1: a PP engine's stage workers spin
(``sched_yield``) between steps while P holds blocks for a push, and a stage on
D's core starved D's handshake and side channel for seconds (measured here).
Each stage WRITEs its own layers into D's member-ordered regions (member
routing by ``region_members``); D connects both stages and waits for a
completion from each. D's output following the pushed KV is shown by
test_kv_dependence.py, so equality with a single engine means every layer's KV
landed in the right place.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_helpers import (
    deployment,
    local_prompt_tokens,
    make_prompts,
    metric,
    run_all,
    scrape_metrics,
)

from devkit.launch.client import complete
from devkit.launch.engine import EngineSpec, start_engine
from devkit.launch.pd import PDDeployment
from devkit.launch.process import ProcessDied

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

#: One OMP thread per P stage, both on core 0 (P's processes are pinned there).
PP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|0"}


@pytest.fixture(scope="module")
def push_pp(tiny_model: Path, tmp_path_factory) -> Iterator[PDDeployment]:
    yield from deployment(
        "push",
        tiny_model,
        tmp_path_factory.mktemp("push-pp"),
        p_pp_size=2,
        p_cpu=0,
        p_extra_env=PP_ENV,
    )


def _log(dep: PDDeployment, name: str) -> str:
    return (dep.cfg.run_dir / f"{name}.log").read_text(errors="replace")


def test_pp2_producer_outputs_equal_single_engine(push_pp, prompts, reference) -> None:
    before = scrape_metrics(push_pp.prefill.url)
    assert run_all(push_pp.url, prompts, concurrency=1) == reference
    after = scrape_metrics(push_pp.prefill.url)

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    # One WRITE per stage per request (a 1-token prompt needs no block: completion only).
    assert delta("vllm:ext_push_writes_total") >= 2 * (len(prompts) - 1)
    kv_per_token = 2 * 2 * 64 * 2 * 4  # K+V x 2 KV heads x head dim 64 x bf16 x 4 layers
    full = sum(len(p) for p in prompts if len(p) >= 128)
    assert delta("vllm:ext_push_bytes_total") >= kv_per_token * full * 0.9


def test_pp2_producer_concurrency_4(push_pp, prompts, reference) -> None:
    assert run_all(push_pp.url, prompts, concurrency=4) == reference


def test_decode_computes_no_prompt_tokens(push_pp) -> None:
    prompts = make_prompts(seed=77)

    def send() -> None:
        for p in prompts:
            complete(push_pp.url, p, max_tokens=2)

    assert local_prompt_tokens(push_pp.decode.url, send) <= len(prompts)


def test_each_stage_routes_by_member_and_d_connects_both(push_pp) -> None:
    p_log, d_log = _log(push_pp, "prefill"), _log(push_pp, "decode")
    # Both stage workers derived a member layout of their own two layers.
    routing = "routing KV by layer (pipeline-parallel producer (2 stages)): 2 members in 2 regions"
    assert p_log.count(routing) == 2, p_log[-3000:]
    # D connected stage 0 (side-channel rank 0) and stage 1 (rank 1), two regions each.
    for rank in (0, 1):
        assert f"push: connected {push_pp.p_engine_id} rank {rank}/1 (2 regions" in d_log


def test_wrong_pp_size_fails_only_that_request(push_pp, prompts) -> None:
    """A D leg claiming P has one stage: D knows better from P's side channel."""
    p_engine = push_pp.prefill
    assert p_engine is not None and push_pp.decode is not None
    body = {
        "model": "tiny",
        "prompt": prompts[2],
        "max_tokens": 2,
        "temperature": 0,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "remote_engine_id": push_pp.p_engine_id,
            "remote_host": "127.0.0.1",
            "remote_port": p_engine.spec.side_channel_port,
            "tp_size": 1,
            "pp_size": 1,
        },
    }
    req = urllib.request.Request(
        f"{push_pp.decode.url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        assert out["choices"][0]["finish_reason"] not in ("length", "stop"), out
    except urllib.error.HTTPError as e:
        assert e.code >= 400
    assert "pp_size=1, but P" in _log(push_pp, "decode")
    # ... and the pair still serves.
    assert complete(push_pp.url, prompts[1], max_tokens=2).token_ids


def test_decode_side_pp_is_refused_at_startup(tiny_model: Path, tmp_path: Path) -> None:
    spec = EngineSpec(
        name="decode-pp",
        model=str(tiny_model),
        kv_transfer_config={
            "kv_connector": "NixlPushConnector",
            "kv_role": "kv_consumer",
            "kv_buffer_device": "cpu",
            "engine_id": "decode-pp",
        },
        extra_args=["--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp"],
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    engine = start_engine(spec, tmp_path)
    try:
        with pytest.raises(ProcessDied):
            engine.wait_ready(timeout=300)
    finally:
        engine.stop()
    log = (tmp_path / "decode-pp.log").read_text(errors="replace")
    assert "decode-side pipeline parallelism is not implemented" in log, log[-3000:]
