# SPDX-License-Identifier: Apache-2.0
"""tools/cpu_standin.py: the registration of vLLM 0.34.0's standalone CPU runner kernels
copies the release's own declarations and schemas, and says which op it cannot find."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import cpu_standin  # noqa: E402

BINDINGS = """#include <torch/all.h>
#define TORCH_EXTENSION_NAME _C
void kept(const torch::Tensor& x);
TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  ops.def("other(Tensor x) -> ()", &other);
  ops.def(
      "kept(Tensor(a0!) x, "
      "str s=\\"a)b\\") -> ()",
      &kept);
  ops.def("sampled(Tensor x) -> Tensor");
  ops.impl("sampled", torch::kCPU, &sampled);
}
"""


def test_registers_only_the_named_ops_with_the_release_schemas() -> None:
    src = cpu_standin.registration_source(BINDINGS, ops=("kept", "sampled"))
    head, fragment = src.split("TORCH_LIBRARY_FRAGMENT(_C, ops) {")
    assert head.startswith("#define VLLM_STANDALONE_CPU_MRV2\n")
    assert "void kept(const torch::Tensor& x);" in head
    assert '"str s=\\"a)b\\") -> ()",\n      &kept);' in fragment
    assert 'ops.def("sampled(Tensor x) -> Tensor");' in fragment
    assert 'ops.impl("sampled", torch::kCPU, &sampled);' in fragment
    assert "other" not in fragment
    assert "TORCH_LIBRARY_EXPAND" not in src


def test_an_op_the_release_does_not_define_is_named() -> None:
    with pytest.raises(cpu_standin.StandinError, match="defines no gone"):
        cpu_standin.registration_source(BINDINGS, ops=("kept", "gone"))
