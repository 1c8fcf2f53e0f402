# SPDX-License-Identifier: Apache-2.0
"""Loggers that print through vLLM's logging setup.

vLLM configures only the ``vllm`` logger tree (handler, format, level from
``VLLM_LOGGING_LEVEL``). Our loggers live under ``vllm.ext`` so their lines look
like and are filtered like vLLM's own.
"""

from __future__ import annotations

import logging


def get_logger(module_name: str) -> logging.Logger:
    """``get_logger(__name__)`` -> the ``vllm.ext.<module>`` logger."""
    short = module_name.removeprefix("vllm_ext").lstrip(".") or "plugin"
    try:
        from vllm.logger import init_logger
    except ImportError:  # tools that run without vLLM installed
        return logging.getLogger(f"vllm.ext.{short}")
    return init_logger(f"vllm.ext.{short}")
