# SPDX-License-Identifier: Apache-2.0
"""The fault harness's pieces that run without engines: the NIXL shim's rules and
events (on a stand-in agent class), the table audit, the soak summary and the
foreign agent's messages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from devkit.testing.faults import audit, foreign, nixl_shim, soak
from devkit.testing.faults.client import Outcome
from vllm_ext.nixl_push.wire import Completion


class Agent:
    """Stands in for nixl_agent: records sends, hands out queued notifications."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.inbox: dict[str, list[bytes]] = {}
        self.states: dict[int, list[str]] = {}
        self.next_handle = 100

    def send_notif(self, remote_agent_name, notif_msg, backend=None):
        self.sent.append((remote_agent_name, notif_msg))

    def get_new_notifs(self, backends=[]):  # noqa: B006 (nixl's signature)
        out, self.inbox = self.inbox, {}
        return out

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent, notif_msg=b"",
                        backends=[]):  # noqa: B006  # fmt: skip
        self.next_handle += 1
        return Handle(self.next_handle)

    def transfer(self, handle, notif_msg=b""):
        return self.states.get(handle._handle, ["PROC"]).pop(0)

    def check_xfer_state(self, handle):
        return (
            self.states.get(handle._handle, ["DONE"]).pop(0)
            if self.states.get(handle._handle)
            else "DONE"
        )


class Handle:
    def __init__(self, value: int) -> None:
        self._handle = value


def reg(rid: str) -> bytes:
    return b"PUSH_REG:" + msgpack.packb({"request_id": rid, "port": 1, "engine_id": "D"})


@pytest.fixture
def shim(tmp_path: Path):
    nixl_shim._installed = False
    cls = type("FakeAgent", (Agent,), {})
    inj = nixl_shim.Injector(tmp_path, "decode")
    nixl_shim.install(cls, inj)
    yield cls, inj, tmp_path
    nixl_shim._installed = False


def set_rules(folder: Path, rules: list[dict]) -> None:
    nixl_shim.rules_path(folder, "decode").write_text(json.dumps({"rules": rules}))
    time.sleep(nixl_shim.RELOAD_INTERVAL_S * 2)


def events(folder: Path) -> list[dict]:
    return [json.loads(x) for x in nixl_shim.events_path(folder, "decode").read_text().split("\n")
            if x]  # fmt: skip


def test_classify() -> None:
    assert nixl_shim.classify(reg("r1")) == ("PUSH_REG", "r1")
    assert nixl_shim.classify(b"cmpl-x-0-ab:1") == ("completion", "cmpl-x-0-ab")
    # the completion P sends a D whose PUSH_REG carried a reply token (S-WIR-3)
    done = Completion("cmpl-x-0-ab", 1, "t" * 32).encode()
    assert nixl_shim.classify(done) == ("completion", "cmpl-x-0-ab")
    assert nixl_shim.classify(b"HB:a,b") == ("HB", None)
    assert nixl_shim.classify(b"\xff\xfe") == ("other", None)
    assert nixl_shim.classify(b"PUSH_REG:\xc1") == ("other", None)


def test_drop_only_the_matching_message_and_only_times(shim) -> None:
    cls, inj, folder = shim
    set_rules(folder, [{"id": "a", "on": "send", "prefix": "PUSH_REG:", "match": "fltA",
                        "action": "drop", "times": 1}])  # fmt: skip
    a = cls()
    a.send_notif("P", reg("cmpl-fltA-0"))
    a.send_notif("P", reg("cmpl-fltB-0"))
    a.send_notif("P", reg("cmpl-fltA-0"))  # the rule is spent
    assert [nixl_shim.classify(m)[1] for _, m in a.sent] == ["cmpl-fltB-0", "cmpl-fltA-0"]
    kinds = [(e["ev"], e.get("rid")) for e in events(folder)]
    assert ("dropped", "cmpl-fltA-0") in kinds and ("rule", "cmpl-fltA-0") in kinds


def test_dup_and_delay_leave_on_later_calls(shim) -> None:
    cls, inj, folder = shim
    set_rules(folder, [
        {"id": "d", "on": "send", "match": "dup", "action": "dup"},
        {"id": "l", "on": "send", "match": "late", "action": "delay", "delay_s": 0.2},
    ])  # fmt: skip
    a = cls()
    a.send_notif("P", reg("dup"))
    assert len(a.sent) == 2
    a.send_notif("P", reg("late"))
    assert len(a.sent) == 2
    a.get_new_notifs()
    assert len(a.sent) == 2  # not due yet
    time.sleep(0.25)
    a.get_new_notifs()
    assert [nixl_shim.classify(m)[1] for _, m in a.sent] == ["dup", "dup", "late"]


def test_rewrite_changes_keys(shim) -> None:
    cls, inj, folder = shim
    set_rules(folder, [{"id": "r", "on": "send", "match": "x1", "action": "rewrite",
                        "set": {"port": 9, "engine_id": "gone"}}])  # fmt: skip
    a = cls()
    a.send_notif("P", reg("x1"))
    body = msgpack.unpackb(a.sent[0][1][len(b"PUSH_REG:") :])
    assert body == {"request_id": "x1", "port": 9, "engine_id": "gone"}


def test_recv_rules_and_events(shim) -> None:
    cls, inj, folder = shim
    set_rules(folder, [{"id": "r", "on": "recv", "match": "gone", "action": "drop"}])
    a = cls()
    a.inbox = {"P": [b"cmpl-gone-0:1", b"cmpl-kept-0:1"]}
    assert a.get_new_notifs() == {"P": [b"cmpl-kept-0:1"]}
    assert any(e["ev"] == "recv" and e["rid"] == "cmpl-kept-0" for e in events(folder))


def test_transfer_events_and_stall(shim) -> None:
    cls, inj, folder = shim
    set_rules(folder, [{"id": "s", "on": "transfer", "match": "slow", "action": "stall",
                        "delay_s": 0.2}])  # fmt: skip
    a = cls()
    h = a.initialize_xfer("WRITE", None, None, "D", b"cmpl-slow-0:1")
    a.states[h._handle] = ["PROC", "PROC", "DONE"]
    t0 = time.monotonic()
    assert a.transfer(h) == "PROC"
    assert time.monotonic() - t0 >= 0.2
    assert a.check_xfer_state(h) == "PROC"
    assert a.check_xfer_state(h) == "DONE"
    evs = [(e["ev"], e.get("rid"), e.get("state")) for e in events(folder)]
    assert ("xfer_post", "cmpl-slow-0", "PROC") in evs
    assert ("xfer_end", "cmpl-slow-0", "DONE") in evs


def test_kill_rule_kills_the_named_process_group(shim, tmp_path: Path) -> None:
    cls, inj, folder = shim
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              start_new_session=True)  # fmt: skip
    try:
        set_rules(folder, [{"id": "k", "on": "transfer", "match": "boom", "action": "kill",
                            "pid": victim.pid, "when": "after"}])  # fmt: skip
        a = cls()
        h = a.initialize_xfer("WRITE", None, None, "D", notif_msg=b"cmpl-boom-0:1")
        a.transfer(h)
        assert victim.wait(10) == -signal.SIGKILL
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)


def test_bad_rules_file_keeps_working(shim) -> None:
    cls, inj, folder = shim
    nixl_shim.rules_path(folder, "decode").write_text("{not json")
    time.sleep(0.05)
    a = cls()
    a.send_notif("P", reg("z"))
    assert len(a.sent) == 1
    assert any(e["ev"] == "rules_error" for e in events(folder))


def test_grown_tables_ignores_caches() -> None:
    base = {"worker.w._inflight": 0, "worker.w._remote_agents": 1, "sched.s._reqs_need_send": 0}
    after = {"worker.w._inflight": 2, "worker.w._remote_agents": 2, "sched.s._reqs_need_send": 0}
    assert audit.grown_tables(base, after, after) == {"worker.w._inflight": [0, 2, 2]}


def test_fault_result_verdicts() -> None:
    r = audit.FaultResult("f", "ours", "loopback", t_fault=0.0)
    r.affected = [Outcome("a", 10, kind="error", status=502, message="decode leg failed",
                          t0=0.0, t1=5.0)]  # fmt: skip
    r.leaked_blocks = {"decode": 0}
    assert r.verdict(40) == "clean"
    r.affected[0].t1 = 61.0
    r.affected[0].status = 504
    assert "request ended only after 61s (504)" in r.problems(40)
    r.leaked_blocks = {"decode": 24}
    assert "24 KV blocks leaked on decode" in r.problems(40)


def test_a_lasting_fault_is_judged_from_its_end() -> None:
    """A 45 s partition: the request it hit cannot end before the link is back (D keeps
    the blocks until P answers, S-SAFE-1); it ends 11 s after that, within the bound."""
    r = audit.FaultResult("link-cut-long", "ours", "netns", t_fault=0.0, t_fault_end=45.0)
    r.affected = [Outcome("a", 10, kind="error", status=502, message="decode leg failed",
                          t0=0.0, t1=56.0)]  # fmt: skip
    assert r.problems(40) == []
    r.affected[0].t1 = 86.0
    assert r.problems(40) == ["request ended only after 86s (502)"]
    r.affected[0].t1, r.affected[0].status = 50.0, 504  # the proxy's bound: always reported
    assert r.problems(40) == ["request ended only after 50s (504)"]


def test_the_table_shows_the_time_to_recovery() -> None:
    from devkit.testing.faults.runner import outcome_cell

    r = audit.FaultResult("link-cut-long", "ours", "netns", t_fault=0.0, t_fault_end=45.0)
    r.affected = [Outcome("a", 10, kind="error", status=502, message="decode leg failed",
                          t0=0.0, t1=30.0)]  # fmt: skip
    r.leaked_blocks = {"decode": 0, "prefill": 0}
    cell = outcome_cell(r.summary(40))
    assert cell.startswith("clean:") and "serves again" not in cell  # not measured
    r.recovered_s = 3.4
    assert outcome_cell(r.summary(40)).endswith("; serves again 3.4s after the fault")


def test_soak_summary() -> None:
    recs = [
        {"kind": "none", "outcome": "ok", "status": 200, "elapsed": 1.0, "wrong": False},
        {"kind": "drop-reg", "outcome": "error", "status": 502, "elapsed": 20.0, "wrong": False},
        {"kind": "drop-reg", "outcome": "error", "status": 502, "elapsed": 22.0, "wrong": False},
    ]
    rows = {r["kind"]: r for r in soak.summarize(recs)}
    assert rows["drop-reg"]["errors"] == 2 and rows["drop-reg"]["time_to_error_max"] == 22.0
    assert rows["none"]["ok"] == 1


def test_foreign_messages_cover_every_parser_branch() -> None:
    import random

    msgs = foreign.malformed_messages(22, random.Random(0))
    assert b"" in msgs and any(m.startswith(b"PUSH_REG:") for m in msgs)
    assert any(len(m) >= 1 << 20 for m in msgs)
    body = msgpack.unpackb(foreign.push_reg("r", "E", 9)[len(b"PUSH_REG:") :])
    # both our format and vLLM 0.32's keys are present
    assert body["request_id"] == "r" and body["decode_engine_id"] == "E" and body["port"] == 9


def test_the_rendezvous_memos_bounded_in_age_are_not_reported_as_leaks() -> None:
    """P remembers evicted requests and D's cancelled registrations (tombstones) for
    ``gone_ttl`` by design; an idle pair that holds some is not leaking. The small soak
    failed on this before the tombstones were listed."""
    from devkit.testing.faults.introspect import _walk
    from vllm_ext.nixl_push.matching import Rendezvous

    def tables(rv: Rendezvous) -> dict[str, int]:
        out: dict[str, int] = {}
        _walk(rv, "worker.rendezvous", out, 0, set())
        return out

    rv = Rendezvous(p_tp_size=1)
    base = tables(rv)
    rv.remember_cancelled(("D", "req-1", 0), "agent-D", now=0.0, verified=True)
    after = tables(rv)
    assert after["worker.rendezvous._cancelled"] == 1
    assert audit.grown_tables(base, after, after) == {}
