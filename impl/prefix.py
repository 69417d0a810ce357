"""A block pool with prefix caching by content (spec: ``kvspec.spec.prefix``;
docs/prefix.md), as vLLM's v1 KV-cache manager keeps one.

Storage follows the paged pool's (``kvspec.impl.paged``): K and V slabs
``[n_blocks, block_size, H, D]`` (K and V head dims may differ), allocated
as zeros on the first :meth:`PrefixCachePool.write` in the dtype handed in
(float16, bfloat16 or float32, stored exactly: bfloat16 rows come back bit
for bit). Rows are written by static slice updates (``kvspec.impl.write.
write_copy``), which MLX donates when nothing else holds a slab; no reader
shares a slab's memory (:meth:`PrefixCachePool.fetch` returns gathers,
:meth:`PrefixCachePool.block_rows` and :meth:`PrefixCachePool.copy` copies,
each evaluated into its own memory), so no write is ever seen through an
array a caller holds.

Host metadata, per block: a reference count (the number of live requests
whose table holds it) and a **key** (None, or ``(salt, tokens)``: the salt
of the request that filled it and the tokens of that request up to the
block's end, so block ``i`` of a table is keyed by the first ``(i + 1) *
block_size`` tokens). Beside them:

* the **free queue**: every block of refcount 0, front first, as an O(1)
  doubly linked list (vLLM's ``FreeKVCacheBlockQueue``); blocks are taken
  from the front; a freed keyed block goes to the back, an unkeyed one to
  the front; a hit on a free keyed block takes it out of the middle;
* the **cached map** ``key -> [block ids]`` in insertion order (a lookup
  takes the first; a second block filled with the same tokens is a
  duplicate, appended after it);
* the **requests**: ``req -> (tokens, salt, table, live)``; a preempted
  request (``live=False``) holds no block and keeps its tokens for
  :meth:`PrefixCachePool.resume`.

Ops come in pairs: :meth:`~PrefixCachePool.admit`,
:meth:`~PrefixCachePool.decode` and :meth:`~PrefixCachePool.resume` allocate
blocks for positions whose rows the model has not computed yet (the
request's **pending** positions, :meth:`~PrefixCachePool.pending`); the
following :meth:`~PrefixCachePool.write` stores their rows and only then
keys every block those rows filled, so a block never has a key before it
holds the rows the key names. Between the two no other request may be
admitted, decoded, resumed or looked up (refused with StateError: their
answer would miss the keys about to be assigned); free and preempt stay
allowed (an aborted request's unwritten blocks are freed unkeyed).

Every op checks all its arguments and its capacity before it changes
anything: a refusal (an exception of ``kvspec.spec.errors``, or a False /
not-admitted result) leaves every refcount, key, table, the free queue, the
cached map and the slabs exactly as they were, a refused admit that would
have evicted keyed blocks included. The rules are stated here on their own
(``kvspec.spec.prefix`` states them independently; the tests compare both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.impl.write import write_copy
from kvspec.spec.errors import InvalidArgumentError, StateError

Key = tuple[Any, tuple[int, ...]]

_FLOATS = (mx.float16, mx.bfloat16, mx.float32)
#: the slab dtypes NumPy holds (bfloat16 is not one): block_rows and copy copy these through the host
_HOST_COPIED = (mx.float16, mx.float32)


def max_hit_blocks(n_tokens: int, block_size: int) -> int:
    """The most blocks a hit may cover for a request of ``n_tokens`` tokens:
    ``(n_tokens - 1) // block_size`` (the last token is always recomputed,
    vLLM's ``max_cache_hit_length = num_tokens - 1``). Rule:
    ``kvspec.spec.prefix.max_hit_blocks``."""
    return (n_tokens - 1) // block_size


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Table entries for ``n_tokens`` tokens: ``ceil(n_tokens / block_size)``.
    Rule: ``kvspec.spec.prefix.admit`` (the table of a live request)."""
    return -(-n_tokens // block_size)


def skipped_blocks(n_tokens: int, window: int, block_size: int) -> int:
    """Leading blocks of a sliding-window request of ``n_tokens`` tokens
    wholly before its next token's window: ``max(0, n_tokens - window + 1)
    // block_size``. Rule: ``kvspec.spec.prefix.skipped_blocks``."""
    return max(0, n_tokens - window + 1) // block_size


def hit_run(window: int, block_size: int) -> int:
    """Cached blocks in a row a sliding-window hit needs: ``max(1,
    ceil((window - 1) / block_size))``. Rule: ``kvspec.spec.prefix.hit_run``."""
    return max(1, -(-(window - 1) // block_size))


@dataclass(frozen=True)
class AdmitResult:
    """What :meth:`PrefixCachePool.admit` and :meth:`PrefixCachePool.resume`
    return (``kvspec.spec.prefix.AdmitResult``'s fields): ``admitted``, the hit in
    **tokens** (a multiple of the block size; 0 when not admitted) and the
    request's block table (``()`` when not admitted; under a sliding
    window None for the hit blocks outside the window)."""

    admitted: bool
    hit_tokens: int
    table: tuple[int | None, ...]


@dataclass
class _Request:
    """A request: its tokens (prompt then decoded), salt, block table,
    ``live`` (False: preempted, no table) and ``written`` (positions
    ``[0, written)`` hold rows; ``[written, len(tokens))`` are pending)."""

    tokens: list[int]
    salt: Any
    table: list[int | None]
    live: bool
    written: int

    def clone(self) -> _Request:
        return _Request(list(self.tokens), self.salt, list(self.table), self.live, self.written)


def _check_int(op: str, name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise InvalidArgumentError(f"{op}: {name} must be an integer, got {v!r}")
    return int(v)


def _check_tokens(op: str, tokens: Any) -> tuple[int, ...]:
    """``tokens`` as a tuple of ints >= 0, non-empty (InvalidArgumentError
    naming the first bad token otherwise)."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (tuple, list, np.ndarray)):
        raise InvalidArgumentError(f"{op}: tokens must be a list of token ids (integers >= 0), got {tokens!r}")
    if len(tokens) == 0:
        raise InvalidArgumentError(f"{op}: tokens must hold at least one token, got []")
    out = []
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
            raise InvalidArgumentError(f"{op}: tokens must be token ids (integers >= 0), got {t!r}")
        out.append(int(t))
    return tuple(out)


def _check_salt(op: str, salt: Any) -> Any:
    if salt is None:
        return None
    if isinstance(salt, bool) or not isinstance(salt, (int, np.integer)) or salt < 0:
        raise InvalidArgumentError(f"{op}: salt must be None or an integer >= 0 (the extra key), got {salt!r}")
    return int(salt)


def _check_req(op: str, req: Any) -> str:
    if not isinstance(req, str):
        raise InvalidArgumentError(f"{op}: req must be a request id (a string), got {req!r}")
    return req


class PrefixCachePool:
    """A pool of ``n_blocks`` blocks of ``block_size`` rows with prefix
    caching by content (``kvspec.spec.prefix``).

    Args:
        block_size: rows per block, int >= 1.
        n_blocks: blocks in the pool, int >= 1 (every one usable: vLLM's
            null block is not counted).
        kv_heads, head_dim: optional; when given, every write must have
            ``H == kv_heads`` and K/V head dim ``head_dim``.
        k_head_dim, v_head_dim: optional, keyword only: the K and V head
            dims when they differ (each defaults to ``head_dim``).
        window: keyword only; None (full attention) or the sliding window
            w >= 1 in tokens: a request's table then holds None for the
            blocks wholly before its next token's window (released by
            :meth:`decode`), hits follow ``kvspec.spec.prefix.window_hit``, and
            under ``w = 1`` no block is keyed.

    The dtype (float16, bfloat16 or float32) and the shapes not given here
    are fixed by the first :meth:`write`, which allocates the slabs.
    Request ids are strings; tokens are ints >= 0; a salt is None or an int
    (the request's extra key: cache salt, LoRA or multimodal identity).
    Every op raises InvalidArgumentError for a bad argument (naming the op,
    the argument, its value and the rule) and StateError for an op the
    request's state does not allow; a refusal changes nothing.
    """

    def __init__(self, block_size: int, n_blocks: int, kv_heads: int | None = None, head_dim: int | None = None,
                 *, k_head_dim: int | None = None, v_head_dim: int | None = None, window: int | None = None):
        op = "PrefixCachePool"
        block_size = _check_int(op, "block_size", block_size)
        n_blocks = _check_int(op, "n_blocks", n_blocks)
        if block_size < 1:
            raise InvalidArgumentError(f"{op}: block_size must be >= 1, got {block_size}")
        if n_blocks < 1:
            raise InvalidArgumentError(f"{op}: n_blocks must be >= 1, got {n_blocks}")
        dims = {}
        for name, v in (("kv_heads", kv_heads), ("head_dim", head_dim), ("k_head_dim", k_head_dim),
                        ("v_head_dim", v_head_dim)):
            if v is not None:
                v = _check_int(op, name, v)
                if v < 1:
                    raise InvalidArgumentError(f"{op}: {name} must be None or >= 1, got {v}")
            dims[name] = v
        if window is not None:
            window = _check_int(op, "window", window)
            if window < 1:
                raise InvalidArgumentError(f"{op}: window must be None or an integer >= 1, got {window}")
        self.window = window
        self.block_size = block_size
        self.n_blocks = n_blocks
        self.kv_heads = dims["kv_heads"]
        self.k_head_dim = dims["k_head_dim"] if dims["k_head_dim"] is not None else dims["head_dim"]
        self.v_head_dim = dims["v_head_dim"] if dims["v_head_dim"] is not None else dims["head_dim"]
        self.keys: mx.array | None = None  # [n_blocks, block_size, H, Dk]
        self.values: mx.array | None = None  # [n_blocks, block_size, H, Dv]
        self._ref = [0] * n_blocks
        self._key: list[Key | None] = [None] * n_blocks
        self._cached: dict[Key, list[int]] = {}
        self._reqs: dict[str, _Request] = {}
        # the request whose rows are pending (at most one: allocations are
        # refused while one is), None when none is
        self._pending: str | None = None
        # the free queue: a doubly linked list over block ids with two
        # sentinels, HEAD = n_blocks and TAIL = n_blocks + 1
        head, tail = n_blocks, n_blocks + 1
        self._next = list(range(1, n_blocks + 1)) + [0, -1]
        self._next[n_blocks - 1] = tail
        self._prev = [head] + list(range(n_blocks - 1)) + [-1, n_blocks - 1]
        self._in_free = [True] * n_blocks
        self._n_free = n_blocks

    # -- the free queue (O(1) each) ------------------------------------------------
    def _q_remove(self, b: int) -> None:
        p, n = self._prev[b], self._next[b]
        self._next[p], self._prev[n] = n, p
        self._in_free[b] = False
        self._n_free -= 1

    def _q_insert_after(self, at: int, b: int) -> None:
        n = self._next[at]
        self._next[at], self._prev[b], self._next[b], self._prev[n] = b, at, n, b
        self._in_free[b] = True
        self._n_free += 1

    def _q_popleft(self) -> int:
        b = self._next[self.n_blocks]
        self._q_remove(b)
        return b

    # -- observables ----------------------------------------------------------------
    def free_queue(self) -> tuple[int, ...]:
        """The free queue, front (taken first) to back: exactly the blocks
        of refcount 0, each once. Rule: ``kvspec.spec.prefix.free`` (the queue's
        order), ``kvspec.spec.prefix.broken_invariants`` (4)."""
        out, b, tail = [], self._next[self.n_blocks], self.n_blocks + 1
        while b != tail and len(out) <= self.n_blocks:  # bounded: a corrupted link cannot loop
            out.append(b)
            b = self._next[b]
        return tuple(out)

    def num_free(self) -> int:
        """``len(free_queue())`` in O(1). Rule: ``kvspec.spec.prefix.admit`` (the
        capacity check)."""
        return self._n_free

    def _block(self, op: str, b: Any) -> int:
        b = _check_int(op, "block", b)
        if not 0 <= b < self.n_blocks:
            raise InvalidArgumentError(f"{op}: block must be a block id in 0..{self.n_blocks - 1}, got {b}")
        return b

    def refcount(self, b: int) -> int:
        """The number of live requests whose table holds block ``b`` (never
        negative). InvalidArgumentError for an id outside ``[0, n_blocks)``.
        Rule: ``kvspec.spec.prefix.broken_invariants`` (3)."""
        return self._ref[self._block("refcount", b)]

    def key(self, b: int) -> Key | None:
        """Block ``b``'s key ``(salt, tokens)`` (the first ``(i + 1) *
        block_size`` tokens of the request that filled it as block ``i``),
        or None. InvalidArgumentError for an id outside ``[0, n_blocks)``.
        Rule: ``kvspec.spec.prefix.broken_invariants`` (1, 2)."""
        return self._key[self._block("key", b)]

    def cached(self) -> dict[Key, tuple[int, ...]]:
        """The cached map, ``key -> block ids`` (a lookup takes the first;
        duplicates follow in the order they were keyed), as a new dict.
        Rule: ``kvspec.spec.prefix.admit`` (caching full blocks), ``kvspec.spec.prefix.broken_invariants`` (2)."""
        return {k: tuple(ids) for k, ids in self._cached.items()}

    def _require(self, op: str, req: Any, live: bool | None = True) -> _Request:
        """The request named ``req`` (StateError when unknown, or when its
        liveness is not ``live``; ``live=None``: either)."""
        req = _check_req(op, req)
        r = self._reqs.get(req)
        if r is None:
            raise StateError(f"{op}: no request {req!r} (known: {sorted(self._reqs)})")
        if live is True and not r.live:
            raise StateError(f"{op}: request {req!r} is preempted (it holds no blocks); resume it first")
        if live is False and r.live:
            raise StateError(f"{op}: request {req!r} is live, not preempted")
        return r

    def table(self, req: str) -> tuple[int | None, ...]:
        """The block table of ``req`` (``()`` for a preempted request):
        position ``p``'s row lives in slot ``p % block_size`` of block
        ``table[p // block_size]``; under a sliding window the leading
        entries wholly before the window are None. StateError for an
        unknown request.
        Rule: ``kvspec.spec.prefix.broken_invariants`` (7)."""
        return tuple(self._require("table", req, live=None).table)

    def tokens(self, req: str) -> tuple[int, ...]:
        """The tokens of ``req`` (prompt, then decoded), live or preempted.
        StateError for an unknown request. Rule: ``kvspec.spec.prefix.preempt`` (a
        preempted request keeps its tokens)."""
        return tuple(self._require("tokens", req, live=None).tokens)

    def requests(self) -> dict[str, tuple[int, bool]]:
        """``req -> (n_tokens, live)`` for every known request (preempted
        ones with ``live=False``), in admission order. Rule:
        ``kvspec.spec.prefix.preempt``."""
        return {name: (len(r.tokens), r.live) for name, r in self._reqs.items()}

    def pending(self, req: str) -> tuple[int, int]:
        """``[first, last + 1)``: the positions of ``req`` allocated by the
        last admit, decode or resume whose rows :meth:`write` has not yet
        stored (an empty range ``(n, n)`` when none). StateError for an
        unknown or preempted request. Rule: ``kvspec.spec.prefix.admit`` (rows
        written for positions ``hit .. len - 1``)."""
        r = self._require("pending", req)
        return (r.written, len(r.tokens))

    def _no_pending(self, op: str) -> None:
        if self._pending is not None:
            name, r = self._pending, self._reqs[self._pending]
            raise StateError(f"{op}: request {name!r} has rows pending for positions [{r.written}, "
                             f"{len(r.tokens)}); write() them first (between an admit, decode or resume and its "
                             f"write no other request is admitted, decoded, resumed or looked up)")

    @property
    def dtype(self) -> Any:
        """The slabs' dtype (``mx.float16``, ``mx.bfloat16`` or
        ``mx.float32``), None before the first write. Rule:
        ``kvspec.spec.prefix.row_name`` (rows stored as handed in)."""
        return None if self.keys is None else self.keys.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the two slabs (0 before the first write). Rule:
        ``kvspec.spec.prefix.admit`` (``n_blocks`` blocks, fixed)."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    # -- hits ------------------------------------------------------------------------
    def _hits(self, tokens: tuple[int, ...], salt: Any) -> list[int | None]:
        """The first block of each key ``0 .. j - 1`` of the longest cached
        run (``j <= max_hit_blocks``). Under a sliding window: ``j`` is the
        highest end whose last ``hit_run`` blocks (or, below that, all) are
        cached, scanning down from the cap, and the entries before
        ``skipped_blocks(j * B)`` are None (``kvspec.spec.prefix.hit_table``)."""
        bs, out = self.block_size, []
        if self.window is not None:
            run, count, j = hit_run(self.window, bs), 0, None
            for i in range(max_hit_blocks(len(tokens), bs) - 1, -1, -1):
                if (salt, tokens[:(i + 1) * bs]) in self._cached:
                    count += 1
                    if count >= run:
                        j = i + run
                        break
                else:
                    count = 0
            if j is None:
                j = count
            lo = skipped_blocks(j * bs, self.window, bs)
            return [None] * lo + [self._cached[(salt, tokens[:(i + 1) * bs])][0] for i in range(lo, j)]
        for i in range(max_hit_blocks(len(tokens), bs)):
            ids = self._cached.get((salt, tokens[:(i + 1) * bs]))
            if not ids:
                break
            out.append(ids[0])
        return out

    def _skipped(self, n_tokens: int) -> int:
        """Leading blocks of a request of ``n_tokens`` tokens wholly before
        its next token's window (sliding window only):
        :func:`skipped_blocks`."""
        return skipped_blocks(n_tokens, self.window, self.block_size)  # type: ignore[arg-type]

    def lookup(self, tokens: Any, salt: Any = None) -> int:
        """The hit, in tokens, that admitting ``tokens`` under ``salt``
        would get now (a pure query: vLLM's ``get_computed_blocks`` without
        ``allocate_slots``): ``j * block_size`` for the largest ``j <=
        (len(tokens) - 1) // block_size`` whose keys ``0 .. j - 1`` are all
        cached. InvalidArgumentError for empty or bad tokens or a bad salt;
        StateError while a request has rows pending. Rule:
        ``kvspec.spec.prefix.lookup``, ``kvspec.spec.prefix.hit_blocks``."""
        op = "lookup"
        tokens = _check_tokens(op, tokens)
        salt = _check_salt(op, salt)
        self._no_pending(op)
        return len(self._hits(tokens, salt)) * self.block_size

    # -- allocation ------------------------------------------------------------------
    def _take(self) -> int:
        """Pop the front of the free queue; a keyed block is evicted (its
        id leaves the cached map, the key entry goes when empty, its key is
        cleared). Refcount 1."""
        b = self._q_popleft()
        key = self._key[b]
        if key is not None:
            ids = self._cached[key]
            ids.remove(b)
            if not ids:
                del self._cached[key]
            self._key[b] = None
        self._ref[b] = 1
        return b

    def _admit(self, op: str, tokens: tuple[int, ...], salt: Any) -> tuple[AdmitResult, _Request | None]:
        hits = self._hits(tokens, salt)
        need = blocks_for(len(tokens), self.block_size) - len(hits)
        available = self._n_free - sum(1 for b in hits if b is not None and self._ref[b] == 0)
        if need > available:
            return AdmitResult(False, 0, ()), None
        for b in hits:  # touch, in table order
            if b is None:
                continue
            if self._ref[b] == 0:
                self._q_remove(b)
            self._ref[b] += 1
        table = hits + [self._take() for _ in range(need)]
        hit = len(hits) * self.block_size
        return AdmitResult(True, hit, tuple(table)), _Request(list(tokens), salt, table, True, hit)

    def admit(self, req: str, tokens: Any, salt: Any = None) -> AdmitResult:
        """Admit a new request: hit its longest cached prefix, allocate the
        rest, and leave positions ``hit .. len - 1`` pending for
        :meth:`write`.

        Args:
            req: a request id (str) not known to the pool.
            tokens: the prompt, a non-empty sequence of ints >= 0.
            salt: None or an int (the extra key: blocks of another salt
                never hit).

        With ``j`` the hit in blocks (:meth:`lookup`), ``need =
        ceil(len / block_size) - j`` blocks are taken from the front of the
        free queue; ``available`` is the free queue's length less the hit
        blocks of refcount 0 in it. ``need > available``: returns
        ``AdmitResult(False, 0, ())`` and nothing changes (vLLM returns
        None). Else the hit blocks are touched in table order (refcount + 1,
        taken out of the free queue at 0), then ``need`` blocks are popped
        from the front one by one, each keyed one evicted (its key leaves
        the cached map and the block). Returns ``AdmitResult(True, j *
        block_size, table)``.

        Raises InvalidArgumentError (nothing changes) for a bad id, empty or
        bad tokens, a bad salt or a request already live; StateError for a
        preempted request (use :meth:`resume`) or while a request has rows
        pending. Rule: ``kvspec.spec.prefix.admit``, ``kvspec.spec.prefix.hit_blocks``.
        """
        op = "admit"
        req = _check_req(op, req)
        tokens = _check_tokens(op, tokens)
        salt = _check_salt(op, salt)
        r = self._reqs.get(req)
        if r is not None and r.live:
            raise InvalidArgumentError(f"{op}: request {req!r} is already admitted (live); free it first")
        if r is not None:
            raise StateError(f"{op}: request {req!r} is preempted; resume it (its tokens and salt are kept)")
        self._no_pending(op)
        res, new = self._admit(op, tokens, salt)
        if new is not None:
            self._reqs[req], self._pending = new, req
        return res

    def resume(self, req: str) -> AdmitResult:
        """Re-admit a preempted request with its tokens (prompt and decoded)
        and salt, as :meth:`admit` would (same hit, capacity and eviction
        rules, same result). Not admitted: it stays preempted, nothing
        changes. StateError (nothing changes) for an unknown or live
        request or while a request has rows pending. Rule:
        ``kvspec.spec.prefix.resume``."""
        op = "resume"
        r = self._require(op, req, live=False)
        self._no_pending(op)
        res, new = self._admit(op, tuple(r.tokens), r.salt)
        if new is not None:
            self._reqs[req], self._pending = new, req
        return res

    def decode(self, req: str, tokens: Any) -> bool:
        """Append ``tokens`` (usually one; several: a speculative or verify
        block) to a live request, allocating ``need = ceil(new_len /
        block_size) - len(table)`` blocks from the front of the free queue
        (evicting keyed ones); the new positions are pending for
        :meth:`write`.

        Under a sliding window the blocks wholly before the first new
        token's window (entries below ``skipped_blocks(len)``, down to the
        first None) are released first, highest first, as :meth:`free`
        releases, and ``need`` is checked against the queue after that
        release; a refused decode releases nothing (``kvspec.spec.prefix.decode``).

        Returns False (nothing changes) when ``need`` exceeds the free
        queue's length. Raises StateError (nothing changes) for an unknown
        or preempted request or while a request has rows pending;
        InvalidArgumentError for empty or bad tokens. Rule:
        ``kvspec.spec.prefix.decode``."""
        op = "decode"
        req = _check_req(op, req)
        tokens = _check_tokens(op, tokens)
        r = self._require(op, req)
        self._no_pending(op)
        need = blocks_for(len(r.tokens) + len(tokens), self.block_size) - len(r.table)
        lo = hi = 0
        if self.window is not None:
            hi = min(self._skipped(len(r.tokens)), len(r.table))
            lo = hi
            while lo > 0 and r.table[lo - 1] is not None:
                lo -= 1
        gain = sum(1 for i in range(lo, hi) if self._ref[r.table[i]] == 1)  # type: ignore[index]
        if need > self._n_free + gain:
            return False
        if lo < hi:
            self._release_blocks(r.table[hi - 1:lo - 1 if lo else None:-1])
            r.table[lo:hi] = [None] * (hi - lo)
        r.table += [self._take() for _ in range(need)]
        r.tokens += tokens
        self._pending = req
        return True

    # -- rows ------------------------------------------------------------------------
    def _check_write_rows(self, op: str, keys: Any, values: Any, n: int) -> None:
        for name, a in (("keys", keys), ("values", values)):
            if not isinstance(a, mx.array):
                raise InvalidArgumentError(f"{op}: {name} must be an mx.array [n, H, D], got {type(a).__name__}")
            if a.ndim != 3:
                raise InvalidArgumentError(f"{op}: {name} must have rank 3 [n, H, D], got shape {tuple(a.shape)}")
            if a.dtype not in _FLOATS:
                raise InvalidArgumentError(f"{op}: {name} dtype must be float16, bfloat16 or float32, got {a.dtype}")
            if a.shape[0] != n:
                raise InvalidArgumentError(f"{op}: {name} must hold one row per pending position (n = {n}), "
                                           f"got shape {tuple(a.shape)}")
        if keys.dtype != values.dtype:
            raise InvalidArgumentError(f"{op}: keys and values must share a dtype, got {keys.dtype} and "
                                       f"{values.dtype}")
        if keys.shape[1] != values.shape[1]:
            raise InvalidArgumentError(f"{op}: keys and values must have the same kv heads H, got "
                                       f"{keys.shape[1]} and {values.shape[1]}")
        if self.keys is not None:
            want = ((self.keys.shape[2], self.keys.shape[3]), (self.values.shape[2], self.values.shape[3]))
            dtype = self.keys.dtype
        else:
            want = ((self.kv_heads, self.k_head_dim), (self.kv_heads, self.v_head_dim))
            dtype = None
        for name, a, (h, d) in (("keys", keys, want[0]), ("values", values, want[1])):
            if (h is not None and a.shape[1] != h) or (d is not None and a.shape[2] != d):
                raise InvalidArgumentError(f"{op}: {name} must be [n, H, D] with [H, D] = [{h}, {d}] (the pool's), "
                                           f"got shape {tuple(a.shape)}")
        if dtype is not None and keys.dtype != dtype:
            raise InvalidArgumentError(f"{op}: keys and values dtype must be the pool's {dtype} (fixed by the first "
                                       f"write), got {keys.dtype}")

    def write(self, req: str, keys: mx.array, values: mx.array) -> None:
        """Store the rows of ``req``'s pending positions, then key every
        block they filled.

        Args:
            req: a live request with pending positions ``[w, n)``
                (:meth:`pending`).
            keys: ``mx.array`` ``[n - w, H, Dk]``; values: ``[n - w, H,
                Dv]``; float16, bfloat16 or float32, one dtype; row ``k`` is
                position ``w + k``.

        The first write allocates the slabs (zeros, in the rows' dtype and
        shape); later writes must match them. Position ``p``'s row goes to
        slot ``p % block_size`` of block ``table[p // block_size]``; the
        slots after the last row in its block are zeroed (an unwritten slot
        of a held block reads zeros, never a former holder's row). Then
        each block ``i`` with ``w < (i + 1) * block_size <= n`` gets the key
        ``(salt, tokens[:(i + 1) * block_size])``, appended to the cached
        map in block order (after any block already under it: a
        duplicate); under ``window == 1`` none is keyed
        (``kvspec.spec.prefix.window_keys``).

        Raises StateError (nothing changes) for an unknown or preempted
        request or one without pending positions; InvalidArgumentError for
        rows of another count, rank, shape or dtype. Rule:
        ``kvspec.spec.prefix.admit`` and ``kvspec.spec.prefix.decode`` (rows written,
        full blocks cached), ``kvspec.spec.prefix.row_name``.
        """
        op = "write"
        r = self._require(op, req)
        w, n = r.written, len(r.tokens)
        if w == n:
            raise StateError(f"{op}: request {req!r} has no pending positions (admit, decode or resume first)")
        self._check_write_rows(op, keys, values, n - w)
        if self.keys is None:
            h = keys.shape[1]
            self.keys = mx.zeros((self.n_blocks, self.block_size, h, keys.shape[2]), dtype=keys.dtype)
            self.values = mx.zeros((self.n_blocks, self.block_size, h, values.shape[2]), dtype=values.dtype)
        bs = self.block_size
        last = blocks_for(n, bs) - 1
        for i in range(w // bs, last + 1):
            lo, hi = max(w, i * bs), min(n, (i + 1) * bs)
            k, v = keys[lo - w:hi - w], values[lo - w:hi - w]
            end = hi - i * bs
            if i == last and end < bs:  # zero the rest of the tail block
                k = mx.concatenate([k, mx.zeros((bs - end,) + tuple(k.shape[1:]), dtype=k.dtype)])
                v = mx.concatenate([v, mx.zeros((bs - end,) + tuple(v.shape[1:]), dtype=v.dtype)])
                end = bs
            at = (r.table[i], slice(lo - i * bs, end))
            self.keys = write_copy(self.keys, k, at)
            self.values = write_copy(self.values, v, at)
        mx.eval(self.keys, self.values)
        r.written, self._pending = n, None
        tokens = tuple(r.tokens)
        for i in range(w // bs, n // bs if self.window != 1 else 0):
            key = (r.salt, tokens[:(i + 1) * bs])
            b = r.table[i]
            self._key[b] = key
            self._cached.setdefault(key, []).append(b)

    def fetch(self, req: str) -> tuple[mx.array, mx.array]:
        """K and V of positions ``[start, len)`` of ``req``, gathered through
        its table (``start``: :meth:`first_position`, 0 under full
        attention): ``[len - start, H, Dk]`` and ``[len - start, H, Dv]`` in
        the pool's dtype,
        evaluated into their own memory (no slab aliased). StateError for
        an unknown or preempted request or one with pending positions.
        Rule: ``kvspec.spec.prefix.broken_invariants`` (5: every live request
        reads its rows)."""
        op = "fetch"
        r = self._require(op, req)
        if r.written < len(r.tokens):
            raise StateError(f"{op}: request {req!r} has rows pending for positions [{r.written}, "
                             f"{len(r.tokens)}); write() them first")
        bs, n = self.block_size, len(r.tokens)
        start = self.first_position(req)
        p = np.arange(start, n)
        held = np.asarray(r.table[start // bs:], dtype=np.int64)
        idx = mx.array(held[p // bs - start // bs] * bs + p % bs, dtype=mx.int32)
        out = []
        for slab in (self.keys, self.values):
            flat = slab.reshape((self.n_blocks * bs,) + tuple(slab.shape[2:]))
            out.append(mx.take(flat, idx, axis=0))
        mx.eval(*out)
        return out[0], out[1]

    def first_position(self, req: str) -> int:
        """The first position whose row ``req``'s table still holds: ``B``
        times its leading None entries (0 under full attention).
        StateError for an unknown request. Rule:
        ``kvspec.spec.prefix.requests_read_their_rows``."""
        r = self._require("first_position", req, live=None)
        nulls = 0
        while nulls < len(r.table) and r.table[nulls] is None:
            nulls += 1
        return nulls * self.block_size

    def block_rows(self, b: int) -> tuple[mx.array, mx.array]:
        """The K and V rows of block ``b``: ``[block_size, H, Dk]`` and
        ``[block_size, H, Dv]`` in the pool's dtype (new arrays, evaluated:
        float16 and float32 copied through NumPy's view of the slabs, with
        no round trip to MLX's scheduler; bfloat16, which NumPy lacks,
        gathered by MLX). What a slot of a free unkeyed block holds is
        unspecified; an unwritten slot of a held
        block reads zeros. InvalidArgumentError for an id outside ``[0,
        n_blocks)``; StateError before the first write. Rule:
        ``kvspec.spec.prefix.broken_invariants`` (1: a keyed block holds the rows
        its key names)."""
        op = "block_rows"
        b = self._block(op, b)
        if self.keys is None:
            raise StateError(f"{op}: the pool holds no rows yet (the first write allocates the slabs)")
        if self.keys.dtype in _HOST_COPIED:  # K and V share the dtype (write refuses otherwise)
            # copied through NumPy's view of the evaluated slabs: new evaluated arrays without a round
            # trip to MLX's scheduler (a block read is an inspection, not the decoder's gather)
            return mx.array(np.asarray(self.keys)[b]), mx.array(np.asarray(self.values)[b])
        at = mx.array(b)  # a scalar index: one gather per slab, the block axis dropped
        k, v = mx.take(self.keys, at, axis=0), mx.take(self.values, at, axis=0)
        mx.eval(k, v)
        return k, v

    # -- release ---------------------------------------------------------------------
    def _release(self, r: _Request) -> None:
        """Release ``r``'s table tail first (:meth:`_release_blocks`; its
        None entries skipped) and empty it."""
        self._release_blocks([b for b in reversed(r.table) if b is not None])
        r.table = []

    def _release_blocks(self, order: list[int]) -> None:
        """Release ``order``, first to last: refcount - 1; a block reaching
        0 joins the free queue, keyed at the back (so a prefix's root, the
        last released, is evicted last), unkeyed at the front (the unkeyed
        blocks of one release keep their release order there)."""
        front = self.n_blocks  # insert unkeyed blocks after this one
        for b in order:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._key[b] is not None:
                    self._q_insert_after(self._prev[self.n_blocks + 1], b)
                else:
                    self._q_insert_after(front, b)
                    front = b

    def free(self, req: str) -> None:
        """Release a live request's blocks (:meth:`_release`'s order: the
        table tail first; keyed blocks reaching refcount 0 to the back of
        the free queue, unkeyed ones to the front) and forget the request.
        A request with pending positions may be freed (its unwritten blocks
        carry no key). StateError (nothing changes) for an unknown or
        preempted request (a double free is refused). Rule:
        ``kvspec.spec.prefix.free``."""
        r = self._require("free", req)
        self._release(r)
        del self._reqs[req]
        if self._pending == req:
            self._pending = None

    def preempt(self, req: str) -> None:
        """As :meth:`free`, but the request stays known, preempted
        (``live=False``, no table), with its tokens (prompt and decoded)
        and salt for :meth:`resume`; its pending positions, if any, stay
        among its tokens (resume recomputes them). StateError (nothing
        changes) for an unknown or preempted request. Rule:
        ``kvspec.spec.prefix.preempt``."""
        r = self._require("preempt", req)
        self._release(r)
        r.live, r.written = False, 0
        if self._pending == req:
            self._pending = None

    def free_blocks(self, blocks: Any) -> None:
        """The pool's own release of blocks by id (vLLM's
        ``BlockPool.free_blocks``), for probing the double-free guard. Every
        held block is held by a live table here, so every call is refused
        (nothing changes): InvalidArgumentError for a non-sequence, an empty
        list, an id that is not an int in ``[0, n_blocks)`` or a block
        listed twice; StateError for a block of refcount 0 (a double free)
        or one a live table holds (its holder would lose it). Rule:
        ``kvspec.spec.prefix.free_blocks``."""
        op = "free_blocks"
        if isinstance(blocks, (str, bytes)) or not isinstance(blocks, (tuple, list)) or not blocks:
            raise InvalidArgumentError(f"{op}: blocks must be a non-empty list of block ids, got {blocks!r}")
        for b in blocks:
            if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 0 <= b < self.n_blocks:
                raise InvalidArgumentError(f"{op}: blocks must be block ids in 0..{self.n_blocks - 1}, got {b!r}")
        ids = [int(b) for b in blocks]
        seen: set[int] = set()
        for b in ids:
            if b in seen:
                raise InvalidArgumentError(f"{op}: block {b} is listed twice (its refcount would fall twice)")
            seen.add(b)
        for b in ids:
            if self._ref[b] == 0:
                raise StateError(f"{op}: block {b} has refcount 0 (it is free already: a double free)")
        b = ids[0]
        holders = sorted(name for name, r in self._reqs.items() if b in r.table)
        raise StateError(f"{op}: block {b} is held by request(s) {holders} (refcount {self._ref[b]}); only "
                         f"free(req) releases a table's blocks")

    def reset(self) -> bool:
        """vLLM's ``reset_prefix_cache``: when no block is held (every
        refcount 0), drop every key (the cached map empties, every block's
        key is None; rows and the free queue's order stay) and return True;
        else return False and change nothing. Preempted requests stay
        known. Rule: ``kvspec.spec.prefix.reset``."""
        if any(self._ref):
            return False
        self._key = [None] * self.n_blocks
        self._cached = {}
        return True

    # -- copies and checks -----------------------------------------------------------
    def copy(self) -> PrefixCachePool:
        """An independent copy: its own slabs (copied, evaluated), refcounts,
        keys, cached map, free queue and requests; nothing is shared, so an
        op on either leaves the other as it was. Rule: ``kvspec.spec.prefix.apply_op``
        (a world is a value)."""
        new = PrefixCachePool.__new__(type(self))
        new.__dict__.update(self.__dict__)
        if self.keys is not None and self.keys.dtype in _HOST_COPIED:  # K and V share the dtype
            # copied through NumPy's view of the evaluated slabs (no round trip to MLX's scheduler)
            new.keys, new.values = mx.array(np.asarray(self.keys)), mx.array(np.asarray(self.values))
        elif self.keys is not None:
            new.keys, new.values = mx.array(self.keys), mx.array(self.values)
            mx.eval(new.keys, new.values)
        new._ref, new._key = list(self._ref), list(self._key)
        new._cached = {k: list(ids) for k, ids in self._cached.items()}
        new._reqs = {name: r.clone() for name, r in self._reqs.items()}
        new._next, new._prev, new._in_free = list(self._next), list(self._prev), list(self._in_free)
        return new

    def broken_invariants(self) -> tuple[str, ...]:
        """The metadata invariants this pool breaks (empty: none), each a
        message that starts with the name of the spec's invariant
        (``kvspec.spec.prefix.broken_invariants``) and names the block or request:
        ``keys_name_contents`` (a key names whole blocks; the rows
        themselves are compared by the tests, which name them),
        ``cached_map_exact``, ``refcounts_match_tables``,
        ``free_queue_exact`` (the links, count and membership agree too),
        ``partial_tail_private``, ``tables_sized``, ``full_blocks_keyed``
        (every written full block of a live request is under its own key);
        and the pool's own ``pending_rows`` (at most one request has rows
        pending, the one the pool records). Rule:
        ``kvspec.spec.prefix.broken_invariants``."""
        bs, out = self.block_size, []
        holders = [0] * self.n_blocks
        for name, r in self._reqs.items():
            if not r.live:
                if r.table:
                    out.append(f"refcounts_match_tables: request {name!r} is preempted but holds {r.table}")
                continue
            held = [b for b in r.table if b is not None]
            if len(set(held)) != len(held):
                out.append(f"refcounts_match_tables: request {name!r}'s table {r.table} holds a block twice")
            nulls = len(r.table) - len(held)
            if any(b is None for b in r.table[nulls:]) or (nulls and (self.window is None or nulls > skipped_blocks(
                    len(r.tokens), self.window, bs))):
                out.append(f"requests_read_their_rows: request {name!r}'s table {r.table} has None entries that "
                           f"are not leading blocks wholly before its window")
            if len(r.table) != blocks_for(len(r.tokens), bs):
                out.append(f"tables_sized: request {name!r} has a table of {len(r.table)} blocks for "
                           f"{len(r.tokens)} tokens")
            for i, b in enumerate(r.table):
                if b is None:
                    continue
                holders[b] += 1
                want = (r.salt, tuple(r.tokens[:(i + 1) * bs])) if self.window != 1 else None
                if i < r.written // bs and self._key[b] != want:
                    out.append(f"full_blocks_keyed: block {b} (request {name!r}'s block {i}) has key "
                               f"{self._key[b]!r}, not {want!r}")
            if len(r.tokens) % bs and r.table:
                b = r.table[-1]
                if self._ref[b] != 1 or self._key[b] is not None:
                    out.append(f"partial_tail_private: block {b} holds request {name!r}'s partial tail but has "
                               f"refcount {self._ref[b]} and key {self._key[b]!r}")
        seen: dict[int, Key] = {}
        for key, ids in self._cached.items():
            if not ids:
                out.append(f"cached_map_exact: cached key {key!r} lists no block")
            for b in ids:
                if b in seen:
                    out.append(f"cached_map_exact: block {b} is listed twice ({seen[b]!r} and {key!r})")
                seen[b] = key
                if self._key[b] != key:
                    out.append(f"cached_map_exact: cached key {key!r} lists block {b}, whose key is "
                               f"{self._key[b]!r}")
            if len(key[1]) < bs or len(key[1]) % bs:
                out.append(f"keys_name_contents: cached key {key!r} does not name whole blocks")
        for b in range(self.n_blocks):
            if self._ref[b] != holders[b]:
                out.append(f"refcounts_match_tables: block {b} has refcount {self._ref[b]} but {holders[b]} "
                           f"live holders")
            if self._key[b] is not None and b not in seen:
                out.append(f"cached_map_exact: block {b} has key {self._key[b]!r} but is not in the cached map")
        queue = self.free_queue()
        if len(queue) != len(set(queue)) or set(queue) != {b for b in range(self.n_blocks) if self._ref[b] == 0}:
            out.append(f"free_queue_exact: free queue {list(queue)} is not the blocks of refcount 0, each once")
        pending = {name for name, r in self._reqs.items() if r.live and r.written < len(r.tokens)}
        if pending != ({self._pending} if self._pending is not None else set()):
            out.append(f"pending_rows: requests with rows pending {sorted(pending)} but the pool records "
                       f"{self._pending!r}")
        members = set(queue)
        if len(queue) != self._n_free or any(self._in_free[b] != (b in members) for b in range(self.n_blocks)):
            out.append("free_queue_exact: the queue's count or membership flags disagree with its links")
        return tuple(out)
