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
from spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError
from spec.layers import list_trim_count

Cache = KVCache | RotatingKVCache


def _convert(layer: int, c: Any, mode: str, step: int, inplace: bool | None,
             classes: dict[str, type] | None = None) -> Cache:
    """One of mlx-lm's per-layer caches -> the kvspec cache of the same kind
    (``classes`` maps a kind, ``"dense"`` or ``"rotating"``, to the class to
    build instead of ours: a subclass, e.g. an injected bug)."""
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
        return ring(max_size=c.max_size, keep=c.keep, step=step, inplace=inplace)
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

    Raises UnsupportedOperationError for a layer kind kvspec lacks (e.g. the
    ``ArraysCache`` of state-space layers) and for ``mode="int8"`` on a
    sliding-window layer; InvalidArgumentError for bad sizes.
    """
    if hasattr(model, "make_cache"):
        return [_convert(i, c, mode, step, inplace, classes) for i, c in enumerate(model.make_cache())]
    n_layers = len(model.layers)
    if max_kv_size is not None:
        if mode != "fp16":
            raise UnsupportedOperationError(
                f"make_prompt_cache: max_kv_size={max_kv_size} makes every layer a RotatingKVCache, "
                f"which supports mode 'fp16' only, got mode={mode!r}"
            )
        ring = (classes or {}).get("rotating", RotatingKVCache)
        return [ring(max_size=max_kv_size, keep=4, step=step, inplace=inplace) for _ in range(n_layers)]
    dense = (classes or {}).get("dense", KVCache)
    return [dense(mode=mode, step=step, inplace=inplace) for _ in range(n_layers)]


def _trimmable_rows(c: Any) -> int | None:
    """Rows one layer can give back by an exact trim (spec.layers.
    layer_trimmable_rows): a dense cache's live rows (a front trim moves
    live_start past rows the offset still counts), an unwrapped ring's
    offset; None when the layer cannot trim exactly."""
    if not c.is_trimmable():
        return None
    return int(c.live_len) if hasattr(c, "live_len") else int(c.offset)


def can_trim_prompt_cache(caches: Sequence[Any]) -> bool:
    """True when every layer can trim exactly (``is_trimmable()``) and the
    list is non-empty (spec.layers.can_trim_prompt_cache)."""
    return len(caches) > 0 and all(c.is_trimmable() for c in caches)


def trim_prompt_cache(caches: Sequence[Any], n: int) -> int:
    """Trim ``n`` tokens from the end of every layer, atomically
    (spec.layers.trim_prompt_cache, semantics.md 6).

    Every layer is trimmed by the same count, ``spec.layers.list_trim_count``:
    ``min(n, rows the layer with the fewest can give back)``, counted from
    live rows, and that count is returned. When any layer cannot trim
    exactly (``is_trimmable()`` is False: a sliding-window ring that has
    wrapped) nothing is trimmed in any layer and 0 is returned, so layers
    never disagree on the sequence they hold. ``n <= 0`` trims nothing.
    Raises InvalidArgumentError for a non-integer ``n``; StateError when a
    layer breaks its ``is_trimmable()`` promise.
    """
    n = _check_int("trim_prompt_cache", "n", n)
    count = list_trim_count(n, tuple(_trimmable_rows(c) for c in caches))
    if count == 0:
        return 0
    trimmed = [c.trim(count) for c in caches]
    if any(t != count for t in trimmed):
        # is_trimmable() promised an exact trim; a layer that trimmed a
        # different count breaks the protocol (nothing to undo it with).
        raise StateError(f"trim_prompt_cache: layers trimmed {trimmed}, expected {count} each")
    return count


def snapshot_prompt_cache(caches: Sequence[Any]) -> list[Any]:
    """A snapshot of every layer (each O(1): new handles to the same
    buffers), in layer order (spec.layers.w_snapshot)."""
    return [c.snapshot() for c in caches]


def restore_prompt_cache(caches: Sequence[Any], snapshots: Sequence[Any]) -> None:
    """Every layer adopts its snapshot, all or none (spec.layers.w_restore):
    a snapshot a layer refuses (wrong kind, shape, counters) leaves every
    layer as it was. Raises InvalidArgumentError for a list of another
    length and the layer's refusal otherwise."""
    if len(snapshots) != len(caches):
        raise InvalidArgumentError(
            f"restore_prompt_cache: snapshots must hold one per layer ({len(caches)}), got {len(snapshots)}"
        )
    backups = [c.snapshot() for c in caches]
    done = 0
    try:
        for c, snap in zip(caches, snapshots):
            c.restore(snap)
            done += 1
    except Exception:
        for c, backup in zip(caches[:done], backups[:done]):
            c.restore(backup)
        raise


__all__ = [
    "can_trim_prompt_cache",
    "make_prompt_cache",
    "restore_prompt_cache",
    "snapshot_prompt_cache",
    "trim_prompt_cache",
]
