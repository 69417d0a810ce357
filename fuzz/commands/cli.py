"""The ``kvspec`` command: replay, fuzz, verify, prove.

A thin layer: every command calls into ``fuzz`` (or ``proofs`` for
``prove``) and only formats what comes back.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fuzz import kinds

DEFAULT_OUT = "fuzz-failures"
# the registry is data (fuzz/kinds.py): reading it loads no MLX
CONFIGS = kinds.configs()
# kept in step with fuzz.targets.TARGETS and fuzz.conformance (not imported
# here: the parser must not load MLX)
TARGET_NAMES = ["impl", "mlx-lm", "mlx-lm-concat", "mlx-lm-guarded"]
WAIVABLE = ["offset", "live_start", "live_len", "capacity", "idx", "trimmable", "trimmable_rows", "masks"]
CONFORMANCE_SEED = 20261129


def _console() -> Console:
    return Console(highlight=False, soft_wrap=True)


def _target(args: argparse.Namespace) -> Any:
    """The ``--target`` (and ``--waive``) of a command as a fuzz.targets.Target.
    Raises KeyError naming the known targets."""
    from fuzz.targets import resolve

    target = resolve(getattr(args, "target", None) or "impl")
    for what in getattr(args, "waive", None) or []:
        target = target.waiving(what)
    return target


# -- replay --------------------------------------------------------------------
def cmd_replay(args: argparse.Namespace) -> int:
    from fuzz.replay import EXIT_DIVERGED, EXIT_INVALID, EXIT_OK, replay
    from fuzz.trace import TraceFormatError, load

    console = _console()
    try:
        trace = load(args.trace)
        factories = None
        if args.bug:
            from fuzz.bugs import by_name

            bug = by_name(args.bug)
            if bug.kind != trace.cache["kind"]:
                raise KeyError(f"--bug {bug.name} patches the {bug.kind} cache; this trace is kind {trace.cache['kind']}")
            factories = bug.factories
        target = _target(args)
        if factories and not target.is_impl:
            raise KeyError(f"--bug: injected bugs patch this project's classes; it cannot be combined with --target {target.name}")
        result = replay(trace, factories, check_inplace=not args.isolation_only, target=target)
    except TraceFormatError as exc:
        if args.json:
            print(json.dumps({"ok": False, "invalid": str(exc), "trace": args.trace}))
        else:
            console.print(f"[bold red]invalid kvtrace[/] {args.trace}: {exc}")
        return EXIT_INVALID
    except KeyError as exc:
        console.print(f"[bold red]error[/]: {exc.args[0]}")
        return EXIT_INVALID
    if args.json:
        print(json.dumps({**result.to_json(), "trace": args.trace}))
        return EXIT_OK if result.ok else EXIT_DIVERGED
    if result.ok:
        who = "implementation" if target.is_impl else f"target {target.name}"
        console.print(f"[green]ok[/] {args.trace}: {result.ops_run} ops, spec and {who} agree")
        for i, m in result.refusals:
            if trace.ops[i].get("error") is not True:
                # Agreement, but a refusal the trace did not ask for is often
                # a typo in a name: say so rather than pass silently.
                console.print(f'  note: op {i} was refused by both sides and has no "error": true: {escape(m)}')
        return EXIT_OK
    console.print(f"[bold red]diverged[/] {args.trace}")
    console.print(str(result.divergence))
    return EXIT_DIVERGED


# -- fuzz ----------------------------------------------------------------------
def _stats_text(stats: dict[str, int]) -> str:
    keep = [k for k in sorted(stats) if k != "ops" and not k.startswith("refused")]
    refused = sum(v for k, v in stats.items() if k.startswith("refused"))
    parts = [f"{k}: {stats[k]}" for k in keep]
    if refused:
        parts.append(f"refused ops: {refused}")
    return ", ".join(parts)


def _inplace_settings(value: str) -> list[bool]:
    return {"on": [True], "off": [False], "both": [True, False]}[value]


def cmd_fuzz(args: argparse.Namespace) -> int:
    from fuzz.campaign import campaign, save_failure

    console = _console()
    if args.budget <= 0:
        console.print(f"[red]--budget: must be > 0 seconds, got {args.budget}[/]")
        return 2
    target = _target(args)
    # an mlx-lm target runs the configs it has a class for (fuzz/targets.py)
    have = [(k, m) for k, m in CONFIGS if target.is_impl or target.cache_class(k, m) is not None]
    configs = [(k, m) for k, m in have if (args.kind in (None, k)) and (args.mode in (None, m))]
    if not configs:
        console.print(f"[red]no implementation for kind={args.kind} mode={args.mode} on target {target.name}[/]; have {have}")
        return 2
    factories = None
    if args.bug:
        from fuzz.bugs import by_name

        bug = by_name(args.bug)
        factories = bug.factories
        if args.kind not in (None, bug.kind) or args.mode not in (None, *bug.modes):
            console.print(f"[red]--bug {bug.name} affects kind {bug.kind}, modes {list(bug.modes)}; "
                          f"got --kind {args.kind} --mode {args.mode}[/]")
            return 2
        configs = [(bug.kind, args.mode or bug.modes[0])]
        if not target.is_impl:
            console.print(f"[red]--bug cannot be combined with --target {target.name}[/]")
            return 2
    # mlx-lm has no in-place switch, and Int8 never writes in place: one
    # setting is enough there (both would run the same campaign twice)
    inplace_settings = _inplace_settings(args.inplace) if target.is_impl else [True]
    runs = [(k, m, ip) for k, m in configs for ip in (inplace_settings if m == "fp16" else inplace_settings[:1])]
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    budget = args.budget / len(runs)
    on = "" if target.is_impl else f", target {target.name}"
    table = Table(title=f"kvspec fuzz (seed {seed}, {args.budget:.0f} s{on})")
    for col in ("config", "examples", "steps", "ops/s", "result"):
        table.add_column(col, no_wrap=True)
    reached: list[str] = []
    failed = []
    for kind, mode, inplace in runs:
        rep = campaign(kind, mode, inplace, budget, seed, factories, target=None if target.is_impl else target)
        result = "ok"
        if rep.failure is not None:
            result = "FAILED"
            failed.append((rep, kind, mode, inplace))
        ops = rep.stats.get("ops", 0)
        table.add_row(rep.config, str(rep.examples), str(ops), f"{ops / max(rep.seconds, 1e-9):.0f}", result)
        reached.append(f"[bold]{rep.config}[/] reached: {_stats_text(rep.stats)}")
    console.print(table)
    for line in reached:
        console.print(line)
    for rep, kind, mode, inplace in failed:
        assert rep.failure is not None
        console.print(f"[bold red]{rep.config}[/]: {str(rep.failure.error).splitlines()[0]}")
        if rep.failure.trace is not None:
            stem = f"{kind}-{mode}-{'inplace' if inplace else 'copy'}-seed{seed}"
            stem = stem if target.is_impl else f"{target.name}-{stem}"
            path = save_failure(rep.failure.trace, args.out, stem)
            bug = f" --bug {args.bug}" if args.bug else ""
            bug += "" if target.is_impl else f" --target {target.name}"
            console.print(f"  minimal trace written to {path}\n  replay it: kvspec replay {path}{bug}")
    return 1 if failed else 0


# -- conformance ---------------------------------------------------------------
def cmd_conformance(args: argparse.Namespace) -> int:
    """Exit 0 when every divergence found replays 1 on its target and 0 on
    impl (the report is trustworthy), 1 otherwise, 2 for bad arguments.
    Divergences themselves are the report, not an error."""
    from fuzz.commands.conformance import print_report, run_conformance, to_json

    try:
        reports = run_conformance(args.budget, args.seed, args.out, args.classes, args.max_findings)
    except KeyError as exc:
        _console().print(f"[bold red]error[/]: {exc.args[0]}")
        return 2
    doc = to_json(reports, args.seed, args.budget)
    if args.json:
        print(json.dumps(doc))
    else:
        print_report(reports, args.seed, args.budget)
        _console().print(f"minimal traces in {args.out}/ (replay commands: kvspec conformance --json)")
    return 0 if doc["ok"] else 1


# -- verify --------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace) -> int:
    from fuzz.commands.verify import run_verify

    return run_verify(quick=args.quick, as_json=args.json, out=args.out, skip_proofs=args.skip_proofs)


def cmd_mutants(args: argparse.Namespace) -> int:
    from fuzz.commands.mutants import main as mutants_main

    return mutants_main(args.seeds, args.json, args.out, args.only)


def cmd_bench(args: argparse.Namespace) -> int:
    from fuzz.commands.bench import run

    return run(args.contexts, args.json)


def cmd_e2e(args: argparse.Namespace) -> int:
    from fuzz.commands.e2e import main as e2e_main

    try:
        return e2e_main(long=args.long, as_json=args.json, bug=args.bug, only=args.only)
    except KeyError as exc:
        _console().print(f"[bold red]error[/]: {exc.args[0]}")
        return 2


def cmd_prove(args: argparse.Namespace) -> int:
    try:
        from proofs.cli import main as prove_main
    except ImportError as exc:  # pragma: no cover - proofs ship with the repo
        print(f"proofs are not available: {exc}", file=sys.stderr)
        return 2
    return prove_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvspec", description="Verified KV caches: spec, proofs, MLX implementation, fuzzing.")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("replay", help="replay a kvtrace on the spec and the implementation")
    r.add_argument("trace")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.add_argument("--bug", help="replay against an injected bug from the catalog instead of the real implementation")
    r.add_argument("--isolation-only", action="store_true",
                   help="do not compare in-place decisions: only a holder's bytes changing can reveal an unsafe write")
    r.add_argument("--target", default="impl", choices=TARGET_NAMES,
                   help="implementation to replay on: impl (ours, default) or mlx-lm's caches (docs/conformance.md)")
    r.add_argument("--waive", action="append", choices=WAIVABLE, metavar="OBSERVABLE",
                   help="do not compare this observable (or masks); repeatable; what a conformance finding was found with")
    r.set_defaults(fn=cmd_replay)

    f = sub.add_parser("fuzz", help="run a differential fuzz campaign")
    f.add_argument("--kind", choices=list(kinds.trace_kinds()))
    f.add_argument("--mode", choices=list(kinds.all_modes()))
    f.add_argument("--inplace", choices=["on", "off", "both"], default="both", help="the KV_INPLACE_WRITE switch")
    f.add_argument("--budget", type=float, default=60.0, help="seconds in all (default 60)")
    f.add_argument("--seed", type=int, help="first seed (default: from the clock; printed)")
    f.add_argument("--bug", help="fuzz an injected bug from the catalog (expect a failure)")
    f.add_argument("--out", default=DEFAULT_OUT, help=f"folder for failure traces (default {DEFAULT_OUT})")
    f.add_argument("--target", default="impl", choices=TARGET_NAMES, help="implementation to fuzz (default impl)")
    f.set_defaults(fn=cmd_fuzz)

    c = sub.add_parser("conformance", help="fuzz mlx-lm's own caches against the spec and report what diverges")
    c.add_argument("--budget", type=float, default=120.0, help="seconds in all, split over the classes (default 120)")
    c.add_argument("--seed", type=int, default=CONFORMANCE_SEED, help=f"first seed (default {CONFORMANCE_SEED})")
    c.add_argument("--out", default=DEFAULT_OUT + "/conformance", help="folder for the minimal traces")
    c.add_argument("--class", dest="classes", action="append", metavar="CLASS",
                   help="an mlx-lm class to fuzz (repeatable; default all)")
    c.add_argument("--max-findings", type=int, default=8, help="divergences per class at most (default 8)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=cmd_conformance)

    v = sub.add_parser("verify", help="traces, fixed-seed campaigns, injected bugs, proofs: one table")
    v.add_argument("--quick", action="store_true", help="short budgets (what make test runs)")
    v.add_argument("--json", action="store_true")
    v.add_argument("--skip-proofs", action="store_true")
    v.add_argument("--out", default=DEFAULT_OUT)
    v.set_defaults(fn=cmd_verify)

    mu = sub.add_parser("mutants", help="fuzz every injected bug of the catalog from N seeds: the kill matrix")
    mu.add_argument("--seeds", type=int, default=5, help="seeds per bug (default 5)")
    mu.add_argument("--json", action="store_true")
    mu.add_argument("--out", default=DEFAULT_OUT + "/mutants", help="folder for the minimal traces")
    mu.add_argument("--only", nargs="*", help="bug names (default: the whole catalog)")
    mu.set_defaults(fn=cmd_mutants)

    be = sub.add_parser("bench", help="the cost contract as ratios: in-place vs copying decode, logical vs physical rollback")
    be.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    be.add_argument("--json", action="store_true")
    be.set_defaults(fn=cmd_bench)

    e = sub.add_parser("e2e", help="real decoding: the caches inside mlx-lm models, byte-identical to the references")
    e.add_argument("--long", action="store_true", help="longer streams, wider windows, four seeds (under ~3 min)")
    e.add_argument("--json", action="store_true")
    e.add_argument("--bug", help="run on an injected bug from the catalog (exit 0 when a scenario catches it)")
    e.add_argument("--only", nargs="*", help="scenario names (default: all)")
    e.set_defaults(fn=cmd_e2e)

    pr = sub.add_parser("prove", help="Z3 proofs and CrossHair contracts of the spec", add_help=False)
    pr.add_argument("rest", nargs=argparse.REMAINDER)
    pr.set_defaults(fn=cmd_prove)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["prove"]:
        # prove's options belong to proofs.cli; argparse would eat them.
        from proofs.cli import main as prove_main

        return prove_main(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())


__all__ = ["Any", "build_parser", "main"]
