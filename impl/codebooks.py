"""Lloyd-Max codebooks of the Turbo quantizer (semantics.md 2, "Storage").

After the random rotation every coordinate of a unit-norm row of dimension
``d`` is close to N(0, 1/d). The optimal scalar quantizer for a Gaussian
(Lloyd 1957 / Max 1960) is computed once for the *unit* Gaussian by
:func:`lloyd_max` and kept as data in ``codebooks.json`` (this module's
``__main__`` rewrites it); the codebook for N(0, 1/d) is the unit one scaled
by ``1 / sqrt(d)`` (:func:`centroids_for`).

Only the generator needs SciPy (``scipy.stats.norm``); the caches read the
stored JSON.

    python -m kvspec.impl.codebooks          # recompute and rewrite codebooks.json
    python -m kvspec.impl.codebooks --check  # exit 1 if the stored data differs
"""

from __future__ import annotations

import json
import math
import sys
from functools import cache
from pathlib import Path

DATA = Path(__file__).with_name("codebooks.json")
BITS = (3, 4)
# Digits kept in the JSON file: far below the float16 resolution the cache
# stores, and stable across platforms.
DIGITS = 12
TOLERANCE = 1e-13
MAX_ITERATIONS = 100_000


def lloyd_max(bits: int, tol: float = TOLERANCE, max_iter: int = MAX_ITERATIONS) -> tuple[list[float], float]:
    """Lloyd-Max quantizer of the unit Gaussian with ``2**bits`` levels.

    Alternates the two optimality conditions until no centroid moves by more
    than ``tol``: decision thresholds at the midpoints between neighbouring
    centroids, each centroid at the conditional mean of its cell,
    ``E[X | a < X < b] = (phi(a) - phi(b)) / (Phi(b) - Phi(a))``.
    Starts from the equiprobable quantiles. Returns ``(centroids ascending,
    mean-squared error)``; the MSE is ``1 - sum_i P_i c_i**2`` (exact for
    centroids at their cells' means). Raises ValueError for ``bits < 1``.
    """
    import numpy as np
    from scipy.stats import norm

    if bits < 1:
        raise ValueError(f"lloyd_max: bits must be >= 1, got {bits}")
    levels = 2 ** bits
    c = norm.ppf((np.arange(levels) + 0.5) / levels)
    for _ in range(max_iter):
        edges = np.concatenate(([-np.inf], (c[:-1] + c[1:]) / 2, [np.inf]))
        mass = np.diff(norm.cdf(edges))
        new = (norm.pdf(edges[:-1]) - norm.pdf(edges[1:])) / mass
        moved = float(np.max(np.abs(new - c)))
        c = new
        if moved < tol:
            break
    c = (c - c[::-1]) / 2  # exact symmetry about 0
    edges = np.concatenate(([-np.inf], (c[:-1] + c[1:]) / 2, [np.inf]))
    mass = np.diff(norm.cdf(edges))
    mse = 1.0 - float(np.sum(mass * c * c))
    return [float(x) for x in c], mse


def compute_all() -> dict[str, list[float]]:
    """Every stored codebook, rounded to ``DIGITS`` significant digits."""
    return {str(b): [float(f"{x:.{DIGITS}g}") for x in lloyd_max(b)[0]] for b in BITS}


@cache
def _stored() -> dict[str, tuple[float, ...]]:
    doc = json.loads(DATA.read_text())
    return {k: tuple(v) for k, v in doc["unit_gaussian"].items()}


def unit_centroids(bits: int) -> tuple[float, ...]:
    """The stored unit-Gaussian codebook for ``bits`` (3 or 4), ascending.
    Raises ValueError for another width."""
    table = _stored()
    if str(bits) not in table:
        raise ValueError(f"unit_centroids: bits must be one of {BITS}, got {bits}")
    return table[str(bits)]


def centroids_for(bits: int, head_dim: int) -> tuple[float, ...]:
    """Codebook for coordinates distributed N(0, 1/head_dim): the unit one
    scaled by ``1 / sqrt(head_dim)``."""
    s = 1.0 / math.sqrt(head_dim)
    return tuple(x * s for x in unit_centroids(bits))


def matches_stored(tol: float = 1e-9) -> bool:
    """Does the generator reproduce the stored codebooks (every centroid
    within ``tol``)?"""
    fresh = compute_all()
    stored = _stored()
    return fresh.keys() == stored.keys() and all(
        len(fresh[k]) == len(stored[k]) and all(abs(a - b) <= tol for a, b in zip(fresh[k], stored[k]))
        for k in fresh
    )


def write() -> None:
    doc = {
        "about": "Lloyd-Max codebooks of the unit Gaussian (impl/codebooks.py); scale by 1/sqrt(d) for N(0, 1/d).",
        "unit_gaussian": compute_all(),
    }
    DATA.write_text(json.dumps(doc, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--check"]:
        same = matches_stored()
        print("codebooks.json matches the generator" if same else "codebooks.json differs from the generator")
        return 0 if same else 1
    if args:
        print("usage: python -m kvspec.impl.codebooks [--check]", file=sys.stderr)
        return 2
    write()
    for b in BITS:
        print(f"{b} bits: mse {lloyd_max(b)[1]:.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
