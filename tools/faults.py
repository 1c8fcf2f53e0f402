#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The fault table in one command: build the pinned envs it needs, then run it.

    python3 tools/faults.py                       # ours and vLLM 0.32's push, side by side
    python3 tools/faults.py --stack ours          # ours only (e.g. after a connector change)
    python3 tools/faults.py --faults kill-p-before-write,link-cut-long --soak 1000
    python3 tools/faults.py --help                # options of python -m devkit.testing.faults

Writes ``results.json`` and ``faults.md`` under ``--out`` (default
``runs/faults-<date>``). Network namespaces (root) are used where the host has them;
the link faults are skipped, with the reason, where it has not. docs/faults.md has
the table and how to read it.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: stack name -> the pin its engines run on (devkit.testing.faults.pair.STACKS)
STACK_PINS = {"ours": "0.23.0", "vllm-push-0.32": "0.32.0"}


def _envs(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "tools" / "envs.py"), *args]
    return subprocess.run(cmd, capture_output=capture, text=True, check=False)


def main() -> int:
    argv = sys.argv[1:]
    if any(a in ("-h", "--help") for a in argv):
        py = _envs("python", capture=True).stdout.strip() or sys.executable
        os.execv(py, [py, "-m", "devkit.testing.faults", "--help"])
    stacks = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--stack"]
    if not stacks:
        stacks = list(STACK_PINS)
        argv = [x for s in stacks for x in ("--stack", s)] + argv
    if "--out" not in argv:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
        argv += ["--out", str(REPO / "runs" / f"faults-{stamp}")]
    for pin in sorted({STACK_PINS[s] for s in stacks if s in STACK_PINS}):
        rc = _envs("build", "--pin", pin).returncode
        if rc:
            return rc
        path = _envs("python", pin, capture=True).stdout.strip()
        argv = ["--python", f"{pin}={path}", *argv]
    py = _envs("python", capture=True).stdout.strip()
    os.chdir(REPO)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    os.execve(py, [py, "-m", "devkit.testing.faults", *argv], env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
