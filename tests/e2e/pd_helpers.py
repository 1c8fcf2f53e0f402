# SPDX-License-Identifier: Apache-2.0
"""Helpers for real 1P1D deployments (vLLM 0.23.0 engines, NIXL over UCX, the proxy).

Engines start in ~50 s here, so deployments are module-scoped and the reference
outputs of a single plain engine are computed once per session.
Fixtures live in conftest.py beside this file.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from devkit.cpu_isa import loaded_kernel_libraries
from devkit.launch.client import complete
from devkit.launch.engine import Engine
from devkit.launch.http import metric as metric  # (the tests import both from here)
from devkit.launch.http import scrape_metrics as scrape_metrics
from devkit.launch.pd import SHORT_TIMEOUTS_CONFIG, PDConfig, PDDeployment
from devkit.launch.process import ProcessStuck, StartOnce

#: Prompt lengths in tokens: 1 token, exactly one 128-token CPU block, a partial
#: last block, several whole blocks.
PROMPT_LENS = (1, 128, 300, 384)
MAX_TOKENS = 8
#: The other pin: test_push_032.py runs our push on it, against one engine of it.
OTHER_PIN = "0.32.0"
#: Short lease / watchdog so failure tests see blocks come back within seconds.
TEST_EXTRA_CONFIG = dict(SHORT_TIMEOUTS_CONFIG)


def kernel_libraries(engine: Engine) -> set[str]:
    """vLLM kernel libraries mapped in the engine's processes (API server, engine core)."""
    root = psutil.Process(engine.proc.pid)
    libs: set[str] = set()
    for proc in [root, *root.children(recursive=True)]:
        libs.update(loaded_kernel_libraries(Path(f"/proc/{proc.pid}/maps")))
    return libs


def make_prompts(vocab: int = 1024, seed: int = 1234) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in PROMPT_LENS]


def run_all(url: str, prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """Greedy token ids per prompt, sent with the given concurrency (streaming)."""
    work = [p for p in prompts for _ in range(max(1, concurrency // len(prompts)))]
    with ThreadPoolExecutor(concurrency) as ex:
        outs = list(ex.map(lambda p: complete(url, p, max_tokens=MAX_TOKENS), work))
    by_prompt: dict[int, list[list[int]]] = {}
    for p, o in zip(work, outs):
        by_prompt.setdefault(prompts.index(p), []).append(o.token_ids)
    result = []
    for i in range(len(prompts)):
        variants = by_prompt[i]
        assert all(v == variants[0] for v in variants), f"prompt {i}: outputs differ: {variants}"
        result.append(variants[0])
    return result


def local_prompt_tokens(url: str, send: Callable[[], object]) -> float:
    """Prompt tokens the engine at ``url`` computed itself (not from a connector or its
    prefix cache) while ``send()`` ran."""
    name = "vllm:prompt_tokens_by_source_total"
    before = metric(scrape_metrics(url), name, source="local_compute")
    send()
    return metric(scrape_metrics(url), name, source="local_compute") - before


def start_together(*deps: StartOnce) -> list[Exception | None]:
    """Start the deployments at the same time: every one's processes first, then the
    waits; one stuck on a port taken before it bound starts over, as under ``with``.
    Returns each one's error: None for one that runs (the caller stops it), else the
    error it failed with (it is stopped)."""
    errors: list[Exception | None] = [None] * len(deps)

    def attempt(i: int, step: Callable[[], object]) -> None:
        if errors[i] is None:
            try:
                step()
            except Exception as e:
                deps[i].stop()
                errors[i] = e

    def wait(d: StartOnce) -> None:
        try:
            d.wait_ready()
        except ProcessStuck as e:
            d.stop()
            d.progress(f"{e}; starting again with fresh ports")
            d.start()
            d.wait_ready()

    try:
        for i, d in enumerate(deps):
            attempt(i, d.start)
        for i, d in enumerate(deps):
            attempt(i, functools.partial(wait, d))
    except BaseException:  # interrupted (e.g. the test's timeout)
        for d in deps:
            d.stop()
        raise
    return errors


def deployment(
    mode: str, model: Path, run_dir: Path, extra_config_update: dict | None = None, **kw
) -> Iterator[PDDeployment]:
    cfg = PDConfig(
        mode=mode,  # type: ignore[arg-type]
        model=str(model),
        run_dir=run_dir,
        extra_config={**TEST_EXTRA_CONFIG, **(extra_config_update or {})},
        **kw,
    )
    with PDDeployment(cfg) as dep:
        yield dep
