# SPDX-License-Identifier: Apache-2.0
"""What the benchmark reports share: ratios and verdicts, the order of a sweep's points,
a row of the aggregate, and Markdown cells and tables (:mod:`devkit.bench.report` for
the CPU runs, :mod:`devkit.bench.report_gpu` for the GPU runs,
:mod:`devkit.bench.scale_report`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def ratio_of(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def point_order(rows: Iterable[dict[str, Any]]) -> list[tuple[int, str]]:
    return sorted({(r["input_len"], r["load"]) for r in rows}, key=load_sort)


def load_sort(k: tuple[int, str]) -> tuple[int, int, float]:
    n, load = k
    kind, _, v = load.partition("=")
    return (n, 0 if kind == "c" else 1, float(v.rstrip("/s")))


def row_at(
    rows: list[dict[str, Any]], mode: str, input_len: int, load: str
) -> dict[str, Any] | None:
    for r in rows:
        if r["mode"] == mode and r["input_len"] == input_len and r["load"] == load:
            return r
    return None


def verdict_of(ratio: float | None, limit: float) -> str:
    if ratio is None:
        return "n/a"
    return "pass" if ratio <= limit else "FAIL"


def worst_of(ratios: list[float]) -> float | None:
    return max(ratios) if ratios else None


def fmt_ms(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x * 1e3:,.{digits}f}"


def md_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)
