# SPDX-License-Identifier: Apache-2.0
"""Start one vLLM OpenAI server on loopback, configured for these CPU machines (or for
GPUs: ``device="cuda"``, see :mod:`devkit.launch.gpu`)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devkit.launch.gpu import CPU_ONLY_ENV, gpu_env
from devkit.launch.process import ManagedProcess, free_port, wait_http_ready
from vllm_ext import ALLOW_VLLM_PUSH_ENV, PUSH_CONNECTOR_NAME

#: Seconds an engine may take to answer /health (45-120 s measured; more under load).
ENGINE_START_TIMEOUT_S = 420.0
#: Name the tiny model is served under.
SERVED_MODEL_NAME = "tiny"
#: Log lines after which a starting engine never becomes ready: it hangs instead of
#: exiting (a port taken between the launcher's pick and the engine's bind kills
#: vLLM's NIXL handshake listener thread, not the server).
#: Log lines after which an engine never becomes ready: a port taken between vLLM's
#: pick and its bind (its HTTP or side-channel port; torch.distributed's store, which
#: kills the engine: "EADDRINUSE"), or a dead handshake listener.
STUCK_MARKERS = (
    "Address already in use",
    "EADDRINUSE",
    "Exception in thread nixl_handshake_listener",
)


#: Set to 1 in a CPU engine's environment (unless set already): torch's inductor then
#: takes the vector ISAs that torch detects on the CPU as buildable instead of proving
#: each one. vLLM's CPU sampler is a ``torch.compile`` function, compiled at every
#: engine's warm-up; the proof builds a probe per ISA and loads it in a new Python that
#: imports torch, one after another: about 6 s of CPU per engine, and most of the
#: warm-up (push pairs on the loaded 2-core machine: warm-up 41-73 s without the
#: variable, 10-24 s with it). The AVX-512 extensions (VNNI, BF16) are still proven.
#: Engines made to see an AVX2-only CPU (``devkit.testing.cpu_isa``) get AVX2 as before.
INDUCTOR_VEC_ISA_OK_ENV = "TORCHINDUCTOR_VEC_ISA_OK"

#: Where vLLM makes the ZMQ IPC sockets between its API server and engine core
#: (``ipc://$VLLM_RPC_BASE_PATH/<uuid4>``; the system's temporary folder by default),
#: which an engine that is killed leaves behind: :func:`start_engine` gives each engine
#: a folder of its own, removed with the engine's processes (``ManagedProcess``'s
#: ``scratch_env``).
RPC_BASE_PATH_ENV = "VLLM_RPC_BASE_PATH"

#: vLLM's notes on model classes under ``VLLM_CACHE_ROOT``; see :func:`modelinfo_store`.
MODELINFOS = "modelinfos"


def modelinfo_store(python: str) -> Path:
    """Where engines of one interpreter (one env, so one vLLM) keep vLLM's model-class
    notes for each other: ``$VLLM_EXT_CACHE/modelinfos/<hash of the python path>``.

    An engine whose cache root lacks the note for its model class inspects the class in
    a process of its own, which imports vLLM once more (about 15 s of CPU: one engine
    was ready in 62 s with an empty cache root, in 46 s with the note); every engine of
    a run gets a fresh cache root. vLLM keys each note by a hash of the model's source
    file and recomputes a note that does not match, so a copied note never stands for
    another class or another vLLM.
    """
    root = Path(os.environ.get("VLLM_EXT_CACHE", Path.home() / ".cache" / "vllm-ext"))
    key = hashlib.sha256(str(Path(python).absolute()).encode()).hexdigest()[:12]
    return root / MODELINFOS / key


def copy_modelinfos(src: Path, dst: Path) -> None:
    """Copy the notes of ``src`` that ``dst`` lacks (each by a rename: a reader never
    sees half a file); a folder that cannot be read or written is left as it is."""
    with contextlib.suppress(OSError):
        dst.mkdir(parents=True, exist_ok=True)
        for note in src.glob("*.json"):
            if not (dst / note.name).exists():
                tmp = dst / f".{note.name}.{os.getpid()}.tmp"
                shutil.copyfile(note, tmp)
                tmp.replace(dst / note.name)


def saved_dtype(model: str) -> str:
    """``torch_dtype`` of a local model folder's config.json; ``auto`` otherwise.

    The test model is float32 because bfloat16 logits of a random model tie often
    enough (spacing 1/32 near the top) that greedy outputs depend on batch shape.
    """
    config = Path(model) / "config.json"
    try:
        dtype = json.loads(config.read_text()).get("torch_dtype")
    except (OSError, ValueError):
        return "auto"
    return dtype if isinstance(dtype, str) else "auto"


@dataclasses.dataclass
class EngineSpec:
    """What to start. ``cpu`` pins the engine's OMP threads to one core (None: no binding).

    ``device="cuda"``: the engine runs on the GPUs in ``cuda_devices``
    (``CUDA_VISIBLE_DEVICES``) with ``gpu_args`` (memory, load format, parallelism);
    ``cpu`` and the ``VLLM_CPU_*`` variables do not apply there.
    """

    name: str
    model: str
    port: int = 0
    kv_transfer_config: dict[str, Any] | None = None
    side_channel_port: int = 0
    cpu: int | None = None
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    kv_cache_gib: int = 1
    extra_args: list[str] = dataclasses.field(default_factory=list)
    extra_env: dict[str, str] = dataclasses.field(default_factory=dict)
    python: str = sys.executable
    #: command prefix, e.g. ``["taskset", "-c", "0"]``
    wrapper: list[str] = dataclasses.field(default_factory=list)
    #: ``"cpu"`` or ``"cuda"``
    device: str = "cpu"
    #: ``CUDA_VISIBLE_DEVICES`` of a GPU engine
    cuda_devices: str | None = None
    #: server arguments only a GPU engine gets (``GpuOptions.args``)
    gpu_args: list[str] = dataclasses.field(default_factory=list)
    #: ``--enforce-eager`` (no compilation, no CUDA graphs)
    enforce_eager: bool = True
    #: ``VLLM_CACHE_ROOT`` (None: ``cache-<name>`` under the run folder)
    cache_root: Path | None = None
    #: address the HTTP server binds (and ``url`` names); e.g. the engine's own address
    #: in a network namespace a test made (``devkit.testing.faults.netns``)
    host: str = "127.0.0.1"
    #: ``VLLM_NIXL_SIDE_CHANNEL_HOST``: where the NIXL side channel listens
    side_channel_host: str = "127.0.0.1"
    #: ``--dtype``; None: the ``torch_dtype`` a local model was saved in (vLLM's
    #: ``auto`` would run a float32 model in bfloat16), else vLLM's ``auto``
    dtype: str | None = None

    def __post_init__(self) -> None:
        if not self.port:
            self.port = free_port()
        if self.kv_transfer_config is not None and not self.side_channel_port:
            self.side_channel_port = free_port()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def cache_dir(self, run_dir: Path) -> Path:
        """The engine's ``VLLM_CACHE_ROOT``."""
        return self.cache_root or run_dir / f"cache-{self.name}"

    def argv(self) -> list[str]:
        args = [
            *self.wrapper,
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--served-model-name", SERVED_MODEL_NAME,
            "--host", self.host,
            "--port", str(self.port),
            *(["--enforce-eager"] if self.enforce_eager else []),
            "--max-model-len", str(self.max_model_len),
            "--seed", "0",
            "--dtype", self.dtype or saved_dtype(self.model),
        ]  # fmt: skip
        if self.device == "cuda":
            args += self.gpu_args
        if not self.enable_prefix_caching:
            args.append("--no-enable-prefix-caching")
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return args + self.extra_args

    def env(self, run_dir: Path) -> dict[str, str]:
        env = dict(os.environ)
        if self.device == "cuda":
            for key in CPU_ONLY_ENV:
                env.pop(key, None)
            env.update(gpu_env(self.cuda_devices or "0"))
        else:
            env.update(
                VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
                VLLM_CPU_OMP_THREADS_BIND="nobind" if self.cpu is None else str(self.cpu),
            )
            env.setdefault(INDUCTOR_VEC_ISA_OK_ENV, "1")
        env.update(
            VLLM_CACHE_ROOT=str(self.cache_dir(run_dir)),
            VLLM_NIXL_SIDE_CHANNEL_HOST=self.side_channel_host,
            VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"),
            PYTHONUNBUFFERED="1",
        )
        if self.side_channel_port:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        if (self.kv_transfer_config or {}).get("kv_connector") == PUSH_CONNECTOR_NAME:
            # this launcher's callers name vLLM's push connector on purpose (the
            # baselines); where the name is ours, the variable changes nothing
            env.setdefault(ALLOW_VLLM_PUSH_ENV, "1")
        env.update(self.extra_env)
        return env


def kv_transfer_config(
    connector: str,
    role: str,
    engine_id: str,
    extra_config: dict[str, Any] | None = None,
    *,
    device: str = "cpu",
    module_path: str | None = None,
) -> dict[str, Any]:
    """An engine's ``--kv-transfer-config`` (every P/D launcher here builds it so)."""
    kv: dict[str, Any] = {
        "kv_connector": connector,
        "kv_role": role,
        "kv_buffer_device": device,
        "engine_id": engine_id,
        "kv_connector_extra_config": dict(extra_config or {}),
    }
    if module_path:
        kv["kv_connector_module_path"] = module_path
    return kv


def pin_to_core(spec: EngineSpec, cpu: int | None) -> None:
    """Run the engine's processes on core ``cpu`` (``taskset``, where there is one)
    after whatever ``spec.wrapper`` already runs it in; None: anywhere."""
    if cpu is not None and shutil.which("taskset"):
        spec.wrapper = [*spec.wrapper, "taskset", "-c", str(cpu)]


class Engine:
    """A running engine (see :func:`start_engine`)."""

    def __init__(
        self, spec: EngineSpec, proc: ManagedProcess, modelinfos: Path | None = None
    ) -> None:
        self.spec = spec
        self.proc = proc
        #: the engine's own notes on model classes, shared once it is ready
        self.modelinfos = modelinfos

    @property
    def url(self) -> str:
        return self.spec.url

    def wait_ready(
        self,
        timeout: float = ENGINE_START_TIMEOUT_S,
        progress: Callable[[float], None] | None = None,
    ) -> float:
        waited = wait_http_ready(
            f"{self.url}/health", timeout, self.proc, progress, stuck_markers=STUCK_MARKERS
        )
        if self.modelinfos is not None:
            copy_modelinfos(self.modelinfos, modelinfo_store(self.spec.python))
        return waited

    def stop(self) -> None:
        self.proc.stop()

    def kill(self, wait_s: float = 15.0) -> None:
        """SIGKILL the engine's whole process group (API server and engine core): a
        crash. Waits up to ``wait_s`` for the leader to be gone."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.proc.wait(wait_s)


def start_engine(spec: EngineSpec, run_dir: Path) -> Engine:
    """Spawn the engine (returns at once; call ``wait_ready``). Logs go to ``run_dir``.

    An engine with the run's own cache root (no ``cache_root``) starts with the notes on
    model classes that engines of its interpreter made before (:func:`modelinfo_store`)
    and adds its own once ready."""
    run_dir.mkdir(parents=True, exist_ok=True)
    modelinfos = None
    if spec.cache_root is None:
        modelinfos = spec.cache_dir(run_dir) / MODELINFOS
        copy_modelinfos(modelinfo_store(spec.python), modelinfos)
    proc = ManagedProcess(
        spec.name, spec.argv(), run_dir / f"{spec.name}.log", env=spec.env(run_dir),
        scratch_env=None if RPC_BASE_PATH_ENV in spec.extra_env else RPC_BASE_PATH_ENV,
    )  # fmt: skip
    return Engine(spec, proc, modelinfos)
