"""Unit tests of the paged spec: each rule of semantics.md section 4, the
invariants after random op sequences, and agreement with a dense cache fed
the same rows."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.spec import dense as sd
from kvspec.spec import paged as sp
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError


def run(world, *ops):
    for op in ops:
        _, world = sp.apply_op(world, op)
    return world


def A(n, seq="main"):
    return {"op": "append", "n": n, "seq": seq}


def test_block_rules_on_integers():
    assert [sp.block_index(p, 3) for p in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert [sp.block_slot(p, 3) for p in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [sp.table_len(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert sp.wholly_before(0, 4, 4) and not sp.wholly_before(1, 7, 4) and sp.wholly_before(1, 8, 4)
    assert sp.needs_copy_on_write(2) and not sp.needs_copy_on_write(1)
    assert sp.write_in_place(True, 1, 5, 5)
    assert not sp.write_in_place(True, 2, 5, 5)
    assert not sp.write_in_place(True, 1, 4, 5)
    assert not sp.write_in_place(False, 1, 5, 5)
    assert sp.growth_blocks(0, 3, 4, None) == 0
    assert sp.growth_blocks(5, 3, 4, None) == 8
    assert sp.growth_blocks(5, 3, 4, 9) == 6
    assert sp.growth_blocks(5, 9, 4, 9) == 0


def test_append_fills_blocks_by_absolute_position_and_first_write_is_in_place():
    w = sp.new_world(block_size=2)
    r, w = sp.append(w, "main", 3)
    assert r.window == (0, 1, 2) and r.inplace and r.fresh == (0, 1) and r.copied == ()
    s = w.seqs["main"]
    assert s.table == (0, 1) and s.length == 3 and s.start == 0
    assert w.pool.blocks == ((0, 1), (2, None))
    assert sp.capacity_of(len(s.table), 2) == 4
    r, w = sp.append(w, "main", 1)
    assert r.inplace and r.fresh == () and w.pool.blocks[1] == (2, 3)


def test_write_after_fork_copies_the_shared_tail_block():
    w = run(sp.new_world(block_size=4), A(3), {"op": "fork", "from": "main", "as": "b"})
    assert w.pool.refcounts == (2,)
    r, w2 = sp.append(w, "b", 1)
    assert not r.inplace and r.copied == ((0, 1),)
    assert w2.seqs["b"].table == (1,) and w2.seqs["main"].table == (0,)
    assert w2.pool.refcounts == (1, 1)
    assert w2.window("main") == (0, 1, 2) and w2.window("b") == (0, 1, 2, 3)
    assert w2.pool.blocks[0] == (0, 1, 2, None)  # the shared block never saw the write
    assert sp.views_unchanged(w, w2, "b")
    # the copy now has one holder: its next row goes in place
    r, _ = sp.append(w2, "b", 1)
    assert r.inplace and r.copied == ()


def test_full_shared_blocks_are_never_copied():
    # a write past a shared block's end allocates; nothing is copied
    w = run(sp.new_world(block_size=2), A(4), {"op": "fork", "from": "main", "as": "b"})
    r, w = sp.append(w, "b", 1)
    assert r.copied == () and r.fresh == (2,) and r.inplace
    assert w.pool.refcounts == (2, 2, 1)


def test_trim_releases_blocks_past_ceil_len():
    w = run(sp.new_world(block_size=2), A(5))
    n, w = sp.trim(w, "main", 2)
    assert n == 2 and w.seqs["main"].table == (0, 1) and w.pool.free == (2,)
    assert w.pool.refcounts == (1, 1, 0)
    n, w = sp.trim(w, "main", 10)  # clamped to the visible rows
    assert n == 3 and w.seqs["main"].table == () and w.pool.free == (0, 1, 2)
    assert sp.trim(w, "main", -1)[0] == 0 and sp.trim(w, "main", 0)[1] is w


def test_trim_of_shared_blocks_lowers_refcounts_only():
    w = run(sp.new_world(block_size=2), A(4), {"op": "fork", "from": "main", "as": "b"}, {"op": "trim", "n": 3})
    assert w.pool.refcounts == (2, 1) and w.pool.free == ()
    assert w.window("b") == (0, 1, 2, 3) and w.window() == (0,)
    r, w = sp.append(w, "main", 1)  # into shared block 0: copy-on-write
    assert r.copied == ((0, 2),) and w.window() == (0, 4) and w.window("b") == (0, 1, 2, 3)


def test_trim_front_moves_start_and_releases_whole_blocks_before_it():
    w = run(sp.new_world(block_size=2), A(5))
    n, w = sp.trim_front(w, "main", 3)
    s = w.seqs["main"]
    assert n == 3 and s.start == 3 and s.length == 5
    assert s.table == (None, 1, 2) and w.pool.free == (0,)
    assert w.window() == (3, 4)
    _, w = sp.append(w, "main", 1)  # absolute position 5: block index 2
    assert w.seqs["main"].table == (None, 1, 2) and w.window() == (3, 4, 5)


def test_trim_front_keep_refused_and_clamped():
    w = run(sp.new_world(block_size=2), A(3))
    with pytest.raises(UnsupportedOperationError, match=r"trim_front: keep must be 0.*got 1"):
        sp.trim_front(w, "main", 1, keep=1)
    n, w = sp.trim_front(w, "main", 99)
    assert n == 3 and w.window() == ()
    assert sp.trim_front(w, "main", 1)[0] == 0


def test_emptying_trim_leaves_len_at_logical_start():
    w = run(sp.new_world(block_size=4), A(6), {"op": "trim_front", "n": 5})
    n, w = sp.trim(w, "main", 5)
    s = w.seqs["main"]
    assert n == 1 and s.length == s.start == 5
    _, w = sp.append(w, "main", 1)
    assert w.windows["main"] == (sd.Entry(5, 6),)
    assert sp.trim_to(w, "main", 0)[1].seqs["main"].length == 5  # stops at the start


def test_trim_to_bounds():
    w = run(sp.new_world(block_size=2), A(3))
    with pytest.raises(InvalidArgumentError, match=r"trim_to: len must satisfy 0 <= len <= offset \(3\), got 4"):
        sp.trim_to(w, "main", 4)
    with pytest.raises(InvalidArgumentError, match="got -1"):
        sp.trim_to(w, "main", -1)
    assert sp.trim_to(w, "main", 1)[0] == 2


def test_release_frees_only_unshared_blocks():
    w = run(sp.new_world(block_size=2), A(3), {"op": "fork", "from": "main", "as": "b"}, A(2, "b"))
    _, w = sp.release(w, "main")
    assert "main" not in w.seqs and w.window("b") == (0, 1, 2, 3, 4)
    assert w.pool.refcounts == (1, 0, 1, 1) and w.pool.free == (1,)
    with pytest.raises(StateError, match="no sequence named 'main'"):
        sp.append(w, "main", 1)


def test_fork_refusals():
    w = sp.new_world(block_size=2)
    with pytest.raises(StateError, match="no sequence named 'x'"):
        sp.fork(w, "x", "y")
    with pytest.raises(StateError, match="'main' already exists"):
        sp.fork(w, "main", "main")


def test_exhaustion_refused_and_nothing_changes():
    w = run(sp.new_world(block_size=2, max_blocks=2), A(3), {"op": "fork", "from": "main", "as": "b"})
    # b's write needs a copy of block 1: the pool is full
    with pytest.raises(StateError, match=r"append: pool exhausted: needs 1 free blocks, has 0 free of 2 and max_blocks=2"):
        sp.append(w, "b", 1)
    with pytest.raises(StateError, match="pool exhausted"):
        sp.append(w, "main", 2)
    _, w2 = sp.trim(w, "main", 1)  # main gives block 1 up: b owns it alone
    r, w2 = sp.append(w2, "b", 1)
    assert r.inplace and r.copied == ()


def test_exhaustion_checks_before_growing():
    w = sp.new_world(block_size=1, max_blocks=3, chunk=2)
    with pytest.raises(StateError):
        sp.append(w, "main", 4)
    _, w = sp.append(w, "main", 1)
    assert w.pool.size == 2  # one chunk
    _, w = sp.append(w, "main", 2)
    assert w.pool.size == 3  # capped at max_blocks


def test_apply_op_refuses_unknown_ops_and_bad_counts():
    w = sp.new_world(block_size=2)
    with pytest.raises(UnsupportedOperationError, match="snapshot: a paged cache snapshots by fork and release"):
        sp.apply_op(w, {"op": "snapshot", "name": "s"})
    with pytest.raises(UnsupportedOperationError, match="gather_positions: not an operation of a paged cache"):
        sp.apply_op(w, {"op": "gather_positions", "positions": [0]})
    with pytest.raises(StateError, match="hold: no append has returned a window yet"):
        sp.apply_op(w, {"op": "hold"})
    _, w2 = sp.apply_op(sp.apply_op(w, {"op": "append", "n": 2})[1], {"op": "hold"})
    assert w2.held == (0, 1) and sp.apply_op(w2, {"op": "release_hold"})[1].held is None
    with pytest.raises(InvalidArgumentError, match="append: n must be >= 1, got 0"):
        sp.apply_op(w, {"op": "append", "n": 0})
    with pytest.raises(InvalidArgumentError, match="new_world: block_size"):
        sp.new_world(0)
    assert sp.apply_op(w, {"op": "expect", "window": []})[0] == ()


# ---------------------------------------------------------------------------
# Random op sequences: invariants, isolation, agreement with a dense cache.

NAMES = ("main", "a", "b", "c")
op_st = st.one_of(
    st.builds(lambda n, s: {"op": "append", "n": n, "seq": s}, st.integers(1, 5), st.sampled_from(NAMES)),
    st.builds(lambda n, s: {"op": "trim", "n": n, "seq": s}, st.integers(-1, 6), st.sampled_from(NAMES)),
    st.builds(lambda n, s: {"op": "trim_front", "n": n, "seq": s}, st.integers(0, 5), st.sampled_from(NAMES)),
    st.builds(lambda f, a: {"op": "fork", "from": f, "as": a}, st.sampled_from(NAMES), st.sampled_from(NAMES)),
    st.builds(lambda s: {"op": "release", "seq": s}, st.sampled_from(NAMES)),
)


def dense_step(dense, op, world):
    """The same op on one dense cache per sequence."""
    seq = op.get("seq", "main")
    if op["op"] == "append":
        tokens = tuple(range(world.next_token, world.next_token + op["n"]))
        dense[seq] = sd.append(dense[seq], tokens)[1]
    elif op["op"] == "trim":
        dense[seq] = sd.trim(dense[seq], op["n"])[1]
    elif op["op"] == "trim_front":
        dense[seq] = sd.trim_front_keep_sink(dense[seq], op["n"], 0)[1]
    elif op["op"] == "fork":
        dense[op["as"]] = dense[op["from"]]
    elif op["op"] == "release":
        del dense[seq]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.sampled_from([None, 4, 8]), st.integers(1, 3), st.lists(op_st, max_size=25))
def test_random_ops_keep_every_invariant_and_match_dense(bs, max_blocks, chunk, ops):
    w = sp.new_world(bs, max_blocks, chunk)
    dense = {"main": sd.new_cache(step=1)}
    for op in ops:
        try:
            _, w2 = sp.apply_op(w, op)
        except (StateError, InvalidArgumentError):
            continue  # refusals are checked to change nothing by construction (pure)
        dense_step(dense, op, w)
        assert sp.broken_invariants(w2) == ()
        if op["op"] in ("append", "trim", "trim_front"):
            assert sp.views_unchanged(w, w2, op["seq"])
        elif op["op"] != "release":
            assert sp.views_unchanged(w, w2, "")
        w = w2
        assert set(w.seqs) == set(dense)
        for name, s in w.seqs.items():
            assert w.window(name) == dense[name].window()
            assert (s.length, s.start) == (dense[name].offset, dense[name].live_start)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.lists(op_st, max_size=20))
def test_invariant_checks_see_a_leak_and_a_double_hold(bs, ops):
    # every invariant can fail: break a reachable world by hand
    w = sp.new_world(bs)
    for op in ops:
        try:
            _, w = sp.apply_op(w, op)
        except (StateError, InvalidArgumentError):
            pass
    if w.pool.size == 0:
        return
    leaked = w.pool.refcounts[:-1] + (w.pool.refcounts[-1] + 1,)
    broken = sp.PagedWorld(sp.replace(w.pool, refcounts=leaked), w.seqs, w.windows, w.next_token)
    assert "refcounts_match_tables" in sp.broken_invariants(broken)
    assert "free_blocks_unheld" in sp.broken_invariants(
        sp.PagedWorld(sp.replace(w.pool, free=w.pool.free + (0,)), w.seqs, w.windows, w.next_token))
