"""The recurrent kind in batched generation (issue 48): a batch
``RecurrentCache`` in lockstep with B single ones (``kvspec.fuzz.batch``'s
recurrent run), its injected bugs caught, and the batch operations'
refusals (kvspec.spec.batch, semantics.md 7: InvalidArgumentError, nothing
changed)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from kvspec.fuzz.batch import RecurrentShape, catch, recurrent_campaign, run_recurrent_program
from kvspec.fuzz.bugs.batch import RECURRENT_BUGS
from kvspec.fuzz.recurrent import FakeModel
from kvspec.impl.recurrent import RecurrentCache, record_steps
from kvspec.spec.errors import InvalidArgumentError


def _single(tokens: int, dtype=mx.float16, kernel: int = 3, channels: int = 2, size: int = 2, seed: int = 0):
    model = FakeModel(kernel, size)
    record_steps(model)
    c = RecurrentCache(size=size, depth=1)
    if tokens:
        x = mx.array(np.random.default_rng(seed).standard_normal((1, tokens, channels)).astype(np.float32) + 0.25)
        model(x.astype(dtype), None, c)
    return c


def _held(c):
    return [None if a is None else (str(a.dtype), np.array(a.astype(mx.float32)).tobytes()) for a in c.cache]


# -- the lockstep ---------------------------------------------------------------------------
def test_batch_recurrent_caches_agree_with_single_caches():
    result = recurrent_campaign(max_examples=60)
    assert result.ok, result.failure
    assert result.examples == 60 and result.steps > 60


def test_a_chunked_right_padded_block_by_hand():
    """BatchGenerator's prefill: prepare(lengths, right_padding), the block
    in chunks (advance lowers lengths), finalize; the short sequence's conv
    window and state are its own tokens', never the padding's."""
    program = (RecurrentShape(kernel=3, channels=2, size=2, depth=1, dtype="bfloat16"), ("merge", (2, 0, 3)),
               [("block", ((1, 5, 3), 2)), ("decode", None), ("filter", (2, 0)), ("extend", (0, 4)),
                ("extract", 1), ("block", ((4, 1, 2, 3), 3))])
    log: list[str] = []
    run_recurrent_program(program, seed=3, log=log)
    assert len(log) == 7  # every op ran and was checked


@pytest.mark.parametrize("bug", RECURRENT_BUGS, ids=lambda b: b.name)
def test_every_recurrent_batch_bug_is_caught(bug):
    result = catch(bug, max_examples=200, shrink=False)
    assert result.caught, f"{bug.name} not caught in {result.examples} programs: {result.failure}"
    assert result.examples < 100


def test_a_harness_failure_is_no_catch(monkeypatch):
    """A lockstep whose own code raises (here: the dense run's decode, in
    fuzz/, on a recurrent run) is a tool failure, never a divergence."""
    import kvspec.fuzz.batch as fb

    monkeypatch.setattr(fb.RecurrentRun, "decode", fb.Run.decode)
    result = recurrent_campaign(max_examples=60, shrink=False)
    assert result.status == "tool failure" and not result.caught, result.failure
    assert "the harness raised" in result.failure


# -- the refusals ---------------------------------------------------------------------------------
def test_filter_and_extract_refuse_bad_indices_and_change_nothing():
    batch = RecurrentCache.merge([_single(2), _single(0), _single(3, seed=1)])
    batch.prepare(lengths=[1, 2, 3])
    before, lengths = _held(batch), np.array(batch.lengths).tolist()
    for bad in ([0, 0], [3], [-1], [], [True], [0.5], mx.array([[0]]), mx.array([0.0]), "0"):
        with pytest.raises(InvalidArgumentError, match="batch_indices"):
            batch.filter(bad)
        assert _held(batch) == before and np.array(batch.lengths).tolist() == lengths
    for bad in (3, -1, True, 1.0, None):
        with pytest.raises(InvalidArgumentError, match=r"idx must be an integer in \[0, 3\)"):
            batch.extract(bad)
    batch.filter([np.int64(2), 0])  # an ordered subset (NumPy integers too): kept in the order asked for
    assert np.array(batch.lengths).tolist() == [3, 1]
    assert _held(batch)[0][1] == np.array(
        mx.concatenate([_single(3, seed=1)[0], _single(2)[0]]).astype(mx.float32)).tobytes()
    batch.filter(mx.array([1]))
    assert batch.batch_size == 1


def test_merge_and_extend_refuse_arrays_that_do_not_fit_and_change_nothing():
    a, b = _single(2), _single(3, seed=1)
    odd = {"dtype": _single(2, dtype=mx.bfloat16), "kernel": _single(2, kernel=4),
           "channels": _single(2, channels=3), "size": _single(2, size=1)}
    for name, c in odd.items():
        inputs = [a, c, b]
        before = [_held(x) for x in inputs]
        with pytest.raises(InvalidArgumentError, match="does not fit|arrays \\(size\\)"):
            RecurrentCache.merge(inputs)
        assert [_held(x) for x in inputs] == before, name
        batch = RecurrentCache.merge([a, b])
        held = _held(batch)
        with pytest.raises(InvalidArgumentError, match="does not fit|arrays \\(size\\)"):
            batch.extend(RecurrentCache.merge([c]))
        assert _held(batch) == held, name
    for bad, rule in (([], "non-empty list"), ([a, "x"], "not a RecurrentCache"),
                      ([RecurrentCache.merge([a, b])], "batch size 2")):
        with pytest.raises(InvalidArgumentError, match=rule):
            RecurrentCache.merge(bad)
    with pytest.raises(InvalidArgumentError, match="must be a RecurrentCache"):
        RecurrentCache.merge([a]).extend(object())
    # an empty cache fits anything of its size: its zeros take the others' shape and dtype
    merged = RecurrentCache.merge([_single(0), odd["dtype"]])
    assert merged[0].dtype == mx.bfloat16 and not np.any(np.array(merged[0][0].astype(mx.float32)))


def test_a_cache_that_consumed_nothing_takes_any_index_it_cannot_check():
    """No array, no left padding, no lengths: the cache cannot tell its batch
    size (ArraysCache's batch_size says 1), so an index >= 0 is taken (the
    recurrent harness's batch-2 cache before its first call); a negative,
    duplicate or non-integer one is still refused."""
    c = RecurrentCache(size=2, depth=1)
    assert c.extract(1).cache == [None, None]
    c.filter([1, 0])
    for bad in ([-1], [1, 1], [], ["1"]):
        with pytest.raises(InvalidArgumentError, match="batch_indices"):
            c.filter(bad)
    with pytest.raises(InvalidArgumentError, match="idx must be an integer"):
        c.extract(-1)
