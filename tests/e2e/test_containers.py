# SPDX-License-Identifier: Apache-2.0
"""The images run the way they are deployed: P, D and the proxy as three podman
containers (``vllm-ext-engine:0.32.0-cpu``, ``vllm-ext-proxy:0.1.0``, built here by
``tools/images.py`` from a Debian base) on one container network, the side channel and
UCX on the containers' own addresses; the proxy with two workers (``--workers 2``) on a
read-only root file system, as the manifests' securityContext runs it. Requests through
the proxy answer what one engine of the same image answers.

Runs only where podman can run containers (``tools/images.py``'s check). The images are
built (or found up to date in podman's layer cache) by the module's fixture."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from container_helpers import PROXY_WORKERS, ContainerPD, container_marks, ensure_images
from pd_helpers import metric, run_all, scrape_metrics

# FULL=1 only: 3 to 5.5 min here with the images up to date (3 min 45 s and 5 min 18 s
# in the last two runs), 3 to 8 more to build the engine image's vLLM layer anew (its
# times in docs/deploy.md, Images)
pytestmark = container_marks(3600, slow=True)


@pytest.fixture(scope="module")
def container_pd(tiny_model: Path, tmp_path_factory) -> Iterator[ContainerPD]:
    ensure_images()
    pd = ContainerPD(tiny_model, tmp_path_factory.mktemp("containers"))
    try:
        pd.start()
        waited = pd.wait_ready()
        print(f"containers ready in {waited:.0f} s")
        yield pd
    finally:
        pd.stop()


def test_push_through_the_proxy_container_equals_one_engine(
    container_pd: ContainerPD, prompts: list[list[int]]
) -> None:
    t0 = time.monotonic()
    reference = run_all(container_pd.single.url, prompts, concurrency=1)
    assert run_all(container_pd.proxy.url, prompts, concurrency=1) == reference
    assert run_all(container_pd.proxy.url, prompts, concurrency=4) == reference
    # the KV crossed between the containers over NIXL: a WRITE per request (a prompt
    # shorter than a block has none to send) and its bytes
    p = scrape_metrics(container_pd.p.url)
    assert metric(p, "vllm:ext_push_writes_total") >= len(prompts) - 1
    assert metric(p, "vllm:ext_push_bytes_total") > 0
    assert metric(p, "vllm:ext_push_failures_total") == 0
    print(f"requests took {time.monotonic() - t0:.0f} s")


def test_every_worker_of_the_proxy_container_answers(container_pd: ContainerPD) -> None:
    """``--workers`` in the image, on a read-only root file system (as the manifests'
    securityContext has it) with a writable /tmp: each worker answers on the one port
    (the kernel spreads new connections over them)."""
    seen = set()
    for _ in range(100):
        with urllib.request.urlopen(f"{container_pd.proxy.url}/health", timeout=10) as r:
            worker = json.load(r)["worker"]
        assert worker["workers"] == PROXY_WORKERS
        seen.add(worker["index"])
        if len(seen) == PROXY_WORKERS:
            break
    assert seen == set(range(PROXY_WORKERS))
