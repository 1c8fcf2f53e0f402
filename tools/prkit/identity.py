# SPDX-License-Identifier: Apache-2.0
"""Whose sign-off the PR branch carries: the git identity of the person running the kit.

vLLM's DCO check wants a ``Signed-off-by:`` of a real person on every commit. The kit
takes ``user.name`` / ``user.email`` from git's configuration as seen from the vLLM
tree (its local config, else the global one), refuses to run without one, and refuses
an address at a reserved domain (RFC 2606 / RFC 6761: ``example.com``, ``*.example``,
``*.invalid``, ``*.test``, ``*.localhost``), which no person can receive mail at.
Tests allow such an address explicitly (``allow_reserved``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .common import UsageError, run

#: Second-level domains reserved for documentation (RFC 2606 section 3).
RESERVED_DOMAINS = ("example.com", "example.net", "example.org")
#: Top-level domains reserved for testing, documentation and invalid names.
RESERVED_TLDS = ("example", "invalid", "test", "localhost")
_EMAIL_RE = re.compile(r"^[^@\s<>]+@([A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+)$")
#: Environment variable that allows a reserved-domain identity (tests, dry runs).
ALLOW_RESERVED_ENV = "VLLM_EXT_PR_ALLOW_RESERVED_IDENTITY"

_HOW_TO_SET = (
    'set yours with `git config --global user.name "Your Name"` and '
    "`git config --global user.email you@your.domain` (or without --global in the tree)"
)


@dataclass(frozen=True)
class Identity:
    name: str
    email: str

    def __str__(self) -> str:
        return f"{self.name} <{self.email}>"

    @property
    def signoff(self) -> str:
        return f"Signed-off-by: {self}"


def reserved_domain(email: str) -> str | None:
    """The reserved domain ``email`` is at, or None."""
    domain = email.rpartition("@")[2].lower().rstrip(".")
    labels = domain.split(".")
    if labels[-1] in RESERVED_TLDS:
        return f".{labels[-1]}"
    for reserved in RESERVED_DOMAINS:
        if domain == reserved or domain.endswith("." + reserved):
            return reserved
    return None


def validate(identity: Identity, allow_reserved: bool = False) -> Identity:
    """Raise :class:`UsageError` for an identity a DCO sign-off cannot carry."""
    if not _EMAIL_RE.match(identity.email):
        raise UsageError(
            f"git user.email {identity.email!r} is not an e-mail address; {_HOW_TO_SET}"
        )
    where = reserved_domain(identity.email)
    if where is not None and not allow_reserved:
        raise UsageError(
            f"the git identity {identity} is at a reserved domain ({where}, RFC 2606/6761): "
            "nobody receives mail there, and vLLM's DCO check needs the sign-off of a real "
            f"person; {_HOW_TO_SET}"
        )
    return identity


def from_git(tree: Path, allow_reserved: bool = False) -> Identity:
    """The identity git uses in ``tree`` (local config, then global/system)."""
    values = {}
    for key in ("user.name", "user.email"):
        res = run(["git", "config", "--get", key], tree)
        values[key] = res.stdout.strip() if res.returncode == 0 else ""
    missing = [k for k, v in values.items() if not v]
    if missing:
        raise UsageError(
            f"no git identity ({' and '.join(missing)} not set for {tree}): the PR branch "
            f"is signed off (DCO) by the person running the kit; {_HOW_TO_SET}"
        )
    return validate(Identity(values["user.name"], values["user.email"]), allow_reserved)
