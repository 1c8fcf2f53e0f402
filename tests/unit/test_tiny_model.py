# SPDX-License-Identifier: Apache-2.0
"""The tiny model builder is deterministic and produces a loadable Llama directory."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from devkit.testing.tiny_model import TinyModelSpec, build_tiny_model


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.timeout(120)
def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    t0 = time.monotonic()
    a = build_tiny_model(TinyModelSpec(seed=7), tmp_path / "a")
    assert time.monotonic() - t0 < 60, "building the tiny model should take seconds"
    b = build_tiny_model(TinyModelSpec(seed=7), tmp_path / "b")
    c = build_tiny_model(TinyModelSpec(seed=8), tmp_path / "c")
    fa, fb, fc = _files(a), _files(b), _files(c)
    assert fa == fb
    assert fa["model.safetensors"] != fc["model.safetensors"]
    # cached: a second call returns the same directory without rebuilding
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(TinyModelSpec(seed=7), tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime


def test_model_directory_contents(tiny_model: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoTokenizer

    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["hidden_size"] == 256 and cfg["num_hidden_layers"] == 4
    with safe_open(str(tiny_model / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.self_attn.q_proj.weight").float()
    # realistic scale, not vLLM's tiny dummy init
    assert 0.1 < float(w.std()) < 0.2
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = tok("The prefill cache of the decode block")["input_ids"]
    assert 3 < len(ids) < 40
    assert tok.decode(ids) == "The prefill cache of the decode block"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|user|>hello<|end|><|assistant|>"


def test_engine_runs_a_local_model_in_its_saved_dtype(tmp_path: Path) -> None:
    """vLLM's ``auto`` downcasts float32 to bfloat16; the launcher passes the saved dtype."""
    from devkit.launch.engine import EngineSpec, saved_dtype

    model = build_tiny_model(TinyModelSpec(seed=7), tmp_path / "a")
    assert saved_dtype(str(model)) == "float32"
    argv = EngineSpec("single", str(model), port=8100).argv()
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert saved_dtype(str(tmp_path / "missing")) == "auto"
    assert saved_dtype("org/hub-name") == "auto"
    forced = EngineSpec("single", str(model), port=8100, dtype="bfloat16").argv()
    assert forced[forced.index("--dtype") + 1] == "bfloat16"
