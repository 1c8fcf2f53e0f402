# SPDX-License-Identifier: Apache-2.0
"""Real faults on a running push 1P1D (devkit.testing.faults; docs/faults.md).

One pair (P, D, proxy; our connector on this env's vLLM) serves the module; each
test injects one fault and asserts the audit: the requests it hit end with a clear
error within a bound (or succeed, always with a single engine's output), the engines
free every KV block and every connector table, requests in flight beside it are
served with a single engine's output, and the pair serves afterwards. A run that
cannot tell (the fault's moment never came, a harness error) fails with the reason:
"inconclusive" is not "clean".

Default CI (``-m e2e``) runs a quick subset on loopback. The rest is behind the
``faults`` marker (``pytest -m faults tests/e2e/test_faults.py``; P and D in
network namespaces where the host allows it): link cuts, kills and restarts, the
late and foreign notifications, the 1,000-request soak. The stale WRITE after a
partition (link-cut-stale-write) is marked ``slow`` (``FULL=1 ci/test.sh``, or
``pytest -m slow tests/e2e/test_faults.py``). The full table, also against vLLM
0.32's own push, is ``python3 tools/faults.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.testing.faults import netns
from devkit.testing.faults.audit import FaultResult
from devkit.testing.faults.catalog import Ctx, run_fault
from devkit.testing.faults.pair import LEG_IDLE_TIMEOUT_S, STACKS, FaultPair, PairConfig
from devkit.testing.faults.soak import soak

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
heavy = pytest.mark.faults

#: where the heavy tests run: namespaces if the host has them (link faults need them)
NETNS_REASON = netns.unavailable_reason()


def _ctx(tiny_model: Path, run_dir: Path, net: str) -> Iterator[Ctx]:
    cfg = PairConfig(STACKS["ours"], str(tiny_model), run_dir, net=net)  # type: ignore[arg-type]
    with FaultPair(cfg, progress=print) as pair:
        log = pair.log_path("prefill").read_text()
        assert "vllm-ext: registered" in log  # the engines load this checkout's plugin
        ctx = Ctx(pair, print)
        ctx.warm_up()
        yield ctx


@pytest.fixture(scope="module")
def ctx(tiny_model: Path, tmp_path_factory) -> Iterator[Ctx]:
    """Network namespaces where the host allows them (the link faults need them),
    else loopback (the link faults are then skipped, with the reason)."""
    net = "netns" if NETNS_REASON is None else "loopback"
    yield from _ctx(tiny_model, tmp_path_factory.mktemp("faults"), net)


def _run(ctx: Ctx, name: str) -> FaultResult:
    res = run_fault(ctx, name)
    s = res.summary(ctx.bound_s)
    print(f"{name}: {s['verdict']} {s['problems']} ends {s['time_to_end_max']}s "
          f"freed {s['freed_s']} details {res.details}")  # fmt: skip
    return res


def _assert_clean(res: FaultResult, ctx: Ctx) -> None:
    assert res.applies, res.note
    assert res.problems(ctx.bound_s) == [], res.summary(ctx.bound_s)
    assert not res.inconclusive, f"inconclusive: {res.inconclusive} ({res.details})"
    assert res.verdict(ctx.bound_s) == "clean"


def _assert_error_message(res: FaultResult) -> None:
    for o in res.affected:
        # 503: a leg to an engine that refused the connection (docs/proxy.md, Errors)
        assert o.status in (502, 503, 504), o.brief()
        assert "leg failed" in o.message, o.brief()


# -- default CI subset ------------------------------------------------------------------------


@heavy  # the integration suite covers duplicates (fake NIXL); here it costs a fault slot
def test_duplicate_push_reg_is_ignored(ctx) -> None:
    res = _run(ctx, "push-reg-duplicate")
    _assert_clean(res, ctx)
    assert res.affected[0].ok


def test_dropped_push_reg_fails_the_request_and_frees_both_sides(ctx) -> None:
    res = _run(ctx, "push-reg-dropped")
    _assert_clean(res, ctx)
    _assert_error_message(res)
    # D's watchdog (20 s) plus at most the cancel answer timeout (10 s)
    assert res.times_to_end()[0] < 20 + 10 + 5


def test_client_abort_while_p_prefills_frees_both_sides(ctx) -> None:
    res = _run(ctx, "client-abort-prefill")
    _assert_clean(res, ctx)
    assert all(t is not None and t < 20 for t in res.freed_s.values()), res.freed_s


def test_notification_flood_from_a_foreign_agent(ctx) -> None:
    res = _run(ctx, "notif-flood")
    assert res.details["foreign_p"].get("ok"), res.details
    _assert_clean(res, ctx)
    assert res.details["foreign_p"]["side_channel_alive_after_bad_query"]


def test_small_soak_with_aborts_and_faults(ctx) -> None:
    out = soak(ctx, int(os.environ.get("VLLM_EXT_SOAK_SMALL", "16")), concurrency=3,
               time_bound_s=240)  # fmt: skip
    print(out["rows"], out["leaked_blocks"], out["tables_grown"], out["failures"][:3])
    assert out["clean"], out


@pytest.mark.skipif(NETNS_REASON is not None, reason=f"no network namespaces: {NETNS_REASON}")
def test_long_link_cut(ctx) -> None:
    """The P-D link drops every packet for 45 s while P's WRITE runs. D keeps the
    request's blocks while P cannot answer (S-SAFE-1); once the link is back the
    request ends with an error within the audit's bound of the link's return, nothing
    leaks, and the pair serves again without a restart."""
    res = _run(ctx, "link-cut-long")
    _assert_clean(res, ctx)
    assert res.recovered_s is not None, res.details


def test_a_hung_producer(ctx) -> None:
    """P stopped (SIGSTOP) with its WRITE in flight for 30 s: D stops waiting (its
    watchdog, or push_heartbeat_timeout_s after P's last PUSH_HB: 20 s and 10 s here) and
    cancels, keeps the blocks while P cannot answer, and once P runs again the request
    ends (right, or with an error) within the audit's bound, nothing leaks, and the
    pair serves again."""
    res = _run(ctx, "p-hangs-mid-write")
    _assert_clean(res, ctx)
    assert res.recovered_s is not None, res.details


@pytest.mark.slow
@pytest.mark.skipif(NETNS_REASON is not None, reason=f"no network namespaces: {NETNS_REASON}")
def test_a_stale_write_never_lands_in_blocks_given_to_another_request(ctx) -> None:
    """link-cut-stale-write: the P-D link is cut while P's WRITE runs and stays cut
    until the request ends, with D's error at D's deadline (watchdog and answer
    deadline, N-LIV-1), not the proxy's 504; parked requests fill D so that a
    victim (a plain request on D) would take the blocks D freed; then the link comes
    back and the WRITE, in flight all along, lands. D must still hold every block the
    WRITE targets for the request the cut hit (S-SAFE-1), the victim's output must
    equal its fault-free run's, and the rest of the audit must be clean. A run that
    cannot tell (victim nondeterministic, target blocks unknown or free, no landing
    seen after blocks were given away) fails with the reason.

    Measured on the 2-core CI VM, alone: 3-5 min (the pair's start 85-131 s, the fault
    89-144 s: a 61 s cut, then the audit), hence ``slow``."""
    res = _run(ctx, "link-cut-stale-write")
    _assert_clean(res, ctx)
    assert res.details.get("target_blocks_kept") == res.details.get("write_target_blocks")
    # D ended the request itself (only its blocks stayed held), before the proxy's bound
    assert res.details.get("request_status") not in (None, 504), res.details
    assert res.details["request_ended_after_s"] < LEG_IDLE_TIMEOUT_S, res.details


# -- behind the marker --------------------------------------------------------------------------


@heavy
@pytest.mark.parametrize(
    "name",
    [
        "push-reg-duplicate-late",
        "push-reg-after-lease",
        "handshake-refused-d-to-p",
        "handshake-refused-p-to-d",
        "client-abort-decode",
        "abort-p-leg",
        "abort-d-leg",
        "d-out-of-blocks",
    ],
)
def test_fault(ctx, name: str) -> None:
    _assert_clean(_run(ctx, name), ctx)


@heavy
@pytest.mark.skipif(NETNS_REASON is not None, reason=f"no network namespaces: {NETNS_REASON}")
def test_short_link_cut(ctx) -> None:
    _assert_clean(_run(ctx, "link-cut-short"), ctx)


@heavy
def test_forged_completion_is_not_accepted(ctx) -> None:
    _assert_clean(_run(ctx, "forged-completion"), ctx)


@heavy
@pytest.mark.parametrize("name", ["kill-p-before-write", "kill-d-mid-write"])
def test_kill_and_restart(ctx, name: str) -> None:
    res = _run(ctx, name)
    _assert_clean(res, ctx)
    assert res.restart and res.restart["picked_up"], res.restart


@heavy
def test_soak(ctx) -> None:
    n = int(os.environ.get("VLLM_EXT_SOAK_N", "1000"))
    out = soak(ctx, n, concurrency=3, time_bound_s=float(os.environ.get("VLLM_EXT_SOAK_S", 3000)))
    print(out)
    assert out["clean"], out
