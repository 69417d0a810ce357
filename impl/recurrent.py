"""The cache of a hybrid model's recurrent layers, with exact rollback
(spec: ``kvspec.spec.recurrent``; docs/recurrent.md).

A recurrent layer (qwen3_next's GatedDeltaNet, the Mamba2 mixers of
nemotron_h, mamba2, granitemoehybrid and plamo2, mamba's and jamba's Mamba
mixers, lfm2's short conv, recurrent_gemma's RG-LRU block) keeps per batch
element the **conv window** (array index 0: the last ``kernel - 1`` inputs
of its causal conv, shape ``(B, kernel - 1, C)``) and, except lfm2, the
**recurrent state** after every token consumed so far (array index 1). The
model writes them (``cache[0] = conv``, ``cache[1] = state``) once per call
of ``S`` tokens; the states inside a block are never handed to the cache.

:class:`RecurrentCache` is a drop-in for mlx-lm's ``ArraysCache`` (a
subclass of it when mlx-lm is installed, so the models' ``isinstance``
checks hold) that also keeps **checkpoints**: a ring of ``depth + 1``
slots, slot ``t % (depth + 1)`` holding the arrays the cache held after
``t`` tokens, valid for ``t`` in ``[offset - c, offset]`` where ``c`` is the
coverage (:meth:`RecurrentCache.trimmable_rows`). ``trim(n)`` with
``n <= c`` puts the checkpoint of ``offset - n`` back, conv window AND
recurrent state, exactly.

Checkpoints need the state after each token, which the model never hands
over; the **step recorder** (:func:`record_steps`) gets them: it wraps each
recurrent mixer of a model instance (the instance's modules only, never
mlx-lm's code) so that a call of ``S`` tokens on a cache of depth ``U > 0``
runs its first ``max(0, S - U)`` tokens as one call and each of its last
``min(S, U)`` tokens as its own call, recording a checkpoint after each.
The verify block of speculative decoding thus runs the recurrent layer one
token at a time, as plain decoding does.
"""

from __future__ import annotations

import inspect
import numbers
import warnings
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kvspec.impl.dense import refuse_foreign_save
from kvspec.spec.errors import InvalidArgumentError, RollbackWarning, StateError

try:  # mlx-lm is optional (the e2e extra); the models test isinstance(c, ArraysCache)
    from mlx_lm.models.cache import ArraysCache as _Base
except ImportError:  # pragma: no cover - make installs the extra
    _Base = object


def _int_arg(op: str, name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidArgumentError(f"{op}: {name} must be an integer, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class RecurrentSnapshot:
    """What :meth:`RecurrentCache.snapshot` returns: handles to the cache's
    (immutable) arrays, its counters and its checkpoint ring. Nothing in it
    is shared with anything a later write changes."""

    size: int
    depth: int
    arrays: tuple[Any, ...]
    offset: int
    coverage: int
    ring: tuple[Any, ...]
    left_padding: Any
    lengths: Any


class RecurrentCache(_Base):  # type: ignore[misc, valid-type]
    """mlx-lm's ``ArraysCache`` with checkpoints for exact rollback.

    Args:
        size: arrays per layer, int >= 1: 2 (conv window, recurrent state)
            or 1 (lfm2: conv window only).
        depth: U, int >= 0: how many tokens a rollback may take back (the
            ring holds U + 1 checkpoints). 0: no checkpoints, no rollback.
        strict: True or False: a refused rollback raises StateError
            (:meth:`warn_refused_rollback`) instead of the once-per-cache
            RollbackWarning.
        left_padding: per batch element left padding (batch generation), as
            ``ArraysCache``.

    ``cache[i]`` reads and writes the arrays as ``ArraysCache`` does, stored
    as handed in (any dtype, bfloat16 and float32 included; no copy, no
    cast). ``offset`` counts the tokens consumed: the step recorder counts
    them inside a recorded call; outside one, ``advance(N)`` counts them.

    Raises InvalidArgumentError for a size, depth or strict of the wrong
    type or range. Rule: ``kvspec.spec.recurrent.step``.
    """

    def __init__(self, size: int = 2, depth: int = 0, strict: bool = False, left_padding: Any = None):
        size = _int_arg("RecurrentCache", "size", size)
        depth = _int_arg("RecurrentCache", "depth", depth)
        if size < 1:
            raise InvalidArgumentError(f"RecurrentCache: size must be >= 1 (arrays per layer), got {size}")
        if depth < 0:
            raise InvalidArgumentError(f"RecurrentCache: depth must be >= 0 (tokens a rollback may take back), "
                                       f"got {depth}")
        if type(strict) is not bool:
            raise InvalidArgumentError(f"RecurrentCache: strict must be True or False, got {strict!r}")
        self.cache: list[Any] = [None] * size
        self.left_padding = mx.array(left_padding) if left_padding else None
        self.lengths = None
        self.offset = 0
        self.depth = depth
        self.strict = strict
        self.rollback_warned = False
        self._ring: tuple[Any, ...] = (None,) * (depth + 1)
        self._coverage = 0
        self._recording = 0

    # -- arrays ---------------------------------------------------------------------
    def __setitem__(self, idx: int, value: Any) -> None:
        """Write array ``idx`` (0: conv window, 1: recurrent state). Outside
        a recorded call, a write of the last index is an unrecorded step:
        the checkpoints are cleared (coverage 0), since the cache cannot
        vouch for states it was not shown; a write of another index replaces
        the live value only. Rule: ``kvspec.spec.recurrent.step``."""
        self.cache[idx] = value
        if not self._recording and idx % len(self.cache) == len(self.cache) - 1:
            self._coverage = 0

    def __getitem__(self, idx: int) -> Any:
        return self.cache[idx]

    def advance(self, N: int) -> None:
        """``N`` tokens consumed (mlx-lm's models call it after writing the
        arrays). Inside a recorded call the recorder counts the tokens, and
        this moves only the batch counters (``lengths``, ``left_padding``),
        as ``ArraysCache.advance``; outside one it is an unrecorded step:
        ``offset += N`` and the checkpoints are cleared (coverage 0).
        Rule: ``kvspec.spec.recurrent.step``."""
        # new arrays, not in place: a snapshot or a saved field keeps the old counters
        if self.lengths is not None:
            self.lengths = self.lengths - N
        if self.left_padding is not None:
            self.left_padding = self.left_padding - N
        if not self._recording:
            self.offset += int(N)
            self._coverage = 0

    # -- rollback -------------------------------------------------------------------
    def trimmable_rows(self) -> int:
        """The coverage c: how many tokens the kept checkpoints can take back,
        ``0 <= c <= min(depth, offset)``. Recorded steps raise it (to at most
        depth), rollbacks lower it, and an unrecorded step, a ``state``
        assignment, a load or a batch filter/extend sets it to 0.
        Rule: ``kvspec.spec.recurrent.trimmable_rows``."""
        return self._coverage

    def is_trimmable(self) -> bool:
        """``depth > 0``: the capability to roll back (mlx-lm asks it once
        before speculative decoding, and before every rollback); how far a
        rollback may go is :meth:`trimmable_rows`.
        Rule: ``kvspec.spec.recurrent.is_trimmable``."""
        return self.depth > 0

    def trim(self, n: int) -> int:
        """Take back the last ``n`` tokens: for ``n <= trimmable_rows()`` the
        checkpoint of ``offset - n`` comes back exactly (conv window AND
        recurrent state, the same array objects), ``offset`` and the coverage
        drop by ``n``, and ``n`` is returned. ``n <= 0`` trims nothing and
        returns 0.

        Raises InvalidArgumentError for a non-integer ``n``, StateError for
        ``n > trimmable_rows()`` naming the layer's coverage (the cache
        unchanged). It raises rather than returning 0 because mlx-lm's
        ``trim_prompt_cache`` trims the layers one by one and a quiet 0
        would leave them at different offsets;
        ``kvspec.impl.models.trim_prompt_cache`` checks every layer first and stays
        atomic. Rule: ``kvspec.spec.recurrent.trim``."""
        n = _int_arg("RecurrentCache.trim", "n", n)
        if n <= 0:
            return 0
        if n > self._coverage:
            raise StateError(self._refusal(f"a rollback of {n} tokens"))
        self.offset -= n
        self._coverage -= n
        self.cache = list(self._ring[self.offset % (self.depth + 1)])
        return n

    def _refusal(self, asked: str) -> str:
        return (f"RecurrentCache(size={len(self.cache)}, depth={self.depth}) at offset {self.offset} holds "
                f"checkpoints for {self._coverage} tokens (its coverage): {asked} is refused and nothing was "
                "trimmed (the cache is unchanged); for speculative decoding with k draft tokens build the caches "
                "with kvspec.impl.models.make_prompt_cache(model, num_draft_tokens=k), which also installs the step "
                "recorder (kvspec.impl.recurrent.record_steps)")

    def warn_refused_rollback(self, n: int | None) -> None:
        """Report a rollback of ``n`` tokens (None: any rollback) this cache
        cannot honour: the once-per-cache RollbackWarning, or with
        ``strict=True`` StateError at every refusal, naming the cache, its
        depth, offset and coverage and the fix. ``rollback_warned`` is set
        only once the warning was issued. Rule: ``kvspec.spec.recurrent.trim``."""
        asked = "any rollback" if n is None else f"a rollback of {n} tokens"
        if self.strict:
            raise StateError(self._refusal(asked))
        if self.rollback_warned:
            return
        warnings.warn(self._refusal(asked) + ". Reported once per cache.", RollbackWarning, stacklevel=3)
        self.rollback_warned = True

    # -- recorder hooks ---------------------------------------------------------------
    def _mark(self) -> None:
        """The current arrays are the checkpoint of the current offset."""
        self._put(self.offset, tuple(self.cache))

    def _put(self, t: int, arrays: tuple[Any, ...]) -> None:
        slot = t % (self.depth + 1)
        self._ring = self._ring[:slot] + (arrays,) + self._ring[slot + 1:]

    def _record(self, n: int, single: bool) -> None:
        """A recorded sub-call of ``n`` tokens ended: count them and keep the
        arrays as the checkpoint of the new offset. A single token extends
        the coverage; a block (whose inner states were not seen) leaves only
        its end point."""
        self.offset += n
        self._coverage = min(self.depth, self._coverage + 1) if single else 0
        self._mark()

    def _fields(self) -> dict[str, Any]:
        return {"cache": list(self.cache), "offset": self.offset, "_coverage": self._coverage,
                "_ring": self._ring, "lengths": self.lengths, "left_padding": self.left_padding}

    # -- snapshots, copies, state -----------------------------------------------------
    def snapshot(self) -> RecurrentSnapshot:
        """O(1): handles to the same immutable arrays, the counters and the
        checkpoint ring; :meth:`restore` brings back the snapshot's coverage.
        A later write replaces arrays and never changes the snapshot.
        Rule: ``kvspec.spec.recurrent.w_snapshot``."""
        return RecurrentSnapshot(len(self.cache), self.depth, tuple(self.cache), self.offset, self._coverage,
                                 self._ring, self.left_padding, self.lengths)

    def _check_snapshot(self, op: str, snap: Any) -> None:
        if not isinstance(snap, RecurrentSnapshot):
            raise InvalidArgumentError(f"{op}: a RecurrentCache takes a RecurrentSnapshot, got {type(snap).__name__}")
        if (snap.size, snap.depth) != (len(self.cache), self.depth):
            raise InvalidArgumentError(
                f"{op}: snapshot of a RecurrentCache(size={snap.size}, depth={snap.depth}) cannot be restored into a "
                f"RecurrentCache(size={len(self.cache)}, depth={self.depth})")
        live, held = self.cache[0], snap.arrays[0] if snap.arrays else None
        if live is not None and held is not None and (tuple(live.shape[1:]), live.dtype) != (
                tuple(held.shape[1:]), held.dtype):
            raise InvalidArgumentError(
                f"{op}: the snapshot's conv window (shape {tuple(held.shape)}, {held.dtype}) does not fit this "
                f"cache's (shape {tuple(live.shape)}, {live.dtype}): a snapshot of another layer (another conv "
                "kernel, channels or dtype)")

    def restore(self, snap: RecurrentSnapshot) -> None:
        """Adopt a snapshot of this cache (or one of the same size and
        depth whose conv window, when both hold one, has this cache's
        window shape ``(kernel - 1, C)`` and dtype): arrays, offset,
        coverage and checkpoints as they were. A cache that has consumed
        nothing holds no conv window and cannot tell its kernel: it takes
        any snapshot of its size and depth. Raises InvalidArgumentError for
        anything else, the cache unchanged.
        Rule: ``kvspec.spec.recurrent.snapshot_fits``, ``kvspec.spec.recurrent.restore``."""
        self._check_snapshot("restore", snap)
        self.cache = list(snap.arrays)
        self.offset, self._coverage, self._ring = snap.offset, snap.coverage, snap.ring
        self.left_padding, self.lengths = snap.left_padding, snap.lengths

    def __copy__(self) -> RecurrentCache:
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.cache = list(self.cache)
        new.rollback_warned = False
        new._recording = 0
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> RecurrentCache:
        # MLX arrays are immutable values here (every write replaces the
        # array): the copy references them, checkpoints included.
        return self.__copy__()

    @property
    def state(self) -> tuple[list[Any], Any, Any]:
        """``(arrays, left_padding, lengths)``, mlx-lm's ArraysCache protocol:
        ``arrays`` a new list of the ``size`` arrays (None before the first
        call), so a held state never sees a later write. The offset is not
        in it: it travels in :attr:`meta_state`. Read by ``mlx_lm.models.cache.save_prompt_cache`` it raises
        UnsupportedOperationError (its file would lose offset and depth:
        use ``kvspec.impl.models.save_prompt_cache``). Rule: ``kvspec.spec.recurrent.w_snapshot``."""
        refuse_foreign_save(self)
        return list(self.cache), self.left_padding, self.lengths

    @state.setter
    def state(self, v: Any) -> None:
        """Assign ``(arrays, left_padding, lengths)``; the checkpoints are
        cleared (coverage 0: a saved state carries no history), ``offset``
        is kept. Raises InvalidArgumentError for a list of another length.
        Rule: ``kvspec.spec.recurrent.state_restore``."""
        arrays, left_padding, lengths = v
        if len(arrays) != len(self.cache):
            raise InvalidArgumentError(f"RecurrentCache.state: arrays must hold {len(self.cache)} entries "
                                       f"(size), got {len(arrays)}")
        self.cache = list(arrays)
        self.left_padding, self.lengths = left_padding, lengths
        self._coverage = 0

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(offset, depth, size)`` as strings, then ``"1"`` when strict:
        what a prompt-cache file needs besides the arrays.
        Rule: ``kvspec.spec.recurrent.reload``."""
        return (str(self.offset), str(self.depth), str(len(self.cache))) + (("1",) if self.strict else ())

    @meta_state.setter
    def meta_state(self, v: Any) -> None:
        """Set offset, depth and strict from ``meta_state`` (as the getter
        gives it); the checkpoints are cleared (coverage 0), as after a
        load. Raises InvalidArgumentError for malformed counters or a size
        other than this cache's, the cache unchanged. Rule: ``kvspec.spec.recurrent.reload``."""
        offset, depth, size, strict = self._parse_meta("meta_state", v)
        if size != len(self.cache):
            raise InvalidArgumentError(f"meta_state: size {size} does not match this cache's {len(self.cache)} arrays")
        self.offset, self.depth, self.strict = offset, depth, strict
        self._ring, self._coverage = (None,) * (depth + 1), 0
        self._mark()

    @staticmethod
    def _parse_meta(op: str, v: Any) -> tuple[int, int, int, bool]:
        try:
            ints = [int(x) for x in v]
        except (TypeError, ValueError):
            ints = []
        if len(ints) not in (3, 4) or any(i < 0 for i in ints) or ints[2] < 1 or ints[3:] not in ([], [1]):
            raise InvalidArgumentError(f"{op}: meta_state must be (offset, depth, size[, '1']) integers, offset and "
                                       f"depth >= 0, size >= 1, got {v!r}")
        return ints[0], ints[1], ints[2], ints[3:] == [1]

    @classmethod
    def from_state(cls, state: Any, meta_state: Any = None) -> RecurrentCache:
        """A cache from a prompt-cache file: ``state`` the ``size`` arrays
        (or none, for a cache that has consumed nothing yet), ``meta_state``
        as :attr:`meta_state` gives it. No checkpoints come back: coverage 0
        (a file is a snapshot without history). Raises InvalidArgumentError
        for counters or arrays that do not fit. Rule: ``kvspec.spec.recurrent.reload``."""
        offset, depth, size, strict = cls._parse_meta("from_state", meta_state)
        arrays = list(state)
        if arrays and len(arrays) != size:
            raise InvalidArgumentError(f"from_state: a RecurrentCache of size {size} needs {size} arrays or none, "
                                       f"got {len(arrays)}")
        if any(not isinstance(a, mx.array) or a.ndim < 1 for a in arrays):
            raise InvalidArgumentError("from_state: every array must be an mx.array of rank >= 1")
        if len({a.shape[0] for a in arrays}) > 1:
            raise InvalidArgumentError(f"from_state: arrays disagree on the batch size: "
                                       f"{[a.shape for a in arrays]}")
        c = cls(size=size, depth=depth, strict=strict)
        if arrays:
            c.cache = arrays
        c.offset = offset
        c._mark()
        return c

    # -- batch generation (ArraysCache's, checkpoints cleared) -------------------------
    def _known_batch(self) -> int | None:
        """The batch size when the cache can tell it (an array, left
        padding or lengths held); None for a cache that has consumed
        nothing (``batch_size`` then says 1, ArraysCache's default)."""
        if all(a is None for a in self.cache) and self.left_padding is None and self.lengths is None:
            return None
        return self.batch_size

    def _batch_index(self, op: str, idx: Any) -> int:
        b = self._known_batch()
        if isinstance(idx, bool) or not isinstance(idx, numbers.Integral) or not 0 <= idx < (b or idx + 1):
            raise InvalidArgumentError(f"{op}: idx must be an integer in [0, {b if b else 'batch size'}) (the batch "
                                       f"size), got {idx!r}; the cache is unchanged")
        return int(idx)

    def _batch_indices(self, op: str, batch_indices: Any) -> list[int]:
        """``batch_indices`` (a list, tuple or 1-D integer mx.array) as a
        list of ints: each in ``[0, batch_size)`` (``>= 0`` on a cache that
        has consumed nothing: it cannot tell its batch size), no duplicate,
        at least one (kvspec.spec.batch.filter); InvalidArgumentError otherwise."""
        if isinstance(batch_indices, mx.array):
            if batch_indices.ndim != 1 or not mx.issubdtype(batch_indices.dtype, mx.integer):
                raise InvalidArgumentError(f"{op}: batch_indices must be a 1-D integer array, got shape "
                                           f"{tuple(batch_indices.shape)} {batch_indices.dtype}")
            batch_indices = batch_indices.tolist()
        if not isinstance(batch_indices, (list, tuple)):
            raise InvalidArgumentError(f"{op}: batch_indices must be a list of integers, got "
                                       f"{type(batch_indices).__name__}")
        b = self._known_batch()
        keep = list(batch_indices)
        if (not keep or any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < (b or i + 1)
                            for i in keep) or len(set(keep)) != len(keep)):
            raise InvalidArgumentError(f"{op}: batch_indices must be distinct integers in [0, {b if b else 'batch size'}) (the batch "
                                       f"size), at least one, got {list(batch_indices)!r}; the cache is unchanged "
                                       "(kvspec.spec.batch.filter)")
        return [int(i) for i in keep]

    @staticmethod
    def _fit(op: str, what: str, a: Any, b: Any) -> None:
        """Two caches' arrays of one index fit a batch: the same shape past
        the batch axis and the same dtype (either None fits anything)."""
        if a is None or b is None:
            return
        if (tuple(a.shape[1:]), a.dtype) != (tuple(b.shape[1:]), b.dtype):
            raise InvalidArgumentError(
                f"{op}: {what} of shape {tuple(b.shape)} {b.dtype} does not fit the batch's "
                f"{tuple(a.shape)} {a.dtype}: a batch holds one conv window shape (kernel - 1, channels), one "
                "recurrent state shape and one dtype; nothing changed")

    @classmethod
    def merge(cls, caches: Any) -> RecurrentCache:
        """A batch cache of ``caches`` (single caches, batch 1 each, of one
        size), as ``ArraysCache.merge``: array ``e`` of batch element ``i``
        is ``caches[i][e]``, zeros of the others' shape and dtype for a
        cache that has consumed nothing (the layer's own initial value); a
        merge of caches that all consumed nothing holds no arrays and left
        padding 0. The batch has depth 0 (offset 0, no checkpoints).

        Raises InvalidArgumentError for an empty list, an element that is not
        a RecurrentCache, a cache of batch size other than 1, sizes that
        differ, or arrays of one index whose shapes (past the batch axis) or
        dtypes differ; the input caches are never changed.
        Rule: ``kvspec.spec.batch.merge`` (semantics.md 7)."""
        caches = list(caches) if isinstance(caches, (list, tuple)) else caches
        if not isinstance(caches, list) or not caches:
            raise InvalidArgumentError("RecurrentCache.merge: caches must be a non-empty list of RecurrentCache")
        for j, c in enumerate(caches):
            if not isinstance(c, RecurrentCache):
                raise InvalidArgumentError(f"RecurrentCache.merge: caches[{j}] is a {type(c).__name__}, not a "
                                           "RecurrentCache")
            if len(c.cache) != len(caches[0].cache):
                raise InvalidArgumentError(f"RecurrentCache.merge: caches[{j}] holds {len(c.cache)} arrays (size), "
                                           f"caches[0] holds {len(caches[0].cache)}")
            if not c.empty() and any(a is not None and a.shape[0] != 1 for a in c.cache):
                raise InvalidArgumentError(f"RecurrentCache.merge: caches[{j}] has batch size {c.batch_size}; "
                                           "merge takes single caches (batch size 1)")
        n_state = len(caches[0].cache)
        first = [next((c.cache[e] for c in caches if c.cache[e] is not None), None) for e in range(n_state)]
        for j, c in enumerate(caches):
            for e in range(n_state):
                cls._fit("RecurrentCache.merge", f"caches[{j}][{e}]", first[e], c.cache[e])
        out = cls(n_state)
        if all(c.empty() for c in caches):
            out.left_padding = mx.array([0] * len(caches))
            return out
        out.cache = [None if f is None else mx.concatenate(
            [c.cache[e] if c.cache[e] is not None else mx.zeros((1, *f.shape[1:]), f.dtype) for c in caches])
            for e, f in enumerate(first)]
        return out

    def filter(self, batch_indices: Any) -> None:
        """Keep the given batch elements, in the given order, as
        ``ArraysCache.filter`` (arrays, ``left_padding`` and ``lengths``);
        the checkpoints are cleared (coverage 0). Raises
        InvalidArgumentError, nothing changed, for indices that are not
        distinct integers in ``[0, batch_size)`` or none at all.
        Rule: ``kvspec.spec.batch.filter``, ``kvspec.spec.recurrent.state_restore``."""
        keep = self._batch_indices("RecurrentCache.filter", batch_indices)
        super().filter(mx.array(keep))
        self._coverage = 0

    def extend(self, other: Any) -> None:
        """Append ``other``'s batch elements, as ``ArraysCache.extend`` (an
        array one side lacks is zeros of the other's shape and dtype); the
        checkpoints are cleared (coverage 0). Raises InvalidArgumentError,
        nothing changed, for an ``other`` that is not a RecurrentCache of
        the same size, or whose arrays' shapes (past the batch axis) or
        dtypes differ from this cache's. Rule: ``kvspec.spec.batch.extend``,
        ``kvspec.spec.recurrent.state_restore``."""
        if not isinstance(other, RecurrentCache):
            raise InvalidArgumentError(f"RecurrentCache.extend: other must be a RecurrentCache, got "
                                       f"{type(other).__name__}")
        if len(other.cache) != len(self.cache):
            raise InvalidArgumentError(f"RecurrentCache.extend: other holds {len(other.cache)} arrays (size), this "
                                       f"cache {len(self.cache)}")
        for e, (a, b) in enumerate(zip(self.cache, other.cache)):
            self._fit("RecurrentCache.extend", f"other[{e}]", a, b)
        super().extend(other)
        self._coverage = 0

    def extract(self, idx: int) -> RecurrentCache:
        """Batch element ``idx`` as a cache of its own (same size, depth,
        strict and offset; coverage 0; new arrays, nothing shared with this
        cache's list). Raises InvalidArgumentError for an ``idx`` outside
        ``[0, batch_size)``. Rule: ``kvspec.spec.batch.extract``,
        ``kvspec.spec.recurrent.state_restore``."""
        idx = self._batch_index("RecurrentCache.extract", idx)
        c = type(self)(size=len(self.cache), depth=self.depth, strict=self.strict)
        c.cache = [a[idx: idx + 1] if a is not None else None for a in self.cache]
        c.offset = self.offset
        c._mark()
        return c

    @property
    def nbytes(self) -> int:
        """Bytes of the live arrays (the checkpoints reference arrays the
        model already made; they are not counted). Rule: ``kvspec.spec.recurrent.w_snapshot``."""
        return sum(a.nbytes for a in self.cache if a is not None)

    def __repr__(self) -> str:
        return (f"RecurrentCache(size={len(self.cache)}, depth={self.depth}, strict={self.strict}, "
                f"offset={self.offset}, coverage={self._coverage})")


# -- the step recorder --------------------------------------------------------------
_RECORDED: dict[type, type] = {}


def _takes_cache(module: Any) -> bool:
    cls = type(module).__dict__.get("_kvspec_unrecorded", type(module))
    try:
        return "cache" in inspect.signature(cls.__call__).parameters
    except (TypeError, ValueError):
        return False


def _is_attention(module: Any) -> bool:
    return "attention" in type(module).__name__.lower()  # the recorded subclass keeps the name


def _unread_parameters(fn: Any) -> frozenset[str]:
    """Parameters ``fn``'s own code never reads (recurrent_gemma's
    RecurrentBlock takes an attention ``mask`` it ignores): the recorder
    may hand them to every sub-call unsliced. Conservative: a parameter a
    closure captures, or any use of ``locals()``/``vars()``, counts as read."""
    code = getattr(fn, "__code__", None)
    if code is None or {"locals", "vars", "eval", "exec"} & set(code.co_names):
        return frozenset()
    read: set[str] = set(code.co_cellvars)
    import dis

    for ins in dis.get_instructions(code):
        if ins.opname.startswith(("LOAD_", "DELETE_")):
            arg = ins.argval
            read.update(arg if isinstance(arg, tuple) else (arg,) if isinstance(arg, str) else ())
    params = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    return frozenset(p for p in params if p not in read)


def _recorded_class(cls: type) -> type:
    sub = _RECORDED.get(cls)
    if sub is None:
        original = cls.__call__
        sig = inspect.signature(original)
        unread = _unread_parameters(original)

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _recorded_call(original, sig, self, args, kwargs, unread)

        sub = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__, "_kvspec_unrecorded": cls})
        _RECORDED[cls] = sub
    return sub


def _mixers(model: Any) -> list[Any]:
    """The recurrent mixers of a model: each child module of a layer
    (``model.layers``) whose ``__call__`` takes ``cache`` and that is not an
    attention module."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise InvalidArgumentError(f"record_steps: model must have layers (an mlx-lm model), "
                                   f"got {type(model).__name__}")
    out = []
    for layer in layers:
        children = layer.children() if hasattr(layer, "children") else {}
        for child in children.values():
            if hasattr(child, "children") and _takes_cache(child) and not _is_attention(child):
                out.append(child)
    return out


def record_steps(model: Any) -> int:
    """Install the step recorder on a model instance: each recurrent mixer
    (a child module of ``model.layers[i]`` whose ``__call__`` takes
    ``cache``, attention modules excepted) gets a recording ``__call__`` (its
    class is swapped for a subclass; parameters, weights and mlx-lm's code
    are untouched). Returns the number of mixers it covers; idempotent.

    A recorded mixer called with ``S`` tokens (input of shape ``(B, S,
    ...)``) and a :class:`RecurrentCache` of depth ``U > 0`` runs its first
    ``max(0, S - U)`` tokens as one call and each of its last ``min(S, U)``
    tokens as its own call, slicing every other argument of shape ``(B, S,
    ...)`` (the ssm mask) with it, and the cache records a checkpoint after
    each sub-call; the output is the sub-calls' outputs joined along the
    sequence axis. At depth 0 the call runs unsplit and the recorder only
    counts its ``S`` tokens (``offset``; coverage stays 0), so a model that
    never calls ``cache.advance`` (recurrent_gemma) keeps its recurrent
    layers' offsets in step with its attention layers'. An argument the mixer's own code never reads (read from
    its bytecode: recurrent_gemma's RecurrentBlock takes an attention
    mask it ignores) is handed on as is. Any other argument it cannot slice
    safely (an array of another shape, a container) runs the call unsplit
    and the coverage drops to 0:
    never a wrong checkpoint. Any other cache passes through unchanged. Raises InvalidArgumentError for a model without ``layers``.
    Rule: ``kvspec.spec.recurrent.step``."""
    n = 0
    for m in _mixers(model):
        cls = type(m)
        if "_kvspec_unrecorded" not in cls.__dict__:
            m.__class__ = _recorded_class(cls)
        n += 1
    return n


def unrecord_steps(model: Any) -> int:
    """Undo :func:`record_steps` on a model instance (each mixer's class
    back to the original); returns the number of mixers restored.
    Raises InvalidArgumentError for a model without ``layers``.
    Rule: ``kvspec.spec.recurrent.step``."""
    n = 0
    for m in _mixers(model):
        orig = type(m).__dict__.get("_kvspec_unrecorded")
        if orig is not None:
            m.__class__ = orig
            n += 1
    return n


def _recorded_call(original: Any, sig: inspect.Signature, module: Any, args: tuple, kwargs: dict,
                   unread: frozenset[str] = frozenset()) -> Any:
    try:
        bound = sig.bind(module, *args, **kwargs)
    except TypeError:
        return original(module, *args, **kwargs)
    cache = bound.arguments.get("cache")
    if not isinstance(cache, RecurrentCache) or cache._recording:
        return original(module, *args, **kwargs)
    names = [p for p in bound.arguments if p != "cache"][1:]  # without self
    x = bound.arguments[names[0]] if names else None
    if cache.depth == 0:
        # no checkpoints to keep: one unsplit call that counts its tokens
        # (recurrent_gemma never calls cache.advance: without this its
        # layers would stay at offset 0 while the attention layers count)
        saved = cache._fields()
        try:
            return _sub_call(original, bound, module, cache, (), 0, _tokens(x), single=False)
        except BaseException:
            for k, v in saved.items():
                setattr(cache, k, v)
            raise
    plan = _slice_plan(bound, [n for n in names if n not in unread or n == names[0]], x)
    saved = cache._fields()
    U = cache.depth
    try:
        cache._mark()  # the live arrays are the checkpoint of the current offset
        if plan is None:  # cannot split safely: one call, coverage 0
            return _sub_call(original, bound, module, cache, (), 0, _tokens(x), single=False)
        S = x.shape[1]
        head = max(0, S - U)
        outs = []
        if head:
            outs.append(_sub_call(original, bound, module, cache, plan, 0, head, single=False))
        for t in range(head, S):
            outs.append(_sub_call(original, bound, module, cache, plan, t, t + 1, single=True))
        if not all(isinstance(o, mx.array) and o.ndim >= 2 and o.shape[0] == x.shape[0] for o in outs):
            raise _Unsplittable
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    except _Unsplittable:  # an output that is not (B, n, ...): redo it as one call
        for k, v in saved.items():
            setattr(cache, k, v)
        cache._mark()
        return _sub_call(original, bound, module, cache, (), 0, _tokens(x), single=False)
    except BaseException:
        for k, v in saved.items():
            setattr(cache, k, v)
        raise


class _Unsplittable(Exception):
    pass


def _tokens(x: Any) -> int | None:
    """How many tokens an input ``(B, S, ...)`` holds; None when it is not
    such an array."""
    return int(x.shape[1]) if isinstance(x, mx.array) and x.ndim >= 2 else None


def _slice_plan(bound: inspect.BoundArguments, names: list[str], x: Any) -> tuple[str, ...] | None:
    """The arguments to slice along the sequence axis with the input, or
    None when some argument cannot be sliced safely."""
    if not isinstance(x, mx.array) or x.ndim < 2 or x.shape[1] < 1:
        return None
    B, S = x.shape[:2]
    plan = [names[0]]
    for name in names[1:]:
        v = bound.arguments[name]
        if v is None or isinstance(v, (bool, int, float, str)):
            continue
        if isinstance(v, mx.array) and v.ndim >= 2 and tuple(v.shape[:2]) == (B, S):
            plan.append(name)
            continue
        return None
    return tuple(plan)


def _sub_call(original: Any, bound: inspect.BoundArguments, module: Any, cache: RecurrentCache,
              plan: tuple[str, ...], start: int, stop: int | None, single: bool) -> Any:
    """Run the mixer on tokens ``[start, stop)`` (the arguments of ``plan``
    sliced; ``plan`` empty: the whole call, ``stop`` its token count) and
    record the checkpoint after it."""
    arguments = dict(bound.arguments)
    for name in plan:
        arguments[name] = arguments[name][:, start:stop]
    call = inspect.BoundArguments(bound.signature, arguments)  # type: ignore[arg-type]
    if stop is None:
        # the token count is unknown: an unrecorded step (the model's own
        # advance counts the tokens; coverage 0)
        out = original(*call.args, **call.kwargs)
        cache._coverage = 0
        return out
    n = stop - start
    cache._recording += 1
    try:
        out = original(*call.args, **call.kwargs)
    finally:
        cache._recording -= 1
    cache._record(n, single)
    return out


__all__ = ["RecurrentCache", "RecurrentSnapshot", "record_steps", "unrecord_steps"]
