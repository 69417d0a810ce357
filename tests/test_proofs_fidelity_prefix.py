"""Encoding fidelity for obligations 22 to 25: every function of
``kvspec.proofs.prefix_model`` agrees with ``kvspec.spec.prefix`` on concrete values
(substitute + simplify). The integer rules on every small case; the
invariant on every world the spec reaches (it must hold there), block sizes
1 to 5; and each op on such worlds through the proof's own step
(``kvspec.proofs.prefix.op_steps``): its premises must hold there (the proof
covers every op the spec accepts, and every refused decode, free, preempt,
reset and free_blocks), the model's state after it (refcounts, keys, the
cached map, rows, the free queue in order, both requests' tables, lengths
and names) against the spec's, with the hit the spec chose (the model must
allow it, and no other length: the hit is the longest chain). An op the
spec refuses must be refused by the model with the world unchanged, or (a
refused admit or resume) be outside the premises."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import z3
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.proofs import prefix as pp
from kvspec.proofs import prefix_model as pm
from kvspec.proofs.domain import INT, Domain, evaluate
from kvspec.spec import prefix as sp
from kvspec.spec.errors import KVCacheError

NAMES = ("a", "b")
#: prompts sharing roots, so hits, duplicates and evictions happen in 3 blocks
PROMPTS = ((1, 2, 3, 4, 5, 6), (1, 2, 3, 7), (1, 2, 8), (9, 9, 1))


def _prompt(draw: Any) -> list[int]:
    base = draw(st.sampled_from(PROMPTS))
    return list(base[:draw(st.integers(1, len(base)))])


@st.composite
def ops(draw: Any, world: sp.PrefixWorld | None = None) -> dict[str, Any]:
    """An op, drawn among those ``world`` accepts without an error (any
    op when None): admissions of prompts that share roots, decodes, frees,
    preemptions and resumptions, resets (free_blocks is always refused)."""
    live = [k for k, r in world.requests.items() if r.live] if world is not None else list(NAMES)
    held = [k for k, r in world.requests.items() if not r.live] if world is not None else list(NAMES)
    new = [k for k in NAMES if world is None or k not in world.requests]
    kinds = ["admit"] * 3 * bool(new) + ["decode", "decode", "free", "preempt"] * bool(live) \
        + ["resume", "resume"] * bool(held) + ["reset"]
    kind = draw(st.sampled_from(kinds))
    if kind == "admit":
        return {"op": "admit", "req": draw(st.sampled_from(new)), "tokens": _prompt(draw),
                "salt": draw(st.sampled_from((None, None, 0)))}
    if kind == "decode":
        return {"op": "decode", "req": draw(st.sampled_from(live)),
                "tokens": draw(st.lists(st.sampled_from((3, 4, 5, 7)), min_size=1, max_size=3))}
    if kind == "reset":
        return {"op": "reset"}
    return {"op": kind, "req": draw(st.sampled_from(held if kind == "resume" else live))}


@st.composite
def refused_ops(draw: Any, world: sp.PrefixWorld) -> dict[str, Any]:
    """An op ``world`` refuses with an error: a decode, free or preempt of a
    request that is not live (unknown or preempted), a resume of one that is
    not preempted, an admission of a known one, a free_blocks of two ids."""
    not_live = [k for k in NAMES if k not in world.requests or not world.requests[k].live]
    not_held = [k for k in NAMES if k not in world.requests or world.requests[k].live]
    known = [k for k in NAMES if k in world.requests]
    kinds = ["decode", "free", "preempt"] * bool(not_live) + ["resume"] * bool(not_held) \
        + ["admit"] * bool(known) + ["free_blocks"]
    kind = draw(st.sampled_from(kinds))
    if kind == "free_blocks":
        return {"op": kind, "blocks": draw(st.lists(st.integers(-1, pm.NB), min_size=2, max_size=2))}
    if kind == "admit":
        return {"op": kind, "req": draw(st.sampled_from(known)), "tokens": _prompt(draw)}
    if kind == "decode":
        return {"op": kind, "req": draw(st.sampled_from(not_live)), "tokens": [draw(st.sampled_from((3, 4)))]}
    return {"op": kind, "req": draw(st.sampled_from(not_held if kind == "resume" else not_live))}


#: block sizes of the fidelity worlds: past 3, so a premise narrowed to
#: small blocks (the proofs claim any B >= 1) fails here
BLOCK_SIZES = (1, 5)


@st.composite
def worlds(draw: Any) -> sp.PrefixWorld:
    world = sp.new_world(draw(st.integers(*BLOCK_SIZES)), pm.NB)
    for _ in range(draw(st.integers(0, 14))):
        _, world = sp.apply_op(world, draw(ops(world)))
    return world


@st.composite
def steps(draw: Any) -> tuple[sp.PrefixWorld, dict[str, Any]]:
    """A reachable world and an op: one it accepts, or (one in four) one it
    refuses with an error."""
    world = draw(worlds())
    return world, draw(refused_ops(world) if draw(st.integers(0, 3)) == 0 else ops(world))


class Names:
    """Integers for the spec's names, consistent within one example: key
    names >= 0, partial rows' names <= -2, blank rows -1, and fresh names
    for keys and tails a request does not have yet."""

    def __init__(self) -> None:
        self.keys: dict[Any, int] = {}
        self.partials: dict[Any, int] = {}
        self.fresh = itertools.count(10_000)

    def key(self, key: Any) -> int:
        return self.keys.setdefault(key, len(self.keys))

    def partial(self, rows: Any) -> int:
        return self.partials.setdefault(rows, -2 - len(self.partials))

    def rows(self, rows: tuple[Any, ...], bs: int) -> int:
        if all(r is None for r in rows):
            return pm.NONE
        last = rows[-1]
        if last is not None and len(last[1]) >= bs and len(last[1]) % bs == 0 and rows == sp.key_rows(last, bs):
            return self.key(last)
        return self.partial(rows)

    def request_keys(self, salt: Any, tokens: tuple[int, ...], bs: int) -> list[int]:
        full = sp.full_blocks(len(tokens), bs)
        return [self.key(sp.block_key(salt, tokens, i, bs)) if i < full else next(self.fresh) for i in range(pm.NB)]

    def tail(self, salt: Any, tokens: tuple[int, ...], bs: int) -> int:
        n = len(tokens)
        if n % bs == 0:
            return -next(self.fresh)
        lo = n // bs * bs
        return self.partial(tuple(sp.row_name(salt, tokens, p) for p in range(lo, n)) + (None,) * (bs - n % bs))


def values(world: sp.PrefixWorld, order: tuple[str, str], names: Names) -> dict[str, Any]:
    """The model's variables (``world_vars`` names) for a spec world, request
    ``order[0]`` in slot 0."""
    bs = world.block_size
    lk = [pm.NONE] * pm.NB
    for key, ids in world.cached:
        for b in ids:
            lk[b] = names.key(key)
    out: dict[str, Any] = {"B": bs, "w_qn": len(world.free)}
    for x, blk in enumerate(world.blocks):
        out.update({f"w_rc{x}": blk.refcount, f"w_key{x}": pm.NONE if blk.key is None else names.key(blk.key),
                    f"w_listed{x}": lk[x], f"w_rows{x}": names.rows(blk.rows, bs)})
    for i in range(pm.NB):
        out[f"w_q{i}"] = world.free[i] if i < len(world.free) else 0
    for slot, name in enumerate(order):
        r = world.requests.get(name)
        v = f"r{slot}"
        if r is None:
            out.update({f"{v}_live": False, f"{v}_preempted": False, f"{v}_n": 0, f"{v}_tl": 0,
                        f"{v}_p": -next(names.fresh)})
            out.update({f"{v}_t{i}": 0 for i in range(pm.NB)})
            out.update({f"{v}_k{i}": next(names.fresh) for i in range(pm.NB)})
            continue
        out.update({f"{v}_live": r.live, f"{v}_preempted": not r.live, f"{v}_n": len(r.tokens),
                    f"{v}_tl": len(r.table), f"{v}_p": names.tail(r.salt, r.tokens, bs)})
        out.update({f"{v}_t{i}": r.table[i] if i < len(r.table) else 0 for i in range(pm.NB)})
        out.update({f"{v}_k{i}": k for i, k in enumerate(names.request_keys(r.salt, r.tokens, bs))})
    return out


def subs_of(vals: dict[str, Any]) -> dict[Any, Any]:
    return {(z3.Bool(k) if isinstance(v, bool) else z3.Int(k)): (z3.BoolVal(v) if isinstance(v, bool) else z3.IntVal(v))
            for k, v in vals.items()}


def read(w: pm.World, subs: dict[Any, Any]) -> dict[str, Any]:
    """The model world ``w`` evaluated, as :func:`values` lays out a spec world."""
    ev = lambda e: evaluate(e, subs)
    out: dict[str, Any] = {"B": ev(w.B), "w_qn": ev(w.qn)}
    for x in range(pm.NB):
        out.update({f"w_rc{x}": ev(w.rc[x]), f"w_key{x}": ev(w.key[x]), f"w_listed{x}": ev(w.lk[x]),
                    f"w_rows{x}": ev(w.rows[x])})
    for i in range(pm.NB):
        out[f"w_q{i}"] = ev(w.q[i])
    for slot, r in enumerate(w.reqs):
        v = f"r{slot}"
        out.update({f"{v}_live": ev(r.live), f"{v}_preempted": ev(r.pre), f"{v}_n": ev(r.n), f"{v}_tl": ev(r.tl),
                    f"{v}_p": ev(r.p)})
        out.update({f"{v}_t{i}": ev(r.t[i]) for i in range(pm.NB)})
        out.update({f"{v}_k{i}": ev(r.k[i]) for i in range(pm.NB)})
    return out


def observed(vals: dict[str, Any], world: sp.PrefixWorld) -> dict[str, Any]:
    """What a state is compared on: every block's refcount, key and map
    entry, rows of held or keyed blocks, the queue, each known request's
    state, length, table, full blocks' keys and partial tail's name."""
    bs = world.block_size
    out = {k: v for k, v in vals.items() if k in ("B", "w_qn") or k.startswith(("w_rc", "w_key", "w_listed"))}
    out.update({f"w_q{i}": vals[f"w_q{i}"] for i in range(vals["w_qn"]) if i < pm.NB})
    for x in range(pm.NB):
        if vals[f"w_rc{x}"] > 0 or vals[f"w_key{x}"] >= 0:
            out[f"w_rows{x}"] = vals[f"w_rows{x}"]
    for slot in range(pm.R):
        v = f"r{slot}"
        out.update({f"{v}_live": vals[f"{v}_live"], f"{v}_preempted": vals[f"{v}_preempted"]})
        if vals[f"{v}_live"] or vals[f"{v}_preempted"]:
            n = vals[f"{v}_n"]
            out[f"{v}_n"] = n
            out.update({f"{v}_k{i}": vals[f"{v}_k{i}"] for i in range(min(pm.NB, n // bs))})
            if n % bs:
                out[f"{v}_p"] = vals[f"{v}_p"]
        if vals[f"{v}_live"]:
            out[f"{v}_tl"] = vals[f"{v}_tl"]
            out.update({f"{v}_t{i}": vals[f"{v}_t{i}"] for i in range(vals[f"{v}_tl"])})
    return out


def _order(name: str) -> tuple[str, str]:
    return (name, next(n for n in NAMES if n != name))


def _step(op: str, rules: pm.PrefixRules) -> tuple[str, pp.Step] | None:
    """The proof's step for the spec's op ``op`` (None: an op it has no step
    for, lookup and expect: they change nothing)."""
    return next(((label, step) for label, name, step in pp.op_steps(rules) if name == op), None)


#: ops whose refusal (an error: the request's state) the proof's premises
#: exclude; every other refused op is inside them and must change nothing
EXCLUDED_WHEN_REFUSED = ("admit", "resume")


def _hit_is_determined(premises: list[Any], subs: dict[Any, Any], j: int) -> bool:
    """Under the step's premises with every value but the hit's fixed, is
    ``hit_j == j`` the only length the hit rule allows?"""
    fixed = [(k, v) for k, v in subs.items() if not str(k).startswith("hit_")]
    s = z3.Solver()
    s.add(z3.substitute(z3.And(*premises), *fixed), z3.Int("hit_j") != j)
    return s.check() == z3.unsat


def transition(world: sp.PrefixWorld, op: dict[str, Any], rules: pm.PrefixRules = pm.PREFIX_SPEC,
               names: Names | None = None) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``op`` on the spec and on the proof's step for it (:func:`pp.op_steps`)
    from the same world: (the model's state after it, the spec's), both as
    :func:`observed` lays them out. The step's premises must hold (an op the
    spec refuses with an error: the model refuses it too and the world is
    unchanged); a refused admit or resume must be outside the premises
    (returns None), as must an op the proof has no step for."""
    try:
        result, after = sp.apply_op(world, op)
        refused = False
    except KVCacheError:
        result, after, refused = None, world, True
    found = _step(op["op"], rules)
    if found is None:
        return None
    label, step = found
    names = names or Names()
    order = _order(op.get("req", "a"))
    bs = world.block_size
    d = Domain(INT)
    premises, new, ok = step(d)
    vals = values(world, order, names)
    r = world.requests.get(op.get("req", ""))
    hit_j = None
    if op["op"] in ("admit", "resume"):
        salt, tokens = (op.get("salt"), tuple(op["tokens"])) if op["op"] == "admit" else \
            ((r.salt, r.tokens) if r is not None else (None, ()))
        table = sp.hit_table(world, salt, tokens) if tokens else ()
        hit_j = len(table)
        vals.update({"hit_j": hit_j, **{f"hit_block{i}": table[i] if i < len(table) else 0 for i in range(pm.NB)}})
        if op["op"] == "admit":
            vals.update({"n": len(tokens), "new_partial": names.tail(salt, tokens, bs),
                         **{f"new_key{i}": k for i, k in enumerate(names.request_keys(salt, tokens, bs))}})
    elif op["op"] == "decode":
        salt, grown = (r.salt, r.tokens) if r is not None else (None, ())
        grown = grown + tuple(op["tokens"])
        vals.update({"n_new": len(op["tokens"]), "after_partial": names.tail(salt, grown, bs),
                     **{f"after_key{i}": k for i, k in enumerate(names.request_keys(salt, grown, bs))}})
    elif op["op"] == "free_blocks":
        vals.update({"listed0": op["blocks"][0], "listed1": op["blocks"][-1]})
    subs = subs_of(vals)
    holds = evaluate(z3.And(*premises), subs)
    if refused and op["op"] in EXCLUDED_WHEN_REFUSED:
        assert holds is False, f"{label}: the premises admit {op}, which the spec refuses"
        return None
    assert holds is True, f"{label}: the premises exclude {op}, which the spec reaches"
    if refused:
        assert evaluate(ok, subs) is False, f"{label}: the model accepts {op}, which the spec refuses"
    elif op["op"] in ("admit", "resume"):
        assert evaluate(ok, subs) == result["admitted"]
        assert _hit_is_determined(premises, subs, hit_j), f"{label}: the hit rule allows a length other than {hit_j}"
    elif op["op"] in ("free", "preempt"):
        assert evaluate(ok, subs) is True
    else:
        assert evaluate(ok, subs) == result
    return observed(read(new, subs), after), observed(values(after, order, names), after)


@pytest.mark.parametrize("bs", [1, 2, 3, 5])
def test_integer_rules_are_the_spec_rules(bs: int) -> None:
    d = Domain(INT)
    B = z3.IntVal(bs)
    for n in range(14):
        N = z3.IntVal(n)
        assert evaluate(pm.blocks_for(d, N, B), {}) == sp.blocks_for(n, bs)
        assert evaluate(pm.full_blocks(d, N, B), {}) == sp.full_blocks(n, bs)
        for i in range(5):
            assert evaluate(pm.is_full(d, z3.IntVal(i), N, B), {}) == sp.is_full(i, n, bs)
        for k in range(1, 5):
            assert evaluate(pm.decode_blocks_needed(d, N, z3.IntVal(k), B), {}) == sp.decode_blocks_needed(n, k, bs)
        for f in range(4):
            assert evaluate(pm.available_blocks(d, z3.IntVal(n), z3.IntVal(f)), {}) == sp.available_blocks(n, f)
        if n >= 1:
            assert evaluate(pm.max_hit_blocks(d, N, B), {}) == sp.max_hit_blocks(n, bs)
            for j in range(sp.max_hit_blocks(n, bs) + 1):
                assert evaluate(pm.new_blocks_needed(d, N, z3.IntVal(j), B), {}) == sp.new_blocks_needed(n, j, bs)


@settings(max_examples=60, deadline=None)
@given(world=worlds())
def test_invariant_holds_on_reachable_worlds(world: sp.PrefixWorld) -> None:
    assert not sp.broken_invariants(world)
    for order in (("a", "b"), ("b", "a")):
        names = Names()
        subs = subs_of(values(world, order, names))
        d = Domain(INT)
        w = pm.world_vars(d)
        for name, part in (("key", pm.key_invariant(d, w)), ("refcount", pm.refcount_invariant(d, w)),
                           ("queue", pm.free_queue_exact(w)), ("whole", pm.invariant(d, w))):
            assert evaluate(part, subs) is True, (name, order)


@settings(max_examples=200, deadline=None)
@given(step=steps())
def test_ops_agree_with_the_spec(step: tuple[sp.PrefixWorld, dict[str, Any]]) -> None:
    world, op = step
    got = transition(world, op)
    if got is None:  # a refused admit or resume, outside the premises (transition checked it)
        assert op["op"] in EXCLUDED_WHEN_REFUSED, op
        return
    model, spec = got
    assert model == spec, op


def _world(bs: int, ops_: list[dict[str, Any]]) -> sp.PrefixWorld:
    world = sp.new_world(bs, pm.NB)
    for op in ops_:
        _, world = sp.apply_op(world, op)
    return world


#: ops each op kind of the model runs at least once on, through the spec:
#: hits on a cached-free block (shared by both requests), evictions,
#: duplicates, a refused admission and decode, a release of keyed and
#: unkeyed blocks, a refused reset; and ops the spec refuses with an error:
#: a double free, a decode of an unknown and of a preempted request,
#: free_blocks, a resume of a live request and an admission of a known one
SCRIPT = [{"op": "admit", "req": "a", "tokens": [1, 2, 3]}, {"op": "admit", "req": "b", "tokens": [1, 2, 9]},
          {"op": "decode", "req": "a", "tokens": [4]}, {"op": "reset"}, {"op": "free_blocks", "blocks": [0, 0]},
          {"op": "free_blocks", "blocks": [0, 1]}, {"op": "free", "req": "b"}, {"op": "free", "req": "b"},
          {"op": "decode", "req": "b", "tokens": [3]}, {"op": "resume", "req": "a"},
          {"op": "admit", "req": "a", "tokens": [1]},
          {"op": "admit", "req": "b", "tokens": [5, 6, 7, 8, 1]}, {"op": "preempt", "req": "a"},
          {"op": "decode", "req": "a", "tokens": [4]}, {"op": "preempt", "req": "a"},
          {"op": "admit", "req": "b", "tokens": [1, 2, 3, 4, 5]}, {"op": "resume", "req": "a"},
          {"op": "decode", "req": "a", "tokens": [5, 6]}, {"op": "free", "req": "a"}, {"op": "reset"},
          {"op": "admit", "req": "a", "tokens": [1, 2, 3, 4, 5, 6, 7]}]


@pytest.mark.parametrize("bs", [1, 2, 4, 5])
def test_a_scripted_run_agrees_at_every_op(bs: int) -> None:
    world = sp.new_world(bs, pm.NB)
    compared = refused = 0
    for op in SCRIPT:
        got = transition(world, op)
        try:
            _, world = sp.apply_op(world, op)
        except KVCacheError:
            refused += 1
        if got is not None:
            assert got[0] == got[1], op
            compared += 1
    assert compared >= 15 and refused >= 8, (compared, refused)


@pytest.mark.parametrize("bs", [1, 2, 4, 7])
def test_the_empty_pool_is_the_init_premise(bs: int) -> None:
    """The init part's premises hold on kvspec.spec.prefix.new_world, whatever the
    block size (the proofs claim every B >= 1), and it is the whole
    invariant's world."""
    premises, w, _ = next(step for _, op, step in pp.op_steps() if op is None)(Domain(INT))
    subs = subs_of(values(sp.new_world(bs, pm.NB), NAMES, Names()))
    assert evaluate(z3.And(*premises), subs) is True
    assert evaluate(pm.invariant(Domain(INT), w), subs) is True


@pytest.mark.parametrize("rules,ops_,op", [
    (pm.PrefixRules(evict="keeps_map_entry"),
     [{"op": "admit", "req": "a", "tokens": [1, 2, 3]}, {"op": "free", "req": "a"}],
     {"op": "admit", "req": "b", "tokens": [5, 6, 7, 8, 9]}),
    (pm.PrefixRules(evict="keeps_key"),
     [{"op": "admit", "req": "a", "tokens": [1, 2, 3]}, {"op": "free", "req": "a"}],
     {"op": "admit", "req": "b", "tokens": [5, 6, 7, 8, 9]}),
    (pm.PrefixRules(evict="none"),
     [{"op": "admit", "req": "a", "tokens": [1, 2, 3]}, {"op": "free", "req": "a"}],
     {"op": "admit", "req": "b", "tokens": [5, 6, 7, 8, 9]}),
    (pm.PrefixRules(touch="leaves_in_queue"),
     [{"op": "admit", "req": "a", "tokens": [1, 2, 3]}, {"op": "free", "req": "a"}],
     {"op": "admit", "req": "b", "tokens": [1, 2, 3]}),
    (pm.PrefixRules(cache_partial=True), [], {"op": "admit", "req": "a", "tokens": [1, 2, 3]}),
    (pm.PrefixRules(pop_refcount=0), [], {"op": "admit", "req": "a", "tokens": [1]}),
])
def test_fidelity_sees_a_wrong_encoding(rules: pm.PrefixRules, ops_: list[dict[str, Any]], op: dict[str, Any]) -> None:
    """The comparison is not vacuous: each control's encoding disagrees with
    the spec on a small run (block size 2) where the correct one agrees."""
    world = _world(2, ops_)
    good = transition(world, op)
    bad = transition(world, op, rules)
    assert good is not None and bad is not None
    assert good[0] == good[1] and bad[0] != bad[1]
