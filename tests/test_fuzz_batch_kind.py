"""`kvspec fuzz --kind batch` and whose failure the batch campaign reports
(issue 47): the batch cache's divergence or crash is a catch, the harness's
own crash a tool failure (exit 2), never a divergence."""

import json

import pytest

import kvspec.fuzz.batch as fb
from kvspec.fuzz.batch import campaign, catch
from kvspec.fuzz.bugs import by_name
from kvspec.fuzz.commands.cli import main
from kvspec.spec import batch as sb


def _harness_raises(monkeypatch):
    # a harness bug: the lockstep hands kvspec.spec.batch.append a count it refuses,
    # so spec/ code raises (InvalidArgumentError) on a decode the target ran
    real = sb.append
    monkeypatch.setattr(fb.sb, "append", lambda layout, n: real(layout, -n))


def test_the_harness_raising_is_a_tool_failure_not_a_catch(monkeypatch):
    _harness_raises(monkeypatch)
    r = campaign(False, max_examples=30, shrink=False)
    assert (r.ok, r.status, r.caught) == (False, "tool failure", False), r
    assert "the harness raised InvalidArgumentError" in r.failure and "spec/batch.py" in r.failure


def test_an_injected_batch_bug_is_still_a_catch():
    r = catch(by_name("batch_filter_wrong_row"), max_examples=200, shrink=False)
    assert (r.ok, r.status, r.caught) == (False, "diverged", True), r
    assert "ops: merge" in r.failure


def test_the_batch_cache_crashing_is_a_catch(monkeypatch):
    # the target (impl/) raising where the single caches and kvspec.spec.batch ran the op
    from kvspec.impl.batch import BatchKVCache

    def filter_raises(self, batch_indices):
        raise IndexError("lost a row")

    monkeypatch.setattr(BatchKVCache, "filter", filter_raises)
    r = campaign(False, max_examples=100, shrink=False)
    # defined here (tests/), not in fuzz/ or spec/: the target's side
    assert (r.status, r.caught) == ("diverged", True), r
    assert "the batch cache raised IndexError: lost a row" in r.failure


def test_kvspec_fuzz_kind_batch_clean_run_exits_0_with_steps(capsys):
    assert main(["fuzz", "--kind", "batch", "--budget", "0.5", "--seed", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exit"] == 0 and [r["config"] for r in out["runs"]] == ["batch/dense", "batch/rotating"]
    assert all(r["steps"] > 0 and r["examples"] > 0 and r["result"] == "ok" for r in out["runs"])


def test_kvspec_fuzz_kind_batch_with_a_batch_bug_exits_1_and_prints_the_program(capsys):
    assert main(["fuzz", "--kind", "batch", "--bug", "batch_merge_shifts_offset", "--budget", "1", "--seed", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "minimal failing program" in out and "ops: merge" in out
    assert "--seed 1" in out  # the rerun line


def test_kvspec_fuzz_kind_batch_harness_crash_exits_2(monkeypatch, capsys):
    _harness_raises(monkeypatch)
    assert main(["fuzz", "--kind", "batch", "--budget", "0.2", "--seed", "1", "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert {r["result"] for r in out["runs"]} == {"tool failure"}


@pytest.mark.parametrize("argv, named", [
    (["--mode", "int8"], "--mode int8"), (["--inplace", "off"], "--inplace"), (["-j", "2"], "--jobs"),
    (["--target", "mlx-lm"], "--target"), (["--bug", "physical_trim_fp16"], "--bug"),
])
def test_kvspec_fuzz_kind_batch_refuses_what_does_not_apply(argv, named, capsys):
    assert main(["fuzz", "--kind", "batch", "--budget", "0.1", *argv]) == 2
    assert named in capsys.readouterr().out
