"""The prefix harness's reads of our pool (kvspec.fuzz.prefix.OursTarget):
names normalised only where they are not spec form already, a whole block
or fetch named at once exactly as slot by slot (from its float32 form or
from its own bytes in the cache's dtype: the same names), every block read through
``block_rows``, every slab byte in ``state()`` (each dtype), and
``PrefixCachePool.block_rows`` and ``copy`` bit for bit in the pool's
dtype whichever way they copy."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.fuzz.prefix import OursTarget, PrefixRows, norm_name, row_name
from kvspec.impl.prefix import PrefixCachePool

DTYPES = ("float16", "bfloat16", "float32")
CFG = {"block_size": 2, "n_blocks": 4, "kv_heads": 2, "head_dim": 8}


def bits(a: mx.array) -> np.ndarray:
    """``a``'s bit pattern (bfloat16 as uint16)."""
    if a.dtype == mx.bfloat16:
        a = mx.view(a, mx.uint16)
    return np.array(a, copy=True)


def test_norm_name_converts_what_is_not_spec_form_and_keeps_what_is():
    spec_form = (1, (0, 2, 3))
    assert norm_name(spec_form) == spec_form and norm_name((None, ())) == (None, ())
    for raw in ((None, (np.int64(1), True, 2.0)), [None, [1, 1, 2]], (None, [np.int32(1), 1, 2])):
        got = norm_name(raw)
        assert got == (None, (1, 1, 2)) and type(got) is tuple and type(got[1]) is tuple, raw
        assert [type(t) for t in got[1]] == [int, int, int], raw
    assert norm_name(None) is None and norm_name("junk") == "junk" and norm_name((None, ("x",))) == (None, ("x",))


@pytest.mark.parametrize("dtype", DTYPES)
def test_slot_names_agree_with_slot_name_row_by_row(dtype):
    rows = PrefixRows(2, 8, dtype)
    names = [row_name(None, (1, 2, 3, 0), p) for p in range(4)]
    k, v = rows.rows(names, "k"), rows.rows(names, "v")
    v[1] = rows.row(names[2], "v")  # a K row without its V row
    k[2] = 0.0  # a row no name makes
    k = np.concatenate([k, k[:1]])  # a row past n: not named
    want = [rows.slot_name(k[i], v[i]) for i in range(4)]
    assert want[0] == names[0] and want[1].startswith("K ") and want[3] == names[3]
    assert rows.slot_names(k, v, 4) == want
    if dtype == "float16":  # host arrays in another dtype: widened to float32 as slot_name does
        assert rows.slot_names(k.astype(np.float16), v.astype(np.float16), 4) == want
    assert rows.slot_names(k, v, 0) == []
    with pytest.raises(IndexError):  # fewer rows than asked: as the row-by-row loop raises
        rows.slot_names(k, v[:2], 3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_stored_slot_names_name_a_dtypes_own_bytes_as_slot_names_its_float32(dtype):
    rows = PrefixRows(2, 8, dtype)
    names = [row_name(1, (3, 2, 1), p) for p in range(3)]
    k, v = rows.rows(names, "k"), rows.rows(names, "v")
    v[0] = rows.row(names[1], "v")  # a K row without its V row
    k[2, 1, 3] = -k[2, 1, 3]  # one value off
    want = rows.slot_names(k, v, 3)
    assert want[0].startswith("K ") and want[1] == names[1] and want[2].startswith("K None")
    stored = [mx.array(a).astype(getattr(mx, dtype)) for a in (k, v)]
    kb, vb = (memoryview(a).tobytes() for a in stored)
    assert rows.stored_bytes(k) == kb and rows.stored_slot_names(kb, vb, 3) == want
    assert rows.stored_slot_names(kb, vb, 2) == want[:2]


class RowsOfTheNextBlock(PrefixCachePool):
    def block_rows(self, b):
        return super().block_rows((b + 1) % self.n_blocks)


@pytest.mark.parametrize("dtype", DTYPES)
def test_observe_reads_every_block_through_block_rows(dtype):
    seen = []

    class Counted(PrefixCachePool):
        def block_rows(self, b):
            seen.append(b)
            return super().block_rows(b)

    cfg = {**CFG, "dtype": dtype}
    t = OursTarget(cfg, Counted)
    t.admit("a", (1, 2, 3), None)
    view = t.observe()
    assert seen == list(range(4))
    named = {(b, s): row_name(None, (1, 2, 3), 2 * b + s) for b in range(2) for s in range(2) if 2 * b + s < 3}
    assert {slot: view["rows"][slot] for slot in named} == named
    assert view["reads"] == {"a": [row_name(None, (1, 2, 3), p) for p in range(3)]}
    broken = OursTarget(cfg, RowsOfTheNextBlock)
    broken.admit("a", (1, 2, 3), None)
    assert broken.observe()["rows"][(0, 0)] == row_name(None, (1, 2, 3), 2)  # block 1's row, read as block 0's


@pytest.mark.parametrize("dtype", DTYPES)
def test_reads_in_another_dtype_are_named_from_their_float32_forms(dtype):
    """A pool whose block_rows and fetch hand back float32 (not the cache's
    dtype): named through their host forms, the same names."""

    class ReadsInFloat32(PrefixCachePool):
        def block_rows(self, b):
            return tuple(a.astype(mx.float32) for a in super().block_rows(b))

        def fetch(self, req):
            return tuple(a.astype(mx.float32) for a in super().fetch(req))

    cfg = {**CFG, "dtype": dtype}
    views = []
    for factory in (None, ReadsInFloat32):
        t = OursTarget(cfg, factory)
        t.admit("a", (1, 2, 3), 0)
        t.decode("a", (2, 2))
        views.append(t.observe())
    assert views[0]["rows"] == views[1]["rows"] and views[0]["reads"] == views[1]["reads"]
    assert views[0]["reads"]["a"] == [row_name(0, (1, 2, 3, 2, 2), p) for p in range(5)]
    assert views[1]["dtypes"]["block_rows"] == views[1]["dtypes"]["fetch"] == ["float32"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_state_holds_every_byte_of_every_block(dtype):
    t = OursTarget({**CFG, "dtype": dtype}, None)
    assert t.state()["slabs"] == [None] * 4
    t.admit("a", (1, 2, 3), None)
    was = t.state()["slabs"]
    assert len(was) == 4 and all(len(k) == 2 * 2 * 8 * np.dtype(np.float32 if dtype == "float32" else np.float16).itemsize
                                 for k, _ in was)
    for b in range(4):
        for which in ("keys", "values"):
            slab = getattr(t.pool, which)
            mask = mx.array((np.arange(4) == b)[:, None, None, None] & (np.arange(8) == 7))
            setattr(t.pool, which, mx.where(mask, -slab, slab))  # one value's sign (a zero's too)
            assert t.state()["slabs"] != was, (b, which)
            setattr(t.pool, which, slab)
    assert t.state()["slabs"] == was


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_rows_and_copy_are_bit_for_bit_in_the_pools_dtype(dtype):
    t = OursTarget({**CFG, "dtype": dtype}, None)
    t.admit("a", (1, 2, 3, 0, 1), None)
    pool = t.pool
    for b in range(4):
        k, v = pool.block_rows(b)
        assert k.dtype == v.dtype == getattr(mx, dtype) and k.shape == (2, 2, 8) == v.shape
        assert np.array_equal(bits(k), bits(pool.keys)[b]) and np.array_equal(bits(v), bits(pool.values)[b])
    dup = pool.copy()
    assert dup.keys.dtype == dup.values.dtype == getattr(mx, dtype)
    assert np.array_equal(bits(dup.keys), bits(pool.keys)) and np.array_equal(bits(dup.values), bits(pool.values))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_named_k_row_beside_a_v_row_no_name_makes_is_no_name(dtype):
    """Only V wrong (zeroed, unwritten, another row's bytes off by a bit):
    every naming path says the K and V rows disagree, never the K row's
    name."""
    rows = PrefixRows(2, 8, dtype)
    names = [row_name(None, (4, 5, 6), p) for p in range(3)]
    k, v = rows.rows(names, "k"), rows.rows(names, "v")
    v[0] = 0.0
    v[1, 0, 0] = -v[1, 0, 0]
    for got in (rows.slot_names(k, v, 3), [rows.slot_name(k[i], v[i]) for i in range(3)]):
        assert got[0] == f"K {names[0]!r} / V None" and got[1] == f"K {names[1]!r} / V None" and got[2] == names[2]
    stored = [mx.array(a).astype(getattr(mx, dtype)) for a in (k, v)]
    kb, vb = (memoryview(a).tobytes() for a in stored)
    assert rows.stored_slot_names(kb, vb, 3)[:2] == [f"K {names[0]!r} / V None", f"K {names[1]!r} / V None"]


_INT_LIKE = st.one_of(st.integers(-5, 50), st.booleans(), st.integers(0, 50).map(np.int64),
                      st.integers(0, 50).map(np.int32), st.integers(0, 50).map(float))


@given(salt=st.one_of(st.none(), st.integers(0, 3), st.text(max_size=2)),
       tokens=st.lists(_INT_LIKE, max_size=5), outer=st.sampled_from([tuple, list]),
       inner=st.sampled_from([tuple, list]))
@settings(max_examples=200, deadline=None)
def test_norm_name_gives_the_spec_form_whatever_the_containers_and_int_likes(salt, tokens, outer, inner):
    got = norm_name(outer([salt, inner(tokens)]))
    want = (salt, tuple(int(t) for t in tokens))
    assert got == want and type(got) is tuple and type(got[1]) is tuple
    assert all(type(t) is int for t in got[1])
    hash(got)
