"""The recurrent layer's harness (kind ``recurrent``): the lockstep driver of
``kvspec.spec.recurrent`` against ``kvspec.impl.recurrent.RecurrentCache`` and its state
machine.

The harness plays the model. Its layer (:class:`FakeMixer`, an ``nn.Module``
with the signature of mlx-lm's recurrent mixers, ``(x, mask, cache)``) reads
``cache[0]`` (the conv window) and ``cache[1]`` (the recurrent state), writes
the new conv window (the last ``kernel - 1`` input rows, zero rows before the
first token), a new state by an exact recurrence, then ``cache.advance(S)``,
as mlx-lm's layers do. Appends run it through ``kvspec.impl.recurrent``'s step
recorder (``record_steps`` on the harness's model), so the recorder, which
splits a call's last ``min(S, U)`` tokens into single-token calls and records
a checkpoint after each, is under test too; ``append_unrecorded`` calls the
layer outside the recorder.

Rows and states are named by token identity:

* a conv row is the portable row of its token (``kvspec.fuzz.rows``, scheme
  ``portable``: no row is all zero, so a zero row is one nobody wrote), of
  shape ``(B, C)``, in the trace's dtype;
* the state, ``(B, 3)`` float32, is per batch element ``(t, h1, h2)``: the
  count of tokens consumed and two rolling hashes ``h = (h * m + v) mod p``
  of each token's value ``v`` (the sum of its row's 16-bit words), computed
  in integers below 2^24, so float32 holds them exactly. A state is decoded
  back to the sequence it summarises, so a wrong state reads "the state after
  [0, 1, 2, 5]" where the spec says "after [0, 1, 2]".

After every op the harness compares offset, depth, coverage
(``trimmable_rows()``), ``is_trimmable()`` and, for the live layer and every
holder (snapshot, state snapshot, copy), the conv window and state row by row
after a rollback of every ``n`` in ``0..coverage`` (taken on a copy), so a
checkpoint that is wrong shows at once, not only at the trim that lands on
it.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule
from mlx import nn

from kvspec.fuzz import rows as rowgen
from kvspec.fuzz.lockstep import (
    Divergence,
    Lockstep,
    StateHolder,
    error_text,
    is_cache_copy,
    take_state,
)
from kvspec.fuzz.machine import KVMachine, StateProtocolMachine
from kvspec.fuzz.trace import TraceFormatError
from kvspec.spec import recurrent as sr
from kvspec.spec.errors import StateError

__all__ = ["FakeMixer", "FakeModel", "RecurrentLockstep", "RecurrentMachine", "RecurrentRows", "arrays_mismatch"]

#: the two rolling hashes of the fake state: (multiplier, modulus)
HASHES = ((31, 65521), (37, 65519))
#: the fake state's width per batch element: count, h1, h2
STATE_WIDTH = 1 + len(HASHES)


def _impl() -> Any:
    """``kvspec.impl.recurrent`` (imported on first use)."""
    from kvspec.impl import recurrent

    return recurrent


class FakeMixer(nn.Module):
    """A recurrent mixer as mlx-lm writes one, with an exact recurrence: the
    conv window is the last ``kernel - 1`` input rows; the state (``size``
    2) per batch element is ``(t, h1, h2)``, advanced token by token with
    ``v`` the sum of the token's row as 16-bit words. ``mask`` (B, S), when
    given, must match the call's tokens (a recorder that hands a sub-call the
    whole call's mask raises here) and zeroes masked rows, as the Mamba2
    mixer does."""

    def __init__(self, kernel: int, size: int):
        super().__init__()
        self.conv_kernel_size = kernel
        self.size = size
        #: write the arrays by negative index (``cache[-1]`` the last array),
        #: as a model may
        self.negative = False
        #: tokens after which the call raises (after writing the conv
        #: window): the harness's failing call; None: never
        self.fail_after: int | None = None
        #: when a list: the cache's coverage before the call and after each
        #: array write is appended (the harness's unrecorded calls)
        self.coverages: list[int] | None = None

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None,
                 extra: mx.array | None = None) -> mx.array:
        B, S, C = x.shape
        if extra is not None and extra.ndim < 0:  # read (never sliceable): the recorder runs the call unsplit
            raise ValueError("mixer: extra")
        if mask is not None:
            if tuple(mask.shape) != (B, S):
                raise ValueError(f"mixer: mask of shape {tuple(mask.shape)} for a call of {S} tokens (batch {B})")
            x = mx.where(mask[..., None], x, mx.zeros_like(x))
        k = self.conv_kernel_size - 1
        conv_i, state_i = (-self.size, -1) if self.negative else (0, 1)
        conv = cache[conv_i] if cache[conv_i] is not None else mx.zeros((B, k, C), dtype=x.dtype)
        if self.coverages is not None:
            self.coverages.append(cache.trimmable_rows())
        cache[conv_i] = mx.concatenate([conv, x], axis=1)[:, -k:, :]
        if self.coverages is not None:
            self.coverages.append(cache.trimmable_rows())
        if self.fail_after is not None:
            self.fail_after -= S
            if self.fail_after <= 0:
                raise MixerFailure(f"mixer: the harness's failing call (after writing the conv window of {S} tokens)")
        if self.size == 2:
            words = x.view(mx.uint16).astype(mx.int32).sum(axis=-1)  # (B, S): each token's value v
            state = cache[1]
            if state is None:
                state = mx.zeros((B, STATE_WIDTH), dtype=mx.float32)
            cols = [state[:, j].astype(mx.int32) for j in range(STATE_WIDTH)]
            for s in range(S):
                v = words[:, s]
                cols[0] = cols[0] + 1
                for j, (mul, mod) in enumerate(HASHES, start=1):
                    cols[j] = mx.remainder(cols[j] * mul + v, mod)
            cache[state_i] = mx.stack(cols, axis=1).astype(mx.float32)
            if self.coverages is not None:
                self.coverages.append(cache.trimmable_rows())
        cache.advance(S)
        return x


class MixerFailure(RuntimeError):
    """The harness's failing call of the layer (:attr:`FakeMixer.fail_after`)."""


class FakeBlock(nn.Module):
    def __init__(self, kernel: int, size: int):
        super().__init__()
        self.mixer = FakeMixer(kernel, size)


class FakeModel(nn.Module):
    """One layer of a hybrid model: ``layers[0].mixer`` is the recurrent
    mixer (what the step recorder wraps)."""

    def __init__(self, kernel: int, size: int):
        super().__init__()
        self.layers = [FakeBlock(kernel, size)]

    def __call__(self, x: mx.array, mask: mx.array | None, cache: Any) -> mx.array:
        return self.layers[0].mixer(x, mask, cache)


class RecurrentRows:
    """The rows and states of token identities for one configuration:
    ``batch``, ``channels`` (C) and the conv rows' ``dtype``."""

    def __init__(self, batch: int, channels: int, dtype: str):
        self.batch, self.channels, self.dtype = batch, channels, dtype
        self._rows: dict[int, np.ndarray] = {}
        self._values: dict[int, tuple[int, ...]] = {}
        #: row bytes (all batch elements) -> token
        self._lookup: dict[bytes, int] = {}
        #: (batch element, t, h1, h2) -> the sequence it summarises
        self._known: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._fingerprints: dict[tuple[int, ...], tuple[tuple[int, ...], ...]] = {(): ((0,) * STATE_WIDTH,) * batch}

    def host_rows(self, tokens: list[int]) -> np.ndarray:
        """``(B, n, C)`` host form (float16, or float32 holding bfloat16 or
        float32 values)."""
        missing = [t for t in tokens if t not in self._rows]
        if missing:
            got = rowgen.rows(missing, "k", self.batch, 1, self.channels, self.dtype, False, "portable")
            for j, t in enumerate(missing):
                row = np.ascontiguousarray(got[:, 0, j, :])
                self._rows[t] = row
                self._lookup[row.tobytes()] = t
                self._values[t] = tuple(int(w) for w in self._words(row).sum(axis=-1))
        if not tokens:
            return np.zeros((self.batch, 0, self.channels), dtype=self._host_dtype())
        return np.stack([self._rows[t] for t in tokens], axis=1)

    def _host_dtype(self) -> Any:
        return np.float16 if self.dtype == "float16" else np.float32

    def _words(self, row: np.ndarray) -> np.ndarray:
        """A row's 16-bit words, as MLX's ``view(uint16)`` of the dtype gives them."""
        if self.dtype == "bfloat16":
            return (row.astype(np.float32).view(np.uint32) >> 16).astype(np.int64)
        if self.dtype == "float16":
            return row.astype(np.float16).view(np.uint16).astype(np.int64)
        return row.astype(np.float32).view(np.uint16).astype(np.int64)

    def input(self, tokens: list[int]) -> mx.array:
        return rowgen.to_mx(self.host_rows(tokens), self.dtype)

    def fingerprint(self, toks: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """Per batch element ``(t, h1, h2)`` after ``toks``; every prefix
        is remembered for :meth:`name_state`."""
        got = self._fingerprints.get(toks)
        if got is not None:
            return got
        prev = self.fingerprint(toks[:-1])
        self.host_rows([toks[-1]])
        v = self._values[toks[-1]]
        out = []
        for b, fp in enumerate(prev):
            hs = [(h * mul + v[b]) % mod for h, (mul, mod) in zip(fp[1:], HASHES)]
            new = (fp[0] + 1, *hs)
            out.append(new)
            self._known.setdefault((b, *new), toks)
        self._fingerprints[toks] = got = tuple(out)
        return got

    def expected_conv(self, conv: tuple[int | None, ...]) -> np.ndarray:
        """``(B, kernel - 1, C)`` host form of a conv window by token (None: zero)."""
        toks = [t for t in conv if t is not None]
        rows = self.host_rows(toks)
        zeros = np.zeros((self.batch, len(conv) - len(toks), self.channels), dtype=rows.dtype)
        return np.concatenate([zeros, rows], axis=1)

    def expected_state(self, toks: tuple[int, ...]) -> np.ndarray:
        return np.array(self.fingerprint(toks), dtype=np.float32).reshape(self.batch, STATE_WIDTH)

    def name_conv(self, host: np.ndarray) -> list[Any]:
        """Each row of a conv window by the token whose bytes it holds:
        an int, ``zero`` for a row nobody wrote, ``?`` for none."""
        out: list[Any] = []
        for j in range(host.shape[1]):
            row = np.ascontiguousarray(host[:, j, :]).astype(self._host_dtype())
            tok = self._lookup.get(row.tobytes())
            out.append(tok if tok is not None else "zero" if not row.any() else "?")
        return out

    def name_state(self, host: np.ndarray) -> str:
        """The sequence a state summarises, per batch element when they
        differ: ``after [0, 1, 2]``, or ``after no sequence seen (count t)``."""
        names = []
        for b in range(host.shape[0]):
            key = tuple(int(x) for x in host[b])
            toks = self._known.get((b, *key)) if key != (0,) * STATE_WIDTH else ()
            names.append(f"after {list(toks)}" if toks is not None else f"after no sequence seen (count {key[0]})")
        if len(set(names)) == 1:
            return f"the state {names[0]}"
        return "the states " + "; ".join(f"batch {b}: {n}" for b, n in enumerate(names))


class _Probe:
    """An implementation read that raised (reported as such, not a crash of the harness)."""

    def __init__(self, error: BaseException):
        self.error = error

    def describe(self) -> str:
        return f"reading it raised {error_text(self.error)}"


def arrays_mismatch(rows: RecurrentRows, kernel: int, size: int, want: sr.RecurrentCache, got: Any,
                    host: Any = rowgen.host) -> tuple[str, Any, Any] | None:
    """How a layer's arrays ``got`` (its ``cache`` list, or a read that
    raised) differ from what the spec layer ``want`` shows: None when they
    agree, else ``(what, spec side, impl side)``, conv rows and states
    named by token identity. The conv window must be the trace's dtype,
    ``(B, kernel - 1, C)``; the state float32 ``(B, 3)``; both None only
    before the first call."""
    if isinstance(got, _Probe):
        return "cannot be read", f"offset {want.offset}", got.describe()
    arrays = list(got)
    if len(arrays) != size:
        return "array count differs", f"{size} arrays", f"{len(arrays)} arrays"
    conv_want = sr.conv_window(want)
    conv_names = [t if t is not None else "zero" for t in conv_want]
    conv = arrays[sr.CONV]
    shape = (rows.batch, kernel - 1, rows.channels)
    if not (want.offset == 0 and conv is None):  # nothing consumed, nothing written: None
        if conv is None or rowgen.dtype_name(conv) != rows.dtype or tuple(conv.shape) != shape:
            return ("conv window differs", f"{rows.dtype} {shape}: {conv_names}",
                    "None" if conv is None else f"{rowgen.dtype_name(conv)} {tuple(conv.shape)}")
        seen = host(conv)
        if seen.tobytes() != rows.expected_conv(conv_want).tobytes():
            return "conv window differs", conv_names, rows.name_conv(seen)
    if size == 1:
        return None
    state, toks = arrays[sr.STATE], sr.state_of(want)
    if want.offset == 0 and state is None:
        return None
    shape = (rows.batch, STATE_WIDTH)
    if state is None or rowgen.dtype_name(state) != "float32" or tuple(state.shape) != shape:
        return ("recurrent state differs", f"float32 {shape}: the state after {list(toks)}",
                "None" if state is None else f"{rowgen.dtype_name(state)} {tuple(state.shape)}")
    seen = host(state)
    if seen.tobytes() != rows.expected_state(toks).tobytes():
        return "recurrent state differs", f"the state after {list(toks)}", rows.name_state(seen)
    return None


class RecurrentLockstep(Lockstep):
    """Drives a spec ``RecurrentWorld`` and an impl ``RecurrentCache``
    (``factory``: the cache class, or a dict with ``"cache"`` and
    ``"record_steps"``: what an injected bug replaces), the layer's
    calls made by :class:`FakeModel` through the step recorder."""

    spec_module = sr
    #: impl words a refused rollback its own way (naming the coverage and the
    #: fix): its type is compared, and its words must name the coverage
    #: (:meth:`compare_refusal`)
    OWN_WORDED_OPS = Lockstep.OWN_WORDED_OPS | {"trim"}

    def compare_refusal(self, index: int, op: dict[str, Any], spec_out: Any, impl_out: Any) -> None:
        """The common rule, and a rollback refused beyond the coverage must
        say so: the implementation's message names ``coverage`` and the
        coverage's value (``c tokens``)."""
        super().compare_refusal(index, op, spec_out, impl_out)
        if (op["op"] == "trim" and self.compare_messages and isinstance(spec_out.error, StateError)
                and impl_out.error is not None):
            c = sr.trimmable_rows(self.world.cache)
            said = str(impl_out.error)
            if "coverage" not in said or f"{c} tokens" not in said:
                raise Divergence(index, op, "refused rollback does not name the coverage",
                                 f"a StateError naming the coverage of {c} tokens", impl_out.describe())
    #: the layer replaces its arrays on every call: no in-place write to observe
    check_inplace = False
    check_sharing = False

    @classmethod
    def check_cache(cls, cache: dict[str, Any]) -> None:
        for name, low in (("kernel", 2), ("depth", 0), ("channels", 1)):
            v = cache.get(name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise TraceFormatError(f"field cache.{name}: must be an integer >= {low}, got {v!r}")
        if cache.get("size") not in (1, 2):
            raise TraceFormatError(f"field cache.size: must be 1 (conv window only) or 2 (conv window and "
                                   f"recurrent state), got {cache.get('size')!r}")
        if cache.get("rows", "portable") != "portable":
            raise TraceFormatError(f"field cache.rows: a recurrent layer's rows are the portable rows (no row is "
                                   f"all zero, so a zero row is one nobody wrote), got {cache['rows']!r}")

    def __init__(self, cache: dict[str, Any], factory: Any = None):
        super().__init__(cache)
        rec = _impl()
        if isinstance(factory, dict):
            cache_cls, recorder = factory.get("cache", rec.RecurrentCache), factory.get("record_steps", rec.record_steps)
        else:
            cache_cls, recorder = factory or rec.RecurrentCache, rec.record_steps
        self.size, self.kernel, self.depth = cache["size"], cache["kernel"], cache["depth"]
        self.rows = RecurrentRows(cache["batch"], cache["channels"], self.dtype)
        self.world = sr.RecurrentWorld(sr.empty(self.size, self.kernel, self.depth))
        self.prev_world = self.world
        self.reached(f"depth={self.depth}")
        self.cache_cls = cache_cls
        self.cache = self.fresh_cache()
        self.model = FakeModel(self.kernel, self.size)
        wrapped = recorder(self.model)
        if wrapped != 1:
            from kvspec.fuzz.failures import HarnessFailure

            raise HarnessFailure(f"record_steps wrapped {wrapped} mixers of the harness's one-layer model")
        #: the same layer, never wrapped: the model's writes outside the recorder
        self.unrecorded = FakeMixer(self.kernel, self.size)

    def fresh_cache(self) -> Any:
        return self.cache_cls(size=self.size, depth=self.depth)

    # -- implementation side ------------------------------------------------------
    def _call(self, mixer: Any, n: int) -> Any:
        """The model's call of the layer with the next ``n`` tokens. How it
        calls varies with the first token's identity ``start`` (so a trace
        replays the same calls), as models vary:

        * through the recorder (``append``): positional ``(x, mask,
          cache)`` or by keyword (``start % 3 == 1``: nemotron_h,
          recurrent_gemma); at ``size`` 2 and odd ``start`` followed by
          qwen3_next's write of index 0 after its last layer
          (``cache[0] = mx.depends(cache[0], ...)``: the live value only,
          never an unrecorded step); at ``depth > 0``, ``n >= 2`` and
          ``start % 4 == 2`` first a failing call (the layer raises after
          writing the conv window of its last sub-call), which must leave
          the cache as it was;
        * outside it (``append_unrecorded``): the unwrapped layer writing
          ``cache[0]``/``cache[1]`` or by negative index (``cache[-1]`` the
          state: ``start % 3 == 1``), or (``start % 3 == 2``) the wrapped
          layer with an argument the recorder cannot slice, which it must
          run unsplit as an unrecorded step.

        The layer's output (its input, masked) is kept for
        :meth:`compare_result`."""
        start = self.world.next_token
        x = self.rows.input(list(range(start, start + n)))
        mask = mx.ones(x.shape[:2], dtype=mx.bool_) if self.cfg["batch"] > 1 else None
        c, wrapped = self.cache, self.model.layers[0].mixer
        self._failed_call = None
        if mixer is self.unrecorded:
            if start % 3 == 2:
                out = wrapped(x, mask, c, extra=mx.zeros((1,), dtype=mx.float32))
            else:
                mixer.negative = start % 3 == 1
                mixer.coverages = []
                try:
                    out = mixer(x, mask, c)
                finally:
                    got, mixer.coverages = mixer.coverages, None
                # before the advance: the write of the last array alone is an unrecorded
                # step (coverage 0); a write of another index (size 2: the conv window)
                # replaces the live value only
                want = [got[0], got[0], 0] if self.size == 2 else [got[0], 0]
                if got != want:
                    self._failed_call = (f"coverage before the call and after each array write "
                                         f"({'cache[-2], cache[-1]' if mixer.negative else 'cache[0], cache[1]'}"
                                         f" at size 2; the last index alone at size 1): {got}, expected {want}")
        else:
            if self.depth > 0 and n >= 2 and start % 4 == 2:
                self._failed_call = self._failing_call(wrapped, x, mask)
            out = wrapped(x, mask=mask, cache=c) if start % 3 == 1 and mask is not None \
                else wrapped(x, cache=c) if start % 3 == 1 else wrapped(x, mask, c)
            if self.size == 2 and start % 2 == 1 and c[0] is not None:
                c[0] = mx.depends(c[0], c[1])  # qwen3_next, after its last layer
        self._output = (out, x)
        self.returned = tuple(c.cache)
        return self.returned

    def _failing_call(self, wrapped: Any, x: mx.array, mask: Any) -> str | None:
        """Call the recorded layer so that it raises in its last sub-call
        (after writing the conv window); None when the cache is as it was,
        else what changed."""
        c = self.cache
        before = ([id(a) for a in c.cache], c.offset, c.trimmable_rows())
        wrapped.fail_after = x.shape[1]
        try:
            wrapped(x, mask, c)
        except MixerFailure:
            pass
        else:
            return "the layer's failing call did not raise"
        finally:
            wrapped.fail_after = None
        after = ([id(a) for a in c.cache], c.offset, c.trimmable_rows())
        if after == before:
            return None
        what = ("arrays replaced" if after[0] != before[0] else
                f"offset {before[1]} -> {after[1]}" if after[1] != before[1] else
                f"coverage {before[2]} -> {after[2]}")
        return f"a call that raised changed the cache ({what})"

    _failed_call: str | None = None
    _output: Any = None

    def expected_nbytes(self) -> int:
        """Bytes of the live arrays the spec layer implies: none before the
        first token, else the conv window ``(B, kernel - 1, C)`` in the
        trace's dtype and (size 2) the float32 state ``(B, 3)``."""
        if self.world.cache.offset == 0:
            return 0
        item = 4 if self.dtype == "float32" else 2
        B = self.cfg["batch"]
        return B * (self.kernel - 1) * self.rows.channels * item + (B * STATE_WIDTH * 4 if self.size == 2 else 0)

    def impl_apply(self, op: dict[str, Any]) -> Any:
        name, c = op["op"], self.cache
        if name == "append":
            return self._call(self.model.layers[0].mixer, op["n"])
        if name == "append_unrecorded":
            return self._call(self.unrecorded, op["n"])
        if name == "fetch":
            return tuple(c.cache)
        if name == "can_trim":
            return c.is_trimmable()
        if name == "snapshot":
            self.fresh_name("snapshot", op["name"])
            self.holders[op["name"]] = c.snapshot()
            return None
        if name == "restore":
            held = self.holders.get(op["name"])
            if held is not None and is_cache_copy(held) or isinstance(held, self.cache_cls):
                c.restore(held.snapshot())
                return None
            snap = self.holder("restore", op["name"])
            if isinstance(snap, StateHolder):
                raise StateError(f"restore: {op['name']!r} is a state snapshot, not a snapshot")
            c.restore(snap)
            return None
        if name == "state_snapshot":
            self.fresh_name("state_snapshot", op["name"])
            self.holders[op["name"]] = take_state(c, self.fresh_cache)
            return None
        if name == "state_restore":
            held = self.holders.get(op["name"])
            if held is not None and not isinstance(held, StateHolder):
                raise StateError(f"state_restore: {op['name']!r} is a snapshot, not a state snapshot")
            saved = self.holder("state_restore", op["name"])
            spec_held = self.world.holders.get(op["name"])
            if spec_held is not None and spec_held.cache.offset == self.world.cache.offset:
                # at the held offset a program restores with ``c.state = saved`` alone, as it
                # restores mlx-lm's ArraysCache (no meta_state): the assignment itself clears
                self.reached("state restores by the state alone")
                c.state = saved.state
            else:
                saved.load_into(c)
            return None
        if name in ("trim", "copy", "reload", "drop", "hold", "release_hold"):
            return self.impl_common(op)
        raise sr.unsupported(name)

    # -- reading ----------------------------------------------------------------
    def _layer_of(self, held: Any) -> Any:
        """A cache holding what ``held`` (a live cache, a copy, a snapshot or
        a state snapshot) holds: a copy as it is, the others loaded into a
        fresh cache (reading, never writing, the holder)."""
        if isinstance(held, self.cache_cls) or is_cache_copy(held) or hasattr(held, "cache") and hasattr(held, "trim"):
            return held
        fresh = self.fresh_cache()
        if isinstance(held, StateHolder):
            held.load_into(fresh)
        else:
            fresh.restore(held)
        return fresh

    def _history(self, held: Any, coverage: int) -> list[Any]:
        """The arrays of ``held`` after a rollback of each ``n`` in
        ``0..coverage`` (``coverage``: the spec's), each rollback on a copy;
        a read that raises is a :class:`_Probe`."""
        try:
            layer = self._layer_of(held)
        except Exception as exc:  # noqa: BLE001 - reported by the comparison
            return [_Probe(exc)]
        out: list[Any] = [tuple(layer.cache)]
        for n in range(1, coverage + 1):
            try:
                dup = copy.copy(layer)
                dup.trim(n)
                out.append(tuple(dup.cache))
            except Exception as exc:  # noqa: BLE001 - reported by the comparison
                out.append(_Probe(exc))
        return out

    def spec_apply(self, op: dict[str, Any]) -> tuple[Any, Any]:
        """The spec's op; its world is kept until the step ends, so that the
        implementation's reads after the op (prefetched before the step
        compares) probe the rollbacks the new world covers."""
        self._pending = None
        result, world = super().spec_apply(op)
        self._pending = world
        return result, world

    _pending: Any = None

    def impl_views(self) -> dict[str, Any]:
        w = self._pending if self._pending is not None else self.world
        views: dict[str, Any] = {"cache": self._history(self.cache, sr.trimmable_rows(w.cache))}
        for name, held in self.holders.items():
            spec_holder = w.holders.get(name)
            cov = sr.trimmable_rows(spec_holder.cache) if spec_holder is not None and spec_holder.kind == "snapshot" \
                else 0
            views["holder:" + name] = self._history(held, cov)
        if self.held is not None:
            views["held"] = [self.held]
        return views

    def spec_views(self) -> dict[str, Any]:
        """Name -> the consumed token identities of the live layer, every
        holder and the held arrays (what ``kvspec render`` draws)."""
        return {name: tuple(h[0].toks) for name, h in self.spec_histories().items()}

    def spec_histories(self) -> dict[str, Any]:
        """Name -> the spec layers whose conv window and state the
        implementation must show, after a rollback of 0, 1, ... coverage."""
        w = self.world

        def history(c: sr.RecurrentCache, kind: str = "snapshot") -> list[sr.RecurrentCache]:
            cov = sr.trimmable_rows(c) if kind == "snapshot" else 0
            return [sr.trim(c, n)[1] for n in range(cov + 1)]

        views: dict[str, Any] = {"cache": history(w.cache)}
        for name, holder in w.holders.items():
            views["holder:" + name] = history(holder.cache, holder.kind)
        if w.held is not None:
            views["held"] = [self._held_cache()]
        return views

    def _held_cache(self) -> sr.RecurrentCache:
        conv, state = self.world.held  # type: ignore[misc]
        toks = state if state is not None else tuple(t for t in conv if t is not None)
        return sr.RecurrentCache(self.size, self.kernel, self.depth, tuple(toks))

    def view_label(self, name: str, n: int = 0) -> str:
        if name == "cache":
            base = "live layer"
        elif name == "held":
            base = "held arrays (the last append's)"
        else:
            held = self.holders.get(name.removeprefix("holder:"))
            what = "state snapshot" if isinstance(held, StateHolder) else "copy" if is_cache_copy(held) else "snapshot"
            base = f"{what} {name.removeprefix('holder:')!r}"
        return base + (f" after a rollback of {n}" if n else "")

    def _compare_arrays(self, index: int, op: dict[str, Any], label: str, want: sr.RecurrentCache, got: Any,
                        isolation: bool) -> None:
        bad = arrays_mismatch(self.rows, self.kernel, self.size, want, got, self.host)
        if bad is not None:
            what, spec_side, impl_side = bad
            raise Divergence(index, op, f"{label}: {what}" + (" (isolation)" if isolation else ""), spec_side,
                             impl_side)

    def compare_result(self, index: int, op: dict[str, Any], s: Any, i: Any) -> None:
        before = self.prev_world.cache
        if op["op"] == "append" and self._failed_call is not None:
            raise Divergence(index, op, "a failing call changed the cache", "the cache as it was before the call",
                             self._failed_call)
        if op["op"] == "append_unrecorded" and self._failed_call is not None:
            raise Divergence(index, op, "an unrecorded write kept or cleared the wrong coverage",
                             "coverage 0 from the write of the last array on", self._failed_call)
        if op["op"] in ("append", "append_unrecorded") and self._output is not None:
            out, x = self._output
            self._output = None
            if not (isinstance(out, mx.array) and out.shape == x.shape and out.dtype == x.dtype
                    and self.host(out).tobytes() == self.host(x).tobytes()):
                got = f"{type(out).__name__} {getattr(out, 'dtype', '')} {tuple(getattr(out, 'shape', ()))}"
                raise Divergence(index, op, "the layer's output differs (the recorder joins its sub-calls' outputs)",
                                 f"the layer's output for the {op['n']} tokens, {tuple(x.shape)}", got)
        if op["op"] in ("append", "append_unrecorded", "fetch"):
            self._compare_arrays(index, op, f"{op['op']} returned", self.world.cache, i, False)
            if op["op"] == "append_unrecorded":
                self.reached("unrecorded steps")
            return
        super().compare_result(index, op, s, i)
        if op["op"] == "trim" and isinstance(s, int) and s > 0:
            self.reached("rollbacks")
            if s == sr.trimmable_rows(before):
                self.reached("rollbacks of exactly the coverage")
            if self._last_call_len(before) >= 2 and s >= 1:
                self.reached("rollbacks after a multi-token call")
        if op["op"] == "restore" and sr.trimmable_rows(before) > 0:
            self.reached("restores over a non-empty checkpoint ring")

    def _last_call_len(self, before: sr.RecurrentCache) -> int:
        return getattr(self, "_call_len", 0)

    def _run_step(self, index: int, op: dict[str, Any]) -> None:
        self._pending = None
        try:
            super()._run_step(index, op)
        finally:
            self._pending = None
        if op["op"] in ("append", "append_unrecorded") and not self.refused:
            self._call_len = op["n"]
        elif op["op"] not in ("trim", "fetch", "can_trim", "hold", "release_hold", "expect", "snapshot", "drop",
                              "state_snapshot"):
            self._call_len = 0
        if op["op"] == "trim" and self.refused:
            self.reached("rollbacks beyond the coverage (refused)")

    def compare_state(self, index: int, op: dict[str, Any]) -> None:
        s_obs, i_obs = self.spec_observables(), self.impl_observables()
        from kvspec.fuzz.lockstep import of_kind, same_value

        for key in s_obs:
            if not same_value(s_obs[key], i_obs.get(key)):
                raise Divergence(index, op, f"{key} differs", f"{key}={s_obs[key]}",
                                 f"{key}={of_kind(s_obs[key], i_obs.get(key))}")
        if isinstance(getattr(type(self.cache), "nbytes", None), property):
            want, got = self.expected_nbytes(), self.cache.nbytes
            if got != want:
                raise Divergence(index, op, "nbytes differs", f"nbytes={want} (the live arrays)", f"nbytes={got}")
        if self.cfg["batch"] > 1 and op["op"] in self.BATCH_CHECKED_OPS and callable(getattr(self.cache, "extract", None)):
            self._check_batch_protocol(index, op)
        s_views, i_views = self.spec_histories(), self.step_views()
        if set(s_views) != set(i_views):
            raise Divergence(index, op, "holders differ", sorted(s_views), sorted(i_views))
        for name, wants in s_views.items():
            gots = i_views[name]
            for n, want in enumerate(wants):
                got = gots[n] if n < len(gots) else _Probe(IndexError("no such rollback"))
                self._compare_arrays(index, op, self.view_label(name, n), want, got, name != "cache")

    # -- the conformance report's "what else differs" (kvspec.fuzz.commands.conformance.differences_after) --
    def window_matches(self, wants: Any, gots: Any, *_: Any) -> bool:
        """Whether a view shows what the spec says: ``wants`` a history of
        :meth:`spec_histories` (the spec layers after a rollback of 0, 1,
        ... coverage tokens), ``gots`` the implementation's
        (:meth:`impl_views`), compared as :meth:`compare_state` compares."""
        try:
            for n, want in enumerate(wants):
                got = gots[n] if n < len(gots) else _Probe(IndexError("no such rollback"))
                self._compare_arrays(-1, {"op": "fetch"}, "view", want, got, False)
        except Divergence:
            return False
        return True

    def identify(self, views: Any, mode: str | None = None) -> list[Any]:
        """An implementation view named in the spec's terms: its conv
        window's rows by token and the sequence its state summarises."""
        first = views[0] if views else None
        if first is None or hasattr(first, "describe"):
            return [first.describe() if first is not None else "nothing"]
        conv = first[0]
        out: list[Any] = [f"conv {self.rows.name_conv(self.host(conv))}" if conv is not None else "conv None"]
        if len(first) > 1 and first[1] is not None:
            out.append(self.rows.name_state(self.host(first[1])))
        return out

    @staticmethod
    def spec_label(wants: Any) -> str:
        """A spec history as the report words it: the tokens consumed and
        how many the checkpoints take back."""
        return f"after {list(wants[0].toks)}, coverage {len(wants) - 1}" if wants else "nothing"

    #: ops after which (at batch > 1) the batch protocol is checked
    BATCH_CHECKED_OPS = frozenset({"append", "append_unrecorded", "trim", "restore", "state_restore", "reload"})

    def _check_batch_protocol(self, index: int, op: dict[str, Any]) -> None:
        """mlx-lm's batch protocol on the live layer (BatchGenerator): for
        each batch element ``b``, ``extract(b)`` and ``filter([b])`` on a
        copy hold that element's arrays ``[b:b+1]``, the layer's offset and
        depth, and no checkpoints (coverage 0: semantics.md 9)."""
        c = self.cache
        live = [None if a is None else self.host(a) for a in c.cache]
        for b in range(self.cfg["batch"]):
            got: dict[str, Any] = {}
            try:
                got["extract"] = c.extract(b)
                dup = copy.copy(c)
                dup.filter(mx.array([b]))
                got["filter"] = dup
            except Exception as exc:  # noqa: BLE001 - reported as the divergence
                raise Divergence(index, op, f"batch element {b}: extract/filter raised", "a cache of one element",
                                 error_text(exc)) from None
            for how, one in got.items():
                arrays = [None if a is None else rowgen.host(a) for a in one.cache]
                same = len(arrays) == len(live) and all(
                    (g is None and w is None) or (g is not None and w is not None and g.shape == w[b:b + 1].shape
                                                  and g.tobytes() == w[b:b + 1].tobytes())
                    for g, w in zip(arrays, live))
                counters = (one.offset, one.depth, one.trimmable_rows())
                want = (self.world.cache.offset, self.depth, 0)
                if not same or counters != want:
                    shapes = [None if a is None else tuple(a.shape) for a in arrays]
                    raise Divergence(index, op, f"batch element {b}: {how} differs",
                                     f"its arrays [{b}:{b + 1}], offset, depth, coverage {want}",
                                     f"arrays {shapes}, offset, depth, coverage {counters}")

    def spec_observables(self) -> dict[str, Any]:
        c = self.world.cache
        return {"offset": c.offset, "depth": c.depth, "trimmable_rows": sr.trimmable_rows(c),
                "trimmable": sr.is_trimmable(c)}

    def impl_observables(self) -> dict[str, Any]:
        c = self.cache
        return {"offset": c.offset, "depth": c.depth, "trimmable_rows": c.trimmable_rows(),
                "trimmable": c.is_trimmable()}

    # -- trace checks -------------------------------------------------------------
    def check_op_checks(self, index: int, op: dict[str, Any], spec_out: Any) -> None:
        if "capacity" in op or "inplace" in op:
            field = "capacity" if "capacity" in op else "inplace"
            raise TraceFormatError(f"op {index} field {field!r}: a recurrent layer has no {field} "
                                   "(it replaces its arrays on every call)")
        if "returns" in op and spec_out.error is None:
            got = spec_out.result
            if op["op"] in ("append", "append_unrecorded", "fetch"):
                got = list(got[1] if got[1] is not None else got[0])
            if got != op["returns"]:
                raise Divergence(index, op, "trace's 'returns' check fails", got, op["returns"],
                                 ("spec says", "trace expects"))

    def check_expect(self, index: int, op: dict[str, Any]) -> None:
        """``expect``: ``window`` is the consumed sequence of the live layer
        (or of the holder ``of``), whose conv window and state must show."""
        name = op.get("of")
        w = self.world
        if name is None:
            have = w.cache
        elif name in w.holders:
            have = w.holders[name].cache
        else:
            names = sorted(w.holders)
            raise TraceFormatError(f"op {index} field 'of': no snapshot or handle named {name!r} at this op "
                                   f"(live: {', '.join(names) or 'none'})")
        want = list(op["window"])
        if list(have.toks) != want:
            raise Divergence(index, op, "trace's 'expect' fails on the spec", list(have.toks), want,
                             ("spec says", "trace expects"))
        held = self.cache if name is None else self.holders[name]
        self._memo.clear()
        got = self._history(held, 0)[0]
        try:
            self._compare_arrays(index, op, "expect", have, got, False)
        except Divergence as d:
            raise Divergence(index, op, "trace's 'expect' fails on the implementation: " + d.what,
                             d.spec, d.impl) from None

    def predictions(self, op: dict[str, Any], result: Any) -> dict[str, Any]:
        if op["op"] in ("trim", "can_trim"):
            return {"returns": result}
        return {}

    def expect_ops(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"op": "expect", "window": list(self.world.cache.toks)}]
        for name, holder in self.world.holders.items():
            out.append({"op": "expect", "window": list(holder.cache.toks), "of": name})
        return out


#: the depths a machine draws (sampled: each is a must_reach edge)
DEPTHS = (0, 1, 2, 3, 4)


class RecurrentMachine(StateProtocolMachine):
    """A recurrent layer's life: calls of 1 to 6 tokens through the step
    recorder and outside it, kernel 2 to 4, depth 0 to 4, size 1 or 2,
    batch 1 or 2, float16, bfloat16 or float32 rows; rollbacks within and
    beyond the coverage (refused, nothing changed), the speculative pattern
    (a verify block of up to U + 1 tokens, then a rollback of part or all
    of it), snapshots, state snapshots, copies and reloads."""

    kind = "recurrent"
    named_ops = ("snapshot", "restore", "drop", "state_restore")

    @initialize(data=st.data())
    def init(self, data: st.DataObject) -> None:
        cfg = {
            "size": data.draw(st.sampled_from([2, 2, 1]), label="size"),
            "kernel": data.draw(st.integers(2, 4), label="kernel"),
            "depth": data.draw(st.sampled_from(DEPTHS), label="depth"),
            "channels": data.draw(st.sampled_from([2, 4, 3]), label="channels"),
            "batch": data.draw(st.sampled_from([1, 1, 2]), label="batch"),
            "dtype": data.draw(st.sampled_from(["float16", "bfloat16", "float32"]), label="dtype"),
        }
        self.setup(**cfg)

    @property
    def _cov(self) -> int:
        return sr.trimmable_rows(self.lock.world.cache)

    @rule(n=st.integers(1, 6))
    def append(self, n: int) -> None:
        self.do({"op": "append", "n": n})

    @rule(n=st.integers(1, 3))
    def append_unrecorded(self, n: int) -> None:
        """The model writes the layer's arrays outside the recorder: the
        coverage drops to 0 (a rollback after it is refused)."""
        self.do({"op": "append_unrecorded", "n": n})

    @rule(data=st.data())
    def speculate(self, data: st.DataObject) -> None:
        """A verify block of 2 to U + 1 tokens, then a rollback of part or
        all of its draft tokens (mlx-lm rejects up to the drafts)."""
        depth = self.lock.world.cache.depth
        n = data.draw(st.integers(2, max(2, depth + 1)), label="block")
        self.do({"op": "append", "n": n})
        reject = data.draw(st.sampled_from(sorted({min(n, depth), max(1, min(n, depth) - 1), 1})), label="reject")
        self.do({"op": "trim", "n": reject})

    @rule(data=st.data())
    def draft_steps(self, data: st.DataObject) -> None:
        """1 to U + 1 single-token calls, then take them back."""
        depth = self.lock.world.cache.depth
        n = data.draw(st.integers(1, depth + 1), label="steps")
        for _ in range(n):
            self.do({"op": "append", "n": 1})
        self.do({"op": "trim", "n": n})

    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        """A rollback at the coverage, one less, one or two more (refused)."""
        c = self._cov
        n = data.draw(st.sampled_from(sorted({c, max(c - 1, 1), c + 1, c + 2})), label="n")
        self.do({"op": "trim", "n": n})

    @rule()
    def can_trim(self) -> None:
        self.do({"op": "can_trim"})

    @rule(target=KVMachine.snapshots, deep=st.booleans(), live=st.sampled_from(["copy", "copy", "original"]))
    def copy_cache(self, deep: bool, live: str) -> str:
        name = self.fresh_name("c")
        self.do({"op": "copy", "name": name, "deep": deep, "live": live})
        return name

    @rule(via=st.sampled_from(["file", "state"]))
    def reload(self, via: str) -> None:
        """Saved and loaded back (a prompt-cache file, or mlx-lm's load
        order): arrays and offset kept, coverage 0."""
        self.do({"op": "reload", "via": via})

    @precondition(lambda self: self.lock is not None and self.lock.world.cache.depth > 0)
    @rule(data=st.data())
    def restore_over_ring(self, data: st.DataObject) -> None:
        """Snapshot, decode past it (a non-empty checkpoint ring), restore:
        the snapshot's coverage comes back, then roll back within it."""
        name = self.fresh_name("r")
        self.do({"op": "snapshot", "name": name})
        for _ in range(data.draw(st.integers(1, 3), label="decodes")):
            self.do({"op": "append", "n": 1})
        self.do({"op": "restore", "name": name})
        self.do({"op": "trim", "n": data.draw(st.integers(1, 2), label="rollback")})
        self.do({"op": "drop", "name": name})

    trim_to = None  # type: ignore[assignment]  # refused by contract: not generated
