# SPDX-License-Identifier: Apache-2.0
"""Build a tiny Llama-architecture model directory, locally, in seconds.

No hub access: the tokenizer is a byte-level BPE trained here with the
``tokenizers`` library on a generated corpus, and the weights are seeded random
tensors saved as safetensors. The init scale (``init_std``, default 0.15) is
large enough that greedy outputs depend on the whole context, and therefore on
the KV cache -- which is what P/D tests need: a wrong or missing KV transfer
changes the output. (``--load-format dummy`` weights are too small for that.)

The result is cached under ``$VLLM_EXT_CACHE`` (default ``~/.cache/vllm-ext``)
keyed by the spec, and is deterministic: the same spec gives the same bytes.

Command line::

    vllm-ext-tiny-model [--out DIR] [--seed 0]     # prints the model directory
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Bump when the builder's output changes for the same spec (invalidates caches).
BUILDER_VERSION = 1

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|end|>", "<|system|>", "<|user|>",
                  "<|assistant|>"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 8192
    init_std: float = 0.15
    #: float32, not bfloat16: bfloat16 logits of a random model are spaced 1/32 near
    #: the top, so two tokens tie every few hundred steps and greedy output then
    #: depends on batch shape (seen in CI: one of two identical requests differed)
    dtype: str = "float32"

    def key(self) -> str:
        blob = json.dumps({**dataclasses.asdict(self), "v": BUILDER_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    return Path(os.environ.get("VLLM_EXT_CACHE", Path.home() / ".cache" / "vllm-ext"))


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """Deterministic pseudo-English: enough variety for a few hundred BPE merges."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "qua", "pli", "dro",
                 "an", "el", "is", "or", "un", "th", "st", "er"]  # fmt: skip
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
                    for _ in range(600)})  # fmt: skip
    words += ["the", "a", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with",
              "prefill", "decode", "cache", "block", "token", "push", "pull", "write"]  # fmt: skip
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 16)
        s = " ".join(rng.choice(words) for _ in range(n))
        lines.append(s.capitalize() + rng.choice([".", "!", "?", ",", ";"]))
    digits = [" ".join(str(rng.randint(0, 9999)) for _ in range(8)) for _ in range(200)]
    return lines + digits


def build_tokenizer(spec: TinyModelSpec, out: Path) -> int:
    """Train a byte-level BPE on the generated corpus; returns the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    write_tokenizer_config(out, spec.max_position_embeddings)
    return tok.get_vocab_size()


def write_tokenizer_config(out: Path, model_max_length: int) -> None:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` for a ``tokenizer.json``
    with :data:`SPECIAL_TOKENS` (a ``PreTrainedTokenizerFast``)."""
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|eos|>",
                "pad_token": "<|pad|>",
                "model_max_length": model_max_length,
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=1,
            sort_keys=True,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"})
    )


def build_weights(spec: TinyModelSpec, vocab_size: int, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    h, inter = spec.hidden_size, spec.intermediate_size
    head_dim = h // spec.num_attention_heads
    kv = spec.num_key_value_heads * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * spec.init_std).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = ones(h)
        tensors[p + "post_attention_layernorm.weight"] = ones(h)
        tensors[p + "self_attn.q_proj.weight"] = normal(h, h)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, h)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, h)
        tensors[p + "self_attn.o_proj.weight"] = normal(h, h)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, h)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, h)
        tensors[p + "mlp.down_proj.weight"] = normal(h, inter)
    tensors["model.norm.weight"] = ones(h)
    tensors["lm_head.weight"] = normal(vocab_size, h)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.init_std,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": spec.dtype,
        "bos_token_id": SPECIAL_TOKENS.index("<|bos|>"),
        "eos_token_id": SPECIAL_TOKENS.index("<|eos|>"),
        "pad_token_id": SPECIAL_TOKENS.index("<|pad|>"),
    }
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    )


def build_tiny_model(
    spec: TinyModelSpec | None = None, cache_dir: Path | None = None, force: bool = False
) -> Path:
    """Return the directory of the tiny model for ``spec``, building it if needed.

    Building happens in a temporary sibling directory that is renamed into place,
    so a crash never leaves a half-written model behind and concurrent builders
    (e.g. pytest-xdist workers) are safe.
    """
    spec = spec or TinyModelSpec()
    root = Path(cache_dir) if cache_dir else default_cache_dir() / "models"

    def fill(tmp: Path) -> None:
        vocab = build_tokenizer(spec, tmp)
        build_weights(spec, vocab, tmp)

    return build_model_dir(
        root / f"tiny-llama-{spec.key()}",
        fill,
        {**dataclasses.asdict(spec), "builder_version": BUILDER_VERSION},
        force,
    )


def build_model_dir(
    target: Path,
    fill: Callable[[Path], None],
    spec: dict[str, Any],
    force: bool = False,
    marker: str = "config.json",
) -> Path:
    """``target``, made by ``fill(tmp)`` in a temporary sibling that is renamed into
    place (with ``spec`` as ``vllm_ext_spec.json``) unless it exists already (its
    ``marker`` file is there).

    A crash never leaves a half-written model behind, and concurrent builders (e.g.
    pytest-xdist workers) are safe.
    """
    if (target / marker).exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the model is shared like any cache
    try:
        fill(tmp)
        (tmp / "vllm_ext_spec.json").write_text(json.dumps(spec))
        for f in tmp.iterdir():
            if f.is_file() and not f.is_symlink():
                f.chmod(0o644)
        if force and target.exists():
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / marker).exists():  # lost a race only if target is whole
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build (or find) the tiny local test model.")
    ap.add_argument("--out", type=Path, help="cache folder (default: ~/.cache/vllm-ext/models)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = ap.parse_args(argv)
    path = build_tiny_model(TinyModelSpec(seed=args.seed), args.out, args.force)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
