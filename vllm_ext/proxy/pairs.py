# SPDX-License-Identifier: Apache-2.0
"""Health of each (P, D) pair: KV must cross between two engines that both answer ``/health``.

A network partition between a P and a D leaves both engines healthy one by one
while every request they share fails (P's WRITE never reaches D; the D leg errs or
times out, or the P leg reports the transfer). Each pair therefore keeps its own
record, a small circuit breaker:

* ``healthy``: ``pair_failures`` transfer failures in a row (:func:`counts_against_pair`)
  back the pair off; a success resets the count.
* ``backed-off`` for the pair's current back-off (``pair_backoff`` at first): the
  choice skips it. Outcomes of requests sent before it was backed off change nothing.
* ``probing`` once the back-off elapsed: the next request that may use the pair goes
  to it, one at a time (the probe). Its success puts the pair back (``healthy``,
  back-off reset); a transfer failure backs it off again for twice as long, up to
  ``pair_backoff_max``. A probe that ends otherwise (4xx, client gone) frees the
  slot for the next.
* The back-off only steers requests to other pairs: while no pair of in-service
  engines may take a request, requests still go to one that is backed off (its
  *last resort*, SPEC S-PRX-2) rather than being refused, so one request's failure
  never takes the only pair out. A last-resort request that succeeds puts its pair
  back as a probe would; one that fails changes nothing more.

Each transition is logged once (SPEC S-PRX-2). Everything runs on the proxy's event loop.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Literal

from vllm_ext.proxy.config import ProxyConfig
from vllm_ext.proxy.errors import UPSTREAM_TIMEOUT, LegError

logger = logging.getLogger("vllm.ext.proxy")

PairState = Literal["healthy", "backed-off", "probing"]
PAIR_STATES: tuple[PairState, ...] = ("healthy", "backed-off", "probing")


def counts_against_pair(err: LegError, client_got_bytes: bool) -> bool:
    """Whether a request's failure ``err`` counts as a transfer failure of its pair.

    Counted: an engine error (5xx, a broken or malformed answer) of either leg,
    before the client got anything from D. Not counted (SPEC S-PRX-2): a timeout (a
    slow prompt says nothing about the pair), a 4xx (the client's request was
    rejected), a refused connection or one dropped before any answer (the engine is
    going or gone: its own health takes it out), a failure after D already streamed
    to the client (the KV had crossed). Client aborts never reach here.
    """
    if client_got_bytes or err.status < 500 or err.type == UPSTREAM_TIMEOUT:
        return False
    return not err.engine_unhealthy


@dataclass
class PairHealth:
    """One (P, D) pair's record (see the module docstring)."""

    prefill: str
    decode: str
    config: ProxyConfig
    state: PairState = "healthy"
    #: transfer failures in a row while healthy (the count that backs it off)
    failures: int = 0
    #: the back-off the pair gets next time (and has now, while backed off)
    backoff: float = 0.0
    #: monotonic time the current back-off ends
    until: float = 0.0
    probe_in_flight: bool = False
    last_error: str | None = None
    #: totals since the proxy started
    successes: int = 0
    transfer_failures: int = 0
    times_backed_off: int = 0

    def __post_init__(self) -> None:
        self.backoff = self.config.pair_backoff

    @property
    def name(self) -> str:
        return f"{self.prefill}->{self.decode}"

    # -- choice ----------------------------------------------------------------------
    def refresh(self, now: float) -> None:
        """Move a back-off that elapsed to ``probing`` (logged once)."""
        if self.state == "backed-off" and now >= self.until:
            self.state = "probing"
            logger.info(
                "pair %s: back-off of %gs over; the next request that may use it probes it",
                self.name,
                self.backoff,
            )

    def usable(self, now: float) -> bool:
        """Whether a new request may go to this pair now."""
        self.refresh(now)
        return self.state == "healthy" or (self.state == "probing" and not self.probe_in_flight)

    def wants_probe(self, now: float) -> bool:
        self.refresh(now)
        return self.state == "probing" and not self.probe_in_flight

    def claim(self, now: float) -> bool:
        """Take the pair for one request; returns whether that request is the probe."""
        if self.wants_probe(now):
            self.probe_in_flight = True
            return True
        return False

    def retry_in(self, now: float) -> float:
        """Seconds until the pair may take a request again (0 if it may now)."""
        self.refresh(now)
        if self.state == "backed-off":
            return max(0.0, self.until - now)
        return 1.0 if self.probe_in_flight else 0.0

    # -- outcomes --------------------------------------------------------------------
    def succeeded(self, probe: bool, last_resort: bool = False) -> None:
        self.successes += 1
        if probe:
            self.probe_in_flight = False
        if self.state == "healthy":
            self.failures = 0
        elif probe or last_resort:
            logger.warning(
                "pair %s: %s succeeded after %d transfer failures: back in service",
                self.name,
                "probe" if probe else "a last-resort request",
                self.failures,
            )
            self.state, self.failures, self.backoff = "healthy", 0, self.config.pair_backoff

    def failed(self, probe: bool, error: str) -> None:
        self.transfer_failures += 1
        if probe:
            self.probe_in_flight = False
        if self.state == "healthy":
            self.failures += 1
            self.last_error = error
            if self.failures >= self.config.pair_failures:
                self._back_off(f"{self.failures} transfer failures in a row")
        elif probe:
            self.failures += 1
            self.last_error = error
            self.backoff = min(2 * self.backoff, self.config.pair_backoff_max)
            self._back_off("its probe failed")

    def released(self, probe: bool) -> None:
        """The request ended without saying anything about the pair (4xx, client gone)."""
        if probe:
            self.probe_in_flight = False

    def _back_off(self, why: str) -> None:
        self.state = "backed-off"
        self.until = time.monotonic() + self.backoff
        self.times_backed_off += 1
        logger.warning(
            "pair %s backed off for %gs after %s (last: %s)",
            self.name,
            self.backoff,
            why,
            self.last_error,
        )

    def describe(self, now: float) -> dict[str, object]:
        self.refresh(now)
        return {
            "prefill": self.prefill,
            "decode": self.decode,
            "state": self.state,
            "failures_in_a_row": self.failures,
            "retry_in_s": round(self.retry_in(now), 3),
            "backoff_s": self.backoff,
            "probe_in_flight": self.probe_in_flight,
            "last_error": self.last_error,
            "successes": self.successes,
            "transfer_failures": self.transfer_failures,
            "times_backed_off": self.times_backed_off,
        }


@dataclass
class PairLease:
    """The pair one request uses, and whether the request is its probe or was sent to it
    though it is backed off (``last_resort``: no pair of in-service engines was usable);
    ended once."""

    pair: PairHealth
    probe: bool
    last_resort: bool = False
    done: bool = False

    def end(self, outcome: Literal["success", "failure", "neutral"], error: str = "") -> None:
        """Account the request's outcome to the pair (only the first call counts)."""
        if self.done:
            return
        self.done = True
        if outcome == "success":
            self.pair.succeeded(self.probe, self.last_resort)
        elif outcome == "failure":
            self.pair.failed(self.probe, error)
        else:
            self.pair.released(self.probe)


class NoPairAvailable(Exception):
    """No engine of a role is known or in service: the client gets 503 (SPEC S-PRX-2)."""

    def __init__(
        self, message: str, retry_after: float, reason: str = "no-engine", out_of_service: str = ""
    ) -> None:
        super().__init__(message)
        self.message = message
        #: the role whose engines are all known but out of service (worth probing now)
        self.out_of_service = out_of_service
        #: ``no-engine``: a role has no engine known (DNS) or none in service
        self.reason = reason
        #: whole seconds for the ``Retry-After`` header (at least 1)
        self.retry_after = max(1, math.ceil(retry_after))
