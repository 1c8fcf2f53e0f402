# SPDX-License-Identifier: Apache-2.0
"""Fault injection at the NIXL API boundary, inside an engine process.

Installed by ``sitehook/sitecustomize.py`` in processes started with
``VLLM_EXT_FAULTS_DIR`` set (test engines only; never in a deployment). It wraps
five methods of NIXL's Python ``nixl_agent`` -- ``send_notif``, ``get_new_notifs``,
``initialize_xfer`` / ``make_prepped_xfer`` and ``transfer`` (+ ``check_xfer_state``
for the end of a WRITE) -- so it sees what any NIXL connector does, ours or vLLM's
own, whatever their internals: a PUSH_REG going out, a notification coming in, a
WRITE being posted and ending.

Two files per engine (``VLLM_EXT_FAULTS_NAME``, e.g. ``prefill``) in that folder:

* ``<name>.rules.json``, written by the test at any time (re-read when it changes):
  ``{"rules": [{...}, ...]}``. A rule applies to the calls of one kind (``on``:
  ``send``, ``recv``, ``transfer``) whose message (for ``transfer``: the WRITE's
  notification, i.e. D's request id) starts with ``prefix`` and contains ``match``;
  it acts at most ``times`` times (by ``id``, across re-reads):

  ==========  ============================================================
  ``drop``    the message is not sent / not delivered
  ``dup``     sent / delivered twice (the copy ``delay_s`` later if set)
  ``delay``   sent / delivered ``delay_s`` later (on a later NIXL call)
  ``rewrite`` PUSH_* msgpack map: keys of ``set`` replaced (e.g. D's port)
  ``kill``    SIGKILL the process group ``pid`` (0: this engine) ``when``
              ``before`` or ``after`` the real call
  ``stall``   sleep ``delay_s`` before the real call
  ==========  ============================================================

* ``<name>.events.jsonl``, appended by the shim: one JSON line per PUSH_* or
  completion notification sent or received, WRITE posted / ended and rule applied,
  with ``t`` = ``time.monotonic()`` (one clock for every process of the host), so a
  test can wait for a moment of a request's life ("P posted the WRITE of X").

Delayed messages leave on a later NIXL call of the same agent (a push writer calls
``get_new_notifs`` at least once per engine step while a request is in flight).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DIR_ENV = "VLLM_EXT_FAULTS_DIR"
NAME_ENV = "VLLM_EXT_FAULTS_NAME"
#: Rules files are checked for changes at most this often (seconds).
RELOAD_INTERVAL_S = 0.02

ACTIONS = ("drop", "dup", "delay", "rewrite", "kill", "stall")
HOOKS = ("send", "recv", "transfer")
#: Notifications worth an event line (heartbeats are not).
_PUSH_PREFIXES = (b"PUSH_REG:", b"PUSH_FAIL:", b"PUSH_CANCEL:")


def rules_path(folder: Path | str, name: str) -> Path:
    return Path(folder) / f"{name}.rules.json"


def events_path(folder: Path | str, name: str) -> Path:
    return Path(folder) / f"{name}.events.jsonl"


def reg_blocks(msg: bytes) -> list[int]:
    """D's block ids in a PUSH_REG (ours: ``block_ids``; vLLM 0.32: ``local_block_ids``)."""
    try:
        body = _unpack(msg[len(b"PUSH_REG:") :])
        groups = body.get("block_ids") or body.get("local_block_ids") or []
        return [int(b) for g in groups for b in (g if isinstance(g, list) else [g])]
    except Exception:
        return []


def classify(msg: bytes) -> tuple[str, str | None]:
    """(kind, request id) of a notification, never raising: ``PUSH_REG``,
    ``PUSH_FAIL``, ``PUSH_CANCEL``, ``HB``, ``completion`` (vLLM's ``<id>:<tp>`` or our
    ``PUSH_DONE:``) or ``other``."""
    try:
        for prefix in _PUSH_PREFIXES:
            if msg.startswith(prefix):
                kind = prefix[:-1].decode()
                body = _unpack(msg[len(prefix) :])
                rid = body.get("request_id") if isinstance(body, dict) else None
                return kind, rid if isinstance(rid, str) else None
        if msg.startswith(b"PUSH_DONE:"):  # a completion with D's reply token (S-WIR-3)
            body = _unpack(msg[len(b"PUSH_DONE:") :])
            rid = body.get("request_id") if isinstance(body, dict) else None
            return "completion", rid if isinstance(rid, str) else None
        if msg.startswith(b"HB:"):
            return "HB", None
        text = msg.decode("utf-8")
        rid, sep, tp = text.rpartition(":")
        if sep and rid and tp.isdigit():
            return "completion", rid
    except Exception:
        pass
    return "other", None


def _unpack(payload: bytes) -> Any:
    import msgpack

    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


def rewrite(msg: bytes, changes: dict[str, Any]) -> bytes:
    """A ``PUSH_*:<msgpack map>`` message with some keys replaced."""
    import msgpack

    prefix, sep, payload = msg.partition(b":")
    body = _unpack(payload)
    if not sep or not isinstance(body, dict):
        return msg
    body.update(changes)
    return prefix + sep + msgpack.packb(body, use_bin_type=True)


class Rule:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.id = str(spec.get("id", id(spec)))
        self.on = spec.get("on", "send")
        self.action = spec["action"]
        if self.on not in HOOKS or self.action not in ACTIONS:
            raise ValueError(f"bad rule {spec}")
        self.prefix = str(spec.get("prefix", "")).encode()
        self.match = str(spec.get("match", "")).encode()
        self.times = int(spec.get("times", 1))
        self.delay_s = float(spec.get("delay_s", 0.0))
        self.pid = int(spec.get("pid", 0))
        self.when = spec.get("when", "before")
        self.changes: dict[str, Any] = dict(spec.get("set", {}))

    def matches(self, hook: str, msg: bytes) -> bool:
        return hook == self.on and msg.startswith(self.prefix) and self.match in msg


class Injector:
    """The rules and the event log of one engine process (thread-safe)."""

    def __init__(self, folder: Path | str, name: str) -> None:
        self.name = name
        self.rules_file = rules_path(folder, name)
        self.events_file = events_path(folder, name)
        self._lock = threading.RLock()
        self._rules: list[Rule] = []
        self._used: dict[str, int] = {}
        self._mtime: float | None = None
        self._checked = 0.0
        self._events = self.events_file.open("a", buffering=1)
        #: (due monotonic time, remote agent, message) sends waiting for their time
        self._later_sends: list[tuple[float, str, bytes]] = []
        #: (due, sender, message) notifications held back from get_new_notifs
        self._later_recvs: list[tuple[float, str, bytes]] = []
        #: WRITE handle -> its notification (D's request id), for ``transfer`` rules
        self._xfer_notif: dict[int, bytes] = {}
        self._xfer_ended: set[int] = set()

    # -- rules ------------------------------------------------------------------------
    def _reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < RELOAD_INTERVAL_S:
            return
        self._checked = now
        try:
            mtime = self.rules_file.stat().st_mtime
        except OSError:
            mtime = None
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            specs = json.loads(self.rules_file.read_text())["rules"] if mtime else []
            self._rules = [Rule(s) for s in specs]
        except Exception as e:  # a half-written file: keep the old rules, retry later
            self._mtime = None
            self.event("rules_error", error=f"{type(e).__name__}: {e}")

    def take(self, hook: str, msg: bytes) -> Rule | None:
        """The first live rule for this call, counted as used."""
        with self._lock:
            self._reload()
            for rule in self._rules:
                if self._used.get(rule.id, 0) < rule.times and rule.matches(hook, msg):
                    self._used[rule.id] = self._used.get(rule.id, 0) + 1
                    return rule
        return None

    # -- events -----------------------------------------------------------------------
    def event(self, _ev: str, **fields: Any) -> None:
        try:
            line = json.dumps({"t": time.monotonic(), "pid": os.getpid(), "ev": _ev, **fields})
        except (TypeError, ValueError):
            line = json.dumps({"t": time.monotonic(), "pid": os.getpid(), "ev": _ev})
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._events.write(line + "\n")

    def note_notif(self, direction: str, peer: str, msg: bytes, **extra: Any) -> None:
        kind, rid = classify(msg)
        if kind == "HB":
            return
        if kind == "PUSH_REG":
            extra["blocks"] = reg_blocks(msg)
        self.event(direction, kind=kind, rid=rid, peer=str(peer), size=len(msg), **extra)

    # -- actions ----------------------------------------------------------------------
    def kill(self, rule: Rule, what: str) -> None:
        target = rule.pid or os.getpgrp()
        self.event("kill", rule=rule.id, pgid=target, at=what)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(target, signal.SIGKILL)

    # -- wrappers ---------------------------------------------------------------------
    def send_notif(self, orig: Callable[..., Any], agent: Any, remote: str, msg: bytes, *a: Any,
                   **kw: Any) -> Any:  # fmt: skip
        self.flush_sends(orig, agent)
        msg = bytes(msg)
        rule = self.take("send", msg)
        if rule is None:
            self.note_notif("sent", remote, msg)
            return orig(agent, remote, msg, *a, **kw)
        self.event("rule", rule=rule.id, action=rule.action, hook="send", rid=classify(msg)[1])
        if rule.action == "drop":
            self.note_notif("dropped", remote, msg)
            return None
        if rule.action in ("delay", "dup"):
            if rule.action == "dup":
                self.note_notif("sent", remote, msg)
                orig(agent, remote, msg, *a, **kw)
            with self._lock:
                self._later_sends.append((time.monotonic() + rule.delay_s, remote, msg))
            if rule.delay_s <= 0:
                self.flush_sends(orig, agent)
            return None
        if rule.action == "rewrite":
            msg = rewrite(msg, rule.changes)
        elif rule.action == "stall":
            time.sleep(rule.delay_s)
        elif rule.action == "kill" and rule.when == "before":
            self.kill(rule, "send")
        self.note_notif("sent", remote, msg)
        out = orig(agent, remote, msg, *a, **kw)
        if rule.action == "kill" and rule.when == "after":
            self.kill(rule, "send")
        return out

    def flush_sends(self, orig_send: Callable[..., Any], agent: Any) -> None:
        if not self._later_sends:
            return
        now = time.monotonic()
        with self._lock:
            due = [x for x in self._later_sends if x[0] <= now]
            self._later_sends = [x for x in self._later_sends if x[0] > now]
        for _, remote, msg in due:
            self.note_notif("sent", remote, msg, delayed=True)
            try:
                orig_send(agent, remote, msg)
            except Exception as e:
                self.event("send_error", error=f"{type(e).__name__}: {e}")

    def get_new_notifs(self, orig: Callable[..., Any], orig_send: Callable[..., Any], agent: Any,
                       *a: Any, **kw: Any) -> dict[str, list[bytes]]:  # fmt: skip
        self.flush_sends(orig_send, agent)
        notifs = orig(agent, *a, **kw)
        out: dict[str, list[bytes]] = {}
        now = time.monotonic()
        if self._later_recvs:
            with self._lock:
                due = [x for x in self._later_recvs if x[0] <= now]
                self._later_recvs = [x for x in self._later_recvs if x[0] > now]
            for _, sender, msg in due:
                self.note_notif("recv", sender, msg, delayed=True)
                out.setdefault(sender, []).append(msg)
        for sender, msgs in notifs.items():
            for msg in msgs:
                rule = self.take("recv", bytes(msg))
                if rule is not None:
                    self.event("rule", rule=rule.id, action=rule.action, hook="recv",
                               rid=classify(bytes(msg))[1])  # fmt: skip
                    if rule.action == "drop":
                        self.note_notif("dropped", sender, msg)
                        continue
                    if rule.action in ("delay", "dup"):
                        with self._lock:
                            self._later_recvs.append((now + rule.delay_s, sender, msg))
                        if rule.action == "delay":
                            continue
                    if rule.action == "rewrite":
                        msg = rewrite(bytes(msg), rule.changes)
                self.note_notif("recv", sender, msg)
                out.setdefault(sender, []).append(msg)
        return out

    def prepared(self, handle: Any, notif: bytes) -> None:
        key = _handle_key(handle)  # NIXL may reuse a released handle's value
        with self._lock:
            self._xfer_notif[key] = bytes(notif or b"")
            self._xfer_ended.discard(key)

    def transfer(self, orig: Callable[..., Any], agent: Any, handle: Any, *a: Any,
                 **kw: Any) -> Any:  # fmt: skip
        key = _handle_key(handle)
        notif = self._xfer_notif.get(key, b"")
        rid = classify(notif)[1]
        rule = self.take("transfer", notif)
        if rule is not None:
            self.event("rule", rule=rule.id, action=rule.action, hook="transfer", rid=rid)
            if rule.action == "stall":
                time.sleep(rule.delay_s)
            elif rule.action == "kill" and rule.when == "before":
                self.kill(rule, "transfer")
            elif rule.action == "drop":  # never posted: a WRITE that silently never happens
                return "PROC"
        t0 = time.monotonic()
        state = orig(agent, handle, *a, **kw)
        self.event("xfer_post", rid=rid, state=state, post_s=time.monotonic() - t0)
        if state != "PROC":
            self._ended(key, rid, state)
        if rule is not None and rule.action == "kill" and rule.when == "after":
            self.kill(rule, "transfer")
        return state

    def check_xfer_state(self, orig: Callable[..., Any], agent: Any, handle: Any) -> Any:
        try:
            state = orig(agent, handle)
        except Exception as e:  # e.g. NIXL_ERR_REMOTE_DISCONNECT: the WRITE ended too
            key = _handle_key(handle)
            if key not in self._xfer_ended:
                rid = classify(self._xfer_notif.get(key, b""))[1]
                self._ended(key, rid, f"raised {type(e).__name__}: {e}")
            raise
        if state != "PROC":
            key = _handle_key(handle)
            if key not in self._xfer_ended:
                self._ended(key, classify(self._xfer_notif.get(key, b""))[1], state)
        return state

    def _ended(self, key: int, rid: str | None, state: str) -> None:
        with self._lock:
            self._xfer_ended.add(key)
            self._xfer_notif.pop(key, None)
            if len(self._xfer_ended) > 10_000:
                self._xfer_ended.clear()
        self.event("xfer_end", rid=rid, state=state)


def _handle_key(handle: Any) -> int:
    inner = getattr(handle, "_handle", None)
    return int(inner) if isinstance(inner, int) else id(handle)


_installed = False


def install(agent_cls: Any, injector: Injector) -> None:
    """Wrap ``agent_cls``'s methods (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    orig_send = agent_cls.send_notif
    orig_notifs = agent_cls.get_new_notifs
    orig_transfer = agent_cls.transfer
    orig_check = agent_cls.check_xfer_state

    @functools.wraps(orig_send)
    def send_notif(self: Any, remote_agent_name: str, notif_msg: bytes, *a: Any, **kw: Any) -> Any:
        return injector.send_notif(orig_send, self, remote_agent_name, notif_msg, *a, **kw)

    @functools.wraps(orig_notifs)
    def get_new_notifs(self: Any, *a: Any, **kw: Any) -> Any:
        return injector.get_new_notifs(orig_notifs, orig_send, self, *a, **kw)

    @functools.wraps(orig_transfer)
    def transfer(self: Any, handle: Any, *a: Any, **kw: Any) -> Any:
        return injector.transfer(orig_transfer, self, handle, *a, **kw)

    @functools.wraps(orig_check)
    def check_xfer_state(self: Any, handle: Any) -> Any:
        return injector.check_xfer_state(orig_check, self, handle)

    agent_cls.send_notif = send_notif
    agent_cls.get_new_notifs = get_new_notifs
    agent_cls.transfer = transfer
    agent_cls.check_xfer_state = check_xfer_state
    for name in ("initialize_xfer", "make_prepped_xfer"):
        orig = getattr(agent_cls, name, None)
        if orig is not None:
            setattr(agent_cls, name, _wrap_prepare(orig, injector))
    injector.event("installed", cls=f"{agent_cls.__module__}.{agent_cls.__qualname__}")


def _wrap_prepare(orig: Callable[..., Any], injector: Injector) -> Callable[..., Any]:
    import inspect

    params = list(inspect.signature(orig).parameters)
    index = params.index("notif_msg") if "notif_msg" in params else None

    @functools.wraps(orig)
    def prepare(self: Any, *a: Any, **kw: Any) -> Any:
        handle = orig(self, *a, **kw)
        notif = kw.get("notif_msg")
        if notif is None and index is not None and len(a) >= index:
            notif = a[index - 1]  # params[0] is self
        injector.prepared(handle, notif if isinstance(notif, bytes) else b"")
        return handle

    return prepare


def from_environment() -> Injector | None:
    folder, name = os.environ.get(DIR_ENV), os.environ.get(NAME_ENV)
    if not folder or not name:
        return None
    return Injector(folder, name)
