# SPDX-License-Identifier: Apache-2.0
"""Refresh a patch series against a newer vLLM tree, patch by patch.

Each patch is one of

* **already upstream**, judged from the source, not from its trailer alone:
  its reverse applies to the new tree (``git apply --reverse --check``: the change is
  there as is); or every symbol it adds (functions, classes, fields, attributes,
  module constants that the series' own base release does not define) is defined in
  the new tree's ``vllm/``; or the code it changes is gone from the new tree (no hunk's
  distinctive lines are left anywhere) and its ``Upstream-Since:`` trailer says the
  change is upstream in that release (superseded upstream);
* **applies cleanly** (``git apply --check``), **applies with 3-way** (``git am -3``,
  with the series' base release fetched into a scratch clone so the merge has its
  ancestor), **blocked** by an earlier patch that did not apply (a cascade: the lines
  it misses are the ones that patch adds), or **conflicts** (the hunk is named, and
  where the code it changes went: moved to another file, or gone; hunks are numbered
  per file, as git and the patch tool number them). Every hunk that does not apply is
  listed (``git apply --reject`` tries each on its own), also for a blocked patch, so
  a real conflict behind a cascade is not hidden.

A patch that sets a wire constant (``*_VERSION``, ``*_PREFIX``: e.g.
``NIXL_CONNECTOR_VERSION``) to a value that the new tree already uses conflicts, even
where its hunk would apply: bumped upstream to the same number, the patched and the
unpatched peers would pair.

Whether the code a patch changes is gone (and with a trailer that agrees, superseded
upstream) is only asked of a patch that does not apply on top of the earlier ones: a
patch whose context an earlier patch of the series adds applies, and is not "gone".

Patches are tried in order on top of the ones that applied; those that apply are
written as ``git format-patch`` files under their original names. Where the trailer
and the source disagree, the report says so.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .common import SCRATCH_IDENTITY, KitError, Progress, git, patchtool, run

_DEFINES = (
    re.compile(r"^\s*(?:async\s+)?def\s+(\w+)\s*\(", re.M),
    re.compile(r"^\s*class\s+(\w+)\b", re.M),
    re.compile(r"^\s+(\w+)\s*:\s*[^=\s][^=]*=(?!=)", re.M),  # field / annotated attribute
    re.compile(r"^([A-Za-z_]\w*)\s*(?::[^=]+)?=(?!=)", re.M),  # module-level name
    re.compile(r"\bself\.(\w+)\s*(?::[^=]+)?=(?!=)"),  # attribute set in a method
)


def _definition_re(name: str) -> re.Pattern[str]:
    n = re.escape(name)
    return re.compile(
        rf"^\s*(?:async\s+)?def\s+{n}\s*\(|^\s*class\s+{n}\b|^\s*{n}\s*:|^{n}\s*=(?!=)"
        rf"|\bself\.{n}\s*(?::[^=]+)?=(?!=)",
        re.M,
    )


class SourceIndex:
    """The Python sources under ``vllm/`` of a tree: text and stripped-line sets."""

    def __init__(self, root: Path):
        self.root = root
        self.text: dict[str, str] = {}
        for path in sorted((root / "vllm").rglob("*.py")):
            self.text[str(path.relative_to(root))] = path.read_text(errors="replace")
        self._lines: dict[str, set[str]] = {}
        self._freq: dict[str, int] = {}

    def lines(self, rel: str) -> set[str]:
        if rel not in self._lines:
            self._lines[rel] = {ln.strip() for ln in self.text.get(rel, "").splitlines()}
        return self._lines[rel]

    def files_with_line(self, line: str) -> int:
        """How many files have ``line`` (stripped); cached."""
        if line not in self._freq:
            self._freq[line] = sum(
                1 for rel, text in self.text.items() if line in text and line in self.lines(rel)
            )
        return self._freq[line]

    def defined_in(self, name: str) -> list[str]:
        pattern = _definition_re(name)
        return [rel for rel, text in self.text.items() if name in text and pattern.search(text)]


@dataclass
class Hunk:
    path: str
    header: str
    old: list[str]  # context and removed lines (what the hunk needs to find)
    added: list[str]
    removed: list[str]


def hunks(patch: patchtool.Patch) -> list[Hunk]:
    out: list[Hunk] = []
    path = None
    for line in patch.path.read_text(errors="replace").splitlines():
        if line.startswith("diff --git "):
            path = line.split(" b/", 1)[-1]
        elif line == "-- ":  # the signature after the last hunk
            break
        elif line.startswith(("--- ", "+++ ")):
            continue
        elif line.startswith("@@") and path is not None:
            out.append(Hunk(path, line, [], [], []))
        elif out and path == out[-1].path:
            if line.startswith("+"):
                out[-1].added.append(line[1:])
            elif line.startswith("-"):
                out[-1].removed.append(line[1:])
                out[-1].old.append(line[1:])
            elif line.startswith(" "):
                out[-1].old.append(line[1:])
    return [h for h in out if h.path.startswith("vllm/") and h.path.endswith(".py")]


def new_symbols(patch: patchtool.Patch, base: SourceIndex | None) -> list[str]:
    """Names the patch defines in ``vllm/`` that neither its removed lines nor the
    series' base release define."""
    found: dict[str, None] = {}
    removed = "\n".join(r for h in hunks(patch) for r in h.removed)
    for h in hunks(patch):
        added = "\n".join(h.added)
        for pattern in _DEFINES:
            for m in pattern.finditer(added):
                name = m.group(1)
                if len(name) < 4 or name.startswith("__") or name in found:
                    continue
                if re.search(rf"\b{re.escape(name)}\b", removed):
                    continue
                found[name] = None
    names = list(found)
    if base is not None:
        names = [n for n in names if not base.defined_in(n)]
    return names


def _distinctive(lines: Iterable[str]) -> list[str]:
    out = []
    for ln in lines:
        s = ln.strip()
        if len(s) >= 20 and not s.startswith(("#", '"""', "'''")):
            out.append(s)
    return out


def where_code_went(patch: patchtool.Patch, index: SourceIndex) -> tuple[str, list[str]]:
    """("present" | "moved" | "gone" | "changed" | "unknown", notes) for the code the
    patch changes: per hunk, whether its distinctive lines (context and removed lines
    that few files share) are still in its file, in another file, or nowhere."""
    verdicts: list[str] = []
    moved: dict[tuple[str, str], list[int]] = {}
    gone: dict[str, list[int]] = {}
    per_file: dict[str, int] = {}
    for h in hunks(patch):
        per_file[h.path] = i = per_file.get(h.path, 0) + 1  # "hunk #i of <file>"
        old = [ln for ln in _distinctive(h.old) if index.files_with_line(ln) <= 3]
        if len(old) < 2:
            continue
        same = sum(ln in index.lines(h.path) for ln in old) / len(old)
        if same >= 0.5:
            verdicts.append("present")
            continue
        best, score = None, 0.0
        for rel in index.text:
            if rel == h.path:
                continue
            text = index.text[rel]
            if not any(ln in text for ln in old[:3]):
                continue
            s = sum(ln in index.lines(rel) for ln in old) / len(old)
            if s > score:
                best, score = rel, s
        if best is not None and score >= 0.5:
            verdicts.append("moved")
            moved.setdefault((h.path, best), []).append(i)
        else:
            verdicts.append("gone")
            gone.setdefault(h.path, []).append(i)
    notes = [
        f"the code of {_hunks_word(ns)} of {_short(path)} is now in {_short(dest)}"
        for (path, dest), ns in moved.items()
    ] + [f"the code of {_hunks_word(ns)} of {_short(path)} is gone" for path, ns in gone.items()]
    if not verdicts:
        return "unknown", notes
    if all(v == "present" for v in verdicts):
        return "present", notes
    if all(v == "gone" for v in verdicts):
        return "gone", notes
    return "moved" if "moved" in verdicts else "changed", notes


@dataclass
class Refreshed:
    patch: patchtool.Patch
    # "already upstream", "applies cleanly", "applies with 3-way", "conflicts", or
    # "blocked" (it conflicts only because an earlier patch did not apply)
    status: str
    evidence: list[str] = field(default_factory=list)
    written: Path | None = None

    def as_dict(self) -> dict:
        return {
            "patch": self.patch.name,
            "subject": self.patch.subject,
            "status": self.status,
            "upstream_since_trailer": self.patch.upstream_since,
            "evidence": self.evidence,
            "written": str(self.written) if self.written else None,
        }


def series_version(directory: Path) -> str | None:
    m = re.fullmatch(r"vllm-(\d+\.\d+\.\d+\S*)", directory.name)
    return m.group(1) if m else None


def refresh(
    series_dir: Path,
    tree: Path,
    out: Path,
    progress: Progress,
    base_tree: Path | None = None,
) -> list[Refreshed]:
    series = patchtool.load_series(series_dir)
    if not series:
        raise KitError(f"{series_dir}: no *.patch files")
    version = patchtool.CheckoutTarget(tree).version()
    progress(f"refresh {series_dir.name} ({len(series)} patches) against vLLM {version} at {tree}")
    base_index = SourceIndex(base_tree) if base_tree is not None else None
    with tempfile.TemporaryDirectory(prefix="vllm-ext-refresh-") as tmp:
        work = Path(tmp) / "work"
        git("clone", "-q", "--shared", "--no-checkout", str(tree), str(work), cwd=Path(tmp))
        head = git("rev-parse", "HEAD", cwd=tree).strip()
        git("checkout", "-q", "--detach", head, cwd=work)
        if base_tree is not None:  # the ancestors git am -3 needs
            run(["git", "fetch", "-q", "--no-tags", str(base_tree), "+HEAD:refs/kit/base"], work)
        index = SourceIndex(work)
        results: list[Refreshed] = []
        upstream_checks = {}
        for p in series:  # on the pristine new tree, before anything is applied
            upstream_checks[p.name] = _upstream_evidence(p, work, index, base_index, version)
        for i, p in enumerate(series, 1):
            progress(f"[{i}/{len(series)}] {p.name}")
            is_up, evidence = upstream_checks[p.name]
            if is_up:
                results.append(Refreshed(p, "already upstream", evidence))
            else:
                results.append(_apply(p, work, index, evidence, version, results))
            r = results[-1]
            collisions = wire_collisions(p, index)
            if collisions and r.status != "already upstream":
                # A clash applies silently: peers of different code would pair.
                r.evidence[:0] = [f"wire constant: {c}" for c in collisions]
                r.status = "conflicts"
            progress(
                f"  {r.status}: {'; '.join(r.evidence[:2])}" if r.evidence else f"  {r.status}"
            )
        applied = [r for r in results if r.status.startswith("applies")]
        if applied:
            (out / "patches").mkdir(parents=True, exist_ok=True)
            fp = Path(tmp) / "fp"
            git(
                "format-patch",
                "-q",
                "--zero-commit",
                "--no-signature",
                "-o",
                str(fp),
                f"{head}..HEAD",
                cwd=work,
            )
            for r, produced in zip(applied, sorted(fp.glob("*.patch"))):
                r.written = out / "patches" / r.patch.name
                r.written.write_text(produced.read_text())
    return results


def _upstream_evidence(
    patch: patchtool.Patch,
    work: Path,
    index: SourceIndex,
    base_index: SourceIndex | None,
    version: str | None,
) -> tuple[bool, list[str]]:
    trailer_says = patch.is_upstream_in(version)
    trailer = f"its Upstream-Since trailer says {patch.upstream_since or 'none'}" + (
        f" (<= {version})" if trailer_says else ""
    )
    reverse = run(["git", "apply", "--check", "--reverse", str(patch.path)], work)
    if reverse.returncode == 0:
        return True, [
            "git apply --reverse --check passes: the change is in the tree as is",
            trailer,
        ]
    symbols = new_symbols(patch, base_index)
    own = set(patch.hunks)
    # where each is defined, the files the patch touches first
    found = {s: sorted(index.defined_in(s), key=lambda f: (f not in own, f)) for s in symbols}
    have = [s for s in symbols if found[s]]
    evidence = []
    if symbols and len(have) == len(symbols):
        evidence.append(
            "every symbol it adds is defined in the tree: "
            + ", ".join(f"{s} ({_where(found[s])})" for s in symbols)
        )
        if not trailer_says:
            evidence.append(f"{trailer}: update it")
        else:
            evidence.append(trailer)
        return True, evidence
    if symbols:
        missing = [s for s in symbols if not found[s]]
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        if have:
            evidence.append(
                f"partly in the tree: {len(have)} of the {len(symbols)} symbols it adds "
                f"(missing: {shown})"
            )
        else:
            evidence.append(f"not upstream: none of the symbols it adds is in the tree ({shown})")
    if trailer_says:
        evidence.append(f"{trailer}, but the source does not show the change")
    return False, evidence


def _short(path: str) -> str:
    return path.replace("vllm/distributed/kv_transfer/kv_connector/", "kv_connector/")


def _where(files: list[str]) -> str:
    more = f" and {len(files) - 2} more" if len(files) > 2 else ""
    return ", ".join(_short(f) for f in files[:2]) + more


def _hunks_word(numbers: list[int]) -> str:
    return ("hunk #" if len(numbers) == 1 else "hunks #") + ", #".join(map(str, numbers))


def _apply(
    patch: patchtool.Patch,
    work: Path,
    index: SourceIndex,
    evidence: list[str],
    version: str | None,
    earlier: list[Refreshed],
) -> Refreshed:
    """Apply ``patch`` on top of the earlier ones that applied; where it does not, tell
    superseded code, a cascade (blocked by an earlier patch that did not apply) and a
    real conflict apart."""
    path = str(patch.path)
    check = run(["git", "apply", "--check", path], work)
    am = run(["git", "am", "-3", "--keep-non-patch", "--quiet", path], work, SCRATCH_IDENTITY)
    if am.returncode == 0:
        status = "applies cleanly" if check.returncode == 0 else "applies with 3-way"
        return Refreshed(patch, status, evidence)
    run(["git", "am", "--abort"], work)
    where = patchtool._conflict_from_git(patch, check.stderr + check.stdout, False).where
    # every hunk that does not apply, not only the first git names
    every = _rejected_evidence(rejected_hunks(patch, work))
    failed = [r.patch for r in earlier if r.status in ("conflicts", "blocked")]
    blockers = blocked_by(patch, failed, work)
    if blockers:
        names = ", ".join(b.name for b in blockers)
        return Refreshed(
            patch,
            "blocked",
            [
                f"blocked by {names}: {where} needs lines that {names} adds, and "
                f"{'it does' if len(blockers) == 1 else 'they do'} not apply; refresh "
                f"{names} first",
                *every,
                *evidence,
            ],
        )
    code, notes = where_code_went(patch, index)
    if code == "gone" and patch.is_upstream_in(version):
        trailer = f"its Upstream-Since trailer says {patch.upstream_since} (<= {version})"
        return Refreshed(
            patch, "already upstream", [f"superseded: {'; '.join(notes)} from the tree", trailer]
        )
    return Refreshed(patch, "conflicts", [f"{where} does not match", *every, *evidence, *notes])


#: A wire constant: a protocol version or a notification prefix, set at module level.
_WIRE_CONSTANT = re.compile(
    r"^([A-Z][A-Z0-9_]*(?:_VERSION|_PREFIX))\s*(?::[^=]+)?=\s*(\d+|b\"[^\"]*\")\s*$"
)


def wire_collisions(patch: patchtool.Patch, index: SourceIndex) -> list[str]:
    """Wire constants the patch sets to a value that the tree already uses: a version
    the patch bumps to that upstream bumped to (or past) on its own, or a new prefix
    that upstream already defines. Either would let peers of different code pair as if
    they spoke the same protocol."""
    found = []
    for h in hunks(patch):
        old = {m.group(1): m.group(2) for m in map(_WIRE_CONSTANT.match, h.removed) if m}
        text = index.text.get(h.path, "")
        for m in filter(None, map(_WIRE_CONSTANT.match, h.added)):
            name, value = m.groups()
            now = [
                t.group(2)
                for t in map(_WIRE_CONSTANT.match, text.splitlines())
                if t and t.group(1) == name
            ]
            if value.isdigit() and now and now[0].isdigit():
                if old.get(name) != now[0] and int(value) <= int(now[0]):
                    found.append(
                        f"{name} = {value} collides with upstream's: {_short(h.path)} "
                        f"already has {name} = {now[0]} (the patch moved it from "
                        f"{old.get(name, '?')}); take {int(now[0]) + 1}"
                    )
            elif not value.isdigit() and value in text and name not in old:
                found.append(f"{name} = {value}: {_short(h.path)} already uses {value}")
    return found


def rejected_hunks(patch: patchtool.Patch, work: Path) -> dict[str, list[int]]:
    """Every hunk of ``patch`` that does not apply to ``work`` as it stands (file ->
    hunk numbers, per file as git numbers them): ``git apply --reject`` tries each hunk
    on its own; the tree is reset afterwards."""
    res = run(["git", "apply", "--reject", str(patch.path)], work)
    out: dict[str, list[int]] = {}
    current = None
    for line in (res.stderr + res.stdout).splitlines():
        if m := re.match(r"Applying patch (\S+) with \d+ rejects?", line):
            current = m.group(1)
        elif (m := re.match(r"Rejected hunk #(\d+)\.", line)) and current:
            out.setdefault(current, []).append(int(m.group(1)))
    run(["git", "reset", "-q", "--hard"], work)
    run(["git", "clean", "-q", "-f", "-d"], work)
    return out


def _rejected_evidence(rejected: dict[str, list[int]]) -> list[str]:
    if not rejected:
        return []
    n = sum(map(len, rejected.values()))
    return [
        f"{n} hunk{'s' if n > 1 else ''} do{'es' if n == 1 else ''} not apply: "
        + "; ".join(f"{_hunks_word(nums)} of {_short(f)}" for f, nums in rejected.items())
    ]


def _needed_lines(h: Hunk) -> set[str]:
    return {ln.strip() for ln in h.old if ln.strip()}


def blocked_by(
    patch: patchtool.Patch, failed: list[patchtool.Patch], work: Path
) -> list[patchtool.Patch]:
    """The earlier patches that did not apply and without which ``patch`` cannot: some
    hunk of ``patch`` needs (context or removed) lines missing from the tree that those
    patches add, and every line it misses is one they add (the tree is assumed to have
    them applied; with them, the hunk would find its place)."""
    if not failed:
        return []
    adds: dict[str, dict[str, set[str]]] = {}  # file -> patch name -> lines it adds
    for f in failed:
        for h in hunks(f):
            adds.setdefault(h.path, {}).setdefault(f.name, set()).update(
                ln.strip() for ln in h.added if ln.strip()
            )
    names: set[str] = set()
    for h in hunks(patch):
        target = work / h.path
        have = (
            {ln.strip() for ln in target.read_text(errors="replace").splitlines()}
            if (target.is_file())
            else set()
        )
        missing = _needed_lines(h) - have
        if not missing:
            continue
        provided = adds.get(h.path, {})
        givers = {n for n, lines in provided.items() if lines & missing}
        if givers and missing <= set().union(*(provided[n] for n in givers)):
            names |= givers
    return [f for f in failed if f.name in names]


def write_report(
    results: list[Refreshed], tree: Path, series_dir: Path, out: Path
) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    version = patchtool.CheckoutTarget(tree).version()
    data = {
        "series": str(series_dir),
        "tree": str(tree),
        "version": version,
        "patches": [r.as_dict() for r in results],
    }
    js = out / "refresh.json"
    js.write_text(json.dumps(data, indent=1))
    lines = [
        f"# Refresh of {series_dir.name} against vLLM {version}",
        "",
        f"Tree: `{tree}`",
        "",
        "| patch | result | evidence |",
        "| --- | --- | --- |",
    ]
    for r in results:
        ev = "<br>".join(e.replace("|", "/") for e in r.evidence)
        lines.append(f"| `{r.patch.name}` | {r.status} | {ev} |")
    written = [r for r in results if r.written]
    if written:
        lines += ["", f"Refreshed patches ({len(written)}): `{out / 'patches'}`"]
    md = out / "refresh.md"
    md.write_text("\n".join(lines) + "\n")
    return js, md
