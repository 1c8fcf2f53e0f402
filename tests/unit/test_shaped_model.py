# SPDX-License-Identifier: Apache-2.0
"""The weightless Qwen3-8B-shaped model (GPU benchmark) and the tiny model's GPU fitness."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from devkit.testing.shaped_model import QWEN3_8B, ShapedModelSpec, build_shaped_model
from devkit.testing.tiny_model import TinyModelSpec


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shaped_model(QWEN3_8B, tmp_path_factory.mktemp("models"))


def test_qwen3_8b_kv_is_144_kib_per_token() -> None:
    # 36 layers x (K, V) x 8 KV heads x 128 x 2 B
    assert QWEN3_8B.kv_bytes_per_token() == 36 * 2 * 8 * 128 * 2 == 144 * 1024
    assert QWEN3_8B.kv_bytes_per_token_layer() == 4096
    # a 16-token GPU block: 64 KiB per layer, 2.25 MiB over all layers
    assert 16 * QWEN3_8B.kv_bytes_per_token_layer() == 64 * 1024
    assert 16 * QWEN3_8B.kv_bytes_per_token() == 36 * 64 * 1024
    # a 16k prompt moves 2.3 GiB (shared/GPU.md: "a 16k prompt is 2.3 GB"... 2.4e9 B)
    assert 16384 * QWEN3_8B.kv_bytes_per_token() == 2_415_919_104


def test_qwen3_8b_config(qwen3_dir: Path) -> None:
    cfg = json.loads((qwen3_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    expected = {
        "num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
        "vocab_size": 151936, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    }  # fmt: skip
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["max_position_embeddings"] >= 20000
    assert not list(qwen3_dir.glob("*.safetensors")), "weights come from --load-format dummy"
    # the same spec is the same directory (cached)
    assert build_shaped_model(QWEN3_8B, qwen3_dir.parent) == qwen3_dir
    assert ShapedModelSpec(num_hidden_layers=2).key() != QWEN3_8B.key()


def test_qwen3_8b_tokenizer_covers_the_vocab(qwen3_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3_dir))
    assert len(tok) == tok.vocab_size == 151936
    rng = random.Random(0)
    ids = [rng.randrange(7, 151936) for _ in range(4096)] + [151935]
    text = tok.decode(ids)
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.num_special_tokens_to_add() == 0


def test_bench_serve_random_prompts_have_exact_lengths(qwen3_dir: Path) -> None:
    """``vllm bench serve --dataset-name random`` decodes and re-encodes its prompts."""
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets.datasets import RandomDataset

    tok = AutoTokenizer.from_pretrained(str(qwen3_dir))
    reqs = RandomDataset(random_seed=3).sample(tok, 4, input_len=16384, output_len=64)
    assert [r.prompt_len for r in reqs] == [16384] * 4
    assert len({r.prompt for r in reqs}) == 4
    for r in reqs:
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == 16384


def test_tiny_model_fits_flash_attention_and_tp2() -> None:
    s = TinyModelSpec()
    head_dim = s.hidden_size // s.num_attention_heads
    assert head_dim % 8 == 0 and head_dim <= 256  # FLASH_ATTN head sizes
    # TP2 on P: heads, KV heads and MLP split evenly over two ranks
    assert s.num_attention_heads % 2 == 0 and s.num_key_value_heads % 2 == 0
    assert s.intermediate_size % 2 == 0 and s.vocab_size % 2 == 0
    # ~4k-token prompts fit its positions
    assert s.max_position_embeddings >= 8192
