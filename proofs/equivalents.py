"""Z3 checks that surviving mutants are equivalent to the code they mutate.

``make mutation`` leaves some mutants alive because no input can tell them
apart from the original. docs/mutation.md argues each one; where the
argument is integer arithmetic over the counters it is checked here, over
unbounded integers, instead of being taken on trust:

* each :class:`Equivalence` states the original expression, the mutant's,
  and the invariants that make them agree (the ring and cache invariants of
  spec/rotating.py and spec/dense.py), and Z3 must find no assignment where
  the two differ (``proved``);
* each also carries a *control*: a nearby change that is **not** equivalent
  (or the same mutant without the invariant the argument leans on), which Z3
  must refute with a counterexample. A check whose control also "proves"
  would be vacuous (contradictory premises, or an encoding that cannot see a
  difference), so it fails.

Kept sequences (``range`` concatenations, slices) are compared by
membership of an arbitrary index ``i``: both sides are increasing sequences
of distinct integers, so equal membership means equal sequences.

``python -m kvspec.proofs.equivalents`` prints the table; ``tests/test_equivalents.py``
requires every check proved with its control refuted.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import z3

from kvspec.proofs.domain import solver

Ints = dict[str, Any]


def _vars(*names: str) -> Ints:
    return {n: z3.Int(n) for n in names}


@dataclass(frozen=True)
class Equivalence:
    """One equivalence claim and its control.

    ``build(v, control)`` returns ``(premises, original, mutant)``: Z3
    formulas over the integer variables ``v`` (a ``dict``); with
    ``control=True`` it returns the non-equivalent variant instead."""

    name: str
    mutants: str  # the mutmut names (function and change) it covers
    claim: str
    control: str
    variables: tuple[str, ...]
    build: Callable[[Ints, bool], tuple[list[Any], Any, Any]]

    def differs(self, control: bool) -> tuple[bool, dict[str, int] | None]:
        """(differs, counterexample): can original and mutant disagree?"""
        v = _vars(*self.variables)
        premises, original, mutant = self.build(v, control)
        s = solver(10_000)
        s.add(*premises)
        s.add(original != mutant)
        r = s.check()
        if r == z3.unknown:
            raise RuntimeError(f"{self.name}: Z3 returned unknown ({s.reason_unknown()})")
        if r == z3.unsat:
            return False, None
        m = s.model()
        return True, {k: m.eval(x, model_completion=True).as_long() for k, x in v.items()}


def _wrap(idx: Any, W: Any, K: Any) -> Any:
    """Step 3 of a decode (kvspec.spec.rotating.decode): a cursor at or past W wraps to K."""
    return z3.If(idx >= W, K, idx)


def _visible(v: Ints, control: bool) -> tuple[list[Any], Any, Any]:
    # kvspec.spec.rotating.visible_positions: `offset <= W` -> `offset < W`
    off, W, K, p = v["offset"], v["W"], v["K"], v["p"]

    def member(unwrapped: Any) -> Any:
        return z3.If(unwrapped, z3.And(0 <= p, p < off),
                     z3.Or(z3.And(0 <= p, p < K), z3.And(off - (W - K) <= p, p < off)))

    bound = W + 2 if control else W  # control: `offset <= W + 1`
    return [0 <= K, K < W, off >= 0], member(off <= W), member(off < bound)


def _inplace_bound(v: Ints, control: bool) -> tuple[list[Any], Any, Any]:
    # impl RotatingKVCache._inplace_write_allowed: `offset < W` -> `offset <= W`.
    # The impl evaluates it only in _decode, after the wrap (control: before
    # it). The spec's rotating_inplace_allowed is public and NOT equivalent
    # under this mutation (a test kills it there).
    off, W, K, idx = v["offset"], v["W"], v["K"], v["idx"]
    cur = idx if control else _wrap(idx, W, K)
    return ([0 <= K, K < W, 0 <= idx, idx <= W, idx <= off],
            z3.And(off < W, cur == off), z3.And(off <= W, cur == off))


def _grow_at_window(v: Ints, control: bool) -> tuple[list[Any], Any, Any]:
    # kvspec.spec.rotating.decode step 2: `capacity < W` -> `capacity <= W`. At
    # capacity == W the extra "growth" adds min(step, 0) = 0 slots and only
    # renames the buffer, which can matter only if the write would be in
    # place; it never is there (the cursor is at W, so the offset is >= W).
    # Control: without the invariant idx <= offset.
    off, W, K, idx, cap = v["offset"], v["W"], v["K"], v["idx"], v["cap"]
    prem = [0 <= K, K < W, cap == W, idx >= cap, idx <= cap]
    if not control:
        prem.append(idx <= off)
    inplace = z3.And(off < W, _wrap(idx, W, K) == off)
    return prem, inplace, z3.BoolVal(False)


def _cut_cursor(v: Ints, control: bool) -> tuple[list[Any], Any, Any]:
    # kvspec.spec.rotating.decode step 1: cutting an oversized buffer sets idx = W;
    # the mutant keeps the old cursor (the old capacity, > W); both wrap to K
    # in step 3. Control: the cut setting idx = W - 1 instead.
    W, K, cap = v["W"], v["K"], v["cap"]
    original = _wrap(W - 1 if control else W, W, K)
    mutant = _wrap(cap, W, K)
    return [0 <= K, K < W, cap > W], original, mutant


def _prefill_kept(i: Any, L: Any, B: Any, s: Any, cut_when: Any, sinks_branch: Any, off_by_one: bool = False) -> Any:
    """Is old row ``i`` kept by kvspec.spec.rotating.prefill's cut?"""
    start = L - (B - s) + (1 if off_by_one else 0)
    cut = z3.If(sinks_branch, z3.Or(i < s, i >= start), i < B)
    return z3.If(cut_when, cut, z3.BoolVal(True))


def _prefill_guard(v: Ints, control: bool) -> tuple[list[Any], Any, Any]:
    # kvspec.spec.rotating.prefill `len(old) > budget` -> `>=` (impl _prefill:
    # `kept > budget` -> `>=`): at len(old) == budget the cut keeps every row.
    # Control: at the boundary len(old) == budget itself, a cut one row
    # short is seen (so the encoding can tell the two sides apart there).
    L, K, W, i = v["L"], v["K"], v["W"], v["i"]
    B, s = W - 1, z3.If(K < L, K, L)
    prem = [0 <= K, K < W, L >= 0, 0 <= i, i < L]
    if control:
        prem.append(L == B)
    original = _prefill_kept(i, L, B, s, L > B, B > s)
    mutant = _prefill_kept(i, L, B, s, L >= B, B > s, off_by_one=control)
    return prem, original, mutant


def _prefill_sinks(v: Ints, control: bool) -> tuple[list[Any], Any, Any]:
    # kvspec.spec.rotating.prefill `budget > sinks` -> `>=` or `True`: sinks =
    # min(K, len) <= K <= W - 1 = budget, so the other branch runs only at
    # budget == sinks, where both keep rows [0, budget).
    # Control: without K < W (a ring whose sinks fill it).
    L, K, W, i = v["L"], v["K"], v["W"], v["i"]
    B, s = W - 1, z3.If(K < L, K, L)
    prem = [0 <= K, L >= 0, 0 <= i, i < L, W >= 1]
    if not control:
        prem.append(K < W)
    return prem, _prefill_kept(i, L, B, s, L > B, B > s), _prefill_kept(i, L, B, s, L > B, z3.BoolVal(True))


def _is_empty(v: Ints, control: bool) -> tuple[list[Any], Any, Any]:
    # kvspec.spec.dense.is_empty: `offset == 0 and live_start == 0 and buffer is None`
    # -> `offset == 0 or (live_start == 0 and buffer is None)`, under the
    # invariants 0 <= live_start <= offset and "a buffer exists iff live_len
    # > 0" (buffers are dropped when live_len reaches 0).
    # Control: without the buffer invariant.
    off, ls, buf = v["offset"], v["live_start"], v["has_buffer"]
    has = buf == 1
    prem = [0 <= ls, ls <= off, z3.Or(buf == 0, buf == 1)]
    if not control:
        prem.append(has == (off - ls > 0))
    return (prem, z3.And(off == 0, ls == 0, z3.Not(has)),
            z3.Or(off == 0, z3.And(ls == 0, z3.Not(has))))


EQUIVALENCES: tuple[Equivalence, ...] = (
    Equivalence("visible_at_window", "kvspec.spec.rotating.visible_positions: `offset <= max_size` -> `<`",
                "at offset == W both branches give range(W)", "`offset <= W + 1`", ("offset", "W", "K", "p"), _visible),
    Equivalence("inplace_offset_bound", "impl RotatingKVCache._inplace_write_allowed (called only from "
                "_decode, after the wrap): `offset < max_size` -> `<=`",
                "after the wrap the cursor is < W, so idx == offset implies offset < W",
                "the rule evaluated before the wrap", ("offset", "W", "K", "idx"), _inplace_bound),
    Equivalence("grow_at_window", "kvspec.spec.rotating.decode: `capacity < W` -> `<=` (growth by 0)",
                "at capacity == W the write is never in place, so renaming the buffer is unobservable",
                "without idx <= offset", ("offset", "W", "K", "idx", "cap"), _grow_at_window),
    Equivalence("cut_cursor", "kvspec.spec.rotating.decode: the cut dropping `idx=W`",
                "the old cursor (> W) and W both wrap to K", "the cut setting idx = W - 1",
                ("W", "K", "cap"), _cut_cursor),
    Equivalence("prefill_guard", "kvspec.spec.rotating.prefill `len(old) > budget` -> `>=`; impl "
                "RotatingKVCache._prefill `kept > budget` -> `>=`",
                "at len(old) == budget the cut keeps every row", "at len(old) == budget, a cut one row short",
                ("L", "K", "W", "i"), _prefill_guard),
    Equivalence("prefill_sinks", "kvspec.spec.rotating.prefill `budget > sinks` -> `>=` / `or True`",
                "sinks <= K < W = budget + 1; at equality both keep [0, budget)", "without K < W",
                ("L", "K", "W", "i"), _prefill_sinks),
    Equivalence("is_empty", "kvspec.spec.dense.is_empty: `and` -> `or`",
                "offset == 0 forces live_start == 0 and no buffer", "without 'buffer iff live_len > 0'",
                ("offset", "live_start", "has_buffer"), _is_empty),
)


@dataclass(frozen=True)
class EquivalenceResult:
    name: str
    mutants: str
    proved: bool
    control_refuted: bool
    counterexample: dict[str, int] | None  # the control's (or the claim's, if it failed)

    @property
    def ok(self) -> bool:
        return self.proved and self.control_refuted


def check(e: Equivalence) -> EquivalenceResult:
    differs, cex = e.differs(control=False)
    control_differs, control_cex = e.differs(control=True)
    return EquivalenceResult(e.name, e.mutants, not differs, control_differs, cex if differs else control_cex)


def check_all() -> list[EquivalenceResult]:
    return [check(e) for e in EQUIVALENCES]


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    results = check_all()
    table = Table(title="Equivalent mutants (Z3, unbounded integers)")
    for col in ("check", "mutants", "equivalent", "control refuted", "control counterexample"):
        table.add_column(col, overflow="fold")
    for r in results:
        table.add_row(r.name, r.mutants, "proved" if r.proved else "[red]NOT PROVED[/]",
                      "yes" if r.control_refuted else "[red]no (vacuous)[/]", str(r.counterexample))
    Console(width=160).print(table)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
