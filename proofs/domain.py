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
    """The outcome of one validity check ``premises => goal``."""

    status: str  # "proved", "refuted" or "unknown"
    model: Any = None
    reason: str = ""
    seconds: float = 0.0


# Nonlinear integer problems (the ring's modular index rules) are sensitive
# to Z3's random seed: a check that takes 0.1 s with one seed can time out
# with another. So a check is a short portfolio of seeds.
SEEDS = ((0, 2_000), (2, 2_000), (3, 4_000), (4, 8_000), (5, None))

#: Z3 resource units (``rlimit``) per millisecond of budget: the rate at
#: which Z3 counted them over a whole ``kvspec prove`` run on this project's
#: 2-core machine was about 1,300 per CPU millisecond (2026-12-01; 250 to
#: 5,600 from one check to the next). Every budget below is a number of
#: milliseconds turned into units: Z3 counts units deterministically, so a
#: check does the same work, and reaches the same verdict, however loaded
#: the machine is (with wall-clock budgets a check got a quarter of its CPU
#: at load average 10 on two cores, and obligations 2 and 8 came out
#: "unknown").
RLIMIT_PER_MS = 1_500
#: a wall-clock guard of this many times the budget stops a check that the
#: machine starves even of its units' worth (reported as Z3's "timeout")
WALL_GUARD = 20


def budget(solver: z3.Solver, ms: int) -> None:
    """Give ``solver``'s next checks about ``ms`` milliseconds of CPU each,
    as :data:`RLIMIT_PER_MS` deterministic resource units, under a
    wall-clock guard of :data:`WALL_GUARD` times ``ms``. Z3 answers
    ``unknown`` with reason "max. resource limit exceeded" when the units
    run out."""
    ms = max(1, int(ms))
    solver.set("rlimit", ms * RLIMIT_PER_MS)
    solver.set("timeout", ms * WALL_GUARD)


def check_valid(
    dom: Domain, premises: list[Any], goal: Any, timeout_ms: int = 30_000, label: str = ""
) -> Check:
    """Is ``premises => goal`` valid in ``dom`` (with its recorded overflow
    obligations added to the goal and its stored-value assumptions and facts
    to the premises)? ``refuted`` carries the model of a counterexample and,
    when an overflow obligation is what fails, names it. Tries the seeds of
    :data:`SEEDS` in turn, each with its budget of :func:`budget` units
    (the last one what is left), ``timeout_ms`` worth in all."""
    import time

    t0 = time.perf_counter()
    s = z3.Solver()
    s.add(*premises)
    s.add(*[a for _, a in dom.assumptions])
    s.add(*dom.facts)
    obligations = [o for _, o in dom.obligations]
    s.add(z3.Not(z3.And(goal, *obligations)))
    r, reason = z3.unknown, ""
    left = timeout_ms
    for seed, ms in SEEDS:
        if left <= 0:
            break
        give = left if ms is None else min(ms, left)
        left -= give
        s.set("random_seed", seed)
        budget(s, give)
        r = s.check()
        if r != z3.unknown:
            break
        reason = str(s.reason_unknown())
    dt = time.perf_counter() - t0
    if r == z3.unsat:
        return Check("proved", seconds=dt)
    if r == z3.sat:
        m = s.model()
        reason = ""
        for name, o in dom.obligations:
            if z3.is_false(m.eval(o, model_completion=True)):
                reason = f"overflow in {name}"
                break
        if not reason and label:
            reason = label
        return Check("refuted", m, reason, dt)
    return Check("unknown", reason=reason, seconds=dt)


def evaluate(expr: Any, subs: dict[Any, Any], dom: Domain | None = None) -> Any:
    """Substitute concrete values and simplify to a Python value (bool/int).
    In bv32 the wrapped results are defined by facts, so the value is read
    from a model of the facts instead."""
    pairs = [(k, v) for k, v in subs.items()]
    out = z3.simplify(z3.substitute(expr, *pairs)) if pairs else z3.simplify(expr)
    if dom is not None and dom.facts and not (z3.is_true(out) or z3.is_false(out) or z3.is_int_value(out)):
        s = z3.Solver()
        s.add(*[z3.substitute(f, *pairs) for f in dom.facts])
        if s.check() != z3.sat:
            raise ValueError("facts unsatisfiable for these values")
        out = s.model().eval(z3.substitute(expr, *pairs), model_completion=True)
    if z3.is_true(out):
        return True
    if z3.is_false(out):
        return False
    if z3.is_int_value(out):
        return out.as_long()
    raise ValueError(f"not a concrete value after substitution: {out}")
