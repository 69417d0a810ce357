"""kvspec verify's failure reports: a worker that dies, a job's own
wall-clock limit (counted from the job's start, not the run's), and a
failed campaign's saved kvtrace with its replay verdict (fails again, or
replays clean: a timing-dependent failure)."""

import json
import os
from pathlib import Path

from kvspec.fuzz.campaign import CampaignReport, RunResult
from kvspec.fuzz.commands import verify
from kvspec.fuzz.trace import load

TRACES = Path(__file__).parent / "traces"


def test_a_worker_that_dies_is_a_failed_check_naming_the_job_and_exit_code():
    # os._exit in the worker: no result, no exception, the pipe just closes
    jobs = [verify.Job("dies", "_under_mechanism", ("numpy", os._exit, 3), 1.0),
            verify.Job("lives", "_under_mechanism", ("numpy", list), 1.0)]
    results = verify.run_jobs(jobs, 2, verify.Progress(len(jobs), quiet=True))
    (died,) = results[0]
    assert not died.ok and died.name == "dies"
    assert "died" in died.detail and "exit code 3" in died.detail and "'dies'" in died.detail
    assert results[1] == []


class _LateClock:
    """perf_counter for run_jobs' parent loop: the run's start is read at
    real time, every later read 1000 s on (as if the run had been going for
    1000 s before this job started)."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def perf_counter(self):
        self.calls += 1
        return self.real.perf_counter() + (0.0 if self.calls == 1 else 1000.0)


def test_the_wall_clock_limit_counts_from_the_jobs_own_start(monkeypatch):
    import time

    monkeypatch.setenv("KVSPEC_VERIFY_JOB_LIMIT", "60")
    monkeypatch.setattr(verify, "time", _LateClock(time))
    jobs = [verify.Job("late job", "_under_mechanism", ("numpy", list), 1.0),
            verify.Job("second late job", "_under_mechanism", ("numpy", list), 1.0)]
    results = verify.run_jobs(jobs, 2, verify.Progress(len(jobs), quiet=True))
    assert results == {0: [], 1: []}, results  # neither was stopped: each ran well under 60 s of its own


def _fake_campaign(trace):
    def campaign(kind, mode, inplace, budget, seed, *a, **k):
        failure = RunResult(True, 0.1, 1, 3, error=AssertionError("divergence at op 2\nmore"), trace=trace)
        return CampaignReport(f"{kind}/{mode}/{'inplace' if inplace else 'copy'}", 0.1, 1, 3, {}, failure)
    return campaign


def _failed_check(monkeypatch, tmp_path, trace):
    import kvspec.fuzz.campaign

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(kvspec.fuzz.campaign, "campaign", _fake_campaign(trace))
    (check,) = verify.check_campaigns(1.0, ("paged", "fp16", True))
    assert not check.ok and check.detail.startswith("divergence at op 2")
    return check


def test_a_failure_that_replays_clean_says_it_depends_on_timing(monkeypatch, tmp_path):
    # the trace of an injected bug replays clean on the implementation: what a
    # GPU race would leave behind
    check = _failed_check(monkeypatch, tmp_path, load(TRACES / "paged_no_cow.json"))
    assert check.trace and Path(check.trace).is_file()
    assert f"kvtrace {check.trace}: replays clean" in check.detail and "depends on timing" in check.detail
    assert "fails again" not in check.detail


def test_a_failure_that_recurs_on_replay_says_so_and_names_the_op(monkeypatch, tmp_path):
    doc = json.loads((TRACES / "paged_no_cow.json").read_text())
    doc["ops"] = [{"op": "append", "n": 2}, {"op": "expect", "window": [0, 2]}]  # the window is [0, 1]
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    check = _failed_check(monkeypatch, tmp_path, load(tmp_path / "bad.json"))
    assert f"kvtrace {check.trace}: fails again on replay at op 1" in check.detail
    assert "replays clean" not in check.detail


def test_a_failure_without_a_trace_says_none_was_recorded(monkeypatch, tmp_path):
    check = _failed_check(monkeypatch, tmp_path, None)
    assert check.trace is None and "no kvtrace was recorded" in check.detail


def test_a_failed_jobs_trace_path_is_printed_when_it_ends():
    import io

    out = io.StringIO()
    progress = verify.Progress(2, stream=out)
    job = verify.Job("fuzz paged/fp16/inplace", "check_campaigns", (), 1.0)
    progress.finished(job, [verify.Check("fuzz paged", False, "x", 1.0, "fuzz-failures/p.json"),
                            verify.Check("fuzz other", True, "y", 1.0, "fuzz-failures/ok.json")], 1.0)
    text = " ".join(out.getvalue().split())  # rich wraps at its width
    assert "FAILED: fuzz paged" in text and "(kvtrace: fuzz-failures/p.json)" in text and "ok.json" not in text
    progress.finished(job, [verify.Check("fuzz paged", True, "x", 2.0)], 3.0, cpu=1.5)
    assert "(2.0 s, 1.5 s CPU; 3 s elapsed)" in " ".join(out.getvalue().split()) and progress.cpu == 1.5


def test_a_recorded_ctrl_c_stops_the_pool_in_its_wait_and_keeps_what_finished(monkeypatch):
    # kvspec.fuzz.interrupt: a Ctrl-C whose KeyboardInterrupt a finalizer swallowed is
    # still recorded; the parent's wait loop raises it within its 1 s wait
    import time

    from kvspec.fuzz import interrupt

    jobs = [verify.Job("quick", "_under_mechanism", ("numpy", list), 2.0),
            verify.Job("sleeps", "_under_mechanism", ("numpy", time.sleep, 60), 1.0)]
    real_finished = verify.Progress.finished

    def finished(self, job, checks, *a):  # the first job's result is in: Ctrl-C now
        real_finished(self, job, checks, *a)
        monkeypatch.setattr(interrupt, "_requested", True)

    monkeypatch.setattr(verify.Progress, "finished", finished)
    start = time.perf_counter()
    try:
        verify.run_jobs(jobs, 2, verify.Progress(len(jobs), quiet=True))
    except KeyboardInterrupt as exc:
        assert exc.partial == {0: []}  # type: ignore[attr-defined]
    else:
        raise AssertionError("run_jobs ignored a recorded Ctrl-C")
    assert time.perf_counter() - start < 30  # not the sleeping job's 60 s


def test_a_proof_job_without_z3_names_z3(monkeypatch):
    # the GPU machine had no Z3 and the job said "proofs package missing"
    import sys

    from kvspec.fuzz.commands import verify

    monkeypatch.setitem(sys.modules, "z3", None)  # import z3 -> ImportError(name='z3')
    for name in [m for m in list(sys.modules) if m.startswith("kvspec.proofs.")]:
        monkeypatch.delitem(sys.modules, name)
    [check] = verify.check_obligation(1)
    assert not check.ok and check.detail.startswith("Z3 is not installed") and "gpu_extras" in check.detail
    monkeypatch.setitem(sys.modules, "kvspec.proofs.cli", None)
    [check] = verify.check_obligation(1)
    assert not check.ok and check.detail.startswith("the proofs cannot be imported")
