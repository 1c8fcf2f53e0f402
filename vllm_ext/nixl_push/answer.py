# SPDX-License-Identifier: Apache-2.0
"""P's answer to a push P leg that carries no ``transfer_id``: the push D leg.

A router that runs the legs one after the other (``vllm-router
--vllm-pd-disaggregation``) sends the P leg with ``do_remote_decode`` and
nothing else, waits for P's response and sends the D leg with the
``kv_transfer_params`` P answered, verbatim. vLLM's pull answer
(``remote_block_ids``) would make that a pull D leg, which a push consumer
refuses (S-LEG-2). With ``push_answer_sequential_legs`` (default on), P instead

* gives such a P leg, when it arrives, a fresh ``transfer_id`` and uses it for its
  own send exactly as if the leg had carried it (matching rule 1, S-WRT-4); a
  ``transfer_secret`` the leg carries is kept and answered too (S-LEG-3). P makes
  up no secret: a client that sends both legs at once without ids must still be
  matched by request id, as S-LEG-1 allows (a made-up secret would refuse its D
  leg), and the random transfer id already names only this transfer;
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

import secrets
import time
from collections import OrderedDict
from typing import Any

from vllm_ext.nixl_push.matching import P_MADE_TRANSFER_ID_PREFIX, body_of

#: Sub-requests of one body reach the engine's scheduler together (the API server
#: adds them in one go); an id is shared this long at most, among this many bodies.
SHARE_WINDOW_S = 60.0
MAX_BODIES = 4096
#: Prefix of the transfer ids P makes (matching.py: such an id does not keep a
#: registration with another transfer id from matching by request id).
TRANSFER_ID_PREFIX = P_MADE_TRANSFER_ID_PREFIX


def new_transfer_id() -> str:
    return TRANSFER_ID_PREFIX + secrets.token_hex(16)


class SequentialLegIds:
    """P: the transfer id of each recent client body whose P leg had none."""

    def __init__(self, window_s: float = SHARE_WINDOW_S, max_bodies: int = MAX_BODIES) -> None:
        self.window_s = window_s
        self.max_bodies = max_bodies
        #: body -> (transfer id, time.monotonic() of its first sub-request)
        self._bodies: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def ids_for(
        self, request_id: str, leg_secret: str | None, now: float | None = None
    ) -> tuple[str, str | None]:
        """The (transfer id, secret) of ``request_id``'s body: the id made on first use,
        the secret the leg carried (None if it carried none)."""
        now = time.monotonic() if now is None else now
        self._forget_old(now)
        body = body_of(request_id)
        known = self._bodies.get(body)
        if known is None:
            known = (new_transfer_id(), now)
            self._bodies[body] = known
            while len(self._bodies) > self.max_bodies:
                self._bodies.popitem(last=False)
        return known[0], leg_secret

    def _forget_old(self, now: float) -> None:
        while self._bodies:
            _, (_, since) = next(iter(self._bodies.items()))
            if now - since <= self.window_s:
                return
            self._bodies.popitem(last=False)

    def __len__(self) -> int:
        return len(self._bodies)


def d_leg_answer(
    pull_answer: dict[str, Any], pp_size: int, transfer_id: str, secret: str | None
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
    }
    if secret is not None:
        answer["transfer_secret"] = secret
    return answer
