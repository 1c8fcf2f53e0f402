# SPDX-License-Identifier: Apache-2.0
"""A stand-in for the cluster's DNS on ``test_kube_play.py``'s container network: podman
creates no Services, and its network's DNS (aardvark-dns) answers only its containers'
and pods' own names, with no SRV records and no ``<pod>.<service>.<namespace>.svc``
names. This answers the SRV and A records that ``kube_pods.cluster_dns_records``
derives from the rendered manifests (``tests/unit/proxy_fakes.FakeDns``), on UDP
``<address>:53``, until it is stopped.

Run inside the proxy image (it has dnspython and the proxy that ``proxy_fakes``
imports)::

    python cluster_dns.py <address> '<{"srv": {...}, "a": {...}}>'
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

# tests/unit is mounted beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent / "unit"))
from proxy_fakes import FakeDns  # noqa: E402


async def serve(address: str, records: dict) -> None:
    fake = FakeDns(
        srv={name: [(t, int(p)) for t, p in targets] for name, targets in records["srv"].items()},
        a=dict(records["a"]),
    )
    loop = asyncio.get_running_loop()
    await loop.create_datagram_endpoint(lambda: fake, local_addr=(address, 53))
    print(f"cluster DNS stand-in on {address}:53: {sorted(records['srv'])}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], json.loads(sys.argv[2])))
