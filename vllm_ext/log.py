# SPDX-License-Identifier: Apache-2.0
"""Loggers that print through vLLM's logging setup, or as JSON lines on request.

vLLM configures only the ``vllm`` logger tree (handler, format, level from
``VLLM_LOGGING_LEVEL``). Our loggers live under ``vllm.ext`` so their lines look
like and are filtered like vLLM's own. With ``VLLM_EXT_LOG_FORMAT=json`` the
connector's lines are JSON objects instead, one a line on stderr (:func:`json_handler`),
with the fields of :func:`event` where a line tells of one request; vLLM's own lines
keep vLLM's format.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, TextIO

#: ``text`` (vLLM's format) or ``json``: the format of the connector's log lines
LOG_FORMAT_ENV = "VLLM_EXT_LOG_FORMAT"
LOG_FORMATS = ("text", "json")


def get_logger(module_name: str) -> logging.Logger:
    """``get_logger(__name__)`` -> the ``vllm.ext.<module>`` logger."""
    short = module_name.removeprefix("vllm_ext").lstrip(".") or "plugin"
    json_lines = log_format() == "json"
    try:
        from vllm import logger as vllm_logger
    except ImportError:  # tools that run without vLLM installed
        return _as_json(logging.getLogger(f"vllm.ext.{short}"), json_lines)
    _ensure_vllm_logging(vllm_logger)
    return _as_json(vllm_logger.init_logger(f"vllm.ext.{short}"), json_lines)


def event(name: str, request_id: str | None = None, **fields: Any) -> dict[str, Any]:
    """The ``extra`` of a log line that tells of an event (of one request): fields of
    its own in a JSON line (``event``, ``request_id``, ...); the text line is unchanged.
    ``logger.warning("push: %s ...", rid, extra=event("push_quarantined", rid))``."""
    out: dict[str, Any] = {"event": name}
    if request_id is not None:
        out["request_id"] = request_id
    out.update(fields)
    return out


def json_handler(stream: TextIO | None = None) -> logging.Handler:
    """A handler that writes each record as one JSON object (python-json-logger):
    ``time``, ``level``, ``logger``, ``message``, and the record's :func:`event`
    fields; a traceback as ``exc_info``."""
    from pythonjsonlogger.json import JsonFormatter

    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(
        JsonFormatter(
            "{asctime}{levelname}{name}{message}",
            style="{",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        )
    )
    return handler


def log_format() -> str:
    """``$VLLM_EXT_LOG_FORMAT`` checked: ``text`` (unset) or ``json``."""
    value = os.environ.get(LOG_FORMAT_ENV, "text").strip().lower() or "text"
    if value not in LOG_FORMATS:
        raise ValueError(f"{LOG_FORMAT_ENV}={value!r}: expected one of {', '.join(LOG_FORMATS)}")
    return value


class _JsonLines(logging.Filter):
    """On one of our loggers: writes each record it lets through as a JSON line, and
    stops the record there (vLLM's text handler never sees it). A filter, not a
    handler: vLLM's configuration of its logger tree, which may come after our loggers
    exist, resets their handlers and ``propagate`` but keeps their filters."""

    def __init__(self) -> None:
        super().__init__()
        self.handler = json_handler()

    def filter(self, record: logging.LogRecord) -> bool:
        self.handler.handle(record)
        return False


def _as_json(logger: logging.Logger, json_lines: bool) -> logging.Logger:
    """``logger``, writing JSON lines where ``json_lines`` (the level stays vLLM's)."""
    if json_lines and not any(isinstance(f, _JsonLines) for f in logger.filters):
        logger.addFilter(_JsonLines())
    return logger


def _ensure_vllm_logging(vllm_logger: object) -> None:
    """Newer vLLM (0.32) configures its logger tree lazily, after plugins may load;
    configure it from the environment now (what 0.23 does at import) so our lines
    are not dropped. vLLM's own later configuration replaces this one."""
    if logging.getLogger("vllm").handlers:
        return
    configure = getattr(vllm_logger, "_configure_vllm_root_logger", None)
    if configure is not None:
        # never let logging setup break plugin loading
        with contextlib.suppress(Exception):
            configure()
