"""``kvspec conformance``: fuzz mlx-lm's own caches against the spec and
report what diverges.

Each mlx-lm class (``kvspec.fuzz.targets``) is fuzzed with the ordinary state
machines, through an adapter, by the ordinary lockstep. A run stops at the
first divergence, so finding several distinct ones takes rounds: after each
finding the search stops looking at what it just found and fuzzes again.

* an observable that differs (``capacity``, ``trimmable``, ...) is no longer
  compared (``Target.waiving``);
* a ``make_mask`` difference stops the mask check;
* a holder whose view changed (isolation) stops generating that holder kind
  (``hold``, or ``snapshot`` with its ``restore``/``drop``);
* any other divergence (a refusal, a return value, a window) stops
  generating the op class it happened at (``kvspec.fuzz.targets.op_class``: the op
  name, appends split into n = 1 and n > 1, trims by the sign of n).

This is a partition of what the harness compares and generates, not a list
of known faults: the search knows nothing about mlx-lm. A class ends when a
round spends its budget without a divergence, when ``max_findings`` are
found, or when nothing is left to exclude (both append classes, or a failure
it cannot classify, such as a state-machine invariant).

Every finding's minimal trace is written to ``out`` as ``<Class>_NN.json``
and checked: it must replay with exit 1 on its target (with the waivers in
force when it was found, ``--waive``) and with exit 0 on this project's
implementation.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvspec.fuzz.adapters.mlx_lm import (
    CONCAT,
    INPLACE_REASON,
    KVCACHE,
    QUANTIZED,
    ROTATING,
    mlx_lm_version,
)
from kvspec.fuzz.campaign import machine_for, run_machine
from kvspec.fuzz.lockstep import Divergence, Lockstep
from kvspec.fuzz.replay import failure_status, make_lockstep, replay
from kvspec.fuzz.targets import CacheClass, Target, op_class, resolve
from kvspec.fuzz.trace import Trace, write

DEFAULT_SEED = 20261129
DEFAULT_OUT = "fuzz-failures/conformance"
#: class -> the target that runs it
CLASSES: tuple[tuple[CacheClass, str], ...] = (
    (KVCACHE, "mlx-lm"), (QUANTIZED, "mlx-lm"), (CONCAT, "mlx-lm-concat"), (ROTATING, "mlx-lm"),
)
OBSERVABLES = ("offset", "live_start", "live_len", "capacity", "idx", "trimmable", "trimmable_rows")
#: Divergences that are contract differences, not faults: what a cache keeps
#: allocated, and how it says no. Every other divergence (a wrong window or
#: wrong bytes, a corrupted counter, a held view that changed, a wrong
#: return value, a wrong mask) is a fault.
CONTRACT_DIFFERENCES = {
    "capacity differs": "capacity kept or dropped",
    "trimmable differs": "refusal style (is_trimmable)",
    "trimmable_rows differs": "refusal style (trimmable_rows)",
    "refusal differs": "refusal style",
    "refusal category differs": "refusal style (category)",
    "refusal message differs": "refusal style (message)",
}
FAULT, CONTRACT = "fault", "contract difference"


def category(what: str) -> str:
    """``"fault"`` or ``"contract difference"`` for a divergence's ``what``."""
    return CONTRACT if what in CONTRACT_DIFFERENCES else FAULT
WAIVABLE = OBSERVABLES + ("masks",)
_APPENDS = {"append n=1", "append n>1"}


@dataclass
class Finding:
    """One divergence: where, what, and its minimal trace."""

    cache_class: str
    target: str
    index: int
    op: dict[str, Any]
    what: str
    summary: str
    trace: str | None
    #: observables not compared when it was found (replay --waive ...)
    waived: list[str]
    #: what the search stopped looking at afterwards
    then: str
    #: replay exit status on the target (1 expected) and on impl (0 expected)
    on_target: int | None = None
    on_impl: int | None = None
    examples_to_catch: int | None = None

    @property
    def replay_command(self) -> str:
        waive = "".join(f" --waive {w}" for w in self.waived)
        return f"kvspec replay --target {self.target}{waive} {self.trace}"

    @property
    def confirmed(self) -> bool:
        return self.on_target == 1 and self.on_impl == 0

    @property
    def category(self) -> str:
        """A fault (wrong window, bytes, counter, held view) or a contract
        difference (capacity kept or dropped, a refusal style)."""
        return category(self.what)


@dataclass
class ClassReport:
    """What fuzzing one mlx-lm class found."""

    cache_class: str
    target: str
    kind: str
    mode: str
    seconds: float = 0.0
    examples: int = 0
    steps: int = 0
    covered: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    not_compared: dict[str, str] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    ended: str = ""
    #: why the search stopped without a verdict (``not applicable: ...`` or
    #: ``tool failure: ...``; kvspec.fuzz.replay.failure_status), else ""
    no_verdict: str = ""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for f, doc in zip(self.findings, out["findings"]):
            doc["replay"] = f.replay_command
            doc["confirmed"] = f.confirmed
            doc["category"] = f.category
        return out


#: checks ``failure_trace`` adds to the last op: the spec's predictions, not arguments
_CHECKS = ("returns", "error", "inplace", "capacity")


def describe_op(op: dict[str, Any]) -> str:
    """``trim n=-1``: an op and its arguments as one short phrase."""
    args = " ".join(f"{k}={json.dumps(v)}" for k, v in op.items() if k != "op" and k not in _CHECKS)
    return f"{op['op']} {args}".strip()


def next_target(target: Target, error: BaseException) -> tuple[Target | None, str]:
    """The target for the next round after ``error``, and a phrase saying
    what it stopped looking at; None when there is nothing left to exclude."""
    if not isinstance(error, Divergence):
        return None, f"stopped: {type(error).__name__} outside the lockstep (e.g. an invariant) cannot be classified"
    what = error.what
    m = re.fullmatch(r"(\w+) differs", what)
    if m and m.group(1) in OBSERVABLES:
        return target.waiving(m.group(1)), f"stopped comparing {m.group(1)}"
    if what.startswith("make_mask("):
        return target.waiving("masks"), "stopped checking make_mask"
    if what.startswith("view of "):
        family = ("hold" if what.startswith("view of held ") else
                  "state_snapshot" if what.startswith("view of state snapshot ") else "snapshot")
        return target.excluding(family), f"stopped generating {family}"
    cls = op_class(error.op)
    if cls in target.excluded:
        return None, f"stopped: {cls} diverged although excluded"
    after = target.excluding(cls)
    if _APPENDS <= after.excluded:
        return None, f"stopped: excluding {cls} leaves no appends"
    return after, f"stopped generating {cls}"


def differences_after(lock: Lockstep) -> list[str]:
    """Everything that differs between the spec and the implementation in
    their current states, as short phrases (no exception)."""
    out: list[str] = []
    s_obs, i_obs = lock.spec_observables(), lock.impl_observables()
    for key, want in s_obs.items():
        if i_obs.get(key) != want:
            out.append(f"{key} {i_obs.get(key)} (spec {want})")
    # a lockstep whose views are not windows of rows (the recurrent kind's:
    # conv window and state after each rollback the spec covers) gives its
    # spec histories and words them itself
    s_views = getattr(lock, "spec_histories", lock.spec_views)()
    i_views = lock.impl_views()
    spec_label = getattr(lock, "spec_label", list)
    for key, tokens in s_views.items():
        if key in i_views and not lock.window_matches(tokens, i_views[key]):
            label = "window" if key == "cache" else key.replace("holder:", "snapshot ")
            out.append(f"{label} {lock.identify(i_views[key])} (spec {spec_label(tokens)})")
    return out


def diagnose(trace: Trace, target: Target) -> tuple[Divergence | None, str]:
    """Replay ``trace`` on ``target`` and describe its first divergence in
    one line, with whatever else differs right after that op."""
    lock = make_lockstep(trace.cache, target=target)
    for i, op in enumerate(trace.ops):
        try:
            lock.step(i, op)
        except Divergence as d:
            who = "mlx-lm" if target.name.startswith("mlx-lm") else target.label
            line = f"op {d.index} {describe_op(d.op)}: {d.what}: {who} {_short(d.impl)}, spec {_short(d.spec)}"
            if d.what not in ("refusal differs",) and not d.what.startswith("make_mask("):
                extra = [x for x in differences_after(lock) if not _same_fact(x, d)]
                if extra:
                    line += "; after it: " + "; ".join(extra)
            return d, line
    return None, "no divergence on replay"


def _short(x: Any) -> str:
    s = x if isinstance(x, str) else json.dumps(x) if isinstance(x, (list, int, bool)) or x is None else repr(x)
    return re.sub(r"^(\w+)=", "", s)


def _same_fact(phrase: str, d: Divergence) -> bool:
    """Is ``phrase`` (from differences_after) what ``d`` already says?"""
    m = re.fullmatch(r"(\w+) differs", d.what)
    if m:
        return phrase.startswith(m.group(1) + " ")
    if d.what == "live window differs":
        return phrase.startswith("window ")
    m = re.fullmatch(r"view of (\S+) changed \(isolation\)", d.what)
    return bool(m) and phrase.startswith(m.group(1).replace("holder:", "snapshot ") + " ")


def _exit(trace: Trace, target: Target) -> int:
    return 0 if replay(trace, target=target).ok else 1


def search_class(cls: CacheClass, target_name: str, budget: float, seed: int, out: Path,
                 max_findings: int = 8, batch: int = 25, steps: int = 40,
                 max_rounds: int | None = None, until_clean: bool = False) -> ClassReport:
    """Fuzz one class in rounds (module docstring) for ``budget`` seconds,
    or ``max_rounds`` rounds of ``batch`` examples in all where given, or
    (``until_clean``) until a round of ``batch`` examples finds nothing (a
    verdict bounded by examples, never by the clock: pass ``budget=math.inf``)."""
    base = resolve(target_name)
    report = ClassReport(cls.name, target_name, cls.kind, cls.mode, skipped=dict(cls.skipped),
                         not_compared={**cls.not_compared, "in-place decision": INPLACE_REASON})
    target: Target | None = base
    start = time.perf_counter()
    k = 0
    while target is not None and len(report.findings) < max_findings:
        machine = machine_for(cls.kind, cls.mode, True, target=target)
        failure = None
        while time.perf_counter() - start < budget and (max_rounds is None or k < max_rounds):
            result = run_machine(machine, seed + k, max_examples=batch, steps=steps, engine="stateful")
            k += 1
            report.examples += result.examples
            report.steps += result.steps
            if result.failed:
                failure = result
                break
            if until_clean:
                break
        for name, count in machine.covered.items():
            report.covered[name] = report.covered.get(name, 0) + count
        if failure is None:
            report.ended = (f"a round of {batch} examples without a further divergence" if until_clean else
                            "budget spent without a further divergence" if max_rounds is None or k < max_rounds
                            else f"{max_rounds} rounds spent without a further divergence")
            break
        assert failure.error is not None
        status = failure_status(failure.error)
        if status != "diverged":
            # no verdict: the class cannot run an op it reached (a capability
            # gap) or the harness itself raised; never counted as a finding
            report.no_verdict = f"{status}: {str(failure.error).splitlines()[0]}"
            report.ended = f"stopped without a verdict ({status})"
            break
        finding = _record(cls, target_name, target, failure, out, len(report.findings) + 1)
        target, finding.then = next_target(target, failure.error)
        report.findings.append(finding)
        if target is None:
            report.ended = finding.then
    if not report.ended:
        report.ended = f"{max_findings} findings (max)"
    report.seconds = time.perf_counter() - start
    return report


def _record(cls: CacheClass, target_name: str, target: Target, failure: Any, out: Path, number: int) -> Finding:
    error = failure.error
    trace: Trace | None = failure.trace
    waived = sorted(target.waived)
    if trace is None or not isinstance(error, Divergence):
        line = str(error).splitlines()[0] if str(error) else type(error).__name__
        return Finding(cls.name, target_name, -1, {}, type(error).__name__, line, None, waived, "",
                       examples_to_catch=failure.examples_to_catch)
    d, line = diagnose(trace, target)
    if d is None:  # pragma: no cover - a shrunk failure always replays
        d, line = error, str(error).splitlines()[0]
    waive = f" --waive {' --waive '.join(waived)}" if waived else ""
    trace.title = (f"{engine_of(target_name)} {cls.name} does not conform "
                   f"(kvspec replay --target {target_name}{waive}): {line}")[:600]
    path = write(trace, out / f"{cls.name}_{number:02d}.json")
    plain = resolve(target_name)
    finding = Finding(cls.name, target_name, d.index, d.op, d.what, line, str(path), waived, "",
                      examples_to_catch=failure.examples_to_catch)
    finding.on_target = _exit(trace, _waived(plain, waived))
    finding.on_impl = _exit(trace, resolve("impl"))
    return finding


def _waived(target: Target, waived: list[str]) -> Target:
    for w in waived:
        target = target.waiving(w)
    return target


def engine_of(target_name: str) -> str:
    """The engine and version a target's classes come from (report titles)."""
    if target_name.startswith("mlx-lm"):
        return f"mlx-lm {mlx_lm_version()}"
    if target_name == "transformers" or target_name.startswith("transformers-"):  # transformers-linear
        from kvspec.fuzz.adapters.transformers import transformers_version

        return transformers_version()
    return target_name


def classes_of(target: str | None) -> tuple[tuple[CacheClass, str], ...]:
    """(class, target name) pairs to fuzz: mlx-lm's by default, else every
    class of ``target`` (any target of docs/targets.md)."""
    if target is None or target == "mlx-lm":
        return CLASSES
    if target == "transformers":  # every transformers cache class, each on a target of its own
        from kvspec.fuzz.adapters.transformers import CONFORMANCE_CLASSES

        return CONFORMANCE_CLASSES
    return tuple((c, target) for c in resolve(target).classes)


def run_conformance(budget: float = 120.0, seed: int = DEFAULT_SEED, out: str | Path = DEFAULT_OUT,
                    only: list[str] | None = None, max_findings: int = 8,
                    target: str | None = None, reports: list[ClassReport] | None = None,
                    examples: int | None = None, steps: int = 40) -> list[ClassReport]:
    """Fuzz every class of ``target`` (default: mlx-lm's four classes, or
    those named in ``only``), ``budget``
    seconds in all, split evenly; or, with ``examples``, in rounds of that
    many examples, a class's search ending at a round without a divergence
    (``budget`` is then ignored: a verdict bounded by examples, never by
    the clock), each example at most ``steps`` ops. Stale ``<Class>_NN.json`` traces of the
    classes run are removed from ``out`` first, and ``out/report.json``
    (:func:`write_report`) lists every trace left there, so the folder is
    the report. Raises KeyError for an unknown class name. Finished
    classes are appended to ``reports`` as they finish (what an
    interrupted run keeps; the report is written for them too)."""
    known = {c.name: (c, t) for c, t in classes_of(target)}
    names = list(known) if not only else list(only)
    for n in names:
        if n not in known:
            import difflib

            close = difflib.get_close_matches(n, list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise KeyError(f"--class: unknown class {n!r}{hint}; known: {', '.join(known)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reports = [] if reports is None else reports
    try:
        _run_classes(names, known, budget, seed, out, max_findings, reports, examples, steps)
    finally:
        write_report(reports, seed, budget, out / REPORT, examples, steps)
    return reports


#: examples per round of a class's search (``search_class``'s ``batch``)
BATCH = 25


def rounds_for(examples: int) -> int:
    """Rounds of :data:`BATCH` examples that run at least ``examples``."""
    return max(1, -(-examples // BATCH))


def _run_classes(names: list[str], known: dict[str, Any], budget: float, seed: int, out: Path, max_findings: int,
                 reports: list[ClassReport], examples: int | None = None, steps: int = 40) -> None:
    for i, n in enumerate(names):
        cls, target = known[n]
        for stale in out.glob(f"{cls.name}_[0-9][0-9].json"):
            stale.unlink()
        bound = f"rounds of {examples} examples" if examples is not None else f"{budget / len(names):.0f} s"
        print(f"conformance: [{i + 1}/{len(names)}] {cls.name} on {target} (seed {seed + 1000 * i}, "
              f"{bound}) ...", file=sys.stderr, flush=True)
        if examples is not None:  # rounds of ``examples`` until one finds nothing (never the clock)
            reports.append(search_class(cls, target, math.inf, seed + 1000 * i, out, max_findings, examples, steps,
                                        until_clean=True))
        else:
            more = {} if steps == 40 else {"steps": steps}  # search_class's default
            reports.append(search_class(cls, target, budget / len(names), seed + 1000 * i, out, max_findings, **more))
        print(f"conformance: {cls.name}: {len(reports[-1].findings)} divergences", file=sys.stderr, flush=True)


#: the machine-readable report written beside the traces (not a trace)
REPORT = "report.json"


def write_report(reports: list[ClassReport], seed: int, budget: float, path: Path, examples: int | None = None,
                 steps: int = 40) -> None:
    """Write the JSON report; classes not run this time keep their entries
    from an earlier report at ``path`` (their traces are still there)."""
    doc = to_json(reports, seed, budget, examples, steps)
    run = {r.cache_class for r in reports}
    if path.exists():
        try:
            old = json.loads(path.read_text())
            doc["classes"] += [c for c in old.get("classes", []) if c.get("cache_class") not in run]
        except (json.JSONDecodeError, AttributeError, TypeError):
            pass  # an unreadable old report is replaced
    path.write_text(json.dumps(doc, indent=1) + "\n")


def to_json(reports: list[ClassReport], seed: int, budget: float | None,
            examples: int | None = None, steps: int = 40) -> dict[str, Any]:
    """The report (docs/json.md): ``budget`` in seconds, or None and
    ``examples`` per class for a search bounded by examples; ``steps`` ops
    an example at most."""
    import mlx.core as mx

    return {"mlx_lm": mlx_lm_version(), "mlx": mx.__version__, "seed": seed,
            "budget": None if examples is not None else budget, "examples": examples, "steps": steps,
            "classes": [r.to_json() for r in reports],
            "ok": all(f.confirmed for r in reports for f in r.findings) and not any(r.no_verdict for r in reports),
            "no_verdict": {r.cache_class: r.no_verdict for r in reports if r.no_verdict}}


def print_report(reports: list[ClassReport], seed: int, budget: float, console: Any = None,
                 examples: int | None = None) -> None:
    """Two rich tables: one row per class, then one row per divergence."""
    import mlx.core as mx
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console(highlight=False, emoji=False)
    total = sum(r.seconds for r in reports)
    bound = f"rounds of {examples} examples" if examples is not None else f"budget {budget:.0f} s"
    table = Table(title=f"kvspec conformance: mlx-lm {mlx_lm_version()} (mlx {mx.__version__}), seed {seed}, "
                        f"{bound}, {total:.0f} s run")
    for col in ("class", "target", "ops covered", "ops skipped (not in the class)", "steps", "faults",
                "contract differences", "search ended"):
        table.add_column(col, overflow="fold")
    for r in reports:
        covered = ", ".join(f"{k} {v}" for k, v in sorted(r.covered.items(), key=lambda kv: -kv[1]))
        faults = sum(f.category == FAULT for f in r.findings)
        table.add_row(escape(r.cache_class), escape(r.target), escape(covered), escape(", ".join(r.skipped) or "-"),
                      str(r.steps), str(faults), str(len(r.findings) - faults), escape(r.ended))
    from kvspec.fuzz.commands.reports import print_table

    print_table(console, table)
    traces = []
    for kind, title in ((FAULT, "faults: a wrong window or bytes, a corrupted counter, a held view that changed"),
                        (CONTRACT, "contract differences: capacity kept or dropped, a refusal style")):
        found = Table(title=f"{title} (each trace replays 1 on its target, 0 on impl)")
        for col in ("class", "#", "what goes wrong", "then", "replay"):
            found.add_column(col, overflow="fold")
        for r in reports:
            for i, f in enumerate(r.findings, 1):
                if f.category != kind:
                    continue
                check = "[green]1/0 ok[/]" if f.confirmed else f"[bold red]{f.on_target}/{f.on_impl}[/]"
                waive = "".join(f" --waive {w}" for w in f.waived)
                found.add_row(escape(r.cache_class), str(i), escape(f.summary), escape(f.then), check)
                traces.append(f"{r.cache_class} #{i}: kvspec replay {f.trace} --target {r.target}{waive}")
        print_table(console, found)
    for line in traces:  # whole lines: a path is never wrapped inside a cell
        console.print(line, soft_wrap=True, markup=False)
    for r in reports:
        if r.no_verdict:
            console.print(f"{r.cache_class} on {r.target}: {r.no_verdict}", soft_wrap=True, markup=False)
