"""The host-time cuts of the dense decode path, from outside: what the
inlined checks of ``KVCache.update_and_fetch`` must still refuse (with the
general path's exact messages, the cache unchanged), what
``kvspec.impl.write.write_inplace_pair`` owes its caller (the same writes as two
``write_inplace`` calls: under ``donate`` the input handles are left as they
were, as ``write_copy`` leaves them), and the inlined ownership check of
``_inplace_write_allowed`` (both buffers named by the marker, not one).

Mutants each test was written against are named in its docstring. Shapes are
small and every dtype the cache stores (float16, bfloat16, float32) runs with
different key and value head dims, so an index read off by one axis, or keys
read for values, shows."""

import mlx.core as mx
import numpy as np
import pytest

from kvspec.impl import write as W
from kvspec.impl.dense import KVCache, _Buffers, _Marker, share
from kvspec.spec.errors import InvalidArgumentError
from tests._standin import stand_in

DTYPES = [mx.float16, mx.bfloat16, mx.float32]
B, H, DK, DV = 2, 3, 4, 5


def pair(s=1, start=0.0, dtype=mx.float16, b=B, h=H, dk=DK, dv=DV):
    """``[b, h, s, dk]`` / ``[b, h, s, dv]``: row ``i`` holds ``start + i``,
    values its negation."""
    base = np.arange(s, dtype=np.float32)[None, None, :, None] + start
    k = np.broadcast_to(base, (b, h, s, dk)).copy()
    v = -np.broadcast_to(base, (b, h, s, dv)).copy()
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def host(a):
    return np.array(a.astype(mx.float32))


def firsts(a):
    return host(a)[0, 0, :, 0].tolist()


class NotAnArray:
    """Has an mx.array's ``shape`` and ``dtype`` (those the cache holds) but
    is not one."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = list(shape), dtype


@pytest.fixture(params=["cpu", "cuda"])
def backend(request, monkeypatch):
    """The write layer on this CPU (numpy) and stood in for CUDA (donate)."""
    stand_in(monkeypatch, request.param)
    monkeypatch.delenv("KV_CUDA_INPLACE", raising=False)
    assert W.inplace_mechanism() == ("numpy" if request.param == "cpu" else "donate")
    return request.param


def decoding_cache(dtype, inplace=True):
    """An Fp16 cache with rows and room: the next one-row append takes the
    one-pass decode path (and, with ``inplace``, the in-place write)."""
    c = KVCache("fp16", step=8, inplace=inplace)
    c.update_and_fetch(*pair(s=2, dtype=dtype))
    c.update_and_fetch(*pair(s=1, start=2, dtype=dtype))  # the marker now names these buffers
    assert c.offset == 3 and c.capacity == 8
    return c


def looks(c):
    k, v = c.fetch()
    return (c.offset, c.capacity, firsts(k), firsts(v))


# -- the inlined checks: what the decode path must still refuse ---------------

@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("which", ["keys", "values", "both"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_step_of_something_that_is_no_mx_array_is_refused_naming_it(which, dtype, inplace, backend):
    """Objects with the cache's very shape and dtype but no mx.array: the
    general path's refusal, the cache unchanged. (Missed before: the type
    check of the fast path dropped, for keys, values or both; the shape and
    dtype checks then accept the pair and the write fails inside MLX.)"""
    c = decoding_cache(dtype, inplace)
    before = looks(c)
    k, v = pair(dtype=dtype)
    if which in ("keys", "both"):
        k = NotAnArray(k.shape, dtype)
    if which in ("values", "both"):
        v = NotAnArray(v.shape, dtype)
    name = "keys" if which != "values" else "values"
    with pytest.raises(InvalidArgumentError, match=f"append: {name} must be an mx.array, got NotAnArray"):
        c.update_and_fetch(k, v)
    assert looks(c) == before
    k, v = c.update_and_fetch(*pair(start=7, dtype=dtype))  # and the cache goes on
    assert firsts(k) == [0, 1, 2, 7] and firsts(v) == [0, -1, -2, -7]


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("which,shape", [
    ("values", (B, H, 1)),              # rank 3: no head dim to read
    ("values", (B, H, 1, DV, 1)),       # rank 5 whose first four axes match the cache
    ("values", (B, H, 1, DV, 2)),
    ("keys", (B, H, 1)),
    ("keys", (B, H, 1, DK, 1)),
    ("keys", (B, H, 1, DK, 3)),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_step_of_a_tensor_of_another_rank_is_refused_naming_it(which, shape, dtype, inplace, backend):
    """(Missed before: the fast path's ``len(vs) == 4``, or ``len(ks) ==
    4``, dropped: a rank-3 tensor raised IndexError out of the shape check,
    a rank-5 one whose first axes match reached the write.)"""
    c = decoding_cache(dtype, inplace)
    before = looks(c)
    k, v = pair(dtype=dtype)
    bad = mx.zeros(shape, dtype=dtype)
    if which == "keys":
        k = bad
    else:
        v = bad
    with pytest.raises(InvalidArgumentError, match=rf"append: {which} must have rank 4 \[B, H, S, D\]"):
        c.update_and_fetch(k, v)
    assert looks(c) == before


@pytest.mark.parametrize("which", ["batch", "heads", "values batch", "values heads", "kdim", "vdim", "rows", "pair dtype",
                                   "cache dtype", "swapped dims"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_pair_the_general_checks_refuse_is_refused_on_the_decode_path(which, dtype, backend):
    """Each inlined comparison against the general path's refusal, with a
    pair that differs from an acceptable one in that rule alone (batch 1 and
    one head broadcast silently if let through; keys and values with their
    head dims swapped pass a check that reads Dk against the cached values).
    Elsewhere only test_write.py's fuzz campaign through the CUDA paths
    catches these; here each rule alone."""
    c = decoding_cache(dtype)
    before = looks(c)
    k, v = pair(dtype=dtype)
    other = mx.float32 if dtype != mx.float32 else mx.float16
    if which == "batch":
        k, v = pair(b=1, dtype=dtype)
    elif which == "heads":
        k, v = pair(h=1, dtype=dtype)
    elif which == "values batch":  # the keys match the cache: the values are checked too
        v = pair(b=1, dtype=dtype)[1]
    elif which == "values heads":
        v = pair(h=1, dtype=dtype)[1]
    elif which == "kdim":
        k = pair(dk=DK + 1, dtype=dtype)[0]
    elif which == "vdim":
        v = pair(dv=DV - 1, dtype=dtype)[1]
    elif which == "rows":
        v = pair(s=2, dtype=dtype)[1]
    elif which == "pair dtype":
        v = v.astype(other)
    elif which == "cache dtype":
        k, v = k.astype(other), v.astype(other)
    else:
        k, v = pair(dk=DV, dv=DK, dtype=dtype)
    with pytest.raises(InvalidArgumentError):
        c.update_and_fetch(k, v)
    assert looks(c) == before


# -- write_inplace_pair ---------------------------------------------------------

def _buffers(dtype):
    keys = mx.zeros((1, 2, 4, DK), dtype=dtype)
    values = mx.zeros((1, 2, 4, DV), dtype=dtype)
    mx.eval(keys, values)
    return keys, values


@pytest.mark.parametrize("src_dtype", [None, mx.float32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_donating_pair_write_leaves_its_input_handles_as_they_were(dtype, src_dtype, monkeypatch):
    """Under ``donate`` the pair write is two ``write_inplace`` calls, i.e.
    two ``write_copy`` calls: new handles hold the rows (cast to the
    buffers' dtype), the input handles and every sharer read what they read
    before. (Missed before: ``k = keys`` / ``v = values`` in place of the
    handle copy, which rebinds the caller's own array objects; and the
    inputs returned in place of the written handles.)"""
    stand_in(monkeypatch, "cuda")
    monkeypatch.delenv("KV_CUDA_INPLACE", raising=False)
    keys, values = _buffers(dtype)
    held_k, held_v = share(keys), share(values)
    nk = mx.full((1, 2, 1, DK), 3.0, dtype=src_dtype or dtype)
    nv = mx.full((1, 2, 1, DV), -5.0, dtype=src_dtype or dtype)
    before = W.COUNTS["donate"]
    for mech in ("donate", None):  # handed to it, and read by it
        k, v = W.write_inplace_pair(keys, nk, values, nv, W.seq_index(1, 1), mech)
        assert k is not keys and v is not values
        assert k.dtype == dtype and v.dtype == dtype and k.shape == keys.shape and v.shape == values.shape
        assert firsts(k) == [0, 3, 0, 0] and firsts(v) == [0, -5, 0, 0]
        assert (host(k)[:, :, 1] == 3).all() and (host(v)[:, :, 1] == -5).all()
        for a in (keys, values, held_k, held_v):
            assert not host(a).any(), "a donating write changed its input or a sharer"
        # the same as two write_inplace calls
        k1, v1 = (W.write_inplace(keys, nk, W.seq_index(1, 1), "donate"),
                  W.write_inplace(values, nv, W.seq_index(1, 1), "donate"))
        assert np.array_equal(host(k), host(k1)) and np.array_equal(host(v), host(v1))
    assert W.COUNTS["donate"] == before + 8


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_numpy_pair_write_writes_both_inputs_themselves(dtype):
    """``numpy``: the input arrays are returned, and every sharer of their
    memory sees the rows (keys in the keys, values in the values)."""
    keys, values = _buffers(dtype)
    held_k, held_v = share(keys), share(values)
    nk, nv = mx.full((1, 2, 1, DK), 3.0, dtype=dtype), mx.full((1, 2, 1, DV), -5.0, dtype=dtype)
    before = W.COUNTS["numpy"]
    k, v = W.write_inplace_pair(keys, nk, values, nv, W.seq_index(2, 1), "numpy")
    assert k is keys and v is values and W.COUNTS["numpy"] == before + 2
    assert firsts(held_k) == [0, 0, 3, 0] and firsts(held_v) == [0, 0, -5, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_steps_through_the_donating_pair_write_keep_every_earlier_window(dtype, monkeypatch):
    """A decoder's steady state under CUDA's donate: windows and snapshots
    taken along the way read the rows they had (the written rows never
    reach them), and the cache reads every row."""
    stand_in(monkeypatch, "cuda")
    monkeypatch.delenv("KV_CUDA_INPLACE", raising=False)
    c = KVCache("fp16", step=4, inplace=True)
    c.update_and_fetch(*pair(s=2, dtype=dtype))
    windows, snaps = [], []
    for step in range(2, 7):  # to the buffer's edge (4) and past it (a regrow)
        k, v = c.update_and_fetch(*pair(start=step, dtype=dtype))
        windows.append((k, v, list(range(step + 1))))
        snaps.append((c.snapshot(), step + 1))
    assert firsts(c.fetch()[0]) == list(range(7)) and firsts(c.fetch()[1]) == [-x for x in range(7)]
    for k, v, want in windows:
        assert firsts(k) == want and firsts(v) == [-x for x in want]
        assert k.shape[-1] == DK and v.shape[-1] == DV
    for snap, n in snaps:
        r = KVCache("fp16")
        r.restore(snap)
        assert firsts(r.fetch()[0]) == list(range(n))


# -- _inplace_write_allowed: the inlined ownership check -------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_is_allowed_only_when_the_marker_names_both_buffers(dtype):
    """The decode path's own rule (inlined, not ``_owns_buffers``): either
    buffer not the one the marker names refuses the in-place write. (Missed
    before: the values' identity check dropped.)"""
    c = decoding_cache(dtype)
    assert c._inplace_write_allowed(1)
    b, m = c.buffers, c._marker
    for i in range(2):
        other = [b.keys, b.values]
        other[i] = share(other[i])
        c._marker = _Marker(tuple(other), m.live_len)
        assert not c._inplace_write_allowed(1), i
        assert c._inplace_write_allowed(1) == c._owns_buffers()
    c._marker = _Marker((b.keys, b.keys), m.live_len)
    assert not c._inplace_write_allowed(1)
    c._marker = _Marker((b.keys,), m.live_len)  # one array short
    assert not c._inplace_write_allowed(1)
    c._marker = m
    assert c._inplace_write_allowed(1)
    assert not c._inplace_write_allowed(2) and not c._inplace_write_allowed(0)
    c.buffers = None  # a marker left over buffers that are gone
    assert not c._inplace_write_allowed(1)


@pytest.mark.parametrize("which", ["keys", "values"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_buffer_the_marker_does_not_name_is_never_written_in_place(which, dtype):
    """A cache whose ``which`` buffer was swapped for a foreign array (of
    the same shape, whose owner reads all of its rows) copies on its next
    decode step: the foreign array keeps its rows. With the numpy mechanism
    an in-place write would have overwritten one of them."""
    c = decoding_cache(dtype)
    b = c.buffers
    foreign = mx.full(b.keys.shape if which == "keys" else b.values.shape, 9.0, dtype=dtype)
    mx.eval(foreign)
    c.buffers = _Buffers(foreign, b.values) if which == "keys" else _Buffers(b.keys, foreign)
    k, v = c.update_and_fetch(*pair(start=3, dtype=dtype))
    assert not c.last_write_inplace
    assert (host(foreign) == 9).all(), "an in-place write went into a buffer the cache does not own"
    assert firsts(k if which == "keys" else v)[3] == (3 if which == "keys" else -3)
