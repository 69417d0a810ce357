"""Unit tests of impl.rotating.RotatingKVCache."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from impl.rotating import RotatingKVCache
from spec.errors import InvalidArgumentError, StateError


def row(t, n=1):
    base = np.arange(t, t + n, dtype=np.float16)[None, None, :, None]
    return mx.array(np.broadcast_to(base, (1, 1, n, 4)).copy())


def firsts(a):
    return [int(x) for x in np.array(a)[0, 0, :, 0]]


def test_warmup_in_place_steady_state_copies():
    c = RotatingKVCache(4, step=4)
    seen = []
    for t in range(6):
        c.update_and_fetch(row(t), row(t))
        seen.append(c.last_write_inplace)
    assert seen == [False, True, True, True, False, False]
    assert firsts(c.fetch()[0]) == [4, 5, 2, 3]


def test_snapshot_of_full_ring_survives_steady_state():
    c = RotatingKVCache(3, keep=1, step=1)
    for t in range(3):
        c.update_and_fetch(row(t), row(t))
    snap = c.snapshot()
    for t in range(3, 8):
        c.update_and_fetch(row(t), row(t))
    assert firsts(snap.fetch()[0]) == [0, 1, 2]


def test_trim_refused_after_wrap():
    c = RotatingKVCache(3, step=1)
    for t in range(4):
        c.update_and_fetch(row(t), row(t))
    assert not c.is_trimmable() and c.trim(1) == 0
    with pytest.raises(StateError, match="wrapped"):
        c.trim_to(2)


def test_prefill_returns_more_than_window():
    c = RotatingKVCache(3, step=2)
    k, _ = c.update_and_fetch(row(0, 5), row(0, 5))
    assert firsts(k) == [0, 1, 2, 3, 4]


def test_make_mask_forms():
    c = RotatingKVCache(4, keep=1, step=1)
    assert c.make_mask(3) == "causal"
    c.update_and_fetch(row(0, 3), row(0, 3))
    m = np.array(c.make_mask(3))
    # query positions 3, 4, 5 over keys 0..5: window 4 with one sink
    assert m.tolist() == [[1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 1, 0], [1, 0, 0, 1, 1, 1]]
    for t in range(3, 9):
        c.update_and_fetch(row(t), row(t))
    assert c.make_mask(1) is None
    m = np.array(c.make_mask(1, window_size=3))
    assert m.sum() == 3


def test_arguments_are_checked():
    with pytest.raises(InvalidArgumentError, match="keep must satisfy"):
        RotatingKVCache(4, keep=4)
    with pytest.raises(InvalidArgumentError, match="max_size must be >= 1"):
        RotatingKVCache(0)


def test_protocol_round_trip():
    c = RotatingKVCache(4, keep=1, step=2)
    for t in range(6):
        c.update_and_fetch(row(t), row(t))
    c2 = RotatingKVCache.from_state(c.state, c.meta_state)
    assert (c2.offset, c2.idx, c2.max_size, c2.keep) == (c.offset, c.idx, 4, 1)
    assert firsts(c2.fetch()[0]) == firsts(c.fetch()[0])
    assert c.size() == 4 and c.nbytes > 0


def test_warmup_inplace_write_really_aliases_the_buffer():
    c = RotatingKVCache(8, step=8)
    c.update_and_fetch(row(0), row(0))
    keys = c.keys
    mx.eval(keys)
    ptr = np.array(keys, copy=False).ctypes.data
    c.update_and_fetch(row(1), row(1))
    assert c.last_write_inplace and c.keys is keys
    assert np.array(c.keys, copy=False).ctypes.data == ptr
    for t in range(2, 9):
        c.update_and_fetch(row(t), row(t))
    assert not c.last_write_inplace and c.keys is not keys  # steady state copies


@settings(max_examples=150)
@given(st.integers(1, 6).flatmap(lambda w: st.tuples(
    st.just(w), st.integers(0, w - 1), st.integers(1, 3),
    st.lists(st.integers(1, 4), max_size=8), st.integers(1, 5), st.one_of(st.none(), st.integers(1, 8)))))
def test_make_mask_equals_the_spec_in_both_forms(case):
    """The vectorized make_mask: the array form is the spec's matrix, and a
    short form (None, "causal") is returned only when it is that matrix."""
    from spec import rotating as sr

    w, keep, step, appends, n, window = case
    c = RotatingKVCache(max_size=w, keep=keep, step=step)
    s = sr.new_cache(w, keep, step)
    token = 0
    for k in appends:
        x = mx.zeros((1, 1, k, 2), dtype=mx.float16)
        c.update_and_fetch(x, x)
        _, s = sr.append(s, tuple(range(token, token + k)))
        token += k
    want = [list(r) for r in sr.make_mask_spec(s, n, window)]
    assert np.array(c.make_mask(n, window_size=window, return_array=True)).tolist() == want
    short = c.make_mask(n, window_size=window)
    L = len(want[0])
    if short is None:
        assert n == 1 and all(want[0])
    elif isinstance(short, str):
        assert short == "causal" and want == [[j <= L - n + i for j in range(L)] for i in range(n)]
    else:
        assert np.array(short).tolist() == want
        assert not (n == 1 and all(want[0]))
        assert want != [[j <= L - n + i for j in range(L)] for i in range(n)]
