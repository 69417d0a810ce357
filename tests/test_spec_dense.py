"""Unit tests of the dense spec: each rule of semantics.md section 2."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.spec import dense as sd
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError


def appended(cache, *sizes, start=0):
    token = start
    for n in sizes:
        _, cache = sd.append(cache, tuple(range(token, token + n)))
        token += n
    return cache


def test_regrow_rule_capacity_is_prev_plus_steps():
    assert sd.regrow_capacity(5, 1, 4) == 9
    assert sd.regrow_capacity(5, 4, 4) == 9
    assert sd.regrow_capacity(5, 5, 4) == 13
    assert sd.regrow_capacity(0, 1, 1) == 1


def test_regrow_after_logical_trim_cuts_the_stale_tail():
    c = appended(sd.new_cache(step=4), 4)
    _, c = sd.trim(c, 1)
    assert (c.capacity, c.live_len) == (4, 3)
    result, c = sd.append(c, (10, 11))
    assert result.regrew and c.capacity == 7  # 3 + ceil(2/4)*4, not 8
    assert c.window() == (0, 1, 2, 10, 11)


def test_first_decode_after_copy_goes_in_place_and_trim_breaks_it():
    c = appended(sd.new_cache(step=8), 3)
    r, c = sd.append(c, (3,))
    assert r.inplace
    _, c = sd.trim(c, 1)
    r, c = sd.append(c, (4,))
    assert not r.inplace  # prev != marker.live_len
    r, c = sd.append(c, (5,))
    assert r.inplace


@pytest.mark.parametrize("mode", ["int8", "turbo4", "turbo3asym"])
def test_only_fp16_writes_in_place(mode):
    c = appended(sd.new_cache(mode=mode, step=8), 3)
    r, _ = sd.append(c, (3,))
    assert not r.inplace


def test_switch_off_never_writes_in_place():
    c = appended(sd.new_cache(step=8, inplace=False), 3, 1, 1)
    r, _ = sd.append(c, (9,))
    assert not r.inplace


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("0", False), ("false", False), (" OFF ", False), ("no", False), ("yes", True)])
def test_inplace_switch_values(value, on):
    assert sd.inplace_switch(value) is on


def test_trim_clamps_and_logical_vs_physical():
    c = appended(sd.new_cache(step=4), 3)
    assert sd.trim(c, -1)[0] == 0
    assert sd.trim(c, 9)[0] == 3
    n, fp = sd.trim(c, 1)
    assert n == 1 and fp.capacity == 4 and fp.buffer == c.buffer
    n, t4 = sd.trim(appended(sd.new_cache(mode="turbo4", step=4), 3), 1)
    assert t4.capacity == 2


def test_trim_to_zero_drops_buffers():
    c = appended(sd.new_cache(step=4), 3)
    n, c = sd.trim_to(c, 0)
    assert n == 3 and c.buffer is None and c.marker is None and c.window() == ()


@pytest.mark.parametrize("length", [-1, 4])
def test_trim_to_out_of_range_is_refused(length):
    c = appended(sd.new_cache(step=4), 3)
    with pytest.raises(InvalidArgumentError, match="trim_to: len"):
        sd.trim_to(c, length)


def test_front_trim_keeps_sinks_and_offset():
    c = appended(sd.new_cache(step=4), 6)
    n, c = sd.trim_front_keep_sink(c, 2, keep=1)
    assert n == 2 and c.window() == (0, 3, 4, 5) and c.offset == 6 and c.live_start == 2
    assert [e.position for e in c.entries] == [0, 3, 4, 5]


def test_front_trim_clamps_keep_and_n():
    c = appended(sd.new_cache(step=4), 3)
    n, c2 = sd.trim_front_keep_sink(c, 2, keep=5)
    assert n == 2 and c2.window() == (0,)
    n, c3 = sd.trim_front_keep_sink(c, 9)
    assert n == 3 and c3.window() == () and c3.buffer is None and c3.offset == 3


def test_front_trim_is_a_noop_in_turbo_modes():
    c = appended(sd.new_cache(mode="turbo4asym", step=4), 3)
    assert sd.trim_front_keep_sink(c, 1) == (0, c)


@pytest.mark.parametrize("positions,error", [((), InvalidArgumentError), ((1, 0), InvalidArgumentError),
                                             ((0, 0), InvalidArgumentError), ((0, 3), InvalidArgumentError),
                                             ((-1,), InvalidArgumentError)])
def test_gather_positions_refusals(positions, error):
    c = appended(sd.new_cache(step=4), 3)
    with pytest.raises(error, match="gather_positions: positions"):
        sd.gather_positions(c, positions)


def test_gather_positions_refused_after_front_trim_and_in_delegated():
    c = appended(sd.new_cache(step=4), 3)
    _, c = sd.trim_front_keep_sink(c, 1)
    with pytest.raises(StateError, match="live_start"):
        sd.gather_positions(c, (0,))
    with pytest.raises(UnsupportedOperationError):
        sd.gather_positions(appended(sd.new_cache(mode="turbo4delegated"), 2), (0,))


def test_gather_identity_is_a_noop_and_gather_compacts():
    c = appended(sd.new_cache(step=4), 3)
    assert sd.gather_positions(c, (0, 1, 2)) == (3, c)
    n, g = sd.gather_positions(c, (0, 2))
    assert n == 2 and g.window() == (0, 2) and g.offset == 2 and g.capacity == 2


def test_gather_within_tail():
    c = appended(sd.new_cache(step=8), 5)
    n, g = sd.gather_within_tail(c, 3, (0, 2))
    assert n == 4 and g.window() == (0, 1, 2, 4) and g.capacity == 8 and g.offset == 4
    with pytest.raises(InvalidArgumentError, match="tail_len"):
        sd.gather_within_tail(c, 6, (0,))
    with pytest.raises(InvalidArgumentError, match="kept"):
        sd.gather_within_tail(c, 2, (2,))


def test_world_snapshot_restore_detach_install():
    w = sd.new_world(step=4)
    _, w = sd.w_append(w, 3)
    _, w = sd.w_snapshot(w, "s")
    with pytest.raises(StateError, match="already in use"):
        sd.w_snapshot(w, "s")
    _, w = sd.w_append(w, 1)
    _, w = sd.w_restore(w, "s")
    assert w.cache.window() == (0, 1, 2) and w.cache.marker is None
    r, w = sd.w_append(w, 1)
    assert not r.inplace and r.window == (0, 1, 2, 4)
    _, w = sd.w_detach(w, "h")
    assert w.cache.window() == () and sd.is_empty(w.cache)
    n, w = sd.w_handle_trim_to(w, "h", 2)
    assert n == 2 and sd.view_of(w, "h") == (0, 1)
    _, w = sd.w_install(w, "h")
    assert w.cache.window() == (0, 1) and "h" not in w.holders
    with pytest.raises(StateError, match="already installed"):  # the consumed handle, handed in again
        sd.w_install(w, "h")
    with pytest.raises(StateError, match="no snapshot or handle"):
        sd.w_install(w, "never")


def test_install_requires_an_empty_cache():
    w = sd.new_world(step=4)
    _, w = sd.w_append(w, 2)
    _, w = sd.w_detach(w, "h")
    _, w = sd.w_append(w, 1)
    with pytest.raises(StateError, match="requires an empty cache"):
        sd.w_install(w, "h")


def test_hold_needs_an_append():
    with pytest.raises(StateError, match="hold"):
        sd.w_hold(sd.new_world())


@given(st.lists(st.integers(1, 6), min_size=1, max_size=6), st.integers(0, 10), st.integers(1, 6), st.integers(1, 8))
def test_trim_then_append_equals_never_appending(sizes, k, extra, step):
    """semantics.md 5.2 at the level of identities and positions."""
    c = appended(sd.new_cache(step=step), *sizes)
    total = sum(sizes)
    n, trimmed = sd.trim(c, k)
    _, after = sd.append(trimmed, tuple(range(100, 100 + extra)))
    kept = tuple(range(total - n))
    assert after.window() == kept + tuple(range(100, 100 + extra))
    assert [e.position for e in after.entries] == list(range(total - n + extra))


@given(st.lists(st.tuples(st.sampled_from(["append", "trim", "front"]), st.integers(-2, 6)), max_size=20), st.integers(1, 8))
def test_offsets_invariant(ops, step):
    """semantics.md 5.6: 0 <= live_start <= offset, live_len <= capacity."""
    c = sd.new_cache(step=step)
    token = 0
    for kind, n in ops:
        if kind == "append" and n >= 1:
            _, c = sd.append(c, tuple(range(token, token + n)))
            token += n
        elif kind == "trim":
            _, c = sd.trim(c, n)
        elif kind == "front":
            _, c = sd.trim_front_keep_sink(c, n, keep=1)
        assert 0 <= c.live_start <= c.offset
        assert c.live_len <= c.capacity
        assert len(c.entries) == c.live_len


def test_handle_cut_is_a_view_of_the_same_memory():
    """handle_trim_to keeps the buffer identity (a cut is a view, not a
    copy) with the new length, and drops the buffer at zero live rows."""
    c = appended(sd.new_cache(step=4), 3)
    h = sd.holder_of(c, "handle")
    n, h1 = sd.handle_trim_to(h, 1)
    assert n == 2 and h1.buffer == sd.Buffer(c.buffer.ident, 1) and h1.window() == (0,)
    n, h0 = sd.handle_trim_to(h, 0)
    assert n == 3 and h0.buffer is None and h0.window() == ()
    assert sd.handle_trim_to(h, 3) == (0, h)


def test_apply_op_defaults_and_unknown_ops():
    """kvtrace ops on the spec world: trim_front's keep defaults to 0, and an
    op the dense cache does not have is refused by name."""
    w = sd.new_world(step=4)
    _, w = sd.apply_op(w, {"op": "append", "n": 3})
    n, w2 = sd.apply_op(w, {"op": "trim_front", "n": 1})
    assert n == 1 and w2.cache.window() == (1, 2)
    with pytest.raises(InvalidArgumentError) as info:
        sd.apply_op(w, {"op": "make_mask", "n": 1})
    assert str(info.value) == "make_mask: not an operation of a dense cache"
