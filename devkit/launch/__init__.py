# SPDX-License-Identifier: Apache-2.0
"""Start and stop vLLM engines, P/D pairs and the proxy on loopback (demo, tests, benchmark)."""

from devkit.launch.process import ManagedProcess, free_port, wait_http_ready

__all__ = ["ManagedProcess", "free_port", "wait_http_ready"]
