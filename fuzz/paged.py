"""The paged cache's harness (kind ``paged``): the lockstep driver of
``kvspec.spec.paged`` against ``kvspec.impl.paged.BlockPool`` and its state machine.

Besides the common checks (refusals and their messages, returned windows,
the in-place decision, trace checks) the driver compares after every op
every sequence's window byte for byte (so a write that reaches another
sequence's rows is an isolation failure), every sequence's block table,
length and logical start, the refcounts, the free list and the pool size,
which blocks an append allocated and which it copied on write, and the
pool invariants on the implementation itself (refcount = tables holding the
block, no block free and held, in use + free = size, tables well formed),
mlx-lm's protocol accessors (``PagedKVCache`` offset, size, live_len,
empty, nbytes) on every sequence against the spec's, and windows fetched
at an append but read only a few ops later (MLX is lazy).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, ClassVar

import mlx.core as mx
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvspec.fuzz.lockstep import Divergence, Lockstep, reload_through_file
from kvspec.fuzz.machine import APPEND_N, HEAD_DIMS, KV_HEADS, KVMachine, LifecycleRules
from kvspec.fuzz.masks import check_dense_masks
from kvspec.fuzz.trace import TraceFormatError
from kvspec.impl.paged import BlockPool, PagedKVCache
from kvspec.spec import paged as sp
from kvspec.spec.errors import StateError


def pool_config(cache: dict[str, Any]) -> dict[str, Any]:
    """BlockPool / kvspec.spec.paged.new_world arguments from a kvtrace cache
    (``max_blocks`` 0 means no maximum)."""
    return {"block_size": cache["block_size"], "max_blocks": cache["max_blocks"] or None,
            "chunk": cache["chunk"], "inplace": cache["inplace"]}


#: Public members of the handle class that do not reach its sequence, with
#: why they are not reuses (everything else public is: :func:`handle_api`).
NOT_REUSES = {
    "is_trimmable": "a constant of the class (True), asked before any sequence exists",
    "to_quantized": "refused on every handle, spent or not (UnsupportedOperationError)",
    "refuse_prompt_cache_file": "the file layer's hook: refuses on every handle, spent or not",
    "from_state": "a classmethod: builds a new cache on a new pool, never a handle's sequence",
}
#: the ``use`` a method is drawn as, where it is not the method's name
REUSE_OF_METHOD = {"update_and_fetch": "append"}


def handle_api(cls: type = PagedKVCache) -> dict[str, tuple[str, str]]:
    """Every way of using a handle of ``cls`` again, derived from the class
    itself rather than listed by hand: ``use`` (kvtrace ``handle_reuse``) ->
    (member name, ``"call"`` / ``"get"`` / ``"set"``). Each public method
    and each property (read, and assigned as ``set_<name>`` where it has a
    setter), less :data:`NOT_REUSES`. A member added to the class is drawn
    at once (and ``kvspec.spec.paged.HANDLE_REUSES`` must answer it:
    tests/test_fuzz_paged.py holds the two to the same set)."""
    uses: dict[str, tuple[str, str]] = {}
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or name in NOT_REUSES:
            continue
        if isinstance(member, property):
            uses[name] = (name, "get")
            if member.fset is not None:
                uses["set_" + name] = (name, "set")
        elif callable(member):
            uses[REUSE_OF_METHOD.get(name, name)] = (name, "call")
    return uses


class PagedLockstep(Lockstep):
    """Drives a spec ``PagedWorld`` and an impl ``BlockPool`` (one layer).
    ``self.cache`` is a ``PagedKVCache`` on ``main`` (mlx-lm's protocol)."""

    spec_module = sp

    @classmethod
    def check_cache(cls, cache: dict[str, Any]) -> None:
        if cache["batch"] != 1:
            raise TraceFormatError(f"field cache.batch: a paged sequence holds batch 1, got {cache['batch']}")

    def __init__(self, cache: dict[str, Any], pool_factory=BlockPool):
        super().__init__(cache)
        cfg = pool_config(cache)
        self.world = sp.new_world(**cfg)
        self.prev_world = self.world
        # the bug catalog hands in a BlockPool subclass, or a PagedKVCache
        # subclass (the handle class: copies, spent handles, the file layer)
        self.cache_class: type = PagedKVCache
        if isinstance(pool_factory, type) and issubclass(pool_factory, PagedKVCache):
            self.cache_class, pool_factory = pool_factory, BlockPool
        self.pool = pool_factory(**cfg)
        self.cache = self.cache_class(self.pool)
        #: the handle of each live sequence (main's, and the one made at its
        #: fork), and the handles releases consumed, by name
        self.handles: dict[str, Any] = {sp.MAIN: self.cache}
        self.spent: dict[str, Any] = {}
        self.current_seq = sp.MAIN
        #: (op index, window fetched and never read, its tokens): see
        #: :meth:`compare_unread`
        self.unread: list[tuple[int, Any, tuple[int, ...]]] = []

    def step(self, index: int, op: dict[str, Any]) -> None:
        self.current_index, self.current_seq = index, op.get("seq", sp.MAIN)
        if op["op"] == "expect" and "of" not in op:
            op = {**op, "of": self.current_seq}
        before = self.world
        super().step(index, op)
        if self.world is not before:
            self.step_stats(op)

    def view_key(self, name: str) -> str:
        return "seq:" + name

    def spec_apply(self, op: dict[str, Any]) -> tuple[Any, Any]:
        """The op on the spec world; the op's sequence is the one whose
        ``capacity`` the observables report (also when a trace is annotated
        without stepping). A ``reload`` in mlx-lm's load order is given only
        on a sequence that starts at position 0 (``kvspec.spec.paged.reload``)."""
        self.current_seq = op.get("seq", sp.MAIN)
        s = self.world.seqs.get(self.current_seq)
        if op["op"] == "reload" and op.get("via") == "state" and s is not None and s.start > 0:
            raise TraceFormatError("reload: via 'state' only on a sequence that starts at position 0 (a front-trimmed "
                                   "sequence comes back from position 0 and its counters are refused)")
        return super().spec_apply(op)

    # -- the implementation side -----------------------------------------------
    def impl_apply(self, op: dict[str, Any]) -> Any:
        p, name, seq = self.pool, op["op"], op.get("seq", sp.MAIN)
        if name == "append":
            self.check_mask(op)
            start = self.world.next_token  # the spec world before this op
            k, v = self.input_rows(list(range(start, start + op["n"])))
            self.returned = p.append(seq, k, v)
            return self.returned
        if name == "fetch":
            return p.fetch(seq)
        if name in ("hold", "release_hold"):
            return self.impl_hold(name)
        if name == "trim":
            return p.trim(seq, op["n"])
        if name == "trim_to":
            return p.trim_to(seq, op["len"])
        if name == "trim_front":
            return p.trim_front(seq, op["n"], op.get("keep", 0))
        if name == "fork":
            p.fork(op.get("from", sp.MAIN), op["as"])
            self.handles[op["as"]] = self.cache_class(p, op["as"])
            if op["as"] == sp.MAIN:
                self.cache = self.handles[sp.MAIN]
            return None
        if name == "release":
            p.release(seq)
            if seq in self.handles:
                self.spent[seq] = self.handles.pop(seq)
            return None
        if name in ("snapshot", "restore", "drop"):
            raise sp.snapshots_by_fork(name)
        if name in ("copy", "reload", "handle_reuse"):
            return self.lifecycle(op, seq)
        if name == "state_assign":
            return self.assign_state(op, seq)
        if name == "append_mismatch":
            return p.append(seq, *self.mismatched_rows(op["n"], op["differs"]))
        if name == "append_pair_mismatch":
            return p.append(seq, *self.pair_mismatched_rows(op["n"], op["differs"]))
        raise sp.UnsupportedOperationError(f"{name}: not an operation of a paged cache")

    def lifecycle(self, op: dict[str, Any], seq: str) -> None:
        """A sequence's handle outside the decode loop: ``copy`` (copy.copy /
        copy.deepcopy of its handle), ``reload`` (through a prompt-cache
        file) and ``handle_reuse`` (the handle a release consumed, used
        again). The spec refuses each (``kvspec.spec.paged.copy_refused``,
        ``reload``, ``handle_reuse``); a handle that goes through returns
        None here and the refusal comparison reports it."""
        name = op["op"]
        if name == "handle_reuse":
            use, handle = op.get("use", "append"), self.spent.get(seq)
            api = handle_api(type(handle)) if handle is not None else {}
            if handle is None or use not in sp.HANDLE_REUSES or use not in api:
                sp.handle_reuse(self.world, seq, use)  # the trace's own mistake: refused as the spec words it
            self.use_handle(handle, seq, *api[use], arg=op.get("arg", "valid"))
            return
        handle = self.handles.get(seq)
        if handle is None:
            raise StateError(f"{name}: no sequence named {seq!r}")
        if name == "copy":
            copy.deepcopy(handle) if op.get("deep", True) else copy.copy(handle)
            return
        via = op.get("via", "file")
        if via == "state":  # mlx-lm's load order on the sequence's handle
            state, meta = handle.state, handle.meta_state
            handle.state = state
            handle.meta_state = meta
            self.reached("loads in mlx-lm's order")
            return
        if via != "file":
            sp.reload(self.world, seq, via)  # refused as the spec words it
        reload_through_file([handle])

    def assign_state(self, op: dict[str, Any], seq: str) -> None:
        """``handle.state = (keys, values)`` on ``seq``'s handle with
        ``n`` rows of the next token identities (``n == 0``: ``state =
        ()``): the setter under test, against ``kvspec.spec.paged.state_assign``
        (a refusal, e.g. the pool exhausted, changes nothing)."""
        handle = self.handles.get(seq)
        if handle is None:
            raise StateError(f"state: no sequence named {seq!r}")
        n = op["n"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            sp.state_assign(self.world, seq, n)  # the trace's own mistake: refused as the spec words it
        start = self.world.next_token
        handle.state = self.input_rows(list(range(start, start + n))) if n else ()
        self.reached("state assignments")

    #: kvtrace ``handle_reuse``'s ``arg``: the arguments a reused method
    #: gets: ``valid`` (a count of 1, position 0, a fresh name) or one the
    #: method would refuse on a live handle (``zero``: counts 0, an empty
    #: name; ``negative``: counts and positions -1, the name of a live
    #: sequence). kvspec.spec.paged.handle_reuse refuses with StateError whatever
    #: the arguments: the spent handle is refused before they are read.
    REUSE_ARGS = ("valid", "zero", "negative")

    def reuse_argument(self, member: str, param: str, seq: str, arg: str = "valid") -> Any:
        """The value a reused handle's ``member`` gets for its required
        parameter ``param`` under ``arg`` (:data:`REUSE_ARGS`). Raises
        TraceFormatError for a parameter this table does not know (a new
        method must be given one, never skipped) or another ``arg``."""
        if arg not in self.REUSE_ARGS:
            raise TraceFormatError(f"handle_reuse: arg must be one of {', '.join(self.REUSE_ARGS)}, got {arg!r}")
        if param in ("n", "N"):
            return {"valid": 1, "zero": 0, "negative": -1}[arg]
        if param in ("length", "keep"):
            return {"valid": 0, "zero": 0, "negative": -1}[arg]
        if param == "name":
            return {"valid": f"{seq}.reused", "zero": "", "negative": sp.MAIN}[arg]
        raise TraceFormatError(f"handle_reuse: no value for parameter {param!r} of PagedKVCache.{member} "
                               "(kvspec.fuzz.paged.PagedLockstep.reuse_argument)")

    def use_handle(self, handle: Any, seq: str, member: str, how: str, arg: str = "valid") -> None:
        """``handle``'s ``member`` called (its required parameters from
        :meth:`reuse_argument`; ``update_and_fetch`` one row of the next
        token), read, or assigned (``state``: one row of the next token;
        ``meta_state``: counters of one row from position 0)."""
        if how == "get":
            getattr(handle, member)
            return
        if how == "set":
            rows = self.input_rows([self.world.next_token])
            value = rows if member == "state" else (str(self.world.pool.block_size), "1", "0")
            setattr(handle, member, value)
            return
        fn = getattr(handle, member)
        if member == "update_and_fetch":
            fn(*self.input_rows([self.world.next_token]))
            return
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        fn(*(self.reuse_argument(member, p.name, seq, arg) for p in params))

    def check_mask(self, op: dict[str, Any]) -> None:
        """make_mask before the append, as an mlx-lm model calls it, in
        array and short form, with and without a window, against
        kvspec.spec.dense.dense_make_mask over the sequence's visible rows plus
        the new ones (kvspec.fuzz.masks.check_dense_masks)."""
        seq = op.get("seq", sp.MAIN)
        if seq not in self.pool.seqs:
            return
        check_dense_masks(self, op, self.pool.seqs[seq].visible, PagedKVCache(self.pool, seq))

    def impl_last_inplace(self) -> bool:
        return self.pool.last_write.inplace

    #: ops an unread window waits before it is read
    UNREAD_AGE = 4

    def compare_unread(self, index: int, op: dict[str, Any]) -> None:
        """MLX is lazy: a window that nobody has read yet must not come to
        depend on slab memory later in-place writes change. Every append
        fetches its sequence once more and leaves that window unread for
        :attr:`UNREAD_AGE` ops (trims, rewrites in place, releases and block
        reuse in between), then reads it: it must hold the rows it held."""
        while self.unread and index - self.unread[0][0] >= self.UNREAD_AGE:
            at, window, tokens = self.unread.pop(0)
            if not self.window_matches(tokens, window):
                raise Divergence(index, op, f"a window fetched at op {at} and read only now changed", list(tokens),
                                 self.identify(window))

    def compare_append(self, index: int, op: dict[str, Any], s: Any, i: Any) -> None:
        super().compare_append(index, op, s, i)
        self.unread.append((index, self.pool.fetch(op.get("seq", sp.MAIN)), tuple(s.window)))
        w = self.pool.last_write
        if self.check_inplace and (w.fresh, w.copied) != (s.fresh, s.copied):
            raise Divergence(index, op, "blocks allocated / copied on write differ",
                             f"fresh={list(s.fresh)} copied={list(s.copied)}",
                             f"fresh={list(w.fresh)} copied={list(w.copied)}")
        self.note_append(op, s)

    def note_append(self, op: dict[str, Any], s: Any) -> None:
        before = self.prev_world
        seq = op.get("seq", sp.MAIN)
        if s.copied:
            self.reached("copies on write")
        if s.fresh:
            self.reached("fresh blocks")
        old = before.seqs[seq]
        if any(before.pool.refcounts[b] > 1 for b in old.held()):
            self.reached("writes beside shared blocks")
        if old.start > 0:
            self.reached("writes after a front trim")
        if len(before.seqs) >= 3:
            self.reached("writes with 3+ sequences")

    def step_stats(self, op: dict[str, Any]) -> None:
        if op["op"] == "fork" and op.get("from", sp.MAIN) != sp.MAIN:
            self.reached("forks of forks")
        if op["op"] in ("trim", "trim_to", "trim_front"):
            before, after = self.prev_world.pool, self.world.pool
            if before.free != after.free:
                self.reached(f"{op['op']} releasing blocks")
        if op["op"] == "release" and self.prev_world.pool.free != self.world.pool.free:
            self.reached("release freeing blocks")
        if op["op"] == "fork":
            self.reached("forks")

    def compare_state(self, index: int, op: dict[str, Any]) -> None:
        if self.refusals and self.refusals[-1][0] == index and "pool exhausted" in self.refusals[-1][1]:
            self.reached("pool exhausted (refused)")
        broken = sp.broken_invariants(self.world)
        if broken:
            raise Divergence(index, op, "the spec breaks its own invariants", broken, "-")
        super().compare_state(index, op)
        broken = self.pool.broken_invariants()
        if broken:
            raise Divergence(index, op, "pool invariants broken on the implementation", "none", list(broken))
        self.compare_unread(index, op)
        want, got = self.spec_protocol(), self.impl_protocol()
        if want != got:
            raise Divergence(index, op, "mlx-lm protocol accessors differ", want, got)

    # -- the mlx-lm protocol of every sequence --------------------------------
    _ITEMSIZE: ClassVar[dict[str, int]] = {"float16": 2, "bfloat16": 2, "float32": 4}

    def spec_protocol(self) -> dict[str, Any]:
        """What ``PagedKVCache`` must answer on each spec sequence: offset and
        size = length, live_len = visible, empty iff nothing is visible, and
        (write path observed) nbytes = the blocks its table holds."""
        _, h, dk, dv = self.shape
        per_block = self.world.pool.block_size * h * (dk + dv) * self._ITEMSIZE[self.dtype]
        out = {}
        for name, s in sorted(self.world.seqs.items()):
            got = {"offset": s.length, "size": s.length, "live_len": s.visible, "empty": s.visible == 0}
            if self.check_inplace:
                got["nbytes"] = per_block * len(s.held())
            out[name] = got
        return out

    def impl_protocol(self) -> dict[str, Any]:
        out = {}
        for name in sorted(self.pool.seqs):
            c = PagedKVCache(self.pool, name)
            got = {"offset": c.offset, "size": c.size(), "live_len": c.live_len, "empty": c.empty()}
            if self.check_inplace:
                got["nbytes"] = c.nbytes
            out[name] = got
        return out

    # -- observables and views --------------------------------------------------
    def _observables(self, seqs: dict[str, Any], refcounts: list[int], free: list[int], capacity: int) -> dict[str, Any]:
        """With the write path unobserved (``check_inplace`` off: an engine
        whose block ids cannot be seen) only lengths, starts and windows are
        compared, so isolation alone must catch an unsafe write."""
        if not self.check_inplace:
            return {"sequences": {k: (length, start) for k, (_, length, start) in seqs.items()}, "capacity": capacity}
        return {"sequences": seqs, "refcounts": refcounts, "free": free, "pool size": len(refcounts),
                "capacity": capacity}

    def spec_observables(self) -> dict[str, Any]:
        w = self.world
        seqs = {k: (list(s.table), s.length, s.start) for k, s in sorted(w.seqs.items())}
        cur = w.seqs.get(self.current_seq)
        cap = 0 if cur is None else sp.capacity_of(len(cur.table), w.pool.block_size)
        return self._observables(seqs, list(w.pool.refcounts), list(w.pool.free), cap)

    def impl_observables(self) -> dict[str, Any]:
        p = self.pool
        seqs = {k: (list(s.table), s.length, s.start) for k, s in sorted(p.seqs.items())}
        cap = 0 if self.current_seq not in p.seqs else p.capacity(self.current_seq)
        return self._observables(seqs, list(p.refcounts), list(p.free), cap)

    def spec_views(self) -> dict[str, tuple[int, ...]]:
        views = {self.view_key(k): self.world.window(k) for k in self.world.seqs}
        if self.world.held is not None:
            views["held"] = self.world.held
        return views

    def impl_views(self) -> dict[str, tuple[mx.array, mx.array] | None]:
        views: dict[str, Any] = {self.view_key(k): self.pool.fetch(k) for k in self.pool.seqs}
        if self.held is not None:
            views["held"] = self.held
        return views


class PagedMachine(LifecycleRules, KVMachine):
    """Several sequences on one pool, block size 1 to 4: decode and
    multi-row appends on any sequence, forks biased towards forks of forks
    and towards a write right after the fork, trims and front trims biased
    to cross block edges, releases, and refused inputs (unknown sequences,
    names in use, ``keep > 0``, pool exhaustion with a small ``max_blocks``).
    Paged caches snapshot by fork: the base snapshot rules are off. The
    lifecycle rules (:class:`kvspec.fuzz.machine.LifecycleRules`) copy a handle
    (refused: ``fork`` is the paged copy), hand the pool rows of another
    shape or dtype and reload through a prompt-cache file (refused), and
    spent handles are used again (:meth:`reuse_released`)."""

    kind = "paged"
    @rule()
    def reload(self) -> None:  # type: ignore[override]
        """``main`` saved and loaded: through a prompt-cache file (refused)
        and, when it starts at position 0, in mlx-lm's load order on its
        handle (its rows come back in fresh private blocks). No draws: the
        shrinker has nothing more to try (a rule that picked the sequence
        made every paged bug's shrink several times slower)."""
        self.do({"op": "reload", "via": "file"})
        s = self.lock.world.seqs.get(sp.MAIN)
        if s is not None and s.start == 0:
            self.do({"op": "reload", "via": "state"})
    #: copies are refused here: the store pattern has nothing to go on with
    prompt_cache_fetch = None

    @initialize(block_size=st.integers(1, 4), head_dim=HEAD_DIMS, kv_heads=KV_HEADS,
                max_blocks=st.sampled_from([0, 0, 0, 6, 12]), chunk=st.integers(1, 3))
    def init(self, block_size: int, head_dim: int, kv_heads: int, max_blocks: int, chunk: int) -> None:
        self.setup(block_size=block_size, head_dim=head_dim, kv_heads=kv_heads, max_blocks=max_blocks, chunk=chunk)
        self.forks: list[str] = []

    # snapshots are forks here
    def snapshot(self) -> None:  # type: ignore[override]
        """Not a rule for paged caches."""

    def restore(self) -> None:  # type: ignore[override]
        """Not a rule for paged caches."""

    def drop(self) -> None:  # type: ignore[override]
        """Not a rule for paged caches."""

    @rule(data=st.data())
    def misuse_name(self, data: st.DataObject) -> None:  # type: ignore[override]
        """A holder op on a paged cache (snapshot, restore, drop, with a
        sequence's name or an unknown one): both sides must refuse it the
        same way (a paged cache snapshots by fork) and change nothing."""
        names = sorted(self.lock.world.seqs) + ["nope"]
        name = data.draw(st.sampled_from(names), label="name")
        self.do({"op": data.draw(st.sampled_from(self.named_ops), label="op"), "name": name})

    @property
    def offset(self) -> int:
        s = self.lock.world.seqs.get(sp.MAIN)
        return 0 if s is None else s.length

    def pick(self, data: st.DataObject, label: str = "seq") -> str:
        """A sequence: the newest fork most often, any live one, or now and
        then a name that does not exist (a refusal)."""
        live = sorted(self.lock.world.seqs)
        choices: list[Any] = [st.just("ghost")]
        if live:
            choices = [st.sampled_from(live)] * 6 + choices
        newest = [f for f in self.forks if f in self.lock.world.seqs]
        if newest:
            choices = [st.just(newest[-1])] * 6 + choices
        return data.draw(st.one_of(*choices), label=label)

    def length_of(self, seq: str) -> tuple[int, int]:
        s = self.lock.world.seqs.get(seq)
        return (0, 0) if s is None else (s.length, s.start)

    def edge_count(self, data: st.DataObject, seq: str, front: bool) -> int:
        """A trim count that lands on, just before or just after a block
        edge, or any small count (negative included)."""
        length, start = self.length_of(seq)
        bs = self.lock.world.pool.block_size
        pos = start if front else length
        to_edge = (bs - pos % bs) % bs if front else pos % bs
        return data.draw(st.one_of(st.integers(-1, 5), st.sampled_from(
            [to_edge, to_edge + 1, max(0, to_edge - 1), to_edge + bs, length - start])), label="n")

    @rule()
    def decode_again(self) -> None:
        self.do({"op": "append", "n": 1})

    @rule(data=st.data())
    def reuse_released(self, data: st.DataObject) -> None:
        """A handle that a release consumed, used again (a scheduler that
        keeps a finished request's cache object): fork a sequence, write to
        it, release it, often fork a new sequence under the same name, then
        use the old handle again in many ways in turn (from a drawn one, as
        many as drawn): its public methods and properties
        (:func:`handle_api`, derived from the class: append, fetch, every
        trim, fork, release, the protocol accessors, ``state`` and
        ``meta_state`` read or assigned, ``make_mask``). Refused, nothing
        changed: the old handle must not reach the new sequence's blocks."""
        name = self.fresh_name("f")
        self.do({"op": "fork", "from": self.pick(data, "from"), "as": name})
        if name not in self.lock.world.seqs:
            return
        self.do({"op": "append", "n": data.draw(st.integers(1, 3), label="n"), "seq": name})
        self.do({"op": "release", "seq": name})
        if data.draw(st.booleans(), label="name taken again"):
            self.do({"op": "fork", "from": self.pick(data, "from"), "as": name})
        uses = sorted(handle_api(self.lock.cache_class))
        at = uses.index(data.draw(st.sampled_from(uses), label="first use"))
        # each refused, nothing changed: the uses in turn from the first, as many as drawn (a
        # shrunk failure keeps the one that went through)
        count = data.draw(st.integers(1, len(uses)), label="uses")
        for use in (uses[at:] + uses[:at])[:count]:
            # the arguments too: refused ones (N=0, n=-1, ...) must still meet the spent handle first
            arg = data.draw(st.sampled_from(PagedLockstep.REUSE_ARGS), label="arg")
            self.do({"op": "handle_reuse", "seq": name, "use": use, "arg": arg})

    @rule(data=st.data())
    def state_assign(self, data: st.DataObject) -> None:
        """``cache.state = rows`` on a sequence's handle (mlx-lm's snapshot
        restore, a prompt cache loaded into a live handle) with new rows:
        often a sequence sharing blocks with a fork, with a pool ceiling
        often just past the room left (refused late, after the rows were
        checked: the old blocks must still be the sequence's), then a
        decode on it. A sequence holding no block gets a row first."""
        seq = self.pick(data)
        s = self.lock.world.seqs.get(seq)
        if s is not None and not s.held():  # something to replace: the old blocks matter
            self.do({"op": "append", "n": 1, "seq": seq})
            s = self.lock.world.seqs.get(seq)
        pool = self.lock.world.pool
        held = 0 if s is None else len(s.held())
        # fewer, as many or more rows than the sequence's blocks hold (more: the new blocks cannot reuse them)
        n = data.draw(st.one_of(st.sampled_from([held * pool.block_size + 1, (held + 1) * pool.block_size]),
                                st.integers(0, 4)), label="rows")
        if pool.max_blocks is not None and data.draw(st.booleans(), label="at the ceiling"):
            room = len(pool.free) + pool.max_blocks - pool.size
            n = max(0, (room + data.draw(st.integers(0, 1), label="blocks past the room")) * pool.block_size)
        self.do({"op": "state_assign", "n": n, "seq": seq})
        self.do({"op": "append", "n": 1, "seq": seq})

    @rule(data=st.data(), n=APPEND_N)
    def append(self, data: st.DataObject, n: int) -> None:
        self.do({"op": "append", "n": n, "seq": self.pick(data)})

    @rule(data=st.data())
    def burst(self, data: st.DataObject) -> None:
        """With a pool ceiling: an append a few blocks longer than the free
        blocks left (exhaustion, refused with nothing changed) or just
        within them."""
        pool = self.lock.world.pool
        if pool.max_blocks is None:
            return
        room = len(pool.free) + pool.max_blocks - pool.size
        extra = data.draw(st.integers(-1, 2), label="blocks past the room")
        n = max(1, (room + extra) * pool.block_size)
        self.do({"op": "append", "n": n, "seq": self.pick(data)})

    @rule(data=st.data())
    def decode_seq(self, data: st.DataObject) -> None:
        self.do({"op": "append", "n": 1, "seq": self.pick(data)})

    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        source = self.pick(data, "from")
        name = data.draw(st.one_of(st.just(self.fresh_name("f")), st.just(sp.MAIN)), label="as")
        self.do({"op": "fork", "from": source, "as": name})
        if name in self.lock.world.seqs and name not in self.forks:
            self.forks.append(name)

    @rule(data=st.data(), n=st.integers(1, 3))
    def fork_then_write(self, data: st.DataObject, n: int) -> None:
        """A fork and, at once, a write on the fork or on its source: the
        write lands in a shared tail block."""
        source = self.pick(data, "from")
        name = self.fresh_name("f")
        self.do({"op": "fork", "from": source, "as": name})
        if name in self.lock.world.seqs:
            self.forks.append(name)
        self.do({"op": "append", "n": n, "seq": data.draw(st.sampled_from([name, source]), label="writer")})

    @rule(data=st.data())
    def fetch(self, data: st.DataObject) -> None:  # type: ignore[override]
        self.do({"op": "fetch", "seq": self.pick(data)})

    @rule(data=st.data())
    def trim(self, data: st.DataObject) -> None:  # type: ignore[override]
        seq = self.pick(data)
        self.do({"op": "trim", "n": self.edge_count(data, seq, front=False), "seq": seq})

    @rule(data=st.data())
    def trim_to(self, data: st.DataObject) -> None:  # type: ignore[override]
        seq = self.pick(data)
        length, _ = self.length_of(seq)
        self.do({"op": "trim_to", "len": data.draw(st.integers(-1, length + 1), label="len"), "seq": seq})

    @rule(data=st.data())
    def trim_front(self, data: st.DataObject) -> None:
        seq = self.pick(data)
        keep = data.draw(st.sampled_from([0, 0, 0, 0, 1]), label="keep")
        self.do({"op": "trim_front", "n": self.edge_count(data, seq, front=True), "keep": keep, "seq": seq})

    @rule(data=st.data())
    def slide_then_rollback(self, data: st.DataObject) -> None:
        """A sliding window's eviction followed by a rollback on the same
        sequence (speculative decoding on a slid window): the trim must keep
        the table indexed by absolute position."""
        seq = self.pick(data)
        self.do({"op": "trim_front", "n": self.edge_count(data, seq, front=True), "seq": seq})
        self.do({"op": "trim", "n": self.edge_count(data, seq, front=False), "seq": seq})
        self.do({"op": "append", "n": data.draw(st.integers(1, 3), label="n"), "seq": seq})

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq = self.pick(data)
        # releasing main refuses every later decode: keep it mostly
        if seq == sp.MAIN and data.draw(st.integers(0, 3), label="release main") != 0:
            return
        self.do({"op": "release", "seq": seq})

    @invariant()
    def pool_sound(self) -> None:
        """The pool invariants on the implementation (also checked after
        every op by the driver)."""
        if self.lock is not None:
            assert self.lock.pool.broken_invariants() == ()
