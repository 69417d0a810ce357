"""Z3 encodings of the cells kind's rules (``kvspec.spec.cells``), for obligations
17 to 21 (``proofs/cells.py``).

A store is a bounded model: :data:`N` cells and :data:`S` sequence ids
(obligation 19 two stores, the memory of an iSWA model). Cell ``i`` has
``used[i]`` (the cell is taken), ``mem[i][s]`` (sequence s holds it),
``pos[i]`` (its position), ``lost[i]`` (window store: dropped by a decode,
kept for the logical positions; the spec's ``Cell.lost``), ``shift[i]`` (the
pending shift an implementation keeps) and ``rot[i]`` (the position its K
row is rotated for). The model's cells are the store's present and lost
cells; which physical slot a cell takes is not observable and not modelled.

Every op is the spec's rule (``kvspec.spec.cells``); a field of :class:`Rules`
other than its default is a negative control (a known bug or a weakened
rule), which the obligation must refute. Positions a store keeps (``pos +
delta``, ``pos0``, a pending shift) are stored values: in bv32 the run
assumes they fit (a 32-bit port refuses a shift past ``INT32_MAX``);
intermediate arithmetic is a no-overflow obligation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import z3

from kvspec.proofs.domain import Domain

#: cells per store and sequence ids in the bounded models
N, S = 3, 2


@dataclass(frozen=True)
class Rules:
    """The spec's rules by default; other values are negative controls."""

    free: str = "spec"  # | "all_only" (only seq_rm(-1) frees a cell) | "keep_used" (seq_keep frees nothing)
    #                     | "shift_keeps_seqs" (a cell shifted below 0 is freed but keeps its sequences)
    cp_check: bool = True  # seq_cp refuses a collision
    add_check: bool = True  # seq_add / seq_div refuse a collision
    pos0_check: bool = True  # decode: pos0 == logical pos_max + 1 for a sequence that holds positions
    restore_clears: bool = True  # restore clears dst before writing
    pending: str = "accumulate"  # | "overwrite" (#3825: the pending shift is set, not added)
    div_pending: str = "accumulate"  # | "overwrite" (seq_div sets the pending shift to new - old)
    atomic: str = "spec"  # | "per_store" (iSWA seq_rm: each store removes, results ANDed)
    #                       | "drop_first" (decode drops windowed cells before the room check)
    #                       | "clear_first" (restore clears dst before the room check)
    rm_rule: str = "spec"  # | "always" (llama.cpp: seq_rm returns true) | "old_max" (checked against the old pos_max)
    drop_slack: int = 0  # a decode may drop a cell with pos_max + 1 - pos >= w - drop_slack (1: off by one)
    compose: str = "spec"  # | "no_edge" (shift composition claimed without the range-edge condition)


SPEC = Rules()


@dataclass(frozen=True)
class Store:
    used: tuple[Any, ...]
    mem: tuple[tuple[Any, ...], ...]
    pos: tuple[Any, ...]
    lost: tuple[Any, ...]
    shift: tuple[Any, ...]
    rot: tuple[Any, ...]


def store_vars(d: Domain, name: str = "c") -> Store:
    return Store(tuple(d.boolean(f"{name}_used_{i}") for i in range(N)),
                 tuple(tuple(d.boolean(f"{name}_seq_{i}_{s}") for s in range(S)) for i in range(N)),
                 tuple(d.var(f"{name}_pos_{i}") for i in range(N)),
                 tuple(d.boolean(f"{name}_lost_{i}") for i in range(N)),
                 tuple(d.var(f"{name}_shift_{i}") for i in range(N)),
                 tuple(d.var(f"{name}_rot_{i}") for i in range(N)))


def same(a: Store, b: Store) -> Any:
    """The two stores are equal (used cells' contents; a free cell's
    leftovers do not count)."""
    out = []
    for i in range(N):
        live = a.used[i]
        out.append(a.used[i] == b.used[i])
        out.append(z3.Implies(live, z3.And(a.pos[i] == b.pos[i], a.lost[i] == b.lost[i],
                                           *[a.mem[i][s] == b.mem[i][s] for s in range(S)])))
    return z3.And(*out)


def freed_iff_empty(st: Store) -> Any:
    """Invariant (a): a cell is used exactly when its set is non-empty."""
    return z3.And(*[st.used[i] == z3.Or(*st.mem[i]) for i in range(N)])


def holds(st: Store, i: int, s: Any) -> Any:
    """Cell ``i`` is used and held by sequence ``s`` (a symbolic id)."""
    return z3.And(st.used[i], z3.Or(*[z3.And(s == j, st.mem[i][j]) for j in range(S)]))


def unique(st: Store) -> Any:
    """Invariant (b): per sequence, no two of its cells (present or lost)
    share a position."""
    return z3.And(*[z3.Implies(z3.And(st.used[i], st.used[k], st.mem[i][s], st.mem[k][s]), st.pos[i] != st.pos[k])
                    for i in range(N) for k in range(i + 1, N) for s in range(S)])


def positions_ok(st: Store) -> Any:
    return z3.And(*[z3.Implies(st.used[i], st.pos[i] >= 0) for i in range(N)])


def rows_named(st: Store) -> Any:
    """Each used cell's K row, once its pending shift is applied, is rotated
    for its position: ``rot + shift == pos`` (section 3's naming rule)."""
    return z3.And(*[z3.Implies(st.used[i], st.rot[i] + st.shift[i] == st.pos[i]) for i in range(N)])


def lpmax(st: Store, s: Any) -> Any:
    """The largest logical position of ``s`` (present or lost cells), -1 if
    none."""
    out: Any = z3.IntVal(-1)
    for i in range(N):
        out = z3.If(z3.And(holds(st, i, s), st.pos[i] > out), st.pos[i], out)
    return out


def in_range(pos: Any, p0: Any, p1: Any, inf: Any) -> Any:
    """``pos`` in ``[p0, p1)`` (``inf``: no upper bound); ``p0 >= 0``."""
    return z3.And(pos >= p0, z3.Or(inf, pos < p1))


def window_ok(d: Domain, st: Store, s: Any, w: Any) -> Any:
    """The window rule for ``s``: no lost position of ``s`` in its next
    decode's window (``q <= lpmax + 1 - w``)."""
    nxt = d.stored("next decode position pos_max + 1", lambda dd, v: dd.add(v, 1, "pos_max + 1"), lpmax(st, s))
    edge = d.sub(nxt, w, "pos_max + 1 - w")
    return z3.And(*[z3.Implies(z3.And(holds(st, i, s), st.lost[i]), st.pos[i] <= edge) for i in range(N)])


# -- ops ------------------------------------------------------------------------------


def seq_rm(st: Store, s: Any, every: Any, p0: Any, p1: Any, inf: Any, rules: Rules = SPEC) -> Store:
    """Remove ``s`` (``every``: every sequence) from the cells in range; a
    cell whose set becomes empty is freed."""
    mem, used = [], []
    for i in range(N):
        hit = z3.And(st.used[i], in_range(st.pos[i], p0, p1, inf))
        row = tuple(z3.And(st.mem[i][j], z3.Not(z3.And(hit, z3.Or(every, s == j)))) for j in range(S))
        mem.append(row)
        if rules.free == "all_only":
            used.append(z3.And(st.used[i], z3.Not(z3.And(hit, every))))
        else:
            used.append(z3.And(st.used[i], z3.Or(*row)))
    return replace(st, mem=tuple(mem), used=tuple(used))


def seq_keep(st: Store, s: Any, rules: Rules = SPEC) -> Store:
    mem = tuple(tuple(z3.And(st.mem[i][j], s == j) for j in range(S)) for i in range(N))
    used = st.used if rules.free == "keep_used" else tuple(z3.And(st.used[i], z3.Or(*mem[i])) for i in range(N))
    return replace(st, mem=mem, used=used)


def seq_add(d: Domain, st: Store, s: Any, p0: Any, p1: Any, inf: Any, delta: Any,
            rules: Rules = SPEC) -> tuple[Any, Store]:
    """``(accepted, store)``: the cells of ``s`` in range move by ``delta``
    (for every holder); one below 0 is freed; refused when a sequence would
    hold two cells at one position."""
    pos, used, mem, shift = [], [], [], []
    for i in range(N):
        moved = z3.And(holds(st, i, s), in_range(st.pos[i], p0, p1, inf))
        np = d.stored("shifted position pos + delta", lambda dd, a, b: dd.add(a, b, "pos + delta"), st.pos[i], delta)
        freed = z3.And(moved, np < 0)
        pos.append(z3.If(moved, np, st.pos[i]))
        used.append(z3.And(st.used[i], z3.Not(freed)))
        mem.append(st.mem[i] if rules.free == "shift_keeps_seqs" else
                   tuple(z3.And(st.mem[i][j], z3.Not(freed)) for j in range(S)))
        acc = d.stored("pending shift + delta", lambda dd, a, b: dd.add(a, b, "shift + delta"), st.shift[i], delta)
        shift.append(z3.If(moved, delta if rules.pending == "overwrite" else acc, st.shift[i]))
    new = replace(st, pos=tuple(pos), used=tuple(used), mem=tuple(mem), shift=tuple(shift))
    ok = unique(new) if rules.add_check else z3.BoolVal(True)
    return ok, new


def seq_div(d: Domain, st: Store, s: Any, p0: Any, p1: Any, inf: Any, k: Any,
            rules: Rules = SPEC) -> tuple[Any, Store]:
    """``(accepted, store)``: ``pos //= k`` (``k >= 1``) for the cells of
    ``s`` in range; the pending shift grows by ``new - old``."""
    pos, shift = [], []
    for i in range(N):
        moved = z3.And(holds(st, i, s), in_range(st.pos[i], p0, p1, inf))
        np = d.floordiv(st.pos[i], k, "pos // d")
        dlt = d.sub(np, st.pos[i], "new - old")
        acc = d.stored("pending shift + (new - old)", lambda dd, a, b: dd.add(a, b, "shift + (new - old)"),
                       st.shift[i], dlt)
        pos.append(z3.If(moved, np, st.pos[i]))
        shift.append(z3.If(moved, dlt if rules.div_pending == "overwrite" else acc, st.shift[i]))
    new = replace(st, pos=tuple(pos), shift=tuple(shift))
    return (unique(new) if rules.add_check else z3.BoolVal(True)), new


def seq_cp(st: Store, src: Any, dst: Any, p0: Any, p1: Any, inf: Any, rules: Rules = SPEC) -> tuple[Any, Store]:
    """``(accepted, store)``: ``dst`` joins every cell of ``src`` in range
    (sharing); refused when ``dst`` would hold two cells at one position."""
    mem = []
    for i in range(N):
        gets = z3.And(holds(st, i, src), in_range(st.pos[i], p0, p1, inf))
        mem.append(tuple(z3.Or(st.mem[i][j], z3.And(gets, dst == j)) for j in range(S)))
    new = replace(st, mem=tuple(mem))
    return (unique(new) if rules.cp_check else z3.BoolVal(True)), new


def write(st: Store, i: int, group: tuple[Any, ...], p: Any, lost: Any = False) -> Store:
    """Cell ``i`` becomes a new cell at ``p`` held by ``group`` (a Bool per
    sequence), pending shift 0, K row rotated for ``p``."""
    def put(t: tuple[Any, ...], v: Any) -> tuple[Any, ...]:
        return t[:i] + (v,) + t[i + 1:]
    return replace(st, used=put(st.used, z3.BoolVal(True)), mem=put(st.mem, group), pos=put(st.pos, p),
                   lost=put(st.lost, z3.BoolVal(lost) if isinstance(lost, bool) else lost),
                   shift=put(st.shift, z3.IntVal(0)), rot=put(st.rot, p))


def out_of_window_encoded(d: Domain, pos: Any, top: Any, w: Any, rules: Rules = SPEC) -> Any:
    """``kvspec.spec.cells.out_of_window(pos, top, w)``: ``(top + 1) - pos >= w``
    (the control ``drop_slack``: ``>= w - slack``)."""
    nxt = d.stored("pos_max + 1", lambda dd, v: dd.add(v, 1, "pos_max + 1"), top)
    return d.sub(nxt, pos, "pos_max + 1 - pos") >= w - rules.drop_slack


def droppable(d: Domain, st: Store, i: int, w: Any, rules: Rules = SPEC) -> Any:
    """Cell ``i`` (present) is held by exactly one sequence h and ``pos_max(h)
    + 1 - pos >= w`` (``kvspec.spec.cells.out_of_window``)."""
    alts = []
    for h in range(S):
        only = z3.And(st.mem[i][h], *[z3.Not(st.mem[i][j]) for j in range(S) if j != h])
        with d.under(z3.And(st.used[i], z3.Not(st.lost[i]), only)):
            alts.append(z3.And(only, out_of_window_encoded(d, st.pos[i], lpmax(st, h), w, rules)))
    return z3.And(st.used[i], z3.Not(st.lost[i]), z3.Or(*alts))


def decode_one(d: Domain, st: Store, group: tuple[Any, ...], pos0: Any, k: int, rules: Rules = SPEC) -> tuple[Any, Store]:
    """``(accepted, store)``: one token at ``pos0`` for the sequences of
    ``group`` (a Bool per sequence, one at least) into the free cell ``k``;
    refused when a member that holds positions does not continue at its
    logical ``pos_max + 1`` (or ``pos0 < 0``)."""
    ok = [z3.Or(*group), pos0 >= 0, z3.Not(st.used[k])]
    if rules.pos0_check:
        for j in range(S):
            top = lpmax(st, j)
            nxt = d.stored("pos_max + 1", lambda dd, v: dd.add(v, 1, "pos_max + 1"), top)
            ok.append(z3.Implies(z3.And(group[j], top >= 0), pos0 == nxt))
    return z3.And(*ok), write(st, k, group, pos0)


def lose(st: Store, i: int) -> Store:
    """A decode drops cell ``i`` of the window store: it becomes lost."""
    return replace(st, lost=st.lost[:i] + (z3.BoolVal(True),) + st.lost[i + 1:])


def restore(st: Store, dst: Any, snap: tuple[Any, ...], cells: tuple[int, ...], rules: Rules = SPEC) -> Store:
    """``dst`` cleared, then the snapshot's positions ``snap`` (distinct)
    written into the free cells ``cells`` held by ``dst`` alone."""
    out = seq_rm(st, dst, z3.BoolVal(False), z3.IntVal(0), z3.IntVal(0), z3.BoolVal(True)) \
        if rules.restore_clears else st
    me = tuple(dst == j for j in range(S))
    for p, i in zip(snap, cells, strict=True):
        out = write(out, i, me, p)
    return out


def restore_reusing(d: Domain, st: Store, dst: Any, snap: tuple[Any, ...], cells: tuple[int, ...], k: int, w: Any,
                    reuse: Any, rules: Rules = SPEC) -> tuple[Store, Any, Store]:
    """``(cleared, dropped, store)``: ``kvspec.spec.cells.restore`` as llama.cpp's
    ``state_read_meta`` finds room: ``dst`` cleared, then cell ``k`` of the
    cleared store, when ``reuse`` is chosen and the cell is droppable there
    (held by one sequence, out of its window), becomes lost for its holder
    (the capacity it frees is abstract: the snapshot's positions ``snap``
    are written into the free cells ``cells``, as :func:`restore` does)."""
    cleared = seq_rm(st, dst, z3.BoolVal(False), z3.IntVal(0), z3.IntVal(0), z3.BoolVal(True)) \
        if rules.restore_clears else st
    dropped = z3.And(reuse, droppable(d, cleared, k, w, rules))
    return cleared, dropped, restore(pick(dropped, lose(cleared, k), cleared), dst, snap, cells, rules)


def pick(c: Any, a: Store, b: Store) -> Store:
    """``a`` if ``c`` else ``b``, field by field."""
    def f(x: Any, y: Any) -> Any:
        return z3.If(c, x, y)
    return Store(tuple(f(x, y) for x, y in zip(a.used, b.used, strict=True)),
                 tuple(tuple(f(x, y) for x, y in zip(r, q, strict=True)) for r, q in zip(a.mem, b.mem, strict=True)),
                 tuple(f(x, y) for x, y in zip(a.pos, b.pos, strict=True)),
                 tuple(f(x, y) for x, y in zip(a.lost, b.lost, strict=True)),
                 tuple(f(x, y) for x, y in zip(a.shift, b.shift, strict=True)),
                 tuple(f(x, y) for x, y in zip(a.rot, b.rot, strict=True)))


def same_shifted(a: Store, b: Store) -> Any:
    """:func:`same` plus the pending shifts of used cells."""
    return z3.And(same(a, b), *[z3.Implies(a.used[i], a.shift[i] == b.shift[i]) for i in range(N)])


def rm_accepted(d: Domain, st: Store, new: Store, s: Any, p0: Any, inf: Any, w: Any, rules: Rules = SPEC) -> Any:
    """``kvspec.spec.cells.seq_rm``'s window rule for ``s`` (the store holds the
    rule before: then "refused iff the logical positions changed and a lost
    one is in the next window" is "whole removal, or no lost position in the
    next window after it"). Controls: ``always`` (llama.cpp returns true),
    ``old_max`` (the window taken from the pos_max before the removal)."""
    whole = z3.And(p0 == 0, inf)
    if rules.rm_rule == "always":
        return z3.BoolVal(True)
    if rules.rm_rule == "old_max":
        nxt = d.stored("pos_max + 1", lambda dd, v: dd.add(v, 1, "pos_max + 1"), lpmax(st, s))
        edge = d.sub(nxt, w, "pos_max + 1 - w")
        return z3.Or(whole, z3.And(*[z3.Implies(z3.And(holds(new, i, s), new.lost[i]), new.pos[i] <= edge)
                                     for i in range(N)]))
    return z3.Or(whole, window_ok(d, new, s, w))
