# SPDX-License-Identifier: Apache-2.0
"""Releasing an in-flight WRITE with real NIXL agents (UCX over TCP, two namespaces).

A short scenario A of ``tools/nixl_release_probe.py`` (docs/design.md, N-REL-1): a
16 MiB WRITE over a link shaped to 40 Mbit/s (~3.5 s), released 0.5 s after the post.
It pins what NIXL 1.5 / UCX 1.23 do, which the connector's writer has to live with:
``release_xfer_handle`` returns at once while the WRITE runs, the WRITE still lands
in full afterwards, and its notification never comes. If NIXL starts to refuse the
release, or to really cancel the WRITE, this fails: then revisit ``Writes._release``
and N-REL-1.
"""

from __future__ import annotations

import importlib
import sys

import pytest
from support import REPO

from devkit.testing.faults import netns

pytest.importorskip("nixl._api")
pytest.importorskip("numpy")

assert (REPO / "tools" / "nixl_release_probe.py").exists()
probe = importlib.import_module("nixl_release_probe")  # tools/ is on sys.path (support)
NETNS_REASON = netns.unavailable_reason()


@pytest.mark.skipif(NETNS_REASON is not None, reason=f"network namespaces: {NETNS_REASON}")
@pytest.mark.timeout(180)
def test_released_in_flight_write_still_lands_in_full(tmp_path) -> None:
    cfg = probe.ProbeConfig(
        size_mib=16, ndesc=16, rate="40mbit", wait_s=0.5, repeats=1, quiet_s=1.5,
        scenario_b=False, check_after_release=False, scenario_c=False, partition_s=0,
        python=sys.executable, logdir=str(tmp_path),
    )  # fmt: skip
    res = probe.run(cfg, log=lambda m: print(m, flush=True))
    (a,) = res["scenario_a"]
    size = 16 << 20
    # the setup: the WRITE was still running when it was released
    assert a["transfer_returned"] == "PROC" and a["state_before_release"] == "PROC", a
    assert a["bytes_at_release_max"] < size, a
    # NIXL's UCX backend does not refuse: release returns (fast) while the WRITE runs ...
    assert a["release_raised"] is None, a
    assert a["release_ms"] < 100, a
    # ... and does not stop it: the rest of the WRITE lands after the release returned
    assert a["bytes_landed_after_release_returned_min"] > 0, a
    assert a["bytes_changed_after_release_returned"], a
    assert a["write_completed_fully"] and a["bytes_final"] == size, a
    # the WRITE's notification (sent by NIXL only on completion) is dropped with it
    assert not a["write_notif_arrived"], a
