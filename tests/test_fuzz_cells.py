"""The cells kind's harness (fuzz/cells.py): campaigns catch every injected
bug of fuzz/bugs/cells.py, the recorded traces pass on our implementation
and diverge on the bug they are named after, replay's exit codes, bad trace
input refused naming the field, and the plug-in surface another engine uses
(cells_campaign, replay_cells with a target factory)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvspec.fuzz.bugs import by_name
from kvspec.fuzz.bugs.cells import BUGS
from kvspec.fuzz.cells import CellsLockstep
from kvspec.fuzz.cells_runs import cells_campaign, replay_cells
from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.failures import Divergence
from kvspec.fuzz.trace import TraceFormatError, load
from kvspec.impl.cells import CellCache
from kvspec.spec import cells as sc

TRACES = Path(__file__).parent / "traces"
CELL_TRACES = sorted(TRACES.glob("cells_*.json"))


@pytest.mark.parametrize("bug", BUGS, ids=lambda b: b.name)
def test_a_campaign_catches_the_bug_and_its_trace_passes_on_ours(bug):
    got = cells_campaign(bug.factories["cells"], max_examples=300, seed=1, shrink=False)
    assert got.status == "diverged", f"{bug.name} not caught in {got.examples} examples"
    assert isinstance(got.error, Divergence)
    clean = replay_cells(got.trace)
    assert clean.ok, clean.divergence


def test_a_clean_campaign_agrees_and_reaches_the_edges():
    """Bounded by examples: seed 3 reaches every event below within 20."""
    got = cells_campaign(None, max_examples=20, seed=3)
    assert got.ok, got.error
    for event in ("decodes", "windowed cells reused", "shared cells", "shifts composed before a read",
                  "restores into another sequence"):
        assert got.stats.get(event), event


def test_every_bug_has_its_trace():
    assert {b.name for b in BUGS} <= {p.stem for p in CELL_TRACES}


@pytest.mark.parametrize("path", CELL_TRACES, ids=lambda p: p.stem)
def test_recorded_trace_passes_on_ours_and_catches_its_bug(path, capsys):
    assert main(["replay", str(path)]) == 0
    names = {b.name for b in BUGS}
    if path.stem in names:
        assert load(path).title, "a bug's trace says what it checks"
        assert main(["replay", str(path), "--bug", path.stem]) == 1
        assert not replay_cells(load(path), by_name(path.stem).factories["cells"]).ok
    capsys.readouterr()


def _doc(**cache_over):
    cache = {"kind": "cells", "n_cells": 4, "window": 2, "stores": ["full", "window"], "n_seq": 2}
    cache.update(cache_over)
    return {"kvtrace": 1, "cache": cache, "ops": [{"op": "decode", "seqs": [0], "tokens": [1, 2], "pos0": 0}]}


@pytest.mark.parametrize("change,field", [
    (lambda d: d["ops"].append({"op": "seq_rm", "seq": "a", "p0": 0}), "seq"),
    (lambda d: d["ops"].append({"op": "seq_rm", "seq": 0, "p0": 0, "p1": "x"}), "p1"),
    (lambda d: d["ops"].append({"op": "seq_add", "seq": 0, "p0": 0}), "delta"),
    (lambda d: d["ops"].append({"op": "restore", "name": "never", "seq": 0}), "name"),
    (lambda d: d["cache"].pop("n_cells"), "n_cells"),
    (lambda d: d["cache"].update(window=None), "window"),
    (lambda d: d["cache"].update(stores=["window", "full"]), "stores"),
    (lambda d: d["cache"].update(window_cells=5), "window_cells"),
    (lambda d: d["cache"].update(window_cells=0), "window_cells"),
    (lambda d: d["cache"].update(stores=["full"], window=None, window_cells=3), "window_cells"),
    (lambda d: d["ops"].append({"op": "append", "n": 1}), "append"),
    # recorded drops: malformed, on an op that drops nothing, a cell not droppable (more than the write
    # needs is allowed: a trace does not say which drop policy made them, test_recorded_drops_beyond_the_need)
    (lambda d: d["ops"].append({"op": "decode", "seqs": [0], "tokens": [3], "pos0": 2, "drops": [[0, 1]]}), "drops"),
    (lambda d: d["ops"].append({"op": "seq_rm", "seq": 0, "p0": 0, "drops": [[0, [0], 1]]}), "drops"),
    (lambda d: d["ops"].append({"op": "decode", "seqs": [0], "tokens": [3], "pos0": 2, "drops": [[1, [0], 2]]}),
     "drops"),
])
def test_bad_trace_input_exits_2_naming_the_field(tmp_path, capsys, change, field):
    doc = _doc()
    change(doc)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    assert main(["replay", str(p)]) == 2
    out = capsys.readouterr().out
    assert field in out and "Traceback" not in out, out


def test_a_refused_op_changes_nothing_and_both_sides_agree():
    lock = CellsLockstep({"kind": "cells", "n_cells": 2, "window": None, "stores": ["full"], "n_seq": 2,
                          "kv_heads": 1, "head_dim": 8, "dtype": "float16"})
    lock.step(0, {"op": "decode", "seqs": [0], "tokens": [1, 2], "pos0": 0})
    before = lock.world.memory
    lock.step(1, {"op": "decode", "seqs": [0], "tokens": [3], "pos0": 2})  # no slot: False
    lock.step(2, {"op": "decode", "seqs": [0], "tokens": [3], "pos0": 5})  # not consecutive: refused
    assert lock.world.memory == before
    assert lock.stats["decodes without a slot"] == 1 and lock.stats["refused decode"] == 1


class SpecTarget(sc.CellsMemory):
    """The spec itself as a CellsTarget (another engine's shape: its own
    snapshot handle, names computed by itself)."""

    name = "spec-as-target"

    def __init__(self, cache: dict) -> None:
        super().__init__(sc.CellsConfig(n_cells=cache["n_cells"], window=cache.get("window"),
                                        stores=tuple(cache["stores"]), n_seq=cache["n_seq"],
                                        window_cells=cache.get("window_cells")))


class ForgetfulTarget(SpecTarget):
    """seq_cp that does nothing: the lockstep must say so."""

    def seq_cp(self, src: int, dst: int, p0: int, p1: int | None) -> None:
        sc.seq_cp(self.state, src, dst, p0, p1)  # the checks only


def test_another_target_plugs_in_through_the_two_calls():
    assert cells_campaign(SpecTarget, max_examples=40, seed=2).ok
    # the trace as found (caught at example 3; shrinking is the catalog bugs' and test_bugs')
    bad = cells_campaign(ForgetfulTarget, max_examples=100, seed=2, shrink=False)
    assert bad.status == "diverged" and bad.trace is not None
    assert "seq_cp" in {op["op"] for op in bad.trace.ops}
    assert replay_cells(bad.trace).ok
    again = replay_cells(bad.trace, ForgetfulTarget)
    assert not again.ok and "spec-as-target did" in str(again.divergence)


def test_replay_cells_refuses_another_kind():
    with pytest.raises(TraceFormatError, match="cache.kind"):
        replay_cells(load(TRACES / "format_example.json"))


# -- adoption after validation, at restore too; window_cells; refusal words ---------------------------------



class ReusesLastSequenceFirst(CellCache):
    """A legitimate choice: among droppable cells, the highest sequence id
    (then the lowest position) is reused first."""

    def _droppable(self, stores, st):
        got = super()._droppable(stores, st)
        return sorted(got, key=lambda i: (-max(st.seqs[i]), st.pos[i]))


class ReusesHighestPositionFirst(CellCache):
    """Another legitimate choice: the droppable cell of highest position first."""

    drop_policy = "highest position first"

    def _droppable(self, stores, st):
        return sorted(super()._droppable(stores, st), key=lambda i: -st.pos[i])


WIN_ONLY = {"kind": "cells", "n_cells": 6, "window": 2, "stores": ["window"], "n_seq": 2, "kv_heads": 1,
            "head_dim": 8, "dtype": "float16"}


def test_adoption_validates_the_group_on_the_state_before_the_drops():
    lock = CellsLockstep(dict(WIN_ONLY), ReusesLastSequenceFirst)
    lock.step(0, {"op": "decode", "seqs": [0], "tokens": [1, 2, 3], "pos0": 0})
    lock.step(1, {"op": "decode", "seqs": [1], "tokens": [4, 5, 6], "pos0": 0})
    # the target reuses sequence 1's position 1 cell: the group (0, 1) was valid before that drop
    lock.step(2, {"op": "decode", "seqs": [0, 1], "tokens": [7], "pos0": 3})
    assert sc.lost(lock.world.memory, 1) == {0}
    assert lock.stats["windowed cells dropped by the target's choice"] == 1


def test_a_restore_may_reuse_droppable_window_cells_and_its_choice_is_adopted():
    cache = {**WIN_ONLY, "stores": ["full", "window"], "n_cells": 8, "window_cells": 4}
    for factory in (None, ReusesHighestPositionFirst):
        lock = CellsLockstep(dict(cache), factory)
        ops = [{"op": "decode", "seqs": [1], "tokens": [9, 8], "pos0": 0},
               {"op": "save", "seq": 1, "name": "s"},
               {"op": "seq_rm", "seq": 1, "p0": -1, "p1": -1},
               {"op": "decode", "seqs": [0], "tokens": [1, 2, 3, 4], "pos0": 0},
               {"op": "restore", "name": "s", "seq": 1}]  # 2 window cells: 2 of 0's 3 droppable reused
        for i, op in enumerate(ops):
            lock.step(i, op)
        assert len(sc.lost(lock.world.memory, 0)) == 2
    assert sc.lost(lock.world.memory, 0) == {1, 2}  # the target's choice (highest position first)


def test_window_cells_reach_both_sides_and_the_machine_draws_it():
    cache = {**WIN_ONLY, "stores": ["full", "window"], "n_cells": 8, "window_cells": 3}
    lock = CellsLockstep(dict(cache))
    assert lock.target.cache.window_cells == 3 and lock.world.memory.config.window_cells == 3
    lock.step(0, {"op": "decode", "seqs": [0], "tokens": [1, 2, 3], "pos0": 0})
    lock.step(1, {"op": "decode", "seqs": [0], "tokens": [4], "pos0": 3})  # the full store has room, the window not
    assert sc.lost(lock.world.memory, 0) == {0} and lock.stats["windowed cells reused"] == 1
    assert len(lock.world.memory.present("full")) == 4
    got = cells_campaign(None, max_examples=30, seed=5)  # seed 5 reaches the refusal 7 times in 30
    assert got.ok, got.error
    assert got.stats.get("windowed seq_rm refused after an iSWA window reuse"), got.stats


def test_refusal_words_are_compared_for_ours():
    assert CellsLockstep.OWN_WORDED_OPS == frozenset()
    lock = CellsLockstep(dict(WIN_ONLY))
    lock.compare_messages = True
    lock.step(0, {"op": "decode", "seqs": [0], "tokens": [1, 2], "pos0": 0})
    for i, op in enumerate([{"op": "seq_div", "seq": 0, "p0": 0, "p1": None, "d": 0},
                            {"op": "seq_add", "seq": 0, "p0": 1, "p1": None, "delta": -1},
                            {"op": "decode", "seqs": [0], "tokens": [3], "pos0": 7},
                            {"op": "decode", "seqs": [0], "tokens": [], "pos0": 2},
                            {"op": "seq_cp", "src": 0, "dst": 0, "p0": 0, "p1": 5},
                            {"op": "seq_rm", "seq": 9, "p0": 0, "p1": None}], start=1):
        lock.step(i, op)


# -- self-contained traces: the target's drops recorded in the op ----------------------------------------------

RECORDED = TRACES / "cells_recorded_drops.json"


def test_a_trace_carries_its_drops_and_needs_them():
    """The recorded drops take the spec (and ours) to the target's state;
    without them the trace's expects fail on the spec alone."""
    assert replay_cells(load(RECORDED)).ok
    stripped = load(RECORDED)
    for op in stripped.ops:
        op.pop("drops", None)
    got = replay_cells(stripped)
    assert not got.ok and "spec says" in str(got.divergence)


def test_the_lockstep_records_an_adopted_choice_and_ours_follows_it():
    from kvspec.fuzz.cells_choosy import HighestFirstCellCache
    from kvspec.fuzz.trace import Trace

    doc = json.loads(RECORDED.read_text())
    ops = [{k: v for k, v in op.items() if k not in ("drops", "returns", "value")}
           for op in doc["ops"] if op["op"] in ("decode", "save", "restore")]
    lock = CellsLockstep(dict(doc["cache"]), HighestFirstCellCache)
    for i, op in enumerate(ops):
        lock.step(i, op)
    assert ops[1]["drops"] == [[2, [0], 3]]  # the highest droppable position, not the spec's 0
    assert ops[3]["drops"] == [[1, [0], 2], [3, [0], 4]]  # after the clear of sequence 1: 3 then 1
    trace = Trace(cache=dict(doc["cache"]), ops=[dict(op) for op in ops] + lock.expect_ops())
    assert replay_cells(trace).ok  # spec and ours, following the recorded drops
    for op in trace.ops:
        op.pop("drops", None)
    assert not replay_cells(trace).ok


def test_render_draws_a_cells_trace_its_stores_and_drops(tmp_path):
    from kvspec.fuzz.render import svg, timeline

    tl = timeline(load(RECORDED))
    assert tl.divergence is None
    stores = [r for r in tl.frames[1].rows if r.group == "store"]
    assert [r.label for r in stores] == ["window store"]
    assert [c.cls for c in stores[0].cells].count("wrong") == 1  # the recorded drop, outlined
    assert "lost: pos 1" in " ".join(c.tip for c in stores[0].cells)
    import re

    header = " ".join(re.findall(r'<text class="small"[^>]*>([^<]*)</text>', svg(tl)))
    assert "kind cells, n_cells 4, window_cells 4, window 2, stores" in header and "n_seq 2" in header
    assert "mode" not in header and "inplace" not in header and "step" not in header


# -- the drop policy: a declared policy is held to the spec's choice; any target drops only what it lacks -----


def test_a_target_declaring_the_spec_policy_must_drop_the_spec_positions():
    class DeclaresLowestDropsHighest(ReusesHighestPositionFirst):
        drop_policy = sc.DROP_POLICY

    lock = CellsLockstep(dict(WIN_ONLY), DeclaresLowestDropsHighest)
    lock.step(0, {"op": "decode", "seqs": [0], "tokens": [1, 2, 3, 4, 5, 6], "pos0": 0})
    with pytest.raises(Divergence, match="drop policy"):
        lock.step(1, {"op": "decode", "seqs": [0], "tokens": [7], "pos0": 6})


def test_no_target_drops_more_than_free_cells_lack():
    class DropsTwo(CellCache):
        drop_policy = "drops two whenever it drops"

        def _slots(self, stores, st, n, reuse=True, keep=None):
            got = super()._slots(stores, st, n, reuse, keep)
            if got is not None and any(st.pos[i] >= 0 for i in got):
                extra = [i for i in self._droppable(stores, st) if i not in got][:1]
                for i in extra:  # one more droppable cell made lost, as a purge of another sequence would
                    st.lost.append((st.pos[i], st.seqs[i]))
                    st.free(i)
            return got

    lock = CellsLockstep(dict(WIN_ONLY, n_seq=2), DropsTwo)
    lock.step(0, {"op": "decode", "seqs": [1], "tokens": [1, 2, 3], "pos0": 0})
    lock.step(1, {"op": "decode", "seqs": [0], "tokens": [4, 5, 6], "pos0": 0})
    with pytest.raises(Divergence, match="more cells dropped than the write needs"):
        lock.step(2, {"op": "decode", "seqs": [0], "tokens": [7], "pos0": 3})


# -- a choosy legal target: the adoption branches run, at decodes and at restores -------------------------------


def test_a_choosy_target_agrees_and_is_adopted_at_decodes_and_restores():
    from kvspec.fuzz.cells_choosy import HighestFirstCellCache

    got = cells_campaign(HighestFirstCellCache, max_examples=60, seed=1, shrink=False)
    assert got.ok, got.error
    assert got.stats.get("windowed cells dropped by the target's choice at a decode", 0) >= 20, got.stats
    assert got.stats.get("windowed cells dropped by the target's choice at a restore into a sequence that held "
                         "window cells", 0) >= 3, got.stats


def test_recorded_drops_beyond_the_need():
    """A trace's recorded drops are held to the spec's permission alone:
    llama.cpp's head-order slot search may reuse an out-of-window cell while
    free cells remain, and the trace does not say which policy dropped it."""
    import kvspec.spec.cells as sc
    from kvspec.fuzz.cells import CellsWorld, _spec_run_dropping

    m = sc.CellsMemory(n_cells=4, window=2, stores=("full", "window"), n_seq=2)
    m.decode((0,), (1, 2), 0)
    world = CellsWorld(m.state, {})
    op = {"op": "decode", "seqs": [0], "tokens": [3], "pos0": 2}
    ok, after = _spec_run_dropping(world, op, 1, [[0, [0], 1]])
    assert ok and sc.lost(after.memory, 0) == frozenset({0})


def test_recorded_drops_are_bounded_by_the_write_size():
    """Whatever the policy, a write of n cells reuses at most n: recorded
    drops taking cells of more sequences than that are refused."""
    import kvspec.spec.cells as sc
    from kvspec.fuzz.cells import CellsWorld, _spec_run_dropping
    from kvspec.spec.errors import StateError

    m = sc.CellsMemory(n_cells=6, window=1, stores=("window",), n_seq=2)
    m.decode((0,), (1, 2), 0)
    m.decode((1,), (3, 4), 0)
    op = {"op": "decode", "seqs": [0], "tokens": [5], "pos0": 2}
    with pytest.raises(StateError, match="at most 1"):
        _spec_run_dropping(CellsWorld(m.state, {}), op, 2, [[0, [0], 1], [0, [1], 3]])
