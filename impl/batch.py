"""Batch caches for mlx-lm's batched generation (spec: ``kvspec.spec.batch``,
semantics.md 7).

mlx-lm's ``batch_generate`` / ``BatchGenerator`` (and its server) merge the
per-sequence caches of a batch with ``type(caches[0][l]).merge([...])``,
decode all sequences at once, ``filter`` finished ones out, ``extend`` the
batch with new ones and ``extract`` a sequence's cache when it finishes.
This module gives our kinds that path:

* :class:`BatchKVCache`: B dense Fp16 sequences, left-padded
  (:class:`BatchLayout`, the fields of kvspec.spec.batch's); ``KVCache.merge`` builds it from our
  dense caches and :meth:`BatchKVCache.extract` gives one back. The layout
  is mlx-lm's own (same buffer positions, the same growth by ``step``), so
  ``batch_generate`` with our caches produces exactly mlx-lm's tokens and
  log-probabilities (``kvspec e2e``, scenario ``batch``).
* :func:`batch_rotating_class`: the batch ring, mlx-lm's
  ``BatchRotatingKVCache`` layout (a subclass: its decode and block paths),
  built from our rings by ``RotatingKVCache.merge`` and extracted back into
  our :class:`~kvspec.impl.rotating.RotatingKVCache`.

An Int8 ``KVCache`` and a ring with sinks refuse ``merge`` with the reason
(a batch stores the model's float rows; mlx-lm's batch ring has no sinks).
Turbo and paged caches have no ``merge``, so mlx-lm's probe
(``hasattr(cache, "merge")``, its server's test for batching) says no.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.impl.dense import KVCache, _check_int
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec.errors import InvalidArgumentError, UnsupportedOperationError

SEQ = 2


# -- the layout arithmetic -------------------------------------------------------------
# This module's own implementation of the batch layout rules (semantics.md 7,
# rules 1-3), not kvspec.spec.batch's functions: the batch harness (kvspec.fuzz.batch)
# compares this cache's layout with kvspec.spec.batch's after every op, which is a
# check only while the two sides are written apart (the contract "impl takes
# no rule from spec" in pyproject.toml). The buffer's idx is its positions;
# pads[i] the left padding of sequence i; sequence i's offset is idx - pads[i].
@dataclass(frozen=True)
class BatchLayout:
    """A batch's layout as this cache holds it: ``idx`` positions in the
    shared buffer, ``pads[i]`` the left padding of sequence ``i`` (Python
    ints). The same fields as :class:`kvspec.spec.batch.BatchLayout`, compared field
    by field by the harness."""

    idx: int
    pads: tuple[int, ...]


def _check_layout(idx: int, pads: tuple[int, ...]) -> None:
    """Raise InvalidArgumentError unless the batch holds a sequence and
    ``0 <= pad <= idx`` for every pad."""
    if len(pads) == 0:
        raise InvalidArgumentError("batch: a batch holds at least one sequence, got pads=()")
    if idx < 0 or not all(0 <= p <= idx for p in pads):
        raise InvalidArgumentError(f"batch: pads must satisfy 0 <= pad <= idx ({idx}), got {pads}")


def _int_seq(op: str, name: str, values: Any, n: int | None = None, nonneg: bool = True) -> tuple[int, ...]:
    """``values`` (a sequence of integers, or a 1-D ``mx.array`` or NumPy array) as a tuple
    of Python ints: ``n`` of them when given (one per sequence) and, with
    ``nonneg``, each ``>= 0``. Raises InvalidArgumentError naming ``op``,
    ``name`` and the rule otherwise."""
    if isinstance(values, (mx.array, np.ndarray)):
        if values.ndim != 1:
            raise InvalidArgumentError(f"{op}: {name} must be a 1-D list of integers, got an array of shape "
                                       f"{tuple(values.shape)}")
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidArgumentError(f"{op}: {name} must be a sequence of integers, got {type(values).__name__}")
    out = tuple(_check_int(op, name, v) for v in values)
    if n is not None and len(out) != n:
        raise InvalidArgumentError(f"{op}: {name} must hold one integer per sequence ({n}), got {len(out)}")
    if nonneg and any(v < 0 for v in out):
        raise InvalidArgumentError(f"{op}: {name} must be >= 0 for every sequence, got {out}")
    return out


def _merged(lengths: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """(idx, pads) of sequences of ``lengths`` rows left-padded to the
    longest (rule 3: each keeps its offset)."""
    width = 0
    for n in lengths:
        width = max(width, n)
    return width, tuple(width - n for n in lengths)


def _trim_count(idx: int, pads: tuple[int, ...], n: int) -> int:
    """Rows a trim of ``n`` takes from every sequence: never into any
    sequence's padding (the shortest offset bounds it), none for n <= 0."""
    if n <= 0:
        return 0
    shortest = min(idx - p for p in pads)
    return min(shortest, n)


def _filtered(idx: int, pads: tuple[int, ...], keep: tuple[int, ...]) -> tuple[int, tuple[int, ...], int]:
    """(idx, pads, dropped columns) after keeping the sequences ``keep`` in
    that order: the leading columns no kept sequence uses are dropped.
    Raises InvalidArgumentError unless ``keep`` is distinct indices in
    range, at least one."""
    if len(keep) == 0 or len(set(keep)) < len(keep) or not all(0 <= k < len(pads) for k in keep):
        raise InvalidArgumentError(f"filter: keep must be distinct indices in [0, {len(pads)}), got {keep}")
    kept = [pads[k] for k in keep]
    drop = min(kept)
    return idx - drop, tuple(p - drop for p in kept), drop


def _extended(a: tuple[int, tuple[int, ...]], b: tuple[int, tuple[int, ...]]) -> tuple[int, tuple[int, ...]]:
    """(idx, pads) of ``a``'s sequences then ``b``'s, each buffer
    right-aligned on the wider one (the narrower one's columns move right)."""
    (ia, pa), (ib, pb) = a, b
    width = max(ia, ib)
    return width, tuple(p + (width - ia) for p in pa) + tuple(p + (width - ib) for p in pb)


def _roll_right(x: mx.array, shifts: Sequence[int]) -> mx.array:
    """Row ``b`` of ``x`` rolled ``shifts[b]`` positions right along the
    sequence axis (mlx-lm's ``dynamic_roll``)."""
    n = x.shape[SEQ]
    s = mx.array(list(shifts))
    idx = (mx.arange(n)[None, None, :, None] - s[:, None, None, None]) % n
    return mx.take_along_axis(x, mx.broadcast_to(idx, x.shape), axis=SEQ)


def _shared_shape(windows: Sequence[tuple[mx.array, mx.array]], op: str = "merge",
                  what: str = "caches") -> tuple[int, int, int, mx.Dtype]:
    """The heads, K and V head dims and dtype every window (``[B, H, T, D]``
    key and value arrays) shares. Raises InvalidArgumentError naming ``op``
    when they differ (a batch buffer holds one shape and dtype: a mismatch
    would broadcast one head into all, fail in a concatenation, or cast
    every row to a promoted dtype)."""
    shapes = {(int(w[0].shape[1]), int(w[0].shape[3]), int(w[1].shape[3]), w[0].dtype) for w in windows}
    if len(shapes) != 1:
        raise InvalidArgumentError(f"{op}: {what} must share heads, head dims and dtype, got {sorted(map(str, shapes))}")
    return shapes.pop()


def _not_ours(i: int, c: Any, want: str) -> UnsupportedOperationError:
    """The refusal of a sequence cache a batch cannot take, naming its class
    with its module (mlx-lm's caches have our class names)."""
    cls = type(c)
    name = f"{cls.__module__}.{cls.__qualname__}"
    hint = (" mlx-lm's caches and kvspec's cannot share a batch: give every sequence kvspec caches "
            "(kvspec.impl.models.make_prompt_cache; batch_generate builds mlx-lm's for a sequence given none)"
            if cls.__module__.startswith("mlx_lm") else "")
    return UnsupportedOperationError(f"merge: cache {i} is a {name}; {want}.{hint}")


class BatchKVCache:
    """B dense sequences in one ``[B, H, capacity, D]`` buffer pair,
    sequence ``i`` at positions ``[pads[i], idx)`` (kvspec.spec.batch).

    Observables: ``offset`` (``mx.array`` of B offsets, what the model's
    RoPE reads), ``left_padding`` (``mx.array``), ``layout`` (the
    :class:`kvspec.spec.batch.BatchLayout`, Python ints), ``size()`` = ``idx``.
    Built by :meth:`merge` (or empty, from ``left_padding``); every
    operation keeps ``layout`` valid (``0 <= pad <= idx``) and each
    sequence's window equal to that of a single cache fed its rows.
    """

    step = 256

    def __init__(self, left_padding: Sequence[int], step: int = 256):
        pads = tuple(_check_int("BatchKVCache", "left_padding", p) for p in left_padding)
        _check_layout(max(pads, default=0), pads)
        self.step = _check_int("BatchKVCache", "step", step)
        if self.step < 1:
            raise InvalidArgumentError(f"BatchKVCache: step must be >= 1, got {step}")
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        # empty: offsets are -pad (the padding is still to come, mlx-lm's convention)
        self._pads = pads
        self._idx = 0
        self._right_padding: tuple[int, ...] | None = None

    # -- layout --------------------------------------------------------------
    @property
    def layout(self) -> BatchLayout:
        """The layout (:class:`BatchLayout`). Before the first append the
        announced padding is not in the buffer yet (``idx`` 0, offsets
        ``-pad``).

        Rule: ``kvspec.spec.batch.check_layout`` (semantics.md 7, "rule 1")."""
        return BatchLayout(self._idx, self._pads)

    @property
    def offset(self) -> mx.array:
        """Each sequence's offset, ``idx - pads[i]``: int32 ``[B]`` (a sequence's RoPE position;
        negative while its announced padding is not yet in the buffer). Rule: ``kvspec.spec.batch.offsets``
        (semantics.md 7, "rule 1")."""
        return mx.array([self._idx - p for p in self._pads])

    @property
    def left_padding(self) -> mx.array:
        """Each sequence's left padding in positions: int32 ``[B]``; those keys are never visible to
        it. Rule: ``kvspec.spec.batch.visible`` (semantics.md 7, "rule 2")."""
        return mx.array(list(self._pads))

    @property
    def batch_size(self) -> int:
        """B, the sequences this batch cache holds. Rule: ``kvspec.spec.batch.check_layout`` (semantics.md
        7)."""
        return len(self._pads)

    # -- the model's path --------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` ``[B, H, S, D]`` (S positions for every
        sequence) and return ``[B, H, idx, D]`` (kvspec.spec.batch.append)."""
        if keys.ndim != 4 or keys.shape[0] != self.batch_size or values.shape[:3] != keys.shape[:3]:
            raise InvalidArgumentError(
                f"update_and_fetch: keys and values must be [B={self.batch_size}, H, S, D] with the same B, H, S, "
                f"got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        prev, n = self._idx, int(keys.shape[SEQ])
        # the layout after the block, refused before anything changes: a
        # refusal leaves the cache as it was
        _check_layout(prev + n, self._pads)
        if self.keys is None or prev + n > int(self.keys.shape[SEQ]):
            b, h, _, dk = keys.shape
            steps = (self.step + n - 1) // self.step
            new_k = mx.zeros((b, h, steps * self.step, dk), keys.dtype)
            new_v = mx.zeros((b, h, steps * self.step, values.shape[3]), values.dtype)
            if self.keys is not None:
                assert self.values is not None
                if prev % self.step != 0:
                    self.keys, self.values = self.keys[..., :prev, :], self.values[..., :prev, :]
                self.keys = mx.concatenate([self.keys, new_k], axis=SEQ)
                self.values = mx.concatenate([self.values, new_v], axis=SEQ)
            else:
                self.keys, self.values = new_k, new_v
        assert self.values is not None
        self._idx = prev + n
        self.keys[..., prev : self._idx, :] = keys
        self.values[..., prev : self._idx, :] = values
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]

    def keys_and_values(self) -> tuple[mx.array, mx.array] | None:
        """The buffer rows ``[0, idx)`` without writing: keys ``[B, H, idx, Dk]`` and values
        ``[B, H, idx, Dv]`` in the rows' dtype, padding included (the mask hides it), or None before
        the first append. Rule: ``kvspec.spec.batch.visible`` (semantics.md 7, "rule 2")."""
        if self.keys is None:
            return None
        assert self.values is not None
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]

    def fetch_sequence(self, i: int) -> tuple[mx.array, mx.array] | None:
        """Sequence ``i``'s window ``[1, H, offset_i, D]`` (kvspec.spec.batch.positions)."""
        if self.keys is None:
            return None
        assert self.values is not None
        p = self._pads[i]
        return self.keys[i : i + 1, :, p : self._idx, :], self.values[i : i + 1, :, p : self._idx, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any) -> mx.array:
        """``[B, 1, N, idx + N]`` bool: query ``q`` (position ``idx + q``) of
        sequence ``b`` sees key ``j`` iff ``pads[b] <= j <= idx + q`` and,
        with ``window_size``, ``idx + q - j < window_size``
        (kvspec.spec.batch.visible: padding is never visible)."""
        N = _check_int("make_mask", "N", N)
        if N < 1:
            raise InvalidArgumentError(f"make_mask: N must be >= 1, got {N}")
        keys = mx.arange(self._idx + N)
        queries = mx.arange(self._idx, self._idx + N)[:, None] if self._idx else keys[:, None]
        mask = queries >= keys[None]
        if window_size is not None:
            mask = mask & (queries < keys[None] + window_size)
        return mask & (mx.expand_dims(self.left_padding, (1, 2, 3)) <= keys[None])

    def prepare(self, *, left_padding: Sequence[int] | None = None, lengths: Sequence[int] | None = None,
                right_padding: Sequence[int] | None = None) -> None:
        """mlx-lm's hooks before a block: ``left_padding`` (only while the
        batch holds no positions, as kvspec.spec.batch.announced_block) adds padding; ``right_padding`` announces a right-padded block,
        which :meth:`finalize` turns into left padding (kvspec.spec.batch.append_ragged)."""
        # every argument checked before anything changes
        b = len(self._pads)
        left = None if left_padding is None else _int_seq("prepare", "left_padding", left_padding, b)
        right = None if right_padding is None else _int_seq("prepare", "right_padding", right_padding, b)
        if left is not None and self._idx != 0:
            # kvspec.spec.batch.announced_block: padding is announced on a batch that
            # holds no positions (a fresh one, or one trimmed back to idx 0)
            raise InvalidArgumentError(f"prepare: left_padding can only be added to an empty BatchKVCache "
                                       f"(one that holds no positions), got idx={self._idx}")
        if left is not None:
            self._pads = tuple(p + q for p, q in zip(self._pads, left))
        if right is not None and max(right) > 0:
            self._right_padding = right

    def finalize(self) -> None:
        """mlx-lm's hook after a block: the right padding announced by
        :meth:`prepare` becomes left padding (each sequence's rows rolled
        right by its pad). Raises InvalidArgumentError, changing nothing,
        when no block was appended (the batch holds no rows) or when a pad
        would pass ``idx`` (more padding than the sequence's positions).

        Rule: ``kvspec.spec.batch.append_ragged`` (semantics.md 7, "rule 3")."""
        if self._right_padding is not None:
            if self.keys is None or self.values is None:
                raise InvalidArgumentError(
                    f"finalize: prepare announced right_padding={self._right_padding}, but the batch holds no "
                    "rows (a right-padded block is appended between prepare and finalize)")
            pads = tuple(p + r for p, r in zip(self._pads, self._right_padding))
            _check_layout(self._idx, pads)  # before anything changes: a refusal leaves the cache as it was
            self.keys = _roll_right(self.keys, self._right_padding)
            self.values = _roll_right(self.values, self._right_padding)
            self._pads = pads
            self._right_padding = None

    # -- the batch's own operations ------------------------------------------------
    @property
    def state(self) -> tuple[Any, ...]:
        """mlx-lm's batch state: ``(keys, values, offset, left_padding)`` (:meth:`keys_and_values`,
        then int32 ``[B]`` each), or ``()`` before the first append. Rule: semantics.md 8,
        "The state protocol"."""
        kv = self.keys_and_values()
        return () if kv is None else (*kv, self.offset, self.left_padding)

    def is_trimmable(self) -> bool:
        """Always True: a batch trims ``min(n, every offset)`` from every sequence. Rule:
        ``kvspec.spec.batch.trim_count`` (semantics.md 7, "rule 3")."""
        return True

    def trim(self, n: int) -> int:
        """Take ``min(n, every offset)`` rows from every sequence
        (kvspec.spec.batch.trim: never into padding); returns the count."""
        n = _check_int("trim", "n", n)
        if self.keys is None:
            return 0
        count = _trim_count(self._idx, self._pads, n)
        self._idx -= count
        return count

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep the sequences ``batch_indices`` (distinct, in that order) and
        drop the columns none of them uses (kvspec.spec.batch.filter)."""
        keep = _int_seq("filter", "batch_indices", batch_indices, nonneg=False)
        idx, pads, drop = _filtered(self._idx, self._pads, keep)
        if self.keys is not None:
            assert self.values is not None
            rows = mx.array(list(keep))
            self.keys = self.keys[rows][..., drop:, :]
            self.values = self.values[rows][..., drop:, :]
        self._idx, self._pads = idx, pads

    def extend(self, other: BatchKVCache) -> None:
        """Append ``other``'s sequences, right-aligned on the longer buffer
        (kvspec.spec.batch.extend). Raises InvalidArgumentError, changing nothing,
        for ``other`` not a BatchKVCache, or holding rows of other heads,
        head dims or dtype than this batch's (one buffer holds one shape and
        dtype: a bfloat16 batch extended by a float16 one would turn every
        row float32)."""
        if not isinstance(other, BatchKVCache):
            raise InvalidArgumentError(f"extend: other must be a BatchKVCache, got {type(other).__name__}")
        if self.keys is not None and other.keys is not None:
            assert self.values is not None and other.values is not None
            _shared_shape([(self.keys, self.values), (other.keys, other.values)], "extend", "both batches")
        if self.keys is None and other.keys is None:
            self._pads = self._pads + other._pads
            return
        idx, pads = _extended((self._idx, self._pads), (other._idx, other._pads))
        ref = self.keys if self.keys is not None else other.keys
        vref = self.values if self.values is not None else other.values
        assert ref is not None and vref is not None
        width = max(int(c.keys.shape[SEQ]) for c in (self, other) if c.keys is not None)

        def aligned(c: BatchKVCache) -> tuple[mx.array, mx.array]:
            k, v = c.keys, c.values
            if k is None:
                k = mx.zeros((c.batch_size, ref.shape[1], 0, ref.shape[3]), ref.dtype)
                v = mx.zeros((c.batch_size, vref.shape[1], 0, vref.shape[3]), vref.dtype)
            assert v is not None
            left = idx - c._idx
            right = width - int(k.shape[SEQ]) - left
            if right < 0:
                k, v, right = k[..., :right, :], v[..., :right, :], 0
            if left or right:
                pad = [(0, 0), (0, 0), (left, right), (0, 0)]
                k, v = mx.pad(k, pad), mx.pad(v, pad)
            return k, v

        (ka, va), (kb, vb) = aligned(self), aligned(other)
        _check_layout(idx, pads)  # before anything changes
        self.keys, self.values = mx.concatenate([ka, kb]), mx.concatenate([va, vb])
        self._idx, self._pads = idx, pads

    def extract(self, idx: int) -> KVCache:
        """Sequence ``idx`` as our Fp16 :class:`~kvspec.impl.dense.KVCache` holding
        its window (offset = its rows; kvspec.spec.batch.extract)."""
        idx = _check_int("extract", "idx", idx)
        if not 0 <= idx < len(self._pads):
            raise InvalidArgumentError(f"extract: idx must be in [0, {len(self._pads)}), got {idx}")
        offset = self._idx - self._pads[idx]
        out = KVCache("fp16", step=self.step)
        window = self.fetch_sequence(idx)
        if window is not None and offset > 0:
            out.update_and_fetch(mx.contiguous(window[0]), mx.contiguous(window[1]))
        return out

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchKVCache:
        """Our dense Fp16 caches (one per sequence, ragged lengths) as one
        batch, left-padded to the longest (kvspec.spec.batch.merge). Raises
        UnsupportedOperationError for an Int8 cache (a batch stores float
        rows) and for a cache whose window does not start at its first row
        (a front trim: its offset is not its row count); InvalidArgumentError
        for no caches or caches of different heads, head dims or dtypes."""
        if not caches:
            raise InvalidArgumentError("merge: caches must hold at least one cache, got []")
        windows = []
        for i, c in enumerate(caches):
            if not isinstance(c, KVCache):
                raise _not_ours(i, c, "a BatchKVCache merges kvspec's dense kvspec.impl.dense.KVCache layers")
            if c.mode != "fp16":
                raise UnsupportedOperationError(
                    f"merge: cache {i} stores mode {c.mode!r}; a batch stores the model's float rows (Fp16 only)")
            if c.live_start != 0:
                raise UnsupportedOperationError(
                    f"merge: cache {i} starts its window at live_start={c.live_start} (a front trim); a batch "
                    "sequence's offset must be its row count")
            windows.append(c.fetch())
        lengths = tuple(0 if w is None else int(w[0].shape[SEQ]) for w in windows)
        width, pads = _merged(lengths)
        out = cls(list(pads), step=caches[0].step)  # a KVCache's step is an integer >= 1
        if width == 0:
            out._pads = (0,) * len(caches)
            return out
        h, dk, dv, dtype = _shared_shape([w for w in windows if w is not None])
        keys = mx.zeros((len(caches), h, width, dk), dtype)
        values = mx.zeros((len(caches), h, width, dv), dtype)
        for i, (p, w) in enumerate(zip(pads, windows)):
            if w is not None:
                keys[i : i + 1, :, p:] = w[0]
                values[i : i + 1, :, p:] = w[1]
        out.keys, out.values, out._idx = keys, values, width  # a valid layout by construction (_merged)
        return out

    def size(self) -> int:
        """Positions in the buffer, ``idx`` (padding included). Rule: ``kvspec.spec.batch.offsets``
        (semantics.md 7)."""
        return self._idx

    def empty(self) -> bool:
        """True before the first append (no buffer). Rule: semantics.md 7."""
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers (their whole capacity), 0 without them. Rule:
        semantics.md 7."""
        return 0 if self.keys is None or self.values is None else self.keys.nbytes + self.values.nbytes

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"BatchKVCache(idx={self._idx}, pads={self._pads})"


_RING_BATCH: list[type] = []


def batch_rotating_class() -> type:
    """The batch ring class (built once): mlx-lm's ``BatchRotatingKVCache``
    with our ``merge`` (from our rings) and ``extract`` (into our ring).
    Raises UnsupportedOperationError when mlx-lm is not installed."""
    if _RING_BATCH:
        return _RING_BATCH[0]
    try:
        from mlx_lm.models.cache import BatchRotatingKVCache as LmBatchRing
    except ImportError:  # pragma: no cover - the e2e extra is installed by make
        raise UnsupportedOperationError("batched rings need mlx-lm (pip install 'kvspec[e2e]')") from None

    class BatchRotatingKVCache(LmBatchRing):  # type: ignore[misc, valid-type]
        """mlx-lm's batch ring layout (every sequence's window of
        ``max_size`` rows, one shared cursor, padding hidden by the mask),
        merged from and extracted into our :class:`RotatingKVCache`."""

        @classmethod
        def merge(cls, caches: Sequence[Any]) -> Any:
            """Our rings (no sinks, one window size) as one batch: each
            sequence's last ``min(offset, max_size)`` rows in order,
            left-padded (kvspec.spec.batch.merge). Raises UnsupportedOperationError
            for a cache that is not our ring or keeps sinks;
            InvalidArgumentError for no caches, rings of different
            ``max_size``, or of different heads, head dims or dtypes."""
            if not caches:
                raise InvalidArgumentError("merge: caches must hold at least one cache, got []")
            for i, c in enumerate(caches):
                if not isinstance(c, RotatingKVCache):
                    raise _not_ours(i, c, "a batch ring merges kvspec's kvspec.impl.rotating.RotatingKVCache layers")
                if c.keep:
                    raise UnsupportedOperationError(
                        f"merge: cache {i} keeps {c.keep} sinks; mlx-lm's batch ring has no sinks (keep=0 only)")
            if len({c.max_size for c in caches}) != 1:
                raise InvalidArgumentError(f"merge: rings must share max_size, got {[c.max_size for c in caches]}")
            rows = [c._chronological() for c in caches]
            lengths = tuple(c.size() for c in caches)
            width, pads = _merged(lengths)
            out = cls(caches[0].max_size, list(pads))
            if width == 0:
                return out
            h, dk, dv, dtype = _shared_shape([r for r in rows if r is not None])
            keys = mx.zeros((len(caches), h, width, dk), dtype)
            values = mx.zeros((len(caches), h, width, dv), dtype)
            for i, (p, n, r) in enumerate(zip(pads, lengths, rows)):
                if r is not None and n:
                    keys[i : i + 1, :, p : p + n] = r[0][..., -n:, :]
                    values[i : i + 1, :, p : p + n] = r[1][..., -n:, :]
            out.keys, out.values = keys, values
            out.offset = mx.array([c.offset for c in caches])
            out._idx = out._offset = width
            return out

        def extract(self, idx: int) -> RotatingKVCache:
            """Sequence ``idx`` as our ring (its window in order, its offset)."""
            return RotatingKVCache.from_mlx_lm(super().extract(idx))

    _RING_BATCH.append(BatchRotatingKVCache)
    return BatchRotatingKVCache


__all__ = ["BatchKVCache", "BatchLayout", "batch_rotating_class"]
