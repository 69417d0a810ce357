"""The dense cache's harness (kind ``dense``): the lockstep driver of
``kvspec.spec.dense`` against ``kvspec.impl.dense.KVCache`` and its state machine."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, consumes, initialize, invariant, rule

from kvspec.fuzz.lockstep import Divergence, Lockstep
from kvspec.fuzz.machine import (
    APPEND_N,
    HEAD_DIMS,
    KV_HEADS,
    SMALL_STEPS,
    LifecycleRules,
    StateProtocolMachine,
    without_lifecycle,
)
from kvspec.fuzz.masks import check_dense_masks
from kvspec.fuzz.quant_ref import int8_oracle, int8_oracle_host, quantize
from kvspec.impl.dense import CacheSnapshot, DetachedHandle, KVCache
from kvspec.impl.quant import dequantize_int8
from kvspec.spec import dense as sd
from kvspec.spec.errors import InvalidArgumentError


class DenseOps:
    """The dense family's own ops on the implementation side, after the ops
    every kind shares (``Lockstep.impl_common``): front trims, gathers and
    detached handles. Used by every driver of a dense-kind cache (Fp16/Int8
    here, the Turbo modes in ``fuzz/turbo.py``); ``handle_class`` names the
    driver's handle class."""

    handle_class: Any
    holders: dict[str, Any]

    @property
    def consumed_handles(self) -> dict[str, Any]:
        """Handles ``install`` consumed, by name: an ``install`` of such a
        name hands the very handle in again (spec: refused, nothing changes)."""
        spent = self.__dict__.get("_consumed")
        if spent is None:
            spent = self.__dict__["_consumed"] = {}
        return spent

    def impl_apply(self, op: dict[str, Any]) -> Any:
        c, name = self.cache, op["op"]
        result = self.impl_common(op)
        if result is not self._UNHANDLED:
            return result
        if name == "trim_front":
            return c.trim_front_keep_sink(op["n"], op.get("keep", 0))
        if name == "gather_positions":
            return c.gather_positions(list(op["positions"]))
        if name == "gather_within_tail":
            return c.gather_within_tail(op["tail"], list(op["kept"]))
        if name == "detach":
            self.fresh_name("detach", op["name"])
            self.holders[op["name"]] = c.detach()
            return None
        if name == "install":
            spent = self.consumed_handles.get(op["name"])
            if op["name"] not in self.holders and spent is not None:
                # the handle install consumed, handed in again: the cache
                # itself must refuse it (the harness does not)
                c.install(spent)
                return None
            handle = self.holder("install", op["name"], self.handle_class)
            c.install(handle)
            del self.holders[op["name"]]
            self.consumed_handles[op["name"]] = handle
            return None
        if name == "handle_trim_to":
            handle = self.holder("handle_trim_to", op["name"], self.handle_class)
            return handle.trim_to(op["len"])
        raise InvalidArgumentError(f"{name}: not an operation of a dense cache")


class DenseLockstep(DenseOps, Lockstep):
    """Drives a spec ``DenseWorld`` and an impl ``KVCache`` with the same ops.

    ``cache_factory`` builds the implementation under test (the injected-bug
    catalog passes a patched class)."""

    spec_module = sd
    snapshot_class = CacheSnapshot
    handle_class = DetachedHandle

    def __init__(self, cache: dict[str, Any], cache_factory=KVCache):
        super().__init__(cache)
        self.world = sd.new_world(cache["mode"], cache["step"], self.spec_inplace())
        self.prev_world = self.world
        self.cache = self.build(cache_factory, mode=cache["mode"], step=cache["step"])
        self.mode = cache["mode"]
        self._stored: dict[int, tuple[np.ndarray, ...]] = {}

    def stored_form(self, x: mx.array, mode: str = "fp16") -> mx.array:
        """Int8: the row quantized and read back by the NumPy oracle written
        from the rule's text (kvspec.fuzz.quant_ref), never by kvspec.impl.quant."""
        if mode == "int8":
            if self.oracle_from_impl:
                return dequantize_int8(*self.cache.quantize_rows(x), x.dtype)
            return int8_oracle(x)
        return x

    def host_stored_rows(self, token: int, mode: str) -> tuple[np.ndarray, np.ndarray] | None:
        """Int8: the NumPy oracle on the rows' host form (no MLX round
        trip); the others as the base class."""
        if mode == "int8" and not self.oracle_from_impl:
            k, v = self.host_rows([token])
            return int8_oracle_host(k, self.dtype), int8_oracle_host(v, self.dtype)
        return super().host_stored_rows(token, mode)

    #: Take the expected Int8 bytes from the implementation's own quantizer
    #: instead of the independent oracle: what the harness did before the
    #: oracle existed, kept to show what that misses (a quantizer bug).
    oracle_from_impl = False

    #: Compare make_mask with kvspec.spec.dense.dense_mask_visible before every append.
    check_dense_masks = True

    def before_append(self, op: dict[str, Any]) -> None:
        if self.check_dense_masks:
            check_dense_masks(self, op, self.world.cache.live_len, self.cache)

    def step(self, index: int, op: dict[str, Any]) -> None:
        self.current_index = index
        super().step(index, op)

    # -- Int8's stored form ------------------------------------------------------
    #: Compare an Int8 cache's stored codes and scales (``state``) with the
    #: oracle's quantization of the live rows, not only what they decode to:
    #: a quantizer that stores other codes or scales which happen to decode
    #: to the same values (a zero row's scale left 0 instead of 1) saves a
    #: different prompt-cache file and feeds other engines other bytes.
    check_stored_int8 = True

    def reload_class(self) -> type | None:
        """The class under test (an mlx-lm target's adapter has no kvspec load)."""
        return type(self.cache) if isinstance(self.cache, KVCache) else None

    def compare_state(self, index: int, op: dict[str, Any]) -> None:
        super().compare_state(index, op)
        if (self.check_stored_int8 and self.mode == "int8" and op["op"] not in self.READ_ONLY_OPS
                and isinstance(self.cache, KVCache)):  # not an mlx-lm target's adapter
            self.compare_stored(index, op)

    def stored_int8(self, token: int) -> tuple[np.ndarray, ...]:
        """``(k codes, k scale, v codes, v scale)`` the oracle stores for a
        token's rows (kvspec.fuzz.quant_ref.quantize, from the rule's text)."""
        got = self._stored.get(token)
        if got is None:
            # the rows' host form is exactly their float32 values (kvspec.fuzz.rows)
            k, v = self.host_rows([token])
            kq, ks = quantize(np.asarray(k, dtype=np.float64))
            vq, vs = quantize(np.asarray(v, dtype=np.float64))
            got = self._stored[token] = (kq, ks, vq, vs)
        return got

    def compare_stored(self, index: int, op: dict[str, Any]) -> None:
        tokens = self.world.cache.window()
        state = self.step_state()
        rows = 0 if not state else int(state[0].shape[2])
        if rows != len(tokens):
            raise Divergence(index, op, "state holds other rows than the live window", f"{len(tokens)} rows",
                             f"{rows} rows")
        if not tokens:
            return
        names = ("key codes", "key scales", "value codes", "value scales")
        for j, (name, arr) in enumerate(zip(names, state)):
            got = np.asarray(arr)
            for i, t in enumerate(tokens):
                want = self.stored_int8(t)[j]
                if got.dtype != want.dtype or got[:, :, i : i + 1, :].tobytes() != want.tobytes():
                    raise Divergence(index, op, f"stored Int8 {name} differ from the quantization rule",
                                     f"token {t}: {want.reshape(-1)[:8].tolist()}",
                                     f"row {i}: {got[:, :, i, :].reshape(-1)[:8].tolist()} ({got.dtype})")

    # -- memory sharing -----------------------------------------------------------
    def spec_buffers(self) -> dict[str, Any]:
        w = self.world
        out: dict[str, Any] = {"cache": None if w.cache.buffer is None else w.cache.buffer.ident}
        for name, holder in w.holders.items():
            out["holder:" + name] = None if holder.buffer is None else holder.buffer.ident
        if w.held is not None and w.cache.mode is sd.Mode.FP16 and w.held.buffer is not None:
            # an Int8 window is dequantized: new memory, not a view
            out["held"] = w.held.buffer.ident
        return out

    def impl_values_pointer(self) -> int | None:
        b = self.cache.buffers
        return None if b is None else self.pointer(b.values)

    def impl_pointers(self) -> dict[str, int | None]:
        def ptr(buffers: Any) -> int | None:
            return None if buffers is None else self.pointer(buffers.keys)

        out: dict[str, int | None] = {"cache": ptr(self.cache.buffers)}
        for name, holder in self.holders.items():
            out["holder:" + name] = ptr(getattr(holder, "buffers", None))
        if self.held is not None and self.cfg["mode"] == "fp16":
            out["held"] = self.pointer(self.held[0])
        return out


    def compare_append(self, index: int, op: dict[str, Any], s: Any, i: Any) -> None:
        super().compare_append(index, op, s, i)
        self.check_window_is_callers(index, op)
        before = self.prev_world
        if s.regrew and before.cache.capacity > before.cache.live_len:
            self.reached("regrow after trim")
        if s.inplace and (before.holders or before.held is not None):
            self.reached("in-place write beside a holder")
        if not s.inplace and before.cache.marker is None and before.cache.buffer is not None:
            self.reached("copy after restore/install")

    def check_window_is_callers(self, index: int, op: dict[str, Any]) -> None:
        """The window an append returns is the caller's: slices or new
        handles of the buffers, never the cache's own buffer objects (a
        caller assigning into its window, ``k[...] = x``, rebinds that
        object: it would write into the cache's rows). Our cache only (an
        mlx-lm target's adapter keeps no ``buffers``)."""
        b = getattr(self.cache, "buffers", None) if isinstance(self.cache, KVCache) else None
        if b is None or self.returned is None:
            return
        if any(r is x for r in self.returned for x in b.arrays()):
            raise Divergence(index, op, "the returned window is the cache's own buffer object",
                             "slices or new handles (the caller's to assign into)", "the buffer array itself")

    # -- observables ------------------------------------------------------------
    def spec_observables(self) -> dict[str, Any]:
        c = self.world.cache
        return {"offset": c.offset, "live_start": c.live_start, "live_len": c.live_len, "capacity": c.capacity}

    def impl_observables(self) -> dict[str, Any]:
        c = self.cache
        return {"offset": c.offset, "live_start": c.live_start, "live_len": c.live_len, "capacity": c.capacity}


class DenseMachine(LifecycleRules, StateProtocolMachine):
    """Every dense-cache operation of semantics.md section 2, with refused
    inputs mixed in (negative lengths, out-of-range and unsorted index
    lists, install into a non-empty cache)."""

    handles = Bundle("handles")
    named_ops = ("snapshot", "restore", "drop", "detach", "install", "state_restore")

    @initialize(step=SMALL_STEPS, data=st.data())
    def init(self, step: int, data: st.DataObject) -> None:
        self.setup(step=step, **self.draw_shape(data))

    @property
    def live_len(self) -> int:
        return self.lock.world.cache.live_len

    @rule(n=APPEND_N)
    def append(self, n: int) -> None:
        self.do({"op": "append", "n": n})

    @rule(data=st.data())
    def regrow_after_trim(self, data: st.DataObject) -> None:
        """Regrow after trim, as its own rule (the edge of the #1209 class,
        which random trims and appends reach in ~150 examples, too late for
        a device ten times slower): trim back to a step boundary or one row
        short of the end, then append more rows than the capacity left, so
        the buffer grows from a trimmed prefix (its dead tail must not
        survive: kvspec.spec.dense.regrow_capacity)."""
        c = self.lock.world.cache
        live, step = c.live_len, c.step
        lens = sorted({x for x in ((live - 1) // step * step, live - 1) if x >= 1})
        if not lens:  # nothing to trim back to yet: fill past a step first
            self.do({"op": "append", "n": step + data.draw(st.integers(1, 3), label="n")})
            c = self.lock.world.cache
            live = c.live_len
            lens = sorted({x for x in ((live - 1) // step * step, live - 1) if x >= 1})
            if not lens:  # the append was refused (a shape the mode cannot take)
                return
        keep = data.draw(st.sampled_from(lens), label="len")
        self.do({"op": "trim", "n": live - keep})
        room = self.lock.world.cache.capacity - self.lock.world.cache.live_len
        self.do({"op": "append", "n": room + data.draw(st.integers(1, step), label="over")})

    @rule(target=StateProtocolMachine.snapshots, data=st.data())
    def reject_beside_snapshot(self, data: st.DataObject) -> str:
        """Speculative rollback beside a prompt-cache snapshot: snapshot,
        trim 1 to 3 rows (the rejected drafts), decode one row. The row it
        writes is one the snapshot still sees, so the ownership rule must
        make it copy (kvspec.spec.dense.inplace_write_allowed); random rules reach
        that order in ~30 examples (inplace_after_trim), this one at once."""
        if self.live_len < 2:
            self.do({"op": "append", "n": data.draw(st.integers(2, 4), label="prefill")})
            self.do({"op": "append", "n": 1})  # a decode: the cache's own write, its marker
        name = self.fresh_name("s")
        self.do({"op": "snapshot", "name": name})
        self.do({"op": "trim", "n": data.draw(st.integers(1, min(3, max(self.live_len - 1, 1))), label="n")})
        self.do({"op": "append", "n": 1})
        return name

    @rule(n=st.integers(0, 4), keep=st.integers(0, 3))
    def trim_front(self, n: int, keep: int) -> None:
        self.do({"op": "trim_front", "n": n, "keep": keep})

    @rule(data=st.data())
    def gather_positions(self, data: st.DataObject) -> None:
        size = self.live_len
        positions = data.draw(
            st.one_of(
                st.sets(st.integers(0, max(size - 1, 0)), max_size=max(size, 1)).map(sorted),
                st.sets(st.integers(0, max(size - 1, 0)), max_size=max(size, 1)).map(sorted),
                st.lists(st.integers(-1, size + 1), max_size=4),
            ),
            label="positions",
        )
        self.do({"op": "gather_positions", "positions": list(positions)})

    @rule(data=st.data())
    def gather_within_tail(self, data: st.DataObject) -> None:
        tail = data.draw(st.integers(1, max(self.live_len, 1)) | st.integers(-1, self.live_len + 1), label="tail")
        kept = data.draw(
            st.one_of(
                st.sets(st.integers(0, max(tail - 1, 0)), min_size=1, max_size=max(tail, 1)).map(sorted),
                st.sets(st.integers(0, max(tail - 1, 0)), min_size=1, max_size=max(tail, 1)).map(sorted),
                st.lists(st.integers(-1, tail + 1), max_size=3),
            ),
            label="kept",
        )
        self.do({"op": "gather_within_tail", "tail": tail, "kept": list(kept)})

    @rule(target=handles)
    def detach(self) -> str:
        name = self.fresh_name("h")
        self.do({"op": "detach", "name": name})
        return name

    @rule(name=consumes(handles))
    def install(self, name: str) -> None:
        self.do({"op": "install", "name": name})

    @rule(data=st.data())
    def reinstall(self, data: st.DataObject) -> None:
        """A consumed handle handed to ``install`` again (a prompt-cache
        store that keeps the handle after installing it), often right after
        emptying the cache so that only the handle's being spent refuses it."""
        spent = sorted(self.lock.world.consumed - set(self.lock.world.holders))
        if not spent:
            return
        name = data.draw(st.sampled_from(spent), label="name")
        if data.draw(st.booleans(), label="empty first"):
            self.do({"op": "detach", "name": self.fresh_name("h")})
        self.do({"op": "install", "name": name})

    @rule(name=handles, data=st.data())
    def handle_trim_to(self, name: str, data: st.DataObject) -> None:
        holder = self.lock.world.holders.get(name)
        top = 0 if holder is None else holder.offset
        self.do({"op": "handle_trim_to", "name": name, "len": data.draw(st.integers(-1, top + 1), label="len")})

    @rule(data=st.data())
    def trim_through_handle(self, data: st.DataObject) -> None:
        """Detach, cut the handle, install it back: how a prompt-cache store
        trims a cache it keeps out of line. The single rules above reach
        this order only by chance (a Delegated handle cut into its cold
        rows, installed with a stale cold offset, took about 1,000 examples
        to find)."""
        top = self.offset
        name = self.fresh_name("h")
        self.do({"op": "detach", "name": name})
        self.do({"op": "handle_trim_to", "name": name, "len": data.draw(st.integers(0, top), label="len")})
        self.do({"op": "install", "name": name})

    @invariant()
    def offsets_in_range(self) -> None:
        """semantics.md 5.6 on the implementation: 0 <= live_start <= offset,
        live_len <= capacity."""
        if self.lock is None or set(getattr(self.lock, "not_compared", ())) & {"live_start", "live_len", "capacity"}:
            return  # not held to them (fuzz/targets.py)
        c = self.lock.cache
        try:
            live_start, live_len, offset, capacity = c.live_start, c.live_len, c.offset, c.capacity
        except Exception:  # noqa: BLE001 - not the invariant's to report
            # a class without them, or a getter of the target's that crashes
            # (the lockstep reads every observable after every op: a crash
            # there is a divergence, never this machine's tool failure)
            return
        try:
            start_ok, len_ok = 0 <= live_start <= offset, live_len <= capacity or live_len == 0
        except TypeError:
            return  # a value that is no number (None): the lockstep compares it after every op
        assert start_ok, (live_start, offset)
        assert len_ok, (live_len, capacity)


@without_lifecycle
class PlainDenseMachine(DenseMachine):
    """The dense machine as mlx-lm targets run it: batch 1, one or two kv
    heads, one head dim, float16, drawn in the order their conformance
    findings were recorded with (fixed seeds reproduce them)."""

    @initialize(step=SMALL_STEPS, head_dim=HEAD_DIMS, kv_heads=KV_HEADS)
    def init(self, step: int, head_dim: int, kv_heads: int) -> None:  # type: ignore[override]
        self.setup(step=step, head_dim=head_dim, kv_heads=kv_heads)


DenseMachine.plain = PlainDenseMachine

