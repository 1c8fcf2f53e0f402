# SPDX-License-Identifier: Apache-2.0
"""The README's install lines work: its build command, run as written in a copy of the
tracked tree, makes the wheel its install command names; installed into a clean venv,
the wheel's entry points run from there, and its proxy serves.

The default test installs the wheel without its dependencies and then only the proxy's
(as the wheel declares them): 57 s here. NIXL's wheels pull torch and CUDA libraries
(105 s and 6 GB into a clean venv here, with a warm pip cache): the slow test runs the
README's install command as written, dependencies and all.
"""

from __future__ import annotations

import contextlib
import email
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
#: what ``import vllm_ext.proxy`` and its CLI need, by distribution name
PROXY_DEPS = ("aiohttp", "prometheus_client", "dnspython", "python-json-logger")


def _readme_install() -> tuple[list[str], list[str]]:
    """The README's build and install commands (its block with ``pip wheel``)."""
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    (block,) = [b for b in blocks if "pip wheel" in b]
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    (build,) = [c for c in commands if c[:4] == ["python", "-m", "pip", "wheel"]]
    (install,) = [c for c in commands if c[:2] == ["pip", "install"]]
    return build, install


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd}: {out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


def _tracked_copy(dest: Path) -> Path:
    """The tracked files of this checkout as they are now (symlinks kept)."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
    ).stdout
    dest.mkdir()
    pack = subprocess.run(
        ["tar", "--null", "-T", "-", "-cf", "-"],
        input=files,
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    subprocess.run(["tar", "-xf", "-", "-C", str(dest)], input=pack, check=True, timeout=60)
    return dest


def _build(tmp_path: Path) -> tuple[Path, list[str]]:
    """Run the README's build command as written (``python``: this interpreter);
    returns the wheel its install command names, and that command."""
    build, install = _readme_install()
    assert build == ["python", "-m", "pip", "wheel", "--no-deps", "-w", "dist", "."]
    src = _tracked_copy(tmp_path / "src")
    _run([sys.executable, *build[1:]], src, timeout=240)
    (named,) = [arg for arg in install[2:] if arg.endswith(".whl")]
    wheel = src / named
    built = sorted(p.name for p in (src / "dist").iterdir())
    assert wheel.is_file(), f"the README installs {named}; the build made {built}"
    return wheel, install


def _venv(path: Path) -> Path:
    _run([sys.executable, "-m", "venv", str(path)], path.parent, timeout=120)
    return path / "bin"


def _requires(wheel: Path) -> dict[str, str]:
    """The wheel's Requires-Dist: distribution name -> requirement."""
    with zipfile.ZipFile(wheel) as whl:
        (meta,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        message = email.message_from_bytes(whl.read(meta))
    out = {}
    for req in message.get_all("Requires-Dist") or ():
        if "extra ==" in req:
            continue
        name = re.match(r"[A-Za-z0-9_.-]+", req)
        assert name is not None
        out[name.group(0).lower().replace("_", "-")] = req
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _proxy(bin_dir: Path, cwd: Path) -> Iterator[str]:
    """The venv's ``vllm-ext-proxy`` in front of two ports nothing listens on."""
    port, p_port, d_port = _free_port(), _free_port(), _free_port()
    cmd = [str(bin_dir / "vllm-ext-proxy"), "--mode", "pull", "--port", str(port)]
    cmd += ["--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}"]
    cmd += ["--log-format", "json"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(url + "/health", timeout=5) as resp,
            ):
                if resp.status == 200:
                    break
            assert time.monotonic() < deadline, "the proxy never answered /health"
            time.sleep(0.1)
        yield url
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _check_installed(bin_dir: Path, cwd: Path) -> None:
    """The entry points run from the venv, on the venv's own copy, and the proxy serves."""
    where = _run(
        [
            str(bin_dir / "python"),
            "-c",
            "import vllm_ext.proxy, vllm_ext; print(vllm_ext.__file__)",
        ],
        cwd,
        timeout=60,
    ).stdout
    assert where.startswith(str(bin_dir.parent)), where  # not this checkout
    help_text = _run([str(bin_dir / "vllm-ext-proxy"), "--help"], cwd, timeout=60).stdout
    assert "--log-format" in help_text and "--prefill" in help_text
    assert "apply" in _run([str(bin_dir / "vllm-ext-patches"), "--help"], cwd, timeout=60).stdout
    with _proxy(bin_dir, cwd) as url, urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert "vllm_ext_proxy_engine_up" in metrics


@pytest.mark.timeout(420)
def test_the_readme_wheel_installs_and_its_proxy_runs_from_a_clean_venv(tmp_path: Path) -> None:
    wheel, install = _build(tmp_path)
    bin_dir = _venv(tmp_path / "venv")
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    # the README's install, less the dependencies, then the proxy's as the wheel says
    assert install == ["pip", "install", str(wheel.relative_to(tmp_path / "src"))]
    _run([*pip, "--no-deps", str(wheel)], tmp_path, timeout=120)
    requires = _requires(wheel)
    missing = [d for d in PROXY_DEPS if d.lower().replace("_", "-") not in requires]
    assert not missing, f"the wheel does not declare {missing}"
    _run([*pip, *(requires[d.lower().replace("_", "-")] for d in PROXY_DEPS)], tmp_path, 300)
    _check_installed(bin_dir, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_readme_install_command_as_written_with_its_dependencies(tmp_path: Path) -> None:
    """NIXL, torch and CUDA libraries: 6 GB. The install took 105 s here with a warm pip
    cache; the whole test 4 min 24 s with other sessions' tests on the same two cores."""
    wheel, install = _build(tmp_path)
    bin_dir = _venv(tmp_path / "venv")
    _run([str(bin_dir / "python"), "-m", *install], tmp_path / "src", timeout=800)
    _check_installed(bin_dir, tmp_path)
