"""Injected bugs of the recurrent layer's cache and its step recorder
(``kvspec.impl.recurrent``: ``RecurrentCache``, ``record_steps``).

See ``fuzz/bugs/__init__.py`` for the catalog and the entry type. A bug of
the cache is a subclass of ``RecurrentCache``; a bug of the recorder is a
``record_steps`` replacement, passed to the lockstep as
``{"recurrent": {"record_steps": ...}}``.
"""

from __future__ import annotations

import inspect
from typing import Any

import mlx.core as mx

from kvspec.fuzz.bugs import InjectedBug
from kvspec.impl.recurrent import (
    RecurrentCache,
    RecurrentSnapshot,
    _mixers,
    _recorded_call,
    _slice_plan,
    _sub_call,
    _unread_parameters,
)


class ConvWindowNotRolledBack(RecurrentCache):
    """A rollback puts the checkpoint's recurrent state back but keeps the
    live conv window: the next call convolves the rejected draft tokens'
    inputs (ekryski/mlx-swift-lm#218: the SSM state restored, the conv
    state kept)."""

    def trim(self, n: int) -> int:
        conv = self.cache[0]
        got = super().trim(n)
        if got:
            self.cache = [conv, *self.cache[1:]]
        return got


class CheckpointRingOneShort(RecurrentCache):
    """The checkpoint ring has U slots, not U + 1: the checkpoint of
    ``offset - U`` shares its slot with the live one, so a rollback of
    exactly U tokens restores the live arrays (no rollback at all)."""

    def _slots(self) -> int:
        return max(1, self.depth)

    def _put(self, t: int, arrays: tuple[Any, ...]) -> None:
        slot = t % self._slots()
        self._ring = self._ring[:slot] + (arrays,) + self._ring[slot + 1:]

    def trim(self, n: int) -> int:
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0 or n > self._coverage:
            return super().trim(n)
        self.offset -= n
        self._coverage -= n
        self.cache = list(self._ring[self.offset % self._slots()])
        return n


class RollbackBeyondCoverage(RecurrentCache):
    """The rollback checks ``n`` against the depth, not the coverage: after
    an unrecorded step, a restore or a short history, a rollback the
    checkpoints do not cover is accepted and restores whatever the slot of
    ``offset - n`` holds (a stale or missing checkpoint)."""

    def trim(self, n: int) -> int:
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            return super().trim(n)
        if n > min(self.depth, self.offset):
            return super().trim(n)
        self.offset -= n
        self._coverage = max(0, self._coverage - n)
        slot = self._ring[self.offset % (self.depth + 1)]
        self.cache = list(slot) if slot is not None else [None] * len(self.cache)
        return n


class SnapshotSharesRing(RecurrentCache):
    """The checkpoints live in a mutable list that a snapshot (and a copy)
    takes by reference, not by value: a later recorded step overwrites a
    slot the snapshot's history still needs, so a rollback after restoring
    the snapshot lands on a state from after it."""

    def _put(self, t: int, arrays: tuple[Any, ...]) -> None:
        if not isinstance(self._ring, list):
            self._ring = list(self._ring)
        self._ring[t % (self.depth + 1)] = arrays  # type: ignore[index]


class UnrecordedStepKeepsCheckpoints(RecurrentCache):
    """A write of the layer's arrays outside the recorder (an unrecorded
    step) keeps the checkpoints: the coverage stays, and a rollback after it
    restores states from before the unrecorded tokens, as if they had
    never been consumed... while the offset says they were."""

    def __setitem__(self, idx: int, value: Any) -> None:
        self.cache[idx] = value

    def advance(self, N: int) -> None:
        if self.lengths is not None:
            self.lengths -= N
        if self.left_padding is not None:
            self.left_padding -= N
        if not self._recording:
            self.offset += int(N)


class RestoreKeepsLiveCoverage(RecurrentCache):
    """restore adopts the snapshot's arrays, offset and ring but keeps the
    live coverage (capped at the depth): a rollback after the restore
    reaches checkpoints the snapshot never vouched for."""

    def restore(self, snap: RecurrentSnapshot) -> None:
        coverage = self._coverage
        super().restore(snap)
        self._coverage = min(self.depth, coverage)


def _wrong_end_call(original: Any, sig: inspect.Signature, unread: frozenset[str], module: Any, args: tuple,
                    kwargs: dict) -> Any:
    """The recorder's split with the ends swapped: each of the FIRST
    ``min(S, U)`` tokens as its own call (a checkpoint each), then the rest
    as one block. Whatever the mixer's signature (qwen3_next's
    ``(inputs, mask, cache)``, nemotron_h's ``(hidden_states, mask,
    cache)``, recurrent_gemma's ``(x, cache, mask)``...): the input is its
    first argument and the other sequence-shaped arguments are sliced with
    it, as the real recorder slices them; a call the real recorder would
    not split (depth 0, another cache, an argument it cannot slice) is the
    real recorder's."""
    try:
        bound = sig.bind(module, *args, **kwargs)
    except TypeError:
        return original(module, *args, **kwargs)
    cache = bound.arguments.get("cache")
    names = [p for p in bound.arguments if p != "cache"][1:]  # without self
    x = bound.arguments[names[0]] if names else None
    plan = _slice_plan(bound, [n for n in names if n not in unread or n == names[0]], x) if names else None
    if not isinstance(cache, RecurrentCache) or cache.depth == 0 or cache._recording or plan is None:
        return _recorded_call(original, sig, module, args, kwargs, unread)
    S, U = x.shape[1], cache.depth
    cache._mark()
    outs = [_sub_call(original, bound, module, cache, plan, t, t + 1, single=True) for t in range(min(S, U))]
    if S > U:
        outs.append(_sub_call(original, bound, module, cache, plan, U, S, single=False))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)


def record_steps_wrong_end(model: Any) -> int:
    """``kvspec.impl.recurrent.record_steps`` that splits the wrong end of a call
    (:func:`_wrong_end_call`): a verify block's checkpoints are those of
    its first tokens, and a long block (S > U) ends with coverage 0."""
    n = 0
    for m in _mixers(model):
        cls = type(m)
        original = cls.__call__
        sig, unread = inspect.signature(original), _unread_parameters(original)

        def __call__(self: Any, *args: Any, __original: Any = original, __sig: Any = sig, __unread: Any = unread,
                     **kwargs: Any) -> Any:
            return _wrong_end_call(__original, __sig, __unread, self, args, kwargs)

        m.__class__ = type(cls.__name__, (cls,), {"__call__": __call__})
        n += 1
    return n


BUGS: tuple[InjectedBug, ...] = (
    InjectedBug(
        "conv_window_not_rolled_back", "semantics.md 9, trim (conv window AND recurrent state of offset - n)",
        "ekryski/mlx-swift-lm#218: the SSM state rolled back, the conv state kept", "recurrent", ("fp16",),
        "RecurrentCache.trim", "a rollback restores the recurrent state but keeps the live conv window",
        {"recurrent": ConvWindowNotRolledBack},
    ),
    InjectedBug(
        "checkpoint_ring_one_short", "semantics.md 9, the checkpoint ring (U + 1 slots, kvspec.spec.recurrent.slot)",
        "ring buffers one slot short (the undo log's undo_log_one_short, for checkpoints)", "recurrent", ("fp16",),
        "RecurrentCache._put/trim", "the ring has U slots: a rollback of exactly U tokens restores the live arrays",
        {"recurrent": CheckpointRingOneShort},
    ),
    InjectedBug(
        "rollback_beyond_coverage", "semantics.md 9, trim (n beyond the coverage: refused, nothing changed)",
        "coverage not checked: rollback bounded by the depth only", "recurrent", ("fp16",), "RecurrentCache.trim",
        "a rollback beyond the coverage (but within the depth) is accepted and restores a stale checkpoint",
        {"recurrent": RollbackBeyondCoverage},
    ),
    InjectedBug(
        "snapshot_shares_ring", "semantics.md 9, snapshot (never shares anything a later write changes)",
        "mutable checkpoint storage taken by reference", "recurrent", ("fp16",), "RecurrentCache._put",
        "the checkpoints are a list a snapshot shares: later steps overwrite the snapshot's history",
        {"recurrent": SnapshotSharesRing},
    ),
    InjectedBug(
        "unrecorded_step_keeps_checkpoints", "semantics.md 9, step (an unrecorded step clears the coverage)",
        "a model's write outside the recorder (a stale checkpoint ring)", "recurrent", ("fp16",),
        "RecurrentCache.__setitem__/advance", "a write outside the recorder keeps the checkpoints and the coverage",
        {"recurrent": UnrecordedStepKeepsCheckpoints},
    ),
    InjectedBug(
        "recorder_splits_wrong_end", "semantics.md 9, the step recorder (the last min(S, U) tokens one by one)",
        "splitting a verify block at the wrong end", "recurrent", ("fp16",), "kvspec.impl.recurrent.record_steps",
        "the recorder runs the first min(S, U) tokens one by one and the rest as a block",
        {"recurrent": {"record_steps": record_steps_wrong_end}},
    ),
    InjectedBug(
        "restore_keeps_live_coverage", "semantics.md 9, restore (the snapshot's coverage comes back)",
        "restore adopting arrays and counters but not the history bound", "recurrent", ("fp16",),
        "RecurrentCache.restore", "restore keeps the live coverage instead of the snapshot's",
        {"recurrent": RestoreKeepsLiveCoverage},
    ),
)
