"""More tests of the program engine (fuzz/program.py) and its campaign
plumbing (fuzz/campaign.py): each fails with a plausible bug the first
suite let through (breaker16)."""

from __future__ import annotations

import warnings
from typing import ClassVar

import pytest
from hypothesis import strategies as st
from hypothesis.errors import UnsatisfiedAssumption
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, rule

from kvspec.fuzz import campaign, program
from kvspec.fuzz.lockstep import Divergence
from kvspec.fuzz.program import CHUNK, Reader, run_program
from tests.test_program_engine import Toy, program_of, rule_byte


def reader(*data: int) -> Reader:
    buf = bytes(data)
    return Reader(buf, 0, len(buf))


def test_a_consumed_bundle_item_is_gone():
    Toy.log, Toy.torn = [], 0
    with_item = ["boom", "take", "add"]
    # add 1, take it; the bundle is empty again: byte 3 is add, not take
    prog = program_of([0], [[rule_byte("add", ["boom", "add"]), 17], [rule_byte("take", with_item), 0],
                            [rule_byte("add", ["boom", "add"]), 18]])
    assert run_program(Toy, prog, 3) == 3
    assert [e for e in Toy.log if e[0] != "inv"] == [("init", 0), ("add", 1), ("take", 1), ("add", 2)]


def test_every_byte_of_a_chunk_feeds_the_rule():
    class Wide(RuleBasedStateMachine):
        got: ClassVar[list] = []

        @rule(vs=st.lists(st.integers(0, 200), min_size=CHUNK - 1, max_size=CHUNK - 1))
        def wide(self, vs):
            type(self).got.append(vs)

    Wide.got = []
    # the list's size is fixed (no size byte): the chunk's 11 other bytes are its elements
    run_program(Wide, program_of([], [[2] + [16 + k for k in range(1, CHUNK)], [2] + [99] * (CHUNK - 1)]), 2)
    assert Wide.got == [list(range(1, CHUNK)), [83] * (CHUNK - 1)]


@pytest.mark.parametrize("lo,hi", [(-300, 700), (0, 1000)])
def test_a_two_byte_range_is_covered(lo, hi):
    seen = {reader(b, t).draw(st.integers(lo, hi)) for b in range(16, 256) for t in range(256)}
    assert seen == set(range(lo, hi + 1))


def test_unique_lists_and_sets_hold_no_duplicates():
    # size byte 2: the range's top edge (3); elements 0, 0, 1, 2
    got = reader(2, 16, 16, 17, 18).draw(st.lists(st.integers(0, 3), max_size=3, unique=True))
    assert got == [0, 1, 2]
    assert reader(2, 17, 17, 18, 19).draw(st.sets(st.integers(0, 3), max_size=3)) == {1, 2, 3}


def test_a_swarm_flag_at_the_cut_leaves_the_rule_in():
    # level 138: p = 10, cut = 245; a flag above the cut leaves its rule out
    assert program._enabled(bytes([138, 245, 246, 0]) + bytes(60), 3) == [True, False, True]


def test_no_enabled_rule_valid_falls_back_to_the_valid_ones():
    Toy.log = []
    # boom and add left out; never and take in, but neither is valid now
    run_program(Toy, program_of([0], [[rule_byte("add", ["boom", "add"]), 17]], swarm=[255, 255, 0, 0, 255]), 1)
    assert ("add", 1) in Toy.log


class InitTarget(RuleBasedStateMachine):
    items = Bundle("items")
    log: ClassVar[list] = []

    @initialize(target=items, n=st.integers(0, 9))
    def init(self, n):
        return n

    @rule(v=consumes(items))
    def take(self, v):
        type(self).log.append(v)


def test_an_initialize_rule_s_result_goes_to_its_bundle():
    InitTarget.log = []
    assert run_program(InitTarget, program_of([21], [[2], [2]]), 2) == 1
    assert InitTarget.log == [5]


def test_a_filter_that_never_passes_rejects_the_example():
    class Picky(RuleBasedStateMachine):
        @rule(v=st.integers(0, 9).filter(lambda v: str(v) == "x"))
        def pick(self, v):
            raise AssertionError("a filtered-out value was drawn")

    test = program.get_program_test(Picky, campaign.fuzz_settings(1, 1), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UnsatisfiedAssumption):
            test.hypothesis.inner_test(program_of([], [[2]]))


def test_the_engine_comes_from_kvspec_engine(monkeypatch):
    monkeypatch.setenv("KVSPEC_ENGINE", "stateful")
    assert campaign.default_engine() == "stateful"
    assert campaign.Campaign("dense", "fp16", True, 1).engine == "stateful"
    monkeypatch.setenv("KVSPEC_ENGINE", " ")
    assert campaign.default_engine() == "program"
    monkeypatch.delenv("KVSPEC_ENGINE")
    assert campaign.default_engine() == "program"


def test_run_share_hands_its_engine_to_the_campaigns(monkeypatch):
    got = []
    monkeypatch.setattr(campaign, "interleaved", lambda camps, budget, *a, **k: got.extend(camps) or [])
    monkeypatch.setenv("KVSPEC_ENGINE", "program")
    campaign.run_share([("dense", "fp16", True, 1)], 1.0, engine="stateful")
    assert [c.engine for c in got] == ["stateful"]


def test_run_machine_runs_the_engine_it_is_given(monkeypatch):
    calls = []
    real = campaign.get_program_test
    monkeypatch.setattr(campaign, "get_program_test", lambda *a, **k: calls.append(1) or real(*a, **k))
    machine = campaign.machine_for("dense", "fp16", True)
    campaign.run_machine(machine, 1, max_examples=2, steps=3, engine="stateful")
    assert calls == []
    campaign.run_machine(machine, 1, max_examples=2, steps=3, engine="program")
    assert calls == [1]


class FakeLock:
    """Diverges at a "boom" op: with the check "bad N" after an "arm" op,
    else with another check."""

    def __init__(self, *args, **kwargs):
        self.armed = False

    def step(self, i, op):
        if op["op"] == "arm":
            self.armed = True
        if op["op"] == "boom":
            raise Divergence(i, op, f"bad {i}" if self.armed else "unarmed", None, None)


def test_reduce_run_keeps_only_what_makes_the_same_failure(monkeypatch):
    monkeypatch.setattr(campaign, "make_lockstep", FakeLock)
    machine = campaign.machine_for("dense", "fp16", True)
    ops = [{"op": "x", "k": 0}, {"op": "arm"}, {"op": "x", "k": 1}, {"op": "x", "k": 2}, {"op": "x", "k": 3},
           {"op": "boom"}, {"op": "x", "k": 4}]
    machine.last_run = ({"mode": "fp16"}, ops)
    got = campaign.reduce_run(machine, Divergence(5, ops[5], "bad 5", None, None), 10.0)
    assert machine.last_run[1] == [{"op": "arm"}, {"op": "boom"}]
    assert got.what == "bad 1" and got.index == 1


@pytest.mark.parametrize("command", ["verify", "mutants"])
def test_a_bad_kvspec_engine_is_exit_2_for_verify_and_mutants(command):
    import os
    import subprocess
    import sys

    env = {**os.environ, "KVSPEC_ENGINE": "fast"}
    try:
        bad = subprocess.run([sys.executable, "-m", "kvspec.fuzz.commands.cli", command], check=False, capture_output=True,
                             text=True, timeout=20, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvspec {command} ran with KVSPEC_ENGINE='fast'")
    assert bad.returncode == 2 and "KVSPEC_ENGINE='fast'" in bad.stdout + bad.stderr
