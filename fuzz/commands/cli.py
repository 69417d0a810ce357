"""The ``kvspec`` command: replay, fuzz, verify, prove.

A thin layer: every command calls into ``fuzz`` (or ``proofs`` for
``prove``) and only formats what comes back.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fuzz import kinds
from fuzz.targets import BUILTIN

DEFAULT_OUT = "fuzz-failures"
# the registry is data (fuzz/kinds.py): reading it loads no MLX
CONFIGS = kinds.configs()
# fuzz.targets loads no MLX: the parser may read the built-in target names
TARGET_NAMES = list(BUILTIN)
TARGET_HELP = ("implementation: " + ", ".join(TARGET_NAMES) + ", an installed kvspec.targets entry point, "
               "SCHEME:REST for a registered target scheme, or MODULE:ATTR naming a cache class or a "
               "Target in another package (docs/targets.md)")
WAIVABLE = ["offset", "live_start", "live_len", "capacity", "idx", "trimmable", "trimmable_rows", "masks"]
CONFORMANCE_SEED = 20261129


def _console() -> Console:
    return Console(highlight=False, soft_wrap=True)


def _target(args: argparse.Namespace) -> Any:
    """The ``--target`` (and ``--waive``) of a command as a fuzz.targets.Target.
    Raises TargetError (a KeyError) naming the known targets."""
    from fuzz.targets import resolve

    target = resolve(getattr(args, "target", None) or "impl")
    for what in getattr(args, "waive", None) or []:
        target = target.waiving(what)
    return target


def _usage_error(console: Console, message: str, as_json: bool = False, **extra: Any) -> int:
    """A bad argument or a target that cannot do what was asked: one line
    naming it, exit 2 (never a traceback); with ``as_json`` one JSON object
    (``{"ok": false, "exit": 2, "error": message, ...}``)."""
    if as_json:
        print(json.dumps({"ok": False, "exit": 2, "error": message, **extra}))
    else:
        console.print(f"[bold red]error[/]: {escape(message)}")
    return 2


class _UsageError(Exception):
    """A bad argument found inside a command (exit 2 with its message)."""


def _find_bug(name: str, flag: str = "--bug", batch_ok: bool = False) -> Any:
    """The catalog entry ``name``; raises _UsageError naming the problem. A
    batch-cache bug (``fuzz/bugs/batch.py``) has no kvtrace kind: only
    ``batch_ok`` commands (``kvspec e2e``) take it."""
    from fuzz import device
    from fuzz.bugs import UnknownBugError, by_name

    try:
        bug = by_name(name)
    except UnknownBugError as exc:
        raise _UsageError(f"{flag}: {exc}") from None
    if bug.kind == "batch" and not batch_ok:
        raise _UsageError(f"{flag} {name}: a batch-cache bug has no kvtrace kind to fuzz or replay; see it caught "
                          f"with kvspec e2e --only batch --bug {name} (kvspec verify runs it through the batch "
                          "lockstep, row 'batch bugs')")
    if bug.device == "gpu" and device.current() != "gpu":
        raise _UsageError(f"{flag} {name}: a GPU-only injected bug (it breaks the CUDA write layer); "
                          "run it with --device gpu on a machine with MLX's CUDA backend")
    return bug


def _bug(console: Console, name: str, flag: str = "--bug", as_json: bool = False, batch_ok: bool = False) -> Any:
    """The catalog entry ``name``, or None after printing the known names."""
    try:
        return _find_bug(name, flag, batch_ok)
    except _UsageError as exc:
        _usage_error(console, str(exc), as_json)
        return None


class _Ticker:
    """Progress of a long command on stderr: a live status line on a
    terminal, otherwise a plain line at most every ``every`` seconds."""

    def __init__(self, console: Console, every: float = 5.0):
        self.console, self.every = console, every
        self.label: str | None = None
        self.last = 0.0
        self.status: Any = None

    def start(self, label: str) -> None:
        self.label, self.last = label, time.monotonic()
        if self.console.is_terminal:
            if self.status is None:
                self.status = self.console.status(label)
                self.status.start()
            self.status.update(label)

    def tick(self, text: str) -> None:
        line = f"{self.label}: {text}"
        if self.status is not None:
            self.status.update(line)
        elif time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            self.console.print(line, markup=False)

    def done(self, text: str) -> None:
        self.console.print(text, markup=False)
        self.label = None

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


# -- replay --------------------------------------------------------------------
def cmd_replay(args: argparse.Namespace) -> int:
    """Exit 0 agree, 1 diverged, 3 a trace check fails on the spec, 2 for an
    invalid trace, a bad argument or a target that cannot run the trace
    (every case in text and in ``--json``)."""
    from fuzz.replay import EXIT_DIVERGED, EXIT_INVALID, EXIT_OK, EXIT_TRACE_CHECK, replay
    from fuzz.targets import TargetCapabilityError, TargetError
    from fuzz.trace import TraceFormatError, load

    console = _console()
    target: Any = None
    try:
        trace = load(args.trace)
        target = _target(args)
        if args.bug:
            target = target.with_bug(_find_bug(args.bug))
        result = replay(trace, check_inplace=not args.isolation_only, target=target)
    except TargetCapabilityError as exc:
        if args.json:
            print(json.dumps({"ok": False, "exit": EXIT_INVALID, "unsupported": str(exc), "target": target.label,
                              "trace": args.trace}))
        else:
            console.print(f"[bold red]target cannot run it[/] {args.trace}: {escape(str(exc))}")
        return EXIT_INVALID
    except TraceFormatError as exc:
        if args.json:
            print(json.dumps({"ok": False, "exit": EXIT_INVALID, "invalid": str(exc), "trace": args.trace}))
        else:
            console.print(f"[bold red]invalid kvtrace[/] {args.trace}: {escape(str(exc))}")
        return EXIT_INVALID
    except (TargetError, _UsageError) as exc:
        return _usage_error(console, str(exc), args.json, trace=args.trace)
    code = EXIT_OK
    if not result.ok:
        assert result.divergence is not None
        code = EXIT_TRACE_CHECK if result.divergence.trace_check else EXIT_DIVERGED
    if args.json:
        print(json.dumps({**result.to_json(), "trace": args.trace, "target": target.label, "exit": code}))
        return code
    if result.not_compared:
        console.print(f"note: target {escape(target.label)} does not compare {', '.join(result.not_compared)} "
                      "(declared, or not an attribute of its class)")
    if result.ok:
        who = "implementation" if target.is_impl else f"target {target.label}"
        console.print(f"[green]ok[/] {args.trace}: {result.ops_run} ops, spec and {escape(who)} agree")
        for i, m in result.refusals:
            if trace.ops[i].get("error") is not True:
                # Agreement, but a refusal the trace did not ask for is often
                # a typo in a name: say so rather than pass silently.
                console.print(f'  note: op {i} was refused by both sides and has no "error": true: {escape(m)}')
        return EXIT_OK
    who = "impl" if target.is_impl else target.label
    if code == EXIT_TRACE_CHECK:
        console.print(f"[bold yellow]trace check failed[/] {args.trace}: the trace expects what the spec does not do")
    else:
        console.print(f"[bold red]diverged[/] {args.trace}: spec and {escape(who)} disagree")
    console.print(escape(str(result.divergence)))
    if target.is_impl:
        console.print(f"  see it: {escape(render_command(args.trace, args.bug, args.isolation_only))}")
    elif result.divergence is not None and result.divergence.what.startswith("adapter "):
        console.print(f"  the trace so far: ops 0 to {result.divergence.index} of {escape(args.trace)} reproduce it")
    return code


def render_command(trace: str, bug: str | None = None, isolation_only: bool = False) -> str:
    """The ``kvspec render`` command that draws a failing trace (what replay
    and fuzz print after a divergence)."""
    import shlex

    out = str(Path(trace).with_suffix(".html"))
    parts = ["kvspec", "render", trace, "--html", "-o", out]
    if bug:
        parts += ["--bug", bug]
    if isolation_only:
        parts.append("--isolation-only")
    return " ".join(shlex.quote(p) for p in parts)


# -- render --------------------------------------------------------------------
def cmd_render(args: argparse.Namespace) -> int:
    from fuzz.render import page, svg, timeline
    from fuzz.replay import EXIT_INVALID, EXIT_OK
    from fuzz.trace import TraceFormatError, load

    console = _console()
    html = args.html or str(args.output or "").endswith((".html", ".htm"))
    out = args.output or str(Path(args.trace).with_suffix(".html" if html else ".svg"))
    try:
        trace = load(args.trace)
        factories = None
        if args.bug:
            bug = _bug(console, args.bug)
            if bug is None:
                return EXIT_INVALID
            if bug.kind != trace.cache["kind"]:
                raise KeyError(f"--bug {bug.name} patches the {bug.kind} cache; this trace is kind {trace.cache['kind']}")
            factories = bug.factories
        tl = timeline(trace, factories, args.bug, check_inplace=not args.isolation_only)
    except TraceFormatError as exc:
        console.print(f"[bold red]invalid kvtrace[/] {escape(args.trace)}: {escape(str(exc))}")
        return EXIT_INVALID
    except KeyError as exc:
        console.print(f"[bold red]error[/]: {escape(str(exc.args[0]))}")
        return EXIT_INVALID
    text = page(tl, args.trace) if html else svg(tl)
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    except OSError as exc:
        return _usage_error(console, f"-o/--output: cannot write {out}: {exc.strerror or exc}")
    what = "no divergence"
    if tl.divergence is not None:
        what = f"first divergence at op {tl.divergence.index}: {tl.divergence.what}"
        if tl.rule is not None:
            what += f" ({tl.rule.cite()}, {tl.rule.function})"
    console.print(f"wrote {escape(out)}: {len(tl.frames)} ops, {escape(what)}")
    return EXIT_OK


# -- rows ----------------------------------------------------------------------
def cmd_rows(args: argparse.Namespace) -> int:
    """Print the K and V rows every append of a trace writes, one line per
    token and side: ``TOKEN k|v`` and the ``B * H * D`` elements in C order
    (batch, head, column), as bit patterns in hex (``--format hex``, the
    default; what adapters compare with) or as values (``--format values``)."""
    from fuzz.trace import TraceFormatError, load

    console = _console()
    try:
        trace = load(args.trace)
    except TraceFormatError as exc:
        console.print(f"[bold red]invalid kvtrace[/] {args.trace}: {exc}")
        return 2
    cache = trace.cache
    scheme = cache.get("rows", "numpy")
    dtype = cache["dtype"]
    b, h = cache["batch"], cache["kv_heads"]
    dk, dv = cache.get("k_head_dim") or cache["head_dim"], cache.get("v_head_dim") or cache["head_dim"]
    # what the harness hands in (fuzz.lockstep.Lockstep.wide_rows): wide
    # rows for unquantized storage
    wide = cache.get("mode", "fp16") == "fp16"
    total = sum(op["n"] for op in trace.ops if op["op"] == "append")
    first, count = args.first, total - args.first if args.count is None else args.count
    if first < 0 or count < 0 or first + count > total:
        return _usage_error(console, f"--first/--count: the trace appends tokens 0 to {total - 1}; "
                                     f"got --first {first} --count {count}")
    try:
        _write_rows(args, trace, scheme, dtype, (b, h, dk, dv), wide, first, count)
    except BrokenPipeError:  # `kvspec rows T | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _write_rows(args: argparse.Namespace, trace: Any, scheme: str, dtype: str, shape: tuple[int, int, int, int],
                wide: bool, first: int, count: int) -> None:
    import numpy as np

    from fuzz.rows import rows as row_values

    b, h, dk, dv = shape
    out = sys.stdout
    out.write(f"# rows of {args.trace}: {scheme} rows, {dtype}, wide {'on' if wide else 'off'}, "
              f"K [{b}, {h}, 1, {dk}], V [{b}, {h}, 1, {dv}]; tokens {first} to {first + count - 1}\n")
    chunk = 4096
    for start in range(first, first + count, chunk):
        tokens = list(range(start, min(start + chunk, first + count)))
        sides = [row_values(tokens, side, b, h, d, dtype, wide, scheme) for side, d in (("k", dk), ("v", dv))]
        for j, t in enumerate(tokens):
            for side, arr in zip("kv", sides):
                x = np.ascontiguousarray(arr[:, :, j, :]).reshape(-1)
                if args.format == "values":
                    cells = [repr(float(v)) for v in x]
                elif dtype == "float16":
                    cells = [f"{v:04x}" for v in x.view(np.uint16)]
                elif dtype == "bfloat16":
                    cells = [f"{v >> 16:04x}" for v in x.astype(np.float32).view(np.uint32)]
                else:
                    cells = [f"{v:08x}" for v in x.view(np.uint32)]
                out.write(f"{t} {side} {' '.join(cells)}\n")
    out.flush()


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
    """Exit 0 when every campaign ran examples and found nothing, 1 when one
    failed (its minimal trace is written), 2 for bad arguments, 130 when
    interrupted (the seed and a rerun command are printed)."""
    from fuzz.campaign import campaign, save_failure

    console = _console()
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        target = _target(args)
    except KeyError as exc:
        return _usage_error(console, str(exc.args[0]), args.json)
    # a target runs the configs it has a class for (fuzz/targets.py)
    have = target.configs()
    configs = [(k, m) for k, m in have if (args.kind in (None, k)) and (args.mode in (None, m))]
    if not configs:
        return _usage_error(console, f"no implementation for kind={args.kind} mode={args.mode} on target "
                                     f"{target.label}; have {', '.join(f'{k}/{m}' for k, m in have)}", args.json)
    factories = None
    if args.bug:
        bug = _bug(console, args.bug, as_json=args.json)
        if bug is None:
            return 2
        factories = bug.factories
        if args.kind not in (None, bug.kind) or args.mode not in (None, *bug.modes):
            return _usage_error(console, f"--bug {bug.name} affects kind {bug.kind}, modes {', '.join(bug.modes)}; "
                                         f"got --kind {args.kind} --mode {args.mode}", args.json)
        configs = [(bug.kind, args.mode or bug.modes[0])]
        if not target.is_impl:
            return _usage_error(console, f"--bug cannot be combined with --target {target.label}", args.json)
    # mlx-lm has no in-place switch, and Int8 never writes in place: one
    # setting is enough there (both would run the same campaign twice)
    # an exec: adapter that takes the "inplace" cache field runs both settings too
    switchable = target.is_impl or getattr(target, "takes_inplace", False)
    inplace_settings = _inplace_settings(args.inplace) if switchable else [True]
    runs = [(k, m, ip) for k, m in configs for ip in (inplace_settings if m == "fp16" else inplace_settings[:1])]
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    budget = args.budget / len(runs)
    on = "" if target.is_impl else f", target {target.label}"
    rerun = f"kvspec fuzz --seed {seed} --budget {args.budget:g}" + "".join(
        f" --{k} {v}" for k, v in (("kind", args.kind), ("mode", args.mode), ("bug", args.bug)) if v) + (
        f" --inplace {args.inplace}" if args.inplace != "both" else "") + ("" if target.is_impl else f" --target {target.label}")
    err.print(f"kvspec fuzz: seed {seed}, {args.budget:g} s over {len(runs)} campaign{'s' * (len(runs) > 1)}{on}")
    progress = _Ticker(err)
    reports: list[tuple[Any, str, str, bool]] = []
    interrupted: str | None = None
    try:
        for kind, mode, inplace in runs:
            label = f"{kind}/{mode}/{'inplace' if inplace else 'copy'}"
            progress.start(label)
            rep = campaign(kind, mode, inplace, budget, seed, factories, target=None if target.is_impl else target,
                           progress=progress.tick)
            progress.done(f"{rep.config}: {rep.examples} examples, {rep.stats.get('ops', 0)} ops, "
                          f"{'FAILED' if rep.failure is not None else 'ok'} ({rep.seconds:.1f} s)")
            reports.append((rep, kind, mode, inplace))
    except KeyboardInterrupt:
        interrupted = progress.label or "?"
    finally:
        progress.stop()
    rows = []
    failed = False
    for rep, kind, mode, inplace in reports:
        ops = rep.stats.get("ops", 0)
        row: dict[str, Any] = {"config": rep.config, "examples": rep.examples, "steps": ops,
                               "seconds": round(rep.seconds, 2), "result": "ok", "reached": rep.stats}
        if rep.examples == 0:
            row["result"], failed = "no examples", True  # a run that checked nothing never says ok
        if rep.failure is not None:
            failed = True
            row["result"] = "FAILED"
            row["failure"] = str(rep.failure.error).splitlines()[0]
            if rep.failure.trace is not None:
                stem = f"{kind}-{mode}-{'inplace' if inplace else 'copy'}-seed{seed}"
                stem = stem if target.is_impl else re.sub(r"[^A-Za-z0-9_.-]+", "_", target.label) + f"-{stem}"
                path = save_failure(rep.failure.trace, args.out, stem)
                extra = f" --bug {args.bug}" if args.bug else ""
                extra += "" if target.is_impl else f" --target {shlex.quote(target.label)}"
                row["trace"], row["replay"] = str(path), f"kvspec replay {path}{extra}"
                if target.is_impl:
                    row["render"] = render_command(str(path), args.bug)
        rows.append(row)
    code = 130 if interrupted else (1 if failed else 0)
    # what the target's classes declare they do not do: skipped and reported
    declared = {} if target.is_impl else {
        f"{c.name} ({c.kind}/{c.mode})": {"skipped": dict(c.skipped), "not_compared": dict(c.not_compared)}
        for c in target.classes if (c.kind, c.mode) in configs}
    if args.json:
        print(json.dumps({"seed": seed, "budget": args.budget, "target": target.label, "ok": code == 0,
                          "interrupted": interrupted, "rerun": rerun, "runs": rows, "declared": declared,
                          "exit": code}))
        return code
    table = Table(title=f"kvspec fuzz (seed {seed}, {args.budget:g} s{on})")
    for col in ("config", "examples", "steps", "ops/s", "result"):
        table.add_column(col, no_wrap=col != "config")
    for row in rows:
        rate = row["steps"] / max(row["seconds"], 1e-9)
        style = "" if row["result"] == "ok" else "[bold red]"
        table.add_row(row["config"], str(row["examples"]), str(row["steps"]), f"{rate:.0f}",
                      f"{style}{row['result']}{'[/]' if style else ''}")
    console.print(table)
    for row in rows:
        console.print(f"[bold]{row['config']}[/] reached: {_stats_text(row['reached'])}")
    for name, d in declared.items():
        for what, items in (("skipped (not in the class)", d["skipped"]), ("not compared", d["not_compared"])):
            if items:
                console.print(f"[bold]{escape(name)}[/] {what}: "
                              + "; ".join(f"{escape(k)} ({escape(v)})" for k, v in items.items()))
    for row in rows:
        if row["result"] == "no examples":
            console.print(f"[bold red]{row['config']}[/]: ran no example in its budget; nothing was checked")
        if "failure" in row:
            console.print(f"[bold red]{row['config']}[/]: {escape(row['failure'])}")
            if "trace" in row:
                console.print(f"  minimal trace written to {row['trace']}\n  replay it: {row['replay']}")
                if "render" in row:
                    console.print(f"  see it: {escape(row['render'])}")
    if interrupted:
        console.print(f"[bold yellow]interrupted[/] during {interrupted}: seed {seed}\n  rerun: {rerun}")
    return code


# -- conformance ---------------------------------------------------------------
def cmd_conformance(args: argparse.Namespace) -> int:
    """Exit 0 when every divergence found replays 1 on its target and 0 on
    impl (the report is trustworthy), 1 otherwise, 2 for bad arguments.
    Divergences themselves are the report, not an error."""
    from fuzz.commands.conformance import print_report, run_conformance, to_json

    try:
        reports = run_conformance(args.budget, args.seed, args.out, args.classes, args.max_findings, args.target)
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

    if args.jobs is not None and args.jobs < 1:
        _console().print(f"[red]--jobs: must be >= 1, got {args.jobs}[/]")
        return 2
    return run_verify(quick=args.quick, as_json=args.json, out=args.out, skip_proofs=args.skip_proofs, jobs=args.jobs)


def cmd_mutants(args: argparse.Namespace) -> int:
    from fuzz.commands.mutants import main as mutants_main

    console = _console()
    for name in args.only or []:
        if _bug(console, name, "--only") is None:
            return 2
    return mutants_main(args.seeds, args.json, args.out, args.only)


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fuzz.commands.bench import run, run_suite

    if args.record:
        # made (or refused) before a run of minutes, not after it
        try:
            Path(args.record).mkdir(parents=True, exist_ok=True)
            probe = Path(args.record) / ".kvspec-write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            return _usage_error(_console(), f"--record: {args.record} must be a folder this user can create and "
                                            f"write into ({exc.strerror or exc})")
    if not (args.decoder or args.e2e or args.record):
        return run(args.contexts, args.json)
    return run_suite(args.contexts, decoder=args.decoder, e2e=args.e2e, layers=args.layers, rounds=args.rounds,
                     e2e_contexts=args.e2e_contexts, tokens=args.tokens, repeats=args.repeats, as_json=args.json,
                     record=args.record)


def cmd_e2e(args: argparse.Namespace) -> int:
    from fuzz.commands.e2e import main as e2e_main

    if args.bug and _bug(_console(), args.bug, batch_ok=True) is None:
        return 2
    try:
        return e2e_main(long=args.long, as_json=args.json, bug=args.bug, only=args.only)
    except KeyError as exc:
        return _usage_error(_console(), str(exc.args[0]))


def cmd_prove(args: argparse.Namespace) -> int:
    try:
        from proofs.cli import main as prove_main
    except ImportError as exc:  # pragma: no cover - proofs ship with the repo
        print(f"proofs are not available: {exc}", file=sys.stderr)
        return 2
    return prove_main(args.rest)


# -- arguments ---------------------------------------------------------------------
MAX_SECONDS = 7 * 24 * 3600.0


def positive_seconds(text: str) -> float:
    """A budget in seconds: a finite number > 0 and at most a week."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0 or value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be finite, > 0 and <= {MAX_SECONDS:g} seconds, got {text!r}")
    return value


def int_in(lo: int, hi: int):
    """An argparse type: an integer in ``[lo, hi]``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {value}")
        return value

    parse.__name__ = f"integer in [{lo}, {hi}]"
    return parse


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, defaults after every option's help."""


EXIT_CODES = {
    "replay": "exit status: 0 spec and implementation agree and every check holds; 1 they disagree (a "
              "divergence); 2 invalid trace or arguments; 3 a check the trace carries fails on the spec "
              "(the trace expects what the spec does not do)",
    "fuzz": "exit status: 0 every campaign ran examples and found nothing; 1 a divergence (its minimal trace is "
            "written and a replay command printed) or a campaign that ran no example; 2 bad arguments; "
            "130 interrupted (seed and rerun command printed)",
    "rows": "exit status: 0 the rows were printed, 2 the file is not a valid kvtrace or an argument is wrong",
    "conformance": "exit status: 0 every finding replays on its target and not on ours (the report is "
                   "trustworthy); 1 otherwise; 2 bad arguments",
    "verify": "exit status: 0 every check passes; 1 one fails; 2 bad arguments; 130 interrupted (the checks "
              "that finished are printed)",
    "mutants": "exit status: 0 every injected bug caught in every seed with a clean trace; 1 otherwise; "
               "2 bad arguments; 130 interrupted",
    "bench": "exit status: 0 measured; 2 bad arguments",
    "render": "exit status: 0 the picture was written (whether or not the trace diverges); 2 invalid trace, "
              "arguments or output path",
    "e2e": "exit status: 0 every scenario passes (with --bug: the bug went unnoticed); 1 a scenario "
           "diverged (with --bug: the bug was caught); 2 bad arguments",
}


def _epilog(command: str, bug_names: list[str] | None, extra: str = "") -> str:
    parts = [EXIT_CODES[command]]
    if bug_names is not None and command in ("replay", "render", "fuzz", "mutants", "e2e"):
        parts.append("injected bugs (--bug / --only): " + ", ".join(bug_names))
    if extra:
        parts.append(extra)
    return "\n\n".join(parts)


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kvspec")
    except metadata.PackageNotFoundError:  # running from a checkout without install
        import tomllib
        from pathlib import Path

        with open(Path(__file__).resolve().parents[2] / "pyproject.toml", "rb") as fh:
            return str(tomllib.load(fh)["project"]["version"])


def build_parser(bug_names: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``kvspec`` parser. ``bug_names`` (the catalog, listed in the
    help of the commands that take one) is given only when help is asked
    for: reading the catalog loads MLX."""
    p = argparse.ArgumentParser(
        prog="kvspec", formatter_class=_Formatter,
        description="Verified KV caches: an executable spec, proofs, MLX caches, and differential fuzzing of "
                    "the caches against the spec. Trace format: docs/kvtrace.md; the contract: docs/semantics.md.")
    p.add_argument("--version", action="version", version=f"kvspec {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subs: dict[str, argparse.ArgumentParser] = {}

    def add(name: str, help: str, description: str, extra: str = "") -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=description, formatter_class=_Formatter,
                            epilog=_epilog(name, bug_names, extra))
        subs[name] = sp
        return sp

    r = add("replay", "replay a kvtrace on the spec and an implementation",
            "Run a kvtrace (docs/kvtrace.md) on the executable spec and on an implementation in lockstep, "
            "comparing every op's result, the windows of the cache and every snapshot, and the physical "
            "observables; stop at the first disagreement and print it.")
    r.add_argument("trace", help="the kvtrace file (JSON)")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.add_argument("--bug", help="replay on an injected bug of the catalog instead of the real implementation")
    r.add_argument("--isolation-only", action="store_true",
                   help="do not compare in-place decisions: only a holder's bytes changing can reveal an unsafe write")
    r.add_argument("--target", default="impl", help=TARGET_HELP)
    r.add_argument("--waive", action="append", choices=WAIVABLE, metavar="OBSERVABLE",
                   help=f"do not compare this observable (repeatable; one of {', '.join(WAIVABLE)})")
    r.set_defaults(fn=cmd_replay)

    rd = add("render", "draw a kvtrace as a timeline (SVG, or an HTML page with --html)",
             "Replay a kvtrace as `kvspec replay` does and draw the spec's state after every op: one column "
             "per op, the live window and every holder's and sequence's view as rows of token identities, "
             "the physical buffers (capacity, dead tail, ownership marker, ring cursor, undo log, block "
             "tables), each write in place or copying, refusals, and the first divergence outlined with "
             "the rule it broke and the spec function that states it (docs/render.md).")
    rd.add_argument("trace", help="the kvtrace file (JSON)")
    rd.add_argument("-o", "--output", help="file to write (default: the trace's name with .svg or .html)")
    rd.add_argument("--html", action="store_true", help="write an HTML page (the picture, the divergence, the ops)")
    rd.add_argument("--bug", help="replay on an injected bug of the catalog instead of the real implementation")
    rd.add_argument("--isolation-only", action="store_true", help="do not compare in-place decisions (as replay)")
    rd.set_defaults(fn=cmd_render)

    rw = add("rows", "print the rows a kvtrace appends (their bytes, per token)",
             "Print the K and V contents of every row the trace's appends write, in the trace's dtype and row "
             "scheme (cache.rows: numpy, or portable: docs/kvtrace.md \"Portable rows\"): one line per token "
             "and side, the elements in C order (batch, head, column).")
    rw.add_argument("trace", help="the kvtrace file (JSON)")
    rw.add_argument("--format", choices=["hex", "values"], default="hex",
                    help="hex: bit patterns (4 hex digits for float16 and bfloat16, 8 for float32); values: numbers")
    rw.add_argument("--first", type=int_in(0, 2**24), default=0, help="first token identity printed")
    rw.add_argument("--count", type=int_in(0, 2**24), default=None, help="tokens printed (default: to the last)")
    rw.set_defaults(fn=cmd_rows)

    f = add("fuzz", "run a differential fuzz campaign",
            "Hypothesis state machines drive the spec and an implementation with random ops; the first "
            "disagreement is shrunk to a minimal kvtrace, written to --out, with the command that replays it.")
    f.add_argument("--kind", choices=list(kinds.trace_kinds()), help="cache kind (default: every kind)")
    f.add_argument("--mode", choices=list(kinds.all_modes()), help="storage mode (default: every implemented mode)")
    f.add_argument("--inplace", choices=["on", "off", "both"], default="both", help="the KV_INPLACE_WRITE switch")
    f.add_argument("--budget", type=positive_seconds, default=60.0, help="seconds in all, split over the campaigns")
    f.add_argument("--seed", type=int_in(0, 2**32 - 1), help="first seed (default: from the clock; printed first)")
    f.add_argument("--bug", help="fuzz an injected bug of the catalog (expect a failure)")
    f.add_argument("--out", default=DEFAULT_OUT, help="folder for failure traces")
    f.add_argument("--target", default="impl", help=TARGET_HELP)
    f.add_argument("--json", action="store_true", help="print one JSON object")
    f.set_defaults(fn=cmd_fuzz)

    c = add("conformance", "fuzz mlx-lm's own caches against the spec and report what diverges",
            "Fuzz mlx-lm's cache classes against the spec and report every divergence with a minimal trace "
            "(docs/conformance.md).")
    c.add_argument("--budget", type=positive_seconds, default=120.0, help="seconds in all, split over the classes")
    c.add_argument("--seed", type=int_in(0, 2**32 - 1), default=CONFORMANCE_SEED, help="first seed")
    c.add_argument("--out", default=DEFAULT_OUT + "/conformance", help="folder for the minimal traces")
    c.add_argument("--target", default=None,
                   help="the engine whose classes to fuzz (default: mlx-lm's KVCache, QuantizedKVCache, "
                        "ConcatenateKVCache, RotatingKVCache); e.g. transformers, or any target of docs/targets.md")
    c.add_argument("--class", dest="classes", action="append", metavar="CLASS",
                   help="an mlx-lm class to fuzz (repeatable; default all)")
    c.add_argument("--max-findings", type=int_in(1, 1000), default=8, help="divergences per class at most")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(fn=cmd_conformance)

    v = add("verify", "traces, fixed-seed campaigns, injected bugs, proofs: one table",
            "Everything that must hold, in one table: every regression trace, a fixed-seed campaign per "
            "kind and mode, every injected bug caught, the real-decoding scenarios, the proofs and CrossHair. "
            "The checks run in parallel (-j).")
    v.add_argument("--quick", action="store_true", help="short budgets, no e2e scenarios (what make test runs)")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    v.add_argument("--skip-proofs", action="store_true", help="leave out the proofs and CrossHair")
    v.add_argument("--out", default=DEFAULT_OUT, help="folder for traces")
    v.add_argument("-j", "--jobs", type=int_in(1, 1024), default=None,
                   help="processes to run the checks on (default: every core; 1 runs them in this process)")
    v.set_defaults(fn=cmd_verify)

    mu = add("mutants", "fuzz every injected bug of the catalog from N seeds: the kill matrix",
             "Fuzz every injected bug (and its variants) from seeds 1..N; each must be caught in every seed, "
             "and every failing run must replay clean on the real implementation. Seed 1's counterexample "
             "is shrunk to a minimal trace (the one reported); the others are kept as found.")
    mu.add_argument("--seeds", type=int_in(1, 1000), default=5, help="seeds per bug")
    mu.add_argument("--json", action="store_true", help="print one JSON object")
    mu.add_argument("--out", default=DEFAULT_OUT + "/mutants", help="folder for the traces, one folder per seed")
    mu.add_argument("--only", nargs="+", metavar="BUG", help="these bugs only (default: the whole catalog)")
    mu.set_defaults(fn=cmd_mutants)

    be = add("bench", "the cost contract as ratios: in-place vs copying decode, logical vs physical rollback",
             "Measure the cost contract at growing context lengths, as ratios: decode in place vs copying, "
             "and trim+append rollback with the logical trim vs a physical re-slice. Each step consumes keys "
             "and values as a decoder does.")
    be.add_argument("--contexts", type=int_in(1, 2**20), nargs="+", default=[1024, 8192, 32768],
                    help="context lengths (rows); the last over the first is the ratio column")
    be.add_argument("--json", action="store_true", help="print one JSON object")
    be.add_argument("--decoder", action="store_true",
                    help="also the decoder rows: write + attention over --layers layers, ours beside mlx-lm's caches")
    be.add_argument("--e2e", action="store_true",
                    help="also tokens/s through mlx-lm with random-weight Qwen2.5-7B / Gemma-3-shaped models (GPU)")
    be.add_argument("--layers", type=int_in(1, 256), default=None,
                    help="layers per decoder step (default: 28 on a GPU, 4 on the CPU)")
    be.add_argument("--rounds", type=int_in(2, 10000), default=None, help="timed rounds per row and context")
    be.add_argument("--e2e-contexts", type=int_in(16, 2**20), nargs="+", default=[1024, 8192, 24576],
                    help="prefill lengths of the end-to-end rows")
    be.add_argument("--tokens", type=int_in(4, 100000), default=48, help="tokens decoded per end-to-end run")
    be.add_argument("--repeats", type=int_in(1, 100), default=2, help="end-to-end runs per config (median)")
    be.add_argument("--record", metavar="DIR", help="write the run as a record under DIR: JSON, Markdown, PNG plot")
    be.set_defaults(fn=cmd_bench)

    e = add("e2e", "real decoding: the caches inside mlx-lm models, byte-identical to the references",
            "Run small random-weight mlx-lm models with these caches through generate_step, speculative "
            "decoding and LRUPromptCache, comparing every token and log-probability with the references.")
    e.add_argument("--long", action="store_true", help="longer streams, wider windows, four seeds (under ~3 min)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.add_argument("--bug", help="run on an injected bug of the catalog")
    e.add_argument("--only", nargs="+", metavar="SCENARIO", help="scenario names (default: all)")
    e.set_defaults(fn=cmd_e2e)

    pr = sub.add_parser("prove", help="Z3 proofs and CrossHair contracts of the spec (kvspec prove --help)",
                        add_help=False)
    pr.add_argument("rest", nargs=argparse.REMAINDER)
    pr.set_defaults(fn=cmd_prove)
    for name in ("replay", "fuzz", "verify", "mutants", "bench", "e2e", "conformance"):
        subs[name].add_argument("--device", choices=["cpu", "gpu"], default=None,
                                help="MLX device to run the caches on (default: $KVSPEC_DEVICE, else MLX's default)")
    p.set_defaults(_subparsers=subs)
    return p


def main(argv: list[str] | None = None) -> int:
    """The ``kvspec`` command; returns the exit status (see each command's
    ``--help``). Bad arguments exit 2 with the command's usage, never a
    traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["prove"]:
        # prove's options belong to proofs.cli; argparse would eat them.
        from proofs.cli import main as prove_main

        return prove_main(argv[1:])
    bug_names = None
    if "-h" in argv or "--help" in argv:
        from fuzz.bugs import catalog

        bug_names = [b.name for b in catalog()]
    parser = build_parser(bug_names)
    args, extra = parser.parse_known_args(argv)
    if extra:
        # report on the subcommand's own usage, with a suggestion
        import difflib

        sp = parser.get_default("_subparsers")[args.command]
        known = [o for a in sp._actions for o in a.option_strings]
        hints = [m for x in extra if x.startswith("-") for m in difflib.get_close_matches(x.split("=")[0], known, 1)]
        sp.error(f"unrecognized arguments: {' '.join(extra)}" + (f" (did you mean {', '.join(hints)}?)" if hints else ""))
    if hasattr(args, "device"):
        from fuzz.device import DeviceError, select

        try:
            select(args.device)
        except DeviceError as exc:
            return _usage_error(_console(), str(exc))
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:
        # commands with a summary catch Ctrl-C themselves; the rest stop here
        print(f"kvspec {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())


__all__ = ["Any", "build_parser", "main"]
