# SPDX-License-Identifier: Apache-2.0
"""Messages a peer forges change no other request's or peer's state (docs/design.md,
"Who may send what"; S-LEG-3, S-WIR-3, S-SAFE-1).

NIXL takes a notification's sender name from the message, and any NIXL peer can reach
P's and D's agents: each test injects what such a peer could send, through the fake
fabric into the real workers, and checks it against what vLLM holds (P's blocks, D's
completions) and against a push that follows. Each failed on the connector before its
fix; the forged completion and PUSH_FAIL to D are in test_push_modelcheck_regressions.py.
"""

from __future__ import annotations

import time

import pytest
from push_harness import (
    PushEnv,
    assert_kv_pushed,
    block_pairs,
    held_finished,
    notifs,
    wait_until,
)
from vllm.v1.request import RequestStatus

from vllm_ext.nixl_push.wire import PUSH_FAIL_PREFIX, PushCancel, PushRegistration

FORGER = "a-peer-that-is-not-d"


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 89 + i * 17) % 1000 + 3 for i in range(n)]


def _push(env: PushEnv, tag: str, tid: str) -> None:
    """A request pair that must push correctly (the legs carry a transfer id only)."""
    p, d = env.engines[0], env.engines[1]
    prompt = _prompt(sum(map(ord, tag)))
    d_id, p_id = f"cmpl-{tag}-0-bbbbbbbb", f"cmpl-{tag}-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(tid), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg(tid))
    env.run_until(lambda: d_id in d.finished, what=f"push {tag}")
    assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))


@pytest.mark.timeout(60)
def test_a_completion_naming_a_p_request_a_write_reads_frees_nothing(env: PushEnv) -> None:
    """vLLM's pull completion ``<P request id>:<n>`` from any agent reported the request
    sent, and vLLM freed its blocks while P's WRITE still read them (S-SAFE-1). Now the
    lease claims decide: while a WRITE may read them, the completion is dropped."""
    p, d = env.pair()
    env.fabric.fail_next_transfer("hang", initiator=p.agents[0].name)
    prompt = _prompt(1)
    d_id, p_id = "cmpl-fc-0-bbbbbbbb", "cmpl-fc-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg("T-fc"), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg("T-fc"))
    env.run_until(lambda: env.fabric.pending_transfers(), what="P's WRITE runs")
    free_before = p.free_blocks()
    env.fabric.inject_notif(p.agents[0].name, d.agents[0].name, f"{p_id}:1".encode())
    env.run_until(
        lambda: p.totals("push_notifs_foreign") or p_id in p.finished_sending, what="P read it"
    )
    for _ in range(20):
        env.step_all()
    assert p_id not in p.finished_sending, "vLLM freed blocks a running WRITE reads"
    assert p.free_blocks() == free_before
    env.fabric.progress(p.agents[0].name)  # the WRITE ends
    env.run_until(lambda: d_id in d.finished and p_id in p.finished_sending, what="done")
    fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_push_reg_naming_a_known_d_from_another_agent_redirects_nothing(env: PushEnv) -> None:
    """Legs with a transfer id and no secret (a proxy that sends no secret): a PUSH_REG
    that names D's engine id from another agent made P forget D and handshake with the
    address it gave. Now only a registration that proved it belongs to its request
    (the transfer id both legs carried, or the secret) may connect D anew."""
    p, d = env.pair()
    _push(env, "fr1", "T-fr1")  # P knows D's agent now
    known = p.workers[0].remote_agents_of("D")
    assert known == {0: d.agents[0].name}
    forged = PushRegistration(
        engine_id="D", request_id="cmpl-evil-0-bbbbbbbb", block_ids=((1, 2),), tp_rank=0,
        tp_size=1, host="127.0.0.1", port=1, block_size=16,
    )  # fmt: skip
    env.fabric.inject_notif(p.agents[0].name, FORGER, forged.encode())
    env.run_until(lambda: p.totals("push_regs_received") >= 2, what="P read it")
    for _ in range(10):
        env.step_all()
    assert p.workers[0].remote_agents_of("D") == known
    assert p.totals("push_agents_removed") == 0
    _push(env, "fr2", "T-fr2")  # and D is still served, through the same connection
    assert p.workers[0].remote_agents_of("D") == known


@pytest.mark.timeout(60)
def test_a_cancel_from_an_engine_p_never_served_leaves_no_connection(env: PushEnv) -> None:
    """A PUSH_CANCEL of a registration P never saw, naming an engine P is not connected
    to: P answers it (D keeps its blocks until answered) over a connection made for that
    answer only, which it drops then; before, the engine stayed connected under the
    address the message named, for every later request of that engine id."""
    p, d = env.pair()
    cancel = PushCancel(
        engine_id="D", request_id="cmpl-gc-0-bbbbbbbb", tp_rank=0, tp_size=1,
        host="127.0.0.1", port=d.port,
    )  # fmt: skip
    env.fabric.inject_notif(p.agents[0].name, d.agents[0].name, cancel.encode())
    wait_until(lambda: notifs(env.fabric, PUSH_FAIL_PREFIX), step=env.step_all, what="P answered")
    env.run_until(lambda: not p.workers[0].remote_agents_of("D"), what="P dropped it")
    assert p.totals("push_cancels_before_registration") == 1
    _push(env, "gc2", "T-gc2")  # a real registration connects D as usual


@pytest.mark.timeout(60)
def test_a_lease_heartbeat_needs_the_proof_of_the_legs_secret(env: PushEnv) -> None:
    """vLLM's lease heartbeat ``HB:<transfer id>`` from any agent renewed P's hold of a
    prefilled request whose D leg waits on D (S-TMO-2), up to the cap: anyone who saw a
    transfer id could keep P's blocks. With a secret in the legs, P renews only on the
    proof D builds from it; a forged heartbeat is counted and the lease ends on time."""
    p, d = env.pair(p_kw={"extra_config": {"kv_lease_duration": 3}})
    secret = "f" * 32
    p_id = "cmpl-hb-0-aaaaaaaa"
    p.add_request(p_id, _prompt(7), p.p_leg("T-hb", transfer_secret=secret))
    env.run_until(lambda: held_finished(p.workers[0]) == 1, what="P holds the prefilled blocks")
    held_at = time.monotonic()
    while p_id not in p.finished_sending and time.monotonic() < held_at + 8.0:
        for forged in (b"HB:T-hb", b"HB:T-hb~" + b"0" * 32):  # every 0.25 s, as vLLM's
            for agent in (FORGER, d.agents[0].name):
                env.fabric.inject_notif(p.agents[0].name, agent, forged)
        for _ in range(5):
            env.step_all()
            time.sleep(0.05)
    assert p_id in p.finished_sending, "forged heartbeats kept P's blocks past the lease"
    assert p.totals("push_leases_renewed_queued") == 0
    assert p.totals("push_notifs_forged") >= 4
    _push(env, "hb-after", "T-hb-after")
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_the_answer_to_a_registration_of_no_blocks_carries_its_reply_token(env: PushEnv) -> None:
    """A registration whose D needs none of P's blocks (D allocated none for it) is
    answered with a completion alone, not a WRITE. That answer carries the reply token
    like every other (S-WIR-3): before, it went out as vLLM's bare ``<id>:<tp>``, which
    a D that sent a token drops as forged, waiting for its watchdog instead."""
    from push_harness import completions

    from vllm_ext.nixl_push.wire import Completion, PromptKey, parse_notif

    p, d = env.pair()
    _push(env, "z0", "T-z0")  # P knows D's agent
    prompt, d_id = _prompt(5), "cmpl-zero-0-bbbbbbbb"
    zero = PushRegistration(
        engine_id="D", request_id=d_id, block_ids=((),), tp_rank=0, tp_size=1,
        host="127.0.0.1", port=d.port, block_size=16, transfer_id="T-z1",
        prompt=PromptKey.of(prompt), reply_token="a-token-d-made-for-it",
    )  # fmt: skip
    env.fabric.inject_notif(p.agents[0].name, d.agents[0].name, zero.encode())
    p.add_request("cmpl-zero-0-aaaaaaaa", prompt, p.p_leg("T-z1"))
    env.run_until(lambda: completions(env.fabric, d_id), what="P answers")
    (answer,) = completions(env.fabric, d_id)
    done = parse_notif(answer.msg)
    assert isinstance(done, Completion) and done.token == "a-token-d-made-for-it"
    assert answer.via == "send_notif"  # a completion alone: no WRITE
