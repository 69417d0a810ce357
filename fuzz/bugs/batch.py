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


class FilterAcceptsDuplicatesBatch(BatchKVCache):
    """``filter`` without the distinct-indices check: ``filter([0, 0])``
    keeps sequence 0 twice (spec.batch.filter refuses it)."""

    def filter(self, batch_indices: Any) -> None:
        keep = [int(i) for i in batch_indices]
        if keep and len(set(keep)) < len(keep) and all(0 <= k < len(self._pads) for k in keep):
            kept = [self._pads[k] for k in keep]
            drop = min(kept)
            if self.keys is not None and self.values is not None:
                rows = mx.array(keep)
                self.keys, self.values = self.keys[rows][..., drop:, :], self.values[rows][..., drop:, :]
            self._idx, self._pads = self._idx - drop, tuple(p - drop for p in kept)
            return
        super().filter(keep)


class NegativeTrimGrowsBatch(BatchKVCache):
    """``trim(n)`` without the ``n <= 0`` case: a negative count moves every
    offset forward into rows nobody wrote (spec.batch: it takes nothing)."""

    def trim(self, n: int) -> int:
        if isinstance(n, int) and n < 0 and self.keys is not None:
            self._idx -= n
            return n
        return super().trim(n)


class ExtractLosesStepBatch(BatchKVCache):
    """``extract`` into a single cache of the default step (256), not the
    batch's: same window, but another capacity growth than a single cache
    of the batch's step."""

    def extract(self, idx: int) -> KVCache:
        one = super().extract(idx)
        out = KVCache("fp16")
        window = one.fetch()
        if window is not None and one.offset > 0:
            out.update_and_fetch(window[0], window[1])
        return out


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
        name="batch_filter_accepts_duplicates", clause="spec.batch.filter (keep: distinct indices, refused otherwise)",
        source="break_report5 #1: a dropped distinct-indices check", kind="batch", modes=("fp16",),
        replaces="BatchKVCache.filter", description="filter([0, 0]) keeps sequence 0 twice instead of refusing",
        factories={"dense": _single(FilterAcceptsDuplicatesBatch)},
    ),
    InjectedBug(
        name="batch_negative_trim_grows", clause="spec.batch.trim_count (n <= 0 takes nothing)",
        source="break_report5 #2: a dropped n <= 0 case", kind="batch", modes=("fp16",),
        replaces="BatchKVCache.trim", description="trim(-2) moves every offset 2 forward into unwritten rows",
        factories={"dense": _single(NegativeTrimGrowsBatch)},
    ),
    InjectedBug(
        name="batch_extract_loses_step", clause="spec.batch.extract (a single cache of the batch's settings)",
        source="break_report5 #4: an extract that builds a default cache", kind="batch", modes=("fp16",),
        replaces="BatchKVCache.extract", description="the extracted cache has step 256, not the batch's",
        factories={"dense": _single(ExtractLosesStepBatch)},
    ),
)
