"""Obligations 17 to 21: the cells kind's invariants (``kvspec.spec.cells``;
semantics.md 10, docs/cells.md). Encodings are in :mod:`kvspec.proofs.cells_model`.

Bounded models: a store of N = 3 cells (present or lost) and S = 2 sequence
ids; positions, ranges, deltas, divisors and windows are unbounded integers
(and 32-bit in the bv32 run). Every cell is symmetric, so an op that writes
one new cell writes cell 0 (restore: cells 1 and 2) without loss of
generality.

* 17, a cell is freed exactly when its set becomes empty: the invariant
  ``used == (set non-empty)`` is kept by seq_rm (one sequence or -1),
  seq_keep, seq_add (a cell moved below 0 is freed for every holder) and
  clear. Controls: only ``seq_rm(-1)`` frees; seq_keep frees nothing; a
  cell shifted below 0 is freed but keeps its sequences (a cell freed while
  sequences hold it).
* 18, per-sequence positions stay unique (present and lost cells alike)
  under decode, seq_cp, seq_add, seq_div and restore (which, as a decode,
  may reuse a droppable window cell) with the spec's refusals. Controls: decode without the ``pos0 = pos_max + 1`` check,
  seq_cp without its collision refusal, seq_add/seq_div without theirs, a
  restore that does not clear dst first.
* 19, a refused seq_rm / decode / restore leaves both stores of an iSWA
  memory unchanged. Controls: llama.cpp's iSWA seq_rm shape (each store
  removes, results ANDed: the full store has removed when the window
  refuses), a decode that drops windowed cells before the room check, a
  restore that clears dst before the room check (llama.cpp's).
* 20, shifts compose: seq_add of d1 then d2 on ``[p0, p1)`` equals one of
  ``d1 + d2`` when both are accepted, no cell of the sequence crosses the
  range edge on the first (``pos in range == pos + d1 in range``) and none
  moved goes below 0 on it; the pending shift accumulates to the sum
  (#3825), and every used cell's K row, its pending shift applied, is
  rotated for its position (``rot + shift == pos``) after seq_add and
  seq_div. Controls: the pending shift overwritten by seq_add (#3825) and
  by seq_div, and the composition claimed without the range-edge condition.
* 21, the windowed removal bound: an accepted seq_rm never leaves a lost
  position q of the sequence in its next decode's window (``q <= pos_max +
  1 - w``), and a decode, or a restore, that drops only droppable cells
  keeps that true for every sequence (a restore: every other sequence). Controls: seq_rm always accepted (llama.cpp), the bound
  taken from the pos_max before the removal, a drop rule off by one.

Run as ``kvspec prove --only 17 18 19 20 21``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import z3

from kvspec.proofs.cells_model import (
    SPEC,
    N,
    Rules,
    Store,
    decode_one,
    droppable,
    freed_iff_empty,
    in_range,
    lose,
    pick,
    positions_ok,
    restore_reusing,
    rm_accepted,
    rows_named,
    same,
    same_shifted,
    seq_add,
    seq_cp,
    seq_div,
    seq_keep,
    seq_rm,
    store_vars,
    unique,
    window_ok,
    write,
)
from kvspec.proofs.core import ObligationResult, PartBuilder, control_from_parts, overall, run_parts
from kvspec.proofs.domain import Domain

TITLES = {17: "cell freed exactly when its set is empty", 18: "per-sequence positions unique",
          19: "cells refusals change nothing", 20: "position shifts compose", 21: "windowed removal bound"}
SEQS = 2


def _args(d: Domain) -> tuple[Any, ...]:
    s, p0, p1, inf = d.var("seq"), d.var("p0"), d.var("p1"), d.boolean("p1_is_infinity")
    return s, p0, p1, inf, [s >= 0, s < SEQS, p0 >= 0, p1 >= 0]


def _base(d: Domain, name: str = "c") -> tuple[Store, list[Any]]:
    st = store_vars(d, name)
    return st, [freed_iff_empty(st), unique(st), positions_ok(st)]


def _group(d: Domain) -> tuple[Any, ...]:
    return tuple(d.boolean(f"group_{j}") for j in range(SEQS))


# -- 17 ------------------------------------------------------------------------------


def freed_parts(rules: Rules = SPEC) -> list[tuple[str, PartBuilder]]:
    def rm(d: Domain) -> tuple[list[Any], Any]:
        st, pre = _base(d)
        s, p0, p1, inf, ranges = _args(d)
        every = d.boolean("seq_is_minus_one")
        return [*pre, *ranges], freed_iff_empty(seq_rm(st, s, every, p0, p1, inf, rules))

    def keep(d: Domain) -> tuple[list[Any], Any]:
        st, pre = _base(d)
        s, *_rest, ranges = _args(d)
        return [*pre, *ranges], freed_iff_empty(seq_keep(st, s, rules))

    def add(d: Domain) -> tuple[list[Any], Any]:
        st, pre = _base(d)
        s, p0, p1, inf, ranges = _args(d)
        delta = d.var("delta")
        ok, new = seq_add(d, st, s, p0, p1, inf, delta, rules)
        return [*pre, *ranges, delta < 0], z3.Implies(ok, freed_iff_empty(new))

    def cleared(d: Domain) -> tuple[list[Any], Any]:
        st, pre = _base(d)
        off = z3.BoolVal(False)
        return pre, freed_iff_empty(Store((off,) * N, ((off,) * SEQS,) * N, st.pos, st.lost, st.shift, st.rot))

    return [("seq_rm (one sequence or -1) frees a cell exactly when its set becomes empty", rm),
            ("seq_keep frees exactly the cells the kept sequence does not hold", keep),
            ("seq_add with delta < 0 frees a cell moved below 0 for every holder", add),
            ("clear frees every cell", cleared)]


FREED_CONTROLS: list[tuple[str, str, Rules]] = [
    ("only_seq_rm_minus_one_frees", "seq_rm frees a cell only for seq -1 (an emptied cell stays used)",
     Rules(free="all_only")),
    ("seq_keep_frees_nothing", "seq_keep removes the other sequences but frees no cell", Rules(free="keep_used")),
    ("freed_while_held", "a cell shifted below 0 is freed while its sequences still hold it",
     Rules(free="shift_keeps_seqs")),
]


# -- 18 ------------------------------------------------------------------------------


def unique_parts(rules: Rules = SPEC) -> list[tuple[str, PartBuilder]]:
    def dec(d: Domain) -> tuple[list[Any], Any]:
        st, pre = _base(d)
        group, pos0 = _group(d), d.var("pos0")
        ok, new = decode_one(d, st, group, pos0, 0, rules)
        return pre, z3.Implies(ok, unique(new))

    def cp(d: Domain) -> tuple[list[Any], Any]:
        st, pre = _base(d)
        s, p0, p1, inf, ranges = _args(d)
        dst = d.var("dst")
        ok, new = seq_cp(st, s, dst, p0, p1, inf, rules)
        return [*pre, *ranges, dst >= 0, dst < SEQS], z3.Implies(ok, unique(new))

    def add(d: Domain) -> tuple[list[Any], Any]:
        st, pre = _base(d)
        s, p0, p1, inf, ranges = _args(d)
        ok, new = seq_add(d, st, s, p0, p1, inf, d.var("delta"), rules)
        return [*pre, *ranges], z3.Implies(ok, z3.And(unique(new), positions_ok(new)))

    def div(d: Domain) -> tuple[list[Any], Any]:
        st, pre = _base(d)
        s, p0, p1, inf, ranges = _args(d)
        k = d.var("d")
        ok, new = seq_div(d, st, s, p0, p1, inf, k, rules)
        return [*pre, *ranges, k >= 1], z3.Implies(ok, z3.And(unique(new), positions_ok(new)))

    def rst(d: Domain) -> tuple[list[Any], Any]:
        st, pre = _base(d)
        dst, a0, a1, w = d.var("dst"), d.var("snap_pos_0"), d.var("snap_pos_1"), d.var("w")
        # the room: cells 1 and 2 free after the clear, cell 0 reused when droppable (find_slot, as a decode)
        cleared, _, new = restore_reusing(d, st, dst, (a0, a1), (1, 2), 0, w, d.boolean("reuse_cell_0"), rules)
        room = z3.And(z3.Not(cleared.used[1]), z3.Not(cleared.used[2]))
        return [*pre, dst >= 0, dst < SEQS, a0 >= 0, a1 >= 0, a0 != a1, w >= 1], z3.Implies(room, unique(new))

    return [("decode (pos0 = logical pos_max + 1 for a sequence that holds positions) keeps positions unique", dec),
            ("seq_cp, refused on a collision, keeps positions unique", cp),
            ("seq_add, refused on a collision, keeps positions unique and >= 0", add),
            ("seq_div (d >= 1), refused on a collision, keeps positions unique and >= 0", div),
            (("restore (dst cleared, distinct snapshot positions, a droppable window cell reused) keeps positions "
             "unique"), rst)]


UNIQUE_CONTROLS: list[tuple[str, str, Rules]] = [
    ("decode_any_pos0", "decode does not check pos0 = pos_max + 1", Rules(pos0_check=False)),
    ("seq_cp_unchecked", "seq_cp shares into dst without refusing a collision", Rules(cp_check=False)),
    ("shift_unchecked", "seq_add / seq_div move cells without refusing a collision", Rules(add_check=False)),
    ("restore_without_clear", "restore writes the snapshot without clearing dst", Rules(restore_clears=False)),
]


# -- 19 ------------------------------------------------------------------------------


def atomic_parts(rules: Rules = SPEC) -> list[tuple[str, PartBuilder]]:
    def two(d: Domain) -> tuple[Store, Store, list[Any]]:
        full, pf = _base(d, "full")
        win, pw = _base(d, "window")
        return full, win, [*pf, *pw]

    def rm(d: Domain) -> tuple[list[Any], Any]:
        full, win, pre = two(d)
        s, p0, p1, inf, ranges = _args(d)
        w = d.var("w")
        no = z3.BoolVal(False)
        rf, rw = seq_rm(full, s, no, p0, p1, inf, rules), seq_rm(win, s, no, p0, p1, inf, rules)
        acc = rm_accepted(d, win, rw, s, p0, inf, w)
        full1 = rf if rules.atomic == "per_store" else pick(acc, rf, full)
        win1 = pick(acc, rw, win)
        return [*pre, *ranges, w >= 1], z3.Implies(z3.Not(acc), z3.And(same(full1, full), same(win1, win)))

    def dec(d: Domain) -> tuple[list[Any], Any]:
        full, win, pre = two(d)
        group, pos0 = _group(d), d.var("pos0")
        room_full, room_win, w = d.boolean("full_has_room"), d.boolean("window_has_room"), d.var("w")
        okf, nf = decode_one(d, full, group, pos0, 0, rules)
        dropped = lose(win, 1)
        drop = droppable(d, win, 1, w, rules)
        okw, nw = decode_one(d, pick(drop, dropped, win), group, pos0, 0, rules)
        acc = z3.And(okf, okw, room_full, room_win)
        miss = pick(drop, dropped, win) if rules.atomic == "drop_first" else win
        full1, win1 = pick(acc, nf, full), pick(acc, nw, miss)
        return [*pre, w >= 1], z3.Implies(z3.Not(acc), z3.And(same(full1, full), same(win1, win)))

    def rst(d: Domain) -> tuple[list[Any], Any]:
        full, win, pre = two(d)
        dst, a0 = d.var("dst"), d.var("snap_pos_0")
        room = d.boolean("room_after_clear")
        no = z3.BoolVal(False)
        cf = seq_rm(full, dst, no, z3.IntVal(0), z3.IntVal(0), z3.BoolVal(True))
        cw = seq_rm(win, dst, no, z3.IntVal(0), z3.IntVal(0), z3.BoolVal(True))
        nf = write(cf, 0, tuple(dst == j for j in range(SEQS)), a0)
        nw = write(cw, 0, tuple(dst == j for j in range(SEQS)), a0)
        miss_f, miss_w = (cf, cw) if rules.atomic == "clear_first" else (full, win)
        full1, win1 = pick(room, nf, miss_f), pick(room, nw, miss_w)
        return [*pre, dst >= 0, dst < SEQS, a0 >= 0], \
            z3.Implies(z3.Not(room), z3.And(same(full1, full), same(win1, win)))

    return [("a seq_rm refused by the window rule changes neither store", rm),
            ("a refused decode (bad pos0, no room in a store) changes neither store", dec),
            (("a restore refused for lack of room (free and droppable cells after the clear) changes neither store, "
             "dst not cleared"), rst)]


ATOMIC_CONTROLS: list[tuple[str, str, Rules]] = [
    ("iswa_seq_rm_per_store", ("each store removes and the memory ANDs the results (the full store removed "
     "when the window refuses)"), Rules(atomic="per_store")),
    ("decode_drops_before_room_check", "the window store drops its droppable cells before the room check",
     Rules(atomic="drop_first")),
    ("restore_clears_before_room_check", "restore clears dst before the room check (llama.cpp)",
     Rules(atomic="clear_first")),
]


# -- 20 ------------------------------------------------------------------------------


def compose_parts(rules: Rules = SPEC) -> list[tuple[str, PartBuilder]]:
    def twice(d: Domain) -> tuple[list[Any], Any]:
        st, pre = _base(d)
        s, p0, p1, inf, ranges = _args(d)
        d1, d2 = d.var("d1"), d.var("d2")
        ok1, a = seq_add(d, st, s, p0, p1, inf, d1, rules)
        ok2, b = seq_add(d, a, s, p0, p1, inf, d2, rules)
        dsum = d.stored("d1 + d2", lambda dd, x, y: dd.add(x, y, "d1 + d2"), d1, d2)
        ok3, c = seq_add(d, st, s, p0, p1, inf, dsum, rules)
        cond = []
        for i in range(N):
            mine = z3.And(st.used[i], z3.Or(*[z3.And(s == j, st.mem[i][j]) for j in range(SEQS)]))
            inside = in_range(st.pos[i], p0, p1, inf)
            after = in_range(st.pos[i] + d1, p0, p1, inf)
            if rules.compose != "no_edge":
                cond.append(z3.Implies(mine, inside == after))
            cond.append(z3.Implies(z3.And(mine, inside), st.pos[i] + d1 >= 0))
        return [*pre, *ranges, ok1, ok2, *cond], z3.And(ok3, same_shifted(b, c))

    def named_add(d: Domain) -> tuple[list[Any], Any]:
        st, pre = _base(d)
        s, p0, p1, inf, ranges = _args(d)
        ok, new = seq_add(d, st, s, p0, p1, inf, d.var("delta"), rules)
        return [*pre, *ranges, rows_named(st)], z3.Implies(ok, rows_named(new))

    def named_div(d: Domain) -> tuple[list[Any], Any]:
        st, pre = _base(d)
        s, p0, p1, inf, ranges = _args(d)
        k = d.var("d")
        ok, new = seq_div(d, st, s, p0, p1, inf, k, rules)
        return [*pre, *ranges, k >= 1, rows_named(st)], z3.Implies(ok, rows_named(new))

    return [("seq_add d1 then d2 equals seq_add d1 + d2 (positions, sets, pending shift = the sum)", twice),
            ("after seq_add every K row, its pending shift applied, is rotated for its position", named_add),
            ("after seq_div (pending shift += new - old) every K row is rotated for its position", named_div)]


COMPOSE_CONTROLS: list[tuple[str, str, Rules]] = [
    ("pending_shift_overwritten", "seq_add sets the pending shift to delta instead of adding it (#3825)",
     Rules(pending="overwrite")),
    ("div_shift_overwritten", "seq_div sets the pending shift to new - old instead of adding it",
     Rules(div_pending="overwrite")),
    ("composition_without_edge_condition", ("d1 then d2 equals d1 + d2 claimed also when a cell crosses the "
     "range edge"), Rules(compose="no_edge")),
]


# -- 21 ------------------------------------------------------------------------------


def window_parts(rules: Rules = SPEC) -> list[tuple[str, PartBuilder]]:
    def rm(d: Domain) -> tuple[list[Any], Any]:
        st, pre = _base(d)
        s, p0, p1, inf, ranges = _args(d)
        w = d.var("w")
        new = seq_rm(st, s, z3.BoolVal(False), p0, p1, inf, rules)
        acc = rm_accepted(d, st, new, s, p0, inf, w, rules)
        return [*pre, *ranges, w >= 1, window_ok(d, st, s, w)], z3.Implies(acc, window_ok(d, new, s, w))

    def dec(d: Domain) -> tuple[list[Any], Any]:
        st, pre = _base(d)
        group, pos0, w = _group(d), d.var("pos0"), d.var("w")
        drop = droppable(d, st, 1, w, rules)
        ok, new = decode_one(d, lose(st, 1), group, pos0, 0, rules)
        keep = [window_ok(d, st, z3.IntVal(j), w) for j in range(SEQS)]
        goal = z3.And(*[window_ok(d, new, z3.IntVal(j), w) for j in range(SEQS)])
        return [*pre, w >= 1, *keep, drop], z3.Implies(ok, goal)

    def rst(d: Domain) -> tuple[list[Any], Any]:
        st, pre = _base(d)
        dst, a0, w = d.var("dst"), d.var("snap_pos_0"), d.var("w")
        cleared, dropped, new = restore_reusing(d, st, dst, (a0,), (2,), 1, w, z3.BoolVal(True), rules)
        keep = [window_ok(d, st, z3.IntVal(j), w) for j in range(SEQS)]
        goal = z3.And(*[z3.Implies(dst != j, window_ok(d, new, z3.IntVal(j), w)) for j in range(SEQS)])
        return [*pre, w >= 1, dst >= 0, dst < SEQS, a0 >= 0, *keep, dropped, z3.Not(cleared.used[2])], goal

    return [("an accepted seq_rm leaves no lost position in the sequence's next window", rm),
            ("a decode that drops a droppable cell leaves no lost position in any sequence's next window", dec),
            (("a restore that reuses a droppable window cell leaves no lost position in another sequence's next "
             "window"), rst)]


WINDOW_CONTROLS: list[tuple[str, str, Rules]] = [
    ("seq_rm_always_true", "seq_rm always returns true (llama.cpp's kv cache)", Rules(rm_rule="always")),
    ("bound_from_old_pos_max", "the window bound taken from the pos_max before the removal",
     Rules(rm_rule="old_max")),
    ("drop_rule_off_by_one", "a decode (or a restore) drops a cell with pos_max + 1 - pos >= w - 1",
     Rules(drop_slack=1)),
]


# -- results -------------------------------------------------------------------------


def _prove(number: int, proves: tuple[str, ...], statement: str, parts_of: Callable[[Rules], list],
           controls: list[tuple[str, str, Rules]]) -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(parts_of(SPEC))
    ctl = [control_from_parts(name, text, parts_of(rules)) for name, text, rules in controls]
    return ObligationResult(number, TITLES[number], proves, statement, overall(parts, ctl), parts, ctl,
                            time.perf_counter() - t0)


def prove_freed() -> ObligationResult:
    return _prove(17, ("seq_rm", "seq_keep", "seq_add", "clear"),
                  "a cell is used exactly while some sequence holds it (seq_rm, seq_keep, seq_add below 0, clear)",
                  freed_parts, FREED_CONTROLS)


def prove_unique() -> ObligationResult:
    return _prove(18, ("decode", "seq_cp", "seq_add", "seq_div", "restore"),
                  "per sequence no two cells (present or lost) share a position, under every op with its refusals",
                  unique_parts, UNIQUE_CONTROLS)


def prove_atomic() -> ObligationResult:
    return _prove(19, ("seq_rm", "decode", "restore"),
                  "a refused seq_rm, decode or restore leaves both stores of the memory unchanged",
                  atomic_parts, ATOMIC_CONTROLS)


def prove_compose() -> ObligationResult:
    return _prove(20, ("seq_add", "seq_div", "shifted"),
                  "seq_add d1 then d2 = seq_add d1 + d2 (no cell crosses the range edge or goes below 0 on the "
                  "first); pending shifts accumulate; K rows named (token, pos) after any shift",
                  compose_parts, COMPOSE_CONTROLS)


def prove_window() -> ObligationResult:
    return _prove(21, ("seq_rm", "droppable", "in_next_window", "restore"),
                  "no lost position of a sequence lies in its next decode's window after an accepted seq_rm or "
                  "a decode's or a restore's drops",
                  window_parts, WINDOW_CONTROLS)


OBLIGATIONS: list[tuple[int, Callable[[], ObligationResult]]] = [
    (17, prove_freed), (18, prove_unique), (19, prove_atomic), (20, prove_compose), (21, prove_window)]
