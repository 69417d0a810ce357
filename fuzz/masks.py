"""Mask checks shared by every lockstep whose implementation offers
``make_mask`` (called before an append, as an mlx-lm model calls it).

The returned value is expanded into the boolean matrix it denotes (``None``:
the single query sees every key; ``"causal"``: the plain causal mask; an
array: itself) and compared with the kind's spec rule: for a dense cache
``spec.dense.dense_make_mask`` (``dense_mask_visible``), for a ring
``spec.rotating.make_mask_spec`` (``mask_visible``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from fuzz.lockstep import Divergence
from spec import dense as sd
from spec import rotating as sr


def mask_as_rows(mask: Any, n: int, length: int) -> list[list[bool]] | None:
    """Expand what ``make_mask`` returned into rows of booleans (None for a
    form that denotes no ``[n, length]`` matrix)."""
    if mask is None:
        if n != 1:
            return None  # no mask for several queries means none is causal
        return [[True] * length]
    if isinstance(mask, str):
        if mask != "causal":
            return None
        return [[j <= length - n + i for j in range(length)] for i in range(n)]
    arr = np.asarray(mask)
    if arr.shape != (n, length):
        return None
    return arr.astype(bool).tolist()


def mask_text(rows: list[list[bool]]) -> str:
    return " / ".join("".join("1" if x else "." for x in r) for r in rows)


def _compare(lock: Any, op: dict[str, Any], cache: Any, n: int, cases: list[tuple[int | None, list[list[bool]]]],
             prefix: str) -> None:
    """``make_mask`` in array and short form for each ``(window, want)`` of
    ``cases``, called now (before the append, as a model calls it) and
    compared in order once the step's one MLX evaluation has evaluated the
    array masks (``lock.defer``; at once outside a step)."""
    calls = []
    for window, want in cases:
        for kwargs in ({"return_array": True}, {}):
            kwargs = {**kwargs, **({} if window is None else {"window_size": window})}
            calls.append((kwargs, want, cache.make_mask(n, **kwargs)))
    index = lock.current_index

    def check() -> None:
        for kwargs, want, mask in calls:
            got = mask_as_rows(mask, n, len(want[0]))
            if got != want:
                raise Divergence(index, op, f"{prefix}make_mask({n}, {kwargs}) differs",
                                 mask_text(want), "unexpected form" if got is None else mask_text(got))

    lazy = [m for _, _, m in calls if isinstance(m, mx.array)]
    if hasattr(lock, "defer"):
        lock.defer(lazy, check)
    else:
        if lazy:
            mx.eval(*lazy)
        check()


def dense_windows(live_len: int) -> list[int | None]:
    """Windows a dense cache's masks are checked with: none, and windows
    that bind (1, 3 and the live length: a windowed layer served by a dense
    cache) or do not."""
    return [None, 1, 3, max(1, live_len)]


def check_dense_masks(lock: Any, op: dict[str, Any], live_len: int, cache: Any, prefix: str = "") -> None:
    """``cache.make_mask`` (array and short forms) for the append ``op``
    against spec.dense.dense_make_mask, for each of :func:`dense_windows`."""
    n = op["n"]
    cases = [(window, [list(r) for r in sd.dense_make_mask(live_len, n, window)])
             for window in dict.fromkeys(dense_windows(live_len))]
    _compare(lock, op, cache, n, cases, prefix)
    lock.reached("dense masks checked")


def check_ring_masks(lock: Any, op: dict[str, Any], spec_cache: sr.RotatingCache, cache: Any,
                     narrow: bool, prefix: str = "") -> None:
    """``cache.make_mask`` for the append ``op`` against
    spec.rotating.make_mask_spec, with the ring's own window and (``narrow``)
    a narrower one: with the full window a decode sees every key, so only a
    narrower one checks where each position sits."""
    n = op["n"]
    windows: list[int | None] = [None]
    if narrow and spec_cache.max_size - 1 > spec_cache.keep:
        windows.append(spec_cache.max_size - 1)
    cases = [(window, [list(r) for r in sr.make_mask_spec(spec_cache, n, window)]) for window in windows]
    _compare(lock, op, cache, n, cases, prefix)
    lock.reached("masks checked")
