# SPDX-License-Identifier: Apache-2.0
"""Push behind a router that runs the legs one after the other (vllm-router).

The P leg carries no ``transfer_id``; P answers the push D leg (with a transfer id and
secret it made and bound to its own send), and that answer, verbatim, is the D leg's
``kv_transfer_params``: D registers once P finished, P WRITEs the blocks it holds.
Real schedulers and workers over the fake NIXL; request ids as vLLM builds them from
vllm-router's X-Request-Id, which both legs carry (tests/integration/test_vllm_router_legs.py).
"""

from __future__ import annotations

import pytest
from push_harness import (
    SAMPLED_TOKEN,
    PushEnv,
    assert_kv_pushed,
    block_pairs,
    completion,
    held_finished,
)
from vllm.v1.request import RequestStatus

from vllm_ext.nixl_push.answer import TRANSFER_ID_PREFIX
from vllm_ext.nixl_push.metadata import MIN_SECRET_LEN, is_pull_d_leg, is_push_d_leg

ROUTER_ID = (
    "___prefill_addr_127.0.0.1:8100___decode_addr_127.0.0.1:8200_a45525a2128c4ffb82ccdcc974b954b8"
)
#: What a sequential router's P leg carries (vllm-router 0.1.17, kv connector nixl).
ROUTER_P_LEG = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


#: P's answer for sequential legs (the engines' default; the harness turns it off)
ON = {"push_answer_sequential_legs": True}


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 97 + i * 11) % 1000 + 3 for i in range(n)]


def _p_finished_and_answered(env: PushEnv, p, p_ids: list[str]) -> None:
    env.run_until(lambda: all(r in p.answers for r in p_ids), what="P answered")
    # P holds the blocks; nothing is written without a registration
    env.run_until(lambda: held_finished(p.workers[0]) == len(p_ids), what="P holds them")
    for _ in range(3):
        env.step_all()
    assert not env.fabric.transfers()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("at_forward_end", [True, False])
def test_p_answers_the_push_d_leg_and_the_kv_crosses_by_push(
    env: PushEnv, at_forward_end: bool
) -> None:
    p, d = env.pair(p_kw={"extra_config": {**ON, "push_at_forward_end": at_forward_end}})
    prompt = _prompt(1, 40)  # 3 blocks of 16
    p_id, d_id = f"cmpl-{ROUTER_ID}-0-1a2b3c4d", f"cmpl-{ROUTER_ID}-0-deadbeef"
    p.add_request(p_id, prompt, dict(ROUTER_P_LEG))
    _p_finished_and_answered(env, p, [p_id])
    assert p.finished[p_id].status == RequestStatus.FINISHED_LENGTH_CAPPED

    answer = p.answers[p_id]
    assert answer is not None and is_push_d_leg(answer) and not is_pull_d_leg(answer)
    assert "remote_block_ids" not in answer
    tid, secret = answer["transfer_id"], answer.get("transfer_secret")
    assert tid.startswith(TRANSFER_ID_PREFIX)
    assert secret is not None and len(secret) >= MIN_SECRET_LEN  # P made one (S-LEG-4)
    assert {k: answer[k] for k in ("remote_engine_id", "remote_host", "remote_port")} == {
        "remote_engine_id": "P", "remote_host": "127.0.0.1", "remote_port": p.port,
    }  # fmt: skip
    assert (answer["tp_size"], answer["pp_size"]) == (1, 1)
    # P's send uses that id as if the P leg had carried it
    fin = p.finished_meta(p_id)
    assert (fin.transfer_id, fin.secret) == (tid, secret)

    d.add_request(d_id, prompt, dict(answer), max_tokens=2)  # the router's D leg
    env.run_until(lambda: d_id in d.finished, what="D request finished")
    env.settle()
    assert list(d.finished[d_id].output_token_ids) == [SAMPLED_TOKEN] * 2
    reg = d.reg_meta(d_id)
    assert (reg.transfer_id, reg.secret) == (tid, secret)
    assert p.totals("push_match_transfer_id") == 1 and p.totals("push_writes") == 1
    assert p.totals("push_regs_unauthorized") == 0
    pairs = block_pairs(p, d, fin.block_ids[0], reg.block_ids[0], reg.prefix_tokens)
    assert len(pairs) == 3
    assert_kv_pushed(p, d, pairs)
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_multi_prompt_body_pushes_each_prompt_with_the_first_answer(env: PushEnv) -> None:
    """vLLM's completion server returns the first prompt's answer; the router gives it
    to D, which applies it to every prompt: each still gets its own P prompt's KV."""
    p, d = env.pair(p_kw={"extra_config": ON})
    prompts = [_prompt(2, 40), _prompt(3, 24)]
    p_ids = [f"cmpl-{ROUTER_ID}-{i}-{s}" for i, s in enumerate(("1a2b3c4d", "0badf00d"))]
    d_ids = [f"cmpl-{ROUTER_ID}-{i}-{s}" for i, s in enumerate(("deadbeef", "cafebabe"))]
    for p_id, prompt in zip(p_ids, prompts):
        p.add_request(p_id, prompt, dict(ROUTER_P_LEG))
    _p_finished_and_answered(env, p, p_ids)
    answer = p.answers[p_ids[0]]
    assert answer is not None and p.answers[p_ids[1]] == answer
    # D's prompts in the other order: each must meet its own twin only
    for d_id, prompt in reversed(list(zip(d_ids, prompts))):
        d.add_request(d_id, prompt, dict(answer), max_tokens=2)
    env.run_until(lambda: all(r in d.finished for r in d_ids), what="D requests finished")
    env.settle()
    assert p.totals("push_match_transfer_id") == 2 and p.totals("push_writes") == 2
    for p_id, d_id in zip(p_ids, d_ids):
        assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
        fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
        assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    assert {completion(t.notif) for t in env.fabric.transfers()} == {(r, 1) for r in d_ids}
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_d_leg_without_the_answered_secret_gets_nothing(env: PushEnv) -> None:
    """A P leg that carries a transfer_secret but no transfer_id: P answers that secret
    with the id it made, and a registration without it gets nothing (S-LEG-3).

    P holds its blocks 8 s (its lease) and D waits 3 s: D's PUSH_REG goes out after its
    handshake with P, and P judges it only while it still holds the request, which a
    loaded machine's engine steps may delay past a short lease."""
    p, d = env.pair(
        p_kw={"extra_config": {**ON, "kv_lease_duration": 8.0, "push_registration_timeout_s": 2.0}},
        d_kw={"extra_config": {"push_registration_timeout_s": 3.0}},
    )
    prompt = _prompt(4, 20)
    p_id, d_id = f"cmpl-{ROUTER_ID}-0-1a2b3c4d", f"cmpl-{ROUTER_ID}-0-deadbeef"
    p.add_request(p_id, prompt, {**ROUTER_P_LEG, "transfer_secret": "s" * MIN_SECRET_LEN})
    _p_finished_and_answered(env, p, [p_id])
    forged = dict(p.answers[p_id] or {})
    assert forged.pop("transfer_secret") == "s" * MIN_SECRET_LEN
    d.add_request(d_id, prompt, forged, max_tokens=2)
    env.run_until(lambda: p.totals("push_regs_unauthorized") >= 1, what="P refused it")
    env.run_until(lambda: d_id in d.finished, what="D watchdog")
    env.settle()
    assert not env.fabric.transfers()
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    env.assert_clean()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("p_leg", ["router", "with_transfer_id"])
def test_p_answers_as_vllm_when_turned_off_or_the_leg_has_an_id(env: PushEnv, p_leg: str) -> None:
    """``push_answer_sequential_legs: false``, or a P leg with a transfer_id (our proxy):
    vLLM's pull answer, and P's send keeps the leg's ids."""
    off = p_leg == "router"
    extra = {"kv_lease_duration": 0.5, "push_answer_sequential_legs": not off}
    p, _ = env.pair(p_kw={"extra_config": extra})
    p_id = f"cmpl-{ROUTER_ID}-0-1a2b3c4d"
    params = dict(ROUTER_P_LEG) if off else p.p_leg("T-1")
    p.add_request(p_id, _prompt(5, 20), params)
    env.run_until(lambda: p_id in p.answers, what="P answered")
    answer = p.answers[p_id]
    assert answer is not None and is_pull_d_leg(answer)
    assert "transfer_id" not in answer and "transfer_secret" not in answer
    assert p.finished_meta(p_id).transfer_id == (None if off else "T-1")
    env.settle()  # P's blocks come back with the lease
    assert p_id in p.finished_sending
    env.assert_clean()
