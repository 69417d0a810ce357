"""Executable spec of a prompt cache: a list of per-layer caches
(semantics.md 6).

A model's prompt cache holds one cache per layer, often of mixed kinds:
full-attention layers dense (:mod:`kvspec.spec.dense`), sliding-window layers
rotating (:mod:`kvspec.spec.rotating`) with their own window and sinks, a hybrid
model's recurrent layers recurrent (:mod:`kvspec.spec.recurrent`). Engines
call four list-level operations: :func:`make_prompt_cache` for a layer
pattern, :func:`can_trim_prompt_cache`, :func:`trim_prompt_cache` and
snapshot/restore of the whole list (:func:`w_snapshot`, :func:`w_restore`).

**Decision** (semantics.md 6): a list-level trim is atomic. Every layer
trims the same number of rows, or none trims and 0 is returned; a layer that
cannot trim that many rows exactly (a ring that has wrapped beyond its undo
depth, or has no undo log; a recurrent layer asked for more tokens than its
checkpoints cover) makes the whole list refuse. The count is taken
from the rows each layer holds (a dense layer's *live* rows, which a front
trim reduces below its offset), never from the offset alone. Layers that disagree on how many
tokens they hold corrupt every later step (a known public bug class: a
rollback that trims some layers only).

Every function is pure; refusals raise :mod:`kvspec.spec.errors` types and change
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvspec.spec import dense, recurrent, rotating
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError


@dataclass(frozen=True)
class DenseLayer:
    """A full-attention layer: a dense cache in ``mode`` growing by ``step``."""

    mode: str = "fp16"
    step: int = 256


@dataclass(frozen=True)
class RingLayer:
    """A sliding-window layer: a ring of ``max_size`` slots with ``keep``
    sinks and an undo log of ``undo`` rows (0: none)."""

    max_size: int
    keep: int = 0
    step: int = 256
    undo: int = 0


@dataclass(frozen=True)
class RecurrentLayer:
    """A hybrid model's recurrent layer (:mod:`kvspec.spec.recurrent`): ``size``
    arrays (2: conv window and recurrent state; 1: conv window only), a
    conv of width ``kernel``, checkpoints for rollbacks of up to ``depth``
    tokens (0: none)."""

    size: int = 2
    kernel: int = 4
    depth: int = 0


Layer = DenseLayer | RingLayer | RecurrentLayer
LayerCache = dense.DenseCache | rotating.RotatingCache | recurrent.RecurrentCache
LayerWorld = dense.DenseWorld | rotating.RotatingWorld | recurrent.RecurrentWorld


def make_layer(layer: Layer, inplace: bool = True) -> LayerCache:
    """The empty cache of one layer of a pattern. Raises the layer kind's
    InvalidArgumentError / UnsupportedOperationError for bad sizes or modes."""
    if isinstance(layer, DenseLayer):
        return dense.new_cache(layer.mode, layer.step, inplace)
    if isinstance(layer, RingLayer):
        return rotating.new_cache(layer.max_size, layer.keep, layer.step, inplace, undo=layer.undo)
    if isinstance(layer, RecurrentLayer):
        return recurrent.empty(layer.size, layer.kernel, layer.depth)
    raise InvalidArgumentError(f"make_prompt_cache: a layer must be a DenseLayer, a RingLayer or a RecurrentLayer, "
                               f"got {layer!r}")


def make_prompt_cache(pattern: tuple[Layer, ...], inplace: bool = True) -> tuple[LayerCache, ...]:
    """One empty cache per layer of ``pattern``, in order. Raises
    InvalidArgumentError for an empty pattern (a model has at least one
    layer) or a bad layer."""
    if len(pattern) < 1:
        raise InvalidArgumentError("make_prompt_cache: pattern must hold at least one layer, got 0")
    return tuple(make_layer(layer, inplace) for layer in pattern)


def layer_trim_bounds(cache: LayerCache) -> tuple[int, int]:
    """``(rows, exact)`` of one layer: ``rows`` is what its own ``trim``
    clamps a request to, ``exact`` the most rows it takes back exactly. A
    dense layer: its live rows, both (``live_len``: a front trim moved
    ``live_start`` past rows the offset still counts). A ring: its offset,
    and ``kvspec.spec.rotating.trimmable_rows`` (the offset while unwrapped, what
    its undo log covers after a wrap: 0 without one). A recurrent layer:
    its offset and its coverage (``kvspec.spec.recurrent.trimmable_rows``; the
    ring's rule, semantics.md 9)."""
    if isinstance(cache, dense.DenseCache):
        return cache.live_len, cache.live_len
    if isinstance(cache, recurrent.RecurrentCache):
        return cache.offset, recurrent.trimmable_rows(cache)
    return cache.offset, rotating.trimmable_rows(cache)


def layer_can_trim(cache: LayerCache) -> bool:
    """Some trim of this layer is exact: always for a dense layer, for a ring
    ``kvspec.spec.rotating.is_trimmable``, for a recurrent layer
    ``kvspec.spec.recurrent.is_trimmable`` (depth > 0)."""
    if isinstance(cache, recurrent.RecurrentCache):
        return recurrent.is_trimmable(cache)
    return isinstance(cache, dense.DenseCache) or rotating.is_trimmable(cache)


def can_trim_prompt_cache(caches: tuple[LayerCache, ...]) -> bool:
    """True iff the list is non-empty and every layer can trim exactly."""
    return len(caches) > 0 and all(layer_can_trim(c) for c in caches)


def list_trim_count(n: int, bounds: tuple[tuple[int, int], ...]) -> int:
    """The atomic list-level trim rule: the number of rows *every* layer
    trims for a request of ``n``, given each layer's ``(rows, exact)``
    (:func:`layer_trim_bounds`). The count is ``min(n, every layer's
    rows)``; it is 0 (the list refuses) when ``n <= 0``, when the list is
    empty, or when the count is beyond some layer's exact bound (a wrapped
    ring beyond its undo depth, semantics.md 6): then no layer trims.

    CrossHair checks the contract with at most 3 layers (the first ``pre:``
    line); the bound loses nothing: each postcondition is about the minimum
    over the layers and one layer's exact bound, so a counterexample with more
    layers stays one when cut to the layer holding the minimum and the layer
    it breaks (two layers); 3 also covers a layer that is neither.

    pre: len(bounds) <= 3
    pre: all(0 <= e <= r for r, e in bounds)
    post: __return__ >= 0
    post: __return__ <= max(n, 0)
    post: __return__ == 0 or all(__return__ <= e for r, e in bounds)
    """
    if n <= 0 or len(bounds) == 0:
        return 0
    count = n
    for rows, _exact in bounds:
        count = min(count, rows)
    for _rows, exact in bounds:
        if count > exact:
            return 0
    return count


def _trim_layer(cache: LayerCache, count: int) -> tuple[int, LayerCache]:
    if isinstance(cache, dense.DenseCache):
        return dense.trim(cache, count)
    if isinstance(cache, recurrent.RecurrentCache):
        return recurrent.trim(cache, count)
    return rotating.trim(cache, count)


def trim_prompt_cache(caches: tuple[LayerCache, ...], n: int) -> tuple[int, tuple[LayerCache, ...]]:
    """Trim ``n`` tokens from the end of every layer, atomically: every
    layer trims :func:`list_trim_count` rows, which is returned (0: no layer
    changed). Raises InvalidArgumentError for a non-integer ``n``. That
    every layer then trims exactly that count is obligation 9
    (``proofs/layers.py``)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidArgumentError(f"trim_prompt_cache: n must be an integer, got {n!r}")
    count = list_trim_count(n, tuple(layer_trim_bounds(c) for c in caches))
    if count == 0:
        return 0, caches
    out = []
    for c in caches:
        trimmed, c = _trim_layer(c, count)
        assert trimmed == count, "list_trim_count promised an exact trim"
        out.append(c)
    return count, tuple(out)


# -- the list with its holders ---------------------------------------------------


@dataclass(frozen=True)
class LayersWorld:
    """The prompt cache as a list of per-layer worlds (each with its own
    holders). List-level snapshots exist in every layer under the same name;
    every layer sees the same token identities."""

    layers: tuple[LayerWorld, ...]
    names: frozenset[str] = field(default_factory=frozenset)


def new_world(pattern: tuple[Layer, ...], inplace: bool = True) -> LayersWorld:
    """A world holding :func:`make_prompt_cache` of ``pattern``."""
    caches = make_prompt_cache(pattern, inplace)
    return LayersWorld(tuple(_world_of(c) for c in caches))


def _world_of(c: LayerCache) -> LayerWorld:
    if isinstance(c, dense.DenseCache):
        return dense.DenseWorld(c)
    if isinstance(c, recurrent.RecurrentCache):
        return recurrent.RecurrentWorld(c)
    return rotating.RotatingWorld(c)


def caches_of(world: LayersWorld) -> tuple[LayerCache, ...]:
    return tuple(w.cache for w in world.layers)


def _module(w: LayerWorld):
    if isinstance(w, recurrent.RecurrentWorld):
        return recurrent
    return dense if isinstance(w, dense.DenseWorld) else rotating


def w_append(world: LayersWorld, n: int) -> tuple[tuple[object, ...], LayersWorld]:
    """Append ``n`` rows (the next ``n`` token identities) to every layer, as
    a model's forward pass does. Returns each layer's append result."""
    if n < 1:
        raise InvalidArgumentError(f"append: n must be >= 1, got {n}")
    results, layers = [], []
    for w in world.layers:
        r, w = _module(w).w_append(w, n)
        results.append(r)
        layers.append(w)
    return tuple(results), replace(world, layers=tuple(layers))


def w_trim(world: LayersWorld, n: int) -> tuple[int, LayersWorld]:
    """List-level :func:`trim_prompt_cache`."""
    count, caches = trim_prompt_cache(caches_of(world), n)
    return count, replace(world, layers=tuple(replace(w, cache=c) for w, c in zip(world.layers, caches)))


def w_snapshot(world: LayersWorld, name: str) -> tuple[None, LayersWorld]:
    """Snapshot every layer under ``name`` (O(1) per layer). Raises
    StateError when the name is in use."""
    if name in world.names:
        raise StateError(f"snapshot: name {name!r} is already in use")
    layers = tuple(_module(w).w_snapshot(w, name)[1] for w in world.layers)
    return None, LayersWorld(layers, world.names | {name})


def _require(world: LayersWorld, op: str, name: str) -> None:
    if name not in world.names:
        raise StateError(f"{op}: no snapshot or handle named {name!r}")


def w_restore(world: LayersWorld, name: str) -> tuple[None, LayersWorld]:
    """Every layer adopts its snapshot ``name``; all or none (the name is
    checked before any layer changes)."""
    _require(world, "restore", name)
    return None, replace(world, layers=tuple(_module(w).w_restore(w, name)[1] for w in world.layers))


def layers_interchangeable(a: LayerWorld, b: LayerWorld, name: str | None = None) -> bool:
    """Whether layer ``a`` takes the snapshot ``name`` layer ``b`` took
    (``name`` None: a snapshot of ``b`` as it is now): both dense, or both
    rings of the same ``(max_size, keep)``, or both recurrent layers whose
    snapshot fits (:func:`kvspec.spec.recurrent.snapshot_fits`: the same size and
    depth, and the same kernel when ``a`` and the snapshot both hold a conv
    window). What a layer's restore checks first."""
    if isinstance(a, recurrent.RecurrentWorld) or isinstance(b, recurrent.RecurrentWorld):
        if not (isinstance(a, recurrent.RecurrentWorld) and isinstance(b, recurrent.RecurrentWorld)):
            return False
        held = b.holders.get(name) if name is not None else None
        return recurrent.snapshot_fits(a.cache, held.cache if held is not None else b.cache)
    if isinstance(a, dense.DenseWorld) != isinstance(b, dense.DenseWorld):
        return False
    if isinstance(a, dense.DenseWorld):
        return a.cache.mode == b.cache.mode  # type: ignore[union-attr]
    return (a.cache.max_size, a.cache.keep) == (b.cache.max_size, b.cache.keep)  # type: ignore[union-attr]


def w_restore_mixed(world: LayersWorld, name: str, layer: int, source: int) -> tuple[None, LayersWorld]:
    """A list restore from snapshot ``name`` whose list hands layer
    ``layer`` the snapshot layer ``source`` took (a store that mixed up its
    entries): layer ``layer`` refuses it, after the layers before it have
    taken theirs, and the list restore is all or none: InvalidArgumentError,
    and nothing changed in any layer (semantics.md 6, "restore_mixed": a restore
    one layer refuses late). Raises
    StateError for an unknown name; InvalidArgumentError for layer indices
    out of range or a pair of layers whose snapshots are interchangeable
    (:func:`layers_interchangeable`: then the restore is no refusal)."""
    _require(world, "restore", name)
    n_layers = len(world.layers)
    for field_name, j in (("layer", layer), ("source", source)):
        if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < n_layers:
            raise InvalidArgumentError(f"restore_mixed: {field_name} must satisfy 0 <= {field_name} < {n_layers}, got {j!r}")
    if layers_interchangeable(world.layers[layer], world.layers[source], name):
        raise InvalidArgumentError(f"restore_mixed: layers {layer} and {source} take each other's snapshots; "
                                   "pick layers of another kind or window")
    raise InvalidArgumentError(f"restore: layer {layer} refuses the snapshot of layer {source} "
                               "(another kind or window); nothing changed in any layer")


def w_copy(world: LayersWorld, name: str, live: str) -> tuple[None, LayersWorld]:
    """A copy of the whole list (``kvspec.impl.layers.copy_prompt_cache``:
    ``copy.deepcopy`` of the list, as mlx-lm's ``LRUPromptCache`` makes on
    every fetch, or ``copy.copy`` of each layer), held under ``name`` like a
    list snapshot: every layer as its kind's copy rule says
    (``kvspec.spec.dense.w_copy``, ``kvspec.spec.rotating.w_copy``): the copy shares each
    layer's buffers and owns nothing. ``live`` says which list the trace
    goes on writing (``"copy"``: the copy, with the original held). Raises
    InvalidArgumentError for another ``live``, StateError for a name in use;
    then nothing changes."""
    if live not in ("copy", "original"):
        raise InvalidArgumentError(f"copy: live must be 'copy' or 'original', got {live!r}")
    if name in world.names:
        raise StateError(f"copy: name {name!r} is already in use")
    layers = tuple(_module(w).w_copy(w, name, live)[1] for w in world.layers)
    return None, LayersWorld(layers, world.names | {name})


def holds_buffer(world: LayersWorld) -> bool:
    """Whether every layer holds a buffer (then every layer must refuse rows
    of another shape or dtype: :func:`w_append_mismatch`)."""
    return all(_module(w).holds_buffer(w) for w in world.layers)


def w_append_mismatch(world: LayersWorld, n: int, differs: str) -> tuple[None, LayersWorld]:
    """A forward pass handing every layer rows whose ``differs`` (batch, kv
    heads, K or V head dim, dtype) is not the cached rows': every layer
    refuses them (``kvspec.spec.dense.w_append_mismatch``, the rule of each kind)
    and nothing changes in any layer; InvalidArgumentError. Only on a list
    whose every layer holds a buffer (:func:`holds_buffer`)."""
    return dense.w_append_mismatch(world.layers[0], n, differs)  # type: ignore[arg-type,return-value]


def w_append_pair_mismatch(world: LayersWorld, n: int, differs: str) -> tuple[None, LayersWorld]:
    """A forward pass handing every layer a K/V pair whose values disagree
    with its keys in ``differs`` (dtype, batch, kv heads, rows): every layer
    refuses it, empty or not (``kvspec.spec.dense.w_append_pair_mismatch``, the
    rule of each kind), and nothing changes in any layer;
    InvalidArgumentError."""
    return dense.w_append_pair_mismatch(world.layers[0], n, differs)  # type: ignore[arg-type,return-value]


#: How a layer refuses its part of a list trim (kvtrace ``trim_refused_late``'s
#: ``how``): its ``trim`` raises, or gives back fewer rows than its bounds
#: promised (none: a ring failing closed), or (``partial``) really trims and
#: then raises: the refusing layer itself changed, so the list trim must
#: undo it too, not only the layers before it.
LATE_TRIM_REFUSALS = ("raises", "short", "partial", "fewer", "more")


def check_late_trim(n: object, layer: object, how: object, layers: int) -> None:
    """The arguments of :func:`w_trim_refused_late` on a list of ``layers``
    layers: InvalidArgumentError for a non-integer ``n``, a layer index
    out of range or a ``how`` not in :data:`LATE_TRIM_REFUSALS`."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidArgumentError(f"trim_prompt_cache: n must be an integer, got {n!r}")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
        raise InvalidArgumentError(f"trim_refused_late: layer must satisfy 0 <= layer < {layers}, got {layer!r}")
    if how not in LATE_TRIM_REFUSALS:
        raise InvalidArgumentError(f"trim_refused_late: how must be one of {', '.join(LATE_TRIM_REFUSALS)}, "
                                   f"got {how!r}")


def w_trim_refused_late(world: LayersWorld, n: int, layer: int, how: str) -> tuple[int, LayersWorld]:
    """A list trim of ``n`` rows in which layer ``layer`` refuses its own
    trim (``how``: its ``trim`` raises, returns 0, trims then raises,
    trims and returns one row fewer than asked, or trims and returns one
    more than asked: any count but the one its bounds promised) after the layers before it have trimmed: a layer that breaks
    its promise of an exact trim. The list trim is all or none
    (semantics.md 6, "trim_refused_late"): when :func:`list_trim_count` is
    0 no layer is asked and 0 is returned; otherwise StateError, and every
    layer (the refusing one included, which with ``how="partial"`` trimmed
    its rows before it raised) is exactly as it was (contents, counters, ownership of its
    buffers, a ring's undo log). Raises InvalidArgumentError for a
    non-integer ``n``, a layer index out of range or another ``how``."""
    check_late_trim(n, layer, how, len(world.layers))
    count = list_trim_count(n, tuple(layer_trim_bounds(c) for c in caches_of(world)))
    if count == 0:
        return 0, world
    raise StateError(f"trim_prompt_cache: layer {layer} refused its trim of {count} rows after the layers before "
                     "it trimmed; nothing was trimmed in any layer")


def w_reload(world: LayersWorld, via: str) -> tuple[None, LayersWorld]:
    """The whole list saved and loaded back (``via``: ``"file"``, a
    prompt-cache file of every layer; ``"state"``, mlx-lm's load order on
    each layer): each layer as its kind's reload says
    (``kvspec.spec.dense.w_reload``, ``kvspec.spec.rotating.w_reload``): same window,
    counters and settings (mode, step, window, sinks, undo depth, in-place
    switch, whatever the loading process's ``KV_INPLACE_WRITE``), fresh
    buffers without ownership, a ring's undo log empty; list snapshots
    stay. Raises InvalidArgumentError for another ``via``."""
    return None, replace(world, layers=tuple(_module(w).w_reload(w, via)[1] for w in world.layers))


def w_drop(world: LayersWorld, name: str) -> tuple[None, LayersWorld]:
    _require(world, "drop", name)
    layers = tuple(_module(w).w_drop(w, name)[1] for w in world.layers)
    return None, LayersWorld(layers, world.names - {name})


def w_hold(world: LayersWorld) -> tuple[None, LayersWorld]:
    """Every layer keeps the window its last append returned."""
    return None, replace(world, layers=tuple(_module(w).w_hold(w)[1] for w in world.layers))


def w_release_hold(world: LayersWorld) -> tuple[None, LayersWorld]:
    return None, replace(world, layers=tuple(_module(w).w_release_hold(w)[1] for w in world.layers))


#: Ops a trace may address to one layer (``{"op": "layer", "index": i,
#: "do": {...}}``): only those that keep the layers' token counters in step.
LAYER_OPS = ("trim_front", "fetch")


def w_layer(world: LayersWorld, index: int, op: dict) -> tuple[object, LayersWorld]:
    """Run a per-layer op (one of :data:`LAYER_OPS`) on layer ``index``.
    Raises InvalidArgumentError for an index out of range or another op;
    the layer kind's refusal otherwise (UnsupportedOperationError: a front
    trim on a ring)."""
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(world.layers):
        raise InvalidArgumentError(f"layer: index must satisfy 0 <= index < {len(world.layers)}, got {index!r}")
    name = op.get("op")
    if name not in LAYER_OPS:
        raise InvalidArgumentError(f"layer: op must be one of {LAYER_OPS}, got {name!r}")
    w = world.layers[index]
    if name == "trim_front" and not isinstance(w, dense.DenseWorld):
        kind = "recurrent" if isinstance(w, recurrent.RecurrentWorld) else "rotating"
        raise UnsupportedOperationError(f"trim_front: not an operation of the {kind} cache (layer {index})")
    result, w = _module(w).apply_op(w, op)
    layers = world.layers[:index] + (w,) + world.layers[index + 1:]
    return result, replace(world, layers=layers)


def apply_op(world: LayersWorld, op: dict) -> tuple[object, LayersWorld]:
    """Run one list-level kvtrace op: ``append`` (every layer), ``fetch``
    (every layer's window), ``trim`` (atomic), ``can_trim``, ``snapshot``,
    ``restore``, ``drop``, ``hold``, ``release_hold``, ``layer`` (one
    layer's op). Raises the spec's refusal, or InvalidArgumentError for an
    op a prompt cache does not have."""
    name = op["op"]
    if name == "append":
        return w_append(world, op["n"])
    if name == "fetch":
        return windows(world), world
    if name == "trim":
        return w_trim(world, op["n"])
    if name == "can_trim":
        return can_trim_prompt_cache(caches_of(world)), world
    if name == "snapshot":
        return w_snapshot(world, op["name"])
    if name == "restore":
        return w_restore(world, op["name"])
    if name == "reload":
        return w_reload(world, op.get("via", "file"))
    if name == "restore_mixed":
        return w_restore_mixed(world, op["name"], op["layer"], op["source"])
    if name == "trim_refused_late":
        return w_trim_refused_late(world, op["n"], op["layer"], op.get("how", "raises"))
    if name == "copy":
        return w_copy(world, op["name"], op.get("live", "original"))
    if name == "append_mismatch":
        return w_append_mismatch(world, op["n"], op["differs"])
    if name == "append_pair_mismatch":
        return w_append_pair_mismatch(world, op["n"], op["differs"])
    if name == "drop":
        return w_drop(world, op["name"])
    if name == "hold":
        return w_hold(world)
    if name == "release_hold":
        return w_release_hold(world)
    if name == "layer":
        return w_layer(world, op["index"], op["do"])
    raise InvalidArgumentError(f"{name}: not an operation of a prompt cache (a list of layers)")


def windows(world: LayersWorld) -> tuple[tuple[int, ...], ...]:
    """Every layer's window (token identities, each in its layer's fetch order)."""
    return tuple(w.cache.window() for w in world.layers)


def view_of(world: LayersWorld, name: str | None) -> tuple[tuple[int, ...], ...]:
    """Every layer's window of the live list (``name is None``) or of the
    list-level snapshot ``name``."""
    if name is None:
        return windows(world)
    _require(world, "expect", name)
    return tuple(_module(w).view_of(w, name) if not isinstance(w, rotating.RotatingWorld)
                 else w.holders[name].window() for w in world.layers)
