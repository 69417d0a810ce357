"""A cell cache shared by several sequences, as llama.cpp's KV memory keeps
one (spec: ``kvspec.spec.cells``; docs/cells.md; docs/semantics.md section 10).

A **memory** is one or two **stores** that receive every op together:
``"full"`` (attention over every cell, never drops a cell) and, for an
interleaved sliding-window model, ``"window"`` (window ``w >= 1``: a token at
position ``p`` attends to positions ``q`` with ``p - q < w``); a memory of a
window store alone is allowed. The full store holds ``n_cells`` **cells**,
the window store ``window_cells`` (``<= n_cells``: llama.cpp sizes its
sliding-window store smaller, llama-kv-cache-iswa.cpp); per
cell a K row and a V row of shape ``(kv_heads, head_dim)`` in the cache's
dtype (float16, bfloat16 or float32, stored as handed in), and on the host
its position (``-1``: free), the set of **sequence ids** holding it (a cell
whose set becomes empty is free) and its **pending shift** (the sum of the
position moves not yet applied to its K row).

K rows are rotated by position (rotate-half RoPE, :func:`rope_shift`); V rows
are not. ``seq_add`` and ``seq_div`` move positions at once and add the move
to the cell's pending shift (successive shifts accumulate); :meth:`CellCache.
update` re-rotates every K row with a pending shift and clears it. ``decode``,
``view``, ``save`` and ``cells`` call it first, so no read ever sees a K row
rotated for another position than its cell's.

Slot search keeps a head pointer per store, as llama.cpp's ``find_slot``: a
decode takes free cells from the head on (wrapping); in a window store, when
no free cell is left, it reuses **droppable** cells, lowest position first
(a cell held by exactly one sequence ``h`` with ``(pos_max(h) + 1) - pos >= w``,
``pos_max`` read before the decode, after the group is validated). A restore
finds its cells the same way, after clearing its destination. The holder of a reused cell keeps the
cell as a **lost** cell (position and holders, no row, no capacity): the
sequence's **logical** positions (the first store's cells, lost ones
included) are what it would hold had the window kept every cell. Lost cells
move, are shared and are removed as present ones are. A partial ``seq_rm``
that would leave a lost position inside the next decode's window is refused
(returns False), the windowed analog of the ring's undo bound.

Every op checks all its arguments and its capacity before it changes
anything: a refusal (an exception of ``kvspec.spec.errors``, or a False return)
leaves buffers and metadata as they were. The rules are stated here on their
own (``kvspec.spec.cells`` states them independently; the fuzzer compares both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.impl.write import write_copy
from kvspec.spec.errors import InvalidArgumentError, StateError

STORES = ("full", "window")
_LAYOUTS = (("full",), ("full", "window"), ("window",))
_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _int(op: str, name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise InvalidArgumentError(f"{op}: {name} must be an integer, got {v!r}")
    return int(v)


def _is_int(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, np.integer))


def _range(op: str, p0: Any, p1: Any) -> tuple[int, int | None]:
    """``[p0, p1)`` as llama.h reads it: ``p0 < 0`` is 0, ``p1`` None or
    ``< 0`` is infinity (None)."""
    if not _is_int(p0):
        raise InvalidArgumentError(f"{op}: p0 must be an integer (< 0 reads as 0), got {p0!r}")
    if p1 is not None and not _is_int(p1):
        raise InvalidArgumentError(f"{op}: p1 must be an integer or None (< 0 or None: to infinity), got {p1!r}")
    p0 = max(0, int(p0))
    if p1 is not None:
        p1 = int(p1)
        if p1 < 0:
            p1 = None
    return p0, p1


def _in(pos: int, p0: int, p1: int | None) -> bool:
    return pos >= p0 and (p1 is None or pos < p1)


def to_host(a: mx.array) -> np.ndarray:
    """A NumPy copy of ``a`` (evaluated first), never sharing its memory.
    bfloat16, which NumPy lacks, comes back as its uint16 bit pattern
    (``from_host`` reads it back exactly)."""
    if a.dtype == mx.bfloat16:
        a = mx.view(a, mx.uint16)
    mx.eval(a)
    return np.array(a, copy=True)


def from_host(a: np.ndarray, dtype: Any) -> mx.array:
    """The inverse of :func:`to_host`: an ``mx.array`` of ``dtype`` holding a
    copy of ``a`` (a uint16 bit pattern for bfloat16)."""
    if dtype == mx.bfloat16:
        return mx.view(mx.array(np.ascontiguousarray(a, dtype=np.uint16)), mx.bfloat16)
    return mx.array(np.array(a, copy=True)).astype(dtype)


def rope_shift(keys: mx.array, delta: Any, base: float = 10000.0) -> mx.array:
    """Rotate K rows by per-row position deltas (rotate-half RoPE).

    Args:
        keys: ``(n, kv_heads, head_dim)`` (or ``(n, head_dim)``), float16,
            bfloat16 or float32; head_dim even.
        delta: ``n`` integers (a sequence, NumPy or ``mx`` array), in
            positions: row ``i`` is rotated by ``delta[i]`` (a row rotated
            for position ``p`` comes back rotated for ``p + delta[i]``).
        base: the RoPE base (theta), > 0.

    Returns ``(n, ..., head_dim)`` in the dtype of ``keys``. Rule: with
    ``h = head_dim / 2`` and ``f_j = base ** (-2 j / head_dim)``, the pair
    ``(x_j, x_{j+h})`` becomes ``(x_j cos a - x_{j+h} sin a, x_{j+h} cos a +
    x_j sin a)`` with ``a = delta * f_j``. Angles are taken in float64 on the
    host, the rotation in float32, then cast back. ``rope_shift(raw, p)``
    is a raw row placed at position ``p``.

    Raises InvalidArgumentError for an odd head_dim or a delta count other
    than ``n``.
    """
    d = keys.shape[-1]
    if d % 2:
        raise InvalidArgumentError(f"rope_shift: head_dim must be even, got {d}")
    deltas = np.asarray(delta, dtype=np.float64).reshape(-1)
    if deltas.shape[0] != keys.shape[0]:
        raise InvalidArgumentError(f"rope_shift: delta must give one integer per row, got {deltas.shape[0]} for "
                                   f"{keys.shape[0]} rows")
    h = d // 2
    freqs = float(base) ** (-2.0 * np.arange(h, dtype=np.float64) / d)
    angles = deltas[:, None] * freqs[None, :]
    shape = (keys.shape[0],) + (1,) * (keys.ndim - 2) + (h,)
    cos = mx.array(np.cos(angles).astype(np.float32).reshape(shape))
    sin = mx.array(np.sin(angles).astype(np.float32).reshape(shape))
    x = keys.astype(mx.float32)
    x1, x2 = x[..., :h], x[..., h:]
    out = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(keys.dtype)


@dataclass(frozen=True)
class CellsSnapshot:
    """One sequence's state (what :meth:`CellCache.save` returns), on the
    host: per store, the sequence's cells in position order as
    ``(positions, keys, values)`` with ``positions`` int64 ``(n,)`` and
    ``keys``/``values`` NumPy ``(n, kv_heads, head_dim)`` copies (float16,
    float32, or the uint16 bit pattern of bfloat16), K rows rotated for
    their positions (no pending shift). Shares no memory with any cache."""

    stores: tuple[str, ...]
    kv_heads: int
    head_dim: int
    dtype: str
    cells: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]

    def positions(self, store: str) -> list[int]:
        """The positions the snapshot holds in ``store``, increasing. Rule: kvspec.spec.cells.save."""
        return [int(p) for p in self.cells[store][0]]

    def rows(self, store: str) -> list[tuple[int, mx.array, mx.array]]:
        """``(pos, k_row, v_row)`` per cell of ``store``, rows as
        ``mx.array`` ``(kv_heads, head_dim)`` in the snapshot's dtype (new
        arrays: the snapshot stays unchanged). Rule: kvspec.spec.cells.observe_snapshot."""
        pos, k, v = self.cells[store]
        dt = _DTYPES[self.dtype]
        return [(int(p), from_host(k[i], dt), from_host(v[i], dt)) for i, p in enumerate(pos)]


class _Store:
    """One store: K/V buffers ``(n_cells, kv_heads, head_dim)``, host
    metadata per cell (position, holders, pending shift), the head, and
    (window store) the lost cells as ``(pos, seqs)`` (no row, no capacity)."""

    __slots__ = ("head", "k", "lost", "name", "pos", "seqs", "shift", "v")

    def __init__(self, name: str, n_cells: int, kv_heads: int, head_dim: int, dtype: Any):
        self.name = name
        self.pos = [-1] * n_cells
        self.seqs: list[frozenset[int]] = [frozenset()] * n_cells
        self.shift = [0] * n_cells
        self.lost: list[tuple[int, frozenset[int]]] = []
        self.head = 0
        self.k = mx.zeros((n_cells, kv_heads, head_dim), dtype)
        self.v = mx.zeros((n_cells, kv_heads, head_dim), dtype)

    def clone(self) -> _Store:
        new = _Store.__new__(_Store)
        new.name, new.head, new.k, new.v = self.name, self.head, self.k, self.v
        new.pos, new.seqs, new.shift, new.lost = list(self.pos), list(self.seqs), list(self.shift), list(self.lost)
        return new

    def used(self) -> list[int]:
        return [i for i, p in enumerate(self.pos) if p >= 0]

    def free_count(self) -> int:
        return sum(1 for p in self.pos if p < 0)

    def of(self, seq: int) -> list[int]:
        return [i for i, p in enumerate(self.pos) if p >= 0 and seq in self.seqs[i]]

    def positions(self, seq: int, lost: bool = True) -> list[int]:
        """``seq``'s positions: present cells, and lost ones if ``lost``."""
        out = [self.pos[i] for i in self.of(seq)]
        if lost:
            out += [p for p, ss in self.lost if seq in ss]
        return out

    def free(self, i: int) -> None:
        self.pos[i], self.seqs[i], self.shift[i] = -1, frozenset(), 0

    def collision(self) -> tuple[int, int] | None:
        """``(seq, pos)`` of a sequence holding two cells (present or lost)
        at one position: the lowest such position, then the lowest such
        sequence; None if none."""
        seen: set[tuple[int, int]] = set()
        hits = []
        for p, ss in [(self.pos[i], self.seqs[i]) for i in self.used()] + self.lost:
            for s in ss:
                if (s, p) in seen:
                    hits.append((p, s))
                seen.add((s, p))
        if not hits:
            return None
        pos, seq = min(hits)
        return seq, pos

    def write(self, idxs: list[int], k: mx.array, v: mx.array, keys_only: bool = False) -> None:
        """Rows ``k[j]``/``v[j]`` into cells ``idxs[j]``, one static slice
        write (``kvspec.impl.write.write_copy``) per run of consecutive cells."""
        j = 0
        while j < len(idxs):
            e = j + 1
            while e < len(idxs) and idxs[e] == idxs[e - 1] + 1:
                e += 1
            sl = (slice(idxs[j], idxs[e - 1] + 1),)
            self.k = write_copy(self.k, k[j:e], sl)
            if not keys_only:
                self.v = write_copy(self.v, v[j:e], sl)
            j = e


class CellCache:
    """llama.cpp's KV memory as an MLX cell cache (``kvspec.spec.cells``).

    Args:
        n_cells: cells per store, int >= 1.
        kv_heads: K/V heads, int >= 1.
        head_dim: int >= 2, even (rotate-half RoPE).
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"`` (or the
            ``mx`` dtype): the rows' dtype, stored as handed in.
        window: ``w``, int >= 1, required iff a ``"window"`` store exists.
        window_cells: cells of the window store, int with ``1 <=
            window_cells <= n_cells``, or None (default) for ``n_cells``;
            without a window store only None or ``n_cells``.
        stores: ``("full",)``, ``("full", "window")`` or ``("window",)``.
        n_seq: sequence ids ``0 .. n_seq - 1``, int >= 1.
        rope_base: RoPE base used to re-rotate shifted K rows, > 0.

    Positions are token positions (int >= 0); ranges ``[p0, p1)`` read
    ``p0 < 0`` as 0 and ``p1`` None or ``< 0`` as infinity. Every op raises
    InvalidArgumentError (``kvspec.spec.errors``) for a bad argument, naming the
    op, the argument, its value and the rule; a refusal changes nothing.
    """

    def __init__(self, n_cells: int, kv_heads: int, head_dim: int, dtype: Any = "float16",
                 window: int | None = None, stores: tuple[str, ...] = ("full",), n_seq: int = 4,
                 rope_base: float = 10000.0, window_cells: int | None = None):
        op = "CellCache"
        n_cells, kv_heads, head_dim, n_seq = (_int(op, n, v) for n, v in (
            ("n_cells", n_cells), ("kv_heads", kv_heads), ("head_dim", head_dim), ("n_seq", n_seq)))
        for name, v, lo in (("n_cells", n_cells, 1), ("kv_heads", kv_heads, 1), ("head_dim", head_dim, 2),
                            ("n_seq", n_seq, 1)):
            if v < lo:
                raise InvalidArgumentError(f"{op}: {name} must be >= {lo}, got {v}")
        if head_dim % 2:
            raise InvalidArgumentError(f"{op}: head_dim must be even (rotate-half RoPE), got {head_dim}")
        dt = _DTYPES.get(dtype) if isinstance(dtype, str) else (dtype if dtype in _NAMES else None)
        if dt is None:
            raise InvalidArgumentError(f"{op}: dtype must be float16, bfloat16 or float32, got {dtype!r}")
        stores = tuple(stores) if isinstance(stores, (list, tuple)) else stores
        if stores not in _LAYOUTS:
            raise InvalidArgumentError(f"{op}: stores must be one of {[list(x) for x in _LAYOUTS]}, got {stores!r}")
        if "window" in stores:
            if window is None:
                raise InvalidArgumentError(f"{op}: window must be an integer >= 1 with a window store, got None")
            window = _int(op, "window", window)
            if window < 1:
                raise InvalidArgumentError(f"{op}: window must be >= 1, got {window}")
        elif window is not None:
            raise InvalidArgumentError(f"{op}: window must be None without a window store, got {window!r}")
        if window_cells is None:
            window_cells = n_cells
        if isinstance(window_cells, bool) or not isinstance(window_cells, (int, np.integer)) \
                or not 1 <= window_cells <= n_cells:
            raise InvalidArgumentError(f"{op}: window_cells must be an integer with 1 <= window_cells <= n_cells "
                                       f"({n_cells}), got {window_cells!r}")
        window_cells = int(window_cells)
        if "window" not in stores and window_cells != n_cells:
            raise InvalidArgumentError(f"{op}: window_cells must be None or n_cells ({n_cells}) without a window "
                                       f"store, got {window_cells!r}")
        if isinstance(rope_base, bool) or not isinstance(rope_base, (int, float)) or not rope_base > 0:
            raise InvalidArgumentError(f"{op}: rope_base must be a number > 0, got {rope_base!r}")
        self.n_cells, self.kv_heads, self.head_dim, self.n_seq = n_cells, kv_heads, head_dim, n_seq
        self.dtype, self.window, self.stores, self.rope_base = dt, window, stores, float(rope_base)
        self.window_cells = window_cells
        self._st = {s: _Store(s, window_cells if s == "window" else n_cells, kv_heads, head_dim, dt) for s in stores}

    #: which droppable window cells a write reuses first (free cells always
    #: come first): the lowest position first, as ``kvspec.spec.cells`` drops them
    drop_policy = "lowest position first"  # kvspec.spec.cells.DROP_POLICY

    # -- helpers --------------------------------------------------------------------
    def _seq(self, op: str, name: str, v: Any, allow_all: bool = False) -> int:
        ok = not isinstance(v, bool) and isinstance(v, (int, np.integer))
        if ok and allow_all and v == -1:
            return -1
        if not ok or not 0 <= v < self.n_seq:
            extra = "-1 (every sequence) or " if allow_all else ""
            raise InvalidArgumentError(f"{op}: {name} must be {extra}a sequence id in 0..{self.n_seq - 1}, got {v!r}")
        return int(v)

    def _main(self) -> _Store:
        """The store pos_min/pos_max read: the window store if present
        (llama.cpp's iSWA memory reads its SWA cache), else the full one."""
        return self._st["window"] if "window" in self._st else self._st["full"]

    def _clone(self) -> dict[str, _Store]:
        return {name: st.clone() for name, st in self._st.items()}

    @staticmethod
    def _logical_max(stores: dict[str, _Store], seq: int) -> int:
        """The largest logical position of ``seq`` (what it would hold had
        no windowed cell been dropped: the first store's cells, lost ones
        included), -1 if none. A decode continues at ``logical_max + 1``."""
        return max(next(iter(stores.values())).positions(seq), default=-1)

    def _droppable(self, stores: dict[str, _Store], st: _Store) -> list[int]:
        """Cells of a window store a write may reuse: held by exactly one
        sequence ``h`` with ``(top + 1) - pos >= w``, ``top`` the larger of
        the cell's position and ``h``'s logical pos_max; lowest position
        first (ties: lowest cell)."""
        if st.name != "window":
            return []
        tops: dict[int, int] = {}
        out = []
        for i in st.used():
            if len(st.seqs[i]) == 1:
                (h,) = st.seqs[i]
                if h not in tops:
                    tops[h] = self._logical_max(stores, h)
                if (max(tops[h], st.pos[i]) + 1) - st.pos[i] >= self.window:
                    out.append(i)
        return sorted(out, key=lambda i: (st.pos[i], i))

    def _slots(self, stores: dict[str, _Store], st: _Store, n: int, reuse: bool = True,
               keep: set[tuple[int, frozenset[int]]] | None = None) -> list[int] | None:
        """``n`` cells for a write, or None (no slot): free cells from the
        head on (the head restarts at 0 when enough cells below it are free,
        as llama.cpp's find_slot), then (``reuse``) droppable ones
        (``keep``: only those whose ``(pos, seqs)`` is in it: the cells
        droppable before a recorded drop)."""
        size = len(st.pos)
        head = st.head
        if head > (size - st.free_count()) + 2 * n:
            head = 0
        order = [(head + j) % size for j in range(size)]
        free = [i for i in order if st.pos[i] < 0][:n]
        if len(free) < n:
            drop = self._droppable(stores, st) if reuse else []
            if keep is not None:
                drop = [i for i in drop if (st.pos[i], st.seqs[i]) in keep]
            if len(free) + len(drop) < n:
                return None
            free += drop[:n - len(free)]
        return free

    def _apply_drops(self, op: str, stores: dict[str, _Store], drops: Any) -> set[tuple[int, frozenset[int]]]:
        """Follow a recorded choice of window cells to drop (``drops``, as
        ``kvspec.spec.cells.drop`` takes them: ``(pos, seqs, token)`` for a whole
        cell held by one sequence and out of its window, or ``((pos, seqs,
        token), seq)`` for ``seq`` forgetting a cell out of its window) on
        ``stores`` (a clone): each dropped cell is freed and kept as lost.
        Returns the ``(pos, seqs)`` of the cells droppable before the drops
        that are still present (what the write may reuse next). Raises
        StateError naming the first cell that may not go."""
        st = stores.get("window")
        if st is None:
            raise StateError(f"{op}: drops name window cells, but the cache has no window store")
        before = [(st.pos[i], st.seqs[i]) for i in self._droppable(stores, st)]
        tops = {s: self._logical_max(stores, s) for s in range(self.n_seq)}
        for item in drops:
            pair = isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], (tuple, list))
            key, seq = (item[0], item[1]) if pair else (item, None)
            try:
                pos, held = int(key[0]), frozenset(int(x) for x in key[1])
            except (TypeError, ValueError, IndexError):
                raise StateError(f"{op}: a dropped cell must be (pos, seqs, token) or ((pos, seqs, token), seq), "
                                 f"got {item!r}") from None
            i = next((j for j in st.used() if st.pos[j] == pos and st.seqs[j] == held), None)
            ok = i is not None and (((pos, held) in before) if seq is None else
                                    (seq in held and (max(tops[seq], pos) + 1) - pos >= self.window))
            if not ok:
                raise StateError(f"{op}: the window cell (pos={pos}, seqs={sorted(held)}) may not be dropped"
                                 + ("" if seq is None else f" by sequence {seq}"))
            gone = held if seq is None else frozenset({seq})
            st.lost.append((pos, gone))
            st.seqs[i] = held - gone
            if not st.seqs[i]:
                st.free(i)
        return {(st.pos[i], st.seqs[i]) for i in st.used() if (st.pos[i], st.seqs[i]) in set(before)}

    def _rows(self, op: str, name: str, a: Any, store: str) -> mx.array:
        if isinstance(a, dict):
            if store not in a:
                raise InvalidArgumentError(f"{op}: {name} must give rows for every store {list(self.stores)}, "
                                           f"missing {store!r}")
            a = a[store]
        if not isinstance(a, mx.array):
            raise InvalidArgumentError(f"{op}: {name} must be an mx.array (or a dict store -> mx.array), "
                                       f"got {type(a).__name__}")
        if a.ndim == 3 and a.shape[0] == 0:
            raise InvalidArgumentError(f"{op}: tokens must hold n >= 1 tokens (one K and V row each), got 0")
        if a.ndim != 3 or tuple(a.shape[1:]) != (self.kv_heads, self.head_dim):
            raise InvalidArgumentError(f"{op}: {name} must have shape (n >= 1, kv_heads={self.kv_heads}, "
                                       f"head_dim={self.head_dim}), got {tuple(a.shape)}")
        if a.dtype != self.dtype:
            raise InvalidArgumentError(f"{op}: {name} dtype must be the cache's {_NAMES[self.dtype]}, "
                                       f"got {a.dtype}")
        return a

    @staticmethod
    def _check_collisions(op: str, stores: dict[str, _Store], what: Any) -> None:
        """InvalidArgumentError when some sequence holds two cells at one
        position in a store (the first store with one; within it, the
        lowest such position). ``what``: the op's words before "would give
        ..." (a str), or a function ``(seq, pos) -> message``."""
        for st in stores.values():
            hit = st.collision()
            if hit is not None:
                if callable(what):
                    raise InvalidArgumentError(what(*hit))
                raise InvalidArgumentError(f"{op}: {what} would give sequence {hit[0]} two cells at position "
                                           f"{hit[1]}; remove the target range first")

    # -- decode -----------------------------------------------------------------------
    def decode(self, seqs: Any, keys: Any, values: Any, pos0: int, drops: Any = None) -> bool:
        """Write one group of ``n`` tokens held by every sequence in ``seqs``
        at positions ``pos0 .. pos0 + n - 1`` (llama_decode of one ubatch).

        Args:
            seqs: a non-empty tuple/list of distinct sequence ids.
            keys, values: ``mx.array`` ``(n, kv_heads, head_dim)`` in the
                cache's dtype (K rotated for its position), or a dict
                store -> such an array (one pair per store, the same ``n``).
            pos0: the first position, int >= 0.

        Returns True on success; False (nothing changes: llama_decode's 1,
        "no slot") when a store has fewer usable cells than ``n`` (usable:
        free, plus droppable in a window store; free cells are taken first,
        then droppable ones, lowest position first; each reused cell becomes
        lost for its holder). Raises InvalidArgumentError (nothing changes)
        for a sequence id out of range, ``seqs`` empty or repeated, the
        sequences of the group differing in ``pos_min`` or ``pos_max``
        (coupled sequences, llama-batch.cpp), a sequence holding positions
        whose largest logical position is not ``pos0 - 1`` (positions stay
        consecutive), ``pos0 < 0``, or rows of another shape or dtype.
        Pending shifts are applied first (:meth:`update`).

        ``drops`` (optional, a trace's recorded choice: the window cells
        another target dropped, as ``kvspec.spec.cells.drop`` takes them): those
        cells are dropped first (StateError, nothing changes, for one that
        may not go), then free cells and the remaining droppable ones are
        taken as above.
        Rule: ``kvspec.spec.cells.decode``, ``kvspec.spec.cells.droppable``.
        """
        op = "decode"
        if not isinstance(seqs, (tuple, list)) or not seqs:
            raise InvalidArgumentError(f"{op}: seqs must be a non-empty tuple of sequence ids, got {seqs!r}")
        seqs = tuple(self._seq(op, "seqs", s) for s in seqs)
        if len(set(seqs)) != len(seqs):
            raise InvalidArgumentError(f"{op}: seqs must not repeat a sequence id, got {list(seqs)}")
        rows = {}
        n = None
        for s in self.stores:
            k = self._rows(op, "keys", keys, s)
            v = self._rows(op, "values", values, s)
            if k.shape[0] != v.shape[0] or (n is not None and k.shape[0] != n):
                raise InvalidArgumentError(f"{op}: keys and values must hold the same number of rows n in every "
                                           f"store, got {k.shape[0]} and {v.shape[0]}")
            n = k.shape[0]
            rows[s] = (k, v)
        if not _is_int(pos0) or pos0 < 0:
            raise InvalidArgumentError(f"{op}: pos0 must be an integer >= 0, got {pos0!r}")
        pos0 = int(pos0)
        bounds = {(self.pos_min(s), self.pos_max(s)) for s in seqs}
        if len(bounds) > 1:
            raise InvalidArgumentError(f"{op}: the sequences {list(seqs)} of one group must have the same pos_min "
                                       f"and pos_max (coupled sequences), got {sorted(bounds)}")
        for s in seqs:
            top = self._logical_max(self._st, s)
            if top >= 0 and pos0 != top + 1:
                raise InvalidArgumentError(f"{op}: sequence {s} holds positions up to {top}, so pos0 must be "
                                           f"{top + 1} (positions stay consecutive), got {pos0}")
        stores, keep = self._st, None
        if drops:
            if any(self._slots(self._st, st, n) is None for st in self._st.values()):
                return False
            stores = self._clone()
            keep = self._apply_drops(op, stores, drops)
        slots = {}
        for name, st in stores.items():
            got = self._slots(stores, st, n, keep=keep if name == "window" else None)
            if got is None:
                return False
            slots[name] = got
        self.update()
        if stores is not self._st:
            for name, st in stores.items():
                st.k, st.v, st.shift = self._st[name].k, self._st[name].v, [0] * len(st.pos)
            self._st = stores
        held = frozenset(seqs)
        for name, st in self._st.items():
            for j, i in enumerate(slots[name]):
                if st.pos[i] >= 0:  # a droppable window cell: lost for its holder
                    st.lost.append((st.pos[i], st.seqs[i]))
                st.pos[i], st.seqs[i], st.shift[i] = pos0 + j, held, 0
            st.write(slots[name], *rows[name])
            st.head = (slots[name][-1] + 1) % len(st.pos)
        return True

    # -- removal ------------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int | None = 0, p1: int | None = None) -> bool:
        """Remove ``seq`` (-1: every sequence) from its cells, present and
        lost, with position in ``[p0, p1)``; a cell whose set becomes empty
        is freed.

        Returns True, or False (nothing changes in any store) by the window
        rule: the memory has a window store, the removal is partial (not
        ``p0 <= 0`` with ``p1`` infinite), and afterwards some sequence whose
        logical positions it changed holds a lost position ``q`` in its next
        decode's window: ``q > new_pos_max + 1 - w``, ``new_pos_max`` its
        largest logical position left (a cell the window dropped cannot be
        attended to again). Raises InvalidArgumentError for a sequence id out
        of range or a non-integer bound.
        Rule: ``kvspec.spec.cells.seq_rm``, ``kvspec.spec.cells.window_breaches``.
        """
        op = "seq_rm"
        seq = self._seq(op, "seq", seq, allow_all=True)
        p0, p1 = _range(op, p0, p1)
        new = self._clone()
        for st in new.values():
            for i in st.used():
                if _in(st.pos[i], p0, p1) and (seq == -1 or seq in st.seqs[i]):
                    st.seqs[i] = frozenset() if seq == -1 else st.seqs[i] - {seq}
                    if not st.seqs[i]:
                        st.free(i)
            st.lost = [(p, frozenset() if seq == -1 else ss - {seq}) if _in(p, p0, p1) and (seq == -1 or seq in ss)
                       else (p, ss) for p, ss in st.lost]
            st.lost = [(p, ss) for p, ss in st.lost if ss]
        if "window" in new and not (p0 == 0 and p1 is None):
            first_old, first_new = next(iter(self._st.values())), next(iter(new.values()))
            for s in (range(self.n_seq) if seq == -1 else (seq,)):
                if sorted(first_old.positions(s)) == sorted(first_new.positions(s)):
                    continue
                top = self._logical_max(new, s)
                if any(q > top + 1 - self.window for q, ss in new["window"].lost if s in ss):
                    return False
        self._st = new
        return True

    def seq_cp(self, src: int, dst: int, p0: int | None = 0, p1: int | None = None) -> None:
        """Share ``src``'s cells (present and lost) with position in
        ``[p0, p1)`` with ``dst``: ``dst`` is added to each cell's set (no
        row is copied). ``src == dst``: no-op.

        Raises InvalidArgumentError (nothing changes) for a sequence id out
        of range, or when ``dst`` would hold two cells at one position in a
        store (clear ``dst``'s range with :meth:`seq_rm` first).
        Rule: ``kvspec.spec.cells.seq_cp``.
        """
        op = "seq_cp"
        src = self._seq(op, "src", src)
        dst = self._seq(op, "dst", dst)
        raw = (p0, p1)
        p0, p1 = _range(op, p0, p1)
        if src == dst:
            return
        new = self._clone()
        for st in new.values():
            for i in st.of(src):
                if _in(st.pos[i], p0, p1):
                    st.seqs[i] = st.seqs[i] | {dst}
            st.lost = [(p, ss | {dst}) if src in ss and _in(p, p0, p1) else (p, ss) for p, ss in st.lost]
        self._check_collisions(op, new, lambda _s, pos: f"{op}: sequence {dst} would hold two cells at position {pos} "
                                                        f"(src={src}, p0={raw[0]}, p1={raw[1]}); remove that range "
                                                        "from dst first")
        self._st = new

    def seq_keep(self, seq: int) -> None:
        """Remove every other sequence from every cell, present and lost;
        cells not held by ``seq`` are freed. Raises InvalidArgumentError for
        a sequence id out of range. Rule: ``kvspec.spec.cells.seq_keep``."""
        seq = self._seq("seq_keep", "seq", seq)
        only = frozenset((seq,))
        for st in self._st.values():
            for i in st.used():
                if seq in st.seqs[i]:
                    st.seqs[i] = only
                else:
                    st.free(i)
            st.lost = [(p, only) for p, ss in st.lost if seq in ss]

    # -- shifts -----------------------------------------------------------------------
    def _move(self, op: str, seq: int, p0: int, p1: int | None, f: Any, what: str) -> None:
        """Move ``seq``'s cells (present and lost) in range to ``f(pos)``,
        for every holder of a moved cell; a present cell's pending shift
        grows by the move; a cell moved below 0 is freed. Refused
        (InvalidArgumentError, nothing changes) when some sequence would
        hold two cells at one position in a store."""
        new = self._clone()
        for st in new.values():
            for i in st.of(seq):
                if _in(st.pos[i], p0, p1):
                    p = f(st.pos[i])
                    if p < 0:
                        st.free(i)
                    else:
                        st.shift[i] += p - st.pos[i]
                        st.pos[i] = p
            st.lost = [(f(p), ss) if seq in ss and _in(p, p0, p1) else (p, ss) for p, ss in st.lost]
            st.lost = [(p, ss) for p, ss in st.lost if p >= 0]
        self._check_collisions(op, new, what)
        self._st = new

    def seq_add(self, seq: int, p0: int | None, p1: int | None, delta: int) -> None:
        """Move the positions of ``seq``'s cells (present and lost) in
        ``[p0, p1)`` by ``delta`` (a shared cell moves for every holder: a
        cell has one position); a cell moved below 0 is freed. The K rows
        are re-rotated lazily (pending shifts, :meth:`update`; successive
        shifts add up). ``delta == 0`` or an empty range: no-op. Raises
        InvalidArgumentError (nothing changes) for a sequence id out of range
        or when some sequence would hold two cells at one position.
        Rule: ``kvspec.spec.cells.seq_add``, ``kvspec.spec.cells.shifted``."""
        op = "seq_add"
        seq = self._seq(op, "seq", seq)
        p0, p1 = _range(op, p0, p1)
        delta = _int(op, "delta", delta)
        if delta == 0 or (p1 is not None and p1 <= p0):
            return
        self._move(op, seq, p0, p1, lambda p: p + delta, f"delta={delta} on [{p0}, {p1})")

    def seq_div(self, seq: int, p0: int | None, p1: int | None, d: int) -> None:
        """Divide the positions of ``seq``'s cells (present and lost) in
        ``[p0, p1)`` by ``d`` (floor); a present cell's pending shift grows
        by ``new - old``. ``d == 1`` or an empty range: no-op. Raises
        InvalidArgumentError (nothing changes) for ``d < 1``, a sequence id
        out of range, or when some sequence would hold two cells at one
        position (``d >= 2`` over two adjacent positions always would).
        Rule: ``kvspec.spec.cells.seq_div``, ``kvspec.spec.cells.divided``."""
        op = "seq_div"
        seq = self._seq(op, "seq", seq)
        p0, p1 = _range(op, p0, p1)
        if not _is_int(d) or d < 1:
            raise InvalidArgumentError(f"{op}: d must be an integer >= 1, got {d!r}")
        d = int(d)
        if d == 1 or (p1 is not None and p1 <= p0):
            return
        self._move(op, seq, p0, p1, lambda p: p // d, f"d={d} on [{p0}, {p1})")

    def update(self) -> None:
        """Apply every pending shift: each K row with a pending shift
        ``delta`` is re-rotated by :func:`rope_shift` (per-row deltas, one
        call per store) and its shift cleared. V rows never move. Called by
        :meth:`decode`, :meth:`view`, :meth:`save` and :meth:`cells`. Rule: semantics.md 10, "shifts"."""
        for st in self._st.values():
            idxs = [i for i in st.used() if st.shift[i]]
            if not idxs:
                continue
            new = rope_shift(st.k[mx.array(idxs, dtype=mx.int32)], [st.shift[i] for i in idxs], self.rope_base)
            st.write(idxs, new, new, keys_only=True)
            for i in idxs:
                st.shift[i] = 0

    # -- reads ------------------------------------------------------------------------
    def pos_min(self, seq: int) -> int:
        """The smallest position ``seq`` holds, -1 if none, read from the
        window store if the memory has one, else from the full store
        (llama.cpp's iSWA memory: the full store is a superset). Raises
        InvalidArgumentError for a sequence id out of range. Rule: ``kvspec.spec.cells.pos_min``."""
        return min(self._main().positions(self._seq("pos_min", "seq", seq), lost=False), default=-1)

    def pos_max(self, seq: int) -> int:
        """The largest position ``seq`` holds, -1 if none (store as
        :meth:`pos_min`; positions in between may be missing). Raises
        InvalidArgumentError for a sequence id out of range. Rule: ``kvspec.spec.cells.pos_max``."""
        return max(self._main().positions(self._seq("pos_max", "seq", seq), lost=False), default=-1)

    def _store(self, op: str, store: str) -> _Store:
        if store not in self._st:
            raise InvalidArgumentError(f"{op}: store must be one of {list(self.stores)}, got {store!r}")
        return self._st[store]

    def view(self, seq: int, store: str) -> tuple[mx.array, mx.array, tuple[int, ...]]:
        """``(keys, values, positions)`` of ``seq``'s cells in ``store`` in
        position order (pending shifts applied first): keys/values
        ``(n, kv_heads, head_dim)`` in the cache's dtype (new arrays),
        positions ``n`` increasing ints (holes allowed). Raises
        InvalidArgumentError for a sequence id or store not in the cache.
        Rule: ``kvspec.spec.cells.observe`` (K rows named ``(token, pos)``)."""
        seq = self._seq("view", "seq", seq)
        st = self._store("view", store)
        self.update()
        idxs = sorted(st.of(seq), key=lambda i: st.pos[i])
        ix = mx.array(idxs, dtype=mx.int32)
        return st.k[ix], st.v[ix], tuple(st.pos[i] for i in idxs)

    def cells(self, store: str, apply_shifts: bool = True) -> list[tuple[int, frozenset[int], np.ndarray, np.ndarray]]:
        """Every used cell of ``store`` as ``(pos, seqs, k_row, v_row)``, in
        cell order (not observable: compare as a multiset); rows are NumPy
        copies ``(kv_heads, head_dim)`` (float16, float32, or bfloat16's
        uint16 bit pattern). Pending shifts are applied first unless
        ``apply_shifts`` is False (then K rows are as stored; see
        :meth:`pending_shifts`). Raises InvalidArgumentError for a store not
        in the cache. Rule: ``kvspec.spec.cells.observe``."""
        st = self._store("cells", store)
        if apply_shifts:
            self.update()
        idxs = st.used()
        if not idxs:
            return []
        ix = mx.array(idxs, dtype=mx.int32)
        k, v = to_host(st.k[ix]), to_host(st.v[ix])
        return [(st.pos[i], st.seqs[i], k[j], v[j]) for j, i in enumerate(idxs)]

    def pending_shifts(self, store: str) -> list[tuple[int, frozenset[int], int]]:
        """``(pos, seqs, delta)`` of every used cell of ``store`` whose K row
        still waits for a shift of ``delta`` positions (its row is rotated
        for ``pos - delta``). Raises InvalidArgumentError for a store not in
        the cache. Rule: semantics.md 10, "shifts"."""
        st = self._store("pending_shifts", store)
        return [(st.pos[i], st.seqs[i], st.shift[i]) for i in st.used() if st.shift[i]]

    def lost(self, seq: int) -> frozenset[int]:
        """``seq``'s lost positions: window cells reused by a decode, kept
        as logical positions (what the sequence would hold had the window
        kept every cell); they move, are shared and are removed as present
        cells are. Raises InvalidArgumentError for a sequence id out of
        range. Rule: ``kvspec.spec.cells.lost``."""
        seq = self._seq("lost", "seq", seq)
        st = self._st.get("window")
        return frozenset(p for p, ss in st.lost if seq in ss) if st is not None else frozenset()

    # -- per-sequence state -----------------------------------------------------------
    def save(self, seq: int) -> CellsSnapshot:
        """``seq``'s state (llama_state_seq_get_data) as a host snapshot:
        per store its present cells in position order, the window store only
        its live window (``pos_max(seq) - pos < w``). Pending shifts are
        applied first, so every K row is rotated for its cell's position.
        NumPy copies: nothing aliases the cache. Raises InvalidArgumentError
        for a sequence id out of range. Rule: ``kvspec.spec.cells.save``."""
        seq = self._seq("save", "seq", seq)
        self.update()
        out = {}
        for name, st in self._st.items():
            idxs = sorted(st.of(seq), key=lambda i: st.pos[i])
            if name == "window" and idxs:
                top = st.pos[idxs[-1]]
                idxs = [i for i in idxs if top - st.pos[i] < self.window]
            ix = mx.array(idxs, dtype=mx.int32)
            out[name] = (np.array([st.pos[i] for i in idxs], dtype=np.int64), to_host(st.k[ix]), to_host(st.v[ix]))
        return CellsSnapshot(self.stores, self.kv_heads, self.head_dim, _NAMES[self.dtype], out)

    def restore(self, snapshot: CellsSnapshot, dst: int, drops: Any = None) -> bool:
        """Write a snapshot into ``dst`` (llama_state_seq_set_data): ``dst``
        is cleared (as ``seq_rm(dst, -1, -1)``), then the snapshot's cells
        become new cells held by ``dst`` alone. Cells are found as a decode
        finds them, on the cleared state (llama.cpp's ``state_read_meta``
        clears ``dst``, then ``find_slot``): free cells from the head on,
        then, in a window store, droppable cells of other sequences, lowest
        position first (each becomes lost for its holder). With a full
        and a window store, the snapshot's full positions missing from its
        window part become lost cells of ``dst`` (its logical positions are
        the snapshot's full positions).

        Returns True, or False (nothing changes: ``dst`` is not cleared
        either) when a store has fewer usable cells (free, plus droppable in
        a window store), after the clear, than the snapshot holds for it. Raises InvalidArgumentError for a sequence id
        out of range or a snapshot of another layout (stores, kv_heads,
        head_dim, dtype) or with repeated or negative positions.
        ``drops``: a recorded choice of window cells to drop, as in
        :meth:`decode`, judged on the state after the clear of ``dst``.
        Rule: ``kvspec.spec.cells.restore``.
        """
        op = "restore"
        dst = self._seq(op, "dst", dst)
        self._check_snapshot(op, snapshot)
        new = self._clone()
        for st in new.values():
            for i in st.of(dst):
                st.seqs[i] = st.seqs[i] - {dst}
                if not st.seqs[i]:
                    st.free(i)
            st.lost = [(p, ss - {dst}) for p, ss in st.lost if ss - {dst}]
        keep = None
        if drops:
            if any(self._slots(new, st, len(snapshot.cells[name][0])) is None for name, st in new.items()):
                return False
            keep = self._apply_drops(op, new, drops)
        slots = {}
        for name, st in new.items():
            n = len(snapshot.cells[name][0])
            if n:
                got = self._slots(new, st, n, keep=keep if name == "window" else None)
                if got is None:
                    return False
                slots[name] = got
        self.update()
        held = frozenset((dst,))
        for name, st in new.items():
            # update() re-rotated rows: take the new buffers; no shift is pending now
            st.k, st.v, st.shift = self._st[name].k, self._st[name].v, [0] * len(st.pos)
            if name not in slots:
                continue
            pos, k, v = snapshot.cells[name]
            for j, i in enumerate(slots[name]):
                if st.pos[i] >= 0:  # a droppable window cell of another sequence: lost for its holder
                    st.lost.append((st.pos[i], st.seqs[i]))
                st.pos[i], st.seqs[i], st.shift[i] = int(pos[j]), held, 0
            st.write(slots[name], from_host(k, self.dtype), from_host(v, self.dtype))
            st.head = (slots[name][-1] + 1) % len(st.pos)
        if "full" in new and "window" in new:
            here = set(snapshot.positions("window"))
            new["window"].lost += [(p, held) for p in snapshot.positions("full") if p not in here]
        self._st = new
        return True

    def _check_snapshot(self, op: str, snap: Any) -> None:
        if not isinstance(snap, CellsSnapshot):
            raise InvalidArgumentError(f"{op}: snapshot must be a CellsSnapshot (from CellCache.save), "
                                       f"got {type(snap).__name__}")
        mine = (self.stores, self.kv_heads, self.head_dim, _NAMES[self.dtype])
        theirs = (snap.stores, snap.kv_heads, snap.head_dim, snap.dtype)
        if mine != theirs:
            raise InvalidArgumentError(f"{op}: snapshot of a cache with (stores, kv_heads, head_dim, dtype) = "
                                       f"{theirs} cannot be restored into one with {mine}")
        for name in self.stores:
            pos, k, v = snap.cells[name]
            ps = [int(p) for p in pos]
            if len(set(ps)) != len(ps) or any(p < 0 for p in ps):
                raise InvalidArgumentError(f"{op}: snapshot positions of the {name} store must be distinct and "
                                           f">= 0, got {ps}")
            shape = (len(ps), self.kv_heads, self.head_dim)
            if tuple(k.shape) != shape or tuple(v.shape) != shape:
                raise InvalidArgumentError(f"{op}: snapshot rows of the {name} store must have shape {shape}, "
                                           f"got {tuple(k.shape)} and {tuple(v.shape)}")

    def clear(self) -> None:
        """Free every cell of every store; every lost cell goes. Rule: ``kvspec.spec.cells.clear``."""
        for st in self._st.values():
            for i in range(len(st.pos)):
                st.free(i)
            st.lost, st.head = [], 0

    # -- copies, size -------------------------------------------------------------------
    def copy(self) -> CellCache:
        """A deep, independent copy: metadata copied; the MLX buffers are
        shared, which is safe because every write makes a new array
        (``kvspec.impl.write.write_copy``) and never changes a buffer in place. Rule: semantics.md 10."""
        new = CellCache.__new__(CellCache)
        new.__dict__.update(self.__dict__)
        new._st = self._clone()
        return new

    __copy__ = copy

    def __deepcopy__(self, memo: dict) -> CellCache:
        return self.copy()

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V buffers of every store
        (``2 * (n_cells per store: n_cells, window_cells) * kv_heads * head_dim * itemsize``). Rule: semantics.md 10."""
        return sum(st.k.nbytes + st.v.nbytes for st in self._st.values())
