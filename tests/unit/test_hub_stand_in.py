# SPDX-License-Identifier: Apache-2.0
"""The hub model stand-ins (devkit.testing.hub_stand_in) the PR kit's pytest check gives
vLLM's tests: with ``HF_HOME`` at the built cache and ``HF_HUB_OFFLINE=1``, transformers
and vLLM resolve each hub id to its stand-in, with the real model's numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from devkit.testing.hub_stand_in import CONFIGS, build_hub_cache, revision

REPO = Path(__file__).resolve().parents[2]

#: From the public config.json files (the numbers vLLM's handshake tests compare).
PUBLIC = {
    "facebook/opt-125m": ("opt", "OPTForCausalLM", 12, 12, 768, 50272),
    "facebook/opt-350m": ("opt", "OPTForCausalLM", 24, 16, 1024, 50272),
    "meta-llama/Llama-3.2-1B-Instruct": ("llama", "LlamaForCausalLM", 16, 32, 2048, 128256),
    "google/gemma-3-1b-it": ("gemma3_text", "Gemma3ForCausalLM", 26, 4, 1152, 262144),
    "Qwen/Qwen3-0.6B": ("qwen3", "Qwen3ForCausalLM", 28, 16, 1024, 151936),
}

_PROBE = """
import json, sys
from transformers import AutoConfig, AutoTokenizer
out = {}
for model_id in sys.argv[1:]:
    try:
        cfg = AutoConfig.from_pretrained(model_id)
        tok = AutoTokenizer.from_pretrained(model_id)
    except OSError as e:
        out[model_id] = {"error": type(e).__name__}
        continue
    out[model_id] = {
        "model_type": cfg.model_type, "architectures": cfg.architectures,
        "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
        "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
        "kv_heads": getattr(cfg, "num_key_value_heads", None),
        "tokenizer_len": len(tok), "ids": tok.encode("w7 w50000", add_special_tokens=False),
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hub_cache(cache_dir=tmp_path_factory.mktemp("stand-ins"))


def _offline_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    return {**env, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def test_the_cache_has_the_hub_layout(hf_home: Path) -> None:
    assert set(PUBLIC) == set(CONFIGS)
    for model_id in CONFIGS:
        repo = hf_home / "hub" / f"models--{model_id.replace('/', '--')}"
        rev = (repo / "refs" / "main").read_text()
        assert rev == revision(model_id) and len(rev) == 40
        files = {p.name for p in (repo / "snapshots" / rev).iterdir()}
        assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= files
        assert not {f for f in files if f.endswith((".safetensors", ".bin"))}, "no weights"
    # built once: the same ids give the same folder, another set another one
    assert build_hub_cache(cache_dir=hf_home.parent) == hf_home
    assert build_hub_cache(("facebook/opt-125m",), hf_home.parent) != hf_home
    with pytest.raises(KeyError, match="no stand-in for org/none"):
        build_hub_cache(("org/none",), hf_home.parent)


@pytest.mark.timeout(180)
def test_transformers_resolves_each_id_offline(hf_home: Path) -> None:
    ids = [*PUBLIC, "facebook/opt-1.3b"]  # the last has no stand-in
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, *ids],
        env=_offline_env(hf_home), capture_output=True, text=True, timeout=150, cwd=hf_home,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for model_id, (model_type, arch, layers, heads, hidden, vocab) in PUBLIC.items():
        g = got[model_id]
        assert (g["model_type"], g["architectures"]) == (model_type, [arch]), model_id
        assert (g["layers"], g["heads"], g["hidden"], g["vocab"]) == (
            layers, heads, hidden, vocab,
        ), model_id  # fmt: skip
        assert g["tokenizer_len"] == vocab, model_id
        assert g["ids"] == [7, 50000], model_id
    assert got["google/gemma-3-1b-it"]["kv_heads"] == 1
    assert got["meta-llama/Llama-3.2-1B-Instruct"]["kv_heads"] == 8
    # offline for real: an id without a stand-in is not found (no download is tried)
    assert got["facebook/opt-1.3b"] == {"error": "OSError"}
