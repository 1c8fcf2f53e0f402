# SPDX-License-Identifier: Apache-2.0
"""When a failed pip run is worth running again: the network cut it short.

Shared by the env builder (``tools/envs.py``) and the bundle builder
(``devkit.bundle``); standard library only (the env builder imports it before any
environment exists).
"""

from __future__ import annotations

#: pip runs per install/download step when the network cuts a transfer short.
PIP_ATTEMPTS = 3
#: What pip prints when the network, not the request, made it fail.
NETWORK_ERRORS = (
    "not enough bytes were received",
    "Download failed",
    "Read timed out",
    "Connection reset",
    "ConnectionError",
    "IncompleteRead",
    "Temporary failure in name resolution",
)


def is_network_error(output: str) -> bool:
    """pip failed because of the network, not because of what was asked."""
    return any(sig in output for sig in NETWORK_ERRORS)
