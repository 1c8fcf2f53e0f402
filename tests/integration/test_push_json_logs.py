# SPDX-License-Identifier: Apache-2.0
"""The connector's event lines as JSON (``VLLM_EXT_LOG_FORMAT=json``, docs/metrics.md):
the records real engines log carry the event and the request id, and the JSON handler
writes them as objects with those keys; with the variable set, the ``vllm.ext`` tree
writes JSON lines through vLLM's logging setup, one per record, vLLM's level kept.

Real vLLM Schedulers and connector workers over the fake NIXL fabric.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from push_harness import PushEnv, capture_logs
from test_push_failures import p_cannot_reach_d

from vllm_ext.log import json_handler

REPO = Path(__file__).resolve().parents[2]


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 37 + i * 13) % 1000 + 3 for i in range(n)]


@pytest.mark.timeout(120)
def test_push_events_carry_their_request_id_as_json(env: PushEnv) -> None:
    """P cannot reach D: P's handshake fails; D's request is quarantined (P never answers
    its cancel) until push_quarantine_s ends it. Each event names its own request."""
    p, d = p_cannot_reach_d(env)
    d_rid, p_rid = "cmpl-js-0-bbbbbbbb", "cmpl-js-0-aaaaaaaa"
    logs_of = ("vllm.ext.nixl_push.writes", "vllm.ext.nixl_push.recv")
    with capture_logs(*logs_of) as records:
        d.add_request(d_rid, _prompt(6), p.d_leg())
        p.add_request(p_rid, _prompt(6), p.p_leg())
        env.run_until(lambda: d.totals("push_quarantine_expired") == 1, what="quarantine ends")
    out = io.StringIO()
    handler = json_handler(out)
    for record in records:
        handler.handle(record)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == len(records)
    by_event = {line["event"]: line for line in lines if "event" in line}
    assert by_event["push_handshake_failed"]["request_id"] == p_rid
    assert by_event["push_quarantined"]["request_id"] == d_rid
    assert by_event["push_quarantined"]["producers"]  # the silent producer's agent
    expired = by_event["push_quarantine_expired"]
    assert expired["request_id"] == d_rid
    assert expired["level"] == "ERROR" and expired["logger"] == "vllm.ext.nixl_push.recv"
    assert d_rid in expired["message"] and "push_quarantine_s=0.5s" in expired["message"]


SCRIPT = """
import logging
from vllm_ext.log import event, get_logger
log = get_logger("vllm_ext.nixl_push.recv")
log.warning("push: %s: held", "rid-7", extra=event("push_quarantined", "rid-7", producers=["a"]))
log.debug("push: not shown at INFO")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["json", "text"])
def test_the_env_var_turns_the_connector_lines_into_json(fmt: str, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_EXT_LOG_FORMAT=fmt)
    env["VLLM_LOGGING_LEVEL"] = "INFO"
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
        cwd=tmp_path, timeout=110,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    ours = [line for line in (out.stdout + out.stderr).splitlines() if "rid-7" in line]
    assert len(ours) == 1, out.stdout + out.stderr  # once: not also through vLLM's handler
    assert "not shown" not in out.stdout + out.stderr  # vLLM's level holds
    if fmt == "text":
        with pytest.raises(ValueError):
            json.loads(ours[0])
        return
    line = json.loads(ours[0])
    assert line["event"] == "push_quarantined" and line["request_id"] == "rid-7"
    assert line["producers"] == ["a"] and line["message"] == "push: rid-7: held"
    assert line["level"] == "WARNING" and line["logger"] == "vllm.ext.nixl_push.recv"


def test_a_bad_format_is_refused_by_name() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_EXT_LOG_FORMAT="yaml")
    out = subprocess.run(
        [sys.executable, "-c", "from vllm_ext.log import get_logger; get_logger('x')"],
        capture_output=True, text=True, env=env, timeout=110,
    )  # fmt: skip
    assert out.returncode != 0
    assert "VLLM_EXT_LOG_FORMAT='yaml': expected one of text, json" in out.stderr
