# SPDX-License-Identifier: Apache-2.0
"""Share identical files between the pinned envs as hard links (stdlib only).

The envs under ``.venvs/`` hold many of the same wheels (0.32.0 and 0.34.0 share their torch,
triton and NIXL; every env shares NIXL, llvmlite and transformers): about 6 GB of 15 GB on the
project machines. A file is shared only when two envs hold it at the same path relative to the
env, with the same size, mode and bytes. The installed ``vllm`` package is never shared: the
patch series edits it in place in some envs. pip replaces a file by unlinking it, and Python
writes bytecode by renaming, so a later install into one env never changes another's file.

Usage (``tools/envs.py build`` calls it after building)::

    python3 -m devkit.shared_files .venvs/vllm-0.32.0 .venvs/vllm-0.34.0
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

#: Smaller files are not worth an inode lookup and a hash.
MIN_SHARED_BYTES = 64 * 1024
#: Parts of an env never shared (relative to the env, ``/``-separated, matched as a path
#: component sequence): the vLLM package the patch series edits in place.
NEVER_SHARED = ("/site-packages/vllm/",)


@dataclass(frozen=True)
class Shared:
    files: int
    bytes: int


def _candidates(envs: list[Path]) -> dict[tuple[str, int, int], list[Path]]:
    """Files by (path in the env, size, mode), only where several envs hold one."""
    by_key: dict[tuple[str, int, int], list[Path]] = defaultdict(list)
    for env in envs:
        for dirpath, _dirs, files in os.walk(env):
            for name in files:
                path = Path(dirpath, name)
                rel = "/" + path.relative_to(env).as_posix()
                if any(part in rel for part in NEVER_SHARED):
                    continue
                try:
                    st = path.lstat()
                except OSError:
                    continue
                if not path.is_file() or path.is_symlink() or st.st_size < MIN_SHARED_BYTES:
                    continue
                by_key[(rel, st.st_size, st.st_mode)].append(path)
    return {k: v for k, v in by_key.items() if len(v) > 1}


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=20)
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def share(envs: list[Path]) -> Shared:
    """Hard-link identical files across ``envs``; returns what was newly shared.

    Each file is swapped for a link atomically (a link made beside it, then renamed over
    it), so a process reading the env meanwhile sees the old file or the same bytes.
    """
    files = saved = 0
    for (_rel, size, _mode), paths in _candidates(envs).items():
        by_inode: dict[tuple[int, int], Path] = {}
        for p in paths:
            st = p.stat()
            by_inode.setdefault((st.st_dev, st.st_ino), p)
        if len(by_inode) < 2:
            continue
        by_digest: dict[str, list[Path]] = defaultdict(list)
        for p in by_inode.values():
            by_digest[_digest(p)].append(p)
        for same in by_digest.values():
            first, *rest = same
            for p in rest:
                tmp = p.with_name(p.name + ".vllm-ext-share")
                try:
                    os.link(first, tmp)
                    os.replace(tmp, p)
                except OSError:  # another file system, or a read-only one: keep the copy
                    tmp.unlink(missing_ok=True)
                    continue
                files += 1
                saved += size
    return Shared(files, saved)


def main(argv: list[str] | None = None) -> int:
    envs = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    missing = [str(e) for e in envs if not e.is_dir()]
    if len(envs) < 2 or missing:
        print(f"usage: shared_files ENV ENV [ENV ...] (missing: {missing})", file=sys.stderr)
        return 2
    done = share(envs)
    print(f"shared {done.files} files, {done.bytes / 2**30:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
