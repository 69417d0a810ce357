"""mlx-lm's snapshot protocol under the harness (kvtrace ``state_snapshot`` /
``state_restore``; semantics.md 8, "The state protocol"): the spec's
answer is the snapshot rule, our caches keep it, mlx-lm's do not, and the
conformance search finds that by itself."""

import json
import math
from pathlib import Path

import pytest

from kvspec.fuzz.adapters.mlx_lm import KVCACHE
from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.commands.conformance import search_class
from kvspec.fuzz.replay import replay
from kvspec.fuzz.trace import load
from kvspec.impl.dense import KVCache
from kvspec.spec import dense as sd
from kvspec.spec import rotating as sr
from kvspec.spec.errors import StateError

TRACES = Path(__file__).parent / "traces"


def test_spec_state_snapshot_is_a_snapshot_of_the_live_rows():
    w = sd.new_world("fp16", 4)
    w = sd.apply_op(w, {"op": "append", "n": 5})[1]
    assert w.cache.capacity == 8
    w = sd.apply_op(w, {"op": "state_snapshot", "name": "s"})[1]
    assert w.holders["s"].kind == "state snapshot" and w.holders["s"].buffer.capacity == 5
    w = sd.apply_op(w, {"op": "trim", "n": 2})[1]
    w = sd.apply_op(w, {"op": "state_restore", "name": "s"})[1]
    assert w.cache.window() == (0, 1, 2, 3, 4) and w.cache.capacity == 5 and w.cache.marker is None
    with pytest.raises(StateError, match="'s' is a state snapshot, not a snapshot"):
        sd.apply_op(w, {"op": "restore", "name": "s"})
    w = sd.apply_op(w, {"op": "snapshot", "name": "p"})[1]
    with pytest.raises(StateError, match="'p' is a snapshot, not a state snapshot"):
        sd.apply_op(w, {"op": "state_restore", "name": "p"})


def test_spec_ring_state_keeps_the_valid_slots_only():
    w = sr.RotatingWorld(sr.new_cache(4, 0, 3, True, "fp16", 0))
    w = sr.apply_op(w, {"op": "append", "n": 2})[1]
    w = sr.apply_op(w, {"op": "trim", "n": 1})[1]
    assert w.cache.capacity == 2 and w.cache.valid_len == 1
    w = sr.apply_op(w, {"op": "state_snapshot", "name": "s"})[1]
    w = sr.apply_op(w, {"op": "append", "n": 4})[1]
    w = sr.apply_op(w, {"op": "state_restore", "name": "s"})[1]
    assert w.cache.window() == (0,) and w.cache.capacity == 1 and w.cache.log == ()
    with pytest.raises(StateError, match="is a state snapshot, not a snapshot"):
        sr.apply_op(w, {"op": "restore", "name": "s"})


@pytest.mark.parametrize("name", ["state_restore_then_trim", "int8_state_keeps_dtype", "ring_state_protocol"])
def test_our_caches_keep_the_snapshot_rule(name):
    assert replay(load(TRACES / f"{name}.json")).ok


def test_mlx_lm_overwrites_rows_kept_through_state(capsys):
    """The issue's case: a stored [0..13] reads [0..9, 14, 15, 16, 13]."""
    path = str(TRACES / "state_restore_then_trim.json")
    assert main(["replay", path, "--target", "mlx-lm", "--waive", "capacity", "--json"]) == 1
    d = json.loads(capsys.readouterr().out)["divergence"]
    assert d["what"] == "view of state snapshot holder:saved changed (isolation)"
    assert d["impl"] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 14, 15, 16, 13] and d["spec"] == list(range(14))


class DropsDtype(KVCache):
    """The fault the state ops found: meta_state without the Int8 dtype."""

    @property
    def meta_state(self):
        return super().meta_state[:4]

    @meta_state.setter
    def meta_state(self, v):
        KVCache.meta_state.fset(self, v)


def test_int8_state_without_its_dtype_diverges():
    trace = load(TRACES / "int8_state_keeps_dtype.json")
    result = replay(trace, {"dense": DropsDtype})
    assert not result.ok and "state snapshot" in result.divergence.what, result.divergence


def test_turbo_modes_have_no_state_setter_exit_2(tmp_path, capsys):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"kvtrace": 1, "cache": {"kind": "dense", "mode": "turbo4asym"},
                             "ops": [{"op": "append", "n": 1}, {"op": "state_snapshot", "name": "s"}]}))
    assert main(["replay", str(p)]) == 2
    assert "no state setter" in capsys.readouterr().out


def test_a_class_without_the_protocol_skips_its_ops():
    class NoSetter:
        kvspec_kind = "dense"
        offset = 0

        def update_and_fetch(self, k, v): ...
        def fetch(self): ...

        @property
        def state(self):
            return ()

    from kvspec.fuzz.targets import class_target

    t = class_target(NoSetter)
    c = t.cache_class("dense", "fp16")
    assert c.skipped["state_restore"] == "no state.setter member"
    with pytest.raises(Exception, match="no state.setter"):
        t.check({"kind": "dense", "mode": "fp16"}, [{"op": "state_snapshot", "name": "s"}])


def test_the_conformance_search_finds_the_state_aliasing(tmp_path):
    """Not told where: the KVCache search (the default seed) reaches it in
    its rounds; the minimal trace replays 1 on mlx-lm and 0 on ours."""
    report = search_class(KVCACHE, "mlx-lm", math.inf, 20261129, tmp_path, max_findings=3, max_rounds=40)
    state = [f for f in report.findings if f.what.startswith("view of state snapshot")]
    assert state and state[0].confirmed, [f.summary for f in report.findings]
    trace = load(state[0].trace)
    assert {op["op"] for op in trace.ops} >= {"state_snapshot", "append"}
    assert len([op for op in trace.ops if op["op"] != "expect"]) <= 6
