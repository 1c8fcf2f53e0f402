# SPDX-License-Identifier: Apache-2.0
"""Hand-written mutants of the push connector that the default test run must catch.

Each mutant is one edit of the connector's source that breaks the invariant of
docs/design.md ("Which blocks a WRITE may touch", S-SAFE-1) the way a real bug
would: KV written into blocks vLLM did not give the request, a failed push served,
a WRITE NIXL still runs taken as stopped. ``test_mutants.py`` applies each to a copy
of ``vllm_ext`` and runs the tests named in ``caught_by`` (all in the default run)
over that copy: at least one must fail, or the suite cannot see that bug.

An edit whose ``original`` text is no longer in the source fails the check too (the
mutant would silently test nothing): move it with the code.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    #: what the bug does, in words
    about: str
    #: the file under ``vllm_ext/`` and the text replaced there (exactly once)
    path: str
    original: str
    mutated: str
    #: test node ids (relative to the repository root) that must catch it
    caught_by: tuple[str, ...]

    def apply(self, package: Path) -> None:
        """Edit the copy of ``vllm_ext`` at ``package`` in place."""
        f = package / self.path
        text = f.read_text()
        count = text.count(self.original)
        if count != 1:
            raise AssertionError(
                f"mutant {self.name}: the text it replaces occurs {count} times in {self.path}"
            )
        f.write_text(text.replace(self.original, self.mutated))


def copy_package(src: Path, dest: Path) -> Path:
    """A copy of the ``vllm_ext`` package at ``src`` under ``dest`` (no caches)."""
    out = dest / "vllm_ext"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return out


_REG_BLOCKS = (
    "            block_ids=block_ids,  # (made for this record above)\n            p_engine_id="
)

MUTANTS = (
    Mutant(
        name="d-registers-shifted-blocks",
        about="D registers every block b as b + 1: request 0's KV lands in request 1's block",
        path="nixl_push/scheduler.py",
        original=_REG_BLOCKS,
        mutated=_REG_BLOCKS.replace("=block_ids,", "=[[b + 1 for b in g] for g in block_ids],"),
        caught_by=("tests/integration/test_push_flow.py",),
    ),
    Mutant(
        name="d-registers-reversed-blocks",
        about="D registers its blocks in reverse order: each block gets another position's KV",
        path="nixl_push/scheduler.py",
        original=_REG_BLOCKS,
        mutated=_REG_BLOCKS.replace("=block_ids,", "=[g[::-1] for g in block_ids],"),
        caught_by=("tests/integration/test_push_flow.py",),
    ),
    Mutant(
        name="completion-accepted-after-push-fail",
        about="a producer's completion after another's PUSH_FAIL wipes the failure: D serves "
        "a request part of whose KV was never written",
        path="nixl_push/lifecycle.py",
        original="        self.answered.add(sender)\n        if failure == CANCELLED_REASON:",
        mutated="        self.answered.add(sender)\n        if failure is None:\n"
        "            self.failure = None\n        if failure == CANCELLED_REASON:",
        # (on the integration path a failed WRITE's notice fails the request in vLLM
        # first, N-REL-2; the rule itself is PushRecv's)
        caught_by=("tests/unit/test_lifecycle.py",),
    ),
    Mutant(
        name="refused-release-taken-as-stop",
        about="NIXL refuses to release a WRITE that still runs, and the writer takes it as "
        "stopped: P frees its blocks and D its own while the WRITE may still land",
        path="nixl_push/dlinks.py",
        original='            logger.debug("push: releasing a WRITE handle failed: %s", e)\n'
        "            return False",
        mutated='            logger.debug("push: releasing a WRITE handle failed: %s", e)\n'
        "            return True",
        caught_by=("tests/integration/test_push_safety.py",),
    ),
    Mutant(
        name="prompt-key-without-adapter",
        about="the prompt key leaves out the LoRA adapter: P writes one adapter's KV into "
        "a registration for the same tokens under another (S-WRT-7)",
        path="compat.py",
        original="        extra.append(f\"lora:{getattr(lora, 'lora_name', '')}:{files}\")",
        mutated="        pass",
        caught_by=("tests/integration/test_push_prompt_key.py",),
    ),
    Mutant(
        name="prompt-key-adapter-name-only",
        about="the prompt key names the LoRA adapter but not its files: one adapter name "
        "holding other weights on P than on D gets P's KV (S-WRT-7)",
        path="compat.py",
        original='        files = adapter_digest(str(path)) if path else ""',
        mutated='        files = ""',
        caught_by=("tests/integration/test_push_prompt_key.py",),
    ),
    Mutant(
        name="first-write-end-unpins",
        about="the first of a request's running WRITEs to end unpins its blocks: at the "
        "lease cap vLLM gets them back while another WRITE still reads them",
        path="nixl_push/leases.py",
        original="            if left > 0:\n                self._running[request_id] = left",
        mutated="            if False:\n                self._running[request_id] = left",
        caught_by=("tests/integration/test_push_write_pins.py",),
    ),
    Mutant(
        name="streaming-write-not-active",
        about="a Write with a chunk WRITE in flight does not count as active: P reports the "
        "request sent when the other D ranks' WRITEs ended, while the chunk still reads",
        path="nixl_push/send_lifecycle.py",
        original="        return [w for w in self.writes if not w.state.final]",
        mutated="        return [w for w in self.writes if not w.state.final"
        " and w.state is not WriteState.STREAMING]",
        caught_by=("tests/integration/test_push_write_pins.py",),
    ),
    Mutant(
        name="stale-chunk-counted",
        about="a chunk WRITE that ends after its request was preempted counts toward it: "
        "the last WRITE skips the blocks it wrote from reused ones",
        path="nixl_push/writes.py",
        original="        w.chunk_done(count=not send.whole)",
        mutated="        w.chunk_done(count=True)",
        caught_by=("tests/integration/test_push_progressive.py",),
    ),
    Mutant(
        name="retired-d-agent-unanswered",
        about="P no longer answers a D agent it retired on a restart (another engine under "
        "the engine id): that engine keeps those requests' blocks quarantined while P lives",
        path="nixl_push/d_agents.py",
        original="        return entry is not None and agent in entry.retired",
        mutated="        return False",
        caught_by=("tests/integration/test_push_engine_id_slip.py",),
    ),
    Mutant(
        name="registrations-kept-on-heal",
        about="P keeps D's registrations when it drops its failed connection to D: after "
        "a partition D counted P gone and reused the blocks, P writes them (N-LIV-1)",
        path="nixl_push/dlinks.py",
        original="            self._end_unwritten(engine_id, why)\n",
        mutated="            pass\n",
        caught_by=(
            "tests/integration/test_push_liveness.py::"
            "test_a_registration_p_holds_across_a_partition_is_answered_never_written",
        ),
    ),
    Mutant(
        name="registrations-kept-on-heal-model-check",
        about="registrations-kept-on-heal, for the model check on its own: its partitions "
        "must find P writing a kept registration into blocks D gave away",
        path="nixl_push/dlinks.py",
        original="            self._end_unwritten(engine_id, why)\n",
        mutated="            pass\n",
        caught_by=(
            "tests/integration/test_push_modelcheck.py::test_push_is_safe[PartitionsWhileRenewed]",
        ),
    ),
    Mutant(
        name="gone-before-p-ttl",
        about="D counts a silent P gone while P may still hold a registration it never "
        "renewed: P serves it after the link returns, into blocks vLLM reused (N-LIV-1)",
        path="nixl_push/recv.py",
        original="            and (a in recv.renewed_by or now >= recv.unrenewed_held_until)\n",
        mutated="            and True\n",
        caught_by=(
            "tests/integration/test_push_liveness.py::"
            "test_d_keeps_the_blocks_while_p_may_hold_a_registration_it_never_renewed",
        ),
    ),
    Mutant(
        name="renewed-registration-outlives-its-request",
        about="P keeps a registration it renewed after the P request that awaited it "
        "ended: D's count on P's TTL no longer holds for it (N-LIV-1)",
        path="nixl_push/matching.py",
        original="                if now > ends or (p.renewed and id(p) not in awaited):\n",
        mutated="                if now > ends:\n",
        caught_by=(
            "tests/integration/test_push_liveness.py::"
            "test_a_renewed_registration_ends_with_the_p_request_that_awaited_it",
        ),
    ),
)
