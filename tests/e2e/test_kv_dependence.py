# SPDX-License-Identifier: Apache-2.0
"""The e2e equality checks can fail: D's output follows the KV that P pushed.

P runs a model with other weights (another seed; same architecture, so the
KV layout matches); if D ignored the pushed KV or recomputed the prompt, its
outputs would still equal the single engine's. They must not.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_helpers import deployment, run_all

from devkit.launch.pd import PDDeployment
from devkit.testing.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def foreign_kv(tiny_model: Path, tmp_path_factory) -> Iterator[PDDeployment]:
    other = build_tiny_model(TinyModelSpec(seed=1))
    yield from deployment(
        "push",
        tiny_model,
        tmp_path_factory.mktemp("foreign"),
        p_model=str(other),
        extra_config_update={"enforce_handshake_compat": False},
    )


def test_outputs_change_when_the_pushed_kv_is_different(foreign_kv, prompts, reference) -> None:
    got = run_all(foreign_kv.url, prompts, concurrency=1)
    multi_token = [i for i, p in enumerate(prompts) if len(p) > 1]
    assert all(got[i] != reference[i] for i in multi_token), (got, reference)
