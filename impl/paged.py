"""Pool-backed (paged) MLX KV cache (spec: ``kvspec.spec.paged``, semantics.md 4).

One :class:`BlockPool` per layer holds the K and V slabs ``[blocks,
block_size, H, D]`` (K and V head dims may differ), grown by ``chunk``
blocks up to ``max_blocks``, a refcount per block and a free list. Each
sequence has a block table indexed by **absolute** position //
block_size, a length (its offset) and a logical start. Several sequences
share blocks after a :meth:`BlockPool.fork` (the paged form of a
prompt-cache snapshot).

Write rule (``kvspec.spec.paged.needs_copy_on_write``, ``kvspec.spec.paged.write_in_place``):
a write into a block whose refcount is above 1 first copies the block into a
fresh one and repoints the writer's table (copy on write); a write into a
block that exactly one sequence holds, at that sequence's own next row, goes
straight into the evaluated slab's memory (``kvspec.impl.write.write_inplace``: a
NumPy view on the CPU, a device kernel on CUDA); otherwise (the in-place
switch off) the slab is replaced by a copying update that MLX donates when
nothing else holds the slab (``kvspec.impl.write.write_copy``).

Why an in-place write is safe here: the slabs are referenced by the pool
only. Readers get :meth:`BlockPool.fetch`'s gather, which is evaluated into
its own memory before it is returned, so no window a caller holds aliases a
slab; and no other table points at a block of refcount 1. So the written
slot is invisible to everyone but the writer, who does not see it yet.

Batch is 1 per sequence (a paged engine batches across sequences); rows are
stored in the dtype the model hands in, fixed by the pool's first write.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Self

import mlx.core as mx

from kvspec.impl.dense import _check_int, _check_rows, inplace_switch_from_env, refuse_foreign_save
from kvspec.impl.masks import causal_mask
from kvspec.impl.write import inplace_keeps_memory, write_copy, write_inplace
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError

MAIN = "main"


def block_index(position: int, block_size: int) -> int:
    """``position // block_size`` (kvspec.spec.paged.block_index): tables are
    indexed by absolute position."""
    return position // block_size


def table_len(length: int, block_size: int) -> int:
    """``ceil(length / block_size)`` (kvspec.spec.paged.table_len)."""
    return -(-length // block_size)


class BlockTable(list):
    """A block table: a list of block ids (``None`` where a front trim
    released a block), which records the lowest index changed since the
    device mirror was last brought up to date (:meth:`BlockPool.fetch`
    gathers through that mirror). Every mutating list method marks; reads
    are a plain list's."""

    dirty_from: int = 0

    def _mark(self, i: int) -> None:
        self.dirty_from = min(self.dirty_from, max(0, i))

    def _mark_index(self, index: Any) -> None:
        if isinstance(index, slice):
            self._mark(index.indices(len(self))[0])
        else:
            self._mark(index if index >= 0 else len(self) + index)

    def __setitem__(self, index: Any, value: Any) -> None:
        self._mark_index(index)
        super().__setitem__(index, value)

    def __delitem__(self, index: Any) -> None:
        self._mark_index(index)
        super().__delitem__(index)

    def append(self, value: Any) -> None:
        """Append a block id (``list.append``), marking the new entry for the device mirror of the
        table. Rule: ``kvspec.spec.paged.block_index`` (semantics.md 4, "where a row lives")."""
        self._mark(len(self))
        super().append(value)

    def extend(self, values: Any) -> None:
        """Append block ids (``list.extend``), marking them for the device mirror. Rule:
        ``kvspec.spec.paged.block_index`` (semantics.md 4, "where a row lives")."""
        self._mark(len(self))
        super().extend(values)

    def __iadd__(self, values: Any) -> Self:
        self.extend(values)
        return self

    def insert(self, index: Any, value: Any) -> None:
        """``list.insert``; the device mirror reloads the whole table. Rule:
        ``kvspec.spec.paged.block_index`` (semantics.md 4, "where a row lives")."""
        self._mark(0)
        super().insert(index, value)

    def pop(self, index: Any = -1) -> Any:
        """``list.pop``; the device mirror reloads the whole table. Rule: ``kvspec.spec.paged.block_index``
        (semantics.md 4, "where a row lives")."""
        self._mark(0)
        return super().pop(index)

    def remove(self, value: Any) -> None:
        """``list.remove``; the device mirror reloads the whole table. Rule:
        ``kvspec.spec.paged.block_index`` (semantics.md 4, "where a row lives")."""
        self._mark(0)
        super().remove(value)

    def clear(self) -> None:
        """``list.clear``; the device mirror reloads the whole table. Rule:
        ``kvspec.spec.paged.block_index`` (semantics.md 4, "where a row lives")."""
        self._mark(0)
        super().clear()

    def sort(self, *a: Any, **k: Any) -> None:
        """``list.sort``; the device mirror reloads the whole table. Rule:
        ``kvspec.spec.paged.block_index`` (semantics.md 4, "where a row lives")."""
        self._mark(0)
        super().sort(*a, **k)

    def reverse(self) -> None:
        """``list.reverse``; the device mirror reloads the whole table. Rule:
        ``kvspec.spec.paged.block_index`` (semantics.md 4, "where a row lives")."""
        self._mark(0)
        super().reverse()


class _TableMirror:
    """The device copy of a block table (int32, ``None`` as 0: only blocks
    wholly before the logical start are ``None``, and no gather reads them),
    with spare capacity, kept up to date by writing only the entries from
    the table's ``dirty_from`` on (a static slice update MLX donates: O(new
    entries) a step, no host read)."""

    def __init__(self) -> None:
        self.array: mx.array | None = None
        self.of: BlockTable | None = None
        self.synced = 0  # entries [0, synced) of array equal the table's

    def sync(self, table: BlockTable) -> mx.array:
        if self.of is not table:  # a table assigned whole: resync it all
            self.of, self.synced = table, 0
        lo = min(table.dirty_from, self.synced, len(table))
        n = len(table)
        if self.array is None or n > self.array.shape[0]:
            cap = max(16, 2 * n)
            grown = mx.zeros((cap,), dtype=mx.int32)
            if self.array is not None and lo:
                grown = write_copy(grown, self.array[:lo], (slice(0, lo),))
            self.array = grown
        if n > lo:
            self.array = write_copy(self.array, mx.array([0 if b is None else b for b in table[lo:n]],
                                                         dtype=mx.int32), (slice(lo, n),))
        self.synced = n
        table.dirty_from = n
        return self.array


@dataclass
class Sequence:
    """A sequence of the pool: block table (``None`` where a front trim
    released a block wholly before the logical start), length, start."""

    table: list[int | None] = field(default_factory=list)
    length: int = 0
    start: int = 0
    mirror: _TableMirror = field(default_factory=_TableMirror, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.table, BlockTable):
            self.table = BlockTable(self.table)

    @property
    def visible(self) -> int:
        """Rows a fetch returns, ``length - start``. Rule: ``kvspec.spec.paged.fetch`` (semantics.md 4,
        "where a row lives")."""
        return self.length - self.start

    def held(self) -> list[int]:
        """The block ids the table holds, in table order (entries a front trim released left out).
        Rule: ``kvspec.spec.paged.wholly_before`` (semantics.md 4, "front trim")."""
        return [b for b in self.table if b is not None]


@dataclass(frozen=True)
class WriteInfo:
    """How the last append wrote: ``inplace`` when every row went in place,
    the ``fresh`` blocks it allocated and the ``copied`` (old, new) blocks
    of its copies on write (kvspec.spec.paged.AppendResult)."""

    inplace: bool
    fresh: tuple[int, ...]
    copied: tuple[tuple[int, int], ...]


class BlockPool:
    """The block pool of one layer, shared by named sequences.

    ``block_size`` rows per block; ``chunk`` blocks per slab growth;
    ``max_blocks`` the pool's ceiling (None: unbounded); ``inplace`` the
    in-place switch (None: ``KV_INPLACE_WRITE``). Starts with one empty
    sequence ``"main"``. Every refused operation raises one of
    :mod:`kvspec.spec.errors` and leaves every sequence, refcount, the free list
    and the slabs exactly as they were.
    """

    def __init__(self, block_size: int, max_blocks: int | None = None, chunk: int = 16,
                 inplace: bool | None = None):
        block_size = _check_int("BlockPool", "block_size", block_size)
        chunk = _check_int("BlockPool", "chunk", chunk)
        if block_size < 1:
            raise InvalidArgumentError(f"BlockPool: block_size must be >= 1, got {block_size}")
        if chunk < 1:
            raise InvalidArgumentError(f"BlockPool: chunk must be >= 1, got {chunk}")
        if max_blocks is not None and _check_int("BlockPool", "max_blocks", max_blocks) < 0:
            raise InvalidArgumentError(f"BlockPool: max_blocks must be None or >= 0, got {max_blocks}")
        self.block_size = block_size
        self.chunk = chunk
        self.max_blocks = max_blocks
        self.inplace = inplace_switch_from_env() if inplace is None else bool(inplace)
        self.keys: mx.array | None = None  # [blocks, block_size, H, Dk]
        self.values: mx.array | None = None  # [blocks, block_size, H, Dv]
        self.refcounts: list[int] = []
        self.free: list[int] = []  # increasing block ids
        self.seqs: dict[str, Sequence] = {MAIN: Sequence()}
        self.last_write: WriteInfo | None = None

    # -- observables --------------------------------------------------------
    @property
    def size(self) -> int:
        """Blocks in the pool (in use + free).

        Rule: ``kvspec.spec.paged.blocks_accounted`` (semantics.md 4, "exhaustion")."""
        return len(self.refcounts)

    def in_use(self) -> int:
        """Blocks of refcount above 0. Rule: ``kvspec.spec.paged.blocks_accounted`` (semantics.md 4,
        "fork / release")."""
        return sum(1 for r in self.refcounts if r > 0)

    def sequence(self, seq: str = MAIN) -> Sequence:
        """The named sequence (StateError when there is none).

        Rule: ``kvspec.spec.paged.handle_reuse`` (semantics.md 4, "handle reuse")."""
        return self._require("sequence", seq)

    def _require(self, op: str, seq: str) -> Sequence:
        s = self.seqs.get(seq)
        if s is None:
            raise StateError(f"{op}: no sequence named {seq!r}")
        return s

    def capacity(self, seq: str = MAIN) -> int:
        """``len(block table) * block_size`` (kvspec.spec.paged.capacity_of)."""
        return len(self._require("capacity", seq).table) * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of the slabs (every block, in use or free).

        Rule: ``kvspec.spec.paged.growth_blocks`` (semantics.md 4, "exhaustion")."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    # -- pool actions -------------------------------------------------------
    def _release_block(self, block: int) -> None:
        """kvspec.spec.paged.release_block: refcount - 1, free at 0."""
        self.refcounts[block] -= 1
        if self.refcounts[block] == 0:
            self.free.append(block)
            self.free.sort()

    def _allocate(self) -> int:
        """kvspec.spec.paged.allocate: the lowest free block, refcount 1."""
        block = self.free.pop(0)
        self.refcounts[block] = 1
        return block

    def _growth(self, needed: int) -> int:
        """kvspec.spec.paged.growth_blocks: whole chunks, capped at max_blocks."""
        deficit = needed - len(self.free)
        if deficit <= 0:
            return 0
        want = -(-deficit // self.chunk) * self.chunk
        return want if self.max_blocks is None else max(0, min(want, self.max_blocks - self.size))

    def _grow(self, blocks: int, keys: mx.array, values: mx.array) -> None:
        """Add ``blocks`` zero blocks to both slabs (shaped and typed after
        the incoming rows on the first growth) and to the free list."""
        _, h, _, dk = keys.shape
        dv = values.shape[3]
        zk = mx.zeros((blocks, self.block_size, h, dk), dtype=keys.dtype)
        zv = mx.zeros((blocks, self.block_size, h, dv), dtype=values.dtype)
        self.keys = zk if self.keys is None else mx.concatenate([self.keys, zk], axis=0)
        self.values = zv if self.values is None else mx.concatenate([self.values, zv], axis=0)
        mx.eval(self.keys, self.values)
        n = self.size
        self.refcounts += [0] * blocks
        self.free += list(range(n, n + blocks))

    def _check_compatible(self, keys: mx.array, values: mx.array) -> None:
        if keys.shape[0] != 1:
            raise InvalidArgumentError(f"append: batch must be 1 per pool sequence, got keys of shape {tuple(keys.shape)}")
        if self.keys is None:
            return
        for name, a, slab in (("keys", keys, self.keys), ("values", values, self.values)):
            if a.shape[1] != slab.shape[2] or a.shape[3] != slab.shape[3] or a.dtype != slab.dtype:
                raise InvalidArgumentError(
                    f"append: {name} must match the pool's [H, D] = [{slab.shape[2]}, {slab.shape[3]}] and dtype "
                    f"{slab.dtype}, got shape {tuple(a.shape)} and dtype {a.dtype}"
                )

    def _blocks_needed(self, s: Sequence, n: int) -> int:
        """kvspec.spec.paged.blocks_needed: one per new table entry, one per shared
        block written into (copy on write)."""
        bs = self.block_size
        return sum(1 for b in range(block_index(s.length, bs), block_index(s.length + n - 1, bs) + 1)
                   if b >= len(s.table) or self.refcounts[s.table[b]] > 1)

    def _copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` into the fresh block ``dst`` (its only holder is
        the writer, so in place when the switch is on)."""
        # The block is gathered into its own memory first: a slice of the slab
        # would keep the slab referenced and stop MLX from reusing it.
        at = (slice(dst, dst + 1),)
        blocks = [mx.take(slab, mx.array([src]), axis=0) for slab in (self.keys, self.values)]
        mx.eval(*blocks)
        write = write_inplace if self.inplace else write_copy
        self.keys = write(self.keys, blocks[0], at)
        self.values = write(self.values, blocks[1], at)

    def _write(self, block: int, slot: int, keys: mx.array, values: mx.array, inplace: bool) -> None:
        """Write rows ``[1, H, m, D]`` into slots ``[slot, slot + m)`` of
        ``block``: in place when ``inplace`` (the caller checked
        kvspec.spec.paged.write_in_place), else by a copying slab update (both
        through kvspec.impl.write)."""
        m = keys.shape[2]
        rk, rv = keys[0].transpose(1, 0, 2), values[0].transpose(1, 0, 2)  # [m, H, D]
        index = (slice(block, block + 1), slice(slot, slot + m))
        if inplace:
            self.keys = write_inplace(self.keys, rk[None], index)
            self.values = write_inplace(self.values, rv[None], index)
        else:
            self.keys = write_copy(self.keys, rk[None], index)
            self.values = write_copy(self.values, rv[None], index)

    def _reserve(self, s: Sequence, needed: int, keys: mx.array, values: mx.array) -> None:
        """kvspec.spec.paged.reserve: make ``needed`` blocks free, growing the slabs
        by whole chunks; StateError (pool exhausted) before any change when
        ``max_blocks`` cannot cover them."""
        extra = self._growth(needed)
        if len(self.free) + extra < needed:
            raise StateError(
                f"append: pool exhausted: needs {needed} free blocks, has {len(self.free)} free of "
                f"{self.size} and max_blocks={self.max_blocks}"
            )
        if extra:
            self._grow(extra, keys, values)

    @staticmethod
    def _needs_copy_on_write(refcount: int) -> bool:
        """kvspec.spec.paged.needs_copy_on_write: the block is shared."""
        return refcount > 1

    def _copy_on_write(self, s: Sequence, b: int) -> int:
        """Copy ``s``'s shared block at table index ``b`` into a fresh block,
        repoint the table and release the shared block (kvspec.spec.paged.append,
        copy-on-write). Returns the copy's id."""
        old, new = s.table[b], self._allocate()
        self._copy_block(old, new)
        self._release_block(old)
        s.table[b] = new
        return new

    def _table_entries(self, s: Sequence, length: int) -> int:
        """Entries ``s``'s table keeps for ``length`` rows:
        ``table_len(length)`` by absolute position (kvspec.spec.paged.table_len)."""
        return table_len(length, self.block_size)

    # -- sequence operations ------------------------------------------------
    def append(self, seq: str, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """``update_and_fetch`` of ``keys``/``values`` ``[1, H, n, D]`` (K
        and V head dims may differ) on sequence ``seq``, at absolute
        positions ``[length, length + n)`` (kvspec.spec.paged.append). Returns the
        window ``[1, H, visible, D]``, evaluated. ``last_write`` says how it
        wrote.

        Raises InvalidArgumentError for malformed rows (rank, batch, dtype,
        shape against the pool's), StateError for an unknown sequence or an
        exhausted pool; refused appends change nothing."""
        s = self._require("append", seq)
        n = _check_rows("append", keys, values)
        self._check_compatible(keys, values)
        self._reserve(s, self._blocks_needed(s, n), keys, values)
        bs = self.block_size
        fresh: list[int] = []
        copied: list[tuple[int, int]] = []
        all_inplace = True
        i = 0
        while i < n:
            p = s.length + i
            b, slot = block_index(p, bs), p % bs
            m = min(n - i, bs - slot)
            if b >= len(s.table):
                s.table.append(self._allocate())
                fresh.append(s.table[b])
            elif self._needs_copy_on_write(self.refcounts[s.table[b]]):
                old = s.table[b]
                copied.append((old, self._copy_on_write(s, b)))
            inplace = self.inplace and self.refcounts[s.table[b]] == 1  # kvspec.spec.paged.write_in_place
            all_inplace = all_inplace and inplace
            self._write(s.table[b], slot, keys[:, :, i : i + m], values[:, :, i : i + m], inplace)
            i += m
        s.length += n
        self.last_write = WriteInfo(all_inplace and not copied, tuple(fresh), tuple(copied))
        window = self.fetch(seq)
        assert window is not None
        return window

    def fetch(self, seq: str = MAIN) -> tuple[mx.array, mx.array] | None:
        """Gather ``seq``'s table's blocks, flattened, sliced ``[start,
        length)``: ``(keys, values)`` ``[1, H, visible, D]`` in memory of
        their own (a gather never aliases a slab); None when nothing is
        visible.

        The gather goes through the device mirror of the block table
        (:class:`_TableMirror`): the host work is O(table entries changed
        since the last fetch), never a list of every position, and no slab
        is read on the host. Where an in-place write goes into a slab behind
        MLX's graph (the NumPy view, the CUDA kernel: kvspec.impl.write.
        inplace_keeps_memory) the gather is evaluated before it is returned,
        so no later in-place write can reach a window already handed out;
        under CUDA's ``donate`` (and with the in-place switch off) every
        write is a graph node that the gather depends on, so the gather is
        left lazy for the caller's evaluation, as a dense cache's window is.

        Rule: ``kvspec.spec.paged.fetch``, ``kvspec.spec.paged.gather`` (semantics.md 4, "where a row lives")."""
        s = self._require("fetch", seq)
        if s.visible == 0 or self.keys is None:
            return None
        if not isinstance(s.table, BlockTable):
            s.table = BlockTable(s.table)
        bs = self.block_size
        first, end = block_index(s.start, bs), table_len(s.length, bs)
        blocks = s.mirror.sync(s.table)[first:end]
        lo, hi = s.start - first * bs, s.length - first * bs
        out = []
        for slab in (self.keys, self.values):
            rows = mx.take(slab, blocks, axis=0)  # [blocks, bs, H, D]
            rows = rows.reshape(-1, slab.shape[2], slab.shape[3])[lo:hi]
            out.append(rows.transpose(1, 0, 2)[None])
        if self.inplace and inplace_keeps_memory():
            mx.eval(*out)
        return out[0], out[1]

    def _truncate(self, s: Sequence, length: int) -> None:
        keep = self._table_entries(s, length)
        for block in s.table[keep:]:
            if block is not None:
                self._release_block(block)
        del s.table[keep:]
        s.length = length

    def trim(self, seq: str, n: int) -> int:
        """Trim ``clamp(n, 0, visible)`` rows from the end, releasing the
        blocks past ``ceil(length / block_size)`` (kvspec.spec.paged.trim).
        Returns the rows removed."""
        s = self._require("trim", seq)
        n = max(0, min(_check_int("trim", "n", n), s.visible))
        if n:
            self._truncate(s, s.length - n)
        return n

    def trim_to(self, seq: str, length: int) -> int:
        """``trim(length_now - length)``; InvalidArgumentError unless ``0 <=
        length <= length_now`` (kvspec.spec.paged.trim_to)."""
        s = self._require("trim_to", seq)
        length = _check_int("trim_to", "len", length)
        if length < 0 or length > s.length:
            raise InvalidArgumentError(f"trim_to: len must satisfy 0 <= len <= offset ({s.length}), got {length}")
        return self.trim(seq, s.length - length)

    def trim_front(self, seq: str, n: int, keep: int = 0) -> int:
        """Move the logical start by ``clamp(n, 0, visible)`` and release
        every block wholly before it (kvspec.spec.paged.trim_front). ``keep > 0``
        is refused (UnsupportedOperationError)."""
        s = self._require("trim_front", seq)
        n = _check_int("trim_front", "n", n)
        keep = _check_int("trim_front", "keep", keep)
        if keep > 0:
            raise UnsupportedOperationError(
                "trim_front: keep must be 0 on a paged sequence (no attention sinks before the logical start), "
                f"got {keep}"
            )
        n = max(0, min(n, s.visible))
        if n:
            s.start += n
            for b, block in enumerate(s.table):
                if block is not None and b < s.start // self.block_size:  # kvspec.spec.paged.wholly_before
                    self._release_block(block)
                    s.table[b] = None
        return n

    def fork(self, source: str, name: str) -> None:
        """A new sequence ``name`` sharing every block of ``source``
        (refcounts rise) (kvspec.spec.paged.fork). StateError for an unknown source
        or a name in use."""
        s = self._require("fork", source)
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"fork: as must be a non-empty string, got {name!r}")
        if name in self.seqs:
            raise StateError(f"fork: a sequence named {name!r} already exists")
        for block in s.held():
            self.refcounts[block] += 1
        self.seqs[name] = Sequence(list(s.table), s.length, s.start)

    def release(self, seq: str) -> None:
        """Release every block of ``seq`` and forget it (kvspec.spec.paged.release)."""
        s = self._require("release", seq)
        for block in s.held():
            self._release_block(block)
        del self.seqs[seq]

    def create(self, seq: str) -> None:
        """A new empty sequence (StateError when the name is in use).

        Rule: ``kvspec.spec.paged.new_world`` (semantics.md 4, "handle reuse")."""
        if seq in self.seqs:
            raise StateError(f"create: a sequence named {seq!r} already exists")
        self.seqs[seq] = Sequence()

    # -- invariants (kvspec.spec.paged.INVARIANTS, on the implementation) -----------
    def broken_invariants(self) -> tuple[str, ...]:
        """Names of the pool invariants this pool breaks (empty when sound):
        refcounts equal table holdings, the free list is exactly the blocks
        of refcount 0 (once each, none held), in use + free = size, tables
        well formed.

        Rule: ``kvspec.spec.paged.broken_invariants`` (semantics.md 4, "fork / release")."""
        bad = []
        counts = [0] * self.size
        for s in self.seqs.values():
            for block in s.held():
                if 0 <= block < self.size:
                    counts[block] += 1
        if counts != self.refcounts:
            bad.append("refcounts_match_tables")
        held = {b for s in self.seqs.values() for b in s.held()}
        if (len(set(self.free)) != len(self.free) or held & set(self.free)
                or set(self.free) != {i for i, r in enumerate(self.refcounts) if r == 0}):
            bad.append("free_blocks_unheld")
        if self.in_use() + len(self.free) != self.size:
            bad.append("blocks_accounted")
        bs = self.block_size
        for s in self.seqs.values():
            if (not 0 <= s.start <= s.length or len(s.table) != table_len(s.length, bs)
                    or any((blk is None) != (b < s.start // bs) for b, blk in enumerate(s.table))
                    or len(set(s.held())) != len(s.held())):
                bad.append("tables_well_formed")
                break
        return tuple(bad)


class PagedKVCache:
    """mlx-lm's cache protocol on one pool sequence: a model decodes through
    it like through ``mlx_lm.models.cache.KVCache``.

    Reads gather the sequence's blocks (``[1, H, visible, D]``, the dtype the
    model handed in). ``offset`` is the sequence's length (the absolute RoPE
    position of the next row, unchanged by front trims). Trims go through the
    pool: there is no dense buffer to rewind, so the dense-side part of a
    trim is a no-op; ``trim(n)`` shortens the pool sequence and releases the
    blocks past ``ceil(length / block_size)``, exactly as
    :meth:`BlockPool.trim`. :meth:`fork` is the prompt-cache snapshot.
    """

    def __init__(self, pool: BlockPool | None = None, seq: str = MAIN, block_size: int = 16, **pool_args: Any):
        self.pool = pool if pool is not None else BlockPool(block_size, **pool_args)
        #: the pool's sequence this handle was made for: once it is released
        #: the handle is spent, also when a new sequence takes the name
        self._sequence = self.pool._require("PagedKVCache", seq)
        self.seq = seq

    def _live(self, op: str) -> Sequence:
        """The handle's sequence; StateError (nothing changes) once a
        release consumed it (kvspec.spec.paged.handle_reuse): a spent handle never
        reaches a sequence that took its name later."""
        s = self.pool.seqs.get(self.seq)
        if s is not self._sequence:
            raise StateError(f"{op}: the handle of sequence {self.seq!r} was consumed by its release "
                             f"(take a new handle: PagedKVCache(pool, {self.seq!r}))")
        return s

    def __copy__(self) -> PagedKVCache:
        raise _copy_refused(False)

    def __deepcopy__(self, memo: dict) -> PagedKVCache:
        raise _copy_refused(True)

    @property
    def offset(self) -> int:
        """The sequence's offset (its length: the position the next row takes). Raises StateError on
        a spent handle. Rule: ``kvspec.spec.paged.table_len`` (semantics.md 4, "where a row lives";
        semantics.md 4, "handle reuse")."""
        return self._live("offset").length

    @property
    def live_len(self) -> int:
        """Rows a fetch returns, ``offset - start``. Raises StateError on a spent handle. Rule:
        ``kvspec.spec.paged.fetch`` (semantics.md 4, "handle reuse")."""
        return self._live("live_len").visible

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``S`` rows (keys ``[1, H, S, Dk]``, values ``[1, H, S, Dv]``, one floating dtype
        per pool) to this sequence and return its visible window ``[1, H, visible, D]``. A shared
        block is copied before the write. Raises StateError on a spent handle, InvalidArgumentError
        for mismatched rows, StateError when the pool cannot grow (nothing allocated). Rule:
        ``kvspec.spec.paged.append``, ``kvspec.spec.paged.needs_copy_on_write``, ``kvspec.spec.paged.reserve``
        (semantics.md 4, "copy on write")."""
        self._live("append")
        return self.pool.append(self.seq, keys, values)

    def fetch(self) -> tuple[mx.array, mx.array] | None:
        """The visible window ``(keys, values)`` ``[1, H, visible, D]`` without writing, or None.
        Raises StateError on a spent handle. Rule: ``kvspec.spec.paged.fetch`` (semantics.md 5,
        "rule 1")."""
        self._live("fetch")
        return self.pool.fetch(self.seq)

    def trim(self, n: int) -> int:
        """Remove ``n`` rows from the end (clamped to ``[0, visible]``) and release the blocks past
        ``ceil(length / block_size)``; returns the rows removed. Raises StateError on a spent
        handle, InvalidArgumentError for a non-integer n. Rule: ``kvspec.spec.paged.trim`` (semantics.md 4,
        "trim")."""
        self._live("trim")
        return self.pool.trim(self.seq, n)

    def trim_to(self, length: int) -> int:
        """``trim(offset - length)``; returns the rows removed. Raises InvalidArgumentError unless
        ``0 <= length <= offset``. Rule: ``kvspec.spec.paged.trim_to`` (semantics.md 4, "trim")."""
        self._live("trim_to")
        return self.pool.trim_to(self.seq, length)

    def trim_front(self, n: int) -> int:
        """Drop ``n`` rows from the front: the start moves, every block wholly before it is
        released, the offset stays; returns the rows dropped. Rule: ``kvspec.spec.paged.trim_front``
        (semantics.md 4, "front trim")."""
        self._live("trim_front")
        return self.pool.trim_front(self.seq, n)

    def trim_front_keep_sink(self, n: int, keep: int = 0) -> int:
        """``trim_front(n)``; ``keep > 0`` is refused (UnsupportedOperationError): a pool keeps no
        sinks. Rule: ``kvspec.spec.paged.trim_front`` (semantics.md 4, "front trim")."""
        self._live("trim_front")
        return self.pool.trim_front(self.seq, n, keep)

    def fork(self, name: str) -> PagedKVCache:
        """A cache on a new pool sequence sharing this one's blocks.

        Rule: ``kvspec.spec.paged.fork`` (semantics.md 4, "fork / release")."""
        self._live("fork")
        self.pool.fork(self.seq, name)
        return type(self)(self.pool, name)

    def release(self) -> None:
        """Release the sequence: its blocks go back to the pool and this
        handle (and every other of the sequence) is spent.

        Rule: ``kvspec.spec.paged.release``, ``kvspec.spec.paged.handle_reuse`` (semantics.md 4,
        "fork / release")."""
        self._live("release")
        self.pool.release(self.seq)

    def refuse_prompt_cache_file(self, layer: int) -> None:
        """Called by ``kvspec.impl.models.save_prompt_cache`` for each layer:
        refused (UnsupportedOperationError, nothing written). A sequence's
        blocks belong to its pool and may be shared with other sequences
        (forks), so a file cannot hold it alone; its rows go through a dense
        cache (docs/paged.md, "Prompt-cache files").

        Rule: ``kvspec.spec.paged.reload`` (semantics.md 4, "prompt-cache files")."""
        raise UnsupportedOperationError(
            f"save_prompt_cache: layer {layer} is a PagedKVCache, whose blocks belong to its pool and may be "
            "shared with other sequences, so a file cannot hold it alone (docs/paged.md); save its rows "
            "through a dense cache (kvspec.impl.dense.KVCache.from_state(layer.state))"
        )

    def is_trimmable(self) -> bool:
        """Always True: a sequence trims any ``n`` (clamped). Rule: ``kvspec.spec.paged.trim``
        (semantics.md 4, "trim")."""
        return True

    def size(self) -> int:
        """The offset (mlx-lm's ``size()``). Rule: ``kvspec.spec.paged.table_len`` (semantics.md 1,
        "offset")."""
        return self.offset

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> Any:
        """mlx-lm's ``kv_bits`` hook: refused. The sequence's blocks belong to
        its pool and may be shared with other sequences (docs/paged.md), and
        the pool stores the model's float rows only; quantizing one
        sequence would need its own copy of every shared block. Raises
        UnsupportedOperationError (use dense caches, ``mode="int8"``, for
        quantized storage).

        Rule: ``kvspec.spec.paged.copy_refused`` (semantics.md 4, "copies")."""
        raise UnsupportedOperationError(
            f"to_quantized(bits={bits!r}): a PagedKVCache's blocks belong to its pool (shared with other sequences) "
            "and the pool stores unquantized rows; for quantized storage use dense caches "
            "(kvspec.impl.models.make_prompt_cache(model, mode='int8'))"
        )

    def empty(self) -> bool:
        """True when the sequence shows no rows. Rule: ``kvspec.spec.paged.fetch`` (semantics.md 4)."""
        return self.live_len == 0

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this sequence holds. StateError on a spent
        handle (kvspec.spec.paged.handle_reuse), also before the pool has slabs."""
        s = self._live("nbytes")
        if self.pool.keys is None:
            return 0
        per_block = (self.pool.keys.nbytes + self.pool.values.nbytes) // max(1, self.pool.size)
        return per_block * len(s.held())

    @property
    def state(self) -> tuple[mx.array, ...]:
        """The visible rows ``(keys, values)``, gathered (never the slabs);
        refused to mlx-lm's ``save_prompt_cache`` (kvspec.impl.dense.refuse_foreign_save)
        and on a spent handle (StateError, kvspec.spec.paged.handle_reuse)."""
        refuse_foreign_save(self)
        self._live("state")
        window = self.pool.fetch(self.seq)
        return () if window is None else window

    @state.setter
    def state(self, v: tuple[mx.array, ...]) -> None:
        """Replace this sequence's rows by ``(keys, values)`` ``[1, H, T,
        D]`` (length T, start 0); refused (nothing changed) when malformed.
        The sequence stays the same object (its handles stay live)."""
        old = self._live("state")
        if not isinstance(v, (tuple, list)) or len(v) not in (0, 2):
            raise InvalidArgumentError(f"state: state must be (keys, values) or (), got {type(v).__name__}")
        if v:
            _check_rows("state", v[0], v[1])
            self.pool._check_compatible(v[0], v[1])
        name = f"{self.seq}\x00state"
        self.pool.create(name)
        try:
            if v:
                self.pool.append(name, v[0], v[1])
        except Exception:
            self.pool.release(name)
            raise
        new = self.pool.seqs.pop(name)
        for block in old.held():
            self.pool._release_block(block)
        old.table, old.length, old.start, old.mirror = new.table, new.length, new.start, new.mirror

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(block_size, offset, start)`` as strings; assigning it (after ``state``, mlx-lm's load
        order) reloads the sequence from position 0. Raises StateError on a spent handle. Rule:
        ``kvspec.spec.paged.load_state`` (semantics.md 4, "prompt-cache files")."""
        s = self._live("meta_state")
        return (str(self.pool.block_size), str(s.length), str(s.start))

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        """Accepted, changing nothing, when ``v`` describes what the sequence
        holds (the pool's block size, its offset and start: mlx-lm's load
        order, ``state`` then ``meta_state``, on a sequence that starts at
        position 0); any other counters are refused
        (UnsupportedOperationError, nothing changes): a paged sequence's
        counters are set by its pool. A sequence is never saved to a
        prompt-cache file (:meth:`refuse_prompt_cache_file`; docs/paged.md)."""
        got = tuple(v) if isinstance(v, (tuple, list)) else None
        if got != self.meta_state:
            raise UnsupportedOperationError(
                f"meta_state: a paged sequence's counters are set by its pool, not assigned (got {v!r}, the "
                f"sequence holds {self.meta_state!r})")

    @classmethod
    def from_state(cls, state: tuple[mx.array, ...], meta_state: tuple[str, ...] | None = None) -> PagedKVCache:
        """A cache on a fresh pool holding ``state``'s rows at positions
        ``[0, rows)``; ``meta_state`` (block_size, offset, start) gives the
        block size (default 16). Raises InvalidArgumentError for a
        malformed meta_state or one whose offset and start do not describe
        exactly these rows from position 0 (a front-trimmed sequence is not
        rebuilt: its rows would take other RoPE positions).

        Rule: ``kvspec.spec.paged.load_state`` (semantics.md 4, "prompt-cache files")."""
        block_size, rows = 16, 0
        if state:
            rows = int(state[0].shape[2]) if isinstance(state[0], mx.array) and state[0].ndim == 4 else -1
        if meta_state is not None:
            try:
                block_size, offset, start = (int(x) for x in meta_state)
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    f"from_state: meta_state must be (block_size, offset, start) integers, got {meta_state!r}"
                ) from None
            if start != 0 or offset != rows:
                raise InvalidArgumentError(
                    f"from_state: meta_state must describe the rows from position 0 (start 0, offset {rows}), "
                    f"got offset={offset}, start={start}"
                )
        cache = cls(block_size=block_size)
        cache.state = state
        return cache

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        """Attention mask for ``N`` new queries over ``visible + N`` keys,
        as :meth:`kvspec.impl.dense.KVCache.make_mask`. StateError on a spent
        handle (kvspec.spec.paged.handle_reuse), whatever ``N``."""
        self._live("make_mask")
        N = _check_int("make_mask", "N", N)
        if N < 1:
            raise InvalidArgumentError(f"make_mask: N must be >= 1, got {N}")
        if window_size is None and not return_array:
            return None if N == 1 else "causal"
        return causal_mask(self.live_len, N, window_size)  # kvspec.impl.masks


def _copy_refused(deep: bool) -> UnsupportedOperationError:
    """``copy.copy`` / ``copy.deepcopy`` of a PagedKVCache (kvspec.spec.paged.copy_refused)."""
    how = "copy.deepcopy" if deep else "copy.copy"
    return UnsupportedOperationError(
        f"copy: {how} of a PagedKVCache is refused: its blocks belong to its pool and may be shared with other "
        "sequences (a shallow copy would write the same sequence, a deep copy would copy the whole pool and alias "
        "its memory); fork(name) is the paged copy (O(table), copy-on-write)")


def make_paged_prompt_cache(num_layers: int, block_size: int = 16, **pool_args: Any) -> list[PagedKVCache]:
    """One pool per layer, each with its ``"main"`` sequence: the prompt
    cache of a model whose layers are all full attention."""
    num_layers = _check_int("make_paged_prompt_cache", "num_layers", num_layers)
    return [PagedKVCache(BlockPool(block_size, **pool_args)) for _ in range(num_layers)]


def fork_prompt_cache(caches: Iterable[PagedKVCache], name: str) -> list[PagedKVCache]:
    """Fork every layer's sequence as ``name`` (all layers or none: a layer
    that refuses undoes the forks already made)."""
    caches = list(caches)
    done: list[PagedKVCache] = []
    try:
        for c in caches:
            done.append(c.fork(name))
    except Exception:
        for f in done:
            f.release()
        raise
    return done
