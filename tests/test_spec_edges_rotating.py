"""Edges of the rotating spec (spec/rotating.py): the undo log's records,
the marker after each kind of write and rollback, refusal messages and the
defaults of a kvtrace op."""

import re

import pytest

from kvspec.spec import dense as sd
from kvspec.spec import rotating as sr
from kvspec.spec.dense import Entry
from kvspec.spec.errors import InvalidArgumentError, StateError
from kvspec.spec.rotating import UndoRecord


def raises(exc, message):
    """``pytest.raises`` on the whole message: the message is the contract."""
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


def decoded(cache, count, start=0):
    for t in range(start, start + count):
        _, cache = sr.append(cache, (t,))
    return cache


def full_ring():
    """A ring of 4 slots, 1 sink, undo depth 3, holding rows 0..3 (unwrapped, full)."""
    return decoded(sr.new_cache(4, keep=1, step=4, undo=3), 4)


def test_the_slot_of_the_first_position_past_the_window_is_the_first_after_the_sinks():
    assert sr.ring_slot(3, 4, 1) == 3
    assert sr.ring_slot(4, 4, 1) == 1
    assert sr.ring_slot(4, 4, 0) == 0


def test_the_largest_step_is_accepted_and_one_more_is_refused():
    assert sr.new_cache(4, step=sd.MAX_STEP).step == sd.MAX_STEP
    with raises(InvalidArgumentError, f"step: must be in [1, {sd.MAX_STEP}], got {sd.MAX_STEP + 1}"):
        sr.new_cache(4, step=sd.MAX_STEP + 1)


def test_a_decode_logs_the_counters_before_it_and_the_row_it_overwrites():
    _, c = sr.append(full_ring(), (4,))
    assert c.log[-1] == UndoRecord("decode", 1, 4, 4, 4, 1, (Entry(1, 1),), True)


def test_a_decode_onto_an_oversized_buffer_logs_a_record_that_is_not_whole():
    _, c = sr.append(sr.new_cache(4, keep=1, step=2, undo=3), tuple(range(6)))
    assert c.capacity == 6
    _, d = sr.append(c, (6,))
    assert d.log == (UndoRecord("decode", 1, 6, 6, 6, 1, (), False),)


def test_a_multi_row_append_logs_the_counters_before_it_and_the_row_it_drops():
    _, c = sr.append(full_ring(), (4, 5))
    assert c.window() == (0, 2, 3, 4, 5)
    assert c.log[-1] == UndoRecord("prefill", 2, 4, 4, 4, -1, (Entry(1, 1),), True)


def test_a_multi_row_append_onto_an_oversized_buffer_logs_a_record_that_is_not_whole():
    _, c = sr.append(sr.new_cache(4, keep=1, step=2, undo=3), tuple(range(6)))
    _, p = sr.append(c, (6, 7))
    assert p.log == (UndoRecord("prefill", 2, 6, 6, 6, -1, (), False),)


def test_a_counter_trim_of_exactly_the_last_append_removes_its_record():
    c = decoded(sr.new_cache(8, undo=4), 3)
    _, c = sr.append(c, (3, 4, 5))
    before = c.log
    assert [r.rows for r in before] == [1, 3]  # depth 4 keeps the latest records only
    _, t = sr.trim(c, 3)
    assert t.log == before[:-1]


def test_a_counter_trim_of_part_of_a_multi_row_append_keeps_its_other_rows():
    c = decoded(sr.new_cache(8, undo=4), 3)
    _, c = sr.append(c, (3, 4, 5))
    _, t = sr.trim(c, 2)
    assert t.log == c.log[:-1] + (UndoRecord("prefill", 1, 3, 3, 8, -1, (), True),)


def test_rolling_back_a_whole_multi_row_append_leaves_no_marker():
    _, p = sr.append(full_ring(), (4, 5))
    n, t = sr.trim(p, 2)
    assert n == 2 and t.window() == (0, 1, 2, 3)
    assert t.marker is None


def test_rolling_back_part_of_a_multi_row_append_leaves_no_marker():
    _, p = sr.append(full_ring(), (4, 5, 6))
    n, t = sr.trim(p, 1)
    assert n == 1 and t.window() == p.window()[:-1]
    assert t.marker is None
    assert t.log[-1].rows == 2


def test_copy_refuses_an_unknown_live_side_and_a_name_in_use():
    w = sr.RotatingWorld(full_ring())
    with raises(InvalidArgumentError, "copy: live must be 'copy' or 'original', got 'both'"):
        sr.w_copy(w, "a", "both")
    _, w = sr.w_snapshot(w, "a")
    with raises(StateError, "copy: name 'a' is already in use"):
        sr.w_copy(w, "a", "copy")
    with raises(StateError, "state_snapshot: name 'a' is already in use"):
        sr.w_state_snapshot(w, "a")


def test_a_reload_of_a_ring_trimmed_to_nothing_holds_no_buffer():
    _, c = sr.trim(decoded(sr.new_cache(4, step=4), 2), 2)
    assert c.ident is not None and c.slots
    _, w = sr.w_reload(sr.RotatingWorld(c), "file")
    assert w.cache.slots == () and w.cache.ident is None and w.cache.next_ident == c.next_ident


def test_a_reload_leaves_no_marker_and_no_log_and_refuses_an_unknown_route():
    w = sr.RotatingWorld(full_ring())
    _, loaded = sr.w_reload(w, "state")
    assert loaded.cache.marker is None and loaded.cache.log == ()
    assert loaded.cache.window() == (0, 1, 2, 3) and loaded.cache.ident == w.cache.next_ident
    with raises(InvalidArgumentError, "reload: via must be 'file' or 'state', got 'disk'"):
        sr.w_reload(w, "disk")


def test_apply_op_copy_keeps_the_original_live_by_default():
    w = sr.RotatingWorld(decoded(sr.new_cache(8, step=8), 2))
    _, w = sr.apply_op(w, {"op": "copy", "name": "c"})
    assert w.cache.marker is not None
    r, _ = sr.apply_op(w, {"op": "append", "n": 1})
    assert r.inplace


def test_apply_op_reload_goes_through_a_file_by_default_and_checks_the_route():
    w = sr.RotatingWorld(full_ring())
    _, loaded = sr.apply_op(w, {"op": "reload"})
    assert loaded.cache.marker is None and loaded.cache.window() == (0, 1, 2, 3)
    with raises(InvalidArgumentError, "reload: via must be 'file' or 'state', got 'disk'"):
        sr.apply_op(w, {"op": "reload", "via": "disk"})


def test_apply_op_dispatches_both_mismatches_with_their_fields():
    w = sr.RotatingWorld(full_ring())
    with raises(InvalidArgumentError, "append: v_head_dim must be the cached rows' (a cache holding rows keeps their shape and dtype)"):
        sr.apply_op(w, {"op": "append_mismatch", "n": 1, "differs": "v_head_dim"})
    with raises(InvalidArgumentError, "append: keys and values must agree on rows (a K/V pair agrees with itself)"):
        sr.apply_op(w, {"op": "append_pair_mismatch", "n": 2, "differs": "rows"})
