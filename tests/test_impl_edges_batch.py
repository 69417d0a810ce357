"""Edges of kvspec.impl.batch found by its mutation survivors: the exact refusals
(the message names the argument and the rule: an empty or out-of-range
``left_padding``, a bad ``step``, a repeated ``filter`` index, a foreign
cache in ``merge`` with and without mlx-lm's hint, a ring merge of nothing,
batched rings without mlx-lm), the defaults of a batch built directly
(``step`` 256, empty until its first block), an empty batch extended by a
filled one, and the merged ring's buffers equal to mlx-lm's own merge
(padding included). tests/test_batch.py checks the layouts in lockstep with
single caches; these pin what its matches on a few words let through."""

from __future__ import annotations

import re
import sys

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")

import kvspec.impl.batch as B
from kvspec.impl.batch import BatchKVCache
from kvspec.impl.dense import KVCache
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec import batch as sb
from kvspec.spec.errors import InvalidArgumentError, UnsupportedOperationError


def rows(n, b=1, h=2, dk=4, dv=4, seed=0, dtype=mx.float16):
    """A K/V pair ``[b, h, n, dk]`` / ``[b, h, n, dv]`` of random rows."""
    rng = np.random.default_rng(seed + n)
    k = mx.array(rng.standard_normal((b, h, n, dk)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((b, h, n, dv)).astype(np.float32)).astype(dtype)
    return k, v


def filled(cls, n, seed=0, **kw):
    c = cls(**kw)
    c.update_and_fetch(*rows(n, seed=seed))
    return c


def exact(message):
    """A ``match`` for exactly ``message``."""
    return "^" + re.escape(message) + "$"


def host(a):
    return np.array(a.astype(mx.float32))


# -- the layout refusals of a batch built directly -------------------------------------

def test_a_batch_of_no_sequences_is_refused_naming_the_rule():
    # mutants: _check_layout 3, 4, 5 (message gone, XX-wrapped, upper-cased);
    # __init__ 22 (max() with no default: a raw ValueError)
    with pytest.raises(InvalidArgumentError, match=exact("batch: a batch holds at least one sequence, got pads=()")):
        BatchKVCache([])


@pytest.mark.parametrize("pads, idx", [((-1, 2), 2), ((-1,), -1), ((0, -3), 0)])
def test_a_negative_pad_is_refused_naming_the_rule(pads, idx):
    """A negative pad is refused beside valid ones too (idx = the largest
    pad is then >= 0: only the per-pad rule catches it)."""
    # mutants: _check_layout 6 (`or` -> `and`: (-1, 2) passed), 14 (message gone)
    with pytest.raises(InvalidArgumentError, match=exact(f"batch: pads must satisfy 0 <= pad <= idx ({idx}), got {pads}")):
        BatchKVCache(list(pads))


def test_a_non_integer_left_padding_is_refused_naming_the_class_and_argument():
    # mutants: __init__ 4, 5, 10, 11, 12, 13, 14 (the op or argument label of _check_int)
    for bad in (1.5, "1", True):
        with pytest.raises(InvalidArgumentError, match=exact(f"BatchKVCache: left_padding must be an integer, got {bad!r}")):
            BatchKVCache([0, bad])


def test_step_must_be_an_integer_of_at_least_1():
    # mutants: __init__ 25, 26, 31, 32, 33, 34, 35 (labels of _check_int), 38 (message gone)
    with pytest.raises(InvalidArgumentError, match=exact("BatchKVCache: step must be an integer, got 1.5")):
        BatchKVCache([0], step=1.5)
    for bad in (0, -2):
        with pytest.raises(InvalidArgumentError, match=exact(f"BatchKVCache: step must be >= 1, got {bad}")):
            BatchKVCache([0], step=bad)
    assert BatchKVCache([0], step=1).step == 1


def test_a_batch_built_directly_grows_by_256_rows_by_default():
    """mlx-lm's BatchKVCache step: the first block of one row allocates 256
    positions (merge passes the sequences' step; only a direct build takes
    the default)."""
    # mutant: __init__ 1 (default 257)
    c = BatchKVCache([1, 0])
    assert c.step == 256
    c.update_and_fetch(*rows(2, b=2))
    assert c.keys.shape == (2, 2, 256, 4) and c.values.shape == (2, 2, 256, 4)
    assert c.offset.tolist() == [1, 2]


def test_a_new_batch_is_empty_until_its_first_block():
    # mutant: empty 1 (negated)
    c = BatchKVCache([2, 0])
    assert c.empty() and c.nbytes == 0 and c.state == ()
    c.update_and_fetch(*rows(3, b=2))
    assert not c.empty()


def test_a_block_shorter_than_the_announced_padding_is_refused():
    """Announced padding (mlx-lm's convention: offsets start at ``-pad``) is
    filled by the first block; a block of fewer rows would leave a pad past
    ``idx`` and is refused, as is a right padding that ``finalize`` would
    turn into more left padding than the block holds."""
    # mutant: _check 1 (`keys is not None` negated: every call site has rows, so no layout was checked)
    c = BatchKVCache([3, 0])
    with pytest.raises(InvalidArgumentError, match=exact("batch: pads must satisfy 0 <= pad <= idx (1), got (3, 0)")):
        c.update_and_fetch(*rows(1, b=2))
    c = BatchKVCache([0, 0])
    c.update_and_fetch(*rows(2, b=2))
    c.prepare(right_padding=[3, 0])
    with pytest.raises(InvalidArgumentError, match=re.escape("batch: pads must satisfy 0 <= pad <= idx (2), got (3, 0)")):
        c.finalize()


# -- the batch's own operations ------------------------------------------------------

def test_filter_refuses_repeated_or_out_of_range_indices_naming_the_rule():
    # mutant: _filtered 11 (message gone)
    batch = KVCache.merge([filled(KVCache, 2), filled(KVCache, 1, seed=5)])
    for keep in ([0, 0], [2], []):
        with pytest.raises(InvalidArgumentError,
                           match=exact(f"filter: keep must be distinct indices in [0, 2), got {tuple(keep)}")):
            batch.filter(keep)
    assert (batch.layout.idx, batch.layout.pads) == (2, (0, 1))


def test_an_empty_batch_extended_by_a_filled_one_takes_its_rows():
    """The empty side has no buffers: its rows are built from the filled
    side's heads, head dims and dtype (its ``values`` start as None, so the
    filled side's values are the reference)."""
    # mutant: __init__ 40 (values start as "" instead of None)
    a, b = filled(KVCache, 2), filled(KVCache, 3, seed=7)
    other = KVCache.merge([a, b])
    batch = BatchKVCache([0])
    batch.extend(other)
    assert (batch.layout.idx, batch.layout.pads) == (3, (3, 1, 0))
    assert batch.offset.tolist() == [0, 2, 3]
    assert batch.keys.shape[:2] == (3, 2) and batch.values.dtype == mx.float16
    for i, c in ((1, a), (2, b)):
        got, want = batch.fetch_sequence(i), c.fetch()
        assert [host(x).tolist() for x in got] == [host(x).tolist() for x in want]


# -- merge refusals: the foreign cache named, with mlx-lm's hint only for mlx-lm's ------

def test_a_foreign_cache_not_from_mlx_lm_is_refused_without_the_mlx_lm_hint():
    # mutants: _not_ours 6 (hint always), 14 (hint "XXXX"); batch_rotating_class 13, 17, 18, 19 (the ring's `want`)
    dense, ring = filled(KVCache, 2), filled(RotatingKVCache, 2, max_size=4)
    with pytest.raises(UnsupportedOperationError, match=exact(
            "merge: cache 1 is a kvspec.impl.rotating.RotatingKVCache; "
            "a BatchKVCache merges kvspec's dense kvspec.impl.dense.KVCache layers.")):
        KVCache.merge([dense, ring])
    with pytest.raises(UnsupportedOperationError, match=exact(
            "merge: cache 1 is a kvspec.impl.dense.KVCache; "
            "a batch ring merges kvspec's kvspec.impl.rotating.RotatingKVCache layers.")):
        RotatingKVCache.merge([ring, dense])


def test_an_mlx_lm_cache_is_refused_with_the_whole_hint():
    # mutants: _not_ours 7, 9, 10 (the two halves of the hint XX-wrapped or upper-cased)
    from mlx_lm.models import cache as lm

    theirs = filled(lm.KVCache, 2)
    with pytest.raises(UnsupportedOperationError, match=exact(
            "merge: cache 1 is a mlx_lm.models.cache.KVCache; "
            "a BatchKVCache merges kvspec's dense kvspec.impl.dense.KVCache layers. "
            "mlx-lm's caches and kvspec's cannot share a batch: give every sequence kvspec caches "
            "(kvspec.impl.models.make_prompt_cache; batch_generate builds mlx-lm's for a sequence given none)")):
        KVCache.merge([filled(KVCache, 2), theirs])


def test_a_ring_merge_of_no_caches_is_refused_naming_the_rule():
    # mutant: batch_rotating_class 7 (XX-wrapped message)
    with pytest.raises(InvalidArgumentError, match=exact("merge: caches must hold at least one cache, got []")):
        RotatingKVCache.merge([])


def test_batched_rings_without_mlx_lm_are_refused_with_the_install_hint(monkeypatch):
    """Without mlx-lm (its cache module unimportable, the class not built
    yet) the batch ring is refused with the extra that installs it."""
    # mutants: batch_rotating_class 2, 3, 4 (message gone, XX-wrapped, upper-cased)
    monkeypatch.setattr(B, "_RING_BATCH", [])
    monkeypatch.setitem(sys.modules, "mlx_lm.models.cache", None)
    with pytest.raises(UnsupportedOperationError, match=exact("batched rings need mlx-lm (pip install 'kvspec[e2e]')")):
        B.batch_rotating_class()


# -- the merged ring -----------------------------------------------------------------

def test_a_merged_ring_is_mlx_lms_merge_of_the_same_rings():
    """Our rings of 3, 1 and 6 rows (the last wrapped: window 4) merge into
    the buffers mlx-lm's BatchRotatingKVCache.merge builds from mlx-lm's
    rings fed the same rows: the same rows, offsets and padding, and zeros
    in the padding (a write spilling into the next sequence's padding
    showed nowhere else: the mask hides it)."""
    # mutants: batch_rotating_class 62, 68 (keys / values written to rows i and i + 1)
    from mlx_lm.models import cache as lm

    ours, theirs = [], []
    for n in (3, 1, 6):
        for cls, out in ((RotatingKVCache, ours), (lm.RotatingKVCache, theirs)):
            c = cls(max_size=4)
            for j in range(n):
                c.update_and_fetch(*rows(1, seed=10 * n + j))
            out.append(c)
    got, want = RotatingKVCache.merge(ours), lm.BatchRotatingKVCache.merge(theirs)
    assert got.offset.tolist() == want.offset.tolist() == [3, 1, 6]
    assert got.left_padding.tolist() == want.left_padding.tolist() == [1, 3, 0]
    for a, b in ((got.keys, want.keys), (got.values, want.values)):
        assert a.shape == b.shape == (3, 2, 4, 4) and a.dtype == b.dtype
        assert host(a).tolist() == host(b).tolist()
    assert not host(got.keys)[1, :, :3].any() and not host(got.values)[0, :, :1].any()


def test_a_ring_trimmed_to_no_rows_merges_as_all_padding():
    """A ring whose rows were all trimmed still has buffers but no rows:
    it merges as a sequence of offset 0, all padding (mlx-lm's own merge
    would copy its whole buffer into a slice of 0 positions)."""
    live, trimmed = filled(RotatingKVCache, 2, max_size=4), filled(RotatingKVCache, 3, seed=3, max_size=4)
    assert trimmed.trim(3) == 3 and trimmed.keys is not None
    got = RotatingKVCache.merge([live, trimmed])
    assert got.offset.tolist() == [2, 0] and got.left_padding.tolist() == [0, 2]
    assert not host(got.keys)[1].any() and not host(got.values)[1].any()


def _snapshot(c: BatchKVCache):
    kv = c.keys_and_values()
    return (c.layout, c.empty(), c._right_padding,
            None if kv is None else (np.array(kv[0]).tobytes(), np.array(kv[1]).tobytes(), kv[0].shape))


def test_a_refused_block_or_finalize_leaves_the_batch_as_it_was():
    """The layout a block or a finalize would leave is checked before
    anything changes: after the refusal the batch is byte for byte what it
    was (an empty batch stays empty; the announced padding stays pending),
    and it goes on as if the bad call had not been made (a trim of 0 is 0;
    a right block then appends)."""
    c = BatchKVCache([3, 0])
    before = _snapshot(c)
    with pytest.raises(InvalidArgumentError, match=re.escape("pads must satisfy 0 <= pad <= idx (1)")):
        c.update_and_fetch(*rows(1, b=2))
    assert _snapshot(c) == before and c.offset.tolist() == [-3, 0]
    c.update_and_fetch(*rows(3, b=2))
    assert c.layout == B.BatchLayout(3, (3, 0)) and c.trim(0) == 0
    c = BatchKVCache([0, 0])
    c.update_and_fetch(*rows(2, b=2))
    c.prepare(right_padding=[3, 0])
    before = _snapshot(c)
    with pytest.raises(InvalidArgumentError, match=re.escape("pads must satisfy 0 <= pad <= idx (2), got (3, 0)")):
        c.finalize()
    assert _snapshot(c) == before and c.offset.tolist() == [2, 2]
    assert c.trim(0) == 0 and c.trim(1) == 1 and c.layout == B.BatchLayout(1, (0, 0))


def test_a_refused_extend_leaves_the_batch_as_it_was():
    """An empty batch announcing more padding than the sequences it is
    extended by leaves a pad past idx: refused, and nothing changes."""
    c = BatchKVCache([2])
    before = _snapshot(c)
    with pytest.raises(InvalidArgumentError, match=re.escape("pads must satisfy 0 <= pad <= idx (3), got (5, 0)")):
        c.extend(KVCache.merge([filled(KVCache, 3)]))
    assert _snapshot(c) == before


@pytest.mark.parametrize("kw, rule", [
    ({"left_padding": [1]}, "prepare: left_padding must hold one integer per sequence (2), got 1"),
    ({"left_padding": [1, 2, 3]}, "prepare: left_padding must hold one integer per sequence (2), got 3"),
    ({"left_padding": [-1, 0]}, "prepare: left_padding must be >= 0 for every sequence, got (-1, 0)"),
    ({"left_padding": [0.5, 0]}, "prepare: left_padding must be an integer, got 0.5"),
    ({"right_padding": []}, "prepare: right_padding must hold one integer per sequence (2), got 0"),
    ({"right_padding": [1, -1]}, "prepare: right_padding must be >= 0 for every sequence, got (1, -1)"),
    ({"right_padding": None, "left_padding": "ab"}, "prepare: left_padding must be a sequence of integers, got str"),
    ({"left_padding": [1, 0], "right_padding": [1]}, "prepare: right_padding must hold one integer per sequence (2), got 1"),
])
def test_prepare_refuses_padding_that_is_not_one_integer_per_sequence(kw, rule):
    """Every argument of ``prepare`` is checked before any is applied: a
    bad right padding beside a good left padding changes nothing either."""
    c = BatchKVCache([0, 1])
    before = _snapshot(c)
    with pytest.raises(InvalidArgumentError, match=exact(rule)):
        c.prepare(**kw)
    assert _snapshot(c) == before


def test_finalize_without_a_block_is_refused_and_keeps_the_announced_padding():
    c = BatchKVCache([0, 0])
    c.prepare(right_padding=[1, 0])
    before = _snapshot(c)
    with pytest.raises(InvalidArgumentError, match=re.escape("finalize: prepare announced right_padding=(1, 0), "
                                                             "but the batch holds no rows")):
        c.finalize()
    assert _snapshot(c) == before and c._right_padding == (1, 0)


@pytest.mark.parametrize("keep, rule", [
    (mx.array([[0, 1]]), "filter: batch_indices must be a 1-D list of integers, got an array of shape (1, 2)"),
    (["a"], "filter: batch_indices must be an integer, got 'a'"),
    (None, "filter: batch_indices must be a sequence of integers, got NoneType"),
    ([0.7, 1.2], "filter: batch_indices must be an integer, got 0.7"),
])
def test_filter_refuses_indices_that_are_not_integers(keep, rule):
    batch = KVCache.merge([filled(KVCache, 2), filled(KVCache, 1, seed=5)])
    before = _snapshot(batch)
    with pytest.raises(InvalidArgumentError, match=exact(rule)):
        batch.filter(keep)
    assert _snapshot(batch) == before
    batch.filter(mx.array([1]))  # a 1-D array of indices, as mlx-lm passes them
    assert batch.layout == B.BatchLayout(1, (0,))


def test_filter_refuses_a_negative_index_with_the_index_rule():
    """A negative index is out of range, refused by the filter's own rule
    (distinct indices in [0, B)), not by a generic sign check."""
    batch = KVCache.merge([filled(KVCache, 2), filled(KVCache, 1, seed=5)])
    with pytest.raises(InvalidArgumentError, match=exact("filter: keep must be distinct indices in [0, 2), got (-1, 0)")):
        batch.filter([-1, 0])


def test_extend_by_a_wider_batch_cuts_the_spare_capacity_of_the_shorter_one():
    """The shorter batch holds spare capacity (a regrow by step) past its
    idx: extending it by a batch of more positions right-aligns both, cutting
    that capacity, and every sequence keeps its window (the single caches')."""
    a1, b1 = filled(KVCache, 2, step=4), filled(KVCache, 5, seed=3, step=4)
    a = KVCache.merge([a1])
    extra = rows(1, seed=9)
    a.update_and_fetch(*extra)  # idx 3 in a buffer of 6 positions (2 + one step of 4)
    a1.update_and_fetch(*extra)
    assert a.keys.shape[2] == 6 and a.layout == B.BatchLayout(3, (0,))
    a.extend(KVCache.merge([b1]))
    assert a.layout == B.BatchLayout(5, (2, 0)) and a.keys.shape[2] == a.values.shape[2]
    for i, single in enumerate((a1, b1)):
        got, want = a.fetch_sequence(i), single.fetch()
        assert all(np.array_equal(np.array(g), np.array(w)) for g, w in zip(got, want)), i


def test_padding_is_announced_on_a_batch_trimmed_back_to_no_positions_as_the_spec_allows():
    """kvspec.spec.batch.announced_block allows announced padding on any layout
    with idx 0; the cache too, once a trim took every position (its buffers
    stay allocated), and the block after it gives the spec's layout and
    each sequence the block's rows after its padding."""
    c = BatchKVCache([0, 0])
    c.update_and_fetch(*rows(3, b=2))
    assert c.trim(3) == 3 and c.layout == B.BatchLayout(0, (0, 0)) and not c.empty()
    c.prepare(left_padding=[1, 0])
    k, v = rows(2, b=2, seed=4)
    c.update_and_fetch(k, v)
    want = sb.announced_block(sb.BatchLayout(0, (0, 0)), (1, 0), 2)
    assert (c.layout.idx, c.layout.pads) == (want.idx, want.pads)
    got = c.fetch_sequence(0)
    assert np.array_equal(np.array(got[0]), np.array(k[0:1, :, 1:])) and c.offset.tolist() == [1, 2]


def test_numpy_indices_and_padding_are_taken_as_lists_are():
    batch = KVCache.merge([filled(KVCache, 2), filled(KVCache, 1, seed=5)])
    batch.filter(np.array([1, 0]))
    assert batch.layout == B.BatchLayout(2, (1, 0))
    c = BatchKVCache([0, 0])
    c.prepare(left_padding=np.array([1, 0]))
    assert c.layout == B.BatchLayout(0, (1, 0))
    with pytest.raises(InvalidArgumentError, match=re.escape("must be a 1-D list of integers")):
        c.prepare(right_padding=np.zeros((1, 2), dtype=int))
