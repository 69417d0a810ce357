"""The paged cache's obligation 6, "paged copy on write".

Parts, each proved over unbounded integers and 32-bit integers for every
block size, sequence count, length, start and position
(:mod:`kvspec.proofs.paged_model` encodes the spec functions under their names):

* **addressing**: a visible row's block-table index (``block_index`` of its
  absolute position) lies inside the table (``table_len(length)``) and not
  wholly before the logical start, and distinct positions get distinct
  (index, slot) pairs;
* **isolation**: every block an append writes into (after the
  copy-on-write rule) is held by the writer alone, so no other sequence's
  view changes; an in-place write needs a refcount of 1;
* **refcount invariant**, inductive: holds initially and is preserved by
  append, trim, trim_front, fork and release.

Negative controls (each one of the catalog's injected bugs, same name) must
be refuted: a write into a shared block without copy-on-write (confirmed on
``kvspec.spec.paged`` with the rule patched out: a kvtrace from an empty pool), the
table sized from the visible length, a trim that keeps tail blocks, a
release that frees a block others hold (confirmed on the spec too),
copy-on-write that leaves the old block's refcount raised.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import z3

from kvspec.proofs import traces
from kvspec.proofs.core import ObligationResult, PartBuilder, control_from_parts, overall, run_parts
from kvspec.proofs.domain import Domain, solver
from kvspec.proofs.paged_model import (
    PAGED_SPEC,
    BlockV,
    PagedRules,
    append,
    append_guard,
    block_index,
    block_slot,
    block_vars,
    fork,
    holds,
    initial,
    refcount_invariant,
    release,
    seq_vars,
    sum_facts,
    table_entries,
    trim,
    trim_front,
    wholly_before,
)

REQUIRED = ("block_index", "block_slot", "table_len", "wholly_before", "needs_copy_on_write", "write_in_place",
            "append", "trim", "trim_front", "fork", "release", "release_block", "apply_op")


def available() -> bool:
    """spec/paged.py exists and has the functions these proofs encode."""
    try:
        from kvspec.spec import paged as sp
    except ImportError:
        return False
    return all(hasattr(sp, name) for name in REQUIRED)


def addressing_parts(rules: PagedRules = PAGED_SPEC) -> list[tuple[str, PartBuilder]]:
    def inside(d: Domain) -> tuple[list[Any], Any]:
        s, bs, p = seq_vars(d, "s."), d.var("block_size"), d.var("position")
        b = block_index(d, p, bs)
        with d.under(b >= 0):
            ok = z3.And(b >= 0, z3.Not(wholly_before(d, b, s.S, bs)), b < table_entries(d, s, bs, rules))
        return [bs >= 1, 0 <= s.S, s.S <= p, p < s.L], ok

    def distinct(d: Domain) -> tuple[list[Any], Any]:
        bs, p, q = d.var("block_size"), d.var("position"), d.var("q")
        same = z3.And(block_index(d, p, bs) == block_index(d, q, bs), block_slot(d, p, bs) == block_slot(d, q, bs))
        return [bs >= 1, p >= 0, q >= 0, p != q], z3.Not(same)

    return [("a visible row's table index is held: inside the table, not before the start", inside),
            ("distinct positions, distinct (block index, slot)", distinct)]


def _append_vars(d: Domain) -> tuple[BlockV, Any, Any, Any, Any]:
    return block_vars(d), d.var("n"), d.boolean("taken"), d.var("q"), d.boolean("switch")


def isolation_parts(rules: PagedRules = PAGED_SPEC) -> list[tuple[str, PartBuilder]]:
    def isolated(d: Domain) -> tuple[list[Any], Any]:
        v, n, taken, q, sw = _append_vars(d)
        out = append(d, v, n, taken, q, sw, rules)
        pre = [sum_facts(v), refcount_invariant(d, v, rules), append_guard(d, v, n, taken, q, rules)]
        alone = z3.And(out.after.holders == 1, out.after.s.pos >= 0, holds(out.after.u) == 0)
        return pre, z3.Implies(out.written, alone)

    def inplace_alone(d: Domain) -> tuple[list[Any], Any]:
        v, n, taken, q, sw = _append_vars(d)
        out = append(d, v, n, taken, q, sw, rules)
        pre = [sum_facts(v), refcount_invariant(d, v, rules), append_guard(d, v, n, taken, q, rules)]
        return pre, z3.Implies(out.inplace, z3.And(out.after.rc == 1, holds(out.after.u) == 0))

    return [("every block an append writes is held by the writer alone", isolated),
            ("an in-place write lands in a block of refcount 1 nobody else holds", inplace_alone)]


def invariant_parts(rules: PagedRules = PAGED_SPEC) -> list[tuple[str, PartBuilder]]:
    def init(d: Domain) -> tuple[list[Any], Any]:
        v = block_vars(d)
        return [initial(v)], z3.And(refcount_invariant(d, v, rules), sum_facts(v))

    def step(t: Callable[[Domain, BlockV], tuple[Any, list[BlockV]]]) -> PartBuilder:
        def build(d: Domain) -> tuple[list[Any], Any]:
            v = block_vars(d)
            guard, afters = t(d, v)
            pre = [sum_facts(v), refcount_invariant(d, v, rules), v.s.alive, guard]
            return pre, z3.And(*[refcount_invariant(d, a, rules) for a in afters])
        return build

    def t_append(d: Domain, v: BlockV) -> tuple[Any, list[BlockV]]:
        _, n, taken, q, sw = _append_vars(d)
        return append_guard(d, v, n, taken, q, rules), [append(d, v, n, taken, q, sw, rules).after]

    def t_trim(d: Domain, v: BlockV) -> tuple[Any, list[BlockV]]:
        return z3.BoolVal(True), [trim(d, v, d.var("n"), rules)]

    def t_trim_front(d: Domain, v: BlockV) -> tuple[Any, list[BlockV]]:
        return z3.BoolVal(True), [trim_front(d, v, d.var("n"))]

    def t_fork(d: Domain, v: BlockV) -> tuple[Any, list[BlockV]]:
        after, new = fork(d, v)
        # the new sequence next to the source and next to the other one
        return z3.BoolVal(True), [after, replace(after, s=new, u=after.s), replace(after, s=new)]

    def t_release(d: Domain, v: BlockV) -> tuple[Any, list[BlockV]]:
        return z3.BoolVal(True), [release(d, v, rules)]

    return [("refcount invariant: init", init), ("refcount invariant: preserved by append", step(t_append)),
            ("refcount invariant: preserved by trim", step(t_trim)),
            ("refcount invariant: preserved by trim_front", step(t_trim_front)),
            ("refcount invariant: preserved by fork", step(t_fork)),
            ("refcount invariant: preserved by release", step(t_release))]


def all_parts(rules: PagedRules = PAGED_SPEC) -> list[tuple[str, PartBuilder]]:
    return addressing_parts(rules) + isolation_parts(rules) + invariant_parts(rules)


# -- negative controls confirmed on the spec's own code -----------------------


def _no_cow(refcount: int) -> bool:
    return False


def _release_block_frees_shared(pool: Any, block: int) -> Any:
    """Bug: a release frees the block whatever its refcount."""

    rc = pool.refcounts
    pool = replace(pool, refcounts=rc[:block] + (0,) + rc[block + 1:])
    return replace(pool, free=tuple(sorted({*pool.free, block})))


def paged_trace(title: str, cache: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``kind: paged`` kvtrace whose checks come from the correct spec:
    appends get ``inplace`` and ``capacity``, trims ``returns``, and one
    ``expect`` per live sequence at the end."""
    from kvspec.spec import paged as sp

    world = sp.new_world(cache["block_size"], cache.get("max_blocks"), cache.get("chunk", 1),
                         cache.get("inplace", True))
    out = []
    for op in ops:
        result, world = sp.apply_op(world, op)
        op = dict(op)
        seq = op.get("seq", sp.MAIN)
        if op["op"] == "append":
            op["inplace"] = result.inplace
            op["capacity"] = sp.capacity_of(len(world.seqs[seq].table), cache["block_size"])
        elif op["op"] in ("trim", "trim_to", "trim_front"):
            op["returns"] = result
        out.append(op)
    out += [{"op": "expect", "seq": name, "window": list(world.window(name))} for name in sorted(world.seqs)]
    return traces.kvtrace(title, cache, out, kind="paged")


def _spec_run(cache: dict[str, Any], ops: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
    from kvspec.spec import paged as sp

    world = sp.new_world(cache["block_size"])
    steps = []
    for op in ops:
        _, after = sp.apply_op(world, op)
        steps.append((world, after))
        world = after
    return steps


def _small_block_size(part: PartBuilder) -> int:
    d = Domain("int")
    premises, goal = part(d)
    s = solver(10_000)
    s.add(*premises, z3.Not(goal), z3.Int("block_size") <= 4, z3.Int("block_size") >= 2)
    if s.check() != z3.sat:
        return 2
    return s.model().eval(z3.Int("block_size"), model_completion=True).as_long()


def _no_cow_reachable() -> tuple[Any, Any, str]:
    from kvspec.spec import paged as sp

    part = dict(isolation_parts(PagedRules(cow="never")))["every block an append writes is held by the writer alone"]
    bs = _small_block_size(part)
    cache = {"block_size": bs}
    # a prompt that ends inside a block, forked; both continue with their
    # own next row, which lands in the shared tail block's same slot
    ops = [{"op": "append", "n": 1}, {"op": "fork", "from": "main", "as": "b"}, {"op": "append", "n": 1, "seq": "b"},
           {"op": "append", "n": 1}]
    with traces.patched(sp, needs_copy_on_write=_no_cow):
        before, after = _spec_run(cache, ops)[-1]
    if sp.views_unchanged(before, after, "main"):
        return None, {"block_size": bs}, "the spec without copy-on-write leaves b's view alone"
    seen = sp.gather(after.pool, after.seqs["b"])
    doc = paged_trace(f"negative control paged_no_cow: main's decode writes block {before.seqs['main'].table[0]} "
                      "slot 1, which b (forked from main) holds and sees", cache, ops)
    return doc, {"block_size": bs}, (
        f"confirmed on spec with the bug: b's window becomes {list(seen)} after main's write; "
        f"the correct rule copies the shared block first (b keeps {list(before.window('b'))})")


def _release_reachable() -> tuple[Any, Any, str]:
    from kvspec.spec import paged as sp

    cache = {"block_size": 2}
    ops = [{"op": "append", "n": 3}, {"op": "fork", "from": "main", "as": "b"}, {"op": "release", "seq": "b"},
           {"op": "fork", "from": "main", "as": "c"}, {"op": "append", "n": 2, "seq": "c"}]
    with traces.patched(sp, release_block=_release_block_frees_shared):
        steps = _spec_run(cache, ops[:3])
    broken = sp.broken_invariants(steps[-1][1])
    if not broken:
        return None, None, "the spec with the buggy release keeps every invariant"
    doc = paged_trace("negative control paged_release_frees_shared: releasing b frees blocks main still holds",
                      cache, ops)
    return doc, {"block_size": 2}, f"confirmed on spec with the bug: after release of b it breaks {', '.join(broken)}"


CONTROLS: list[tuple[str, str, PagedRules, Callable[[], tuple[Any, Any, str]] | None]] = [
    ("paged_no_cow", "a write into a block of refcount > 1 goes without copy-on-write", PagedRules(cow="never"),
     _no_cow_reachable),
    ("paged_table_from_visible_len", "the block table is sized from length - start, not the absolute length",
     PagedRules(table="visible_len"), None),
    ("paged_trim_keeps_tail", "trim cuts the table but does not release the tail blocks",
     PagedRules(trim_release="keep_tail"), None),
    ("paged_release_frees_shared", "release frees a block another sequence still holds",
     PagedRules(release="frees_shared"), _release_reachable),
    ("paged_cow_keeps_old_refcount", "copy-on-write copies the block but leaves the old refcount raised",
     PagedRules(cow_old_refcount="kept"), None),
]


def prove_paged() -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(all_parts())
    controls = [control_from_parts(name, rule, all_parts(rules), reachable=reach)
                for name, rule, rules, reach in CONTROLS]
    return ObligationResult(
        6, "paged copy on write", ("needs_copy_on_write", "write_in_place", "block_index", "table_len"),
        "a block is written only when its writer alone holds it (copy-on-write first otherwise); a visible row's "
        "table index is held; refcount = tables holding the block, inductively over append/trim/fork/release",
        overall(parts, controls), parts, controls, time.perf_counter() - t0)


OBLIGATIONS: list[tuple[int, Callable[[], ObligationResult]]] = [(6, prove_paged)]
