# SPDX-License-Identifier: Apache-2.0
"""Run vLLM processes as if on an AVX2-only CPU (tests of the AVX2 kernel path)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

FORCE_AVX2_DIR = Path(__file__).resolve().parent / "force_avx2"


def force_avx2_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment entries that make vLLM processes load ``vllm/_C_AVX2``.

    Puts ``force_avx2/sitecustomize.py`` first on ``PYTHONPATH`` (kept after it: the
    caller's ``PYTHONPATH``, if any) and switches it on.
    """
    env = os.environ if base is None else base
    path = [str(FORCE_AVX2_DIR)]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    return {"PYTHONPATH": os.pathsep.join(path), "VLLM_EXT_FORCE_AVX2": "1"}
