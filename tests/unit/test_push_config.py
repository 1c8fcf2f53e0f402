# SPDX-License-Identifier: Apache-2.0
"""``kv_connector_extra_config`` -> ``PushConfig``: defaults, every key, clear errors."""

from __future__ import annotations

import os

import pytest

from vllm_ext import compat
from vllm_ext.nixl_push.config import (
    DEFAULT_DECODER_KV_BLOCKS_TTL,
    DEVICE_DEFAULTS,
    OUR_KEYS,
    RENAMED_KEYS,
    PushConfig,
    PushConfigError,
    check_side_channel_host,
)


def test_defaults() -> None:
    c = PushConfig.from_extra_config(None)
    assert c == PushConfig()
    # vLLM's decoder_kv_blocks_ttl (test_push_scheduler checks vLLM's default is this)
    assert c.push_registration_timeout_s == DEFAULT_DECODER_KV_BLOCKS_TTL
    assert c.push_at_forward_end and c.ucx_use_mt_mutex and c.keep_cpu_affinity
    assert c.push_prepare_at_announce and c.push_recv_idle_wait_ms == 0.0
    assert c.push_handover_wait_ms == 5.0 and c.nixl_progress_delay_us == 100
    assert c.push_write_timeout_s == 30.0
    assert c.push_answer_sequential_legs and not c.push_progressive
    assert c.push_heartbeat_timeout_s == 30.0 >= 2 * c.heartbeat_interval


def test_derived_bounds() -> None:
    c = PushConfig.from_extra_config(
        {
            "push_registration_timeout_s": 60,
            "push_cancel_answer_timeout_s": 8,
            "push_write_timeout_s": 5,
        }
    )
    assert c.heartbeat_interval == 2.0  # a quarter of the shorter of D's two waits
    assert c.write_release_bound == 5.0
    assert c.lease_overrun == 10.0  # a WRITE's deadline, then its release bound
    slow = PushConfig.from_extra_config({"push_cancel_answer_timeout_s": 120})
    assert slow.heartbeat_interval == 30.0 and slow.push_heartbeat_timeout_s == 60.0


def test_a_gpu_engine_gets_gpu_defaults_and_set_keys_still_win() -> None:
    cpu, gpu = PushConfig.from_extra_config(None), PushConfig.from_extra_config(None, "cuda")
    assert not cpu.cross_layer_blocks and cpu.device == "cpu"
    assert gpu.device == "cuda"
    for key, value in DEVICE_DEFAULTS["cuda"].items():
        field = "cross_layer_blocks" if key == "enable_cross_layers_blocks" else key
        assert getattr(gpu, field) == value != getattr(cpu, field), key
    # the fields no device overrides are the same
    assert gpu.push_recv_idle_wait_ms == cpu.push_recv_idle_wait_ms
    mine = PushConfig.from_extra_config(
        {"push_handover_wait_ms": 2, "enable_cross_layers_blocks": "False"}, "cuda"
    )
    assert mine.push_handover_wait_ms == 2.0 and not mine.cross_layer_blocks
    assert PushConfig.from_extra_config({"enable_cross_layers_blocks": "true"}).cross_layer_blocks


def test_every_key() -> None:
    c = PushConfig.from_extra_config(
        {
            "decoder_kv_blocks_ttl": 60,
            "push_writer_poll_interval_ms": "0.5",
            "nixl_progress_delay_us": None,
            "push_cancel_answer_timeout_s": 3,
            "keep_cpu_affinity": False,
            "push_at_forward_end": False,
            "push_handover_wait_ms": 0,
            "ucx_use_mt_mutex": False,
            "push_prepare_at_announce": False,
            "push_recv_idle_wait_ms": 2,
            "push_write_timeout_s": "12.5",
            "push_heartbeat_timeout_s": 0,
            "push_progressive": True,
        }
    )
    assert c.push_registration_timeout_s == 60.0  # follows decoder_kv_blocks_ttl
    assert c.push_writer_poll_interval_ms == 0.5 and c.nixl_progress_delay_us is None
    assert c.push_cancel_answer_timeout_s == 3.0 and not c.keep_cpu_affinity
    assert not c.push_at_forward_end and c.push_handover_wait_ms == 0.0
    assert not c.ucx_use_mt_mutex and not c.push_prepare_at_announce
    assert c.push_recv_idle_wait_ms == 2.0
    assert c.push_write_timeout_s == 12.5
    assert c.push_heartbeat_timeout_s == 0.0  # off: only the watchdog
    assert c.push_progressive


@pytest.mark.parametrize(
    "extra,key",
    [
        ({"push_at_forward_end": "yes"}, "push_at_forward_end"),
        ({"ucx_use_mt_mutex": 1}, "ucx_use_mt_mutex"),
        ({"push_prepare_at_announce": "no"}, "push_prepare_at_announce"),
        ({"push_recv_idle_wait_ms": -0.5}, "push_recv_idle_wait_ms"),
        ({"push_recv_idle_wait_ms": 2000}, "push_recv_idle_wait_ms"),
        ({"keep_cpu_affinity": None}, "keep_cpu_affinity"),
        ({"push_handover_wait_ms": -1}, "push_handover_wait_ms"),
        ({"push_handover_wait_ms": 5000}, "push_handover_wait_ms"),
        ({"push_handover_wait_ms": "soon"}, "push_handover_wait_ms"),
        ({"push_writer_poll_interval_ms": 0}, "push_writer_poll_interval_ms"),
        ({"push_registration_timeout_s": 0}, "push_registration_timeout_s"),
        ({"push_write_timeout_s": 0}, "push_write_timeout_s"),
        ({"push_write_timeout_s": "never"}, "push_write_timeout_s"),
        ({"push_answer_sequential_legs": "false"}, "push_answer_sequential_legs"),
        ({"push_answer_sequential_legs": 0}, "push_answer_sequential_legs"),
        ({"push_heartbeat_timeout_s": -1}, "push_heartbeat_timeout_s"),
        ({"push_progressive": "true"}, "push_progressive"),
        # shorter than two heartbeat intervals (2.5 s each by default): every request
        # would be cancelled between two renewals
        ({"push_heartbeat_timeout_s": 4.9}, "push_heartbeat_timeout_s"),
    ],
)
def test_bad_values_name_the_key(extra: dict, key: str) -> None:
    with pytest.raises(PushConfigError, match=key):
        PushConfig.from_extra_config(extra)


@pytest.mark.parametrize(
    "key,hint",
    [
        ("push_write_timout_s", "did you mean 'push_write_timeout_s'?"),  # misspelt
        ("push_made_up", None),  # our prefix, no such key
        ("ucx_tcp_timeout_s", None),
        ("keep_cpu_afinity", "did you mean 'keep_cpu_affinity'?"),  # not our prefix, close
    ],
)
def test_an_unknown_key_of_ours_stops_the_engine_with_the_valid_ones(key: str, hint) -> None:
    with pytest.raises(PushConfigError) as e:
        PushConfig.from_extra_config({key: 1, "push_write_timeout_s": 5})
    msg = str(e.value)
    assert f"unknown key(s) {key!r}" in msg
    assert hint is None or hint in msg
    for valid in OUR_KEYS:  # the whole list, to pick from
        assert valid in msg.split("keys are:", 1)[1]
    assert "device" not in msg.split("keys are:", 1)[1].split(", ")


def test_keys_of_vllm_and_other_connectors_pass() -> None:
    c = PushConfig.from_extra_config(
        {"backends": ["UCX"], "kv_lease_duration": 8, "enable_permute_local_kv": False,
         "decoder_kv_blocks_ttl": 60, "enable_cross_layers_blocks": "true"}
    )  # fmt: skip
    assert c.push_registration_timeout_s == 60.0 and c.cross_layer_blocks


def test_old_key_names_still_work_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    assert all(new == old + "_s" for old, new in RENAMED_KEYS.items())
    old = {k: 7 for k in RENAMED_KEYS} | {"push_heartbeat_timeout": 0}
    with caplog.at_level("WARNING"):
        c = PushConfig.from_extra_config(old)
    assert c == PushConfig.from_extra_config({RENAMED_KEYS[k]: v for k, v in old.items()})
    assert c.push_write_timeout_s == 7.0 and c.push_heartbeat_timeout_s == 0.0
    warned = caplog.text
    for k, new in RENAMED_KEYS.items():
        assert f"[{k!r}] is deprecated: it is now {new!r}" in warned
    with pytest.raises(PushConfigError, match="sets both 'push_write_timeout' and"):
        PushConfig.from_extra_config({"push_write_timeout": 1, "push_write_timeout_s": 2})


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]"])
def test_an_unspecified_side_channel_host_is_refused(host: str) -> None:
    with pytest.raises(PushConfigError, match="binds every interface"):
        check_side_channel_host(host)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.1.1"])
def test_a_loopback_side_channel_host_warns_one_host_only(host: str) -> None:
    warning = check_side_channel_host(host)
    assert warning is not None and "only between engines on this host" in warning


@pytest.mark.parametrize("host", ["10.0.0.10", "fd00::5", "prefill-0.pd.svc"])
def test_a_reachable_side_channel_host_passes(host: str) -> None:
    assert check_side_channel_host(host) is None


def test_ucx_mt_mutex_sets_the_variable_only_inside_and_never_overrides(monkeypatch) -> None:
    monkeypatch.delenv(compat.UCX_MT_MUTEX_ENV, raising=False)
    with compat.ucx_mt_mutex(True):
        assert os.environ[compat.UCX_MT_MUTEX_ENV] == "y"
    assert compat.UCX_MT_MUTEX_ENV not in os.environ
    with compat.ucx_mt_mutex(False):
        assert compat.UCX_MT_MUTEX_ENV not in os.environ
    monkeypatch.setenv(compat.UCX_MT_MUTEX_ENV, "n")  # the user's choice wins
    with compat.ucx_mt_mutex(True):
        assert os.environ[compat.UCX_MT_MUTEX_ENV] == "n"
    assert os.environ[compat.UCX_MT_MUTEX_ENV] == "n"


def test_a_write_timeout_not_below_twice_the_tcp_user_timeout_is_refused() -> None:
    """N-REL-2's hold (2 x T) bounds a failed WRITE only if P gives up on a WRITE before
    that: a config that does not is refused, naming both values, the rule and the fix."""
    from vllm_ext.nixl_push.config import check_write_timeout

    cfg = PushConfig.from_extra_config({"push_write_timeout_s": 20})
    with pytest.raises(PushConfigError) as e:
        check_write_timeout(cfg, 10, "ucx_tcp_user_timeout_s")
    msg = str(e.value)
    assert "['push_write_timeout_s']=20 must be less than 2 x the TCP user timeout" in msg
    assert "(ucx_tcp_user_timeout_s: 10s, so less than 20s)" in msg
    assert "Set push_write_timeout_s below 20, or raise the TCP user timeout above 10s" in msg
    check_write_timeout(cfg, 10.5, "ucx_tcp_user_timeout_s")
    check_write_timeout(cfg, 0, "ucx_tcp_user_timeout_s")  # unbounded: warned of on its own
    check_write_timeout(PushConfig.from_extra_config({}), 30, "ucx_tcp_user_timeout_s")


def test_push_peer_hosts_limits_the_d_hosts_p_connects_to() -> None:
    """P connects only to D hosts among ``push_peer_hosts`` (addresses, CIDR networks, host
    names) when set: a PUSH_REG or PUSH_CANCEL naming another host gets no connection."""
    any_host = PushConfig.from_extra_config({})
    assert any_host.allows_peer_host("203.0.113.9") and any_host.allows_peer_host("x.example")
    cfg = PushConfig.from_extra_config(
        {"push_peer_hosts": ["10.1.0.0/16", "192.0.2.7", "decode-0.decode.svc", "fd00::/8"]}
    )
    assert cfg.allows_peer_host("10.1.200.3") and cfg.allows_peer_host("192.0.2.7")
    assert cfg.allows_peer_host("Decode-0.decode.svc") and cfg.allows_peer_host("fd00::1")
    for outside in ("10.2.0.1", "192.0.2.8", "127.0.0.1", "evil.example", "::1"):
        assert not cfg.allows_peer_host(outside), outside
    for bad in ("10.0.0.0/8", [""], [3]):
        with pytest.raises(PushConfigError, match="push_peer_hosts"):
            PushConfig.from_extra_config({"push_peer_hosts": bad})
