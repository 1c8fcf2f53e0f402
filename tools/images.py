#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Build the container images with podman on a machine that reaches no image registry.

Three images, each built from the repository root:

* ``base``: Debian bookworm (minbase, ``python3``, ``python3-venv``, ``ca-certificates``)
  bootstrapped from Debian's packages by ``mmdebstrap`` and imported into podman as
  ``vllm-ext-base:bookworm``;
* ``engine-cpu``: ``deploy/images/engine-cpu.Containerfile`` on that base (vLLM's CPU
  build of the 0.32.0 pin, NIXL, vllm-ext: ``tools/envs.py --project runtime``),
  ``vllm-ext-engine:0.32.0-cpu``;
* ``proxy``: ``deploy/images/proxy.Containerfile`` on that base, ``vllm-ext-proxy:0.1.0``.

The CUDA engine image (``deploy/images/engine.Containerfile``) starts from vLLM's release
image, which has to be pulled: ``engine-cuda`` builds it where that works. With
``--stand-in-base`` it starts from ``vllm-cuda`` instead
(``deploy/images/vllm-cuda.Containerfile``: vLLM's CUDA wheel and its torch in a virtualenv
on the Debian base, ``vllm-ext-vllm-cuda:0.23.0``), made here first.

pip inside a build uses this machine's pip configuration (``pip config list``: indexes,
local wheel folders, certificate, constraints): it is written to a private temporary
folder and mounted, with every local file and folder it names, as build volumes under
``/run/host-pip``; nothing of it enters an image layer or this repository. pip's cache
lives in ``~/.cache/vllm-ext/images/pip`` (mounted too, as ``/run/host-pip/cache``) and
podman keeps each build's layers, so a second build after a source change redoes only
the layers it must.

Podman runs with ``deploy/images/podman-containers.conf`` (``$CONTAINERS_CONF``; set the
variable to use another): runc instead of crun, an open-files limit within the host's.

Usage::

    python3 tools/images.py all           # base, engine-cpu, proxy
    python3 tools/images.py base [--rebuild]
    python3 tools/images.py engine-cpu
    python3 tools/images.py proxy
    python3 tools/images.py engine-cuda [--stand-in-base]   # vLLM's release image, or one made here
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IMAGES = REPO / "deploy" / "images"
PODMAN_CONF = IMAGES / "podman-containers.conf"
BASE_TAG = "vllm-ext-base:bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
#: image name -> (Containerfile, tag, build arguments)
RECIPES = {
    "engine-cpu": ("engine-cpu.Containerfile", "vllm-ext-engine:0.32.0-cpu",
                   {"BASE_IMAGE": BASE_TAG}),
    "proxy": ("proxy.Containerfile", "vllm-ext-proxy:0.1.0", {"PYTHON_IMAGE": BASE_TAG}),
    "engine-cuda": ("engine.Containerfile", "vllm-ext-engine:0.23.0-cuda", {}),
    # vLLM's release image made here (engine-cuda --stand-in-base builds it first)
    "vllm-cuda": ("vllm-cuda.Containerfile", "vllm-ext-vllm-cuda:0.23.0",
                  {"BASE_IMAGE": BASE_TAG}),
}  # fmt: skip
#: where a build sees the host's pip configuration (the Containerfiles' PIP_CONFIG_FILE)
PIP_MOUNT = "/run/host-pip"
#: pip configuration keys whose values may name local files or folders
PATH_KEYS = ("cert", "client-cert", "constraint", "find-links", "extra-index-url",
             "index-url", "requirement")  # fmt: skip


class ImageError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "vllm-ext" / "images"


def podman_env() -> dict[str, str]:
    """The environment podman runs in: this project's containers.conf unless set."""
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(PODMAN_CONF))
    return env


def podman(*args: str, check: bool = True, capture: bool = False, timeout: float | None = None):
    return subprocess.run(
        ["podman", *args],
        env=podman_env(),
        check=check,
        text=True,
        capture_output=capture,
        timeout=timeout,
    )


def image_exists(tag: str) -> bool:
    return podman("image", "exists", tag, check=False).returncode == 0


def podman_works() -> str | None:
    """None where podman can run a container here, else why not."""
    if shutil.which("podman") is None:
        return "podman is not installed"
    try:
        out = podman("info", "--format", "{{.Host.OCIRuntime.Name}}", check=False,
                     capture=True, timeout=60)  # fmt: skip
    except subprocess.TimeoutExpired:
        return "podman info did not answer within 60 s"
    if out.returncode != 0:
        return f"podman info failed: {out.stderr.strip()[-300:]}"
    return None


def host_pip_config() -> dict[str, str]:
    """This machine's effective pip options (``pip config list``), by key; a variable
    (``:env:``) wins over a file, a later file over an earlier one."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in out.stdout.splitlines():
        m = re.match(r"^(?P<section>[^.]*)\.(?P<key>[\w-]+)='(?P<value>.*)'$", line)
        if m is None:
            continue
        if m["section"] == ":env:":
            env[m["key"]] = m["value"]
        elif m["section"] in ("global", "install", "download", "wheel"):
            files[m["key"]] = m["value"]
    return {**files, **env}


def pip_mounts(workdir: Path) -> list[str]:
    """``-v`` arguments that give a build this machine's pip configuration at
    ``/run/host-pip/pip.conf``, each local file or folder it names mounted read-only
    beside it (``workdir``: a private folder that holds the written configuration)."""
    options = host_pip_config()
    volumes: list[str] = []
    mounted: dict[str, str] = {}

    def inside(path: str) -> str:
        if path not in mounted:
            mounted[path] = f"{PIP_MOUNT}/m{len(mounted)}"
            volumes.extend(["-v", f"{path}:{mounted[path]}:ro"])
        return mounted[path]

    lines = ["[global]"]
    for key, value in options.items():
        if key in PATH_KEYS:
            words = []
            for word in value.split():
                local = word[len("file://") :] if word.startswith("file://") else word
                if local.startswith("/") and os.path.exists(local):
                    # an index's pages link to its files by relative paths (../../files/):
                    # a folder named simple comes with the folder it is in
                    path = Path(local.rstrip("/"))
                    where = (
                        inside(str(path.parent)) + "/simple"
                        if path.name == "simple"
                        else inside(str(path))
                    )
                    word = ("file://" if word.startswith("file://") else "") + where
                words.append(word)
            value = " ".join(words)
        lines.append(f"{key} = {value}")
    # pip's cache, named in the configuration (HOME differs between build steps)
    lines.append(f"cache-dir = {PIP_MOUNT}/cache")
    conf = workdir / "pip.conf"
    conf.write_text("\n".join(lines) + "\n")
    conf.chmod(0o600)
    pip_cache = cache_dir() / "pip"
    pip_cache.mkdir(parents=True, exist_ok=True)
    return ["-v", f"{conf}:{PIP_MOUNT}/pip.conf:ro", *volumes,
            "-v", f"{pip_cache}:{PIP_MOUNT}/cache"]  # fmt: skip


def build_base(rebuild: bool = False) -> float:
    """mmdebstrap a Debian bookworm tarball (cached) and import it as ``BASE_TAG``."""
    t0 = time.monotonic()
    if image_exists(BASE_TAG) and not rebuild:
        print(f"[images] {BASE_TAG} exists (--rebuild to make it again)", flush=True)
        return 0.0
    tar = cache_dir() / "base-bookworm.tar"
    tar.parent.mkdir(parents=True, exist_ok=True)
    if rebuild or not tar.exists():
        partial = tar.with_suffix(".partial.tar")
        print(f"[images] mmdebstrap bookworm -> {tar}", flush=True)
        subprocess.run(
            ["mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
             "bookworm", str(partial)],
            check=True,
        )  # fmt: skip
        partial.replace(tar)
    podman("import", "--change", 'CMD ["/bin/bash"]', str(tar), BASE_TAG)
    return time.monotonic() - t0


def build_image(name: str, extra_args: list[str] | None = None) -> float:
    """``podman build`` of one recipe from the repository root; returns its seconds."""
    containerfile, tag, build_args = RECIPES[name]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vllm-ext-pip-") as work:
        args = ["build", "--network", "host", "--layers", "-f", str(IMAGES / containerfile),
                "-t", tag, *pip_mounts(Path(work))]  # fmt: skip
        for key, value in build_args.items():
            args += ["--build-arg", f"{key}={value}"]
        args += [*(extra_args or []), str(REPO)]
        print(f"[images] building {tag} from {containerfile}", flush=True)
        if podman(*args, check=False).returncode != 0:
            raise ImageError(f"building {tag} failed (its output is above)")
    took = time.monotonic() - t0
    print(f"[images] {tag} built in {took:.0f} s", flush=True)
    return took


def build_cuda_engine_on_stand_in() -> dict[str, float]:
    """The CUDA engine image on ``vllm-cuda`` (a stand-in for vLLM's release image made
    on the Debian base) instead of the release image; the seconds each build took."""
    took = {"base": build_base(), "vllm-cuda": build_image("vllm-cuda")}
    stand_in = f"localhost/{RECIPES['vllm-cuda'][1]}"
    took["engine-cuda"] = build_image("engine-cuda", ["--build-arg", f"BASE_IMAGE={stand_in}"])
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=["all", "base", *RECIPES])
    ap.add_argument("--rebuild", action="store_true", help="base: bootstrap Debian again")
    ap.add_argument(
        "--stand-in-base",
        action="store_true",
        help="engine-cuda: build on a stand-in for vLLM's release image made here "
        "(vllm-cuda.Containerfile on the Debian base) instead of pulling the release image",
    )
    args = ap.parse_args(argv)
    if (why := podman_works()) is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        if args.stand_in_base and args.what == "engine-cuda":
            build_cuda_engine_on_stand_in()
            return 0
        if args.what in ("all", "base", "vllm-cuda"):
            build_base(args.rebuild)
        for name in ("engine-cpu", "proxy") if args.what == "all" else [args.what]:
            if name in RECIPES:
                build_image(name)
    except (ImageError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
