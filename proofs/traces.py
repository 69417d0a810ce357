"""Counterexamples as kvtraces, replayed on the spec.

A refuted negative control yields a sequence of operations. This module turns
it into a kvtrace/1 document (``shared/reference/kvtrace.md``) whose checks
(``inplace``, ``capacity``, ``returns``, ``expect``) come from replaying the
ops on the correct spec, so the trace passes on a correct implementation and
fails on one that has the buggy rule. It also replays the ops on the spec with
the buggy rule patched in (:func:`patched`), which is how a counterexample is
confirmed on the spec's own code rather than only on its Z3 encoding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from spec import dense as sd


def apply_dense(world: sd.DenseWorld, op: dict[str, Any]) -> tuple[Any, sd.DenseWorld]:
    """One kvtrace op on a spec ``DenseWorld``. Functions are looked up on
    the module at call time, so :func:`patched` reaches them."""
    name = op["op"]
    if name == "append":
        return sd.w_append(world, op["n"])
    if name == "fetch":
        return world.cache.window(), world
    if name == "hold":
        return sd.w_hold(world)
    if name == "release_hold":
        return sd.w_release_hold(world)
    if name == "trim":
        return sd.w_cache_op(world, sd.trim, op["n"])
    if name == "trim_to":
        return sd.w_cache_op(world, sd.trim_to, op["len"])
    if name == "trim_front":
        return sd.w_cache_op(world, sd.trim_front_keep_sink, op["n"], op.get("keep", 0))
    if name == "gather_positions":
        return sd.w_cache_op(world, sd.gather_positions, tuple(op["positions"]))
    if name == "gather_within_tail":
        return sd.w_cache_op(world, sd.gather_within_tail, op["tail"], tuple(op["kept"]))
    if name == "snapshot":
        return sd.w_snapshot(world, op["name"])
    if name == "restore":
        return sd.w_restore(world, op["name"])
    if name == "drop":
        return sd.w_drop(world, op["name"])
    if name == "detach":
        return sd.w_detach(world, op["name"])
    if name == "install":
        return sd.w_install(world, op["name"])
    if name == "handle_trim_to":
        return sd.w_handle_trim_to(world, op["name"], op["len"])
    if name == "expect":
        return None, world
    raise ValueError(f"{name}: not an operation of a dense cache")


@dataclass
class Step:
    op: dict[str, Any]
    result: Any
    before: sd.DenseWorld
    after: sd.DenseWorld


def replay_dense(cache: dict[str, Any], ops: list[dict[str, Any]]) -> list[Step]:
    """Run ops on a fresh spec world. Raises the spec's refusal if an op is
    refused (a counterexample never contains a refused op)."""
    world = sd.new_world(cache.get("mode", "fp16"), cache.get("step", 256), cache.get("inplace", True))
    steps = []
    for op in ops:
        result, after = apply_dense(world, op)
        steps.append(Step(op, result, world, after))
        world = after
    return steps


def annotate_dense(cache: dict[str, Any], ops: list[dict[str, Any]], expect_of: list[str | None]) -> list[dict[str, Any]]:
    """The ops with the correct spec's checks added: every append gets
    ``inplace`` and ``capacity``, every trim its ``returns``; then one
    ``expect`` per name in ``expect_of`` (None: the live cache)."""
    steps = replay_dense(cache, ops)
    out = []
    for s in steps:
        op = dict(s.op)
        if op["op"] == "append":
            op["inplace"] = s.result.inplace
            op["capacity"] = s.after.cache.capacity
        elif op["op"] in ("trim", "trim_to", "trim_front", "handle_trim_to"):
            op["returns"] = s.result
            if op["op"] != "handle_trim_to":
                op["capacity"] = s.after.cache.capacity
        out.append(op)
    world = steps[-1].after if steps else sd.new_world(cache.get("mode", "fp16"), cache.get("step", 256))
    for name in expect_of:
        view = list(sd.view_of(world, name))
        exp: dict[str, Any] = {"op": "expect", "window": view}
        if name is not None:
            exp["of"] = name
        out.append(exp)
    return out


def kvtrace(title: str, cache: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    return {"kvtrace": 1, "title": title, "cache": {"kind": "dense", **cache}, "ops": ops}


@contextlib.contextmanager
def patched(**functions: Any) -> Iterator[None]:
    """Temporarily replace ``spec.dense`` functions by buggy variants (to
    replay a counterexample on the spec's own code with one rule broken)."""
    saved = {name: getattr(sd, name) for name in functions}
    try:
        for name, fn in functions.items():
            setattr(sd, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(sd, name, fn)


# ---------------------------------------------------------------------------
# The sliding-window cache


def apply_rotating(world: Any, op: dict[str, Any]) -> tuple[Any, Any]:
    """One kvtrace op on a spec ``RotatingWorld`` (functions looked up at
    call time, so :func:`patched_module` reaches them)."""
    from dataclasses import replace

    from spec import rotating as sr

    name = op["op"]
    if name == "append":
        return sr.w_append(world, op["n"])
    if name == "hold":
        return sr.w_hold(world)
    if name == "release_hold":
        return sr.w_release_hold(world)
    if name in ("trim", "trim_to"):
        fn = sr.trim if name == "trim" else sr.trim_to
        result, cache = fn(world.cache, op["n"] if name == "trim" else op["len"])
        return result, replace(world, cache=cache)
    if name == "snapshot":
        return sr.w_snapshot(world, op["name"])
    if name == "restore":
        return sr.w_restore(world, op["name"])
    if name == "drop":
        return sr.w_drop(world, op["name"])
    if name in ("expect", "fetch"):
        return None, world
    raise ValueError(f"{name}: not an operation of the rotating cache")


def replay_rotating(cache: dict[str, Any], ops: list[dict[str, Any]]) -> list[Step]:
    from spec import rotating as sr

    world = sr.RotatingWorld(sr.new_cache(cache["max_size"], cache.get("keep", 0), cache.get("step", 256),
                                          cache.get("inplace", True), cache.get("mode", "fp16")))
    steps = []
    for op in ops:
        result, after = apply_rotating(world, op)
        steps.append(Step(op, result, world, after))
        world = after
    return steps


def annotate_rotating(cache: dict[str, Any], ops: list[dict[str, Any]], expect_of: list[str | None]) -> list[dict[str, Any]]:
    """The ops with the correct spec's ``inplace``/``capacity``/``returns``
    checks, then one ``expect`` per name (None: the live cache)."""
    steps = replay_rotating(cache, ops)
    out = []
    for s in steps:
        op = dict(s.op)
        if op["op"] == "append":
            op["inplace"] = s.result.inplace
            op["capacity"] = s.after.cache.capacity
        elif op["op"] in ("trim", "trim_to"):
            op["returns"] = s.result
        out.append(op)
    world = steps[-1].after
    for name in expect_of:
        view = list(world.cache.window() if name is None else world.holders[name].window())
        exp: dict[str, Any] = {"op": "expect", "window": view}
        if name is not None:
            exp["of"] = name
        out.append(exp)
    return out


def rotating_kvtrace(title: str, cache: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    return {"kvtrace": 1, "title": title, "cache": {"kind": "rotating", **cache}, "ops": ops}


@contextlib.contextmanager
def patched_module(module: Any, **functions: Any) -> Iterator[None]:
    """:func:`patched` for any spec module."""
    saved = {name: getattr(module, name) for name in functions}
    try:
        for name, fn in functions.items():
            setattr(module, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
