"""The differential state machines, short and deterministic (CI profile)."""

import re

import pytest
from hypothesis import settings

from kvspec.fuzz.campaign import machine_for
from tests.budget import examples

CONFIGS = [("dense", "fp16", True), ("dense", "fp16", False), ("dense", "int8", True), ("rotating", "fp16", True),
           ("rotating", "fp16", False)]


@pytest.mark.parametrize("kind,mode,inplace", CONFIGS)
def test_state_machine_agrees(kind, mode, inplace):
    machine = machine_for(kind, mode, inplace)
    # the loaded profile (ci, or mutation under `make mutation`), longer runs
    machine.TestCase.settings = settings(settings.default, max_examples=examples(40), stateful_step_count=30)
    machine.TestCase().runTest()
    # the run must actually have reached the edges it is there for
    assert machine.stats.get("copying writes", 0) > 0
    if inplace and mode == "fp16":
        assert machine.stats.get("in-place writes", 0) > 0
    # names used wrongly (misuse_name) reach the refusals of the named ops
    named = ("snapshot", "restore", "drop", "detach", "install")
    assert sum(machine.stats.get("refused " + op, 0) for op in named) > 0, machine.stats


# -- the stored-form checks, each seen failing on a broken variant -------------------
def _load_drops_live_start():
    from kvspec.impl.dense import KVCache

    class LoadDropsLiveStart(KVCache):
        """from_state ignores live_start (a front-trimmed cache loads as if untrimmed)."""

        @classmethod
        def from_state(cls, state, meta_state=None, op="from_state"):
            if meta_state is not None:
                meta_state = (*meta_state[:3], "0")
            return super().from_state(state, meta_state, op)

    return LoadDropsLiveStart


def _ring_load_drops_undo():
    from kvspec.impl.rotating import RotatingKVCache

    class RingLoadDropsUndo(RotatingKVCache):
        """from_state forgets the undo depth (the sixth meta_state field)."""

        @classmethod
        def from_state(cls, state, meta_state):
            return super().from_state(state, tuple(meta_state)[:5])

    return RingLoadDropsUndo


def _int8_zero_scale():
    import mlx.core as mx

    from kvspec.impl.dense import KVCache

    class Int8ZeroScale(KVCache):
        """An all-zero row keeps scale 0 (not 1): it decodes to the same zeros."""

        def quantize_rows(self, x):
            q, scale = super().quantize_rows(x)
            absmax = mx.max(mx.abs(x.astype(mx.float16)), axis=-1, keepdims=True)
            return q, mx.where(absmax == 0, mx.zeros_like(scale), scale)

    return Int8ZeroScale


def _int8_zero_value_scale():
    import mlx.core as mx

    from kvspec.impl.dense import KVCache

    class Int8ZeroValueScale(KVCache):
        """The zero-row scale bug on the values only (keys stored right)."""

        @property
        def state(self):
            st = super().state
            if len(st) != 4:
                return st
            k, ks, v, vs = st
            return (k, ks, v, mx.where(mx.max(mx.abs(v), axis=-1, keepdims=True) == 0, mx.zeros_like(vs), vs))

        @state.setter
        def state(self, v):
            KVCache.state.fset(self, v)

    return Int8ZeroValueScale


def _load_reverses_rows():
    from kvspec.impl.dense import KVCache

    class LoadReversesRows(KVCache):
        """from_state copies the rows back to front: same shapes, same
        meta_state, other arrays once two rows differ."""

        @classmethod
        def from_state(cls, state, meta_state=None, op="from_state"):
            state = tuple(a[:, :, ::-1, :] for a in state)
            return super().from_state(state, meta_state, op)

    return LoadReversesRows


def _ring_state_oldest_first():
    import mlx.core as mx

    from kvspec.impl.rotating import RotatingKVCache

    class RingStateOldestFirst(RotatingKVCache):
        """state answers the valid rows rotated by the cursor (oldest first)
        instead of in slot order: the right shapes, other values once the
        ring wraps (and it loads back as itself, so the save/load fixpoint
        holds: only a comparison of the values with fetch sees it)."""

        @property
        def state(self):
            got = self.fetch()
            if got is None:
                return ()
            return tuple(mx.roll(a, -self.idx, axis=2) for a in got)

        @state.setter
        def state(self, v):
            RotatingKVCache.state.fset(self, v)

    return RingStateOldestFirst


@pytest.mark.parametrize("kind,mode,make,message", [
    ("dense", "fp16", _load_drops_live_start, "do not load back|a save/load round trip changes meta_state"),
    ("rotating", "fp16", _ring_load_drops_undo, "a save/load round trip changes meta_state"),
    ("dense", "int8", _int8_zero_scale, "stored Int8 key scales differ"),
    # every array of the stored form is compared, by value, not only its shape
    ("dense", "int8", _int8_zero_value_scale, "stored Int8 value scales differ"),
    ("dense", "fp16", _load_reverses_rows, "a save/load round trip changes the arrays"),
    ("rotating", "fp16", _ring_state_oldest_first, "state differs from the valid rows|a save/load round trip changes the arrays"),
])
def test_stored_form_checks_catch_their_bug(kind, mode, make, message):
    """Bounded by examples, not seconds (each bug is caught within 8 from
    seed 3); the check that fires is read from the failure as found: the
    shrunk trace names the same check, and shrinking is tested elsewhere."""
    from kvspec.fuzz.campaign import Campaign

    run = Campaign(kind, mode, True, 3, factories={kind: make()}, shrink=False)
    while run.report.examples < 100 and not run.failed:
        run.batch()
    rep = run.report
    assert rep.failure is not None, f"not caught in {rep.examples} examples"
    assert re.search(message, str(rep.failure.error)), str(rep.failure.error).splitlines()[0]


# -- the composite rules do what their docstrings promise ---------------------------
class _Recorder:
    """Stands in for a machine: records the ops a rule emits."""

    offset = 3

    def __init__(self):
        self.ops, self.n, self.drawn = [], 0, []

    def fresh_name(self, prefix):
        self.n += 1
        return f"{prefix}{self.n}"

    def do(self, op):
        self.ops.append(op)

    def draw(self, strategy, label=None):
        self.drawn.append(repr(strategy))
        return 1


def test_branch_holds_the_first_continuation_while_the_second_writes():
    from kvspec.fuzz.machine import KVMachine

    m = _Recorder()
    KVMachine.branch(m, 2)
    kinds = [op["op"] for op in m.ops]
    snap, restore = kinds.index("snapshot"), kinds.index("restore")
    name = m.ops[snap]["name"]
    assert m.ops[restore]["name"] == name and m.ops[-1] == {"op": "drop", "name": name}
    first = [i for i, k in enumerate(kinds) if k == "append"]
    assert len(first) == 2 and snap < first[0] < restore < first[1]
    # the first continuation's window is alive when the second one writes
    assert any(k == "hold" for k in kinds[first[0] + 1 : restore])
    assert "release_hold" not in kinds


def test_trim_through_handle_cuts_the_detached_handle_and_installs_it_back():
    from kvspec.fuzz.dense import DenseMachine

    m = _Recorder()
    DenseMachine.trim_through_handle(m, m)
    assert [op["op"] for op in m.ops] == ["detach", "handle_trim_to", "install"]
    assert len({op["name"] for op in m.ops}) == 1
    assert m.drawn == [f"integers(min_value=0, max_value={m.offset})"]  # every cut, from none to all rows
