"""Edges of kvspec.impl.dense: the one-pass decode checks against the general ones,
exact refusals (the message names the argument and the rule), boundary
values and the mlx-lm hooks (``to_quantized``, ``merge``, the foreign-save
refusal)."""

import copy
import re
import sys
import types
import warnings

import mlx.core as mx
import numpy as np
import pytest

import kvspec.impl.dense as D
from kvspec.impl import write as W
from kvspec.impl.dense import (
    KVCache,
    _check_rows,
    _Marker,
    decode_pair_rows,
    share,
    write_rows_copy,
    write_rows_inplace,
)
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError


def pair(b=2, h=3, s=1, dk=4, dv=5, start=0.0, dtype=mx.float16):
    """A K/V pair ``[b, h, s, dk]`` / ``[b, h, s, dv]``; row ``i`` holds
    ``start + i`` (values: its negation)."""
    base = np.arange(s, dtype=np.float32)[None, None, :, None] + start
    k = np.broadcast_to(base, (b, h, s, dk)).copy()
    v = -np.broadcast_to(base, (b, h, s, dv)).copy()
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def firsts(a):
    return [float(x) for x in np.array(a.astype(mx.float32))[0, 0, :, 0]]


class NotAnArray:
    """Has an mx.array's ``shape`` and ``dtype`` but is not one."""

    def __init__(self, shape, dtype=mx.float16):
        self.shape, self.dtype = list(shape), dtype


# -- the one-pass checks of the decode path ----------------------------------

@pytest.mark.parametrize("s", [1, 2])
def test_decode_pair_rows_accepts_a_pair_that_matches_the_cache(s):
    """B, H, S, Dk, Dv and the cached capacity all different, so an index
    read off by one axis shows."""
    bk, bv = pair(b=2, h=3, s=8, dk=4, dv=5)
    k, v = pair(b=2, h=3, s=s, dk=4, dv=5)
    assert decode_pair_rows(k, v, bk, bv) == s


def test_decode_pair_rows_accepts_keys_of_head_dim_0():
    """No rule bounds the head dims: keys ``[B, H, 1, 0]`` are a valid row."""
    c = KVCache(step=4)
    c.update_and_fetch(mx.zeros((1, 2, 2, 0), dtype=mx.float16), mx.zeros((1, 2, 2, 3), dtype=mx.float16))
    k, v = mx.zeros((1, 2, 1, 0), dtype=mx.float16), mx.ones((1, 2, 1, 3), dtype=mx.float16)
    assert decode_pair_rows(k, v, c.buffers.keys, c.buffers.values) == 1
    got_k, got_v = c.update_and_fetch(k, v)
    assert got_k.shape == (1, 2, 3, 0) and firsts(got_v) == [0, 0, 1]


@pytest.mark.parametrize("which", ["batch", "heads", "kdim", "vdim", "rows", "dtype", "cache dtype"])
def test_decode_pair_rows_is_zero_for_a_pair_any_rule_refuses(which):
    bk, bv = pair(b=2, h=3, s=8, dk=4, dv=5)
    k, v = pair(b=2, h=3, s=1, dk=4, dv=5)
    if which == "batch":
        k, v = pair(b=1, h=3, s=1, dk=4, dv=5)
    elif which == "heads":
        k, v = pair(b=2, h=2, s=1, dk=4, dv=5)
    elif which == "kdim":
        k = pair(b=2, h=3, s=1, dk=5, dv=5)[0]
    elif which == "vdim":
        v = pair(b=2, h=3, s=1, dk=4, dv=4)[1]
    elif which == "rows":
        v = pair(b=2, h=3, s=2, dk=4, dv=5)[1]
    elif which == "dtype":
        v = v.astype(mx.float32)
    else:
        k, v = k.astype(mx.float32), v.astype(mx.float32)
    assert decode_pair_rows(k, v, bk, bv) == 0


def test_decode_pair_rows_is_zero_for_what_is_not_an_mx_array():
    bk, bv = pair(s=8)
    k, v = pair()
    assert decode_pair_rows(NotAnArray(k.shape), v, bk, bv) == 0
    assert decode_pair_rows(k, NotAnArray(v.shape), bk, bv) == 0


def test_check_rows_returns_the_rows_of_a_valid_pair():
    for s in (1, 3):
        k, v = pair(b=2, h=3, s=s, dk=4, dv=5)
        assert _check_rows("append", k, v) == s


def test_check_rows_refuses_values_that_are_not_an_mx_array_even_shaped_like_one():
    k, _ = pair(b=1, h=2, s=1, dk=4, dv=4)
    with pytest.raises(InvalidArgumentError, match=re.escape("append: values must be an mx.array, got NotAnArray")):
        _check_rows("append", k, NotAnArray((1, 2, 1, 4)))
    with pytest.raises(InvalidArgumentError, match=re.escape("append: keys must be an mx.array, got NotAnArray")):
        _check_rows("append", NotAnArray((1, 2, 1, 4)), k)


@pytest.mark.parametrize("which", ["keys", "values"])
@pytest.mark.parametrize("shape", [(1, 2, 1), (1, 2, 1, 4, 1)])
def test_check_rows_refuses_a_rank_other_than_4_beside_a_rank_4_partner(which, shape):
    good = mx.zeros((1, 2, 1, 4), dtype=mx.float16)
    bad = mx.zeros(shape, dtype=mx.float16)
    k, v = (bad, good) if which == "keys" else (good, bad)
    with pytest.raises(InvalidArgumentError,
                       match=re.escape(f"append: {which} must have rank 4 [B, H, S, D], got shape {shape}")):
        _check_rows("append", k, v)


@pytest.mark.parametrize("kshape,vshape", [((1, 1, 2, 3), (1, 1, 3, 5)), ((1, 1, 2, 4), (1, 1, 3, 2))])
def test_check_rows_refuses_rows_that_disagree_even_when_a_head_dim_equals_the_other_rows(kshape, vshape):
    k, v = mx.zeros(kshape, dtype=mx.float16), mx.zeros(vshape, dtype=mx.float16)
    with pytest.raises(InvalidArgumentError, match=re.escape(
            f"append: keys and values must agree on rows S, got {kshape[2]} and {vshape[2]} "
            f"(shapes {kshape} and {vshape})")):
        _check_rows("append", k, v)


def test_check_rows_refuses_zero_rows():
    k, v = mx.zeros((1, 2, 0, 4), dtype=mx.float16), mx.zeros((1, 2, 0, 3), dtype=mx.float16)
    with pytest.raises(InvalidArgumentError, match=re.escape("append: n must be >= 1, got 0")):
        _check_rows("append", k, v)


def _no_general_path(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a valid decode step took the general path")

    monkeypatch.setattr(D, "_check_rows", refuse)
    monkeypatch.setattr(KVCache, "_check_compatible", refuse)
    monkeypatch.setattr(KVCache, "_grow", refuse)


@pytest.mark.parametrize("inplace", [True, False])
def test_a_decode_step_with_room_takes_the_one_pass_path_up_to_a_full_buffer(inplace, monkeypatch):
    """The Fp16 decode path accepts a valid pair in one pass and writes
    without the general checks, up to and including the step that fills the
    buffer (its window is then the whole buffer)."""
    c = KVCache("fp16", step=4, inplace=inplace)
    c.update_and_fetch(*pair(b=2, h=3, s=2, dk=4, dv=5))
    _no_general_path(monkeypatch)
    k, _ = c.update_and_fetch(*pair(b=2, h=3, s=1, dk=4, dv=5, start=7))
    assert firsts(k) == [0, 1, 7]
    k, v = c.update_and_fetch(*pair(b=2, h=3, s=1, dk=4, dv=5, start=9))
    assert c.capacity == 4 and c.offset == 4 and c.last_write_inplace is inplace
    assert firsts(k) == [0, 1, 7, 9] and firsts(v) == [0, -1, -7, -9]
    assert k.shape == (2, 3, 4, 4) and v.shape == (2, 3, 4, 5)


def test_a_decode_step_reads_the_in_place_mechanism_once_for_both_buffers(monkeypatch):
    """Keys and values of one step go the same way: the mechanism is read
    once (kvspec.impl.write.inplace_mechanism) and handed to both writes."""
    calls = []

    def mechanism():
        calls.append(1)
        return "numpy"

    def no_second_read():
        raise AssertionError("the write read the mechanism again")

    c = KVCache("fp16", step=4, inplace=True)
    c.update_and_fetch(*pair(s=2))
    monkeypatch.setattr(D, "inplace_mechanism", mechanism)
    monkeypatch.setattr(W, "inplace_mechanism", no_second_read)
    k, _ = c.update_and_fetch(*pair(start=5))
    assert c.last_write_inplace and calls == [1] and firsts(k) == [0, 1, 5]


# -- write_rows_inplace / write_rows_copy -----------------------------------

def test_write_rows_inplace_writes_the_rows_at_their_position_into_the_buffer_itself():
    dst = mx.zeros((1, 2, 5, 3), dtype=mx.float16)
    mx.eval(dst)
    held = share(dst)
    src = mx.full((1, 2, 2, 3), 4.0, dtype=mx.float16)
    assert write_rows_inplace(dst, src, 2) is dst
    assert firsts(held) == [0, 0, 4, 4, 0]


def test_write_rows_inplace_uses_the_mechanism_it_is_given(monkeypatch):
    def no_read():
        raise AssertionError("the mechanism was given, not to be read")

    monkeypatch.setattr(W, "inplace_mechanism", no_read)
    dst = mx.zeros((1, 1, 3, 2), dtype=mx.float32)
    mx.eval(dst)
    assert write_rows_inplace(dst, mx.ones((1, 1, 1, 2)), 1, "numpy") is dst
    assert firsts(dst) == [0, 1, 0]


def test_write_rows_copy_leaves_its_input_unchanged():
    dst = mx.zeros((1, 2, 4, 3), dtype=mx.float16)
    mx.eval(dst)
    out = write_rows_copy(dst, mx.full((1, 2, 1, 3), 2.0, dtype=mx.float16), 3)
    assert firsts(out) == [0, 0, 0, 2] and firsts(dst) == [0, 0, 0, 0]


# -- the general append's checks ---------------------------------------------

@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_rows_of_another_batch_are_refused_naming_the_batch_and_nothing_changes(mode):
    c = KVCache(mode, step=4)
    c.update_and_fetch(*pair(b=1, h=2, s=2, dk=4, dv=3))
    before = (c.offset, c.capacity, c.buffers)
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "append: keys batch B must be 1 (the cache's), got 2 (shape (2, 2, 1, 4))")):
        c.update_and_fetch(*pair(b=2, h=2, s=1, dk=4, dv=3))
    assert (c.offset, c.capacity, c.buffers) == before


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_rows_of_other_heads_are_refused_naming_the_heads(mode):
    """Cache B = H = 2 (so a batch index read as a head index passes for the
    cache), rows with H = 2 but B = 1; then rows with other heads."""
    c = KVCache(mode, step=4)
    c.update_and_fetch(*pair(b=2, h=2, s=2, dk=4, dv=3))
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "append: keys batch B must be 2 (the cache's), got 1 (shape (1, 2, 1, 4))")):
        c.update_and_fetch(*pair(b=1, h=2, s=1, dk=4, dv=3))
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "append: keys kv heads H must be 2 (the cache's), got 1 (shape (2, 1, 1, 4))")):
        c.update_and_fetch(*pair(b=2, h=1, s=1, dk=4, dv=3))
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "append: values head dim D must be 3 (the cache's), got 4 (shape (2, 2, 1, 4))")):
        c.update_and_fetch(*pair(b=2, h=2, s=1, dk=4, dv=4))
    assert c.offset == 2


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("cache,new,message", [
    # cache [B, H] = [2, 1], rows B = 1: the batch compared with the cache's heads would pass
    ((2, 1), (1, 1, 1, 4, 3), "keys batch B must be 2 (the cache's), got 1 (shape (1, 1, 1, 4))"),
    # rows S = 2 = the cache's H: the rows compared with the cache's heads would pass
    ((1, 2), (1, 1, 2, 4, 3), "keys kv heads H must be 2 (the cache's), got 1 (shape (1, 1, 2, 4))"),
    # rows H = 4 = the cache's capacity
    ((1, 2), (1, 4, 1, 4, 3), "keys kv heads H must be 2 (the cache's), got 4 (shape (1, 4, 1, 4))"),
    ((1, 2), (1, 2, 1, 5, 3), "keys head dim D must be 4 (the cache's), got 5 (shape (1, 2, 1, 5))"),
    ((1, 2), (1, 2, 1, 4, 2), "values head dim D must be 3 (the cache's), got 2 (shape (1, 2, 1, 2))"),
])
def test_an_append_that_does_not_match_the_cache_is_refused_naming_the_dimension(mode, cache, new, message):
    c = KVCache(mode, step=4)
    c.update_and_fetch(*pair(b=cache[0], h=cache[1], s=2, dk=4, dv=3))
    before = (c.offset, c.capacity, c.buffers)
    b, h, s, dk, dv = new
    with pytest.raises(InvalidArgumentError, match=re.escape("append: " + message)):
        c.update_and_fetch(*pair(b=b, h=h, s=s, dk=dk, dv=dv))
    assert (c.offset, c.capacity, c.buffers) == before


@pytest.mark.parametrize("bad,big,small", [("keys", 1e5, 2.0), ("values", 7e4, 3.0)])
def test_an_int8_refusal_names_the_tensor_and_its_own_largest_magnitude(bad, big, small):
    """The message's magnitude is the refused tensor's, not its partner's."""
    c = KVCache("int8", step=4)
    kval, vval = (big, small) if bad == "keys" else (small, big)
    k = mx.full((1, 1, 1, 4), kval, dtype=mx.float32)
    v = mx.full((1, 1, 1, 3), vval, dtype=mx.float32)
    top = big
    with pytest.raises(InvalidArgumentError, match=re.escape(
            f"append: {bad} must be finite within float16's range (|x| <= 65504) in mode int8 "
            f"(no finite scale otherwise), got max |x| = {top:g}")):
        c.update_and_fetch(k, v)
    assert c.empty() and c.offset == 0


# -- constructor, trim, install, make_mask -----------------------------------

def test_the_largest_step_is_accepted_and_one_more_is_refused():
    assert KVCache(step=D.MAX_STEP).step == 2**20
    with pytest.raises(InvalidArgumentError, match=re.escape("KVCache: step must be in [1, 1048576], got 1048577")):
        KVCache(step=D.MAX_STEP + 1)


def test_trim_of_zero_and_of_a_numpy_integer():
    c = KVCache(step=4)
    c.update_and_fetch(*pair(s=3))
    assert c.trim(0) == 0 and c.offset == 3
    assert c.trim(np.int64(2)) == 2 and c.offset == 1


def test_install_refuses_a_cache_that_holds_no_rows_but_has_an_offset():
    """A cache front-trimmed to nothing holds no rows (``empty()``) but its
    offset still counts them: it is not the empty cache install needs."""
    c = KVCache(step=4)
    c.update_and_fetch(*pair(s=3))
    assert c.trim_front(3) == 3 and c.empty() and c.offset == 3
    other = KVCache(step=4)
    other.update_and_fetch(*pair(s=2))
    h = other.detach()
    with pytest.raises(StateError, match=re.escape("install: requires an empty cache, got offset=3, live_len=0")):
        c.install(h)
    assert not h.consumed and h.offset == 2


@pytest.mark.parametrize("live,n,window,want", [(0, 2, 2, "causal"), (2, 1, 3, None), (0, 1, 1, None)])
def test_a_window_exactly_as_long_as_the_keys_does_not_bind(live, n, window, want):
    c = KVCache(step=4)
    if live:
        c.update_and_fetch(*pair(s=live))
    assert c.make_mask(n, window_size=window) == want


def test_a_window_one_shorter_than_the_keys_binds():
    c = KVCache(step=4)
    c.update_and_fetch(*pair(s=2))
    m = np.array(c.make_mask(1, window_size=2))
    assert m.tolist() == [[False, True, True]]


# -- restore's holder check --------------------------------------------------

def test_restore_names_the_values_tensor_it_refuses():
    c = KVCache(step=4)
    c.update_and_fetch(*pair(s=2))
    snap = c.snapshot()
    bad = copy.copy(snap)
    bad.buffers = copy.copy(snap.buffers)
    bad.buffers.values = mx.zeros((1, 2, 4), dtype=mx.float16)
    with pytest.raises(InvalidArgumentError, match=re.escape("restore: values must have rank 4, got shape (1, 2, 4)")):
        c.restore(bad)
    bad.buffers.values = "rows"
    with pytest.raises(InvalidArgumentError, match=re.escape("restore: values must be an mx.array, got str")):
        c.restore(bad)
    assert c.offset == 2 and firsts(c.fetch()[0]) == [0, 1]


def test_restore_refuses_an_int8_snapshot_that_dequantizes_to_a_non_float_dtype():
    c = KVCache("int8", step=4)
    c.update_and_fetch(*pair(s=2))
    bad = copy.copy(c.snapshot())
    bad.buffers = copy.copy(bad.buffers)
    bad.buffers.out_dtype = mx.int32
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "restore: dequantized dtype must be float16, bfloat16 or float32, got mlx.core.int32")):
        c.restore(bad)


# -- from_state ----------------------------------------------------------------

def test_from_state_refuses_a_five_field_meta_state_outside_int8():
    c = KVCache(step=4)
    c.update_and_fetch(*pair(s=2))
    meta = ("fp16", "4", "2", "0", "float32")
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "from_state: meta_state must be (mode, step, offset, live_start), or for int8 "
            f"(mode, step, offset, live_start, dtype), got {meta!r}")):
        KVCache.from_state(c.state, meta)


def test_from_state_refuses_an_unknown_dtype_name():
    c = KVCache("int8", step=4)
    c.update_and_fetch(*pair(s=2, dtype=mx.float32))
    assert c.meta_state == ("int8", "4", "2", "0", "float32")
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "from_state: meta_state dtype must be one of float16, bfloat16, float32, got 'int4'")):
        KVCache.from_state(c.state, ("int8", "4", "2", "0", "int4"))
    back = KVCache.from_state(c.state, c.meta_state)
    assert back.fetch()[0].dtype == mx.float32


# -- the ownership marker ----------------------------------------------------

@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_the_cache_owns_exactly_the_buffers_its_last_write_produced(mode):
    c = KVCache(mode, step=4)
    assert not c._owns_buffers()  # no buffers, no marker
    c.update_and_fetch(*pair(s=2))
    assert c._owns_buffers()
    arrays = c.buffers.arrays()
    for i in range(len(arrays)):  # any one array that is not the written one
        other = list(arrays)
        other[i] = share(other[i])
        c._marker = _Marker(tuple(other), c.live_len)
        assert not c._owns_buffers()
    c._marker = _Marker(arrays[:-1], c.live_len)  # one array short
    assert not c._owns_buffers()
    c.restore(c.snapshot())  # adopted buffers: no marker
    assert c.buffers is not None and not c._owns_buffers()


# -- to_quantized --------------------------------------------------------------

def test_to_quantized_by_default_is_mlx_lms_four_bit_groups_of_64_and_equals_its_own():
    from mlx_lm.models.cache import KVCache as MlxKVCache
    from mlx_lm.models.cache import QuantizedKVCache

    c = KVCache(step=8)
    k, v = pair(b=1, h=2, s=3, dk=64, dv=128, start=1.0)
    c.update_and_fetch(k, v)
    q = c.to_quantized()
    ref = MlxKVCache()
    ref.update_and_fetch(k, v)
    want = ref.to_quantized()
    assert isinstance(q, QuantizedKVCache) and (q.group_size, q.bits) == (64, 4) and q.offset == 3
    for got, exp in ((q.keys, want.keys), (q.values, want.values)):
        assert len(got) == len(exp)
        for a, b in zip(got, exp):  # mlx-lm quantizes its whole buffer: its first 3 rows
            assert a.shape[2] == 3 and np.array_equal(np.array(a), np.array(b[:, :, :3]))


@pytest.mark.parametrize("bits,group_size", [(5, 32), (2, 128), (3, 64), (6, 128)])
def test_to_quantized_takes_every_bits_and_group_size_mlx_takes(bits, group_size):
    c = KVCache(step=4)
    c.update_and_fetch(*pair(b=1, h=1, s=1, dk=128, dv=256))
    q = c.to_quantized(group_size=group_size, bits=bits)
    assert (q.group_size, q.bits, q.offset) == (group_size, bits, 1)
    assert q.keys[0].shape[2] == 1 and q.values[0].shape[2] == 1


def test_to_quantized_hands_mlx_lm_the_live_rows_only():
    c = KVCache(step=8)
    c.update_and_fetch(*pair(b=1, h=1, s=5, dk=32, dv=64))
    c.trim(3)
    q = c.to_quantized(group_size=32, bits=4)
    assert q.offset == 2 and q.keys[0].shape[2] == 2 and q.values[0].shape[2] == 2


def test_to_quantized_of_a_cache_with_buffers_but_no_live_rows_hands_over_none():
    c = KVCache(step=4)
    c.update_and_fetch(*pair(b=1, h=1, s=2, dk=32, dv=32))
    snap = copy.copy(c.snapshot())
    snap.offset = 0
    c.restore(snap)
    assert c.buffers is not None and c.live_len == 0
    q = c.to_quantized(group_size=32, bits=4)
    assert q.keys is None and q.values is None and q.offset == 0


@pytest.mark.parametrize("dk,dv", [(64, 32), (32, 64)])
def test_to_quantized_refuses_a_group_size_that_does_not_divide_either_head_dim(dk, dv):
    c = KVCache(step=4)
    c.update_and_fetch(*pair(b=1, h=1, s=2, dk=dk, dv=dv))
    with pytest.raises(UnsupportedOperationError, match=re.escape(
            f"to_quantized: group_size=64 must divide the head dims (keys {dk}, values {dv}) for mlx's quantizer")):
        c.to_quantized(group_size=64, bits=4)


def test_to_quantized_refuses_a_front_trimmed_cache_for_mlx_lm():
    c = KVCache(step=4)
    c.update_and_fetch(*pair(b=1, h=1, s=3, dk=32, dv=32))
    c.trim_front(1)
    with pytest.raises(UnsupportedOperationError, match=re.escape(
            "to_quantized: bits=4 hands the layer to mlx-lm's QuantizedKVCache, whose offset counts its rows; "
            "this cache's window starts at live_start=1 (a front trim), which it cannot hold")):
        c.to_quantized(group_size=32, bits=4)


def test_to_quantized_without_mlx_lm_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx_lm.models.cache", None)
    c = KVCache(step=4)
    with pytest.raises(UnsupportedOperationError, match=re.escape(
            "to_quantized: bits=4 needs mlx-lm's QuantizedKVCache (pip install 'kvspec[e2e]'); "
            "kvspec itself stores bits=8")):
        c.to_quantized(bits=4)


@pytest.mark.parametrize("arg,value,shown", [("bits", 4.0, "4.0"), ("group_size", "64", "'64'")])
def test_to_quantized_refuses_a_non_integer_naming_the_argument(arg, value, shown):
    with pytest.raises(InvalidArgumentError, match=re.escape(f"to_quantized: {arg} must be an integer, got {shown}")):
        KVCache().to_quantized(**{arg: value})


@pytest.mark.parametrize("bits,group_size", [(7, 64), (4, 129), (8, 16)])
def test_to_quantized_refuses_what_mlx_does_not_take(bits, group_size):
    with pytest.raises(UnsupportedOperationError, match=re.escape(
            "to_quantized: bits must be one of 2, 3, 4, 5, 6, 8 and group_size one of 32, 64, 128 "
            f"(mlx's quantizer), got bits={bits}, group_size={group_size}")):
        KVCache().to_quantized(group_size=group_size, bits=bits)


def test_an_int8_cache_keeps_its_storage_for_other_bits_and_says_so_once():
    c = KVCache("int8", step=4)
    c.update_and_fetch(*pair(s=2))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        kept = [c.to_quantized(bits=4), c.to_quantized(bits=2)]
    assert kept == [c, c]
    assert [(w.category, str(w.message)) for w in record] == [(UserWarning, (
        "to_quantized(bits=4): this cache stores int8 (mode 'int8') and keeps it "
        "(re-quantizing int8 codes would lose rows; build the layer with mode='fp16' to take "
        "kv_bits; reported once per cache)"))]


@pytest.mark.parametrize("inplace", [True, False])
def test_to_quantized_bits_8_keeps_the_in_place_switch_step_and_counters(inplace, monkeypatch):
    monkeypatch.setenv("KV_INPLACE_WRITE", "on" if not inplace else "off")  # the opposite of the cache's
    c = KVCache(step=4, inplace=inplace)
    c.update_and_fetch(*pair(b=1, h=2, s=3, dk=4, dv=3, dtype=mx.bfloat16))
    c.trim(1)
    q = c.to_quantized(bits=8)
    assert (q.mode, q.step, q.inplace, q.offset, q.live_start) == ("int8", 4, inplace, 2, 0)
    assert q.capacity == 2  # exactly the live rows
    k, v = q.fetch()
    assert k.dtype == mx.bfloat16 and firsts(k) == [0, 1] and firsts(v) == [0, -1]
    assert q.to_quantized(bits=8) is q


def test_to_quantized_bits_8_ignores_a_trimmed_row_beyond_float16():
    c = KVCache(step=4)
    c.update_and_fetch(mx.full((1, 1, 2, 2), 127.0), mx.full((1, 1, 2, 2), 127.0))  # exact in int8
    c.update_and_fetch(mx.full((1, 1, 1, 2), 1e6), mx.full((1, 1, 1, 2), 127.0))
    c.trim(1)
    assert firsts(c.to_quantized(bits=8).fetch()[0]) == [127, 127]


@pytest.mark.parametrize("bad", ["keys", "values"])
def test_to_quantized_bits_8_refuses_rows_beyond_float16_naming_the_tensor(bad):
    c = KVCache(step=4)
    big, small = mx.full((1, 1, 1, 2), 1e5), mx.full((1, 1, 1, 2), 1.0)
    c.update_and_fetch(*((big, small) if bad == "keys" else (small, big)))
    with pytest.raises(InvalidArgumentError, match=re.escape(
            f"to_quantized: {bad} must be finite within float16's range (|x| <= 65504) "
            "to be stored as int8, got |x| up to 100000.0")):
        c.to_quantized(bits=8)


# -- merge ---------------------------------------------------------------------

def test_merge_is_the_batch_caches_merge():
    from kvspec.impl.batch import BatchKVCache

    a, b = KVCache(step=4), KVCache(step=4)
    a.update_and_fetch(*pair(b=1, h=2, s=2, dk=4, dv=3))
    b.update_and_fetch(*pair(b=1, h=2, s=3, dk=4, dv=3, start=5))
    got = KVCache.merge([a, b])
    want = BatchKVCache.merge([a, b])
    assert type(got) is BatchKVCache
    for x, y in zip(got.state, want.state):
        assert np.array_equal(np.array(x), np.array(y))
    with pytest.raises(InvalidArgumentError, match=re.escape("merge: caches must hold at least one cache, got []")):
        KVCache.merge([])


# -- refusing mlx-lm's save_prompt_cache --------------------------------------

def test_mlx_lms_save_prompt_cache_is_refused_with_what_to_use_instead(tmp_path):
    from mlx_lm.models.cache import save_prompt_cache as lm_save

    c = KVCache(step=4)
    c.update_and_fetch(*pair(s=1))
    with pytest.raises(UnsupportedOperationError, match=re.escape(
            "mlx_lm.models.cache.save_prompt_cache cannot write a kvspec KVCache: it stores "
            "`state` without the counters of `meta_state`, so no loader could rebuild the cache from its file; "
            "save with kvspec.impl.models.save_prompt_cache(file, cache) and load with kvspec.impl.models.load_prompt_cache "
            "(nothing was written)")):
        lm_save(str(tmp_path / "p.safetensors"), [c])
    assert not list(tmp_path.iterdir())
    assert len(c.state) == 2  # any other caller reads it


class _Frame:
    def __init__(self, name, module, back):
        self.f_code = types.SimpleNamespace(co_name=name)
        self.f_globals = {"__name__": module}
        self.f_back = back


def _stack(foreign_at, depth=9):
    """Frames ``[0, depth)`` as ``sys._getframe`` sees them from the
    refusal: 0 the refusal, 1 the ``state`` getter, 2 its caller, ...;
    ``foreign_at`` is mlx-lm's writer."""
    frames, back = [None] * depth, None
    for i in reversed(range(depth)):
        name, module = ("save_prompt_cache", "mlx_lm.models.cache") if i == foreign_at else (f"f{i}", "tests")
        back = frames[i] = _Frame(name, module, back)
    return frames


@pytest.mark.parametrize("foreign_at,refused", [(2, True), (6, True), (7, False), (1, False)])
def test_the_foreign_save_is_looked_for_in_five_frames_from_the_state_getters_caller(foreign_at, refused,
                                                                                     monkeypatch):
    frames = _stack(foreign_at)
    monkeypatch.setattr(D, "sys", types.SimpleNamespace(_getframe=lambda k: frames[k]))
    c = KVCache()
    if refused:
        with pytest.raises(UnsupportedOperationError, match="mlx_lm.models.cache.save_prompt_cache cannot write"):
            D.refuse_foreign_save(c)
    else:
        assert D.refuse_foreign_save(c) is None


def test_the_foreign_save_search_stops_at_the_bottom_of_the_stack(monkeypatch):
    frames = _stack(foreign_at=-1, depth=4)
    monkeypatch.setattr(D, "sys", types.SimpleNamespace(_getframe=lambda k: frames[k]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert D.refuse_foreign_save(KVCache()) is None
