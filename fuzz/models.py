"""The model-level machine: a prompt cache built by ``make_prompt_cache`` and
driven through the model glue and the file layer (docs/models.md).

The list itself runs every op of the ``layers`` kind (appends, atomic
trims, snapshots, reloads: :class:`kvspec.fuzz.layers.LayersLockstep`), always
built the way a model builds it (``kvspec.impl.models.make_prompt_cache``), and
after every op each layer's ``nbytes`` is compared with
``kvspec.spec.models.nbytes``. Its own ops are observations of the glue, each
compared with the pure rule of ``kvspec.spec.models`` (or the kind's spec):

* ``build_probe``: ``make_prompt_cache`` with other settings (a model with
  or without ``make_cache``, ``max_kv_size``, ``undo``,
  ``num_draft_tokens``, every mode, Delegated's ``hot_threshold`` and
  ``fold_block``): every layer's kind, mode, step, window, sinks, undo
  depth and Delegated settings (``kvspec.spec.models.prompt_cache_layout``);
* ``save_load``: the list saved with user metadata (keys drawn to include
  a leading ``"0"``, ``"."``, ``"0."``, non-ASCII and the empty string)
  and loaded back: the metadata (``kvspec.spec.models.loaded_metadata``), each
  loaded layer's window, offset and ``meta_state``;
* ``to_quantized``: ``to_quantized(group_size, bits)`` of one layer
  mid-stream, ``bits`` and ``group_size`` drawn from every value a layer
  takes and a few it refuses (the refusal's type; the layer unchanged):
  bits 8 gives the Int8 copy's mode, offset, live_start, step, switch,
  capacity, ``nbytes`` and rows in their dtype; other bits mlx-lm's
  QuantizedKVCache's group_size, bits, offset, live_start, step and
  dequantized rows in their dtype (``kvspec.spec.models.to_quantized``);
* ``mask``: one layer's ``make_mask(n, window_size, return_array=True)``
  built on the host or on the device path (``kvspec.impl.masks``' MLX build, the
  one CUDA runs) against the kind's spec mask, query length 1 and more;
* ``mechanism``: the write layer's ``inplace_mechanism`` under a
  ``KV_CUDA_INPLACE`` spelling (``kvspec.spec.models.inplace_mechanism``);
* ``rows``: the rows the harness hands in (portable rows, float16,
  bfloat16, float32) against ``kvspec.spec.rows.row_bits``, bit for bit, token
  by token in order.

Injected bugs (``fuzz/bugs/models.py``) replace one entry point of
:class:`ModelOps` or one method of a cache class.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from kvspec.fuzz import rows as rowgen
from kvspec.fuzz.layers import LayersLockstep, LayersMachine, LayoutModel, layer_patterns
from kvspec.fuzz.masks import mask_text
from kvspec.fuzz.trace import TraceFormatError
from kvspec.impl import masks as impl_masks
from kvspec.impl import models as impl_models
from kvspec.impl import write as impl_write
from kvspec.impl.dense import KVCache
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec import dense as sd
from kvspec.spec import models as sm
from kvspec.spec import rotating as sr
from kvspec.spec import rows as spec_rows

#: the ops of this kind beyond the ``layers`` kind's
MODEL_OPS = ("build_probe", "save_load", "to_quantized", "mask", "mechanism", "rows")
#: the rule each op's observation is compared with
RULES = {"build_probe": "kvspec.spec.models.prompt_cache_layout", "save_load": "kvspec.spec.models.loaded_metadata and the saved layers",
         "to_quantized": "kvspec.spec.models.to_quantized", "mask": "the layer kind's spec mask",
         "mechanism": "kvspec.spec.models.inplace_mechanism", "rows": "kvspec.spec.rows.row_bits"}
#: metadata keys a ``save_load`` draws from: the edges of the file's
#: ``"0."`` namespace prefix and of the safetensors header
METADATA_KEYS = ("0shot", "0.5", ".hidden", "00", "0.", ".", "", "name", "température", "模型", "0.0.x", "__kvspec")
METADATA_VALUES = ("", "0", "1.5", "x y", "ü", "{\"a\": 1}")
#: KV_CUDA_INPLACE spellings a ``mechanism`` op sets (None: unset)
MECHANISM_ENVS = (None, "", " ", "donate", "kernel", " Kernel ", "DONATE", "bogus", "0")
#: to_quantized's ``bits``: every value a dense layer takes (8 twice: Int8)
#: and three it refuses.
QUANT_BITS = st.sampled_from([*sm.QUANTIZED_BITS, 8, 4, 1, 7, 16])
#: to_quantized's ``group_size``: every value a dense layer takes and two it refuses.
QUANT_GROUP_SIZES = st.sampled_from([*sm.QUANTIZED_GROUP_SIZES, 32, 64, 16, 256])
#: The models machine's head dims: small ones and multiples of every group size.
MODEL_HEAD_DIMS = st.sampled_from([8, 16, 32, 64, 128])
#: modes a ``build_probe`` asks for
PROBE_MODES = ("fp16", "int8", "turbo4asym", "turbo4delegated")


class ModelOps:
    """The model glue's and file layer's entry points, as the machine calls
    them (an injected bug subclasses this and replaces one)."""

    def make_prompt_cache(self, model: Any, **kw: Any) -> list[Any]:
        return impl_models.make_prompt_cache(model, **kw)

    def save_prompt_cache(self, file: Any, caches: list[Any], metadata: dict[str, str]) -> None:
        impl_models.save_prompt_cache(file, caches, metadata)

    def load_prompt_cache(self, file: Any) -> tuple[list[Any], dict[str, str]]:
        return impl_models.load_prompt_cache(file, return_metadata=True)

    def inplace_mechanism(self) -> str:
        return impl_write.inplace_mechanism()

    def portable_rows(self, tokens: list[int], which: str, batch: int, kv_heads: int, head_dim: int,
                      dtype: str) -> mx.array:
        """The portable rows the harness hands a cache, as MLX arrays."""
        return rowgen.to_mx(rowgen.rows(tokens, which, batch, kv_heads, head_dim, dtype, False, "portable"), dtype)


class _Plain:
    """A model without ``make_cache``: ``n`` layers."""

    def __init__(self, n: int):
        self.layers = [None] * n


@contextmanager
def _env(name: str, value: str | None):
    saved = os.environ.get(name)
    try:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


@contextmanager
def _device_masks():
    """``kvspec.impl.masks`` builds in MLX, as on MLX's CUDA backend (the device
    path), while the default device stays where it is."""
    saved = impl_masks.mask_namespace
    impl_masks.mask_namespace = lambda: mx  # type: ignore[assignment]
    try:
        yield
    finally:
        impl_masks.mask_namespace = saved  # type: ignore[assignment]


def _settings(c: Any) -> tuple[Any, ...]:
    """A built layer as ``kvspec.spec.models.LayerSettings`` fields."""
    if isinstance(c, RotatingKVCache):
        return ("rotating", "fp16", c.step, c.max_size, c.keep, getattr(c, "undo", 0), None, None)
    return ("dense", c.mode, c.step, None, None, None, getattr(c, "hot_threshold", None),
            getattr(c, "fold_block", None))


def _spec_settings(s: sm.LayerSettings) -> tuple[Any, ...]:
    return (s.kind, s.mode, s.step, s.max_size, s.keep, s.undo, s.hot_threshold, s.fold_block)


class ModelsLockstep(LayersLockstep):
    """A ``make_prompt_cache`` list driven as :class:`LayersLockstep`
    drives it, plus the ops of :data:`MODEL_OPS` and every layer's
    ``nbytes``. ``factories``: ``"dense"`` / ``"rotating"`` layer classes,
    ``"layers"`` a ``kvspec.fuzz.layers.ListOps`` and ``"models"`` a
    :class:`ModelOps` (sub)class."""

    OWN_WORDED_OPS = LayersLockstep.OWN_WORDED_OPS | {"build_probe", "save_load", "to_quantized", "mechanism"}

    @classmethod
    def check_cache(cls, cache: dict[str, Any]) -> None:
        if cache.get("build", "make_prompt_cache") != "make_prompt_cache":
            raise TraceFormatError("field cache.build: a models cache is built by make_prompt_cache, "
                                   f"got {cache.get('build')!r}")
        super().check_cache(cache)

    def __init__(self, cache: dict[str, Any], factories: dict[str, Any] | None = None):
        cache = {**cache, "build": "make_prompt_cache"}
        super().__init__(cache, factories)
        self.model_ops: ModelOps = (factories or {}).get("models", ModelOps)()
        self.dense_cls = (factories or {}).get("dense", KVCache)
        self.bug_classes = {k: v for k, v in (factories or {}).items() if k in ("dense", "rotating")}

    # -- the spec side ---------------------------------------------------------
    def spec_apply(self, op: dict[str, Any]) -> tuple[Any, Any]:
        name = op["op"]
        if name not in MODEL_OPS:
            return super().spec_apply(op)
        return getattr(self, f"_spec_{name}")(op), self.world

    def _layer_index(self, op: dict[str, Any]) -> int:
        j = op.get("layer")
        if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < len(self.caches):
            raise TraceFormatError(f"{op['op']}: layer must be an integer in [0, {len(self.caches)}), got {j!r}")
        return j

    def _spec_build_probe(self, op: dict[str, Any]) -> Any:
        layout = op.get("layout")
        for j, layer in enumerate(layout or ()):
            ok = isinstance(layer, dict) and (
                layer == {"kind": "dense"}
                or (layer.get("kind") == "rotating" and set(layer) <= {"kind", "max_size", "keep"}
                    and all(isinstance(layer.get(k, 0), int) and not isinstance(layer.get(k, 0), bool)
                            for k in ("max_size", "keep"))
                    and 0 <= layer.get("keep", 0) < layer.get("max_size", 0)))
            if not ok:
                raise TraceFormatError(f"build_probe: layout.{j} must be {{'kind': 'dense'}} or {{'kind': 'rotating', "
                                       f"'max_size': W, 'keep': K}} with 0 <= K < W, got {layer!r}")
        spec_layout = None if layout is None else tuple(
            ("dense", 0, 0) if layer["kind"] == "dense" else ("rotating", layer["max_size"], layer.get("keep", 0))
            for layer in layout)
        got = sm.prompt_cache_layout(spec_layout, op.get("n_layers", 1), op["mode"], op.get("step", 256),
                                     op.get("max_kv_size"), op.get("undo", 0), op.get("num_draft_tokens", 0),
                                     op.get("hot_threshold", 256), op.get("fold_block", 128))
        return [_spec_settings(s) for s in got]

    def _spec_save_load(self, op: dict[str, Any]) -> Any:
        meta = sm.loaded_metadata(op.get("metadata", {}))
        layers = [self._spec_layer_view(j) for j in range(len(self.caches))]
        return {"metadata": meta, "layers": layers}

    def _spec_layer_view(self, j: int) -> tuple[Any, ...]:
        c = self.world.layers[j].cache
        return (c.offset, c.window())

    def _quant_args(self, op: dict[str, Any]) -> tuple[int, int]:
        bits, group_size = op.get("bits", 8), op.get("group_size", 64)
        for name, x in (("bits", bits), ("group_size", group_size)):
            if isinstance(x, bool) or not isinstance(x, int):
                raise TraceFormatError(f"to_quantized: {name} must be an integer, got {x!r}")
        return bits, group_size

    def _spec_to_quantized(self, op: dict[str, Any]) -> Any:
        j = self._layer_index(op)
        bits, group_size = self._quant_args(op)
        w = self.world.layers[j]
        c = w.cache
        kind = "dense" if isinstance(w, sd.DenseWorld) else "rotating"
        mode = c.mode.value if hasattr(c.mode, "value") else str(c.mode)
        tokens = list(c.window())
        k, v = self.host_rows(tokens) if tokens else (np.zeros(1), np.zeros(1))
        finite = bool(np.isfinite(k).all() and np.isfinite(v).all()
                      and max(np.abs(k).max(initial=0), np.abs(v).max(initial=0)) <= 65504.0)
        b, h, dk, dv = self.shape
        q = sm.to_quantized(kind, mode, c.offset, getattr(c, "live_start", 0), c.step, self.spec_inplace(),
                            self.dtype, finite, bits=bits, group_size=group_size, head_dims=(dk, dv))
        if q is None:
            return "itself"
        if isinstance(q, sm.AffineQuantized):
            return {"mode": q.mode, "group_size": q.group_size, "bits": q.bits, "offset": q.offset,
                    "live_start": q.live_start, "step": q.step, "dtype": q.dtype, "window": tuple(tokens)}
        return {"mode": q.mode, "offset": q.offset, "live_start": q.live_start, "step": q.step,
                "inplace": q.inplace, "dtype": q.dtype, "capacity": q.capacity,
                "nbytes": sm.nbytes("int8", q.capacity, b, h, dk, dv, self.dtype), "window": tuple(tokens)}

    def _spec_mask(self, op: dict[str, Any]) -> Any:
        j = self._layer_index(op)
        n, window = op["n"], op.get("window")
        w = self.world.layers[j]
        if isinstance(w, sd.DenseWorld):
            rows = sd.dense_make_mask(w.cache.live_len, n, window)
        else:
            rows = sr.make_masks_spec(w.cache, n, (window,))[0]
        return mask_text(rows)

    def _spec_mechanism(self, op: dict[str, Any]) -> Any:
        return sm.inplace_mechanism(impl_write.backend(), op.get("env"))

    def _spec_rows(self, op: dict[str, Any]) -> Any:
        b, h, dk, dv = self.shape
        if self.cfg.get("rows") != "portable":
            raise TraceFormatError("rows: the op checks portable rows: the trace's cache needs \"rows\": \"portable\"")
        bad = [t for t in op["tokens"] if not 0 <= t < spec_rows.TOKEN_LIMIT]
        if bad:
            raise TraceFormatError(f"rows: tokens must lie in [0, {spec_rows.TOKEN_LIMIT}), got {bad[0]}")
        out = []
        for t in op["tokens"]:
            out.append((spec_rows.row_bits(t, 0, b, h, dk, self.dtype), spec_rows.row_bits(t, 1, b, h, dv, self.dtype)))
        return out

    # -- the implementation side -------------------------------------------------
    def impl_apply(self, op: dict[str, Any]) -> Any:
        name = op["op"]
        if name not in MODEL_OPS:
            return super().impl_apply(op)
        return getattr(self, f"_impl_{name}")(op)

    def _impl_build_probe(self, op: dict[str, Any]) -> Any:
        layout = op.get("layout")
        model = _Plain(op.get("n_layers", 1)) if layout is None else LayoutModel(layout)
        kw = {k: op[k] for k in ("max_kv_size", "undo", "num_draft_tokens", "step") if k in op}
        if op["mode"] in sm.DELEGATED_MODES:
            kw.update({k: op[k] for k in ("hot_threshold", "fold_block") if k in op})
        caches = self.model_ops.make_prompt_cache(model, mode=op["mode"], inplace=self.spec_inplace(),
                                                  classes=self.bug_classes or None, **kw)
        return [_settings(c) for c in caches]

    def _impl_save_load(self, op: dict[str, Any]) -> Any:
        added = {type(c).__name__: type(c) for c in self.caches if type(c).__name__ not in impl_models._CLASSES}
        impl_models._CLASSES.update(added)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "prompt.safetensors"
                self.model_ops.save_prompt_cache(path, list(self.caches), dict(op.get("metadata", {})))
                loaded, meta = self.model_ops.load_prompt_cache(path)
        finally:
            for k in added:
                impl_models._CLASSES.pop(k, None)
        layers = []
        for j, (c, mine) in enumerate(zip(loaded, self.caches)):
            tokens = self.world.layers[j].cache.window()
            same = self.window_matches(tokens, c.fetch(), self.layer_mode(j)) and c.meta_state == mine.meta_state
            layers.append((c.offset, tokens if same else self.identify(c.fetch(), self.layer_mode(j))))
        return {"metadata": dict(meta), "layers": layers}

    def _impl_to_quantized(self, op: dict[str, Any]) -> Any:
        j = self._layer_index(op)
        bits, group_size = self._quant_args(op)
        c = self.caches[j]
        with warnings.catch_warnings():  # a ring's (or Int8 layer's) once-per-cache notice that it stays itself
            warnings.simplefilter("ignore", UserWarning)
            q = c.to_quantized(group_size=group_size, bits=bits)
        if q is c:
            return "itself"
        tokens = tuple(self.world.layers[j].cache.window())
        if not hasattr(q, "fetch"):  # mlx-lm's QuantizedKVCache (affine group storage)
            return self._affine_view(q, tokens, group_size, bits)
        arrays = q.fetch()
        dtype = rowgen.dtype_name(arrays[0]) if arrays is not None else self.dtype
        window = tokens if self.window_matches(tokens, arrays, "int8") else tuple(self.identify(arrays, "int8"))
        return {"mode": q.mode, "offset": q.offset, "live_start": q.live_start, "step": q.step,
                "inplace": q.inplace, "dtype": dtype, "capacity": q.capacity, "nbytes": q.nbytes, "window": window}

    def _affine_view(self, q: Any, tokens: tuple[int, ...], group_size: int, bits: int) -> Any:
        """mlx-lm's QuantizedKVCache as the spec's AffineQuantized: its own
        group_size, bits, offset and step; live_start the offset less the rows
        it holds; its rows dequantized with its own group_size and bits,
        named by ``tokens`` when they equal the round trip
        ``dequantize(quantize(rows, group_size, bits))`` of the live rows
        under the requested ``group_size`` and ``bits``, else described."""
        gs, qb = getattr(q, "group_size", None), getattr(q, "bits", None)
        out: dict[str, Any] = {"mode": "affine" if type(q).__name__ == "QuantizedKVCache" else type(q).__name__,
                               "group_size": gs, "bits": qb, "offset": q.offset}
        if q.keys is None:
            out.update(live_start=q.offset, step=q.step, dtype=self.dtype, window=())
            return out
        got = [mx.dequantize(*q.keys, group_size=gs, bits=qb), mx.dequantize(*q.values, group_size=gs, bits=qb)]
        out.update(live_start=q.offset - int(got[0].shape[2]), step=q.step, dtype=rowgen.dtype_name(got[0]))
        want = [mx.dequantize(*mx.quantize(a, group_size=group_size, bits=bits), group_size=group_size, bits=bits)
                for a in self.input_rows(list(tokens))] if tokens else []
        same = len(want) == 2 and all(g.shape == w.shape and g.dtype == w.dtype
                                      and np.array_equal(self.host(g), self.host(w)) for g, w in zip(got, want))
        out["window"] = tokens if same else f"rows {[tuple(a.shape) for a in got]} differ from the round trip"
        return out

    def _impl_mask(self, op: dict[str, Any]) -> Any:
        j = self._layer_index(op)
        n, window = op["n"], op.get("window")
        c = self.caches[j]
        kwargs = {"return_array": True, **({} if window is None else {"window_size": window})}
        if op.get("device"):
            with _device_masks():
                mask = c.make_mask(n, **kwargs)
        else:
            mask = c.make_mask(n, **kwargs)
        if not isinstance(mask, mx.array) or mask.dtype != mx.bool_ or mask.ndim != 2 or mask.shape[0] != n:
            return f"not a bool [{n}, L] array: {mask!r}"
        return mask_text(np.array(mask).tolist())

    def _impl_mechanism(self, op: dict[str, Any]) -> Any:
        with _env("KV_CUDA_INPLACE", op.get("env")):
            return self.model_ops.inplace_mechanism()

    def _impl_rows(self, op: dict[str, Any]) -> Any:
        b, h, dk, dv = self.shape
        out = []
        for t in op["tokens"]:
            pair = []
            for which, d in (("k", dk), ("v", dv)):
                a = self.model_ops.portable_rows([t], which, b, h, d, self.dtype)
                if rowgen.dtype_name(a) != self.dtype or tuple(a.shape) != (b, h, 1, d):
                    pair.append(f"{rowgen.dtype_name(a)} {tuple(a.shape)}")
                    continue
                bits = a.view(mx.uint32 if self.dtype == "float32" else mx.uint16)
                pair.append([int(x) for x in np.array(bits).reshape(-1)])
            out.append(tuple(pair))
        return out

    def compare_result(self, index: int, op: dict[str, Any], s: Any, i: Any) -> None:
        if op["op"] in MODEL_OPS:
            self.reached(f"{op['op']} checked")
            if s != i:
                from kvspec.fuzz.lockstep import Divergence

                raise Divergence(index, op, f"{op['op']}: differs from {RULES[op['op']]}", s, i)
            return
        super().compare_result(index, op, s, i)

    # -- nbytes, after every op ---------------------------------------------------
    def spec_observables(self) -> dict[str, Any]:
        out = super().spec_observables()
        b, h, dk, dv = self.shape
        for j, w in enumerate(self.world.layers):
            mode = self.layer_mode(j)
            out[f"layer {j} nbytes"] = sm.nbytes(mode, w.cache.capacity, b, h, dk, dv, self.dtype)
        return out

    def impl_observables(self) -> dict[str, Any]:
        out = super().impl_observables()
        for j, c in enumerate(self.caches):
            out[f"layer {j} nbytes"] = c.nbytes
        return out


class ModelsMachine(LayersMachine):
    """The ``layers`` machine's rules on a list ``make_prompt_cache`` built
    (portable rows half the time, in float16, bfloat16 or float32), plus
    one rule per op of :data:`MODEL_OPS`."""

    kind = "models"

    @initialize(layers=layer_patterns(), data=st.data())
    def init(self, layers: list[dict[str, Any]], data: st.DataObject) -> None:
        layers = [{k: v for k, v in layer.items() if k not in ("mode", "step", "undo")} for layer in layers]
        extra: dict[str, Any] = {"build": "make_prompt_cache", "step": data.draw(st.integers(1, 8), label="step"),
                                 "num_draft_tokens": data.draw(st.integers(0, 3), label="num_draft_tokens")}
        if data.draw(st.booleans(), label="portable"):
            extra["rows"] = "portable"
        self.setup(layers=layers, **extra, **self.draw_shape(data, head_dims=MODEL_HEAD_DIMS))

    @rule(data=st.data())
    def build_probe(self, data: st.DataObject) -> None:
        """``make_prompt_cache`` with other settings than the live list's."""
        mode = data.draw(st.sampled_from(PROBE_MODES), label="mode")
        op: dict[str, Any] = {"op": "build_probe", "mode": mode, "step": data.draw(st.integers(1, 8), label="step")}
        if data.draw(st.booleans(), label="has make_cache"):
            op["layout"] = self.cfg["layers"]
        else:
            op["n_layers"] = data.draw(st.integers(1, 2), label="n_layers")
            if data.draw(st.booleans(), label="max_kv_size?"):
                op["max_kv_size"] = data.draw(st.integers(5, 8), label="max_kv_size")
        for key, top in (("undo", 3), ("num_draft_tokens", 3)):
            if data.draw(st.booleans(), label=f"{key}?"):
                op[key] = data.draw(st.integers(0, top), label=key)
        if mode in sm.DELEGATED_MODES:
            op["hot_threshold"] = data.draw(st.integers(0, 8), label="hot_threshold")
            op["fold_block"] = data.draw(st.integers(1, 8), label="fold_block")
        self.do(op)

    @rule(data=st.data())
    def save_load(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(METADATA_KEYS), max_size=4, unique=True), label="keys")
        metadata = {k: data.draw(st.sampled_from(METADATA_VALUES), label="value") for k in keys}
        self.do({"op": "save_load", "metadata": metadata})

    @rule(data=st.data())
    def to_quantized(self, data: st.DataObject) -> None:
        """Every ``bits`` and ``group_size`` a layer takes, and a few refused."""
        op: dict[str, Any] = {"op": "to_quantized",
                              "layer": data.draw(st.integers(0, len(self.cfg["layers"]) - 1), label="layer"),
                              "bits": data.draw(QUANT_BITS, label="bits")}
        if data.draw(st.integers(0, 3), label="group_size?"):
            op["group_size"] = data.draw(QUANT_GROUP_SIZES, label="group_size")
        self.do(op)

    @rule(data=st.data())
    def mask(self, data: st.DataObject) -> None:
        op: dict[str, Any] = {"op": "mask", "layer": data.draw(st.integers(0, len(self.cfg["layers"]) - 1), label="layer"),
                              "n": data.draw(st.integers(1, 4), label="n"),
                              "device": data.draw(st.booleans(), label="device")}
        window = data.draw(st.one_of(st.none(), st.integers(1, 9)), label="window")
        if window is not None:
            op["window"] = window
        self.do(op)

    @rule(env=st.sampled_from(MECHANISM_ENVS))
    def mechanism(self, env: str | None) -> None:
        op: dict[str, Any] = {"op": "mechanism"}
        if env is not None:
            op["env"] = env
        self.do(op)

    @rule(data=st.data())
    def rows_check(self, data: st.DataObject) -> None:
        if self.cfg.get("rows") != "portable":
            return
        start = self.lock.world.layers[0].next_token
        self.do({"op": "rows", "tokens": [start + i for i in range(data.draw(st.integers(1, 3), label="tokens"))]})


__all__ = ["MODEL_OPS", "ModelOps", "ModelsLockstep", "ModelsMachine"]
