"""Arithmetic domains the obligations are proved in.

Every encoded spec function takes a :class:`Domain` as its first argument and
does its arithmetic through it, so one encoding serves two runs:

* ``int``: unbounded mathematical integers, Python's own semantics;
* ``bv32``: 32-bit two's-complement bit-vectors, the arithmetic of a C, Rust
  or Metal port that keeps offsets in ``int32``.

In the ``bv32`` run every operation records a no-overflow fact, guarded by the
branch it is computed in (:meth:`Domain.under`). Those facts are proof
obligations, with one exception: a value the cache *stores* (a new offset, a
new capacity, the next buffer identity) is computed through
:meth:`Domain.stored`, which assumes that its exact value fits in 32 bits (a
32-bit port must refuse to grow past ``INT32_MAX``; that refusal is not part
of the spec). So the ``bv32`` run proves that no *intermediate* computation
overflows whenever the stored results are representable, and that the rule
still holds in wrapping arithmetic.
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
    """One arithmetic domain plus the overflow facts recorded while encoding."""

    kind: str = INT
    bits: int = 32
    path: list[Any] = field(default_factory=list)
    obligations: list[tuple[str, Any]] = field(default_factory=list)
    assumptions: list[tuple[str, Any]] = field(default_factory=list)

    # -- sorts and values ---------------------------------------------------
    @property
    def is_bv(self) -> bool:
        return self.kind != INT

    def sort(self) -> z3.SortRef:
        return z3.BitVecSort(self.bits) if self.is_bv else z3.IntSort()

    def var(self, name: str) -> Any:
        return z3.BitVec(name, self.bits) if self.is_bv else z3.Int(name)

    def val(self, v: int) -> Any:
        return z3.BitVecVal(v, self.bits) if self.is_bv else z3.IntVal(v)

    def boolean(self, name: str) -> Any:
        return z3.Bool(name)

    def array(self, name: str) -> Any:
        return z3.Array(name, self.sort(), self.sort())

    def lam(self, body: Callable[[Any], Any]) -> Any:
        """An array ``i -> body(i)`` (beta-reduced by Z3 on select)."""
        i = self.var(f"i!{next(_counter)}")
        return z3.Lambda([i], body(i))

    def to_python(self, value: Any) -> int:
        """A concrete model value as a Python int (signed in bv32)."""
        if self.is_bv:
            return value.as_signed_long()
        return value.as_long()

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

    def _record(self, label: str, fact: Any) -> None:
        if self.is_bv:
            self.obligations.append((label, self._guard(fact)))

    # -- arithmetic ----------------------------------------------------------
    def add(self, a: Any, b: Any, label: str = "+") -> Any:
        if self.is_bv:
            a, b = self._bv(a), self._bv(b)
            self._record(label, z3.And(z3.BVAddNoOverflow(a, b, True), z3.BVAddNoUnderflow(a, b)))
        return a + b

    def sub(self, a: Any, b: Any, label: str = "-") -> Any:
        if self.is_bv:
            a, b = self._bv(a), self._bv(b)
            self._record(label, z3.And(z3.BVSubNoOverflow(a, b), z3.BVSubNoUnderflow(a, b, True)))
        return a - b

    def mul(self, a: Any, b: Any, label: str = "*") -> Any:
        if self.is_bv:
            # Nonlinear operations go through exact integers (bit-blasting a
            # 32-bit multiplier or divider is intractable); Int2BV wraps
            # exactly as two's-complement hardware does.
            exact = self.exact(a) * self.exact(b)
            self._record(label, self.fits(exact))
            return z3.Int2BV(exact, self.bits)
        return a * b

    def neg(self, a: Any, label: str = "neg") -> Any:
        if self.is_bv:
            a = self._bv(a)
            self._record(label, z3.BVSNegNoOverflow(a))
        return -a

    def floordiv(self, a: Any, b: Any, label: str = "//") -> Any:
        """Python's ``a // b`` (rounds toward minus infinity). In bv32 the
        result wraps like a 32-bit port's ``floor_div`` (only INT_MIN // -1
        overflows); division by zero is an overflow obligation."""
        if not self.is_bv:
            # SMT-LIB integer div is Euclidean: floor for b > 0.
            return z3.If(b > 0, a / b, (-a) / (-b))
        ea, eb = self.exact(a), self.exact(b)
        exact = z3.If(eb > 0, ea / eb, (-ea) / (-eb))
        self._record(label, z3.And(eb != 0, self.fits(exact)))
        return z3.Int2BV(exact, self.bits)

    def exact(self, x: Any) -> Any:
        """The signed integer a bit-vector stands for."""
        return z3.IntVal(x) if isinstance(x, int) else z3.BV2Int(x, is_signed=True)

    def fits(self, exact: Any) -> Any:
        """An exact integer is representable in ``bits`` signed bits."""
        return z3.And(exact >= -(2 ** (self.bits - 1)), exact < 2 ** (self.bits - 1))

    def ceildiv(self, n: Any, d: Any) -> Any:
        """``-(-n // d)``, exactly as the spec writes ceil(n / d)."""
        return self.neg(self.floordiv(self.neg(n, "-n"), d, "-n // step"), "-(-n // step)")

    def stored(self, label: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(self, *args)``, a value the cache stores. In bv32 assume that
        its exact value (``fn`` recomputed over unbounded integers from the
        arguments' signed values) fits in 32 bits; the operations inside
        ``fn`` remain proof obligations."""
        result = fn(self, *args)
        if self.is_bv:
            exact = fn(Domain(INT), *[self.exact(a) if _is_bv(a) or isinstance(a, int) else a for a in args])
            self.assumptions.append((label, self._guard(self.fits(exact))))
        return result

    def _bv(self, x: Any) -> Any:
        return self.val(x) if isinstance(x, int) else x

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


def _is_bv(x: Any) -> bool:
    return z3.is_bv(x)


# ---------------------------------------------------------------------------
# Checking


@dataclass
class Check:
    """The outcome of one validity check ``premises => goal``."""

    status: str  # "proved", "refuted" or "unknown"
    model: Any = None
    reason: str = ""
    seconds: float = 0.0


def check_valid(
    dom: Domain, premises: list[Any], goal: Any, timeout_ms: int = 30_000, label: str = ""
) -> Check:
    """Is ``premises => goal`` valid in ``dom`` (with its recorded overflow
    obligations added to the goal and its stored-value assumptions to the
    premises)? ``refuted`` carries the model of a counterexample and, when an
    overflow obligation is what fails, names it."""
    import time

    t0 = time.perf_counter()
    s = z3.Solver()
    s.set(timeout=timeout_ms)
    s.add(*premises)
    s.add(*[a for _, a in dom.assumptions])
    obligations = [o for _, o in dom.obligations]
    s.add(z3.Not(z3.And(goal, *obligations)))
    r = s.check()
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
    return Check("unknown", reason=str(s.reason_unknown()), seconds=dt)


def evaluate(expr: Any, subs: dict[Any, Any]) -> Any:
    """Substitute concrete values and simplify to a Python value (bool/int)."""
    pairs = [(k, v) for k, v in subs.items()]
    out = z3.simplify(z3.substitute(expr, *pairs)) if pairs else z3.simplify(expr)
    if z3.is_true(out):
        return True
    if z3.is_false(out):
        return False
    if z3.is_int_value(out):
        return out.as_long()
    if z3.is_bv_value(out):
        return out.as_signed_long()
    raise ValueError(f"not a concrete value after substitution: {out}")
