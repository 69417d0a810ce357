"""The Turbo (PolarQuant-style) per-row quantizer in MLX (semantics.md 2,
"Turbo modes").

Per row ``x`` of ``head_dim = d`` coordinates:

1. ``norm = ||x||_2`` in float32 (rows are first widened to float32, exact
   for float16, bfloat16 and float32 input; the sum of squares is taken on
   ``x / max|x|`` so a large bfloat16 row cannot overflow it);
2. ``u = x / norm`` (the divisor is 1 where the norm is 0);
3. ``y = D2 . H . D1 . u``: ``H`` the orthonormal Walsh-Hadamard transform
   (``mx.hadamard_transform``, Sylvester order), ``D1``, ``D2`` diagonal
   +-1 sign vectors from a seeded LCG (:func:`sign_vectors`);
4. each ``y_i`` is replaced by the index of its nearest centroid of the
   Lloyd-Max codebook for N(0, 1/d) (16 levels at 4 bits, 8 at 3 bits;
   :mod:`kvspec.impl.codebooks`);
5. the indices are packed: 4 bits two per byte, even coordinate in the low
   nibble; 3 bits eight per three bytes, as the little-endian bytes of the
   24-bit word ``sum_j idx_j << 3j``;
6. sidecars: ``norm`` (float32 ``[..., 1]``) and, at 4 bits,
   ``rescale = norm / ||y_hat||`` (float32 ``[..., 1]``), ``y_hat`` the
   vector of chosen centroids.

Dequantize: unpack, gather centroids (``y_hat``), renormalize and scale
(``y_hat * rescale`` at 4 bits, ``y_hat * norm / ||y_hat||`` at 3 bits),
inverse rotation ``D1 . H . D2`` (applied to the bounded ``y_hat`` before
the scale), clip to the output dtype's finite range, cast to the dtype of
the rows that were quantized.

**Decision** (zero rows): the 1 replaces a zero norm only as the divisor;
the stored norm stays 0, so a zero row dequantizes to exactly zero instead
of to a random unit vector. **Decision** (range): the reconstruction is
clipped to the output dtype's finite range, so a finite input never comes
back as inf or NaN; a norm beyond float32 (only bfloat16/float32 rows near
3e38) saturates at float32's maximum.

Shape rules (checked before anything is computed, InvalidArgumentError
naming the argument): ``head_dim`` a power of two, at least 2 at 4 bits
(nibble pairs) and a multiple of 8 at 3 bits (whole 24-bit words: packing
``3 * d / 8`` bytes for another ``d`` silently truncates, a known bug class).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from typing import Any

import mlx.core as mx

from kvspec.impl import fused, write
from kvspec.impl.codebooks import unit_centroids
from kvspec.impl.fused import elementwise
from kvspec.spec.errors import InvalidArgumentError

#: Largest head dim the quantizer takes (the Walsh-Hadamard rotation's
#: length); the spec states the same bound (``kvspec.spec.turbo.MAX_HEAD_DIM``).
MAX_HEAD_DIM = 8192

# Seeds of the sign vectors. Turbo4 rotates K with its own pair (K_SEED);
# every quantized V uses V_SEED.
V_SEED = 0x5EED_0001
K_SEED = 0x5EED_0002
# Knuth's MMIX LCG: state <- a * state + c (mod 2**64); a sign is the top bit.
LCG_A = 6364136223846793005
LCG_C = 1442695040888963407
LCG_MASK = (1 << 64) - 1


def lcg_signs(count: int, seed: int) -> tuple[int, ...]:
    """``count`` values in {+1, -1} from the LCG started at ``seed``: each
    step advances the state and takes +1 when bit 63 is 0."""
    state = seed & LCG_MASK
    out = []
    for _ in range(count):
        state = (LCG_A * state + LCG_C) & LCG_MASK
        out.append(-1 if state >> 63 else 1)
    return tuple(out)


def sign_vectors(head_dim: int, seed: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(D1, D2)`` for ``head_dim``: the first and the next ``head_dim``
    draws of one LCG stream."""
    s = lcg_signs(2 * head_dim, seed)
    return s[:head_dim], s[head_dim:]


def check_head_dim(name: str, head_dim: int, bits: int) -> None:
    """Shape rules of the quantizer (kvspec.spec.turbo.check_head_dim): raises
    InvalidArgumentError naming ``name`` (the argument, e.g. ``values``)
    when ``head_dim`` is not a power of two in ``[2, 8192]``, or, at 3 bits,
    not a multiple of 8."""
    if bits not in (3, 4):
        raise InvalidArgumentError(f"turbo: bits must be 3 or 4, got {bits}")
    # impl's own statement of the rule (a power of two: one bit set)
    if not 2 <= head_dim <= MAX_HEAD_DIM or head_dim.bit_count() != 1:
        raise InvalidArgumentError(
            f"{name}: head_dim must be a power of two in [2, {MAX_HEAD_DIM}] for the Walsh-Hadamard "
            f"rotation, got {head_dim}"
        )
    if bits == 3 and head_dim % 8 != 0:
        raise InvalidArgumentError(
            f"{name}: head_dim must be a multiple of 8 for 3-bit packing (8 indices per 3 bytes), got {head_dim}"
        )


def packed_width(head_dim: int, bits: int) -> int:
    """Bytes per packed row: ``d / 2`` at 4 bits, ``3 * d / 8`` at 3 bits.
    Raises InvalidArgumentError when that is not exact."""
    if bits == 4:
        if head_dim % 2:
            raise InvalidArgumentError(f"pack: head_dim must be even for 4-bit packing, got {head_dim}")
        return head_dim // 2
    if bits == 3:
        if head_dim % 8:
            raise InvalidArgumentError(
                f"pack: head_dim must be a multiple of 8 for 3-bit packing, got {head_dim}"
            )
        return 3 * head_dim // 8
    raise InvalidArgumentError(f"pack: bits must be 3 or 4, got {bits}")


def pack_indices(idx: mx.array, bits: int) -> mx.array:
    """Pack centroid indices ``[..., d]`` (integers in ``[0, 2**bits)``) into
    uint8 ``[..., packed_width(d, bits)]``. Raises InvalidArgumentError when
    ``d`` does not pack exactly."""
    d = int(idx.shape[-1])
    packed_width(d, bits)
    lead = tuple(idx.shape[:-1])
    if bits == 4:
        q = idx.astype(mx.uint8).reshape(*lead, d // 2, 2)
        return q[..., 0] | mx.left_shift(q[..., 1], 4)
    q = idx.astype(mx.uint32).reshape(*lead, d // 8, 8)
    shifts = mx.array([3 * j for j in range(8)], dtype=mx.uint32)
    word = mx.sum(mx.left_shift(q, shifts), axis=-1).astype(mx.uint32)
    parts = [(mx.right_shift(word, 8 * b) & 0xFF).astype(mx.uint8) for b in range(3)]
    return mx.stack(parts, axis=-1).reshape(*lead, 3 * d // 8)


def unpack_indices(packed: mx.array, bits: int, head_dim: int) -> mx.array:
    """Inverse of :func:`pack_indices`: uint8 ``[..., w]`` -> uint32 indices
    ``[..., head_dim]``. Raises InvalidArgumentError when ``w`` is not
    ``packed_width(head_dim, bits)``."""
    w = packed_width(head_dim, bits)
    if int(packed.shape[-1]) != w:
        raise InvalidArgumentError(f"unpack: packed width must be {w} for head_dim {head_dim}, got {packed.shape[-1]}")
    lead = tuple(packed.shape[:-1])
    p = packed.astype(mx.uint32)
    if bits == 4:
        return mx.stack([p & 0xF, mx.right_shift(p, 4)], axis=-1).reshape(*lead, head_dim)
    b = p.reshape(*lead, head_dim // 8, 3)
    word = b[..., 0] | mx.left_shift(b[..., 1], 8) | mx.left_shift(b[..., 2], 16)
    shifts = mx.array([3 * j for j in range(8)], dtype=mx.uint32)
    return (mx.right_shift(word[..., None], shifts) & 7).reshape(*lead, head_dim)


@cache
def _constants(head_dim: int, bits: int, seed: int) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(D1, D2, centroids, decision thresholds) as float32 MLX arrays."""
    d1, d2 = sign_vectors(head_dim, seed)
    c = [x / math.sqrt(head_dim) for x in unit_centroids(bits)]
    mids = [(a + b) / 2 for a, b in pairwise(c)]
    f32 = mx.float32
    return mx.array(d1, dtype=f32), mx.array(d2, dtype=f32), mx.array(c, dtype=f32), mx.array(mids, dtype=f32)


def rotate(u: mx.array, seed: int) -> mx.array:
    """``D2 . H . D1 . u`` along the last axis (float32)."""
    d1, d2, _, _ = _constants(int(u.shape[-1]), 4, seed)
    return d2 * mx.hadamard_transform(d1 * u)


def inverse_rotate(y: mx.array, seed: int) -> mx.array:
    """``D1 . H . D2 . y``: the inverse of :func:`rotate` (H is symmetric
    and orthonormal, each D its own inverse)."""
    d1, d2, _, _ = _constants(int(y.shape[-1]), 4, seed)
    return d1 * mx.hadamard_transform(d2 * y)


@dataclass(frozen=True)
class Quantized:
    """Quantized rows ``[B, H, T, ...]``: ``packed`` uint8 ``[..., w]``,
    ``norm`` float32 ``[..., 1]``, ``rescale`` float32 ``[..., 1]`` (4-bit
    only, else None)."""

    packed: mx.array
    norm: mx.array
    rescale: mx.array | None

    def arrays(self) -> tuple[mx.array, ...]:
        """The stored arrays in order: packed indices (uint8), norms (float32) and, at 4 bits,
        rescales (float32). Rule: ``kvspec.spec.turbo.array_names`` (semantics.md 2,
        "Turbo row storage")."""
        return tuple(a for a in (self.packed, self.norm, self.rescale) if a is not None)


def quantize(x: mx.array, bits: int, seed: int, name: str = "values", pack: Any = pack_indices,
             check: bool = True) -> Quantized:
    """Quantize rows ``x`` ``[..., d]`` (any float dtype). Raises
    InvalidArgumentError (naming ``name``) for a head_dim that breaks
    :func:`check_head_dim` (``check=False``: the caller checked). ``pack``
    packs the indices (:func:`pack_indices`).

    A decode step's rows (one row per head: ``x.shape[-2] == 1``) with the
    standard packer are quantized by one compiled function on CUDA
    (:func:`_decode_quantizer`), the same bytes in about a third of the
    kernels and one Python call instead of some seventy op calls."""
    d = int(x.shape[-1])
    if check:
        check_head_dim(name, d, bits)
    if pack is pack_indices and x.ndim >= 2 and x.shape[-2] == 1 and fused.ENABLED and write.backend() == "cuda":
        arrays = _decode_quantizer(bits, seed)(x)
        return Quantized(arrays[0], arrays[1], arrays[2] if bits == 4 else None)
    return _quantize(x, bits, seed, pack)


@cache
def _decode_quantizer(bits: int, seed: int) -> Any:
    """:func:`_quantize` compiled (``mx.compile``, traced once per input
    shape: a decoder's rows have one shape). MLX fuses its elementwise runs
    between the reductions, the Hadamard transform and the gathers, which
    stay as they are, so the bytes are the op-by-op ones (kvspec.impl.fused's
    argument: no addition of a product is fused; MLX 0.32 fuses nothing into
    a reduction)."""
    return mx.compile(lambda x: _quantize(x, bits, seed, pack_indices).arrays())


def _quantize(x: mx.array, bits: int, seed: int, pack: Any) -> Quantized:
    d = int(x.shape[-1])
    _, _, centroids, mids = _constants(d, bits, seed)
    xf = x.astype(mx.float32)
    peak = mx.max(mx.abs(xf), axis=-1, keepdims=True)
    peak = mx.where(peak == 0, 1, peak)
    scaled = xf / peak
    # saturate a norm beyond float32 (bfloat16/float32 rows near their max)
    f32_max = float(mx.finfo(mx.float32).max)
    norm = mx.minimum(peak * mx.sqrt(mx.sum(scaled * scaled, axis=-1, keepdims=True)), f32_max)
    divisor = mx.where(norm == 0, 1, norm)
    y = rotate(xf / divisor, seed)
    # nearest centroid: the number of decision thresholds below y
    idx = mx.sum(y[..., None] > mids, axis=-1).astype(mx.uint32)
    rescale = None
    if bits == 4:
        y_hat = mx.take(centroids, idx)
        rescale = mx.minimum(norm / mx.sqrt(mx.sum(y_hat * y_hat, axis=-1, keepdims=True)), f32_max)
    return Quantized(pack(idx, bits), norm, rescale)


@cache
def _pair_table(head_dim: int, seed: int) -> tuple[mx.array, mx.array]:
    """The 4-bit dequantizer's lookup: ``(table, offsets)``, ``table``
    float32 ``[w * 256, 2]`` with row ``256 * j + b`` the pair of
    coordinates ``2j, 2j + 1`` that packed byte ``b`` at byte ``j`` decodes
    to, already multiplied by their signs of ``D2``: ``(D2[2j] * c[b & 15],
    D2[2j + 1] * c[b >> 4])`` (a sign flip is exact, so this is bit for bit
    what unpacking, gathering centroids and multiplying by ``D2`` gives);
    ``offsets`` uint32 ``[w]``, ``256 * j``."""
    _, d2, centroids, _ = _constants(head_dim, 4, seed)
    byte = mx.arange(256, dtype=mx.uint32)
    low, high = mx.take(centroids, byte & 0xF), mx.take(centroids, mx.right_shift(byte, 4))
    w = head_dim // 2
    pairs = mx.stack([d2[0::2, None] * low[None, :], d2[1::2, None] * high[None, :]], axis=-1)  # [w, 256, 2]
    table = pairs.reshape(w * 256, 2)
    offsets = mx.arange(w, dtype=mx.uint32) * 256
    mx.eval(table, offsets)
    return table, offsets


@elementwise
def _pair_index(packed: mx.array, offsets: mx.array) -> mx.array:
    return packed.astype(mx.uint32) + offsets


@cache
def _scaled(dtype: mx.Dtype) -> Any:
    """``clip((h * D1) * rescale)`` in ``dtype``: the 4-bit dequantizer
    after its Hadamard transform, one kernel on CUDA (kvspec.impl.fused). Casting
    before clipping to ``dtype``'s finite range equals clipping before
    casting (the cast is monotone and keeps the bound), in half the bytes."""
    top = float(mx.finfo(dtype).max)

    @elementwise
    def scaled(h: mx.array, d1: mx.array, rescale: mx.array) -> mx.array:
        return mx.clip(((h * d1) * rescale).astype(dtype), -top, top)

    return scaled


def _dequantize4(q: Quantized, seed: int, head_dim: int, dtype: mx.Dtype) -> mx.array:
    """:func:`dequantize` at 4 bits with the standard packer, bit for bit,
    in three kernels on CUDA instead of a dozen (every append dequantizes
    the whole window, so each pass is a pass over every live row): the
    byte-pair lookup of :func:`_pair_table` (unpack, centroids and ``D2`` in
    one gather), the Hadamard transform, then :func:`_scaled`."""
    w = packed_width(head_dim, 4)
    if int(q.packed.shape[-1]) != w:
        raise InvalidArgumentError(f"unpack: packed width must be {w} for head_dim {head_dim}, got {q.packed.shape[-1]}")
    table, offsets = _pair_table(head_dim, seed)
    y = mx.take(table, _pair_index(q.packed, offsets), axis=0)  # [..., w, 2]: D2 . y_hat, pairwise
    h = mx.hadamard_transform(y.reshape(*q.packed.shape[:-1], head_dim))
    d1 = _constants(head_dim, 4, seed)[0]
    return _scaled(dtype)(h, d1, q.rescale)


def dequantize(q: Quantized, bits: int, seed: int, head_dim: int, dtype: mx.Dtype,
               unpack: Any = unpack_indices) -> mx.array:
    """Rows ``[..., head_dim]`` of ``dtype`` from quantized rows; finite
    (clipped to ``dtype``'s range). ``unpack`` inverts the packer
    (:func:`unpack_indices`; with it, 4-bit rows take the fused path of
    :func:`_dequantize4`, which gives the same bytes)."""
    if bits == 4 and unpack is unpack_indices and q.rescale is not None:
        return _dequantize4(q, seed, head_dim, dtype)
    _, _, centroids, _ = _constants(head_dim, bits, seed)
    y_hat = mx.take(centroids, unpack(q.packed, bits, head_dim))
    # Rotate the bounded centroid vector first and scale last: a finite
    # scale times finite coordinates can overflow to +-inf (clipped below)
    # but never produce NaN (no inf - inf inside the transform).
    unit = inverse_rotate(y_hat, seed)
    if q.rescale is not None:
        x = unit * q.rescale
    else:
        x = (unit / mx.sqrt(mx.sum(y_hat * y_hat, axis=-1, keepdims=True))) * q.norm
    top = float(mx.finfo(dtype).max)
    return mx.clip(x, -top, top).astype(dtype)


def roundtrip(x: mx.array, bits: int, seed: int) -> mx.array:
    """``dequantize(quantize(x))`` in ``x``'s dtype: what a quantized cache
    returns for rows ``x`` (the per-row oracle of the differential harness)."""
    return dequantize(quantize(x, bits, seed), bits, seed, int(x.shape[-1]), x.dtype)


__all__ = [
    "K_SEED", "V_SEED", "Quantized", "check_head_dim", "dequantize", "inverse_rotate", "lcg_signs",
    "pack_indices", "packed_width", "quantize", "rotate", "roundtrip", "sign_vectors", "unpack_indices",
]
