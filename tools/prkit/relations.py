# SPDX-License-Identifier: Apache-2.0
"""Every patch of every series against upstream vLLM: merged in, open PR, or ours alone.

A patch's relation comes from its own message and ``patches/upstream-state.toml``:

* **merged in vLLM X**: its ``Upstream-Since:`` trailer names a release;
* **open PR #N**: a PR its *Related upstream PR* section names (or the state file adds
  for it) is open upstream: the patch builds on it, or duplicates it;
* **ours alone**: no upstream PR is known.

Patches a newer series leaves out (``dropped`` in the state file) are listed with the
PRs they are left to and why. The states are as the state file records them (``seen``):
no network is reachable here, so they are not live. Where ``seen`` is older than the
newest release a series targets (its date: the build time of its cached sdist), the
table says so and ``relations`` warns: the states predate that release and are to be
refreshed from the stored copy of vLLM's GitHub threads.

A *Related upstream PR* section that starts with "None found" relates the patch to no
PR: the numbers it goes on to cite are context (e.g. a PR that does not cover it).
"""

from __future__ import annotations

import datetime
import re
import tarfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .common import REPO, UsageError, patchtool

STATE_FILE = REPO / "patches" / "upstream-state.toml"
BEGIN = "<!-- relations:begin (tools/upstream_pr.py relations --update) -->"
END = "<!-- relations:end -->"
_PR_RE = re.compile(r"(?<![\w/])#(\d{4,6})\b")


@dataclass
class Row:
    series: str
    patch: str
    subject: str
    since: str
    prs: list[int] = field(default_factory=list)
    relation: str = ""
    why: str = ""


def load_state(path: Path = STATE_FILE) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"{path}: {e}") from e


def _related_section(text: str) -> str:
    head = text.partition("\n---\n")[0]
    m = re.search(r"^Related upstream PR:\s*$(.*?)(?=^[A-Z][\w -]*:\s*$|^Upstream-Since:|\Z)",
                  head, re.M | re.S)  # fmt: skip
    section = m.group(1) if m else ""
    # "None found": the PRs it goes on to name are context, not relations.
    return "" if section.lstrip().lower().startswith("none found") else section


def release_date(version: str, cache: Path | None = None) -> datetime.date | None:
    """When vLLM ``version`` was built, from its cached sdist (``PKG-INFO``'s time);
    None where the sdist is not cached (nothing is downloaded here)."""
    if cache is None:
        import vllm_source  # tools/, stdlib only

        cache = vllm_source.cache_root()
    sdist = cache / "sdists" / f"vllm-{version}.tar.gz"
    try:
        with tarfile.open(sdist) as tf:
            info = tf.getmember(f"vllm-{version}/PKG-INFO")
    except (OSError, KeyError, tarfile.TarError):
        return None
    return datetime.datetime.fromtimestamp(info.mtime, datetime.UTC).date()


def staleness(state: dict, versions: list[str], cache: Path | None = None) -> str | None:
    """Why the state's PR states may be out of date for ``versions``, or None."""
    try:
        seen = datetime.date.fromisoformat(str(state.get("seen", "")))
    except ValueError:
        return "the state file has no valid `seen` date"
    for version in sorted(versions, key=patchtool.version_key, reverse=True):
        date = release_date(version, cache)
        if date is None:
            continue
        if date > seen:
            return (
                f"the PR states were seen on {seen}, before vLLM {version} (its sdist was "
                f"built on {date}): refresh `patches/upstream-state.toml` from the stored "
                "copy of vLLM's GitHub threads and set `seen`"
            )
        return None
    return None


def _relation(since: str, prs: list[int], state: dict) -> str:
    if since and since != "none":
        return f"merged in vLLM {since}"
    known = state.get("prs", {})
    prs = [n for n in prs if known.get(str(n), {}).get("kind", "pr") == "pr"]  # not issues
    open_prs = [n for n in prs if known.get(str(n), {}).get("state") == "open"]
    if open_prs:
        return "open PR " + ", ".join(f"#{n}" for n in open_prs)
    merged = [n for n in prs if known.get(str(n), {}).get("state") == "merged"]
    if merged:
        return "merged PR " + ", ".join(f"#{n}" for n in merged)
    return "ours alone"


def collect(patches_root: Path = REPO / "patches", state: dict | None = None) -> list[Row]:
    state = load_state() if state is None else state
    extra = state.get("patches", {})
    rows: list[Row] = []
    series_dirs = sorted(
        (d for d in patches_root.glob("vllm-*") if d.is_dir()),
        key=lambda d: patchtool.version_key(d.name.removeprefix("vllm-")),
    )
    for d in series_dirs:
        for p in patchtool.load_series(d):
            text = p.path.read_text(encoding="utf-8", errors="replace")
            stem = p.path.stem
            # Each PR once, in the order the message first names it.
            prs = list(dict.fromkeys(int(n) for n in _PR_RE.findall(_related_section(text))))
            prs += [n for n in extra.get(f"{d.name}/{stem}", {}).get("related", []) if n not in prs]
            since = p.upstream_since or "none"
            rows.append(Row(d.name, stem, p.subject, since, prs, _relation(since, prs, state)))
    for entry in state.get("dropped", []):
        prs = list(entry.get("related", []))
        rel = _relation("none", prs, state)
        rows.append(
            Row(
                entry["series"],
                entry["patch"],
                f"(left out; {entry.get('from', '?')}'s patch)",
                "none",
                prs,
                entry.get("relation")
                or ("left to " + rel if rel != "ours alone" else "left out, ours alone"),
                " ".join(entry.get("why", "").split()),
            )
        )
    rows.sort(key=lambda r: (patchtool.version_key(r.series.removeprefix("vllm-")), r.patch))
    return rows


def _pr_label(number: int, known: dict) -> str:
    info = known.get(str(number), {})
    state = " ".join(filter(None, (info.get("state", "?"), info.get("kind"))))
    return f"#{number} ({state})"


def render(rows: list[Row], state: dict | None = None, stale: str | None = None) -> str:
    state = load_state() if state is None else state
    known = state.get("prs", {})
    out = [
        f"Upstream states as last seen ({state.get('seen', '?')}, "
        "`patches/upstream-state.toml`); generated by `tools/upstream_pr.py relations`.",
        "",
        *([f"**Stale:** {stale}.", ""] if stale else []),
        "| series | patch | subject | Upstream-Since | related upstream PRs | relation |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        prs = ", ".join(_pr_label(n, known) for n in r.prs)
        subject = r.subject.replace("|", "/") + (f" Why: {r.why}" if r.why else "")
        out.append(
            f"| {r.series} | `{r.patch}` | {subject} | {r.since} | {prs or '-'} | {r.relation} |"
        )
    return "\n".join(out) + "\n"


def update_doc(doc: Path, table: str) -> bool:
    """Replace the block between the markers in ``doc``; False if it was current."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise UsageError(f"{doc}: no {BEGIN!r} ... {END!r} block to update")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{table}{END}{tail}"
    if new == text:
        return False
    doc.write_text(new)
    return True
