"""Injected bugs of the dense cache (``kvspec.impl.dense.KVCache``).

Each entry is a subclass of ``KVCache`` that breaks exactly one rule of
``kvspec.spec.dense`` (the clause it names); see ``fuzz/bugs/__init__.py``.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import mlx.core as mx

from kvspec.fuzz.bugs import InjectedBug
from kvspec.impl import write as kvwrite
from kvspec.impl.dense import SEQ_AXIS, CacheSnapshot, DetachedHandle, KVCache, _Buffers, _Marker
from kvspec.spec.errors import InvalidArgumentError, StateError


class InplaceAfterTrim(KVCache):
    """Ownership predicate without the marker's length check: after a
    logical trim the decode row lands on a row a snapshot still sees."""

    def _inplace_write_allowed(self, n: int) -> bool:
        return self.inplace and n == 1 and self.mode == "fp16" and self._owns_buffers()


class InplaceAfterRestore(KVCache):
    """``restore`` records an ownership marker for the adopted buffers, as if
    the cache had produced them: the next decode writes into memory the
    snapshot (and whatever else shares it) may see."""

    def _adopt(self, holder: Any) -> None:
        super()._adopt(holder)
        if self.buffers is not None:
            self._marker = _Marker(self.buffers.arrays(), self.live_len)


class PhysicalTrimFp16(KVCache):
    """Fp16 trim re-slices the buffers to the live rows: values stay right,
    but every rollback costs O(context) and throws the capacity away (#1209)."""

    def trim(self, n: int) -> int:
        removed = super().trim(n)
        if self.buffers is not None and removed:
            live = self.live_len
            self.buffers = self.buffers.map(lambda a: a[:, :, :live, :])
        return removed


class OldRegrowGuard(KVCache):
    """The pre-#1209 regrow guard: cut the buffer before growing only when
    ``prev % step != 0``, so a logically trimmed buffer keeps its stale tail
    and grows past the spec's capacity."""

    def _grow(self, prev: int, n: int, rows: _Buffers) -> None:
        extra = -(-n // self.step) * self.step

        def zeros(a: mx.array) -> mx.array:
            return mx.zeros((a.shape[0], a.shape[1], extra, a.shape[3]), dtype=a.dtype)

        grown = rows.map(zeros)
        if self.buffers is None:
            self.buffers = grown
            return
        old = self.buffers
        if prev % self.step != 0:
            old = old.map(lambda a: a[:, :, :prev, :])
        parts = zip((old.keys, old.values, old.key_scales, old.value_scales),
                    (grown.keys, grown.values, grown.key_scales, grown.value_scales))
        self.buffers = _Buffers(*(None if a is None else mx.concatenate([a, b], axis=SEQ_AXIS) for a, b in parts),
                                out_dtype=rows.out_dtype)


class Int8FrontTrimForgetsScales(KVCache):
    """Int8 front trim compacts the quantized rows but not their scales: the
    surviving rows are dequantized with the evicted rows' scales."""

    def trim_front_keep_sink(self, n: int, keep: int = 0) -> int:
        scales = None if self.buffers is None else (self.buffers.key_scales, self.buffers.value_scales)
        removed = super().trim_front_keep_sink(n, keep)
        if removed and self.buffers is not None and scales is not None and scales[0] is not None:
            live = self.live_len
            self.buffers.key_scales = scales[0][:, :, :live, :]
            self.buffers.value_scales = scales[1][:, :, :live, :]  # type: ignore[index]
        return removed


class Int8WritesInPlace(KVCache):
    """The mode condition dropped from the ownership rule: Int8 decode rows
    go in place too (the rule keeps Int8 and Turbo modes on the copying path)."""

    def _inplace_write_allowed(self, n: int) -> bool:
        return (self.inplace and n == 1 and self._owns_buffers() and self._marker is not None
                and self.live_len == self._marker.live_len)


class InplaceSwitchIgnored(KVCache):
    """``KV_INPLACE_WRITE=0`` is ignored: the escape hatch that must turn
    in-place writes off everywhere does nothing."""

    def _inplace_write_allowed(self, n: int) -> bool:
        saved, self.inplace = self.inplace, True
        try:
            return super()._inplace_write_allowed(n)
        finally:
            self.inplace = saved


class NegativeTrimGrowsOffset(KVCache):
    """trim clamps only from above, so a negative n grows the offset (the
    behaviour of mlx-lm's KVCache.trim)."""

    def trim(self, n: int) -> int:
        n = min(int(n), self.live_len)
        self.offset -= n
        self._drop_if_empty()
        return n


class FrontTrimRewindsOffset(KVCache):
    """Front trim moves the offset back as well: the next row gets a RoPE
    position that is already taken."""

    def trim_front_keep_sink(self, n: int, keep: int = 0) -> int:
        removed = super().trim_front_keep_sink(n, keep)
        self.offset -= removed
        self.live_start -= removed
        return removed


class TrimToZeroKeepsBuffers(KVCache):
    """A trim to live_len 0 keeps the buffers and sidecars allocated."""

    def _drop_if_empty(self) -> None:
        return None


# -- blind spots of a harness without these checks (each caught only by the check named)


class MaskIgnoresWindow(KVCache):
    """A dense cache serving a windowed layer ignores ``window_size`` for a
    decode step: ``make_mask(1, window_size=3)`` over 6 keys returns None
    (every key visible). Caught only by the dense mask check."""

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if N == 1 and not return_array:
            return None
        return super().make_mask(N, window_size, return_array)


class SnapshotDeepCopies(KVCache):
    """The snapshot copies every buffer (O(n) instead of O(1)): the bytes are
    identical, only the memory differs. Caught only by the sharing check."""

    def snapshot(self) -> CacheSnapshot:
        snap = super().snapshot()
        if snap.buffers is not None:
            snap.buffers = snap.buffers.map(lambda a: mx.array(a) + 0)
            mx.eval(*snap.buffers.arrays())
        return snap


class CastsToFloat16(KVCache):
    """The unquantized mode casts incoming rows to float16 (the old
    behaviour): a bfloat16 model's rows change dtype, values beyond 65504
    become inf. Caught only when the machines draw bfloat16 or float32."""

    def _encode(self, keys: mx.array, values: mx.array) -> _Buffers:
        if self.mode == "fp16":
            return _Buffers(keys.astype(mx.float16), values.astype(mx.float16))
        return super()._encode(keys, values)

    def _check_compatible(self, op: str, keys: mx.array, values: mx.array) -> None:
        super()._check_compatible(op, keys.astype(mx.float16) if self.mode == "fp16" else keys, values)


def _env_switch_case_sensitive() -> bool:
    value = os.environ.get("KV_INPLACE_WRITE")
    return value is None or value not in ("0", "false", "off", "no")


class EnvSwitchCaseSensitive(KVCache):
    """``KV_INPLACE_WRITE`` parsed without case folding or blank stripping:
    ``OFF`` or ``" no "`` leave in-place writes on. Caught only when the
    machines build caches under drawn spellings (``inplace_env``)."""

    def __init__(self, mode: str = "fp16", step: int = 256, inplace: bool | None = None):
        super().__init__(mode, step, inplace)
        if inplace is None:
            self.inplace = _env_switch_case_sensitive()


def _round_half_away(x: mx.array) -> mx.array:
    return mx.sign(x) * mx.floor(mx.abs(x) + 0.5)


def quantize_half_away(x: mx.array) -> tuple[mx.array, mx.array]:
    """kvspec.impl.quant.quantize_int8 with round half away from zero instead of
    half to even (ties of ``x / scale`` go the wrong way)."""
    x16 = x.astype(mx.float16)
    absmax = mx.max(mx.abs(x16), axis=-1, keepdims=True)
    scale = absmax / 127
    scale = mx.where(scale == 0, 1, scale)
    q = mx.clip(_round_half_away(x16 / scale), -128, 127).astype(mx.int8)
    return q, scale.astype(mx.float16)


class QuantizerRoundsHalfAway(KVCache):
    """A rounding bug in the quantizer itself. An oracle that calls the
    implementation's quantizer agrees with it; caught only by the
    independent NumPy oracle (kvspec.fuzz.quant_ref)."""

    quantize_rows = staticmethod(quantize_half_away)


# -- harness mutants: each caught only by one of the harness's cheaper
# -- checks (kvspec.fuzz.harness_mutants pairs them), so a weakened check misses it


class MaskWindowFromNewestQuery(KVCache):
    """A multi-row mask whose window is measured from the newest query for
    every row (``mask & (L - 1 < k + window_size)`` instead of ``q < k +
    window_size``): the last query's row is right, every earlier row of a
    prefill chunk sees too few keys (none at all with window 1). A decode
    step (one query) is unaffected. Caught only by the mask check comparing
    whole ``[N, L]`` matrices, never by one comparing the newest row."""

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        mask = super().make_mask(N, window_size, return_array)
        if not isinstance(mask, mx.array) or window_size is None:
            return mask
        L = self.live_len + N
        q = mx.arange(self.live_len, L)[:, None]
        k = mx.arange(L)[None]
        return (q >= k) & (L - 1 < k + window_size)


class Int8DequantizesInFloat16(KVCache):
    """The append's Int8 window dequantized in float16, the scale's dtype
    (``(fp16(q) * scale).astype(dtype)``), instead of the exact product
    rounded once to the rows' dtype: float16 rows are unchanged, but
    bfloat16 and float32 rows are rounded to float16 first (11 significant
    bits, then 8 for bfloat16: double rounding). The stored codes and
    scales are right, so the stored-codes check cannot see it; caught only
    by comparing the window with the independent oracle (kvspec.fuzz.quant_ref)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k, v = super().update_and_fetch(keys, values)
        b = self.buffers
        if self.mode != "int8" or b is None or b.key_scales is None or b.dtype == mx.float16:
            return k, v
        ix = slice(0, self.live_len)
        return tuple(  # type: ignore[return-value]
            (q[:, :, ix, :].astype(mx.float16) * s[:, :, ix, :]).astype(b.dtype)
            for q, s in ((b.keys, b.key_scales), (b.values, b.value_scales)))


def quantize_zero_scale(x: mx.array) -> tuple[mx.array, mx.array]:
    """kvspec.impl.quant.quantize_int8 with the zero-row guard on the codes instead
    of the scale: an all-zero row stores codes 0 (right) and scale 0 (the
    rule: 1). It decodes to the same zeros."""
    x16 = x.astype(mx.float16)
    scale = mx.max(mx.abs(x16), axis=-1, keepdims=True) / 127
    q = mx.where(scale == 0, 0, mx.clip(mx.round(x16 / mx.where(scale == 0, 1, scale)), -128, 127))
    return q.astype(mx.int8), scale.astype(mx.float16)


class Int8ZeroRowScaleZero(KVCache):
    """A zero row's scale stored as 0 instead of 1: every window is right
    (0 * 0 = 0), but the stored scales, what ``state`` saves to a
    prompt-cache file and hands other engines, break the rule. Caught only
    by the stored-codes check (the expected codes and scales quantized by
    kvspec.fuzz.quant_ref from the rows' host values)."""

    quantize_rows = staticmethod(quantize_zero_scale)


class Int8ZeroValueRowScaleZero(KVCache):
    """The values' twin of :class:`Int8ZeroRowScaleZero`: an all-zero V row's
    scale stored as 0 (the keys keep the rule's 1). Every window is right;
    only a stored-codes check that compares the values' codes and scales
    as well as the keys' sees it (breaker sweep: a check narrowed to the
    keys passed the keys-side bug)."""

    def _encode(self, keys: mx.array, values: mx.array) -> Any:
        b = super()._encode(keys, values)
        if self.mode != "int8":
            return b
        vq, vs = quantize_zero_scale(values)
        return type(b)(b.keys, vq, b.key_scales, vs, b.out_dtype)


class PairRowsTruncated(KVCache):
    """A K/V pair whose values carry more rows than its keys is taken, the
    values cut to the keys' rows, instead of refused (the pair's own
    agreement on S is not checked; a cache compares each array with its
    buffer only on batch, heads and head dim, so rows of another S never
    fail that check)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if (isinstance(keys, mx.array) and isinstance(values, mx.array) and keys.ndim == 4 and values.ndim == 4
                and values.shape[2] > keys.shape[2]):
            values = values[:, :, : keys.shape[2]]
        return super().update_and_fetch(keys, values)


class DequantizeUnclipped(KVCache):
    """The Int8 read-back without its float16 saturation (the clip dropped
    from the dequantizer): ``q * scale`` is rounded straight to float16, so
    a row whose largest value is 65504 (scale 516, q 127: 65532) comes back
    as inf. Only rows at float16's edge reach it."""

    def _unclipped(self, window: Any) -> Any:
        b = self.buffers
        if window is None or b is None or b.key_scales is None or b.dtype != mx.float16:
            return window
        ix = (slice(None), slice(None), slice(0, self.live_len))
        return tuple((q[ix].astype(mx.float32) * s[ix].astype(mx.float32)).astype(mx.float16)
                     for q, s in ((b.keys, b.key_scales), (b.values, b.value_scales)))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._unclipped(super().update_and_fetch(keys, values))

    def fetch(self) -> tuple[mx.array, mx.array] | None:
        return self._unclipped(super().fetch())


class Int8RangeByMagnitude(KVCache):
    """Int8's range decision as ``|x| <= 65504`` instead of "finite once cast
    to float16": float32 rows in (65504, 65520), which round to a finite
    65504, are refused (breaker sweep)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.mode == "int8":
            for name, a in (("keys", keys), ("values", values)):
                if isinstance(a, mx.array) and a.size and bool(mx.any(mx.abs(a.astype(mx.float32)) > 65504.0).item()):
                    raise InvalidArgumentError(f"append: {name} must be finite within float16's range "
                                               f"(|x| <= 65504) in mode int8")
        return super().update_and_fetch(keys, values)


# -- GPU-only: the CUDA write layer (kvspec.impl.write), run with --device gpu --------------
class KernelOrderedByDepends(KVCache):
    """The CUDA kernel write is not evaluated before the window is returned;
    the window is made to depend on the kernel's token with ``mx.depends``
    instead. MLX's CUDA backend records the kernel as a reader of the buffer,
    so a device read of the window gets no edge to the kernel and can run
    before the row is written."""

    def _write_inplace(self, at: int, rows: _Buffers) -> None:
        assert self.buffers is not None
        tokens = []
        for dst, src in zip(self.buffers.arrays(), rows.arrays()):
            mx.eval(dst)
            start = [0, 0, at, 0]
            tokens.append(kvwrite.kernel_write(dst, src.astype(dst.dtype), start))
        self._pending = tokens

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._pending: list[mx.array] = []
        k, v = super().update_and_fetch(keys, values)
        if self._pending:
            k, v = mx.depends([k, v], self._pending)
        return k, v


class KernelRowOff(KVCache):
    """The CUDA kernel write lands one row past the decode row (an
    off-by-one in the start it is given; the row before it when there is no
    room), and the decode row keeps whatever it held."""

    def _write_inplace(self, at: int, rows: _Buffers) -> None:
        assert self.buffers is not None
        for dst, src in zip(self.buffers.arrays(), rows.arrays()):
            where = at + 1 if at + 1 < dst.shape[SEQ_AXIS] else at - 1
            mx.eval(dst, src)
            mx.eval(kvwrite.kernel_write(dst, src.astype(dst.dtype), [0, 0, where, 0]))


class KernelWriteWhereCopy(KVCache):
    """The copying write is routed through the CUDA kernel straight into the
    current buffers whenever they have room: a write the ownership rule says
    must copy (after a trim, a restore, beside a snapshot that sees the row)
    lands in memory another holder reads."""

    def _write_copy(self, at: int, rows: _Buffers) -> None:
        assert self.buffers is not None
        if self.mode != "fp16":
            return super()._write_copy(at, rows)
        for dst, src in zip(self.buffers.arrays(), rows.arrays()):
            kvwrite.write_inplace_kernel(dst, src, kvwrite.seq_index(at, src.shape[SEQ_AXIS]))


# -- the cache's life outside the decode loop: each caught only by the
# -- op named (copy, install of a consumed handle, append_mismatch, reload)


class DeepcopyKeepsMarker(KVCache):
    """``copy.deepcopy`` copies every field, the ownership marker included
    (the default deep copy): the copy's marker names its own (deep-copied)
    buffer handles, which alias the original's memory, so the copy passes
    the ownership rule and writes its decode rows in place into memory the
    original (mlx-lm's ``LRUPromptCache`` entry) still holds."""

    def __deepcopy__(self, memo: dict) -> KVCache:
        new = type(self).__new__(type(self))
        new.__dict__.update(copy.deepcopy(dict(self.__dict__), memo))
        return new


class InstallKeepsHandle(KVCache):
    """``install`` adopts the handle's buffers but neither empties the
    handle nor marks it consumed: the same handle installs again (into this
    cache once emptied, or another), a second owner of one buffer."""

    def install(self, handle: Any) -> None:
        if not isinstance(handle, DetachedHandle):
            raise InvalidArgumentError(f"install: expected a DetachedHandle, got {type(handle).__name__}")
        if not self.empty() or self.offset != 0:
            raise StateError(f"install: requires an empty cache, got offset={self.offset}, live_len={self.live_len}")
        self._check_holder("install", handle)
        self._adopt(handle)


class AppendBatchUnchecked(KVCache):
    """The append's shape check compares kv heads and head dims with the
    cached rows but not the batch: rows of another batch reach the write,
    which fails deep in MLX (or broadcasts) instead of a clear refusal."""

    def _check_compatible(self, op: str, keys: mx.array, values: mx.array) -> None:
        if self.buffers is None:
            return
        for name, have, new in (("keys", self.buffers.keys, keys), ("values", self.buffers.values, values)):
            if have.shape[1] != new.shape[1] or have.shape[3] != new.shape[3]:
                raise InvalidArgumentError(f"{op}: {name} must match the cache's heads and head dim")
        if self.buffers.dtype != keys.dtype:
            raise InvalidArgumentError(f"{op}: dtype must be {self.buffers.dtype} (the cache's rows), got {keys.dtype}")


class PairDtypeCast(KVCache):
    """An append whose values' dtype is not the keys' casts the values to the
    keys' dtype instead of refusing the pair: the compatibility check then
    compares the keys' dtype with the cache's and passes, and the values are
    stored cast (a cast changes the model's output)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if isinstance(keys, mx.array) and isinstance(values, mx.array) and keys.dtype != values.dtype:
            values = values.astype(keys.dtype)
        return super().update_and_fetch(keys, values)


BUGS: tuple[InjectedBug, ...] = (
    InjectedBug(
        "inplace_after_trim", "semantics.md 2, ownership rule (live_len == marker.live_len)",
        "dense in-place write rule (speculative-decoding rollback)", "dense", ("fp16",), "KVCache._inplace_write_allowed",
        "in-place decode write after a logical trim overwrites a row a snapshot still sees",
        {"dense": InplaceAfterTrim},
    ),
    InjectedBug(
        "inplace_after_restore", "semantics.md 2, restore (no ownership marker)",
        "dense in-place write rule (buffers the cache did not produce)", "dense", ("fp16",), "KVCache._adopt",
        "restore adopts a marker for shared buffers; the next decode writes into them",
        {"dense": InplaceAfterRestore},
    ),
    InjectedBug(
        "physical_trim_fp16", "semantics.md 2, trim is logical (Fp16/Int8 move counters only; #1209)",
        "public fix #1209", "dense", ("fp16", "int8"), "KVCache.trim",
        "trim re-slices the buffers: values right, capacity lost", {"dense": PhysicalTrimFp16},
    ),
    InjectedBug(
        "old_regrow_guard", "semantics.md 2, append: how much (cut the buffer to [0, prev) before growing)",
        "public fix #1209, the regression it fixed", "dense", ("fp16", "int8"), "KVCache._grow",
        "growth after a logical trim keeps the stale tail (cut only when prev % step != 0)",
        {"dense": OldRegrowGuard},
    ),
    InjectedBug(
        "int8_front_trim_scales", "semantics.md 2, front trim (Int8 scales move with their rows)",
        "sliding-window eviction with sinks", "dense", ("int8",), "KVCache.trim_front_keep_sink",
        "front trim leaves the scale sidecars behind", {"dense": Int8FrontTrimForgetsScales},
    ),
    InjectedBug(
        "int8_writes_in_place", "semantics.md 2, ownership rule (Fp16 only)",
        "dense in-place write rule", "dense", ("int8",), "KVCache._inplace_write_allowed",
        "Int8 decode rows go in place", {"dense": Int8WritesInPlace},
    ),
    InjectedBug(
        "inplace_switch_ignored", "semantics.md 2, the switch (KV_INPLACE_WRITE)",
        "the switch restores the copying path everywhere", "dense", ("fp16",),
        "KVCache._inplace_write_allowed", "the in-place switch is ignored", {"dense": InplaceSwitchIgnored},
        inplace=False,
    ),
    InjectedBug(
        "negative_trim_grows_offset", "semantics.md 2, trim(n) (n = clamp(n, 0, live_len))",
        "mlx-lm KVCache.trim (semantics.md 6)", "dense", ("fp16", "int8"), "KVCache.trim",
        "a negative trim grows the offset", {"dense": NegativeTrimGrowsOffset},
    ),
    InjectedBug(
        "front_trim_rewinds_offset", "semantics.md 2, front trim (the offset never decreases)",
        "sliding-window eviction with sinks (RoPE positions)", "dense", ("fp16", "int8"),
        "KVCache.trim_front_keep_sink", "front trim moves the offset back", {"dense": FrontTrimRewindsOffset},
    ),
    InjectedBug(
        "trim_to_zero_keeps_buffers", "semantics.md 2, trim(n) (at live_len 0 every buffer is dropped)",
        "dense trim family", "dense", ("fp16", "int8"), "KVCache._drop_if_empty",
        "buffers survive a trim to zero rows", {"dense": TrimToZeroKeepsBuffers},
    ),
    InjectedBug(
        "dense_mask_ignores_window", "kvspec.spec.dense.dense_mask_visible (a window binds on a decode step)",
        "a dense cache serving a windowed layer (masks)", "dense", ("fp16",), "KVCache.make_mask",
        "make_mask(1, window_size=w) returns None: every key visible", {"dense": MaskIgnoresWindow},
    ),
    InjectedBug(
        "snapshot_deep_copies", "semantics.md 5.4, cost contract: a snapshot shares the buffers (O(1))",
        "memory sharing", "dense", ("fp16", "int8"), "KVCache.snapshot",
        "the snapshot copies every buffer: same bytes, new memory", {"dense": SnapshotDeepCopies},
    ),
    InjectedBug(
        "fp16_casts_rows", "semantics.md 2, Storage (rows stored and returned in the incoming dtype)",
        "bf16 models decode differently with a float16 cache", "dense", ("fp16",), "KVCache._encode",
        "unquantized rows are cast to float16", {"dense": CastsToFloat16},
    ),
    InjectedBug(
        "env_switch_case_sensitive", "kvspec.spec.dense.inplace_switch (any case, blanks ignored)",
        "the in-place switch", "dense", ("fp16",), "kvspec.impl.dense.inplace_switch_from_env",
        "KV_INPLACE_WRITE=OFF (or ' no ') leaves in-place writes on", {"dense": EnvSwitchCaseSensitive},
    ),
    InjectedBug(
        "int8_round_half_away", "semantics.md 2, Storage (Int8: round half to even)",
        "quantizer oracle", "dense", ("int8",), "kvspec.impl.quant.quantize_int8",
        "the quantizer rounds ties away from zero", {"dense": QuantizerRoundsHalfAway},
    ),
    InjectedBug(
        "mask_window_from_newest_query", "kvspec.spec.dense.dense_mask_visible (query i's window ends at live_len + i)",
        "a multi-row mask that measures every row's window from the newest query (harness mutants)",
        "dense", ("fp16",), "KVCache.make_mask",
        "make_mask(N > 1, window_size=w): every row's window ends at the last query", {"dense": MaskWindowFromNewestQuery},
        inplace=False,  # the write path has no part in a mask (and no switch spelling to shrink)
    ),
    InjectedBug(
        "int8_dequantizes_in_float16", "semantics.md 2, Storage (Int8 reads back q * scale rounded once to the rows' dtype)",
        "a dequantizer computing in the scale's dtype (harness mutants)", "dense", ("int8",),
        "kvspec.impl.quant.dequantize_int8", "bfloat16 and float32 rows read back through float16 (rounded twice)",
        {"dense": Int8DequantizesInFloat16},
    ),
    InjectedBug(
        "int8_zero_row_scale_zero", "semantics.md 2, Storage (a zero row's scale is 1)",
        "a zero-row guard on the codes instead of the scale (harness mutants)", "dense", ("int8",),
        "kvspec.impl.quant.quantize_int8", "an all-zero row is stored with scale 0: same window, other stored bytes",
        {"dense": Int8ZeroRowScaleZero},
    ),
    InjectedBug(
        "int8_zero_value_row_scale_zero", "semantics.md 2, Storage (a zero row's scale is 1)",
        "the zero-row guard lost on the values' path only (breaker sweep)", "dense", ("int8",),
        "KVCache._encode", "an all-zero V row is stored with scale 0: same window, other stored value scales",
        {"dense": Int8ZeroValueRowScaleZero},
    ),
    InjectedBug(
        "gpu_kernel_ordered_by_depends", "semantics.md 5.1, window: a kernel write completes before any read of the window (the write layer's ordering rule)",
        "measured on MLX 0.32 CUDA: reads ordered by mx.depends missed the write 97-100% of the time", "dense", ("fp16",),
        "KVCache._write_inplace", "CUDA kernel write ordered only by mx.depends: a device read of the window can run first",
        {"dense": KernelOrderedByDepends}, device="gpu",
    ),
    InjectedBug(
        "gpu_kernel_row_off", "semantics.md 2, append: the write (rows land at [prev, prev + n))",
        "off-by-one in a device kernel's start", "dense", ("fp16",), "KVCache._write_inplace",
        "CUDA kernel write lands one row off the decode row", {"dense": KernelRowOff}, device="gpu",
    ),
    InjectedBug(
        "gpu_kernel_write_where_copy", "semantics.md 2, ownership rule (a copying write leaves shared buffers alone)",
        "in-place write where the ownership rule says copy, on the GPU", "dense", ("fp16",), "KVCache._write_copy",
        "CUDA kernel writes into shared buffers where the rule says copy", {"dense": KernelWriteWhereCopy},
        device="gpu",
    ),
    InjectedBug(
        "deepcopy_keeps_marker", "kvspec.spec.dense.w_copy (a copy shares the buffers and owns nothing)",
        "mlx-lm LRUPromptCache deep-copies a cached prompt on every fetch", "dense", ("fp16",),
        "KVCache.__deepcopy__", "a deep copy keeps the ownership marker and writes in place into the original's memory",
        {"dense": DeepcopyKeepsMarker},
    ),
    InjectedBug(
        "install_keeps_handle", "kvspec.spec.dense.w_install (a consumed handle is refused)",
        "prompt-cache stores that keep a handle after installing it", "dense", ("fp16", "int8"), "KVCache.install",
        "a consumed handle installs again", {"dense": InstallKeepsHandle},
    ),
    InjectedBug(
        "append_batch_unchecked", "kvspec.spec.dense.w_append_mismatch (rows match the cached [B, H, D] and dtype)",
        "batched serving: a request joins a cache of another batch", "dense", ("fp16",),
        "KVCache._check_compatible", "rows of another batch are not refused", {"dense": AppendBatchUnchecked},
    ),
    InjectedBug(
        "pair_rows_truncated", "kvspec.spec.dense.w_append_pair_mismatch (a K/V pair agrees with itself on dtype, B, H, S)",
        "a K/V pair that disagrees with itself, never driven by the fuzzer (breaker sweep)", "dense", ("fp16",),
        "KVCache.update_and_fetch", "values with more rows than the keys are cut to the keys' rows, not refused",
        {"dense": PairRowsTruncated},
    ),
    InjectedBug(
        "int8_dequantize_unclipped", "semantics.md 2, Storage (Int8 read-back saturated to +-65504 in float16)",
        "a fused dequantizer that lost its float16 clip (breaker sweep)", "dense", ("int8",),
        "kvspec.impl.quant.dequantize_int8", "the Int8 window is q * scale rounded to float16 without the saturation: "
        "a row at float16's edge reads back as inf",
        {"dense": DequantizeUnclipped},
    ),
    InjectedBug(
        "int8_range_by_magnitude", "semantics.md 2, Storage (Int8 refuses only rows not finite once cast to float16)",
        "a cheaper range test than the rule (breaker sweep)", "dense", ("int8",),
        "kvspec.impl.quant.int8_rows_flag", "float32 rows in (65504, 65520), finite once rounded to float16, are refused",
        {"dense": Int8RangeByMagnitude},
    ),
    InjectedBug(
        "pair_dtype_cast", "kvspec.spec.dense.w_append_mismatch (rows match the cached [B, H, D] and dtype)",
        "a K/V pair whose values' dtype differs from the keys' is cast, not refused", "dense", ("fp16",),
        "KVCache.update_and_fetch", "values of another dtype than the keys are cast to the keys' dtype",
        {"dense": PairDtypeCast},
    ),
)
