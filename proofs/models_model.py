"""Z3 encoding of what a layer's ``nbytes`` counts (``spec.models.nbytes``):
the stored arrays of a dense or ring layer, each ``[B, H, capacity, D]``
array counted once, with the Int8 sidecars (one float16 scale per row and
head for keys and for values).

The spec's function is pure integer arithmetic, so it is evaluated on Z3
integers directly: the encoding is the spec itself, not a copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import z3

from spec import models as sm


@dataclass(frozen=True)
class Shape:
    """Symbolic batch, kv heads, buffer capacity and key / value head dims."""

    batch: Any
    kv_heads: Any
    capacity: Any
    k_head_dim: Any
    v_head_dim: Any

    def bounds(self) -> Any:
        return z3.And(self.batch >= 1, self.kv_heads >= 1, self.capacity >= 0, self.k_head_dim >= 1,
                      self.v_head_dim >= 1)


def shape() -> Shape:
    return Shape(*z3.Ints("batch kv_heads capacity k_head_dim v_head_dim"))


def array_bytes(s: Shape, head_dim: Any, itemsize: int) -> Any:
    """Bytes of one ``[B, H, capacity, head_dim]`` array of ``itemsize``-byte elements."""
    return s.batch * s.kv_heads * s.capacity * head_dim * itemsize


def stored_arrays(s: Shape, mode: str, dtype: str) -> list[Any]:
    """The bytes of each array a layer of ``mode`` stores for rows of ``dtype``."""
    if mode == "fp16":
        item = sm.ITEMSIZE[dtype]
        return [array_bytes(s, s.k_head_dim, item), array_bytes(s, s.v_head_dim, item)]
    scale = sm.ITEMSIZE[sm.INT8_SCALE_DTYPE]
    return [array_bytes(s, s.k_head_dim, 1), array_bytes(s, s.v_head_dim, 1), array_bytes(s, 1, scale),
            array_bytes(s, 1, scale)]
