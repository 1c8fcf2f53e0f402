# SPDX-License-Identifier: Apache-2.0
"""Command line of the P/D proxy (``vllm-ext-proxy`` / ``python -m vllm_ext.proxy``).

Example (push, 1P1D)::

    vllm-ext-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --mode push --p-engine-id prefill-0 --p-side-channel-port 5601 --port 8000

xPyD: repeat ``--prefill`` and ``--decode``; each P names its own coordinates::

    vllm-ext-proxy --mode push --port 8000 \\
        --prefill http://127.0.0.1:8100,engine_id=P0,side_channel_port=5601 \\
        --prefill http://127.0.0.1:8101,engine_id=P1,side_channel_port=5602 \\
        --decode http://127.0.0.1:8200 --decode http://127.0.0.1:8201
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from vllm_ext.log import LOG_FORMATS, json_handler
from vllm_ext.proxy.app import create_app, logger
from vllm_ext.proxy.config import (
    DEFAULT_DNS_INTERVAL,
    DEFAULT_KEEPALIVE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_METRICS_INTERVAL,
    DEFAULT_METRICS_TIMEOUT,
    DEFAULT_PAIR_BACKOFF,
    DEFAULT_PAIR_BACKOFF_MAX,
    DEFAULT_PAIR_FAILURES,
    DEFAULT_PREFIX_CHARS,
    DEFAULT_PREFIX_CHUNK_CHARS,
    DEFAULT_PREFIX_MAX_IMBALANCE,
    DEFAULT_SHUTDOWN_DELAY,
    DEFAULT_SHUTDOWN_GRACE,
    MODES,
    PUSH_LEGS,
    ROUTINGS,
    DecodeEndpoint,
    Discovery,
    LegTimeouts,
    PrefillCoordinates,
    PrefillEndpoint,
    ProxyConfig,
)
from vllm_ext.proxy.serve import serve
from vllm_ext.proxy.workers import supervise, this_worker

#: ``key=value`` options of a ``--prefill`` / ``--decode`` value, with their types.
PREFILL_KEYS: dict[str, type] = {
    "engine_id": str,
    "host": str,
    "side_channel_port": int,
    "tp_size": int,
    "pp_size": int,
    "name": str,
}
DECODE_KEYS: dict[str, type] = {"name": str}


def parse_endpoint(text: str, keys: dict[str, type]) -> tuple[str, dict[str, object]]:
    """``URL[,key=value...]`` -> (URL, options); raises ``ValueError`` naming the bad part."""
    url, *items = [part.strip() for part in text.split(",")]
    if not url:
        raise ValueError(f"{text!r}: the URL is missing")
    options: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in keys:
            raise ValueError(
                f"{text!r}: bad option {item!r} (expected key=value, keys: {', '.join(keys)})"
            )
        if key in options:
            raise ValueError(f"{text!r}: {key} given twice")
        try:
            options[key] = keys[key](value)
        except ValueError as exc:
            raise ValueError(f"{text!r}: {key} must be {keys[key].__name__}") from exc
    return url, options


def _seconds(text: str) -> float | None:
    """A timeout in seconds; ``0`` or ``none`` means no limit."""
    if text.lower() in ("none", "0", "0.0"):
        return None
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"timeout must be >= 0, got {text}")
    return value


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in ``--help``, except where there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used by the launcher's tests)."""
    p = argparse.ArgumentParser(
        prog="vllm-ext-proxy",
        description="OpenAI-compatible proxy for vLLM prefill/decode disaggregation "
        "(push: concurrent legs; pull: sequential legs). Every flag: docs/proxy.md.",
        formatter_class=_DefaultsShown,
    )
    p.add_argument(
        "--prefill",
        action="append",
        metavar="URL[,key=value...]",
        help="a P engine: base URL, e.g. http://127.0.0.1:8100, and (push mode, several P) "
        "its coordinates: engine_id=, side_channel_port=, host=, tp_size=, pp_size= "
        "(defaults: the --p-* options); name= names it in logs. Repeat for xPyD. "
        "Required unless --prefill-srv.",
    )
    p.add_argument(
        "--decode",
        action="append",
        metavar="URL[,name=NAME]",
        help="a D engine's base URL, e.g. http://127.0.0.1:8200. Repeat for xPyD. "
        "Required unless --decode-srv.",
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="push",
        help="push: P writes the KV to D, both legs at once; pull: D reads it after P answered",
    )
    p.add_argument(
        "--push-legs",
        choices=PUSH_LEGS,
        default="concurrent",
        help="push mode: 'sequential' sends the D leg after P answered, as a router built "
        "for pull does (A/B measurements only)",
    )
    g = p.add_argument_group(
        "P's KV coordinates (push mode; with several P, engine id and port go in each --prefill)"
    )
    g.add_argument("--p-engine-id", help="engine_id in P's --kv-transfer-config")
    g.add_argument("--p-host", default="127.0.0.1", help="P's NIXL side-channel host")
    g.add_argument("--p-side-channel-port", type=int, help="P's VLLM_NIXL_SIDE_CHANNEL_PORT")
    g.add_argument("--p-tp-size", type=int, default=1, help="P's tensor-parallel size")
    g.add_argument("--p-pp-size", type=int, default=1, help="P's pipeline-parallel size")
    dns = p.add_argument_group(
        "engines found by DNS (instead of --prefill / --decode)",
        "Each SRV record of the name is one engine at its target's address and port, named "
        "by the target's first label (a StatefulSet pod's name), which for P is also its "
        "engine_id; P's side channel is --p-side-channel-port at that address. Looked up "
        "again every --dns-interval seconds: engines come and go with the records.",
    )
    dns.add_argument(
        "--prefill-srv",
        metavar="NAME",
        help="SRV name of the P engines' HTTP port, e.g. "
        "_http._tcp.vllm-prefill.vllm-pd.svc.cluster.local",
    )
    dns.add_argument("--decode-srv", metavar="NAME", help="SRV name of the D engines' HTTP port")
    dns.add_argument(
        "--dns-interval",
        type=float,
        default=DEFAULT_DNS_INTERVAL,
        help="seconds between two look-ups",
    )
    dns.add_argument(
        "--dns-server",
        metavar="HOST[:PORT]",
        help="ask this DNS server (default: the system's resolver)",
    )
    h = p.add_argument_group("health checks (background, every engine)")
    h.add_argument("--health-interval", type=float, default=2.0, help="seconds between probes")
    h.add_argument(
        "--health-failures",
        type=int,
        default=2,
        help="failed probes in a row that take an engine out of service "
        "(a refused connection takes it out at once)",
    )
    h.add_argument(
        "--health-successes", type=int, default=1, help="good probes in a row that put it back"
    )
    pair = p.add_argument_group(
        "pair health (each P-D pair: KV must cross between them)",
        "Transfer failures (engine errors, 5xx, timeouts of either leg; not 4xx, not client "
        "aborts) in a row back a pair off; the choice skips it meanwhile, then one request "
        "probes it. While no pair may serve, clients get 503 with Retry-After.",
    )
    pair.add_argument(
        "--pair-failures",
        type=int,
        default=DEFAULT_PAIR_FAILURES,
        help="transfer failures in a row that back a pair off",
    )
    pair.add_argument(
        "--pair-backoff",
        type=float,
        default=DEFAULT_PAIR_BACKOFF,
        help="seconds of the first back-off; doubled after each failed probe",
    )
    pair.add_argument(
        "--pair-backoff-max",
        type=float,
        default=DEFAULT_PAIR_BACKOFF_MAX,
        help="longest back-off, seconds",
    )
    r = p.add_argument_group(
        "routing (how engines are weighed)",
        "least-in-flight: the legs this proxy has in flight on each engine (exact while it "
        "is the engines' only client); engine-load: the engines' own /metrics (requests "
        "waiting + running), scraped in the background, so other clients' load counts; "
        "prefix-affinity: P by rendezvous hash of the prompt's leading chunks (prefix cache "
        "hits), bounded by that load.",
    )
    r.add_argument("--routing", choices=ROUTINGS, default="least-in-flight", help="see above")
    r.add_argument(
        "--metrics-interval-ms",
        type=float,
        default=DEFAULT_METRICS_INTERVAL * 1000,
        help="milliseconds between two /metrics scrapes of every engine",
    )
    r.add_argument(
        "--metrics-timeout-ms",
        type=float,
        default=DEFAULT_METRICS_TIMEOUT * 1000,
        help="longest scrape, milliseconds; an engine whose scrape fails counts with the "
        "proxy's own in-flight legs",
    )
    r.add_argument(
        "--prefix-chars",
        type=int,
        default=DEFAULT_PREFIX_CHARS,
        help="leading prompt characters hashed for prefix affinity",
    )
    r.add_argument(
        "--prefix-chunk-chars",
        type=int,
        default=DEFAULT_PREFIX_CHUNK_CHARS,
        help="the prefix is hashed in whole chunks of this many characters",
    )
    r.add_argument(
        "--prefix-max-imbalance",
        type=int,
        default=DEFAULT_PREFIX_MAX_IMBALANCE,
        help="requests by which a prefix's P may exceed the least loaded P before the "
        "request goes to the next P in its order",
    )
    t = p.add_argument_group("timeouts (seconds; 0 = none)")
    t.add_argument("--connect-timeout", type=_seconds, default=10.0, help="both legs")
    t.add_argument("--prefill-timeout", type=_seconds, default=600.0, help="P leg, total")
    t.add_argument("--decode-timeout", type=_seconds, default=3600.0, help="D leg, total")
    t.add_argument(
        "--decode-idle-timeout",
        type=_seconds,
        default=600.0,
        help="D leg, longest wait for the next bytes (non-streaming: for the whole answer)",
    )
    t.add_argument("--health-timeout", type=float, default=5.0, help="one health probe")
    t.add_argument(
        "--keepalive-timeout",
        type=float,
        default=DEFAULT_KEEPALIVE_TIMEOUT,
        help="idle pooled connections to the engines are closed after this (keep it below "
        "the engines' own keep-alive timeout, 5 s for vLLM)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest client request body; a larger one gets 413",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="pool size; 0 = no limit",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=DEFAULT_MAX_IN_FLIGHT,
        help="client requests in flight past which new ones get 429 with Retry-After at once "
        "(the default is what the default pool carries, two legs each); 0 = no limit",
    )
    s = p.add_argument_group(
        "shutdown (SIGTERM: drain)",
        "On SIGTERM /health answers 503 at once; new requests are still served for "
        "--shutdown-delay seconds (until the Service stops routing here), then the proxy "
        "stops listening, lets what is in flight finish and exits, at most --shutdown-grace "
        "seconds after the signal (requests still running then are cut). SIGINT skips the "
        "delay; a second signal exits at once.",
    )
    s.add_argument(
        "--shutdown-delay",
        type=float,
        default=DEFAULT_SHUTDOWN_DELAY,
        help="seconds new requests are still accepted after SIGTERM",
    )
    s.add_argument(
        "--shutdown-grace",
        type=float,
        default=DEFAULT_SHUTDOWN_GRACE,
        help="most seconds from SIGTERM to exit (keep it below the pod's "
        "terminationGracePeriodSeconds)",
    )
    a = p.add_argument_group(
        "authentication",
        f"Keys are best given in the environment (${API_KEY_ENV}, ${ENGINE_API_KEY_ENV}): "
        "a command line is visible to every user of the host. /health and /metrics never "
        "need a key.",
    )
    a.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="clients of the OpenAI routes must send Authorization: Bearer KEY (else 401); "
        f"repeat for several keys (rotation). Also ${API_KEY_ENV} (comma-separated). "
        "None: no key needed",
    )
    a.add_argument(
        "--engine-api-key",
        metavar="KEY",
        help="sent as Authorization: Bearer KEY on every leg (engines started with vLLM's "
        f"--api-key). Also ${ENGINE_API_KEY_ENV}",
    )
    a.add_argument(
        "--forward-authorization",
        action="store_true",
        help="send the client's own Authorization header to the engines (without "
        "--engine-api-key); by default it stays at the proxy",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; 0.0.0.0 listens on every interface (a pod: the Service, the "
        "kubelet's probes and kubectl port-forward reach it)",
    )
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="proxy processes sharing the port (SO_REUSEPORT), each with its own pool and "
        "admission (the in-flight and connection limits hold per worker); /metrics sums "
        "them all",
    )
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="INFO",
        help="the proxy's log level (any case)",
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text: one key=value line per request; json: one JSON object a line "
        "(time, level, logger, message, and a request's fields as keys of their own: "
        "event, request_id, status, ...)",
    )
    p.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="asyncio",
        help="the event loop: Python's own, or uvloop's (the uvloop package must be "
        "installed; it measured no less CPU per request than Python's own on a 2-vCPU VM: "
        "docs/benchmarks.md, The proxy at scale)",
    )
    return p


#: environment variables that give the keys instead of the command line
API_KEY_ENV = "VLLM_EXT_PROXY_API_KEY"
ENGINE_API_KEY_ENV = "VLLM_EXT_PROXY_ENGINE_API_KEY"

#: ``--log-level`` values
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

#: ``--event-loop`` values
EVENT_LOOPS = ("asyncio", "uvloop")


def new_event_loop(kind: str) -> asyncio.AbstractEventLoop:
    """The event loop the proxy runs on (``--event-loop``); ``uvloop`` needs the package."""
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _prefill_endpoints(args: argparse.Namespace) -> tuple[PrefillEndpoint, ...]:
    """The ``--prefill`` values, their coordinates completed from the ``--p-*`` options."""
    parsed = [parse_endpoint(text, PREFILL_KEYS) for text in args.prefill]
    lone = len(parsed) == 1
    if not lone and (args.p_engine_id or args.p_side_channel_port is not None):
        raise ValueError(
            "with several --prefill, give each its engine_id= and side_channel_port= "
            "instead of --p-engine-id / --p-side-channel-port"
        )
    out = []
    for url, opts in parsed:
        coords = None
        engine_id = opts.get("engine_id", args.p_engine_id if lone else None)
        port = opts.get("side_channel_port", args.p_side_channel_port if lone else None)
        if args.mode == "push":
            if not engine_id or port is None:
                raise ValueError(
                    "--mode push needs --p-engine-id and --p-side-channel-port"
                    if lone
                    else f"--prefill {url}: push mode needs engine_id= and side_channel_port="
                )
            coords = PrefillCoordinates(
                engine_id=str(engine_id),
                host=str(opts.get("host", args.p_host)),
                side_channel_port=int(port),  # type: ignore[call-overload]
                tp_size=int(opts.get("tp_size", args.p_tp_size)),  # type: ignore[call-overload]
                pp_size=int(opts.get("pp_size", args.p_pp_size)),  # type: ignore[call-overload]
            )
        out.append(PrefillEndpoint(url, coords, name=str(opts.get("name", ""))))
    return tuple(out)


def _discovery(args: argparse.Namespace) -> Discovery | None:
    """The DNS names to find engines by, checked against the listed engines."""
    for listed, srv, role in ((args.prefill, args.prefill_srv, "prefill"),
                              (args.decode, args.decode_srv, "decode")):  # fmt: skip
        if bool(listed) == bool(srv):
            raise ValueError(f"give either --{role} or --{role}-srv (one of them)")
    if not (args.prefill_srv or args.decode_srv):
        return None
    if args.prefill_srv and args.mode == "push" and args.p_side_channel_port is None:
        raise ValueError("--prefill-srv in push mode needs --p-side-channel-port")
    if args.prefill_srv and args.p_engine_id:
        raise ValueError("--prefill-srv names each P by its record: no --p-engine-id")
    return Discovery(
        prefill_srv=args.prefill_srv or "",
        decode_srv=args.decode_srv or "",
        interval=args.dns_interval,
        nameserver=args.dns_server or "",
        side_channel_port=args.p_side_channel_port or 5600,
        tp_size=args.p_tp_size,
        pp_size=args.p_pp_size,
    )


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """Turn parsed arguments into a :class:`ProxyConfig` (raises ``ValueError``)."""
    discovery = _discovery(args)
    decodes = []
    for text in args.decode or ():
        url, opts = parse_endpoint(text, DECODE_KEYS)
        decodes.append(DecodeEndpoint(url, name=str(opts.get("name", ""))))
    return ProxyConfig(
        mode=args.mode,
        prefills=_prefill_endpoints(args) if args.prefill else (),
        decodes=tuple(decodes),
        discovery=discovery,
        prefill_timeouts=LegTimeouts(connect=args.connect_timeout, total=args.prefill_timeout),
        decode_timeouts=LegTimeouts(
            connect=args.connect_timeout, total=args.decode_timeout, idle=args.decode_idle_timeout
        ),
        health_timeout=args.health_timeout,
        health_interval=args.health_interval,
        health_failures=args.health_failures,
        health_successes=args.health_successes,
        push_legs=args.push_legs,
        keepalive_timeout=args.keepalive_timeout,
        max_request_bytes=args.max_request_bytes,
        max_connections=args.max_connections,
        max_in_flight=args.max_in_flight,
        pair_failures=args.pair_failures,
        pair_backoff=args.pair_backoff,
        pair_backoff_max=args.pair_backoff_max,
        routing=args.routing,
        metrics_interval=args.metrics_interval_ms / 1000,
        metrics_timeout=args.metrics_timeout_ms / 1000,
        prefix_chars=args.prefix_chars,
        prefix_chunk_chars=args.prefix_chunk_chars,
        prefix_max_imbalance=args.prefix_max_imbalance,
        host=args.host,
        port=args.port,
        shutdown_delay=args.shutdown_delay,
        shutdown_grace=args.shutdown_grace,
        api_keys=_api_keys(args),
        engine_api_key=args.engine_api_key or os.environ.get(ENGINE_API_KEY_ENV, ""),
        forward_authorization=args.forward_authorization,
    )


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The clients' keys: ``--api-key`` values and ``$VLLM_EXT_PROXY_API_KEY``'s."""
    from_env = [k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    return tuple(args.api_key or ()) + tuple(from_env)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments and serve until SIGINT/SIGTERM (then drain: vllm_ext/proxy/serve.py)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    worker = this_worker() if args.workers > 1 else None
    if args.workers > 1 and config.port == 0:
        parser.error("--workers needs a fixed --port (port 0 would give each its own)")
    if args.log_format == "json":
        try:
            handler = json_handler()
        except ImportError as exc:
            parser.error(f"--log-format json needs python-json-logger: {exc}")
        logging.basicConfig(level=args.log_level, handlers=[handler])
    else:
        logging.basicConfig(
            level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    if args.workers > 1 and worker is None:
        return supervise(list(sys.argv[1:] if argv is None else argv), args.workers)
    for ep in config.prefills:
        coords = ep.coords
        logger.info(
            "proxy prefill %s: %s%s",
            ep.name,
            ep.url,
            f" p_engine={coords.engine_id}@{coords.host}:{coords.side_channel_port}"
            f" tp={coords.tp_size} pp={coords.pp_size}"
            if coords
            else "",
        )
    for dep in config.decodes:
        logger.info("proxy decode %s: %s", dep.name, dep.url)
    try:
        loop = new_event_loop(args.event_loop)
    except ImportError as exc:
        parser.error(f"--event-loop {args.event_loop}: {exc}")
    found = config.discovery
    logger.info(
        "proxy mode=%s prefill=%s decode=%s listening on http://%s:%d (event loop: %s)",
        config.mode,
        f"SRV {found.prefill_srv}"
        if found and found.prefill_srv
        else ",".join(ep.url for ep in config.prefills),
        f"SRV {found.decode_srv}"
        if found and found.decode_srv
        else ",".join(ep.url for ep in config.decodes),
        config.host,
        config.port,
        type(loop).__module__.split(".")[0],
    )
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(
            serve(
                create_app(config, worker),
                config.host,
                config.port,
                config.shutdown_delay,
                config.shutdown_grace,
                worker=worker is not None,
            )
        )
    finally:
        loop.close()
    logger.info("proxy stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
