# SPDX-License-Identifier: Apache-2.0
"""The operator docs do not contradict the code or each other where a test can see it:
the links in ``ci/pins.toml`` exist, the README installs what can be installed, the
proxy's documented error messages name no engine address (the proxy redacts them), and
the docs do not say again what stopped being true (vllm-router's legs bound without a
secret, a restart after a long partition, readiness that follows the engines)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_ext.proxy.errors import redact

REPO = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/deploy.md", "docs/xpyd.md", "docs/proxy.md", "deploy/k8s/README.md"]


def _text(path: str) -> str:
    return (REPO / path).read_text()


def test_every_document_ci_pins_names_exists() -> None:
    comments = [line for line in _text("ci/pins.toml").splitlines() if "#" in line]
    named = re.findall(r"[\w./-]+\.md\b", "\n".join(comments))
    assert named, "ci/pins.toml names no document (the README)"
    for path in named:
        assert (REPO / path).exists(), path


def test_the_readme_installs_a_wheel_built_here() -> None:
    readme = _text("README.md")
    assert not re.search(r"pip install vllm-ext\b", readme)
    assert "pip wheel --no-deps -w dist ." in readme
    assert "pip install dist/vllm_ext-" in readme
    version = re.search(r'^version = "([^"]+)"', _text("pyproject.toml"), re.M)
    assert version and f"vllm_ext-{version.group(1)}-py3-none-any.whl" in readme


@pytest.mark.parametrize("path", DOCS)
def test_quoted_client_errors_name_no_engine_address(path: str) -> None:
    """What a client is told (``... leg failed ...``) reads as the proxy redacts it."""
    for quoted in re.findall(r"`([^`]*leg failed[^`]*)`", _text(path)):
        assert redact(quoted) == quoted, (path, quoted)


@pytest.mark.parametrize(
    ("path", "stale"),
    [
        ("docs/deploy.md", r"routers send no secret:\s+their legs match as before"),
        ("docs/xpyd.md", r"P makes none up"),
        ("docs/deploy.md", r"restart one of the two engines"),
        ("docs/deploy.md", r"The proxy needs only this package\."),
        ("docs/deploy.md", r"503 while the engines are down"),
        ("docs/xpyd.md", r"200 while at least one P and one D answer"),
        ("docs/proxy.md", r"200 while at least one P and one D answer"),
        ("deploy/k8s/base/proxy.yaml", r"200 while at least one P and one D answer"),
        ("README.md", r"two H200s of one host, software"),
        ("docs/offline-install.md", r"under the device tool's 64 MiB per call"),
    ],
)
def test_a_statement_that_stopped_being_true_is_gone(path: str, stale: str) -> None:
    assert not re.search(stale, _text(path)), (path, stale)
