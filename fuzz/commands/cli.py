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
from rich.text import Text

from kvspec.fuzz import kinds
from kvspec.fuzz.targets import BUILTIN

DEFAULT_OUT = "fuzz-failures"
#: kvspec.fuzz.campaign.ENGINES, named here without importing MLX for --help
ENGINE_CHOICES = ("program", "stateful")
#: the example database ``kvspec fuzz`` uses unless --db or $KVSPEC_DB says
#: otherwise: Hypothesis's own folder (ignored by git), a subfolder for us
DEFAULT_DB = ".hypothesis/kvspec-examples"
# the registry is data (fuzz/kinds.py): reading it loads no MLX
CONFIGS = kinds.configs()
# kvspec.fuzz.targets loads no MLX: the parser may read the built-in target names
TARGET_NAMES = list(BUILTIN)
TARGET_HELP = ("implementation: " + ", ".join(TARGET_NAMES) + ", an installed kvspec.targets entry point, "
               "SCHEME:REST for a registered target scheme, or MODULE:ATTR naming a cache class or a "
               "Target in another package (docs/targets.md)")
WAIVABLE = ["offset", "live_start", "live_len", "capacity", "idx", "trimmable", "trimmable_rows", "masks"]
CONFORMANCE_SEED = 20261129


def _console() -> Console:
    """The console of every command's output. Names (class names, target
    labels, trace paths, bug names) print literally: no emoji codes
    (``:Ring:`` stays ``:Ring:``), and markup only where a message escapes
    what it interpolates (rich.markup.escape)."""
    return Console(highlight=False, soft_wrap=True, emoji=False)


def _target(args: argparse.Namespace) -> Any:
    """The ``--target`` (and ``--waive``) of a command as a kvspec.fuzz.targets.Target.
    Raises TargetError (a KeyError) naming the known targets."""
    from kvspec.fuzz.targets import resolve

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
    from kvspec.fuzz import device
    from kvspec.fuzz.bugs import UnknownBugError, by_name

    try:
        bug = by_name(name)
    except UnknownBugError as exc:
        raise _UsageError(f"{flag}: {exc}") from None
    if bug.kind == "batch" and not batch_ok:
        raise _UsageError(f"{flag} {name}: a batch-cache bug has no kvtrace kind to fuzz or replay; fuzz it with "
                          f"kvspec fuzz --kind batch --bug {name}, or see it caught "
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
            # Text, not a string: a status line reads strings as markup and emoji codes
            if self.status is None:
                self.status = self.console.status(Text(label))
                self.status.start()
            self.status.update(Text(label))

    def tick(self, text: str) -> None:
        line = f"{self.label}: {text}"
        if self.status is not None:
            self.status.update(Text(line))
        elif time.monotonic() - self.last >= self.every or text.startswith("failure found"):
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
def _trace_paths(items: list[str]) -> tuple[list[str], list[str]]:
    """The kvtrace files named by ``items`` (files as given; a folder: every
    ``*.json`` below it, sorted, but a conformance ``report.json``), and the
    folders that hold none."""
    files, missing = [], []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(str(f) for f in p.rglob("*.json") if f.name != "report.json")
            files += found
            if not found:
                missing.append(f"{item} (a folder with no *.json)")
        else:
            files.append(item)  # a file that cannot be read: load() says why
    return files, missing


#: with several traces, the exit status is the worst one's among the traces
#: the target could run, in this order
_REPLAY_SEVERITY = (2, 1, 3, 0)
#: a replayed trace's ``status`` (JSON) and the words of the folder summary,
#: in the summary's order
REPLAY_STATUSES = ("ok", "diverged", "not applicable", "trace check failed", "invalid", "error", "tool failure")


def _replay_one(path: str, args: argparse.Namespace, console: Console, quiet: bool) -> tuple[int, dict[str, Any]]:
    """Replay one trace; print its lines (not with ``quiet``: --json);
    return its exit status and its JSON object, whose ``status`` is one of
    REPLAY_STATUSES: ``not applicable`` when the target cannot run the trace
    (exit 2 for this trace alone; a folder counts it apart), ``tool
    failure`` when the harness itself raised (exit 2, never a divergence)."""
    from kvspec.fuzz.replay import EXIT_DIVERGED, EXIT_INVALID, EXIT_OK, EXIT_TRACE_CHECK, replay
    from kvspec.fuzz.targets import TargetCapabilityError, TargetError
    from kvspec.fuzz.trace import TraceFormatError, load

    target: Any = None
    try:
        trace = load(path)
        target = _target(args)
        if args.bug:
            target = target.with_bug(_find_bug(args.bug))
        start = time.perf_counter()
        result = replay(trace, check_inplace=not args.isolation_only, target=target)
        seconds = time.perf_counter() - start
    except TargetCapabilityError as exc:
        if not quiet:
            console.print(f"[yellow]not applicable[/] {escape(path)}: target cannot run it: {escape(str(exc))}")
        return EXIT_INVALID, {"ok": False, "exit": EXIT_INVALID, "status": "not applicable", "unsupported": str(exc),
                              "target": target.label, "trace": path}
    except TraceFormatError as exc:
        if not quiet:
            console.print(f"[bold red]invalid kvtrace[/] {escape(path)}: {escape(str(exc))}")
        return EXIT_INVALID, {"ok": False, "exit": EXIT_INVALID, "status": "invalid", "invalid": str(exc),
                              "trace": path}
    except (TargetError, _UsageError) as exc:
        if not quiet:
            console.print(f"[bold red]error[/]: {escape(str(exc))}")
        return EXIT_INVALID, {"ok": False, "exit": EXIT_INVALID, "status": "error", "error": str(exc), "trace": path}
    except Exception as exc:  # noqa: BLE001 - the harness's own failure: said, never a divergence
        what = f"{type(exc).__name__}: {exc}"
        if not quiet:
            console.print(f"[bold red]tool failure[/] {escape(path)}: the harness raised {escape(what)} "
                          "(not a divergence)")
        return EXIT_INVALID, {"ok": False, "exit": EXIT_INVALID, "status": "tool failure", "error": what,
                              "trace": path}
    code, status = EXIT_OK, "ok"
    if not result.ok:
        assert result.divergence is not None
        trace_check = result.divergence.trace_check
        code = EXIT_TRACE_CHECK if trace_check else EXIT_DIVERGED
        status = "trace check failed" if trace_check else "diverged"
    doc = {**result.to_json(), "trace": path, "target": target.label, "exit": code, "status": status,
           "seconds": round(seconds, 3), "kind": trace.cache["kind"]}
    if quiet:
        return code, doc
    if result.not_compared:
        console.print(f"note: target {escape(target.label)} does not compare {', '.join(result.not_compared)} "
                      "(declared, or not an attribute of its class)")
    if result.ok:
        who = "implementation" if target.is_impl else f"target {target.label}"
        console.print(f"[green]ok[/] {escape(path)}: {result.ops_run} ops, spec and {escape(who)} agree")
        for i, m in result.refusals:
            if trace.ops[i].get("error") is not True:
                # Agreement, but a refusal the trace did not ask for is often
                # a typo in a name: say so rather than pass silently.
                console.print(f'  note: op {i} was refused by both sides and has no "error": true: {escape(m)}')
        return code, doc
    who = "impl" if target.is_impl else target.label
    if code == EXIT_TRACE_CHECK:
        console.print(f"[bold yellow]trace check failed[/] {escape(path)}: the trace expects what the spec does not do")
    else:
        console.print(f"[bold red]diverged[/] {escape(path)}: spec and {escape(who)} disagree")
    console.print(escape(str(result.divergence)))
    if not target.is_impl and result.divergence is not None and result.divergence.what.startswith("adapter "):
        console.print(f"  the trace so far: ops 0 to {result.divergence.index} of {escape(path)} reproduce it")
    see = render_command(path, args.bug, args.isolation_only, None if target.is_impl else target.label,
                         getattr(args, "waive", None))
    console.print(f"  see it: {escape(see)}")
    return code, doc


def replay_exit(results: list[tuple[int, dict[str, Any]]], many: bool) -> int:
    """The exit status of a replay of ``results`` (each a trace's exit
    status and JSON object). One trace: its own. Several: the most severe
    among the traces the target could run (2 over 1 over 3 over 0), a trace
    that is not applicable to the target counted apart, not failed; 2 when
    the target could run none of them (nothing was checked)."""
    if not many:
        return results[0][0]
    ran = {c for c, doc in results if doc.get("status") != "not applicable"}
    if not ran:
        return 2
    return next(c for c in _REPLAY_SEVERITY if c in ran or c == 0)


def replay_summary(docs: list[dict[str, Any]], target: str) -> str:
    """The last line of a replay of several traces: the count of each
    status, ``ok``, ``diverged`` and ``not applicable`` always, the others
    when any (``132 traces: 23 ok, 0 diverged, 109 not applicable to target
    exec:./kvspec_dense``)."""
    counts = {s: sum(d.get("status") == s for d in docs) for s in REPLAY_STATUSES}
    parts = [f"{counts['ok']} ok", f"{counts['diverged']} diverged",
             f"{counts['not applicable']} not applicable to target {target}"]
    parts += [f"{counts[s]} {s}" for s in REPLAY_STATUSES[3:] if counts[s]]
    return f"{len(docs)} trace{'s' if len(docs) != 1 else ''}: " + ", ".join(parts)


def cmd_replay(args: argparse.Namespace) -> int:
    """Exit 0 agree, 1 diverged, 3 a trace check fails on the spec, 2 for an
    invalid trace, a bad argument, a target that cannot run the trace or a
    failure of the harness itself (every case in text and in ``--json``);
    with several traces, the most severe among those the target could run
    (2 over 1 over 3 over 0; a trace the target cannot run is counted as
    not applicable, not failed; none it can run: 2)."""
    from kvspec.fuzz.commands.reports import Case, write_junit, write_sarif

    console = _console()
    for flag in ("junit_xml", "sarif"):
        problem = _report_path_problem(getattr(args, flag, None))
        if problem:
            return _usage_error(console, f"--{flag.replace('_', '-')}: {problem}", args.json)
    if args.sarif and (args.target or "impl") == "impl":
        return _usage_error(console, "--sarif reports divergences of a third-party target: give --target", args.json)
    paths, empty = _trace_paths(args.trace)
    if empty and not paths:
        return _usage_error(console, f"trace: no kvtrace files in {', '.join(empty)}", args.json)
    many = len(paths) > 1 or any(Path(t).is_dir() for t in args.trace)
    if args.spec_only:
        from kvspec.fuzz.commands.record import cmd_replay_spec_only

        return cmd_replay_spec_only(args, paths, many, console, _usage_error)
    results = [_replay_one(path, args, console, quiet=args.json) for path in paths]
    code = replay_exit(results, many)
    docs = [d for _, d in results]
    if args.junit_xml:
        cases = []
        for c, doc in results:
            detail = doc.get("invalid") or doc.get("error") or doc.get("unsupported") or ""
            if doc.get("divergence"):
                d = doc["divergence"]
                detail = f"op {d['index']} {json.dumps(d['op'])}: {d['what']}\n{json.dumps(d)}"
            skipped = None
            if doc.get("status") == "not applicable":
                skipped = f"not applicable: target {doc.get('target')} cannot run it: {doc.get('unsupported')}"
            cases.append(Case("replay", doc["trace"], c == 0, float(doc.get("seconds", 0.0)),
                              detail or f"{doc.get('ops_run', 0)} ops agree", skipped=skipped,
                              error=doc.get("status") == "tool failure"))
        write_junit(args.junit_xml, cases)
    if args.sarif:
        findings = []
        for c, doc in results:
            d = doc.get("divergence")
            if c == 1 and d:
                findings.append({"trace": doc["trace"], "target": doc["target"], "index": d["index"], "op": d["op"],
                                 "what": d["what"], "spec": d.get("spec"), "impl": d.get("impl"),
                                 "replay": f"kvspec replay {shlex.quote(doc['trace'])} --target "
                                           f"{shlex.quote(doc['target'])}"})
        write_sarif(args.sarif, findings, version())
    label = next((d["target"] for d in docs if d.get("target")), args.target or "impl")
    if args.json:
        if not many:
            print(json.dumps(docs[0]))
        else:
            counts = {s.replace(" ", "_"): sum(d.get("status") == s for d in docs) for s in REPLAY_STATUSES}
            print(json.dumps({"ok": code == 0, "exit": code, "count": len(results),
                              "failed": len(results) - counts["ok"] - counts["not_applicable"],
                              "counts": counts, "target": label, "traces": docs}))
    elif many:
        console.print(escape(replay_summary(docs, label)))
        if code == 2 and all(d.get("status") == "not applicable" for d in docs):
            console.print(f"[bold red]error[/]: target {escape(label)} can run none of these traces: nothing was "
                          "checked")
    return code


def render_command(trace: str, bug: str | None = None, isolation_only: bool = False, target: str | None = None,
                   waive: list[str] | None = None) -> str:
    """The ``kvspec render`` command that draws a failing trace (what replay
    and fuzz print after a divergence); ``target`` the third-party target it
    failed on (None: this project's caches)."""
    import shlex

    out = str(Path(trace).with_suffix(".html"))
    parts = ["kvspec", "render", trace, "--html", "-o", out]
    if bug:
        parts += ["--bug", bug]
    if target and target != "impl":
        parts += ["--target", target]
    for what in waive or []:
        parts += ["--waive", what]
    if isolation_only:
        parts.append("--isolation-only")
    return " ".join(shlex.quote(p) for p in parts)


# -- render --------------------------------------------------------------------
def _cmd_record(args: argparse.Namespace) -> int:
    from kvspec.fuzz.commands.record import cmd_record

    return cmd_record(args, _console(), _usage_error)


def cmd_render(args: argparse.Namespace) -> int:
    from kvspec.fuzz.render import page, svg, timeline
    from kvspec.fuzz.replay import EXIT_INVALID, EXIT_OK
    from kvspec.fuzz.targets import TargetCapabilityError
    from kvspec.fuzz.trace import TraceFormatError, load

    console = _console()
    html = args.html or str(args.output or "").endswith((".html", ".htm"))
    out = args.output or str(Path(args.trace).with_suffix(".html" if html else ".svg"))
    target: Any = None
    try:
        trace = load(args.trace)
        target = _target(args)
        factories = None
        if args.bug:
            if not target.is_impl:
                return _usage_error(console, f"--bug cannot be combined with --target {target.label}")
            bug = _bug(console, args.bug)
            if bug is None:
                return EXIT_INVALID
            if bug.kind != trace.cache["kind"]:
                raise KeyError(f"--bug {bug.name} patches the {bug.kind} cache; this trace is kind {trace.cache['kind']}")
            factories = bug.factories
        tl = timeline(trace, factories, args.bug, check_inplace=not args.isolation_only, target=target)
    except TargetCapabilityError as exc:
        return _usage_error(console, f"--target {target.label}: cannot run {args.trace}: {exc}")
    except TraceFormatError as exc:
        console.print(f"[bold red]invalid kvtrace[/] {escape(args.trace)}: {escape(str(exc))}")
        return EXIT_INVALID
    except KeyError as exc:
        console.print(f"[bold red]error[/]: {escape(str(exc.args[0]))}")
        return EXIT_INVALID
    except Exception as exc:  # a target that raises outside a compared op: said, never a traceback
        if target is None or target.is_impl:
            raise
        return _usage_error(console, f"--target {target.label}: the target raised {type(exc).__name__}: {exc}")
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
    from kvspec.fuzz.trace import TraceFormatError, load

    console = _console()
    try:
        trace = load(args.trace)
    except TraceFormatError as exc:
        console.print(f"[bold red]invalid kvtrace[/] {escape(args.trace)}: {escape(str(exc))}")
        return 2
    cache = trace.cache
    scheme = cache.get("rows", "numpy")
    dtype = cache["dtype"]
    b, h = cache["batch"], cache["kv_heads"]
    dk, dv = cache.get("k_head_dim") or cache["head_dim"], cache.get("v_head_dim") or cache["head_dim"]
    # what the harness hands in (kvspec.fuzz.lockstep.Lockstep.wide_rows): wide
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

    from kvspec.fuzz.rows import rows as row_values

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


def _fuzz_shares(runs: list[tuple[str, str, bool]], seed: int, jobs: int) -> list[list[tuple[str, str, bool, int]]]:
    """The campaigns of each of ``jobs`` workers: with fewer workers than
    campaigns, campaign ``i`` goes to worker ``i % jobs`` (each worker
    interleaves its own); with more, the campaigns are repeated under other
    seeds (``seed + 1_000_003 * copy``) so every worker searches."""
    if jobs <= len(runs):
        return [[(*r, seed) for r in runs[w::jobs]] for w in range(jobs)]
    return [[(*runs[w % len(runs)], seed + 1_000_003 * (w // len(runs)))] for w in range(jobs)]


def _merge(reports: list[Any]) -> Any:
    """One configuration's reports from several workers as one."""
    first = reports[0]
    for rep in reports[1:]:
        first.examples += rep.examples
        first.steps += rep.steps
        first.seconds += rep.seconds
        first.shrink_seconds += rep.shrink_seconds
        first.shrink_cut = first.shrink_cut or rep.shrink_cut
        first.batches += rep.batches
        for k, v in rep.stats.items():
            first.stats[k] = first.stats.get(k, 0) + v
        if first.failure is None and rep.failure is not None:
            first.failure, first.examples_to_catch = rep.failure, rep.examples_to_catch
    return first


def _run_fuzz_pool(shares: list[list[tuple[str, str, bool, int]]], budget: float, bug: str | None,
                   target: str | None, progress: Any, database: str | None = None,
                   shrink_budget: float | None = None, engine: str | None = None) -> list[Any]:
    """``shares`` on a forkserver pool (MLX hangs in a plain forked child);
    the reports of every finished worker, in the order of ``shares``."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from kvspec.fuzz.campaign import run_share

    ctx = multiprocessing.get_context("forkserver")
    done: dict[int, list[Any]] = {}
    pool = ProcessPoolExecutor(max_workers=len(shares), mp_context=ctx)
    try:
        futs = {pool.submit(run_share, share, budget, bug, target, database, shrink_budget, engine): w
                for w, share in enumerate(shares)}
        for fut in as_completed(futs):
            w = futs[fut]
            done[w] = fut.result()
            progress(f"worker {w + 1}/{len(shares)} finished: " + ", ".join(
                f"{r.config} {r.steps} ops{' FAILED' if r.failure is not None else ''}" for r in done[w]))
    except BaseException as exc:
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        exc.partial = [r for w in sorted(done) for r in done[w]]  # type: ignore[attr-defined]
        raise
    pool.shutdown()
    return [r for w in sorted(done) for r in done[w]]


def _fuzz_batch(args: argparse.Namespace) -> int:
    """``kvspec fuzz --kind batch``: the batch lockstep (``kvspec.fuzz.batch``: a
    batch cache against B single caches and kvspec.spec.batch), dense and rotating,
    or the campaign of ``--bug`` (a batch bug of the catalog). Rounds of
    ``BATCH_ROUND`` programs under seeds drawn from ``--seed`` run until
    each campaign's share of ``--budget`` is spent (at least one round
    each); the first failure is shrunk and its program printed. Exit 0
    agreement, 1 divergence, 2 a tool failure or an option that does not
    apply (named)."""
    from kvspec.fuzz.batch import campaign, catch
    from kvspec.fuzz.commands.reports import Case, print_table, rerun, write_junit

    console = _console()
    as_json = args.json
    if args.mode not in (None, "fp16"):
        return _usage_error(console, f"--mode {args.mode}: a batch cache holds fp16 rows only; kind batch takes "
                                     "--mode fp16 or no --mode", as_json)
    not_applicable = [("--inplace", args.inplace != "both", "a batch cache has no in-place switch"),
                      ("--jobs", (args.jobs or 1) > 1, "the batch campaign runs in one process"),
                      ("--engine", args.engine is not None, "the batch campaign has one engine"),
                      ("--target", (args.target or "impl") != "impl", "the batch caches are ours (impl) only"),
                      ("--sarif", bool(args.sarif), "no third-party target runs a batch"),
                      ("--shrink-budget", args.shrink_budget is not None, "the batch campaign's shrinking is untimed"),
                      ("--db", args.db is not None, "the batch campaign keeps no example database"),
                      ("--baseline", bool(args.baseline), "the batch caches are ours (impl) only"),
                      ("--examples", args.examples is not None, "the batch campaign is budgeted in seconds")]
    for flag, given, why in not_applicable:
        if given:
            return _usage_error(console, f"{flag} does not apply to --kind batch: {why}", as_json)
    problem = _report_path_problem(args.junit_xml)
    if problem:
        return _usage_error(console, f"--junit-xml: {problem}", as_json)
    bug = None
    if args.bug:
        bug = _bug(console, args.bug, as_json=as_json, batch_ok=True)
        if bug is None:
            return 2
        if bug.kind != "batch":
            return _usage_error(console, f"--bug {bug.name} patches the {bug.kind} cache, not a batch cache; "
                                         f"drop --kind batch to fuzz it", as_json)
    rings = ["rotating" in bug.factories] if bug is not None else [False, True]
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    again = rerun("fuzz", getattr(args, "argv", None) or ["fuzz", "--kind", "batch"], {"--seed": str(seed)})
    share = args.budget / len(rings)
    rows: list[dict[str, Any]] = []
    for ring in rings:
        config = f"batch/{'rotating' if ring else 'dense'}" + (f" ({bug.name})" if bug is not None else "")
        row: dict[str, Any] = {"config": config, "examples": 0, "steps": 0, "seconds": 0.0, "result": "ok"}
        start, rnd = time.perf_counter(), 0
        while True:
            search_seed = (seed * 1000 + rnd) * 2 + ring
            r = (catch(bug, BATCH_ROUND, search_seed=search_seed) if bug is not None
                 else campaign(ring, max_examples=BATCH_ROUND, search_seed=search_seed))
            row["examples"] += r.examples
            row["steps"] += r.steps
            rnd += 1
            if not r.ok:
                row["result"] = "FAILED" if r.caught else r.status
                row["failure"] = r.failure
                break
            if time.perf_counter() - start >= share:
                break
        row["seconds"] = round(time.perf_counter() - start, 2)
        rows.append(row)
    results = {row["result"] for row in rows}
    code = 2 if results - {"ok", "FAILED"} else 1 if "FAILED" in results else 0
    if args.junit_xml:
        write_junit(args.junit_xml, [Case("fuzz", r["config"], r["result"] == "ok", r["seconds"],
                                          r.get("failure", ""), error=r["result"] not in ("ok", "FAILED"))
                                     for r in rows])
    if as_json:
        print(json.dumps({"seed": seed, "budget": args.budget, "kind": "batch", "bug": args.bug, "ok": code == 0,
                          "rerun": again, "runs": rows, "exit": code}))
        return code
    table = Table(title=f"kvspec fuzz --kind batch (seed {seed}, {args.budget:g} s of search)")
    for col in ("config", "examples", "steps", "ops/s", "result"):
        table.add_column(col, no_wrap=col != "config", justify="right" if col in ("examples", "steps", "ops/s") else "left")
    for row in rows:
        style = "" if row["result"] == "ok" else "[bold red]"
        table.add_row(escape(row["config"]), str(row["examples"]), str(row["steps"]), _ops_per_second(row),
                      f"{style}{escape(row['result'])}{'[/]' if style else ''}")
    print_table(console, table)
    for row in rows:
        if "failure" in row:
            what = "minimal failing program" if row["result"] == "FAILED" else "the harness failed (no verdict)"
            console.print(f"[bold red]{escape(row['config'])}[/]: {what}:\n{escape(row['failure'])}")
    if code:
        console.print(f"rerun: {escape(again)}")
    return code


#: programs a round of ``kvspec fuzz --kind batch`` runs (one Hypothesis call)
BATCH_ROUND = 25


def cmd_fuzz(args: argparse.Namespace) -> int:
    """Exit 0 when every campaign ran examples and found nothing, 1 when one
    failed (its minimal trace is written), 2 for bad arguments and when a
    campaign stopped without a verdict (the target cannot run an op it
    reached, or the harness itself raised: kvspec.fuzz.replay.failure_status), 130
    when interrupted (the seed and a rerun command are printed)."""
    from kvspec.fuzz.campaign import Campaign, interleaved, save_failure
    from kvspec.fuzz.commands.reports import Case, print_table, rerun, write_junit, write_sarif
    from kvspec.fuzz.replay import failure_status

    if args.kind == "batch":  # not a kvtrace kind: the batch lockstep (kvspec.fuzz.batch), its own runner
        return _fuzz_batch(args)
    console = _console()
    err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
    try:
        target = _target(args)
    except KeyError as exc:
        return _usage_error(console, str(exc.args[0]), args.json)
    if target.label == "llama.cpp":
        return _usage_error(console, "--target llama.cpp: not applicable to kvspec fuzz (its campaigns draw cells "
                                     "caches of any size and head layout; llama.cpp sizes its own memory for its "
                                     "two models): fuzz llama.cpp with kvspec conformance --target llama.cpp "
                                     "(docs/conformance.md)", args.json)
    for flag in ("junit_xml", "sarif"):
        problem = _report_path_problem(getattr(args, flag, None))
        if problem:
            return _usage_error(console, f"--{flag.replace('_', '-')}: {problem}", args.json)
    if args.sarif and target.is_impl:
        return _usage_error(console, "--sarif reports divergences of a third-party target: give --target", args.json)
    if args.baseline or args.examples is not None:  # bounded by examples; head against base (fuzz/commands/review.py)
        from kvspec.fuzz.commands.review import fuzz_by_examples

        return fuzz_by_examples(args, target, console, _usage_error, version())
    from kvspec.fuzz.campaign import open_database

    db_spec = args.db if args.db is not None else os.environ.get("KVSPEC_DB", DEFAULT_DB)
    try:
        database = open_database(db_spec)
    except ValueError as exc:
        return _usage_error(console, str(exc), args.json)
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
    # setting is enough there (both would run the same campaign twice);
    # an exec: adapter that takes the "inplace" cache field runs both settings too
    switchable = target.is_impl or getattr(target, "takes_inplace", False)
    inplace_settings = _inplace_settings(args.inplace) if switchable else [True]
    # a kind whose writes the switch does not change (Kind.inplace_switch) runs one campaign, not two alike
    runs = [(k, m, ip) for k, m in configs
            for ip in (inplace_settings if m == "fp16" and kinds.get(k, m).inplace_switch else inplace_settings[:1])]
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    jobs = args.jobs or 1
    on = "" if target.is_impl else f", target {target.label}"
    again = rerun("fuzz", getattr(args, "argv", None) or ["fuzz"], {"--seed": str(seed)})
    shrink_budget = args.shrink_budget if args.shrink_budget is not None else args.budget
    err.print(f"kvspec fuzz: seed {seed}, {args.budget:g} s of search over {len(runs)} campaign{'s' * (len(runs) > 1)}"
              f"{on}" + (f", {jobs} processes" if jobs > 1 else ", interleaved")
              + f"; shrinking is timed apart, at most {shrink_budget:g} s a campaign; "
              + ("no example database" if database is None else f"example database {db_spec} (saved failures replay first)"),
              markup=False)
    progress = _Ticker(err)
    reports: list[Any] = []
    interrupted: str | None = None
    camps = [Campaign(k, m, ip, seed, factories, target=None if target.is_impl else target, progress=progress.tick,
                      database=database, shrink_budget=shrink_budget, engine=args.engine)
             for k, m, ip in runs] if jobs == 1 else []
    try:
        if jobs == 1:
            progress.start("fuzz")
            interleaved(camps, args.budget, progress=lambda c: setattr(progress, "label", c.report.config))
        else:
            progress.start(f"fuzz on {jobs} processes")
            got = _run_fuzz_pool(_fuzz_shares(runs, seed, jobs), args.budget, args.bug,
                                 None if target.is_impl else target.label, progress.tick, db_spec, shrink_budget,
                                 args.engine)
            reports = [_merge([r for r in got if r.config == c]) for c in dict.fromkeys(r.config for r in got)]
    except KeyboardInterrupt as exc:
        interrupted = progress.label or "?"
        reports = list(getattr(exc, "partial", []))
    finally:
        progress.stop()
    if jobs == 1:
        reports = [c.report for c in camps if c.report.batches]
    by_config = {f"{k}/{m}/{'inplace' if ip else 'copy'}": (k, m, ip) for k, m, ip in runs}
    rows = []
    failed = refused = False
    sarif_findings: list[dict[str, Any]] = []
    for rep in reports:
        kind, mode, inplace = by_config[rep.config.rsplit(":", 1)[-1]]
        ops = rep.stats.get("ops", 0)
        row: dict[str, Any] = {"config": rep.config, "examples": rep.examples, "steps": ops,
                               "seconds": round(rep.seconds, 2), "shrink_seconds": round(rep.shrink_seconds, 2),
                               "shrink_cut": rep.shrink_cut,
                               "examples_to_catch": rep.examples_to_catch, "result": "ok", "reached": rep.stats}
        if rep.examples == 0:
            # a run that checked nothing never says ok, and found nothing either: no verdict, exit 2
            row["result"], refused = "no examples", True
        if rep.failure is not None:
            failed = True
            status = failure_status(rep.failure.error)
            # a capability gap or the harness's own crash is no verdict: exit 2
            refused = refused or status != "diverged"
            row["result"] = "FAILED" if status == "diverged" else status
            row["failure"] = str(rep.failure.error).splitlines()[0]
            if rep.failure.flaky:
                row["flaky"] = rep.failure.flaky
            if rep.failure.trace is not None:
                stem = f"{kind}-{mode}-{'inplace' if inplace else 'copy'}-seed{seed}"
                stem = stem if target.is_impl else re.sub(r"[^A-Za-z0-9_.-]+", "_", target.label) + f"-{stem}"
                path = save_failure(rep.failure.trace, args.out, stem)
                extra = f" --bug {args.bug}" if args.bug else ""
                extra += "" if target.is_impl else f" --target {shlex.quote(target.label)}"
                row["trace"], row["replay"] = str(path), f"kvspec replay {path}{extra}"
                if target.is_impl or status == "diverged":  # a target's run that did not diverge draws nothing
                    row["render"] = render_command(str(path), args.bug,
                                                   target=None if target.is_impl else target.label)
                if not target.is_impl and status == "diverged":
                    sarif_findings.append(_sarif_finding(rep.failure.trace, path, target, row["replay"]))
        rows.append(row)
    code = 130 if interrupted else (2 if refused else 1 if failed else 0)
    # what the target's classes declare they do not do: skipped and reported
    declared = {} if target.is_impl else {
        f"{c.name} ({c.kind}/{c.mode})": {"skipped": dict(c.skipped), "not_compared": dict(c.not_compared)}
        for c in target.classes if (c.kind, c.mode) in configs}
    if args.junit_xml:
        cases = [Case("fuzz", r["config"], r["result"] == "ok", r["seconds"] + r["shrink_seconds"],
                      r.get("failure", r["result"]) + (f"\nminimal trace: {r['trace']}\nreplay it: {r['replay']}"
                                                       if "trace" in r else "")) for r in rows]
        cases += [Case("fuzz", f"{k}/{m}/{'inplace' if ip else 'copy'}", False, 0.0, skipped="interrupted before it ran")
                  for k, m, ip in runs if not any(r["config"].endswith(f"{k}/{m}/{'inplace' if ip else 'copy'}")
                                                 for r in rows)]
        write_junit(args.junit_xml, cases)
    if args.sarif:
        write_sarif(args.sarif, sarif_findings, version())
    if args.json:
        print(json.dumps({"seed": seed, "budget": args.budget, "jobs": jobs, "target": target.label, "ok": code == 0,
                          "database": "none" if database is None else db_spec,
                          "interrupted": interrupted, "rerun": again, "runs": rows, "declared": declared,
                          "exit": code}))
        return code
    table = Table(title=f"kvspec fuzz (seed {seed}, {args.budget:g} s of search{escape(on)}"
                        + (f", {jobs} processes" if jobs > 1 else "") + ")")
    for col in ("config", "examples", "steps", "ops/s", "shrinking", "result"):
        table.add_column(col, no_wrap=col != "config", justify="right" if col in ("examples", "steps", "ops/s") else "left")
    for row in rows:
        style = "" if row["result"] == "ok" else "[bold red]"
        table.add_row(escape(row["config"]), str(row["examples"]), str(row["steps"]), _ops_per_second(row),
                      (f"{row['shrink_seconds']:.1f} s" + (" (cut)" if row["shrink_cut"] else ""))
                      if row["shrink_seconds"] else "-",
                      f"{style}{row['result']}{'[/]' if style else ''}")
    print_table(console, table)
    for row in rows:
        if row["reached"]:
            console.print(f"[bold]{escape(row['config'])}[/] reached: {escape(_stats_text(row['reached']))}")
    for name, d in declared.items():
        for what, items in (("skipped (not in the class)", d["skipped"]), ("not compared", d["not_compared"])):
            if items:
                console.print(f"[bold]{escape(name)}[/] {what}: "
                              + "; ".join(f"{escape(k)} ({escape(v)})" for k, v in items.items()))
    for row in rows:
        if row["result"] == "no examples":
            console.print(f"[bold red]{escape(row['config'])}[/]: ran no example in its budget; nothing was checked")
        if "failure" in row:
            console.print(f"[bold red]{escape(row['config'])}[/]: {escape(row['failure'])}")
            if "flaky" in row:
                console.print(f"  [bold red]{escape(row['flaky'])}[/]\n  the trace is the run that diverged, "
                              "unshrunk; a verdict must be a function of the trace alone (docs/fuzzing.md, "
                              "'Determinism of a verdict')", soft_wrap=True)
            if "trace" in row:
                if row["shrink_cut"]:
                    console.print(f"  shrinking stopped at its limit of {shrink_budget:g} s (--shrink-budget): "
                                  f"the trace is the smallest failing run found by then, not a minimal one")
                console.print(f"  {'trace' if row['shrink_cut'] else 'minimal trace'} written to {escape(row['trace'])}"
                              f"\n  replay it: {escape(row['replay'])}")
                if "render" in row:
                    console.print(f"  see it: {escape(row['render'])}")
    if interrupted:
        console.print(f"[bold yellow]interrupted[/] during {escape(interrupted)}: seed {seed}\n  rerun: {escape(again)}")
    return code


def _ops_per_second(row: dict[str, Any]) -> str:
    """The ops/s cell of a ``kvspec fuzz`` row: ops run over seconds of
    search, only for a campaign that ran its budget clean with ops and
    measurable time; "-" for a failed, interrupted-empty or 0-step one (a
    rate over the moments before a failure is no throughput)."""
    if row["result"] != "ok" or row["steps"] <= 0 or row["seconds"] <= 0:
        return "-"
    return f"{row['steps'] / row['seconds']:.0f}"


def _sarif_finding(trace: Any, path: Any, target: Any, replay_cmd: str) -> dict[str, Any]:
    """A SARIF finding for a divergence written to ``path``: the trace is
    replayed on ``target`` for the op and both sides."""
    from kvspec.fuzz.replay import replay

    result = replay(trace, target=target)
    d = result.divergence
    if d is None:
        return {"trace": str(path), "target": target.label, "index": None, "op": {}, "what": "no longer diverges",
                "spec": None, "impl": None, "replay": replay_cmd, "level": "warning"}
    j = d.to_json()
    return {"trace": str(path), "target": target.label, "index": d.index, "op": d.op, "what": d.what,
            "spec": j.get("spec", j.get("trace")), "impl": j.get("impl", j.get("trace")), "replay": replay_cmd}


def _report_path_problem(path: str | None) -> str | None:
    if not path:
        return None
    from kvspec.fuzz.commands.reports import writable

    return writable(path)


# -- conformance ---------------------------------------------------------------
def cmd_campaign(args: argparse.Namespace) -> int:
    """HypoFuzz on the state machines for --budget seconds (fuzz/commands/campaign.py)."""
    from kvspec.fuzz.campaign import open_database
    from kvspec.fuzz.commands.campaign import run_campaign

    console = _console()
    db_spec = args.db if args.db is not None else os.environ.get("KVSPEC_DB", DEFAULT_DB)
    if db_spec == "none":
        return _usage_error(console, "--db none: a campaign needs an example database (HypoFuzz's workers and "
                                     "dashboard share it); give a folder or redis://HOST:PORT", args.json)
    if not db_spec.startswith("redis://"):
        db_spec = str(Path(db_spec).resolve())  # HypoFuzz runs from the checkout's root
    try:
        open_database(db_spec)
    except ValueError as exc:
        return _usage_error(console, str(exc), args.json)
    if args.bug and _bug(console, args.bug, as_json=args.json) is None:
        return 2
    return run_campaign(args, console, _usage_error, db_spec)


def cmd_conformance(args: argparse.Namespace) -> int:
    """Exit 0 when every divergence found replays 1 on its target and 0 on
    impl (the report is trustworthy), 1 otherwise, 2 for bad arguments and
    when a class's search stopped without a verdict (its class cannot run
    an op it reached, or the harness raised: ``no_verdict``), 130
    when interrupted (the classes that finished are printed)."""
    if args.target in ("llama.cpp", "vllm") and (args.baseline or args.junit_xml):
        return _usage_error(_console(), f"--baseline/--junit-xml: not with --target {args.target} (its search "
                                        "writes a report of its own; compare with --target mlx-lm, transformers "
                                        "or a target of docs/targets.md)", args.json)
    if args.target == "llama.cpp":  # the cells kind: a search of its own (fuzz/commands/conformance_cells.py)
        from kvspec.fuzz.commands.conformance_cells import cmd_llama_conformance

        return cmd_llama_conformance(args, _console(), _usage_error,
                                     default_out=args.out == DEFAULT_OUT + "/conformance")
    if args.target == "vllm":  # the prefix kind: a search of its own (fuzz/commands/conformance_prefix.py)
        from kvspec.fuzz.commands.conformance_prefix import cmd_vllm_conformance

        return cmd_vllm_conformance(args, _console(), _usage_error,
                                    default_out=args.out == DEFAULT_OUT + "/conformance")
    if args.budget is not None and (args.examples is not None or args.baseline):
        return _usage_error(_console(), "--budget: not with --examples or --baseline (a search bounded by "
                                        "examples takes no seconds budget)", args.json)
    if args.target == "transformers" and args.budget is None and args.examples is None and not args.baseline:
        args.examples = 50  # transformers' six classes: bounded by examples unless --budget says seconds
    if args.junit_xml and not args.baseline:
        return _usage_error(_console(), "--junit-xml: only with --baseline (one test case per divergence key)",
                            args.json)
    if args.baseline:  # head against base (fuzz/commands/review.py)
        from kvspec.fuzz.commands.review import run_baseline

        for flag in ("junit_xml", "sarif"):
            problem = _report_path_problem(getattr(args, flag))
            if problem:
                return _usage_error(_console(), f"--{flag.replace('_', '-')}: {problem}", args.json)
        params = {"target": args.target, "classes": args.classes, "examples": args.examples, "steps": args.steps,
                  "seed": None if args.seed == CONFORMANCE_SEED else args.seed, "default_seed": CONFORMANCE_SEED,
                  "max_findings": args.max_findings if args.max_findings is not None else 8}
        return run_baseline(args, "conformance", params, _console(), _usage_error, version())
    from kvspec.fuzz.commands.conformance import print_report, run_conformance, to_json
    from kvspec.fuzz.commands.reports import rerun, write_sarif

    problem = _report_path_problem(args.sarif)
    if problem:
        return _usage_error(_console(), f"--sarif: {problem}")
    reports: list[Any] = []
    interrupted = False
    try:
        run_conformance(args.budget if args.budget is not None else 120.0, args.seed, args.out, args.classes,
                        args.max_findings if args.max_findings is not None else 8, args.target,
                        reports=reports, examples=args.examples, steps=args.steps or 40)
    except KeyError as exc:
        _console().print(f"[bold red]error[/]: {escape(str(exc.args[0]))}")
        return 2
    except KeyboardInterrupt:
        interrupted = True
    budget = args.budget if args.budget is not None else 120.0
    doc = to_json(reports, args.seed, budget, args.examples, args.steps or 40)
    code = 130 if interrupted else (2 if doc["no_verdict"] else 0 if doc["ok"] else 1)
    doc["exit"], doc["interrupted"] = code, interrupted
    if args.sarif:
        write_sarif(args.sarif, [{"trace": f.trace, "target": f.target, "index": f.index, "op": f.op,
                                  "what": f.what, "spec": f.summary, "impl": f.then, "replay": f.replay_command,
                                  "level": "error" if f.category == "fault" else "warning"}
                                 for r in reports for f in r.findings if f.trace], version())
    if args.json:
        print(json.dumps(doc))
    else:
        print_report(reports, args.seed, budget, examples=args.examples)
        _console().print(f"minimal traces in {escape(args.out)}/ (replay commands: kvspec conformance --json)")
        if interrupted:
            _console().print(f"[bold yellow]interrupted[/]: {len(reports)} classes finished\n  rerun: "
                             f"{escape(rerun('conformance', getattr(args, 'argv', None) or ['conformance']))}")
    return code


# -- verify --------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace) -> int:
    from kvspec.fuzz.commands.verify import run_verify

    if args.jobs is not None and args.jobs < 1:
        _console().print(f"[red]--jobs: must be >= 1, got {args.jobs}[/]")
        return 2
    problem = _report_path_problem(args.junit_xml)
    if problem:
        return _usage_error(_console(), f"--junit-xml: {problem}")
    return run_verify(quick=args.quick, as_json=args.json, out=args.out, skip_proofs=args.skip_proofs, jobs=args.jobs,
                      patterns=args.pattern, exitfirst=args.exitfirst, list_only=args.list, junit_xml=args.junit_xml,
                      argv=getattr(args, "argv", None))


def cmd_mutants(args: argparse.Namespace) -> int:
    from kvspec.fuzz.commands.mutants import default_jobs
    from kvspec.fuzz.commands.mutants import main as mutants_main

    console = _console()
    if args.changed is not None:
        clash = [flag for flag, on in (("--list", args.list), ("--only", args.only), ("--junit-xml", args.junit_xml)) if on]
        if clash:
            return _usage_error(console, f"--changed: mutates source lines, not the injected-bug catalog; "
                                         f"drop {', '.join(clash)}")
        from kvspec.fuzz.commands.mutation_changed import main as changed_main

        return changed_main(args.changed, args.json, args.max_children)
    if args.list:
        from kvspec.fuzz.bugs import catalog

        if args.json:
            print(json.dumps({"bugs": [{"name": b.name, "kind": b.kind, "modes": list(b.modes), "device": b.device,
                                        "variants": [v[0] for v in b.variants], "clause": b.clause,
                                        "description": b.description} for b in catalog()]}))
            return 0
        for b in catalog():  # one line each: names are what a reader copies
            extra = f", {len(b.variants)} variants" if b.variants else ""
            gpu = ", GPU only" if b.device == "gpu" else ""
            console.print(f"{escape(b.name)} ({b.kind} {'/'.join(b.modes)}{extra}{gpu}): {escape(b.description)}",
                          soft_wrap=True)
        return 0
    problem = _report_path_problem(args.junit_xml)
    if problem:
        return _usage_error(console, f"--junit-xml: {problem}")
    for name in args.only or []:
        if _bug(console, name, "--only") is None:
            return 2
    return mutants_main(args.seeds, args.json, args.out, args.only, junit_xml=args.junit_xml,
                        argv=getattr(args, "argv", None), jobs=args.jobs or default_jobs())


#: the cache bench's options and their defaults (``kvspec bench``'s parser
#: takes them from here; ``--harness`` refuses any that is set)
_BENCH_DEFAULTS: dict[str, Any] = {
    "contexts": [1024, 8192, 32768], "decoder": False, "e2e": False, "layers": None, "rounds": None,
    "e2e_contexts": [1024, 8192, 24576], "tokens": 16, "repeats": 12, "record": None, "e2e_size": "7b",
    "plot": None, "recurrent": False, "recurrent_size": None,
}


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvspec.fuzz.commands.bench import run, run_suite

    if args.harness:
        # the harness bench takes none of the cache bench's options: refused
        # rather than ignored (--plot would otherwise win, silently)
        given = [f"--{name.replace('_', '-')}" for name, default in _BENCH_DEFAULTS.items()
                 if getattr(args, name) != default]
        if given:
            return _usage_error(_console(), f"--harness: measures the fuzz harness alone; it takes no "
                                            f"{', '.join(given)} (options of the cache bench)")
        from kvspec.fuzz.commands.bench_harness import run as run_harness

        return run_harness(args.only, args.batches or 3, args.json)
    for name in ("only", "batches"):
        if getattr(args, name) is not None:
            return _usage_error(_console(), f"--{name}: an option of --harness (the fuzz harness's bench); "
                                            "give --harness too")
    if args.recurrent_size is not None and not args.recurrent:
        return _usage_error(_console(), "--recurrent-size: an option of --recurrent (the recurrent layers' "
                                        "rollback bench); give --recurrent too")
    if args.recurrent:
        # its own bench: the cache bench's decoder and end-to-end options are refused, not ignored
        given = [f"--{name.replace('_', '-')}" for name in ("decoder", "e2e", "layers", "e2e_size", "plot")
                 if getattr(args, name) != _BENCH_DEFAULTS[name]]
        if given:
            return _usage_error(_console(), f"--recurrent: measures the recurrent layers' rollback; it takes no "
                                            f"{', '.join(given)} (options of the cache bench)")
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
    if args.plot:
        from kvspec.fuzz.commands.bench import plot_record

        try:
            path = plot_record(args.plot)
        except (OSError, ValueError, KeyError) as exc:
            return _usage_error(_console(), f"--plot: {args.plot} must be a record's JSON with decoder rows ({exc})")
        _console().print(f"bench: plot written: {path}", markup=False)
        return 0
    if args.recurrent:
        from kvspec.fuzz.commands.bench_recurrent import run as run_recurrent

        e2e_contexts = None if args.e2e_contexts == _BENCH_DEFAULTS["e2e_contexts"] else args.e2e_contexts
        return run_recurrent(args.contexts, size=args.recurrent_size, rounds=args.rounds, e2e_contexts=e2e_contexts,
                             tokens=args.tokens, repeats=args.repeats, as_json=args.json, record=args.record)
    if not (args.decoder or args.e2e or args.record):
        return run(args.contexts, args.json)
    return run_suite(args.contexts, decoder=args.decoder, e2e=args.e2e, layers=args.layers, rounds=args.rounds,
                     e2e_contexts=args.e2e_contexts, tokens=args.tokens, repeats=args.repeats, as_json=args.json,
                     record=args.record, e2e_size=args.e2e_size)


def cmd_e2e(args: argparse.Namespace) -> int:
    from kvspec.fuzz.commands.e2e import main as e2e_main

    if args.bug and _bug(_console(), args.bug, batch_ok=True) is None:
        return 2
    try:
        return e2e_main(long=args.long, as_json=args.json, bug=args.bug, only=args.only)
    except KeyError as exc:
        return _usage_error(_console(), str(exc.args[0]))


def cmd_prove(args: argparse.Namespace) -> int:
    try:
        from kvspec.proofs.cli import main as prove_main
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


def nonnegative_seconds(text: str) -> float:
    """A limit in seconds: a finite number >= 0 and at most a week (0: none of it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be finite, >= 0 and <= {MAX_SECONDS:g} seconds, got {text!r}")
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


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; an option's default after its help, once:
    not where the help already says its default, nor for a flag or an
    option without one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS)
                or action.option_strings == [] or isinstance(action, argparse._StoreConstAction)):
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse with "did you mean" for a value outside an option's choices."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            from kvspec.fuzz.commands.reports import suggest

            choices = ", ".join(map(repr, action.choices))
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{suggest(value, action.choices)} "
                                                 f"(choose from {choices})")
        super()._check_value(action, value)




EXIT_CODES = {
    "replay": "exit status: 0 spec and implementation agree and every check holds; 1 they disagree (a "
              "divergence); 2 invalid trace or arguments, a target that cannot run the trace, or the harness's "
              "own failure; 3 a check the trace carries fails on the spec (the trace expects what the spec does "
              "not do); with several traces the most severe among those the target can run (a trace it cannot "
              "run is counted as not applicable, not failed; 2 when it can run none). With --spec-only: 0 every "
              "op of every recording is possible under the contract, 1 one is not (the first such op printed), 2 "
              "invalid trace or arguments",
    "fuzz": "exit status: 0 every campaign ran examples and found nothing; 1 a divergence (its minimal trace is "
            "written and a replay command printed); 2 bad arguments or no verdict (a campaign that ran no "
            "example, a capability gap, the harness's own crash, a failure the tool could not repeat); "
            "130 interrupted (seed and rerun command printed); with --baseline: 1 only when the head adds a "
            "divergence, 0 when it adds none, 2 bad input or no verdict (the base could not run)",
    "campaign": "exit status: 0 HypoFuzz ran the budget and found nothing; 1 a failure (its kvtrace is written "
                "and a replay command printed); 2 bad arguments, HypoFuzz missing (the extra 'campaign'), "
                "failing to start or one of its processes dying during the run; 130 interrupted (what was found is printed)",
    "rows": "exit status: 0 the rows were printed, 2 the file is not a valid kvtrace or an argument is wrong",
    "adapter": "exit status: 0 check: no problem found (new: the skeleton was written); 1 check: the adapter or "
               "class has problems, each said in one sentence; 2 bad arguments (no command and no --target, or "
               "both; a --target that names nothing; for new, a folder that exists and is not empty)",
    "conformance": "exit status: 0 every finding replays on its target and not on ours (the report is "
                   "trustworthy; llama.cpp's and vLLM's findings also in paranoid mode); 1 otherwise; 2 bad arguments, "
                   "an option that does not apply to the target (named), llama-cpp-python missing for --target "
                   "llama.cpp, vLLM missing for --target vllm, or a class without a verdict; with --baseline: 1 "
                   "only when the head adds a divergence, 0 when it adds none, 2 bad input or no verdict (the "
                   "base could not run, a class without a verdict)",
    "verify": "exit status: 0 every check passes; 1 one fails; 2 bad arguments or a tool failure (a verdict the "
              "tool could not repeat: one run of ops gave two answers, both printed); 130 interrupted (the checks "
              "that finished are printed)",
    "mutants": "exit status: 0 every injected bug caught in every seed with a clean trace (with --changed: no "
               "mutant of the changed lines survives); 1 otherwise; 2 bad arguments or a tool failure (a seed whose verdict "
               "the tool could not repeat, both answers printed); 130 interrupted",
    "bench": "exit status: 0 measured; 2 bad arguments",
    "record": "exit status: 0 recorded (what a recording cannot show is printed as notes); 2 bad arguments",
    "render": "exit status: 0 the picture was written (whether or not the trace diverges); 2 invalid trace, "
              "arguments or output path, an unknown --target or one that cannot run the trace",
    "e2e": "exit status: 0 every scenario passes (with --bug: the bug went unnoticed); 1 a scenario "
           "diverged (with --bug: the bug was caught); 2 bad arguments",
}


def _epilog(command: str, extra: str = "") -> str:
    parts = [EXIT_CODES[command]]
    if command in ("replay", "render", "fuzz", "mutants", "e2e", "campaign"):
        parts.append("injected bugs (--bug / --only): kvspec mutants --list names them")
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


def _cmd_adapter(args: argparse.Namespace) -> int:
    from kvspec.fuzz.commands.adapter import cmd_adapter

    return cmd_adapter(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``kvspec`` parser (builds without loading MLX)."""
    p = _Parser(
        prog="kvspec", formatter_class=_Formatter,
        description="Verified KV caches: an executable spec, proofs, MLX caches, and differential fuzzing of "
                    "the caches against the spec. Trace format: docs/kvtrace.md; the contract: docs/semantics.md.")
    p.add_argument("--version", action="version", version=f"kvspec {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    subs: dict[str, argparse.ArgumentParser] = {}

    def add(name: str, help: str, description: str, extra: str = "") -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=description, formatter_class=_Formatter,
                            epilog=_epilog(name, extra))
        subs[name] = sp
        return sp

    r = add("replay", "replay a kvtrace on the spec and an implementation",
            "Run a kvtrace (docs/kvtrace.md) on the executable spec and on an implementation in lockstep, "
            "comparing every op's result, the windows of the cache and every snapshot, and the physical "
            "observables; stop at the first disagreement and print it.")
    r.add_argument("trace", nargs="+", help="kvtrace files (JSON) and folders (every *.json below them)")
    r.add_argument("--json", action="store_true",
                   help="print one JSON object (several traces: one with a list; docs/json.md)")
    r.add_argument("--junit-xml", metavar="PATH", help="also write a JUnit XML report, one test case per trace")
    r.add_argument("--sarif", metavar="PATH", help="also write the divergences of a --target as SARIF 2.1.0")
    r.add_argument("--bug", help="replay on an injected bug of the catalog instead of the real implementation")
    r.add_argument("--isolation-only", action="store_true",
                   help="do not compare in-place decisions: only a holder's bytes changing can reveal an unsafe write")
    r.add_argument("--target", default="impl", help=TARGET_HELP)
    r.add_argument("--waive", action="append", choices=WAIVABLE, metavar="OBSERVABLE",
                   help=f"do not compare this observable (repeatable; one of {', '.join(WAIVABLE)})")
    r.add_argument("--spec-only", action="store_true",
                   help="check a recording (kvspec record, kvspec.fuzz.record) on the spec alone: the first op it shows "
                        "that the contract does not allow is printed, exit 1 (docs/record.md); no implementation runs")
    r.set_defaults(fn=cmd_replay)

    rc = add("record", "record a tiny model's real decoding as kvtraces (one per layer)",
             "Decode with a tiny random-weight llama through mlx-lm's own loops, record every layer's cache "
             "(the ops and the windows it returned) and write one kvtrace per layer; check them with "
             "`kvspec replay --spec-only`. Your own runs: kvspec.fuzz.record.record (docs/record.md).")
    rc.add_argument("scenario", choices=("generate", "server", "speculative"),
                    help="generate: two chat turns on one prompt cache; server: a prompt cache whose state is "
                         "saved after a request and put back, trimmed, for the next ones; speculative: "
                         "speculative decoding with an early-exit draft (trims)")
    rc.add_argument("--cache", default="impl", metavar="CACHE",
                    help="whose caches decode: impl (this project's), mlx-lm (mlx-lm's own), or MODULE:ATTR, a "
                         "cache class with mlx-lm's protocol (one per layer, built with no arguments) or a function "
                         "model -> list of caches (default: impl)")
    rc.add_argument("-o", "--out", required=True, metavar="DIR", help="folder for layerNN.json (created)")
    rc.add_argument("--seed", type=int, default=0, help="weights and prompts (default: 0)")
    rc.add_argument("--tokens", type=int, default=4, help="tokens generated a turn, 1 to 64 (default: 4)")
    rc.add_argument("--json", action="store_true", help="print one JSON object")
    rc.set_defaults(fn=_cmd_record)

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
    rd.add_argument("--target", default="impl", help=TARGET_HELP + "; the picture is the target's run, drawn "
                    "against the spec, up to the op where it diverges")
    rd.add_argument("--waive", action="append", choices=WAIVABLE, metavar="OBSERVABLE",
                    help=f"do not compare this observable (repeatable; one of {', '.join(WAIVABLE)})")
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
    f.add_argument("--kind", choices=[*kinds.trace_kinds(), "batch"],
                   help="cache kind (default: every kvtrace kind); batch: the batch caches against B single "
                        "caches and kvspec.spec.batch (docs/fuzzing.md, 'Batch caches')")
    f.add_argument("--mode", choices=list(kinds.all_modes()), help="storage mode (default: every implemented mode)")
    f.add_argument("--inplace", choices=["on", "off", "both"], default="both", help="the KV_INPLACE_WRITE switch")
    f.add_argument("--budget", type=positive_seconds, default=60.0,
                   help="seconds of search, shared by the campaigns round-robin (each gets its slice from the "
                        "first seconds); shrinking a failure is timed apart and reported (default: 60)")
    f.add_argument("--shrink-budget", type=nonnegative_seconds, default=None, metavar="S",
                   help="seconds a campaign may spend shrinking its failure, reported apart; when they run out "
                        "the smallest failing run found so far is written (default: the --budget)")
    f.add_argument("-j", "--jobs", type=int_in(1, 1024), default=1,
                   help="processes (forkserver pool): each runs its share of the campaigns for the whole "
                        "budget; more processes than campaigns repeat them under other seeds (default: 1)")
    f.add_argument("--seed", type=int_in(0, 2**32 - 1), help="first seed (default: from the clock; printed first)")
    f.add_argument("--bug", help="fuzz an injected bug of the catalog (expect a failure)")
    f.add_argument("--engine", choices=ENGINE_CHOICES, default=None,
                   help="how examples run the state machines' rules: program (one byte string an example, "
                        "decoded into the rules; 1.3-1.9x the ops a second on most kinds) or stateful (Hypothesis's "
                        "rule steps); docs/fuzzing.md, 'Engines' (default: $KVSPEC_ENGINE, else program)")
    f.add_argument("--out", default=DEFAULT_OUT, help="folder for failure traces")
    f.add_argument("--target", default="impl", help=TARGET_HELP)
    f.add_argument("--db", metavar="WHERE",
                   help="the Hypothesis example database every process shares: a folder, redis://HOST:PORT (many "
                        "machines; hypothesis[redis]) or none; saved failures replay first "
                        f"(default: $KVSPEC_DB, else {DEFAULT_DB})")
    f.add_argument("--json", action="store_true", help="print one JSON object (docs/json.md)")
    f.add_argument("--junit-xml", metavar="PATH", help="also write a JUnit XML report, one test case per campaign")
    f.add_argument("--sarif", metavar="PATH", help="with --target: also write its divergences as SARIF 2.1.0")
    f.add_argument("--examples", type=int_in(1, 1_000_000), default=None,
                   help="examples per campaign, in seeded rounds of 25, instead of --budget seconds; a failure is "
                        "shrunk by replays: a verdict and a --json report that do not depend on the machine's "
                        "speed (a baseline for --baseline; default seed 20261207; with --baseline default 200)")
    f.add_argument("--baseline", metavar="BASE",
                   help="with --target: compare this environment's engine (the head) with a base and report the "
                        "divergences the head adds, fixes and shares (docs/review.md): BASE is a saved report "
                        "(REPORT.json of --examples N --json), an import folder put first on sys.path, or another "
                        "install's Python executable; exit 1 only when the head adds a divergence")
    f.set_defaults(fn=cmd_fuzz)

    cp = add("campaign", "fuzz on every core under HypoFuzz, with its dashboard",
             "Run the state machines (every campaign of `kvspec verify`, or one injected bug's) under HypoFuzz, "
             "a coverage-guided fuzzer that spends its processes on the machines still finding new behaviour, "
             "for --budget seconds, with its dashboard (a web page: inputs, coverage, failures per machine). "
             "Each failure is written to --out as a kvtrace, with the command that replays it. Needs the "
             "optional extra 'campaign' (HypoFuzz is AGPL-3.0): pip install 'kvspec[campaign]'. Many "
             "machines share one campaign through a Redis example database (docs/campaigns.md).")
    cp.add_argument("--budget", type=positive_seconds, default=600.0, help="seconds to run (default: 600)")
    cp.add_argument("-j", "--jobs", type=int_in(1, 1024), default=None,
                    help="worker processes (default: every core)")
    cp.add_argument("--only", action="append", metavar="PREFIX",
                    help="campaigns whose kind/mode/inplace|copy label starts with PREFIX (e.g. dense, "
                         "rotating/fp16/copy); repeatable (default: all)")
    cp.add_argument("--bug", help="fuzz an injected bug of the catalog in its configuration (expect a failure)")
    cp.add_argument("--out", default=DEFAULT_OUT, help="folder for failure traces and HypoFuzz's log")
    cp.add_argument("--db", metavar="WHERE",
                    help=f"the example database: a folder or redis://HOST:PORT shared by many machines "
                         f"(default: $KVSPEC_DB, else {DEFAULT_DB})")
    cp.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=True,
                    help="serve HypoFuzz's dashboard while the campaign runs")
    cp.add_argument("--host", default="127.0.0.1", help="the dashboard's address (default: 127.0.0.1)")
    cp.add_argument("--port", type=int_in(0, 65535), default=9999,
                    help="the dashboard's port; 0: a free one (default: 9999)")
    cp.add_argument("--json", action="store_true", help="print one JSON object (docs/json.md)")
    cp.set_defaults(fn=cmd_campaign)

    c = add("conformance", "fuzz an engine's caches (mlx-lm, transformers, llama.cpp, vLLM) against the spec and "
                           "report what diverges",
            "Fuzz an engine's cache classes against the spec and report every divergence with a minimal trace "
            "(docs/conformance.md): mlx-lm's by default, another engine's with --target (transformers, "
            "llama.cpp, vllm, ...). The mlx-lm and transformers searches are budgeted in seconds (--budget); the "
            "llama.cpp and vLLM searches in examples (--examples, --steps). An option that does not apply to the "
            "target exits 2 naming it.")
    c.add_argument("--budget", type=positive_seconds, default=None,
                   help="seconds in all, split over the classes (default 120; not with --target llama.cpp or "
                        "vllm, whose searches are budgeted by --examples)")
    c.add_argument("--seed", type=int_in(0, 2**32 - 1), default=CONFORMANCE_SEED, help="first seed")
    c.add_argument("--out", default=DEFAULT_OUT + "/conformance", help="folder for the minimal traces")
    c.add_argument("--class", dest="classes", action="append", metavar="CLASS",
                   help="a cache class of the target to fuzz (repeatable; default all): mlx-lm's KVCache, "
                        "QuantizedKVCache, ...; llama.cpp's llama_kv_cache, llama_kv_cache_iswa; vLLM's "
                        "KVCacheManager; the report lists a target's classes")
    c.add_argument("--max-findings", type=int_in(1, 1000), default=None,
                   help="divergences per class at most (default 8; 16 with --target llama.cpp or vllm)")
    c.add_argument("--target", default=None,
                   help="the engine whose classes to fuzz (default: mlx-lm's KVCache, QuantizedKVCache, "
                        "ConcatenateKVCache, RotatingKVCache); e.g. transformers, or any target of docs/targets.md")
    c.add_argument("--examples", type=int_in(1, 1_000_000), default=None,
                   help="--target llama.cpp or vllm: examples per round (default 200 for llama.cpp, 300 for vllm; "
                        "their searches are budgeted by examples); other targets too, instead of --budget "
                        "seconds: a class's search ends at a round of this many examples without a divergence "
                        "(a verdict that does not depend on the machine's speed; with --baseline default 200)")
    c.add_argument("--steps", type=int_in(1, 10_000), default=None,
                   help="ops per example (default 40)")
    c.add_argument("--baseline", metavar="BASE",
                   help="compare this environment's engine (the head) with a base and report the divergences "
                        "the head adds, fixes and shares (docs/review.md): BASE is a saved report (REPORT.json "
                        "of --examples N --json), an import folder put first on sys.path (a checkout at the "
                        "base), or another install's Python executable; both sides run the same seed and "
                        "--examples; exit 1 only when the head adds a divergence")
    c.add_argument("--json", action="store_true", help="print one JSON object (docs/json.md)")
    c.add_argument("--sarif", metavar="PATH",
                   help="also write the divergences as SARIF 2.1.0 (faults as errors, contract differences as "
                        "warnings; with --baseline: the added ones)")
    c.add_argument("--junit-xml", metavar="PATH",
                   help="with --baseline: also write a JUnit XML report, one test case per divergence key "
                        "(added: failed, in both: skipped, fixed: passed)")
    c.set_defaults(fn=cmd_conformance)

    v = add("verify", "traces, fixed-seed campaigns, injected bugs, proofs: one table",
            "Everything that must hold, in one table: every regression trace, a fixed-seed campaign per "
            "kind and mode, every injected bug caught, the real-decoding scenarios, the proofs and CrossHair. "
            "The checks run in parallel (-j).")
    v.add_argument("--quick", action="store_true",
                   help="a first verdict on every kind, bug and obligation in about a minute: each campaign "
                        "25 examples (bounded by examples, not seconds; no must-reach requirement), one seed per "
                        "injected bug, every Z3 obligation; leaves out the e2e scenarios and CrossHair")
    v.add_argument("--json", action="store_true", help="print one JSON object (docs/json.md)")
    v.add_argument("-k", dest="pattern", metavar="PATTERN", action="append",
                   help="only the jobs whose label contains PATTERN (a shell glob when it has * ? or [); "
                        "repeatable: any of them; `kvspec verify --list` shows the labels")
    v.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failed check")
    v.add_argument("--list", action="store_true", help="list the jobs' labels and exit")
    v.add_argument("--junit-xml", metavar="PATH", help="also write a JUnit XML report, one test case per check")
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
    mu.add_argument("--json", action="store_true", help="print one JSON object (docs/json.md)")
    mu.add_argument("--junit-xml", metavar="PATH", help="also write a JUnit XML report, one test case per entry")
    mu.add_argument("--list", action="store_true", help="list the injected bugs (name, kind, modes, what) and exit")
    mu.add_argument("--out", default=DEFAULT_OUT + "/mutants", help="folder for the traces, one folder per seed")
    mu.add_argument("--only", nargs="+", metavar="BUG", help="these bugs only (default: the whole catalog)")
    mu.add_argument("-j", "--jobs", type=int_in(1, 1024), default=None,
                    help="processes to run the seeds on (default: every core; 1 runs them in this process); "
                         "the report is the same, in catalog order")
    mu.add_argument("--changed", metavar="BASE",
                    help="instead of the catalog: mutmut on the lines of spec/ and impl/ changed since git revision "
                         "BASE; report each surviving mutant with file:line and its diff (docs/mutation.md)")
    mu.add_argument("--max-children", type=int_in(1, 64), default=2,
                    help="with --changed: mutants run in parallel (default 2)")
    mu.set_defaults(fn=cmd_mutants)

    be = add("bench", "the cost contract as ratios: in-place vs copying decode, logical vs physical rollback",
             "Measure the cost contract at growing context lengths, as ratios: decode in place vs copying, "
             "and trim+append rollback with the logical trim vs a physical re-slice. Each step consumes keys "
             "and values as a decoder does.")
    be.add_argument("--contexts", type=int_in(1, 2**20), nargs="+", default=_BENCH_DEFAULTS["contexts"],
                    help="context lengths (rows); the last over the first is the ratio column")
    be.add_argument("--json", action="store_true", help="print one JSON object (docs/json.md)")
    be.add_argument("--decoder", action="store_true",
                    help="also the decoder rows: write + attention over --layers layers, ours beside mlx-lm's caches")
    be.add_argument("--e2e", action="store_true",
                    help="also tokens/s through mlx-lm with random-weight Qwen2.5-7B / Gemma-3-shaped models (GPU)")
    be.add_argument("--layers", type=int_in(1, 256), default=None,
                    help="layers per decoder step (default: 28 on a GPU, 4 on the CPU)")
    be.add_argument("--rounds", type=int_in(2, 10000), default=None, help="timed rounds per row and context")
    be.add_argument("--e2e-contexts", type=int_in(16, 2**20), nargs="+", default=_BENCH_DEFAULTS["e2e_contexts"],
                    help="prefill lengths of the end-to-end rows")
    be.add_argument("--tokens", type=int_in(4, 100000), default=_BENCH_DEFAULTS["tokens"],
                    help="tokens an end-to-end block decodes (every config decodes its blocks in turn, "
                         "its caches kept alive)")
    be.add_argument("--repeats", type=int_in(1, 100), default=_BENCH_DEFAULTS["repeats"],
                    help="end-to-end blocks per config and context (median; each paired with mlx-lm's "
                         "block of the same round)")
    be.add_argument("--record", metavar="DIR", help="write the run as a record under DIR: JSON, Markdown, PNG plot")
    be.add_argument("--e2e-size", choices=["7b", "tiny"], default=_BENCH_DEFAULTS["e2e_size"],
                    help="end-to-end model shapes: Qwen2.5-7B / 0.5B and Gemma-3-1B (default), or toy shapes (a smoke run)")
    be.add_argument("--plot", metavar="JSON",
                    help="only draw the PNG plot of an existing record's JSON (beside it) and exit; for a record "
                         "made where matplotlib is missing")
    be.add_argument("--recurrent", action="store_true",
                    help="instead: what exact rollback of a hybrid model's recurrent layers costs: per speculative "
                         "round (k = 2, 4) the verify block with the step recorder on vs off vs plain decoding, the "
                         "rollback, the checkpoint ring's memory, and end-to-end speculative decoding vs greedy "
                         "(random-weight qwen3_next / lfm2 shapes; takes --contexts, --rounds, --e2e-contexts "
                         "(default 1024), --tokens, --repeats, --record; docs/recurrent.md)")
    be.add_argument("--recurrent-size", choices=["full", "small", "tiny"], default=None,
                    help="with --recurrent: model shapes: full (hidden 2048, the GPU default), small (hidden 512, "
                         "the CPU default) or tiny (a smoke run)")
    be.add_argument("--harness", action="store_true",
                    help="instead: where a fuzz campaign's time goes, per registry campaign (verify's seed): ops/s "
                         "of the campaign, of the same ops replayed through every check, and of the spec and "
                         "implementation alone with and without reading every window (docs/fuzzing.md)")
    be.add_argument("--only", nargs="+", metavar="WORD",
                    help="with --harness: the campaigns whose label (kind/mode/inplace|copy) holds one of the words")
    be.add_argument("--batches", type=int_in(2, 100), default=None,
                    help="with --harness: seeded batches of 25 examples per campaign, the first timed apart "
                         "(default 3)")
    be.set_defaults(fn=cmd_bench)

    e = add("e2e", "real decoding: the caches inside mlx-lm models, byte-identical to the references",
            "Run small random-weight mlx-lm models with these caches through generate_step, speculative "
            "decoding and LRUPromptCache, comparing every token and log-probability with the references.")
    e.add_argument("--long", action="store_true", help="longer streams, wider windows, four seeds (under ~3 min)")
    e.add_argument("--json", action="store_true", help="print one JSON object (docs/json.md)")
    e.add_argument("--bug", help="run on an injected bug of the catalog")
    e.add_argument("--only", nargs="+", metavar="SCENARIO", help="scenario names (default: all)")
    e.set_defaults(fn=cmd_e2e)

    ad = add("adapter", "check a cache adapter, or write a skeleton of one (kvspec adapter check|new)",
             "Tools for putting a cache of your own under kvspec (docs/targets.md): check an adapter program "
             "(the kvproto/1 line protocol) or a cache class before fuzzing it, or write a skeleton adapter "
             "in Python, C or Rust.")
    ad_sub = ad.add_subparsers(dest="adapter_command", required=True, metavar="{check,new}", parser_class=_Parser)
    ac = ad_sub.add_parser(
        "check", formatter_class=_Formatter, epilog=_epilog("adapter"),
        help="start an adapter, send canned requests, explain every problem",
        description="Start the adapter program CMD [ARGS] (what --target exec:CMD names), validate its hello "
                    "against the kvproto/1 schema, send canned sessions (init, appends, fetch, trims, holders "
                    "and snapshots, refusals, an op no adapter has, bye), each to a fresh process, and explain "
                    "every problem in one sentence: what was sent, what came back, the rule, the fix. With "
                    "--target module:Class, check a cache class instead: its declaration, the members the "
                    "target API needs, and a small canned trace replayed against the spec.")
    ac.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD",
                    help="the adapter's command line (a path and its arguments; exec: in front is allowed)")
    ac.add_argument("--target", metavar="MODULE:CLASS", default=None,
                    help="check a cache class (or any --target) instead of an adapter program")
    ac.add_argument("--timeout", type=positive_seconds, default=10.0, metavar="S",
                    help="seconds to wait for one reply, a hang guard only (default: 10)")
    ac.add_argument("--json", action="store_true", help="print one JSON object (problems, passed steps, notes)")
    an = ad_sub.add_parser(
        "new", formatter_class=_Formatter, epilog=_epilog("adapter"),
        help="write a skeleton adapter (a correct dense cache) in Python, C or Rust",
        description="Write a skeleton kvproto/1 adapter into DIR: a correct dense cache, so `kvspec adapter "
                    "check` and `kvspec fuzz --target exec:...` pass on it as written, with comments marked YOUR "
                    "CACHE where your engine's cache goes; print how to build, check and fuzz it.")
    an.add_argument("--lang", choices=["python", "c", "rust"], required=True, help="the skeleton's language")
    an.add_argument("dir", metavar="DIR", help="a new (or empty) folder to write into")
    for sp in (ac, an):
        sp.set_defaults(fn=_cmd_adapter)

    pr = sub.add_parser("prove", help="Z3 proofs and CrossHair contracts of the spec (kvspec prove --help)",
                        add_help=False)
    pr.add_argument("rest", nargs=argparse.REMAINDER)
    pr.set_defaults(fn=cmd_prove)
    for name in ("replay", "fuzz", "verify", "mutants", "bench", "e2e", "conformance", "record"):
        subs[name].add_argument("--device", choices=["cpu", "gpu"], default=None,
                                help="MLX device to run the caches on (default: $KVSPEC_DEVICE, else MLX's default)")
    for name in ("verify", "mutants"):
        subs[name].add_argument("--engine", choices=ENGINE_CHOICES, default=None,
                                help="how the campaigns and the catalog's runs run the state machines' rules: "
                                     "program or stateful (docs/fuzzing.md, 'Engines'; default: $KVSPEC_ENGINE, "
                                     "else program)")
    p.set_defaults(_subparsers=subs)
    return p


def main(argv: list[str] | None = None) -> int:
    """The ``kvspec`` command; returns the exit status (see each command's
    ``--help``). Bad arguments exit 2 with the command's usage, never a
    traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["prove"]:
        # prove's options belong to kvspec.proofs.cli; argparse would eat them.
        try:
            from kvspec.proofs.cli import main as prove_main
        except ModuleNotFoundError as exc:  # the extra `proofs` (Z3, CrossHair) is not installed
            print(f"kvspec prove: {exc.name} is not installed; the proofs need the extra 'proofs' "
                  f"(pip install 'kvspec[proofs]': Z3 and CrossHair)", file=sys.stderr)
            return 2

        return prove_main(argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = argv
    if extra:
        # report on the subcommand's own usage, with a suggestion
        import difflib

        sp = parser.get_default("_subparsers")[args.command]
        known = [o for a in sp._actions for o in a.option_strings]
        hints = [m for x in extra if x.startswith("-") for m in difflib.get_close_matches(x.split("=")[0], known, 1)]
        sp.error(f"unrecognized arguments: {' '.join(extra)}" + (f" (did you mean {', '.join(hints)}?)" if hints else ""))
    if hasattr(args, "device"):
        from kvspec.fuzz.device import DeviceError, select

        try:
            select(args.device)
        except DeviceError as exc:
            return _usage_error(_console(), str(exc))
    if getattr(args, "engine", None):
        # every process the command starts (spawned: their environment is
        # this one) runs the same engine
        os.environ["KVSPEC_ENGINE"] = args.engine
    elif os.environ.get("KVSPEC_ENGINE", "").strip() not in ("", *ENGINE_CHOICES) and \
            args.command in ("fuzz", "verify", "mutants", "campaign"):
        return _usage_error(_console(), f"KVSPEC_ENGINE={os.environ['KVSPEC_ENGINE']!r}: not one of "
                                        f"{', '.join(ENGINE_CHOICES)}")
    from kvspec.fuzz import interrupt

    interrupt.install()
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:
        # commands with a summary catch Ctrl-C themselves; the rest stop here
        print(f"kvspec {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        interrupt.clear()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())


__all__ = ["Any", "build_parser", "main"]
