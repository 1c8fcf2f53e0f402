# SPDX-License-Identifier: Apache-2.0
"""P and D each in a network namespace of their own, so a test can cut their link.

::

    root namespace (test, proxy)
      vxf<tag>pc 10.123.N.1/30 ──── 10.123.N.2   eth0 of ns P   (HTTP: proxy -> P)
      vxf<tag>dc 10.123.N+1.1/30 ── 10.123.N+1.2 eth0 of ns D   (HTTP: proxy -> D)
    ns P  kv0 10.123.N+2.1/29 ─┐
                               ├─ bridge "swbr" in ns S (the switch)
    ns D  kv0 10.123.N+2.2/29 ─┘

P and D talk KV only over the switch (NIXL side channel and UCX, with
``UCX_TLS=tcp`` on that interface: across namespaces UCX would otherwise still
copy through shared memory / CMA, which no link cut can stop). The proxy keeps
reaching both engines over their own links while the P-D link is cut.

* ``cut()`` / ``restore()`` take the bridge down / up: frames are dropped
  silently and both ends keep their carrier and routes, as when a switch or a
  cable between two hosts fails (TCP retransmits; nothing tells the endpoints).
* ``throttle(rate)`` shapes the link towards D (``tc tbf``), so a WRITE of a few
  MB lasts long enough to be hit while in flight.
* TCP keeps the kernel's defaults: after a restore, traffic resumes at the next
  retransmission (exponential back-off: ~15-25 s after a 30-45 s cut); a cut
  shorter than ``tcp_retries2``'s ~15 minutes never breaks a connection.

Every name carries a random tag and the addresses a free /22 of 10.123.0.0/16, so
two runs on one host do not meet; ``destroy()`` (also at exit) deletes the
namespaces, which removes every interface made here.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import ipaddress
import os
import random
import shutil
import subprocess
import uuid

NAME_PREFIX = "vxf"
DATA_DEV = "kv0"
CTRL_DEV = "eth0"
BRIDGE = "swbr"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None when they can (root, ``ip``,
    ``tc``, netns, veth, bridge: tried once with throwaway names)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    tag = uuid.uuid4().hex[:6]
    ns, a, b, br = (
        f"{NAME_PREFIX}-{tag}-probe",
        f"{NAME_PREFIX}{tag}a",
        f"{NAME_PREFIX}{tag}b",
        (f"{NAME_PREFIX}{tag}br"),
    )
    try:
        for args in (
            ["netns", "add", ns],
            ["link", "add", a, "type", "veth", "peer", "name", b],
            ["link", "set", b, "netns", ns],
            ["-n", ns, "link", "add", br, "type", "bridge"],
        ):
            r = _ip(*args, check=False)
            if r.returncode != 0:
                return f"`ip {' '.join(args)}` failed: {r.stderr.strip()}"
        r = subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", b, "root", "tbf",
             "rate", "100mbit", "burst", "64kbit", "latency", "1s"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        if r.returncode != 0:
            return f"tc tbf is not available: {r.stderr.strip()}"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"network namespaces are not usable: {e}"
    finally:
        _ip("link", "del", a, check=False)
        _ip("netns", "del", ns, check=False)


def _free_block() -> int:
    """A third octet N (multiple of 4) such that 10.123.N.0/22 is unused here."""
    used = _ip("-o", "addr", "show", check=False).stdout + _ip("route", "show", check=False).stdout
    nets = []
    for token in used.split():
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(token, strict=False))
    blocks = list(range(4, 252, 4))
    random.shuffle(blocks)
    for n in blocks:
        mine = ipaddress.ip_network(f"10.123.{n}.0/22")
        if not any(net.version == 4 and net.overlaps(mine) for net in nets):
            return n
    raise RuntimeError("no free /22 in 10.123.0.0/16 for the fault namespaces")


@dataclasses.dataclass
class Topology:
    tag: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:6])
    block: int = 0
    created: bool = False

    # -- names and addresses --------------------------------------------------------
    def ns(self, role: str) -> str:
        """``prefill`` / ``decode`` / ``switch`` -> namespace name."""
        return f"{NAME_PREFIX}-{self.tag}-{role[0]}"

    def ctrl_ip(self, role: str) -> str:
        """The engine's address towards the proxy (HTTP)."""
        return f"10.123.{self.block + (0 if role == 'prefill' else 1)}.2"

    def data_ip(self, role: str) -> str:
        """The engine's address on the P-D link (NIXL side channel, UCX)."""
        return f"10.123.{self.block + 2}.{1 if role == 'prefill' else 2}"

    def wrapper(self, role: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(role)]

    def engine_env(self, role: str) -> dict[str, str]:
        """UCX over TCP on the P-D link only (see the module docstring)."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": DATA_DEV}

    # -- lifecycle --------------------------------------------------------------------
    def create(self) -> Topology:
        self.block = _free_block()
        self.created = True
        atexit.register(self.destroy)
        p, d, s = self.ns("prefill"), self.ns("decode"), self.ns("switch")
        br = BRIDGE
        cmds: list[list[str]] = []
        for ns in (p, d, s):
            cmds += [["netns", "add", ns], ["-n", ns, "link", "set", "lo", "up"]]
        for role, ns, n in (("prefill", p, self.block), ("decode", d, self.block + 1)):
            host = f"{NAME_PREFIX}{self.tag}{role[0]}c"
            cmds += [
                ["link", "add", host, "type", "veth", "peer", "name", CTRL_DEV, "netns", ns],
                ["addr", "add", f"10.123.{n}.1/30", "dev", host],
                ["link", "set", host, "up"],
                ["-n", ns, "addr", "add", f"10.123.{n}.2/30", "dev", CTRL_DEV],
                ["-n", ns, "link", "set", CTRL_DEV, "up"],
            ]
        cmds += [
            ["-n", s, "link", "add", "name", br, "type", "bridge"],
            ["-n", s, "link", "set", br, "up"],
        ]
        for role, ns in (("prefill", p), ("decode", d)):
            port = f"sw{role[0]}"
            cmds += [
                ["-n", ns, "link", "add", DATA_DEV, "type", "veth", "peer", "name", port,
                 "netns", s],
                ["-n", s, "link", "set", port, "master", br],
                ["-n", s, "link", "set", port, "up"],
                ["-n", ns, "addr", "add", f"{self.data_ip(role)}/29", "dev", DATA_DEV],
                ["-n", ns, "link", "set", DATA_DEV, "up"],
            ]  # fmt: skip
        try:
            for c in cmds:
                _ip(*c)
        except subprocess.CalledProcessError as e:
            self.destroy()
            raise RuntimeError(f"`ip {' '.join(e.cmd[1:])}` failed: {e.stderr.strip()}") from e
        return self

    def destroy(self) -> None:
        if not self.created:
            return
        self.created = False
        for role in ("prefill", "decode", "switch"):
            _ip("netns", "del", self.ns(role), check=False)

    def __enter__(self) -> Topology:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # -- faults -----------------------------------------------------------------------
    def cut(self) -> None:
        """Silently drop every frame between P and D (both keep carrier and routes)."""
        _ip("-n", self.ns("switch"), "link", "set", BRIDGE, "down")

    def restore(self) -> None:
        _ip("-n", self.ns("switch"), "link", "set", BRIDGE, "up")

    def throttle(self, rate: str = "50mbit") -> None:
        """Shape the link towards D (where WRITEs go) to ``rate``."""
        self.unthrottle()
        subprocess.run(
            ["ip", "netns", "exec", self.ns("switch"), "tc", "qdisc", "add", "dev", "swd",
             "root", "tbf", "rate", rate, "burst", "64kbit", "latency", "2s"],
            check=True, capture_output=True, timeout=20,
        )  # fmt: skip

    def unthrottle(self) -> None:
        subprocess.run(
            ["ip", "netns", "exec", self.ns("switch"), "tc", "qdisc", "del", "dev", "swd", "root"],
            capture_output=True, timeout=20,
        )  # fmt: skip
