"""Lockstep of ``spec.dense`` and ``impl.dense.KVCache`` (kind ``dense``)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from fuzz.lockstep import Lockstep
from impl.dense import CacheSnapshot, DetachedHandle, KVCache
from impl.quant import dequantize_int8, quantize_int8
from spec import dense as sd
from spec.errors import InvalidArgumentError, StateError


class DenseLockstep(Lockstep):
    """Drives a spec ``DenseWorld`` and an impl ``KVCache`` with the same ops.

    ``cache_factory`` builds the implementation under test (the injected-bug
    catalog passes a patched class)."""

    spec_module = sd

    def __init__(self, cache: dict[str, Any], cache_factory=KVCache):
        super().__init__(cache)
        self.world = sd.new_world(cache["mode"], cache["step"], cache["inplace"])
        self.prev_world = self.world
        self.cache = cache_factory(mode=cache["mode"], step=cache["step"], inplace=cache["inplace"])
        self.holders: dict[str, CacheSnapshot] = {}
        self.returned: tuple[mx.array, mx.array] | None = None
        self.held: tuple[mx.array, mx.array] | None = None

    def stored_form(self, x: mx.array) -> mx.array:
        if self.cfg["mode"] == "int8":
            return dequantize_int8(*quantize_int8(x))
        return x.astype(mx.float16)

    # -- implementation side ---------------------------------------------------
    def _holder(self, op: str, name: str, kind: type | None = None) -> CacheSnapshot:
        holder = self.holders.get(name)
        if holder is None:
            raise StateError(f"{op}: no snapshot or handle named {name!r}")
        if kind is not None and not (type(holder) is kind):
            have = "handle" if isinstance(holder, DetachedHandle) else "snapshot"
            want = "handle" if kind is DetachedHandle else "snapshot"
            raise StateError(f"{op}: {name!r} is a {have}, not a {want}")
        return holder

    def _fresh(self, op: str, name: str) -> None:
        if name in self.holders:
            raise StateError(f"{op}: name {name!r} is already in use")

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
        if name == "snapshot":
            self._fresh("snapshot", op["name"])
            self.holders[op["name"]] = c.snapshot()
            return None
        if name == "restore":
            c.restore(self._holder("restore", op["name"], CacheSnapshot))
            return None
        if name == "drop":
            self._holder("drop", op["name"])
            del self.holders[op["name"]]
            return None
        if name == "detach":
            self._fresh("detach", op["name"])
            self.holders[op["name"]] = c.detach()
            return None
        if name == "install":
            handle = self._holder("install", op["name"], DetachedHandle)
            c.install(handle)  # type: ignore[arg-type]
            del self.holders[op["name"]]
            return None
        if name == "handle_trim_to":
            handle = self._holder("handle_trim_to", op["name"], DetachedHandle)
            return handle.trim_to(op["len"])  # type: ignore[attr-defined]
        raise InvalidArgumentError(f"{name}: not an operation of a dense cache")

    def compare_append(self, index: int, op: dict[str, Any], s: Any, i: Any) -> None:
        super().compare_append(index, op, s, i)
        before = self.prev_world
        if s.regrew and before.cache.capacity > before.cache.live_len:
            self.reached("regrow after trim")
        if s.inplace and (before.holders or before.held is not None):
            self.reached("in-place write beside a holder")
        if not s.inplace and before.cache.marker is None and before.cache.buffer is not None:
            self.reached("copy after restore/install")

    def impl_last_inplace(self) -> bool:
        return self.cache.last_write_inplace

    # -- observables ------------------------------------------------------------
    def spec_observables(self) -> dict[str, Any]:
        c = self.world.cache
        return {"offset": c.offset, "live_start": c.live_start, "live_len": c.live_len, "capacity": c.capacity}

    def impl_observables(self) -> dict[str, Any]:
        c = self.cache
        return {"offset": c.offset, "live_start": c.live_start, "live_len": c.live_len, "capacity": c.capacity}

    def spec_views(self) -> dict[str, tuple[int, ...]]:
        w = self.world
        views = {"cache": w.cache.window()}
        for name, holder in w.holders.items():
            views["holder:" + name] = holder.window()
        if w.held is not None:
            views["held"] = w.held.window()
        return views

    def impl_views(self) -> dict[str, tuple[mx.array, mx.array] | None]:
        views: dict[str, Any] = {"cache": self.cache.fetch()}
        for name, holder in self.holders.items():
            views["holder:" + name] = holder.fetch()
        if self.held is not None:
            views["held"] = self.held
        return views
