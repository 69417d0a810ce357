"""kvspec caches for mlx-lm models: per-layer prompt caches and list-level trims.

mlx-lm models take a list with one cache per layer (``model(x, cache=...)``,
``generate_step(..., prompt_cache=...)``). :func:`make_prompt_cache` builds
that list from kvspec caches, laid out the way mlx-lm lays out its own:
full-attention layers get a dense :class:`~kvspec.impl.dense.KVCache`,
sliding-window layers a :class:`~kvspec.impl.rotating.RotatingKVCache` with the
layer's window.

The list-level operations (:func:`trim_prompt_cache`,
:func:`can_trim_prompt_cache`, :func:`snapshot_prompt_cache`,
:func:`restore_prompt_cache`) live in :mod:`kvspec.impl.layers` (spec:
``kvspec.spec.layers``) and are re-exported here.

mlx-lm is an optional dependency (``pip install 'kvspec[e2e]'``); it is
imported only when a model defines ``make_cache``.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvspec.impl.dense import KVCache, _check_int
from kvspec.impl.layers import (
    can_trim_prompt_cache,
    restore_prompt_cache,
    snapshot_prompt_cache,
    trim_prompt_cache,
)
from kvspec.impl.rotating import RotatingKVCache
from kvspec.impl.turbo import DelegatedKVCache, TurboKVCache, make_cache
from kvspec.spec.errors import InvalidArgumentError, UnsupportedOperationError

# (and kvspec.impl.recurrent.RecurrentCache: imported on first use, since it
# subclasses mlx-lm's ArraysCache and importing mlx-lm takes seconds)
Cache = KVCache | RotatingKVCache | TurboKVCache | DelegatedKVCache


def _recurrent() -> Any:
    """``kvspec.impl.recurrent``, imported on first use."""
    return importlib.import_module("kvspec.impl.recurrent")


def _is_recurrent(c: Any) -> bool:
    """``c`` is an kvspec.impl.recurrent.RecurrentCache (False while that module
    was never imported: then no such cache exists)."""
    mod = sys.modules.get("kvspec.impl.recurrent")
    return mod is not None and isinstance(c, mod.RecurrentCache)


def _dense(mode: str, step: int, inplace: bool | None, classes: dict[str, type] | None,
           kw: dict[str, Any]) -> Cache:
    """A dense-kind cache in ``mode``: ``classes["dense"]`` when given (it
    must take the mode), else :func:`kvspec.impl.turbo.make_cache`."""
    cls = (classes or {}).get("dense")
    if cls is None:
        return make_cache(mode, step=step, inplace=inplace, **kw)
    return cls(mode=mode, step=step, inplace=inplace, **kw)


def _convert(layer: int, c: Any, mode: str, step: int, inplace: bool | None,
             classes: dict[str, type] | None = None, undo: int = 0, strict: bool = False, **kw: Any) -> Cache:
    """One of mlx-lm's per-layer caches -> the kvspec cache of the same kind
    (``classes`` maps a kind, ``"dense"`` or ``"rotating"``, to the class to
    build instead of ours: a subclass, e.g. a test double; ``undo`` is a
    ring's undo depth, ``strict`` its refusal setting; ``kw``: the Delegated mode's ``hot_threshold`` and
    ``fold_block``)."""
    from mlx_lm.models import cache as lm_cache

    classes = classes or {}
    # RotatingKVCache before KVCache: check exact kinds, not a subclass chain.
    if type(c) is lm_cache.RotatingKVCache:
        # A sliding-window layer stays a ring in every mode: the ring stores
        # fp16 (the model's dtype) only; ``mode`` applies to the
        # full-attention layers (docs/mlx-lm.md, "Quantized caches").
        ring = classes.get("rotating", RotatingKVCache)
        return ring(max_size=c.max_size, keep=c.keep, step=step, inplace=inplace, undo=undo, **_strict_kw(strict))
    if type(c) is lm_cache.KVCache:
        return _dense(mode, step, inplace, classes, kw)
    if type(c) is lm_cache.ArraysCache:
        # a recurrent layer: conv window (+ recurrent state) with a checkpoint ring of depth ``undo``
        return _recurrent().RecurrentCache(size=len(c.cache), depth=undo, strict=strict)
    nested = " (a CacheList nests several caches in one layer, e.g. falcon_h1's mamba + attention)" \
        if type(c).__name__ == "CacheList" else ""
    raise UnsupportedOperationError(
        f"make_prompt_cache: layer {layer} needs a {type(c).__name__}, which kvspec does not implement{nested} "
        "(supported: full-attention KVCache, sliding-window RotatingKVCache and recurrent ArraysCache layers)"
    )


def _strict_kw(strict: bool) -> dict[str, bool]:
    """``strict`` for a ring's constructor: passed only when True, so a
    ``classes`` factory written before the setting still builds the rest."""
    return {"strict": True} if strict else {}


def make_prompt_cache(
    model: Any,
    mode: str = "fp16",
    step: int = 256,
    inplace: bool | None = None,
    max_kv_size: int | None = None,
    classes: dict[str, type] | None = None,
    undo: int = 0,
    num_draft_tokens: int = 0,
    strict: bool = False,
    **kw: Any,
) -> list[Cache]:
    """One kvspec cache per layer of an mlx-lm ``model``, laid out as
    ``mlx_lm.models.cache.make_prompt_cache`` lays out mlx-lm's caches.

    When the model defines ``make_cache()`` (models with sliding-window
    layers, e.g. gemma3, llama with ``layer_types``; hybrid models), each
    layer's cache kind and window come from it: ``KVCache`` -> dense
    :class:`KVCache`, ``RotatingKVCache(max_size, keep)`` ->
    :class:`RotatingKVCache` with the same window and sinks,
    ``ArraysCache(size=n)`` (the recurrent layers of qwen3_next, qwen3_5,
    nemotron_h, mamba, mamba2, lfm2, recurrent_gemma, jamba, ...) ->
    :class:`~kvspec.impl.recurrent.RecurrentCache` of the same size, depth
    ``max(undo, num_draft_tokens)`` and this ``strict``.

    **Hybrid models: the step recorder.** When the model has a recurrent
    layer, this call also installs the step recorder on ``model``:
    ``kvspec.impl.recurrent.record_steps(model)``, the public call, which wraps
    each recurrent mixer of this model instance (not mlx-lm's code) so
    that the last ``depth`` tokens of every call run one at a time and the
    cache keeps a checkpoint after each (docs/recurrent.md); at depth 0 it
    only counts the tokens of each call (recurrent_gemma never calls
    ``cache.advance``: without the count its recurrent layers would stay
    at offset 0 and a list trim could not tell how far they reach). Without it a
    recurrent layer rolls back nothing; ``kvspec.impl.recurrent.unrecord_steps``
    removes it. Otherwise every layer gets a dense cache, or, with
    ``max_kv_size``, a ring of that size with 4 sinks (mlx-lm's choice;
    like mlx-lm, ``max_kv_size`` is ignored when the model has
    ``make_cache``).

    Args:
        model: an mlx-lm model (anything with ``layers``, or ``make_cache``).
        mode: dense layers' storage: ``"fp16"``, ``"int8"``, ``"turbo4asym"``,
            ``"turbo4"``, ``"turbo3asym"`` or ``"turbo4delegated"``
            (:func:`kvspec.impl.turbo.make_cache`).
        step: growth granularity in rows, for every layer.
        inplace: the in-place write switch; ``None`` reads ``KV_INPLACE_WRITE``.
        max_kv_size: window of every layer's ring when the model has no
            ``make_cache``.
        classes: ``{"dense": cls, "rotating": cls}`` to build subclasses of
            ours instead (subclasses, e.g. test doubles); default ours
            (:func:`kvspec.impl.turbo.make_cache` for the dense modes).
        undo: every ring's undo depth U (rows a trim can take back after a
            wrap; 0: none), and every recurrent layer's checkpoint depth.
        num_draft_tokens: the ``num_draft_tokens`` of the speculative
            decoding these caches serve (mlx-lm's
            ``speculative_generate_step``; 0: none): every ring's undo log
            holds ``max(undo, num_draft_tokens)`` rows, enough for every
            rollback of a round to stay exact after the window wraps.
            Without an undo log a ring that went past its window (a
            prompt longer than it) refuses every rollback; its first
            refusal warns (``RollbackWarning``, once per cache, also when
            mlx-lm only asks ``is_trimmable()``; docs/mlx-lm.md).
        strict: True or False (default): every ring's ``strict``. True
            makes each refused rollback raise StateError (the ring
            unchanged) instead of the once-per-cache RollbackWarning, also
            inside mlx-lm's own loops (``speculative_generate_step``,
            which asks ``is_trimmable()``); dense layers trim exactly and
            never refuse. A ``classes`` ring gets ``strict=True`` only when
            it is set.
        **kw: ``hot_threshold``, ``fold_block`` for ``turbo4delegated``.

    In a quantized ``mode`` (``"int8"``, the Turbo modes) the full-attention
    layers store that mode and the sliding-window layers stay fp16
    :class:`RotatingKVCache` rings (a ring has no quantized storage), so
    gemma3 and other models with sliding-window layers take every mode.

    Raises UnsupportedOperationError for a layer kind kvspec lacks (e.g.
    falcon_h1's ``CacheList``, ``ChunkedKVCache``) and for a quantized ``mode`` with
    ``max_kv_size`` (every layer a ring: nothing the mode applies to);
    InvalidArgumentError for bad sizes or a ``strict`` that is not a bool.
    """
    if type(strict) is not bool:
        raise InvalidArgumentError(f"make_prompt_cache: strict must be True or False, got {strict!r}")
    num_draft_tokens = _check_int("make_prompt_cache", "num_draft_tokens", num_draft_tokens)
    if num_draft_tokens < 0:
        raise InvalidArgumentError(f"make_prompt_cache: num_draft_tokens must be >= 0, got {num_draft_tokens}")
    undo = max(_check_int("make_prompt_cache", "undo", undo), num_draft_tokens)
    if hasattr(model, "make_cache"):
        caches = [_convert(i, c, mode, step, inplace, classes, undo, strict, **kw)
                  for i, c in enumerate(model.make_cache())]
        if any(_is_recurrent(c) for c in caches):
            _recurrent().record_steps(model)  # the explicit, documented step: checkpoints need per-token states
        return caches
    n_layers = len(model.layers)
    if max_kv_size is not None:
        if mode != "fp16":
            raise UnsupportedOperationError(
                f"make_prompt_cache: max_kv_size={max_kv_size} makes every layer a RotatingKVCache, "
                f"which supports mode 'fp16' only, got mode={mode!r}"
            )
        ring = (classes or {}).get("rotating", RotatingKVCache)
        return [ring(max_size=max_kv_size, keep=4, step=step, inplace=inplace, undo=undo, **_strict_kw(strict))
                for _ in range(n_layers)]
    return [_dense(mode, step, inplace, classes, kw) for _ in range(n_layers)]


# -- prompt-cache files -------------------------------------------------------------
#: Format version of the kvspec part of a prompt-cache file.
FILE_FORMAT = 1
#: Metadata key (inside mlx-lm's user-metadata namespace "0.") holding the
#: kvspec layer descriptions, and what each class entry says to mlx-lm.
_META_KEY = "__kvspec__"
_CLASSES = {"KVCache": KVCache, "RotatingKVCache": RotatingKVCache, "TurboKVCache": TurboKVCache,
            "DelegatedKVCache": DelegatedKVCache}
#: classes a file may name whose module is imported on first use
_LAZY_CLASSES = {"RecurrentCache": "kvspec.impl.recurrent"}


def _known(name: str) -> bool:
    return name in _CLASSES or name in _LAZY_CLASSES


def _class_named(name: str) -> type:
    if name in _CLASSES:
        return _CLASSES[name]
    return getattr(importlib.import_module(_LAZY_CLASSES[name]), name)
#: Most arrays a layer's ``state`` holds (a Turbo store: 7).
_MAX_ARRAYS = 16
_LOADER = "kvspec.impl.models.load_prompt_cache"


def _class_entry(name: str) -> str:
    """What mlx-lm's loader sees as the layer's class name: not one of its
    classes, so ``mlx_lm.models.cache.load_prompt_cache`` stops with a
    KeyError whose text names our loader."""
    return f"kvspec.{name} (this file holds kvspec caches: load it with {_LOADER})"


def _describe(layer: int, c: Any) -> dict[str, Any]:
    name = type(c).__name__
    refuse = getattr(c, "refuse_prompt_cache_file", None)
    if refuse is not None:  # a cache a file cannot hold (kvspec.impl.paged.PagedKVCache)
        refuse(layer)
    if not _known(name) or not isinstance(c, _class_named(name)):
        raise UnsupportedOperationError(
            f"save_prompt_cache: layer {layer} is a {name}; kvspec files hold kvspec caches only "
            f"({', '.join([*_CLASSES, *_LAZY_CLASSES])}); save mlx-lm's caches with mlx_lm.models.cache.save_prompt_cache"
        )
    # Turbo writes always copy: no switch to keep (saved as false)
    return {"class": name, "meta_state": list(c.meta_state), "inplace": bool(getattr(c, "inplace", False)),
            "arrays": len(_file_arrays(layer, c))}


def _file_arrays(layer: int, c: Any) -> tuple[Any, ...]:
    """The arrays a file holds for a layer: its ``state``; a recurrent
    layer's ``size`` arrays (conv window, recurrent state), or none before
    its first call."""
    if not _is_recurrent(c):
        return tuple(c.state)
    present = [a is not None for a in c.cache]
    if any(present) and not all(present):
        raise UnsupportedOperationError(
            f"save_prompt_cache: layer {layer} (RecurrentCache) holds some arrays and not others "
            f"({['set' if p else 'None' for p in present]}): a file holds all of them or none")
    return tuple(c.cache) if all(present) else ()


def save_prompt_cache(file: str | Path, cache: Sequence[Any], metadata: Mapping[str, str] | None = None) -> None:
    """Save a list of kvspec caches (one per layer, any mix of dense Fp16,
    Int8, Turbo and rings) to a safetensors file: mlx-lm's call shape.

    Tensors: ``"{layer}.{j}"``, the layer's ``state`` (its live rows:
    Fp16 ``(keys, values)``, Int8 ``(keys, key_scales, values,
    value_scales)``, a ring ``(keys, values)`` in physical slot order, a
    Turbo cache its packed codes, norms and rescales, sorted by name).
    Metadata (strings): the user's ``metadata`` under ``"0.<key>"`` as
    mlx-lm stores it; under ``"0.__kvspec__"`` a JSON description of every
    layer (class, ``meta_state``: mode, step, offset, live_start for a
    dense cache, keep, max_size, step, offset, idx[, undo] for a ring,
    offset, depth, size[, strict] for a recurrent layer (its conv window
    and recurrent state are its arrays; its checkpoints are not saved:
    coverage 0 after a load, kvspec.spec.recurrent.reload), the
    Turbo counters, dtype, head dims and array names; the in-place switch;
    how many arrays); and under ``"1.<layer>"`` a class entry that makes
    mlx-lm's own loader stop with a message naming
    :func:`load_prompt_cache`. A file is a snapshot: a ring's undo log is
    not saved (a restored ring cannot roll back into the history before the
    restore, kvspec.spec.rotating.w_restore). docs/mlx-lm.md "Prompt-cache files".

    Raises InvalidArgumentError for metadata that is not ``str -> str`` or
    uses the reserved key, UnsupportedOperationError for a layer that is not
    a kvspec cache or is a paged sequence (its blocks belong to its pool).
    Nothing is written when refused.
    """
    if len(cache) == 0:
        raise InvalidArgumentError("save_prompt_cache: cache must hold at least one layer, got []")
    meta = dict(metadata or {})
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidArgumentError(f"save_prompt_cache: metadata must map str to str, got {k!r}: {v!r}")
        if k == _META_KEY:
            raise InvalidArgumentError(f"save_prompt_cache: metadata key {_META_KEY!r} is reserved for kvspec")
    layers = [_describe(i, c) for i, c in enumerate(cache)]
    arrays: dict[str, mx.array] = {}
    for i, c in enumerate(cache):
        for j, a in enumerate(_file_arrays(i, c)):
            arrays[f"{i}.{j}"] = a
    header = {f"0.{k}": v for k, v in meta.items()}
    header[f"0.{_META_KEY}"] = json.dumps({"format": FILE_FORMAT, "layers": layers})
    for i, layer in enumerate(layers):
        header[f"1.{i}"] = _class_entry(layer["class"])
    header["2.0"] = ""  # mlx-lm's (empty) list of scalars
    mx.eval(list(arrays.values()))
    mx.save_safetensors(str(file), arrays, header)


def _bad(file: Any, what: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"load_prompt_cache: {file}: {what}")


def _layer_plan(file: Any, header: dict[str, str], arrays: dict[str, mx.array]) -> list[dict[str, Any]]:
    """Parse and check the kvspec metadata against the tensors present."""
    raw = header.get(f"0.{_META_KEY}")
    if raw is None:
        if any(k.startswith("1.") and v.startswith("kvspec.") for k, v in header.items()):
            raise _bad(file, f"kvspec class entries but no kvspec metadata (key '0.{_META_KEY}'): the file is damaged")
        raise _bad(file, f"no kvspec metadata (key '0.{_META_KEY}') and no mlx-lm class entries ('1.<layer>'): "
                         "not a prompt-cache file")
    try:
        desc = json.loads(raw)
    except ValueError as exc:
        raise _bad(file, f"kvspec metadata is not JSON ({exc})") from None
    if not isinstance(desc, dict) or desc.get("format") != FILE_FORMAT or not isinstance(desc.get("layers"), list):
        raise _bad(file, f"kvspec metadata must be {{'format': {FILE_FORMAT}, 'layers': [...]}}, got {raw[:120]!r}")
    layers = desc["layers"]
    want: set[str] = set()
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict) or set(layer) != {"class", "meta_state", "inplace", "arrays"}:
            raise _bad(file, f"layer {i}: description must have class, meta_state, inplace, arrays; got {layer!r}")
        if not _known(layer["class"]):
            raise _bad(file, f"layer {i}: unknown class {layer['class']!r}; "
                             f"known: {', '.join([*_CLASSES, *_LAZY_CLASSES])}")
        if not isinstance(layer["meta_state"], list) or not all(isinstance(x, str) for x in layer["meta_state"]):
            raise _bad(file, f"layer {i}: meta_state must be a list of strings, got {layer['meta_state']!r}")
        if not isinstance(layer["inplace"], bool):
            raise _bad(file, f"layer {i}: inplace must be true or false, got {layer['inplace']!r}")
        n = layer["arrays"]
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= _MAX_ARRAYS:
            raise _bad(file, f"layer {i}: arrays must be an integer in [0, {_MAX_ARRAYS}], got {n!r}")
        if header.get(f"1.{i}") != _class_entry(layer["class"]):
            raise _bad(file, f"layer {i}: class entry '1.{i}' does not match the kvspec metadata")
        for j in range(n):
            if f"{i}.{j}" not in arrays:
                raise _bad(file, f"layer {i}: tensor '{i}.{j}' is missing")
            want.add(f"{i}.{j}")
    extra = sorted(set(arrays) - want)
    if extra:
        raise _bad(file, f"tensors {extra[:5]} belong to no layer")
    for k in header:
        if k.startswith("1.") and (not k[2:].isdigit() or int(k[2:]) >= len(layers)):
            raise _bad(file, f"class entry {k!r} belongs to no layer")
    return layers


def load_prompt_cache(file: str | Path, return_metadata: bool = False) -> Any:
    """Load a file written by :func:`save_prompt_cache` into kvspec caches
    (mlx-lm's call shape): each layer comes back as its own class with its
    mode, step, window, sinks, offset, live_start, cursor and in-place
    switch, holding the same rows. Returns the list, or ``(list,
    metadata)`` with ``return_metadata``.

    A file that ``mlx_lm.models.cache.save_prompt_cache`` wrote from
    mlx-lm's own caches loads too: its ``KVCache`` layers become our Fp16
    :class:`KVCache`, its ``RotatingKVCache`` layers our
    :class:`RotatingKVCache`, each with the same rows and counters (decoding
    after the load equals mlx-lm's caches continuing, byte for byte), its
    ``ArraysCache`` layers a :class:`~kvspec.impl.recurrent.RecurrentCache` of
    depth 0 with the same arrays (offset 0: mlx-lm's counts no tokens); any
    other class (``QuantizedKVCache``, ``CacheList``, ...) is refused
    with UnsupportedOperationError naming it and why.

    Every layer is checked before the list is returned, so a damaged file
    yields an error and no caches: InvalidArgumentError (naming the file,
    the layer and what is wrong) for an unreadable or truncated file, a
    file without kvspec metadata or mlx-lm class entries, an unknown class, missing or extra
    tensors, and tensors or counters that do not fit (wrong rank, shape or
    dtype, a cursor out of range: the checks of ``from_state``);
    UnsupportedOperationError for a mode this implementation lacks.
    """
    try:
        arrays, header = mx.load(str(file), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as exc:
        raise _bad(file, f"not a readable safetensors file ({exc})") from None
    if not isinstance(arrays, dict):
        raise _bad(file, "not a safetensors file")
    if f"0.{_META_KEY}" not in header and any(
            k.startswith("1.") and not v.startswith("kvspec.") for k, v in header.items()):
        return _load_mlx_lm_file(file, return_metadata)
    layers = _layer_plan(file, header, arrays)
    caches: list[Any] = []
    for i, layer in enumerate(layers):
        state = tuple(arrays[f"{i}.{j}"] for j in range(layer["arrays"]))
        cls = _class_named(layer["class"])
        try:
            c = cls.from_state(state, tuple(layer["meta_state"]))
        except (InvalidArgumentError, UnsupportedOperationError) as exc:
            raise type(exc)(f"load_prompt_cache: {file}: layer {i}: {exc}") from None
        if hasattr(c, "inplace"):
            c.inplace = layer["inplace"]
        caches.append(c)
    if return_metadata:
        meta = {k[2:]: v for k, v in header.items() if k.startswith("0.") and k != f"0.{_META_KEY}"}
        return caches, meta
    return caches


#: mlx-lm's cache classes a file of mlx-lm's may hold, and why kvspec does
#: not load each it does not map (KVCache and RotatingKVCache are mapped)
_UNMAPPED = {
    "QuantizedKVCache": "kvspec has no affine group-quantized storage (its Int8 quantizes whole rows)",
    "ChunkedKVCache": "kvspec has no chunked-attention cache",
    "ConcatenateKVCache": "kvspec has no concatenating cache",
    "CacheList": "kvspec has no nested cache lists",
    "BatchKVCache": "a batch cache: extract each sequence with mlx-lm first",
    "BatchRotatingKVCache": "a batch cache: extract each sequence with mlx-lm first",
}


def _from_mlx_lm(file: Any, layer: int, c: Any) -> Cache:
    """One of mlx-lm's loaded caches -> ours, holding the same rows and
    counters: ``KVCache`` -> Fp16 :class:`KVCache` (its rows ``[0,
    offset)``), ``RotatingKVCache`` -> :class:`RotatingKVCache` (window,
    sinks, offset, cursor, the buffer in its physical order); step 256,
    mlx-lm's. Any other class is refused naming it (``_UNMAPPED``)."""
    from mlx_lm.models import cache as lm_cache

    name = type(c).__name__
    try:
        if type(c) is lm_cache.KVCache:
            if c.keys is None or c.offset == 0:
                return KVCache("fp16", step=lm_cache.KVCache.step)
            state = (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
            return KVCache.from_state(state, ("fp16", str(lm_cache.KVCache.step), str(c.offset), "0"))
        if type(c) is lm_cache.RotatingKVCache:
            return RotatingKVCache.from_mlx_lm(c, step=lm_cache.RotatingKVCache.step)
        if type(c) is lm_cache.ArraysCache:
            # mlx-lm's ArraysCache counts no tokens: offset 0, depth 0
            arrays = [a for a in c.cache if a is not None and a.size > 0]
            return _recurrent().RecurrentCache.from_state(arrays if len(arrays) == len(c.cache) else (),
                                             ("0", "0", str(len(c.cache))))
    except (InvalidArgumentError, UnsupportedOperationError) as exc:
        raise type(exc)(f"load_prompt_cache: {file}: layer {layer} (mlx-lm's {name}): {exc}") from None
    why = _UNMAPPED.get(name, "kvspec does not implement it")
    raise UnsupportedOperationError(
        f"load_prompt_cache: {file}: layer {layer} is mlx-lm's {name}, which kvspec cannot hold ({why}); "
        "this file loads into mlx-lm's own caches with mlx_lm.models.cache.load_prompt_cache"
    )


def _load_mlx_lm_file(file: Any, return_metadata: bool) -> Any:
    """A file written by ``mlx_lm.models.cache.save_prompt_cache`` from
    mlx-lm's own caches: parsed by mlx-lm's loader, then every layer mapped
    to ours (:func:`_from_mlx_lm`), all or none."""
    try:
        from mlx_lm.models.cache import load_prompt_cache as lm_load
    except ImportError:  # pragma: no cover - the e2e extra is installed by make
        raise UnsupportedOperationError(
            f"load_prompt_cache: {file}: a file of mlx-lm's caches needs mlx-lm to parse it (pip install 'kvspec[e2e]')"
        ) from None
    try:
        lm_caches, meta = lm_load(str(file), return_metadata=True)
    except KeyError as exc:
        raise UnsupportedOperationError(
            f"load_prompt_cache: {file}: holds a cache class neither mlx-lm nor kvspec knows: {exc.args[0]!r}"
        ) from None
    except (ValueError, TypeError, IndexError) as exc:
        raise _bad(file, f"a damaged file of mlx-lm's caches ({type(exc).__name__}: {exc})") from None
    caches = [_from_mlx_lm(file, i, c) for i, c in enumerate(lm_caches)]
    return (caches, dict(meta)) if return_metadata else caches


__all__ = [
    "can_trim_prompt_cache",
    "load_prompt_cache",
    "make_prompt_cache",
    "restore_prompt_cache",
    "save_prompt_cache",
    "snapshot_prompt_cache",
    "trim_prompt_cache",
]
