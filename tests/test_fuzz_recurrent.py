"""The recurrent layer's harness (fuzz/recurrent.py): what its lockstep
compares and how it names a wrong conv window or state, the state machine
reaching its edges at every depth, every injected bug of the kind caught,
hybrid lists in the layers kind, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvspec.fuzz import kinds
from kvspec.fuzz.bugs import by_name
from kvspec.fuzz.campaign import catch_bug, machine_for
from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.lockstep import Divergence
from kvspec.fuzz.replay import make_lockstep, replay
from kvspec.fuzz.trace import TraceFormatError, load, parse
from kvspec.impl.recurrent import RecurrentCache, _mixers, _sub_call
from kvspec.spec.errors import StateError

TRACES = Path(__file__).parent / "traces"
RECURRENT_BUGS = [b.name for b in kinds.KINDS["recurrent"].bug_list()]


def lock(factories=None, **cache):
    doc = {"kvtrace": 1, "cache": {"kind": "recurrent", **cache}, "ops": []}
    return make_lockstep(parse(doc).cache, factories)


@pytest.mark.parametrize("depth", [0, 1, 2, 3, 4])
def test_machine_reaches_the_edges_at_every_depth(depth):
    machine = machine_for("recurrent", fixed={"depth": depth})
    run_state_machine_as_test(machine, settings=settings(max_examples=8, stateful_step_count=20, deadline=None,
                                                         derandomize=True, database=None))
    edges = [f"depth={depth}", "unrecorded steps", "rollbacks beyond the coverage (refused)"]
    if depth:
        edges += ["rollbacks of exactly the coverage", "rollbacks after a multi-token call"]
    for edge in edges:
        assert machine.stats.get(edge, 0) > 0, (edge, machine.stats)


@pytest.mark.parametrize("name", [*RECURRENT_BUGS, "list_trim_ignores_recurrent_coverage"])
def test_every_injected_bug_is_caught_by_fuzzing(name, tmp_path):
    got = catch_bug(by_name(name), seed=1, max_examples=40, out_dir=tmp_path, shrink=False)
    assert got.caught and got.alarm is None, got


def test_a_wrong_state_is_named_by_the_prefix_it_summarises():
    lk = lock(depth=0, kernel=3, batch=2, dtype="bfloat16")
    lk.step(0, {"op": "append", "n": 2})
    stale = lk.cache.cache[1]
    lk.step(1, {"op": "append", "n": 3})
    lk.cache.cache[1] = stale  # the state after [0, 1], where the spec has [0, 1, 2, 3, 4]
    with pytest.raises(Divergence) as err:
        lk.step(2, {"op": "fetch"})
    text = str(err.value)
    assert "recurrent state differs" in text
    assert "the state after [0, 1, 2, 3, 4]" in text and "the state after [0, 1]" in text


def test_a_wrong_conv_window_is_named_row_by_row():
    lk = lock(depth=0, kernel=4, channels=2)
    lk.step(0, {"op": "append", "n": 1})
    first = lk.cache.cache[0]  # rows: zero, zero, 0
    lk.step(1, {"op": "append", "n": 2})
    lk.cache.cache[0] = first
    with pytest.raises(Divergence) as err:
        lk.step(2, {"op": "fetch"})
    assert "conv window differs" in str(err.value)
    assert err.value.spec == [0, 1, 2] and err.value.impl == ["zero", "zero", 0]


def test_a_checkpoint_is_checked_before_any_trim_lands_on_it():
    """After every op each rollback the coverage allows is taken on a copy
    and compared: a wrong checkpoint shows at the call that stored it."""
    lk = lock(depth=2, kernel=2)
    lk.step(0, {"op": "append", "n": 3})
    ring = lk.cache._ring  # offsets 1, 2, 3 in slots 1, 2, 0
    lk.cache._ring = (ring[0], ring[0], ring[2])  # offset 1's slot holds offset 3's arrays
    with pytest.raises(Divergence, match="live layer after a rollback of 2"):
        lk.step(1, {"op": "can_trim"})


def _recorder_keeping_the_whole_mask(model):
    """A step recorder that splits the input but hands every sub-call the
    whole call's mask (a broken slicing of the mixer's other arguments)."""
    import inspect

    for m in _mixers(model):
        cls = type(m)
        original = cls.__call__

        def __call__(self, x, mask=None, cache=None, _original=original):
            if not isinstance(cache, RecurrentCache) or cache.depth == 0:
                return _original(self, x, mask, cache)
            bound = inspect.signature(_original).bind(self, x, mask, cache=cache)
            cache._mark()
            outs = [_sub_call(_original, bound, self, cache, ("x",), t, t + 1, single=True)
                    for t in range(x.shape[1])]
            return mx.concatenate(outs, axis=1)

        m.__class__ = type(cls.__name__, (cls,), {"__call__": __call__})
    return 1


def test_the_recorder_must_slice_the_mask_with_the_input():
    ok = lock(depth=2, batch=2)
    ok.step(0, {"op": "append", "n": 2})  # the real recorder slices the (B, S) mask
    broken = lock({"recurrent": {"record_steps": _recorder_keeping_the_whole_mask}}, depth=2, batch=2)
    with pytest.raises(Divergence, match="refusal differs") as err:
        broken.step(0, {"op": "append", "n": 2})
    assert "mask of shape (2, 2) for a call of 1 tokens" in str(err.value)


@pytest.mark.parametrize(("cache", "needle"), [
    ({"kind": "recurrent", "kernel": 1}, "cache.kernel: must be an integer >= 2"),
    ({"kind": "recurrent", "size": 2, "rows": "numpy"}, "cache.rows: a recurrent layer's rows are the portable rows"),
    ({"kind": "recurrent", "max_size": 4}, "cache.max_size: not a field of kind recurrent"),
    ({"kind": "layers", "layers": [{"kind": "recurrent"}, {"kind": "dense"}]}, "cache.layers.0.kind"),
    ({"kind": "layers", "layers": [{"kind": "dense"}, {"kind": "recurrent", "depth": 1}],
      "build": "make_prompt_cache"}, "cache.layers.1.depth"),
])
def test_configurations_the_kind_cannot_build_are_refused(cache, needle):
    doc = {"kvtrace": 1, "cache": cache, "ops": []}
    with pytest.raises(TraceFormatError, match=needle.replace(".", r"\.")):
        make_lockstep(parse(doc).cache)


def test_hybrid_list_trim_is_all_or_none():
    trace = load(TRACES / "list_trim_ignores_recurrent_coverage.json")
    assert replay(trace).ok
    broken = replay(trace, by_name("list_trim_ignores_recurrent_coverage").factories)
    assert not broken.ok and broken.divergence.index == 1


def test_hybrid_lists_built_by_make_prompt_cache_record_steps():
    doc = {"kvtrace": 1, "cache": {"kind": "layers", "build": "make_prompt_cache", "num_draft_tokens": 2,
                                   "layers": [{"kind": "dense"}, {"kind": "recurrent", "size": 1, "kernel": 3}]},
           "ops": [{"op": "append", "n": 4}, {"op": "trim", "n": 2, "returns": 2}, {"op": "trim", "n": 1, "returns": 0},
                   {"op": "expect", "window": [0, 1], "layer": 1}]}
    result = replay(parse(doc))
    assert result.ok, result.divergence


def test_cli_fuzz_replay_and_render(tmp_path, capsys):
    assert main(["fuzz", "--kind", "recurrent", "--budget", "2", "--seed", "1", "--out", str(tmp_path)]) == 0
    path = str(TRACES / "recurrent_worked_example.json")
    assert main(["replay", path]) == 0
    assert main(["replay", str(TRACES / "conv_window_not_rolled_back.json"), "--bug", "conv_window_not_rolled_back"]) == 1
    out = tmp_path / "t.html"
    assert main(["render", path, "--html", "-o", str(out)]) == 0
    assert out.stat().st_size > 0
    capsys.readouterr()


def test_every_recurrent_trace_carries_a_title():
    for name in [*RECURRENT_BUGS, "recurrent_worked_example"]:
        assert json.loads((TRACES / f"{name}.json").read_text())["title"]


class _QuietRefusal(RecurrentCache):
    """Refuses a rollback beyond its coverage without saying why."""

    def trim(self, n):
        if isinstance(n, int) and not isinstance(n, bool) and n > self.trimmable_rows():
            raise StateError("trim: refused")
        return super().trim(n)


def test_a_refused_rollback_must_name_the_coverage():
    ok = lock(depth=1)
    ok.step(0, {"op": "append", "n": 2})
    ok.step(1, {"op": "trim", "n": 2, "error": True})
    quiet = lock({"recurrent": _QuietRefusal}, depth=1)
    quiet.step(0, {"op": "append", "n": 2})
    with pytest.raises(Divergence, match="refused rollback does not name the coverage"):
        quiet.step(1, {"op": "trim", "n": 2})
