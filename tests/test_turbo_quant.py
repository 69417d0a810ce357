"""The Turbo quantizer (impl/turbo_quant.py) against the independent NumPy
reference in fuzz/turbo_ref.py (the fuzzer's oracle for Turbo rows too).

Stated tolerance: MLX computes in float32 and the reference in float64, so a
coordinate lying within float32 rounding of a decision threshold may pick the
neighbouring centroid. We require (a) at least 99.9% of the indices to agree,
(b) norms to agree within 1e-6 relative, and (c) every row whose indices all
agree to dequantize within 1e-5 * ||x|| of the reference (float32 output).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvspec.fuzz import turbo_ref as ref
from kvspec.impl import turbo_quant as tq
from kvspec.spec.errors import InvalidArgumentError


def _rows(d: int, n: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + d).standard_normal((1, 2, n, d)).astype(np.float32)


def test_lcg_signs_match_the_reference_and_k_differs_from_v():
    assert tq.lcg_signs(40, tq.V_SEED) == tuple(int(s) for s in ref.signs(40, tq.V_SEED))
    d1, d2 = tq.sign_vectors(64, tq.V_SEED)
    assert set(d1) == {1, -1} and d1 != d2
    assert tq.sign_vectors(64, tq.K_SEED) != (d1, d2)


@pytest.mark.parametrize("d", [2, 8, 64, 128])
def test_rotation_is_orthonormal_and_matches_the_reference(d):
    eye = mx.eye(d, dtype=mx.float32)
    r = np.array(tq.rotate(eye, tq.V_SEED)).T  # column j = R e_j
    np.testing.assert_allclose(r @ r.T, np.eye(d), atol=1e-6)
    np.testing.assert_allclose(r, ref.rotation(d, tq.V_SEED), atol=1e-6)
    x = mx.array(_rows(d)[0, 0])
    np.testing.assert_allclose(np.array(tq.inverse_rotate(tq.rotate(x, tq.K_SEED), tq.K_SEED)), np.array(x), atol=1e-5)


@pytest.mark.parametrize("bits,d", [(4, 8), (4, 16), (4, 24), (4, 64), (4, 128),
                                    (3, 8), (3, 16), (3, 24), (3, 64), (3, 128)])
def test_pack_unpack_round_trip_and_layout(bits, d):
    rng = np.random.default_rng(d * bits)
    idx = rng.integers(0, 2 ** bits, size=(2, 3, 5, d))
    idx[0, 0, 0] = 2 ** bits - 1  # all bits set
    idx[0, 0, 1] = 0
    packed = tq.pack_indices(mx.array(idx), bits)
    assert packed.dtype == mx.uint8 and packed.shape[-1] == (d // 2 if bits == 4 else 3 * d // 8)
    np.testing.assert_array_equal(np.array(tq.unpack_indices(packed, bits, d)), idx)
    for row, got in zip(idx.reshape(-1, d), np.array(packed).reshape(-1, packed.shape[-1])):
        np.testing.assert_array_equal(got, ref.pack(row, bits))
        np.testing.assert_array_equal(ref.unpack(got, bits, d), row)


def test_nibble_and_24_bit_word_order():
    # even coordinate in the low nibble
    assert np.array(tq.pack_indices(mx.array([[1, 2]]), 4)).tolist() == [[0x21]]
    # little-endian 24-bit word sum idx_j << 3j
    word = sum(j << (3 * j) for j in range(8))
    want = [word & 0xFF, (word >> 8) & 0xFF, word >> 16]
    assert np.array(tq.pack_indices(mx.array([list(range(8))]), 3)).tolist() == [want]


@pytest.mark.parametrize("d", [4, 12, 20])
def test_three_bit_packer_refuses_a_partial_word(d):
    with pytest.raises(InvalidArgumentError, match=f"multiple of 8 for 3-bit packing, got {d}"):
        tq.pack_indices(mx.zeros((1, d), dtype=mx.uint32), 3)
    with pytest.raises(InvalidArgumentError, match="packed width must be"):
        tq.unpack_indices(mx.zeros((1, 3 * d // 8), dtype=mx.uint8), 3, 8)


@pytest.mark.parametrize("bits,d,msg", [
    (4, 24, "power of two"), (3, 24, "power of two"), (4, 1, "power of two"), (4, 16384, "power of two"),
    (3, 4, "multiple of 8"), (3, 2, "multiple of 8"),
])
def test_quantize_checks_head_dim_up_front(bits, d, msg):
    with pytest.raises(InvalidArgumentError, match=f"values: head_dim must be .*{msg}.*got {d}"):
        tq.quantize(mx.ones((1, 1, 1, d)), bits, tq.V_SEED)


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("d", [8, 16, 64, 128])
def test_mlx_matches_the_numpy_reference(bits, d):
    x = _rows(d)
    q = tq.quantize(mx.array(x), bits, tq.V_SEED)
    flat = x.reshape(-1, d)
    packed = np.array(q.packed).reshape(len(flat), -1)
    norms = np.array(q.norm).reshape(-1)
    got = np.array(tq.dequantize(q, bits, tq.V_SEED, d, mx.float32)).reshape(len(flat), d)
    agree_idx = agree_rows = 0
    for i, row in enumerate(flat):
        rp, rn, rr = ref.quantize_row(row, bits, tq.V_SEED)
        mine, theirs = tq_unpack(packed[i], bits, d), ref.unpack(rp, bits, d)
        agree_idx += int(np.sum(mine == theirs))
        assert abs(norms[i] - rn) <= 1e-6 * rn
        if rr is not None:
            assert abs(float(np.array(q.rescale).reshape(-1)[i]) - rr) <= 1e-5 * rr
        if np.array_equal(mine, theirs):
            agree_rows += 1
            want = ref.dequantize_row(rp, rn, bits, tq.V_SEED, d)
            assert np.max(np.abs(got[i] - want)) <= 1e-5 * rn
    assert agree_idx >= 0.999 * flat.size
    assert agree_rows >= 0.9 * len(flat)


def tq_unpack(packed: np.ndarray, bits: int, d: int) -> np.ndarray:
    return np.array(tq.unpack_indices(mx.array(packed[None]), bits, d))[0]


@pytest.mark.parametrize("bits,bound", [(4, 0.11), (3, 0.20)])
def test_reconstruction_error_per_bit_width(bits, bound):
    """Relative L2 error ||x - x_hat|| / ||x|| over Gaussian rows, d = 128.
    Lloyd-Max predicts sqrt(MSE): 0.0975 at 4 bits, 0.186 at 3 bits."""
    x = _rows(128, n=256)
    got = np.array(tq.roundtrip(mx.array(x), bits, tq.V_SEED))
    err = float(np.mean(np.linalg.norm(got - x, axis=-1) / np.linalg.norm(x, axis=-1)))
    print(f"turbo {bits}-bit relative L2 reconstruction error (d=128): {err:.4f}")
    assert 0.5 * bound < err < bound


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_dtype_kept_and_extremes_stay_finite(dtype):
    top = float(mx.finfo(dtype).max)
    rows = mx.array([[[[top] + [0.0] * 7, [-top] * 8, [0.0] * 8, [1e-7] * 8]]]).astype(dtype)
    for bits in (3, 4):
        out = tq.roundtrip(rows, bits, tq.V_SEED)
        assert out.dtype == dtype
        assert bool(mx.all(mx.isfinite(out)))
        assert np.all(np.array(out.astype(mx.float32))[0, 0, 2] == 0)  # a zero row stays zero


@pytest.mark.parametrize("bits", [3, 4])
def test_a_row_quantizes_the_same_alone_or_in_a_batch(bits):
    x = mx.array(_rows(16, n=9)).astype(mx.float16)
    whole = tq.roundtrip(x, bits, tq.V_SEED)
    for t in range(9):
        alone = tq.roundtrip(x[:, :, t : t + 1, :], bits, tq.V_SEED)
        assert np.array_equal(np.array(alone), np.array(whole[:, :, t : t + 1, :]))


F32_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("bits", [3, 4])
def test_every_magnitude_matches_the_reference(dtype, bits):
    """Rows at every scale float32 and bfloat16 can hold, from where squares
    underflow float32 (|x| ~ 1e-20) to where they overflow it (|x| ~ 1e20,
    up to 1e38): the norm is the float64 reference's (saturated at float32's
    maximum) and the row comes back within the Lloyd-Max error of itself.
    The N(0, 1) rows of the other tests and the dtype's extremes cannot tell
    a norm taken on the raw squares from one taken after the peak scaling."""
    d = 16
    base = np.random.default_rng(7).standard_normal((1, 1, 4, d))
    for exp in range(-36, 39, 3):
        x = mx.array(np.clip(base * 10.0 ** exp, -F32_MAX / 2, F32_MAX / 2).astype(np.float32)).astype(dtype)
        exact = np.array(x.astype(mx.float32)).astype(np.float64)
        q = tq.quantize(x, bits, tq.V_SEED)
        norms = np.array(q.norm).reshape(-1)
        back = np.array(tq.dequantize(q, bits, tq.V_SEED, d, dtype).astype(mx.float32)).astype(np.float64)
        for i, row in enumerate(exact.reshape(-1, d)):
            want = min(float(np.sqrt(np.sum(row * row))), F32_MAX)
            assert abs(norms[i] - want) <= 1e-5 * want, (exp, i, norms[i], want)
            if want < F32_MAX:
                err = np.linalg.norm(back.reshape(-1, d)[i] - row) / want
                assert err < 0.5, (exp, i, err)
