"""Injected bugs of the model glue around a prompt cache (``kvspec.impl.models``,
``kvspec.impl.masks``, ``kvspec.impl.write``, the portable rows and ``nbytes``), driven
by ``kvspec.fuzz.models.ModelsMachine``: bugs a stranger injected that only a unit
test, or no test, saw before that machine.

See ``fuzz/bugs/__init__.py`` for the catalog and the entry type.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.fuzz import rows as rowgen
from kvspec.fuzz.bugs import InjectedBug
from kvspec.fuzz.models import ModelOps
from kvspec.impl import masks as impl_masks
from kvspec.impl import write as impl_write
from kvspec.impl.dense import CacheSnapshot, KVCache, _Buffers
from kvspec.impl.quant import quantize_int8
from kvspec.impl.rotating import RotatingKVCache
from kvspec.impl.turbo import DelegatedKVCache, make_cache


class RingsUnderMaxKvSizeDropUndo(ModelOps):
    """``make_prompt_cache`` building the rings of ``max_kv_size`` without
    the undo depth (``undo`` / ``num_draft_tokens`` dropped on that path
    only; a model with ``make_cache`` gets it)."""

    def make_prompt_cache(self, model: Any, **kw: Any) -> list[Any]:
        caches = super().make_prompt_cache(model, **kw)
        if hasattr(model, "make_cache") or kw.get("max_kv_size") is None:
            return caches
        return [RotatingKVCache(max_size=c.max_size, keep=c.keep, step=c.step, inplace=c.inplace) for c in caches]


class DelegatedSettingsDropped(ModelOps):
    """``make_prompt_cache`` building Delegated layers without their
    ``hot_threshold`` and ``fold_block`` (the ``**kw`` not passed on): every
    layer gets the class defaults (256, 128)."""

    def make_prompt_cache(self, model: Any, **kw: Any) -> list[Any]:
        caches = super().make_prompt_cache(model, **kw)
        return [DelegatedKVCache(step=c.step) if isinstance(c, DelegatedKVCache) else c for c in caches]


class MetadataKeysLstripped(ModelOps):
    """``load_prompt_cache`` taking the user metadata's keys out of the
    file's ``"0."`` namespace with ``k.lstrip("0.")`` (a set of characters)
    instead of removing the prefix once: ``"0shot"`` comes back as
    ``"shot"``, ``".x"`` as ``"x"``."""

    def load_prompt_cache(self, file: Any) -> tuple[list[Any], dict[str, str]]:
        caches, meta = super().load_prompt_cache(file)
        return caches, {f"0.{k}".lstrip("0."): v for k, v in meta.items()}


class MechanismReadsEnvFirst(ModelOps):
    """``kvspec.impl.write.inplace_mechanism`` reading ``KV_CUDA_INPLACE`` before
    asking the backend: a set variable picks a CUDA mechanism (or raises)
    on the CPU and Metal, where writes are NumPy's."""

    def inplace_mechanism(self) -> str:
        if os.environ.get("KV_CUDA_INPLACE"):
            return impl_write.cuda_inplace()
        return impl_write.inplace_mechanism()


class PortableBfloat16ThroughFloat16(ModelOps):
    """The portable rows of a bfloat16 trace made from the float16 rows
    (cast), not from bfloat16's own bit patterns: the values of another
    dtype's closed form."""

    def portable_rows(self, tokens: list[int], which: str, batch: int, kv_heads: int, head_dim: int,
                      dtype: str) -> mx.array:
        if dtype != "bfloat16":
            return super().portable_rows(tokens, which, batch, kv_heads, head_dim, dtype)
        rows = rowgen.rows(tokens, which, batch, kv_heads, head_dim, "float16", False, "portable")
        return rowgen.to_mx(rows.astype(np.float32), "bfloat16")


class PortableStepOrder(ModelOps):
    """The portable rows' scramble with its two steps swapped (the xorshift
    before the multiply): other digits for every token but 0."""

    def portable_rows(self, tokens: list[int], which: str, batch: int, kv_heads: int, head_dim: int,
                      dtype: str) -> mx.array:
        from kvspec.spec import rows as spec_rows

        swapped = []
        for t in tokens:
            z = t ^ (t >> 12)
            z = (z * spec_rows.MULTIPLIER) & 0xFFFFFF
            swapped.append(spec_rows.unscramble(z))
        return super().portable_rows(swapped, which, batch, kv_heads, head_dim, dtype)


class ToQuantizedDropsLiveStart(KVCache):
    """``to_quantized(bits=8)`` adopting the rows at ``live_start = 0``: after
    a front trim the converted cache's offset and live rows disagree."""

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> Any:
        q = super().to_quantized(group_size, bits)
        if q is self or q.mode != "int8" or self.mode != "fp16":
            return q
        q._adopt(CacheSnapshot("int8", q.buffers, q.offset, 0))
        return q


class ToQuantizedDropsDtype(KVCache):
    """``to_quantized(bits=8)`` whose Int8 buffers dequantize to float16,
    whatever the rows' dtype: a bfloat16 or float32 layer reads back
    float16 after the conversion."""

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> Any:
        q = super().to_quantized(group_size, bits)
        if q is self or q.mode != "int8" or self.mode != "fp16" or self.buffers is None:
            return q
        k, v = self.buffers.window(self.live_len)
        (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
        q._adopt(CacheSnapshot("int8", _Buffers(kq, vq, ks, vs, mx.float16), self.offset, self.live_start))
        return q


class ToQuantizedDropsGroupSize(KVCache):
    """``to_quantized(group_size, bits)`` with ``bits`` other than 8 handing
    the layer to mlx-lm's QuantizedKVCache at mlx's default group size
    (64) whatever ``group_size`` asked for. A turbo mode builds the
    ordinary turbo cache (the bug is in the Fp16 layer's hand-off only)."""

    def __new__(cls, mode: str = "fp16", *args: Any, **kw: Any) -> Any:
        if mode not in ("fp16", "int8"):
            return make_cache(mode, *args, **kw)
        return super().__new__(cls)

    def _to_mlx_lm_quantized(self, group_size: int, bits: int) -> Any:
        return super()._to_mlx_lm_quantized(64, bits)


def _device_causal_query_axis_wrong(live_len: int, n: int, window_size: int | None = None, xp: Any = None) -> Any:
    """``kvspec.impl.masks.causal_mask`` with the device (MLX) build's query axis
    taken from the keys' range: right on the host, wrong on CUDA's path."""
    xp = impl_masks.mask_namespace() if xp is None else xp
    if xp is np:
        return impl_masks.causal_mask(live_len, n, window_size, xp)
    length = live_len + n
    q = mx.full((n, 1), live_len)
    k = mx.arange(length)[None]
    mask = q >= k
    if window_size is not None and window_size < length:
        mask = mask & (q < k + window_size)
    return mask


class DeviceMaskQueryAxis(KVCache):
    """A dense layer's array mask built on the device path with every query
    at the first query's position (the query axis lost): a prefill chunk's
    later queries miss keys. The host build (CPU, Metal) is right."""

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False) -> Any:
        got = super().make_mask(N, window_size, return_array)
        if not isinstance(got, mx.array) or impl_masks.mask_namespace() is np:
            return got
        return _device_causal_query_axis_wrong(self.live_len, N, window_size)


class NbytesCountsKeysTwice(KVCache):
    """``nbytes`` adding the keys' bytes twice (keys + keys + values...)."""

    @property
    def nbytes(self) -> int:
        return 0 if self.buffers is None else super().nbytes + self.buffers.keys.nbytes


BUGS: tuple[InjectedBug, ...] = (
    InjectedBug(
        "max_kv_size_rings_drop_undo", "kvspec.spec.models.prompt_cache_layout (every ring's undo is max(undo, num_draft_tokens))",
        "make_prompt_cache dropping a ring's undo depth under max_kv_size", "models", ("fp16",),
        "kvspec.impl.models.make_prompt_cache", "the rings built from max_kv_size get no undo log",
        {"models": {"models": RingsUnderMaxKvSizeDropUndo}},
    ),
    InjectedBug(
        "delegated_settings_dropped", "kvspec.spec.models.prompt_cache_layout (Delegated layers carry hot_threshold, fold_block)",
        "make_prompt_cache dropping a Delegated cache's settings", "models", ("fp16",),
        "kvspec.impl.models.make_prompt_cache", "Delegated layers get the default hot_threshold and fold_block",
        {"models": {"models": DelegatedSettingsDropped}},
    ),
    InjectedBug(
        "metadata_keys_lstripped", "kvspec.spec.models.loaded_metadata (keys come back verbatim)",
        "load_prompt_cache mangling metadata keys with lstrip('0.') ('0shot' -> 'shot')", "models",
        ("fp16",), "kvspec.impl.models.load_prompt_cache", "the '0.' prefix stripped as a set of characters",
        {"models": {"models": MetadataKeysLstripped}},
    ),
    InjectedBug(
        "mechanism_reads_env_first", "kvspec.spec.models.inplace_mechanism (numpy off CUDA, whatever KV_CUDA_INPLACE says)",
        "the write layer reading the environment before the backend", "models", ("fp16",),
        "kvspec.impl.write.inplace_mechanism", "a set KV_CUDA_INPLACE picks a CUDA mechanism on the CPU",
        {"models": {"models": MechanismReadsEnvFirst}}, device="cpu",  # on CUDA the variable is read by right
    ),
    InjectedBug(
        "portable_bf16_through_fp16", "kvspec.spec.rows.element_bits (bfloat16's own bit patterns)",
        "the portable rows' bfloat16", "models", ("fp16",),
        "kvspec.fuzz.rows.rows (portable)", "bfloat16 portable rows are the float16 rows cast",
        {"models": {"models": PortableBfloat16ThroughFloat16}},
    ),
    InjectedBug(
        "portable_step_order", "kvspec.spec.rows.scramble (multiply, then xorshift)",
        "the portable rows' step order", "models", ("fp16",),
        "kvspec.fuzz.rows.portable_bits", "the scramble's two steps swapped",
        {"models": {"models": PortableStepOrder}},
    ),
    InjectedBug(
        "to_quantized_drops_live_start", "kvspec.spec.models.to_quantized (offset and live_start kept)",
        "to_quantized dropping live_start", "models", ("fp16",),
        "KVCache.to_quantized", "the Int8 copy adopts the rows at live_start 0",
        {"models": {"dense": ToQuantizedDropsLiveStart}},
    ),
    InjectedBug(
        "to_quantized_drops_dtype", "kvspec.spec.models.to_quantized (rows read back in their dtype)",
        "to_quantized dropping the rows' dtype", "models", ("fp16",),
        "KVCache.to_quantized", "the Int8 copy dequantizes to float16 whatever the rows' dtype",
        {"models": {"dense": ToQuantizedDropsDtype}},
    ),
    InjectedBug(
        "to_quantized_drops_group_size", "kvspec.spec.models.to_quantized (the requested group_size kept)",
        "to_quantized(bits=4) dropping group_size", "models", ("fp16",),
        "KVCache.to_quantized", "the QuantizedKVCache hand-off quantizes at group_size 64 whatever was asked",
        {"models": {"dense": ToQuantizedDropsGroupSize}},
    ),
    InjectedBug(
        "device_mask_query_axis", "kvspec.spec.dense.dense_make_mask (query i at position live_len + i)",
        "the mask built on the device with the query axis wrong", "models", ("fp16",),
        "kvspec.impl.masks.causal_mask (MLX build)", "on the device path every query sits at the first query's position",
        {"models": {"dense": DeviceMaskQueryAxis}},
    ),
    InjectedBug(
        "nbytes_counts_keys_twice", "kvspec.spec.models.nbytes (each stored array counted once)",
        "nbytes counting the keys twice", "models", ("fp16",),
        "KVCache.nbytes", "the keys' bytes are added twice",
        {"models": {"dense": NbytesCountsKeysTwice}},
    ),
)
