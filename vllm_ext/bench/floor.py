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

``python -m vllm_ext.bench.floor --input-lens 256 1024 2048`` prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Any

from vllm_ext.nixl_push.descriptors import RegionLayout, build_write_descs

BLOCK_TOKENS = 128  # vLLM's CPU block size
DEFAULT_DELAY_US = 100  # PushConfig.nixl_progress_delay_us


def kv_geometry() -> tuple[int, int]:
    """(regions, bytes per token per region) of the tiny model: one region per layer
    holding K and V (the CPU backend's 4-D per-layer tensor)."""
    from vllm_ext.testing.tiny_model import TinyModelSpec

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


def _make_agent(name: str, delay_us: int | None) -> Any:
    """A raw ``nixl_agent`` with the NIXL/UCX settings of PushConfig's defaults."""
    from nixl._api import nixl_agent, nixl_agent_config

    from vllm_ext import compat

    with compat.tuned_nixl_agents(delay_us, True, agent_cls=nixl_agent):
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--input-lens", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--delay-us", type=int, default=DEFAULT_DELAY_US, help="-1: NIXL's (0)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin to cores 0 and 1")
    args = ap.parse_args(argv)
    rows = measure(
        args.input_lens, args.repeats, delay_us=None if args.delay_us < 0 else args.delay_us,
        progress=print, cpus=(None, None) if args.no_pin else (0, 1),
    )  # fmt: skip
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
