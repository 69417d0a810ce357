"""Executable spec of the ``prefix`` kind: a block pool with prefix caching
by content (vLLM's v1 KV cache manager; semantics.md 11, docs/prefix.md).

A pool of ``n_blocks`` blocks of ``block_size`` (B) slots serves
**requests**, each a token list with an optional **extra key** (``salt``:
vLLM's cache_salt, LoRA or multimodal identity). A request's **block table**
holds ``ceil(len / B)`` blocks; row ``p`` lives in slot ``p % B`` of block
``table[p // B]``.

A full block is **cached** under its **key**, ``(salt, tokens[:(i + 1) *
B])`` for block index ``i``: what vLLM's hash chain ``H(parent, block
tokens, extra keys)`` names, the chain taken as collision-free (so a key IS
what it names, and the spec keeps no hashes). A later request whose first
blocks' keys are cached **hits** them: its table takes those blocks
(refcount + 1) and only the rest is computed. A block whose refcount falls to
0 joins the **free queue** but keeps its key and rows: it is **cached-free**
and can still be hit, until it is popped from the front of the queue for a
new allocation, which **evicts** it (its key is dropped). The partial tail
block of a request is never keyed, so never shared.

Names: a K/V row at position p of a request depends on every token up to p
and on the extra key, so the spec names it ``row_name(salt, tokens, p) =
(salt, tokens[:p + 1])``. Every invariant is stated on these names; the
harness turns them into bytes.

Every op is a pure function ``op(world, ...) -> (result, new world)`` on a
frozen :class:`PrefixWorld`, or raises one of :mod:`kvspec.spec.errors` naming the
argument and the rule; a refusal (and an admission or decode that finds no
room, which returns a negative result) changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError

#: a block key: ``(salt, tokens)``, tokens the first ``(i + 1) * B`` tokens
Key = tuple[Any, tuple[int, ...]]
#: a row name: ``(salt, tokens[:p + 1])``
RowName = tuple[Any, tuple[int, ...]]


# -- integer rules (CrossHair contracts) ------------------------------------------------


def max_hit_blocks(n_tokens: int, block_size: int) -> int:
    """The most blocks a request of ``n_tokens`` tokens may hit: ``(n_tokens
    - 1) // block_size``. The last token is always recomputed (its logits
    are needed), so a hit covers at most ``n_tokens - 1`` tokens, in whole
    blocks (vLLM: ``max_cache_hit_length = num_tokens - 1``, then
    ``max_length // block_size`` blocks). A prompt that is a whole number of
    blocks and wholly cached still recomputes its last block.

    pre: n_tokens >= 1 and block_size >= 1
    post: __return__ >= 0
    post: __return__ * block_size <= n_tokens - 1 < (__return__ + 1) * block_size
    """
    return (n_tokens - 1) // block_size


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Entries of a block table for ``n_tokens`` rows: ``ceil(n_tokens /
    block_size)``.

    pre: n_tokens >= 0 and block_size >= 1
    post: __return__ >= 0
    post: (__return__ - 1) * block_size < n_tokens <= __return__ * block_size or (n_tokens == 0 and __return__ == 0)
    """
    return -(-n_tokens // block_size)


def full_blocks(n_tokens: int, block_size: int) -> int:
    """Blocks of a request of ``n_tokens`` tokens that are full (and so
    keyed): ``n_tokens // block_size``. Block ``i`` is full iff ``i <
    full_blocks`` (:func:`is_full`).

    pre: n_tokens >= 0 and block_size >= 1
    post: __return__ * block_size <= n_tokens < (__return__ + 1) * block_size
    """
    return n_tokens // block_size


def is_full(index: int, n_tokens: int, block_size: int) -> bool:
    """Is block ``index`` of a request of ``n_tokens`` tokens full, i.e.
    ``(index + 1) * block_size <= n_tokens``? Written as ``index < n_tokens
    // block_size`` (no product to overflow).

    pre: index >= 0 and n_tokens >= 0 and block_size >= 1
    post: __return__ == ((index + 1) * block_size <= n_tokens)
    """
    return index < n_tokens // block_size


def new_blocks_needed(n_tokens: int, hit: int, block_size: int) -> int:
    """Blocks an admission must take from the free queue: ``ceil(n_tokens /
    block_size) - hit`` for ``hit`` blocks hit. Never 0: the hit stops one
    token short of the whole prompt (:func:`max_hit_blocks`), so at least
    the block of the last token is new.

    pre: n_tokens >= 1 and block_size >= 1
    pre: 0 <= hit <= (n_tokens - 1) // block_size
    post: __return__ >= 1
    post: (hit + __return__) * block_size >= n_tokens
    """
    return blocks_for(n_tokens, block_size) - hit


def decode_blocks_needed(n_tokens: int, n_new: int, block_size: int) -> int:
    """Blocks a decode of ``n_new`` tokens onto a request of ``n_tokens``
    must take from the free queue: ``ceil((n_tokens + n_new) / B) -
    ceil(n_tokens / B)``; the tail block's free slots are used first.

    pre: n_tokens >= 0 and n_new >= 1 and block_size >= 1
    post: 0 <= __return__ <= (n_new + block_size - 1) // block_size
    post: __return__ == 0 or n_tokens + n_new > -(-n_tokens // block_size) * block_size
    """
    return blocks_for(n_tokens + n_new, block_size) - blocks_for(n_tokens, block_size)


def available_blocks(n_free: int, hit_free: int) -> int:
    """Blocks an admission may take from the free queue: ``n_free`` minus the
    ``hit_free`` cached-free blocks it hits (touching a cached-free block
    takes it out of the queue; vLLM counts these in
    ``get_num_blocks_to_allocate``).

    pre: 0 <= hit_free <= n_free
    post: 0 <= __return__ <= n_free
    """
    return n_free - hit_free


def skipped_blocks(n_tokens: int, window: int, block_size: int) -> int:
    """Leading blocks of a sliding-window request of ``n_tokens`` computed
    tokens that lie wholly before the window of the next token: ``max(0,
    n_tokens - window + 1) // block_size``. The next token (position
    ``n_tokens``) attends positions ``n_tokens - window + 1 .. n_tokens``
    (vLLM: ``SlidingWindowManager.get_num_skipped_tokens`` is ``max(0, n -
    w + 1)``; ``remove_skipped_blocks`` frees ``skipped // block_size``
    blocks). Block ``i`` is outside iff ``i < skipped_blocks``.

    pre: n_tokens >= 0 and window >= 1 and block_size >= 1
    post: __return__ >= 0
    post: __return__ * block_size <= max(0, n_tokens - window + 1)
    post: (__return__ + 1) * block_size > n_tokens - window + 1
    """
    return max(0, n_tokens - window + 1) // block_size


def hit_run(window: int, block_size: int) -> int:
    """Cached blocks in a row a sliding-window hit needs, ending at the hit
    boundary: ``max(1, ceil((window - 1) / block_size))``. The first token
    after the hit attends ``window - 1`` tokens before it, which span
    ``ceil((w - 1) / B)`` blocks. vLLM: ``_contiguous_blocks_for_hit`` is
    ``cdiv(w - 1, B)``; its scan counts a block before comparing, so with
    ``w = 1`` (0 blocks) one cached block is still needed.

    pre: window >= 1 and block_size >= 1
    post: __return__ >= 1
    post: __return__ == 1 or (__return__ - 1) * block_size < window - 1 <= __return__ * block_size
    """
    return max(1, -(-(window - 1) // block_size))


def window_hit(cached: tuple[bool, ...], run: int) -> int:
    """The sliding-window hit length in blocks over ``cached`` (``cached[i]``:
    block ``i``'s key is cached; its length is the cap, :func:`max_hit_blocks`):
    the largest ``e <= len(cached)`` such that blocks ``max(0, e - run) ..
    e - 1`` are all cached. vLLM's ``find_longest_cache_hit`` scans from the
    cap down for ``run`` cached blocks in a row and stops at the first such
    run (the highest ``e >= run``); with none, it falls back to the leading
    run of cached blocks from block 0 (shorter than ``run``). ``e = 0``
    always qualifies.

    pre: run >= 1 and len(cached) <= 4
    post: 0 <= __return__ <= len(cached)
    post: all(cached[max(0, __return__ - run):__return__])
    post: all(not all(cached[max(0, e - run):e]) for e in range(__return__ + 1, len(cached) + 1))
    """
    count = 0
    for i in range(len(cached) - 1, -1, -1):
        if cached[i]:
            count += 1
            if count >= run:
                return i + run
        else:
            count = 0
    return count


def window_keys(window: int | None) -> bool:
    """Are full blocks keyed under this window? Yes, except ``window == 1``:
    a token then attends only itself, no block can serve a hit, and vLLM's
    ``SlidingWindowManager.reachable_block_mask`` (0 blocks needed per
    block-sized segment) marks every block unreachable, so
    ``cache_full_blocks`` keys none."""
    return window != 1


def key_slot_length(index: int, slot: int, block_size: int) -> int:
    """Tokens named by the row in ``slot`` of block ``index``: ``index *
    block_size + slot + 1`` (its row name holds that prefix).

    pre: index >= 0 and block_size >= 1 and 0 <= slot < block_size
    post: index * block_size < __return__ <= (index + 1) * block_size
    """
    return index * block_size + slot + 1


# -- names ------------------------------------------------------------------------------


def row_name(salt: Any, tokens: tuple[int, ...], p: int) -> RowName:
    """The name of the K/V row at position ``p`` of a request: ``(salt,
    tokens[:p + 1])`` (a row depends on every token up to it and on the
    extra key)."""
    return (salt, tuple(tokens[: p + 1]))


def block_key(salt: Any, tokens: tuple[int, ...], index: int, block_size: int) -> Key:
    """The key of block ``index`` of a request: ``(salt, tokens[:(index + 1)
    * block_size])`` (the prefix the hash chain up to that block names)."""
    return (salt, tuple(tokens[: (index + 1) * block_size]))


def key_index(key: Key, block_size: int) -> int:
    """The block index a key names: ``len(tokens) // block_size - 1``."""
    return len(key[1]) // block_size - 1


def key_rows(key: Key, block_size: int) -> tuple[RowName, ...]:
    """The ``block_size`` row names a block under ``key`` must hold: slot
    ``j`` holds ``(salt, tokens[:i * B + j + 1])``, i the key's index."""
    salt, tokens = key
    i = key_index(key, block_size)
    return tuple((salt, tokens[: key_slot_length(i, j, block_size)]) for j in range(block_size))


# -- the state --------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Block:
    """One block of the pool: ``refcount`` (tables holding it), ``key``
    (None: not cached) and ``rows`` (B row names, None where nothing was
    written since the block was last allocated)."""

    refcount: int
    key: Key | None
    rows: tuple[RowName | None, ...]


@dataclass(frozen=True)
class Req:
    """A request: its ``tokens`` (prompt and decoded tokens), ``salt``
    (extra key, None or an int), block ``table`` and ``live`` (False:
    preempted; it holds no blocks and keeps its tokens for :func:`resume`)."""

    tokens: tuple[int, ...]
    salt: Any = None
    table: tuple[int | None, ...] = ()
    live: bool = True


@dataclass(frozen=True)
class AdmitResult:
    """What an admission (or a resume) returns: ``admitted`` (False: no room,
    nothing changed), ``hit_tokens`` (tokens served by the cache, a multiple
    of B; 0 when not admitted) and the request's block ``table``."""

    admitted: bool
    hit_tokens: int = 0
    table: tuple[int | None, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The kvtrace result: ``{"admitted", "hit", "table"}``."""
        return {"admitted": self.admitted, "hit": self.hit_tokens, "table": list(self.table)}


REFUSED = AdmitResult(admitted=False, hit_tokens=0, table=())


@dataclass(frozen=True)
class PrefixWorld:
    """The pool and its requests.

    * ``block_size`` (B >= 1), ``window`` (None: full attention; an int
      w >= 1: a sliding-window group, whose tables hold None for the blocks
      wholly before the window, :func:`skipped_blocks`);
    * ``blocks``: one :class:`Block` per block id ``0 .. n_blocks - 1``;
    * ``free``: the free queue, front (index 0, popped first) to back;
    * ``cached``: ``(key, block ids)`` pairs, ids in insertion order (a
      lookup takes the first); a key is present iff some block has it;
    * ``requests``: request id -> :class:`Req`, in admission order.

    Dicts are treated as immutable: every op builds new ones."""

    block_size: int
    blocks: tuple[Block, ...]
    free: tuple[int, ...]
    cached: tuple[tuple[Key, tuple[int, ...]], ...] = ()
    requests: Mapping[str, Req] = field(default_factory=dict)
    window: int | None = None

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    def cached_map(self) -> dict[Key, tuple[int, ...]]:
        """``cached`` as a dict (key -> block ids in insertion order)."""
        return dict(self.cached)


def new_world(block_size: int, n_blocks: int, window: int | None = None) -> PrefixWorld:
    """An empty pool: every block free (queue ``0 .. n_blocks - 1``),
    unkeyed, never written; ``window`` None (full attention) or the sliding
    window w >= 1 in tokens. Raises InvalidArgumentError for ``block_size <
    1``, ``n_blocks < 1`` or a bad window."""
    for name, value in (("block_size", block_size), ("n_blocks", n_blocks)):
        if not _is_int(value) or value < 1:
            raise InvalidArgumentError(f"prefix: {name} must be an integer >= 1, got {value!r}")
    if window is not None and (not _is_int(window) or window < 1):
        raise InvalidArgumentError(f"prefix: window must be None or an integer >= 1, got {window!r}")
    blank = Block(0, None, (None,) * block_size)
    return PrefixWorld(block_size, (blank,) * n_blocks, tuple(range(n_blocks)), window=window)


# -- argument checks --------------------------------------------------------------------


def _check_req(op: str, req: object) -> str:
    if not isinstance(req, str):
        raise InvalidArgumentError(f"{op}: req must be a request id (a string), got {req!r}")
    return req


def _check_tokens(op: str, tokens: object, name: str = "tokens") -> tuple[int, ...]:
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (list, tuple)):
        raise InvalidArgumentError(f"{op}: {name} must be a list of token ids (integers >= 0), got {tokens!r}")
    if not tokens:
        raise InvalidArgumentError(f"{op}: {name} must hold at least one token, got []")
    bad = [t for t in tokens if not _is_int(t) or t < 0]
    if bad:
        raise InvalidArgumentError(f"{op}: {name} must be token ids (integers >= 0), got {bad[0]!r}")
    return tuple(tokens)


def _check_salt(op: str, salt: object) -> Any:
    if salt is not None and (not _is_int(salt) or salt < 0):
        raise InvalidArgumentError(f"{op}: salt must be None or an integer >= 0 (the extra key), got {salt!r}")
    return salt


def _live(world: PrefixWorld, op: str, req: str) -> Req:
    r = world.requests.get(req)
    if r is None:
        raise StateError(f"{op}: no request {req!r} (known: {sorted(world.requests)})")
    if not r.live:
        raise StateError(f"{op}: request {req!r} is preempted (it holds no blocks); resume it first")
    return r


# -- pool actions (private: each builds new tuples) -------------------------------------


def _set(t: tuple, i: int, v: object) -> tuple:
    return t[:i] + (v,) + t[i + 1:]


def _cache_add(cached: tuple, key: Key, block: int) -> tuple:
    for i, (k, ids) in enumerate(cached):
        if k == key:
            return _set(cached, i, (k, ids + (block,)))
    return cached + ((key, (block,)),)


def _cache_remove(cached: tuple, key: Key, block: int) -> tuple:
    for i, (k, ids) in enumerate(cached):
        if k == key:
            rest = tuple(b for b in ids if b != block)
            return _set(cached, i, (k, rest)) if rest else cached[:i] + cached[i + 1:]
    return cached


def lookup_block(world: PrefixWorld, key: Key) -> int | None:
    """The block a lookup of ``key`` returns: the first cached under it (the
    oldest of duplicates), None if the key is not cached."""
    for k, ids in world.cached:
        if k == key:
            return ids[0]
    return None


def _pop(world: PrefixWorld, n: int) -> tuple[tuple[int, ...], PrefixWorld]:
    """Pop ``n`` blocks from the front of the free queue, one by one; a keyed
    one is evicted (its id leaves ``cached[key]``, its key is cleared). Each
    popped block gets refcount 1 and blank rows. The caller checked room."""
    blocks, free, cached = world.blocks, world.free, world.cached
    out = []
    blank = (None,) * world.block_size
    for _ in range(n):
        b, free = free[0], free[1:]
        key = blocks[b].key
        if key is not None:
            cached = _cache_remove(cached, key, b)
        blocks = _set(blocks, b, Block(1, None, blank))
        out.append(b)
    return tuple(out), replace(world, blocks=blocks, free=free, cached=cached)


def _write(world: PrefixWorld, salt: Any, tokens: tuple[int, ...], table: tuple[int, ...], lo: int,
           hi: int) -> PrefixWorld:
    """Write the rows of positions ``[lo, hi)`` through ``table``."""
    bs = world.block_size
    blocks = world.blocks
    for p in range(lo, hi):
        b, s = table[p // bs], p % bs
        blk = blocks[b]
        blocks = _set(blocks, b, replace(blk, rows=_set(blk.rows, s, row_name(salt, tokens, p))))
    return replace(world, blocks=blocks)


def _cache_full(world: PrefixWorld, salt: Any, tokens: tuple[int, ...], table: tuple[int, ...], lo: int,
                hi: int) -> PrefixWorld:
    """Key blocks ``lo .. hi - 1`` of ``table`` (each full): key set and the
    id appended under it (after any block already there: a duplicate).
    Under ``window == 1`` nothing is keyed (:func:`window_keys`)."""
    if not window_keys(world.window):
        return world
    blocks, cached = world.blocks, world.cached
    for i in range(lo, hi):
        b = table[i]
        key = block_key(salt, tokens, i, world.block_size)
        blocks = _set(blocks, b, replace(blocks[b], key=key))
        cached = _cache_add(cached, key, b)
    return replace(world, blocks=blocks, cached=cached)


def _with_request(world: PrefixWorld, req: str, r: Req | None) -> PrefixWorld:
    if r is None:
        return replace(world, requests={k: v for k, v in world.requests.items() if k != req})
    return replace(world, requests={**world.requests, req: r})


# -- queries ----------------------------------------------------------------------------


def hit_blocks(world: PrefixWorld, salt: Any, tokens: tuple[int, ...]) -> int:
    """The hit length in blocks: the largest ``j <= max_hit_blocks(len,
    B)`` such that the keys of blocks ``0 .. j - 1`` (under ``salt``) are all
    cached. Hit tokens are ``j * B``. The chain stops at the first miss (a
    key names its whole prefix, so no later block can hit).

    Under a sliding window w only the last ``hit_run(w, B)`` blocks before
    the hit boundary must be cached (:func:`window_hit`): the earlier ones
    are outside the window of every token computed after the hit."""
    bs = world.block_size
    keys = world.cached_map()
    if world.window is not None:
        flags = tuple(block_key(salt, tokens, i, bs) in keys for i in range(max_hit_blocks(len(tokens), bs)))
        return window_hit(flags, hit_run(world.window, bs))
    j = 0
    for i in range(max_hit_blocks(len(tokens), bs)):
        if block_key(salt, tokens, i, bs) not in keys:
            break
        j = i + 1
    return j


def lookup(world: PrefixWorld, tokens: Any, salt: Any = None) -> int:
    """Hit tokens an admission of ``tokens`` under ``salt`` would get now
    (``hit_blocks * B``): a pure query, nothing changes (vLLM's
    ``get_computed_blocks`` without ``allocate_slots``). Raises
    InvalidArgumentError for empty or bad tokens or a bad salt."""
    tokens = _check_tokens("lookup", tokens)
    salt = _check_salt("lookup", salt)
    return hit_blocks(world, salt, tokens) * world.block_size


def hit_table(world: PrefixWorld, salt: Any, tokens: tuple[int, ...]) -> tuple[int | None, ...]:
    """The table entries an admission would take from the cache, in table
    order: the first block under each key ``0 .. hit_blocks - 1``. Under a
    sliding window the first ``skipped_blocks(hit * B, w, B)`` entries are
    None (outside the window of the first computed token: vLLM pads them
    with its null block and touches only the rest)."""
    bs = world.block_size
    j = hit_blocks(world, salt, tokens)
    lo = 0 if world.window is None else skipped_blocks(j * bs, world.window, bs)
    return (None,) * lo + tuple(lookup_block(world, block_key(salt, tokens, i, bs))  # type: ignore[misc]
                                for i in range(lo, j))


def free_count(world: PrefixWorld) -> int:
    """Blocks in the free queue (cached-free ones included)."""
    return len(world.free)


# -- ops --------------------------------------------------------------------------------


def _admit(world: PrefixWorld, req: str, tokens: tuple[int, ...], salt: Any) -> tuple[AdmitResult, PrefixWorld]:
    bs = world.block_size
    hits = hit_table(world, salt, tokens)
    j = len(hits)
    need = new_blocks_needed(len(tokens), j, bs)
    hit_free = sum(1 for b in hits if b is not None and world.blocks[b].refcount == 0)
    if need > available_blocks(len(world.free), hit_free):
        return REFUSED, world
    # touch the hits, in table order
    blocks, free = world.blocks, world.free
    for b in hits:
        if b is None:
            continue
        blk = blocks[b]
        if blk.refcount == 0:
            free = tuple(x for x in free if x != b)
        blocks = _set(blocks, b, replace(blk, refcount=blk.refcount + 1))
    new = replace(world, blocks=blocks, free=free)
    fresh, new = _pop(new, need)
    table = hits + fresh
    new = _write(new, salt, tokens, table, j * bs, len(tokens))
    new = _cache_full(new, salt, tokens, table, j, full_blocks(len(tokens), bs))
    new = _with_request(new, req, Req(tokens, salt, table, True))
    return AdmitResult(True, j * bs, table), new


def admit(world: PrefixWorld, req: str, tokens: Any, salt: Any = None) -> tuple[AdmitResult, PrefixWorld]:
    """Admit request ``req`` with ``tokens`` under ``salt`` (vLLM:
    ``get_computed_blocks`` then ``allocate_slots`` for the whole prompt,
    then the prompt's full blocks cached).

    ``j = hit_blocks``; the hits are the first block under each key ``0 ..
    j - 1``; ``need = new_blocks_needed(len, j, B)``; ``available`` is the
    free queue's length minus the hits that are cached-free. ``need >
    available``: returns ``AdmitResult(False, 0, ())`` and changes nothing
    (vLLM returns None). Else the hits are touched in table order (refcount
    + 1, a cached-free one leaves the free queue), ``need`` blocks are
    popped from the front of the free queue one by one (a keyed one is
    **evicted**: its id leaves ``cached[key]``, its key is cleared; each gets
    refcount 1 and blank rows), the rows of positions ``j * B .. len - 1``
    are written, and every full block from ``j`` on is cached under its key
    (appended after a block already under it: a duplicate key).

    Under a sliding window the hit follows :func:`window_hit`, the hit
    entries outside the first computed token's window are None and not
    touched (:func:`hit_table`), and every other block of the prompt is
    allocated, even those wholly outside the last token's window: the
    prefill computes through them; they are released by the next decode.

    Raises InvalidArgumentError for a non-string ``req``, empty or bad
    tokens, a bad salt, or a request already live; StateError for a
    preempted request (use :func:`resume`)."""
    _check_req("admit", req)
    tokens = _check_tokens("admit", tokens)
    salt = _check_salt("admit", salt)
    known = world.requests.get(req)
    if known is not None and known.live:
        raise InvalidArgumentError(f"admit: request {req!r} is already admitted (live); free it first")
    if known is not None:
        raise StateError(f"admit: request {req!r} is preempted; resume it (its tokens and salt are kept)")
    return _admit(world, req, tokens, salt)


def decode(world: PrefixWorld, req: str, tokens: Any) -> tuple[bool, PrefixWorld]:
    """Append ``tokens`` (usually one; several: a speculative or verify
    block) to live request ``req`` (vLLM: the output token appended, then
    ``allocate_slots`` for it). ``need = decode_blocks_needed(len, n, B)``;
    ``need > len(free)``: returns False, nothing changed. Else ``need``
    blocks are popped from the front (evicting, as in :func:`admit`), the
    rows of the new positions are written, and every block that became full
    is cached under its key. Returns True.

    Under a sliding window the blocks wholly before the window of the first
    new token are released first (:func:`_slide`; vLLM's
    ``remove_skipped_blocks`` at the start of ``allocate_slots``), and
    ``need`` is checked against the queue after that release. A refused
    decode changes nothing, that release included (vLLM keeps it:
    docs/prefix.md, Decisions).

    Raises InvalidArgumentError for a non-string ``req`` or empty or bad
    tokens; StateError for an unknown or preempted request."""
    _check_req("decode", req)
    tokens = _check_tokens("decode", tokens)
    r = _live(world, "decode", req)
    bs = world.block_size
    old = len(r.tokens)
    table, new = _slide(world, r)
    need = decode_blocks_needed(old, len(tokens), bs)
    if need > len(new.free):
        return False, world
    fresh, new = _pop(new, need)
    all_tokens = r.tokens + tokens
    table = table + fresh
    new = _write(new, r.salt, all_tokens, table, old, len(all_tokens))
    new = _cache_full(new, r.salt, all_tokens, table, full_blocks(old, bs), full_blocks(len(all_tokens), bs))
    new = _with_request(new, req, replace(r, tokens=all_tokens, table=table))
    return True, new


def _slide(world: PrefixWorld, r: Req) -> tuple[tuple[int | None, ...], PrefixWorld]:
    """Release the blocks of live request ``r`` wholly before the window of
    its next token: entries ``i < skipped_blocks(len, w, B)``, from the
    highest down to the first that is already None (vLLM's
    ``_remove_blocks_in_range``), in that order (:func:`_release` of the
    ascending slice). Returns the table with those entries None and the new
    world. Full attention: nothing."""
    if world.window is None:
        return r.table, world
    hi = min(skipped_blocks(len(r.tokens), world.window, world.block_size), len(r.table))
    lo = hi
    while lo > 0 and r.table[lo - 1] is not None:
        lo -= 1
    if lo == hi:
        return r.table, world
    return (None,) * hi + r.table[hi:], _release(world, r.table[lo:hi])


def _release(world: PrefixWorld, table: tuple[int | None, ...]) -> PrefixWorld:
    """Release ``table`` tail first: refcount - 1; a block reaching 0 joins
    the free queue, a keyed one at the back, an unkeyed one at the front.
    Those of one release keep release order within each group (vLLM:
    ``prepend_n`` of the unkeyed, ``append_n`` of the keyed). None entries
    (a sliding window's released blocks, always leading) are skipped (vLLM:
    ``trim_null_head``)."""
    blocks = world.blocks
    front: list[int] = []
    back: list[int] = []
    for b in reversed(table):
        if b is None:
            continue
        blk = blocks[b]
        blocks = _set(blocks, b, replace(blk, refcount=blk.refcount - 1))
        if blk.refcount - 1 == 0:
            (back if blk.key is not None else front).append(b)
    return replace(world, blocks=blocks, free=tuple(front) + world.free + tuple(back))


def free(world: PrefixWorld, req: str) -> tuple[None, PrefixWorld]:
    """Release live request ``req``'s table in reverse order (tail block
    first; :func:`_release`) and forget the request. So a prefix's root is
    the last of its blocks to be evicted, and a private (unkeyed) tail is
    reused first.

    Raises InvalidArgumentError for a non-string ``req``; StateError (nothing
    changed) for an unknown request (a double free) or a preempted one."""
    _check_req("free", req)
    r = _live(world, "free", req)
    return None, _with_request(_release(world, r.table), req, None)


def preempt(world: PrefixWorld, req: str) -> tuple[None, PrefixWorld]:
    """As :func:`free`, but the request stays known, preempted (``live=False``,
    empty table) with its tokens (prompt and decoded) and salt, for
    :func:`resume`. Raises as :func:`free`."""
    _check_req("preempt", req)
    r = _live(world, "preempt", req)
    return None, _with_request(_release(world, r.table), req, replace(r, table=(), live=False))


def resume(world: PrefixWorld, req: str) -> tuple[AdmitResult, PrefixWorld]:
    """Admit preempted request ``req`` again with its tokens and salt: the
    rules of :func:`admit`, the same result (not admitted: it stays
    preempted, nothing changed). Raises InvalidArgumentError for a
    non-string ``req``; StateError for an unknown or live request."""
    _check_req("resume", req)
    r = world.requests.get(req)
    if r is None:
        raise StateError(f"resume: no request {req!r} (known: {sorted(world.requests)})")
    if r.live:
        raise StateError(f"resume: request {req!r} is live, not preempted")
    return _admit(world, req, r.tokens, r.salt)


def free_blocks(world: PrefixWorld, blocks: Any) -> tuple[None, PrefixWorld]:
    """The block pool's own release call (vLLM's ``BlockPool.free_blocks``),
    there so a harness can probe a pool's double-free guard. Every block
    with a refcount above 0 is held by a live table, so every call is
    refused, nothing changed: InvalidArgumentError for ``blocks`` not a
    non-empty list of block ids, an id out of ``0 .. n_blocks - 1`` or one
    listed twice (its refcount would drop twice); StateError for a block of
    refcount 0 (a double free: it is already free) or a block a live table
    holds (its holder would lose it: only ``free(req)`` releases it)."""
    n = world.n_blocks
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, (list, tuple)) or not blocks:
        raise InvalidArgumentError(f"free_blocks: blocks must be a non-empty list of block ids, got {blocks!r}")
    for b in blocks:
        if not _is_int(b) or not 0 <= b < n:
            raise InvalidArgumentError(f"free_blocks: blocks must be block ids in 0..{n - 1}, got {b!r}")
    seen: set[int] = set()
    for b in blocks:
        if b in seen:
            raise InvalidArgumentError(f"free_blocks: block {b} is listed twice (its refcount would fall twice)")
        seen.add(b)
    for b in blocks:
        if world.blocks[b].refcount == 0:
            raise StateError(f"free_blocks: block {b} has refcount 0 (it is free already: a double free)")
    b = blocks[0]
    holders = sorted(k for k, r in world.requests.items() if b in r.table)
    raise StateError(f"free_blocks: block {b} is held by request(s) {holders} (refcount "
                     f"{world.blocks[b].refcount}); only free(req) releases a table's blocks")


def reset(world: PrefixWorld) -> tuple[bool, PrefixWorld]:
    """vLLM's ``reset_prefix_cache``: if any block has a refcount above 0,
    returns False and changes nothing; else every key is dropped (``cached``
    empty, every block's key None; rows stay, unreachable) and the free
    queue keeps its order; returns True."""
    if any(b.refcount > 0 for b in world.blocks):
        return False, world
    return True, replace(world, blocks=tuple(replace(b, key=None) for b in world.blocks), cached=())


# -- the observable view ----------------------------------------------------------------


def observe(world: PrefixWorld) -> dict[str, Any]:
    """What a target shows, as the lockstep compares it after every op:

    * ``requests``: ``{req: {"table": [ids], "tokens": n, "live": bool}}``
      (a preempted request: ``live`` False, table ``[]``);
    * ``blocks``: ``[(refcount, key or None)]`` per block id;
    * ``free``: the free queue, front to back;
    * ``cached``: ``{key: [ids]}``, ids in insertion order;
    * ``rows``: ``{(block, slot): row name or None}`` for the blocks that
      are held or keyed (a free unkeyed block's rows are garbage)."""
    rows = {(b, s): name
            for b, blk in enumerate(world.blocks) if blk.refcount > 0 or blk.key is not None
            for s, name in enumerate(blk.rows)}
    return {
        "requests": {k: {"table": list(r.table), "tokens": len(r.tokens), "live": r.live}
                     for k, r in world.requests.items()},
        "blocks": [(blk.refcount, blk.key) for blk in world.blocks],
        "free": list(world.free),
        "cached": {k: list(ids) for k, ids in world.cached},
        "rows": rows,
    }


# -- trace ops --------------------------------------------------------------------------


def _field(op: dict, name: str) -> Any:
    if name not in op:
        raise InvalidArgumentError(f"{op.get('op')}: the op needs the field {name!r}, got {sorted(op)}")
    return op[name]


def apply_op(world: PrefixWorld, op: dict) -> tuple[object, PrefixWorld]:
    """Run one kvtrace op (``kind: prefix``) on ``world``: ``(result, new
    world)``, the result as a trace records it: admit and resume
    ``{"admitted", "hit", "table"}`` (:meth:`AdmitResult.to_json`), decode
    and reset a bool, free and preempt None, lookup the hit tokens (an int).
    ``expect`` changes nothing and returns :func:`observe` (the harness
    compares the fields the op names). ``salt`` is optional (absent: None).
    Raises the spec's refusal; ``free_blocks`` is always refused;
    UnsupportedOperationError for an op the kind does not have. Module
    functions are looked up at call time, so a test that patches one (a
    proof's negative control) reaches it here."""
    name = op.get("op")
    if name == "admit":
        r, w = admit(world, _field(op, "req"), _field(op, "tokens"), op.get("salt"))
        return r.to_json(), w
    if name == "decode":
        return decode(world, _field(op, "req"), _field(op, "tokens"))
    if name == "free":
        return free(world, _field(op, "req"))
    if name == "preempt":
        return preempt(world, _field(op, "req"))
    if name == "resume":
        r, w = resume(world, _field(op, "req"))
        return r.to_json(), w
    if name == "lookup":
        return lookup(world, _field(op, "tokens"), op.get("salt")), world
    if name == "free_blocks":
        return free_blocks(world, _field(op, "blocks"))
    if name == "reset":
        return reset(world)
    if name == "expect":
        return observe(world), world
    raise UnsupportedOperationError(f"{name}: not an operation of a prefix cache (ops: admit, decode, free, "
                                    f"preempt, resume, lookup, free_blocks, reset, expect)")


# -- invariants (each True on every reachable world) ------------------------------------


def keys_name_contents(world: PrefixWorld) -> bool:
    """Key to content (the invariant the public reports break): every block
    reached through a key holds exactly the rows that key names, and carries
    that key; a key names whole blocks (``len(tokens)`` a positive multiple
    of B)."""
    bs = world.block_size
    for key, ids in world.cached:
        if not ids or len(key[1]) < bs or len(key[1]) % bs:
            return False
        want = key_rows(key, bs)
        for b in ids:
            if not 0 <= b < world.n_blocks or world.blocks[b].key != key or world.blocks[b].rows != want:
                return False
    return True


def cached_map_exact(world: PrefixWorld) -> bool:
    """Every keyed block is under its key in ``cached`` exactly once; no key
    appears twice, no id under two keys, no unkeyed block under any."""
    keys = [k for k, _ in world.cached]
    if len(set(keys)) != len(keys):
        return False
    listed = [b for _, ids in world.cached for b in ids]
    if len(set(listed)) != len(listed):
        return False
    keyed = {b for b, blk in enumerate(world.blocks) if blk.key is not None}
    if set(listed) != keyed:
        return False
    m = world.cached_map()
    return all(b in m.get(world.blocks[b].key, ()) for b in keyed)  # type: ignore[arg-type]


def refcounts_match_tables(world: PrefixWorld) -> bool:
    """A block's refcount is the number of live tables holding it (never
    negative); a table holds a block at most once; a preempted request
    holds none."""
    counts = [0] * world.n_blocks
    for r in world.requests.values():
        if not r.live and r.table:
            return False
        held = [b for b in r.table if b is not None]
        if len(set(held)) != len(held):
            return False
        for b in held:
            if not 0 <= b < world.n_blocks:
                return False
            counts[b] += 1
    return tuple(counts) == tuple(blk.refcount for blk in world.blocks)


def free_queue_exact(world: PrefixWorld) -> bool:
    """The free queue holds exactly the blocks of refcount 0, each once."""
    zero = {b for b, blk in enumerate(world.blocks) if blk.refcount == 0}
    return len(set(world.free)) == len(world.free) and set(world.free) == zero


def requests_read_their_rows(world: PrefixWorld) -> bool:
    """Every live request reads its own rows: slot ``p % B`` of block
    ``table[p // B]`` holds ``row_name(salt, tokens, p)`` for ``p < len``.
    Under a sliding window the None entries are leading, all before
    ``skipped_blocks(len, w, B)`` (so every row the next token attends is
    readable), and every held block holds its rows."""
    bs = world.block_size
    for r in world.requests.values():
        if not r.live:
            continue
        nulls = sum(1 for b in r.table if b is None)
        if any(b is None for b in r.table[nulls:]):
            return False
        if nulls and (world.window is None or nulls > skipped_blocks(len(r.tokens), world.window, bs)):
            return False
        for p in range(nulls * bs, len(r.tokens)):
            i = p // bs
            if i >= len(r.table) or world.blocks[r.table[i]].rows[p % bs] != row_name(r.salt, r.tokens, p):
                return False
    return True


def partial_tail_private(world: PrefixWorld) -> bool:
    """A live request's partial tail block (``len % B != 0``: its last
    table entry) has refcount 1 and no key: only full blocks are keyed or
    shared."""
    bs = world.block_size
    for r in world.requests.values():
        if r.live and len(r.tokens) % bs and r.table:
            tail = world.blocks[r.table[-1]]
            if tail.refcount != 1 or tail.key is not None:
                return False
    return True


def tables_sized(world: PrefixWorld) -> bool:
    """A live request's table has ``ceil(len / B)`` entries."""
    return all(len(r.table) == blocks_for(len(r.tokens), world.block_size)
               for r in world.requests.values() if r.live)


def full_blocks_keyed(world: PrefixWorld) -> bool:
    """Every full block a live request holds is keyed under its own key (a
    held block is never evicted, and reset is refused while blocks are
    held); under ``window == 1`` no block is keyed."""
    bs = world.block_size
    keyed = window_keys(world.window)
    for r in world.requests.values():
        if r.live:
            for i in range(full_blocks(len(r.tokens), bs)):
                b = r.table[i]
                if b is not None and world.blocks[b].key != (block_key(r.salt, r.tokens, i, bs) if keyed else None):
                    return False
    return True


INVARIANTS = (keys_name_contents, cached_map_exact, refcounts_match_tables, free_queue_exact,
              requests_read_their_rows, partial_tail_private, tables_sized, full_blocks_keyed)


def broken_invariants(world: PrefixWorld) -> tuple[str, ...]:
    """Names of the invariants ``world`` breaks (empty on every reachable
    world)."""
    return tuple(inv.__name__ for inv in INVARIANTS if not inv(world))


# -- the spec as a target ---------------------------------------------------------------


class PrefixModel:
    """The spec driven as a prefix target (fuzz/prefix.py's protocol): the
    same methods and results. A refusal changes nothing: an op that raises
    leaves the frozen :attr:`world` as it was, ``reset`` replaces it only
    when it returns True, and ``admit``, ``decode`` and ``resume`` take the
    world their function returns, which on a negative result (not admitted,
    False) is the world they were given. ``declared`` is empty: the spec
    differs from itself in nothing."""

    declared: ClassVar[dict[str, str]] = {}

    def __init__(self, block_size: int, n_blocks: int, window: int | None = None) -> None:
        self.world = new_world(block_size, n_blocks, window)

    def admit(self, req: str, tokens: Any, salt: Any = None) -> AdmitResult:
        r, self.world = admit(self.world, req, tokens, salt)
        return r

    def decode(self, req: str, tokens: Any) -> bool:
        ok, self.world = decode(self.world, req, tokens)
        return ok

    def free(self, req: str) -> None:
        _, self.world = free(self.world, req)

    def preempt(self, req: str) -> None:
        _, self.world = preempt(self.world, req)

    def resume(self, req: str) -> AdmitResult:
        r, self.world = resume(self.world, req)
        return r

    def lookup(self, tokens: Any, salt: Any = None) -> int:
        return lookup(self.world, tokens, salt)

    def free_blocks(self, blocks: Any) -> None:
        _, self.world = free_blocks(self.world, blocks)

    def reset(self) -> bool:
        ok, world = reset(self.world)
        if ok:
            self.world = world
        return ok

    def observe(self) -> dict[str, Any]:
        return observe(self.world)
