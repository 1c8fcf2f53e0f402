# SPDX-License-Identifier: Apache-2.0
"""Hybrid KV (S-HYB-1) on real vLLM 0.32.0 CPU engines: a tiny model whose even layers
attend within a sliding window and whose odd layers attend to everything, served by
a push 1P1D (``ExtNixlPushConnector``), answers what one 0.32 engine answers.

The model is the tiny Llama (built locally) with ``layer_types`` and
``sliding_window`` in its config, which vLLM's Llama reads per layer: two KV cache
groups under vLLM's hybrid KV cache manager (full attention, sliding window), each KV
tensor shared by one layer of each. The prompts longer than the window leave their
first blocks outside it: D's KV cache manager holds the null block there and P has
freed them, so P writes each group's blocks from the first D holds.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_helpers import (
    OTHER_PIN,
    deployment,
    local_prompt_tokens,
    metric,
    run_all,
    scrape_metrics,
    start_together,
)
from support import pin_python

from devkit.launch.pd import PDConfig, PDDeployment

# FULL=1 (about 4 min: three 0.32.0 engines); the push suite covers it in the default run
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

#: tokens: less than the two longest prompts (300, 384) by more than one 128-token block
WINDOW = 160
LAYER_TYPES = ["sliding_attention", "full_attention"] * 2


@pytest.fixture(scope="module")
def hybrid_model(tiny_model: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-hybrid") / "model"
    shutil.copytree(tiny_model, out)
    config = json.loads((out / "config.json").read_text())
    config.update(layer_types=LAYER_TYPES, sliding_window=WINDOW)
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    return out


@pytest.fixture(scope="module")
def reference_hybrid(hybrid_model: Path, prompts, tmp_path_factory) -> list[list[int]]:
    """Greedy outputs of one plain 0.32 engine serving the hybrid model."""
    single = PDDeployment(
        PDConfig(mode="single", model=str(hybrid_model), d_cpu=0,
                 run_dir=tmp_path_factory.mktemp("single-hybrid"),
                 python=str(pin_python(OTHER_PIN)))
    )  # fmt: skip
    (error,) = start_together(single)
    if error is not None:
        raise error
    try:
        return run_all(single.url, prompts, concurrency=1)
    finally:
        single.stop()


@pytest.fixture(scope="module")
def push_hybrid(hybrid_model: Path, tmp_path_factory) -> Iterator[PDDeployment]:
    yield from deployment(
        "push", hybrid_model, tmp_path_factory.mktemp("push-hybrid"),
        python=str(pin_python(OTHER_PIN)), connector="ExtNixlPushConnector",
    )  # fmt: skip


def _log(dep: PDDeployment, name: str) -> str:
    return (dep.cfg.run_dir / f"{name}.log").read_text(errors="replace")


def test_hybrid_push_outputs_equal_single_engine(push_hybrid, prompts, reference_hybrid) -> None:
    # Both engines run vLLM's hybrid KV cache manager: two KV cache groups.
    for name in ("prefill", "decode"):
        log = _log(push_hybrid, name)
        assert "Turning off hybrid kv cache manager" not in log, log[-3000:]
    before = scrape_metrics(push_hybrid.prefill.url)
    assert run_all(push_hybrid.url, prompts, concurrency=1) == reference_hybrid
    after = scrape_metrics(push_hybrid.prefill.url)
    # Every prompt of a block or more was written (not recomputed on D).
    writes = metric(after, "vllm:ext_push_writes_total") - metric(
        before, "vllm:ext_push_writes_total"
    )
    assert writes >= sum(1 for p in prompts if len(p) >= 128)
    assert run_all(push_hybrid.url, prompts, concurrency=4) == reference_hybrid


def test_hybrid_decode_computes_no_prompt_tokens(push_hybrid, prompts) -> None:
    """D decodes from the pushed KV of both groups: it computes at most the last
    prompt token of each request itself."""
    local = local_prompt_tokens(
        push_hybrid.decode.url, lambda: run_all(push_hybrid.url, prompts, concurrency=1)
    )
    assert local <= len(prompts)
