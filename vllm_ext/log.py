# SPDX-License-Identifier: Apache-2.0
"""Loggers that print through vLLM's logging setup.

vLLM configures only the ``vllm`` logger tree (handler, format, level from
``VLLM_LOGGING_LEVEL``). Our loggers live under ``vllm.ext`` so their lines look
like and are filtered like vLLM's own.
"""

from __future__ import annotations

import contextlib
import logging


def get_logger(module_name: str) -> logging.Logger:
    """``get_logger(__name__)`` -> the ``vllm.ext.<module>`` logger."""
    short = module_name.removeprefix("vllm_ext").lstrip(".") or "plugin"
    try:
        from vllm import logger as vllm_logger
    except ImportError:  # tools that run without vLLM installed
        return logging.getLogger(f"vllm.ext.{short}")
    _ensure_vllm_logging(vllm_logger)
    return vllm_logger.init_logger(f"vllm.ext.{short}")


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
