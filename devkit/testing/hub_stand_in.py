# SPDX-License-Identifier: Apache-2.0
"""Local stand-ins for the Hugging Face hub models that vLLM's own tests name.

vLLM's KV connector unit tests build a ``ModelConfig`` (and a tokenizer) for hub ids
such as ``facebook/opt-125m``. There is no hub here and this project downloads no
model from one, so each id gets a model directory built here, in code: the real
model's ``config.json`` numbers (architecture, ``model_type``, layers, heads, KV
heads, head size, hidden size, vocabulary: tests compare them, e.g. a handshake with
``num_key_value_heads`` overridden to 8 must differ from ``opt-125m``'s 12), written
from the public configs, and a word-level tokenizer of the model's vocabulary size
(:func:`devkit.testing.shaped_model.build_word_tokenizer`). No weights: a test that
loads a model's weights still fails, as it does without the stand-in. The special
token ids in the config are the stand-in tokenizer's (``<|bos|>`` 0, ``<|eos|>`` 1,
``<|pad|>`` 2), not the real ones.

The directories are laid out as an offline Hugging Face cache
(``<home>/hub/models--org--name/refs/main`` and ``snapshots/<rev>/``): with
``HF_HOME=<home>`` and ``HF_HUB_OFFLINE=1``, transformers and vLLM resolve the ids to
the stand-ins. Built once, under ``$VLLM_EXT_CACHE`` (default ``~/.cache/vllm-ext``),
keyed by the configs; a build happens in a temporary sibling renamed into place.

    python -m devkit.testing.hub_stand_in [--out DIR]   # prints the HF_HOME folder
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from devkit.testing.shaped_model import build_word_tokenizer
from devkit.testing.tiny_model import SPECIAL_TOKENS, build_model_dir, default_cache_dir

#: Bump when the builder's output changes for the same configs (invalidates caches).
BUILDER_VERSION = 1

_OPT = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "attention_dropout": 0.0,
    "dropout": 0.1,
    "enable_bias": True,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "use_cache": True,
    "vocab_size": 50272,
}

#: hub id -> the fields of its ``config.json`` (public configs; token ids are set
#: from the stand-in tokenizer by :func:`stand_in_config`).
CONFIGS: dict[str, dict[str, Any]] = {
    "facebook/opt-125m": {
        **_OPT,
        "do_layer_norm_before": True,
        "ffn_dim": 3072,
        "hidden_size": 768,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "word_embed_proj_dim": 768,
    },
    "facebook/opt-350m": {
        **_OPT,
        "do_layer_norm_before": False,
        "ffn_dim": 4096,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "word_embed_proj_dim": 512,
    },
    "meta-llama/Llama-3.2-1B-Instruct": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
    },
    "google/gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "cache_implementation": "hybrid",
        "final_logit_softcapping": None,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "initializer_range": 0.02,
        "intermediate_size": 6912,
        "max_position_embeddings": 32768,
        "num_attention_heads": 4,
        "num_hidden_layers": 26,
        "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 262144,
    },
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}


def stand_in_config(model_id: str) -> dict[str, Any]:
    """The ``config.json`` of ``model_id``'s stand-in."""
    return {
        **CONFIGS[model_id],
        "bos_token_id": SPECIAL_TOKENS.index("<|bos|>"),
        "eos_token_id": SPECIAL_TOKENS.index("<|eos|>"),
        "pad_token_id": SPECIAL_TOKENS.index("<|pad|>"),
    }


def revision(model_id: str) -> str:
    """The stand-in's snapshot name: 40 hex digits from its config (a commit-like id)."""
    blob = json.dumps({"id": model_id, "config": stand_in_config(model_id),
                       "v": BUILDER_VERSION}, sort_keys=True)  # fmt: skip
    return hashlib.sha1(blob.encode()).hexdigest()


def build_model(model_id: str, root: Path) -> Path:
    """The directory of ``model_id``'s stand-in (config, tokenizer), built if needed."""
    cfg = stand_in_config(model_id)

    def fill(tmp: Path) -> None:
        build_word_tokenizer(cfg["vocab_size"], tmp, cfg["max_position_embeddings"])
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]})
        )

    name = model_id.replace("/", "--")
    return build_model_dir(root / f"stand-in-{name}-{revision(model_id)[:12]}", fill,
                           {"id": model_id, "builder_version": BUILDER_VERSION})  # fmt: skip


def cache_key(ids: tuple[str, ...]) -> str:
    blob = json.dumps([[i, revision(i)] for i in sorted(ids)])
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_hub_cache(ids: tuple[str, ...] = tuple(CONFIGS), cache_dir: Path | None = None) -> Path:
    """An ``HF_HOME`` folder whose hub cache holds the stand-ins of ``ids`` (each a key
    of :data:`CONFIGS`), built once and reused."""
    unknown = sorted(set(ids) - set(CONFIGS))
    if unknown:
        raise KeyError(f"no stand-in for {', '.join(unknown)}")
    root = Path(cache_dir) if cache_dir else default_cache_dir() / "hub-stand-ins"

    def fill(tmp: Path) -> None:
        for model_id in ids:
            src = build_model(model_id, root / "models")
            repo = tmp / "hub" / f"models--{model_id.replace('/', '--')}"
            snap = repo / "snapshots" / revision(model_id)
            snap.mkdir(parents=True)
            for f in sorted(src.iterdir()):
                if f.name != "vllm_ext_spec.json":  # as the hub cache links its blobs
                    (snap / f.name).symlink_to(f.resolve())
            (repo / "refs").mkdir()
            (repo / "refs" / "main").write_text(revision(model_id))
        (tmp / "stand_ins.json").write_text(
            json.dumps({i: revision(i) for i in ids}, indent=1, sort_keys=True)
        )

    spec = {"ids": sorted(ids), "builder_version": BUILDER_VERSION}
    return build_model_dir(root / f"hf-home-{cache_key(ids)}", fill, spec, marker="stand_ins.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build (or find) the hub model stand-ins.")
    ap.add_argument(
        "--out", type=Path, help="cache folder (default: ~/.cache/vllm-ext/hub-stand-ins)"
    )
    ap.add_argument("--id", action="append", dest="ids", choices=sorted(CONFIGS),
                    help="only this hub id (repeatable; default: all)")  # fmt: skip
    args = ap.parse_args(argv)
    print(build_hub_cache(tuple(args.ids or CONFIGS), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
