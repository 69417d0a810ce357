"""mlx-lm protocol, copies and exact refusal messages of the implementation.

The differential harness compares refusal messages word for word with the
spec's for every op a trace can express; these tests pin the messages of the
refusals only the Python API can reach (wrong types, malformed snapshots),
and the protocol methods mlx-lm calls."""

import copy

import mlx.core as mx
import numpy as np
import pytest

from kvspec.impl.dense import KVCache
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError


def rows(n, start=0, d=4, h=1):
    base = np.arange(start, start + n, dtype=np.float16)[None, None, :, None]
    return mx.array(np.broadcast_to(base, (1, h, n, d)).copy())


def firsts(a):
    return [int(x) for x in np.array(a)[0, 0, :, 0]]


def decode(c, n, start=0):
    for t in range(start, start + n):
        c.update_and_fetch(rows(1, t), rows(1, t))


def message(fn, *args, **kwargs):
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return type(info.value), str(info.value)


# -- exact messages -----------------------------------------------------------------
def test_dense_argument_messages():
    c = KVCache("fp16", step=2)
    decode(c, 3)
    assert message(c.trim, 1.5) == (InvalidArgumentError, "trim: n must be an integer, got 1.5")
    assert message(c.trim, True) == (InvalidArgumentError, "trim: n must be an integer, got True")
    assert message(c.trim_to, "2") == (InvalidArgumentError, "trim_to: len must be an integer, got '2'")
    assert message(c.trim_front_keep_sink, 1, None) == (InvalidArgumentError, "trim_front: keep must be an integer, got None")
    assert message(c.trim_front_keep_sink, None) == (InvalidArgumentError, "trim_front: n must be an integer, got None")
    assert message(c.gather_positions, [0.5]) == (InvalidArgumentError, "gather_positions: positions must be an integer, got 0.5")
    assert message(c.gather_within_tail, "x", [0]) == (InvalidArgumentError, "gather_within_tail: tail_len must be an integer, got 'x'")
    assert message(c.gather_within_tail, 1, [None]) == (InvalidArgumentError, "gather_within_tail: kept must be an integer, got None")
    assert message(KVCache, step=0) == (InvalidArgumentError, "KVCache: step must be in [1, 1048576], got 0")
    assert message(KVCache, step=10**12) == (
        InvalidArgumentError, "KVCache: step must be in [1, 1048576], got 1000000000000")
    assert message(RotatingKVCache, 4, step=10**12) == (
        InvalidArgumentError, "RotatingKVCache: step must be in [1, 1048576], got 1000000000000")
    assert message(KVCache, step=2.0) == (InvalidArgumentError, "KVCache: step must be an integer, got 2.0")
    assert message(KVCache, mode="turbo4") == (
        UnsupportedOperationError, "KVCache: mode must be one of ('fp16', 'int8'), got 'turbo4'")
    assert c.offset == 3 and c.capacity == 4


def test_append_validation_messages():
    c = KVCache("fp16", step=2)
    decode(c, 1)
    assert message(c.update_and_fetch, [1], rows(1)) == (
        InvalidArgumentError, "append: keys must be an mx.array, got list")
    assert message(c.update_and_fetch, rows(1), mx.zeros((1, 4))) == (
        InvalidArgumentError, "append: values must have rank 4 [B, H, S, D], got shape (1, 4)")
    assert message(c.update_and_fetch, mx.zeros((1, 1, 1, 4), dtype=mx.int8), rows(1)) == (
        InvalidArgumentError, "append: keys dtype must be float16, bfloat16 or float32, got mlx.core.int8")
    assert message(c.update_and_fetch, rows(2), rows(1)) == (
        InvalidArgumentError, "append: keys and values must agree on rows S, got 2 and 1 (shapes (1, 1, 2, 4) and (1, 1, 1, 4))")
    assert message(c.update_and_fetch, rows(0), rows(0)) == (InvalidArgumentError, "append: n must be >= 1, got 0")
    assert message(c.update_and_fetch, rows(1, d=8), rows(1, d=8)) == (
        InvalidArgumentError, "append: keys head dim D must be 4 (the cache's), got 8 (shape (1, 1, 1, 8))")
    assert message(c.update_and_fetch, rows(1), rows(1, d=8)) == (
        InvalidArgumentError, "append: values head dim D must be 4 (the cache's), got 8 (shape (1, 1, 1, 8))")
    assert c.offset == 1 and firsts(c.fetch()[0]) == [0]


def test_restore_and_install_messages():
    c = KVCache("fp16", step=2)
    decode(c, 2)
    snap = c.snapshot()
    bad = copy.copy(snap)
    bad.live_start = 5
    assert message(c.restore, bad) == (
        InvalidArgumentError, "restore: cursor must satisfy 0 <= live_start <= offset, got live_start=5, offset=2")
    bad = copy.copy(snap)
    bad.buffers = None
    assert message(c.restore, bad) == (InvalidArgumentError, "restore: live_len 2 > 0 but no tensors")
    bad = copy.copy(snap)
    bad.buffers = snap.buffers.map(lambda a: a[0])
    assert message(c.restore, bad) == (InvalidArgumentError, "restore: keys must have rank 4, got shape (1, 2, 4)")
    bad = copy.copy(snap)
    bad.buffers = snap.buffers.map(lambda a: a.astype(mx.int32))
    assert message(c.restore, bad) == (
        InvalidArgumentError, "restore: keys dtype must be float16, bfloat16 or float32, got mlx.core.int32")
    bad = copy.copy(snap)
    bad.buffers = type(snap.buffers)(snap.buffers.keys, snap.buffers.values[:, :, :1, :])
    assert message(c.restore, bad) == (
        InvalidArgumentError, "restore: keys and values must agree on [B, H, T], got (1, 1, 2, 4) and (1, 1, 1, 4)")
    bad = copy.copy(snap)
    bad.buffers = type(snap.buffers)(snap.buffers.keys, snap.buffers.values, snap.buffers.keys[..., :1], None)
    assert message(c.restore, bad) == (InvalidArgumentError, "restore: scale sidecars must be present exactly in int8 mode")
    h = KVCache("fp16", step=2)
    assert message(h.install, snap) == (InvalidArgumentError, "install: expected a DetachedHandle, got CacheSnapshot")
    handle = c.detach()
    decode(c, 1, 9)
    assert message(c.install, handle) == (StateError, "install: requires an empty cache, got offset=1, live_len=1")
    assert firsts(c.fetch()[0]) == [9] and firsts(handle.fetch()[0]) == [0, 1]


def test_handle_trim_to_messages_and_effect():
    c = KVCache("fp16", step=4)
    decode(c, 3)
    h = c.detach()
    assert message(h.trim_to, 4) == (InvalidArgumentError, "handle_trim_to: len must satisfy 0 <= len <= offset (3), got 4")
    assert message(h.trim_to, -1) == (InvalidArgumentError, "handle_trim_to: len must satisfy 0 <= len <= offset (3), got -1")
    assert h.trim_to(3) == 0 and h.buffers.capacity == 4
    assert h.trim_to(1) == 2 and h.offset == 1 and h.buffers.capacity == 1
    assert h.trim_to(0) == 1 and h.buffers is None and h.fetch() is None


def test_rotating_messages():
    assert message(RotatingKVCache, 4, mode="int8") == (UnsupportedOperationError, "RotatingKVCache: mode must be 'fp16', got 'int8'")
    assert message(RotatingKVCache, 0) == (InvalidArgumentError, "RotatingKVCache: max_size must be >= 1, got 0")
    assert message(RotatingKVCache, 4, keep=-1) == (
        InvalidArgumentError, "RotatingKVCache: keep must satisfy 0 <= keep < max_size (4), got -1")
    assert message(RotatingKVCache, 4, step=0) == (InvalidArgumentError, "RotatingKVCache: step must be in [1, 1048576], got 0")
    assert message(RotatingKVCache, 4.0) == (InvalidArgumentError, "RotatingKVCache: max_size must be an integer, got 4.0")
    c = RotatingKVCache(4, keep=1, step=2)
    decode(c, 2)
    assert message(c.trim, "1") == (InvalidArgumentError, "trim: n must be an integer, got '1'")
    assert message(c.trim_to, 1.0) == (InvalidArgumentError, "trim_to: len must be an integer, got 1.0")
    assert message(c.trim_to, 3) == (InvalidArgumentError, "trim_to: len must satisfy 0 <= len <= offset (2), got 3")
    assert message(c.restore, "s") == (InvalidArgumentError, "restore: expected a RingSnapshot, got str")
    other = RotatingKVCache(5, keep=1)
    assert message(c.restore, other.snapshot()) == (
        InvalidArgumentError, "restore: (max_size, keep) must be (4, 1), got (5, 1)")
    snap = c.snapshot()
    snap.idx = 3
    assert message(c.restore, snap) == (InvalidArgumentError, "restore: cursor must satisfy 0 <= idx <= offset, got idx=3, offset=2")
    assert message(c.update_and_fetch, rows(1, d=8), rows(1, d=8)) == (
        InvalidArgumentError, "append: keys head dim D must be 4 (the cache's), got 8 (shape (1, 1, 1, 8))")
    assert message(c.update_and_fetch, rows(1), rows(1, d=8)) == (
        InvalidArgumentError, "append: values head dim D must be 4 (the cache's), got 8 (shape (1, 1, 1, 8))")
    assert c.offset == 2 and firsts(c.fetch()[0]) == [0, 1]


# -- protocol -------------------------------------------------------------------------
def test_dense_from_state_without_meta_state():
    c = KVCache("fp16", step=4)
    decode(c, 3)
    c2 = KVCache.from_state(c.state)
    assert (c2.mode, c2.step, c2.offset, c2.live_start) == ("fp16", 256, 3, 0)
    assert firsts(c2.fetch()[0]) == [0, 1, 2]
    empty = KVCache.from_state(())
    assert empty.offset == 0 and empty.empty() and empty.fetch() is None and empty.state == ()


def test_dense_meta_state_round_trip_after_front_trim():
    c = KVCache("int8", step=3)
    decode(c, 5)
    c.trim_front(2)
    assert c.meta_state == ("int8", "3", "5", "2")
    c2 = KVCache.from_state(c.state, c.meta_state)
    assert (c2.mode, c2.step, c2.offset, c2.live_start, c2.live_len) == ("int8", 3, 5, 2, 3)
    assert np.array_equal(np.array(c2.fetch()[0]), np.array(c.fetch()[0]))
    assert c.size() == 5 and c.nbytes == sum(a.nbytes for a in c.buffers.arrays())


def test_trim_front_is_keep_zero():
    a, b = KVCache("fp16", step=2), KVCache("fp16", step=2)
    decode(a, 4)
    decode(b, 4)
    assert a.trim_front(2) == b.trim_front_keep_sink(2, 0) == 2
    assert firsts(a.fetch()[0]) == firsts(b.fetch()[0]) == [2, 3]


@pytest.mark.parametrize("make", [lambda: KVCache("fp16", step=8), lambda: RotatingKVCache(8, step=8)])
def test_copies_are_holders_not_owners(make):
    c = make()
    decode(c, 3)
    assert c._marker is not None
    for dup in (copy.copy(c), copy.deepcopy(c)):
        assert dup._marker is None and c._marker is not None
        assert firsts(dup.fetch()[0]) == [0, 1, 2]
    shallow, deep = copy.copy(c), copy.deepcopy(c)
    assert shallow.__dict__.keys() == deep.__dict__.keys() == c.__dict__.keys()
    decode(c, 1, 7)  # in place: above every copy's rows
    assert c.last_write_inplace
    decode(deep, 1, 8)  # the copy's first write copies
    assert not deep.last_write_inplace
    assert firsts(c.fetch()[0]) == [0, 1, 2, 7] and firsts(deep.fetch()[0]) == [0, 1, 2, 8]
    assert firsts(shallow.fetch()[0]) == [0, 1, 2]
    pair = copy.deepcopy([c, c])
    assert pair[0] is pair[1] and pair[0] is not c
    # copy.copy shares the cache's fields; deepcopy makes new handles (to the
    # same memory) and keeps references inside one deepcopy consistent
    first = lambda x: getattr(x, "buffers", None) or x.keys
    assert first(copy.copy(c)) is first(c) and first(copy.deepcopy(c)) is not first(c)
    both = copy.deepcopy([c, first(c)])
    assert first(both[0]) is both[1]


def test_view_of_unknown_name():
    from kvspec.spec import dense as sd

    assert message(sd.view_of, sd.new_world(), "nope") == (StateError, "expect: no snapshot or handle named 'nope'")


def test_chronological_slots():
    from kvspec.impl.rotating import chronological_slots

    assert chronological_slots(5, 3, 1, True) == [0, 3, 4, 1, 2]
    assert chronological_slots(5, 3, 1, False) == [0, 1, 2]


def test_rotating_protocol():
    c = RotatingKVCache(4, keep=1, step=3)
    assert c.empty() and c.nbytes == 0 and c.state == () and c.fetch() is None
    decode(c, 6)
    assert not c.empty() and c.size() == 4
    c2 = RotatingKVCache.from_state(c.state, c.meta_state)
    assert (c2.keep, c2.max_size, c2.step, c2.offset, c2.idx) == (1, 4, 3, 6, 3)
    c.update_and_fetch(rows(1, 6), rows(1, 6))
    c2.update_and_fetch(rows(1, 6), rows(1, 6))
    assert firsts(c2.fetch()[0]) == firsts(c.fetch()[0])
    c3 = RotatingKVCache(4)
    c3.state = ()
    assert c3.empty()


# -- malformed state and snapshots are refused and change nothing ---------------------------
def test_dense_from_state_refusals():
    k = mx.zeros((1, 1, 3, 4), dtype=mx.float16)
    cases = [
        ((k, k), ("fp16", "4", "10", "0"), "from_state: cursor out of range: live_len 10 > capacity 3"),
        ((k, k), ("fp16", "4", "3", "5"), "from_state: cursor must satisfy 0 <= live_start <= offset, got live_start=5, offset=3"),
        ((k, k), ("int8", "4", "3", "0"), "from_state: state must hold 4 arrays in mode int8, got 2"),
        ((k, k), ("fp16", "0", "3", "0"), "KVCache: step must be in [1, 1048576], got 0"),
        ((k.astype(mx.int32),) * 2, ("fp16", "4", "3", "0"), "from_state: keys dtype must be float16, bfloat16 or float32, got mlx.core.int32"),
        ((k, k), ("fp16", "4", "x", "0"), "from_state: meta_state must hold integers, got ('fp16', '4', 'x', '0')"),
        ((k, k), ("fp16", "4", "2", "0"), "from_state: state must hold exactly the live rows, got 3 rows for live_len 2"),
    ]
    for state, meta, text in cases:
        assert message(KVCache.from_state, state, meta) == (InvalidArgumentError, text)
    c = KVCache()
    c.state = (k, k)
    with pytest.raises(InvalidArgumentError, match="live_len 9 > capacity 3"):
        c.meta_state = ("fp16", "4", "9", "0")
    assert (c.offset, c.live_len, c.capacity) == (3, 3, 3)


def test_rotating_restore_and_state_refusals():
    from kvspec.impl.rotating import RingSnapshot

    c = RotatingKVCache(4, keep=1, step=1)
    decode(c, 5)
    good = c.snapshot()
    before = (c.offset, c.idx, firsts(c.fetch()[0]))
    cases = [
        (RingSnapshot(good.keys.astype(mx.int32), good.values, 5, 2, 4, 1), "restore: keys dtype must be float16, bfloat16 or float32, got mlx.core.int32"),
        (RingSnapshot(good.keys, good.values[:, :, :3], 5, 2, 4, 1),
         "restore: keys and values must agree on [B, H, T], got (1, 1, 4, 4) and (1, 1, 3, 4)"),
        (RingSnapshot(good.keys, good.values, 9, 9, 4, 1),
         "restore: counters do not fit the ring: offset=9, idx=9, capacity=4, max_size=4, keep=1"),
        (RingSnapshot(good.keys, good.values, 7, 0, 4, 1),
         "restore: counters do not fit the ring: offset=7, idx=0, capacity=4, max_size=4, keep=1"),
        (RingSnapshot(None, good.values, 5, 2, 4, 1), "restore: keys and values must both be present or both absent"),
        (RingSnapshot(None, None, 5, 5, 4, 1), "restore: offset 5 > 0 but no tensors"),
        (RingSnapshot(good.keys[0], good.values[0], 5, 2, 4, 1), "restore: keys must have rank 4, got shape (1, 4, 4)"),
        (RingSnapshot(good.keys, good.values[0], 5, 2, 4, 1), "restore: values must have rank 4, got shape (1, 4, 4)"),
        (RingSnapshot("k", good.values, 5, 2, 4, 1), "restore: keys must be an mx.array, got str"),
        (RingSnapshot(good.keys, good.values, 5, 2.5, 4, 1), "restore: idx must be an integer, got 2.5"),
        (RingSnapshot(None, None, 1, 1, 4, 1), "restore: offset 1 > 0 but no tensors"),
        # wrapped with the cursor on the sinks: no ring writes and stops there
        (RingSnapshot(good.keys, good.values, 5, 1, 4, 1),
         "restore: counters do not fit the ring: offset=5, idx=1, capacity=4, max_size=4, keep=1"),
        # wrapped, but the buffer is smaller than the window
        (RingSnapshot(good.keys[:, :, :3], good.values[:, :, :3], 5, 2, 4, 1),
         "restore: counters do not fit the ring: offset=5, idx=2, capacity=3, max_size=4, keep=1"),
        # oversized (a multi-row append's result) with the cursor not at its end
        (RingSnapshot(mx.concatenate([good.keys, good.keys], axis=2), mx.concatenate([good.values, good.values], axis=2),
                      8, 7, 4, 1),
         "restore: counters do not fit the ring: offset=8, idx=7, capacity=8, max_size=4, keep=1"),
        (RingSnapshot(good.keys, good.values, 5.0, 2, 4, 1), "restore: offset must be an integer, got 5.0"),
    ]
    for snap, text in cases:
        assert message(c.restore, snap) == (InvalidArgumentError, text)
    assert (c.offset, c.idx, firsts(c.fetch()[0])) == before
    with pytest.raises(InvalidArgumentError, match="cursor must satisfy 0 <= idx <= offset, got idx=-2"):
        RotatingKVCache.from_state(c.state, ("1", "4", "1", "5", "-2"))
    assert message(RotatingKVCache.from_state, c.state, ("1", "4", "1", "5")) == (
        InvalidArgumentError,
        ("from_state: meta_state must be five to seven integers (keep, max_size, step, offset, idx[, undo[, strict 0 or 1]]), "
         "got ('1', '4', '1', '5')"))
    assert message(RotatingKVCache.from_state, (c.state[0],), ("1", "4", "1", "5", "2")) == (
        InvalidArgumentError, "from_state: state must hold (keys, values), got 1 arrays")
    assert message(RotatingKVCache.from_state, (c.state[0], None), ("1", "4", "1", "5", "2")) == (
        InvalidArgumentError, "from_state: values must be an mx.array, got NoneType")
    with pytest.raises(InvalidArgumentError, match=r"^meta_state: meta_state must be five to seven integers"):
        c.meta_state = ("1", "4")
    with pytest.raises(InvalidArgumentError, match="state: keys and values must share a dtype"):
        c.state = (c.state[0].astype(mx.float32), c.state[1])
    assert (c.offset, c.idx, firsts(c.fetch()[0])) == before


def test_small_api_refusals():
    c = KVCache("fp16", step=2)
    decode(c, 3)
    assert message(c.gather_positions, None) == (InvalidArgumentError, "gather_positions: positions must be a list of integers, got NoneType")
    assert message(c.gather_within_tail, 2, None) == (InvalidArgumentError, "gather_within_tail: kept must be a list of integers, got NoneType")
    assert message(c.make_mask, 0) == (InvalidArgumentError, "make_mask: N must be >= 1, got 0")
    assert message(RotatingKVCache(4).make_mask, -1) == (InvalidArgumentError, "make_mask: N must be >= 1, got -1")
    assert message(KVCache, inplace="0")[0] is InvalidArgumentError
    h = c.detach()
    c.install(h)
    other = KVCache("fp16", step=2)
    assert message(other.install, h) == (StateError, "install: the handle was already installed")
    assert firsts(c.fetch()[0]) == [0, 1, 2]


def test_rotating_argument_messages_and_defaults():
    assert message(RotatingKVCache, 4, keep="1") == (InvalidArgumentError, "RotatingKVCache: keep must be an integer, got '1'")
    assert message(RotatingKVCache, 4, step=None) == (InvalidArgumentError, "RotatingKVCache: step must be an integer, got None")
    c = RotatingKVCache(4)
    assert (c.step, c.keep, c.mode, c.last_write_inplace) == (256, 0, "fp16", False)
    assert message(c.update_and_fetch, rows(1), mx.zeros((1, 4))) == (
        InvalidArgumentError, "append: values must have rank 4 [B, H, S, D], got shape (1, 4)")
    from kvspec.spec import rotating as sr
    from kvspec.spec.dense import Mode

    assert sr.new_cache(4).step == 256 and sr.new_cache(4, mode="int8").mode is Mode.INT8
    assert message(sr.new_cache, 4, step=0) == (InvalidArgumentError, "step: must be in [1, 1048576], got 0")
    assert message(sr.new_cache, 4, step=2**20 + 1) == (InvalidArgumentError, "step: must be in [1, 1048576], got 1048577")
    assert message(sr.append, sr.new_cache(4), ()) == (InvalidArgumentError, "append: n must be >= 1, got 0")
    assert str(sr.unsupported("gather_positions")) == "gather_positions: not an operation of the rotating cache"


def test_one_slot_ring():
    """W = 1: every decode overwrites the only slot; spec and impl agree."""
    from kvspec.spec import rotating as sr

    c, s = RotatingKVCache(1, step=1), sr.new_cache(1, step=1)
    for t in range(4):
        c.update_and_fetch(rows(1, t), rows(1, t))
        _, s = sr.append(s, (t,))
        assert firsts(c.fetch()[0]) == list(s.window()) == [t]
    k, _ = c.update_and_fetch(rows(3, 10), rows(3, 10))
    _, s = sr.append(s, (10, 11, 12))
    assert firsts(k) == list(s.window()) == [10, 11, 12]


def test_handle_messages_and_spec_gather_refusals():
    c = KVCache("fp16", step=2)
    decode(c, 2)
    h = c.detach()
    assert message(h.trim_to, 1.5) == (InvalidArgumentError, "handle_trim_to: len must be an integer, got 1.5")
    bad = copy.copy(h)
    bad.buffers = type(h.buffers)(h.buffers.keys, h.buffers.values.astype(mx.float32))
    assert message(c.restore, bad) == (
        InvalidArgumentError, "restore: keys and values must share a dtype, got mlx.core.float16 and mlx.core.float32")
    assert message(c.restore, None) == (InvalidArgumentError, "restore: expected a CacheSnapshot, got NoneType")
    from kvspec.spec import dense as sd

    delegated = sd.append(sd.new_cache("turbo4delegated", 2), (0, 1))[1]
    assert message(sd.gather_within_tail, delegated, 1, (0,)) == (
        UnsupportedOperationError, "gather_within_tail: not supported in mode turbo4delegated")


def test_spec_defaults_and_unreachable_refusals():
    """Defaults and refusals no trace can express (the schema requires n >= 1;
    no implemented mode is a Turbo mode)."""
    from kvspec.spec import dense as sd
    from kvspec.spec import rotating as sr

    assert sd.new_cache().step == 256 and sd.new_world().cache.inplace is True and KVCache().step == 256
    assert sd.new_world().cache.step == 256 and sd.new_world().cache.mode is sd.Mode.FP16
    assert message(sd.new_cache, step=0) == (InvalidArgumentError, "step: must be an integer in [1, 1048576], got 0")
    assert message(sd.new_cache, step="4") == (InvalidArgumentError, "step: must be an integer in [1, 1048576], got '4'")
    assert message(sd.append, sd.new_cache(), ()) == (InvalidArgumentError, "append: n must be >= 1, got 0")
    assert message(sd.w_append, sd.new_world(), 0) == (InvalidArgumentError, "append: n must be >= 1, got 0")
    assert message(sr.w_append, sr.RotatingWorld(sr.new_cache(4)), 0) == (InvalidArgumentError, "append: n must be >= 1, got 0")
    delegated = sd.append(sd.new_cache("turbo4delegated", 2), (0, 1))[1]
    assert message(sd.gather_positions, delegated, (0,)) == (
        UnsupportedOperationError, "gather_positions: not supported in mode turbo4delegated")
    c = sd.append(sd.new_cache(step=4), (0, 1, 2))[1]
    assert sd.trim_front_keep_sink(c, 1)[1].window() == (1, 2)


def test_spec_turbo_paths_cut_physically():
    from kvspec.spec import dense as sd

    c = sd.append(sd.new_cache("turbo4", step=4), (0, 1, 2))[1]
    n, t = sd.trim(c, 2)
    assert n == 2 and t.capacity == 1 and t.buffer.ident != c.buffer.ident
    n, g = sd.gather_within_tail(c, 2, (1,))
    assert n == 2 and g.capacity == 2 and g.window() == (0, 2)
    n, g = sd.gather_within_tail(sd.append(sd.new_cache(step=4), (0, 1, 2))[1], 2, (1,))
    assert g.capacity == 4


def test_install_and_append_messages_name_the_shapes():
    c = KVCache("fp16", step=2)
    c.update_and_fetch(rows(1, h=2), rows(1, h=2))
    assert message(c.update_and_fetch, rows(1, d=8, h=2), rows(1, d=8, h=2)) == (
        InvalidArgumentError, "append: keys head dim D must be 4 (the cache's), got 8 (shape (1, 2, 1, 8))")
    other = KVCache("int8", step=2)
    decode(other, 1)
    h = other.detach()
    assert message(KVCache("fp16").install, h) == (InvalidArgumentError, "install: mode must be 'fp16', got 'int8'")


def test_dense_holder_field_messages_and_consumed_handle():
    c = KVCache("fp16", step=2)
    decode(c, 3)
    c.trim_front(1)
    snap = c.snapshot()
    assert message(c.restore, "s") == (InvalidArgumentError, "restore: expected a CacheSnapshot, got str")
    bad = copy.copy(snap)
    bad.offset = 3.0
    assert message(c.restore, bad) == (InvalidArgumentError, "restore: offset must be an integer, got 3.0")
    bad = copy.copy(snap)
    bad.live_start = "1"
    assert message(c.restore, bad) == (InvalidArgumentError, "restore: live_start must be an integer, got '1'")
    bad = copy.copy(snap)
    bad.buffers = type(snap.buffers)(np.zeros((1, 1, 4, 4), np.float16), snap.buffers.values)
    assert message(c.restore, bad) == (InvalidArgumentError, "restore: keys must be an mx.array, got ndarray")
    h = c.detach()
    h.live_start = None
    assert message(KVCache("fp16").install, h) == (InvalidArgumentError, "install: live_start must be an integer, got None")
    h.live_start = 1
    d = KVCache("fp16", step=2)
    d.install(h)
    # the handle is emptied: no tensors, offset and live_start 0
    assert (h.consumed, h.buffers, h.offset, h.live_start, h.fetch()) == (True, None, 0, 0, None)
    assert (d.offset, d.live_start, firsts(d.fetch()[0])) == (3, 1, [1, 2])
    assert KVCache().last_write_inplace is False


def test_dense_state_round_trip_keeps_keys_and_values_apart():
    c = KVCache("fp16", step=2)
    for t in range(3):
        c.update_and_fetch(rows(1, t), rows(1, 10 + t))
    for meta in (None, c.meta_state):
        c2 = KVCache.from_state(c.state, meta)
        k, v = c2.fetch()
        assert firsts(k) == [0, 1, 2] and firsts(v) == [10, 11, 12]
    q = KVCache("int8", step=2)
    for t in range(3):
        q.update_and_fetch(rows(1, t), rows(1, 10 + t))
    q2 = KVCache.from_state(q.state, q.meta_state)
    assert [np.array(a).tolist() for a in q2.fetch()] == [np.array(a).tolist() for a in q.fetch()]
    k3 = mx.zeros((1, 3, 4), dtype=mx.float16)
    assert message(KVCache.from_state, (k3, k3)) == (InvalidArgumentError, "from_state: keys must have rank 4, got shape (1, 3, 4)")
    assert message(KVCache.from_state, (c.state[0], None)) == (InvalidArgumentError, "from_state: values must be an mx.array, got NoneType")
    assert message(KVCache.from_state, c.state, ("fp16", "2", "3")) == (
        InvalidArgumentError, ("from_state: meta_state must be (mode, step, offset, live_start), or for int8 "
        "(mode, step, offset, live_start, dtype), got ('fp16', '2', '3')"))
    assert message(KVCache.from_state, c.state, "fp16") == (
        InvalidArgumentError, ("from_state: meta_state must be (mode, step, offset, live_start), or for int8 "
        "(mode, step, offset, live_start, dtype), got 'fp16'"))
    before = (c.offset, firsts(c.fetch()[0]))
    with pytest.raises(InvalidArgumentError, match=r"^state: keys must have rank 4"):
        c.state = (k3, k3)
    with pytest.raises(InvalidArgumentError, match=r"^meta_state: meta_state must hold integers"):
        c.meta_state = ("fp16", "2", "x", "0")
    assert (c.offset, firsts(c.fetch()[0])) == before


def test_make_mask_argument_messages():
    for c in (KVCache("fp16"), RotatingKVCache(4)):
        assert message(c.make_mask, 1.5) == (InvalidArgumentError, "make_mask: N must be an integer, got 1.5")
    assert message(KVCache().gather_positions, 5) == (InvalidArgumentError, "gather_positions: positions must be a list of integers, got int")
    assert message(KVCache().install, None) == (InvalidArgumentError, "install: expected a DetachedHandle, got NoneType")


def test_restore_accepts_every_shape_a_ring_can_take():
    """Warm-up (capacity below the window), full but not wrapped (capacity
    reached early through a large step), wrapped, and oversized (after a
    multi-row append) snapshots all restore, and reads agree."""
    for step, n, prefill in ((2, 3, 0), (4, 2, 0), (1, 6, 0), (1, 2, 5)):
        c = RotatingKVCache(4, keep=1, step=step)
        decode(c, n)
        if prefill:
            c.update_and_fetch(rows(prefill, 50), rows(prefill, 50))
        snap = c.snapshot()
        r = RotatingKVCache(4, keep=1, step=step)
        r.restore(snap)
        assert (r.offset, r.idx, r.capacity) == (c.offset, c.idx, c.capacity)
        assert firsts(r.fetch()[0]) == firsts(c.fetch()[0])


@pytest.mark.parametrize("make", [lambda: KVCache("fp16", step=4), lambda: RotatingKVCache(4, step=4)])
def test_inplace_write_touches_exactly_its_rows(make):
    """Warm-up: the second decode goes in place; the buffer's rows past the
    written ones are still the zeros growth put there."""
    c = make()
    decode(c, 2, start=1)
    assert c.last_write_inplace
    raw = c.buffers.keys if isinstance(c, KVCache) else c.keys
    assert firsts(raw) == [1, 2, 0, 0]


def test_more_argument_messages():
    assert message(KVCache, inplace="0") == (
        InvalidArgumentError, "KVCache: inplace must be True, False or None (read KV_INPLACE_WRITE), got '0'")
    c = RotatingKVCache(4, keep=1, step=1)
    decode(c, 5)
    assert message(RotatingKVCache.from_state, (None, c.state[1]), c.meta_state) == (
        InvalidArgumentError, "from_state: keys must be an mx.array, got NoneType")
    assert message(RotatingKVCache.from_state, c.state, ("1", "4", "1", "5", "-2")) == (
        InvalidArgumentError, "from_state: cursor must satisfy 0 <= idx <= offset, got idx=-2, offset=5")


def test_int8_scales_and_state_containers_are_validated():
    q = KVCache("int8", step=2)
    decode(q, 3)
    k, ks, v, vs = q.state
    meta = q.meta_state
    cases = [
        ((k, ks[:, :, :, 0], v, vs), "from_state: key_scales must have rank 4, got shape (1, 1, 3)"),
        ((k, ks, v, list(vs.tolist())), "from_state: value_scales must be an mx.array, got list"),
        ((k, ks.astype(mx.float32), v, vs),
         "from_state: key_scales must be float16 of shape [B, H, T, 1] = (1, 1, 3, 1), got mlx.core.float32 (1, 1, 3, 1)"),
        ((k, ks, v, vs[:, :, :2]),
         "from_state: value_scales must be float16 of shape [B, H, T, 1] = (1, 1, 3, 1), got mlx.core.float16 (1, 1, 2, 1)"),
    ]
    for state, text in cases:
        assert message(KVCache.from_state, state, meta) == (InvalidArgumentError, text)
    assert message(KVCache.from_state, k, meta) == (
        InvalidArgumentError, "from_state: state must be a tuple of 4 arrays (or empty), got array")
    assert message(RotatingKVCache.from_state, 5, ("0", "4", "1", "0", "0")) == (
        InvalidArgumentError, "from_state: state must be a tuple (keys, values) (or empty), got int")
    before = (q.offset, q.step, q.capacity)
    assert message(setattr, q, "meta_state", None) == (
        InvalidArgumentError, "meta_state: meta_state must be (mode, step, offset, live_start), got None")
    assert (q.offset, q.step, q.capacity) == before
    assert np.array_equal(np.array(KVCache.from_state(q.state, meta).fetch()[0]), np.array(q.fetch()[0]))


def test_rotating_meta_state_refusals_change_nothing():
    """Well-formed meta_state whose counters do not fit the loaded rows is
    refused by the setter with the ring as it was (every field, the rows):
    only a malformed tuple was tested, which fails before any counter is
    read, so a setter that moved offset/idx before the check passed."""
    c = RotatingKVCache(4, keep=1, step=1, undo=2)
    decode(c, 5)
    def fields():
        return (c.keep, c.max_size, c.step, c.offset, c.idx, c.undo, firsts(c.fetch()[0]), c.trimmable_rows())
    before = fields()
    bad = [
        ("1", "4", "1", "9", "7"),       # idx > capacity
        ("1", "4", "1", "2", "3"),       # idx > offset
        ("1", "4", "1", "6", "1"),       # wrapped with the cursor on the sinks
        ("1", "4", "1", "5", "-1"),      # negative cursor
        ("1", "4", "1", "5", "2", "-1"),  # negative undo depth
        ("4", "4", "1", "5", "2"),       # keep >= max_size
        ("1", "8", "1", "5", "2"),       # wrapped ring whose capacity is below max_size
    ]
    for meta in bad:
        with pytest.raises(InvalidArgumentError):
            c.meta_state = meta
        assert fields() == before, meta


@pytest.mark.parametrize("make", [lambda: KVCache("fp16", step=8), lambda: RotatingKVCache(8, step=8)])
def test_the_ownership_marker_holds_its_buffers_not_their_ids(make):
    """The marker names the very buffer objects of the cache's last write and
    keeps them alive (issue 47 (a)): a marker keyed by ``id()`` lets those
    objects die, and a later buffer allocated at the same address would pass
    the ownership check it never earned."""
    c = make()
    decode(c, 3)
    m = c._marker
    held = m.arrays if hasattr(m, "arrays") else m[:2]
    current = (c.buffers.keys, c.buffers.values) if hasattr(c, "buffers") else (c.keys, c.values)
    assert all(isinstance(a, mx.array) for a in held), "the marker must hold the arrays, not their identities"
    assert held[0] is current[0] and held[1] is current[1]
    decode(c, 1, 7)
    assert c.last_write_inplace
    m = c._marker
    held = m.arrays if hasattr(m, "arrays") else m[:2]
    current = (c.buffers.keys, c.buffers.values) if hasattr(c, "buffers") else (c.keys, c.values)
    assert held[0] is current[0] and held[1] is current[1]
