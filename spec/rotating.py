"""Executable spec of the sliding-window (rotating) cache (semantics.md 3).

A ring of at most ``max_size`` (W) physical slots whose first ``keep`` (K)
slots hold the attention sinks, which are never evicted. The state is
physical on purpose: after a wrap a decode returns the buffer in *physical
ring order*, so the spec must say which entry sits in which slot.

* ``slots``: the buffer, one ``Entry`` or ``None`` (a zero row nobody wrote)
  per physical slot; ``len(slots)`` is the capacity.
* ``offset``: absolute count of rows ever written (RoPE position of the next).
* ``idx``: the physical write cursor.
* ``ident``/``marker``: buffer identity and ownership marker, as in the dense
  cache, for the warm-up in-place rule.

Valid rows are ``slots[:idx]`` while the ring is unwrapped (``idx ==
offset``), else every slot (a wrapped ring, or an oversized buffer after a
multi-row append).

The undo log (``undo`` = U rows, 0 by default) makes rollback exact after a
wrap: each append records the ring's counters before it and the valid rows
it overwrote or dropped (``UndoRecord``); records older than the latest U
rows are discarded, so the log holds at most U rows. ``trimmable_rows``
gives the bound, ``trim``/``trim_to`` use it (semantics.md 3, Trim).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvspec.spec.dense import MAX_STEP, Entry, Mode, w_append_mismatch, w_append_pair_mismatch
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError


def ring_slot(position: int, max_size: int, keep: int) -> int:
    """Slot of absolute ``position`` in a ring filled by decode steps only:
    sinks and the warm-up keep their position; afterwards non-sink positions
    cycle through ``[keep, max_size)``.

    pre: 0 <= keep < max_size
    pre: position >= 0
    post: 0 <= __return__ < max_size
    """
    if position < max_size:
        return position
    return keep + (position - keep) % (max_size - keep)


def visible_positions(offset: int, max_size: int, keep: int) -> tuple[int, ...]:
    """Absolute positions a decode-step reader sees once ``offset`` rows were
    written: the sinks ``[0, keep)`` and the latest ``max_size - keep``
    others, in increasing order.

    CrossHair checks the length with ``max_size <= 6`` and ``offset <= 3 *
    max_size`` (the first ``pre:`` line); the bound loses nothing: both
    branches build ranges whose length is linear in the arguments
    (``offset``, or ``keep + (max_size - keep)``), and the box holds both
    branches, the boundary ``offset == max_size`` and wrapped rings several
    windows past it.

    pre: max_size <= 6 and offset <= 3 * max_size
    pre: 0 <= keep < max_size
    pre: offset >= 0
    post: len(__return__) == min(offset, max_size)
    """
    if offset <= max_size:
        return tuple(range(offset))
    return tuple(range(keep)) + tuple(range(offset - (max_size - keep), offset))


def chronological_order(n_slots: int, idx: int, keep: int, wrapped: bool) -> tuple[int, ...]:
    """Slot indices of the valid rows in chronological order: unwrapped,
    ``[0, idx)``; after a wrap, the sinks, then ``[idx, n_slots)`` (oldest
    non-sinks), then ``[keep, idx)``. Appending after a wrap in physical
    instead of this order is a known bug.

    CrossHair checks the length with ``n_slots <= 4`` (the first ``pre:``
    line); the bound loses nothing: the length is ``idx`` or ``keep +
    (n_slots - idx) + (idx - keep)``, linear in the arguments, and the box
    holds both branches and every ordering of ``keep``, ``idx``, ``n_slots``
    (equalities included).

    pre: n_slots <= 4
    pre: 0 <= keep <= idx <= n_slots
    post: len(__return__) == (n_slots if wrapped else idx)
    """
    if not wrapped:
        return tuple(range(idx))
    return tuple(range(keep)) + tuple(range(idx, n_slots)) + tuple(range(keep, idx))


def mask_visible(query: int, key: int, window: int, keep: int) -> bool:
    """May the query at absolute position ``query`` attend to the key at
    ``key``? Causal, and either a sink or among the ``window - keep`` latest
    positions. So each query sees exactly ``min(query + 1, window)`` keys
    when ``keep == 0`` (admitting ``window + 1`` is a known bug), and sinks
    stay visible to every later query of a chunk (hiding them is another).
    A window at or below ``keep`` (a ring's mask asked for a narrower
    window, as the harness asks) leaves the causal sinks only.

    pre: 0 <= keep and 1 <= window
    post: not __return__ or key <= query
    post: not __return__ or key < keep or query - key < window - keep
    post: __return__ or not (0 <= key < keep and key <= query)
    """
    return key <= query and (key < keep or query - key < window - keep)


@dataclass(frozen=True)
class RingMarker:
    """Ownership marker: buffer identity and the cursor after the cache's own
    last write."""

    buffer: int
    idx: int


@dataclass(frozen=True)
class UndoRecord:
    """What one append needs to be undone (the undo log's unit).

    * ``kind``: ``"decode"`` (one row) or ``"prefill"`` (a multi-row append;
      after a partial rollback it may cover fewer rows, still >= 2, or 1 when
      the ring is unwrapped, where both layouts coincide);
    * ``rows``: rows of the append still in the ring;
    * ``offset``, ``idx``, ``capacity``: the ring's counters before it;
    * ``slot``: where a decode wrote (after growth and wrap); -1 for a prefill;
    * ``saved``: the valid rows the append destroyed, oldest first: the one a
      decode overwrote (none during warm-up), the ones a multi-row append
      dropped (at most one unless the buffer was oversized);
    * ``whole``: the record can undo its append wholly. False when the append
      went onto an oversized buffer (the transient state after a long
      multi-row append): undoing it would bring back every row the cut or the
      re-linearisation dropped, up to the whole previous chunk, more than the
      log's U rows. Such an append starts the log afresh; only its later rows
      can be rolled back.
    """

    kind: str
    rows: int
    offset: int
    idx: int
    capacity: int
    slot: int
    saved: tuple[Entry, ...]
    whole: bool


@dataclass(frozen=True)
class RotatingCache:
    max_size: int
    keep: int = 0
    step: int = 256
    inplace: bool = True
    mode: Mode = Mode.FP16
    slots: tuple[Entry | None, ...] = ()
    offset: int = 0
    idx: int = 0
    ident: int | None = None
    marker: RingMarker | None = None
    next_ident: int = 0
    undo: int = 0
    log: tuple[UndoRecord, ...] = ()

    @property
    def capacity(self) -> int:
        return len(self.slots)

    @property
    def wrapped(self) -> bool:
        """Some valid row is not at ``slot == position``: the ring wrapped or
        a multi-row append dropped old rows."""
        return self.offset != self.idx

    @property
    def valid_len(self) -> int:
        """Number of valid slots from slot 0."""
        return self.capacity if self.wrapped else self.idx

    def window(self) -> tuple[int, ...]:
        """Token identities a fetch returns, in physical slot order."""
        return tuple(_valid(e).token for e in self.slots[: self.valid_len])

    def positions(self) -> tuple[int, ...]:
        return tuple(_valid(e).position for e in self.slots[: self.valid_len])


def _valid(e: Entry | None) -> Entry:
    """A valid slot always holds an entry (only slots past the cursor of an
    unwrapped ring are empty)."""
    assert e is not None
    return e


def new_cache(max_size: int, keep: int = 0, step: int = 256, inplace: bool = True,
              mode: Mode | str = Mode.FP16, undo: int = 0) -> RotatingCache:
    """An empty ring with an undo log of ``undo`` rows (0: no log, a wrapped
    ring fails closed). Raises InvalidArgumentError unless ``max_size >= 1``,
    ``0 <= keep < max_size``, ``1 <= step <= MAX_STEP`` and ``undo >= 0``."""
    if max_size < 1:
        raise InvalidArgumentError(f"max_size: must be >= 1, got {max_size}")
    if keep < 0 or keep >= max_size:
        raise InvalidArgumentError(f"keep: must satisfy 0 <= keep < max_size ({max_size}), got {keep}")
    if step < 1 or step > MAX_STEP:
        raise InvalidArgumentError(f"step: must be in [1, {MAX_STEP}], got {step}")
    if undo < 0:
        raise InvalidArgumentError(f"undo: must be >= 0, got {undo}")
    return RotatingCache(max_size=max_size, keep=keep, step=step, inplace=inplace, mode=Mode(mode), undo=undo)


def _new_buffer(cache: RotatingCache, slots: tuple[Entry | None, ...]) -> RotatingCache:
    return replace(cache, slots=slots, ident=cache.next_ident, next_ident=cache.next_ident + 1)


def rotating_inplace_allowed(cache: RotatingCache) -> bool:
    """Warm-up in-place rule for a decode row about to land at ``idx``: the
    window is not yet full (``offset < max_size``, so the slot was never
    valid), the ring is unwrapped (``idx == offset``), the switch is on, the
    mode is Fp16, and the marker says the cache's own last write produced
    these buffers and left the cursor here. In the steady state the write
    overwrites the oldest slot, which a snapshot may still hold: it must copy
    (writing in place there is the project's flagship injected bug).

    post: not __return__ or (cache.offset < cache.max_size and cache.idx == cache.offset)
    post: not __return__ or (cache.marker is not None and cache.marker.buffer == cache.ident)
    """
    return (
        cache.inplace
        and cache.mode is Mode.FP16
        and cache.offset < cache.max_size
        and cache.idx == cache.offset
        and cache.marker is not None
        and cache.ident is not None
        and cache.marker.buffer == cache.ident
        and cache.marker.idx == cache.idx
    )


@dataclass(frozen=True)
class RingAppendResult:
    window: tuple[int, ...]
    positions: tuple[int, ...]
    inplace: bool


def decode(cache: RotatingCache, token: int) -> tuple[RingAppendResult, RotatingCache]:
    """Single-row append (semantics.md 3, steps 1 to 5); logs what it
    overwrites (:func:`decode_record`)."""
    W, K = cache.max_size, cache.keep
    prior = cache
    if cache.capacity > W:
        # 1. cut an oversized buffer back to its sinks and latest W - K rows
        cache = replace(_new_buffer(cache, cache.slots[:K] + cache.slots[cache.capacity - (W - K):]), idx=W)
    if cache.idx >= cache.capacity and cache.capacity < W:
        # 2. grow by at most step, never past W
        grow = min(cache.step, W - cache.capacity)
        cache = _new_buffer(cache, cache.slots + (None,) * grow)
    if cache.idx >= W:
        cache = replace(cache, idx=K)  # 3. wrap
    inplace = rotating_inplace_allowed(cache)
    record = decode_record(prior, cache.idx)
    entry = Entry(cache.offset, token)
    slots = cache.slots[: cache.idx] + (entry,) + cache.slots[cache.idx + 1 :]
    cache = replace(cache, slots=slots) if inplace else _new_buffer(cache, slots)
    cache = replace(cache, offset=cache.offset + 1, idx=cache.idx + 1)
    assert cache.ident is not None
    cache = replace(cache, marker=RingMarker(cache.ident, cache.idx), log=log_push(cache.log, record, cache.undo))
    return RingAppendResult(cache.window(), cache.positions(), inplace), cache


def prefill_kept(n_old: int, max_size: int, keep: int) -> tuple[int, ...]:
    """Which of ``n_old`` old rows (chronological order) a multi-row append
    keeps: all of them while at most ``max_size - 1``, else the sinks and
    the latest others, ``max_size - 1`` rows in all.

    CrossHair checks the length with ``max_size <= 6`` and ``n_old <= 3 *
    max_size`` (the first ``pre:`` line); the bound loses nothing: every
    branch's length is linear in the arguments, and the box holds all three
    branches (no cut, a cut keeping sinks, ``budget <= sinks``) and their
    boundaries.

    pre: max_size <= 6 and n_old <= 3 * max_size
    pre: 0 <= keep < max_size
    pre: n_old >= 0
    post: len(__return__) == min(n_old, max_size - 1)
    """
    budget = max_size - 1
    if n_old <= budget:
        return tuple(range(n_old))
    sinks = min(keep, n_old)
    if budget > sinks:
        return tuple(range(sinks)) + tuple(range(n_old - (budget - sinks), n_old))
    return tuple(range(budget))


def prefill(cache: RotatingCache, tokens: tuple[int, ...]) -> tuple[RingAppendResult, RotatingCache]:
    """Multi-row append: put the valid rows in chronological order, keep the
    sinks and the latest others so that at most ``max_size - 1`` old rows
    remain (:func:`prefill_kept`), append every new row, store contiguously
    and return the whole concatenation (it may exceed ``max_size``: clamping
    it starves the earliest queries, a known bug). Logs the rows it drops
    (:func:`prefill_record`)."""
    order = chronological_order(cache.capacity, cache.idx, cache.keep, cache.wrapped)
    old = tuple(cache.slots[i] for i in order)
    kept = prefill_kept(len(old), cache.max_size, cache.keep)
    record = prefill_record(cache, old, kept, len(tokens))
    new = tuple(Entry(cache.offset + i, t) for i, t in enumerate(tokens))
    prior = cache
    cache = _new_buffer(cache, tuple(old[j] for j in kept) + new)
    cache = replace(cache, offset=prior.offset + len(tokens), idx=len(kept) + len(new))
    assert cache.ident is not None
    cache = replace(cache, marker=RingMarker(cache.ident, cache.idx), log=log_push(cache.log, record, cache.undo))
    return RingAppendResult(cache.window(), cache.positions(), False), cache


def append(cache: RotatingCache, tokens: tuple[int, ...]) -> tuple[RingAppendResult, RotatingCache]:
    """``update_and_fetch``: :func:`decode` for one row, :func:`prefill` for
    more. Raises InvalidArgumentError when no rows are given."""
    if len(tokens) < 1:
        raise InvalidArgumentError(f"append: n must be >= 1, got {len(tokens)}")
    if len(tokens) == 1:
        return decode(cache, tokens[0])
    return prefill(cache, tokens)


# ---------------------------------------------------------------------------
# The undo log


def oversized(cache: RotatingCache) -> bool:
    """The buffer is longer than the window (right after a multi-row append)."""
    return cache.capacity > cache.max_size


def decode_record(prior: RotatingCache, slot: int) -> UndoRecord:
    """Undo record of a decode that writes at ``slot`` (after growth and
    wrap) into ``prior``: the counters before it and the row it overwrites
    when that row is valid (never during warm-up). Onto an oversized buffer
    the decode's cut drops rows the log cannot hold: the record is not whole."""
    if oversized(prior):
        return UndoRecord("decode", 1, prior.offset, prior.idx, prior.capacity, slot, (), False)
    saved = (_valid(prior.slots[slot]),) if slot < prior.valid_len else ()
    return UndoRecord("decode", 1, prior.offset, prior.idx, prior.capacity, slot, saved, True)


def prefill_record(prior: RotatingCache, old: tuple[Entry | None, ...], kept: tuple[int, ...],
                   rows: int) -> UndoRecord:
    """Undo record of a multi-row append of ``rows`` rows onto ``prior``
    whose chronological old rows are ``old``, of which it keeps ``kept``:
    the counters before it and the rows it drops (at most one unless
    ``prior`` is oversized, in which case the record is not whole)."""
    if oversized(prior):
        return UndoRecord("prefill", rows, prior.offset, prior.idx, prior.capacity, -1, (), False)
    dropped = tuple(_valid(old[j]) for j in range(len(old)) if j not in kept)
    return UndoRecord("prefill", rows, prior.offset, prior.idx, prior.capacity, -1, dropped, True)


def log_push(log: tuple[UndoRecord, ...], record: UndoRecord, undo: int) -> tuple[UndoRecord, ...]:
    """The log after an append: no log at depth 0; a record that is not
    whole starts it afresh; otherwise records older than the latest
    ``undo`` rows are discarded (a rollback of at most ``undo`` rows never
    reaches them), so the log holds at most ``undo`` records of at most one
    saved row each."""
    if undo == 0:
        return ()
    if not record.whole:
        return (record,)
    log = log + (record,)
    while sum(r.rows for r in log[1:]) >= undo:
        log = log[1:]
    return log


def log_rows(log: tuple[UndoRecord, ...]) -> int:
    """Rows the log can roll back: every row its records cover, except the
    first row of a record that is not whole (always the oldest)."""
    covered = sum(r.rows for r in log)
    return covered - 1 if log and not log[0].whole else covered


def log_saved_rows(log: tuple[UndoRecord, ...]) -> int:
    """Rows the log holds (its memory): at most the ring's undo depth."""
    return sum(len(r.saved) for r in log)


def log_rewind(log: tuple[UndoRecord, ...], n: int) -> tuple[UndoRecord, ...]:
    """The log after the latest ``n`` rows were taken back by counters
    alone: records wholly past the new offset go, a partly taken multi-row
    append keeps its remaining rows."""
    while n > 0 and log:
        last = log[-1]
        if n >= last.rows:
            log, n = log[:-1], n - last.rows
        else:
            log, n = log[:-1] + (replace(last, rows=last.rows - n),), 0
    return log


def counters_rewind_exact(cache: RotatingCache) -> bool:
    """Moving offset and idx back is an exact trim: the ring is unwrapped and
    not oversized (``idx == offset <= max_size``, ``capacity <= max_size``),
    so its valid rows are ``slots[:idx]`` at ``slot == position``."""
    return cache.idx == cache.offset and cache.offset <= cache.max_size and cache.capacity <= cache.max_size


def trimmable_rows(cache: RotatingCache) -> int:
    """How many rows ``trim`` can take back exactly: every row (``offset``)
    when the counters alone rewind the ring, else what the undo log covers,
    at most ``undo``. **Decision** (semantics.md 3): beyond it trim fails
    closed. (Its bounds are obligation 8 of the proofs and the exhaustive
    replay check in tests/test_spec_rotating.py, not PEP 316 contracts: an
    arbitrary ``RotatingCache`` with an arbitrary log is no reachable ring.)
    """
    if counters_rewind_exact(cache):
        return cache.offset
    return min(cache.undo, log_rows(cache.log))


def is_trimmable(cache: RotatingCache) -> bool:
    """Some trim is exact: the counters alone rewind the ring (also when it
    is empty), or the undo log covers at least one row."""
    return counters_rewind_exact(cache) or trimmable_rows(cache) > 0


def prior_layout(cache: RotatingCache, record: UndoRecord) -> tuple[Entry | None, ...]:
    """The slots of the ring before the multi-row append ``record`` logged,
    rebuilt from the kept old rows (the first ones of the buffer) and the
    dropped ones (``record.saved``; ``None`` where the record is not whole):
    each old row goes back to its slot in the chronological order of the
    prior ring. Slots past the prior's valid rows are unwritten; an empty
    prior keeps the current buffer's length up to ``max_size`` (a ring trim
    keeps its buffers)."""
    W, K = cache.max_size, cache.keep
    order = chronological_order(record.capacity, record.idx, K, record.offset != record.idx)
    kept = prefill_kept(len(order), W, K)
    old: list[Entry | None] = [None] * len(order)
    for i, j in enumerate(kept):
        old[j] = cache.slots[i]
    dropped = [j for j in range(len(order)) if j not in kept]
    for j, entry in zip(dropped, record.saved, strict=False):
        old[j] = entry
    length = record.capacity if record.capacity else min(cache.capacity, W)
    slots: list[Entry | None] = [None] * length
    for j, slot in enumerate(order):
        slots[slot] = old[j]
    return tuple(slots)


def undo_append(cache: RotatingCache, record: UndoRecord) -> RotatingCache:
    """Undo the newest append wholly (``record`` is ``cache.log[-1]`` and
    whole): a decode gets back the row it overwrote (its slot only), a
    multi-row append the prior layout (:func:`prior_layout`); offset and idx
    return to the record's. The rows land in a fresh buffer (a holder may
    still share the current one), with no marker."""
    if record.kind == "decode":
        slots = cache.slots
        if record.saved:
            slots = slots[: record.slot] + record.saved + slots[record.slot + 1 :]
    else:
        slots = prior_layout(cache, record)
    cache = _new_buffer(cache, slots)
    return replace(cache, offset=record.offset, idx=record.idx, marker=None, log=cache.log[:-1])


def undo_part(cache: RotatingCache, record: UndoRecord, n: int) -> RotatingCache:
    """Undo the last ``n`` rows of the newest multi-row append (``0 < n <
    record.rows``). Two rows or more remain: that shorter append would
    have left the same layout, cut to its rows. One row remains: alone it
    would have been a decode onto the prior ring, so rebuild the prior
    (the slot that decode overwrites is the one a non-whole record lacks)
    and decode it again."""
    remaining = record.rows - n
    if remaining >= 2:
        cache = _new_buffer(cache, cache.slots[: cache.idx - n])
        return replace(cache, offset=cache.offset - n, idx=cache.idx - n, marker=None,
                       log=cache.log[:-1] + (replace(record, rows=remaining),))
    first = _valid(cache.slots[cache.idx - record.rows])
    prior = _new_buffer(cache, prior_layout(cache, record))
    prior = replace(prior, offset=record.offset, idx=record.idx, marker=None, log=cache.log[:-1])
    _, cache = decode(prior, first.token)
    return cache


def rollback(cache: RotatingCache, n: int) -> RotatingCache:
    """Take back the latest ``n`` rows through the undo log (``0 < n <=
    trimmable_rows(cache)``): undo whole appends newest first, then part of
    a multi-row append."""
    while n > 0:
        record = cache.log[-1]
        if n >= record.rows:
            cache, n = undo_append(cache, record), n - record.rows
        else:
            cache, n = undo_part(cache, record, n), 0
    return cache


def trim(cache: RotatingCache, n: int) -> tuple[int, RotatingCache]:
    """Rewind ``n`` rows (clamped to ``[0, offset]``) exactly: the ring
    afterwards holds the window it would hold had the last ``n`` rows never
    been appended, with that offset and idx. While the counters alone
    rewind it (unwrapped, not oversized) only offset and idx move; else the
    undo log rolls it back (:func:`rollback`). The buffers stay, also when
    the window empties (the dense rule "drop the buffers at zero rows" is
    the dense cache's). **Decision** (semantics.md 3): beyond
    ``trimmable_rows`` trims nothing and returns 0 (moving the counters
    there makes idx negative and corrupts the window, a known public bug).
    """
    n = max(0, min(n, cache.offset))
    if n == 0 or n > trimmable_rows(cache):
        return 0, cache
    if counters_rewind_exact(cache):
        return n, replace(cache, offset=cache.offset - n, idx=cache.idx - n, log=log_rewind(cache.log, n))
    return n, rollback(cache, n)


def trim_to(cache: RotatingCache, length: int) -> tuple[int, RotatingCache]:
    """``trim(offset - length)``. Raises InvalidArgumentError unless ``0 <=
    length <= offset``, StateError when ``offset - length`` is beyond
    ``trimmable_rows`` (the ring would still hold the later rows)."""
    if length < 0 or length > cache.offset:
        raise InvalidArgumentError(f"trim_to: len must satisfy 0 <= len <= offset ({cache.offset}), got {length}")
    if cache.offset - length > trimmable_rows(cache):
        raise StateError(
            f"trim_to: cannot trim a wrapped sliding-window ring exactly by {cache.offset - length} rows "
            f"(offset={cache.offset}, idx={cache.idx}, max_size={cache.max_size}, undo={cache.undo}, "
            f"rows it can roll back: {trimmable_rows(cache)}), got len={length}"
        )
    return trim(cache, cache.offset - length)


@dataclass(frozen=True)
class RingHolder:
    """A snapshot of a ring: the whole cache state at that moment. ``kind``
    is ``"snapshot"`` or ``"state snapshot"`` (taken through mlx-lm's
    ``state`` protocol; only ``state_restore`` takes it back)."""

    cache: RotatingCache
    kind: str = "snapshot"

    def window(self) -> tuple[int, ...]:
        return self.cache.window()


@dataclass(frozen=True)
class RotatingWorld:
    cache: RotatingCache
    holders: dict[str, RingHolder] = field(default_factory=dict)
    held: tuple[int, ...] | None = None
    returned: tuple[int, ...] | None = None
    next_token: int = 0


def w_append(world: RotatingWorld, n: int) -> tuple[RingAppendResult, RotatingWorld]:
    if n < 1:
        raise InvalidArgumentError(f"append: n must be >= 1, got {n}")
    tokens = tuple(range(world.next_token, world.next_token + n))
    result, cache = append(world.cache, tokens)
    return result, replace(world, cache=cache, returned=result.window, next_token=world.next_token + n)


def w_snapshot(world: RotatingWorld, name: str) -> tuple[None, RotatingWorld]:
    if name in world.holders:
        raise StateError(f"snapshot: name {name!r} is already in use")
    return None, replace(world, holders={**world.holders, name: RingHolder(world.cache)})


def w_copy(world: RotatingWorld, name: str, live: str) -> tuple[None, RotatingWorld]:
    """``copy.copy``/``copy.deepcopy`` of the ring held under ``name``
    (kvspec.spec.dense.w_copy): the copy shares the buffers, counters and undo log
    by value and carries no ownership marker; with ``live == "copy"`` the
    trace goes on writing the copy (no marker: its first warm-up write
    copies, and it keeps the undo log), else the copy is held as a
    snapshot. Raises StateError for a name in use."""
    if live not in ("copy", "original"):
        raise InvalidArgumentError(f"copy: live must be 'copy' or 'original', got {live!r}")
    if name in world.holders:
        raise StateError(f"copy: name {name!r} is already in use")
    holders = {**world.holders, name: RingHolder(world.cache)}
    cache = replace(world.cache, marker=None) if live == "copy" else world.cache
    return None, replace(world, cache=cache, holders=holders)


def holds_buffer(world: RotatingWorld) -> bool:
    """Whether the ring holds a buffer (then an append's rows must match it)."""
    return bool(world.cache.slots)


def w_reload(world: RotatingWorld, via: str) -> tuple[None, RotatingWorld]:
    """The ring saved and loaded back (kvspec.spec.dense.w_reload): its valid rows
    in physical order become fresh private buffers of exactly that many
    slots; offset, cursor, window, sinks, step, undo depth and switch stay;
    no marker and an empty undo log (a file is a snapshot: a loaded ring
    cannot roll back into the history before the save)."""
    if via not in ("file", "state"):
        raise InvalidArgumentError(f"reload: via must be 'file' or 'state', got {via!r}")
    c = world.cache
    valid = c.slots[: c.valid_len]
    loaded = _new_buffer(c, valid) if valid else replace(c, slots=(), ident=None)
    return None, replace(world, cache=replace(loaded, marker=None, log=()))


def w_state_snapshot(world: RotatingWorld, name: str) -> tuple[None, RotatingWorld]:
    """``saved = c.state`` (with ``c.meta_state``): a snapshot whose rows
    never change, as ``snapshot`` (semantics.md 8, "The state
    protocol")."""
    if name in world.holders:
        raise StateError(f"state_snapshot: name {name!r} is already in use")
    return None, replace(world, holders={**world.holders, name: RingHolder(state_of(world.cache), "state snapshot")})


def state_of(cache: RotatingCache) -> RotatingCache:
    """What ``c.state`` hands out: the valid slots only (slot 0 to
    ``valid_len``, physical order), so a ring loaded from it has capacity
    ``valid_len``; slots past the cursor of a warm-up buffer are not saved.

    CrossHair checks it on rings of at most 4 slots (the first ``pre:``
    line); the bound loses nothing: the result is a slice of length
    ``valid_len`` (``idx`` unwrapped, every slot wrapped) whatever the slots
    hold, and the box has both cases with the cursor at 0, inside and at
    the end.

    pre: len(cache.slots) <= 4
    pre: 0 <= cache.idx <= len(cache.slots)
    post: __return__.capacity == cache.valid_len
    """
    return replace(cache, slots=cache.slots[: cache.valid_len])


def w_state_restore(world: RotatingWorld, name: str) -> tuple[None, RotatingWorld]:
    """``c.state = saved``: as ``restore`` (no marker, empty undo log)."""
    return w_restore(world, name, "state_restore", "state snapshot")


def w_restore(world: RotatingWorld, name: str, op: str = "restore",
              kind: str = "snapshot") -> tuple[None, RotatingWorld]:
    """Adopt a snapshot's buffers, offset and cursor, with no marker and an
    empty undo log (a restored ring cannot roll back into another history).
    Raises StateError for an unknown name or a holder of the other kind."""
    snap = world.holders.get(name)
    if snap is None:
        raise StateError(f"{op}: no snapshot or handle named {name!r}")
    if snap.kind != kind:
        raise StateError(f"{op}: {name!r} is a {snap.kind}, not a {kind}")
    s = snap.cache
    cache = replace(world.cache, slots=s.slots, offset=s.offset, idx=s.idx, ident=s.ident, marker=None, log=())
    return None, replace(world, cache=cache)


def w_drop(world: RotatingWorld, name: str) -> tuple[None, RotatingWorld]:
    if name not in world.holders:
        raise StateError(f"drop: no snapshot or handle named {name!r}")
    return None, replace(world, holders={k: v for k, v in world.holders.items() if k != name})


def w_hold(world: RotatingWorld) -> tuple[None, RotatingWorld]:
    if world.returned is None:
        raise StateError("hold: no append has returned a window yet")
    return None, replace(world, held=world.returned)


def w_release_hold(world: RotatingWorld) -> tuple[None, RotatingWorld]:
    return None, replace(world, held=None)


def unsupported(op: str) -> UnsupportedOperationError:
    return UnsupportedOperationError(f"{op}: not an operation of the rotating cache")


def apply_op(world: RotatingWorld, op: dict) -> tuple[object, RotatingWorld]:
    """Run one kvtrace op on ``world``: ``(result, new world)``. Raises the
    spec's refusal, or UnsupportedOperationError for an op the ring does not
    have. Module functions are looked up at call time, so a test that
    patches one (a proof's negative control) reaches it here."""
    name = op["op"]
    if name == "append":
        return w_append(world, op["n"])
    if name == "fetch":
        return world.cache.window(), world
    if name == "hold":
        return w_hold(world)
    if name == "release_hold":
        return w_release_hold(world)
    if name == "trim":
        result, cache = trim(world.cache, op["n"])
        return result, replace(world, cache=cache)
    if name == "trim_to":
        result, cache = trim_to(world.cache, op["len"])
        return result, replace(world, cache=cache)
    if name == "snapshot":
        return w_snapshot(world, op["name"])
    if name == "restore":
        return w_restore(world, op["name"])
    if name == "drop":
        return w_drop(world, op["name"])
    if name == "state_snapshot":
        return w_state_snapshot(world, op["name"])
    if name == "state_restore":
        return w_state_restore(world, op["name"])
    if name == "copy":
        return w_copy(world, op["name"], op.get("live", "original"))
    if name == "append_mismatch":
        return w_append_mismatch(world, op["n"], op["differs"])  # type: ignore[arg-type]
    if name == "append_pair_mismatch":
        return w_append_pair_mismatch(world, op["n"], op["differs"])  # type: ignore[arg-type]
    if name == "reload":
        return w_reload(world, op.get("via", "file"))
    raise unsupported(name)


def make_mask_spec(cache: RotatingCache, n: int, window_size: int | None = None) -> tuple[tuple[bool, ...], ...]:
    """The mask ``make_mask(n, window_size)`` must equal for the ``n`` queries
    about to be appended: row ``i`` (query position ``offset + i``), column
    ``j`` (the j-th key of the window the append will return, in its order).
    ``window_size`` defaults to ``max_size``."""
    return make_masks_spec(cache, n, (window_size,))[0]


def make_masks_spec(cache: RotatingCache, n: int,
                    windows: tuple[int | None, ...]) -> tuple[tuple[tuple[bool, ...], ...], ...]:
    """:func:`make_mask_spec` for each of ``windows`` (None: ``max_size``),
    in that order, with the append's key positions worked out once."""
    result, _ = append(cache, tuple(range(-n, 0)))
    out = []
    for window_size in windows:
        window = cache.max_size if window_size is None else window_size
        out.append(tuple(
            tuple(mask_visible(cache.offset + i, p, window, cache.keep) for p in result.positions)
            for i in range(n)
        ))
    return tuple(out)
