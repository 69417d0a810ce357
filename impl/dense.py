"""Dense MLX KV cache, modes Fp16 and Int8 (spec: ``kvspec.spec.dense``).

Buffers are ``[B, H, capacity, D]`` along axis 2 (keys and values may have
different head dims ``Dk``/``Dv``); Int8 keeps float16 scale sidecars
``[B, H, capacity, 1]`` in lockstep. Fp16 stores rows in the floating dtype
they come in (float16, bfloat16 or float32) and Int8 dequantizes to it
(semantics.md 2 "Storage"; "fp16" names the unquantized mode). Readers slice ``[0, live_len)``
with ``live_len = offset - live_start``.

Writes go through :mod:`kvspec.impl.write`. They are copying writes (a static slice
update: MLX copies a buffer that anyone else still references and reuses it
otherwise) except Fp16 decode steps that the ownership rule
(``kvspec.spec.dense.inplace_write_allowed``) allows: those write the row straight
into the evaluated buffer (a NumPy view on the CPU, a device kernel on
CUDA). Trims are logical (O(1)).
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
import warnings
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.impl.masks import causal_mask
from kvspec.impl.quant import (
    FLOAT16_MAX,
    dequantize_int8,
    int8_representable,
    int8_rows_flag,
    int8_rows_refused,
    quantize_int8,
)
from kvspec.impl.write import (
    inplace_mechanism,
    seq_index,
    seq_prefix,
    write_copy,
    write_inplace,
    write_inplace_pair,
)
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError

_ALL = slice(None)

#: Largest growth granularity a cache accepts (rows): growth allocates
#: ``ceil(n / step) * step`` rows at once, so an unbounded step is an
#: allocation of any size. The spec states the same bound
#: (``kvspec.spec.dense.MAX_STEP``); impl keeps its own copy so that a change to
#: either side is seen by the differential check (tests/test_layout.py).
MAX_STEP = 2**20


def check_window_size(op: str, window_size: object) -> int | None:
    """A mask's ``window_size``: None (no window) or an int >= 1 (a window
    of 0 keys would hide the query itself). Raises InvalidArgumentError
    naming ``op`` and the value otherwise (0, negative, a float, a bool).
    Rule: kvspec.spec.dense.check_window_size (written here on its own)."""
    if window_size is None:
        return None
    if type(window_size) is bool or not isinstance(window_size, int):
        raise InvalidArgumentError(f"{op}: window_size must be None or an integer >= 1, got {window_size!r}")
    if window_size < 1:
        raise InvalidArgumentError(f"{op}: window_size must be >= 1, got {window_size}")
    return window_size

SEQ_AXIS = 2
_OFF_VALUES = ("0", "false", "off", "no")
_MODES = ("fp16", "int8")
#: The floating dtypes a cache stores and returns (semantics.md 2 "Storage").
FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def inplace_switch_from_env() -> bool:
    """``KV_INPLACE_WRITE``: on unless ``0``/``false``/``off``/``no``
    (kvspec.spec.dense.inplace_switch)."""
    value = os.environ.get("KV_INPLACE_WRITE")
    return value is None or value.strip().lower() not in _OFF_VALUES


def regrow_capacity(prev: int, n: int, step: int) -> int:
    """Capacity after a growth: ``prev + ceil(n / step) * step``
    (kvspec.spec.dense.regrow_capacity)."""
    return prev + -(-n // step) * step


def check_inplace(op: str, inplace: Any) -> bool:
    """The ``inplace`` argument of every cache: True, False or None (read
    ``KV_INPLACE_WRITE``, kvspec.spec.dense.inplace_switch). Anything else (a
    string such as ``"no"``, an int) is refused: truthiness would turn
    ``"no"`` into on."""
    if inplace is not None and not isinstance(inplace, bool):
        raise InvalidArgumentError(
            f"{op}: inplace must be True, False or None (read KV_INPLACE_WRITE), got {inplace!r}"
        )
    return inplace_switch_from_env() if inplace is None else inplace


def _check_int(op: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{op}: {name} must be an integer, got {value!r}")
    return int(value)


def write_rows_inplace(dst: mx.array, src: mx.array, at: int, mechanism: str | None = None) -> mx.array:
    """Write ``src`` (``[B, H, n, D]``) into rows ``[at, at + n)`` of
    ``dst``'s own memory (:func:`kvspec.impl.write.write_inplace`: a NumPy view on
    the CPU and Apple unified memory, a device kernel completed before return
    on CUDA): every array that shares that memory (a snapshot, a held window)
    sees the write. Callers must have proved that no one else can read those
    rows (the ownership rule, kvspec.spec.dense.inplace_write_allowed /
    kvspec.spec.rotating.rotating_inplace_allowed). Returns the array that now holds
    the rows (``dst`` itself except under CUDA's ``donate`` mechanism), which
    the caller keeps as its buffer. ``mechanism``: as for
    :func:`kvspec.impl.write.write_inplace`."""
    return write_inplace(dst, src, seq_index(at, src.shape[SEQ_AXIS], SEQ_AXIS), mechanism)


def write_rows_copy(dst: mx.array, src: mx.array, at: int) -> mx.array:
    """``dst`` with rows ``[at, at + n)`` replaced by ``src``, as a new array
    (:func:`kvspec.impl.write.write_copy`: a static slice update MLX donates when
    nothing else holds ``dst``; ``dst`` itself is unchanged)."""
    return write_copy(dst, src, seq_index(at, src.shape[SEQ_AXIS], SEQ_AXIS))


def data_pointer(a: mx.array) -> int:
    """Address of the first element of ``a``'s memory (evaluated first), read
    through an aliasing NumPy view: two arrays with the same pointer share
    memory. The memory-sharing observable of the cost contract."""
    mx.eval(a)
    if a.dtype == mx.bfloat16:
        a = mx.view(a, mx.uint16)
        mx.eval(a)
    return int(np.array(a, copy=False).__array_interface__["data"][0])


def _check_tensor(op: str, name: str, a: Any) -> None:
    """A stored tensor must be an ``mx.array`` of rank 4 ``[B, H, T, D]``."""
    if not isinstance(a, mx.array):
        raise InvalidArgumentError(f"{op}: {name} must be an mx.array, got {type(a).__name__}")
    if a.ndim != 4:
        raise InvalidArgumentError(f"{op}: {name} must have rank 4, got shape {tuple(a.shape)}")


def _check_list(op: str, name: str, value: Any) -> list[Any]:
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise InvalidArgumentError(f"{op}: {name} must be a list of integers, got {type(value).__name__}")
    return list(value)


_DIMS = ((0, "batch B"), (1, "kv heads H"), (3, "head dim D"))


def _check_rows(op: str, keys: Any, values: Any) -> int:
    """Validate a ``[B, H, S, Dk]`` / ``[B, H, S, Dv]`` K/V pair (head dims
    may differ; dtype float16, bfloat16 or float32, the same for both);
    returns S. Messages name the dimension that disagrees."""
    if type(keys) is mx.array and type(values) is mx.array:
        # the decode path's pair passes every rule below: accept it in one
        # pass (each .shape and .dtype read builds a new object)
        ks, vs = keys.shape, values.shape
        if (len(ks) == 4 and len(vs) == 4 and ks[0] == vs[0] and ks[1] == vs[1] and ks[2] == vs[2]
                and ks[2] >= 1):
            kd = keys.dtype
            if kd in FLOAT_DTYPES and kd == values.dtype:
                return ks[2]
    for name, a in (("keys", keys), ("values", values)):
        if not isinstance(a, mx.array):
            raise InvalidArgumentError(f"{op}: {name} must be an mx.array, got {type(a).__name__}")
        if a.ndim != 4:
            raise InvalidArgumentError(f"{op}: {name} must have rank 4 [B, H, S, D], got shape {tuple(a.shape)}")
        if a.dtype not in FLOAT_DTYPES:
            raise InvalidArgumentError(
                f"{op}: {name} dtype must be float16, bfloat16 or float32, got {a.dtype}"
            )
    if keys.dtype != values.dtype:
        raise InvalidArgumentError(f"{op}: keys and values must share a dtype, got {keys.dtype} and {values.dtype}")
    ks, vs = keys.shape, values.shape  # each .shape builds a new list: read once (the decode hot path)
    for axis, dim in ((0, "batch B"), (1, "kv heads H"), (2, "rows S")):
        if ks[axis] != vs[axis]:
            raise InvalidArgumentError(
                f"{op}: keys and values must agree on {dim}, got {ks[axis]} and {vs[axis]} "
                f"(shapes {tuple(ks)} and {tuple(vs)})"
            )
    if ks[2] < 1:
        raise InvalidArgumentError(f"{op}: n must be >= 1, got {ks[2]}")
    return int(ks[2])


def decode_pair_rows(keys: Any, values: Any, cached_keys: mx.array, cached_values: mx.array) -> int:
    """The rows ``S`` of a ``[B, H, S, Dk]`` / ``[B, H, S, Dv]`` pair that
    every append rule accepts against the cached buffers (:func:`_check_rows`,
    :func:`check_matches_cache`, :func:`check_dtype_matches` with the cached
    keys' dtype), in one pass over the shapes and dtypes (each ``.shape`` and
    ``.dtype`` read builds a new object: the decode path runs per layer per
    step); 0 when it does not or is not sure, and the caller then runs those
    checks, which name the rule broken."""
    if type(keys) is not mx.array or type(values) is not mx.array:
        return 0
    ks, vs, bk, bv = keys.shape, values.shape, cached_keys.shape, cached_values.shape
    if (len(ks) == 4 and len(vs) == 4 and ks[2] == vs[2] and ks[2] >= 1 and ks[0] == bk[0] == vs[0] == bv[0]
            and ks[1] == bk[1] == vs[1] == bv[1] and ks[3] == bk[3] and vs[3] == bv[3]):
        kd = keys.dtype
        if kd == values.dtype and kd == cached_keys.dtype:
            return ks[2]
    return 0


def check_matches_cache(op: str, name: str, have: tuple[int, ...], new: mx.array) -> None:
    """An appended ``[B, H, S, D]`` tensor must match the cached
    ``[B, H, _, D]`` ``have``; the message names the dimension (batch B,
    kv heads H or head dim D) that does not."""
    shape = new.shape
    for axis, dim in _DIMS:
        if have[axis] != shape[axis]:
            raise InvalidArgumentError(
                f"{op}: {name} {dim} must be {have[axis]} (the cache's), got {shape[axis]} "
                f"(shape {tuple(shape)})"
            )


def check_dtype_matches(op: str, have: mx.Dtype, new: mx.Dtype) -> None:
    """Rows appended to a cache that holds rows come in the cache's dtype
    (mixing would cast silently, semantics.md 2 "Storage")."""
    if have != new:
        raise InvalidArgumentError(f"{op}: dtype must be {have} (the cache's rows), got {new}")


def share(a: mx.array) -> mx.array:
    """A new handle to the same memory: a full slice. (In MLX 0.32 an
    evaluated ``mx.array(a)`` is a copy, while slices and ``copy.deepcopy``
    alias the buffer; a prompt-cache snapshot is an O(1) alias, so it is a
    holder that in-place writes could reach.)"""
    return a[:, :, :, :]


def copy_without_marker(cache: Any, memo: dict | None = None) -> Any:
    """``copy.copy`` (``memo`` None) or ``copy.deepcopy`` of a cache, minus
    its ownership marker. Either copy aliases the buffers' memory (a deep
    copy of an ``mx.array`` is a new handle to the same memory), so the copy
    is one more holder, not an owner: were the marker copied along, copy and
    original would both pass the ownership rule and write the same rows in
    place into each other's windows. Without it the copy's first write
    copies. (mlx-lm's ``LRUPromptCache`` deep-copies a cached prompt on every
    fetch.)"""
    new = type(cache).__new__(type(cache))
    fields = dict(cache.__dict__)
    new.__dict__.update(fields if memo is None else copy.deepcopy(fields, memo))
    new._marker = None
    return new

#: mlx-lm's writer of prompt-cache files, which cannot write kvspec caches
_FOREIGN_SAVE = ("mlx_lm.models.cache", "save_prompt_cache")


def refuse_foreign_save(cache: Any) -> None:
    """Called by every kvspec cache's ``state`` getter: when the caller is
    ``mlx_lm.models.cache.save_prompt_cache`` (it reads ``state`` first,
    before writing anything), raise UnsupportedOperationError saying to use
    ``kvspec.impl.models.save_prompt_cache``. mlx-lm's writer stores ``state`` and
    the class name only, without the counters of ``meta_state`` (offset,
    live_start, a ring's cursor, the Turbo counters), so its loader could
    not rebuild a kvspec cache from the file (docs/mlx-lm.md, "Prompt-cache
    files"). Looks at most five frames up; any other caller is unaffected."""
    frame = sys._getframe(2)
    for _ in range(5):
        if frame is None:
            return
        code = frame.f_code
        if code.co_name == _FOREIGN_SAVE[1] and frame.f_globals.get("__name__") == _FOREIGN_SAVE[0]:
            raise UnsupportedOperationError(
                f"mlx_lm.models.cache.save_prompt_cache cannot write a kvspec {type(cache).__name__}: it stores "
                "`state` without the counters of `meta_state`, so no loader could rebuild the cache from its file; "
                "save with kvspec.impl.models.save_prompt_cache(file, cache) and load with kvspec.impl.models.load_prompt_cache "
                "(nothing was written)"
            )
        frame = frame.f_back



#: the dtypes an Int8 cache dequantizes to, by their meta_state names
_DTYPE_NAMES = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}


@dataclass(slots=True)
class _Buffers:
    """The cache's tensors. Fp16: ``keys``/``values`` in the rows' dtype.
    Int8: int8 ``keys``/``values`` plus float16 ``key_scales``/
    ``value_scales``; ``out_dtype`` is the dtype the window is dequantized
    to (the dtype the rows came in; None in Fp16, where it is the buffers')."""

    keys: mx.array
    values: mx.array
    key_scales: mx.array | None = None
    value_scales: mx.array | None = None
    out_dtype: mx.Dtype | None = None

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype of the rows this cache was handed and returns (Int8
        rows loaded from ``state`` alone, which records none: float16; the
        fifth field of an Int8 ``meta_state`` names it)."""
        if self.out_dtype is not None:
            return self.out_dtype
        return self.keys.dtype if self.key_scales is None else mx.float16

    def arrays(self) -> tuple[mx.array, ...]:
        # no generator: the decode path calls this twice per layer per step
        if self.key_scales is None:
            return (self.keys, self.values)
        return (self.keys, self.values, self.key_scales, self.value_scales)  # type: ignore[return-value]

    def __deepcopy__(self, memo: dict) -> _Buffers:
        """A deep copy: each array deep-copied (a new handle to its memory),
        the dtype kept (an ``mx.Dtype`` cannot be copied: deep-copying an
        Int8 cache raised TypeError, found by the fuzzer's ``copy`` op)."""
        return _Buffers(*(None if a is None else copy.deepcopy(a, memo)
                          for a in (self.keys, self.values, self.key_scales, self.value_scales)),
                        out_dtype=self.out_dtype)

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[SEQ_AXIS])

    def map(self, fn) -> _Buffers:
        return _Buffers(
            fn(self.keys),
            fn(self.values),
            None if self.key_scales is None else fn(self.key_scales),
            None if self.value_scales is None else fn(self.value_scales),
            self.out_dtype,
        )

    def shared(self) -> _Buffers:
        """New handles to the same memory (an O(1) alias, no data copied)."""
        return self.map(share)

    def window(self, live_len: int) -> tuple[mx.array, mx.array]:
        """Attention-ready rows ``[0, live_len)`` in the rows' dtype."""
        ix = seq_prefix(live_len)
        k, v = self.keys[ix], self.values[ix]
        if self.key_scales is not None:
            k = dequantize_int8(k, self.key_scales[ix], self.dtype)
            v = dequantize_int8(v, self.value_scales[ix], self.dtype)  # type: ignore[index]
        return k, v


@dataclass(slots=True)
class _Marker:
    """Ownership marker: the very buffer objects the cache's last write
    produced (held by reference, so an identity can never be recycled) and
    the live_len after it."""

    arrays: tuple[mx.array, ...]
    live_len: int


class CacheSnapshot:
    """A prompt-cache snapshot: new handles to the cache's buffers (no data
    copied) and the window at that moment. Its view never changes."""

    def __init__(self, mode: str, buffers: _Buffers | None, offset: int, live_start: int):
        self.mode = mode
        self.buffers, self.offset, self.live_start = buffers, offset, live_start

    @property
    def live_len(self) -> int:
        """Rows the snapshot sees, ``offset - live_start``. Rule: ``kvspec.spec.dense.holder_of``
        (semantics.md 2, "snapshot")."""
        return self.offset - self.live_start

    def fetch(self) -> tuple[mx.array, mx.array] | None:
        """The snapshot's window ``[B, H, live_len, D]`` in the rows' dtype, or None.

        Rule: ``kvspec.spec.dense.view_of`` (a holder's view never changes: semantics.md 5, "rule 3")."""
        return None if self.buffers is None else self.buffers.window(self.live_len)


class DetachedHandle(CacheSnapshot):
    """Tensors moved out of a cache by :meth:`KVCache.detach`. ``install``
    consumes it (``consumed``); installing it again is refused."""

    consumed = False

    def trim_to(self, length: int) -> int:
        """Cut the handle's tensors physically so that ``offset == length``.
        Returns the rows removed. Raises InvalidArgumentError unless
        ``0 <= length <= offset``.

        Rule: ``kvspec.spec.dense.handle_trim_to`` (semantics.md 2, "handle trim")."""
        length = _check_int("handle_trim_to", "len", length)
        if length < 0 or length > self.offset:
            raise InvalidArgumentError(
                f"handle_trim_to: len must satisfy 0 <= len <= offset ({self.offset}), got {length}"
            )
        n = min(self.offset - length, self.live_len)
        if n == 0:
            return 0
        live = self.live_len - n
        self.buffers = None if live == 0 or self.buffers is None else self.buffers.map(lambda a: a[:, :, :live, :])
        self.offset -= n
        return n


class KVCache:
    """Dense per-layer KV cache in mode ``"fp16"`` or ``"int8"``.

    Args:
        mode: ``"fp16"`` (unquantized: rows stored in the dtype they come
            in) or ``"int8"`` (per-row symmetric int8 with float16 scales,
            dequantized to the incoming dtype; semantics.md 2 "Storage", :mod:`kvspec.impl.quant` for the range decision).
        step: growth granularity in rows, 1 to ``MAX_STEP`` (2^20). Production engines use 256;
            tests use 1 to 8.
        inplace: the in-place write switch; ``None`` reads ``KV_INPLACE_WRITE``.

    Raises InvalidArgumentError for a bad step and UnsupportedOperationError
    for a mode this implementation does not provide.

    Observables used by the differential harness: ``offset``,
    ``live_start``, ``live_len``, ``capacity`` and ``last_write_inplace``.
    """

    #: The Int8 quantizer (kvspec.impl.quant.quantize_int8).
    quantize_rows = staticmethod(quantize_int8)

    def __init__(self, mode: str = "fp16", step: int = 256, inplace: bool | None = None):
        if mode not in _MODES:
            raise UnsupportedOperationError(f"KVCache: mode must be one of {_MODES}, got {mode!r}")
        step = _check_int("KVCache", "step", step)
        if step < 1 or step > MAX_STEP:
            raise InvalidArgumentError(f"KVCache: step must be in [1, {MAX_STEP}], got {step}")
        self.mode = mode
        self.step = step
        self.inplace = check_inplace("KVCache", inplace)
        self._reset()

    def _reset(self) -> None:
        self.buffers: _Buffers | None = None
        self.offset = 0
        self.live_start = 0
        self._marker: _Marker | None = None
        self.last_write_inplace = False

    # -- observables -------------------------------------------------------
    @property
    def live_len(self) -> int:
        """Valid rows, ``offset - live_start``.

        Rule: ``kvspec.spec.dense.DenseCache`` (semantics.md 1, "live_len")."""
        return self.offset - self.live_start

    @property
    def capacity(self) -> int:
        """Physical rows along axis 2 (0 without buffers).

        Rule: ``kvspec.spec.dense.regrow_capacity`` (semantics.md 1, "capacity")."""
        return 0 if self.buffers is None else self.buffers.capacity

    # -- the write path ----------------------------------------------------
    def _encode(self, keys: mx.array, values: mx.array) -> _Buffers:
        """Rows as stored: as given in Fp16; quantized in Int8, which refuses
        a row that is not finite in float16 (kvspec.impl.quant's range decision)."""
        if self.mode == "int8":
            # One host read for both (a GPU sync per layer: the refusal must be
            # raised by this call, docs/gpu.md). The flag is scheduled first and
            # read once the quantized rows are built, so the device computes it
            # meanwhile; nothing of the cache changes before the read.
            flag = int8_rows_flag(keys, values)
            mx.async_eval(flag)
            kq, ks = self.quantize_rows(keys)
            vq, vs = self.quantize_rows(values)
            bad = int8_rows_refused(keys, values, flag)
            if bad is not None:
                absmax = int8_representable(keys if bad == "keys" else values)[1]
                raise InvalidArgumentError(
                    f"append: {bad} must be finite within float16's range (|x| <= {FLOAT16_MAX:g}) "
                    f"in mode int8 (no finite scale otherwise), got max |x| = {absmax:g}"
                )
            return _Buffers(kq, vq, ks, vs, keys.dtype)
        return _Buffers(keys, values)

    def _check_compatible(self, op: str, keys: mx.array, values: mx.array) -> None:
        """Appended rows (a pair :func:`_check_rows` accepted) match the
        cached ``[B, H, _, D]`` and dtype."""
        b = self.buffers
        if b is None:
            return
        bk, bv, ks, vs = b.keys.shape, b.values.shape, keys.shape, values.shape
        # the pair agrees on B and H (_check_rows, run first) and so do the
        # cached keys and values: the keys' B and H decide for the values too
        if not (ks[0] == bk[0] and ks[1] == bk[1] and ks[3] == bk[3] and vs[3] == bv[3]):
            check_matches_cache(op, "keys", tuple(bk), keys)
            check_matches_cache(op, "values", tuple(bv), values)
        check_dtype_matches(op, b.dtype, keys.dtype)

    def _grow(self, prev: int, n: int, rows: _Buffers) -> None:
        """Regrow rule (kvspec.spec.dense.regrow_needed / regrow_capacity): cut a
        buffer whose capacity differs from the live prefix, then append
        ``ceil(n / step) * step`` zero rows."""
        extra = regrow_capacity(prev, n, self.step) - prev

        def zeros_like_rows(a: mx.array) -> mx.array:
            return mx.zeros((a.shape[0], a.shape[1], extra, a.shape[3]), dtype=a.dtype)

        grown = rows.map(zeros_like_rows)
        if self.buffers is None:
            self.buffers = grown
            return
        old = self.buffers
        if old.capacity != prev:
            old = old.map(lambda a: a[:, :, :prev, :])
        # arrays() lists keys, values[, key_scales, value_scales]: the
        # constructor's order.
        self.buffers = _Buffers(
            *(mx.concatenate([a, b], axis=SEQ_AXIS) for a, b in zip(old.arrays(), grown.arrays())),
            out_dtype=rows.out_dtype,
        )

    def _owns_buffers(self) -> bool:
        m, b = self._marker, self.buffers
        if m is None or b is None:
            return False
        if b.key_scales is None:
            return len(m.arrays) == 2 and m.arrays[0] is b.keys and m.arrays[1] is b.values
        current = b.arrays()
        return len(current) == len(m.arrays) and all(x is y for x, y in zip(current, m.arrays))

    def _inplace_write_allowed(self, n: int) -> bool:
        """Ownership rule (kvspec.spec.dense.inplace_write_allowed): switch on,
        a decode step, Fp16, and the marker names these very buffers and the
        current live_len. Why it is safe: see the spec's docstring."""
        m = self._marker
        if not (self.inplace and n == 1 and self.mode == "fp16" and m is not None
                and m.live_len == self.offset - self.live_start):  # cheapest first: a rollback's write fails here
            return False
        # _owns_buffers for Fp16 buffers (two arrays), inlined: the decode
        # path asks per layer per step
        b, owned = self.buffers, m.arrays
        return b is not None and len(owned) == 2 and owned[0] is b.keys and owned[1] is b.values

    def _write_inplace(self, at: int, rows: _Buffers) -> None:
        """Write rows into the existing buffers' memory: every holder sharing
        them sees it, which the ownership rule makes harmless."""
        assert self.buffers is not None and self.buffers.key_scales is None  # Fp16 only (the ownership rule)
        b, mech = self.buffers, inplace_mechanism()
        index = (_ALL, _ALL, slice(at, at + rows.keys.shape[SEQ_AXIS]))  # one index for both arrays
        self.buffers = _Buffers(*write_inplace_pair(b.keys, rows.keys, b.values, rows.values, index, mech),
                                out_dtype=b.out_dtype)

    def _write_copy(self, at: int, rows: _Buffers) -> None:
        """Copying write (kvspec.impl.write.write_copy): new buffers, the old ones
        unchanged for whoever shares them; MLX reuses their memory when
        nobody does."""
        b = self.buffers
        assert b is not None
        index = (_ALL, _ALL, slice(at, at + rows.keys.shape[SEQ_AXIS]))  # one index for every array
        scales = (None, None) if b.key_scales is None else (
            write_copy(b.key_scales, rows.key_scales, index), write_copy(b.value_scales, rows.value_scales, index))  # type: ignore[arg-type]
        self.buffers = _Buffers(write_copy(b.keys, rows.keys, index), write_copy(b.values, rows.values, index),
                                *scales, out_dtype=b.out_dtype)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``S`` rows and return the window (kvspec.spec.dense.append).

        ``keys``: ``[B, H, S, Dk]``, ``values``: ``[B, H, S, Dv]`` in
        float16, bfloat16 or float32 (stored as given, or int8 + scales).
        Returns the ``[B, H, live_len, Dk]`` / ``[..., Dv]`` window in that
        dtype (dequantized in Int8).
        Raises InvalidArgumentError for a wrong rank or dtype, S < 1, a
        batch B, kv heads H, head dim or dtype that differs from the rows
        already cached (the message names it), and in Int8 for rows beyond
        float16's finite range.
        """
        b = self.buffers
        n = 0
        if (b is not None and b.key_scales is None and b.out_dtype is None and self.mode == "fp16"
                and type(keys) is mx.array and type(values) is mx.array):
            # the Fp16 decode path: the pair accepted in one pass
            # (decode_pair_rows's checks, inlined: the cached keys' shape is
            # read once, for the checks and the capacity)
            ks, vs, bk, bv = keys.shape, values.shape, b.keys.shape, b.values.shape
            if (len(ks) == 4 and len(vs) == 4 and ks[2] == vs[2] and ks[2] >= 1 and ks[0] == bk[0] == vs[0] == bv[0]
                    and ks[1] == bk[1] == vs[1] == bv[1] and ks[3] == bk[3] and vs[3] == bv[3]
                    and (kd := keys.dtype) == values.dtype and kd == b.keys.dtype):
                n = ks[2]
            prev = self.offset - self.live_start
            if n and prev + n <= (cap := bk[SEQ_AXIS]):
                # no regrow: what the general path below does, in fewer
                # Python calls (on a GPU a 28-layer step pays this Python
                # between its kernels); the writes go through the same two
                # methods
                inplace = self._inplace_write_allowed(n)
                if inplace:
                    self._write_inplace(prev, _Buffers(keys, values))
                else:
                    self._write_copy(prev, _Buffers(keys, values))
                self.offset += n
                self.last_write_inplace = inplace
                b = self.buffers
                k, v = b.keys, b.values
                live = prev + n
                self._marker = _Marker((k, v), live)
                if live == cap:
                    # the window is the whole buffer: handles of the buffers
                    # themselves (the same memory and rows, no slice; a slice
                    # costs about 3 us of host time per array, per layer per
                    # step). A caller assigning into its window rebinds its
                    # own handle, never the cache's buffer.
                    return k.__copy__(), v.__copy__()
                window = (_ALL, _ALL, slice(0, live))
                return k[window], v[window]
        if n:
            rows = _Buffers(keys, values)
        else:
            n = _check_rows("append", keys, values)
            self._check_compatible("append", keys, values)
            rows = self._encode(keys, values)
        prev = self.offset - self.live_start  # live_len, read once (the decode path runs per layer per step)
        if self.buffers is None or prev + n > self.buffers.keys.shape[SEQ_AXIS]:
            self._grow(prev, n, rows)
        inplace = self._inplace_write_allowed(n)
        if inplace:
            self._write_inplace(prev, rows)
        else:
            self._write_copy(prev, rows)
        self.offset += n
        self.last_write_inplace = inplace
        b = self.buffers
        assert b is not None
        self._marker = _Marker(b.arrays(), prev + n)
        return b.window(prev + n)

    def fetch(self) -> tuple[mx.array, mx.array] | None:
        """The live window without writing: ``[B, H, live_len, D]`` pair in
        the rows' dtype, or None when the cache holds no rows.

        Rule: ``kvspec.spec.dense.view_of`` (semantics.md 5, "rule 1")."""
        return None if self.buffers is None else self.buffers.window(self.live_len)

    # -- the trim family ---------------------------------------------------
    def _drop_if_empty(self) -> None:
        if self.live_len == 0:
            self.buffers = None
            self._marker = None

    def trim(self, n: int) -> int:
        """Remove ``n`` rows from the end by a logical rewind (O(1): only the
        offset moves; buffers, sidecars and capacity stay; the next write
        overwrites the abandoned rows; speculative decoding relies on it).
        ``n`` is clamped to ``[0, live_len]``, so a negative n trims nothing. Returns the rows
        removed. Raises InvalidArgumentError for a non-integer n.

        Rule: ``kvspec.spec.dense.trim`` (semantics.md 2, "trim(n)"), ``kvspec.spec.dense.trim_is_logical``."""
        if type(n) is not int:  # the common case (a Python int) skips the full check
            n = _check_int("trim", "n", n)
        live = self.offset - self.live_start
        n = 0 if n < 0 else min(n, live)
        self.offset -= n
        if n == live:
            self._drop_if_empty()
        return n

    def trim_to(self, length: int) -> int:
        """``trim(offset - length)``. Raises InvalidArgumentError unless
        ``0 <= length <= offset``.

        Rule: ``kvspec.spec.dense.trim_to`` (semantics.md 2, "trim_to(len)")."""
        length = _check_int("trim_to", "len", length)
        if length < 0 or length > self.offset:
            raise InvalidArgumentError(
                f"trim_to: len must satisfy 0 <= len <= offset ({self.offset}), got {length}"
            )
        return self.trim(self.offset - length)

    def trim_front_keep_sink(self, n: int, keep: int = 0) -> int:
        """Evict ``n`` rows after the first ``keep`` sinks; the offset never
        decreases, ``live_start += n``. Rows (and Int8 scales, in lockstep)
        are compacted into new buffers of exactly the live rows. Returns the
        rows evicted (kvspec.spec.dense.trim_front_keep_sink)."""
        n = _check_int("trim_front", "n", n)
        keep = _check_int("trim_front", "keep", keep)
        n = max(0, min(n, self.live_len))
        if n == 0:
            return 0
        keep = max(0, min(keep, self.live_len - n))
        assert self.buffers is not None
        live = self.live_len
        self.buffers = self.buffers.map(
            lambda a: mx.concatenate([a[:, :, :keep, :], a[:, :, keep + n : live, :]], axis=SEQ_AXIS)
        )
        self.live_start += n
        self._drop_if_empty()
        return n

    def trim_front(self, n: int) -> int:
        """``trim_front_keep_sink(n, keep=0)``.

        Rule: ``kvspec.spec.dense.trim_front_keep_sink`` (semantics.md 2, "front trim")."""
        return self.trim_front_keep_sink(n)

    def gather_positions(self, positions: list[int]) -> int:
        """Keep exactly the listed live rows, in order; ``offset =
        len(positions)``. Returns the new live_len. The identity list is a
        no-op. Raises StateError when ``live_start != 0`` and
        InvalidArgumentError unless positions are non-empty, strictly
        increasing and in ``[0, live_len)`` (kvspec.spec.dense.gather_positions)."""
        if self.live_start != 0:
            raise StateError(
                f"gather_positions: requires live_start == 0 (no front trim), got live_start={self.live_start}"
            )
        positions = [_check_int("gather_positions", "positions", p) for p in _check_list("gather_positions", "positions", positions)]
        _check_index_list("gather_positions", "positions", positions, 0, self.live_len)
        if positions == list(range(self.live_len)):
            return self.live_len
        assert self.buffers is not None
        idx = mx.array(positions)
        self.buffers = self.buffers.map(lambda a: mx.take(a, idx, axis=SEQ_AXIS))
        self.offset = len(positions)
        return self.live_len

    def gather_within_tail(self, tail_len: int, kept: list[int]) -> int:
        """Tree-speculation rollback in O(tail): of the last ``tail_len``
        rows keep ``kept`` (indices into the tail), written back at the
        tail's start; capacity is kept. Returns the new live_len. Raises
        InvalidArgumentError unless ``0 < tail_len <= live_len`` and kept is
        non-empty, strictly increasing and in ``[0, tail_len)``.

        Rule: ``kvspec.spec.dense.gather_within_tail`` (semantics.md 2, "gather_within_tail")."""
        tail_len = _check_int("gather_within_tail", "tail_len", tail_len)
        if tail_len <= 0 or tail_len > self.live_len:
            raise InvalidArgumentError(
                f"gather_within_tail: tail_len must satisfy 0 < tail_len <= live_len ({self.live_len}), got {tail_len}"
            )
        kept = [_check_int("gather_within_tail", "kept", k) for k in _check_list("gather_within_tail", "kept", kept)]
        _check_index_list("gather_within_tail", "kept", kept, 0, tail_len)
        assert self.buffers is not None
        start = self.live_len - tail_len
        idx = mx.array([start + k for k in kept])
        rows = self.buffers.map(lambda a: mx.take(a, idx, axis=SEQ_AXIS))
        self._write_copy(start, rows)
        self.offset -= tail_len - len(kept)
        return self.live_len

    # -- snapshot, restore, detach, install ---------------------------------
    def __copy__(self) -> KVCache:
        return copy_without_marker(self)

    def __deepcopy__(self, memo: dict) -> KVCache:
        return copy_without_marker(self, memo)

    def snapshot(self) -> CacheSnapshot:
        """A prompt-cache snapshot sharing the buffers (O(1), no copy).

        Rule: ``kvspec.spec.dense.w_snapshot`` (semantics.md 2, "snapshot")."""
        shared = None if self.buffers is None else self.buffers.shared()
        return CacheSnapshot(self.mode, shared, self.offset, self.live_start)

    def _check_holder(self, op: str, holder: CacheSnapshot) -> None:
        if not isinstance(holder, CacheSnapshot):
            raise InvalidArgumentError(f"{op}: expected a CacheSnapshot, got {type(holder).__name__}")
        if holder.mode != self.mode:
            raise InvalidArgumentError(f"{op}: mode must be {self.mode!r}, got {holder.mode!r}")
        _check_int(op, "offset", holder.offset)
        _check_int(op, "live_start", holder.live_start)
        if holder.live_start < 0 or holder.live_start > holder.offset:
            raise InvalidArgumentError(
                f"{op}: cursor must satisfy 0 <= live_start <= offset, got live_start={holder.live_start}, offset={holder.offset}"
            )
        b = holder.buffers
        if b is None:
            if holder.live_len != 0:
                raise InvalidArgumentError(f"{op}: live_len {holder.live_len} > 0 but no tensors")
            return
        for name, a in (("keys", b.keys), ("values", b.values)):
            _check_tensor(op, name, a)
            if self.mode == "int8" and a.dtype != mx.int8:
                raise InvalidArgumentError(f"{op}: {name} dtype must be {mx.int8}, got {a.dtype}")
            if self.mode == "fp16" and a.dtype not in FLOAT_DTYPES:
                raise InvalidArgumentError(f"{op}: {name} dtype must be float16, bfloat16 or float32, got {a.dtype}")
        if b.keys.dtype != b.values.dtype:
            raise InvalidArgumentError(f"{op}: keys and values must share a dtype, got {b.keys.dtype} and {b.values.dtype}")
        if b.out_dtype is not None and b.out_dtype not in FLOAT_DTYPES:
            raise InvalidArgumentError(f"{op}: dequantized dtype must be float16, bfloat16 or float32, got {b.out_dtype}")
        if b.keys.shape[:3] != b.values.shape[:3]:
            raise InvalidArgumentError(
                f"{op}: keys and values must agree on [B, H, T], got {tuple(b.keys.shape)} and {tuple(b.values.shape)}"
            )
        if (b.key_scales is None) != (self.mode != "int8") or (b.value_scales is None) != (self.mode != "int8"):
            raise InvalidArgumentError(f"{op}: scale sidecars must be present exactly in int8 mode")
        if self.mode == "int8":
            want_shape = (*b.keys.shape[:3], 1)
            for name, s in (("key_scales", b.key_scales), ("value_scales", b.value_scales)):
                _check_tensor(op, name, s)
                if s.dtype != mx.float16 or tuple(s.shape) != want_shape:
                    raise InvalidArgumentError(
                        f"{op}: {name} must be float16 of shape [B, H, T, 1] = {want_shape}, got {s.dtype} {tuple(s.shape)}"
                    )
        if holder.live_len > b.capacity:
            raise InvalidArgumentError(
                f"{op}: cursor out of range: live_len {holder.live_len} > capacity {b.capacity}"
            )

    def _adopt(self, holder: CacheSnapshot) -> None:
        # Adopted buffers are shared with the holder: no marker, so the next
        # write copies (semantics.md 2, "restore").
        self.buffers = None if holder.buffers is None else holder.buffers.shared()
        self.offset, self.live_start = holder.offset, holder.live_start
        self._marker = None

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Adopt a snapshot's buffers and window. The snapshot stays valid and
        unchanged. Raises InvalidArgumentError for a malformed snapshot
        (wrong type, mode, rank, K/V mismatch, dtype, cursor out of range).

        The cache keeps no ownership marker, so its next write copies. Rule:
        ``kvspec.spec.dense.w_restore``, ``kvspec.spec.dense.adopt`` (semantics.md 2, "restore")."""
        self._check_holder("restore", snapshot)
        self._adopt(snapshot)

    def detach(self) -> DetachedHandle:
        """Move every tensor into a detached handle; the cache becomes empty.

        Rule: ``kvspec.spec.dense.w_detach`` (semantics.md 2, "detach / install")."""
        handle = DetachedHandle(self.mode, self.buffers, self.offset, self.live_start)
        self._reset()
        return handle

    def install(self, handle: DetachedHandle) -> None:
        """Install a detached handle into this empty cache; the handle is
        consumed (emptied). Raises StateError when the cache is not empty,
        InvalidArgumentError for a malformed handle.

        Rule: ``kvspec.spec.dense.w_install``, ``kvspec.spec.dense.is_empty`` (semantics.md 2,
        "detach / install")."""
        if not isinstance(handle, DetachedHandle):
            raise InvalidArgumentError(f"install: expected a DetachedHandle, got {type(handle).__name__}")
        if handle.consumed:
            raise StateError("install: the handle was already installed")
        if not self.empty() or self.offset != 0:
            raise StateError(f"install: requires an empty cache, got offset={self.offset}, live_len={self.live_len}")
        self._check_holder("install", handle)
        self._adopt(handle)
        handle.buffers, handle.offset, handle.live_start = None, 0, 0
        handle.consumed = True

    # -- mlx-lm cache protocol ---------------------------------------------
    @property
    def state(self) -> tuple[mx.array, ...]:
        """Live rows only, never the buffer objects themselves: Fp16
        ``(keys, values)``; Int8 ``(keys, key_scales, values, value_scales)``.
        Refused (UnsupportedOperationError) to mlx-lm's
        ``save_prompt_cache`` (:func:`refuse_foreign_save`).

        Rule: ``kvspec.spec.dense.state_of`` (semantics.md 8, "The state protocol")."""
        refuse_foreign_save(self)
        if self.buffers is None:
            return ()
        b = self.buffers.map(lambda a: a[:, :, : self.live_len, :])
        if self.mode == "int8":
            return (b.keys, b.key_scales, b.values, b.value_scales)  # type: ignore[return-value]
        return (b.keys, b.values)

    @state.setter
    def state(self, v: tuple[mx.array, ...]) -> None:
        """Load live rows (offset = their count, live_start 0) in this
        cache's mode; validated as ``from_state`` validates, and nothing
        changes when refused."""
        other = type(self)._build("state", self.mode, self.step, v, None, 0)
        self.buffers, self.offset, self.live_start, self._marker = other.buffers, other.offset, other.live_start, None

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(mode, step, offset, live_start)`` as strings; an Int8 cache
        whose rows came in another dtype than float16 adds a fifth field,
        that dtype (``"bfloat16"``, ``"float32"``): ``state`` holds int8
        codes and float16 scales, which do not say what a reader gets back
        (docs/mlx-lm.md, "The state protocol").

        Rule: ``kvspec.spec.dense.w_reload`` (semantics.md 8, "The state protocol")."""
        head = (self.mode, str(self.step), str(self.offset), str(self.live_start))
        if self.mode == "int8" and self.buffers is not None and self.buffers.dtype != mx.float16:
            return head + (_DTYPE_NAMES[self.buffers.dtype],)
        return head

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        """Set (mode, step, offset, live_start) over the rows already loaded;
        refused (nothing changes) when they do not fit those rows."""
        if v is None:
            raise InvalidArgumentError("meta_state: meta_state must be (mode, step, offset, live_start), got None")
        other = type(self).from_state(self.state, v, op="meta_state")
        self.mode, self.step = other.mode, other.step
        self.buffers, self.offset, self.live_start, self._marker = other.buffers, other.offset, other.live_start, None

    @classmethod
    def from_state(cls, state: tuple[mx.array, ...], meta_state: tuple[str, ...] | None = None,
                   op: str = "from_state") -> KVCache:
        """Rebuild a cache from ``state`` (the live rows: Fp16 ``(keys,
        values)``, Int8 ``(keys, key_scales, values, value_scales)``, each
        ``[B, H, live_len, D]``) and ``meta_state`` (``(mode, step, offset,
        live_start)`` as strings, mlx-lm prompt-cache files). Without
        meta_state: an Fp16 cache with offset = rows, live_start 0.

        Raises InvalidArgumentError (message prefixed with ``op``) for a
        malformed meta_state, the wrong number of arrays for the mode,
        tensors of the wrong rank or dtype, or counters that do not fit the
        rows; UnsupportedOperationError for an unknown mode.

        Rule: ``kvspec.spec.dense.w_reload`` (semantics.md 8, "The state protocol")."""
        if meta_state is None:
            return cls._build(op, "fp16", 256, state, None, 0)
        if not isinstance(meta_state, (tuple, list)) or len(meta_state) not in (4, 5) or (
                len(meta_state) == 5 and meta_state[0] != "int8"):
            raise InvalidArgumentError(f"{op}: meta_state must be (mode, step, offset, live_start), or for int8 "
                                       f"(mode, step, offset, live_start, dtype), got {meta_state!r}")
        try:
            step, offset, live_start = (int(x) for x in meta_state[1:4])
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"{op}: meta_state must hold integers, got {meta_state!r}") from None
        out_dtype = None
        if len(meta_state) == 5:
            out_dtype = next((d for d, name in _DTYPE_NAMES.items() if name == meta_state[4]), None)
            if out_dtype is None:
                raise InvalidArgumentError(f"{op}: meta_state dtype must be one of {', '.join(_DTYPE_NAMES.values())}, "
                                           f"got {meta_state[4]!r}")
        return cls._build(op, meta_state[0], step, state, offset, live_start, out_dtype)

    @classmethod
    def _build(cls, op: str, mode: str, step: int, state: tuple[mx.array, ...], offset: int | None,
               live_start: int, out_dtype: mx.Dtype | None = None) -> KVCache:
        obj = cls(mode=mode, step=step)
        want = 4 if mode == "int8" else 2
        if not isinstance(state, (tuple, list)):
            raise InvalidArgumentError(f"{op}: state must be a tuple of {want} arrays (or empty), got {type(state).__name__}")
        if state and len(state) != want:
            raise InvalidArgumentError(f"{op}: state must hold {want} arrays in mode {mode}, got {len(state)}")
        buffers = None
        if state:
            buffers = (_Buffers(state[0], state[2], state[1], state[3], out_dtype) if mode == "int8"
                       else _Buffers(state[0], state[1]))
            for name, a in (("keys", buffers.keys), ("values", buffers.values)):
                _check_tensor(op, name, a)
        rows = 0 if buffers is None else buffers.capacity
        holder = CacheSnapshot(mode, buffers, rows if offset is None else offset, live_start)
        obj._check_holder(op, holder)
        if buffers is not None and holder.live_len != rows:
            raise InvalidArgumentError(
                f"{op}: state must hold exactly the live rows, got {rows} rows for live_len {holder.live_len}"
            )
        obj._adopt(holder)
        return obj

    def is_trimmable(self) -> bool:
        """Always True: a dense cache trims any ``n`` (clamped to ``[0, live_len]``). Rule:
        ``kvspec.spec.dense.trim`` (semantics.md 2, "trim(n)")."""
        return True

    def keys_and_values(self) -> tuple[mx.array, mx.array] | None:
        """mlx-lm's name for reading the window without writing (models that
        share one layer's keys with another call it): :meth:`fetch`.

        Rule: ``kvspec.spec.dense.view_of`` (semantics.md 5, "rule 1")."""
        return self.fetch()

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> Any:
        """mlx-lm's ``kv_bits`` hook (``maybe_quantize_kv_cache`` calls it
        once the offset reaches ``quantized_kv_start``): a quantized copy of
        this cache, for every ``bits`` mlx-lm takes, so ``kv_bits`` never
        fails late (docs/mlx-lm.md, "Quantized caches").

        * ``bits=8``: our Int8 storage (per-row symmetric, one group per
          head_dim row, so ``group_size`` does not change it): ``self`` when
          already Int8, else a new Int8 cache holding these rows quantized,
          with the same offset, live_start and step.
        * ``bits`` in 2, 3, 4, 5, 6 on an Fp16 cache: kvspec has no such
          affine group storage, so the layer becomes mlx-lm's own
          ``QuantizedKVCache(group_size, bits)`` holding these live rows
          (exactly mlx-lm's ``KVCache.to_quantized``; decoding equals mlx-lm's
          caches under the same ``kv_bits``, byte for byte). From then on the
          layer is mlx-lm's: it trims, but has no snapshot.

        * ``bits`` other than 8 on an Int8 cache: ``self``, with one
          UserWarning per cache saying the layer keeps its int8 storage
          (re-quantizing int8 codes would lose rows; a cache built
          ``mode="int8"`` has chosen its quantization). Raising here would
          fail late: mlx-lm calls this hook only once the offset reaches
          ``quantized_kv_start``, thousands of tokens into a conversation.

        Raises UnsupportedOperationError for a ``bits`` or ``group_size``
        mlx-lm does not take (bits 2, 3, 4, 5, 6, 8; group_size 32, 64,
        128), and when mlx-lm is not installed; never silently keeps fp16.

        Rule: semantics.md 2, "Storage" (semantics.md 8, mlx-lm interop)."""
        bits = _check_int("to_quantized", "bits", bits)
        group_size = _check_int("to_quantized", "group_size", group_size)
        if bits not in (2, 3, 4, 5, 6, 8) or group_size not in (32, 64, 128):
            raise UnsupportedOperationError(
                f"to_quantized: bits must be one of 2, 3, 4, 5, 6, 8 and group_size one of 32, 64, 128 "
                f"(mlx's quantizer), got bits={bits}, group_size={group_size}"
            )
        if bits != 8:
            if self.mode != "fp16":
                if not self.__dict__.get("_quantize_warned"):
                    self._quantize_warned = True
                    warnings.warn(
                        f"to_quantized(bits={bits}): this cache stores int8 (mode 'int8') and keeps it "
                        "(re-quantizing int8 codes would lose rows; build the layer with mode='fp16' to take "
                        "kv_bits; reported once per cache)", UserWarning, stacklevel=2,
                    )
                return self
            return self._to_mlx_lm_quantized(group_size, bits)
        if self.mode == "int8":
            return self
        q = type(self)(mode="int8", step=self.step, inplace=self.inplace)
        buffers = None
        if self.buffers is not None:
            k, v = self.buffers.window(self.live_len)
            for name, a in (("keys", k), ("values", v)):
                ok, absmax = int8_representable(a)
                if not ok:
                    raise InvalidArgumentError(
                        f"to_quantized: {name} must be finite within float16's range (|x| <= {FLOAT16_MAX:g}) "
                        f"to be stored as int8, got |x| up to {absmax}")
            (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
            buffers = _Buffers(kq, vq, ks, vs, k.dtype)  # dequantizes to the rows' dtype (bfloat16 stays bfloat16)
        q._adopt(CacheSnapshot("int8", buffers, self.offset, self.live_start))
        return q

    @classmethod
    def merge(cls, caches: Any) -> Any:
        """mlx-lm's batching hook (``_merge_caches``): one batch cache from
        one cache per sequence, :meth:`kvspec.impl.batch.BatchKVCache.merge`
        (kvspec.spec.batch.merge). Raises what that raises."""
        # kvspec.impl.batch builds on this module; looked up at call time (no import cycle)
        return importlib.import_module("kvspec.impl.batch").BatchKVCache.merge(caches)

    def _to_mlx_lm_quantized(self, group_size: int, bits: int) -> Any:
        try:
            from mlx_lm.models.cache import QuantizedKVCache
        except ImportError:  # pragma: no cover - the e2e extra is installed by make
            raise UnsupportedOperationError(
                f"to_quantized: bits={bits} needs mlx-lm's QuantizedKVCache (pip install 'kvspec[e2e]'); "
                "kvspec itself stores bits=8"
            ) from None
        if self.live_start != 0:
            raise UnsupportedOperationError(
                f"to_quantized: bits={bits} hands the layer to mlx-lm's QuantizedKVCache, whose offset counts its rows; "
                f"this cache's window starts at live_start={self.live_start} (a front trim), which it cannot hold"
            )
        q = QuantizedKVCache(group_size=group_size, bits=bits)
        q.offset = self.offset
        if self.buffers is not None and self.live_len > 0:
            k, v = self.buffers.window(self.live_len)
            if k.shape[-1] % group_size or v.shape[-1] % group_size:
                raise UnsupportedOperationError(
                    f"to_quantized: group_size={group_size} must divide the head dims (keys {k.shape[-1]}, "
                    f"values {v.shape[-1]}) for mlx's quantizer"
                )
            q.keys = mx.quantize(k, group_size=group_size, bits=bits)
            q.values = mx.quantize(v, group_size=group_size, bits=bits)
        return q

    def size(self) -> int:
        """The offset (mlx-lm's ``size()``: the position the next row takes). Rule: semantics.md 1,
        "offset"."""
        return self.offset

    def empty(self) -> bool:
        """True when the cache holds no buffers. Rule: ``kvspec.spec.dense.is_empty`` (semantics.md 2,
        "detach / install")."""
        return self.buffers is None

    @property
    def nbytes(self) -> int:
        """Bytes of every stored array (buffers and, in Int8, scales) over the whole capacity, dead
        rows included; 0 without buffers. Rule: semantics.md 2, "Storage"."""
        return 0 if self.buffers is None else sum(a.nbytes for a in self.buffers.arrays())

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        """Attention mask for ``N`` new queries (called before the update, as
        mlx-lm does), over the ``live_len + N`` keys the append will return.
        Query ``i`` sees key ``j`` iff ``j <= live_len + i`` and, with
        ``window_size``, ``live_len + i - j < window_size``
        (kvspec.spec.dense.dense_mask_visible). Returns ``None`` when every key is
        visible to the single query, ``"causal"`` when the plain causal mask
        is exact, else (or with ``return_array``) a bool ``[N, live_len + N]``
        array. Raises InvalidArgumentError for ``N < 1`` and for a
        ``window_size`` that is not None or an integer >= 1
        (kvspec.spec.dense.check_window_size)."""
        N = _check_int("make_mask", "N", N)
        if N < 1:
            raise InvalidArgumentError(f"make_mask: N must be >= 1, got {N}")
        window_size = check_window_size("make_mask", window_size)
        L = self.live_len + N
        # The window binds only when some query is window_size or more keys
        # past the first: otherwise the plain causal mask is exact.
        binds = window_size is not None and L > window_size
        if not return_array and not binds:
            return None if N == 1 else "causal"
        return causal_mask(self.live_len, N, window_size)  # kvspec.impl.masks: built where the arrays live


def _check_index_list(op: str, name: str, values: list[int], lo: int, hi: int) -> None:
    if not values:
        raise InvalidArgumentError(f"{op}: {name} must be non-empty, got []")
    for a, b in pairwise(values):
        if b <= a:
            raise InvalidArgumentError(f"{op}: {name} must be strictly increasing, got {values}")
    if values[0] < lo or values[-1] >= hi:
        raise InvalidArgumentError(f"{op}: {name} must lie in [{lo}, {hi}), got {values}")
