# SPDX-License-Identifier: Apache-2.0
"""Test engines only: fault hooks for processes started with ``VLLM_EXT_FAULTS_DIR``.

Put this folder first on ``PYTHONPATH`` (``devkit.testing.faults.pair`` does) and
Python imports it at start-up. With ``VLLM_EXT_FAULTS_DIR`` unset it does nothing.
With it set, nothing is imported now; two modules are patched right after their
first import:

* NIXL's ``_api`` (``nixl._api`` / ``nixl_cu1x._api``): ``nixl_agent`` gets the
  rule-driven fault injection and event log of :mod:`devkit.testing.faults.nixl_shim`;
* ``vllm.v1.worker.worker_base``: ``WorkerBase`` gets the ``/collective_rpc`` methods
  of :mod:`devkit.testing.faults.introspect` (connector table sizes);
* ``vllm.v1.engine.core``: ``EngineCore.collective_rpc`` answers them in the
  scheduler's process too (its connector half's tables, the requests' KV blocks).

Never installed; never used outside tests.
"""

import os
import sys

if os.environ.get("VLLM_EXT_FAULTS_DIR"):
    import importlib.abc
    import importlib.machinery

    def _patch_nixl(module):
        from devkit.testing.faults import nixl_shim

        injector = nixl_shim.from_environment()
        if injector is not None and hasattr(module, "nixl_agent"):
            nixl_shim.install(module.nixl_agent, injector)

    def _patch_worker(module):
        from devkit.testing.faults import introspect

        introspect.install(module.WorkerBase)

    def _patch_engine_core(module):
        from devkit.testing.faults import introspect

        introspect.install_engine_core(module.EngineCore)

    def _hook_for(fullname):
        if fullname.startswith("nixl") and fullname.endswith("._api"):
            return _patch_nixl
        if fullname == "vllm.v1.worker.worker_base":
            return _patch_worker
        if fullname == "vllm.v1.engine.core":
            return _patch_engine_core
        return None

    class _Loader(importlib.abc.Loader):
        def __init__(self, inner, hook):
            self._inner, self._hook = inner, hook

        def create_module(self, spec):
            return self._inner.create_module(spec)

        def exec_module(self, module):
            self._inner.exec_module(module)
            try:
                self._hook(module)
            except Exception as e:  # a test hook must never break the engine
                print(f"vllm-ext faults: hook for {module.__name__} failed: {e}", file=sys.stderr)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            hook = _hook_for(fullname)
            if hook is None:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, hook)
            return spec

    sys.meta_path.insert(0, _Finder())
