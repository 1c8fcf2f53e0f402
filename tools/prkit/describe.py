# SPDX-License-Identifier: Apache-2.0
"""The PR description, in vLLM's template, with the checks' results and benchmark numbers.

The template is the tree's ``.github/PULL_REQUEST_TEMPLATE.md``, else vLLM's current
one (``template.py``), without its HTML comments. Its ``## Purpose`` comes from the
patches' messages (*Why* / *How*), ``## Test Plan`` lists the commands the kit ran,
``## Test Result`` says what ran and what did not, the results and the benchmark
numbers; the "Essential Elements" checklist is kept, with the items the description
fills ticked. A patch to vLLM's NIXL connector gets a *Request flow* section (its
message's numbered *Request flow* list and the connector files it changes) before the
test sections. A *Duplicate-work check* (each patch's *Related upstream PR*) and an *AI
assistance* statement with an unticked box for the submitter follow (``template.py``).
The title goes to a file of its own.

Benchmark numbers come from a results JSON (``tools/bench.py``'s ``results.json``:
``aggregates`` rows with ``mode``, ``point``, ``input_len``, ``load``, ``ttft_p50``,
...) through a small mapping (JSON)::

    {"patches": ["0001"],                      # optional: descriptions that get them
     "numbers": [{"label": "TTFT p50, 1024 tokens, c=1, push",
                  "select": "aggregates[mode=push-0.23,point=in1024-c=1].ttft_p50",
                  "scale": 1000, "unit": "ms", "digits": 0}],
     "table": {"caption": "TTFT p50 (ms)", "rows": "point", "cols": "mode",
               "value": "ttft_p50", "scale": 1000, "digits": 0,
               "select_rows": ["in1024-c=1"], "select_cols": {"pull-0.23": "pull"}}}

A selector is a dotted path; ``name[key=value,...]`` picks the one element of a list
whose keys match. Without a mapping, a results JSON with ``aggregates`` gives the
table of TTFT p50 (ms) per point and mode. A selector that matches nothing is an error
naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .branch import PRBranch
from .checks import CheckResult
from .common import KitError, UsageError, patchtool
from .template import ai_assistance, duplicate_work, strip_instructions, tail_index, template

_SECTION_RE = re.compile(r"^(Why|How|Request flow|Related upstream PR|When to drop it):\s*$", re.M)
#: vLLM's NIXL connector: a patch touching it gets a *Request flow* section.
NIXL_CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/"
#: An absolute local path (an env, a cache, a worktree); not a URL's path.
_LOCAL_PATH = re.compile(
    r"(?<![\w.:/~-])(?:~|/(?:root|home|tmp|work|var|opt|usr|mnt))(?:/[\w.+@-]+)+/?"
)


def local_paths(text: str) -> list[str]:
    """The local paths in ``text`` (a PR description must hold none)."""
    return _LOCAL_PATH.findall(text)


def message_sections(patch: patchtool.Patch) -> dict[str, str]:
    """The *Why* / *How* / ... sections of a patch's message (text after the subject)."""
    head = patch.path.read_text(encoding="utf-8", errors="replace").partition("\n---\n")[0]
    body = head.split("\n\n", 1)[1] if "\n\n" in head else ""
    body = "\n".join(
        ln for ln in body.splitlines() if not re.match(r"^(Upstream-Since|Signed-off-by):", ln)
    )
    parts = _SECTION_RE.split(body)
    out = {"intro": parts[0].strip()}
    for name, text in zip(parts[1::2], parts[2::2]):
        out[name] = text.strip()
    return out


# -- benchmark numbers ------------------------------------------------------------------

_STEP_RE = re.compile(r"^(?P<name>[^\[\]]+)(?:\[(?P<filters>[^\]]*)\])?$")


def select(data: Any, selector: str) -> Any:
    """Follow ``selector`` (``a.b[k=v,k2=v2].c``) in ``data``; UsageError if it fails."""
    cur = data
    for step in re.split(r"\.(?![^\[]*\])", selector):
        m = _STEP_RE.match(step)
        if m is None:
            raise UsageError(f"bench mapping: bad selector {selector!r} (at {step!r})")
        name, filters = m["name"], m["filters"]
        if not isinstance(cur, dict) or name not in cur:
            raise UsageError(f"bench mapping: {selector!r} selects nothing: no {name!r}")
        cur = cur[name]
        if filters is not None:
            want = dict(kv.split("=", 1) for kv in filters.split(",") if "=" in kv)
            if not isinstance(cur, list):
                raise UsageError(f"bench mapping: {selector!r}: {name!r} is not a list")
            hits = [
                x
                for x in cur
                if isinstance(x, dict) and all(str(x.get(k)) == v for k, v in want.items())
            ]
            if len(hits) != 1:
                raise UsageError(
                    f"bench mapping: {selector!r} matches {len(hits)} elements of {name!r} "
                    f"(want one with {filters})"
                )
            cur = hits[0]
    return cur


def _fmt(value: Any, scale: float = 1.0, digits: int = 1, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        v = value * scale
        text = f"{v:,.{digits}f}"
        return f"{text} {unit}".strip()
    return str(value)


@dataclass
class Bench:
    source: str  # where the numbers come from (path, run id, commit, machine)
    lines: list[str]  # markdown
    patches: list[str] | None  # patch-number prefixes the numbers belong to (None: all)
    command: str | None


def check_provenance(results: Any, path: Path, version: str | None) -> list[str]:
    """Refuse numbers that cannot back this series: measured on another vLLM release,
    or from a tree with uncommitted changes (``versions`` and ``git.dirty`` of
    ``tools/bench.py``'s results). Returns the vLLM versions it measured."""
    if not isinstance(results, dict):
        raise UsageError(f"--bench {path}: not a results object")
    versions = results.get("versions")
    measured = []
    if isinstance(versions, dict):
        for key, entry in versions.items():
            got = entry.get("vllm") if isinstance(entry, dict) else None
            measured.append(str(got or key))
    if not measured:
        raise UsageError(
            f"--bench {path}: no 'versions' in it, so which vLLM it measured is unknown; "
            "pass a results JSON of tools/bench.py"
        )
    if version is None:
        raise UsageError(f"--bench {path}: the series' vLLM version is unknown; pass --version")
    if not any(patchtool.version_key(v) == patchtool.version_key(version) for v in measured):
        raise UsageError(
            f"--bench {path} measured vLLM {', '.join(measured)}, the series is for vLLM "
            f"{version}: benchmark the series' release"
        )
    git = results.get("git")
    dirty = git.get("dirty") if isinstance(git, dict) else None
    if dirty is None:
        raise UsageError(
            f"--bench {path}: no 'git.dirty' in it, so whether it ran from a clean tree is "
            "unknown; pass a results JSON of tools/bench.py"
        )
    if dirty:
        commit = str(git.get("commit") or "?")[:12]
        raise UsageError(
            f"--bench {path} ran from a tree with uncommitted changes (git.dirty, at "
            f"{commit}): its numbers belong to no commit; benchmark a clean checkout"
        )
    return measured


def bench_numbers(results_path: Path, mapping_path: Path | None, version: str | None) -> Bench:
    """The numbers of ``results_path`` for a series of vLLM ``version`` (checked
    with :func:`check_provenance`), picked by the mapping at ``mapping_path``."""
    try:
        results = json.loads(results_path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--bench {results_path}: cannot read it as JSON ({e})") from e
    measured = check_provenance(results, results_path, version)
    if mapping_path is not None:
        try:
            mapping = json.loads(mapping_path.read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"--bench-map {mapping_path}: cannot read it as JSON ({e})") from e
    elif results.get("aggregates"):
        mapping = {"table": {"caption": "TTFT p50 (ms)", "rows": "point", "cols": "mode",
                             "value": "ttft_p50", "scale": 1000, "digits": 0}}  # fmt: skip
    else:
        raise UsageError(
            f"--bench {results_path}: no 'aggregates' in it; pass --bench-map to say which "
            "numbers go into the description"
        )
    lines: list[str] = []
    if mapping.get("table"):
        lines += _table(results, mapping["table"])
    if mapping.get("numbers"):
        if lines:
            lines.append("")
        lines += ["| | value |", "| --- | --- |"]
        for entry in mapping["numbers"]:
            value = select(results, entry["select"])
            digits = int(entry.get("digits", 1))
            lines.append(
                f"| {entry['label']} | "
                f"{_fmt(value, float(entry.get('scale', 1)), digits, entry.get('unit', ''))} |"
            )
    machine = results.get("machine") or {}
    git = results.get("git") or {}
    bits = [f"`{results_path.name}`", f"vLLM {', '.join(measured)}"]
    if results.get("run_id"):
        bits.append(f"run `{results['run_id']}`")
    if isinstance(git, dict) and git.get("commit"):
        bits.append(f"commit `{str(git['commit'])[:12]}`")
    if machine.get("cpu"):
        bits.append(f"{machine['cpu']}, {machine.get('cores', '?')} cores")
    command = results.get("command")
    if isinstance(command, list):
        command = " ".join(map(str, command))
    return Bench(", ".join(bits), lines, mapping.get("patches"), command or None)


def _table(results: dict, spec: dict) -> list[str]:
    rows_src = select(results, spec.get("from", "aggregates"))
    if not isinstance(rows_src, list):
        raise UsageError(f"bench mapping: {spec.get('from', 'aggregates')!r} is not a list")
    rk, ck, vk = spec.get("rows", "point"), spec.get("cols", "mode"), spec["value"]
    row_keys = spec.get("select_rows") or list(dict.fromkeys(r.get(rk) for r in rows_src))
    cols = spec.get("select_cols") or {c: c for c in dict.fromkeys(r.get(ck) for r in rows_src)}
    if isinstance(cols, list):
        cols = {c: c for c in cols}
    cells = {(r.get(rk), r.get(ck)): r.get(vk) for r in rows_src}
    for key in row_keys:
        if not any(k[0] == key for k in cells):
            raise UsageError(f"bench mapping: no {rk}={key!r} in {spec.get('from', 'aggregates')}")
    for key in cols:
        if not any(k[1] == key for k in cells):
            raise UsageError(f"bench mapping: no {ck}={key!r} in {spec.get('from', 'aggregates')}")
    scale, digits = float(spec.get("scale", 1)), int(spec.get("digits", 1))
    out = [f"**{spec.get('caption', vk)}**", ""]
    out.append("| " + " | ".join([rk, *cols.values()]) + " |")
    out.append("|" + " --- |" * (len(cols) + 1))
    for key in row_keys:
        out.append(
            "| "
            + " | ".join([str(key)] + [_fmt(cells.get((key, c)), scale, digits) for c in cols])
            + " |"
        )
    return out


# -- the description --------------------------------------------------------------------


def _purpose(commits: list, single: bool) -> list[str]:
    out = []
    for c in commits:
        s = message_sections(c.patch)
        if not single:
            out += [f"### {c.subject}", ""]
        if s.get("intro"):
            out += [s["intro"], ""]
        if s.get("Why"):
            out += [s["Why"], ""]
        if s.get("How"):
            out += ["**How.**", "", s["How"], ""]
    return out


def _flat(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _overview(commits: list) -> list[str]:
    """What the change is, one line per patch (newer vLLM templates' *Overview*; the
    why and how of each patch are told once, in *Details*)."""
    return [f"- {c.subject}" for c in commits] + [""]


def _claims(commits: list) -> list[str]:
    """What each patch changes, one bullet per item of its *How* (newer vLLM templates'
    *Claims*): each a concrete, checkable statement about a file or behaviour."""
    out = []
    for c in commits:
        how = (message_sections(c.patch).get("How") or "").split("\n\n", 1)[0]
        items = [_flat(i) for i in re.split(r"(?m)^- ", how) if _flat(i)]
        if len(commits) > 1:
            out.append(f"- **{c.subject}**")
            out += [f"  - {i}" for i in items]
        else:
            out += [f"- {i}" for i in items]
    return out + [""]


def touches_nixl(commit: Any) -> bool:
    """Whether ``commit`` changes vLLM's NIXL connector."""
    return any(f.startswith(NIXL_CONNECTOR) for f in commit.files)


def request_flow(commits: list) -> list[str]:
    """Where in a P/D request each NIXL patch's code runs and what changes there: the
    numbered *Request flow* list of its message, then the connector files it changes.
    A patch without that list gets none (older series lack it; the 0.34.0 bodies are
    checked for it by tests/patches/test_pr_body_facts.py)."""
    out: list[str] = []
    for c in (c for c in commits if touches_nixl(c)):
        flow = message_sections(c.patch).get("Request flow", "")
        if not re.match(r"1\. ", flow):
            continue
        if len(commits) > 1:
            out += [f"### {c.subject}", ""]
        files = sorted(f[len(NIXL_CONNECTOR) :] for f in c.files if f.startswith(NIXL_CONNECTOR))
        out += [flow, "", "Connector files changed: " + ", ".join(f"`{f}`" for f in files), ""]
    return out


_TAGS = re.compile(r"^((?:\[[^\]]+\])+)\s*")


def series_title(commits: list) -> str:
    """One commit: its subject. Several: their common ``[Tag]`` prefix, the first
    subject and how many more (a reviewer reads the list in *Overview*)."""
    if len(commits) == 1:
        return commits[0].subject
    tags = [m.group(1) if (m := _TAGS.match(c.subject)) else "" for c in commits]
    common = tags[0] if len(set(tags)) == 1 else ""
    first = commits[0].subject[len(common) :].strip() if common else commits[0].subject
    return f"{common} {first} (+{len(commits) - 1} more)".strip()


def _files_arg(files: list[str]) -> str:
    return " ".join(files)


def _test_plan(
    results: list[CheckResult], bench: Bench | None, tree_note: str, pr_files: set[str]
) -> list[str]:
    out = [f"On {tree_note}:", ""]
    seen = set()
    for r in results:
        files = [f for f in r.files if f in pr_files] or r.files
        command = r.command.replace("{files}", _files_arg(files))
        if command and command not in seen and r.status != "skip":
            seen.add(command)
            out.append(f"- `{command}`" if not command.startswith("SPDX") else f"- {command}")
    notes = {r.note for r in results if r.note}
    out += [f"- Note: {n}" for n in sorted(notes)]
    skipped = [r for r in results if r.status == "skip"]
    for r in skipped:
        out.append(f"- {r.check}: not run here ({r.summary})")
    if bench is not None:
        cmd = f" (`{bench.command}`)" if bench.command else ""
        out.append(f"- Benchmark: {bench.source}{cmd}")
    return out + [""]


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _paths_count(paths: list[str]) -> str:
    """``2 folders``, ``1 file``, ``1 folder and 2 files`` (a folder ends with ``/``)."""
    folders = sum(p.endswith("/") for p in paths)
    parts = [_count(n, what) for n, what in ((folders, "folder"), (len(paths) - folders, "file"))]
    return " and ".join(p for p in parts if not p.startswith("0 ")) or "0 files"


def ran_statement(results: list[CheckResult], part: bool = False) -> str:
    """What ran and what did not, exactly, from the checks' results."""
    by_check: dict[str, list[CheckResult]] = {}
    for r in results:
        by_check.setdefault(r.check, []).append(r)
    ran, missing = [], []
    for check, rs in by_check.items():
        done = [r for r in rs if r.status in ("pass", "fail") and not r.could_not_run]
        files = sorted({f for r in done for f in r.files})
        if done and check == "pytest":
            which = "this PR's tests" if part else "the patches' tests"
            ran.append(f"pytest on {which} ({_paths_count(files)})")
        elif done:
            scope = "the branch touches" if part else "the PR touches"
            ran.append(f"{check} on the {_count(len(files), 'file')} {scope}")
        for why in dict.fromkeys(r.summary for r in rs if r not in done):
            missing.append(f"{check} ({why})")
    text = ("Checks run: " + "; ".join(ran) + ".") if ran else "No check ran."
    if missing:
        text += " Not run: " + "; ".join(missing) + "."
    return text


def _test_result(
    results: list[CheckResult], bench: Bench | None, names: set[str], part: bool
) -> list[str]:
    out = [ran_statement(results, part), ""]
    if part:
        out += [
            "The ruff, SPDX and mypy rows are of the branch with the whole series applied "
            "(this PR's files among them); the pytest rows are this PR's tests.",
            "",
        ]
    out += ["| check | result |", "| --- | --- |"]
    for r in results:
        out.append(f"| {r.check} | {r.status}: {r.summary.replace('|', '/')} |")
    out.append("")
    problems = [
        p
        for r in results
        if r.status == "fail"
        for p in r.problems
        if not p.endswith(".patch)") or any(n in p for n in names)
    ]
    if problems:
        out += ["Failing:", "", "```", *problems[:40], "```", ""]
    if bench is not None and bench.lines:
        out += [f"Benchmark ({bench.source}):", "", *bench.lines, ""]
    return out


def render(
    tree: Path,
    commits: list,
    results: list[CheckResult],
    bench: Bench | None,
    tree_note: str,
    part: bool = False,
) -> str:
    """The description of a PR made of ``commits`` (one patch or the whole series)."""
    text, _ = template(tree)
    single = len(commits) == 1
    if bench is not None and bench.patches is not None:
        wanted = {p.split("-", 1)[0] for p in bench.patches}
        if not any(c.patch.name.split("-", 1)[0] in wanted for c in commits):
            bench = None
    names = {c.patch.name for c in commits}
    # ruff, SPDX and mypy ran on the whole branch; pytest per patch: only these patches'.
    mine = [r for r in results if r.check != "pytest" or not r.patches or set(r.patches) & names]
    plan = _test_plan(mine, bench, tree_note, {f for c in commits for f in c.files})
    result = _test_result(mine, bench, names, part)
    fill = {
        # vLLM's template up to ~0.31
        "Purpose": _purpose(commits, single),
        "Test Plan": plan,
        "Test Result": result,
        # the newer one (0.32: Overview / Claims / Validation / Details)
        "Overview": _overview(commits),
        "Claims": _claims(commits),
        "Validation": [*plan, *result],
        "Details": _purpose(commits, single),
    }
    out: list[str] = []
    headings: list[str] = []
    for line in strip_instructions(text).splitlines():
        out.append(line)
        heading = line[3:].strip() if line.startswith("## ") else None
        if heading is not None:
            headings.append(heading)
        if heading in fill:
            out += ["", *fill[heading]]
    if not set(headings) & set(fill):
        raise KitError(
            f"the PR template ({template(tree)[1]}) has the sections {headings}; the kit fills "
            f"{sorted(fill)}: teach tools/prkit/describe.py the new template"
        )
    flow = request_flow(commits)
    if flow:
        after = [i for i, ln in enumerate(out) if ln in ("## Validation", "## Test Plan")]
        at = after[0] if after else tail_index(out)
        out[at:at] = ["## Request flow", "", *flow]
    related = {
        c.patch.name: message_sections(c.patch).get("Related upstream PR", "") for c in commits
    }
    at = tail_index(out)
    out[at:at] = [*duplicate_work(commits, related), *ai_assistance()]
    body = "\n".join(out)
    # No local path: the tree's own files by their path in vLLM, anything else named
    # as what it is (a failing test's output may quote an env or a temporary folder).
    body = body.replace(f"{tree}/", "")
    body = _LOCAL_PATH.sub("<local path>", body)
    for item in ("The purpose of the PR", "The test plan", "The test results"):
        body = body.replace(f"- [ ] {item}", f"- [x] {item}")
    return re.sub(r"\n{3,}", "\n\n", body).strip() + "\n"


def title(commits: list) -> str:
    """The PR title: the one subject, or :func:`series_title`."""
    return commits[0].subject if len(commits) == 1 else series_title(commits)


def write_descriptions(
    branch: PRBranch,
    results: list[CheckResult],
    bench: Bench | None,
    out: Path,
    tree_note: str,
) -> list[Path]:
    """``out/PR.md`` (the series as one PR) and ``out/pr/<patch>.md`` (one PR each), each
    with its title next to it (``PR.title``, ``pr/<patch>.title``)."""
    (out / "pr").mkdir(parents=True, exist_ok=True)
    paths = [out / "PR.md"]
    paths[0].write_text(render(branch.worktree, branch.commits, results, bench, tree_note))
    (out / "PR.title").write_text(title(branch.commits) + "\n")
    for c in branch.commits:
        p = out / "pr" / (Path(c.patch.name).stem + ".md")
        part = len(branch.commits) > 1
        p.write_text(render(branch.worktree, [c], results, bench, tree_note, part))
        p.with_suffix(".title").write_text(c.subject + "\n")
        paths.append(p)
    return paths
