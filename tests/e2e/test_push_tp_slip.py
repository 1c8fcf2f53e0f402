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

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_helpers import deployment

from devkit.launch.client import SERVED_MODEL_NAME, complete
from devkit.launch.pd import PDDeployment
from devkit.launch.process import ManagedProcess, free_port, wait_http_ready

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


def _ask(url: str, prompt: list[int], max_tokens: int) -> tuple[str | None, list[int]]:
    """(finish reason, token ids) of one greedy completion; (None, []) for an HTTP error."""
    body = {
        "model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            choice = json.loads(r.read())["choices"][0]
    except urllib.error.HTTPError:
        return None, []
    return choice["finish_reason"], choice.get("token_ids") or []


def test_a_proxy_not_told_ps_tp_gets_errors_never_wrong_outputs(
    push_p_tp2: PDDeployment, prompts: list[list[int]], reference: list[list[int]], tmp_path: Path
) -> None:
    """Each request fails (vLLM's failed KV load: finish reason ``error``, no token, or an
    HTTP error); none finishes normally with another output than one engine's."""
    wrong, refused = [], 0
    for prompt, expected in zip(prompts, reference):
        finish, tokens = _ask(push_p_tp2.url, prompt, len(expected))
        if finish in ("length", "stop"):
            if tokens != expected:
                wrong.append((len(prompt), tokens, expected))
        else:
            assert not tokens, (finish, tokens)
            refused += 1
    assert not wrong, f"answered with another output than one engine's: {wrong}"
    decode_log = (push_p_tp2.cfg.run_dir / "decode.log").read_text(errors="replace")
    assert "tp_size=1, but P" in decode_log and "announces tensor parallel size 2" in decode_log
    assert refused == len(prompts)
    proc, url = _proxy_told_tp(push_p_tp2, tmp_path)
    try:
        for prompt, expected in zip(prompts, reference):
            assert complete(url, prompt, max_tokens=len(expected)).token_ids == expected
    finally:
        proc.stop()
