"""Batch caches (issue 24): the spec's layout rules, their Z3 model against
the spec, the lockstep of ``kvspec.impl.batch`` against B single caches, the
injected batch bugs caught, and the refusals."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
import z3

pytest.importorskip("mlx_lm")

from kvspec.fuzz.batch import campaign, catch
from kvspec.fuzz.bugs import batch_bugs, by_name
from kvspec.impl.batch import BatchKVCache
from kvspec.impl.dense import KVCache
from kvspec.impl.paged import BlockPool, PagedKVCache
from kvspec.impl.rotating import RotatingKVCache
from kvspec.impl.turbo import TurboKVCache
from kvspec.proofs import batch as pb
from kvspec.spec import batch as sb
from kvspec.spec.errors import InvalidArgumentError, UnsupportedOperationError


# -- the spec --------------------------------------------------------------------
def test_merge_filter_extend_trim_by_hand():
    lay = sb.merge((3, 0, 5))
    assert lay == sb.BatchLayout(5, (2, 5, 0)) and sb.offsets(lay) == (3, 0, 5)
    kept = sb.filter(lay, (1, 0))
    assert kept == sb.BatchLayout(3, (3, 0)) and sb.offsets(kept) == (0, 3)
    assert sb.extend(kept, sb.merge((1,))) == sb.BatchLayout(3, (3, 0, 2))
    assert sb.append_ragged(sb.merge((2, 2)), (1, 3)) == sb.BatchLayout(5, (2, 0))
    assert sb.trim(sb.merge((3, 1)), 2) == (1, sb.BatchLayout(2, (0, 2)))  # never past the shortest
    assert [j for j in range(6) if sb.visible(lay, 0, 5, j)] == [2, 3, 4, 5]
    for bad in (lambda: sb.merge(()), lambda: sb.filter(lay, (0, 0)), lambda: sb.filter(lay, (3,)),
                lambda: sb.extract(lay, 3), lambda: sb.append_ragged(lay, (1,))):
        with pytest.raises(InvalidArgumentError):
            bad()


def _val(expr):
    return z3.simplify(expr).as_long() if not z3.is_bool(expr) else z3.is_true(z3.simplify(expr))


def test_the_z3_model_is_the_spec():
    """proofs/batch.py's encodings equal spec/batch.py on sampled integers."""
    rng = random.Random(0)
    for _ in range(300):
        lengths = [rng.randint(0, 9) for _ in range(pb.B)]
        idx, pads = pb.merge([z3.IntVal(n) for n in lengths])
        assert sb.BatchLayout(_val(idx), tuple(_val(p) for p in pads)) == sb.merge(tuple(lengths))
        lay = sb.merge(tuple(lengths))
        zi, zp = z3.IntVal(lay.idx), [z3.IntVal(p) for p in lay.pads]
        keep = tuple(rng.sample(range(pb.B), 2))
        fi, fp = pb.filter_(zi, zp, [z3.IntVal(k) for k in keep])
        assert sb.BatchLayout(_val(fi), tuple(_val(p) for p in fp)) == sb.filter(lay, keep)
        other = sb.merge(tuple(rng.randint(0, 9) for _ in range(pb.B)))
        ei, ep = pb.extend((zi, zp), (z3.IntVal(other.idx), [z3.IntVal(p) for p in other.pads]))
        assert sb.BatchLayout(_val(ei), tuple(_val(p) for p in ep)) == sb.extend(lay, other)
        block = tuple(rng.randint(0, 4) for _ in range(pb.B))
        ri, rp = pb.append_ragged(zi, zp, [z3.IntVal(n) for n in block])
        assert sb.BatchLayout(_val(ri), tuple(_val(p) for p in rp)) == sb.append_ragged(lay, block)
        empty = sb.merge((0,) * pb.B)
        left, width = tuple(rng.randint(0, 3) for _ in range(pb.B)), rng.randint(0, 4)
        refused, ai, ap = pb.announced_block(z3.IntVal(0), [z3.IntVal(p) for p in empty.pads],
                                             [z3.IntVal(q) for q in left], z3.IntVal(width))
        try:
            want, spec_refused = sb.announced_block(empty, left, width), False
        except InvalidArgumentError:
            want, spec_refused = empty, True
        assert (_val(refused), sb.BatchLayout(_val(ai), tuple(_val(p) for p in ap))) == (spec_refused, want)
        n = rng.randint(-2, 12)
        assert _val(pb.trim_count(zi, zp, z3.IntVal(n))) == sb.trim_count(lay, n)
        q, k = rng.randint(0, lay.idx), rng.randint(0, lay.idx)
        assert _val(pb.visible(zp[0], z3.IntVal(q), z3.IntVal(k))) == sb.visible(lay, 0, q, k)


def test_the_mask_rule_is_mlx_lms_batch_mask():
    """kvspec.spec.batch.visible (with and without a window) equals the mask
    mlx-lm's model code builds for a left-padded batch
    (``create_causal_mask(N, offset, window_size, left_padding=...)``), on
    every small layout: an independent pin of the rule, since the lockstep
    checks the implementation against the spec and the Z3 model has no
    window (a spec and an implementation agreeing on ``<= window`` passed)."""
    from mlx_lm.models.base import create_causal_mask

    for idx in range(5):
        for pads in {(p, q) for p in range(idx + 1) for q in (0, idx)}:
            lay = sb.BatchLayout(idx, pads)
            for n in (1, 3):
                for window in (None, 1, 2, 4):
                    want = np.array(create_causal_mask(n, idx, window_size=window, left_padding=mx.array(pads)))
                    for i in range(2):
                        for q in range(n):
                            got = [sb.visible(lay, i, idx + q, j, window) for j in range(idx + n)]
                            assert got == want[i, 0, q].tolist(), (lay, i, q, n, window)


def test_the_obligation_is_proved_and_every_control_refuted():
    result = pb.prove_batch()
    assert result.status == "proved", result
    assert sorted(c.name for c in result.controls) == sorted(b.name for b in batch_bugs())
    assert all(c.status == "refuted" for c in result.controls)


# -- the lockstep ------------------------------------------------------------------
@pytest.mark.parametrize("ring", [False, True])
def test_batch_caches_agree_with_single_caches(ring):
    result = campaign(ring, max_examples=60)
    assert result.ok, result.failure
    assert result.examples == 60


@pytest.mark.parametrize("name", [b.name for b in batch_bugs()])
def test_every_batch_bug_is_caught_by_the_lockstep(name):
    result = catch(by_name(name), max_examples=200, shrink=False)
    assert not result.ok, f"{name} not caught in {result.examples} programs"
    assert result.examples < 100  # caught early, not by luck at the end


# -- refusals and the protocol ---------------------------------------------------------
def rows(n, h=2, d=4):
    return mx.array(np.random.default_rng(n).standard_normal((1, h, n, d)).astype(np.float16))


def test_merge_refuses_what_a_batch_cannot_hold():
    int8 = KVCache("int8")
    int8.update_and_fetch(rows(2), rows(2))
    with pytest.raises(UnsupportedOperationError, match="stores mode 'int8'"):
        KVCache.merge([KVCache(), int8])
    front = KVCache()
    front.update_and_fetch(rows(3), rows(3))
    front.trim_front_keep_sink(1, keep=1)
    with pytest.raises(UnsupportedOperationError, match="live_start=1"):
        KVCache.merge([front])
    # no merge at all: mlx-lm's probe (hasattr(cache, "merge"), its server's test for batching) says no,
    # and its _merge_caches refuses naming the class
    assert not hasattr(TurboKVCache("turbo4"), "merge") and not hasattr(PagedKVCache(BlockPool(2)), "merge")
    with pytest.raises(UnsupportedOperationError, match="sinks"):
        RotatingKVCache.merge([RotatingKVCache(max_size=4, keep=1)])
    a, b = KVCache(), KVCache()
    a.update_and_fetch(rows(2), rows(2))
    b.update_and_fetch(rows(2, h=1), rows(2, h=1))
    with pytest.raises(InvalidArgumentError, match="share heads"):
        KVCache.merge([a, b])


def _filled(cls, n, h=2, dk=4, dv=4, dtype=mx.float16, **kw):
    c = cls(**kw)
    k = mx.array(np.random.default_rng(n).standard_normal((1, h, n, dk))).astype(dtype)
    v = mx.array(np.random.default_rng(n + 1).standard_normal((1, h, n, dv))).astype(dtype)
    c.update_and_fetch(k, v)
    return c


def _snap(c):
    return (c.offset, [np.array(a.astype(mx.float32)).tobytes() if isinstance(a, mx.array) else a for a in c.state])


def _lm(name):
    from mlx_lm.models import cache

    return getattr(cache, name)


MERGE_REFUSALS = {
    # name: (caches, error, message) -- one per guard of KVCache.merge / RotatingKVCache.merge
    "dense_no_caches": (list, KVCache, InvalidArgumentError, "at least one cache"),
    "dense_not_dense": (lambda: [_filled(KVCache, 2), _filled(RotatingKVCache, 2, max_size=4)], KVCache,
                        UnsupportedOperationError, r"cache 1 is a kvspec\.impl\.rotating\.RotatingKVCache; "),
    "dense_heads": (lambda: [_filled(KVCache, 2), _filled(KVCache, 2, h=1)], KVCache, InvalidArgumentError,
                    "share heads"),
    "dense_k_dim": (lambda: [_filled(KVCache, 2), _filled(KVCache, 3, dk=2)], KVCache, InvalidArgumentError,
                    "head dims"),
    "dense_v_dim": (lambda: [_filled(KVCache, 2), _filled(KVCache, 3, dv=6)], KVCache, InvalidArgumentError,
                    "head dims"),
    "dense_dtype": (lambda: [_filled(KVCache, 2), _filled(KVCache, 3, dtype=mx.bfloat16)], KVCache,
                    InvalidArgumentError, "dtype"),
    "dense_mlx_lms": (lambda: [_filled(KVCache, 2), _filled(_lm("KVCache"), 2)], KVCache, UnsupportedOperationError,
                      r"cache 1 is a mlx_lm\.models\.cache\.KVCache; .*cannot share a batch"),
    "ring_mlx_lms": (lambda: [_filled(RotatingKVCache, 2, max_size=4), _filled(_lm("RotatingKVCache"), 2, max_size=4)],
                     RotatingKVCache, UnsupportedOperationError,
                     r"cache 1 is a mlx_lm\.models\.cache\.RotatingKVCache; .*cannot share a batch"),
    "ring_no_caches": (list, RotatingKVCache, InvalidArgumentError, "at least one cache"),
    "ring_not_ring": (lambda: [_filled(RotatingKVCache, 2, max_size=4), _filled(KVCache, 2)], RotatingKVCache,
                      UnsupportedOperationError, r"cache 1 is a kvspec\.impl\.dense\.KVCache; "),
    "ring_windows": (lambda: [_filled(RotatingKVCache, 2, max_size=4), _filled(RotatingKVCache, 2, max_size=5)],
                     RotatingKVCache, InvalidArgumentError, "share max_size"),
    "ring_heads": (lambda: [_filled(RotatingKVCache, 3, max_size=4), _filled(RotatingKVCache, 2, h=1, max_size=4)],
                   RotatingKVCache, InvalidArgumentError, "share heads"),
    "ring_v_dim": (lambda: [_filled(RotatingKVCache, 3, max_size=4), _filled(RotatingKVCache, 2, dv=2, max_size=4)],
                   RotatingKVCache, InvalidArgumentError, "head dims"),
    "ring_dtype": (lambda: [_filled(RotatingKVCache, 3, max_size=4),
                            _filled(RotatingKVCache, 2, dtype=mx.bfloat16, max_size=4)],
                   RotatingKVCache, InvalidArgumentError, "dtype"),
    "ring_sinks": (lambda: [_filled(RotatingKVCache, 2, max_size=4), _filled(RotatingKVCache, 2, max_size=4, keep=1)],
                   RotatingKVCache, UnsupportedOperationError, "cache 1 keeps 1 sinks"),
}


@pytest.mark.parametrize("name", sorted(MERGE_REFUSALS))
def test_every_merge_guard_refuses_and_leaves_the_caches_as_they_were(name):
    """Each guard of merge, one case apiece (a guard removed, e.g. caches of
    two dtypes merged into one buffer with a silent cast, or rings of two
    windows merged on the first one's, passed every other test; the ring's
    merge had no shape or dtype guard at all: one head broadcast into all,
    bfloat16 cast to float16)."""
    make, cls, err, msg = MERGE_REFUSALS[name]
    caches = make()
    before = [_snap(c) for c in caches]
    with pytest.raises(err, match=msg):
        cls.merge(caches)
    assert [_snap(c) for c in caches] == before


def test_announced_left_padding_is_mlx_lms():
    """An empty batch built with ``left_padding`` and given more by
    ``prepare(left_padding=...)`` (mlx-lm's protocol; the lockstep starts
    from merges only, so a prepare replacing the padding instead of adding
    to it passed) holds what mlx-lm's BatchKVCache holds after the same
    calls: offsets and padding before and after the first block, and the
    mask; a prepare after rows is refused."""
    from mlx_lm.models.cache import BatchKVCache as LmBatch

    ours, theirs = BatchKVCache([1, 0, 2]), LmBatch([1, 0, 2])
    for c in (ours, theirs):
        c.prepare(left_padding=[2, 1, 0])
    assert ours.offset.tolist() == theirs.offset.tolist() == [-3, -1, -2]
    assert ours.left_padding.tolist() == theirs.left_padding.tolist()
    k = mx.array(np.random.default_rng(0).standard_normal((3, 2, 5, 4)).astype(np.float16))
    for c in (ours, theirs):
        c.update_and_fetch(k, k)
    assert ours.offset.tolist() == theirs.offset.tolist() == [2, 4, 3]
    assert (ours.layout.idx, ours.layout.pads) == (5, (3, 1, 2))
    for n in (1, 2):
        assert np.array(ours.make_mask(n, return_array=True)).tolist() == \
            np.array(theirs.make_mask(n, return_array=True)).tolist()
    with pytest.raises(InvalidArgumentError, match="only be added to an empty BatchKVCache"):
        ours.prepare(left_padding=[1, 1, 1])


def test_a_batch_filters_extends_and_extracts_our_caches():
    caches = []
    for n in (3, 1, 2):
        c = KVCache(step=2)
        c.update_and_fetch(rows(n), rows(n))
        caches.append(c)
    batch = KVCache.merge(caches)
    assert isinstance(batch, BatchKVCache) and batch.offset.tolist() == [3, 1, 2]
    mask = np.array(batch.make_mask(1))
    assert mask[1, 0, 0].tolist() == [False, False, True, True]  # sequence 1: padding hidden
    batch.filter([2, 1])
    assert (batch.layout.idx, batch.layout.pads) == (2, (0, 1))
    one = batch.extract(0)
    assert type(one) is KVCache and one.offset == 2
    assert [np.array(a).tobytes() for a in one.fetch()] == [np.array(a).tobytes() for a in caches[2].fetch()]
    batch.extend(KVCache.merge([KVCache()]))
    assert batch.offset.tolist() == [2, 1, 0]


def test_the_cli_refuses_a_batch_bug_where_there_is_no_kvtrace_kind(capsys):
    from kvspec.fuzz.commands.cli import main

    assert main(["fuzz", "--bug", "batch_padding_visible", "--budget", "1"]) == 2
    assert "kvspec e2e --only batch --bug batch_padding_visible" in capsys.readouterr().out
    assert main(["replay", "tests/traces/rotating_prefill_after_wrap.json", "--bug", "batch_merge_shifts_offset"]) == 2


@pytest.mark.parametrize("odd", ["dtype", "heads", "v_dim"])
def test_extend_refuses_a_batch_of_another_dtype_or_shape_and_changes_nothing(odd):
    # a float16 batch extended by a bfloat16 one used to turn every row float32 (mx.concatenate
    # promotes); other heads or head dims raised MLX's ValueError from the concatenation
    batch = KVCache.merge([_filled(KVCache, 3), _filled(KVCache, 2)])
    kw = {"dtype": {"dtype": mx.bfloat16}, "heads": {"h": 1}, "v_dim": {"dv": 6}}[odd]
    other = KVCache.merge([_filled(KVCache, 2, **kw)])
    before = [np.array(batch.fetch_sequence(i)[1]).tobytes() for i in range(2)]
    with pytest.raises(InvalidArgumentError, match="extend: both batches must share heads, head dims and dtype"):
        batch.extend(other)
    assert (batch.layout.idx, batch.layout.pads, batch.keys.dtype) == (3, (0, 1), mx.float16)
    assert [np.array(batch.fetch_sequence(i)[1]).tobytes() for i in range(2)] == before
