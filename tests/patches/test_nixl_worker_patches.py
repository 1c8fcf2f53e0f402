# SPDX-License-Identifier: Apache-2.0
"""Patches 0002-0004 on a real NixlConnectorWorker of the patched 0.23.0, on CPU.

The worker is vLLM's own, with its real NIXL agent (UCX): it registers the CPU
attention backend's KV caches (0003), advertises ``region_members`` in the handshake
payload (0002), and a second real NIXL agent in this process sends it every kind of
malformed notification, which its real ``_get_new_notifs`` counts and drops (0004).
Only the TP identity is stubbed (rank 0 of ``TP_SIZE``), to avoid a process group.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

import msgspec
import pytest

pytestmark = pytest.mark.integration

WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker"
ENGINE_ID = "producer-under-test"
TP_SIZE = 2
NUM_BLOCKS = 4
KNOWN_REQ = "cmpl-known-0"


@pytest.fixture
def worker(tiny_model: Path) -> Iterator:
    """A real producer-side NixlConnectorWorker with registered CPU KV caches."""
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(tiny_model), enforce_eager=True, max_model_len=512),
        cache_config=CacheConfig(block_size=128),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_producer",
            kv_buffer_device="cpu", engine_id=ENGINE_ID,
        ),
    )  # fmt: skip
    hf = vllm_config.model_config.hf_config
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)]
    heads, head_size = hf.num_key_value_heads, hf.hidden_size // hf.num_attention_heads
    spec = FullAttentionSpec(
        block_size=128, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(size=NUM_BLOCKS * spec.page_size_bytes, shared_by=[name])
            for name in layers
        ],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    shape = CPUAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, 128, heads, head_size)
    kv_caches = {name: torch.zeros(shape, dtype=torch.bfloat16) for name in layers}
    affinity = os.sched_getaffinity(0)
    with (
        set_current_vllm_config(vllm_config),
        patch(f"{WORKER_MODULE}.get_tensor_model_parallel_rank", return_value=0),
        patch(f"{WORKER_MODULE}.get_tensor_model_parallel_world_size", return_value=TP_SIZE),
    ):
        w = NixlConnectorWorker(vllm_config, ENGINE_ID, kv_cache_config)
        try:
            assert w.backend_name == "CPU_ATTN"
            w.register_kv_caches(kv_caches)
            w.test_kv_caches = kv_caches  # type: ignore[attr-defined]
            yield w
        finally:
            w.shutdown()
            os.sched_setaffinity(0, affinity)


def test_cpu_kv_cache_registers_one_region_per_layer(worker) -> None:
    caches = worker.test_kv_caches
    assert worker.num_regions == len(caches)
    assert worker.kv_caches_base_addr[ENGINE_ID][0] == [t.data_ptr() for t in caches.values()]
    page = next(iter(caches.values()))[0].nbytes
    assert worker.block_len_per_layer == [page] * len(caches)
    assert len(worker.src_blocks_data) == len(caches) * NUM_BLOCKS


def test_region_members_in_the_real_handshake_payload(worker) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlHandshakePayload,
    )

    # Encoded as the scheduler's side channel listener does, decoded as _nixl_handshake.
    wire = msgspec.msgpack.Encoder().encode(worker.xfer_handshake_metadata)
    payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(wire)
    metadata = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    assert metadata.region_members == [[name] for name in worker.test_kv_caches]
    assert len(metadata.region_members) == len(metadata.kv_caches_base_addr)
    assert metadata.attn_backend_name == "CPU_ATTN"


# Every malformed kind once (and the reason it is dropped for), with TP_SIZE = 2.
MALFORMED: list[tuple[bytes, str]] = [
    (b"", "empty"),
    (b"\xff\xfe:2", "not_utf8"),
    (KNOWN_REQ.encode(), "no_separator"),
    (b":2", "no_separator"),
    (f"{KNOWN_REQ}:two".encode(), "bad_tp_size"),
    (f"{KNOWN_REQ}:0".encode(), "bad_tp_size"),
    (f"{KNOWN_REQ}:-1".encode(), "bad_tp_size"),
    (f"{KNOWN_REQ}:3".encode(), "bad_tp_size"),
    (f"{KNOWN_REQ}:{'9' * 5000}".encode(), "bad_tp_size"),
    (b"cmpl-unknown-1:2", "unknown_request"),
]


@dataclass
class Sender:
    agent: object
    remote: str

    def send(self, *notifs: bytes) -> None:
        for notif in notifs:
            self.agent.send_notif(self.remote, notif)  # type: ignore[attr-defined]


@pytest.fixture
def sender(worker) -> Iterator[Sender]:
    """A second real NIXL agent that knows the worker's agent from its handshake."""
    from nixl._api import nixl_agent, nixl_agent_config
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

    metadata = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(
        worker.xfer_handshake_metadata.agent_metadata_bytes
    )
    agent = nixl_agent("malformed-notif-sender", nixl_agent_config(backends=["UCX"]))
    remote = agent.add_remote_agent(metadata.agent_metadata)
    try:
        yield Sender(agent, remote)
    finally:
        agent.remove_remote_agent(remote)


def _drain(worker, n_dropped: int, timeout_s: float = 20.0) -> set[str]:
    """Call the worker's real _get_new_notifs until ``n_dropped`` drops were counted."""
    done: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done |= worker._get_new_notifs()
        if sum(worker.num_dropped_notifs.values()) >= n_dropped:
            return done | worker._get_new_notifs()
        time.sleep(0.02)
    raise AssertionError(f"only {dict(worker.num_dropped_notifs)} arrived")


def test_malformed_notifications_over_ucx_are_counted_and_dropped(worker, sender) -> None:
    # A finished request whose blocks wait for 2 decode ranks (D TP 4 > P TP 2).
    worker._reqs_to_process.add(KNOWN_REQ)
    worker._reqs_to_send[KNOWN_REQ] = time.perf_counter() + 300

    sender.send(*(n for n, _ in MALFORMED), f"{KNOWN_REQ}:4".encode())
    assert _drain(worker, len(MALFORMED)) == set()
    expected: dict[str, int] = {}
    for _, reason in MALFORMED:
        expected[reason] = expected.get(reason, 0) + 1
    assert dict(worker.num_dropped_notifs) == expected
    assert worker.xfer_stats.data["num_dropped_notifications"] == [1] * len(MALFORMED)
    assert worker.consumer_notification_counts_by_req[KNOWN_REQ] == 1  # valid one counted

    # The worker keeps working: the second consumer's notification completes the send.
    sender.send(*(n for n, _ in MALFORMED), f"{KNOWN_REQ}:4".encode())
    assert _drain(worker, 2 * len(MALFORMED)) == {KNOWN_REQ}
    assert KNOWN_REQ not in worker._reqs_to_send and KNOWN_REQ not in worker._reqs_to_process
    done, _ = worker.get_finished()  # the engine's own entry point still runs cleanly
    assert done == set()
