"""Targets: which cache implementation the lockstep drives against the spec.

* ``impl`` (the default): this project's MLX caches (``impl/``).
* ``mlx-lm``: mlx-lm's own caches (``mlx_lm.models.cache``), chosen by the
  trace's kind and mode: dense fp16 -> ``KVCache``, dense int8 ->
  ``QuantizedKVCache(group_size=32, bits=8)``, rotating fp16 ->
  ``RotatingKVCache(max_size, keep)``. ``step`` (a class attribute, 256, in
  mlx-lm) is set per instance to the trace's step.
* ``mlx-lm-concat``: dense fp16 -> ``ConcatenateKVCache``.
* ``mlx-lm-guarded``: as ``mlx-lm``, but ``trim`` goes through
  ``trim_prompt_cache([cache], n)`` (the ``is_trimmable()`` guard that
  mlx-lm's generate and server use) instead of the ``trim(n)`` method.

An adapter presents an mlx-lm cache through the methods our lockstep drivers
call on ``self.cache`` (``update_and_fetch``, ``fetch``, ``trim``,
``snapshot``/``restore``, ``make_mask``, ``is_trimmable`` and the
observables). Everything mlx-lm does differently *on purpose* is declared
here, per class, and nowhere else: ops the class does not have
(:attr:`CacheClass.skipped`, with the reason) are never generated for it and
make a replay exit 2; observables with no contract in mlx-lm
(:attr:`CacheClass.not_compared`) are not compared; the in-place decision is
never compared (mlx-lm has no ownership marker). Everything else (windows,
refusals, return values, offsets, cursors, masks, and isolation of
``copy.deepcopy`` snapshots and held windows) is compared exactly as for
``impl``, so a difference there is a finding. docs/conformance.md lists the
declared differences and the findings.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import numpy as np

from fuzz import kinds
from fuzz.trace import TraceFormatError

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

#: Ops that need their family: excluding the first excludes the others too
#: (a restore of a snapshot that was never taken is meaningless).
OP_FAMILIES = {
    "snapshot": ("snapshot", "restore", "drop"),
    "hold": ("hold", "release_hold"),
    "detach": ("detach", "install", "handle_trim_to"),
}

#: mlx.core.quantize supports group sizes 32, 64 and 128 only, so the int8
#: target needs head_dim % 32 == 0; its machine draws these head dims.
QUANT_GROUP_SIZE = 32
QUANT_BITS = 8
QUANT_HEAD_DIMS = (32, 64)


def op_class(op: dict[str, Any]) -> str:
    """The class of an op the conformance search can exclude: its name, with
    appends split into decode (n = 1) and multi-row (n > 1), and trims by the
    sign of n. A partition of the op space, not a list of known faults."""
    name = op["op"]
    if name == "append":
        return "append n=1" if op["n"] == 1 else "append n>1"
    if name == "trim":
        n = op["n"]
        return "trim n<0" if n < 0 else "trim n=0" if n == 0 else "trim n>0"
    return name


# -- adapters ----------------------------------------------------------------


class DequantView:
    """One side (K or V) of a QuantizedKVCache window: the ``(w, scales,
    biases)`` tuple exactly as mlx-lm returned it, dequantized only when read,
    so a held window that aliases the cache's buffers shows the aliasing."""

    def __init__(self, parts: tuple[mx.array, ...], group_size: int, bits: int):
        self.parts, self.group_size, self.bits = parts, group_size, bits

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        w = self.parts[0]
        if w.shape[-2] == 0:  # mx.dequantize cannot reshape an empty window
            head_dim = w.shape[-1] * 32 // self.bits  # each uint32 word packs 32 / bits values
            out = np.zeros((*w.shape[:-1], head_dim), dtype=np.float16)
        else:
            out = np.asarray(mx.dequantize(*self.parts, group_size=self.group_size, bits=self.bits))
        return out if dtype is None else out.astype(dtype)


class MlxLmAdapter:
    """Base adapter around one mlx-lm cache object (``self.inner``).

    ``trim_via`` is ``"method"`` (call ``inner.trim(n)``, the protocol method
    semantics.md 6 lists and ``CacheList.trim`` calls unguarded) or
    ``"trim_prompt_cache"`` (mlx-lm's guarded helper: returns 0 unless
    ``is_trimmable()``).
    """

    #: mlx-lm has no ownership marker: whether a write went in place is not
    #: observable, so it is never compared (check_inplace is off).
    last_write_inplace = None
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
    ``QUANT_GROUP_SIZE`` along head_dim, 8 bits, float16 scale and bias
    (``mx.quantize``); a reader sees ``mx.dequantize`` of it. Quantization is
    per group, so a row quantized alone equals that row of a quantized block."""
    x = x.astype(mx.float16)
    return mx.dequantize(*mx.quantize(x, group_size=QUANT_GROUP_SIZE, bits=QUANT_BITS),
                         group_size=QUANT_GROUP_SIZE, bits=QUANT_BITS)


# -- the registry --------------------------------------------------------------


@dataclass(frozen=True)
class CacheClass:
    """One mlx-lm cache class standing in for a (kind, mode).

    ``skipped``: ops the class does not have, with the reason; never
    generated, refused by replay. ``not_compared``: observables with no
    contract in this class, with the reason. ``stored_form``: the bytes a
    reader must see for one row (None: float16 as written). ``head_dims``:
    the head dims its state machine draws (None: the default 8 and 16)."""

    name: str
    kind: str
    mode: str
    adapter: type[MlxLmAdapter]
    skipped: dict[str, str]
    not_compared: dict[str, str] = field(default_factory=dict)
    stored_form: Callable[[mx.array], mx.array] | None = None
    head_dims: tuple[int, ...] | None = None
    note: str = ""


#: why no target here compares the in-place decision
INPLACE_REASON = "mlx-lm has no ownership marker: whether a write went in place is not observable"

KVCACHE = CacheClass(
    "KVCache", "dense", "fp16", KVCacheAdapter, dict(_DENSE_ONLY),
    note="step set per instance to the trace's step",
)
QUANTIZED = CacheClass(
    "QuantizedKVCache", "dense", "int8", QuantizedKVCacheAdapter, dict(_DENSE_ONLY),
    stored_form=affine_int8_row, head_dims=QUANT_HEAD_DIMS,
    note=f"mode int8 means mlx-lm's affine {QUANT_BITS}-bit quantization, group_size={QUANT_GROUP_SIZE}, "
         "not the spec's symmetric per-row int8: expected rows are mx.dequantize(mx.quantize(row))",
)
CONCAT = CacheClass(
    "ConcatenateKVCache", "dense", "fp16", ConcatenateKVCacheAdapter, dict(_DENSE_ONLY),
    not_compared={"capacity": "no preallocation and no step: the buffer is whatever was concatenated"},
)
ROTATING = CacheClass(
    "RotatingKVCache", "rotating", "fp16", RotatingKVCacheAdapter,
    {"trim_to": _DENSE_ONLY["trim_to"]},
    note="step set per instance to the trace's step",
)


@dataclass(frozen=True)
class Target:
    """A family of implementations plus what the conformance search has
    stopped looking at.

    ``classes`` is empty for ``impl``. ``excluded`` holds op classes
    (:func:`op_class`) or op names that are not generated; ``waived`` holds
    observables (or ``"masks"``) that are not compared. Both start empty; the
    conformance search adds to them after each finding."""

    name: str
    description: str
    classes: tuple[CacheClass, ...] = ()
    trim_via: str = "method"
    excluded: frozenset[str] = frozenset()
    waived: frozenset[str] = frozenset()

    @property
    def is_impl(self) -> bool:
        return not self.classes

    def cache_class(self, kind: str, mode: str) -> CacheClass | None:
        for c in self.classes:
            if (c.kind, c.mode) == (kind, mode):
                return c
        return None

    def require_class(self, cache: dict[str, Any]) -> CacheClass:
        """The class for a trace's cache. Raises TraceFormatError (replay exit
        2) when the target has none or the trace's sizes do not fit it."""
        kind, mode = cache["kind"], cache.get("mode", "fp16")
        c = self.cache_class(kind, mode)
        if c is None:
            have = ", ".join(f"{x.kind}/{x.mode} ({x.name})" for x in self.classes)
            raise TraceFormatError(f"field cache.kind/mode: target {self.name} has no class for {kind}/{mode}; it has {have}")
        if c.head_dims is not None and cache["head_dim"] % QUANT_GROUP_SIZE:
            raise TraceFormatError(
                f"field cache.head_dim: target {self.name} runs {kind}/{mode} on {c.name}(group_size="
                f"{QUANT_GROUP_SIZE}), which needs head_dim % {QUANT_GROUP_SIZE} == 0, got {cache['head_dim']}"
            )
        return c

    def skip_reason(self, cache: dict[str, Any], op: dict[str, Any]) -> str | None:
        """Why this target does not run ``op`` (None: it does)."""
        if op["op"] == "expect":
            return None
        if op["op"] in self.excluded or op_class(op) in self.excluded:
            return f"{op_class(op)} excluded after an earlier finding"
        if self.is_impl:
            return None
        c = self.cache_class(cache["kind"], cache.get("mode", "fp16"))
        if c is None:
            return f"target {self.name} has no class for {cache['kind']}/{cache.get('mode', 'fp16')}"
        reason = c.skipped.get(op["op"])
        return None if reason is None else f"{c.name}: {reason}"

    def excluding(self, name: str) -> Target:
        """This target with an op class (and its family) no longer generated."""
        return replace(self, excluded=self.excluded | set(OP_FAMILIES.get(name, (name,))))

    def waiving(self, what: str) -> Target:
        """This target with an observable (or ``"masks"``) no longer compared."""
        return replace(self, waived=self.waived | {what})

    def make_lockstep(self, cache: dict[str, Any]) -> Any:
        """The lockstep driver for this target's class of the trace's cache."""
        c = self.require_class(cache)
        return declared_lockstep(kinds.get(c.kind, c.mode).lockstep_class())(cache, c, self)

    def machine_base(self, kind: str, mode: str, base: type) -> type:
        """The state machine to subclass: ``base``, or one drawing the head
        dims the class needs."""
        c = None if self.is_impl else self.cache_class(kind, mode)
        if c is None or c.head_dims is None:
            return base
        return _machine_with_head_dims(base, c.head_dims)


_MLX_LM = (KVCACHE, QUANTIZED, ROTATING)
TARGETS: dict[str, Target] = {
    "impl": Target("impl", "this project's MLX caches (impl/)"),
    "mlx-lm": Target("mlx-lm", "mlx-lm's KVCache / QuantizedKVCache / RotatingKVCache", _MLX_LM),
    "mlx-lm-concat": Target("mlx-lm-concat", "mlx-lm's ConcatenateKVCache (dense fp16)", (CONCAT,)),
    "mlx-lm-guarded": Target("mlx-lm-guarded", "as mlx-lm, trims through trim_prompt_cache (is_trimmable guard)",
                             _MLX_LM, trim_via="trim_prompt_cache"),
}


def resolve(target: str | Target | None) -> Target:
    """A Target from its name (None: ``impl``). Raises KeyError naming the
    known targets."""
    if target is None:
        return TARGETS["impl"]
    if isinstance(target, Target):
        return target
    try:
        return TARGETS[target]
    except KeyError:
        raise KeyError(f"--target: unknown target {target!r}; known: {', '.join(TARGETS)}") from None


def target_of_class(name: str) -> Target:
    """The target that runs an mlx-lm class by name (``"ConcatenateKVCache"``
    -> ``mlx-lm-concat``)."""
    for t in (TARGETS["mlx-lm"], TARGETS["mlx-lm-concat"]):
        if any(c.name == name for c in t.classes):
            return t
    raise KeyError(f"class: no target runs {name!r}")


def mlx_lm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx-lm")
    except PackageNotFoundError:  # pragma: no cover - mlx-lm is a dependency of the target
        return "unknown"


# -- lockstep drivers ----------------------------------------------------------


class _Declared:
    """Mixin over a kind's lockstep driver: compare everything except what
    the class and target declare not comparable (``not_compared``,
    ``waived``) and the in-place decision."""

    cls: CacheClass
    target: Target
    #: mlx-lm's snapshots are deep copies (MlxLmSnapshot); it has no handles
    snapshot_class = MlxLmSnapshot
    handle_class = None

    def __init__(self, cache: dict[str, Any], cls: CacheClass, target: Target):
        self.cls, self.target = cls, target
        self.not_compared = set(cls.not_compared) | set(target.waived)
        super().__init__(cache, lambda **_: cls.adapter(cache, target.trim_via))  # type: ignore[call-arg]
        self.check_inplace = False

    def stored_form(self, x: mx.array, mode: str = "fp16") -> mx.array:
        if self.cls.stored_form is not None:
            return self.cls.stored_form(x)
        return x.astype(mx.float16)

    def spec_observables(self) -> dict[str, Any]:
        full = super().spec_observables()  # type: ignore[misc]
        return {k: v for k, v in full.items() if k not in self.not_compared}

    def check_op_checks(self, index: int, op: dict[str, Any], spec_out: Any) -> None:
        # A trace's own capacity claim is about a contract this target does
        # not have when capacity is not compared; the rest still applies.
        if "capacity" in op and "capacity" in self.not_compared:
            op = {k: v for k, v in op.items() if k != "capacity"}
        super().check_op_checks(index, op, spec_out)  # type: ignore[misc]

    def check_masks(self, op: dict[str, Any]) -> None:
        if "masks" not in self.not_compared:
            super().check_masks(op)  # type: ignore[misc]


_DECLARED: dict[type, type] = {}


def declared_lockstep(base: type) -> type:
    """``base`` (a kind's lockstep driver from the registry) run over an
    mlx-lm class: ``MlxLm<Base>(cache, cache_class, target)``."""
    if base not in _DECLARED:
        _DECLARED[base] = type(f"MlxLm{base.__name__}", (_Declared, base), {})
    return _DECLARED[base]


def _machine_with_head_dims(base: type, head_dims: tuple[int, ...]) -> type:
    """A dense machine drawing ``head_dims`` (QuantizedKVCache needs whole
    quantization groups)."""
    from hypothesis import strategies as st
    from hypothesis.stateful import initialize

    from fuzz.machine import KV_HEADS, SMALL_STEPS

    class WideHeadMachine(base):  # type: ignore[misc, valid-type]
        @initialize(step=SMALL_STEPS, head_dim=st.sampled_from(head_dims), kv_heads=KV_HEADS)
        def init(self, step: int, head_dim: int, kv_heads: int) -> None:
            self.setup(step=step, head_dim=head_dim, kv_heads=kv_heads)

    WideHeadMachine.__name__ = f"{base.__name__}_head{'_'.join(map(str, head_dims))}"
    return WideHeadMachine
