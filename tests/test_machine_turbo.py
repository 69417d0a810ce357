"""The Turbo state machine, short and deterministic (CI profile): it agrees
with the spec and reaches the edges it is there for."""

import pytest
from hypothesis import settings

from fuzz.campaign import machine_for


@pytest.mark.parametrize("mode", ["turbo4asym", "turbo4", "turbo3asym", "turbo4delegated"])
def test_turbo_state_machine_agrees(mode):
    machine = machine_for("dense", mode, True)
    machine.TestCase.settings = settings(settings.default, max_examples=40, stateful_step_count=30)
    machine.TestCase().runTest()
    stats = machine.stats
    assert stats.get("copying writes", 0) > 0 and stats.get("in-place writes", 0) == 0
    assert stats.get("physical trim", 0) > 0
    assert stats.get("refused append", 0) > 0  # a head_dim the quantizer refuses
    if mode == "turbo4delegated":
        assert stats.get("handoff fold", 0) > 0 and stats.get("block fold", 0) > 0
        assert stats.get("refused gather_positions", 0) > 0
