"""Whose failure it is: a divergence of the target from the spec, a
capability gap of the target (exit 2, not applicable), or the harness's own
crash (exit 2, tool failure, never a divergence). The lockstep raises these;
the target layer (``kvspec.fuzz.targets``) re-exports them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvspec.fuzz.protocol import refusal_category
from kvspec.fuzz.trace import TraceFormatError


def _jsonable(x: Any) -> Any:
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    return repr(x)


@dataclass
class Divergence(Exception):
    """The spec and the implementation (or the trace's own checks) disagree."""

    index: int
    op: dict[str, Any]
    what: str
    spec: Any
    impl: Any
    #: what the two lines are: (spec, implementation) by default; a trace's
    #: own check compares one side with what the trace expects
    labels: tuple[str, str] = ("spec says", "impl did")

    def __str__(self) -> str:
        width = max(len(label) for label in self.labels) + 1
        first, second = (f"{label}:".ljust(width) for label in self.labels)
        return (
            f"op {self.index} {json.dumps(self.op)}: {self.what}\n"
            f"  {first} {self.spec}\n"
            f"  {second} {self.impl}"
        )

    @property
    def trace_check(self) -> bool:
        """The trace's own check failed against the spec (the trace expects
        something the spec does not do), as opposed to the implementation
        disagreeing with the spec or with a check the spec satisfies."""
        return self.labels[1] == "trace expects"

    def to_json(self) -> dict[str, Any]:
        keys = ["trace" if self.labels[0] == "trace expects" else "spec",
                "trace" if self.labels[1] == "trace expects" else "impl"]
        return {"index": self.index, "op": self.op, "what": self.what,
                "kind": "trace check" if self.trace_check else "divergence",
                "implementation": self.labels[1].removesuffix(" did") if keys[1] == "impl" else None,
                keys[0]: _jsonable(self.spec), keys[1]: _jsonable(self.impl)}


class TargetCapabilityError(TraceFormatError):
    """The target cannot run this trace (exit 2, with the reason): no class
    for its kind and mode, a cache field value the class cannot take, or an
    op the class does not have."""


# -- whose failure it is ---------------------------------------------------------


class HarnessFailure(Exception):
    """The harness's own code raised while running or reading an op (a
    crash of ``fuzz/`` or ``spec/``, or of ``impl/`` driving another
    target): a tool failure, exit 2, never a divergence. ``index`` and
    ``op`` name the op; ``__cause__`` is the exception."""

    def __init__(self, index: int, op: dict[str, Any], exc: BaseException, where: str):
        self.index, self.op, self.error = index, op, exc
        super().__init__(f"op {index} {op.get('op')!r}: the harness raised {type(exc).__name__}: {exc} "
                         f"(in {where}; a tool failure, not a divergence)")


class TargetCannotRun(TargetCapabilityError):
    """The harness asked the target's object for a member its class does not
    have while running an op (``AttributeError`` raised in the harness's own
    code on the target's object): a capability gap, exit 2 not applicable,
    never a divergence. ``index``, ``op`` and ``member`` name it."""

    def __init__(self, index: int, op: dict[str, Any], target: str, cls: str, member: str):
        self.index, self.op, self.member = index, op, member
        super().__init__(f"op {index} {op.get('op')!r}: target {target} cannot run it: its class {cls} has no "
                         f"member {member!r}, which this op needs (a capability gap, not a divergence)")


def _package_dir(name: str) -> str:
    import importlib.util
    import os

    spec = importlib.util.find_spec(name)
    return os.path.dirname(spec.origin) + os.sep if spec is not None and spec.origin else "\0"


_HARNESS: dict[str, tuple[str, ...]] = {}


def harness_dirs(impl_is_target: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the harness's folders, folders inside them that hold target code):
    ``fuzz/`` and ``spec/`` (and ``impl/`` unless it is the target), less
    ``fuzz/bugs/`` (an injected bug's classes are the target)."""
    if not _HARNESS:
        _HARNESS["fuzz"] = (_package_dir("kvspec.fuzz"),)
        _HARNESS["spec"] = (_package_dir("kvspec.spec"),)
        _HARNESS["impl"] = (_package_dir("kvspec.impl"),)
        _HARNESS["bugs"] = (_package_dir("kvspec.fuzz.bugs"),)
    dirs = _HARNESS["fuzz"] + _HARNESS["spec"] + (() if impl_is_target else _HARNESS["impl"])
    return dirs, _HARNESS["bugs"]


def raised_in(exc: BaseException) -> str:
    """The file of the innermost Python frame that raised ``exc`` (an
    exception of C code, such as MLX's, is its Python caller's)."""
    tb = exc.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename


def _is_harness(path: str, impl_is_target: bool) -> bool:
    dirs, inside = harness_dirs(impl_is_target)
    return path.startswith(dirs) and not path.startswith(inside)


def target_objects(lock: Any) -> list[Any]:
    """The objects a lockstep holds of the target: the cache (and a built-in
    adapter's ``inner`` engine object) and every snapshot or copy."""
    out = []
    for obj in (getattr(lock, "cache", None), *getattr(lock, "holders", {}).values()):
        if obj is not None:
            out.append(obj)
            inner = getattr(obj, "inner", None) if type(obj).__module__.startswith("kvspec.fuzz.adapters") else None
            if inner is not None:
                out.append(inner)
    return out


def classify_failure(lock: Any, index: int, op: dict[str, Any], exc: BaseException,
                     running: bool) -> BaseException | None:
    """Whose failure ``exc`` is, raised while the lockstep ``lock`` ran op
    ``index`` on the target (``running``) or read and compared after it.
    Returns None where it is the target's own (a refusal, compared by
    category; a crash of the target's code, a divergence), else what to
    raise instead:

    * an ``AttributeError`` raised in the harness's own code for a member
      of one of the target's objects that its class does not have (the
      harness asked for ``meta_state``, ``state``, ...):
      :class:`TargetCannotRun` (exit 2, not applicable);
    * any other exception raised in the harness's own code
      (:func:`harness_dirs`): :class:`HarnessFailure` (exit 2, tool
      failure); while running the op, an exception of a refusal category is
      left to the comparison (an adapter translates the target's refusals
      into exceptions: kvproto's categories).

    An exception raised in the target's own code while it is read after the
    op (its ``fetch``, an observable) is returned as a Divergence at that
    op: the target crashed on an op the spec ran."""

    if isinstance(exc, HarnessFailure):  # already told apart (e.g. by the exec: client)
        return exc
    if isinstance(exc, TraceFormatError):
        # the trace asks for what this cache cannot do (e.g. a reload via
        # 'state' of a class without a state setter): the trace's problem,
        # exit 2 naming it, never the harness's own failure
        return exc
    where = raised_in(exc)
    target = getattr(lock, "target", None)
    impl_is_target = target is None or target.is_impl
    if not _is_harness(where, impl_is_target):
        if running:
            return None
        return Divergence(index, op, "target crashed while being read after the op", "the op's outcome, readable",
                          f"raised {type(exc).__name__}: {exc}")
    if isinstance(exc, AttributeError):
        obj, name = getattr(exc, "obj", None), getattr(exc, "name", None)
        if name and any(obj is t for t in target_objects(lock)) and not hasattr(type(obj), name):
            label = target.label if target is not None else "impl"
            return TargetCannotRun(index, op, label, type(obj).__qualname__, name)
    if running and refusal_category(exc, getattr(lock, "refusal_categories", None)) is not None:
        return None
    return HarnessFailure(index, op, exc, where)
