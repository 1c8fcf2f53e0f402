# SPDX-License-Identifier: Apache-2.0
"""vllm-ext: push-mode NIXL KV transfer for vLLM prefill/decode disaggregation.

The package is loaded by vLLM through the ``vllm.general_plugins`` entry point;
:func:`register` is the only thing that runs at load time.
"""

from __future__ import annotations

import threading

__all__ = [
    "register",
    "CONNECTOR_MODULE",
    "EXT_CONNECTOR_NAME",
    "PUSH_CONNECTOR_NAME",
    "ALLOW_VLLM_PUSH_ENV",
]

#: Name under which our connector is always registered (side by side with vLLM's own):
#: the name users are told to use.
EXT_CONNECTOR_NAME = "ExtNixlPushConnector"
#: vLLM's name for a push connector; ours takes it only where vLLM has none.
PUSH_CONNECTOR_NAME = "NixlPushConnector"
#: ``1``: ``NixlPushConnector`` may run vLLM's own push connector where vLLM has one.
#: Unset, asking for that name there is an error (:func:`_guard_vllm_push`).
ALLOW_VLLM_PUSH_ENV = "VLLM_EXT_ALLOW_VLLM_PUSH"
CONNECTOR_MODULE = "vllm_ext.nixl_push.connector"
CONNECTOR_CLASS = "NixlPushConnector"

_lock = threading.Lock()


def register() -> list[str]:
    """Register our KV connector(s) (:func:`_register`); with
    ``$VLLM_EXT_HANDOFF_TRACE`` set (benchmarks only), also time the hand-off of
    every push connector this vLLM has (``vllm_ext.handoff_trace``)."""
    names = _register()
    import os

    if os.environ.get("VLLM_EXT_HANDOFF_TRACE"):
        from vllm_ext import handoff_trace

        handoff_trace.install()
    return names


def _register() -> list[str]:
    """Register our KV connector(s) with vLLM's ``KVConnectorFactory``.

    Called by vLLM in the API server, the engine core and every worker process;
    calling it again in the same process is harmless. Returns the names this
    process now has registered to us (empty on an unsupported vLLM).

    * vLLM without an in-tree push connector (pin 0.23.0): registers both
      ``NixlPushConnector`` and ``ExtNixlPushConnector``.
    * vLLM with its own ``NixlPushConnector`` (pin 0.32.0): never shadows it and
      registers ``ExtNixlPushConnector`` only, so both run side by side.
    * A pin our connector is not ported to yet (``connector = false`` in
      ``ci/pins.toml``): one line saying so, nothing registered.
    * Any other vLLM: one error line, and ``ExtNixlPushConnector`` (with
      ``NixlPushConnector`` where vLLM has none) refuses at startup with the same
      message (:func:`_refuse_unsupported`); nothing of ours runs.

    Wherever vLLM has its own ``NixlPushConnector``, that name is guarded: a config
    that asks for it fails at startup with an error naming ``ExtNixlPushConnector``
    instead of running vLLM's push silently (:func:`_guard_vllm_push`).
    """
    from vllm_ext import compat
    from vllm_ext.log import get_logger

    logger = get_logger(__name__)

    with _lock:
        installed = compat.installed_vllm_version()
        pin = compat.pin_for(installed)
        _guard_vllm_push(installed, ours=pin is not None and pin.connector)
        if pin is None:
            message = unsupported_vllm_message(installed)
            logger.error("%s", message)
            _refuse_unsupported(message)
            return []
        if not pin.connector:
            logger.info(
                "vllm-ext: our push connector does not run on vLLM %s yet (validated: %s); "
                "nothing registered%s",
                installed,
                ", ".join(v for v, p in compat.load_pins().items() if p.connector),
                ": vLLM's own NixlPushConnector is there" if pin.in_tree_push else "",
            )
            return []

        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        registry = KVConnectorFactory._registry
        wanted = [EXT_CONNECTOR_NAME]
        if not pin.in_tree_push:
            wanted.append(PUSH_CONNECTOR_NAME)

        mine: list[str] = []
        added: list[str] = []
        for name in wanted:
            if name not in registry:
                KVConnectorFactory.register_connector(name, CONNECTOR_MODULE, CONNECTOR_CLASS)
                added.append(name)
            if _is_ours(registry[name]):
                mine.append(name)
            else:  # someone else's (e.g. vLLM's own): never shadowed
                logger.warning("vllm-ext: %s is already registered elsewhere; kept", name)
        if added:
            logger.info(
                "vllm-ext: registered %s -> %s.%s (vLLM %s)",
                " and ".join(added),
                CONNECTOR_MODULE,
                CONNECTOR_CLASS,
                installed,
            )
        return mine


def unsupported_vllm_message(installed: str | None) -> str:
    """What an engine asking for our connector on a vLLM no pin covers is told (S-PIN-4)."""
    from vllm_ext import compat

    releases = [v for v, p in compat.load_pins().items() if p.connector]
    series = ", ".join(f"{'.'.join(v.split('.')[:2])}.x" for v in releases)
    have = f"vLLM {installed}" if installed else "a vLLM whose version cannot be read"
    return (
        f"vllm-ext's {EXT_CONNECTOR_NAME} does not run on {have}: it supports vLLM "
        f"{series} only (tested on {', '.join(releases)}; vllm_ext/pins.toml). Install one of "
        f"those vLLM releases next to this vllm-ext, or a vllm-ext whose pins name vLLM "
        f"{installed or '<your version>'}; nothing runs in its place."
    )


def _refuse_unsupported(message: str) -> None:
    """On a vLLM no pin covers, a config naming our connector fails at startup with
    ``message`` (vLLM's factory calls the loader when it builds the connector) instead
    of vLLM's bare "unsupported connector" or a silent fallback. ``NixlPushConnector``
    is guarded the same way only where vLLM has none of its own."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    def refused() -> type:
        raise ValueError(message)

    refused.vllm_ext_guard = True  # type: ignore[attr-defined]
    registry = KVConnectorFactory._registry
    for name in (EXT_CONNECTOR_NAME, PUSH_CONNECTOR_NAME):
        if name not in registry:  # vLLM's own push connector keeps its guard
            registry[name] = refused


def _is_ours(loader: object) -> bool:
    """Whether a factory registry entry was made by us (checks the lazy loader's closure)."""
    closure = getattr(loader, "__closure__", None) or ()
    return any(getattr(c, "cell_contents", None) == CONNECTOR_MODULE for c in closure)


def _guard_vllm_push(installed: str | None, ours: bool) -> None:
    """Where vLLM registered its own ``NixlPushConnector``, make that name fail with a
    clear error unless ``$VLLM_EXT_ALLOW_VLLM_PUSH`` is ``1``: a config written for our
    connector would otherwise run vLLM's push, silently. (A ``kv_connector_module_path``
    names a class directly and is not guarded: that is an explicit choice too.)"""
    import os

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = KVConnectorFactory._registry
    loader = registry.get(PUSH_CONNECTOR_NAME)
    if loader is None or _is_ours(loader) or getattr(loader, "vllm_ext_guard", False):
        return
    use = (
        f"use kv_connector {EXT_CONNECTOR_NAME!r} for vllm-ext's push connector"
        if ours
        else f"vllm-ext's push connector does not run on vLLM {installed}"
    )
    message = (
        f"kv_connector {PUSH_CONNECTOR_NAME!r} is vLLM {installed}'s own push connector, not "
        f"vllm-ext's: {use}. To run vLLM's own, set {ALLOW_VLLM_PUSH_ENV}=1 (or its "
        "kv_connector_module_path)."
    )

    def guarded() -> type:
        if os.environ.get(ALLOW_VLLM_PUSH_ENV) == "1":
            return loader()  # type: ignore[no-any-return]
        raise ValueError(message)

    guarded.vllm_ext_guard = True  # type: ignore[attr-defined]
    registry[PUSH_CONNECTOR_NAME] = guarded
