"""Edges of the Turbo spec (spec/turbo.py): Delegated's array names, the
world's defaults and head dims, the cold offset after ``trim_to``, and the
cold offset of a holder's view."""

import re

import pytest

from kvspec.spec import turbo as st
from kvspec.spec.dense import Mode
from kvspec.spec.errors import InvalidArgumentError


def raises(exc, message):
    """``pytest.raises`` on the whole message: the message is the contract."""
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


def run(world, *ops):
    for op in ops:
        _, world = st.apply_op(world, op)
    return world


def test_delegated_keeps_its_cold_v_arrays_its_hot_v_buffer_and_float_keys():
    assert st.array_names(Mode.TURBO4DELEGATED) == ("cold_norm", "cold_packed", "cold_rescale", "hot", "keys")


def test_a_new_world_grows_by_256_rows_and_never_writes_in_place():
    w = st.new_world("turbo4")
    assert w.dense.cache.step == 256
    assert w.dense.cache.inplace is False


def test_a_new_world_keeps_the_keys_head_dim_and_turbo4_refuses_it_unequal():
    w = st.new_world("turbo4", 8, head_dim=8, k_head_dim=4)
    assert (w.head_dim, w.k_head_dim) == (8, 4)
    with raises(InvalidArgumentError, "append: keys head_dim must equal values head_dim in mode turbo4, got 4 and 8"):
        st.apply_op(w, {"op": "append", "n": 1})


def test_without_a_keys_head_dim_the_keys_take_the_values_one():
    w = st.new_world("turbo4", 8, head_dim=8)
    assert w.k_head_dim is None
    _, w = st.apply_op(w, {"op": "append", "n": 2})
    assert w.dense.cache.window() == (0, 1)


def delegated_with_cold_rows():
    """5 rows, 4 of them cold (threshold 2, blocks of 2)."""
    w = run(st.new_world("turbo4delegated", 4, hot_threshold=2, fold_block=2),
            {"op": "append", "n": 3}, {"op": "append", "n": 1}, {"op": "append", "n": 1})
    assert (w.cold_offset, w.dense.cache.live_len) == (4, 5)
    return w


def test_trim_to_takes_the_hot_rows_first_then_cold_ones_as_trim_does():
    w = delegated_with_cold_rows()
    n, cut = st.apply_op(w, {"op": "trim_to", "len": 2})
    assert n == 3 and cut.cold_offset == 2
    assert run(w, {"op": "trim", "n": 3}).cold_offset == 2


def test_a_holder_s_cold_offset_is_read_by_its_whole_name_and_an_unknown_holder_has_none():
    w = run(delegated_with_cold_rows(), {"op": "snapshot", "name": "a:b"})
    assert st.view_cold(w, "holder:a:b") == 4
    assert st.view_cold(w, "holder:a") == 0
    assert st.view_cold(w, "holder:b") == 0
