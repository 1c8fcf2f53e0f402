# SPDX-License-Identifier: Apache-2.0
"""Command line of the P/D proxy (``vllm-ext-proxy`` / ``python -m vllm_ext.proxy``).

Example (push)::

    vllm-ext-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --mode push --p-engine-id prefill-0 --p-side-channel-port 5601 --port 8000
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from aiohttp import web

from vllm_ext.proxy.app import create_app, logger
from vllm_ext.proxy.config import (
    DEFAULT_KEEPALIVE_TIMEOUT,
    DEFAULT_MAX_REQUEST_BYTES,
    MODES,
    LegTimeouts,
    PrefillCoordinates,
    ProxyConfig,
)


def _seconds(text: str) -> float | None:
    """A timeout in seconds; ``0`` or ``none`` means no limit."""
    if text.lower() in ("none", "0", "0.0"):
        return None
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"timeout must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used by the launcher's tests)."""
    p = argparse.ArgumentParser(
        prog="vllm-ext-proxy",
        description="OpenAI-compatible proxy for vLLM prefill/decode disaggregation "
        "(push: concurrent legs; pull: sequential legs).",
    )
    p.add_argument("--prefill", required=True, help="P's base URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, help="D's base URL, e.g. http://127.0.0.1:8200")
    p.add_argument("--mode", choices=MODES, default="push")
    g = p.add_argument_group("P's KV coordinates (push mode)")
    g.add_argument("--p-engine-id", help="engine_id in P's --kv-transfer-config")
    g.add_argument("--p-host", default="127.0.0.1", help="P's NIXL side-channel host")
    g.add_argument("--p-side-channel-port", type=int, help="P's VLLM_NIXL_SIDE_CHANNEL_PORT")
    g.add_argument("--p-tp-size", type=int, default=1)
    g.add_argument("--p-pp-size", type=int, default=1)
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
    t.add_argument("--health-timeout", type=float, default=5.0)
    t.add_argument(
        "--keepalive-timeout",
        type=float,
        default=DEFAULT_KEEPALIVE_TIMEOUT,
        help="idle pooled connections to the engines are closed after this (keep it below "
        "the engines' own keep-alive timeout, 5 s for vLLM)",
    )
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    p.add_argument("--max-connections", type=int, default=1024, help="pool size; 0 = no limit")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """Turn parsed arguments into a :class:`ProxyConfig` (raises ``ValueError``)."""
    prefill = None
    if args.mode == "push":
        if not args.p_engine_id or args.p_side_channel_port is None:
            raise ValueError("--mode push needs --p-engine-id and --p-side-channel-port")
        prefill = PrefillCoordinates(
            engine_id=args.p_engine_id,
            host=args.p_host,
            side_channel_port=args.p_side_channel_port,
            tp_size=args.p_tp_size,
            pp_size=args.p_pp_size,
        )
    return ProxyConfig(
        prefill_url=args.prefill,
        decode_url=args.decode,
        mode=args.mode,
        prefill=prefill,
        prefill_timeouts=LegTimeouts(connect=args.connect_timeout, total=args.prefill_timeout),
        decode_timeouts=LegTimeouts(
            connect=args.connect_timeout, total=args.decode_timeout, idle=args.decode_idle_timeout
        ),
        health_timeout=args.health_timeout,
        keepalive_timeout=args.keepalive_timeout,
        max_request_bytes=args.max_request_bytes,
        max_connections=args.max_connections,
        host=args.host,
        port=args.port,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments and serve until SIGINT/SIGTERM."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    coords = config.prefill
    logger.info(
        "proxy mode=%s prefill=%s decode=%s%s listening on http://%s:%d",
        config.mode,
        config.prefill_url,
        config.decode_url,
        f" p_engine={coords.engine_id}@{coords.host}:{coords.side_channel_port}"
        f" tp={coords.tp_size} pp={coords.pp_size}"
        if coords
        else "",
        config.host,
        config.port,
    )
    web.run_app(
        create_app(config),
        host=config.host,
        port=config.port,
        handler_cancellation=True,
        access_log=None,
        print=None,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
