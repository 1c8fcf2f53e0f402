# SPDX-License-Identifier: Apache-2.0
"""Which package index the tools use: pip's and uv's configuration, never a host of ours."""

from __future__ import annotations

import re
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest

from devkit import index_config
from devkit.bundle import resolve
from devkit.bundle.installer import BundleError

REPO = Path(__file__).resolve().parents[2]
MIRROR = "https://mirror.example/p"
OTHER = "https://other.example/q"
_configured = index_config.configured  # the real one, also while a test replaces it


def _cfg(env: dict[str, str], pip: dict[str, str] | None = None) -> index_config.IndexConfig:
    return _configured(env, lambda: pip or {})


# -- resolution order -----------------------------------------------------------------


def test_pip_variable_wins_over_uv_variables_and_pip_config() -> None:
    env = {"PIP_INDEX_URL": MIRROR, "UV_DEFAULT_INDEX": OTHER, "UV_INDEX_URL": OTHER}
    cfg = _cfg(env, {"global.index-url": OTHER})
    assert (cfg.index_url, cfg.source) == (MIRROR, "PIP_INDEX_URL")


def test_uv_variables_when_pip_has_none() -> None:
    cfg = _cfg({"UV_DEFAULT_INDEX": MIRROR, "UV_INDEX_URL": OTHER}, {"global.index-url": OTHER})
    assert (cfg.index_url, cfg.source) == (MIRROR, "UV_DEFAULT_INDEX")
    cfg = _cfg({"UV_INDEX_URL": MIRROR}, {"global.index-url": OTHER})
    assert (cfg.index_url, cfg.source) == (MIRROR, "UV_INDEX_URL")


def test_pip_config_when_no_variable_is_set() -> None:
    cfg = _cfg({"PIP_INDEX_URL": "  "}, {"install.index-url": OTHER, "global.index-url": MIRROR})
    assert (cfg.index_url, cfg.source) == (MIRROR, "pip config global.index-url")
    cfg = _cfg({}, {"install.index-url": OTHER})
    assert cfg.index_url == OTHER


def test_extras_from_all_places_in_order_without_duplicates() -> None:
    env = {
        "PIP_INDEX_URL": MIRROR,
        "PIP_EXTRA_INDEX_URL": f"{OTHER} {MIRROR}",
        "UV_INDEX": f"named={OTHER}/2",
        "UV_EXTRA_INDEX_URL": f"{OTHER}/3",
    }
    cfg = _cfg(env, {"global.extra-index-url": f"{OTHER}/4\n{OTHER}"})
    assert cfg.extra_urls == (OTHER, f"{OTHER}/2", f"{OTHER}/3", f"{OTHER}/4")


def test_nothing_configured_leaves_the_clients_default() -> None:
    cfg = _cfg({}, {"global.find-links": "/wheels"})
    assert cfg.index_url is None and cfg.extra_urls == ()
    assert cfg.uv_args() == []
    assert _cfg({"UV_DEFAULT_INDEX": MIRROR}).uv_args() == ["--index-url", MIRROR]
    assert "none configured" in index_config.describe(cfg)


def test_simple_api_index_asks_pip_then_names_the_variable() -> None:
    nothing = _cfg({})
    assert index_config.simple_api_index(_cfg({"PIP_INDEX_URL": MIRROR + "/"})) == MIRROR
    assert index_config.simple_api_index(nothing, default=lambda: OTHER) == OTHER
    with pytest.raises(index_config.IndexNotConfigured, match="set PIP_INDEX_URL"):
        index_config.simple_api_index(nothing, default=lambda: None)


def test_pip_config_list_output_is_parsed() -> None:
    text = (
        ":env:.index-url='ignored'\n"
        f"global.index-url='{MIRROR}'\n"
        f"global.extra-index-url='{OTHER} {OTHER}/2'\n"
        "global.timeout='60'\n"
    )
    assert index_config.parse_pip_config_list(text) == {
        "global.index-url": MIRROR,
        "global.extra-index-url": f"{OTHER} {OTHER}/2",
        "global.timeout": "60",
    }


def test_real_pip_config_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nindex-url = {MIRROR}\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    for var in (*index_config.INDEX_VARS, *index_config.EXTRA_INDEX_VARS):
        monkeypatch.delenv(var, raising=False)
    cfg = index_config.configured()
    assert (cfg.index_url, cfg.source) == (MIRROR, "pip config global.index-url")


def test_pip_names_its_default_index() -> None:
    url = index_config.pip_default_index()
    assert url is not None and url.startswith("https://")


# -- the bundle tool takes the machine's index ----------------------------------------


def test_release_time_without_an_index_says_which_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(index_config, "configured", lambda: _cfg({}))
    monkeypatch.setattr(index_config, "pip_default_index", lambda: None)
    with pytest.raises(BundleError, match="PIP_INDEX_URL.*--as-of"):
        resolve.release_time("vllm", "0.23.0")


def _fake_uv(tmp_path: Path) -> tuple[Path, Path]:
    args_file = tmp_path / "uv-args.txt"
    uv = tmp_path / "uv"
    uv.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {args_file}\n: > resolved.txt\n')
    uv.chmod(0o755)
    return uv, args_file


@pytest.mark.parametrize(
    ("env", "want"),
    [({}, None), ({"PIP_INDEX_URL": MIRROR, "PIP_EXTRA_INDEX_URL": OTHER}, MIRROR)],
)
def test_uv_gets_the_configured_index_or_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict, want: str | None
) -> None:
    monkeypatch.setattr(index_config, "configured", lambda: _cfg(env))
    uv, args_file = _fake_uv(tmp_path)
    resolve.compile_requirements(
        uv,
        ["vllm==0.23.0"],
        python="3.12",
        platform="x86_64-manylinux_2_39",
        as_of=datetime(2026, 1, 1, tzinfo=UTC),
        excludes=[],
        overrides=[],
        undated=[],
        workdir=tmp_path / "w",
    )
    args = args_file.read_text().splitlines()
    if want is None:
        assert "--index-url" not in args
    else:
        assert args[args.index("--index-url") + 1] == want
    assert "--extra-index-url" not in args and OTHER not in args


# -- the repository names no index host -----------------------------------------------

#: Public index hosts, spelled in pieces so this file does not name them either.
_HOSTS = [".".join(p) for p in (("pypi", "org"), ("pythonhosted", "org"), ("pytorch", "org"))]
_URL = re.compile(r"https?://[^\s\"'`<>)\]]+")
_INDEX_PATH = re.compile(r"/(simple|whl)(/|$)")


def offending_lines(text: str) -> list[str]:
    """Lines naming a public index host, or a URL whose path looks like an index."""
    bad = []
    for line in text.splitlines():
        low = line.lower()
        if any(h in low for h in _HOSTS):
            bad.append(line.strip())
            continue
        for url in _URL.findall(line):
            path = url.split("://", 1)[1].partition("/")[2]
            if _INDEX_PATH.search("/" + path):
                bad.append(line.strip())
                break
    return bad


def test_the_check_catches_index_urls() -> None:
    host = _HOSTS[0]
    assert offending_lines(f"see {host}/project/uv") != []
    # index-like URLs are assembled here so that this file passes the check itself
    assert offending_lines("PIP_EXTRA_INDEX_URL=" + "/".join((MIRROR, "whl", "cpu"))) != []
    assert offending_lines("index = '" + "/".join(("http://10.0.0.1:3141", "simple", "'"))) != []
    assert offending_lines(f"url = {MIRROR} and http://127.0.0.1:8100/v1/completions") == []


def test_no_tracked_file_names_a_package_index() -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    found = {}
    for name in filter(None, files):
        path = REPO / name.decode()
        if path.is_symlink() or not path.is_file():
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if bad := offending_lines(text):
            found[name.decode()] = bad
    assert found == {}
