"""Unit tests of spec/turbo.py: the Turbo modes' physical layout and
Delegated's fold schedule (semantics.md 2, "Storage")."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from kvspec.spec import dense as sd
from kvspec.spec import turbo as st
from kvspec.spec.errors import InvalidArgumentError, KVCacheError, UnsupportedOperationError

M = st.Mode


def run(world, *ops):
    results = []
    for op in ops:
        r, world = st.apply_op(world, op)
        results.append(r)
    return results, world


def test_names_bits_and_quantized_parts():
    assert st.array_names(M.TURBO4ASYM) == ("keys", "v_norm", "v_packed", "v_rescale")
    assert st.array_names(M.TURBO3ASYM) == ("keys", "v_norm", "v_packed")
    assert st.array_names(M.TURBO4) == ("k_norm", "k_packed", "k_rescale", "v_norm", "v_packed", "v_rescale")
    assert st.bits_of(M.TURBO3ASYM) == 3 and st.bits_of(M.TURBO4DELEGATED) == 4
    assert st.quantized_rows(M.TURBO4, 2, 0) == ((True, True), (True, True))
    assert st.quantized_rows(M.TURBO4ASYM, 1, 0) == ((False, True),)
    assert st.quantized_rows(M.TURBO4DELEGATED, 3, 2) == ((False, True), (False, True), (False, False))


@pytest.mark.parametrize("d", range(1, 65))
def test_three_bit_byte_count_is_exact_iff_head_dim_is_a_multiple_of_8(d):
    assert (st.packed_bytes(d, 3) * 8 == 3 * d) == (d % 8 == 0)
    assert st.packed_bytes(d, 4) * 8 == 4 * d or d % 2


def test_head_dim_rule():
    assert [d for d in range(1, 70) if st.head_dim_allowed(d, 4)] == [2, 4, 8, 16, 32, 64]
    assert [d for d in range(1, 70) if st.head_dim_allowed(d, 3)] == [8, 16, 32, 64]
    assert not st.head_dim_allowed(16384, 4) and st.head_dim_allowed(8192, 4) and not st.head_dim_allowed(1, 4)


def test_handoff_and_block_folds():
    assert st.handoff_fold(0, 5, 1) and not st.handoff_fold(0, 5, 2)
    assert not st.handoff_fold(1, 5, 1) and not st.handoff_fold(0, 0, 1)
    # handoff: all 5 held rows fold, the new row stays hot
    assert st.fold_schedule(0, 5, 1, 256, 128) == 5
    # prefill of 9 with T=3, B=2: hot 9 -> 7 -> 5 -> 3
    assert st.fold_schedule(0, 0, 9, 3, 2) == 6
    # a partial last block only when fewer than a block is hot
    assert st.fold_schedule(0, 0, 3, 0, 5) == 3
    assert st.fold_schedule(4, 7, 1, 3, 2) == 2
    assert st.fold_schedule(4, 6, 1, 3, 2) == 0
    assert st.fold_block_rows(4, 3, 128) == 4 and st.fold_block_rows(3, 3, 1) == 0


@given(hs.integers(0, 12), hs.integers(0, 12), hs.integers(1, 9), hs.integers(0, 6), hs.integers(1, 6))
def test_fold_schedule_bounds_and_closed_form(cold, hot, n, T, B):
    live = cold + hot
    f = st.fold_schedule(cold, live, n, T, B)
    hand = live if st.handoff_fold(cold, live, n) else 0
    left = live - cold - hand + n
    k = -(-(left - T) // B) if left > T else 0
    assert f == hand + min(k * B, left)  # blocks of B, the last one partial only when left < B
    assert 0 <= f <= hot + n and hot + n - f <= T
    assert st.cold_offset_ok(cold + f, live + n)


def test_trim_takes_hot_rows_first():
    assert st.trim_split(4, 6, 1) == (1, 0)
    assert st.trim_split(4, 6, 3) == (2, 1)
    assert st.trim_split(0, 6, 6) == (6, 0)
    assert st.trim_split(6, 6, 2) == (0, 2)


def test_array_rows_follow_capacity_and_cold_offset():
    assert st.array_rows(M.TURBO3ASYM, 8, 5, 0) == {"keys": 8, "v_norm": 8, "v_packed": 8}
    assert st.array_rows(M.TURBO4DELEGATED, 8, 5, 2) == {
        "cold_norm": 2, "cold_packed": 2, "cold_rescale": 2, "hot": 3, "keys": 8}
    assert st.array_rows(M.TURBO4DELEGATED, 8, 5, 0) == {"hot": 5, "keys": 8}
    assert st.array_rows(M.TURBO4DELEGATED, 5, 5, 5) == {
        "cold_norm": 5, "cold_packed": 5, "cold_rescale": 5, "keys": 5}
    assert st.array_rows(M.TURBO4, 4, 0, 0) == {}


@pytest.mark.parametrize("mode", ["turbo4asym", "turbo4", "turbo3asym", "turbo4delegated"])
def test_trim_is_physical_and_front_trim_a_no_op(mode):
    w = st.new_world(mode, step=4, hot_threshold=2, fold_block=1)
    (_, n, front), w = run(w, {"op": "append", "n": 6}, {"op": "trim", "n": 1}, {"op": "trim_front", "n": 2})
    assert n == 1 and front == 0
    assert w.cache.capacity == w.cache.live_len == 5
    assert set(w.rows().values()) <= {5, w.cold_offset, 5 - w.cold_offset}
    assert w.cache.window() == (0, 1, 2, 3, 4)


def test_delegated_world_tracks_cold_offsets_of_holders():
    w = st.new_world("turbo4delegated", step=2, hot_threshold=3, fold_block=2)
    _, w = run(w, {"op": "append", "n": 3}, {"op": "hold"}, {"op": "snapshot", "name": "s"},
               {"op": "append", "n": 1})
    assert (w.cold_offset, w.held_cold, w.holder_cold["s"]) == (3, 0, 0)
    _, w = run(w, {"op": "hold"}, {"op": "trim", "n": 2})
    assert (w.cold_offset, w.held_cold, w.cache.live_len) == (2, 3, 2)
    _, w = run(w, {"op": "restore", "name": "s"})
    assert (w.cold_offset, w.cache.window()) == (0, (0, 1, 2))
    _, w = run(w, {"op": "append", "n": 1}, {"op": "detach", "name": "h"})
    assert (w.cold_offset, w.holder_cold["h"]) == (0, 3)
    (n,), w = run(w, {"op": "handle_trim_to", "name": "h", "len": 2})
    assert n == 2 and w.holder_cold["h"] == 2  # hot row first, then one cold row
    _, w = run(w, {"op": "install", "name": "h"})
    assert (w.cold_offset, "h" in w.holder_cold) == (2, False)
    _, w = run(w, {"op": "drop", "name": "s"}, {"op": "trim", "n": 5})
    assert (w.cold_offset, w.cache.live_len, w.holder_cold) == (0, 0, {})
    assert st.view_cold(w, "cache") == 0


def test_delegated_refuses_gathers_other_modes_compact():
    w = st.new_world("turbo4delegated", step=4)
    _, w = run(w, {"op": "append", "n": 4})
    with pytest.raises(UnsupportedOperationError):
        st.apply_op(w, {"op": "gather_positions", "positions": [0, 1, 2, 3]})
    w = st.new_world("turbo4", step=4)
    (_, r), w = run(w, {"op": "append", "n": 6}, {"op": "gather_within_tail", "tail": 3, "kept": [1]})
    assert r == 4 and w.cache.capacity == 4 and w.cache.window() == (0, 1, 2, 4)


def test_new_world_refusals():
    with pytest.raises(InvalidArgumentError, match="must be a Turbo mode, got fp16"):
        st.new_world("fp16")
    with pytest.raises(InvalidArgumentError, match="fold_block: must be an integer >= 1, got 0"):
        st.new_world("turbo4delegated", fold_block=0)
    with pytest.raises(InvalidArgumentError, match="hot_threshold"):
        st.new_world("turbo4delegated", hot_threshold=-1)


OPS = hs.one_of(
    hs.builds(lambda n: {"op": "append", "n": n}, hs.integers(1, 5)),
    hs.builds(lambda n: {"op": "append", "n": 1}, hs.just(1)),
    hs.builds(lambda n: {"op": "trim", "n": n}, hs.integers(0, 6)),
    hs.builds(lambda n: {"op": "handle_trim_to", "name": "h", "len": n}, hs.integers(0, 4)),
    hs.sampled_from([{"op": "snapshot", "name": "s"}, {"op": "restore", "name": "s"}, {"op": "drop", "name": "s"},
                     {"op": "detach", "name": "h"}, {"op": "install", "name": "h"}, {"op": "hold"}]),
)


@given(hs.lists(OPS, max_size=25), hs.integers(0, 4), hs.integers(1, 4), hs.integers(1, 4))
def test_invariants_hold_along_any_sequence(ops, T, B, step):
    w = st.new_world("turbo4delegated", step=step, hot_threshold=T, fold_block=B)
    for op in ops:
        try:
            r, w2 = st.apply_op(w, op)
        except KVCacheError:  # a refusal changes nothing
            continue
        c = w2.cache
        assert st.cold_offset_ok(w2.cold_offset, c.offset)
        if op["op"] == "append":
            assert c.live_len - w2.cold_offset <= T
            assert w2.cold_offset >= w.cold_offset  # appends only fold
        if op["op"] == "trim" and r:
            assert c.capacity == c.live_len
        for name, h in w2.dense.holders.items():
            assert 0 <= w2.holder_cold[name] <= h.live_len
        assert set(w2.holder_cold) == set(w2.dense.holders)
        assert sd.is_empty(c) or c.live_len > 0 or c.buffer is None
        w = w2
