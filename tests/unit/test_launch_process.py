# SPDX-License-Identifier: Apache-2.0
"""Launched processes are cleaned up by PID when their parent is told to stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

_PARENT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from devkit.launch.process import ManagedProcess
    child = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"],
                           Path(sys.argv[1]) / "sleeper.log")
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.timeout(60)
def test_sigterm_to_the_parent_stops_its_children(tmp_path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(30) == 128 + signal.SIGTERM  # a normal exit, atexit ran
        deadline = time.monotonic() + 20
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the launched child survived its parent's SIGTERM"
    finally:
        parent.kill()
        parent.wait(5)


@pytest.mark.timeout(60)
def test_a_stuck_engine_fails_fast_instead_of_at_the_start_timeout(tmp_path) -> None:
    """vLLM's handshake listener dies on a taken port while the server keeps starting:
    its log line ends the wait at once (PDDeployment then retries with fresh ports)."""
    from devkit.launch.engine import STUCK_MARKERS
    from devkit.launch.process import (
        ManagedProcess,
        ProcessStuck,
        free_port,
        wait_http_ready,
    )

    code = (
        "import time; print('OSError: [Errno 98] Address already in use', flush=True); "
        "time.sleep(120)"
    )
    proc = ManagedProcess("engine", [sys.executable, "-c", code], tmp_path / "engine.log")
    try:
        t0 = time.monotonic()
        with pytest.raises(ProcessStuck, match="Address already in use"):
            wait_http_ready(
                f"http://127.0.0.1:{free_port()}/health", 300, proc, stuck_markers=STUCK_MARKERS
            )
        assert time.monotonic() - t0 < 30
    finally:
        proc.stop(timeout=5)


@pytest.mark.timeout(60)
def test_an_engine_killed_by_a_taken_port_is_stuck_not_dead(tmp_path) -> None:
    """torch.distributed's store lost the port race and the engine exited: that is the
    race the deployments retry with fresh ports (ProcessStuck), not a crash
    (ProcessDied). Before: ProcessDied, and a fault pair's fixture errored 4 tests. A
    marker left in the log by an earlier process of the same name does not count."""
    from devkit.launch.engine import STUCK_MARKERS
    from devkit.launch.process import (
        ManagedProcess,
        ProcessDied,
        ProcessStuck,
        free_port,
        wait_http_ready,
    )

    log = tmp_path / "engine.log"
    url = f"http://127.0.0.1:{free_port()}/health"
    died = (
        "print('torch.distributed.DistNetworkError: The server socket has failed to listen "
        "on any local network address. port: 33039, code: -98, name: EADDRINUSE', flush=True);"
        "raise SystemExit(1)"
    )
    proc = ManagedProcess("engine", [sys.executable, "-c", died], log)
    proc.proc.wait(30)
    with pytest.raises(ProcessStuck, match="EADDRINUSE"):
        wait_http_ready(url, 30, proc, stuck_markers=STUCK_MARKERS)
    again = ManagedProcess("engine", [sys.executable, "-c", "raise SystemExit(3)"], log)
    again.proc.wait(30)
    with pytest.raises(ProcessDied):
        wait_http_ready(url, 30, again, stuck_markers=STUCK_MARKERS)


def test_pid_files_while_alive(tmp_path, monkeypatch) -> None:
    from pathlib import Path

    from devkit.launch.process import PID_DIR_ENV, ManagedProcess

    monkeypatch.setenv(PID_DIR_ENV, str(tmp_path / "pids"))
    p = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"],
                       Path(tmp_path) / "s.log")  # fmt: skip
    pid_file = tmp_path / "pids" / f"{p.pid}.pid"
    assert pid_file.read_text().splitlines()[0] == "sleeper"
    p.stop(timeout=5)
    assert not pid_file.exists()
    monkeypatch.delenv(PID_DIR_ENV)
    q = ManagedProcess("quiet", [sys.executable, "-c", "pass"], Path(tmp_path) / "q.log")
    q.stop(timeout=5)
    assert sorted(x.name for x in (tmp_path / "pids").iterdir()) == []


#: A stand-in for vLLM's API server: it forks a "core" into its own process group and, on
#: SIGTERM, takes a moment (HTTP drain), then stops the core itself. The core writes
#: whether the server had asked it to stop when its SIGTERM came.
_SERVER = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    out = Path(sys.argv[1])
    asked = out / "server-asked-core-to-stop"
    core = os.fork()
    if core == 0:
        def on_term(*_):
            (out / "core.txt").write_text("asked" if asked.exists() else "signalled too early")
            os._exit(0)
        signal.signal(signal.SIGTERM, on_term)
        (out / "core-ready").write_text("")
        while True:
            time.sleep(0.05)
    def on_term(*_):
        time.sleep(0.5)
        asked.write_text("")
        os.kill(core, signal.SIGTERM)
        os.waitpid(core, 0)
        (out / "server.txt").write_text("stopped its core")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    while True:
        time.sleep(0.05)
    """
)


def _started(tmp_path, code: str):
    from devkit.launch.process import ManagedProcess

    proc = ManagedProcess("server", [sys.executable, "-c", code, str(tmp_path)],
                          tmp_path / "server.log")  # fmt: skip
    deadline = time.monotonic() + 30
    while not (tmp_path / "core-ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "core-ready").exists(), proc.log_tail()
    return proc


@pytest.mark.timeout(60)
def test_stop_asks_the_server_alone_so_it_stops_its_core(tmp_path) -> None:
    """Signalling the whole group at once made vLLM's engine core exit under a running API
    server, which logged EngineDeadError at every shutdown."""
    proc = _started(tmp_path, _SERVER)
    assert proc.stop(timeout=10) == 0
    assert (tmp_path / "core.txt").read_text() == "asked"
    assert (tmp_path / "server.txt").read_text() == "stopped its core"


@pytest.mark.timeout(60)
def test_stop_still_ends_what_the_leader_leaves_behind(tmp_path) -> None:
    from devkit.launch.process import _group_alive

    """A leader that exits at once on SIGTERM leaves a child that ignores SIGTERM and
    holds 256 MB, as an engine core holds its memory: SIGKILL is delivered at once but
    the kernel takes a while to tear the child down (the 256 MB alone take longer than
    one look at /proc), so ``stop`` must wait for the group to be gone. It returned
    right after the SIGKILL and left the child running, whatever the load."""
    # a leader that exits at once on SIGTERM, leaving a child that ignores SIGTERM
    code = textwrap.dedent(
        """
        import os, signal, sys, time
        from pathlib import Path
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            held = bytearray(256 << 20)
            for i in range(0, len(held), 4096):
                held[i] = 1  # touched: the kernel frees every page at exit
            (Path(sys.argv[1]) / "core-ready").write_text("")
            while True:
                time.sleep(0.05)
        while True:
            time.sleep(0.05)
        """
    )
    proc = _started(tmp_path, code)
    assert _group_alive(proc.pid)
    t0 = time.monotonic()
    proc.stop(timeout=5)
    assert not _group_alive(proc.pid)
    assert time.monotonic() - t0 < 15


def test_free_ports_are_below_the_ephemeral_range_and_never_repeat() -> None:
    """A port from a bind of port 0 lies in the kernel's ephemeral range, where an outgoing
    connection or another process's bind of port 0 may take it before the server binds
    it; ``free_port`` picks below that range and never the same port twice."""
    from devkit.launch.process import LISTEN_PORTS_FROM, _ephemeral_ports, free_port

    lo, _ = _ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(LISTEN_PORTS_FROM <= p < lo for p in ports)


_HEALTH_SERVER = textwrap.dedent(
    """
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


@pytest.mark.timeout(60)
def test_a_health_answer_from_another_process_on_the_port_is_not_ready(tmp_path) -> None:
    """Two sessions picked one free port: the other's server answers ``/health`` while
    ours is still exiting on its failed bind. Before, that 200 counted as our server
    ready (an e2e session then got empty 200s from another session's proxy); now only a
    server that our process (or a child of it) listens with does. A server started under
    a shell, listening in a child, is ours."""
    from devkit.launch.process import ManagedProcess, ProcessDied, free_port, wait_http_ready

    port = free_port()
    url = f"http://127.0.0.1:{port}/health"
    other = subprocess.Popen([sys.executable, "-c", _HEALTH_SERVER, str(port)])
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the other server did not start"
                time.sleep(0.1)
        loser = ManagedProcess(
            "proxy",
            [sys.executable, "-c", "import time; time.sleep(2); raise SystemExit(1)"],
            tmp_path / "proxy.log",
        )
        with pytest.raises(ProcessDied):
            wait_http_ready(url, 30, loser, interval=0.1)
    finally:
        other.kill()
        other.wait(10)
    ours_port = free_port()
    ours = ManagedProcess(
        "server",
        ["bash", "-c", f'"{sys.executable}" -c "$0" {ours_port}', _HEALTH_SERVER],
        tmp_path / "server.log",
    )
    try:
        wait_http_ready(f"http://127.0.0.1:{ours_port}/health", 30, ours, interval=0.1)
    finally:
        ours.stop()
