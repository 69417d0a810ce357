"""Record what a cache did during real decoding, as a kvtrace, and check a
recording against the spec alone (docs/record.md is the user's page).

**Recording.** :func:`record` wraps every layer's cache of a prompt cache
(a list of cache objects: mlx-lm's, this project's ``impl/`` caches, any
class with mlx-lm's cache protocol) for the length of a ``with`` block.
Each object keeps its identity and stays an instance of its class (its
class is swapped for a subclass that records, and swapped back at the
end), so ``generate_step``, ``stream_generate``, speculative decoding and a
program's own prompt-cache code run unchanged. One kvtrace per layer is
written (:meth:`Recorder.write`), holding:

* ``append`` (``update_and_fetch``): ``n`` = the rows given, and
  ``returns`` = the window the cache handed back, as token identities;
* ``trim`` (``trim(n)``): ``returns`` = the count the cache returned;
* ``state_snapshot`` / ``state_restore``: a ``state`` the program took and
  later assigned back with ``c.state = saved``, and that assignment;
* ``expect`` with ``of``: the window such a saved state holds, right after
  it was taken and after every op that changed it;
* ``"error": true`` on an op the cache refused (it raised).

Rows are named as kvtrace names them (docs/kvtrace.md, "Token
identities"): every appended row gets the next integer, and a returned row
is named by matching its bytes (the K and V rows of one position, every
batch entry and head) against the rows appended so far. Only the names go
into the file, never the rows, so a recording of a real model stays small.
A row that matches no appended row is named ``-1`` (garbage, or a slot
nobody wrote). Two appended rows with the same bytes (the same token fed
again at the same position) are told apart by continuity: a slot whose
bytes did not change keeps its name; otherwise the newest identity with
those bytes is used. No naming ever gives a row another row's bytes.

**Checking.** :func:`replay_spec_only` runs a trace's ops on the spec alone
(the kind's lockstep driver, spec side only: ``Lockstep.spec_apply``,
``check_op_checks``, ``spec_expect``) and stops at the first op the
recording shows happening in a way the contract does not allow: a returned
window or count the spec does not return, a saved window that changed, an
op recorded as done that the spec refuses, or recorded as refused that the
spec runs.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.fuzz import kinds
from kvspec.fuzz.lockstep import Divergence, Outcome
from kvspec.fuzz.replay import check_ops
from kvspec.fuzz.trace import Trace, TraceFormatError, parse
from kvspec.spec.errors import KVCacheError

#: The name a recording gives a returned row whose bytes match no row the
#: run appended (garbage, or a slot nobody wrote).
UNKNOWN_ROW = -1

_DTYPES = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}
_ATTR = "_kvspec_layer"
#: methods of cache classes that change a cache in ways no kvtrace/1 op says:
#: a call stops the recording of that layer (its trace ends before it)
_UNRECORDABLE = {
    "filter": "a batch cache keeps some of its sequences",
    "extend": "a batch cache takes in more sequences",
    "prepare": "a batch cache's padding is set up",
    "finalize": "a batch cache rolls its rows over its padding",
    "to_quantized": "the program goes on with a quantized copy, which is not recorded",
    "trim_front_keep_sink": "a front trim of this project's dense cache",
    "gather_positions": "a tree-speculation gather",
    "gather_within_tail": "a tree-speculation gather",
    "detach": "a detached handle",
    "install": "a detached handle installed",
    "restore": "a snapshot restored",
}


class RecordError(Exception):
    """A cache the recorder cannot wrap (not a cache object, or already
    being recorded)."""


def _row_hashes(keys: Any, values: Any) -> list[bytes]:
    """One 16-byte digest per position of ``keys``/``values`` (``[B, H, n,
    D]`` mx arrays): the bytes of the K and V rows of that position, every
    batch entry and head."""
    def host(a: Any) -> np.ndarray:
        bits = {2: mx.uint16, 4: mx.uint32}.get(a.dtype.size)
        arr = np.asarray(a.view(bits) if bits is not None else a)
        b, h, n, d = arr.shape
        return arr.transpose(2, 0, 1, 3).reshape(n, b * h * d)  # n may be 0: an empty window

    k, v = host(keys), host(values)
    return [hashlib.blake2b(k[j].tobytes() + b"|" + v[j].tobytes(), digest_size=16).digest()
            for j in range(k.shape[0])]


def _is_window(x: Any) -> bool:
    return (isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(a, mx.array) and a.ndim == 4 for a in x)
            and x[0].shape[2] == x[1].shape[2])


@dataclass
class _Saved:
    """A ``state`` the program took: the object handed out, where in the
    op log it was taken, and the names of its window after each op that
    changed it (``(after op log index, [(digest, name)])``)."""

    name: str
    obj: Any
    at: int
    #: ``meta_state`` when taken, where the class has one (read back with the state)
    meta: Any = None
    seen: list[tuple[int, list[tuple[bytes, int]]]] = field(default_factory=list)
    restored: bool = False
    dropped: bool = False


class LayerRecorder:
    """The recording of one layer: its op log, its identities and the
    states the program took. Built by :class:`Recorder`."""

    def __init__(self, index: int, cache: Any):
        self.index = index
        self.base: type = type(cache)
        self.cache_obj = cache
        self.log: list[dict[str, Any]] = []
        self.next_id = 0
        self.by_digest: dict[bytes, list[int]] = {}
        #: the last known naming of the live window, slot by slot
        self.live: list[tuple[bytes, int]] = []
        self.saved: list[_Saved] = []
        #: log index of each state_restore -> the state it assigned
        self.restores: dict[int, _Saved] = {}
        #: a state put back whose meta_state has not been assigned yet
        self.pending: _Saved | None = None
        self.config: dict[str, Any] | None = None
        #: why recording stopped (None: it did not): later ops are not in the trace
        self.stopped: str | None = None
        self.notes: list[str] = []
        self.busy = 0

    # -- naming -----------------------------------------------------------------
    def name_rows(self, digests: list[bytes], prior: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        """Names of the rows of a window (``digests``, slot by slot): a slot
        whose bytes are those of ``prior``'s slot keeps its name; the other
        slots, last to first, take the newest identity with their bytes that
        no slot of this window has taken yet (so rows with equal bytes
        appended together keep their own names), else the newest one (a row
        handed back twice), else :data:`UNKNOWN_ROW`."""
        out: list[tuple[bytes, int] | None] = [
            prior[j] if j < len(prior) and prior[j][0] == d else None for j, d in enumerate(digests)]
        used = {name for _, name in filter(None, out)}
        for j in reversed(range(len(digests))):
            if out[j] is not None:
                continue
            ids = self.by_digest.get(digests[j], [])
            name = next((i for i in reversed(ids) if i not in used), ids[-1] if ids else UNKNOWN_ROW)
            used.add(name)
            out[j] = (digests[j], name)
        return [x for x in out if x is not None]

    def stop(self, why: str) -> None:
        if self.stopped is None:
            self.stopped = f"op {len(self.log)}: {why}"

    def configure(self, keys: mx.array, values: mx.array) -> bool:
        """The trace's ``cache`` object, from the class and the first rows."""
        if self.config is not None:
            return True
        c = self.cache_obj
        mode = getattr(c, "mode", "fp16")
        if mode != "fp16":
            self.stop(f"mode {mode!r}: a recording names rows by their bytes, and a quantized cache hands back "
                      "other bytes than it was given")
            return False
        if keys.dtype not in _DTYPES or values.dtype != keys.dtype:
            self.stop(f"rows of dtype {keys.dtype}/{values.dtype}: kvtrace rows are float16, bfloat16 or float32 "
                      "(K and V alike)")
            return False
        b, h, _, dk = keys.shape
        dv = values.shape[3]
        step = getattr(c, "step", 256)
        cfg: dict[str, Any] = {"kind": "dense", "mode": "fp16",
                               "step": int(step) if isinstance(step, int) and step >= 1 else 256,
                               "batch": int(b), "kv_heads": int(h), "head_dim": int(dk)}
        if dv != dk:
            cfg["v_head_dim"] = int(dv)
        if keys.dtype != mx.float16:
            cfg["dtype"] = _DTYPES[keys.dtype]
        if isinstance(getattr(c, "max_size", None), int):
            # undo: the rows a trim after a wrap can take back (this project's rings; mlx-lm's has none)
            undo = getattr(c, "undo", 0)
            cfg.update(kind="rotating", max_size=int(c.max_size), keep=int(getattr(c, "keep", 0) or 0),
                       undo=int(undo) if isinstance(undo, int) and undo > 0 else 0)
        self.config = cfg
        return True

    # -- after every op -----------------------------------------------------------
    def window_of_state(self, state: Any, meta: Any = None) -> Any:
        """The window a saved ``state`` holds: loaded into a reader of the
        cache's own class (``reader.state = saved``, then ``reader.meta_state
        = meta`` where the class has one, which read and never write), read
        with ``keys_and_values()``."""
        reader = object.__new__(self.base)
        reader.__dict__.update({k: v for k, v in self.cache_obj.__dict__.items() if k != _ATTR})
        self.base.state.fset(reader, state)  # type: ignore[attr-defined]
        if meta:
            self.base.meta_state.fset(reader, meta)  # type: ignore[attr-defined]
        read = getattr(self.base, "keys_and_values", None) or self.base.fetch  # type: ignore[attr-defined]
        return read(reader)

    def observe(self) -> None:
        """After op ``len(log) - 1``: drop the saved states nobody holds any
        more; name the window of each other one, noting it when it changed."""
        after = len(self.log) - 1
        for s in self.saved:
            if s.dropped:
                continue
            if not s.restored and sys.getrefcount(s.obj) <= 2 and not _held_elsewhere(s.obj, self.cache_obj):
                s.dropped, s.obj = True, None  # only the recorder holds it: it can never be assigned back
                continue
            self.busy += 1
            try:
                window = self.window_of_state(s.obj, s.meta)
            except Exception as exc:  # noqa: BLE001 - a state the class cannot read back: said, not guessed
                # its window is unknown from here on: the trace ends, rather than claim a window it does not hold
                self.stop(f"the state {s.name!r} could not be read back after op {after} ({type(exc).__name__}: "
                          f"{exc})")
                return
            finally:
                self.busy -= 1
            if window is None:
                names: list[tuple[bytes, int]] = []
            elif _is_window(window):
                names = self.name_rows(_row_hashes(*window), s.seen[-1][1] if s.seen else self.live)
            else:
                self.stop(f"the state {s.name!r} reads back as {type(window).__name__}, not a (keys, values) window")
                return
            if not s.seen or [n for _, n in names] != [n for _, n in s.seen[-1][1]]:
                s.seen.append((after, names))

    # -- the ops -------------------------------------------------------------------
    def append(self, cache: Any, keys: Any, values: Any) -> Any:
        base_call = self.base.update_and_fetch  # type: ignore[attr-defined]
        self.check_pending()
        if self.stopped or not (isinstance(keys, mx.array) and isinstance(values, mx.array) and keys.ndim == 4
                                and values.ndim == 4) or not self.configure(keys, values):
            if self.stopped is None:
                self.stop("update_and_fetch was given something other than two [B, H, n, D] arrays")
            return base_call(cache, keys, values)
        c = self.config
        want = (c["batch"], c["kv_heads"], c["head_dim"], c.get("v_head_dim", c["head_dim"]))
        got = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
        if got != want or keys.dtype != values.dtype or _DTYPES.get(keys.dtype) != c.get("dtype", "float16"):
            self.stop(f"rows of shape {tuple(keys.shape)}/{tuple(values.shape)} and dtype {keys.dtype}, not the "
                      f"first rows' (batch, kv_heads, head dims {want}, {c.get('dtype', 'float16')}): a kvtrace "
                      "cache keeps one shape")
            return base_call(cache, keys, values)
        n = int(keys.shape[2])
        if n == 0 or values.shape[2] != n:
            self.stop(f"update_and_fetch of {n} keys and {values.shape[2]} values: a kvtrace append gives one "
                      "or more rows, as many keys as values")
            return base_call(cache, keys, values)
        op: dict[str, Any] = {"op": "append", "n": n}
        digests = _row_hashes(keys, values)
        self.busy += 1
        try:
            out = base_call(cache, keys, values)
        except Exception:
            op["error"] = True
            self.log.append(op)
            self.observe()
            raise
        finally:
            self.busy -= 1
        for j, d in enumerate(digests):
            self.by_digest.setdefault(d, []).append(self.next_id + j)
        self.next_id += n
        if not _is_window(out):
            self.stop(f"update_and_fetch returned {type(out).__name__}, not a (keys, values) window of "
                      "[B, H, L, D] arrays (a quantized cache's tuples are not recorded)")
            return out
        # the rows just appended keep their new names: the prior naming
        # covers only the slots before them
        names = self.name_rows(_row_hashes(*out), self.live[: max(0, int(out[0].shape[2]) - n)])
        op["returns"] = [i for _, i in names]
        self.live = names
        self.log.append(op)
        self.observe()
        return out

    def trim(self, cache: Any, n: Any) -> Any:
        base_call = self.base.trim  # type: ignore[attr-defined]
        self.check_pending()
        if self.stopped or self.config is None:
            if self.config is None and self.stopped is None:
                self.stop("trim before the first append (the recording starts with the first rows)")
            return base_call(cache, n)
        if not isinstance(n, int) or isinstance(n, bool):
            self.stop(f"trim({n!r}): a count that is not an integer")
            return base_call(cache, n)
        op: dict[str, Any] = {"op": "trim", "n": n}
        self.busy += 1
        try:
            out = base_call(cache, n)
        except Exception:
            op["error"] = True
            self.log.append(op)
            self.observe()
            raise
        finally:
            self.busy -= 1
        if isinstance(out, (int, np.integer)) and not isinstance(out, bool):
            op["returns"] = int(out)
            if 0 <= int(out) <= len(self.live):
                self.live = self.live[: len(self.live) - int(out)]
        else:
            self.stop(f"trim({n}) returned {out!r}, not a count")
            return out
        self.log.append(op)
        self.observe()
        return out

    def state_get(self, cache: Any) -> Any:
        self.check_pending()
        out = self.base.state.fget(cache)  # type: ignore[attr-defined]
        if not self.stopped and self.config is not None:
            s = _Saved(f"state{len(self.saved)}", out, len(self.log))
            self.saved.append(s)
            self.busy += 1
            try:
                if isinstance(getattr(self.base, "meta_state", None), property):
                    s.meta = self.base.meta_state.fget(cache)  # type: ignore[attr-defined]
                window = self.window_of_state(out, s.meta)
            except Exception:  # noqa: BLE001 - never restorable as a kvtrace state: not tracked
                s.dropped, s.obj = True, None
                return out
            finally:
                self.busy -= 1
            if window is not None and _is_window(window):
                s.seen.append((len(self.log) - 1, self.name_rows(_row_hashes(*window), self.live)))
            else:
                s.seen.append((len(self.log) - 1, []))
        return out

    def state_set(self, cache: Any, value: Any) -> None:
        """``c.state = value``: a ``state_restore`` of the saved state it is.
        A class with ``meta_state`` loads a state in two steps (``state``,
        then ``meta_state``): when the counters the state alone gives differ
        from those taken with it, the restore is complete at the
        ``meta_state`` assignment (:meth:`meta_set`)."""
        setter = self.base.state.fset  # type: ignore[attr-defined]
        self.check_pending()
        if self.stopped:
            setter(cache, value)
            return
        match = next((s for s in self.saved if not s.dropped and _same_state(s.obj, value)), None)
        if match is None:
            self.stop("state assigned from an object the recorder did not see taken from this layer's cache "
                      "(a state loaded from a file, taken before recording began, or put together by hand)")
            setter(cache, value)
            return
        if match.meta:
            self.busy += 1
            try:
                setter(cache, value)
                complete = _same_meta(self.base.meta_state.fget(cache), match.meta)  # type: ignore[attr-defined]
            except Exception:
                self.log_restore(match, error=True)
                raise
            finally:
                self.busy -= 1
            if complete:
                self.log_restore(match)
            else:
                self.pending = match
            return
        self.busy += 1
        try:
            setter(cache, value)
        except Exception:
            self.log_restore(match, error=True)
            raise
        finally:
            self.busy -= 1
        self.log_restore(match)

    def meta_set(self, cache: Any, value: Any) -> None:
        """``c.meta_state = value``: completes a pending restore (the meta
        taken with that state); the counters the cache already has pass
        through; any other value stops the recording."""
        setter = self.base.meta_state.fset  # type: ignore[attr-defined]
        pending, self.pending = self.pending, None
        if self.stopped or self.config is None:
            setter(cache, value)
            return
        if pending is None:
            if not _same_meta(self.base.meta_state.fget(cache), value):  # type: ignore[attr-defined]
                self.stop("meta_state assigned without the state taken with it (the counters changed under the rows)")
            setter(cache, value)
            return
        if not _same_meta(value, pending.meta):
            self.stop(f"meta_state assigned after the state {pending.name!r} is not the one taken with it")
            setter(cache, value)
            return
        self.busy += 1
        try:
            setter(cache, value)
        except Exception:
            self.log_restore(pending, error=True)
            raise
        finally:
            self.busy -= 1
        self.log_restore(pending)

    def check_pending(self) -> None:
        """Stop the recording when a state was put back and the next call is
        not its ``meta_state``: the cache holds the rows under other counters,
        which no kvtrace op says."""
        if self.pending is not None and not self.stopped:
            self.stop(f"the state {self.pending.name!r} was put back without the meta_state taken with it (this "
                      "class loads a state in two steps: state, then meta_state)")
        self.pending = None

    def log_restore(self, match: _Saved, error: bool = False) -> None:
        op: dict[str, Any] = {"op": "state_restore", "name": match.name}
        if error:
            op["error"] = True
        else:
            self.live = list(match.seen[-1][1]) if match.seen else []
        self.restores[len(self.log)] = match
        match.restored = True
        self.log.append(op)
        self.observe()

    def unrecordable(self, name: str) -> None:
        """A method with no kvtrace counterpart was called: the recording
        stops before it."""
        if self.config is not None:
            self.stop(f"{name}() has no kvtrace op ({_UNRECORDABLE[name]})")

    def copied(self, deep: bool) -> None:
        self.notes.append(f"op {len(self.log)}: a {'deep' if deep else 'shallow'} copy of the cache was made; "
                          "ops on the copy are not recorded")

    # -- the trace ------------------------------------------------------------------
    def trace(self, title: str = "") -> Trace | None:
        """The kvtrace of this layer (None: no rows were ever appended)."""
        if self.config is None:
            return None
        kept = [s for s in self.saved if s.restored]
        names = {id(s): f"state{k}" for k, s in enumerate(kept)}  # in the order they were taken
        ops: list[dict[str, Any]] = []
        taken = {s.at: [] for s in kept}  # type: dict[int, list[_Saved]]
        for s in kept:
            taken[s.at].append(s)
        seen_after: dict[int, list[tuple[_Saved, list[tuple[bytes, int]]]]] = {}
        for s in kept:
            for after, window in s.seen[1:]:
                seen_after.setdefault(after, []).append((s, window))

        def snapshots_at(i: int) -> None:
            for s in taken.get(i, ()):
                ops.append({"op": "state_snapshot", "name": names[id(s)]})
                ops.append({"op": "expect", "of": names[id(s)], "window": [n for _, n in s.seen[0][1]]})

        for i, op in enumerate(self.log):
            snapshots_at(i)
            if op["op"] == "state_restore":
                op = {**op, "name": names[id(self.restores[i])]}
            ops.append(op)
            for s, window in seen_after.get(i, ()):
                ops.append({"op": "expect", "of": names[id(s)], "window": [n for _, n in window]})
        snapshots_at(len(self.log))
        head = title or f"recorded: layer {self.index}, {self.base.__module__}.{self.base.__qualname__}"
        if self.stopped:
            head += f"; recording stopped at {self.stopped}"
        doc = {"kvtrace": 1, "title": head[:4096], "cache": self.config, "ops": ops}
        trace = parse(doc)
        trace.cache = {"kind": trace.cache["kind"], **trace.cache}  # the kind first, as people write it
        return trace


def _held_elsewhere(obj: Any, cache: Any) -> bool:
    """Whether an array of a saved ``state`` tuple is held by someone other
    than the tuple itself and the cache's own attributes."""
    if not isinstance(obj, tuple):
        return True
    for a in obj:
        if not isinstance(a, mx.array):
            continue
        own = sum(v is a for v in vars(cache).values())
        # getrefcount's argument, the tuple, the loop variable
        if sys.getrefcount(a) - 3 - own > 0:
            return True
    return False


def _same_meta(a: Any, b: Any) -> bool:
    """Two ``meta_state`` values name the same counters (strings or not)."""
    try:
        return tuple(map(str, a)) == tuple(map(str, b))
    except TypeError:
        return bool(a == b)


def _same_state(saved: Any, value: Any) -> bool:
    if saved is value:
        return True
    if isinstance(saved, (tuple, list)) and isinstance(value, (tuple, list)) and len(saved) == len(value):
        return all(a is b or (not isinstance(a, mx.array) and a == b) for a, b in zip(saved, value))
    return False


def _recording_class(base: type) -> type:
    """A subclass of ``base`` that records through the instance's
    :class:`LayerRecorder` (same name and module, so prompt-cache files and
    ``isinstance`` see the class they know). A new class each call: nothing
    of a recording outlives it."""
    if not isinstance(getattr(base, "state", None), property):
        raise RecordError(f"{base.__qualname__}: no 'state' property (mlx-lm's cache protocol)")

    def layer_of(self: Any) -> LayerRecorder | None:
        layer = self.__dict__.get(_ATTR)
        return None if layer is None or layer.busy else layer

    def update_and_fetch(self: Any, keys: Any, values: Any) -> Any:
        layer = layer_of(self)
        if layer is None:
            return base.update_and_fetch(self, keys, values)  # type: ignore[attr-defined]
        return layer.append(self, keys, values)

    def trim(self: Any, n: Any) -> Any:
        layer = layer_of(self)
        if layer is None:
            return base.trim(self, n)  # type: ignore[attr-defined]
        return layer.trim(self, n)

    def get_state(self: Any) -> Any:
        layer = layer_of(self)
        return base.state.fget(self) if layer is None else layer.state_get(self)  # type: ignore[attr-defined]

    def set_state(self: Any, value: Any) -> None:
        layer = layer_of(self)
        if layer is None:
            base.state.fset(self, value)  # type: ignore[attr-defined]
        else:
            layer.state_set(self, value)

    def plain_copy(self: Any, deep: bool, memo: Any = None) -> Any:
        layer = self.__dict__.pop(_ATTR, None)
        self.__class__ = base
        try:
            return copy.deepcopy(self, memo) if deep else copy.copy(self)
        finally:
            self.__class__ = cls
            if layer is not None:
                self.__dict__[_ATTR] = layer
                layer.copied(deep)

    def get_meta(self: Any) -> Any:
        return base.meta_state.fget(self)  # type: ignore[attr-defined]

    def set_meta(self: Any, value: Any) -> None:
        layer = layer_of(self)
        if layer is None:
            base.meta_state.fset(self, value)  # type: ignore[attr-defined]
        else:
            layer.meta_set(self, value)

    def guard(name: str) -> Any:
        method = getattr(base, name)

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            layer = layer_of(self)
            if layer is not None:
                layer.unrecordable(name)
            return method(self, *args, **kwargs)

        return call

    ns: dict[str, Any] = {name: guard(name) for name in _UNRECORDABLE if callable(getattr(base, name, None))}
    ns |= {
        "update_and_fetch": update_and_fetch, "trim": trim, "state": property(get_state, set_state),
        "__copy__": lambda self: plain_copy(self, False),
        "__deepcopy__": lambda self, memo: plain_copy(self, True, memo),
        "__module__": base.__module__, "__qualname__": base.__qualname__,
    }
    meta = getattr(base, "meta_state", None)
    if isinstance(meta, property) and meta.fset is not None:
        ns["meta_state"] = property(get_meta, set_meta)
    cls = type(base.__name__, (base,), ns)
    return cls


class Recorder:
    """Records every layer of one prompt cache (a list of cache objects).
    Use :func:`record`; :meth:`traces` and :meth:`write` give the result."""

    def __init__(self, caches: Sequence[Any], layers: Sequence[int] | None = None):
        caches = list(caches)
        chosen = range(len(caches)) if layers is None else list(layers)
        for i in chosen:
            if not 0 <= i < len(caches):
                raise RecordError(f"layers: no layer {i} in a prompt cache of {len(caches)} layers")
        self.layers: list[LayerRecorder] = []
        classes: dict[type, type] = {}
        self._installed: list[tuple[Any, type]] = []
        for i in chosen:
            c = caches[i]
            if not hasattr(c, "__dict__") or not callable(getattr(c, "update_and_fetch", None)):
                raise RecordError(f"layer {i}: {type(c).__qualname__} has no update_and_fetch (not a KV cache)")
            if _ATTR in c.__dict__ or any(layer.cache_obj is c for layer in self.layers):
                raise RecordError(f"layer {i}: this cache is already being recorded")
            if type(c) not in classes:
                try:
                    classes[type(c)] = _recording_class(type(c))
                except RecordError as exc:
                    raise RecordError(f"layer {i}: {exc}") from None
            self.layers.append(LayerRecorder(i, c))
        for layer in self.layers:  # nothing is swapped before every layer passed
            c = layer.cache_obj
            try:
                c.__class__ = classes[type(c)]
            except TypeError as exc:  # a class whose instances cannot change class (an extension type)
                self.close()
                raise RecordError(f"layer {layer.index}: {type(c).__qualname__} cannot be wrapped: {exc}") from None
            c.__dict__[_ATTR] = layer
            self._installed.append((c, layer.base))

    def close(self) -> None:
        """Unwrap every cache: each is an instance of its own class again."""
        for c, base in self._installed:
            c.__class__ = base
            c.__dict__.pop(_ATTR, None)
        self._installed = []

    def traces(self, title: str = "") -> list[tuple[int, Trace]]:
        """``(layer index, kvtrace)`` of every recorded layer that was
        given rows."""
        out = []
        for layer in self.layers:
            t = layer.trace(title)
            if t is not None:
                out.append((layer.index, t))
        return out

    @property
    def notes(self) -> list[str]:
        """What the recording could not show, layer by layer."""
        out = []
        for layer in self.layers:
            if layer.stopped:
                out.append(f"layer {layer.index}: recording stopped at {layer.stopped}")
            out += [f"layer {layer.index}: {n}" for n in layer.notes]
        return out

    def write(self, folder: str | Path, title: str = "") -> list[Path]:
        """Write ``layerNN.json`` per recorded layer into ``folder``
        (created); returns the paths. The folder holds one recording: a
        ``layerNN.json`` of an earlier recording there that this one does
        not write is removed, so ``kvspec replay --spec-only folder``
        checks this recording alone."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for i, t in self.traces(title):
            p = folder / f"layer{i:02d}.json"
            p.write_text(t.dumps())
            paths.append(p)
        for old in folder.glob("layer*.json"):
            if re.fullmatch(r"layer\d{2,}\.json", old.name) and old not in paths and old.is_file():
                old.unlink()
        return paths


@contextmanager
def record(caches: Sequence[Any], out: str | Path | None = None, layers: Sequence[int] | None = None,
           title: str = "") -> Iterator[Recorder]:
    """Record every layer of ``caches`` (or those in ``layers``) while the
    block runs; on exit unwrap them and, with ``out``, write one kvtrace per
    layer there (:meth:`Recorder.write`; also when the block raised)::

        cache = make_prompt_cache(model)
        with record(cache, out="rec/") as rec:
            for tok, _ in generate_step(prompt, model, prompt_cache=cache): ...
        # kvspec replay --spec-only rec/

    Raises RecordError for a list entry that is not a cache or is already
    being recorded."""
    rec = Recorder(caches, layers)
    try:
        yield rec
    finally:
        rec.close()
        if out is not None:  # a run that raised is recorded up to where it stopped
            rec.write(out, title)


# -- checking a recording against the spec alone -----------------------------------

#: The kinds a spec-only replay checks: one sequence, ops with recorded returns.
SPEC_ONLY_KINDS = ("dense", "rotating")


@dataclass
class SpecOnlyResult:
    """The verdict of :func:`replay_spec_only`: ``ok``, the ops run, and for
    an impossible recording the first check that fails (:class:`Divergence`,
    labels ``spec says`` / ``recorded``). When that check is an ``expect``
    of a saved window, the op at fault is the op before it, which the window
    was read after: ``after`` (its index) and ``after_op``; otherwise the
    op at fault is the one that failed."""

    ok: bool
    ops_run: int
    divergence: Divergence | None = None
    after: int | None = None
    after_op: dict[str, Any] | None = None

    @property
    def index(self) -> int | None:
        """The op at fault (None: every op is possible)."""
        if self.divergence is None:
            return None
        return self.after if self.after is not None else self.divergence.index

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.ok, "ops_run": self.ops_run}
        d = self.divergence
        if d is not None:
            imp: dict[str, Any] = {"index": self.index, "op": self.after_op if self.after is not None else d.op,
                                   "what": d.what, "spec": _plain(d.spec), "recorded": _plain(d.impl)}
            if self.after is not None:
                imp["seen_at"] = {"index": d.index, "op": d.op}
            out["impossible"] = imp
        return out

    def __str__(self) -> str:
        d = self.divergence
        if d is None:
            return f"{self.ops_run} ops, every one possible under the contract"
        if self.after is None:
            return str(d)
        return (f"op {self.after} {json.dumps(self.after_op)}: {d.what}\n"
                f"  seen at op {d.index} {json.dumps(d.op)}\n"
                f"  spec says: {d.spec}\n  recorded:  {d.impl}")


def _plain(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except TypeError:
        return str(x)


def _what(op: dict[str, Any], check: str) -> str:
    name = op["op"]
    if name == "expect":
        return (f"the window of state {op['of']!r} after this op is impossible" if "of" in op
                else "the live window after this op is impossible")
    if name == "append" and "returns" in check:
        return "the returned window is impossible"
    if "returns" in check:
        return f"the value {name} returned is impossible"
    return check


def replay_spec_only(trace: Trace) -> SpecOnlyResult:
    """Run ``trace`` on the spec alone and compare what it records with what
    the spec allows, op by op; stop at the first impossible op. In a
    recording an op without ``"error": true`` succeeded: the spec refusing
    it is impossible, as is the spec running an op recorded as refused.
    Raises TraceFormatError (exit 2) for a kind this mode does not check
    (:data:`SPEC_ONLY_KINDS`), a trace with no ops, or an ``expect`` of a
    name nothing holds."""
    if trace.cache["kind"] not in SPEC_ONLY_KINDS:
        raise TraceFormatError(f"field cache.kind: --spec-only checks recordings of kinds "
                               f"{', '.join(SPEC_ONLY_KINDS)}, got {trace.cache['kind']!r}")
    if not trace.ops:
        raise TraceFormatError("field ops: no ops: a recording of nothing checks nothing (was the recording "
                               "stopped at its first op? its title says why)")
    check_ops(trace.cache, trace.ops)
    kind = kinds.get(trace.cache["kind"], trace.cache.get("mode"))
    lock = kind.lockstep_class()(trace.cache)  # builds the spec world; the implementation side is never driven
    last = None
    for i, op in enumerate(trace.ops):
        try:
            _spec_step(lock, i, op)
        except Divergence as d:
            d.labels = ("spec says", "recorded")  # type: ignore[assignment]
            d.what = _what(op, d.what)
            after = last if op["op"] == "expect" else None
            return SpecOnlyResult(False, i + 1, d, after, None if after is None else trace.ops[after])
        if op["op"] != "expect":
            last = i
    return SpecOnlyResult(True, len(trace.ops))


def _spec_step(lock: Any, index: int, op: dict[str, Any]) -> None:
    if op["op"] == "expect":
        lock.spec_expect(index, op)
        return
    try:
        result, world = lock.spec_apply(op)
        out = Outcome(result=result)
    except KVCacheError as exc:
        out, world = Outcome(error=exc), None
    if op.get("error") is True and out.error is None:
        raise Divergence(index, op, "recorded as refused; the spec runs it", out.describe(), "a refusal")
    if op.get("error") is not True and out.error is not None:
        raise Divergence(index, op, "recorded as done; the spec refuses it", out.describe(),
                         "done" + (f", returned {op['returns']!r}" if "returns" in op else ""))
    if world is not None:
        lock.prev_world, lock.world = lock.world, world
    lock.check_op_checks(index, op, out)
