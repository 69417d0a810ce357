"""Obligations 15 (the recurrent checkpoint ring) and 16 (the atomic list
trim over dense, ring and recurrent layers): proved in both domains, every
negative control refuted, registered with ``kvspec prove``, and the Z3
encodings tied to kvspec.spec.recurrent / kvspec.spec.layers on every small case."""

from __future__ import annotations

import itertools

import z3

from kvspec.proofs import cli
from kvspec.proofs import recurrent as pr
from kvspec.proofs.domain import Domain
from kvspec.proofs.recurrent_model import REFUSED, layer_trims, list_count, mixed_vars, slot
from kvspec.spec import layers as sl
from kvspec.spec import recurrent as sr
from kvspec.spec.errors import StateError


def test_ring_obligation_proved_and_controls_refuted():
    result = pr.prove_ring()
    assert result.number == 15 and result.name == cli.TITLES[15]
    assert result.status == "proved", [(p.part, p.domain, p.status, p.reason) for p in result.parts]
    assert {p.domain for p in result.parts} == {"int", "bv32"}
    assert [(c.name, c.status) for c in result.controls] == [(n, "refuted") for n, _, _ in pr.RING_CONTROLS]
    assert all(c.domains == {"int": "refuted", "bv32": "refuted"} for c in result.controls)


def test_list_obligation_proved_and_control_refuted():
    result = pr.prove_list()
    assert result.number == 16 and result.name == cli.TITLES[16]
    assert result.status == "proved", [(p.part, p.domain, p.status, p.reason) for p in result.parts]
    assert [(c.name, c.status) for c in result.controls] == [(n, "refuted") for n, _, _ in pr.LIST_CONTROLS]
    assert [c.name for c in result.controls] == ["trim_each_to_its_bound", "recurrent_bound_is_offset"]


def test_registered_with_kvspec_prove():
    assert {15, 16} <= {n for n, _ in cli.obligations()}
    assert cli.select(["recurrent checkpoint ring", "16"], {15, 16}) == [15, 16]


def test_slot_encoding_is_the_spec_slot():
    d = Domain()
    x, U = d.var("x"), d.var("U")
    s = slot(d, x, U)
    for xv, uv in itertools.product(range(12), range(5)):
        got = z3.simplify(z3.substitute(s, (x, z3.IntVal(xv)), (U, z3.IntVal(uv)))).as_long()
        assert got == sr.slot(xv, uv), (xv, uv)


def _layer_cases():
    """(kind, cache) over small offsets and bounds: dense layers after a
    front trim, one-slot rings with and without an undo log, recurrent layers of each
    coverage (spec caches, so each layer's own trim is the spec's)."""
    from kvspec.spec import dense, rotating

    for offset in range(3):
        for live in range(offset + 1):
            c = dense.new_cache("fp16", 4)
            for t in range(offset):
                _, c = dense.append(c, (t,))
            if live < offset:
                _, c = dense.trim_front_keep_sink(c, offset - live)
            yield "dense", c
        for undo in (0, 1):
            ring = rotating.new_cache(1, 0, 1, undo=undo)
            for t in range(offset):
                _, ring = rotating.append(ring, (t,))
            yield "ring", ring
        for cov in range(offset + 1):
            r = sr.step(sr.empty(2, 3, 2), tuple(range(offset)), recorded=False) if offset else sr.empty(2, 3, 2)
            if cov:
                r = sr.step(sr.step(sr.empty(2, 3, cov), tuple(range(offset - cov)), recorded=False)
                            if offset > cov else sr.empty(2, 3, cov), tuple(range(offset - cov, offset)))
            assert (r.offset, r.coverage) == (offset, cov)
            yield "recurrent", r


def _own_trim(cache: object, count: int) -> int:
    if isinstance(cache, sr.RecurrentCache):
        try:
            return sr.trim(cache, count)[0]
        except StateError:
            return REFUSED
    return sl._trim_layer(cache, count)[0]  # type: ignore[arg-type]


def test_list_encoding_matches_the_spec_on_small_mixed_lists():
    d = Domain()
    n = d.var("n")
    vs = [mixed_vars(d, i) for i in range(3)]
    count = list_count(n, vs)
    trims = [layer_trims(v, count) for v in vs]
    cases = list(_layer_cases())
    checked = 0
    for combo in itertools.islice(itertools.product(cases, repeat=3), 0, None, 23):
        caches = tuple(c for _, c in combo)
        bounds = tuple(sl.layer_trim_bounds(c) for c in caches)
        for nv in (-1, 0, 1, 2, 3):
            subst = [(n, z3.IntVal(nv))]
            for v, (kind, c), (rows, exact) in zip(vs, combo, bounds):
                subst += [(v.dense, z3.BoolVal(kind == "dense")), (v.recurrent, z3.BoolVal(kind == "recurrent")),
                          (v.offset, z3.IntVal(c.offset)), (v.live, z3.IntVal(rows)), (v.exact, z3.IntVal(exact))]
            want = sl.list_trim_count(nv, bounds)
            assert z3.simplify(z3.substitute(count, *subst)).as_long() == want, (combo, nv)
            for t, c in zip(trims, caches):
                assert z3.simplify(z3.substitute(t, *subst)).as_long() == _own_trim(c, want), (combo, nv)
            assert sl.trim_prompt_cache(caches, nv)[0] == want
            checked += 1
    assert checked > 300


def test_each_layer_trim_encoding_matches_the_spec_at_every_count():
    """Also at counts no list asks for (beyond a layer's exact bound: a
    recurrent layer raises, a ring returns 0, a dense layer clamps)."""
    d = Domain()
    v, k = mixed_vars(d, 0), d.var("count")
    t = layer_trims(v, k)
    for kind, c in _layer_cases():
        rows, exact = sl.layer_trim_bounds(c)
        for count in range(-1, 5):
            subst = [(v.dense, z3.BoolVal(kind == "dense")), (v.recurrent, z3.BoolVal(kind == "recurrent")),
                     (v.offset, z3.IntVal(c.offset)), (v.live, z3.IntVal(rows)), (v.exact, z3.IntVal(exact)),
                     (k, z3.IntVal(count))]
            assert z3.simplify(z3.substitute(t, *subst)).as_long() == _own_trim(c, count), (kind, c, count)
