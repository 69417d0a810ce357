"""Z3 encoding of the list-level trim rule (``spec.layers``): the count
every layer of a prompt cache trims (``list_trim_count`` over
``layer_trimmable_rows``), for a list of :data:`LAYERS` layers of either kind.

Each layer ``i`` is described by ``dense_i`` (a dense layer, else a ring),
``offset_i``, ``live_i`` (a dense layer's live rows, ``<= offset_i``) and
``trimmable_i`` (a ring's ``spec.rotating.is_trimmable``). The encoding uses
comparisons and ``If`` only, so it is exact in both domains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import z3

from proofs.domain import Domain

#: Layers in the encoded list (mixed patterns of dense layers and rings).
LAYERS = 3


@dataclass(frozen=True)
class LayerS:
    dense: Any
    offset: Any
    live: Any
    trimmable: Any


@dataclass(frozen=True)
class TrimRules:
    """Which rule each step follows: the spec's, or a named bug."""

    rows: str = "spec"  # "spec": live rows of a dense layer; "offset": its offset
    refuse: str = "spec"  # "spec": any untrimmable layer refuses; "skip": it is ignored


TRIM_SPEC = TrimRules()


def layer_vars(d: Domain, i: int) -> LayerS:
    return LayerS(d.boolean(f"dense_{i}"), d.var(f"offset_{i}"), d.var(f"live_{i}"), d.boolean(f"trimmable_{i}"))


def layer_premises(layer: LayerS) -> list[Any]:
    """What every layer satisfies: a dense layer's live rows lie within its
    offset; a ring's rows are its offset (no front trim)."""
    return [layer.offset >= 0, layer.live >= 0, layer.live <= layer.offset,
            z3.Implies(z3.Not(layer.dense), layer.live == layer.offset)]


def can_trim(layer: LayerS) -> Any:
    """``layer_trimmable_rows(cache) is not None``: dense always, a ring
    when ``is_trimmable``."""
    return z3.Or(layer.dense, layer.trimmable)


def trimmable_rows(layer: LayerS, rules: TrimRules = TRIM_SPEC) -> Any:
    """``layer_trimmable_rows``: a dense layer's live rows, a ring's offset."""
    if rules.rows == "offset":
        return layer.offset
    return z3.If(layer.dense, layer.live, layer.offset)


def list_trim_count(n: Any, layers: list[LayerS], rules: TrimRules = TRIM_SPEC) -> Any:
    """``spec.layers.list_trim_count(n, rows)``: 0 when ``n <= 0`` or some
    layer cannot trim exactly, else ``min(n, rows of every layer)``."""
    least = n
    for layer in layers:
        rows = trimmable_rows(layer, rules)
        least = z3.If(rows < least, rows, least)
    every = z3.And(*(can_trim(layer) for layer in layers)) if rules.refuse == "spec" else z3.BoolVal(True)
    return z3.If(z3.Or(n <= 0, z3.Not(every)), 0, least)


def layer_trims(layer: LayerS, count: Any) -> Any:
    """What one layer's own ``trim(count)`` removes (``spec.dense.trim``:
    ``clamp(count, 0, live)``; ``spec.rotating.trim``: ``clamp(count, 0,
    offset)`` when trimmable, else 0)."""
    dense = z3.If(count <= 0, 0, z3.If(count > layer.live, layer.live, count))
    ring = z3.If(z3.Or(z3.Not(layer.trimmable), count <= 0), 0, z3.If(count > layer.offset, layer.offset, count))
    return z3.If(layer.dense, dense, ring)
