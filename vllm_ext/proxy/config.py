# SPDX-License-Identifier: Apache-2.0
"""Typed configuration of the P/D proxy.

Everything the proxy needs is known up front: where P and D serve HTTP, which
transfer mode drives the legs, and (push mode) P's KV coordinates, which the D
leg carries so D can register its blocks with P (SPEC S-LEG-1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["push", "pull"]
MODES: tuple[Mode, ...] = ("push", "pull")

#: Default size limit of a client request body (bytes).
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024
#: Default seconds an idle pooled connection to an engine is kept.
DEFAULT_KEEPALIVE_TIMEOUT = 2.0


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


@dataclass(frozen=True)
class ProxyConfig:
    """The proxy's whole configuration.

    ``prefill_url`` / ``decode_url``: base URLs of the engines' OpenAI servers
    (e.g. ``http://127.0.0.1:8100``). ``prefill`` is required in push mode.
    """

    prefill_url: str
    decode_url: str
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
    max_connections: int = 1024
    host: str = "127.0.0.1"
    port: int = 8000

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "push" and self.prefill is None:
            raise ValueError("push mode needs P's coordinates (engine id, side-channel port)")
        for name in ("prefill_url", "decode_url"):
            url = getattr(self, name)
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{name} must be an http(s) URL, got {url!r}")
            object.__setattr__(self, name, url.rstrip("/"))
        if self.max_request_bytes < 1:
            raise ValueError("max_request_bytes must be >= 1")
        if self.health_timeout <= 0:
            raise ValueError("health_timeout must be > 0")
        if self.keepalive_timeout <= 0:
            raise ValueError("keepalive_timeout must be > 0")
        if self.max_connections < 0:
            raise ValueError("max_connections must be >= 0 (0: unlimited)")
