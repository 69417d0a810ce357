"""Proof that ``spec.models.nbytes`` counts every stored array exactly once
(issue 47 (h): ``nbytes`` counting the keys twice), for every batch, kv
heads, capacity and head dims, in each mode and dtype, with a negative
control: the keys counted twice is refuted with a counterexample.

Run as ``python -m proofs.models``; ``tests/test_models_machine.py`` runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import z3

from proofs.domain import solver as clock_free_solver
from proofs.models_model import Shape, shape, stored_arrays
from spec import models as sm

CASES = [(mode, dtype) for mode in ("fp16", "int8") for dtype in ("float16", "bfloat16", "float32")]


def counted_once(count: Callable[[Shape, str, str], Any]) -> dict[tuple[str, str], str | None]:
    """For each ``(mode, dtype)``: None when ``count`` equals the sum of the
    stored arrays for every shape, else Z3's counterexample as text."""
    out: dict[tuple[str, str], str | None] = {}
    for mode, dtype in CASES:
        s = shape()
        solver = clock_free_solver(20_000)  # Z3 units, no wall-clock timeout (docs/proofs.md, "Budgets")
        solver.add(s.bounds(), count(s, mode, dtype) != sum(stored_arrays(s, mode, dtype)))
        verdict = solver.check()
        out[(mode, dtype)] = None if verdict == z3.unsat else str(solver.model() if verdict == z3.sat else verdict)
    return out


def spec_count(s: Shape, mode: str, dtype: str) -> Any:
    return sm.nbytes(mode, s.capacity, s.batch, s.kv_heads, s.k_head_dim, s.v_head_dim, dtype)


def keys_twice(s: Shape, mode: str, dtype: str) -> Any:
    """Negative control: the keys' bytes added once more."""
    return spec_count(s, mode, dtype) + stored_arrays(s, mode, dtype)[0]


if __name__ == "__main__":  # pragma: no cover - a manual run
    print("spec.models.nbytes:", counted_once(spec_count))
    print("control (keys twice):", counted_once(keys_twice))
