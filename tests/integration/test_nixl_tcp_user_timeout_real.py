# SPDX-License-Identifier: Apache-2.0
"""The TCP user timeout the connector sets reaches its NIXL agents (real NIXL agents,
UCX over TCP, two network namespaces; docs/design.md, N-REL-2 and N-LIV-1).

The worker builds its agents inside ``compat.tuned_nixl_agents(...,
tcp_user_timeout_s=ucx_tcp_user_timeout_s)``, which sets ``UCX_TCP_USER_TIMEOUT`` only
while they are built (UCX reads its environment when a context is created). Here both
agents are built that way, with the variable absent from the processes' environment
otherwise, and the link between them is cut while D sends P a notification every
0.2 s (as D re-asks a silent producer): D's send raises within T of the cut. Built
without it (0: UCX's default), no send raises in three times as long: the kernel keeps
retrying for about 15 minutes. Both bounds of N-REL-2 and N-LIV-1 rest on the first.
"""

from __future__ import annotations

import importlib
import sys
import time
from typing import Any

import pytest
from support import REPO

from devkit.testing.faults import netns

pytest.importorskip("nixl._api")
pytest.importorskip("numpy")

assert (REPO / "tools" / "nixl_release_probe.py").exists()
probe = importlib.import_module("nixl_release_probe")  # tools/ is on sys.path (support)
NETNS_REASON = netns.unavailable_reason()

TCP_USER_TIMEOUT_S = 2.0
#: UCX's error reaches the next send after the timeout: one send period and slack
SLACK_S = 2.5
WATCH_S = 3 * TCP_USER_TIMEOUT_S + SLACK_S


def _first_failed_send_after_cut(topo: Any, tmp_path: Any, tcp_user_timeout_s: float) -> Any:
    """Seconds from the cut to D's first send that raised (None: none within WATCH_S)."""
    cfg = probe.ProbeConfig(size_mib=1, ndesc=1, python=sys.executable, logdir=str(tmp_path))
    tag = f"tcp{tcp_user_timeout_s:g}"
    pair = probe._Pair(topo, cfg, {}, tag, 180, tcp_user_timeout_s=tcp_user_timeout_s)
    try:
        pair.target.send(cmd="send_sample", period=0.2, max=WATCH_S + 1.0, remove=False)
        pair.target.expect("sampling", 30)
        time.sleep(1.0)  # sends go through first
        topo.cut()
        cut_at = time.monotonic()
        got = pair.target.expect("sent_sampled", WATCH_S + 60)
    finally:
        pair.close()
        topo.restore()
    before = [s for s in got["sends"] if s[0] < cut_at and s[1] is not None]
    assert not before, f"sends failed before the cut: {before}"
    failed = [s for s in got["sends"] if s[0] >= cut_at and s[1] is not None]
    return None if not failed else failed[0][0] - cut_at


@pytest.mark.skipif(NETNS_REASON is not None, reason=f"network namespaces: {NETNS_REASON}")
@pytest.mark.timeout(300)
def test_the_connectors_tcp_user_timeout_ends_a_send_across_a_cut(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("UCX_TCP_USER_TIMEOUT", raising=False)
    topo = netns.Topology()
    try:
        topo.create()
        probe._wait_links_up(topo)
        with_t = _first_failed_send_after_cut(topo, tmp_path, TCP_USER_TIMEOUT_S)
        assert with_t is not None, f"no send raised within {WATCH_S:g}s of the cut"
        print(f"T={TCP_USER_TIMEOUT_S:g}s: D's first send raised {with_t:.2f}s after the cut")
        assert with_t <= TCP_USER_TIMEOUT_S + SLACK_S, f"the first send raised {with_t:.1f}s after"
        without_t = _first_failed_send_after_cut(topo, tmp_path, 0.0)
        assert without_t is None, (
            f"a send raised {without_t:.1f}s after the cut with UCX's default: the bound "
            "above may not come from the connector's setting"
        )
    finally:
        probe._kill_all()
        topo.destroy()
