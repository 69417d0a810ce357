"""Per-row quantizers of the quantized cache modes (semantics.md 2,
"Storage"). Quantization is per row, so trims
and appends commute with it: a cache must return exactly what quantizing each
live row on its own and dequantizing gives.

**Decision** (the range of Int8; semantics.md 2 "Storage" says a
quantized mode never turns a finite input into inf or NaN):

* Int8 quantizes the row cast to float16 (the spec's rule). A row that is
  not finite once cast (a bfloat16 or float32 value with ``|x| >= 65520``
  overflows float16; an input inf or NaN) has no finite scale: the cache
  refuses it (InvalidArgumentError naming keys or values, the largest
  magnitude and the rule) instead of storing an infinite scale. See
  :func:`int8_representable`.
* Dequantization is the exact product ``q * scale`` (an int8 times a
  float16 fits a float32 exactly) rounded once to the dtype the rows came in
  (float16, bfloat16 or float32) and, for float16, saturated to +-65504: a
  row whose absmax is 65504 has ``scale = 516`` and ``q = 127``, and
  ``127 * 516 = 65532`` would round to inf in float16. For float16 output
  this is the spec's ``fp16(q) * scale`` byte for byte wherever that is
  finite.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx

from kvspec.impl import fused, write
from kvspec.impl.fused import elementwise

#: Largest finite float16.
FLOAT16_MAX = 65504.0


def quantize_int8(x: mx.array) -> tuple[mx.array, mx.array]:
    """Symmetric per-row int8 quantization, one group per head_dim row.

    ``x``: ``[..., D]`` any float dtype; it is cast to float16 first.
    Returns ``(q, scale)``: ``q`` int8 ``[..., D]``, ``scale`` float16
    ``[..., 1]`` with ``scale = absmax / 127`` (1 where absmax is 0) and
    ``q = clip(round(x / scale), -128, 127)``. Rows that are not finite in
    float16 give a non-finite scale: callers check
    :func:`int8_representable` first.

    A decode step's rows (``x.shape[-2] == 1``) are quantized by one
    compiled function on CUDA (``mx.compile``, traced once per shape; its
    elementwise runs fused around the reduction, the bytes unchanged:
    kvspec.impl.fused).

    Rule: semantics.md 2, "Storage"."""
    if x.ndim >= 2 and x.shape[-2] == 1 and fused.ENABLED and write.backend() == "cuda":
        return _decode_quantizer()(x)
    return _quantize_int8(x)


@cache
def _decode_quantizer() -> Any:
    return mx.compile(_quantize_int8)


def _quantize_int8(x: mx.array) -> tuple[mx.array, mx.array]:
    x16 = x.astype(mx.float16)
    absmax = mx.max(mx.abs(x16), axis=-1, keepdims=True)
    # Python scalars are weakly typed in MLX: the arithmetic stays float16.
    scale = absmax / 127
    scale = mx.where(scale == 0, 1, scale)
    q = mx.clip(mx.round(x16 / scale), -128, 127).astype(mx.int8)
    return q, scale.astype(mx.float16)


def int8_representable(x: mx.array) -> tuple[bool, float]:
    """``(ok, absmax)``: ``ok`` iff every value of ``x`` is finite once cast
    to float16 (so every row's scale is finite); ``absmax`` is the largest
    magnitude of ``x`` in its own dtype (inf or nan when ``x`` holds one).
    Evaluates ``x`` (one host sync)."""
    ok = mx.all(mx.isfinite(x.astype(mx.float16)))
    absmax = mx.max(mx.abs(x.astype(mx.float32)))
    mx.eval(ok, absmax)
    return bool(ok.item()), float(absmax.item())


def int8_rows_representable(keys: mx.array, values: mx.array) -> str | None:
    """The append path's form of :func:`int8_representable`: None when
    every value of ``keys`` and ``values`` is finite once cast to float16,
    else the name of the first that is not (``"keys"`` or ``"values"``).
    One host read of one flag for both (on a GPU each host read is a
    synchronisation, paid per layer per decode step); the magnitudes are
    read only for a refusal's message. Reads only the incoming rows, never
    a cache buffer."""
    return int8_rows_refused(keys, values, int8_rows_flag(keys, values))


def int8_rows_flag(keys: mx.array, values: mx.array) -> mx.array:
    """The lazy flag of :func:`int8_rows_representable` (a bool scalar:
    every value of both finite in float16). The append path schedules it
    (``mx.async_eval``) before it builds the quantized rows, and reads it
    after, so the device computes the flag while the host builds."""
    return mx.all(mx.isfinite(keys.astype(mx.float16))) & mx.all(mx.isfinite(values.astype(mx.float16)))


def int8_rows_refused(keys: mx.array, values: mx.array, flag: mx.array) -> str | None:
    """Read ``flag`` (:func:`int8_rows_flag` of these rows; the one host
    read): None when it is set, else the name of the first of ``keys``,
    ``values`` that is not finite in float16."""
    if bool(flag.item()):
        return None
    return "keys" if not int8_representable(keys)[0] else "values"


def _dequantizer(dtype: mx.Dtype) -> Any:
    """The rule of :func:`dequantize_int8` for one output dtype, as one
    kernel on CUDA (kvspec.impl.fused: every append dequantizes the whole window,
    and op by op the chain is five passes over it, four of them float32)."""

    @elementwise
    def dequantize(q: mx.array, scale: mx.array) -> mx.array:
        exact = q.astype(mx.float32) * scale.astype(mx.float32)  # exact: 8 and 11 significant bits
        if dtype == mx.float16:
            exact = mx.clip(exact, -FLOAT16_MAX, FLOAT16_MAX)
        return exact.astype(dtype)

    return dequantize


_DEQUANTIZERS = {dt: _dequantizer(dt) for dt in (mx.float16, mx.bfloat16, mx.float32)}


def dequantize_int8(q: mx.array, scale: mx.array, dtype: mx.Dtype = mx.float16) -> mx.array:
    """``q * scale`` rounded once to ``dtype`` (saturated to +-65504 for
    float16): ``q`` int8 ``[..., D]``, ``scale`` float16 ``[..., 1]``;
    returns ``dtype`` ``[..., D]`` (float16, bfloat16 or float32). One
    kernel on CUDA (:mod:`kvspec.impl.fused`): every append dequantizes the whole
    window."""
    fn = _DEQUANTIZERS.get(dtype)
    return (fn or _dequantizer(dtype))(q, scale)
