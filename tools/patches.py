#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Patch tool for the vLLM patch series (thin wrapper; the code is ``vllm_ext.patchtool``).

    python tools/patches.py {apply,check,revert,status} [--pin VERSION]
        [--installed [--python PY] | --site-packages DIR | --checkout DIR]
    python tools/patches.py source --version 0.23.0 [--dest DIR] [--with-tests]  # pristine tree

Runs with any Python >= 3.10 from the repository (no install needed); the same tool is
the ``vllm-ext-patches`` console script of an installed vllm-ext.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, str(REPO))
    from vllm_ext import patchtool

    return patchtool.main(argv)


if __name__ == "__main__":
    sys.exit(main())
