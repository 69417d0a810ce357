"""Obligations 22 to 26: the prefix kind's rules (``kvspec.spec.prefix``;
semantics.md 11, docs/prefix.md). Encodings are in
:mod:`kvspec.proofs.prefix_model`.

Obligations 22 to 24 are one inductive invariant over a bounded pool of 3
blocks and 2 request slots (block size, token counts, key and row names
symbolic), split by what each states: each assumes the whole invariant
(:func:`kvspec.proofs.prefix_model.invariant`, the spec's ``INVARIANTS`` together)
before an op and proves its own part after it, so the three proved
together make the whole invariant inductive. It holds for the empty pool
and is kept by every op: admit (hits touched, blocks popped from the
queue's front and evicted, rows written, full blocks keyed; no room: nothing
changed), resume, decode, free and preempt (released tail first, keyed
blocks to the back, unkeyed to the front), reset and free_blocks (refused:
nothing changed). A decode, free or preempt of a request that is not live
is inside the premises (refused: nothing changed); admit and resume keep
the request's state as a premise (not known; preempted). Request 0 acts,
request 1 is the other one (the two are symmetric). ``lookup`` changes
nothing. tests/test_proofs_fidelity_prefix.py evaluates each op's premises
and the world after it (:func:`op_steps`) on the worlds the spec reaches,
block sizes 1 to 5, and its refused ops.

* 22, key to content: a block listed under a key in the cached map carries
  that key and holds exactly the rows it names, a keyed block is listed
  under its key, every live request's blocks hold its own rows, and its
  full blocks are keyed under its own keys. Controls: eviction that leaves
  the popped block's id under its key (vLLM PR #4761), eviction that
  leaves the block its key (vLLM PR #24084's dirty block), reallocation
  with no eviction step at all (MinivLLM PR #87: the recycled block keeps
  its old key and map entry), a partial tail block keyed.
* 23, refcounts and holders: a block's refcount is the number of live
  tables holding it, never negative; a table holds a block at most once and
  has ``ceil(len / B)`` entries; a partial tail has refcount 1 and no key;
  ``free_blocks`` is refused for every call (a block listed twice
  included). Controls: vLLM's ``BlockPool.free_blocks`` (each listed block
  decremented, no check: ``[b, b]`` drives a refcount to -1, vLLM issue
  #42571), a popped block left at refcount 0 (MinivLLM PR #87).
* 24, the free queue: exactly the blocks of refcount 0, each once (a hit
  on a cached-free block takes it out). Controls: a touch that leaves the
  hit block in the queue, vLLM's ``free_blocks`` (a block held by a table,
  or listed twice, joins the queue).
* 25, hit length: ``max_hit_blocks(n, B) = (n - 1) // B`` is the largest
  ``j`` with ``j * B <= n - 1``; a hit of ``j <= max_hit_blocks`` blocks
  covers full blocks only and leaves the last token to compute (``j * B``,
  the hit tokens, without overflow); an admission always takes at least
  one new block (``new_blocks_needed >= 1``: the block of the last token is
  the request's own). Controls: the uncapped whole-prompt hit (``n // B``
  blocks), a hit that counts the partial block (``ceil(n / B)``).

A control whose fault is one spec function away is also confirmed on
``kvspec.spec.prefix`` with that function replaced, on its report's scenario
(``kvspec.spec.prefix.broken_invariants`` names one of the obligation's
invariants; for the uncapped hit, the admission leaves no token to
compute).

Run as ``kvspec prove --only 22 23 24 25``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import z3

from kvspec.proofs.core import ObligationResult, PartBuilder, control_from_parts, overall, run_parts
from kvspec.proofs.domain import INT, Domain
from kvspec.proofs.prefix_model import (
    NB,
    PREFIX_SPEC,
    PrefixRules,
    World,
    admit,
    blocks_for,
    decode,
    free,
    free_blocks,
    free_queue_exact,
    hit_run,
    hit_vars,
    initial,
    invariant,
    is_full,
    key_invariant,
    max_hit_blocks,
    new_blocks_needed,
    refcount_invariant,
    reset,
    skipped_blocks,
    world_vars,
)

TITLES = {22: "prefix key to content", 23: "prefix refcounts and holders", 24: "prefix free queue",
          25: "prefix hit length", 26: "prefix sliding window"}
#: the acting request slot
ACTOR = 0

Goal = Callable[[Domain, World], Any]


def _key_goal(d: Domain, w: World) -> Any:
    return key_invariant(d, w)


def _refcount_goal(d: Domain, w: World) -> Any:
    return refcount_invariant(d, w)


def _queue_goal(d: Domain, w: World) -> Any:
    return free_queue_exact(w)


def _names(d: Domain, name: str) -> tuple[tuple[Any, ...], Any, list[Any]]:
    """Key names of a request's blocks 0..2 and its partial rows' name, with
    what names are: keys >= 0 and distinct, partial rows <= -2."""
    keys = tuple(d.var(f"{name}_key{i}") for i in range(NB))
    pn = d.var(f"{name}_partial")
    facts = [pn <= -2, *[k >= 0 for k in keys], *[keys[i] != keys[m] for i in range(NB) for m in range(i + 1, NB)]]
    return keys, pn, facts


def exact() -> Domain:
    """The invariants are statements over the integers, not computations
    of the pool: they are stated in exact arithmetic in both runs (the bv32
    run checks that the ops' own arithmetic does not overflow)."""
    return Domain(INT)


#: a transition: ``d -> (premises, goal, accepted)`` (``accepted``: the op
#: was not refused; tests check that it is reachable under the premises)
Case = Callable[[Domain], tuple[list[Any], Any, Any]]
#: an op's step: ``d -> (premises, the world after it, accepted)``; the
#: fidelity test evaluates these on the spec's worlds (the premises must
#: hold on every op the proof claims, the world after must be the spec's)
Step = Callable[[Domain], tuple[list[Any], World, Any]]

def op_steps(rules: PrefixRules = PREFIX_SPEC) -> list[tuple[str, str | None, Step]]:
    """One step per op, ``(label, the spec's op, step)``: the whole
    invariant before (init: the empty pool), and the condition under which
    the op is accepted. Premises name only what the op's caller fixes: a
    refused op (decode, free or preempt of a request that is not live,
    reset while a block is held, every free_blocks) is inside them and must
    leave the world unchanged; only admit (a request not known yet) and
    resume (a preempted one) keep the request's state as a premise."""

    def start(d: Domain) -> tuple[World, list[Any]]:
        w = world_vars(d)
        return w, [invariant(exact(), w)]

    def init(d: Domain) -> tuple[list[Any], World, Any]:
        w = world_vars(d)
        return [initial(w)], w, z3.BoolVal(True)

    def t_admit(d: Domain) -> tuple[list[Any], World, Any]:
        w, pre = start(d)
        me = w.reqs[ACTOR]
        n = d.var("n")
        keys, pn, facts = _names(d, "new")
        rule, ok, after = admit(d, w, ACTOR, n, keys, pn, hit_vars(d), rules)
        return [*pre, z3.Not(me.live), z3.Not(me.pre), n >= 1, *facts, rule], after, ok

    def t_resume(d: Domain) -> tuple[list[Any], World, Any]:
        w, pre = start(d)
        me = w.reqs[ACTOR]
        rule, ok, after = admit(d, w, ACTOR, me.n, me.k, me.p, hit_vars(d), rules)
        return [*pre, me.pre, rule], after, ok

    def t_decode(d: Domain) -> tuple[list[Any], World, Any]:
        # not live (unknown or preempted) is inside: decode must refuse it
        w, pre = start(d)
        me = w.reqs[ACTOR]
        m = d.var("n_new")
        keys, pn, facts = _names(d, "after")
        kept = [z3.Implies(is_full(exact(), z3.IntVal(i), me.n, w.B), keys[i] == me.k[i]) for i in range(NB)]
        ok, after = decode(d, w, ACTOR, m, keys, pn, rules)
        return [*pre, m >= 1, *facts, *kept], after, ok

    def t_free(preempting: bool) -> Step:
        def build(d: Domain) -> tuple[list[Any], World, Any]:
            w, pre = start(d)
            ok, after = free(d, w, ACTOR, preempting)
            return pre, after, ok
        return build

    def t_reset(d: Domain) -> tuple[list[Any], World, Any]:
        w, pre = start(d)
        ok, after = reset(w)
        return pre, after, ok

    def t_free_blocks(d: Domain) -> tuple[list[Any], World, Any]:
        w, pre = start(d)
        ok, after = free_blocks(d, w, (d.var("listed0"), d.var("listed1")), rules)
        return pre, after, ok

    return [("init: the empty pool", None, init),
            (("preserved by admit (hits touched, blocks popped from the front and evicted, rows written, full blocks "
             "keyed; no room: unchanged)"), "admit", t_admit),
            ("preserved by resume", "resume", t_resume),
            (("preserved by decode (blocks popped and evicted, rows written, blocks that became full keyed; no room "
              "or not live: unchanged)"), "decode", t_decode),
            ("preserved by free (tail first, keyed to the back, unkeyed to the front; not live: refused)", "free",
             t_free(False)),
            ("preserved by preempt", "preempt", t_free(True)),
            ("preserved by reset (refused while a block is held)", "reset", t_reset),
            ("preserved by free_blocks of two ids (a block maybe listed twice)", "free_blocks", t_free_blocks)]


def op_cases(goal: Goal, rules: PrefixRules = PREFIX_SPEC) -> list[tuple[str, Case]]:
    """One case per op (:func:`op_steps`): the whole invariant before,
    ``goal`` after, and the condition under which the op is accepted."""

    def case(step: Step) -> Case:
        def build(d: Domain) -> tuple[list[Any], Any, Any]:
            premises, after, ok = step(d)
            return premises, goal(exact(), after), ok
        return build

    return [(label, case(step)) for label, _, step in op_steps(rules)]


def op_parts(goal: Goal, rules: PrefixRules = PREFIX_SPEC) -> list[tuple[str, PartBuilder]]:
    """The parts of :func:`op_cases` (premises and goal)."""

    def part(case: Case) -> PartBuilder:
        def build(d: Domain) -> tuple[list[Any], Any]:
            premises, g, _ = case(d)
            return premises, g
        return build

    return [(label, part(case)) for label, case in op_cases(goal, rules)]


# -- negative controls confirmed on the spec's own code -------------------------------
#
# A control whose fault is one function of kvspec.spec.prefix away is also run on the
# spec with that function replaced (kvspec.proofs.traces.patched), on the scenario of
# the public report it comes from: confirmed when the spec's own
# broken_invariants (or, for the hit length, the admission's result) shows
# the fault. The op sequences are those of the reports, in the kind's ops.

Confirm = Callable[[], tuple[Any, Any, str]]


def _pop_with(evict: str = "spec", refcount: int = 1) -> Callable[..., Any]:
    """``kvspec.spec.prefix._pop`` with its eviction step changed: ``keeps_map_entry``
    (the id stays under the key), ``keeps_key`` (the block keeps its key),
    ``none`` (neither), or a popped block's refcount other than 1."""
    from dataclasses import replace

    from kvspec.spec import prefix as sp

    def _pop(world: Any, n: int) -> tuple[tuple[int, ...], Any]:
        blocks, free, cached = world.blocks, world.free, world.cached
        out = []
        blank = (None,) * world.block_size
        for _ in range(n):
            b, free = free[0], free[1:]
            key = blocks[b].key
            if key is not None and evict in ("spec", "keeps_key"):
                cached = sp._cache_remove(cached, key, b)
            kept = key if evict in ("keeps_key", "none") else None
            blocks = sp._set(blocks, b, sp.Block(refcount, kept, blank))
            out.append(b)
        return tuple(out), replace(world, blocks=blocks, free=free, cached=cached)

    return _pop


def _free_blocks_unchecked(world: Any, blocks: Any) -> tuple[None, Any]:
    """vLLM's ``BlockPool.free_blocks``: each listed block's refcount - 1, at
    0 it joins the back of the free queue; no check."""
    from dataclasses import replace

    from kvspec.spec import prefix as sp

    bl, free = world.blocks, world.free
    for b in blocks:
        blk = bl[b]
        bl = sp._set(bl, b, replace(blk, refcount=blk.refcount - 1))
        if blk.refcount - 1 == 0:
            free = (*free, b)
    return None, replace(world, blocks=bl, free=free)


def _cache_partial_tail() -> Callable[..., Any]:
    """``kvspec.spec.prefix._cache_full`` keying every written block up to the
    table's end, the partial tail included."""
    from kvspec.spec import prefix as sp

    whole = sp._cache_full

    def _cache_full(world: Any, salt: Any, tokens: Any, table: Any, lo: int, hi: int) -> Any:
        return whole(world, salt, tokens, table, lo, len(table))

    return _cache_full


def _op_text(op: dict[str, Any]) -> str:
    args = " ".join(str(op[k]) for k in ("req", "tokens", "blocks") if k in op)
    return f"{op['op']} {args}".strip()


def _broken_on_spec(scenario: str, block_size: int, n_blocks: int, ops: list[dict[str, Any]],
                    patches: Callable[[], dict[str, Any]], shows: tuple[str, ...]) -> Confirm:
    """Run ``ops`` from an empty spec pool with ``patches()`` in place:
    confirmed at the first op after which kvspec.spec.prefix.broken_invariants
    names one of ``shows`` (the obligation's own invariants)."""

    def confirm() -> tuple[Any, Any, str]:
        from kvspec.proofs import traces
        from kvspec.spec import prefix as sp

        try:
            functions = patches()
        except AttributeError as e:
            return None, None, f"not confirmed: kvspec.spec.prefix changed ({e})"
        world = sp.new_world(block_size, n_blocks)
        values = {"block_size": block_size, "n_blocks": n_blocks}
        with traces.patched(sp, **functions):
            for i, op in enumerate(ops):
                _, world = sp.apply_op(world, op)
                broken = sp.broken_invariants(world)
                if set(broken) & set(shows):
                    return None, values, (f"confirmed on spec with the bug ({scenario}, block size {block_size}, "
                                          f"{n_blocks} blocks): after op {i} ({_op_text(op)}) it breaks "
                                          f"{', '.join(broken)}")
        return None, values, (f"not confirmed: {scenario} keeps {', '.join(shows)} on the spec with the bug")

    confirm.scenario = (block_size, n_blocks, ops)  # type: ignore[attr-defined]
    return confirm


def _uncapped_on_spec() -> tuple[Any, Any, str]:
    """The whole-prompt hit on the spec: a prompt of whole blocks admitted
    twice; the second admission hits every token, none left to compute."""
    from kvspec.proofs import traces
    from kvspec.spec import prefix as sp

    world = sp.new_world(2, 4)
    tokens = [1, 2, 3, 4]
    with traces.patched(sp, max_hit_blocks=lambda n, bs: n // bs):
        _, world = sp.apply_op(world, {"op": "admit", "req": "a", "tokens": tokens})
        result, _ = sp.apply_op(world, {"op": "admit", "req": "b", "tokens": tokens})
    values = {"block_size": 2, "n_tokens": len(tokens), "hit": result["hit"]}
    if result["hit"] < len(tokens):
        return None, values, "not confirmed: the spec with an uncapped hit leaves a token to compute"
    return None, values, (f"confirmed on spec with the bug: a second admission of {tokens} (block size 2) hits all "
                          f"{result['hit']} tokens, none left to compute (the last token's logits need it)")


A = "admit"
KEY = ("keys_name_contents", "cached_map_exact", "requests_read_their_rows", "full_blocks_keyed")
REFCOUNT = ("refcounts_match_tables", "tables_sized", "partial_tail_private")
QUEUE = ("free_queue_exact",)
#: the reports' scenarios (their op sequences; see each control's rule)
STALE_ENTRY = _broken_on_spec("vLLM PR #4761's scenario", 2, 2, [
    {"op": A, "req": "a", "tokens": [1, 2, 3]}, {"op": "free", "req": "a"},
    {"op": A, "req": "b", "tokens": [5, 6, 7]}], lambda: {"_pop": _pop_with("keeps_map_entry")}, KEY)
DIRTY_BLOCK = _broken_on_spec("vLLM PR #24084's scenario", 2, 3, [
    {"op": A, "req": "a", "tokens": [1, 2]}, {"op": A, "req": "h", "tokens": [5, 6]}, {"op": "free", "req": "a"},
    {"op": A, "req": "b", "tokens": [7, 8, 9]}], lambda: {"_pop": _pop_with("keeps_key")}, KEY)
RECYCLED = _broken_on_spec("MinivLLM PR #87's scenario", 2, 3, [
    {"op": A, "req": "a", "tokens": [1, 2, 3, 4]}, {"op": "free", "req": "a"},
    {"op": A, "req": "b", "tokens": [7, 8, 3, 4, 9]}], lambda: {"_pop": _pop_with("none")}, KEY)
PARTIAL_KEYED = _broken_on_spec("a prompt ending in a partial block", 2, 3,
                                [{"op": A, "req": "a", "tokens": [1, 2, 3]}],
                                lambda: {"_cache_full": _cache_partial_tail()}, KEY)
DOUBLE_FREE = _broken_on_spec("vLLM issue #42571's free_blocks([b, b])", 1, 3, [
    {"op": A, "req": "a", "tokens": [1, 2]}, {"op": "free_blocks", "blocks": [0, 0]}],
    lambda: {"free_blocks": _free_blocks_unchecked}, REFCOUNT)
QUEUED_TWICE = _broken_on_spec("vLLM issue #42571's free_blocks([b, b])", 1, 3, [
    {"op": A, "req": "a", "tokens": [1, 2]}, {"op": "free_blocks", "blocks": [0, 0]}],
    lambda: {"free_blocks": _free_blocks_unchecked}, QUEUE)
REFCOUNT_ZERO = _broken_on_spec("a first admission", 2, 3, [{"op": A, "req": "a", "tokens": [1, 2, 3]}],
                                lambda: {"_pop": _pop_with(refcount=0)}, REFCOUNT)


# -- 22 ------------------------------------------------------------------------------


def key_parts(rules: PrefixRules = PREFIX_SPEC) -> list[tuple[str, PartBuilder]]:
    return op_parts(_key_goal, rules)


KEY_CONTROLS: list[tuple[str, str, PrefixRules, Confirm | None]] = [
    ("evict_keeps_map_entry", ("a block popped from the free queue loses its key but stays listed under it "
     "(vLLM PR #4761)"), PrefixRules(evict="keeps_map_entry"), STALE_ENTRY),
    ("evict_keeps_key", ("a block popped from the free queue leaves the key's list but keeps its key "
     "(vLLM PR #24084's dirty block)"), PrefixRules(evict="keeps_key"), DIRTY_BLOCK),
    ("recycled_block_keeps_key", ("reallocation without an eviction step: the recycled block keeps its old key "
     "and map entry (MinivLLM PR #87)"), PrefixRules(evict="none"), RECYCLED),
    ("partial_tail_keyed", "the partial tail block is keyed (and so shared) too", PrefixRules(cache_partial=True),
     PARTIAL_KEYED),
]


# -- 23 ------------------------------------------------------------------------------


def refcount_parts(rules: PrefixRules = PREFIX_SPEC) -> list[tuple[str, PartBuilder]]:
    def twice(d: Domain) -> tuple[list[Any], Any]:
        w = world_vars(d)
        b = d.var("listed")
        ok, after = free_blocks(d, w, (b, b), rules)
        return [invariant(exact(), w)], z3.And(z3.Not(ok), refcount_invariant(exact(), after))

    def refused(d: Domain) -> tuple[list[Any], Any]:
        w = world_vars(d)
        ok, _ = free_blocks(d, w, (d.var("listed0"), d.var("listed1")), rules)
        return [invariant(exact(), w)], z3.Not(ok)

    return [("free_blocks([b, b]), a block listed twice, is refused: no refcount falls twice", twice),
            *op_parts(_refcount_goal, rules),
            ("free_blocks is refused for every call (a block listed twice, of refcount 0, or held by a table)",
             refused)]


REFCOUNT_CONTROLS: list[tuple[str, str, PrefixRules, Confirm | None]] = [
    ("free_blocks_unchecked", ("the pool's release decrements each listed block with no check (vLLM's "
     "BlockPool.free_blocks: [b, b] drives a refcount to -1, issue #42571)"), PrefixRules(pool_release="unchecked"),
     DOUBLE_FREE),
    ("popped_block_refcount_zero", "a block popped for a request starts at refcount 0 (MinivLLM PR #87)",
     PrefixRules(pop_refcount=0), REFCOUNT_ZERO),
]


# -- 24 ------------------------------------------------------------------------------


def queue_parts(rules: PrefixRules = PREFIX_SPEC) -> list[tuple[str, PartBuilder]]:
    return op_parts(_queue_goal, rules)


QUEUE_CONTROLS: list[tuple[str, str, PrefixRules, Confirm | None]] = [
    ("touch_leaves_in_queue", "a hit on a cached-free block raises its refcount but leaves it in the free queue",
     PrefixRules(touch="leaves_in_queue"), None),
    ("free_blocks_unchecked", ("the pool's release decrements each listed block with no check: a block a table "
     "holds, or listed twice, joins the free queue (vLLM issue #42571)"), PrefixRules(pool_release="unchecked"),
     QUEUED_TWICE),
]


# -- 25 ------------------------------------------------------------------------------


def hit_parts(rules: PrefixRules = PREFIX_SPEC) -> list[tuple[str, PartBuilder]]:
    def sizes(d: Domain) -> tuple[Any, Any, list[Any]]:
        n, bs = d.var("n"), d.var("B")
        return n, bs, [n >= 1, bs >= 1]

    def largest(d: Domain) -> tuple[list[Any], Any]:
        n, bs, pre = sizes(d)
        cap = max_hit_blocks(d, n, bs, rules)
        return pre, z3.And(cap >= 0, cap * bs <= n - 1, n - 1 < (cap + 1) * bs)

    def whole(d: Domain) -> tuple[list[Any], Any]:
        n, bs, pre = sizes(d)
        j, i = d.var("j"), d.var("i")
        cap = max_hit_blocks(d, n, bs, rules)
        with d.under(z3.And(j >= 0, j <= cap)):
            tokens = d.mul(j, bs, "hit tokens j * B")
        with d.under(z3.And(i >= 0, i < j)):
            full = is_full(d, i, n, bs)
        goal = z3.And(tokens <= d.sub(n, 1, "n - 1"), z3.Implies(z3.And(i >= 0, i < j), full))
        return [*pre, j >= 0, j <= cap], goal

    def new_block(d: Domain) -> tuple[list[Any], Any]:
        n, bs, pre = sizes(d)
        j = d.var("j")
        cap = max_hit_blocks(d, n, bs, rules)
        with d.under(z3.And(j >= 0, j <= cap)):
            need = new_blocks_needed(d, n, j, bs)
        last = d.floordiv(d.sub(n, 1, "n - 1"), bs, "(n - 1) // B")
        # the block of the last token (index (n - 1) // B) is one of the new ones
        return [*pre, j >= 0, j <= cap], z3.And(need >= 1, last >= j, last < j + need)

    return [(("a hit of j <= max_hit_blocks blocks leaves the last token to compute (j * B <= n - 1, no overflow) "
             "and covers full blocks only"), whole),
            ("an admission takes at least one new block, the one of the last token (new_blocks_needed >= 1)",
             new_block),
            ("max_hit_blocks(n, B) = (n - 1) // B is the largest j with j * B <= n - 1", largest)]


HIT_CONTROLS: list[tuple[str, str, PrefixRules, Confirm | None]] = [
    ("uncapped_whole_prompt_hit", "the hit may cover the whole prompt: up to n // B blocks",
     PrefixRules(cap="uncapped"), _uncapped_on_spec),
    ("partial_block_hit", "the hit may cover the partial block: up to ceil(n / B) blocks", PrefixRules(cap="partial"),
     None),
]


# -- 26 ------------------------------------------------------------------------------


def window_parts(rules: PrefixRules = PREFIX_SPEC) -> list[tuple[str, PartBuilder]]:
    """The sliding window's integer rules (``kvspec.spec.prefix.skipped_blocks``,
    ``hit_run``, ``hit_table``), n tokens, block size B, window w and a hit
    of e blocks all unbounded."""

    def sizes(d: Domain) -> tuple[Any, Any, Any, list[Any]]:
        n, bs, w = d.var("n"), d.var("B"), d.var("w")
        return n, bs, w, [n >= 0, bs >= 1, w >= 1]

    def hit_blocks(d: Domain) -> tuple[Any, Any, Any, Any, list[Any]]:
        """A hit of e blocks of a prompt of n >= 1 tokens: never beyond the cap."""
        n, bs, w, pre = sizes(d)
        e = d.var("e")
        return n, bs, w, e, [*pre, n >= 1, e >= 0, e <= max_hit_blocks(d, n, bs, rules)]

    def touched_in_run(d: Domain) -> tuple[list[Any], Any]:
        _, bs, w, e, pre = hit_blocks(d)
        with d.under(z3.And(*pre)):
            s = skipped_blocks(d, d.mul(e, bs, "hit tokens e * B"), w, bs, rules)
        r = hit_run(d, w, bs, rules)
        # the touched entries [s, e) lie in the run [e - r, e) the hit rule found cached
        return pre, z3.And(s <= e, s >= e - r)

    def attended_touched(d: Domain) -> tuple[list[Any], Any]:
        _, bs, w, e, pre = hit_blocks(d)
        p = d.var("p")
        with d.under(z3.And(*pre)):
            hit = d.mul(e, bs, "hit tokens e * B")
            s = skipped_blocks(d, hit, w, bs, rules)
        first = d.add(d.sub(hit, w, "e * B - w"), 1, "e * B - w + 1")
        with d.under(z3.And(p >= 0, p >= first, p < hit)):
            blk = d.floordiv(p, bs, "p // B")
        # every position the first computed token (position e * B) attends is in a touched block
        return [*pre, p >= 0, p >= first, p < hit], z3.And(blk >= s, blk < e)

    def release_unattended(d: Domain) -> tuple[list[Any], Any]:
        n, bs, w, pre = sizes(d)
        i = d.var("i")
        s = skipped_blocks(d, n, w, bs, rules)
        with d.under(z3.And(i >= 0, i < s)):
            last = d.add(d.mul(i, bs, "i * B"), d.sub(bs, 1, "B - 1"), "i * B + B - 1")
        first = d.add(d.sub(n, w, "n - w"), 1, "n - w + 1")
        # a released block ends before the first position the next token (position n) attends,
        # and the release never reaches past the table (ceil(n / B) entries)
        return [*pre, i >= 0, i < s], z3.And(last < first, s <= blocks_for(d, n, bs))

    return [(("a windowed hit of e <= max_hit_blocks blocks touches only blocks of its run: "
              "skipped_blocks(e * B) >= e - hit_run, and never beyond the hit"), touched_in_run),
            ("every position the first token after the hit attends lies in a touched block", attended_touched),
            ("a decode from n tokens releases only blocks wholly before position n's window, within the table",
             release_unattended)]


def _late_release_on_spec() -> tuple[Any, Any, str]:
    """The release a token late on the spec: B = 2, w = 3, a 4-token prompt
    decoded twice; the second decode releases block 1, which holds position
    3, one the new token (position 5) attends."""
    from kvspec.proofs import traces
    from kvspec.spec import prefix as sp

    world = sp.new_world(2, 4, 3)
    ops = [{"op": A, "req": "a", "tokens": [1, 2, 3, 4]}, {"op": "decode", "req": "a", "tokens": [5]},
           {"op": "decode", "req": "a", "tokens": [6]}]
    with traces.patched(sp, skipped_blocks=lambda n, w, bs: max(0, n - w + 2) // bs):
        for op in ops:
            _, world = sp.apply_op(world, op)
            if op["tokens"] == [6]:
                break
            before = world
    # the decode computing position 5 (attending 3 .. 5) ran with the table it left
    table = list(world.requests["a"].table)
    values = {"block_size": 2, "window": 3, "table before": list(before.requests["a"].table), "table after": table}
    if table[1] is not None:
        return None, values, "not confirmed: the spec with the late release keeps block 1 (position 3)"
    return None, values, (f"confirmed on spec with the bug: {'; '.join(_op_text(o) for o in ops)}: the last decode "
                          f"computes position 5, which attends positions 3 to 5 under w = 3, and leaves table "
                          f"{table}: block 1, holding position 3, released")


WINDOW_CONTROLS: list[tuple[str, str, PrefixRules, Confirm | None]] = [
    ("release_one_token_late", "blocks before max(0, n - w + 2) // B released (a token late)",
     PrefixRules(skip="late"), _late_release_on_spec),
    ("run_one_block_short", "a windowed hit needs ceil((w - 1) / B) - 1 cached blocks in a row",
     PrefixRules(run="short"), None),
]


# -- results -------------------------------------------------------------------------


def _prove(number: int, proves: tuple[str, ...], statement: str,
           parts_of: Callable[[PrefixRules], list[tuple[str, PartBuilder]]],
           controls: list[tuple[str, str, PrefixRules, Confirm | None]]) -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(parts_of(PREFIX_SPEC))
    ctl = [control_from_parts(name, text, parts_of(rules), reachable=confirm)
           for name, text, rules, confirm in controls]
    return ObligationResult(number, TITLES[number], proves, statement, overall(parts, ctl), parts, ctl,
                            time.perf_counter() - t0)


def prove_key() -> ObligationResult:
    return _prove(22, ("keys_name_contents", "cached_map_exact", "requests_read_their_rows", "full_blocks_keyed"),
                  "a block reached through a key carries it and holds exactly the rows it names; every live request "
                  "reads its own rows; inductive over admit, resume, decode, free, preempt, reset, free_blocks",
                  key_parts, KEY_CONTROLS)


def prove_refcount() -> ObligationResult:
    return _prove(23, ("refcounts_match_tables", "tables_sized", "partial_tail_private", "free_blocks"),
                  "refcount = live tables holding the block, never negative; a partial tail private; every "
                  "free_blocks call refused (a double free); inductive over every op",
                  refcount_parts, REFCOUNT_CONTROLS)


def prove_queue() -> ObligationResult:
    return _prove(24, ("free_queue_exact",),
                  "the free queue holds exactly the blocks of refcount 0, each once (a hit takes a cached-free block "
                  "out); inductive over every op",
                  queue_parts, QUEUE_CONTROLS)


def prove_hit() -> ObligationResult:
    return _prove(25, ("max_hit_blocks", "is_full", "new_blocks_needed"),
                  "a hit covers at most (n - 1) // B blocks, whole ones: the last token is always computed, in a new "
                  "block of the request's own",
                  hit_parts, HIT_CONTROLS)


def prove_window() -> ObligationResult:
    return _prove(26, ("skipped_blocks", "hit_run", "hit_table"),
                  "a sliding-window hit touches only blocks of the cached run it found, and they hold every row "
                  "the first computed token attends; a decode releases only blocks wholly before its window",
                  window_parts, WINDOW_CONTROLS)


OBLIGATIONS: list[tuple[int, Callable[[], ObligationResult]]] = [
    (22, prove_key), (23, prove_refcount), (24, prove_queue), (25, prove_hit), (26, prove_window)]
