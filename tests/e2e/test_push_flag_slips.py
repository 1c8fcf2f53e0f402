# SPDX-License-Identifier: Apache-2.0
"""One flag set differently on P, D or the proxy of a push 1P1D, on real vLLM 0.32.0
CPU engines: each request is answered with one engine's output, or fails with an error
(HTTP error, or finish reason ``error`` and no token, with D's log naming what
disagrees); none is answered 200 with another output. docs/faults.md, *One-flag
slips*, lists every slip considered, these and those settled from the code.

Default run: ``test_flags_that_must_not_change_the_output``, one pair (engine flags that
differ harmlessly, then seven proxy slips in front of the same engines): 67-162 s on the
shared 2-core machine here, beside the session's 0.32.0 reference engine (132-151 s,
shared with ``test_push_032.py``). ``FULL=1`` (``slow``) adds six pairs, 75-173 s each,
about 11 min here: one model path with other weights on D (failed before S-LEG-6), another
block size on P, a rope scaling override on P (failed before S-LEG-6), ``--dtype`` on D,
another model folder on P, another tokenizer on P. The fixed slips also have a fast
default test: ``tests/integration/test_push_model_identity.py``.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import MAX_TOKENS, OTHER_PIN, deployment
from support import pin_python

from devkit.launch.client import SERVED_MODEL_NAME
from devkit.launch.pd import PDDeployment
from devkit.launch.process import ManagedProcess, free_port, wait_http_ready
from devkit.testing.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

#: a slip's requests must end (answered or failed) well within this
SLIP_TIMEOUT_S = 60


def _py() -> str:
    return str(pin_python(OTHER_PIN))


def _ask(url: str, prompt: list[int] | str, body: dict[str, Any] | None = None) -> tuple[Any, ...]:
    """(HTTP status, finish reason, token ids, error text) of one greedy completion."""
    req_body = {
        "model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True, **(body or {}),
    }  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(req_body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=SLIP_TIMEOUT_S + 30) as r:
            choice = json.loads(r.read())["choices"][0]
    except urllib.error.HTTPError as e:
        return e.code, None, [], e.read().decode(errors="replace")
    return 200, choice["finish_reason"], choice.get("token_ids") or [], ""


def _outcomes(url: str, prompts: list[list[int]], reference: list[list[int]], **kw) -> list[str]:
    """Per prompt: ``equal``, ``error`` (an HTTP error, or finish reason ``error`` and
    no token), or ``WRONG`` (200 with another output than one engine's)."""
    out = []
    for prompt, expected in zip(prompts, reference):
        status, finish, tokens, _ = _ask(url, prompt, **kw)
        if status == 200 and finish in ("length", "stop"):
            out.append("equal" if tokens == expected else "WRONG")
        else:
            assert not tokens, (status, finish, tokens)
            out.append("error")
    return out


def _log(dep: PDDeployment, name: str) -> str:
    return (dep.cfg.run_dir / f"{name}.log").read_text(errors="replace")


class _Proxy:
    """A second proxy in front of the deployment's engines, with one slip."""

    def __init__(self, dep: PDDeployment, run_dir: Path, name: str, **over: Any) -> None:
        assert dep.prefill is not None and dep.decode is not None
        args = {
            "--prefill": dep.prefill.url, "--decode": dep.decode.url, "--mode": "push",
            "--p-engine-id": dep.p_engine_id,
            "--p-side-channel-port": str(dep.prefill.spec.side_channel_port),
            "--prefill-timeout": str(SLIP_TIMEOUT_S), "--decode-timeout": str(SLIP_TIMEOUT_S),
            **over,
        }  # fmt: skip
        port = free_port()
        argv = [sys.executable, "-m", "vllm_ext.proxy", "--host", "127.0.0.1",
                "--port", str(port)]  # fmt: skip
        for k, v in args.items():
            argv += [k, v]
        self.proc = ManagedProcess(f"proxy-{name}", argv, run_dir / f"proxy-{name}.log")
        self.url = f"http://127.0.0.1:{port}"
        try:
            wait_http_ready(f"{self.url}/health", 60, self.proc)
        except BaseException:
            self.proc.stop()
            raise

    def __enter__(self) -> _Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.stop()


def test_flags_that_must_not_change_the_output(
    tiny_model: Path, prompts, reference_032, tmp_path
) -> None:
    """P: no prefix caching, 64-token prefill chunks, chunk-progressive push, another
    ``--seed`` and ``--max-model-len``; D: another ``--seed`` and ``--max-model-len``.
    Outputs equal one engine's. Then proxy slips in front of the same engines: each
    request fails, none is answered with another output, and the right proxy still
    gets one engine's outputs."""
    for dep in deployment(
        "push", tiny_model, tmp_path / "harmless", python=_py(),
        connector="ExtNixlPushConnector",
        p_extra_args=["--no-enable-prefix-caching", "--max-num-batched-tokens", "64",
                      "--seed", "7", "--max-model-len", "1024"],
        p_extra_config={"push_progressive": True},
        d_extra_args=["--seed", "3", "--max-model-len", "2048"],
    ):  # fmt: skip
        assert _outcomes(dep.url, prompts, reference_032) == ["equal"] * len(prompts)
        # a client's own kv_transfer_params are replaced by the proxy's
        forged = {"kv_transfer_params": {"do_remote_prefill": True, "tp_size": 2,
                                         "remote_engine_id": "nobody"}}  # fmt: skip
        assert _outcomes(dep.url, prompts, reference_032, body=forged) == ["equal"] * len(prompts)
        # a prompt over P's --max-model-len (1024), within D's (2048): P's 400, passed on
        status, _, tokens, text = _ask(dep.url, [(i * 37) % 1000 + 10 for i in range(1500)])
        assert 400 <= status < 500 and not tokens and "1024" in text, (status, text)
        assert dep.decode is not None and dep.prefill is not None
        slips: dict[str, dict[str, str]] = {
            "p-tp-size": {"--p-tp-size": "2"},
            "p-pp-size": {"--p-pp-size": "2"},
            "engine-id": {"--p-engine-id": "prefill-other"},
            "side-channel": {"--p-side-channel-port": str(dep.decode.spec.side_channel_port)},
            "swapped": {"--prefill": dep.decode.url, "--decode": dep.prefill.url},
            "pull-mode": {"--mode": "pull"},
        }
        seen = {}
        for name, over in slips.items():
            with _Proxy(dep, tmp_path, name, **over) as proxy:
                seen[name] = _outcomes(proxy.url, prompts, reference_032)
        assert all("WRONG" not in v for v in seen.values()), seen
        assert _outcomes(dep.url, prompts, reference_032) == ["equal"] * len(prompts)
        d_log = _log(dep, "decode")
        assert "announces tensor parallel size 1" in d_log
        assert "pipeline stage(s)" in d_log
        assert "are the proxy's --prefill and --decode URLs swapped?" in _log(dep, "prefill")
        print(seen)


@pytest.mark.slow
def test_same_model_path_other_weights(tiny_model: Path, prompts, reference_032, tmp_path) -> None:
    """P and D name the same model folder, which holds other weights on D (two hosts,
    one path): vLLM's compatibility hash (model name, dtype, shapes) cannot tell."""
    other = build_tiny_model(TinyModelSpec(seed=1))
    link = tmp_path / "model"
    link.symlink_to(tiny_model)

    def swap() -> None:
        link.unlink()
        link.symlink_to(other)

    for dep in deployment(
        "push", link, tmp_path / "weights", python=_py(), connector="ExtNixlPushConnector",
        before_decode=swap,
    ):  # fmt: skip
        # (a 1-token prompt has no KV to move: D computes it alone, with its weights)
        got = _outcomes(dep.url, prompts[1:], reference_032[1:])
        assert got == ["error"] * (len(prompts) - 1), got
        d_log = _log(dep, "decode")
        assert "computes other KV than this engine (weight files: " in d_log


YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 2048}}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, kw, expected, d_log_says",
    [
        ("block-size", {"p_extra_args": ["--block-size", "64"]}, "error",
         "has 64-token physical blocks, this engine 128"),
        ("rope-scaling", {"p_extra_args": ["--hf-overrides", json.dumps(YARN)]}, "error",
         "computes other KV than this engine (model configuration (config.json with "
         "--hf-overrides applied): "),
        ("dtype", {"d_extra_args": ["--dtype", "bfloat16"]}, "error",
         "computes other KV than this engine (--dtype: torch.float32 there, torch.bfloat16 "
         "here"),
        ("model-dir", {"p_model": "seed1"}, "error",
         "computes other KV than this engine (weight files: "),
    ],
    ids=["block-size", "rope-scaling", "dtype", "model-dir"],
)  # fmt: skip
def test_one_engine_flag(
    name: str, kw: dict[str, Any], expected: str, d_log_says: str | None,
    tiny_model: Path, prompts, reference_032, tmp_path,
) -> None:  # fmt: skip
    """One engine flag set on P or D only: equal outputs, or every request fails and D's
    log names the flag."""
    if kw.get("p_model") == "seed1":
        kw = {**kw, "p_model": str(build_tiny_model(TinyModelSpec(seed=1)))}
    for dep in deployment(
        "push", tiny_model, tmp_path / name, python=_py(), connector="ExtNixlPushConnector",
        **kw,
    ):  # fmt: skip
        multi = slice(1, None)  # D alone answers a 1-token prompt: with its own flags
        got = _outcomes(dep.url, prompts[multi], reference_032[multi])
        assert got == [expected] * (len(prompts) - 1), got
        if d_log_says is not None:
            d_log = _log(dep, "decode")
            assert d_log_says in d_log


@pytest.mark.slow
def test_another_tokenizer_on_p(tiny_model: Path, tmp_path) -> None:
    """P tokenizes the client's text with another tokenizer (``--tokenizer``): P's
    prompt is not D's, and the prompt key (S-WRT-7) refuses the registration. D runs
    without prefix caching, so D's own answer to the same text afterwards is one
    engine's output, not one made from the pushed KV."""
    other = build_tiny_model(TinyModelSpec(seed=1))
    texts = [" ".join(f"word{i * 7 % 97}" for i in range(n)) for n in (40, 120)]
    for dep in deployment(
        "push", tiny_model, tmp_path / "tokenizer", python=_py(),
        connector="ExtNixlPushConnector", p_extra_args=["--tokenizer", str(other)],
        d_extra_args=["--no-enable-prefix-caching"],
    ):  # fmt: skip
        assert dep.decode is not None
        got = []
        for text in texts:
            status, finish, tokens, _ = _ask(dep.url, text)
            alone = _ask(dep.decode.url, text)
            if status == 200 and finish in ("length", "stop"):
                got.append("equal" if tokens == alone[2] else "WRONG")
            else:
                got.append("error")
        assert got == ["error"] * len(texts), got
        assert "met a P request with another prompt" in _log(dep, "prefill")
