"""kvspec verify on warm workers (kvspec.fuzz.workers.WarmPool) and its quick
plan: a failing job still fails, a hung one is stopped while the rest go
on, -x stops the pool, a job that leaves its worker changed is a tool
failure; --quick gives every kind, every injected bug and every proof
obligation a first verdict, with campaigns bounded by examples."""

from __future__ import annotations

import time

from kvspec.fuzz import kinds
from kvspec.fuzz.commands import verify


def _bad_contract(tmp_path):
    bad = tmp_path / "bad_contract.py"
    bad.write_text('def grow(x: int) -> int:\n    """\n    pre: x >= 0\n    post: __return__ > x\n    """\n    return x\n')
    return str(bad)


def test_a_failing_job_fails_on_the_pool_and_the_others_still_pass(tmp_path):
    jobs = [verify.Job("crosshair bad", "check_crosshair_file", (_bad_contract(tmp_path),), 2.0),
            verify.Job("equivalent mutants", "check_equivalents", (), 1.0),
            verify.Job("proof front trim", "check_obligation", (5,), 0.5)]
    progress = verify.Progress(len(jobs), quiet=True)
    results = verify.run_jobs(jobs, 2, progress)
    (bad,) = results[0]
    assert not bad.ok and "counterexamples 1" in bad.detail
    assert results[1] and all(c.ok for c in results[1]) and all(c.ok for c in results[2])
    assert progress.done == 3 and progress.cpu > 0


def test_exitfirst_stops_the_pool_at_the_first_failed_job(tmp_path):
    jobs = [verify.Job("crosshair bad", "check_crosshair_file", (_bad_contract(tmp_path),), 9.0),
            verify.Job("sleeps", "_under_mechanism", ("numpy", time.sleep, 120), 5.0),
            *[verify.Job(f"later {i}", "_under_mechanism", ("numpy", list), 0.1) for i in range(4)]]
    start = time.perf_counter()
    results = verify.run_jobs(jobs, 2, verify.Progress(len(jobs), quiet=True), exitfirst=True)
    assert time.perf_counter() - start < 60  # not the sleeping job's 120 s
    assert 0 in results and not results[0][0].ok
    assert 1 not in results  # stopped with the pool


def test_a_job_that_leaves_its_worker_changed_is_a_tool_failure():
    from kvspec.impl.dense import KVCache

    # setattr returns None, so the job itself crashes too; what matters is
    # the patch it leaves behind on impl's class
    jobs = [verify.Job("patches", "_under_mechanism", ("numpy", setattr, KVCache, "trim", len), 2.0),
            verify.Job("equivalent mutants", "check_equivalents", (), 1.0)]
    results = verify.run_jobs(jobs, 2, verify.Progress(len(jobs), quiet=True))
    leaked = [c for c in results[0] if c.tool_failure]
    assert len(leaked) == 1 and leaked[0].name == "patches [isolation]" and not leaked[0].ok
    assert "kvspec.impl.dense.KVCache.trim" in leaked[0].detail
    assert all(c.ok for c in results[1])


# -- --quick ---------------------------------------------------------------------------
def test_quick_gives_every_kind_bug_and_obligation_a_first_verdict():
    from kvspec.fuzz.bugs import batch_bugs, catalog, runnable
    from kvspec.fuzz.bugs.batch import RECURRENT_BUGS
    from kvspec.proofs.cli import TITLES, obligations

    plan = verify.plan(quick=True)
    labels = {j.label: j for j in plan}
    configs = [(k.kind, m, ip) for k in kinds.KINDS.values() for m, ip in k.campaigns]
    for kind, mode, inplace in configs:
        job = labels.get(f"fuzz {kind}/{mode}/{'inplace' if inplace else 'copy'}")
        assert job is not None, f"quick runs no campaign of {kind}/{mode}"
        # bounded by examples (a verdict that does not depend on the clock),
        # not by seconds
        assert job.args == (0.0, (kind, mode, inplace), False, verify.QUICK_EXAMPLES), job
    assert {k.kind for k in kinds.KINDS.values()} <= {label.split()[1].split("/")[0]
                                                      for label in labels if label.startswith("fuzz ")}
    bugs = [b for b in catalog() if runnable(b)]
    missing = [b.name for b in bugs if f"bug {b.name}" not in labels]
    assert not missing, f"quick's plan leaves out injected bugs {missing}"
    assert all(labels[f"bug {b.name}"].args[1] == 1 for b in bugs)  # one seed each
    # the batch bugs run in one job, with the examples that catch each of them
    assert labels["batch bugs"].args == (200,) and len(batch_bugs()) + len(RECURRENT_BUGS) > 5
    assert {"batch lockstep/dense", "batch lockstep/rotating", "batch lockstep/recurrent", "traces",
            "harness mutants", "equivalent mutants"} <= set(labels)
    numbers = sorted({n for n, _ in obligations()})
    assert [label for label in labels if label.startswith("proof ")] == [f"proof {TITLES[n]}" for n in numbers]
    # what quick leaves out: the e2e scenarios and CrossHair
    assert not any(label.startswith(("e2e ", "crosshair ")) for label in labels)
    full = {j.label for j in verify.plan(quick=False)}
    assert set(labels) == {label for label in full if not label.startswith(("e2e ", "crosshair "))}


def test_a_quick_campaign_runs_its_examples_whatever_the_clock(monkeypatch):
    import kvspec.fuzz.campaign

    (first,) = verify.check_campaigns(0.0, ("dense", "fp16", False), False, verify.QUICK_EXAMPLES)
    assert first.ok and first.detail.startswith(f"{verify.QUICK_EXAMPLES} examples, ")

    class Slow:  # every clock read 100 s after the last: a machine at a crawl
        def __init__(self):
            self.now = 0.0

        def perf_counter(self):
            self.now += 100.0
            return self.now

    monkeypatch.setattr(kvspec.fuzz.campaign, "time", Slow())
    (slow,) = verify.check_campaigns(0.0, ("dense", "fp16", False), False, verify.QUICK_EXAMPLES)
    assert slow.ok and slow.detail.split(" ops")[0] == first.detail.split(" ops")[0]


def test_the_queue_starts_the_longest_jobs_first():
    # expected seconds are measured ones: an e2e scenario missing from
    # E2E_SECONDS would start late and end the run alone
    from kvspec.fuzz.commands.e2e import SCENARIOS

    assert set(verify.E2E_SECONDS) >= {s.name for s in SCENARIOS}
    plan = verify.plan()
    weight = {j.label: j.weight for j in plan}
    # a bug job on a warm worker takes about a second: it no longer outweighs
    # a campaign or a long e2e scenario
    assert max(w for label, w in weight.items() if label.startswith("bug ")) < verify.CAMPAIGN_BUDGET
    assert weight["e2e hybrid_speculative"] > weight["fuzz dense/fp16/inplace"] > weight["e2e greedy"]


def test_a_quick_campaign_is_bounded_by_examples_on_a_fast_clock_too(monkeypatch):
    """A clock that never advances (a machine far faster than the one the
    budget was set on): still exactly QUICK_EXAMPLES examples, not more.
    (A seconds-bounded campaign would not end on it: it is replaced by one
    that fails.)"""
    import kvspec.fuzz.campaign

    class Fast:
        def __init__(self):
            self.reads = 0

        def perf_counter(self):
            self.reads += 1
            return 0.0 if self.reads < 200 else 1e9

    def bounded_by_seconds(*args, **kwargs):  # on this clock it would not end: fail instead of hanging
        raise AssertionError("a quick campaign ran the seconds-bounded campaign")

    monkeypatch.setattr(kvspec.fuzz.campaign, "time", Fast())
    monkeypatch.setattr(kvspec.fuzz.campaign, "campaign", bounded_by_seconds)
    (fast,) = verify.check_campaigns(0.0, ("dense", "fp16", False), False, verify.QUICK_EXAMPLES)
    assert fast.ok and fast.detail.startswith(f"{verify.QUICK_EXAMPLES} examples, "), fast


def test_a_quick_campaign_never_calls_the_seconds_bounded_campaign(monkeypatch):
    import kvspec.fuzz.campaign

    def bounded_by_seconds(*args, **kwargs):
        raise AssertionError(f"a quick campaign ran the seconds-bounded campaign{args}")

    monkeypatch.setattr(kvspec.fuzz.campaign, "campaign", bounded_by_seconds)
    (check,) = verify.check_campaigns(0.0, ("dense", "fp16", False), False, verify.QUICK_EXAMPLES)
    assert check.ok and check.detail.startswith(f"{verify.QUICK_EXAMPLES} examples, "), check
