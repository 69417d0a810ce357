"""The op-level shrinker (kvspec.fuzz.campaign's reduce_run, shrink_run and their
parts) against fake locksteps whose failures are known by construction,
and, for a few catalog rows, against the traces shipped in tests/traces."""

import json
from pathlib import Path

import pytest

from kvspec.fuzz import campaign
from kvspec.fuzz.lockstep import Divergence


def _fake(rule):
    """A make_lockstep stand-in: ``rule(seen, i, op)`` (``seen`` the op
    names stepped before) returns a check's text to diverge with, or None."""

    class Lock:
        def __init__(self, *args, **kwargs):
            self.seen = []

        def step(self, i, op):
            what = rule(self.seen, i, op)
            self.seen.append(op["op"])
            if what is not None:
                raise Divergence(i, op, what, None, None)

    return Lock


def _shrink(monkeypatch, how, machine, error):
    """reduce_run, or shrink_run with kvspec.fuzz.trace's schema check off (the
    fake ops are no kvtrace)."""
    if how == "reduce_run":
        return campaign.reduce_run(machine, error, 10.0)
    monkeypatch.setattr(campaign, "parse", lambda trace: None)
    return campaign.shrink_run(machine, error, 10.0)


def _machine(ops):
    machine = campaign.machine_for("dense", "fp16", True)
    machine.last_run = ({"mode": "fp16"}, ops)
    return machine


def test_the_same_failure_is_the_same_op_and_check_up_to_numbers():
    a = Divergence(3, {"op": "append", "n": 2}, "offset 7 != 5", None, None)
    assert campaign._signature(a) == campaign._signature(Divergence(0, {"op": "append"}, "offset 1 != -2", None, None))
    assert campaign._signature(a) != campaign._signature(Divergence(3, {"op": "trim"}, "offset 7 != 5", None, None))
    assert campaign._signature(a) != campaign._signature(Divergence(3, {"op": "append"}, "length 7 != 5", None, None))


@pytest.mark.parametrize("how", ["reduce_run", "shrink_run"])
def test_a_failure_at_another_op_with_the_same_check_is_not_the_same_failure(monkeypatch, how):
    """[guard, early, boom] fails at boom ("bad 2"); deleting guard makes
    early fail first with the same check text ("bad 0"), at another op: the
    reduced run must still fail at boom."""

    def rule(seen, i, op):
        if op["op"] == "early" and "guard" not in seen:
            return f"bad {i}"
        if op["op"] == "boom" and "early" in seen:
            return f"bad {i}"
        return None

    monkeypatch.setattr(campaign, "make_lockstep", _fake(rule))
    ops = [{"op": "guard"}, {"op": "early"}, {"op": "boom"}]
    machine = _machine(ops)
    error = Divergence(2, ops[2], "bad 2", None, None)
    got = _shrink(monkeypatch, how, machine, error)
    assert got.op == {"op": "boom"} and got.what == "bad 2"
    assert machine.last_run[1] == ops
    replays = campaign._Replays(machine, error)
    assert replays.diverges({"mode": "fp16"}, [{"op": "early"}, {"op": "boom"}]) is None


@pytest.mark.parametrize("how", ["reduce_run", "shrink_run"])
def test_deletion_passes_repeat_until_no_single_op_can_go(monkeypatch, how):
    """[a, b, boom]: b can go only once a has gone (boom fails unless a ran
    without b), so one pass of single deletions leaves [b, boom]; the
    result is one-minimal: [boom]."""

    def rule(seen, i, op):
        if op["op"] == "boom" and not ("a" in seen and "b" not in seen):
            return "bad"
        return None

    monkeypatch.setattr(campaign, "make_lockstep", _fake(rule))
    ops = [{"op": "a"}, {"op": "b"}, {"op": "boom"}]
    machine = _machine(ops)
    got = _shrink(monkeypatch, how, machine, Divergence(2, ops[2], "bad", None, None))
    assert machine.last_run[1] == [{"op": "boom"}] and got.index == 0


def _simpler_ints(n):
    """The integers simpler than ``n``, simplest first, by the documented
    rule (written out here, not taken from the module): 0, 1, half and one
    less, in magnitude, with n's sign, each nearer 0 than n."""
    size, sign = abs(n), (1 if n > 0 else -1)
    return [sign * v for v in sorted({0, 1, size // 2, size - 1}) if 0 <= v < size]


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 100, -1, -2, -9])
def test_simpler_integers_are_zero_one_half_and_one_less(n):
    want = {0: [], 1: [0], 2: [0, 1], 3: [0, 1, 2], 4: [0, 1, 2, 3], 5: [0, 1, 2, 4], 7: [0, 1, 3, 6],
            8: [0, 1, 4, 7], 100: [0, 1, 50, 99], -1: [0], -2: [0, -1], -9: [0, -1, -4, -8]}[n]
    assert campaign._simpler(n) == want == _simpler_ints(n)
    assert campaign._simpler({"op": "x", "name": 5, "n": n}) == [{"op": "x", "name": 5, "n": v} for v in want]


def test_shrink_run_finds_the_smallest_failing_integer_above_zero(monkeypatch):
    """boom fails only with n >= 5: shrunk from 100 (through 50, 25, 12, 6)
    it must stop at 5, which trying 0 alone never reaches."""

    def rule(seen, i, op):
        return "bad" if op["op"] == "boom" and op["n"] >= 5 else None

    monkeypatch.setattr(campaign, "make_lockstep", _fake(rule))
    ops = [{"op": "boom", "n": 100}]
    machine = _machine(ops)
    got = _shrink(monkeypatch, "shrink_run", machine, Divergence(0, ops[0], "bad", None, None))
    assert machine.last_run[1] == [{"op": "boom", "n": 5}] and got.op == {"op": "boom", "n": 5}


#: cheap catalog rows of different kinds, each with a shipped minimal trace
ROWS = ["cells_shift_delta_not_accumulated", "prefix_stale_key_kept_on_eviction", "rollback_beyond_coverage",
        "list_ring_casts_rows"]


@pytest.mark.parametrize("name", ROWS)
def test_mutants_seed_1_trace_is_no_longer_than_the_shipped_one(name, tmp_path):
    """What ``kvspec mutants`` writes for seed 1 of a row (its catch_seed,
    shrink on) has no more ops than tests/traces/<bug>.json."""
    from kvspec.fuzz.commands.mutants import catch_seed

    caught, _s, _e, path, alarm, _flaky = catch_seed(name, "", 1, 1000, str(tmp_path), True)
    assert caught and alarm is None and path is not None, alarm
    got = [op for op in json.loads(Path(path).read_text())["ops"] if op["op"] != "expect"]
    shipped = json.loads((Path(__file__).parent / "traces" / f"{name}.json").read_text())["ops"]
    shipped = [op for op in shipped if op["op"] != "expect"]
    assert len(got) <= len(shipped), (got, shipped)
