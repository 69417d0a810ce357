"""Edges of impl/batch.py's BatchKVCache found by its mutation survivors:
the exact refusals (the message names the argument and the rule, and a
refusal leaves the batch as it was), the buffer growth by ``step`` (mlx-lm's
own, since the layout is mlx-lm's), the zeros under the padding, the empty
cases of ``extend``, ``trim``, ``extract`` and ``finalize``, and the hooks'
answers (``is_trimmable``, ``keys_and_values``)."""

import re

import mlx.core as mx
import numpy as np
import pytest

from kvspec.impl.batch import BatchKVCache, BatchLayout
from kvspec.impl.dense import KVCache
from kvspec.spec.errors import InvalidArgumentError, UnsupportedOperationError


def raises(exc, message):
    """``pytest.raises`` on the whole message: the message is the contract."""
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


def rows(b, s, h=2, dk=3, dv=4, start=1.0):
    """K/V ``[b, h, s, dk]`` / ``[b, h, s, dv]`` of distinct non-zero values
    (from ``start`` up; values negated), so a misplaced row or a non-zero
    padding shows."""
    k = (np.arange(b * h * s * dk, dtype=np.float32).reshape(b, h, s, dk) + start)
    v = -(np.arange(b * h * s * dv, dtype=np.float32).reshape(b, h, s, dv) + start)
    return mx.array(k).astype(mx.float16), mx.array(v).astype(mx.float16)


def dense(n, start=1.0, step=256):
    """Our Fp16 KVCache holding ``n`` rows (none: an empty cache)."""
    c = KVCache("fp16", step=step)
    if n:
        c.update_and_fetch(*rows(1, n, start=start))
    return c


def np_(a):
    return np.array(a.astype(mx.float32))


def snapshot(c):
    """What a refusal must leave as it was."""
    kv = c.keys_and_values()
    return c.layout, None if kv is None else (np_(kv[0]), np_(kv[1]))


def same(a, b):
    (la, ka), (lb, kb) = a, b
    return la == lb and (ka is kb is None or (ka is not None and kb is not None
                                                and all(np.array_equal(x, y) for x, y in zip(ka, kb))))


# -- update_and_fetch ------------------------------------------------------------
@pytest.mark.parametrize("keys_shape, values_shape", [
    ((3, 2, 1, 3), (3, 2, 1, 4)),  # another batch size, values agreeing with the keys
    ((2, 2, 1, 3), (2, 2, 2, 4)),  # the right batch size, values of another length
])
def test_update_and_fetch_refuses_keys_and_values_outside_the_batch_shape(keys_shape, values_shape):
    # kills update_and_fetch mutants 1, 2 (the or/and of the shape rule), 10, 11, 12 (the message)
    c = BatchKVCache([0, 0])
    c.update_and_fetch(*rows(2, 2))
    before = snapshot(c)
    k, v = mx.zeros(keys_shape, mx.float16), mx.zeros(values_shape, mx.float16)
    with raises(InvalidArgumentError, "update_and_fetch: keys and values must be [B=2, H, S, D] with the same "
                f"B, H, S, got {keys_shape} and {values_shape}"):
        c.update_and_fetch(k, v)
    assert same(snapshot(c), before)


# (rows appended or trimmed, buffer capacity after) with step 4: a full buffer
# is not grown, a growth adds ceil(n / step) * step rows, a buffer whose
# positions end off a step is cut to them first and one ending on a step is not
GROWTH = [(2, 4), (2, 4), (3, 8), (3, 11), (-2, 11), (4, 15)]


def test_the_buffer_grows_by_step_as_mlx_lms_batch_cache_does():
    # kills update_and_fetch mutants 18 (> vs >=), 23 (the step count), 41, 42, 43 (the cut)
    c = BatchKVCache([0, 0], step=4)
    want_k, want_v = [], []
    for n, capacity in GROWTH:
        if n < 0:
            assert c.trim(-n) == -n
            want_k, want_v = want_k[:n], want_v[:n]
        else:
            k, v = rows(2, n, start=10.0 * len(want_k) + 1)
            got_k, got_v = c.update_and_fetch(k, v)
            want_k += [np_(k)[:, :, i] for i in range(n)]
            want_v += [np_(v)[:, :, i] for i in range(n)]
            assert np.array_equal(np_(got_k), np.stack(want_k, axis=2))
            assert np.array_equal(np_(got_v), np.stack(want_v, axis=2))
        assert c.keys.shape[2] == c.values.shape[2] == capacity, (n, c.keys.shape)
        assert c.nbytes == 2 * 2 * capacity * (3 + 4) * 2


def test_the_growth_and_the_merged_buffer_are_mlx_lms():
    """The same appends and trims on mlx-lm's BatchKVCache give the same
    capacities, and its merge the same buffer (padding zeros)."""
    lm = pytest.importorskip("mlx_lm.models.cache")
    ours, theirs = BatchKVCache([0, 0], step=4), lm.BatchKVCache([0, 0])
    theirs.step = 4
    for n, _ in GROWTH:
        for c in (ours, theirs):
            if n < 0:
                c.trim(-n)
            else:
                c.update_and_fetch(*rows(2, n))
        assert ours.keys.shape == theirs.keys.shape and ours.values.shape == theirs.values.shape
    mine = [dense(3, 1.0), dense(1, 50.0), dense(0), dense(2, 80.0)]
    lms = []
    for c in mine:
        t = lm.KVCache()
        if c.fetch() is not None:
            t.update_and_fetch(*c.fetch())
        lms.append(t)
    a, b = BatchKVCache.merge(mine), lm.BatchKVCache.merge(lms)
    assert np.array_equal(np_(a.keys), np_(b.keys[..., : a.keys.shape[2], :]))
    assert np.array_equal(np_(a.values), np_(b.values[..., : a.values.shape[2], :]))


def test_keys_and_values_is_none_while_empty_then_the_rows_of_every_sequence():
    # kills keys_and_values mutant 1
    c = BatchKVCache([0, 0], step=4)
    assert c.keys_and_values() is None and c.state == ()
    k, v = rows(2, 3)
    c.update_and_fetch(k, v)
    got = c.keys_and_values()
    assert got is not None and got[0].shape == (2, 2, 3, 3) and got[1].shape == (2, 2, 3, 4)
    assert np.array_equal(np_(got[0]), np_(k)) and np.array_equal(np_(got[1]), np_(v))


# -- make_mask --------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["2", 2.0, True])
def test_make_mask_refuses_a_non_integer_N_naming_it(bad):
    # kills make_mask mutants 3, 4, 9, 10, 11, 12 (the op and argument names)
    with raises(InvalidArgumentError, f"make_mask: N must be an integer, got {bad!r}"):
        BatchKVCache([0]).make_mask(bad)


@pytest.mark.parametrize("n", [0, -1])
def test_make_mask_refuses_N_below_1_with_the_rule(n):
    # kills make_mask mutant 15
    with raises(InvalidArgumentError, f"make_mask: N must be >= 1, got {n}"):
        BatchKVCache([0]).make_mask(n)


# -- prepare / finalize --------------------------------------------------------------
def test_prepare_refuses_left_padding_once_rows_are_cached_and_changes_nothing():
    # kills prepare mutant 4
    c = BatchKVCache.merge([dense(2), dense(1)])
    before = snapshot(c)
    with raises(InvalidArgumentError, "prepare: left_padding can only be added to an empty BatchKVCache "
                                      "(one that holds no positions), got idx=2"):
        c.prepare(left_padding=[1, 1])
    assert same(snapshot(c), before)


def test_an_all_zero_right_padding_announces_nothing_so_finalize_is_a_no_op():
    """Even before any rows: ``prepare(right_padding=[0, 0])`` then
    ``finalize()`` on an empty batch is no block to roll."""
    # kills prepare mutant 18 (max(right_padding) >= 0)
    c = BatchKVCache([1, 0])
    c.prepare(right_padding=[0, 0])
    c.finalize()
    assert c.layout == BatchLayout(0, (1, 0)) and c.empty()
    c = BatchKVCache.merge([dense(2), dense(1)])
    before = snapshot(c)
    c.prepare(right_padding=[0, 0])
    c.finalize()
    assert same(snapshot(c), before)


# -- trim ---------------------------------------------------------------------------
def test_a_batch_is_trimmable():
    # kills is_trimmable mutant 1 (mlx-lm's can_trim_prompt_cache asks it)
    assert BatchKVCache([0]).is_trimmable() is True


@pytest.mark.parametrize("empty", [True, False])
def test_trim_refuses_a_non_integer_n_naming_it(empty):
    # kills trim mutants 2, 3, 8, 9, 10, 11
    c = BatchKVCache([0, 0]) if empty else BatchKVCache.merge([dense(2), dense(2)])
    before = snapshot(c)
    with raises(InvalidArgumentError, "trim: n must be an integer, got 1.0"):
        c.trim(1.0)
    assert same(snapshot(c), before)


def test_trimming_an_empty_batch_takes_no_row():
    # kills trim mutant 13
    c = BatchKVCache([2, 0])
    assert c.trim(3) == 0
    assert c.layout == BatchLayout(0, (2, 0)) and c.empty()


# -- extend -------------------------------------------------------------------------
def test_extend_refuses_what_is_not_a_batch_naming_its_type():
    # kills extend mutants 2, 3
    c = BatchKVCache.merge([dense(2)])
    before = snapshot(c)
    with raises(InvalidArgumentError, "extend: other must be a BatchKVCache, got KVCache"):
        c.extend(dense(1))
    assert same(snapshot(c), before)


def test_extending_an_empty_batch_by_an_empty_one_appends_its_padding():
    # kills extend mutants 6, 7, 8
    c = BatchKVCache([1])
    c.extend(BatchKVCache([0, 2]))
    assert c.layout == BatchLayout(0, (1, 0, 2)) and c.empty() and c.batch_size == 3


def test_extending_an_empty_batch_by_one_with_rows_takes_its_rows():
    """The empty side has no buffer to copy the heads, dims and dtype from:
    they come from the other side."""
    # kills extend mutants 6 (the empty fast path taken), 16 and 20 (the reference buffers)
    c = BatchKVCache([0])
    other = BatchKVCache.merge([dense(3, 1.0), dense(1, 50.0)])
    c.extend(other)
    assert c.layout == BatchLayout(3, (3, 0, 2))
    assert c.keys.shape == (3, 2, 3, 3) and c.values.shape == (3, 2, 3, 4) and c.keys.dtype == mx.float16
    assert c.extract(0).fetch() is None
    for i, (n, start) in enumerate([(3, 1.0), (1, 50.0)], start=1):
        got = c.extract(i).fetch()
        k, v = rows(1, n, start=start)
        assert np.array_equal(np_(got[0]), np_(k)) and np.array_equal(np_(got[1]), np_(v))


# -- extract ------------------------------------------------------------------------
def test_extract_refuses_a_non_integer_idx_naming_it():
    # kills extract mutants 2, 3, 8, 9, 10, 11
    with raises(InvalidArgumentError, "extract: idx must be an integer, got '0'"):
        BatchKVCache.merge([dense(1)]).extract("0")


@pytest.mark.parametrize("idx", [2, 3, -1])
def test_extract_refuses_an_index_outside_the_batch_with_the_range(idx):
    # kills extract mutants 15 (idx == B let through: an IndexError) and 16
    c = BatchKVCache.merge([dense(2), dense(1)])
    with raises(InvalidArgumentError, f"extract: idx must be in [0, 2), got {idx}"):
        c.extract(idx)


def test_extracting_a_sequence_of_no_rows_gives_an_empty_cache():
    """A sequence that is all padding (pad == idx, offset 0) extracts as an
    empty cache: no block of 0 rows is appended (KVCache refuses one)."""
    # kills extract mutants 18 (idx + pad), 28 (or), 30 (offset >= 0)
    c = BatchKVCache.merge([dense(0), dense(3)])
    assert c.layout == BatchLayout(3, (3, 0))
    out = c.extract(0)
    assert isinstance(out, KVCache) and out.mode == "fp16"
    assert out.offset == 0 and out.fetch() is None
    assert c.extract(1).offset == 3


# -- merge --------------------------------------------------------------------------
def test_merge_refuses_no_caches():
    # kills merge mutant 3
    with raises(InvalidArgumentError, "merge: caches must hold at least one cache, got []"):
        BatchKVCache.merge([])


@pytest.mark.parametrize("foreign", [7, object()])
def test_merge_refuses_a_cache_that_is_not_our_dense_cache_saying_what_it_takes(foreign):
    # kills merge mutants 10, 14, 15, 16
    name = f"{type(foreign).__module__}.{type(foreign).__qualname__}"
    with raises(UnsupportedOperationError, f"merge: cache 1 is a {name}; a BatchKVCache merges kvspec's dense "
                "kvspec.impl.dense.KVCache layers."):
        BatchKVCache.merge([dense(1), foreign])


def test_merge_refuses_a_front_trimmed_cache_with_the_reason():
    # kills merge mutants 24, 25
    trimmed = dense(3)
    assert trimmed.trim_front_keep_sink(1) == 1
    with raises(UnsupportedOperationError, "merge: cache 1 starts its window at live_start=1 (a front trim); "
                "a batch sequence's offset must be its row count"):
        BatchKVCache.merge([dense(2), trimmed])


def test_merge_leaves_zeros_under_every_sequences_padding():
    """Each sequence's rows at ``[pad, idx)`` of its own row of the buffer
    and zeros before them, as mlx-lm's merge leaves them (the buffer is
    ``state``, what a prompt-cache file saves)."""
    # kills merge mutants 84, 88 (a sequence's rows also written into the next row)
    c = BatchKVCache.merge([dense(3, 1.0), dense(1, 50.0), dense(0), dense(2, 80.0)])
    assert c.layout == BatchLayout(3, (0, 2, 3, 1))
    keys, values = np_(c.keys), np_(c.values)
    assert keys.shape == (4, 2, 3, 3) and values.shape == (4, 2, 3, 4)
    for i, (n, start) in enumerate([(3, 1.0), (1, 50.0), (0, 0.0), (2, 80.0)]):
        p = 3 - n
        assert not keys[i, :, :p].any() and not values[i, :, :p].any(), i
        if n:
            k, v = rows(1, n, start=start)
            assert np.array_equal(keys[i : i + 1, :, p:], np_(k)) and np.array_equal(values[i : i + 1, :, p:], np_(v))
