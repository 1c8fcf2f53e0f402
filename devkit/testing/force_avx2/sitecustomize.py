# SPDX-License-Identifier: Apache-2.0
"""Make every Python process started with this folder on ``PYTHONPATH`` look like an
AVX2-only x86-64 CPU to vLLM.

vLLM chooses its CPU kernel library from torch's detection
(``torch.cpu._is_avx512_supported()`` and friends; see ``devkit.cpu_isa``). Turning
those answers off makes vLLM load ``vllm/_C_AVX2``, which runs on any AVX-512 host too
(AVX2 is a subset), so the AVX2 path is testable everywhere. torch's own kernels are
untouched. Used by ``devkit.testing.cpu_isa.force_avx2_env``; never installed.
"""

import os

if os.environ.get("VLLM_EXT_FORCE_AVX2") == "1":
    import torch

    def _no() -> bool:
        return False

    for _name in dir(torch.cpu):
        if _name.startswith(("_is_avx512", "_is_amx")):
            setattr(torch.cpu, _name, _no)
