"""Injected bugs of the paged cache (see fuzz/bugs/__init__.py): each a
``BlockPool`` subclass that replaces exactly one method."""

from __future__ import annotations

import copy

import mlx.core as mx

from kvspec.fuzz.bugs import InjectedBug
from kvspec.impl.dense import _check_rows
from kvspec.impl.paged import BlockPool, BlockTable, PagedKVCache, Sequence, table_len
from kvspec.spec.errors import InvalidArgumentError, StateError


class NoCopyOnWrite(BlockPool):
    """A write into a block another sequence holds goes straight into it
    (a prefix cache handing a shared block to a writer): the other
    sequence's rows change under it."""

    @staticmethod
    def _needs_copy_on_write(refcount: int) -> bool:
        return False


class TableFromVisibleLen(BlockPool):
    """The block table is sized from the visible length (``length -
    start``) instead of the absolute length: after a front trim, a trim cuts
    the table short and releases blocks whose rows are still visible; the
    next write reuses them."""

    def _table_entries(self, s: Sequence, length: int) -> int:
        return table_len(max(0, length - s.start), self.block_size)


class TrimKeepsTail(BlockPool):
    """Trim cuts the table but never releases the tail blocks: a leak (their
    refcounts stay raised with no table holding them)."""

    def _truncate(self, s: Sequence, length: int) -> None:
        keep = self._table_entries(s, length)
        del s.table[keep:]
        s.length = length


class ReleaseFreesShared(BlockPool):
    """Releasing a sequence frees each of its blocks whatever the refcount:
    blocks other sequences still hold go back on the free list and the next
    allocation hands them to a new writer."""

    def release(self, seq: str) -> None:
        s = self._require("release", seq)
        for block in s.held():
            self.refcounts[block] = 0
            if block not in self.free:
                self.free.append(block)
        self.free.sort()
        del self.seqs[seq]


class CowKeepsOldRefcount(BlockPool):
    """Copy-on-write copies the shared block and repoints the writer's
    table, but leaves the old block's refcount raised: once its other
    holders are gone it can never be freed (a leak)."""

    def _copy_on_write(self, s: Sequence, b: int) -> int:
        old, new = s.table[b], self._allocate()
        self._copy_block(old, new)
        s.table[b] = new
        return new


class ExhaustionHalfAllocates(BlockPool):
    """Pool exhaustion is noticed only after the pool grew as far as it
    could and the writer's table took the free blocks there were: the
    refused append leaves blocks allocated to a sequence that did not grow."""

    def _reserve(self, s: Sequence, needed: int, keys: mx.array, values: mx.array) -> None:
        message = (f"append: pool exhausted: needs {needed} free blocks, has {len(self.free)} free of "
                   f"{self.size} and max_blocks={self.max_blocks}")
        extra = self._growth(needed)
        if extra:
            self._grow(extra, keys, values)
        if len(self.free) < needed:
            while self.free:
                s.table.append(self._allocate())
            raise StateError(message)


# -- a sequence's handle outside the decode loop: each caught only by
# -- the op named (copy, append_mismatch, handle_reuse, reload)


class CopyAliasesSequence(PagedKVCache):
    """``copy.copy`` and ``copy.deepcopy`` of a sequence's handle left to
    Python's defaults: a shallow copy is a second handle on the same
    sequence (a write through the copy is a write through the original), a
    deep copy copies the whole pool with slabs that alias the original's
    memory (its in-place writes land there)."""

    def __copy__(self) -> PagedKVCache:
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo: dict) -> PagedKVCache:
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(dict(self.__dict__), memo))
        return new


class PoolDtypeUnchecked(BlockPool):
    """The pool's shape check compares kv heads and head dims with the
    slabs' but not the dtype: rows of another dtype are cast into the
    slabs silently instead of refused."""

    def _check_compatible(self, keys: mx.array, values: mx.array) -> None:
        if keys.shape[0] != 1:
            raise InvalidArgumentError(f"append: batch must be 1 per pool sequence, got keys of shape {tuple(keys.shape)}")
        if self.keys is None:
            return
        for name, a, slab in (("keys", keys, self.keys), ("values", values, self.values)):
            if a.shape[1] != slab.shape[2] or a.shape[3] != slab.shape[3]:
                raise InvalidArgumentError(f"append: {name} must match the pool's [H, D]")


class SpentHandleByName(PagedKVCache):
    """A handle that finds its sequence by name only: once its sequence is
    released the handle goes on working as soon as a new sequence (a fork)
    takes the name, and writes into that sequence's blocks."""

    def _live(self, op: str) -> Sequence:
        return self.pool._require(op, self.seq)


class FileSavesSequence(PagedKVCache):
    """The file layer's refusal of a paged sequence dropped: the sequence
    is written as its gathered rows and loads back as a fresh pool of its
    own, without the blocks it shared with its forks, its start or its
    block table."""

    def refuse_prompt_cache_file(self, layer: int) -> None:
        return None


def _load_releasing_first(self: PagedKVCache, v: tuple[mx.array, ...]) -> None:
    s = self._live("state")
    rows = [mx.array(a) for a in v]  # read before the blocks go back to the pool
    mx.eval(*rows)
    for block in s.held():
        self.pool._release_block(block)
    s.table, s.length, s.start = BlockTable([]), 0, 0
    if rows:
        self.pool.append(self.seq, rows[0], rows[1])


class StateLoadReleasesFirst(PagedKVCache):
    """``cache.state = rows`` gives the sequence's blocks back to the pool
    before it writes the rows, which then land in the blocks just freed
    instead of fresh ones (and a refusal on the way, an exhausted pool,
    would leave the sequence empty): the block tables, free list and the
    write path differ from the rule's."""

    state = property(PagedKVCache.state.fget, _load_releasing_first)  # type: ignore[assignment]


def _assign_releasing_first_to_grow(self: PagedKVCache, v: tuple[mx.array, ...]) -> None:
    old = self._live("state")
    if v:
        _check_rows("state", v[0], v[1])
        self.pool._check_compatible(v[0], v[1])
    rows = int(v[0].shape[2]) if v else 0
    name = f"{self.seq}\x00state"
    grows = table_len(rows, self.pool.block_size) > len(old.held())
    if grows:  # "make room": the old blocks go back first
        for block in old.held():
            self.pool._release_block(block)
    self.pool.create(name)
    try:
        if v:
            self.pool.append(name, v[0], v[1])
    except Exception:
        self.pool.release(name)
        raise
    new = self.pool.seqs.pop(name)
    if not grows:
        for block in old.held():
            self.pool._release_block(block)
    old.table, old.length, old.start, old.mirror = new.table, new.length, new.start, new.mirror


class StateAssignReleasesFirstToGrow(PagedKVCache):
    """``cache.state = rows`` with more rows than the sequence's blocks
    hold gives the old blocks back to the pool first, to make room: the
    rows land in the blocks just freed (other block ids than the rule's),
    and when the pool is exhausted anyway the refusal leaves the sequence
    pointing at blocks it released (a partial change before a refusal). A
    load of the sequence's own rows never grows, so only an assignment of
    other rows reaches it."""

    state = property(PagedKVCache.state.fget, _assign_releasing_first_to_grow)  # type: ignore[assignment]


class SinkTrimSkipsSpentCheck(PagedKVCache):
    """``trim_front_keep_sink`` without the spent-handle check the other
    operations keep: a released sequence's handle front-trims whatever
    sequence took its name since (or the pool refuses an unknown name in
    its own words), instead of refusing as spent."""

    def trim_front_keep_sink(self, n: int, keep: int = 0) -> int:
        return self.pool.trim_front(self.seq, n, keep)


class MaskChecksCountBeforeSpent(PagedKVCache):
    """``make_mask`` that checks ``N`` before the spent-handle check: a
    released sequence's handle asked for ``make_mask(0)`` is refused as a bad
    count (InvalidArgumentError), not as spent (StateError)."""

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):  # type: ignore[no-untyped-def]
        if isinstance(N, int) and N < 1:
            raise InvalidArgumentError(f"make_mask: N must be >= 1, got {N}")
        return super().make_mask(N, window_size, return_array)


BUGS: tuple[InjectedBug, ...] = (
    InjectedBug(
        "paged_no_cow", "semantics.md 4, copy on write (kvspec.spec.paged.needs_copy_on_write)",
        "public fault: prefix caches in paged engines handing a shared block to a writer", "paged", ("fp16",),
        "BlockPool._needs_copy_on_write",
        "a write into a block of refcount > 1 goes straight into it; the forked sequence sees the write",
        {"paged": NoCopyOnWrite},
        variants=(("isolation only", {}, False),),
    ),
    InjectedBug(
        "paged_table_from_visible_len", "semantics.md 4, where a row lives (tables indexed by absolute position; kvspec.spec.paged.table_len)",
        "public fault: block tables sized from the visible length (slid-off rows come back)", "paged", ("fp16",),
        "BlockPool._table_entries",
        "after a front trim, trims size the table from length - start and drop blocks still visible",
        {"paged": TableFromVisibleLen},
    ),
    InjectedBug(
        "paged_trim_keeps_tail", "semantics.md 4, trim (releases blocks past ceil(len / block_size))",
        "public fault: freed blocks leaked by rollback", "paged", ("fp16",), "BlockPool._truncate",
        "trim cuts the table without releasing the tail blocks (refcount invariant)", {"paged": TrimKeepsTail},
    ),
    InjectedBug(
        "paged_release_frees_shared", "semantics.md 4, fork / release (release lowers each refcount by one; kvspec.spec.paged.release_block)",
        "public fault: freed blocks still referenced", "paged", ("fp16",), "BlockPool.release",
        "release frees blocks other sequences still hold", {"paged": ReleaseFreesShared},
    ),
    InjectedBug(
        "paged_cow_keeps_old_refcount", "semantics.md 4, copy on write (releases the shared block)",
        "public fault: copy-on-write refcount leak", "paged", ("fp16",), "BlockPool._copy_on_write",
        "copy-on-write copies the block but leaves the old block's refcount raised", {"paged": CowKeepsOldRefcount},
    ),
    InjectedBug(
        "paged_exhaustion_half_allocates", "semantics.md 5.5 atomicity (kvspec.spec.paged.reserve: refuse before allocating)",
        "public fault: allocation failures leaving partial block tables", "paged", ("fp16",), "BlockPool._reserve",
        "a refused append leaves the pool grown and free blocks taken by the writer's table",
        {"paged": ExhaustionHalfAllocates},
    ),
    InjectedBug(
        "paged_copy_aliases_sequence", "kvspec.spec.paged.copy_refused (fork is the paged copy)",
        "mlx-lm LRUPromptCache deep-copies a cached prompt on every fetch", "paged", ("fp16",),
        "PagedKVCache.__copy__/__deepcopy__", "copies of a sequence's handle alias the sequence or the pool's memory",
        {"paged": CopyAliasesSequence},
    ),
    InjectedBug(
        "paged_dtype_unchecked", "kvspec.spec.paged.append_mismatch (rows match the pool's [H, D] and dtype)",
        "a request in another dtype joining a shared pool", "paged", ("fp16",),
        "BlockPool._check_compatible", "rows of another dtype are cast into the slabs, not refused",
        {"paged": PoolDtypeUnchecked},
    ),
    InjectedBug(
        "paged_spent_handle_by_name", "kvspec.spec.paged.handle_reuse (a released sequence's handle is spent)",
        "schedulers that keep a finished request's cache object", "paged", ("fp16",),
        "PagedKVCache._live", "a released sequence's handle finds its sequence by name: refused as an unknown name, and "
        "once a fork takes the name it writes into that sequence",
        {"paged": SpentHandleByName},
    ),
    InjectedBug(
        "paged_sink_trim_spent_handle", "kvspec.spec.paged.handle_reuse (every method of a released sequence's handle refuses)",
        "a handle method that forgets the spent-handle check the others keep (breaker sweep)", "paged",
        ("fp16",), "PagedKVCache.trim_front_keep_sink", "trim_front_keep_sink on a spent handle reaches the pool "
        "by name: it front-trims the sequence that took the name since, or is refused in the pool's words",
        {"paged": SinkTrimSkipsSpentCheck},
    ),
    InjectedBug(
        "paged_mask_spent_after_count", "kvspec.spec.paged.handle_reuse (a spent handle refuses whatever the arguments)",
        "a spent-handle check placed after the argument checks (breaker sweep)", "paged",
        ("fp16",), "PagedKVCache.make_mask", "make_mask(0) on a spent handle is refused as a bad count "
        "(InvalidArgumentError), not as spent (StateError)",
        {"paged": MaskChecksCountBeforeSpent},
    ),
    InjectedBug(
        "paged_file_saves_sequence", "kvspec.spec.paged.reload (a file cannot hold a paged sequence)",
        "prompt-cache files of pool-backed caches", "paged", ("fp16",),
        "PagedKVCache.refuse_prompt_cache_file", "a sequence is saved as its gathered rows and loads as a pool of its own",
        {"paged": FileSavesSequence},
    ),
    InjectedBug(
        "paged_state_load_releases_first", "kvspec.spec.paged.load_state (fresh blocks first, the old ones released after)",
        "mlx-lm's load order (state, then meta_state) on a pool sequence", "paged", ("fp16",),
        "PagedKVCache.state (setter)", "the setter frees the sequence's blocks before writing the rows into them",
        {"paged": StateLoadReleasesFirst},
    ),
    InjectedBug(
        "paged_state_assign_releases_first",
        "kvspec.spec.paged.state_assign (fresh blocks first, the old ones released after; a refusal changes nothing)",
        "a state setter that frees the old blocks before a refusal can come (breaker sweep)", "paged",
        ("fp16",), "PagedKVCache.state (setter)", "an assignment of more rows than the sequence's blocks hold "
        "releases the old blocks first: other blocks than the rule's, and a refused (pool-exhausted) assignment "
        "leaves the sequence on freed blocks",
        {"paged": StateAssignReleasesFirstToGrow},
    ),
)
