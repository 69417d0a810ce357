"""``kvspec mutants``: the kill matrix of the injected-bug catalog.

Every catalog entry is fuzzed from N fixed seeds (1..N). For each seed the
fuzzer must catch it, and the failing run is written out as a kvtrace and
replayed on the real implementation, where it must pass (when it does not,
the implementation diverges from the spec at the op the report names). The
first seed's counterexample is shrunk to a minimal trace (the one reported);
the other seeds keep theirs as found, up to the failing op: shrinking costs
about ten times the search, and the kill matrix asks only whether and how
soon each seed catches the bug. Reported
per entry: caught in every seed or not, examples and seconds to the first
failing example (median and worst), and the trace of the first seed. A seed
whose failure Hypothesis could not replay (one run of ops gave two answers,
``fuzz.machine.FlakyVerdict``) is a tool failure, not a catch: the entry
fails, and the command exits 2 naming both answers.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fuzz.bugs import InjectedBug, catalog, runnable
from fuzz.campaign import catch_bug


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
    #: could not replay: fuzz.machine.FlakyVerdict), each with both answers
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


def run_mutants(seeds: int = 5, max_examples: int = 2000, out: str = "fuzz-failures/mutants",
                names: list[str] | None = None, progress=None, reports: list[MutantReport] | None = None,
                shrink_first: bool = True) -> list[MutantReport]:
    """Fuzz every entry (``names``: only these) from seeds 1..``seeds``;
    seed 1's counterexample is shrunk unless ``shrink_first=False`` (then
    no seed's is). ``progress(report)`` is called after each entry; finished
    entries are appended to ``reports`` as they finish (what an interrupted
    run keeps)."""
    reports = [] if reports is None else reports
    bugs = [bug for bug in catalog() if runnable(bug)]  # GPU-only entries need --device gpu
    runs = [(bug, "", None, True) for bug in bugs]
    runs += [(bug, label, fixed, check) for bug in bugs for label, fixed, check in bug.variants]
    for bug, variant, fixed, check_inplace in runs:
        if names and bug.name not in names:
            continue
        rep = MutantReport(bug, variant)
        stem = bug.name + ("-" + "".join(c if c.isalnum() else "_" for c in variant) if variant else "")
        for seed in range(1, seeds + 1):
            caught, seconds, examples, path, alarm, flaky = catch_bug(
                bug, seed, max_examples, Path(out) / f"seed{seed}", fixed, check_inplace, stem,
                shrink=shrink_first and seed == 1)
            if not caught:
                rep.caught = False
                rep.problems.append(f"seed {seed}: missed after {examples} examples")
                continue
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
        reports.append(rep)
        if progress is not None:
            progress(rep)
    return reports


def main(seeds: int, as_json: bool, out: str, names: list[str] | None = None, junit_xml: str | None = None,
         argv: list[str] | None = None) -> int:
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
    try:
        run_mutants(seeds, out=out, names=names, progress=progress, reports=reports)
    except KeyboardInterrupt:
        interrupted = True
    ok = bool(reports) and all(r.caught for r in reports) and not interrupted
    tool_failed = any(r.tool_failures for r in reports)
    code = 130 if interrupted else (0 if ok else 2 if tool_failed else 1)
    from fuzz.commands.reports import Case, print_table, rerun, write_junit

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
