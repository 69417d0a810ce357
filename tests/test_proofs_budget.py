"""One input, one verdict (issue 47): a proof's verdict is decided by Z3's
deterministic resource units (``rlimit``), never by the clock.

* the ring undo-log obligation's heaviest part (the heaviest check of every
  obligation, and the one that came out ``unknown`` under load) gives the
  same verdicts and uses the same number of units on an idle machine and
  under a CPU hog;
* a budget too small gives ``unknown`` with a reason that names the
  resource limit, the same units every time, and ``kvspec prove`` prints
  the reason and the line that reruns that obligation alone;
* ``--only`` takes a number or a name and refuses anything else (exit 2,
  naming the argument).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

import pytest

from kvspec.proofs import cli, domain
from kvspec.proofs.core import run_parts
from kvspec.proofs.rotating import available as rotating_available

pytestmark = pytest.mark.skipif(not rotating_available(), reason="needs spec/rotating.py")


def _busy(until: float) -> None:
    """A CPU hog: spin until ``until`` (time.time()) or until killed."""
    x = 0
    while time.time() < until:
        x = (x * 31 + 7) % 1_000_003


def _undo_parts() -> list[tuple[str, str, str, int]]:
    """Obligation 8's heaviest part, the one that came out unknown under
    load (both domains): (part, domain, status, units)."""
    from kvspec.proofs.rotating_undo import undo_parts

    domain.reset_names()
    name = "rollback(n <= min(U, offset)) restores every valid non-sink slot"
    return [(p.part, p.domain, p.status, p.units) for p in run_parts([(name, dict(undo_parts())[name])], ("int",))]


def test_same_verdicts_and_units_under_a_cpu_hog() -> None:
    idle = _undo_parts()
    assert all(status == "proved" for _, _, status, _ in idle), idle
    assert max(units for *_, units in idle) > 1_000_000  # a heavy check is among them
    ctx = multiprocessing.get_context("spawn")  # MLX may be loaded here: never fork
    hogs = [ctx.Process(target=_busy, args=(time.time() + 120,), daemon=True)
            for _ in range(max(2, os.cpu_count() or 1))]
    for h in hogs:
        h.start()
    try:
        time.sleep(0.5)  # the hogs are spinning before the proof starts
        loaded = _undo_parts()
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.join(5)
    assert loaded == idle


def _exact_part() -> Any:
    from kvspec.proofs.rotating_undo import undo_parts

    return dict(undo_parts())["rollback(n <= min(U, offset)) restores every valid non-sink slot"]


def test_a_tiny_rlimit_gives_unknown_naming_the_resource_limit_deterministically() -> None:
    def once(ms: int) -> domain.Check:
        domain.reset_names()
        d = domain.Domain(domain.INT)
        premises, goal = _exact_part()(d)
        return domain.check_valid(d, premises, goal, ms)

    full = once(30_000)
    assert full.status == "proved" and full.seed == 0 and 0 < full.units < full.units_given
    # a tenth of the units the proof needs, shared by the seeds: unknown, and
    # the reason says which limit stopped it
    tiny_ms = full.units // domain.RLIMIT_PER_MS // 10
    a, b = once(tiny_ms), once(tiny_ms)
    assert a.status == b.status == "unknown" and a.seed is None
    assert a.reason.startswith(domain.RLIMIT_REASON), a.reason
    assert a.units == b.units >= a.units_given == tiny_ms * domain.RLIMIT_PER_MS
    assert a.reason == b.reason


def test_prove_prints_the_reason_and_the_rerun_line(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "240")
    monkeypatch.setattr(domain, "RLIMIT_PER_MS", 1)  # 30,000 units a check: far too few for obligation 8
    assert cli.main(["--only", "ring rollback (undo log)"]) == 1
    out = capsys.readouterr().out
    assert "unknown" in out and domain.RLIMIT_REASON in out
    assert "rerun it alone: kvspec prove --only 8" in out
    assert cli.main(["--json", "--only", "8"]) == 1
    import json

    (ob,) = json.loads(capsys.readouterr().out)["obligations"]
    assert ob["status"] == "unknown" and ob["rerun"] == "kvspec prove --only 8"
    # a part's units: those of its checks (a bv32 part may run two)
    assert ob["units_given"] in (30_000, 32_000) and ob["units"] >= 30_000
    unknown = [p for p in ob["parts"] if p["status"] == "unknown"]
    assert unknown and all(p["reason"].startswith(domain.RLIMIT_REASON) for p in unknown)


def test_only_takes_numbers_and_names_and_refuses_the_rest(capsys: pytest.CaptureFixture[str]) -> None:
    known = {n for n, _ in cli.obligations()}
    assert cli.select(["8", " Ring Rollback (undo log) ", "3"], known) == [8, 3]
    for bad in (["ring rollback"], ["99"], ["-1"], [""]):
        with pytest.raises(ValueError, match=r"--only .*not an obligation number or name"):
            cli.select(bad, known)
    assert cli.main(["--only", "no such obligation"]) == 2
    err = capsys.readouterr().err
    assert "--only 'no such obligation'" in err and "8 ring rollback (undo log)" in err


def test_every_solver_is_clock_free() -> None:
    """No proof builds Z3's default solver (its QF_NIA strategy gives steps
    2 s and 3 s of wall-clock time) or sets a wall-clock timeout: every
    solver comes from ``kvspec.proofs.domain.solver``."""
    import re
    from pathlib import Path

    found = []
    for path in sorted(Path(domain.__file__).parent.glob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"z3\.(Solver|SolverFor|SimpleSolver)\(|[\"']timeout[\"']|TryFor\(", line):
                found.append(f"{path.name}:{i}: {line.strip()}")
    assert found == [], found
