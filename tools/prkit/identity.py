# SPDX-License-Identifier: Apache-2.0
"""Whose sign-off the PR branch carries: the git identity of the person running the kit.

vLLM's DCO check wants a ``Signed-off-by:`` of a real person on every commit. The kit
takes the author identity git would use: ``GIT_AUTHOR_NAME`` / ``GIT_AUTHOR_EMAIL`` from
the environment where set (they win over the configuration, as in git), else
``user.name`` / ``user.email`` from git's configuration as seen from the vLLM tree (its
local config, else the global one). It refuses to run without one, and refuses an
address at a reserved domain (RFC 2606 / RFC 6761: ``example.com``, ``*.example``,
``*.invalid``, ``*.test``, ``*.localhost``), which no person can receive mail at; the
same holds for a patch author that ``--keep-author`` would keep. Tests allow such an
address explicitly (``allow_reserved``).
"""

from __future__ import annotations

import email.header
import email.parser
import email.utils
import os
import re
from collections.abc import Iterable
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


#: Environment variables that override git's configuration, as git reads them.
ENV_KEYS = {"user.name": "GIT_AUTHOR_NAME", "user.email": "GIT_AUTHOR_EMAIL"}


def from_git(tree: Path, allow_reserved: bool = False) -> Identity:
    """The author identity git uses in ``tree``: ``GIT_AUTHOR_NAME`` /
    ``GIT_AUTHOR_EMAIL`` where set, else the tree's config (local, then global/system)."""
    values = {}
    for key, env in ENV_KEYS.items():
        value = os.environ.get(env, "").strip()
        if not value:
            res = run(["git", "config", "--get", key], tree)
            value = res.stdout.strip() if res.returncode == 0 else ""
        values[key] = value
    missing = [f"{k} ({ENV_KEYS[k]})" for k, v in values.items() if not v]
    if missing:
        raise UsageError(
            f"no git identity ({' and '.join(missing)} not set for {tree}): the PR branch "
            f"is signed off (DCO) by the person running the kit; {_HOW_TO_SET}"
        )
    return validate(Identity(values["user.name"], values["user.email"]), allow_reserved)


def source_of(key: str) -> str:
    """Where :func:`from_git` took ``key`` from, for the progress line."""
    return ENV_KEYS[key] if os.environ.get(ENV_KEYS[key], "").strip() else f"git config {key}"


def patch_author(path: Path) -> Identity | None:
    """The author (``From:`` header) of a ``git format-patch`` file, or None."""
    text = path.read_text(encoding="utf-8", errors="replace")
    head = text.split("\n\n", 1)[0]
    if head.startswith("From "):  # the mbox separator line
        head = head.partition("\n")[2]
    value = email.parser.HeaderParser().parsestr(head + "\n\n").get("From")
    if value is None:
        return None
    decoded = str(email.header.make_header(email.header.decode_header(str(value))))
    name, address = email.utils.parseaddr(decoded)
    return Identity(name, address) if address else None


def check_kept_authors(paths: Iterable[Path], allow_reserved: bool = False) -> None:
    """Refuse ``--keep-author`` when a patch's author is at a reserved domain."""
    bad = []
    for path in paths:
        author = patch_author(path)
        where = reserved_domain(author.email) if author else None
        if author is not None and where is not None:
            bad.append(f"{path.name}: {author} ({where})")
    if bad and not allow_reserved:
        raise UsageError(
            "--keep-author would keep authors at reserved domains (RFC 2606/6761), which "
            "no person receives mail at and vLLM's DCO check does not accept:\n  "
            + "\n  ".join(bad)
            + "\ndrop --keep-author (the commits are then yours), or pass "
            "--allow-reserved-identity (tests, dry runs)"
        )
