# SPDX-License-Identifier: Apache-2.0
"""What proves that a silent producer can no longer write into D's blocks: measured
with two real NIXL agents (UCX over TCP) in two network namespaces (docs/design.md,
N-LIV-1). Uses the agents of ``tools/nixl_release_probe.py`` (same setup, same link
shaping); both agents get ``UCX_TCP_USER_TIMEOUT`` (``--tcp-user-timeout``, the
connector sets it from ``ucx_tcp_user_timeout_s``).

    sudo python tools/nixl_liveness_probe.py --out docs/results/nixl-liveness-$(date +%Y%m%d).json

P posts a WRITE of ``--size-mib`` into D's buffer; meanwhile D sends P a notification
every second (as D re-asks a silent producer) and counts the bytes that landed.

* **gone**: the link is cut 1 s after the post and never restored (a host removed):
  when does D's send to P raise, when does P's WRITE leave PROC?
* **hung**: P is stopped (SIGSTOP) 1 s after the post with the link up, and resumed
  ``--hang`` s later: do D's sends ever raise while P is hung, and does the WRITE land
  after P resumes (i.e. long after any bound of time alone)?
* **hung-cut**: P is stopped, the link cut; at D's first failed send D removes P's
  agent (as the connector does); the link comes back ``--tcp-user-timeout`` + 5 s after
  that failure, then P resumes: does any byte of the WRITE land after the restore?

Needs root. Every child is bounded in time and killed by PID; the namespaces are
deleted at the end.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import nixl_release_probe as probe  # noqa: E402

from devkit.testing.faults import netns  # noqa: E402


def _at(t: float, fn: Callable[[], Any]) -> threading.Timer:
    timer = threading.Timer(max(0.0, t - time.monotonic()), fn)
    timer.daemon = True
    timer.start()
    return timer


def _first_failure(sends: list[list[Any]]) -> list[Any] | None:
    return next((s for s in sends if s[1] is not None), None)


def _run_one(
    topo: Any, cfg: probe.ProbeConfig, env: dict[str, str], name: str, user_timeout: float,
    hang_s: float, log: Callable[[str], None],
) -> dict[str, Any]:  # fmt: skip
    """One scenario on a fresh pair of agents."""
    span = max(hang_s, 3 * user_timeout) + 20
    pair = probe._Pair(topo, cfg, env, name, span + 300)
    pid = int(pair.initiator_pid)
    try:
        pair.target.send(cmd="send_sample", period=1.0, max=span, remove=name == "hung-cut")
        t0 = pair.target.expect("sampling", 30)["t"]
        pair.initiator.send(cmd="write_watch", notif=name, max=span + 60)
        t_post = pair.initiator.expect("posted", 60)["t"]
        ev: dict[str, float] = {}

        def do(what: str, fn: Callable[[], Any]) -> Callable[[], None]:
            def run() -> None:
                fn()
                ev[what] = time.monotonic()

            return run

        stop = do("stopped", lambda: os.kill(pid, signal.SIGSTOP))
        cont = do("resumed", lambda: os.kill(pid, signal.SIGCONT))
        if name == "gone":
            _at(t_post + 1, do("cut", topo.cut))
        elif name == "hung":
            _at(t_post + 1, stop)
            _at(t_post + 1 + hang_s, cont)
        else:
            _at(t_post + 1, stop)
            _at(t_post + 1.5, do("cut", topo.cut))
        if name == "hung-cut":
            # restore (at least) T + 5 s after D's first failed send, then resume P
            got = pair.target.expect("sent_sampled", span + 60)
            fail = _first_failure(got["sends"])
            when = (fail[0] if fail else time.monotonic()) + user_timeout + 5
            time.sleep(max(0.0, when - time.monotonic()))
            topo.restore()
            ev["restored"] = time.monotonic()
            time.sleep(1)
            cont()
            pair.target.send(cmd="sample", period=0.1, quiet=10.0, min=15.0, max=60.0)
            pair.target.expect("sampling", 30)
            after = pair.target.expect("sampled", 120)
            got["after_restore"] = {"final": after["final"], "samples": after["samples"]}
        else:
            got = pair.target.expect("sent_sampled", span + 60)
        if name == "gone":
            topo.restore()
        watched = pair.initiator.expect("watched", span + 120)
        return _report(name, got, watched, ev, t_post, t0, cfg.size, log)
    finally:
        if pair.initiator.proc.poll() is None:
            os.kill(pid, signal.SIGCONT)
        pair.close()
        topo.restore()


def _report(
    name: str, got: dict[str, Any], watched: dict[str, Any], ev: dict[str, float],
    t_post: float, t0: float, size: int, log: Callable[[str], None],
) -> dict[str, Any]:  # fmt: skip
    def rel(t: float | None, base: str = "post") -> float | None:
        if t is None:
            return None
        return round(t - (t_post if base == "post" else ev[base]), 2)

    fail = _first_failure(got["sends"])
    ref = "cut" if "cut" in ev else "stopped"
    row: dict[str, Any] = {
        "scenario": name,
        "events_s_after_post": {k: rel(v) for k, v in ev.items()},
        "d_sends": [[rel(t), e] for t, e in got["sends"]],
        f"d_first_send_failure_s_after_{ref}": rel(fail[0], ref) if fail else None,
        "d_removed_peer_s_after_post": rel(got.get("removed_at")),
        "p_write_final_state": watched["state"],
        "p_write_transitions_s_after_post": [[rel(t), s] for t, s in watched["transitions"]],
        "bytes_final": got["final"],
        "bytes_total": size,
    }
    samples = got["samples"]
    if "stopped" in ev:
        before = [c for t, c in samples if t <= ev["stopped"] + 0.5]
        row["bytes_at_stop"] = before[-1] if before else 0
    if "resumed" in ev and name == "hung":
        at = [c for t, c in samples if t <= ev["resumed"]]
        row["bytes_at_resume"] = at[-1] if at else 0
        row["bytes_landed_after_resume"] = got["final"] - row["bytes_at_resume"]
    if "after_restore" in got:
        pre = got["final"]
        row["bytes_at_restore"] = pre
        row["bytes_final"] = got["after_restore"]["final"]
        row["bytes_landed_after_restore"] = got["after_restore"]["final"] - pre
    log(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'd_sends'})}")
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--size-mib", type=int, default=64)
    p.add_argument("--rate", default="80mbit")
    p.add_argument("--tcp-user-timeout", type=float, default=5.0, help="s, both agents")
    p.add_argument("--hang", type=float, default=0.0, help="hung: seconds P stays stopped "
                   "(default: 3 x the TCP user timeout)")  # fmt: skip
    p.add_argument("--only", default="gone,hung,hung-cut")
    p.add_argument("--logdir", default="")
    args = p.parse_args(argv)
    reason = netns.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"network namespaces unavailable: {reason}")
    logdir = args.logdir or tempfile.mkdtemp(prefix="nixl-liveness-")
    cfg = probe.ProbeConfig(size_mib=args.size_mib, ndesc=64, rate=args.rate,
                            python=probe.default_python(), logdir=logdir)  # fmt: skip
    Path(cfg.logdir).mkdir(parents=True, exist_ok=True)
    log = probe._clock(time.monotonic())
    atexit.register(probe._kill_all)
    t_user = args.tcp_user_timeout
    env = {"UCX_TCP_USER_TIMEOUT": f"{t_user:g}s"}
    hang = args.hang or 3 * t_user
    out: dict[str, Any] = {
        "probe": "tools/nixl_liveness_probe.py", "ucx_env_extra": env,
        "size_mib": args.size_mib, "rate": args.rate, "hang_s": hang,
    }  # fmt: skip
    topo = netns.Topology()
    try:
        topo.create()
        probe._shape(topo, args.rate)
        probe._wait_links_up(topo)
        out["scenarios"] = [
            _run_one(topo, cfg, env, name, t_user, hang, log) for name in args.only.split(",")
        ]
    finally:
        probe._kill_all()
        topo.destroy()
    text = json.dumps(out, indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
