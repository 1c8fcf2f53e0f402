# SPDX-License-Identifier: Apache-2.0
"""Engines found by DNS: the proxy looks up SRV records of P and D and follows them.

With ``--prefill-srv`` / ``--decode-srv`` the proxy lists no engine up front. It looks
up each name's SRV records at start and every ``--dns-interval`` seconds: each record
is one engine, at ``http://<its target's address>:<its port>``, named by the first label
of its target. On Kubernetes a headless Service over a StatefulSet gives exactly that:
``_http._tcp.<service>.<namespace>.svc.cluster.local`` has one record per ready pod,
whose target is ``<pod name>.<service>...``; a P's pod name is its ``engine_id``
(``$(POD_NAME)`` in its ``--kv-transfer-config``), so the D leg can name P's engine id
and side channel (``--p-side-channel-port`` at the pod's address) without a list.

Scaling the StatefulSet adds or removes records; the next look-up adds or removes the
engines (:meth:`~vllm_ext.proxy.pool.Pool.set_engines`): an engine found again at the
same address keeps its health and load, one that came back at a new address is new.
A look-up that fails (timeout, server failure) keeps the engines known so far and is
counted (``vllm_ext_proxy_discovery_failures_total``); a name that does not exist or
has no record means no engine of that role (the proxy then answers 503).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.resolver

from vllm_ext.proxy.config import Discovery, PrefillCoordinates, ProxyConfig
from vllm_ext.proxy.pool import Backend, Pool, Role

logger = logging.getLogger("vllm.ext.proxy")

#: longest one DNS question may take, retries included (seconds); the next round starts
#: ``interval`` seconds after a round ended, so a slow server never stacks look-ups
MAX_LOOKUP_SECONDS = 5.0


@dataclass(frozen=True)
class FoundEngine:
    """One SRV record, resolved: the engine's name, address and HTTP port."""

    name: str
    address: str
    port: int


def make_resolver(discovery: Discovery) -> dns.asyncresolver.Resolver:
    """The system's resolver, or one that asks only ``discovery.nameserver``."""
    server = discovery.nameserver_address()
    if server is None:
        resolver = dns.asyncresolver.Resolver()
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [server[0]]
        resolver.port = server[1]
    resolver.lifetime = MAX_LOOKUP_SECONDS
    return resolver


async def lookup(resolver: dns.asyncresolver.Resolver, srv: str) -> list[FoundEngine]:
    """The engines behind ``srv``, in a stable order; ``[]`` when the name has none.

    Raises :class:`dns.exception.DNSException` when DNS gives no answer (timeout,
    server failure): the caller keeps what it knew.
    """
    try:
        answer = await resolver.resolve(srv, "SRV", search=True)
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return []
    found: dict[str, FoundEngine] = {}
    for record in sorted(answer, key=lambda r: r.target.to_text()):  # type: ignore[attr-defined]
        target = record.target.to_text(omit_final_dot=True)  # type: ignore[attr-defined]
        name = target.split(".")[0]
        if name in found:  # one engine per name (its engine id): the first record wins
            logger.warning("discovery: %s names %s twice; the second is ignored", srv, name)
            continue
        addresses = await resolver.resolve(record.target, "A")  # type: ignore[attr-defined]
        address = sorted(a.to_text() for a in addresses)[0]
        found[name] = FoundEngine(name, address, int(record.port))  # type: ignore[attr-defined]
    return list(found.values())


def to_backend(role: Role, engine: FoundEngine, config: ProxyConfig) -> Backend:
    """The pool's view of a found engine (a P carries its coordinates in push mode)."""
    discovery = config.discovery
    assert discovery is not None
    coords = None
    if role == "prefill" and config.mode == "push":
        coords = PrefillCoordinates(
            engine_id=engine.name,
            host=engine.address,
            side_channel_port=discovery.side_channel_port,
            tp_size=discovery.tp_size,
            pp_size=discovery.pp_size,
        )
    return Backend(role, engine.name, f"http://{engine.address}:{engine.port}", coords)


class EngineDiscovery:
    """Keeps the pool's engines of the roles found by DNS as DNS says."""

    def __init__(self, config: ProxyConfig, pool: Pool, failed: Callable[[Role], None]) -> None:
        assert config.discovery is not None
        self.config = config
        self.discovery = config.discovery
        self.pool = pool
        self._failed = failed
        self.resolver = make_resolver(config.discovery)
        self.names: dict[Role, str] = {}
        if self.discovery.prefill_srv:
            self.names["prefill"] = self.discovery.prefill_srv
        if self.discovery.decode_srv:
            self.names["decode"] = self.discovery.decode_srv

    async def refresh(self) -> None:
        """Look every name up once (the roles at once) and apply what changed; a failed
        look-up keeps that role's engines."""
        roles = list(self.names)
        results = await asyncio.gather(
            *(lookup(self.resolver, self.names[role]) for role in roles), return_exceptions=True
        )
        for role, found in zip(roles, results):
            srv = self.names[role]
            if isinstance(found, dns.exception.DNSException):
                self._failed(role)
                logger.warning(
                    "discovery: looking up %s engines at %s failed (%s: %s); keeping the %d known",
                    role,
                    srv,
                    type(found).__name__,
                    found,
                    len(self.pool.backends[role]),
                )
                continue
            if isinstance(found, BaseException):
                raise found
            backends = [to_backend(role, engine, self.config) for engine in found]
            added, removed = self.pool.set_engines(role, backends)
            if added or removed:
                logger.warning(
                    "discovery: %s engines now %s (added %s, removed %s; from %s)",
                    role,
                    ", ".join(f"{b.name}={b.url}" for b in backends) or "none",
                    added or "none",
                    removed or "none",
                    srv,
                )

    async def watch(self) -> None:
        """Look the names up again every ``interval`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(self.discovery.interval)
            try:
                await self.refresh()
            except Exception:  # a round must never end the loop
                logger.exception("discovery round failed")
