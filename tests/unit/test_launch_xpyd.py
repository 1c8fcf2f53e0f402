# SPDX-License-Identifier: Apache-2.0
"""xPyD engines start in waves, no two of a wave on one core."""

from __future__ import annotations

from devkit.launch.engine import EngineSpec
from devkit.launch.xpyd import start_waves


def _names(waves: list[list[EngineSpec]]) -> list[list[str]]:
    return [[s.name for s in w] for w in waves]


def _spec(name: str, cpu: int | None) -> EngineSpec:
    return EngineSpec(name=name, model="m", port=1, cpu=cpu)


def test_each_pair_of_2p2d_starts_in_a_wave_of_its_own() -> None:
    specs = [_spec("P0", 0), _spec("P1", 0), _spec("D0", 1), _spec("D1", 1)]
    assert _names(start_waves(specs)) == [["P0", "D0"], ["P1", "D1"]]


def test_engines_bound_to_no_core_start_at_once() -> None:
    specs = [_spec("P0", None), _spec("P1", None), _spec("D0", 1), _spec("D1", None)]
    assert _names(start_waves(specs)) == [["P0", "P1", "D0", "D1"]]


def test_more_engines_than_cores_start_as_soon_as_their_core_is_free_of_starts() -> None:
    specs = [_spec("P0", 0), _spec("P1", 1), _spec("P2", 0), _spec("D0", 1), _spec("D1", 1)]
    assert _names(start_waves(specs)) == [["P0", "P1"], ["P2", "D0"], ["D1"]]
