# SPDX-License-Identifier: Apache-2.0
"""``relations``: a state file older than the newest target release is called stale,
and a "None found" section relates its patch to no PR."""

from __future__ import annotations

import datetime
import io
import tarfile
from pathlib import Path

from prkit import relations  # tools/ is on sys.path through patch_support


def _sdist(cache: Path, version: str, built: datetime.datetime) -> None:
    (cache / "sdists").mkdir(parents=True, exist_ok=True)
    with tarfile.open(cache / "sdists" / f"vllm-{version}.tar.gz", "w:gz") as tf:
        info = tarfile.TarInfo(f"vllm-{version}/PKG-INFO")
        data = b"Metadata-Version: 2.1\nName: vllm\n"
        info.size, info.mtime = len(data), built.timestamp()
        tf.addfile(info, io.BytesIO(data))


def test_a_state_seen_before_the_newest_release_is_stale(tmp_path: Path) -> None:
    utc = datetime.UTC
    _sdist(tmp_path, "0.33.0", datetime.datetime(2026, 9, 1, tzinfo=utc))
    _sdist(tmp_path, "0.34.0", datetime.datetime(2026, 11, 16, 23, 0, tzinfo=utc))
    state = {"seen": "2026-09-23"}
    stale = relations.staleness(state, ["0.33.0", "0.34.0"], cache=tmp_path)
    assert stale is not None
    assert "seen on 2026-09-23, before vLLM 0.34.0 (its sdist was built on 2026-11-16)" in stale
    assert "**Stale:** the PR states" in relations.render([], state, stale)
    # Seen after the newest release: current; a release with no cached sdist: unknown.
    assert relations.staleness({"seen": "2026-11-20"}, ["0.34.0"], cache=tmp_path) is None
    assert relations.staleness(state, ["0.33.0", "0.35.0"], cache=tmp_path) is None
    assert "no valid `seen`" in str(relations.staleness({}, ["0.34.0"], cache=tmp_path))


def test_none_found_relates_to_no_pr() -> None:
    msg = (
        "Subject: x\n\nRelated upstream PR:\nNone found: #48633 is about the push "
        "protocol, not this.\n\nUpstream-Since: none\n---\n"
    )
    assert relations._related_section(msg) == ""
    related = msg.replace("None found: #48633 is", "#48633 row L1 is")
    assert "#48633" in relations._related_section(related)


def test_no_patch_is_related_to_a_pr_its_message_says_is_unrelated() -> None:
    rows = {(r.series, r.patch): r for r in relations.collect()}
    for series in ("vllm-0.32.0", "vllm-0.34.0"):
        first = next(r for (s, _), r in rows.items() if s == series and r.patch.startswith("0001"))
        assert first.prs == [], (series, first.patch, first.prs)
