"""Obligations 15 and 16: the recurrent kind's checkpoint ring and the list
trim over mixed layers (``kvspec.spec.recurrent``, ``kvspec.spec.layers``; semantics.md
9). Encodings are in :mod:`kvspec.proofs.recurrent_model`.

Obligation 15, the checkpoint ring of depth U (U + 1 slots, the checkpoint
of offset x in slot ``x % (U + 1)``), for every integer U >= 1, offset t,
coverage c and rollback n, over unbounded integers and in 32-bit wrapping
arithmetic:

* no step in ``(x, t]`` writes the slot of a live offset x (``t - c <= x``,
  ``c <= U``): the checkpoints of the live offsets are never overwritten;
* a recorded step keeps the ring sound (every live offset in its slot) and
  the coverage within ``[0, min(U, t)]``;
* a rollback of ``n <= c`` finds the checkpoint of ``t - n`` in its slot,
  and the ring stays sound for the recorded steps after it;
* clearing the coverage (an unrecorded step, ``c.state = v``, a reload)
  leaves a sound ring: the current state becomes the checkpoint of its
  offset, so the next recorded step can be rolled back.

Negative controls, each refuted: a ring of U slots (``x % U``), a clear that
forgets to keep the current offset's checkpoint, a recorded step that lets
the coverage pass U.

Obligation 16, the atomic list trim over up to three mixed layers (dense,
ring, recurrent): after ``list_trim_count`` every layer trims the same
count (the list's), or none does; no layer is asked beyond its exact bound
(a recurrent layer's coverage, so its trim never raises inside a list
trim); the count is the largest such. Negative controls: a list trim that
trims each layer by ``min(n, its own bound)``, and one that takes a
recurrent layer's exact bound as its offset (every state kept), refuted.

Run as ``kvspec prove --only 15 16``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import z3

from kvspec.proofs.core import ObligationResult, PartBuilder, control_from_parts, overall, run_parts
from kvspec.proofs.domain import Domain
from kvspec.proofs.recurrent_model import (
    LIST_SPEC,
    RING_SPEC,
    ListRules,
    RingRules,
    asked,
    clear,
    counters_ok,
    coverage_after,
    layer_trims,
    list_count,
    mixed_premises,
    mixed_vars,
    record,
    slot,
    sound_at,
)

#: offsets a 32-bit port stores: the run assumes the next offset fits
LAYERS = 3
RING_NAME = "recurrent checkpoint ring"
LIST_NAME = "atomic list trim with recurrent layers"


def ring_parts(rules: RingRules = RING_SPEC) -> list[tuple[str, PartBuilder]]:
    def floor_bounds(d: Domain) -> tuple[list[Any], Any]:
        a, L = d.var("a"), d.var("L")
        k = d.floordiv(a, L, "a // L")
        return [L > 0], z3.And(k * L <= a, a < k * L + L)

    def distinct(d: Domain) -> tuple[list[Any], Any]:
        U, t, c, x, y = (d.var(v) for v in ("U", "offset", "c", "x", "y"))
        pre = [U >= 1, counters_ok(t, c, U), x >= t - c, x < y, y <= t]
        return pre, slot(d, y, U, rules) != slot(d, x, U, rules)

    def step_keeps(d: Domain) -> tuple[list[Any], Any]:
        U, t, c, x = (d.var(v) for v in ("U", "offset", "c", "x"))
        ring = d.array("ring")
        pre = [U >= 1, counters_ok(t, c, U), sound_at(d, ring, t, c, U, x, rules)]
        ring1, t1 = record(d, ring, t, U, rules)
        c1 = coverage_after(d, c, U, rules)
        return pre, z3.And(counters_ok(t1, c1, U), sound_at(d, ring1, t1, c1, U, x, rules))

    def rollback(d: Domain) -> tuple[list[Any], Any]:
        U, t, c, n, x = (d.var(v) for v in ("U", "offset", "c", "n", "x"))
        ring = d.array("ring")
        back = d.sub(t, n, "offset - n")
        pre = [U >= 1, counters_ok(t, c, U), n >= 1, n <= c,
               sound_at(d, ring, t, c, U, x, rules), sound_at(d, ring, t, c, U, back, rules)]
        c1 = d.sub(c, n, "c - n")
        return pre, z3.And(ring[slot(d, back, U, rules)] == back, counters_ok(back, c1, U),
                           sound_at(d, ring, back, c1, U, x, rules))

    def cleared(d: Domain) -> tuple[list[Any], Any]:
        U, t, x = (d.var(v) for v in ("U", "offset", "x"))
        ring = d.array("ring")
        ring1 = clear(d, ring, t, U, rules)
        return [U >= 1, t >= 0], z3.And(counters_ok(t, 0, U), sound_at(d, ring1, t, 0, U, x, rules))

    return [("floor division bounds: (a // L) * L <= a < (a // L) * L + L", floor_bounds),
            ("no step in (x, offset] writes the slot of a live offset x", distinct),
            ("a recorded step keeps every live offset's checkpoint and 0 <= c <= min(U, offset)", step_keeps),
            ("rollback(n <= c) finds the checkpoint of offset - n; the ring stays sound", rollback),
            ("a cleared ring (unrecorded step, state, reload) is sound", cleared)]


RING_CONTROLS: list[tuple[str, str, RingRules]] = [
    ("ring_of_depth_slots", "the ring has U slots (x % U) instead of U + 1", RingRules(slots="depth")),
    ("clear_forgets_current", "a cleared ring does not keep the current offset's checkpoint",
     RingRules(clear="forget")),
    ("coverage_past_depth", "a recorded step raises the coverage past U", RingRules(cap="none")),
]


def list_parts(rules: ListRules = LIST_SPEC) -> list[tuple[str, PartBuilder]]:
    def setup(d: Domain) -> tuple[Any, list[Any], list[Any]]:
        n = d.var("n")
        layers = [mixed_vars(d, i) for i in range(LAYERS)]
        return n, layers, [p for layer in layers for p in mixed_premises(layer)]

    def same_count(d: Domain) -> tuple[list[Any], Any]:
        n, layers, premises = setup(d)
        count = list_count(n, layers, rules)
        return premises, z3.And(*(layer_trims(layer, asked(n, layers, layer, rules)) == count for layer in layers))

    def within(d: Domain) -> tuple[list[Any], Any]:
        n, layers, premises = setup(d)
        return premises, z3.And(*(z3.And(asked(n, layers, layer, rules) >= 0,
                                         asked(n, layers, layer, rules) <= layer.exact) for layer in layers))

    def largest(d: Domain) -> tuple[list[Any], Any]:
        n, layers, premises = setup(d)
        least = n
        for layer in layers:
            least = z3.If(layer.live < least, layer.live, least)
        fits = z3.And(*(least <= layer.exact for layer in layers))
        return [*premises, n > 0, fits], list_count(n, layers, rules) == least

    return [("every layer trims the list's count, or none trims", same_count),
            ("no layer is asked beyond its exact bound (a recurrent layer's coverage)", within),
            ("the count is min(n, every layer's rows) when all can take it exactly", largest)]


LIST_CONTROLS: list[tuple[str, str, ListRules]] = [
    ("trim_each_to_its_bound", "each layer trims min(n, its own exact bound)", ListRules(count="per_layer")),
    ("recurrent_bound_is_offset", "a recurrent layer's exact bound taken as its offset, not its coverage",
     ListRules(bound="offset")),
]


def prove_ring() -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(ring_parts())
    controls = [control_from_parts(name, text, ring_parts(rules)) for name, text, rules in RING_CONTROLS]
    return ObligationResult(
        15, RING_NAME, ("slot", "live_offsets", "coverage_after", "trim"),
        "a ring of U + 1 slots keeps the checkpoint of every live offset [offset - c, offset] (c <= min(U, offset)) "
        "through recorded steps, rollbacks of n <= c and clears",
        overall(parts, controls), parts, controls, time.perf_counter() - t0)


def prove_list() -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(list_parts())
    controls = [control_from_parts(name, text, list_parts(rules)) for name, text, rules in LIST_CONTROLS]
    return ObligationResult(
        16, LIST_NAME, ("list_trim_count", "layer_trim_bounds"),
        "over dense, ring and recurrent layers every layer trims the same count, within its exact bound "
        "(a recurrent layer's coverage), or none does",
        overall(parts, controls), parts, controls, time.perf_counter() - t0)


OBLIGATIONS: list[tuple[int, Callable[[], ObligationResult]]] = [(15, prove_ring), (16, prove_list)]
