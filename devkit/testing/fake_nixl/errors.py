# SPDX-License-Identifier: Apache-2.0
"""The fake NIXL's errors (NIXL's exception types by kind) and the constants its parts share."""

from __future__ import annotations

from typing import Literal

NIXL_INIT_AGENT = "NIXL_INIT_AGENT"
_METADATA_MAGIC = b"\x00FAKENIXL/1\x00"
_MEM_TYPES = {"DRAM": "DRAM", "cpu": "DRAM", "VRAM": "VRAM", "cuda": "VRAM"}
_UNSUPPORTED_MEM_TYPES = ("FILE", "BLOCK", "OBJ")
_OPS = ("WRITE", "READ")

FailureKind = Literal[
    "post", "post_raise", "state", "state_raise", "hang", "hang_uncancellable", "hang_state_raise"
]
_FAILURE_KINDS: tuple[str, ...] = (
    "post", "post_raise", "state", "state_raise", "hang", "hang_uncancellable",
    "hang_state_raise",
)  # fmt: skip
_HANGS = ("hang", "hang_uncancellable", "hang_state_raise")
#: Transfers that NIXL cannot cancel while they run.
_UNCANCELLABLE = ("hang_uncancellable", "hang_state_raise")


# --------------------------------------------------------------------------- errors


class FakeNixlError(Exception):
    """Base of the fake's errors; ``status`` is the NIXL status name it stands for."""

    status = "NIXL_ERR_UNKNOWN"

    def __init__(self, detail: str) -> None:
        super().__init__(f"{self.status}: {detail}")
        self.detail = detail


class FakeNixlNotFoundError(FakeNixlError):
    """Like ``nixlNotFoundError``: unknown agent, or memory not registered."""

    status = "NIXL_ERR_NOT_FOUND"


class FakeNixlInvalidParamError(FakeNixlError):
    """Like ``nixlInvalidParamError``: mismatched lists, bad indices, bad sides."""

    status = "NIXL_ERR_INVALID_PARAM"


class FakeNixlMismatchError(FakeNixlError):
    """Like ``nixlMismatchError``: metadata that cannot be deserialized."""

    status = "NIXL_ERR_MISMATCH"


class FakeNixlNotPostedError(FakeNixlError):
    """Like ``nixlNotPostedError``: state/telemetry of a transfer not posted/complete."""

    status = "NIXL_ERR_NOT_POSTED"


class FakeNixlRepostActiveError(FakeNixlError):
    """Like ``nixlRepostActiveError``: ``transfer()`` on a handle still in flight."""

    status = "NIXL_ERR_REPOST_ACTIVE"


class FakeNixlBackendError(FakeNixlError):
    """Like ``nixlBackendError``: the (injected) backend failure."""

    status = "NIXL_ERR_BACKEND"


class FakeNixlNoTelemetryError(FakeNixlError):
    """Like ``nixlNoTelemetryError``: telemetry asked of an agent without capture."""

    status = "NIXL_ERR_NO_TELEMETRY"


class FakeNixlNotSupportedError(FakeNixlError):
    """Like ``nixlNotSupportedError``: a feature the fake does not model."""

    status = "NIXL_ERR_NOT_SUPPORTED"


class FakeNixlUsageError(FakeNixlError):
    """Misuse real NIXL does not report (double release, use after release, ...)."""

    status = "FAKE_NIXL_USAGE"


class FakeNixlLeakError(FakeNixlError, AssertionError):
    """Raised by ``FakeNixlFabric.assert_no_leaks``."""

    status = "FAKE_NIXL_LEAK"
