"""Hypothesis state machines that drive spec and implementation in lockstep.

One machine per cache kind. Rules emit kvtrace ops (so every run *is* a
trace), bundles hold what lives across steps (snapshots, detached handles),
and every step is checked by the lockstep driver against the properties of
semantics.md section 5. Parameters are small on purpose (step 1 to 8, head
dim 8 or 16, one or two kv heads): small sizes reach the edges (regrow after
trim, exact-fit buffers, shared buffers) that large sizes hide.

After a failing run, Hypothesis shrinks it and re-runs the minimal example
last; ``teardown`` records each run, so ``Machine.last_run`` is then the
minimal counterexample, which :func:`fuzz.campaign.failure_trace` writes out.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from fuzz.trace import CACHE_DEFAULTS

SMALL_STEPS = st.integers(1, 8)
HEAD_DIMS = st.sampled_from([8, 16])
KV_HEADS = st.integers(1, 2)
# Decode steps dominate real traffic and are the only writes that may go in
# place, so n = 1 is drawn most often; multi-row appends cross step edges.
APPEND_N = st.one_of(st.just(1), st.just(1), st.integers(1, 9))


class KVMachine(RuleBasedStateMachine):
    """Shared plumbing: configuration, op recording, the lockstep driver,
    and the rules every cache kind runs alike (fetch, hold, trims,
    snapshots)."""

    snapshots = Bundle("snapshots")

    kind = "dense"
    mode = "fp16"
    inplace = True
    factories: dict[str, Any] | None = None
    check_inplace = True
    #: cache fields pinned for every example (e.g. ``{"max_size": 16}``)
    fixed: ClassVar[dict[str, Any]] = {}
    #: a ``fuzz.targets.Target`` (None: ``impl``). Ops it does not run are
    #: not generated (counted as "skipped <op>"); ``covered`` counts the ops
    #: each example did run, by name.
    target: Any = None
    covered: ClassVar[dict[str, int]] = {}
    last_run: tuple[dict[str, Any], list[dict[str, Any]]] | None = None
    runs = 0
    stats: ClassVar[dict[str, int]] = {}
    #: (examples run, perf_counter time) when the first failure was seen,
    #: before shrinking: what "examples and seconds to catch" report.
    first_failure: tuple[int, float] | None = None

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[dict[str, Any]] = []
        self.names = 0
        self.cfg: dict[str, Any] = {}
        self.lock: Any = None

    def setup(self, **cfg: Any) -> None:
        from fuzz.replay import make_lockstep

        type(self).runs += 1
        self.cfg = {**CACHE_DEFAULTS, "kind": self.kind, "mode": self.mode, "inplace": self.inplace, **cfg, **self.fixed}
        if "keep" in self.fixed or "max_size" in self.fixed:
            self.cfg["keep"] = min(self.cfg["keep"], self.cfg["max_size"] - 1)
        self.lock = make_lockstep(self.cfg, self.factories, self.check_inplace, self.target)

    def do(self, op: dict[str, Any]) -> None:
        if self.target is not None and self.target.skip_reason(self.cfg, op) is not None:
            self.lock.reached("skipped " + op["op"])
            return
        type(self).covered[op["op"]] = type(self).covered.get(op["op"], 0) + 1
        self.ops.append(op)
        try:
            self.lock.step(len(self.ops) - 1, op)
        except Exception:
            if type(self).first_failure is None:
                type(self).first_failure = (type(self).runs, time.perf_counter())
            raise

    def fresh_name(self, prefix: str) -> str:
        self.names += 1
        return f"{prefix}{self.names}"

    def teardown(self) -> None:
        cfg = {k: v for k, v in self.cfg.items() if k in trace_cache_fields(self.kind)}
        type(self).last_run = (cfg, list(self.ops))
        if self.lock is not None:
            for key, count in self.lock.stats.items():
                type(self).stats[key] = type(self).stats.get(key, 0) + count
                event(key)

    # -- rules every kind runs alike (Hypothesis orders rules by name, so
    # -- where they are defined changes no fixed-seed run) --
    @property
    def offset(self) -> int:
        return self.lock.world.cache.offset

    @rule()
    def fetch(self) -> None:
        self.do({"op": "fetch"})

    @rule()
    def hold(self) -> None:
        if self.lock.world.returned is not None:
            self.do({"op": "hold"})

    @rule()
    def release_hold(self) -> None:
        self.do({"op": "release_hold"})

    @rule(n=st.integers(-1, 4))
    def trim(self, n: int) -> None:
        self.do({"op": "trim", "n": n})

    @rule(data=st.data())
    def trim_to(self, data: st.DataObject) -> None:
        self.do({"op": "trim_to", "len": data.draw(st.integers(-1, self.offset + 1), label="len")})

    @rule(target=snapshots)
    def snapshot(self) -> str:
        name = self.fresh_name("s")
        self.do({"op": "snapshot", "name": name})
        return name

    @rule(name=snapshots)
    def restore(self, name: str) -> None:
        self.do({"op": "restore", "name": name})

    @rule(name=consumes(snapshots))
    def drop(self, name: str) -> None:
        self.do({"op": "drop", "name": name})


def trace_cache_fields(kind: str) -> tuple[str, ...]:
    common = ("kind", "mode", "step", "batch", "kv_heads", "head_dim", "inplace")
    if kind == "rotating":
        return common + ("max_size", "keep")
    if kind == "paged":
        return common + ("block_size",)
    return common


class DenseMachine(KVMachine):
    """Every dense-cache operation of semantics.md section 2, with refused
    inputs mixed in (negative lengths, out-of-range and unsorted index
    lists, install into a non-empty cache)."""

    handles = Bundle("handles")

    @initialize(step=SMALL_STEPS, head_dim=HEAD_DIMS, kv_heads=KV_HEADS)
    def init(self, step: int, head_dim: int, kv_heads: int) -> None:
        self.setup(step=step, head_dim=head_dim, kv_heads=kv_heads)

    @property
    def live_len(self) -> int:
        return self.lock.world.cache.live_len

    @rule(n=APPEND_N)
    def append(self, n: int) -> None:
        self.do({"op": "append", "n": n})

    @rule()
    def decode(self) -> None:
        """A second decode rule: appends of one row are the common case and
        the only ones that may go in place, so they get twice the weight."""
        self.do({"op": "append", "n": 1})

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

    @rule(name=handles, data=st.data())
    def handle_trim_to(self, name: str, data: st.DataObject) -> None:
        holder = self.lock.world.holders.get(name)
        top = 0 if holder is None else holder.offset
        self.do({"op": "handle_trim_to", "name": name, "len": data.draw(st.integers(-1, top + 1), label="len")})

    @invariant()
    def offsets_in_range(self) -> None:
        """semantics.md 5.6 on the implementation: 0 <= live_start <= offset,
        live_len <= capacity."""
        if self.lock is None:
            return
        c = self.lock.cache
        assert 0 <= c.live_start <= c.offset, (c.live_start, c.offset)
        assert c.live_len <= c.capacity or c.live_len == 0, (c.live_len, c.capacity)


def machine_for(kind: str, mode: str = "fp16", inplace: bool = True, factories: dict[str, Any] | None = None,
                check_inplace: bool = True, fixed: dict[str, Any] | None = None,
                target: Any = None) -> type[KVMachine]:
    """A fresh machine class bound to one configuration (class attributes,
    so that runs in one process never share statistics). ``target`` (a name
    or ``fuzz.targets.Target``; None: ``impl``) picks the implementation and
    the ops it runs."""
    if kind == "dense":
        base: type[KVMachine] = DenseMachine
    elif kind == "rotating":
        from fuzz.rotating import RotatingMachine

        base = RotatingMachine
    else:
        raise ValueError(f"kind: no state machine for {kind!r}")
    if target is not None:
        from fuzz.targets import resolve

        target = resolve(target)
        base = target.machine_base(kind, mode, base)
        if target.is_impl and not target.excluded:
            target = None  # the plain machine: no per-op target check
    name = f"{base.__name__}_{mode}_{'inplace' if inplace else 'copy'}"
    return type(name, (base,), {
        "mode": mode, "inplace": inplace, "factories": factories, "check_inplace": check_inplace,
        "fixed": dict(fixed or {}), "target": target, "covered": {},
        "stats": {}, "runs": 0, "last_run": None, "first_failure": None,
    })


__all__ = ["DenseMachine", "KVMachine", "machine_for", "precondition"]
