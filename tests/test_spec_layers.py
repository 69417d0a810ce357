"""kvspec.spec.layers: a prompt cache as a list of layers (semantics.md 6)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.spec import dense, layers, rotating
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError
from kvspec.spec.layers import DenseLayer, RingLayer

MIXED = (DenseLayer("fp16", 2), RingLayer(4, 1, 2), RingLayer(6, 0, 3), DenseLayer("int8", 1))


def run(world, *ops):
    out = None
    for op in ops:
        out, world = layers.apply_op(world, op)
    return out, world


def offsets(world):
    return tuple(c.offset for c in layers.caches_of(world))


def test_make_prompt_cache_follows_the_pattern():
    caches = layers.make_prompt_cache(MIXED)
    assert [type(c) for c in caches] == [dense.DenseCache, rotating.RotatingCache, rotating.RotatingCache,
                                         dense.DenseCache]
    assert (caches[1].max_size, caches[1].keep, caches[2].max_size) == (4, 1, 6)
    assert caches[3].mode == dense.Mode.INT8
    with pytest.raises(InvalidArgumentError, match="pattern must hold at least one layer"):
        layers.make_prompt_cache(())
    with pytest.raises(InvalidArgumentError, match="keep"):
        layers.make_prompt_cache((RingLayer(2, 2),))


def test_trim_is_atomic_across_a_wrapped_ring():
    """The issue's escape: [dense, wrapped ring] must trim nothing and say 0."""
    world = layers.new_world((DenseLayer(step=2), RingLayer(4, 0, 2)))
    _, world = run(world, *({"op": "append", "n": 1} for _ in range(6)))
    assert not layers.can_trim_prompt_cache(layers.caches_of(world))
    before = world
    count, world = layers.apply_op(world, {"op": "trim", "n": 2})
    assert count == 0 and world == before


def test_trim_counts_live_rows_after_a_front_trim():
    """A front trim leaves offset 6 but 2 live rows in the dense layer: the
    list trims 2 rows in every layer, not 3, and never fails half-way."""
    world = layers.new_world((DenseLayer(step=2), RingLayer(8, 0, 2)))
    _, world = run(world, {"op": "append", "n": 6}, {"op": "layer", "index": 0, "do": {"op": "trim_front", "n": 4}})
    assert layers.layer_trim_bounds(world.layers[0].cache) == (2, 2)
    count, world = layers.apply_op(world, {"op": "trim", "n": 3})
    assert count == 2 and offsets(world) == (4, 4)
    assert layers.windows(world) == ((), (0, 1, 2, 3))


def test_trim_refusals():
    world = layers.new_world(MIXED)
    _, world = run(world, {"op": "append", "n": 2})
    for bad in (1.5, "2", True, None):
        with pytest.raises(InvalidArgumentError, match="trim_prompt_cache: n must be an integer"):
            layers.apply_op(world, {"op": "trim", "n": bad})
    assert layers.apply_op(world, {"op": "trim", "n": -3})[0] == 0
    assert layers.apply_op(world, {"op": "trim", "n": 0})[0] == 0
    assert layers.list_trim_count(5, ()) == 0 and not layers.can_trim_prompt_cache(())


def test_list_snapshot_and_restore():
    world = layers.new_world(MIXED)
    _, world = run(world, {"op": "append", "n": 3}, {"op": "snapshot", "name": "s"},
                   *({"op": "append", "n": 1} for _ in range(5)))
    at_snapshot = layers.view_of(world, "s")
    assert at_snapshot == ((0, 1, 2),) * 4
    _, world = layers.apply_op(world, {"op": "restore", "name": "s"})
    assert layers.windows(world) == at_snapshot and offsets(world) == (3, 3, 3, 3)
    with pytest.raises(StateError, match="already in use"):
        layers.apply_op(world, {"op": "snapshot", "name": "s"})
    _, world = layers.apply_op(world, {"op": "drop", "name": "s"})
    with pytest.raises(StateError, match="no snapshot or handle named 's'"):
        layers.apply_op(world, {"op": "restore", "name": "s"})


def test_a_ring_with_an_undo_log_trims_within_its_depth_after_a_wrap():
    """Ring W=3 with an undo log of 2 rows: after the wrap the list trims
    up to 2 rows exactly in every layer, and refuses 3 in every layer."""
    world = layers.new_world((DenseLayer(step=1), RingLayer(3, 0, 1, undo=2)))
    _, world = run(world, *({"op": "append", "n": 1} for _ in range(5)))
    assert layers.layer_trim_bounds(world.layers[1].cache) == (5, 2)
    before = world
    count, world = layers.apply_op(world, {"op": "trim", "n": 3})
    assert count == 0 and world == before
    count, world = layers.apply_op(world, {"op": "trim", "n": 2})
    assert count == 2 and offsets(world) == (3, 3)
    assert layers.windows(world)[0] == (0, 1, 2) and sorted(layers.windows(world)[1]) == [0, 1, 2]


def test_restore_brings_back_a_trimmable_list_after_a_wrap():
    world = layers.new_world((DenseLayer(step=1), RingLayer(3, 1, 1)))
    _, world = run(world, {"op": "append", "n": 2}, {"op": "snapshot", "name": "s"},
                   *({"op": "append", "n": 1} for _ in range(4)))
    assert layers.apply_op(world, {"op": "trim", "n": 1})[0] == 0
    _, world = run(world, {"op": "restore", "name": "s"})
    count, world = layers.apply_op(world, {"op": "trim", "n": 1})
    assert count == 1 and layers.windows(world) == ((0,), (0,))


def test_layer_ops_are_restricted():
    world = layers.new_world(MIXED)
    _, world = run(world, {"op": "append", "n": 4})
    with pytest.raises(InvalidArgumentError, match=r"index must satisfy 0 <= index < 4, got 4"):
        layers.apply_op(world, {"op": "layer", "index": 4, "do": {"op": "fetch"}})
    with pytest.raises(InvalidArgumentError, match="op must be one of"):
        layers.apply_op(world, {"op": "layer", "index": 0, "do": {"op": "append", "n": 1}})
    with pytest.raises(UnsupportedOperationError, match="layer 1"):
        layers.apply_op(world, {"op": "layer", "index": 1, "do": {"op": "trim_front", "n": 1}})
    with pytest.raises(InvalidArgumentError, match="not an operation of a prompt cache"):
        layers.apply_op(world, {"op": "gather_positions", "positions": [0]})


OPS = st.one_of(
    st.builds(lambda n: {"op": "append", "n": n}, st.integers(1, 5)),
    st.builds(lambda n: {"op": "trim", "n": n}, st.integers(-1, 6)),
    st.builds(lambda n, k: {"op": "layer", "index": 0, "do": {"op": "trim_front", "n": n, "keep": k}},
              st.integers(0, 3), st.integers(0, 2)),
    st.builds(lambda s: {"op": "snapshot", "name": s}, st.sampled_from("ab")),
    st.builds(lambda s: {"op": "restore", "name": s}, st.sampled_from("ab")),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(OPS, max_size=25), st.integers(2, 6), st.integers(0, 1))
def test_layers_never_disagree_on_the_offset(ops, window, keep):
    """Whatever the op sequence, every layer holds the same offset, and a
    list trim either trims every layer by its count or changes nothing."""
    world = layers.new_world((DenseLayer(step=2), RingLayer(window, keep, 1), RingLayer(window + 2, 0, 2)))
    for op in ops:
        try:
            result, new = layers.apply_op(world, op)
        except (StateError, InvalidArgumentError):
            continue
        if op["op"] == "trim":
            assert all(o - result == n for o, n in zip(offsets(world), offsets(new)))
            assert result > 0 or new == world
        world = new
        assert len(set(offsets(world))) == 1
