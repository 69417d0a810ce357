"""``fuzz --shrink-budget``: the cap on shrinking a failure applies to the
batch that finds it, whichever batch that is (fuzz/campaign.py,
``Campaign.batch``). The end-to-end test (tests/test_exec_target.py) finds
its failure in the first batch, so a cap passed to the first batch only
(or lost after it) passed it; here the batches are counted out and the
failure is found in the third."""

from __future__ import annotations

import pytest

from kvspec.fuzz import campaign as fc


@pytest.mark.parametrize("cap", [0.0, 2.5])
def test_the_shrink_cap_reaches_the_batch_that_finds_the_failure(monkeypatch, cap):
    calls: list[float | None] = []

    def run_machine(machine, seed, max_examples=50, steps=40, shrink=True, database=None, shrink_seconds=None,
                    engine=None):
        calls.append(shrink_seconds)
        late = len(calls) == 3
        # the failing batch: found after 0.4 s of search, then 1.0 s of shrinking (cut by the cap)
        return fc.RunResult(late, 1.4 if late else 0.5, 5, 50, 2 if late else None, 0.4 if late else None,
                            {}, AssertionError("planted") if late else None, None, shrink_cut=late)

    monkeypatch.setattr(fc, "run_machine", run_machine)
    camp = fc.Campaign("dense", "fp16", True, seed=1, batch=5, steps=10, shrink_budget=cap)
    for _ in range(3):
        camp.batch()
    assert calls == [cap, cap, cap], calls
    report = camp.report
    assert report.failure is not None and report.shrink_cut and report.examples_to_catch == 12
    assert report.shrink_seconds == pytest.approx(1.0) and report.seconds == pytest.approx(1.4)


def test_no_cap_is_hypothesis_own_limit(monkeypatch):
    calls: list[float | None] = []

    def run_machine(machine, seed, max_examples=50, steps=40, shrink=True, database=None, shrink_seconds=None,
                    engine=None):
        calls.append(shrink_seconds)
        return fc.RunResult(False, 0.1, 1, 1)

    monkeypatch.setattr(fc, "run_machine", run_machine)
    camp = fc.Campaign("dense", "fp16", True, seed=1, batch=1, steps=1)
    camp.batch()
    camp.batch()
    assert calls == [None, None]


def test_the_cli_passes_the_cap_to_every_campaign(monkeypatch, capsys, tmp_path):
    """``--shrink-budget S`` reaches every campaign of a run; without it the
    cap is the ``--budget``."""
    from kvspec.fuzz.commands.cli import main

    seen: list[float | None] = []
    real = fc.Campaign.__init__

    def init(self, *args, **kw):
        seen.append(kw.get("shrink_budget"))
        real(self, *args, **kw)

    monkeypatch.setattr(fc.Campaign, "__init__", init)
    monkeypatch.setattr(fc, "run_machine", lambda *a, **k: fc.RunResult(False, 0.05, 1, 1))
    for extra, want in ((["--shrink-budget", "3"], 3.0), ([], 0.5)):
        seen.clear()
        try:
            main(["fuzz", "--kind", "dense", "--mode", "fp16", "--budget", "0.5", "--seed", "1", "--db", "none",
                  "--out", str(tmp_path), *extra])
        except SystemExit:
            pass
        capsys.readouterr()
        assert seen and all(s == want for s in seen), (extra, seen)


@pytest.mark.parametrize("shrink", [True, False])
def test_campaign_passes_shrink_to_every_batch(monkeypatch, shrink):
    """``campaign(..., shrink=False)`` (the CUDA-path campaigns of
    tests/test_write.py under the mutation profile) runs every batch without
    the shrink phase; the default shrinks."""
    calls: list[bool] = []

    def run_machine(machine, seed, max_examples=50, steps=40, shrink=True, database=None, shrink_seconds=None,
                    engine=None):
        calls.append(shrink)
        return fc.RunResult(len(calls) == 2, 0.1, 1, 1, 1 if len(calls) == 2 else None, None, {},
                            AssertionError("planted") if len(calls) == 2 else None)

    monkeypatch.setattr(fc, "run_machine", run_machine)
    rep = fc.campaign("dense", "fp16", True, 10.0, 1) if shrink else \
        fc.campaign("dense", "fp16", True, 10.0, 1, shrink=False)
    assert calls == [shrink, shrink] and rep.failure is not None
