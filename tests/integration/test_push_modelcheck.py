# SPDX-License-Identifier: Apache-2.0
"""A randomized model check of push's safety (Hypothesis stateful testing).

Real vLLM Schedulers and push connector workers (1P1D, tp 1) over the fake NIXL
fabric, which here misbehaves like a network: it holds notifications and delivers
them late and out of order, drops them, replays old ones (``inject_notif``), hangs
WRITEs and completes them later in any order, and lets ``check_xfer_state`` raise.
Rules send client requests (1..3 prompts: sub-requests ``cmpl-X-<i>-<8hex>``, or n > 1:
children ``<j>_cmpl-X-0-<8hex>``; one transfer_id per client body, other random
suffixes on P and D), add their D and P legs in any order, step the engines, abort,
let deadlines pass (small timeouts), hold and release handshakes (``HandshakeGate``).

The invariant (push_modelcheck.py), checked the moment each WRITE lands: **a byte
written into a D block belongs to the request that block was registered for, and
only while it is registered.**

The default run is short (``SHORT``, derandomized: the same examples every run); the
long one is behind the ``modelcheck_long`` marker::

    pytest tests/integration/test_push_modelcheck.py              # short, < 60 s
    pytest -m modelcheck_long tests/integration/test_push_modelcheck.py

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
from push_harness import HandshakeGate, PushEnv, join_stopped_listeners
from push_modelcheck import KvOwnership
from vllm.v1.request import RequestStatus

from vllm_ext.nixl_push.wire import (
    PUSH_CANCEL_PREFIX,
    PUSH_FAIL_PREFIX,
    PUSH_HB_PREFIX,
    PUSH_REG_PREFIX,
)
from vllm_ext.testing.fake_nixl import NotifRecord
from vllm_ext.testing.tiny_model import build_tiny_model

P_CONFIG = {"kv_lease_duration": 2.0, "push_write_timeout": 0.2}
#: (push_quarantine_s -1: blocks of silent producers are held until they answer, the
#: strict mode whose invariant this check asserts)
D_CONFIG = {
    "push_registration_timeout": 0.4,
    "push_cancel_answer_timeout": 0.15,
    "push_quarantine_s": -1,
}
PROMPT_LEN = 36  # three 16-token blocks

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
    "all": (PUSH_REG_PREFIX, PUSH_CANCEL_PREFIX, PUSH_FAIL_PREFIX, PUSH_HB_PREFIX, "xfer"),
}
REPLAYABLE = (PUSH_REG_PREFIX, PUSH_CANCEL_PREFIX)


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
    NETWORK: ClassVar[bool] = True  # hold / release / drop / replay notifications
    HANGS: ClassVar[bool] = True  # WRITEs held in flight; check_xfer_state raising
    HOLD_D_HANDSHAKE: ClassVar[bool] = False  # D's first handshake always held
    ABORT_SIDES: ClassVar[tuple[str, ...]] = ("D", "P")
    #: the WRITE faults drawn, and how long let_time_pass may last
    WRITE_FAULTS: ClassVar[tuple[str, ...]] = ("hang", "hang_uncancellable", "state_raise", "state")
    PAUSES: ClassVar[tuple[float, ...]] = (0.05, 0.25, 0.5)
    #: more of P's engine settings (e.g. chunk-progressive push)
    P_ENGINE: ClassVar[dict[str, Any]] = {}

    examples: ClassVar[int] = 0
    steps: ClassVar[int] = 0
    found: ClassVar[str | None] = None

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        cls.examples += 1
        self.env: PushEnv | None = None
        self.bodies = 0
        self.unsent_d: list[tuple[str, list[int], str]] = []
        self.unsent_p: list[tuple[str, list[int], str]] = []
        self.gates: dict[str, HandshakeGate] = {}
        self.my_steps = 0

    # -- set-up -------------------------------------------------------------------------
    @initialize(hold_d=st.booleans(), hold_p=st.booleans())
    def start(self, hold_d: bool, hold_p: bool) -> None:
        self.env = PushEnv(build_tiny_model())
        self.p, self.d = self.env.pair(
            p_kw={
                "enable_prefix_caching": False,
                **self.P_ENGINE,
                "extra_config": {**P_CONFIG, **self.P_ENGINE.get("extra_config", {})},
            },
            d_kw={"enable_prefix_caching": False, "extra_config": dict(D_CONFIG)},
        )
        self.oracle = KvOwnership(self.p, self.d)
        if self.GATES and (hold_d or self.HOLD_D_HANDSHAKE):
            self.gates["D"] = HandshakeGate(self.d.workers[0])  # D -> P, before PUSH_REG
        if self.GATES and hold_p:
            self.gates["P"] = HandshakeGate(self.p.workers[0])  # P -> D, before the WRITE

    def _count(self) -> None:
        type(self).steps += 1
        self.my_steps += 1

    # -- clients ------------------------------------------------------------------------
    @rule(prompts=st.integers(1, 3), children=st.integers(1, 3))
    def client_request(self, prompts: int, children: int) -> None:
        """One client body: its sub-requests (multi-prompt) or children (n > 1)."""
        self._count()
        x = self.bodies = self.bodies + 1
        prompts = min(prompts, self.MAX_PROMPTS)
        children = children if self.CHILDREN and prompts == 1 else 1
        tid = f"tid-{x}"
        for i in range(prompts):
            prompt = [(x * 97 + i * 31 + k * 7) % 1000 + 3 for k in range(PROMPT_LEN)]
            for j in range(children):
                n = x * 16 + i * 4 + j
                head = f"{j}_" if children > 1 else ""
                self.unsent_d.append((f"{head}cmpl-{x}-{i}-{_hex8(n, 'd')}", prompt, tid))
                self.unsent_p.append((f"{head}cmpl-{x}-{i}-{_hex8(n, 'a')}", prompt, tid))

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

    # -- time ---------------------------------------------------------------------------
    def _step(self) -> None:
        self.p.engine_step(forward=self.oracle.fill)
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
        self.env.fabric.fail_next_transfer(kind, initiator=self.p.agents[0].name)

    @precondition(lambda self: self.HANGS)
    @rule(pick=st.integers(0, 8))
    def a_hung_write_completes(self, pick: int) -> None:
        self._count()
        pending = self.env.fabric.pending_transfers()
        if pending:
            self.env.fabric.complete(pending[pick % len(pending)])

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

    # -- the invariant ------------------------------------------------------------------------
    # The oracle records each violation the moment the WRITE lands; the example fails at
    # its end (teardown), not at the step where it landed: the writer threads run on
    # their own, so that step varies from run to run, while the rules drawn must not
    # (Hypothesis replays and shrinks them).
    def _check(self, when: str) -> None:
        if not self.oracle.violations:
            return
        cls = type(self)
        if cls.found is None:
            cls.found = self.oracle.violations[0][0]
            print(
                f"modelcheck: {cls.__name__}: first violation ({cls.found}) found after "
                f"{cls.examples} examples, {cls.steps} steps in all, step {self.my_steps} "
                f"of its example ({when})"
            )
        raise AssertionError(f"push safety violated ({when}):\n{self.oracle.report()}")

    def teardown(self) -> None:
        env = self.env
        if env is None:
            return
        try:
            # Let everything that is still in flight land: handshakes end, the network
            # delivers what it held, hung WRITEs complete, clients go away.
            for gate in self.gates.values():
                gate.open()
            env.fabric.hold_notifs(None)
            while env.fabric.held_notifs():
                env.fabric.release_held(0)
            env.fabric.progress()
            for eng in (self.p, self.d):
                for rid, req in list(eng.scheduler.requests.items()):
                    if not req.is_finished():
                        eng.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            end = time.monotonic() + 1.0
            while time.monotonic() < end and not all(e.idle() for e in env.engines):
                self._step()
                env.fabric.progress()
            self._check("draining at the end")
        finally:
            # (leaked NIXL handles after a violation are not what this test checks)
            with contextlib.suppress(AssertionError):
                env.close()


class MultiPromptBodies(PushSafety):
    """Multi-prompt and n > 1 bodies on a well-behaved network."""

    GATES = ABORTS = NETWORK = HANGS = False


class LateHandshakes(PushSafety):
    """Single-prompt bodies; handshakes held, aborts and deadlines."""

    MAX_PROMPTS = 1
    CHILDREN = NETWORK = HANGS = False
    HOLD_D_HANDSHAKE = True


class LateWrites(PushSafety):
    """Single-prompt bodies; a misbehaving network and WRITEs held in flight."""

    MAX_PROMPTS = 1
    CHILDREN = GATES = False


class LateHandshakeReplay(LateHandshakes):
    """D's handshake with P held while D's deadlines pass, then released."""

    ABORT_SIDES = ("D",)
    PAUSES = (0.5,)


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


#: The default run: the focused machines (each found its bug on the code before the
#: fixes, in the long run: multi-prompt after 3 examples, the late handshake after 120,
#: stale WRITEs after 20) and the whole model; the long run adds the broader variants.
MACHINES = [MultiPromptBodies, LateHandshakeReplay, StaleWrites, PushSafety, ProgressivePrompts]
LONG_MACHINES = [*MACHINES, LateHandshakes, LateWrites]


def _run(machine: type[PushSafety], profile: settings, shrink_s: float | None) -> None:
    machine.examples = machine.steps = 0
    machine.found = None
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


@pytest.mark.timeout(600)
@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.__name__)
def test_push_is_safe(machine: type[PushSafety]) -> None:
    _run(machine, SHORT, shrink_s=45)


@pytest.mark.modelcheck_long
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("machine", LONG_MACHINES, ids=lambda m: m.__name__)
def test_push_is_safe_long(machine: type[PushSafety]) -> None:
    _run(machine, LONG, shrink_s=None)
