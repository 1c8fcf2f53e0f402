# SPDX-License-Identifier: Apache-2.0
"""The benchmark's pure parts: workload, records, probes parsing, aggregation, report."""

from __future__ import annotations

import json
import random

import pytest

from devkit.bench import client, floor, probes, report
from devkit.bench import modes as M
from devkit.bench.workload import (
    Point,
    deployments,
    point_seed,
    poisson_offsets,
    round_plan,
    sweep,
)

# -- workload ---------------------------------------------------------------------------------


def test_sweep_grid_and_labels() -> None:
    pts = sweep([256, 2048], [1, 4], [2.5], num_requests=16, output_len=16)
    assert [p.key for p in pts] == [
        "in256-c=1", "in256-c=4", "in256-rate=2.5/s",
        "in2048-c=1", "in2048-c=4", "in2048-rate=2.5/s",
    ]  # fmt: skip
    assert [p.slug for p in pts[:3]] == ["in256-c1", "in256-c4", "in256-r2.5"]
    with pytest.raises(ValueError):
        Point(256, 16, 4)
    with pytest.raises(ValueError):
        Point(256, 16, 4, concurrency=1, rate=1.0)


def test_point_seed_is_stable_and_distinct() -> None:
    pts = sweep([256, 1024, 2048], [1, 4], [], 16, 16)
    seeds = [point_seed(0, p) for p in pts]
    assert seeds == [point_seed(0, p) for p in sweep([256, 1024, 2048], [1, 4], [], 16, 16)]
    assert len(set(seeds)) == len(seeds)
    assert point_seed(1, pts[0]) != point_seed(0, pts[0])
    # stable across processes and Python versions: crc32, not hash()
    assert point_seed(0, Point(1024, 16, 16, concurrency=4)) == point_seed(
        0, Point(1024, 16, 99, concurrency=4)
    )


def test_poisson_offsets_deterministic_and_plausible() -> None:
    a = poisson_offsets(4.0, 2000, seed=7)
    assert a == poisson_offsets(4.0, 2000, seed=7)
    assert a != poisson_offsets(4.0, 2000, seed=8)
    assert all(x < y for x, y in zip(a, a[1:]))
    assert a[-1] / len(a) == pytest.approx(0.25, rel=0.1)


def test_round_plan_interleaves_forward_then_reversed() -> None:
    plan = round_plan(["A", "B", "C"], 3)
    assert [m for _, m in plan] == list("ABCCBAABC")
    assert [r for r, _ in plan] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    deps = deployments(plan)
    # the mode at each round's turn keeps its engines
    assert [(d.mode, d.rounds) for d in deps] == [
        ("A", [0]), ("B", [0]), ("C", [0, 1]), ("B", [1]), ("A", [1, 2]), ("B", [2]), ("C", [2]),
    ]  # fmt: skip


def test_modes_table() -> None:
    for name in M.DEFAULT_MODES:
        assert name in M.MODES
    assert M.MODES[M.SINGLE].disaggregated is False
    assert M.MODES[M.PULL_TUNED].module_path == "devkit.bench.tuned_pull"
    assert M.pins_of(M.resolve(M.DEFAULT_MODES)) == ["0.23.0", "0.32.0"]
    with pytest.raises(ValueError, match="unknown mode"):
        M.resolve(["push-9.9"])


def test_mode_variants_set_connector_keys() -> None:
    (v,) = M.resolve(["push-0.23+push_recv_idle_wait_ms=0+push_prepare_at_announce=false+x=ab"])
    base = M.MODES["push-0.23"]
    assert v.name.startswith("push-0.23+") and v.connector == base.connector
    assert v.extra_config == {
        "push_recv_idle_wait_ms": 0,
        "push_prepare_at_announce": False,
        "x": "ab",
    }
    assert base.extra_config == {}  # the table's row is untouched
    with pytest.raises(ValueError, match="not key=value"):
        M.resolve(["push-0.23+oops"])
    with pytest.raises(ValueError, match="unknown mode"):
        M.resolve(["push-9.9+a=1"])


def test_floor_geometry() -> None:
    # tiny model (float32): 4 layer regions x 1 KiB/token; whole 128-token blocks
    assert floor.kv_geometry() == (4, 1024)
    assert floor.kv_bytes(2048) == 8 * 2**20
    assert floor.kv_bytes(1) == 128 * 4096
    assert floor.blocks_for(257) == 3


# -- records and probes -------------------------------------------------------------------------


def test_records_from_bench_serve_result() -> None:
    p = Point(256, 4, 3, concurrency=1)
    result = {
        "ttfts": [0.05, 0.0, 0.04],
        "itls": [[0.01, 0.02, 0.03], [], [0.01, 0.01, 0.01]],
        "start_times": [100.0, 100.2, 100.5],
        "input_lens": [256, 256, 257],
        "output_lens": [4, 0, 4],
        "errors": ["", "Traceback...\nClientError: boom", ""],
    }
    recs = client.records_from_result(result, "push-0.23", 1, p)
    assert [r.ok for r in recs] == [True, False, True]
    assert recs[0].e2e == pytest.approx(0.11)
    assert recs[0].tpot == pytest.approx(0.02)
    assert recs[1].error == "ClientError: boom" and recs[1].ttft is None
    assert recs[2].start == pytest.approx(0.5) and recs[2].prompt_len == 257


def test_bench_serve_argv_closed_and_open_loop() -> None:
    from pathlib import Path

    closed = client.bench_serve_argv(
        "http://h:1", "/tok", Point(1024, 16, 8, concurrency=4), 5, "x-", Path("/r"), "f.json"
    )
    assert closed[closed.index("--max-concurrency") + 1] == "4"
    assert closed[closed.index("--request-rate") + 1] == "inf"
    assert closed[closed.index("--random-input-len") + 1] == "1024"
    opened = client.bench_serve_argv(
        "http://h:1", "/tok", Point(1024, 16, 8, rate=2.0), 5, "x-", Path("/r"), "f.json"
    )
    assert "--max-concurrency" not in opened
    assert opened[opened.index("--request-rate") + 1] == "2.0"


METRICS_TEXT = """\
# HELP vllm:ext_push_handoff_seconds vllm-ext push: P request finished -> WRITE complete
# TYPE vllm:ext_push_handoff_seconds histogram
vllm:ext_push_handoff_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 1.0
vllm:ext_push_handoff_seconds_sum{engine="0",model_name="tiny"} 0.012
vllm:ext_push_handoff_seconds_count{engine="0",model_name="tiny"} 3.0
vllm:ext_push_handoff_seconds_created{engine="0",model_name="tiny"} 1.7e9
vllm:ext_push_bytes_total{engine="0",model_name="tiny"} 1048576.0
vllm:ext_push_bytes_total{engine="1",model_name="tiny"} 1048576.0
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""


def test_parse_prometheus_and_delta() -> None:
    m = probes.parse_prometheus(METRICS_TEXT)
    assert m == {
        # buckets of the hand-off histogram are kept (p50/p90 per point), others dropped
        "vllm:ext_push_handoff_seconds_bucket:le=0.001": 1.0,
        "vllm:ext_push_handoff_seconds_sum": 0.012,
        "vllm:ext_push_handoff_seconds_count": 3.0,
        "vllm:ext_push_bytes_total": 2097152.0,
    }
    after = dict(m, **{"vllm:ext_push_handoff_seconds_count": 5.0, "vllm:nixl_new": 1.0})
    assert probes.delta(m, after) == {
        "vllm:ext_push_handoff_seconds_bucket:le=0.001": 0.0,  # kept: a quantile's bound
        "vllm:ext_push_handoff_seconds_count": 2.0,
        "vllm:nixl_new": 1.0,
    }


def test_histogram_quantile_from_bucket_deltas() -> None:
    text = (
        "".join(
            f'vllm:nixl_xfer_time_seconds_bucket{{engine="{e}",le="{le}"}} {c}\n'
            for e in (0, 1)
            for le, c in (("0.001", 1), ("0.005", 3), ("0.01", 4), ("+Inf", 4))
        )
        + 'vllm:nixl_num_descriptors_bucket{engine="0",le="8.0"} 1.0\n'
    )
    m = probes.parse_prometheus(text)
    assert "vllm:nixl_num_descriptors_bucket:le=8.0" not in m
    b = probes.buckets_of({f"D:{k}": v for k, v in m.items()}, "vllm:nixl_xfer_time_seconds")
    assert b == {0.001: 2, 0.005: 6, 0.01: 8, float("inf"): 8}
    assert probes.histogram_quantile(b, 0.5) == pytest.approx(0.001 + 0.004 * 2 / 4)
    assert probes.histogram_quantile(b, 0.9) == pytest.approx(0.005 + 0.005 * 1.2 / 2)
    assert probes.histogram_quantile({}, 0.5) is None
    assert probes.histogram_quantile({1.0: 0, float("inf"): 0}, 0.5) is None
    assert probes.histogram_quantile({1.0: 1, float("inf"): 3}, 0.9) == 1.0  # in +Inf
    # a point's delta keeps the empty buckets below: they bound the interpolation
    before = {"h_bucket:le=0.001": 5.0, "h_bucket:le=0.005": 5.0, "h_bucket:le=+Inf": 5.0}
    after = {"h_bucket:le=0.001": 5.0, "h_bucket:le=0.005": 9.0, "h_bucket:le=+Inf": 9.0}
    d = probes.delta(before, after)
    assert d == {"h_bucket:le=0.001": 0.0, "h_bucket:le=0.005": 4.0, "h_bucket:le=+Inf": 4.0}
    assert probes.histogram_quantile(probes.buckets_of(d, "h"), 0.5) == pytest.approx(0.003)


# -- aggregation and report ----------------------------------------------------------------------


def test_percentile_matches_numpy() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    xs = [rng.random() for _ in range(37)]
    for q in (0, 1, 50, 90, 99, 100):
        assert report.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert report.percentile([], 50) is None
    assert report.percentile([2.0], 99) == 2.0


def canned_results() -> dict:
    """Two lengths x two loads x four modes, TTFTs chosen so every target has a verdict."""
    ttft = {  # mode -> base TTFT (s) at 1024; scales with length
        M.SINGLE: 0.05, M.OURS: 0.07, M.PULL: 0.20, M.VLLM_PUSH: 0.30, M.PULL_TUNED: 0.12,
    }  # fmt: skip
    reqs, points = [], []
    for mode, base in ttft.items():
        for n in (1024, 2048):
            for load in ("c=1", "c=4"):
                key = f"in{n}-{load}"
                scale = (n / 1024) * (2 if load == "c=4" else 1)
                for rnd in (0, 1):
                    for i in range(4):
                        t = base * scale * (1 + 0.01 * i)
                        reqs.append({
                            "mode": mode, "round": rnd, "point": key, "input_len": n,
                            "load": load, "prompt_len": n, "output_len": 16, "ttft": t,
                            "tpot": 0.004 if mode == M.OURS else 0.005, "e2e": t + 0.06,
                            "start": i * 0.1, "itl": [0.004] * 15, "error": "",
                        })  # fmt: skip
                    metrics = {}
                    if mode == M.OURS:
                        metrics = {"P": {"vllm:ext_push_handoff_seconds_sum": 4 * 0.002,
                                         "vllm:ext_push_handoff_seconds_count": 4.0,
                                         "vllm:ext_push_writes_total": 4.0,
                                         "vllm:ext_push_bytes_total": 4.0 * n * 2048}}  # fmt: skip
                    points.append({"mode": mode, "round": rnd, "point": key, "input_len": n,
                                   "load": load, "metrics": metrics})  # fmt: skip
    return {
        "run_id": "canned",
        "config": {"modes": list(ttft), "rounds": 2, "num_requests": 4, "output_len": 16},
        "machine": {"cpu": "test cpu", "cores": 2},
        "floor": [
            {
                "input_len": n,
                "bytes": n * 2048,
                "memcpy_s": 1e-4,
                "nixl_write_notif_p50_s": 0.0016,
                "nixl_write_done_p50_s": 0.0016,
            }
            for n in (1024, 2048)
        ],  # fmt: skip
        "idle_cpu": {M.OURS: {"prefill": 0.02, "decode": 0.03, "proxy": 0.0}},
        "requests": reqs,
        "points": points,
    }


def test_aggregate_overhead_and_targets() -> None:
    res = canned_results()
    report.finish(res)
    rows = res["aggregates"]
    assert len(rows) == 5 * 4
    ours = next(r for r in rows if r["mode"] == M.OURS and r["point"] == "in2048-c=4")
    assert ours["n"] == 8 and ours["failed"] == 0
    assert ours["ttft_p50"] == pytest.approx(0.07 * 4 * 1.015)
    assert ours["overhead_p50"] == pytest.approx((0.07 - 0.05) * 4 * 1.015)
    assert ours["handoff_mean"] == pytest.approx(0.002)
    assert ours["kv_bytes_per_request"] == pytest.approx(2048 * 2048)
    single = next(r for r in rows if r["mode"] == M.SINGLE and r["point"] == "in2048-c=4")
    assert single["overhead_p50"] is None
    verdicts = {t["id"]: (t["verdict"], t["ratio"]) for t in res["targets"]}
    assert verdicts["T1a"][0] == "pass"
    assert verdicts["T1a"][1] == pytest.approx(0.02 / 0.15)
    assert verdicts["T1b"][0] == "pass"
    assert verdicts["T2"] == ("pass", pytest.approx(0.07 / 0.30))
    assert verdicts["T3"] == ("pass", pytest.approx(0.002 / 0.0016))
    assert verdicts["T4"] == ("pass", pytest.approx(0.8))
    assert verdicts["T5"] == ("pass", pytest.approx(0.03))


def test_targets_not_applicable_without_rows() -> None:
    res = canned_results()
    res["requests"] = [r for r in res["requests"] if r["mode"] != M.VLLM_PUSH]
    res["idle_cpu"] = {}
    report.finish(res)
    verdicts = {t["id"]: t["verdict"] for t in res["targets"]}
    assert verdicts["T2"] == "n/a" and verdicts["T5"] == "n/a"


def test_report_files_from_canned_json(tmp_path) -> None:
    res = json.loads(json.dumps(canned_results()))  # as if read back from results.json
    paths = report.write(res, tmp_path, plots=False)
    md = paths["md"].read_text()
    assert "**TTFT p50 / p99 (ms)**" in md
    assert "| 2048 | c=4 |" in md
    assert "| T1a |" in md and "pass" in md
    assert "Disaggregation overhead" in md
    saved = json.loads(paths["json"].read_text())
    assert saved["targets"] and saved["aggregates"]


def test_handoff_table_has_a_column_per_load_level_for_poisson_runs(tmp_path) -> None:
    res = canned_results()
    as_rate = {"c=1": "rate=1/s", "c=4": "rate=2/s"}
    for r in (*res["requests"], *res["points"]):
        r["load"] = as_rate[r["load"]]
        r["point"] = f"in{r['input_len']}-{r['load']}"
    md = report.write(res, tmp_path, plots=False)["md"].read_text()
    table = md[md.index("**KV hand-off") :].split("\n\n")[1]
    header = table.splitlines()[0]
    assert "push hand-off rate=1/s" in header and "push hand-off rate=2/s" in header
    assert "hand-off / floor (rate=1/s)" in header
    # 2 ms hand-offs at both levels against a 1.6 ms floor
    assert "| 1024 | 2.00 | 0.100 |" in table and "| 2.00 | 2.00 | 1.25 |" in table


def test_plots_from_canned_json(tmp_path) -> None:
    import matplotlib  # noqa: F401  (installed by the env builder: the dev extra has bench)

    res = canned_results()
    report.finish(res)
    paths = report.plot(res, tmp_path)
    assert sorted(p.name for p in paths) == ["overhead.png", "tpot.png", "ttft.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_floor_by_len_takes_the_lowest() -> None:
    res = canned_results()
    res["floor"] = [
        {"input_len": 1024, "bytes": 1, "memcpy_s": 1e-5, "nixl_write_notif_p50_s": 0.002,
         "cpus": [None, None]},
        {"input_len": 1024, "bytes": 1, "memcpy_s": 1e-5, "nixl_write_notif_p50_s": 0.001,
         "nixl_write_notif_fresh_p50_s": 0.003, "cpus": [0, 1]},
    ]  # fmt: skip
    res["floor_end"] = [
        {"input_len": 1024, "bytes": 1, "memcpy_s": 1e-5, "nixl_write_notif_p50_s": 0.0015,
         "nixl_write_notif_fresh_p50_s": 0.0025, "cpus": [None, None]},
    ]  # fmt: skip
    assert report.floor_by_len(res)[1024]["nixl_write_notif_p50_s"] == 0.001
    md = report.markdown({**res, "aggregates": []})
    # free, pinned, then the lowest fresh-blocks floor
    assert "| 1024 | 0.00 | 0.010 | 1.50 | 1.00 | 2.50 |" in md


def test_handoff_breakdown_from_synthetic_traces(tmp_path) -> None:
    from devkit.bench import handoff

    trace = tmp_path / "trace"
    trace.mkdir()
    xid = "run-push-0.23-traced-r1-in256-c1-0"
    d_rid, p_rid = f"cmpl-{xid}-0-aaaa1111", f"cmpl-{xid}-0-bbbb2222"
    p_events = [
        {"ev": "handed", "rid": p_rid, "finished_at": 10.000, "t": 10.002},
        {"ev": "w_fin", "rid": p_rid, "t": 10.0025},
        {"ev": "w_write", "p_rid": p_rid, "d_rid": d_rid, "t": 10.0026},
        {"ev": "init_xfer", "t0": 10.0027, "t": 10.0028, "notif": f"{d_rid}:1"},
        {"ev": "transfer", "t0": 10.0028, "t": 10.0038, "notif": f"{d_rid}:1"},
        {"ev": "xfer_done", "t": 10.0040, "notif": f"{d_rid}:1"},
        {"ev": "settle", "rid": p_rid, "t": 10.0041},
    ]
    d_events = [
        {"ev": "notif_in", "t": 10.0045, "msg": f"{d_rid}:1"[:60]},  # truncated like old traces
        {"ev": "got_recv", "rid": d_rid, "t": 10.006},
    ]
    for name, evs in (("trace-prefill-x-1.jsonl", p_events), ("trace-decode-y-2.jsonl", d_events)):
        (trace / name).write_text("\n".join(json.dumps(e) for e in evs) + "\n")
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "push-0.23-traced-r1-in256-c1.json").write_text(
        json.dumps({"start_times": [9.99], "ttfts": [0.03]})
    )
    clients = handoff.client_times(raw, "run", "push-0.23-traced")
    assert clients == {xid: ("in256-c1", 9.99, pytest.approx(10.02))}
    res = handoff.breakdown(trace, clients)
    st = res["by_point"]["in256-c1"]
    assert res["requests"] == 1
    assert st["P KV final -> handed to the writer"]["p50"] == pytest.approx(2.0)
    assert st["hand-off total (P finished -> settled)"]["p50"] == pytest.approx(4.1)
    assert st["post -> completion notif read on D"]["p50"] == pytest.approx(0.7)
    assert st["P KV final -> completion read on D (D ready)"]["p50"] == pytest.approx(4.5)
    assert st["D get_finished -> first token at client"]["p50"] == pytest.approx(14.0)
    assert st["client sent -> first token (TTFT)"]["p50"] == pytest.approx(30.0)
    assert res["prepared_before_kv_final"] == 0


def test_handoff_breakdown_of_a_write_prepared_before_the_kv_was_final(tmp_path) -> None:
    """push_prepare_at_announce: the writer saw the request and built the WRITE during the
    forward pass; the pick-up is its first pass after the hand-over."""
    from devkit.bench import handoff

    trace = tmp_path / "trace"
    trace.mkdir()
    d_rid, p_rid = "cmpl-x-0-aaaa1111", "cmpl-x-0-bbbb2222"
    p_events = [
        {"ev": "announced", "rid": p_rid, "finished_at": 0.0, "t": 9.990},
        {"ev": "w_fin", "rid": p_rid, "t": 9.991},
        {"ev": "w_write", "p_rid": p_rid, "d_rid": d_rid, "t": 9.9911},
        {"ev": "init_xfer", "t0": 9.9912, "t": 9.9913, "notif": f"{d_rid}:1"},
        {"ev": "handed", "rid": p_rid, "finished_at": 10.000, "t": 10.0001},
        {"ev": "w_fin", "rid": p_rid, "t": 10.0002},
        {"ev": "transfer", "t0": 10.0003, "t": 10.0008, "notif": f"{d_rid}:1"},
        {"ev": "xfer_done", "t": 10.0009, "notif": f"{d_rid}:1"},
        {"ev": "settle", "rid": p_rid, "t": 10.0010},
    ]
    (trace / "trace-prefill-x-1.jsonl").write_text("\n".join(json.dumps(e) for e in p_events))
    res = handoff.breakdown(trace)
    st = res["stages_ms"]
    assert res["requests"] == 1 and res["prepared_before_kv_final"] == 1
    assert st["handed -> writer picks it up"]["p50"] == pytest.approx(0.1)
    pick = "writer: pick-up -> transfer() (match, descriptors, init unless prepared)"
    assert st[pick]["p50"] == pytest.approx(0.1)
    assert st["hand-off total (P finished -> settled)"]["p50"] == pytest.approx(1.0)
