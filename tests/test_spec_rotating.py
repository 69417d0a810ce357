"""Unit tests of the rotating spec (semantics.md section 3)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec import rotating as sr
from spec.errors import InvalidArgumentError, StateError


def decoded(cache, count, start=0):
    for t in range(start, start + count):
        _, cache = sr.append(cache, (t,))
    return cache


def test_warmup_then_wrap_physical_order():
    c = decoded(sr.new_cache(4, step=4), 4)
    assert c.window() == (0, 1, 2, 3) and c.idx == 4
    r, c = sr.append(c, (4,))
    assert r.window == (4, 1, 2, 3) and c.idx == 1 and not r.inplace


def test_warmup_writes_in_place_after_first():
    c = sr.new_cache(8, step=4)
    r, c = sr.append(c, (0,))
    assert not r.inplace  # the buffer was just grown
    r, c = sr.append(c, (1,))
    assert r.inplace


def test_sinks_are_never_overwritten():
    c = decoded(sr.new_cache(4, keep=2, step=1), 9)
    assert c.window()[:2] == (0, 1)
    assert set(c.window()[2:]) == {7, 8}


@given(st.integers(2, 16), st.integers(0, 3), st.integers(0, 60))
def test_decode_only_slots_match_ring_slot(W, K, count):
    K = min(K, W - 1)
    c = decoded(sr.new_cache(W, keep=K, step=3), count)
    visible = sr.visible_positions(count, W, K)
    assert sorted(p for p in c.positions()) == list(visible)
    for slot, entry in enumerate(c.slots[: c.valid_len]):
        assert sr.ring_slot(entry.position, W, K) == slot


def test_prefill_after_wrap_is_chronological_and_long():
    c = decoded(sr.new_cache(4, keep=1, step=1), 6)
    assert c.window() == (0, 4, 5, 3)
    r, c = sr.append(c, (6, 7))
    assert r.window == (0, 4, 5, 6, 7)
    assert r.positions == (0, 4, 5, 6, 7)


def test_wrapped_trim_fails_closed():
    c = decoded(sr.new_cache(3, step=1), 4)
    assert not sr.is_trimmable(c)
    assert sr.trim(c, 1) == (0, c)
    with pytest.raises(StateError, match="cannot trim a wrapped"):
        sr.trim_to(c, 2)
    assert sr.trim_to(c, 4) == (0, c)


def test_unwrapped_trim_is_exact():
    c = decoded(sr.new_cache(6, step=2), 4)
    n, c = sr.trim(c, 2)
    assert n == 2 and c.window() == (0, 1) and c.capacity == 4
    r, c = sr.append(c, (9,))
    assert r.window == (0, 1, 9) and not r.inplace


def test_mask_visible_counts():
    for q in range(12):
        assert sum(sr.mask_visible(q, p, 4, 0) for p in range(12)) == min(q + 1, 4)
        assert sum(sr.mask_visible(q, p, 4, 1) for p in range(12)) == min(q + 1, 4)
    assert sr.mask_visible(10, 0, 4, 1)  # a sink stays visible
    assert not sr.mask_visible(10, 6, 4, 0) and sr.mask_visible(10, 7, 4, 0)


def test_new_cache_refusals():
    with pytest.raises(InvalidArgumentError, match="keep"):
        sr.new_cache(4, keep=4)
    with pytest.raises(InvalidArgumentError, match="max_size"):
        sr.new_cache(0)


def test_chronological_order():
    assert sr.chronological_order(5, 3, 1, True) == (0, 3, 4, 1, 2)
    assert sr.chronological_order(5, 3, 1, False) == (0, 1, 2)


def test_restore_shares_the_snapshot_buffer_and_empty_ring_has_none():
    """Restore adopts the snapshot's very buffer (same identity: a write in
    place would reach the snapshot, so the marker is cleared); trimming to
    offset 0 drops the buffer."""
    w = sr.RotatingWorld(sr.new_cache(4, step=2))
    _, w = sr.w_append(w, 3)
    _, w = sr.w_snapshot(w, "s")
    _, w = sr.w_append(w, 2)  # a multi-row append: new buffer
    assert w.cache.ident != w.holders["s"].cache.ident
    _, w = sr.w_restore(w, "s")
    assert w.cache.ident == w.holders["s"].cache.ident and w.cache.marker is None
    n, c = sr.trim(w.cache, 3)
    assert n == 3 and (c.slots, c.ident, c.marker, c.offset, c.idx) == ((), None, None, 0, 0)


def test_inplace_rule_is_false_on_a_full_unwrapped_ring():
    """Called on its own (not only from decode, after the wrap): a full ring
    whose marker still names the buffer is not a warm-up state."""
    c = decoded(sr.new_cache(3, step=1), 3)
    assert (c.offset, c.idx, c.marker.idx) == (3, 3, 3) and c.marker.buffer == c.ident
    assert sr.rotating_inplace_allowed(c) is False
