# SPDX-License-Identifier: Apache-2.0
"""The fake NIXL agent behaves like NIXL where the push connector could notice.

Its API call by call: metadata, transfers, validation, handles, injected faults,
telemetry, threads and the vLLM drop-in (``test_fake_nixl_parity.py``: against the
real agent, and links cut as UCX over TCP sees them).
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import numpy as np
import pytest
import torch
from fake_nixl_pairs import Cfg, N, Pair, make_pair

from devkit.testing.fake_nixl import (
    FakeNixlAgent,
    FakeNixlBackendError,
    FakeNixlFabric,
    FakeNixlInvalidParamError,
    FakeNixlLeakError,
    FakeNixlMismatchError,
    FakeNixlNoTelemetryError,
    FakeNixlNotFoundError,
    FakeNixlNotPostedError,
    FakeNixlRepostActiveError,
    FakeNixlUsageError,
    FakeNixlWrapper,
    fake_nixl_wrapper_cls,
    patch_vllm_nixl_wrapper,
)

# --------------------------------------------------------------------------- metadata


@pytest.fixture
def fabric() -> FakeNixlFabric:
    return FakeNixlFabric()


@pytest.fixture
def pair(fabric: FakeNixlFabric) -> Pair:
    return make_pair(fabric)


@pytest.mark.timeout(60)
def test_metadata_exchange(fabric: FakeNixlFabric) -> None:
    a = FakeNixlAgent("A", fabric=fabric)
    b = FakeNixlAgent("B", fabric=fabric)
    md = b.get_agent_metadata()
    assert isinstance(md, bytes)
    with pytest.raises(FakeNixlNotFoundError, match="'B' not found"):
        a.send_notif("B", b"too early")
    assert a.add_remote_agent(md) == b"B"  # bytes, like the real binding
    assert a.add_remote_agent(md) == b"B"  # re-adding is fine
    assert a.remote_agents() == ["B"]
    a.send_notif(b"B", "str and bytes are both accepted")
    a.send_notif("B", b"second")
    # b never added a: receiving needs no metadata; keys are str, values bytes, in order
    assert b.get_new_notifs() == {"A": [b"str and bytes are both accepted", b"second"]}
    assert b.get_new_notifs() == {}
    with pytest.raises(FakeNixlNotFoundError):
        b.send_notif("A", b"b has not loaded a's metadata")
    with pytest.raises(FakeNixlInvalidParamError, match="same as local"):
        a.add_remote_agent(a.get_agent_metadata())
    with pytest.raises(FakeNixlMismatchError):
        a.add_remote_agent(b"garbage")
    other = FakeNixlAgent("C", fabric=FakeNixlFabric())
    with pytest.raises(FakeNixlMismatchError, match="another FakeNixlFabric"):
        a.add_remote_agent(other.get_agent_metadata())
    with pytest.raises(FakeNixlUsageError, match="already on the fabric"):
        FakeNixlAgent("A", fabric=fabric)
    a.send_notif("A", b"loopback")  # to self, like NIXL
    assert a.get_new_notifs() == {"A": [b"loopback"]}
    a.remove_remote_agent("B")
    a.remove_remote_agent("B")  # unknown: silent, like NIXL
    with pytest.raises(FakeNixlNotFoundError):
        a.send_notif("B", b"removed")


@pytest.mark.timeout(60)
def test_metadata_is_a_snapshot_of_registered_memory(pair: Pair) -> None:
    extra = torch.zeros(64, dtype=torch.uint8)
    reg = pair.b.register_memory(pair.b.get_reg_descs(extra))  # a tensor: kept alive
    rows = [(0, 16)]
    with pytest.raises(FakeNixlNotFoundError, match="as of its loaded metadata"):
        pair.a.initialize_xfer(
            "WRITE", pair.descs(pair.src, rows), pair.descs(extra, rows), pair.b_name
        )
    pair.a.add_remote_agent(pair.b.get_agent_metadata())
    h = pair.a.initialize_xfer(
        "WRITE", pair.descs(pair.src, rows), pair.descs(extra, rows), pair.b_name
    )
    pair.a.transfer(h)
    pair.fabric.progress()
    assert extra[:16].tolist() == pair.src[:16].tolist()
    h.release()
    pair.b.deregister_memory(reg)
    with pytest.raises(FakeNixlNotFoundError):
        pair.b.deregister_memory(reg)


# --------------------------------------------------------------------------- transfers


@pytest.mark.timeout(60)
def test_write_copies_only_on_completion_and_notifies_peer(pair: Pair) -> None:
    h = pair.write([(0, 64), (128, 32)], b"req-1:1")
    with pytest.raises(FakeNixlNotPostedError):
        pair.a.check_xfer_state(h)
    assert pair.a.transfer(h) == "PROC"
    assert pair.dst.sum().item() == 0
    assert pair.a.check_xfer_state(h) == "PROC"  # poll 1 of 2
    assert pair.dst.sum().item() == 0 and pair.b.get_new_notifs() == {}
    assert pair.fabric.pending_transfers() == [h]
    assert pair.a.check_xfer_state(h) == "DONE"  # poll 2: copy + notif
    assert pair.dst[:64].tolist() == pair.src[:64].tolist()
    assert pair.dst[64:128].sum().item() == 0
    assert pair.dst[128:160].tolist() == pair.src[128:160].tolist()
    assert pair.b.get_new_notifs() == {"A": [b"req-1:1"]}
    assert pair.a.check_xfer_state(h) == "DONE"
    # re-posting a finished handle runs it again; a new notif_msg sticks
    pair.dst.zero_()
    assert pair.a.transfer(h, b"again") == "PROC"
    with pytest.raises(FakeNixlRepostActiveError):
        pair.a.transfer(h)
    assert pair.fabric.progress() == 1
    assert pair.dst[:64].tolist() == pair.src[:64].tolist()
    pair.a.transfer(h)
    pair.fabric.progress("A")
    assert pair.b.get_new_notifs() == {"A": [b"again", b"again"]}
    pair.a.release_xfer_handle(h)
    [*_, rec] = pair.fabric.transfers()
    assert (rec.initiator, rec.target, rec.op, rec.state, rec.notif) == (
        "A",
        "B",
        "WRITE",
        "DONE",
        b"again",
    )
    pair.fabric.assert_no_leaks()


@pytest.mark.timeout(60)
def test_read_copies_remote_into_local_and_notifies_remote(pair: Pair) -> None:
    pair.dst.fill_(7)
    h = pair.a.initialize_xfer(
        "READ", pair.descs(pair.src, [(8, 8)]), pair.descs(pair.dst, [(0, 8)]), "B", b"read-done"
    )
    assert pair.a.transfer(h) == "PROC"
    assert pair.src[8:16].tolist() != [7] * 8
    while pair.a.check_xfer_state(h) == "PROC":
        pass
    assert pair.src[8:16].tolist() == [7] * 8
    assert pair.b.get_new_notifs() == {"A": [b"read-done"]}  # READ notifies the target too
    h.release()


@pytest.mark.timeout(60)
def test_complete_after_zero_polls_returns_done_from_transfer(pair: Pair) -> None:
    pair.fabric.complete_after_polls = 0
    h = pair.write([(0, 8)], b"n")
    assert pair.a.transfer(h) == "DONE"
    assert pair.dst[:8].tolist() == pair.src[:8].tolist()
    assert pair.b.get_new_notifs() == {"A": [b"n"]}
    h.release()


@pytest.mark.timeout(60)
def test_prepped_transfers_and_index_checks(pair: Pair) -> None:
    a = pair.a
    local = a.prep_xfer_dlist(
        "NIXL_INIT_AGENT",
        np.array([[pair.src.data_ptr() + 16 * i, 16, 0] for i in range(16)]),
        "DRAM",
    )
    remote = a.prep_xfer_dlist(pair.b_name, pair.descs(pair.dst, [(16 * i, 16) for i in range(16)]))
    h = a.make_prepped_xfer("WRITE", local, [0, 1, 5], remote, [2, 3, 9], b"prepped")
    a.transfer(h)
    pair.fabric.progress()
    assert pair.dst[32:64].tolist() == pair.src[0:32].tolist()
    assert pair.dst[144:160].tolist() == pair.src[80:96].tolist()
    assert pair.b.get_new_notifs() == {"A": [b"prepped"]}
    with pytest.raises(FakeNixlInvalidParamError, match="index out of range"):
        a.make_prepped_xfer("WRITE", local, [0, 16], remote, [0, 1])
    with pytest.raises(FakeNixlInvalidParamError, match="number of indices"):
        a.make_prepped_xfer("WRITE", local, [0, 1], remote, [0])
    with pytest.raises(FakeNixlInvalidParamError, match="number of indices"):
        a.make_prepped_xfer("WRITE", local, [], remote, [])
    with pytest.raises(FakeNixlInvalidParamError, match="invalid sides"):
        a.make_prepped_xfer("WRITE", local, [0], local, [0])
    with pytest.raises(KeyError):
        a.make_prepped_xfer("COPY", local, [0], remote, [0])
    for handle in (h, local, remote):
        handle.release()
    pair.fabric.assert_no_leaks()


@pytest.mark.timeout(60)
def test_strided_lists_index_their_blocks_in_order(pair: Pair) -> None:
    """nixl 1.5's Nx5 form (vLLM 0.34 prepares its local lists so): a row
    ``(address, len, device, stride, count)`` stands for ``count`` blocks of ``len``
    bytes ``stride`` apart, indexed in order across rows. The bytes a WRITE moves
    are those of the blocks spelled out by hand."""
    a, base = pair.a, pair.src.data_ptr()
    strided = np.array(
        [[base, 8, 0, 32, 4], [base + 200, 16, 0, 16, 2]], dtype=np.uint64
    )  # blocks: 0, 32, 64, 96 (8 bytes), then 200, 216 (16 bytes)
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", strided, "DRAM")
    remote = a.prep_xfer_dlist(
        pair.b_name, pair.descs(pair.dst, [(0, 8), (8, 8), (16, 16), (32, 16)])
    )
    h = a.make_prepped_xfer("WRITE", local, [1, 3, 4, 5], remote, [0, 1, 2, 3])
    a.transfer(h)
    pair.fabric.progress()
    src = pair.src.tolist()
    assert pair.dst[:48].tolist() == src[32:40] + src[96:104] + src[200:216] + src[216:232]
    with pytest.raises(FakeNixlInvalidParamError, match="index out of range"):
        a.make_prepped_xfer("WRITE", local, [6], remote, [0])
    with pytest.raises(ValueError, match="mem type"):
        a.prep_xfer_dlist("NIXL_INIT_AGENT", strided)
    with pytest.raises(FakeNixlNotFoundError):  # the last block of a row past the region
        a.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[base, 16, 0, 16, N // 16 + 1]]), "DRAM")
    for handle in (h, local, remote):
        handle.release()
    pair.fabric.assert_no_leaks()


# -------------------------------------------------------------------------- validation


@pytest.mark.timeout(60)
def test_descriptors_outside_registered_memory_raise(pair: Pair) -> None:
    a, src, dst = pair.a, pair.src, pair.dst
    stray = torch.zeros(N, dtype=torch.uint8)  # never registered
    inside = [(0, 16)]
    cases = [
        (pair.descs(src, [(N - 8, 16)]), pair.descs(dst, inside), "local descriptor #0"),
        (pair.descs(stray, inside), pair.descs(dst, inside), "local descriptor #0"),
        (pair.descs(src, inside), pair.descs(dst, [(N - 8, 16)]), "remote descriptor #0"),
        (pair.descs(src, inside), pair.descs(stray, inside), "remote descriptor #0"),
        (
            pair.descs(src, inside),
            a.get_xfer_descs([(dst.data_ptr(), 16, 1)], "DRAM"),  # wrong device id
            "remote descriptor #0",
        ),
    ]
    for local, remote, what in cases:
        with pytest.raises(FakeNixlNotFoundError, match=what):
            a.initialize_xfer("WRITE", local, remote, "B", b"x")
    with pytest.raises(FakeNixlNotFoundError, match="descriptor #1"):
        a.prep_xfer_dlist("NIXL_INIT_AGENT", pair.descs(src, [(0, 8), (N, 8)]))
    with pytest.raises(FakeNixlNotFoundError, match="registered by 'B'"):
        a.prep_xfer_dlist("B", pair.descs(dst, [(N - 4, 8)]))
    with pytest.raises(FakeNixlInvalidParamError, match="length mismatch at index 1"):
        a.initialize_xfer(
            "WRITE", pair.descs(src, [(0, 8), (8, 8)]), pair.descs(dst, [(0, 8), (8, 4)]), "B"
        )
    with pytest.raises(FakeNixlInvalidParamError, match="sizes"):
        a.initialize_xfer("WRITE", pair.descs(src, [(0, 8), (8, 8)]), pair.descs(dst, inside), "B")
    with pytest.raises(FakeNixlInvalidParamError, match="mem type"):
        a.get_xfer_descs([(src.data_ptr(), 8, 0)])
    # a region spanning two adjacent registrations is not covered (like NIXL)
    two = torch.zeros(64, dtype=torch.uint8)
    pair.b.register_memory(
        pair.b.get_reg_descs(
            [(two.data_ptr(), 32, 0, ""), (two.data_ptr() + 32, 32, 0, "")], "DRAM"
        )
    )
    a.add_remote_agent(pair.b.get_agent_metadata())
    with pytest.raises(FakeNixlNotFoundError):
        a.initialize_xfer("WRITE", pair.descs(src, [(0, 16)]), pair.descs(two, [(24, 16)]), "B")
    pair.fabric.assert_no_leaks()


@pytest.mark.timeout(60)
def test_unknown_and_removed_agents(pair: Pair) -> None:
    a = pair.a
    rows = [(0, 8)]
    with pytest.raises(FakeNixlNotFoundError, match="'nobody' not found"):
        a.initialize_xfer("WRITE", pair.descs(pair.src, rows), pair.descs(pair.dst, rows), "nobody")
    with pytest.raises(FakeNixlNotFoundError):
        a.prep_xfer_dlist("nobody", pair.descs(pair.dst, rows))
    with pytest.raises(FakeNixlNotFoundError):
        a.send_notif("nobody", b"x")
    local = a.prep_xfer_dlist("", pair.descs(pair.src, rows))
    remote = a.prep_xfer_dlist("B", pair.descs(pair.dst, rows))
    old = a.make_prepped_xfer("WRITE", local, [0], remote, [0], b"n")
    inflight = pair.write(rows, b"lost")
    assert a.transfer(inflight) == "PROC"
    a.remove_remote_agent(pair.b_name)
    assert a.check_xfer_state(inflight) == "PROC"
    assert a.check_xfer_state(inflight) == "ERR"  # disconnected before completion
    # handles made before the removal stay stale even after the agent is added again
    a.add_remote_agent(pair.b.get_agent_metadata())
    with pytest.raises(FakeNixlNotFoundError, match="re-created"):
        a.transfer(old)
    with pytest.raises(FakeNixlNotFoundError, match="re-created"):
        a.make_prepped_xfer("WRITE", local, [0], remote, [0])
    assert pair.dst.sum().item() == 0 and pair.b.get_new_notifs() == {}
    # the target leaving the fabric fails an in-flight transfer, and send_notif
    fresh = pair.write(rows, b"n")
    a.transfer(fresh)
    pair.b.close()
    pair.fabric.progress()
    assert a.check_xfer_state(fresh) == "ERR"
    assert "left the fabric" in pair.fabric.transfers()[-1].reason
    with pytest.raises(FakeNixlBackendError):
        a.send_notif("B", b"x")
    for h in (old, inflight, fresh, local, remote):
        h.release()
    pair.fabric.assert_no_leaks()


# ----------------------------------------------------------------------------- handles


@pytest.mark.timeout(60)
def test_leak_detection_and_double_release(pair: Pair) -> None:
    h = pair.write([(0, 8)])
    d = pair.a.prep_xfer_dlist("NIXL_INIT_AGENT", pair.descs(pair.src, [(0, 8)]))
    with pytest.raises(FakeNixlLeakError) as e:
        pair.fabric.assert_no_leaks()
    assert "2 leaked" in str(e.value) and "initialize_xfer" in str(e.value)
    assert isinstance(e.value, AssertionError)
    assert pair.fabric.live_handles("A") == [h, d]
    pair.a.release_xfer_handle(h)
    d.release()
    pair.fabric.assert_no_leaks()
    with pytest.raises(FakeNixlUsageError, match="already released"):
        h.release()
    with pytest.raises(FakeNixlUsageError, match="already released"):
        pair.a.release_dlist_handle(d)
    with pytest.raises(FakeNixlUsageError):
        pair.a.transfer(h)
    with pytest.raises(FakeNixlUsageError):
        pair.a.check_xfer_state(h)
    # registered memory counts only when asked for
    with pytest.raises(FakeNixlLeakError, match="still registers"):
        pair.fabric.assert_no_leaks(include_memory=True)
    # a lenient fabric ignores a second release, like the real Python wrapper
    lenient = FakeNixlFabric(strict_release=False)
    agent = FakeNixlAgent("L", fabric=lenient)
    buf = torch.zeros(8, dtype=torch.uint8)
    agent.register_memory(agent.get_reg_descs(buf))
    dl = agent.prep_xfer_dlist("", agent.get_xfer_descs(buf))
    dl.release()
    dl.release()
    lenient.assert_no_leaks()


@pytest.mark.timeout(60)
def test_handles_belong_to_their_agent(pair: Pair) -> None:
    h = pair.write([(0, 8)])
    pair.b.add_remote_agent(pair.a.get_agent_metadata())
    with pytest.raises(FakeNixlInvalidParamError, match="belongs to agent 'A'"):
        pair.b.transfer(h)
    with pytest.raises(TypeError):
        pair.a.transfer(object())  # type: ignore[arg-type]
    h.release()


@pytest.mark.timeout(60)
def test_release_while_in_flight_succeeds_and_the_write_may_still_land(pair: Pair) -> None:
    """As NIXL over UCX (N-REL-1): the release succeeds, the detached WRITE's bytes still
    land when the fabric makes progress, read from the source as it is then, and its
    notification dies with the handle."""
    h = pair.write([(0, 64)], b"released")
    assert pair.a.transfer(h) == "PROC"
    pair.a.release_xfer_handle(h)  # no error, the handle is gone
    pair.fabric.assert_no_leaks()
    rec = pair.fabric.transfers()[-1]
    assert (rec.state, rec.notif, rec.reason) == ("CANCELLED", None, "released while in flight")
    (late,) = pair.fabric.detached()
    assert (late.why, late.initiator, late.target, late.total_bytes) == ("released", "A", "B", 64)
    assert pair.dst.sum().item() == 0 and pair.b.get_new_notifs() == {}  # not yet
    pair.src[:8] = 200  # P reuses its buffer after the release
    assert pair.fabric.progress() == 0  # (counts transfers in flight only)
    assert pair.dst[:64].equal(pair.src[:64]) and pair.dst[64:].sum().item() == 0
    assert int(pair.dst[0]) == 200 and pair.b.get_new_notifs() == {}
    (landing,) = pair.fabric.landings()
    assert (landing.how, landing.whole, landing.notif) == ("released", True, b"released")
    assert not pair.fabric.detached()


@pytest.mark.timeout(60)
def test_detached_writes_land_in_part_late_or_never(pair: Pair) -> None:
    a, f = pair.a, pair.fabric
    seen: list[Any] = []
    f.observe_writes(seen.append)
    f.detached_fate("keep")  # progress() leaves them to the test
    handles = [pair.write([(0, 32), (64, 32)], b"one"), pair.write([(128, 16)], b"two")]
    for h in handles:
        assert a.transfer(h) == "PROC"
        a.release_xfer_handle(h)
    f.progress()
    assert len(f.detached()) == 2 and pair.dst.sum().item() == 0
    landing = f.land_detached(0, part=0.75)  # 48 of 64 bytes: all of (0, 32), half of (64, 32)
    assert landing is not None and not landing.whole and landing.how == "released"
    assert [n for _, _, n in landing.spans] == [32, 16]
    assert pair.dst[:32].equal(pair.src[:32]) and pair.dst[64:80].equal(pair.src[64:80])
    assert pair.dst[80:96].sum().item() == 0 and pair.b.get_new_notifs() == {}
    assert f.detached()[0].landed_bytes == 48
    f.land_detached(0, notify=True)  # the rest, and (beyond N-REL-1) its notification
    assert pair.dst[80:96].equal(pair.src[80:96]) and pair.b.get_new_notifs() == {"A": [b"one"]}
    assert f.drop_detached(0).notif == b"two"  # never lands
    assert not f.detached() and pair.dst[128:144].sum().item() == 0
    assert [x.whole for x in seen] == [False, True]
    assert f.progress() == 0 and pair.b.get_new_notifs() == {}
    # the fates progress() applies
    for fate, landed, notified in (("never", 0, False), ("part", 8, False),
                                   ("land_silent", 16, False), ("land", 16, True)):  # fmt: skip
        pair.dst.zero_()
        f.detached_fate(fate)  # type: ignore[arg-type]
        h = pair.write([(128, 16)], b"fate")
        a.transfer(h)
        a.release_xfer_handle(h)
        f.progress()
        assert int((pair.dst[128:144] != 0).sum()) == landed, fate  # (src has no 0 there)
        assert pair.b.get_new_notifs() == ({"A": [b"fate"]} if notified else {}), fate
        assert not f.detached()
    with pytest.raises(ValueError):
        f.detached_fate("sometimes")  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_a_detached_write_does_not_land_once_its_memory_is_gone(pair: Pair) -> None:
    a, b, f = pair.a, pair.b, pair.fabric
    h = pair.write([(0, 8)], b"gone")
    a.transfer(h)
    a.release_xfer_handle(h)
    b.deregister_memory(b.get_reg_descs([(pair.dst.data_ptr(), N, 0, "")], "DRAM"))
    assert f.land_detached(0) is None and not f.detached()
    assert pair.dst.sum().item() == 0 and b.get_new_notifs() == {}


@pytest.mark.timeout(60)
def test_release_in_flight_may_be_the_kind_cancel(fabric: FakeNixlFabric) -> None:
    """``release_in_flight="cancel"``: the old model, nothing of it ever lands."""
    kind = FakeNixlFabric(release_in_flight="cancel")
    a = FakeNixlAgent("A", fabric=kind)
    b = FakeNixlAgent("B", fabric=kind)
    src, dst = torch.ones(N, dtype=torch.uint8), torch.zeros(N, dtype=torch.uint8)
    a.register_memory(a.get_reg_descs([(src.data_ptr(), N, 0, "")], "DRAM"))
    b.register_memory(b.get_reg_descs([(dst.data_ptr(), N, 0, "")], "DRAM"))
    a.add_remote_agent(b.get_agent_metadata())
    descs = a.get_xfer_descs([(src.data_ptr(), 8, 0)], "DRAM")
    h = a.initialize_xfer("WRITE", descs, a.get_xfer_descs([(dst.data_ptr(), 8, 0)], "DRAM"), "B")
    a.transfer(h)
    a.release_xfer_handle(h)
    assert kind.progress() == 0 and not kind.detached() and dst.sum().item() == 0
    with pytest.raises(ValueError):
        FakeNixlFabric(release_in_flight="maybe")  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_failed_writes_may_land_in_part_now_and_the_rest_later(pair: Pair) -> None:
    a, f = pair.a, pair.fabric
    f.fail_next_transfer("state")
    h = pair.write([(0, 64)], b"n")
    a.transfer(h)
    assert [a.check_xfer_state(h), a.check_xfer_state(h)] == ["PROC", "ERR"]
    assert pair.dst.sum().item() == 0 and not f.landings()  # default: nothing lands
    f.failed_writes_land(0.25)
    f.fail_next_transfer("state")
    a.transfer(h)
    assert [a.check_xfer_state(h), a.check_xfer_state(h)] == ["PROC", "ERR"]
    assert pair.dst[:16].equal(pair.src[:16]) and pair.dst[16:].sum().item() == 0
    (landing,) = f.landings()
    assert (landing.how, landing.whole, landing.notif) == ("failed", False, b"n")
    assert not f.detached() and pair.b.get_new_notifs() == {}
    f.failed_writes_land(0.5, later=True)
    f.fail_next_transfer("state_raise")
    h2 = pair.write([(128, 64)], b"m")
    a.transfer(h2)
    a.check_xfer_state(h2)
    with pytest.raises(FakeNixlBackendError):
        a.check_xfer_state(h2)
    assert pair.dst[128:160].equal(pair.src[128:160]) and pair.dst[160:].sum().item() == 0
    (late,) = f.detached()
    assert (late.why, late.landed_bytes) == ("failed", 32)
    f.progress()  # the rest arrives after the initiator saw the error
    assert pair.dst[128:192].equal(pair.src[128:192])
    assert pair.b.get_new_notifs() == {}
    with pytest.raises(ValueError):
        f.failed_writes_land(1.5)
    h.release()
    h2.release()


@pytest.mark.timeout(60)
def test_a_cut_link_may_leave_its_writes_on_the_wire(pair: Pair) -> None:
    """``stale_writes``: WRITEs in flight at the cut stall (N-REL-1: still in progress)
    and land once the link is back, released meanwhile or not, after what the initiator
    sent over a new endpoint since."""
    a, b, f = pair.a, pair.b, pair.fabric
    b.add_remote_agent(a.get_agent_metadata())
    kept, released = pair.write([(0, 16)], b"kept"), pair.write([(64, 16)], b"released")
    assert a.transfer(kept) == "PROC" and a.transfer(released) == "PROC"
    f.cut_link("A", "B", stale_writes=True)
    assert {a.check_xfer_state(kept) for _ in range(5)} == {"PROC"}
    a.release_xfer_handle(released)
    assert [d.why for d in f.detached()] == ["cut"]
    assert f.progress() == 0 and pair.dst.sum().item() == 0  # nothing moves while cut
    f.restore_link("A", "B")
    assert f.progress() == 1
    assert a.check_xfer_state(kept) == "DONE" and pair.dst[:16].equal(pair.src[:16])
    assert pair.dst[64:80].equal(pair.src[64:80]) and not f.detached()
    assert b.get_new_notifs() == {"A": [b"kept"]}  # (the released one's died with it)
    kept.release()
    pair.dst.zero_()
    a.remove_remote_agent("B")  # (its endpoint failed with the cut: a new one)
    a.add_remote_agent(b.get_agent_metadata())
    late = pair.write([(128, 16)], b"late")
    assert a.transfer(late) == "PROC"
    f.cut_link("A", "B", stale_writes=True)
    a.release_xfer_handle(late)
    f.restore_link("A", "B")
    a.remove_remote_agent("B")  # the failed endpoint goes, a new one comes
    a.add_remote_agent(b.get_agent_metadata())
    a.send_notif("B", b"over a new endpoint")
    assert pair.dst.sum().item() == 0
    f.progress()  # the stale WRITE lands after the notification sent since
    assert pair.dst[128:144].equal(pair.src[128:144])
    assert b.get_new_notifs() == {"A": [b"over a new endpoint"]}


@pytest.mark.timeout(60)
def test_reordered_landings_let_a_notification_overtake_earlier_data(pair: Pair) -> None:
    """The earlier WRITE's data lands after the later one's notification, and
    overwrites what the later one wrote."""
    a, f = pair.a, pair.fabric
    f.detached_fate("land_silent")
    f.reorder_landings()
    order: list[bytes] = []
    f.observe_writes(lambda w: order.append(w.notif))
    first = pair.write([(0, 16)], b"")
    a.transfer(first)
    a.release_xfer_handle(first)  # detached, its bytes still on the way
    pair.src[:16] = 99  # what the later WRITE carries
    later = pair.write([(0, 16)], b"later:1")
    f.fail_next_transfer("hang")
    a.transfer(later)
    f.progress()
    assert order == [b"later:1", b""]
    assert pair.b.get_new_notifs() == {"A": [b"later:1"]}
    assert a.check_xfer_state(later) == "DONE"
    assert pair.dst[:16].equal(pair.src[:16])  # (same source: 99 either way)
    f.reorder_landings(False)
    later.release()


@pytest.mark.timeout(60)
def test_a_completion_may_come_long_after_its_data(pair: Pair) -> None:
    a, f = pair.a, pair.fabric
    f.hold_notifs(lambda n: n.via == "xfer")
    h = pair.write([(0, 16)], b"req:1")
    a.transfer(h)
    f.progress()
    assert a.check_xfer_state(h) == "DONE" and pair.dst[:16].equal(pair.src[:16])
    assert pair.b.get_new_notifs() == {}
    f.release_held(0)
    assert pair.b.get_new_notifs() == {"A": [b"req:1"]}
    h.release()


@pytest.mark.timeout(60)
def test_any_peer_may_name_itself_another_agent(pair: Pair) -> None:
    """Real NIXL reads the sender's name from the message: the fake takes any string."""
    f = pair.fabric
    for sender in ("A", "not-on-the-fabric", "", "écrit par P"):
        f.inject_notif("B", sender, b"PUSH_FAIL:forged")
    assert pair.b.get_new_notifs() == {
        s: [b"PUSH_FAIL:forged"] for s in ("A", "not-on-the-fabric", "", "écrit par P")
    }
    assert {n.sender for n in f.notifications()} == {"A", "not-on-the-fabric", "", "écrit par P"}


@pytest.mark.timeout(60)
def test_injected_failures(pair: Pair) -> None:
    a, f = pair.a, pair.fabric
    f.fail_next_transfer("post")
    h = pair.write([(0, 8)], b"n")
    assert a.transfer(h) == "ERR"
    assert a.check_xfer_state(h) == "ERR"
    with pytest.raises(FakeNixlNotPostedError):
        a.get_xfer_telemetry(h)

    f.fail_next_transfer("state")
    assert a.transfer(h) == "PROC"  # a failed handle may be re-posted
    assert [a.check_xfer_state(h), a.check_xfer_state(h)] == ["PROC", "ERR"]

    f.fail_next_transfer("post_raise")
    with pytest.raises(FakeNixlBackendError, match="injected post failure"):
        a.transfer(h)

    f.fail_next_transfer("state_raise")
    a.transfer(h)
    a.check_xfer_state(h)
    with pytest.raises(FakeNixlBackendError):
        a.check_xfer_state(h)

    f.fail_next_transfer("post", initiator="B")  # only B's next transfer fails
    assert a.transfer(h) == "PROC"
    f.progress()
    assert a.check_xfer_state(h) == "DONE"
    assert pair.b.get_new_notifs() == {"A": [b"n"]}  # only the successful post notified
    states = [r.state for r in f.transfers()]
    assert states == ["ERR", "ERR", "ERR", "ERR", "DONE"]
    with pytest.raises(ValueError):
        f.fail_next_transfer("bogus")  # type: ignore[arg-type]
    h.release()


@pytest.mark.timeout(60)
def test_injected_hangs(pair: Pair) -> None:
    """A transfer that never completes by itself; one NIXL cannot cancel either."""
    a, f = pair.a, pair.fabric
    f.fail_next_transfer("hang")
    h = pair.write([(0, 8)], b"late")
    assert a.transfer(h) == "PROC"
    assert {a.check_xfer_state(h) for _ in range(50)} == {"PROC"}
    a.release_xfer_handle(h)  # cancellable: released (detached: see the tests above)
    assert f.transfers()[-1].state == "CANCELLED" and pair.b.get_new_notifs() == {}
    f.drop_detached(0)

    f.fail_next_transfer("hang_uncancellable")
    h = pair.write([(0, 8)], b"stuck")
    assert a.transfer(h) == "PROC"
    with pytest.raises(FakeNixlBackendError, match="cannot be cancelled"):
        a.release_xfer_handle(h)
    assert h in f.live_handles() and a.check_xfer_state(h) == "PROC"
    assert f.progress() == 1  # the peer completes it after all
    assert a.check_xfer_state(h) == "DONE"
    assert pair.b.get_new_notifs() == {"A": [b"stuck"]}
    a.release_xfer_handle(h)
    f.assert_no_leaks()

    pair.dst.zero_()
    f.fail_next_transfer("hang_state_raise")
    h = pair.write([(0, 8)], b"failed at last")
    a.transfer(h)
    assert f.complete(h, ok=False) and not f.complete(h)  # it ends in ERR
    assert a.check_xfer_state(h) == "ERR" and pair.dst.sum().item() == 0
    assert pair.b.get_new_notifs() == {}
    a.release_xfer_handle(h)


@pytest.mark.timeout(60)
def test_inject_notif_delivers_untrusted_bytes(pair: Pair) -> None:
    pair.fabric.inject_notif("A", "B", b"\xff\xfe not utf-8")
    pair.fabric.inject_notif("A", "B", b"")
    assert pair.a.get_new_notifs() == {"B": [b"\xff\xfe not utf-8", b""]}
    assert [n.via for n in pair.fabric.notifications()] == ["inject", "inject"]


# --------------------------------------------------------------------------- telemetry


@pytest.mark.timeout(60)
def test_telemetry_and_descriptor_counts(pair: Pair) -> None:
    a = pair.a
    h = pair.write([(0, 16), (16, 16), (64, 8)])
    with pytest.raises(FakeNixlNotPostedError):
        a.get_xfer_telemetry(h)
    a.transfer(h)
    pair.fabric.progress()
    t = a.get_xfer_telemetry(h)
    # initialize_xfer never merges, even contiguous neighbours
    assert (t.totalBytes, t.descCount, h.requested_desc_count) == (40, 3, 3)
    assert t.startTime > 0 and t.xferDuration >= t.postDuration >= 0
    h.release()

    dense_l = a.prep_xfer_dlist("", pair.descs(pair.src, [(8 * i, 8) for i in range(16)]))
    dense_r = a.prep_xfer_dlist("B", pair.descs(pair.dst, [(8 * i, 8) for i in range(16)]))
    gap_r = a.prep_xfer_dlist("B", pair.descs(pair.dst, [(16 * i, 8) for i in range(16)]))
    cases = [  # (remote list, local idx, remote idx, skip_merge) -> descCount, as measured on NIXL
        ((dense_r, [0, 1, 2, 3], [4, 5, 6, 7], False), 1),
        ((dense_r, [0, 1, 3], [0, 1, 3], False), 2),
        ((dense_r, [3, 2, 1], [3, 2, 1], False), 3),
        ((dense_r, [0, 1], [1, 0], False), 2),
        ((gap_r, [0, 1, 2], [0, 1, 2], False), 3),
        ((dense_r, [0, 1, 2], [0, 1, 2], True), 3),
    ]
    for (remote, li, ri, skip), want in cases:
        h = a.make_prepped_xfer("WRITE", dense_l, li, remote, ri, skip_desc_merge=skip)
        a.transfer(h)
        pair.fabric.progress()
        t = a.get_xfer_telemetry(h)
        assert (t.descCount, t.totalBytes, h.requested_desc_count) == (want, 8 * len(li), len(li))
        assert pair.fabric.transfers()[-1].desc_count == want
        h.release()
    for d in (dense_l, dense_r, gap_r):
        d.release()
    # no telemetry without capture_telemetry, like NIXL
    pair.b.add_remote_agent(pair.a.get_agent_metadata())
    h = pair.b.initialize_xfer(
        "WRITE",
        pair.b.get_xfer_descs([(pair.dst.data_ptr(), 8, 0)], "DRAM"),
        pair.b.get_xfer_descs([(pair.src.data_ptr(), 8, 0)], "DRAM"),
        "A",
    )
    pair.b.transfer(h)
    pair.fabric.progress()
    with pytest.raises(FakeNixlNoTelemetryError):
        pair.b.get_xfer_telemetry(h)
    h.release()
    pair.fabric.assert_no_leaks()


# ----------------------------------------------------------------------------- threads


@pytest.mark.timeout(60)
def test_call_log_records_thread_names(pair: Pair) -> None:
    def writer() -> None:
        h = pair.write([(0, 8)], b"w")
        pair.a.transfer(h)
        while pair.a.check_xfer_state(h) == "PROC":
            pass
        pair.a.release_xfer_handle(h)
        pair.a.send_notif("B", b"PUSH_REG:x")
        pair.a.get_new_notifs()

    t = threading.Thread(target=writer, name="nixl-push-writer")
    t.start()
    t.join(10)
    pair.a.get_agent_metadata()  # on the main thread
    writer_only = (
        "initialize_xfer",
        "transfer",
        "check_xfer_state",
        "send_notif",
        "get_new_notifs",
    )
    for method in writer_only:
        assert pair.a.call_threads(method) == {"nixl-push-writer"}, method
    assert pair.a.call_threads("get_agent_metadata") == {"MainThread"}
    assert [c.method for c in pair.a.calls("check_xfer_state")] == ["check_xfer_state"] * 2
    names = [c.method for c in pair.a.calls()]
    assert names[:4] == ["get_reg_descs", "register_memory", "add_remote_agent", "get_xfer_descs"]
    assert pair.fabric.transfers()[-1].post_thread == "nixl-push-writer"


@pytest.mark.timeout(60)
def test_concurrent_callers_are_safe(pair: Pair) -> None:
    pair.b.add_remote_agent(pair.a.get_agent_metadata())
    n_threads, per_thread = 4, 200
    errors: list[BaseException] = []

    def sender(i: int) -> None:
        try:
            for k in range(per_thread):
                pair.a.send_notif("B", f"{i}:{k}".encode())
                h = pair.write([(8 * (k % 8), 8)], b"x")
                pair.a.transfer(h)
                pair.fabric.progress("A")  # completes ours and maybe others'
                h.release()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    got: list[bytes] = []
    while any(t.is_alive() for t in threads):
        got += pair.b.get_new_notifs().get("A", [])
    for t in threads:
        t.join()
    got += pair.b.get_new_notifs().get("A", [])
    assert not errors
    plain = [m for m in got if m != b"x"]
    assert len(plain) == n_threads * per_thread
    for i in range(n_threads):  # per-pair order is kept
        mine = [m for m in plain if m.startswith(f"{i}:".encode())]
        assert mine == [f"{i}:{k}".encode() for k in range(per_thread)]
    assert got.count(b"x") == n_threads * per_thread
    pair.fabric.assert_no_leaks()


# ------------------------------------------------------------------------- vLLM drop-in


@pytest.mark.timeout(60)
def test_wrapper_cls_is_a_nixl_wrapper_drop_in(fabric: FakeNixlFabric) -> None:
    cls = fake_nixl_wrapper_cls(fabric)
    name = str(uuid.uuid4())
    agent = cls(name, Cfg())  # how vLLM's worker builds it
    assert isinstance(agent, FakeNixlWrapper) and isinstance(agent, FakeNixlAgent)
    assert fabric.agent(name) is agent and agent.fabric is fabric
    assert cls("other", None).name == "other"
    assert [a.name for a in fabric.agents()] == [name, "other"]
    with pytest.raises(TypeError, match="fake_nixl_wrapper_cls"):
        FakeNixlWrapper("unbound")


@pytest.mark.timeout(60)
def test_patch_vllm_worker_nixl_wrapper(
    fabric: FakeNixlFabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker")
    patch_vllm_nixl_wrapper(monkeypatch, fabric)
    config = None
    if worker.nixl_agent_config is not None:
        config = worker.nixl_agent_config(num_threads=4, capture_telemetry=True)
    agent = worker.NixlWrapper(str(uuid.uuid4()), config)
    assert isinstance(agent, FakeNixlAgent)
    assert agent._capture_telemetry == (config is not None)
