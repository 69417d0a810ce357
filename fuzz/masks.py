"""Mask checks shared by every lockstep whose implementation offers
``make_mask`` (called before an append, as an mlx-lm model calls it).

The returned value is expanded into the boolean matrix it denotes (``None``:
the single query sees every key; ``"causal"``: the plain causal mask; an
array: itself) and compared with the kind's spec rule: for a dense cache
``kvspec.spec.dense.dense_make_mask`` (``dense_mask_visible``), for a ring
``kvspec.spec.rotating.make_mask_spec`` (``mask_visible``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.fuzz.lockstep import Divergence
from kvspec.spec import dense as sd
from kvspec.spec import rotating as sr


def mask_as_rows(mask: Any, n: int, length: int) -> list[list[bool]] | None:
    """Expand what ``make_mask`` returned into rows of booleans (None for a
    form that denotes no ``[n, length]`` matrix)."""
    got = mask_matrix(mask, n, length)
    return None if got is None else got.tolist()


@lru_cache(maxsize=4096)
def _causal(n: int, length: int) -> np.ndarray:
    """The matrix ``"causal"`` denotes: query ``i`` sees key ``j`` iff ``j <= length - n + i``."""
    out = np.arange(length)[None, :] <= (length - n + np.arange(n))[:, None]
    out.setflags(write=False)
    return out


def mask_matrix(mask: Any, n: int, length: int) -> np.ndarray | None:
    """What ``make_mask`` returned as an ``[n, length]`` boolean matrix (None
    for a form that denotes none): ``None`` (one query, sees every key),
    ``"causal"``, or an array of that shape (nonzero: visible)."""
    if mask is None:
        return np.ones((1, length), dtype=bool) if n == 1 else None  # several queries: no mask is not causal
    if isinstance(mask, str):
        return _causal(n, length) if mask == "causal" else None
    arr = np.asarray(mask)
    if arr.shape != (n, length):
        return None
    return arr.astype(bool)


def same_mask(got: np.ndarray, want: np.ndarray) -> bool:
    """Whether two ``[N, L]`` boolean matrices are equal: every query's row,
    not only the newest one (a prefill chunk's earlier rows are where a
    window measured from the wrong query shows; catalog bug
    ``mask_window_from_newest_query``, kvspec.fuzz.harness_mutants)."""
    return np.array_equal(got, want)


def mask_text(rows: Any) -> str:
    return " / ".join("".join("1" if x else "." for x in r) for r in rows)


def _spec_matrix(rows: tuple[tuple[bool, ...], ...]) -> np.ndarray:
    out = np.array(rows, dtype=bool).reshape(len(rows), -1)
    out.setflags(write=False)
    return out


@lru_cache(maxsize=4096)
def _dense_mask(live_len: int, n: int, window: int | None) -> np.ndarray:
    """kvspec.spec.dense.dense_make_mask as a boolean matrix, kept per arguments
    (a pure function: a decode loop asks for the same ones op after op)."""
    return _spec_matrix(sd.dense_make_mask(live_len, n, window))


def _compare(lock: Any, op: dict[str, Any], cache: Any, n: int, cases: list[tuple[int | None, np.ndarray]],
             prefix: str) -> None:
    """``make_mask`` in array and short form for each ``(window, want)`` of
    ``cases`` (``want``: the spec's ``[n, length]`` boolean matrix), called
    now (before the append, as a model calls it) and compared in order once
    the step's one MLX evaluation has evaluated the array masks
    (``lock.defer``; at once outside a step): whole matrices, one NumPy
    comparison each."""
    calls = []
    for window, want in cases:
        for kwargs in ({"return_array": True}, {}):
            kwargs = {**kwargs, **({} if window is None else {"window_size": window})}
            calls.append((kwargs, want, cache.make_mask(n, **kwargs)))
    index = lock.current_index
    # the form asked for (an array) is this project's contract; another engine's
    # cache is compared on the matrix its answer denotes (kvspec.fuzz.targets)
    form = getattr(lock, "check_mask_form", True)

    def check() -> None:
        for kwargs, want, mask in calls:
            if form and kwargs.get("return_array") and not isinstance(mask, mx.array):
                # asked for an array: None or "causal" is the wrong form, whatever it denotes
                raise Divergence(index, op, f"{prefix}make_mask({n}, {kwargs}) differs", "an array",
                                 f"unexpected form {type(mask).__name__}")
            if form and isinstance(mask, mx.array) and mask.dtype != mx.bool_:
                # MLX's attention adds a mask that is not bool to the scores
                # (0/1 would shift them, not hide keys): the form is bool
                raise Divergence(index, op, f"{prefix}make_mask({n}, {kwargs}) differs", "a bool array",
                                 f"an array of {mask.dtype}")
            got = mask_matrix(mask, n, want.shape[1])
            if got is None or not same_mask(got, want):
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
    against kvspec.spec.dense.dense_make_mask, for each of :func:`dense_windows`."""
    n = op["n"]
    cases = [(window, _dense_mask(live_len, n, window)) for window in dict.fromkeys(dense_windows(live_len))]
    _compare(lock, op, cache, n, cases, prefix)
    lock.reached("dense masks checked")


def ring_windows(max_size: int, keep: int) -> list[int | None]:
    """Windows a ring's masks are checked with (``narrow``): its own
    (None), one narrower (``W - 1``: where each position sits), the edges
    around the sinks (1, ``keep``, ``keep + 1``: a window at or below the
    sinks hides even the query's own key unless it is a sink) and one wider
    than the ring (``W + 2``). A decode with the full window sees every
    key, so only the others check where each position sits."""
    out: list[int | None] = [None, max_size - 1, 1, keep, keep + 1, max_size + 2]
    return [w for w in dict.fromkeys(out) if w is None or w >= 1]


def check_ring_masks(lock: Any, op: dict[str, Any], spec_cache: sr.RotatingCache, cache: Any,
                     narrow: bool, prefix: str = "") -> None:
    """``cache.make_mask`` for the append ``op`` against
    kvspec.spec.rotating.make_mask_spec, with the ring's own window and (``narrow``)
    the windows of :func:`ring_windows`."""
    n = op["n"]
    windows: list[int | None] = ring_windows(spec_cache.max_size, spec_cache.keep) if narrow else [None]
    wants = sr.make_masks_spec(spec_cache, n, tuple(windows))
    cases = [(window, _spec_matrix(want)) for window, want in zip(windows, wants)]
    _compare(lock, op, cache, n, cases, prefix)
    lock.reached("masks checked")
