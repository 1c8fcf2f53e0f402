# SPDX-License-Identifier: Apache-2.0
"""A D does not pair with a P whose model computes other KV (S-LEG-6): real push
workers and schedulers, fake NIXL. vLLM's handshake hash cannot tell two models apart
that share name, dtype and shapes; the identity each side channel announces can."""

from __future__ import annotations

from typing import Any

import pytest
from push_harness import PushEnv, assert_kv_pushed, block_pairs, capture_logs
from vllm.v1.request import RequestStatus

from vllm_ext import compat


def _prompt(n: int = 40) -> list[int]:
    return [(i * 13) % 1000 + 3 for i in range(n)]


def _refused(env: PushEnv, p: Any, d: Any, tag: str) -> str:
    """Send one request pair from ``p`` to ``d``; it must fail on D, nothing written:
    D's log line for it."""
    bad_id = f"cmpl-{tag}-0-bbbbbbbb"
    with capture_logs("vllm.ext.nixl_push.writer") as logs:
        d.add_request(bad_id, _prompt(), p.d_leg(), max_tokens=2)
        p.add_request(f"cmpl-{tag}-0-aaaaaaaa", _prompt(), p.p_leg())
        env.run_until(lambda: bad_id in d.finished, what="the request fails")
    assert d.finished[bad_id].status == RequestStatus.FINISHED_ERROR
    assert not env.fabric.transfers()
    (failure,) = {r.getMessage() for r in logs if bad_id in r.getMessage()}
    return failure


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "key, value, named",
    [
        ("weights", "0123456789abcdef", "weight files: 0123456789abcdef there"),
        ("config", "fedcba9876543210", "model configuration"),
    ],
)
def test_d_does_not_pair_with_a_p_whose_model_computes_other_kv(
    env: PushEnv, monkeypatch: pytest.MonkeyPatch, key: str, value: str, named: str
) -> None:
    """P announces another weights (or configuration) digest: D's request fails, its
    log names what differs, nothing is written; a P with D's identity then pushes."""
    real = compat.model_identity
    monkeypatch.setattr(compat, "model_identity", lambda cfg: {**real(cfg), key: value})
    other = env.engine("P-other", "kv_producer")
    monkeypatch.setattr(compat, "model_identity", real)
    p, d = env.pair()
    failure = _refused(env, other, d, "model")
    assert "computes other KV than this engine" in failure and named in failure
    assert not d.workers[0].remote_agents_of("P-other")
    good_id, p_id = "cmpl-same-0-bbbbbbbb", "cmpl-same-0-aaaaaaaa"
    d.add_request(good_id, _prompt(), p.d_leg())
    p.add_request(p_id, _prompt(), p.p_leg())
    env.run_until(lambda: good_id in d.finished, what="the push with P's own model")
    assert d.finished[good_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    fin, reg = p.finished_meta(p_id), d.reg_meta(good_id)
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))


@pytest.mark.timeout(60)
def test_d_does_not_pair_with_a_p_whose_kv_blocks_are_laid_out_otherwise(env: PushEnv) -> None:
    """P's handshake metadata names its KV cache layout (vLLM's ``kv_cache_layout``: where
    each head and token sits in a block); D's differs (``VLLM_KV_CACHE_LAYOUT`` set on
    one side, say): the same bytes would mean other positions, so D refuses P, naming
    both layouts, and nothing is written."""
    p, d = env.pair()
    w = d.workers[0]
    w.kv_cache_layout = w.host_buffer_kv_cache_layout = "XHNDX"
    failure = _refused(env, p, d, "layout")
    assert "lays its KV blocks out as" in failure and "this engine as XHNDX" in failure
