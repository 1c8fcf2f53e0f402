# SPDX-License-Identifier: Apache-2.0
"""A pinned vLLM engine serves the tiny model on CPU with our plugin loaded."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from devkit.launch.engine import SERVED_MODEL_NAME, EngineSpec, start_engine


def _complete(url: str, prompt: str, max_tokens: int = 8) -> dict:
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_engine_serves_tiny_model_with_plugin(tiny_model: Path, tmp_path: Path) -> None:
    engine = start_engine(EngineSpec(name="single", model=str(tiny_model)), tmp_path)
    try:
        engine.wait_ready()
        a = _complete(engine.url, "The prefill cache of the decode block")
        b = _complete(engine.url, "A prefill cache of the decode block")
    finally:
        engine.stop()
    text_a, text_b = a["choices"][0]["text"], b["choices"][0]["text"]
    assert a["usage"]["completion_tokens"] == 8 and text_a
    # the output depends on more than the last token: the weights are KV-sensitive
    assert text_a != text_b
    log = engine.proc.log_path.read_text()
    assert "vllm-ext: registered" in log
    assert not engine.proc.alive()
