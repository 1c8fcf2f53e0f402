#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The benchmark command: build the pinned envs it needs, then run the sweep.

    python3 tools/bench.py                  # the default sweep (docs/benchmarks.md)
    python3 tools/bench.py --help           # options of python -m devkit.bench

Builds (or checks, a second when up to date) every pinned env with tools/envs.py,
installs the ``bench`` extra (matplotlib) into the primary env if it is missing, and
runs ``python -m devkit.bench`` there; modes on another pin start their engines
with that pin's python (``--python PIN=PATH`` is passed for every pin).
"""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _envs(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "tools" / "envs.py"), *args]
    return subprocess.run(cmd, capture_output=capture, text=True, check=False)


def main() -> int:
    argv = sys.argv[1:]
    if any(a in ("-h", "--help", "--report") for a in argv):
        pins: list[str] = []
    else:
        rc = _envs("build").returncode  # every pin: the default modes span both
        if rc:
            return rc
        listed = _envs("list", capture=True).stdout
        pins = [ln.split()[0] for ln in listed.splitlines() if ln.strip()]
    py = _envs("python", capture=True).stdout.strip()
    probe = subprocess.run([py, "-c", "import matplotlib"], capture_output=True)
    if probe.returncode:
        print("[bench] installing the bench extra (matplotlib) into the primary env", flush=True)
        rc = subprocess.call([py, "-m", "pip", "install", "--quiet", "-e", f"{REPO}/devkit[bench]"])
        if rc:
            return rc
    for pin in pins:
        path = _envs("python", pin, capture=True).stdout.strip()
        argv = ["--python", f"{pin}={path}", *argv]
    os.chdir(REPO)
    os.execv(py, [py, "-m", "devkit.bench", *argv])
    return 0


if __name__ == "__main__":
    sys.exit(main())
