"""Encoding fidelity: every Z3 encoding in ``proofs`` agrees with the spec.

Each test builds the encoding once over Z3 variables, then for concrete
inputs drawn by Hypothesis (reachable spec states, made by random op
sequences on ``kvspec.spec.dense``) substitutes the values, simplifies, and compares
with the spec's Python function. A proof about an encoding is only worth as
much as this agreement. The bv32 domain is checked too, on values where no
stored result overflows (there it must agree exactly; wrapping is what the
bv32 run is for).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import z3
from hypothesis import assume, given
from hypothesis import strategies as st

from kvspec.proofs import dense as pd
from kvspec.proofs import dense_model as dm
from kvspec.proofs import traces
from kvspec.proofs.domain import BV32, INT, Domain, evaluate
from kvspec.spec import dense as sd
from kvspec.spec.errors import KVCacheError

# ---------------------------------------------------------------------------
# Reachable spec states

OPS = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 6)),
    st.tuples(st.just("trim"), st.integers(-2, 7)),
    st.tuples(st.just("trim_to"), st.integers(0, 12)),
    st.tuples(st.just("trim_front"), st.integers(-1, 6), st.integers(-1, 4)),
    st.tuples(st.just("gather_positions"), st.integers(1, 6)),
    st.tuples(st.just("gather_within_tail"), st.integers(1, 5), st.integers(1, 5)),
    st.tuples(st.just("snapshot"), st.integers(0, 1)),
    st.tuples(st.just("restore"), st.integers(0, 1)),
    st.tuples(st.just("detach"), st.integers(0, 1)),
    st.tuples(st.just("install"), st.integers(0, 1)),
    st.tuples(st.just("handle_trim_to"), st.integers(0, 1), st.integers(0, 10)),
    st.tuples(st.just("drop"), st.integers(0, 1)),
    st.tuples(st.just("hold")),
)
MODES = st.sampled_from([m.value for m in sd.Mode])


def _op(t: tuple[Any, ...], world: sd.DenseWorld) -> dict[str, Any]:
    kind = t[0]
    if kind == "append":
        return {"op": "append", "n": t[1]}
    if kind in ("trim",):
        return {"op": "trim", "n": t[1]}
    if kind == "trim_to":
        return {"op": "trim_to", "len": t[1]}
    if kind == "trim_front":
        return {"op": "trim_front", "n": t[1], "keep": t[2]}
    if kind == "gather_positions":
        return {"op": "gather_positions", "positions": list(range(t[1]))}
    if kind == "gather_within_tail":
        return {"op": "gather_within_tail", "tail": t[1], "kept": list(range(t[2]))}
    if kind in ("snapshot", "restore", "drop"):
        return {"op": kind, "name": f"s{t[1]}"}
    if kind in ("detach", "install"):
        return {"op": kind, "name": f"h{t[1]}"}
    if kind == "handle_trim_to":
        return {"op": "handle_trim_to", "name": f"h{t[1]}", "len": t[2]}
    return {"op": kind}


@st.composite
def worlds(draw: Any) -> sd.DenseWorld:
    world = sd.new_world(draw(MODES), draw(st.integers(1, 5)), draw(st.booleans()))
    for t in draw(st.lists(OPS, max_size=12)):
        try:
            _, world = traces.apply("dense", world, _op(t, world))
        except KVCacheError:
            pass
    return world


# ---------------------------------------------------------------------------
# Concrete values <-> Z3 terms


def _array(values: list[int]) -> Any:
    a = z3.K(z3.IntSort(), z3.IntVal(-99))
    for i, v in enumerate(values):
        a = z3.Store(a, i, v)
    return a


def cache_subs(c: dm.CacheS, cache: sd.DenseCache) -> dict[Any, Any]:
    subs = {
        c.mode: z3.IntVal(dm.mode_code(cache.mode)), c.sw: z3.BoolVal(cache.inplace),
        c.step: z3.IntVal(cache.step), c.off: z3.IntVal(cache.offset), c.ls: z3.IntVal(cache.live_start),
        c.has_buf: z3.BoolVal(cache.buffer is not None),
        c.buf: z3.IntVal(cache.buffer.ident if cache.buffer else 0), c.cap: z3.IntVal(cache.capacity),
        c.mk: z3.BoolVal(cache.marker is not None),
        c.mkb: z3.IntVal(cache.marker.buffer if cache.marker else 0),
        c.mkl: z3.IntVal(cache.marker.live_len if cache.marker else 0), c.nid: z3.IntVal(cache.next_ident),
    }
    if c.tok is not None:
        subs[c.tok] = _array([e.token for e in cache.entries])
        subs[c.pos] = _array([e.position for e in cache.entries])
        subs[c.wlen] = z3.IntVal(len(cache.entries))
    return subs


def holder_subs(h: dm.HolderS, holder: sd.Holder | None) -> dict[Any, Any]:
    if holder is None:
        return {h.alive: z3.BoolVal(False), h.has_buf: z3.BoolVal(False), h.buf: z3.IntVal(0),
                h.cap: z3.IntVal(0), h.off: z3.IntVal(0), h.ls: z3.IntVal(0)}
    return {h.alive: z3.BoolVal(True), h.has_buf: z3.BoolVal(holder.buffer is not None),
            h.buf: z3.IntVal(holder.buffer.ident if holder.buffer else 0),
            h.cap: z3.IntVal(holder.buffer.capacity if holder.buffer else 0),
            h.off: z3.IntVal(holder.offset), h.ls: z3.IntVal(holder.live_start)}


def read_cache(c: dm.CacheS, subs: dict[Any, Any], dom: Domain) -> dict[str, Any]:
    ev = lambda x: evaluate(x, subs, dom)
    out = {"offset": ev(c.off), "live_start": ev(c.ls), "has_buf": ev(c.has_buf), "marker": ev(c.mk),
           "next_ident": ev(c.nid)}
    if out["has_buf"]:
        out.update(buf=ev(c.buf), cap=ev(c.cap))
    if out["marker"]:
        out.update(marker_buf=ev(c.mkb), marker_len=ev(c.mkl))
    if c.tok is not None:
        n = ev(c.wlen)
        out["entries"] = tuple((ev(c.pos[i]), ev(c.tok[i])) for i in range(n))
    return out


def spec_cache(cache: sd.DenseCache, window: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"offset": cache.offset, "live_start": cache.live_start,
                           "has_buf": cache.buffer is not None, "marker": cache.marker is not None,
                           "next_ident": cache.next_ident}
    if cache.buffer is not None:
        out.update(buf=cache.buffer.ident, cap=cache.capacity)
    if cache.marker is not None:
        out.update(marker_buf=cache.marker.buffer, marker_len=cache.marker.live_len)
    if window:
        out["entries"] = tuple((e.position, e.token) for e in cache.entries)
    return out


def read_holder(h: dm.HolderS, subs: dict[Any, Any], dom: Domain) -> dict[str, Any]:
    ev = lambda x: evaluate(x, subs, dom)
    out = {"has_buf": ev(h.has_buf), "offset": ev(h.off), "live_start": ev(h.ls)}
    if out["has_buf"]:
        out.update(buf=ev(h.buf), cap=ev(h.cap))
    return out


def spec_holder(holder: sd.Holder) -> dict[str, Any]:
    out: dict[str, Any] = {"has_buf": holder.buffer is not None, "offset": holder.offset,
                           "live_start": holder.live_start}
    if holder.buffer is not None:
        out.update(buf=holder.buffer.ident, cap=holder.buffer.capacity)
    return out


class Enc:
    """One encoding built over fresh variables in a domain."""

    def __init__(self, kind: str, window: bool = False):
        self.d = Domain(kind)
        self.c = dm.cache_vars(self.d, "c.", window=window)
        self.h = dm.holder_vars(self.d, "h.")
        self.x, self.y = self.d.var("x"), self.d.var("y")
        self.tokens = self.d.array("tokens")


# ---------------------------------------------------------------------------
# Index rules


@pytest.mark.parametrize("kind", [INT, BV32])
@given(prev=st.integers(0, 10**6), n=st.integers(1, 10**6), step=st.integers(1, 300))
def test_regrow_capacity_and_needed(kind: str, prev: int, n: int, step: int) -> None:
    d = Domain(kind)
    p, nv, s, cap = d.var("prev"), d.var("n"), d.var("step"), d.var("cap")
    has = z3.Bool("has")
    subs = {p: z3.IntVal(prev), nv: z3.IntVal(n), s: z3.IntVal(step)}
    assert evaluate(dm.regrow_capacity(d, p, nv, s), subs, d) == sd.regrow_capacity(prev, n, step)
    for c in (prev, prev + n - 1, prev + n, prev + n + 3):
        for hb in (True, False):
            sub2 = {**subs, cap: z3.IntVal(c), has: z3.BoolVal(hb)}
            assert evaluate(dm.regrow_needed(d, has, p, cap, nv), sub2, d) == sd.regrow_needed(hb, prev, c, n)


@given(prev=st.integers(0, 10**6), n=st.integers(1, 10**6), step=st.integers(1, 300))
def test_ceil_by_add_equals_the_rule_over_unbounded_ints(prev: int, n: int, step: int) -> None:
    # The bv32-only negative control is a correct formula in Python: only
    # its 32-bit overflow is wrong.
    d = Domain(INT)
    p, nv, s = d.var("prev"), d.var("n"), d.var("step")
    subs = {p: z3.IntVal(prev), nv: z3.IntVal(n), s: z3.IntVal(step)}
    assert evaluate(dm.regrow_capacity(d, p, nv, s, "ceil_by_add"), subs) == sd.regrow_capacity(prev, n, step)


def test_bv32_wraps_like_a_32_bit_port() -> None:
    d = Domain(BV32)
    a, b = d.var("a"), d.var("b")
    s = d.add(a, b)
    assert evaluate(s, {a: z3.IntVal(2**31 - 1), b: z3.IntVal(1)}, d) == -(2**31)
    q = d.floordiv(a, b)
    assert evaluate(q, {a: z3.IntVal(-7), b: z3.IntVal(2)}, d) == -4  # Python floor, not truncation


@given(world=worlds(), n=st.integers(0, 3))
def test_inplace_write_allowed(world: sd.DenseWorld, n: int) -> None:
    for rule, fn in (("spec", sd.inplace_write_allowed),):
        e = Enc(INT)
        expr = dm.inplace_write_allowed(e.d, e.c, e.x, rule)
        subs = {**cache_subs(e.c, world.cache), e.x: z3.IntVal(n)}
        assert evaluate(expr, subs) == fn(world.cache, n)


@given(world=worlds(), n=st.integers(0, 3))
def test_buggy_inplace_rules_match_their_python(world: sd.DenseWorld, n: int) -> None:
    from kvspec.proofs import dense_controls as buggy

    for rule, fn in (("no_length_check", buggy.inplace_no_length_check),
                     ("no_identity_check", buggy.inplace_no_identity_check)):
        e = Enc(INT)
        subs = {**cache_subs(e.c, world.cache), e.x: z3.IntVal(n)}
        assert evaluate(dm.inplace_write_allowed(e.d, e.c, e.x, rule), subs) == fn(world.cache, n)


# ---------------------------------------------------------------------------
# Operations


@pytest.mark.parametrize("kind", [INT, BV32])
@given(world=worlds(), n=st.integers(1, 5))
def test_append(kind: str, world: sd.DenseWorld, n: int) -> None:
    e = Enc(kind, window=True)
    out, c1 = dm.append(e.d, e.c, e.x, e.tokens)
    tokens = tuple(range(100, 100 + n))
    result, after = sd.append(world.cache, tokens)
    subs = {**cache_subs(e.c, world.cache), e.x: z3.IntVal(n), e.tokens: _array(list(tokens))}
    assert read_cache(c1, subs, e.d) == spec_cache(after, window=True)
    assert evaluate(out.inplace, subs, e.d) == result.inplace
    assert evaluate(out.regrew, subs, e.d) == result.regrew


@pytest.mark.parametrize("kind", [INT, BV32])
@given(world=worlds(), n=st.integers(-3, 9))
def test_trim(kind: str, world: sd.DenseWorld, n: int) -> None:
    e = Enc(kind, window=True)
    k, c1 = dm.trim(e.d, e.c, e.x)
    removed, after = sd.trim(world.cache, n)
    subs = {**cache_subs(e.c, world.cache), e.x: z3.IntVal(n)}
    assert evaluate(k, subs, e.d) == removed
    assert read_cache(c1, subs, e.d) == spec_cache(after, window=True)


@given(world=worlds(), length=st.integers(-2, 12))
def test_trim_to(world: sd.DenseWorld, length: int) -> None:
    e = Enc(INT)
    ok, k, c1 = dm.trim_to(e.d, e.c, e.x)
    subs = {**cache_subs(e.c, world.cache), e.x: z3.IntVal(length)}
    try:
        removed, after = sd.trim_to(world.cache, length)
    except KVCacheError:
        assert evaluate(ok, subs) is False
        return
    assert evaluate(ok, subs) is True
    assert evaluate(k, subs) == removed
    assert read_cache(c1, subs, e.d) == spec_cache(after)


@pytest.mark.parametrize("kind", [INT, BV32])
@given(world=worlds(), n=st.integers(-2, 8), keep=st.integers(-2, 6))
def test_trim_front_keep_sink(kind: str, world: sd.DenseWorld, n: int, keep: int) -> None:
    e = Enc(kind, window=True)
    k, c1 = dm.trim_front_keep_sink(e.d, e.c, e.x, e.y)
    removed, after = sd.trim_front_keep_sink(world.cache, n, keep)
    subs = {**cache_subs(e.c, world.cache), e.x: z3.IntVal(n), e.y: z3.IntVal(keep)}
    assert evaluate(k, subs, e.d) == removed
    assert read_cache(c1, subs, e.d) == spec_cache(after, window=True)
    assert evaluate(dm.front_keep(e.d, e.c, e.x, e.y), subs, e.d) == max(0, min(keep, world.cache.live_len - removed)) or removed == 0


def test_trim_front_keep_sink_small_box() -> None:
    """Exhaustive over a small box (the drawn worlds above rarely clamp
    ``keep`` at ``live_len - n``): caches of 0 to 5 rows, some front-trimmed
    before, every n and keep from -1 to 6, in Fp16 and Int8."""
    e = Enc(INT, window=True)
    k, c1 = dm.trim_front_keep_sink(e.d, e.c, e.x, e.y)
    for mode, rows, pre in itertools.product(("fp16", "int8"), range(6), range(3)):
        world = sd.new_world(mode, 2, True)
        if rows:
            _, world = sd.apply_op(world, {"op": "append", "n": rows})
        _, world = sd.apply_op(world, {"op": "trim_front", "n": pre, "keep": 1})
        for n, keep in itertools.product(range(-1, 7), repeat=2):
            removed, after = sd.trim_front_keep_sink(world.cache, n, keep)
            subs = {**cache_subs(e.c, world.cache), e.x: z3.IntVal(n), e.y: z3.IntVal(keep)}
            assert evaluate(k, subs, e.d) == removed, (mode, rows, pre, n, keep)
            assert read_cache(c1, subs, e.d) == spec_cache(after, window=True), (mode, rows, pre, n, keep)


@given(world=worlds(), n=st.integers(-2, 8), keep=st.integers(-2, 6),
       rule=st.sampled_from(["decreases_offset", "keep_unclamped"]))
def test_buggy_front_trims_match_their_python(world: sd.DenseWorld, n: int, keep: int, rule: str) -> None:
    from kvspec.proofs import dense_controls as buggy

    e = Enc(INT, window=True)
    _, c1 = dm.trim_front_keep_sink(e.d, e.c, e.x, e.y, dm.Rules(front=rule))
    fn = buggy.front_decreases_offset if rule == "decreases_offset" else buggy.front_keep_unclamped
    _, after = fn(world.cache, n, keep)
    subs = {**cache_subs(e.c, world.cache), e.x: z3.IntVal(n), e.y: z3.IntVal(keep)}
    assert read_cache(c1, subs, e.d) == spec_cache(after, window=True)


@given(world=worlds(), n=st.integers(-2, 8), rule=st.sampled_from(["forgets_offset", "keeps_rows"]))
def test_buggy_trims_match_their_python(world: sd.DenseWorld, n: int, rule: str) -> None:
    from kvspec.proofs import dense_controls as buggy

    e = Enc(INT, window=True)
    _, c1 = dm.trim(e.d, e.c, e.x, dm.Rules(trim=rule))
    fn = buggy.trim_forgets_offset if rule == "forgets_offset" else buggy.trim_keeps_rows
    _, after = fn(world.cache, n)
    subs = {**cache_subs(e.c, world.cache), e.x: z3.IntVal(n)}
    assert read_cache(c1, subs, e.d) == spec_cache(after, window=True)


@given(world=worlds(), p=st.integers(0, 8))
def test_gather_positions_by_length(world: sd.DenseWorld, p: int) -> None:
    e = Enc(INT)
    ok, c1 = dm.gather_positions(e.d, e.c, e.x)
    subs = {**cache_subs(e.c, world.cache), e.x: z3.IntVal(p)}
    try:
        _, after = sd.gather_positions(world.cache, tuple(range(p)))
    except KVCacheError:
        assert evaluate(ok, subs) is False
        return
    assert evaluate(ok, subs) is True
    assert read_cache(c1, subs, e.d) == spec_cache(after)


@given(world=worlds(), tail=st.integers(-1, 7), q=st.integers(0, 7), data=st.data())
def test_gather_within_tail_by_lengths(world: sd.DenseWorld, tail: int, q: int, data: Any) -> None:
    e = Enc(INT)
    ok, c1 = dm.gather_within_tail(e.d, e.c, e.x, e.y)
    subs = {**cache_subs(e.c, world.cache), e.x: z3.IntVal(tail), e.y: z3.IntVal(q)}
    # any strictly increasing list of length q in [0, tail) gives the same state
    kept = tuple(sorted(data.draw(st.sets(st.integers(0, max(tail - 1, 0)), min_size=min(q, max(tail, 0)),
                                           max_size=min(q, max(tail, 0))))))
    assume(len(kept) == q or q == 0)
    try:
        _, after = sd.gather_within_tail(world.cache, tail, kept)
    except KVCacheError:
        assert evaluate(ok, subs) is False
        return
    assert evaluate(ok, subs) is True
    assert read_cache(c1, subs, e.d) == spec_cache(after)


# ---------------------------------------------------------------------------
# Holders


@given(world=worlds())
def test_holder_of_adopt_detach_is_empty(world: sd.DenseWorld) -> None:
    e = Enc(INT)
    subs = cache_subs(e.c, world.cache)
    holder = sd.holder_of(world.cache, "snapshot")
    assert read_holder(dm.holder_of(e.d, e.c), subs, e.d) == spec_holder(holder)
    assert evaluate(dm.is_empty(e.d, e.c), subs) == sd.is_empty(world.cache)
    handle, c1 = dm.detach(e.d, e.c)
    _, w1 = sd.w_detach(world, "__fidelity__")
    assert read_cache(c1, subs, e.d) == spec_cache(w1.cache)
    assert read_holder(handle, subs, e.d) == spec_holder(w1.holders["__fidelity__"])
    for snap in world.holders.values():
        hs = {**subs, **holder_subs(e.h, snap)}
        for rule, fn in (("none", sd.adopt),):
            assert read_cache(dm.adopt(e.d, e.c, e.h, dm.Rules(restore_marker=rule)), hs, e.d) == spec_cache(fn(world.cache, snap))


@given(world=worlds())
def test_buggy_adopts_match_their_python(world: sd.DenseWorld) -> None:
    from kvspec.proofs import dense_controls as buggy

    e = Enc(INT)
    for snap in world.holders.values():
        hs = {**cache_subs(e.c, world.cache), **holder_subs(e.h, snap)}
        for rule, fn in (("keep", buggy.adopt_keeps_marker), ("record", buggy.adopt_records_marker)):
            assert read_cache(dm.adopt(e.d, e.c, e.h, dm.Rules(restore_marker=rule)), hs, e.d) == spec_cache(fn(world.cache, snap))


@pytest.mark.parametrize("kind", [INT, BV32])
@given(world=worlds(), length=st.integers(-1, 12))
def test_handle_trim_to(kind: str, world: sd.DenseWorld, length: int) -> None:
    handles = [h for h in world.holders.values() if h.kind == "handle"]
    assume(handles)
    e = Enc(kind)
    ok, k, h1 = dm.handle_trim_to(e.d, e.h, e.x)
    for handle in handles:
        subs = {**holder_subs(e.h, handle), e.x: z3.IntVal(length)}
        try:
            removed, after = sd.handle_trim_to(handle, length)
        except KVCacheError:
            assert evaluate(ok, subs, e.d) is False
            continue
        assert evaluate(ok, subs, e.d) is True
        assert evaluate(k, subs, e.d) == removed
        assert read_holder(h1, subs, e.d) == spec_holder(after)


# ---------------------------------------------------------------------------
# The ownership invariant holds on reachable states; the physical model of
# obligation 3 agrees with the spec's window.


@given(world=worlds())
def test_ownership_invariant_holds_on_reachable_states(world: sd.DenseWorld) -> None:
    e = Enc(INT)
    inv = pd.invariant(e.d, e.c, e.h)
    holders = [*world.holders.values(), world.held, world.returned]
    for holder in holders:
        subs = {**cache_subs(e.c, world.cache), **holder_subs(e.h, holder)}
        assert evaluate(inv, subs) is True


@given(world=worlds(), n=st.integers(1, 6), junk=st.integers(200, 300))
def test_physical_append_rows_below_live_len_are_the_window(world: sd.DenseWorld, n: int, junk: int) -> None:
    cache = world.cache
    e = Enc(INT, window=True)
    ptok, ppos = e.d.array("ptok"), e.d.array("ppos")
    p1 = pd.physical_append(e.d, e.c, pd.Phys(ptok, ppos), e.x, e.tokens)
    cap = cache.capacity
    # a buffer consistent with the window, stale junk in the dead rows
    rows = [e_.token for e_ in cache.entries] + [junk + i for i in range(cap - cache.live_len)]
    poss = [e_.position for e_ in cache.entries] + [-5] * (cap - cache.live_len)
    tokens = tuple(range(100, 100 + n))
    _, after = sd.append(cache, tokens)
    subs = {**cache_subs(e.c, cache), e.x: z3.IntVal(n), e.tokens: _array(list(tokens)),
            ptok: _array(rows), ppos: _array(poss)}
    got = [(evaluate(p1.pos[i], subs), evaluate(p1.tok[i], subs)) for i in range(after.live_len)]
    assert got == [(x.position, x.token) for x in after.entries]
