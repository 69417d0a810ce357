"""Edges of the dense spec (spec/dense.py): exact refusal messages, the
state a refused op leaves, boundary values and the defaults of a kvtrace op."""

import re
from dataclasses import replace

import pytest

from kvspec.spec import dense as sd
from kvspec.spec.errors import InvalidArgumentError, StateError


def raises(exc, message):
    """``pytest.raises`` on the whole message: the message is the contract."""
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


def world_with(*sizes, step=8, mode="fp16"):
    w = sd.new_world(mode, step)
    for n in sizes:
        _, w = sd.w_append(w, n)
    return w


def test_the_largest_step_is_accepted_and_one_more_is_refused():
    assert sd.new_cache(step=sd.MAX_STEP).step == sd.MAX_STEP
    with raises(InvalidArgumentError, f"step: must be an integer in [1, {sd.MAX_STEP}], got {sd.MAX_STEP + 1}"):
        sd.new_cache(step=sd.MAX_STEP + 1)


def test_a_cache_emptied_by_a_front_trim_is_not_empty_and_refuses_an_install():
    """No buffer, but its offset moved on: ``install`` needs offset 0."""
    w = world_with(3)
    _, w = sd.w_detach(w, "h")
    w = replace(w, cache=sd.trim_front_keep_sink(sd.append(w.cache, (7, 8))[1], 2)[1])
    assert w.cache.buffer is None and w.cache.offset == 2
    assert not sd.is_empty(w.cache)
    with raises(StateError, "install: requires an empty cache, got offset=2, live_len=0"):
        sd.w_install(w, "h")


@pytest.mark.parametrize("op", [
    lambda w: sd.w_copy(w, "a", "original"),
    lambda w: sd.w_copy(w, "a", "copy"),
])
def test_copy_under_a_name_in_use_is_refused_and_names_the_op(op):
    _, w = sd.w_snapshot(world_with(2), "a")
    with raises(StateError, "copy: name 'a' is already in use"):
        op(w)


def test_copy_refuses_an_unknown_live_side():
    with raises(InvalidArgumentError, "copy: live must be 'copy' or 'original', got 'both'"):
        sd.w_copy(world_with(2), "a", "both")


def test_state_snapshot_under_a_name_in_use_is_refused_and_names_the_op():
    _, w = sd.w_snapshot(world_with(2), "a")
    with raises(StateError, "state_snapshot: name 'a' is already in use"):
        sd.w_state_snapshot(w, "a")


def test_a_state_snapshot_shares_the_buffer_identity_cut_to_the_live_rows():
    w = world_with(3)
    assert w.cache.capacity == 8
    _, w = sd.w_state_snapshot(w, "s")
    assert w.holders["s"].buffer == sd.Buffer(w.cache.buffer.ident, 3)
    assert sd.state_of(sd.new_cache()).buffer is None


ROW_MESSAGE = "append: {} must be the cached rows' (a cache holding rows keeps their shape and dtype)"
PAIR_MESSAGE = "append: keys and values must agree on {} (a K/V pair agrees with itself)"


@pytest.mark.parametrize("differs", sd.ROW_FIELDS)
@pytest.mark.parametrize("n", [1, 2])
def test_an_append_mismatch_of_every_field_and_size_is_refused_naming_the_field(differs, n):
    with raises(InvalidArgumentError, ROW_MESSAGE.format(differs)):
        sd.w_append_mismatch(world_with(2), n, differs)


def test_an_append_mismatch_checks_the_field_then_the_size():
    w = world_with(2)
    with raises(InvalidArgumentError, "append_mismatch: differs must be one of " + ", ".join(sd.ROW_FIELDS) + ", got 'rows'"):
        sd.w_append_mismatch(w, 0, "rows")
    with raises(InvalidArgumentError, "append: n must be >= 1, got 0"):
        sd.w_append_mismatch(w, 0, "dtype")


@pytest.mark.parametrize("differs", sd.PAIR_FIELDS)
@pytest.mark.parametrize("n", [1, 2])
def test_an_append_pair_mismatch_of_every_field_and_size_is_refused_naming_the_field(differs, n):
    with raises(InvalidArgumentError, PAIR_MESSAGE.format(differs)):
        sd.w_append_pair_mismatch(world_with(), n, differs)


def test_an_append_pair_mismatch_checks_the_field_then_the_size():
    w = world_with(2)
    with raises(InvalidArgumentError, "append_pair_mismatch: differs must be one of " + ", ".join(sd.PAIR_FIELDS) + ", got 'k_head_dim'"):
        sd.w_append_pair_mismatch(w, 0, "k_head_dim")
    with raises(InvalidArgumentError, "append: n must be >= 1, got 0"):
        sd.w_append_pair_mismatch(w, 0, "rows")


def test_a_reload_leaves_no_marker_and_refuses_an_unknown_route():
    w = world_with(3, 1)
    assert w.cache.marker is not None
    _, loaded = sd.w_reload(w, "state")
    assert loaded.cache.marker is None
    assert loaded.cache.window() == w.cache.window() and loaded.cache.capacity == 4
    with raises(InvalidArgumentError, "reload: via must be 'file' or 'state', got 'disk'"):
        sd.w_reload(w, "disk")


def test_apply_op_copy_keeps_the_original_live_by_default():
    w = world_with(3, 1)
    _, w = sd.apply_op(w, {"op": "copy", "name": "c"})
    assert w.cache.marker is not None and w.holders["c"].kind == "snapshot"
    result, _ = sd.apply_op(w, {"op": "append", "n": 1})
    assert result.inplace


def test_apply_op_copy_passes_the_live_side():
    _, w = sd.apply_op(world_with(3, 1), {"op": "copy", "name": "c", "live": "copy"})
    assert w.cache.marker is None


def test_apply_op_reload_goes_through_a_file_by_default_and_checks_the_route():
    _, w = sd.apply_op(world_with(3), {"op": "reload"})
    assert w.cache.marker is None and w.cache.window() == (0, 1, 2)
    with raises(InvalidArgumentError, "reload: via must be 'file' or 'state', got 'disk'"):
        sd.apply_op(world_with(3), {"op": "reload", "via": "disk"})


def test_apply_op_dispatches_both_mismatches_with_their_fields():
    w = world_with(2)
    with raises(InvalidArgumentError, ROW_MESSAGE.format("kv_heads")):
        sd.apply_op(w, {"op": "append_mismatch", "n": 1, "differs": "kv_heads"})
    with raises(InvalidArgumentError, PAIR_MESSAGE.format("batch")):
        sd.apply_op(w, {"op": "append_pair_mismatch", "n": 1, "differs": "batch"})


def test_apply_op_names_an_unknown_op():
    with raises(InvalidArgumentError, "fork: not an operation of a dense cache"):
        sd.apply_op(world_with(), {"op": "fork"})
