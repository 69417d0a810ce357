"""kvspec.impl.layers' list-level operations against kvspec.spec.layers (semantics.md 6)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.impl.dense import KVCache
from kvspec.impl.layers import (
    can_trim_prompt_cache,
    restore_prompt_cache,
    snapshot_prompt_cache,
    trim_prompt_cache,
)
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec import layers
from kvspec.spec.errors import InvalidArgumentError, StateError
from kvspec.spec.layers import DenseLayer, RingLayer


def build(pattern):
    return [KVCache(p.mode, step=p.step) if isinstance(p, DenseLayer) else RotatingKVCache(p.max_size, p.keep, p.step)
            for p in pattern]


def tokens_rows(first, n):
    x = np.arange(first, first + n, dtype=np.float32)[None, None, :, None]
    return mx.array(np.broadcast_to(x, (2, 1, n, 3)).copy())


def window(c):
    got = c.fetch()
    return () if got is None else tuple(int(t) for t in np.array(got[0])[0, 0, :, 0])


OPS = st.one_of(
    st.builds(lambda n: {"op": "append", "n": n}, st.integers(1, 4)),
    st.builds(lambda n: {"op": "trim", "n": n}, st.integers(-1, 5)),
    st.builds(lambda n, k: {"op": "layer", "index": 0, "do": {"op": "trim_front", "n": n, "keep": k}},
              st.integers(0, 3), st.integers(0, 2)),
    st.builds(lambda s: {"op": "snapshot", "name": s}, st.sampled_from("ab")),
    st.builds(lambda s: {"op": "restore", "name": s}, st.sampled_from("ab")),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(OPS, max_size=20), st.integers(2, 5), st.integers(0, 1))
def test_impl_list_ops_follow_the_spec(ops, window_size, keep):
    pattern = (DenseLayer("fp16", 2), RingLayer(window_size, keep, 1), RingLayer(window_size + 2, 0, 2))
    world, caches, snaps = layers.new_world(pattern), build(pattern), {}
    for op in ops:
        try:
            result, new = layers.apply_op(world, op)
        except (StateError, InvalidArgumentError):
            continue
        if op["op"] == "append":
            for c in caches:
                c.update_and_fetch(tokens_rows(world.layers[0].next_token, op["n"]),
                                   tokens_rows(world.layers[0].next_token, op["n"]))
        elif op["op"] == "trim":
            assert can_trim_prompt_cache(caches) == layers.can_trim_prompt_cache(layers.caches_of(world))
            assert trim_prompt_cache(caches, op["n"]) == result
        elif op["op"] == "layer":
            caches[0].trim_front_keep_sink(op["do"]["n"], op["do"]["keep"])
        elif op["op"] == "snapshot":
            snaps[op["name"]] = snapshot_prompt_cache(caches)
        else:
            restore_prompt_cache(caches, snaps[op["name"]])
        world = new
        assert tuple(c.offset for c in caches) == tuple(c.offset for c in layers.caches_of(world))
        assert tuple(window(c) for c in caches) == layers.windows(world)


def test_restore_is_all_or_none():
    caches = build((DenseLayer(step=2), RingLayer(4, 0, 2)))
    for c in caches:
        c.update_and_fetch(tokens_rows(0, 3), tokens_rows(0, 3))
    good = snapshot_prompt_cache(caches)
    for c in caches:
        c.update_and_fetch(tokens_rows(3, 1), tokens_rows(3, 1))
    other = RotatingKVCache(5)
    other.update_and_fetch(tokens_rows(0, 1), tokens_rows(0, 1))
    with pytest.raises(InvalidArgumentError, match=r"\(max_size, keep\) must be \(4, 0\)"):
        restore_prompt_cache(caches, [good[0], other.snapshot()])
    assert [window(c) for c in caches] == [(0, 1, 2, 3), (0, 1, 2, 3)]  # the dense layer was put back
    with pytest.raises(InvalidArgumentError, match="one per layer"):
        restore_prompt_cache(caches, good[:1])
    restore_prompt_cache(caches, good)
    assert [window(c) for c in caches] == [(0, 1, 2), (0, 1, 2)]


def test_trim_after_a_front_trim_counts_live_rows():
    """Offset 6, 2 live rows in the dense layer, an unwrapped ring of 8: a
    count taken from the offset (3) would trim the ring and then fail on the
    dense layer, leaving the list disagreeing."""
    caches = build((DenseLayer(step=2), RingLayer(8, 0, 2)))
    for c in caches:
        c.update_and_fetch(tokens_rows(0, 6), tokens_rows(0, 6))
    caches[0].trim_front(4)
    assert trim_prompt_cache(caches, 3) == 2
    assert [c.offset for c in caches] == [4, 4] and window(caches[1]) == (0, 1, 2, 3)


def test_trim_over_a_wrapped_ring_changes_no_layer():
    caches = build((DenseLayer(step=2), RingLayer(4, 0, 2)))
    for t in range(6):
        for c in caches:
            c.update_and_fetch(tokens_rows(t, 1), tokens_rows(t, 1))
    assert not can_trim_prompt_cache(caches)
    assert trim_prompt_cache(caches, 2) == 0
    assert [c.offset for c in caches] == [6, 6] and window(caches[0]) == tuple(range(6))


def test_a_failure_past_the_checks_rolls_the_earlier_layers_back():
    """Every layer's check passes, then a later layer's restore itself fails
    (a copy out of memory, a layer class without a check of its own): the
    layers restored before it are put back, the error propagates. Our own
    layers never fail past their checks, so neither the fuzzer nor the
    other tests reach this rollback; a restore that dropped it passed."""

    class FailingRing(RotatingKVCache):
        def restore(self, snapshot):
            raise MemoryError("planted: the restore failed past its check")

    caches = [KVCache(step=2), FailingRing(4, step=2)]
    for c in caches:
        c.update_and_fetch(tokens_rows(0, 3), tokens_rows(0, 3))
    good = snapshot_prompt_cache(caches)
    for c in caches:
        c.update_and_fetch(tokens_rows(3, 1), tokens_rows(3, 1))
    with pytest.raises(MemoryError, match="planted"):
        restore_prompt_cache(caches, good)
    assert [window(c) for c in caches] == [(0, 1, 2, 3), (0, 1, 2, 3)]
    assert [c.offset for c in caches] == [4, 4]


@pytest.mark.parametrize("how", ["raises", "short", "partial"])
def test_a_layer_refusing_its_trim_late_changes_no_layer(how):
    """The last layer refuses its part of a list trim after the others
    trimmed (its trim raises, trims nothing, or trims for real and then
    raises, so the put-back must undo the refusing layer too): StateError, and every
    layer keeps its rows, offset and ownership (the next decode of the
    dense layer still goes in place) and the ring its undo log (a trim of
    one row after the wrap still rolls back exactly)."""

    class RefusingRing(RotatingKVCache):
        refuse = False

        def trim(self, n):
            if not self.refuse:
                return super().trim(n)
            if how == "partial":
                super().trim(n)
                raise StateError("planted: the ring trimmed, then refused")
            if how == "raises":
                raise StateError("planted: the ring refuses its trim")
            return 0

    caches = [KVCache(step=4), RefusingRing(2, step=1, undo=1)]
    for t in range(3):  # the ring wraps; its undo log holds the last decode
        for c in caches:
            c.update_and_fetch(tokens_rows(t, 1), tokens_rows(t, 1))
    before = [window(c) for c in caches]
    caches[1].refuse = True
    with pytest.raises(StateError, match="broke its promise" if how == "short" else "planted"):
        trim_prompt_cache(caches, 1)
    assert [window(c) for c in caches] == before and [c.offset for c in caches] == [3, 3]
    caches[1].refuse = False
    caches[0].update_and_fetch(tokens_rows(3, 1), tokens_rows(3, 1))
    assert caches[0].last_write_inplace
    caches[0].trim(1)
    assert trim_prompt_cache(caches, 1) == 1 and [c.offset for c in caches] == [2, 2]


def test_copy_prompt_cache_copies_every_layer():
    """A copy of the list (deep, and shallow per layer) holds new layer
    objects whose windows do not move when the original writes."""
    from kvspec.impl.layers import copy_prompt_cache

    caches = [KVCache(step=2), RotatingKVCache(3, step=1)]
    for c in caches:
        c.update_and_fetch(tokens_rows(0, 2), tokens_rows(0, 2))
    for deep in (True, False):
        dup = copy_prompt_cache(caches, deep)
        assert all(a is not b for a, b in zip(dup, caches))
        for c in caches:
            c.update_and_fetch(tokens_rows(2, 1), tokens_rows(2, 1))
        assert [window(c) for c in dup] == [(0, 1), (0, 1)]
        for c in caches:
            c.trim(1)
    with pytest.raises(InvalidArgumentError, match="deep must be"):
        copy_prompt_cache(caches, 1)


@pytest.mark.parametrize("position", [0, 1])
def test_the_list_reload_through_state_reloads_every_layer(position):
    """``reload`` with ``via: state`` in the layers machine sets every
    layer's ``state`` then ``meta_state``: a ring that keeps its undo log
    across that load (the rotating catalog's ``load_keeps_undo_log``) is
    caught first or last in the list. A harness loop that reloaded all but
    the last layer passed every test (the catalog's list bugs reload through
    a file)."""
    from kvspec.fuzz.bugs import by_name
    from kvspec.fuzz.replay import replay
    from kvspec.fuzz.trace import parse

    ring, dense = {"kind": "rotating", "max_size": 2, "undo": 1}, {"kind": "dense"}
    doc = {"kvtrace": 1, "cache": {"kind": "layers", "mode": "fp16", "step": 1, "head_dim": 8,
                                   "layers": [ring, dense] if position == 0 else [dense, ring]},
           "ops": [{"op": "append", "n": 1}] * 3 + [{"op": "reload", "via": "state"}, {"op": "trim", "n": 1}]}
    assert replay(parse(doc)).ok
    result = replay(parse(doc), factories={"layers": by_name("load_keeps_undo_log").factories})
    assert not result.ok and result.divergence.index == 3, result.divergence
