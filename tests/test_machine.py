"""The differential state machines, short and deterministic (CI profile)."""

import pytest
from hypothesis import settings

from fuzz.campaign import machine_for

CONFIGS = [("dense", "fp16", True), ("dense", "fp16", False), ("dense", "int8", True), ("rotating", "fp16", True),
           ("rotating", "fp16", False)]


@pytest.mark.parametrize("kind,mode,inplace", CONFIGS)
def test_state_machine_agrees(kind, mode, inplace):
    machine = machine_for(kind, mode, inplace)
    # the loaded profile (ci, or mutation under `make mutation`), longer runs
    machine.TestCase.settings = settings(settings.default, max_examples=40, stateful_step_count=30)
    machine.TestCase().runTest()
    # the run must actually have reached the edges it is there for
    assert machine.stats.get("copying writes", 0) > 0
    if inplace and mode == "fp16":
        assert machine.stats.get("in-place writes", 0) > 0
    # names used wrongly (misuse_name) reach the refusals of the named ops
    named = ("snapshot", "restore", "drop", "detach", "install")
    assert sum(machine.stats.get("refused " + op, 0) for op in named) > 0, machine.stats
