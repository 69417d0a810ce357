"""Edges of the prompt-cache spec (spec/layers.py): exact refusal messages
of the list-level ops, the in-place switch reaching every layer, and the
defaults of a kvtrace op."""

import re

import pytest

from kvspec.spec import layers as sl
from kvspec.spec.errors import InvalidArgumentError, StateError
from kvspec.spec.layers import DenseLayer, RingLayer


def raises(exc, message):
    """``pytest.raises`` on the whole message: the message is the contract."""
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


MIXED = (DenseLayer(step=4), RingLayer(4, step=4))


def world_with(pattern=MIXED, rows=2):
    w = sl.new_world(pattern)
    if rows:
        _, w = sl.w_append(w, rows)
    return w


def test_every_layer_writes_in_place_unless_the_switch_is_off():
    assert all(c.inplace for c in sl.make_prompt_cache(MIXED))
    assert all(w.cache.inplace for w in sl.new_world(MIXED).layers)
    assert sl.make_layer(DenseLayer()).inplace and sl.make_layer(RingLayer(4)).inplace
    assert not any(c.inplace for c in sl.make_prompt_cache(MIXED, inplace=False))
    assert not sl.make_layer(RingLayer(4), inplace=False).inplace


def test_a_pattern_of_no_layer_and_a_layer_of_no_kind_are_refused():
    with raises(InvalidArgumentError, "make_prompt_cache: pattern must hold at least one layer, got 0"):
        sl.make_prompt_cache(())
    with raises(InvalidArgumentError,
                "make_prompt_cache: a layer must be a DenseLayer, a RingLayer or a RecurrentLayer, got 'ring'"):
        sl.make_prompt_cache(("ring",))


def test_a_list_append_of_no_rows_is_refused():
    with raises(InvalidArgumentError, "append: n must be >= 1, got 0"):
        sl.w_append(world_with(), 0)


def test_restore_mixed_names_an_unknown_snapshot_as_a_restore():
    with raises(StateError, "restore: no snapshot or handle named 's'"):
        sl.w_restore_mixed(world_with(), "s", 1, 0)


@pytest.mark.parametrize("layer,source,field,value", [
    (2, 0, "layer", "2"), (-1, 0, "layer", "-1"), (True, 0, "layer", "True"), ("1", 0, "layer", "'1'"),
    (1, 2, "source", "2"), (1, -1, "source", "-1"), (1, False, "source", "False"), (1, 0.0, "source", "0.0"),
])
def test_restore_mixed_refuses_a_layer_index_out_of_range_naming_the_field(layer, source, field, value):
    _, w = sl.w_snapshot(world_with(), "s")
    with raises(InvalidArgumentError, f"restore_mixed: {field} must satisfy 0 <= {field} < 2, got {value}"):
        sl.w_restore_mixed(w, "s", layer, source)


def test_restore_mixed_takes_the_first_and_the_last_layer():
    _, w = sl.w_snapshot(world_with(), "s")
    message = "restore: layer {} refuses the snapshot of layer {} (another kind or window); nothing changed in any layer"
    with raises(InvalidArgumentError, message.format(0, 1)):
        sl.w_restore_mixed(w, "s", 0, 1)
    with raises(InvalidArgumentError, message.format(1, 0)):
        sl.apply_op(w, {"op": "restore_mixed", "name": "s", "layer": 1, "source": 0})


def test_restore_mixed_refuses_layers_that_take_each_other_s_snapshots():
    _, w = sl.w_snapshot(world_with((DenseLayer(), DenseLayer())), "s")
    with raises(InvalidArgumentError, "restore_mixed: layers 0 and 1 take each other's snapshots; "
                                      "pick layers of another kind or window"):
        sl.w_restore_mixed(w, "s", 0, 1)


def test_copy_refuses_an_unknown_live_side_and_a_name_in_use():
    w = world_with()
    with raises(InvalidArgumentError, "copy: live must be 'copy' or 'original', got 'both'"):
        sl.w_copy(w, "a", "both")
    _, w = sl.w_snapshot(w, "a")
    with raises(StateError, "copy: name 'a' is already in use"):
        sl.w_copy(w, "a", "copy")


@pytest.mark.parametrize("n,value", [(True, "True"), (1.0, "1.0"), ("1", "'1'")])
def test_a_late_refused_trim_refuses_a_count_that_is_no_integer(n, value):
    with raises(InvalidArgumentError, f"trim_prompt_cache: n must be an integer, got {value}"):
        sl.w_trim_refused_late(world_with(), n, 0, "raises")


@pytest.mark.parametrize("layer,value", [(2, "2"), (-1, "-1"), (True, "True"), ("0", "'0'")])
def test_a_late_refused_trim_refuses_a_layer_out_of_range(layer, value):
    with raises(InvalidArgumentError, f"trim_refused_late: layer must satisfy 0 <= layer < 2, got {value}"):
        sl.w_trim_refused_late(world_with(), 1, layer, "raises")


def test_a_late_refused_trim_refuses_an_unknown_way_of_refusing():
    with raises(InvalidArgumentError, "trim_refused_late: how must be one of raises, short, partial, fewer, more, "
                                      "got 'quietly'"):
        sl.w_trim_refused_late(world_with(), 1, 0, "quietly")


@pytest.mark.parametrize("layer", [0, 1])
def test_a_late_refused_trim_of_the_first_or_last_layer_names_it_and_the_count(layer):
    message = (f"trim_prompt_cache: layer {layer} refused its trim of 2 rows after the layers before "
               "it trimmed; nothing was trimmed in any layer")
    with raises(StateError, message):
        sl.w_trim_refused_late(world_with(rows=3), 2, layer, "partial")


def test_a_late_refused_trim_refuses_by_raising_by_default():
    with raises(StateError, "trim_prompt_cache: layer 1 refused its trim of 1 rows after the layers before "
                            "it trimmed; nothing was trimmed in any layer"):
        sl.apply_op(world_with(), {"op": "trim_refused_late", "n": 1, "layer": 1})


def test_a_late_refused_trim_of_nothing_asks_no_layer():
    w = world_with()
    assert sl.w_trim_refused_late(w, 0, 0, "raises") == (0, w)


def test_a_per_layer_op_refuses_a_boolean_index():
    with raises(InvalidArgumentError, "layer: index must satisfy 0 <= index < 2, got True"):
        sl.w_layer(world_with(), True, {"op": "fetch"})


def test_apply_op_reload_goes_through_a_file_by_default_and_checks_the_route():
    w = world_with()
    _, loaded = sl.apply_op(w, {"op": "reload"})
    assert sl.windows(loaded) == sl.windows(w)
    assert all(layer.cache.marker is None for layer in loaded.layers)
    with raises(InvalidArgumentError, "reload: via must be 'file' or 'state', got 'disk'"):
        sl.apply_op(w, {"op": "reload", "via": "disk"})


def test_apply_op_copy_keeps_the_original_list_live_by_default():
    _, w = sl.apply_op(world_with(), {"op": "copy", "name": "c"})
    assert all(layer.cache.marker is not None for layer in w.layers)
    results, _ = sl.apply_op(w, {"op": "append", "n": 1})
    assert results[0].inplace  # the dense layer's marker stayed


def test_apply_op_dispatches_both_mismatches_with_their_fields():
    w = world_with()
    with raises(InvalidArgumentError, "append: dtype must be the cached rows' (a cache holding rows keeps their shape and dtype)"):
        sl.apply_op(w, {"op": "append_mismatch", "n": 1, "differs": "dtype"})
    with raises(InvalidArgumentError, "append: keys and values must agree on kv_heads (a K/V pair agrees with itself)"):
        sl.apply_op(w, {"op": "append_pair_mismatch", "n": 1, "differs": "kv_heads"})


def test_the_view_of_the_live_list_is_every_layer_s_window():
    w = world_with()
    assert sl.view_of(w, None) == ((0, 1), (0, 1))


def test_the_view_of_an_unknown_snapshot_is_refused_as_an_expectation():
    with raises(StateError, "expect: no snapshot or handle named 's'"):
        sl.view_of(world_with(), "s")


def test_apply_op_passes_the_way_a_late_trim_is_refused():
    with raises(InvalidArgumentError, "trim_refused_late: how must be one of raises, short, partial, fewer, more, "
                                      "got 'quietly'"):
        sl.apply_op(world_with(), {"op": "trim_refused_late", "n": 1, "layer": 1, "how": "quietly"})
