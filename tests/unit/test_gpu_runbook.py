# SPDX-License-Identifier: Apache-2.0
"""tools/gpu/run.sh's own logic, on CPU: the detached benchmark (start, follow, collect,
follow again, stop), leftover cleanup by pid file, and the environment it sets.

A stand-in python answers ``-m devkit.bench.gpu`` with a slow fake run (progress lines,
files), ``-m devkit.bench.{hostcheck,floor,correctness}`` with quick fakes (they need
GPUs), and passes every other call to the real interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_SH = REPO / "tools" / "gpu" / "run.sh"

FAKE_BENCH = textwrap.dedent(
    """\
    import os, sys, time, json
    from pathlib import Path
    args = sys.argv[1:]
    out = Path(args[args.index("--out") + 1])
    print("[bench 0:00] env", os.environ.get("NCCL_NVLS_ENABLE"), os.environ.get("HF_HUB_OFFLINE"),
          os.environ["PYTHONPATH"].split(":")[0], "budget", args[args.index("--budget-s") + 1],
          flush=True)
    print("[bench 0:00] path", os.environ["PYTHONPATH"], flush=True)
    for i in range(int(os.environ.get("FAKE_POINTS", "3"))):
        time.sleep(1.0)
        (out / "results.json").write_text(json.dumps({"points": i + 1}))
        (out / "report.md").write_text(f"report after {i + 1} points\\n")
        print(f"[bench 0:0{i + 1}]   push-0.23 point {i + 1}", flush=True)
    print("[bench-gpu] done", flush=True)
    """
)


FAKE_STEP = textwrap.dedent(
    """\
    import json, sys
    from pathlib import Path
    module, args = sys.argv[1], sys.argv[2:]
    if "--plugin-shim" in args:  # the real project is installed here: no shim needed
        sys.exit(0)
    for flag in ("--out", "--json-out"):
        if flag in args:
            Path(args[args.index(flag) + 1]).write_text(json.dumps({"fake": module}))
    print({"hostcheck": "[check] all ok", "floor": "floor in=2048 fake",
           "correctness": "[correctness 1s] verdict: pass"}[module], flush=True)
    """
)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    fake = tmp_path / "fake_bench.py"
    fake.write_text(FAKE_BENCH)
    step = tmp_path / "fake_step.py"
    step.write_text(FAKE_STEP)
    wrapper = tmp_path / "python3"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = -m ] && [ "$2" = devkit.bench.gpu ] \\\n'
        '    && [[ " $* " != *" --collect "* ]]; then\n'
        f'  shift 2; exec {sys.executable} {fake} "$@"\nfi\n'
        'case "$2" in devkit.bench.hostcheck|devkit.bench.floor|devkit.bench.correctness)\n'
        f'  m="${{2#devkit.bench.}}"; shift 2; exec {sys.executable} {step} "$m" "$@";;\nesac\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    return {
        **os.environ,
        "PYTHON": str(wrapper),
        "OUT": str(tmp_path / "out"),
        "STATE": str(tmp_path / "state"),
        "VLLM_EXT_PYTHONPATH": "/opt/site",
        "BUDGET_S": "77",
    }


def _run(step: str, env: dict[str, str], **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(RUN_SH), step], env={**env, **extra}, capture_output=True, text=True,
        timeout=120, cwd=REPO,
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_bench_detached_follow_collect(env: dict[str, str], tmp_path: Path) -> None:
    env = {**env, "FAKE_POINTS": "10"}
    first = _run("bench", env, WAIT_S="1")
    assert first.returncode == 0, first.stderr
    assert "benchmark started: pid" in first.stdout
    assert "still running" in first.stdout
    # environment of the run: multicast off, offline, this checkout first on the path
    assert f"[bench 0:00] env 0 1 {REPO} budget 77" in first.stdout
    out = tmp_path / "out"
    # a second start while it runs starts nothing
    again = _run("bench", env, WAIT_S="1")
    assert "already running" in again.stdout
    rest = _run("bench-wait", env, WAIT_S="30")
    assert rest.returncode == 0, rest.stderr
    assert "finished (exit 0)" in rest.stdout
    assert "[bench-gpu] done" in rest.stdout
    assert "env 0 1" not in rest.stdout, "bench-wait prints only the new lines"
    assert (out / "report.md").read_text() == "report after 10 points\n"
    assert (out / "results.json").is_file() and (out / "progress.log").is_file()
    assert len(list(out.iterdir())) <= 8


@pytest.mark.timeout(120)
def test_bench_stop_and_status(env: dict[str, str], tmp_path: Path) -> None:
    started = _run("bench", env, WAIT_S="1", FAKE_POINTS="60")
    assert "still running" in started.stdout
    status = _run("status", env)
    assert "benchmark running: pid" in status.stdout
    stopped = _run("bench-stop", env)
    assert stopped.returncode == 0, stopped.stderr
    pid = int((tmp_path / "state" / "bench.pid").read_text())
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert (tmp_path / "out" / "results.json").is_file()


@pytest.mark.timeout(60)
def test_cleanup_stops_leftovers_by_pid_file(env: dict[str, str], tmp_path: Path) -> None:
    pids = tmp_path / "state" / "pids"
    pids.mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    (pids / f"{sleeper.pid}.pid").write_text("prefill\nvllm serve ...\n")
    (pids / "999999.pid").write_text("gone\n")  # a stale file of a process long gone
    status = _run("status", env)
    assert f"{sleeper.pid} prefill" in status.stdout
    res = _run("cleanup", env)
    assert res.returncode == 0
    assert sleeper.wait(10) is not None
    assert "stopping leftover prefill" in res.stdout
    assert not list(pids.iterdir())


@pytest.mark.timeout(120)
def test_all_in_one_command(env: dict[str, str], tmp_path: Path) -> None:
    res = _run("all", env, CMD_LIMIT_S="12", FAKE_POINTS="30")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[check] all ok" in res.stdout and "verdict: pass" in res.stdout
    assert "benchmark started" in res.stdout and "still running" in res.stdout
    out = tmp_path / "out"
    names = sorted(p.name for p in out.iterdir())
    assert names == ["check.json", "correctness.json", "report.md", "results.json", "run.log"]
    log = (out / "run.log").read_text()
    assert "===== check.log" in log and "===== correctness.log" in log
    _run("bench-stop", env)


def test_all_stops_when_the_check_fails(env: dict[str, str], tmp_path: Path) -> None:
    broken = tmp_path / "broken_python"
    broken.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$2" = devkit.bench.hostcheck ]; then echo "[check] NOT READY"; exit 2; fi\n'
        f'exec {env["PYTHON"]} "$@"\n'
    )
    broken.chmod(0o755)
    res = _run("all", env, PYTHON=str(broken))
    assert res.returncode == 1
    assert "the check failed fatally: stopping here" in res.stdout
    assert "benchmark started" not in res.stdout


@pytest.mark.timeout(120)
def test_all_goes_on_after_a_check_that_is_not_fatal(env: dict[str, str], tmp_path: Path) -> None:
    partial = tmp_path / "partial_python"
    partial.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$2" = devkit.bench.hostcheck ]; then echo "[check] NOT READY"; exit 1; fi\n'
        f'exec {env["PYTHON"]} "$@"\n'
    )
    partial.chmod(0o755)
    res = _run("all", env, PYTHON=str(partial), CMD_LIMIT_S="8", FAKE_POINTS="30")
    assert "going on: some modes may fail" in res.stdout
    assert "verdict: pass" in res.stdout and "benchmark started" in res.stdout
    _run("bench-stop", env)


def test_help_lists_the_steps(env: dict[str, str]) -> None:
    res = _run("help", env)
    assert res.returncode == 2
    for step in ("all", "check", "correctness", "floor", "bench", "bench-wait", "bench-stop"):
        assert f"run.sh {step}" in res.stdout
    # the whole comment block, every variable, and none of the script
    assert "push-0.34" in res.stdout and "CORRECTNESS_ARGS" in res.stdout
    assert "set -uo" not in res.stdout


def test_plugin_entry_point_shim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata as md

    from devkit.bench import hostcheck

    # installed (editable, in this env): nothing to do
    assert hostcheck.ensure_entry_point(tmp_path / "a") is None
    assert not (tmp_path / "a").exists()
    # not installed: a minimal dist-info declares it, found once the folder is on the path
    monkeypatch.setattr(md, "entry_points", lambda group=None: [])
    folder = hostcheck.ensure_entry_point(tmp_path / "b")
    assert folder == tmp_path / "b"
    dists = list(md.distributions(path=[str(folder)]))
    eps = [e for d in dists for e in d.entry_points if e.group == "vllm.general_plugins"]
    assert [(e.name, e.value) for e in eps] == [("vllm_ext", "vllm_ext:register")]


FAKE_INSTALL = textwrap.dedent(
    """\
    import sys
    from pathlib import Path
    args = sys.argv[1:]
    assert args[0] == "install" and "--no-compile" in args, args
    parts, target = Path(args[args.index("--parts") + 1]), Path(args[args.index("--target") + 1])
    assert (parts / "install.py").is_file()
    target.mkdir(parents=True)
    (target / "bundle-env.sh").write_text(
        f"export PYTHONPATH={target}:{target}/extra${{PYTHONPATH:+:$PYTHONPATH}}\\n"
    )
    print("done: 3 wheels", flush=True)
    """
)


@pytest.mark.timeout(120)
def test_install_step_puts_the_bundle_on_the_path_of_later_steps(
    env: dict[str, str], tmp_path: Path
) -> None:
    bundle = tmp_path / "stage"
    bundle.mkdir()
    (bundle / "install.py").write_text(FAKE_INSTALL)
    env = {k: v for k, v in env.items() if k != "VLLM_EXT_PYTHONPATH"}
    env["PYTHONPATH"] = "/outer"
    res = subprocess.run(
        ["bash", str(RUN_SH), "install", str(bundle)], env=env, capture_output=True,
        text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    site = tmp_path / "state" / "site"
    assert "done: 3 wheels" in res.stdout and (tmp_path / "out" / "install.log").is_file()
    bench = _run("bench", {**env, "FAKE_POINTS": "1"}, WAIT_S="30")
    # this checkout, then the install (with its extra folder), then the caller's path
    assert f"[bench 0:00] path {REPO}:{site}:{site}/extra:/outer" in bench.stdout, bench.stdout
    # no bundle folder: usage, nothing installed
    bad = subprocess.run(
        ["bash", str(RUN_SH), "install", str(tmp_path / "none")], env=env, capture_output=True,
        text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert bad.returncode == 2 and "usage" in bad.stdout
