"""Run kvtrace ops on the spec and an implementation side by side.

After every op the harness compares (semantics.md section 5):

* refusals: the spec and the implementation refuse the same ops with the
  same error type, and a refused op changes nothing;
* the live window, byte for byte (quantized modes: against each live row
  quantized and dequantized on its own);
* every snapshot, detached handle and held window (isolation);
* the physical observables the spec predicts: offset, live_len, capacity,
  the ring cursor, and whether an append went in place;
* the op's own checks (``returns``, ``error``, ``inplace``, ``capacity``) and
  ``expect`` ops.

The first disagreement raises :class:`Divergence`, which names the op index,
the op, what the spec says and what the implementation did, as token
identities where possible.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from fuzz import rows as rowgen
from spec.errors import KVCacheError, StateError


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

    def to_json(self) -> dict[str, Any]:
        keys = ["spec" if "spec" in self.labels[0] else "trace", "impl" if "impl" in self.labels[1] else "trace"]
        return {"index": self.index, "op": self.op, "what": self.what,
                keys[0]: _jsonable(self.spec), keys[1]: _jsonable(self.impl)}


def _jsonable(x: Any) -> Any:
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    return repr(x)


@dataclass
class Outcome:
    """What one side did with one op: a result or a refusal."""

    result: Any = None
    error: BaseException | None = None

    def describe(self) -> str:
        if self.error is None:
            return f"returned {self.result!r}"
        return f"raised {type(self.error).__name__}: {self.error}"


class Lockstep:
    """Base class: one cache kind's spec world and implementation in step.

    Subclasses set ``spec_module`` (its ``apply_op(world, op) -> (result,
    new_world)`` runs the spec side; pure, may raise a KVCacheError) and
    provide ``impl_apply(op) -> result`` (mutates the
    implementation), ``spec_views()`` / ``impl_views()`` (name -> window) and
    ``observables()``.
    """

    #: Compare the in-place decision of every append (the cost contract).
    #: Switched off to show that isolation checks alone still catch an
    #: unsafe in-place write (an engine that cannot observe its write path).
    check_inplace = True
    #: Compare refusal messages too, not only their types. On for our
    #: implementation, whose messages follow the spec's word for word; other
    #: targets word their errors their own way.
    compare_messages = False

    def __init__(self, cache: dict[str, Any]):
        self.cfg = cache
        self.shape = (cache["batch"], cache["kv_heads"], cache["head_dim"])
        self._expected: dict[int, tuple[bytes, bytes]] = {}
        self.stats: dict[str, int] = {}
        #: (op index, message) of every op both sides refused
        self.refusals: list[tuple[int, str]] = []
        #: the implementation's snapshots and handles by name, the window the
        #: last append returned and the held one (``hold``)
        self.holders: dict[str, Any] = {}
        self.returned: tuple[mx.array, mx.array] | None = None
        self.held: tuple[mx.array, mx.array] | None = None

    @classmethod
    def check_cache(cls, cache: dict[str, Any]) -> None:
        """Refuse (``TraceFormatError``) a cache configuration the schema
        allows but the kind cannot build; nothing by default."""

    # -- rows -----------------------------------------------------------------
    def input_rows(self, tokens: list[int]) -> tuple[mx.array, mx.array]:
        b, h, d = self.shape
        return mx.array(rowgen.rows(tokens, "k", b, h, d)), mx.array(rowgen.rows(tokens, "v", b, h, d))

    def expected_row(self, token: int) -> tuple[bytes, bytes]:
        """The bytes a reader must see for a token's K and V rows."""
        got = self._expected.get(token)
        if got is None:
            k, v = self.input_rows([token])
            k, v = self.stored_form(k), self.stored_form(v)
            got = (np.asarray(k).tobytes(), np.asarray(v).tobytes())
            self._expected[token] = got
        return got

    def stored_form(self, x: mx.array) -> mx.array:
        """What a reader gets back for one row (identity in float16 modes)."""
        return x.astype(mx.float16)

    def identify(self, arrays: tuple[mx.array, mx.array] | None) -> list[Any]:
        """Name each row of a fetched window by the token whose bytes it
        holds: an int, "zero" for an all-zero row nobody wrote, "?" else."""
        if arrays is None:
            return []
        k, v = (np.asarray(a) for a in arrays)
        lookup = {pair: t for t, pair in self._expected.items()}
        out: list[Any] = []
        for j in range(k.shape[2]):
            pair = (k[:, :, j : j + 1, :].tobytes(), v[:, :, j : j + 1, :].tobytes())
            tok = lookup.get(pair)
            if tok is None and not k[:, :, j, :].any() and not v[:, :, j, :].any():
                tok = "zero"
            out.append("?" if tok is None else tok)
        return out

    def window_matches(self, tokens: tuple[int, ...], arrays: tuple[mx.array, mx.array] | None) -> bool:
        if arrays is None:
            return len(tokens) == 0
        k, v = (np.asarray(a) for a in arrays)
        if k.dtype != np.float16 or v.dtype != np.float16:
            return False
        b, h, d = self.shape
        if k.shape != (b, h, len(tokens), d) or v.shape != (b, h, len(tokens), d):
            return False
        for j, t in enumerate(tokens):
            ek, ev = self.expected_row(t)
            if k[:, :, j : j + 1, :].tobytes() != ek or v[:, :, j : j + 1, :].tobytes() != ev:
                return False
        return True

    # -- the step -------------------------------------------------------------
    def reached(self, event: str) -> None:
        self.stats[event] = self.stats.get(event, 0) + 1

    def step(self, index: int, op: dict[str, Any]) -> None:
        self.reached("ops")
        if op["op"] == "expect":
            self.check_expect(index, op)
            return
        try:
            s_result, s_world = self.spec_apply(op)
            spec_out = Outcome(result=s_result)
        except KVCacheError as exc:
            spec_out, s_world = Outcome(error=exc), None
        try:
            impl_out = Outcome(result=self.impl_apply(op))
        except Divergence:
            raise
        except Exception as exc:  # noqa: BLE001 - a crash is a divergence too
            impl_out = Outcome(error=exc)

        if (spec_out.error is None) != (impl_out.error is None) or (
            spec_out.error is not None and type(spec_out.error) is not type(impl_out.error)
        ):
            raise Divergence(index, op, "refusal differs", spec_out.describe(), impl_out.describe())
        if self.compare_messages and spec_out.error is not None and str(spec_out.error) != str(impl_out.error):
            raise Divergence(index, op, "refusal message differs", spec_out.describe(), impl_out.describe())
        if spec_out.error is not None:
            self.reached("refused " + op["op"])
            self.refusals.append((index, str(spec_out.error)))
        if op.get("error") is True and spec_out.error is None:
            raise Divergence(index, op, "trace expects a refusal", spec_out.describe(), "a refusal", ("spec says", "trace expects"))
        if op.get("error") is False and spec_out.error is not None:
            raise Divergence(index, op, "trace expects success", spec_out.describe(), "success", ("spec says", "trace expects"))
        if s_world is not None:
            self.prev_world, self.world = self.world, s_world
            self.compare_result(index, op, spec_out.result, impl_out.result)
        self.compare_state(index, op)
        self.check_op_checks(index, op, spec_out)

    def compare_result(self, index: int, op: dict[str, Any], s: Any, i: Any) -> None:
        """Compare an op's return values; appends are compared by window."""
        if op["op"] == "append":
            self.compare_append(index, op, s, i)
        elif op["op"] != "fetch" and s != i:
            raise Divergence(index, op, "return value differs", s, i)

    def compare_append(self, index: int, op: dict[str, Any], s: Any, i: Any) -> None:
        if not self.window_matches(s.window, i):
            raise Divergence(index, op, "returned window differs", list(s.window), self.identify(i))
        if self.check_inplace and s.inplace != self.impl_last_inplace():
            raise Divergence(index, op, "in-place decision differs", f"inplace={s.inplace}", f"inplace={self.impl_last_inplace()}")
        self.reached("in-place writes" if s.inplace else "copying writes")

    def compare_state(self, index: int, op: dict[str, Any]) -> None:
        s_obs, i_obs = self.spec_observables(), self.impl_observables()
        for key in s_obs:
            if s_obs[key] != i_obs.get(key):
                raise Divergence(index, op, f"{key} differs", f"{key}={s_obs[key]}", f"{key}={i_obs.get(key)}")
        s_views, i_views = self.spec_views(), self.impl_views()
        if set(s_views) != set(i_views):
            raise Divergence(index, op, "holders differ", sorted(s_views), sorted(i_views))
        for name, tokens in s_views.items():
            arrays = i_views[name]
            if not self.window_matches(tokens, arrays):
                what = "live window differs" if name == "cache" else f"view of {name} changed (isolation)"
                raise Divergence(index, op, what, list(tokens), self.identify(arrays))

    def check_op_checks(self, index: int, op: dict[str, Any], spec_out: Outcome) -> None:
        if "returns" in op and spec_out.error is None:
            got = spec_out.result
            if op["op"] == "append":
                got = list(got.window)
            if got != op["returns"]:
                raise Divergence(index, op, "trace's 'returns' check fails", got, op["returns"], ("spec says", "trace expects"))
        if ("inplace" in op and op["op"] == "append" and spec_out.error is None
                and spec_out.result.inplace != op["inplace"]):
            raise Divergence(index, op, "trace's 'inplace' check fails", f"inplace={spec_out.result.inplace}",
                             f"inplace={op['inplace']}", ("spec says", "trace expects"))
        if "capacity" in op:
            cap = self.spec_observables()["capacity"]
            if cap != op["capacity"]:
                raise Divergence(index, op, "trace's 'capacity' check fails", f"capacity={cap}",
                                 f"capacity={op['capacity']}", ("spec says", "trace expects"))

    def check_expect(self, index: int, op: dict[str, Any]) -> None:
        name = op.get("of")
        s_views, i_views = self.spec_views(), self.impl_views()
        key = "cache" if name is None else self.view_key(name)
        if key not in s_views:
            names = sorted(k.split(":", 1)[1] for k in s_views if k.startswith("holder:"))
            raise Divergence(index, op, f"expect: no snapshot, handle or sequence named {name!r}",
                             f"holders are {names}", f"holders are {names}")
        want = list(op["window"])
        have = list(s_views[key])
        same = sorted(want) == sorted(have) if op.get("order") == "set" else want == have
        if not same:
            raise Divergence(index, op, "trace's 'expect' fails on the spec", have, want, ("spec says", "trace expects"))
        impl_have = self.identify(i_views.get(key))
        if op.get("order") == "set":
            same = sorted(map(str, impl_have)) == sorted(map(str, want))
        else:
            same = self.window_matches(tuple(want), i_views.get(key))
        if not same:
            raise Divergence(index, op, "trace's 'expect' fails on the implementation", want, impl_have,
                             ("trace expects", "impl did"))

    _UNHANDLED = object()
    #: the spec module whose ``apply_op`` runs each op on the spec side
    #: (``spec.dense`` or ``spec.rotating``)
    spec_module: Any = None
    #: the implementation's snapshot and detached-handle classes: ``restore``
    #: takes only an exact ``snapshot_class`` and handle ops only an exact
    #: ``handle_class`` (None: no check, the kind has one holder class)
    snapshot_class: type | None = None
    handle_class: type | None = None

    def impl_common(self, op: dict[str, Any]) -> Any:
        """The ops every cache kind runs the same way on the implementation
        side (``self.cache``; ``self.returned``/``self.held`` hold the
        windows, ``self.holders`` the snapshots by name): append, fetch,
        hold, release_hold, trim, trim_to, snapshot, restore, drop. Returns
        ``_UNHANDLED`` for any other op."""
        c, name = self.cache, op["op"]
        if name == "append":
            self.before_append(op)
            start = self.world.next_token  # the spec world before this op
            k, v = self.input_rows(list(range(start, start + op["n"])))
            self.returned = c.update_and_fetch(k, v)
            return self.returned
        if name == "fetch":
            return c.fetch()
        if name == "hold":
            if self.returned is None:
                raise StateError("hold: no append has returned a window yet")
            self.held = self.returned
            return None
        if name == "release_hold":
            self.held = None
            return None
        if name == "trim":
            return c.trim(op["n"])
        if name == "trim_to":
            return c.trim_to(op["len"])
        if name == "snapshot":
            self.fresh_name("snapshot", op["name"])
            self.holders[op["name"]] = c.snapshot()
            return None
        if name == "restore":
            c.restore(self.holder("restore", op["name"], self.snapshot_class))
            return None
        if name == "drop":
            self.holder("drop", op["name"])
            del self.holders[op["name"]]
            return None
        return self._UNHANDLED

    def holder(self, op: str, name: str, kind: type | None = None) -> Any:
        """The implementation's snapshot or handle called ``name``; with
        ``kind``, only one of exactly that class. Raises StateError worded as
        the spec words it."""
        holder = self.holders.get(name)
        if holder is None:
            raise StateError(f"{op}: no snapshot or handle named {name!r}")
        if kind is not None and type(holder) is not kind:
            have = "handle" if isinstance(holder, self.handle_class or ()) else "snapshot"
            want = "handle" if kind is self.handle_class else "snapshot"
            raise StateError(f"{op}: {name!r} is a {have}, not a {want}")
        return holder

    def fresh_name(self, op: str, name: str) -> None:
        if name in self.holders:
            raise StateError(f"{op}: name {name!r} is already in use")

    def before_append(self, op: dict[str, Any]) -> None:
        """Checks to run before an append reaches the implementation."""

    def view_key(self, name: str) -> str:
        return "holder:" + name

    # -- to be provided -------------------------------------------------------
    world: Any
    prev_world: Any

    def spec_apply(self, op: dict[str, Any]) -> tuple[Any, Any]:
        """The op on the spec world: ``(result, new world)`` (pure)."""
        return self.spec_module.apply_op(self.world, op)

    def impl_apply(self, op: dict[str, Any]) -> Any:
        raise NotImplementedError

    def impl_last_inplace(self) -> bool:
        return self.cache.last_write_inplace

    def spec_observables(self) -> dict[str, Any]:
        raise NotImplementedError

    def impl_observables(self) -> dict[str, Any]:
        raise NotImplementedError

    def spec_views(self) -> dict[str, tuple[int, ...]]:
        """Name -> token identities of every window the spec world shows:
        the live cache, each holder, the held window."""
        w = self.world
        views = {"cache": w.cache.window()}
        for name, holder in w.holders.items():
            views["holder:" + name] = holder.window()
        if w.held is not None:
            views["held"] = w.held.window() if hasattr(w.held, "window") else w.held
        return views

    def impl_views(self) -> dict[str, tuple[mx.array, mx.array] | None]:
        """The same windows read from the implementation."""
        views: dict[str, Any] = {"cache": self.cache.fetch()}
        for name, holder in self.holders.items():
            views["holder:" + name] = holder.fetch()
        if self.held is not None:
            views["held"] = self.held
        return views
