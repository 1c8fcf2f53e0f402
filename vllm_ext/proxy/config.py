# SPDX-License-Identifier: Apache-2.0
"""Typed configuration of the P/D proxy.

Everything the proxy needs is known up front: where the P and D engines serve
HTTP (one or several of each: xPyD), which transfer mode drives the legs, and
(push mode) each P's KV coordinates, which the D leg carries so D can register
its blocks with the P that serves the request (SPEC S-LEG-1).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

Mode = Literal["push", "pull"]
MODES: tuple[Mode, ...] = ("push", "pull")
PushLegs = Literal["concurrent", "sequential"]
PUSH_LEGS: tuple[PushLegs, ...] = ("concurrent", "sequential")
#: how engines are weighed (vllm_ext/proxy/routing.py)
Routing = Literal["least-in-flight", "engine-load", "prefix-affinity"]
ROUTINGS: tuple[Routing, ...] = ("least-in-flight", "engine-load", "prefix-affinity")
#: Default seconds between two background /metrics scrapes of every engine ...
DEFAULT_METRICS_INTERVAL = 0.5
#: ... and the longest one may take (seconds).
DEFAULT_METRICS_TIMEOUT = 0.25
#: Default leading prompt characters hashed for prefix affinity, in whole chunks of ...
DEFAULT_PREFIX_CHARS = 512
#: ... this many characters (a prompt shorter than one chunk gets no affinity).
DEFAULT_PREFIX_CHUNK_CHARS = 64
#: Default requests by which a prefix's P may exceed the least loaded P before the
#: request spills to the next P in its rendezvous order.
DEFAULT_PREFIX_MAX_IMBALANCE = 4

#: Default size limit of a client request body (bytes).
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024
#: Default seconds an idle pooled connection to an engine is kept.
DEFAULT_KEEPALIVE_TIMEOUT = 2.0
#: Default connection pool size (each request holds two connections: its P and D legs).
DEFAULT_MAX_CONNECTIONS = 1024
#: Default limit of client requests in flight through one proxy: what the default pool
#: carries (two legs each), so that a burst past it is refused at once instead of
#: waiting for a pooled connection until the connect timeout.
DEFAULT_MAX_IN_FLIGHT = DEFAULT_MAX_CONNECTIONS // 2
#: Default transfer failures in a row that back a P-D pair off.
DEFAULT_PAIR_FAILURES = 3
#: Default seconds a proxy that got SIGTERM still accepts new requests (not ready): none
#: (a host's process manager routes nothing; behind a Service set the time its endpoints
#: take to follow, deploy/k8s: 5) ...
DEFAULT_SHUTDOWN_DELAY = 0.0
#: ... and the most seconds from SIGTERM to its exit (vllm_ext/proxy/serve.py).
DEFAULT_SHUTDOWN_GRACE = 30.0
#: Default first back-off of a pair (seconds); it doubles after each failed probe ...
DEFAULT_PAIR_BACKOFF = 10.0
#: ... up to this (seconds).
DEFAULT_PAIR_BACKOFF_MAX = 160.0


@dataclass(frozen=True)
class LegTimeouts:
    """Timeouts of one leg, in seconds (``None``: no limit).

    ``connect``: establishing the TCP connection (pool wait included).
    ``total``: the whole leg, from sending the request to the last body byte.
    ``idle``: the longest gap between two reads of the response (streams).
    """

    connect: float | None = 10.0
    total: float | None = 600.0
    idle: float | None = None

    def __post_init__(self) -> None:
        for name in ("connect", "total", "idle"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"leg timeout {name!r} must be > 0 or None, got {value!r}")


@dataclass(frozen=True)
class PrefillCoordinates:
    """Where D finds P's KV (push mode): the fields of the D leg's kv_transfer_params.

    ``engine_id`` is the ``engine_id`` in P's ``--kv-transfer-config``;
    ``side_channel_port`` is P's ``VLLM_NIXL_SIDE_CHANNEL_PORT``.
    """

    engine_id: str
    host: str = "127.0.0.1"
    side_channel_port: int = 5600
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ValueError("prefill engine_id must not be empty")
        if not self.host:
            raise ValueError("prefill side-channel host must not be empty")
        if not 0 < self.side_channel_port < 65536:
            raise ValueError(f"bad prefill side-channel port {self.side_channel_port!r}")
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError("prefill tp_size and pp_size must be >= 1")


def _base_url(what: str, url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{what} must be an http(s) URL, got {url!r}")
    return url.rstrip("/")


@dataclass(frozen=True)
class PrefillEndpoint:
    """One P engine: its OpenAI server and (push mode) its KV coordinates."""

    url: str
    coords: PrefillCoordinates | None = None
    #: how logs, errors and ``/health`` name it (default: its engine id, or its place)
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", _base_url("prefill URL", self.url))


@dataclass(frozen=True)
class DecodeEndpoint:
    """One D engine: its OpenAI server."""

    url: str
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", _base_url("decode URL", self.url))


#: Default seconds between two DNS look-ups of the engines (``--prefill-srv``/``--decode-srv``).
DEFAULT_DNS_INTERVAL = 10.0


@dataclass(frozen=True)
class Discovery:
    """Engines found by DNS instead of listed (vllm_ext/proxy/discovery.py).

    ``prefill_srv`` / ``decode_srv``: DNS SRV names whose records point at each engine's
    HTTP port (Kubernetes: ``_http._tcp.<headless service>.<namespace>.svc.cluster.local``
    for a port named ``http``). An engine is named by the first label of its record's
    target (a StatefulSet pod's name); in push mode that name is also P's engine id, and
    P's side channel is ``side_channel_port`` at the target's address. Looked up again
    every ``interval`` seconds; ``nameserver`` (``host[:port]``) replaces the system's.
    """

    prefill_srv: str = ""
    decode_srv: str = ""
    interval: float = DEFAULT_DNS_INTERVAL
    nameserver: str = ""
    side_channel_port: int = 5600
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not (self.prefill_srv or self.decode_srv):
            raise ValueError("discovery needs prefill_srv or decode_srv")
        if self.interval <= 0:
            raise ValueError("the DNS interval must be > 0")
        PrefillCoordinates("check", side_channel_port=self.side_channel_port,
                           tp_size=self.tp_size, pp_size=self.pp_size)  # fmt: skip

    def nameserver_address(self) -> tuple[str, int] | None:
        """``nameserver`` as (host, port), or ``None`` for the system's resolver."""
        if not self.nameserver:
            return None
        host, sep, port = self.nameserver.rpartition(":")
        if not sep or not port.isdigit():
            return self.nameserver, 53
        return host, int(port)


@dataclass(frozen=True)
class ProxyConfig:
    """The proxy's whole configuration.

    One P and one D: ``prefill_url`` / ``decode_url``, the base URLs of the
    engines' OpenAI servers (e.g. ``http://127.0.0.1:8100``), and ``prefill``,
    P's coordinates (required in push mode).

    xPyD: ``prefills`` / ``decodes`` instead (each P with its own coordinates in
    push mode). Either way, after construction ``prefills`` and ``decodes`` list
    every engine, and ``prefill_url`` / ``decode_url`` / ``prefill`` are the first's.
    """

    prefill_url: str = ""
    decode_url: str = ""
    mode: Mode = "push"
    prefill: PrefillCoordinates | None = None
    prefill_timeouts: LegTimeouts = field(default_factory=LegTimeouts)
    decode_timeouts: LegTimeouts = field(
        default_factory=lambda: LegTimeouts(connect=10.0, total=3600.0, idle=600.0)
    )
    health_timeout: float = 5.0
    #: seconds an idle pooled connection to an engine is kept (below the engines' own
    #: keep-alive timeout: vLLM's server closes idle connections after 5 s)
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    host: str = "127.0.0.1"
    port: int = 8000
    #: every P / D engine (xPyD); built from ``prefill_url`` / ``decode_url`` if empty
    prefills: tuple[PrefillEndpoint, ...] = ()
    decodes: tuple[DecodeEndpoint, ...] = ()
    #: seconds between two background ``/health`` probes of every engine
    health_interval: float = 2.0
    #: failed probes in a row that take an engine out of service (a refused
    #: connection takes it out at once)
    health_failures: int = 2
    #: good probes in a row that put it back
    health_successes: int = 1
    #: push mode: ``sequential`` sends the D leg only after P answered, as routers
    #: built for pull do (for A/B measurements; push wants ``concurrent``)
    push_legs: PushLegs = "concurrent"
    #: client requests in flight through the proxy past which a new one gets 429 at
    #: once (0: no limit)
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    #: transfer failures in a row of one (P, D) pair that take the pair out of the
    #: choice (engine errors, 5xx, timeouts of its legs; not 4xx, not client aborts)
    pair_failures: int = DEFAULT_PAIR_FAILURES
    #: seconds a pair stays out after that; doubled after each failed probe, up to
    #: ``pair_backoff_max``; back to ``pair_backoff`` after a success
    pair_backoff: float = DEFAULT_PAIR_BACKOFF
    pair_backoff_max: float = DEFAULT_PAIR_BACKOFF_MAX
    #: how engines are weighed: the proxy's own legs in flight, the engines' /metrics,
    #: or prompt-prefix affinity of P bounded by load (vllm_ext/proxy/routing.py)
    routing: Routing = "least-in-flight"
    #: seconds between two /metrics scrapes of every engine (engine-load, prefix-affinity)
    metrics_interval: float = DEFAULT_METRICS_INTERVAL
    #: seconds one scrape may take; a failed one falls back to the proxy's in-flight count
    metrics_timeout: float = DEFAULT_METRICS_TIMEOUT
    prefix_chars: int = DEFAULT_PREFIX_CHARS
    prefix_chunk_chars: int = DEFAULT_PREFIX_CHUNK_CHARS
    prefix_max_imbalance: int = DEFAULT_PREFIX_MAX_IMBALANCE
    #: engines found by DNS (their role's ``prefills``/``decodes`` then start empty)
    discovery: Discovery | None = None
    #: seconds after SIGTERM the proxy still accepts new requests while ``/health``
    #: says 503, and the most seconds from SIGTERM to its exit (vllm_ext/proxy/serve.py)
    shutdown_delay: float = DEFAULT_SHUTDOWN_DELAY
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    #: keys a client must send (``Authorization: Bearer <key>``) for the OpenAI routes;
    #: empty: none needed. ``/health`` and ``/metrics`` never need one.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    #: the key sent to the engines (started with vLLM's ``--api-key``) on every leg
    engine_api_key: str = field(default="", repr=False)
    #: send the client's own ``Authorization`` to the engines (without ``engine_api_key``)
    forward_authorization: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        self._set_endpoints()
        if self.mode == "push":
            self._check_push_coordinates()
        names = [ep.name for ep in self.prefills + self.decodes]  # type: ignore[operator]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique: {names}")
        if self.max_request_bytes < 1:
            raise ValueError("max_request_bytes must be >= 1")
        if self.health_timeout <= 0:
            raise ValueError("health_timeout must be > 0")
        if self.keepalive_timeout <= 0:
            raise ValueError("keepalive_timeout must be > 0")
        if self.max_connections < 0:
            raise ValueError("max_connections must be >= 0 (0: unlimited)")
        if self.push_legs not in PUSH_LEGS:
            raise ValueError(f"push_legs must be one of {PUSH_LEGS}, got {self.push_legs!r}")
        if self.health_interval <= 0:
            raise ValueError("health_interval must be > 0")
        if self.health_failures < 1 or self.health_successes < 1:
            raise ValueError("health_failures and health_successes must be >= 1")
        if self.max_in_flight < 0:
            raise ValueError("max_in_flight must be >= 0 (0: unlimited)")
        if self.pair_failures < 1:
            raise ValueError("pair_failures must be >= 1")
        if self.pair_backoff <= 0 or self.pair_backoff_max < self.pair_backoff:
            raise ValueError("pair_backoff must be > 0 and pair_backoff_max >= pair_backoff")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.metrics_interval <= 0 or self.metrics_timeout <= 0:
            raise ValueError("metrics_interval and metrics_timeout must be > 0")
        if self.prefix_chunk_chars < 1 or self.prefix_chars < self.prefix_chunk_chars:
            raise ValueError("prefix_chunk_chars must be >= 1 and prefix_chars >= it")
        if self.prefix_max_imbalance < 0:
            raise ValueError("prefix_max_imbalance must be >= 0")
        if any(not key or key != key.strip() for key in self.api_keys):
            raise ValueError("an API key must not be empty nor start or end with a space")
        if not 0 <= self.shutdown_delay <= self.shutdown_grace:
            raise ValueError("shutdown_delay must be >= 0 and shutdown_grace >= shutdown_delay")

    def _set_endpoints(self) -> None:
        """Fill ``prefills``/``decodes`` and the single-engine fields from each other."""
        prefills, decodes = tuple(self.prefills), tuple(self.decodes)
        p_by_dns = self.discovery is not None and bool(self.discovery.prefill_srv)
        d_by_dns = self.discovery is not None and bool(self.discovery.decode_srv)
        if p_by_dns and (prefills or self.prefill_url):
            raise ValueError("P engines are either listed or found by DNS, not both")
        if d_by_dns and (decodes or self.decode_url):
            raise ValueError("D engines are either listed or found by DNS, not both")
        if not prefills and not p_by_dns:
            prefills = (PrefillEndpoint(_base_url("prefill_url", self.prefill_url), self.prefill),)
        if not decodes and not d_by_dns:
            decodes = (DecodeEndpoint(_base_url("decode_url", self.decode_url)),)
        prefills = tuple(
            ep if ep.name else replace(ep, name=_default_name("prefill", i, len(prefills), ep))
            for i, ep in enumerate(prefills)
        )
        decodes = tuple(
            ep if ep.name else replace(ep, name=_default_name("decode", i, len(decodes), None))
            for i, ep in enumerate(decodes)
        )
        urls = [ep.url for ep in prefills + decodes]  # type: ignore[operator]
        if len(set(urls)) != len(urls):
            raise ValueError(f"an engine URL is listed twice: {urls}")
        object.__setattr__(self, "prefills", prefills)
        object.__setattr__(self, "decodes", decodes)
        object.__setattr__(self, "prefill_url", prefills[0].url if prefills else "")
        object.__setattr__(self, "decode_url", decodes[0].url if decodes else "")
        object.__setattr__(self, "prefill", prefills[0].coords if prefills else None)

    def _check_push_coordinates(self) -> None:
        missing = [ep.url for ep in self.prefills if ep.coords is None]
        if missing:
            raise ValueError(
                "push mode needs each P's coordinates (engine id, side-channel port); "
                f"missing for {', '.join(missing)}"
            )
        coords = [ep.coords for ep in self.prefills if ep.coords is not None]
        ids = [c.engine_id for c in coords]
        if len(set(ids)) != len(ids):
            raise ValueError(f"each P needs its own engine id, got {ids}")
        channels = [(c.host, c.side_channel_port) for c in coords]
        if len(set(channels)) != len(channels):
            raise ValueError(f"each P needs its own side channel (host, port), got {channels}")


def _default_name(role: str, index: int, count: int, endpoint: PrefillEndpoint | None) -> str:
    """``prefill`` / ``decode`` for a lone engine; else P's engine id or ``<role>-<i>``."""
    if count == 1:
        return role
    if endpoint is not None and endpoint.coords is not None:
        return endpoint.coords.engine_id
    return f"{role}-{index}"
