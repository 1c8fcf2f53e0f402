# SPDX-License-Identifier: Apache-2.0
"""The main job: a local 1P1D push demo on CPU with a tiny locally built model.

Starts P (kv_producer) and D (kv_consumer) vLLM engines with our connector and
the proxy, sends a few requests through the proxy, prints each output with its
TTFT, and shuts everything down (also on Ctrl-C and on failure). ``--mode pull``
runs vLLM's own pull connector instead, ``--mode single`` one plain engine.

Run it with ``python3 tools/demo.py`` (sets up the environment first).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from vllm_ext.launch.client import complete
from vllm_ext.launch.pd import PDConfig, PDDeployment
from vllm_ext.testing.tiny_model import build_tiny_model

PROMPTS = [
    "The prefill instance computes the cache",
    "Push mode writes every block into the decode instance as soon as prefill ends, "
    "so the decode instance can start at once.",
    " ".join(f"token {i} of a longer prompt that spans several blocks" for i in range(60)),
]


def _say(msg: str) -> None:
    print(f"[demo +{time.monotonic() - _T0:5.1f}s] {msg}", flush=True)


_T0 = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mode", choices=["push", "pull", "single"], default="push")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--run-dir", type=Path, help="logs and caches (default: a temp folder)")
    ap.add_argument("--connector", help="override the connector name (e.g. ExtNixlPushConnector)")
    args = ap.parse_args(argv)

    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix=f"vllm-ext-demo-{args.mode}-"))
    _say("building the tiny model (cached after the first run)")
    model = build_tiny_model()
    _say(f"model: {model}")
    _say(f"starting {args.mode} deployment; logs in {run_dir}")
    cfg = PDConfig(mode=args.mode, model=str(model), run_dir=run_dir, connector=args.connector)
    try:
        with PDDeployment(cfg, progress=_say) as dep:
            _say(f"ready after {dep.startup_s:.0f}s; sending {len(PROMPTS)} requests to {dep.url}")
            for i, prompt in enumerate(PROMPTS):
                out = complete(dep.url, prompt, max_tokens=args.max_tokens)
                short = prompt if len(prompt) < 60 else prompt[:57] + "..."
                print(f"\n  request {i}: {short!r}")
                print(f"    output: {out.text!r}")
                print(f"    TTFT {out.ttft_s * 1e3:.0f} ms, total {out.total_s * 1e3:.0f} ms")
            _say("shutting down")
    except KeyboardInterrupt:
        _say("interrupted; everything was stopped")
        return 130
    except Exception as e:
        _say(f"failed: {e}")
        return 1
    _say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
