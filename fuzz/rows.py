"""Deterministic row contents for token identities.

kvtrace says a row's K and V are a function of its identity and the trace's
configuration, so any machine replays the same bytes and a stale row can be
told from a new one. Rows are ``[B, H, 1, D]`` (K and V may have different
head dims); every seventh token has an all-zero K row and every eleventh an
all-zero V row (the Int8 ``scale == 0`` rule), never both, so every token's
(K, V) pair stays unique; the others are normal draws scaled by a per-token
magnitude so the quantizers see a spread.

The identity-to-bytes mapping per dtype (kvtrace ``dtype``):

* ``float16``: the draw rounded to float16 (the bytes every float16 trace
  has always had);
* ``bfloat16``: the same draw rounded to bfloat16 (to nearest, ties to
  even), carried in NumPy as the float32 of that value (NumPy has no
  bfloat16; :func:`to_mx` makes it a bfloat16 ``mx.array`` exactly);
* ``float32``: the draw rounded to float32.

With ``wide`` (unquantized storage, any dtype but float16) every fifth
nonzero row is scaled by 2**16, beyond float16's finite range: a cache that
detours through float16 turns those rows into inf. Quantized modes never
get wide rows (their range decision refuses them, and the spec's rows are
identities, not values). Int8 gets ``wide="edge"`` rows instead: every
fifth nonzero row scaled to float16's edge, its largest value exactly
65504 (the largest finite float16; bfloat16's largest below it, 65280, for
bfloat16 rows) every other time, and just below it (0.99 to 1 of it)
otherwise; float32 rows every fourth time reach into the band above 65504
that still rounds to a finite float16 (:data:`BAND`, up to 65519.996, just
below the 65520 that turns inf): all representable by the quantizer's rule
(finite once cast to float16, so never refused: a cheaper ``<= 65504``
test refuses the band), and at 65504 the dequantized product ``127 * 516`` is past
float16's range, so the read-back's saturation is exercised.

Three row schemes (kvtrace ``cache.rows``):

* ``numpy`` (the default: every trace written before the field existed):
  the seeded NumPy draws above;
* ``portable``: the closed-form function of :mod:`kvspec.spec.rows` (integer
  arithmetic assembled into bit patterns, reproducible in any language:
  docs/kvtrace.md "Portable rows"), computed here by a vectorized NumPy
  copy of it (:func:`portable_bits`; tests/test_rows.py checks the two
  agree). No portable row is all zero;
* ``ranged``: seeded NumPy draws across the dtype's whole magnitude range
  (:func:`ranged_row`), for the quantizers' range rules: by token, tiny rows
  (float16 subnormals, bfloat16/float32 near the smallest normal), huge
  rows (up to the dtype's largest finite value), rows with negative zeros
  (one in thirteen all ``-0.0``), rows mixing every scale of the range in
  one row, and ordinary draws; the NumPy scheme's all-zero K and V rows too.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.fuzz.device import current as device_current
from kvspec.fuzz.device import device_read
from kvspec.spec import rows as portable

DTYPES = ("float16", "bfloat16", "float32")
#: kvtrace ``cache.rows``: which function gives a row its contents
SCHEMES = ("numpy", "portable", "ranged")
#: exponent ranges (powers of two) of each dtype's finite values: float16's
#: smallest subnormal to its largest binade; bfloat16 and float32 from the
#: smallest normal (MLX may flush float32 subnormals to zero)
EXPONENTS = {"float16": (-24, 15), "bfloat16": (-126, 127), "float32": (-126, 127)}
LARGEST = {"float16": 65504.0, "bfloat16": (2 - 2.0**-7) * 2.0**127, "float32": float(np.finfo(np.float32).max)}
#: the largest value of each dtype that is finite once rounded to float16
#: (``wide="edge"`` rows, Int8's range rule)
EDGE = {"float16": 65504.0, "bfloat16": 65280.0, "float32": 65504.0}
#: the band above :data:`EDGE` whose values still round to a finite float16
#: (to 65504: float16 rounds to nearest, and 65520 is the midpoint to the
#: next binade, so it and everything above turn inf): (low, high), both
#: exact in the dtype and inside the open band (65504, 65520); float32 only
#: (bfloat16 has no value there: 65280, then 65536)
BAND = {"float32": (float(np.nextafter(np.float32(65504.0), np.float32(np.inf))),
                    float(np.nextafter(np.float32(65520.0), np.float32(0.0))))}
_HOST_BITS = {"float16": (np.uint16, np.float16), "float32": (np.uint32, np.float32)}


def _mix32(x: np.ndarray) -> np.ndarray:
    """kvspec.spec.rows.mix32 on uint32 arrays (NumPy's uint32 products wrap mod
    2^32, as C's do)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def portable_bits(tokens, kv: int, batch: int, kv_heads: int, head_dim: int, dtype: str = "float16",
                  wide: bool = False) -> np.ndarray:
    """kvspec.spec.rows.element_bits for every element of ``[batch, kv_heads,
    len(tokens), head_dim]`` (uint16 for float16 and bfloat16, uint32 for
    float32), vectorized. Raises ValueError for an identity outside
    ``[0, kvspec.spec.rows.TOKEN_LIMIT)`` or an unknown dtype."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    t = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens), dtype=np.int64)
    if t.size and (int(t.max()) >= portable.TOKEN_LIMIT or int(t.min()) < 0):
        raise ValueError(f"token identity must lie in [0, {portable.TOKEN_LIMIT}), got {int(t.max())}")
    u32 = np.uint32
    t = t.astype(u32).reshape(1, 1, -1, 1)
    b = np.arange(batch, dtype=u32).reshape(-1, 1, 1, 1)
    h = np.arange(kv_heads, dtype=u32).reshape(1, -1, 1, 1)
    c = np.arange(head_dim, dtype=u32).reshape(1, 1, 1, -1)
    salt = _mix32(((u32(kv) * u32(64) + b) * u32(64) + h) * u32(1024) + c)  # mix32(place)
    z = (t * u32(portable.MULTIPLIER)) & u32(0xFFFFFF)
    z ^= z >> u32(12)
    shift = u32(12) * ((u32(kv) + b + h + c) & u32(1))
    u = ((z >> shift) & u32(0xFFF)) ^ (salt & u32(0xFFF))
    x = _mix32(salt ^ t) >> u32(16)
    sign, e, m = u >> u32(11), (u >> u32(7)) & u32(15), u & u32(127)
    if dtype == "float16":
        return ((sign << u32(15)) | ((u32(7) + e) << u32(10)) | (m << u32(3)) | (x >> u32(13))).astype(np.uint16)
    exp = u32(119) + e + np.where(wide & (t % u32(5) == u32(2)), u32(24), u32(0)).astype(u32)
    if dtype == "bfloat16":
        return ((sign << u32(15)) | (exp << u32(7)) | m).astype(np.uint16)
    return (sign << u32(31)) | (exp << u32(23)) | (m << u32(16)) | x


def _portable_host(tokens, which: str, batch: int, kv_heads: int, head_dim: int, dtype: str,
                   wide: bool) -> np.ndarray:
    """Portable rows in host form (float16, or float32 for bfloat16 and float32)."""
    bits = portable_bits(tokens, 0 if which == "k" else 1, batch, kv_heads, head_dim, dtype, wide)
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return bits.view(_HOST_BITS[dtype][1])


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 values -> the nearest bfloat16 values (ties to even), as float32."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def _rng(seed: list[int]) -> np.random.Generator:
    """``np.random.default_rng(seed)``, which NumPy defines as
    ``Generator(PCG64(seed))`` (the same stream, bit for bit), built in half
    its time (18 us against 38 us here: a campaign draws a row for every new
    token of every example's shape)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed)))


@lru_cache(maxsize=65536)
def row(token: int, which: str, batch: int, kv_heads: int, head_dim: int, dtype: str = "float16",
        wide: bool | str = False, scheme: str = "numpy") -> np.ndarray:
    """``[batch, kv_heads, 1, head_dim]`` for ``which`` in {"k", "v"}: a
    float16 array for ``dtype="float16"``, else float32 holding values exact
    in ``dtype``. ``scheme`` is the trace's ``rows`` (:data:`SCHEMES`);
    ``wide``: False, True (beyond float16's range) or ``"edge"`` (up to
    float16's largest value; numpy scheme only)."""
    shape = (batch, kv_heads, 1, head_dim)
    host = np.float16 if dtype == "float16" else np.float32
    if scheme == "portable":
        out = _portable_host([token], which, batch, kv_heads, head_dim, dtype, wide is True)
        out.setflags(write=False)
        return out
    if scheme not in ("numpy", "ranged"):
        raise ValueError(f"rows must be one of {SCHEMES}, got {scheme!r}")
    if (which == "k" and token % 7 == 3) or (which == "v" and token % 11 == 5 and token % 7 != 3):
        return np.zeros(shape, dtype=host)
    if scheme == "ranged":
        out = _cast(ranged_row(token, which, shape, dtype), dtype)
        out.setflags(write=False)
        return out
    rng = _rng([token, 0 if which == "k" else 1, batch, kv_heads, head_dim])
    magnitude = float(2.0 ** rng.integers(-6, 6))
    if wide == "edge" and token % 5 == 2:
        draw = rng.standard_normal(shape)
        if token % 10 == 2:
            edge = EDGE[dtype]
        elif token % 20 == 7 and dtype in BAND:  # above 65504, finite once in float16: accepted
            low, high = BAND[dtype]
            edge = float(np.clip(np.float32(rng.uniform(low, high)), low, high))
        else:
            edge = EDGE[dtype] * float(rng.uniform(0.99, 1.0))
        out = _cast(draw / (np.max(np.abs(draw)) or 1.0) * edge, dtype)
        out.setflags(write=False)
        return out
    if wide is True and dtype != "float16" and token % 5 == 2:
        magnitude *= 2.0**16
    out = _cast(rng.standard_normal(shape) * magnitude, dtype)
    out.setflags(write=False)
    return out


def _cast(draw: np.ndarray, dtype: str) -> np.ndarray:
    """float64 draws -> host form of ``dtype`` (float16, or float32 values
    exact in bfloat16/float32)."""
    if dtype == "float16":
        return draw.astype(np.float16)
    if dtype == "bfloat16":
        return round_to_bfloat16(draw.astype(np.float32))
    if dtype == "float32":
        return draw.astype(np.float32)
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def ranged_row(token: int, which: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """The ``ranged`` scheme's draw (float64, finite in ``dtype``), by
    ``token % 6``: 0 tiny (a binade among the lowest four of
    :data:`EXPONENTS`), 1 huge (the row's largest value within a factor 2 of
    the dtype's largest finite value), 2 negative zeros among ordinary
    values (every coordinate ``-0.0`` when ``token % 13 == 2``), 3 every
    coordinate at its own scale across the whole range, else ordinary."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    rng = _rng([token, 0 if which == "k" else 1, *shape, DTYPES.index(dtype), 7])
    lo, hi = EXPONENTS[dtype]
    draw = rng.standard_normal(shape)
    kind = token % 6
    if kind == 0:
        return draw * 2.0 ** int(rng.integers(lo, lo + 4))
    if kind == 1:
        peak = np.max(np.abs(draw)) or 1.0
        return np.clip(draw / peak * LARGEST[dtype] * float(rng.uniform(0.5, 1.0)), -LARGEST[dtype], LARGEST[dtype])
    if kind == 2:
        if token % 13 == 2:
            return np.full(shape, -0.0)
        return np.where(rng.random(shape) < 0.5, -0.0, draw)
    if kind == 3:
        return np.clip(draw * 2.0 ** rng.integers(lo, hi, size=shape).astype(np.float64),
                       -LARGEST[dtype], LARGEST[dtype])
    return draw * 2.0 ** int(rng.integers(-6, 6))


def rows(tokens, which: str, batch: int, kv_heads: int, head_dim: int, dtype: str = "float16",
         wide: bool | str = False, scheme: str = "numpy") -> np.ndarray:
    """``[batch, kv_heads, len(tokens), head_dim]`` in token order (host
    form: see :func:`row`)."""
    tokens = list(tokens)
    if not tokens:
        return np.zeros((batch, kv_heads, 0, head_dim), dtype=np.float16 if dtype == "float16" else np.float32)
    if scheme == "portable":
        return _portable_host(tokens, which, batch, kv_heads, head_dim, dtype, wide is True)
    return np.concatenate([row(t, which, batch, kv_heads, head_dim, dtype, wide, scheme) for t in tokens], axis=2)


def to_mx(x: np.ndarray, dtype: str) -> mx.array:
    """Rows in host form as an ``mx.array`` of ``dtype`` (exact)."""
    return mx.array(x).astype(getattr(mx, dtype))


def read_form(a: mx.array) -> mx.array:
    """The array :func:`host` converts for ``a`` (lazy): ``a`` read as a
    decoder reads it on this device, bfloat16 widened to float32 (exact)."""
    a = device_read(a)  # on a GPU, read as a decoder reads it (kvspec.fuzz.device)
    return a.astype(mx.float32) if a.dtype == mx.bfloat16 else a


def read_forms(arrays: list[mx.array]) -> list[mx.array]:
    """:func:`read_form` of each of ``arrays`` (MLX arrays), the device
    asked once for them all."""
    if device_current() == "gpu":
        return [read_form(a) for a in arrays]
    return [a.astype(mx.float32) if a.dtype == mx.bfloat16 else a for a in arrays]


def host(a) -> np.ndarray:
    """A fetched array as NumPy, bit for bit: float16 and float32 as they
    are, bfloat16 as the float32 of each value (exact and one-to-one);
    anything else (a target's view object) through ``np.asarray``."""
    if isinstance(a, mx.array):
        return np.asarray(read_form(a))
    return np.asarray(a)


def host_many(arrays: list[Any]) -> list[np.ndarray]:
    """:func:`host` of each of ``arrays``, the MLX arrays among them
    evaluated in one ``mx.eval`` (one round trip to MLX's scheduler, not
    one per array: on the CPU that round trip, not the copy, is what a
    read costs)."""
    forms = [read_form(a) if isinstance(a, mx.array) else a for a in arrays]
    lazy = [f for f in forms if isinstance(f, mx.array)]
    if lazy:
        mx.eval(*lazy)
    return [np.asarray(f) for f in forms]


def mx_arrays(x: Any, out: list[mx.array] | None = None) -> list[mx.array]:
    """Every ``mx.array`` inside ``x`` (nested tuples, lists, dict values),
    appended to ``out`` when given (and returned)."""
    if out is None:
        out = []
    if isinstance(x, mx.array):
        out.append(x)
    elif isinstance(x, (tuple, list)):
        for item in x:
            mx_arrays(item, out)
    elif isinstance(x, dict):
        for item in x.values():
            mx_arrays(item, out)
    return out


_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(a) -> str:
    """The kvtrace dtype name of a fetched array (a view object's
    ``kvtrace_dtype`` where it has one, e.g. bfloat16 rows NumPy cannot
    hold; else NumPy's name for ``numpy.asarray`` of it)."""
    named = getattr(a, "kvtrace_dtype", None)
    if isinstance(named, str):
        return named
    if isinstance(a, mx.array):
        d = a.dtype
        name = _DTYPE_NAMES.get(d)
        if name is None:
            name = _DTYPE_NAMES[d] = str(d).rsplit(".", 1)[-1]
        return name
    return str(np.asarray(a).dtype)
