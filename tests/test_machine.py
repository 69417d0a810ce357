"""The differential state machines, short and deterministic (CI profile)."""

import re

import pytest
from hypothesis import settings

from fuzz.campaign import machine_for

CONFIGS = [("dense", "fp16", True), ("dense", "fp16", False), ("dense", "int8", True), ("rotating", "fp16", True),
           ("rotating", "fp16", False)]


@pytest.mark.parametrize("kind,mode,inplace", CONFIGS)
def test_state_machine_agrees(kind, mode, inplace):
    machine = machine_for(kind, mode, inplace)
    # the loaded profile (ci, or mutation under `make mutation`), longer runs
    machine.TestCase.settings = settings(settings.default, max_examples=40, stateful_step_count=30)
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
    from impl.dense import KVCache

    class LoadDropsLiveStart(KVCache):
        """from_state ignores live_start (a front-trimmed cache loads as if untrimmed)."""

        @classmethod
        def from_state(cls, state, meta_state=None, op="from_state"):
            if meta_state is not None:
                meta_state = (*meta_state[:3], "0")
            return super().from_state(state, meta_state, op)

    return LoadDropsLiveStart


def _ring_load_drops_undo():
    from impl.rotating import RotatingKVCache

    class RingLoadDropsUndo(RotatingKVCache):
        """from_state forgets the undo depth (the sixth meta_state field)."""

        @classmethod
        def from_state(cls, state, meta_state):
            return super().from_state(state, tuple(meta_state)[:5])

    return RingLoadDropsUndo


def _int8_zero_scale():
    import mlx.core as mx

    from impl.dense import KVCache

    class Int8ZeroScale(KVCache):
        """An all-zero row keeps scale 0 (not 1): it decodes to the same zeros."""

        def quantize_rows(self, x):
            q, scale = super().quantize_rows(x)
            absmax = mx.max(mx.abs(x.astype(mx.float16)), axis=-1, keepdims=True)
            return q, mx.where(absmax == 0, mx.zeros_like(scale), scale)

    return Int8ZeroScale


@pytest.mark.parametrize("kind,mode,make,message", [
    ("dense", "fp16", _load_drops_live_start, "do not load back|a save/load round trip changes meta_state"),
    ("rotating", "fp16", _ring_load_drops_undo, "a save/load round trip changes meta_state"),
    ("dense", "int8", _int8_zero_scale, "stored Int8 key scales differ"),
])
def test_stored_form_checks_catch_their_bug(kind, mode, make, message):
    from fuzz.campaign import campaign

    rep = campaign(kind, mode, True, budget=30.0, seed=3, factories={kind: make()})
    assert rep.failure is not None, f"not caught in {rep.examples} examples"
    assert re.search(message, str(rep.failure.error)), str(rep.failure.error).splitlines()[0]
