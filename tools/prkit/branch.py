# SPDX-License-Identifier: Apache-2.0
"""The PR branch: one commit per patch of a series, ``git am -3``, signed off by the runner.

The branch is made in a temporary ``git worktree`` of the vLLM tree, so the tree's own
checkout (its HEAD, index and files) is never touched; the checks run in that worktree,
which is removed at the end. Each commit keeps the patch's subject and body; its author
becomes the runner (``keep_author`` keeps the patch's), the project-only
``Upstream-Since:`` trailer and sign-offs at reserved domains are dropped, and the
runner's ``Signed-off-by:`` is added.
"""

from __future__ import annotations

import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .common import KitError, Progress, UsageError, git, patchtool, run
from .identity import Identity, reserved_domain

_SIGNOFF_RE = re.compile(r"^Signed-off-by:\s*(.*?)\s*<([^>]*)>\s*$")
_PROJECT_TRAILERS = ("Upstream-Since:",)
_TRAILER_BY_RE = re.compile(r"^[A-Z][\w-]*-by: ")


@dataclass
class Commit:
    patch: patchtool.Patch
    sha: str
    subject: str
    files: list[str]
    insertions: int
    deletions: int
    patch_bytes: int
    signoffs: list[str]
    author: str


@dataclass
class PRBranch:
    tree: Path
    name: str
    base: str
    worktree: Path
    identity: Identity
    commits: list[Commit] = field(default_factory=list)

    def files_of(self, path: str) -> list[str]:
        """The patches (names) that touch ``path``."""
        return [c.patch.name for c in self.commits if path in c.files]

    def remove_worktree(self) -> None:
        run(["git", "worktree", "remove", "--force", str(self.worktree)], self.tree)
        shutil.rmtree(self.worktree.parent, ignore_errors=True)
        run(["git", "worktree", "prune"], self.tree)


def obtain_tree(
    tree: Path | None, version: str | None, out: Path, progress: Progress
) -> tuple[Path, bool]:
    """The vLLM git tree to work in, and whether the kit made it (from ``version``)."""
    if tree is not None:
        res = run(["git", "rev-parse", "--show-toplevel"], tree)
        if res.returncode != 0:
            raise UsageError(f"--tree {tree}: not a git checkout of vLLM")
        top = Path(res.stdout.strip())
        if not (top / "vllm").is_dir():
            raise UsageError(f"--tree {tree}: no vllm/ package at {top}")
        return top, False
    assert version is not None
    import vllm_source  # tools/vllm_source.py

    dest = out / f"vllm-{version}"
    if (dest / ".git").is_dir():
        progress(f"vLLM {version} tree: reusing {dest}")
        return dest, True
    progress(f"vLLM {version} tree: wheel + sdist tests/ (tools/vllm_source.py) -> {dest}")
    try:
        vllm_source.make_source_tree(version, dest, with_tests=True, identity=False)
    except vllm_source.SourceError as e:
        raise KitError(f"cannot make a vLLM {version} tree: {e}") from e
    return dest, True


def pr_message(message: str, identity: Identity, co_author: str | None = None) -> str:
    """The patch's commit message as it goes upstream (see the module docstring), with
    a ``Co-authored-by: <co_author>`` trailer (vLLM's AGENTS.md asks AI-assisted commits
    to name the assistant) before the sign-off."""
    kept = []
    for line in message.rstrip("\n").splitlines():
        if line.startswith(_PROJECT_TRAILERS):
            continue
        m = _SIGNOFF_RE.match(line)
        if m and line != identity.signoff and reserved_domain(m.group(2)):
            continue  # a group alias at a reserved domain is no DCO sign-off
        kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    trailers = [f"Co-authored-by: {co_author}"] if co_author else []
    for trailer in [*trailers, identity.signoff]:
        if trailer not in kept:
            if kept and not _TRAILER_BY_RE.match(kept[-1]):
                kept.append("")  # the first trailer opens the trailer block
            kept.append(trailer)
    return "\n".join(kept) + "\n"


def make_branch(
    tree: Path,
    series: list[patchtool.Patch],
    identity: Identity,
    name: str,
    base: str,
    progress: Progress,
    keep_author: bool = False,
    force: bool = False,
    co_author: str | None = None,
) -> PRBranch:
    """Create branch ``name`` at ``base`` with one commit per patch, in a new worktree."""
    base_sha = run(["git", "rev-parse", "--verify", f"{base}^{{commit}}"], tree)
    if base_sha.returncode != 0:
        raise UsageError(f"--base {base}: no such commit in {tree}")
    sha = base_sha.stdout.strip()
    if run(["git", "rev-parse", "--verify", f"refs/heads/{name}"], tree).returncode == 0:
        if not force:
            raise UsageError(
                f"branch {name} exists in {tree}; pass --branch NAME, or --force to replace it"
            )
        res = run(["git", "branch", "-D", name], tree)
        if res.returncode != 0:
            raise UsageError(f"cannot replace branch {name}: {res.stderr.strip()}")
    holder = Path(tempfile.mkdtemp(prefix="vllm-ext-pr-"))
    worktree = holder / "tree"
    git("worktree", "add", "-q", "-b", name, str(worktree), sha, cwd=tree)
    branch = PRBranch(tree, name, sha, worktree, identity)
    env = {"GIT_COMMITTER_NAME": identity.name, "GIT_COMMITTER_EMAIL": identity.email}
    try:
        for i, patch in enumerate(series, 1):
            progress(f"[{i}/{len(series)}] git am -3 {patch.name}")
            res = run(
                ["git", "am", "-3", "--keep-non-patch", "--quiet", str(patch.path)], worktree, env
            )
            if res.returncode != 0:
                output = res.stdout + res.stderr
                run(["git", "am", "--abort"], worktree)
                check = run(["git", "apply", "--check", str(patch.path)], worktree)
                conflict = patchtool._conflict_from_git(patch, check.stderr or output, False)
                raise KitError(
                    f"{patch.name} does not apply to {tree} at {sha[:12]} (git am -3): "
                    f"{conflict.where}\n  git said:\n"
                    + "\n".join("    " + ln for ln in output.strip().splitlines()[-6:])
                )
            message = git("log", "-1", "--format=%B", cwd=worktree)
            msg_file = holder / "message"
            msg_file.write_text(pr_message(message, identity, co_author))
            amend = ["commit", "--amend", "--no-verify", "-q", "-F", str(msg_file)]
            if not keep_author:
                amend += ["--author", str(identity)]
            git(*amend, cwd=worktree, env=env)
            branch.commits.append(_commit_info(worktree, patch))
    except BaseException:
        branch.remove_worktree()
        run(["git", "branch", "-D", name], tree)
        raise
    return branch


def _commit_info(worktree: Path, patch: patchtool.Patch) -> Commit:
    sha = git("rev-parse", "HEAD", cwd=worktree).strip()
    files, ins, dels = [], 0, 0
    for line in git("show", "--numstat", "--format=", sha, cwd=worktree).splitlines():
        a, d, path = line.split("\t", 2)
        files.append(path)
        ins += int(a) if a.isdigit() else 0
        dels += int(d) if d.isdigit() else 0
    body = git("log", "-1", "--format=%B", sha, cwd=worktree)
    return Commit(
        patch=patch,
        sha=sha,
        subject=git("log", "-1", "--format=%s", sha, cwd=worktree).strip(),
        files=files,
        insertions=ins,
        deletions=dels,
        patch_bytes=len(git("format-patch", "--stdout", "-1", sha, cwd=worktree).encode()),
        signoffs=[ln for ln in body.splitlines() if ln.startswith("Signed-off-by:")],
        author=git("log", "-1", "--format=%an <%ae>", sha, cwd=worktree).strip(),
    )


def write_format_patches(branch: PRBranch, dest: Path, upstream_base: str) -> list[str]:
    """Write the branch's commits as ``git format-patch`` files under ``dest`` and return
    the shell commands that put them on a real vLLM checkout at ``upstream_base``.

    A branch of a tree made from a release's wheel and sdist (one synthetic commit)
    cannot be pushed as a PR to vLLM: its history is not vLLM's. The same commits,
    applied with ``git am -3`` onto vLLM's own ``upstream_base`` (a tag such as
    ``v0.23.0``), can. Where the tree's files equal vLLM's at that tag, the blobs the
    patches name are vLLM's, so ``git am -3`` can fall back to a 3-way merge."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    git(
        "format-patch", "-q", "--zero-commit", "--no-signature", "-o", str(dest),
        f"{branch.base}..{branch.name}", cwd=branch.tree,
    )  # fmt: skip
    files = sorted(dest.glob("*.patch"))
    if len(files) != len(branch.commits):
        raise KitError(
            f"git format-patch wrote {len(files)} files for {len(branch.commits)} commits"
        )
    return [
        "cd /path/to/your/vllm  # a clone of vLLM's repository, with its tags",
        f"git switch -c {shlex.quote(branch.name)} {shlex.quote(upstream_base)}",
        # --keep-non-patch: keep the subjects' "[KV Connector]"-style tags
        "git am -3 --keep-non-patch " + " ".join(shlex.quote(str(f)) for f in files),
    ]
