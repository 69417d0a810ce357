"""kvspec caches for mlx-lm models: per-layer prompt caches and list-level trims.

mlx-lm models take a list with one cache per layer (``model(x, cache=...)``,
``generate_step(..., prompt_cache=...)``). :func:`make_prompt_cache` builds
that list from kvspec caches, laid out the way mlx-lm lays out its own:
full-attention layers get a dense :class:`~impl.dense.KVCache`,
sliding-window layers a :class:`~impl.rotating.RotatingKVCache` with the
layer's window.

:func:`trim_prompt_cache` is the rollback of speculative decoding and of
prompt-cache reuse, applied to every layer at once. It is atomic
(semantics.md 5, property 5): when one layer cannot trim exactly (a
sliding-window ring that has wrapped, semantics.md 3 "Trim") it trims
nothing in any layer and returns 0. mlx-lm's own ``trim_prompt_cache`` is
also all-or-nothing, but returns the first layer's count, which hides a
layer that trimmed fewer rows.

mlx-lm is an optional dependency (``pip install 'kvspec[e2e]'``); it is
imported only when a model defines ``make_cache``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from impl.dense import KVCache, _check_int
from impl.rotating import RotatingKVCache
from impl.turbo import DelegatedKVCache, TurboKVCache, make_cache
from spec.errors import StateError, UnsupportedOperationError

Cache = KVCache | RotatingKVCache | TurboKVCache | DelegatedKVCache


def _dense(mode: str, step: int, inplace: bool | None, classes: dict[str, type] | None,
           kw: dict[str, Any]) -> Cache:
    """A dense-kind cache in ``mode``: ``classes["dense"]`` when given (it
    must take the mode), else :func:`impl.turbo.make_cache`."""
    cls = (classes or {}).get("dense")
    if cls is None:
        return make_cache(mode, step=step, inplace=inplace, **kw)
    return cls(mode=mode, step=step, inplace=inplace, **kw)


def _convert(layer: int, c: Any, mode: str, step: int, inplace: bool | None,
             classes: dict[str, type] | None = None, undo: int = 0, **kw: Any) -> Cache:
    """One of mlx-lm's per-layer caches -> the kvspec cache of the same kind
    (``classes`` maps a kind, ``"dense"`` or ``"rotating"``, to the class to
    build instead of ours: a subclass, e.g. an injected bug; ``undo`` is a
    ring's undo depth; ``kw``: the Delegated mode's ``hot_threshold`` and
    ``fold_block``)."""
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
        return _dense(mode, step, inplace, classes, kw)
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
    **kw: Any,
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
        mode: dense layers' storage: ``"fp16"``, ``"int8"``, ``"turbo4asym"``,
            ``"turbo4"``, ``"turbo3asym"`` or ``"turbo4delegated"``
            (:func:`impl.turbo.make_cache`).
        step: growth granularity in rows, for every layer.
        inplace: the in-place write switch; ``None`` reads ``KV_INPLACE_WRITE``.
        max_kv_size: window of every layer's ring when the model has no
            ``make_cache``.
        classes: ``{"dense": cls, "rotating": cls}`` to build subclasses of
            ours instead (the injected-bug catalog's classes); default ours
            (:func:`impl.turbo.make_cache` for the dense modes).
        undo: every ring's undo depth U (rows a trim can take back after a
            wrap; 0: none).
        **kw: ``hot_threshold``, ``fold_block`` for ``turbo4delegated``.

    Raises UnsupportedOperationError for a layer kind kvspec lacks (e.g. the
    ``ArraysCache`` of state-space layers) and for ``mode="int8"`` on a
    sliding-window layer; InvalidArgumentError for bad sizes.
    """
    if hasattr(model, "make_cache"):
        return [_convert(i, c, mode, step, inplace, classes, undo, **kw) for i, c in enumerate(model.make_cache())]
    n_layers = len(model.layers)
    if max_kv_size is not None:
        if mode != "fp16":
            raise UnsupportedOperationError(
                f"make_prompt_cache: max_kv_size={max_kv_size} makes every layer a RotatingKVCache, "
                f"which supports mode 'fp16' only, got mode={mode!r}"
            )
        ring = (classes or {}).get("rotating", RotatingKVCache)
        return [ring(max_size=max_kv_size, keep=4, step=step, inplace=inplace, undo=undo) for _ in range(n_layers)]
    return [_dense(mode, step, inplace, classes, kw) for _ in range(n_layers)]


def _trimmable_rows(c: Any) -> int:
    """Rows a trimmable cache can give back: the live rows of a dense cache
    (a front trim moves live_start), the offset of an unwrapped ring."""
    return int(c.live_len) if hasattr(c, "live_len") else int(c.offset)


def can_trim_prompt_cache(caches: Sequence[Any]) -> bool:
    """True when every layer can trim exactly (``is_trimmable()``) and the
    list is non-empty."""
    return len(caches) > 0 and all(c.is_trimmable() for c in caches)


def trim_prompt_cache(caches: Sequence[Any], n: int) -> int:
    """Trim ``n`` tokens from the end of every layer, atomically.

    Every layer is trimmed by the same count: ``min(n, rows the shortest
    layer can give back)``, and that count is returned. When any layer cannot
    trim exactly (``is_trimmable()`` is False, or the count is beyond a
    ring's ``trimmable_rows()``: a wrapped ring beyond its undo depth)
    nothing is trimmed in any layer and 0 is returned, so layers
    never disagree on the sequence they hold. ``n <= 0`` trims nothing.
    Raises InvalidArgumentError for a non-integer ``n``; StateError when a
    layer breaks its ``is_trimmable()`` promise.
    """
    n = _check_int("trim_prompt_cache", "n", n)
    if n <= 0 or not can_trim_prompt_cache(caches):
        return 0
    count = min(n, *(_trimmable_rows(c) for c in caches))
    if count == 0 or any(count > c.trimmable_rows() for c in caches if hasattr(c, "trimmable_rows")):
        return 0  # a ring beyond its undo depth refuses for the whole list (semantics.md 6)
    trimmed = [c.trim(count) for c in caches]
    if any(t != count for t in trimmed):
        # is_trimmable() promised an exact trim; a layer that trimmed a
        # different count breaks the protocol (nothing to undo it with).
        raise StateError(f"trim_prompt_cache: layers trimmed {trimmed}, expected {count} each")
    return count


__all__ = ["can_trim_prompt_cache", "make_prompt_cache", "trim_prompt_cache"]
