"""Z3 encoding of what a layer's ``nbytes`` counts (``kvspec.spec.models.nbytes``):
the stored arrays of a dense or ring layer, each ``[B, H, capacity, D]``
array counted once, with the Int8 sidecars (one float16 scale per row and
head for keys and for values).

Two things are encoded:

* :func:`stored_arrays`: the bytes of each array the layer stores, in exact
  integer arithmetic (the reference: what the arrays occupy);
* :func:`nbytes`: ``kvspec.spec.models.nbytes``'s formula, its operations done
  through a :class:`kvspec.proofs.domain.Domain` (so the bv32 run wraps them like
  a 32-bit port would). Obligation 14 proves it equal, over unbounded
  integers, to ``kvspec.spec.models.nbytes`` evaluated on the same Z3 integers:
  the spec's own function, not a copy of it, is what is proved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import z3

from kvspec.proofs.domain import Domain
from kvspec.spec import models as sm


@dataclass(frozen=True)
class Shape:
    """Symbolic batch, kv heads, buffer capacity (rows allocated) and key /
    value head dims."""

    batch: Any
    kv_heads: Any
    capacity: Any
    k_head_dim: Any
    v_head_dim: Any

    def bounds(self, least_capacity: int = 1) -> Any:
        """Every dimension at least 1, the capacity at least
        ``least_capacity`` (1: a layer with buffers; 0 also admits an empty
        layer)."""
        return z3.And(self.batch >= 1, self.kv_heads >= 1, self.capacity >= least_capacity, self.k_head_dim >= 1,
                      self.v_head_dim >= 1)


def shape(d: Domain | None = None) -> Shape:
    """Fresh shape variables (in ``d``: 32-bit ranged in bv32)."""
    names = ("batch", "kv_heads", "capacity", "k_head_dim", "v_head_dim")
    if d is None:
        return Shape(*z3.Ints(" ".join(names)))
    return Shape(*(d.var(n) for n in names))


@dataclass(frozen=True)
class NbytesRules:
    """The counting rule; a negative control changes it."""

    keys_times: int = 1  # how many times the keys' array is counted


SPEC = NbytesRules()


def array_bytes(s: Shape, head_dim: Any, itemsize: int) -> Any:
    """Bytes of one ``[B, H, capacity, head_dim]`` array of ``itemsize``-byte
    elements (exact)."""
    return s.batch * s.kv_heads * s.capacity * head_dim * itemsize


def stored_arrays(s: Shape, mode: str, dtype: str) -> list[Any]:
    """The bytes of each array a layer of ``mode`` stores for rows of
    ``dtype`` (exact): keys, values, then (int8) the keys' and the values'
    scales."""
    if mode == "fp16":
        item = sm.ITEMSIZE[dtype]
        return [array_bytes(s, s.k_head_dim, item), array_bytes(s, s.v_head_dim, item)]
    scale = sm.ITEMSIZE[sm.INT8_SCALE_DTYPE]
    return [array_bytes(s, s.k_head_dim, 1), array_bytes(s, s.v_head_dim, 1), array_bytes(s, 1, scale),
            array_bytes(s, 1, scale)]


def _formula(d: Domain, s: Shape, mode: str, dtype: str, rules: NbytesRules) -> Any:
    rows = d.mul(d.mul(s.batch, s.kv_heads, "B*H"), s.capacity, "rows")
    item = sm.ITEMSIZE[dtype] if mode == "fp16" else sm.ITEMSIZE["int8"]
    out = d.mul(d.mul(rows, d.add(s.k_head_dim, s.v_head_dim, "Dk+Dv"), "rows*(Dk+Dv)"), d.val(item), "codes")
    if mode == "int8":
        scales = d.mul(d.mul(d.val(2), rows, "2*rows"), d.val(sm.ITEMSIZE[sm.INT8_SCALE_DTYPE]), "scales")
        out = d.add(out, scales, "codes+scales")
    for _ in range(rules.keys_times - 1):  # the control: the keys once more
        keys = d.mul(d.mul(rows, s.k_head_dim, "rows*Dk"), d.val(item), "keys again")
        out = d.add(out, keys, "+keys")
    return out


def nbytes(d: Domain, s: Shape, mode: str, dtype: str, rules: NbytesRules = SPEC) -> Any:
    """``kvspec.spec.models.nbytes(mode, capacity, batch, kv_heads, k_head_dim,
    v_head_dim, dtype)`` in ``d``. The count is a value the cache reports:
    in bv32 it is assumed to fit in 32 bits (a 32-bit port must widen or
    refuse past that), and every intermediate product is a no-overflow
    obligation."""
    return d.stored("nbytes", lambda dd, *a: _formula(dd, *a), s, mode, dtype, rules)


def spec_nbytes(s: Shape, mode: str, dtype: str) -> Any:
    """``kvspec.spec.models.nbytes`` itself, run on Z3 integers (exact)."""
    return sm.nbytes(mode, s.capacity, s.batch, s.kv_heads, s.k_head_dim, s.v_head_dim, dtype)
