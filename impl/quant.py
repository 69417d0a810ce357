"""Per-row quantizers of the quantized cache modes (semantics.md 2,
"Quantized storage"). Quantization is per row, so trims and appends commute
with it: a cache must return exactly what quantizing each live row on its own
and dequantizing gives.
"""

from __future__ import annotations

import mlx.core as mx


def quantize_int8(x: mx.array) -> tuple[mx.array, mx.array]:
    """Symmetric per-row int8 quantization, one group per head_dim row.

    ``x``: ``[..., D]`` any float dtype; it is cast to float16 first.
    Returns ``(q, scale)``: ``q`` int8 ``[..., D]``, ``scale`` float16
    ``[..., 1]`` with ``scale = absmax / 127`` (1 where absmax is 0) and
    ``q = clip(round(x / scale), -128, 127)``.
    """
    x16 = x.astype(mx.float16)
    absmax = mx.max(mx.abs(x16), axis=-1, keepdims=True)
    # Python scalars are weakly typed in MLX: the arithmetic stays float16.
    scale = absmax / 127
    scale = mx.where(scale == 0, 1, scale)
    q = mx.clip(mx.round(x16 / scale), -128, 127).astype(mx.int8)
    return q, scale.astype(mx.float16)


def dequantize_int8(q: mx.array, scale: mx.array) -> mx.array:
    """``float16(q) * scale``: ``q`` int8 ``[..., D]``, ``scale`` float16
    ``[..., 1]``; returns float16 ``[..., D]``."""
    return q.astype(mx.float16) * scale
