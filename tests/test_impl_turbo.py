"""The Turbo caches (impl/turbo.py): per-row oracle, physical trim of every
buffer and sidecar, copying writes, atomic refusals, Delegated's fold
schedule, and the mlx-lm protocol."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from kvspec.impl import turbo_quant as tq
from kvspec.impl.turbo import DelegatedKVCache, TurboHandle, TurboKVCache, make_cache
from kvspec.spec import turbo as st
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError

MODES = ["turbo4asym", "turbo4", "turbo3asym", "turbo4delegated"]


def rows(start: int, n: int, d: int = 16, dv: int | None = None, dtype=mx.float16) -> tuple[mx.array, mx.array]:
    """Deterministic K/V rows for tokens ``start .. start + n - 1``."""
    ks, vs = [], []
    for t in range(start, start + n):
        rng = np.random.default_rng(t)
        ks.append(rng.standard_normal((1, 2, 1, d)))
        vs.append(rng.standard_normal((1, 2, 1, dv or d)) * 2.0 ** (t % 5 - 2))
    return mx.array(np.concatenate(ks, 2)).astype(dtype), mx.array(np.concatenate(vs, 2)).astype(dtype)


def raw(a: mx.array) -> np.ndarray:
    """The array's bytes as NumPy sees them (bfloat16 through a uint16 view)."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def cache(mode: str, **kw):
    if mode == "turbo4delegated":
        kw.setdefault("hot_threshold", 3)
        kw.setdefault("fold_block", 2)
    return make_cache(mode, step=kw.pop("step", 4), **kw)


def expected(mode: str, tokens: list[int], cold: int, d: int = 16, dtype=mx.float16) -> tuple[np.ndarray, np.ndarray]:
    """Each live row quantized and dequantized on its own (the oracle)."""
    ks, vs = [], []
    bits = st.bits_of(st.Mode(mode))
    for i, t in enumerate(tokens):
        k, v = rows(t, 1, d, dtype=dtype)
        if mode == "turbo4":
            k = tq.roundtrip(k, bits, tq.K_SEED)
        if mode != "turbo4delegated" or i < cold:
            v = tq.roundtrip(v, bits, tq.V_SEED)
        ks.append(raw(k))
        vs.append(raw(v))
    return np.concatenate(ks, 2), np.concatenate(vs, 2)


def assert_window(c, tokens: list[int], dtype=mx.float16) -> None:
    k, v = c.fetch()
    assert k.dtype == dtype and v.dtype == dtype
    ek, ev = expected(c.mode, tokens, c.cold_offset, dtype=dtype)
    assert raw(k).tobytes() == ek.tobytes()
    assert raw(v).tobytes() == ev.tobytes()


def assert_rows(c) -> None:
    want = st.array_rows(st.Mode(c.mode), c.capacity, c.live_len, c.cold_offset)
    assert c.row_counts() == want


def state_of(c):
    return (c.offset, c.cold_offset, c.capacity, c.row_counts(),
            None if c.store is None else {k: raw(a).tobytes() for k, a in c.store.items()})


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_window_is_each_row_quantized_on_its_own_across_appends_and_trims(mode, dtype):
    c = cache(mode)
    tokens: list[int] = []
    nxt = 0
    for op in [("a", 5), ("a", 1), ("a", 1), ("t", 2), ("a", 3), ("a", 1), ("t", 4), ("a", 1), ("a", 2)]:
        if op[0] == "a":
            k, v = rows(nxt, op[1], dtype=dtype)
            out = c.update_and_fetch(k, v)
            tokens += list(range(nxt, nxt + op[1]))
            nxt += op[1]
            assert c.last_write_inplace is False
            ek, ev = expected(mode, tokens, c.cold_offset, dtype=dtype)
            assert raw(out[0]).tobytes() == ek.tobytes() and raw(out[1]).tobytes() == ev.tobytes()
        else:
            assert c.trim(op[1]) == op[1]
            del tokens[-op[1]:]
            assert c.capacity == len(tokens)  # physical
        assert_window(c, tokens, dtype)
        assert_rows(c)
        assert 0 <= c.cold_offset <= c.offset


@pytest.mark.parametrize("mode", MODES)
def test_trim_cuts_every_buffer_and_sidecar_to_the_live_rows(mode):
    c = cache(mode)
    c.update_and_fetch(*rows(0, 6))
    assert c.capacity == 8
    assert c.trim(1) == 1
    assert set(c.row_counts().values()) <= {5, c.cold_offset, 5 - c.cold_offset}
    assert c.capacity == 5 and c.row_counts() == st.array_rows(st.Mode(mode), 5, 5, c.cold_offset)
    assert c.trim(-3) == 0 and c.trim(0) == 0
    assert c.trim(99) == 5
    assert c.store is None and c.capacity == 0 and c.cold_offset == 0 and c.row_counts() == {}


def test_delegated_folds_on_the_schedule():
    c = DelegatedKVCache(step=2, hot_threshold=3, fold_block=2)
    c.update_and_fetch(*rows(0, 3))           # prefill within the threshold: all hot
    assert (c.cold_offset, c.hot_len) == (0, 3)
    c.update_and_fetch(*rows(3, 1))           # first decode: handoff folds all 3, new row hot
    assert (c.cold_offset, c.hot_len) == (3, 1)
    c.update_and_fetch(*rows(4, 3))           # hot 4 > 3: fold 2
    assert (c.cold_offset, c.hot_len) == (5, 2)
    c.trim(3)                                  # hot first (2), then 1 cold
    assert (c.cold_offset, c.hot_len, c.offset) == (4, 0, 4)
    c.update_and_fetch(*rows(7, 1))
    assert (c.cold_offset, c.hot_len) == (4, 1)
    c.trim(5)
    c.update_and_fetch(*rows(8, 9))            # prefill of 9: 9 -> 7 -> 5 -> 3
    assert (c.cold_offset, c.hot_len) == (6, 3)
    assert_window(c, list(range(8, 17)))
    c.trim(8)                                  # rollback empties the cold part
    c.update_and_fetch(*rows(17, 1))           # handoff again: the held row folds
    assert (c.cold_offset, c.hot_len) == (1, 1)
    assert_window(c, [8, 17])


def test_delegated_defaults_and_parameters():
    c = DelegatedKVCache()
    assert (c.hot_threshold, c.fold_block) == (256, 128)
    with pytest.raises(InvalidArgumentError, match="fold_block must be >= 1, got 0"):
        DelegatedKVCache(fold_block=0)
    with pytest.raises(InvalidArgumentError, match="hot_threshold must be >= 0, got -1"):
        DelegatedKVCache(hot_threshold=-1)
    with pytest.raises(InvalidArgumentError, match="apply to mode turbo4delegated only"):
        make_cache("turbo4", fold_block=2)
    with pytest.raises(UnsupportedOperationError, match="mode must be one of"):
        TurboKVCache("fp16")


@pytest.mark.parametrize("mode,k,v,msg", [
    ("turbo4asym", (1, 2, 1, 16), (1, 2, 1, 24), "values: head_dim must be a power of two"),
    ("turbo3asym", (1, 2, 1, 4), (1, 2, 1, 4), "values: head_dim must be a multiple of 8"),
    ("turbo4", (1, 2, 1, 8), (1, 2, 1, 16), "keys head_dim must equal values head_dim"),
    ("turbo4delegated", (1, 2, 1, 16), (1, 2, 1, 12), "values: head_dim must be a power of two"),
    ("turbo4asym", (1, 2, 1, 16), (1, 2, 1, 8), r"\[B, H, Dk, Dv\] must match"),
    ("turbo4", (1, 2, 1, 16), (1, 2, 1, 16), "dtype must be the cache's"),
])
def test_a_refused_append_changes_nothing(mode, k, v, msg):
    c = cache(mode)
    c.update_and_fetch(*rows(0, 4))
    before = state_of(c)
    dtype = mx.bfloat16 if "dtype" in msg else mx.float16
    with pytest.raises(InvalidArgumentError, match=msg):
        c.update_and_fetch(mx.ones(k, dtype=dtype), mx.ones(v, dtype=dtype))
    assert state_of(c) == before


def test_asymmetric_head_dims_are_fine_where_k_stays_float():
    c = cache("turbo3asym")
    k, v = mx.ones((1, 1, 2, 24)), mx.ones((1, 1, 2, 8))
    out = c.update_and_fetch(k.astype(mx.float16), v.astype(mx.float16))
    assert out[0].shape == (1, 1, 2, 24) and out[1].shape == (1, 1, 2, 8)


@pytest.mark.parametrize("mode", MODES)
def test_writes_copy_so_holders_never_change(mode):
    c = cache(mode)
    c.update_and_fetch(*rows(0, 3))
    snap = c.snapshot()
    held = c.update_and_fetch(*rows(3, 1))
    held_bytes = [np.array(a).tobytes() for a in held]
    snap_bytes = [np.array(a).tobytes() for a in snap.fetch()]
    c.trim(2)
    c.update_and_fetch(*rows(10, 1))
    c.update_and_fetch(*rows(11, 1))
    assert [np.array(a).tobytes() for a in held] == held_bytes
    assert [np.array(a).tobytes() for a in snap.fetch()] == snap_bytes
    c.restore(snap)
    assert_window(c, [0, 1, 2])
    c.update_and_fetch(*rows(20, 1))
    assert [np.array(a).tobytes() for a in snap.fetch()] == snap_bytes


@pytest.mark.parametrize("mode", MODES)
def test_front_trim_is_a_no_op(mode):
    c = cache(mode)
    c.update_and_fetch(*rows(0, 5))
    before = state_of(c)
    assert c.trim_front_keep_sink(2, 1) == 0 and c.trim_front(3) == 0
    assert state_of(c) == before


@pytest.mark.parametrize("mode", ["turbo4asym", "turbo4", "turbo3asym"])
def test_gathers_leave_the_live_rows_only(mode):
    c = cache(mode)
    c.update_and_fetch(*rows(0, 6))
    assert c.gather_positions(list(range(6))) == 6 and c.capacity == 8  # identity: no-op
    assert c.gather_within_tail(3, [0, 2]) == 5
    assert c.capacity == 5 and set(c.row_counts().values()) == {5}
    assert_window(c, [0, 1, 2, 3, 5])
    assert c.gather_positions([0, 2, 4]) == 3
    assert c.capacity == 3 and set(c.row_counts().values()) == {3}
    assert_window(c, [0, 2, 5])
    before = state_of(c)
    with pytest.raises(InvalidArgumentError, match="strictly increasing"):
        c.gather_positions([1, 0])
    with pytest.raises(InvalidArgumentError, match="tail_len must satisfy"):
        c.gather_within_tail(4, [0])
    assert state_of(c) == before


def test_delegated_refuses_every_gather():
    c = cache("turbo4delegated")
    c.update_and_fetch(*rows(0, 4))
    before = state_of(c)
    with pytest.raises(UnsupportedOperationError, match="gather_positions: not supported in mode turbo4delegated"):
        c.gather_positions([0, 1, 2, 3])
    with pytest.raises(UnsupportedOperationError, match="gather_within_tail"):
        c.gather_within_tail(2, [0])
    assert state_of(c) == before


@pytest.mark.parametrize("mode", MODES)
def test_detach_install_handle_trim_and_state_round_trip(mode):
    c = cache(mode)
    c.update_and_fetch(*rows(0, 5))
    c.update_and_fetch(*rows(5, 1))
    h = c.detach()
    assert isinstance(h, TurboHandle) and c.empty() and c.offset == 0
    cold = h.cold_offset
    assert h.trim_to(4) == 2
    assert h.cold_offset == min(cold, 4)
    c.install(h)
    assert h.consumed and c.offset == 4 and c.capacity == 4
    assert_window(c, [0, 1, 2, 3])
    with pytest.raises(StateError, match="already installed"):
        cache(mode).install(h)
    other = type(c).from_state(c.state, c.meta_state)
    assert [np.array(a).tobytes() for a in other.fetch()] == [np.array(a).tobytes() for a in c.fetch()]
    assert other.cold_offset == c.cold_offset
    with pytest.raises(InvalidArgumentError):
        type(c).from_state(c.state[:-1], c.meta_state)
    bad = list(c.meta_state)
    bad[2] = "9"
    with pytest.raises(InvalidArgumentError, match="offset|arrays must be"):
        type(c).from_state(c.state, tuple(bad))


def test_restore_refuses_a_snapshot_whose_sidecar_is_out_of_step():
    c = cache("turbo4asym")
    c.update_and_fetch(*rows(0, 5))
    snap = c.snapshot()
    snap.store["v_norm"] = snap.store["v_norm"][:, :, :3, :]
    fresh = cache("turbo4asym")
    with pytest.raises(InvalidArgumentError, match="same capacity"):
        fresh.restore(snap)
    assert fresh.empty()


def test_copies_share_nothing_writable_and_protocol_bits():
    c = cache("turbo4")
    c.update_and_fetch(*rows(0, 3))
    snap_bytes = [np.array(a).tobytes() for a in c.fetch()]
    for dup in (copy.copy(c), copy.deepcopy(c)):
        dup.update_and_fetch(*rows(9, 1))
        dup.trim(3)
    assert [np.array(a).tobytes() for a in c.fetch()] == snap_bytes
    assert c.is_trimmable() and c.size() == 3 and c.nbytes > 0
    assert c.make_mask(1) is None and c.make_mask(3) == "causal"
    assert c.make_mask(2, return_array=True).shape == (2, 5)


def test_bytes_per_token_against_fp16():
    """Storage per token (all heads, one layer) at head_dim 128, printed;
    Turbo4 below a third of fp16."""
    d, out = 128, {}
    for mode in ["fp16", *MODES]:
        c = make_cache(mode, step=1, **({"hot_threshold": 0} if mode == "turbo4delegated" else {}))
        k = mx.ones((1, 1, 8, d), dtype=mx.float16)
        c.update_and_fetch(k, k)
        out[mode] = c.nbytes / 8
    print({m: f"{b:.0f} B ({b / out['fp16']:.2f}x)" for m, b in out.items()})
    assert out["fp16"] == 4 * d
    assert out["turbo4asym"] == 2 * d + d / 2 + 8
    assert out["turbo3asym"] == 2 * d + 3 * d / 8 + 4
    assert out["turbo4"] == 2 * (d / 2 + 8) < out["fp16"] / 3
    assert out["turbo4delegated"] == out["turbo4asym"]


def test_constructor_defaults_and_exact_refusals():
    assert (TurboKVCache().mode, TurboKVCache().step) == ("turbo4asym", 256)
    d = DelegatedKVCache()
    assert (d.mode, d.step, d.hot_threshold, d.fold_block) == ("turbo4delegated", 256, 256, 128)
    with pytest.raises(InvalidArgumentError) as e:
        DelegatedKVCache(hot_threshold="4")
    assert str(e.value) == "DelegatedKVCache: hot_threshold must be an integer, got '4'"
    with pytest.raises(InvalidArgumentError) as e:
        DelegatedKVCache(fold_block=1.5)
    assert str(e.value) == "DelegatedKVCache: fold_block must be an integer, got 1.5"
    with pytest.raises(InvalidArgumentError) as e:
        TurboKVCache("turbo4", step=0)
    assert str(e.value) == "TurboKVCache: step must be >= 1, got 0"
    with pytest.raises(UnsupportedOperationError) as e:
        DelegatedKVCache("turbo4")
    assert str(e.value) == "DelegatedKVCache: mode must be 'turbo4delegated', got 'turbo4'"
    assert DelegatedKVCache(hot_threshold=0).hot_threshold == 0


@pytest.mark.parametrize("mode", MODES)
def test_shallow_and_deep_copies_read_the_same_window(mode):
    c = cache(mode)
    c.update_and_fetch(*rows(0, 5))
    want = [raw(a).tobytes() for a in c.fetch()]
    for dup in (copy.copy(c), copy.deepcopy(c)):
        assert [raw(a).tobytes() for a in dup.fetch()] == want
        assert (dup.offset, dup.cold_offset, dup.capacity, dup.row_counts()) == (
            c.offset, c.cold_offset, c.capacity, c.row_counts())


def test_from_state_refusals_name_the_problem():
    c = cache("turbo4delegated")
    c.update_and_fetch(*rows(0, 5))
    state, meta = c.state, c.meta_state
    assert c.state_names() == tuple(sorted(c.store)) and meta[7] == ",".join(sorted(c.store))
    cases = [
        (meta[:7], f"from_state: meta_state must have at least 8 fields, got {meta[:7]!r}"),
        ((meta[0], "x", *meta[2:]), f"from_state: meta_state must hold integers, got {(meta[0], 'x', *meta[2:])!r}"),
    ]
    for bad, msg in cases:
        with pytest.raises(InvalidArgumentError) as e:
            DelegatedKVCache.from_state(state, bad)
        assert str(e.value) == msg
    with pytest.raises(InvalidArgumentError) as e:
        TurboKVCache.from_state(state, meta)
    assert str(e.value) == "from_state: mode 'turbo4delegated' is not a mode of TurboKVCache"
    with pytest.raises(InvalidArgumentError) as e:
        DelegatedKVCache.from_state(state[:3], meta)
    assert str(e.value) == ("from_state: state must hold 5 arrays ('cold_norm', 'cold_packed', 'cold_rescale', "
                            "'hot', 'keys'), got 3 arrays")
    good = DelegatedKVCache.from_state(state, meta, op="load")
    assert (good.hot_threshold, good.fold_block, good.cold_offset, good.dtype) == (3, 2, c.cold_offset, mx.float16)
    empty = DelegatedKVCache.from_state((), cache("turbo4delegated").meta_state)
    assert empty.empty() and empty.offset == 0 and empty.dtype is None
    with pytest.raises(InvalidArgumentError, match="^load: "):
        DelegatedKVCache.from_state(state[:3], meta, op="load")


@pytest.mark.parametrize("mode", MODES)
def test_every_row_count_rule_refuses_in_every_loader(mode):
    """Each stored array in turn one row short or one row long: from_state,
    restore and install all refuse it (InvalidArgumentError) and leave the
    target as it was. The one exception is Delegated's K buffer, which may
    hold more rows than offset (its capacity). A check dropped from the
    row-count rules (e.g. Delegated's keys >= offset) loads a cache whose K
    and V windows differ in length."""
    def off_by_one(a: mx.array, label: str, least: int | None = None) -> mx.array:
        """One row fewer than allowed (``least``: the fewest rows allowed,
        default all of them) or one more."""
        if label == "short":
            return a[:, :, : (int(a.shape[2]) if least is None else least) - 1, :]
        return mx.concatenate([a, a[:, :, -1:, :]], axis=2)

    c = cache(mode)
    c.update_and_fetch(*rows(0, 7))
    if mode == "turbo4delegated":
        assert 0 < c.cold_offset < c.offset  # cold and hot arrays both present
    state, meta, names = list(c.state), c.meta_state, c.state_names()
    for i, name in enumerate(names):
        least = c.offset if (mode == "turbo4delegated" and name == "keys") else None  # Delegated K: >= offset
        for label in ("short", "long"):
            if label == "long" and mode == "turbo4delegated" and name == "keys":
                continue
            bad = off_by_one(state[i], label)
            with pytest.raises(InvalidArgumentError):
                type(c).from_state(tuple(state[:i] + [bad] + state[i + 1:]), meta)
            target = cache(mode)
            target.update_and_fetch(*rows(50, 2))
            before = (target.offset, target.cold_offset, target.row_counts())
            snap = c.snapshot()
            snap.store = {**snap.store, name: off_by_one(snap.store[name], label, least)}
            with pytest.raises(InvalidArgumentError):
                target.restore(snap)
            assert (target.offset, target.cold_offset, target.row_counts()) == before, (name, label)
            donor = cache(mode)
            donor.update_and_fetch(*rows(0, 7))
            handle = donor.detach()
            handle.store = {**handle.store, name: off_by_one(handle.store[name], label, least)}
            with pytest.raises(InvalidArgumentError):
                cache(mode).install(handle)


@pytest.mark.parametrize("mode", MODES)
def test_every_counter_rule_refuses_in_every_loader(mode):
    """A holder whose counters break a rule (live_start other than 0, a
    negative offset, an offset beyond the arrays' rows, a cold_offset that
    does not match the cold/hot rows or is not 0 outside Delegated) is
    refused by restore and install with InvalidArgumentError, the target
    unchanged. Dropping the live_start rule let restore adopt live_start 2
    and fetch rows 0..2 as the window of rows 2..4."""
    c = cache(mode)
    c.update_and_fetch(*rows(0, 7))
    capacity = c.capacity
    bad_counters = [{"live_start": 1}, {"live_start": 2}, {"offset": -1}, {"offset": capacity + 1},
                    {"cold_offset": c.cold_offset + 1}]
    if mode == "turbo4delegated":
        bad_counters += [{"cold_offset": c.cold_offset - 1}, {"offset": c.offset - 1}, {"offset": c.offset + 1}]
    for bad in bad_counters:
        target = cache(mode)
        target.update_and_fetch(*rows(50, 2))
        before = (target.offset, target.live_start, target.cold_offset, target.row_counts())
        snap = c.snapshot()
        for k, v in bad.items():
            setattr(snap, k, v)
        with pytest.raises(InvalidArgumentError):
            target.restore(snap)
        assert (target.offset, target.live_start, target.cold_offset, target.row_counts()) == before, bad
        donor = cache(mode)
        donor.update_and_fetch(*rows(0, 7))
        handle = donor.detach()
        for k, v in bad.items():
            setattr(handle, k, v)
        fresh = cache(mode)
        with pytest.raises(InvalidArgumentError):
            fresh.install(handle)
        assert fresh.empty() and fresh.offset == 0, bad
