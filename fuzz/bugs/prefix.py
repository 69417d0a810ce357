"""Injected bugs of the prefix cache (``kvspec.impl.prefix.PrefixCachePool``).

See ``fuzz/bugs/__init__.py`` for the catalog and the entry type. Each bug
is a subclass of ``PrefixCachePool`` that replaces one method (or the one
helper that method calls) with a broken version; ``kvspec mutants`` and
``kvspec verify`` must catch each one, and ``tests/traces/<name>.json``
holds a minimal trace that passes on ``PrefixCachePool`` and diverges on
the bug.

Most stand for a fault a public report names (vLLM, text-generation-
inference, FastDeploy, MinivLLM, llama.cpp; docs/semantics.md section 11
lists them); the report's trace, ``tests/traces/prefix_report_*.json``,
replays the report's own sequence, and the catalog trace is the campaign's
shrunk counterexample. A bug that keeps state of its own copies it in
``copy`` (a copy of the pool is independent).
"""

from __future__ import annotations

from typing import Any

from kvspec.fuzz.bugs import InjectedBug
from kvspec.impl.prefix import AdmitResult, PrefixCachePool, _Request, blocks_for, max_hit_blocks

# -- allocation and eviction (_take: pop the free queue's front, evict a keyed block) --------


class StaleKeyKeptOnEviction(PrefixCachePool):
    """vLLM PR #4761 (block manager v2: a block taken out of the evictor
    for reuse stayed in the allocator's cached-block table): a cached-free
    block popped for new content loses its key field, but its id stays
    listed under the key, so a later lookup of the old prefix hits a block
    that now holds another request's rows."""

    def _take(self) -> int:
        b = self._q_popleft()
        self._key[b] = None  # self._cached[key].remove(b) forgotten
        self._ref[b] = 1
        return b


class RecycledBlockKeepsKey(PrefixCachePool):
    """MinivLLM PR #87, item 3 (as nano-vllm #163: ``_allocate_block``
    resets a block but never deletes its old hash mapping): a block popped
    from the free queue is reused with no eviction step at all; it keeps its
    key field and its entry under the old key, and when it is keyed again
    the old entry stays beside the new one."""

    def _take(self) -> int:
        b = self._q_popleft()
        self._ref[b] = 1  # the eviction of its key skipped
        return b


class EvictionMissesDuplicate(PrefixCachePool):
    """vLLM PR #44237 (``_maybe_evict_cached_block`` reset the hash only
    when the map's ``pop`` returned the block; in the single-block branch it
    returns None for another block under the key): when the popped block is
    a later duplicate of its key (not the first listed), neither its entry
    nor its key field is removed."""

    def _take(self) -> int:
        b = self._next[self.n_blocks]
        key = self._key[b]
        if key is not None and self._cached[key][0] != b:  # "pop found another block": nothing evicted
            self._q_remove(b)
            self._ref[b] = 1
            return b
        return super()._take()


class DirtyBlockKeepsKey(PrefixCachePool):
    """vLLM PR #24084 (``cache_full_blocks`` met blocks that still carried a
    hash: a dirty block): a block popped for reuse leaves the cached map but
    keeps its key field; it cannot be hit, but it is treated as keyed (a
    partial tail holding it is released to the back of the free queue)."""

    def _take(self) -> int:
        b = self._q_popleft()
        key = self._key[b]
        if key is not None:
            ids = self._cached[key]
            ids.remove(b)
            if not ids:
                del self._cached[key]  # ... and self._key[b] = None forgotten
        self._ref[b] = 1
        return b


# -- hits (_hits: the first block of each cached key of the longest run) ------------------------


class WholePromptHitNotCapped(PrefixCachePool):
    """The hit is not capped one token short of the prompt (vLLM's
    ``max_cache_hit_length = num_tokens - 1`` read as ``num_tokens``): a
    prompt of whole blocks that is wholly cached hits every block, one
    block too many, and its last token is never computed (no logits)."""

    def _hits(self, tokens: tuple[int, ...], salt: Any) -> list[int]:
        bs, out = self.block_size, []
        for i in range(len(tokens) // bs):  # max_hit_blocks(len(tokens), bs) is (len - 1) // bs
            ids = self._cached.get((salt, tokens[:(i + 1) * bs]))
            if not ids:
                break
            out.append(ids[0])
        return out


class RestoredSlotUnbeatable(PrefixCachePool):
    """llama.cpp #28276 (a restored slot whose whole content is a prefix of
    the new prompt wins without the cache search, so a longer cached state
    is never found), as prefix caching: the hit stops at the full blocks of
    a live request whose tokens are a prefix of the prompt, though longer
    keys of the prompt are cached."""

    def _hits(self, tokens: tuple[int, ...], salt: Any) -> list[int]:
        out = super()._hits(tokens, salt)
        for r in self._reqs.values():
            if r.live and r.salt == salt and len(r.tokens) <= len(tokens) and tuple(r.tokens) == tokens[:len(r.tokens)]:
                return out[:len(r.tokens) // self.block_size]  # the slot that holds the prompt wins
        return out


# -- admission (_admit: touch the hits, count room, take the new blocks) -----------------------


class HitSetsRefcountToOne(PrefixCachePool):
    """The touch of a hit block sets its refcount to 1 (taking a cached-free
    block out of the free queue) instead of adding one (vLLM's
    ``BlockPool.touch``: ``ref_cnt += 1``): a block two live requests share
    counts one holder, and freeing either puts it in the free queue while
    the other still reads it."""

    def _admit(self, op: str, tokens: tuple[int, ...], salt: Any) -> tuple[AdmitResult, _Request | None]:
        hits = self._hits(tokens, salt)
        need = blocks_for(len(tokens), self.block_size) - len(hits)
        available = self._n_free - sum(1 for b in hits if self._ref[b] == 0)
        if need > available:
            return AdmitResult(False, 0, ()), None
        for b in hits:
            if self._ref[b] == 0:
                self._q_remove(b)
            self._ref[b] = 1  # += 1
        table = hits + [self._take() for _ in range(need)]
        hit = len(hits) * self.block_size
        return AdmitResult(True, hit, tuple(table)), _Request(list(tokens), salt, table, True, hit)


class TouchKeepsInQueue(PrefixCachePool):
    """A hit on a cached-free block raises its refcount but leaves it in
    the free queue (the evictor-side half of vLLM PR #4761's fault: a block
    handed out as a hit is still evictable): the next allocation can pop
    and evict a block a live table holds."""

    def _admit(self, op: str, tokens: tuple[int, ...], salt: Any) -> tuple[AdmitResult, _Request | None]:
        hits = self._hits(tokens, salt)
        need = blocks_for(len(tokens), self.block_size) - len(hits)
        available = self._n_free - sum(1 for b in hits if self._ref[b] == 0)
        if need > available:
            return AdmitResult(False, 0, ()), None
        for b in hits:
            self._ref[b] += 1  # the self._q_remove(b) of a cached-free block forgotten
        table = hits + [self._take() for _ in range(need)]
        hit = len(hits) * self.block_size
        return AdmitResult(True, hit, tuple(table)), _Request(list(tokens), salt, table, True, hit)


class RefusedAdmitNotRolledBack(PrefixCachePool):
    """text-generation-inference PR #2489's class (an allocation undone
    before its rows were written leaves the pool changed): admit touches
    its hits and takes new blocks one by one, finding the pool short only
    when the free queue runs dry; the undo hands the blocks back (taken ones
    to the front, hits untouched to the back) but not what taking them did:
    the cached-free blocks it popped stay evicted, and its cached-free hits
    lose their place in the queue. vLLM's ``allocate_slots`` counts room
    before it changes anything."""

    def _admit(self, op: str, tokens: tuple[int, ...], salt: Any) -> tuple[AdmitResult, _Request | None]:
        hits = self._hits(tokens, salt)
        need = blocks_for(len(tokens), self.block_size) - len(hits)
        for b in hits:
            if self._ref[b] == 0:
                self._q_remove(b)
            self._ref[b] += 1
        taken: list[int] = []
        while len(taken) < need and self._n_free:
            taken.append(self._take())
        if len(taken) < need:  # short: give the blocks back
            for b in reversed(taken):
                self._ref[b] = 0
                self._q_insert_after(self.n_blocks, b)
            for b in hits:
                self._ref[b] -= 1
                if self._ref[b] == 0:
                    self._q_insert_after(self._prev[self.n_blocks + 1], b)
            return AdmitResult(False, 0, ()), None
        table = hits + taken
        hit = len(hits) * self.block_size
        return AdmitResult(True, hit, tuple(table)), _Request(list(tokens), salt, table, True, hit)


class SaltDropped(PrefixCachePool):
    """vLLM #56655 (mixed prompt-embedding masks left out of the block
    hash; fixed by PR #56656): the request's extra key never reaches its
    keys: its blocks are keyed and its hits looked up without it, so
    requests that differ only in the salt share blocks."""

    def _admit(self, op: str, tokens: tuple[int, ...], salt: Any) -> tuple[AdmitResult, _Request | None]:
        return super()._admit(op, tokens, None)


class StaleHitAfterRefusedAdmit(PrefixCachePool):
    """vLLM PR #18957 (``ComputedBlocksTracker``: the cached-token count of
    a sequence that could not be scheduled was kept, and read on the next
    attempt): the hit found when an admission is refused for room is
    remembered per request; the admission of that request that succeeds
    later reports the remembered hit and leaves the positions below it
    unwritten, though the cache changed in between and its blocks are
    fresh. The memo is copied with the pool."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._tracked: dict[str, int] = {}

    def admit(self, req: str, tokens: Any, salt: Any = None) -> AdmitResult:
        res = super().admit(req, tokens, salt)
        if not res.admitted:
            self._tracked.setdefault(req, self.lookup(tokens, salt))  # never dropped on the refusal
            return res
        stale = self._tracked.pop(req, None)
        if stale is not None:
            stale = min(stale, max_hit_blocks(len(tokens), self.block_size) * self.block_size)
            if stale > res.hit_tokens:
                self._reqs[req].written = stale  # positions below it taken as computed
                res = AdmitResult(True, stale, res.table)
        return res

    def copy(self) -> StaleHitAfterRefusedAdmit:
        new = super().copy()
        new._tracked = dict(self._tracked)
        return new


# -- keying (write: store the rows, then key every block they filled) ---------------------------


class DuplicateKeyReplaces(PrefixCachePool):
    """FastDeploy PR #6226 (two requests producing the same output block:
    the prefix tree kept only one of the two block ids under its hash): a
    block keyed with a key another block already has replaces that block's
    entry instead of following it; the first block stays keyed but
    unlisted, hits go to the second."""

    def write(self, req: str, keys: Any, values: Any) -> None:
        r = self._reqs.get(req)
        w = r.written if r is not None else 0
        super().write(req, keys, values)
        for i in range(w // self.block_size, len(r.tokens) // self.block_size):
            b = r.table[i]
            self._cached[self._key[b]] = [b]  # .append(b)


class PartialTailKeyed(PrefixCachePool):
    """write keys every block its rows went to, ``ceil(n / B)`` blocks for
    ``n // B``: the partial tail gets a key naming the tokens it holds so
    far and is listed in the cached map (vLLM's ``cache_full_blocks`` takes
    ``num_tokens // block_size``); as a keyed block it is released to the
    back of the free queue, and its entry outlives the decode that fills
    it."""

    def write(self, req: str, keys: Any, values: Any) -> None:
        super().write(req, keys, values)
        r = self._reqs[req]
        if len(r.tokens) % self.block_size:
            b = r.table[-1]
            key = (r.salt, tuple(r.tokens))  # tokens[:(i + 1) * B] of the last, partial block
            self._key[b] = key
            self._cached.setdefault(key, []).append(b)


class SaltOnlyInFirstBlock(PrefixCachePool):
    """vLLM PR #12603 (extra keys must enter every block's hash, through
    its parent), with a per-request salt: only block 0 is keyed with the
    request's salt, later blocks by their tokens alone; an unsalted request
    whose first block is cached on its own hits a salted request's later
    blocks."""

    def write(self, req: str, keys: Any, values: Any) -> None:
        r = self._reqs.get(req)
        w = r.written if r is not None else 0
        super().write(req, keys, values)
        if r.salt is None:
            return
        bs = self.block_size
        for i in range(max(1, w // bs), len(r.tokens) // bs):
            b = r.table[i]
            key = self._key[b]
            ids = self._cached[key]
            ids.remove(b)
            if not ids:
                del self._cached[key]
            unsalted = (None, key[1])
            self._key[b] = unsalted
            self._cached.setdefault(unsalted, []).append(b)


# -- release (_release: tail first; keyed blocks to the back, unkeyed to the front) -----------


class FreeHeadFirst(PrefixCachePool):
    """vLLM #48489 / PR #48532 (a deferred free path reversed the blocks of
    all groups at once, losing the per-group tail-first order), in one
    group: a request's blocks are released head first, so the root of its
    prefix is the first of its blocks evicted and the rest of the chain
    becomes unreachable while still cached."""

    def _release(self, r: _Request) -> None:
        front = self.n_blocks
        for b in r.table:  # reversed(r.table)
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._key[b] is not None:
                    self._q_insert_after(self._prev[self.n_blocks + 1], b)
                else:
                    self._q_insert_after(front, b)
                    front = b
        r.table = []


class KeyedBlockFreedToFront(PrefixCachePool):
    """A keyed block reaching refcount 0 is put at the front of the free
    queue, the end reused first, instead of the back (vLLM's
    ``BlockPool.free_blocks`` appends hashed blocks and prepends only the
    unhashed ones): a prefix just released is the first thing evicted."""

    def _release(self, r: _Request) -> None:
        front = self.n_blocks
        for b in reversed(r.table):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._key[b] is not None:
                    self._q_insert_after(self.n_blocks, b)  # self._prev[TAIL]: the back
                else:
                    self._q_insert_after(front, b)
                    front = b
        r.table = []


class FreeBlocksDoubleFree(PrefixCachePool):
    """vLLM #42571 (PR #42612 deduplicates ``BlockPool.free_blocks``): the
    pool's own release takes the list as given, as vLLM's does: a block
    listed twice is decremented twice, a free block goes below 0, and a
    held block joins the free queue while live tables still hold it."""

    def free_blocks(self, blocks: Any) -> None:
        ids = [self._block("free_blocks", b) for b in blocks]
        for b in ids:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._key[b] is not None:
                    self._q_insert_after(self._prev[self.n_blocks + 1], b)
                else:
                    self._q_insert_after(self.n_blocks, b)


# -- sliding window (window = w: blocks before the window released, the windowed hit) ----------


class WindowReleaseOneTokenEarly(PrefixCachePool):
    """The window's first position taken one token late (``n - w + 2``
    tokens skipped instead of vLLM's ``get_num_skipped_tokens = n - w +
    1``): a decode releases the block that holds the first position the new
    token attends, so its attention reads a released (and, once reused,
    overwritten) row."""

    def _skipped(self, n_tokens: int) -> int:
        return max(0, n_tokens - self.window + 2) // self.block_size  # type: ignore[operator]


class WindowReleaseDropsKey(PrefixCachePool):
    """A block released because it left the window is taken for garbage:
    its key is dropped (its id leaves the cached map) and it goes to the
    front of the free queue, as an unkeyed block would. vLLM keeps it
    cached: ``remove_skipped_blocks`` frees it through
    ``BlockPool.free_blocks``, which appends a hashed block to the back, so
    a later request with the same prefix still hits it."""

    def _release_blocks(self, order: list[int]) -> None:
        import inspect

        if inspect.stack()[1].function == "decode":  # the window's release, not free/preempt
            for b in order:
                key = self._key[b]
                if key is not None and self._ref[b] == 1:
                    ids = self._cached[key]
                    ids.remove(b)
                    if not ids:
                        del self._cached[key]
                    self._key[b] = None
        super()._release_blocks(order)


def _entry(name: str, clause: str, source: str, replaces: str, description: str, cls: type) -> InjectedBug:
    return InjectedBug(name, clause, source, "prefix", ("fp16",), replaces, description, {"prefix": cls})


BUGS: tuple[InjectedBug, ...] = (
    _entry("prefix_stale_key_kept_on_eviction", "semantics.md 11, eviction (its id leaves the key's entry)",
           "vLLM PR #4761: a block popped from the evictor left in the cached-block table", "PrefixCachePool._take",
           "an evicted block's key is cleared but its id stays listed under the key", StaleKeyKeptOnEviction),
    _entry("prefix_recycled_block_keeps_key", "semantics.md 11, eviction (its key is cleared)",
           "MinivLLM PR #87 (nano-vllm #163): a recycled block's old hash left mapped", "PrefixCachePool._take",
           "a block popped for reuse keeps its key and its entry (no eviction step)", RecycledBlockKeepsKey),
    _entry("prefix_eviction_misses_duplicate", "semantics.md 11, duplicate keys (evicting it promotes the next)",
           "vLLM PR #44237: a reused block's stale hash left in the map's collision branch", "PrefixCachePool._take",
           "a popped block that is a later duplicate of its key is not evicted", EvictionMissesDuplicate),
    _entry("prefix_dirty_block_keeps_key", "semantics.md 11, eviction (its key is cleared)",
           "vLLM PR #24084: blocks cached again with a hash already set (dirty blocks)", "PrefixCachePool._take",
           "a block popped for reuse leaves the map but keeps its key field", DirtyBlockKeepsKey),
    _entry("prefix_whole_prompt_hit_not_capped", "semantics.md 11, hit length (the last token is always recomputed)",
           "vLLM's max_cache_hit_length = num_tokens - 1 taken as num_tokens", "PrefixCachePool._hits",
           "a wholly cached prompt of whole blocks hits every block, one block too many", WholePromptHitNotCapped),
    _entry("prefix_restored_slot_unbeatable", "semantics.md 11, hit length (the largest j)",
           "llama.cpp #28276: a restored slot hides a longer cached state from the prompt-cache lookup",
           "PrefixCachePool._hits", "the hit stops at a live request whose tokens are a prefix of the prompt",
           RestoredSlotUnbeatable),
    _entry("prefix_hit_sets_refcount_to_one", "semantics.md 11, touch (refcount rises by one)",
           "vLLM's BlockPool.touch (ref_cnt += 1) written as an assignment", "PrefixCachePool._admit",
           "a hit block's refcount is set to 1: a block two requests share counts one holder", HitSetsRefcountToOne),
    _entry("prefix_touch_keeps_in_free_queue", "semantics.md 11, touch (a cached-free one leaves the free queue)",
           "vLLM PR #4761's evictor side: a block handed out as a hit still evictable", "PrefixCachePool._admit",
           "a hit on a cached-free block leaves it in the free queue", TouchKeepsInQueue),
    _entry("prefix_refused_admit_not_rolled_back", "semantics.md 11, room (otherwise not admitted, nothing changed)",
           "text-generation-inference PR #2489: an allocation undone before prefill left the pool changed",
           "PrefixCachePool._admit", "a refused admit keeps its evictions and moves its cached-free hits",
           RefusedAdmitNotRolledBack),
    _entry("prefix_salt_dropped", "semantics.md 11, keys (the salt in every block's key)",
           "vLLM #56655 (PR #56656): prompt-embedding masks omitted from the prefix cache keys",
           "PrefixCachePool._admit", "the extra key never reaches a request's keys or its lookups", SaltDropped),
    _entry("prefix_stale_hit_after_refused_admit", "semantics.md 11, admit (returns admitted, hit tokens and the table)",
           "vLLM PR #18957: an outdated ComputedBlocksTracker count kept across a failed schedule",
           "PrefixCachePool.admit", "the hit of a refused admit is reported by the request's next admit",
           StaleHitAfterRefusedAdmit),
    _entry("prefix_duplicate_key_replaces", "semantics.md 11, duplicate keys (listed after the block(s) already under it)",
           "FastDeploy PR #6226: two identical output blocks under one hash, one dropped from the tree",
           "PrefixCachePool.write", "a duplicate key replaces the first block's entry", DuplicateKeyReplaces),
    _entry("prefix_partial_tail_keyed", "semantics.md 11, partial tail private (refcount 1 and no key)",
           "vLLM's cache_full_blocks (num_tokens // block_size) taken as a ceiling", "PrefixCachePool.write",
           "the partial tail block is keyed and listed in the cached map", PartialTailKeyed),
    _entry("prefix_salt_only_in_first_block", "semantics.md 11, keys (the salt in every block's key)",
           "vLLM PR #12603: extra keys missing from later blocks' hashes", "PrefixCachePool.write",
           "only block 0's key carries the salt; later blocks are keyed by tokens alone", SaltOnlyInFirstBlock),
    _entry("prefix_free_head_first", "semantics.md 11, release order (a table tail block first)",
           "vLLM #48489 (PR #48532): the tail-first free order lost on a deferred path", "PrefixCachePool._release",
           "a request's blocks are released head first: its root is evicted first", FreeHeadFirst),
    _entry("prefix_keyed_block_freed_to_front", "semantics.md 11, release order (keyed blocks at the back)",
           "vLLM's BlockPool.free_blocks (hashed blocks appended) with the ends swapped", "PrefixCachePool._release",
           "a freed keyed block goes to the front of the free queue", KeyedBlockFreedToFront),
    _entry("prefix_free_blocks_double_free", "semantics.md 11, free_blocks (always refused, nothing changed)",
           "vLLM #42571 (PR #42612): BlockPool.free_blocks([b, b]) drives a refcount below 0",
           "PrefixCachePool.free_blocks", "the pool's own release decrements per listing, no check",
           FreeBlocksDoubleFree),
    _entry("prefix_window_release_one_token_early", "semantics.md 11, sliding window (blocks wholly before the window)",
           "vLLM's get_num_skipped_tokens = n - w + 1 taken as n - w + 2", "PrefixCachePool._skipped",
           "a decode releases the block holding the first position the new token attends",
           WindowReleaseOneTokenEarly),
    _entry("prefix_window_release_drops_key", "semantics.md 11, sliding window (released blocks stay cached)",
           "vLLM's remove_skipped_blocks freeing through free_blocks (hashed blocks to the back) taken as an eviction",
           "PrefixCachePool._release_blocks", "a block released by the window loses its key and goes to the front",
           WindowReleaseDropsKey),
)
