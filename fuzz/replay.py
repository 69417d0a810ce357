"""``kvspec replay``: run a kvtrace on the spec and an implementation in
lockstep (docs/kvtrace.md, "What replay compares after every op")."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvspec.fuzz import kinds
from kvspec.fuzz.lockstep import Divergence, Lockstep
from kvspec.fuzz.targets import TargetError, resolve
from kvspec.fuzz.trace import Trace, TraceFormatError

EXIT_OK, EXIT_DIVERGED, EXIT_INVALID, EXIT_TRACE_CHECK = 0, 1, 2, 3
#: Ctrl-C (128 + SIGINT), as shells report it
EXIT_INTERRUPTED = 130


def make_lockstep(cache: dict[str, Any], factories: dict[str, Any] | None = None, check_inplace: bool = True,
                  target: Any = "impl") -> Lockstep:
    """The lockstep driver for the trace's cache on ``target`` (a name or a
    ``kvspec.fuzz.targets.Target``; :meth:`Target.make_lockstep`). ``factories``
    maps a kind to the implementation class to use (the bug catalog swaps
    them; ``impl`` only); ``check_inplace=False`` leaves the write path
    unobserved. Raises TraceFormatError (TargetCapabilityError) when the
    target cannot build the trace's cache."""
    tgt = resolve(target)
    if factories:
        if not tgt.is_impl:
            raise TargetError(f"factories: injected bugs patch this project's classes, not target {tgt.label}")
        tgt = replace(tgt, factories=factories)
    if not check_inplace:
        tgt = replace(tgt, check_inplace=False)
    return tgt.make_lockstep(cache)


def check_ops(cache: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """Refuse (TraceFormatError) an op the trace's kind does not have, e.g. a
    paged ``fork`` on a dense cache, before anything runs."""
    try:
        kind = kinds.get(cache["kind"], cache.get("mode"))
    except kinds.UnknownKindError:
        return  # make_lockstep names the problem
    for i, op in enumerate(ops):
        if op["op"] not in kind.all_ops and op["op"] not in kind.refuses:
            raise TraceFormatError(
                f"op {i} field 'op': kind {kind.kind} has no op {op['op']!r}; its ops: {', '.join(kind.all_ops)}"
            )
        if op["op"] in kind.without:
            raise TraceFormatError(f"op {i} {op['op']!r}: mode {cache.get('mode')} cannot run it: "
                                   f"{kind.without[op['op']]}")


@dataclass
class ReplayResult:
    ok: bool
    ops_run: int
    divergence: Divergence | None = None
    stats: dict[str, int] = field(default_factory=dict)
    #: ops both sides refused, as (index, message): agreement, but a trace
    #: that did not mark them ``"error": true`` may hold a typo
    refusals: list[tuple[int, str]] = field(default_factory=list)
    #: observables (or "masks") the target's class does not have or declares
    #: no contract for: not compared in this run
    not_compared: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.ok, "ops_run": self.ops_run,
                               "refused": [{"index": i, "error": m} for i, m in self.refusals],
                               "not_compared": self.not_compared}
        if self.divergence is not None:
            out["divergence"] = self.divergence.to_json()
        return out


def replay(trace: Trace, factories: dict[str, Any] | None = None, check_inplace: bool = True,
           target: Any = "impl") -> ReplayResult:
    """Run every op; stop at the first divergence. The trace goes to the
    registry (its kind's ops), to the target (which checks that it can run
    the trace: its class, cache fields and ops, else TargetCapabilityError,
    a TraceFormatError), to the kind's lockstep over spec and target."""
    check_ops(trace.cache, trace.ops)
    tgt = resolve(target)
    tgt.check(trace.cache, trace.ops)
    lock = make_lockstep(trace.cache, factories, check_inplace, tgt)
    for i, op in enumerate(trace.ops):
        try:
            lock.step(i, op)
        except Divergence as d:
            return ReplayResult(False, i + 1, d, lock.stats, lock.refusals, sorted(getattr(lock, "not_compared", ())))
    return ReplayResult(True, len(trace.ops), None, lock.stats, lock.refusals, sorted(getattr(lock, "not_compared", ())))


#: what a failed run's exception is, for ``kvspec fuzz`` and ``kvspec
#: conformance``: a finding (exit 1), or no verdict at all (exit 2)
FAILURE_STATUSES = ("diverged", "not applicable", "tool failure")


def failure_status(error: BaseException | None) -> str:
    """``diverged`` for a Divergence (or a state machine's invariant, an
    AssertionError of the comparison); ``not applicable`` when the target
    cannot run the trace or an op of it (TargetCapabilityError, e.g.
    kvspec.fuzz.targets.TargetCannotRun: a capability gap, exit 2); ``tool
    failure`` for anything else (the harness's own crash, exit 2: never a
    divergence). An exception carried back from a worker process keeps its
    status in ``status``."""
    from kvspec.fuzz.targets import TargetCapabilityError

    carried = getattr(error, "status", None)
    if carried in FAILURE_STATUSES:
        return carried
    if isinstance(error, (Divergence, AssertionError)):
        return "diverged"
    if isinstance(error, TargetCapabilityError):
        return "not applicable"
    return "tool failure"
