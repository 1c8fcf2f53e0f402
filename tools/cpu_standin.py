#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The wheel that lets vLLM 0.34.0 serve on an x86 CPU without triton-cpu.

The 0.34.0 CPU env is 0.34.0's Python over 0.32.0's compiled parts (``compiled_from``
in ``ci/pins.toml``, ``tools/vllm_source.py``'s ``overlay_wheel``). vLLM 0.34.0 runs
on an x86 CPU only with triton-cpu, which no package index here has; its standalone
(no-Triton) CPU model runner, which it uses on other CPUs, needs CPU kernels that
0.32.0's ``vllm._C`` lacks. This tool builds the wheel ``vllm-cpu-standin``:

* ``vllm_cpu_standin/_kernels.so``: exactly those kernels (:data:`OPS`), compiled from
  0.34.0's sdist, unchanged (:data:`SOURCES`, with the flags of vLLM's own AVX2
  build), and registered into the ``_C`` op namespace with the schemas of the sdist's
  ``csrc/cpu/torch_bindings.cpp`` (its declarations and its ``ops.def`` statements of
  those ops, copied by :func:`registration_source` into a ``TORCH_LIBRARY_FRAGMENT``);
* ``vllm_cpu_standin/__init__.py``: ``tools/cpu_standin_shim.py``, which loads that
  library and selects the standalone runner on x86 (what it changes is said there);
* ``vllm_cpu_standin.pth``: imports it at every interpreter start of the env.

``tools/envs.py`` installs it into a pin's env where the pin says ``cpu_standin =
true``. The wheel is cached under ``$VLLM_EXT_CACHE/standin-wheels`` (keyed by the
sources, the sdist, the torch version and the compiler), so the compile (minutes) runs
once::

    python3 tools/cpu_standin.py --version 0.34.0 --python .venvs/vllm-0.34.0/bin/python
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_source  # noqa: E402  (tools/: standard library only)

SHIM = Path(__file__).with_name("cpu_standin_shim.py")
DISTRIBUTION = "vllm_cpu_standin"
#: The ops of vLLM 0.34.0's standalone CPU runner that 0.32.0's ``_C`` lacks (``vllm/
#: _cpu_ops.py``); its int8 MoE ops are missing too and left out (no model here uses them).
OPS = (
    "gather_block_table_cpu",
    "compute_slot_mapping_cpu",
    "prepare_prefill_inputs_cpu",
    "get_prompt_logprobs_token_ids_cpu",
    "prepare_pos_seq_lens_cpu",
    "prepare_mrope_positions_cpu",
    "combine_sampled_and_draft_tokens_cpu",
    "post_update_cpu",
    "gumbel_sample_cpu",
    "apply_logit_bias_cpu",
)
#: The sdist's files that define them (under ``csrc/cpu/``).
SOURCES = ("block_table.cpp", "input_batch.cpp", "sampling_kernels.cpp")
BINDINGS = "torch_bindings.cpp"
#: vLLM's compile flags for its AVX2 build (``cmake/cpu_extension.cmake``), plus -O3 as
#: in its release build: the library runs on every CPU the 0.32.0 kernels run on.
COMPILE_FLAGS = ("-O3", "-fopenmp", "-DVLLM_CPU_EXTENSION", "-mf16c", "-mavx2", "-mfma")
#: The compile's bound (measured: 280 s on 2 cores shared with other builds).
COMPILE_TIMEOUT_S = 1800
_LIBRARY_OPEN = "TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {"


class StandinError(RuntimeError):
    """The wheel could not be built; the message says why."""


def _statements(text: str) -> Iterator[str]:
    """The ``ops.def(...);`` and ``ops.impl(...);`` statements of ``text``."""
    for m in re.finditer(r"ops\.(?:def|impl)\(", text):
        j, depth = m.end(), 1
        while depth:
            c = text[j]
            if c == '"':  # a string literal: its parentheses do not count
                j += 1
                while text[j] != '"':
                    j += 2 if text[j] == "\\" else 1
            depth += {"(": 1, ")": -1}.get(c, 0)
            j += 1
        yield text[m.start() : j + 1]


def registration_source(bindings: str, ops: tuple[str, ...] = OPS) -> str:
    """A C++ file registering ``ops`` into ``_C``: the declarations of ``bindings`` (the
    sdist's ``torch_bindings.cpp``, with the standalone runner's kernels declared) and
    its statements defining those ops, in a ``TORCH_LIBRARY_FRAGMENT``."""
    if _LIBRARY_OPEN not in bindings:
        raise StandinError(f"{BINDINGS} has no {_LIBRARY_OPEN!r}")
    head, body = bindings.split(_LIBRARY_OPEN, 1)
    found: dict[str, list[str]] = {}
    for statement in _statements(body):
        name = re.search(r'"(\w+)', statement)
        if name is not None and name.group(1) in ops:
            found.setdefault(name.group(1), []).append(statement)
    missing = [op for op in ops if op not in found]
    if missing:
        raise StandinError(f"{BINDINGS} defines no {', '.join(missing)}")
    lines = [f"  {s}" for op in ops for s in found[op]]
    return "\n".join(
        ["#define VLLM_STANDALONE_CPU_MRV2", head, "TORCH_LIBRARY_FRAGMENT(_C, ops) {", *lines, "}"]
    )


def _probe(python: str) -> str:
    """The torch version of ``python`` and the compiler's first line (the cache key)."""
    try:
        torch = subprocess.run(
            [python, "-c", "import torch; print(torch.__version__)"],
            capture_output=True, text=True, timeout=300, check=True,
        ).stdout.strip()  # fmt: skip
    except (subprocess.SubprocessError, OSError) as e:
        raise StandinError(f"{python} cannot import torch: {e}") from e
    cxx = shutil.which("c++")
    if cxx is None:
        raise StandinError("no C++ compiler (c++) on PATH: the kernels are compiled here")
    compiler = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    return f"{torch}|{compiler.splitlines()[0] if compiler else ''}"


def _compile(python: str, csrc: Path, build: Path) -> Path:
    sources = [build / "registration.cpp", *(csrc / "cpu" / s for s in SOURCES)]
    script = (
        "import sys\n"
        "from torch.utils.cpp_extension import load\n"
        f"load(name='vllm_cpu_standin_kernels', sources={[str(s) for s in sources]!r},\n"
        f"     extra_cflags={list(COMPILE_FLAGS)!r},\n"
        f"     extra_include_paths={[str(csrc), str(csrc / 'cpu')]!r},\n"
        f"     build_directory={str(build)!r}, is_python_module=False, verbose=True)\n"
    )
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    env = {**os.environ, "MAX_JOBS": os.environ.get("MAX_JOBS", str(min(4, os.cpu_count() or 1)))}
    try:
        done = subprocess.run(
            [*nice, python, "-c", script], capture_output=True, text=True, env=env,
            timeout=COMPILE_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise StandinError(f"compiling the kernels took over {COMPILE_TIMEOUT_S} s") from e
    library = build / "vllm_cpu_standin_kernels.so"
    if done.returncode != 0 or not library.is_file():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
        raise StandinError(f"compiling the kernels failed (exit {done.returncode}):\n{tail}")
    return library


def standin_wheel(version: str, python: str, wheel_dir: Path | None = None) -> Path:
    """The wheel for the env of ``python`` (vLLM ``version``'s Python installed, torch
    of its compiled parts): built once, then taken from the cache."""
    wheel_dir = wheel_dir or vllm_source.cache_root() / "standin-wheels"
    sdist = vllm_source.find_or_download_sdist(version)
    if sdist is None:
        raise StandinError(f"the index has no sdist of vllm=={version}")
    with tarfile.open(sdist) as tf:
        bindings_member = next(m for m in tf.getmembers() if m.name.endswith(f"/cpu/{BINDINGS}"))
        bindings_file = tf.extractfile(bindings_member)
        assert bindings_file is not None
        registration = registration_source(bindings_file.read().decode())
    key = hashlib.sha256()
    # what the wheel is made of: a change to this file elsewhere rebuilds nothing
    for part in (registration, repr((SOURCES, COMPILE_FLAGS)), sdist.name, _probe(python)):
        key.update(part.encode())
    key.update(SHIM.read_bytes())
    full = f"{version}+{key.hexdigest()[:12]}"
    target = wheel_dir / f"{DISTRIBUTION}-{full}-py3-none-linux_x86_64.whl"
    if target.is_file():
        return target
    wheel_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".standin-", dir=wheel_dir) as tmp:
        root = Path(tmp)
        with tarfile.open(sdist) as tf:
            members = [m for m in tf.getmembers() if "/csrc/" in m.name]
            tf.extractall(root, members=members, filter="data")
        csrc = next(root.glob("*/csrc"))
        build = root / "build"
        build.mkdir()
        (build / "registration.cpp").write_text(registration)
        library = _compile(python, csrc, build)
        files = {
            f"{DISTRIBUTION}/__init__.py": SHIM.read_bytes(),
            f"{DISTRIBUTION}/_kernels.so": library.read_bytes(),
            f"{DISTRIBUTION}.pth": f"import {DISTRIBUTION}; {DISTRIBUTION}.install()\n".encode(),
        }
        _write_wheel(target, full, files, f"vLLM {version}'s CPU kernels of {sdist.name}")
    return target


def _write_wheel(target: Path, version: str, files: dict[str, bytes], summary: str) -> None:
    dist_info = f"{DISTRIBUTION}-{version}.dist-info"
    files = {
        **files,
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: {version}\n"
            f"Summary: {summary}; made by vllm-ext tools/cpu_standin.py\n"
        ).encode(),
        f"{dist_info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: vllm-ext\nRoot-Is-Purelib: false\n"
            b"Tag: py3-none-linux_x86_64\n"
        ),
    }
    vllm_source.write_wheel(target, files, dist_info)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", required=True, help="the vLLM release (its sdist)")
    ap.add_argument("--python", required=True, help="the env's python (its torch)")
    args = ap.parse_args(argv)
    try:
        print(standin_wheel(args.version, args.python))
    except (StandinError, vllm_source.SourceError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
