# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the tests of the vLLM patch series and the patch tool (see patch_support)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from patch_support import source_tree


@pytest.fixture(scope="session")
def pristine_tree() -> Path:
    """The cached pristine v0.23.0 tree (shared: never modify it)."""
    return source_tree()


@pytest.fixture
def site_copy(tmp_path: Path, pristine_tree: Path) -> Path:
    """A throwaway site-packages style directory holding a pristine ``vllm/``."""
    root = tmp_path / "site-packages"
    shutil.copytree(pristine_tree / "vllm", root / "vllm")
    return root


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A throwaway git checkout of v0.23.0 (its own clone of the cached tree)."""
    return source_tree(tmp_path / "vllm-checkout")
