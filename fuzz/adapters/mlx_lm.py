"""mlx-lm's own caches (``mlx_lm.models.cache``) as targets of the target API
(docs/targets.md), registered in ``kvspec.fuzz.targets.BUILTIN``:

* ``mlx-lm``: by the trace's kind and mode, dense fp16 -> ``KVCache``,
  dense int8 -> ``QuantizedKVCache(group_size=32, bits=8)``, rotating fp16
  -> ``RotatingKVCache(max_size, keep)``. ``step`` (a class attribute, 256,
  in mlx-lm) is set per instance to the trace's step.
* ``mlx-lm-concat``: dense fp16 -> ``ConcatenateKVCache``.
* ``mlx-lm-guarded``: as ``mlx-lm``, but ``trim`` goes through
  ``trim_prompt_cache([cache], n)`` (the ``is_trimmable()`` guard that
  mlx-lm's generate and server use) instead of the ``trim(n)`` method.

An adapter presents an mlx-lm cache through the methods of the target API
(``update_and_fetch``, ``fetch``, ``trim``, ``snapshot``/``restore``,
``make_mask``, ``is_trimmable``, the ``state`` getter and setter and the
observables). ``snapshot`` is a deep copy (as mlx-lm's server copies a
prompt cache); ``state_snapshot`` keeps what ``state`` returns, uncopied. Everything mlx-lm does
differently *on purpose* is declared here, per class, and nowhere else: ops
the class does not have (``CacheClass.skipped``, with the reason) are never
generated for it and make a replay exit 2; observables with no contract in
mlx-lm (``CacheClass.not_compared``) are not compared; a cache field it
cannot take (the ring's ``undo``) makes a replay exit 2; the in-place
decision is never compared (mlx-lm has no ownership marker). Everything else
(windows, refusals by category, return values, offsets, cursors, masks, and
isolation of ``copy.deepcopy`` snapshots and held windows) is compared
exactly as for ``impl``, so a difference there is a finding.
docs/conformance.md lists the declared differences and the findings.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.fuzz.targets import CacheClass, Target, TargetError

#: Ops that exist only in this project's dense cache (semantics.md 2). mlx-lm's
#: caches have none of them; prompt-cache code computes n and calls trim(n).
_DENSE_ONLY = {
    "trim_to": "mlx-lm caches have no trim_to; prompt-cache code computes n and calls trim(n)",
    "trim_front": "no trim_front_keep_sink (sliding windows are RotatingKVCache's job)",
    "gather_positions": "no gather_positions (no tree-speculation rollback)",
    "gather_within_tail": "no gather_within_tail (no tree-speculation rollback)",
    "detach": "no detach/install handles (prompt caches are whole cache objects)",
    "install": "no detach/install handles (prompt caches are whole cache objects)",
    "handle_trim_to": "no detached handles",
}

#: mlx.core.quantize supports group sizes 32, 64 and 128 only, so the int8
#: target needs head_dim % 32 == 0; its machine draws these head dims.
QUANT_GROUP_SIZE = 32
QUANT_BITS = 8
QUANT_HEAD_DIMS = (32, 64)
#: mlx-lm's ring has no undo log: a trace with an undo depth cannot run there
NO_UNDO = {"undo": (0, "mlx-lm's RotatingKVCache has no undo log, so no trim after a wrap can be exact")}


# -- adapters ----------------------------------------------------------------


class DequantView:
    """One side (K or V) of a QuantizedKVCache window: the ``(w, scales,
    biases)`` tuple exactly as mlx-lm returned it, dequantized only when read,
    so a held window that aliases the cache's buffers shows the aliasing.

    A reader gets ``mx.dequantize`` of it in the scales' dtype (mlx-lm keeps
    scales and biases in the dtype of the rows it was given: float16,
    bfloat16 or float32): :attr:`kvtrace_dtype` names it, and ``numpy.asarray``
    gives its host form (``kvspec.fuzz.rows.host``: bfloat16 as the float32 of each
    value, exact; NumPy has no bfloat16)."""

    def __init__(self, parts: tuple[mx.array, ...], group_size: int, bits: int):
        self.parts, self.group_size, self.bits = parts, group_size, bits

    @property
    def kvtrace_dtype(self) -> str:
        """The kvtrace dtype name of the dequantized rows (the scales' dtype)."""
        return str(self.parts[1].dtype).rsplit(".", 1)[-1]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        from kvspec.fuzz.rows import host

        w = self.parts[0]
        if w.shape[-2] == 0:  # mx.dequantize cannot reshape an empty window
            head_dim = w.shape[-1] * 32 // self.bits  # each uint32 word packs 32 / bits values
            wide = self.parts[1].dtype in (mx.float32, mx.bfloat16)
            out = np.zeros((*w.shape[:-1], head_dim), dtype=np.float32 if wide else np.float16)
        else:
            out = host(mx.dequantize(*self.parts, group_size=self.group_size, bits=self.bits))
        return out if dtype is None else out.astype(dtype)


class MlxLmAdapter:
    """Base adapter around one mlx-lm cache object (``self.inner``).

    ``trim_via`` is ``"method"`` (call ``inner.trim(n)``, the protocol method
    semantics.md 6 lists and ``CacheList.trim`` calls unguarded) or
    ``"trim_prompt_cache"`` (mlx-lm's guarded helper: returns 0 unless
    ``is_trimmable()``).
    """

    live_start = 0  # no front trim in mlx-lm: slot 0 always holds position 0

    def __init__(self, cfg: dict[str, Any], trim_via: str = "method"):
        self.cfg, self.trim_via = cfg, trim_via
        self.inner = self.make(cfg)

    def make(self, cfg: dict[str, Any]) -> Any:
        raise NotImplementedError

    # -- observables -----------------------------------------------------------
    @property
    def offset(self) -> int:
        return int(self.inner.offset)

    @property
    def live_len(self) -> int:
        # mlx-lm's dense caches index their buffer by offset (no live_start).
        return int(self.inner.offset)

    @property
    def capacity(self) -> int:
        keys = self.inner.keys
        return 0 if keys is None else int(keys.shape[2])

    def is_trimmable(self) -> bool:
        return bool(self.inner.is_trimmable())

    # -- ops -------------------------------------------------------------------
    def wrap(self, window: Any) -> Any:
        """What a reader gets from mlx-lm's return value (identity for fp16)."""
        return window

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        return self.wrap(self.inner.update_and_fetch(keys, values))

    def fetch(self) -> Any:
        """The window a reader gets without writing: ``keys_and_values()``."""
        return self.window_of(self.inner)

    def window_of(self, inner: Any) -> Any:
        if inner.keys is None:
            return None
        return self.wrap(inner.keys_and_values())

    def trim(self, n: int) -> int:
        if self.trim_via == "trim_prompt_cache":
            from mlx_lm.models.cache import trim_prompt_cache

            return trim_prompt_cache([self.inner], n)
        return self.inner.trim(n)

    def snapshot(self) -> MlxLmSnapshot:
        """``copy.deepcopy``, as mlx-lm's server copies a prompt cache."""
        return MlxLmSnapshot(copy.deepcopy(self.inner), self)

    def restore(self, snapshot: MlxLmSnapshot) -> None:
        """The live cache becomes a deep copy of the snapshot, as the server's
        ``fetch_nearest_cache`` hands one out."""
        self.inner = copy.deepcopy(snapshot.inner)

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.make_mask(*args, **kwargs)

    def __copy__(self) -> MlxLmAdapter:
        """``copy.copy`` of the cache a program holds: a new adapter around
        ``copy.copy(inner)`` (mlx-lm's object, its arrays shared), never a
        second wrapper around the same mlx-lm object."""
        dup = object.__new__(type(self))
        dup.__dict__.update(self.__dict__)
        dup.inner = copy.copy(self.inner)
        return dup

    def kvspec_reload(self, via: str) -> MlxLmAdapter:
        """The kvtrace ``reload`` op as mlx-lm saves and loads a prompt cache
        (mlx-lm has no ``meta_state``: its ``state`` carries everything).
        ``file``: ``save_prompt_cache`` to a temporary ``.safetensors`` file,
        then ``load_prompt_cache`` (``Class.from_state(state)``); ``state``:
        ``inner.state = inner.state`` on the cache itself. The per-instance
        ``step`` (a harness setting, not mlx-lm state) is set again on the
        loaded object. Returns the adapter (itself, its ``inner`` replaced)."""
        if via == "state":
            self.inner.state = self.inner.state
            return self
        import tempfile
        from pathlib import Path

        from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "prompt.safetensors")
            save_prompt_cache(path, [self.inner])
            (loaded,) = load_prompt_cache(path)
        if "step" in type(self.inner).__dict__ or "step" in self.inner.__dict__:
            loaded.step = self.inner.step
        self.inner = loaded
        return self

    # -- the state protocol (kvtrace state_snapshot / state_restore) ------------
    @property
    def state(self) -> Any:
        """``inner.state`` exactly as mlx-lm returns it (no copy): what a
        program keeps as ``[c.state for c in cache]``."""
        return self.inner.state

    @state.setter
    def state(self, v: Any) -> None:
        """``inner.state = v``, as a program restores a kept prompt cache."""
        self.inner.state = v


@dataclass
class MlxLmSnapshot:
    """A deep copy of an mlx-lm cache; ``fetch`` reads it as the adapter does."""

    inner: Any
    adapter: MlxLmAdapter

    def fetch(self) -> Any:
        return self.adapter.window_of(self.inner)


def _with_step(cache: Any, step: int) -> Any:
    # step is a class attribute (256) in mlx-lm; small steps find the edges.
    cache.step = step
    return cache


class KVCacheAdapter(MlxLmAdapter):
    def make(self, cfg: dict[str, Any]) -> Any:
        from mlx_lm.models.cache import KVCache

        return _with_step(KVCache(), cfg["step"])


class ConcatenateKVCacheAdapter(MlxLmAdapter):
    def make(self, cfg: dict[str, Any]) -> Any:
        from mlx_lm.models.cache import ConcatenateKVCache

        return ConcatenateKVCache()


class QuantizedKVCacheAdapter(MlxLmAdapter):
    def make(self, cfg: dict[str, Any]) -> Any:
        from mlx_lm.models.cache import QuantizedKVCache

        return _with_step(QuantizedKVCache(group_size=QUANT_GROUP_SIZE, bits=QUANT_BITS), cfg["step"])

    @property
    def capacity(self) -> int:
        keys = self.inner.keys
        return 0 if keys is None else int(keys[0].shape[-2])

    def wrap(self, window: Any) -> Any:
        k, v = window
        return DequantView(k, QUANT_GROUP_SIZE, QUANT_BITS), DequantView(v, QUANT_GROUP_SIZE, QUANT_BITS)


class RotatingKVCacheAdapter(MlxLmAdapter):
    def make(self, cfg: dict[str, Any]) -> Any:
        from mlx_lm.models.cache import RotatingKVCache

        return _with_step(RotatingKVCache(max_size=cfg["max_size"], keep=cfg["keep"]), cfg["step"])

    @property
    def idx(self) -> int:
        return int(self.inner._idx)

    @property
    def keep(self) -> int:
        return int(self.inner.keep)

    @property
    def max_size(self) -> int:
        return int(self.inner.max_size)


# -- stored forms (what a reader must see for one row) -------------------------


def affine_int8_row(x: mx.array) -> mx.array:
    """QuantizedKVCache's storage: affine quantization per group of
    ``QUANT_GROUP_SIZE`` along head_dim, 8 bits, scale and bias in the rows'
    own dtype (``mx.quantize`` of the row as given: float16, bfloat16 or
    float32); a reader sees ``mx.dequantize`` of it, in that dtype.
    Quantization is per group, so a row quantized alone equals that row of
    a quantized block."""
    return mx.dequantize(*mx.quantize(x, group_size=QUANT_GROUP_SIZE, bits=QUANT_BITS),
                         group_size=QUANT_GROUP_SIZE, bits=QUANT_BITS)


# -- the classes and targets ------------------------------------------------------

#: why no target here compares the in-place decision
INPLACE_REASON = "mlx-lm has no ownership marker: whether a write went in place is not observable"

KVCACHE = CacheClass(
    "KVCache", "dense", "fp16", KVCacheAdapter, dict(_DENSE_ONLY), snapshot_class=MlxLmSnapshot, note="step set per instance to the trace's step",
)
QUANTIZED = CacheClass(
    "QuantizedKVCache", "dense", "int8", QuantizedKVCacheAdapter, dict(_DENSE_ONLY),
    stored_form=affine_int8_row, head_dims=QUANT_HEAD_DIMS, snapshot_class=MlxLmSnapshot,
    note=f"mode int8 means mlx-lm's affine {QUANT_BITS}-bit quantization, group_size={QUANT_GROUP_SIZE}, "
         "not the spec's symmetric per-row int8: expected rows are mx.dequantize(mx.quantize(row))",
)
CONCAT = CacheClass(
    "ConcatenateKVCache", "dense", "fp16", ConcatenateKVCacheAdapter, dict(_DENSE_ONLY),
    not_compared={"capacity": "no preallocation and no step: the buffer is whatever was concatenated"},
    snapshot_class=MlxLmSnapshot,
)
ROTATING = CacheClass(
    "RotatingKVCache", "rotating", "fp16", RotatingKVCacheAdapter,
    {"trim_to": _DENSE_ONLY["trim_to"]}, fields=dict(NO_UNDO), snapshot_class=MlxLmSnapshot, note="step set per instance to the trace's step",
)


def _guarded(c: CacheClass) -> CacheClass:
    return replace(c, factory=partial(c.factory, trim_via="trim_prompt_cache"))


_CLASSES = (KVCACHE, QUANTIZED, ROTATING)
MLX_LM = Target("mlx-lm", "mlx-lm's KVCache / QuantizedKVCache / RotatingKVCache", _CLASSES)
MLX_LM_CONCAT = Target("mlx-lm-concat", "mlx-lm's ConcatenateKVCache (dense fp16)", (CONCAT,))
MLX_LM_GUARDED = Target("mlx-lm-guarded", "as mlx-lm, trims through trim_prompt_cache (is_trimmable guard)",
                        tuple(_guarded(c) for c in _CLASSES))
TARGETS = {t.name: t for t in (MLX_LM, MLX_LM_CONCAT, MLX_LM_GUARDED)}


def target_of_class(name: str) -> Target:
    """The target that runs an mlx-lm class by name (``"ConcatenateKVCache"``
    -> ``mlx-lm-concat``). Raises TargetError."""
    for t in (MLX_LM, MLX_LM_CONCAT):
        if any(c.name == name for c in t.classes):
            return t
    raise TargetError(f"class: no target runs {name!r}")


def mlx_lm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx-lm")
    except PackageNotFoundError:  # pragma: no cover - mlx-lm is a dependency of the target
        return "unknown"
