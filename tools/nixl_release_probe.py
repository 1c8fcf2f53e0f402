# SPDX-License-Identifier: Apache-2.0
"""What releasing an in-flight NIXL WRITE really does: measured with two real NIXL
agents (UCX backend over TCP) in two network namespaces.

    sudo python tools/nixl_release_probe.py --out docs/results/nixl-release-ucx-$(date +%Y%m%d).json
    python tools/nixl_release_probe.py --help

Setup: P (initiator) and D (target) namespaces joined by a bridge
(``devkit/testing/faults/netns.py``), the link towards D shaped with ``tc tbf``
(``--rate``, default 80 Mbit/s) so that a WRITE of ``--size-mib`` (default 64 MiB in
``--ndesc`` descriptors) lasts several seconds. One NIXL agent per namespace, each a
process of its own (``ip netns exec NS python tools/nixl_probe_agent.py --role ...``),
UCX restricted to TCP on the P-D link (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=kv0``), agents
made with the connector's settings (vLLM's ``num_threads=4`` and telemetry,
``--num-threads``; progress thread with ``PushConfig``'s delay and mutex). This process
relays the agents' metadata over their stdin/stdout and times everything with
``CLOCK_MONOTONIC``, which all namespaces share. D's buffer starts as 0x00, P's is 0xAB;
D counts its 0xAB bytes every ``--period`` seconds.

Scenarios (each result in the JSON written to ``--out``):

* **A** (``--repeats`` times): post a WRITE with a notification, wait ``--wait`` s,
  record ``check_xfer_state``, call ``release_xfer_handle`` on the in-flight handle
  (raised or returned, latency), then watch D's buffer until it stops changing: bytes
  that landed after the release returned, when they stopped, whether the WRITE's
  notification arrived.
* **B** (same connection): as A, but P sends ``send_notif`` right after the release
  returned: do D's bytes still change after that notification arrived?
* **A-reuse**: as A, and P overwrites its source buffer (0xCD) right after the release,
  as a reuse of freed blocks would: which contents land on D?
* **A-partition** (``--partition`` s, 0: left out): the link is cut 1 s after the post,
  the WRITE released 0.5 s later, the link restored: does the WRITE still land?
* **release-then-check** (last on that connection, since it may crash P):
  ``check_xfer_state`` on the released handle (a use after free in NIXL's agent).
* **C** (fresh agents per UCX setting, all at once): post a WRITE, cut the link for
  good (bridge down: frames dropped silently) and poll ``check_xfer_state`` until it
  leaves PROC or ``--dead-cap`` s pass, with UCX's defaults and with shorter UCX
  keepalive / ``TCP_USER_TIMEOUT`` settings; then release the handle (latency).
* **E** (fresh agents per variant, ``UCX_TCP_USER_TIMEOUT=5s``): P removes D's agent
  (``remove_remote_agent``) about 1 s into a WRITE, after releasing the handle or with
  it alive (then ``check_xfer_state`` is watched), with the link up, or cut and back
  before the timeout or after twice it: does anything of the WRITE land afterwards?
  (docs/design.md, N-REL-2)

Needs root (netns, veth, tc) and an interpreter with ``nixl`` and numpy (``--python``;
default: this one if it has nixl, else the primary pin's env). Every child is bounded
in time and killed by PID; the namespaces are deleted at the end (also on errors and at
exit). docs/design.md, N-REL-1 and N-REL-2, has the numbers of a run.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nixl_probe_agent import (  # tools/: this script's folder
    REUSE_BYTE,
)

REPO = Path(__file__).resolve().parent.parent
#: the agent processes' script
AGENT = Path(__file__).resolve().with_name("nixl_probe_agent.py")

#: UCX settings of scenario C (both agents get them). Names and defaults: UCX's
#: ``src/uct/tcp/tcp_iface.c`` (TCP_KEEPIDLE/KEEPINTVL/KEEPCNT, TCP_USER_TIMEOUT: "auto"
#: = the kernel's) and ``src/ucp/core/ucp_context.c`` (KEEPALIVE_INTERVAL).
DEAD_PEER_VARIANTS: dict[str, dict[str, str]] = {
    "ucx-defaults": {},
    "keepalive-1s": {
        "UCX_KEEPALIVE_INTERVAL": "1s",
        "UCX_TCP_KEEPIDLE": "1s",
        "UCX_TCP_KEEPINTVL": "1s",
        "UCX_TCP_KEEPCNT": "3",
    },
    "tcp-user-timeout-5s": {"UCX_TCP_USER_TIMEOUT": "5s"},
}


@dataclasses.dataclass
class ProbeConfig:
    size_mib: int = 64
    ndesc: int = 64
    #: vLLM's NixlConnector default (kv_transfer_config extra "num_threads"), which the
    #: push connector inherits: NIXL's UCX thread-pool engine. 0: the plain UCX engine.
    num_threads: int = 4
    rate: str = "80mbit"
    wait_s: float = 1.0
    repeats: int = 3
    period_s: float = 0.1
    quiet_s: float = 2.0
    scenario_b: bool = True
    check_after_release: bool = True
    reuse: bool = True
    scenario_c: bool = True
    scenario_e: bool = True
    dead_cap_s: float = 60.0
    partition_s: float = 5.0
    cut_after_s: float = 1.0
    python: str = ""
    logdir: str = ""

    @property
    def size(self) -> int:
        return self.size_mib << 20


# -- the parent -------------------------------------------------------------------------


class ChildGone(RuntimeError):
    pass


_CHILDREN: list[_Child] = []


class _Child:
    """One agent process in a namespace; JSON lines over its stdin/stdout."""

    def __init__(
        self, role: str, wrapper: list[str], env: dict[str, str], python: str, log: Path,
        max_s: float,
    ) -> None:  # fmt: skip
        self.role = role
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 (closed in kill())
        cmd = [*wrapper, python, str(AGENT), "--role", role,
               "--child-max-s", str(max_s)]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
            cwd=REPO, start_new_session=True,
        )  # fmt: skip
        _CHILDREN.append(self)
        self._buf = b""

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def recv(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.role}: no answer within {timeout:g}s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    rc = self.proc.wait(timeout=10)
                    raise ChildGone(f"{self.role} exited (rc {rc}); log {self.log_path}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line)
        if msg.get("ev") == "error":
            raise RuntimeError(f"{self.role}: {msg['error']}\n{msg.get('tb', '')}")
        return msg

    def expect(self, ev: str, timeout: float) -> dict[str, Any]:
        msg = self.recv(timeout)
        if msg.get("ev") != ev:
            raise RuntimeError(f"{self.role}: expected {ev!r}, got {msg}")
        return msg

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        self._log.close()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()

    def ucx_warnings(self) -> list[str]:
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace")
            return sorted({ln.strip() for ln in text.splitlines() if "UCX  WARN" in ln})
        return []


def _kill_all() -> None:
    while _CHILDREN:
        _CHILDREN.pop().kill()


class _Pair:
    """An initiator (ns P) and a target (ns D) with each other's metadata, connected."""

    def __init__(self, topo: Any, cfg: ProbeConfig, env_extra: dict[str, str], tag: str,
                 max_s: float, tcp_user_timeout_s: float = 0.0) -> None:  # fmt: skip
        env = dict(os.environ)
        env.update(topo.engine_env("prefill"))
        env.update(env_extra)
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("UCX_USE_MT_MUTEX", None)
        logdir = Path(cfg.logdir)
        self.topo = topo
        self.env_extra = env_extra
        self.target = _Child("target", topo.wrapper("decode"), env, cfg.python,
                             logdir / f"{tag}-target.log", max_s)  # fmt: skip
        self.initiator = _Child("initiator", topo.wrapper("prefill"), env, cfg.python,
                                logdir / f"{tag}-initiator.log", max_s)  # fmt: skip
        for child in (self.target, self.initiator):
            child.send(cmd="init", size=cfg.size, threads=cfg.num_threads,
                       tcp_user_timeout_s=tcp_user_timeout_s)  # fmt: skip
        t = self.target.expect("ready", 180)
        i = self.initiator.expect("ready", 180)
        self.versions = {"nixl": i["nixl"], "ucx": i["ucx"]}
        self.initiator_pid = int(i["pid"])
        self.target.send(cmd="peer", meta=i["meta"])
        self.target.expect("ok", 60)
        self.initiator.send(cmd="peer", meta=t["meta"], addr=t["addr"], ndesc=cfg.ndesc)
        self.initiator.expect("ok", 60)
        self.initiator.send(cmd="hello", msg="hello")
        self.initiator.expect("ok", 60)
        self.target.send(cmd="wait_notif", msg="hello", timeout=60)
        if not self.target.expect("notif", 90)["ok"]:
            raise RuntimeError("the target never got the initiator's first notification")

    def close(self) -> None:
        for c in (self.initiator, self.target):
            c.kill()


def _clock(t0: float) -> Callable[[str], None]:
    def log(msg: str) -> None:
        print(f"[probe +{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    return log


def _shape(topo: Any, rate: str) -> dict[str, str]:
    """Shape the switch port towards D: ``rate``, a short queue (100 ms)."""
    args = ["tc", "qdisc", "replace", "dev", "swd", "root", "tbf", "rate", rate,
            "burst", "64kb", "latency", "100ms"]  # fmt: skip
    subprocess.run([*topo.wrapper("switch"), *args], check=True, capture_output=True, timeout=20)
    return {"qdisc": " ".join(args[3:]), "namespace": "switch (port towards D)"}


def _wait_links_up(topo: Any, timeout: float = 20.0) -> float:
    """Wait until both ends' P-D interface is operationally up (the kernel sets carrier
    up to ~1 s after ``ip link set up``; UCX refuses a device that is not running)."""
    from devkit.testing.faults.netns import DATA_DEV

    t0 = time.monotonic()
    for role in ("prefill", "decode"):
        while True:
            r = subprocess.run(["ip", "-n", topo.ns(role), "-o", "link", "show", DATA_DEV],
                               capture_output=True, text=True, timeout=20)  # fmt: skip
            if "state UP" in r.stdout:
                break
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{DATA_DEV} in {topo.ns(role)} not up: {r.stdout.strip()}")
            time.sleep(0.1)
    return time.monotonic() - t0


def _tcp_to_d(topo: Any) -> dict[str, Any]:
    """P's TCP connections to D's data address now: how many, and the bytes in their
    send queues (handed to the kernel, not yet acknowledged)."""
    r = subprocess.run([*topo.wrapper("prefill"), "ss", "-Htn", "state", "established"],
                       capture_output=True, text=True, timeout=20)  # fmt: skip
    peer = topo.data_ip("decode") + ":"
    rows = [ln.split() for ln in r.stdout.splitlines()]
    rows = [x for x in rows if len(x) >= 4 and x[3].startswith(peer)]
    return {"connections": len(rows), "send_q_bytes": [int(x[1]) for x in rows]}


def _sysctl(topo: Any, key: str) -> str:
    r = subprocess.run([*topo.wrapper("prefill"), "sysctl", "-n", key], capture_output=True,
                       text=True, timeout=20)  # fmt: skip
    return r.stdout.strip() or r.stderr.strip()


def _analyze(rel: dict[str, Any], sampled: dict[str, Any], size: int) -> dict[str, Any]:
    """Bytes on D before / after the release returned, from D's timed counts (bounds:
    a count is taken between its two timestamps)."""
    samples = sampled["samples"]
    final = int(sampled["final"])
    t_end = rel["t_release_end"]
    surely_before = [s[2] for s in samples if s[1] <= rel["t_release_start"]]
    after = [s for s in samples if s[0] >= t_end]
    at_release_max = int(after[0][2]) if after else final
    at_release_min = int(surely_before[-1]) if surely_before else 0
    first_final = next(s for s in samples if s[2] == final)
    changes_after = [s for s in samples if s[0] >= t_end and s[2] != at_release_max]
    post = rel["t_post"]
    return {
        "bytes_total": size,
        "bytes_final": final,
        "write_completed_fully": final == size,
        "bytes_at_release_min": at_release_min,
        "bytes_at_release_max": at_release_max,
        "bytes_landed_after_release_returned_min": final - at_release_max,
        "bytes_landed_after_release_returned_max": final - at_release_min,
        "bytes_changed_after_release_returned": bool(changes_after),
        "bytes_stopped_s_after_release_returned": round(first_final[1] - t_end, 3),
        "throughput_MBps": round(final / max(first_final[1] - post, 1e-6) / 1e6, 2),
        "samples": len(samples),
    }


def scenario_release(
    pair: _Pair, cfg: ProbeConfig, label: str, notif_after: str | None = None,
    check_after: bool = False, partition_s: float | None = None, reuse: bool = False,
    remove: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Scenario A (and B with ``notif_after``, release-then-check with ``check_after``;
    with ``partition_s``: the link is cut ``wait`` s after the post, the WRITE released
    0.5 s later, the link restored ``partition_s`` s after the cut)."""
    pair.target.send(cmd="reset")
    pair.target.expect("ok", 30)
    expected_s = cfg.size / (_rate_bps(cfg.rate) / 8)
    max_s = cfg.wait_s + 3 * expected_s + 20 + (partition_s or 0) * 3
    quiet = cfg.quiet_s if partition_s is None else 10.0  # > TCP's retransmission back-off
    hold = 0.0 if partition_s is None else 0.5
    pair.target.send(cmd="sample", period=cfg.period_s, quiet=quiet,
                     min=cfg.wait_s + hold + cfg.quiet_s + 1 + (partition_s or 0),
                     max=max_s, reuse=reuse)  # fmt: skip
    pair.target.expect("sampling", 30)
    pair.initiator.send(cmd="write_release", wait=cfg.wait_s + hold, notif=label,
                        notif_after=notif_after, check_after=check_after,
                        reuse=reuse, remove=remove)  # fmt: skip
    out: dict[str, Any] = {"label": label}
    if partition_s is not None:
        time.sleep(cfg.wait_s)
        pair.topo.cut()
        t_cut = time.monotonic()
    rel = pair.initiator.expect("released", cfg.wait_s + 60)
    out["tcp_p_to_d_after_release"] = _tcp_to_d(pair.topo)
    if partition_s is not None:
        time.sleep(max(0.0, t_cut + partition_s - time.monotonic()))
        pair.topo.restore()
        t_restore = time.monotonic()
        out["partition"] = {
            "cut_s_after_post": round(t_cut - rel["t_post"], 3),
            "released_s_after_cut": round(rel["t_release_start"] - t_cut, 3),
            "restored_s_after_cut": round(t_restore - t_cut, 3),
        }
    if check_after:
        try:
            out["check_after_release"] = pair.initiator.expect("checked", 30)
        except (ChildGone, TimeoutError) as e:
            out["check_after_release"] = {"crashed": str(e)}
    sampled = pair.target.expect("sampled", max_s + 30)
    t_end = rel["t_release_end"]
    out.update({k: rel[k] for k in ("transfer_returned", "polled_states",
                                    "state_before_release", "release_raised")})  # fmt: skip
    out["release_ms"] = round(rel["release_s"] * 1e3, 3)
    out["released_s_after_post"] = round(rel["t_release_start"] - rel["t_post"], 3)
    out.update(_analyze(rel, sampled, cfg.size))
    if remove is not None:
        out.update(_after_remove(rel, sampled))
    notifs = sampled["notifs"]
    mine = [n for n in notifs if n["msg"] == label]
    out["write_notif_arrived"] = bool(mine)
    if mine:
        out["write_notif_s_after_release_returned"] = round(mine[0]["t"] - t_end, 3)
    if notif_after:
        later = [n for n in notifs if n["msg"] == notif_after]
        out["later_notif_arrived"] = bool(later)
        if later:
            n = later[0]
            out["later_notif_s_after_sent"] = round(n["t"] - rel["t_notif_after_sent"], 3)
            out["bytes_at_later_notif"] = n["count"]
            out["bytes_changed_after_later_notif"] = int(sampled["final"]) != n["count"]
            out["bytes_landed_after_later_notif"] = int(sampled["final"]) - n["count"]
    out["other_notifs"] = [n["msg"] for n in notifs if n["msg"] not in (label, notif_after)]
    if reuse:
        rs = sampled["reuse"]
        final_r = int(rs[-1][2]) if rs else 0
        first = next((x for x in rs if x[2] > 0), None)
        out["reuse"] = {
            "overwritten_s_after_release_returned": round(rel["t_reuse_end"] - t_end, 4),
            "reuse_bytes_on_target": final_r,
            "source_bytes_on_target": int(sampled["final"]),
            "target_bytes_from_write_total": final_r + int(sampled["final"]),
            "first_reuse_byte_seen_s_after_release": round(first[1] - t_end, 3)
            if first else None,
        }  # fmt: skip
    if partition_s is not None:
        final = int(sampled["final"])
        after = [s for s in sampled["samples"] if s[0] >= t_restore]
        at_restore = int(after[0][2]) if after else final
        moved = [s for s in after if s[2] != at_restore]
        out["partition"].update({
            "bytes_at_restore_max": at_restore,
            "bytes_landed_after_restore_min": final - at_restore,
            "first_change_s_after_restore": round(moved[0][1] - t_restore, 3) if moved else None,
        })  # fmt: skip
    return out


def _after_remove(rel: dict[str, Any], sampled: dict[str, Any]) -> dict[str, Any]:
    """What landed on D after ``remove_remote_agent`` returned on P (lower bound)."""
    t_end = rel["t_remove_end"]
    final = int(sampled["final"])
    after = [s for s in sampled["samples"] if s[0] >= t_end]
    at_remove = int(after[0][2]) if after else final
    moved = [s for s in after if s[2] != at_remove]
    states = rel.get("states_after_remove")
    return {
        "remove_raised": rel["remove_raised"],
        "remove_ms": round((t_end - rel["t_remove_start"]) * 1e3, 3),
        "removed_s_after_post": round(rel["t_remove_start"] - rel["t_post"], 3),
        "bytes_at_remove_max": at_remove,
        "bytes_landed_after_remove_min": final - at_remove,
        "last_change_s_after_remove": round(moved[-1][1] - t_end, 3) if moved else None,
        "states_after_remove": [[round(t - rel["t_remove_start"], 3), st] for t, st in states]
        if states else None,
    }  # fmt: skip


#: Scenario E: D's agent removed on P during a WRITE (UCX_TCP_USER_TIMEOUT on both
#: agents); label -> (remove: "after" the release or "first", partition s or None)
REMOVE_VARIANTS: dict[str, tuple[str, float | None]] = {
    "release-then-remove": ("after", None),
    "remove-with-handle-alive": ("first", None),
    "cut-remove-restore-before-timeout": ("after", 2.5),
    "cut-remove-restore-after-2x-timeout": ("after", 12.0),
}
REMOVE_TCP_USER_TIMEOUT = "5s"


def scenario_remove(topo: Any, cfg: ProbeConfig, log: Callable[[str], None]) -> list[Any]:
    """Scenario E: a fresh pair per variant (a removal ends its connection)."""
    out = []
    env = {"UCX_TCP_USER_TIMEOUT": REMOVE_TCP_USER_TIMEOUT}
    for label, (how, partition) in REMOVE_VARIANTS.items():
        pair = _Pair(topo, cfg, env, f"e-{label}", 600)
        try:
            log(f"E: {label}")
            r = scenario_release(pair, cfg, f"E-{label}", partition_s=partition, remove=how)
            r["variant"], r["env"] = label, env
            how_it_went = f"raised {r['remove_raised']}" if r["remove_raised"] else "returned"
            log(f"E: {label}: remove {how_it_went}"
                f" in {r['remove_ms']} ms; >= {r['bytes_landed_after_remove_min']} B landed after"
                f" it (last change +{r['last_change_s_after_remove']}s); states after remove:"
                f" {r['states_after_remove']}; partition: {r.get('partition')}")  # fmt: skip
            out.append(r)
        finally:
            pair.close()
    return out


def _rate_bps(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, m in units.items():
        if rate.lower().endswith(u):
            return float(rate[: -len(u)]) * m
    raise ValueError(f"rate {rate!r}: use e.g. 80mbit")


def scenario_dead_peer(topo: Any, cfg: ProbeConfig, log: Callable[[str], None]) -> list[Any]:
    """Scenario C: one fresh pair per UCX setting, all posting at once, then the link cut."""
    max_s = cfg.dead_cap_s + 300
    pairs: dict[str, _Pair] = {}
    try:
        for name, env in DEAD_PEER_VARIANTS.items():
            log(f"C: starting agents with {name} {env}")
            pairs[name] = _Pair(topo, cfg, env, f"c-{name}", max_s)
        for name, p in pairs.items():
            p.initiator.send(cmd="write_watch", notif=f"C-{name}", max=cfg.dead_cap_s)
        posted = {name: p.initiator.expect("posted", 60) for name, p in pairs.items()}
        time.sleep(cfg.cut_after_s)
        topo.cut()
        t_cut = time.monotonic()
        log(f"C: link cut (bridge down); polling check_xfer_state up to {cfg.dead_cap_s:g}s")
        out = []
        for name, p in pairs.items():
            w = p.initiator.expect("watched", cfg.dead_cap_s + 60)
            left = w["state"] != "PROC"
            row = {
                "variant": name, "env": p.env_extra,
                "state_at_cut": [s for t, s in w["transitions"] if t <= t_cut][-1],
                "posted_s_before_cut": round(t_cut - posted[name]["t"], 3),
                "final_state": w["state"], "left_proc": left,
                "s_from_cut_to_leave_proc": round(w["transitions"][-1][0] - t_cut, 3)
                if left else None,
                "capped_at_s": cfg.dead_cap_s,
                "release_after_ms": round(w["release_s"] * 1e3, 3),
                "release_raised": w["release_raised"],
                "ucx_warnings": p.initiator.ucx_warnings(),
            }  # fmt: skip
            log(f"C: {name}: {'-> ' + w['state'] if left else 'still PROC'} "
                f"{row['s_from_cut_to_leave_proc'] or cfg.dead_cap_s}s after the cut")  # fmt: skip
            out.append(row)
        return out
    finally:
        for p in pairs.values():
            p.close()


def run(cfg: ProbeConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the scenarios that ``cfg`` selects; the result as a JSON-able dict."""
    sys.path.insert(0, str(REPO))
    from devkit.testing.faults import netns

    log = log or _clock(time.monotonic())
    atexit.register(_kill_all)
    reason = netns.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"network namespaces unavailable: {reason}")
    cfg.python = cfg.python or default_python()
    own_logdir = not cfg.logdir
    if own_logdir:
        cfg.logdir = tempfile.mkdtemp(prefix="nixl-release-probe-")
    result: dict[str, Any] = {
        "probe": "tools/nixl_release_probe.py",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "logdir"},
    }
    topo = netns.Topology()
    try:
        topo.create()
        log(f"namespaces {topo.ns('prefill')} / {topo.ns('decode')} via {topo.ns('switch')}")
        shaping = _shape(topo, cfg.rate)
        result["setup"] = {
            "link": "veth P - bridge (ns switch) - veth D, tc tbf on the port towards D",
            "shaping": shaping,
            "ucx_env": topo.engine_env("prefill"),
            "tcp_retries2": _sysctl(topo, "net.ipv4.tcp_retries2"),
            "kernel": platform.release(),
            "clock": "CLOCK_MONOTONIC, shared by all namespaces",
        }
        log(f"link shaped: {shaping['qdisc']}; up after {_wait_links_up(topo):.1f}s")
        pair = _Pair(topo, cfg, {}, "ab", 900)
        result["versions"] = pair.versions
        log(f"agents up: NIXL {pair.versions['nixl']}, UCX {pair.versions['ucx']}")
        try:
            a = []
            for i in range(cfg.repeats):
                log(f"A{i}: WRITE {cfg.size_mib} MiB, release after {cfg.wait_s:g}s")
                r = scenario_release(pair, cfg, f"A{i}")
                raised = r["release_raised"]
                log(
                    f"A{i}: state {r['state_before_release']}, release "
                    f"{'raised ' + raised if raised else 'returned'} in {r['release_ms']:.2f} ms;"
                    f" >= {r['bytes_landed_after_release_returned_min']} B landed after it, until"
                    f" +{r['bytes_stopped_s_after_release_returned']}s; notif "
                    f"{'arrived' if r['write_notif_arrived'] else 'never arrived'}"
                )
                a.append(r)
            result["scenario_a"] = a
            if cfg.scenario_b:
                log("B: release, then send_notif at once on the same connection")
                b = scenario_release(pair, cfg, "B-write", notif_after="B-later")
                log(f"B: later notif arrived={b.get('later_notif_arrived')}, bytes landed after "
                    f"it: {b.get('bytes_landed_after_later_notif')}")  # fmt: skip
                result["scenario_b"] = b
            if cfg.reuse:
                log(f"A-reuse: release, then overwrite P's buffer with {REUSE_BYTE:#x}")
                r = scenario_release(pair, cfg, "U-write", reuse=True)
                log(f"A-reuse: {r['reuse']}")
                result["scenario_a_reuse"] = r
            if cfg.partition_s > 0:
                log(f"A-partition: cut the link, release, restore {cfg.partition_s:g}s later")
                r = scenario_release(pair, cfg, "P-write", partition_s=cfg.partition_s)
                log(f"A-partition: {r['partition']}")
                result["scenario_a_partition"] = r
            if cfg.check_after_release:
                log("check_xfer_state on a released handle (may crash the initiator)")
                c = scenario_release(pair, cfg, "R-write", check_after=True)
                log(f"  -> {c.get('check_after_release')}")
                result["release_then_check"] = c
            result["ucx_warnings"] = pair.initiator.ucx_warnings() + pair.target.ucx_warnings()
        finally:
            pair.close()
        if cfg.scenario_c:
            result["scenario_c"] = scenario_dead_peer(topo, cfg, log)
        if cfg.scenario_e:
            result["scenario_e"] = scenario_remove(topo, cfg, log)
        result["summary"] = summarize(result)
        return result
    finally:
        _kill_all()
        topo.destroy()
        log("namespaces deleted")


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    a = result.get("scenario_a", [])
    s: dict[str, Any] = {}
    if a:
        s["a_runs"] = len(a)
        s["a_release_raised"] = [r["release_raised"] for r in a]
        s["a_state_before_release"] = [r["state_before_release"] for r in a]
        s["a_release_ms"] = [r["release_ms"] for r in a]
        s["a_bytes_landed_after_release_min"] = [
            r["bytes_landed_after_release_returned_min"] for r in a
        ]
        s["a_write_completed_fully"] = [r["write_completed_fully"] for r in a]
        s["a_stopped_s_after_release"] = [r["bytes_stopped_s_after_release_returned"] for r in a]
        s["a_write_notif_arrived"] = [r["write_notif_arrived"] for r in a]
    b = result.get("scenario_b")
    if b:
        s["b_later_notif_arrived"] = b.get("later_notif_arrived")
        s["b_bytes_landed_after_later_notif"] = b.get("bytes_landed_after_later_notif")
    c = result.get("scenario_c")
    if c:
        s["c_s_from_cut_to_leave_proc"] = {
            r["variant"]: (r["final_state"], r["s_from_cut_to_leave_proc"]) for r in c
        }
    return s


def default_python() -> str:
    """This interpreter if it has nixl, else the primary pin's env."""
    import importlib.util

    if importlib.util.find_spec("nixl") is not None:
        return sys.executable
    sys.path.insert(0, str(REPO / "tools"))
    import envs  # tools/envs.py

    pins = envs.load_pins()
    primary = next(v for v, p in pins["pins"].items() if p.get("primary"))
    return str(envs.venv_python(primary))


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM/SIGHUP unwind like an exception, so the finally blocks clean up."""

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Needs root: it makes network namespaces, a veth pair and a tc qdisc.",
    )  # fmt: skip
    d = ProbeConfig()
    p.add_argument("--out", type=Path, help="write the JSON result here")
    p.add_argument("--size-mib", type=int, default=d.size_mib, help="WRITE size (%(default)s)")
    p.add_argument("--ndesc", type=int, default=d.ndesc,
                   help="descriptors the WRITE is split into (%(default)s)")  # fmt: skip
    p.add_argument("--num-threads", type=int, default=d.num_threads,
                   help="nixl_agent_config(num_threads=...) of both agents; the connector's "
                   "(vLLM's default) is %(default)s, 0 is NIXL's plain UCX engine")  # fmt: skip
    p.add_argument("--rate", default=d.rate, help="tc tbf rate towards D (%(default)s)")
    p.add_argument("--wait", type=float, default=d.wait_s,
                   help="seconds between the post and the release (%(default)s)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=d.repeats, help="runs of A (%(default)s)")
    p.add_argument("--period", type=float, default=d.period_s,
                   help="D's sampling period, s (%(default)s)")  # fmt: skip
    p.add_argument(
        "--dead-cap",
        type=float,
        default=d.dead_cap_s,
        help="C: longest wait for check_xfer_state to leave PROC, s (%(default)s)",
    )
    p.add_argument("--partition", type=float, default=d.partition_s,
                   help="A-partition: seconds the link stays cut around the release; 0: "
                   "leave the scenario out (%(default)s)")  # fmt: skip
    p.add_argument("--skip", default="", help="comma list of a,b,reuse,check,c,e to leave out")
    p.add_argument("--python", default="", help="interpreter of the agents (with nixl)")
    p.add_argument("--logdir", default="", help="keep the agents' logs here (default: a tmp dir)")
    args = p.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    cfg = ProbeConfig(
        size_mib=args.size_mib, ndesc=args.ndesc, num_threads=args.num_threads, rate=args.rate,
        wait_s=args.wait,
        repeats=args.repeats, period_s=args.period, dead_cap_s=args.dead_cap,
        partition_s=args.partition,
        scenario_b="b" not in skip, check_after_release="check" not in skip,
        reuse="reuse" not in skip,
        scenario_c="c" not in skip, scenario_e="e" not in skip, python=args.python,
        logdir=args.logdir,
    )  # fmt: skip
    if cfg.logdir:
        Path(cfg.logdir).mkdir(parents=True, exist_ok=True)
    with _terminate_as_exit():
        res = run(cfg)
    text = json.dumps(res, indent=2) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"result: {args.out}")
    else:
        print(text)
    print(json.dumps(res.get("summary", {}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
