"""``kvspec mutants`` on warm workers (``-j``): the same report, traces and
progress as one process, in catalog order whatever order the seeds finish
in; a seed the pool could not finish is a tool failure of its row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import pytest

from kvspec.fuzz.campaign import Catch
from kvspec.fuzz.commands import mutants
from kvspec.fuzz.workers import TaskResult

#: rows of four kinds, one a variant (pinned cache fields, isolation only)
NAMES = ["inplace_after_trim", "paged_no_cow", "list_trim_partial", "ring_values_key_head_dim"]


def _same(report: list[mutants.MutantReport], out: Path) -> list[dict]:
    """The reports as JSON, without the seconds (the clock's) and with the
    output folder named alike."""
    docs = []
    for r in report:
        doc = r.to_json()
        doc.pop("median_seconds"), doc.pop("worst_seconds")
        doc["trace"] = doc["trace"] and str(Path(doc["trace"]).relative_to(out))
        docs.append(doc)
    return docs


def test_the_pool_gives_the_report_and_traces_of_one_process(tmp_path):
    """Two workers and one process: the same rows in catalog order (progress
    and result), the same examples to catch per seed, the same trace files
    byte for byte (seed 1's shrunk, the others as found)."""
    runs = {}
    for jobs in (1, 2):
        out = tmp_path / f"j{jobs}"
        seen: list[str] = []
        reports = mutants.run_mutants(2, out=str(out), names=NAMES, jobs=jobs, progress=lambda r, s=seen: s.append(r.name))
        order = [e.stem for e in mutants.entries(NAMES)]
        assert [r.name for r in reports] == seen == [
            f"{e.bug.name} [{e.variant}]" if e.variant else e.bug.name for e in mutants.entries(NAMES)]
        assert len(order) == 5 and all(r.caught for r in reports), [r.problems + r.tool_failures for r in reports]
        files = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*.json"))}
        assert len(files) == 2 * len(order)
        runs[jobs] = (_same(reports, out), [r.examples for r in reports], files)
    assert runs[1] == runs[2]


class FakePool:
    """Stands in for kvspec.fuzz.workers.WarmPool: runs each task in this process
    and yields the results last task first (the worst order for a report
    that must come out in catalog order); ``broken`` maps a task index to
    the status it ends with instead."""

    broken: ClassVar[dict[int, str]] = {}
    sizes: ClassVar[list[int]] = []

    start_cpu = 0.5

    def __init__(self, workers, preload=()):
        FakePool.sizes.append(workers)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    #: raise KeyboardInterrupt (a Ctrl-C) after this many results, yielded
    #: first task first; None: every result, last task first
    stop_after: ClassVar[int | None] = None

    def run(self, tasks, on_poll=None):
        order = range(len(tasks)) if self.stop_after is not None else reversed(range(len(tasks)))
        for n, i in enumerate(order):
            if n == self.stop_after:
                raise KeyboardInterrupt
            name, _variant, seed, *_ = tasks[i].args
            catch = Catch(True, 0.01 * seed, seed + len(name), Path(f"{name}-{seed}.json"), None)
            if i in self.broken:
                status = self.broken[i]
                # as a real pool: a task that leaked returned, and its
                # result carries its value (a catch that must not count)
                yield TaskResult(i, catch if status == "leaked" else None,
                                 f"task {tasks[i].label!r} ran past its wall-clock limit" if status == "stopped"
                                 else None, leaked="kvspec.fuzz.campaign.X" if status == "leaked" else None, status=status)
                continue
            yield TaskResult(i, catch, cpu=0.25)


def test_rows_come_out_in_catalog_order_whatever_order_the_seeds_finish(monkeypatch):
    import kvspec.fuzz.workers

    monkeypatch.setattr(kvspec.fuzz.workers, "WarmPool", FakePool)
    FakePool.broken, FakePool.sizes = {}, []
    seen: list[str] = []
    cpu: dict[str, float] = {}
    reports = mutants.run_mutants(3, names=NAMES, jobs=8, progress=lambda r: seen.append(r.name), cpu=cpu)
    assert FakePool.sizes == [8] and cpu == {"seeds": 0.25 * 15, "start": 0.5}
    rows = mutants.entries(NAMES)
    assert [r.name for r in reports] == seen and [r.bug.name for r in reports] == [e.bug.name for e in rows]
    for r in reports:
        assert r.caught and r.examples == [1 + len(r.bug.name), 2 + len(r.bug.name), 3 + len(r.bug.name)]
        assert r.trace == f"{r.bug.name}-1.json"


@pytest.mark.parametrize("status", ["stopped", "died", "error", "leaked"])
def test_a_seed_the_pool_could_not_finish_is_a_tool_failure_of_its_row(monkeypatch, status):
    import kvspec.fuzz.workers

    monkeypatch.setattr(kvspec.fuzz.workers, "WarmPool", FakePool)
    FakePool.broken = {4: status}  # the second row's second seed
    reports = mutants.run_mutants(3, names=NAMES, jobs=2)
    assert [r.caught for r in reports] == [True, False, True, True, True]
    [failure] = reports[1].tool_failures
    assert failure.startswith("seed 2: the run could not finish: ")
    if status == "leaked":  # the seed's catch came back with it, and is no catch
        assert "left its worker changed (kvspec.fuzz.campaign.X)" in failure
        assert not reports[1].caught and len(reports[1].examples) == 2
    assert reports[1].examples == [1 + len(reports[1].bug.name), 3 + len(reports[1].bug.name)]


def test_kvspec_mutants_jobs_option(monkeypatch, capsys, tmp_path):
    """``-j N`` reaches the run (default: every core); ``--json`` is the same
    document either way."""
    from kvspec.fuzz.commands.cli import main

    got: list[int] = []

    def run(seeds, out, names, progress, reports, jobs, cpu):
        got.append(jobs)
        rep = mutants.MutantReport(mutants.entries(names)[0].bug, examples=[3], seconds=[0.1])
        reports.append(rep)
        progress(rep)
        return reports

    monkeypatch.setattr(mutants, "run_mutants", run)
    docs = []
    for extra in (["-j", "1"], ["-j", "3"], []):
        code = main(["mutants", "--seeds", "1", "--only", NAMES[0], "--json", "--out", str(tmp_path), *extra])
        assert code == 0
        docs.append(json.loads(capsys.readouterr().out))
    assert got == [1, 3, mutants.default_jobs()]
    assert docs[0] == docs[1] == docs[2]


def test_the_catch_times_in_the_docs_come_from_the_record():
    """docs/fuzzing.md's per-kind table of seconds and examples to catch is
    the one the committed record of ``kvspec mutants --seeds 5 --json``
    gives (kvspec.fuzz.docgen.catch_summary), the record has every row of the kill
    matrix, every row caught in every seed, and no row's median above 10 s;
    the generated per-row table names every row."""
    from kvspec.fuzz import docgen

    record = docgen.mutants_record()
    assert record["report"]["ok"] and record["report"]["seeds"] == 5
    rows = docgen.catch_rows(record)
    names = [f"{e.bug.name} [{e.variant}]" if e.variant else e.bug.name for e in mutants.entries()]
    assert sorted(r["name"] for r in rows) == sorted(names), (
        "the record's rows are not the kill matrix's: rerun kvspec mutants --seeds 5 --json and "
        "python -m kvspec.fuzz.docgen mutants (docs/fuzzing.md, 'Where the time goes')")
    assert all(r["caught"] for r in rows)
    slow = [(r["name"], r["median_seconds"]) for r in rows if r["median_seconds"] > 10]
    assert not slow, slow
    text = (Path(__file__).parents[1] / "docs" / "fuzzing.md").read_text()
    for row in docgen.catch_summary(record):
        assert "| " + " | ".join(str(c) for c in row) + " |" in text, row
    table = docgen.catch_times_table()
    assert "not measured" not in table and all(f"`{n}`" in table for n in names)


def test_an_interrupted_pool_run_keeps_the_rows_finished_in_order(monkeypatch):
    """Ctrl-C during a pool run: the rows whose seeds all finished, in
    catalog order, are what ``kvspec mutants`` prints (exit 130)."""
    import kvspec.fuzz.workers

    monkeypatch.setattr(kvspec.fuzz.workers, "WarmPool", FakePool)
    monkeypatch.setattr(FakePool, "stop_after", 7)  # two rows of three seeds, and one seed of the third
    FakePool.broken = {}
    reports: list[mutants.MutantReport] = []
    with pytest.raises(KeyboardInterrupt):
        mutants.run_mutants(3, names=NAMES, jobs=2, reports=reports)
    rows = mutants.entries(NAMES)[:2]
    assert [(r.bug.name, r.variant) for r in reports] == [(e.bug.name, e.variant) for e in rows]
    assert all(r.caught and len(r.examples) == 3 for r in reports)
