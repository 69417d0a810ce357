"""Elementwise chains run as one kernel on CUDA (``mx.compile``, shapeless).

Why: a quantized cache hands attention a float window, so every append
dequantizes every live row (``T`` rows of ``D`` coordinates per head, K and
V, every layer, every step: work proportional to the context). Run op by
op, a chain of ``k`` elementwise ops is ``k`` kernel launches and ``k``
round trips of a window-sized intermediate through device memory (float32
for most of them). Compiled, the chain is one kernel that reads its inputs
once and writes its output once. On MLX's CUDA backend that is where a
Turbo4 decode step's time went (a 32k context cost 3.6 times a 1k one).

Same bytes, fused or not: :func:`elementwise` takes only chains of
elementwise ops without additions of products (so no multiply-add can be
contracted into one rounding); the fused kernel applies the same ops, in
the same order, in the same dtypes, and MLX's CUDA JIT compiles with the
IEEE defaults (correctly rounded division and square root, subnormals
kept). tests/test_quantized_window.py compares the two paths byte for byte.

Where: only on ``cuda`` (:func:`kvspec.impl.write.backend`). On the CPU, MLX
compiles a fused chain with the system C++ compiler at run time (a machine
without one would fail), and the per-op cost that fusion removes is a GPU
cost; Metal (Apple GPUs) cannot be built or tested where this project is
developed, so it keeps the op-by-op chain too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kvspec.impl import write

#: Fuse on CUDA (True, the default). ``tools/gpu_profile.py`` turns it off
#: for its op-by-op rows, to measure what fusion changes in one run.
ENABLED = True


class Elementwise:
    """``fn`` (arrays -> array, elementwise ops only) callable as ``fn``
    itself: fused into one kernel on CUDA, op by op elsewhere (module
    docstring). ``eager`` and ``fused`` are the two forms."""

    def __init__(self, fn: Callable[..., mx.array]):
        self.eager = fn
        self.fused = mx.compile(fn, shapeless=True)
        self.__name__ = getattr(fn, "__name__", "elementwise")

    def __call__(self, *arrays: Any) -> mx.array:
        return (self.fused if ENABLED and write.backend() == "cuda" else self.eager)(*arrays)


def elementwise(fn: Callable[..., mx.array]) -> Elementwise:
    """Decorator form of :class:`Elementwise`."""
    return Elementwise(fn)
