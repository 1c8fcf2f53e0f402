# SPDX-License-Identifier: Apache-2.0
"""The CUDA engine image (``deploy/images/engine.Containerfile``) builds here, on a
stand-in for vLLM's release image made from Debian's and the package index's packages
(``deploy/images/vllm-cuda.Containerfile``; the release image's registry cannot be
reached), and holds what its build promises: vLLM 0.23.0 with every patch of the pin's
series applied (the patch tool's own status inside the image), NIXL, and our connector
registered with vLLM through the plugin entry point. There is no GPU here: nothing is
served (the CPU engine image serves in tests/e2e/test_containers.py)."""

from __future__ import annotations

import json

import pytest
from container_helpers import container_marks, images, podman

# FULL=1 only: about 11 min for the stand-in's vLLM/torch layer on a cold pip cache
# (10 GB of CUDA wheels), 1 to 2 min for the engine image on it, seconds when up to date
pytestmark = container_marks(3600, slow=True)
IMAGE = images.RECIPES["engine-cuda"][1]

#: run inside the image: vLLM's plugins loaded as vLLM loads them, then which module
#: each push connector name resolves to
REGISTERED = """
import importlib.metadata as md, json
import nixl._api  # noqa: F401  (NIXL with its UCX)
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F
names = ("NixlPushConnector", "ExtNixlPushConnector")
print(json.dumps({
    "plugins": sorted(e.value for e in md.entry_points(group="vllm.general_plugins")),
    "connectors": {n: F._registry[n]().__module__ for n in names if n in F._registry},
    "vllm": md.version("vllm"),
}))
"""


@pytest.fixture(scope="module")
def cuda_image() -> str:
    took = images.build_cuda_engine_on_stand_in()
    print(f"image builds (s): {took}")
    return f"localhost/{IMAGE}"


def test_the_cuda_engine_image_holds_vllm_with_the_pins_series_applied(cuda_image: str) -> None:
    out = podman("run", "--rm", "--entrypoint", "vllm-ext-patches", cuda_image,
                 "status", "--json", timeout=300)  # fmt: skip
    status = json.loads(out)
    assert status["kind"] == "installed package" and status["version"] == "0.23.0"
    assert status["patches"] and all(p["state"] == "applied" for p in status["patches"])
    assert status["error"] is None


def test_vllm_in_the_cuda_engine_image_loads_our_connector(cuda_image: str) -> None:
    out = podman("run", "--rm", "--entrypoint", "python3", cuda_image, "-c", REGISTERED,
                 timeout=300)  # fmt: skip
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["vllm"] == "0.23.0"
    assert any(p.startswith("vllm_ext") for p in seen["plugins"]), seen
    assert seen["connectors"] == {
        "NixlPushConnector": "vllm_ext.nixl_push.connector",
        "ExtNixlPushConnector": "vllm_ext.nixl_push.connector",
    }
