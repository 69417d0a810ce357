"""Obligation 14: ``kvspec.spec.models.nbytes`` counts every stored array exactly
once (the bug it rules out: ``nbytes`` counting the keys twice), for every batch,
kv heads, capacity and head dims, in each mode (fp16, int8) and rows'
dtype (float16, bfloat16, float32).

Parts, each over unbounded integers and in 32-bit wrapping arithmetic
(``bv32``), per ``(mode, dtype)``:

* the count equals the sum of the bytes of the stored arrays
  (:func:`kvspec.proofs.models_model.stored_arrays`: keys and values, plus the
  Int8 scales), each counted once;
* the encoding is the spec: it equals ``kvspec.spec.models.nbytes`` run on the
  same Z3 integers (in bv32: whenever the count fits in 32 bits, no
  intermediate product overflows and the wrapped count is the spec's).

These two are stated for a layer with buffers (``capacity >= 1``): with
``capacity == 0`` the product ``batch * kv_heads`` (or ``Dk + Dv``) can
overflow 32 bits while the count is 0, so bv32 would refute the
no-overflow obligation of a product whose value is then multiplied by 0.
A third part states that case on its own: a layer without buffers counts
0 bytes, as do its (empty) arrays.

Negative control ``nbytes_keys_twice``: the keys' bytes added once more,
refuted with a counterexample shape in both domains.

Run as ``kvspec prove --only 14`` (or ``python -m kvspec.proofs.models``);
``tests/test_models_machine.py`` also runs :func:`counted_once`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import z3

from kvspec.proofs.core import ObligationResult, PartBuilder, control_from_parts, overall, run_parts
from kvspec.proofs.domain import INT
from kvspec.proofs.models_model import SPEC, NbytesRules, nbytes, shape, spec_nbytes, stored_arrays

CASES = [(mode, dtype) for mode in ("fp16", "int8") for dtype in ("float16", "bfloat16", "float32")]
NAME = "nbytes counts each array once"


def nbytes_parts(rules: NbytesRules = SPEC, cases: list[tuple[str, str]] = CASES) -> list[tuple[str, PartBuilder]]:
    def once(mode: str, dtype: str) -> PartBuilder:
        def build(d: Any) -> tuple[list[Any], Any]:
            s = shape(d)
            return [s.bounds()], nbytes(d, s, mode, dtype, rules) == sum(stored_arrays(s, mode, dtype))
        return build

    def is_spec(mode: str, dtype: str) -> PartBuilder:
        def build(d: Any) -> tuple[list[Any], Any]:
            s = shape(d)
            return [s.bounds()], nbytes(d, s, mode, dtype, rules) == spec_nbytes(s, mode, dtype)
        return build

    def empty(d: Any) -> tuple[list[Any], Any]:
        s = shape(d)
        return [s.bounds(0), s.capacity == 0], z3.And(*(z3.And(spec_nbytes(s, m, t) == 0,
                                                               sum(stored_arrays(s, m, t)) == 0)
                                                       for m, t in cases))

    parts: list[tuple[str, PartBuilder]] = []
    for mode, dtype in cases:
        parts.append((f"{mode}/{dtype}: nbytes is the sum of the stored arrays, each once", once(mode, dtype)))
    for mode, dtype in cases:
        parts.append((f"{mode}/{dtype}: the encoding is kvspec.spec.models.nbytes", is_spec(mode, dtype)))
    parts.append(("a layer without buffers (capacity 0) counts 0 bytes", empty))
    return parts


CONTROLS = [
    ("nbytes_keys_twice", "nbytes adds the keys' bytes once more", NbytesRules(keys_times=2)),
]


def prove_nbytes() -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(nbytes_parts())
    controls = [control_from_parts(name, text, nbytes_parts(rules)) for name, text, rules in CONTROLS]
    return ObligationResult(
        14, NAME, ("nbytes",),
        "a layer's nbytes is the bytes of its stored arrays (keys, values, Int8 scales), each counted once, "
        "for every shape, mode and dtype",
        overall(parts, controls), parts, controls, time.perf_counter() - t0)


OBLIGATIONS: list[tuple[int, Callable[[], ObligationResult]]] = [(14, prove_nbytes)]


def counted_once(rules: NbytesRules = SPEC) -> dict[tuple[str, str], str | None]:
    """For each ``(mode, dtype)``: None when the count under ``rules`` is the
    sum of the stored arrays for every shape (proved over unbounded
    integers), else the status and Z3's counterexample as text."""
    out: dict[tuple[str, str], str | None] = {}
    for mode, dtype in CASES:
        (label, build), = nbytes_parts(rules, [(mode, dtype)])[:1]
        r = run_parts([(label, build)], (INT,))[0]
        out[(mode, dtype)] = None if r.status == "proved" else f"{r.status}: {r.counterexample or r.reason}"
    return out


spec_count = SPEC
keys_twice = CONTROLS[0][2]


if __name__ == "__main__":  # pragma: no cover - a manual run
    print("kvspec.spec.models.nbytes:", counted_once(spec_count))
    print("control (keys twice):", counted_once(keys_twice))
