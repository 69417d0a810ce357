"""Obligation 9 (atomic list trim): proved, its negative controls refuted,
and the Z3 encoding tied to kvspec.spec.layers on every small case."""

from __future__ import annotations

import itertools

import z3

from kvspec.proofs import layers as pl
from kvspec.proofs.domain import Domain
from kvspec.proofs.layers_model import LAYERS, layer_trims, layer_vars, list_trim_count
from kvspec.spec import layers as sl


def test_obligation_proved_and_controls_refuted():
    result = pl.prove_list_trim()
    assert result.number == pl.NUMBER
    assert result.status == "proved", [(p.part, p.domain, p.status) for p in result.parts]
    assert [c.status for c in result.controls] == ["refuted"] * len(pl.TRIM_CONTROLS)


def _layers():
    """(dense, offset, live, exact) over small values."""
    for dense, offset in itertools.product((True, False), range(3)):
        if dense:
            for live in range(offset + 1):
                yield True, offset, live, live
        else:
            for exact in range(offset + 1):
                yield False, offset, offset, exact


def _spec_trim(dense: bool, offset: int, live: int, exact: int, count: int) -> int:
    """What the layer's own trim removes, by the spec's rules."""
    if count <= 0:
        return 0
    if dense:
        return min(count, live)
    clamped = min(count, offset)
    return 0 if clamped > exact else clamped


def test_encoding_matches_the_spec_rule():
    d = Domain()
    n = d.var("n")
    vs = [layer_vars(d, i) for i in range(LAYERS)]
    count = list_trim_count(n, vs)
    trims = [layer_trims(v, count) for v in vs]
    cases = list(_layers())
    for combo in itertools.islice(itertools.product(cases, repeat=LAYERS), 0, None, 5):
        for nv in (-1, 0, 1, 2, 3):
            subst = [(n, z3.IntVal(nv))]
            for v, (dense, offset, live, exact) in zip(vs, combo):
                subst += [(v.dense, z3.BoolVal(dense)), (v.offset, z3.IntVal(offset)), (v.live, z3.IntVal(live)),
                          (v.exact, z3.IntVal(exact))]
            want = sl.list_trim_count(nv, tuple((live, exact) for _, _, live, exact in combo))
            assert z3.simplify(z3.substitute(count, *subst)).as_long() == want, (combo, nv)
            for t, layer in zip(trims, combo):
                got = z3.simplify(z3.substitute(t, *subst)).as_long()
                assert got == _spec_trim(*layer, want) == want, (combo, nv)
