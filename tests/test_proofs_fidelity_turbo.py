"""The Z3 encodings of proofs/turbo_model.py against spec/turbo.py on small
concrete cases, the obligations' premises are satisfiable (no vacuous
proof), and obligations 10-12 are proved with every negative control
refuted."""

from __future__ import annotations

import itertools

import pytest
import z3

from kvspec.proofs import turbo as pt
from kvspec.proofs import turbo_model as tm
from kvspec.proofs.domain import DOMAINS, Domain, evaluate
from kvspec.spec import dense as sd
from kvspec.spec import turbo as st

D = Domain()


def ev(expr):
    return evaluate(expr, {})


def test_counters_match_the_spec():
    for cold, hot, n, T, B in itertools.product(range(4), range(5), range(1, 4), range(4), range(1, 4)):
        live = cold + hot
        assert ev(tm.handoff_fold(D, z3.IntVal(cold), z3.IntVal(live), z3.IntVal(n))) == st.handoff_fold(cold, live, n)
        assert ev(tm.fold_block_rows(D, z3.IntVal(hot), z3.IntVal(T), z3.IntVal(B))) == st.fold_block_rows(hot, T, B)
        for k in range(live + 1):
            got = tm.trim_split(D, z3.IntVal(cold), z3.IntVal(live), z3.IntVal(k))
            assert tuple(ev(x) for x in got) == st.trim_split(cold, live, k)
    for h in range(1, 80):
        assert ev(tm.packed_bytes(D, z3.IntVal(h), 3)) == st.packed_bytes(h, 3)
        assert ev(tm.pack_guard(D, z3.IntVal(h))) == st.head_dim_allowed(h, 3) or h & (h - 1)


def _delegated_state(cold: int, off: int) -> tm.DelegatedS:
    """A concrete Delegated state whose window holds tokens 0..off-1."""
    win = z3.Lambda([i := z3.Int("i")], i)
    return tm.DelegatedS(z3.IntVal(off), z3.IntVal(cold), win, win, z3.Lambda([i], i + cold))


def _fold_schedule_by_encoding(cold: int, live: int, n: int, T: int, B: int) -> int:
    """kvspec.spec.turbo.fold_schedule replayed with the encoded steps: handoff
    fold, append, block folds until none moves."""
    c = _delegated_state(cold, live)
    if ev(tm.handoff_fold(D, c.cold, c.off, z3.IntVal(n))):
        c = tm.d_fold(D, c, z3.IntVal(ev(c.off - c.cold)))
    c = tm.d_append(D, c, z3.IntVal(n), z3.Lambda([z3.Int("j")], z3.Int("j") + 100))
    while True:
        f = ev(tm.fold_block_rows(D, z3.IntVal(ev(c.off - c.cold)), z3.IntVal(T), z3.IntVal(B)))
        if f == 0:
            return ev(c.cold) - cold
        c = tm.d_fold(D, c, z3.IntVal(f))


def test_fold_and_trim_transitions_match_the_spec():
    for cold, hot, n, T, B in itertools.product(range(3), range(4), range(1, 4), range(3), range(1, 3)):
        live = cold + hot
        assert _fold_schedule_by_encoding(cold, live, n, T, B) == st.fold_schedule(cold, live, n, T, B)
        for k in range(-1, live + 2):
            c = tm.d_trim(D, _delegated_state(cold, live), z3.IntVal(k))
            removed = max(0, min(k, live))
            want = 0 if removed == live else cold - st.trim_split(cold, live, removed)[1]
            assert (ev(c.off), ev(c.cold)) == (live - removed, want)


@pytest.mark.parametrize("mode", ["turbo4asym", "turbo4", "turbo3asym", "turbo4delegated"])
def test_row_counts_after_append_and_trim_match_the_spec_world(mode):
    for step, first, k in itertools.product(range(1, 4), range(1, 6), range(-1, 7)):
        w = st.new_world(mode, step=step, hot_threshold=2, fold_block=1)
        _, w = st.apply_op(w, {"op": "append", "n": first})
        rows = w.rows()
        live, cap, cold = w.cache.live_len, w.cache.capacity, w.cold_offset
        _, w2 = st.apply_op(w, {"op": "trim", "n": k})
        if mode == "turbo4delegated":
            full = {"keys": cap, "hot": live - cold, **dict.fromkeys(tm.COLD, cold)}
            after, left, cold2 = tm.delegated_rows_after_trim(D, {a: z3.IntVal(v) for a, v in full.items()},
                                                              z3.IntVal(live), z3.IntVal(cold), z3.IntVal(k))
            got = {a: ev(v) for a, v in after.items() if ev(v)}
            assert ev(cold2) == w2.cold_offset
        else:
            names = tm.NON_DELEGATED[mode]
            assert set(rows) == set(names) == set(st.array_names(sd.Mode(mode)))
            after, left = tm.array_rows_after_trim(D, names, {a: z3.IntVal(rows[a]) for a in names},
                                                   z3.IntVal(live), z3.IntVal(k))
            got = {a: ev(v) for a, v in after.items() if ev(v)}
            grown = tm.array_rows_after_append(D, names, {a: z3.IntVal(0) for a in names}, z3.IntVal(0),
                                               z3.IntVal(first), z3.IntVal(step))
            assert {a: ev(v) for a, v in grown.items()} == rows
        assert ev(left) == w2.cache.live_len
        assert got == w2.rows()


@pytest.mark.parametrize("builder", [pt.trim_parts, pt.fold_parts, pt.pack_parts])
def test_every_part_has_satisfiable_premises(builder):
    for label, build in builder():
        for kind in DOMAINS:
            d = Domain(kind)
            premises, _ = build(d)
            s = z3.Solver()
            s.add(*premises, *d.facts, *(a for _, a in d.assumptions))
            assert s.check() == z3.sat, (label, kind)


@pytest.mark.parametrize("prove", [pt.prove_trim, pt.prove_fold, pt.prove_pack])
def test_turbo_obligations_are_proved_and_controls_refuted(prove):
    r = prove()
    assert r.status == "proved", [(p.part, p.domain, p.status) for p in r.parts if p.status != "proved"]
    assert r.controls and all(c.status == "refuted" for c in r.controls)
