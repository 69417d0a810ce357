"""Edges of the block pool (impl/paged.py) and of the rotating ring
(impl/rotating.py): the exact refusal of every malformed argument (each
names its operation, the argument and the rule), the defaults, the block
table's dirty marks and its device mirror, the invariant check's every
clause, and the block and window boundaries of a multi-row write."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from kvspec.impl.paged import (
    BlockPool,
    BlockTable,
    PagedKVCache,
    Sequence,
    _TableMirror,
    make_paged_prompt_cache,
)
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError
from tests.test_impl_paged import DK, DV, H, pool_state, rows, same_window


def refused(exc: type[Exception], message: str):
    """``pytest.raises`` on the whole message, matched literally."""
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


# -- the block pool: argument refusals ----------------------------------------
@pytest.mark.parametrize(("args", "message"), [
    (("2",), "BlockPool: block_size must be an integer, got '2'"),
    ((0,), "BlockPool: block_size must be >= 1, got 0"),
    ((2, None, 1.0), "BlockPool: chunk must be an integer, got 1.0"),
    ((2, None, 0), "BlockPool: chunk must be >= 1, got 0"),
    ((2, "3"), "BlockPool: max_blocks must be an integer, got '3'"),
    ((2, -1), "BlockPool: max_blocks must be None or >= 0, got -1"),
])
def test_a_pool_refuses_each_malformed_setting_by_name(args, message):
    with refused(InvalidArgumentError, message):
        BlockPool(*args)


def test_a_pool_defaults_to_chunks_of_16_blocks_and_no_last_write():
    pool = BlockPool(2)
    assert (pool.block_size, pool.max_blocks, pool.chunk, pool.last_write) == (2, None, 16, None)
    pool.append("main", *rows(0, 1))
    assert pool.size == 16


def test_an_unknown_sequence_is_refused_naming_the_operation():
    pool = BlockPool(2)
    with refused(StateError, "sequence: no sequence named 'x'"):
        pool.sequence("x")
    with refused(StateError, "PagedKVCache: no sequence named 'x'"):
        PagedKVCache(pool, "x")
    pool.create("x")
    with refused(StateError, "create: a sequence named 'x' already exists"):
        pool.create("x")


@pytest.mark.parametrize(("name", "shown"), [("", "''"), (5, "5"), (None, "None")])
def test_a_fork_name_must_be_a_non_empty_string(name, shown):
    pool = BlockPool(2)
    pool.append("main", *rows(0, 3))
    before = pool_state(pool)
    with refused(InvalidArgumentError, f"fork: as must be a non-empty string, got {shown}"):
        pool.fork("main", name)
    assert pool_state(pool) == before


def test_append_refusals_name_append_and_the_argument():
    pool = BlockPool(2)
    pool.append("main", *rows(0, 1))
    before = pool_state(pool)
    with refused(InvalidArgumentError, "append: keys must be an mx.array, got list"):
        pool.append("main", [1], rows(0, 1)[1])
    with refused(InvalidArgumentError,
                 f"append: keys must match the pool's [H, D] = [{H}, {DK}] and dtype mlx.core.float16, "
                 f"got shape (1, {H}, 1, 4) and dtype mlx.core.float16"):
        pool.append("main", mx.zeros((1, H, 1, 4), mx.float16), mx.zeros((1, H, 1, DV), mx.float16))
    assert pool_state(pool) == before


@pytest.mark.parametrize(("call", "message"), [
    (lambda p: p.trim_to("main", "1"), "trim_to: len must be an integer, got '1'"),
    (lambda p: p.trim_to("main", 4), "trim_to: len must satisfy 0 <= len <= offset (3), got 4"),
    (lambda p: p.trim_front("main", 1.0), "trim_front: n must be an integer, got 1.0"),
    (lambda p: p.trim_front("main", 1, "0"), "trim_front: keep must be an integer, got '0'"),
])
def test_trim_refusals_name_the_operation_and_the_argument(call, message):
    pool = BlockPool(2)
    pool.append("main", *rows(0, 3))
    before = pool_state(pool)
    with refused(InvalidArgumentError, message):
        call(pool)
    assert pool_state(pool) == before


# -- multi-row appends across block boundaries --------------------------------
@pytest.mark.parametrize(("bs", "first", "n"), [(3, 0, 5), (4, 0, 6), (4, 1, 9), (3, 2, 7), (2, 0, 5)])
def test_one_append_of_many_rows_fills_every_block_it_crosses(bs, first, n):
    """A run of rows split at each block boundary: the last, partial block
    takes exactly the rows left (never a block's worth)."""
    for inplace in (True, False):
        pool = BlockPool(bs, chunk=1, inplace=inplace)
        if first:
            pool.append("main", *rows(0, first))
        got = pool.append("main", *rows(first, n))
        assert same_window(got, tuple(range(first + n)))
        assert pool.size == -(-(first + n) // bs)


# -- the block table's marks and its device mirror ---------------------------
def fresh_table(n: int = 6) -> BlockTable:
    t = BlockTable(range(n))
    t.dirty_from = n  # as after a sync
    return t


@pytest.mark.parametrize(("change", "mark"), [
    (lambda t: t.__setitem__(slice(2, 4), [9, 9]), 2),
    (lambda t: t.__setitem__(-1, 9), 5),
    (lambda t: t.__setitem__(-6, 9), 0),
    (lambda t: t.__setitem__(3, 9), 3),
    (lambda t: t.__delitem__(slice(4, None)), 4),
    (lambda t: t.__delitem__(-2), 4),
    (lambda t: t.append(9), 6),
    (lambda t: t.extend([9, 9]), 6),
    (lambda t: t.__iadd__([9]), 6),
    (lambda t: t.insert(3, 9), 0),
    (lambda t: t.pop(), 0),
    (lambda t: t.remove(3), 0),
    (lambda t: t.clear(), 0),
    (lambda t: t.sort(reverse=True), 0),
    (lambda t: t.reverse(), 0),
])
def test_every_change_of_a_block_table_marks_the_lowest_entry_it_may_move(change, mark):
    t = fresh_table()
    change(t)
    assert t.dirty_from == mark


def test_every_list_method_of_a_block_table_still_does_its_work():
    t = fresh_table()
    t += [6]
    t.extend([7])
    t.insert(1, 10)
    assert t == [0, 10, 1, 2, 3, 4, 5, 6, 7]
    assert t.pop() == 7 and t.pop(1) == 10
    t.remove(4)
    t.sort(key=lambda b: -b)
    assert t == [6, 5, 3, 2, 1, 0]
    t.sort()
    t.reverse()
    assert t == [6, 5, 3, 2, 1, 0]
    t.clear()
    assert t == [] and t.dirty_from == 0


def test_the_mirror_follows_marks_and_resyncs_a_table_assigned_whole():
    """After a sync, only the marked entries are rewritten; a table the
    mirror has not seen (one another mirror brought up to date, so its
    marks say clean) is written whole."""
    m, other = _TableMirror(), _TableMirror()
    t1 = BlockTable([1, 2, 3])
    assert m.sync(t1)[:3].tolist() == [1, 2, 3]
    t1[1] = 7
    t1.append(8)
    assert m.sync(t1)[:4].tolist() == [1, 7, 3, 8]
    t2 = BlockTable([4, 5, 6, 9])
    other.sync(t2)
    assert t2.dirty_from == 4
    assert m.sync(t2)[:4].tolist() == [4, 5, 6, 9]
    assert m.sync(t1)[:4].tolist() == [1, 7, 3, 8]
    big = BlockTable(range(40))
    assert m.sync(big)[:40].tolist() == list(range(40))


def test_a_sequence_made_from_a_plain_list_holds_a_block_table():
    s = Sequence([0, 1])
    assert type(s.table) is BlockTable and s.table == [0, 1]
    t = BlockTable([2])
    assert Sequence(t).table is t


def test_a_table_assigned_whole_as_a_plain_list_is_gathered_right():
    pool = BlockPool(2, chunk=1)
    pool.append("main", *rows(0, 5))
    assert same_window(pool.fetch(), (0, 1, 2, 3, 4))
    s = pool.sequence()
    s.table = list(s.table)
    assert same_window(pool.fetch(), (0, 1, 2, 3, 4))
    assert type(s.table) is BlockTable
    pool.append("main", *rows(5, 2))
    assert same_window(pool.fetch(), tuple(range(7)))


# -- copy on write and the in-place switch ------------------------------------
def test_an_in_place_pool_copies_a_shared_block_into_the_slab_it_has():
    """With room in the slab, a copy on write and the write after it go
    into the slab's own memory: the pool keeps the same slab arrays."""
    pool = BlockPool(2, chunk=4)
    pool.append("main", *rows(0, 1))
    pool.fork("main", "b")
    slabs = pool.keys, pool.values
    pool.append("b", *rows(1, 1))
    assert pool.last_write.copied == ((0, 1),)
    assert pool.keys is slabs[0] and pool.values is slabs[1]
    assert same_window(pool.fetch("b"), (0, 1)) and same_window(pool.fetch("main"), (0,))


def test_with_the_switch_off_a_lazy_window_survives_its_block_being_reused_by_a_copy():
    """The switch off, a window is left lazy; its rows stay what they were
    after its block was freed and a copy on write wrote into it."""
    pool = BlockPool(2, chunk=4, inplace=False)
    pool.append("main", *rows(0, 4))
    window = pool.fetch()  # lazy: gathers blocks 0 and 1
    pool.trim("main", 3)  # block 1 back on the free list
    pool.fork("main", "b")
    pool.append("b", *rows(10, 1))  # block 0 shared: copied into block 1
    assert pool.last_write.copied == ((0, 1),)
    assert same_window(window, (0, 1, 2, 3))
    assert same_window(pool.fetch("b"), (0, 10))


# -- the invariant check, clause by clause ------------------------------------
def sound_pool() -> BlockPool:
    pool = BlockPool(2, chunk=4)
    pool.append("main", *rows(0, 3))  # blocks 0, 1; 2 and 3 free
    assert pool.broken_invariants() == ()
    return pool


def test_a_table_naming_a_block_past_the_pool_is_a_refcount_mismatch():
    pool = sound_pool()
    pool.seqs["main"].table[1] = pool.size
    assert pool.broken_invariants() == ("refcounts_match_tables",)


def test_a_free_list_missing_a_free_block_is_reported_alone_with_the_count():
    pool = sound_pool()
    pool.free.remove(3)
    assert pool.broken_invariants() == ("free_blocks_unheld", "blocks_accounted")


def test_a_free_block_listed_twice_is_reported():
    pool = sound_pool()
    pool.free.append(3)
    assert pool.broken_invariants() == ("free_blocks_unheld", "blocks_accounted")


def test_a_table_holding_a_block_twice_is_malformed():
    pool = sound_pool()
    pool.seqs["main"].table[1] = 0
    pool.refcounts[0], pool.refcounts[1] = 2, 0
    pool.free = [1, 2, 3]
    assert pool.broken_invariants() == ("tables_well_formed",)


def test_a_table_longer_than_the_length_needs_is_malformed():
    pool = sound_pool()
    pool.seqs["main"].length = 2
    assert pool.broken_invariants() == ("tables_well_formed",)


@pytest.mark.parametrize("start", [-1, 1])
def test_a_start_outside_zero_to_length_is_malformed(start):
    pool = BlockPool(4)
    pool.create("e")
    pool.seqs["e"].start = start  # e: length 0, empty table
    assert pool.broken_invariants() == ("tables_well_formed",)


def test_a_released_entry_after_the_start_is_malformed_and_one_report_covers_every_table():
    pool = sound_pool()
    pool.fork("main", "b")
    for name in ("main", "b"):
        pool.seqs[name].table[1] = None
    pool.refcounts[1] = 0
    pool.free = [1, 2, 3]
    assert pool.broken_invariants() == ("tables_well_formed",)


# -- the cache handle ---------------------------------------------------------
def test_a_paged_cache_defaults_to_blocks_of_16():
    assert PagedKVCache().pool.block_size == 16
    assert [c.pool.block_size for c in make_paged_prompt_cache(2)] == [16, 16]
    caches = make_paged_prompt_cache(0)
    assert caches == []
    with refused(InvalidArgumentError, "make_paged_prompt_cache: num_layers must be an integer, got '2'"):
        make_paged_prompt_cache("2")


def test_the_handle_trims_to_a_length_and_front_trims_without_a_sink_by_default():
    cache = PagedKVCache(block_size=2, chunk=1)
    cache.update_and_fetch(*rows(0, 5))
    assert cache.trim_to(3) == 2 and cache.offset == 3
    with refused(InvalidArgumentError, "trim_to: len must satisfy 0 <= len <= offset (3), got 4"):
        cache.trim_to(4)
    assert cache.trim_front_keep_sink(2) == 2 and cache.live_len == 1
    assert same_window(cache.fetch(), (2,))


def test_to_quantized_is_refused_naming_the_bits_and_the_dense_alternative():
    cache = PagedKVCache(block_size=2)
    message = ("a PagedKVCache's blocks belong to its pool (shared with other sequences) and the pool stores "
               "unquantized rows; for quantized storage use dense caches "
               "(kvspec.impl.models.make_prompt_cache(model, mode='int8'))")
    with refused(UnsupportedOperationError, "to_quantized(bits=4): " + message):
        cache.to_quantized()
    with refused(UnsupportedOperationError, "to_quantized(bits=8): " + message):
        cache.to_quantized(32, 8)


def test_make_mask_refuses_a_bad_n_and_bounds_a_window():
    cache = PagedKVCache(block_size=2)
    cache.update_and_fetch(*rows(0, 3))
    with refused(InvalidArgumentError, "make_mask: N must be an integer, got '1'"):
        cache.make_mask("1")
    with refused(InvalidArgumentError, "make_mask: N must be >= 1, got 0"):
        cache.make_mask(0)
    q, k = np.arange(3, 5)[:, None], np.arange(5)[None]
    want = (q >= k) & (q < k + 2)
    assert np.array_equal(np.array(cache.make_mask(2, window_size=2)), want)
    assert np.array_equal(np.array(cache.make_mask(2, return_array=True)), q >= k)


def test_from_state_defaults_to_blocks_of_16_and_takes_an_empty_state():
    cache = PagedKVCache.from_state(rows(0, 3))
    assert cache.pool.block_size == 16 and same_window(cache.fetch(), (0, 1, 2))
    empty = PagedKVCache.from_state((), ("4", "0", "0"))
    assert empty.pool.block_size == 4 and empty.offset == 0 and empty.fetch() is None


def from_state_refusal(offset: int, start: int, rows_: int) -> str:
    return (f"from_state: meta_state must describe the rows from position 0 (start 0, offset {rows_}), "
            f"got offset={offset}, start={start}")


def test_from_state_refuses_counters_that_do_not_start_at_zero():
    with refused(InvalidArgumentError, from_state_refusal(3, 1, 3)):
        PagedKVCache.from_state(rows(0, 3), ("2", "3", "1"))
    with refused(InvalidArgumentError, from_state_refusal(2, 0, 3)):
        PagedKVCache.from_state(rows(0, 3), ("2", "2", "0"))


def test_from_state_counts_rows_of_rank_4_keys_only():
    """Rows are counted from the keys, and only when they are a rank-4
    array (-1 otherwise, which no offset matches); the values' own rank
    and rows are the state setter's to refuse."""
    k, v = rows(0, 3)
    with refused(InvalidArgumentError, from_state_refusal(0, 0, -1)):
        PagedKVCache.from_state(("x", "y"), ("2", "0", "0"))
    with refused(InvalidArgumentError, from_state_refusal(2, 0, -1)):
        PagedKVCache.from_state((k[0], v), ("2", "2", "0"))
    with refused(InvalidArgumentError, f"state: values must have rank 4 [B, H, S, D], got shape {tuple(v[0].shape)}"):
        PagedKVCache.from_state((k, v[0]), ("2", "3", "0"))
    short = v[:, :, :2]
    with refused(InvalidArgumentError, "state: keys and values must agree on rows S, got 3 and 2 "
                 f"(shapes {tuple(k.shape)} and {tuple(short.shape)})"):
        PagedKVCache.from_state((k, short), ("2", "3", "0"))


# == the rotating ring ========================================================
def test_ring_visible_is_the_spec_mask_rule():
    from kvspec.impl.rotating import ring_visible
    from kvspec.spec.rotating import mask_visible

    for window in range(1, 6):
        for keep in range(window):
            for query in range(9):
                for key in range(11):
                    assert ring_visible(query, key, window, keep) == mask_visible(query, key, window, keep), (
                        query, key, window, keep)


def test_ring_visible_at_its_boundaries():
    from kvspec.impl.rotating import ring_visible

    assert ring_visible(3, 3, 2, 0) and not ring_visible(3, 4, 2, 0)  # causal: the query itself, not later
    assert ring_visible(5, 4, 2, 0) and not ring_visible(5, 3, 2, 0)  # the latest window - keep only
    assert ring_visible(9, 1, 3, 2) and not ring_visible(9, 2, 3, 2)  # sinks are keys < keep
    assert ring_visible(9, 8, 4, 2) and not ring_visible(9, 7, 4, 2)  # window - keep = 2 latest
    assert not ring_visible(1, 5, 4, 2)  # a sink is still causal


def record(rows: int, whole: bool = True, saved: bool = False):
    from kvspec.impl.rotating import UndoRecord

    a = mx.zeros((1, 1, 1, 2), mx.float16) if saved else None
    return UndoRecord("prefill" if rows > 1 else "decode", rows, 10, 10, 12, -1, a, a, whole)


@pytest.mark.parametrize(("rows", "n"), [((1,), 1), ((2, 1), 1), ((3,), 2), ((1, 3), 3), ((2, 1, 3), 4),
                                         ((2, 1, 3), 5), ((2, 1, 3), 6), ((2, 1, 3), 9), ((1, 1), 0), ((), 2)])
def test_log_rewind_is_the_spec_rewind(rows, n):
    """Whole records wholly past the new offset go (a record of exactly the
    rows taken goes too), a partly taken record keeps its remaining rows,
    the older ones stay as they were."""
    from kvspec.impl.rotating import log_rewind
    from kvspec.spec import rotating as sr

    log = tuple(record(r) for r in rows)
    spec_log = tuple(sr.UndoRecord(r.kind, r.rows, r.offset, r.idx, r.capacity, r.slot, (), r.whole) for r in log)
    got = log_rewind(log, n)
    want = sr.log_rewind(spec_log, n)
    assert [r.rows for r in got] == [r.rows for r in want]
    assert all(g is o for g, o in zip(got[:-1], log, strict=False))


def test_log_rewind_keeps_the_remaining_rows_of_a_part_taken_record():
    from kvspec.impl.rotating import log_rewind

    log = (record(2), record(3))
    assert [r.rows for r in log_rewind(log, 1)] == [2, 2]
    assert [r.rows for r in log_rewind(log, 3)] == [2]
    assert [r.rows for r in log_rewind(log, 4)] == [1]
    assert log_rewind(log, 5) == ()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"undo": "1"}, "RotatingKVCache: undo must be an integer, got '1'"),
    ({"undo": -1}, "RotatingKVCache: undo must be >= 0, got -1"),
    ({"step": 2**20 + 1}, "RotatingKVCache: step must be in [1, 1048576], got 1048577"),
    ({"step": 0}, "RotatingKVCache: step must be in [1, 1048576], got 0"),
    ({"inplace": "no"}, "RotatingKVCache: inplace must be True, False or None (read KV_INPLACE_WRITE), got 'no'"),
])
def test_a_ring_refuses_each_malformed_setting_by_name(kwargs, message):
    with refused(InvalidArgumentError, message):
        RotatingKVCache(4, **kwargs)


def test_a_ring_accepts_the_largest_step():
    assert RotatingKVCache(4, step=2**20).step == 2**20


def test_a_fresh_ring_has_reported_nothing():
    c = RotatingKVCache(3, step=1)
    assert c.rollback_warned is False


def kvr(tokens):
    from tests.test_impl_rotating import kv

    return kv(tokens)


def wrapped_ring(undo: int = 0) -> RotatingKVCache:
    c = RotatingKVCache(3, step=1, undo=undo)
    for t in range(4):
        c.update_and_fetch(*kvr([t]))
    assert c.offset != c.idx
    return c


ROLLBACK_WARNING = (
    "RotatingKVCache(max_size=3, undo={undo}) has wrapped and can roll back exactly {rows} rows: {asked} is "
    "refused (nothing trimmed), so a decoding loop that goes on leaves the stream it would have had; for "
    "speculative decoding build the caches with kvspec.impl.models.make_prompt_cache(model, num_draft_tokens=k) (an "
    "undo log of k rows per ring). Reported once per cache."
)


def only_warning(record_, category):
    """The one warning recorded, of exactly ``category``."""
    assert len(record_) == 1, [str(w.message) for w in record_]
    w = record_[0]
    assert w.category is category
    return str(w.message)


def test_a_refused_trim_warns_once_naming_the_rows_asked():
    import warnings

    from kvspec.spec.errors import RollbackWarning

    c = wrapped_ring()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert c.trim(2) == 0
    assert only_warning(got, RollbackWarning) == ROLLBACK_WARNING.format(undo=0, rows=0, asked="a rollback of 2 rows")
    assert c.rollback_warned is True
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert c.trim(1) == 0 and not c.is_trimmable()
    assert got == []


def test_is_trimmable_warns_any_rollback_once_a_trim_was_asked():
    """A trim that succeeded while the ring was unwrapped marks it as used
    by a rollback loop: once wrapped, is_trimmable's False comes with the
    warning (for any rollback)."""
    import warnings

    from kvspec.spec.errors import RollbackWarning

    c = RotatingKVCache(3, step=1)
    c.update_and_fetch(*kvr([0, 1]))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert c.trim(1) == 1
        assert c.is_trimmable()  # unwrapped: trimmable, nothing to report
    assert got == []
    for t in range(1, 5):
        c.update_and_fetch(*kvr([t]))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert not c.is_trimmable()
    assert only_warning(got, RollbackWarning) == ROLLBACK_WARNING.format(undo=0, rows=0, asked="any rollback")


def test_is_trimmable_false_warns_without_a_trim_before_and_with_an_undo_log():
    """Issue 47: is_trimmable()'s False is a refused rollback (mlx-lm then
    skips the rollback in every layer): each ring warns at its first False,
    with no trim before it and also with an (empty) undo log; trim(0)
    asks nothing and is silent."""
    import warnings

    from kvspec.spec.errors import RollbackWarning

    c = wrapped_ring()
    d = wrapped_ring(undo=2)
    d.restore(d.snapshot())  # a restored ring's log is empty: nothing to roll back
    e = wrapped_ring()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert c.trim(0) == 0 and d.trim(0) == 0 and d.trimmable_rows() == 0
    assert got == []
    for ring, undo in ((c, 0), (d, 2), (e, 0)):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            assert not ring.is_trimmable()
            assert not ring.is_trimmable()
        assert only_warning(got, RollbackWarning) == ROLLBACK_WARNING.format(undo=undo, rows=0, asked="any rollback")


def test_a_partial_rollback_of_a_block_keeps_the_last_write_flag_and_the_ownership():
    """Undoing all but one row of a multi-row append rebuilds the ring
    before it and decodes that row again: the ring owns its buffers after
    it (the next warm-up decode goes in place) and ``last_write_inplace``
    still says how the user's last write went."""
    c = RotatingKVCache(4, step=4, undo=8, inplace=True)
    c.update_and_fetch(*kvr([0]))
    c.update_and_fetch(*kvr([1, 2, 3, 4, 5]))  # oversized: 6 rows
    assert c.capacity == 6 and c.last_write_inplace is False
    assert c.trim(4) == 4
    assert c.last_write_inplace is False
    assert (c.offset, c.idx) == (2, 2) and window_of_ring(c) == (0, 1)
    c.update_and_fetch(*kvr([2]))
    assert c.last_write_inplace is True and window_of_ring(c) == (0, 1, 2)


def window_of_ring(c):
    from tests.test_impl_rotating import window_of

    return window_of(c)


def test_a_decode_that_sees_every_key_builds_no_positions():
    """Every small ring state (warm-up, a buffer grown to the window, the
    wrap point, wrapped, oversized) and window: when the decode's mask is
    all True (the spec matrix, built here first), make_mask(1) answers None
    without building the positions."""
    from kvspec.spec import rotating as sr

    def never(n):
        raise AssertionError("make_mask(1) built the positions")

    for W in range(1, 6):
        for K in range(W):
            for step in (1, 2, W):
                for history in ([1] * 8, [3, 1, 1, 4, 1, 1], [W + 2, 1, 1]):
                    c = RotatingKVCache(W, keep=K, step=step)
                    s = sr.new_cache(W, K, step)
                    token = 0
                    for n in history:
                        x = mx.zeros((1, 1, n, 2), mx.float16)
                        c.update_and_fetch(x, x)
                        _, s = sr.append(s, tuple(range(token, token + n)))
                        token += n
                        for window in range(1, W + 2):
                            sees_all = all(sr.make_mask_spec(s, 1, window)[0])
                            c._next_positions = never
                            if sees_all:
                                assert c.make_mask(1, window_size=window) is None, (W, K, step, history, window)
                            del c._next_positions


def test_to_quantized_keeps_the_ring_and_warns_once_naming_the_bits():
    import warnings

    c = RotatingKVCache(3)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert c.to_quantized() is c
        assert c.to_quantized(bits=8) is c
    assert only_warning(got, UserWarning) == (
        "to_quantized(bits=4): RotatingKVCache(max_size=3) is a sliding-window layer and keeps its rows "
        "unquantized (kv_bits applies to the full-attention layers; reported once per cache)")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"bits": 4.0}, "to_quantized: bits must be an integer, got 4.0"),
    ({"group_size": "64"}, "to_quantized: group_size must be an integer, got '64'"),
])
def test_to_quantized_refuses_a_non_integer_setting(kwargs, message):
    c = RotatingKVCache(3)
    with refused(InvalidArgumentError, message):
        c.to_quantized(**kwargs)


def test_merge_builds_the_batch_ring_of_impl_batch():
    pytest.importorskip("mlx_lm")
    from kvspec.impl.batch import batch_rotating_class

    a, b = RotatingKVCache(4, step=2), RotatingKVCache(4, step=2)
    a.update_and_fetch(*kvr([0, 1, 2]))
    b.update_and_fetch(*kvr([5]))
    got = RotatingKVCache.merge([a, b])
    want = batch_rotating_class().merge([a, b])
    assert type(got) is batch_rotating_class()
    assert np.array_equal(np.array(got.keys), np.array(want.keys))
    assert np.array_equal(np.array(got.values), np.array(want.values))


def test_from_mlx_lm_takes_an_empty_ring_and_the_default_step():
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import RotatingKVCache as LmRing

    c = RotatingKVCache.from_mlx_lm(LmRing(max_size=5, keep=2))
    assert (c.max_size, c.keep, c.step, c.offset, c.fetch()) == (5, 2, 256, 0, None)
    c = RotatingKVCache.from_mlx_lm(LmRing(max_size=5, keep=2), step=3)
    assert c.step == 3


def test_from_mlx_lm_takes_only_the_rows_mlx_lm_wrote():
    """mlx-lm grows its buffer ahead of its rows: the slots past its offset
    are not carried over."""
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import RotatingKVCache as LmRing

    lm = LmRing(max_size=8)
    for t in range(3):
        lm.update_and_fetch(*kvr([t]))
    assert lm.keys.shape[2] > 3
    c = RotatingKVCache.from_mlx_lm(lm)
    assert (c.offset, c.idx, c.capacity, c.step) == (3, 3, 3, 256) and window_of_ring(c) == (0, 1, 2)
