# SPDX-License-Identifier: Apache-2.0
"""Which package index this machine uses, read from pip's and uv's own configuration.

The single place the project's tools ask "which index?"; the repository names no index
host. Standard library only: the env builder (``tools/envs.py``) imports it before any
environment exists.

The primary index, first found wins:

1. ``PIP_INDEX_URL``
2. ``UV_DEFAULT_INDEX``, then ``UV_INDEX_URL`` (uv's older name)
3. pip's configuration files: ``global.index-url``, then ``install.index-url``,
   ``download.index-url`` (read with ``python -m pip config list``)

Extra indexes, all of them in this order, duplicates dropped: ``PIP_EXTRA_INDEX_URL``,
``UV_INDEX`` (``name=url`` entries allowed), ``UV_EXTRA_INDEX_URL`` and pip's
``global.extra-index-url`` (each a whitespace-separated list).

Tools that only run pip need nothing from here: pip reads the same configuration. Where
none is configured, a tool that runs uv passes no ``--index-url`` (uv's own default
applies); a tool that reads an index's JSON simple API itself uses
:func:`simple_api_index`, which falls back to pip's built-in default (asked of pip, never
written here) and otherwise fails naming ``PIP_INDEX_URL``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

#: Environment variables naming the primary index, highest precedence first.
INDEX_VARS = ("PIP_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX_URL")
#: Environment variables naming extra indexes.
EXTRA_INDEX_VARS = ("PIP_EXTRA_INDEX_URL", "UV_INDEX", "UV_EXTRA_INDEX_URL")
#: pip configuration keys naming the primary index, highest precedence first.
PIP_INDEX_KEYS = ("global.index-url", "install.index-url", "download.index-url")
PIP_EXTRA_INDEX_KEYS = ("global.extra-index-url", "install.extra-index-url")
#: What to tell a user whose machine names no index.
HOW_TO_SET = "set PIP_INDEX_URL to your package index (or `pip config set global.index-url URL`)"


class IndexNotConfigured(RuntimeError):
    """No index is configured and pip's default could not be read."""


@dataclass(frozen=True)
class IndexConfig:
    """The indexes this machine is configured to use."""

    #: Primary index, or None: the client's own default applies.
    index_url: str | None
    #: Extra indexes (pip and uv consult them next to the primary one).
    extra_urls: tuple[str, ...] = ()
    #: Where ``index_url`` came from (a variable name or a pip config key).
    source: str = ""

    def uv_args(self) -> list[str]:
        """``--index-url`` for uv when one is configured, else nothing (uv's default).

        Extra indexes are left out on purpose: uv prefers an extra index over the
        primary one for every package it holds, and the bundle's resolution as of a
        release date needs the upload times only the primary index is relied on for.
        """
        return ["--index-url", self.index_url] if self.index_url else []


def _split(value: str) -> list[str]:
    urls = []
    for item in value.split():
        # uv's UV_INDEX takes ``name=url`` entries
        name, eq, url = item.partition("=")
        urls.append(url if eq and "://" not in name else item)
    return urls


def parse_pip_config_list(text: str) -> dict[str, str]:
    """``pip config list`` output (``key='value'`` lines) -> {key: value}; files only
    (pip's ``:env:.`` entries come from variables, read here directly)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, eq, raw = line.partition("=")
        if not eq or key.startswith(":env:"):
            continue
        try:
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            value = raw.strip()
        found[key.strip()] = str(value)
    return found


def pip_config(python: str | None = None) -> dict[str, str]:
    """pip's configuration file values on this machine ({} if pip cannot say)."""
    try:
        res = subprocess.run(
            [python or sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_pip_config_list(res.stdout) if res.returncode == 0 else {}


def configured(
    env: Mapping[str, str] | None = None,
    pip_settings: Callable[[], Mapping[str, str]] = pip_config,
) -> IndexConfig:
    """The indexes configured on this machine (see the module docstring for the order);
    ``env`` and ``pip_settings`` (pip's config file values) default to the real ones."""
    env = os.environ if env is None else env
    index_url, source = None, ""
    for var in INDEX_VARS:
        if env.get(var, "").strip():
            index_url, source = env[var].strip(), var
            break
    settings = pip_settings()
    if index_url is None:
        for key in PIP_INDEX_KEYS:
            if settings.get(key, "").strip():
                index_url, source = settings[key].strip(), f"pip config {key}"
                break
    extras: list[str] = []
    for value in [env.get(v, "") for v in EXTRA_INDEX_VARS] + [
        settings.get(k, "") for k in PIP_EXTRA_INDEX_KEYS
    ]:
        for url in _split(value):
            if url not in extras and url != index_url:
                extras.append(url)
    return IndexConfig(index_url, tuple(extras), source)


def pip_default_index(python: str | None = None) -> str | None:
    """The index pip uses when none is configured, asked of pip itself (None if it
    cannot say)."""
    code = "from pip._internal.models.index import PyPI; print(PyPI.simple_url)"
    try:
        res = subprocess.run(
            [python or sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    url = res.stdout.strip()
    return url if res.returncode == 0 and "://" in url else None


def simple_api_index(
    config: IndexConfig | None = None,
    default: Callable[[], str | None] | None = None,
) -> str:
    """The index whose JSON simple API a tool reads itself: the configured one, else
    pip's default; raises :class:`IndexNotConfigured` (naming ``PIP_INDEX_URL``) when
    neither is known (``default``: pip's, asked of pip; tests pass a fake)."""
    config = configured() if config is None else config
    url = config.index_url or (default or pip_default_index)()
    if not url:
        raise IndexNotConfigured(f"no package index is configured and pip names none; {HOW_TO_SET}")
    return url.rstrip("/")


def describe(config: IndexConfig) -> str:
    """One line for logs: which index and where it came from."""
    if config.index_url:
        return f"{config.index_url} (from {config.source})"
    return "the client's default index (none configured)"
