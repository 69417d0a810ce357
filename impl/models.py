"""kvspec caches for mlx-lm models: per-layer prompt caches and list-level trims.

mlx-lm models take a list with one cache per layer (``model(x, cache=...)``,
``generate_step(..., prompt_cache=...)``). :func:`make_prompt_cache` builds
that list from kvspec caches, laid out the way mlx-lm lays out its own:
full-attention layers get a dense :class:`~impl.dense.KVCache`,
sliding-window layers a :class:`~impl.rotating.RotatingKVCache` with the
layer's window.

The list-level operations (:func:`trim_prompt_cache`,
:func:`can_trim_prompt_cache`, :func:`snapshot_prompt_cache`,
:func:`restore_prompt_cache`) live in :mod:`impl.layers` (spec:
``spec.layers``) and are re-exported here.

mlx-lm is an optional dependency (``pip install 'kvspec[e2e]'``); it is
imported only when a model defines ``make_cache``.
"""

from __future__ import annotations

from typing import Any

from impl.dense import KVCache
from impl.layers import (
    can_trim_prompt_cache,
    restore_prompt_cache,
    snapshot_prompt_cache,
    trim_prompt_cache,
)
from impl.rotating import RotatingKVCache
from spec.errors import UnsupportedOperationError

Cache = KVCache | RotatingKVCache


def _convert(layer: int, c: Any, mode: str, step: int, inplace: bool | None,
             classes: dict[str, type] | None = None, undo: int = 0) -> Cache:
    """One of mlx-lm's per-layer caches -> the kvspec cache of the same kind
    (``classes`` maps a kind, ``"dense"`` or ``"rotating"``, to the class to
    build instead of ours: a subclass, e.g. an injected bug; ``undo`` is a
    ring's undo depth)."""
    from mlx_lm.models import cache as lm_cache

    classes = classes or {}
    # RotatingKVCache before KVCache: check exact kinds, not a subclass chain.
    if type(c) is lm_cache.RotatingKVCache:
        if mode != "fp16":
            raise UnsupportedOperationError(
                f"make_prompt_cache: layer {layer} is a sliding-window layer (max_size={c.max_size}); "
                f"its RotatingKVCache supports mode 'fp16' only, got mode={mode!r}"
            )
        ring = classes.get("rotating", RotatingKVCache)
        return ring(max_size=c.max_size, keep=c.keep, step=step, inplace=inplace, undo=undo)
    if type(c) is lm_cache.KVCache:
        return classes.get("dense", KVCache)(mode=mode, step=step, inplace=inplace)
    raise UnsupportedOperationError(
        f"make_prompt_cache: layer {layer} needs a {type(c).__name__}, which kvspec does not implement "
        "(supported: full-attention KVCache and sliding-window RotatingKVCache layers)"
    )


def make_prompt_cache(
    model: Any,
    mode: str = "fp16",
    step: int = 256,
    inplace: bool | None = None,
    max_kv_size: int | None = None,
    classes: dict[str, type] | None = None,
    undo: int = 0,
) -> list[Cache]:
    """One kvspec cache per layer of an mlx-lm ``model``, laid out as
    ``mlx_lm.models.cache.make_prompt_cache`` lays out mlx-lm's caches.

    When the model defines ``make_cache()`` (models with sliding-window
    layers, e.g. gemma3, llama with ``layer_types``), each layer's cache kind
    and window come from it: ``KVCache`` -> dense :class:`KVCache`,
    ``RotatingKVCache(max_size, keep)`` -> :class:`RotatingKVCache` with the
    same window and sinks. Otherwise every layer gets a dense cache, or, with
    ``max_kv_size``, a ring of that size with 4 sinks (mlx-lm's choice;
    like mlx-lm, ``max_kv_size`` is ignored when the model has
    ``make_cache``).

    Args:
        model: an mlx-lm model (anything with ``layers``, or ``make_cache``).
        mode: dense layers' storage, ``"fp16"`` or ``"int8"``.
        step: growth granularity in rows, for every layer.
        inplace: the in-place write switch; ``None`` reads ``KV_INPLACE_WRITE``.
        max_kv_size: window of every layer's ring when the model has no
            ``make_cache``.
        classes: ``{"dense": cls, "rotating": cls}`` to build subclasses of
            ours instead (the injected-bug catalog's classes); default ours.
        undo: every ring's undo depth U (rows a trim can take back after a
            wrap; 0: none).

    Raises UnsupportedOperationError for a layer kind kvspec lacks (e.g. the
    ``ArraysCache`` of state-space layers) and for ``mode="int8"`` on a
    sliding-window layer; InvalidArgumentError for bad sizes.
    """
    if hasattr(model, "make_cache"):
        return [_convert(i, c, mode, step, inplace, classes, undo) for i, c in enumerate(model.make_cache())]
    n_layers = len(model.layers)
    if max_kv_size is not None:
        if mode != "fp16":
            raise UnsupportedOperationError(
                f"make_prompt_cache: max_kv_size={max_kv_size} makes every layer a RotatingKVCache, "
                f"which supports mode 'fp16' only, got mode={mode!r}"
            )
        ring = (classes or {}).get("rotating", RotatingKVCache)
        return [ring(max_size=max_kv_size, keep=4, step=step, inplace=inplace, undo=undo) for _ in range(n_layers)]
    dense = (classes or {}).get("dense", KVCache)
    return [dense(mode=mode, step=step, inplace=inplace) for _ in range(n_layers)]


__all__ = [
    "can_trim_prompt_cache",
    "make_prompt_cache",
    "restore_prompt_cache",
    "snapshot_prompt_cache",
    "trim_prompt_cache",
]
