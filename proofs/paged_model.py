"""Z3 encodings of the paged cache's spec functions (``kvspec.spec.paged``), one
per spec function and under its name, and of its operations seen from one
arbitrary block.

Index rules (``block_index``, ``block_slot``, ``table_len``,
``wholly_before``) and the write rules (``needs_copy_on_write``,
``write_in_place``) are encoded directly over symbolic integers.

The operations are encoded as a **block view** (:class:`BlockV`): what one
arbitrary block ``x`` looks like to the pool and to two arbitrary distinct
sequences, the actor ``s`` (the sequence the operation acts on) and another
sequence ``u``:

* ``N``: live sequences; ``rc``: x's refcount; ``free``: x is on the free
  list; ``holders``: the number of live sequences whose table holds x
  (``sum_i h(i, x)`` with ``h(i, x) = 1`` iff sequence i holds x);
* per sequence (:class:`SeqV`): live or not, length, logical start, and
  ``pos``: the table index at which it holds x, or -1.

An operation changes one sequence's table only (fork: it creates one), so
the holder count changes by that sequence's term alone: ``holders' =
holders - h(s, x) + h'(s, x)`` (a sum that differs in one term). That is
how ``holders`` is updated here, and why a quantifier-free view of one
block and two sequences proves the invariant for any number of sequences:
the block, the actor and the other sequence are arbitrary.

``tests/test_proofs_fidelity_paged.py`` compares every function here with
``kvspec.spec.paged`` on concrete worlds. Buggy variants for the negative controls
are selected by :class:`PagedRules`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import z3

from kvspec.proofs.domain import Domain


@dataclass(frozen=True)
class PagedRules:
    """The spec's rules by default; other values are negative controls (the
    injected bugs of the catalog, same names)."""

    cow: str = "spec"  # | "never" (write into a shared block without copy-on-write)
    table: str = "spec"  # | "visible_len" (table sized from length - start)
    trim_release: str = "spec"  # | "keep_tail" (trim does not release tail blocks)
    release: str = "spec"  # | "frees_shared" (release frees a block others hold)
    cow_old_refcount: str = "spec"  # | "kept" (copy-on-write leaves the old block's refcount raised)


PAGED_SPEC = PagedRules()


# ---------------------------------------------------------------------------
# Index and write rules


def mod(d: Domain, a: Any, b: Any) -> Any:
    """Python's ``a % b``."""
    return d.sub(a, d.mul(d.floordiv(a, b, "a // bs"), b, "(a // bs) * bs"), "a % bs")


def block_index(d: Domain, position: Any, block_size: Any) -> Any:
    return d.floordiv(position, block_size, "position // block_size")


def block_slot(d: Domain, position: Any, block_size: Any) -> Any:
    return mod(d, position, block_size)


def table_len(d: Domain, length: Any, block_size: Any) -> Any:
    return d.ceildiv(length, block_size)


def table_entries(d: Domain, s: SeqV, block_size: Any, rules: PagedRules = PAGED_SPEC) -> Any:
    """How many entries the block table of ``s`` has: ``table_len(length)``
    (the bug sizes it from the visible length)."""
    if rules.table == "visible_len":
        return table_len(d, d.sub(s.L, s.S, "length - start"), block_size)
    return table_len(d, s.L, block_size)


def wholly_before(d: Domain, index: Any, start: Any, block_size: Any) -> Any:
    return index < d.floordiv(start, block_size, "start // block_size")


def needs_copy_on_write(refcount: Any, rules: PagedRules = PAGED_SPEC) -> Any:
    return z3.BoolVal(False) if rules.cow == "never" else refcount > 1


def write_in_place(switch: Any, refcount: Any, position: Any, length: Any) -> Any:
    return z3.And(switch, refcount == 1, position == length)


# ---------------------------------------------------------------------------
# The block view


@dataclass(frozen=True)
class SeqV:
    alive: Any
    L: Any  # length (offset)
    S: Any  # logical start
    pos: Any  # table index holding x, or -1


@dataclass(frozen=True)
class BlockV:
    bs: Any
    N: Any
    rc: Any
    free: Any
    holders: Any
    s: SeqV  # the actor
    u: SeqV  # another sequence (u != s)


def seq_vars(d: Domain, p: str) -> SeqV:
    return SeqV(d.boolean(f"{p}alive"), d.var(f"{p}len"), d.var(f"{p}start"), d.var(f"{p}pos"))


def block_vars(d: Domain, p: str = "") -> BlockV:
    return BlockV(d.var(f"{p}block_size"), d.var(f"{p}N"), d.var(f"{p}rc"), d.boolean(f"{p}free"),
                  d.var(f"{p}holders"), seq_vars(d, f"{p}s."), seq_vars(d, f"{p}u."))


def holds(s: SeqV) -> Any:
    """``h(s, x)`` as 0/1."""
    return z3.If(s.pos >= 0, 1, 0)


def seq_well_formed(d: Domain, s: SeqV, bs: Any, rules: PagedRules = PAGED_SPEC) -> Any:
    """A dead sequence holds nothing; ``0 <= start <= length``; an index
    holding x lies inside the table and not wholly before the start
    (kvspec.spec.paged.tables_well_formed)."""
    with d.under(s.pos >= 0):
        inside = z3.And(z3.Not(wholly_before(d, s.pos, s.S, bs)), s.pos < table_entries(d, s, bs, rules))
    return z3.And(z3.Implies(z3.Not(s.alive), s.pos < 0),
                  z3.Implies(s.alive, z3.And(0 <= s.S, s.S <= s.L)),
                  z3.Implies(s.pos >= 0, z3.And(s.alive, inside)))


def sum_facts(v: BlockV) -> Any:
    """What ``holders`` is by definition, in any state: a sum over the live
    sequences of 0/1 terms, so at least the actor's and the other's terms
    together, at most N; N counts the actor and the other if they live.
    (Premises about the state before an operation only: the state after
    must earn its facts.)"""
    alive_count = z3.If(v.s.alive, 1, 0) + z3.If(v.u.alive, 1, 0)
    return z3.And(v.holders >= holds(v.s) + holds(v.u), v.holders <= v.N, v.N >= alive_count)


def refcount_invariant(d: Domain, v: BlockV, rules: PagedRules = PAGED_SPEC) -> Any:
    """The refcount invariant seen from block x: refcount = number of
    tables holding it (kvspec.spec.paged.refcounts_match_tables); on the free
    list iff refcount 0 (kvspec.spec.paged.free_blocks_unheld, blocks_accounted);
    both sequences' tables well formed (kvspec.spec.paged.tables_well_formed)."""
    return z3.And(v.bs >= 1, v.rc == v.holders, v.free == (v.rc == 0),
                  seq_well_formed(d, v.s, v.bs, rules), seq_well_formed(d, v.u, v.bs, rules))


def initial(v: BlockV) -> Any:
    """A fresh pool with its one empty sequence ``main``: x not yet
    allocated (a block the pool will grow is free), nobody holds it."""
    empty = lambda s: z3.And(s.L == 0, s.S == 0, s.pos == -1)
    return z3.And(v.bs >= 1, v.N == 1, v.rc == 0, v.holders == 0, v.free, empty(v.s), empty(v.u),
                  z3.Not(z3.And(v.s.alive, v.u.alive)))


def _released(d: Domain, v: BlockV, s: SeqV, cut: Any, rules_kept: bool = False) -> BlockV:
    """``s``'s table stops holding x where ``cut`` holds: the holder count
    loses s's term, the refcount falls by one (kvspec.spec.paged.release_block)
    unless the buggy rule keeps it."""
    with d.under(cut):
        rc1 = d.sub(v.rc, 1, "rc - 1")
        h1 = d.sub(v.holders, 1, "holders - 1")
    rc = v.rc if rules_kept else z3.If(cut, rc1, v.rc)
    return replace(v, rc=rc, free=z3.If(cut, rc == 0, v.free), holders=z3.If(cut, h1, v.holders),
                   s=replace(s, pos=z3.If(cut, -1, s.pos)))


@dataclass(frozen=True)
class AppendV:
    """An append seen from x: the next view, whether x is the block the
    first row is written into, whether it went there by copy-on-write,
    whether the write into x goes in place."""

    after: BlockV
    written: Any
    cow: Any
    inplace: Any


def append(d: Domain, v: BlockV, n: Any, taken: Any, q: Any, switch: Any,
           rules: PagedRules = PAGED_SPEC) -> AppendV:
    """kvspec.spec.paged.append of ``n`` rows by the actor. The first row's block
    index ``b0 = block_index(length)``: if the actor holds x there and x is
    shared, x is copied (copy-on-write: the actor's term and one refcount
    leave x). ``taken``: x is one of the blocks this append allocates (it
    was free), placed at table index ``q`` (``b0`` for a copy, a new entry
    past the table otherwise)."""
    s, bs = v.s, v.bs
    b0 = block_index(d, s.L, bs)
    hi = table_entries(d, s, bs, rules)
    target = z3.And(s.pos == b0, b0 < hi)
    cow = z3.And(target, needs_copy_on_write(v.rc, rules))
    # the buggy rule copies and repoints but leaves the old refcount raised
    after = _released(d, v, s, cow, rules.cow_old_refcount == "kept")
    L1 = d.stored("length + n", lambda d, a, b: d.add(a, b, "length + n"), s.L, n)
    with d.under(taken):
        h1 = d.stored("holders + 1", lambda d, a: d.add(a, 1, "holders + 1"), v.holders)
    after = replace(after, rc=z3.If(taken, 1, after.rc), free=z3.If(taken, False, after.free),
                    holders=z3.If(taken, h1, after.holders))
    after = replace(after, s=replace(after.s, L=L1, pos=z3.If(taken, q, after.s.pos)))
    written = z3.Or(z3.And(target, z3.Not(cow)), taken)
    inplace = z3.And(written, write_in_place(switch, after.rc, s.L, s.L))
    return AppendV(after, written, cow, inplace)


def append_guard(d: Domain, v: BlockV, n: Any, taken: Any, q: Any, rules: PagedRules = PAGED_SPEC) -> Any:
    """What the spec guarantees about the allocation: an allocated block
    was free, and its index is the copied first block or a new entry in
    ``[table_len(length), block_index(length + n - 1)]``."""
    s, bs = v.s, v.bs
    b0 = block_index(d, s.L, bs)
    hi = table_entries(d, s, bs, rules)
    last = block_index(d, d.add(s.L, d.sub(n, 1, "n - 1"), "length + n - 1"), bs)
    placed = z3.Or(z3.And(q >= hi, q <= last), z3.And(q == b0, b0 < hi))  # a new entry, or the copy
    return z3.And(s.alive, n >= 1, z3.Implies(taken, z3.And(v.free, placed)))


def trim(d: Domain, v: BlockV, n: Any, rules: PagedRules = PAGED_SPEC) -> BlockV:
    """kvspec.spec.paged.trim of ``n`` rows by the actor: ``length -= clamp(n, 0,
    visible)``; the table loses every index at or past ``table_len(length)``."""
    s = v.s
    k = d.clamp(n, 0, d.sub(s.L, s.S, "visible"))
    L1 = d.sub(s.L, k, "length - n")
    s1 = replace(s, L=L1)
    cut = z3.And(s.pos >= 0, s.pos >= table_entries(d, s1, v.bs, rules))
    after = _released(d, replace(v, s=s1), s1, cut, rules.trim_release == "keep_tail")
    return after


def trim_front(d: Domain, v: BlockV, n: Any) -> BlockV:
    """kvspec.spec.paged.trim_front: the start moves by ``clamp(n, 0, visible)``;
    every index wholly before it is released."""
    s = v.s
    k = d.clamp(n, 0, d.sub(s.L, s.S, "visible"))
    S1 = d.add(s.S, k, "start + n")
    s1 = replace(s, S=S1)
    with d.under(s.pos >= 0):
        gone = wholly_before(d, s.pos, S1, v.bs)
    return _released(d, replace(v, s=s1), s1, z3.And(s.pos >= 0, gone))


def fork(d: Domain, v: BlockV) -> tuple[BlockV, SeqV]:
    """kvspec.spec.paged.fork of the actor into a new sequence: the new table is a
    copy of the actor's, so x gains a holder and a refcount iff the actor
    holds it. Returns the next view and the new sequence."""
    with d.under(v.s.pos >= 0):
        rc1 = d.stored("rc + 1", lambda d, a: d.add(a, 1, "rc + 1"), v.rc)
        h1 = d.stored("holders + 1", lambda d, a: d.add(a, 1, "holders + 1"), v.holders)
    N1 = d.stored("N + 1", lambda d, a: d.add(a, 1, "N + 1"), v.N)
    held = v.s.pos >= 0
    after = replace(v, N=N1, rc=z3.If(held, rc1, v.rc), holders=z3.If(held, h1, v.holders),
                    free=z3.If(held, False, v.free))
    return after, v.s


def release(d: Domain, v: BlockV, rules: PagedRules = PAGED_SPEC) -> BlockV:
    """kvspec.spec.paged.release of the actor: its term leaves the holder count and
    one refcount leaves x if it held x; the actor is gone (the buggy rule
    frees x whatever the refcount)."""
    cut = v.s.pos >= 0
    after = _released(d, v, v.s, cut)
    if rules.release == "frees_shared":
        after = replace(after, rc=z3.If(cut, 0, after.rc), free=z3.If(cut, True, after.free))
    N1 = d.sub(v.N, 1, "N - 1")
    return replace(after, N=N1, s=SeqV(z3.BoolVal(False), v.s.L, v.s.S, z3.IntVal(-1)))
