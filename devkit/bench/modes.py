# SPDX-License-Identifier: Apache-2.0
"""The mode table: what the benchmark compares (an open list: add a row).

A mode is a deployment recipe: which pinned vLLM runs the engines, the launcher
mode (``push``: the proxy's legs run concurrently; ``pull``: sequentially;
``single``: one plain engine), and which KV connector class (optionally loaded
through ``kv_connector_module_path``).

A variant of a mode sets ``kv_connector_extra_config`` keys for an A/B of one knob:
``push-0.23+push_recv_idle_wait_ms=0+push_prepare_at_announce=false`` (values are
JSON; anything else is taken as a string).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

PRIMARY_PIN = "0.23.0"
TUNED_MODULE = "devkit.bench.tuned_pull"
#: our proxy + the D-leg field vLLM's own push (0.26.0 to 0.34.0) needs (vllm_push_proxy.py)
VLLM_PUSH_PROXY = "devkit.bench.vllm_push_proxy"


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    pin: str
    launch: Literal["push", "pull", "single"]
    connector: str | None = None
    module_path: str | None = None
    extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    about: str = ""
    #: proxy module run with ``python -m`` (None: ``vllm_ext.proxy``)
    proxy_module: str | None = None
    #: engines write hand-off traces (devkit.bench.trace_push) under the run's logs
    trace: bool = False
    #: vLLM's own connector, run as released: the engines get none of the settings the
    #: launcher gives ours (on a GPU: the V1 model runner for cross-layer KV)
    vllm_connector: bool = False
    #: the connector (loaded through ``module_path``) subclasses our NixlPushConnector:
    #: its engines get the settings the launcher gives ours (on a GPU: cross-layer KV)
    extends_ours: bool = False

    @property
    def disaggregated(self) -> bool:
        return self.launch != "single"

    @property
    def ours(self) -> bool:
        """Our push connector as such (on any pin; not a subclass of it)."""
        return (
            self.launch == "push"
            and not self.vllm_connector
            and not self.extends_ours
            and self.connector == "ExtNixlPushConnector"
        )


_ALL = [
    Mode("pull-0.23", "0.23.0", "pull", "NixlConnector",
         about="vLLM 0.23.0 NixlConnector (D READs after prefill), as released + our CPU patches"),
    Mode("push-0.23", "0.23.0", "push", "ExtNixlPushConnector",
         about="ours: P WRITEs into D's pre-registered blocks; legs concurrent"),
    Mode("vllm-push-0.32", "0.32.0", "push", "NixlPushConnector",
         about="vLLM 0.32.0's own NixlPushConnector, legs concurrent",
         proxy_module=VLLM_PUSH_PROXY, vllm_connector=True),
    Mode("pull-0.32", "0.32.0", "pull", "NixlConnector",
         about="vLLM 0.32.0 NixlConnector (pull)"),
    Mode("single-0.23", "0.23.0", "single",
         about="one plain engine on one core: the baseline of the disaggregation overhead"),
    Mode("pull-0.23-tuned", "0.23.0", "pull", "TunedNixlConnector", TUNED_MODULE,
         about="vLLM 0.23.0 pull + our NIXL/UCX/affinity fixes"),
    Mode("vllm-push-0.32-tuned", "0.32.0", "push", "TunedNixlPushConnector", TUNED_MODULE,
         about="vLLM 0.32.0's own push + our NIXL/UCX/affinity fixes",
         proxy_module=VLLM_PUSH_PROXY),
    Mode("push-0.23-traced", "0.23.0", "push", "TracedNixlPushConnector",
         "devkit.bench.trace_push", trace=True, extends_ours=True,
         about="ours with timestamps per hand-off stage (diagnostics)"),
    # Optional rows (not in the default run).
    Mode("pull-0.32-tuned", "0.32.0", "pull", "TunedNixlConnector", TUNED_MODULE,
         about="vLLM 0.32.0 pull + our NIXL/UCX/affinity fixes"),
    Mode("push-0.32", "0.32.0", "push", "ExtNixlPushConnector",
         about="ours on 0.32.0 (ExtNixlPushConnector; no PP, no cross-layer KV there)"),
    Mode("single-0.32", "0.32.0", "single", about="one plain engine, vLLM 0.32.0"),
    # GPU baseline: vLLM 0.32.0's CUDA wheel needs torch 2.13, the GPU image has 2.11;
    # 0.26.0 is the newest release whose own push runs there (a bundle_only pin).
    Mode("vllm-push-0.26", "0.26.0", "push", "NixlPushConnector",
         about="vLLM 0.26.0's own NixlPushConnector, legs concurrent (GPU baseline)",
         proxy_module=VLLM_PUSH_PROXY, vllm_connector=True),
    # Like for like on one release: vLLM 0.34.0 ships its own NixlPushConnector, ours runs
    # beside it as ExtNixlPushConnector. vLLM 0.34.0 has no cross-layer KV layout (nor a
    # V1 model runner): both connectors register the same per-layer tensors, with the
    # same block size. GPU bundle: docs/offline-install.md (vLLM 0.34.0).
    Mode("push-0.34", "0.34.0", "push", "ExtNixlPushConnector",
         about="ours on vLLM 0.34.0 (ExtNixlPushConnector; per-layer KV, as vLLM's)"),
    Mode("vllm-push-0.34", "0.34.0", "push", "NixlPushConnector",
         about="vLLM 0.34.0's own NixlPushConnector, legs concurrent",
         proxy_module=VLLM_PUSH_PROXY, vllm_connector=True),
    Mode("single-0.34", "0.34.0", "single", about="one plain engine, vLLM 0.34.0"),
]  # fmt: skip

MODES: dict[str, Mode] = {m.name: m for m in _ALL}
DEFAULT_MODES = ["pull-0.23", "push-0.23", "vllm-push-0.32", "pull-0.32", "single-0.23",
                 "pull-0.23-tuned", "vllm-push-0.32-tuned", "push-0.23-traced"]  # fmt: skip

#: The rows the CPU targets compare (docs/benchmarks.md, *CPU targets*).
OURS = "push-0.23"
PULL = "pull-0.23"
PULL_TUNED = "pull-0.23-tuned"
VLLM_PUSH = "vllm-push-0.32"
SINGLE = "single-0.23"


def resolve(names: list[str]) -> list[Mode]:
    """Modes by name (or ``name+key=value...`` variants), in the given order; unknown
    names raise with the list of known ones."""
    unknown = [n for n in names if n.split("+", 1)[0] not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    return [mode_of(n) for n in names]


def mode_of(name: str) -> Mode:
    """The mode called ``name``: a row of the table, or a variant of one."""
    base, *settings = name.split("+")
    mode = MODES[base]
    if not settings:
        return mode
    extra = dict(mode.extra_config)
    for item in settings:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"mode {name!r}: {item!r} is not key=value")
        try:
            extra[key] = json.loads(raw)
        except json.JSONDecodeError:
            extra[key] = raw
    about = f"{mode.about}; with {', '.join(settings)}"
    return dataclasses.replace(mode, name=name, extra_config=extra, about=about)


def disaggregated(name: str) -> bool:
    """Whether the mode called ``name`` runs P and D (unknown names, e.g. from an older
    results file, count as disaggregated)."""
    return name.split("+", 1)[0] not in MODES or mode_of(name).disaggregated


def pins_of(modes: list[Mode]) -> list[str]:
    return sorted({m.pin for m in modes})
