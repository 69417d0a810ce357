"""A divergence that Hypothesis cannot replay (FlakyFailure) is a tool
failure naming both answers (kvspec.fuzz.machine.FlakyVerdict), never a catch nor
a warning: one run of ops gave two answers, so the verdict was not a
function of the trace (issue 47: the flagship's isolation-only W=16 variant
diverged once at a trim and agreed on the replay, because the write layer's
host write raced a queued read; docs/fuzzing.md, "Determinism of a
verdict"). The run that diverged is still written as the trace."""

import pytest
from hypothesis.errors import FlakyFailure, FlakyStrategyDefinition

from kvspec.fuzz.bugs import InjectedBug
from kvspec.fuzz.campaign import catch_bug, machine_for, run_machine
from kvspec.fuzz.trace import load
from kvspec.impl.dense import KVCache


class TrimsOneMoreOnce(KVCache):
    """Trims one row too many, once in the process's life: the first run
    that reaches a trim diverges and no replay of it does (a stand-in for a
    divergence that depends on what the op sequence does not fix)."""

    fired = False

    def trim(self, n):
        if not TrimsOneMoreOnce.fired and isinstance(n, int) and 0 < n < self.offset:
            TrimsOneMoreOnce.fired = True
            return super().trim(n + 1)
        return super().trim(n)


BUG = InjectedBug("trims_one_more_once", "test", "test", "dense", ("fp16",), "KVCache.trim",
                  "one extra row trimmed, once", {"dense": TrimsOneMoreOnce})


def test_a_divergence_hypothesis_cannot_replay_is_a_tool_failure_with_both_answers(tmp_path):
    TrimsOneMoreOnce.fired = False
    got = catch_bug(BUG, 1, 200, tmp_path, shrink=False)
    assert got.caught and got.alarm is not None and "FlakyVerdict" in got.alarm, got
    assert got.flaky and got.flaky.startswith("flaky verdict (a tool failure, not a finding)")
    first, then = got.flaky.split(". Then: ")
    assert '{"op": "trim"' in first and "return value differs (spec says: 1; impl did: 2)" in first
    assert then.startswith("Hypothesis's replay of the example did not fail the same way (FlakyFailure)")
    assert then.endswith("run again here: spec and implementation agreed at every op (3 of 3)")
    # the trace is the run that diverged: it ends at the trim that went wrong
    trace = load(got.path)
    assert trace.ops[-1]["op"] == "trim" or any(op["op"] == "trim" for op in trace.ops)
    failing = [i for i, op in enumerate(trace.ops) if op["op"] == "trim" and "returns" in op]
    assert failing, "the failing op carries the spec's prediction"


def test_the_run_result_is_a_flaky_verdict_not_a_divergence():
    from kvspec.fuzz.machine import FlakyVerdict
    from kvspec.fuzz.replay import failure_status

    TrimsOneMoreOnce.fired = False
    machine = machine_for("dense", "fp16", True, {"dense": TrimsOneMoreOnce})
    result = run_machine(machine, 1, max_examples=200, shrink=False)
    assert result.failed and isinstance(result.error, FlakyVerdict) and result.flaky == str(result.error)
    assert failure_status(result.error) == "tool failure"
    assert result.trace is not None and result.trace.ops


def test_a_bug_caught_every_time_has_no_flaky_note(tmp_path):
    from kvspec.fuzz.bugs import by_name

    got = catch_bug(by_name("negative_trim_grows_offset"), 1, 200, tmp_path, shrink=False)
    assert got.caught and got.alarm is None and got.flaky is None


def test_verify_shows_a_flaky_catch_as_a_tool_failure(monkeypatch, tmp_path):
    from kvspec.fuzz.commands import mutants, verify

    monkeypatch.setattr(mutants, "catalog", lambda: (BUG,))
    TrimsOneMoreOnce.fired = False
    [check] = verify.check_bugs(str(tmp_path), 1)
    assert not check.ok and check.tool_failure and check.name == "bug trims_one_more_once"
    assert check.detail.startswith("seed 1: flaky verdict (a tool failure, not a finding)")
    assert "First: op " in check.detail and "Then: Hypothesis's replay" in check.detail and not check.warnings


def _fake_flaky_run(monkeypatch, flaky_type, first_error):
    """run_machine over a stand-in for Hypothesis's test: the first run
    failed at op 1 with ``first_error``, the replay (the last run) drew
    other ops, and Hypothesis raised ``flaky_type``."""
    from kvspec.fuzz import campaign

    cfg = {"kind": "dense", "mode": "fp16", "step": 2, "head_dim": 8}
    diverged = [{"op": "append", "n": 2}, {"op": "trim", "n": 1}]
    replayed = [{"op": "append", "n": 3}, {"op": "append", "n": 1}, {"op": "append", "n": 1}]

    def fake_test_for(machine, settings=None, steps=None):
        def test():
            machine.runs, machine.first_failure = 2, (1, 0.0)
            machine.first_error, machine.first_failure_run = first_error, (dict(cfg), [dict(op) for op in diverged])
            machine.last_run = (dict(cfg), [dict(op) for op in replayed])
            raise flaky_type("could not reproduce", [first_error])
        return test

    # either engine's test (kvspec.fuzz.program's takes the steps too)
    monkeypatch.setattr(campaign, "get_state_machine_test", fake_test_for)
    monkeypatch.setattr(campaign, "get_program_test", fake_test_for)
    return run_machine(machine_for("dense", "fp16", True), 1, max_examples=2, shrink=False), diverged


@pytest.mark.parametrize("flaky_type", [FlakyFailure, FlakyStrategyDefinition])
def test_a_flaky_divergence_is_the_diverging_run_s_trace_and_named_in_the_note(monkeypatch, flaky_type):
    # both of Hypothesis's Flaky errors count; the trace is the run that
    # diverged (not the replay, the last run); the note quotes the divergence
    from kvspec.fuzz.lockstep import Divergence
    from kvspec.fuzz.machine import FlakyVerdict

    div = Divergence(1, {"op": "trim", "n": 1}, "offset differs", 1, 0)
    result, diverged = _fake_flaky_run(monkeypatch, flaky_type, div)
    assert result.failed and isinstance(result.error, FlakyVerdict)
    assert result.flaky is not None and f"({flaky_type.__name__}" in result.flaky
    assert result.error.first == 'op 1 {"op": "trim", "n": 1}: offset differs (spec says: 1; impl did: 0)'
    # the second answer: the diverging run's ops on the real implementation agree
    assert result.error.again.endswith(f"its {len(diverged)} ops run again here: spec and implementation agreed "
                                       "at every op (3 of 3)")
    ran = [{"op": op["op"], "n": op["n"]} for op in result.trace.ops if op["op"] != "expect"]
    assert ran == diverged


def test_a_flaky_harness_fault_is_not_a_flaky_catch(monkeypatch):
    # only a divergence (or an invariant's assertion) seen once is a catch;
    # a harness that raised once is still Hypothesis's Flaky error
    result, _ = _fake_flaky_run(monkeypatch, FlakyFailure, RuntimeError("the driver broke"))
    assert result.flaky is None and isinstance(result.error, FlakyFailure)


@pytest.mark.parametrize("mode", ["turbo4", "turbo4delegated"])
def test_a_flaky_turbo_trace_records_only_its_mode_s_fields(mode):
    # hot_threshold and fold_block are Delegated's fields only: the run that
    # diverged (first_failure_run) drops them like teardown's last_run does
    machine = machine_for("dense", mode, True)
    real, fired = machine.make_lockstep, []

    def once(*args, **kwargs):
        lock = real(*args, **kwargs)
        step = lock.step

        def step_once(index, op):
            step(index, op)
            if not fired and op["op"] == "append":
                fired.append(index)
                raise AssertionError("fails once")
        lock.step = step_once
        return lock

    machine.make_lockstep = staticmethod(once)
    result = run_machine(machine, 1, max_examples=20, steps=5, shrink=False)
    assert result.flaky and result.trace is not None
    delegated = mode == "turbo4delegated"
    for cfg in (machine.first_failure_run[0], result.trace.cache):
        assert ("hot_threshold" in cfg) == delegated and ("fold_block" in cfg) == delegated, cfg


def test_every_flaky_seed_is_a_tool_failure(monkeypatch, tmp_path, capsys):
    import json

    from kvspec.fuzz.campaign import Catch
    from kvspec.fuzz.commands import mutants, verify
    from tests.test_reports import valid

    monkeypatch.setattr(mutants, "catalog", lambda: (BUG,))
    monkeypatch.setattr(mutants, "catch_bug", lambda bug, seed, *a, **k: Catch(
        True, 0.1, 3, tmp_path / "t.json", "the alarm" if seed != 2 else None,
        f"flaky in seed {seed}" if seed != 2 else None))
    [check] = verify.check_bugs(str(tmp_path), 3)
    assert not check.ok and check.tool_failure
    assert check.detail == f"seed 1: flaky in seed 1 (the run that diverged: {tmp_path / 't.json'}); " \
                           f"seed 3: flaky in seed 3 (the run that diverged: {tmp_path / 't.json'})"
    # kvspec mutants: exit 2, the entry a tool failure in the table and the JSON
    assert mutants.main(3, True, str(tmp_path)) == 2
    doc = valid("mutants", json.loads(capsys.readouterr().out))
    assert doc["exit"] == 2 and len(doc["mutants"][0]["tool_failures"]) == 2 and not doc["mutants"][0]["caught"]
    assert mutants.main(3, False, str(tmp_path)) == 2
    out = capsys.readouterr().out
    assert "TOOL FAILURE" in out and "tool failure trims_one_more_once: seed 1: flaky in seed 1" in out


def test_kvspec_fuzz_reports_a_flaky_verdict_as_a_tool_failure(monkeypatch, tmp_path, capsys):
    import json

    from kvspec.fuzz import campaign
    from kvspec.fuzz.commands.cli import main
    from kvspec.fuzz.machine import FlakyVerdict
    from kvspec.fuzz.trace import Trace
    from tests.test_reports import valid

    def fake_interleaved(camps, budget, progress=None):
        for c in camps:
            error = FlakyVerdict("op 1 {\"op\": \"trim\", \"n\": 1}: offset differs", "it agreed")
            trace = Trace(cache={"kind": "dense", "mode": "fp16", "step": 2}, ops=[{"op": "append", "n": 2}])
            c.report.examples, c.report.batches = 3, 1
            c.report.failure = campaign.RunResult(True, 0.1, 3, 4, error=error, trace=trace, flaky=str(error))

    monkeypatch.setattr(campaign, "interleaved", fake_interleaved)
    args = ["fuzz", "--kind", "dense", "--mode", "fp16", "--inplace", "on", "--budget", "1", "--seed", "1",
            "--db", "none", "--out", str(tmp_path)]
    assert main([*args, "--json"]) == 2
    doc = valid("fuzz", json.loads(capsys.readouterr().out))
    [row] = doc["runs"]
    assert row["result"] == "tool failure" and row["flaky"].endswith("First: op 1 {\"op\": \"trim\", \"n\": 1}: "
                                                                     "offset differs. Then: it agreed")
    assert main(args) == 2
    out = capsys.readouterr().out
    assert "tool failure" in out and "Then: it agreed" in out


class CapacityWrongOnceToTheInvariant(KVCache):
    """Reports a capacity below its live rows once, and only to the
    machine's invariant (``offsets_in_range``): no op diverges, the
    invariant fails in one run and never in its replay."""

    fired = False

    @property
    def capacity(self):
        import sys

        real = KVCache.capacity.fget(self)
        if (not CapacityWrongOnceToTheInvariant.fired and self.live_len > 1
                and sys._getframe(1).f_code.co_name == "offsets_in_range"):
            CapacityWrongOnceToTheInvariant.fired = True
            return 0
        return real


def test_an_invariant_failure_hypothesis_cannot_replay_is_a_tool_failure_too(tmp_path):
    bug = InjectedBug("capacity_wrong_once", "test", "test", "dense", ("fp16",), "KVCache.capacity",
                      "capacity below live_len once, to the invariant", {"dense": CapacityWrongOnceToTheInvariant})
    CapacityWrongOnceToTheInvariant.fired = False
    got = catch_bug(bug, 1, 200, tmp_path, shrink=False)
    assert CapacityWrongOnceToTheInvariant.fired
    assert got.caught and got.alarm is not None, got
    assert got.flaky and "FlakyFailure" in got.flaky and "First: " in got.flaky
    assert load(got.path).ops, "the trace is the run whose invariant failed"


def _invariant_raises(monkeypatch, error, mode="turbo4", machine=None):
    """A machine of ``mode`` (or ``machine``) partway through a run (two ops
    done) whose invariant pass raises ``error``; returns the class and the
    instance."""
    from hypothesis.stateful import RuleBasedStateMachine

    from kvspec.fuzz.kinds import get as kind_entry

    def fails(self, *args, **kwargs):
        raise error

    machine = machine or machine_for("dense", mode, True)
    m = machine()
    m.cfg = {**kind_entry("dense", mode).defaults(), "kind": "dense", "mode": mode, "inplace": True,
             "hot_threshold": 4, "fold_block": 8}
    m.ops = [{"op": "append", "n": 2}, {"op": "trim", "n": 1}]
    monkeypatch.setattr(RuleBasedStateMachine, "check_invariants", fails)
    with pytest.raises(type(error)):
        m.check_invariants(None, None, None)
    return machine, m


def test_an_invariant_s_failure_is_kept_with_the_run_s_recorded_fields_and_ops(monkeypatch):
    # first_error and first_failure_run as do() keeps them: the trace's cache
    # fields (not the machine's whole cfg) and a copy of the ops so far;
    # first_failure (examples to the first failing op) stays an op's
    err = AssertionError("offset out of range")
    machine, m = _invariant_raises(monkeypatch, err)
    assert machine.first_error is err and machine.first_failure is None
    cfg, ops = machine.first_failure_run
    assert cfg == m.recorded_cfg() and "hot_threshold" not in cfg and ops == m.ops and ops is not m.ops


def test_an_invariant_keeps_neither_a_harness_fault_nor_a_later_failure(monkeypatch):
    # only an assertion is a finding; and an op's earlier failure stays the first
    machine, _ = _invariant_raises(monkeypatch, RuntimeError("the invariant itself broke"))
    assert machine.first_error is None and machine.first_failure_run is None
    earlier, run = AssertionError("the op's"), ({"kind": "dense"}, [{"op": "append", "n": 1}])
    machine.first_error, machine.first_failure_run = earlier, run
    _invariant_raises(monkeypatch, AssertionError("the invariant's"), machine=machine)
    assert machine.first_error is earlier and machine.first_failure_run == run


def test_an_op_failing_after_an_invariant_keeps_the_invariant_s_error_and_counts_examples(monkeypatch):
    # do(): first_error stays the invariant's; first_failure is still the op's
    machine = machine_for("dense", "fp16", True)
    kept = AssertionError("the invariant's")
    machine.first_error, machine.first_failure_run, machine.runs = kept, ({"kind": "dense"}, []), 3
    m = machine()

    class Lock:
        def step(self, index, op):
            raise AssertionError("the op's")

    m.lock, m.cfg = Lock(), {"kind": "dense", "mode": "fp16"}
    with pytest.raises(AssertionError, match="the op's"):
        m.do({"op": "append", "n": 1})
    assert machine.first_error is kept and machine.first_failure_run == ({"kind": "dense"}, [])
    assert machine.first_failure is not None and machine.first_failure[0] == 3


def test_kvspec_verify_exits_2_on_a_tool_failure_and_names_it(monkeypatch, capsys):
    """A check that could not repeat its verdict is TOOL FAILURE in the
    table and ``tool_failure`` in the JSON, and the run exits 2 (over a
    divergence's 1: a verdict the tool cannot repeat says nothing)."""
    import json

    from kvspec.fuzz.commands import verify
    from tests.test_reports import valid

    checks = [verify.Check("bug a", False, "seed 1: flaky verdict ... First: x. Then: y", 0.1, tool_failure=True),
              verify.Check("bug b", False, "missed", 0.1)]
    monkeypatch.setattr(verify, "run_jobs", lambda plan, *a, **k: {i: [checks[i]] for i in range(len(plan))})
    monkeypatch.setattr(verify, "plan", lambda *a, **k: [verify.Job(c.name, "x", ()) for c in checks])
    assert verify.run_verify(as_json=True, jobs=1) == 2
    doc = valid("verify", json.loads(capsys.readouterr().out))
    assert [c["tool_failure"] for c in doc["checks"]] == [True, False] and doc["exit"] == 2
    assert verify.run_verify(jobs=1, width=200) == 2
    out = capsys.readouterr().out
    assert "TOOL FAILURE" in out and "First: x. Then: y" in out
    checks.pop(0)
    assert verify.run_verify(as_json=True, jobs=1) == 1
