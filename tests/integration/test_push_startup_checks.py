# SPDX-License-Identifier: Apache-2.0
"""What the connector refuses or warns about when an engine starts: a misspelt key of
``kv_connector_extra_config`` and the side-channel address the engine announces
(real vLLM ``Scheduler`` and workers building the connector, fake NIXL)."""

from __future__ import annotations

import pytest
from push_harness import PushEnv, capture_logs
from vllm import envs

from vllm_ext.nixl_push.config import PushConfigError


@pytest.mark.timeout(60)
@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_a_misspelt_key_stops_the_engine_with_the_valid_keys(env: PushEnv, role: str) -> None:
    with pytest.raises(PushConfigError) as e:
        env.engine("X", role, extra_config={"push_write_timout_s": 5})  # type: ignore[arg-type]
    msg = str(e.value)
    assert "unknown key(s) 'push_write_timout_s' (did you mean 'push_write_timeout_s'?)" in msg
    assert "push_quarantine_s" in msg.split("keys are:", 1)[1]


@pytest.mark.timeout(60)
def test_a_loopback_side_channel_warns_once_per_engine_and_the_push_runs(env: PushEnv) -> None:
    with capture_logs("vllm.ext.nixl_push.connector") as records:
        env.pair({"tp": 2}, {"tp": 2})  # the harness announces 127.0.0.1
    warned = [r.getMessage() for r in records if "loopback" in r.getMessage()]
    assert len(warned) == 2, warned  # P and D: their scheduler halves, not every rank
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST='127.0.0.1' is a loopback address" in warned[0]


@pytest.mark.timeout(60)
def test_an_unspecified_side_channel_host_stops_the_engine(
    env: PushEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(envs, "VLLM_NIXL_SIDE_CHANNEL_HOST", "0.0.0.0", raising=False)
    with pytest.raises(PushConfigError, match="binds every interface"):
        env.engine("X", "kv_consumer")


@pytest.mark.timeout(60)
def test_a_write_timeout_not_below_twice_the_tcp_user_timeout_stops_a_producer(
    env: PushEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """N-REL-2: P counts a WRITE NIXL failed ended 2 x its TCP user timeout after the
    error, which is safe only if P gives a WRITE up before that. A producer whose
    push_write_timeout_s is not below stops at startup (the timeout from its config or
    from UCX_TCP_USER_TIMEOUT, which wins); a consumer, which writes nothing, starts."""
    bad = {"ucx_tcp_user_timeout_s": 10, "push_write_timeout_s": 20}
    with pytest.raises(PushConfigError) as e:
        env.engine("P", "kv_producer", extra_config=bad)
    assert "['push_write_timeout_s']=20 must be less than 2 x the TCP user timeout" in str(e.value)
    monkeypatch.setenv("UCX_TCP_USER_TIMEOUT", "5s")
    good_in_config = {"ucx_tcp_user_timeout_s": 30, "push_write_timeout_s": 20}
    with pytest.raises(PushConfigError, match=r"UCX_TCP_USER_TIMEOUT='5s' in the environment: 5s"):
        env.engine("P2", "kv_producer", extra_config=good_in_config)
    monkeypatch.delenv("UCX_TCP_USER_TIMEOUT")
    env.engine("P3", "kv_producer", extra_config=good_in_config)
    env.engine("D", "kv_consumer", extra_config=bad)
