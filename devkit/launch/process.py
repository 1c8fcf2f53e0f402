# SPDX-License-Identifier: Apache-2.0
"""Child processes that are always cleaned up, by PID (process group).

Every process is started in its own session so that ``stop()`` can reach the whole
group (vLLM's API server forks an engine core): the leader is asked to stop first and
alone, then whatever of the group is left is terminated. Processes still alive at
interpreter exit are stopped by an ``atexit`` hook, so a failed test or a Ctrl-C
in the demo never leaves engines behind. A SIGTERM (``kill``, ``timeout``) is
turned into a normal exit for the same reason: Python's default action for it
skips ``atexit``.

With ``VLLM_EXT_PID_DIR`` set, each live process also has a file ``<pid>.pid`` there
(its name and command line; removed when it is stopped), so that a later command can
stop what an interrupted one left behind, by id (``tools/gpu/run.sh cleanup``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

_live: set[ManagedProcess] = set()
_live_lock = threading.Lock()
PID_DIR_ENV = "VLLM_EXT_PID_DIR"


#: Where :func:`free_port` picks from, below the kernel's ephemeral range.
LISTEN_PORTS_FROM = 10000
_handed_out: set[int] = set()
_ports_lock = threading.Lock()


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections and binds of port 0."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a server started next.

    Picked below the kernel's ephemeral range, and never twice by this process: a port
    that binding port 0 returns stays in that range, where any outgoing connection or
    any other process's bind of port 0 (vLLM's and ZMQ's internal sockets, UCX) may take
    it before the server binds it (an xPyD start in CI once lost a decode engine's HTTP
    port so). Falls back to port 0 where that range is too small.
    """
    lo, _ = _ephemeral_ports()
    rng = random.Random()
    with _ports_lock:
        for _ in range(200) if lo - LISTEN_PORTS_FROM >= 1000 else ():
            port = rng.randrange(LISTEN_PORTS_FROM, lo)
            if port in _handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ProcessDied(RuntimeError):
    pass


#: Seconds the rest of a process group gets after its leader is gone, before SIGKILL.
GROUP_GRACE_S = 3.0
#: Seconds :meth:`ManagedProcess.stop` waits for a SIGKILLed group to be gone.
KILLED_GONE_S = 5.0


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still running (zombies do not count)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    if not Path("/proc/self/stat").exists():
        return True  # no /proc to tell zombies apart
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after the command: state, ppid, pgrp
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _wait_group_gone(pgid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)


class ManagedProcess:
    """A child process with its own log file, stopped by process group."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        scratch_env: str | None = None,
    ) -> None:
        """``scratch_env``: the name of a variable that gets a new folder in the
        temporary folder (``scratch_dir``), which goes with the process: removed once
        no process of its group is left, by :meth:`stop`."""
        self.name = name
        self.scratch_dir: Path | None = None
        if scratch_env is not None:
            self.scratch_dir = Path(tempfile.mkdtemp(prefix=f"vllm-ext-{name}-"))
            env = {**(os.environ if env is None else env), scratch_env: str(self.scratch_dir)}
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        #: where this process's output starts in its (appended) log
        self.log_offset = self._log.tell()
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )
        except BaseException:
            self._log.close()
            if self.scratch_dir is not None:
                shutil.rmtree(self.scratch_dir, ignore_errors=True)
            raise
        self.pid = self.proc.pid
        self._pid_file = _write_pid_file(self.pid, name, self.argv)
        with _live_lock:
            _live.add(self)
        _exit_cleanly_on_sigterm()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the leader and wait up to ``timeout`` seconds; then SIGTERM what is left
        of its process group, and SIGKILL it after a short grace.

        The leader first, alone: vLLM's API server stops its engine core itself when told
        to shut down. Signalled together, the core exits while the server still runs,
        which the server takes for a crash (``EngineDeadError`` at every shutdown).
        """
        try:
            if self.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout)
            # The leader may be gone (or stuck) while other members of its group still run.
            if _group_alive(self.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, signal.SIGTERM)
                _wait_group_gone(self.pid, GROUP_GRACE_S)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            # SIGKILL is delivered, not done: a member runs until the kernel schedules
            # its exit, so wait until none is left (a stopped group is gone on return).
            _wait_group_gone(self.pid, KILLED_GONE_S)
        finally:
            self._log.close()
            if self._pid_file is not None:
                with contextlib.suppress(OSError):
                    self._pid_file.unlink()
            with _live_lock:
                _live.discard(self)
            if self.scratch_dir is not None and not _group_alive(self.pid):
                shutil.rmtree(self.scratch_dir, ignore_errors=True)
        return self.proc.returncode

    def __repr__(self) -> str:
        return f"ManagedProcess({self.name!r}, pid={self.pid}, log={self.log_path})"


def _write_pid_file(pid: int, name: str, argv: Sequence[str]) -> Path | None:
    folder = os.environ.get(PID_DIR_ENV)
    if not folder:
        return None
    try:
        path = Path(folder) / f"{pid}.pid"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{name}\n{' '.join(argv)[:2000]}\n")
        return path
    except OSError:
        return None


class ProcessStuck(RuntimeError):
    """The process logged a line after which it never becomes ready (it hangs, or it
    died of it)."""


class _LogScanner:
    """Finds marker lines in a growing log, reading each byte once."""

    def __init__(self, path: Path, markers: Sequence[str], offset: int = 0) -> None:
        self._path, self._markers = path, markers
        self._offset = offset
        self._partial = ""

    def scan(self) -> str | None:
        """The first new complete line containing a marker, if any."""
        try:
            with self._path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return None
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk.decode(errors="replace")).split("\n")
        return next((ln.strip() for ln in lines if any(m in ln for m in self._markers)), None)


def wait_http_ready(
    url: str,
    timeout: float,
    proc: ManagedProcess | None = None,
    progress: Callable[[float], None] | None = None,
    interval: float = 0.5,
    stuck_markers: Sequence[str] = (),
) -> float:
    """Poll ``url`` until it answers 200; returns the seconds waited.

    Raises :class:`ProcessDied` (with the log tail) if ``proc`` exits first,
    :class:`ProcessStuck` as soon as its log shows one of ``stuck_markers``, and
    :class:`TimeoutError` after ``timeout`` seconds. ``progress(elapsed)`` is
    called about every 5 s while waiting.
    """
    t0 = time.monotonic()
    last = t0
    scanner = (
        _LogScanner(proc.log_path, stuck_markers, proc.log_offset)
        if proc and stuck_markers
        else None
    )
    while True:
        dead = proc is not None and not proc.alive()
        if scanner is not None:  # first: a process a marker killed is stuck, not dead
            line = scanner.scan()
            if line is not None:
                assert proc is not None
                raise ProcessStuck(f"{proc.name} cannot start ({proc.log_path}): {line[:300]}")
        if dead:
            assert proc is not None
            raise ProcessDied(
                f"{proc.name} exited with {proc.proc.returncode} before {url} was ready; "
                f"log {proc.log_path}:\n{proc.log_tail()}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                # (a 200 from a server another process holds on that port is not ours)
                if r.status == 200 and (proc is None or listens_on(proc.pid, url) is not False):
                    return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        now = time.monotonic()
        if now - t0 > timeout:
            tail = f"; log {proc.log_path}:\n{proc.log_tail()}" if proc else ""
            raise TimeoutError(f"{url} not ready after {timeout:.0f}s{tail}")
        if progress is not None and now - last >= 5:
            last = now
            progress(now - t0)
        time.sleep(interval)


def listens_on(pid: int, url: str) -> bool | None:
    """Whether process ``pid`` or one of its descendants holds the listening TCP socket
    of ``url``'s port, read from ``/proc`` in that process's own network namespace;
    None where that cannot be read (no ``/proc``, no permission, the process gone).

    :func:`wait_http_ready` asks it: two test sessions on one machine can pick the same
    free port, and then the loser's ``/health`` is answered by the winner's server while
    the loser's own process is still exiting on its failed bind (an e2e session once got
    200s with empty streams from another session's proxy so)."""
    port = urllib.parse.urlsplit(url).port
    if port is None:
        return None
    # psutil (a dependency of vLLM) for the process tree only: its socket tables are
    # those of the caller's network namespace, not of the process's
    import psutil

    try:
        root = psutil.Process(pid)
        pids = [pid, *(p.pid for p in root.children(recursive=True))]
        inodes: set[str] = set()
        for p in pids:
            for fd in os.listdir(f"/proc/{p}/fd"):
                try:
                    target = os.readlink(f"/proc/{p}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        for table in ("tcp", "tcp6"):
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    cols = line.split()
                    # local address "ADDR:PORT" in hex, state 0A = LISTEN, column 9 the inode
                    listening = cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port
                    if listening and cols[9] in inodes:
                        return True
        return False
    except (OSError, psutil.Error, StopIteration, ValueError, IndexError):
        return None


def _exit_cleanly_on_sigterm() -> None:
    """SIGTERM -> ``SystemExit(143)``, so ``finally`` blocks and :func:`_stop_all` run.

    Only from the main thread and only over the default action: a handler someone
    else installed (a test runner, an application) stays.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


@atexit.register
def _stop_all() -> None:
    with _live_lock:
        procs = list(_live)
    for p in procs:
        with contextlib.suppress(Exception):
            p.stop(timeout=5)


class StartOnce:
    """``with X(...) as dep:`` starts, waits until ready and always stops.

    Subclasses provide ``start``, ``wait_ready``, ``stop`` and ``progress``. An engine
    stuck on start (:class:`ProcessStuck`: most likely a port taken between our pick
    and its bind) makes the whole deployment start over once, with fresh ports.
    """

    progress: Callable[[str], None]

    def start(self) -> None:
        raise NotImplementedError

    def wait_ready(self) -> float:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        for attempt in (1, 2):
            try:
                self.start()
                self.wait_ready()
                return self
            except ProcessStuck as e:
                self.stop()
                if attempt == 2:
                    raise
                self.progress(f"{e}; starting again with fresh ports")
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_engines(self, engines: Sequence[Any], log_dir: Path, timeout: float) -> None:
        """Wait for each engine's ``/health``, saying where its log is meanwhile."""
        for e in engines:
            name = e.spec.name

            def waiting(seconds: float, name: str = name) -> None:
                self.progress(
                    f"waiting for {name} engine ({seconds:.0f}s; log {log_dir}/{name}.log)"
                )

            e.wait_ready(timeout, progress=waiting)
            self.progress(f"{name} engine ready on {e.url}")
