"""``kvspec mutants``: the kill matrix of the injected-bug catalog.

Every catalog entry is fuzzed from N fixed seeds (1..N). For each seed the
fuzzer must catch it, and the failing run is written out as a kvtrace and
replayed on the real implementation, where it must pass (when it does not,
the implementation diverges from the spec at the op the report names). The
first seed's counterexample is shrunk to a minimal trace (the one reported:
``kvspec.fuzz.campaign.shrink_run``, op by op, bounded by replays, not seconds);
the other seeds keep theirs as found, up to the failing op: the kill matrix
asks only whether and how soon each seed catches the bug. Reported
per entry: caught in every seed or not, examples and seconds to the first
failing example (median and worst), and the trace of the first seed. A seed
whose failure Hypothesis could not replay (one run of ops gave two answers,
``kvspec.fuzz.machine.FlakyVerdict``) is a tool failure, not a catch: the entry
fails, and the command exits 2 naming both answers.

``-j N`` runs the rows' seeds on N warm worker processes
(``kvspec.fuzz.workers.WarmPool``: MLX, the implementation, the spec and the
harness imported once per worker; each seed checked for what it leaves
behind); the report, the progress lines and the traces are the same as in
one process, in catalog order.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvspec.fuzz.bugs import InjectedBug, catalog, runnable
from kvspec.fuzz.campaign import Catch, catch_bug


@dataclass
class MutantReport:
    bug: InjectedBug
    variant: str = ""
    caught: bool = True
    examples: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    trace: str | None = None
    problems: list[str] = field(default_factory=list)
    #: seeds whose verdict the tool could not repeat (a failure Hypothesis
    #: could not replay: kvspec.fuzz.machine.FlakyVerdict), each with both answers
    tool_failures: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.bug.name} [{self.variant}]" if self.variant else self.bug.name

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "caught": self.caught,
            "median_seconds": round(statistics.median(self.seconds), 3) if self.seconds else None,
            "worst_seconds": round(max(self.seconds), 3) if self.seconds else None,
            "median_examples": statistics.median(self.examples) if self.examples else None,
            "worst_examples": max(self.examples) if self.examples else None,
            "trace": self.trace,
            "clause": self.bug.clause,
            "source": self.bug.source,
            "modes": list(self.bug.modes),
            "replaces": self.bug.replaces,
            "problems": self.problems,
            "tool_failures": self.tool_failures,
        }


@dataclass(frozen=True)
class Entry:
    """One row of the kill matrix: a catalog bug, or one of its variants
    (``variant`` its label, ``fixed`` the pinned cache fields,
    ``check_inplace`` False for isolation only)."""

    bug: InjectedBug
    variant: str = ""
    fixed: dict | None = None
    check_inplace: bool = True

    @property
    def stem(self) -> str:
        """The trace's file name (without ``.json``) in each seed's folder."""
        v = self.variant
        return self.bug.name + ("-" + "".join(c if c.isalnum() else "_" for c in v) if v else "")


def entries(names: list[str] | None = None) -> list[Entry]:
    """The kill matrix's rows in catalog order: every runnable entry, then
    every variant (``names``: only these bugs' rows)."""
    bugs = [bug for bug in catalog() if runnable(bug)]  # GPU-only entries need --device gpu
    rows = [Entry(bug) for bug in bugs]
    rows += [Entry(bug, label, fixed, check) for bug in bugs for label, fixed, check in bug.variants]
    return [e for e in rows if not names or e.bug.name in names]


def catch_seed(name: str, variant: str, seed: int, max_examples: int, out: str, shrink: bool) -> Catch:
    """One seed of one row (``name`` and ``variant`` say which): the same
    call whether it runs in this process or in a pool worker."""
    from kvspec.fuzz.device import select

    select(None)  # the device the parent chose (KVSPEC_DEVICE), in a worker too
    row = next(e for e in entries([name]) if e.variant == variant)
    return catch_bug(row.bug, seed, max_examples, Path(out) / f"seed{seed}", row.fixed, row.check_inplace,
                     row.stem, shrink=shrink)


def _add(rep: MutantReport, seed: int, catch: Catch) -> None:
    """Seed ``seed``'s :class:`~kvspec.fuzz.campaign.Catch` into the row's report."""
    caught, seconds, examples, path, alarm, flaky = catch
    if not caught:
        rep.caught = False
        rep.problems.append(f"seed {seed}: missed after {examples} examples")
        return
    rep.examples.append(examples)
    rep.seconds.append(seconds)
    if flaky:
        rep.caught = False
        rep.tool_failures.append(f"seed {seed}: {flaky} (the run that diverged: {path})")
    elif alarm:
        rep.caught = False
        rep.problems.append(f"seed {seed}: {alarm}")
    if rep.trace is None and path is not None:
        rep.trace = str(path)


#: wall-clock seconds one seed of one row may run in a pool worker before it
#: is stopped: a guard against a hang, never a verdict (a seed is bounded by
#: its examples; the slowest catalog seed takes a few seconds)
SEED_LIMIT = 300.0


def run_mutants(seeds: int = 5, max_examples: int = 2000, out: str = "fuzz-failures/mutants",
                names: list[str] | None = None, progress=None, reports: list[MutantReport] | None = None,
                shrink_first: bool = True, jobs: int = 1, cpu: dict[str, float] | None = None) -> list[MutantReport]:
    """Fuzz every entry (``names``: only these) from seeds 1..``seeds``;
    seed 1's counterexample is shrunk unless ``shrink_first=False`` (then
    no seed's is). ``jobs``: the rows' seeds run on that many warm worker
    processes (``kvspec.fuzz.workers.WarmPool``; 1: one after another in this
    process); either way the reports, the traces and the ``progress``
    calls are the same and in catalog order. ``progress(report)`` is called
    after each entry; finished entries are appended to ``reports`` in
    catalog order (what an interrupted run keeps). ``cpu``, when given,
    gets the CPU seconds the seeds took (``seeds``: summed over the
    processes that ran them) and the workers took to start (``start``)."""
    import time

    reports = [] if reports is None else reports
    cpu = {} if cpu is None else cpu
    cpu.setdefault("seeds", 0.0)
    cpu.setdefault("start", 0.0)
    rows = entries(names)
    if jobs > 1 and rows:
        return _run_pool(rows, seeds, max_examples, out, progress, reports, shrink_first, jobs, cpu)
    for row in rows:
        before = time.process_time()
        rep = MutantReport(row.bug, row.variant)
        for seed in range(1, seeds + 1):
            _add(rep, seed, catch_seed(row.bug.name, row.variant, seed, max_examples, out,
                                       shrink_first and seed == 1))
        cpu["seeds"] += time.process_time() - before
        reports.append(rep)
        if progress is not None:
            progress(rep)
    return reports


def _run_pool(rows: list[Entry], seeds: int, max_examples: int, out: str, progress, reports: list[MutantReport],
              shrink_first: bool, jobs: int, cpu: dict[str, float]) -> list[MutantReport]:
    """:func:`run_mutants` on a pool of ``jobs`` warm workers: one task per
    row and seed, queued in catalog order; a row is reported once its seeds
    and every row before it are done. A task the pool could not finish
    (stopped past :data:`SEED_LIMIT`, its worker died, it raised, or it
    left its worker changed) is a tool failure of its row, naming why."""
    from kvspec.fuzz import interrupt
    from kvspec.fuzz.workers import Task, WarmPool

    tasks = [Task("kvspec.fuzz.commands.mutants:catch_seed",
                  (row.bug.name, row.variant, seed, max_examples, out, shrink_first and seed == 1),
                  SEED_LIMIT, 1.0, f"{row.stem} seed {seed}")
             for row in rows for seed in range(1, seeds + 1)]
    done: dict[int, object] = {}
    nxt = 0
    with WarmPool(min(jobs, len(tasks)), preload=PRELOAD) as pool:
        for result in pool.run(tasks, on_poll=interrupt.check):
            done[result.index] = result
            cpu["seeds"] += result.cpu
            cpu["start"] = pool.start_cpu
            while nxt < len(rows) and all(nxt * seeds + k in done for k in range(seeds)):
                rep = MutantReport(rows[nxt].bug, rows[nxt].variant)
                for k in range(seeds):
                    r = done.pop(nxt * seeds + k)
                    if r.ok:
                        _add(rep, k + 1, r.value)
                    else:
                        rep.caught = False
                        why = (r.error or "").strip().splitlines()[-1:] or [r.status]
                        what = f"left its worker changed ({r.leaked})" if r.status == "leaked" else why[0]
                        rep.tool_failures.append(f"seed {k + 1}: the run could not finish: {what}")
                reports.append(rep)
                nxt += 1
                if progress is not None:
                    progress(rep)
    return reports


#: what each worker imports before its first seed: the implementation, the
#: spec, Hypothesis and the harness (not the proofs' solver, which no seed uses)
PRELOAD = ("numpy", "mlx.core", "hypothesis", "hypothesis.stateful", "hypothesis.strategies", "kvspec.impl.*", "kvspec.spec.*",
           "kvspec.fuzz.*", "kvspec.fuzz.commands.mutants", "kvspec.fuzz.bugs:catalog", "kvspec.fuzz.trace:_op_checker")


def default_jobs() -> int:
    """Every core this process may use."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def main(seeds: int, as_json: bool, out: str, names: list[str] | None = None, junit_xml: str | None = None,
         argv: list[str] | None = None, jobs: int = 1) -> int:
    """Exit 0 when every entry is caught in every seed with a clean trace,
    2 when a seed's verdict could not be repeated (a tool failure:
    :attr:`MutantReport.tool_failures`), 1 otherwise, 130 when interrupted
    (the entries finished are printed)."""
    import sys
    import time

    err = Console(stderr=True, highlight=False, emoji=False)
    total = sum(1 + len(b.variants) for b in catalog() if runnable(b) and (not names or b.name in names))
    skipped = [b.name for b in catalog() if not runnable(b) and (not names or b.name in names)]
    err.print(f"kvspec mutants: {total} entries, seeds 1..{seeds}", markup=False)
    if skipped:
        err.print(f"kvspec mutants: {len(skipped)} GPU-only entries not run on this device (--device gpu on a CUDA "
                  f"machine runs them): {', '.join(skipped)}", markup=False)
    start = time.perf_counter()

    def progress(rep: MutantReport) -> None:
        done = len(reports)
        err.print(f"[{done}/{total}] {rep.name}: {'caught' if rep.caught else 'TOOL FAILURE' if rep.tool_failures else 'NOT caught'} "
                  f"({sum(rep.seconds):.1f} s)", markup=False)

    reports: list[MutantReport] = []
    interrupted = False
    cpu: dict[str, float] = {}
    try:
        run_mutants(seeds, out=out, names=names, progress=progress, reports=reports, jobs=jobs, cpu=cpu)
    except KeyboardInterrupt:
        interrupted = True
    # what the run cost whatever else the machine ran: CPU seconds over the
    # processes that ran the seeds (on an idle machine the wall clock is
    # about this over the number of processes, plus their start)
    err.print(f"kvspec mutants: {time.perf_counter() - start:.0f} s wall; the seeds took {cpu.get('seeds', 0.0):.0f} s "
              f"of CPU in {jobs} process{'es' if jobs > 1 else ''}"
              + (f", starting the workers {cpu.get('start', 0.0):.0f} s" if jobs > 1 else ""), markup=False)
    ok = bool(reports) and all(r.caught for r in reports) and not interrupted
    tool_failed = any(r.tool_failures for r in reports)
    code = 130 if interrupted else (0 if ok else 2 if tool_failed else 1)
    from kvspec.fuzz.commands.reports import Case, print_table, rerun, write_junit

    if junit_xml:
        cases = [Case(f"{r.bug.kind}/{r.bug.modes[0]}", r.name, r.caught, sum(r.seconds),
                      "; ".join(r.tool_failures + r.problems) if r.tool_failures or r.problems else
                      f"caught in {seeds}/{seeds} seeds, examples median {r.to_json()['median_examples']}"
                      + (f"; trace {r.trace}" if r.trace else "")) for r in reports]
        write_junit(junit_xml, cases)
    if as_json:
        print(json.dumps({"seeds": seeds, "ok": ok, "interrupted": interrupted, "exit": code,
                          "mutants": [r.to_json() for r in reports]}))
        return code
    table = Table(title=f"kvspec mutants: injected-bug kill matrix ({seeds} seeds each)")
    for col in ("bug", "kind/mode", "caught", "examples med/worst", "seconds med/worst"):
        table.add_column(col, overflow="fold", no_wrap=col != "bug")
    for r in reports:
        j = r.to_json()
        table.add_row(
            escape(r.name), f"{r.bug.kind}/{r.bug.modes[0]}",
            "[green]yes[/]" if r.caught else "[bold red]TOOL FAILURE[/]" if r.tool_failures else "[bold red]NO[/]",
            f"{j['median_examples']}/{j['worst_examples']}",
            f"{j['median_seconds']}/{j['worst_seconds']}",
        )
    console = Console(highlight=False, emoji=False)
    print_table(console, table)
    for r in reports:
        if r.trace:
            console.print(f"{escape(r.name)}: {escape(r.trace)}", soft_wrap=True)
        for p in r.problems:
            console.print(f"[bold red]{escape(r.name)}[/]: {escape(p)}", soft_wrap=True)
        for p in r.tool_failures:
            console.print(f"[bold red]tool failure[/] {escape(r.name)}: {escape(p)}", soft_wrap=True)
    console.print(f"{sum(r.caught for r in reports)} of {len(reports)} injected bugs and variants caught in every seed "
                  f"({time.perf_counter() - start:.0f} s)")
    if tool_failed:
        console.print(f"[bold red]tool failure[/]: {sum(bool(r.tool_failures) for r in reports)} entries had a seed whose "
                      "verdict the tool could not repeat (one run of ops, two answers; docs/fuzzing.md, "
                      "'Determinism of a verdict'): exit 2", soft_wrap=True)
    if interrupted:
        missing = total - len(reports)
        again = rerun("mutants", argv or ["mutants", "--seeds", str(seeds)] + (["--only", *names] if names else []))
        console.print(f"[bold yellow]interrupted[/]: {missing} entries not run\n  rerun: {escape(again)}", soft_wrap=True)
    sys.stdout.flush()
    return code


#: the parts of a catch that :func:`time_parts` times, in the order of a catch
PARTS = ("machine class (machine_for)", "Hypothesis test construction", "search (to the first failing example)",
         "Hypothesis: engine set-up, its shrink phase, the final replay", "op-level shrink (reduce_run, shrink_run)",
         "failure_trace and save_failure", "clean replay on the real implementation", "other")


def time_parts(step: int = 8, seeds: int = 5, max_examples: int = 2000, out: str = "fuzz-failures/mutants-parts",
               shrink_first: bool = True) -> dict:
    """Where a row's catches spend their wall clock, part by part: every
    ``step``-th row of the kill matrix from seeds 1..``seeds`` in this
    process (seed 1 shrunk), each part of ``kvspec.fuzz.campaign.catch_bug`` timed
    around its call; garbage collection is timed apart (it happens inside
    the other parts). ``python -m kvspec.fuzz.commands.mutants --parts [STEP]``
    prints it as JSON."""
    import gc
    import time

    import kvspec.fuzz.campaign as fc

    acc = dict.fromkeys(PARTS, 0.0)
    saved = {name: getattr(fc, name) for name in ("machine_for", "reduce_run", "shrink_run", "failure_trace",
                                                    "save_failure", "replay", "get_program_test",
                                                    "get_state_machine_test", "run_machine")}

    traced = [0.0]  # failure_trace's part, which runs inside run_machine

    def timed(name: str, part: str):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return saved[name](*args, **kwargs)
            finally:
                acc[part] += time.perf_counter() - t
                if name == "failure_trace":
                    traced[0] += time.perf_counter() - t
        return call

    inner = {"machine_for": PARTS[0], "get_program_test": PARTS[1], "get_state_machine_test": PARTS[1],
             "reduce_run": PARTS[4], "shrink_run": PARTS[4], "failure_trace": PARTS[5], "save_failure": PARTS[5],
             "replay": PARTS[6]}
    for name, part in inner.items():
        setattr(fc, name, timed(name, part))
    machine_seconds = [0.0]

    def run_machine(*args, **kwargs):
        t = time.perf_counter()
        result = saved["run_machine"](*args, **kwargs)
        machine_seconds[0] += time.perf_counter() - t
        acc[PARTS[2]] += result.seconds_to_catch or 0.0
        return result

    fc.run_machine = run_machine
    collecting = [0.0, 0.0]

    def collector(phase: str, info: dict) -> None:
        if phase == "start":
            collecting[1] = time.perf_counter()
        else:
            collecting[0] += time.perf_counter() - collecting[1]

    gc.callbacks.append(collector)
    rows = entries()[::step]
    start, cpu = time.perf_counter(), time.process_time()
    try:
        for row in rows:
            for seed in range(1, seeds + 1):
                catch_seed(row.bug.name, row.variant, seed, max_examples, out, shrink_first and seed == 1)
    finally:
        gc.callbacks.remove(collector)
        for name, f in saved.items():
            setattr(fc, name, f)
    wall = time.perf_counter() - start
    # run_machine's own time less what is timed inside it (the search, the
    # test's construction, the op-level shrink and failure_trace)
    acc[PARTS[3]] = machine_seconds[0] - acc[PARTS[1]] - acc[PARTS[2]] - acc[PARTS[4]] - traced[0]
    acc[PARTS[7]] = wall - sum(acc[p] for p in PARTS[:7])
    return {"rows": len(rows), "seeds": seeds, "wall_seconds": round(wall, 2),
            "cpu_seconds": round(time.process_time() - cpu, 2), "gc_seconds": round(collecting[0], 2),
            "parts": {p: {"seconds": round(acc[p], 2), "share": round(acc[p] / wall, 3)} for p in PARTS}}


if __name__ == "__main__":  # pragma: no cover - a measuring command
    import sys

    if sys.argv[1:2] != ["--parts"]:
        print("usage: python -m kvspec.fuzz.commands.mutants --parts [STEP]", file=sys.stderr)
        raise SystemExit(2)
    print(json.dumps(time_parts(int(sys.argv[2]) if len(sys.argv) > 2 else 8), indent=1))
