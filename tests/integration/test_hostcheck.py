# SPDX-License-Identifier: Apache-2.0
"""The GPU runbook's host check, run here with --device cpu: every item but the GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(300)
def test_hostcheck_cpu(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, "-m", "devkit.bench.hostcheck", "--device", "cpu", "--out", str(out)],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    res = json.loads(out.read_text())
    failed = {k: v for k, v in res["items"].items() if not v["ok"]}
    assert proc.returncode == 0 and res["ok"], failed
    items = res["items"]
    assert items["connector_registered"]["detail"]["NixlPushConnector"] is True
    assert any("vllm_ext" in e for e in items["entry_point"]["detail"])
    assert "applicable patches applied" in items["patches"]["detail"]
    assert Path(items["models"]["detail"]["qwen3-8b"], "config.json").is_file()
    assert "[check] all ok" in proc.stdout
