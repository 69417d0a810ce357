"""Obligations 17 to 21 (the cells kind, proofs/cells.py): proved in both
domains, every negative control refuted, registered with ``kvspec prove``,
and the Z3 encodings' rules checked against kvspec.spec.cells on small cases."""

from __future__ import annotations

import itertools

import pytest
import z3

from kvspec.proofs import cells as pc
from kvspec.proofs import cli
from kvspec.proofs.cells_model import N, lpmax, out_of_window_encoded, store_vars
from kvspec.proofs.domain import Domain, reset_names
from kvspec.spec import cells as sc

CASES = [(17, pc.prove_freed, pc.FREED_CONTROLS), (18, pc.prove_unique, pc.UNIQUE_CONTROLS),
         (19, pc.prove_atomic, pc.ATOMIC_CONTROLS), (20, pc.prove_compose, pc.COMPOSE_CONTROLS),
         (21, pc.prove_window, pc.WINDOW_CONTROLS)]


@pytest.mark.parametrize("number,prove,controls", CASES, ids=[str(c[0]) for c in CASES])
def test_obligation_proved_and_every_control_refuted(number, prove, controls):
    reset_names()
    result = prove()
    assert result.number == number and result.name == cli.TITLES[number]
    assert result.status == "proved", [(p.part, p.domain, p.status, p.reason) for p in result.parts]
    assert {p.domain for p in result.parts} == {"int", "bv32"}
    assert [(c.name, c.status) for c in result.controls] == [(n, "refuted") for n, _, _ in controls]
    assert all(c.domains == {"int": "refuted", "bv32": "refuted"} for c in result.controls)


def test_registered_with_kvspec_prove():
    assert {17, 18, 19, 20, 21} <= {n for n, _ in cli.obligations()}
    assert cli.select(["windowed removal bound", "17"], {17, 21}) == [21, 17]
    assert all(cli.TITLES[n] == pc.TITLES[n] for n in pc.TITLES)


def test_kvspec_prove_only_runs_them(capsys):
    assert cli.main(["--only", "17", "18", "19", "20", "21", "--json"]) == 0
    assert '"ok": true' in capsys.readouterr().out


def test_drop_rule_encoding_is_the_spec_rule():
    d = Domain()
    pos, top, w = d.var("pos"), d.var("top"), d.var("w")
    e = out_of_window_encoded(d, pos, top, w)
    for p, t, ww in itertools.product(range(5), range(5), range(1, 4)):
        if p > t:
            continue
        got = z3.is_true(z3.simplify(z3.substitute(e, (pos, z3.IntVal(p)), (top, z3.IntVal(t)), (w, z3.IntVal(ww)))))
        assert got == sc.out_of_window(p, t, ww)


def test_lpmax_encoding_is_the_spec_logical_pos_max():
    """The model's pos_max over present and lost cells = kvspec.spec.cells.logical_pos_max, on every small store."""
    d = Domain()
    st = store_vars(d)
    top = [lpmax(st, z3.IntVal(s)) for s in range(2)]
    cfg = sc.CellsConfig(n_cells=N, window=2, stores=("window",), n_seq=2)
    checked = 0
    for sets in itertools.product([(), (0,), (1,), (0, 1)], repeat=N):
        for positions in itertools.product(range(3), repeat=N):
            cells = [sc.Cell.make(p, frozenset(s), 0, lost=(i == 1)) for i, (p, s) in enumerate(zip(positions, sets))
                     if s]
            state = sc.CellsState(cfg, (tuple(cells),))
            subst = []
            for i in range(N):
                subst.append((st.used[i], z3.BoolVal(bool(sets[i]))))
                subst.append((st.pos[i], z3.IntVal(positions[i])))
                subst += [(st.mem[i][s], z3.BoolVal(s in sets[i])) for s in range(2)]
            for s in range(2):
                assert z3.simplify(z3.substitute(top[s], *subst)).as_long() == sc.logical_pos_max(state, s)
                checked += 1
    assert checked > 500


def test_the_restore_reuse_part_is_refuted_by_the_off_by_one_drop_rule():
    """Obligation 21's restore part (a restore reuses a droppable window cell,
    as find_slot does) is not vacuous: with the drop rule off by one it fails."""
    from kvspec.proofs.core import run_parts

    reset_names()
    rules = {n: r for n, _, r in pc.WINDOW_CONTROLS}["drop_rule_off_by_one"]
    parts = [p for p in pc.window_parts(rules) if p[0].startswith("a restore")]
    assert len(parts) == 1
    got = run_parts(parts)
    assert any(r.status == "refuted" for r in got), [(r.part, r.status) for r in got]
    reset_names()
    assert all(r.status == "proved" for r in run_parts([p for p in pc.window_parts() if p[0].startswith("a restore")]))
