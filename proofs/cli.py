"""``kvspec prove [--json] [--crosshair] [--only N|NAME ...]``: run every
proof obligation and its negative controls.

Prints a table (obligation, what it states, status, negative control, the
Z3 resource units its largest check used of those it was given, seconds),
then each refuted negative control's counterexample as a kvtrace, and for
every check that came out ``unknown`` Z3's reason and the command that runs
that obligation alone (``kvspec prove --only N``). ``--json`` prints
``{"obligations": [...]}`` instead (with the kvtraces, units and reasons).
Exit status 0 only if every obligation that can run is proved and every
negative control is refuted (and, with ``--crosshair``, CrossHair found no
counterexample); 1 otherwise; 2 for bad arguments (an ``--only`` that names
no obligation).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvspec.proofs.core import ObligationResult


def waiting(number: int, name: str, proves: tuple[str, ...], statement: str, waits_for: str) -> ObligationResult:
    return ObligationResult(number, name, proves, statement, "waits", [], [], 0.0, waits_for)


#: every obligation's name by number (the ``name`` of its result, which
#: tests/test_proofs.py checks): ``kvspec verify`` labels one job per
#: obligation with it before any runs
TITLES = {1: "ownership soundness", 2: "ring slot and warm-up in place", 3: "regrow rule", 4: "trim then append",
          5: "front trim", 6: "paged copy on write", 7: "sliding-window mask", 8: "ring rollback (undo log)",
          9: "atomic list trim", 10: "Turbo physical trim", 11: "Delegated fold schedule",
          12: "3-bit packing byte count", 13: "batch layout", 14: "nbytes counts each array once",
          15: "recurrent checkpoint ring", 16: "atomic list trim with recurrent layers",
          17: "cell freed exactly when its set is empty", 18: "per-sequence positions unique",
          19: "cells refusals change nothing", 20: "position shifts compose", 21: "windowed removal bound",
          22: "prefix key to content", 23: "prefix refcounts and holders", 24: "prefix free queue",
          25: "prefix hit length", 26: "prefix sliding window"}


def obligations() -> list[tuple[int, Any]]:
    """(number, thunk) for every obligation, in number order."""
    from kvspec.proofs import dense

    out: list[tuple[int, Any]] = list(dense.OBLIGATIONS)
    try:
        from kvspec.proofs import rotating
    except ImportError:
        rotating = None  # type: ignore[assignment]
    if rotating is not None and rotating.available():
        from kvspec.proofs import rotating_undo

        out += rotating.OBLIGATIONS + rotating_undo.OBLIGATIONS
    else:
        out.append((2, lambda: waiting(2, "ring slot and warm-up in place", ("ring_slot", "chronological_order", "rotating_inplace_allowed"),
                                       "ring slots, chronological order and the warm-up in-place rule", "spec/rotating.py")))
        out.append((7, lambda: waiting(7, "sliding-window mask", ("mask_visible",),
                                       "each query sees min(query + 1, window) keys, sinks always", "spec/rotating.py")))
    from kvspec.proofs import turbo

    out += turbo.OBLIGATIONS
    from kvspec.proofs import layers

    if layers.available():
        out += layers.OBLIGATIONS
    try:
        from kvspec.proofs import paged
    except ImportError:
        paged = None  # type: ignore[assignment]
    if paged is not None and paged.available():
        out += paged.OBLIGATIONS
    else:
        out.append((6, lambda: waiting(6, "paged copy on write", ("(paged spec)",),
                                       "a block is written in place only when exactly one sequence holds it",
                                       "a paged spec (spec/paged.py)")))
    from kvspec.proofs import batch

    if batch.available():
        out += batch.OBLIGATIONS
    from kvspec.proofs import models

    out += models.OBLIGATIONS
    from kvspec.proofs import recurrent

    out += recurrent.OBLIGATIONS
    from kvspec.proofs import cells

    out += cells.OBLIGATIONS
    from kvspec.proofs import prefix

    out += prefix.OBLIGATIONS
    return sorted(out, key=lambda x: x[0])


def select(only: list[str], known: set[int]) -> list[int]:
    """The obligation numbers ``--only`` names: each item a number or a name
    of :data:`TITLES` (case and surrounding spaces ignored). Raises
    ``ValueError`` naming the argument and what it accepts for an item that
    names no obligation of ``known``."""
    by_name = {TITLES[n].casefold(): n for n in known if n in TITLES}
    out: list[int] = []
    for item in only:
        text = item.strip()
        n = int(text) if text.isdigit() else by_name.get(text.casefold())
        if n is None or n not in known:
            names = "; ".join(f"{k} {TITLES.get(k, '')}".strip() for k in sorted(known))
            raise ValueError(f"--only {item!r}: not an obligation number or name; the obligations are: {names}")
        if n not in out:
            out.append(n)
    return out


def run_all(only: set[int] | None = None, progress: Any = None) -> list[ObligationResult]:
    """Run the obligations (``only``: these numbers); ``progress(result)``
    after each."""
    from kvspec.proofs.domain import reset_names

    results = []
    for number, thunk in obligations():
        if only and number not in only:
            continue
        reset_names()
        results.append(thunk())
        if progress is not None:
            progress(results[-1])
    return results


def ok(results: list[ObligationResult]) -> bool:
    return all(r.status in ("proved", "waits") for r in results)


def _crosshair_status(ch: Any) -> str:
    if ch.counterexamples:
        return "[red]counterexample[/]"
    if ch.count("not confirmed") or ch.count("precondition unmet"):
        return "[red]not confirmed[/]"
    if not ch.ok:
        return "[yellow]error[/]"
    return f"[yellow]warn ({len(ch.warnings)})[/]" if ch.warnings else "[green]ok[/]"


def _table(results: list[ObligationResult], crosshair: Any = None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="kvspec prove: Z3 (int and bv32) with negative controls")
    for col in ("obligation", "states", "status", "negative control", "Z3 units (most used / given, one check)", "seconds"):
        table.add_column(col, overflow="fold")
    colors = {"proved": "green", "refuted": "red", "failed": "red", "unknown": "yellow", "waits": "dim"}
    for r in results:
        name = f"{r.number}. {r.name} ({', '.join(r.proves)})"
        statement = r.statement if not r.waits_for else f"waits for {r.waits_for}"
        nc = r.negative_control
        if r.controls:
            nc = f"{nc} ({sum(c.status == 'refuted' for c in r.controls)}/{len(r.controls)})"
        units = f"{r.units:,} / {r.units_given:,}" if r.units_given else "-"
        table.add_row(name, statement, f"[{colors.get(r.status, 'white')}]{r.status}[/]", nc, units,
                      f"{r.seconds:.1f}")
    if crosshair is not None:
        table.add_row("CrossHair (PEP 316 contracts, spec/)", crosshair.summary(),
                      _crosshair_status(crosshair), "-", "-", f"{crosshair.seconds:.1f}")
    console = Console()
    console.print(table)
    if crosshair is not None:
        for w in crosshair.warnings:
            console.print(f"[yellow]warning[/] CrossHair: {escape(w)}", soft_wrap=True, highlight=False)
    for r in results:
        for p in r.parts:
            if p.status != "proved":
                console.print(f"[red]{r.number}. {escape(p.part)} ({p.domain}): {p.status}[/] {escape(p.reason)} "
                              f"{p.counterexample or ''}", highlight=False)
        for line in r.unknowns():
            if line.startswith("negative control"):
                console.print(f"[yellow]{r.number}. {escape(line)}[/]", highlight=False)
        if r.status not in ("proved", "waits"):
            console.print(f"   rerun it alone: {r.rerun()}", highlight=False)
        for c in r.controls:
            head = f"{r.number}. negative control [bold]{c.name}[/] ({c.rule}): {c.status}"
            if c.refuting_part:
                head += f" at '{c.refuting_part}'"
            console.print(head, highlight=False)
            if c.confirmed:
                console.print(f"   {c.confirmed}", highlight=False)
            if c.trace is not None:
                console.print("   kvtrace: " + json.dumps(c.trace, separators=(",", ":")), highlight=False, soft_wrap=True)
            elif c.counterexample:
                console.print(f"   counterexample: {c.counterexample}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvspec prove", description="Prove the spec's rules with Z3.")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--crosshair", action="store_true", help="also run CrossHair on the spec's contracts")
    parser.add_argument("--only", nargs="+", metavar="N|NAME",
                        help="run only these obligations, by number or by name (e.g. 8 or 'ring rollback (undo log)')")
    try:
        args = parser.parse_args(argv if argv is not None else sys.argv[1:])
    except SystemExit as exc:
        return 0 if exc.code == 0 else 2
    t0 = time.perf_counter()
    if args.only:
        try:
            args.only = select(args.only, {n for n, _ in obligations()})
        except ValueError as e:
            print(f"kvspec prove: error: {e}", file=sys.stderr)
            return 2

    def progress(r: ObligationResult) -> None:
        print(f"prove: {r.number}. {r.name}: {r.status} ({r.seconds:.1f} s)", file=sys.stderr, flush=True)

    print("kvspec prove: Z3 obligations" + (" and CrossHair" if args.crosshair else ""), file=sys.stderr, flush=True)
    try:
        results = run_all(set(args.only) if args.only else None, progress)
        ch = None
        if args.crosshair:
            from kvspec.proofs import crosshair_run

            print("prove: CrossHair on spec/ contracts ...", file=sys.stderr, flush=True)
            ch = crosshair_run.run()
    except KeyboardInterrupt:
        print("kvspec prove: interrupted (nothing is cached; rerun kvspec prove, or --only N)", file=sys.stderr)
        return 130
    good = ok(results) and (ch is None or ch.ok)
    if args.json:
        doc: dict[str, Any] = {"obligations": [r.to_json() for r in results], "ok": good,
                               "seconds": round(time.perf_counter() - t0, 3)}
        if ch is not None:
            doc["crosshair"] = ch.to_json()
        print(json.dumps(doc, indent=2))
    else:
        _table(results, ch)
    return 0 if good else 1


if __name__ == "__main__":
    raise SystemExit(main())
