#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The README's main command: set up the primary pin's env, then run the 1P1D push demo.

python3 tools/demo.py [--mode push|pull|single] [--max-tokens N] [--run-dir DIR]
"""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    if {"-h", "--help"} & set(sys.argv[1:]):
        # the options only: the demo's module needs nothing outside the standard library
        # to say them, so nothing is built
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        return subprocess.call([sys.executable, "-m", "devkit.demo", "--help"], env=env)
    envs = [sys.executable, str(REPO / "tools" / "envs.py")]
    primary = subprocess.run([*envs, "python"], capture_output=True, text=True, check=True)
    py = primary.stdout.strip()
    version = Path(py).parent.parent.name.removeprefix("vllm-")
    rc = subprocess.call([*envs, "build", "--pin", version])
    if rc:
        return rc
    os.execv(py, [py, "-m", "devkit.demo", *sys.argv[1:]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
