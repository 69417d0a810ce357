"""Counterexamples as kvtraces, replayed on the spec.

A refuted negative control yields a sequence of operations. This module turns
it into a kvtrace/1 document (``docs/kvtrace.md``) whose checks
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

from kvspec.spec import dense as sd
from kvspec.spec import rotating as sr

#: the spec module of each cache kind
SPECS: dict[str, Any] = {"dense": sd, "rotating": sr}


def apply(kind: str, world: Any, op: dict[str, Any]) -> tuple[Any, Any]:
    """One kvtrace op on a spec world of ``kind`` (``expect`` changes
    nothing). The spec's ``apply_op`` looks its functions up at call time,
    so :func:`patched` reaches them."""
    if op["op"] == "expect":
        return None, world
    return SPECS[kind].apply_op(world, op)


@dataclass
class Step:
    op: dict[str, Any]
    result: Any
    before: Any
    after: Any


def new_world(kind: str, cache: dict[str, Any]) -> Any:
    """A fresh spec world for a kvtrace ``cache`` object (its defaults)."""
    mode, step, inplace = cache.get("mode", "fp16"), cache.get("step", 256), cache.get("inplace", True)
    if kind == "rotating":
        return sr.RotatingWorld(sr.new_cache(cache["max_size"], cache.get("keep", 0), step, inplace, mode,
                                             cache.get("undo", 0)))
    return sd.new_world(mode, step, inplace)


def replay(kind: str, cache: dict[str, Any], ops: list[dict[str, Any]]) -> list[Step]:
    """Run ops on a fresh spec world. Raises the spec's refusal if an op is
    refused (a counterexample never contains a refused op)."""
    world = new_world(kind, cache)
    steps = []
    for op in ops:
        result, after = apply(kind, world, op)
        steps.append(Step(op, result, world, after))
        world = after
    return steps


def annotate(kind: str, cache: dict[str, Any], ops: list[dict[str, Any]],
             expect_of: list[str | None]) -> list[dict[str, Any]]:
    """The ops with the correct spec's checks added: every append gets
    ``inplace`` and ``capacity``, every trim its ``returns`` (and, on the
    cache itself, ``capacity``); then one ``expect`` per name in
    ``expect_of`` (None: the live cache)."""
    steps = replay(kind, cache, ops)
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
    world = steps[-1].after if steps else new_world(kind, cache)
    for name in expect_of:
        view = list(world.cache.window() if name is None else world.holders[name].window())
        exp: dict[str, Any] = {"op": "expect", "window": view}
        if name is not None:
            exp["of"] = name
        out.append(exp)
    return out


def kvtrace(title: str, cache: dict[str, Any], ops: list[dict[str, Any]], kind: str = "dense") -> dict[str, Any]:
    return {"kvtrace": 1, "title": title, "cache": {"kind": kind, **cache}, "ops": ops}


@contextlib.contextmanager
def patched(module: Any, **functions: Any) -> Iterator[None]:
    """Temporarily replace functions of a spec module by buggy variants (to
    replay a counterexample on the spec's own code with one rule broken)."""
    saved = {name: getattr(module, name) for name in functions}
    try:
        for name, fn in functions.items():
            setattr(module, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
