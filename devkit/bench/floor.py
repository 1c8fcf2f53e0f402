# SPDX-License-Identifier: Apache-2.0
"""The physical floor of the KV hand-off on this machine, for each prompt length.

(a) memcpy: one torch copy (one thread) of the request's KV bytes, best of N (the
    same buffers each time: cache-warm, a lower bound).
(b) raw NIXL: a WRITE of the same descriptors our connector builds (one per KV
    region per contiguous run: 4 layer regions x blocks of 128 tokens x
    512 B/token/layer for the tiny model) from one process to another, with one
    notification attached, timed from the post (``initialize_xfer``) to the
    notification's arrival at the target. Two ``nixl_agent``s over UCX in separate
    processes, DRAM torch tensors, metadata exchanged over a pipe, both agents with
    the NIXL/UCX settings our connector uses (``nixl_progress_delay_us``=100,
    ``ucx_use_mt_mutex``). Both sides poll without sleeping (yielding the core
    between polls) and nothing else runs: the best case. ``cpus`` pins the two
    processes to the engines' cores (P's 0, D's 1), each poll loop then shares its
    core with its own NIXL progress thread; the runner measures pinned and free
    and the report uses the lower. Two memory states: the same blocks every
    repeat (cache-hot: the strict floor), and fresh blocks every repeat with the
    source just written (as a request's KV right after its forward pass, into D
    blocks nobody touched lately: what a real hand-off moves).

``python -m devkit.bench.floor --input-lens 256 1024 2048`` prints the table.

**On GPUs** (``--device cuda``, :func:`measure_device`): the same bytes as a real
model's request (Qwen3-8B shapes: 16-token blocks of 64 KiB per layer) between two
processes, one per GPU (``CUDA_VISIBLE_DEVICES`` 0 and 1, as P and D get them),
``nixl_agent``s over UCX on VRAM, metadata over a pipe, timed from the post
(``transfer()``) to the notification's arrival at the target, with the descriptor
preparation (``get_xfer_descs`` + ``initialize_xfer``) timed apart. For each input
length, each KV layout (:data:`LAYOUTS`: one region per layer, per layer and K/V as
vLLM registers FLASH_ATTN caches, or one cross-layer region) and each placement of
the blocks (contiguous: the run merges into one descriptor per region; scattered: a
random pick of free blocks on each side, as a loaded engine's free list hands out,
one descriptor per block and region), plus one descriptor of all the bytes and a
torch peer copy (cuda:0 -> cuda:1) of them. The same code runs on DRAM
(``--device cpu --layouts ...``), which is how the tests check it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_ext.nixl_push.descriptors import Desc, RegionLayout, build_write_descs

BLOCK_TOKENS = 128  # vLLM's CPU block size
DEFAULT_DELAY_US = 100  # PushConfig.nixl_progress_delay_us


def kv_geometry() -> tuple[int, int]:
    """(regions, bytes per token per region) of the tiny model: one region per layer
    holding K and V (the CPU backend's 4-D per-layer tensor)."""
    from devkit.testing.tiny_model import TinyModelSpec

    s = TinyModelSpec()
    head_dim = s.hidden_size // s.num_attention_heads
    dtype_bytes = 2 if s.dtype in ("bfloat16", "float16") else 4
    return s.num_hidden_layers, 2 * s.num_key_value_heads * head_dim * dtype_bytes


def blocks_for(input_len: int) -> int:
    return math.ceil(input_len / BLOCK_TOKENS)


def kv_bytes(input_len: int) -> int:
    """KV bytes one request of ``input_len`` prompt tokens moves (whole blocks)."""
    regions, per_token = kv_geometry()
    return blocks_for(input_len) * BLOCK_TOKENS * per_token * regions


def _make_agent(name: str, delay_us: int | None, mt_mutex: bool = True) -> Any:
    """A raw ``nixl_agent`` with the NIXL/UCX settings of PushConfig's defaults."""
    from nixl._api import nixl_agent, nixl_agent_config

    from vllm_ext import compat

    with compat.tuned_nixl_agents(delay_us, mt_mutex, agent_cls=nixl_agent):
        return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _regions(n_regions: int, nbytes: int, fill: int) -> list[Any]:
    import torch

    return [torch.full((nbytes,), (fill + i) % 251, dtype=torch.uint8) for i in range(n_regions)]


def _register(agent: Any, tensors: list[Any]) -> Any:
    descs = [(t.data_ptr(), t.numel(), 0, "") for t in tensors]
    reg = agent.get_reg_descs(descs, "DRAM")
    agent.register_memory(reg)
    return reg


def _pin(cpu: int | None) -> None:
    import os

    if cpu is not None and hasattr(os, "sched_setaffinity") and cpu in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {cpu})


def _target_main(
    conn: Any, n_regions: int, region_bytes: int, delay_us: int | None, cpu: int | None
) -> None:
    """The receiving process: registers its regions, reports notification arrivals."""
    import os

    _pin(cpu)
    agent = _make_agent("floor-target", delay_us)
    tensors = _regions(n_regions, region_bytes, fill=0)
    _register(agent, tensors)
    conn.send(("meta", agent.get_agent_metadata(), [t.data_ptr() for t in tensors]))
    kind, peer_meta = conn.recv()
    agent.add_remote_agent(peer_meta)
    conn.send(("ready",))
    while True:
        for msgs in agent.get_new_notifs().values():
            for m in msgs:
                conn.send(("notif", bytes(m), time.monotonic()))
        os.sched_yield()  # busy-poll, but let this core's NIXL progress thread run
        if conn.poll(0):
            msg = conn.recv()
            if msg[0] == "stop":
                conn.send(("check", [int(t[: msg[1]].sum()) for t in tensors]))
                return


def memcpy_seconds(nbytes: int, repeats: int = 20) -> float:
    """Best time of one single-threaded torch copy of ``nbytes``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return best
    finally:
        torch.set_num_threads(threads)


def measure(
    input_lens: list[int],
    repeats: int = 20,
    warmup: int = 3,
    delay_us: int | None = DEFAULT_DELAY_US,
    progress: Any = None,
    cpus: tuple[int | None, int | None] = (0, 1),
) -> list[dict[str, Any]]:
    """The floor per input length (seconds; see the module docstring).

    ``cpus``: the cores of the initiator (P) and the target (D) process, as the
    launcher gives them to the engines (None: unpinned).
    """
    import multiprocessing as mp
    import os

    say = progress or (lambda msg: None)
    n_regions, per_token = kv_geometry()
    block_len = BLOCK_TOKENS * per_token
    max_blocks = max(blocks_for(n) for n in input_lens)
    # room for a fresh run of blocks per repeat (the "fresh" variant)
    pool_blocks = max_blocks * (warmup + repeats + 1)
    region_bytes = pool_blocks * block_len
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(
        target=_target_main,
        args=(child_conn, n_regions, region_bytes, delay_us, cpus[1]),
        daemon=True,
    )
    proc.start()
    affinity = os.sched_getaffinity(0)
    agent = None
    try:
        _pin(cpus[0])  # this thread, and the NIXL threads the agent starts
        agent = _make_agent("floor-initiator", delay_us)
        tensors = _regions(n_regions, region_bytes, fill=7)
        _register(agent, tensors)
        if not conn.poll(120):
            raise RuntimeError("floor: the target process did not start")
        _, target_meta, target_addrs = conn.recv()
        remote = agent.add_remote_agent(target_meta)
        conn.send(("meta", agent.get_agent_metadata()))
        conn.recv()  # ready
        local_layout = RegionLayout(
            tuple(t.data_ptr() for t in tensors), (block_len,) * n_regions, pool_blocks, 0,
            BLOCK_TOKENS,
        )  # fmt: skip
        remote_layout = RegionLayout(
            tuple(target_addrs), (block_len,) * n_regions, pool_blocks, 0, BLOCK_TOKENS
        )
        rows = []
        for n in input_lens:
            nb = blocks_for(n)
            src, dst = build_write_descs(local_layout, remote_layout, range(nb), range(nb))
            to_notif, to_done, post, fresh = [], [], [], []
            for i in range(2 * (warmup + repeats)):
                notif = f"floor:{n}:{i}".encode()
                k = i - (warmup + repeats)  # >= 0: the fresh-blocks pass
                if k >= 0:
                    first = (k + 1) * max_blocks  # block 0.. stays for the data check
                    blocks = range(first, first + nb)
                    src, dst = build_write_descs(local_layout, remote_layout, blocks, blocks)
                    for t in tensors:  # the forward pass just wrote the source
                        t[first * block_len : (first + nb) * block_len].add_(1)
                t0 = time.monotonic()
                handle = agent.initialize_xfer(
                    "WRITE",
                    agent.get_xfer_descs(src, "DRAM"),
                    agent.get_xfer_descs(dst, "DRAM"),
                    remote,
                    notif,
                )
                if agent.transfer(handle) == "ERR":
                    raise RuntimeError("floor: NIXL transfer() returned ERR")
                t_post = time.monotonic()
                while (state := agent.check_xfer_state(handle)) == "PROC":
                    os.sched_yield()  # let this core's NIXL progress thread run
                t_done = time.monotonic()
                agent.release_xfer_handle(handle)
                if state != "DONE":
                    raise RuntimeError(f"floor: WRITE ended {state}")
                while True:
                    kind, msg, t_notif = conn.recv()
                    if msg == notif:
                        break
                if k >= warmup:
                    fresh.append(t_notif - t0)
                elif warmup <= i < warmup + repeats:
                    to_notif.append(t_notif - t0)
                    to_done.append(t_done - t0)
                    post.append(t_post - t0)
            nbytes = sum(d[1] for d in src)
            mc = memcpy_seconds(nbytes)
            row = {
                "input_len": n,
                "blocks": nb,
                "bytes": nbytes,
                "descriptors": len(src),
                "memcpy_s": mc,
                "memcpy_gbps": nbytes / mc / 1e9,
                "nixl_write_notif_p50_s": statistics.median(to_notif),
                "nixl_write_notif_min_s": min(to_notif),
                "nixl_write_done_p50_s": statistics.median(to_done),
                "nixl_post_p50_s": statistics.median(post),
                "nixl_write_notif_fresh_p50_s": statistics.median(fresh),
                "repeats": repeats,
                "progress_delay_us": delay_us,
                "cpus": list(cpus),
            }
            rows.append(row)
            where = "free cores" if cpus == (None, None) else f"cores {cpus[0]}/{cpus[1]}"
            say(
                f"floor in={n} ({where}): {nbytes / 2**20:.2f} MiB in {len(src)} descriptors: "
                f"memcpy {mc * 1e3:.3f} ms, NIXL WRITE+notif p50 "
                f"{row['nixl_write_notif_p50_s'] * 1e3:.3f} ms (same blocks), "
                f"{row['nixl_write_notif_fresh_p50_s'] * 1e3:.3f} ms (fresh blocks)"
            )
        check_len = min(region_bytes, 4096)
        conn.send(("stop", check_len))
        _, sums = conn.recv()
        expected = [int(t[:check_len].sum()) for t in tensors]
        if sums != expected:
            raise RuntimeError(f"floor: data check failed ({sums} != {expected})")
        return rows
    finally:
        del agent
        os.sched_setaffinity(0, affinity)
        proc.join(10)
        if proc.is_alive():
            proc.kill()


# -- on GPUs (and the same code on DRAM): layouts, placements, one process per device ------

#: KV layouts of one request's blocks: regions x bytes of one block in a region.
#: ``per-layer``: one region per layer holding K and V; ``kv-split``: K and V of each
#: layer apart (how vLLM registers FLASH_ATTN caches with NIXL); ``cross-layer``: one
#: region whose blocks hold every layer (vLLM's cross-layer KV blocks).
LAYOUTS = ("per-layer", "kv-split", "cross-layer")
#: ``contiguous``: blocks 0..n-1 on both sides; ``scattered``: a random pick of blocks
#: on each side (a loaded engine's free list), a new pick every repeat.
PLACEMENTS = ("contiguous", "scattered")
GPU_BLOCK_TOKENS = 16  # vLLM's block size on CUDA


@dataclasses.dataclass(frozen=True)
class KvGeometry:
    """A model's KV on one engine rank."""

    layers: int
    bytes_per_token_layer: int  # K and V of one layer, all KV heads
    block_tokens: int

    @classmethod
    def of_shape(cls, spec: Any, block_tokens: int = GPU_BLOCK_TOKENS) -> KvGeometry:
        """From a :class:`~devkit.testing.shaped_model.ShapedModelSpec`."""
        return cls(spec.num_hidden_layers, spec.kv_bytes_per_token_layer(), block_tokens)

    @property
    def bytes_per_block(self) -> int:
        """One block of every layer."""
        return self.layers * self.block_tokens * self.bytes_per_token_layer

    def blocks_for(self, input_len: int) -> int:
        return math.ceil(input_len / self.block_tokens)

    def regions(self, layout: str) -> tuple[int, int]:
        """``(regions, bytes of one block in one region)`` of ``layout``."""
        per_layer = self.block_tokens * self.bytes_per_token_layer
        if layout == "per-layer":
            return self.layers, per_layer
        if layout == "kv-split":
            return 2 * self.layers, per_layer // 2
        if layout == "cross-layer":
            return 1, self.layers * per_layer
        raise ValueError(f"unknown KV layout {layout!r}; known: {', '.join(LAYOUTS)}")


def _qwen3_8b_geometry() -> KvGeometry:
    from devkit.testing.shaped_model import QWEN3_8B

    return KvGeometry.of_shape(QWEN3_8B)


@dataclasses.dataclass(frozen=True)
class FloorCase:
    input_len: int
    layout: str
    placement: str
    regions: int
    block_bytes: int  # one block in one region
    blocks: int

    @property
    def bytes(self) -> int:
        return self.regions * self.block_bytes * self.blocks

    @property
    def max_descriptors(self) -> int:
        """Descriptors per WRITE: one per region and run (contiguous: one run)."""
        return self.regions * (1 if self.placement == "contiguous" else self.blocks)

    @property
    def key(self) -> str:
        return f"in{self.input_len}-{self.layout}-{self.placement}"


@dataclasses.dataclass
class DeviceFloorConfig:
    """What :func:`measure_device` measures, and where."""

    device: str = "cuda"  # "cuda" (VRAM, one GPU per process) or "cpu" (DRAM)
    input_lens: list[int] = dataclasses.field(default_factory=lambda: [2048, 8192, 16384])
    geometry: KvGeometry = dataclasses.field(default_factory=_qwen3_8b_geometry)
    layouts: list[str] = dataclasses.field(default_factory=lambda: list(LAYOUTS))
    placements: list[str] = dataclasses.field(default_factory=lambda: list(PLACEMENTS))
    repeats: int = 10
    warmup: int = 2
    #: ``CUDA_VISIBLE_DEVICES`` of the initiator (P) and the target (D)
    gpus: tuple[str, str] = ("0", "1")
    #: ``own``: each process sees only its GPU (as P and D do); ``both``: each sees both
    #: and uses its own by index (a fallback if UCX needs the peer GPU visible)
    visible: str = "own"
    #: NIXL progress-thread delay and UCX mutex (the connector's defaults for the device)
    delay_us: int | None = DEFAULT_DELAY_US
    mt_mutex: bool = True
    #: blocks in each side's pool = pool_factor x the largest request (room to scatter)
    pool_factor: int = 2
    seed: int = 0
    peer_copy: bool = True
    #: seconds for the processes to start and register (CUDA init, UCX)
    start_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device {self.device!r}: cuda or cpu")
        if self.visible not in ("own", "both"):
            raise ValueError(f"visible {self.visible!r}: own or both")
        for layout in self.layouts:
            self.geometry.regions(layout)
        unknown = set(self.placements) - set(PLACEMENTS)
        if unknown:
            raise ValueError(f"unknown placement(s) {sorted(unknown)}; known: {PLACEMENTS}")

    @property
    def mem_type(self) -> str:
        return "VRAM" if self.device == "cuda" else "DRAM"

    @property
    def pool_blocks(self) -> int:
        """Blocks per side; block 0 is kept for the contiguous runs' data check."""
        return self.pool_factor * max(self.geometry.blocks_for(n) for n in self.input_lens) + 1

    @property
    def buffer_bytes(self) -> int:
        """One buffer per side, carved into each layout's regions in turn."""
        return self.pool_blocks * self.geometry.bytes_per_block

    def env(self, side: str) -> dict[str, str]:
        """The environment of a floor process: ``initiator``, ``target`` or ``copy``."""
        if self.device != "cuda":
            return {}
        from devkit.launch.gpu import gpu_env

        both = ",".join(dict.fromkeys(self.gpus))  # one GPU shared: "0", not "0,0"
        if self.visible == "both":
            return gpu_env(both)
        return gpu_env({"initiator": self.gpus[0], "target": self.gpus[1]}.get(side, both))

    def device_index(self, side: str) -> int:
        """The CUDA device index of ``side``'s buffer inside its process."""
        if self.device != "cuda" or self.visible == "own" or self.gpus[0] == self.gpus[1]:
            return 0
        return 0 if side == "initiator" else 1


def config_to_json(cfg: DeviceFloorConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_json(data: dict[str, Any]) -> DeviceFloorConfig:
    data = dict(data)
    data["geometry"] = KvGeometry(**data["geometry"])
    data["gpus"] = tuple(data["gpus"])
    return DeviceFloorConfig(**data)


def plan(cfg: DeviceFloorConfig) -> list[FloorCase]:
    """Every case in run order: per input length, one descriptor of all the bytes
    (cross-layer, contiguous) first, then each layout x placement."""
    g = cfg.geometry
    cases: list[FloorCase] = []
    for n in cfg.input_lens:
        combos = [("cross-layer", "contiguous")]
        combos += [(lay, pl) for lay in cfg.layouts for pl in cfg.placements]
        for layout, placement in dict.fromkeys(combos):
            regions, block_bytes = g.regions(layout)
            cases.append(FloorCase(n, layout, placement, regions, block_bytes, g.blocks_for(n)))
    return cases


def case_blocks(
    case: FloorCase, pool_blocks: int, rng: random.Random
) -> tuple[list[int], list[int]]:
    """Source and destination block ids of one WRITE of ``case``."""
    if case.placement == "contiguous":
        ids = list(range(case.blocks))
        return ids, ids
    free = range(1, pool_blocks)  # block 0: the contiguous runs' data check
    return rng.sample(free, case.blocks), rng.sample(free, case.blocks)


def case_layout(case: FloorCase, base: int, pool_blocks: int, device_id: int) -> RegionLayout:
    """``case``'s regions carved out of one side's buffer at ``base``."""
    stride = pool_blocks * case.block_bytes
    return RegionLayout(
        tuple(base + i * stride for i in range(case.regions)),
        (case.block_bytes,) * case.regions,
        pool_blocks,
        device_id,
        1,
    )


@contextlib.contextmanager
def _environ(update: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``update`` while a child process is spawned (it inherits it)."""
    saved = {k: os.environ.get(k) for k in update}
    os.environ.update(update)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _device_buffer(cfg: DeviceFloorConfig, fill: int, side: str) -> Any:
    import torch

    dev = f"cuda:{cfg.device_index(side)}" if cfg.device == "cuda" else "cpu"
    if cfg.device == "cuda":
        torch.cuda.set_device(dev)
    buf = torch.full((cfg.buffer_bytes,), fill, dtype=torch.uint8, device=dev)
    if cfg.device == "cuda":
        torch.cuda.synchronize()
    return buf


def _register_buffer(agent: Any, buf: Any, cfg: DeviceFloorConfig, side: str) -> None:
    dev_id = cfg.device_index(side)
    reg = agent.get_reg_descs([(buf.data_ptr(), buf.numel(), dev_id, "")], cfg.mem_type)
    agent.register_memory(reg)


def _device_target_main(conn: Any, cfg: DeviceFloorConfig) -> None:
    """The receiving process (D's GPU): reports notification arrivals, sums ranges."""
    # the CUDA context first, then the agent (as in a vLLM worker: UCX's CUDA
    # transports see the context the process uses)
    buf = _device_buffer(cfg, 0, "target")
    agent = _make_agent("floor-target", cfg.delay_us, cfg.mt_mutex)
    _register_buffer(agent, buf, cfg, "target")
    conn.send(("meta", agent.get_agent_metadata(), buf.data_ptr()))
    _, peer_meta = conn.recv()
    agent.add_remote_agent(peer_meta)
    conn.send(("ready",))
    while True:
        for msgs in agent.get_new_notifs().values():
            for m in msgs:
                conn.send(("notif", bytes(m), time.monotonic()))
        os.sched_yield()
        if conn.poll(0):
            msg = conn.recv()
            if msg[0] == "sums":
                base = buf.data_ptr()
                conn.send(("sums", [int(buf[a - base : a - base + n].sum()) for a, n in msg[1]]))
            elif msg[0] == "stop":
                conn.send(("stopped",))
                return


def _timed_write(
    agent: Any,
    remote: str,
    target: Any,
    case: FloorCase,
    layouts: tuple[RegionLayout, RegionLayout],
    blocks: tuple[list[int], list[int]],
    notif: bytes,
    mem_type: str,
) -> tuple[dict[str, float], list[Desc], list[Desc]]:
    """One WRITE with its notification: build -> prepare -> post -> DONE / notif seen."""
    t0 = time.monotonic()
    src, dst = build_write_descs(layouts[0], layouts[1], blocks[0], blocks[1])
    t_built = time.monotonic()
    handle = agent.initialize_xfer(
        "WRITE",
        agent.get_xfer_descs(src, mem_type),
        agent.get_xfer_descs(dst, mem_type),
        remote,
        notif,
    )
    t_post = time.monotonic()
    if agent.transfer(handle) == "ERR":
        raise RuntimeError(f"floor {case.key}: NIXL transfer() returned ERR")
    t_posted = time.monotonic()
    while (state := agent.check_xfer_state(handle)) == "PROC":
        os.sched_yield()
    t_done = time.monotonic()
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"floor {case.key}: WRITE ended {state}")
    while True:
        _, msg, t_notif = target.recv()
        if msg == notif:
            break
    times = {
        "build_s": t_built - t0,
        "prep_s": t_post - t_built,
        "post_s": t_posted - t_post,
        "done_s": t_done - t_post,
        "notif_s": t_notif - t_post,
    }
    return times, src, dst


def _sums(target: Any, ranges: list[tuple[int, int]]) -> list[int]:
    target.send(("sums", ranges))
    while True:
        msg = target.recv()
        if msg[0] == "sums":
            return list(msg[1])


def _device_initiator_main(parent: Any, target: Any, cfg: DeviceFloorConfig) -> None:
    """P's side: runs every case of :func:`plan`, sends one row per case to ``parent``."""
    import torch

    buf = _device_buffer(cfg, 7, "initiator")
    agent = _make_agent("floor-initiator", cfg.delay_us, cfg.mt_mutex)
    _register_buffer(agent, buf, cfg, "initiator")
    _, target_meta, target_base = target.recv()
    remote = agent.add_remote_agent(target_meta)
    target.send(("meta", agent.get_agent_metadata()))
    target.recv()  # ready
    parent.send(("ready",))
    base = buf.data_ptr()
    rng = random.Random(cfg.seed)
    for i, case in enumerate(plan(cfg)):
        layouts = (
            case_layout(case, base, cfg.pool_blocks, cfg.device_index("initiator")),
            case_layout(case, target_base, cfg.pool_blocks, cfg.device_index("target")),
        )
        samples: dict[str, list[float]] = {}
        descs = 0
        for r in range(cfg.warmup + cfg.repeats):
            blocks = case_blocks(case, cfg.pool_blocks, rng)
            notif = f"floor:{i}:{r}".encode()
            times, src, _ = _timed_write(
                agent, remote, target, case, layouts, blocks, notif, cfg.mem_type
            )
            descs = len(src)
            if r >= cfg.warmup:
                for k, v in times.items():
                    samples.setdefault(k, []).append(v)
        # data check: mark the first and last source ranges, WRITE once more, compare
        blocks = case_blocks(case, cfg.pool_blocks, rng)
        src, dst = build_write_descs(layouts[0], layouts[1], blocks[0], blocks[1])
        marks = [(src[0], dst[0]), (src[-1], dst[-1])]
        value = i % 200 + 20  # never the fills (7 and 0), one per case
        for (addr, length, _), _d in marks:
            buf[addr - base : addr - base + min(length, 4096)].fill_(value)
        if cfg.device == "cuda":
            torch.cuda.synchronize()
        _timed_write(
            agent, remote, target, case, layouts, blocks, f"floor:{i}:check".encode(),
            cfg.mem_type,
        )  # fmt: skip
        got = _sums(target, [(d[0], min(d[1], 4096)) for _, d in marks])
        expected = [value * min(d[1], 4096) for _, d in marks]
        row: dict[str, Any] = {
            "device": cfg.device,
            "input_len": case.input_len,
            "layout": case.layout,
            "placement": case.placement,
            "regions": case.regions,
            "block_bytes": case.block_bytes,
            "blocks": case.blocks,
            "bytes": case.bytes,
            "descriptors": descs,
            "repeats": cfg.repeats,
            "data_ok": got == expected,
        }
        for k, xs in samples.items():
            row[k.removesuffix("_s") + "_p50_s"] = statistics.median(xs)
        row["notif_min_s"] = min(samples["notif_s"])
        row["gbps"] = case.bytes / row["notif_p50_s"] / 1e9
        parent.send(("row", row))
    target.send(("stop",))
    parent.send(("done",))
    del agent


def _peer_copy_main(conn: Any, cfg: DeviceFloorConfig) -> None:
    """A torch copy of each request's bytes: cuda:0 -> cuda:1 (both GPUs visible), or a
    single-threaded DRAM copy on CPU."""
    import torch

    rows = []
    for n in cfg.input_lens:
        nbytes = cfg.geometry.blocks_for(n) * cfg.geometry.bytes_per_block
        if cfg.device == "cuda":
            # P's and D's GPU (the same one when they share it)
            dst_dev = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
            src = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda:0")
            dst = torch.empty((nbytes,), dtype=torch.uint8, device=dst_dev)
            times = []
            for r in range(cfg.warmup + cfg.repeats):
                torch.cuda.synchronize("cuda:0")
                torch.cuda.synchronize(dst_dev)
                t0 = time.perf_counter()
                dst.copy_(src)
                torch.cuda.synchronize(dst_dev)
                torch.cuda.synchronize("cuda:0")
                if r >= cfg.warmup:
                    times.append(time.perf_counter() - t0)
            ok = int(dst[:4096].sum()) == 7 * 4096
            del src, dst
            torch.cuda.empty_cache()
            p50, best = statistics.median(times), min(times)
        else:
            best = p50 = memcpy_seconds(nbytes, cfg.repeats)
            ok = True
        rows.append({
            "input_len": n, "bytes": nbytes, "copy_p50_s": p50, "copy_min_s": best,
            "gbps": nbytes / p50 / 1e9, "data_ok": ok,
            "kind": f"torch copy cuda:0->{dst_dev}" if cfg.device == "cuda" else "memcpy",
        })  # fmt: skip
    conn.send(("rows", rows))


def measure_device(
    cfg: DeviceFloorConfig, progress: Any = None, checkpoint: Any = None
) -> dict[str, Any]:
    """The floor of every case of :func:`plan` (and the peer copy), one process per side.

    Returns ``{"config": ..., "cases": [row...], "peer_copy": [row...]}``; rows come in
    as they are measured, so a failure later keeps the earlier ones (``"error"``);
    ``checkpoint(result)`` is called after each.
    """
    import multiprocessing as mp

    say = progress or (lambda msg: None)
    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {
        "config": {
            **{k: v for k, v in dataclasses.asdict(cfg).items() if k != "geometry"},
            "geometry": dataclasses.asdict(cfg.geometry),
            "mem_type": cfg.mem_type,
            "pool_blocks": cfg.pool_blocks,
            "buffer_gib": cfg.buffer_bytes / 2**30,
        },
        "cases": [],
        "peer_copy": [],
    }
    cases = plan(cfg)
    say(
        f"floor ({cfg.device}): {len(cases)} cases x {cfg.warmup}+{cfg.repeats} WRITEs, "
        f"{cfg.buffer_bytes / 2**30:.1f} GiB per side"
    )
    t_conn, t_child = ctx.Pipe()
    p_conn, p_child = ctx.Pipe()
    procs = []
    try:
        with _environ(cfg.env("target")):
            target = ctx.Process(target=_device_target_main, args=(t_child, cfg), daemon=True)
            target.start()
        procs.append(target)
        with _environ(cfg.env("initiator")):
            init = ctx.Process(
                target=_device_initiator_main, args=(p_child, t_conn, cfg), daemon=True
            )
            init.start()
        procs.append(init)
        if not p_conn.poll(cfg.start_timeout_s):
            raise RuntimeError(f"floor: the NIXL processes did not start in {cfg.start_timeout_s}s")
        p_conn.recv()  # ready
        while True:
            if not p_conn.poll(600):
                raise RuntimeError("floor: no result for 600 s")
            msg = p_conn.recv()
            if msg[0] == "done":
                break
            row = msg[1]
            out["cases"].append(row)
            if checkpoint:
                checkpoint(out)
            say(
                f"floor in={row['input_len']} {row['layout']}/{row['placement']}: "
                f"{row['bytes'] / 2**20:.1f} MiB in {row['descriptors']} descriptors: "
                f"post -> notif p50 {row['notif_p50_s'] * 1e3:.3f} ms "
                f"({row['gbps']:.0f} GB/s), prep {row['prep_p50_s'] * 1e3:.2f} ms"
                + ("" if row["data_ok"] else ", DATA CHECK FAILED")
            )
        if cfg.peer_copy:
            c_conn, c_child = ctx.Pipe()
            with _environ(cfg.env("copy")):
                cp = ctx.Process(target=_peer_copy_main, args=(c_child, cfg), daemon=True)
                cp.start()
            procs.append(cp)
            if not c_conn.poll(cfg.start_timeout_s + 120):
                raise RuntimeError("floor: the copy process gave no result")
            out["peer_copy"] = c_conn.recv()[1]
            for row in out["peer_copy"]:
                say(
                    f"floor in={row['input_len']} {row['kind']}: {row['bytes'] / 2**20:.1f} MiB "
                    f"p50 {row['copy_p50_s'] * 1e3:.3f} ms ({row['gbps']:.0f} GB/s)"
                )
    except (Exception, KeyboardInterrupt) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        say(f"floor failed: {out['error']}")
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        bad = [p.exitcode for p in procs if p.exitcode not in (0, None)]
        if bad and "error" not in out:
            out["error"] = f"floor process exit codes {bad}"
    return out


def device_floor_by_len(floor: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per input length: ``one_desc`` (cross-layer contiguous), ``best`` (the lowest
    post -> notif p50 of any case), ``copy`` (the peer copy), each in seconds."""
    out: dict[int, dict[str, Any]] = {}
    for row in floor.get("cases") or []:
        d = out.setdefault(row["input_len"], {"bytes": row["bytes"]})
        t = row["notif_p50_s"]
        if row["layout"] == "cross-layer" and row["placement"] == "contiguous":
            d["one_desc"] = t
        d["best"] = min(d.get("best", t), t)
        d[f"{row['layout']}/{row['placement']}"] = t
        d[f"{row['layout']}/{row['placement']}:descriptors"] = row["descriptors"]
    for row in floor.get("peer_copy") or []:
        out.setdefault(row["input_len"], {"bytes": row["bytes"]})["copy"] = row["copy_p50_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--input-lens", type=int, nargs="+", help="default: CPU 256 1024 2048, "
                    "cuda 2048 8192 16384")  # fmt: skip
    ap.add_argument("--repeats", type=int, help="default: CPU 20, cuda 10")
    ap.add_argument("--delay-us", type=int, default=DEFAULT_DELAY_US, help="-1: NIXL's (0)")
    ap.add_argument("--no-pin", action="store_true", help="CPU: do not pin to cores 0 and 1")
    g = ap.add_argument_group("layouts (--device cuda, or --device cpu with --layouts: DRAM)")
    g.add_argument("--layouts", nargs="+", choices=LAYOUTS)
    g.add_argument("--placements", nargs="+", choices=PLACEMENTS, default=list(PLACEMENTS))
    g.add_argument("--gpus", default="0,1", help="CUDA_VISIBLE_DEVICES of P's and D's process")
    g.add_argument(
        "--visible", choices=["own", "both"], default="own",
        help="own: each process sees its GPU only (as the engines); both: both GPUs",
    )  # fmt: skip
    g.add_argument(
        "--mt-mutex", choices=["auto", "on", "off"], default="auto",
        help="UCX_USE_MT_MUTEX (auto: the connector's default for the device)",
    )  # fmt: skip
    g.add_argument("--no-peer-copy", action="store_true")
    g.add_argument("--plan", action="store_true", help="print the cases and exit")
    ap.add_argument("--json-out", type=Path, help="write the result JSON here (after each case)")
    ap.add_argument("--config-json", type=Path, help="a DeviceFloorConfig as JSON (the runner's)")
    args = ap.parse_args(argv)
    if args.config_json:
        return _run_device(config_from_json(json.loads(args.config_json.read_text())), args)
    delay = None if args.delay_us < 0 else args.delay_us
    if args.device == "cpu" and not args.layouts:
        rows = measure(
            args.input_lens or [256, 1024, 2048], args.repeats or 20, delay_us=delay,
            progress=print, cpus=(None, None) if args.no_pin else (0, 1),
        )  # fmt: skip
        print(json.dumps(rows, indent=1))
        if args.json_out:
            args.json_out.write_text(json.dumps(rows, indent=1))
        return 0
    gpus = tuple(args.gpus.split(","))
    if len(gpus) != 2:
        ap.error("--gpus: two CUDA_VISIBLE_DEVICES values, e.g. 0,1")
    mt = {"on": True, "off": False}.get(args.mt_mutex, connector_mt_mutex(args.device))
    cfg = DeviceFloorConfig(
        device=args.device,
        input_lens=args.input_lens or [2048, 8192, 16384],
        layouts=args.layouts or list(LAYOUTS),
        placements=args.placements,
        repeats=args.repeats or 10,
        gpus=(gpus[0], gpus[1]),
        visible=args.visible,
        delay_us=delay,
        mt_mutex=mt,
        peer_copy=not args.no_peer_copy,
    )
    if args.plan:
        for c in plan(cfg):
            print(f"{c.key}: {c.bytes / 2**20:.1f} MiB, {c.regions} regions x {c.blocks} blocks "
                  f"of {c.block_bytes} B, <= {c.max_descriptors} descriptors")  # fmt: skip
        print(f"buffer per side {cfg.buffer_bytes / 2**30:.2f} GiB ({cfg.mem_type}); "
              f"env initiator {cfg.env('initiator')} target {cfg.env('target')}")  # fmt: skip
        return 0
    return _run_device(cfg, args)


def _run_device(cfg: DeviceFloorConfig, args: argparse.Namespace) -> int:
    def save(res: dict[str, Any]) -> None:
        if args.json_out:
            tmp = args.json_out.with_suffix(".tmp")
            tmp.write_text(json.dumps(res, indent=1))
            tmp.replace(args.json_out)

    res = measure_device(cfg, progress=lambda m: print(m, flush=True), checkpoint=save)
    save(res)
    if not args.json_out:
        print(json.dumps(res, indent=1))
    bad = [r["layout"] + "/" + r["placement"] for r in res["cases"] if not r["data_ok"]]
    return 1 if res.get("error") or bad else 0


def connector_mt_mutex(device: str) -> bool:
    """The push connector's ``ucx_use_mt_mutex`` default for ``device`` (the floor's
    agents are tuned like the connector's)."""
    try:
        from vllm_ext.nixl_push import config as push_config
    except Exception:  # vLLM missing: the documented CPU default
        return True
    value = getattr(push_config, "DEVICE_DEFAULTS", {}).get(device, {}).get("ucx_use_mt_mutex")
    return bool(push_config.PushConfig.ucx_use_mt_mutex if value is None else value)


if __name__ == "__main__":
    sys.exit(main())
