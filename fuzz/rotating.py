"""The sliding-window cache's harness (kind ``rotating``): the lockstep driver
of ``kvspec.spec.rotating`` against ``kvspec.impl.rotating.RotatingKVCache`` and its state
machine."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import mlx.core as mx
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvspec.fuzz.lockstep import Divergence, Lockstep
from kvspec.fuzz.machine import (
    HEAD_DIMS,
    KV_HEADS,
    SMALL_STEPS,
    LifecycleRules,
    StateProtocolMachine,
    without_lifecycle,
)
from kvspec.fuzz.masks import check_ring_masks, mask_as_rows
from kvspec.fuzz.trace import TraceFormatError
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec import rotating as sr
from kvspec.spec.errors import RollbackWarning

__all__ = ["RotatingLockstep", "RotatingMachine", "mask_as_rows"]


class RotatingLockstep(Lockstep):
    """Drives a spec ``RotatingWorld`` and an impl ``RotatingKVCache``, both
    with the trace's undo depth ``undo``.

    Besides the common checks it compares the ring cursor ``idx``, with an
    undo log ``trimmable_rows()`` and ``log_saved_rows()`` (the log's memory),
    after every op ``state`` against the valid rows, and, before every
    append, ``make_mask``
    (array and short forms) with the spec's visibility rule over the keys
    the append will return. On our ring it also checks the refused-rollback
    warning (:meth:`check_rollback_warning`)."""

    spec_module = sr

    @classmethod
    def check_cache(cls, cache: dict[str, Any]) -> None:
        if cache["keep"] >= cache["max_size"]:
            raise TraceFormatError(f"field cache.keep: must be < max_size ({cache['max_size']}), got {cache['keep']}")
        undo = cache.get("undo", 0)
        if not isinstance(undo, int) or isinstance(undo, bool) or undo < 0:
            raise TraceFormatError(f"field cache.undo: must be an integer >= 0, got {undo!r}")

    def __init__(self, cache: dict[str, Any], cache_factory=RotatingKVCache):
        super().__init__(cache)
        self.undo = cache.get("undo", 0)
        self.world = sr.RotatingWorld(
            sr.new_cache(cache["max_size"], cache["keep"], cache["step"], self.spec_inplace(), cache["mode"], self.undo)
        )
        self.prev_world = self.world
        self.reached(f"undo={self.undo}")
        self.cache = self.build(cache_factory, max_size=cache["max_size"], keep=cache["keep"], step=cache["step"],
                                mode=cache["mode"], **({"undo": self.undo} if self.undo else {}))

    # -- the refused-rollback warning ---------------------------------------------------
    #: the ring the expected warning state is about, and whether it has
    #: warned (spec side); another ring object (a copy the trace goes on
    #: with, a reload) is another cache, which has not warned
    _warn_cache: Any = None
    _warned = False

    def _run_step(self, index: int, op: dict[str, Any]) -> None:
        """The step with the RollbackWarnings it issues recorded (the
        harness's own filter ignores them; here they are counted), then
        :meth:`check_rollback_warning`. Other warnings are issued again."""
        if not isinstance(self.cache, RotatingKVCache):  # an mlx-lm target's adapter: no warning to check
            super()._run_step(index, op)
            return
        before = self.world.cache
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", RollbackWarning)
            super()._run_step(index, op)
        for w in seen:
            if not issubclass(w.category, RollbackWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        self.check_rollback_warning(index, op, before, sum(issubclass(w.category, RollbackWarning) for w in seen))

    def check_rollback_warning(self, index: int, op: dict[str, Any], before: Any, issued: int) -> None:
        """The rule of ``RotatingKVCache.warn_refused_rollback``: a ring warns
        (one RollbackWarning, ``rollback_warned`` set) at its first refused
        rollback and never again: a trim of ``min(n, offset) >
        kvspec.spec.rotating.trimmable_rows`` rows, or ``is_trimmable()`` False
        (the step's observables ask it). A copy or a reload is another
        cache. Raises Divergence on another count of warnings this step, or
        on a ``rollback_warned`` that differs."""
        if self.cache is not self._warn_cache:
            self._warn_cache, self._warned = self.cache, False
        refused, refused_trim = False, 0
        if op["op"] == "trim" and not self.refused:
            n = max(0, min(int(op["n"]), before.offset))
            if n > sr.trimmable_rows(before):
                refused, refused_trim = True, n
        if op["op"] != "expect" and not sr.is_trimmable(self.world.cache):
            refused = True
        want = 1 if refused and not self._warned else 0
        self._warned = self._warned or refused
        got_flag = getattr(self.cache, "rollback_warned", None)
        if (issued, got_flag) != (want, self._warned):
            raise Divergence(index, op, "refused-rollback warning (one RollbackWarning per cache, at its first "
                                        "refused rollback)",
                             f"{want} warnings this step, rollback_warned={self._warned}",
                             f"{issued} warnings this step, rollback_warned={got_flag}")
        if want:
            self.probe_strict_refusal(index, op, refused_trim)

    def probe_strict_refusal(self, index: int, op: dict[str, Any], n: int) -> None:
        """The refusal again, on a copy (another cache, not warned; sharing
        the buffers, which a refusal does not write) under
        ``warnings.simplefilter("error", RollbackWarning)``: it must raise,
        and leave the copy's ``rollback_warned`` unset (a warning that
        raised was not issued, so every strict refusal raises)."""
        probe = copy.copy(self.cache)
        raised = False
        with warnings.catch_warnings():
            warnings.simplefilter("error", RollbackWarning)
            try:
                probe.trim(n) if n else probe.is_trimmable()
            except RollbackWarning:
                raised = True
        flag = probe.rollback_warned
        del probe
        if not raised or flag:
            what = f"trim({n})" if n else "is_trimmable()"
            raise Divergence(index, op, f"strict refused rollback (a copy's {what} under an error filter)",
                             "raises RollbackWarning, rollback_warned stays False",
                             f"raised: {raised}, rollback_warned={flag}")

    def impl_apply(self, op: dict[str, Any]) -> Any:
        result = self.impl_common(op)
        if result is not self._UNHANDLED:
            return result
        raise sr.unsupported(op["op"])

    #: Also check ``make_mask`` with a window narrower than the ring. Off for
    #: mlx-lm targets: their conformance findings were reported with the
    #: ring's own window, and a narrower window is not part of that report.
    narrow_masks = True

    def before_append(self, op: dict[str, Any]) -> None:
        self.check_masks(op)

    def check_masks(self, op: dict[str, Any]) -> None:
        """make_mask before the append, as an mlx-lm model calls it
        (kvspec.fuzz.masks.check_ring_masks)."""
        check_ring_masks(self, op, self.world.cache, self.cache, self.narrow_masks)

    # -- memory sharing -----------------------------------------------------------
    def spec_buffers(self) -> dict[str, Any]:
        w = self.world
        out: dict[str, Any] = {"cache": w.cache.ident if w.cache.slots else None}
        for name, holder in w.holders.items():
            out["holder:" + name] = holder.cache.ident if holder.cache.slots else None
        return out

    def impl_values_pointer(self) -> int | None:
        return None if self.cache.values is None else self.pointer(self.cache.values)

    def impl_pointers(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {"cache": None if self.cache.keys is None else self.pointer(self.cache.keys)}
        for name, snap in self.holders.items():
            out["holder:" + name] = None if getattr(snap, "keys", None) is None else self.pointer(snap.keys)
        return out

    def step(self, index: int, op: dict[str, Any]) -> None:
        self.current_index = index
        super().step(index, op)

    def compare_append(self, index: int, op: dict[str, Any], s: Any, i: Any) -> None:
        super().compare_append(index, op, s, i)
        c, ret = self.cache, self.returned
        if (op["n"] == 1 and isinstance(c, RotatingKVCache) and ret is not None
                and any(r is x for r in ret for x in (c.keys, c.values))):
            # a decode's window is the caller's: slices or new handles, never
            # the ring's own buffer objects (an assignment into the window
            # would write the ring). Decode only: a multi-row append (_prefill)
            # returns the ring's buffers, as mlx-lm's ring does (not checked)
            raise Divergence(index, op, "the returned window is the ring's own buffer object",
                             "slices or new handles (the caller's to assign into)", "the buffer array itself")
        before = self.prev_world.cache
        if op["n"] == 1 and before.offset >= before.max_size:
            self.reached("steady-state decodes")
        if op["n"] > 1 and before.wrapped:
            self.reached("multi-row appends after a wrap")
        if op["n"] > 1 and len(s.window) > before.max_size:
            self.reached("returns longer than the window")
        if before.idx >= before.max_size or (before.wrapped and self.world.cache.idx <= before.idx and op["n"] == 1):
            self.reached("wraps")
        if op["n"] == 1 and (before.offset >= before.max_size) and (self.prev_world.holders or self.prev_world.held):
            self.reached("steady-state writes beside a holder")

    def compare_result(self, index: int, op: dict[str, Any], s: Any, i: Any) -> None:
        super().compare_result(index, op, s, i)
        before = self.prev_world.cache
        if op["op"] in ("trim", "trim_to") and s and before.wrapped:
            self.reached("rollbacks after a wrap")
            if s == before.undo:
                self.reached("rollbacks of exactly U rows")
            if before.log and before.log[-1].kind == "prefill" and s >= before.log[-1].rows:
                self.reached("rollbacks of a whole block")
        if op["op"] == "restore" and before.log:
            self.reached("restores over a non-empty undo log")

    def compare_state(self, index: int, op: dict[str, Any]) -> None:
        super().compare_state(index, op)
        self.compare_protocol_state(index, op)

    def reload_class(self) -> type | None:
        """The class under test (an mlx-lm target's adapter has no kvspec
        load). A reloaded ring keeps its undo depth but not its log (a load
        is a restore), which the fixpoint's ``meta_state`` and arrays do
        not show; tests/test_prompt_cache_files.py checks that part."""
        return type(self.cache) if isinstance(self.cache, RotatingKVCache) else None

    _protocol_equal: Any = ()

    def more_to_evaluate(self, views: dict[str, Any], state: Any) -> list[Any]:
        """``state`` equal to the fetched rows, array by array (lazy; empty
        when their count or shapes differ), for compare_protocol_state."""
        rows = views.get("cache")
        self._protocol_equal = []
        if isinstance(self.cache, RotatingKVCache) and rows is not None and state is not None and len(state) == 2 \
                and all(tuple(a.shape) == tuple(b.shape) for a, b in zip(state, rows)):
            self._protocol_equal = [mx.array_equal(a, b, equal_nan=True) for a, b in zip(state, rows)]
        return self._protocol_equal

    def compare_protocol_state(self, index: int, op: dict[str, Any]) -> None:
        """mlx-lm's ``state`` (what a prompt-cache file saves and what
        ``from_state`` rebuilds from) holds exactly the valid rows that
        ``fetch`` returns, which the views compare with the spec: no unwritten
        slot of a warm-up buffer grown past ``offset``."""
        if not isinstance(self.cache, RotatingKVCache):  # an mlx-lm target's adapter
            return
        state, rows = self.step_state(), self.step_views()["cache"]
        if rows is None:
            if len(state) == 0:
                return
            raise Divergence(index, op, "state differs from the valid rows", "()",
                             [tuple(a.shape) for a in state])
        equal = self._protocol_equal if self._step_state is state else self.more_to_evaluate({"cache": rows}, state)
        if equal:
            mx.eval(*equal)  # already evaluated by the step's prefetch, or both at once here
            if all(bool(e) for e in equal):
                return
        raise Divergence(index, op, "state differs from the valid rows", [tuple(a.shape) for a in rows],
                         [tuple(a.shape) for a in state])

    def spec_observables(self) -> dict[str, Any]:
        c = self.world.cache
        out = {"offset": c.offset, "idx": c.idx, "capacity": c.capacity, "trimmable": sr.is_trimmable(c)}
        if self.undo:
            out["trimmable_rows"] = sr.trimmable_rows(c)
            # the log's memory (rows it holds per K/V buffer), not only what
            # it can roll back: a row saved where none was valid is waste
            out["log_saved_rows"] = sr.log_saved_rows(c.log)
        return out

    def impl_observables(self) -> dict[str, Any]:
        c = self.cache
        out = {"offset": c.offset, "idx": c.idx, "capacity": c.capacity, "trimmable": c.is_trimmable()}
        if self.undo:
            out["trimmable_rows"] = c.trimmable_rows()
            out["log_saved_rows"] = c.log_saved_rows()
        return out


#: the ring's undo depths a machine draws (U = 0: no log, as mlx-lm's ring)
UNDO_DEPTHS = (0, 1, 2, 3, 4)


class RotatingMachine(LifecycleRules, StateProtocolMachine):
    """Sliding-window ops with W 2 to 16, K 0 to 3, step 1 to 8, undo depth U
    0 to 4 (0 on mlx-lm targets, which have no undo log): mixed decode and
    multi-row appends, trims before and after the wrap, snapshots and held
    windows in warm-up and in the steady state; after a wrap, the
    speculative pattern (append a block of up to U + 1 rows, then trim part
    or all of it) and rollbacks of the latest decode steps up to the bound."""

    kind = "rotating"

    @initialize(
        data=st.data(),
        max_size=st.one_of(st.integers(2, 6), st.integers(2, 16)),
        step=SMALL_STEPS,
    )
    def init(self, data: st.DataObject, max_size: int, step: int) -> None:
        keep = data.draw(st.integers(0, min(3, max_size - 1)), label="keep")
        extra = {}
        if self.target is None or self.target.is_impl:
            # sampled, not an integer range: Hypothesis skews integers to
            # their ends, and every depth is a must_reach edge of a campaign
            # that may run only ~30 examples (the GPU's rate)
            extra["undo"] = data.draw(st.sampled_from(UNDO_DEPTHS), label="undo")
        self.setup(max_size=max_size, keep=keep, step=step, **self.draw_shape(data), **extra)

    @rule()
    def decode_again(self) -> None:
        """Decode steps dominate, and the ring needs W of them to wrap."""
        self.do({"op": "append", "n": 1})

    @rule(n=st.integers(2, 9))
    def prefill(self, n: int) -> None:
        self.do({"op": "append", "n": n})

    def _wrapped(self) -> bool:
        return self.lock is not None and self.lock.world.cache.wrapped

    @precondition(_wrapped)
    @rule(data=st.data())
    def speculate(self, data: st.DataObject) -> None:
        """After a wrap: a verification block of 2 to U + 2 rows, then a trim
        of part or all of it (the speculative rollback)."""
        undo = self.lock.world.cache.undo
        n = data.draw(st.integers(2, undo + 2), label="block")
        self.do({"op": "append", "n": n})
        reject = data.draw(st.one_of(st.sampled_from([n, n - 1]), st.integers(1, n)), label="reject")
        self.do({"op": "trim", "n": reject})

    def _block_fits(self) -> bool:
        return self._wrapped() and self.lock.world.cache.undo >= 2

    @precondition(_block_fits)
    @rule(data=st.data())
    def reject_block(self, data: st.DataObject) -> None:
        """After a wrap, at undo depth U >= 2: a verification block of 2 to
        U rows, then reject all of it (a rollback of a whole multi-row
        append, which :meth:`speculate` reaches only when its block fits the
        log and its draw rejects all of it). Its own rule, so a campaign of
        a few dozen examples reaches the edge (verify requires it)."""
        n = data.draw(st.integers(2, self.lock.world.cache.undo), label="block")
        self.do({"op": "append", "n": n})
        self.do({"op": "trim", "n": n})

    @precondition(_wrapped)
    @rule(data=st.data())
    def draft_steps(self, data: st.DataObject) -> None:
        """After a wrap: 1 to U + 1 decode steps (a draft model's), then
        take them back (all of them at depth U is a rollback of exactly U)."""
        undo = self.lock.world.cache.undo
        n = data.draw(st.integers(1, undo + 1), label="steps")
        for _ in range(n):
            self.do({"op": "append", "n": 1})
        self.do({"op": "trim", "n": n})

    @precondition(_wrapped)
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        """After a wrap: trim at the bound, one row less, one row more, or one."""
        bound = sr.trimmable_rows(self.lock.world.cache)
        n = data.draw(st.sampled_from(sorted({bound, max(bound - 1, 1), bound + 1, 1})), label="n")
        self.do({"op": "trim", "n": n})

    @invariant()
    def cursor_in_range(self) -> None:
        """semantics.md 5.6: K <= idx <= capacity once the ring has wrapped
        (in fact K < idx: a wrapped cursor has always just written past the
        sinks, which is also what restore demands of a snapshot)."""
        if self.lock is None or set(getattr(self.lock, "not_compared", ())) & {"idx", "capacity", "keep"}:
            return  # not held to them (fuzz/targets.py)
        c = self.lock.cache
        try:
            idx, capacity, keep, offset = c.idx, c.capacity, c.keep, c.offset
        except Exception:  # noqa: BLE001 - not the invariant's to report
            # a class without them, or a getter of the target's that crashes
            # (the lockstep reads every observable after every op: a crash
            # there is a divergence, never this machine's tool failure)
            return
        try:
            idx_ok, keep_ok = 0 <= idx <= max(capacity, 0), offset == idx or keep < idx
        except TypeError:
            return  # a value that is no number (None): the lockstep compares it after every op
        assert idx_ok, (idx, capacity)
        assert keep_ok, (keep, idx)


@without_lifecycle
class PlainRotatingMachine(RotatingMachine):
    """The ring machine as mlx-lm targets run it (batch 1, one head dim,
    float16), drawn in the order their conformance findings were recorded
    with."""

    @initialize(
        data=st.data(),
        max_size=st.one_of(st.integers(2, 6), st.integers(2, 16)),
        step=SMALL_STEPS,
        head_dim=HEAD_DIMS,
        kv_heads=KV_HEADS,
    )
    def init(self, data: st.DataObject, max_size: int, step: int, head_dim: int,  # type: ignore[override]
             kv_heads: int) -> None:
        keep = data.draw(st.integers(0, min(3, max_size - 1)), label="keep")
        self.setup(max_size=max_size, keep=keep, step=step, head_dim=head_dim, kv_heads=kv_heads)


RotatingMachine.plain = PlainRotatingMachine

