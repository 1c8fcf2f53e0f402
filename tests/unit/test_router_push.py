# SPDX-License-Identifier: Apache-2.0
"""``RouterPushConnector``'s P answer: vLLM's pull answer turned into push's D-leg params,
which our D accepts as a push D leg (what vllm-router hands D verbatim)."""

from __future__ import annotations

from vllm_ext.bench.router_push import push_answer
from vllm_ext.nixl_push.metadata import DLegParams, is_push_d_leg, parse_d_leg

PULL_ANSWER = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": ([3, 4, 5],),
    "remote_engine_id": "P0",
    "remote_request_id": "___prefill_addr_x___decode_addr_y_abc-1a2b3c4d",
    "remote_host": "127.0.0.1",
    "remote_port": 5601,
    "tp_size": 1,
    "remote_num_tokens": 300,
}


def test_pull_answer_becomes_a_push_d_leg() -> None:
    out = push_answer(dict(PULL_ANSWER), pp_size=2)
    assert out == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "P0",
        "remote_host": "127.0.0.1",
        "remote_port": 5601,
        "tp_size": 1,
        "pp_size": 2,
    }
    assert is_push_d_leg(out)
    assert parse_d_leg(out) == DLegParams("P0", "127.0.0.1", 5601, 1, 2, None)


def test_other_answers_pass_unchanged() -> None:
    assert push_answer(None, 1) is None
    assert push_answer({}, 1) == {}
    d_side = {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [1]}
    assert push_answer(d_side, 1) == d_side
