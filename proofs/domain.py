"""Arithmetic domains the obligations are proved in.

Every encoded spec function takes a :class:`Domain` as its first argument and
does its arithmetic through it, so one encoding serves two runs:

* ``int``: unbounded mathematical integers, Python's own semantics;
* ``bv32``: 32-bit two's-complement machine integers, the arithmetic of a C,
  Rust or Metal port that keeps offsets in ``int32``: every variable lies in
  ``[-2**31, 2**31)`` and every operation wraps around modulo ``2**32``.

How ``bv32`` is encoded: Z3's native bit-vector theory bit-blasts the regrow
rule's symbolic ``ceil(n / step) * step`` into a 32-bit divider and
multiplier, and that did not finish in 120 s (nor did ``append`` with the
divider summarised away). So the run states the same 32-bit semantics
exactly over integers: the result of an operation whose exact value is ``x``
is a fresh ``y == x - 2**32 * k`` with ``y`` in range (the wrapped value,
bit for bit what a 32-bit ALU returns, as ``Int2BV``/``BV2Int`` would give),
and Z3 decides it with integer reasoning in milliseconds.

In the ``bv32`` run every operation records a no-overflow fact (its exact
value is in range), guarded by the branch it is computed in
(:meth:`Domain.under`). Those facts are proof obligations, with one
exception: a value the cache *stores* (a new offset, a new capacity, the next
buffer identity) is computed through :meth:`Domain.stored`, which assumes that
its exact value fits (a 32-bit port must refuse to grow past ``INT32_MAX``;
that refusal is not part of the spec). So the ``bv32`` run proves that no
*intermediate* computation overflows whenever the stored results are
representable, and that the rule holds in wrapping arithmetic.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import z3

INT = "int"
BV32 = "bv32"
DOMAINS = (INT, BV32)

_counter = itertools.count()


def reset_names() -> None:
    """Number fresh variables from 0 again: each obligation builds its
    formulas with the same names whether it runs alone or after others
    (Z3's search can follow the names)."""
    global _counter
    _counter = itertools.count()


@dataclass
class Domain:
    """One arithmetic domain plus what was recorded while encoding:
    ``obligations`` (no-overflow facts to prove), ``assumptions`` (stored
    values fit) and ``facts`` (definitions of wrapped results and the range
    of every 32-bit variable; always satisfiable)."""

    kind: str = INT
    bits: int = 32
    path: list[Any] = field(default_factory=list)
    obligations: list[tuple[str, Any]] = field(default_factory=list)
    assumptions: list[tuple[str, Any]] = field(default_factory=list)
    facts: list[Any] = field(default_factory=list)
    contracts: bool = False  # use proved contracts of nonlinear spec formulas

    # -- sorts and values ---------------------------------------------------
    @property
    def is_bv(self) -> bool:
        return self.kind != INT

    def sort(self) -> z3.SortRef:
        return z3.IntSort()

    def var(self, name: str) -> Any:
        v = z3.Int(name)
        if self.is_bv:
            self.facts.append(self.fits(v))
        return v

    def fresh(self, name: str) -> Any:
        """A fresh variable (a numbered ``name``)."""
        return self.var(f"{name}!{next(_counter)}")

    def val(self, v: int) -> Any:
        return z3.IntVal(v)

    def boolean(self, name: str) -> Any:
        return z3.Bool(name)

    def array(self, name: str) -> Any:
        return z3.Array(name, z3.IntSort(), z3.IntSort())

    def lam(self, body: Callable[[Any], Any]) -> Any:
        """An array ``i -> body(i)`` (beta-reduced by Z3 on select). Index
        arithmetic inside ``body`` is exact: it addresses the window, it is
        not a stored counter."""
        i = z3.Int(f"i!{next(_counter)}")
        return z3.Lambda([i], body(i))

    def assume(self, label: str, fact: Any) -> None:
        """Assume ``fact`` on the current branch (a contract proved elsewhere)."""
        self.assumptions.append((label, self._guard(fact)))

    def fits(self, exact: Any) -> Any:
        """An exact integer is representable in ``bits`` signed bits."""
        return z3.And(exact >= -(2 ** (self.bits - 1)), exact < 2 ** (self.bits - 1))

    # -- overflow bookkeeping -----------------------------------------------
    @contextlib.contextmanager
    def under(self, cond: Any) -> Iterator[None]:
        """Record the overflow facts of the enclosed computations only for
        the branch where ``cond`` holds."""
        self.path.append(cond)
        try:
            yield
        finally:
            self.path.pop()

    def _guard(self, fact: Any) -> Any:
        return z3.Implies(z3.And(*self.path), fact) if self.path else fact

    def _op(self, exact: Any, label: str, extra: Any = None) -> Any:
        """The result of an operation with exact value ``exact``: itself in
        ``int``; in bv32 the wrapped value, with the no-overflow obligation."""
        if not self.is_bv:
            return exact
        ok = self.fits(exact) if extra is None else z3.And(extra, self.fits(exact))
        self.obligations.append((label, self._guard(ok)))
        n = next(_counter)
        y, k = z3.Int(f"{label}!{n}"), z3.Int(f"wrap!{n}")
        self.facts += [y == exact - (2 ** self.bits) * k, self.fits(y)]
        return y

    # -- arithmetic ----------------------------------------------------------
    def add(self, a: Any, b: Any, label: str = "+") -> Any:
        return self._op(a + b, label)

    def sub(self, a: Any, b: Any, label: str = "-") -> Any:
        return self._op(a - b, label)

    def mul(self, a: Any, b: Any, label: str = "*") -> Any:
        return self._op(a * b, label)

    def neg(self, a: Any, label: str = "neg") -> Any:
        return self._op(-a, label)

    def floordiv(self, a: Any, b: Any, label: str = "//") -> Any:
        """Python's ``a // b`` (rounds toward minus infinity); division by
        zero is an overflow obligation, and so is ``INT_MIN // -1``."""
        # SMT-LIB integer div is Euclidean: floor for b > 0.
        exact = z3.If(b > 0, a / b, (-a) / (-b))
        return self._op(exact, label, b != 0 if self.is_bv else None)

    def ceildiv(self, n: Any, d: Any) -> Any:
        """``-(-n // d)``, exactly as the spec writes ceil(n / d)."""
        return self.neg(self.floordiv(self.neg(n, "-n"), d, "-n // step"), "-(-n // step)")

    def stored(self, label: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(self, *args)``, a value the cache stores. In bv32 assume that
        its exact value (``fn`` recomputed over unbounded integers from the
        same arguments) fits in 32 bits; the operations inside ``fn`` remain
        proof obligations."""
        result = fn(self, *args)
        if self.is_bv:
            exact = fn(Domain(INT), *args)
            self.assumptions.append((label, self._guard(self.fits(exact))))
        return result

    # -- comparisons without arithmetic --------------------------------------
    @staticmethod
    def ite(c: Any, a: Any, b: Any) -> Any:
        return z3.If(c, a, b)

    def min(self, a: Any, b: Any) -> Any:
        return z3.If(a <= b, a, b)

    def max(self, a: Any, b: Any) -> Any:
        return z3.If(a >= b, a, b)

    def clamp(self, x: Any, lo: Any, hi: Any) -> Any:
        """``max(lo, min(x, hi))``, the spec's clamp."""
        return self.max(lo, self.min(x, hi))


# ---------------------------------------------------------------------------
# Checking


@dataclass
class Check:
    """The outcome of one validity check ``premises => goal``: its verdict,
    a counterexample model (``refuted``), the reason (``unknown``: Z3's
    ``reason_unknown`` and the units), wall seconds (information only), the
    Z3 resource units it used and was given, and the seed that decided it
    (None: none did)."""

    status: str  # "proved", "refuted" or "unknown"
    model: Any = None
    reason: str = ""
    seconds: float = 0.0
    #: Z3 resource units the check used and was given (over its seeds)
    units: int = 0
    units_given: int = 0
    seed: int | None = None


# Nonlinear integer problems (the ring's modular index rules) are sensitive
# to Z3's random seed: a check that takes 0.1 s with one seed can run out of
# its budget with another. So a check is a short portfolio of seeds, each
# with a fixed share of the check's budget (milliseconds' worth of units,
# never measured time); the last one gets what is left. Every part of every
# obligation is decided by the first seed, using at most a sixth of its
# share (docs/proofs.md, "Budgets").
SEEDS = ((0, 10_000), (1, 10_000), (2, None))

#: Z3 resource units (``rlimit``) per millisecond of budget: the rate at
#: which Z3 counted them over a whole ``kvspec prove`` run on this project's
#: 2-core machine was about 1,300 per CPU millisecond (2026-12-01; 250 to
#: 5,600 from one check to the next). A budget is a number of milliseconds
#: turned into units: Z3 counts units deterministically, so a check does the
#: same work, and reaches the same verdict, however loaded the machine is.
RLIMIT_PER_MS = 1_500

#: what every check runs: Z3's SMT core behind the preprocessing steps of
#: its own QF_NIA strategy, with no wall-clock step in it. Z3's default
#: solver picks a strategy by logic, and the QF_NIA one (every obligation
#: with a division by a variable) gives its SMT attempt 2 s and its nlsat
#: attempt 3 s *of wall-clock time* (``try_for`` in Z3's
#: ``qfnia_tactic.cpp``) before it moves on: on a loaded machine the attempt
#: that proves a part in 1.5 s of CPU was cut off, and obligation 8 came out
#: "unknown". This chain has no timer: only the rlimit bounds it.
TACTICS = ("simplify", "propagate-values", "solve-eqs", "elim-uncnstr", "smt")


def solver(ms: int | None = None, ctx: z3.Context | None = None) -> z3.Solver:
    """A clock-free solver (:data:`TACTICS`) in ``ctx`` (None: Z3's main
    context), with ``ms`` milliseconds' worth of resource units when given
    (:func:`budget`)."""
    s = z3.Then(*[z3.Tactic(t, ctx=ctx) for t in TACTICS], ctx=ctx).solver()
    if ms is not None:
        budget(s, ms)
    return s


def budget(solver: z3.Solver, ms: int) -> int:
    """Give ``solver``'s next checks ``ms`` milliseconds' worth of
    deterministic resource units each (:data:`RLIMIT_PER_MS` per ms) and
    return that number of units. No wall-clock limit: Z3 answers
    ``unknown`` when the units run out, the same on any machine at any
    load."""
    units = max(1, int(ms)) * RLIMIT_PER_MS
    solver.set("rlimit", units)
    return units


def _units(s: z3.Solver) -> int:
    """Resource units counted so far in ``s``'s context (Z3's "rlimit
    count" statistic)."""
    try:
        return int(s.statistics().get_key_value("rlimit count"))
    except z3.Z3Exception:  # no check has run in this context
        return 0


#: the reason an ``unknown`` gives when its units ran out (Z3 itself says
#: "canceled" or "max. resource limit exceeded", depending on where the
#: search stopped)
RLIMIT_REASON = "resource limit (rlimit) exhausted"


def check_valid(
    dom: Domain, premises: list[Any], goal: Any, timeout_ms: int = 30_000, label: str = ""
) -> Check:
    """Is ``premises => goal`` valid in ``dom`` (with its recorded overflow
    obligations added to the goal and its stored-value assumptions and facts
    to the premises)? ``refuted`` carries the model of a counterexample and,
    when an overflow obligation is what fails, names it. Tries the seeds of
    :data:`SEEDS` in turn, each with its budget of :func:`budget` units
    (the last one what is left), ``timeout_ms`` milliseconds' worth in all
    (``Check.units_given``; ``Check.units`` is what Z3 counted over the
    seeds it tried). The check
    runs in a Z3 context of its own, so what ran before it in the process
    does not change its search. ``unknown`` carries Z3's ``reason_unknown``
    and, when the units ran out, :data:`RLIMIT_REASON`."""
    import time

    t0 = time.perf_counter()
    ctx = z3.Context()
    s = solver(ctx=ctx)
    obligations = [o for _, o in dom.obligations]
    formulas = [*premises, *[a for _, a in dom.assumptions], *dom.facts, z3.Not(z3.And(goal, *obligations))]
    s.add(*[f.translate(ctx) for f in formulas])
    r, reason, decided = z3.unknown, "", None
    left = timeout_ms
    given = max(1, int(timeout_ms)) * RLIMIT_PER_MS
    for seed, ms in SEEDS:
        if left <= 0:
            break
        give = left if ms is None else min(ms, left)
        left -= give
        s.set("random_seed", seed)
        budget(s, give)
        r = s.check()
        if r != z3.unknown:
            decided = seed
            break
        reason = str(s.reason_unknown())
    used = _units(s)
    dt = time.perf_counter() - t0
    if r == z3.unsat:
        return Check("proved", seconds=dt, units=used, units_given=given, seed=decided)
    if r == z3.sat:
        m = s.model().translate(z3.main_ctx())
        reason = ""
        for name, o in dom.obligations:
            if z3.is_false(m.eval(o, model_completion=True)):
                reason = f"overflow in {name}"
                break
        if not reason and label:
            reason = label
        return Check("refuted", m, reason, dt, used, given, decided)
    if used >= given:
        reason = f"{RLIMIT_REASON}: {used:,} of {given:,} units (Z3: {reason})"
    else:
        reason = f"Z3: {reason} after {used:,} of {given:,} units"
    return Check("unknown", reason=reason, seconds=dt, units=used, units_given=given)


def substitute(expr: Any, pairs: list[tuple[Any, Any]]) -> Any:
    """``z3.substitute(expr, *pairs)`` without z3's checks of every pair in
    Python (a sort object made and compared per pair and per call: most of
    an :func:`evaluate` of a world of a hundred variables). Z3 itself still
    refuses a pair of two sorts (Z3Exception "type error")."""
    n = len(pairs)
    src, dst = (z3.Ast * n)(), (z3.Ast * n)()
    for i, (a, b) in enumerate(pairs):
        src[i], dst[i] = a.as_ast(), b.as_ast()
    return z3.z3._to_expr_ref(z3.Z3_substitute(expr.ctx.ref(), expr.as_ast(), n, src, dst), expr.ctx)


def evaluate(expr: Any, subs: dict[Any, Any], dom: Domain | None = None) -> Any:
    """Substitute concrete values and simplify to a Python value (bool/int).
    In bv32 the wrapped results are defined by facts, so the value is read
    from a model of the facts instead."""
    pairs = [(k, v) for k, v in subs.items()]
    out = z3.simplify(substitute(expr, pairs)) if pairs else z3.simplify(expr)
    if dom is not None and dom.facts and not (z3.is_true(out) or z3.is_false(out) or z3.is_int_value(out)):
        s = solver()
        s.add(*[substitute(f, pairs) for f in dom.facts])
        if s.check() != z3.sat:
            raise ValueError("facts unsatisfiable for these values")
        out = s.model().eval(substitute(expr, pairs), model_completion=True)
    if z3.is_true(out):
        return True
    if z3.is_false(out):
        return False
    if z3.is_int_value(out):
        return out.as_long()
    raise ValueError(f"not a concrete value after substitution: {out}")
