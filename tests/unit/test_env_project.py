# SPDX-License-Identifier: Apache-2.0
"""How an env holds this project (``tools/envs.py build --project``): the CI envs'
stamps stay what they were (no rebuild of an existing env), the image's two steps
(``none`` then ``runtime``) share one base env, and each mode installs what it says."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import REPO, envs


def _stamps() -> dict[str, dict]:
    pins = envs.load_pins()
    pin = pins["pins"]["0.32.0"]
    return {mode: envs._stamp("0.32.0", pin, pins, mode) for mode in envs.PROJECT_MODES}


def test_the_dev_stamp_is_the_one_existing_envs_carry() -> None:
    # before --project, "project" was the hash of the two pyproject.toml files alone
    assert _stamps()["dev"]["project"] == envs._sha(
        [REPO / "pyproject.toml", REPO / "devkit" / "pyproject.toml"]
    )


def test_modes_differ_in_the_project_install_only() -> None:
    stamps = _stamps()
    for mode, stamp in stamps.items():
        rest = {k: v for k, v in stamp.items() if k != "project"}
        assert rest == {k: v for k, v in stamps["dev"].items() if k != "project"}, mode
    assert len({s["project"] for s in stamps.values()}) == len(envs.PROJECT_MODES)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("dev", [["-e", f"{REPO}[dev]"], ["-e", f"{REPO / 'devkit'}[bench]"]]),
        ("runtime", [[str(REPO)]]),
        ("none", []),
    ],
)
def test_each_mode_installs_what_it_says(mode: str, expected: list[list[str]]) -> None:
    calls: list[list[str]] = []

    class Recorder(envs.Builder):
        def pip(self, *args: str, what: str) -> str:
            calls.append(list(args))
            return ""

    pins = envs.load_pins()
    b = Recorder("0.32.0", pins["pins"]["0.32.0"], pins, verbose=False, project=mode)
    b.install_project()
    assert calls == expected
    assert isinstance(b.env, Path)
