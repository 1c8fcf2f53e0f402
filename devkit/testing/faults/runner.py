# SPDX-License-Identifier: Apache-2.0
"""Run the fault table (and a soak) against one or more stacks; write JSON and markdown.

``python -m devkit.testing.faults --out DIR [--stack ours --stack vllm-push-0.32]
[--python 0.32.0=PATH] [--net netns|loopback|auto] [--faults a,b] [--soak N]``

(``tools/faults.py`` builds the pinned environments first and passes their pythons.)
Per stack: one :class:`~devkit.testing.faults.pair.FaultPair` is started, warmed
up, and every fault runs on it in turn (a fault that kills an engine restarts it;
an engine left holding blocks is restarted before the next fault). Results are
written after every fault (``results.json``), the table at the end
(``faults.md``: one column group per stack, side by side).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

from devkit.testing.faults import netns
from devkit.testing.faults.catalog import FAULTS, run_fault
from devkit.testing.faults.context import Ctx
from devkit.testing.faults.pair import STACKS, FaultPair, PairConfig
from devkit.testing.faults.soak import soak


def run_stack(
    stack_name: str,
    model: str,
    python: str,
    out: Path,
    net: str,
    faults: list[str],
    soak_n: int = 0,
    soak_concurrency: int = 3,
    say: Any = print,
    results: dict[str, Any] | None = None,
    save: Any = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    stack = STACKS[stack_name]
    cfg = PairConfig(stack=stack, model=model, run_dir=out / stack_name, python=python,
                     net=net)  # type: ignore[arg-type]  # fmt: skip
    cfg.extra_config.update(config or {})
    rec: dict[str, Any] = {"stack": stack_name, "about": stack.about, "net": net,
                           "config": cfg.extra_config, "faults": [], "soak": None}  # fmt: skip
    if results is not None:
        results.setdefault("stacks", []).append(rec)
    t0 = time.monotonic()

    def log(msg: str) -> None:
        say(f"[{stack_name} {time.monotonic() - t0:6.0f}s] {msg}")

    with FaultPair(cfg, progress=log) as pair:
        rec["startup_s"] = round(time.monotonic() - t0, 1)
        ctx = Ctx(pair, log)
        ctx.warm_up()
        rec["bound_s"] = ctx.bound_s
        for name in faults:
            res = run_fault(ctx, name)
            entry = res.summary(ctx.bound_s)
            entry["about"] = res.about
            entry["details"] = res.details
            entry["affected_outcomes"] = [o.brief() for o in res.affected]
            entry["tables_grown"] = res.tables_grown
            entry["wrong"] = res.wrong_outputs()
            rec["faults"].append(entry)
            if save:
                save()
        if soak_n:
            log(f"soak: {soak_n} requests")
            rec["soak"] = soak(ctx, soak_n, concurrency=soak_concurrency)
            log(f"soak: clean={rec['soak']['clean']} leaked={rec['soak']['leaked_blocks']}")
    rec["wall_s"] = round(time.monotonic() - t0, 1)
    if save:
        save()
    return rec


def _fmt_s(v: Any) -> str:
    return "-" if v is None else f"{v:.1f}"


def outcome_cell(f: dict[str, Any]) -> str:
    """One stack's cell of the table: the verdict (an inconclusive one with its reason),
    how the requests ended, time to end, leaks."""
    if f["verdict"] == "n/a":
        return f"n/a ({f['note']})"
    kinds = [k for k in f["affected_kinds"] if k]
    status = "/".join(str(s) for s in f["statuses"]) or "-"
    ended = ", ".join(kinds)
    t = f"{_fmt_s(f['time_to_end_p50'])}s" if f["time_to_end_max"] is not None else "-"
    if f["time_to_end_max"] is not None and f["affected"] > 1:
        t += f" (max {_fmt_s(f['time_to_end_max'])}s)"
    leaks = ", ".join(f"{r[0].upper()} {n}" for r, n in f["leaked_blocks"].items() if n) or "0"
    back = f.get("recovered_s")
    recovered = f"; serves again {_fmt_s(back)}s after the fault" if back is not None else ""
    verdict = f["verdict"]
    if verdict == "inconclusive":
        verdict = f"inconclusive ({f['inconclusive']})"
    served = ""
    if f.get("expect") == "error" and f.get("served_right"):
        served = " (served with the single engine's output)"
    return (f"{verdict}: {ended} {status}{served} in {t}; leaked blocks {leaks}"
            f"{recovered}")  # fmt: skip


def markdown(results: dict[str, Any]) -> str:
    stacks = results.get("stacks", [])
    names = [s["stack"] for s in stacks]
    by_stack = {s["stack"]: {f["fault"]: f for f in s["faults"]} for s in stacks}
    faults = list(dict.fromkeys(f for s in stacks for f in (x["fault"] for x in s["faults"])))
    lines = [
        f"Fault table ({results.get('when', '')}; net: "
        f"{', '.join(sorted({s['net'] for s in stacks}))}).",
        "",
        "| fault | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for name in faults:
        cells = []
        for s in names:
            f = by_stack[s].get(name)
            cells.append(outcome_cell(f) if f else "not run")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for s in stacks:
        lines.append(f"### {s['stack']}: problems found, inconclusive runs")
        lines.append("")
        for f in s["faults"]:
            if f["problems"]:
                lines.append(f"* **{f['fault']}**: " + "; ".join(f["problems"]))
            elif f.get("verdict") == "inconclusive":
                lines.append(f"* **{f['fault']}**: inconclusive: {f['inconclusive']}")
        if s.get("soak"):
            sk = s["soak"]
            lines += ["", f"Soak: {sk['requests']} requests (concurrency {sk['concurrency']}) in "
                      f"{sk['wall_s']}s; leaked blocks {sk['leaked_blocks']}; tables grown "
                      f"{ {r: list(g) for r, g in sk['tables_grown'].items() if g} }; serves "
                      f"after: {sk['serves_after']}; clean: {sk['clean']}", "",
                      "| kind | requests | ok | errors | aborted | wrong | time to error p50 / "
                      "max (s) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
            for r in sk["rows"]:
                lines.append(
                    f"| {r['kind']} | {r['requests']} | {r['ok']} | {r['errors']} | "
                    f"{r['aborted']} | {r['wrong']} | {_fmt_s(r['time_to_error_p50'])} / "
                    f"{_fmt_s(r['time_to_error_max'])} |"
                )
        lines.append("")
    return "\n".join(lines)


def _config_item(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devkit.testing.faults")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--stack", action="append", choices=sorted(STACKS))
    p.add_argument("--python", action="append", default=[], metavar="PIN=PATH",
                   help="the python of a pinned env (default: this one)")  # fmt: skip
    p.add_argument("--net", choices=("auto", "netns", "loopback"), default="auto")
    p.add_argument("--faults", default="", help=f"comma-separated subset of {list(FAULTS)}")
    p.add_argument("--soak", type=int, default=0, help="soak requests after the faults")
    p.add_argument("--soak-concurrency", type=int, default=3)
    p.add_argument("--model", default="", help="model dir (default: the tiny test model)")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   type=_config_item, help="a kv_connector_extra_config entry for both "
                   "engines, over the fault defaults (VALUE is JSON, else a string), e.g. "
                   "push_quarantine_s=-1")  # fmt: skip
    args = p.parse_args(argv)
    stacks = args.stack or ["ours"]
    pythons = dict(item.split("=", 1) for item in args.python)
    faults = [f for f in args.faults.split(",") if f] or list(FAULTS)
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        p.error(f"unknown faults {unknown}; known: {list(FAULTS)}")
    net = args.net
    if net == "auto":
        reason = netns.unavailable_reason()
        net = "loopback" if reason else "netns"
        if reason:
            print(f"[faults] no network namespaces ({reason}): loopback; link faults skipped")
    if not args.model:
        from devkit.testing.tiny_model import build_tiny_model

        args.model = str(build_tiny_model())
    args.out.mkdir(parents=True, exist_ok=True)
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    results: dict[str, Any] = {"when": when, "net": net, "stacks": []}

    def save() -> None:
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        (args.out / "faults.md").write_text(markdown(results))

    for name in stacks:
        python = pythons.get(STACKS[name].pin, sys.executable)
        try:
            run_stack(name, args.model, python, args.out, net, faults, args.soak,
                      args.soak_concurrency, say=lambda m: print(m, flush=True),
                      results=results, save=save, config=dict(args.config))  # fmt: skip
        except Exception as e:
            print(f"[faults] {name}: {type(e).__name__}: {e}", flush=True)
            results.setdefault("errors", []).append(f"{name}: {type(e).__name__}: {e}")
            save()
    save()
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
