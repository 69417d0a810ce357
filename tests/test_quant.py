"""Int8 quantizer: a NumPy reference and the round-trip bound."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvspec.fuzz import quant_ref
from kvspec.impl.quant import dequantize_int8, quantize_int8

ROWS = arrays(np.float16, st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 3), st.sampled_from([8, 16])),
              elements=st.floats(-1000, 1000, width=16))


@given(ROWS)
def test_int8_round_trip_within_one_step(x):
    q, scale = quantize_int8(mx.array(x))
    assert q.dtype == mx.int8 and scale.dtype == mx.float16 and scale.shape == (*x.shape[:-1], 1)
    back = np.array(dequantize_int8(q, scale)).astype(np.float32)
    s = np.array(scale).astype(np.float32)
    # within one quantization step per row (half a step plus fp16 rounding)
    assert np.all(np.abs(back - x.astype(np.float32)) <= s * 1.0 + 1e-3)


@given(ROWS)
def test_int8_matches_numpy_reference(x):
    q, scale = quantize_int8(mx.array(x))
    absmax = np.max(np.abs(x), axis=-1, keepdims=True)
    ref_scale = (absmax / np.float16(127)).astype(np.float16)
    ref_scale = np.where(ref_scale == 0, np.float16(1), ref_scale)
    ref_q = np.clip(np.round(x / ref_scale), -128, 127).astype(np.int8)
    assert np.array_equal(np.array(scale), ref_scale)
    # division may round differently by one ulp before round(): allow one level
    assert np.max(np.abs(np.array(q).astype(np.int16) - ref_q.astype(np.int16))) <= 1


def test_zero_row_uses_scale_one():
    q, scale = quantize_int8(mx.zeros((1, 1, 1, 8)))
    assert np.array(scale).item() == 1.0 and not np.array(q).any()


def test_quantization_is_per_row():
    x = np.random.default_rng(0).standard_normal((1, 2, 5, 8)).astype(np.float16)
    q_all, s_all = quantize_int8(mx.array(x))
    for j in range(5):
        q1, s1 = quantize_int8(mx.array(x[:, :, j : j + 1, :]))
        assert np.array_equal(np.array(q_all)[:, :, j : j + 1], np.array(q1))
        assert np.array_equal(np.array(s_all)[:, :, j : j + 1], np.array(s1))


def first_difference(x: np.ndarray, got: np.ndarray, want: np.ndarray) -> str:
    """'' when ``got`` and ``want`` agree bytewise (NaN-free), else the first
    differing row: its input and both outputs."""
    got = np.asarray(got, dtype=np.float64).reshape(len(x), -1)
    want = np.asarray(want, dtype=np.float64).reshape(len(x), -1)
    bad = np.flatnonzero(np.any((got != want) | (np.signbit(got) != np.signbit(want)), axis=1))
    if not len(bad):
        return ""
    i = int(bad[0])
    return (f"{len(bad)} rows differ; first: row {i}, input {x.reshape(len(x), -1)[i].tolist()}: "
            f"implementation {got[i].tolist()}, reference {want[i].tolist()}")


def test_int8_every_float16_magnitude():
    """Every finite float16 value, both signs, as a row's absmax, against the
    independent NumPy oracle (kvspec.fuzz.quant_ref, written from the rule's text).
    Below about 1.6e-5 the scale ``absmax / 127`` is subnormal and rounds
    coarsely, so ``x / scale`` reaches 190: the clip to [-128, 127] is what
    keeps such rows from wrapping around int8 (a row of +7.6e-6 would read
    back as negative). Exhaustive, because random rows almost never land
    there. The largest magnitudes read back saturated, never inf."""
    pos = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16)
    x = np.stack([pos, -pos, pos / np.float16(3)], axis=-1).astype(np.float16)  # absmax = pos
    x = np.concatenate([x, -x])[:, None, None, :]  # [2N, 1, 1, 3]
    q, scale = quantize_int8(mx.array(x))
    ref_q, ref_scale = quant_ref.quantize(x)
    assert not (msg := first_difference(x, np.array(scale), ref_scale)), "scale: " + msg
    assert not (msg := first_difference(x, np.array(q), ref_q)), "q: " + msg
    assert int(np.abs(np.array(q).astype(np.int32)).max()) <= 128
    back = np.array(dequantize_int8(q, scale)).astype(np.float64)
    assert not (msg := first_difference(x, back, quant_ref.dequantize(ref_q, ref_scale))), "read back: " + msg
    assert np.isfinite(back).all()
    # the sign of every nonzero value survives quantization
    assert np.all(np.sign(back[back != 0]) == np.sign(x.astype(np.float64)[back != 0]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_int8_every_bfloat16_magnitude_reads_back_in_its_dtype(dtype):
    """Every bfloat16 value that is finite in float16 (both signs) as a row's
    absmax; the row comes in as ``dtype`` and is read back in it."""
    bits = np.arange(1, 0x7F80, dtype=np.uint32) << 16
    pos = bits.view(np.float32)
    with np.errstate(over="ignore"):
        pos = pos[np.isfinite(pos.astype(np.float16))]
    x = np.stack([pos, -pos / 3, pos / 7], axis=-1)
    x = np.concatenate([x, -x])[:, None, None, :].astype(np.float32)
    xm = mx.array(x).astype(getattr(mx, dtype))
    x = np.array(xm.astype(mx.float32))  # what the cache was handed
    q, scale = quantize_int8(xm)
    back = np.array(dequantize_int8(q, scale, getattr(mx, dtype)).astype(mx.float32))
    assert not (msg := first_difference(x, back, quant_ref.round_trip(x, dtype))), msg


def test_first_difference_names_the_row():
    x = np.zeros((3, 2))
    got, want = np.zeros((3, 2)), np.zeros((3, 2))
    got[1, 1] = 5.0
    assert first_difference(x, got, want).startswith("1 rows differ; first: row 1")
    assert first_difference(x, -0.0 * np.ones((3, 2)), want) != ""
    assert first_difference(x, want, want) == ""


# -- the append path's finiteness check (kvspec.impl.quant.int8_rows_representable) --
# One element out of float16's range anywhere in keys or values (any batch,
# head, row or column; any incoming float dtype) names that tensor; a check
# of only the keys, only some rows or heads, or in the incoming dtype's own
# range (bfloat16 and float32 hold 1e5 finite) misses some of these.
SHAPE = (2, 2, 3, 4)
PLACES = [(b, h, t, d) for b in range(2) for h in range(2) for t in range(3) for d in (0, 3)]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("bad", [1e5, 65520.0, float("inf"), float("-inf"), float("nan")])
def test_rows_check_finds_one_bad_element_anywhere_and_names_its_tensor(dtype, bad):
    from kvspec.impl.quant import int8_rows_representable

    if dtype == mx.float16 and bad == 65520.0:  # rounds to inf on the way in: the same case as inf
        bad = float("inf")
    # large but finite in float16 whatever the dtype (65280 is exact in bfloat16 too), both signs
    fine = mx.array(np.where(np.arange(48).reshape(SHAPE) % 2, 65280.0, -65280.0)).astype(dtype)
    assert int8_rows_representable(fine, fine) is None
    for place in PLACES:
        x = np.zeros(SHAPE, dtype=np.float32)
        x[place] = bad
        one = mx.array(x).astype(dtype)
        assert int8_rows_representable(one, fine) == "keys", (place, dtype, bad)
        assert int8_rows_representable(fine, one) == "values", (place, dtype, bad)
        assert int8_rows_representable(one, one) == "keys", (place, dtype, bad)  # the first named, as documented


@pytest.mark.parametrize("name", ["keys", "values"])
@pytest.mark.parametrize("row", [0, 2, 4])
def test_int8_append_refuses_a_bad_element_in_any_row_of_a_prefill(name, row):
    """Through the cache: a 5-row prefill with one bad element in row ``row``
    of one head is refused naming the tensor, and the cache keeps its rows."""
    from kvspec.impl.dense import KVCache
    from kvspec.spec.errors import InvalidArgumentError

    c = KVCache("int8", step=4)
    c.update_and_fetch(mx.ones((1, 2, 3, 8), dtype=mx.bfloat16), mx.ones((1, 2, 3, 8), dtype=mx.bfloat16))
    before = (c.offset, c.capacity, np.array(c.fetch()[0].astype(mx.float32)))
    good = np.ones((1, 2, 5, 8), dtype=np.float32)
    bad = good.copy()
    bad[0, 1, row, 5] = 3e5
    k, v = (bad, good) if name == "keys" else (good, bad)
    with pytest.raises(InvalidArgumentError, match=f"append: {name} must be finite within float16's range"):
        c.update_and_fetch(mx.array(k).astype(mx.bfloat16), mx.array(v).astype(mx.bfloat16))
    assert (c.offset, c.capacity) == before[:2] and np.array_equal(np.array(c.fetch()[0].astype(mx.float32)), before[2])
