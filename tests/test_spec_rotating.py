"""Unit tests of the rotating spec (semantics.md section 3)."""

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.spec import rotating as sr
from kvspec.spec.errors import InvalidArgumentError, StateError
from tests.budget import examples


def decoded(cache, count, start=0):
    for t in range(start, start + count):
        _, cache = sr.append(cache, (t,))
    return cache


def test_warmup_then_wrap_physical_order():
    c = decoded(sr.new_cache(4, step=4), 4)
    assert c.window() == (0, 1, 2, 3) and c.idx == 4
    r, c = sr.append(c, (4,))
    assert r.window == (4, 1, 2, 3) and c.idx == 1 and not r.inplace


def test_warmup_writes_in_place_after_first():
    c = sr.new_cache(8, step=4)
    r, c = sr.append(c, (0,))
    assert not r.inplace  # the buffer was just grown
    r, c = sr.append(c, (1,))
    assert r.inplace


def test_sinks_are_never_overwritten():
    c = decoded(sr.new_cache(4, keep=2, step=1), 9)
    assert c.window()[:2] == (0, 1)
    assert set(c.window()[2:]) == {7, 8}


@given(st.integers(2, 16), st.integers(0, 3), st.integers(0, 60))
def test_decode_only_slots_match_ring_slot(W, K, count):
    K = min(K, W - 1)
    c = decoded(sr.new_cache(W, keep=K, step=3), count)
    visible = sr.visible_positions(count, W, K)
    assert sorted(p for p in c.positions()) == list(visible)
    for slot, entry in enumerate(c.slots[: c.valid_len]):
        assert sr.ring_slot(entry.position, W, K) == slot


def test_prefill_after_wrap_is_chronological_and_long():
    c = decoded(sr.new_cache(4, keep=1, step=1), 6)
    assert c.window() == (0, 4, 5, 3)
    r, c = sr.append(c, (6, 7))
    assert r.window == (0, 4, 5, 6, 7)
    assert r.positions == (0, 4, 5, 6, 7)


def test_wrapped_trim_fails_closed():
    c = decoded(sr.new_cache(3, step=1), 4)
    assert not sr.is_trimmable(c)
    assert sr.trim(c, 1) == (0, c)
    with pytest.raises(StateError, match="cannot trim a wrapped"):
        sr.trim_to(c, 2)
    assert sr.trim_to(c, 4) == (0, c)


def test_unwrapped_trim_is_exact():
    c = decoded(sr.new_cache(6, step=2), 4)
    n, c = sr.trim(c, 2)
    assert n == 2 and c.window() == (0, 1) and c.capacity == 4
    r, c = sr.append(c, (9,))
    assert r.window == (0, 1, 9) and not r.inplace


def test_mask_visible_counts():
    for q in range(12):
        assert sum(sr.mask_visible(q, p, 4, 0) for p in range(12)) == min(q + 1, 4)
        assert sum(sr.mask_visible(q, p, 4, 1) for p in range(12)) == min(q + 1, 4)
    assert sr.mask_visible(10, 0, 4, 1)  # a sink stays visible
    assert not sr.mask_visible(10, 6, 4, 0) and sr.mask_visible(10, 7, 4, 0)


def test_new_cache_refusals():
    with pytest.raises(InvalidArgumentError, match="keep"):
        sr.new_cache(4, keep=4)
    with pytest.raises(InvalidArgumentError, match="max_size"):
        sr.new_cache(0)


def test_chronological_order():
    assert sr.chronological_order(5, 3, 1, True) == (0, 3, 4, 1, 2)
    assert sr.chronological_order(5, 3, 1, False) == (0, 1, 2)


def test_restore_shares_the_snapshot_buffer_and_emptied_ring_keeps_it():
    """Restore adopts the snapshot's very buffer (same identity: a write in
    place would reach the snapshot, so the marker is cleared); trimming to
    offset 0 keeps the buffer (a ring trim never drops buffers)."""
    w = sr.RotatingWorld(sr.new_cache(4, step=2))
    _, w = sr.w_append(w, 3)
    _, w = sr.w_snapshot(w, "s")
    _, w = sr.w_append(w, 2)  # a multi-row append: new buffer
    assert w.cache.ident != w.holders["s"].cache.ident
    _, w = sr.w_restore(w, "s")
    assert w.cache.ident == w.holders["s"].cache.ident and w.cache.marker is None
    n, c = sr.trim(w.cache, 3)
    assert n == 3 and (c.slots, c.ident, c.marker, c.offset, c.idx) == (w.cache.slots, w.cache.ident, None, 0, 0)
    assert c.capacity == 3 and c.window() == ()


def test_inplace_rule_is_false_on_a_full_unwrapped_ring():
    """Called on its own (not only from decode, after the wrap): a full ring
    whose marker still names the buffer is not a warm-up state."""
    c = decoded(sr.new_cache(3, step=1), 3)
    assert (c.offset, c.idx, c.marker.idx) == (3, 3, 3) and c.marker.buffer == c.ident
    assert sr.rotating_inplace_allowed(c) is False


# ---------------------------------------------------------------------------
# The undo log


def replayed(W, K, step, calls):
    c = sr.new_cache(W, keep=K, step=step)
    for toks in calls:
        _, c = sr.append(c, tuple(toks))
    return c


def truncated(calls, n):
    """The append history without its last ``n`` rows (call boundaries kept)."""
    calls = [list(x) for x in calls]
    while n:
        if len(calls[-1]) <= n:
            n -= len(calls.pop())
        else:
            calls[-1], n = calls[-1][:-n], 0
    return calls


def observed(c):
    return (c.window(), c.positions(), c.offset, c.idx)


def check_every_trim(c, calls, W, K, step):
    """Every trim within trimmable_rows equals replaying the history without
    those rows (also after a further decode and multi-row append); every
    trim beyond returns 0 and changes nothing; so does trim_to's refusal."""
    bound = sr.trimmable_rows(c)
    for n in range(c.offset + 2):
        got, after = sr.trim(c, n)
        k = min(n, c.offset)
        if 0 < k <= bound:
            assert got == k
            want = replayed(W, K, step, truncated(calls, k))
            assert observed(after) == observed(want)
            for more in ((900,), (901, 902)):
                assert observed(sr.append(after, more)[1]) == observed(sr.append(want, more)[1])
            assert after.capacity > 0 or c.capacity == 0  # the buffers stay
            assert sr.trim_to(c, c.offset - k) == (got, after)
        else:
            assert (got, after) == (0, c)
            if k > bound:
                with pytest.raises(StateError, match="cannot trim"):
                    sr.trim_to(c, c.offset - k)


def random_history(seed, ops):
    """Random appends (decode steps, blocks, chunks longer than the window),
    trims, snapshots and restores on a small ring with a random undo depth;
    checks exactness and the bound after every step. ``avail`` is the
    promise: min(U, rows appended since the log was cleared), each exact
    trim using up what it takes back, and an append onto an oversized
    buffer keeping only its own rows after the first."""
    import random

    rng = random.Random(seed)
    W = rng.randint(1, 6)
    K, step, U = rng.randint(0, W - 1), rng.randint(1, 4), rng.randint(0, 4)
    w = sr.RotatingWorld(sr.new_cache(W, keep=K, step=step, undo=U))
    calls, avail, snaps = [], 0, {}
    for _ in range(ops):
        c = w.cache
        r = rng.random()
        if r < 0.55 or not calls:
            s = rng.choice([1, 1, 1, 2, 3, 4, W + 2])
            avail = min(U, s - 1) if sr.oversized(c) else min(U, avail + s)
            _, w = sr.w_append(w, s)
            calls.append(list(range(w.next_token - s, w.next_token)))
        elif r < 0.65:
            name = f"s{len(snaps)}"
            _, w = sr.w_snapshot(w, name)
            snaps[name] = ([list(x) for x in calls])
        elif r < 0.72 and snaps:
            name = rng.choice(sorted(snaps))
            _, w = sr.w_restore(w, name)
            calls, avail = [list(x) for x in snaps[name]], 0
            assert w.cache.log == ()
        else:
            bound = sr.trimmable_rows(c)
            if sr.counters_rewind_exact(c):
                assert bound == c.offset
            else:
                assert avail <= bound <= U
            assert sr.log_saved_rows(c.log) <= U and len(c.log) <= max(U, 1)
            assert sr.is_trimmable(c) == (sr.counters_rewind_exact(c) or bound > 0)
            check_every_trim(c, calls, W, K, step)
            got, cache = sr.trim(c, rng.randint(0, bound + 1))
            w = replace(w, cache=cache)
            calls, avail = truncated(calls, got), max(0, avail - got)


@pytest.mark.parametrize("chunk", range(4))
def test_rollback_equals_replay_without_the_rows(chunk):
    """400 random histories per chunk (a third under the mutation profile:
    tests/budget.py)."""
    for seed in range(chunk * 400, chunk * 400 + examples(400)):
        random_history(seed, 18)


def test_undo_log_worked_example():
    """W = 4, K = 1, U = 3: the diagram of docs/rotating.md."""
    c = sr.new_cache(4, keep=1, step=4, undo=3)
    for t in range(6):
        _, c = sr.append(c, (t,))
    assert c.window() == (0, 4, 5, 3) and c.idx == 3
    assert [(r.kind, r.slot, r.saved) for r in c.log] == [
        ("decode", 3, ()), ("decode", 1, (sr.Entry(1, 1),)), ("decode", 2, (sr.Entry(2, 2),))]
    assert sr.trimmable_rows(c) == 3 and not sr.counters_rewind_exact(c)
    n, back = sr.trim(c, 2)
    assert n == 2 and back.window() == (0, 1, 2, 3) and (back.offset, back.idx) == (4, 4)
    n, back = sr.trim(c, 3)
    assert n == 3 and back.window() == (0, 1, 2) and (back.offset, back.idx) == (3, 3)
    assert sr.trim(c, 4) == (0, c)
    _, c = sr.append(c, (6, 7, 8))  # a verification block: drops position 3
    assert c.window() == (0, 4, 5, 6, 7, 8) and c.log[-1].saved == (sr.Entry(3, 3),)
    n, part = sr.trim(c, 2)  # keep one row of the block: a decode onto the old ring
    assert n == 2 and part.window() == (0, 4, 5, 6) and part.idx == 4
    n, whole = sr.trim(c, 3)
    assert n == 3 and whole.window() == (0, 4, 5, 3) and whole.idx == 3


def test_undo_depth_zero_keeps_fail_closed_and_refusals():
    c = decoded(sr.new_cache(3, step=1), 4)
    assert c.log == () and sr.trimmable_rows(c) == 0
    with pytest.raises(InvalidArgumentError, match="undo: must be >= 0, got -1"):
        sr.new_cache(3, undo=-1)


def test_an_append_onto_an_oversized_buffer_starts_the_log_afresh():
    c = sr.new_cache(3, step=1, undo=4)
    _, c = sr.append(c, tuple(range(6)))  # oversized: 6 slots
    assert sr.oversized(c) and sr.trimmable_rows(c) == 4
    _, c = sr.append(c, (6, 7))
    assert len(c.log) == 1 and not c.log[0].whole and sr.trimmable_rows(c) == 1
    n, c1 = sr.trim(c, 1)
    assert n == 1 and c1.window() == (6, 4, 5) and sr.trimmable_rows(c1) == 0
    assert sr.trim(c, 2) == (0, c)


def test_memory_bound_and_clear_on_restore():
    w = sr.RotatingWorld(sr.new_cache(2, step=1, undo=3))
    for _ in range(10):
        _, w = sr.w_append(w, 1)
        assert sr.log_saved_rows(w.cache.log) <= 3 and len(w.cache.log) <= 3
    _, w = sr.w_snapshot(w, "s")
    _, w = sr.w_append(w, 1)
    _, w = sr.w_restore(w, "s")
    assert w.cache.log == () and sr.trimmable_rows(w.cache) == 0 and sr.trim(w.cache, 1) == (0, w.cache)
