# SPDX-License-Identifier: Apache-2.0
"""An engine the launcher started leaves no ZMQ IPC socket behind, even when killed.

vLLM names the sockets between its API server and engine core in ``VLLM_RPC_BASE_PATH``
(the system's temporary folder by default) and a killed engine unlinks none of them:
each engine gets a folder of its own there, removed once the engine's processes are gone.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

from devkit.launch.engine import RPC_BASE_PATH_ENV, Engine, EngineSpec, start_engine

#: a stand-in engine: binds a ZMQ IPC socket where vLLM's own function names it, as
#: vLLM's API server does for its engine core, writes the name down, and waits
_BINDS_AN_IPC_SOCKET = """
import sys, time, zmq
from vllm.utils.network_utils import get_open_zmq_ipc_path
path = get_open_zmq_ipc_path()
sock = zmq.Context().socket(zmq.ROUTER)
sock.bind(path)
open(sys.argv[1], "w").write(path)
time.sleep(120)
"""


def _started(tmp_path: Path, name: str) -> tuple[Engine, Path]:
    named = tmp_path / f"{name}.path"
    spec = EngineSpec(name=name, model="m", port=1, python=sys.executable,
                      wrapper=[sys.executable, "-c", _BINDS_AN_IPC_SOCKET, str(named)])  # fmt: skip
    engine = start_engine(spec, tmp_path / "run")
    deadline = time.monotonic() + 60
    while not named.exists() or not named.read_text():
        assert engine.proc.alive(), engine.proc.log_tail()
        assert time.monotonic() < deadline, "the stand-in never bound its socket"
        time.sleep(0.1)
    return engine, Path(named.read_text().removeprefix("ipc://"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("end", ["stop", "kill"])
def test_an_engines_ipc_sockets_go_with_it(tmp_path: Path, end: str) -> None:
    engine, socket = _started(tmp_path, f"sockets-{end}")
    try:
        assert socket.is_socket()
        folder = socket.parent
        assert folder != Path(tempfile.gettempdir()), "vLLM's default folder, shared by all"
        assert folder.parent == Path(tempfile.gettempdir())
        assert folder.name.startswith(f"vllm-ext-sockets-{end}-")
        if end == "kill":
            engine.kill()  # a crash: nothing of the engine unlinks its socket
            assert socket.exists()
        engine.stop()  # (a killed engine too: what a test or the exit hook does)
        assert not folder.exists(), os.listdir(folder)
    finally:
        engine.stop()


def test_an_rpc_folder_the_caller_names_is_kept(tmp_path: Path) -> None:
    own = tmp_path / "rpc"
    own.mkdir()
    spec = EngineSpec(name="named", model="m", port=1, python=sys.executable,
                      wrapper=[sys.executable, "-c", "pass"],
                      extra_env={RPC_BASE_PATH_ENV: str(own)})  # fmt: skip
    engine = start_engine(spec, tmp_path / "run")
    engine.stop()
    assert engine.proc.scratch_dir is None and own.is_dir()
