#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""One NIXL agent of ``tools/nixl_release_probe.py`` (and ``nixl_liveness_probe.py``):
the probe starts two of these, P (initiator) and D (target), each in its network
namespace, and drives them with JSON lines over stdin/stdout.

    python tools/nixl_probe_agent.py --role target|initiator [--child-max-s S]

What an agent does on a command: make the agent with the connector's settings, register
its buffer, exchange metadata, post a WRITE and release it in flight, sample D's buffer,
remove a peer, watch a handle's state (the ``_write_*``/``_sample`` functions below).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SRC_BYTE = 0xAB  # P's (initiator's) buffer
DST_BYTE = 0x00  # D's (target's) buffer before each WRITE
REUSE_BYTE = 0xCD  # what P writes into its own buffer after the release (A-reuse)
TARGET = "probe-target"
INITIATOR = "probe-initiator"


# -- the two agents (child processes) --------------------------------------------------


class _Proto:
    """JSON lines to the parent on a private copy of fd 1; fd 1 itself goes to stderr so
    that nothing printed by NIXL or UCX can corrupt the protocol."""

    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    def send(self, **msg: Any) -> None:
        self._out.write(json.dumps(msg) + "\n")
        self._out.flush()


def _make_agent(name: str, num_threads: int, tcp_user_timeout_s: float = 0.0) -> Any:
    """A NIXL agent over UCX with the connector's settings: vLLM's NixlConnector config
    (``num_threads``, telemetry) and, where vllm_ext is importable, PushConfig's progress
    delay and UCX mutex, and ``tcp_user_timeout_s`` set the way the connector's worker
    sets ``ucx_tcp_user_timeout_s`` (only while the agent is built; 0: not at all)."""
    from nixl._api import nixl_agent, nixl_agent_config

    ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    with contextlib.suppress(ImportError):
        sys.path.insert(0, str(REPO))
        from vllm_ext import compat
        from vllm_ext.nixl_push.config import PushConfig

        ctx = compat.tuned_nixl_agents(
            PushConfig.nixl_progress_delay_us,
            PushConfig.ucx_use_mt_mutex,
            agent_cls=nixl_agent,
            tcp_user_timeout_s=tcp_user_timeout_s,
        )
    with ctx:
        cfg = nixl_agent_config(backends=["UCX"], num_threads=num_threads, capture_telemetry=True)
        return nixl_agent(name, cfg)


def _ucx_version() -> str:
    """UCX's version, from the libucp this process loaded (NIXL's wheel bundles one)."""
    import ctypes

    with open("/proc/self/maps") as f:
        libs = {ln.split()[-1] for ln in f if "libucp" in ln and ln.rstrip().endswith(".so.0.0.0")}
    for lib in sorted(libs):
        v = [ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()]
        ctypes.CDLL(lib).ucp_get_version(*(ctypes.byref(x) for x in v))
        return ".".join(str(x.value) for x in v)
    return "unknown"


def _nixl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nixl")
    except PackageNotFoundError:
        return "unknown"


def _register(agent: Any, buf: Any) -> None:
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))


def _child_main(role: str, max_s: float) -> int:
    import numpy as np

    # Bounded in time even if the parent vanishes without killing us.
    watchdog = threading.Timer(max_s, os._exit, (3,))
    watchdog.daemon = True
    watchdog.start()
    proto = _Proto()
    agent: Any = None
    buf: Any = None
    peer = ""
    local: Any = None
    remote: Any = None

    def count(byte: int = SRC_BYTE) -> int:
        return int(np.count_nonzero(buf == byte))

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["cmd"]
        try:
            if op == "init":
                agent = _make_agent(
                    TARGET if role == "target" else INITIATOR,
                    cmd["threads"],
                    cmd.get("tcp_user_timeout_s", 0.0),
                )
                fill = DST_BYTE if role == "target" else SRC_BYTE
                buf = np.full(cmd["size"], fill, dtype=np.uint8)
                _register(agent, buf)
                meta = base64.b64encode(agent.get_agent_metadata()).decode()
                proto.send(ev="ready", meta=meta, addr=buf.ctypes.data, size=buf.nbytes,
                           ucx=_ucx_version(), nixl=_nixl_version(), pid=os.getpid())  # fmt: skip
            elif op == "peer":
                peer = agent.add_remote_agent(base64.b64decode(cmd["meta"]))
                if isinstance(peer, bytes):
                    peer = peer.decode()
                if role == "initiator":
                    n, size = cmd["ndesc"], buf.nbytes
                    chunk = size // n
                    local = agent.get_xfer_descs(
                        [(buf.ctypes.data + i * chunk, chunk, 0) for i in range(n)], "DRAM"
                    )
                    remote = agent.get_xfer_descs(
                        [(cmd["addr"] + i * chunk, chunk, 0) for i in range(n)], "DRAM"
                    )
                proto.send(ev="ok", peer=peer)
            elif op == "hello":
                agent.send_notif(peer, cmd["msg"].encode())
                proto.send(ev="ok")
            elif op == "wait_notif":
                deadline = time.monotonic() + cmd["timeout"]
                seen: list[str] = []
                while time.monotonic() < deadline and cmd["msg"] not in seen:
                    for msgs in agent.get_new_notifs().values():
                        seen += [bytes(m).decode(errors="replace") for m in msgs]
                    time.sleep(0.01)
                proto.send(ev="notif", seen=seen, ok=cmd["msg"] in seen)
            elif op == "reset":
                buf.fill(DST_BYTE)
                proto.send(ev="ok", count=count())
            elif op == "sample":
                _sample(agent, count, proto, cmd)
            elif op == "write_release":
                _write_release(agent, peer, local, remote, buf, proto, cmd)
            elif op == "write_watch":
                _write_watch(agent, peer, local, remote, proto, cmd)
            elif op == "send_sample":
                _send_sample(agent, peer, count, proto, cmd)
            elif op == "exit":
                proto.send(ev="bye")
                break
            else:
                raise ValueError(f"unknown command {op!r}")
        except Exception as e:
            proto.send(ev="error", error=f"{type(e).__name__}: {e}", tb=traceback.format_exc())
    os._exit(0)  # skip NIXL's teardown: a released WRITE may still be in UCX's hands


def _sample(agent: Any, count: Callable[..., int], proto: _Proto, cmd: dict[str, Any]) -> None:
    """D: count the source pattern every ``period`` s, read notifications in between,
    until the count stayed put ``quiet`` s (after ``min`` s), at most ``max`` s; with
    ``reuse``, also count the pattern P writes into its buffer after the release."""
    t0 = time.monotonic()
    proto.send(ev="sampling", t=t0)
    samples: list[list[float]] = []  # [t_before_count, t_after_count, count], on change
    notifs: list[dict[str, Any]] = []
    reuse: list[list[float]] = []  # [t_before_count, t_after_count, count], on change
    last, last_change, last_r = -1, t0, -1
    while True:
        for msgs in agent.get_new_notifs().values():
            for m in msgs:
                t = time.monotonic()
                notifs.append({"t": t, "msg": bytes(m).decode(errors="replace"),
                               "count": count(), "t_counted": time.monotonic()})  # fmt: skip
        ts = time.monotonic()
        c = count()
        te = time.monotonic()
        if c != last:
            samples.append([ts, te, c])
            last, last_change = c, ts
        if cmd.get("reuse"):
            tr = time.monotonic()
            r = count(REUSE_BYTE)
            if r != last_r:
                reuse.append([tr, time.monotonic(), r])
                last_r, last_change = r, tr
            te = time.monotonic()
        if te - t0 >= cmd["max"] or (te - t0 >= cmd["min"] and te - last_change >= cmd["quiet"]):
            break
        time.sleep(cmd["period"])
    samples.append([ts, te, c])
    proto.send(ev="sampled", samples=samples, notifs=notifs, final=c, t0=t0, t_end=te,
               reuse=reuse)  # fmt: skip


def _release(agent: Any, handle: Any) -> str | None:
    """Release ``handle``; what NIXL raised, if it refused."""
    try:
        agent.release_xfer_handle(handle)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _write_release(
    agent: Any, peer: str, local: Any, remote: Any, buf: Any, proto: _Proto, cmd: dict[str, Any]
) -> None:
    """P: post, poll ``check_xfer_state`` as the connector's writer does, then release
    the handle while the WRITE runs (with ``reuse``: then overwrite the source buffer,
    as a reuse of freed blocks would)."""
    buf.fill(SRC_BYTE)
    handle = agent.initialize_xfer("WRITE", local, remote, peer, cmd["notif"].encode())
    t_post = time.monotonic()
    posted = agent.transfer(handle)
    polled: dict[str, int] = {}
    state = posted
    while state == "PROC" and time.monotonic() - t_post < cmd["wait"]:
        time.sleep(0.05)
        state = agent.check_xfer_state(handle)
        polled[state] = polled.get(state, 0) + 1
    before = agent.check_xfer_state(handle)
    removal: dict[str, Any] = {}
    if cmd.get("remove") == "first":  # remove D's agent with the WRITE's handle alive
        removal = _remove_peer(agent, peer)
        removal["states_after_remove"] = _watch_state(agent, handle, cmd.get("watch_s", 3.0))
    t_rel0 = time.monotonic()
    error = _release(agent, handle)
    t_rel1 = time.monotonic()
    if cmd.get("remove") == "after":  # release, then remove D's agent
        removal = _remove_peer(agent, peer)
    res: dict[str, Any] = {
        "t_post": t_post, "transfer_returned": posted, "polled_states": polled,
        "state_before_release": before, "t_release_start": t_rel0, "t_release_end": t_rel1,
        "release_s": t_rel1 - t_rel0, "release_raised": error,
    }  # fmt: skip
    res.update(removal)
    if cmd.get("notif_after"):
        agent.send_notif(peer, cmd["notif_after"].encode())
        res["t_notif_after_sent"] = time.monotonic()
    if cmd.get("reuse"):
        res["t_reuse_start"] = time.monotonic()
        buf.fill(REUSE_BYTE)
        res["t_reuse_end"] = time.monotonic()
    if error is not None:  # not released: let it end, then release it (clean state)
        while agent.check_xfer_state(handle) == "PROC":
            time.sleep(0.05)
        agent.release_xfer_handle(handle)
    proto.send(ev="released", **res)
    if cmd.get("check_after") and error is None:
        # NIXL's releaseXferReq deleted the request: this reads freed memory.
        try:
            got = agent.check_xfer_state(handle)
        except Exception as e:
            got = f"raised {type(e).__name__}: {e}"
        raw = None
        with contextlib.suppress(Exception):
            raw = int(agent.agent.getXferStatus(handle._handle))
        proto.send(ev="checked", check_xfer_state=got, raw_status=raw)


def _remove_peer(agent: Any, peer: str) -> dict[str, Any]:
    """``remove_remote_agent``: when it started and returned, and what it raised."""
    t0 = time.monotonic()
    try:
        agent.remove_remote_agent(peer)
        raised = None
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    return {"t_remove_start": t0, "t_remove_end": time.monotonic(), "remove_raised": raised}


def _watch_state(agent: Any, handle: Any, watch_s: float) -> list[list[Any]]:
    """``check_xfer_state`` every 20 ms for ``watch_s`` s: [time, state] on change."""
    out: list[list[Any]] = []
    t_end = time.monotonic() + watch_s
    while time.monotonic() < t_end:
        try:
            st = agent.check_xfer_state(handle)
        except Exception as e:
            st = f"raised {type(e).__name__}: {e}"
        if not out or out[-1][1] != st:
            out.append([time.monotonic(), st])
        if st != "PROC":
            break
        time.sleep(0.02)
    return out


def _write_watch(
    agent: Any, peer: str, local: Any, remote: Any, proto: _Proto, cmd: dict[str, Any]
) -> None:
    """P (scenario C): post, then poll ``check_xfer_state`` until it leaves PROC or
    ``max`` s pass; then release the handle."""
    handle = agent.initialize_xfer("WRITE", local, remote, peer, cmd["notif"].encode())
    t_post = time.monotonic()
    state = agent.transfer(handle)
    proto.send(ev="posted", t=t_post, state=state)
    transitions: list[list[Any]] = [[t_post, state]]
    while state == "PROC" and time.monotonic() - t_post < cmd["max"]:
        time.sleep(0.1)
        try:
            s = agent.check_xfer_state(handle)
        except Exception as e:  # NIXL raises some errors instead of returning "ERR"
            s = f"raised {type(e).__name__}: {e}"
        if s != state:
            transitions.append([time.monotonic(), s])
            state = s
    t_end = time.monotonic()
    error = _release(agent, handle)
    proto.send(ev="watched", state=state, t_post=t_post, t_end=t_end, transitions=transitions,
               release_s=time.monotonic() - t_end, release_raised=error)  # fmt: skip


def _send_sample(
    agent: Any, peer: str, count: Callable[..., int], proto: _Proto, cmd: dict[str, Any]
) -> None:
    """D (tools/nixl_liveness_probe.py): every ``period`` s send the peer a notification
    (as D re-asks a silent producer) and count the source pattern, for ``max`` s; with
    ``remove``, remove the peer's agent at the first send that raises (as the connector
    does, S-FLT-2) and send no more."""
    t0 = time.monotonic()
    proto.send(ev="sampling", t=t0)
    sends: list[list[Any]] = []  # [t, error or None], on change
    samples: list[list[float]] = []  # [t, count], on change
    removed_at = None
    last_err: Any = "unset"
    last = -1
    while time.monotonic() - t0 < cmd["max"]:
        if removed_at is None:
            t = time.monotonic()
            try:
                agent.send_notif(peer, f"ping-{t:.1f}".encode())
                err = None
            except Exception as e:
                err = f"{type(e).__name__}: {e}"[:200]
            if err != last_err:
                sends.append([t, err])
                last_err = err
            if err is not None and cmd.get("remove"):
                agent.remove_remote_agent(peer)
                removed_at = time.monotonic()
        agent.get_new_notifs()
        c = count()
        if c != last:
            samples.append([time.monotonic(), c])
            last = c
        time.sleep(cmd["period"])
    proto.send(ev="sent_sampled", sends=sends, samples=samples, final=count(), t0=t0,
               removed_at=removed_at)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=["target", "initiator"], required=True)
    p.add_argument("--child-max-s", type=float, default=600)
    args = p.parse_args(argv)
    return _child_main(args.role, args.child_max_s)


if __name__ == "__main__":
    sys.exit(main())
