"""kvspec.impl.prefix: PrefixCachePool, each op and each refusal (a refusal leaves
every field and both slabs as they were), rows named by ``(salt, tokens[:p +
1])`` and read back through tables, shared prefix blocks and the slabs
(float16, bfloat16 bit for bit, float32; K and V head dims that differ),
eviction, duplicate keys, the free queue's order, a pool of one block, block
size 1, copies that share nothing, and a seeded differential loop against
``kvspec.spec.prefix`` comparing every result, refusal and observable."""

from __future__ import annotations

import hashlib
import random

import mlx.core as mx
import numpy as np
import pytest

from kvspec.impl.prefix import AdmitResult, PrefixCachePool
from kvspec.spec import prefix as spec
from kvspec.spec.errors import InvalidArgumentError, KVCacheError, StateError

H, DK, DV = 2, 4, 3
DTYPES = ("float16", "bfloat16", "float32")


def host(a: mx.array) -> np.ndarray:
    """A NumPy copy of ``a`` (bfloat16 as its uint16 bit pattern)."""
    if a.dtype == mx.bfloat16:
        a = mx.view(a, mx.uint16)
    mx.eval(a)
    return np.array(a, copy=True)


class Named:
    """A pool driven as the lockstep drives it: each admit, decode and resume
    is followed by the write of its pending rows, each row a deterministic
    function of its name ``(salt, tokens[:p + 1])`` (K and V differ), and
    rows are named back from their bytes."""

    def __init__(self, block_size: int, n_blocks: int, dtype: str = "float32", dk: int = DK, dv: int = DV,
                 **kw):
        self.pool = PrefixCachePool(block_size, n_blocks, **kw)
        self.dtype, self.dk, self.dv = getattr(mx, dtype), dk, dv
        self.salt: dict[str, object] = {}
        self.names: dict[tuple[str, bytes], tuple] = {}

    def rows(self, salt, tokens, lo: int, hi: int) -> tuple[mx.array, mx.array]:
        """K ``[hi - lo, H, dk]`` and V ``[hi - lo, H, dv]`` of positions
        ``[lo, hi)``; their bytes are recorded for :meth:`name`."""
        out = []
        for which, d in (("k", self.dk), ("v", self.dv)):
            raw = []
            for p in range(lo, hi):
                name = spec.row_name(salt, tuple(tokens), p)
                seed = int.from_bytes(hashlib.sha256(repr((which, name)).encode()).digest()[:8], "little")
                raw.append(np.random.default_rng(seed).uniform(0.5, 2.0, (H, d)).astype(np.float32))
            a = mx.array(np.stack(raw)).astype(self.dtype)
            for p, r in zip(range(lo, hi), host(a), strict=True):
                self.names[(which, r.tobytes())] = spec.row_name(salt, tuple(tokens), p)
            out.append(a)
        return out[0], out[1]

    def name(self, which: str, row: np.ndarray):
        """The name of a row read back; None for zeros (never written)."""
        if not row.any():
            return None
        return self.names.get((which, row.tobytes()), ("unknown row", row.tobytes()))

    def write_pending(self, req: str) -> None:
        lo, hi = self.pool.pending(req)
        self.pool.write(req, *self.rows(self.salt[req], self.pool.tokens(req), lo, hi))

    def admit(self, req, tokens, salt=None) -> AdmitResult:
        res = self.pool.admit(req, tokens, salt)
        if res.admitted:
            self.salt[req] = salt
            self.write_pending(req)
        return res

    def decode(self, req, tokens) -> bool:
        ok = self.pool.decode(req, tokens)
        if ok:
            self.write_pending(req)
        return ok

    def resume(self, req) -> AdmitResult:
        res = self.pool.resume(req)
        if res.admitted:
            self.write_pending(req)
        return res

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def block_names(self, b: int) -> list:
        k, v = (host(a) for a in self.pool.block_rows(b))
        out = []
        for s in range(self.pool.block_size):
            nk, nv = self.name("k", k[s]), self.name("v", v[s])
            out.append(nk if nk == nv else ("K/V differ", nk, nv))
        return out

    def fetch_names(self, req: str) -> list:
        k, v = (host(a) for a in self.pool.fetch(req))
        out = []
        for p in range(k.shape[0]):
            nk, nv = self.name("k", k[p]), self.name("v", v[p])
            out.append(nk if nk == nv else ("K/V differ", nk, nv))
        return out

    def observe(self) -> dict:
        """The spec's observable view (``kvspec.spec.prefix.observe``), read back."""
        pool = self.pool
        blocks = [(pool.refcount(b), pool.key(b)) for b in range(pool.n_blocks)]
        rows = {}
        slabs = None if pool.keys is None else (host(pool.keys), host(pool.values))  # one read of each slab
        for b, (ref, key) in enumerate(blocks):
            if ref > 0 or key is not None:
                for s in range(pool.block_size):
                    nk, nv = self.name("k", slabs[0][b, s]), self.name("v", slabs[1][b, s])
                    rows[(b, s)] = nk if nk == nv else ("K/V differ", nk, nv)
        return {
            "requests": {r: {"table": list(pool.table(r)), "tokens": n, "live": live}
                         for r, (n, live) in pool.requests().items()},
            "blocks": blocks,
            "free": list(pool.free_queue()),
            "cached": {k: list(ids) for k, ids in pool.cached().items()},
            "rows": rows,
        }


def snapshot(pool: PrefixCachePool) -> dict:
    """Every field of the pool: metadata (the free queue's links included)
    and the slabs' bytes."""
    return {
        "ref": list(pool._ref), "key": list(pool._key), "cached": pool.cached(),
        "cached_order": [list(ids) for ids in pool._cached.values()],
        "reqs": {n: (list(r.tokens), r.salt, list(r.table), r.live, r.written) for n, r in pool._reqs.items()},
        "links": (list(pool._next), list(pool._prev), list(pool._in_free), pool._n_free),
        "free": pool.free_queue(), "pending": pool._pending,
        "slabs": None if pool.keys is None else (pool.keys.dtype, host(pool.keys).tobytes(),
                                                 pool.values.dtype, host(pool.values).tobytes()),
    }


def refused(pool: PrefixCachePool, exc, fn, *args, match: str | None = None):
    """``fn(*args)`` raises ``exc`` (matching ``match``) and changes nothing."""
    before = snapshot(pool)
    with pytest.raises(exc, match=match):
        fn(*args)
    assert snapshot(pool) == before


def names(salt, tokens, lo: int, hi: int) -> list:
    return [spec.row_name(salt, tuple(tokens), p) for p in range(lo, hi)]


# -- construction -------------------------------------------------------------------------


@pytest.mark.parametrize("args, kw, match", [
    ((0, 4), {}, "block_size must be >= 1"),
    ((2, 0), {}, "n_blocks must be >= 1"),
    ((2.0, 4), {}, "block_size must be an integer"),
    ((2, True), {}, "n_blocks must be an integer"),
    ((2, 4, 0), {}, "kv_heads must be None or >= 1"),
    ((2, 4, 2, "8"), {}, "head_dim must be an integer"),
    ((2, 4), {"v_head_dim": 0}, "v_head_dim must be None or >= 1"),
])
def test_construction_refusals(args, kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        PrefixCachePool(*args, **kw)


def test_a_fresh_pool():
    pool = PrefixCachePool(4, 5)
    assert pool.free_queue() == (0, 1, 2, 3, 4) and pool.num_free() == 5
    assert pool.cached() == {} and pool.requests() == {} and pool.broken_invariants() == ()
    assert [pool.refcount(b) for b in range(5)] == [0] * 5 and [pool.key(b) for b in range(5)] == [None] * 5
    assert pool.dtype is None and pool.nbytes == 0
    refused(pool, StateError, pool.block_rows, 0, match="no rows yet")
    for fn in (pool.refcount, pool.key, pool.block_rows):
        refused(pool, InvalidArgumentError, fn, 5, match=r"block id in 0\.\.4")
        refused(pool, InvalidArgumentError, fn, -1)
    for fn in (pool.table, pool.tokens, pool.pending, pool.fetch, pool.free, pool.preempt, pool.resume):
        refused(pool, StateError, fn, "x", match="no request 'x'")


# -- admit, write, keys -------------------------------------------------------------------


def test_admit_allocates_writes_then_keys_full_blocks():
    t = Named(2, 6)
    pool = t.pool
    res = pool.admit("a", [1, 2, 3, 4, 5])
    assert res == AdmitResult(True, 0, (0, 1, 2))
    assert pool.pending("a") == (0, 5) and pool.free_queue() == (3, 4, 5)
    assert pool.cached() == {} and pool.key(0) is None  # no key before the rows are written
    assert [pool.refcount(b) for b in range(6)] == [1, 1, 1, 0, 0, 0]
    t.salt["a"] = None
    t.write_pending("a")
    assert pool.pending("a") == (5, 5)
    assert pool.cached() == {(None, (1, 2)): (0,), (None, (1, 2, 3, 4)): (1,)}
    assert pool.key(2) is None  # the partial tail is never keyed
    assert t.fetch_names("a") == names(None, [1, 2, 3, 4, 5], 0, 5)
    assert t.block_names(2) == names(None, [1, 2, 3, 4, 5], 4, 5) + [None]
    assert pool.requests() == {"a": (5, True)} and pool.broken_invariants() == ()
    assert pool.dtype == mx.float32 and pool.keys.shape == (6, 2, H, DK) and pool.values.shape == (6, 2, H, DV)
    assert pool.nbytes == 6 * 2 * H * (DK + DV) * 4


def test_a_hit_shares_the_prefix_blocks_and_fetch_reads_through_them():
    t = Named(2, 8)
    t.admit("a", [1, 2, 3, 4, 5])
    res = t.admit("b", [1, 2, 3, 4, 9, 9, 7])
    assert res == AdmitResult(True, 4, (0, 1, 3, 4))
    assert t.pending("b") == (7, 7)
    assert [t.refcount(b) for b in range(5)] == [2, 2, 1, 1, 1]
    assert t.fetch_names("b") == names(None, [1, 2, 3, 4, 9, 9, 7], 0, 7)
    assert t.fetch_names("a") == names(None, [1, 2, 3, 4, 5], 0, 5)
    assert t.cached()[(None, (1, 2, 3, 4, 9, 9))] == (3,)
    assert t.lookup([1, 2, 3, 4, 9, 9, 7]) == 6 and t.lookup([1, 2, 3]) == 2 and t.lookup([5]) == 0
    assert t.lookup([1, 2, 3], salt=1) == 0  # another salt never hits
    assert t.broken_invariants() == ()


def test_the_hit_stops_one_token_short_and_a_whole_prompt_match_duplicates_its_key():
    t = Named(2, 6)
    t.admit("a", [1, 2, 3])
    assert t.lookup([1, 2]) == 0 and t.lookup([1, 2, 3]) == 2
    res = t.admit("b", [1, 2])  # (2 - 1) // 2 = 0 blocks may hit: the last token is recomputed
    assert res == AdmitResult(True, 0, (2,))
    assert t.cached()[(None, (1, 2))] == (0, 2)  # a duplicate, after the first
    res = t.admit("c", [1, 2, 7])
    assert res.table[0] == 0 and res.hit_tokens == 2  # a lookup takes the first
    assert t.broken_invariants() == ()


def test_salted_requests_never_share():
    t = Named(2, 6)
    t.admit("a", [1, 2, 3], salt=1)
    assert t.lookup([1, 2, 3], salt=1) == 2 and t.lookup([1, 2, 3]) == 0 and t.lookup([1, 2, 3], salt=0) == 0
    res = t.admit("b", [1, 2, 3], salt=0)
    assert res.hit_tokens == 0 and set(res.table).isdisjoint({0, 1})
    assert t.cached() == {(1, (1, 2)): (0,), (0, (1, 2)): (2,)}
    assert t.fetch_names("b") == names(0, [1, 2, 3], 0, 3) and t.fetch_names("a") == names(1, [1, 2, 3], 0, 3)


def test_admit_refusals_change_nothing():
    t = Named(2, 4)
    t.admit("a", [1, 2, 3])
    t.preempt("a")
    t.admit("b", [1, 2])
    pool = t.pool
    for args, exc, match in [
        (("c", []), InvalidArgumentError, "at least one token|non-empty"),
        (("c", [1, -1]), InvalidArgumentError, "integers >= 0"),
        (("c", [1, True]), InvalidArgumentError, "integers >= 0"),
        (("c", [1, 2.0]), InvalidArgumentError, "integers >= 0"),
        (("c", "12"), InvalidArgumentError, "list of token ids"),
        (("c", None), InvalidArgumentError, "list of token ids"),
        ((3, [1]), InvalidArgumentError, "req must be a request id"),
        (("c", [1], -1), InvalidArgumentError, "salt must be None or an integer >= 0"),
        (("c", [1], "s"), InvalidArgumentError, "salt must be None"),
        (("c", [1], True), InvalidArgumentError, "salt must be None"),
        (("b", [5]), InvalidArgumentError, "already admitted"),
        (("a", [5]), StateError, "preempted; resume it"),
    ]:
        refused(pool, exc, pool.admit, *args, match=match)


def test_a_refused_admit_that_would_have_evicted_changes_nothing():
    t = Named(1, 3)
    t.admit("a", [1, 2, 3])
    t.free("a")
    assert t.free_queue() == (2, 1, 0) and len(t.cached()) == 3
    before = snapshot(t.pool)
    assert t.admit("b", [5, 6, 7, 8]) == AdmitResult(False, 0, ())  # 4 blocks > 3 free
    assert snapshot(t.pool) == before
    # every free block is a hit: touching them leaves none to allocate the last token's block
    assert t.lookup([1, 2, 3, 4]) == 3
    assert t.admit("c", [1, 2, 3, 4]) == AdmitResult(False, 0, ())
    assert snapshot(t.pool) == before
    assert t.admit("c", [1, 2, 3]) == AdmitResult(True, 2, (0, 1, 2))  # the third block evicted and refilled
    assert t.cached()[(None, (1, 2, 3))] == (2,) and t.free_queue() == ()
    assert t.fetch_names("c") == names(None, [1, 2, 3], 0, 3) and t.broken_invariants() == ()


# -- the free queue, eviction --------------------------------------------------------------


def test_free_releases_the_tail_first_keyed_to_the_back_unkeyed_to_the_front():
    t = Named(2, 6)
    t.admit("a", [1, 2, 3, 4, 5])
    assert t.free_queue() == (3, 4, 5)
    t.free("a")
    assert t.free_queue() == (2, 3, 4, 5, 1, 0)  # a prefix's root is evicted last
    assert t.requests() == {} and [t.refcount(b) for b in range(6)] == [0] * 6
    assert t.cached() == {(None, (1, 2)): (0,), (None, (1, 2, 3, 4)): (1,)}  # cached-free blocks keep their keys
    refused(t.pool, StateError, t.pool.free, "a", match="no request ")  # a double free
    assert t.broken_invariants() == ()


def test_several_unkeyed_blocks_of_one_release_keep_release_order_at_the_front():
    pool = PrefixCachePool(1, 5)
    pool.admit("a", [1, 2, 3])  # freed before its write: no block is keyed (an aborted request)
    pool.free("a")
    assert pool.free_queue() == (2, 1, 0, 3, 4) and pool.cached() == {}
    assert pool.broken_invariants() == ()


def test_a_shared_block_joins_the_queue_when_its_last_holder_goes():
    t = Named(2, 6)
    t.admit("a", [1, 2, 3])
    t.admit("b", [1, 2, 4])
    assert t.table("b") == (0, 2) and t.refcount(0) == 2
    t.free("a")
    assert t.refcount(0) == 1 and t.free_queue() == (1, 3, 4, 5)
    t.free("b")
    assert t.free_queue() == (2, 1, 3, 4, 5, 0)


def test_a_hit_on_a_cached_free_block_takes_it_out_of_the_queue():
    t = Named(2, 6)
    t.admit("a", [1, 2, 3, 4, 5])
    t.free("a")
    res = t.admit("b", [1, 2, 3, 4, 6])
    assert res == AdmitResult(True, 4, (0, 1, 2))
    assert t.free_queue() == (3, 4, 5)
    assert [t.refcount(b) for b in range(3)] == [1, 1, 1]
    assert t.fetch_names("b") == names(None, [1, 2, 3, 4, 6], 0, 5)
    assert t.broken_invariants() == ()


def test_eviction_drops_the_key_and_a_later_lookup_misses():
    t = Named(2, 6)
    t.admit("a", [1, 2, 3, 4, 5])
    t.free("a")  # queue 2 3 4 5 1 0
    t.admit("b", [7, 8, 9, 10, 11, 12, 13])  # pops 2 3 4 5
    assert t.free_queue() == (1, 0)
    res = t.admit("c", [7, 8, 1])  # hits b's root, pops 1: (1, 2, 3, 4) evicted
    assert res == AdmitResult(True, 2, (2, 1))
    assert (None, (1, 2, 3, 4)) not in t.cached() and t.key(1) is None
    assert t.lookup([1, 2, 3, 4, 5]) == 2  # the root is still cached
    assert t.fetch_names("c") == names(None, [7, 8, 1], 0, 3)
    assert t.block_names(1) == names(None, [7, 8, 1], 2, 3) + [None]  # a reused block reads no former row
    assert t.broken_invariants() == ()


def test_evicting_the_first_of_duplicates_leaves_the_second_to_lookups():
    t = Named(2, 3)
    t.admit("a", [1, 2, 3])  # blocks 0 (keyed (1, 2)) and 1
    t.admit("b", [1, 2])  # block 2, a duplicate of (1, 2)
    assert t.cached() == {(None, (1, 2)): (0, 2)}
    t.free("a")  # queue: 1 (unkeyed, front), 0 (keyed, back)
    t.free("b")
    assert t.free_queue() == (1, 0, 2)
    assert t.admit("c", [5, 6, 7]) == AdmitResult(True, 0, (1, 0))  # evicts block 0
    assert t.cached() == {(None, (5, 6)): (1,), (None, (1, 2)): (2,)}
    assert t.admit("d", [1, 2, 9]) == AdmitResult(False, 0, ())  # hits 2, nothing left for its tail
    t.free("c")
    res = t.admit("d", [1, 2, 9])
    assert res == AdmitResult(True, 2, (2, 0)) and t.fetch_names("d") == names(None, [1, 2, 9], 0, 3)
    assert t.broken_invariants() == ()


# -- decode ----------------------------------------------------------------------------------


def test_decode_fills_the_tail_then_takes_blocks_and_keys_them_on_write():
    t = Named(2, 4)
    t.admit("a", [1, 2, 3])
    assert t.decode("a", [4]) and t.table("a") == (0, 1)
    assert t.cached()[(None, (1, 2, 3, 4))] == (1,)
    pool = t.pool
    assert pool.decode("a", [5, 6, 7]) and pool.table("a") == (0, 1, 2, 3) and pool.pending("a") == (4, 7)
    assert (None, (1, 2, 3, 4, 5, 6)) not in pool.cached()  # keyed only by the write
    t.write_pending("a")
    assert pool.cached()[(None, (1, 2, 3, 4, 5, 6))] == (2,) and pool.key(3) is None
    assert t.fetch_names("a") == names(None, [1, 2, 3, 4, 5, 6, 7], 0, 7)
    assert t.decode("a", [8]) and t.table("a") == (0, 1, 2, 3)  # the tail had room
    before = snapshot(pool)
    assert t.decode("a", [9]) is False  # no free block left
    assert snapshot(pool) == before
    assert t.broken_invariants() == ()


def test_decode_refusals_change_nothing():
    t = Named(2, 3)
    t.admit("a", [1, 2, 3])
    t.admit("b", [5])
    t.preempt("b")
    pool = t.pool
    before = snapshot(pool)
    assert pool.decode("a", [4, 5, 6, 7]) is False  # needs 2 blocks, 1 free
    assert snapshot(pool) == before
    for args, exc, match in [
        (("a", []), InvalidArgumentError, "at least one token|non-empty"),
        (("a", [-2]), InvalidArgumentError, "integers >= 0"),
        (("x", [1]), StateError, "no request "),
        (("b", [1]), StateError, "preempted"),
        ((None, [1]), InvalidArgumentError, "req must be"),
        (("x", []), InvalidArgumentError, "at least one token"),  # the tokens are checked before the request
    ]:
        refused(pool, exc, pool.decode, *args, match=match)


# -- pending rows ------------------------------------------------------------------------------


def test_between_an_allocation_and_its_write_no_other_request_runs():
    t = Named(2, 8)
    t.admit("a", [1, 2, 3])
    pool = t.pool
    assert pool.admit("b", [1, 2, 3, 4]).admitted and pool.pending("b") == (2, 4)
    t.salt["b"] = None
    for fn, args in ((pool.admit, ("c", [1])), (pool.lookup, ([1, 2, 3],)), (pool.decode, ("a", [4])),
                     (pool.decode, ("b", [4])), (pool.fetch, ("b",))):
        refused(pool, StateError, fn, *args, match="pending")
    assert t.fetch_names("a") == names(None, [1, 2, 3], 0, 3)  # a written request stays readable
    t.preempt("a")
    refused(pool, StateError, pool.resume, "a", match="pending")
    t.write_pending("b")
    assert t.resume("a").hit_tokens == 2 and t.fetch_names("b") == names(None, [1, 2, 3, 4], 0, 4)


def test_a_request_freed_before_its_write_leaves_no_key():
    pool = PrefixCachePool(2, 4)
    pool.admit("a", [1, 2, 3, 4, 5])
    pool.free("a")
    assert pool.cached() == {} and pool.free_queue() == (2, 1, 0, 3)
    pool.admit("b", [1, 2, 3])
    pool.preempt("b")  # preempted before its write: resume recomputes every row
    assert pool.requests() == {"b": (3, False)} and pool.cached() == {}
    assert pool.resume("b") == AdmitResult(True, 0, (1, 2)) and pool.pending("b") == (0, 3)


def test_write_refusals_change_nothing():
    t = Named(2, 4)
    t.admit("a", [1, 2, 3])
    pool = t.pool
    pool.admit("b", [7, 8, 9])
    k, v = t.rows(None, [7, 8, 9], 0, 3)
    bad = [
        (("b", k[:2], v[:2]), InvalidArgumentError, r"one row per pending position \(n = 3\)"),
        (("b", k.astype(mx.float16), v.astype(mx.float16)), InvalidArgumentError, "dtype must be the pool's"),
        (("b", k, v.astype(mx.float16)), InvalidArgumentError, "share a dtype"),
        (("b", k.astype(mx.int32), v), InvalidArgumentError, "float16, bfloat16 or float32"),
        (("b", k[:, :1], v[:, :1]), InvalidArgumentError, r"\[H, D\] = \[2, 4\]"),
        (("b", k, v[:, :, :2]), InvalidArgumentError, r"\[H, D\] = \[2, 3\]"),
        (("b", k[None], v), InvalidArgumentError, "rank 3"),
        (("b", np.zeros((3, H, DK)), v), InvalidArgumentError, "must be an mx.array"),
        (("a", k, v), StateError, "no pending positions"),
        (("x", k, v), StateError, "no request "),
    ]
    for args, exc, match in bad:
        refused(pool, exc, pool.write, *args, match=match)
    pool.write("b", k, v)
    pool.preempt("b")
    refused(pool, StateError, pool.write, "b", k, v, match="preempted")


def test_the_first_write_checks_the_dims_given_to_the_pool():
    pool = PrefixCachePool(2, 4, kv_heads=2, head_dim=4, v_head_dim=3)
    pool.admit("a", [1, 2])
    k, v = mx.ones((2, 2, 4)), mx.ones((2, 2, 3))
    refused(pool, InvalidArgumentError, pool.write, "a", mx.ones((2, 1, 4)), mx.ones((2, 1, 3)),
            match=r"\[H, D\] = \[2, 4\]")
    refused(pool, InvalidArgumentError, pool.write, "a", k, mx.ones((2, 2, 4)), match=r"\[H, D\] = \[2, 3\]")
    assert pool.keys is None
    pool.write("a", k, v)
    assert pool.keys.shape == (4, 2, 2, 4) and pool.values.shape == (4, 2, 2, 3)


# -- dtypes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_come_back_exactly_in_every_dtype(dtype):
    t = Named(3, 6, dtype=dtype, dk=8, dv=5)
    t.admit("a", [1, 2, 3, 4, 5, 6, 7])
    t.admit("b", [1, 2, 3, 4, 5, 6, 9, 9])
    t.decode("b", [3, 3])
    for req, toks in (("a", [1, 2, 3, 4, 5, 6, 7]), ("b", [1, 2, 3, 4, 5, 6, 9, 9, 3, 3])):
        k, v = t.pool.fetch(req)
        assert k.dtype == v.dtype == getattr(mx, dtype) and k.shape == (len(toks), H, 8) and v.shape[2] == 5
        want_k, want_v = t.rows(None, toks, 0, len(toks))
        assert np.array_equal(host(k), host(want_k)) and np.array_equal(host(v), host(want_v))  # bit for bit
        assert t.fetch_names(req) == names(None, toks, 0, len(toks))
    assert t.pool.dtype == getattr(mx, dtype)


def test_fetch_and_block_rows_alias_no_slab():
    t = Named(2, 4)
    t.admit("a", [1, 2, 3])
    k, _ = t.pool.fetch("a")
    rk, _ = t.pool.block_rows(0)
    kept, kept_rows = host(k), host(rk)
    t.free("a")
    t.admit("b", [5, 6, 7, 8, 9, 10, 11])  # overwrites every block
    assert np.array_equal(host(k), kept) and np.array_equal(host(rk), kept_rows)


# -- preempt, resume -----------------------------------------------------------------------------


def test_preempt_keeps_the_tokens_and_resume_hits_the_cached_blocks():
    t = Named(2, 6)
    t.admit("a", [1, 2, 3, 4, 5])
    t.decode("a", [6])
    t.preempt("a")
    assert t.requests() == {"a": (6, False)} and t.table("a") == () and t.tokens("a") == (1, 2, 3, 4, 5, 6)
    assert t.free_queue() == (3, 4, 5, 2, 1, 0)
    refused(t.pool, StateError, t.pool.preempt, "a", match="preempted")
    refused(t.pool, StateError, t.pool.free, "a", match="preempted")
    refused(t.pool, StateError, t.pool.fetch, "a", match="preempted")
    refused(t.pool, StateError, t.pool.pending, "a", match="preempted")
    res = t.resume("a")  # 6 tokens: at most 2 blocks hit; block 2, full and cached-free, is not one
    assert res == AdmitResult(True, 4, (0, 1, 3)) and t.requests() == {"a": (6, True)}
    assert t.free_queue() == (4, 5, 2) and t.cached()[(None, (1, 2, 3, 4, 5, 6))] == (2, 3)  # a duplicate
    assert t.fetch_names("a") == names(None, [1, 2, 3, 4, 5, 6], 0, 6)
    refused(t.pool, StateError, t.pool.resume, "a", match="live, not preempted")
    refused(t.pool, StateError, t.pool.resume, "zz", match="no request ")
    refused(t.pool, InvalidArgumentError, t.pool.resume, 7, match="req must be")
    assert t.broken_invariants() == ()


def test_a_resume_without_room_leaves_the_request_preempted():
    t = Named(2, 3)
    t.admit("a", [1, 2, 3, 4, 5], salt=1)
    t.preempt("a")
    t.admit("b", [9, 9, 9])  # takes the unkeyed tail block 2 and evicts block 1
    before = snapshot(t.pool)
    assert t.resume("a") == AdmitResult(False, 0, ())
    assert snapshot(t.pool) == before and t.requests()["a"] == (5, False)
    t.free("b")
    res = t.resume("a")
    assert res.admitted and res.hit_tokens == 2 and t.fetch_names("a") == names(1, [1, 2, 3, 4, 5], 0, 5)


# -- free_blocks, reset ----------------------------------------------------------------------------


def test_free_blocks_is_always_refused_naming_the_rule():
    t = Named(2, 4)
    t.admit("a", [1, 2, 3])
    pool = t.pool
    for arg, exc, match in [
        ([], InvalidArgumentError, "non-empty list of block ids"),
        ("01", InvalidArgumentError, "non-empty list of block ids"),
        (None, InvalidArgumentError, "non-empty list of block ids"),
        ([4], InvalidArgumentError, r"block ids in 0\.\.3"),
        ([0, -1], InvalidArgumentError, r"block ids in 0\.\.3"),
        ([True], InvalidArgumentError, r"block ids in 0\.\.3, got True"),
        ([0, 0], InvalidArgumentError, "twice"),
        ([2, 2], InvalidArgumentError, "twice"),
        ([2], StateError, "refcount 0"),
        ([0, 2], StateError, "refcount 0"),  # every listed block is checked for refcount 0 first
        ([1, 0], StateError, r"held by request\(s\) \['a'\]"),
    ]:
        refused(pool, exc, pool.free_blocks, arg, match=match)


def test_reset_drops_every_key_only_when_no_block_is_held():
    t = Named(2, 5)
    t.admit("a", [1, 2, 3, 4, 5])
    t.admit("b", [7])
    t.preempt("b")
    before = snapshot(t.pool)
    assert t.reset() is False and snapshot(t.pool) == before
    t.free("a")
    queue = t.free_queue()
    assert t.reset() is True
    assert t.cached() == {} and all(t.key(b) is None for b in range(5)) and t.free_queue() == queue
    assert t.lookup([1, 2, 3]) == 0 and t.requests() == {"b": (1, False)}
    assert t.resume("b").admitted and t.broken_invariants() == ()


# -- small pools -------------------------------------------------------------------------------------


def test_a_pool_of_one_block():
    t = Named(2, 1)
    assert t.admit("a", [1, 2]) == AdmitResult(True, 0, (0,))
    assert t.cached() == {(None, (1, 2)): (0,)}
    assert t.admit("b", [1, 2, 3]) == AdmitResult(False, 0, ())
    assert t.decode("a", [3]) is False
    t.free("a")
    assert t.free_queue() == (0,)
    assert t.admit("b", [1, 2, 3]) == AdmitResult(False, 0, ())  # its only free block is its hit
    assert t.admit("b", [1, 2]) == AdmitResult(True, 0, (0,))  # evicts (1, 2) and keys it again
    assert t.cached() == {(None, (1, 2)): (0,)} and t.fetch_names("b") == names(None, [1, 2], 0, 2)
    t.free("b")
    assert t.admit("c", [5]) == AdmitResult(True, 0, (0,)) and t.cached() == {}
    assert t.block_names(0) == names(None, [5], 0, 1) + [None]
    assert t.broken_invariants() == ()


def test_block_size_one():
    t = Named(1, 6)
    t.admit("a", [1, 2, 3])
    assert t.cached() == {(None, (1,)): (0,), (None, (1, 2)): (1,), (None, (1, 2, 3)): (2,)}
    assert t.lookup([1, 2, 3]) == 2 and t.lookup([1, 2, 3, 4]) == 3 and t.lookup([1]) == 0
    res = t.admit("b", [1, 2, 3, 4])
    assert res == AdmitResult(True, 3, (0, 1, 2, 3))
    assert t.decode("b", [5, 6]) and t.table("b") == (0, 1, 2, 3, 4, 5)
    assert t.fetch_names("b") == names(None, [1, 2, 3, 4, 5, 6], 0, 6)
    assert t.decode("b", [7]) is False
    t.free("a")
    t.free("b")
    assert t.free_queue() == (5, 4, 3, 2, 1, 0)
    assert t.broken_invariants() == ()


# -- copies, invariants ------------------------------------------------------------------------------


def test_a_copy_shares_nothing():
    t = Named(2, 5, dtype="bfloat16")
    t.admit("a", [1, 2, 3])
    t.admit("b", [1, 2, 5, 6])
    t.preempt("b")
    pool = t.pool
    dup = pool.copy()
    assert type(dup) is PrefixCachePool and snapshot(dup) == snapshot(pool)
    assert dup.keys is not pool.keys and dup._reqs["a"] is not pool._reqs["a"]
    before = snapshot(dup)
    t.decode("a", [4, 4, 4])
    t.free("a")
    t.resume("b")
    t.admit("c", [8, 8, 8])
    assert snapshot(dup) == before
    mine = snapshot(pool)
    assert dup.resume("b").admitted and dup.free_queue() != before["free"]
    assert snapshot(pool) == mine and dup.broken_invariants() == () and pool.broken_invariants() == ()


def test_broken_invariants_names_the_spec_invariant():
    t = Named(2, 4)
    t.admit("a", [1, 2, 3])
    t.admit("b", [1, 2, 4])
    pool = t.pool
    cases = [
        (lambda p: p._ref.__setitem__(0, 1), "refcounts_match_tables"),
        (lambda p: p._key.__setitem__(0, (None, (1, 9))), "full_blocks_keyed"),
        (lambda p: p._key.__setitem__(1, (None, (1, 2, 3, 4))), "partial_tail_private"),
        (lambda p: p._cached.__setitem__((None, (1, 2)), [0, 0]), "cached_map_exact"),
        (lambda p: p._q_remove(3), "free_queue_exact"),
        (lambda p: p._reqs["a"].table.pop(), "tables_sized"),
        (lambda p: p._cached.__setitem__((None, (1,)), [3]), "keys_name_contents"),
    ]
    for corrupt, name in cases:
        bad = pool.copy()
        corrupt(bad)
        assert any(m.startswith(name + ":") for m in bad.broken_invariants()), (name, bad.broken_invariants())
    assert pool.broken_invariants() == ()


# -- the differential loop against kvspec.spec.prefix ------------------------------------------------------

BASES = ((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 9, 9, 4, 4), (5, 6, 5, 6, 5, 6))
REQS = ("a", "b", "c", "d")


def _random_op(rng: random.Random, view: dict, n_blocks: int) -> dict:
    """One op, mostly valid, drawn from overlapping prompts; some refused."""
    reqs = view["requests"]
    live = [r for r, x in reqs.items() if x["live"]]
    pre = [r for r, x in reqs.items() if not x["live"]]
    new = [r for r in REQS if r not in reqs]
    held = [b for b, (ref, _) in enumerate(view["blocks"]) if ref > 0]
    salt = rng.choice((None, None, None, 0, 1))
    base = rng.choice(BASES)
    tokens = list(base[:rng.randint(1, len(base))]) + ([rng.randint(0, 9)] if rng.random() < 0.3 else [])
    k = rng.random()
    if k < 0.3 and new and len(live) < 3:
        return {"op": "admit", "req": rng.choice(new), "tokens": tokens, "salt": salt}
    if k < 0.5 and live:
        return {"op": "decode", "req": rng.choice(live), "tokens": [rng.randint(0, 9) for _ in range(rng.randint(1, 2))]}
    if k < 0.62 and live:
        return {"op": "free", "req": rng.choice(live)}
    if k < 0.7 and live:
        return {"op": "preempt", "req": rng.choice(live)}
    if k < 0.8 and pre:
        return {"op": "resume", "req": rng.choice(pre)}
    if k < 0.86:
        return {"op": "lookup", "tokens": tokens, "salt": salt}
    if k < 0.9:
        return {"op": "reset"}
    if k < 0.94:
        probes = [[rng.randrange(n_blocks)], [n_blocks], []] + ([[held[0], held[0]], [held[-1]]] if held else [])
        return {"op": "free_blocks", "blocks": rng.choice(probes)}
    bad = [{"op": "admit", "req": rng.choice(REQS), "tokens": tokens, "salt": salt},
           {"op": "admit", "req": "e", "tokens": rng.choice(([], [1, -1]))},
           {"op": "decode", "req": rng.choice(REQS), "tokens": rng.choice(([], [2]))},
           {"op": "free", "req": rng.choice(REQS)}, {"op": "preempt", "req": rng.choice(REQS)},
           {"op": "resume", "req": rng.choice(REQS)}, {"op": "lookup", "tokens": tokens, "salt": -1}]
    return rng.choice(bad)


def _run_impl(t: Named, op: dict):
    name = op["op"]
    if name == "admit":
        r = t.admit(op["req"], op["tokens"], op.get("salt"))
        return {"admitted": r.admitted, "hit": r.hit_tokens, "table": list(r.table)}
    if name == "resume":
        r = t.resume(op["req"])
        return {"admitted": r.admitted, "hit": r.hit_tokens, "table": list(r.table)}
    if name == "decode":
        return t.decode(op["req"], op["tokens"])
    if name in ("free", "preempt"):
        return getattr(t, name)(op["req"])
    if name == "lookup":
        return t.lookup(op["tokens"], op.get("salt"))
    if name == "free_blocks":
        return t.free_blocks(op["blocks"])
    return t.reset()


def _outcome(fn):
    try:
        return ("ok", fn())
    except KVCacheError as e:
        return ("refused", type(e).__name__)


def _events(op: dict, result, old: spec.PrefixWorld, new: spec.PrefixWorld) -> set[str]:
    """What an accepted op of the loop reached, read from the spec's worlds."""
    out = {op["op"]}
    if isinstance(result, dict):
        out.add("hit" if result["hit"] else "miss" if result["admitted"] else f"{op['op']} not admitted")
        if result["admitted"] and any(b is not None and old.blocks[b].refcount == 0 and old.blocks[b].key is not None
                                      for b in result["table"][:result["hit"] // old.block_size]):
            out.add("cached-free hit")
    if result is False:
        out.add(f"{op['op']} False")
    if any(o.key is not None and n.key != o.key for o, n in zip(old.blocks, new.blocks, strict=True)) \
            and op["op"] != "reset":
        out.add("eviction")
    if any(len(ids) > 1 for _, ids in new.cached):
        out.add("duplicate key")
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_differential_loop_against_spec(dtype):
    """Random op sequences (overlapping prompts, salts, refused calls) run
    on the pool (rows written as the lockstep writes them) and on
    ``kvspec.spec.prefix``: the same results and refusal types, the same observable
    view after every op (tables, refcounts, keys, free queue, cached map,
    the row names read back), a pool unchanged by every refusal, no broken
    invariant, and every live request fetching its own rows."""
    seen: set = set()
    for seed in range(30):
        rng = random.Random(f"{dtype}-{seed}")
        bs, n_blocks = rng.randint(1, 4), rng.randint(4, 12)
        t = Named(bs, n_blocks, dtype=dtype, dk=4, dv=rng.choice((2, 4)))
        world = spec.new_world(bs, n_blocks)
        for i in range(80):
            op = _random_op(rng, spec.observe(world), n_blocks)
            where = f"seed {seed} (block_size {bs}, n_blocks {n_blocks}) op {i} {op}"
            before = snapshot(t.pool)
            got = _outcome(lambda: _run_impl(t, op))  # noqa: B023
            try:
                result, new = spec.apply_op(world, op)
                want = ("ok", result)
            except KVCacheError as e:
                want, new = ("refused", type(e).__name__), world
            assert got == want, where
            if want[0] == "refused":
                seen.add(f"{op['op']} refused")
            else:
                seen |= _events(op, want[1], world, new)
            if new is world:
                assert snapshot(t.pool) == before, where
            world = new
            assert t.observe() == spec.observe(world), where
            assert t.broken_invariants() == () and spec.broken_invariants(world) == (), where
            for req, r in world.requests.items():
                if r.live:
                    assert t.fetch_names(req) == names(r.salt, r.tokens, 0, len(r.tokens)), where
    must = {"admit", "decode", "free", "preempt", "resume", "lookup", "reset", "hit", "cached-free hit",
            "eviction", "duplicate key", "admit not admitted", "decode False", "free_blocks refused",
            "admit refused", "decode refused", "free refused", "resume refused"}
    assert must <= seen, must - seen


def _words(fn):
    try:
        return ("ok", fn())
    except KVCacheError as e:
        return ("refused", type(e).__name__, str(e))


@pytest.mark.parametrize("window", [1, 2, 3, 4, 5])
def test_differential_loop_against_spec_under_a_sliding_window(window):
    """The loop above under ``window = w``: the same results, refusal types
    and words, views (tables with None entries), unchanged pools on
    refusal, no broken invariant, and every live request fetching its rows
    from the first position its table holds; the window's releases and
    windowed hits are reached."""
    seen: set = set()
    for seed in range(20):
        rng = random.Random(f"w{window}-{seed}")
        bs, n_blocks = rng.randint(1, 4), rng.randint(4, 12)
        t = Named(bs, n_blocks, dk=4, dv=4, window=window)
        world = spec.new_world(bs, n_blocks, window)
        for i in range(80):
            op = _random_op(rng, spec.observe(world), n_blocks)
            if op["op"] == "decode" and rng.random() < 0.5 and op["req"] in world.requests:
                op["tokens"] = op["tokens"] * 2  # longer decodes: the window moves by several blocks
            where = f"w={window} seed {seed} (block_size {bs}, n_blocks {n_blocks}) op {i} {op}"
            before = snapshot(t.pool)
            got = _words(lambda: _run_impl(t, op))  # noqa: B023
            try:
                result, new = spec.apply_op(world, op)
                want = ("ok", result)
            except KVCacheError as e:
                want, new = ("refused", type(e).__name__, str(e)), world
            assert got == want, where
            if want[0] == "ok":
                seen |= _events(op, want[1], world, new)
                if op["op"] == "decode" and want[1] and any(b is None for b in new.requests[op["req"]].table) \
                        and new.requests[op["req"]].table != world.requests[op["req"]].table[:len(
                            new.requests[op["req"]].table)]:
                    seen.add("window release")
                if isinstance(want[1], dict) and want[1]["admitted"] and None in want[1]["table"]:
                    seen.add("hit with None entries")
            if new is world:
                assert snapshot(t.pool) == before, where
            world = new
            assert t.observe() == spec.observe(world), where
            assert t.broken_invariants() == () and spec.broken_invariants(world) == (), where
            for req, r in world.requests.items():
                if r.live:
                    first = bs * sum(1 for b in r.table if b is None)
                    assert t.pool.first_position(req) == first, where
                    assert t.fetch_names(req) == names(r.salt, r.tokens, first, len(r.tokens)), where
    must = {"admit", "decode", "free", "window release"}
    if window > 1:  # under w = 1 nothing is keyed: no hit, no eviction
        must |= {"hit", "eviction", "hit with None entries", "cached-free hit"}
    assert must <= seen, must - seen


def test_block_rows_reads_a_reused_block_anew():
    """block_rows reads the slabs each call: a block read, freed (unkeyed:
    to the front of the queue) and taken by another request reads the new
    request's rows, as fetch does."""
    t = Named(2, 2)
    t.admit("a", [1])
    assert t.block_names(0) == names(None, [1], 0, 1) + [None]
    t.pool.free("a")
    t.admit("b", [7, 8])
    assert t.pool.table("b") == (0,)
    assert t.block_names(0) == names(None, [7, 8], 0, 2) == t.fetch_names("b")
