# SPDX-License-Identifier: Apache-2.0
"""P's answer to a push P leg that carries no ``transfer_id``: the push D leg.

A router that runs the legs one after the other (``vllm-router
--vllm-pd-disaggregation``) sends the P leg with ``do_remote_decode`` and
nothing else, waits for P's response and sends the D leg with the
``kv_transfer_params`` P answered, verbatim. vLLM's pull answer
(``remote_block_ids``) would make that a pull D leg, which a push consumer
refuses (S-LEG-2). With ``push_answer_sequential_legs`` (default on), P instead

* gives such a P leg, when it arrives, a fresh ``transfer_id`` and a secret (the
  ``transfer_secret`` the leg carries, else one P makes) and uses them for its own
  send exactly as if the leg had carried them (matching rule 1, S-WRT-4; S-LEG-3):
  only a registration carrying both is served. A client that sends both legs at
  once without ids cannot know them: it needs ``push_answer_sequential_legs:
  false`` (then its legs match by request id, S-LEG-4);
* answers, when the request finished with blocks to send, the push D-leg
  params (S-LEG-1) with that id and secret (:func:`d_leg_answer`), which the
  router hands to D: D registers at once and P WRITEs.

A client body of several sub-requests (a completion with several prompts,
``n > 1``) gets one response, hence one answer (vLLM's completion server
returns the first sub-request's), which D applies to all its sub-requests. So
the sub-requests of one body share one id and secret (:class:`SequentialLegIds`,
keyed by :func:`~vllm_ext.nixl_push.matching.body_of`); matching qualifies the
id with the sub-request, so each D sub-request still meets its own twin.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections import OrderedDict
from typing import Any

from vllm_ext.nixl_push.matching import body_of, sub_request_of

#: Sub-requests of one body reach the engine's scheduler together (the API server
#: adds them in one go); an id is shared this long at most, among this many bodies.
SHARE_WINDOW_S = 60.0
MAX_BODIES = 4096
#: Prefix of the transfer ids P makes (for the logs: a transfer id is opaque).
TRANSFER_ID_PREFIX = "p-answer-"


def new_transfer_id() -> str:
    return TRANSFER_ID_PREFIX + secrets.token_hex(16)


def new_secret() -> str:
    return secrets.token_urlsafe(24)


@dataclasses.dataclass
class _BodyIds:
    """The ids P made for one client body, and the sub-requests that took them."""

    transfer_id: str
    secret: str
    since: float
    sub_requests: set[str] = dataclasses.field(default_factory=set)


class SequentialLegIds:
    """P: the transfer id and secret of each recent client body whose P leg had none.

    A body is known by its request id without what tells its sub-requests apart
    (:func:`~vllm_ext.nixl_push.matching.body_of`: for vllm-router's legs, the
    client's X-Request-Id). Clients may send one X-Request-Id twice: a sub-request
    whose place in the body (:func:`~vllm_ext.nixl_push.matching.sub_request_of`)
    was already taken starts a new body, with new ids, so two bodies in a row never
    share a transfer id. Two bodies under one X-Request-Id whose sub-requests reach P
    interleaved can still share one; then the prompt check (S-WRT-7) refuses every
    registration that meets the other body's prompt: a request fails, none gets
    another prompt's KV.
    """

    def __init__(self, window_s: float = SHARE_WINDOW_S, max_bodies: int = MAX_BODIES) -> None:
        self.window_s = window_s
        self.max_bodies = max_bodies
        #: body -> its current ids, oldest first
        self._bodies: OrderedDict[str, _BodyIds] = OrderedDict()

    def ids_for(
        self, request_id: str, leg_secret: str | None, now: float | None = None
    ) -> tuple[str, str]:
        """The (transfer id, secret) of ``request_id``'s body: made on first use, the
        secret being the leg's own if it carried one (S-LEG-3), else one P made."""
        now = time.monotonic() if now is None else now
        self._forget_old(now)
        body, sub = body_of(request_id), sub_request_of(request_id)
        known = self._bodies.get(body)
        if (
            known is None
            or sub in known.sub_requests
            or (leg_secret is not None and leg_secret != known.secret)
        ):
            known = _BodyIds(new_transfer_id(), leg_secret or new_secret(), now)
            self._bodies[body] = known
            self._bodies.move_to_end(body)
            while len(self._bodies) > self.max_bodies:
                self._bodies.popitem(last=False)
        known.sub_requests.add(sub)
        return known.transfer_id, known.secret

    def _forget_old(self, now: float) -> None:
        while self._bodies:
            ids = next(iter(self._bodies.values()))
            if now - ids.since <= self.window_s:
                return
            self._bodies.popitem(last=False)

    def __len__(self) -> int:
        return len(self._bodies)


def d_leg_answer(
    pull_answer: dict[str, Any], pp_size: int, transfer_id: str, secret: str
) -> dict[str, Any]:
    """The push D leg (S-LEG-1) made from the pull answer of vLLM's NIXL scheduler
    (which names this engine, its side channel and its TP size): no
    ``remote_block_ids``, so D takes it as a push D leg."""
    answer: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": pull_answer["remote_engine_id"],
        "remote_host": pull_answer["remote_host"],
        "remote_port": pull_answer["remote_port"],
        "tp_size": pull_answer["tp_size"],
        "pp_size": pp_size,
        "transfer_id": transfer_id,
        "transfer_secret": secret,
    }
    return answer
