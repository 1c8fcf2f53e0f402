# SPDX-License-Identifier: Apache-2.0
"""P and D sharing one GPU (``--gpus 0,0``, e.g. a one-GPU host): the correctness check
and the floor place both sides on it and drop what needs two GPUs."""

from __future__ import annotations

import pytest

from devkit.bench import correctness, floor
from devkit.testing.shaped_model import QWEN3_8B


def test_correctness_on_one_gpu_puts_p_and_d_there_and_skips_tp2() -> None:
    assert correctness.phases_for("cuda", ("0", "0")) == ["single", "push", "push-progressive"]
    assert "push-tp2" in correctness.phases_for("cuda", ("0", "1"))
    opts = correctness.gpu_options("push", ("0", "0"))
    assert (opts.devices("prefill"), opts.devices("decode"), opts.devices("single")) == (
        "0",
        "0",
        "0",
    )
    with pytest.raises(ValueError, match="two distinct GPUs"):
        correctness.gpu_options("push-tp2", ("0", "0"))
    tp2 = correctness.gpu_options("push-tp2", ("0", "1"))
    assert (tp2.devices("prefill"), tp2.devices("decode"), tp2.p_tp_size) == ("0,1", "1", 2)


@pytest.mark.parametrize("visible", ["own", "both"])
def test_floor_on_one_gpu_uses_it_for_both_sides(visible: str) -> None:
    cfg = floor.DeviceFloorConfig(
        device="cuda", geometry=floor.KvGeometry.of_shape(QWEN3_8B), input_lens=[2048],
        gpus=("0", "0"), visible=visible,
    )  # fmt: skip
    for side in ("initiator", "target", "copy"):
        assert cfg.env(side)["CUDA_VISIBLE_DEVICES"] == "0"
        assert cfg.device_index(side) == 0
