"""Edges of the Turbo caches (impl/turbo.py) and their quantizer
(impl/turbo_quant.py): the exact refusal of every malformed argument,
snapshot and handle (each names its operation, the field and the rule),
the defaults, the packer hooks a subclass supplies, the dispatch between
the quantizer's paths, and the boundaries of a decision threshold, the
fold schedule and the output range."""

from __future__ import annotations

import copy
import re
import warnings

import mlx.core as mx
import numpy as np
import pytest

from kvspec.impl import turbo_quant as tq
from kvspec.impl.dense import KVCache
from kvspec.impl.turbo import DelegatedKVCache, TurboKVCache, TurboSnapshot, make_cache
from kvspec.spec.errors import InvalidArgumentError, StateError
from tests._standin import stand_in
from tests.test_impl_turbo import MODES, cache, raw, rows


def refused(exc: type[Exception], message: str):
    """``pytest.raises`` on the whole message, matched literally."""
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


def window_bytes(got) -> list[bytes]:
    return [raw(a).tobytes() for a in got]


# -- the packer hooks ---------------------------------------------------------
def _pack_xor(idx: mx.array, bits: int) -> mx.array:
    """The standard packing with every byte inverted: another format, with
    its own inverse below."""
    return tq.pack_indices(idx, bits) ^ mx.array(0xFF, dtype=mx.uint8)


def _unpack_xor(packed: mx.array, bits: int, head_dim: int) -> mx.array:
    return tq.unpack_indices(packed ^ mx.array(0xFF, dtype=mx.uint8), bits, head_dim)


class XorPacked(TurboKVCache):
    _pack = staticmethod(_pack_xor)
    _unpack = staticmethod(_unpack_xor)


class XorPackedDelegated(DelegatedKVCache):
    _pack = staticmethod(_pack_xor)
    _unpack = staticmethod(_unpack_xor)


@pytest.mark.parametrize("mode", MODES)
def test_a_subclass_packer_is_read_back_through_its_own_unpacker_everywhere(mode):
    """A cache whose packer stores another format reads every window (an
    append's, a fetch's, a snapshot's, a detached handle's) back through
    its own unpacker: the same rows as the standard cache."""
    cls = XorPackedDelegated if mode == "turbo4delegated" else XorPacked
    kw = {"hot_threshold": 1, "fold_block": 1} if mode == "turbo4delegated" else {}
    ours, std = cls(mode, step=4, **kw), make_cache(mode, step=4, **kw)
    for start, n in ((0, 3), (3, 1), (4, 1)):
        got, want = ours.update_and_fetch(*rows(start, n)), std.update_and_fetch(*rows(start, n))
        assert window_bytes(got) == window_bytes(want)
    stored = "cold_packed" if mode == "turbo4delegated" else "v_packed"
    assert not np.array_equal(np.array(ours.store[stored]), np.array(std.store[stored]))
    want = window_bytes(std.fetch())
    assert window_bytes(ours.fetch()) == want
    assert window_bytes(ours.snapshot().fetch()) == want
    assert window_bytes(ours.detach().fetch()) == want


# -- constructor, defaults, observables --------------------------------------
def test_a_turbo_cache_refuses_a_non_integer_step_naming_its_class():
    with refused(InvalidArgumentError, "TurboKVCache: step must be an integer, got '4'"):
        TurboKVCache("turbo4", step="4")
    with refused(InvalidArgumentError, "DelegatedKVCache: step must be an integer, got 2.0"):
        DelegatedKVCache(step=2.0)


@pytest.mark.parametrize("mode", MODES)
def test_a_fresh_and_a_detached_cache_have_no_layout_and_no_in_place_write(mode):
    c = cache(mode)
    assert (c.dtype, c.k_dim, c.v_dim, c.last_write_inplace) == (None, None, None, False)
    c.update_and_fetch(*rows(0, 2))
    assert (c.dtype, c.k_dim, c.v_dim, c.last_write_inplace) == (mx.float16, 16, 16, False)
    c.detach()
    assert (c.dtype, c.k_dim, c.v_dim) == (None, None, None) and c.last_write_inplace is False
    assert c.meta_state[4:7] == ("", "0", "0")


def test_make_cache_defaults_to_a_dense_fp16_cache_of_step_256_and_passes_the_mode():
    c = make_cache()
    assert type(c) is KVCache and (c.mode, c.step) == ("fp16", 256)
    assert make_cache("int8").mode == "int8"
    assert make_cache("turbo3asym").step == 256 and make_cache("turbo3asym").mode == "turbo3asym"
    assert type(make_cache("turbo4delegated")) is DelegatedKVCache


def test_repr_names_the_class_and_the_counters():
    c = TurboKVCache("turbo4", step=4)
    c.update_and_fetch(*rows(0, 2))
    assert repr(c) == "TurboKVCache(mode=turbo4, offset=2, cold_offset=0, capacity=4)"
    d = DelegatedKVCache(step=4, hot_threshold=1, fold_block=1)
    d.update_and_fetch(*rows(0, 3))
    assert repr(d) == "DelegatedKVCache(mode=turbo4delegated, offset=3, cold_offset=2, capacity=4)"


# -- appends ------------------------------------------------------------------
def test_append_refusals_name_append():
    c = TurboKVCache("turbo4", step=4)
    with refused(InvalidArgumentError, "append: keys must be an mx.array, got list"):
        c.update_and_fetch([0], rows(0, 1)[1])
    k, v = rows(0, 1, d=6)
    with refused(InvalidArgumentError, "values: head_dim must be a power of two in [2, 8192] for the Walsh-Hadamard "
                 "rotation, got 6"):
        c.update_and_fetch(k, v)
    k, v = rows(0, 1, d=8, dv=16)
    with refused(InvalidArgumentError, "append: keys head_dim must equal values head_dim in mode turbo4, got 8 and 16"):
        c.update_and_fetch(k, v)
    assert c.store is None and c.offset == 0


# -- the trim family ----------------------------------------------------------
@pytest.mark.parametrize(("call", "message"), [
    (lambda c: c.trim_to("1"), "trim_to: len must be an integer, got '1'"),
    (lambda c: c.trim_front_keep_sink(1.0), "trim_front: n must be an integer, got 1.0"),
    (lambda c: c.trim_front_keep_sink(1, "0"), "trim_front: keep must be an integer, got '0'"),
    (lambda c: c.detach().trim_to(1.5), "handle_trim_to: len must be an integer, got 1.5"),
])
def test_trim_refusals_name_the_operation_and_the_argument(call, message):
    c = cache("turbo4asym")
    c.update_and_fetch(*rows(0, 3))
    with refused(InvalidArgumentError, message):
        call(c)


def test_a_front_trim_without_a_sink_returns_zero():
    c = cache("turbo4asym")
    c.update_and_fetch(*rows(0, 3))
    assert c.trim_front_keep_sink(2) == 0 and c.trim_front(2) == 0 and c.offset == 3


# -- copies -------------------------------------------------------------------
def test_a_deep_copy_keeps_the_sharing_of_what_it_copies():
    """``copy.deepcopy`` of a structure that holds a cache and one of its
    arrays: the copied cache holds the copied array (the memo is passed
    down), as for any deep copy."""
    c = cache("turbo4asym")
    c.update_and_fetch(*rows(0, 2))
    dup, keys = copy.deepcopy([c, c.store["keys"]])
    assert dup.store["keys"] is keys
    assert window_bytes(dup.fetch()) == window_bytes(c.fetch())


# -- snapshots, handles and their checks --------------------------------------
def snap_of(c, **changes) -> TurboSnapshot:
    s = c.snapshot()
    for k, v in changes.items():
        setattr(s, k, v)
    return s


@pytest.mark.parametrize(("make", "message"), [
    (lambda c: "x", "restore: expected a TurboSnapshot, got str"),
    (lambda c: snap_of(c, mode="turbo4"), "restore: mode must be 'turbo4asym', got 'turbo4'"),
    (lambda c: snap_of(c, offset="2"), "restore: offset must be an integer, got '2'"),
    (lambda c: snap_of(c, live_start=1.0), "restore: live_start must be an integer, got 1.0"),
    (lambda c: snap_of(c, cold_offset=None), "restore: cold_offset must be an integer, got None"),
    (lambda c: snap_of(c, live_start=1), "restore: live_start must be 0 in mode turbo4asym, got 1"),
    (lambda c: snap_of(c, offset=-1), "restore: offset must be >= 0, got -1"),
    (lambda c: snap_of(c, store=None), "restore: live_len 3 > 0 but no tensors"),
    (lambda c: snap_of(c, store=[]), "restore: arrays must be a dict of name -> mx.array, got list"),
    (lambda c: snap_of(c, dtype=mx.int8), "restore: dtype must be one of float16, bfloat16, float32, got mlx.core.int8"),
    (lambda c: snap_of(c, k_dim=0), "restore: k_dim must be a positive integer, got 0"),
    (lambda c: snap_of(c, k_dim=True), "restore: k_dim must be a positive integer, got True"),
    (lambda c: snap_of(c, v_dim="16"), "restore: v_dim must be a positive integer, got '16'"),
    (lambda c: snap_of(c, v_dim=1),
     "values: head_dim must be a power of two in [2, 8192] for the Walsh-Hadamard rotation, got 1"),
    (lambda c: snap_of(c, cold_offset=1), "restore: cold_offset must be 0 in mode turbo4asym, got 1"),
    (lambda c: snap_of(c, cold_offset=-1), "restore: cold_offset must be 0 in mode turbo4asym, got -1"),
    (lambda c: snap_of(c, store={**c.store, "keys": "k"}), "restore: keys must be an mx.array, got str"),
    (lambda c: snap_of(c, store={**c.store, "v_norm": c.store["v_norm"][:, :1]}),
     "restore: v_norm must share [B, H] = (1, 2), got (1, 1, 4, 1)"),
])
def test_restore_refuses_each_malformed_snapshot_naming_the_field(make, message):
    c = cache("turbo4asym")
    c.update_and_fetch(*rows(0, 3))
    bad = make(c)
    before = (window_bytes(c.fetch()), c.offset, c.row_counts())
    with refused(InvalidArgumentError, message):
        c.restore(bad)
    assert (window_bytes(c.fetch()), c.offset, c.row_counts()) == before


def test_a_turbo4_snapshot_with_a_bad_key_head_dim_names_keys():
    c = cache("turbo4")
    c.update_and_fetch(*rows(0, 2, d=8))
    with refused(InvalidArgumentError, "keys: head_dim must be a power of two in [2, 8192] for the Walsh-Hadamard "
                 "rotation, got 6"):
        c.restore(snap_of(c, k_dim=6))


def test_a_delegated_snapshot_refuses_counters_out_of_step_naming_the_rows():
    c = cache("turbo4delegated")
    c.update_and_fetch(*rows(0, 5))  # hot 5 > threshold 3: one block of 2 folds
    assert (c.cold_offset, c.hot_len) == (2, 3)
    with refused(InvalidArgumentError,
                 "restore: cold_offset must satisfy 0 <= cold_offset <= offset (5), got 6"):
        c.restore(snap_of(c, cold_offset=6))
    counts = c.row_counts()
    with refused(InvalidArgumentError,
                 "restore: rows out of step: cold arrays need cold_offset=1, hot needs 4, keys at least "
                 f"offset=5; got {counts}"):
        c.restore(snap_of(c, cold_offset=1))


def test_install_refuses_a_non_handle_and_a_malformed_one_naming_install():
    c = cache("turbo4asym")
    c.update_and_fetch(*rows(0, 2))
    h = c.detach()
    with refused(InvalidArgumentError, "install: expected a TurboHandle, got TurboSnapshot"):
        c.install(snap_of(cache("turbo4asym")))
    h.mode = "turbo4"
    with refused(InvalidArgumentError, "install: mode must be 'turbo4asym', got 'turbo4'"):
        c.install(h)
    h.mode = "turbo4asym"
    c.install(h)
    assert (h.store, h.offset, h.cold_offset, h.consumed) == (None, 0, 0, True)
    assert c.offset == 2


def test_install_consumes_a_delegated_handle_whole():
    c = cache("turbo4delegated")
    c.update_and_fetch(*rows(0, 5))
    want = window_bytes(c.fetch())
    h = c.detach()
    d = cache("turbo4delegated")
    d.install(h)
    assert (h.store, h.offset, h.cold_offset) == (None, 0, 0)
    assert window_bytes(d.fetch()) == want and d.cold_offset == 2


def test_install_refuses_a_cache_holding_arrays_at_offset_zero():
    """A cache restored from a snapshot of capacity 4 and offset 0 holds
    arrays: it is not empty, whatever its offset."""
    c = cache("turbo4asym")
    c.update_and_fetch(*rows(0, 2))
    s = c.snapshot()
    s.offset = 0
    d = cache("turbo4asym")
    d.restore(s)
    assert d.offset == 0 and not d.empty()
    h = cache("turbo4asym")
    h.update_and_fetch(*rows(5, 1))
    with refused(StateError, "install: requires an empty cache, got offset=0, live_len=0"):
        d.install(h.detach())


# -- from_state ---------------------------------------------------------------
def test_from_state_of_a_subclass_builds_the_subclass_and_refuses_another_mode():
    class Sub(TurboKVCache):
        pass

    c = cache("turbo4")
    c.update_and_fetch(*rows(0, 3))
    got = Sub.from_state(c.state, c.meta_state)
    assert type(got) is Sub and window_bytes(got.fetch()) == window_bytes(c.fetch())
    with refused(InvalidArgumentError, "from_state: mode 'turbo4' is not a mode of DelegatedKVCache"):
        DelegatedKVCache.from_state(c.state, c.meta_state)


def test_from_state_refuses_a_state_that_is_not_a_sequence_naming_its_type():
    c = cache("turbo3asym")
    c.update_and_fetch(*rows(0, 2))
    names = tuple(sorted(c.store))
    with refused(InvalidArgumentError, f"from_state: state must hold {len(names)} arrays {names}, got str"):
        TurboKVCache.from_state("abc", c.meta_state)
    with refused(InvalidArgumentError, f"from_state: state must hold {len(names)} arrays {names}, got 1 arrays"):
        TurboKVCache.from_state(c.state[:1], c.meta_state)


def test_from_state_refuses_a_dtype_name_mlx_does_not_know_with_invalid_argument():
    """A saved dtype name that is not an MLX dtype (a file from another
    tool, a typo) leaves the holder without a dtype: check_store refuses it
    with InvalidArgumentError, never getattr's AttributeError."""
    c = cache("turbo4asym")
    c.update_and_fetch(*rows(0, 2))
    meta = list(c.meta_state)
    meta[4] = "bfloat99"
    with pytest.raises(InvalidArgumentError, match="from_state"):
        TurboKVCache.from_state(c.state, tuple(meta))

# -- the mlx-lm hooks ---------------------------------------------------------
def test_to_quantized_at_the_cache_bits_is_silent_and_at_other_bits_warns_once():
    c = TurboKVCache("turbo3asym")
    t4 = TurboKVCache("turbo4")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert t4.to_quantized() is t4  # 4 bits by default: turbo4's own
        assert c.to_quantized(bits=3) is c
    assert got == []
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert c.to_quantized() is c
        assert c.to_quantized(bits=8) is c
    assert len(got) == 1 and got[0].category is UserWarning
    assert str(got[0].message) == (
        "to_quantized(bits=4): this TurboKVCache stores mode 'turbo3asym' (3-bit codes) and keeps them (build the "
        "layer with mode='fp16' to take kv_bits; reported once per cache)")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"bits": "4"}, "to_quantized: bits must be an integer, got '4'"),
    ({"group_size": 64.0}, "to_quantized: group_size must be an integer, got 64.0"),
])
def test_to_quantized_refuses_a_non_integer_setting(kwargs, message):
    with refused(InvalidArgumentError, message):
        TurboKVCache("turbo4").to_quantized(**kwargs)


def test_make_mask_passes_the_window_on():
    c = cache("turbo4asym")
    c.update_and_fetch(*rows(0, 4))
    d = KVCache(step=4)
    d.update_and_fetch(*rows(0, 4))
    for window in (1, 2, None):
        got = c.make_mask(2, window_size=window, return_array=True)
        want = d.make_mask(2, window_size=window, return_array=True)
        assert np.array_equal(np.array(got), np.array(want)), window
    assert not np.array(c.make_mask(2, window_size=1, return_array=True)).all()


# -- gathers ------------------------------------------------------------------
@pytest.mark.parametrize(("call", "message"), [
    (lambda c: c.gather_positions("01"), "gather_positions: positions must be a list of integers, got str"),
    (lambda c: c.gather_positions([0, 1.0]), "gather_positions: positions must be an integer, got 1.0"),
    (lambda c: c.gather_within_tail("2", [0]), "gather_within_tail: tail_len must be an integer, got '2'"),
    (lambda c: c.gather_within_tail(2, 0), "gather_within_tail: kept must be a list of integers, got int"),
    (lambda c: c.gather_within_tail(2, [None]), "gather_within_tail: kept must be an integer, got None"),
])
def test_gather_refusals_name_the_operation_and_the_argument(call, message):
    c = cache("turbo4asym")
    c.update_and_fetch(*rows(0, 3))
    before = window_bytes(c.fetch())
    with refused(InvalidArgumentError, message):
        call(c)
    assert window_bytes(c.fetch()) == before and c.offset == 3


# -- Delegated's fold schedule at its boundaries -------------------------------
@pytest.mark.parametrize(("threshold", "block", "appends", "cold"), [
    (2, 1, [2], 0),  # hot == threshold: nothing folds
    (2, 1, [3], 1),
    (2, 2, [2, 1], 2),  # the handoff folds every held row, then hot 1 <= 2
    (0, 3, [1], 1),
    (1, 1, [1, 1], 1),  # handoff of the one held row
])
def test_delegated_folds_nothing_at_the_threshold_and_hands_off_held_rows(threshold, block, appends, cold):
    c = DelegatedKVCache(step=4, hot_threshold=threshold, fold_block=block)
    token = 0
    for n in appends:
        c.update_and_fetch(*rows(token, n))
        token += n
    assert c.cold_offset == cold and c.hot_len == token - cold


# == the quantizer ============================================================
def test_the_quantizer_refuses_bits_and_widths_it_cannot_pack():
    with refused(InvalidArgumentError, "turbo: bits must be 3 or 4, got 5"):
        tq.check_head_dim("values", 8, 5)
    with refused(InvalidArgumentError, "pack: head_dim must be even for 4-bit packing, got 7"):
        tq.packed_width(7, 4)
    with refused(InvalidArgumentError, "pack: head_dim must be a multiple of 8 for 3-bit packing, got 12"):
        tq.packed_width(12, 3)
    with refused(InvalidArgumentError, "pack: bits must be 3 or 4, got 2"):
        tq.packed_width(8, 2)


def test_packed_widths_are_whole_bytes():
    for d, bits, w in ((2, 4, 1), (16, 4, 8), (8, 3, 3), (64, 3, 24)):
        got = tq.packed_width(d, bits)
        assert got == w and type(got) is int


@pytest.mark.parametrize("bits", [3, 4])
def test_unpacked_indices_are_uint32_and_a_wrong_width_names_the_last_axis(bits):
    d = 16
    idx = mx.array(np.arange(2 * d).reshape(1, 1, 2, d) % (2**bits), dtype=mx.uint32)
    packed = tq.pack_indices(idx, bits)
    back = tq.unpack_indices(packed, bits, d)
    assert back.dtype == mx.uint32 and np.array_equal(np.array(back), np.array(idx))
    w = tq.packed_width(d, bits)
    with refused(InvalidArgumentError, f"unpack: packed width must be {w} for head_dim {d}, got {w - 1}"):
        tq.unpack_indices(packed[..., : w - 1], bits, d)


def test_the_fused_4_bit_dequantizer_refuses_a_wrong_width_naming_the_last_axis():
    x = mx.array(np.linspace(-1, 1, 2 * 16).reshape(1, 1, 2, 16), dtype=mx.float32)
    q = tq.quantize(x, 4, tq.V_SEED)
    short = tq.Quantized(q.packed[..., :7], q.norm, q.rescale)
    with refused(InvalidArgumentError, "unpack: packed width must be 8 for head_dim 16, got 7"):
        tq.dequantize(short, 4, tq.V_SEED, 16, mx.float16)


@pytest.mark.parametrize("bits", [3, 4])
def test_a_coordinate_on_a_decision_threshold_takes_the_lower_centroid(bits):
    """The nearest centroid by threshold count: a rotated coordinate
    exactly between two centroids (0, between the two middle ones of the
    symmetric codebook) takes the lower one, as an argmin over distances
    does. ``x = D1`` rotates to ``(sqrt(d), 0, ...)``-like rows with exact
    zeros."""
    d = 8
    d1, _ = tq.sign_vectors(d, tq.V_SEED)
    x = mx.array(np.array(d1, dtype=np.float32).reshape(1, 1, 1, d))
    y = np.array(tq.rotate(x / float(np.sqrt(d)), tq.V_SEED)).reshape(-1)
    zeros = np.flatnonzero(y == 0)
    assert zeros.size > 0
    idx = np.array(tq.unpack_indices(tq.quantize(x, bits, tq.V_SEED).packed, bits, d)).reshape(-1)
    lower = 2 ** (bits - 1) - 1
    assert (idx[zeros] == lower).all()


def test_dequantize_with_another_unpacker_uses_it_and_scales_by_the_rescale():
    """The fused 4-bit dequantizer stands for the standard unpacker only:
    rows packed another way are unpacked by theirs, the same values."""
    x = mx.array(np.random.default_rng(0).standard_normal((1, 2, 3, 16)) * 3, dtype=mx.float32)
    for bits in (3, 4):
        q = tq.quantize(x, bits, tq.V_SEED)
        qx = tq.quantize(x, bits, tq.V_SEED, pack=_pack_xor)
        assert (qx.rescale is None) == (bits == 3)
        want = np.array(tq.dequantize(q, bits, tq.V_SEED, 16, mx.float32))
        got = np.array(tq.dequantize(qx, bits, tq.V_SEED, 16, mx.float32, _unpack_xor))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, np.array(x), rtol=0.5, atol=1.5)


@pytest.mark.parametrize("bits", [3, 4])
def test_a_row_beyond_the_output_range_comes_back_clipped(bits):
    x = mx.array(np.full((1, 1, 1, 8), 1e30, dtype=np.float32) * np.array([1, -1] * 4, dtype=np.float32))
    for unpack in (tq.unpack_indices, _unpack_xor):
        pack = tq.pack_indices if unpack is tq.unpack_indices else _pack_xor
        out = np.array(tq.dequantize(tq.quantize(x, bits, tq.V_SEED, pack=pack), bits, tq.V_SEED, 8, mx.float16,
                                     unpack).astype(mx.float32))
        assert np.isfinite(out).all() and np.abs(out).max() == 65504.0


def test_only_cuda_decode_rows_with_the_standard_packer_take_the_compiled_quantizer(monkeypatch):
    """The dispatch of quantize: on CUDA, rows of one position per head
    (``x.shape[-2] == 1``, rank >= 2) with the standard packer go through
    the compiled quantizer; anything else, and anything off CUDA, through
    the op-by-op one. Both give the same bytes."""
    from kvspec.impl import fused, write

    calls = []
    real = tq._decode_quantizer

    def spy(bits, seed):
        calls.append(bits)
        return real(bits, seed)

    monkeypatch.setattr(tq, "_decode_quantizer", spy)
    decode = mx.array(np.linspace(-2, 2, 2 * 8).reshape(1, 2, 1, 8), dtype=mx.float16)
    flat = mx.array(np.linspace(-2, 2, 8).reshape(1, 8), dtype=mx.float16)  # rank 2, one row
    three = mx.array(np.linspace(-2, 2, 2 * 8).reshape(2, 1, 8), dtype=mx.float16)  # shape[2] is d, not 1
    block = mx.array(np.linspace(-2, 2, 3 * 8).reshape(1, 1, 3, 8), dtype=mx.float16)
    want = {id(a): [np.array(b) for b in tq.quantize(a, 4, tq.V_SEED).arrays()] for a in (decode, flat, three)}
    assert write.backend() != "cuda"
    for a in (decode, flat, three, block):
        tq.quantize(a, 4, tq.V_SEED)
    assert calls == []
    stand_in(monkeypatch, "cuda")
    assert fused.ENABLED
    for a in (decode, flat, three):
        got = tq.quantize(a, 4, tq.V_SEED)
        assert all(np.array_equal(np.array(g), w) for g, w in zip(got.arrays(), want[id(a)], strict=True))
    assert calls == [4, 4, 4]
    tq.quantize(block, 4, tq.V_SEED)
    tq.quantize(decode, 4, tq.V_SEED, pack=_pack_xor)
    assert calls == [4, 4, 4]


@pytest.mark.parametrize("dtype", [None, "float16", 16])
def test_check_store_refuses_a_dtype_that_is_not_an_mlx_dtype_by_name(dtype):
    """A holder or a ``meta_state`` without a dtype (None, a name string)
    is refused with the argument and the rule, not MLX's TypeError from
    comparing a Dtype with something else."""
    from kvspec.impl.turbo import check_store

    with pytest.raises(InvalidArgumentError, match=re.escape(
            f"restore: dtype must be one of float16, bfloat16, float32, got {dtype!r}")):
        check_store("restore", "turbo4", {}, 0, 0, dtype, 4, 4)
