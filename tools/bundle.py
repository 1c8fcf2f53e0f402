#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Offline install bundles for air-gapped hosts (thin wrapper; the code is ``devkit.bundle``).

    python3 tools/bundle.py build --pin 0.23.0 --flavor cuda -o DIR \\
        --target-file tools/targets/h200-cuda13-py312.toml --no-project --part-size 56MiB
    python3 DIR/install.py install --venv VENV        # on the target: Python + pip only

Runs with any Python >= 3.11 from the repository (no install needed); it installs
the pinned uv into ~/.cache/vllm-ext on first use. docs/offline-install.md has more.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO))
    from devkit.bundle import cli

    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
