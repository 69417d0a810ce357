"""Sliding-window MLX KV cache (spec: ``spec.rotating``).

A ring of at most ``max_size`` (W) slots along axis 2 whose first ``keep``
(K) slots hold attention sinks. Decode steps write at the cursor ``idx``
and wrap to K; multi-row appends re-linearise the ring into chronological
order and return everything so each new query sees a full window.

In-place writes (through a NumPy view of the evaluated buffer) happen only
during warm-up, when the slot being written was never valid, under the
dense cache's ownership proof (seed 003). Once the window is full every
write overwrites the oldest slot, which a prompt-cache snapshot may still
hold, so steady-state writes always copy.

Storage is unquantized only: mode ``"fp16"``, which names the mode, not a
cast: rows are stored and returned in the dtype they come in (float16,
bfloat16 or float32; semantics.md 2 "Storage dtype"). Keys and values may
have different head dims. (The reference engine falls back to Fp16 storage
for quantized modes on sliding-window layers; here such a request is refused
instead of silently changing precision.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from impl.dense import (
    FLOAT_DTYPES,
    SEQ_AXIS,
    _check_int,
    _check_rows,
    _check_tensor,
    check_dtype_matches,
    check_inplace,
    check_matches_cache,
    copy_without_marker,
    share,
    write_rows_inplace,
)
from spec.dense import check_window_size
from spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError


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
    """Slot indices of the valid rows, oldest first (spec.rotating.chronological_order)."""
    if not wrapped:
        return list(range(idx))
    return list(range(keep)) + list(range(idx, n_slots)) + list(range(keep, idx))


def ring_visible(query: int, key: int, window: int, keep: int) -> bool:
    """Mask rule (spec.rotating.mask_visible): causal, and a sink or one of
    the ``window - keep`` latest positions."""
    return key <= query and (key < keep or query - key < window - keep)


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
        if self.keys is None:
            return None
        assert self.values is not None
        n = self.keys.shape[SEQ_AXIS] if self.offset != self.idx else self.idx
        return self.keys[:, :, :n, :], self.values[:, :, :n, :]


class RotatingKVCache:
    """Sliding-window cache with window ``max_size`` and ``keep`` sinks.

    Args:
        max_size: window W in rows (>= 1).
        keep: sink rows K, ``0 <= keep < max_size``; never evicted.
        step: growth granularity in rows (>= 1) during warm-up.
        inplace: the in-place switch: True, False or None (reads
            ``KV_INPLACE_WRITE``); validated like the dense cache's.
        mode: ``"fp16"`` only.

    Raises InvalidArgumentError for bad sizes and UnsupportedOperationError
    for another mode. Observables: ``offset``, ``idx``, ``capacity``,
    ``last_write_inplace``.
    """

    def __init__(self, max_size: int, keep: int = 0, step: int = 256, inplace: bool | None = None, mode: str = "fp16"):
        if mode != "fp16":
            raise UnsupportedOperationError(f"RotatingKVCache: mode must be 'fp16', got {mode!r}")
        max_size = _check_int("RotatingKVCache", "max_size", max_size)
        keep = _check_int("RotatingKVCache", "keep", keep)
        step = _check_int("RotatingKVCache", "step", step)
        if max_size < 1:
            raise InvalidArgumentError(f"RotatingKVCache: max_size must be >= 1, got {max_size}")
        if keep < 0 or keep >= max_size:
            raise InvalidArgumentError(f"RotatingKVCache: keep must satisfy 0 <= keep < max_size ({max_size}), got {keep}")
        if step < 1:
            raise InvalidArgumentError(f"RotatingKVCache: step must be >= 1, got {step}")
        self.max_size, self.keep, self.step, self.mode = max_size, keep, step, mode
        self.inplace = check_inplace("RotatingKVCache", inplace)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.idx = 0
        self._marker: tuple[mx.array, mx.array, int] | None = None
        self.last_write_inplace = False

    # -- observables --------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[SEQ_AXIS])

    @property
    def wrapped(self) -> bool:
        return self.offset != self.idx

    @property
    def valid_len(self) -> int:
        return self.capacity if self.wrapped else self.idx

    def fetch(self) -> tuple[mx.array, mx.array] | None:
        """Valid rows in physical slot order, ``[B, H, n, D]`` in the rows' dtype."""
        if self.keys is None:  # keys and values are set and dropped together
            return None
        n = self.valid_len
        return self.keys[:, :, :n, :], self.values[:, :, :n, :]

    # -- writes -----------------------------------------------------------------
    def _set_buffers(self, keys: mx.array, values: mx.array) -> None:
        self.keys, self.values = keys, values

    def _owns_buffers(self) -> bool:
        m = self._marker
        return m is not None and m[0] is self.keys and m[1] is self.values

    def _inplace_write_allowed(self) -> bool:
        """Warm-up rule (spec.rotating.rotating_inplace_allowed): the window
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
        if inplace:
            write_rows_inplace(self.keys, k, self.idx)
            write_rows_inplace(self.values, v, self.idx)
        else:
            start = mx.array([self.idx])
            self._set_buffers(
                mx.slice_update(self.keys, k, start, axes=(SEQ_AXIS,)),
                mx.slice_update(self.values, v, start, axes=(SEQ_AXIS,)),
            )

    def _decode(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        W, K = self.max_size, self.keep
        if self.keys is not None and self.capacity > W:
            # An oversized buffer (after a multi-row append) is cut to its
            # sinks and latest W - K rows, in chronological order already.
            cut = self.capacity - (W - K)
            self._set_buffers(*(mx.concatenate([a[:, :, :K, :], a[:, :, cut:, :]], axis=SEQ_AXIS) for a in (self.keys, self.values)))  # type: ignore[index]
            self.idx = W
        if self.keys is None or (self.idx >= self.capacity and self.capacity < W):
            grow = min(self.step, W - self.capacity)
            zk = mx.zeros((k.shape[0], k.shape[1], grow, k.shape[3]), dtype=k.dtype)
            zv = mx.zeros((v.shape[0], v.shape[1], grow, v.shape[3]), dtype=v.dtype)
            if self.keys is None:
                self._set_buffers(zk, zv)
            else:
                self._set_buffers(mx.concatenate([self.keys, zk], axis=SEQ_AXIS), mx.concatenate([self.values, zv], axis=SEQ_AXIS))  # type: ignore[list-item]
        if self.idx >= W:
            self.idx = K
        inplace = self._inplace_write_allowed()
        self._write_row(k, v, inplace)
        self.offset += 1
        self.idx += 1
        self.last_write_inplace = inplace
        return self.fetch()  # type: ignore[return-value]

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
        rows (the message names it)."""
        n = _check_rows("append", keys, values)
        if self.keys is not None:
            assert self.values is not None
            check_matches_cache("append", "keys", tuple(self.keys.shape), keys)
            check_matches_cache("append", "values", tuple(self.values.shape), values)
            check_dtype_matches("append", self.keys.dtype, keys.dtype)
        k, v = keys, values
        out = self._decode(k, v) if n == 1 else self._prefill(k, v)
        self._marker = (self.keys, self.values, self.idx)  # type: ignore[assignment]
        return out

    # -- trims ------------------------------------------------------------------
    def is_trimmable(self) -> bool:
        """True only while trim is exact: unwrapped and not oversized
        (spec.rotating.is_trimmable)."""
        return self.idx == self.offset and self.offset <= self.max_size and self.capacity <= self.max_size

    def trim(self, n: int) -> int:
        """Rewind ``n`` rows (clamped to ``[0, offset]``) by moving offset and
        idx; the buffers stay (O(1)). On a wrapped ring trims nothing and
        returns 0 (fail closed)."""
        n = _check_int("trim", "n", n)
        if not self.is_trimmable():
            return 0
        n = max(0, min(n, self.offset))
        self.offset -= n
        self.idx -= n
        if self.offset == 0 and n:
            self.keys = self.values = None
            self._marker = None
        return n

    def trim_to(self, length: int) -> int:
        """``trim(offset - length)``. Raises InvalidArgumentError unless
        ``0 <= length <= offset``; StateError when ``length < offset`` and the
        ring cannot trim exactly."""
        length = _check_int("trim_to", "len", length)
        if length < 0 or length > self.offset:
            raise InvalidArgumentError(f"trim_to: len must satisfy 0 <= len <= offset ({self.offset}), got {length}")
        if length < self.offset and not self.is_trimmable():
            raise StateError(
                f"trim_to: cannot trim a wrapped sliding-window ring exactly (offset={self.offset}, "
                f"idx={self.idx}, max_size={self.max_size}), got len={length}"
            )
        return self.trim(self.offset - length)

    # -- snapshots -------------------------------------------------------------
    def __copy__(self) -> RotatingKVCache:
        return copy_without_marker(self)

    def __deepcopy__(self, memo: dict) -> RotatingKVCache:
        return copy_without_marker(self, memo)

    def snapshot(self) -> RingSnapshot:
        """New handles to the same buffers (O(1)) and the counters."""
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
        or mismatched snapshot."""
        self._check_snapshot("restore", snapshot)
        self.keys = None if snapshot.keys is None else share(snapshot.keys)
        self.values = None if snapshot.values is None else share(snapshot.values)
        self.offset, self.idx = snapshot.offset, snapshot.idx
        self._marker = None

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

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        """Mask for ``N`` queries about to be appended (mlx-lm calls it
        before ``update_and_fetch``). Returns ``None`` (decode, every key
        visible), ``"causal"`` (plain causal is exact) or a bool ``[N, L]``
        array over the keys the append will return, in their (physical)
        order: query ``offset + i`` sees key ``p`` iff ``p <= q`` and ``p`` is
        a sink or ``q - p < window - keep`` (``window`` defaults to
        ``max_size``). Raises InvalidArgumentError for ``N < 1`` and for a
        ``window_size`` that is not None or an integer >= 1
        (spec.dense.check_window_size)."""
        N = _check_int("make_mask", "N", N)
        if N < 1:
            raise InvalidArgumentError(f"make_mask: N must be >= 1, got {N}")
        window_size = check_window_size("make_mask", window_size)
        window = self.max_size if window_size is None else window_size
        positions = self._next_positions(N)
        rows = [[ring_visible(self.offset + i, p, window, self.keep) for p in positions] for i in range(N)]
        mask = mx.array(np.array(rows).reshape(N, len(positions)))
        if return_array:
            return mask
        L = len(positions)
        if N == 1 and all(rows[0]):
            return None
        causal = [[j <= L - N + i for j in range(L)] for i in range(N)]
        if rows == causal:
            return "causal"
        return mask

    # -- mlx-lm protocol --------------------------------------------------------
    @property
    def state(self) -> tuple[mx.array, ...]:
        """The buffers (valid rows, physical order) as new handles."""
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

    @property
    def meta_state(self) -> tuple[str, ...]:
        return tuple(map(str, (self.keep, self.max_size, self.step, self.offset, self.idx)))

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        """Set (keep, max_size, step, offset, idx) over the loaded rows;
        refused (nothing changes) when the counters do not fit them."""
        other = type(self)._from_parts("meta_state", self.keys, self.values, v)
        self.keep, self.max_size, self.step, self.offset, self.idx = other.keep, other.max_size, other.step, other.offset, other.idx
        self._marker = None

    @classmethod
    def from_state(cls, state: tuple[mx.array, ...], meta_state: tuple[str, ...]) -> RotatingKVCache:
        """Rebuild a ring from ``state`` (``(keys, values)``, ``[B, H,
        T, D]`` in physical slot order, or ``()``) and ``meta_state``
        (``(keep, max_size, step, offset, idx)`` as strings, mlx-lm's
        layout). Raises InvalidArgumentError for a malformed state or
        meta_state, or counters that do not fit the rows (the checks of
        :meth:`restore`)."""
        return cls._from_parts("from_state", *_state_pair("from_state", state), meta_state)

    @classmethod
    def _from_parts(cls, op: str, keys: mx.array | None, values: mx.array | None, meta: Any) -> RotatingKVCache:
        try:
            keep, max_size, step, offset, idx = (int(x) for x in meta)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"{op}: meta_state must be five integers (keep, max_size, step, offset, idx), got {meta!r}") from None
        obj = cls(max_size=max_size, keep=keep, step=step)
        obj._check_snapshot(op, RingSnapshot(keys, values, offset, idx, max_size, keep))
        obj.keys, obj.values, obj.offset, obj.idx = keys, values, offset, idx
        return obj

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes  # type: ignore[union-attr]

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"RotatingKVCache(W={self.max_size}, K={self.keep}, offset={self.offset}, idx={self.idx}, capacity={self.capacity})"


__all__ = ["Any", "RingSnapshot", "RotatingKVCache", "chronological_slots", "ring_visible"]
