# SPDX-License-Identifier: Apache-2.0
"""The main job: a local 1P1D push demo on CPU with a tiny locally built model.

Starts P (kv_producer) and D (kv_consumer) vLLM engines with our connector and the
proxy, sends a few requests through the proxy and stops them; then runs the same
requests on one plain engine (the reference). For each request it prints the pair's
tokens next to the single engine's, whether they are equal, the TTFT, and how much KV
crossed from P to D (P's ``vllm:ext_push_bytes_total``, D's prompt tokens by source,
both from the engines' ``/metrics``). Everything is shut down on Ctrl-C and on failure.

The tiny model has random weights: its text is gibberish by design. What the demo
shows is that the pair's greedy tokens equal one engine's, so the KV that crossed is
the KV one engine would have computed.

``--mode pull`` runs vLLM's own pull connector instead; ``--mode single`` one plain
engine only (no reference run). Run it with ``python3 tools/demo.py`` (sets up the
environment first).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from devkit.bench import probes
from devkit.launch.client import Completion, complete
from devkit.launch.pd import PDConfig, PDDeployment

PROMPTS = [
    "The prefill instance computes the cache",
    " ".join(f"push mode writes block {i} into the decode instance" for i in range(25)),
    " ".join(f"token {i} of a longer prompt that spans several blocks" for i in range(60)),
]
#: Metrics read around each request (P's, and D's with a ``d:`` prefix).
PUSH_BYTES = "vllm:ext_push_bytes_total"
PUSH_WRITES = "vllm:ext_push_writes_total"
HANDOFFS = "vllm:ext_push_handoff_seconds_count"
D_EXTERNAL = "d:vllm:prompt_tokens_by_source_total[external_kv_transfer]"
D_LOCAL = "d:vllm:prompt_tokens_by_source_total[local_compute]"
#: How long to wait for P's counters of a request to show up in /metrics.
SETTLE_S = 3.0
GIBBERISH_NOTE = "The tiny model has random weights, so its text is gibberish by design."
PAIR_NOTE = (
    "What matters is that the P/D pair's tokens equal one engine's: then the KV that "
    "crossed from P to D is exactly the KV one engine would have computed."
)

_T0 = time.monotonic()


def _say(msg: str) -> None:
    print(f"[demo +{time.monotonic() - _T0:5.1f}s] {msg}", flush=True)


@dataclasses.dataclass
class RequestResult:
    """One request through the pair, and the same request on one engine."""

    prompt: str
    pair: Completion
    #: bytes P pushed and WRITEs it posted for this request (None: not a push run)
    pushed_bytes: float | None = None
    writes: float | None = None
    #: D's prompt tokens of this request: from P's KV / computed by D itself
    d_external_tokens: float | None = None
    d_local_tokens: float | None = None
    reference: Completion | None = None

    @property
    def equal(self) -> bool | None:
        if self.reference is None:
            return None
        return self.pair.token_ids == self.reference.token_ids


def _short(prompt: str, width: int = 60) -> str:
    return prompt if len(prompt) < width else prompt[: width - 3] + "..."


def _ids(ids: list[int], width: int = 16) -> str:
    shown = " ".join(map(str, ids[:width]))
    return shown + (f" ... ({len(ids)} tokens)" if len(ids) > width else "")


def format_report(results: list[RequestResult], mode: str) -> str:
    """What the demo prints after its runs (pure: unit-tested on fake results)."""
    pair = any(r.reference is not None for r in results)
    lines = ["", GIBBERISH_NOTE + (" " + PAIR_NOTE if pair else ""), ""]
    for i, r in enumerate(results):
        lines.append(f"request {i}: {_short(r.prompt)!r}")
        label = "one engine" if mode == "single" else f"{mode} P/D"
        lines.append(f"  {label:<11} tokens: {_ids(r.pair.token_ids)}")
        if r.reference is not None:
            lines.append(f"  {'one engine':<11} tokens: {_ids(r.reference.token_ids)}")
            lines.append("  equal: " + ("yes" if r.equal else "NO (the KV that crossed differs)"))
        lines.append(f"  text (gibberish by design): {r.pair.text!r}")
        ttft = f"  TTFT {r.pair.ttft_s * 1e3:.0f} ms, total {r.pair.total_s * 1e3:.0f} ms"
        if r.reference is not None:
            ttft += f" (one engine: TTFT {r.reference.ttft_s * 1e3:.0f} ms)"
        lines.append(ttft)
        if r.pushed_bytes is not None:
            if r.pushed_bytes > 0:
                kib = r.pushed_bytes / 1024
                kv = f"  KV pushed P -> D: {kib:.0f} KiB in {r.writes:.0f} WRITE(s)"
            else:
                kv = "  KV pushed P -> D: none (no whole KV block in this prompt; D computes it)"
            lines.append(kv)
        if r.d_external_tokens is not None and r.d_local_tokens is not None:
            lines.append(
                f"  D's prompt tokens: {r.d_external_tokens:.0f} from P's KV, "
                f"{r.d_local_tokens:.0f} computed by D"
            )
        lines.append("")
    if pair:
        n_equal = sum(bool(r.equal) for r in results)
        verdict = "PASS" if n_equal == len(results) else "FAIL"
        summary = f"{verdict}: {n_equal}/{len(results)} outputs equal one engine's"
        total = sum(r.pushed_bytes or 0 for r in results)
        if any(r.pushed_bytes is not None for r in results):
            summary += f"; {total / 1024:.0f} KiB of KV pushed in all"
        lines.append(summary)
    return "\n".join(lines)


def _counters(p_url: str | None, d_url: str | None) -> dict[str, float]:
    """P's counters and D's prompt tokens by source (``d:`` keys), from /metrics."""
    out: dict[str, float] = {}
    if p_url is not None:
        out.update(probes.engine_metrics(p_url))
    if d_url is not None:
        out.update({f"d:{k}": v for k, v in probes.engine_metrics(d_url).items()})
    return out


def run_pair(
    dep: PDDeployment, prompts: list[str], max_tokens: int, say: Callable[[str], None]
) -> list[RequestResult]:
    """Each prompt through ``dep``, with what its metrics moved."""
    p_url = dep.prefill.url if dep.prefill is not None and dep.cfg.mode == "push" else None
    d_url = dep.decode.url if dep.cfg.mode != "single" and dep.decode is not None else None
    results = []
    for i, prompt in enumerate(prompts):
        before = _counters(p_url, d_url)
        out = complete(dep.url, prompt, max_tokens=max_tokens)
        deadline = time.monotonic() + SETTLE_S
        after = _counters(p_url, d_url)
        # P reports a request's hand-off with the engine step that saw it end
        while p_url and after.get(HANDOFFS, 0) <= before.get(HANDOFFS, 0):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
            after = _counters(p_url, d_url)
        res = RequestResult(prompt, out)
        if p_url is not None:
            res.pushed_bytes = after.get(PUSH_BYTES, 0) - before.get(PUSH_BYTES, 0)
            res.writes = after.get(PUSH_WRITES, 0) - before.get(PUSH_WRITES, 0)
        if d_url is not None:
            res.d_external_tokens = after.get(D_EXTERNAL, 0) - before.get(D_EXTERNAL, 0)
            res.d_local_tokens = after.get(D_LOCAL, 0) - before.get(D_LOCAL, 0)
        say(f"request {i}: {len(out.token_ids)} tokens, TTFT {out.ttft_s * 1e3:.0f} ms")
        results.append(res)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mode", choices=["push", "pull", "single"], default="push")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--run-dir", type=Path, help="logs and caches (default: a temp folder)")
    ap.add_argument("--connector", help="override the connector name (e.g. ExtNixlPushConnector)")
    ap.add_argument(
        "--no-reference", action="store_true", help="skip the single-engine reference run"
    )
    args = ap.parse_args(argv)
    from devkit.testing.tiny_model import build_tiny_model

    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix=f"vllm-ext-demo-{args.mode}-"))
    _say("building the tiny model (random weights; cached after the first run)")
    model = build_tiny_model()
    _say(f"model: {model}")
    steps = 1 if args.mode == "single" or args.no_reference else 2
    _say(f"[1/{steps}] starting the {args.mode} deployment; logs in {run_dir}")
    cfg = PDConfig(mode=args.mode, model=str(model), run_dir=run_dir, connector=args.connector)
    try:
        with PDDeployment(cfg, progress=_say) as dep:
            _say(f"ready after {dep.startup_s:.0f}s; sending {len(PROMPTS)} requests to {dep.url}")
            results = run_pair(dep, PROMPTS, args.max_tokens, _say)
            _say(f"stopping the {args.mode} deployment")
        if steps == 2:
            _say(f"[2/{steps}] the reference: the same requests on one plain engine")
            ref_cfg = PDConfig(mode="single", model=str(model), run_dir=run_dir / "reference")
            with PDDeployment(ref_cfg, progress=_say) as ref:
                _say(f"reference engine ready after {ref.startup_s:.0f}s")
                for r in results:
                    r.reference = complete(ref.url, r.prompt, max_tokens=args.max_tokens)
                _say("stopping the reference engine")
    except KeyboardInterrupt:
        _say("interrupted; everything was stopped")
        return 130
    except Exception as e:
        _say(f"failed: {e}")
        return 1
    print(format_report(results, args.mode), flush=True)
    _say("done")
    return 0 if all(r.equal is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
