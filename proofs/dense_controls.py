"""The negative controls' buggy rules as Python, for replay on the spec.

Each function is the spec function it replaces with exactly one rule broken,
under the negative control's name. :func:`patches` maps a
:class:`kvspec.proofs.dense_model.Rules` to the spec functions to swap in
(:func:`kvspec.proofs.traces.patched`), so a counterexample found by Z3 on the
encoding is replayed on the spec's own code with the same bug.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvspec.proofs.dense_model import Rules
from kvspec.spec import dense as sd


def inplace_no_length_check(cache: sd.DenseCache, n: int) -> bool:
    """inplace_after_trim: the ownership predicate without
    ``live_len == marker.live_len``."""
    return (
        cache.inplace and n == 1 and cache.mode is sd.Mode.FP16 and cache.marker is not None
        and cache.buffer is not None and cache.marker.buffer == cache.buffer.ident
    )


def inplace_no_identity_check(cache: sd.DenseCache, n: int) -> bool:
    """The ownership predicate without ``marker.buffer == buffer.ident``."""
    return (
        cache.inplace and n == 1 and cache.mode is sd.Mode.FP16 and cache.marker is not None
        and cache.buffer is not None and cache.live_len == cache.marker.live_len
    )


def adopt_keeps_marker(cache: sd.DenseCache, holder: sd.Holder) -> sd.DenseCache:
    """restore/install that keep the cache's old ownership marker."""
    return replace(cache, entries=holder.entries, offset=holder.offset, live_start=holder.live_start,
                   buffer=holder.buffer)


def adopt_records_marker(cache: sd.DenseCache, holder: sd.Holder) -> sd.DenseCache:
    """inplace_after_restore: restore/install record a marker for the
    adopted (shared) buffers, as if the cache had produced them."""
    marker = None if holder.buffer is None else sd.Marker(holder.buffer.ident, holder.live_len)
    return replace(cache, entries=holder.entries, offset=holder.offset, live_start=holder.live_start,
                   buffer=holder.buffer, marker=marker)


def trim_forgets_offset(cache: sd.DenseCache, n: int) -> tuple[int, sd.DenseCache]:
    """trim cuts the window but leaves the offset where it was."""
    n = max(0, min(n, cache.live_len))
    if n == 0:
        return 0, cache
    cache = replace(cache, entries=cache.entries[: cache.live_len - n])
    if not sd.trim_is_logical(cache.mode) and cache.live_len > 0:
        cache = sd._with_new_buffer(cache, cache.live_len)
    return n, sd._dropped_if_empty(cache)


def trim_keeps_rows(cache: sd.DenseCache, n: int) -> tuple[int, sd.DenseCache]:
    """trim moves the offset but keeps the rejected rows in the window (a
    concatenation cache brings trimmed rows back)."""
    n = max(0, min(n, cache.live_len))
    if n == 0:
        return 0, cache
    cache = replace(cache, offset=cache.offset - n)
    if not sd.trim_is_logical(cache.mode) and cache.live_len > 0:
        cache = sd._with_new_buffer(cache, cache.live_len)
    return n, sd._dropped_if_empty(cache)


def _front(cache: sd.DenseCache, n: int, keep: int, clamp_keep: bool, move_offset: bool) -> tuple[int, sd.DenseCache]:
    if not sd.supports_front_trim(cache.mode):
        return 0, cache
    n = max(0, min(n, cache.live_len))
    if n == 0:
        return 0, cache
    keep = max(0, min(keep, cache.live_len - n)) if clamp_keep else max(0, keep)
    entries = cache.entries[:keep] + cache.entries[keep + n :]
    if move_offset:
        cache = replace(cache, entries=entries, offset=cache.offset - n)
    else:
        cache = replace(cache, entries=entries, live_start=cache.live_start + n)
    if cache.live_len > 0:
        cache = sd._with_new_buffer(cache, cache.live_len)
    return n, sd._dropped_if_empty(cache)


def front_decreases_offset(cache: sd.DenseCache, n: int, keep: int = 0) -> tuple[int, sd.DenseCache]:
    """trim_front_keep_sink that moves the offset back instead of live_start
    forward (RoPE positions of later rows go wrong)."""
    return _front(cache, n, keep, clamp_keep=True, move_offset=True)


def front_keep_unclamped(cache: sd.DenseCache, n: int, keep: int = 0) -> tuple[int, sd.DenseCache]:
    """trim_front_keep_sink without clamping keep to ``live_len - n``."""
    return _front(cache, n, keep, clamp_keep=False, move_offset=False)


def patches(rules: Rules) -> dict[str, Any]:
    """The spec functions to swap in for a Rules variant."""
    out: dict[str, Any] = {}
    if rules.inplace == "no_length_check":
        out["inplace_write_allowed"] = inplace_no_length_check
    elif rules.inplace == "no_identity_check":
        out["inplace_write_allowed"] = inplace_no_identity_check
    if rules.restore_marker == "keep":
        out["adopt"] = adopt_keeps_marker
    elif rules.restore_marker == "record":
        out["adopt"] = adopt_records_marker
    if rules.trim == "forgets_offset":
        out["trim"] = trim_forgets_offset
    elif rules.trim == "keeps_rows":
        out["trim"] = trim_keeps_rows
    if rules.front == "decreases_offset":
        out["trim_front_keep_sink"] = front_decreases_offset
    elif rules.front == "keep_unclamped":
        out["trim_front_keep_sink"] = front_keep_unclamped
    return out
