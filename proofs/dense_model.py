"""Z3 encodings of the dense cache's spec functions (``kvspec.spec.dense``).

One function here per spec function, under the same name and with the same
arguments, except that a domain comes first and a state is a
:class:`CacheS` of Z3 terms instead of a ``DenseCache``:

* ``regrow_needed``, ``regrow_capacity``, ``inplace_write_allowed``,
  ``trim_is_logical``, ``supports_front_trim``, ``supports_gather``;
* ``append``, ``trim``, ``trim_to``, ``trim_front_keep_sink``,
  ``gather_positions``, ``gather_within_tail``;
* ``holder_of``, ``adopt``, ``is_empty``, ``handle_trim_to`` and
  ``detach`` (``kvspec.spec.dense.w_detach``).

What is abstracted, and why it is faithful:

* buffer identities are integers handed out by ``next_ident`` exactly as in
  the spec; a holder "shares" a buffer iff it holds the same identity;
* ``gather_positions(positions)`` depends on the list only through its length
  (a strictly increasing list inside ``[0, live_len)`` of length ``live_len``
  is the identity), ``gather_within_tail`` only through ``tail`` and
  ``len(kept)``;
* the window (``entries``) is optional: a pair of arrays (token, position)
  plus its length ``wlen``; the ownership proof does not need it.

Buggy variants used by the negative controls are selected by :class:`Rules`;
``Rules()`` is the spec. ``tests/test_proofs_fidelity.py`` evaluates every
function here on concrete states and compares it with ``kvspec.spec.dense``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import z3

from kvspec.proofs.domain import Domain
from kvspec.spec.dense import Mode

MODES: tuple[Mode, ...] = tuple(Mode)


def mode_code(mode: Mode | str) -> int:
    """The integer a mode is encoded as."""
    return MODES.index(Mode(mode))


FP16, INT8, TURBO4DELEGATED = (mode_code(Mode.FP16), mode_code(Mode.INT8), mode_code(Mode.TURBO4DELEGATED))


@dataclass(frozen=True)
class Rules:
    """Which variant of each rule the encoding follows; the defaults are the
    spec. Every other value is a named buggy rule of a negative control."""

    inplace: str = "spec"  # | "no_length_check" | "no_identity_check"
    restore_marker: str = "none"  # | "keep" (restore keeps the old marker) | "record"
    regrow: str = "spec"  # | "old_guard" | "ceil_by_add"
    trim: str = "spec"  # | "forgets_offset" | "keeps_rows"
    front: str = "spec"  # | "decreases_offset" | "keep_unclamped"
    append_at: str = "live_len"  # | "offset" (physical rows only: obligation 3)


SPEC = Rules()


@dataclass(frozen=True)
class CacheS:
    """A ``DenseCache`` as Z3 terms. ``buf``/``cap`` mean something only
    when ``has_buf``; ``mkb``/``mkl`` only when ``mk`` (the marker exists).
    ``tok``/``pos``/``wlen`` are the window (``entries``), or None."""

    mode: Any
    sw: Any  # the in-place switch
    step: Any
    off: Any
    ls: Any
    has_buf: Any
    buf: Any
    cap: Any
    mk: Any
    mkb: Any
    mkl: Any
    nid: Any
    tok: Any = None
    pos: Any = None
    wlen: Any = None


@dataclass(frozen=True)
class HolderS:
    """A ``Holder`` as Z3 terms (its window is not needed by the proofs)."""

    alive: Any
    has_buf: Any
    buf: Any
    cap: Any
    off: Any
    ls: Any


def cache_vars(d: Domain, prefix: str, window: bool = False) -> CacheS:
    v = d.var
    return CacheS(
        mode=z3.Int(f"{prefix}mode"), sw=z3.Bool(f"{prefix}inplace"), step=v(f"{prefix}step"),
        off=v(f"{prefix}offset"), ls=v(f"{prefix}live_start"), has_buf=z3.Bool(f"{prefix}has_buf"),
        buf=v(f"{prefix}buf"), cap=v(f"{prefix}cap"), mk=z3.Bool(f"{prefix}marker"),
        mkb=v(f"{prefix}marker_buf"), mkl=v(f"{prefix}marker_len"), nid=v(f"{prefix}next_ident"),
        tok=d.array(f"{prefix}tok") if window else None,
        pos=d.array(f"{prefix}pos") if window else None,
        wlen=v(f"{prefix}wlen") if window else None,
    )


def holder_vars(d: Domain, prefix: str) -> HolderS:
    v = d.var
    return HolderS(z3.Bool(f"{prefix}alive"), z3.Bool(f"{prefix}has_buf"), v(f"{prefix}buf"),
                   v(f"{prefix}cap"), v(f"{prefix}offset"), v(f"{prefix}live_start"))


def select(cond: Any, a: Any, b: Any) -> Any:
    """Field-wise ``If(cond, a, b)`` of two states of the same class."""
    out = {}
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x is None and y is None:
            out[f.name] = None
        elif x is y:
            out[f.name] = x
        else:
            out[f.name] = z3.If(cond, x, y)
    return type(a)(**out)


# ---------------------------------------------------------------------------
# Mode rules and the two index rules


def trim_is_logical(d: Domain, mode: Any) -> Any:
    return z3.Or(mode == FP16, mode == INT8)


def supports_front_trim(d: Domain, mode: Any) -> Any:
    return z3.Or(mode == FP16, mode == INT8)


def supports_gather(d: Domain, mode: Any) -> Any:
    return mode != TURBO4DELEGATED


def regrow_needed(d: Domain, has_buffer: Any, prev: Any, capacity: Any, n: Any) -> Any:
    """Regrow rule, guard: no buffer or ``prev + n > capacity``."""
    return z3.Or(z3.Not(has_buffer), d.add(prev, n, "prev + n") > capacity)


def _regrow_formula(d: Domain, prev: Any, n: Any, step: Any) -> Any:
    return d.add(prev, d.mul(d.ceildiv(n, step), step, "ceil(n/step) * step"), "prev + ceil(n/step) * step")


def _ceil_by_add_formula(d: Domain, prev: Any, n: Any, step: Any) -> Any:
    # Buggy in 32 bits: n + step - 1 overflows although the result fits.
    up = d.sub(d.add(n, step, "n + step"), 1, "n + step - 1")
    return d.add(prev, d.mul(d.floordiv(up, step, "(n + step - 1) // step"), step, "* step"), "prev + ...")


def regrow_capacity(d: Domain, prev: Any, n: Any, step: Any, rule: str = "spec") -> Any:
    """Regrow rule, result: ``prev + ceil(n / step) * step``. With
    ``d.contracts`` the result is a fresh value constrained by the contract
    obligation 3 proves (``prev + n <= r < prev + n + step``)."""
    if d.contracts and rule == "spec":
        r = d.fresh("regrow_capacity")
        d.assume("regrow_capacity contract", z3.Implies(
            z3.And(prev >= 0, n >= 1, step >= 1), z3.And(prev + n <= r, r < prev + n + step)))
        return r
    if rule == "ceil_by_add":
        return d.stored("capacity after growth", _ceil_by_add_formula, prev, n, step)
    return d.stored("capacity after growth", _regrow_formula, prev, n, step)


def mod(d: Domain, a: Any, b: Any) -> Any:
    """Python's ``a % b``."""
    return d.sub(a, d.mul(d.floordiv(a, b, "prev // step"), b, "(prev // step) * step"), "prev % step")


def grown_capacity(d: Domain, c: CacheS, prev: Any, n: Any, rule: str) -> Any:
    """Capacity after a growth: the spec cuts to ``[0, prev)`` then appends
    ``ceil(n/step)*step`` rows. ``old_guard`` cuts only when
    ``prev % step != 0`` (the pre-#1209 regression)."""
    if rule == "old_guard":
        extra = d.mul(d.ceildiv(n, c.step), c.step, "ceil(n/step) * step")
        keep_tail = z3.And(c.has_buf, mod(d, prev, c.step) == 0)
        base = z3.If(keep_tail, capacity(d, c), prev)
        return d.stored("capacity after growth", lambda d, b, e: d.add(b, e, "base + extra"), base, extra)
    return regrow_capacity(d, prev, n, c.step, "ceil_by_add" if rule == "ceil_by_add" else "spec")


# ---------------------------------------------------------------------------
# The cache


def live_len(d: Domain, c: CacheS) -> Any:
    return d.sub(c.off, c.ls, "offset - live_start")


def capacity(d: Domain, c: CacheS) -> Any:
    return z3.If(c.has_buf, c.cap, 0)


def _next_ident(d: Domain, nid: Any) -> Any:
    return d.stored("next_ident + 1", lambda d, x: d.add(x, 1, "next_ident + 1"), nid)


def _with_new_buffer(d: Domain, c: CacheS, cap: Any) -> CacheS:
    """Fresh private buffers of capacity ``cap`` (spec ``_with_new_buffer``)."""
    return replace(c, has_buf=z3.BoolVal(True), buf=c.nid, cap=cap, nid=_next_ident(d, c.nid))


def _dropped_if_empty(d: Domain, c: CacheS) -> CacheS:
    empty = live_len(d, c) == 0
    return replace(c, has_buf=z3.And(c.has_buf, z3.Not(empty)), mk=z3.And(c.mk, z3.Not(empty)))


def inplace_write_allowed(d: Domain, c: CacheS, n: Any, rule: str = "spec") -> Any:
    """Ownership rule: switch on, n == 1, Fp16, the marker names the current
    buffers and ``live_len == marker.live_len``."""
    conds = [c.sw, n == 1, c.mode == FP16, c.mk, c.has_buf]
    if rule != "no_identity_check":
        conds.append(c.mkb == c.buf)
    if rule != "no_length_check":
        conds.append(live_len(d, c) == c.mkl)
    return z3.And(*conds)


@dataclass(frozen=True)
class AppendOut:
    """What an append decided: in place, regrew, and ``prev``."""

    inplace: Any
    regrew: Any
    prev: Any


def append(d: Domain, c: CacheS, n: Any, tokens: Any = None, rules: Rules = SPEC) -> tuple[AppendOut, CacheS]:
    """``update_and_fetch`` of ``n`` rows; ``tokens`` is an array whose
    first ``n`` entries are the new rows' identities (window runs only).
    Precondition (the caller's): ``n >= 1``."""
    prev = live_len(d, c)
    regrew = regrow_needed(d, c.has_buf, prev, capacity(d, c), n)
    with d.under(regrew):
        grown = _with_new_buffer(d, c, grown_capacity(d, c, prev, n, rules.regrow))
    c1 = select(regrew, grown, c)
    inplace = inplace_write_allowed(d, c1, n, rules.inplace)
    with d.under(z3.Not(inplace)):
        copied = _with_new_buffer(d, c1, c1.cap)
    c2 = select(inplace, c1, copied)
    off = d.stored("offset + n", lambda d, a, b: d.add(a, b, "offset + n"), c.off, n)
    c3 = replace(c2, off=off, mk=z3.BoolVal(True), mkb=c2.buf, mkl=d.add(prev, n, "prev + n (marker)"))
    if c.tok is not None:
        # entries + tuple(Entry(offset + i, t) for i, t in enumerate(tokens))
        w, o = c.wlen, c.off
        c3 = replace(
            c3,
            tok=d.lam(lambda i: z3.If(i < w, c.tok[i], tokens[i - w])),
            pos=d.lam(lambda i: z3.If(i < w, c.pos[i], o + (i - w))),
            wlen=d.stored("len(entries) + n", lambda d, a, b: d.add(a, b, "len(entries) + n"), w, n),
        )
    return AppendOut(inplace, regrew, prev), c3


def trim(d: Domain, c: CacheS, n: Any, rules: Rules = SPEC) -> tuple[Any, CacheS]:
    """Trim ``clamp(n, 0, live_len)`` rows from the end; logical in
    Fp16/Int8, fresh buffers of exactly the live rows otherwise; drop
    everything when nothing is left. Returns (rows removed, state)."""
    L = live_len(d, c)
    k = d.clamp(n, 0, L)
    moved = k != 0
    with d.under(moved):
        off = d.sub(c.off, k, "offset - n")
        c1 = c if rules.trim == "forgets_offset" else replace(c, off=off)
        if c.tok is not None and rules.trim != "keeps_rows":
            c1 = replace(c1, wlen=d.sub(L, k, "live_len - n"))  # entries[: live_len - n]
        L1 = live_len(d, c1)
        physical = z3.And(z3.Not(trim_is_logical(d, c.mode)), L1 > 0)
        with d.under(physical):
            cut = _with_new_buffer(d, c1, L1)
        c2 = _dropped_if_empty(d, select(physical, cut, c1))
    return z3.If(moved, k, 0), select(moved, c2, c)


def trim_to(d: Domain, c: CacheS, length: Any, rules: Rules = SPEC) -> tuple[Any, Any, CacheS]:
    """Returns (allowed, rows removed, state): refused unless
    ``0 <= length <= offset``."""
    ok = z3.And(length >= 0, length <= c.off)
    with d.under(ok):
        k, c1 = trim(d, c, d.sub(c.off, length, "offset - len"), rules)
    return ok, k, select(ok, c1, c)


def trim_front_keep_sink(d: Domain, c: CacheS, n: Any, keep: Any, rules: Rules = SPEC) -> tuple[Any, CacheS]:
    """Evict ``clamp(n, 0, live_len)`` rows after the first
    ``clamp(keep, 0, live_len - n)``; ``live_start += n``; compact into fresh
    buffers of the live rows. Fp16/Int8 only (else 0, unchanged)."""
    L = live_len(d, c)
    k = d.clamp(n, 0, L)
    moved = z3.And(supports_front_trim(d, c.mode), k != 0)
    with d.under(moved):
        if rules.front == "keep_unclamped":
            kp = d.max(keep, 0)
        else:
            kp = d.clamp(keep, 0, d.sub(L, k, "live_len - n"))
        if rules.front == "decreases_offset":
            c1 = replace(c, off=d.sub(c.off, k, "offset - n"))
        else:
            c1 = replace(c, ls=d.add(c.ls, k, "live_start + n"))
        if c.tok is not None:
            # entries[:keep] + entries[keep + n:], with Python's slice clamping
            w = c.wlen
            head = d.min(kp, w)
            tail_start = d.min(d.add(kp, k, "keep + n"), w)
            c1 = replace(
                c1,
                tok=d.lam(lambda i: z3.If(i < head, c.tok[i], c.tok[i - head + tail_start])),
                pos=d.lam(lambda i: z3.If(i < head, c.pos[i], c.pos[i - head + tail_start])),
                wlen=d.add(head, d.sub(w, tail_start, "len - start"), "head + tail"),
            )
        L1 = live_len(d, c1)
        with d.under(L1 > 0):
            compact = _with_new_buffer(d, c1, L1)
        c2 = _dropped_if_empty(d, select(L1 > 0, compact, c1))
    return z3.If(moved, k, 0), select(moved, c2, c)


def front_keep(d: Domain, c: CacheS, n: Any, keep: Any) -> Any:
    """The sink count ``trim_front_keep_sink`` keeps: ``clamp(keep, 0,
    live_len - clamp(n, 0, live_len))``."""
    L = live_len(d, c)
    return d.clamp(keep, 0, L - d.clamp(n, 0, L))


def gather_positions(d: Domain, c: CacheS, p: Any) -> tuple[Any, CacheS]:
    """``gather_positions`` of a valid list of length ``p`` (its first ``p``
    rows, say). Returns (allowed, state); the refusal changes nothing."""
    L = live_len(d, c)
    ok = z3.And(supports_gather(d, c.mode), c.ls == 0, p >= 1, p <= L)
    with d.under(z3.And(ok, p != L)):
        kept = _with_new_buffer(d, replace(c, off=p), p)
    return ok, select(z3.And(ok, p != L), kept, c)


def gather_within_tail(d: Domain, c: CacheS, tail: Any, q: Any) -> tuple[Any, CacheS]:
    """``gather_within_tail(tail, kept)`` with ``len(kept) == q``. Returns
    (allowed, state)."""
    L = live_len(d, c)
    ok = z3.And(supports_gather(d, c.mode), tail > 0, tail <= L, q >= 1, q <= tail)
    with d.under(ok):
        c1 = replace(c, off=d.sub(c.off, d.sub(tail, q, "tail - len(kept)"), "offset - dropped"))
        cap = z3.If(trim_is_logical(d, c.mode), capacity(d, c), live_len(d, c1))
        c2 = _with_new_buffer(d, c1, cap)
    return ok, select(ok, c2, c)


# ---------------------------------------------------------------------------
# Holders


def holder_rows(d: Domain, h: HolderS) -> Any:
    """A holder's valid rows: ``[0, live_len)`` of its buffer."""
    return d.sub(h.off, h.ls, "holder live_len")


def holder_of(d: Domain, c: CacheS) -> HolderS:
    return HolderS(z3.BoolVal(True), c.has_buf, c.buf, c.cap, c.off, c.ls)


def adopt(d: Domain, c: CacheS, h: HolderS, rules: Rules = SPEC) -> CacheS:
    """The cache adopting a holder's buffers and window. The spec holds no
    marker afterwards; ``keep`` keeps the old one, ``record`` records one for
    the adopted buffers (both buggy)."""
    c1 = replace(c, off=h.off, ls=h.ls, has_buf=h.has_buf, buf=h.buf, cap=h.cap)
    if rules.restore_marker == "keep":
        return c1
    if rules.restore_marker == "record":
        return replace(c1, mk=h.has_buf, mkb=h.buf, mkl=holder_rows(d, h))
    return replace(c1, mk=z3.BoolVal(False))


def is_empty(d: Domain, c: CacheS) -> Any:
    return z3.And(c.off == 0, c.ls == 0, z3.Not(c.has_buf))


def detach(d: Domain, c: CacheS) -> tuple[HolderS, CacheS]:
    """``w_detach``: the handle, and the emptied cache (``next_ident`` kept)."""
    empty = replace(c, off=d.val(0), ls=d.val(0), has_buf=z3.BoolVal(False), mk=z3.BoolVal(False))
    return holder_of(d, c), empty


def handle_trim_to(d: Domain, h: HolderS, length: Any) -> tuple[Any, Any, HolderS]:
    """A detached handle's physical ``trim_to``. Returns (allowed, rows
    removed, handle). The cut is a view of the same memory: same identity,
    capacity the live rows (buffer dropped when none are left)."""
    ok = z3.And(length >= 0, length <= h.off)
    with d.under(ok):
        rows = holder_rows(d, h)
        k = d.min(d.sub(h.off, length, "offset - len"), rows)
        live = d.sub(rows, k, "live_len - n")
        cut = HolderS(h.alive, z3.And(h.has_buf, live != 0), h.buf, live, d.sub(h.off, k, "offset - n"), h.ls)
    moved = z3.And(ok, k != 0)
    return ok, z3.If(moved, k, 0), select(moved, cut, h)
