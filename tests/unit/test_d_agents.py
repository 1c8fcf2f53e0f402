# SPDX-License-Identifier: Apache-2.0
"""P's memory of the D agents it connected per engine id and rank (d_agents.py): a
restart is not taken for two engines, two engines are told from a restart, and a
retired agent stays reachable until P connects it again."""

from __future__ import annotations

from vllm_ext.nixl_push.d_agents import AGENTS_PER_RANK_MAX, ENGINES_MAX, DAgents


def _read(agents: DAgents, *seq: str | None, engine: str = "D", rank: int = 0) -> list:
    """The proofs returned while P reads ``seq`` as the connected agent, in order."""
    return [agents.observe(engine, rank, a) for a in seq]


def test_restarts_and_reconnects_to_the_same_agent_prove_nothing() -> None:
    agents = DAgents()
    # a restart (a -> b), one more (b -> c), reads while not connected, a heal of c
    # (forgotten, removed, connected anew to c itself)
    assert _read(agents, "a", "a", None, "b", None, "b", "c", None, "c") == [None] * 9
    assert agents.shared("D", 0, "a") is None


def test_a_restarted_agents_stale_registration_does_not_make_a_slip() -> None:
    """A restarted D's old agent ``a`` had a registration waiting; P reconnects for
    it, forgetting ``b``, and the handshake answers ``b`` again (same address): the
    agents read are a, b, b: no alternation."""
    agents = DAgents()
    assert _read(agents, "a") == [None]
    agents.retire("D", {0: "a"})
    assert _read(agents, "b") == [None]
    agents.retire("D", {0: "b"})
    assert _read(agents, "b") == [None]
    assert agents.shared("D", 0, "a") is None


def test_an_agent_that_comes_back_proves_two_engines_once() -> None:
    agents = DAgents()
    assert _read(agents, "a", "b") == [None, None]
    agents.retire("D", {0: "b"})
    proof = agents.observe("D", 0, "a")
    assert proof is not None and (proof.served, proof.other) == ("a", "b")
    assert "two D engines use engine_id 'D'" in proof.reason()
    assert "kv_transfer_config.engine_id" in proof.reason()
    assert len(proof.reason()) <= 200 or "leave it unset" in proof.reason()[:200]
    assert agents.observe("D", 0, "b") is None  # logged once
    # ...after which P serves "b" (it read it last) and refuses "a"
    assert agents.shared("D", 0, "b") is None
    refused = agents.shared("D", 0, "a")
    assert refused is not None and (refused.served, refused.other) == ("b", "a")


def test_another_engine_id_or_rank_is_not_shared() -> None:
    agents = DAgents()
    _read(agents, "a", "b", "a")
    assert agents.shared("D", 0, "b") is not None
    assert agents.shared("D", 1, "b") is None
    assert agents.shared("E", 0, "b") is None
    assert agents.shared("D", 0, "stranger") is None  # never connected: not refused


def test_retired_agents_are_reachable_until_connected_again() -> None:
    agents = DAgents()
    _read(agents, "a0", engine="D", rank=0)
    agents.retire("D", {0: "a0", 1: "a1"})
    assert agents.reachable("D", 0, "a0") and agents.reachable("D", 1, "a1")
    assert not agents.reachable("D", 1, "a0")  # another rank's agent
    assert not agents.reachable("D", 0, "stranger")
    agents.observe("D", 0, "a0")  # connected again: P's current agent, not retired
    assert not agents.reachable("D", 0, "a0")


def test_bounded() -> None:
    agents = DAgents()
    for i in range(AGENTS_PER_RANK_MAX + 5):
        agents.observe("D", 0, f"a{i}")
        agents.retire("D", {0: f"a{i}"})
    entry = agents._engines[("D", 0)]
    assert len(entry.seen) == AGENTS_PER_RANK_MAX and len(entry.retired) <= AGENTS_PER_RANK_MAX
    assert not agents.reachable("D", 0, "a0")  # the oldest forgotten
    for i in range(ENGINES_MAX + 5):
        agents.observe(f"E{i}", 0, "a")
    assert len(agents._engines) == ENGINES_MAX
