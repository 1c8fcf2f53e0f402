# SPDX-License-Identifier: Apache-2.0
"""A P at TP 2 behind a proxy not told P's TP size (S-LEG-5), on real vLLM CPU engines.

The proxy's ``--p-tp-size`` defaults to 1, so a proxy started without it puts
``tp_size: 1`` in every D leg for a P that runs two TP ranks. D takes P's layout
from P's side channel, so each such request fails with an error that names both
sizes; none is answered 200 with another output than one engine's. The same
engines behind a proxy told ``--p-tp-size 2`` then serve outputs equal to one
engine's: nothing of the refused requests stayed behind in D's connections.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_helpers import deployment

from vllm_ext.launch.client import complete
from vllm_ext.launch.pd import PDDeployment
from vllm_ext.launch.process import ManagedProcess, free_port, wait_http_ready

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

#: One OMP thread per P TP rank, both on core 0 (P's processes are pinned there).
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|0"}


@pytest.fixture(scope="module")
def push_p_tp2(tiny_model: Path, tmp_path_factory) -> Iterator[PDDeployment]:
    # The launcher passes --p-tp-size only for GPU runs: its proxy here is the slip.
    yield from deployment(
        "push",
        tiny_model,
        tmp_path_factory.mktemp("push-p-tp2"),
        p_cpu=0,
        p_extra_args=["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"],
        p_extra_env=TP_ENV,
    )


def _proxy_told_tp(dep: PDDeployment, run_dir: Path) -> tuple[ManagedProcess, str]:
    assert dep.prefill is not None and dep.decode is not None
    port = free_port()
    argv = [
        sys.executable, "-m", "vllm_ext.proxy",
        "--prefill", dep.prefill.url, "--decode", dep.decode.url, "--mode", "push",
        "--p-engine-id", dep.p_engine_id,
        "--p-side-channel-port", str(dep.prefill.spec.side_channel_port),
        "--p-tp-size", "2", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    proc = ManagedProcess("proxy-tp2", argv, run_dir / "proxy-tp2.log")
    url = f"http://127.0.0.1:{port}"
    wait_http_ready(f"{url}/health", 60, proc)
    return proc, url


def test_a_proxy_not_told_ps_tp_gets_errors_never_wrong_outputs(
    push_p_tp2: PDDeployment, prompts: list[list[int]], reference: list[list[int]], tmp_path: Path
) -> None:
    wrong, refused = [], 0
    for prompt, expected in zip(prompts, reference):
        try:
            out = complete(push_p_tp2.url, prompt, max_tokens=len(expected), timeout=120)
        except Exception:  # an HTTP error or a stream that ends with an error
            refused += 1
            continue
        if out.token_ids != expected:
            wrong.append((len(prompt), out.token_ids, expected))
    assert not wrong, f"answered with another output than one engine's: {wrong}"
    decode_log = (push_p_tp2.cfg.run_dir / "decode.log").read_text(errors="replace")
    assert "tp_size=1, but P" in decode_log and "announces tensor parallel size 2" in decode_log
    # A 1-token prompt needs no KV from P (no block to push), so it may be served.
    assert refused >= len([p for p in prompts if len(p) > 1])
    proc, url = _proxy_told_tp(push_p_tp2, tmp_path)
    try:
        for prompt, expected in zip(prompts, reference):
            assert complete(url, prompt, max_tokens=len(expected)).token_ids == expected
    finally:
        proc.stop()
