"""Int8 quantizer: a NumPy reference and the round-trip bound."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from impl.quant import dequantize_int8, quantize_int8

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


def _reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_int8 in NumPy float16 arithmetic (each op rounded to fp16)."""
    absmax = np.max(np.abs(x), axis=-1, keepdims=True)
    scale = (absmax / np.float16(127)).astype(np.float16)
    scale = np.where(scale == 0, np.float16(1), scale)
    q = np.clip(np.round((x / scale).astype(np.float16)), -128, 127).astype(np.int8)
    return q, scale


def test_int8_every_float16_magnitude():
    """Every finite float16 value, both signs, as a row's absmax. Below about
    1.6e-5 the scale ``absmax / 127`` is subnormal and rounds coarsely, so
    ``x / scale`` reaches 190: the clip to [-128, 127] is what keeps such
    rows from wrapping around int8 (a row of +7.6e-6 would read back as
    negative). Exhaustive, because random rows almost never land there."""
    pos = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16)
    x = np.stack([pos, -pos, pos / np.float16(3)], axis=-1).astype(np.float16)  # absmax = pos
    x = np.concatenate([x, -x])[:, None, None, :]  # [2N, 1, 1, 3]
    q, scale = quantize_int8(mx.array(x))
    ref_q, ref_scale = _reference(x)
    assert np.array_equal(np.array(scale), ref_scale)
    assert np.array_equal(np.array(q), ref_q)
    assert int(np.abs(np.array(q).astype(np.int32)).max()) <= 128
    # the sign of every nonzero value survives quantization
    back = np.array(dequantize_int8(q, scale)).astype(np.float32)
    assert np.all(np.sign(back[back != 0]) == np.sign(x.astype(np.float32)[back != 0]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 65505.0 * 2, -1e6])
@pytest.mark.parametrize("which", ["keys", "values"])
def test_int8_refuses_rows_it_cannot_store_finitely(bad, which):
    """semantics.md 2 "Storage": NaN, inf and values beyond the float16 range
    are refused in Int8 (the scale would be non-finite); nothing changes.
    Fp16 stores them as given."""
    from impl.dense import KVCache
    from spec.errors import InvalidArgumentError

    c = KVCache("int8", step=2)
    good = mx.ones((1, 1, 1, 4), dtype=mx.float32)
    c.update_and_fetch(good, good)
    before = (c.offset, c.capacity, np.array(c.fetch()[0]).tobytes())
    row = np.ones((1, 1, 1, 4), dtype=np.float32)
    row[0, 0, 0, 2] = bad
    args = {"keys": good, "values": good}
    args[which] = mx.array(row)
    with pytest.raises(InvalidArgumentError, match=f"append: {which} must be finite and within the float16 range"):
        c.update_and_fetch(args["keys"], args["values"])
    assert (c.offset, c.capacity, np.array(c.fetch()[0]).tobytes()) == before
    ok = KVCache("int8", step=2)
    edge = np.full((1, 1, 1, 4), 65504.0, dtype=np.float32)
    ok.update_and_fetch(mx.array(edge), mx.array(edge))  # the range's edge is accepted
    assert ok.offset == 1
    f = KVCache("fp16")
    f.update_and_fetch(args["keys"], args["values"])
    assert f.offset == 1
