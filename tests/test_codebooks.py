"""The Turbo codebooks: the stored data is what the Lloyd-Max generator
produces, and its distortion is the known Lloyd-Max optimum."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
from scipy import integrate
from scipy.stats import norm

from kvspec.impl import codebooks

# Mean-squared error of the optimal (Lloyd-Max) quantizer of the unit
# Gaussian, from Max (1960), Table I.
KNOWN_MSE = {3: 0.03455, 4: 0.009497}


def gaussian_mse(centroids: tuple[float, ...]) -> float:
    """E[(X - q(X))^2] for X ~ N(0, 1) and q the nearest centroid,
    integrated numerically cell by cell (independent of the generator's
    closed form)."""
    edges = [-math.inf, *((a + b) / 2 for a, b in pairwise(centroids)), math.inf]
    total = 0.0
    for c, lo, hi in zip(centroids, edges, edges[1:]):
        total += integrate.quad(lambda x, c=c: (x - c) ** 2 * norm.pdf(x), lo, hi, epsabs=1e-13)[0]
    return total


@pytest.mark.parametrize("bits", [3, 4])
def test_stored_codebook_is_within_one_percent_of_lloyd_max(bits):
    c = codebooks.unit_centroids(bits)
    assert len(c) == 2 ** bits
    assert list(c) == sorted(c)
    assert all(abs(a + b) < 1e-12 for a, b in zip(c, reversed(c)))  # symmetric
    mse = gaussian_mse(c)
    assert abs(mse - KNOWN_MSE[bits]) / KNOWN_MSE[bits] < 0.01, mse


def test_the_generator_reproduces_the_stored_values():
    assert codebooks.matches_stored()
    assert codebooks.main(["--check"]) == 0


def test_a_perturbed_codebook_is_detected(monkeypatch):
    stored = dict(codebooks._stored())
    bad = list(stored["4"])
    bad[3] += 1e-6
    monkeypatch.setattr(codebooks, "_stored", lambda: {**stored, "4": tuple(bad)})
    assert not codebooks.matches_stored()


def test_a_naive_uniform_codebook_misses_the_optimum():
    # the check has teeth: uniform levels on [-2, 2] are well above 1% off
    uniform = tuple(-2 + 4 * (i + 0.5) / 8 for i in range(8))
    assert abs(gaussian_mse(uniform) - KNOWN_MSE[3]) / KNOWN_MSE[3] > 0.01


def test_scaled_codebook_and_bad_width():
    d = 64
    assert codebooks.centroids_for(4, d) == tuple(x / 8 for x in codebooks.unit_centroids(4))
    with pytest.raises(ValueError, match="bits must be one of"):
        codebooks.unit_centroids(5)
    with pytest.raises(ValueError, match="bits must be >= 1"):
        codebooks.lloyd_max(0)
