# SPDX-License-Identifier: Apache-2.0
"""A model directory with a real model's shapes and no weights, for ``--load-format dummy``.

The GPU benchmark needs the KV sizes, compute and memory of a real model but no hub:
``config.json`` carries the architecture's numbers (Qwen3-8B by default: 36 layers,
8 KV heads of 128, bf16: 144 KiB of KV per token) and vLLM's dummy loader fills the
weights with random values. The tokenizer is built here like the tiny model's
(``tokenizers``, the same special tokens and config files) but as a word-level
vocabulary of exactly the model's size (``<|bos|>`` ... then ``w7`` ... ``w151935``):
every token id the model can sample decodes to a word, and every decoded prompt
encodes back to the same ids, so ``vllm bench serve``'s random prompts have exactly
the requested length and are unique per request.

    vllm-ext-shaped-model [--shape qwen3-8b]      # prints the model directory
    python -m devkit.testing.shaped_model       # same

The directory is cached under ``$VLLM_EXT_CACHE`` (default ``~/.cache/vllm-ext``)
keyed by the spec, built in seconds (the tokenizer file is ~3 MB).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

from devkit.testing.tiny_model import (
    SPECIAL_TOKENS,
    build_model_dir,
    default_cache_dir,
    write_tokenizer_config,
)

BUILDER_VERSION = 1
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class ShapedModelSpec:
    """A decoder's shapes (defaults: Qwen3-8B's ``config.json``)."""

    name: str = "qwen3-8b"
    architecture: str = "Qwen3ForCausalLM"
    model_type: str = "qwen3"
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    max_position_embeddings: int = 40960
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    dtype: str = "bfloat16"

    def key(self) -> str:
        blob = json.dumps({**dataclasses.asdict(self), "v": BUILDER_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token (all KV heads, one rank)."""
        return (
            self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * self.dtype_bytes
        )

    def kv_bytes_per_token_layer(self) -> int:
        return self.kv_bytes_per_token() // self.num_hidden_layers

    def config(self) -> dict[str, object]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "initializer_range": 0.02,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "sliding_window": None,
            "use_sliding_window": False,
            "use_cache": True,
            "tie_word_embeddings": False,
            "torch_dtype": self.dtype,
            "bos_token_id": SPECIAL_TOKENS.index("<|bos|>"),
            "eos_token_id": SPECIAL_TOKENS.index("<|eos|>"),
            "pad_token_id": SPECIAL_TOKENS.index("<|pad|>"),
        }


QWEN3_8B = ShapedModelSpec()
SHAPES: dict[str, ShapedModelSpec] = {QWEN3_8B.name: QWEN3_8B}


def word(i: int) -> str:
    """The text of token id ``i`` (ids below ``len(SPECIAL_TOKENS)`` are special)."""
    return SPECIAL_TOKENS[i] if i < len(SPECIAL_TOKENS) else f"w{i}"


def build_word_tokenizer(vocab_size: int, out: Path, model_max_length: int) -> None:
    """A word-level tokenizer of exactly ``vocab_size`` ids (split on whitespace)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {word(i): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[2]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    write_tokenizer_config(out, model_max_length)


def build_shaped_model(
    spec: ShapedModelSpec = QWEN3_8B, cache_dir: Path | None = None, force: bool = False
) -> Path:
    """The directory of ``spec`` (config + tokenizer, no weights), built if needed."""
    root = Path(cache_dir) if cache_dir else default_cache_dir() / "models"

    def fill(tmp: Path) -> None:
        build_word_tokenizer(spec.vocab_size, tmp, spec.max_position_embeddings)
        cfg = spec.config()
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]})
        )

    return build_model_dir(
        root / f"shaped-{spec.name}-{spec.key()}",
        fill,
        {**dataclasses.asdict(spec), "builder_version": BUILDER_VERSION},
        force,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build (or find) a weightless model directory.")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=QWEN3_8B.name)
    ap.add_argument("--out", type=Path, help="cache folder (default: ~/.cache/vllm-ext/models)")
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = ap.parse_args(argv)
    print(build_shaped_model(SHAPES[args.shape], args.out, args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
