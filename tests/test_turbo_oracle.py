"""The independent Turbo oracle (``kvspec.fuzz.turbo_ref``, used by
``kvspec.fuzz.turbo.TurboLockstep.check_reference``) is as sharp as it says.

The quantizer's own tests (tests/test_turbo_quant.py) check that the
correct quantizer passes the reference; nothing there checks that a
slightly wrong one fails it. Here small wrongs are planted and each must be
rejected: a norm or a rescale off by ten times the stated relative
tolerance, a centroid index moved across a threshold the coordinate is not
within ``Y_TOL`` of, a value off by a few times the stated value tolerance
(per dtype). And through the harness: a quantizer shared by the
implementation and the byte oracle (so only the reference can see it)
whose K or V norm is off by 1e-3 is caught in every dtype and mode, for
K where the mode quantizes K (a check that skipped a dtype, or K, or
compared with a loose tolerance, passed every other test).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvspec.fuzz import turbo_ref as ref
from kvspec.impl import turbo_quant as tq

DTYPES = ("float16", "bfloat16", "float32")
#: the tolerances fuzz/turbo_ref.py states (its docstring: float32 against
#: float64 arithmetic, each dtype's half ulp), written out here so that a
#: loosened constant there is a rejected plant here, not a moved goalpost
NORM_RTOL = 1e-5
Y_TOL = 1e-5
DTYPE_EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}


def _stored(bits: int, d: int = 16, rows: int = 6, seed: int = tq.V_SEED, dtype: str = "float32"):
    """Rows ``[1, 1, rows, d]`` (float64) and what the quantizer stores and
    returns for them, as NumPy."""
    import mlx.core as mx

    x = np.random.default_rng(bits * 100 + d).standard_normal((1, 1, rows, d)) * 3.0
    xm = mx.array(x.astype(np.float32)).astype(getattr(mx, dtype))
    exact = np.array(xm.astype(mx.float32)).astype(np.float64)
    q = tq.quantize(xm, bits, seed)
    back = np.array(tq.dequantize(q, bits, seed, d, xm.dtype).astype(mx.float32)).astype(np.float64)
    rescale = None if q.rescale is None else np.array(q.rescale)
    return exact, np.array(q.packed), np.array(q.norm), rescale, back


@pytest.mark.parametrize("bits", [3, 4])
def test_the_correct_quantizer_passes(bits):
    for dtype in DTYPES:
        x, packed, norm, rescale, back = _stored(bits, dtype=dtype)
        assert ref.check_stored(x, packed, norm, rescale, bits, tq.V_SEED) is None
        idx = ref.unpack_rows(packed, bits, x.shape[-1])
        assert ref.check_values(x, idx, back, bits, tq.V_SEED, dtype) is None


@pytest.mark.parametrize("bits", [3, 4])
def test_a_norm_or_rescale_ten_tolerances_off_is_rejected(bits):
    x, packed, norm, rescale, _ = _stored(bits)
    off = norm.copy()
    off[0, 0, 2, 0] *= 1 + 10 * NORM_RTOL
    assert "norm at [0, 0, 2]" in (ref.check_stored(x, packed, off, rescale, bits, tq.V_SEED) or "")
    if bits == 4:
        off = rescale.copy()
        off[0, 0, 3, 0] *= 1 - 10 * NORM_RTOL
        assert "rescale at [0, 0, 3]" in (ref.check_stored(x, packed, norm, off, bits, tq.V_SEED) or "")
        assert "no rescale" in ref.check_stored(x, packed, norm, None, bits, tq.V_SEED)


def _pack(idx: np.ndarray, bits: int) -> np.ndarray:
    return np.stack([ref.pack(row, bits) for row in idx.reshape(-1, idx.shape[-1])]).reshape(
        *idx.shape[:-1], -1)


@pytest.mark.parametrize("bits", [3, 4])
def test_an_index_moved_across_a_threshold_it_is_not_near_is_rejected(bits):
    """A coordinate between 100 and 1000 times the stated ``Y_TOL`` from its nearest
    threshold, moved to the centroid across it: a wrong index (only
    coordinates within ``Y_TOL`` may take either neighbour)."""
    d = 16
    x = np.random.default_rng(5).standard_normal((1, 1, 64, d))
    idx, _, norm = ref.reference(x, bits, tq.V_SEED)
    y = (x / norm) @ ref.rotation(d, tq.V_SEED).T
    c = np.array(ref.unit_centroids(bits)) / np.sqrt(d)
    mids = (c[1:] + c[:-1]) / 2
    gap = y[..., None] - mids
    near = np.argmin(np.abs(gap), axis=-1)
    dist = np.take_along_axis(np.abs(gap), near[..., None], axis=-1)[..., 0]
    at = tuple(int(i) for i in np.argwhere((dist > 100 * Y_TOL) & (dist < 1000 * Y_TOL))[0])
    moved = idx.copy()
    # across threshold `near`: from centroid near (below) to near + 1 (above) or back
    moved[at] = near[at] + 1 if idx[at] == near[at] else near[at]
    assert abs(int(moved[at]) - int(idx[at])) == 1
    f32 = norm.astype(np.float32)
    y_hat = c[moved]
    rescale = (norm / np.sqrt(np.sum(y_hat * y_hat, axis=-1, keepdims=True))).astype(np.float32)
    got = ref.check_stored(x, _pack(moved, bits), f32, rescale if bits == 4 else None, bits, tq.V_SEED)
    assert got is not None and got.startswith(f"centroid index at {list(at)}"), got
    # and the unmoved indices pass
    y_hat = c[idx]
    rescale = (norm / np.sqrt(np.sum(y_hat * y_hat, axis=-1, keepdims=True))).astype(np.float32)
    assert ref.check_stored(x, _pack(idx, bits), f32, rescale if bits == 4 else None, bits, tq.V_SEED) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [3, 4])
def test_a_value_a_few_tolerances_off_is_rejected(bits, dtype):
    """Four times the stated value tolerance of ``dtype`` off, in one
    coordinate: rejected (an oracle using a coarser dtype's rounding for
    every dtype passed it)."""
    x, packed, _, _, back = _stored(bits, dtype=dtype)
    idx = ref.unpack_rows(packed, bits, x.shape[-1])
    norm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
    tol = (2 * DTYPE_EPS[dtype] + 1e-5) * norm
    off = back.copy()
    off[0, 0, 1, 5] += 4 * tol[0, 0, 1, 0]
    got = ref.check_values(x, idx, off, bits, tq.V_SEED, dtype)
    assert got is not None and got.startswith("value at [0, 0, 1, 5]"), got


# -- through the harness: a shared quantizer bug only the reference sees ------------

#: (mode, which rows of it are quantized by the seed)
CASES = [("turbo4asym", "V"), ("turbo4", "V"), ("turbo4", "K"), ("turbo3asym", "V"), ("turbo4delegated", "V")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,which", CASES)
def test_a_shared_quantizer_bug_is_caught_by_the_reference(monkeypatch, mode, which, dtype):
    """The implementation and the byte oracle both call
    ``kvspec.impl.turbo_quant.quantize``; one that stores K's (or V's) norm 1e-3
    too large gives both the same bytes, so only the reference can tell.
    The harness must, in every dtype and for K and V, on plain and
    ranged rows."""
    from kvspec.fuzz.replay import replay
    from kvspec.fuzz.trace import parse

    real = tq.quantize
    seed = tq.K_SEED if which == "K" else tq.V_SEED

    def quantize(x, bits, s, *args, **kw):
        q = real(x, bits, s, *args, **kw)
        return tq.Quantized(q.packed, q.norm * (1 + 1e-3), q.rescale) if s == seed else q

    monkeypatch.setattr(tq, "quantize", quantize)
    for rows in ("numpy", "ranged"):
        cache = {"kind": "dense", "mode": mode, "step": 2, "head_dim": 8, "dtype": dtype, "rows": rows}
        ops = [{"op": "append", "n": 3}] + [{"op": "append", "n": 1}] * 3
        if mode == "turbo4delegated":
            cache.update(hot_threshold=2, fold_block=2)
        result = replay(parse({"kvtrace": 1, "cache": cache, "ops": ops}))
        assert not result.ok, (mode, which, dtype, rows)
        msg = str(result.divergence)
        assert f"stored {which} rows differ from the reference quantizer" in msg, msg
