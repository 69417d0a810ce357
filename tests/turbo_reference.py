"""An independent NumPy reference of the Turbo quantizer (semantics.md 2,
"Turbo modes"), written from the rule, not from impl/turbo_quant.py:
an explicit Hadamard matrix (scipy.linalg.hadamard), nearest centroid by
argmin of distances, packing bit by bit in Python integers, float64
arithmetic throughout."""

from __future__ import annotations

import numpy as np
from scipy.linalg import hadamard

from impl.codebooks import unit_centroids

MASK64 = (1 << 64) - 1


def signs(count: int, seed: int) -> np.ndarray:
    """LCG x <- 6364136223846793005 x + 1442695040888963407 (mod 2^64);
    sign -1 when the top bit of the new state is set."""
    out, x = [], seed & MASK64
    for _ in range(count):
        x = (6364136223846793005 * x + 1442695040888963407) & MASK64
        out.append(-1.0 if x >= 1 << 63 else 1.0)
    return np.array(out)


def rotation(d: int, seed: int) -> np.ndarray:
    """The d x d matrix D2 H D1."""
    s = signs(2 * d, seed)
    h = hadamard(d) / np.sqrt(d)
    return np.diag(s[d:]) @ h @ np.diag(s[:d])


def pack(idx: np.ndarray, bits: int) -> np.ndarray:
    """One row of indices -> bytes."""
    idx = [int(i) for i in idx]
    if bits == 4:
        return np.array([idx[i] | (idx[i + 1] << 4) for i in range(0, len(idx), 2)], dtype=np.uint8)
    out = []
    for g in range(0, len(idx), 8):
        word = 0
        for j in range(8):
            word |= idx[g + j] << (3 * j)
        out += [word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF]
    return np.array(out, dtype=np.uint8)


def unpack(packed: np.ndarray, bits: int, d: int) -> np.ndarray:
    b = [int(x) for x in packed]
    if bits == 4:
        return np.array([(b[i // 2] >> (4 * (i % 2))) & 0xF for i in range(d)])
    out = []
    for g in range(0, len(b), 3):
        word = b[g] | (b[g + 1] << 8) | (b[g + 2] << 16)
        out += [(word >> (3 * j)) & 7 for j in range(8)]
    return np.array(out)


def quantize_row(x: np.ndarray, bits: int, seed: int) -> tuple[np.ndarray, float, float | None]:
    """(packed bytes, norm, rescale or None) of one row."""
    d = x.shape[-1]
    x = x.astype(np.float64)
    norm = float(np.sqrt(np.sum(x * x)))
    u = x / (norm if norm != 0 else 1.0)
    y = rotation(d, seed) @ u
    c = np.array(unit_centroids(bits)) / np.sqrt(d)
    idx = np.argmin(np.abs(y[:, None] - c[None, :]), axis=1)
    rescale = norm / float(np.linalg.norm(c[idx])) if bits == 4 else None
    return pack(idx, bits), norm, rescale


def dequantize_row(packed: np.ndarray, norm: float, bits: int, seed: int, d: int) -> np.ndarray:
    c = np.array(unit_centroids(bits)) / np.sqrt(d)
    y_hat = c[unpack(packed, bits, d)]
    y_hat = y_hat / np.linalg.norm(y_hat) * norm
    return rotation(d, seed).T @ y_hat


def roundtrip(x: np.ndarray, bits: int, seed: int) -> np.ndarray:
    """Quantize and dequantize every row of ``x`` [..., d] (float64)."""
    d = x.shape[-1]
    flat = x.reshape(-1, d)
    out = np.empty(flat.shape)
    for i, row in enumerate(flat):
        packed, norm, _ = quantize_row(row, bits, seed)
        out[i] = dequantize_row(packed, norm, bits, seed, d)
    return out.reshape(x.shape)
