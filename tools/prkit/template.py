# SPDX-License-Identifier: Apache-2.0
"""vLLM's pull-request template, and the parts of a PR body that vLLM's contribution
policy (its ``AGENTS.md``) asks of AI-assisted work beyond the template's sections.

* The template is the tree's ``.github/PULL_REQUEST_TEMPLATE.md`` (the sdist has it),
  else :data:`BUILTIN_TEMPLATE`, vLLM's current one (*Purpose* / *Test Plan* / *Test
  Result*, then the "Essential Elements" checklist). Its HTML comments and the "fill in
  here" line are instructions to the author: they are dropped from the body.
* *Duplicate-work check*: what each patch's message says under *Related upstream PR*,
  and the searches the submitter runs before opening the PR.
* *AI assistance*: a statement that AI assistance was used, with an unticked box the
  human submitter ticks after reviewing every changed line and running the tests.

Both go above the template's "BEFORE SUBMITTING" line (GitHub Actions removes what is
below it).
"""

from __future__ import annotations

import re
from pathlib import Path

BUILTIN_TEMPLATE = """<!-- markdownlint-disable -->
PLEASE FILL IN THE PR DESCRIPTION HERE ENSURING ALL CHECKLIST ITEMS (AT THE BOTTOM) HAVE BEEN CONSIDERED.

## Purpose

## Test Plan

## Test Result

---
<details>
<summary> Essential Elements of an Effective PR Description Checklist </summary>

- [ ] The purpose of the PR, such as "Fix some issue (link existing issues this PR will resolve)".
- [ ] The test plan, such as providing test command.
- [ ] The test results, such as pasting the results comparison before and after, or e2e results
- [ ] (Optional) The necessary documentation update, such as updating `supported_models.md` and `examples` for a new model.
- [ ] (Optional) Release notes update. If your change is user facing, please update the release notes draft.
</details>

**BEFORE SUBMITTING, PLEASE READ <https://docs.vllm.ai/en/latest/contributing>** (anything written below this line will be removed by GitHub Actions)
"""  # noqa: E501

_COMMENT_RE = re.compile(r"<!--.*?-->", re.S)
_FILL_IN_RE = re.compile(r"^(PLEASE )?FILL IN THE PR DESCRIPTION HERE\b")
#: Lines that end the sections an author fills in.
_TAIL_RE = re.compile(r"^(---\s*$|<details>|\*\*BEFORE SUBMITTING)")

AI_STATEMENT = (
    "- [ ] AI assistance was used to prepare this change: its code, tests and this "
    "description were drafted with an AI coding assistant. "
    "I, the submitter, have reviewed every changed line, ran the tests listed above, "
    "and can explain and defend the change end to end."
)


def template(tree: Path) -> tuple[str, str]:
    path = tree / ".github" / "PULL_REQUEST_TEMPLATE.md"
    if path.is_file():
        return path.read_text(), "the tree's .github/PULL_REQUEST_TEMPLATE.md"
    return BUILTIN_TEMPLATE, "vLLM's template (built-in copy: the tree has none)"


def strip_instructions(text: str) -> str:
    """The template without its HTML comments and its "fill in here" line."""
    out = []
    for line in text.splitlines():
        stripped = _COMMENT_RE.sub("", line)
        if stripped != line and not stripped.strip():
            continue  # a line that held only a comment
        if _FILL_IN_RE.match(stripped.strip()):
            continue
        out.append(stripped.rstrip())
    body = "\n".join(out)
    return _COMMENT_RE.sub("", body).strip("\n") + "\n"  # comments over several lines


def tail_index(lines: list[str]) -> int:
    """Where the sections to fill end: the first separator, checklist or "BEFORE
    SUBMITTING" line after the last ``## `` heading (else the end)."""
    last = max((i for i, ln in enumerate(lines) if ln.startswith("## ")), default=-1)
    for i in range(last + 1, len(lines)):
        if _TAIL_RE.match(lines[i]):
            return i
    return len(lines)


def _search_words(subject: str) -> str:
    words = re.sub(r"^(\[[^\]]+\]\s*)+", "", subject)
    keep = [w for w in re.findall(r"[A-Za-z_][\w-]+", words) if len(w) > 3]
    return " ".join(keep[:4])


def duplicate_work(commits: list, related: dict[str, str]) -> list[str]:
    """The *Duplicate-work check* section: each patch's *Related upstream PR* lines."""
    out = ["## Duplicate-work check", ""]
    for c in commits:
        text = " ".join(related.get(c.patch.name, "").split())
        out.append(f"- **{c.subject}**: " + (text or "its message names no related upstream PR."))
    out += ["", "Searches to run before opening this PR:", ""]
    for c in commits:
        words = _search_words(c.subject)
        out.append(f'- `gh pr list --repo vllm-project/vllm --state open --search "{words}"`')
    return out + [
        "",
        "- [ ] I ran these searches and found no open PR that duplicates this one.",
        "",
    ]


def ai_assistance() -> list[str]:
    """The *AI assistance* section: an unticked box for the submitter to confirm."""
    return ["## AI assistance", "", AI_STATEMENT, ""]
