# SPDX-License-Identifier: Apache-2.0
"""The command line of a proxy in front of one P and one D (the demo's pair, the e2e
tests', the fault tools'): ``vllm-ext-proxy`` or a stand-in with its options (the
benchmark's proxy for vLLM's own push connector)."""

from __future__ import annotations

from collections.abc import Sequence


def pair_proxy_argv(
    python: str,
    port: int,
    *,
    prefill_url: str,
    decode_url: str,
    p_engine_id: str,
    p_side_channel_port: int,
    mode: str = "push",
    module: str = "vllm_ext.proxy",
    options: Sequence[str] = (),
) -> list[str]:
    """``python -m module`` on 127.0.0.1:``port`` with P's coordinates (the D legs name
    them), then ``options`` (e.g. ``--p-host``, ``--p-pp-size``, timeouts)."""
    return [
        python, "-m", module,
        "--prefill", prefill_url, "--decode", decode_url, "--mode", mode,
        "--p-engine-id", p_engine_id, "--p-side-channel-port", str(p_side_channel_port),
        "--host", "127.0.0.1", "--port", str(port),
        *options,
    ]  # fmt: skip
