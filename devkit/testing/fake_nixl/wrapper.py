# SPDX-License-Identifier: Apache-2.0
"""The fake NIXL as a drop-in for vLLM's ``NixlWrapper``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from devkit.testing.fake_nixl.agent import FakeNixlAgent

if TYPE_CHECKING:
    from devkit.testing.fake_nixl.fabric import FakeNixlFabric

# ---------------------------------------------------------------------- vLLM drop-in


class FakeNixlWrapper(FakeNixlAgent):
    """Base of the classes ``fake_nixl_wrapper_cls`` makes: ``NixlWrapper``'s signature."""

    bound_fabric: ClassVar[FakeNixlFabric]

    def __init__(
        self, agent_name: str, nixl_conf: Any = None, instantiate_all: bool = False
    ) -> None:
        fabric = getattr(type(self), "bound_fabric", None)
        if fabric is None:
            raise TypeError("make the class with fake_nixl_wrapper_cls(fabric)")
        super().__init__(agent_name, nixl_conf, instantiate_all, fabric=fabric)


def fake_nixl_wrapper_cls(fabric: FakeNixlFabric) -> type[FakeNixlWrapper]:
    """A class usable as vLLM's ``NixlWrapper``: ``cls(agent_name, nixl_conf)`` joins ``fabric``.

    vLLM's worker builds its agent as ``NixlWrapper(str(uuid.uuid4()), config)``;
    find it afterwards with ``fabric.agents()``.
    """
    return type("FakeNixlWrapper", (FakeNixlWrapper,), {"bound_fabric": fabric})


def patch_vllm_nixl_wrapper(
    monkeypatch: Any,
    fabric: FakeNixlFabric,
    module: str = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker",
) -> type[FakeNixlWrapper]:
    """Make vLLM's NIXL worker (and subclasses) build fake agents on ``fabric``.

    ``monkeypatch`` is pytest's fixture; the module is imported here.
    """
    import importlib

    cls = fake_nixl_wrapper_cls(fabric)
    monkeypatch.setattr(importlib.import_module(module), "NixlWrapper", cls)
    return cls
