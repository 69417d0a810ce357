"""impl states its own rules (the import contract in pyproject.toml forbids
impl -> spec rules): each against the spec function it must agree with,
exhaustively over a small box and on drawn larger inputs. A disagreement is
a bug on one side; that both sides were written apart is what lets the
differential fuzzer see a bug in either."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.impl import dense as idense
from kvspec.impl import layers as ilayers
from kvspec.impl import turbo as iturbo
from kvspec.impl import turbo_quant as tq
from kvspec.spec import dense as sd
from kvspec.spec import layers as sl
from kvspec.spec import turbo as stb
from kvspec.spec.errors import InvalidArgumentError


def _impl_fold(cold: int, live: int, n: int, threshold: int, block: int) -> int:
    c = iturbo.DelegatedKVCache(hot_threshold=threshold, fold_block=block)
    c.cold_offset = cold  # _fold_count reads the counters only
    return c._fold_count(live, n)


def test_fold_schedule_small_box():
    for cold, hot, n, t, b in itertools.product(range(5), range(6), range(1, 6), range(5), range(1, 5)):
        live = cold + hot
        assert _impl_fold(cold, live, n, t, b) == stb.fold_schedule(cold, live, n, t, b), (cold, live, n, t, b)


@given(st.integers(0, 400), st.integers(0, 400), st.integers(1, 300), st.integers(0, 300), st.integers(1, 200))
def test_fold_schedule_drawn(cold, hot, n, t, b):
    assert _impl_fold(cold, cold + hot, n, t, b) == stb.fold_schedule(cold, cold + hot, n, t, b)


BOUNDS = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)).map(lambda p: (p[0], min(p))), max_size=5)


def test_list_trim_count_small_box():
    pairs = [(r, e) for r in range(4) for e in range(r + 1)]
    for k in range(4):
        for bounds in itertools.product(pairs, repeat=k):
            for n in range(-1, 5):
                assert ilayers._list_trim_count(n, list(bounds)) == sl.list_trim_count(n, bounds), (n, bounds)


@given(st.integers(-5, 60), BOUNDS)
def test_list_trim_count_drawn(n, bounds):
    assert ilayers._list_trim_count(n, bounds) == sl.list_trim_count(n, tuple(bounds))


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except InvalidArgumentError as e:
        return ("refused", str(e))


@pytest.mark.parametrize("value", [None, 0, 1, 2, 7, -1, -5, 1.0, 2.5, True, False, "3", 10**9])
def test_window_size_rule(value):
    assert _outcome(idense.check_window_size, "make_mask", value) == _outcome(sd.check_window_size, "make_mask", value)


def test_constants_agree():
    assert idense.MAX_STEP == sd.MAX_STEP
    assert tq.MAX_HEAD_DIM == stb.MAX_HEAD_DIM


@pytest.mark.parametrize("bits", [3, 4])
def test_head_dim_rule(bits):
    for h in [*range(-2, 70), 96, 128, 4096, 8192, 8193, 16384]:
        assert _outcome(tq.check_head_dim, "values", h, bits) == _outcome(stb.check_head_dim, "values", h, bits), h


@pytest.mark.parametrize("mode", ["turbo4asym", "turbo4", "turbo3asym", "turbo4delegated"])
def test_append_head_dims_rule(mode):
    import mlx.core as mx

    spec_mode = sd.Mode(mode)
    for dk, dv in itertools.product([2, 4, 6, 8, 16, 24], repeat=2):
        c = iturbo.make_cache(mode)
        k, v = mx.zeros((1, 1, 1, dk)), mx.zeros((1, 1, 1, dv))
        want = _outcome(stb.check_append_head_dims, spec_mode, dk, dv)
        try:
            c.update_and_fetch(k, v)
            got = ("ok", None)
        except InvalidArgumentError as e:
            got = ("refused", str(e))
        assert got[0] == want[0] and (got[0] == "ok" or got[1] == want[1]), (dk, dv, got, want)
