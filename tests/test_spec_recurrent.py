"""spec/recurrent.py: the recurrent kind's rules (semantics.md 9), its
refusals (nothing changes) and its bad arguments; the checkpoint ring's
closed form against a ring simulated slot by slot; recurrent layers in the
list-level trim (spec/layers.py)."""

from __future__ import annotations

import itertools

import pytest

from kvspec.spec import layers as sl
from kvspec.spec import recurrent as sr
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError


def _after(cache: sr.RecurrentCache, *chunks: int, recorded: bool = True) -> sr.RecurrentCache:
    for n in chunks:
        cache = sr.step(cache, tuple(range(cache.offset, cache.offset + n)), recorded)
    return cache


def test_empty_and_its_bad_arguments():
    c = sr.empty(2, 4, 3)
    assert (c.size, c.kernel, c.depth, c.offset, c.coverage) == (2, 4, 3, 0, 0)
    assert sr.conv_window(c) == (None, None, None) and sr.state_of(c) == ()
    assert sr.state_of(sr.empty(1, 2, 0)) is None and sr.conv_window(sr.empty(1, 2, 0)) == (None,)
    for kwargs, word in [({"size": 3}, "size must be 1"), ({"size": True}, "size must be 1"),
                         ({"kernel": 1}, "kernel must be an integer >= 2"),
                         ({"kernel": 2.0}, "kernel must be an integer >= 2"),
                         ({"depth": -1}, "depth must be an integer >= 0"),
                         ({"depth": True}, "depth must be an integer >= 0")]:
        with pytest.raises(InvalidArgumentError, match=word):
            sr.empty(**kwargs)


def test_conv_window_and_state_are_functions_of_the_consumed_tokens_whatever_the_chunking():
    whole = _after(sr.empty(2, 4, 0), 7)
    for chunks in [(1,) * 7, (3, 4), (2, 2, 3), (6, 1)]:
        c = _after(sr.empty(2, 4, 0), *chunks)
        assert c.toks == whole.toks == tuple(range(7))
        assert sr.conv_window(c) == (4, 5, 6) and sr.state_of(c) == tuple(range(7))
    assert sr.conv_window(_after(sr.empty(2, 4, 0), 2)) == (None, 0, 1)


def test_coverage_of_recorded_and_unrecorded_steps():
    c = sr.empty(2, 3, 3)
    covs = []
    for n in (1, 1, 5, 2):
        c = _after(c, n)
        covs.append(c.coverage)
    assert covs == [1, 2, 3, 3]  # min(U, c + n)
    assert _after(c, 2, recorded=False).coverage == 0  # an unrecorded step clears it
    assert _after(sr.empty(2, 3, 0), 4).coverage == 0  # depth 0: no checkpoints
    assert _after(sr.empty(2, 3, 8), 5).coverage == 5  # never past the offset


def test_step_refuses_bad_tokens_and_changes_nothing():
    c = _after(sr.empty(2, 4, 2), 3)
    for bad in [(), [1, 2], (1, "a"), (True,), None]:
        with pytest.raises(InvalidArgumentError, match="step: "):
            sr.step(c, bad)  # type: ignore[arg-type]
    assert c == _after(sr.empty(2, 4, 2), 3)


def test_trim_within_the_coverage_restores_conv_window_and_state_exactly():
    c = _after(sr.empty(2, 4, 3), 5, 1, 1)  # offset 7, coverage 3
    for n in range(4):
        count, t = sr.trim(c, n)
        want = _after(sr.empty(2, 4, 3), 7 - n) if n else c
        assert count == n
        assert sr.conv_window(t) == sr.conv_window(want) and sr.state_of(t) == sr.state_of(want)
        assert t.offset == 7 - n and t.coverage == 3 - n
    assert sr.trim(c, -2) == (0, c)


def test_trim_beyond_the_coverage_is_refused_and_changes_nothing():
    c = _after(sr.empty(2, 4, 3), 5, 1)  # coverage 3 (min(U, ...)), offset 6
    before = c
    with pytest.raises(StateError, match=r"coverage of 3 tokens .*offset=6, depth=3.*got n=4; nothing changed"):
        sr.trim(c, 4)
    assert c == before
    cleared = _after(c, 1, recorded=False)
    with pytest.raises(StateError, match="coverage of 0"):
        sr.trim(cleared, 1)
    for bad in [1.0, "1", True, None]:
        with pytest.raises(InvalidArgumentError, match="trim: n must be an integer"):
            sr.trim(c, bad)  # type: ignore[arg-type]


def test_is_trimmable_is_the_capability_trimmable_rows_the_coverage():
    assert not sr.is_trimmable(_after(sr.empty(2, 4, 0), 3))
    fresh = sr.empty(2, 4, 2)
    assert sr.is_trimmable(fresh) and sr.trimmable_rows(fresh) == 0
    assert sr.trimmable_rows(_after(fresh, 1)) == 1


def test_snapshot_restore_state_restore_copy_reload():
    c = _after(sr.empty(2, 4, 3), 4)
    r = sr.restore(_after(c, 2, recorded=False), c)
    assert r == c and r.coverage == 3  # the snapshot's checkpoints come back
    s = sr.state_restore(_after(c, 2), c)
    assert s.toks == c.toks and s.coverage == 0  # a saved state carries no history
    assert sr.copy(c) == c and sr.copy(c) is not c
    loaded = sr.reload(c)
    assert loaded.toks == c.toks and (loaded.size, loaded.kernel, loaded.depth) == (2, 4, 3) and loaded.coverage == 0


def _world_ops():
    return [{"op": "append", "n": 3}, {"op": "snapshot", "name": "a"}, {"op": "append", "n": 2},
            {"op": "state_snapshot", "name": "s"}, {"op": "trim", "n": 2}, {"op": "restore", "name": "a"}]


def test_world_ops_and_their_refusals():
    w = sr.RecurrentWorld(sr.empty(2, 3, 2))
    for op in _world_ops():
        _, w = sr.apply_op(w, op)
    assert w.cache.toks == (0, 1, 2) and w.cache.coverage == 2
    assert sr.apply_op(w, {"op": "fetch"})[0] == ((1, 2), (0, 1, 2))
    assert sr.apply_op(w, {"op": "can_trim"})[0] is True
    _, u = sr.apply_op(w, {"op": "append_unrecorded", "n": 1})
    assert u.cache.coverage == 0 and u.cache.toks == (0, 1, 2, 5)  # fresh identities after a rollback
    _, s = sr.apply_op(w, {"op": "state_restore", "name": "s"})
    assert s.cache.toks == (0, 1, 2, 3, 4) and s.cache.coverage == 0
    refusals = [({"op": "restore", "name": "s"}, StateError, "is a state snapshot"),
                ({"op": "state_restore", "name": "a"}, StateError, "is a snapshot"),
                ({"op": "restore", "name": "zz"}, StateError, "no snapshot"),
                ({"op": "snapshot", "name": "a"}, StateError, "already in use"),
                ({"op": "copy", "name": "c", "live": "both"}, InvalidArgumentError, "live must be"),
                ({"op": "reload", "via": "disk"}, InvalidArgumentError, "via must be"),
                ({"op": "append", "n": 0}, InvalidArgumentError, "n must be an integer >= 1"),
                ({"op": "trim", "n": 3}, StateError, "coverage of 2"),
                ({"op": "trim_front", "n": 1}, UnsupportedOperationError, "not an operation of the recurrent"),
                ({"op": "drop", "name": "zz"}, StateError, "no snapshot")]
    for op, err, word in refusals:
        with pytest.raises(err, match=word):
            sr.apply_op(w, op)
    _, c = sr.apply_op(w, {"op": "copy", "name": "c", "live": "copy"})
    assert c.cache == w.cache and sr.view_of(c, "c") == w.cache.toks
    _, r = sr.apply_op(w, {"op": "reload", "via": "state"})
    assert r.cache.coverage == 0 and r.cache.toks == w.cache.toks


def test_slot_and_live_offsets():
    assert [sr.slot(x, 2) for x in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert sr.live_offsets(7, 3) == (4, 5, 6, 7)
    with pytest.raises(UnsupportedOperationError, match="depth 0"):
        sr.ring(sr.empty(2, 4, 0))


def _simulate(ops: list[tuple[str, int]], depth: int) -> tuple[list[object], sr.RecurrentCache]:
    """A ring of depth + 1 slots written as the implementation's recorder
    writes it: each recorded token puts the checkpoint of its new offset into
    slot offset % (depth + 1); a clear seeds the current offset's slot; a
    rollback reads the slot of the new offset. Returns the slots (each the
    token prefix of its checkpoint) and the spec cache after the same ops."""
    slots: list[object] = [None] * (depth + 1)
    toks: tuple[int, ...] = ()
    slots[0] = toks
    cache = sr.empty(2, 3, depth)
    for op, n in ops:
        if op == "rec":
            for _ in range(n):
                toks += (len(toks),)
                slots[len(toks) % (depth + 1)] = toks
            cache = sr.step(cache, tuple(range(cache.offset, cache.offset + n)))
        elif op == "unrec":
            toks += tuple(range(len(toks), len(toks) + n))
            slots[len(toks) % (depth + 1)] = toks
            cache = sr.step(cache, tuple(range(cache.offset, cache.offset + n)), recorded=False)
        else:
            try:
                count, cache = sr.trim(cache, n)
            except StateError:
                continue
            if count:
                restored = slots[(len(toks) - n) % (depth + 1)]
                assert restored == toks[: len(toks) - n], "the slot of offset - n was overwritten"
                toks = restored  # type: ignore[assignment]
    return slots, cache


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_ring_closed_form_matches_a_ring_written_slot_by_slot(depth):
    moves = [("rec", 1), ("rec", 2), ("rec", 4), ("unrec", 1), ("trim", 1), ("trim", 2), ("trim", 3)]
    for ops in itertools.product(moves, repeat=4):
        slots, cache = _simulate(list(ops), depth)
        assert cache.coverage <= min(depth, cache.offset)
        for x, held in zip(sr.ring(cache), slots):
            if x is not None:
                assert held == cache.toks[:x], (ops, sr.ring(cache), slots)


def test_mixed_list_trim_is_all_or_none():
    pattern = (sl.DenseLayer(), sl.RingLayer(4, undo=2), sl.RecurrentLayer(2, 4, 3))
    w = sl.new_world(pattern)
    for n in (6, 1, 1):
        _, w = sl.apply_op(w, {"op": "append", "n": n})
    bounds = tuple(sl.layer_trim_bounds(c) for c in sl.caches_of(w))
    assert bounds == ((8, 8), (8, 1), (8, 3))
    assert sl.apply_op(w, {"op": "can_trim"})[0] is True
    count, t = sl.apply_op(w, {"op": "trim", "n": 1})
    assert count == 1 and {c.offset for c in sl.caches_of(t)} == {7} and sl.caches_of(t)[2].coverage == 2
    # the ring covers 1 (wrapped after a block, one decode logged): the list refuses 3, nothing changes
    before = sl.caches_of(w)
    count, t = sl.apply_op(w, {"op": "trim", "n": 3})
    assert count == 0 and sl.caches_of(t) == before
    # a recurrent layer's coverage alone bounds the list
    w2 = sl.new_world((sl.DenseLayer(), sl.RecurrentLayer(1, 2, 2)))
    _, w2 = sl.apply_op(w2, {"op": "append", "n": 5})
    assert sl.apply_op(w2, {"op": "trim", "n": 3})[0] == 0
    count, t2 = sl.apply_op(w2, {"op": "trim", "n": 2})
    assert count == 2 and [c.offset for c in sl.caches_of(t2)] == [3, 3]
    assert not sl.can_trim_prompt_cache(sl.make_prompt_cache((sl.DenseLayer(), sl.RecurrentLayer(depth=0))))
    with pytest.raises(UnsupportedOperationError, match="recurrent cache"):
        sl.apply_op(w2, {"op": "layer", "index": 1, "do": {"op": "trim_front", "n": 1}})
    with pytest.raises(InvalidArgumentError, match="RecurrentLayer"):
        sl.make_prompt_cache(("recurrent",))  # type: ignore[arg-type]


def test_mixed_list_snapshot_restore_and_interchangeability():
    w = sl.new_world((sl.RecurrentLayer(2, 4, 2), sl.RecurrentLayer(2, 4, 2), sl.RecurrentLayer(1, 3, 2),
                      sl.DenseLayer()))
    _, w = sl.apply_op(w, {"op": "append", "n": 2})
    _, w = sl.apply_op(w, {"op": "snapshot", "name": "a"})
    _, w2 = sl.apply_op(w, {"op": "append", "n": 3})
    _, w2 = sl.apply_op(w2, {"op": "restore", "name": "a"})
    assert sl.caches_of(w2)[:3] == sl.caches_of(w)[:3] and sl.windows(w2) == sl.view_of(w2, "a") == sl.windows(w)
    a, b, c, d = w.layers
    assert sl.layers_interchangeable(a, b) and not sl.layers_interchangeable(a, c)
    assert not sl.layers_interchangeable(a, d) and not sl.layers_interchangeable(d, a)
    with pytest.raises(InvalidArgumentError, match="layer 0 refuses the snapshot of layer 2"):
        sl.apply_op(w, {"op": "restore_mixed", "name": "a", "layer": 0, "source": 2})
    assert not sl.holds_buffer(w)
    _, r = sl.apply_op(w, {"op": "reload", "via": "file"})
    assert [x.coverage for x in sl.caches_of(r)[:3]] == [0, 0, 0]
