"""The ``kvspec e2e`` command: one table (or one JSON object)."""

from __future__ import annotations

import time

from kvspec.fuzz.commands.e2e.checks import DEFAULT, LONG
from kvspec.fuzz.commands.e2e.registry import (
    SCENARIOS,
    ScenarioResult,
    by_name,
    gpu_skipped,
    run_all,
)


def main(long: bool = False, as_json: bool = False, bug: str | None = None, only: list[str] | None = None) -> int:
    """Run the scenarios and print one table (or one JSON object). Exit 0
    when every scenario passes and 1 when any diverged, as replay and fuzz
    do; with ``bug`` (an injected bug of ``kvspec.fuzz.bugs``) exit 1 therefore
    means the bug was caught, and the last line says by which scenarios."""
    import json

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    factories = None
    if bug is not None:
        from kvspec.fuzz.bugs import by_name as bug_by_name

        factories = bug_by_name(bug).factories
    for name in only or []:
        by_name(name)
    start = time.perf_counter()
    size = LONG if long else DEFAULT
    import sys

    print(f"kvspec e2e: {'long' if long else 'default'} size, seeds {list(size.seeds)}"
          + (f", bug {bug}" if bug else ""), file=sys.stderr, flush=True)
    results: list[ScenarioResult] = []

    def finished(r: ScenarioResult) -> None:
        results.append(r)
        print(f"e2e: {r.name}: {'ok' if r.ok else 'DIVERGED'} ({r.seconds:.1f} s)", file=sys.stderr, flush=True)

    interrupted = False
    try:
        run_all(size, factories, only or None, finished)
    except KeyboardInterrupt:
        # Ctrl-C: the scenarios that finished are the report
        interrupted = True
    total = time.perf_counter() - start
    wanted = [s.name for s in SCENARIOS if (not only or s.name in only) and s.name not in {n for n, _ in gpu_skipped()}]
    not_run = [n for n in wanted if n not in {r.name for r in results}]
    skipped = gpu_skipped(only or None)
    for name, reason in skipped:
        print(f"e2e: {name}: not run on the GPU: it {reason} (GPU kernels round by shape)", file=sys.stderr)
    ok = all(r.ok for r in results) and bool(results) and not interrupted
    code = 130 if interrupted else (0 if ok else 1)
    if as_json:
        print(json.dumps({"ok": ok, "exit": code, "long": long, "bug": bug, "seconds": round(total, 1),
                          "interrupted": interrupted, "not_run": not_run,
                          "scenarios": [r.to_json() for r in results],
                          "not_run_on_gpu": [{"scenario": n, "reason": r} for n, r in skipped]}))
        return code
    title = (f"kvspec e2e ({'long' if long else 'default'}: {size.tokens} tokens a stretch, window {size.window}, "
             f"{len(size.seeds)} seeds{', bug ' + bug if bug else ''}; {total:.0f} s)")
    table = Table(title=title)
    for col in ("scenario", "tokens", "distinct", "acceptance", "result", "seconds"):
        table.add_column(col, justify="left" if col in ("scenario", "result") else "right", no_wrap=True)
    for r in results:
        result = "[green]ok[/]" if r.ok else ("[yellow]diverged[/]" if bug else "[bold red]FAILED[/]")
        table.add_row(r.title, str(r.tokens), str(r.distinct),
                      "" if r.acceptance is None else f"{r.acceptance:.0%}", result, f"{r.seconds:.1f}")
    console = Console(highlight=False, soft_wrap=True, emoji=False)
    from kvspec.fuzz.commands.reports import print_table

    print_table(console, table)
    for r in results:
        console.print(f"{escape(r.name)}: {'' if r.ok else '[bold]'}{escape(r.detail)}{'' if r.ok else '[/]'}",
                      markup=True)
    if bug:
        caught = [r.name for r in results if not r.ok]
        console.print(f"injected bug {bug}: " + (f"caught by {', '.join(caught)}" if caught else "[bold red]not caught[/]"))
    if interrupted:
        console.print(f"[bold yellow]interrupted[/]: {len(results)} of {len(wanted)} scenarios finished; not run: "
                      f"{', '.join(not_run) or 'none'}")
    return code
