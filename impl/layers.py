"""A prompt cache as a list of layers: the list-level operations
(spec: ``kvspec.spec.layers``, semantics.md 6).

Every function takes the list of per-layer caches a model uses (dense
:class:`~kvspec.impl.dense.KVCache`, sliding-window
:class:`~kvspec.impl.rotating.RotatingKVCache` and recurrent
:class:`~kvspec.impl.recurrent.RecurrentCache`, mixed) and applies one operation to
all of them at once. :func:`trim_prompt_cache` is the rollback of
speculative decoding and of prompt-cache reuse; it is atomic: when one layer
cannot trim exactly (a ring that has wrapped) no layer is trimmed and 0 is
returned (a ring with an undo log trims exactly within its depth after a
wrap). mlx-lm's own ``trim_prompt_cache`` is also all-or-nothing, but
returns the first layer's count, which hides a layer that trimmed fewer rows.
:func:`kvspec.impl.models.make_prompt_cache` builds such a list for an mlx-lm model.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

from kvspec.impl.dense import _check_int
from kvspec.spec.errors import InvalidArgumentError, RollbackWarning, StateError


def _trim_bounds(c: Any) -> tuple[int, int]:
    """``(rows, exact)`` of one layer (kvspec.spec.layers.layer_trim_bounds): a
    dense cache's live rows, both (a front trim moves live_start past rows
    the offset still counts); a ring's offset, and ``trimmable_rows()`` (the
    offset while unwrapped, what its undo log covers after a wrap); a
    recurrent layer's (:class:`~kvspec.impl.recurrent.RecurrentCache`) offset and
    its coverage ``trimmable_rows()`` (the tokens its checkpoints can take
    back), the same rule as a ring's (kvspec.spec.recurrent.trimmable_rows)."""
    if hasattr(c, "live_len"):
        return int(c.live_len), int(c.live_len)
    if hasattr(c, "trimmable_rows"):
        return int(c.offset), int(c.trimmable_rows())
    return int(c.offset), int(c.offset) if c.is_trimmable() else 0


def _is_recurrent_layer(c: Any) -> bool:
    """A recurrent layer: it has a checkpoint ``depth`` and no window."""
    return hasattr(c, "depth") and not hasattr(c, "max_size")


def _why_refused(c: Any) -> str:
    """Why a layer cannot roll back exactly: a recurrent layer beyond its
    checkpoints' coverage (or at offset 0: it counted none of the tokens
    the other layers hold), else a ring past its window."""
    if _is_recurrent_layer(c):
        if not c.offset:
            return ("a recurrent layer at offset 0 beside layers that hold rows (it counted no tokens: a model "
                    "that never calls cache.advance, e.g. recurrent_gemma, run without the step recorder "
                    "kvspec.impl.recurrent.record_steps, which kvspec.impl.models.make_prompt_cache installs)")
        return "a recurrent layer beyond its checkpoints' coverage"
    return "a sliding-window ring wrapped beyond its undo log"


def can_trim_prompt_cache(caches: Sequence[Any]) -> bool:
    """True when every layer can trim exactly (``is_trimmable()``) and the
    list is non-empty (kvspec.spec.layers.can_trim_prompt_cache). Stops at the
    first layer that answers False; a ring answering False warns
    (RollbackWarning, once per cache: its first refused rollback,
    :meth:`kvspec.impl.rotating.RotatingKVCache.is_trimmable`)."""
    return len(caches) > 0 and all(c.is_trimmable() for c in caches)


def _list_trim_count(n: int, bounds: Sequence[tuple[int, int]]) -> int:
    """The count every layer trims for a request of ``n`` given each layer's
    ``(rows, exact)``: ``min(n, every layer's rows)``, or 0 (no layer trims)
    when ``n <= 0``, the list is empty, or that count is beyond some
    layer's exact bound. The rule of kvspec.spec.layers.list_trim_count, written
    here on its own (impl never calls the spec it is checked against)."""
    if n <= 0 or not bounds:
        return 0
    count = min(n, *(rows for rows, _ in bounds))
    return count if all(exact >= count for _, exact in bounds) else 0


def trim_prompt_cache(caches: Sequence[Any], n: int, strict: bool = False) -> int:
    """Trim ``n`` tokens from the end of every layer, atomically
    (kvspec.spec.layers.trim_prompt_cache, semantics.md 6).

    Every layer is trimmed by the same count, ``kvspec.spec.layers.list_trim_count``:
    ``min(n, every layer's rows)``, counted from a dense layer's live rows,
    and that count is returned. When the count is beyond some layer's exact
    bound (a sliding-window ring that has wrapped beyond its undo depth, or
    has no undo log; a recurrent layer beyond its checkpoints' coverage)
    nothing is trimmed in any layer and 0 is returned, so
    layers never disagree on the sequence they hold. ``n <= 0`` trims
    nothing. Raises InvalidArgumentError for a non-integer ``n``. A layer
    that refuses late, after the layers before it trimmed (its ``trim``
    raises, or trims another count than its bounds promised: StateError),
    leaves every layer exactly as it was (kvspec.spec.layers.w_trim_refused_late).

    A recurrent layer at offset 0 beside layers that hold rows counted
    none of the tokens it consumed (its bound is unknown): the trim is
    refused like one beyond its coverage, never a silent 0.

    A refusal is loud: each layer that cannot honour the rollback warns once
    per cache (``kvspec.spec.errors.RollbackWarning``), and with ``strict=True``
    the refusal raises StateError naming those layers instead (nothing
    trimmed either way).
    """
    n = _check_int("trim_prompt_cache", "n", n)
    if not isinstance(strict, bool):
        raise InvalidArgumentError(f"trim_prompt_cache: strict must be True or False, got {strict!r}")
    bounds = tuple(_trim_bounds(c) for c in caches)
    count = _list_trim_count(n, bounds)
    if count == 0:
        want = min([n, *(rows for rows, _ in bounds)])
        # a layer refuses when it cannot roll back ``want`` rows exactly
        # (every exact bound is >= 0, so a refusal has want > 0)
        refusing = [i for i, (_, exact) in enumerate(bounds) if want > exact]
        if want == 0 and n > 0 and any(rows for rows, _ in bounds):
            # a recurrent layer at offset 0 beside layers that hold rows has
            # not counted the tokens it consumed (a model that never calls
            # cache.advance, run without the step recorder): its bound is
            # unknown, so the trim is refused loudly, never a silent 0
            want = min(n, max(rows for rows, _ in bounds))
            refusing = [i for i, (rows, _) in enumerate(bounds) if rows == 0 and _is_recurrent_layer(caches[i])]
        if refusing:
            if strict:
                why = sorted({_why_refused(caches[i]) for i in refusing}, reverse=True)
                raise StateError(
                    f"trim_prompt_cache: cannot roll back {want} rows exactly: layer(s) {refusing} can roll back "
                    f"{[bounds[i][1] for i in refusing]} ({'; '.join(why)}); "
                    "nothing was trimmed"
                )
            for i in refusing:
                warn = getattr(caches[i], "warn_refused_rollback", None)
                if warn is not None:
                    warn(want)
                else:
                    warnings.warn(f"trim_prompt_cache: layer {i} cannot roll back {want} rows exactly; "
                                  "nothing was trimmed", RollbackWarning, stacklevel=2)
        return 0
    # a layer may still refuse late (its trim raises, or gives back another
    # count than its bounds promised) after the layers before it trimmed:
    # then every layer goes back to exactly what it was (kvspec.spec.layers.w_trim_refused_late)
    saved = [_fields(c) for c in caches]
    done = 0
    try:
        for c in caches:
            got = c.trim(count)
            if got != count:
                raise StateError(f"trim_prompt_cache: layer {done} trimmed {got} rows, expected {count} "
                                 "(it broke its promise of an exact trim); nothing was trimmed in any layer")
            done += 1
    except BaseException:
        for c, fields in zip(caches[: done + 1], saved):
            _put_back(c, fields)
        raise
    return count


def _fields(c: Any) -> dict[str, Any]:
    """A layer's fields as they are (a shallow copy of ``vars(c)``): what
    :func:`_put_back` restores when a later layer refuses its trim. Exact
    for kvspec caches, whose trims only reassign fields and never write into
    memory in place (a dense trim moves the offset; a ring's rollback writes
    its saved rows through copies), so the old field values still hold the
    old contents, ownership marker and undo log."""
    return dict(vars(c))


def _put_back(c: Any, fields: dict[str, Any]) -> None:
    state = vars(c)
    state.clear()
    state.update(fields)


def copy_prompt_cache(caches: Sequence[Any], deep: bool = True) -> list[Any]:
    """A copy of every layer, as a prompt-cache store keeps one: ``deep``,
    ``copy.deepcopy`` of the list (one memo for every layer, as mlx-lm's
    ``LRUPromptCache`` deep-copies a stored prompt cache on every fetch);
    else ``copy.copy`` of each layer. Each layer's copy shares its buffers
    (O(1) per layer) and owns nothing, so its first write copies and never
    reaches the original's rows (kvspec.spec.layers.w_copy). ``copy.copy`` of the
    list itself is not a copy of the prompt cache: both lists would hold the
    same layer objects. Raises InvalidArgumentError for a ``deep`` that is
    not a bool."""
    if not isinstance(deep, bool):
        raise InvalidArgumentError(f"copy_prompt_cache: deep must be True or False, got {deep!r}")
    if deep:
        return copy.deepcopy(list(caches))
    return [copy.copy(c) for c in caches]


def snapshot_prompt_cache(caches: Sequence[Any]) -> list[Any]:
    """A snapshot of every layer (each O(1): new handles to the same
    buffers), in layer order (kvspec.spec.layers.w_snapshot)."""
    return [c.snapshot() for c in caches]


def restore_prompt_cache(caches: Sequence[Any], snapshots: Sequence[Any]) -> None:
    """Every layer adopts its snapshot, all or none (kvspec.spec.layers.w_restore,
    kvspec.spec.layers.w_restore_mixed): a snapshot a layer refuses (wrong kind,
    shape, counters) leaves every layer exactly as it was (each layer's
    check runs before any layer changes; a failure past the checks rolls
    the earlier layers back). Raises InvalidArgumentError for a list of another
    length and the layer's refusal otherwise."""
    if len(snapshots) != len(caches):
        raise InvalidArgumentError(
            f"restore_prompt_cache: snapshots must hold one per layer ({len(caches)}), got {len(snapshots)}"
        )
    # every layer's own check first, before any layer changes: a refusal
    # then leaves every layer exactly as it was (its ownership of its
    # buffers and a ring's undo log included, which a rollback through
    # restore would drop)
    for c, snap in zip(caches, snapshots):
        check = getattr(c, "_check_holder", None) or getattr(c, "_check_snapshot", None)
        if check is not None:
            check("restore", snap)
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


__all__ = ["can_trim_prompt_cache", "copy_prompt_cache", "restore_prompt_cache", "snapshot_prompt_cache", "trim_prompt_cache"]
