# SPDX-License-Identifier: Apache-2.0
"""P/D correctness on real engines: push output equals one engine's, token for token.

    python -m devkit.bench.correctness --device cuda --out verdict.json
    python -m devkit.bench.correctness --device cpu --out verdict.json   # same checks on CPU

The tiny model with seeded real weights (its greedy outputs depend on the whole
context, so on the KV: a wrong or missing transfer changes them). Phases, one
deployment each, in order:

* ``single``: one engine (GPU 0): the reference outputs, with the top-2 logprobs of
  every generated token (to tell a numerical near-tie from a wrong KV on mismatch);
* ``push``: our push 1P1D (P on GPU 0, D on GPU 1);
* ``push-tp2`` (GPUs only): P with tensor parallelism 2 over both GPUs, D on GPU 1.

For each P/D phase: the greedy token ids of every prompt (1 to ~4k tokens, sent one
at a time) equal the reference; the KV crossed (P's WRITEs and bytes, D's prompt
tokens came from the transfer, not its own compute); no push failure counted; and
afterwards no KV block in use and no request left on P or D. The prompts sent all at
once are compared too (reported, not judged: on GPUs batching may change the last
bits). Prefix caching is off everywhere (every request moves its whole KV).

Engines start eager (no compilation). Every phase is bounded (``--budget-s``: a
phase that could not finish in the time left is skipped, not started). The verdict
JSON is written after every phase.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from devkit.bench import probes
from devkit.launch.client import complete
from devkit.launch.engine import SERVED_MODEL_NAME
from devkit.launch.gpu import GpuOptions
from devkit.launch.pd import PDConfig, PDDeployment

PROMPT_LENS = (1, 128, 300, 1000, 4000)
MAX_TOKENS = 16
MAX_MODEL_LEN = 8192
#: KV of the tiny model per token, all layers: 4 layers x (K, V) x 2 KV heads x 64 x bf16
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 2
BLOCK_TOKENS = {"cpu": 128, "cuda": 16}
#: a phase is started only with this much of the budget left (start + requests)
PHASE_EST_S = {"cpu": 150.0, "cuda": 120.0}
IDLE_TIMEOUT_S = 60.0
#: GPU engines of the tiny model: a fixed, small KV cache, so that two engines can share a
#: GPU and start together (vLLM then skips its whole-GPU memory profiling)
GPU_KV_BYTES = 4 << 30
GPU_MEMORY_SHARE = 0.3
#: ``push-progressive``: P computes prompts in chunks of this many tokens and writes
#: each chunk's full blocks before the prompt ends (push_progressive, S-PRG-1)
PROGRESSIVE_CHUNK_TOKENS = 512


def make_prompts(lens: tuple[int, ...] = PROMPT_LENS, seed: int = 1234) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1024) for _ in range(n)] for n in lens]


def phases_for(device: str, gpus: tuple[str, str] = ("0", "1")) -> list[str]:
    """The phases that run by default: TP2 on P needs two distinct GPUs."""
    if device != "cuda":
        return ["single", "push", "push-progressive"]
    if gpus[0] == gpus[1]:
        return ["single", "push", "push-progressive"]
    return ["single", "push", "push-progressive", "push-tp2"]


def gpu_options(
    phase: str, gpus: tuple[str, str] = ("0", "1"), compiled_async: bool = False
) -> GpuOptions:
    """Every phase eager (or, ``compiled_async``, compiled with CUDA graphs and async
    scheduling, vLLM's defaults on GPUs), with a fixed KV cache and a third of each GPU
    per engine (P and D may share one GPU: ``gpus`` ``("0", "0")``)."""
    p_gpu, d_gpu = gpus
    common: dict[str, Any] = {
        "enforce_eager": not compiled_async,
        "async_scheduling": compiled_async,
        "memory_utilization": GPU_MEMORY_SHARE,
        "kv_cache_memory_bytes": GPU_KV_BYTES,
        "start_timeout_s": 420.0,
    }
    if phase == "push-tp2":
        if p_gpu == d_gpu:
            raise ValueError("push-tp2 needs two distinct GPUs")
        return GpuOptions(p_devices=f"{p_gpu},{d_gpu}", d_devices=d_gpu, p_tp_size=2, **common)
    return GpuOptions(p_devices=p_gpu, d_devices=d_gpu, single_devices=p_gpu, **common)


def pd_config(
    phase: str,
    device: str,
    model: str,
    run_dir: Path,
    gpus: tuple[str, str] = ("0", "1"),
    compiled_async: bool = False,
) -> PDConfig:
    mode = "single" if phase == "single" else "push"
    progressive = phase == "push-progressive"
    return PDConfig(
        mode=mode,  # type: ignore[arg-type]
        model=model,
        run_dir=run_dir / phase,
        enable_prefix_caching=False,
        max_model_len=MAX_MODEL_LEN,
        gpu=gpu_options(phase, gpus, compiled_async) if device == "cuda" else None,
        extra_config={"push_progressive": True} if progressive else {},
        p_extra_args=(
            ["--max-num-batched-tokens", str(PROGRESSIVE_CHUNK_TOKENS)] if progressive else []
        ),
    )


def reference_request(url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """Greedy ids and the top-2 logprobs per generated token, straight from one engine."""
    body = {
        "model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "logprobs": 2, "return_token_ids": True,
    }  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        choice = json.loads(r.read())["choices"][0]
    top = (choice.get("logprobs") or {}).get("top_logprobs") or []
    return {
        "token_ids": choice.get("token_ids") or [],
        "top2": [sorted(t.values(), reverse=True)[:2] for t in top if t],
    }


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def wait_idle(urls: dict[str, str], timeout: float = IDLE_TIMEOUT_S) -> dict[str, Any]:
    """Poll until no KV block is in use and no request is running or waiting on each side."""
    deadline = time.monotonic() + timeout
    state: dict[str, Any] = {}
    while True:
        state = {}
        for side, url in urls.items():
            m = probes.engine_metrics(url)
            state[side] = {
                "kv_cache_usage_perc": m.get(probes.KV_USAGE, -1.0),
                "running": m.get("vllm:num_requests_running", -1.0),
                "waiting": m.get("vllm:num_requests_waiting", -1.0),
            }
        idle = all(v["kv_cache_usage_perc"] == 0 and v["running"] == 0 and v["waiting"] == 0
                   for v in state.values())  # fmt: skip
        if idle or time.monotonic() > deadline:
            return {"idle": idle, "sides": state}
        time.sleep(1.0)


def run_phase(
    phase: str, device: str, model: str, run_dir: Path, prompts: list[list[int]],
    reference: list[dict[str, Any]] | None, say: Any, gpus: tuple[str, str] = ("0", "1"),
    compiled_async: bool = False,
) -> dict[str, Any]:  # fmt: skip
    cfg = pd_config(phase, device, model, run_dir, gpus, compiled_async)
    out: dict[str, Any] = {"phase": phase, "ok": False}
    t0 = time.monotonic()
    with PDDeployment(cfg, progress=lambda m: say(f"{phase}: {m}")) as dep:
        out["startup_s"] = round(dep.startup_s, 1)
        say(f"{phase}: ready in {dep.startup_s:.0f}s")
        if phase == "single":
            refs = [reference_request(dep.url, p, MAX_TOKENS) for p in prompts]
            out["outputs"] = [r["token_ids"] for r in refs]
            out["reference"] = refs
            out["ok"] = all(len(r["token_ids"]) == MAX_TOKENS for r in refs)
            out["wall_s"] = round(time.monotonic() - t0, 1)
            return out
        assert dep.prefill is not None and dep.decode is not None and reference is not None
        sides = {"P": dep.prefill.url, "D": dep.decode.url}
        before = {s: probes.engine_metrics(u) for s, u in sides.items()}
        outputs = [complete(dep.url, p, max_tokens=MAX_TOKENS).token_ids for p in prompts]
        after = {s: probes.engine_metrics(u) for s, u in sides.items()}
        with ThreadPoolExecutor(len(prompts)) as ex:
            concurrent = list(
                ex.map(lambda p: complete(dep.url, p, max_tokens=MAX_TOKENS).token_ids, prompts)
            )
        idle = wait_idle(sides)
        final = {s: probes.engine_metrics(u) for s, u in sides.items()}
    ref_ids = [r["token_ids"] for r in reference]
    equal = [o == r for o, r in zip(outputs, ref_ids)]
    diffs = []
    for i, (o, r) in enumerate(zip(outputs, ref_ids)):
        k = first_diff(o, r)
        if k is None:
            continue
        top2 = reference[i]["top2"][k] if k < len(reference[i]["top2"]) else []
        margin = top2[0] - top2[1] if len(top2) == 2 else None
        diffs.append({
            "prompt_len": len(prompts[i]), "at": k, "got": o[k: k + 4], "expected": r[k: k + 4],
            "reference_top2_logprob_margin": margin,
        })  # fmt: skip
    p_tp = cfg.gpu.p_tp_size if cfg.gpu else 1
    block = BLOCK_TOKENS[device]
    full_blocks_bytes = sum(len(p) // block * block for p in prompts) * KV_BYTES_PER_TOKEN
    writes = _delta(before["P"], after["P"], "vllm:ext_push_writes_total")
    chunk_writes = _delta(before["P"], after["P"], "vllm:ext_push_chunk_writes_total")
    sent = _delta(before["P"], after["P"], "vllm:ext_push_bytes_total")
    local = _delta(before["D"], after["D"], "vllm:prompt_tokens_by_source_total[local_compute]")
    external = _delta(
        before["D"], after["D"], "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
    )
    failures = {
        f"{s}:{k}": v
        for s in sides
        for k, v in final[s].items()
        if k.startswith("vllm:ext_push_failures_total") and v
    }
    n_with_blocks = sum(len(p) >= block for p in prompts)
    checks = {
        "outputs_equal": all(equal),
        # one WRITE per request with at least one whole block (per P rank with TP)
        "kv_written": writes >= n_with_blocks,
        # every P rank's share of the prompts' whole blocks crossed (TP: summed over ranks)
        "kv_bytes": sent >= 0.9 * full_blocks_bytes / p_tp,
        # D computed at most the last token of each prompt; the rest came from P
        "d_used_transferred_kv": local <= len(prompts)
        and external >= sum(len(p) for p in prompts) - 2 * len(prompts),
        "no_push_failures": not failures,
        "no_blocks_left": bool(idle["idle"]),
    }
    if phase == "push-progressive":
        # the prompts longer than one chunk had blocks written before their prompt ended
        checks["chunks_written_early"] = chunk_writes >= 1
    out.update(
        ok=all(checks.values()),
        checks=checks,
        equal=equal,
        first_diffs=diffs,
        concurrent_equal=[c == r for c, r in zip(concurrent, ref_ids)],
        writes=writes,
        chunk_writes=chunk_writes,
        bytes=sent,
        expected_bytes_min=full_blocks_bytes / p_tp,
        d_prompt_tokens={"local_compute": local, "external_kv_transfer": external},
        push_failures=failures,
        after_idle=idle,
        p_tp_size=p_tp,
        wall_s=round(time.monotonic() - t0, 1),
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--out", type=Path, required=True, help="the verdict JSON")
    ap.add_argument("--run-dir", type=Path, help="engine logs (default: next to --out)")
    ap.add_argument("--phases", nargs="+", help="default: single push (+ push-tp2 on cuda)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="the whole check")
    ap.add_argument(
        "--gpus", default="0,1", help="CUDA_VISIBLE_DEVICES of P and of D (0,0: one GPU shared)"
    )
    ap.add_argument(
        "--compiled-async", action="store_true",
        help="GPU engines compiled (CUDA graphs) with --async-scheduling, not eager",
    )  # fmt: skip
    args = ap.parse_args(argv)
    p_gpu, _, d_gpu = args.gpus.partition(",")
    if not p_gpu or not d_gpu:
        ap.error("--gpus: P's and D's GPU, e.g. 0,1")
    gpus = (p_gpu, d_gpu)
    from devkit.testing.tiny_model import build_tiny_model

    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[correctness {time.monotonic() - t0:5.0f}s] {msg}", flush=True)

    phases = args.phases or phases_for(args.device, gpus)
    if "single" not in phases:
        phases = ["single", *phases]
    run_dir = args.run_dir or args.out.parent / "correctness-logs"
    model = str(build_tiny_model())
    prompts = make_prompts()
    verdict: dict[str, Any] = {
        "device": args.device, "model": model, "prompt_lens": [len(p) for p in prompts],
        "engines": "compiled, async scheduling" if args.compiled_async else "eager",
        "max_tokens": MAX_TOKENS, "phases": {}, "verdict": "fail",
    }  # fmt: skip

    def save() -> None:
        verdict["wall_s"] = round(time.monotonic() - t0, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(verdict, indent=1))

    reference = None
    for phase in phases:
        left = args.budget_s - (time.monotonic() - t0)
        if left < PHASE_EST_S[args.device]:
            verdict["phases"][phase] = {"skipped": f"budget: {left:.0f}s left"}
            say(f"{phase}: skipped ({left:.0f}s left of the budget)")
            continue
        if phase != "single" and reference is None:
            verdict["phases"][phase] = {"skipped": "no reference outputs"}
            continue
        say(f"{phase}: starting")
        try:
            res = run_phase(
                phase, args.device, model, run_dir, prompts, reference, say, gpus,
                args.compiled_async,
            )  # fmt: skip
        except Exception as e:
            res = {"phase": phase, "ok": False, "error": f"{type(e).__name__}: {e}"[:3000],
                   "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
        if phase == "single" and res.get("ok"):
            reference = res["reference"]
            res = {k: v for k, v in res.items() if k != "reference"}
        verdict["phases"][phase] = res
        summary = "ok" if res.get("ok") else f"FAILED {res.get('error') or res.get('checks')}"
        say(f"{phase}: {summary}")
        if res.get("first_diffs"):
            say(f"{phase}: first differences {res['first_diffs']}")
        save()
    # the verdict: every phase asked for that ran passed, and single + push ran
    # (push-tp2 has its own line: "if the host allows")
    results = verdict["phases"]
    ran = {k: v for k, v in results.items() if "skipped" not in v}
    ok = all(v.get("ok") for k, v in ran.items() if k != "push-tp2")
    ok = ok and all(k in ran for k in ("single", "push") if k in phases)
    verdict["verdict"] = "pass" if ok else "fail"
    if "push-tp2" in results:
        tp2 = results["push-tp2"]
        verdict["tp2"] = "skipped" if "skipped" in tp2 else ("pass" if tp2.get("ok") else "fail")
    save()
    say(f"verdict: {verdict['verdict']}" + (f", TP2 P -> TP1 D: {verdict['tp2']}" if "tp2" in
        verdict else "") + f" ({args.out})")  # fmt: skip
    return 0 if verdict["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
