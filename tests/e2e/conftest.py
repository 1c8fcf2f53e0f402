# SPDX-License-Identifier: Apache-2.0
"""Fixtures for e2e tests: the prompt set and a single engine's reference outputs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from pd_helpers import OTHER_PIN, deployment, make_prompts, run_all, start_together
from support import pin_python

from devkit.launch.pd import PDConfig, PDDeployment

T = TypeVar("T")


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return make_prompts()


@pytest.fixture(scope="session")
def single_engines(
    tiny_model: Path, prompts: list[list[int]], tmp_path_factory, request
) -> Iterator[tuple[PDDeployment | Exception, list[list[int]] | Exception | None]]:
    """One plain engine (same core count as each P/D engine), started once for every
    reference output of the session (it idles between them), and the outputs of one
    plain engine of vLLM 0.32.0 for the prompt set where a test of the session asks for
    them (``reference_032``; None otherwise). Either is the error it failed with, for
    the tests that ask for it.

    Both start at once, on the two cores (an engine's start keeps one core busy: two
    take the time of one); the 0.32.0 one stops once it answered."""
    single = PDDeployment(
        PDConfig(mode="single", model=str(tiny_model), run_dir=tmp_path_factory.mktemp("single"))
    )
    other = None
    if any("reference_032" in item.fixturenames for item in request.session.items):
        other = PDDeployment(
            PDConfig(mode="single", model=str(tiny_model), d_cpu=0,
                     run_dir=tmp_path_factory.mktemp("single-032"),
                     python=str(pin_python(OTHER_PIN)))
        )  # fmt: skip
    errors = start_together(single, *([other] if other else []))
    outputs: list[list[int]] | Exception | None = None
    if other is not None:
        try:
            outputs = errors[1] or run_all(other.url, prompts, concurrency=1)
        except Exception as e:
            outputs = e
        finally:
            if errors[1] is None:
                other.stop()
    try:
        yield errors[0] or single, outputs
    finally:
        if errors[0] is None:
            single.stop()


def _or_raise(value: T | Exception) -> T:
    if isinstance(value, Exception):
        raise value
    return value


@pytest.fixture(scope="session")
def single_engine(single_engines) -> PDDeployment:
    return _or_raise(single_engines[0])


@pytest.fixture(scope="session")
def reference_032(single_engines) -> list[list[int]]:
    """Outputs of one plain engine of vLLM 0.32.0 for the prompt set."""
    outputs = _or_raise(single_engines[1])
    assert outputs is not None
    return outputs


@pytest.fixture(scope="session")
def push_1p1d(tiny_model: Path, tmp_path_factory) -> Iterator[PDDeployment]:
    """One push 1P1D (our proxy, test timeouts) for every module that only sends it
    requests (engines start in ~70 s here, so once)."""
    yield from deployment("push", tiny_model, tmp_path_factory.mktemp("push"))


@pytest.fixture(scope="session")
def reference(single_engine: PDDeployment, prompts: list[list[int]]) -> list[list[int]]:
    """Outputs of one plain engine for the prompt set."""
    return run_all(single_engine.url, prompts, concurrency=1)
