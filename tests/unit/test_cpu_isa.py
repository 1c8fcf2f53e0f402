# SPDX-License-Identifier: Apache-2.0
"""The CPU kernel check: flag parsing, vLLM's library choice, and clear failures."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, envs, pin_python

from devkit import cpu_isa
from devkit.testing.cpu_isa import force_avx2_env

EPYC_AVX2 = frozenset(["fpu", "sse4_2", "avx", "f16c", "avx2", "fma", "bmi2"])
ICELAKE = EPYC_AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
SAPPHIRE = ICELAKE | {"avx512_bf16", "amx_tile", "amx_bf16"}


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 fma avx512f\n\n")
    assert cpu_isa.cpu_flags(info) == {"fpu", "avx2", "fma", "avx512f"}
    assert cpu_isa.cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.parametrize(
    ("flags", "library"),
    [(SAPPHIRE, "_C"), (ICELAKE, "_C_AVX512"), (EPYC_AVX2, "_C_AVX2"), (frozenset(), None)],
)
def test_expected_library_follows_vllms_order(flags: frozenset[str], library: str) -> None:
    assert cpu_isa.expected_library(flags) == library


def test_preflight_refuses_an_x86_cpu_without_avx2_and_names_its_flags() -> None:
    why = cpu_isa.preflight(frozenset(["fpu", "sse4_2", "avx"]), x86=True)
    assert why is not None
    assert "lacks avx2 and fma" in why and "CPU flags:" in why and "no avx2" in why
    assert cpu_isa.preflight(EPYC_AVX2, x86=True) is None
    assert cpu_isa.preflight(frozenset(["fpu"]), x86=False) is None  # not judged
    assert cpu_isa.preflight(frozenset(), x86=True) is None  # flags unknown


def test_env_builder_stops_before_installing_on_a_cpu_without_avx2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    monkeypatch.setattr(cpu_isa, "is_x86_64", lambda: True)
    monkeypatch.setattr(envs.Builder, "build", lambda *a: pytest.fail("started a build"))
    rc = envs._build_locked([next(iter(envs.load_pins()["pins"]))], envs.load_pins())
    assert rc == 3
    err = capsys.readouterr().err
    assert "cannot run here" in err and "lacks avx2 and fma" in err


def test_loaded_libraries_are_read_from_the_process_maps(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    so = "/venv/lib/python3.11/site-packages/vllm/_C_AVX2.abi3.so"
    maps.write_text(
        f"7f00-7f10 r--p 0 08:01 1 {so}\n7f10-7f20 r-xp 0 08:01 1 {so}\n"
        "7f20-7f30 r--p 0 08:01 2 /usr/lib/libc.so.6\n"
        "7f30-7f40 r--p 0 08:01 3 /venv/site-packages/torch/lib/libtorch_cpu.so\n"
    )
    assert cpu_isa.loaded_kernel_libraries(maps) == ["_C_AVX2"]


def _fake_python(tmp_path: Path, body: str) -> str:
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\nimport os, signal, sys\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_a_kernel_library_dying_of_sigill_is_explained(tmp_path: Path) -> None:
    py = _fake_python(
        tmp_path,
        "print('vllm-ext-kernels-loading: _C', flush=True)\nos.kill(os.getpid(), signal.SIGILL)",
    )
    with pytest.raises(cpu_isa.KernelCheckError) as err:
        cpu_isa.run_check(py)
    msg = str(err.value)
    assert "vllm/_C died of SIGILL (illegal instruction)" in msg
    assert "CPU flags:" in msg


def test_a_failing_check_reports_its_output(tmp_path: Path) -> None:
    py = _fake_python(tmp_path, "print('error: rms_norm differs', file=sys.stderr); sys.exit(1)")
    with pytest.raises(cpu_isa.KernelCheckError, match="(?s)exit 1.*rms_norm differs"):
        cpu_isa.run_check(py)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("forced", [False, True], ids=["default", "forced-avx2"])
def test_the_check_runs_vllms_kernels_in_the_pinned_env(forced: bool) -> None:
    """The real check in the primary pin's env: vLLM's own choice, then a real kernel call."""
    py = str(pin_python(next(v for v, p in envs.load_pins()["pins"].items() if p.get("primary"))))
    env = dict(os.environ)
    if forced:
        env.update(force_avx2_env())
    proc = subprocess.run(
        [py, "-m", "devkit.cpu_isa"], capture_output=True, text=True, env=env, cwd=REPO,
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lib = next(ln for ln in proc.stdout.splitlines() if ln.startswith(cpu_isa.RESULT_PREFIX))
    if forced:
        assert '"library": "_C_AVX2"' in lib
    else:
        expected = cpu_isa.expected_library(cpu_isa.cpu_flags())
        assert f'"library": "{expected}"' in lib
