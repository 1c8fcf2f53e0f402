# SPDX-License-Identifier: Apache-2.0
"""What P and D must share for P's KV to be the KV D would compute itself (S-LEG-6).

vLLM's handshake compares a hash of the model's name, dtype, shapes, KV cache dtype and
attention backend. Two engines can agree on all of that and still compute different KV:
one model path holding other weights on another host, or an ``--hf-overrides`` (rope
scaling, say) on one side only. D would then decode from KV its own model would never
have made and answer 200 with another output than one engine's. Each side channel
therefore announces this engine's model identity (:func:`identity`'s keys) in its
layout, and a peer whose identity differs is refused at the handshake, naming what
differs (:func:`identity_mismatch`).

* ``config``: a digest of the model's configuration as vLLM runs it (overrides
  applied), without the keys that cannot change the KV (:data:`BENIGN_CONFIG_KEYS`:
  the path it was loaded from, token ids, library versions, ...).
* ``weights``: a digest of the weight files (name, size and content: whole files up
  to :data:`WHOLE_FILE_BYTES`, else :data:`SAMPLES` evenly spaced samples of
  :data:`SAMPLE_BYTES`: a few MB read once per process however large the model).
  Empty where the weights are not in a local folder or file (not compared then).
* ``dtype``, ``kv_cache_dtype``, ``quantization``: as vLLM resolved them.

A LoRA adapter changes the KV per request, not per engine: a request's prompt key
(S-WRT-7) carries its adapter's name and :func:`adapter_digest`, so an adapter of one
name holding other weights (or another ``adapter_config.json``) on P than on D fails
the request at P's match instead of answering with another output.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Keys of a model's configuration that do not change the KV it computes.
BENIGN_CONFIG_KEYS = frozenset({
    "transformers_version", "torch_dtype", "dtype", "use_cache", "return_dict",
    "output_hidden_states", "output_attentions", "torchscript", "tokenizer_class",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "id2label", "label2id", "max_position_embeddings",
})  # fmt: skip
#: The identity keys compared (the model's path only names it in a message).
COMPARED = ("config", "weights", "dtype", "kv_cache_dtype", "quantization")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
WHOLE_FILE_BYTES = 8 << 20
SAMPLES = 16
SAMPLE_BYTES = 64 << 10


def _kv_relevant(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: _kv_relevant(v)
            for k, v in value.items()
            if not str(k).startswith("_") and k not in BENIGN_CONFIG_KEYS
        }
    if isinstance(value, (list, tuple)):
        return [_kv_relevant(v) for v in value]
    return value


def config_digest(config: Mapping[str, Any]) -> str:
    """A digest of a model configuration (``to_dict()`` of vLLM's ``hf_config``)
    without :data:`BENIGN_CONFIG_KEYS` and private (``_``) keys, at any depth."""
    text = json.dumps(_kv_relevant(dict(config)), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _file_digest(h: Any, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_BYTES:
            h.update(f.read())
            return
        for i in range(SAMPLES):  # the first and last bytes included
            f.seek(i * (size - SAMPLE_BYTES) // (SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))


@functools.lru_cache(maxsize=8)
def weights_digest(location: str) -> str:
    """A digest of the weight files of a model folder (or of one weight file); empty
    where ``location`` is neither or holds none."""
    path = Path(location)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
        # a folder with safetensors may keep .bin copies too: vLLM loads the former
        safetensors = [p for p in files if p.name.endswith(".safetensors")]
        files = safetensors or files
    else:
        return ""
    if not files:
        return ""
    h = hashlib.sha256()
    for f in files:
        _file_digest(h, f)
    return h.hexdigest()[:16]


#: the adapter files :func:`adapter_digest` reads beside its weight files
ADAPTER_CONFIG = "adapter_config.json"


def adapter_digest(location: str) -> str:
    """A digest of a LoRA adapter folder: its ``adapter_config.json`` (rank, scaling,
    target modules) and weight files, as :func:`weights_digest` reads them. Empty where
    ``location`` is no local folder (an adapter vLLM resolves elsewhere: its name alone
    is compared). Worked out once per folder and version of its files (their sizes and
    modification times), so an adapter reloaded in place is read again."""
    path = Path(location)
    try:
        files = sorted(
            p
            for p in path.iterdir()
            if p.name == ADAPTER_CONFIG or p.name.endswith(WEIGHT_SUFFIXES)
        )
        version = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    except OSError:  # not a folder, or gone
        return ""
    return _adapter_digest(str(path), version)


@functools.lru_cache(maxsize=64)
def _adapter_digest(location: str, version: tuple[tuple[str, int, int], ...]) -> str:
    if not version:
        return ""
    h = hashlib.sha256()
    config = Path(location, ADAPTER_CONFIG)
    if config.is_file():
        _file_digest(h, config)
    h.update(b"\0weights\0" + weights_digest.__wrapped__(location).encode())
    return h.hexdigest()[:16]


def identity(
    model: str, config: Mapping[str, Any], dtype: str, kv_cache_dtype: str,
    quantization: str | None, weights_location: str | None,
) -> dict[str, str]:  # fmt: skip
    """This engine's model identity, as its layout announces it."""
    location = weights_location or (model if os.path.exists(model) else "")
    return {
        "model": model,
        "config": config_digest(config),
        "weights": weights_digest(location) if location else "",
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype,
        "quantization": str(quantization),
    }


def identity_mismatch(mine: Mapping[str, str], theirs: Mapping[str, str], peer: str) -> str | None:
    """What differs between this engine's model identity and a peer's (``peer``: how to
    name it, e.g. ``P prefill-0``); None if nothing compared differs. A key either side
    does not announce (an older vllm-ext announces none) or leaves empty (weights not
    in a local folder) is not compared."""
    differ = [
        k for k in COMPARED
        if mine.get(k) and theirs.get(k) and mine[k] != theirs[k]
    ]  # fmt: skip
    if not differ:
        return None
    what = {
        "config": "model configuration (config.json with --hf-overrides applied)",
        "weights": "weight files",
        "dtype": "--dtype",
        "kv_cache_dtype": "--kv-cache-dtype",
        "quantization": "--quantization",
    }
    parts = [f"{what[k]}: {theirs[k]} there, {mine[k]} here" for k in differ]
    return (
        f"push: {peer} computes other KV than this engine ({'; '.join(parts)}; its model "
        f"{theirs.get('model', '?')!r}, this engine's {mine.get('model', '?')!r}): serve "
        "the same model with the same settings on P and D"
    )
