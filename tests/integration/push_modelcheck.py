# SPDX-License-Identifier: Apache-2.0
"""The safety oracle of the push model check: whose KV lands in which D block, and when.

Invariant: **a byte written into a D block belongs to the request that block was
registered for, and only while it is registered.** A D block is registered to a D
request from the moment D's scheduler hands its registration to the workers
(``build_connector_meta``) until D reports the request ``finished_recving`` (vLLM
frees or reuses the blocks from then on).

KV content identifies its request: the fake forward pass on P fills every block of
every running P request with a code derived from its prompt (exact in bf16), so the
bytes that land say whose KV they are. The fake fabric calls :meth:`KvOwnership.landed`
the moment a WRITE's bytes land (``FakeNixlFabric.observe_writes``); each D block
touched must then be registered to the request the WRITE's notification names, and
hold that request's prompt code.

Only harness-level APIs are used (the scheduler half's ``build_connector_meta``, the
engine's ``on_recved`` hook, the model runner's ``forward`` callback), so the oracle
does not depend on how push matches or frees internally.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import torch
from push_harness import DTYPE, Engine, Rank

from vllm_ext.testing.fake_nixl import WriteLanding

#: Violation kinds (the report counts them).
FREED = "landed in a D block registered to no request (D let it go)"
OTHER_REQUEST = "landed in a D block registered to another request"
WRONG_KV = "carried another request's KV"


class KvOwnership:
    """Owns nothing: observes P (fills KV), D (registrations, releases) and the fabric."""

    def __init__(self, p: Engine, d: Engine) -> None:
        assert p.spec.tp == 1 and d.spec.tp == 1, "the oracle maps tp 1 engines"
        assert not d.spec.enable_prefix_caching
        self.p, self.d = p, d
        self._lock = threading.Lock()
        self._codes: dict[tuple[int, ...], int] = {}
        #: D physical block -> the D request it is registered to
        self.owner: dict[int, str] = {}
        #: D request -> the code of its prompt
        self.d_code: dict[str, int] = {}
        #: (kind, detail) of every violation seen, in order
        self.violations: list[tuple[str, str]] = []
        self.landings = 0
        # D's KV tensors: (base address, bytes, bytes per physical block)
        self._d_tensors = [
            (t.data_ptr(), t.numel() * t.element_size(), t.stride(0) * t.element_size())
            for t in d.ranks[0].caches.values()
        ]
        self._wrap_d_scheduler()
        d.on_recved.append(self._released)
        p.fabric.observe_writes(self.landed)

    # -- content ---------------------------------------------------------------------
    def code_of(self, prompt: Sequence[int]) -> int:
        """A small integer per distinct prompt (1..255: exact in bf16)."""
        key = tuple(prompt)
        with self._lock:
            if key not in self._codes:
                self._codes[key] = len(self._codes) % 255 + 1
            return self._codes[key]

    def fill(self, rank: Rank) -> None:
        """P's forward pass: every running request's blocks hold its prompt's code."""
        sched = self.p.scheduler
        for req in list(sched.running):
            (ids,) = sched.kv_cache_manager.get_block_ids(req.request_id)
            blocks = self.p.physical(ids)
            code = float(self.code_of(req.prompt_token_ids or ()))
            for t in rank.caches.values():
                t[blocks] = code

    # -- D's registrations -----------------------------------------------------------------
    def _wrap_d_scheduler(self) -> None:
        sched = self.d.sched
        original = sched.build_connector_meta

        def build_connector_meta(scheduler_output):  # type: ignore[no-untyped-def]
            meta = original(scheduler_output)
            for rid, reg in meta.push_registrations.items():
                req = self.d.scheduler.requests[rid]
                code = self.code_of(req.prompt_token_ids or ())
                with self._lock:
                    self.d_code[rid] = code
                    for b in self.d.physical(reg.block_ids[0]):
                        self.owner[b] = rid
            return meta

        sched.build_connector_meta = build_connector_meta  # type: ignore[method-assign]

    def _released(self, request_ids: set[str]) -> None:
        with self._lock:
            for b, rid in list(self.owner.items()):
                if rid in request_ids:
                    del self.owner[b]

    # -- the fabric ---------------------------------------------------------------------
    def _d_blocks(self, addr: int, length: int) -> list[int]:
        for base, size, per_block in self._d_tensors:
            if base <= addr < base + size:
                first = (addr - base) // per_block
                last = (addr + length - 1 - base) // per_block
                return list(range(first, last + 1))
        return []

    def landed(self, w: WriteLanding) -> None:
        """A WRITE's bytes just landed (the fabric's thread, under its lock)."""
        if w.target not in {a.name for a in self.d.agents}:
            return
        # The completion names the D request; a chunk WRITE (push_progressive) carries
        # none: it must stay within the blocks of one registered request.
        d_rid = w.notif.rsplit(b":", 1)[0].decode(errors="replace") if w.notif else None
        with self._lock:
            self.landings += 1
            for _, remote, length in w.spans:
                raw = ctypes.string_at(remote, length)
                codes = set(torch.frombuffer(bytearray(raw), dtype=DTYPE).unique().tolist())
                for b in self._d_blocks(remote, length):
                    owner = self.owner.get(b)
                    if owner is None:
                        self._violate(FREED, f"WRITE for {d_rid} -> D block {b}")
                    elif d_rid is None:
                        d_rid = owner  # the request of the chunk WRITE's first block
                    elif owner != d_rid:
                        self._violate(OTHER_REQUEST, f"WRITE for {d_rid} -> D block {b} of {owner}")
                want = self.d_code.get(d_rid) if d_rid is not None else None
                if codes != {want}:
                    self._violate(
                        WRONG_KV,
                        f"WRITE for {d_rid} (prompt code {want}) carried prompt codes "
                        f"{sorted(codes)[:4]}",
                    )

    def _violate(self, kind: str, detail: str) -> None:
        if (kind, detail) not in self.violations:
            self.violations.append((kind, detail))

    def report(self) -> str:
        return "\n".join(f"  {kind}: {detail}" for kind, detail in self.violations)
