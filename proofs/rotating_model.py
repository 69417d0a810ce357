"""Z3 encodings of the sliding-window cache's spec functions
(``kvspec.spec.rotating``), one per spec function and under its name:

* index rules: ``ring_slot``, ``visible_positions`` (its j-th element),
  ``chronological_order`` (its j-th element), ``mask_visible``;
* ``rotating_inplace_allowed`` and the counters of ``decode``, ``prefill``,
  ``trim`` (``is_trimmable``) and ``w_restore``, at the level the ownership
  proof needs: capacity, offset, idx, buffer identity, marker. Which entry
  sits in which slot is the index rules' business.

Tuples are encoded as functions of the index ``j``; ``tests/test_proofs_fidelity.py``
compares every function here with ``kvspec.spec.rotating`` on concrete values.
Buggy variants for the negative controls are selected by :class:`RingRules`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import z3

from kvspec.proofs.dense_model import FP16, select
from kvspec.proofs.domain import Domain


@dataclass(frozen=True)
class RingRules:
    """The spec's rules by default; other values are negative controls."""

    inplace: str = "spec"  # | "owns_only" (the flagship: steady-state in place)
    ring_slot: str = "spec"  # | "wrap_to_zero" (cycle through every slot, sinks included)
    order: str = "spec"  # | "physical" (prefill after a wrap in physical order)
    mask: str = "spec"  # | "admits_extra_key" | "hides_sinks"
    restore_marker: str = "none"  # | "record"


RING_SPEC = RingRules()


def mod(d: Domain, a: Any, b: Any) -> Any:
    """Python's ``a % b``."""
    return d.sub(a, d.mul(d.floordiv(a, b, "a // b"), b, "(a // b) * b"), "a % b")


# ---------------------------------------------------------------------------
# Index rules


def ring_slot(d: Domain, position: Any, max_size: Any, keep: Any, rule: str = "spec") -> Any:
    """Slot of ``position`` in a decode-only ring: itself during warm-up,
    then cycling through ``[keep, max_size)``."""
    with d.under(position >= max_size):
        if rule == "wrap_to_zero":
            cyc = mod(d, position, max_size)
        else:
            cyc = d.add(keep, mod(d, d.sub(position, keep, "position - keep"), d.sub(max_size, keep, "W - K")),
                        "keep + ...")
    return z3.If(position < max_size, position, cyc)


def visible_position(d: Domain, offset: Any, max_size: Any, keep: Any, j: Any) -> Any:
    """``visible_positions(offset, max_size, keep)[j]``."""
    with d.under(z3.And(offset > max_size, j >= keep)):
        later = d.add(d.sub(offset, d.sub(max_size, keep, "W - K"), "offset - (W - K)"), d.sub(j, keep, "j - K"),
                      "+ (j - K)")
    return z3.If(offset <= max_size, j, z3.If(j < keep, j, later))


def visible_count(d: Domain, offset: Any, max_size: Any) -> Any:
    """``len(visible_positions(...))``."""
    return d.min(offset, max_size)


def chronological_slot(d: Domain, n_slots: Any, idx: Any, keep: Any, wrapped: Any, j: Any, rule: str = "spec") -> Any:
    """``chronological_order(n_slots, idx, keep, wrapped)[j]``."""
    if rule == "physical":
        return j
    with d.under(z3.And(wrapped, j >= keep)):
        tail = d.sub(n_slots, idx, "n_slots - idx")
        first = j < d.add(keep, tail, "keep + tail")
        with d.under(first):
            older = d.add(idx, d.sub(j, keep, "j - keep"), "idx + (j - keep)")
        with d.under(z3.Not(first)):
            newer = d.add(keep, d.sub(d.sub(j, keep, "j - keep"), tail, "j - keep - tail"), "keep + ...")
    return z3.If(z3.Not(wrapped), j, z3.If(j < keep, j, z3.If(first, older, newer)))


def chronological_len(d: Domain, n_slots: Any, idx: Any, wrapped: Any) -> Any:
    return z3.If(wrapped, n_slots, idx)


def mask_visible(d: Domain, query: Any, key: Any, window: Any, keep: Any, rule: str = "spec") -> Any:
    """Causal, and a sink or among the ``window - keep`` latest positions."""
    dist = d.sub(query, key, "query - key")
    span = d.sub(window, keep, "window - keep")
    if rule == "admits_extra_key":
        return z3.And(key <= query, z3.Or(key < keep, dist <= span))
    if rule == "hides_sinks":
        return z3.And(key <= query, dist < span)
    return z3.And(key <= query, z3.Or(key < keep, dist < span))


# ---------------------------------------------------------------------------
# The ring's counters


@dataclass(frozen=True)
class RingS:
    """A ``RotatingCache`` as Z3 terms (slots abstracted to the capacity)."""

    W: Any
    K: Any
    step: Any
    mode: Any
    sw: Any
    cap: Any
    off: Any
    idx: Any
    has: Any  # ident is not None
    ident: Any
    mk: Any
    mkb: Any
    mki: Any
    nid: Any


@dataclass(frozen=True)
class RingHolderS:
    """A snapshot or held window: the ring's counters at that moment."""

    alive: Any
    has: Any
    ident: Any
    cap: Any
    off: Any
    idx: Any


def ring_vars(d: Domain, p: str) -> RingS:
    v = d.var
    return RingS(v(p + "W"), v(p + "K"), v(p + "step"), z3.Int(p + "mode"), z3.Bool(p + "inplace"), v(p + "cap"),
                 v(p + "offset"), v(p + "idx"), z3.Bool(p + "has_buf"), v(p + "ident"), z3.Bool(p + "marker"),
                 v(p + "marker_buf"), v(p + "marker_idx"), v(p + "next_ident"))


def ring_holder_vars(d: Domain, p: str) -> RingHolderS:
    v = d.var
    return RingHolderS(z3.Bool(p + "alive"), z3.Bool(p + "has_buf"), v(p + "ident"), v(p + "cap"), v(p + "offset"),
                       v(p + "idx"))


def wrapped(c: Any) -> Any:
    return c.off != c.idx


def valid_len(c: Any) -> Any:
    return z3.If(wrapped(c), c.cap, c.idx)


def _new_buffer(d: Domain, c: RingS, cap: Any) -> RingS:
    nid = d.stored("next_ident + 1", lambda d, x: d.add(x, 1, "next_ident + 1"), c.nid)
    return replace(c, cap=cap, has=z3.BoolVal(True), ident=c.nid, nid=nid)


def rotating_inplace_allowed(d: Domain, c: RingS, rule: str = "spec") -> Any:
    """Warm-up rule: switch on, Fp16, ``offset < max_size``, ``idx ==
    offset``, and the marker names these buffers and this cursor."""
    owns = z3.And(c.mk, c.has, c.mkb == c.ident)
    if rule == "owns_only":
        return z3.And(c.sw, c.mode == FP16, owns)
    return z3.And(c.sw, c.mode == FP16, c.off < c.W, c.idx == c.off, owns, c.mki == c.idx)


@dataclass(frozen=True)
class DecodeOut:
    inplace: Any
    slot: Any  # where the row is written
    before_write: RingS  # the ring after steps 1-3, before the write


def decode(d: Domain, c: RingS, rules: RingRules = RING_SPEC) -> tuple[DecodeOut, RingS]:
    """Single-row append: cut an oversized buffer, grow, wrap, write at idx."""
    W, K = c.W, c.K
    over = c.cap > W
    with d.under(over):
        cut = replace(_new_buffer(d, c, W), idx=W)
    c1 = select(over, cut, c)
    grow_needed = z3.And(c1.idx >= c1.cap, c1.cap < W)
    with d.under(grow_needed):
        grown = _new_buffer(d, c1, d.add(c1.cap, d.min(c.step, d.sub(W, c1.cap, "W - capacity")), "capacity + grow"))
    c2 = select(grow_needed, grown, c1)
    c3 = replace(c2, idx=z3.If(c2.idx >= W, K, c2.idx))
    inplace = rotating_inplace_allowed(d, c3, rules.inplace)
    with d.under(z3.Not(inplace)):
        copied = _new_buffer(d, c3, c3.cap)
    c4 = select(inplace, c3, copied)
    off = d.stored("offset + 1", lambda d, x: d.add(x, 1, "offset + 1"), c4.off)
    idx = d.add(c4.idx, 1, "idx + 1")
    c5 = replace(c4, off=off, idx=idx, mk=z3.BoolVal(True), mkb=c4.ident, mki=idx)
    return DecodeOut(inplace, c3.idx, c3), c5


def prefill(d: Domain, c: RingS, n: Any) -> RingS:
    """Multi-row append (n >= 2): keep at most ``max_size - 1`` old rows,
    store them and the n new rows contiguously in fresh buffers."""
    valid = valid_len(c)
    budget = d.sub(c.W, 1, "max_size - 1")
    kept = z3.If(valid > budget, budget, valid)
    cap = d.stored("kept + n", lambda d, a, b: d.add(a, b, "kept + n"), kept, n)
    c1 = _new_buffer(d, c, cap)
    off = d.stored("offset + n", lambda d, a, b: d.add(a, b, "offset + n"), c.off, n)
    return replace(c1, off=off, idx=cap, mk=z3.BoolVal(True), mkb=c1.ident, mki=cap)


def counters_rewind_exact(d: Domain, c: RingS) -> Any:
    return z3.And(c.idx == c.off, c.off <= c.W, c.cap <= c.W)


is_trimmable = counters_rewind_exact  # at U = 0 the two coincide


def trim(d: Domain, c: RingS, n: Any) -> tuple[Any, RingS]:
    """Rewind ``clamp(n, 0, offset)`` rows while the counters alone rewind
    the ring (``counters_rewind_exact``; the buffers stay, also at offset
    0); a wrapped ring without an undo log (U = 0) trims nothing (fail
    closed). The log's rollback is :mod:`kvspec.proofs.rotating_undo`."""
    k = d.clamp(n, 0, c.off)
    moved = z3.And(counters_rewind_exact(d, c), k != 0)
    with d.under(moved):
        c1 = replace(c, off=d.sub(c.off, k, "offset - n"), idx=d.sub(c.idx, k, "idx - n"))
    return z3.If(moved, k, 0), select(moved, c1, c)


def holder_of(d: Domain, c: RingS) -> RingHolderS:
    """``RingHolder(cache)``: a snapshot, or the window an append
    returned (it shares the buffers it was sliced from)."""
    return RingHolderS(z3.BoolVal(True), c.has, c.ident, c.cap, c.off, c.idx)


def restore(d: Domain, c: RingS, h: RingHolderS, rules: RingRules = RING_SPEC) -> RingS:
    """``w_restore``: adopt the snapshot's slots, offset, cursor, identity;
    no marker (``record``: a marker for the adopted buffers, buggy)."""
    c1 = replace(c, cap=h.cap, off=h.off, idx=h.idx, has=h.has, ident=h.ident)
    if rules.restore_marker == "record":
        return replace(c1, mk=h.has, mkb=h.ident, mki=h.idx)
    return replace(c1, mk=z3.BoolVal(False))
