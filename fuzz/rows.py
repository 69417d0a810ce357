"""Deterministic row contents for token identities.

kvtrace says a row's K and V are a function of its identity and the trace's
configuration, so any machine replays the same bytes and a stale row can be
told from a new one. Rows are float16 ``[B, H, 1, D]``; every seventh token
has an all-zero K row and every eleventh an all-zero V row (the Int8
``scale == 0`` rule), never both, so every token's (K, V) pair stays unique;
the others are normal draws scaled by a per-token magnitude so the quantizers
see a spread.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


@lru_cache(maxsize=65536)
def row(token: int, which: str, batch: int, kv_heads: int, head_dim: int) -> np.ndarray:
    """float16 ``[batch, kv_heads, 1, head_dim]`` for ``which`` in {"k", "v"}."""
    shape = (batch, kv_heads, 1, head_dim)
    if (which == "k" and token % 7 == 3) or (which == "v" and token % 11 == 5 and token % 7 != 3):
        return np.zeros(shape, dtype=np.float16)
    rng = np.random.default_rng([token, 0 if which == "k" else 1, batch, kv_heads, head_dim])
    magnitude = float(2.0 ** rng.integers(-6, 6))
    out = (rng.standard_normal(shape) * magnitude).astype(np.float16)
    out.setflags(write=False)
    return out


def rows(tokens, which: str, batch: int, kv_heads: int, head_dim: int) -> np.ndarray:
    """float16 ``[batch, kv_heads, len(tokens), head_dim]`` in token order."""
    tokens = list(tokens)
    if not tokens:
        return np.zeros((batch, kv_heads, 0, head_dim), dtype=np.float16)
    return np.concatenate([row(t, which, batch, kv_heads, head_dim) for t in tokens], axis=2)
