# SPDX-License-Identifier: Apache-2.0
"""Every push counter the code increments is declared (so Prometheus exports it)."""

from __future__ import annotations

import re
from pathlib import Path

import vllm_ext.nixl_push as pkg
from vllm_ext.nixl_push.lifecycle import Answer
from vllm_ext.nixl_push.matching import _Indexes
from vllm_ext.nixl_push.stats import COUNTERS


def test_every_incremented_counter_is_declared() -> None:
    src = "\n".join(p.read_text() for p in Path(pkg.__file__).parent.glob("*.py"))
    literal = set(re.findall(r'\.inc\(\s*"([a-z_]+)"', src))
    assert literal, "the pattern found nothing"
    # the two formatted ones: f"push_match_{rule}" and f"push_notifs_{how.value}"
    formatted = {f"push_match_{rule}" for rule in _Indexes.RULES}
    formatted |= {f"push_notifs_{a.value}" for a in Answer if a is not Answer.ACCEPTED}
    assert len(re.findall(r'\.inc\(\s*f"', src)) == 2, "a new formatted counter: list it here"
    assert literal | formatted <= set(COUNTERS), sorted((literal | formatted) - set(COUNTERS))
    assert len(COUNTERS) == len(set(COUNTERS))
