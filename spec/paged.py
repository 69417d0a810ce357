"""Executable spec of the pool-backed (paged) KV cache (semantics.md 4).

Two levels live side by side in one frozen :class:`PagedWorld`:

* the **abstract** level: a map from sequence names to windows, each window
  the sequence's visible rows as ``Entry(position, token)`` values (what a
  dense cache fed the same rows would return);
* the **physical** level: a pool of ``block_size``-row blocks (their slot
  contents as token identities, ``None`` for a slot nobody wrote), one
  refcount per block, the free list, and one :class:`Sequence` per name with
  its block table, length and logical start.

Block tables are indexed by **absolute** position: row ``p`` of a sequence
lives in slot ``p % block_size`` of block ``table[p // block_size]``. The
table has ``ceil(length / block_size)`` entries; an entry is ``None`` exactly
when its block lies wholly before the logical start (released by a front
trim). Reading gathers ``[start, length)`` through the table.

Every operation is a pure function ``op(world, ...) -> (result, new world)``
or raises one of :mod:`kvspec.spec.errors` and returns nothing, so a refusal (pool
exhaustion included) changes nothing. Rows are token identities; the harness
turns them into bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from kvspec.spec.dense import Entry, w_append_mismatch, w_append_pair_mismatch
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError

MAIN = "main"

# ---------------------------------------------------------------------------
# Rules on integers (the proofs encode these very functions).


def block_index(position: int, block_size: int) -> int:
    """Block-table index of absolute ``position``: ``position // block_size``.
    Indexing by the visible index (``position - start``) instead brings
    slid-off rows back after a front trim (a known bug).

    pre: position >= 0 and block_size >= 1
    post: __return__ * block_size <= position < (__return__ + 1) * block_size
    """
    return position // block_size


def block_slot(position: int, block_size: int) -> int:
    """Slot of absolute ``position`` inside its block.

    pre: position >= 0 and block_size >= 1
    post: 0 <= __return__ < block_size
    """
    return position % block_size


def table_len(length: int, block_size: int) -> int:
    """Entries of a block table for ``length`` rows: ``ceil(length /
    block_size)``. Trims release every block at an index past it.

    pre: length >= 0 and block_size >= 1
    post: (__return__ - 1) * block_size < length <= __return__ * block_size or (length == 0 and __return__ == 0)
    """
    return -(-length // block_size)


def wholly_before(index: int, start: int, block_size: int) -> bool:
    """Does block ``index`` hold only rows before the logical ``start``,
    i.e. ``(index + 1) * block_size <= start``? A front trim releases
    exactly these blocks. Written as ``index < start // block_size``: the
    product overflows 32-bit integers near the top of the range (the bv32
    proof of obligation 6 found it), the quotient cannot.

    pre: index >= 0 and start >= 0 and block_size >= 1
    post: __return__ == ((index + 1) * block_size <= start)
    """
    return index < start // block_size


def needs_copy_on_write(refcount: int) -> bool:
    """Copy-on-write rule: a write into a block held by more than one
    sequence (a shared prefix tail) first copies the block into a fresh one,
    repoints the writer's table and releases the shared block, so no other
    sequence ever sees the write."""
    return refcount > 1


def write_in_place(switch: bool, refcount: int, position: int, length: int) -> bool:
    """May the row at absolute ``position`` be written straight into its
    pool block? Only when the in-place switch is on, exactly one sequence
    holds the block (the writer) and the row is the writer's own next row
    (``position == length``). Then no other table points at the block and
    every slot at or past ``length`` is invisible to the writer, so nobody
    can see the write land. A freshly allocated or freshly copied block has
    refcount 1: its first write goes in place. Otherwise the write is a
    copying (functional) write of the pool slab.

    post: not __return__ or (refcount == 1 and position == length)
    """
    return switch and refcount == 1 and position == length


def capacity_of(table_entries: int, block_size: int) -> int:
    """The trace check ``capacity`` of a paged sequence:
    ``len(block table) * block_size``."""
    return table_entries * block_size


def clamp(n: int, lo: int, hi: int) -> int:
    """``max(lo, min(n, hi))``: trims clamp their count to the visible rows."""
    return max(lo, min(n, hi))


def growth_blocks(deficit: int, size: int, chunk: int, max_blocks: int | None) -> int:
    """Blocks the pool grows by when ``deficit`` more free blocks are needed:
    whole chunks, capped at ``max_blocks`` (None: unbounded). 0 when the
    deficit is 0. A result below ``deficit`` means exhaustion.

    pre: deficit >= 0 and size >= 0 and chunk >= 1
    post: __return__ >= 0
    """
    if deficit <= 0:
        return 0
    want = -(-deficit // chunk) * chunk
    if max_blocks is None:
        return want
    return max(0, min(want, max_blocks - size))


# ---------------------------------------------------------------------------
# State


@dataclass(frozen=True)
class Sequence:
    """One sequence: its block table (block id per absolute block index,
    ``None`` for a block released by a front trim), its length (the absolute
    position the next row takes, the sequence's offset) and logical start."""

    table: tuple[int | None, ...] = ()
    length: int = 0
    start: int = 0

    @property
    def visible(self) -> int:
        """Rows a fetch returns: ``length - start``."""
        return self.length - self.start

    def held(self) -> tuple[int, ...]:
        """Block ids this sequence's table holds (each counts once in its
        block's refcount)."""
        return tuple(b for b in self.table if b is not None)


@dataclass(frozen=True)
class Pool:
    """The block pool of one layer. ``blocks[i]`` is block ``i``'s slot
    contents (token identities, ``None`` where nobody wrote), ``refcounts[i]``
    its refcount (0: free), ``free`` the free list in increasing id order.
    ``len(blocks)`` is the pool size; it grows by ``chunk`` blocks up to
    ``max_blocks`` (None: unbounded)."""

    block_size: int
    chunk: int = 1
    max_blocks: int | None = None
    inplace: bool = True
    blocks: tuple[tuple[int | None, ...], ...] = ()
    refcounts: tuple[int, ...] = ()
    free: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return len(self.blocks)

    def in_use(self) -> int:
        """Blocks with a refcount above 0."""
        return sum(1 for r in self.refcounts if r > 0)


@dataclass(frozen=True)
class PagedWorld:
    """The pool, the sequences that share it, and the abstract windows.

    ``windows`` maps each sequence name to its visible rows: the abstract
    model the physical pool must agree with (:func:`gathered_matches_windows`).
    ``next_token`` is the trace's token counter (identities never reused).
    Dicts are treated as immutable: every operation builds new ones."""

    pool: Pool
    seqs: Mapping[str, Sequence] = field(default_factory=dict)
    windows: Mapping[str, tuple[Entry, ...]] = field(default_factory=dict)
    next_token: int = 0
    #: the window the last append returned, and the one ``hold`` keeps alive
    #: (a pipelined step's view; it must never change)
    returned: tuple[int, ...] | None = None
    held: tuple[int, ...] | None = None
    #: names of sequences a release consumed: their handles are spent
    #: (:func:`handle_reuse`), also once a new sequence takes the name
    spent: frozenset[str] = frozenset()

    def window(self, seq: str = MAIN) -> tuple[int, ...]:
        """Token identities a fetch of ``seq`` returns (the abstract view)."""
        return tuple(e.token for e in _require(self, "fetch", seq)[1])


def new_world(block_size: int, max_blocks: int | None = None, chunk: int = 1,
              inplace: bool = True) -> PagedWorld:
    """A pool with one empty sequence ``"main"``. Raises InvalidArgumentError
    when ``block_size < 1``, ``chunk < 1`` or ``max_blocks < 0``."""
    for name, value, lo in (("block_size", block_size, 1), ("chunk", chunk, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise InvalidArgumentError(f"new_world: {name} must be an integer >= {lo}, got {value!r}")
    if max_blocks is not None and (isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 0):
        raise InvalidArgumentError(f"new_world: max_blocks must be None or an integer >= 0, got {max_blocks!r}")
    pool = Pool(block_size=block_size, chunk=chunk, max_blocks=max_blocks, inplace=inplace)
    return PagedWorld(pool, {MAIN: Sequence()}, {MAIN: ()})


def _require(world: PagedWorld, op: str, seq: str) -> tuple[Sequence, tuple[Entry, ...]]:
    if seq not in world.seqs:
        raise StateError(f"{op}: no sequence named {seq!r}")
    return world.seqs[seq], world.windows[seq]


def _check_count(op: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{op}: {name} must be an integer, got {value!r}")
    return value


# ---------------------------------------------------------------------------
# Pool actions (refcounts, free list)


def _set(t: tuple, i: int, v: object) -> tuple:
    return t[:i] + (v,) + t[i + 1 :]


def retain(pool: Pool, block: int) -> Pool:
    """One more table holds ``block``: its refcount rises."""
    return replace(pool, refcounts=_set(pool.refcounts, block, pool.refcounts[block] + 1))


def release_block(pool: Pool, block: int) -> Pool:
    """One table stops holding ``block``: its refcount falls; at 0 the block
    joins the free list. Its contents stay (stale, never read again until a
    new owner writes them)."""
    rc = pool.refcounts[block] - 1
    pool = replace(pool, refcounts=_set(pool.refcounts, block, rc))
    if rc == 0:
        pool = replace(pool, free=tuple(sorted((*pool.free, block))))
    return pool


def grow(pool: Pool, blocks: int) -> Pool:
    """Add ``blocks`` never-written blocks to the pool and the free list."""
    n = pool.size
    return replace(
        pool,
        blocks=pool.blocks + ((None,) * pool.block_size,) * blocks,
        refcounts=pool.refcounts + (0,) * blocks,
        free=pool.free + tuple(range(n, n + blocks)),
    )


def allocate(pool: Pool) -> tuple[int, Pool]:
    """Take the lowest free block (refcount 0 -> 1). The caller has made sure
    that one is free (:func:`reserve`)."""
    block = pool.free[0]
    pool = replace(pool, free=pool.free[1:], refcounts=_set(pool.refcounts, block, 1))
    return block, pool


def reserve(pool: Pool, op: str, needed: int) -> Pool:
    """Make ``needed`` blocks free, growing the pool by chunks if needed.
    Raises StateError (pool exhausted) and changes nothing when the pool
    cannot reach that many free blocks within ``max_blocks``: the check
    comes before any allocation, so a refused operation half-allocates
    nothing."""
    deficit = needed - len(pool.free)
    extra = growth_blocks(deficit, pool.size, pool.chunk, pool.max_blocks)
    if extra < deficit:
        raise StateError(
            f"{op}: pool exhausted: needs {needed} free blocks, has {len(pool.free)} free of "
            f"{pool.size} and max_blocks={pool.max_blocks}"
        )
    return grow(pool, extra) if extra > 0 else pool


def write_slot(pool: Pool, block: int, slot: int, token: int) -> Pool:
    """Store ``token`` in ``slot`` of ``block``."""
    return replace(pool, blocks=_set(pool.blocks, block, _set(pool.blocks[block], slot, token)))


def copy_block(pool: Pool, src: int, dst: int) -> Pool:
    """Copy every slot of ``src`` into ``dst``."""
    return replace(pool, blocks=_set(pool.blocks, dst, pool.blocks[src]))


# ---------------------------------------------------------------------------
# Reading


def gather(pool: Pool, seq: Sequence) -> tuple[int | None, ...]:
    """Read a sequence: its table's blocks, flattened, sliced
    ``[start, length)`` (by absolute position)."""
    bs = pool.block_size
    out = []
    for p in range(seq.start, seq.length):
        block = seq.table[block_index(p, bs)]
        out.append(None if block is None else pool.blocks[block][block_slot(p, bs)])
    return tuple(out)


# ---------------------------------------------------------------------------
# Sequence actions


@dataclass(frozen=True)
class AppendResult:
    """What an append of n rows returned and how it wrote: ``inplace`` when
    every row went in place; ``fresh`` blocks allocated for new block-table
    entries; ``copied`` blocks made by copy-on-write (old id, new id)."""

    window: tuple[int, ...]
    inplace: bool
    fresh: tuple[int, ...]
    copied: tuple[tuple[int, int], ...]


def blocks_needed(pool: Pool, seq: Sequence, n: int) -> int:
    """Blocks an append of ``n`` rows takes from the free list: one per new
    table entry, one per shared block it writes into (copy-on-write)."""
    bs = pool.block_size
    needed = 0
    for b in range(block_index(seq.length, bs), block_index(seq.length + n - 1, bs) + 1):
        if b >= len(seq.table) or needs_copy_on_write(pool.refcounts[seq.table[b]]):
            needed += 1
    return needed


def append(world: PagedWorld, seq: str, n: int) -> tuple[AppendResult, PagedWorld]:
    """``update_and_fetch`` of ``n`` new rows on sequence ``seq``, with the
    next ``n`` token identities, at absolute positions ``[length, length +
    n)``. Each row goes to ``table[p // block_size]``: a missing entry gets a
    fresh block, a shared block is copied first (copy-on-write), and the
    write goes in place iff :func:`write_in_place`. Returns the window.

    Raises InvalidArgumentError when ``n < 1``, StateError for an unknown
    sequence or when the pool is exhausted (nothing changes)."""
    name = seq
    s, window = _require(world, "append", name)
    n = _check_count("append", "n", n)
    if n < 1:
        raise InvalidArgumentError(f"append: n must be >= 1, got {n}")
    pool = reserve(world.pool, "append", blocks_needed(world.pool, s, n))
    bs = pool.block_size
    table = list(s.table)
    fresh: list[int] = []
    copied: list[tuple[int, int]] = []
    inplace = True
    entries = []
    for i in range(n):
        p, token = s.length + i, world.next_token + i
        b = block_index(p, bs)
        if b >= len(table):  # rows are contiguous: b == len(table)
            block, pool = allocate(pool)
            table.append(block)
            fresh.append(block)
        elif needs_copy_on_write(pool.refcounts[table[b]]):
            old = table[b]
            block, pool = allocate(pool)
            pool = release_block(copy_block(pool, old, block), old)
            table[b] = block
            copied.append((old, block))
        inplace = inplace and write_in_place(pool.inplace, pool.refcounts[table[b]], p, p)
        pool = write_slot(pool, table[b], block_slot(p, bs), token)
        entries.append(Entry(p, token))
    s = replace(s, table=tuple(table), length=s.length + n)
    window = window + tuple(entries)
    tokens = tuple(e.token for e in window)
    world = replace(world, pool=pool, seqs={**world.seqs, name: s}, windows={**world.windows, name: window},
                    next_token=world.next_token + n, returned=tokens)
    return AppendResult(tokens, inplace and not copied, tuple(fresh), tuple(copied)), world


def _truncated(pool: Pool, s: Sequence, length: int) -> tuple[Pool, Sequence]:
    """``s`` cut to ``length`` rows: every table entry at an index past
    ``table_len(length)`` is released."""
    keep = table_len(length, pool.block_size)
    for block in s.table[keep:]:
        if block is not None:
            pool = release_block(pool, block)
    return pool, replace(s, table=s.table[:keep], length=length)


def trim(world: PagedWorld, seq: str, n: int) -> tuple[int, PagedWorld]:
    """Trim ``n`` rows from the end of ``seq``, through the pool; returns
    how many were removed. ``n = clamp(n, 0, visible)``; ``length -= n``;
    blocks past ``ceil(length / block_size)`` are released. A trim that
    empties the window leaves ``length == start``. Raises StateError for an
    unknown sequence, InvalidArgumentError for a non-integer n."""
    s, window = _require(world, "trim", seq)
    n = clamp(_check_count("trim", "n", n), 0, s.visible)
    if n == 0:
        return 0, world
    pool, s = _truncated(world.pool, s, s.length - n)
    return n, replace(world, pool=pool, seqs={**world.seqs, seq: s},
                      windows={**world.windows, seq: window[: len(window) - n]})


def trim_to(world: PagedWorld, seq: str, length: int) -> tuple[int, PagedWorld]:
    """``trim(length_now - length)``. Raises InvalidArgumentError unless
    ``0 <= length <= length_now`` (a length below the logical start empties
    the window: the length stops at the start)."""
    s, _ = _require(world, "trim_to", seq)
    length = _check_count("trim_to", "len", length)
    if length < 0 or length > s.length:
        raise InvalidArgumentError(f"trim_to: len must satisfy 0 <= len <= offset ({s.length}), got {length}")
    return trim(world, seq, s.length - length)


def trim_front(world: PagedWorld, seq: str, n: int, keep: int = 0) -> tuple[int, PagedWorld]:
    """Evict the ``n`` oldest visible rows of ``seq``: the logical start
    moves by ``clamp(n, 0, visible)`` and every block wholly before it is
    released (its table entry becomes ``None``); the length never changes.
    Returns the number evicted. ``keep > 0`` (attention sinks) is refused
    with UnsupportedOperationError: a paged sequence cannot keep rows before
    its logical start."""
    s, window = _require(world, "trim_front", seq)
    n = _check_count("trim_front", "n", n)
    keep = _check_count("trim_front", "keep", keep)
    if keep > 0:
        raise UnsupportedOperationError(
            f"trim_front: keep must be 0 on a paged sequence (no attention sinks before the logical start), got {keep}"
        )
    n = clamp(n, 0, s.visible)
    if n == 0:
        return 0, world
    start = s.start + n
    pool, table = world.pool, list(s.table)
    for b, block in enumerate(table):
        if block is not None and wholly_before(b, start, pool.block_size):
            pool = release_block(pool, block)
            table[b] = None
    s = replace(s, table=tuple(table), start=start)
    return n, replace(world, pool=pool, seqs={**world.seqs, seq: s}, windows={**world.windows, seq: window[n:]})


def fork(world: PagedWorld, source: str, name: str) -> tuple[None, PagedWorld]:
    """A new sequence ``name`` sharing every block of ``source`` (each
    block's refcount rises by one): the paged form of a prompt-cache
    snapshot, O(table). Raises StateError for an unknown source or a name
    in use."""
    s, window = _require(world, "fork", source)
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"fork: as must be a non-empty string, got {name!r}")
    if name in world.seqs:
        raise StateError(f"fork: a sequence named {name!r} already exists")
    pool = world.pool
    for block in s.held():
        pool = retain(pool, block)
    return None, replace(world, pool=pool, seqs={**world.seqs, name: s}, windows={**world.windows, name: window})


def release(world: PagedWorld, seq: str) -> tuple[None, PagedWorld]:
    """Free sequence ``seq``: every block its table holds is released and
    the name is gone. Raises StateError for an unknown sequence."""
    s, _ = _require(world, "release", seq)
    pool = world.pool
    for block in s.held():
        pool = release_block(pool, block)
    seqs = {k: v for k, v in world.seqs.items() if k != seq}
    windows = {k: v for k, v in world.windows.items() if k != seq}
    return None, replace(world, pool=pool, seqs=seqs, windows=windows, spent=world.spent | {seq})


def fetch(world: PagedWorld, seq: str = MAIN) -> tuple[tuple[int, ...], PagedWorld]:
    """The window of ``seq`` without writing."""
    return world.window(seq), world


def hold(world: PagedWorld) -> tuple[None, PagedWorld]:
    """Keep the window the last append returned alive (a pipelined step).
    Raises StateError before any append."""
    if world.returned is None:
        raise StateError("hold: no append has returned a window yet")
    return None, replace(world, held=world.returned)


def release_hold(world: PagedWorld) -> tuple[None, PagedWorld]:
    return None, replace(world, held=None)


def snapshots_by_fork(op: str) -> UnsupportedOperationError:
    """A paged cache takes snapshots by ``fork`` (a named sequence sharing
    the blocks): ``snapshot``, ``restore`` and ``drop`` are refused."""
    return UnsupportedOperationError(f"{op}: a paged cache snapshots by fork and release, not {op}")


#: What a spent handle is used for again (kvtrace ``handle_reuse``'s
#: ``use``): every public method and property of the handle class that
#: reaches its sequence (``append`` is ``update_and_fetch``; ``set_state`` /
#: ``set_meta_state`` assign the property). The fuzzer derives the uses it
#: draws from the class itself (``kvspec.fuzz.paged.handle_api``) and a test holds
#: this tuple to that set, so a method added to the handle is driven and
#: needs its answer here.
HANDLE_REUSES = ("append", "fetch", "trim", "release", "trim_to", "trim_front", "trim_front_keep_sink", "fork",
                 "offset", "live_len", "size", "empty", "nbytes", "state", "set_state", "meta_state",
                 "set_meta_state", "make_mask")
#: The word a refused reuse names (the operation the handle refuses):
#: ``use`` itself unless listed (``size()`` reads ``offset``, ``empty()``
#: ``live_len``, ``meta_state =`` compares with the ``meta_state`` it reads).
REUSE_WORDS = {"size": "offset", "empty": "live_len", "set_state": "state", "set_meta_state": "meta_state",
               "trim_front_keep_sink": "trim_front"}


def handle_reuse(world: PagedWorld, seq: str, use: str) -> tuple[None, PagedWorld]:
    """The handle (``PagedKVCache``) of sequence ``seq`` that a release
    consumed, used again (``use``: one of :data:`HANDLE_REUSES`, every
    method and property of the handle that reaches its sequence: append a
    row, fetch, trims, fork, release, the protocol accessors, ``state`` and
    ``meta_state`` read or assigned, ``make_mask``): refused with StateError
    naming the operation (:data:`REUSE_WORDS`) whatever the arguments (a
    count of 0 or -1 too: the spent handle is refused before its arguments
    are checked) and nothing changes, also once a new
    sequence (a fork ``as`` that name) took the name: a spent handle never
    reaches another sequence's blocks (semantics.md 4, "handle reuse").
    StateError too when no release consumed a handle of that name (the
    trace holds none); InvalidArgumentError for another ``use``."""
    if use not in HANDLE_REUSES:
        raise InvalidArgumentError(f"handle_reuse: use must be one of {', '.join(HANDLE_REUSES)}, got {use!r}")
    if seq not in world.spent:
        raise StateError(f"handle_reuse: no handle of a released sequence named {seq!r}")
    raise StateError(f"{REUSE_WORDS.get(use, use)}: the handle of sequence {seq!r} was consumed by its release "
                     f"(take a new handle: PagedKVCache(pool, {seq!r}))")


def copy_refused(deep: bool) -> UnsupportedOperationError:
    """``copy.copy`` / ``copy.deepcopy`` of a paged sequence's cache is
    refused (semantics.md 4, "copies"): its blocks belong to the pool and
    may be shared with other sequences, so a shallow copy would be a second
    writer of the same sequence and a deep copy a copy of the whole pool
    aliasing its memory. ``fork`` is the paged copy."""
    how = "copy.deepcopy" if deep else "copy.copy"
    return UnsupportedOperationError(
        f"copy: {how} of a PagedKVCache is refused: its blocks belong to its pool and may be shared with other "
        "sequences (a shallow copy would write the same sequence, a deep copy would copy the whole pool and alias "
        "its memory); fork(name) is the paged copy (O(table), copy-on-write)")


def holds_buffer(world: PagedWorld) -> bool:
    """Whether the pool has its slabs (its first growth fixed the rows'
    kv heads, head dims and dtype: an append's rows must match them)."""
    return world.pool.size > 0


def append_mismatch(world: PagedWorld, seq: str, n: int, differs: str) -> tuple[None, PagedWorld]:
    """An append to ``seq`` of ``n`` rows whose ``differs`` (batch, kv heads,
    K or V head dim, dtype) is not the pool's (a batch other than 1 on any
    pool; the rest once the pool has its slabs, :func:`holds_buffer`):
    refused with InvalidArgumentError, nothing changes (the rule of
    ``kvspec.spec.dense.w_append_mismatch``; StateError first for an unknown
    sequence)."""
    _require(world, "append", seq)
    w_append_mismatch(world, n, differs)  # type: ignore[arg-type]  # always raises
    raise AssertionError("unreachable")


def append_pair_mismatch(world: PagedWorld, seq: str, n: int, differs: str) -> tuple[None, PagedWorld]:
    """An append to ``seq`` of a K/V pair whose values disagree with its
    keys in ``differs`` (dtype, batch, kv heads, rows): refused with
    InvalidArgumentError on any pool, slabs or not, nothing changes (the
    rule of ``kvspec.spec.dense.w_append_pair_mismatch``; StateError first for an
    unknown sequence)."""
    _require(world, "append", seq)
    w_append_pair_mismatch(world, n, differs)  # type: ignore[arg-type]  # always raises
    raise AssertionError("unreachable")


def load_state(world: PagedWorld, seq: str) -> PagedWorld:
    """``cache.state = rows`` on sequence ``seq`` with its own window's rows:
    a new table of fresh blocks (the lowest free, the pool grown by chunks
    as for an append) holds them from position 0, then the old table's
    blocks are released (a block a fork shares stays with the fork), so the
    sequence keeps its window in private blocks; length = rows, start 0.
    Raises StateError (pool exhausted, nothing changed) when the new blocks
    do not fit beside the old ones."""
    s, window = _require(world, "state", seq)
    return _assigned(world, seq, s, [e.token for e in window])


def state_assign(world: PagedWorld, seq: str, n: int) -> tuple[None, PagedWorld]:
    """``cache.state = (keys, values)`` on sequence ``seq``'s handle with
    ``n`` new rows (the next ``n`` token identities; ``n == 0``: ``state =
    ()``, the sequence emptied): as :func:`load_state` says, a new table of
    fresh blocks holds them from position 0 and only then are the old
    table's blocks released; length = n, start 0, the sequence's handles
    stay live. Raises StateError for an unknown sequence, and StateError
    (pool exhausted) when the new blocks do not fit beside the old ones: a
    refused assignment changes nothing (not the table, not a block, not a
    refcount: the old blocks are still the sequence's). InvalidArgumentError
    for ``n < 0``."""
    s, _ = _require(world, "state", seq)
    n = _check_count("state", "n", n)
    if n < 0:
        raise InvalidArgumentError(f"state: n must be >= 0, got {n}")
    world = _assigned(world, seq, s, list(range(world.next_token, world.next_token + n)))
    return None, replace(world, next_token=world.next_token + n)


def _assigned(world: PagedWorld, seq: str, s: Sequence, tokens: list[int]) -> PagedWorld:
    """Sequence ``seq`` (now ``s``) holding ``tokens`` from position 0 in
    fresh blocks, its old blocks released after (:func:`load_state`)."""
    bs = world.pool.block_size
    pool = reserve(world.pool, "append", table_len(len(tokens), bs))
    table: list[int] = []
    for i, token in enumerate(tokens):
        if block_slot(i, bs) == 0:
            block, pool = allocate(pool)
            table.append(block)
        pool = write_slot(pool, table[-1], block_slot(i, bs), token)
    for block in s.held():
        pool = release_block(pool, block)
    s = Sequence(tuple(table), len(tokens), 0)
    window = tuple(Entry(i, t) for i, t in enumerate(tokens))
    return replace(world, pool=pool, seqs={**world.seqs, seq: s}, windows={**world.windows, seq: window})


def reload(world: PagedWorld, seq: str, via: str) -> tuple[None, PagedWorld]:
    """Save and load sequence ``seq`` (semantics.md 4, "prompt-cache files").
    ``via="file"``: refused with UnsupportedOperationError, nothing written,
    nothing changed: a prompt-cache file cannot hold a paged sequence alone
    (its blocks belong to the pool and may be shared with forks; its rows go
    through a dense cache). ``via="state"``, mlx-lm's load order on the
    sequence's handle (``state = saved``, then ``meta_state = saved``): the
    rows load as :func:`load_state` says and the ``meta_state`` assignment
    is accepted because it describes exactly what the sequence then holds
    (the pool's block size, offset = rows, start 0), which holds for a
    sequence that starts at position 0 (a front-trimmed one would come back
    from position 0 with its counters refused: a trace gives this path only
    on a sequence with ``start == 0``)."""
    _require(world, "reload", seq)
    if via == "state":
        return None, load_state(world, seq)
    if via != "file":
        raise InvalidArgumentError(f"reload: via must be 'file' or 'state', got {via!r}")
    raise UnsupportedOperationError(
        "save_prompt_cache: layer 0 is a PagedKVCache, whose blocks belong to its pool and may be "
        "shared with other sequences, so a file cannot hold it alone (docs/paged.md); save its rows "
        "through a dense cache (kvspec.impl.dense.KVCache.from_state(layer.state))")


def apply_op(world: PagedWorld, op: dict) -> tuple[object, PagedWorld]:
    """Run one kvtrace op (``kind: paged``) on ``world``: ``(result, new
    world)``; every op takes ``"seq"`` (default ``"main"``); ``fork`` takes
    ``"from"`` (default ``"main"``) and ``"as"``. ``expect`` returns the
    window it names and changes nothing (the harness compares it). Raises
    the spec's refusal, or UnsupportedOperationError for an op the paged
    cache does not have. Module functions are looked up at call time, so a
    test that patches one (a proof's negative control) reaches it here."""
    name = op["op"]
    seq = op.get("seq", MAIN)
    if name == "append":
        return append(world, seq, op["n"])
    if name == "fetch":
        return fetch(world, seq)
    if name == "trim":
        return trim(world, seq, op["n"])
    if name == "trim_to":
        return trim_to(world, seq, op["len"])
    if name == "trim_front":
        return trim_front(world, seq, op["n"], op.get("keep", 0))
    if name == "fork":
        return fork(world, op.get("from", MAIN), op["as"])
    if name == "release":
        return release(world, seq)
    if name == "expect":
        return fetch(world, op.get("of") or seq)
    if name == "hold":
        return hold(world)
    if name == "release_hold":
        return release_hold(world)
    if name in ("snapshot", "restore", "drop"):
        raise snapshots_by_fork(name)
    if name == "copy":
        _require(world, "copy", seq)
        raise copy_refused(op.get("deep", True))
    if name == "append_mismatch":
        return append_mismatch(world, seq, op["n"], op["differs"])
    if name == "append_pair_mismatch":
        return append_pair_mismatch(world, seq, op["n"], op["differs"])
    if name == "reload":
        return reload(world, seq, op.get("via", "file"))
    if name == "handle_reuse":
        return handle_reuse(world, seq, op.get("use", "append"))
    if name == "state_assign":
        return state_assign(world, seq, op["n"])
    raise UnsupportedOperationError(f"{name}: not an operation of a paged cache")


# ---------------------------------------------------------------------------
# Invariants (semantics.md 4 and 5): each True on every reachable world.


def refcounts_match_tables(world: PagedWorld) -> bool:
    """A block's refcount equals the number of tables holding it."""
    counts = [0] * world.pool.size
    for s in world.seqs.values():
        for block in s.held():
            counts[block] += 1
    return tuple(counts) == world.pool.refcounts


def free_blocks_unheld(world: PagedWorld) -> bool:
    """No block is both free and held: the free list holds exactly the
    blocks of refcount 0, once each."""
    pool = world.pool
    held = {b for s in world.seqs.values() for b in s.held()}
    return (len(set(pool.free)) == len(pool.free) and not held & set(pool.free)
            and set(pool.free) == {i for i, r in enumerate(pool.refcounts) if r == 0})


def blocks_accounted(world: PagedWorld) -> bool:
    """Blocks in use + free blocks = pool size."""
    return world.pool.in_use() + len(world.pool.free) == world.pool.size


def tables_well_formed(world: PagedWorld) -> bool:
    """Each table has ``ceil(length / block_size)`` entries, ``None``
    exactly at the blocks wholly before the logical start, and
    ``0 <= start <= length``; no table holds a block twice."""
    bs = world.pool.block_size
    for s in world.seqs.values():
        if not 0 <= s.start <= s.length or len(s.table) != table_len(s.length, bs):
            return False
        if any((block is None) != wholly_before(b, s.start, bs) for b, block in enumerate(s.table)):
            return False
        if len(set(s.held())) != len(s.held()):
            return False
    return True


def gathered_matches_windows(world: PagedWorld) -> bool:
    """Every sequence's gathered window equals its abstract window (what a
    dense cache fed the same rows returns), positions included."""
    for name, s in world.seqs.items():
        window = world.windows[name]
        if gather(world.pool, s) != tuple(e.token for e in window):
            return False
        if tuple(e.position for e in window) != tuple(range(s.start, s.length)):
            return False
    return True


def views_unchanged(before: PagedWorld, after: PagedWorld, writer: str) -> bool:
    """No write changes a row another sequence sees: every sequence other
    than ``writer`` gathers the same rows after as before."""
    return all(gather(after.pool, after.seqs[name]) == gather(before.pool, s)
               for name, s in before.seqs.items() if name != writer and name in after.seqs)


INVARIANTS = (refcounts_match_tables, free_blocks_unheld, blocks_accounted, tables_well_formed,
              gathered_matches_windows)


def broken_invariants(world: PagedWorld) -> tuple[str, ...]:
    """Names of the invariants ``world`` breaks (empty on every reachable
    world)."""
    return tuple(inv.__name__ for inv in INVARIANTS if not inv(world))
