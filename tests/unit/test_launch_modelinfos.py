# SPDX-License-Identifier: Apache-2.0
"""Engines of one python share vLLM's notes on model classes (``modelinfos``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from devkit.launch.engine import (
    MODELINFOS,
    EngineSpec,
    copy_modelinfos,
    modelinfo_store,
    start_engine,
)
from devkit.launch.process import free_port

NOTE = "vllm-model_executor-models-llama-LlamaForCausalLM.json"


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_EXT_CACHE", str(tmp_path / "cache"))


def _health_server_script(port: int) -> str:
    """A stand-in engine: it answers ``/health`` on ``port`` (the launcher counts a
    server ready only where the process it started listens)."""
    return (
        "import http.server\n"
        "class Health(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200)\n"
        "        self.end_headers()\n"
        "    def log_message(self, *args):\n"
        "        pass\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), Health).serve_forever()\n"
    )


def test_each_python_has_a_store_of_its_own() -> None:
    a, b = modelinfo_store("/envs/a/bin/python"), modelinfo_store("/envs/b/bin/python")
    assert a != b and a.parent == b.parent
    assert modelinfo_store("/envs/a/bin/python") == a


def test_a_copy_adds_what_is_missing_and_keeps_what_is_there(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "a.json").write_text("new a")
    (src / "b.json").write_text("new b")
    (dst / "a.json").write_text("old a")
    copy_modelinfos(src, dst)
    assert (dst / "a.json").read_text() == "old a"
    assert (dst / "b.json").read_text() == "new b"
    assert sorted(p.name for p in dst.iterdir()) == ["a.json", "b.json"]
    copy_modelinfos(tmp_path / "missing", dst)  # nothing to copy: nothing happens


@pytest.mark.timeout(60)
def test_an_engine_starts_with_the_notes_and_shares_its_own_once_ready(tmp_path: Path) -> None:
    """The stand-in "engine" only answers its /health."""
    port = free_port()
    spec = EngineSpec(name="e", model="m", port=port, python=sys.executable,
                      wrapper=[sys.executable, "-c", _health_server_script(port)])  # fmt: skip
    store = modelinfo_store(sys.executable)
    store.mkdir(parents=True)
    (store / NOTE).write_text("{}")
    engine = start_engine(spec, tmp_path / "run")
    try:
        own = tmp_path / "run" / "cache-e" / MODELINFOS
        assert (own / NOTE).read_text() == "{}"
        (own / "other.json").write_text("[]")  # what the engine noted while it started
        engine.wait_ready(timeout=30)
        assert (store / "other.json").read_text() == "[]"
    finally:
        engine.stop()


def test_an_engine_with_a_cache_root_of_its_own_is_left_alone(tmp_path: Path) -> None:
    store = modelinfo_store(sys.executable)
    store.mkdir(parents=True)
    (store / NOTE).write_text("{}")
    spec = EngineSpec(name="e", model="m", port=1, python=sys.executable,
                      cache_root=tmp_path / "mine",
                      wrapper=[sys.executable, "-c", "pass"])  # fmt: skip
    engine = start_engine(spec, tmp_path / "run")
    engine.stop()
    assert not (tmp_path / "mine").exists()
