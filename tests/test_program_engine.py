"""The program engine (fuzz/program.py): the byte decoder's values, the
rule runner's order, swarm flags, bundles and teardown, and the engine in
campaigns (a catalog bug caught, a failing run reduced op by op)."""

from __future__ import annotations

import subprocess
import sys
from typing import ClassVar

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvspec.fuzz import program
from kvspec.fuzz.program import CHUNK, HEADER, SKIP, STOP, Reader, run_program


def reader(*data: int) -> Reader:
    buf = bytes(data)
    return Reader(buf, 0, len(buf))


def test_zero_bytes_are_every_strategy_s_simplest_value():
    # Hypothesis shrinks towards zero bytes: they must be the simplest choice
    assert reader(0).draw(st.integers(-1, 4)) == 0
    assert reader(0).draw(st.integers(3, 9)) == 3
    assert reader(0).draw(st.integers(-9, -3)) == -3
    assert reader(0).draw(st.booleans()) is False
    assert reader(0).draw(st.sampled_from(["a", "b", "c"])) == "a"
    assert reader(0).draw(st.one_of(st.just(7), st.integers(1, 9))) == 7
    assert reader(0, 0).draw(st.lists(st.integers(0, 3), max_size=4)) == []
    assert reader().draw(st.integers(2, 5)) == 2  # past the end: zeros


def test_edge_bytes_pick_the_range_s_ends():
    assert [reader(b).draw(st.integers(-1, 4)) for b in (1, 2, 3, 4)] == [-1, 4, 0, 3]
    assert [reader(b).draw(st.integers(5, 5)) for b in (1, 2, 3, 4)] == [5, 5, 5, 5]


@pytest.mark.parametrize("lo,hi", [(-1, 4), (1, 8), (0, 255), (0, 256), (-300, 700), (0, 70000)])
def test_every_byte_decodes_inside_the_range_and_the_range_is_covered(lo, hi):
    seen = set()
    nbytes = 1 if hi - lo + 1 <= 256 else 2 if hi - lo + 1 <= 65536 else 4
    for b in range(256):
        for tail in ((0,) * (nbytes - 1), (255,) * (nbytes - 1), (7,) * (nbytes - 1)):
            v = reader(b, *tail).draw(st.integers(lo, hi))
            assert lo <= v <= hi
            seen.add(v)
    if hi - lo + 1 <= 240:
        assert seen == set(range(lo, hi + 1))


def test_collections_maps_filters_and_composites():
    r = reader(*([3] + [16, 17, 16, 18, 19] + [0] * 10))
    got = r.draw(st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True))
    assert got == sorted(set(got), key=got.index) and 1 <= len(got) <= 3  # unique
    assert reader(16, 17, 18).draw(st.sets(st.integers(0, 3), max_size=3).map(sorted)) in ([], [0], [0, 1], [1])
    assert reader(17).draw(st.integers(0, 9).map(lambda v: v * 10)) == 10
    assert reader(17, 18).draw(st.integers(0, 9).filter(lambda v: v % 2 == 0)) == 2

    @st.composite
    def pair(draw):
        return draw(st.integers(0, 3)), draw(st.booleans())

    assert reader(18, 1).draw(pair()) == (2, True)


def test_a_strategy_it_cannot_decode_is_named():
    with pytest.raises(TypeError, match="cannot draw from .*floats"):
        reader(1).draw(st.floats())


class Toy(RuleBasedStateMachine):
    """A machine that records what ran."""

    items = Bundle("items")
    log: ClassVar[list] = []
    torn = 0

    @initialize(n=st.integers(0, 3))
    def init(self, n):
        type(self).log.append(("init", n))

    @rule(target=items, v=st.integers(0, 9))
    def add(self, v):
        type(self).log.append(("add", v))
        return v

    @rule(v=consumes(items))
    def take(self, v):
        type(self).log.append(("take", v))

    @precondition(lambda self: False)
    @rule()
    def never(self):
        raise AssertionError("a rule whose precondition is False ran")

    @rule()
    def boom(self):
        raise RuntimeError("boom")

    @invariant()
    def seen(self):
        type(self).log.append(("inv",))

    def teardown(self):
        type(self).torn += 1


def program_of(init: list[int], steps: list[list[int]], swarm: list[int] | None = None) -> bytes:
    buf = bytearray(HEADER + CHUNK * len(steps))
    for i, b in enumerate(swarm or []):
        buf[i] = b
    buf[program.SWARM:program.SWARM + len(init)] = bytes(init)
    for k, chunk in enumerate(steps):
        buf[HEADER + CHUNK * k:HEADER + CHUNK * k + len(chunk)] = bytes(chunk)
    return bytes(buf)


def rule_byte(name: str, live: list[str]) -> int:
    return 2 + live.index(name)


def test_the_runner_runs_init_then_the_chosen_rules_with_bundles_and_invariants():
    Toy.log, Toy.torn = [], 0
    # rules in Hypothesis's order: no target first (boom, never, take), then add
    order = [r.function.__name__ for r in program._rules(Toy)[0]]
    assert order == ["boom", "never", "take", "add"]
    live_empty = ["boom", "add"]  # take needs an item, never's precondition is False
    prog = program_of([18], [[rule_byte("add", live_empty), 21], [SKIP, 99],
                             [rule_byte("take", ["boom", "take", "add"]), 0], [STOP], [rule_byte("boom", live_empty)]])
    assert run_program(Toy, prog, 5) == 2
    assert Toy.log == [("init", 2), ("inv",), ("add", 5), ("inv",), ("take", 5), ("inv",)]
    assert Toy.torn == 1


def test_teardown_runs_when_a_rule_raises_and_the_error_propagates():
    Toy.log, Toy.torn = [], 0
    with pytest.raises(RuntimeError, match="boom"):
        run_program(Toy, program_of([0], [[2]]), 1)
    assert Toy.torn == 1


def test_swarm_flags_leave_rules_out_and_zero_bytes_leave_them_in():
    assert program._enabled(bytes(64), 4) == [True] * 4
    assert program._enabled(bytes([127, 255, 255, 255, 255] + [0] * 59), 4) == [True] * 4
    flags = program._enabled(bytes([255, 255, 0, 200, 127] + [0] * 59), 4)
    assert flags == [False, True, False, True]  # cut at 255 - 127 = 128
    Toy.log = []
    # boom left out: the step's byte picks among the rest (add)
    run_program(Toy, program_of([0], [[2, 17]], swarm=[255, 255]), 1)
    assert ("add", 1) in Toy.log


def test_the_program_test_has_its_own_database_key():
    from hypothesis.stateful import get_state_machine_test

    from kvspec.fuzz.campaign import fuzz_settings

    a = program.get_program_test(Toy, fuzz_settings(2, 3), 3)
    b = get_state_machine_test(Toy, settings=fuzz_settings(2, 3))
    key = "_hypothesis_internal_add_digest"
    assert getattr(a.hypothesis.inner_test, key) != getattr(b.hypothesis.inner_test, key)


def test_engine_names_are_checked():
    from kvspec.fuzz.campaign import ENGINES, check_engine
    from kvspec.fuzz.commands.cli import ENGINE_CHOICES

    assert set(ENGINES) == set(ENGINE_CHOICES)
    with pytest.raises(ValueError, match="engine 'fast': not one of stateful, program"):
        check_engine("fast")


def test_a_bad_engine_is_exit_2_on_the_cli():
    import os

    bad = subprocess.run([sys.executable, "-m", "kvspec.fuzz.commands.cli", "fuzz", "--engine", "fast", "--budget", "1"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--engine" in bad.stderr and "Traceback" not in bad.stderr
    env = {**os.environ, "KVSPEC_ENGINE": "fast"}
    bad = subprocess.run([sys.executable, "-m", "kvspec.fuzz.commands.cli", "fuzz", "--budget", "1", "--kind", "dense"],
                         check=False, capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "KVSPEC_ENGINE='fast'" in bad.stdout + bad.stderr


def test_a_program_campaign_runs_the_harness_and_catches_a_catalog_bug(tmp_path):
    from kvspec.fuzz.bugs import by_name
    from kvspec.fuzz.campaign import catch_bug, machine_for, run_machine

    result = run_machine(machine_for("dense", "fp16", True), seed=3, max_examples=4, steps=10, engine="program")
    assert not result.failed and result.examples >= 4 and result.steps > 10
    assert result.stats.get("ops", 0) == result.steps
    got = catch_bug(by_name("inplace_after_trim"), 1, 200, tmp_path, shrink=False)
    assert got.caught and got.alarm is None and got.examples <= 200


def test_a_failing_run_is_reduced_op_by_op():
    from kvspec.fuzz.bugs import by_name
    from kvspec.fuzz.campaign import machine_for, reduce_run, run_machine
    from kvspec.fuzz.lockstep import Divergence
    from kvspec.fuzz.replay import make_lockstep

    bug = by_name("negative_trim_grows_offset")
    machine = machine_for(bug.kind, bug.modes[0], bug.inplace, bug.factories)
    result = run_machine(machine, 1, max_examples=200, shrink=False, engine="program")
    assert result.failed and isinstance(result.error, Divergence)
    cfg, ops = machine.last_run
    # pad the failing run with ops that do not matter (decodes, fetches)
    padded = [{"op": "fetch"}, {"op": "append", "n": 1}, {"op": "fetch"}] + ops[: result.error.index] + \
        [{"op": "fetch"}, ops[result.error.index]]
    machine.last_run = (cfg, padded)
    lock = make_lockstep({**cfg, "kind": bug.kind}, bug.factories)
    with pytest.raises(Divergence) as first:
        for i, op in enumerate(padded):
            lock.step(i, op)
    reduced = reduce_run(machine, first.value, 30.0)
    _, kept = machine.last_run
    assert len(kept) < len(padded) and kept[-1]["op"] == "trim" and kept[-1]["n"] < 0
    assert reduced.what == first.value.what
    # on the real implementation the reduced run passes
    from kvspec.fuzz.replay import make_lockstep as real

    clean = real({**cfg, "kind": bug.kind})
    for i, op in enumerate(kept):
        clean.step(i, op)
