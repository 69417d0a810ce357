"""Encoding fidelity for obligation 6: every function of
``kvspec.proofs.paged_model`` agrees with ``kvspec.spec.paged`` on concrete values
(substitute + simplify): the index rules on integers, and each operation's
block view (refcount, free, holders, the actor's and another sequence's
length, start and table index) on reachable worlds drawn by Hypothesis, for
every block and every pair of sequences."""

from __future__ import annotations

from typing import Any

import z3
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.proofs import paged_model as pm
from kvspec.proofs.domain import INT, Domain, evaluate
from kvspec.spec import paged as sp
from kvspec.spec.errors import KVCacheError

NAMES = ("main", "a", "b")
OPS = st.one_of(
    st.builds(lambda n, s: {"op": "append", "n": n, "seq": s}, st.integers(1, 5), st.sampled_from(NAMES)),
    st.builds(lambda n, s: {"op": "trim", "n": n, "seq": s}, st.integers(-1, 5), st.sampled_from(NAMES)),
    st.builds(lambda n, s: {"op": "trim_front", "n": n, "seq": s}, st.integers(-1, 5), st.sampled_from(NAMES)),
    st.builds(lambda f, a: {"op": "fork", "from": f, "as": a}, st.sampled_from(NAMES), st.sampled_from(NAMES)),
    st.builds(lambda s: {"op": "release", "seq": s}, st.sampled_from(NAMES)),
)


@st.composite
def worlds(draw: Any) -> sp.PagedWorld:
    bs = draw(st.integers(1, 4))
    world = sp.new_world(bs, chunk=draw(st.integers(1, 3)))
    for op in [{"op": "append", "n": draw(st.integers(1, 6))}, {"op": "fork", "from": "main", "as": "a"},
               *draw(st.lists(OPS, max_size=12))]:
        try:
            _, world = sp.apply_op(world, op)
        except KVCacheError:
            continue
    return world


def seq_values(world: sp.PagedWorld, name: str, x: int) -> dict[str, Any]:
    s = world.seqs.get(name)
    if s is None:
        return {"alive": False, "len": 0, "start": 0, "pos": -1}
    pos = s.table.index(x) if x in s.table else -1
    return {"alive": True, "len": s.length, "start": s.start, "pos": pos}


def view_values(world: sp.PagedWorld, x: int, s: str, u: str) -> dict[str, Any]:
    pool = world.pool
    rc = pool.refcounts[x] if x < pool.size else 0
    free = x in pool.free or x >= pool.size  # a block the pool will grow is free
    holders = sum(1 for q in world.seqs.values() if x in q.table)
    return {"block_size": pool.block_size, "N": len(world.seqs), "rc": rc, "free": free, "holders": holders,
            "s": seq_values(world, s, x), "u": seq_values(world, u, x)}


def subs_of(v: pm.BlockV, values: dict[str, Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {v.bs: z3.IntVal(values["block_size"]), v.N: z3.IntVal(values["N"]),
                           v.rc: z3.IntVal(values["rc"]), v.free: z3.BoolVal(values["free"]),
                           v.holders: z3.IntVal(values["holders"])}
    for sv, key in ((v.s, "s"), (v.u, "u")):
        q = values[key]
        out.update({sv.alive: z3.BoolVal(q["alive"]), sv.L: z3.IntVal(q["len"]), sv.S: z3.IntVal(q["start"]),
                    sv.pos: z3.IntVal(q["pos"])})
    return out


def read(v: pm.BlockV, subs: dict[Any, Any], live: tuple[bool, bool]) -> dict[str, Any]:
    ev = lambda e: evaluate(e, subs)
    out: dict[str, Any] = {"block_size": ev(v.bs), "N": ev(v.N), "rc": ev(v.rc), "free": ev(v.free),
                           "holders": ev(v.holders)}
    for sv, key, alive in ((v.s, "s", live[0]), (v.u, "u", live[1])):
        q = {"alive": ev(sv.alive), "pos": ev(sv.pos)}
        # a dead sequence's length and start are not part of the state
        q.update({"len": ev(sv.L), "start": ev(sv.S)} if alive else {"len": 0, "start": 0})
        out[key] = q
    return out


def blocks_and_pairs(world: sp.PagedWorld, actor: str) -> list[tuple[int, str]]:
    return [(x, u) for x in range(world.pool.size + 1) for u in NAMES if u != actor]


@settings(max_examples=60, deadline=None)
@given(p=st.integers(0, 40), q=st.integers(0, 40), start=st.integers(0, 40), bs=st.integers(1, 5))
def test_index_rules_agree(p: int, q: int, start: int, bs: int) -> None:
    d = Domain(INT)
    P, S, B = z3.IntVal(p), z3.IntVal(start), z3.IntVal(bs)
    assert evaluate(pm.block_index(d, P, B), {}) == sp.block_index(p, bs)
    assert evaluate(pm.block_slot(d, P, B), {}) == sp.block_slot(p, bs)
    assert evaluate(pm.table_len(d, P, B), {}) == sp.table_len(p, bs)
    assert evaluate(pm.wholly_before(d, z3.IntVal(q), S, B), {}) == sp.wholly_before(q, start, bs)
    assert evaluate(pm.needs_copy_on_write(z3.IntVal(q)), {}) == sp.needs_copy_on_write(q)
    for sw in (True, False):
        got = evaluate(pm.write_in_place(z3.BoolVal(sw), z3.IntVal(q % 3), P, S), {})
        assert got == sp.write_in_place(sw, q % 3, p, start)


@settings(max_examples=40, deadline=None)
@given(world=worlds())
def test_invariant_holds_on_reachable_worlds(world: sp.PagedWorld) -> None:
    for actor in NAMES:
        for x, u in blocks_and_pairs(world, actor):
            d = Domain(INT)
            v = pm.block_vars(d)
            subs = subs_of(v, view_values(world, x, actor, u))
            assert evaluate(z3.And(pm.refcount_invariant(d, v), pm.sum_facts(v)), subs), (x, actor, u)


def check_transition(world: sp.PagedWorld, op: dict[str, Any], build) -> int:
    """Run ``op`` on the spec; for every block and other sequence, the
    encoding ``build(d, v, result, x)`` evaluated on the before-view must
    give the after-view. Returns the number of views compared."""
    actor = op.get("seq", op.get("from", "main"))
    try:
        result, after = sp.apply_op(world, op)
    except KVCacheError:
        return 0
    compared = 0
    for x, u in blocks_and_pairs(world, actor):
        d = Domain(INT)
        v = pm.block_vars(d)
        subs, encoded = build(d, v, result, x, after)
        subs.update(subs_of(v, view_values(world, x, actor, u)))
        want = view_values(after, x, actor, u)
        got = read(encoded, subs, (want["s"]["alive"], want["u"]["alive"]))
        assert got == want, (op, x, u)
        compared += 1
    return compared


@settings(max_examples=40, deadline=None)
@given(world=worlds(), n=st.integers(1, 5), seq=st.sampled_from(NAMES), switch=st.booleans())
def test_append_agrees(world: sp.PagedWorld, n: int, seq: str, switch: bool) -> None:
    def build(d: Domain, v: pm.BlockV, result: Any, x: int, after: sp.PagedWorld):
        n_, taken, q, sw = d.var("n"), d.boolean("taken"), d.var("q"), d.boolean("switch")
        new = set(result.fresh) | {b for _, b in result.copied}
        table = after.seqs[seq].table
        subs = {n_: z3.IntVal(n), taken: z3.BoolVal(x in new), q: z3.IntVal(table.index(x) if x in new else 0),
                sw: z3.BoolVal(switch)}
        out = pm.append(d, v, n_, taken, q, sw)
        assert evaluate(pm.append_guard(d, v, n_, taken, q), {**subs, **subs_of(v, view_values(
            world, x, seq, "b" if seq != "b" else "a"))})
        return subs, out.after

    check_transition(world, {"op": "append", "n": n, "seq": seq}, build)


@settings(max_examples=40, deadline=None)
@given(world=worlds(), n=st.integers(-1, 6), seq=st.sampled_from(NAMES), front=st.booleans())
def test_trims_agree(world: sp.PagedWorld, n: int, seq: str, front: bool) -> None:
    def build(d: Domain, v: pm.BlockV, result: Any, x: int, after: sp.PagedWorld):
        n_ = d.var("n")
        return {n_: z3.IntVal(n)}, (pm.trim_front(d, v, n_) if front else pm.trim(d, v, n_))

    check_transition(world, {"op": "trim_front" if front else "trim", "n": n, "seq": seq}, build)


@settings(max_examples=40, deadline=None)
@given(world=worlds(), seq=st.sampled_from(NAMES))
def test_release_agrees(world: sp.PagedWorld, seq: str) -> None:
    check_transition(world, {"op": "release", "seq": seq},
                     lambda d, v, result, x, after: ({}, pm.release(d, v)))


@settings(max_examples=40, deadline=None)
@given(world=worlds(), source=st.sampled_from(NAMES))
def test_fork_agrees(world: sp.PagedWorld, source: str) -> None:
    name = "fresh"
    try:
        _, after = sp.fork(world, source, name)
    except KVCacheError:
        return
    for x in range(world.pool.size + 1):
        for u in NAMES:
            if u == source:
                continue
            d = Domain(INT)
            v = pm.block_vars(d)
            subs = subs_of(v, view_values(world, x, source, u))
            encoded, new = pm.fork(d, v)
            want = view_values(after, x, source, u)
            assert read(encoded, subs, (True, want["u"]["alive"])) == want
            # the new sequence's view equals the source's
            got_new = {"alive": evaluate(new.alive, subs), "len": evaluate(new.L, subs),
                       "start": evaluate(new.S, subs), "pos": evaluate(new.pos, subs)}
            assert got_new == seq_values(after, name, x)


def test_fidelity_sees_a_wrong_encoding() -> None:
    # the comparison is not vacuous: the buggy release encoding disagrees
    world = sp.new_world(2)
    for op in ({"op": "append", "n": 3}, {"op": "fork", "from": "main", "as": "a"}):
        _, world = sp.apply_op(world, op)
    d = Domain(INT)
    v = pm.block_vars(d)
    subs = subs_of(v, view_values(world, 0, "a", "main"))
    _, after = sp.release(world, "a")
    good = read(pm.release(d, v), subs, (False, True))
    bad = read(pm.release(d, v, pm.PagedRules(release="frees_shared")), subs, (False, True))
    assert good == view_values(after, 0, "a", "main") != bad
