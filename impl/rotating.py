"""Sliding-window MLX KV cache (spec: ``kvspec.spec.rotating``).

A ring of at most ``max_size`` (W) slots along axis 2 whose first ``keep``
(K) slots hold attention sinks. Decode steps write at the cursor ``idx``
and wrap to K; multi-row appends re-linearise the ring into chronological
order and return everything so each new query sees a full window.

In-place writes (through a NumPy view of the evaluated buffer) happen only
during warm-up, when the slot being written was never valid, under the
dense cache's ownership proof. Once the window is full every
write overwrites the oldest slot, which a prompt-cache snapshot may still
hold, so steady-state writes always copy.

Storage is unquantized only: mode ``"fp16"``, which names the mode, not a
cast: rows are stored and returned in the dtype they come in (float16,
bfloat16 or float32; semantics.md 2 "Storage"). Keys and values may
have different head dims. (The reference engine falls back to Fp16 storage
for quantized modes on sliding-window layers; here such a request is refused
instead of silently changing precision.)
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.impl.dense import (
    FLOAT_DTYPES,
    MAX_STEP,
    SEQ_AXIS,
    _check_int,
    _check_rows,
    _check_tensor,
    check_dtype_matches,
    check_inplace,
    check_matches_cache,
    check_window_size,
    copy_without_marker,
    decode_pair_rows,
    refuse_foreign_save,
    share,
    write_rows_copy,
)
from kvspec.impl.masks import ring_mask
from kvspec.impl.write import queue_read, seq_prefix, write_copy, write_inplace_pair
from kvspec.spec.errors import (
    InvalidArgumentError,
    RollbackWarning,
    StateError,
    UnsupportedOperationError,
)

_ALL = slice(None)


def _state_pair(op: str, v: Any) -> tuple[Any, Any]:
    """``state`` is ``(keys, values)`` or empty."""
    if not isinstance(v, (tuple, list)):
        raise InvalidArgumentError(f"{op}: state must be a tuple (keys, values) (or empty), got {type(v).__name__}")
    if not v:
        return None, None
    if len(v) != 2:
        raise InvalidArgumentError(f"{op}: state must hold (keys, values), got {len(v)} arrays")
    for name, a in (("keys", v[0]), ("values", v[1])):
        _check_tensor(op, name, a)
    return v[0], v[1]


def chronological_slots(n_slots: int, idx: int, keep: int, wrapped: bool) -> list[int]:
    """Slot indices of the valid rows, oldest first (kvspec.spec.rotating.chronological_order)."""
    if not wrapped:
        return list(range(idx))
    return list(range(keep)) + list(range(idx, n_slots)) + list(range(keep, idx))


def ring_visible(query: int, key: int, window: int, keep: int) -> bool:
    """Mask rule (kvspec.spec.rotating.mask_visible): causal, and a sink or one of
    the ``window - keep`` latest positions."""
    return key <= query and (key < keep or query - key < window - keep)


def prefill_kept(n_old: int, max_size: int, keep: int) -> list[int]:
    """Which old rows (chronological index) a multi-row append keeps
    (kvspec.spec.rotating.prefill_kept): all while at most ``max_size - 1``, else
    the sinks and the latest others."""
    budget = max_size - 1
    if n_old <= budget:
        return list(range(n_old))
    sinks = min(keep, n_old)
    if budget > sinks:
        return list(range(sinks)) + list(range(n_old - (budget - sinks), n_old))
    return list(range(budget))


@dataclass(frozen=True)
class UndoRecord:
    """One append's undo record (kvspec.spec.rotating.UndoRecord): the counters
    before it, where a decode wrote (-1 for a block), and the valid rows it
    destroyed as ``[B, H, r, D]`` float16 slices (r <= 1; ``None`` for
    none). ``whole`` is False for an append onto an oversized buffer."""

    kind: str
    rows: int
    offset: int
    idx: int
    capacity: int
    slot: int
    saved_keys: mx.array | None
    saved_values: mx.array | None
    whole: bool

    @property
    def saved_rows(self) -> int:
        """Rows this record saved per K/V buffer (0 or 1 for a decode, at most the rows a multi-row
        append dropped). Rule: ``kvspec.spec.rotating.log_saved_rows`` (semantics.md 3, "undo log")."""
        return 0 if self.saved_keys is None else int(self.saved_keys.shape[SEQ_AXIS])


def log_push(log: tuple[UndoRecord, ...], record: UndoRecord, undo: int) -> tuple[UndoRecord, ...]:
    """kvspec.spec.rotating.log_push: no log at depth 0; a record that is not whole
    starts it afresh; records older than the latest ``undo`` rows go."""
    if undo == 0:
        return ()
    if not record.whole:
        return (record,)
    log = log + (record,)
    while sum(r.rows for r in log[1:]) >= undo:
        log = log[1:]
    return log


def log_rows(log: tuple[UndoRecord, ...]) -> int:
    """kvspec.spec.rotating.log_rows: rows the log can roll back."""
    covered = sum(r.rows for r in log)
    return covered - 1 if log and not log[0].whole else covered


def log_rewind(log: tuple[UndoRecord, ...], n: int) -> tuple[UndoRecord, ...]:
    """kvspec.spec.rotating.log_rewind: the log after a counters-only trim of ``n``."""
    while n > 0 and log:
        last = log[-1]
        if n >= last.rows:
            log, n = log[:-1], n - last.rows
        else:
            log, n = log[:-1] + (replace(last, rows=last.rows - n),), 0
    return log


@dataclass
class RingSnapshot:
    """A snapshot of a ring: new handles to its buffers and its counters."""

    keys: mx.array | None
    values: mx.array | None
    offset: int
    idx: int
    max_size: int
    keep: int

    def fetch(self) -> tuple[mx.array, mx.array] | None:
        """The snapshot's valid rows in physical slot order, ``[B, H, n, D]`` in the rows' dtype, or
        None; never changes. Rule: ``kvspec.spec.rotating.w_snapshot`` (semantics.md 3,
        "snapshot / restore")."""
        if self.keys is None:
            return None
        assert self.values is not None
        ix = seq_prefix(self.keys.shape[SEQ_AXIS] if self.offset != self.idx else self.idx)
        return self.keys[ix], self.values[ix]


class RotatingKVCache:
    """Sliding-window cache with window ``max_size`` and ``keep`` sinks.

    Args:
        max_size: window W in rows (>= 1).
        keep: sink rows K, ``0 <= keep < max_size``; never evicted.
        step: growth granularity in rows (>= 1) during warm-up.
        inplace: the in-place switch: True, False or None (reads
            ``KV_INPLACE_WRITE``); validated like the dense cache's.
        mode: ``"fp16"`` only.
        undo: undo depth U in rows (>= 0; 0, the default: a wrapped ring
            cannot trim). The log keeps at most U rows per K/V buffer, so a
            trim of up to U rows after a wrap is exact
            (``trimmable_rows()``; kvspec.spec.rotating.trimmable_rows).
        strict: True or False (default). A rollback the ring cannot honour
            exactly (beyond ``trimmable_rows()``: a trim, or an
            ``is_trimmable()`` that would answer False) is refused and the
            ring is left unchanged; False reports the first refusal with a
            RollbackWarning (once per cache), True raises StateError at
            every refusal, also inside mlx-lm's loops that only ask
            ``is_trimmable()`` (docs/mlx-lm.md, "A rollback a layer cannot
            honour is loud").

    Raises InvalidArgumentError for bad sizes or a ``strict`` that is not a
    bool, UnsupportedOperationError for another mode. Observables:
    ``offset``, ``idx``, ``capacity``, ``last_write_inplace``,
    ``trimmable_rows()``, ``strict``.
    """

    def __init__(self, max_size: int, keep: int = 0, step: int = 256, inplace: bool | None = None, mode: str = "fp16",
                 undo: int = 0, strict: bool = False):
        if mode != "fp16":
            raise UnsupportedOperationError(f"RotatingKVCache: mode must be 'fp16', got {mode!r}")
        max_size = _check_int("RotatingKVCache", "max_size", max_size)
        keep = _check_int("RotatingKVCache", "keep", keep)
        step = _check_int("RotatingKVCache", "step", step)
        undo = _check_int("RotatingKVCache", "undo", undo)
        if undo < 0:
            raise InvalidArgumentError(f"RotatingKVCache: undo must be >= 0, got {undo}")
        if max_size < 1:
            raise InvalidArgumentError(f"RotatingKVCache: max_size must be >= 1, got {max_size}")
        if keep < 0 or keep >= max_size:
            raise InvalidArgumentError(f"RotatingKVCache: keep must satisfy 0 <= keep < max_size ({max_size}), got {keep}")
        if step < 1 or step > MAX_STEP:
            raise InvalidArgumentError(f"RotatingKVCache: step must be in [1, {MAX_STEP}], got {step}")
        if type(strict) is not bool:
            raise InvalidArgumentError(f"RotatingKVCache: strict must be True or False, got {strict!r}")
        self.strict = strict
        self.max_size, self.keep, self.step, self.mode, self.undo = max_size, keep, step, mode, undo
        self._log: tuple[UndoRecord, ...] = ()
        self.inplace = check_inplace("RotatingKVCache", inplace)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.idx = 0
        self._marker: tuple[mx.array, mx.array, int] | None = None
        self.last_write_inplace = False
        # set once a refused rollback has been reported (RollbackWarning,
        # once per cache; a copy of the ring is another cache and starts unset)
        self.rollback_warned = False
        self._quantize_warned = False

    # -- observables --------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Physical slots along axis 2 (0 without buffers; at most ``max_size`` except right after a
        multi-row append). Rule: ``kvspec.spec.rotating.decode`` (semantics.md 3, "decode (one row)")."""
        return 0 if self.keys is None else int(self.keys.shape[SEQ_AXIS])

    @property
    def wrapped(self) -> bool:
        """True once ``offset != idx`` (the cursor wrapped or a multi-row append rebuilt the
        buffer). Rule: ``kvspec.spec.rotating.chronological_order`` (semantics.md 3,
        "valid rows in time order")."""
        return self.offset != self.idx

    @property
    def valid_len(self) -> int:
        """Valid slots: the capacity once wrapped, else ``idx``. Rule:
        ``kvspec.spec.rotating.visible_positions`` (semantics.md 3, "what a reader sees")."""
        return self.capacity if self.wrapped else self.idx

    def fetch(self) -> tuple[mx.array, mx.array] | None:
        """Valid rows in physical slot order, ``[B, H, n, D]`` in the rows' dtype.

        None when the ring holds no rows. Rule: ``kvspec.spec.rotating.chronological_order`` (semantics.md
        3, "what a reader sees")."""
        keys = self.keys
        if keys is None:  # keys and values are set and dropped together
            return None
        ix = seq_prefix(keys.shape[SEQ_AXIS] if self.offset != self.idx else self.idx)  # valid_len
        return keys[ix], self.values[ix]  # type: ignore[index]

    # -- writes -----------------------------------------------------------------
    def _set_buffers(self, keys: mx.array, values: mx.array) -> None:
        self.keys, self.values = keys, values

    def _owns_buffers(self) -> bool:
        m = self._marker
        return m is not None and m[0] is self.keys and m[1] is self.values

    def _inplace_write_allowed(self) -> bool:
        """Warm-up rule (kvspec.spec.rotating.rotating_inplace_allowed): the window
        is not full, so slot ``idx == offset`` was never valid, and the
        marker says our own last write produced these buffers and left the
        cursor here."""
        return (
            self.inplace
            and self.offset < self.max_size
            and self.idx == self.offset
            and self._owns_buffers()
            and self._marker is not None
            and self._marker[2] == self.idx
        )

    def _write_row(self, k: mx.array, v: mx.array, inplace: bool) -> None:
        assert self.keys is not None and self.values is not None
        index = (_ALL, _ALL, slice(self.idx, self.idx + 1))  # one decode row; one index for both arrays
        if inplace:
            # one write of the pair (on the host: one wait for rows, buffers and queued reads)
            self.keys, self.values = write_inplace_pair(self.keys, k, self.values, v, index)
        else:
            self._set_buffers(write_copy(self.keys, k, index), write_copy(self.values, v, index))

    def _decode(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        W, K = self.max_size, self.keep
        # the capacity read once (the decode path runs per layer per step)
        cap = 0 if self.keys is None else self.keys.shape[SEQ_AXIS]
        prior = (self.offset, self.idx, cap, cap if self.offset != self.idx else self.idx)
        if self.keys is not None and cap > W:
            # An oversized buffer (after a multi-row append) is cut to its
            # sinks and latest W - K rows, in chronological order already.
            cut = self.capacity - (W - K)
            self._set_buffers(*(mx.concatenate([a[:, :, :K, :], a[:, :, cut:, :]], axis=SEQ_AXIS) for a in (self.keys, self.values)))  # type: ignore[index]
            self.idx = W
            cap = W
        if self.keys is None or (self.idx >= cap and cap < W):
            grow = min(self.step, W - cap)
            zk = mx.zeros((k.shape[0], k.shape[1], grow, k.shape[3]), dtype=k.dtype)
            zv = mx.zeros((v.shape[0], v.shape[1], grow, v.shape[3]), dtype=v.dtype)
            if self.keys is None:
                self._set_buffers(zk, zv)
            else:
                self._set_buffers(mx.concatenate([self.keys, zk], axis=SEQ_AXIS), mx.concatenate([self.values, zv], axis=SEQ_AXIS))  # type: ignore[list-item]
        if self.idx >= W:
            self.idx = K
        inplace = self._inplace_write_allowed()
        saved = self._log_decode(prior, self.idx) if self.undo else None
        if saved:
            # The saved row is scheduled before the write is built: once its
            # gather is enqueued it lets go of the buffer, so the write (a
            # static slice update) may reuse the buffer instead of copying the
            # whole ring; the stream runs the gather first. No host wait
            # (async_eval); a lazy copy, or mx.depends, kept the buffer
            # referenced and made every steady-state decode copy the ring.
            # Through the write layer: a host write in place waits for it.
            queue_read(*saved)
        self._write_row(k, v, inplace)
        self.offset += 1
        self.idx += 1
        self.last_write_inplace = inplace
        keys = self.keys  # fetch(), inlined: the decode path runs per layer per step
        cap = keys.shape[SEQ_AXIS]  # type: ignore[union-attr]
        if self.offset != self.idx or self.idx == cap:
            # the window is the whole ring (steady state, or warm-up at a full
            # buffer): handles of the buffers themselves, no slice (as in
            # kvspec.impl.dense.KVCache.update_and_fetch)
            return keys.__copy__(), self.values.__copy__()  # type: ignore[union-attr]
        ix = (_ALL, _ALL, slice(0, self.idx))
        return keys[ix], self.values[ix]  # type: ignore[index]

    def _chronological(self) -> tuple[mx.array, mx.array] | None:
        if self.keys is None:
            return None
        assert self.values is not None
        order = chronological_slots(self.capacity, self.idx, self.keep, self.wrapped)
        if order == list(range(self.capacity)):
            return self.keys, self.values
        if order == list(range(len(order))):
            return self.keys[:, :, : len(order), :], self.values[:, :, : len(order), :]
        idx = mx.array(order)
        return mx.take(self.keys, idx, axis=SEQ_AXIS), mx.take(self.values, idx, axis=SEQ_AXIS)

    def _prefill(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        old = self._chronological()
        self._log_prefill(old, k.shape[SEQ_AXIS])
        if old is None:
            keys, values = k, v
            kept = 0
        else:
            kept = old[0].shape[SEQ_AXIS]
            budget = self.max_size - 1
            if kept > budget:
                sinks = min(self.keep, kept)
                tail = budget - sinks
                old = tuple(mx.concatenate([a[:, :, :sinks, :], a[:, :, kept - tail :, :]], axis=SEQ_AXIS) for a in old)  # type: ignore[assignment]
                kept = budget
            keys = mx.concatenate([old[0], k], axis=SEQ_AXIS)  # type: ignore[index]
            values = mx.concatenate([old[1], v], axis=SEQ_AXIS)  # type: ignore[index]
        self._set_buffers(keys, values)
        self.offset += k.shape[SEQ_AXIS]
        self.idx = kept + k.shape[SEQ_AXIS]
        self.last_write_inplace = False
        return self.keys, self.values  # type: ignore[return-value]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``S`` rows (keys ``[B, H, S, Dk]``, values ``[B, H, S, Dv]``
        in float16, bfloat16 or float32, stored in that dtype). S == 1 returns
        the valid rows in physical ring order; S > 1 returns the
        chronological concatenation of the kept old rows and all new rows,
        which may be longer than ``max_size``.
        Raises InvalidArgumentError for a wrong rank or dtype, S < 1, or a
        batch B, kv heads H, head dim or dtype that differs from the cached
        rows (the message names it).

        Rule: ``kvspec.spec.rotating.decode``, ``kvspec.spec.rotating.prefill``,
        ``kvspec.spec.rotating.rotating_inplace_allowed`` (semantics.md 3, "warm-up in place"; semantics.md
        3, "steady state copies")."""
        # the decode path: the pair accepted in one pass; else the full checks
        n = 0 if self.keys is None else decode_pair_rows(keys, values, self.keys, self.values)  # type: ignore[arg-type]
        if not n:
            n = _check_rows("append", keys, values)
            if self.keys is not None:
                assert self.values is not None
                bk, bv, ks, vs = self.keys.shape, self.values.shape, keys.shape, values.shape
                if not (ks[0] == bk[0] and ks[1] == bk[1] and ks[3] == bk[3] and vs[0] == bv[0] and vs[1] == bv[1]
                        and vs[3] == bv[3]):
                    check_matches_cache("append", "keys", tuple(bk), keys)
                    check_matches_cache("append", "values", tuple(bv), values)
                check_dtype_matches("append", self.keys.dtype, keys.dtype)
        k, v = keys, values
        out = self._decode(k, v) if n == 1 else self._prefill(k, v)
        self._marker = (self.keys, self.values, self.idx)  # type: ignore[assignment]
        return out

    # -- the undo log (kvspec.spec.rotating: decode_record, prefill_record) ----------
    def _log_decode(self, prior: tuple[int, int, int, int], slot: int) -> list[mx.array]:
        """Record the decode about to write at ``slot``: the counters before
        it and the row it overwrites when that row is valid; onto an
        oversized buffer the record is not whole (kvspec.spec.rotating.decode_record).
        Returns the saved rows (empty when none were saved)."""
        if self.undo == 0:
            return []
        offset, idx, cap, valid = prior
        sk = sv = None
        if cap <= self.max_size and slot < valid:
            # Gathered into memory of its own (a slice would share the
            # buffer's memory and stop MLX from reusing it; _decode schedules
            # the gather before the write).
            at = mx.array([slot], dtype=mx.int32)
            sk, sv = (mx.take(a, at, axis=SEQ_AXIS) for a in (self.keys, self.values))  # type: ignore[arg-type]
        record = UndoRecord("decode", 1, offset, idx, cap, slot, sk, sv, cap <= self.max_size)
        self._log = log_push(self._log, record, self.undo)
        return [] if sk is None else [sk, sv]

    def _log_prefill(self, old: tuple[mx.array, mx.array] | None, rows: int) -> None:
        """Record the multi-row append about to go onto the chronological
        rows ``old``: the counters before it and the old rows it drops (at
        most one unless the buffer is oversized, then not whole;
        kvspec.spec.rotating.prefill_record)."""
        if self.undo == 0:
            return
        whole = self.capacity <= self.max_size
        sk = sv = None
        n_old = 0 if old is None else int(old[0].shape[SEQ_AXIS])
        dropped = sorted(set(range(n_old)) - set(prefill_kept(n_old, self.max_size, self.keep)))
        if whole and dropped and old is not None:
            a, b = dropped[0], dropped[-1] + 1
            sk, sv = old[0][:, :, a:b, :], old[1][:, :, a:b, :]
        record = UndoRecord("prefill", rows, self.offset, self.idx, self.capacity, -1, sk, sv, whole)
        self._log = log_push(self._log, record, self.undo)

    def log_saved_rows(self) -> int:
        """Rows the undo log holds per K/V buffer (at most ``undo``).

        Rule: ``kvspec.spec.rotating.log_saved_rows`` (semantics.md 3, "undo log")."""
        return sum(r.saved_rows for r in self._log)

    def _prior_layout(self, r: UndoRecord) -> tuple[mx.array, mx.array]:
        """The buffers before the multi-row append ``r`` (kvspec.spec.rotating.prior_layout):
        each old row back to its slot in the prior's chronological order,
        kept ones from the front of the buffer, dropped ones from the log,
        zeros where nothing was valid. One gather per tensor."""
        assert self.keys is not None and self.values is not None
        W, K, cap = self.max_size, self.keep, self.capacity
        order = chronological_slots(r.capacity, r.idx, K, r.offset != r.idx)
        row_of = {j: i for i, j in enumerate(prefill_kept(len(order), W, K))}
        dropped = [j for j in range(len(order)) if j not in row_of]
        row_of.update({j: cap + t for t, j in enumerate(dropped[: r.saved_rows])})
        zero = cap + r.saved_rows
        src = [zero] * (r.capacity if r.capacity else min(cap, W))
        for j, slot in enumerate(order):
            src[slot] = row_of.get(j, zero)
        out = []
        for a, saved in ((self.keys, r.saved_keys), (self.values, r.saved_values)):
            pad = mx.zeros((a.shape[0], a.shape[1], 1, a.shape[3]), dtype=a.dtype)
            parts = [a] + ([saved] if saved is not None else []) + [pad]
            out.append(mx.take(mx.concatenate(parts, axis=SEQ_AXIS), mx.array(src, dtype=mx.int32), axis=SEQ_AXIS))
        return out[0], out[1]

    def _undo_append(self, r: UndoRecord) -> None:
        """Undo the newest append wholly (kvspec.spec.rotating.undo_append): a decode
        writes its saved row back into its slot (O(1) rows), a block gets
        the prior layout back; counters from the record; no marker."""
        if r.kind == "decode":
            if r.saved_keys is not None:
                self._set_buffers(write_rows_copy(self.keys, r.saved_keys, r.slot),
                                  write_rows_copy(self.values, r.saved_values, r.slot))
        else:
            self._set_buffers(*self._prior_layout(r))
        self.offset, self.idx, self._log, self._marker = r.offset, r.idx, self._log[:-1], None

    def _undo_part(self, r: UndoRecord, n: int) -> None:
        """Undo the last ``n < r.rows`` rows of the newest block
        (kvspec.spec.rotating.undo_part): two rows or more left, cut the buffers to
        them; one left, rebuild the prior ring and decode that row again."""
        assert self.keys is not None and self.values is not None
        if r.rows - n >= 2:
            end = self.idx - n
            self._set_buffers(self.keys[:, :, :end, :], self.values[:, :, :end, :])
            self.offset, self.idx, self._marker = self.offset - n, end, None
            self._log = self._log[:-1] + (replace(r, rows=r.rows - n),)
            return
        at = self.idx - r.rows
        first = (self.keys[:, :, at : at + 1, :], self.values[:, :, at : at + 1, :])
        self._set_buffers(*self._prior_layout(r))
        self.offset, self.idx, self._log, self._marker = r.offset, r.idx, self._log[:-1], None
        inplace = self.last_write_inplace
        self._decode(*first)
        self._marker = (self.keys, self.values, self.idx)  # type: ignore[assignment]
        self.last_write_inplace = inplace

    def _rollback(self, n: int) -> None:
        """Take back ``n <= trimmable_rows()`` rows through the log, newest
        append first (kvspec.spec.rotating.rollback)."""
        while n > 0:
            r = self._log[-1]
            if n >= r.rows:
                self._undo_append(r)
                n -= r.rows
            else:
                self._undo_part(r, n)
                n = 0

    # -- trims ------------------------------------------------------------------
    def _counters_rewind_exact(self) -> bool:
        """kvspec.spec.rotating.counters_rewind_exact: unwrapped and not oversized."""
        return self.idx == self.offset and self.offset <= self.max_size and self.capacity <= self.max_size

    def trimmable_rows(self) -> int:
        """Rows a trim can take back exactly (kvspec.spec.rotating.trimmable_rows):
        ``offset`` while the counters alone rewind the ring, else what the
        undo log covers, at most ``undo``."""
        if self._counters_rewind_exact():
            return self.offset
        return min(self.undo, log_rows(self._log))

    def is_trimmable(self) -> bool:
        """True when some trim is exact (kvspec.spec.rotating.is_trimmable): the
        counters alone rewind the ring, or its undo log covers a row.

        False is a refused rollback and is reported as one: a
        RollbackWarning, once per cache, whatever happened before (a ring
        that went past its window during the prefill warns at its first
        False; no earlier trim is needed). mlx-lm asks this before every
        rollback (its ``trim_prompt_cache`` through
        ``can_trim_prompt_cache``, inside ``speculative_generate_step``)
        and on False skips the rollback in every layer without calling
        :meth:`trim`, so this answer is the only place the ring learns of
        it. A caller that only asks, and would have rolled nothing back,
        is warned too: the ring cannot tell the two apart, and from here
        on any rollback asked of it is refused. False only for a ring that
        holds rows (``offset > 0``).

        With ``strict=True`` the answer False is never given: the refusal
        raises StateError instead (every time; the ring is unchanged), since
        mlx-lm's loops skip a rollback on False without calling
        :meth:`trim`. True stays True, so mlx-lm's set-up check in
        ``speculative_generate_step`` passes on fresh caches. A caller that
        uses the answer only to choose (mlx-lm's ``LRUPromptCache``) gets
        the error too: keep ``strict`` off for such caches."""
        if self._counters_rewind_exact() or self.trimmable_rows() > 0:
            return True
        self.warn_refused_rollback(None)
        return False

    def warn_refused_rollback(self, n: int | None) -> None:
        """Report a rollback of ``n`` rows (None: any rollback, from
        :meth:`is_trimmable`) this ring cannot honour exactly: the
        once-per-cache RollbackWarning, or with ``strict=True`` StateError
        at every refusal (naming the ring, its window, its undo depth,
        ``n`` and the fix). ``rollback_warned`` is set only once the
        warning was issued, so under ``warnings.simplefilter("error",
        RollbackWarning)`` every refusal raises (nothing trimmed); a strict
        ring never sets it.

        Rule: ``kvspec.spec.rotating.trimmable_rows`` (semantics.md 3, "what a trim can take back")."""
        if self.strict:
            asked = ("any rollback (asked through is_trimmable(), which mlx-lm's trim_prompt_cache asks before "
                     "every rollback)") if n is None else f"a rollback of {n} rows"
            deeper = "" if n is None else f", or give this ring an undo log of at least {n} rows (undo={n})"
            raise StateError(
                f"RotatingKVCache(max_size={self.max_size}, keep={self.keep}, undo={self.undo}, strict=True) at "
                f"offset {self.offset} went past its window and can roll back exactly {self.trimmable_rows()} rows: "
                f"{asked} is refused and nothing was trimmed (the ring is unchanged); for speculative decoding with "
                f"k draft tokens build the caches with kvspec.impl.models.make_prompt_cache(model, num_draft_tokens=k) "
                f"(an undo log of k rows per ring){deeper}"
            )
        if self.rollback_warned:
            return
        asked = "any rollback" if n is None else f"a rollback of {n} rows"
        warnings.warn(
            f"RotatingKVCache(max_size={self.max_size}, undo={self.undo}) has wrapped and can roll back exactly "
            f"{self.trimmable_rows()} rows: {asked} is refused (nothing trimmed), so a decoding loop that goes on "
            f"leaves the stream it would have had; for speculative decoding build the caches with "
            f"kvspec.impl.models.make_prompt_cache(model, num_draft_tokens=k) (an undo log of k rows per ring). "
            f"Reported once per cache.",
            RollbackWarning, stacklevel=3,
        )
        self.rollback_warned = True

    def trim(self, n: int) -> int:
        """Rewind ``n`` rows (clamped to ``[0, offset]``) exactly
        (kvspec.spec.rotating.trim): by the counters while unwrapped (O(1)), else
        through the undo log (O(n) rows for decode steps). The buffers stay,
        also at offset 0. Beyond ``trimmable_rows()`` trims nothing and
        returns 0 (fail closed), with a RollbackWarning once per cache, or
        with ``strict=True`` raises StateError (nothing trimmed)."""
        n = _check_int("trim", "n", n)
        n = max(0, min(n, self.offset))
        if n == 0:
            return 0
        if n > self.trimmable_rows():
            self.warn_refused_rollback(n)
            return 0
        if self._counters_rewind_exact():
            self.offset -= n
            self.idx -= n
            self._log = log_rewind(self._log, n)
        else:
            self._rollback(n)
        return n

    def trim_to(self, length: int) -> int:
        """``trim(offset - length)``. Raises InvalidArgumentError unless
        ``0 <= length <= offset``; StateError (nothing changes) when
        ``offset - length`` is beyond ``trimmable_rows()``.

        Rule: ``kvspec.spec.rotating.trim_to`` (semantics.md 3, "trim_to")."""
        length = _check_int("trim_to", "len", length)
        if length < 0 or length > self.offset:
            raise InvalidArgumentError(f"trim_to: len must satisfy 0 <= len <= offset ({self.offset}), got {length}")
        if self.offset - length > self.trimmable_rows():
            raise StateError(
                f"trim_to: cannot trim a wrapped sliding-window ring exactly by {self.offset - length} rows "
                f"(offset={self.offset}, idx={self.idx}, max_size={self.max_size}, undo={self.undo}, "
                f"rows it can roll back: {self.trimmable_rows()}), got len={length}"
            )
        return self.trim(self.offset - length)

    # -- snapshots -------------------------------------------------------------
    def __copy__(self) -> RotatingKVCache:
        """A copy sharing the buffers, owning nothing (its first write
        copies); another cache, so its first refused rollback warns again."""
        new = copy_without_marker(self)
        new.rollback_warned = False
        return new

    def __deepcopy__(self, memo: dict) -> RotatingKVCache:
        """As :meth:`__copy__` (mlx-lm's ``LRUPromptCache`` deep-copies a
        stored prompt cache on every fetch)."""
        new = copy_without_marker(self, memo)
        new.rollback_warned = False
        return new

    def snapshot(self) -> RingSnapshot:
        """New handles to the same buffers (O(1)) and the counters.

        Rule: ``kvspec.spec.rotating.w_snapshot`` (semantics.md 3, "snapshot / restore")."""
        k = None if self.keys is None else share(self.keys)
        v = None if self.values is None else share(self.values)
        return RingSnapshot(k, v, self.offset, self.idx, self.max_size, self.keep)

    def _check_snapshot(self, op: str, snap: RingSnapshot) -> None:
        """Refuse a snapshot no ring of this shape could have produced: wrong
        type, (max_size, keep), tensor rank, dtype or K/V agreement, or
        counters outside the ring's invariants (``0 <= idx <= offset``,
        ``idx <= capacity``; wrapped: ``keep < idx`` (a wrapped cursor has just written past the
        sinks) and ``capacity >=
        max_size``; oversized: ``idx == capacity``)."""
        if not isinstance(snap, RingSnapshot):
            raise InvalidArgumentError(f"{op}: expected a RingSnapshot, got {type(snap).__name__}")
        if (snap.max_size, snap.keep) != (self.max_size, self.keep):
            raise InvalidArgumentError(
                f"{op}: (max_size, keep) must be {(self.max_size, self.keep)}, got {(snap.max_size, snap.keep)}"
            )
        _check_int(op, "offset", snap.offset)
        _check_int(op, "idx", snap.idx)
        if not (0 <= snap.idx <= snap.offset):
            raise InvalidArgumentError(f"{op}: cursor must satisfy 0 <= idx <= offset, got idx={snap.idx}, offset={snap.offset}")
        if (snap.keys is None) != (snap.values is None):
            raise InvalidArgumentError(f"{op}: keys and values must both be present or both absent")
        if snap.keys is None:  # and so values, checked just above
            if snap.offset != 0:
                raise InvalidArgumentError(f"{op}: offset {snap.offset} > 0 but no tensors")
            return
        for name, a in (("keys", snap.keys), ("values", snap.values)):
            _check_tensor(op, name, a)
            if a.dtype not in FLOAT_DTYPES:
                raise InvalidArgumentError(f"{op}: {name} dtype must be float16, bfloat16 or float32, got {a.dtype}")
        if snap.keys.dtype != snap.values.dtype:
            raise InvalidArgumentError(
                f"{op}: keys and values must share a dtype, got {snap.keys.dtype} and {snap.values.dtype}"
            )
        if snap.keys.shape[:3] != snap.values.shape[:3]:
            raise InvalidArgumentError(
                f"{op}: keys and values must agree on [B, H, T], got {tuple(snap.keys.shape)} and {tuple(snap.values.shape)}"
            )
        cap = int(snap.keys.shape[SEQ_AXIS])
        wrapped = snap.offset != snap.idx
        if snap.idx > cap or (wrapped and (snap.idx <= self.keep or cap < self.max_size)) or (cap > self.max_size and snap.idx != cap):
            raise InvalidArgumentError(
                f"{op}: counters do not fit the ring: offset={snap.offset}, idx={snap.idx}, capacity={cap}, "
                f"max_size={self.max_size}, keep={self.keep}"
            )

    def restore(self, snapshot: RingSnapshot) -> None:
        """Adopt a snapshot's buffers and counters with no ownership marker,
        so the next write copies. Raises InvalidArgumentError for a malformed
        or mismatched snapshot.

        The undo log starts empty. Rule: ``kvspec.spec.rotating.w_restore`` (semantics.md 3,
        "snapshot / restore"; semantics.md 3, "restore clears the log")."""
        self._check_snapshot("restore", snapshot)
        self.keys = None if snapshot.keys is None else share(snapshot.keys)
        self.values = None if snapshot.values is None else share(snapshot.values)
        self.offset, self.idx = snapshot.offset, snapshot.idx
        self._marker = None
        self._log = ()  # a restored ring cannot roll back into another history

    # -- masks ------------------------------------------------------------------
    def _next_positions(self, n: int) -> list[int]:
        """Absolute positions of the keys the next append of ``n`` rows will
        return, in its order."""
        W, K = self.max_size, self.keep
        if n > 1:
            kept = min(self.valid_len, W - 1)
            sinks = min(K, kept)
            if kept == self.offset:
                old = list(range(self.offset))
            else:
                old = list(range(sinks)) + list(range(self.offset - (kept - sinks), self.offset))
            return old + list(range(self.offset, self.offset + n))
        # Replay the decode's cursor arithmetic without writing. Growth never
        # matters here: an unwrapped ring returns [0, q] whatever its
        # capacity, and a wrapped one has exactly W slots.
        q, idx = self.offset, self.idx
        if self.capacity > W:
            idx = W
        if idx >= W:
            idx = K
        if q == idx:
            return list(range(q + 1))
        # Wrapped: the sinks, then the latest W - K positions in cyclic order
        # ending at slot idx, where position q lands.
        return [j if j < K else q - ((idx - j) % (W - K)) for j in range(W)]

    def _decode_sees_every_key(self, window: int) -> bool:
        """Whether a decode's query (position ``offset``) sees every key the
        decode returns under a ``window`` (sinks always seen): the oldest
        non-sink key is within ``window - keep`` of it. The keys are
        :meth:`_next_positions`'s for one row: unwrapped, positions ``[0,
        q]`` (oldest non-sink ``keep``, if ``q >= keep``); wrapped, the sinks
        and the latest ``W - keep`` positions (oldest ``q - (W - keep - 1)``).
        Arithmetic only: make_mask is called once per layer per step."""
        W, K, q, idx = self.max_size, self.keep, self.offset, self.idx
        if self.capacity > W:
            idx = W
        if idx >= W:
            idx = K
        if q == idx:  # unwrapped
            return q < K or q - K < window - K
        return W - K - 1 < window - K

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        """Mask for ``N`` queries about to be appended (mlx-lm calls it
        before ``update_and_fetch``). Returns ``None`` (decode, every key
        visible), ``"causal"`` (plain causal is exact) or a bool ``[N, L]``
        array over the keys the append will return, in their (physical)
        order: query ``offset + i`` sees key ``p`` iff ``p <= q`` and ``p`` is
        a sink or ``q - p < window - keep`` (``window`` defaults to
        ``max_size``). Raises InvalidArgumentError for ``N < 1`` and for a
        ``window_size`` that is not None or an integer >= 1
        (kvspec.spec.dense.check_window_size)."""
        N = _check_int("make_mask", "N", N)
        if N < 1:
            raise InvalidArgumentError(f"make_mask: N must be >= 1, got {N}")
        window_size = check_window_size("make_mask", window_size)
        window = self.max_size if window_size is None else window_size
        if N == 1 and not return_array and self._decode_sees_every_key(window):
            return None  # a decode step's common case, decided in O(1) (no positions built)
        positions = np.asarray(self._next_positions(N), dtype=np.int64)
        # O(N + L) here (no per-element Python work); kvspec.impl.masks builds it
        # where the arrays live
        mask = ring_mask(positions, self.offset, N, self.keep, window)
        if return_array:
            return mask
        # The window hides no causal key iff it spares the oldest non-sink
        # from the last query (the pair with the largest distance).
        nonsink = positions[positions >= self.keep]
        none_hidden = nonsink.size == 0 or (self.offset + N - 1) - int(nonsink.min()) < window - self.keep
        if not none_hidden:
            return mask
        # Every key is at or before each query's own position: a decode sees
        # them all; a multi-row append returns its keys in time order, so
        # its mask is exactly the causal one.
        return None if N == 1 else "causal"

    # -- mlx-lm protocol --------------------------------------------------------
    @property
    def state(self) -> tuple[mx.array, ...]:
        """The buffers (valid rows, physical order) as new handles; refused
        to mlx-lm's ``save_prompt_cache`` (kvspec.impl.dense.refuse_foreign_save).

        Rule: ``kvspec.spec.rotating.state_of`` (semantics.md 8, "The state protocol")."""
        refuse_foreign_save(self)
        got = self.fetch()
        return () if got is None else got

    @state.setter
    def state(self, v: tuple[mx.array, ...]) -> None:
        """Load rows as an unwrapped ring (offset = idx = rows); ``meta_state``
        then sets the counters. Validated like ``restore``."""
        keys, values = _state_pair("state", v)
        rows = 0 if keys is None else int(keys.shape[SEQ_AXIS])
        self._check_snapshot("state", RingSnapshot(keys, values, rows, rows, self.max_size, self.keep))
        self.keys, self.values, self.offset, self.idx = keys, values, rows, rows
        self._marker = None
        self._log = ()

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(keep, max_size, step, offset, idx)`` as strings (mlx-lm's
        layout), followed by ``undo`` when it is not 0 or the ring is
        strict, and by ``"1"`` when it is strict.

        Rule: ``kvspec.spec.rotating.w_reload`` (semantics.md 8, "The state protocol")."""
        head = (self.keep, self.max_size, self.step, self.offset, self.idx)
        tail = (self.undo, 1) if self.strict else (self.undo,) if self.undo else ()
        return tuple(map(str, head + tail))

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        """Set (keep, max_size, step, offset, idx[, undo[, strict]]) over the
        loaded rows, with an empty undo log (``undo`` 0 and ``strict`` off
        where absent); refused (nothing changes) when the counters do not
        fit them."""
        other = type(self)._from_parts("meta_state", self.keys, self.values, v)
        self.keep, self.max_size, self.step, self.offset, self.idx = other.keep, other.max_size, other.step, other.offset, other.idx
        self.undo, self.strict, self._log = other.undo, other.strict, ()
        self._marker = None

    @classmethod
    def from_state(cls, state: tuple[mx.array, ...], meta_state: tuple[str, ...]) -> RotatingKVCache:
        """Rebuild a ring from ``state`` (``(keys, values)``, ``[B, H,
        T, D]`` in physical slot order, or ``()``) and ``meta_state``
        (``(keep, max_size, step, offset, idx)`` as strings, mlx-lm's
        layout, optionally followed by ``undo`` and then ``strict``, 0 or
        1; the log starts empty: a
        rebuilt ring cannot roll back into the saved one's history). Raises InvalidArgumentError for a malformed state or
        meta_state, or counters that do not fit the rows (the checks of
        :meth:`restore`).

        Rule: ``kvspec.spec.rotating.w_reload`` (semantics.md 3, "restore clears the log")."""
        return cls._from_parts("from_state", *_state_pair("from_state", state), meta_state)

    @classmethod
    def _from_parts(cls, op: str, keys: mx.array | None, values: mx.array | None, meta: Any) -> RotatingKVCache:
        try:
            ints = [int(x) for x in meta]
            if len(ints) not in (5, 6, 7) or ints[6:] not in ([], [0], [1]):
                raise ValueError
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"{op}: meta_state must be five to seven integers (keep, max_size, step, offset, idx[, undo[, strict "
                f"0 or 1]]), got {meta!r}"
            ) from None
        keep, max_size, step, offset, idx = ints[:5]
        obj = cls(max_size=max_size, keep=keep, step=step, undo=ints[5] if len(ints) >= 6 else 0,
                  strict=ints[6:] == [1])
        obj._check_snapshot(op, RingSnapshot(keys, values, offset, idx, max_size, keep))
        obj.keys, obj.values, obj.offset, obj.idx = keys, values, offset, idx
        return obj

    def size(self) -> int:
        """Rows a reader sees, ``min(offset, max_size)`` (mlx-lm's ``size()`` of a ring). Rule:
        ``kvspec.spec.rotating.visible_positions`` (semantics.md 3, "what a reader sees")."""
        return min(self.offset, self.max_size)

    def keys_and_values(self) -> tuple[mx.array, mx.array] | None:
        """mlx-lm's name for reading the valid rows without writing: :meth:`fetch`.

        Rule: ``kvspec.spec.rotating.chronological_order`` (semantics.md 3, "what a reader sees")."""
        return self.fetch()

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> Any:
        """mlx-lm's ``kv_bits`` hook. The ring stores the model's float rows
        only: a sliding-window layer stays this ring under ``kv_bits``, as
        under ``make_prompt_cache(mode=...)`` (docs/mlx-lm.md, "Quantized
        caches"), so ``generate(..., kv_bits=B)`` on a model with
        sliding-window layers quantizes the full-attention layers and never
        fails late (mlx-lm's own ring raises NotImplementedError once the
        offset reaches ``quantized_kv_start``). Returns ``self`` and warns
        once per cache (UserWarning) that the ring keeps its rows
        unquantized. Raises InvalidArgumentError for a non-integer
        ``bits`` or ``group_size``.

        Rule: semantics.md 2, "Storage" (a ring stores the rows' own float dtype; semantics.md 8)."""
        bits = _check_int("to_quantized", "bits", bits)
        _check_int("to_quantized", "group_size", group_size)
        if not self._quantize_warned:
            self._quantize_warned = True
            warnings.warn(
                f"to_quantized(bits={bits}): RotatingKVCache(max_size={self.max_size}) is a sliding-window layer and "
                "keeps its rows unquantized (kv_bits applies to the full-attention layers; reported once per cache)",
                UserWarning, stacklevel=2,
            )
        return self

    @classmethod
    def merge(cls, caches: Any) -> Any:
        """mlx-lm's batching hook (``_merge_caches``): one batch ring from one
        ring per sequence, ``kvspec.impl.batch.batch_rotating_class().merge``
        (kvspec.spec.batch.merge; no sinks, one window size)."""
        # kvspec.impl.batch builds on this module; looked up at call time (no import cycle)
        return importlib.import_module("kvspec.impl.batch").batch_rotating_class().merge(caches)

    @classmethod
    def from_mlx_lm(cls, c: Any, step: int = 256) -> RotatingKVCache:
        """mlx-lm's ``RotatingKVCache`` ``c`` as ours, holding the same rows
        in the same physical slots with the same window, sinks, offset and
        cursor (its buffer as it is: unwrapped, wrapped or oversized after a
        block). Raises InvalidArgumentError when its counters do not fit its
        rows.

        Rule: ``kvspec.spec.rotating.ring_slot`` (semantics.md 3, "where a decode writes")."""
        if c.keys is None:
            return cls(max_size=c.max_size, keep=c.keep, step=step)
        rows = min(int(c.offset), int(c.keys.shape[SEQ_AXIS]))
        state = (c.keys[..., :rows, :], c.values[..., :rows, :])
        return cls.from_state(state, tuple(str(int(x)) for x in (c.keep, c.max_size, step, c.offset, c._idx)))

    def empty(self) -> bool:
        """True when the ring holds no buffers. Rule: ``kvspec.spec.rotating.new_cache`` (semantics.md 3,
        "new ring")."""
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers over their capacity (the undo log's saved rows not
        counted); 0 without buffers. Rule: semantics.md 3, "decode (one row)"."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes  # type: ignore[union-attr]

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"RotatingKVCache(W={self.max_size}, K={self.keep}, U={self.undo}, strict={self.strict}, offset={self.offset}, idx={self.idx}, "
                f"capacity={self.capacity})")


__all__ = ["Any", "RingSnapshot", "RotatingKVCache", "UndoRecord", "chronological_slots", "prefill_kept", "ring_visible"]
