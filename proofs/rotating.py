"""The sliding-window cache's obligations: 2 (ring slots, chronological
order and the warm-up in-place rule) and 7 (the window mask).

Encodings are in :mod:`kvspec.proofs.rotating_model`; each negative control names
the buggy rule, and is confirmed on ``kvspec.spec.rotating`` with the bug patched in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import z3

from kvspec.proofs import traces
from kvspec.proofs.core import ObligationResult, PartBuilder, control_from_parts, overall, run_parts
from kvspec.proofs.dense_model import MODES
from kvspec.proofs.domain import INT, Domain, solver
from kvspec.proofs.rotating_model import (
    RING_SPEC,
    RingHolderS,
    RingRules,
    RingS,
    chronological_len,
    chronological_slot,
    decode,
    holder_of,
    mask_visible,
    prefill,
    restore,
    ring_holder_vars,
    ring_slot,
    ring_vars,
    trim,
    valid_len,
    visible_count,
    visible_position,
)

REQUIRED = ("ring_slot", "chronological_order", "mask_visible", "rotating_inplace_allowed", "visible_positions",
            "decode", "prefill", "trim", "w_restore", "make_mask_spec")


def available() -> bool:
    """spec/rotating.py exists and has the functions these proofs encode."""
    try:
        from kvspec.spec import rotating as sr
    except ImportError:
        return False
    return all(hasattr(sr, name) for name in REQUIRED)


def _shape(d: Domain, W: Any, K: Any) -> Any:
    return z3.And(K >= 0, K < W)


def cursor(d: Domain, o: Any, W: Any, K: Any, rule: str = "spec") -> Any:
    """Where idx stands after ``o`` decode steps from empty: ``o`` during
    warm-up, then one past the slot of the last row."""
    with d.under(o > W):
        after = ring_slot(d, o - 1, W, K, rule) + 1
    return z3.If(o <= W, o, after)


# ===========================================================================
# Obligation 2


def ring_parts(rules: RingRules = RING_SPEC) -> list[tuple[str, PartBuilder]]:
    rs = rules.ring_slot

    def slot_range(d: Domain) -> tuple[list[Any], Any]:
        W, K, p = d.var("W"), d.var("K"), d.var("position")
        s = ring_slot(d, p, W, K, rs)
        return [_shape(d, W, K), p >= 0], z3.And(s >= 0, s < W, z3.Implies(p < W, s == p), z3.Implies(p >= K, s >= K))

    def distinct(d: Domain) -> tuple[list[Any], Any]:
        W, K, o, j1, j2 = (d.var(x) for x in ("W", "K", "offset", "j1", "j2"))
        n = visible_count(d, o, W)
        p1, p2 = visible_position(d, o, W, K, j1), visible_position(d, o, W, K, j2)
        pre = [_shape(d, W, K), o >= 0, j1 >= 0, j1 < n, j2 >= 0, j2 < n, j1 != j2]
        return pre, ring_slot(d, p1, W, K, rs) != ring_slot(d, p2, W, K, rs)

    def evicts_oldest(d: Domain) -> tuple[list[Any], Any]:
        W, K, o = d.var("W"), d.var("K"), d.var("offset")
        oldest = visible_position(d, o, W, K, K)  # the first non-sink visible position
        return [_shape(d, W, K), o >= W], z3.And(oldest >= K, oldest == o - (W - K),
                                                 ring_slot(d, o, W, K, rs) == ring_slot(d, oldest, W, K, rs))

    def decode_cursor(d: Domain) -> tuple[list[Any], Any]:
        c = ring_vars(d, "c.")
        o = c.off
        pre = [_shape(d, c.W, c.K), c.step >= 1, o >= 0, c.idx == cursor(d, o, c.W, c.K, rs),
               z3.If(o >= c.W, c.cap == c.W, z3.And(c.cap >= c.idx, c.cap <= c.W))]
        out, c1 = decode(d, c, rules)
        return pre, z3.And(out.slot == ring_slot(d, o, c.W, c.K, rs), c1.idx == cursor(d, o + 1, c.W, c.K, rs))

    def chronological(d: Domain) -> tuple[list[Any], Any]:
        W, K, o, j = d.var("W"), d.var("K"), d.var("offset"), d.var("j")
        idx = cursor(d, o, W, K, rs)
        n_slots = z3.If(o >= W, W, o)
        wr = o != idx
        n = visible_count(d, o, W)
        pre = [_shape(d, W, K), o >= 0, j >= 0, j < n]
        goal = z3.And(chronological_len(d, n_slots, idx, wr) == n,
                      chronological_slot(d, n_slots, idx, K, wr, j, rules.order)
                      == ring_slot(d, visible_position(d, o, W, K, j), W, K, rs))
        return pre, goal

    return [("ring_slot in [0, W), warm-up slot = position, non-sinks avoid sinks", slot_range),
            ("visible positions get distinct slots", distinct),
            ("the next decode overwrites the oldest non-sink", evicts_oldest),
            ("decode writes at ring_slot(offset) and moves idx on", decode_cursor),
            ("chronological_order lists the visible positions' slots in order", chronological)]


# -- the warm-up in-place rule: an inductive ownership invariant ------------


def ring_well_formed(d: Domain, c: RingS) -> Any:
    """Counters of a reachable ring: ``0 <= idx <= capacity``, no more
    valid slots than rows written, a wrapped ring has at least max_size
    slots, an oversized buffer (after a prefill) is full and unwrapped,
    identities already handed out."""
    return z3.And(
        _shape(d, c.W, c.K), c.step >= 1, c.mode >= 0, c.mode < len(MODES), c.nid >= 0,
        c.idx >= 0, c.idx <= c.cap, c.idx <= c.off,
        z3.Implies(c.off != c.idx, z3.And(c.cap <= c.off, c.cap >= c.W)),
        z3.Implies(c.cap > c.W, c.idx == c.cap),
        z3.Implies(c.has, z3.And(c.cap >= 1, c.ident >= 0, c.ident < c.nid)),
        z3.Implies(z3.Not(c.has), z3.And(c.cap == 0, c.off == 0, c.idx == 0)),
        z3.Implies(c.mk, z3.And(c.mkb >= 0, c.mkb < c.nid)),
    )


def ring_holder_well_formed(d: Domain, c: RingS, h: RingHolderS) -> Any:
    return z3.Implies(h.alive, z3.And(
        h.idx >= 0, h.idx <= h.cap, h.idx <= h.off,
        z3.Implies(h.off != h.idx, z3.And(h.cap <= h.off, h.cap >= c.W)),
        z3.Implies(h.cap > c.W, h.idx == h.cap),
        z3.Implies(h.has, z3.And(h.cap >= 1, h.ident >= 0, h.ident < c.nid)),
        z3.Implies(z3.Not(h.has), z3.And(h.cap == 0, h.off == 0, h.idx == 0)),
    ))


def ring_ownership_invariant(d: Domain, c: RingS, h: RingHolderS) -> Any:
    """While the marker names the current buffers and the ring is unwrapped
    (``idx == offset``): ``idx <= marker.idx``, and every holder of those
    buffers is an unwrapped state whose cursor is at most ``marker.idx``.
    (A wrapped ring never writes in place again with the same buffers: a
    wrapped ring cannot trim, and every write there copies.)"""
    owns = z3.And(c.mk, c.has, c.mkb == c.ident, c.idx == c.off)
    shares = z3.And(h.alive, h.has, h.ident == c.ident)
    return z3.Implies(owns, z3.And(c.idx <= c.mki, z3.Implies(shares, z3.And(h.off == h.idx, h.idx <= c.mki))))


def ring_invariant(d: Domain, c: RingS, h: RingHolderS) -> Any:
    return z3.And(ring_well_formed(d, c), ring_holder_well_formed(d, c, h), ring_ownership_invariant(d, c, h))


def ring_ownership_parts(rules: RingRules = RING_SPEC) -> list[tuple[str, PartBuilder]]:
    def fresh(d: Domain) -> tuple[RingS, RingHolderS, RingHolderS]:
        return ring_vars(d, "c."), ring_holder_vars(d, "h."), ring_holder_vars(d, "g.")

    def init(d: Domain) -> tuple[list[Any], Any]:
        c, h, _ = fresh(d)
        pre = [_shape(d, c.W, c.K), c.step >= 1, c.mode >= 0, c.mode < len(MODES), c.cap == 0, c.off == 0,
               c.idx == 0, z3.Not(c.has), z3.Not(c.mk), c.nid == 0, z3.Not(h.alive)]
        return pre, ring_invariant(d, c, h)

    def step(t: Callable[[Domain, RingS, RingHolderS, RingHolderS], tuple[Any, RingS, list[RingHolderS]]]) -> PartBuilder:
        def build(d: Domain) -> tuple[list[Any], Any]:
            c, h, g = fresh(d)
            guard, c1, hs = t(d, c, h, g)
            return [ring_invariant(d, c, h), ring_invariant(d, c, g), guard], z3.And(*[ring_invariant(d, c1, x) for x in hs])
        return build

    def t_decode(d: Domain, c: RingS, h: RingHolderS, g: RingHolderS) -> tuple[Any, RingS, list[RingHolderS]]:
        _, c1 = decode(d, c, rules)
        return z3.BoolVal(True), c1, [h, holder_of(d, c1)]  # the returned window shares the buffers

    def t_prefill(d: Domain, c: RingS, h: RingHolderS, g: RingHolderS) -> tuple[Any, RingS, list[RingHolderS]]:
        n = d.var("n")
        c1 = prefill(d, c, n)
        return n >= 2, c1, [h, holder_of(d, c1)]

    def t_trim(d: Domain, c: RingS, h: RingHolderS, g: RingHolderS) -> tuple[Any, RingS, list[RingHolderS]]:
        _, c1 = trim(d, c, d.var("n"))
        return z3.BoolVal(True), c1, [h]

    def t_snapshot(d: Domain, c: RingS, h: RingHolderS, g: RingHolderS) -> tuple[Any, RingS, list[RingHolderS]]:
        return z3.BoolVal(True), c, [h, holder_of(d, c)]

    def t_restore(d: Domain, c: RingS, h: RingHolderS, g: RingHolderS) -> tuple[Any, RingS, list[RingHolderS]]:
        return g.alive, restore(d, c, g, rules), [h]

    def safety(d: Domain) -> tuple[list[Any], Any]:
        c, h, _ = fresh(d)
        out, _ = decode(d, c, rules)
        b = out.before_write
        shares = z3.And(h.alive, h.has, h.ident == b.ident)
        goal = z3.Implies(out.inplace, z3.And(z3.Implies(shares, valid_len(h) <= out.slot), out.slot < b.cap))
        return [ring_invariant(d, c, h)], goal

    return [("init", init), ("preserved by decode", step(t_decode)), ("preserved by prefill", step(t_prefill)),
            ("preserved by trim", step(t_trim)), ("preserved by snapshot", step(t_snapshot)),
            ("preserved by restore", step(t_restore)), ("in-place slot unseen", safety)]


# -- negative controls: the buggy rules in Python, and concrete counterexamples


def _ring_slot_wraps_to_zero(position: int, max_size: int, keep: int) -> int:
    return position if position < max_size else position % max_size


def _steady_state_inplace(cache: Any) -> bool:
    from kvspec.spec.rotating import Mode

    return bool(cache.inplace and cache.mode is Mode.FP16 and cache.marker is not None and cache.ident is not None
                and cache.marker.buffer == cache.ident)


def _physical_order(n_slots: int, idx: int, keep: int, wrapped: bool) -> tuple[int, ...]:
    return tuple(range(n_slots if wrapped else idx))


def _restore_records_marker(world: Any, name: str) -> tuple[None, Any]:
    from kvspec.spec import rotating as sr

    snap = world.holders.get(name)
    if snap is None:
        raise ValueError(name)
    s = snap.cache
    marker = None if s.ident is None else sr.RingMarker(s.ident, s.idx)
    cache = replace(world.cache, slots=s.slots, offset=s.offset, idx=s.idx, ident=s.ident, marker=marker)
    return None, replace(world, cache=cache)


def _mask_admits_extra_key(query: int, key: int, window: int, keep: int) -> bool:
    return key <= query and (key < keep or query - key <= window - keep)


def _mask_hides_sinks(query: int, key: int, window: int, keep: int) -> bool:
    return key <= query and query - key < window - keep


def _model_ints(m: Any, names: list[str]) -> dict[str, int]:
    out = {}
    for decl in m.decls():
        if decl.name() in names:
            out[decl.name()] = m[decl].as_long()
    return out


def _find(build: PartBuilder, rules_extra: list[Any] | None = None) -> Any:
    """A model of the negation of a part over unbounded ints, with small
    values preferred."""
    d = Domain(INT)
    premises, goal = build(d)
    s = solver(20_000)
    s.add(*premises, z3.Not(goal), *(rules_extra or []))
    return s.model() if s.check() == z3.sat else None


def _small(names: list[str], bound: int = 8) -> list[Any]:
    return [z3.And(z3.Int(n) >= 0, z3.Int(n) <= bound) for n in names]


def _steady_reachable() -> tuple[Any, Any, str]:

    safety = dict(ring_ownership_parts(RingRules(inplace="owns_only")))["in-place slot unseen"]
    m = _find(safety, _small(["c.W", "c.step"]))
    if m is None:
        return None, None, "no counterexample"
    v = _model_ints(m, ["c.W", "c.K", "c.step"])
    W, K, step = v.get("c.W", 2), v.get("c.K", 0), max(1, v.get("c.step", 1))
    cache = {"mode": "fp16", "step": step, "max_size": W, "keep": K}
    # fill the window, snapshot it, decode once: the write wraps onto the
    # oldest non-sink slot, which the snapshot still sees
    ops = [{"op": "append", "n": W}, {"op": "snapshot", "name": "s"}, {"op": "append", "n": 1}]
    return _confirm_ring_write(cache, ops, {"rotating_inplace_allowed": _steady_state_inplace}, "steady_state_inplace", v)


def _restore_reachable() -> tuple[Any, Any, str]:
    part = dict(ring_ownership_parts(RingRules(restore_marker="record")))["preserved by restore"]
    m = _find(part, _small(["c.W", "c.step"], 12))
    if m is None:
        return None, None, "no counterexample"
    v = _model_ints(m, ["c.W", "c.K", "c.step"])
    W = max(6, v.get("c.W", 6))
    cache = {"mode": "fp16", "step": 8, "max_size": W, "keep": min(v.get("c.K", 0), 1)}
    # prefill, one decode (grows: fresh buffers), snapshot, one decode in
    # place, snapshot the longer ring, restore the shorter one: with a
    # recorded marker the next decode writes the slot the longer one sees
    ops = [{"op": "append", "n": 2}, {"op": "append", "n": 1}, {"op": "snapshot", "name": "s1"},
           {"op": "append", "n": 1}, {"op": "snapshot", "name": "s2"}, {"op": "restore", "name": "s1"},
           {"op": "append", "n": 1}]
    return _confirm_ring_write(cache, ops, {"w_restore": _restore_records_marker}, "warmup_inplace_ignores_marker", v)


def _confirm_ring_write(cache: dict[str, Any], ops: list[dict[str, Any]], patches: dict[str, Any], name: str,
                        values: dict[str, int]) -> tuple[Any, Any, str]:
    from kvspec.spec import rotating as sr

    with traces.patched(sr, **patches):
        steps = traces.replay("rotating", cache, ops)
    last = steps[-1]
    before = last.before.cache
    slot = before.idx if before.idx < before.max_size else before.keep
    seers = sorted(k for k, h in last.before.holders.items()
                   if h.cache.ident == before.ident and slot < h.cache.valid_len)
    if not (last.result.inplace and seers):
        return None, values, "the spec with the buggy rule does not write in place onto a visible slot"
    correct = traces.replay("rotating", cache, ops)[-1].result.inplace
    doc = traces.kvtrace(f"negative control {name}: the last append writes slot {slot} in place while "
                                  f"{', '.join(seers)} still sees it", cache,
                                  traces.annotate("rotating", cache, ops, seers[:1]), kind="rotating")
    return doc, {**values, "slot": slot, "seen_by": seers}, (
        f"confirmed on spec with the bug: decode writes slot {slot} in place, visible to {', '.join(seers)}; "
        f"the correct rule copies (inplace={correct})")


def _order_reachable() -> tuple[Any, Any, str]:
    from kvspec.spec import rotating as sr

    part = dict(ring_parts(RingRules(order="physical")))["chronological_order lists the visible positions' slots in order"]
    m = _find(part, _small(["W", "offset"], 10))
    if m is None:
        return None, None, "no counterexample"
    v = _model_ints(m, ["W", "K", "offset", "j"])
    W, K, o = v["W"], v.get("K", 0), v["offset"]
    cache = {"mode": "fp16", "step": 4, "max_size": W, "keep": K}
    ops = [{"op": "append", "n": 1} for _ in range(o)] + [{"op": "append", "n": 2}]
    with traces.patched(sr, chronological_order=_physical_order):
        bug = traces.replay("rotating", cache, ops)[-1].after.cache.window()
    good = traces.replay("rotating", cache, ops)[-1].after.cache.window()
    if bug == good:
        return None, v, "the spec with physical order gives the same window"
    doc = traces.kvtrace("negative control prefill_physical_order", cache,
                                  traces.annotate("rotating", cache, ops, [None]), kind="rotating")
    return doc, {**v, "buggy_window": list(bug), "spec_window": list(good)}, (
        f"confirmed on spec with the bug: after {o} decodes a 2-row append returns {list(bug)}, "
        f"the spec {list(good)}")


def _ring_slot_confirm() -> tuple[Any, Any, str]:
    from kvspec.spec import rotating as sr

    part = dict(ring_parts(RingRules(ring_slot="wrap_to_zero")))[
        "ring_slot in [0, W), warm-up slot = position, non-sinks avoid sinks"]
    m = _find(part, _small(["W", "position"], 12))
    if m is None:
        return None, None, "no counterexample"
    v = _model_ints(m, ["W", "K", "position"])
    W, K, p = v["W"], v.get("K", 0), v["position"]
    bug, good = _ring_slot_wraps_to_zero(p, W, K), sr.ring_slot(p, W, K)
    ok = bug < K <= p and good >= K
    # ring_slot is the readers' index rule: no kvtrace op exercises it alone
    return None, {**v, "buggy_slot": bug, "spec_slot": good}, (
        (f"confirmed on spec: position {p} (not a sink) goes to sink slot {bug} under the bug; "
         f"ring_slot gives {good}") if ok else "model and spec disagree")


RING_CONTROLS: list[tuple[str, str, RingRules, Callable[[], tuple[Any, Any, str]], Callable[[RingRules], list[tuple[str, PartBuilder]]]]] = [
    ("steady_state_inplace", "rotating_inplace_allowed without the warm-up conditions (the flagship bug)",
     RingRules(inplace="owns_only"), _steady_reachable, ring_ownership_parts),
    ("warmup_inplace_ignores_marker", "restore records a marker for the adopted ring buffers",
     RingRules(restore_marker="record"), _restore_reachable, ring_ownership_parts),
    ("ring_slot_wraps_to_zero", "ring_slot cycles through every slot, sinks included",
     RingRules(ring_slot="wrap_to_zero"), _ring_slot_confirm, ring_parts),
    ("prefill_physical_order", "chronological_order after a wrap is the physical order",
     RingRules(order="physical"), _order_reachable, ring_parts),
]


def prove_ring() -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(ring_parts() + ring_ownership_parts())
    controls = [control_from_parts(name, rule, parts_of(rules), reachable=reach)
                for name, rule, rules, reach, parts_of in RING_CONTROLS]
    return ObligationResult(
        2, "ring slot and warm-up in place", ("ring_slot", "chronological_order", "rotating_inplace_allowed"),
        "decode writes at ring_slot(offset), evicting the oldest non-sink; chronological_order is position order; "
        "a write rotating_inplace_allowed lets through lands on a slot no holder sees",
        overall(parts, controls), parts, controls, time.perf_counter() - t0)


# ===========================================================================
# Obligation 7: the window mask


def mask_parts(rule: str = "spec") -> list[tuple[str, PartBuilder]]:
    def v(d: Domain) -> tuple[Any, Any, Any, Any]:
        return d.var("query"), d.var("key"), d.var("window"), d.var("keep")

    def only_window(d: Domain) -> tuple[list[Any], Any]:
        q, k, W, K = v(d)
        vis = mask_visible(d, q, k, W, K, rule)
        return [_shape(d, W, K), q >= 0, k >= 0], z3.Implies(vis, z3.And(k <= q, z3.Or(k < K, k > q - (W - K))))

    def whole_window(d: Domain) -> tuple[list[Any], Any]:
        q, k, W, K = v(d)
        vis = mask_visible(d, q, k, W, K, rule)
        return [_shape(d, W, K), q >= 0, k >= 0], z3.Implies(z3.And(k <= q, z3.Or(k < K, k > q - (W - K))), vis)

    def count(d: Domain) -> tuple[list[Any], Any]:
        q, _, W, K = v(d)
        sinks = d.min(K, q + 1)
        latest_from = d.max(K, q - (W - K) + 1)
        latest = d.max(0, q + 1 - latest_from)
        return [_shape(d, W, K), q >= 0], sinks + latest == d.min(q + 1, W)

    def decode_query(d: Domain) -> tuple[list[Any], Any]:
        # The query of a decode at offset o sees exactly visible_positions(o + 1).
        o, k, W, K = v(d)
        j = d.var("j")
        o1 = d.stored("offset + 1", lambda d, x: d.add(x, 1, "offset + 1"), o)
        n = visible_count(d, o1, W)
        with d.under(z3.And(j >= 0, j < n)):
            member = z3.And(j >= 0, j < n, visible_position(d, o1, W, K, j) == k)
        witness = z3.If(z3.Or(o + 1 <= W, k < K), k, k - (o + 1 - (W - K)) + K)
        vis = mask_visible(d, o, k, W, K, rule)
        with d.under(z3.And(witness >= 0, witness < n)):
            member_w = z3.And(witness >= 0, witness < n, visible_position(d, o1, W, K, witness) == k)
        return [_shape(d, W, K), o >= 0, k >= 0, k <= o], z3.And(z3.Implies(vis, member_w), z3.Implies(member, vis))

    return [("visible => causal and a sink or among the latest window - keep", only_window),
            ("every sink and every latest key is visible", whole_window),
            ("|sinks + latest| = min(query + 1, window)", count),
            ("a decode query sees exactly visible_positions(offset + 1)", decode_query)]


def _mask_reachable(name: str, rule: str, fn: Callable[[int, int, int, int], bool]) -> Callable[[], tuple[Any, Any, str]]:
    def run() -> tuple[Any, Any, str]:
        from kvspec.spec import rotating as sr

        parts = dict(mask_parts(rule))
        part = parts["visible => causal and a sink or among the latest window - keep"] if rule == "admits_extra_key" \
            else parts["every sink and every latest key is visible"]
        small = _small(["window", "query"], 10) + [z3.Int("query") >= 1]
        # prefer a key at least a whole window behind the query: it shows
        # every reading of the bug (e.g. the window applied to sinks as
        # query - key < window)
        m = _find(part, small + [z3.Int("query") - z3.Int("key") >= z3.Int("window")]) or _find(part, small)
        if m is None:
            return None, None, "no counterexample"
        val = _model_ints(m, ["query", "key", "window", "keep"])
        q, key, W, K = val["query"], val.get("key", 0), val["window"], val.get("keep", 0)
        cache = {"mode": "fp16", "step": 4, "max_size": W, "keep": K}
        # one multi-row append from empty: query q of the chunk sees key
        ops = [{"op": "append", "n": q + 1}]
        empty = sr.new_cache(W, K, 4)
        good = sr.make_mask_spec(empty, q + 1)
        with traces.patched(sr, mask_visible=fn):
            bug = sr.make_mask_spec(empty, q + 1)
        if good == bug:
            return None, val, "the buggy mask agrees with the spec's on this chunk"
        doc = traces.kvtrace(f"negative control {name}: make_mask({q + 1}) before the append differs "
                                      f"at query {q}, key {key}", cache, traces.annotate("rotating", cache, ops, [None]), kind="rotating")
        return doc, val, (f"confirmed on spec with the bug: make_mask({q + 1}) row {q} key {key} is "
                          f"{bug[q][key]}, the spec says {good[q][key]}")

    return run


MASK_CONTROLS: list[tuple[str, str, str, Callable[[int, int, int, int], bool]]] = [
    ("mask_admits_extra_key", "query - key <= window - keep: each query sees window + 1 keys",
     "admits_extra_key", _mask_admits_extra_key),
    ("mask_hides_sinks", "the mask drops key < keep: later queries lose the sinks", "hides_sinks", _mask_hides_sinks),
]


def prove_mask() -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(mask_parts())
    controls = [control_from_parts(name, text, mask_parts(rule), reachable=_mask_reachable(name, rule, fn))
                for name, text, rule, fn in MASK_CONTROLS]
    return ObligationResult(
        7, "sliding-window mask", ("mask_visible",),
        "each query sees exactly its sinks and latest window - keep keys: min(query + 1, window) keys",
        overall(parts, controls), parts, controls, time.perf_counter() - t0)


OBLIGATIONS: list[tuple[int, Callable[[], ObligationResult]]] = [(2, prove_ring), (7, prove_mask)]
