"""Unit tests of kvspec.impl.dense.KVCache beyond what the fuzzer compares."""

import copy

import mlx.core as mx
import numpy as np
import pytest

from kvspec.impl.dense import KVCache
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError


def rows(n, start=0, d=8, h=2):
    base = np.arange(start, start + n, dtype=np.float16)[None, None, :, None]
    return mx.array(np.broadcast_to(base, (1, h, n, d)).copy())


def fill(c, n, start=0):
    out = None
    for i in range(n):
        out = c.update_and_fetch(rows(1, start + i), rows(1, start + i))
    return out


def firsts(a):
    return [float(x) for x in np.array(a)[0, 0, :, 0]]


def test_inplace_write_really_aliases_the_buffer():
    c = KVCache("fp16", step=8, inplace=True)
    c.update_and_fetch(rows(2), rows(2))
    before = c.buffers.keys
    mx.eval(before)
    ptr = np.array(before, copy=False).ctypes.data
    c.update_and_fetch(rows(1, 2), rows(1, 2))
    assert c.last_write_inplace and c.buffers.keys is before
    assert np.array(c.buffers.keys, copy=False).ctypes.data == ptr


def test_copying_write_when_switch_off(monkeypatch):
    monkeypatch.setenv("KV_INPLACE_WRITE", "off")
    c = KVCache("fp16", step=8)
    assert c.inplace is False
    fill(c, 3)
    assert not c.last_write_inplace


def test_snapshot_is_isolated_from_later_writes_and_shares_memory():
    c = KVCache("fp16", step=8)
    fill(c, 3)
    snap = c.snapshot()
    fill(c, 3, 3)
    c.trim(4)
    fill(c, 2, 10)
    assert firsts(snap.fetch()[0]) == [0, 1, 2]
    assert firsts(c.fetch()[0]) == [0, 1, 10, 11]


def test_trim_is_logical_and_o1():
    c = KVCache("int8", step=4)
    c.update_and_fetch(rows(6), rows(6))
    buffers = c.buffers
    assert c.trim(3) == 3
    assert c.buffers is buffers and c.capacity == 8 and c.offset == 3


def test_regrow_after_trim_capacity():
    c = KVCache("fp16", step=4)
    c.update_and_fetch(rows(4), rows(4))
    c.trim(1)
    c.update_and_fetch(rows(2, 10), rows(2, 10))
    assert c.capacity == 7 and firsts(c.fetch()[0]) == [0, 1, 2, 10, 11]


def test_refused_append_changes_nothing():
    c = KVCache("fp16", step=4)
    fill(c, 2)
    state = (c.offset, c.capacity, c.buffers)
    with pytest.raises(InvalidArgumentError, match="append: keys head dim D must be 8"):
        c.update_and_fetch(rows(1, d=16), rows(1, d=16))
    with pytest.raises(InvalidArgumentError, match="rank 4"):
        c.update_and_fetch(mx.zeros((2, 8)), mx.zeros((2, 8)))
    with pytest.raises(InvalidArgumentError, match="float16, bfloat16 or float32"):
        c.update_and_fetch(mx.zeros((1, 2, 1, 8), dtype=mx.int32), mx.zeros((1, 2, 1, 8), dtype=mx.int32))
    with pytest.raises(InvalidArgumentError, match="keys and values must agree on rows S"):
        c.update_and_fetch(rows(1), rows(2))
    assert (c.offset, c.capacity, c.buffers) == state


def test_bad_arguments_name_the_argument():
    with pytest.raises(InvalidArgumentError, match=r"step must be in \[1, 1048576\]"):
        KVCache(step=0)
    with pytest.raises(UnsupportedOperationError, match="mode"):
        KVCache(mode="turbo4")
    c = KVCache()
    with pytest.raises(InvalidArgumentError, match="trim: n must be an integer"):
        c.trim(1.5)


def test_restore_refuses_malformed_snapshots_and_changes_nothing():
    c = KVCache("fp16", step=4)
    fill(c, 3)
    snap = c.snapshot()
    other = KVCache("int8", step=4)
    fill(other, 2)
    with pytest.raises(InvalidArgumentError, match="mode"):
        c.restore(other.snapshot())
    bad = copy.copy(snap)
    bad.offset = 9
    with pytest.raises(InvalidArgumentError, match="cursor out of range"):
        c.restore(bad)
    with pytest.raises(InvalidArgumentError, match="CacheSnapshot"):
        c.restore("nope")
    assert c.offset == 3 and firsts(c.fetch()[0]) == [0, 1, 2]


def test_install_refuses_non_empty_cache_and_keeps_handle():
    c = KVCache("fp16", step=4)
    fill(c, 3)
    h = c.detach()
    assert c.empty() and c.offset == 0
    fill(c, 1, 7)
    with pytest.raises(StateError, match="requires an empty cache"):
        c.install(h)
    assert firsts(h.fetch()[0]) == [0, 1, 2] and firsts(c.fetch()[0]) == [7]


def test_mlx_lm_protocol_round_trip():
    c = KVCache("int8", step=4)
    fill(c, 5)
    c2 = KVCache.from_state(c.state, c.meta_state)
    assert c2.offset == 5 and c2.is_trimmable() and c2.size() == 5 and not c2.empty()
    assert np.array_equal(np.array(c2.fetch()[0]), np.array(c.fetch()[0]))
    assert c.nbytes > 0 and KVCache().nbytes == 0
    assert c.make_mask(1) is None and c.make_mask(3) == "causal"
    m = np.array(c.make_mask(2, return_array=True))
    assert m.shape == (2, 7) and m[0].sum() == 6 and m[1].sum() == 7
    m = np.array(c.make_mask(2, window_size=3))
    assert m[0].sum() == 3 and m[1].sum() == 3


def test_state_never_aliases_future_writes():
    """mlx-lm's KVCache.state returns the buffer objects themselves when the
    buffer is exactly full; ours returns rows that later writes cannot reach."""
    c = KVCache("fp16", step=4)
    c.update_and_fetch(rows(4), rows(4))
    k, _ = c.state
    mx.eval(k)
    c.trim(2)
    fill(c, 2, 20)
    assert firsts(k) == [0, 1, 2, 3]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_int8_decode_after_a_prefill_on_the_copying_path_matches_the_oracle(dtype):
    """An Int8 decode after a prefill with the in-place switch off (the
    copying write: every array of the store, the scale sidecars included,
    goes through ``write_copy``): the whole window equals what the NumPy
    oracle (kvspec.fuzz.quant_ref, written from the rule, not from kvspec.impl.quant)
    says each row reads back as. K and V rows of very different
    magnitudes (K up to float16's edge), so K scales taken from the V rows,
    or V's from K's, show in the window."""
    from kvspec.fuzz.quant_ref import int8_oracle_host

    rng = np.random.default_rng(7)
    k_all = rng.standard_normal((2, 2, 5, 8)) * np.array([1e4, 3.0, 0.01, 6e4, 1.0])[None, None, :, None]
    v_all = rng.standard_normal((2, 2, 5, 4)) * np.array([0.5, 2e3, 7.0, 1e-3, 4e2])[None, None, :, None]
    k_all = np.clip(k_all, -65000.0, 65000.0)
    # a row at float16's edge (bfloat16's largest value below it): in float16 its read-back saturates
    k_all[..., 3, 0] = 65280.0 if dtype == mx.bfloat16 else 65504.0
    host = np.float16 if dtype == mx.float16 else np.float32

    def as_mx(a):
        return mx.array(a.astype(np.float32)).astype(dtype)

    c = KVCache(mode="int8", step=8, inplace=False)
    c.update_and_fetch(as_mx(k_all[:, :, :4]), as_mx(v_all[:, :, :4]))  # the prefill
    k, v = c.update_and_fetch(as_mx(k_all[:, :, 4:]), as_mx(v_all[:, :, 4:]))  # the decode step
    assert not c.last_write_inplace
    name = str(dtype).rsplit(".", 1)[-1]
    for got, rows_in in ((k, k_all), (v, v_all)):
        given = np.asarray(as_mx(rows_in).astype(mx.float32), dtype=host)  # the rows as handed in
        want = int8_oracle_host(given, name)
        assert got.dtype == dtype
        assert np.array_equal(np.asarray(got.astype(mx.float32)), want.astype(np.float32))
