"""``kvspec replay``: run a kvtrace on the spec and an implementation in
lockstep (docs/kvtrace.md, "What replay compares after every op")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fuzz import kinds
from fuzz.lockstep import Divergence, Lockstep
from fuzz.targets import resolve
from fuzz.trace import Trace, TraceFormatError

EXIT_OK, EXIT_DIVERGED, EXIT_INVALID, EXIT_TRACE_CHECK = 0, 1, 2, 3
#: Ctrl-C (128 + SIGINT), as shells report it
EXIT_INTERRUPTED = 130


def make_lockstep(cache: dict[str, Any], factories: dict[str, Any] | None = None, check_inplace: bool = True,
                  target: Any = "impl") -> Lockstep:
    """The lockstep driver for the trace's cache kind. ``factories`` maps a
    kind to the implementation class to use (the bug catalog swaps them);
    ``check_inplace=False`` leaves the write path unobserved. ``target``
    (a name or a ``fuzz.targets.Target``) picks the implementation family:
    ``impl`` (ours) or an mlx-lm target, whose driver declares what it does
    not compare. Raises TraceFormatError when the target has no class for
    the trace's cache."""
    tgt = resolve(target)
    if not tgt.is_impl:
        if factories:
            raise ValueError(f"factories: injected bugs patch this project's classes, not target {tgt.name}")
        lock = tgt.make_lockstep(cache)
        lock.narrow_masks = False
        lock.impl_name = tgt.name
        # mlx-lm's conformance findings were taken without these checks:
        # a dense cache's masks and memory sharing are this project's
        # contract, not a report on another engine.
        lock.check_dense_masks = False
        lock.check_sharing = False
        return lock
    lock = _make_lockstep(cache, factories or {})
    lock.check_inplace = check_inplace
    lock.compare_messages = True
    return lock


def _make_lockstep(cache: dict[str, Any], factories: dict[str, Any]) -> Lockstep:
    """Our implementation's driver for the trace's kind (the registry's
    entry); ``factories`` maps a kind to a patched class (injected bugs)."""
    try:
        kind = kinds.get(cache["kind"], cache["mode"])
    except kinds.UnknownKindError as exc:
        raise TraceFormatError(f"field cache.{exc.field}: {exc}") from None
    driver = kind.lockstep_class()
    driver.check_cache(cache)
    factory = factories.get(kind.kind)
    return driver(cache) if factory is None else driver(cache, factory)


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


@dataclass
class ReplayResult:
    ok: bool
    ops_run: int
    divergence: Divergence | None = None
    stats: dict[str, int] = field(default_factory=dict)
    #: ops both sides refused, as (index, message): agreement, but a trace
    #: that did not mark them ``"error": true`` may hold a typo
    refusals: list[tuple[int, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.ok, "ops_run": self.ops_run,
                               "refused": [{"index": i, "error": m} for i, m in self.refusals]}
        if self.divergence is not None:
            out["divergence"] = self.divergence.to_json()
        return out


def replay(trace: Trace, factories: dict[str, Any] | None = None, check_inplace: bool = True,
           target: Any = "impl") -> ReplayResult:
    """Run every op; stop at the first divergence. Raises TraceFormatError
    when ``target`` cannot run the trace: no class for its cache, or an op
    the class does not have (fuzz/targets.py says which and why)."""
    tgt = resolve(target)
    check_ops(trace.cache, trace.ops)
    lock = make_lockstep(trace.cache, factories, check_inplace, tgt)
    for i, op in enumerate(trace.ops):
        reason = tgt.skip_reason(trace.cache, op)
        if reason is not None:
            raise TraceFormatError(f"op {i} {op['op']!r}: target {tgt.name} cannot run it: {reason}")
    for i, op in enumerate(trace.ops):
        try:
            lock.step(i, op)
        except Divergence as d:
            return ReplayResult(False, i + 1, d, lock.stats, getattr(lock, "refusals", []))
    return ReplayResult(True, len(trace.ops), None, lock.stats, getattr(lock, "refusals", []))
