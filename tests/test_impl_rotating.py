"""Unit tests of kvspec.impl.rotating.RotatingKVCache."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec.errors import InvalidArgumentError, StateError


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
    from kvspec.spec import rotating as sr

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


# ---------------------------------------------------------------------------
# The undo log (kvspec.spec.rotating: trimmable_rows, rollback)


def kv(tokens, B=1, H=2, Dk=3, Dv=5):
    """Rows whose keys carry the token and values 1000 + token (K and V head
    dims differ, so a rollback mixing them up shows)."""
    t = np.array(tokens, dtype=np.float16)[None, None, :, None]
    k = np.broadcast_to(t, (B, H, len(tokens), Dk)).copy()
    v = np.broadcast_to(t + 1000, (B, H, len(tokens), Dv)).copy()
    return mx.array(k), mx.array(v)


def window_of(c):
    got = c.fetch()
    if got is None:
        return ()
    k, v = (np.array(a) for a in got)
    assert (v[..., 0] == k[..., 0] + 1000).all()
    return tuple(int(x) for x in k[0, 0, :, 0])


def lockstep_history(seed, ops=24):
    """Random appends, trims (within and beyond the bound, trim_to) and
    snapshot/restore on the MLX ring and the spec ring with the same undo
    depth: windows, counters, capacity and the bound agree after every op."""
    import random

    from kvspec.spec import rotating as sr

    rng = random.Random(seed)
    W = rng.randint(1, 6)
    K, step, U = rng.randint(0, W - 1), rng.randint(1, 4), rng.randint(0, 4)
    c, s = RotatingKVCache(W, keep=K, step=step, undo=U), sr.new_cache(W, keep=K, step=step, undo=U)
    snaps, tok = [], 0
    for _ in range(ops):
        r = rng.random()
        if r < 0.5:
            n = rng.choice([1, 1, 1, 2, 3, W + 2])
            c.update_and_fetch(*kv(range(tok, tok + n)))
            _, s = sr.append(s, tuple(range(tok, tok + n)))
            tok += n
        elif r < 0.85:
            n = rng.randint(-1, sr.trimmable_rows(s) + 1)
            got = c.trim(n)
            want, s = sr.trim(s, n)
            assert got == want
        elif r < 0.93:
            snaps.append((c.snapshot(), s))
        elif snaps:
            snap, s = rng.choice(snaps)
            c.restore(snap)
            s = replace(s, log=())
        assert window_of(c) == s.window(), (seed, W, K, U)
        assert (c.offset, c.idx, c.capacity) == (s.offset, s.idx, s.capacity)
        assert c.trimmable_rows() == sr.trimmable_rows(s) and c.is_trimmable() == sr.is_trimmable(s)
        assert c.log_saved_rows() == sr.log_saved_rows(s.log) <= U


def test_undo_log_agrees_with_the_spec():
    for seed in range(150):
        lockstep_history(seed)


def test_rollback_after_wrap_and_memory_bound():
    c = RotatingKVCache(4, keep=1, step=4, undo=3)
    for t in range(6):
        c.update_and_fetch(*kv([t]))
    assert window_of(c) == (0, 4, 5, 3) and c.trimmable_rows() == 3 and c.log_saved_rows() == 2
    c.update_and_fetch(*kv([6, 7, 8]))
    assert c.trim(2) == 2 and window_of(c) == (0, 4, 5, 6) and c.idx == 4
    with pytest.raises(StateError, match="cannot trim .* by 2 rows"):
        c.trim_to(c.offset - 2)
    assert c.trim(2) == 0 and window_of(c) == (0, 4, 5, 6)


def test_trim_to_zero_keeps_the_buffers():
    c = RotatingKVCache(4, step=2)
    c.update_and_fetch(*kv([0, 1, 2]))
    assert c.trim(3) == 3 and c.capacity == 3 and not c.empty() and window_of(c) == ()


def test_undo_argument_and_state_round_trip():
    with pytest.raises(InvalidArgumentError, match="undo must be >= 0, got -1"):
        RotatingKVCache(4, undo=-1)
    with pytest.raises(InvalidArgumentError, match="undo"):
        RotatingKVCache(4, undo=1.5)
    c = RotatingKVCache(3, step=1, undo=2)
    for t in range(5):
        c.update_and_fetch(*kv([t]))
    assert c.meta_state == ("0", "3", "1", "5", "2", "2")
    d = RotatingKVCache.from_state(c.state, c.meta_state)
    assert d.undo == 2 and d.trimmable_rows() == 0 and window_of(d) == window_of(c)
    d.update_and_fetch(*kv([5]))
    assert d.trim(1) == 1 and window_of(d) == window_of(c)
    assert RotatingKVCache(3).meta_state == ("0", "3", "256", "0", "0")
    with pytest.raises(InvalidArgumentError, match="five to seven integers"):
        RotatingKVCache.from_state(c.state, ("0", "3", "1", "5"))


# -- every load path starts a fresh history --------------------------------------
# restore clears the undo log, but a ring is also loaded through the mlx-lm
# protocol (the state setter alone, state then meta_state, from_state) and from
# a prompt-cache file, which no state machine drives. Each must leave the ring
# exactly as restore leaves it: the same rows and counters, no ownership
# marker, and an empty undo log, so that no later rollback reaches the rows
# of the history the load replaced.

def _load_restore(c, k, v, meta):
    from kvspec.impl.rotating import RingSnapshot
    n = int(k.shape[2])
    c.restore(RingSnapshot(k, v, n, n, c.max_size, c.keep))
    return c


def _load_state(c, k, v, meta):
    c.state = (k, v)
    return c


def _load_state_meta(c, k, v, meta):
    c.state = (k, v)
    c.meta_state = meta
    return c


def _load_from_state(c, k, v, meta):
    return RotatingKVCache.from_state((k, v), meta)


def _load_file(c, k, v, meta, tmp_path):
    from kvspec.impl.models import load_prompt_cache, save_prompt_cache
    save_prompt_cache(tmp_path / "ring.safetensors", [RotatingKVCache.from_state((k, v), meta)])
    return load_prompt_cache(tmp_path / "ring.safetensors")[0]


@pytest.mark.parametrize("load", ["restore", "state", "state+meta_state", "from_state", "file"])
@pytest.mark.parametrize(("W", "K", "U"), [(3, 0, 3), (4, 1, 2), (5, 2, 4)])
def test_every_load_path_starts_a_fresh_history(load, W, K, U, tmp_path):
    paths = {"restore": _load_restore, "state": _load_state, "state+meta_state": _load_state_meta,
             "from_state": _load_from_state, "file": lambda *a: _load_file(*a, tmp_path)}
    c = RotatingKVCache(W, keep=K, step=1, undo=U)
    for t in range(2 * W + 1):  # wrapped, with a full undo log
        c.update_and_fetch(*kv([t]))
    assert c.trimmable_rows() > 0 and c.log_saved_rows() > 0
    k, v = kv([100 + t for t in range(W - 1)])
    meta = (str(K), str(W), "1", str(W - 1), str(W - 1), str(U))
    got = paths[load](c, k, v, meta)
    ref = _load_restore(RotatingKVCache(W, keep=K, step=1, undo=U), k, v, meta)
    assert (got.offset, got.idx, got.undo, window_of(got)) == (ref.offset, ref.idx, ref.undo, window_of(ref))
    assert got.log_saved_rows() == 0 and not got._owns_buffers()
    for t in range(200, 200 + W + 1):  # past the wrap: now only the log can trim
        for x in (got, ref):
            x.update_and_fetch(*kv([t]))
        assert (got.trimmable_rows(), got.log_saved_rows()) == (ref.trimmable_rows(), ref.log_saved_rows())
    n = ref.trimmable_rows() + 1  # one beyond the bound is refused by both
    assert got.trim(n) == ref.trim(n) == 0
    n -= 1
    assert got.trim(n) == ref.trim(n) == n
    assert (got.offset, got.idx, window_of(got)) == (ref.offset, ref.idx, window_of(ref))


def _agree(c, s, where):
    from kvspec.spec import rotating as sr
    assert window_of(c) == s.window(), where
    assert (c.offset, c.idx, c.capacity) == (s.offset, s.idx, s.capacity), where
    assert c.trimmable_rows() == sr.trimmable_rows(s) and c.log_saved_rows() == sr.log_saved_rows(s.log), where


@pytest.mark.parametrize("W", [1, 2, 3])
def test_every_trim_of_every_short_history_agrees_with_the_spec(W):
    """Bounded-exhaustive: from the empty ring, every history of one or two
    appends (sizes 1, 2, W, W + 1, W + 2: warm-up, full, oversized), every
    trim n in [0, offset + 1], then one decode, for every K, U in 0..4 and
    steps 1 and 3, against the spec. Random histories rarely take a rollback
    all the way back to the empty ring (an oversized first block with
    U >= its rows), where the prior layout has capacity 0."""
    import itertools

    from kvspec.spec import rotating as sr

    sizes = sorted({1, 2, W, W + 1, W + 2})
    for K, U, step in itertools.product(range(W), range(5), (1, 3)):
        for hist in itertools.chain(((a,) for a in sizes), itertools.product(sizes, repeat=2) if W <= 2 else ()):
            total = sum(hist)
            for n in range(total + 2):
                c, s = RotatingKVCache(W, keep=K, step=step, undo=U), sr.new_cache(W, keep=K, step=step, undo=U)
                tok = 0
                for a in hist:
                    c.update_and_fetch(*kv(range(tok, tok + a)))
                    _, s = sr.append(s, tuple(range(tok, tok + a)))
                    tok += a
                where = (W, K, U, step, hist, n)
                got = c.trim(n)
                want, s = sr.trim(s, n)
                assert got == want, where
                _agree(c, s, where)
                c.update_and_fetch(*kv([tok]))
                _, s = sr.append(s, (tok,))
                _agree(c, s, where + ("decode",))


@settings(max_examples=300, deadline=None)
@given(W=st.integers(2, 8), K=st.integers(0, 2), undo=st.integers(0, 2), inplace=st.booleans(),
       ops=st.lists(st.tuples(st.sampled_from(["decode", "append", "trim"]), st.integers(1, 5)), max_size=14),
       window=st.one_of(st.none(), st.integers(1, 10)))
def test_a_decode_mask_is_none_exactly_when_every_key_is_visible(W, K, undo, inplace, ops, window):
    """make_mask(1) decides "every key visible" (None) in O(1), without the
    positions; it must agree with the full mask over those positions
    (return_array=True builds it) in every ring state: warm-up, wrapped,
    grown past W by a multi-row append, rolled back."""
    if K >= W:
        return
    c = RotatingKVCache(max_size=W, keep=K, step=2, undo=undo, inplace=inplace)
    for op, n in ops:
        if op == "trim":
            if c.is_trimmable():
                c.trim(n)
        else:
            k = mx.zeros((1, 1, 1 if op == "decode" else n, 2), mx.float16)
            c.update_and_fetch(k, k)
        full = np.array(c.make_mask(1, window, return_array=True))
        got = c.make_mask(1, window)
        assert (got is None) == bool(full.all()), (c.offset, c.idx, c.capacity, window, full.tolist())
        if got is not None:
            assert np.array(got).tolist() == full.tolist()


def test_a_decode_mask_builds_no_positions(monkeypatch):
    """mlx-lm's models call make_mask every step (Gemma 3: once for the
    sliding layers, once for the global ones): a decode whose query sees
    every key is answered without the O(window) positions (95 us -> 1.6 us
    a call on this machine at window 1024, 512 rows)."""
    c = RotatingKVCache(max_size=16, keep=1, step=4)
    k = mx.zeros((1, 1, 9, 2), mx.float16)
    c.update_and_fetch(k, k)

    def never(n):
        raise AssertionError("make_mask(1) built the positions")

    monkeypatch.setattr(c, "_next_positions", never)
    assert c.make_mask(1) is None and c.make_mask(1, window_size=16) is None
    with pytest.raises(AssertionError, match="built the positions"):
        c.make_mask(1, window_size=4)  # the window hides keys: the mask is built
