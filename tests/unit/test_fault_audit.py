# SPDX-License-Identifier: Apache-2.0
"""The fault audit's judgement of outputs, without engines: every request that got an
HTTP 200 is compared with a single engine's output (a wrong 200 is a problem that
names the request and the first differing token), and a run that cannot tell (the
fault not injected as meant, a harness error, a check without a truth) is reported
as inconclusive, never as clean."""

from __future__ import annotations

import types
from typing import Any

import pytest

from devkit.testing.faults import audit, catalog, network_faults
from devkit.testing.faults.client import Outcome
from devkit.testing.faults.runner import outcome_cell

REF = [11, 12, 13, 14, 15, 16]


def _ok(rid: str, tokens: list[int]) -> Outcome:
    return Outcome(rid, 3000, kind="ok", status=200, token_ids=list(tokens), t0=0.0, t1=2.0)


def _result(expect: str = "error") -> audit.FaultResult:
    r = audit.FaultResult("push-reg-dropped", "ours", "netns", t_fault=0.0, expect=expect)
    r.leaked_blocks = {"prefill": 0, "decode": 0}
    return r


def test_a_wrong_200_among_the_affected_requests_is_a_problem() -> None:
    """The fault expects an error; the request got a 200 with other tokens than a
    single engine's from index 3: FAIL, naming the request and the index."""
    r = _result(expect="error")
    r.affected = [_ok("flt-a", [11, 12, 13, 99, 15, 16])]
    r.references = {"flt-a": REF}
    problems = r.problems(40)
    assert any("flt-a" in p and "token 3" in p for p in problems), problems
    assert r.verdict(40) == "FAIL"
    assert r.summary(40)["wrong_outputs"] == 1


@pytest.mark.parametrize("expect", ["error", "ok"])
def test_a_wrong_200_is_a_problem_whatever_the_fault_expects(expect: str) -> None:
    r = _result(expect=expect)
    r.affected = [_ok("flt-b", [11, 12])]  # short: differs at the first missing token
    r.references = {"flt-b": REF}
    assert any("flt-b" in p and "token 2" in p for p in r.problems(40)), r.problems(40)


def test_a_right_200_where_an_error_was_expected_is_reported_as_served() -> None:
    """Serving the request with a single engine's output is allowed where the fault
    expects an error (e.g. P's WRITE completed after all); the table says so."""
    r = _result(expect="error")
    r.affected = [_ok("flt-c", REF)]
    r.references = {"flt-c": REF}
    assert r.problems(40) == []
    assert r.verdict(40) == "clean"
    s = r.summary(40)
    assert s["served_right"] == 1
    assert "served with the single engine's output" in outcome_cell(s)


def test_a_200_without_a_reference_is_a_problem() -> None:
    r = _result(expect="error")
    r.affected = [_ok("flt-d", REF)]
    r.bystanders = [_ok("flt-e", REF)]
    r.references = {"flt-e": REF}
    problems = r.problems(40)
    assert any("flt-d" in p and "no reference" in p for p in problems), problems
    assert not any("flt-e" in p for p in problems), problems


def test_a_wrong_bystander_is_named() -> None:
    r = _result()
    r.affected = [Outcome("flt-f", 3000, kind="error", status=502, message="decode leg failed",
                          t0=0.0, t1=20.0)]  # fmt: skip
    r.bystanders = [_ok("flt-g", [11, 12, 13, 14, 15, 0])]
    r.references = {"flt-g": REF}
    problems = r.problems(40)
    assert any("bystander" in p and "flt-g" in p and "token 5" in p for p in problems), problems


def test_the_tokens_of_an_aborted_stream_must_start_the_reference() -> None:
    """A request the client left mid-stream: what it received is checked too."""
    r = _result()
    aborted = Outcome("flt-h", 300, kind="aborted", token_ids=[11, 12, 77], t0=0.0, t1=1.0)
    r.affected = [aborted]
    r.references = {"flt-h": REF}
    assert any("flt-h" in p and "token 2" in p for p in r.problems(40)), r.problems(40)
    aborted.token_ids = [11, 12, 13]
    assert r.problems(40) == []


def test_an_inconclusive_result_is_not_clean() -> None:
    r = _result()
    r.affected = [Outcome("flt-i", 3000, kind="error", status=502, message="decode leg failed",
                          t0=0.0, t1=20.0)]  # fmt: skip
    r.inconclusive = "P never reached the WRITE"
    assert r.problems(40) == []
    assert r.verdict(40) == "inconclusive"
    cell = outcome_cell(r.summary(40))
    assert cell.startswith("inconclusive (P never reached the WRITE)"), cell


def test_a_harness_error_is_not_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault whose harness raised never ran: run_fault records it, and its verdict
    is not clean."""

    def broken(ctx: Any) -> audit.FaultResult:
        raise RuntimeError("reference request failed")

    monkeypatch.setitem(catalog.FAULTS, "broken", broken)
    monkeypatch.setattr(catalog, "healthy", lambda pair, role: True)
    pair = types.SimpleNamespace(clear_rules=lambda: None, topology=None,
                                 alive=lambda role: True)  # fmt: skip
    stack = types.SimpleNamespace(name="ours")
    ctx = types.SimpleNamespace(pair=pair, say=lambda msg: None, bound_s=40.0, stack=stack,
                                net="loopback")  # fmt: skip
    res = catalog.run_fault(ctx, "broken")  # type: ignore[arg-type]
    assert res.verdict(40) == "inconclusive"
    assert "reference request failed" in outcome_cell(res.summary(40))


# -- link-cut-stale-write's judgement -------------------------------------------------------------


def _stale(**kw: Any) -> dict[str, Any]:
    """Observations of a link-cut-stale-write run where D kept the WRITE's target
    blocks (its quarantine) while the victim ran; ``kw`` changes them."""
    obs: dict[str, Any] = {
        "baseline": [REF, REF],
        "stale_rid": "fltstale1x",
        "victim_rid": "fltvictimx",
        "stale_outcome": Outcome("fltstale1x", 3000, kind="error", status=504, t0=0.0, t1=58.0),
        "target": [5, 6, 7, 8],
        "holders": {
            "cmpl-fltstale1x-0": [5, 6, 7, 8],
            "cmpl-fltvictimx-0": [40, 41],
            "cmpl-fltpark1x-0": [9, 10],
        },
        "ends": {"cmpl-fltvictimx-0": 90.0, "cmpl-fltpark1x-0": 80.0},
        "restored": 62.0,
        "landed": 73.0,
    }
    obs.update(kw)
    return obs


def _judge(**kw: Any) -> audit.FaultResult:
    r = _result()
    r.fault = "link-cut-stale-write"
    network_faults.judge_stale_write(r, _stale(**kw))
    return r


def test_stale_write_with_the_target_blocks_kept_is_clean() -> None:
    r = _judge()
    assert r.problems(40) == [] and r.verdict(40) == "clean", (r.problems(40), r.inconclusive)


def test_stale_write_with_a_nondeterministic_victim_is_inconclusive() -> None:
    r = _judge(baseline=[REF, [*REF[:-1], 0]])
    assert r.verdict(40) == "inconclusive"
    assert "fault-free runs" in r.inconclusive


def test_stale_write_without_the_target_blocks_is_inconclusive() -> None:
    r = _judge(target=[])
    assert r.verdict(40) == "inconclusive"


def test_stale_write_into_blocks_given_away_is_a_problem() -> None:
    """D gave two of the target blocks to the victim while the link was cut, and the
    WRITE landed after the restore while the victim still ran: FAIL, whatever the
    victim's output."""
    holders = {"cmpl-fltstale1x-0": [5, 6], "cmpl-fltvictimx-0": [7, 8, 40],
               "cmpl-fltpark1x-0": [9, 10]}  # fmt: skip
    r = _judge(holders=holders)
    problems = r.problems(40)
    assert any("cmpl-fltvictimx-0" in p and "landed" in p for p in problems), problems
    assert r.verdict(40) == "FAIL"


def test_stale_write_given_away_but_not_seen_landing_is_inconclusive() -> None:
    holders = {"cmpl-fltstale1x-0": [5, 6], "cmpl-fltvictimx-0": [7, 8, 40]}
    r = _judge(holders=holders, landed=None)
    assert r.verdict(40) == "inconclusive"
    assert "cmpl-fltvictimx-0" in r.inconclusive


def test_stale_write_without_the_victims_blocks_is_inconclusive() -> None:
    """The scheduler's blocks per request could not be read (the victim, running,
    is not among them): the run cannot tell who held the target blocks."""
    r = _judge(holders={})
    assert r.verdict(40) == "inconclusive"
    assert "victim" in r.inconclusive


def test_stale_write_with_target_blocks_freed_and_not_taken_is_inconclusive() -> None:
    r = _judge(holders={"cmpl-fltstale1x-0": [5], "cmpl-fltvictimx-0": [40, 41]})
    assert r.verdict(40) == "inconclusive"


def test_stale_write_where_the_request_was_served_is_inconclusive() -> None:
    r = _judge(stale_outcome=_ok("fltstale1x", REF))
    assert r.verdict(40) == "inconclusive"


def test_a_504_is_no_problem_only_where_the_partition_outlasts_the_request() -> None:
    """link-cut-stale-write keeps the link cut until the request it hit ended: under
    S-SAFE-1 only the proxy's bound can end it. Anywhere else a 504 is a problem."""
    r = _result()
    r.affected = [Outcome("flt-j", 3000, kind="error", status=504, message="decode leg idle",
                          t0=0.0, t1=59.0)]  # fmt: skip
    r.t_fault_end = 62.0
    assert r.problems(40) == ["request ended only after 59s (504)"]
    r.outlasts_request = True
    assert r.problems(40) == []
