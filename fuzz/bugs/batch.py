"""Injected bugs of the batch caches (``impl.batch``; spec ``spec.batch``,
semantics.md 7), caught by the batch lockstep (``fuzz.batch``, ``kvspec
verify``'s ``batch`` rows) and by ``kvspec e2e``'s ``batch`` scenario
(``kvspec e2e --only batch --bug NAME``). Each is a single-cache class whose
``merge`` builds a broken batch, the way mlx-lm reaches a batch cache.

See ``fuzz/bugs/__init__.py`` for the entry type.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from fuzz.bugs import InjectedBug
from impl.batch import BatchKVCache
from impl.dense import KVCache
from spec.errors import InvalidArgumentError


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
        name="batch_padding_visible", clause="spec.batch.visible (semantics.md 7, rule 2)",
        source="issue 24: padding visible in a window", kind="batch", modes=("fp16",),
        replaces="BatchKVCache.make_mask", description="the mask shows left padding to the sequence's queries",
        factories={"dense": _single(PaddingVisibleBatch)},
    ),
    InjectedBug(
        name="batch_filter_wrong_row", clause="spec.batch.filter (semantics.md 7, rule 3)",
        source="issue 24: filter keeping the wrong row", kind="batch", modes=("fp16",),
        replaces="BatchKVCache.filter", description="filter gathers the next sequence's rows",
        factories={"dense": _single(FilterWrongRowBatch)},
    ),
    InjectedBug(
        name="batch_merge_shifts_offset", clause="spec.batch.merge (semantics.md 7, rule 3)",
        source="issue 24: merge shifting one sequence's offset", kind="batch", modes=("fp16",),
        replaces="BatchKVCache.merge", description="merge pads sequence 1 one position too many",
        factories={"dense": _single(MergeShiftsOffsetBatch)},
    ),
    InjectedBug(
        name="batch_refused_block_moves_idx", clause="spec.batch.announced_block (semantics.md 7: a refusal "
                                                     "changes nothing)",
        source="issue 26: a refused block left the batch changed (found by a mutation survivor's triage)",
        kind="batch", modes=("fp16",), replaces="BatchKVCache.update_and_fetch",
        description="a block shorter than the announced padding is refused after it moved idx",
        factories={"dense": _single(RefusedBlockMovesIdxBatch)},
    ),
)
