"""Z3 encoding of the list-level trim rule (``kvspec.spec.layers``): the count
every layer of a prompt cache trims (``list_trim_count`` over
``layer_trim_bounds``), for a list of :data:`LAYERS` layers of either kind.

Each layer ``i`` is described by ``dense_i`` (a dense layer, else a ring),
``offset_i``, ``live_i`` (a dense layer's live rows, ``<= offset_i``) and
``exact_i`` (the most rows its trim takes back exactly: a dense layer's live
rows; a ring's ``kvspec.spec.rotating.trimmable_rows``, between 0 and its offset).
The encoding uses comparisons and ``If`` only, so it is exact in both
domains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import z3

from kvspec.proofs.domain import Domain

#: Layers in the encoded list (mixed patterns of dense layers and rings).
LAYERS = 3


@dataclass(frozen=True)
class LayerS:
    dense: Any
    offset: Any
    live: Any
    exact: Any


@dataclass(frozen=True)
class TrimRules:
    """Which rule each step follows: the spec's, or a named bug."""

    rows: str = "spec"  # "spec": live rows of a dense layer; "offset": its offset
    refuse: str = "spec"  # "spec": a count beyond some layer's exact bound refuses; "skip": ignored


TRIM_SPEC = TrimRules()


def layer_vars(d: Domain, i: int) -> LayerS:
    return LayerS(d.boolean(f"dense_{i}"), d.var(f"offset_{i}"), d.var(f"live_{i}"), d.var(f"exact_{i}"))


def layer_premises(layer: LayerS) -> list[Any]:
    """What every layer satisfies: a dense layer's live rows lie within its
    offset and are its exact bound; a ring's rows are its offset (no front
    trim) and its exact bound lies in ``[0, offset]``."""
    return [layer.offset >= 0, layer.live >= 0, layer.live <= layer.offset,
            z3.Implies(layer.dense, layer.exact == layer.live),
            z3.Implies(z3.Not(layer.dense), z3.And(layer.live == layer.offset, layer.exact >= 0,
                                                   layer.exact <= layer.offset))]


def rows_of(layer: LayerS, rules: TrimRules = TRIM_SPEC) -> Any:
    """What the layer's trim clamps a request to: a dense layer's live rows,
    a ring's offset (the bug: a dense layer's offset)."""
    if rules.rows == "offset":
        return layer.offset
    return layer.live


def list_trim_count(n: Any, layers: list[LayerS], rules: TrimRules = TRIM_SPEC) -> Any:
    """``kvspec.spec.layers.list_trim_count(n, bounds)``: ``min(n, every layer's
    rows)``, and 0 when ``n <= 0`` or that is beyond some layer's exact bound."""
    count = n
    for layer in layers:
        rows = rows_of(layer, rules)
        count = z3.If(rows < count, rows, count)
    beyond = z3.Or(*(count > layer.exact for layer in layers)) if rules.refuse == "spec" else z3.BoolVal(False)
    return z3.If(z3.Or(n <= 0, beyond), 0, count)


def layer_trims(layer: LayerS, count: Any) -> Any:
    """What one layer's own ``trim(count)`` removes (``kvspec.spec.dense.trim``:
    ``clamp(count, 0, live)``; ``kvspec.spec.rotating.trim``: ``clamp(count, 0,
    offset)`` when within its exact bound, else 0: fail closed)."""
    dense = z3.If(count <= 0, 0, z3.If(count > layer.live, layer.live, count))
    clamped = z3.If(count > layer.offset, layer.offset, count)
    ring = z3.If(z3.Or(count <= 0, clamped > layer.exact), 0, clamped)
    return z3.If(layer.dense, dense, ring)
