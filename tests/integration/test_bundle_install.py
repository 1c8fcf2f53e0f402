# SPDX-License-Identifier: Apache-2.0
"""The offline installer on small synthetic wheels: no index, overlapping wheels, .pth dirs.

Two wheels write the same paths with different contents (like nvidia-cutlass-dsl's
libs-base and libs-cu13), the later one depends on the earlier one, and both ship a
``.pth`` file naming a folder inside the package.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from bundle_support import make_bundle, make_wheel

PTH = b"shared_pkg/python_packages\n"


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    wheels = tmp_path / "wheels"
    base = make_wheel(
        wheels,
        "shared-base",
        "1.0",
        {
            "shared_pkg/python_packages/shared_mod.py": b"WHO = 'base'\n",
            "shared_pkg/python_packages/base_only.py": b"X = 1\n",
            "shared_pkg.pth": PTH,
        },
    )
    cu13 = make_wheel(
        wheels,
        "shared-cu13",
        "1.0",
        {
            "shared_pkg/python_packages/shared_mod.py": b"WHO = 'cu13'\n",
            "shared_pkg/python_packages/cu13_only.py": b"Y = 2\n",
            "shared_pkg.pth": PTH,
        },
        requires=["shared-base==1.0"],
    )
    plain = make_wheel(wheels, "plain", "3.0", {"plain.py": b"Z = 3\n"})
    out = tmp_path / "bundle"
    python = "{}.{}".format(*sys.version_info[:2])
    index = make_bundle(out, [base, plain, cu13], part_size=2048, python=python)
    assert len(index["parts"]) >= 2
    return out


def _install(bundle: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIP_NO_INDEX": "1"}
    return subprocess.run(
        [sys.executable, str(bundle / "install.py"), "install", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


CHECK = (
    "import shared_mod, base_only, cu13_only, plain; "
    "print(shared_mod.WHO, base_only.X, cu13_only.Y, plain.Z)"
)


@pytest.mark.timeout(300)
def test_install_into_a_target_dir(bundle: Path, tmp_path: Path) -> None:
    dest = tmp_path / "site"
    proc = _install(bundle, "--target", str(dest), "--no-compile")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pip run 2/2: 1 wheels" in proc.stdout
    assert "patches not applied: the bundle has no vllm" in proc.stdout
    # later group wins where both write; what only the first writes is kept
    py_packages = dest / "shared_pkg" / "python_packages"
    assert (py_packages / "shared_mod.py").read_text() == "WHO = 'cu13'\n"
    assert (py_packages / "base_only.py").is_file() and (py_packages / "cu13_only.py").is_file()
    line = (
        f"export PYTHONPATH={dest.absolute()}:{py_packages.resolve()}${{PYTHONPATH:+:$PYTHONPATH}}"
    )
    assert line in proc.stdout
    assert line in (dest / "bundle-env.sh").read_text()
    run = subprocess.run(
        ["bash", "-c", f'source {dest / "bundle-env.sh"} && {sys.executable} -c "{CHECK}"'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.stdout.split() == ["cu13", "1", "2", "3"], run.stderr


@pytest.mark.timeout(300)
def test_install_into_a_venv_that_sees_this_venv(bundle: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    proc = _install(bundle, "--venv", str(venv), "--python", sys.executable)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "done: 3 wheels" in proc.stdout and "in 2 pip runs" in proc.stdout
    # the bundle's packages, and (through the .pth) what the venv of --python has
    run = subprocess.run(
        [str(venv / "bin" / "python"), "-c", f"{CHECK}; import pytest; print(pytest.__file__)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = run.stdout.split()
    assert out[:4] == ["cu13", "1", "2", "3"], run.stderr
    if sys.prefix != sys.base_prefix:
        assert out[4].startswith(sys.prefix)
    # a second run over the same venv is fine
    proc = _install(bundle, "--venv", str(venv), "--python", sys.executable, "--no-compile")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "using the existing venv" in proc.stdout


def test_wrong_python_is_refused_before_anything_is_written(bundle: Path, tmp_path: Path) -> None:
    index = next(bundle.glob("*.index.json"))
    text = index.read_text().replace('"python": "3.', '"python": "2.')
    index.write_text(text)
    proc = _install(bundle, "--target", str(tmp_path / "site"))
    assert proc.returncode == 1
    assert "this bundle is for Python 2." in proc.stderr
    assert not (tmp_path / "site").exists()
