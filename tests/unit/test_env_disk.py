# SPDX-License-Identifier: Apache-2.0
"""The envs' disk: a build that cannot fit is refused before it starts (and a disk that fills
up anyway is named), and the built envs share identical files as hard links without one
env's later install changing another's files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, envs

from devkit import shared_files

SITE = "lib/python3.11/site-packages"
BIG = shared_files.MIN_SHARED_BYTES


def _env(root: Path, name: str, files: dict[str, bytes], mode: int = 0o644) -> Path:
    env = root / name
    for rel, data in files.items():
        p = env / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        p.chmod(mode)
    return env


def _ino(p: Path) -> int:
    return p.stat().st_ino


def test_identical_files_are_shared_and_stay_apart_on_a_later_install(tmp_path: Path) -> None:
    lib = f"{SITE}/torch/lib/libtorch_cpu.so"
    same, other = os.urandom(BIG * 3), os.urandom(BIG * 3)
    a = _env(tmp_path, "a", {lib: same, f"{SITE}/x/diff.bin": b"a" * BIG})
    b = _env(tmp_path, "b", {lib: same, f"{SITE}/x/diff.bin": b"b" * BIG})
    c = _env(tmp_path, "c", {lib: other})

    done = shared_files.share([a, b, c])

    assert done == shared_files.Shared(files=1, bytes=len(same))
    assert _ino(a / lib) == _ino(b / lib) != _ino(c / lib)
    assert (b / lib).read_bytes() == same and (c / lib).read_bytes() == other
    assert _ino(a / f"{SITE}/x/diff.bin") != _ino(b / f"{SITE}/x/diff.bin")
    assert not list(tmp_path.rglob("*.vllm-ext-share"))
    # pip replaces a file by unlinking it: the other env keeps its bytes
    (b / lib).unlink()
    (b / lib).write_bytes(other)
    assert (a / lib).read_bytes() == same
    # b now holds c's bytes: the next pass shares those, the one after finds nothing new
    assert shared_files.share([a, b, c]).files == 1
    assert _ino(b / lib) == _ino(c / lib) != _ino(a / lib)
    assert shared_files.share([a, b, c]).files == 0


def test_the_vllm_package_and_files_of_another_mode_are_never_shared(tmp_path: Path) -> None:
    patched = f"{SITE}/vllm/distributed/kv_transfer/nixl.py"
    script = f"{SITE}/tool/run.bin"
    data = os.urandom(BIG * 2)
    a = _env(tmp_path, "a", {patched: data, script: data})
    b = _env(tmp_path, "b", {patched: data})
    _env(tmp_path, "b", {script: data}, mode=0o755)

    assert shared_files.share([a, b]).files == 0
    assert _ino(a / patched) != _ino(b / patched)
    # the patch tool edits vLLM in place: the other env must not see it
    with (a / patched).open("r+b") as f:
        f.write(b"patched")
    assert (b / patched).read_bytes() == data


def test_the_command_line_refuses_fewer_than_two_envs(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "devkit.shared_files", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "usage" in res.stderr


def _pins_with_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setenv("VLLM_EXT_VENV_ROOT", str(tmp_path))
    return envs.load_pins()


def test_a_build_that_cannot_fit_is_refused_naming_sizes_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pins = _pins_with_root(tmp_path, monkeypatch)
    versions = list(pins["pins"])
    monkeypatch.setattr(envs, "_free_gib", lambda _p: 3.0)

    why = envs._disk_shortfall(versions, pins, "dev")

    need = sum(p["env_gib"] + envs.BUILD_SCRATCH_GIB for p in pins["pins"].values())
    assert why is not None
    assert f"needs about {need:.1f} GiB" in why and "3.0 GiB is free" in why
    assert all(v in why for v in versions) and "--pin" in why
    monkeypatch.setattr(envs, "_free_gib", lambda _p: need + 0.1)
    assert envs._disk_shortfall(versions, pins, "dev") is None


def test_an_env_on_its_base_costs_no_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pins = _pins_with_root(tmp_path, monkeypatch)
    v = next(iter(pins["pins"]))
    env = envs.venv_dir(v, pins)
    env.mkdir(parents=True)
    stamp = envs._stamp(v, pins["pins"][v], pins, "dev")
    (env / envs.STAMP_NAME).write_text(json.dumps({**stamp, "project": "older"}))
    monkeypatch.setattr(envs, "_free_gib", lambda _p: 0.0)
    assert envs._disk_shortfall([v], pins, "dev") is None


def test_every_pin_states_its_env_size_and_the_size_rebuilds_nothing() -> None:
    pins = envs.load_pins()
    for v, pin in pins["pins"].items():
        assert float(pin["env_gib"]) > 0, v
        assert envs._stamp(v, {**pin, "env_gib": 99}, pins) == envs._stamp(v, pin, pins), v


def test_a_full_disk_during_a_build_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pins = _pins_with_root(tmp_path, monkeypatch)
    v = next(iter(pins["pins"]))
    b = envs.Builder(v, pins["pins"][v], pins, verbose=False)
    b.env.parent.mkdir(parents=True, exist_ok=True)
    say = "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device"
    with pytest.raises(envs.BuildError) as err:
        b.run(sys.executable, "-c", f"print({say!r}); raise SystemExit(1)", what="installing x")
    assert "the disk filled up" in str(err.value) and "GiB free now" in str(err.value)
    assert "VLLM_EXT_VENV_ROOT" in str(err.value)
