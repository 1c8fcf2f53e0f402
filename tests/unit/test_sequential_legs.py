# SPDX-License-Identifier: Apache-2.0
"""P's answer to a P leg without ``transfer_id`` (nixl_push/answer.py): ids that match
D's sub-requests under the ids a sequential router (vllm-router) makes, and a push D
leg that our D parses as one (S-LEG-1, S-LEG-3)."""

from __future__ import annotations

import pytest

from vllm_ext.nixl_push.answer import (
    TRANSFER_ID_PREFIX,
    SequentialLegIds,
    d_leg_answer,
)
from vllm_ext.nixl_push.config import PushConfig
from vllm_ext.nixl_push.matching import body_of, sub_request_of, transfer_tag
from vllm_ext.nixl_push.metadata import (
    MAX_SECRET_LEN,
    MIN_SECRET_LEN,
    DLegParams,
    is_pull_d_leg,
    is_push_d_leg,
    parse_d_leg,
)

#: What vllm-router 0.1.17 sends as X-Request-Id on both legs (seen with recording
#: engines: tests/integration/test_vllm_router_legs.py): 32 hex digits at the end.
ROUTER_ID = (
    "___prefill_addr_127.0.0.1:8100___decode_addr_127.0.0.1:8200_a45525a2128c4ffb82ccdcc974b954b8"
)

#: vLLM's pull answer of a finished P leg (0.23's NixlConnectorScheduler)
PULL_ANSWER = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": ([3, 4, 5],),
    "remote_engine_id": "P0",
    "remote_request_id": f"cmpl-{ROUTER_ID}-0-1a2b3c4d",
    "remote_host": "127.0.0.1",
    "remote_port": 5601,
    "tp_size": 2,
    "remote_num_tokens": 300,
}


def test_the_answer_is_a_push_d_leg_with_the_id_and_secret() -> None:
    ids = SequentialLegIds()
    tid, secret = ids.ids_for(f"cmpl-{ROUTER_ID}-0-1a2b3c4d", "a-leg-secret-0123456789")
    out = d_leg_answer(dict(PULL_ANSWER), 1, tid, secret)
    assert out == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "P0",
        "remote_host": "127.0.0.1",
        "remote_port": 5601,
        "tp_size": 2,
        "pp_size": 1,
        "transfer_id": tid,
        "transfer_secret": secret,
    }
    assert is_push_d_leg(out) and not is_pull_d_leg(out)
    assert parse_d_leg(out) == DLegParams("P0", "127.0.0.1", 5601, 2, 1, tid, secret)
    assert tid.startswith(TRANSFER_ID_PREFIX)
    assert secret is not None and MIN_SECRET_LEN <= len(secret) <= MAX_SECRET_LEN
    # a leg without a secret: P makes one (S-LEG-4), answered like the leg's own
    tid2, made = ids.ids_for("cmpl-another-body-0-1a2b3c4d", None)
    assert MIN_SECRET_LEN <= len(made) <= MAX_SECRET_LEN and made != secret
    assert d_leg_answer(dict(PULL_ANSWER), 1, tid2, made)["transfer_secret"] == made


def test_each_body_gets_fresh_ids() -> None:
    ids = SequentialLegIds()
    a = ids.ids_for("cmpl-a-0-11111111", None)
    b = ids.ids_for("cmpl-b-0-22222222", None)
    assert a[0] != b[0] and a[1] != b[1]
    assert SequentialLegIds().ids_for("cmpl-a-0-11111111", None) != a  # random, not derived


@pytest.mark.parametrize(
    "first,second",
    [
        (["cmpl-x-0-11111111"], ["cmpl-x-0-22222222"]),  # one prompt each
        (["chatcmpl-x-11111111"], ["chatcmpl-x-22222222"]),  # chat
        (
            [f"cmpl-x-{i}-1111111{i}" for i in range(3)],
            [f"cmpl-x-{i}-2222222{i}" for i in range(2)],
        ),
        (
            [f"{c}_cmpl-x-0-11111111" for c in range(2)],
            [f"{c}_cmpl-x-0-22222222" for c in range(2)],
        ),
    ],
)
def test_two_bodies_under_one_client_id_never_share_ids(first, second) -> None:
    """Clients and gateways may send one X-Request-Id twice (a retry, a bug): the
    second body's first sub-request finds its place in the body taken, so it starts
    a body of its own (before: it got the first body's transfer id, and D's
    sub-requests of either body could meet P's of the other)."""
    ids = SequentialLegIds()
    a = {ids.ids_for(r, None) for r in first}
    b = {ids.ids_for(r, None) for r in second}
    assert len(a) == 1 and len(b) == 1 and a.isdisjoint(b)


@pytest.mark.parametrize(
    "p_ids,d_ids",
    [
        # a completion with three prompts: one engine request per prompt, own suffix each
        (
            [
                f"cmpl-{ROUTER_ID}-{i}-{s}"
                for i, s in enumerate(("1a2b3c4d", "aaaaaaaa", "0f0f0f0f"))
            ],
            [
                f"cmpl-{ROUTER_ID}-{i}-{s}"
                for i, s in enumerate(("99999999", "bbbbbbbb", "cccccccc"))
            ],
        ),
        # n=2: children "<index>_<parent id>"
        (
            [f"{i}_cmpl-{ROUTER_ID}-0-1a2b3c4d" for i in range(2)],
            [f"{i}_cmpl-{ROUTER_ID}-0-deadbeef" for i in range(2)],
        ),
        # a chat completion: no prompt index
        ([f"chatcmpl-{ROUTER_ID}-1a2b3c4d"], [f"chatcmpl-{ROUTER_ID}-deadbeef"]),
    ],
)
def test_sub_requests_share_one_id_and_each_matches_its_twin_on_d(
    p_ids: list[str], d_ids: list[str]
) -> None:
    """The router answers D with one sub-request's params (vLLM's completion server
    returns the first one's); D gives them to all its sub-requests. Each P sub-request
    must carry that id, and its transfer tag must equal exactly its twin's on D."""
    ids = SequentialLegIds()
    made = {ids.ids_for(rid, None) for rid in p_ids}
    assert len(made) == 1
    ((tid, _),) = made
    assert len({body_of(r) for r in p_ids + d_ids}) == 1
    for i, p_id in enumerate(p_ids):
        d_tags = [transfer_tag(tid, d) for d in d_ids]
        assert [t == transfer_tag(tid, p_id) for t in d_tags] == [j == i for j in range(len(d_ids))]


def test_a_leg_secret_is_kept() -> None:
    ids = SequentialLegIds()
    own = "s" * 20
    tid, secret = ids.ids_for("cmpl-x-0-11111111", own)
    assert secret == own and tid.startswith(TRANSFER_ID_PREFIX)


def test_ids_are_shared_within_the_window_only_and_the_table_is_bounded() -> None:
    ids = SequentialLegIds(window_s=10.0, max_bodies=3)
    first = ids.ids_for("cmpl-a-0-11111111", None, now=0.0)
    assert ids.ids_for("cmpl-a-1-22222222", None, now=9.0) == first
    assert ids.ids_for("cmpl-a-2-33333333", None, now=11.0) != first
    for i in range(10):
        ids.ids_for(f"cmpl-{i}-0-11111111", None, now=12.0)
    assert len(ids) == 3


@pytest.mark.parametrize(
    "rid,body,sub",
    [
        ("cmpl-x-2-1a2b3c4d", "cmpl-x", "/2"),
        ("1_cmpl-x-0-1a2b3c4d", "cmpl-x", "1/0"),
        ("chatcmpl-x-1a2b3c4d", "chatcmpl-x", "/"),
        ("cmpl-x-0", "cmpl-x", "/0"),  # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION
        ("plain", "plain", "/"),
    ],
)
def test_body_of(rid: str, body: str, sub: str) -> None:
    assert body_of(rid) == body and sub_request_of(rid) == sub


def test_the_key_turns_it_off() -> None:
    assert not PushConfig.from_extra_config(
        {"push_answer_sequential_legs": False}
    ).push_answer_sequential_legs
