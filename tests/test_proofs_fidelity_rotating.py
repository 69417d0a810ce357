"""Encoding fidelity for the sliding-window proofs: every function of
``kvspec.proofs.rotating_model`` agrees with ``kvspec.spec.rotating`` on concrete values
(substitute + simplify), on reachable ring states drawn by Hypothesis."""

from __future__ import annotations

from typing import Any

import pytest
import z3
from hypothesis import given
from hypothesis import strategies as st

from kvspec.proofs import rotating as pr
from kvspec.proofs import rotating_model as rm
from kvspec.proofs import traces
from kvspec.proofs.dense_model import mode_code
from kvspec.proofs.domain import BV32, INT, Domain, evaluate
from kvspec.spec.errors import KVCacheError

sr = pytest.importorskip("kvspec.spec.rotating")

SHAPES = st.integers(1, 7).flatmap(lambda w: st.tuples(st.just(w), st.integers(0, w - 1)))


@st.composite
def rings(draw: Any) -> Any:
    W, K = draw(SHAPES)
    cache = {"max_size": W, "keep": K, "step": draw(st.integers(1, 4)), "inplace": draw(st.booleans()),
             "mode": draw(st.sampled_from(["fp16", "int8"]))}
    world = sr.RotatingWorld(sr.new_cache(W, K, cache["step"], cache["inplace"], cache["mode"]))
    ops = draw(st.lists(st.one_of(
        st.builds(lambda n: {"op": "append", "n": n}, st.integers(1, 5)),
        st.builds(lambda n: {"op": "append", "n": 1}, st.integers(0, 1)),
        st.builds(lambda n: {"op": "trim", "n": n}, st.integers(-1, 4)),
        st.builds(lambda i: {"op": "snapshot", "name": f"s{i}"}, st.integers(0, 1)),
        st.builds(lambda i: {"op": "restore", "name": f"s{i}"}, st.integers(0, 1)),
    ), max_size=14))
    for op in ops:
        try:
            _, world = traces.apply("rotating", world, op)
        except KVCacheError:  # refusals (unknown names, fresh names in use)
            continue
    return world


def ring_subs(c: rm.RingS, cache: Any) -> dict[Any, Any]:
    return {
        c.W: z3.IntVal(cache.max_size), c.K: z3.IntVal(cache.keep), c.step: z3.IntVal(cache.step),
        c.mode: z3.IntVal(mode_code(cache.mode)), c.sw: z3.BoolVal(cache.inplace), c.cap: z3.IntVal(cache.capacity),
        c.off: z3.IntVal(cache.offset), c.idx: z3.IntVal(cache.idx), c.has: z3.BoolVal(cache.ident is not None),
        c.ident: z3.IntVal(cache.ident if cache.ident is not None else 0), c.mk: z3.BoolVal(cache.marker is not None),
        c.mkb: z3.IntVal(cache.marker.buffer if cache.marker else 0),
        c.mki: z3.IntVal(cache.marker.idx if cache.marker else 0), c.nid: z3.IntVal(cache.next_ident),
    }


def holder_subs(h: rm.RingHolderS, cache: Any | None) -> dict[Any, Any]:
    if cache is None:
        return {h.alive: z3.BoolVal(False), h.has: z3.BoolVal(False), h.ident: z3.IntVal(0), h.cap: z3.IntVal(0),
                h.off: z3.IntVal(0), h.idx: z3.IntVal(0)}
    return {h.alive: z3.BoolVal(True), h.has: z3.BoolVal(cache.ident is not None),
            h.ident: z3.IntVal(cache.ident if cache.ident is not None else 0), h.cap: z3.IntVal(cache.capacity),
            h.off: z3.IntVal(cache.offset), h.idx: z3.IntVal(cache.idx)}


def read_ring(c: rm.RingS, subs: dict[Any, Any], d: Domain) -> dict[str, Any]:
    ev = lambda x: evaluate(x, subs, d)
    out = {"cap": ev(c.cap), "offset": ev(c.off), "idx": ev(c.idx), "has": ev(c.has), "marker": ev(c.mk),
           "next_ident": ev(c.nid)}
    if out["has"]:
        out["ident"] = ev(c.ident)
    if out["marker"]:
        out.update(marker_buf=ev(c.mkb), marker_idx=ev(c.mki))
    return out


def spec_ring(cache: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"cap": cache.capacity, "offset": cache.offset, "idx": cache.idx,
                           "has": cache.ident is not None, "marker": cache.marker is not None,
                           "next_ident": cache.next_ident}
    if cache.ident is not None:
        out["ident"] = cache.ident
    if cache.marker is not None:
        out.update(marker_buf=cache.marker.buffer, marker_idx=cache.marker.idx)
    return out


# ---------------------------------------------------------------------------
# Index rules


@pytest.mark.parametrize("kind", [INT, BV32])
@given(shape=SHAPES, position=st.integers(0, 40))
def test_ring_slot(kind: str, shape: tuple[int, int], position: int) -> None:
    W, K = shape
    d = Domain(kind)
    p, w, k = d.var("p"), d.var("w"), d.var("k")
    subs = {p: z3.IntVal(position), w: z3.IntVal(W), k: z3.IntVal(K)}
    assert evaluate(rm.ring_slot(d, p, w, k), subs, d) == sr.ring_slot(position, W, K)
    assert evaluate(rm.ring_slot(d, p, w, k, "wrap_to_zero"), subs, d) == pr._ring_slot_wraps_to_zero(position, W, K)


@given(shape=SHAPES, offset=st.integers(0, 30))
def test_visible_positions(shape: tuple[int, int], offset: int) -> None:
    W, K = shape
    d = Domain(INT)
    o, w, k, j = d.var("o"), d.var("w"), d.var("k"), d.var("j")
    want = sr.visible_positions(offset, W, K)
    base = {o: z3.IntVal(offset), w: z3.IntVal(W), k: z3.IntVal(K)}
    assert evaluate(rm.visible_count(d, o, w), base) == len(want)
    expr = rm.visible_position(d, o, w, k, j)
    assert [evaluate(expr, {**base, j: z3.IntVal(i)}) for i in range(len(want))] == list(want)


@given(data=st.data())
def test_chronological_order(data: Any) -> None:
    n_slots = data.draw(st.integers(1, 9))
    idx = data.draw(st.integers(0, n_slots))
    keep = data.draw(st.integers(0, idx))
    wrapped = data.draw(st.booleans())
    d = Domain(INT)
    n, i, k, j = d.var("n"), d.var("i"), d.var("k"), d.var("j")
    wr = z3.Bool("wrapped")
    base = {n: z3.IntVal(n_slots), i: z3.IntVal(idx), k: z3.IntVal(keep), wr: z3.BoolVal(wrapped)}
    want = sr.chronological_order(n_slots, idx, keep, wrapped)
    assert evaluate(rm.chronological_len(d, n, i, wr), base) == len(want)
    for rule, fn in (("spec", sr.chronological_order), ("physical", pr._physical_order)):
        expr = rm.chronological_slot(d, n, i, k, wr, j, rule)
        want = fn(n_slots, idx, keep, wrapped)
        assert [evaluate(expr, {**base, j: z3.IntVal(x)}) for x in range(len(want))] == list(want)


@pytest.mark.parametrize("kind", [INT, BV32])
@given(shape=SHAPES, query=st.integers(0, 20), key=st.integers(-2, 22))
def test_mask_visible(kind: str, shape: tuple[int, int], query: int, key: int) -> None:
    W, K = shape
    d = Domain(kind)
    q, k_, w, kp = d.var("q"), d.var("key"), d.var("w"), d.var("kp")
    subs = {q: z3.IntVal(query), k_: z3.IntVal(key), w: z3.IntVal(W), kp: z3.IntVal(K)}
    for rule, fn in (("spec", sr.mask_visible), ("admits_extra_key", pr._mask_admits_extra_key),
                     ("hides_sinks", pr._mask_hides_sinks)):
        assert evaluate(rm.mask_visible(d, q, k_, w, kp, rule), subs, d) == fn(query, key, W, K)


@given(shape=SHAPES, steps=st.integers(0, 25))
def test_cursor_is_where_decode_only_rings_stand(shape: tuple[int, int], steps: int) -> None:
    W, K = shape
    cache = sr.new_cache(W, K, step=2)
    for t in range(steps):
        _, cache = sr.decode(cache, t)
    d = Domain(INT)
    o, w, k = d.var("o"), d.var("w"), d.var("k")
    assert evaluate(pr.cursor(d, o, w, k), {o: z3.IntVal(steps), w: z3.IntVal(W), k: z3.IntVal(K)}) == cache.idx
    # and every visible position sits at its ring_slot
    for pos in sr.visible_positions(steps, W, K):
        assert cache.slots[sr.ring_slot(pos, W, K)].position == pos


# ---------------------------------------------------------------------------
# Counters of the operations


class Enc:
    def __init__(self, kind: str):
        self.d = Domain(kind)
        self.c = rm.ring_vars(self.d, "c.")
        self.h = rm.ring_holder_vars(self.d, "h.")
        self.n = self.d.var("n")


@given(world=rings())
def test_rotating_inplace_allowed(world: Any) -> None:
    e = Enc(INT)
    subs = ring_subs(e.c, world.cache)
    assert evaluate(rm.rotating_inplace_allowed(e.d, e.c), subs) == sr.rotating_inplace_allowed(world.cache)
    assert evaluate(rm.rotating_inplace_allowed(e.d, e.c, "owns_only"), subs) == pr._steady_state_inplace(world.cache)


@pytest.mark.parametrize("kind", [INT, BV32])
@given(world=rings())
def test_decode(kind: str, world: Any) -> None:
    e = Enc(kind)
    out, c1 = rm.decode(e.d, e.c)
    result, after = sr.decode(world.cache, 999)
    subs = ring_subs(e.c, world.cache)
    assert read_ring(c1, subs, e.d) == spec_ring(after)
    assert evaluate(out.inplace, subs, e.d) == result.inplace
    slot = evaluate(out.slot, subs, e.d)
    assert after.slots[slot].token == 999


@pytest.mark.parametrize("kind", [INT, BV32])
@given(world=rings(), n=st.integers(2, 6))
def test_prefill(kind: str, world: Any, n: int) -> None:
    e = Enc(kind)
    c1 = rm.prefill(e.d, e.c, e.n)
    _, after = sr.prefill(world.cache, tuple(range(n)))
    subs = {**ring_subs(e.c, world.cache), e.n: z3.IntVal(n)}
    assert read_ring(c1, subs, e.d) == spec_ring(after)


@given(world=rings(), n=st.integers(-2, 8))
def test_trim(world: Any, n: int) -> None:
    e = Enc(INT)
    k, c1 = rm.trim(e.d, e.c, e.n)
    removed, after = sr.trim(world.cache, n)
    subs = {**ring_subs(e.c, world.cache), e.n: z3.IntVal(n)}
    assert evaluate(k, subs) == removed
    assert evaluate(rm.is_trimmable(e.d, e.c), subs) == sr.is_trimmable(world.cache)
    assert read_ring(c1, subs, e.d) == spec_ring(after)


@given(world=rings())
def test_restore_and_holders(world: Any) -> None:
    e = Enc(INT)
    for name, snap in world.holders.items():
        subs = {**ring_subs(e.c, world.cache), **holder_subs(e.h, snap.cache)}
        _, w1 = sr.w_restore(world, name)
        assert read_ring(rm.restore(e.d, e.c, e.h), subs, e.d) == spec_ring(w1.cache)
        _, w2 = pr._restore_records_marker(world, name)
        assert read_ring(rm.restore(e.d, e.c, e.h, rm.RingRules(restore_marker="record")), subs, e.d) == spec_ring(w2.cache)
        assert evaluate(rm.valid_len(e.h), subs) == snap.cache.valid_len


@given(world=rings())
def test_ring_invariant_holds_on_reachable_states(world: Any) -> None:
    e = Enc(INT)
    inv = pr.ring_invariant(e.d, e.c, e.h)
    holders = [s.cache for s in world.holders.values()] + [None]
    for h in holders:
        assert evaluate(inv, {**ring_subs(e.c, world.cache), **holder_subs(e.h, h)}) is True
    # the window the cache itself returned last shares its buffers too
    assert evaluate(inv, {**ring_subs(e.c, world.cache), **holder_subs(e.h, world.cache)}) is True
