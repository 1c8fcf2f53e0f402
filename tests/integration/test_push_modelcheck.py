# SPDX-License-Identifier: Apache-2.0
"""A randomized model check of push's safety (Hypothesis stateful testing).

Real vLLM Schedulers and push connector workers (1P1D, tp 1) over the fake NIXL
fabric, which misbehaves like a network and like UCX (fake_nixl/, "Pessimistic like
UCX"): it holds notifications and delivers them late and out of order, drops them,
replays old ones, delivers completions long after their data, lets notifications
overtake earlier WRITEs' data, hangs WRITEs and completes them later in any order,
lets ``check_xfer_state`` raise, lands part of failed WRITEs, and lets WRITEs released
in flight land later; a peer forges notifications in P's name. Rules send client
requests (1..3 prompts: sub-requests ``cmpl-X-<i>-<8hex>``, or n > 1: children
``<j>_cmpl-X-0-<8hex>``; one transfer_id per client body, other random suffixes on P
and D), add their D and P legs in any order, run local requests on P (no push: they
take the blocks P frees, small pools reuse them at once), step the engines, abort,
let deadlines pass (small timeouts), hold and release handshakes (``HandshakeGate``).

The invariant (push_modelcheck.py; its truth is vLLM's block tables and pools, and KV
coded per request pair and block position): **a byte written into a D block belongs
to the request that block was registered for, and only while it is registered; D
serves only its request's KV.**

Each example starts with a client body (and maybe a fault of the first WRITE); its
legs not sent by the rules come at the end, hung WRITEs stay in flight past every
deadline (``LINGER``) and then complete, and the engines drain, so every example
writes, and a WRITE still reading blocks P freed reads a local request's KV.

The default run is short (``SHORT``, derandomized: the same examples every run);
the long one (random examples, broader variants) is behind the ``modelcheck_long``
marker::

    pytest tests/integration/test_push_modelcheck.py              # short, ~3 min (2 cores)
    pytest -m modelcheck_long tests/integration/test_push_modelcheck.py

``HybridKv`` (sliding-window and full-attention layers: two KV cache groups) runs on
vLLM 0.32 and later only (0.23 refuses a hybrid D; CI runs it on 0.32.0 alone).
``PPProducer`` runs the whole model with P in two pipeline stages (each WRITEs its
own layers, with a completion of its own), on every pinned vLLM; ``PPTPProducer`` the
same with each stage at TP 2 (four P ranks into one D rank, each writing half the heads).

A failure prints the shrunk rule sequence (Hypothesis' "Falsifying example") and
the violation; ``modelcheck: ... found after`` lines count the examples and steps it
took to find the first one.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, ClassVar
from unittest import mock

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine as hypothesis_engine
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)
from push_harness import HandshakeGate, PushEnv, join_stopped_listeners, pending_regs
from push_modelcheck import KvOwnership
from vllm.v1.request import RequestStatus

from devkit.testing.fake_nixl import NotifRecord
from devkit.testing.tiny_model import build_tiny_model
from vllm_ext import compat_nixl
from vllm_ext.nixl_push.wire import (
    PUSH_CANCEL_PREFIX,
    PUSH_FAIL_PREFIX,
    PUSH_HB_PREFIX,
    PUSH_REG_PREFIX,
    PushFailed,
    PushHeartbeat,
)

#: P's TCP user timeout: the rest of a failed WRITE lands within twice that of its
#: ERR or never (N-REL-2; the fabric drops it then). D keeps the default (its
#: N-LIV-1 bound stays out of the examples: the fabric's failed sends to P do not
#: end P's WRITEs, as a dead connection would).
P_TCP_USER_TIMEOUT_S = 0.15
P_CONFIG = {
    "kv_lease_duration": 2.0,
    "push_write_timeout_s": 0.2,
    "ucx_tcp_user_timeout_s": P_TCP_USER_TIMEOUT_S,
}
#: (push_quarantine_s -1: blocks of silent producers are held until they answer, the
#: strict mode whose invariant this check asserts)
D_CONFIG = {
    "push_registration_timeout_s": 0.4,
    "push_cancel_answer_timeout_s": 0.15,
    "push_quarantine_s": -1,
}
#: D's TCP user timeout where links are cut (``Partitions``): as P's, so that D counts
#: a silent P gone (N-LIV-1) within an example
D_PARTITION_CONFIG = {
    "ucx_tcp_user_timeout_s": P_TCP_USER_TIMEOUT_S,
    "push_handshake_backoff_s": 0.1,
}
#: longer than D takes to count a silent P gone after its watchdog (0.4 s) fired: the
#: cancel's send fails after T, then 2 x T, checked each answer period (0.15 s), and
#: not before P's hold of a registration it never renewed (T + 0.8 x 0.4 s) ended
LONG_PARTITION_S = 1.5
PROMPT_LEN = 36  # three 16-token blocks
#: the prefix prompts share where D's prefix cache is on (two blocks)
SHARED_PREFIX = [(k * 13) % 997 + 3 for k in range(32)]

SHORT = settings(
    max_examples=20, stateful_step_count=14, deadline=None, derandomize=True, print_blob=True
)
LONG = settings(max_examples=400, stateful_step_count=30, deadline=None, print_blob=True)

#: which notifications the network holds (delays, then releases in any order or drops)
HOLD = {
    "nothing": None,
    "registrations": (PUSH_REG_PREFIX,),
    "cancels": (PUSH_CANCEL_PREFIX,),
    "answers": (PUSH_FAIL_PREFIX, PUSH_HB_PREFIX, "xfer"),
    "completions": ("xfer",),  # a WRITE's data is in place, its notification comes later
    "all": (PUSH_REG_PREFIX, PUSH_CANCEL_PREFIX, PUSH_FAIL_PREFIX, PUSH_HB_PREFIX, "xfer"),
}
REPLAYABLE = (PUSH_REG_PREFIX, PUSH_CANCEL_PREFIX)
FORGERIES = ("PUSH_HB", "completion", "PUSH_FAIL")


def _holds(what: tuple[Any, ...]) -> Any:
    def pred(rec: NotifRecord) -> bool:
        return any(rec.via == w if isinstance(w, str) else rec.msg.startswith(w) for w in what)

    return pred


def _hex8(n: int, side: str) -> str:
    return f"{side}{n:07x}"  # 8 hex digits; P's and D's differ


class PushSafety(RuleBasedStateMachine):
    """The whole model; subclasses narrow it with the class flags below."""

    MAX_PROMPTS: ClassVar[int] = 3  # >1: multi-prompt bodies
    CHILDREN: ClassVar[bool] = True  # n > 1 bodies
    GATES: ClassVar[bool] = True  # handshakes held and released late
    ABORTS: ClassVar[bool] = True
    NETWORK: ClassVar[bool] = True  # hold / release / drop / replay / reorder
    HANGS: ClassVar[bool] = True  # WRITEs held in flight; check_xfer_state raising
    HOLD_D_HANDSHAKE: ClassVar[bool] = False  # D's first handshake always held
    ABORT_SIDES: ClassVar[tuple[str, ...]] = ("D", "P")
    #: the WRITE faults drawn, and how long let_time_pass may last
    WRITE_FAULTS: ClassVar[tuple[str, ...]] = ("hang", "hang_uncancellable", "state_raise", "state")
    PAUSES: ClassVar[tuple[float, ...]] = (0.05, 0.25)
    #: more of P's engine settings (e.g. chunk-progressive push)
    P_ENGINE: ClassVar[dict[str, Any]] = {}
    #: small pools: freed blocks are reused at once (P: 3 requests of 3 blocks, D: 4)
    P_BLOCKS: ClassVar[int] = 10
    D_BLOCKS: ClassVar[int] = 14
    #: requests on P without push (they take and fill the blocks P frees): drawn by a
    #: rule, and a filler before a step of an idle P that takes every free block
    LOCAL_REQUESTS: ClassVar[bool] = True
    #: D's prefix cache on, prompts sharing their first two blocks
    D_PREFIX_CACHING: ClassVar[bool] = False
    #: a failed WRITE may land part of its bytes before its ERR
    PARTIAL_FAILURES: ClassVar[bool] = True
    #: the rest of a failed WRITE lands after its ERR, within P's bound (N-REL-2; a
    #: WRITE released in flight lands in every machine: N-REL-1)
    LATE_FAILURES: ClassVar[bool] = True
    #: the share of failed WRITEs whose rest may land past that bound (seeded)
    LATE_REST: ClassVar[float] = 0.0
    #: notifications a peer sends D in P's name (S-WIR-3: without the registration's
    #: reply token, which only the P its PUSH_REG reached knows)
    FORGED: ClassVar[tuple[str, ...]] = FORGERIES
    #: links between P and D cut and healed as UCX over TCP sees it (the fabric's
    #: ``ucx_partitions``), D's TCP user timeout as small as P's: a cut may outlast
    #: D's give-up (N-LIV-1) and heal after it
    PARTITIONS: ClassVar[bool] = False
    #: more of D's settings
    D_EXTRA: ClassVar[dict[str, Any]] = {}
    #: hybrid KV on P and D: sliding-window and full-attention layers (two KV cache
    #: groups; vLLM 0.32 and later), prompts of PROMPT_TOKENS
    SLIDING_WINDOW: ClassVar[int | None] = None
    PROMPT_TOKENS: ClassVar[int] = PROMPT_LEN

    #: how long hung WRITEs stay in flight at the end of an example (past P's write
    #: timeout and release bound, and D's watchdog)
    LINGER: ClassVar[float] = 0.5
    #: examples in the short run (SHORT); a deadline-driven machine spends its time in
    #: let_time_pass
    EXAMPLES: ClassVar[int] = 15

    examples: ClassVar[int] = 0
    steps: ClassVar[int] = 0
    found: ClassVar[str | None] = None
    #: what the examples exercised: landings on D (late ones), requests D served
    landed: ClassVar[int] = 0
    landed_late: ClassVar[int] = 0
    served: ClassVar[int] = 0
    prefix_hits: ClassVar[int] = 0
    #: P requests vLLM preempted after they were announced (by vLLM's preempted ids)
    announced_preempted: ClassVar[int] = 0
    #: partitions: D counted P gone (N-LIV-1), P ended D's registrations and unposted
    #: WRITEs when it dropped its failed connection
    producers_lost: ClassVar[int] = 0
    ended_on_heal: ClassVar[int] = 0
    started: ClassVar[float] = 0.0

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        cls.examples += 1
        self.env: PushEnv | None = None
        self.bodies = 0
        self.locals = 0
        self.unsent_d: list[tuple[str, list[int], str]] = []
        self.unsent_p: list[tuple[str, list[int], str]] = []
        #: D request -> the P request of its pair
        self.p_leg_of: dict[str, str] = {}
        self.gates: dict[str, HandshakeGate] = {}
        self.my_steps = 0
        #: P request -> vLLM's count of its preemptions when it was announced
        self.preemptions_at_announce: dict[str, int] = {}

    # -- set-up -------------------------------------------------------------------------
    @initialize(
        hold_d=st.booleans(),
        hold_p=st.booleans(),
        prompts=st.integers(1, 3),
        children=st.integers(1, 3),
        fault=st.integers(0, 15),
    )
    def start(self, hold_d: bool, hold_p: bool, prompts: int, children: int, fault: int) -> None:
        """The engines, a first client body (its legs come when the rules say, or at
        the end), and maybe a fault of the first WRITE."""
        self.env = PushEnv(build_tiny_model())
        hybrid = {"sliding_window": self.SLIDING_WINDOW} if self.SLIDING_WINDOW else {}
        self.p, self.d = self.env.pair(
            p_kw={
                **hybrid,
                "enable_prefix_caching": False,
                "num_blocks": self.P_BLOCKS,
                **self.P_ENGINE,
                "extra_config": {**P_CONFIG, **self.P_ENGINE.get("extra_config", {})},
            },
            d_kw={
                **hybrid,
                "enable_prefix_caching": self.D_PREFIX_CACHING,
                "num_blocks": self.D_BLOCKS,
                "extra_config": {
                    **D_CONFIG,
                    **(D_PARTITION_CONFIG if self.PARTITIONS else {}),
                    **self.D_EXTRA,
                },
            },
        )
        self.oracle = KvOwnership(self.p, self.d)
        fabric = self.env.fabric
        if self.GATES and (hold_d or self.HOLD_D_HANDSHAKE):
            self.gates["D"] = HandshakeGate(self.d.workers[0])  # D -> P, before PUSH_REG
        if self.GATES and hold_p:
            self.gates["P"] = HandshakeGate(self.p.workers[0])  # P -> D, before the WRITE
        if self.D_PREFIX_CACHING:
            self._warm_prefix()
        if self.LATE_REST or self.PARTITIONS:
            fabric.ucx_partitions(seed=fault, late_rest=self.LATE_REST)
        if self.HANGS and fault < len(self.WRITE_FAULTS):
            fabric.fail_next_transfer(self.WRITE_FAULTS[fault], initiator=self._p_agent(fault))
        self._body(prompts, children)

    def _warm_prefix(self) -> None:
        """One request served before the rules run: D's prefix cache holds the shared
        prefix, so the bodies that follow find it there."""
        d_rid, p_rid = "cmpl-0-0-d0000000", "cmpl-0-0-a0000000"
        prompt = SHARED_PREFIX + [1, 2, 3, 4]
        self.oracle.pair(p_rid, d_rid)
        self.d.add_request(d_rid, prompt, self.p.d_leg("tid-0"), max_tokens=2)
        self.p.add_request(p_rid, prompt, self.p.p_leg("tid-0"))
        end = time.monotonic() + 3.0
        while d_rid not in self.d.finished and time.monotonic() < end:
            self._step()

    def _count(self) -> None:
        """Every rule: the engines take a step first (they run all the time)."""
        type(self).steps += 1
        self.my_steps += 1
        self._step()

    # -- clients ------------------------------------------------------------------------
    def _prompt(self, x: int, i: int) -> list[int]:
        own = [(x * 97 + i * 31 + k * 7) % 1000 + 3 for k in range(self.PROMPT_TOKENS)]
        if self.D_PREFIX_CACHING:
            return SHARED_PREFIX + own[len(SHARED_PREFIX) :]
        return own

    @rule(prompts=st.integers(1, 3), children=st.integers(1, 3))
    def client_request(self, prompts: int, children: int) -> None:
        """One client body: its sub-requests (multi-prompt) or children (n > 1)."""
        self._count()
        self._body(prompts, children)

    def _body(self, prompts: int, children: int) -> None:
        x = self.bodies = self.bodies + 1
        prompts = min(prompts, self.MAX_PROMPTS)
        children = children if self.CHILDREN and prompts == 1 else 1
        tid = f"tid-{x}"
        for i in range(prompts):
            prompt = self._prompt(x, i)
            for j in range(children):
                n = x * 16 + i * 4 + j
                head = f"{j}_" if children > 1 else ""
                d_rid = f"{head}cmpl-{x}-{i}-{_hex8(n, 'd')}"
                p_rid = f"{head}cmpl-{x}-{i}-{_hex8(n, 'a')}"
                self.oracle.pair(p_rid, d_rid)  # the test knows the legs it made
                self.p_leg_of[d_rid] = p_rid
                self.unsent_d.append((d_rid, prompt, tid))
                self.unsent_p.append((p_rid, prompt, tid))

    @precondition(lambda self: self.unsent_d)
    @rule(pick=st.integers(0, 8))
    def d_leg(self, pick: int) -> None:
        self._count()
        rid, prompt, tid = self.unsent_d.pop(pick % len(self.unsent_d))
        self.d.add_request(rid, prompt, self.p.d_leg(tid), max_tokens=2)

    @precondition(lambda self: self.unsent_p)
    @rule(pick=st.integers(0, 8))
    def p_leg(self, pick: int) -> None:
        self._count()
        rid, prompt, tid = self.unsent_p.pop(pick % len(self.unsent_p))
        self.p.add_request(rid, prompt, self.p.p_leg(tid))

    @precondition(lambda self: self.LOCAL_REQUESTS)
    @rule(tokens=st.integers(1, 3))
    def p_local_request(self, tokens: int) -> None:
        """A request on P alone (no push): it takes blocks P freed and fills them."""
        self._count()
        k = self.locals = self.locals + 1
        prompt = [(k * 53 + t * 11) % 1000 + 3 for t in range(self.PROMPT_TOKENS)]
        self.p.add_request(f"local-{k}", prompt, None, max_tokens=tokens)

    # -- time ---------------------------------------------------------------------------
    def _fill_free_blocks(self) -> None:
        """With nothing else on P, a local request takes every free block (the least
        recently freed last): a WRITE that reads blocks P freed reads its KV."""
        sched = self.p.scheduler
        free = self.p.free_blocks()
        if sched.waiting or sched.running or not free:
            return
        # (each KV cache group takes a block per 16 tokens of a prefill)
        per_group = free // (2 if self.SLIDING_WINDOW else 1)
        if not per_group:
            return
        self.fillers = getattr(self, "fillers", 0) + 1
        prompt = [(self.fillers * 31 + t * 3) % 1000 + 3 for t in range(16 * per_group - 4)]
        self.p.add_request(f"filler-{self.fillers}", prompt, None)

    def _step(self) -> None:
        if self.LOCAL_REQUESTS:
            self._fill_free_blocks()
        self.p.engine_step(forward=self.oracle.fill)
        for rid in self.p.ranks[0].metas[-1].push_prefill_done:
            req = self.p.scheduler.requests.get(rid)
            if req is not None:
                self.preemptions_at_announce.setdefault(rid, req.num_preemptions)
        self.d.engine_step()
        time.sleep(0.002)

    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        self._count()
        for _ in range(n):
            self._step()

    @rule(data=st.data())
    def let_time_pass(self, data: st.DataObject) -> None:
        """The engines keep stepping; deadlines (watchdog, cancel answer, lease,
        WRITE) may pass."""
        self._count()
        seconds = data.draw(st.sampled_from(self.PAUSES), label="seconds")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._step()

    # -- faults -------------------------------------------------------------------------
    @precondition(lambda self: self.ABORTS)
    @rule(pick=st.integers(0, 8), side=st.sampled_from(["D", "P"]))
    def abort(self, pick: int, side: str) -> None:
        self._count()
        eng = self.d if side == "D" else self.p
        if side not in self.ABORT_SIDES:
            return
        live = sorted(r for r, q in eng.scheduler.requests.items() if not q.is_finished())
        if live:
            eng.scheduler.finish_requests(live[pick % len(live)], RequestStatus.FINISHED_ABORTED)

    @precondition(lambda self: self.gates)
    @rule(which=st.sampled_from(["D", "P"]))
    def handshake_completes(self, which: str) -> None:
        self._count()
        if which in self.gates:
            self.gates[which].open()

    @precondition(lambda self: self.HANGS)
    @rule(data=st.data())
    def next_write_misbehaves(self, data: st.DataObject) -> None:
        self._count()
        kind = data.draw(st.sampled_from(self.WRITE_FAULTS), label="kind")
        # (a draw of the stage only where P has several: the other machines' examples
        # stay as they were)
        pick = data.draw(st.integers(0, 7), label="stage") if len(self.p.agents) > 1 else 0
        self.env.fabric.fail_next_transfer(kind, initiator=self._p_agent(pick))

    def _p_agent(self, pick: int) -> str:
        """One of P's agents (with PP, a stage's: each stage WRITEs its own layers)."""
        return self.p.agents[pick % len(self.p.agents)].name

    @precondition(lambda self: self.HANGS)
    @rule(pick=st.integers(0, 8))
    def a_hung_write_completes(self, pick: int) -> None:
        self._count()
        pending = self.env.fabric.pending_transfers()
        if pending:
            self.env.fabric.complete(pending[pick % len(pending)])

    @precondition(lambda self: self.HANGS and self.PARTIAL_FAILURES)
    @rule(part=st.sampled_from([None, 0.3, 0.7]))
    def failed_writes_land_in_part(self, part: float | None) -> None:
        """From now on a failed WRITE lands ``part`` of its bytes first (and the rest
        may follow late, where LATE_FAILURES)."""
        self._count()
        self.env.fabric.failed_writes_land(
            part, later=self.LATE_FAILURES, within_s=2 * P_TCP_USER_TIMEOUT_S
        )

    @precondition(lambda self: self.HANGS)
    @rule(pick=st.integers(0, 8), part=st.sampled_from([0.5, 1.0]), notify=st.booleans())
    def a_detached_write_lands(self, pick: int, part: float, notify: bool) -> None:
        """Bytes of a WRITE P no longer watches (released in flight, the rest of a
        failed one) land now, maybe with its notification (beyond N-REL-1)."""
        self._count()
        late = self.env.fabric.detached()
        if late:
            self.env.fabric.land_detached(pick % len(late), part, notify=notify)

    @precondition(lambda self: self.NETWORK)
    @rule(what=st.sampled_from(sorted(HOLD)))
    def network_holds(self, what: str) -> None:
        self._count()
        held = HOLD[what]
        self.env.fabric.hold_notifs(None if held is None else _holds(held))

    @precondition(lambda self: self.NETWORK)
    @rule(pick=st.integers(0, 8), deliver=st.booleans())
    def network_releases(self, pick: int, deliver: bool) -> None:
        """A held notification arrives now (maybe after later ones), or is lost."""
        self._count()
        held = self.env.fabric.held_notifs()
        if held:
            i = pick % len(held)
            (self.env.fabric.release_held if deliver else self.env.fabric.drop_held)(i)

    @precondition(lambda self: self.NETWORK)
    @rule(pick=st.integers(0, 8))
    def network_replays(self, pick: int) -> None:
        """A notification delivered earlier arrives again (duplicated)."""
        self._count()
        past = [
            n for n in self.env.fabric.notifications()
            if n.via != "inject" and n.msg.startswith(REPLAYABLE)
        ]  # fmt: skip
        if past:
            n = past[pick % len(past)]
            self.env.fabric.inject_notif(n.receiver, n.sender, n.msg)

    @precondition(lambda self: self.NETWORK)
    @rule(on=st.booleans())
    def network_reorders(self, on: bool) -> None:
        """Landings newest first: a later WRITE's data and notification overtake the
        data of an earlier one still on the way."""
        self._count()
        self.env.fabric.reorder_landings(on)

    def _links(self) -> list[tuple[str, str]]:
        return [(p.name, d.name) for p in self.p.agents for d in self.d.agents]

    @precondition(lambda self: self.PARTITIONS)
    @rule()
    def link_cut(self) -> None:
        """P and D can no longer reach each other (nothing fails at once: sends queue,
        WRITEs stall, each side's endpoint fails once a send waited its T)."""
        self._count()
        for a, b in self._links():
            self.env.fabric.cut_link(a, b)

    @precondition(lambda self: self.PARTITIONS and self.unsent_d)
    @rule(pick=st.integers(0, 8))
    def d_leg_then_its_p_leg(self, pick: int) -> None:
        """A D leg, and its P leg once P holds its registration (P's request then
        awaits it, renewing it with PUSH_HB, while it prefills)."""
        self._count()
        rid, prompt, tid = self.unsent_d.pop(pick % len(self.unsent_d))
        self.d.add_request(rid, prompt, self.p.d_leg(tid), max_tokens=2)
        p_rid = self.p_leg_of[rid]
        legs = [leg for leg in self.unsent_p if leg[0] == p_rid]
        end = time.monotonic() + 1.0
        while time.monotonic() < end and not pending_regs(self.p.workers[0]):
            self.d.engine_step()
            time.sleep(0.002)
        if legs:
            self.unsent_p.remove(legs[0])
            self.p.add_request(p_rid, prompt, self.p.p_leg(tid))

    @precondition(lambda self: self.PARTITIONS)
    @rule()
    def long_partition_while_p_is_busy(self) -> None:
        """The link is cut while P's engine thread is busy elsewhere (a long forward
        pass: only D steps; P's writer thread runs on), for longer than D takes to
        count P gone, then heals; P's requests go on from where they were."""
        self._count()
        for a, b in self._links():
            self.env.fabric.cut_link(a, b)
        end = time.monotonic() + LONG_PARTITION_S
        while time.monotonic() < end:
            self.d.engine_step()
            time.sleep(0.002)
        for a, b in self._links():
            self.env.fabric.restore_link(a, b)

    @precondition(lambda self: self.PARTITIONS)
    @rule()
    def link_heals(self) -> None:
        """The link is back: what UCX still queued is delivered, stalled WRITEs go on;
        endpoints that failed stay failed."""
        self._count()
        for a, b in self._links():
            self.env.fabric.restore_link(a, b)

    @precondition(lambda self: self.FORGED)
    @rule(data=st.data(), pick=st.integers(0, 8))
    def forged_notification(self, data: st.DataObject, pick: int) -> None:
        """A peer sends D a notification naming P's agent as its sender."""
        self._count()
        kind = data.draw(st.sampled_from(self.FORGED), label="forged")
        live = sorted(r for r in self.oracle.regs if r not in self.d.recv_reports)
        if not live:
            return
        rid = live[pick % len(live)]
        msg = {
            "PUSH_HB": PushHeartbeat((rid,)).encode(),
            "completion": f"{rid}:1".encode(),
            "PUSH_FAIL": PushFailed(rid, "forged").encode(),
        }[kind]
        self.env.fabric.inject_notif(self.d.agents[0].name, self._p_agent(pick), msg)

    # -- the invariant ------------------------------------------------------------------------
    # The oracle records each violation the moment the WRITE lands (or D serves); the
    # example fails at its end (teardown), not at the step where it landed: the writer
    # threads run on their own, so that step varies from run to run, while the rules
    # drawn must not (Hypothesis replays and shrinks them).
    def _check(self, when: str) -> None:
        if not self.oracle.violations:
            return
        cls = type(self)
        if cls.found is None:
            cls.found = self.oracle.violations[0][0]
            print(
                f"modelcheck: {cls.__name__}: first violation ({cls.found}) found after "
                f"{cls.examples} examples, {cls.steps} steps in all, step {self.my_steps} "
                f"of its example ({when}), {time.monotonic() - cls.started:.1f} s"
            )
        raise AssertionError(f"push safety violated ({when}):\n{self.oracle.report()}")

    def _progress(self) -> None:
        """The fabric completes everything in flight; detached WRITEs land (N-REL-1)."""
        self.env.fabric.progress()

    def _drain(self, seconds: float, done: Any) -> None:
        """Step (at least 5 times) until ``done()`` with nothing in flight on the
        fabric, for ``seconds`` at most. (P may hold unmatched legs under their lease
        longer: nothing of theirs can reach D's blocks once D is idle.)"""
        end, n = time.monotonic() + seconds, 0
        fabric = self.env.fabric
        while time.monotonic() < end:
            self._step()
            self._progress()
            n += 1
            if n >= 5 and done() and not fabric.pending_transfers() and not fabric.detached():
                return

    def _announced_preempted(self) -> int:
        """P requests vLLM preempted after the step that announced them (vLLM's count
        of a request's preemptions, then and at the end)."""
        requests = {**self.p.finished, **self.p.scheduler.requests}
        return sum(
            1 for rid, n in self.preemptions_at_announce.items()
            if rid in requests and requests[rid].num_preemptions > n
        )  # fmt: skip

    def teardown(self) -> None:
        env = self.env
        if env is None:
            return
        try:
            # Let everything that is still in flight land: handshakes end, the network
            # delivers what it held, hung WRITEs complete, clients go away.
            for gate in self.gates.values():
                gate.open()
            if self.PARTITIONS:
                for a, b in self._links():
                    env.fabric.restore_link(a, b)
            env.fabric.hold_notifs(None)
            while env.fabric.held_notifs():
                env.fabric.release_held(0)
            # The legs not sent yet come now (D's first: no P leg waits for a lease).
            while self.unsent_d:
                rid, prompt, tid = self.unsent_d.pop(0)
                self.d.add_request(rid, prompt, self.p.d_leg(tid), max_tokens=2)
            while self.unsent_p:
                rid, prompt, tid = self.unsent_p.pop(0)
                self.p.add_request(rid, prompt, self.p.p_leg(tid))
            for _ in range(10):
                self._step()
            if env.fabric.pending_transfers():
                # NIXL holds the hung WRITEs past every deadline (P's write timeout and
                # release bound, D's watchdog) before it completes them.
                end = time.monotonic() + self.LINGER
                while time.monotonic() < end:
                    self._step()
            # The engines serve what they can before the clients go away.
            self._drain(1.0, lambda: not self.d.scheduler.has_requests())
            for eng in (self.p, self.d):
                for rid, req in list(eng.scheduler.requests.items()):
                    if not req.is_finished():
                        eng.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            self._drain(1.0, lambda: self.d.idle())
            cls = type(self)
            cls.landed += self.oracle.landings
            cls.landed_late += sum(1 for x in self.oracle.landed if x.how != "done")
            cls.served += sum(self.oracle.served.values())
            cls.prefix_hits += sum(1 for r in self.oracle.regs.values() if r.first)
            cls.announced_preempted += self._announced_preempted()
            cls.producers_lost += int(self.d.totals("push_producers_lost"))
            cls.ended_on_heal += int(self.p.totals("push_regs_ended_on_heal"))
            self._check("draining at the end")
        finally:
            # (leaked NIXL handles after a violation are not what this test checks)
            with contextlib.suppress(AssertionError):
                env.close()


class MultiPromptBodies(PushSafety):
    """Multi-prompt and n > 1 bodies on a well-behaved network (local requests on P
    reuse the blocks)."""

    GATES = ABORTS = NETWORK = HANGS = False
    FORGED = ()
    PAUSES = (0.05,)  # no deadline matters here
    EXAMPLES = 10


class LateHandshakes(PushSafety):
    """Single-prompt bodies; handshakes held, aborts and deadlines."""

    MAX_PROMPTS = 1
    CHILDREN = NETWORK = HANGS = False
    HOLD_D_HANDSHAKE = True
    FORGED = ()


class LateWrites(PushSafety):
    """Single-prompt bodies; a misbehaving network and WRITEs held in flight."""

    MAX_PROMPTS = 1
    CHILDREN = GATES = False


class LateHandshakeReplay(LateHandshakes):
    """D's handshake with P held while D's deadlines pass, then released."""

    ABORT_SIDES = ("D",)
    PAUSES = (0.5,)
    EXAMPLES = 6


class StaleWrites(LateWrites):
    """WRITEs NIXL cannot cancel, registrations replayed after their cancel."""

    ABORT_SIDES = ("D",)
    WRITE_FAULTS = ("hang_uncancellable", "hang_state_raise")
    PAUSES = (0.25, 0.5)


class ProgressivePrompts(PushSafety):
    """Chunk-progressive push (S-PRG-1): P prefills each prompt in 16-token chunks and
    writes each chunk's full blocks before the prompt ends; the same faults, aborts and
    deadlines (a chunk WRITE that hangs, fails or outlives its request)."""

    P_ENGINE = {"max_num_batched_tokens": 16, "extra_config": {"push_progressive": True}}
    EXAMPLES = 12


class DPrefixCache(PushSafety):
    """D's prefix cache on, prompts sharing their first two blocks: a D request that
    finds them cached registers only its last block, which P must write alone (and no
    WRITE may touch the cached ones, which other requests share)."""

    D_PREFIX_CACHING = True
    GATES = False


class AsyncPreemption(PushSafety):
    """vLLM's asynchronous scheduling on P (its default on GPU engines): each step is
    scheduled before the previous step's output is processed, and P runs out of blocks
    (local requests that decode on, prefix-cache resets) while an announced request's
    step is in flight, so vLLM preempts it and hands its blocks to another request in
    that very step (S-SAFE-1, "Preempted after it was announced")."""

    P_ENGINE = {"async_scheduling": True}
    GATES = NETWORK = HANGS = False  # (the rules left mostly add, step and preempt)
    FORGED = ()
    EXAMPLES = 30

    # (rules of this machine only: rules added to PushSafety would change the examples
    # the other machines draw)
    @rule(tokens=st.integers(8, 30))
    def p_decoding_request(self, tokens: int) -> None:
        """A request on P alone that decodes on: each block it needs next may make
        vLLM preempt the last running request, maybe one announced in the step in
        flight (async scheduling)."""
        self._count()
        k = self.locals = self.locals + 1
        prompt = [(k * 59 + t * 17) % 1000 + 3 for t in range(PROMPT_LEN)]
        self.p.add_request(f"local-{k}", prompt, None, max_tokens=tokens)

    @rule()
    def p_resets_prefix_cache(self) -> None:
        """``reset_prefix_cache(reset_running_requests=True)`` while a step is in
        flight (the next one that announces a P leg, if one comes within a few steps):
        vLLM preempts every running request, outside its schedule."""
        self._count()
        for _ in range(4):
            if self.p.ranks[0].metas[-1].push_prefill_done:
                break
            self._step()
        with contextlib.suppress(RuntimeError):  # blocks held for WRITEs: no reset
            self.p.scheduler.reset_prefix_cache(reset_running_requests=True)


class LateFailedWrites(LateWrites):
    """The rest of failed WRITEs landing after their ERR (N-REL-2)."""

    WRITE_FAULTS = ("state", "state_raise", "hang", "hang_uncancellable")


class RestPastTheBound(LateFailedWrites):
    """As :class:`LateFailedWrites`, and half of the failed WRITEs' rest may land up to
    3 x later than the 2 x T bound the code assumes (N-REL-2; UCX promises no bound:
    the fake's ``ucx_partitions(late_rest=)``)."""

    LATE_REST = 0.5


class Partitions(PushSafety):
    """Links between P and D cut, for longer than D takes to count P gone (its
    watchdog, its cancel's failed send, then 2 x T: N-LIV-1) or not, and healed: D
    reuses the blocks of a request it gave up, and P, holding that request's
    registration or an unposted WRITE, must not write them once the link is back."""

    PARTITIONS = True
    GATES = False
    HANGS = False
    NETWORK = False
    FORGED = ()
    #: P prefills in 16-token chunks: its requests stay live (their registrations
    #: awaited, heartbeated) over several steps
    #: (a handshake that failed during a cut is tried again soon after the link is back)
    P_ENGINE = {"max_num_batched_tokens": 16, "extra_config": {"push_handshake_backoff_s": 0.1}}
    PAUSES = (0.05, 0.4, 1.2)
    EXAMPLES = 15


class PartitionsWhileRenewed(Partitions):
    """As :class:`Partitions`, where P keeps a registration it renewed longer than D
    takes to count it gone: D's registration timeout is long (P's hold of a renewed
    registration, 0.8 x that since its last renewal, 2.4 s) and its heartbeat timeout
    short (0.4 s: D's watchdog fires that long after P's last PUSH_HB), so D gives a
    cut-off P up (N-LIV-1) and reuses the blocks while P still holds the registration.
    P must end what it holds of D when it drops its failed connection, even when its
    next handshake with D succeeds."""

    D_EXTRA = {"push_registration_timeout_s": 3.0, "push_heartbeat_timeout_s": 0.4}
    EXAMPLES = 6

    # (a rule of this machine only: see AsyncPreemption)
    @precondition(lambda self: self.unsent_d)
    @rule(pick=st.integers(0, 8))
    def link_back_before_p_writes(self, pick: int) -> None:
        """P holds D's registration for a request it prefills (renewing it), the link
        is cut while P's engine thread is busy elsewhere until P dropped its failed
        connection to D (its heartbeat's send waited T) and D counted P gone (N-LIV-1)
        and gave the blocks back, and the link is back before P tries D again: P's
        next handshake with D succeeds, no failed one in between. P's request then
        ends its prefill and must not write that registration, nor a WRITE it had not
        posted, into the blocks D gave away."""
        renewals = self.d.totals("push_heartbeats_received")
        self.d_leg_then_its_p_leg(pick)
        self._step()  # P's request is live (queued or prefilling its first chunk) ...
        end = time.monotonic() + 1.0  # ... and P's writer renews the registration
        while time.monotonic() < end and self.d.totals("push_heartbeats_received") == renewals:
            self.d.engine_step()
            time.sleep(0.002)
        p_healed, d_lost = self.p.totals("push_peers_healed"), self.d.totals("push_producers_lost")
        for a, b in self._links():
            self.env.fabric.cut_link(a, b)
        end = time.monotonic() + 2 * LONG_PARTITION_S
        while time.monotonic() < end and not (
            self.p.totals("push_peers_healed") > p_healed
            and self.d.totals("push_producers_lost") > d_lost
        ):
            self.d.engine_step()
            time.sleep(0.002)
        for a, b in self._links():
            self.env.fabric.restore_link(a, b)


class HybridKv(PushSafety):
    """Hybrid KV (S-HYB-1) under the whole model: sliding-window and full-attention
    layers, two KV cache groups sharing each KV tensor and one block pool, on P and D.
    Per group, a WRITE may touch only the blocks D's block table gives the request in
    that group, never the null block where the window holds none; D serves each group's
    blocks with that group's KV of that position (the oracle's GROUP_STRIDE)."""

    SLIDING_WINDOW = 40
    #: 6 blocks of 16: D's window holds the last 4 of them, the first 2 are null
    PROMPT_TOKENS = 84
    #: P: 2 prefills of both groups; D: 3 requests (10 blocks each)
    P_BLOCKS = 27
    D_BLOCKS = 34
    EXAMPLES = 8


class PPProducer(PushSafety):
    """The whole model with a pipeline-parallel P (S-PP-1..3): two stages, each holding
    half the layers, WRITE them to D (one stage) with completions of their own. Faults
    hit either stage's WRITEs (and forged notifications name either); D may serve a
    request only once every stage's layers are in place, and a stage's WRITE may land
    only in the layers it holds (the oracle's WRONG_STAGE)."""

    P_ENGINE = {"pp": 2}
    EXAMPLES = 8


class PPTPProducer(PPProducer):
    """:class:`PPProducer` with each stage at tensor parallel size 2 (four P ranks, one
    D rank): each rank WRITEs its stage's layers and its half of the heads, with a
    completion of its own; D may serve a request only once all four are in place."""

    P_ENGINE = {"pp": 2, "tp": 2}
    EXAMPLES = 6


# -- the long run only --------------------------------------------------------------------


class UcxEverything(PushSafety):
    """The whole model with every fault kind (long run only)."""


#: The default run: the focused machines (each found its bug on the code before the
#: fixes, in the long run: multi-prompt after 3 examples, the late handshake after 120,
#: stale WRITEs after 20), the rest of failed WRITEs landing late (N-REL-2; its short
#: run did not find the gap of the code before, the regression test did), partitions
#: (a P that kept D's registrations across a heal: ``PartitionsWhileRenewed``, in its
#: first examples; ``Partitions`` did not), the whole model and hybrid KV (a WRITE of
#: one group's KV into the other group's blocks, or into the null block, in its first
#: example) and a pipeline-parallel P (breaks made by hand, each found in its first
#: example: D ending a request at one stage's completion, served with the other
#: stage's layers unwritten; a stage routed into the other stage's layers, which only
#: the oracle's WRONG_STAGE tells) and one at TP 2 per stage (D ending a request at
#: three of its four completions: D's own state check raised IllegalTransition within
#: 12 examples); the long run adds the broader variants.
MACHINES = [
    MultiPromptBodies, LateHandshakeReplay, StaleWrites, PushSafety, ProgressivePrompts,
    DPrefixCache, AsyncPreemption, LateFailedWrites, Partitions, PartitionsWhileRenewed,
    HybridKv, PPProducer, PPTPProducer,
]  # fmt: skip
LONG_MACHINES = [*MACHINES, LateHandshakes, LateWrites, UcxEverything, RestPastTheBound]


def _run(machine: type[PushSafety], profile: settings, shrink_s: float | None) -> None:
    if machine.SLIDING_WINDOW and not compat_nixl.HYBRID_RECV:
        pytest.skip("vLLM 0.23 refuses a hybrid decode engine (test_push_hybrid.py)")
    machine.examples = machine.steps = machine.landed = machine.landed_late = 0
    machine.served = machine.prefix_hits = machine.announced_preempted = 0
    machine.producers_lost = machine.ended_on_heal = 0
    machine.found = None
    machine.started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if shrink_s is not None and hasattr(hypothesis_engine, "MAX_SHRINKING_SECONDS"):
            # Hypothesis shrinks for up to 5 minutes; an example here takes ~1 s.
            stack.enter_context(
                mock.patch.object(hypothesis_engine, "MAX_SHRINKING_SECONDS", shrink_s)
            )
        try:
            run_state_machine_as_test(machine, settings=profile)
        finally:
            join_stopped_listeners()
            print(
                f"modelcheck: {machine.__name__}: {machine.examples} examples, "
                f"{machine.steps} steps, {machine.landed} landings on D "
                f"({machine.landed_late} late or partial), {machine.served} requests served, "
                f"{machine.prefix_hits} registered after D's prefix cache, "
                f"{machine.announced_preempted} preempted after they were announced"
                + (
                    f", P counted gone {machine.producers_lost} times, "
                    f"{machine.ended_on_heal} registrations or WRITEs ended on a heal"
                    if machine.PARTITIONS
                    else ""
                )
            )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.__name__)
def test_push_is_safe(machine: type[PushSafety]) -> None:
    _run(machine, settings(SHORT, max_examples=machine.EXAMPLES), shrink_s=45)


@pytest.mark.modelcheck_long
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("machine", LONG_MACHINES, ids=lambda m: m.__name__)
def test_push_is_safe_long(machine: type[PushSafety]) -> None:
    _run(machine, LONG, shrink_s=None)
