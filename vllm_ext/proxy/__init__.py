# SPDX-License-Identifier: Apache-2.0
"""The P/D proxy: OpenAI-compatible front end that drives a prefill and a decode engine.

Push mode dispatches the P and D legs concurrently (SPEC S-LEG-1, S-PRX-1); pull
mode runs them one after the other, like vLLM's NIXL toy proxy. Run it with
``vllm-ext-proxy`` or ``python -m vllm_ext.proxy`` (see :mod:`vllm_ext.proxy.cli`).
"""

from __future__ import annotations

from vllm_ext.proxy.app import create_app, make_runner
from vllm_ext.proxy.config import LegTimeouts, PrefillCoordinates, ProxyConfig

__all__ = ["LegTimeouts", "PrefillCoordinates", "ProxyConfig", "create_app", "make_runner"]
