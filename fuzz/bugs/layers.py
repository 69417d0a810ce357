"""Injected bugs of the prompt cache as a list of layers (``kvspec.impl.layers``'
list-level operations, driven by ``kvspec.fuzz.layers.ListOps``).

See ``fuzz/bugs/__init__.py`` for the catalog and the entry type.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx

from kvspec.fuzz.bugs import InjectedBug
from kvspec.fuzz.layers import ListOps
from kvspec.impl.layers import _fields, _list_trim_count, _put_back, _trim_bounds
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec.errors import StateError


class TrimsLayersThenRefuses(ListOps):
    """The list trim walks the layers in order and trims each one that can
    trim, then returns 0 when a later layer (a wrapped ring) cannot: the
    dense layers are trimmed, the ring is not, and the caller is told that
    nothing happened."""

    def trim(self, caches: list[Any], n: int) -> int:
        if n <= 0:
            return 0
        count = min(n, *(c.live_len if hasattr(c, "live_len") else c.offset for c in caches))
        for c in caches:
            if not c.is_trimmable():
                return 0
            c.trim(count)
        return count


class TrimCountFromOffset(ListOps):
    """The count every layer trims is taken from the offsets, not from the
    rows each layer can give back: after a dense layer's front trim the
    count exceeds its live rows, the rings trim it, the dense layer trims
    fewer (and the protocol check raises with some layers already trimmed)."""

    def trim(self, caches: list[Any], n: int) -> int:
        if n <= 0 or not all(c.is_trimmable() for c in caches):
            return 0
        count = min(n, *(c.offset for c in caches))
        trimmed = [c.trim(count) for c in caches]
        return trimmed[0]


class TrimIgnoresRecurrentCoverage(ListOps):
    """The list trim bounds a recurrent layer by ``is_trimmable()`` and its
    offset (as mlx-lm's ``trim_prompt_cache`` and a ring's bounds do), not
    by its coverage, and trims the layers one by one: past a recurrent
    layer's checkpoints the attention layers before it roll back, then the
    recurrent layer refuses (StateError) and the list is left split."""

    def trim(self, caches: list[Any], n: int) -> int:
        if n <= 0 or not all(c.is_trimmable() for c in caches):
            return 0
        count = min(n, *(c.live_len if hasattr(c, "live_len") else c.offset for c in caches))
        ring_bounds = [c.trimmable_rows() for c in caches if isinstance(c, RotatingKVCache)]
        if count <= 0 or any(b < count for b in ring_bounds):
            return 0
        for c in caches:
            c.trim(count)
        return count


class RestoreWithoutRollback(ListOps):
    """The list restore walks the layers in order and lets a layer's
    refusal propagate: the layers before the refusing one keep the
    snapshot they adopted, the later ones do not, and the caller sees an
    error as if nothing had happened."""

    def restore(self, caches: list[Any], snapshots: list[Any]) -> None:
        for c, snap in zip(caches, snapshots):
            c.restore(snap)


class RingsGetLayerStep(ListOps):
    """``make_prompt_cache`` building the sliding-window layers with the
    step of mlx-lm's own layer cache (``RotatingKVCache.step``, 256), not
    the ``step`` argument: one layer kind gets a wrong setting, the
    full-attention layers are right."""

    def make_prompt_cache(self, model: Any, **kw: Any) -> list[Any]:
        from kvspec.impl.rotating import RotatingKVCache

        caches = super().make_prompt_cache(model, **kw)
        return [type(c)(max_size=c.max_size, keep=c.keep, step=256, inplace=c.inplace, undo=c.undo)
                if isinstance(c, RotatingKVCache) else c for c in caches]


class LoadIgnoresInplace(ListOps):
    """A prompt-cache load that leaves each layer's in-place switch to the
    loading process's ``KV_INPLACE_WRITE`` (the line restoring the file's
    ``inplace`` missing): a list saved with the switch off writes in place
    once loaded where the variable is unset or on."""

    def load_prompt_cache(self, file: Any) -> list[Any]:
        from kvspec.impl.dense import inplace_switch_from_env

        caches = super().load_prompt_cache(file)
        for c in caches:
            if hasattr(c, "inplace"):
                c.inplace = inplace_switch_from_env()
        return caches


class TrimWithoutRollback(ListOps):
    """The list trim as it was before late refusals were fuzzed: the count
    is checked against every layer's bounds up front, then each layer
    trims in turn, and a layer that refuses late (its trim raises, or gives
    back another count) leaves the layers before it trimmed."""

    def trim(self, caches: list[Any], n: int) -> int:
        bounds = tuple(_trim_bounds(c) for c in caches)
        count = _list_trim_count(n, bounds)
        if count == 0:
            return 0
        trimmed = [c.trim(count) for c in caches]
        if any(t != count for t in trimmed):
            raise StateError(f"trim_prompt_cache: layers trimmed {trimmed}, expected {count} each")
        return count


class TrimPutBackSkipsRefuser(ListOps):
    """The list trim's put-back after a late refusal is off by one: it puts
    back the layers that trimmed and returned the count (``caches[:done]``)
    but not the refusing layer itself, which may have changed before it
    raised (a layer that trims its rows, then fails)."""

    def trim(self, caches: list[Any], n: int) -> int:
        bounds = tuple(_trim_bounds(c) for c in caches)
        count = _list_trim_count(n, bounds)
        if count == 0:
            return 0
        saved = [_fields(c) for c in caches]
        done = 0
        try:
            for c in caches:
                if c.trim(count) != count:
                    raise StateError(f"trim_prompt_cache: layer {done} broke its promise of an exact trim")
                done += 1
        except BaseException:
            for c, fields in zip(caches[:done], saved):
                _put_back(c, fields)
            raise
        return count


class TrimAcceptsOvertrim(ListOps):
    """The list trim checks a layer's count with ``<``, not ``!=``: a layer
    whose trim reports more rows than asked (a broken promise, as much as
    fewer) goes through, and the list trim succeeds where the rule refuses
    and puts every layer back."""

    def trim(self, caches: list[Any], n: int) -> int:
        bounds = tuple(_trim_bounds(c) for c in caches)
        count = _list_trim_count(n, bounds)
        if count == 0:
            return 0
        saved = [_fields(c) for c in caches]
        done = 0
        try:
            for c in caches:
                if c.trim(count) < count:
                    raise StateError(f"trim_prompt_cache: layer {done} broke its promise of an exact trim")
                done += 1
        except BaseException:
            for c, fields in zip(caches[: done + 1], saved):
                _put_back(c, fields)
            raise
        return count


class CopyListNotLayers(ListOps):
    """The prompt-cache store copies the list, not its layers
    (``copy.copy(prompt_cache)`` / ``list(prompt_cache)``): the "copy" holds
    the very layer objects of the original, so every write through one is a
    write through the other."""

    def copy(self, caches: list[Any], deep: bool) -> list[Any]:
        return copy.copy(caches)


class RingCastsRows(RotatingKVCache):
    """A sliding-window layer that casts rows of another dtype to its
    buffer's instead of refusing them (the full-attention layers refuse):
    float32 rows handed to a float16 ring are rounded silently, and the
    list's layers disagree on what they accepted."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is not None and keys.dtype != self.keys.dtype:
            keys, values = keys.astype(self.keys.dtype), values.astype(self.values.dtype)  # type: ignore[union-attr]
        return super().update_and_fetch(keys, values)


BUGS: tuple[InjectedBug, ...] = (
    InjectedBug(
        "list_trim_partial", "semantics.md 6, atomic (every layer trims the same count or none)",
        "public bug class: a rollback that silently trims some layers only", "layers", ("fp16",),
        "kvspec.impl.layers.trim_prompt_cache", "trims the layers before a wrapped ring, then returns 0",
        {"layers": {"layers": TrimsLayersThenRefuses}},
    ),
    InjectedBug(
        "list_trim_ignores_recurrent_coverage", "semantics.md 9, list trim bounds (a recurrent layer's bound is its "
        "coverage); semantics.md 6, atomic (every layer trims the same count or none)", "mlx-lm's trim_prompt_cache over a hybrid model (is_trimmable() asked, layers trimmed one by one)",
        "layers", ("fp16",), "kvspec.impl.layers.trim_prompt_cache",
        "the attention layers roll back, then a recurrent layer refuses a rollback beyond its checkpoints",
        {"layers": {"layers": TrimIgnoresRecurrentCoverage}},
    ),
    InjectedBug(
        "list_trim_count_from_offset", "semantics.md 6, the count (from each layer's trimmable rows)",
        "dense front trim with sinks (live_start > 0) inside a mixed list", "layers", ("fp16",),
        "kvspec.impl.layers.trim_prompt_cache", "the trim count ignores a dense layer's front trim",
        {"layers": {"layers": TrimCountFromOffset}},
    ),
    InjectedBug(
        "list_restore_partial", "kvspec.spec.layers.w_restore_mixed (a list restore a layer refuses changes no layer)",
        "a prompt-cache store handing one layer another layer's snapshot", "layers", ("fp16",),
        "kvspec.impl.layers.restore_prompt_cache", "a layer's refusal leaves the layers before it restored",
        {"layers": {"layers": RestoreWithoutRollback}},
    ),
    InjectedBug(
        "make_prompt_cache_ring_step", "kvspec.spec.layers.make_prompt_cache (every layer takes the list's settings)",
        "make_prompt_cache passing a wrong setting to one layer kind", "layers", ("fp16",),
        "kvspec.impl.models.make_prompt_cache", "the sliding-window layers get mlx-lm's layer step (256), not step",
        {"layers": {"layers": RingsGetLayerStep}},
    ),
    InjectedBug(
        "load_ignores_inplace", "kvspec.spec.layers.w_reload (a loaded layer keeps the file's in-place switch)",
        "a prompt-cache file load that ignores the saved in-place switch", "layers", ("fp16",),
        "kvspec.impl.models.load_prompt_cache", "each loaded layer's switch comes from the loading process's "
        "KV_INPLACE_WRITE, not from the file",
        {"layers": {"layers": LoadIgnoresInplace}}, inplace=False,
    ),
    InjectedBug(
        "list_trim_refused_late_partial", "kvspec.spec.layers.w_trim_refused_late (a list trim a layer refuses late changes no layer)",
        "a layer that breaks its promise of an exact trim inside a list", "layers", ("fp16",),
        "kvspec.impl.layers.trim_prompt_cache", "a layer's late refusal leaves the layers before it trimmed",
        {"layers": {"layers": TrimWithoutRollback}},
    ),
    InjectedBug(
        "list_trim_putback_skips_refuser",
        "kvspec.spec.layers.w_trim_refused_late (a list trim a layer refuses late changes no layer, the refusing one too)",
        "a put-back off by one after a layer that trimmed, then refused (breaker sweep)", "layers", ("fp16",),
        "kvspec.impl.layers.trim_prompt_cache", "the put-back after a late refusal skips the refusing layer itself",
        {"layers": {"layers": TrimPutBackSkipsRefuser}},
    ),
    InjectedBug(
        "list_trim_accepts_overtrim",
        "kvspec.spec.layers.w_trim_refused_late (every layer trims exactly the count, or the list trim is refused)",
        "a promise check weakened from != to < (breaker sweep)", "layers", ("fp16",),
        "kvspec.impl.layers.trim_prompt_cache", "a layer that reports more rows trimmed than asked is not refused",
        {"layers": {"layers": TrimAcceptsOvertrim}},
    ),
    InjectedBug(
        "list_copy_shares_layers", "kvspec.spec.layers.w_copy (a copy of the list copies every layer)",
        "prompt-cache stores that keep copy.copy(prompt_cache)", "layers", ("fp16",),
        "kvspec.impl.layers.copy_prompt_cache", "the copy is a new list of the same layer objects",
        {"layers": {"layers": CopyListNotLayers}},
    ),
    InjectedBug(
        "list_ring_casts_rows", "kvspec.spec.layers.w_append_mismatch (every layer refuses rows of another shape or dtype)",
        "a sliding-window layer casting rows of another dtype", "layers", ("fp16",),
        "RotatingKVCache.update_and_fetch", "the ring layers cast rows of another dtype instead of refusing them",
        {"layers": {"rotating": RingCastsRows}},
    ),
)
