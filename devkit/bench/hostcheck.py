# SPDX-License-Identifier: Apache-2.0
"""Is this host ready for the GPU runs? Each item ok / FAILED with what was found.

    python -m devkit.bench.hostcheck --device cuda --out check.json

Items: python, torch and its CUDA, two GPUs with peer access, vLLM (version, where
from), NIXL (``nixl._api``, the CUDA build), this project (where from, its
``vllm.general_plugins`` entry point, the connector registered in vLLM's factory,
the pin's patches applied), the model directories (built here: the tiny model and
the Qwen3-8B-shaped one) and the GPU benchmark's plan (``--dry-run``). Nothing is
started and nothing needs the network; a failed item never stops the others.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Item = tuple[bool, Any]


def _python() -> Item:
    return True, {"version": sys.version.split()[0], "executable": sys.executable}


def _torch(device: str, min_gpus: int = 2) -> Item:
    import torch

    info: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda}
    if device != "cuda":
        return True, info
    n = torch.cuda.device_count()
    info["device_count"] = n
    info["devices"] = [torch.cuda.get_device_name(i) for i in range(n)]
    if n >= 2:  # reported: UCX and NCCL can do without it, only slower
        info["peer_access_0_1"] = torch.cuda.can_device_access_peer(0, 1)
    return n >= min_gpus, info


def _module_file(name: str) -> Item:
    mod = importlib.import_module(name)
    return True, {
        "file": getattr(mod, "__file__", None),
        "version": getattr(mod, "__version__", None),
    }


def _nixl() -> Item:
    from importlib.metadata import PackageNotFoundError, version

    from nixl._api import nixl_agent  # noqa: F401

    found = {}
    for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
        with contextlib.suppress(PackageNotFoundError):
            found[dist] = version(dist)
    return True, found


PLUGIN_GROUP = "vllm.general_plugins"
SHIM_DIST = "vllm_ext_plugin_shim-0.dist-info"


def ensure_entry_point(folder: Path) -> Path | None:
    """Make vLLM load our plugin in every process even where this project was not
    installed (only put on ``PYTHONPATH``, e.g. an offline bundle built without it):
    if no distribution declares the ``vllm.general_plugins`` entry point to
    ``vllm_ext``, write a minimal one under ``folder`` and return ``folder`` (to put on
    ``PYTHONPATH``); else None."""
    from importlib.metadata import entry_points

    if any(e.value.startswith("vllm_ext") for e in entry_points(group=PLUGIN_GROUP)):
        return None
    dist = folder / SHIM_DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-ext-plugin-shim\nVersion: 0\n"
    )
    (dist / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\nvllm_ext = vllm_ext:register\n")
    return folder


def _entry_point() -> Item:
    from importlib.metadata import entry_points

    eps = [f"{e.name} = {e.value}" for e in entry_points(group=PLUGIN_GROUP)]
    return any("vllm_ext" in e for e in eps), eps


def _registered() -> Item:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    import vllm_ext

    load_general_plugins()
    reg = KVConnectorFactory._registry
    ours = {n: vllm_ext._is_ours(reg[n]) for n in ("NixlPushConnector", "ExtNixlPushConnector")
            if n in reg}  # fmt: skip
    # ours is ExtNixlPushConnector everywhere, NixlPushConnector too where vLLM has none
    # (0.23.0); from 0.26.0 that name is vLLM's own (the vllm-push-* modes run it)
    return bool(ours.get("ExtNixlPushConnector")) and "NixlConnector" in reg, ours


def _patches() -> Item:
    out = subprocess.run(
        [sys.executable, "-m", "vllm_ext.patchtool", "status", "--installed"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = (out.stdout + out.stderr).strip()
    m = re.search(r"(\d+)/(\d+) applicable patches applied", text)
    ok = m is not None and m[1] == m[2]
    return out.returncode == 0 and ok, text[-1500:]


def _models() -> Item:
    from devkit.testing.shaped_model import QWEN3_8B, build_shaped_model
    from devkit.testing.tiny_model import build_tiny_model

    return True, {"tiny": str(build_tiny_model()), "qwen3-8b": str(build_shaped_model(QWEN3_8B))}


def _bench_plan(device: str) -> Item:
    if device != "cuda":
        return True, "skipped (cpu)"
    out = subprocess.run(
        [sys.executable, "-m", "devkit.bench.gpu", "--out", "/tmp/vllm-ext-plan/bench",
         "--dry-run"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if out.returncode:
        return False, out.stderr[-1500:]
    plan = json.loads(out.stdout)
    return True, {"points": plan["points"], "modes": plan["modes"]}


#: Items without which no engine can run here.
FATAL = ("torch", "vllm", "vllm_ext")


def checks(device: str, min_gpus: int = 2) -> dict[str, Callable[[], Item]]:
    return {
        "python": _python,
        "torch": lambda: _torch(device, min_gpus),
        "vllm": lambda: _module_file("vllm"),
        "nixl": _nixl,
        "vllm_ext": lambda: _module_file("vllm_ext"),
        "entry_point": _entry_point,
        "connector_registered": _registered,
        "patches": _patches,
        "models": _models,
        "bench_plan": lambda: _bench_plan(device),
    }


def run(device: str, min_gpus: int = 2) -> dict[str, Any]:
    items: dict[str, Any] = {}
    for name, fn in checks(device, min_gpus).items():
        t0 = time.monotonic()
        try:
            ok, detail = fn()
        except Exception as e:  # every item reports; none stops the others
            ok, detail = False, f"{type(e).__name__}: {e}"
        items[name] = {"ok": ok, "detail": detail, "s": round(time.monotonic() - t0, 1)}
        print(f"[check] {name}: {'ok' if ok else 'FAILED'} {json.dumps(detail)[:400]}", flush=True)
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("CUDA_", "NCCL_", "TORCH_", "NVSHMEM_", "VLLM_", "UCX_"))
           or k in ("PYTHONPATH",)}  # fmt: skip
    # without these nothing can run on this host; anything else fails one mode or check
    fatal = [k for k in FATAL if not items[k]["ok"]]
    return {"ok": all(i["ok"] for i in items.values()), "fatal": fatal, "items": items, "env": env}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--plugin-shim", type=Path, metavar="DIR",
        help="only: write the plugin entry point under DIR if none is installed; print DIR then",
    )  # fmt: skip
    ap.add_argument("--min-gpus", type=int, default=2, help="GPUs needed (1: P and D share one)")
    args = ap.parse_args(argv)
    if args.plugin_shim:
        made = ensure_entry_point(args.plugin_shim)
        if made:
            print(made)
        return 0
    res = run(args.device, args.min_gpus)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    verdict = "all ok" if res["ok"] else f"NOT READY (fatal: {res['fatal'] or 'none'})"
    print(f"[check] {verdict}", flush=True)
    return 0 if res["ok"] else (2 if res["fatal"] else 1)


if __name__ == "__main__":
    sys.exit(main())
