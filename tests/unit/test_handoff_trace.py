# SPDX-License-Identifier: Apache-2.0
"""The connector-agnostic hand-off clock (devkit.bench.handoff_trace) and the GPU
baseline mode of vLLM 0.26.0's own push."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from devkit.bench import gpu, handoff_trace
from devkit.bench import modes as M
from devkit.bundle import build
from devkit.bundle.installer import BundleError


class _Connector:
    """The three interface calls the clock wraps, as a push connector answers them."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def request_finished(self, request, block_ids):  # type: ignore[no-untyped-def]
        self.calls.append("finished")
        return False, None

    def request_finished_all_groups(self, request, block_ids):  # type: ignore[no-untyped-def]
        self.calls.append("finished_all")
        return False, None

    def update_state_after_alloc(self, request, blocks, n):  # type: ignore[no-untyped-def]
        request.kv_transfer_params["do_remote_prefill"] = False  # as vLLM's push does
        self.calls.append("alloc")

    def get_finished(self, finished_req_ids):  # type: ignore[no-untyped-def]
        self.calls.append("get_finished")
        return set(), set(self.recving)

    # D's step: the scheduler side's batch and the worker-side hooks
    def build_connector_meta(self, scheduler_output):  # type: ignore[no-untyped-def]
        return None

    def start_load_kv(self, forward_context, **kw):  # type: ignore[no-untyped-def]
        pass

    def wait_for_layer_load(self, layer_name):  # type: ignore[no-untyped-def]
        pass

    def wait_for_save(self):  # type: ignore[no-untyped-def]
        pass


def _req(rid: str, **params: object) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, kv_transfer_params=dict(params))


def test_wrapped_connector_logs_and_joins_by_transfer_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Conn(_Connector):
        pass

    monkeypatch.setenv(handoff_trace.ENV, str(tmp_path))
    assert handoff_trace.wrap(Conn) and not handoff_trace.wrap(Conn)
    p, d = Conn(), Conn()
    # P: prefill of transfer t1 done; a plain request (no remote decode) logs nothing
    assert p.request_finished_all_groups(_req("p-1", do_remote_decode=True, transfer_id="t1"), ())
    p.request_finished(_req("p-2"), [])
    # D: allocation names D's id for t1, then the worker reports it received (and a stranger)
    d.update_state_after_alloc(_req("d-1", do_remote_prefill=True, transfer_id="t1"), None, 5)
    d.recving = {"d-1", "d-9"}
    assert d.get_finished(set()) == (set(), {"d-1", "d-9"})
    assert p.calls == ["finished_all", "finished"] and d.calls == ["alloc", "get_finished"]
    events = handoff_trace.read_events(tmp_path)
    assert [e["ev"] for e in events] == ["p_done", "d_alloc", "d_recv", "d_recv"]
    (h,) = handoff_trace.handoffs(events)
    assert h["s"] >= 0
    assert handoff_trace.window(tmp_path, h["t"], h["t"]) == [h["s"]]
    assert handoff_trace.window(tmp_path, h["t"] + 1, h["t"] + 2) == []


def test_d_steps_record_the_batch_and_the_wait_in_the_connectors_hooks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer's step: the latest schedule's batch, and the wall time of its
    worker-side hooks since the previous get_finished (a fake clock the hooks advance);
    a producer records no step."""
    from vllm_ext import handoff_trace as runtime

    clock, cpu = [100.0], [7.0]
    monkeypatch.setattr(runtime.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(runtime.time, "thread_time", lambda: cpu[0])
    monkeypatch.setattr(runtime, "_files", {})  # this process's file: under tmp_path
    monkeypatch.setattr(runtime._Step, "hook_s", 0.0)
    monkeypatch.setattr(runtime._Step, "cpu_s", 0.0)

    def run(us: float, cpu_us: float) -> None:  # wall time, of which the thread ran cpu_us
        clock[0] += us / 1e6
        cpu[0] += cpu_us / 1e6

    class Conn(_Connector):
        def start_load_kv(self, forward_context, **kw):  # type: ignore[no-untyped-def]
            run(300, 100)  # 200 us blocked

        def wait_for_layer_load(self, layer_name):  # type: ignore[no-untyped-def]
            run(10, 10)

        def get_finished(self, finished_req_ids):  # type: ignore[no-untyped-def]
            run(500, 480)
            return set(), set()

    monkeypatch.setenv(handoff_trace.ENV, str(tmp_path))
    handoff_trace.wrap(Conn)
    d, p = Conn(), Conn()
    d._kv_transfer_config = SimpleNamespace(is_kv_consumer=True)
    p._kv_transfer_config = SimpleNamespace(is_kv_consumer=False)
    sched = SimpleNamespace(
        num_scheduled_tokens={"a": 1, "b": 1, "c": 40}, total_num_scheduled_tokens=42
    )
    d.build_connector_meta(sched)
    d.start_load_kv(None)
    run(1e6, 1e6)  # the forward pass: not the connector's
    for _ in range(2):
        d.wait_for_layer_load("l")
    d.get_finished(set())
    d.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, total_num_scheduled_tokens=0))
    d.get_finished(set())  # an empty step
    p.start_load_kv(None)
    p.get_finished(set())
    steps = [e for e in handoff_trace.read_events(tmp_path) if e["ev"] == "d_step"]
    assert [(e["hook_us"], e["hook_cpu_us"], e["reqs"], e["tokens"]) for e in steps] == [
        (820.0, 600.0, 3, 42), (500.0, 480.0, 0, 0),
    ]  # fmt: skip
    # P's hooks ran after D's last step: they count in no D step (nor a later one)
    summary = handoff_trace.d_steps(tmp_path, 0.0, float("inf"))
    assert summary["steps"] == 2 and summary["busy_steps"] == 1
    assert summary["busy_hook_us"]["p50"] == 820.0 and summary["batch_reqs"]["p50"] == 3.0
    # of the busy step's 820 us, 600 the thread ran and 220 it did not (start_load_kv)
    assert summary["busy_hook_cpu_us"]["p50"] == 600.0
    assert summary["busy_wait_us"]["p50"] == 220.0
    assert handoff_trace.d_steps(tmp_path, 0.0, 0.0)["steps"] == 0


@pytest.mark.parametrize("delegates", [False, True], ids=["own", "via-get-finished"])
def test_a_step_ended_by_get_transfer_results_is_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, delegates: bool
) -> None:
    """vLLM's V2 model runner (0.32.0 on) ends D's step with ``get_transfer_results``,
    which vLLM's NIXL connectors answer without ``get_finished`` ("own") and vLLM's
    base class answers by calling it ("via-get-finished"): each step logs one d_step
    and each received request one d_recv."""
    from vllm_ext import handoff_trace as runtime

    monkeypatch.setattr(runtime, "_files", {})
    monkeypatch.setattr(runtime._Step, "hook_s", 0.0)
    monkeypatch.setattr(runtime._Step, "cpu_s", 0.0)

    class Conn(_Connector):
        def get_transfer_results(self, finished_req_ids):  # type: ignore[no-untyped-def]
            if delegates:
                sending, recving = self.get_finished(finished_req_ids)
            else:
                sending, recving = set(), set(self.recving)
            return SimpleNamespace(finished_sending=sending, finished_recving=recving)

    monkeypatch.setenv(handoff_trace.ENV, str(tmp_path))
    handoff_trace.wrap(Conn)
    d = Conn()
    d._kv_transfer_config = SimpleNamespace(is_kv_consumer=True)
    d.build_connector_meta(
        SimpleNamespace(num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1)
    )
    d.recving = {"a"}
    assert d.get_transfer_results(set()).finished_recving == {"a"}
    d.recving = set()
    d.get_transfer_results(set())
    events = handoff_trace.read_events(tmp_path)
    assert [e["rid"] for e in events if e["ev"] == "d_recv"] == ["a"]
    assert [e["reqs"] for e in events if e["ev"] == "d_step"] == [1, 1]


def test_a_step_logged_by_a_worker_process_takes_the_latest_schedule_before_it(
    tmp_path: Path,
) -> None:
    events = [
        {"ev": "d_sched", "reqs": 5, "tokens": 5, "t": 1.0},
        {"ev": "d_step", "hook_us": 90.0, "reqs": None, "tokens": None, "t": 1.5},
        {"ev": "d_sched", "reqs": 0, "tokens": 0, "t": 2.0},
        {"ev": "d_step", "hook_us": 10.0, "reqs": None, "tokens": None, "t": 2.5},
    ]
    (tmp_path / "handoff-1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    s = handoff_trace.d_steps(tmp_path, 0.0, 3.0)
    assert (s["steps"], s["busy_steps"], s["batch_reqs"]["p50"]) == (2, 1, 5.0)
    assert s["busy_hook_us"]["p50"] == 90.0 and s["hook_us"]["mean"] == 50.0


def test_goodput_counts_requests_that_met_both_slos_per_second_of_point() -> None:
    from devkit.bench import report_dstep

    req = {"mode": "m", "point": "in=8 c=2", "error": ""}
    results = {
        "config": {"slo_ttft_ms": 100, "slo_tpot_ms": 10},
        "points": [{"mode": "m", "point": "in=8 c=2", "duration_s": 2.0}],
        "requests": [
            {**req, "ttft": 0.05, "tpot": 0.005},  # met both
            {**req, "ttft": 0.15, "tpot": 0.005},  # TTFT over
            {**req, "ttft": 0.05, "tpot": 0.02},  # TPOT over
            {**req, "ttft": 0.01, "tpot": 0.001, "error": "boom"},
        ],
    }
    table = report_dstep.goodput_table(results)
    assert "| m | in=8 c=2 | 1 / 4 | 0.50 |" in table
    assert report_dstep.goodput_table({**results, "config": {}}) == ""


def test_join_takes_the_first_report_and_skips_unmatched() -> None:
    events = [
        {"ev": "p_done", "tid": "a", "t": 10.0},
        {"ev": "p_done", "tid": "b", "t": 11.0},  # D never received it
        {"ev": "d_alloc", "tid": "a", "rid": "d-a", "t": 9.5},
        {"ev": "d_recv", "rid": "d-a", "t": 10.25},
        {"ev": "d_recv", "rid": "d-a", "t": 12.0},
    ]
    assert handoff_trace.handoffs(events) == [{"t": 10.0, "s": 0.25}]


def test_trace_off_without_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(handoff_trace.ENV, raising=False)
    assert handoff_trace.install() == []
    handoff_trace._log("p_done", tid="x")
    assert list(tmp_path.iterdir()) == []


def test_a_cut_line_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "handoff-1.jsonl").write_text(
        json.dumps({"ev": "p_done", "tid": "a", "t": 1.0}) + '\n{"ev": "d_rec'
    )
    assert [e["ev"] for e in handoff_trace.read_events(tmp_path)] == ["p_done"]


def test_vllm_push_026_mode_is_vllms_own_connector_through_the_shim_proxy() -> None:
    m = M.MODES["vllm-push-0.26"]
    assert (m.pin, m.launch, m.connector) == ("0.26.0", "push", "NixlPushConnector")
    assert m.proxy_module == M.VLLM_PUSH_PROXY and m.vllm_connector
    assert not M.MODES["push-0.23"].vllm_connector
    assert "vllm-push-0.26" not in M.DEFAULT_MODES


def test_a_mode_with_its_own_proxy_starts_that_proxy_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's push modes run the shim proxy in place of ours: one proxy, that one."""
    import devkit.launch.engine as engine_mod
    import devkit.launch.pd as pd_mod
    from devkit.bench.runner import deployment_of
    from devkit.launch.pd import PDConfig

    proxies: list[list[str]] = []

    class Recorded:
        def __init__(self, name: str, argv: list[str], *a: object, **k: object) -> None:
            self.argv = list(argv)
            if name == "proxy":
                proxies.append(self.argv)

    monkeypatch.setattr(engine_mod, "ManagedProcess", Recorded)
    monkeypatch.setattr(pd_mod, "ManagedProcess", Recorded)
    cfg = PDConfig(mode="push", model="m", run_dir=tmp_path)
    deployment_of(cfg, M.MODES["vllm-push-0.26"]).start()
    deployment_of(cfg, M.MODES["push-0.23"]).start()
    assert [argv[2] for argv in proxies] == [M.VLLM_PUSH_PROXY, "vllm_ext.proxy"]


def test_gpu_bench_takes_another_pins_python(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ext import compat

    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.23.0")
    modes = M.resolve(["push-0.23", "vllm-push-0.26", "single-0.23"])
    with pytest.raises(SystemExit, match=r"need vLLM \['0.26.0'\]"):
        gpu._pythons(modes)
    assert gpu._pythons(modes, ["0.26.0=/opt/py026"]) == {
        "0.23.0": sys.executable, "0.26.0": "/opt/py026",
    }  # fmt: skip
    with pytest.raises(SystemExit, match="PIN=EXE"):
        gpu._pythons(modes, ["0.26.0"])


def test_vllm_connector_engines_get_no_runner_setting(tmp_path: Path) -> None:
    from devkit.bench.runner import BenchDeployment
    from devkit.launch.gpu import GpuOptions
    from devkit.launch.pd import PDConfig

    def env_of(vllm_connector: bool, extra_env: dict[str, str]) -> dict[str, str]:
        cfg = PDConfig(
            mode="push", model="m", run_dir=tmp_path, connector="NixlPushConnector",
            gpu=GpuOptions(p_devices="0", d_devices="0"), extra_env=dict(extra_env),
        )  # fmt: skip
        dep = BenchDeployment(cfg, vllm_connector=vllm_connector)
        kv = dep._kv("NixlPushConnector", "kv_producer", "p")
        return dep._spec("prefill", kv, None).extra_env

    if "VLLM_USE_V2_MODEL_RUNNER" in os.environ:
        pytest.skip("the caller's environment chooses the runner")
    assert env_of(False, {}).get("VLLM_USE_V2_MODEL_RUNNER") == "0"  # ours: V1 runner
    assert "VLLM_USE_V2_MODEL_RUNNER" not in env_of(True, {})  # vLLM's: as released
    assert env_of(True, {"VLLM_USE_V2_MODEL_RUNNER": "1"})["VLLM_USE_V2_MODEL_RUNNER"] == "1"


def test_the_traced_connector_runs_with_the_kv_layout_of_ours(tmp_path: Path) -> None:
    """The traced mode measures our hand-off: its engines lay the KV out cross-layer as
    ours do (the launcher would not know the subclass by its name)."""
    from devkit.bench.runner import BenchDeployment
    from devkit.launch.gpu import GpuOptions
    from devkit.launch.pd import PDConfig

    if "VLLM_USE_V2_MODEL_RUNNER" in os.environ:
        pytest.skip("the caller's environment chooses the runner")
    mode = M.mode_of("push-0.23-traced+push_progressive=true")
    assert mode.extends_ours and not M.MODES["pull-0.23-tuned"].extends_ours
    cfg = PDConfig(
        mode="push", model="m", run_dir=tmp_path, connector=mode.connector,
        gpu=GpuOptions(p_devices="0", d_devices="0"), extra_config=dict(mode.extra_config),
    )  # fmt: skip
    for extends_ours, runner in ((True, "0"), (False, None)):
        dep = BenchDeployment(cfg, mode.module_path, extends_ours=extends_ours)
        kv = dep._kv(str(mode.connector), "kv_producer", "p")
        assert kv["kv_connector_module_path"] == "devkit.bench.trace_push"
        env = dep._spec("prefill", kv, None).extra_env
        assert env.get("VLLM_USE_V2_MODEL_RUNNER") == runner


def test_bundle_only_pins_build_but_are_no_ci_pins() -> None:
    from vllm_ext import compat

    entry = build.pin_entry("0.26.0")
    assert entry["vllm_package"] == "vllm" and "torch" in entry["skip_requirements"]
    assert "0.26.0" not in compat.load_pins()  # no CI env, no runtime support
    with pytest.raises(BundleError, match="known: .*0.23.0.*0.26.0"):
        build.pin_entry("9.9.9")
