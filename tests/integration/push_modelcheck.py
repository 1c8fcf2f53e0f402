# SPDX-License-Identifier: Apache-2.0
"""The safety oracle of the push model check: whose KV lands in which D block, and when.

Invariant (docs/design.md, S-SAFE-1): **a byte written into a D block belongs to the
request that block was registered for, and only while it is registered; D serves a
request only from blocks that hold that request's KV.** A D block is registered to a
D request from the moment D's scheduler hands the request's registration to the
workers (``build_connector_meta``) until D reports the request ``finished_recving``
(vLLM frees or reuses the blocks from then on).

Every truth here comes from vLLM or from the test, never from the connector:

* **Which D blocks a request has**: D's vLLM block table
  (``kv_cache_manager.get_block_ids``), each KV cache group's, read when its
  registration is handed to the workers, less the leading blocks vLLM found in D's
  prefix cache (``kv_cache_manager.get_computed_blocks``: D computed those itself, no
  WRITE may touch them) and less the null block (``compat.NULL_BLOCK_ID``, where a
  sliding window holds no block: no WRITE may touch it either).
* **Whether a block is free**: D's ``BlockPool`` (``ref_cnt`` 0, or in its free queue).
* **Whose KV a block holds**: P's fake forward pass writes into block ``i`` of P
  request ``R`` the code of ``R``'s pair in even elements and ``i + 1`` in odd ones
  (integers <= 256: exact in bf16), ``i + 1 + GROUP_STRIDE * g`` in KV cache group
  ``g`` (hybrid KV: a block of one group written into the other's is wrong KV). The
  test pairs each P request with its D request when it creates both legs
  (:meth:`KvOwnership.pair`), so ``n > 1`` children and the sub-requests of a
  multi-prompt body get codes of their own; P requests without a D leg (local ones)
  get codes of their own too.

Checks, each recorded as a violation:

* at every landing (``FakeNixlFabric.observe_writes``: whole WRITEs, the part a
  failed one landed, detached ones landing late), each touched D block (a) is
  registered to the request the WRITE is for (its completion ``<d_rid>:<tp>``; a
  chunk WRITE without one: one registered request for all its blocks), and (b) is in
  use in D's block pool, and (c) with a pipeline-parallel P, each touched D layer is
  one the writing P rank's stage holds (P's fill is the same in every layer: only
  where a WRITE lands tells a stage's layers from another's). What the bytes say (d)
  is recorded with the landing (:attr:`KvOwnership.landed`);
* when D reports a request received and serves it (not aborted, its blocks not
  reported invalid), every block it serves from (after its local prefix, before its
  first invalid block) holds its pair's code and its own position, in every layer
  (with PP: every stage's layers, so a stage's WRITE alone does not make it served).
  (A hybrid D fails a request per request, ``failed_recving``: none of it is served.)
  Wrong bytes that land in the blocks of a request D then fails, or that a later
  WRITE overwrites before D serves, are no violation (S-PRG-1 rewrites such blocks).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch
from push_harness import Engine, Rank, completion_or_none

from devkit.testing.fake_nixl import WriteLanding
from vllm_ext.compat import NULL_BLOCK_ID

#: Violation kinds (the report counts them).
FREED = "landed in a D block registered to no request (D let it go, or never gave it)"
POOL_FREE = "landed in a D block that D's block pool holds free"
OTHER_REQUEST = "landed in a D block registered to another request"
WRONG_KV = "D served a block that does not hold its request's KV at that position"
UNPAIRED = "the test did not pair this D request with a P request"
WRONG_STAGE = "landed in a D layer the P rank that wrote it does not hold (another stage's)"

#: pair codes are 1..PAIR_CODES, codes of P requests alone (local ones) the rest up to
#: 250: codes and positions stay exact in bf16, and a local request reusing a pair's
#: freed blocks never writes that pair's code
PAIR_CODES = 125
MAX_CODE = 250
#: the position code of KV cache group g starts at GROUP_STRIDE * g (positions < 64)
GROUP_STRIDE = 64


@dataclasses.dataclass(frozen=True)
class Reg:
    """A D request's blocks as vLLM allocated them, at its registration."""

    #: physical D blocks P may write, group by group, each in position order
    blocks: tuple[int, ...]
    #: the position (physical index in the request's block table) of ``blocks[0]``
    first: int
    #: of each of ``blocks``: (its KV cache group, its position, its logical id)
    where: tuple[tuple[int, int, int], ...]
    #: D's outputs before the registration (invalid blocks reported since count)
    since: int


@dataclasses.dataclass(frozen=True)
class Landed:
    """One landing as the oracle saw it: the D blocks touched, who owned each then,
    and what each held right after, ``(code, position)`` or None (anything else)."""

    for_request: str | None
    how: str
    whole: bool
    blocks: tuple[int, ...]
    owners: tuple[str | None, ...]
    holds: tuple[tuple[int, int] | None, ...]


def _decode(block: torch.Tensor) -> tuple[int, int] | None:
    """``(code, position)`` if a block (one layer) holds exactly one fill pattern."""
    flat = block.reshape(-1)
    even, odd = flat[0::2].unique(), flat[1::2].unique()
    if even.numel() != 1 or odd.numel() != 1:
        return None
    return int(even.item()), int(odd.item()) - 1


class KvOwnership:
    """Owns nothing: observes P (fills KV), D (registrations, releases) and the fabric."""

    def __init__(self, p: Engine, d: Engine) -> None:
        # D at tp 1: a D block is one span per layer. P at any tp: each rank fills its
        # heads with the same pattern, so a D block holds one pattern once every P
        # rank's WRITE of it landed (before, "no fill pattern": mixed).
        assert d.spec.tp == 1, "the oracle maps a tp 1 D"
        self.p, self.d = p, d
        self._lock = threading.RLock()
        self._next_pair = self._next_local = 0
        #: P and D request id -> the code of its pair (or of a P request alone)
        self.code: dict[str, int] = {}
        #: D physical block -> (the D request it is registered to, its position code)
        self.owner: dict[int, tuple[str, int]] = {}
        #: D request -> its blocks at registration
        self.regs: dict[str, Reg] = {}
        #: D request -> prompt tokens vLLM found in D's prefix cache
        self.local_tokens: dict[str, int] = {}
        #: every landing on D, in order
        self.landed: list[Landed] = []
        #: D requests checked when received: True if D served them
        self.served: dict[str, bool] = {}
        #: (kind, detail) of every violation seen, in order
        self.violations: list[tuple[str, str]] = []
        self._scheduled: dict[str, int] = {}
        self._d_tensors = [
            (t.data_ptr(), t.numel() * t.element_size(), t.stride(0) * t.element_size(), t, name)
            for name, t in d.ranks[0].caches.items()
        ]
        #: P agent -> the layers its rank holds (with PP, its stage's only)
        self._p_layers = {r.agent.name: set(r.caches) for r in p.ranks}
        self._watch_p()
        self._watch_d()
        d.on_recved.append(self._received)
        p.fabric.observe_writes(self._on_landing)

    @property
    def landings(self) -> int:
        return len(self.landed)

    # -- content ---------------------------------------------------------------------
    def _new_code(self, local: bool = False) -> int:
        if local:
            self._next_local = self._next_local % (MAX_CODE - PAIR_CODES) + 1
            return PAIR_CODES + self._next_local
        self._next_pair = self._next_pair % PAIR_CODES + 1
        return self._next_pair

    def pair(self, p_rid: str, d_rid: str) -> int:
        """The test made these two legs of one transfer: one code for both."""
        with self._lock:
            code = self.code[p_rid] = self.code[d_rid] = self._new_code()
            return code

    def code_of(self, p_rid: str) -> int:
        with self._lock:
            if p_rid not in self.code:
                self.code[p_rid] = self._new_code(local=True)  # a P request alone
            return self.code[p_rid]

    def fill(self, rank: Rank) -> None:
        """P's forward pass: the blocks of each scheduled request, up to the tokens it
        computes in this pass, hold (its pair's code, position)."""
        sched, bs = self.p.scheduler, self.p.spec.block_size
        for rid, n in self._scheduled.items():
            req = sched.requests.get(rid)
            if req is None:
                continue
            upto = -(-(req.num_computed_tokens + n) // bs)
            code = float(self.code_of(rid))
            for g, ids in enumerate(sched.kv_cache_manager.get_block_ids(rid)):
                for pos, b in enumerate(self.p.physical(ids[:upto])):
                    if b // self.p.spec.physical_per_logical == NULL_BLOCK_ID:
                        continue  # outside a sliding window
                    for t in rank.caches.values():
                        flat = t[b].view(-1)
                        flat[0::2] = code
                        flat[1::2] = float(pos + 1 + GROUP_STRIDE * g)

    def _watch_p(self) -> None:
        sched = self.p.scheduler
        schedule = sched.schedule

        def watched():  # type: ignore[no-untyped-def]
            out = schedule()
            self._scheduled = dict(out.num_scheduled_tokens)
            return out

        sched.schedule = watched  # type: ignore[method-assign]

    # -- D's registrations -------------------------------------------------------------
    def _recording_local_tokens(self, lookup):  # type: ignore[no-untyped-def]
        """vLLM's prefix-cache lookup, recording the tokens D found cached itself."""

        def recorded(request, *args, **kwargs):  # type: ignore[no-untyped-def]
            out = lookup(request, *args, **kwargs)  # (0.34: and max_cache_hit_length)
            with self._lock:
                self.local_tokens[request.request_id] = out[1]
            return out

        return recorded

    def _watch_d(self) -> None:
        d = self.d
        mgr = d.scheduler.kv_cache_manager
        # (vLLM 0.23: (blocks, tokens); 0.32: more fields, and a connector's own lookup)
        for name in ("get_computed_blocks", "get_computed_blocks_for_connector"):
            if hasattr(mgr, name):
                setattr(mgr, name, self._recording_local_tokens(getattr(mgr, name)))
        sched = d.sched
        build = sched.build_connector_meta

        def build_connector_meta(scheduler_output):  # type: ignore[no-untyped-def]
            meta = build(scheduler_output)
            for rid in meta.push_registrations:
                if rid in d.scheduler.requests:
                    self._registered(rid)
            return meta

        sched.build_connector_meta = build_connector_meta  # type: ignore[method-assign]

    def _registered(self, rid: str) -> None:
        per = self.d.spec.physical_per_logical
        local = self.local_tokens.get(rid, 0) // self.d.spec.block_size
        where: list[tuple[int, int, int]] = []
        blocks: list[int] = []
        for g, ids in enumerate(self.d.scheduler.kv_cache_manager.get_block_ids(rid)):
            for pos in range(local * per, len(ids) * per):
                if ids[pos // per] != NULL_BLOCK_ID:  # (a sliding window holds none there)
                    where.append((g, pos, ids[pos // per]))
                    blocks.append(ids[pos // per] * per + pos % per)
        reg = Reg(tuple(blocks), local * per, tuple(where), len(self.d.outputs))
        with self._lock:
            self.regs[rid] = reg
            for b, (g, pos, _) in zip(reg.blocks, reg.where):
                self.owner[b] = (rid, pos + GROUP_STRIDE * g)

    def _received(self, request_ids: set[str]) -> None:
        """D reports these received (their blocks are still allocated): from now on
        they are not registered; those D serves must hold their KV."""
        with self._lock:
            for b, (rid, _) in list(self.owner.items()):
                if rid in request_ids:
                    del self.owner[b]
            for rid in sorted(request_ids):
                reg = self.regs.get(rid)
                if reg is not None and rid not in self.served:
                    self.served[rid] = self._check_served(rid, reg)

    def _check_served(self, rid: str, reg: Reg) -> bool:
        req = self.d.scheduler.requests.get(rid)
        if req is None or req.is_finished():
            return False  # aborted: nothing is served
        invalid: set[int] = set()
        for out in self.d.outputs[reg.since :]:
            invalid |= out.invalid_block_ids
            if rid in (getattr(out, "failed_recving", None) or ()):
                return False  # failed per request (hybrid D, vLLM 0.32+): recomputed
        served: list[tuple[int, int]] = []
        broken: set[int] = set()  # groups past their first invalid block
        for b, (g, pos, logical) in zip(reg.blocks, reg.where):
            if logical in invalid:
                broken.add(g)
            if g not in broken:
                served.append((pos + GROUP_STRIDE * g, b))
        if not served:
            return False
        code = self.code.get(rid)
        if code is None:
            self._violate(UNPAIRED, rid)
            return True
        for pos, b in served:
            held = {_decode(t[b]) for *_, t, _ in self._d_tensors}
            if held != {(code, pos)}:
                what = ", ".join(sorted(self._name(h) for h in held))
                self._violate(
                    WRONG_KV,
                    f"{rid} (code {code}) served D block {b} at position {pos}, which holds {what}",
                )
        return True

    def _name(self, held: tuple[int, int] | None) -> str:
        if held is None:
            return "no fill pattern (never written, or mixed)"
        code, pos = held
        whose = sorted(r for r, c in self.code.items() if c == code) or ["?"]
        return f"code {code} ({'/'.join(whose)}) position {pos}"

    # -- the fabric ---------------------------------------------------------------------
    def _d_blocks(
        self, addr: int, length: int
    ) -> tuple[str | None, list[tuple[int, torch.Tensor]]]:
        """The D layer a span lands in, and its blocks there."""
        for base, size, per_block, t, layer in self._d_tensors:
            if base <= addr < base + size:
                first = (addr - base) // per_block
                last = (addr + length - 1 - base) // per_block
                return layer, [(b, t) for b in range(first, last + 1)]
        return None, []

    def _pool_free(self, physical: int) -> bool:
        pool = self.d.scheduler.kv_cache_manager.block_pool
        block = pool.blocks[physical // self.d.spec.physical_per_logical]
        queued = block.prev_free_block is not None or block.next_free_block is not None
        return block.ref_cnt == 0 or queued

    def _on_landing(self, w: WriteLanding) -> None:
        """A WRITE's bytes just landed (the fabric's thread, under its lock)."""
        if w.target not in {a.name for a in self.d.agents}:
            return
        # The completion names the D request; a chunk WRITE (push_progressive) carries
        # none: it must stay within the blocks of one registered request.
        done = completion_or_none(w.notif)
        d_rid = done[0] if done else None
        with self._lock:
            touched: dict[int, torch.Tensor] = {}
            held = self._p_layers.get(w.initiator)
            for _, remote, length in w.spans:
                layer, blocks_there = self._d_blocks(remote, length)
                touched.update(blocks_there)
                if held is not None and layer is not None and layer not in held:
                    self._violate(
                        WRONG_STAGE, f"{w.how} WRITE for {d_rid} by {w.initiator} -> D {layer}"
                    )
            blocks = sorted(touched)
            owners: list[str | None] = []
            for b in blocks:
                owner = self.owner.get(b)
                owners.append(owner[0] if owner else None)
                if owner is None:
                    self._violate(FREED, f"{w.how} WRITE for {d_rid} -> D block {b}")
                elif d_rid is None:
                    d_rid = owner[0]  # the request of the chunk WRITE's first block
                elif owner[0] != d_rid:
                    self._violate(
                        OTHER_REQUEST, f"{w.how} WRITE for {d_rid} -> D block {b} of {owner[0]}"
                    )
                if self._pool_free(b):
                    self._violate(POOL_FREE, f"{w.how} WRITE for {d_rid} -> D block {b}")
            holds = tuple(_decode(touched[b][b]) for b in blocks)
            self.landed.append(Landed(d_rid, w.how, w.whole, tuple(blocks), tuple(owners), holds))

    def _violate(self, kind: str, detail: str) -> None:
        if (kind, detail) not in self.violations:
            self.violations.append((kind, detail))

    def report(self) -> str:
        return "\n".join(f"  {kind}: {detail}" for kind, detail in self.violations)

    def describe(self, d_rid: str) -> dict[str, Any]:
        """What the oracle knows of one D request (for assertions' messages)."""
        with self._lock:
            return {
                "reg": self.regs.get(d_rid),
                "code": self.code.get(d_rid),
                "served": self.served.get(d_rid),
                "landed": [x for x in self.landed if x.for_request == d_rid],
            }
