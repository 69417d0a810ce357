"""Injected bugs of the sliding-window cache (``impl.rotating.RotatingKVCache``).

See ``fuzz/bugs/__init__.py`` for the catalog and the entry type.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from fuzz.bugs import InjectedBug
from impl.dense import SEQ_AXIS
from impl.rotating import RotatingKVCache


class SteadyStateInplace(RotatingKVCache):
    """The flagship: decode rows go in place whenever the cache still owns
    its buffers, also after the window is full. The overwritten oldest slot
    is still part of every snapshot and held window of the full ring."""

    def _inplace_write_allowed(self) -> bool:
        return self.inplace and self._owns_buffers()


class WrappedTrimMovesCounters(RotatingKVCache):
    """trim on a wrapped ring moves offset and idx anyway: the cursor goes
    below the sinks (or negative) and the window is corrupted."""

    def trim(self, n: int) -> int:
        n = max(0, min(int(n), self.offset))
        self.offset -= n
        self.idx -= n
        if self.offset == 0 and n:
            self.keys = self.values = None
            self._marker = None
        return n


class PrefillPhysicalOrder(RotatingKVCache):
    """A multi-row append after a wrap concatenates the ring in physical
    order instead of chronological order."""

    def _chronological(self):
        if self.keys is None or self.values is None:
            return None
        n = self.valid_len
        return self.keys[:, :, :n, :], self.values[:, :, :n, :]


class PrefillClampsReturn(RotatingKVCache):
    """A multi-row append returns only the last max_size rows, starving the
    earliest queries of the chunk of their window."""

    def _prefill(self, k: mx.array, v: mx.array):
        keys, values = super()._prefill(k, v)
        if keys.shape[SEQ_AXIS] > self.max_size:
            return keys[:, :, -self.max_size :, :], values[:, :, -self.max_size :, :]
        return keys, values


class MaskAdmitsExtraKey(RotatingKVCache):
    """The window mask uses ``q - p <= window`` : every query sees W + 1 keys."""

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        window = self.max_size if window_size is None else window_size
        positions = self._next_positions(N)
        rows = [[p <= self.offset + i and (p < self.keep or self.offset + i - p <= window - self.keep) for p in positions]
                for i in range(N)]
        mask = mx.array(np.array(rows, dtype=bool).reshape(N, len(positions)))
        if not return_array and N == 1 and all(rows[0]):
            return None
        return mask


class WarmupInplaceIgnoresMarker(RotatingKVCache):
    """restore takes the adopted buffers for its own (records a marker for
    them), so the next warm-up decode writes in place into memory the
    snapshot shares, which other holders of a longer ring see."""

    def restore(self, snapshot) -> None:
        super().restore(snapshot)
        self._marker = (self.keys, self.values, self.idx)  # type: ignore[assignment]


class MaskHidesSinks(RotatingKVCache):
    """The window mask ignores the sinks: later queries of a chunk (and a
    decode whose window excludes position 0) lose them, as mlx-lm's
    RotatingKVCache.make_mask does for keep > 0."""

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        window = self.max_size if window_size is None else window_size
        positions = self._next_positions(N)
        rows = [[p <= self.offset + i and self.offset + i - p < window for p in positions] for i in range(N)]
        mask = mx.array(np.array(rows, dtype=bool).reshape(N, len(positions)))
        if not return_array and N == 1 and all(rows[0]):
            return None
        return mask


class PrefillDropsSinks(RotatingKVCache):
    """A multi-row append that must drop old rows drops the oldest ones,
    sinks included."""

    def _chronological(self):
        got = super()._chronological()
        if got is None or self.keep == 0:
            return got
        n = got[0].shape[SEQ_AXIS]
        if n <= self.max_size - 1:
            return got
        # keep only the latest W - 1 rows; the sinks go with the rest
        return tuple(a[:, :, n - (self.max_size - 1 - self.keep) - self.keep :, :] for a in got)


BUGS: tuple[InjectedBug, ...] = (
    InjectedBug(
        "steady_state_inplace", "semantics.md 3, single-row append 4 (steady state must copy)",
        "seed 003 (#1963): the flagship", "rotating", ("fp16",), "RotatingKVCache._inplace_write_allowed",
        "decode writes in place after the window is full; snapshots of the full ring see the overwrite",
        {"rotating": SteadyStateInplace},
        variants=(("W=16", {"max_size": 16}, True), ("isolation only", {}, False),
                  ("isolation only, W=16", {"max_size": 16}, False)),
    ),
    InjectedBug(
        "wrapped_trim_moves_counters", "semantics.md 3, Trim (Decision: fail closed on a wrapped ring)",
        "mlx-lm RotatingKVCache.trim on a wrapped ring", "rotating", ("fp16",), "RotatingKVCache.trim",
        "trim after a wrap moves offset and idx; the cursor leaves [keep, W) and the window is corrupted",
        {"rotating": WrappedTrimMovesCounters},
    ),
    InjectedBug(
        "prefill_physical_order", "semantics.md 3, multi-row append (chronological order)",
        "public fault: appending after a wrap in physical order", "rotating", ("fp16",), "RotatingKVCache._chronological",
        "multi-row append after a wrap keeps the ring's physical order", {"rotating": PrefillPhysicalOrder},
    ),
    InjectedBug(
        "prefill_clamps_return", "semantics.md 3, multi-row append returns the whole concatenation",
        "public fault: clamping the return to W", "rotating", ("fp16",), "RotatingKVCache._prefill",
        "multi-row append returns only the last W rows", {"rotating": PrefillClampsReturn},
    ),
    InjectedBug(
        "mask_admits_extra_key", "semantics.md 3, Masks (exactly the window's keys)",
        "public fault: window mask admitting W+1 keys", "rotating", ("fp16",), "RotatingKVCache.make_mask",
        "the window mask admits W + 1 keys", {"rotating": MaskAdmitsExtraKey},
    ),
    InjectedBug(
        "warmup_inplace_ignores_marker", "semantics.md 3, warm-up in place only under the ownership rule",
        "seed 003 (#1963) ownership proof", "rotating", ("fp16",), "RotatingKVCache.restore",
        "warm-up decode writes in place without the marker (after a restore)",
        {"rotating": WarmupInplaceIgnoresMarker},
    ),
    InjectedBug(
        "mask_hides_sinks", "semantics.md 3, Masks (sinks stay visible to every query)",
        "public fault: sinks hidden from later queries of a chunk", "rotating", ("fp16",),
        "RotatingKVCache.make_mask", "the mask applies the window to the sinks too", {"rotating": MaskHidesSinks},
    ),
    InjectedBug(
        "prefill_drops_sinks", "semantics.md 3, sinks are never evicted",
        "sliding-window eviction with sinks", "rotating", ("fp16",), "RotatingKVCache._chronological",
        "a multi-row append that trims old rows evicts the sinks", {"rotating": PrefillDropsSinks},
    ),
)
