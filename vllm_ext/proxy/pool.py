# SPDX-License-Identifier: Apache-2.0
"""The engines behind the proxy (xPyD): health, load, and the choice per request.

Each prefill (P) and decode (D) engine is a :class:`Backend`. The pool

* counts the legs in flight on each engine (taken when a request picks it,
  given back when its leg ends, whatever the outcome);
* picks, per request, the in-service engine of a role with the fewest legs in
  flight (ties in turn, so equal engines share the load evenly); while no engine
  of a role is in service (or none is known, DNS), :class:`NoPairAvailable` says
  so and the client gets 503 with ``Retry-After`` (SPEC S-PRX-2);
* keeps the health of each (P, D) pair (:mod:`vllm_ext.proxy.pairs`): P is
  chosen among those with a usable pair and D among those usable with that P; a
  pair whose back-off elapsed gets the next request it can take (its probe);
  while no pair of in-service engines is usable, the request goes to one anyway
  (its last resort): a pair's back-off steers requests, it never refuses them;
* probes every engine's ``/health`` in the background: an engine is taken out
  after ``health_failures`` failed probes in a row (at once when its port
  refuses connections: nothing listens there) and put back after
  ``health_successes`` good probes in a row. A leg whose connection is refused
  takes its engine out the same way, without waiting for the next probe; one
  dropped before any answer counts as a failed probe. Nothing else a request
  meets (a timeout, an error answer) touches the engine's health.

The pool lives on the proxy's event loop; nothing here needs a lock.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Literal

import aiohttp

from vllm_ext.proxy.config import PrefillCoordinates, ProxyConfig
from vllm_ext.proxy.errors import redact
from vllm_ext.proxy.pairs import NoPairAvailable, PairHealth, PairLease
from vllm_ext.proxy.routing import EngineLoad, load_key, rendezvous_order, watch_loads

logger = logging.getLogger("vllm.ext.proxy")

Role = Literal["prefill", "decode"]
#: seconds between two probe rounds a waiting request may start (:meth:`Pool.recheck`)
RECHECK_INTERVAL = 0.5
ROLES: tuple[Role, ...] = ("prefill", "decode")


@dataclass
class Backend:
    """One engine: where it serves, (P, push mode) its KV coordinates, its state."""

    role: Role
    name: str
    url: str
    coords: PrefillCoordinates | None = None
    in_flight: int = 0
    up: bool = True
    #: ``up`` or ``down: <reason>`` as of the last probe or leg failure
    state: str = "up"
    fails: int = 0
    oks: int = 0
    #: legs sent to this engine since the proxy started
    picked: int = 0
    #: its last ``/metrics`` scrape (``--routing engine-load``/``prefix-affinity``);
    #: ``None`` before the first or after a failed one
    engine_load: EngineLoad | None = None
    scrapes_failed: int = 0

    def release(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {
            "role": self.role,
            "name": self.name,
            "state": redact(self.state),
            "in_service": self.up,
            "in_flight": self.in_flight,
            "picked": self.picked,
        }
        if self.engine_load is not None:
            out["engine_load"] = {
                "waiting": self.engine_load.waiting,
                "running": self.engine_load.running,
                "kv_cache_usage": self.engine_load.kv_usage,
            }
        if self.coords is not None:
            out["engine_id"] = self.coords.engine_id
        return out


class Pool:
    """The P and D engines of one proxy (see the module docstring)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.backends: dict[Role, list[Backend]] = {
            "prefill": [Backend("prefill", ep.name, ep.url, ep.coords) for ep in config.prefills],
            "decode": [Backend("decode", ep.name, ep.url) for ep in config.decodes],
        }
        self._turn: dict[Role, int] = {"prefill": 0, "decode": 0}
        #: requests whose prefix's first P was passed over for load (prefix-affinity)
        self.affinity_spills = 0
        #: the probe round each role's waiting requests share (:meth:`recheck`), and when
        #: the last one began
        self._rechecks: dict[Role, asyncio.Future[list[str]]] = {}
        self._rechecked_at: dict[Role, float] = {}
        self.pairs: dict[tuple[str, str], PairHealth] = {
            (p.name, d.name): PairHealth(p.name, d.name, config)
            for p in self.backends["prefill"]
            for d in self.backends["decode"]
        }

    def all(self) -> list[Backend]:
        return self.backends["prefill"] + self.backends["decode"]

    def several(self, role: Role) -> bool:
        """Whether ``role`` has more than one engine (errors then name the engine)."""
        return len(self.backends[role]) > 1

    # -- choice ----------------------------------------------------------------------
    def _candidates(self, role: Role) -> list[Backend]:
        """The in-service engines of ``role``; :class:`NoPairAvailable` if none is."""
        backends = self.backends[role]
        if not backends:
            raise NoPairAvailable(
                f"no {role} engine is known yet", self.retry_after_unreachable(), "no-engine"
            )
        up = [b for b in backends if b.up]
        if not up:
            why = "it fails its" if len(backends) == 1 else f"all {len(backends)} fail their"
            raise NoPairAvailable(
                f"no {role} engine is in service ({why} health checks)",
                self.retry_after_unreachable(),
                "no-engine",
                out_of_service=role,
            )
        return up

    def _load(self, backend: Backend, now: float) -> tuple:
        config = self.config
        stale_after = 4 * config.metrics_interval + config.metrics_timeout
        return load_key(backend, config.routing, now, stale_after)

    def _least_loaded(self, role: Role, candidates: list[Backend]) -> Backend:
        now = time.monotonic()
        loads = {id(b): self._load(b, now) for b in candidates}
        low = min(loads.values())
        tied = [b for b in candidates if loads[id(b)] == low]
        chosen = tied[self._turn[role] % len(tied)]
        if len(tied) > 1:  # a lone choice (e.g. the one D a P may pair with) takes no turn
            self._turn[role] += 1
        return chosen

    @staticmethod
    def _take(backend: Backend) -> Backend:
        backend.in_flight += 1
        backend.picked += 1
        return backend

    def pick(self, role: Role) -> Backend:
        """The in-service engine of ``role`` with the fewest legs in flight, taken.

        Pairs are not considered (see :meth:`pick_pair`). The caller owns one unit
        of its ``in_flight`` and must ``release()`` it.
        """
        return self._take(self._least_loaded(role, self._candidates(role)))

    def pair(self, p: Backend, d: Backend) -> PairHealth:
        return self.pairs[(p.name, d.name)]

    def _by_affinity(self, usable: list[Backend], prefix: str, now: float) -> Backend:
        """The first P in ``prefix``'s rendezvous order within ``prefix_max_imbalance``
        requests of the least loaded (bounded load: the least loaded always qualifies)."""
        loads = {id(b): self._load(b, now)[0] for b in usable}
        bound = min(loads.values()) + self.config.prefix_max_imbalance
        order = rendezvous_order(prefix, usable)
        chosen = next(b for b in order if loads[id(b)] <= bound)
        if chosen is not order[0]:
            self.affinity_spills += 1
        return chosen

    def retry_after_unreachable(self) -> int:
        """``Retry-After`` seconds for an engine that could not be reached: the next
        health probe (or DNS look-up) may bring it or another one back."""
        return max(1, math.ceil(self.config.health_interval))

    def _choose_prefill(self, now: float, prefix: str | None = None) -> Backend:
        """A P with a pair that may take a request: one owed a probe first, else by the
        routing policy (``prefix``: the request's prompt-prefix key, for affinity)."""
        ps, ds = self._candidates("prefill"), self._candidates("decode")
        probing = [p for p in ps if any(self.pair(p, d).wants_probe(now) for d in ds)]
        if probing:
            return self._least_loaded("prefill", probing)
        usable = [p for p in ps if any(self.pair(p, d).usable(now) for d in ds)] or ps
        if self.config.routing == "prefix-affinity" and prefix is not None:
            return self._by_affinity(usable, prefix, now)
        return self._least_loaded("prefill", usable)

    def _choose_decode(self, p: Backend, now: float) -> Backend:
        """A D whose pair with ``p`` may take a request: a probe first, else least loaded
        (else, no pair with ``p`` being usable, the least loaded D: the last resort)."""
        ds = self._candidates("decode")
        probing = [d for d in ds if self.pair(p, d).wants_probe(now)]
        if probing:
            return self._least_loaded("decode", probing)
        usable = [d for d in ds if self.pair(p, d).usable(now)] or ds
        return self._least_loaded("decode", usable)

    def _lease(self, p: Backend, d: Backend, now: float) -> PairLease:
        """The pair ``(p, d)`` for one request: its probe, a usual request, or its last resort."""
        pair = self.pair(p, d)
        if not pair.usable(now):
            return PairLease(pair, probe=False, last_resort=True)
        return PairLease(pair, pair.claim(now))

    def pick_pair(self, prefix: str | None = None) -> tuple[Backend, Backend, PairLease]:
        """Push mode: P and D of one request, both taken, and the lease of their pair.

        Raises :class:`NoPairAvailable` (nothing taken) when a role has no engine in service.
        """
        now = time.monotonic()
        p = self._choose_prefill(now, prefix)
        d = self._choose_decode(p, now)
        lease = self._lease(p, d, now)
        return self._take(p), self._take(d), lease

    def pick_prefill(self, prefix: str | None = None) -> Backend:
        """Pull mode: the P of a request (taken), among those with a usable pair."""
        return self._take(self._choose_prefill(time.monotonic(), prefix))

    def pick_decode(self, p: Backend) -> tuple[Backend, PairLease]:
        """Pull mode, once ``p`` answered: the D (taken) and the lease of the pair."""
        now = time.monotonic()
        d = self._choose_decode(p, now)
        lease = self._lease(p, d, now)
        return self._take(d), lease

    def any_pair_usable(self) -> bool:
        """Whether some pair of in-service engines may take a request now."""
        now = time.monotonic()
        ps = [b for b in self.backends["prefill"] if b.up]
        ds = [b for b in self.backends["decode"] if b.up]
        return any(self.pair(p, d).usable(now) for p in ps for d in ds)

    def describe_pairs(self) -> list[dict[str, object]]:
        now = time.monotonic()
        return [pair.describe(now) for pair in self.pairs.values()]

    def peek(self, role: Role) -> Backend:
        """Like :meth:`pick`, without taking a share of the engine's load."""
        chosen = self.pick(role)
        chosen.release()
        chosen.picked -= 1
        return chosen

    # -- engines found by DNS (vllm_ext/proxy/discovery.py) -----------------------------
    def set_engines(self, role: Role, found: list[Backend]) -> tuple[list[str], list[str]]:
        """Make ``found`` the engines of ``role``; returns the names (added, removed).

        An engine found again at the same URL and coordinates keeps its state (health,
        load, its pairs' records); one whose URL or coordinates changed (a pod that came
        back elsewhere) is new. Legs in flight on a removed engine end as they would.
        """
        current = {b.name: b for b in self.backends[role]}
        kept: list[Backend] = []
        added: list[str] = []
        for b in found:
            old = current.get(b.name)
            if old is not None and (old.url, old.coords) == (b.url, b.coords):
                kept.append(old)
            else:
                kept.append(b)
                added.append(b.name)
        ids = {id(b) for b in kept}
        removed = [b.name for b in self.backends[role] if id(b) not in ids]
        if not added and not removed:
            return added, removed
        self.backends[role] = kept
        pairs = {}
        for p in self.backends["prefill"]:
            for d in self.backends["decode"]:
                pair = self.pairs.get((p.name, d.name))
                fresh = p.name in added or d.name in added
                pairs[(p.name, d.name)] = (
                    PairHealth(p.name, d.name, self.config) if pair is None or fresh else pair
                )
        self.pairs = pairs
        return added, removed

    # -- health ----------------------------------------------------------------------
    def record(self, backend: Backend, state: str, refused: bool = False) -> None:
        """Account one health observation (``up`` or ``down: ...``) of ``backend``."""
        if state == "up":
            backend.fails = 0
            backend.oks += 1
            if not backend.up and backend.oks >= self.config.health_successes:
                backend.up = True
                logger.warning(
                    "%s engine %s (%s) healthy again: back in service",
                    backend.role,
                    backend.name,
                    backend.url,
                )
            backend.state = "up" if backend.up else f"recovering ({backend.oks} good probes)"
            return
        backend.oks = 0
        backend.fails += 1
        backend.state = state
        if backend.up and (refused or backend.fails >= self.config.health_failures):
            backend.up = False
            logger.warning(
                "%s engine %s (%s) taken out of service: %s",
                backend.role,
                backend.name,
                backend.url,
                state,
            )

    def leg_unreachable(self, backend: Backend, reason: str) -> None:
        """A leg found nothing listening at ``backend``: take it out now."""
        self.record(backend, f"down: {reason}", refused=True)

    def leg_dropped(self, backend: Backend, reason: str) -> None:
        """A leg's new connection to ``backend`` was dropped before any answer: that
        counts as one failed health probe (``health_failures`` in a row take it out)."""
        self.record(backend, f"down: dropped before any answer: {reason}")

    async def probe(self, session: aiohttp.ClientSession, backend: Backend) -> str:
        """Probe ``backend``'s ``/health`` once, account it, return the observation."""
        timeout = self.config.health_timeout
        refused = False
        try:
            async with session.get(
                backend.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                await resp.read()
                state = "up" if resp.status == 200 else f"down: HTTP {resp.status}"
        except TimeoutError:
            state = f"down: no answer within {timeout:g}s"
        except aiohttp.ClientError as exc:
            refused = isinstance(exc, aiohttp.ClientConnectorError)
            state = f"down: {type(exc).__name__}: {exc}"
        self.record(backend, state, refused=refused)
        return state

    async def recheck(self, session: aiohttp.ClientSession, role: Role) -> bool:
        """Probe now the engines of ``role`` (all out of service: a request is waiting);
        whether one is back in service. Concurrent callers share one round, and a role is
        probed so at most every :data:`RECHECK_INTERVAL` seconds, so that requests
        arriving while its engines are down cost them no more than the background probes.
        """
        task = self._rechecks.get(role)
        if task is None:
            now = time.monotonic()
            if now - self._rechecked_at.get(role, -math.inf) < RECHECK_INTERVAL:
                return any(b.up for b in self.backends[role])
            self._rechecked_at[role] = now
            task = asyncio.ensure_future(self.probe_all(session, list(self.backends[role])))
            self._rechecks[role] = task
            task.add_done_callback(lambda _: self._rechecks.pop(role, None))
        try:
            await asyncio.shield(task)
        except Exception:  # a probe round never fails the request
            logger.exception("probe round of the %s engines failed", role)
        return any(b.up for b in self.backends[role])

    async def probe_all(
        self, session: aiohttp.ClientSession, backends: list[Backend] | None = None
    ) -> list[str]:
        """Probe ``backends`` (default: every engine now) at once; their observations."""
        chosen = self.all() if backends is None else backends
        return list(await asyncio.gather(*(self.probe(session, b) for b in chosen)))

    async def watch(self, session: aiohttp.ClientSession) -> None:
        """Probe every engine every ``health_interval`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(self.config.health_interval)
            try:
                await self.probe_all(session)
            except Exception:  # a probe round must never end the loop
                logger.exception("health probe round failed")

    async def watch_loads(self, session: aiohttp.ClientSession) -> None:
        """Scrape every engine's ``/metrics`` in the background (routing by engine load)."""
        await watch_loads(
            session, self.all, self.config.metrics_interval, self.config.metrics_timeout
        )
