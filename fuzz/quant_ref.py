"""An Int8 oracle in NumPy, written from the rule's text, not from
``kvspec.impl.quant`` (so a rounding bug in the implementation's quantizer cannot
hide behind an oracle that calls it).

The rule (semantics.md 2, "Storage" and "Storage dtype"; the range
decision is :mod:`kvspec.impl.quant`'s docstring), per row of ``head_dim`` values:

1. cast the row to float16 (round to nearest, ties to even);
2. ``scale = absmax / 127`` rounded to float16, and 1 where that is 0;
3. ``q = clip(round(x / scale), -128, 127)`` with ``x / scale`` rounded to
   float16 and ``round`` half to even;
4. read back: the exact product ``q * scale`` rounded once to the dtype the
   rows came in, saturated to +-65504 when that dtype is float16.

Every value here is carried as float64 (exact for every float16, bfloat16
and float32 value, and for every product of step 4), and each rounding
named above is done explicitly, so the oracle owes NumPy's float16
arithmetic nothing but its float64 -> float16 cast (correctly rounded).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

FLOAT16_MAX = 65504.0
#: The dtypes a cache hands back, by kvtrace name.
DTYPES = ("float16", "bfloat16", "float32")


def round_to_float16(x: np.ndarray) -> np.ndarray:
    """float64 -> nearest float16 (ties to even), as float64."""
    return np.asarray(x, dtype=np.float64).astype(np.float16).astype(np.float64)


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float64 -> nearest bfloat16 (ties to even), as float64: round the
    float32 bit pattern at bit 16. Inputs must be exact in float32 (every
    product of step 4 is: 8 by 11 significant bits)."""
    f = np.asarray(x, dtype=np.float64).astype(np.float32)
    bits = f.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 values to ``dtype`` (one of :data:`DTYPES`), as float64."""
    if dtype == "float16":
        return round_to_float16(x)
    if dtype == "bfloat16":
        return round_to_bfloat16(x)
    if dtype == "float32":
        return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Steps 1-3 on ``x`` (``[..., D]``, any real dtype, float16-finite
    once rounded): ``(q, scale)``, int8 ``[..., D]`` and float16 ``[..., 1]``
    (both as NumPy arrays of those dtypes)."""
    x16 = round_to_float16(np.asarray(x, dtype=np.float64))
    absmax = np.max(np.abs(x16), axis=-1, keepdims=True)
    scale = round_to_float16(absmax / 127.0)
    scale = np.where(scale == 0.0, 1.0, scale)
    ratio = round_to_float16(x16 / scale)
    q = np.clip(np.round(ratio), -128, 127)  # np.round: half to even
    return q.astype(np.int8), scale.astype(np.float16)


def dequantize(q: np.ndarray, scale: np.ndarray, dtype: str = "float16") -> np.ndarray:
    """Step 4: ``q * scale`` rounded once to ``dtype`` (saturated for
    float16), returned as float64."""
    exact = q.astype(np.float64) * scale.astype(np.float64)
    if dtype == "float16":
        exact = np.clip(exact, -FLOAT16_MAX, FLOAT16_MAX)
    return round_to(exact, dtype)


def round_trip(x: np.ndarray, dtype: str = "float16") -> np.ndarray:
    """What an Int8 cache hands back for rows ``x`` that came in as
    ``dtype``: float64 values, each exact in ``dtype``."""
    return dequantize(*quantize(x), dtype)


def int8_oracle(x: mx.array) -> mx.array:
    """What an Int8 cache must hand back for the rows ``x`` (an ``mx.array``
    of float16, bfloat16 or float32), in ``x``'s dtype: :func:`round_trip`
    (exact in that dtype)."""
    dtype = str(x.dtype).rsplit(".", 1)[-1]
    wide = np.asarray(x.astype(mx.float32), dtype=np.float64)
    return mx.array(round_trip(wide, dtype).astype(np.float32)).astype(x.dtype)


def int8_oracle_host(x: np.ndarray, dtype: str) -> np.ndarray:
    """:func:`int8_oracle` on the host: rows ``x`` in host form
    (``kvspec.fuzz.rows.rows``: float16, or float32 holding bfloat16 or float32
    values) -> what ``kvspec.fuzz.rows.host`` reads back from ``int8_oracle`` of
    the same rows as an ``mx.array`` of ``dtype``, bit for bit (the values
    are exact in ``dtype``, so no cast rounds them)."""
    out = round_trip(np.asarray(x, dtype=np.float64), dtype)
    return out.astype(np.float16 if dtype == "float16" else np.float32)
