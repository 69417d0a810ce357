"""Storage dtype, shapes, the in-place switch and masks of both caches
(semantics.md 2 "Storage"; kvspec.spec.dense.inplace_switch,
kvspec.spec.dense.dense_mask_visible, kvspec.spec.dense.check_window_size)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvspec.impl.dense as impl_dense
from kvspec.impl.dense import KVCache, data_pointer
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec import dense as spec_dense
from kvspec.spec.errors import InvalidArgumentError

DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def rows(n, start=0, b=1, h=2, d=8, dtype=mx.float16, scale=1.0):
    x = np.arange(start, start + n, dtype=np.float32)[None, None, :, None] * scale
    x = np.broadcast_to(x, (b, h, n, d)) + np.arange(d, dtype=np.float32) / 8
    return mx.array(x.copy()).astype(dtype)


def as_f32(a):
    return np.array(a.astype(mx.float32))


def make(kind, **kw):
    if kind == "dense":
        return KVCache("fp16", step=kw.pop("step", 2), **kw)
    return RotatingKVCache(kw.pop("max_size", 4), keep=kw.pop("keep", 1), step=kw.pop("step", 2), **kw)


# -- storage dtype --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dense", "ring"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_unquantized_caches_store_and_return_the_incoming_dtype(kind, dtype):
    c = make(kind)
    sent = []
    for t in range(3):  # decode steps: growth, then in-place / copying writes
        k = rows(1, t, dtype=dtype, scale=1e5 if dtype != mx.float16 else 1.0)
        sent.append(k)
        got_k, got_v = c.update_and_fetch(k, k)
        assert got_k.dtype == dtype and got_v.dtype == dtype
    want = np.concatenate([as_f32(k) for k in sent], axis=2)
    assert np.array_equal(as_f32(c.fetch()[0]), want)  # byte identical: no float16 detour
    assert np.isfinite(as_f32(c.fetch()[0])).all()


@pytest.mark.parametrize("kind", ["dense", "ring"])
def test_bfloat16_beyond_float16_range_is_stored_not_inf(kind):
    c = make(kind)
    k = mx.full((1, 1, 1, 4), 1e5, dtype=mx.bfloat16)
    out, _ = c.update_and_fetch(k, k)
    assert out.dtype == mx.bfloat16 and float(as_f32(out).max()) == float(as_f32(k).max())


@pytest.mark.parametrize("kind", ["dense", "ring"])
def test_append_of_another_dtype_is_refused_and_changes_nothing(kind):
    c = make(kind)
    c.update_and_fetch(rows(2, dtype=mx.bfloat16), rows(2, dtype=mx.bfloat16))
    before = (c.offset, as_f32(c.fetch()[0]))
    with pytest.raises(InvalidArgumentError, match=r"append: dtype must be mlx.core.bfloat16 .*got mlx.core.float16"):
        c.update_and_fetch(rows(1), rows(1))
    assert c.offset == before[0] and np.array_equal(as_f32(c.fetch()[0]), before[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_dequantizes_to_the_incoming_dtype(dtype):
    c = KVCache("int8", step=2)
    for t in range(3):
        k, _ = c.update_and_fetch(rows(1, t, dtype=dtype), rows(1, t, dtype=dtype))
        assert k.dtype == dtype
    assert c.snapshot().fetch()[0].dtype == dtype
    assert c.buffers.keys.dtype == mx.int8 and c.buffers.key_scales.dtype == mx.float16


@pytest.mark.parametrize("bad", [1e5, float("inf"), float("nan")])
def test_int8_refuses_rows_without_a_finite_scale(bad):
    c = KVCache("int8", step=2)
    c.update_and_fetch(rows(1, dtype=mx.bfloat16), rows(1, dtype=mx.bfloat16))
    before = (c.offset, c.capacity, as_f32(c.fetch()[1]))
    v = mx.array(np.full((1, 2, 1, 8), bad, dtype=np.float32)).astype(mx.bfloat16)
    with pytest.raises(InvalidArgumentError, match=r"append: values must be finite within float16's range "
                                                   r"\(\|x\| <= 65504\) in mode int8 .*got max \|x\| ="):
        c.update_and_fetch(rows(1, 1, dtype=mx.bfloat16), v)
    assert (c.offset, c.capacity) == before[:2] and np.array_equal(as_f32(c.fetch()[1]), before[2])


def test_int8_float16_max_reads_back_finite():
    """absmax 65504: scale 516, q 127, and 127 * 516 = 65532 rounds to inf in
    float16; the dequantizer saturates instead (kvspec.impl.quant's decision)."""
    c = KVCache("int8", step=1)
    x = mx.full((1, 1, 1, 4), 65504.0, dtype=mx.float16)
    k, _ = c.update_and_fetch(x, -x)
    assert np.isfinite(as_f32(k)).all() and float(as_f32(k).max()) == 65504.0


# -- shapes -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dense", "ring"])
@pytest.mark.parametrize(("dim", "bad", "pattern"), [
    ("b", {"b": 3}, r"append: keys batch B must be 2 \(the cache's\), got 3"),
    ("h", {"h": 1}, r"append: keys kv heads H must be 2 \(the cache's\), got 1"),
    ("dk", {"dk": 4}, r"append: keys head dim D must be 8 \(the cache's\), got 4"),
    ("dv", {"dv": 8}, r"append: values head dim D must be 4 \(the cache's\), got 8"),
])
def test_mismatched_append_names_the_dimension(kind, dim, bad, pattern):
    c = make(kind)
    c.update_and_fetch(rows(2, b=2, d=8), rows(2, b=2, d=4))
    before = (c.offset, c.capacity)
    shape = {"b": 2, "h": 2, "dk": 8, "dv": 4} | bad
    k = rows(1, 5, b=shape["b"], h=shape["h"], d=shape["dk"])
    v = rows(1, 5, b=shape["b"], h=shape["h"], d=shape["dv"])
    with pytest.raises(InvalidArgumentError, match=pattern):
        c.update_and_fetch(k, v)
    assert (c.offset, c.capacity) == before


@pytest.mark.parametrize("kind", ["dense", "ring"])
def test_keys_and_values_disagreeing_on_batch_or_heads_are_refused(kind):
    c = make(kind)
    with pytest.raises(InvalidArgumentError, match="keys and values must agree on batch B, got 1 and 2"):
        c.update_and_fetch(rows(1, b=1), rows(1, b=2))
    with pytest.raises(InvalidArgumentError, match="keys and values must agree on kv heads H, got 2 and 3"):
        c.update_and_fetch(rows(1, h=2), rows(1, h=3))
    assert c.offset == 0 and c.empty()


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_dense_growth_keeps_each_head_dim(mode):
    c = KVCache(mode, step=2)
    for t in range(7):
        k, v = c.update_and_fetch(rows(1, t, b=3, h=1, d=8), rows(1, t, b=3, h=1, d=2))
        assert k.shape == (3, 1, t + 1, 8) and v.shape == (3, 1, t + 1, 2)
    c.trim(3)
    k, v = c.update_and_fetch(rows(4, 9, b=3, h=1, d=8), rows(4, 9, b=3, h=1, d=2))
    assert c.buffers.values.shape[3] == 2 and v.shape == (3, 1, 8, 2)


def test_ring_growth_uses_the_real_batch():
    """The issue's trace: batch 2, kv_heads 1, head_dim 8, max_size 4, step 2,
    a single append of one row."""
    c = RotatingKVCache(4, step=2)
    k, v = c.update_and_fetch(rows(1, b=2, h=1, d=8), rows(1, b=2, h=1, d=3))
    assert k.shape == (2, 1, 1, 8) and v.shape == (2, 1, 1, 3)
    for t in range(1, 7):
        k, v = c.update_and_fetch(rows(1, t, b=2, h=1, d=8), rows(1, t, b=2, h=1, d=3))
    assert c.keys.shape == (2, 1, 4, 8) and c.values.shape == (2, 1, 4, 3)


# -- the in-place switch ---------------------------------------------------------

SPELLINGS = [None, "", " ", "0", "false", "off", "no", "FALSE", "Off", " no ", "\tNO\n", "oFf", " 0 ",
             "1", "true", "on", "yes", "2", "disable", "nope", "0.0", "n o", "offf", "fals", "-", "none"]


@pytest.mark.parametrize("value", SPELLINGS)
def test_env_switch_parsing_matches_the_spec(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("KV_INPLACE_WRITE", raising=False)
    else:
        monkeypatch.setenv("KV_INPLACE_WRITE", value)
    want = spec_dense.inplace_switch(value)
    assert impl_dense.inplace_switch_from_env() is want
    assert KVCache().inplace is want and RotatingKVCache(4).inplace is want


@pytest.mark.parametrize("bad", ["no", "off", "", 0, 1, 1.0, "True"])
def test_both_caches_refuse_the_same_inplace_values(bad):
    for build in (lambda: KVCache(inplace=bad), lambda: RotatingKVCache(4, inplace=bad)):
        with pytest.raises(InvalidArgumentError, match=r"inplace must be True, False or None"):
            build()


@pytest.mark.parametrize("good", [True, False])
def test_both_caches_accept_the_same_inplace_values(good):
    assert KVCache(inplace=good).inplace is good and RotatingKVCache(4, inplace=good).inplace is good


# -- memory sharing through the data pointer --------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace_write_keeps_memory_copying_write_moves_it(dtype):
    c = KVCache("fp16", step=8, inplace=True)
    c.update_and_fetch(rows(1, dtype=dtype), rows(1, dtype=dtype))
    c.update_and_fetch(rows(1, 1, dtype=dtype), rows(1, 1, dtype=dtype))  # owns the buffer now
    p = data_pointer(c.buffers.keys)
    c.update_and_fetch(rows(1, 2, dtype=dtype), rows(1, 2, dtype=dtype))
    assert c.last_write_inplace and data_pointer(c.buffers.keys) == p
    snap = c.snapshot()
    assert data_pointer(snap.buffers.keys) == p  # O(1) snapshot: same memory
    c.trim(1)  # the snapshot still reads row 2: the next write must copy
    c.update_and_fetch(rows(1, 3, dtype=dtype), rows(1, 3, dtype=dtype))
    assert not c.last_write_inplace and data_pointer(c.buffers.keys) != p
    assert data_pointer(snap.buffers.keys) == p
    assert np.array_equal(as_f32(snap.fetch()[0])[0, 0, :, 0], [0, 1, 2])


# -- masks --------------------------------------------------------------------------


def denoted(mask, n, length):
    """The bool matrix a make_mask return value denotes."""
    if mask is None:
        assert n == 1, "None is only a decode step's mask"
        return np.ones((1, length), dtype=bool)
    if isinstance(mask, str):
        assert mask == "causal"
        return np.tril(np.ones((n, length), dtype=bool), k=length - n)
    return np.array(mask).astype(bool)


@pytest.mark.parametrize("return_array", [False, True])
def test_dense_mask_matches_the_spec(return_array):
    for live in range(7):
        c = KVCache("fp16", step=3)
        if live:
            c.update_and_fetch(rows(live), rows(live))
        for n in range(1, 5):
            for window in (None, *range(1, 9)):
                got = denoted(c.make_mask(n, window_size=window, return_array=return_array), n, live + n)
                want = np.array(spec_dense.dense_make_mask(live, n, window), dtype=bool)
                assert got.shape == want.shape and np.array_equal(got, want), (live, n, window)


def test_dense_mask_with_a_binding_window_is_an_array():
    c = KVCache("fp16", step=8)
    c.update_and_fetch(rows(5), rows(5))
    m = c.make_mask(1, window_size=3)
    assert m is not None and np.array(m).tolist() == [[False, False, False, True, True, True]]


@pytest.mark.parametrize("kind", ["dense", "ring"])
@pytest.mark.parametrize(("bad", "pattern"), [
    (0, "window_size must be >= 1, got 0"),
    (-2, "window_size must be >= 1, got -2"),
    (2.5, "window_size must be None or an integer >= 1, got 2.5"),
    (True, "window_size must be None or an integer >= 1, got True"),
    ("3", "window_size must be None or an integer >= 1, got '3'"),
])
def test_bad_window_size_is_refused(kind, bad, pattern):
    c = make(kind)
    c.update_and_fetch(rows(2), rows(2))
    with pytest.raises(InvalidArgumentError, match=f"make_mask: {pattern}"):
        c.make_mask(1, window_size=bad)


# -- every storage mode refuses rows that do not fit the cached ones -------------
# The checks above build the Fp16 dense cache and the ring only, and the
# state machines hold one shape and dtype per run, so a compatibility check
# skipped in one storage mode (e.g. "quantized buffers hold int8 codes, so
# compare dtypes in Fp16 only") went unseen. Every mode of the dense kind,
# and the ring, must refuse a row of another dtype or shape and keep its rows.

def _every_mode():
    from kvspec.impl.dense import _MODES
    from kvspec.impl.turbo import DELEGATED, TURBO_MODES
    return list(_MODES) + list(TURBO_MODES) + [DELEGATED, "ring"]


def _make_mode(mode):
    from kvspec.impl.turbo import make_cache
    if mode == "ring":
        return RotatingKVCache(4, keep=1, step=2)
    return make_cache(mode, step=2)


@pytest.mark.parametrize("mode", _every_mode())
@pytest.mark.parametrize(("have", "new"), [(mx.bfloat16, mx.float16), (mx.float16, mx.float32),
                                           (mx.float32, mx.bfloat16)])
def test_every_mode_refuses_an_append_of_another_dtype(mode, have, new):
    c = _make_mode(mode)
    c.update_and_fetch(rows(2, dtype=have), rows(2, dtype=have))
    before = (c.offset, as_f32(c.fetch()[0]), as_f32(c.fetch()[1]))
    with pytest.raises(InvalidArgumentError, match=r"append: dtype must be"):
        c.update_and_fetch(rows(1, 2, dtype=new), rows(1, 2, dtype=new))
    got = c.fetch()
    assert c.offset == before[0] and got[0].dtype == have
    assert np.array_equal(as_f32(got[0]), before[1]) and np.array_equal(as_f32(got[1]), before[2])


@pytest.mark.parametrize("mode", _every_mode())
@pytest.mark.parametrize("bad", [{"b": 3}, {"h": 1}, {"dk": 24}, {"dv": 32}])
def test_every_mode_refuses_an_append_of_another_shape(mode, bad):
    # head dims multiples of 8 (3-bit Turbo packing), equal in turbo4
    shape = {"b": 2, "h": 2, "dk": 16, "dv": 16 if mode == "turbo4" else 8}
    c = _make_mode(mode)
    c.update_and_fetch(rows(2, b=2, d=shape["dk"]), rows(2, b=2, d=shape["dv"]))
    before = (c.offset, as_f32(c.fetch()[0]), as_f32(c.fetch()[1]))
    shape |= bad
    with pytest.raises(InvalidArgumentError, match=r"append: "):
        c.update_and_fetch(rows(1, 2, b=shape["b"], h=shape["h"], d=shape["dk"]),
                           rows(1, 2, b=shape["b"], h=shape["h"], d=shape["dv"]))
    got = c.fetch()
    assert c.offset == before[0]
    assert np.array_equal(as_f32(got[0]), before[1]) and np.array_equal(as_f32(got[1]), before[2])


@pytest.mark.parametrize("mode", _every_mode())
@pytest.mark.parametrize(("k_kw", "v_kw", "pattern"), [
    ({"b": 1}, {"b": 2}, "batch B"),
    ({"h": 2}, {"h": 3}, "kv heads H"),
    ({"n": 2}, {"n": 1}, "rows S"),
    ({"dtype": mx.float16}, {"dtype": mx.bfloat16}, "share a dtype"),
    ({"dtype": mx.float32}, {"dtype": mx.float16}, "share a dtype"),
], ids=["batch", "heads", "rows", "f16-bf16", "f32-f16"])
@pytest.mark.parametrize("filled", [False, True], ids=["empty", "filled"])
def test_every_mode_refuses_keys_and_values_that_disagree(mode, k_kw, v_kw, pattern, filled):
    """One append whose keys and values disagree on B, H, S or dtype is
    refused in every mode, on an empty cache and on one holding rows of the
    keys' shape, and changes nothing (the dtype agreement was tested nowhere:
    dropped, an Int8 cache cast the values to the keys' dtype and a ring
    stored a pair its own snapshot could not be restored from)."""
    c = _make_mode(mode)
    base = {"b": 1, "h": 2, "n": 1, "dtype": mx.float16}
    k_args, v_args = base | k_kw, base | v_kw
    if filled:
        c.update_and_fetch(rows(2, b=k_args["b"], h=k_args["h"], dtype=k_args["dtype"]),
                           rows(2, b=k_args["b"], h=k_args["h"], dtype=k_args["dtype"]))
    before = None if c.fetch() is None else tuple(as_f32(a) for a in c.fetch())
    offset = c.offset
    with pytest.raises(InvalidArgumentError, match=pattern):
        c.update_and_fetch(rows(k_args.pop("n"), 2, **k_args), rows(v_args.pop("n"), 2, **v_args))
    got = c.fetch()
    assert c.offset == offset
    assert (got is None) == (before is None)
    if got is not None:
        assert all(np.array_equal(as_f32(a), b) for a, b in zip(got, before))


def _every_trimmer():
    return _every_mode() + ["paged"]


def _make_trimmer(mode):
    if mode == "paged":
        from kvspec.impl.paged import PagedKVCache
        return PagedKVCache(block_size=2)
    return _make_mode(mode)


@pytest.mark.parametrize("mode", _every_trimmer())
@pytest.mark.parametrize("bad", [True, False, 1.0, 1.5, "1", None], ids=repr)
def test_every_mode_refuses_a_trim_count_that_is_not_an_integer(mode, bad):
    """``trim(n)`` takes an int or a NumPy integer; a bool (an ``int``
    subclass: ``isinstance(True, int)``), a float, a str or None is refused
    by name and trims nothing, on every cache kind, whatever shortcut a kind
    takes for the common Python int (a shortcut testing ``isinstance(n, int)``
    let ``trim(True)`` remove a row)."""
    c = _make_trimmer(mode)
    c.update_and_fetch(rows(3), rows(3))
    before = (c.offset, tuple(as_f32(a) for a in c.fetch()))
    with pytest.raises(InvalidArgumentError, match=r"trim: n must be an integer"):
        c.trim(bad)
    assert c.offset == before[0]
    assert all(np.array_equal(as_f32(a), b) for a, b in zip(c.fetch(), before[1]))


@pytest.mark.parametrize("mode", _every_trimmer())
@pytest.mark.parametrize("n", [np.int64(2), np.int32(-1), 2, -1, 7], ids=repr)
def test_every_mode_trims_a_numpy_integer_as_the_int(mode, n):
    """A NumPy integer trims exactly what the same Python int does (clamped
    to ``[0, live_len]``), and returns a Python int."""
    a, b = _make_trimmer(mode), _make_trimmer(mode)
    for c in (a, b):
        c.update_and_fetch(rows(3), rows(3))
    got, want = a.trim(n), b.trim(int(n))
    assert type(got) is int and got == want and a.offset == b.offset
    fa, fb = a.fetch(), b.fetch()
    assert (fa is None) == (fb is None)
    if fa is not None:
        assert all(np.array_equal(as_f32(x), as_f32(y)) for x, y in zip(fa, fb))
