"""The prompt cache's obligation 9: the list-level trim is atomic
(semantics.md 6, ``kvspec.spec.layers``).

Encodings are in :mod:`kvspec.proofs.layers_model`. Parts, for a list of
``LAYERS`` layers of either kind, any request ``n``:

* every layer's own trim removes exactly the list's count (so the layers
  never disagree on how many tokens they hold), and a refusal (count 0)
  trims no layer;
* the count is the largest such: ``min(n, rows of every layer)`` whenever
  every layer can take that many rows back exactly;
* a count beyond some layer's exact bound (a wrapped ring beyond its undo
  depth) refuses the list.

Negative controls: the count taken from the offsets (a dense layer after a
front trim trims fewer rows than the others), and an untrimmable layer
skipped instead of refusing (the others trim, it does not).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import z3

from kvspec.proofs.core import ObligationResult, PartBuilder, control_from_parts, overall, run_parts
from kvspec.proofs.domain import Domain
from kvspec.proofs.layers_model import (
    LAYERS,
    TRIM_SPEC,
    TrimRules,
    layer_premises,
    layer_trims,
    layer_vars,
    list_trim_count,
)

REQUIRED = ("list_trim_count", "layer_trim_bounds", "trim_prompt_cache", "can_trim_prompt_cache")


def available() -> bool:
    """spec/layers.py exists and has the functions this proof encodes."""
    try:
        from kvspec.spec import layers as sl
    except ImportError:
        return False
    return all(hasattr(sl, name) for name in REQUIRED)


def _setup(d: Domain) -> tuple[Any, list[Any], list[Any]]:
    n = d.var("n")
    layers = [layer_vars(d, i) for i in range(LAYERS)]
    premises = [p for layer in layers for p in layer_premises(layer)]
    return n, layers, premises


def _least(n: Any, layers: list[Any]) -> Any:
    least = n
    for layer in layers:
        least = z3.If(layer.live < least, layer.live, least)
    return least


def trim_parts(rules: TrimRules = TRIM_SPEC) -> list[tuple[str, PartBuilder]]:
    def same_count_everywhere(d: Domain) -> tuple[list[Any], Any]:
        n, layers, premises = _setup(d)
        count = list_trim_count(n, layers, rules)
        return premises, z3.And(*(layer_trims(layer, count) == count for layer in layers))

    def largest(d: Domain) -> tuple[list[Any], Any]:
        n, layers, premises = _setup(d)
        count, least = list_trim_count(n, layers, rules), _least(n, layers)
        within = z3.And(*(least <= layer.exact for layer in layers))
        return [*premises, n > 0, within], count == least

    def refuses_beyond_an_exact_bound(d: Domain) -> tuple[list[Any], Any]:
        n, layers, premises = _setup(d)
        count, least = list_trim_count(n, layers, rules), _least(n, layers)
        beyond = z3.Or(*(least > layer.exact for layer in layers))
        return [*premises, beyond], count == 0

    return [("every layer trims the list's count", same_count_everywhere),
            ("the count is min(n, every layer's rows) when all can take it exactly", largest),
            ("a count beyond some layer's exact bound refuses the list", refuses_beyond_an_exact_bound)]


#: (name, what the bug does, rules)
TRIM_CONTROLS: list[tuple[str, str, TrimRules]] = [
    ("count_from_offset", "the count taken from the layers' offsets, not a dense layer's live rows",
     TrimRules(rows="offset")),
    ("skip_untrimmable", "a layer that cannot trim the count exactly is ignored instead of refusing the list",
     TrimRules(refuse="skip")),
]


def prove_list_trim() -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(trim_parts())
    controls = [control_from_parts(name, text, trim_parts(rules)) for name, text, rules in TRIM_CONTROLS]
    return ObligationResult(
        NUMBER, "atomic list trim", ("list_trim_count", "layer_trim_bounds"),
        "every layer trims the same count, min(n, every layer's live rows), or none does",
        overall(parts, controls), parts, controls, time.perf_counter() - t0)


#: obligation 8 is the ring's undo log
NUMBER = 9
OBLIGATIONS: list[tuple[int, Callable[[], ObligationResult]]] = [(NUMBER, prove_list_trim)]
