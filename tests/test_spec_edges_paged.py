"""Edges of the paged spec (spec/paged.py): exact refusal messages naming
the op and the argument, the invariant checks on broken worlds, and the
defaults of a kvtrace op."""

import re
from dataclasses import replace

import pytest

from kvspec.spec import paged as sp
from kvspec.spec.dense import Entry
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError


def raises(exc, message):
    """``pytest.raises`` on the whole message: the message is the contract."""
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


def world_with(rows=3, block_size=2):
    w = sp.new_world(block_size)
    if rows:
        _, w = sp.append(w, sp.MAIN, rows)
    return w


@pytest.mark.parametrize("kwargs,message", [
    ({"block_size": True}, "new_world: block_size must be an integer >= 1, got True"),
    ({"block_size": 2, "chunk": 0}, "new_world: chunk must be an integer >= 1, got 0"),
    ({"block_size": 2, "chunk": False}, "new_world: chunk must be an integer >= 1, got False"),
    ({"block_size": 2, "max_blocks": -1}, "new_world: max_blocks must be None or an integer >= 0, got -1"),
    ({"block_size": 2, "max_blocks": True}, "new_world: max_blocks must be None or an integer >= 0, got True"),
    ({"block_size": 2, "max_blocks": "3"}, "new_world: max_blocks must be None or an integer >= 0, got '3'"),
])
def test_new_world_refuses_bad_sizes_naming_them(kwargs, message):
    with raises(InvalidArgumentError, message):
        sp.new_world(**kwargs)


@pytest.mark.parametrize("call,message", [
    (lambda w: sp.append(w, sp.MAIN, True), "append: n must be an integer, got True"),
    (lambda w: sp.trim(w, sp.MAIN, True), "trim: n must be an integer, got True"),
    (lambda w: sp.trim_to(w, sp.MAIN, False), "trim_to: len must be an integer, got False"),
    (lambda w: sp.trim_front(w, sp.MAIN, True), "trim_front: n must be an integer, got True"),
    (lambda w: sp.trim_front(w, sp.MAIN, 1, True), "trim_front: keep must be an integer, got True"),
    (lambda w: sp.state_assign(w, sp.MAIN, 1.0), "state: n must be an integer, got 1.0"),
    (lambda w: sp.state_assign(w, sp.MAIN, -1), "state: n must be >= 0, got -1"),
])
def test_a_count_that_is_no_integer_is_refused_naming_the_op_and_the_argument(call, message):
    w = world_with()
    with raises(InvalidArgumentError, message):
        call(w)


def test_fork_refuses_an_empty_name():
    with raises(InvalidArgumentError, "fork: as must be a non-empty string, got ''"):
        sp.fork(world_with(), sp.MAIN, "")


def test_a_released_sequence_leaves_no_window_behind():
    _, w = sp.fork(world_with(), sp.MAIN, "b")
    _, w = sp.release(w, "b")
    assert set(w.windows) == set(w.seqs) == {sp.MAIN}


def test_handle_reuse_refuses_an_unknown_use_and_a_handle_nobody_released():
    w = world_with()
    with raises(InvalidArgumentError, "handle_reuse: use must be one of " + ", ".join(sp.HANDLE_REUSES) + ", got 'poke'"):
        sp.handle_reuse(w, sp.MAIN, "poke")
    with raises(StateError, "handle_reuse: no handle of a released sequence named 'b'"):
        sp.handle_reuse(w, "b", "fetch")


def test_both_mismatches_name_an_unknown_sequence_as_an_append():
    w = world_with()
    with raises(StateError, "append: no sequence named 'b'"):
        sp.append_mismatch(w, "b", 1, "dtype")
    with raises(StateError, "append: no sequence named 'b'"):
        sp.append_pair_mismatch(w, "b", 1, "dtype")


def test_loading_the_state_of_an_unknown_sequence_is_refused_as_a_state():
    with raises(StateError, "state: no sequence named 'b'"):
        sp.load_state(world_with(), "b")


def test_a_state_assignment_moves_the_token_counter_on():
    _, w = sp.state_assign(world_with(), sp.MAIN, 2)
    assert w.window() == (3, 4)
    _, w = sp.append(w, sp.MAIN, 1)
    assert w.window() == (3, 4, 5)


def test_reload_refuses_an_unknown_route():
    with raises(InvalidArgumentError, "reload: via must be 'file' or 'state', got 'disk'"):
        sp.reload(world_with(), sp.MAIN, "disk")


def test_apply_op_forks_from_main_by_default():
    _, w = sp.apply_op(world_with(), {"op": "fork", "as": "b"})
    assert w.window("b") == (0, 1, 2)


def test_apply_op_expect_reads_the_sequence_it_names():
    w = world_with()
    _, w = sp.fork(w, sp.MAIN, "b")
    _, w = sp.append(w, "b", 1)
    assert sp.apply_op(w, {"op": "expect", "of": "b"})[0] == (0, 1, 2, 3)
    assert sp.apply_op(w, {"op": "expect", "seq": "b"})[0] == (0, 1, 2, 3)
    assert sp.apply_op(w, {"op": "expect"})[0] == (0, 1, 2)


def test_apply_op_copy_names_an_unknown_sequence_and_refuses_a_deep_copy_by_default():
    w = world_with()
    with raises(StateError, "copy: no sequence named 'b'"):
        sp.apply_op(w, {"op": "copy", "seq": "b"})
    with raises(UnsupportedOperationError, str(sp.copy_refused(True))):
        sp.apply_op(w, {"op": "copy"})
    assert "copy.deepcopy of a PagedKVCache" in str(sp.copy_refused(True))


def test_apply_op_dispatches_both_mismatches_with_their_fields():
    w = world_with()
    with raises(InvalidArgumentError, "append: batch must be the cached rows' (a cache holding rows keeps their shape and dtype)"):
        sp.apply_op(w, {"op": "append_mismatch", "n": 1, "differs": "batch"})
    with raises(InvalidArgumentError, "append: keys and values must agree on dtype (a K/V pair agrees with itself)"):
        sp.apply_op(w, {"op": "append_pair_mismatch", "n": 1, "differs": "dtype"})


def test_apply_op_reload_goes_through_a_file_by_default():
    with pytest.raises(UnsupportedOperationError, match="^save_prompt_cache: layer 0 is a PagedKVCache"):
        sp.apply_op(world_with(), {"op": "reload"})


def test_apply_op_handle_reuse_appends_by_default():
    _, w = sp.fork(world_with(), sp.MAIN, "b")
    _, w = sp.release(w, "b")
    with raises(StateError, "append: the handle of sequence 'b' was consumed by its release "
                            "(take a new handle: PagedKVCache(pool, 'b'))"):
        sp.apply_op(w, {"op": "handle_reuse", "seq": "b"})


def test_gather_reads_a_released_block_in_range_as_unwritten():
    """A broken table (None inside the visible rows) reads as None, so the
    window check flags it instead of failing."""
    w = world_with()
    broken = replace(w.seqs[sp.MAIN], table=(None, 1))
    assert sp.gather(w.pool, broken) == (None, None, 2)
    assert not sp.gathered_matches_windows(replace(w, seqs={sp.MAIN: broken}))


def with_main(w, **fields):
    return replace(w, seqs={**w.seqs, sp.MAIN: replace(w.seqs[sp.MAIN], **fields)})


@pytest.mark.parametrize("fields", [
    {"start": 4},  # start past the length, table length right
    {"table": (0,)},  # one entry short
    {"start": 2, "table": (0, 1)},  # a block wholly before start still held
    {"table": (0, 0)},  # a block held twice
])
def test_a_broken_table_is_not_well_formed(fields):
    w = world_with()
    assert sp.tables_well_formed(w)
    assert not sp.tables_well_formed(with_main(w, **fields))


def test_a_window_out_of_step_with_the_blocks_or_the_positions_is_flagged():
    w = world_with()
    assert sp.gathered_matches_windows(w)
    tokens = replace(w, windows={sp.MAIN: (Entry(0, 0), Entry(1, 1), Entry(2, 9))})
    positions = replace(w, windows={sp.MAIN: (Entry(0, 0), Entry(1, 1), Entry(3, 2))})
    assert not sp.gathered_matches_windows(tokens)
    assert not sp.gathered_matches_windows(positions)


def test_views_unchanged_sees_a_change_to_a_sequence_other_than_the_writer():
    _, before = sp.fork(world_with(), sp.MAIN, "b")
    _, after = sp.trim(before, "b", 1)
    assert not sp.views_unchanged(before, after, sp.MAIN)
    assert sp.views_unchanged(before, after, "b")
