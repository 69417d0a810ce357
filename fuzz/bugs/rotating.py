"""Injected bugs of the sliding-window cache (``kvspec.impl.rotating.RotatingKVCache``).

See ``fuzz/bugs/__init__.py`` for the catalog and the entry type.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.fuzz.bugs import InjectedBug
from kvspec.impl.dense import SEQ_AXIS
from kvspec.impl.rotating import RotatingKVCache


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


class DecodeMaskWindowIgnoresSinks(RotatingKVCache):
    """make_mask(1)'s "every key visible" shortcut measures a wrapped ring's
    oldest non-sink against the whole window, not the window less the sinks
    (``W - K - 1 < window``): with sinks, a window of ``W - 1`` returns None
    where the mask hides the oldest non-sink. Only a mask check narrower
    than the ring sees it (breaker sweep)."""

    def _decode_sees_every_key(self, window: int) -> bool:
        W, K, q, idx = self.max_size, self.keep, self.offset, self.idx
        if self.capacity > W:
            idx = W
        if idx >= W:
            idx = K
        if q == idx:
            return q < K or q - K < window - K
        return W - K - 1 < window


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


class GrowthWithBatchOne(RotatingKVCache):
    """The ring's warm-up growth builds its zero rows with batch 1 (a
    hard-coded shape): a ring of batch 2 fails on its first decode step.
    Caught only when the machines draw batch > 1."""

    def _decode(self, k: mx.array, v: mx.array):
        if self.keys is None:
            grow = min(self.step, self.max_size)
            self._set_buffers(mx.zeros((1, k.shape[1], grow, k.shape[3]), dtype=k.dtype),
                              mx.zeros((1, v.shape[1], grow, v.shape[3]), dtype=v.dtype))
        return super()._decode(k, v)


class GrowthPadsValuesToKeyDim(RotatingKVCache):
    """The ring's warm-up growth sizes the value buffer with the keys' head
    dim (one shape for both): a model whose value head dim differs from its
    key head dim fails. Caught only when the machines draw separate K and V
    head dims."""

    def _decode(self, k: mx.array, v: mx.array):
        if self.keys is None:
            grow = min(self.step, self.max_size)
            self._set_buffers(mx.zeros((k.shape[0], k.shape[1], grow, k.shape[3]), dtype=k.dtype),
                              mx.zeros((v.shape[0], v.shape[1], grow, k.shape[3]), dtype=v.dtype))
        return super()._decode(k, v)


class UndoLogOneShort(RotatingKVCache):
    """The undo log keeps one row too few: once it covers U rows, the
    oldest record has lost its saved row, so a rollback of exactly U rows
    after a wrap leaves the overwriting row in that slot."""

    def _short(self) -> None:
        if self._log and sum(r.rows for r in self._log) >= self.undo:
            self._log = (replace(self._log[0], saved_keys=None, saved_values=None),) + self._log[1:]

    def _log_decode(self, prior, slot) -> None:
        super()._log_decode(prior, slot)
        self._short()

    def _log_prefill(self, old, rows) -> None:
        super()._log_prefill(old, rows)
        self._short()


class RollbackKeepsIdx(RotatingKVCache):
    """Undoing a decode writes its saved row back but leaves the cursor
    where it was: offset is rolled back, idx is not."""

    def _undo_append(self, r) -> None:
        idx = self.idx
        super()._undo_append(r)
        if r.kind == "decode":
            self.idx = idx


class UndoLogSurvivesRestore(RotatingKVCache):
    """restore adopts the snapshot's rows and counters but keeps the undo
    log of the history it replaces: a later rollback resurrects that
    history's rows."""

    def restore(self, snapshot) -> None:
        log = self._log
        super().restore(snapshot)
        self._log = log


class BlockDropsUnlogged(RotatingKVCache):
    """A multi-row append logs its counters but not the old row it drops:
    undoing the whole block leaves that slot empty (zeros)."""

    def _log_prefill(self, old, rows) -> None:
        super()._log_prefill(old, rows)
        if self._log and self._log[-1].kind == "prefill":
            self._log = self._log[:-1] + (replace(self._log[-1], saved_keys=None, saved_values=None),)


def _keeping_log(setter: Any) -> Any:
    def set_keeping_log(self: RotatingKVCache, v: Any) -> None:
        log = self._log
        setter(self, v)
        self._log = log

    return set_keeping_log


class LoadKeepsUndoLog(RotatingKVCache):
    """mlx-lm's load order (``state``, then ``meta_state``) over a ring keeps
    its undo log: a trim after the load rolls back into the history before
    it (a file is a snapshot: a loaded ring holds no log)."""

    state = property(RotatingKVCache.state.fget, _keeping_log(RotatingKVCache.state.fset))  # type: ignore[assignment]
    meta_state = property(RotatingKVCache.meta_state.fget,  # type: ignore[assignment]
                          _keeping_log(RotatingKVCache.meta_state.fset))


BUGS: tuple[InjectedBug, ...] = (
    InjectedBug(
        "decode_mask_window_ignores_sinks", "semantics.md 3, mask (exactly the window's keys)",
        "an O(1) decode-mask shortcut that forgets the sinks (breaker sweep)", "rotating", ("fp16",),
        "RotatingKVCache._decode_sees_every_key",
        "make_mask(1) returns None on a wrapped ring with sinks where a narrower window hides the oldest non-sink",
        {"rotating": DecodeMaskWindowIgnoresSinks},
    ),
    InjectedBug(
        "steady_state_inplace", "semantics.md 3, steady state copies",
        "public fix #1963: the flagship", "rotating", ("fp16",), "RotatingKVCache._inplace_write_allowed",
        "decode writes in place after the window is full; snapshots of the full ring see the overwrite",
        {"rotating": SteadyStateInplace},
        variants=(("W=16", {"max_size": 16}, True), ("isolation only", {}, False),
                  ("isolation only, W=16", {"max_size": 16}, False)),
    ),
    InjectedBug(
        "wrapped_trim_moves_counters", "semantics.md 3, trim (Decision: fail closed on a wrapped ring)",
        "mlx-lm RotatingKVCache.trim on a wrapped ring", "rotating", ("fp16",), "RotatingKVCache.trim",
        "trim after a wrap moves offset and idx; the cursor leaves [keep, W) and the window is corrupted",
        {"rotating": WrappedTrimMovesCounters},
    ),
    InjectedBug(
        "prefill_physical_order", "semantics.md 3, valid rows in time order (a multi-row append reads them chronologically)",
        "public fault: appending after a wrap in physical order", "rotating", ("fp16",), "RotatingKVCache._chronological",
        "multi-row append after a wrap keeps the ring's physical order", {"rotating": PrefillPhysicalOrder},
    ),
    InjectedBug(
        "prefill_clamps_return", "semantics.md 3, multi-row append (returns the whole concatenation)",
        "public fault: clamping the return to W", "rotating", ("fp16",), "RotatingKVCache._prefill",
        "multi-row append returns only the last W rows", {"rotating": PrefillClampsReturn},
    ),
    InjectedBug(
        "mask_admits_extra_key", "semantics.md 3, mask (exactly the window's keys)",
        "public fault: window mask admitting W+1 keys", "rotating", ("fp16",), "RotatingKVCache.make_mask",
        "the window mask admits W + 1 keys", {"rotating": MaskAdmitsExtraKey},
    ),
    InjectedBug(
        "warmup_inplace_ignores_marker", "semantics.md 3, warm-up in place (only under the marker)",
        "public fix #1963: the warm-up ownership proof", "rotating", ("fp16",), "RotatingKVCache.restore",
        "warm-up decode writes in place without the marker (after a restore)",
        {"rotating": WarmupInplaceIgnoresMarker},
    ),
    InjectedBug(
        "mask_hides_sinks", "semantics.md 3, mask (sinks stay visible to every query)",
        "public fault: sinks hidden from later queries of a chunk", "rotating", ("fp16",),
        "RotatingKVCache.make_mask", "the mask applies the window to the sinks too", {"rotating": MaskHidesSinks},
    ),
    InjectedBug(
        "prefill_drops_sinks", "semantics.md 3, multi-row append (keeps the sinks)",
        "sliding-window eviction with sinks", "rotating", ("fp16",), "RotatingKVCache._chronological",
        "a multi-row append that trims old rows evicts the sinks", {"rotating": PrefillDropsSinks},
    ),
    InjectedBug(
        "ring_growth_batch_one", "semantics.md 3, decode (one row) (growth keeps the rows' [B, H, _, D])",
        "batch > 1", "rotating", ("fp16",), "RotatingKVCache._decode",
        "the first growth allocates batch 1", {"rotating": GrowthWithBatchOne},
    ),
    InjectedBug(
        "ring_values_key_head_dim", "semantics.md 3, decode (one row) (keys and values keep their own head dims)",
        "models with a distinct value head dim", "rotating", ("fp16",), "RotatingKVCache._decode",
        "the value buffer is allocated with the keys' head dim", {"rotating": GrowthPadsValuesToKeyDim},
    ),
    InjectedBug(
        "undo_log_one_short", "semantics.md 3, what a trim can take back (exact for n <= min(U, rows appended))",
        "undo-log rollback after a wrap", "rotating", ("fp16",), "RotatingKVCache._log_decode/_log_prefill",
        "the log keeps U - 1 rows: a rollback of exactly U rows after a wrap restores a wrong row",
        {"rotating": UndoLogOneShort},
    ),
    InjectedBug(
        "rollback_keeps_idx", "semantics.md 3, rollback (offset and idx return to the record's)",
        "undo-log rollback after a wrap", "rotating", ("fp16",), "RotatingKVCache._undo_append",
        "undoing a decode restores its row and offset but not the cursor idx", {"rotating": RollbackKeepsIdx},
    ),
    InjectedBug(
        "undo_log_survives_restore", "semantics.md 3, restore clears the log",
        "undo-log rollback after a wrap", "rotating", ("fp16",), "RotatingKVCache.restore",
        "restore keeps the replaced history's undo log", {"rotating": UndoLogSurvivesRestore},
    ),
    InjectedBug(
        "block_drops_unlogged", "semantics.md 3, undo log (records the rows a multi-row append drops)",
        "undo-log rollback after a wrap", "rotating", ("fp16",), "RotatingKVCache._log_prefill",
        "a multi-row append does not log the old row it drops", {"rotating": BlockDropsUnlogged},
    ),
    InjectedBug(
        "load_keeps_undo_log", "kvspec.spec.rotating.w_reload (a load acts as a restore: empty undo log)",
        "mlx-lm's load_prompt_cache sets state, then meta_state", "rotating", ("fp16",),
        "RotatingKVCache.state/meta_state setters", "loading over a ring keeps its undo log",
        {"rotating": LoadKeepsUndoLog},
    ),
)
