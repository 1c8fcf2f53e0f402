# SPDX-License-Identifier: Apache-2.0
"""What the demo prints: the pair's tokens next to one engine's, equality, TTFT, KV moved."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from devkit import demo
from devkit.launch.client import Completion


def _out(ids: list[int], ttft_s: float = 0.05, text: str = "qz#k") -> Completion:
    return Completion(text, ids, ttft_s, 0.4, len(ids))


def _push(ids, ref_ids, pushed: float, writes: float = 1, ext=300, loc=1) -> demo.RequestResult:
    return demo.RequestResult(
        prompt="x" * 100,
        pair=_out(ids),
        pushed_bytes=pushed,
        writes=writes,
        d_external_tokens=ext,
        d_local_tokens=loc,
        reference=_out(ref_ids, ttft_s=0.12),
    )


def test_report_shows_equality_ttft_and_kv_and_says_the_text_is_gibberish() -> None:
    results = [
        _push([1, 2, 3], [1, 2, 3], pushed=0, writes=0, ext=0, loc=9),
        _push(list(range(20)), list(range(20)), pushed=300 * 1024),
    ]
    text = demo.format_report(results, "push")
    assert "random weights" in text and "gibberish by design" in text
    assert "push P/D    tokens: 1 2 3" in text and "one engine  tokens: 1 2 3" in text
    assert "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 ... (20 tokens)" in text
    assert text.count("equal: yes") == 2
    assert "TTFT 50 ms, total 400 ms (one engine: TTFT 120 ms)" in text
    assert "KV pushed P -> D: none (no whole KV block" in text
    assert "KV pushed P -> D: 300 KiB in 1 WRITE(s)" in text
    assert "D's prompt tokens: 300 from P's KV, 1 computed by D" in text
    assert text.rstrip().endswith(
        "PASS: 2/2 outputs equal one engine's; 300 KiB of KV pushed in all"
    )


def test_report_flags_a_difference() -> None:
    text = demo.format_report([_push([1, 2, 3], [1, 2, 4], pushed=1024)], "push")
    assert "equal: NO" in text
    assert "FAIL: 0/1 outputs equal one engine's" in text


def test_single_mode_has_no_reference_and_no_kv_lines() -> None:
    text = demo.format_report([demo.RequestResult("hi", _out([7, 8]))], "single")
    assert "one engine  tokens: 7 8" in text
    assert "equal:" not in text and "KV pushed" not in text and "PASS" not in text
    assert "gibberish by design" in text


def test_engine_metrics_keys_what_the_demo_reads() -> None:
    """P's push counters and D's prompt tokens by source, as a vLLM server exports them."""
    import http.server
    import threading

    from devkit.bench import probes

    body = (
        b"# TYPE vllm:ext_push_bytes_total counter\n"
        b'vllm:ext_push_bytes_total{engine="0",model_name="tiny"} 307200.0\n'
        b'vllm:ext_push_bytes_created{engine="0",model_name="tiny"} 1.7e9\n'
        b'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 300.0\n'
        b'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 1.0\n'
        b'vllm:ext_push_handoff_seconds_bucket{engine="0",le="0.01"} 2.0\n'
    )

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        m = probes.engine_metrics(f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    assert m == {
        demo.PUSH_BYTES: 307200.0,
        demo.D_EXTERNAL.removeprefix("d:"): 300.0,
        demo.D_LOCAL.removeprefix("d:"): 1.0,
    }


def test_the_demo_command_answers_help_without_building_anything(tmp_path: Path) -> None:
    """``python3 tools/demo.py --help`` prints the options at once: it never runs the env
    builder (here an empty HOME and cache: a build would have to download)."""
    repo = Path(__file__).resolve().parents[2]
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "VLLM_EXT_CACHE": str(tmp_path)}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(repo / "tools" / "demo.py"), "--help"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--mode {push,pull,single}" in proc.stdout and "--max-tokens" in proc.stdout
    assert "build" not in proc.stderr and time.monotonic() - t0 < 30
