# SPDX-License-Identifier: Apache-2.0
"""The NIXL agents P has connected for each D engine id and rank, on P's writer thread.

vLLM keys a peer by engine id, so P is connected to one agent per D engine id and rank.
P connects an engine anew when a registration from another agent proves it belongs to
its request (a D restarted under its engine id: S-FLT-1, ``writes._prepare``). The agent
it forgets then stays loaded in NIXL (a WRITE of it may still run): P keeps its name
here as *retired*, so that it can still answer that agent's registrations and cancels
(docs/design.md, "Who may send what").

**Two engines under one engine id (a configuration slip).** A restart never brings an
agent back: vLLM names each worker's NIXL agent with a fresh ``uuid4``, and an agent is
one process, alive over one interval of time. So if the handshakes P made for one
engine id and rank answered agent ``a``, later ``b``, later ``a`` again, ``a`` was alive
before and after ``b`` answered, and two engines used that engine id at once
(:meth:`DAgents.observe` returns the :class:`SharedEngineId` then). P only reads the
agent its last handshake connected (``PeerAgents``), at moments of its choosing; the
handshakes between two reads can only add agents between them, so an alternation
among the agents read is one among the agents that answered: no false alarm.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

#: Agents remembered per D engine id and rank (the oldest forgotten first).
AGENTS_PER_RANK_MAX = 16
#: D engine ids and ranks remembered (the least recently seen forgotten first).
ENGINES_MAX = 1024


@dataclasses.dataclass(frozen=True)
class SharedEngineId:
    """Two D engines use ``engine_id`` at once: P serves ``served`` (the agent its last
    handshake connected) and refuses ``other``'s registrations."""

    engine_id: str
    tp_rank: int
    served: str
    other: str

    def reason(self) -> str:
        """What P tells the refused engine (a PUSH_FAIL's reason, of which D keeps 200
        characters: the advice first) and logs."""
        return (
            f"two D engines use engine_id {self.engine_id!r}: give each its own "
            f"(kv_transfer_config.engine_id, or leave it unset); P serves agent "
            f"{self.served} and refuses {self.other} (rank {self.tp_rank})"
        )


@dataclasses.dataclass
class _RankAgents:
    #: agents P read as connected, oldest first (each once, at its latest place)
    seen: list[str] = dataclasses.field(default_factory=list)
    #: agents P forgot on a restart without removing them from NIXL (reachable)
    retired: set[str] = dataclasses.field(default_factory=set)
    #: proven: two engines use this engine id and rank
    shared: SharedEngineId | None = None


class DAgents:
    """See the module docstring. Writer thread only; bounded (:data:`ENGINES_MAX`
    engine ids and ranks, :data:`AGENTS_PER_RANK_MAX` agents each)."""

    def __init__(self) -> None:
        self._engines: OrderedDict[tuple[str, int], _RankAgents] = OrderedDict()

    def _of(self, engine_id: str, tp_rank: int) -> _RankAgents:
        key = (engine_id, tp_rank)
        entry = self._engines.get(key)
        if entry is None:
            entry = self._engines[key] = _RankAgents()
            while len(self._engines) > ENGINES_MAX:
                self._engines.popitem(last=False)
        self._engines.move_to_end(key)
        return entry

    def observe(self, engine_id: str, tp_rank: int, agent: str | None) -> SharedEngineId | None:
        """P is connected to ``agent`` for that engine and rank now (None: to none).
        Returns the proof that two engines share the engine id the first time the agents
        read alternate (see the module docstring), else None."""
        if agent is None:
            return None
        entry = self._of(engine_id, tp_rank)
        entry.retired.discard(agent)  # connected again: no longer retired
        if entry.seen and entry.seen[-1] == agent:
            return None
        came_back = agent in entry.seen
        if came_back:
            entry.seen.remove(agent)
        other = entry.seen[-1] if entry.seen else None
        entry.seen.append(agent)
        del entry.seen[:-AGENTS_PER_RANK_MAX]
        if not came_back or other is None or entry.shared is not None:
            return None
        entry.shared = SharedEngineId(engine_id, tp_rank, served=agent, other=other)
        return entry.shared

    def retire(self, engine_id: str, agents: dict[int, str]) -> None:
        """P forgot these agents (by rank) on a restart and left them loaded in NIXL."""
        for rank, agent in agents.items():
            entry = self._of(engine_id, rank)
            entry.retired.add(agent)
            if agent not in entry.seen:
                entry.seen.append(agent)
                del entry.seen[:-AGENTS_PER_RANK_MAX]
            entry.retired &= set(entry.seen)  # (bounded with them)

    def unload(self, engine_id: str, agents: dict[int, str]) -> None:
        """P removed these agents (by rank) from NIXL: no longer reachable."""
        for rank, agent in agents.items():
            entry = self._engines.get((engine_id, rank))
            if entry is not None:
                entry.retired.discard(agent)

    def reachable(self, engine_id: str, tp_rank: int, agent: str) -> bool:
        """``agent`` is one P connected for that engine and rank and retired on a
        restart: P's own handshake learned it as D's, and NIXL still holds it."""
        entry = self._engines.get((engine_id, tp_rank))
        return entry is not None and agent in entry.retired

    def shared(self, engine_id: str, tp_rank: int, agent: str) -> SharedEngineId | None:
        """The proof that two engines use this engine id and rank, if ``agent`` is an
        agent P connected there before the one it serves now (refused: another engine,
        or an older process of one); None otherwise."""
        entry = self._engines.get((engine_id, tp_rank))
        if entry is None or entry.shared is None or agent not in entry.seen[:-1]:
            return None
        return dataclasses.replace(entry.shared, served=entry.seen[-1], other=agent)
