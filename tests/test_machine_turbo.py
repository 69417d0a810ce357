"""The Turbo state machine, short and deterministic (CI profile): it agrees
with the spec and reaches the edges it is there for."""

import pytest
from hypothesis import settings

from kvspec.fuzz.campaign import machine_for
from tests.budget import examples


@pytest.mark.parametrize("mode", ["turbo4asym", "turbo4", "turbo3asym", "turbo4delegated"])
def test_turbo_state_machine_agrees(mode):
    machine = machine_for("dense", mode, True)
    machine.TestCase.settings = settings(settings.default, max_examples=examples(40), stateful_step_count=30)
    machine.TestCase().runTest()
    stats = machine.stats
    assert stats.get("copying writes", 0) > 0 and stats.get("in-place writes", 0) == 0
    assert stats.get("physical trim", 0) > 0
    if mode == "turbo4delegated":
        assert stats.get("handoff fold", 0) > 0 and stats.get("block fold", 0) > 0
        assert stats.get("refused gather_positions", 0) > 0


@pytest.mark.parametrize("mode,head_dim,rule", [
    ("turbo3asym", 4, "multiple of 8"), ("turbo4asym", 12, "power of two"), ("turbo4", 24, "power of two"),
    ("turbo4delegated", 1, "power of two"),
])
def test_a_head_dim_the_quantizer_refuses_is_refused_alike(mode, head_dim, rule):
    """Spec and implementation refuse every append, with the same message,
    and nothing changes (the fuzzer draws such head dims now and then)."""
    from kvspec.fuzz.replay import replay
    from kvspec.fuzz.trace import parse

    doc = {"kvtrace": 1, "cache": {"kind": "dense", "mode": mode, "step": 2, "head_dim": head_dim},
           "ops": [{"op": "append", "n": 2, "error": True}, {"op": "append", "n": 1, "error": True},
                   {"op": "trim", "n": 1, "returns": 0, "capacity": 0}, {"op": "expect", "window": []}]}
    result = replay(parse(doc))
    assert result.ok, result.divergence
    assert len(result.refusals) == 2 and all(rule in msg for _, msg in result.refusals)
