"""Encoding fidelity for obligation 8 (``kvspec.proofs.rotating_undo``): the closed
forms and the rolled-back slot contents agree with ``kvspec.spec.rotating`` on
concrete decode histories, for the spec's rules and for each negative
control's rule against the spec with that bug patched in."""

from __future__ import annotations

import z3

from kvspec.proofs import rotating_undo as ru
from kvspec.proofs import traces
from kvspec.proofs.domain import INT, Domain, evaluate
from kvspec.spec import rotating as sr

NAMES = ("W", "K", "U", "offset", "n", "s", "x", "y")


def decoded(W, K, U, o):
    c = sr.new_cache(W, keep=K, step=1, undo=U)
    for t in range(o):
        _, c = sr.append(c, (t,))
    return c


def cases():
    for W in range(1, 6):
        for K in range(W):
            for U in (1, 2, 3, 5):
                for o in range(13):
                    for n in range(1, min(U, o) + 1):
                        yield W, K, U, o, n


def test_content_and_earliest_match_decode_histories():
    d = Domain(INT)
    v = {name: d.var(name) for name in NAMES}
    content = ru.content(d, v["x"], v["s"], v["W"], v["K"])
    first = ru.earliest(d, v["y"], v["s"], v["W"], v["K"])
    for W in range(1, 6):
        for K in range(W):
            for x in range(14):
                c = decoded(W, K, 0, x)
                for s in range(K, W):
                    subs = {v["W"]: z3.IntVal(W), v["K"]: z3.IntVal(K), v["x"]: z3.IntVal(x), v["s"]: z3.IntVal(s),
                            v["y"]: z3.IntVal(x)}
                    if x > s:
                        assert evaluate(content, subs) == c.slots[s].position
                    e = evaluate(first, subs)
                    assert e >= x and sr.ring_slot(e, W, K) == s
                    assert all(sr.ring_slot(q, W, K) != s for q in range(x, e))


def test_rolled_back_matches_spec_and_controls_match_patched_spec():
    d = Domain(INT)
    v = {name: d.var(name) for name in NAMES}
    exprs = {rules: ru.rolled_back(d, v["offset"], v["n"], v["s"], v["W"], v["K"], v["U"], rules)
             for rules in (ru.UNDO_SPEC, ru.UndoRules(log="one_short"), ru.UndoRules(order="oldest_first"))}
    patches = {ru.UndoRules(log="one_short"): {"log_push": ru._log_push_one_short},
               ru.UndoRules(order="oldest_first"): {"rollback": ru._rollback_oldest_first}}
    differs = {rules: 0 for rules in patches}
    for W, K, U, o, n in cases():
        c = decoded(W, K, U, o)
        got, after = sr.trim(c, n)
        assert got == n
        subs = {v["W"]: z3.IntVal(W), v["K"]: z3.IntVal(K), v["U"]: z3.IntVal(U), v["offset"]: z3.IntVal(o),
                v["n"]: z3.IntVal(n)}
        for s in range(K, min(o - n, W)):
            subs[v["s"]] = z3.IntVal(s)
            assert evaluate(exprs[ru.UNDO_SPEC], subs) == after.slots[s].position
        for rules, patch in patches.items():
            with traces.patched(sr, **patch):
                bug = decoded(W, K, U, o)
                _, bug_after = sr.trim(bug, n)
            for s in range(K, min(o - n, W)):
                subs[v["s"]] = z3.IntVal(s)
                want = bug_after.slots[s].position
                assert evaluate(exprs[rules], subs) == want
                differs[rules] += want != after.slots[s].position
    assert all(differs.values())  # each control's rule is a real bug on the spec


def test_memory_parts_on_the_spec():
    """A whole record saves at most one row and the log never holds more
    than U rows, on every history of the exhaustive spec check."""
    for W, K, U, o, _ in cases():
        c = decoded(W, K, U, o)
        assert sr.log_saved_rows(c.log) <= U and len(c.log) <= U
        assert all(len(r.saved) <= 1 for r in c.log)
        _, b = sr.append(c, (100, 101, 102))
        assert sr.log_saved_rows(b.log) <= U and all(len(r.saved) <= 1 for r in b.log if r.whole)
