"""Injected bugs of the batch caches (``kvspec.impl.batch``; spec ``kvspec.spec.batch``,
semantics.md 7), caught by the batch lockstep (``kvspec.fuzz.batch``, ``kvspec
verify``'s ``batch`` rows) and by ``kvspec e2e``'s ``batch`` scenario
(``kvspec e2e --only batch --bug NAME``). Each is a single-cache class whose
``merge`` builds a broken batch, the way mlx-lm reaches a batch cache.

See ``fuzz/bugs/__init__.py`` for the entry type.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvspec.fuzz.bugs import InjectedBug
from kvspec.impl.batch import BatchKVCache
from kvspec.impl.dense import KVCache
from kvspec.impl.recurrent import RecurrentCache
from kvspec.spec.errors import InvalidArgumentError


class PaddingVisibleBatch(BatchKVCache):
    """The mask is the plain causal mask of the buffer: a short sequence's
    queries also see the left padding (zeros, or a filtered sequence's
    leftovers) before its first row."""

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any) -> mx.array:
        keys = mx.arange(self._idx + N)
        queries = mx.arange(self._idx, self._idx + N)[:, None]
        mask = queries >= keys[None]
        return mx.broadcast_to(mask[None, None], (self.batch_size, 1, N, self._idx + N))


class FilterWrongRowBatch(BatchKVCache):
    """``filter`` computes the kept sequences' layout right but gathers the
    rows of the next sequence (``keep[j] + 1``, wrapping): each kept
    sequence decodes on another sequence's history."""

    def filter(self, batch_indices: Any) -> None:
        keep = [int(i) for i in batch_indices]
        shifted = [(k + 1) % self.batch_size for k in keep]
        keys, values = self.keys, self.values
        super().filter(keep)
        if keys is not None and values is not None:
            drop = keys.shape[2] - self.keys.shape[2]  # type: ignore[union-attr]
            rows = mx.array(shifted)
            self.keys, self.values = keys[rows][..., drop:, :], values[rows][..., drop:, :]


class MergeShiftsOffsetBatch(BatchKVCache):
    """``merge`` pads sequence 1 one position more than the longest sequence
    needs: its first row becomes padding and its offset (its RoPE position)
    one less than the rows it held."""

    @classmethod
    def merge(cls, caches: Any) -> BatchKVCache:
        out = super().merge(caches)
        if len(out._pads) > 1 and out._pads[1] < out._idx:
            out._pads = (out._pads[0], out._pads[1] + 1, *out._pads[2:])
        return out


class RefusedBlockMovesIdxBatch(BatchKVCache):
    """A block shorter than the announced left padding is refused only
    after its rows were written and ``idx`` moved (the check after the
    write): the refused batch is no longer empty, a pad passes idx, and a
    later trim returns a negative count."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev = self._idx
        try:
            return super().update_and_fetch(keys, values)
        except InvalidArgumentError:
            if self.keys is None and keys.ndim == 4:
                self.keys, self.values = mx.zeros(keys.shape, keys.dtype), mx.zeros(values.shape, values.dtype)
                self._idx = prev + int(keys.shape[2])
            raise


def _single(batch: type[BatchKVCache]) -> type[KVCache]:
    """A dense single cache whose ``merge`` builds ``batch``."""

    class Single(KVCache):
        @classmethod
        def merge(cls, caches: Any) -> Any:
            return batch.merge(caches)

    Single.__name__ = Single.__qualname__ = f"KVCacheInto{batch.__name__}"
    return Single


BUGS: tuple[InjectedBug, ...] = (
    InjectedBug(
        name="batch_padding_visible", clause="kvspec.spec.batch.visible (semantics.md 7, rule 2)",
        source="padding visible in a window", kind="batch", modes=("fp16",),
        replaces="BatchKVCache.make_mask", description="the mask shows left padding to the sequence's queries",
        factories={"dense": _single(PaddingVisibleBatch)},
    ),
    InjectedBug(
        name="batch_filter_wrong_row", clause="kvspec.spec.batch.filter (semantics.md 7, rule 3)",
        source="filter keeping the wrong row", kind="batch", modes=("fp16",),
        replaces="BatchKVCache.filter", description="filter gathers the next sequence's rows",
        factories={"dense": _single(FilterWrongRowBatch)},
    ),
    InjectedBug(
        name="batch_merge_shifts_offset", clause="kvspec.spec.batch.merge (semantics.md 7, rule 3)",
        source="merge shifting one sequence's offset", kind="batch", modes=("fp16",),
        replaces="BatchKVCache.merge", description="merge pads sequence 1 one position too many",
        factories={"dense": _single(MergeShiftsOffsetBatch)},
    ),
    InjectedBug(
        name="batch_refused_block_moves_idx", clause="kvspec.spec.batch.announced_block (semantics.md 7: a refusal "
                                                     "changes nothing)",
        source="a refused block left the batch changed (found by a mutation survivor's triage)",
        kind="batch", modes=("fp16",), replaces="BatchKVCache.update_and_fetch",
        description="a block shorter than the announced padding is refused after it moved idx",
        factories={"dense": _single(RefusedBlockMovesIdxBatch)},
    ),
)


# -- the recurrent kind's batch operations (kvspec.impl.recurrent.RecurrentCache) -------------------
#
# Caught by the recurrent batch lockstep (kvspec.fuzz.batch.recurrent_campaign, kvspec verify's
# ``batch bugs`` row): each breaks an op only batched generation runs (merge, extend,
# prepare/advance's lengths, an ordered filter, left padding), which the recurrent
# harness (kvspec.fuzz.recurrent: single sequences, a filter of one index) never reaches. Not in
# BUGS: proofs/batch.py's layout controls mirror BUGS one to one.


class RecurrentFilterKeepsPadding(RecurrentCache):
    """``filter`` keeps the kept sequences' arrays but not their counters:
    ``left_padding`` and ``lengths`` stay those of the whole batch, so the
    next call's mask (``make_mask``) is of the old batch size and masks the
    wrong sequences' positions."""

    def filter(self, batch_indices: Any) -> None:
        left_padding, lengths = self.left_padding, self.lengths
        super().filter(batch_indices)
        self.left_padding, self.lengths = left_padding, lengths


class RecurrentFilterLosesOrder(RecurrentCache):
    """``filter`` selects the kept sequences with a boolean mask over the
    batch: the set is right, their order is the batch's, not the order
    asked for (BatchGenerator asks in sorted order; kvspec.spec.batch.filter keeps
    the given order)."""

    def filter(self, batch_indices: Any) -> None:
        keep = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        super().filter(keep if len(set(keep)) != len(keep) else sorted(keep))


class RecurrentExtendWrongSide(RecurrentCache):
    """``extend`` onto a batch that holds no arrays yet (its sequences
    consumed nothing) puts the zeros standing for them after the other
    batch's rows instead of before: its sequences get the newcomers' conv
    windows and states, the newcomers get zeros."""

    def extend(self, other: Any) -> None:
        a_batch, had = self.batch_size, list(self.cache)
        super().extend(other)
        self.cache = [mx.concatenate([o, mx.zeros((a_batch, *o.shape[1:]), o.dtype)]) if a is None and o is not None
                      else c for a, o, c in zip(had, other.cache, self.cache)]


class RecurrentMergeLosesDtype(RecurrentCache):
    """``merge`` builds each batch array as ``mx.zeros(shape)`` (float32,
    the dtype forgotten) and writes the sequences' rows into it: a float16
    or bfloat16 conv window comes back float32."""

    @classmethod
    def merge(cls, caches: Any) -> RecurrentCache:
        out = super().merge(caches)
        out.cache = [None if a is None else mx.zeros(a.shape) + a for a in out.cache]
        return out


class RecurrentAdvanceKeepsLengths(RecurrentCache):
    """``advance`` counts the tokens but leaves ``lengths`` as ``prepare``
    set them: a right-padded block run in chunks (BatchGenerator's prefill
    step) masks the second chunk as if it began at position 0, so a short
    sequence takes padding into its state and conv window."""

    def advance(self, N: int) -> None:
        lengths = self.lengths
        super().advance(N)
        self.lengths = lengths


def _recurrent_bug(name: str, cls: type, replaces: str, description: str, clause: str) -> InjectedBug:
    return InjectedBug(name=name, clause=clause, source="recurrent layers in batched generation",
                       kind="batch_recurrent", modes=("fp16",), replaces=replaces, description=description,
                       factories={"recurrent": cls})


RECURRENT_BUGS: tuple[InjectedBug, ...] = (
    _recurrent_bug("batch_recurrent_filter_keeps_padding", RecurrentFilterKeepsPadding, "RecurrentCache.filter",
                   "filter keeps left_padding and lengths of the whole batch", "kvspec.spec.batch.filter (semantics.md 7, rule 3)"),
    _recurrent_bug("batch_recurrent_filter_loses_order", RecurrentFilterLosesOrder, "RecurrentCache.filter",
                   "filter keeps the batch's order, not the order asked for", "kvspec.spec.batch.filter (semantics.md 7, rule 3)"),
    _recurrent_bug("batch_recurrent_extend_wrong_side", RecurrentExtendWrongSide, "RecurrentCache.extend",
                   "extend onto an empty batch zero-fills after the newcomers", "kvspec.spec.batch.extend (semantics.md 7, rule 3)"),
    _recurrent_bug("batch_recurrent_merge_loses_dtype", RecurrentMergeLosesDtype, "RecurrentCache.merge",
                   "merge builds the batch arrays in float32", "kvspec.spec.batch.merge (semantics.md 7, rule 3)"),
    _recurrent_bug("batch_recurrent_advance_keeps_lengths", RecurrentAdvanceKeepsLengths, "RecurrentCache.advance",
                   "advance leaves lengths as prepare set them (chunked right-padded blocks)",
                   "kvspec.spec.batch.append_ragged (semantics.md 7, rule 3)"),
)
