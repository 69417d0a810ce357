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

import copy
import ctypes
import numbers
import os
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np

from kvspec.fuzz import expected_refusals, interrupt
from kvspec.fuzz import rows as rowgen
from kvspec.fuzz.device import current as current_device
from kvspec.fuzz.failures import (  # noqa: F401  (Divergence re-exported)
    Divergence,
    HarnessFailure,
    TargetCapabilityError,
    _jsonable,
    classify_failure,
)
from kvspec.fuzz.protocol import refusal_category
from kvspec.impl.dense import data_pointer
from kvspec.impl.write import inplace_keeps_memory
from kvspec.spec.dense import inplace_switch
from kvspec.spec.errors import KVCacheError, StateError

#: The environment variable of the in-place switch (kvspec.spec.dense.inplace_switch).
INPLACE_ENV = "KV_INPLACE_WRITE"


def reload_through_file(caches: list[Any], save: Any = None, load: Any = None, env: str | None = None) -> list[Any]:
    """``caches`` saved to a temporary prompt-cache file and loaded back
    (``save``/``load``: ``kvspec.impl.models.save_prompt_cache`` /
    ``load_prompt_cache`` unless an injected bug replaces one). An injected
    bug's class is the class under test on both sides: while the file is
    written and read, the file layer's class table names it under its own
    name (so its ``meta_state``, ``state`` and ``from_state`` are the ones
    fuzzed; saving it as the kvspec class it derives from would hide a bug
    in them). ``env``: ``KV_INPLACE_WRITE`` during the load (a process
    whose switch differs from the file's: the loaded layers keep the
    file's)."""
    import tempfile
    from pathlib import Path

    from kvspec.impl import models

    save = save or models.save_prompt_cache
    load = load or models.load_prompt_cache
    added = {type(c).__name__: type(c) for c in caches if type(c).__name__ not in models._CLASSES}
    saved_env = os.environ.get(INPLACE_ENV)
    models._CLASSES.update(added)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "prompt.safetensors"
            save(path, list(caches))
            if env is not None:
                os.environ[INPLACE_ENV] = env
            try:
                return list(load(path))
            finally:
                if env is not None:
                    if saved_env is None:
                        del os.environ[INPLACE_ENV]
                    else:
                        os.environ[INPLACE_ENV] = saved_env
    finally:
        for name in added:
            del models._CLASSES[name]


def host_pointer(a: mx.array) -> int:
    """``kvspec.impl.dense.data_pointer(a)`` for an array in host memory (the CPU),
    without its second evaluation for bfloat16 (NumPy has no bfloat16, so
    ``data_pointer`` reads it through a ``uint16`` view, one more MLX round
    trip): a C-contiguous array's address is read through the buffer
    protocol (the same memory ``np.array(a, copy=False)`` aliases); any
    other array through ``data_pointer``."""
    if a.dtype == mx.bfloat16:
        mx.eval(a)
        try:
            return ctypes.addressof(ctypes.c_char.from_buffer(memoryview(a)))
        except (TypeError, ValueError, BufferError):  # not C-contiguous (a window of a longer buffer)
            pass
    return data_pointer(a)


def is_cache_copy(holder: Any) -> bool:
    """Whether a held object is a copy of a cache (the ``copy`` op), not a
    snapshot or handle: it can take appends."""
    return callable(getattr(holder, "update_and_fetch", None))


class StateHolder:
    """A snapshot taken through mlx-lm's protocol: exactly the objects
    ``c.state`` returned (and ``c.meta_state``, where the class has one),
    kept without a copy, as programs keep ``[c.state for c in cache]``.
    ``fetch()`` reads its window by loading it into a fresh cache of the
    same class (``fresh.state = saved``), which reads and never writes."""

    def __init__(self, state: Any, meta: Any, fresh: Any):
        self.state, self.meta, self._fresh = state, meta, fresh

    def load_into(self, cache: Any) -> None:
        """``cache.state = saved`` (then ``cache.meta_state = meta``)."""
        cache.state = self.state
        if self.meta is not None:
            cache.meta_state = self.meta

    def fetch(self) -> Any:
        """The saved window, or :class:`Unreadable` when the class cannot
        load its own saved state back (the comparison reports it)."""
        try:
            reader = self._fresh()
            self.load_into(reader)
            return reader.fetch()
        except Exception as exc:  # noqa: BLE001 - any failure to load back is the finding
            return Unreadable(exc)


#: a memory address, as an object's repr shows it (``<X object at
#: 0x7f42c5d82e50>``): where an object lives is no part of a verdict
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{8,}\b")


def error_text(exc: BaseException) -> str:
    """``Type: message`` of an exception one side raised, as a divergence
    shows it: a function of the trace alone (docs/fuzzing.md, "Determinism
    of a verdict"). Memory addresses in reprs are masked (``0x…``). An
    AssertionError keeps only its message as written in the source, with
    the file and line that raised it: pytest rewrites the asserts of this
    repository's packages (they are a pytest plugin's distribution), and the
    explanation it adds (``assert ... is None`` with reprs) appears only
    under pytest."""
    text = str(exc)
    if isinstance(exc, AssertionError):
        text = "" if text.startswith("assert ") else text.split("\nassert ", 1)[0]
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None:
            path = tb.tb_frame.f_code.co_filename.replace(os.sep, "/").rsplit("/", 2)[-2:]
            text = f"(at {'/'.join(path)}:{tb.tb_lineno})" + (f" {text}" if text else "")
    return f"{type(exc).__name__}: {_ADDRESS.sub('0x…', text)}"


@dataclass
class Unreadable:
    """A holder whose window cannot be read back (its state does not load)."""

    error: BaseException

    def describe(self) -> str:
        return f"loading it back raised {error_text(self.error)}"


def take_state(cache: Any, fresh: Any) -> StateHolder:
    """``saved = c.state`` (with ``c.meta_state`` where the class has one)."""
    meta = cache.meta_state if hasattr(type(cache), "meta_state") else None
    return StateHolder(cache.state, meta, fresh)


def same_value(spec: Any, impl: Any) -> bool:
    """An observable or a return value of the implementation equals the
    spec's, and is of its kind: where the spec has a count (an ``int``:
    offset, live_len, idx, rows trimmed) the implementation's is an integer
    too (``numbers.Integral``, NumPy's included; not a bool, not a float
    such as 3.0, which equals 3 but breaks a slice bound or a model's
    positions); where the spec has a bool (``is_trimmable()``) the
    implementation's is a bool (Python's or NumPy's). Anything else:
    ``==``."""
    if isinstance(spec, bool):
        return isinstance(impl, (bool, np.bool_)) and bool(impl) == spec
    if isinstance(spec, int):
        return isinstance(impl, numbers.Integral) and not isinstance(impl, (bool, np.bool_)) and int(impl) == spec
    return bool(spec == impl)


def of_kind(spec: Any, impl: Any) -> Any:
    """``impl`` as a report shows it: itself, or where it equals the spec's
    value but is not of its kind (:func:`same_value`), its repr and type
    (``3.0 (float, not int)``)."""
    if isinstance(spec, (bool, int)) and not isinstance(impl, bool) and impl == spec:
        return f"{impl!r} ({type(impl).__name__}, not {type(spec).__name__})"
    return impl


@dataclass
class Outcome:
    """What one side did with one op: a result or a refusal."""

    result: Any = None
    error: BaseException | None = None

    def describe(self) -> str:
        if self.error is None:
            return f"returned {self.result!r}"
        return f"raised {error_text(self.error)}"


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
    #: Compare memory sharing (the cost contract, semantics.md 5.4): two
    #: windows share memory in the implementation (same data pointer) iff
    #: the spec says they hold the same buffer, and an in-place append keeps
    #: the cache's memory. Bytes alone cannot tell an O(1) snapshot from a
    #: deep copy.
    check_sharing = True

    def __init__(self, cache: dict[str, Any]):
        self.cfg = cache
        d = cache["head_dim"]
        #: (B, H, K head dim, V head dim)
        self.shape = (cache["batch"], cache["kv_heads"], cache.get("k_head_dim") or d, cache.get("v_head_dim") or d)
        #: the rows' dtype (kvtrace ``dtype``): what the cache must hand back
        self.dtype: str = cache.get("dtype", "float16")
        self._expected: dict[tuple[int, str], tuple[bytes, bytes]] = {}
        self.stats: dict[str, int] = {}
        #: (op index, message) of every op both sides refused
        self.refusals: list[tuple[int, str]] = []
        #: whether the op being compared was refused (both sides)
        self.refused = False
        #: the implementation's snapshots and handles by name, the window the
        #: last append returned and the held one (``hold``)
        self.holders: dict[str, Any] = {}
        self.returned: tuple[mx.array, mx.array] | None = None
        self.held: tuple[mx.array, mx.array] | None = None
        #: this step's reads (:meth:`prefetch`): id -> (array, host form);
        #: the implementation's windows and ``state`` as read after the op
        self._memo: dict[int, tuple[Any, Any]] = {}
        self._step_views: dict[str, Any] | None = None
        self._step_state: Any = None
        self._step_reload: Any = None
        self._pointers_memo: dict[int, tuple[Any, int]] = {}
        #: checks waiting for this step's evaluation (:meth:`defer`)
        self._deferred: list[tuple[list[Any], Any]] | None = None
        #: expected bytes of whole windows, by (tokens, mode)
        self._windows: dict[tuple[tuple[int, ...], str], tuple[bytes, bytes]] = {}
        self._expected_arrays: dict[tuple[int, str], tuple[Any, Any]] = {}

    def spec_inplace(self) -> bool:
        """The in-place switch the spec runs with: the trace's ``inplace``,
        or, when the trace sets ``inplace_env``, what kvspec.spec.dense.inplace_switch
        reads from that ``KV_INPLACE_WRITE`` spelling."""
        env = self.cfg.get("inplace_env")
        return self.cfg["inplace"] if env is None else inplace_switch(env)

    def build(self, factory: Any, **kwargs: Any) -> Any:
        """The implementation's cache: ``factory(inplace=..., **kwargs)``.
        With ``inplace_env`` the cache is built with ``inplace=None`` while
        ``KV_INPLACE_WRITE`` holds that spelling, so the implementation parses
        the variable itself (the environment is restored afterwards)."""
        self._built = (factory, kwargs)
        env = self.cfg.get("inplace_env")
        if env is None:
            return factory(inplace=self.cfg["inplace"], **kwargs)
        saved = os.environ.get(INPLACE_ENV)
        os.environ[INPLACE_ENV] = env
        try:
            return factory(inplace=None, **kwargs)
        finally:
            if saved is None:
                del os.environ[INPLACE_ENV]
            else:
                os.environ[INPLACE_ENV] = saved

    @classmethod
    def check_cache(cls, cache: dict[str, Any]) -> None:
        """Refuse (``TraceFormatError``) a cache configuration the schema
        allows but the kind cannot build; nothing by default."""

    # -- rows -----------------------------------------------------------------
    def wide_rows(self) -> bool | str:
        """Rows beyond float16's range (kvspec.fuzz.rows) for unquantized storage;
        Int8: rows up to float16's largest value (``"edge"``: never refused,
        and they reach the read-back's float16 saturation)."""
        mode = self.cfg.get("mode", "fp16")
        return True if mode == "fp16" else "edge" if mode == "int8" else False

    def host_rows(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The K and V rows of ``tokens`` in host form (``kvspec.fuzz.rows.rows``:
        float16, or float32 holding bfloat16 or float32 values)."""
        b, h, dk, dv = self.shape
        wide = self.wide_rows()
        scheme = self.cfg.get("rows", "numpy")
        return (rowgen.rows(tokens, "k", b, h, dk, self.dtype, wide, scheme),
                rowgen.rows(tokens, "v", b, h, dv, self.dtype, wide, scheme))

    def input_rows(self, tokens: list[int]) -> tuple[mx.array, mx.array]:
        k, v = self.host_rows(tokens)
        return rowgen.to_mx(k, self.dtype), rowgen.to_mx(v, self.dtype)

    def host_stored_rows(self, token: int, mode: str) -> tuple[np.ndarray, np.ndarray] | None:
        """What ``host(stored_form(row))`` gives for the token's K and V rows,
        computed on the host without MLX (no round trip to its scheduler),
        or None where only :meth:`stored_form` can say. Unquantized storage
        (:meth:`stored_identity`): the rows' own host form, bit for bit
        what MLX hands back (tests/test_fast_checks.py)."""
        return self.host_rows([token]) if self.stored_identity(mode) else None

    def stored_identity(self, mode: str) -> bool:
        """Whether :meth:`stored_form` hands rows back as given in ``mode``
        (unquantized storage): then a reader's expected bytes are the rows'
        own host form. True for ``fp16`` and wherever ``stored_form`` is
        not overridden."""
        return type(self).stored_form is Lockstep.stored_form or mode == "fp16"

    def expected_row(self, token: int, mode: str | None = None) -> tuple[bytes, bytes]:
        """The bytes a reader must see for a token's K and V rows (``mode``:
        a layer's storage mode where layers differ; default the cache's)."""
        mode = mode or self.cfg.get("mode", "fp16")
        got = self._expected.get((token, mode))
        if got is None:
            host = self.host_stored_rows(token, mode) if current_device() == "cpu" else None
            if host is not None:
                hk, hv = host
            else:
                k, v = self.input_rows([token])
                hk, hv = rowgen.host_many([self.stored_form(k, mode), self.stored_form(v, mode)])
            got = (hk.tobytes(), hv.tobytes())
            self._expected[(token, mode)] = got
            self._expected_arrays[(token, mode)] = (hk, hv)
        return got

    def expected_window(self, tokens: tuple[int, ...], mode: str | None = None) -> tuple[bytes, bytes]:
        """The bytes of a whole window holding ``tokens``' rows (C order of
        ``[B, H, n, D]``), K and V: what :meth:`window_matches` compares a
        window's bytes with, in one comparison, not one per row. Windows
        recur from op to op (a snapshot's does not change), so they are
        kept."""
        mode = mode or self.cfg.get("mode", "fp16")
        key = (tokens, mode)
        got = self._windows.get(key)
        if got is None:
            for t in tokens:
                self.expected_row(t, mode)
            ks = [self._expected_arrays[(t, mode)][0] for t in tokens]
            vs = [self._expected_arrays[(t, mode)][1] for t in tokens]
            got = (np.concatenate(ks, axis=2).tobytes(), np.concatenate(vs, axis=2).tobytes())
            if len(self._windows) > 4096:
                self._windows.clear()
            self._windows[key] = got
        return got

    # -- reading the implementation, one MLX round trip per step ----------------
    def host(self, a: Any) -> Any:
        """``rows.host(a)``, from this step's reads when :meth:`prefetch`
        read ``a`` (the same array object) after the op."""
        hit = self._memo.get(id(a))
        if hit is not None and hit[0] is a:
            return hit[1]
        return rowgen.host(a)

    def read_all(self, arrays: list[Any], evaluate: list[Any] = ()) -> None:
        """Read ``arrays`` to the host in one ``mx.eval`` (with ``evaluate``,
        arrays only evaluated) and keep their host forms for this step."""
        memo = self._memo
        todo = [a for a in dict.fromkeys(arrays, None) if isinstance(a, mx.array) and id(a) not in memo]
        forms = rowgen.read_forms(todo)
        lazy = forms + [a for a in evaluate if isinstance(a, mx.array)]
        if lazy:
            mx.eval(*lazy)
        for a, f in zip(todo, forms):
            memo[id(a)] = (a, np.asarray(f))

    def prefetch(self, op: dict[str, Any], outcome: Outcome) -> None:
        """After the op: read every window the checks will compare (the
        returned one, the live window, every holder's), and evaluate
        ``state`` and the save/load round trip's comparison
        (:meth:`compare_reload`), all in one MLX evaluation. A read that
        raises is left for the check that makes it (it raises there, where
        it always did)."""
        try:
            views = self.impl_views()
            arrays = rowgen.mx_arrays(outcome.result) if outcome.error is None else []
            arrays += rowgen.mx_arrays(views)
            cls = self.reload_class()
            state = self.cache.state if cls is not None else None
            evaluate = rowgen.mx_arrays(state)
            reload = None
            if cls is not None and op["op"] not in self.READ_ONLY_OPS:
                try:
                    back = cls.from_state(state, self.cache.meta_state)
                    got = back.state
                    equal = ([mx.array_equal(a, b) for a, b in zip(state, got)]
                             if self._same_layout(state, got) else None)
                    reload = (back, got, equal)
                    evaluate += equal or []
                except Exception:  # noqa: BLE001 - compare_reload loads again and reports it
                    reload = None
            evaluate += self.more_to_evaluate(views, state)
            evaluate += [a for pending, _ in self._deferred or [] for a in pending]
            self.read_all(arrays, evaluate)
        except Exception:  # noqa: BLE001 - the checks read again and report it
            self._memo.clear()
            return
        self._step_views, self._step_state, self._step_reload = views, state, reload

    def more_to_evaluate(self, views: dict[str, Any], state: Any) -> list[Any]:
        """Lazy arrays a kind's own checks will evaluate after this op (made
        from ``views`` and ``state``), for :meth:`prefetch`'s one
        evaluation; none by default."""
        return []

    def pointer(self, a: mx.array) -> int:
        """``kvspec.impl.dense.data_pointer(a)``, kept per array object for this
        lockstep: an evaluated MLX array's memory never moves, and reading
        a bfloat16 array's pointer costs an MLX evaluation of its own. The
        arrays are held, so no id is reused while it is kept."""
        if not inplace_keeps_memory():
            return data_pointer(a)  # CUDA: holding the array would stop MLX donating it
        hit = self._pointers_memo.get(id(a))
        if hit is not None and hit[0] is a:
            return hit[1]
        p = host_pointer(a)
        self._pointers_memo[id(a)] = (a, p)
        return p

    def defer(self, arrays: list[Any], check: Any) -> None:
        """Run ``check()`` once ``arrays`` (lazy results taken now, e.g. the
        masks ``make_mask`` returns before an append) are evaluated: inside
        a step, right after the op, in the step's one evaluation and before
        any other comparison; outside one, at once."""
        if self._deferred is None:
            if arrays:
                mx.eval(*arrays)
            check()
            return
        self._deferred.append((arrays, check))

    def run_deferred(self) -> None:
        pending, self._deferred = self._deferred or [], None
        lazy = [a for arrays, _ in pending for a in arrays]
        if lazy:
            mx.eval(*lazy)  # already evaluated by prefetch, unless it failed
        for _, check in pending:
            check()

    def step_views(self) -> dict[str, Any]:
        """``impl_views()`` as :meth:`prefetch` read them after this op."""
        return self._step_views if self._step_views is not None else self.impl_views()

    def step_state(self) -> Any:
        """The implementation cache's ``state`` as read after this op."""
        return self._step_state if self._step_state is not None else self.cache.state

    def stored_form(self, x: mx.array, mode: str = "fp16") -> mx.array:
        """What a reader gets back for one row: unquantized storage hands
        back the rows as given, in their dtype (semantics.md 2 "Storage")."""
        return x

    def identify(self, arrays: tuple[mx.array, mx.array] | None, mode: str | None = None) -> list[Any]:
        """Name each row of a fetched window by the token whose bytes it
        holds: an int, "zero" for an all-zero row nobody wrote, "?" else."""
        if arrays is None:
            return []
        if isinstance(arrays, Unreadable):
            return [arrays.describe()]
        k, v = (self.host(a) for a in arrays)
        mode = mode or self.cfg.get("mode", "fp16")
        # every identity handed out so far, the failing op's own rows included
        for t in range(getattr(self.world, "next_token", 0)):
            if (t, mode) not in self._expected:
                self.expected_row(t, mode)
        lookup = {pair: t for (t, m), pair in self._expected.items() if m == mode}
        out: list[Any] = []
        for j in range(max(k.shape[2], v.shape[2])):
            if j >= k.shape[2] or j >= v.shape[2]:
                # a target that took a K/V pair of different lengths holds
                # a row on one side only: no token's pair
                out.append(f"{'V' if j >= k.shape[2] else 'K'} only")
                continue
            pair = (k[:, :, j : j + 1, :].tobytes(), v[:, :, j : j + 1, :].tobytes())
            tok = lookup.get(pair)
            if tok is None and not k[:, :, j, :].any() and not v[:, :, j, :].any():
                tok = "zero"
            out.append("?" if tok is None else tok)
        return out

    def window_matches(self, tokens: tuple[int, ...], arrays: tuple[mx.array, mx.array] | None,
                       mode: str | None = None) -> bool:
        """The fetched window holds exactly ``tokens``' rows: the trace's
        dtype, ``[B, H, n, Dk]`` / ``[B, H, n, Dv]``, byte for byte."""
        if arrays is None:
            return len(tokens) == 0
        if isinstance(arrays, Unreadable):
            return False
        if any(rowgen.dtype_name(a) != self.dtype for a in arrays):
            return False
        k, v = (self.host(a) for a in arrays)
        b, h, dk, dv = self.shape
        if k.shape != (b, h, len(tokens), dk) or v.shape != (b, h, len(tokens), dv):
            return False
        if not tokens:
            return True
        ek, ev = self.expected_window(tuple(tokens), mode)
        # tobytes() is C order whatever the view's strides: row j of the
        # window is where row j of the expected concatenation is
        return k.tobytes() == ek and v.tobytes() == ev

    # -- the step -------------------------------------------------------------
    def reached(self, event: str) -> None:
        self.stats[event] = self.stats.get(event, 0) + 1

    #: how reports name the implementation side (``impl``, or a target's name)
    impl_name = "impl"

    def step(self, index: int, op: dict[str, Any]) -> None:
        """Run ``op`` on both sides and compare; raises Divergence (its
        second line names :attr:`impl_name`)."""
        try:
            try:
                self._step(index, op)
            except Divergence:
                raise
            except Exception as exc:
                # whose failure (kvspec.fuzz.failures.classify_failure): the target's
                # crash while read (a divergence), a capability gap or the
                # harness's own failure (exit 2), never a raw traceback
                from kvspec.fuzz.trace import TraceFormatError

                if isinstance(exc, (TraceFormatError, HarnessFailure)):
                    raise
                raise (classify_failure(self, index, op, exc, running=False) or exc) from exc
        except Divergence as d:
            if self.impl_name != "impl":
                d.labels = tuple(f"{self.impl_name} did" if lab == "impl did" else lab for lab in d.labels)  # type: ignore[assignment]
            raise

    def _step(self, index: int, op: dict[str, Any]) -> None:
        self._memo.clear()
        self._step_views = self._step_state = self._step_reload = None
        self._deferred = []
        try:
            with expected_refusals():  # a refused rollback is compared here, not news (fuzz/__init__.py)
                self._run_step(index, op)
        finally:
            self._deferred = None

    def _run_step(self, index: int, op: dict[str, Any]) -> None:
        interrupt.check()  # a Ctrl-C a gc callback swallowed still stops the run (kvspec.fuzz.interrupt)
        self.reached("ops")
        if op["op"] == "expect":
            self.check_expect(index, op)
            return
        try:
            s_result, s_world = self.spec_apply(op)
            spec_out = Outcome(result=s_result)
        except KVCacheError as exc:
            spec_out, s_world = Outcome(error=exc), None
        self.pointer_before = self.impl_pointers().get("cache") if self.check_sharing else None
        self.values_pointer_before = self.impl_values_pointer() if self.check_sharing else None
        try:
            impl_out = Outcome(result=self.impl_apply(op))
        except Divergence:
            raise
        except Exception as exc:  # a target's crash is a divergence too (classify_failure)
            other = classify_failure(self, index, op, exc, running=True)
            if other is not None:  # a capability gap or the harness's own crash: exit 2
                raise other from exc
            impl_out = Outcome(error=exc)
        self.prefetch(op, impl_out)
        self.run_deferred()

        self.compare_refusal(index, op, spec_out, impl_out)
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
        self.refused = spec_out.error is not None
        self.compare_state(index, op)
        self.check_op_checks(index, op, spec_out)

    #: ops whose refusal each cache words its own way (naming the dimension
    #: or dtype at fault): their type is compared, not their words
    OWN_WORDED_OPS: ClassVar[frozenset[str]] = frozenset({"append_mismatch", "append_pair_mismatch"})
    #: a target's own exception types -> refusal category (kvspec.fuzz.targets)
    refusal_categories: ClassVar[dict[type, str]] = {}

    def compare_refusal(self, index: int, op: dict[str, Any], spec_out: Outcome, impl_out: Outcome) -> None:
        """Both sides refuse, or neither. With :attr:`compare_messages` (our
        implementation) the refusal has the spec's exact type and words;
        otherwise the two refusals fall in the same category
        (:func:`refusal_category`), and an exception of no category is a
        crash, never a refusal."""
        s_err, i_err = spec_out.error, impl_out.error
        if s_err is None and i_err is None:
            return
        if (s_err is None) != (i_err is None):
            raise Divergence(index, op, "refusal differs", self.describe_side(spec_out),
                             self.describe_side(impl_out))
        if self.compare_messages:
            if type(s_err) is not type(i_err):
                raise Divergence(index, op, "refusal differs", spec_out.describe(), impl_out.describe())
            if str(s_err) != str(i_err) and op["op"] not in self.OWN_WORDED_OPS:
                raise Divergence(index, op, "refusal message differs", spec_out.describe(), impl_out.describe())
            return
        if refusal_category(s_err) != refusal_category(i_err, self.refusal_categories):  # type: ignore[arg-type]
            raise Divergence(index, op, "refusal category differs", self.describe_side(spec_out),
                             self.describe_side(impl_out))

    def describe_side(self, out: Outcome) -> str:
        """An outcome, with a refusal's category (or "not a refusal")."""
        if out.error is None or self.compare_messages:
            return out.describe()
        cat = refusal_category(out.error, self.refusal_categories)
        return f"{out.describe()} ({cat or 'not a refusal: a crash'})"

    def compare_result(self, index: int, op: dict[str, Any], s: Any, i: Any) -> None:
        """Compare an op's return values; appends are compared by window."""
        if op["op"] == "append":
            self.compare_append(index, op, s, i)
        elif op["op"] != "fetch" and not same_value(s, i):
            raise Divergence(index, op, "return value differs", s, of_kind(s, i))

    def compare_append(self, index: int, op: dict[str, Any], s: Any, i: Any) -> None:
        if not self.window_matches(s.window, i):
            raise Divergence(index, op, "returned window differs", list(s.window), self.identify(i))
        if self.check_inplace and s.inplace != self.impl_last_inplace():
            raise Divergence(index, op, "in-place decision differs", f"inplace={s.inplace}", f"inplace={self.impl_last_inplace()}")
        if self.check_sharing and s.inplace and self.pointer_before is not None:
            after = self.impl_pointers().get("cache")
            if not inplace_keeps_memory():
                # CUDA's donate mechanism (kvspec.impl.write): MLX reuses the memory
                # only when nothing else holds it, so a move is a copy, not a
                # bug; what others see is still checked (isolation, windows).
                self.reached("in-place writes donated" if after == self.pointer_before else "in-place writes copied by MLX")
            elif after != self.pointer_before:
                raise Divergence(index, op, "an in-place write moved the cache's memory",
                                 "same memory (in place)", "the keys' data pointer moved: new memory (a copy)")
            elif self.values_pointer_before is not None and self.impl_values_pointer() != self.values_pointer_before:
                raise Divergence(index, op, "an in-place write moved the cache's values memory",
                                 "same memory (in place)",
                                 "the values' data pointer moved: new memory (a copy)")
        self.reached("in-place writes" if s.inplace else "copying writes")

    def impl_caches(self) -> list[Any]:
        """The implementation's caches (one; a list of layers has several)."""
        return [self.cache]

    def compare_switch(self, index: int, op: dict[str, Any]) -> None:
        """Under ``inplace_env`` the switch every cache runs with is the
        spec's reading of that spelling (kvspec.spec.dense.inplace_switch)."""
        env, want = self.cfg["inplace_env"], self.spec_inplace()
        for c in self.impl_caches():
            if getattr(c, "inplace", want) is not want:
                raise Divergence(index, op, "in-place switch differs",
                                 f"KV_INPLACE_WRITE={env!r}: inplace={want}", f"inplace={c.inplace}")

    #: ops that change neither a cache's arrays nor its counters (checks
    #: of the stored form are not repeated after them)
    READ_ONLY_OPS = frozenset({"fetch", "snapshot", "drop", "hold", "release_hold", "handle_trim_to", "expect",
                               "state_snapshot"})

    def reload_class(self) -> type | None:
        """The class whose ``from_state(state, meta_state)`` must give this
        cache back, as a prompt-cache file load does; None where the kind
        has no such round trip (a list of layers, a paged sequence)."""
        return None

    def compare_reload(self, index: int, op: dict[str, Any]) -> None:
        """A save/load round trip is a fixpoint: ``from_state(state,
        meta_state)`` loads, answers the same ``meta_state`` (mode, step,
        counters, window and sinks, dtype, head dims, array names...) and
        the same ``state`` arrays, value by value (the window follows from
        these). The spec has no load op, so this is checked on the
        implementation against itself after every op that writes: a field
        dropped or swapped on save or load, or a ``state`` that holds other
        rows than the valid ones, shows here."""
        cls = self.reload_class()
        if cls is None:
            return
        c = self.cache
        if op["op"] in self.READ_ONLY_OPS:
            # the skip is only sound if the op really wrote nothing: an op
            # listed here by mistake (a restore, a trim) shows at once
            before = getattr(self, "_reloaded_meta", None)
            if before is not None and c.meta_state != before:
                raise Divergence(index, op, "an op counted read-only (no save/load check) changed meta_state",
                                 list(before), list(c.meta_state))
            return
        want = self.step_state()
        loaded = self._step_reload
        if loaded is None:
            try:
                back = cls.from_state(want, c.meta_state)
            except Exception as exc:  # noqa: BLE001 - any failure to load is the divergence
                raise Divergence(index, op, "state/meta_state do not load back", "a cache", repr(exc)) from None
            loaded = (back, back.state, None)
        back, got, equal = loaded
        if back.meta_state != c.meta_state:
            raise Divergence(index, op, "a save/load round trip changes meta_state", list(c.meta_state),
                             list(back.meta_state))
        names = getattr(c, "state_names", lambda: tuple(range(len(want))))()
        back_names = getattr(back, "state_names", lambda: tuple(range(len(got))))()
        same = names == back_names and self._same_layout(want, got)
        if same:
            if equal is None:
                equal = [mx.array_equal(a, b) for a, b in zip(want, got)]
                mx.eval(*equal)  # one evaluation for every array of the state
            same = all(bool(e) for e in equal)
        if not same:
            raise Divergence(index, op, "a save/load round trip changes the arrays", list(names), list(back_names))
        self._reloaded_meta = c.meta_state

    @staticmethod
    def _same_layout(want: Any, got: Any) -> bool:
        return len(want) == len(got) and all(a.dtype == b.dtype and a.shape == b.shape for a, b in zip(want, got))

    def compare_state(self, index: int, op: dict[str, Any]) -> None:
        if "inplace_env" in self.cfg:
            self.compare_switch(index, op)
        s_obs, i_obs = self.spec_observables(), self.impl_observables()
        for key in s_obs:
            if not same_value(s_obs[key], i_obs.get(key)):
                raise Divergence(index, op, f"{key} differs", f"{key}={s_obs[key]}",
                                 f"{key}={of_kind(s_obs[key], i_obs.get(key))}")
        s_views, i_views = self.spec_views(), self.step_views()
        if set(s_views) != set(i_views):
            raise Divergence(index, op, "holders differ", sorted(s_views), sorted(i_views))
        for name, tokens in s_views.items():
            arrays = i_views[name]
            if isinstance(arrays, Unreadable):
                raise Divergence(index, op, self.view_label(name), list(tokens), arrays.describe())
            if not self.view_matches(name, tokens, arrays):
                raise Divergence(index, op, self.view_label(name), list(tokens),
                                 self.identify(arrays, self.view_mode(name)))
        if self.check_sharing:
            self.compare_sharing(index, op)
        self.compare_reload(index, op)

    def predictions(self, op: dict[str, Any], result: Any) -> dict[str, Any]:
        """The spec's checks for ``op`` (which returned ``result`` on the
        spec) that a written-out trace carries, so that another engine can
        replay it without our spec: ``inplace`` of an append, ``returns``
        of ops that return a value, ``capacity``."""
        out: dict[str, Any] = {}
        if op["op"] == "append":
            out["inplace"] = result.inplace
        elif op["op"] not in ("fetch", "snapshot", "restore", "drop", "detach", "install", "hold", "release_hold",
                              "state_snapshot", "state_restore", "copy", "append_mismatch", "reload",
                              "state_assign", "append_pair_mismatch"):
            out["returns"] = list(result) if isinstance(result, tuple) else result
        out["capacity"] = self.spec_observables()["capacity"]
        return out

    def expect_ops(self) -> list[dict[str, Any]]:
        """``expect`` ops pinning the spec's live window and every holder's."""
        out = []
        for key, window in self.spec_views().items():
            if key == "held":
                continue
            op: dict[str, Any] = {"op": "expect", "window": list(window)}
            if key != "cache":
                op["of"] = key.split(":", 1)[1]
            out.append(op)
        return out

    def view_label(self, name: str) -> str:
        """How a divergence names a window that differs."""
        if name == "cache":
            return "live window differs"
        if isinstance(self.holders.get(name.removeprefix("holder:")), StateHolder):
            return f"view of state snapshot {name} changed (isolation)"
        return f"view of {name} changed (isolation)"

    def view_matches(self, name: str, tokens: tuple[int, ...], arrays: Any) -> bool:
        """Whether the implementation's window ``name`` holds ``tokens``'
        rows (a kind whose rows depend on where they sit overrides it)."""
        return self.window_matches(tokens, arrays, self.view_mode(name))

    def view_mode(self, name: str) -> str | None:
        """The storage mode of the window ``name`` (None: the cache's)."""
        return None

    def compare_sharing(self, index: int, op: dict[str, Any]) -> None:
        """Memory sharing against the spec's buffers (:meth:`spec_buffers` /
        :meth:`impl_pointers`): after an append, the cache shares memory
        with a holder only if the spec says it still holds the same buffer
        (a copying write made new memory); after an op that shares by
        contract (:meth:`shared_by`: a snapshot, a restore, a hold), the
        windows it shares also share memory in the implementation (O(1),
        not a copy). (Other ops may give the cache a view of a holder's
        memory where the spec gives it a new buffer, e.g. an undo-log trim;
        the isolation and in-place checks cover what a later write does.)"""
        s, i = self.spec_buffers(), self.impl_pointers()
        names = [n for n in s if s[n] is not None and i.get(n) is not None]
        if op["op"] == "append":
            for a, b in self.written_pairs(names):
                if i[a] == i[b] and s[a] != s[b]:
                    raise Divergence(index, op, f"memory sharing of {a} and {b} differs",
                                     f"the copying write gave {a} new memory, apart from {b}",
                                     f"{a} and {b} share memory (one data pointer)")
        # a refused op (a snapshot under a name in use, say) shared nothing:
        # what sharing is left from earlier ops is not its contract (after an
        # in-place write beside a holder, CUDA's donate may have copied)
        for a, b in [] if self.refused else self.shared_by(op):
            if a in names and b in names and s[a] == s[b] and i[a] != i[b]:
                raise Divergence(index, op, f"memory sharing of {a} and {b} differs",
                                 f"{a} and {b} share one buffer (O(1))",
                                 f"{a} and {b} hold different memory (two data pointers): a copy")
        if len(names) > 1:
            self.reached("sharing checked")

    def written_pairs(self, names: list[str]) -> list[tuple[str, str]]:
        """(the cache, a holder of it) for every holder among ``names``: an
        append writes the cache, so where the spec gives it a new buffer
        the implementation must not still share the holder's memory."""
        return [("cache", n) for n in names if n != "cache"] if "cache" in names else []

    def shared_by(self, op: dict[str, Any]) -> list[tuple[str, str]]:
        """The windows ``op`` shares by contract: a snapshot and a restore
        share the cache's buffers with the named holder, a hold the window
        the last append returned."""
        if op["op"] in ("snapshot", "restore"):
            return [("cache", "holder:" + op["name"])]
        if op["op"] == "hold":
            return [("cache", "held")]
        return []

    def spec_buffers(self) -> dict[str, Any]:
        """Window name -> the spec's buffer identity (None: no buffer, or
        not modelled). Default: nothing is compared."""
        return {}

    def impl_pointers(self) -> dict[str, int | None]:
        """Window name -> the data pointer of the implementation's keys
        buffer behind it (``kvspec.impl.dense.data_pointer``)."""
        return {}

    def impl_values_pointer(self) -> int | None:
        """The data pointer of the cache's values buffer (None: none, or not
        modelled): an in-place write must leave it where it was too."""
        return None

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
        key, want = self.spec_expect(index, op)
        i_views = self.impl_views()
        impl_have = self.identify(i_views.get(key))
        if op.get("order") == "set":
            same = sorted(map(str, impl_have)) == sorted(map(str, want))
        else:
            same = self.window_matches(tuple(want), i_views.get(key))
        if not same:
            raise Divergence(index, op, "trace's 'expect' fails on the implementation", want, impl_have,
                             ("trace expects", "impl did"))

    def spec_expect(self, index: int, op: dict[str, Any]) -> tuple[str, list[Any]]:
        """The spec half of ``expect``: ``(view key, the window it lists)``;
        Divergence when the spec's window differs (``kvspec replay
        --spec-only`` runs this half alone)."""
        name = op.get("of")
        s_views = self.spec_views()
        key = "cache" if name is None else self.view_key(name)
        if key not in s_views:
            from kvspec.fuzz.trace import TraceFormatError

            names = sorted(k.split(":", 1)[1] for k in s_views if k.startswith("holder:"))
            raise TraceFormatError(f"op {index} field 'of': no snapshot or handle named {name!r} at this op "
                                   f"(live: {', '.join(names) or 'none'})")
        want = list(op["window"])
        have = list(s_views[key])
        same = sorted(want) == sorted(have) if op.get("order") == "set" else want == have
        if not same:
            raise Divergence(index, op, "trace's 'expect' fails on the spec", have, want, ("spec says", "trace expects"))
        return key, want

    _UNHANDLED = object()
    #: the spec module whose ``apply_op`` runs each op on the spec side
    #: (``kvspec.spec.dense`` or ``kvspec.spec.rotating``)
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
        if name in ("hold", "release_hold"):
            return self.impl_hold(name)
        if name == "trim":
            return c.trim(op["n"])
        if name == "trim_to":
            return c.trim_to(op["len"])
        if name == "snapshot":
            self.fresh_name("snapshot", op["name"])
            self.holders[op["name"]] = c.snapshot()
            return None
        if name == "restore":
            held = self.holders.get(op["name"])
            if held is not None and is_cache_copy(held):
                # a held copy of the cache (``copy``): restore from it
                c.restore(held.snapshot())
                return None
            snap = self.holder("restore", op["name"], self.snapshot_class)
            if isinstance(snap, StateHolder):  # restore takes snapshots only (the spec's rule)
                raise StateError(f"restore: {op['name']!r} is a state snapshot, not a snapshot")
            c.restore(snap)
            return None
        if name == "copy":
            self.fresh_name("copy", op["name"])
            dup = copy.deepcopy(c) if op.get("deep", True) else copy.copy(c)
            if op.get("live", "original") == "copy":
                # the trace goes on with the copy (LRUPromptCache hands out a
                # deep copy); the original is held
                self.holders[op["name"]] = c
                self.cache = dup
            else:
                self.holders[op["name"]] = dup
            return None
        if name == "append_mismatch":
            k, v = self.mismatched_rows(op["n"], op["differs"])
            self.returned = c.update_and_fetch(k, v)
            return None
        if name == "append_pair_mismatch":
            self.returned = c.update_and_fetch(*self.pair_mismatched_rows(op["n"], op["differs"]))
            return None
        if name == "reload":
            self.cache = self.reloaded(c, op.get("via", "file"))
            return None
        if name == "drop":
            self.holder("drop", op["name"])
            del self.holders[op["name"]]
            return None
        if name == "state_snapshot":
            self.fresh_name("state_snapshot", op["name"])
            self.holders[op["name"]] = take_state(c, self.fresh_cache)
            return None
        if name == "state_restore":
            self.holder("state_restore", op["name"], StateHolder).load_into(c)
            return None
        return self._UNHANDLED

    def fresh_cache(self) -> Any:
        """A new, empty cache of the class under test, built as the live one
        was (what a state snapshot is read back through)."""
        factory, kwargs = self._built
        return self.build(factory, **kwargs)

    def next_identity(self) -> int:
        """The token identity the next appended row takes (the spec world's
        counter)."""
        return self.world.next_token

    def mismatched_rows(self, n: int, differs: str) -> tuple[mx.array, mx.array]:
        """Rows of the next ``n`` token identities in a shape or dtype the
        cache does not hold: one more batch row or kv head, a K or V head
        dim twice the cached one, or another float dtype (for both arrays,
        or for the keys or the values alone)."""
        b, h, dk, dv = self.shape
        dtype = kdt = vdt = self.dtype
        other = "float32" if dtype != "float32" else "float16"
        if differs == "batch":
            b += 1
        elif differs == "kv_heads":
            h += 1
        elif differs == "k_head_dim":
            dk *= 2
        elif differs == "v_head_dim":
            dv *= 2
        elif differs == "k_dtype":
            kdt = other
        elif differs == "v_dtype":
            vdt = other
        else:
            kdt = vdt = other
        start = self.next_identity()
        tokens = list(range(start, start + n))
        return (rowgen.to_mx(rowgen.rows(tokens, "k", b, h, dk, kdt, False), kdt),
                rowgen.to_mx(rowgen.rows(tokens, "v", b, h, dv, vdt, False), vdt))

    def pair_mismatched_rows(self, n: int, differs: str) -> tuple[mx.array, mx.array]:
        """A K/V pair of the next ``n`` token identities whose keys are the
        trace's shape and dtype (the cached rows') and whose values disagree
        with them (kvspec.spec.dense.PAIR_FIELDS): another float dtype, one more
        batch row, one more kv head, or one more row than the keys."""
        b, h, dk, dv = self.shape
        vb, vh, vdt = b, h, self.dtype
        start = self.next_identity()
        k_tokens = v_tokens = list(range(start, start + n))
        if differs == "dtype":
            vdt = "float32" if self.dtype != "float32" else "float16"
        elif differs == "batch":
            vb += 1
        elif differs == "kv_heads":
            vh += 1
        else:  # rows: the values carry one row more than the keys
            v_tokens = list(range(start, start + n + 1))
        return (rowgen.to_mx(rowgen.rows(k_tokens, "k", b, h, dk, self.dtype, False), self.dtype),
                rowgen.to_mx(rowgen.rows(v_tokens, "v", vb, vh, dv, vdt, False), vdt))

    def reloaded(self, c: Any, via: str) -> Any:
        """The cache saved and loaded back. ``file``: through a prompt-cache
        file (:func:`reload_through_file`); the loaded layer takes the place
        of the live cache. ``state``: mlx-lm's load order on the cache
        itself, ``state`` then ``meta_state``. A target's object with its
        own ``kvspec_reload(via)`` (a built-in adapter: mlx-lm's own
        prompt-cache files) reloads that way."""
        own = getattr(c, "kvspec_reload", None)
        if callable(own):
            return own(via)
        if via == "state":
            if not callable(getattr(getattr(type(c), "state", None), "fset", None)):
                from kvspec.fuzz.trace import TraceFormatError

                raise TraceFormatError(f"reload: via 'state' needs a state setter, which {type(c).__name__} lacks "
                                       "(it loads by from_state: use via 'file')")
            state, meta = c.state, c.meta_state
            c.state = state
            c.meta_state = meta
            return c
        (loaded,) = reload_through_file([c])
        return loaded

    def impl_hold(self, name: str) -> None:
        """``hold`` keeps the window the last append returned alive (as a
        pipelined step does); ``release_hold`` lets it go. Every kind alike."""
        if name == "release_hold":
            self.held = None
            return
        if self.returned is None:
            raise StateError("hold: no append has returned a window yet")
        self.held = self.returned
        return

    def holder(self, op: str, name: str, kind: type | None = None) -> Any:
        """The implementation's snapshot or handle called ``name``; with
        ``kind``, only one of exactly that class. Raises StateError worded as
        the spec words it."""
        holder = self.holders.get(name)
        if holder is None:
            raise StateError(f"{op}: no snapshot or handle named {name!r}")
        if kind is not None and type(holder) is not kind:
            raise StateError(f"{op}: {name!r} is a {self.holder_kind(holder)}, not a {self.holder_kind(kind)}")
        return holder

    def holder_kind(self, holder: Any) -> str:
        """How the spec names a holder (or a holder class): ``snapshot``,
        ``state snapshot`` or ``handle``."""
        cls = holder if isinstance(holder, type) else type(holder)
        if issubclass(cls, StateHolder):
            return "state snapshot"
        return "handle" if self.handle_class is not None and issubclass(cls, self.handle_class) else "snapshot"

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
        if op["op"] == "append_mismatch" and not self.spec_module.holds_buffer(self.world):
            from kvspec.fuzz.trace import TraceFormatError

            raise TraceFormatError("append_mismatch: only on a cache holding a buffer (an empty cache takes any "
                                   "shape; the spec cannot follow rows of another shape)")
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
