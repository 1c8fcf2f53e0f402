# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.34.0's standalone CPU model runner on an x86 CPU without triton-cpu.

Installed into the 0.34.0 CPU env only (never part of ``vllm_ext``), as the module
``vllm_cpu_standin`` of the wheel ``tools/cpu_standin.py`` builds, and imported at every
interpreter start by its ``.pth`` file. It changes two things, both when
``vllm.platforms.cpu`` is first imported (a meta path hook: nothing is imported before):

* ``CpuPlatform.uses_standalone_cpu_model_runner()`` is True: vLLM 0.34.0 runs its
  standalone (no-Triton) CPU model runner, which it selects itself on every non-x86
  CPU without Triton; ``CpuPlatform.check_and_update_config`` runs as on such a CPU
  (it refuses x86 without Triton, the case the standalone runner exists for).
* the library next to this file is loaded: vLLM 0.34.0's own kernels of that runner
  that 0.32.0's ``vllm._C`` (the env's compiled parts) lacks, registered into the
  ``_C`` op namespace with 0.34.0's schemas (docs/environments.md).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path
from types import ModuleType

#: The module whose import this hooks.
PLATFORM_MODULE = "vllm.platforms.cpu"
KERNELS = Path(__file__).with_name("_kernels.so")


def _adapt(module: ModuleType) -> None:
    import torch
    from vllm.platforms.interface import CpuArchEnum

    platform = module.CpuPlatform
    check = platform.check_and_update_config.__func__
    arch = platform.get_cpu_architecture

    def check_as_without_triton(cls, vllm_config) -> None:  # type: ignore[no-untyped-def]
        platform.get_cpu_architecture = classmethod(lambda c: CpuArchEnum.ARM)
        try:
            check(cls, vllm_config)
        finally:
            platform.get_cpu_architecture = arch

    platform.uses_standalone_cpu_model_runner = classmethod(lambda cls: True)
    platform.check_and_update_config = classmethod(check_as_without_triton)
    torch.ops.load_library(str(KERNELS))


class _PlatformHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != PLATFORM_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_adapt(module: ModuleType) -> None:
            exec_module(module)
            _adapt(module)

        spec.loader.exec_module = exec_and_adapt  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Hook the platform module's import (the ``.pth`` file calls this)."""
    if PLATFORM_MODULE not in sys.modules and not any(
        isinstance(f, _PlatformHook) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _PlatformHook())
