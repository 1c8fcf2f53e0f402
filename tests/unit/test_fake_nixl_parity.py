# SPDX-License-Identifier: Apache-2.0
"""The fake NIXL agent against the real one: one scenario run against the real
``nixl._api.nixl_agent`` (two agents in this process over UCX, DRAM tensors) and
against the fake, comparing what is observable (that keeps the fake honest); and links
cut as UCX over TCP sees them."""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from fake_nixl_pairs import Cfg, N, Pair, make_pair

from devkit.testing.fake_nixl import (
    FakeNixlAgent,
    FakeNixlBackendError,
    FakeNixlFabric,
)

# ---------------------------------------------------------------------- real NIXL parity


@pytest.fixture
def fabric() -> FakeNixlFabric:
    return FakeNixlFabric()


@pytest.fixture
def pair(fabric: FakeNixlFabric) -> Pair:
    return make_pair(fabric)


def _kind(e: BaseException) -> str:
    """'nixlNotFoundError' and 'FakeNixlNotFoundError' both give 'NotFound'."""
    return re.sub(r"^(FakeNixl|nixl)|Error$", "", type(e).__name__)


def _raises(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as e:  # the real binding's exceptions derive from Exception
        return _kind(e)
    return "no error"


def _wait_state(agent: Any, h: Any, first: str) -> list[str]:
    states = [first]
    deadline = time.monotonic() + 20
    while states[-1] == "PROC":
        assert time.monotonic() < deadline, "transfer did not complete"
        states.append(agent.check_xfer_state(h))
    return states


def _wait_notifs(agent: Any, want: int) -> dict[str, list[bytes]]:
    got: dict[str, list[bytes]] = {}
    deadline = time.monotonic() + 20
    while sum(map(len, got.values())) < want:
        assert time.monotonic() < deadline, f"notifications did not arrive: {got}"
        for k, v in agent.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
    return got


def _scenario(make_agent: Callable[[str], Any]) -> dict[str, Any]:
    """WRITE+notif and a few edge cases; returns what a connector could observe."""
    uid = uuid.uuid4().hex[:8]
    p, d = make_agent(f"p-{uid}"), make_agent(f"d-{uid}")
    roles = {p.name: "P", d.name: "D"}
    src = (torch.arange(N, dtype=torch.int32) * 7).to(torch.uint8)
    dst = torch.zeros(N, dtype=torch.uint8)
    regs = [
        (p, p.register_memory(p.get_reg_descs([(src.data_ptr(), N, 0, "")], "DRAM"))),
        (d, d.register_memory(d.get_reg_descs([(dst.data_ptr(), N, 0, "")], "DRAM"))),
    ]
    handles: list[Any] = []
    out: dict[str, Any] = {}
    try:
        d_name = p.add_remote_agent(d.get_agent_metadata())
        out["add_remote_agent"] = (type(d_name).__name__, roles[d_name.decode()])

        def descs(t: torch.Tensor, rows: list[tuple[int, int]]) -> Any:
            return p.get_xfer_descs([(t.data_ptr() + o, n, 0) for o, n in rows], "DRAM")

        rows = [(0, 64), (64, 64), (192, 32)]
        h = p.initialize_xfer("WRITE", descs(src, rows), descs(dst, rows), d_name, b"req-1:1")
        handles.append(h)
        out["state_before_post"] = _raises(lambda: p.check_xfer_state(h))
        states = _wait_state(p, h, p.transfer(h))
        out["states_end"] = states[-1]
        out["states_prefix"] = set(states[:-1]) <= {"PROC"}
        out["bytes_copied"] = dst[:128].equal(src[:128]) and dst[192:224].equal(src[192:224])
        out["bytes_untouched"] = int(dst[128:192].sum()) == 0 and int(dst[224:].sum()) == 0
        tel = p.get_xfer_telemetry(h)
        out["telemetry"] = (tel.totalBytes, tel.descCount)
        notifs = _wait_notifs(d, 1)
        out["notifs"] = {roles[k]: v for k, v in notifs.items()}

        # a prepped WRITE: NIXL merges consecutive, contiguous descriptors
        lh = p.prep_xfer_dlist("NIXL_INIT_AGENT", descs(src, [(16 * i, 16) for i in range(16)]))
        rh = p.prep_xfer_dlist(d_name, descs(dst, [(16 * i, 16) for i in range(16)]))
        handles += [lh, rh]
        counts = []
        for li, ri in ([0, 1, 2, 3], [4, 5, 6, 7]), ([0, 1, 3], [0, 1, 3]), ([3, 2], [3, 2]):
            x = p.make_prepped_xfer("WRITE", lh, li, rh, ri)
            handles.append(x)
            _wait_state(p, x, p.transfer(x))
            counts.append(p.get_xfer_telemetry(x).descCount)
        out["prepped_desc_counts"] = counts
        out["index_out_of_range"] = _raises(lambda: p.make_prepped_xfer("WRITE", lh, [16], rh, [0]))

        # errors a connector could hit
        out["unknown_agent_notif"] = _raises(lambda: p.send_notif("nobody", b"x"))
        out["reverse_without_add"] = _raises(lambda: d.send_notif(p.name, b"x"))
        out["outside_remote"] = _raises(
            lambda: p.initialize_xfer(
                "WRITE", descs(src, [(0, 16)]), descs(dst, [(N - 8, 16)]), d_name
            )
        )
        out["length_mismatch"] = _raises(
            lambda: p.initialize_xfer("WRITE", descs(src, [(0, 8)]), descs(dst, [(0, 16)]), d_name)
        )
        stale = p.make_prepped_xfer("WRITE", lh, [0], rh, [0], b"stale")
        handles.append(stale)
        p.remove_remote_agent(d_name)
        out["send_after_remove"] = _raises(lambda: p.send_notif(d_name, b"x"))
        p.add_remote_agent(d.get_agent_metadata())
        out["stale_handle_post"] = _raises(lambda: p.transfer(stale))
        p.remove_remote_agent(d_name)
    finally:
        for h in reversed(handles):
            h.release()
        for agent, reg in regs:
            agent.deregister_memory(reg)
    return out


EXPECTED = {
    "add_remote_agent": ("bytes", "D"),
    "state_before_post": "NotPosted",
    "states_end": "DONE",
    "states_prefix": True,
    "bytes_copied": True,
    "bytes_untouched": True,
    "telemetry": (160, 3),
    "notifs": {"P": [b"req-1:1"]},
    "prepped_desc_counts": [1, 2, 2],
    "index_out_of_range": "InvalidParam",
    "unknown_agent_notif": "NotFound",
    "reverse_without_add": "NotFound",
    "outside_remote": "NotFound",
    "length_mismatch": "InvalidParam",
    "send_after_remove": "NotFound",
    "stale_handle_post": "NotFound",
}


@pytest.fixture
def real_nixl_agents() -> Iterator[Callable[[str], Any]]:
    nixl_api = pytest.importorskip("nixl._api")
    agents: list[Any] = []

    def make(name: str) -> Any:
        try:
            cfg = nixl_api.nixl_agent_config(backends=["UCX"], capture_telemetry=True)
            agent = nixl_api.nixl_agent(name, cfg)
        except Exception as e:  # no UCX plugin on this machine
            pytest.skip(f"real NIXL agent unavailable: {e}")
        if "UCX" not in agent.backends:
            pytest.skip("NIXL UCX backend unavailable")
        agents.append(agent)
        return agent

    yield make
    agents.clear()  # the agents are destroyed with their last reference


@pytest.mark.timeout(60)
def test_parity_real_nixl(real_nixl_agents: Callable[[str], Any]) -> None:
    assert _scenario(real_nixl_agents) == EXPECTED


@pytest.mark.timeout(60)
def test_parity_fake_nixl(fabric: FakeNixlFabric) -> None:
    assert _scenario(lambda name: FakeNixlAgent(name, Cfg(), fabric=fabric)) == EXPECTED
    fabric.assert_no_leaks(include_memory=True)
    p = fabric.agents()[0]
    assert [r.state for r in fabric.transfers()] == ["DONE"] * 4
    assert p.calls("check_xfer_state")[0].thread == threading.current_thread().name


@pytest.mark.timeout(60)
def test_a_cut_link_fails_its_endpoints_until_the_peer_is_loaded_anew(pair: Pair) -> None:
    """Like UCX's endpoints after a partition that outlasted the keepalive: sends and
    new WRITEs fail, also after the link is back, until the peer is removed and loaded
    again (loading it again without removing keeps the failed endpoint)."""
    a, b, fabric = pair.a, pair.b, pair.fabric
    b.add_remote_agent(a.get_agent_metadata())
    fabric.cut_link("A", "B")
    for sender, to in ((a, "B"), (b, "A")):
        with pytest.raises(FakeNixlBackendError, match="endpoint"):
            sender.send_notif(to, b"lost")
    h = pair.write([(0, 8)])
    assert a.transfer(h) == "ERR"
    a.release_xfer_handle(h)
    a.remove_remote_agent("B")
    a.add_remote_agent(b.get_agent_metadata())  # during the cut: fails as well
    with pytest.raises(FakeNixlBackendError):
        a.send_notif("B", b"still cut")
    fabric.restore_link("A", "B")
    b.add_remote_agent(a.get_agent_metadata())  # not removed: still failed
    with pytest.raises(FakeNixlBackendError):
        b.send_notif("A", b"old endpoint")
    for sender, to, meta in ((a, "B", b), (b, "A", a)):
        sender.remove_remote_agent(to)
        sender.add_remote_agent(meta.get_agent_metadata())
        sender.send_notif(to, b"over a new endpoint")
    assert b.get_new_notifs() == {"A": [b"over a new endpoint"]}
    assert a.get_new_notifs() == {"B": [b"over a new endpoint"]}
    h = pair.write([(0, 8)])
    assert a.transfer(h) in ("PROC", "DONE")


# ------------------------------------------------------- cut links as UCX over TCP sees them


def _ucx_pair(monkeypatch: pytest.MonkeyPatch, t_a: str | None, t_b: str | None) -> Pair:
    """A pair on a fabric that models cut links as UCX does; each agent's TCP user
    timeout is ``UCX_TCP_USER_TIMEOUT`` as set while it was built (None: unset)."""
    fabric = FakeNixlFabric()
    fabric.ucx_partitions(seed=7)
    timeouts = {"A": t_a, "B": t_b}

    def env_of(name: str) -> None:
        if timeouts[name] is None:
            monkeypatch.delenv("UCX_TCP_USER_TIMEOUT", raising=False)
        else:
            monkeypatch.setenv("UCX_TCP_USER_TIMEOUT", str(timeouts[name]))

    p = make_pair(fabric, env_of)
    monkeypatch.delenv("UCX_TCP_USER_TIMEOUT", raising=False)
    p.b.add_remote_agent(p.a.get_agent_metadata())
    return p


def _until(cond: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "not reached"
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_each_agent_reads_its_tcp_user_timeout_when_it_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    p = _ucx_pair(monkeypatch, "300ms", None)
    assert p.a.tcp_user_timeout_s == pytest.approx(0.3)
    assert p.b.tcp_user_timeout_s == float("inf")  # unset: UCX's default, unbounded here
    monkeypatch.setenv("UCX_TCP_USER_TIMEOUT", "2s")
    assert p.a.tcp_user_timeout_s == pytest.approx(0.3)  # read once, as UCX does


@pytest.mark.timeout(60)
def test_a_send_over_a_cut_link_is_held_and_delivered_if_the_link_returns_within_t(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """UCX queues a send while the link is down; nothing fails at the cut. Back within
    the sender's T, what was sent arrives, in order."""
    p = _ucx_pair(monkeypatch, "5s", "5s")
    p.fabric.cut_link("A", "B")
    p.a.send_notif("B", b"one")  # no error: UCX took it
    p.a.send_notif("B", b"two")
    p.b.send_notif("A", b"back")
    assert p.b.get_new_notifs() == {} and len(p.fabric.queued_sends()) == 3
    p.fabric.restore_link("A", "B")
    assert p.b.get_new_notifs() == {"A": [b"one", b"two"]}
    assert p.a.get_new_notifs() == {"B": [b"back"]}
    p.a.send_notif("B", b"after")  # the endpoint never failed
    assert p.b.get_new_notifs() == {"A": [b"after"]}


@pytest.mark.timeout(60)
def test_a_held_send_is_lost_after_the_senders_t_and_each_side_has_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A's T is 0.2 s, B's 30 s: after 0.2 s A's endpoint has failed (its held send is
    lost, later ones raise), while B's send of the same moment is still held and
    arrives when the link returns."""
    p = _ucx_pair(monkeypatch, "0.2s", "30s")
    p.fabric.cut_link("A", "B")
    p.a.send_notif("B", b"from A")
    p.b.send_notif("A", b"from B")
    _until(lambda: [q.sender for q in p.fabric.queued_sends()] == ["B"])
    with pytest.raises(FakeNixlBackendError, match="endpoint"):
        p.a.send_notif("B", b"too late")
    p.fabric.restore_link("A", "B")
    assert p.b.get_new_notifs() == {}
    assert p.a.get_new_notifs() == {"B": [b"from B"]}
    with pytest.raises(FakeNixlBackendError):  # failed stays failed until loaded anew
        p.a.send_notif("B", b"still the old endpoint")


@pytest.mark.timeout(60)
def test_a_write_over_a_cut_link_stalls_then_fails_after_t_and_its_rest_lands_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Posted over the cut, a WRITE stays in flight; back within T it lands. Cut longer
    than the initiator's T, it ends in ERR and its bytes are still on the wire: they
    land when the link returns, within 2 x T of the error."""
    p = _ucx_pair(monkeypatch, "0.2s", None)
    p.fabric.cut_link("A", "B")
    quick = p.write([(0, 16)], b"quick")
    assert p.a.transfer(quick) == "PROC"
    p.fabric.restore_link("A", "B")
    _until(lambda: p.a.check_xfer_state(quick) == "DONE")
    assert p.dst[:16].equal(p.src[:16]) and p.b.get_new_notifs() == {"A": [b"quick"]}
    quick.release()
    p.fabric.cut_link("A", "B")
    slow = p.write([(64, 16)], b"slow")
    assert p.a.transfer(slow) == "PROC"
    assert {p.a.check_xfer_state(slow) for _ in range(3)} == {"PROC"}
    _until(lambda: p.a.check_xfer_state(slow) == "ERR")
    seen_err = time.monotonic()
    (rest,) = p.fabric.detached()
    assert rest.why == "cut" and rest.dies_at is not None
    assert rest.dies_at <= seen_err + 2 * 0.2  # late_rest off: within 2 x T of the error
    p.a.release_xfer_handle(slow)
    assert p.fabric.progress() == 0 and p.dst[64:80].sum().item() == 0  # still cut
    p.fabric.restore_link("A", "B")
    p.fabric.progress()
    assert p.dst[64:80].equal(p.src[64:80]) and p.b.get_new_notifs() == {}


@pytest.mark.timeout(60)
def test_the_rest_of_a_failed_write_may_land_past_two_t_at_random_seeded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``late_rest``, some failed WRITEs' rest may land later than 2 x T after the
    error (up to three times that); which ones follows the seed."""

    def bounds(seed: int) -> list[float]:
        fabric = FakeNixlFabric()
        fabric.ucx_partitions(seed=seed, late_rest=0.5)
        fabric.failed_writes_land(0.5, later=True, within_s=2.0)  # T = 1 s
        p = make_pair(fabric)
        out = []
        for i in range(12):
            fabric.fail_next_transfer("state")
            h = p.write([(i * 16, 16)])
            p.a.transfer(h)
            before = time.monotonic()
            _until(lambda h=h: p.a.check_xfer_state(h) == "ERR")
            out.append(fabric.detached()[-1].dies_at - before)  # type: ignore[operator]
            p.a.release_xfer_handle(h)
        for _ in fabric.detached():
            fabric.drop_detached()
        return out

    first, again, other = bounds(3), bounds(3), bounds(4)
    late = [b > 2.0 + 0.05 for b in first]
    assert any(late) and not all(late)
    assert all(b <= 6.0 + 0.05 for b in first)
    assert late == [b > 2.0 + 0.05 for b in again]  # the seed decides
    assert late != [b > 2.0 + 0.05 for b in other]
