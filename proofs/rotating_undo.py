"""Obligation 8: the ring's undo log (``kvspec.spec.rotating``: ``decode_record``,
``log_push``, ``rollback``, ``trimmable_rows``).

Exactness is proved for every integer window W, sink count K, undo depth U,
offset o and rollback length n of a decode history: the ring after o
decode steps, rolled back by ``n <= min(U, o)`` rows through its log, holds
in every valid slot the row the ring holds after ``o - n`` decode steps.
The slot contents are written in closed form (:func:`content`: the latest
position below x whose ring slot is s; :func:`earliest`: the first position
at or above y in slot s), and two parts prove that the closed forms mean
that, against ``ring_slot`` itself. Rollback of multi-row appends (the
prior layout) is not encoded here: ``tests/test_spec_rotating.py`` replays
every trim of small random histories with blocks instead.

The memory bound: a whole record saves at most one row (a decode overwrites
one slot; a multi-row append onto a buffer of at most W slots drops at most
one of its at most W valid rows), and the log keeps at most U records (the
pruning loop's exit condition), so at most U rows per buffer.

Negative controls: a log one row too short (it keeps U - 1 records),
rollback applied oldest record first, and pruning that keeps a record too
many (exits on ``> U`` instead of ``>= U``); each refuted, the first two
confirmed on ``kvspec.spec.rotating`` with the bug patched in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import z3

from kvspec.proofs import traces
from kvspec.proofs.core import ObligationResult, PartBuilder, control_from_parts, overall, run_parts
from kvspec.proofs.domain import INT, Domain, solver
from kvspec.proofs.rotating_model import ring_slot
from kvspec.spec.rotating import log_push as _spec_log_push


@dataclass(frozen=True)
class UndoRules:
    """The spec's rules by default; other values are negative controls."""

    log: str = "spec"  # | "one_short" (the log keeps U - 1 records)
    order: str = "newest_first"  # | "oldest_first"
    prune: str = "spec"  # | "keeps_one_more" (exit on rest <= U)


UNDO_SPEC = UndoRules()


def content(d: Domain, x: Any, s: Any, W: Any, K: Any) -> Any:
    """The position slot ``s`` (``K <= s < W``, ``x > s``) holds after ``x``
    decode steps from empty: ``s + ((x - 1 - s) // (W - K)) * (W - K)``."""
    L = d.sub(W, K, "W - K")
    a = d.sub(d.sub(x, 1, "x - 1"), s, "x - 1 - s")
    k = d.floordiv(a, L, "(x - 1 - s) // (W - K)")
    _floor_bounds(d, a, L, k)
    return d.add(s, d.mul(k, L, "k * (W - K)"), "s + k * (W - K)")


def _floor_bounds(d: Domain, a: Any, L: Any, k: Any) -> None:
    """In bv32, state what ``k = a // L`` means (``k * L <= a < k * L + L``
    for ``L > 0``; part "floor division bounds" proves it over unbounded
    ints): the no-overflow checks of ``k * L`` need it and Z3's nonlinear
    search does not find it within the time limit."""
    if d.is_bv:
        d.assume("floor division bounds", z3.Implies(L > 0, z3.And(k * L <= a, a < k * L + L)))


def earliest(d: Domain, y: Any, s: Any, W: Any, K: Any) -> Any:
    """The first position ``>= y`` whose slot is ``s`` (``K <= s < W``):
    ``s`` itself, or ``s + ceil((y - s) / (W - K)) * (W - K)``."""
    L = d.sub(W, K, "W - K")
    with d.under(y > s):
        num = d.add(d.sub(y, s, "y - s"), d.sub(L, 1, "L - 1"), "y - s + L - 1")
        k = d.floordiv(num, L, "ceil((y - s) / L)")
        _floor_bounds(d, num, L, k)
        later = d.add(s, d.mul(k, L, "k * L"), "s + k * L")
    return z3.If(y <= s, s, later)


#: positions up to a window past the offset are representable (the ring
#: stores offset; bv32 runs need the headroom for the next window's slots)
HEADROOM = 2**31 - 1


def _shape(W: Any, K: Any) -> Any:
    return z3.And(K >= 0, K < W)


def rolled_back(d: Domain, o: Any, n: Any, s: Any, W: Any, K: Any, U: Any, rules: UndoRules = UNDO_SPEC) -> Any:
    """What slot ``s`` (``K <= s``, valid after ``o - n`` steps) holds after
    ``rollback(n)`` of a decode history of ``o`` steps. The record of the
    decode at position q (``log_push`` keeps those of positions ``[o - U,
    o)``) saved the row it overwrote, ``content(q, s)``; the records are
    applied newest first, so the slot ends with the row saved by the
    earliest logged decode in ``[o - n, o)`` that wrote it, or keeps its
    row when none did."""
    x = o - n
    if rules.order == "newest_first":
        # the log covers positions from o - U (one_short: from o - U + 1)
        if rules.log == "spec":
            q = earliest(d, x, s, W, K)
            wrote = z3.And(q >= x, q < o, q >= o - U)
        else:
            q = earliest(d, z3.If(x >= o - U + 1, x, o - U + 1), s, W, K)
            wrote = q < o
    else:  # the last record applied is the newest one that wrote s
        q = content(d, o, s, W, K)
        wrote = q >= x
    with d.under(z3.And(wrote, q > s)):
        saved = content(d, q, s, W, K)
    return z3.If(wrote, saved, content(d, o, s, W, K))


def undo_parts(rules: UndoRules = UNDO_SPEC) -> list[tuple[str, PartBuilder]]:
    def latest_in_slot(d: Domain) -> tuple[list[Any], Any]:
        W, K, x, s, q = (d.var(v) for v in ("W", "K", "x", "s", "q"))
        c = content(d, x, s, W, K)
        pre = [_shape(W, K), s >= K, s < W, x > s, x + W <= HEADROOM, q > c, q < x]
        return pre, z3.And(c >= s, c < x, ring_slot(d, c, W, K) == s, ring_slot(d, q, W, K) != s)

    def first_in_slot(d: Domain) -> tuple[list[Any], Any]:
        W, K, y, s, q = (d.var(v) for v in ("W", "K", "y", "s", "q"))
        e = earliest(d, y, s, W, K)
        pre = [_shape(W, K), s >= K, s < W, y >= 0, y + W <= HEADROOM, q >= y, q < e]
        return pre, z3.And(e >= y, ring_slot(d, e, W, K) == s, ring_slot(d, q, W, K) != s)

    def exact(d: Domain) -> tuple[list[Any], Any]:
        W, K, U, o, n, s = (d.var(v) for v in ("W", "K", "U", "offset", "n", "s"))
        x = o - n
        pre = [_shape(W, K), U >= 1, n >= 1, n <= U, n <= o, o + W <= HEADROOM, s >= K, s < W, s < x]
        return pre, rolled_back(d, o, n, s, W, K, U, rules) == content(d, x, s, W, K)

    def sinks(d: Domain) -> tuple[list[Any], Any]:
        # No decode in [o - n, o) writes a sink slot still valid afterwards.
        W, K, o, n, s, q = (d.var(v) for v in ("W", "K", "offset", "n", "s", "q"))
        pre = [_shape(W, K), n >= 1, n <= o, s >= 0, s < K, s < o - n, q >= o - n, q < o]
        return pre, ring_slot(d, q, W, K) != s

    def floor_bounds(d: Domain) -> tuple[list[Any], Any]:
        a, L = d.var("a"), d.var("L")
        k = d.floordiv(a, L, "a // L")
        return [L > 0], z3.And(k * L <= a, a < k * L + L)

    return [("floor division bounds: (a // L) * L <= a < (a // L) * L + L", floor_bounds),
            ("content(x, s) is the latest position below x in slot s", latest_in_slot),
            ("earliest(y, s) is the first position from y in slot s", first_in_slot),
            ("rollback(n <= min(U, offset)) restores every valid non-sink slot", exact),
            ("rollback never needs a sink row", sinks)]


def memory_parts(rules: UndoRules = UNDO_SPEC) -> list[tuple[str, PartBuilder]]:
    def block_drops_one(d: Domain) -> tuple[list[Any], Any]:
        # prefill_kept keeps min(n_old, W - 1) of the n_old <= capacity <= W valid rows
        W, n_old = d.var("W"), d.var("n_old")
        kept = d.min(n_old, d.sub(W, 1, "W - 1"))
        return [W >= 1, n_old >= 0, n_old <= W], d.sub(n_old, kept, "n_old - kept") <= 1

    def at_most_u(d: Domain) -> tuple[list[Any], Any]:
        # After log_push's loop: the records newer than the oldest cover
        # `rest` rows, each at least one, and the loop exited (rest < U).
        U, m, rest, saved = d.var("U"), d.var("records"), d.var("rest"), d.var("saved")
        exited = rest < U if rules.prune == "spec" else rest <= U
        pre = [U >= 1, m >= 1, rest >= m - 1, exited, saved >= 0, saved <= m]
        return pre, z3.And(m <= U, saved <= U)

    return [("a whole record saves at most one row", block_drops_one),
            ("the log holds at most U records, so at most U rows", at_most_u)]


# -- negative controls confirmed on the spec ---------------------------------


def _model_ints(m: Any, names: list[str]) -> dict[str, int]:
    return {decl.name(): m[decl].as_long() for decl in m.decls() if decl.name() in names}


def _find(build: PartBuilder, extra: list[Any]) -> Any:
    d = Domain(INT)
    premises, goal = build(d)
    s = solver(20_000)
    s.add(*premises, z3.Not(goal), *extra)
    return s.model() if s.check() == z3.sat else None


def _confirm(rules: UndoRules, patches: dict[str, Any], name: str) -> Any:
    def run() -> tuple[Any, Any, str]:
        from kvspec.spec import rotating as sr

        part = dict(undo_parts(rules))["rollback(n <= min(U, offset)) restores every valid non-sink slot"]
        small = [z3.Int(v) <= 9 for v in ("W", "U", "offset")] + [z3.Int("W") >= 1]
        m = _find(part, small)
        if m is None:
            return None, None, "no counterexample"
        v = _model_ints(m, ["W", "K", "U", "offset", "n", "s"])
        W, K, U, o, n = v["W"], v.get("K", 0), v["U"], v["offset"], v["n"]
        cache = {"mode": "fp16", "step": 1, "max_size": W, "keep": K, "undo": U}
        ops = [{"op": "append", "n": 1} for _ in range(o)] + [{"op": "trim", "n": n}, {"op": "fetch"}]
        good = traces.replay("rotating", cache, ops)[-1].result
        with traces.patched(sr, **patches):
            bug = traces.replay("rotating", cache, ops)[-1].result
        if bug == good:
            return None, v, "the spec with the buggy rule gives the same window"
        doc = traces.kvtrace(f"negative control {name}: after {o} decodes, trim({n}) restores a wrong row",
                             cache, traces.annotate("rotating", cache, ops, [None]), kind="rotating")
        return doc, {**v, "buggy_window": list(bug), "spec_window": list(good)}, (
            f"confirmed on spec with the bug: W={W} K={K} U={U}, {o} decodes, trim({n}) leaves {list(bug)}, "
            f"the spec {list(good)}")

    return run


def _log_push_one_short(log: Any, record: Any, undo: int) -> Any:
    """``log_push`` whose rows stop one short: the record of the oldest of
    the latest U rows has lost its saved row (U - 1 rows kept)."""
    from dataclasses import replace as _replace

    out = _spec_log_push(log, record, undo)
    if out and sum(r.rows for r in out) >= undo:
        out = (_replace(out[0], saved=()),) + out[1:]
    return out


def _rollback_oldest_first(cache: Any, n: int) -> Any:
    """Undo the decode records of the latest n rows oldest first."""
    from dataclasses import replace as _replace

    from kvspec.spec import rotating as sr

    records = cache.log[len(cache.log) - n:] if n <= len(cache.log) else cache.log
    slots = list(cache.slots)
    for r in records:
        if r.saved:
            slots[r.slot] = r.saved[0]
    first = records[0]
    out = sr._new_buffer(cache, tuple(slots))
    return _replace(out, offset=first.offset, idx=first.idx, marker=None, log=cache.log[: len(cache.log) - len(records)])


def prove_undo() -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(undo_parts() + memory_parts())
    controls = [
        control_from_parts("undo_log_one_short", "the log keeps the records of U - 1 rows",
                           undo_parts(UndoRules(log="one_short")),
                           reachable=_confirm(UndoRules(log="one_short"), {"log_push": _log_push_one_short},
                                              "undo_log_one_short")),
        control_from_parts("rollback_oldest_first", "rollback applies the oldest record first",
                           undo_parts(UndoRules(order="oldest_first")),
                           reachable=_confirm(UndoRules(order="oldest_first"), {"rollback": _rollback_oldest_first},
                                              "rollback_oldest_first")),
        control_from_parts("log_keeps_one_more", "log_push prunes only while the newer records cover more than U",
                           memory_parts(UndoRules(prune="keeps_one_more"))),
    ]
    return ObligationResult(
        8, "ring rollback (undo log)", ("log_push", "rollback", "trimmable_rows"),
        "rollback of n <= min(U, offset) rows of a decode history restores every valid slot; "
        "the log holds at most U rows",
        overall(parts, controls), parts, controls, time.perf_counter() - t0)


OBLIGATIONS = [(8, prove_undo)]
