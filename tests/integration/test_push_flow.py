# SPDX-License-Identifier: Apache-2.0
"""P and D connector workers push KV through the fake NIXL fabric (S-WRT-2..4, S-WIR-1, S-WRT-6).

Real vLLM Schedulers drive real ``NixlPushConnector`` workers; PUSH_REG and the
completion notification are real NIXL notifications between the two agents and
the KV bytes really land in D's CPU KV cache.
"""

from __future__ import annotations

import msgpack
import pytest
from push_harness import (
    BLOCK_BYTES,
    LAYERS,
    SAMPLED_TOKEN,
    PushEnv,
    assert_kv_pushed,
    assert_untouched,
    block_pairs,
    completion,
    completions,
    held_finished,
    notifs,
    pending_regs,
    prompt_tokens,
)
from vllm.v1.request import RequestStatus

from vllm_ext.nixl_push.wire import PUSH_REG_PREFIX, WIRE_VERSION, PromptKey
from vllm_ext.nixl_push.writer import WRITER_THREAD_NAME

BLOCK_TOKENS = 16


@pytest.fixture
def env(env_both_ways: PushEnv) -> PushEnv:
    """Every test here runs with vLLM's synchronous and asynchronous scheduling."""
    return env_both_ways


_prompt = prompt_tokens


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", ["registration_first", "finished_first"])
def test_both_arrival_orders(env: PushEnv, order: str) -> None:
    p, d = env.pair()
    d_before = d.snapshot()
    prompt = _prompt(1, 40)  # 3 blocks of 16
    d_id, p_id = "cmpl-abc-0-1111aaaa", "cmpl-abc-0-2222bbbb"
    p_writer = p.workers[0]

    if order == "registration_first":
        d.add_request(d_id, prompt, p.d_leg("T-1"), max_tokens=2)
        env.run_until(lambda: pending_regs(p_writer) == 1, what="PUSH_REG waits at P")
        assert held_finished(p_writer) == 0 and not env.fabric.transfers()
        assert d.scheduler.requests[d_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        # The registration names the blocks D's KV cache manager allocated.
        d_blocks = d.scheduler.kv_cache_manager.get_block_ids(d_id)
        assert [list(g) for g in d.reg_meta(d_id).block_ids] == [list(g) for g in d_blocks]
        p.add_request(p_id, prompt, p.p_leg("T-1"))
    else:
        p.add_request(p_id, prompt, p.p_leg("T-1"))
        env.run_until(lambda: held_finished(p_writer) == 1, what="finished blocks wait at P")
        for _ in range(5):
            env.step_all()
        # P finished the request but holds its blocks for the push.
        assert p.finished[p_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert p.free_blocks() < p.initial_free_blocks
        assert pending_regs(p_writer) == 0 and not env.fabric.transfers()
        d.add_request(d_id, prompt, p.d_leg("T-1"), max_tokens=2)

    env.run_until(lambda: d_id in d.finished, what="D request finished")
    env.settle()
    req = d.finished[d_id]
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert list(req.output_token_ids) == [SAMPLED_TOKEN] * 2

    # The PUSH_REG: one real msgpack notification from D's agent to P's agent.
    reg_meta = d.reg_meta(d_id)
    (reg_notif,) = notifs(env.fabric, PUSH_REG_PREFIX)
    assert (reg_notif.sender, reg_notif.receiver, reg_notif.via) == (
        d.agents[0].name,
        p.agents[0].name,
        "send_notif",
    )
    body = msgpack.unpackb(reg_notif.msg[len(PUSH_REG_PREFIX) :], raw=False)
    assert body["v"] == WIRE_VERSION
    assert body["engine_id"] == "D" and body["request_id"] == d_id
    assert body["transfer_id"] == "T-1"
    assert body["block_ids"] == [list(reg_meta.block_ids[0])]
    assert (body["tp_rank"], body["tp_size"], body["block_size"]) == (0, 1, BLOCK_TOKENS)
    assert (body["host"], body["port"]) == ("127.0.0.1", d.port)
    assert (body["prompt_tokens"], body["prompt_digest"]) == (
        len(prompt),
        PromptKey.of(prompt).digest,
    )
    assert len(body["reply_token"]) == 32

    # One WRITE from P's writer thread carrying vLLM's completion notification.
    (xfer,) = env.fabric.transfers()
    assert (xfer.op, xfer.state, xfer.post_thread) == ("WRITE", "DONE", WRITER_THREAD_NAME)
    assert completion(xfer.notif) == (d_id, 1)
    assert xfer.total_bytes == 3 * len(LAYERS) * BLOCK_BYTES
    (done,) = completions(env.fabric, d_id, via="xfer")
    assert (done.sender, done.receiver) == (p.agents[0].name, d.agents[0].name)

    # The bytes: D's registered blocks hold P's, nothing else on D changed.
    fin = p.finished_meta(p_id)
    pairs = block_pairs(p, d, fin.block_ids[0], reg_meta.block_ids[0], reg_meta.prefix_tokens)
    assert len(pairs) == 3
    assert_kv_pushed(p, d, pairs)
    assert_untouched(d, d_before, [db for _, db in pairs])

    assert p.totals("push_regs_received") == 1 and d.totals("push_regs_sent") == 1
    assert p.totals("push_match_transfer_id") == 1 and p.totals("push_writes") == 1
    assert d.totals("push_completions_received") == 1
    assert p_id in p.finished_sending and d_id in d.finished_recving
    env.assert_clean()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "p_id,d_id,p_tid,d_tid,rule",
    [
        ("cmpl-r-0-aaaaaaaa", "cmpl-r-0-bbbbbbbb", "T", "T", "transfer_id"),
        # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION: the ids are equal.
        ("cmpl-r-0", "cmpl-r-0", None, None, "exact"),
        ("cmpl-r-0-aaaaaaaa", "cmpl-r-0-bbbbbbbb", None, None, "base_id"),
        ("cmpl-r-0-aaaaaaaa", "cmpl-r-0-bbbbbbbb", None, "T", "base_id"),
    ],
)
def test_matching_rules(
    env: PushEnv, p_id: str, d_id: str, p_tid: str | None, d_tid: str | None, rule: str
) -> None:
    p, d = env.pair()
    prompt = _prompt(2, 20)
    d.add_request(d_id, prompt, p.d_leg(d_tid))
    p.add_request(p_id, prompt, p.p_leg(p_tid))
    env.run_until(lambda: d_id in d.finished)
    env.settle()
    assert p.totals(f"push_match_{rule}") == 1
    assert sum(p.totals(f"push_match_{r}") for r in ("transfer_id", "exact", "base_id")) == 1
    fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    env.assert_clean()


@pytest.mark.timeout(60)
def test_multi_prompt_sub_requests_stay_distinct(env: PushEnv) -> None:
    """Same base, different completion index: each D sub-request gets its own P's KV."""
    p, d = env.pair()
    prompts = {0: _prompt(3, 40), 1: _prompt(4, 24)}
    p_ids = {i: f"cmpl-multi-{i}-aaaaaaa{i}" for i in prompts}
    d_ids = {i: f"cmpl-multi-{i}-bbbbbbb{i}" for i in prompts}
    # Adversarial order: D's second sub-request registers first, P finishes the first one.
    d.add_request(d_ids[1], prompts[1], p.d_leg())
    env.run_until(lambda: pending_regs(p.workers[0]) == 1)
    p.add_request(p_ids[0], prompts[0], p.p_leg())
    env.run_until(lambda: held_finished(p.workers[0]) == 1)
    for _ in range(5):
        env.step_all()
    assert not env.fabric.transfers(), "sub-request 0's blocks were written for sub-request 1"
    d.add_request(d_ids[0], prompts[0], p.d_leg())
    p.add_request(p_ids[1], prompts[1], p.p_leg())
    env.run_until(lambda: all(d_ids[i] in d.finished for i in prompts))
    env.settle()
    assert p.totals("push_match_base_id") == 2 and p.totals("push_writes") == 2
    for i in prompts:
        fin, reg = p.finished_meta(p_ids[i]), d.reg_meta(d_ids[i])
        assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    by_notif = {completion(t.notif) for t in env.fabric.transfers()}
    assert by_notif == {(d_ids[i], 1) for i in prompts}
    env.assert_clean()


@pytest.mark.timeout(60)
def test_different_transfer_ids_never_match(env: PushEnv) -> None:
    """Both legs carry a transfer_id and they differ: no WRITE, even though the base ids match.

    Both sides clean up on their own: D through its registration watchdog, P
    through the lease (S-TMO-1).

    P must hold both for a while, the finished request (its lease) and D's PUSH_REG
    (0.8 x D's watchdog from its arrival), for the test to see them side by side:
    the engine steps between their arrivals are slow on a loaded machine, so both
    are held a few seconds, not half a second.
    """
    hold_s = 2.5
    p, d = env.pair(
        p_kw={"extra_config": {"kv_lease_duration": hold_s, "push_registration_timeout_s": 2.0}},
        d_kw={"extra_config": {"push_registration_timeout_s": hold_s}},
    )
    prompt = _prompt(5, 20)
    d.add_request("cmpl-t-0-bbbbbbbb", prompt, p.d_leg("T-D"))
    p.add_request("cmpl-t-0-aaaaaaaa", prompt, p.p_leg("T-P"))
    env.run_until(lambda: held_finished(p.workers[0]) == 1 and pending_regs(p.workers[0]) == 1)
    env.run_until(lambda: "cmpl-t-0-bbbbbbbb" in d.finished, what="D watchdog")
    env.settle()
    assert not env.fabric.transfers()
    assert d.finished["cmpl-t-0-bbbbbbbb"].status == RequestStatus.FINISHED_ERROR
    assert "cmpl-t-0-aaaaaaaa" in p.finished_sending  # released by the lease
    env.assert_clean()


def _push(env: PushEnv, tag: str, prompt: list[int]) -> str:
    p, d = env.engines[0], env.engines[1]
    d_id, p_id = f"cmpl-{tag}-0-bbbbbbbb", f"cmpl-{tag}-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(tag), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg(tag))
    env.run_until(lambda: d_id in d.finished, what=f"{tag} finished on D")
    return d_id


#: P streams chunks of 32 tokens (S-PRG-1).
PROGRESSIVE = {"extra_config": {"push_progressive": True}, "max_num_batched_tokens": 32}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "prompt_len,cached_len,p_kw",
    [
        (1, 0, {}),
        (BLOCK_TOKENS * 3 + 1, BLOCK_TOKENS * 3, {}),
        (BLOCK_TOKENS * 3, BLOCK_TOKENS * 3, {}),
        (33, 0, PROGRESSIVE),
        (65, 32, PROGRESSIVE),
    ],
    ids=[
        "one-token-prompt", "d-holds-every-full-block", "d-holds-all-but-the-last-token",
        "last-chunk-of-one-token", "last-chunk-of-one-token-after-ds-prefix",
    ],
)  # fmt: skip
def test_every_answer_at_the_edges_of_what_p_writes_is_taken(
    env: PushEnv, prompt_len: int, cached_len: int, p_kw: dict
) -> None:
    """The edges of what P writes (a 1-token prompt, D's prefix cache holding what P
    would write, a last chunk of one token on a block boundary): D takes P's answer at
    once, and counts nothing forged or malformed (every answer carries its reply token,
    S-WIR-3; the answer to a registration of no blocks: test_push_forged.py)."""
    p, d = env.pair(p_kw=p_kw)
    prompt = _prompt(9, prompt_len)
    if cached_len:  # D's prefix cache gets the first blocks from an earlier push
        _push(env, "warm", prompt[:cached_len] + _prompt(10, 5))
    d_id = _push(env, "cold", prompt)
    env.settle()
    assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert d.totals("push_notifs_forged") == 0
    assert d.totals("push_notifs_malformed") == 0
    env.assert_clean()
