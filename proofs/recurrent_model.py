"""Z3 encodings of the recurrent kind's rules (``kvspec.spec.recurrent``,
``kvspec.spec.layers``), for obligations 15 and 16 (``proofs/recurrent.py``).

The checkpoint ring of depth U (obligation 15) is a Z3 array ``ring`` from
slot to the offset whose checkpoint the slot holds; a cache at offset ``t``
with coverage ``c`` is sound when every live offset ``x`` in ``[t - c, t]``
sits in its slot: ``ring[slot(x)] == x`` (:func:`sound_at`). The universal
statement is proved for an arbitrary ``x`` (a free variable: proving the
statement for every value of it is proving it for all), with the premise
instantiated at the same ``x``: every step below changes one slot at most,
so the slot of ``x`` after a step is the slot of ``x`` before it or the slot
just written.

The list trim (obligation 16) reuses :mod:`kvspec.proofs.layers_model`'s layers
and adds the recurrent kind: each layer is dense, a ring or recurrent (a
recurrent layer's trim bounds are ``(offset, coverage)``, a ring's rule; its
own ``trim`` raises beyond the coverage, encoded as :data:`REFUSED`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import z3

from kvspec.proofs.domain import Domain

#: what a recurrent layer's trim "returns" when it raises (beyond its coverage)
REFUSED = -1


@dataclass(frozen=True)
class RingRules:
    """The spec's rules by default; other values are negative controls."""

    slots: str = "depth_plus_one"  # | "depth" (a ring of U slots)
    clear: str = "seed"  # | "forget" (a cleared ring does not keep the current offset's checkpoint)
    cap: str = "depth"  # | "none" (a recorded step raises the coverage past U)


RING_SPEC = RingRules()


def slot(d: Domain, x: Any, U: Any, rules: RingRules = RING_SPEC) -> Any:
    """``kvspec.spec.recurrent.slot(x, U) = x % (U + 1)``, written ``x - (U + 1) *
    (x // (U + 1))`` (the control: ``x % U``)."""
    # the ring's length is stored (a port allocates U + 1 slots): it fits
    L = d.stored("ring slots U + 1", lambda dd, u: dd.add(u, 1, "U + 1"), U) if rules.slots == "depth_plus_one" else U
    k = d.floordiv(x, L, "x // (U + 1)")
    floor_bounds(d, x, L, k)
    return d.sub(x, d.mul(k, L, "k * (U + 1)"), "x % (U + 1)")


def floor_bounds(d: Domain, a: Any, L: Any, k: Any) -> None:
    """State what ``k = a // L`` means for ``L > 0`` (``k * L <= a < k * L +
    L``; part "floor division bounds" proves it over unbounded integers):
    Z3's nonlinear search needs it, and in bv32 the no-overflow check of
    ``k * L`` too."""
    d.assume("floor division bounds", z3.Implies(L > 0, z3.And(k * L <= a, a < k * L + L)))


def coverage_after(d: Domain, c: Any, U: Any, rules: RingRules = RING_SPEC) -> Any:
    """A recorded step of one token: ``min(U, c + 1)`` (the control: ``c + 1``)."""
    up = d.add(c, 1, "c + 1")
    return d.min(U, up) if rules.cap == "depth" else up


def sound_at(d: Domain, ring: Any, t: Any, c: Any, U: Any, x: Any, rules: RingRules = RING_SPEC) -> Any:
    """The ring's invariant at the offset ``x``: if ``x`` is live (``t - c
    <= x <= t``) its slot holds its checkpoint."""
    live = z3.And(x >= t - c, x <= t)
    with d.under(live):
        held = ring[slot(d, x, U, rules)]
    return z3.Implies(live, held == x)


def counters_ok(t: Any, c: Any, U: Any) -> Any:
    """``0 <= c <= min(U, t)``."""
    return z3.And(c >= 0, c <= U, c <= t)


def record(d: Domain, ring: Any, t: Any, U: Any, rules: RingRules = RING_SPEC) -> tuple[Any, Any]:
    """A recorded step from offset ``t``: ``(ring, t + 1)`` with the
    checkpoint of ``t + 1`` in its slot."""
    t1 = d.stored("offset + 1", lambda dd, v: dd.add(v, 1, "t + 1"), t)
    return z3.Store(ring, slot(d, t1, U, rules), t1), t1


def clear(d: Domain, ring: Any, t: Any, U: Any, rules: RingRules = RING_SPEC) -> Any:
    """An unrecorded step, a ``state`` assignment or a reload leaving offset
    ``t``: coverage 0, and the current state becomes the checkpoint of ``t``
    (the spec's seed; the control forgets it). ``kvspec.impl.recurrent`` writes
    the seed lazily, at the start of the next recorded call: the same ring
    whenever a trim can read it (a trim needs coverage >= 1, so a recorded
    step after the clear)."""
    if rules.clear == "forget":
        return ring
    return z3.Store(ring, slot(d, t, U, rules), t)


# -- obligation 16: the list trim with recurrent layers ----------------------------


@dataclass(frozen=True)
class MixedLayer:
    dense: Any
    recurrent: Any
    offset: Any
    live: Any
    exact: Any


@dataclass(frozen=True)
class ListRules:
    count: str = "spec"  # | "per_layer" (each layer trims min(n, its own exact bound))
    bound: str = "spec"  # | "offset" (a recurrent layer's exact bound taken as its offset, not its coverage)


LIST_SPEC = ListRules()


def mixed_vars(d: Domain, i: int) -> MixedLayer:
    return MixedLayer(d.boolean(f"dense_{i}"), d.boolean(f"recurrent_{i}"), d.var(f"offset_{i}"),
                      d.var(f"live_{i}"), d.var(f"exact_{i}"))


def mixed_premises(layer: MixedLayer) -> list[Any]:
    """A dense layer: live rows within the offset, its exact bound. A ring
    or a recurrent layer: rows = offset, the exact bound (a ring's
    ``trimmable_rows``, a recurrent layer's coverage) in ``[0, offset]``."""
    return [z3.Not(z3.And(layer.dense, layer.recurrent)), layer.offset >= 0, layer.live >= 0,
            layer.live <= layer.offset, z3.Implies(layer.dense, layer.exact == layer.live),
            z3.Implies(z3.Not(layer.dense), z3.And(layer.live == layer.offset, layer.exact >= 0,
                                                   layer.exact <= layer.offset))]


def exact_bound(layer: MixedLayer, rules: ListRules = LIST_SPEC) -> Any:
    """``layer_trim_bounds``'s exact bound: a recurrent layer's coverage
    (the control: its offset, as if every state were kept)."""
    if rules.bound == "offset":
        return z3.If(layer.recurrent, layer.offset, layer.exact)
    return layer.exact


def list_count(n: Any, layers: list[MixedLayer], rules: ListRules = LIST_SPEC) -> Any:
    """``kvspec.spec.layers.list_trim_count`` over ``layer_trim_bounds``: ``min(n,
    every layer's rows)``, 0 when ``n <= 0`` or beyond some exact bound."""
    count = n
    for layer in layers:
        count = z3.If(layer.live < count, layer.live, count)
    beyond = z3.Or(*(count > exact_bound(layer, rules) for layer in layers))
    return z3.If(z3.Or(n <= 0, beyond), 0, count)


def asked(n: Any, layers: list[MixedLayer], layer: MixedLayer, rules: ListRules = LIST_SPEC) -> Any:
    """What the list asks ``layer`` to trim: the list's count (the control:
    ``min(n, the layer's own exact bound)``)."""
    if rules.count == "per_layer":
        return z3.If(n <= 0, 0, z3.If(layer.exact < n, layer.exact, n))
    return list_count(n, layers, rules)


def layer_trims(layer: MixedLayer, count: Any) -> Any:
    """What one layer's own trim removes: ``kvspec.spec.dense.trim`` clamps to its
    live rows; ``kvspec.spec.rotating.trim`` returns 0 beyond its exact bound;
    ``kvspec.spec.recurrent.trim`` raises beyond its coverage (:data:`REFUSED`)."""
    dense = z3.If(count <= 0, 0, z3.If(count > layer.live, layer.live, count))
    clamped = z3.If(count > layer.offset, layer.offset, count)
    ring = z3.If(z3.Or(count <= 0, clamped > layer.exact), 0, clamped)
    rec = z3.If(count <= 0, 0, z3.If(count > layer.exact, REFUSED, count))
    return z3.If(layer.dense, dense, z3.If(layer.recurrent, rec, ring))
