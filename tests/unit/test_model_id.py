# SPDX-License-Identifier: Apache-2.0
"""The model identity a push engine announces (S-LEG-6): what differs is named, what
cannot change the KV is not compared."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from vllm_ext.nixl_push import model_id, wire
from vllm_ext.nixl_push.model_id import config_digest, identity, identity_mismatch, weights_digest

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_key_value_heads": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "_name_or_path": "/models/a", "transformers_version": "5.0", "eos_token_id": 1,
}  # fmt: skip


def test_the_config_digest_follows_what_changes_the_kv_only() -> None:
    same = {**CONFIG, "_name_or_path": "/mnt/b", "transformers_version": "4.57",
            "eos_token_id": [1, 7], "torch_dtype": "bfloat16"}  # fmt: skip
    assert config_digest(same) == config_digest(CONFIG)
    yarn = {**CONFIG, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    assert config_digest(yarn) != config_digest(CONFIG)
    assert config_digest({**CONFIG, "rms_norm_eps": 1e-5}) != config_digest(CONFIG)


def _weights(folder: Path, data: bytes, name: str = "model.safetensors") -> str:
    folder.mkdir()
    (folder / name).write_bytes(data)
    (folder / "config.json").write_text("{}")
    return str(folder)


def test_the_weights_digest_reads_the_content(tmp_path: Path, monkeypatch) -> None:
    a = _weights(tmp_path / "a", bytes(1000))
    b = _weights(tmp_path / "b", bytes(999) + b"\1")  # same size, one byte differs
    c = _weights(tmp_path / "c", bytes(1000))
    assert weights_digest(a) == weights_digest(c) != weights_digest(b)
    assert weights_digest(str(tmp_path / "missing")) == ""
    assert weights_digest(str(tmp_path)) == ""  # no weight files
    # past WHOLE_FILE_BYTES: evenly spaced samples, the last one included
    monkeypatch.setattr(model_id, "WHOLE_FILE_BYTES", 100)
    monkeypatch.setattr(model_id, "SAMPLE_BYTES", 10)
    big = bytes(5000)
    d = _weights(tmp_path / "d", big)
    e = _weights(tmp_path / "e", big[:-1] + b"\1")
    assert weights_digest(d) != weights_digest(e)


def test_a_mismatch_names_what_differs_and_skips_what_is_not_announced(tmp_path: Path) -> None:
    folder = _weights(tmp_path / "m", b"w" * 64)
    mine = identity(folder, CONFIG, "torch.float32", "auto", None, None)
    assert mine["weights"] and identity_mismatch(mine, dict(mine), "P p0") is None
    other = {**mine, "weights": "0" * 16, "dtype": "torch.bfloat16", "model": "/x"}
    problem = identity_mismatch(mine, other, "P p0")
    assert problem is not None and "P p0" in problem
    assert "weight files: " + "0" * 16 in problem
    assert "--dtype: torch.bfloat16 there, torch.float32 here" in problem
    assert "configuration" not in problem and "'/x'" in problem
    # an older peer (no identity) or weights it cannot read: not compared
    assert identity_mismatch(mine, {}, "P p0") is None
    assert identity_mismatch(mine, {**mine, "weights": ""}, "P p0") is None
    # the model's path names it only: the same weights under another path pair
    assert identity_mismatch(mine, {**mine, "model": "/elsewhere"}, "P p0") is None


def test_a_layout_carries_the_model_identity() -> None:
    ident = (("config", "abc"), ("model", "/m"), ("weights", "def"))
    layout = wire.PeerLayout("P", 1, 1, 5.0, (), ident)
    assert wire.PeerLayout.decode(layout.encode()) == layout
    body = msgpack.unpackb(layout.encode())
    body.pop("model")  # an older peer announces none
    assert wire.PeerLayout.decode(msgpack.packb(body)).model == ()
    for bad in ({"config": 3}, ["config"]):
        body["model"] = bad
        with pytest.raises(wire.WireError):
            wire.PeerLayout.decode(msgpack.packb(body))


def _adapter(folder: Path, weights: bytes, alpha: int = 16) -> str:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(f'{{"r": 8, "lora_alpha": {alpha}}}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    (folder / "README.md").write_text(str(folder))  # not what the KV depends on
    return str(folder)


def _key(adapter: str | None, name: str = "sql") -> object:
    from types import SimpleNamespace

    from vllm.lora.request import LoRARequest

    from vllm_ext import compat

    lora = LoRARequest(name, 1, adapter) if adapter is not None else None
    return compat.prompt_key(SimpleNamespace(prompt_token_ids=[5, 6, 7], lora_request=lora))


def test_a_prompt_key_carries_its_lora_adapters_files(tmp_path: Path) -> None:
    """S-WRT-7 with S-LEG-6's reasoning: one adapter name on P and D holding other
    weights, or another adapter_config.json, gives P's KV to a D that computes other
    KV; the prompt keys differ, so P refuses the registration (the request fails)."""
    on_p = _adapter(tmp_path / "p" / "sql", b"\x01" * 4096)
    on_d = _adapter(tmp_path / "d" / "sql", b"\x01" * 4096)  # another host, same files
    other_weights = _adapter(tmp_path / "x" / "sql", b"\x02" * 4096)
    other_alpha = _adapter(tmp_path / "y" / "sql", b"\x01" * 4096, alpha=32)
    assert _key(on_p) == _key(on_d)
    assert _key(on_p) != _key(other_weights)
    assert _key(on_p) != _key(other_alpha)
    assert _key(on_p) != _key(on_d, name="sql-v2") and _key(on_p) != _key(None)
    # not a local folder (vLLM resolves it elsewhere): the name alone is compared
    assert _key(str(tmp_path / "nowhere")) == _key("hub-org/sql-adapter")


def test_an_adapter_rewritten_in_place_is_read_again(tmp_path: Path) -> None:
    folder = _adapter(tmp_path / "sql", b"\x01" * 4096)
    before = model_id.adapter_digest(folder)
    (Path(folder) / "adapter_model.safetensors").write_bytes(b"\x03" * 4097)
    assert model_id.adapter_digest(folder) not in ("", before)
