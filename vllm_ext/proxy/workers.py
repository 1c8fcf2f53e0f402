# SPDX-License-Identifier: Apache-2.0
"""Several proxy processes on one port (``--workers N``).

The proxy serves every request on one Python thread; ``--workers N`` runs N such
processes (workers) behind one address. This process, the supervisor, serves
nothing itself: it starts the workers (``python -m vllm_ext.proxy`` with the same
arguments), each of which binds the port with ``SO_REUSEPORT``, so the kernel spreads
new client connections over them. Each worker is a whole proxy of its own: its own
connection pool, engine health, pair records and back-offs, and its own admission
(``--max-in-flight`` and ``--max-connections`` hold per worker: N workers admit N
times ``--max-in-flight`` in all). ``/health`` answers for the worker that got the
probe (its payload names it under ``worker``). ``/metrics``, from whichever worker,
sums every worker's series (:mod:`vllm_ext.proxy.metrics`), through a folder of
prometheus_client's multiprocess files this supervisor makes and removes.

Signals: SIGTERM or SIGINT to the supervisor goes on to every worker, and each drains
as one proxy does (:mod:`vllm_ext.proxy.serve`); the supervisor exits once all have,
0 if all exited 0. The workers run in a session of their own, so a terminal's Ctrl-C
reaches them once, through the supervisor. A worker whose supervisor is gone drains
as on SIGTERM. A worker that exits on its own (a crash) makes the supervisor drain
the others and exit 1: what restarts the proxy (Kubernetes, systemd) restarts it whole.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger("vllm.ext.proxy")

#: set in a worker's environment: ``<index>/<workers>``
WORKER_ENV = "VLLM_EXT_PROXY_WORKER"
#: prometheus_client's folder of multiprocess files (read when it is imported)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: how often the supervisor looks at its workers (seconds)
_POLL_S = 0.1


@dataclass(frozen=True)
class Worker:
    """Which worker this process is (``index`` from 0 of ``workers``)."""

    index: int
    workers: int
    multiprocess_dir: str

    def describe(self) -> dict[str, int]:
        return {"index": self.index, "workers": self.workers, "pid": os.getpid()}


def this_worker() -> Worker | None:
    """This process's place among the workers, or ``None`` when it is no worker."""
    text = os.environ.get(WORKER_ENV)
    folder = os.environ.get(MULTIPROC_ENV)
    if not text or not folder:
        return None
    index, _, workers = text.partition("/")
    return Worker(int(index), int(workers), folder)


def supervise(argv: Sequence[str], workers: int) -> int:
    """Start ``workers`` workers with ``argv`` (the proxy's arguments) and wait for them
    as the module docstring says; the supervisor's exit status."""
    folder = tempfile.mkdtemp(prefix="vllm-ext-proxy-metrics-")
    procs: list[subprocess.Popen[bytes]] = []
    signalled: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        signalled.append(signum)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for index in range(workers):
            env = {**os.environ, WORKER_ENV: f"{index}/{workers}", MULTIPROC_ENV: folder}
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "vllm_ext.proxy", *argv],
                    env=env,
                    start_new_session=True,
                )
            )
        logger.info(
            "proxy supervisor: %d workers (pids %s) on one port",
            workers,
            " ".join(str(p.pid) for p in procs),
        )
        return _wait(procs, signalled, folder)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in procs:  # only after an error of the supervisor itself
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _wait(procs: list[subprocess.Popen[bytes]], signalled: list[int], folder: str) -> int:
    """Wait until every worker has exited; a worker that exits before any signal drains
    the others. The supervisor's exit status."""
    crashed = False
    codes: dict[int, int] = {}
    while len(codes) < len(procs):
        time.sleep(_POLL_S)
        for proc in procs:
            code = proc.poll()
            if code is None or proc.pid in codes:
                continue
            codes[proc.pid] = code
            with_state = os.path.join(folder, f"state_{proc.pid}.json")
            if os.path.exists(with_state):
                os.remove(with_state)
            if not signalled and not crashed:
                crashed = True
                logger.error(
                    "proxy worker %d exited (status %d) unasked: draining the others",
                    proc.pid,
                    code,
                )
                for other in procs:
                    if other.poll() is None:
                        other.send_signal(signal.SIGTERM)
    if crashed:
        return 1
    return 0 if all(code == 0 for code in codes.values()) else 1
