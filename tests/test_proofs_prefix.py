"""Obligations 22 to 26 (the prefix kind, proofs/prefix.py): proved in both
domains, every negative control refuted where its fault shows, registered
with ``kvspec prove``, and no part vacuous: under each part's premises the
op is accepted in some world, and the cases the reports turn on (a hit on a
cached-free block, an eviction, a release of keyed and unkeyed blocks) are
reachable. tests/test_proofs_fidelity_prefix.py ties the encodings to
kvspec.spec.prefix."""

from __future__ import annotations

from typing import Any

import pytest
import z3

from kvspec.proofs import cli
from kvspec.proofs import prefix as pp
from kvspec.proofs import prefix_model as pm
from kvspec.proofs.domain import INT, Domain, reset_names, solver

CASES = [(22, pp.prove_key, pp.KEY_CONTROLS), (23, pp.prove_refcount, pp.REFCOUNT_CONTROLS),
         (24, pp.prove_queue, pp.QUEUE_CONTROLS), (25, pp.prove_hit, pp.HIT_CONTROLS),
         (26, pp.prove_window, pp.WINDOW_CONTROLS)]
#: where each control must be refuted: the op that shows the fault
REFUTED_AT = {(22, "evict_keeps_map_entry"): "preserved by admit", (22, "evict_keeps_key"): "preserved by admit",
              (22, "recycled_block_keeps_key"): "preserved by admit", (22, "partial_tail_keyed"): "preserved by admit",
              (23, "free_blocks_unchecked"): "free_blocks([b, b])",
              (23, "popped_block_refcount_zero"): "preserved by admit",
              (24, "touch_leaves_in_queue"): "preserved by admit",
              (24, "free_blocks_unchecked"): "preserved by free_blocks",
              (25, "uncapped_whole_prompt_hit"): "a hit of j", (25, "partial_block_hit"): "a hit of j",
              (26, "release_one_token_late"): "a windowed hit", (26, "run_one_block_short"): "a windowed hit"}


@pytest.fixture(scope="module")
def results() -> dict[int, Any]:
    """Obligations 22 to 26 proved once, as ``kvspec prove --only 22 .. 26``
    proves them (``cli.run_all``: each registered thunk after
    ``reset_names``), for the tests of each result and of the command."""
    return {r.number: r for r in cli.run_all({n for n, _, _ in CASES})}


@pytest.mark.parametrize("number,prove,controls", CASES, ids=[str(c[0]) for c in CASES])
def test_obligation_proved_and_every_control_refuted(results, number, prove, controls):
    assert dict(cli.obligations())[number] is prove  # the result is this prove function's
    result = results[number]
    assert result.number == number and result.name == cli.TITLES[number]
    assert result.status == "proved", [(p.part, p.domain, p.status, p.reason) for p in result.parts]
    assert {p.domain for p in result.parts} == {"int", "bv32"}
    assert [(c.name, c.status) for c in result.controls] == [(n, "refuted") for n, _, _, _ in controls]
    confirms = {name: confirm for name, _, _, confirm in controls}
    for c in result.controls:
        assert c.domains == {"int": "refuted", "bv32": "refuted"}, c.name
        assert c.refuting_part.startswith(REFUTED_AT[number, c.name]), (c.name, c.refuting_part)
        if confirms[c.name] is not None:
            assert c.confirmed.startswith("confirmed on spec with the bug"), (c.name, c.confirmed)


@pytest.mark.parametrize("name,confirm", [(name, confirm) for _, _, controls in CASES
                                          for name, _, _, confirm in controls if hasattr(confirm, "scenario")])
def test_each_confirming_scenario_keeps_every_invariant_on_the_spec(name, confirm):
    """A control's confirmation is the bug's doing: its scenario, on the
    spec as written, keeps every invariant at every op (free_blocks is
    refused there, nothing changed)."""
    from kvspec.spec import prefix as sp
    from kvspec.spec.errors import KVCacheError

    bs, n_blocks, ops = confirm.scenario
    world = sp.new_world(bs, n_blocks)
    for op in ops:
        try:
            _, world = sp.apply_op(world, op)
        except KVCacheError:
            assert op["op"] == "free_blocks", op
        assert not sp.broken_invariants(world), (name, op)


def test_registered_with_kvspec_prove():
    assert {22, 23, 24, 25, 26} <= {n for n, _ in cli.obligations()}
    assert cli.select(["prefix key to content", "25"], {22, 25}) == [22, 25]
    assert all(cli.TITLES[n] == pp.TITLES[n] for n in pp.TITLES)


def test_kvspec_prove_only_runs_them(results, capsys, monkeypatch):
    """The command runs exactly the obligations named (through
    ``cli.run_all``, whose results for them the module fixture holds: the
    proofs are not run twice) and reports them ok."""
    asked = []

    def run_all(only=None, progress=None):
        asked.append(only)
        got = [results[n] for n in sorted(only or ())]
        for r in got:
            if progress is not None:
                progress(r)
        return got

    monkeypatch.setattr(cli, "run_all", run_all)
    assert cli.main(["--only", "22", "23", "24", "25", "26", "--json"]) == 0
    assert asked == [{22, 23, 24, 25, 26}]
    out = capsys.readouterr().out
    assert '"ok": true' in out and out.count('"number": ') == 5, out[:500]


def _sat(premises: list[Any], *extra: Any) -> bool:
    s = solver(20_000)
    s.add(*premises, *extra)
    return s.check() == z3.sat


#: a block size past every small one: a premise narrowed to small blocks
#: (the proofs claim any B >= 1) leaves no world of this size
BIG_B = 7


@pytest.mark.parametrize("label", [label for label, _ in pp.op_cases(pp._key_goal)])
def test_no_part_is_vacuous(label):
    """Under each op part's premises (the invariant and the op's rules) the
    op is accepted in some world, with block size BIG_B too, and refused in
    another; free_blocks is refused in every world (obligation 23 proves
    it), so its part is checked on premises that hold: a held block listed
    twice."""
    case = dict(pp.op_cases(pp._key_goal))[label]
    reset_names()
    premises, _, accepted = case(Domain(INT))
    if label.startswith("preserved by free_blocks"):
        x = z3.Int("listed0")
        assert _sat(premises, x == z3.Int("listed1"), pm.sel(z3.Ints("w_rc0 w_rc1 w_rc2"), x) > 0, z3.Int("B") == BIG_B)
        assert not _sat(premises, accepted)
        return
    assert _sat(premises, accepted), label
    assert _sat(premises, accepted, z3.Int("B") == BIG_B), label
    if not label.startswith("init"):
        assert _sat(premises, z3.Not(accepted)), label


@pytest.mark.parametrize("number,label,build", [(number, label, build) for number, parts in (
    (22, pp.key_parts()), (23, pp.refcount_parts()), (24, pp.queue_parts()), (25, pp.hit_parts()),
    (26, pp.window_parts()))
    for label, build in parts], ids=lambda v: str(v)[:24] if isinstance(v, (int, str)) else "")
def test_every_part_holds_a_world_of_a_big_block_size(number, label, build):
    """A vacuity guard on the block size: every part's premises, in both
    domains, have a model with B == BIG_B (the proofs are stated for any
    symbolic B >= 1)."""
    for dom in ("int", "bv32"):
        reset_names()
        d = Domain(dom)
        premises, _ = build(d)
        assert _sat([*premises, *[a for _, a in d.assumptions], *d.facts], z3.Int("B") == BIG_B), (number, label, dom)


def _step(op: str) -> tuple[list[Any], pm.World, Any, pm.World, pm.Hit]:
    """The proof's own step for ``op`` (kvspec.proofs.prefix.op_steps): its
    premises, the world after, accepted, and the world before and the hit,
    named as the step names them."""
    reset_names()
    d = Domain(INT)
    premises, after, ok = next(step for _, name, step in pp.op_steps() if name == op)(d)
    return premises, after, ok, pm.world_vars(d), pm.hit_vars(d)


def test_an_admission_can_hit_a_cached_free_block_and_evict_another():
    """One admission that touches a cached-free block (it leaves the queue),
    shared with the other live request's table, and pops a keyed block from
    the front (evicted): the case the eviction and touch controls turn on is
    inside the admit part's own premises."""
    premises, _, ok, w, hit = _step("admit")
    cached_free_hit = z3.And(hit.j >= 1, pm.sel(w.rc, hit.h[0]) == 0)
    front_keyed = z3.And(w.qn >= 1, pm.sel(w.key, w.q[0]) >= 0, w.q[0] != hit.h[0])
    assert _sat(premises, ok, cached_free_hit, front_keyed, w.B == 2)
    other = w.reqs[1]
    shared = z3.And(hit.j >= 1, other.live, other.tl >= 1, other.t[0] == hit.h[0])
    assert _sat(premises, ok, shared, w.B == 2)


@pytest.mark.parametrize("op", ["free", "preempt"])
def test_a_release_queues_keyed_and_unkeyed_blocks(op):
    """A free (a preemption) that puts a keyed block at the back and an
    unkeyed one at the front, with the other request still holding a shared
    block: inside the part's own premises."""
    premises, _, ok, w, _ = _step(op)
    me, other = w.reqs
    shared = z3.And(other.live, other.tl >= 1, other.t[0] == me.t[0])
    keyed_and_not = z3.And(me.live, me.tl == 3, pm.sel(w.key, me.t[1]) >= 0, pm.sel(w.key, me.t[2]) == pm.NONE)
    assert _sat(premises, ok, shared, keyed_and_not)


@pytest.mark.parametrize("op", ["resume", "decode"])
def test_the_other_ops_run_on_shared_blocks(op):
    """Decode, and resume (a hit of the other request's block), each accept
    on a world where both requests' tables share a block: no part assumes
    the tables disjoint."""
    premises, _, ok, w, hit = _step(op)
    me, other = w.reqs
    both = z3.And(other.live, other.tl >= 1)
    if op == "decode":
        shared = z3.And(both, me.live, me.tl >= 1, me.t[0] == other.t[0])
    else:
        shared = z3.And(both, hit.j >= 1, hit.h[0] == other.t[0])
    assert _sat(premises, ok, shared)


def test_window_controls_fail_where_their_fault_shows():
    """Obligation 26's controls, each part by part: the late release breaks
    the attended positions and the release bound, the short run the run
    bound only."""
    from kvspec.proofs.core import run_parts

    late = {r.part.split(" (")[0][:30]: r.status
            for r in run_parts(pp.window_parts(pm.PrefixRules(skip="late")), ("int",))}
    assert set(late.values()) == {"refuted"}, late
    short = [r.status for r in run_parts(pp.window_parts(pm.PrefixRules(run="short")), ("int",))]
    assert short == ["refuted", "proved", "proved"], short
