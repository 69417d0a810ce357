"""Attention masks as ``make_mask`` returns them in array form: one formula
per cache kind, built where the arrays live.

Every cache's ``make_mask(N, window_size, return_array)`` (dense, Int8,
Turbo, the paged sequence, the ring) returns, when it must hand back an
array, a bool ``[N, L]`` matrix: row ``i`` is the query of the ``i``-th new
row, column ``j`` the ``j``-th key the append will return, True where the
query sees the key. The rules are the caches' own (their docstrings); this
module only builds the matrix they state, in one of two places
(:func:`mask_namespace`):

* ``"cpu"`` and ``"metal"`` (host or Apple unified memory): in NumPy, then
  one ``mx.array`` from the finished matrix. A mask is a few comparisons of
  index vectors; as a lazy MLX graph it is 7-15 nodes, and on MLX's CPU
  backend each node is a task handed to the stream's thread (measured on a
  2-core x86 host, MLX 0.32: six ring masks added about 270 us to one
  evaluation as MLX graphs, and took 66 us built in NumPy, evaluation
  included). Host and device share the pages, so the copy is all there is.
* ``"cuda"`` (managed memory): in MLX, on the device, as mlx-lm builds its
  masks. A host-built matrix would be written by the host and then read by
  the GPU, migrating its pages, and a prefill chunk's mask is ``N * L``
  bytes.

Both builds evaluate the same expression with the same integer arithmetic
(int64 on the host; MLX's own index dtype on the device, exact at these
sizes), so they give the same matrix; ``tests/test_impl_masks.py`` checks
that on every small case, the CUDA build run on the CPU.

Errors: none of its own; the callers validate ``N`` and ``window_size``
(``kvspec.spec.dense.check_window_size`` states the rule).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.impl.write import backend


def mask_namespace() -> Any:
    """``numpy`` where a host-built mask is read in place (``kvspec.impl.write.
    backend()`` is ``"cpu"`` or ``"metal"``), ``mlx.core`` on MLX's CUDA
    backend. Read at each call: the default device may move."""
    return mx if backend() == "cuda" else np


def _finish(mask: Any) -> mx.array:
    return mask if isinstance(mask, mx.array) else mx.array(mask)


def causal_mask(live_len: int, n: int, window_size: int | None = None, xp: Any = None) -> mx.array:
    """bool ``[n, live_len + n]``: query ``i`` (position ``live_len + i``)
    sees key ``j`` iff ``j <= live_len + i`` and, with ``window_size``,
    ``live_len + i - j < window_size``. The dense, Int8, Turbo and paged
    caches' rule (their ``make_mask``). ``xp``: the namespace to build in
    (None: :func:`mask_namespace`)."""
    xp = mask_namespace() if xp is None else xp
    length = live_len + n
    q = xp.arange(live_len, length)[:, None]
    k = xp.arange(length)[None]
    mask = q >= k
    if window_size is not None and window_size < length:
        # a window of length or more hides no causal key (q - k < length);
        # only a narrower one is compared, so k + window_size never wraps
        # (any integer >= 1 is a valid window: int64 on the host, MLX's
        # int32 on the device)
        mask = mask & (q < k + window_size)
    return _finish(mask)


def ring_mask(positions: np.ndarray, offset: int, n: int, keep: int, window: int, xp: Any = None) -> mx.array:
    """bool ``[n, len(positions)]`` for a ring: query ``i`` (position
    ``offset + i``) sees the key at position ``p`` (``positions``: int64,
    the keys' positions in the order the append returns them) iff ``p <=
    offset + i`` and ``p`` is a sink (``p < keep``) or ``offset + i - p <
    window - keep``. ``kvspec.impl.rotating.RotatingKVCache.make_mask``'s rule.
    ``xp``: as :func:`causal_mask`."""
    xp = mask_namespace() if xp is None else xp
    # a window past every query's distance to position 0 hides no key: cut to
    # that, so window - keep stays a small integer in either namespace
    window = min(window, offset + n + keep)
    if xp is np:
        p = positions[None, :]
        q = (offset + np.arange(n, dtype=np.int64))[:, None]
    else:
        p = mx.array(positions)[None, :]
        q = (offset + mx.arange(n, dtype=mx.int64))[:, None]
    mask = (p <= q) & ((p < keep) | ((q - p) < (window - keep)))
    return _finish(mask)
