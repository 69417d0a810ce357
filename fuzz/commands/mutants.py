"""``kvspec mutants``: the kill matrix of the injected-bug catalog.

Every catalog entry is fuzzed from N fixed seeds (1..N). For each seed the
fuzzer must catch it; the minimal counterexample is written out and replayed
on the real implementation, where it must pass (a trace that fails on correct
code is a false alarm). Reported per entry: caught in every seed or not,
examples and seconds to the first failing example (median and worst), and
the trace of the first seed.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fuzz.bugs import InjectedBug, catalog
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
        }


def run_mutants(seeds: int = 5, max_examples: int = 2000, out: str = "fuzz-failures/mutants",
                names: list[str] | None = None) -> list[MutantReport]:
    reports = []
    runs = [(bug, "", None, True) for bug in catalog()]
    runs += [(bug, label, fixed, check) for bug in catalog() for label, fixed, check in bug.variants]
    for bug, variant, fixed, check_inplace in runs:
        if names and bug.name not in names:
            continue
        rep = MutantReport(bug, variant)
        stem = bug.name + ("-" + "".join(c if c.isalnum() else "_" for c in variant) if variant else "")
        for seed in range(1, seeds + 1):
            caught, seconds, examples, path, alarm = catch_bug(bug, seed, max_examples, Path(out) / f"seed{seed}",
                                                               fixed, check_inplace, stem)
            if not caught:
                rep.caught = False
                rep.problems.append(f"seed {seed}: missed after {examples} examples")
                continue
            rep.examples.append(examples)
            rep.seconds.append(seconds)
            if alarm:
                rep.caught = False
                rep.problems.append(f"seed {seed}: {alarm}")
            if rep.trace is None and path is not None:
                rep.trace = str(path)
        reports.append(rep)
    return reports


def main(seeds: int, as_json: bool, out: str, names: list[str] | None = None) -> int:
    reports = run_mutants(seeds, out=out, names=names)
    ok = all(r.caught for r in reports)
    if as_json:
        print(json.dumps({"seeds": seeds, "mutants": [r.to_json() for r in reports]}))
        return 0 if ok else 1
    table = Table(title=f"kvspec mutants: injected-bug kill matrix ({seeds} seeds each)")
    for col in ("bug", "kind/mode", "caught", "examples med/worst", "seconds med/worst", "trace"):
        table.add_column(col, overflow="fold")
    for r in reports:
        j = r.to_json()
        table.add_row(
            escape(r.name), f"{r.bug.kind}/{r.bug.modes[0]}",
            "[green]yes[/]" if r.caught else "[bold red]NO[/]",
            f"{j['median_examples']}/{j['worst_examples']}",
            f"{j['median_seconds']}/{j['worst_seconds']}",
            r.trace or "-",
        )
    console = Console(highlight=False, width=170)
    console.print(table)
    for r in reports:
        for p in r.problems:
            console.print(f"[bold red]{escape(r.name)}[/]: {escape(p)}")
    console.print(f"{sum(r.caught for r in reports)} of {len(reports)} injected bugs and variants caught in every seed")
    return 0 if ok else 1
