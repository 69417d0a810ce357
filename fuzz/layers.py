"""Lockstep and state machine for a prompt cache: a list of layers (kind
``layers``, semantics.md 6, ``kvspec.spec.layers``).

A trace's cache is ``{"kind": "layers", "layers": [{"kind": "dense", ...},
{"kind": "rotating", "max_size": 4, ...}, {"kind": "recurrent", "kernel": 4, "depth": 2}], ...}``; the
shape fields (batch,
kv heads, head dims, dtype) and ``inplace`` are the list's, shared by every
layer, as in a model. Its ops are list-level: ``append`` (every layer, as a
forward pass does), ``trim`` (atomic, ``impl.impl_layers.trim_prompt_cache``),
``can_trim``, ``snapshot`` / ``restore`` / ``drop`` of the whole list,
``hold`` / ``release_hold``, ``fetch``, and ``layer`` (one layer's front
trim or fetch).

After every op the harness compares every layer as the per-kind harnesses
do (window bytes, holders, offset, capacity, cursor, in-place decisions, the
masks before each append) plus the list's own rule: ``can_trim`` and the
count every trim returns. A recurrent layer's conv window and state are
compared row by row, live, in every holder and after each rollback ``1..
coverage`` taken on a copy (:meth:`LayersLockstep._probe_rollbacks`).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import mlx.core as mx
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvspec.fuzz.lockstep import (
    Divergence,
    Lockstep,
    error_text,
    is_cache_copy,
    reload_through_file,
)
from kvspec.fuzz.machine import APPEND_N, KVMachine, LifecycleRules
from kvspec.fuzz.masks import check_dense_masks, check_ring_masks
from kvspec.fuzz.quant_ref import int8_oracle, int8_oracle_host
from kvspec.fuzz.recurrent import FakeBlock, FakeModel, RecurrentRows, _Probe, arrays_mismatch
from kvspec.fuzz.trace import TraceFormatError
from kvspec.impl import layers as impl_layers
from kvspec.impl.dense import KVCache
from kvspec.impl.recurrent import RecurrentCache, record_steps
from kvspec.impl.rotating import RotatingKVCache
from kvspec.impl.write import inplace_keeps_memory
from kvspec.spec import dense as sd
from kvspec.spec import layers as sl
from kvspec.spec import recurrent as src
from kvspec.spec import rotating as sr
from kvspec.spec.errors import (
    InvalidArgumentError,
    RollbackWarning,
    StateError,
    UnsupportedOperationError,
)


class ListOps:
    """The list-level operations under test (``kvspec.impl.layers``) and the model
    glue around a prompt cache (``kvspec.impl.models``: ``make_prompt_cache``, the
    prompt-cache file's save and load). The bug catalog passes a subclass
    that breaks one of them."""

    def trim(self, caches: list[Any], n: int) -> int:
        return impl_layers.trim_prompt_cache(caches, n)

    def trim_strict(self, caches: list[Any], n: int) -> int:
        """``trim_prompt_cache(caches, n, strict=True)``: the strict probe of
        a refused list trim (:meth:`LayersLockstep._list_trim`)."""
        return impl_layers.trim_prompt_cache(caches, n, strict=True)

    def can_trim(self, caches: list[Any]) -> bool:
        return impl_layers.can_trim_prompt_cache(caches)

    def snapshot(self, caches: list[Any]) -> list[Any]:
        return impl_layers.snapshot_prompt_cache(caches)

    def restore(self, caches: list[Any], snapshots: list[Any]) -> None:
        impl_layers.restore_prompt_cache(caches, snapshots)

    def copy(self, caches: list[Any], deep: bool) -> list[Any]:
        return impl_layers.copy_prompt_cache(caches, deep)

    def make_prompt_cache(self, model: Any, **kw: Any) -> list[Any]:
        from kvspec.impl.models import make_prompt_cache

        return make_prompt_cache(model, **kw)

    def save_prompt_cache(self, file: Any, caches: list[Any]) -> None:
        from kvspec.impl.models import save_prompt_cache

        save_prompt_cache(file, caches)

    def load_prompt_cache(self, file: Any) -> list[Any]:
        from kvspec.impl.models import load_prompt_cache

        return load_prompt_cache(file)


def spec_pattern(layers: list[dict[str, Any]], mode: str = "fp16", step: int = 256,
                 num_draft_tokens: int = 0) -> tuple[sl.Layer, ...]:
    """A trace's ``layers`` list as spec layer descriptions; a layer without
    ``mode`` / ``step`` takes the list's, a ring without ``undo`` (a
    recurrent layer without ``depth``) the list's ``num_draft_tokens`` (what
    ``make_prompt_cache`` gives every ring and recurrent layer)."""
    out: list[sl.Layer] = []
    for layer in layers:
        if layer["kind"] == "recurrent":
            out.append(sl.RecurrentLayer(layer.get("size", 2), layer.get("kernel", 4),
                                         layer.get("depth", num_draft_tokens)))
        elif layer["kind"] == "dense":
            out.append(sl.DenseLayer(layer.get("mode", mode), layer.get("step", step)))
        else:
            out.append(sl.RingLayer(layer["max_size"], layer.get("keep", 0), layer.get("step", step),
                                    layer.get("undo", num_draft_tokens)))
    return tuple(out)


#: kvtrace ``cache.build`` of a prompt cache: who builds the layers
BUILDS = ("list", "make_prompt_cache")


class LayoutModel:
    """A stand-in for an mlx-lm model: ``make_cache()`` gives mlx-lm's own
    per-layer caches for the trace's layout (``KVCache`` for a dense layer,
    ``RotatingKVCache(max_size, keep)`` for a ring, ``ArraysCache(size)``
    for a recurrent layer), which ``kvspec.impl.models.make_prompt_cache`` turns
    into ours, as for gemma3, a llama with ``layer_types`` or a hybrid
    model. A recurrent layer's entry in ``layers`` is a block holding its
    mixer (``kvspec.fuzz.recurrent.FakeBlock``), which ``make_prompt_cache``'s
    step recorder wraps, as in a hybrid model."""

    def __init__(self, layers: list[dict[str, Any]]):
        self.layout = [dict(layer) for layer in layers]
        self.layers = [FakeBlock(layer.get("kernel", 4), layer.get("size", 2)) if layer["kind"] == "recurrent"
                       else layer for layer in self.layout]

    def make_cache(self) -> list[Any]:
        from mlx_lm.models import cache as lm_cache

        return [lm_cache.KVCache() if layer["kind"] == "dense"
                else lm_cache.ArraysCache(layer.get("size", 2)) if layer["kind"] == "recurrent"
                else lm_cache.RotatingKVCache(max_size=layer["max_size"], keep=layer.get("keep", 0))
                for layer in self.layout]


def rollback_on_copy(cache: Any, n: int) -> Any:
    """The arrays a ``copy.copy`` of recurrent layer ``cache`` holds after
    its rollback of ``n`` tokens (``cache`` untouched), or a
    ``kvspec.fuzz.recurrent._Probe`` of what the copy or the rollback raised."""
    try:
        dup = copy.copy(cache)
        dup.trim(n)
        return tuple(dup.cache)
    except Exception as exc:  # noqa: BLE001 - reported by the comparison
        return _Probe(exc)


class LayersLockstep(Lockstep):
    """Drives a spec ``LayersWorld`` and a list of implementation caches.

    ``factories``: ``"dense"`` / ``"rotating"`` classes for the layers (so
    every per-kind injected bug also runs inside a list) and ``"layers"``, a
    :class:`ListOps` (sub)class for the list-level operations."""

    spec_module = sl

    @classmethod
    def check_cache(cls, cache: dict[str, Any]) -> None:
        build = cache.get("build", "list")
        if build not in BUILDS:
            raise TraceFormatError(f"field cache.build: must be one of {', '.join(BUILDS)}, got {build!r}")
        drafts = cache.get("num_draft_tokens", 0)
        if isinstance(drafts, bool) or not isinstance(drafts, int) or drafts < 0:
            raise TraceFormatError(f"field cache.num_draft_tokens: must be an integer >= 0, got {drafts!r}")
        if cache["layers"] and cache["layers"][0]["kind"] == "recurrent":
            raise TraceFormatError(
                "field cache.layers.0.kind: layer 0 of a list must be an attention layer (dense or rotating), got "
                "recurrent: the harness reads layer 0 as the list's attention view (rows of another shape or dtype, "
                "held windows and the lifecycle checks address it); a model whose first layer is recurrent "
                "(nemotron_h, lfm2) is covered by the same list with an attention layer first, since a list trim or "
                "restore is all or none whatever the layers' order (kvspec.spec.layers.list_trim_count)")
        for j, layer in enumerate(cache["layers"]):
            own = sorted(set(layer) & {"mode", "step", "undo", "depth"})
            if build == "make_prompt_cache" and own:
                raise TraceFormatError(
                    f"field cache.layers.{j}.{own[0]}: with build make_prompt_cache every layer takes the list's "
                    "mode and step and every ring undo (every recurrent layer depth) num_draft_tokens (one call "
                    "builds them all)")
            if layer["kind"] == "recurrent":
                if layer.get("kernel", 4) < 2:
                    raise TraceFormatError(f"field cache.layers.{j}.kernel: must be an integer >= 2 (a conv of "
                                           f"width 1 keeps no window), got {layer['kernel']}")
                if layer.get("size", 2) not in (1, 2):
                    raise TraceFormatError(f"field cache.layers.{j}.size: must be 1 (conv window only) or 2 (conv "
                                           f"window and recurrent state), got {layer['size']}")
            if layer["kind"] == "rotating" and layer.get("keep", 0) >= layer["max_size"]:
                raise TraceFormatError(
                    f"field cache.layers.{j}.keep: must be < max_size ({layer['max_size']}), got {layer.get('keep', 0)}"
                )

    def __init__(self, cache: dict[str, Any], factories: dict[str, Any] | None = None):
        super().__init__(cache)
        factories = factories or {}
        drafts = cache.get("num_draft_tokens", 0)
        self.pattern = spec_pattern(cache["layers"], cache["mode"], cache["step"], drafts)
        self.world = sl.new_world(self.pattern, self.spec_inplace())
        self.prev_world = self.world
        dense_cls = factories.get("dense", KVCache)
        ring_cls = factories.get("rotating", RotatingKVCache)
        ops = factories.get("layers", ListOps)
        self.list_ops: ListOps = ops()
        if cache.get("build", "list") == "make_prompt_cache":
            self.reached("lists built by make_prompt_cache")
            classes = {k: factories[k] for k in ("dense", "rotating") if k in factories}
            model = LayoutModel(cache["layers"])
            # the depth comes as num_draft_tokens, or (an odd count of layers) as undo, which
            # alone must give every ring its undo log and install the step recorder too
            depth_kw = {"undo": drafts} if len(cache["layers"]) % 2 else {"num_draft_tokens": drafts}
            self.caches: list[Any] = self.build(self.list_ops.make_prompt_cache, model=model,
                                                mode=cache["mode"], step=cache["step"], classes=classes or None,
                                                **depth_kw)
            # the mixers the call's step recorder wrapped (when a layer got a depth)
            mixers = {j: block.mixer for j, block in enumerate(model.layers) if isinstance(block, FakeBlock)}
        else:
            rec_cls = factories.get("recurrent", RecurrentCache)
            self.caches = [
                self.build(dense_cls, mode=p.mode, step=p.step) if isinstance(p, sl.DenseLayer)
                else rec_cls(size=p.size, depth=p.depth) if isinstance(p, sl.RecurrentLayer)
                else self.build(ring_cls, max_size=p.max_size, keep=p.keep, step=p.step,
                                **({"undo": p.undo} if p.undo else {}))
                for p in self.pattern
            ]
            mixers = {}
            for j, p in enumerate(self.pattern):
                if isinstance(p, sl.RecurrentLayer):
                    one = FakeModel(p.kernel, p.size)
                    record_steps(one)  # as make_prompt_cache(model, num_draft_tokens=k) does
                    mixers[j] = one.layers[0].mixer
        #: recurrent layer index -> (its rows, its mixer): the harness plays
        #: the model's recurrent layers (kvspec.fuzz.recurrent)
        self.recurrent = {j: (RecurrentRows(cache["batch"], cache["layers"][j].get("channels", 4), self.dtype), m)
                          for j, m in mixers.items()}
        self.pointers_before: list[tuple[int, int] | None] = []
        #: names of list snapshots dropped so far (``misuse_name`` reuses them)
        self.dropped: set[str] = set()

    def wide_rows(self) -> bool | str:
        modes = {self.layer_mode(j) for j in range(len(self.pattern))}
        return True if modes == {"fp16"} else "edge" if modes <= {"fp16", "int8"} else False

    def stored_form(self, x: Any, mode: str = "fp16") -> Any:
        return int8_oracle(x) if mode == "int8" else x

    def host_stored_rows(self, token: int, mode: str) -> Any:
        """Int8 layers: the NumPy oracle on the rows' host form (no MLX round trip)."""
        if mode == "int8":
            k, v = self.host_rows([token])
            return int8_oracle_host(k, self.dtype), int8_oracle_host(v, self.dtype)
        return super().host_stored_rows(token, mode)

    def step(self, index: int, op: dict[str, Any]) -> None:
        self.current_index = index
        super().step(index, op)

    def impl_caches(self) -> list[Any]:
        return list(self.caches)

    @property
    def cache(self) -> Any:
        """Layer 0 (the base class reads ``self.cache`` in a few places)."""
        return self.caches[0]

    def layer_mode(self, j: int) -> str:
        p = self.pattern[j]
        return p.mode if isinstance(p, sl.DenseLayer) else "fp16"

    # -- implementation side ---------------------------------------------------
    def impl_apply(self, op: dict[str, Any]) -> Any:
        name = op["op"]
        if name == "append":
            self.before_append(op)
            start = self.world.layers[0].next_token
            tokens = list(range(start, start + op["n"]))
            # each layer gets its own arrays, as in a model (a ring may keep
            # a prefill's input as its buffer); a recurrent layer is called
            # with its conv input (through the step recorder when installed)
            self.returned = tuple(self._recurrent_call(j, c, tokens) if j in self.recurrent
                                  else c.update_and_fetch(*self.input_rows(tokens)) for j, c in enumerate(self.caches))
            return self.returned
        if name == "fetch":
            return tuple(tuple(c.cache) if j in self.recurrent else c.fetch() for j, c in enumerate(self.caches))
        if name in ("hold", "release_hold"):
            return self.impl_hold(name)
        if name == "trim":
            return self._list_trim(op["n"])
        if name == "can_trim":
            return self.list_ops.can_trim(self.caches)
        if name == "snapshot":
            if op["name"] in self.holders:
                raise StateError(f"snapshot: name {op['name']!r} is already in use")
            self.holders[op["name"]] = self.list_ops.snapshot(self.caches)
            return None
        if name in ("restore", "drop"):
            snaps = self.holders.get(op["name"])
            if snaps is None:
                raise StateError(f"{name}: no snapshot or handle named {op['name']!r}")
            if name == "restore":
                self.list_ops.restore(self.caches, self.as_snapshots(snaps))
            else:
                del self.holders[op["name"]]
                self.dropped.add(op["name"])
            return None
        if name == "copy":
            return self._copy(op)
        if name in ("append_mismatch", "append_pair_mismatch"):
            return self._append_mismatch(op)
        if name == "restore_mixed":
            return self._restore_mixed(op)
        if name == "trim_refused_late":
            return self._trim_refused_late(op)
        if name == "reload":
            return self._reload(op)
        if name == "layer":
            return self._layer_op(op["index"], op["do"])
        raise InvalidArgumentError(f"{name}: not an operation of a prompt cache (a list of layers)")

    _loudness: Any = None

    @staticmethod
    def _fields_id(c: Any) -> tuple[Any, ...]:
        """Which objects a layer's fields hold (a strict refusal replaces none)."""
        return tuple(sorted((k, id(v)) for k, v in vars(c).items()))

    def _list_trim(self, n: Any) -> int:
        """The list trim under test, its RollbackWarnings recorded with each
        layer's ``rollback_warned`` before and after; when it trims nothing,
        the same trim with ``strict=True`` (``ListOps.trim_strict``) is
        probed: what it raised or returned, and whether it changed any
        layer (:meth:`_check_loudness` compares them with the spec)."""
        self._loudness = None
        flags = [getattr(c, "rollback_warned", None) for c in self.caches]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", RollbackWarning)
            count = self.list_ops.trim(self.caches, n)
        warned = sum(issubclass(w.category, RollbackWarning) for w in seen)
        after = [getattr(c, "rollback_warned", None) for c in self.caches]
        strict: tuple[str, Any] | None = None
        changed = False
        if count == 0:
            before = [self._fields_id(c) for c in self.caches]
            try:
                with warnings.catch_warnings(record=True) as loud:
                    warnings.simplefilter("always", RollbackWarning)
                    strict = ("returned", self.list_ops.trim_strict(self.caches, n))
                if any(issubclass(w.category, RollbackWarning) for w in loud):
                    strict = ("warned", strict[1])
            except StateError as exc:
                strict = ("raised", str(exc))
            except Exception as exc:  # noqa: BLE001 - compared with the spec's refusal below
                strict = ("raised another error", error_text(exc))
            changed = before != [self._fields_id(c) for c in self.caches]
        self._loudness = (flags, warned, after, strict, changed)
        return count

    def _check_loudness(self, index: int, op: dict[str, Any], count: int) -> None:
        """A list trim that trims nothing is loud exactly for the layers that
        refuse (spec: ``want = min(n, every layer's rows)`` beyond a layer's
        exact bound, kvspec.spec.layers.layer_trim_bounds): each of them warns once
        per cache (one RollbackWarning, ``rollback_warned`` set; none for a
        layer that warned before), no other layer warns; with
        ``strict=True`` the same trim raises StateError naming exactly
        those layers and changes nothing; with no refusing layer (``n <=
        0``) it returns 0 without a word (semantics.md 6)."""
        got, self._loudness = self._loudness, None
        if got is None:
            return
        flags, warned, after, strict, changed = got
        if count != 0:
            if warned:
                raise Divergence(index, op, "a list trim that trimmed warned", "no RollbackWarning",
                                 f"{warned} RollbackWarning(s)")
            return
        n = op["n"]
        bounds = [sl.layer_trim_bounds(w.cache) for w in self.prev_world.layers]
        refusing: list[int] = []
        if n > 0 and bounds:
            want = min([n, *(rows for rows, _ in bounds)])
            refusing = [j for j, (_, exact) in enumerate(bounds) if want > exact]
        expected = sum(1 for j in refusing if not flags[j])
        if warned != expected:
            raise Divergence(index, op, "refused list trim: RollbackWarnings differ",
                             f"{expected} (once per refusing layer {refusing} not warned before)", f"{warned}")
        for j, (was, now) in enumerate(zip(flags, after)):
            want_flag = True if j in refusing and was is not None else was
            if now != want_flag:
                raise Divergence(index, op, f"refused list trim: layer {j} rollback_warned differs",
                                 f"rollback_warned={want_flag}", f"rollback_warned={now}")
        if changed:
            raise Divergence(index, op, "a strict refused list trim changed a layer", "nothing changed",
                             f"strict=True: {strict}")
        if refusing:
            if strict is None or strict[0] != "raised" or f"layer(s) {refusing}" not in strict[1]:
                raise Divergence(index, op, "strict refused list trim",
                                 f"StateError naming layer(s) {refusing}", f"strict=True: {strict}")
        elif strict != ("returned", 0):
            raise Divergence(index, op, "strict list trim of nothing", "returns 0 without a word",
                             f"strict=True: {strict}")

    def _recurrent_call(self, j: int, c: Any, tokens: list[int]) -> tuple[Any, ...]:
        """Recurrent layer ``j`` called with ``tokens``' conv input (a mask
        of the call's shape at batch > 1); returns the arrays it then holds."""
        rows, mixer = self.recurrent[j]
        x = rows.input(tokens)
        mixer(x, mx.ones(x.shape[:2], dtype=mx.bool_) if self.cfg["batch"] > 1 else None, c)
        return tuple(c.cache)

    #: a layer's refusal of another layer's snapshot, or of its part of a
    #: list trim, is in that layer's words
    OWN_WORDED_OPS = Lockstep.OWN_WORDED_OPS | {"restore_mixed", "trim_refused_late"}

    def next_identity(self) -> int:
        return self.world.layers[0].next_token

    @staticmethod
    def as_snapshots(held: list[Any]) -> list[Any]:
        """A held list as the snapshots a list restore takes: a list
        snapshot as it is, a held copy of the list (``copy``) as a snapshot
        of each copied layer."""
        return [c.snapshot() if is_cache_copy(c) or isinstance(c, RecurrentCache) else c for c in held]

    def _copy(self, op: dict[str, Any]) -> None:
        """A copy of the whole list (``ListOps.copy``,
        ``kvspec.impl.layers.copy_prompt_cache``) held under ``name``; ``live:
        copy`` goes on with the copy and holds the original."""
        live = op.get("live", "original")
        if live not in ("copy", "original"):
            raise InvalidArgumentError(f"copy: live must be 'copy' or 'original', got {live!r}")
        if op["name"] in self.holders:
            raise StateError(f"copy: name {op['name']!r} is already in use")
        dup = self.list_ops.copy(self.caches, op.get("deep", True))
        if live == "copy":
            self.holders[op["name"]], self.caches = self.caches, dup
        else:
            self.holders[op["name"]] = dup
        self.reached("list copies")

    def _append_mismatch(self, op: dict[str, Any]) -> str:
        """The same rows of another shape or dtype handed to every layer, as
        a forward pass would: each layer must refuse them. The first
        refusal is raised once every layer has refused; a layer that takes
        the rows is named in the result (the spec refuses: the refusal
        comparison reports it). ``append_pair_mismatch``: a pair whose
        values disagree with its keys, the same way."""
        rows = self.pair_mismatched_rows if op["op"] == "append_pair_mismatch" else self.mismatched_rows
        k, v = rows(op["n"], op["differs"])
        refusals, took = [], []
        for j, c in enumerate(self.caches):
            if j in self.recurrent:
                continue  # a forward pass hands K/V rows to the attention layers only
            try:
                c.update_and_fetch(k, v)
            except Exception as exc:  # noqa: BLE001 - each layer's refusal, compared below
                refusals.append(exc)
            else:
                took.append(j)
        if took:
            return f"layer(s) {took} took rows of another {op['differs']}"
        raise refusals[0]

    def _trim_refused_late(self, op: dict[str, Any]) -> int:
        """The list trim under test (``ListOps.trim``) of ``n`` rows while
        layer ``layer`` refuses its own part (``how``: its ``trim`` raises
        StateError, or trims nothing and returns 0, as a ring failing closed
        would, or ``partial``: runs its real trim, then raises StateError,
        or ``fewer``: trims and returns one row fewer than asked, or
        ``more``: trims the rows asked and returns one more: every way the
        promise of exactly ``count`` can break),
        after the layers before it trimmed: the list trim must end with
        every layer as it was, the refusing one too. The refusing ``trim``
        is the layer's for this call only."""
        layer, how = op["layer"], op.get("how", "raises")
        # the trace's arguments, as the spec checks them (before the list is touched)
        sl.check_late_trim(op["n"], layer, how, len(self.caches))
        c = self.caches[layer]
        real_trim = c.trim

        def refuse(n: int) -> int:
            if how == "partial":
                got = real_trim(n)
                raise StateError(f"trim: layer {layer} trimmed {got} rows, then refused")
            if how == "raises":
                raise StateError(f"trim: layer {layer} refuses to trim {n} rows")
            if how == "fewer":
                return int(real_trim(n - 1))
            if how == "more":
                return int(real_trim(n)) + 1
            return 0

        c.trim = refuse
        try:
            self.reached("late list refusals")
            return self.list_ops.trim(self.caches, op["n"])
        finally:
            vars(c).pop("trim", None)

    def _restore_mixed(self, op: dict[str, Any]) -> None:
        """The list restore of snapshot ``name`` with layer ``layer``'s entry
        replaced by layer ``source``'s: the list operation under test must
        refuse it (the layer does) and leave every layer as it was. The
        trace's preconditions (indices, a pair that cannot swap snapshots)
        are the spec's (``kvspec.spec.layers.w_restore_mixed``), checked here
        before the list is touched."""
        snaps = self.holders.get(op["name"])
        if snaps is None:
            raise StateError(f"restore: no snapshot or handle named {op['name']!r}")
        layer, source = op["layer"], op["source"]
        n_layers = len(self.caches)
        for field_name, j in (("layer", layer), ("source", source)):
            if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < n_layers:
                raise InvalidArgumentError(
                    f"restore_mixed: {field_name} must satisfy 0 <= {field_name} < {n_layers}, got {j!r}")
        if sl.layers_interchangeable(self.world.layers[layer], self.world.layers[source], op["name"]):
            raise InvalidArgumentError(f"restore_mixed: layers {layer} and {source} take each other's snapshots; "
                                       "pick layers of another kind or window")
        mixed = self.as_snapshots(snaps)
        mixed[layer] = mixed[source]
        self.reached("late list refusals")
        self.list_ops.restore(self.caches, mixed)

    def _reload(self, op: dict[str, Any]) -> None:
        """The whole list saved and loaded back: ``via: file`` through a
        prompt-cache file of every layer (``ListOps.save_prompt_cache`` /
        ``load_prompt_cache``; ``env``: ``KV_INPLACE_WRITE`` while loading,
        a process whose switch differs from the file's), ``via: state`` in
        mlx-lm's load order on every layer (``state``, then
        ``meta_state``). The loaded list goes on as the live one."""
        via, env = op.get("via", "file"), op.get("env")
        if via not in ("file", "state"):
            raise InvalidArgumentError(f"reload: via must be 'file' or 'state', got {via!r}")
        if env is not None and not isinstance(env, str):
            raise TraceFormatError(f"reload: env must be a string (a KV_INPLACE_WRITE spelling), got {env!r}")
        if via == "state":
            for c in self.caches:
                state, meta = c.state, c.meta_state
                c.state = state
                c.meta_state = meta
            return
        self.caches = reload_through_file(self.caches, self.list_ops.save_prompt_cache,
                                          self.list_ops.load_prompt_cache, env)

    def _layer_op(self, index: Any, inner: dict[str, Any]) -> Any:
        n_layers = len(self.caches)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n_layers:
            raise InvalidArgumentError(f"layer: index must satisfy 0 <= index < {n_layers}, got {index!r}")
        if inner.get("op") not in sl.LAYER_OPS:
            raise InvalidArgumentError(f"layer: op must be one of {sl.LAYER_OPS}, got {inner.get('op')!r}")
        c = self.caches[index]
        if inner["op"] == "fetch":
            return tuple(c.cache) if index in self.recurrent else c.fetch()
        if not isinstance(c, KVCache):
            what = "recurrent" if index in self.recurrent else "rotating"
            raise UnsupportedOperationError(f"trim_front: not an operation of the {what} cache (layer {index})")
        return c.trim_front_keep_sink(inner["n"], inner.get("keep", 0))

    # -- checks -------------------------------------------------------------------
    def before_append(self, op: dict[str, Any]) -> None:
        """Every layer's ``make_mask`` against its kind's rule, before the
        append (as a model calls it); each layer's data pointer."""
        for j, (w, c) in enumerate(zip(self.world.layers, self.caches)):
            if j in self.recurrent:
                continue  # a recurrent layer has no mask (its conv window is the whole context)
            if isinstance(w, sd.DenseWorld):
                check_dense_masks(self, op, w.cache.live_len, c, f"layer {j}: ")
            else:
                check_ring_masks(self, op, w.cache, c, True, f"layer {j}: ")
        self.pointers_before = [self._pointers(c) for c in self.caches]

    def _pointer(self, c: Any) -> int | None:
        """Data pointer of a cache's or snapshot's keys buffer (None: none)."""
        if hasattr(c, "buffers"):
            return None if c.buffers is None else self.pointer(c.buffers.keys)
        return None if getattr(c, "keys", None) is None else self.pointer(c.keys)

    def _pointers(self, c: Any) -> tuple[int, int] | None:
        """Data pointers of a cache's keys and values buffers (None: none):
        what an in-place write must leave where it was."""
        if hasattr(c, "buffers"):
            return None if c.buffers is None else (self.pointer(c.buffers.keys), self.pointer(c.buffers.values))
        return None if getattr(c, "keys", None) is None else (self.pointer(c.keys), self.pointer(c.values))

    def compare_result(self, index: int, op: dict[str, Any], s: Any, i: Any) -> None:
        if op["op"] == "append":
            for j, (s_res, i_win) in enumerate(zip(s, i)):
                if j in self.recurrent:
                    self._check_recurrent(index, op, j, self.world.layers[j].cache, i_win, "returned")
                elif not self.window_matches(s_res.window, i_win, self.layer_mode(j)):
                    raise Divergence(index, op, f"layer {j}: returned window differs", list(s_res.window),
                                     self.identify(i_win, self.layer_mode(j)))
            s_inplace = [r.inplace for j, r in enumerate(s) if j not in self.recurrent]
            i_inplace = [c.last_write_inplace for j, c in enumerate(self.caches) if j not in self.recurrent]
            if self.check_inplace and s_inplace != i_inplace:
                raise Divergence(index, op, "in-place decisions differ", f"inplace={s_inplace}", f"inplace={i_inplace}")
            if self.check_sharing and inplace_keeps_memory():  # not under CUDA's donate (kvspec.fuzz.lockstep)
                attention = [j for j in range(len(self.caches)) if j not in self.recurrent]
                for j, inplace in zip(attention, s_inplace):
                    before, c = self.pointers_before[j], self.caches[j]
                    if inplace and before is not None and self._pointers(c) != before:
                        raise Divergence(index, op, f"layer {j}: an in-place write moved the cache's memory",
                                         "same memory (in place)",
                                         f"data pointers (keys, values) {before} -> {self._pointers(c)}")
            self.reached("list appends")
        elif op["op"] in ("fetch", "layer") and (op["op"] == "fetch" or op["do"]["op"] == "fetch"):
            return
        elif s != i:
            raise Divergence(index, op, "return value differs", s, i)
        elif op["op"] == "trim":
            self._check_loudness(index, op, s)
            self._count_trim(s)

    def _count_trim(self, count: int) -> None:
        before = self.prev_world
        rings = [w.cache for w in before.layers if isinstance(w, sr.RotatingWorld)]
        dense_layers = [w.cache for w in before.layers if isinstance(w, sd.DenseWorld)]
        recurrent = [w.cache for w in before.layers if isinstance(w, src.RecurrentWorld)]
        if recurrent and count > 0:
            self.reached("list trims with recurrent layers")
            if any(count == src.trimmable_rows(c) for c in recurrent):
                self.reached("list trims of a recurrent layer's whole coverage")
        if recurrent and count == 0 and any(c.offset and src.trimmable_rows(c) < min(x.offset for x in recurrent)
                                            for c in recurrent):
            self.reached("list trim refused by a recurrent layer")
        if count == 0 and any(not sr.is_trimmable(c) for c in rings) and any(c.live_len for c in dense_layers):
            self.reached("list trim refused by a wrapped ring")
        if count > 0 and any(c.live_start > 0 for c in dense_layers):
            self.reached("list trim after a front trim")
        if count > 0 and rings and dense_layers:
            self.reached("mixed list trims")

    def spec_observables(self) -> dict[str, Any]:
        out: dict[str, Any] = {"can_trim": sl.can_trim_prompt_cache(sl.caches_of(self.world))}
        for j, w in enumerate(self.world.layers):
            c = w.cache
            if isinstance(w, src.RecurrentWorld):
                obs = {"offset": c.offset, "trimmable": src.is_trimmable(c), "trimmable_rows": src.trimmable_rows(c)}
            elif isinstance(w, sd.DenseWorld):
                obs = {"offset": c.offset, "live_start": c.live_start, "live_len": c.live_len, "capacity": c.capacity}
            else:
                obs = {"offset": c.offset, "idx": c.idx, "capacity": c.capacity, "trimmable": sr.is_trimmable(c),
                       "trimmable_rows": sr.trimmable_rows(c)}
            out.update({f"layer {j} {k}": v for k, v in obs.items()})
        switch = self.spec_inplace()
        for j, p in enumerate(self.pattern):
            out[f"layer {j} settings"] = (("dense", p.mode, p.step, switch) if isinstance(p, sl.DenseLayer)
                                          else ("recurrent", p.size, p.depth) if isinstance(p, sl.RecurrentLayer)
                                          else ("rotating", p.max_size, p.keep, p.step, p.undo, switch))
        return out

    def impl_observables(self) -> dict[str, Any]:
        out: dict[str, Any] = {"can_trim": impl_layers.can_trim_prompt_cache(self.caches)}
        for j, c in enumerate(self.caches):
            if isinstance(c, RecurrentCache):
                obs = {"offset": c.offset, "trimmable": c.is_trimmable(), "trimmable_rows": c.trimmable_rows()}
            elif isinstance(c, KVCache):
                obs = {"offset": c.offset, "live_start": c.live_start, "live_len": c.live_len, "capacity": c.capacity}
            else:
                obs = {"offset": c.offset, "idx": c.idx, "capacity": c.capacity, "trimmable": c.is_trimmable(),
                       "trimmable_rows": c.trimmable_rows()}
            out.update({f"layer {j} {k}": v for k, v in obs.items()})
        for j, c in enumerate(self.caches):
            out[f"layer {j} settings"] = (
                ("recurrent", len(c.cache), c.depth) if isinstance(c, RecurrentCache)
                else ("dense", c.mode, c.step, c.inplace) if isinstance(c, KVCache)
                else ("rotating", c.max_size, c.keep, c.step, getattr(c, "undo", 0), c.inplace))
        return out

    def spec_views(self) -> dict[str, tuple[int, ...]]:
        views: dict[str, tuple[int, ...]] = {}
        for j, w in enumerate(self.world.layers):
            views[f"layer {j}"] = w.cache.window()
            for name, holder in w.holders.items():
                views[f"holder:{name}:layer {j}"] = holder.window()
            if w.held is not None:
                views[f"held:layer {j}"] = w.held.window() if isinstance(w, sd.DenseWorld) else w.held
        return views

    def impl_views(self) -> dict[str, Any]:
        views: dict[str, Any] = {}
        for j, c in enumerate(self.caches):
            if j in self.recurrent:
                views[f"layer {j}"] = tuple(c.cache)
                for name, snaps in self.holders.items():
                    views[f"holder:{name}:layer {j}"] = self._recurrent_read(c, snaps[j])
            else:
                views[f"layer {j}"] = c.fetch()
                for name, snaps in self.holders.items():
                    views[f"holder:{name}:layer {j}"] = snaps[j].fetch()
            if self.held is not None:
                views[f"held:layer {j}"] = self.held[j]
        return views

    def view_mode(self, name: str) -> str | None:
        return self.layer_mode(int(name.rsplit(" ", 1)[1]))

    @staticmethod
    def _recurrent_read(live: Any, held: Any) -> Any:
        """The arrays a recurrent layer's holder holds: a copy's own, a
        snapshot's as a fresh layer of the live one's size and depth
        restores them (reading, never writing, the snapshot)."""
        if isinstance(held, RecurrentCache):
            return tuple(held.cache)
        try:
            fresh = type(live)(size=len(live.cache), depth=live.depth)
            fresh.restore(held)
            return tuple(fresh.cache)
        except Exception as exc:  # noqa: BLE001 - compared (and reported) as a read that raised
            return _Probe(exc)

    def view_matches(self, name: str, tokens: tuple[int, ...], arrays: Any) -> bool:
        """Recurrent layers' views are compared by :meth:`_compare_recurrent`."""
        if int(name.rsplit(" ", 1)[1]) in self.recurrent:
            return True
        return super().view_matches(name, tokens, arrays)

    def _check_recurrent(self, index: int, op: dict[str, Any], j: int, want: src.RecurrentCache, got: Any,
                         label: str) -> None:
        rows, _ = self.recurrent[j]
        p = self.pattern[j]
        bad = arrays_mismatch(rows, p.kernel, p.size, want, got, self.host)
        if bad is not None:
            what, spec_side, impl_side = bad
            raise Divergence(index, op, f"layer {j}: {label} {what}", spec_side, impl_side)

    def _compare_recurrent(self, index: int, op: dict[str, Any]) -> None:
        """Every recurrent layer's conv window and state, live and in every
        holder, row by row (kvspec.fuzz.recurrent.arrays_mismatch)."""
        views = self.step_views()
        for j in self.recurrent:
            w = self.world.layers[j]
            self._check_recurrent(index, op, j, w.cache, views[f"layer {j}"], "live")
            for name, holder in w.holders.items():
                self._check_recurrent(index, op, j, holder.cache, views[f"holder:{name}:layer {j}"],
                                      f"view of {name!r} changed (isolation):")

    def _probe_rollbacks(self, index: int, op: dict[str, Any]) -> None:
        """Every rollback ``n`` in ``1..coverage`` (the spec's) of every
        recurrent layer, each taken on a ``copy.copy`` of the live layer
        (the list untouched) and compared with the spec layer after that
        rollback, conv window and state row by row, as the recurrent
        kind's harness probes (``kvspec.fuzz.recurrent``): a wrong or clobbered
        checkpoint shows after the op that wrote it, not only at a list
        trim that lands on it. The copies' arrays are read in one MLX
        evaluation; a rollback that raises is reported as a read that
        raised."""
        probes = []
        for j in self.recurrent:
            want = self.world.layers[j].cache
            for n in range(1, src.trimmable_rows(want) + 1):
                probes.append((j, n, src.trim(want, n)[1], rollback_on_copy(self.caches[j], n)))
        if not probes:
            return
        self.read_all([a for *_, got in probes if not isinstance(got, _Probe) for a in got])
        for j, n, want, got in probes:
            self._check_recurrent(index, op, j, want, got, f"live after a rollback of {n} (on a copy):")
        self.reached("recurrent rollbacks probed")

    def compare_state(self, index: int, op: dict[str, Any]) -> None:
        super().compare_state(index, op)
        self._compare_recurrent(index, op)
        self._probe_rollbacks(index, op)

    def view_label(self, name: str) -> str:
        if name.startswith("layer "):
            return f"{name}: live window differs"
        return f"view of {name} changed (isolation)"

    def check_expect(self, index: int, op: dict[str, Any]) -> None:
        """``expect`` of one layer (``layer``, default 0), of the live list or
        of a list snapshot (``of``)."""
        j = op.get("layer", 0)
        name = op.get("of")
        key = f"layer {j}" if name is None else f"holder:{name}:layer {j}"
        s_views, i_views = self.spec_views(), self.impl_views()
        if key not in s_views:
            names = sorted({k.split(":")[1] for k in s_views if k.startswith("holder:")})
            raise Divergence(index, op, f"expect: no layer {j} or snapshot named {name!r}",
                             f"holders are {names}", f"holders are {names}")
        want, have = list(op["window"]), list(s_views[key])
        if (sorted(want) != sorted(have)) if op.get("order") == "set" else want != have:
            raise Divergence(index, op, "trace's 'expect' fails on the spec", have, want, ("spec says", "trace expects"))
        if j in self.recurrent:
            want_cache = (self.world.layers[j].cache if name is None else self.world.layers[j].holders[name].cache)
            self._check_recurrent(index, op, j, want_cache, i_views.get(key), "expect:")
            return
        mode = self.layer_mode(j)
        if not self.window_matches(tuple(have), i_views.get(key), mode):
            raise Divergence(index, op, "trace's 'expect' fails on the implementation", want,
                             self.identify(i_views.get(key), mode), ("trace expects", "impl did"))

    def check_op_checks(self, index: int, op: dict[str, Any], spec_out: Any) -> None:
        """A list op's own checks: ``returns`` (an append: every layer's
        window, a list of lists), ``inplace`` (an append: every layer's
        decision equals it); ``capacity`` is a per-cache check, refused."""
        if "capacity" in op:
            raise TraceFormatError(f"op {index} field 'capacity': a list of layers has one capacity per layer; "
                                   "check it per layer with expect or a per-kind trace")
        if spec_out.error is not None or op["op"] != "append":
            super().check_op_checks(index, op, spec_out)
            return
        if "returns" in op:
            got = [list(r.window) for r in spec_out.result]
            if got != op["returns"]:
                raise Divergence(index, op, "trace's 'returns' check fails", got, op["returns"],
                                 ("spec says", "trace expects"))
        if "inplace" in op:
            got = [r.inplace for r in spec_out.result]
            if any(g != op["inplace"] for g in got):
                raise Divergence(index, op, "trace's 'inplace' check fails", f"inplace={got}",
                                 f"inplace={op['inplace']} in every layer", ("spec says", "trace expects"))

    def predictions(self, op: dict[str, Any], result: Any) -> dict[str, Any]:
        if op["op"] in ("trim", "can_trim"):
            return {"returns": result}
        return {}

    def expect_ops(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for key, window in self.spec_views().items():
            if key.startswith("held:"):
                continue
            layer = int(key.rsplit(" ", 1)[1])
            op: dict[str, Any] = {"op": "expect", "window": list(window), "layer": layer}
            if key.startswith("holder:"):
                op["of"] = key.split(":")[1]
            out.append(op)
        return out

    # -- memory sharing -----------------------------------------------------------
    def written_pairs(self, names: list[str]) -> list[tuple[str, str]]:
        return [(f"layer {j}", n) for j in range(len(self.caches)) if f"layer {j}" in names
                for n in names if n.startswith("holder:") and n.endswith(f":layer {j}")]

    def shared_by(self, op: dict[str, Any]) -> list[tuple[str, str]]:
        if op["op"] in ("snapshot", "restore"):
            return [(f"layer {j}", f"holder:{op['name']}:layer {j}") for j in range(len(self.caches))]
        return []

    def spec_buffers(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for j, w in enumerate(self.world.layers):
            if isinstance(w, src.RecurrentWorld):
                continue  # its arrays are replaced on every call: no buffer to share
            if isinstance(w, sd.DenseWorld):
                out[f"layer {j}"] = None if w.cache.buffer is None else ("d", j, w.cache.buffer.ident)
                for name, holder in w.holders.items():
                    out[f"holder:{name}:layer {j}"] = None if holder.buffer is None else ("d", j, holder.buffer.ident)
            else:
                out[f"layer {j}"] = ("r", j, w.cache.ident) if w.cache.slots else None
                for name, holder in w.holders.items():
                    out[f"holder:{name}:layer {j}"] = ("r", j, holder.cache.ident) if holder.cache.slots else None
        return out

    def impl_pointers(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for j, c in enumerate(self.caches):
            out[f"layer {j}"] = self._pointer(c)
            for name, snaps in self.holders.items():
                out[f"holder:{name}:layer {j}"] = self._pointer(snaps[j])
        return out


def dense_layer(step: int) -> dict[str, Any]:
    """A dense layer in the list's mode."""
    return {"kind": "dense", "step": step}


def ring_layer(max_size: int, keep: int, step: int, undo: int = 0) -> dict[str, Any]:
    """A ring layer; ``undo`` only when it has an undo log."""
    return {"kind": "rotating", "max_size": max_size, "keep": keep, "step": step, **({"undo": undo} if undo else {})}


def recurrent_layer(size: int, kernel: int, depth: int = 0, channels: int = 4) -> dict[str, Any]:
    """A hybrid model's recurrent layer; ``depth`` and ``channels`` only when
    not their defaults (0: no checkpoints; 4)."""
    return {"kind": "recurrent", "size": size, "kernel": kernel, **({"depth": depth} if depth else {}),
            **({"channels": channels} if channels != 4 else {})}


#: the checkpoint depths of a hybrid list's recurrent layers: 1 to 4 five times
#: in six, 0 (no checkpoints: every list trim refused) once, so that most
#: hybrid lists can roll back a speculative block (a list trim is bounded by
#: its shallowest recurrent layer); the first is what a shrunk example keeps
HYBRID_DEPTHS = (1, 2, 3, 4, 2, 0)
#: the most speculative rounds one ``speculate`` step runs (its draws fit a
#: program engine step: rounds, then per round the calls' form and the reject)
ROUNDS = 5


def is_hybrid(layers: list[dict[str, Any]]) -> bool:
    """Whether a trace's ``layers`` list holds a recurrent layer."""
    return any(layer["kind"] == "recurrent" for layer in layers)


@st.composite
def layer_patterns(draw: st.DrawFn, recurrent: bool = False) -> list[dict[str, Any]]:
    """Layer patterns engines build: all dense (1 to 3 layers); dense plus
    rings of different windows (gemma-style, every ring its own W); rings
    with sinks; rings with an undo log of 1 to 3 rows (exact rollback after
    a wrap within its depth) or none. With ``recurrent``, also hybrid
    models (qwen3_next, nemotron_h, lfm2 style; 3 draws in 7): dense layers, 1 or 2
    recurrent layers (size 1 or 2, kernel 2 to 4, checkpoint depth 0 to 4,
    mostly 1 to 4: :data:`HYBRID_DEPTHS`) and sometimes a ring (its undo
    log mostly the deepest recurrent layer's depth). The first layer is
    dense (front trims address it)."""
    step = st.integers(1, 8)
    shapes = ["all dense", "dense + rings", "dense + rings", "dense + sink rings"]
    shape = draw(st.sampled_from(shapes + (["hybrid"] * 3 if recurrent else [])))
    layers = [dense_layer(draw(step))]
    if shape == "hybrid":
        for _ in range(draw(st.integers(1, 2))):
            layers.append(recurrent_layer(draw(st.sampled_from([2, 2, 1])), draw(st.integers(2, 4)),
                                          draw(st.sampled_from(HYBRID_DEPTHS)), draw(st.sampled_from([4, 2]))))
        if draw(st.booleans()):
            # a ring's undo log mostly as deep as the recurrent layers' checkpoints (as make_prompt_cache
            # gives both num_draft_tokens), so that a wrapped ring does not refuse every speculative trim
            deepest = max(layer.get("depth", 0) for layer in layers)
            w = draw(st.integers(2, 6))
            layers.append(ring_layer(w, draw(st.integers(0, min(1, w - 1))), draw(step),
                                     draw(st.sampled_from([deepest, deepest, 0, 2]))))
        if draw(st.booleans()):
            layers.append(dense_layer(draw(step)))
        return layers
    if shape == "all dense":
        layers += [dense_layer(draw(step)) for _ in range(draw(st.integers(0, 2)))]
        return layers
    windows = draw(st.lists(st.integers(2, 8), min_size=1, max_size=3, unique=True))
    for w in windows:
        keep = draw(st.integers(1, min(2, w - 1))) if shape == "dense + sink rings" else draw(st.integers(0, min(2, w - 1)))
        undo = draw(st.sampled_from([0, 0, 1, 2, 3]))
        layers.append(ring_layer(w, keep, draw(step), undo))
    if draw(st.booleans()):
        layers.append(dense_layer(draw(step)))
    return layers


class LayersMachine(LifecycleRules, KVMachine):
    """List-level ops over mixed layer patterns: appends, atomic trims
    (after a wrap, after a front trim of a dense layer), list snapshots
    and restores, held windows; copies of the whole list, rows of another
    shape or dtype and reloads (:class:`kvspec.fuzz.machine.LifecycleRules`), and
    list restores and trims one layer refuses late."""

    kind = "layers"

    @initialize(layers=layer_patterns(recurrent=True), data=st.data())
    def init(self, layers: list[dict[str, Any]], data: st.DataObject) -> None:
        """Half the examples build the list through ``make_prompt_cache`` (the
        model-level configuration: a random layout of full-attention and
        sliding layers, the list's step and mode, ``num_draft_tokens`` 0 to
        3 for every ring's undo log (a hybrid list's: :data:`HYBRID_DEPTHS`,
        every recurrent layer's depth too), the in-place switch or a spelling of
        it); the others build each layer on its own (per-layer steps and
        undo depths)."""
        extra: dict[str, Any] = {}
        if data.draw(st.sampled_from(BUILDS), label="build") == "make_prompt_cache":
            layers = [{k: v for k, v in layer.items() if k not in ("mode", "step", "undo", "depth")} for layer in layers]
            # a hybrid list's num_draft_tokens is its recurrent layers' depth: mostly 1 to 4
            drafts = st.sampled_from(HYBRID_DEPTHS) if is_hybrid(layers) else st.integers(0, 3)
            extra = {"build": "make_prompt_cache", "step": data.draw(st.integers(1, 8), label="step"),
                     "num_draft_tokens": data.draw(drafts, label="num_draft_tokens")}
        self.setup(layers=layers, **extra, **self.draw_shape(data))

    @rule(via=st.sampled_from(["file", "state"]))
    def reload(self, via: str) -> None:
        """The whole list saved and loaded back, through a prompt-cache file
        (loaded in a process whose ``KV_INPLACE_WRITE`` says the opposite of
        the list's switch: every layer keeps the file's) or in mlx-lm's
        load order (``state``, then ``meta_state``); the list goes on with
        what was loaded, so its behaviour is compared from then on, and
        every layer's settings at once."""
        op: dict[str, Any] = {"op": "reload", "via": via}
        if via == "file":
            op["env"] = "0" if self.lock.spec_inplace() else "1"
        self.do(op)

    @property
    def offset(self) -> int:
        return self.lock.world.layers[0].cache.offset

    @rule(n=APPEND_N)
    def append(self, n: int) -> None:
        self.do({"op": "append", "n": n})

    @rule()
    def decode(self) -> None:
        self.do({"op": "append", "n": 1})

    @rule()
    def decode_again(self) -> None:
        """Rings need W decode steps to wrap."""
        self.do({"op": "append", "n": 1})

    @rule(n=st.integers(-1, 9))
    def trim(self, n: int) -> None:
        self.do({"op": "trim", "n": n})

    @rule(data=st.data())
    def misuse_name(self, data: st.DataObject) -> None:
        """A list snapshot's name used wrongly: unknown, dropped already, or
        already in use."""
        names = sorted(self.lock.world.names) + sorted(self.lock.dropped) + ["nope"]
        name = data.draw(st.sampled_from(names), label="name")
        op = data.draw(st.sampled_from(self.named_ops), label="op")
        self.do({"op": op, "name": name})

    @rule(n=st.integers(1, 3), data=st.data())
    def restore_refused_late(self, n: int, data: st.DataObject) -> None:
        """A list restore that a later layer refuses after the layers before
        it took their snapshots: snapshot the list, decode ``n`` rows, then
        restore with one layer (never layer 0) handed another kind's or
        window's snapshot. Refused, and every layer (the earlier ones
        included) must still hold the ``n`` new rows."""
        name = self.fresh_name("m")
        self.do({"op": "snapshot", "name": name})
        for _ in range(n):
            self.do({"op": "append", "n": 1})
        layers = self.lock.world.layers  # the pairs as they stand now: a recurrent one depends on both offsets
        pairs = [(k, j) for k in range(1, len(layers)) for j in range(len(layers))
                 if not sl.layers_interchangeable(layers[k], layers[j], name)]
        if not pairs:
            self.do({"op": "drop", "name": name})
            return
        k, j = data.draw(st.sampled_from(pairs), label="layer, source")
        self.do({"op": "restore_mixed", "name": name, "layer": k, "source": j})
        self.do({"op": "drop", "name": name})

    @rule(n=st.integers(1, 4), data=st.data())
    def trim_refused_late(self, n: int, data: st.DataObject) -> None:
        """A list trim that a later layer (never layer 0) refuses after the
        layers before it trimmed (its trim raises, trims nothing, or trims
        for real and then raises): decode
        ``n`` rows so that there is something to trim, then the trim.
        Refused, and every layer must still hold those rows, with its
        ownership and a ring's undo log (the next decode shows both)."""
        layers = len(self.lock.world.layers)
        if layers < 2:
            return
        for _ in range(n):
            self.do({"op": "append", "n": 1})
        self.do({"op": "trim_refused_late", "n": data.draw(st.integers(1, n), label="rows"),
                 "layer": data.draw(st.integers(1, layers - 1), label="layer"),
                 "how": data.draw(st.sampled_from(sl.LATE_TRIM_REFUSALS), label="how")})
        self.do({"op": "append", "n": 1})

    @rule()
    def can_trim(self) -> None:
        self.do({"op": "can_trim"})

    def _hybrid(self) -> bool:
        return self.lock is not None and bool(self.lock.recurrent)

    @precondition(_hybrid)
    @rule(data=st.data())
    def speculate(self, data: st.DataObject) -> None:
        """Speculative decoding over a hybrid list: 1 to :data:`ROUNDS` rounds of a
        verify block of k + 1 tokens (one call, or k + 1 single-token
        calls), k the smallest checkpoint depth of the list's recurrent
        layers, then a list trim of the rejected drafts, mostly 1 to k
        (within every recurrent layer's coverage: every layer rolls back;
        k itself lands on the shallowest layer's oldest checkpoint),
        sometimes 0 or k + 1 (beyond it: the whole list refuses). With k =
        0 one token and a trim of 1, refused."""
        k = min(w.cache.depth for w in self.lock.world.layers if isinstance(w, src.RecurrentWorld))
        if k == 0:
            self.do({"op": "append", "n": 1})
            self.do({"op": "trim", "n": 1})
            return
        for _ in range(data.draw(st.integers(1, ROUNDS), label="rounds")):
            if data.draw(st.booleans(), label="single-token calls"):
                for _ in range(k + 1):
                    self.do({"op": "append", "n": 1})
            else:
                self.do({"op": "append", "n": k + 1})
            self.do({"op": "trim", "n": data.draw(st.sampled_from([k, k, *range(1, k), 0, k + 1]), label="reject")})

    @precondition(_hybrid)
    @rule(data=st.data())
    def speculate_after_prefill(self, data: st.DataObject) -> None:
        """A prompt of 1 to 6 tokens (one call: the recorder splits off its
        last min(S, U) tokens), then one speculative round of
        :meth:`speculate`: a weight of its own, so that a hybrid list runs
        many successful list trims per example."""
        self.do({"op": "append", "n": data.draw(st.integers(1, 6), label="prompt")})
        self.speculate(data)

    @rule()
    def hold(self) -> None:
        if self.lock.world.layers[0].returned is not None:
            self.do({"op": "hold"})

    @rule(data=st.data())
    def trim_to(self, data: st.DataObject) -> None:
        """No list-level trim_to: a front trim of a dense layer instead."""
        dense_at = [j for j, layer in enumerate(self.cfg["layers"]) if layer["kind"] == "dense"]
        index = data.draw(st.sampled_from(dense_at), label="index")
        n = data.draw(st.integers(0, 4), label="n")
        keep = data.draw(st.integers(0, 2), label="keep")
        self.do({"op": "layer", "index": index, "do": {"op": "trim_front", "n": n, "keep": keep}})



__all__ = ["BUILDS", "HYBRID_DEPTHS", "LayersLockstep", "LayersMachine", "LayoutModel", "ListOps", "is_hybrid",
           "layer_patterns", "recurrent_layer", "rollback_on_copy", "spec_pattern"]
