# SPDX-License-Identifier: Apache-2.0
"""The runner's time budget and priority order, and the GPU command's plan, without engines.

A fake clock drives the runner: engine starts and points take simulated seconds, so the
budget logic (shares per deployment, skipped points, a save after every point, stopping
in time) is checked exactly and in milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from devkit.bench import gpu as G
from devkit.bench import runner as R
from devkit.bench.workload import Point, sweep


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s

    def time(self) -> float:
        return self.now

    perf_counter = monotonic


class FakeDeployment:
    """Stands for BenchDeployment: 'starts' in ``startup`` simulated seconds."""

    startup = 100.0
    started: list[str] = []

    def __init__(self, cfg: Any, module_path: Any = None, proxy_module: Any = None,
                 progress: Any = None, vllm_connector: bool = False,
                 extends_ours: bool = False) -> None:  # fmt: skip
        self.cfg, self.prefill, self.decode, self.proxy = cfg, None, None, None
        self.startup_s = self.startup
        self.url = "http://fake"

    def __enter__(self) -> FakeDeployment:
        CLOCK.sleep(self.startup)
        FakeDeployment.started.append(self.cfg.run_dir.name)
        return self

    def __exit__(self, *a: object) -> None:
        CLOCK.sleep(5)


CLOCK = FakeClock()
#: simulated seconds per point (by input length and rate)
DURATION = {(2048, 8.0): 10.0, (8192, 8.0): 20.0, (2048, 0.5): 60.0, (8192, 0.5): 60.0}


async def fake_run_point(base_url: str, tok: str, point: Point, *a: Any) -> dict[str, Any]:
    CLOCK.sleep(DURATION[(point.input_len, point.rate)])
    n = point.num_requests
    return {
        "ttfts": [0.1] * n, "itls": [[0.01] * (point.output_len - 1)] * n,
        "start_times": [float(i) for i in range(n)], "input_lens": [point.input_len] * n,
        "output_lens": [point.output_len] * n, "errors": [""] * n,
    }  # fmt: skip


@pytest.fixture
def fake_run(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patches engines, load generator, scrapes and time; returns the save count."""
    global CLOCK
    CLOCK = FakeClock()
    FakeDeployment.started = []
    monkeypatch.setattr(R, "time", CLOCK)
    monkeypatch.setattr(R, "BenchDeployment", FakeDeployment)
    monkeypatch.setattr(R, "complete", lambda *a, **k: None)
    monkeypatch.setattr(R.client, "run_point", fake_run_point)
    monkeypatch.setattr(R.probes, "scrape", lambda url: {})
    monkeypatch.setattr(R, "pin_versions", lambda py: {})
    for name in ("vllm", "vllm.benchmarks", "vllm.benchmarks.serve"):  # no 10 s import
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    saves: list[int] = []
    real_write = R.report.write

    def counting_write(results: dict[str, Any], out_dir: Path, plots: bool = True,
                       small: bool = False) -> Any:  # fmt: skip
        saves.append(len(results.get("points", [])))
        return real_write(results, out_dir, plots=False, small=small)

    monkeypatch.setattr(R.report, "write", counting_write)
    return saves


def _cfg(tmp_path: Path, budget: float | None, order: list[str]) -> R.RunConfig:
    return R.RunConfig(
        modes=["push-0.23", "pull-0.23", "single-0.23"], input_lens=[2048, 8192],
        concurrencies=[], rates=[0.5, 8.0], num_requests=4, output_len=8, rounds=1, seed=0,
        warmup=0, idle_seconds=0, floor_repeats=0, pythons={"0.23.0": sys.executable},
        out_dir=tmp_path / "run", model="/m", budget_s=budget, point_order=order,
        small_json=True, est_startup_s=100.0, est_request_s=1.0,
    )  # fmt: skip


def test_prioritized_points() -> None:
    pts = sweep([2048, 8192], [], [0.5, 8.0], 4, 8)
    out = R.prioritized(pts, ["in8192-r8", "in2048-rate=8/s"])
    assert [p.slug for p in out] == ["in8192-r8", "in2048-r8", "in2048-r0.5", "in8192-r0.5"]
    with pytest.raises(ValueError, match="unknown point"):
        R.prioritized(pts, ["in4096-r8"])


def test_no_budget_runs_everything(tmp_path: Path, fake_run: list[int]) -> None:
    res = R.Runner(_cfg(tmp_path, None, [])).run()
    assert len(res["points"]) == 3 * 4 and res["skipped"] == []
    assert len(FakeDeployment.started) == 3


def test_budget_shares_skips_and_saves(tmp_path: Path, fake_run: list[int]) -> None:
    # 3 modes; each start 100 s; points 10 + 20 s (rate 8) and 60 + 60 s (0.5/s)
    cfg = _cfg(tmp_path, 700.0, ["in8192-r8", "in2048-r8"])
    t0 = CLOCK.now
    res = R.Runner(cfg).run()
    assert CLOCK.now - t0 <= 700.0, "the run ends within its budget"
    assert len(FakeDeployment.started) == 3, "every mode gets its share"
    done = {(p["mode"], p["point"]) for p in res["points"]}
    for mode in cfg.modes:  # the priority points ran in every mode
        assert (mode, "in8192-rate=8/s") in done and (mode, "in2048-rate=8/s") in done
    # per mode: (700 - 30 reserve) / 3 = 223 s: 100 start + 30 + one 60 s point, not two
    assert res["skipped"], "some 0.5/s points cannot fit"
    assert all(s["why"].startswith("budget") for s in res["skipped"])
    assert len(res["points"]) + len(res["skipped"]) == 3 * 4
    order = [p["point"] for p in res["points"] if p["mode"] == "push-0.23"]
    assert order[:2] == ["in8192-rate=8/s", "in2048-rate=8/s"]
    # saved after every point (and after each deployment)
    assert sorted(set(fake_run)) == list(range(1, len(res["points"]) + 1))
    saved = json.loads((cfg.out_dir / "results.json").read_text())
    assert len(saved["points"]) == len(res["points"])
    assert "\n" not in (cfg.out_dir / "results.json").read_text()[:1000]  # small JSON


def test_budget_too_small_for_a_start_skips_the_deployment(
    tmp_path: Path, fake_run: list[int]
) -> None:
    cfg = _cfg(tmp_path, 300.0, [])
    res = R.Runner(cfg).run()
    # 270 s: the first mode (share 90 s) cannot fit a start + its shortest point... but the
    # share only bounds points; a start needs 100 s + the shortest point (10 s est. 9 s)
    assert res["budget_stop"].startswith("budget:")
    assert len(FakeDeployment.started) < 3
    assert {s["mode"] for s in res["skipped"]} >= {"single-0.23"}


def test_point_timeout_never_passes_the_budget(tmp_path: Path, fake_run: list[int]) -> None:
    runner = R.Runner(_cfg(tmp_path, 600.0, []))
    p = runner.points[0]
    assert runner._point_timeout(p) == pytest.approx(R.POINT_TIMEOUT_MIN_S)
    CLOCK.now += 560.0
    assert runner._point_timeout(p) == pytest.approx(600 - 560 - R.BUDGET_RESERVE_S / 2)
    assert R.Runner(_cfg(tmp_path, None, []))._point_timeout(p) is None


def test_gpu_options_start_timeout_fits_the_budget(tmp_path: Path, fake_run: list[int]) -> None:
    from devkit.launch.gpu import GpuOptions

    cfg = _cfg(tmp_path, 400.0, [])
    cfg.gpu = GpuOptions()
    runner = R.Runner(cfg)
    gpu = runner._gpu_options()
    assert gpu is not None and gpu.start_timeout_s == pytest.approx(400 - R.BUDGET_RESERVE_S)


# -- the GPU command ------------------------------------------------------------------------


def _gpu_cfg(tmp_path: Path, *extra: str) -> Any:
    args = G.build_parser().parse_args(["--out", str(tmp_path / "bench"), *extra])
    return G.make_config(args, "test")


def test_gpu_command_defaults(tmp_path: Path) -> None:
    cfg = _gpu_cfg(tmp_path, "--budget-s", "780")
    assert cfg.device == "cuda" and cfg.modes == ["push-0.23", "pull-0.23", "single-0.23"]
    assert cfg.input_lens == [2048, 8192, 16384] and cfg.rates == [0.5, 2.0, 8.0]
    assert cfg.concurrencies == [] and cfg.num_requests == 24 and cfg.output_len == 64
    assert cfg.max_model_len == 20000 and cfg.rounds == 1 and cfg.small_json
    assert cfg.budget_s == 780 and cfg.idle_seconds == 0
    keys = [p.key for p in cfg.points()]
    assert keys[0] == "in8192-rate=8/s" and keys[-1] == "in2048-rate=0.5/s"
    assert len(keys) == 9
    assert cfg.gpu.load_format == "dummy" and not cfg.gpu.enforce_eager
    assert (cfg.gpu.p_devices, cfg.gpu.d_devices, cfg.gpu.single_devices) == ("0", "1", "0")
    assert cfg.floor_device.device == "cuda" and cfg.floor_device.input_lens == cfg.input_lens
    cfgjson = json.loads((Path(cfg.model) / "config.json").read_text())
    assert cfgjson["architectures"] == ["Qwen3ForCausalLM"]


def test_gpu_dry_run_engines(tmp_path: Path) -> None:
    plan = G.dry_run(_gpu_cfg(tmp_path))
    assert plan["points"][0] == "in8192-rate=8/s"
    assert set(plan["engines"]) == {"push-0.23", "pull-0.23", "single-0.23"}
    push, pull, single = (plan["engines"][m] for m in ("push-0.23", "pull-0.23", "single-0.23"))
    assert set(push) == {"prefill", "decode"} and set(single) == {"single"}
    for eng, devices in ((push["prefill"], "0"), (push["decode"], "1"), (pull["decode"], "1"),
                         (single["single"], "0")):  # fmt: skip
        argv, env = eng["argv"], eng["env"]
        assert env["CUDA_VISIBLE_DEVICES"] == devices
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
        assert not [k for k in env if k.startswith("VLLM_CPU_")]
        assert argv[argv.index("--max-model-len") + 1] == "20000"
        assert argv[argv.index("--load-format") + 1] == "dummy"
        assert "--no-enable-prefix-caching" in argv and "--enforce-eager" not in argv
    kv = json.loads(
        push["decode"]["argv"][push["decode"]["argv"].index("--kv-transfer-config") + 1]
    )
    assert kv["kv_connector"] == "ExtNixlPushConnector" and kv["kv_buffer_device"] == "cuda"
    kv = json.loads(
        pull["prefill"]["argv"][pull["prefill"]["argv"].index("--kv-transfer-config") + 1]
    )
    assert kv["kv_connector"] == "NixlConnector" and kv["kv_role"] == "kv_producer"
    assert plan["floor_cases"][0] == "in2048-cross-layer-contiguous"
    assert plan["floor_env"]["target"]["CUDA_VISIBLE_DEVICES"] == "1"


def test_gpu_command_rejects_other_pins(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="need vLLM"):
        _gpu_cfg(tmp_path, "--modes", "push-0.23", "vllm-push-0.32")


def test_collect_copies_at_most_eight_small_files(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs" / "01-push-0.23").mkdir(parents=True)
    for name in ("results.json", "report.md", "ttft.png", "progress.log", "other.bin"):
        (run / name).write_text("x\n" * 1000)
    (run / "logs" / "01-push-0.23" / "prefill.log").write_text(
        "".join(f"l{i}\n" for i in range(500))
    )
    out = G.collect(run, tmp_path / "out")
    names = sorted(p.name for p in out)
    assert names == ["logs-tail.txt", "progress.log", "report.md", "results.json", "ttft.png"]
    assert len(names) <= 8
    tail = (tmp_path / "out" / "logs-tail.txt").read_text()
    assert "l499" in tail and "l100\n" not in tail
    with contextlib.suppress(FileNotFoundError):
        assert (tmp_path / "out" / "other.bin").stat().st_size == 0


def test_an_engine_that_dies_is_not_restarted_under_a_budget(
    tmp_path: Path, fake_run: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from devkit.launch.process import ProcessDied

    class DyingDeployment(FakeDeployment):
        def __enter__(self) -> FakeDeployment:
            CLOCK.sleep(30)
            FakeDeployment.started.append(self.cfg.run_dir.name)
            if "push" in self.cfg.run_dir.name:
                raise ProcessDied("prefill exited with 1 before ... was ready")
            return self

    monkeypatch.setattr(R, "BenchDeployment", DyingDeployment)
    res = R.Runner(_cfg(tmp_path, 900.0, [])).run()
    assert [n for n in FakeDeployment.started if "push" in n] == ["01-push-0.23"]
    push = next(d for d in res["deployments"] if d["mode"] == "push-0.23")
    assert push["error"].startswith("ProcessDied")
    assert {p["mode"] for p in res["points"]} == {"pull-0.23", "single-0.23"}
    # without a budget the start is retried once, as before
    FakeDeployment.started = []
    R.Runner(_cfg(tmp_path / "again", None, [])).run()
    assert [n for n in FakeDeployment.started if "push" in n] == [
        "01-push-0.23",
        "01-push-0.23-retry",
    ]


def test_gpu_runs_wait_for_the_gpus_to_be_free(
    tmp_path: Path, fake_run: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    readings = iter([[70000, 60000], [9000, 100], [500, 400]] + [[0, 0]] * 100)
    monkeypatch.setattr(R, "gpu_memory_used_mib", lambda: next(readings))
    cfg = _cfg(tmp_path, None, [])
    cfg.device, cfg.modes = "cuda", ["push-0.23"]
    t0 = CLOCK.now
    R.Runner(cfg).run()
    # 2 s of polling (2 readings above 2 GiB) after the deployment's 5 s stop
    assert CLOCK.now - t0 >= 100 + 5 + 2
    assert next(readings) == [0, 0]
