# SPDX-License-Identifier: Apache-2.0
"""P writes a request's KV only into a registration for the same prompt (S-WRT-7), and
the KV of a prompt depends on more than its tokens: the LoRA adapter it runs with and
the multimodal inputs its placeholders stand for. Two requests whose token ids are
equal but whose adapter, or whose multimodal identifiers, differ have different KV:
met by their ids (one transfer id, as two bodies under one X-Request-Id can), P must
refuse the registration, and D must fail its request rather than decode P's KV.

Both scheduler halves run with real vLLM ``Request`` objects that carry a
``LoRARequest`` or ``MultiModalFeatureSpec`` (the tiny model has neither, so vLLM's
scheduler would not run them: the halves are driven by hand, as the engine core
would, and the workers step through the fake NIXL). The truth is D's KV cache: its
blocks hold P's bytes only when the identifiers are equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from push_harness import (
    Engine,
    PushEnv,
    assert_kv_pushed,
    assert_untouched,
    block_pairs,
    kv_blocks,
    wait_until,
)
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.request import Request, RequestStatus

P_BLOCKS, D_BLOCKS = (4, 5, 6), (20, 21, 22)
PROMPT = [(i * 29) % 900 + 5 for i in range(48)]  # 3 blocks of 16
P_ID, D_ID = "cmpl-key-0-aaaaaaaa", "cmpl-key-0-bbbbbbbb"


def _lora(name: str | None) -> dict[str, Any]:
    if name is None:
        return {"lora_request": None}
    return {"lora_request": LoRARequest(name, sum(map(ord, name)), f"/adapters/{name}")}


def _images(*identifiers: str) -> dict[str, Any]:
    return {
        "mm_features": [
            MultiModalFeatureSpec(
                data=None, modality="image", identifier=ident,
                mm_position=PlaceholderRange(offset=4 + 8 * i, length=8),
            )
            for i, ident in enumerate(identifiers)
        ]
    }  # fmt: skip


def _request(engine: Engine, rid: str, params: dict, inputs: dict[str, Any]) -> Request:
    req = engine.make_request(rid, PROMPT, params, max_tokens=2)
    for name, value in inputs.items():
        setattr(req, name, value)
    return req


def _push(env: PushEnv, p: Engine, d: Engine, p_inputs: dict, d_inputs: dict) -> None:
    """D registers its blocks for its request, P finishes its own (one transfer id),
    and both sides step until D's request ended."""
    d_req = _request(d, D_ID, p.d_leg("KEY"), d_inputs)
    n, load_async = d.connector.get_num_new_matched_tokens(d_req, 0)
    assert (n, load_async) == (len(PROMPT), True)
    d.connector.update_state_after_alloc(d_req, kv_blocks(D_BLOCKS), n)
    p_req = _request(p, P_ID, p.p_leg("KEY"), p_inputs)
    assert p.connector.get_num_new_matched_tokens(p_req, 0) == (0, False)
    p.connector.update_state_after_alloc(p_req, kv_blocks([]), 0)
    p_req.num_computed_tokens = len(PROMPT)
    p_req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, _ = p.connector.request_finished(p_req, list(P_BLOCKS))
    assert delay
    wait_until(
        lambda: D_ID in d.finished_recving,
        step=lambda: (p.connector_step(), d.connector_step()),
        what="D's request ended",
    )


SAME = [
    ("no adapter, no images", {}, {}),
    ("one adapter", _lora("sql"), _lora("sql")),
    ("one image", _images("img-a"), _images("img-a")),
]
DIFFERENT = [
    ("other adapter", _lora("sql"), _lora("chat")),
    ("adapter on P only", _lora("sql"), _lora(None)),
    ("adapter on D only", _lora(None), _lora("sql")),
    ("other image", _images("img-a"), _images("img-b")),
    ("image on P only", _images("img-a"), {}),
    ("images in another order", _images("img-a", "img-b"), _images("img-b", "img-a")),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("what", "p_inputs", "d_inputs"), SAME, ids=[c[0] for c in SAME])
def test_equal_prompts_are_pushed(env: PushEnv, what: str, p_inputs: dict, d_inputs: dict) -> None:
    p, d = env.pair()
    _push(env, p, d, p_inputs, d_inputs)
    assert not d.invalid_block_ids & set(D_BLOCKS)
    assert_kv_pushed(p, d, block_pairs(p, d, P_BLOCKS, D_BLOCKS))
    assert p.totals("push_regs_prompt_mismatch") == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("what", "p_inputs", "d_inputs"), DIFFERENT, ids=[c[0] for c in DIFFERENT])
def test_prompts_that_differ_only_in_adapter_or_images_are_not_matched(
    env: PushEnv, what: str, p_inputs: dict, d_inputs: dict
) -> None:
    """Same token ids, same transfer id; only the adapter or the images differ: P
    refuses the registration and writes nothing, D fails the request (its blocks
    reported invalid, so vLLM never decodes from them)."""
    _assert_refused(env, p_inputs, d_inputs)


def _assert_refused(env: PushEnv, p_inputs: dict, d_inputs: dict) -> None:
    p, d = env.pair()
    d_before = d.snapshot()
    _push(env, p, d, p_inputs, d_inputs)
    assert not [t for t in env.fabric.transfers() if t.op == "WRITE"], "P wrote D's blocks"
    assert_untouched(d, d_before, ())
    assert set(D_BLOCKS) <= d.invalid_block_ids, f"D's blocks not invalid: {d.invalid_block_ids}"
    assert p.totals("push_regs_prompt_mismatch") == 1


def _adapter_at(folder: Path, weights: bytes) -> dict[str, Any]:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return {"lora_request": LoRARequest("sql", 7, str(folder))}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("d_weights", [b"\x01" * 4096, b"\x02" * 4096], ids=["same", "other"])
def test_one_adapter_name_is_matched_by_its_files(
    env: PushEnv, tmp_path: Path, d_weights: bytes
) -> None:
    """P and D load an adapter of one name from their own folders (two hosts): equal
    files are pushed; other weights give other KV, so P refuses the registration as
    for another adapter (before, the name alone was compared and D decoded P's KV)."""
    p_inputs = _adapter_at(tmp_path / "p" / "sql", b"\x01" * 4096)
    d_inputs = _adapter_at(tmp_path / "d" / "sql", d_weights)
    if d_weights == b"\x01" * 4096:
        p, d = env.pair()
        _push(env, p, d, p_inputs, d_inputs)
        assert_kv_pushed(p, d, block_pairs(p, d, P_BLOCKS, D_BLOCKS))
        assert p.totals("push_regs_prompt_mismatch") == 0
    else:
        _assert_refused(env, p_inputs, d_inputs)
