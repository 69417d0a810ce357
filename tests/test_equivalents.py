"""The Z3 equivalence checks behind docs/mutation.md's "equivalent" survivors:
every claim proved, every control refuted, and the encodings agree with the
spec's Python on small values (so the proof is about the code, not a model
of it that drifted)."""

import itertools

import pytest
import z3

from kvspec.proofs.equivalents import EQUIVALENCES, _prefill_kept, check
from kvspec.spec import rotating as sr


@pytest.mark.parametrize("e", EQUIVALENCES, ids=lambda e: e.name)
def test_equivalence_proved_and_control_refuted(e):
    r = check(e)
    assert r.proved, f"{e.name}: original and mutant differ at {r.counterexample}"
    assert r.control_refuted, f"{e.name}: the control '{e.control}' was not refuted: the check is vacuous"


def _eval(formula, **values):
    subs = [(z3.Int(k), z3.IntVal(v)) for k, v in values.items()]
    return z3.is_true(z3.simplify(z3.substitute(formula, *subs)))


def test_visible_encoding_matches_spec():
    e = next(e for e in EQUIVALENCES if e.name == "visible_at_window")
    v = {n: z3.Int(n) for n in e.variables}
    _, original, _ = e.build(v, False)
    for W in range(1, 6):
        for K, off in itertools.product(range(W), range(10)):
            want = set(sr.visible_positions(off, W, K))
            got = {p for p in range(-1, 12) if _eval(original, offset=off, W=W, K=K, p=p)}
            assert got == want, (off, W, K)


def test_prefill_cut_encoding_matches_spec():
    """_prefill_kept against kvspec.spec.rotating.prefill itself: a ring holding
    rows 0..L-1 (oversized when L > W) takes a two-row append; the rows it
    returns before the new ones are the kept old rows."""
    i = z3.Int("i")
    for W in range(1, 6):
        for K, L in itertools.product(range(W), range(9)):
            c = sr.new_cache(W, keep=K, step=1)
            if L:
                _, c = sr.append(c, tuple(range(L)))
            result, _ = sr.append(c, (100, 101))
            kept = result.window[:-2]
            budget, sinks = W - 1, min(K, L)
            formula = _prefill_kept(i, z3.IntVal(L), z3.IntVal(budget), z3.IntVal(sinks),
                                    z3.BoolVal(L > budget), z3.BoolVal(budget > sinks))
            assert tuple(x for x in range(L) if _eval(formula, i=x)) == kept, (W, K, L)
