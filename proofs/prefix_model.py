"""Z3 encodings of the prefix kind's spec (``kvspec.spec.prefix``): its integer
rules under their names, and its operations on a bounded pool.

**Integer rules** (``max_hit_blocks``, ``blocks_for``, ``full_blocks``,
``is_full``, ``new_blocks_needed``, ``decode_blocks_needed``,
``available_blocks``) are encoded over symbolic integers through the
domain, so the bv32 run checks that none of them overflows.

**The pool** (:class:`World`) is a bounded model: ``NB`` = 3 blocks and
``R`` = 2 requests, the block size B and every token count symbolic. Keys
and rows are **names** (integers), as the spec's are: the hash chain is
taken as collision-free, so a key IS the prefix it names and the B rows a
block under that key must hold are named by it (``kvspec.spec.prefix.key_rows``).
So:

* a key name is an integer >= 0, and the name of the B rows a key names is
  that same integer: "block b holds the rows its key names" is ``rows[b] ==
  key[b]``;
* a block's ``rows`` name: ``-1`` blank (popped, nothing written yet), a
  key name (a full block's rows), or a name ``<= -2`` (a partial block's
  rows: some slots still None, so they are no key's rows);
* a request carries the key names of its blocks 0, 1, 2 (``k``: block i's
  key ``(salt, tokens[:(i + 1) * B])``; pairwise distinct, since they name
  prefixes of different lengths; a block not full yet has the name its key
  will have once it is) and ``p``, the name of its partial tail's rows.

Two requests with the same salt and prefix share key names; with another
salt, other names (so salted misses are the general case of two unequal
names). Which names are equal is left to Z3: every relation between two
requests' prefixes is covered.

The cached map is kept per block: ``lk[b]`` is the key whose id list holds
``b`` (-1: none). The spec's map is ``key -> ids``; a block under two keys
or a key listed twice cannot be written this way, and the spec's
``cached_map_exact`` says neither happens. The order of ids under one key
(a lookup takes the first) is not kept: a hit may take any block listed
under its key, which covers the spec's choice (the fidelity test pins the
spec's choice and checks that the model allows it). The free queue is
kept in order (``q[0]`` the front, ``qn`` its length), and so are the
tables.

``tests/test_proofs_fidelity_prefix.py`` runs every operation here on
concrete worlds the spec reaches and compares with ``kvspec.spec.prefix``. Buggy
variants for the negative controls are selected by :class:`PrefixRules`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import z3

from kvspec.proofs.domain import Domain

#: blocks and request slots of the bounded pool
NB, R = 3, 2
#: a block with no key, not listed under a key, or with blank rows
NONE = -1


@dataclass(frozen=True)
class PrefixRules:
    """The spec's rules by default; other values are negative controls
    (the fault classes of public reports, named in proofs/prefix.py)."""

    evict: str = "spec"  # | "keeps_map_entry" (the popped block's id stays under its key, its key cleared)
    #                      | "keeps_key" (the id leaves the key's list, the block keeps its key)
    #                      | "none" (no eviction step: the key and the map entry both stay)
    cache_partial: bool = False  # the partial tail block is keyed too
    pop_refcount: int = 1  # the refcount a popped block starts at (0: never raised for its holder)
    touch: str = "spec"  # | "leaves_in_queue" (a hit on a cached-free block leaves it in the free queue)
    pool_release: str = "spec"  # | "unchecked" (free_blocks decrements each listed block, no check)
    cap: str = "spec"  # | "uncapped" (hit up to len // B blocks) | "partial" (up to ceil(len / B))
    skip: str = "spec"  # | "late" (max(0, n - w + 2) // B blocks before the window: one token late)
    run: str = "spec"  # | "short" (a windowed hit needs ceil((w - 1) / B) - 1 cached blocks in a row)


PREFIX_SPEC = PrefixRules()


# -- integer rules (kvspec.spec.prefix, same names) -----------------------------------------


def _once(d: Domain, name: str, args: tuple[Any, ...], fn: Callable[[], Any]) -> Any:
    """``fn()``, computed once per domain, arguments and branch: in bv32
    each computation is a fresh wrapped variable, and the invariants ask
    for ``n // B`` and ``ceil(n / B)`` of one request many times; one
    variable per value keeps the check small. The branch is part of the
    key, so each no-overflow obligation is still recorded where the value
    is computed."""
    memo = d.__dict__.setdefault("_prefix_once", {})
    key = (name, *[a.get_id() if isinstance(a, z3.AstRef) else a for a in args],
           *[c.get_id() for c in d.path])
    if key not in memo:
        memo[key] = fn()
    return memo[key]


def max_hit_blocks(d: Domain, n: Any, bs: Any, rules: PrefixRules = PREFIX_SPEC) -> Any:
    """``(n - 1) // B`` (controls: ``n // B``, the whole prompt; ``ceil(n / B)``)."""
    if rules.cap == "uncapped":
        return full_blocks(d, n, bs)
    if rules.cap == "partial":
        return blocks_for(d, n, bs)
    return _once(d, "max_hit_blocks", (n, bs), lambda: d.floordiv(d.sub(n, 1, "n - 1"), bs, "(n - 1) // B"))


def skipped_blocks(d: Domain, n: Any, w: Any, bs: Any, rules: PrefixRules = PREFIX_SPEC) -> Any:
    """``max(0, n - w + 1) // B``: leading blocks of ``n`` tokens wholly
    before the next token's window (control: ``n - w + 2``, a token late)."""
    late = 2 if rules.skip == "late" else 1
    first = d.add(d.sub(n, w, "n - w"), late, "n - w + 1")
    return d.floordiv(z3.If(first > 0, first, 0), bs, "max(0, n - w + 1) // B")


def hit_run(d: Domain, w: Any, bs: Any, rules: PrefixRules = PREFIX_SPEC) -> Any:
    """``max(1, ceil((w - 1) / B))``: cached blocks in a row a windowed hit
    needs (control: one fewer)."""
    r = d.ceildiv(d.sub(w, 1, "w - 1"), bs)
    if rules.run == "short":
        r = r - 1
    return z3.If(r > 1, r, 1)


def blocks_for(d: Domain, n: Any, bs: Any) -> Any:
    """``-(-n // B)``: the entries of a table for ``n`` rows."""
    return _once(d, "blocks_for", (n, bs), lambda: d.ceildiv(n, bs))


def full_blocks(d: Domain, n: Any, bs: Any) -> Any:
    """``n // B``: the full blocks of ``n`` rows."""
    return _once(d, "full_blocks", (n, bs), lambda: d.floordiv(n, bs, "n // B"))


def is_full(d: Domain, index: Any, n: Any, bs: Any) -> Any:
    """``index < n // B``: block ``index`` of ``n`` rows is full."""
    return index < full_blocks(d, n, bs)


def new_blocks_needed(d: Domain, n: Any, hit: Any, bs: Any) -> Any:
    """``blocks_for(n, B) - hit``."""
    return d.sub(blocks_for(d, n, bs), hit, "blocks_for - hit")


def decode_blocks_needed(d: Domain, n: Any, n_new: Any, bs: Any) -> Any:
    """``blocks_for(n + n_new, B) - blocks_for(n, B)``; ``n + n_new`` is the
    length the request stores."""
    total = tokens_after(d, n, n_new)
    return d.sub(blocks_for(d, total, bs), blocks_for(d, n, bs), "blocks_for(n + n_new) - blocks_for(n)")


def tokens_after(d: Domain, n: Any, n_new: Any) -> Any:
    """``n + n_new``, the length a request stores after a decode (in bv32
    assumed to fit: a 32-bit port refuses to grow past it)."""
    return _once(d, "n + n_new", (n, n_new),
                 lambda: d.stored("tokens after the decode", lambda dd, a, b: dd.add(a, b, "n + n_new"), n, n_new))


def available_blocks(d: Domain, n_free: Any, hit_free: Any) -> Any:
    """``n_free - hit_free``."""
    return d.sub(n_free, hit_free, "n_free - hit_free")


# -- the bounded pool ----------------------------------------------------------------


@dataclass(frozen=True)
class ReqV:
    """One request slot: ``live``; ``pre`` (known, preempted); ``n`` tokens;
    table ``t`` of ``tl`` entries; key names ``k`` of its blocks 0..2;
    ``p`` the name of its partial tail's rows."""

    live: Any
    pre: Any
    n: Any
    tl: Any
    t: tuple[Any, ...]
    k: tuple[Any, ...]
    p: Any


@dataclass(frozen=True)
class World:
    """The pool: block size ``B``; per block its refcount, key, the key the
    cached map lists it under (``lk``) and its rows' name; the free queue
    ``q[:qn]`` (front first); the request slots."""

    B: Any
    rc: tuple[Any, ...]
    key: tuple[Any, ...]
    lk: tuple[Any, ...]
    rows: tuple[Any, ...]
    q: tuple[Any, ...]
    qn: Any
    reqs: tuple[ReqV, ...]


def req_vars(d: Domain, name: str) -> ReqV:
    return ReqV(d.boolean(f"{name}_live"), d.boolean(f"{name}_preempted"), d.var(f"{name}_n"), d.var(f"{name}_tl"),
                tuple(d.var(f"{name}_t{i}") for i in range(NB)), tuple(d.var(f"{name}_k{i}") for i in range(NB)),
                d.var(f"{name}_p"))


def world_vars(d: Domain, name: str = "w") -> World:
    return World(d.var("B"), tuple(d.var(f"{name}_rc{x}") for x in range(NB)),
                 tuple(d.var(f"{name}_key{x}") for x in range(NB)), tuple(d.var(f"{name}_listed{x}") for x in range(NB)),
                 tuple(d.var(f"{name}_rows{x}") for x in range(NB)), tuple(d.var(f"{name}_q{i}") for i in range(NB)),
                 d.var(f"{name}_qn"), tuple(req_vars(d, f"r{r}") for r in range(R)))


def initial(w: World) -> Any:
    """``kvspec.spec.prefix.new_world``: every block free (queue ``0 .. NB - 1``),
    refcount 0, unkeyed, blank; no request."""
    return z3.And(w.B >= 1, *[w.rc[x] == 0 for x in range(NB)], *[w.key[x] == NONE for x in range(NB)],
                  *[w.lk[x] == NONE for x in range(NB)], *[w.rows[x] == NONE for x in range(NB)],
                  *[w.q[i] == i for i in range(NB)], w.qn == NB,
                  *[z3.And(z3.Not(r.live), z3.Not(r.pre)) for r in w.reqs])


# -- symbolic tuples -----------------------------------------------------------------


def sel(t: tuple[Any, ...], i: Any) -> Any:
    """``t[i]`` for a symbolic index (the last entry for any index past it)."""
    out = t[-1]
    for x in reversed(range(len(t) - 1)):
        out = z3.If(i == x, t[x], out)
    return out


def put(t: tuple[Any, ...], i: Any, v: Any, cond: Any = True) -> tuple[Any, ...]:
    """``t`` with ``t[i] = v`` where ``cond``."""
    return tuple(z3.If(z3.And(cond, i == x), v, t[x]) for x in range(len(t)))


def ite(c: Any, a: Any, b: Any) -> Any:
    """``a`` if ``c`` else ``b``, field by field, for worlds, requests and tuples."""
    if isinstance(a, World):
        return World(a.B, ite(c, a.rc, b.rc), ite(c, a.key, b.key), ite(c, a.lk, b.lk), ite(c, a.rows, b.rows),
                     ite(c, a.q, b.q), z3.If(c, a.qn, b.qn), tuple(ite(c, x, y) for x, y in zip(a.reqs, b.reqs, strict=True)))
    if isinstance(a, ReqV):
        return ReqV(z3.If(c, a.live, b.live), z3.If(c, a.pre, b.pre), z3.If(c, a.n, b.n), z3.If(c, a.tl, b.tl),
                    ite(c, a.t, b.t), ite(c, a.k, b.k), z3.If(c, a.p, b.p))
    if isinstance(a, tuple):
        return tuple(z3.If(c, x, y) for x, y in zip(a, b, strict=True))
    return z3.If(c, a, b)


def with_req(w: World, r: int, req: ReqV) -> World:
    return replace(w, reqs=w.reqs[:r] + (req,) + w.reqs[r + 1:])


# -- the free queue ------------------------------------------------------------------


def in_queue(w: World, x: Any) -> Any:
    return z3.Or(*[z3.And(i < w.qn, w.q[i] == x) for i in range(NB)])


def queue_remove(w: World, x: Any, cond: Any) -> World:
    """Where ``cond``: the first occurrence of ``x`` leaves the queue."""
    at: Any = z3.IntVal(NB)
    for i in reversed(range(NB)):
        at = z3.If(z3.And(i < w.qn, w.q[i] == x), i, at)
    found = z3.And(cond, at < NB)
    q = tuple(z3.If(z3.And(found, i >= at), w.q[i + 1] if i + 1 < NB else w.q[i], w.q[i]) for i in range(NB))
    return replace(w, q=q, qn=z3.If(found, w.qn - 1, w.qn))


def queue_insert(w: World, at: Any, x: Any, cond: Any) -> World:
    """Where ``cond``: ``x`` inserted at position ``at`` (``at == qn``: the
    back). A queue already holding NB entries keeps its first NB slots and
    its length grows past NB (a state the invariant excludes)."""
    q = tuple(z3.If(cond, z3.If(i < at, w.q[i], z3.If(i == at, x, w.q[i - 1] if i else w.q[i])), w.q[i])
              for i in range(NB))
    return replace(w, q=q, qn=z3.If(cond, w.qn + 1, w.qn))


# -- per-block updates ---------------------------------------------------------------


def set_block(w: World, b: Any, cond: Any, rc: Any = None, key: Any = None, lk: Any = None, rows: Any = None) -> World:
    """Where ``cond``: block ``b``'s fields given (not None) replaced."""
    return replace(w, rc=w.rc if rc is None else put(w.rc, b, rc, cond),
                   key=w.key if key is None else put(w.key, b, key, cond),
                   lk=w.lk if lk is None else put(w.lk, b, lk, cond),
                   rows=w.rows if rows is None else put(w.rows, b, rows, cond))


def holders(w: World, x: Any) -> Any:
    """The number of live tables holding block ``x``."""
    return z3.Sum(*[z3.If(z3.And(r.live, z3.Or(*[z3.And(i < r.tl, r.t[i] == x) for i in range(NB)])), 1, 0)
                    for r in w.reqs])


# -- the ops -------------------------------------------------------------------------


@dataclass(frozen=True)
class Hit:
    """The hit an admission chooses: ``j`` blocks, block ``h[i]`` for key i."""

    j: Any
    h: tuple[Any, ...]


def hit_vars(d: Domain, name: str = "hit") -> Hit:
    return Hit(d.var(f"{name}_j"), tuple(d.var(f"{name}_block{i}") for i in range(NB)))


def hit_rule(d: Domain, w: World, n: Any, keys: tuple[Any, ...], hit: Hit, rules: PrefixRules = PREFIX_SPEC) -> Any:
    """``kvspec.spec.prefix.hit_blocks`` and ``hit_table``: ``j`` is the largest
    count ``<= max_hit_blocks(n, B)`` whose keys ``0 .. j - 1`` are all
    cached, and ``h[i]`` a block listed under key ``i`` (the spec takes the
    first: any is allowed here)."""
    cap = max_hit_blocks(d, n, w.B, rules)
    listed = [z3.Or(*[w.lk[x] == keys[i] for x in range(NB)]) for i in range(NB)]
    out = [hit.j >= 0, hit.j <= cap, hit.j <= NB]
    for i in range(NB):
        out.append(z3.Implies(i < hit.j, z3.And(hit.h[i] >= 0, hit.h[i] < NB, sel(w.lk, hit.h[i]) == keys[i])))
        # the chain stops at the first key not cached (or at the cap)
        out.append(z3.Implies(hit.j == i, z3.Or(cap == i, z3.Not(listed[i]))))
    return z3.And(*out)


def pop(d: Domain, w: World, need: Any, at: Any, r: int, cond: Any, rules: PrefixRules = PREFIX_SPEC) -> tuple[World, tuple[Any, ...]]:
    """``kvspec.spec.prefix._pop``: ``need`` blocks from the front, one by one, into
    request ``r``'s table from index ``at``; a keyed one is evicted (its id
    leaves its key's list, its key is cleared); each gets refcount 1 and
    blank rows. Returns the world and the request's new table."""
    t = w.reqs[r].t
    for k in range(NB):
        go = z3.And(cond, k < need)
        b = w.q[0]
        # evicted: the id leaves its key's list, the key is cleared (an unkeyed
        # block is listed nowhere and has no key: the same assignments)
        lk = sel(w.lk, b) if rules.evict in ("keeps_map_entry", "none") else z3.IntVal(NONE)
        key = sel(w.key, b) if rules.evict in ("keeps_key", "none") else z3.IntVal(NONE)
        w = set_block(w, b, go, rc=z3.IntVal(rules.pop_refcount), key=key, lk=lk, rows=z3.IntVal(NONE))
        w = replace(w, q=tuple(z3.If(go, w.q[i + 1] if i + 1 < NB else w.q[i], w.q[i]) for i in range(NB)),
                    qn=z3.If(go, w.qn - 1, w.qn))
        t = put(t, at + k, b, go)
    return w, t


def write_and_cache(d: Domain, w: World, t: tuple[Any, ...], tl: Any, lo_written: Any, n_old: Any, n: Any,
                    keys: tuple[Any, ...], pn: Any, cond: Any, rules: PrefixRules = PREFIX_SPEC) -> World:
    """``kvspec.spec.prefix._write`` of positions from the first block not full at
    ``n_old`` rows (``lo_written``: a block index) to ``n``, then
    ``_cache_full``: every block that became full is keyed (its rows are then
    the key's: the abstract rows of a full block are its key's name)."""
    with d.under(cond):
        last_full = full_blocks(d, n, w.B)
    for i in range(NB):
        go = z3.And(cond, i < tl, i >= lo_written)
        full = i < last_full  # is_full(i, n, B)
        b = t[i]
        w = set_block(w, b, go, rows=z3.If(full, keys[i], pn))
        keyed = z3.And(go, z3.Or(full, rules.cache_partial))
        w = set_block(w, b, keyed, key=keys[i], lk=keys[i])
    return w


def admit(d: Domain, w: World, r: int, n: Any, keys: tuple[Any, ...], pn: Any, hit: Hit,
          rules: PrefixRules = PREFIX_SPEC) -> tuple[Any, Any, World]:
    """``kvspec.spec.prefix._admit`` of request slot ``r`` (not live) with ``n >= 1``
    tokens whose blocks have key names ``keys`` and whose partial tail rows
    are named ``pn``: returns ``(the hit rule, admitted, world)``; not
    admitted: the world unchanged."""
    bs = w.B
    rule = hit_rule(d, w, n, keys, hit, rules)
    need = new_blocks_needed(d, n, hit.j, bs)
    hit_free = z3.Sum(*[z3.If(z3.And(i < hit.j, sel(w.rc, hit.h[i]) == 0), 1, 0) for i in range(NB)])
    ok = need <= available_blocks(d, w.qn, hit_free)
    new = w
    for i in range(NB):
        go = z3.And(ok, i < hit.j)
        b = hit.h[i]
        was_free = sel(new.rc, b) == 0
        with d.under(go):
            rc1 = d.stored("refcount + 1", lambda dd, v: dd.add(v, 1, "refcount + 1"), sel(new.rc, b))
        if rules.touch == "spec":
            new = queue_remove(new, b, z3.And(go, was_free))
        new = set_block(new, b, go, rc=rc1)
    t0 = tuple(z3.If(i < hit.j, hit.h[i], w.reqs[r].t[i]) for i in range(NB))
    new = with_req(new, r, replace(new.reqs[r], t=t0))
    new, t = pop(d, new, need, hit.j, r, ok, rules)
    tl = blocks_for(d, n, bs)
    new = write_and_cache(d, new, t, tl, hit.j, z3.IntVal(0), n, keys, pn, ok, rules)
    new = with_req(new, r, ReqV(z3.BoolVal(True), z3.BoolVal(False), n, tl, t, keys, pn))
    return rule, ok, ite(ok, new, w)


def decode(d: Domain, w: World, r: int, m: Any, keys: tuple[Any, ...], pn: Any,
           rules: PrefixRules = PREFIX_SPEC) -> tuple[Any, World]:
    """``kvspec.spec.prefix.decode`` of ``m >= 1`` tokens onto live request ``r``:
    ``keys`` are the key names of its blocks after the decode (those full
    before are kept), ``pn`` the name of its new partial tail's rows.
    Returns ``(done, world)``; not done: unchanged. A request that is not
    live is refused before any arithmetic (the spec's ``_live`` check
    comes first), so its lengths are computed only under ``live``."""
    req, bs = w.reqs[r], w.B
    with d.under(req.live):
        need = decode_blocks_needed(d, req.n, m, bs)
        n1 = tokens_after(d, req.n, m)
    ok = z3.And(req.live, need <= w.qn)
    new, t = pop(d, w, need, req.tl, r, ok, rules)
    with d.under(ok):
        tl = blocks_for(d, n1, bs)
        lo = full_blocks(d, req.n, bs)
    new = write_and_cache(d, new, t, tl, lo, req.n, n1, keys, pn, ok, rules)
    new = with_req(new, r, replace(req, n=n1, tl=tl, t=t, k=keys, p=pn))
    return ok, ite(ok, new, w)


def release(d: Domain, w: World, t: tuple[Any, ...], tl: Any, cond: Any) -> World:
    """``kvspec.spec.prefix._release`` of table ``t[:tl]`` tail first: refcount - 1;
    a block reaching 0 joins the queue, a keyed one at the back, an unkeyed
    one at the front (the unkeyed of one release in release order)."""
    front: Any = z3.IntVal(0)
    for i in reversed(range(NB)):
        go = z3.And(cond, i < tl)
        b = t[i]
        with d.under(go):
            rc1 = d.stored("refcount - 1", lambda dd, v: dd.sub(v, 1, "refcount - 1"), sel(w.rc, b))
        w = set_block(w, b, go, rc=rc1)
        zero = z3.And(go, rc1 == 0)
        keyed = sel(w.key, b) >= 0
        w = queue_insert(w, z3.If(keyed, w.qn, front), b, zero)
        front = z3.If(z3.And(zero, z3.Not(keyed)), front + 1, front)
    return w


def free(d: Domain, w: World, r: int, preempt: bool = False) -> tuple[Any, World]:
    """``kvspec.spec.prefix.free`` (``preempt``: ``kvspec.spec.prefix.preempt``) of request
    ``r``: refused (unchanged) unless live; its table released; the request
    forgotten (preempted: kept, not live, with its tokens and keys)."""
    req = w.reqs[r]
    ok = req.live
    new = release(d, w, req.t, req.tl, ok)
    new = with_req(new, r, replace(req, live=z3.BoolVal(False), pre=z3.BoolVal(preempt), tl=z3.IntVal(0)))
    return ok, ite(ok, new, w)


def reset(w: World) -> tuple[Any, World]:
    """``kvspec.spec.prefix.reset``: refused while any block has a refcount above
    0; else every key dropped (map empty), the queue and rows as they are."""
    ok = z3.And(*[w.rc[x] == 0 for x in range(NB)])
    new = replace(w, key=(z3.IntVal(NONE),) * NB, lk=(z3.IntVal(NONE),) * NB)
    return ok, ite(ok, new, w)


def free_blocks(d: Domain, w: World, xs: tuple[Any, ...], rules: PrefixRules = PREFIX_SPEC) -> tuple[Any, World]:
    """``kvspec.spec.prefix.free_blocks(xs)`` (two ids, maybe equal): the spec
    refuses an id out of range, one listed twice, one of refcount 0 and one
    a live table holds (under the invariant: every call); an accepted call
    would release each as vLLM's does (refcount - 1, at 0 the block joins the back of the queue).
    The control ``unchecked`` is vLLM's ``BlockPool.free_blocks``: each
    listed block released, no check."""
    if rules.pool_release == "unchecked":
        ok: Any = z3.And(*[z3.And(x >= 0, x < NB) for x in xs])
    else:
        ok = z3.And(*[z3.And(x >= 0, x < NB, sel(w.rc, x) > 0, holders(w, x) == 0) for x in xs],
                    *[xs[i] != xs[k] for i in range(len(xs)) for k in range(i + 1, len(xs))])
    new = w
    for x in xs:
        with d.under(ok):
            rc1 = d.stored("refcount - 1", lambda dd, v: dd.sub(v, 1, "refcount - 1"), sel(new.rc, x))
        new = set_block(new, x, ok, rc=rc1)
        new = queue_insert(new, new.qn, x, z3.And(ok, rc1 == 0))
    return ok, ite(ok, new, w)


# -- invariants (kvspec.spec.prefix.INVARIANTS) ----------------------------------------------


def _table_entry(req: ReqV, i: int) -> Any:
    return z3.And(req.live, i < req.tl)


def keys_name_contents(w: World) -> Any:
    """``keys_name_contents`` and ``cached_map_exact``: a block listed under
    a key carries it and holds the rows it names; a keyed block is listed
    under its key."""
    out = []
    for x in range(NB):
        out += [w.key[x] >= NONE, w.lk[x] >= NONE,
                z3.Implies(z3.Or(w.key[x] >= 0, w.lk[x] >= 0), z3.And(w.key[x] == w.lk[x], w.rows[x] == w.key[x]))]
    return z3.And(*out)


def requests_read_their_rows(d: Domain, w: World) -> Any:
    """Every live request's block i holds its rows: a full block the rows
    its key ``k[i]`` names, the partial tail the rows named ``p``."""
    out = []
    for req in w.reqs:
        for i in range(NB):
            with d.under(req.live):
                full = is_full(d, z3.IntVal(i), req.n, w.B)
            out.append(z3.Implies(_table_entry(req, i), sel(w.rows, req.t[i]) == z3.If(full, req.k[i], req.p)))
    return z3.And(*out)


def full_blocks_keyed(d: Domain, w: World) -> Any:
    """Every full block of a live request is keyed under its own key."""
    out = []
    for req in w.reqs:
        for i in range(NB):
            with d.under(req.live):
                full = is_full(d, z3.IntVal(i), req.n, w.B)
            out.append(z3.Implies(z3.And(_table_entry(req, i), full), sel(w.key, req.t[i]) == req.k[i]))
    return z3.And(*out)


def key_invariant(d: Domain, w: World) -> Any:
    """Obligation 22's invariant: key to content, the cached map exact,
    requests read their rows, full blocks keyed."""
    return z3.And(keys_name_contents(w), requests_read_their_rows(d, w), full_blocks_keyed(d, w))


def requests_well_formed(w: World) -> Any:
    """A request slot is unknown, live or preempted; a known one has
    tokens, its key names are distinct (prefixes of different lengths) and
    >= 0, its partial rows' name is no key's (<= -2)."""
    out = []
    for req in w.reqs:
        known = z3.Or(req.live, req.pre)
        names = z3.And(req.n >= 1, req.p <= -2, *[req.k[i] >= 0 for i in range(NB)],
                       *[req.k[i] != req.k[m] for i in range(NB) for m in range(i + 1, NB)])
        out += [z3.Not(z3.And(req.live, req.pre)), z3.Implies(known, names)]
    return z3.And(*out)


def refcounts_match_tables(w: World) -> Any:
    """``refcounts_match_tables``: a block's refcount is the number of live
    tables holding it, never negative; a table holds in-range blocks, each
    at most once."""
    out = [*[w.rc[x] == holders(w, x) for x in range(NB)], *[w.rc[x] >= 0 for x in range(NB)]]
    for req in w.reqs:
        for i in range(NB):
            out.append(z3.Implies(_table_entry(req, i), z3.And(req.t[i] >= 0, req.t[i] < NB)))
            out += [z3.Implies(_table_entry(req, m), req.t[i] != req.t[m]) for m in range(i + 1, NB)]
    return z3.And(*out)


def tables_sized(d: Domain, w: World) -> Any:
    """``tables_sized``: a live request's table has ``blocks_for(n, B)``
    entries (at most NB: the pool's size)."""
    out = []
    for req in w.reqs:
        with d.under(req.live):
            size = blocks_for(d, req.n, w.B)
        out.append(z3.Implies(req.live, z3.And(req.tl == size, req.tl >= 0, req.tl <= NB)))
    return z3.And(*out)


def partial_tail_private(d: Domain, w: World) -> Any:
    """``partial_tail_private``: a live request's partial tail has refcount 1
    and no key."""
    out = []
    for req in w.reqs:
        with d.under(req.live):
            partial = blocks_for(d, req.n, w.B) != full_blocks(d, req.n, w.B)
        tail = sel(req.t, req.tl - 1)
        out.append(z3.Implies(z3.And(req.live, partial), z3.And(sel(w.rc, tail) == 1, sel(w.key, tail) == NONE)))
    return z3.And(*out)


def refcount_invariant(d: Domain, w: World) -> Any:
    """Obligation 23's invariant: refcounts match the live tables, tables
    sized, the partial tail private, requests well formed."""
    return z3.And(refcounts_match_tables(w), tables_sized(d, w), partial_tail_private(d, w), requests_well_formed(w))


def free_queue_exact(w: World) -> Any:
    """``free_queue_exact`` (obligation 24's invariant): the queue holds
    exactly the blocks of refcount 0, each once."""
    out = [w.qn >= 0, w.qn <= NB]
    for i in range(NB):
        out.append(z3.Implies(i < w.qn, z3.And(w.q[i] >= 0, w.q[i] < NB)))
        out += [z3.Implies(m < w.qn, w.q[i] != w.q[m]) for m in range(i + 1, NB)]
    out += [in_queue(w, z3.IntVal(x)) == (w.rc[x] == 0) for x in range(NB)]
    return z3.And(*out)


def invariant(d: Domain, w: World) -> Any:
    """The whole invariant: the three obligations' together (each assumes
    all three before an op and proves its own after it)."""
    return z3.And(w.B >= 1, key_invariant(d, w), refcount_invariant(d, w), free_queue_exact(w))
