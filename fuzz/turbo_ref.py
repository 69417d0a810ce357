"""An independent NumPy reference of the Turbo quantizer (semantics.md 2,
"Turbo modes"), written from the rule, not from impl/turbo_quant.py:
an explicit Hadamard matrix (scipy.linalg.hadamard), nearest centroid by
argmin of distances, packing bit by bit in Python integers, float64
arithmetic throughout.

Two uses: ``tests/test_turbo_quant.py`` compares the quantizer with the
per-row functions (:func:`quantize_row`, :func:`dequantize_row`), and the
fuzzer's Turbo harness (``fuzz/turbo.py``) checks every row a Turbo cache
stores against :func:`check_stored` and every quantized row it hands back
against :func:`check_values` (so a bug in the implementation's quantizer,
which the harness's byte oracle shares, cannot hide: a nibble order, a
norm's scaling, a rescale, a rotation). The stated tolerance: MLX computes
in float32 and this reference in float64, so a coordinate within
:data:`Y_TOL` of a decision threshold may take either neighbouring
centroid; norms and rescales agree within :data:`NORM_RTOL` relative;
values within the output dtype's rounding plus float32's, relative to the
row's norm. The range decision (impl/turbo_quant.py) is followed: a norm or
rescale beyond float32 saturates at float32's maximum, values are clipped to
the output dtype's finite range.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from scipy.linalg import hadamard

from kvspec.impl.codebooks import unit_centroids

MASK64 = (1 << 64) - 1


def signs(count: int, seed: int) -> np.ndarray:
    """LCG x <- 6364136223846793005 x + 1442695040888963407 (mod 2^64);
    sign -1 when the top bit of the new state is set."""
    out, x = [], seed & MASK64
    for _ in range(count):
        x = (6364136223846793005 * x + 1442695040888963407) & MASK64
        out.append(-1.0 if x >= 1 << 63 else 1.0)
    return np.array(out)


@cache
def rotation(d: int, seed: int) -> np.ndarray:
    """The d x d matrix D2 H D1 (read only: cached)."""
    s = signs(2 * d, seed)
    h = hadamard(d) / np.sqrt(d)
    out = np.diag(s[d:]) @ h @ np.diag(s[:d])
    out.setflags(write=False)
    return out


def pack(idx: np.ndarray, bits: int) -> np.ndarray:
    """One row of indices -> bytes."""
    idx = [int(i) for i in idx]
    if bits == 4:
        return np.array([idx[i] | (idx[i + 1] << 4) for i in range(0, len(idx), 2)], dtype=np.uint8)
    out = []
    for g in range(0, len(idx), 8):
        word = 0
        for j in range(8):
            word |= idx[g + j] << (3 * j)
        out += [word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF]
    return np.array(out, dtype=np.uint8)


def unpack(packed: np.ndarray, bits: int, d: int) -> np.ndarray:
    b = [int(x) for x in packed]
    if bits == 4:
        return np.array([(b[i // 2] >> (4 * (i % 2))) & 0xF for i in range(d)])
    out = []
    for g in range(0, len(b), 3):
        word = b[g] | (b[g + 1] << 8) | (b[g + 2] << 16)
        out += [(word >> (3 * j)) & 7 for j in range(8)]
    return np.array(out)


def quantize_row(x: np.ndarray, bits: int, seed: int) -> tuple[np.ndarray, float, float | None]:
    """(packed bytes, norm, rescale or None) of one row."""
    d = x.shape[-1]
    x = x.astype(np.float64)
    norm = float(np.sqrt(np.sum(x * x)))
    u = x / (norm if norm != 0 else 1.0)
    y = rotation(d, seed) @ u
    c = np.array(unit_centroids(bits)) / np.sqrt(d)
    idx = np.argmin(np.abs(y[:, None] - c[None, :]), axis=1)
    rescale = norm / float(np.linalg.norm(c[idx])) if bits == 4 else None
    return pack(idx, bits), norm, rescale


def dequantize_row(packed: np.ndarray, norm: float, bits: int, seed: int, d: int) -> np.ndarray:
    c = np.array(unit_centroids(bits)) / np.sqrt(d)
    y_hat = c[unpack(packed, bits, d)]
    y_hat = y_hat / np.linalg.norm(y_hat) * norm
    return rotation(d, seed).T @ y_hat


def roundtrip(x: np.ndarray, bits: int, seed: int) -> np.ndarray:
    """Quantize and dequantize every row of ``x`` [..., d] (float64)."""
    d = x.shape[-1]
    flat = x.reshape(-1, d)
    out = np.empty(flat.shape)
    for i, row in enumerate(flat):
        packed, norm, _ = quantize_row(row, bits, seed)
        out[i] = dequantize_row(packed, norm, bits, seed, d)
    return out.reshape(x.shape)


# -- vectorized checks for the fuzzer (float64, many rows at once) -----------

#: a rotated coordinate this close to a decision threshold may take either
#: neighbouring centroid (float32 against float64 rounding)
Y_TOL = 1e-5
#: relative agreement of stored norms and rescales (float32 arithmetic)
NORM_RTOL = 1e-5
F32_MAX = float(np.finfo(np.float32).max)
#: relative rounding of each output dtype (half an ulp at 1), and its
#: largest finite value
DTYPE_EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}
DTYPE_MAX = {"float16": 65504.0, "bfloat16": (2 - 2.0**-7) * 2.0**127,
             "float32": F32_MAX}
#: absolute slack for values near the bottom of each dtype's range (a
#: float32 subnormal flushed to zero, a float16 subnormal's spacing)
DTYPE_TINY = {"float16": 2.0**-24, "bfloat16": 2.0**-120, "float32": 2.0**-120}


def unpack_rows(packed: np.ndarray, bits: int, d: int) -> np.ndarray:
    """Indices ``[..., d]`` (int64) of packed rows ``[..., w]`` (uint8), by
    the packing rule: 4 bits two per byte, even coordinate in the low
    nibble; 3 bits eight per three bytes, the little-endian 24-bit word
    ``sum_j idx_j << 3j``."""
    p = np.asarray(packed).astype(np.int64)
    lead = p.shape[:-1]
    if bits == 4:
        return np.stack([p & 0xF, p >> 4], axis=-1).reshape(*lead, d)
    b = p.reshape(*lead, d // 8, 3)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    return ((word[..., None] >> (3 * np.arange(8))) & 7).reshape(*lead, d)


def _centroids(bits: int, d: int) -> np.ndarray:
    return np.array(unit_centroids(bits), dtype=np.float64) / np.sqrt(d)


def reference(x: np.ndarray, bits: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For rows ``x`` ``[..., d]`` (float64): ``(idx, ambiguous, norm)``:
    the nearest-centroid indices ``[..., d]``, where a coordinate lies
    within :data:`Y_TOL` of a threshold (either neighbour is right there),
    and the norm ``[..., 1]`` saturated at float32's maximum."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    # the range decision: a norm beyond float32 saturates, and the row is
    # divided by the saturated norm (so such a row's u is a little longer
    # than 1, as the quantizer's steps 1-2 say)
    norm = np.minimum(np.sqrt(np.sum(x * x, axis=-1, keepdims=True)), F32_MAX)
    u = x / np.where(norm == 0, 1.0, norm)
    y = u @ rotation(d, seed).T
    c = _centroids(bits, d)
    idx = np.argmin(np.abs(y[..., None] - c), axis=-1)
    mids = (c[1:] + c[:-1]) / 2
    ambiguous = np.min(np.abs(y[..., None] - mids), axis=-1) < Y_TOL
    return idx, ambiguous, norm


def _first_bad(bad: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(bad)[0])


def check_stored(x: np.ndarray, packed: np.ndarray, norm: np.ndarray, rescale: np.ndarray | None, bits: int,
                 seed: int) -> str | None:
    """Whether a cache stored rows ``x`` ``[..., d]`` (float64, the rows it
    was handed) as the rule says: ``packed`` (uint8 ``[..., w]``) unpacks to
    the nearest centroids, ``norm`` (``[..., 1]``) is ``||x||`` and, at 4
    bits, ``rescale`` is ``norm / ||y_hat||`` of the stored indices. None
    when it did, else what differs first (index ``[b, h, t, i]``)."""
    d = x.shape[-1]
    idx, ambiguous, want_norm = reference(x, bits, seed)
    width = d // 2 if bits == 4 else 3 * d // 8
    if packed.shape[-1] != width:
        return f"packed width {packed.shape[-1]}, the rule's {width}"
    got = unpack_rows(packed, bits, d)
    bad = (got != idx) & ~(ambiguous & (np.abs(got - idx) == 1))
    if bad.any():
        at = _first_bad(bad)
        return f"centroid index at {list(at)}: stored {int(got[at])}, the reference {int(idx[at])}"
    have = np.asarray(norm, dtype=np.float64)
    bad = ~np.isclose(have, want_norm, rtol=NORM_RTOL, atol=0.0)
    if bad.any():
        at = _first_bad(bad)
        return f"norm at {list(at[:-1])}: stored {float(have[at])!r}, the reference {float(want_norm[at])!r}"
    if bits == 4:
        if rescale is None:
            return "no rescale sidecar at 4 bits"
        y_hat = _centroids(bits, d)[got]
        want = np.minimum(want_norm / np.sqrt(np.sum(y_hat * y_hat, axis=-1, keepdims=True)), F32_MAX)
        have = np.asarray(rescale, dtype=np.float64)
        bad = ~np.isclose(have, want, rtol=NORM_RTOL, atol=0.0)
        if bad.any():
            at = _first_bad(bad)
            return f"rescale at {list(at[:-1])}: stored {float(have[at])!r}, the reference {float(want[at])!r}"
    return None


def dequantized(x: np.ndarray, idx: np.ndarray, bits: int, seed: int, dtype: str) -> np.ndarray:
    """What a reader must see (float64) for rows ``x`` stored as centroid
    indices ``idx``: ``R^T y_hat`` scaled to ``||x||`` (by the saturated
    rescale at 4 bits), clipped to ``dtype``'s finite range."""
    d = x.shape[-1]
    _, _, norm = reference(x, bits, seed)
    y_hat = _centroids(bits, d)[idx]
    length = np.sqrt(np.sum(y_hat * y_hat, axis=-1, keepdims=True))
    unit = y_hat @ rotation(d, seed)
    out = unit * np.minimum(norm / length, F32_MAX) if bits == 4 else (unit / length) * norm
    top = DTYPE_MAX[dtype]
    return np.clip(out, -top, top)


def check_values(x: np.ndarray, idx: np.ndarray, got: np.ndarray, bits: int, seed: int, dtype: str) -> str | None:
    """Whether values ``got`` (float64 ``[..., d]``, read from the cache in
    ``dtype``) are rows ``x`` dequantized from indices ``idx`` within the
    stated tolerance. None when they are, else the first value off."""
    want = dequantized(x, idx, bits, seed, dtype)
    _, _, norm = reference(x, bits, seed)
    tol = (2 * DTYPE_EPS[dtype] + 1e-5) * norm + DTYPE_TINY[dtype]
    bad = ~(np.abs(np.asarray(got, dtype=np.float64) - want) <= tol)
    if bad.any():
        at = _first_bad(bad)
        return f"value at {list(at)}: read {float(got[at])!r}, the reference {float(want[at])!r}"
    return None
