"""``kvspec verify`` counts what it announces in the same unit it sums up
(issue 47: it announced "129 jobs" and ended "263 passed"): a job is one
unit of the pool and gives one or more checks, the table's rows; the
announcement says jobs, the summary says checks and jobs, each by name."""

from __future__ import annotations

import re

import pytest

from kvspec.fuzz.commands import verify


def test_announced_jobs_and_summed_up_checks_name_their_unit(capsys: pytest.CaptureFixture[str]) -> None:
    # one job of 7 checks (the equivalent mutants) and one job of one check
    code = verify.run_verify(patterns=["equivalent mutants", "proof front trim"], jobs=1, width=200)
    assert code == 0
    captured = capsys.readouterr()
    assert re.search(r"kvspec verify: 2 jobs \(each one or more checks, the table's rows\)", captured.err), captured.err
    from kvspec.proofs.equivalents import EQUIVALENCES

    checks = len(EQUIVALENCES) + 1
    assert checks > 2
    summary = re.search(r"(\d+) checks passed, (\d+) failed \(the table's rows\), from (\d+) of (\d+) jobs "
                        r"\((\d+) jobs passed, (\d+) failed\)", captured.out)
    assert summary is not None, captured.out
    assert [int(g) for g in summary.groups()] == [checks, 0, 2, 2, 2, 0]
    rows = [line for line in captured.out.splitlines() if re.match(r"^│ (equivalent mutant|proof) ", line)]
    assert len(rows) == checks
