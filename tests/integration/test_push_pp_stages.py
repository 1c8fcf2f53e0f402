# SPDX-License-Identifier: Apache-2.0
"""Push from a pipeline-parallel producer (S-PP-1..3), on every pinned vLLM.

P runs the tiny 4-layer model in two pipeline stages (stage 0 holds layers 0-1,
stage 1 layers 2-3, vLLM's own partition); each stage's ranks register only their
layers, and the engine core serves them on P's side channel as ``(stage, tp_rank)``.
D (one stage) learns P's stages from P's side channel, connects both, and each
stage WRITEs its own layers into D's regions (member routing by ``region_members``),
with a completion of its own. The truth the bytes are checked against is vLLM's
block tables: P's blocks of each layer, on the stage that holds it, land in D's
blocks of the same layer.
"""

from __future__ import annotations

import pytest
from push_harness import (
    BLOCK_BYTES,
    LAYERS,
    SAMPLED_TOKEN,
    PushEnv,
    assert_kv_pushed,
    assert_untouched,
    block_pairs,
    completions,
    prompt_tokens,
    push_one,
)
from vllm.v1.request import RequestStatus

from devkit.testing.inproc import stage_layers
from vllm_ext.nixl_push.members import producer_rank, producer_stage


@pytest.fixture
def env(env_both_ways: PushEnv) -> PushEnv:
    return env_both_ways


def test_stages_hold_their_layers_only(env: PushEnv) -> None:
    p = env.engine("P", "kv_producer", pp=2)
    assert [(r.stage, r.rank) for r in p.ranks] == [(0, 0), (1, 0)]
    assert [set(r.caches) for r in p.ranks] == [set(LAYERS[:2]), set(LAYERS[2:])]
    assert [stage_layers(s, 2) for s in (0, 1)] == [LAYERS[:2], LAYERS[2:]]
    # Each stage advertises its layers behind its regions (what D routes by).
    for r in p.ranks:
        assert sorted(sum(r.worker.region_members, [])) == sorted(r.caches)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 2), (2, 1)])
def test_pp2_producer_pushes_every_layer_from_its_stage(env: PushEnv, p_tp: int, d_tp: int) -> None:
    p, d = env.pair({"pp": 2, "tp": p_tp}, {"tp": d_tp})
    d_before = d.snapshot()
    req = push_one(env, p, d, prompt_tokens(3, 40), "pp")  # 3 blocks of 16
    d_id, p_id = "d-pp", "p-pp"
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert list(req.output_token_ids) == [SAMPLED_TOKEN] * 2
    assert p.finished[p_id].status == RequestStatus.FINISHED_LENGTH_CAPPED

    # Each D rank connected the P ranks it takes heads from in both stages, and the
    # D ranks together every rank of every stage (side-channel ranks s * tp + r).
    union: set[int] = set()
    for w in d.workers:
        connected = {k[1] if isinstance(k, tuple) else k for k in w._remote_agents["P"]}
        assert {producer_stage(k, p_tp)[0] for k in connected} == {0, 1}, connected
        union |= connected
    assert union == {producer_rank(s, r, p_tp) for s in (0, 1) for r in range(p_tp)}

    # Every P rank WRITEs its own stage's layers only: 3 blocks x 2 layers, its
    # share of the heads, to every D rank it covers, with a completion each.
    writes = [x for x in env.fabric.transfers() if x.op == "WRITE"]
    assert {x.state for x in writes} == {"DONE"}
    by_sender: dict[str, int] = {}
    for x in writes:
        by_sender[x.initiator] = by_sender.get(x.initiator, 0) + x.total_bytes
    assert by_sender == {a.name: 3 * 2 * BLOCK_BYTES // p_tp for a in p.agents}
    producers = {c.sender for c in completions(env.fabric, d_id, via="xfer")}
    assert producers == {a.name for a in p.agents}

    # The bytes: D's blocks hold P's, layer by layer, from the stage holding each.
    fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
    pairs = block_pairs(p, d, fin.block_ids[0], reg.block_ids[0], reg.prefix_tokens)
    assert len(pairs) == 3
    assert_kv_pushed(p, d, pairs)
    assert_untouched(d, d_before, [db for _, db in pairs])
    env.assert_clean()


@pytest.mark.timeout(60)
def test_many_requests_and_a_prefix_hit(env: PushEnv) -> None:
    """Several requests at once, one with a prefix D computed itself: each stage
    WRITEs only what D registered, into the blocks vLLM allocated."""
    p, d = env.pair({"pp": 2})
    shared = prompt_tokens(9, 32)  # 2 blocks D will hold cached
    d.add_request("warm", shared + [5], None, max_tokens=1)
    env.run_until(lambda: "warm" in d.finished, what="D warm-up")
    prompts = {f"r{i}": prompt_tokens(20 + i, 35 + 9 * i) for i in range(3)}
    prompts["r-prefix"] = shared + prompt_tokens(7, 20)
    for rid, prompt in prompts.items():
        d.add_request(f"d-{rid}", prompt, p.d_leg(f"T-{rid}"), max_tokens=2)
        p.add_request(f"p-{rid}", prompt, p.p_leg(f"T-{rid}"))
    env.run_until(lambda: all(f"d-{r}" in d.finished for r in prompts), what="all D done")
    env.settle()
    for rid in prompts:
        assert list(d.finished[f"d-{rid}"].output_token_ids) == [SAMPLED_TOKEN] * 2
        fin, reg = p.finished_meta(f"p-{rid}"), d.reg_meta(f"d-{rid}")
        pairs = block_pairs(p, d, fin.block_ids[0], reg.block_ids[0], reg.prefix_tokens)
        assert pairs
        assert_kv_pushed(p, d, pairs)
    assert d.reg_meta("d-r-prefix").prefix_tokens == 32
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_d_leg_with_the_wrong_pp_size_fails_alone(env: PushEnv) -> None:
    """A D leg saying P has one stage: D knows better from P's side channel, fails
    that request, and the next one with the right size is served."""
    p, d = env.pair({"pp": 2})
    prompt = prompt_tokens(4, 40)
    d.add_request("d-bad", prompt, p.d_leg("T-bad", pp_size=1), max_tokens=2)
    env.run_until(lambda: "d-bad" in d.finished, what="bad D leg ends")
    assert list(d.finished["d-bad"].output_token_ids) != [SAMPLED_TOKEN] * 2
    d.add_request("d-ok", prompt, p.d_leg("T-ok"), max_tokens=2)
    p.add_request("p-ok", prompt, p.p_leg("T-ok"))
    env.run_until(lambda: "d-ok" in d.finished, what="good D leg ends")
    assert list(d.finished["d-ok"].output_token_ids) == [SAMPLED_TOKEN] * 2
    fin, reg = p.finished_meta("p-ok"), d.reg_meta("d-ok")
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))


def test_decode_side_pp_is_refused_at_startup(env: PushEnv) -> None:
    with pytest.raises(ValueError, match="decode-side pipeline parallelism is not implemented"):
        env.engine("D", "kv_consumer", pp=2)
