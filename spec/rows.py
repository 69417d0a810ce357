"""Portable row contents: the K and V values of a token identity, in closed form.

A kvtrace names rows by token identity (docs/kvtrace.md "Token
identities"); with ``"rows": "portable"`` in its cache object the bytes of
every row come from the function below, which any language reproduces bit
for bit with 32-bit unsigned integer arithmetic: no random generator, no
floating-point operation, only bit patterns assembled from integers. The
value of one element is a function of

* ``t``: the token identity, ``0 <= t < TOKEN_LIMIT`` (2^24),
* ``kv``: 0 for the K row, 1 for the V row,
* ``b``, ``h``, ``c``: the batch index (< 64), the kv head (< 64) and the
  column along the head dim (< 1024), the kvtrace schema's bounds,
* the dtype (``float16``, ``bfloat16``, ``float32``) and the trace's
  ``wide`` flag,

and of nothing else (not of the shape: a row of a larger cache holds the
same values at the same coordinates).

How it is built (docs/kvtrace.md "Portable rows" has the same in prose):

1. ``z = scramble(t)``: ``(t * 0x9E3779B1) mod 2^24``, then ``z ^= z >> 12``;
   both steps are bijections of ``[0, 2^24)`` (an odd multiplier; a
   self-inverse xorshift), so ``z`` has the two 12-bit digits ``z & 0xFFF``
   and ``z >> 12``.
2. The element carries digit ``(kv + b + h + c) & 1`` of ``z``, XORed with a
   salt of its coordinates, ``mix32(place) & 0xFFF`` (``mix32`` is
   MurmurHash3's 32-bit finalizer): a 12-bit **code** ``u``. XOR with a
   constant is a bijection, so each element's code determines one digit.
3. The code becomes a sign bit (bit 11), a 4-bit exponent ``e`` (bits 7-10)
   and 7 mantissa bits (bits 0-6): the value ``+-(1 + m/128 + x) * 2^(e - 8)``,
   in ``[2^-8, 2^8)``, where ``x`` is a dtype's extra precision taken from
   ``mix32(mix32(place) ^ t)``: 3 more mantissa bits in float16, 16 in
   float32, none in bfloat16 (which has 7). Every value is a normal finite
   number of its dtype (no subnormal, no zero: an all-zero row in a report
   is always a slot nobody wrote), and a cache that stores float16 or
   float32 rows through bfloat16 (or float32 rows through float16) loses
   the extra bits and shows.
4. ``wide`` (the harness sets it for unquantized storage of bfloat16 and
   float32 rows): rows of tokens with ``t % 5 == 2`` get 24 more on the
   exponent, ``[2^16, 2^32)``, beyond float16's finite range, so a cache
   that detours through float16 turns them into inf.

Distinctness (the bound, proved exhaustively by tests/test_rows.py): for
``t1 != t2`` below ``TOKEN_LIMIT``, the element pair ``K[0, 0, 0]``,
``V[0, 0, 0]`` differs in every dtype, with or without ``wide``, so every
(K, V) row pair of every shape is distinct; and when one side's row has at
least two elements (``batch * kv_heads * head_dim >= 2``) that side alone is
distinct too (its element ``[0, 0, 0]`` and a neighbour carry both digits),
so a K row of one token beside the V row of another is never a valid pair.
A kvtrace hands out at most ``TOKEN_LIMIT`` identities (fuzz/trace.py
refuses a trace that appends more rows).
"""

from __future__ import annotations

#: Identities are below this bound (2^24): the rows are distinct for all of them.
TOKEN_LIMIT = 2**24
#: The dtypes rows are handed in (kvtrace ``dtype``).
DTYPES = ("float16", "bfloat16", "float32")
MASK32 = 0xFFFFFFFF
#: scramble's multiplier; odd, so multiplication is a bijection mod 2^24
MULTIPLIER = 0x9E3779B1
#: its inverse mod 2^24 (``MULTIPLIER * MULTIPLIER_INVERSE % 2**24 == 1``)
MULTIPLIER_INVERSE = pow(MULTIPLIER, -1, 2**24)
#: the coordinate bounds of ``place`` (the kvtrace schema's: batch and
#: kv_heads at most 64, head dims at most 1024)
MAX_BATCH, MAX_HEADS, MAX_COLUMNS = 64, 64, 1024


def mix32(x: int) -> int:
    """MurmurHash3's 32-bit finalizer (a bijection of 32-bit words)."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & MASK32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & MASK32
    x ^= x >> 16
    return x


def scramble(t: int) -> int:
    """The bijection of ``[0, 2^24)`` the digits come from. Raises
    ValueError for an identity outside ``[0, TOKEN_LIMIT)``."""
    if not 0 <= t < TOKEN_LIMIT:
        raise ValueError(f"token identity must lie in [0, {TOKEN_LIMIT}), got {t}")
    z = (t * MULTIPLIER) & 0xFFFFFF
    return z ^ (z >> 12)


def unscramble(z: int) -> int:
    """The inverse of :func:`scramble` (an adapter that reports identities
    decodes a row with it, then checks the whole row)."""
    z ^= z >> 12
    return (z * MULTIPLIER_INVERSE) & 0xFFFFFF


def place(kv: int, b: int, h: int, c: int) -> int:
    """One integer per element coordinate, below 2^23. Raises ValueError
    for a coordinate outside the schema's bounds."""
    if kv not in (0, 1) or not (0 <= b < MAX_BATCH and 0 <= h < MAX_HEADS and 0 <= c < MAX_COLUMNS):
        raise ValueError(f"coordinates must satisfy kv in (0, 1), b < {MAX_BATCH}, h < {MAX_HEADS}, "
                         f"c < {MAX_COLUMNS}, got kv={kv}, b={b}, h={h}, c={c}")
    return ((kv * MAX_BATCH + b) * MAX_HEADS + h) * MAX_COLUMNS + c


def digit_of(kv: int, b: int, h: int, c: int) -> int:
    """Which 12-bit digit of ``scramble(t)`` the element carries (0: low)."""
    return (kv + b + h + c) & 1


def code(t: int, kv: int, b: int, h: int, c: int) -> int:
    """The element's 12-bit code: its digit of ``scramble(t)`` XOR its salt."""
    digit = (scramble(t) >> (12 * digit_of(kv, b, h, c))) & 0xFFF
    return digit ^ (mix32(place(kv, b, h, c)) & 0xFFF)


def extra(t: int, kv: int, b: int, h: int, c: int) -> int:
    """16 bits of extra precision (float32 uses all, float16 the top 3)."""
    return mix32(mix32(place(kv, b, h, c)) ^ t) >> 16


def is_wide(t: int, dtype: str, wide: bool) -> bool:
    """Whether token ``t``'s rows lie beyond float16's range: the trace's
    ``wide`` flag, a dtype other than float16, and ``t % 5 == 2``."""
    return wide and dtype != "float16" and t % 5 == 2


def element_bits(t: int, kv: int, b: int, h: int, c: int, dtype: str = "float16", wide: bool = False) -> int:
    """The bit pattern of one element in ``dtype`` (16 bits for float16 and
    bfloat16, 32 for float32). Raises ValueError for an unknown dtype or an
    argument out of range."""
    u = code(t, kv, b, h, c)
    sign, e, m = u >> 11, (u >> 7) & 15, u & 127
    x = extra(t, kv, b, h, c)
    if dtype == "float16":
        return (sign << 15) | ((7 + e) << 10) | (m << 3) | (x >> 13)
    shift = 24 if is_wide(t, dtype, wide) else 0
    if dtype == "bfloat16":
        return (sign << 15) | ((119 + e + shift) << 7) | m
    if dtype == "float32":
        return (sign << 31) | ((119 + e + shift) << 23) | (m << 16) | x
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def row_bits(t: int, kv: int, batch: int, kv_heads: int, head_dim: int, dtype: str = "float16",
             wide: bool = False) -> list[int]:
    """A whole ``[batch, kv_heads, 1, head_dim]`` row as bit patterns in C
    order (batch, then head, then column)."""
    return [element_bits(t, kv, b, h, c, dtype, wide)
            for b in range(batch) for h in range(kv_heads) for c in range(head_dim)]


def identify(k000: int, v000: int, dtype: str = "float16", wide: bool = False) -> int | None:
    """The one identity whose rows hold these bit patterns at ``K[0, 0, 0]``
    and ``V[0, 0, 0]`` (None: no identity below TOKEN_LIMIT). Only those
    two elements are read: a caller checks the rest of the row against
    :func:`element_bits` of the answer."""
    def code_of(bits: int) -> int:
        if dtype == "float16":
            sign, exp, m = bits >> 15, (bits >> 10) & 31, (bits >> 3) & 127
            e = exp - 7
        elif dtype == "bfloat16":
            sign, exp, m = bits >> 15, (bits >> 7) & 255, bits & 127
            e = exp - 119
        else:
            sign, exp, m = bits >> 31, (bits >> 23) & 255, (bits >> 16) & 127
            e = exp - 119
        if e >= 24 and dtype != "float16":
            e -= 24
        return -1 if not 0 <= e < 16 else (sign << 11) | (e << 7) | m

    lo, hi = code_of(k000), code_of(v000)
    if lo < 0 or hi < 0:
        return None
    lo ^= mix32(place(0, 0, 0, 0)) & 0xFFF
    hi ^= mix32(place(1, 0, 0, 0)) & 0xFFF
    t = unscramble((hi << 12) | lo)
    ok = element_bits(t, 0, 0, 0, 0, dtype, wide) == k000 and element_bits(t, 1, 0, 0, 0, dtype, wide) == v000
    return t if ok else None
