"""The registry of cache kinds: the one list every command reads.

A registry entry (a cache kind such as ``dense`` or ``rotating``, or a family
of storage modes of one, such as the Turbo modes of the dense cache) is one
name that is also the stem of its file in every layer: ``spec/<kind>.py``, ``impl/<kind>.py``,
``proofs/<kind>.py`` (its Z3 model beside it), ``fuzz/<kind>.py`` (lockstep
driver and state machine), ``fuzz/bugs/<kind>.py`` (its injected bugs) and
``docs/<kind>.md``. Adding a kind means adding those files and one
:class:`Kind` entry to :data:`KINDS` (docs/architecture.md, step by step).

The entries are data: they name classes by ``"module:attribute"`` and import
them on first use (:meth:`Kind.load`). So listing kinds (the CLI's parser,
the schema generator, ``trace.py``'s defaults) never imports MLX, and this
module imports nothing of the project: it sits at the bottom of ``fuzz/``
while what it names sits above it.

``python -m kvspec.fuzz.kinds`` rewrites ``fuzz/kvtrace.schema.json`` from the
registry (the ``kind``, ``mode`` and ``op`` values and each kind's cache
fields); ``tests/test_layout.py`` fails when the file has drifted.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Ops every kind runs (``expect`` is the trace's own assertion).
COMMON_OPS = ("append", "fetch", "hold", "release_hold", "trim", "trim_to",
              "snapshot", "restore", "drop", "expect")
#: mlx-lm's snapshot protocol as ops (docs/kvtrace.md): ``saved = c.state``
#: (with ``c.meta_state`` where the class has one) and ``c.state = saved``;
#: the kinds whose classes have that protocol list them in ``ops``.
STATE_OPS = ("state_snapshot", "state_restore")
#: Ops of the cache's life outside the decode loop: ``copy``
#: (copy.copy / copy.deepcopy of the cache, as mlx-lm's prompt-cache
#: helpers make them), ``append_mismatch`` (rows whose batch, heads, head
#: dim or dtype differ from the cached rows'), ``append_pair_mismatch`` (a K/V
#: pair whose values disagree with its keys: dtype, batch, heads or rows) and
#: ``reload`` (a prompt-cache file save and load, or mlx-lm's load order
#: ``state`` then ``meta_state``).
LIFECYCLE_OPS = ("copy", "append_mismatch", "append_pair_mismatch", "reload")
#: Cache fields every kind has, with their defaults (kvtrace ``cache``).
COMMON_FIELDS: dict[str, Any] = {
    "mode": "fp16", "step": 256, "batch": 1, "kv_heads": 2, "head_dim": 8, "inplace": True,
    "dtype": "float16",
}
#: Cache fields every kind may carry that have no default value: the key and
#: value head dims (absent: ``head_dim``), ``inplace_env``, a spelling of
#: ``KV_INPLACE_WRITE`` the cache is built under (absent: ``inplace`` rules),
#: and ``rows``, the function that gives rows their contents (absent:
#: ``numpy``, the rows every trace had before the field; ``portable``: the
#: closed form of spec/rows.py, docs/kvtrace.md "Portable rows").
OPTIONAL_FIELDS = ("k_head_dim", "v_head_dim", "inplace_env", "rows")
#: A required field (no default) in :attr:`Kind.fields`.
REQUIRED = None


class _Null:
    """The default ``null`` of an optional field (:data:`NULL`): a value
    distinct from :data:`REQUIRED` (which is None) that
    :meth:`Kind.defaults` turns into None."""

    def __repr__(self) -> str:
        return "NULL"


#: An optional field whose default is JSON ``null`` (absent from a trace:
#: None), in :attr:`Kind.fields`.
NULL = _Null()


def field_default(value: Any) -> Any:
    """A field's default as a trace holds it: :data:`NULL` is None."""
    return None if value is NULL else value


@dataclass(frozen=True)
class Kind:
    """One cache kind.

    ``modes``: the storage modes implemented (the first is the default a
    campaign uses). ``fields``: the kind's own cache fields and their
    defaults (:data:`REQUIRED` for none). ``ops``: the trace ops besides
    :data:`COMMON_OPS`, ``refuses`` the ops it refuses by contract.
    ``campaigns``: the ``(mode, inplace)`` pairs
    ``kvspec verify`` fuzzes. The ``"module:attribute"`` references name the
    lockstep driver, the state machine and the bug list (``BUGS``)."""

    name: str
    title: str
    modes: tuple[str, ...]
    #: the kvtrace ``cache.kind`` this entry runs (default: ``name``); two
    #: entries may share one (a mode family with its own files), never a mode
    trace_kind: str = ""
    fields: dict[str, Any] = field(default_factory=dict)
    ops: tuple[str, ...] = ()
    #: ops of other kinds that this kind's spec refuses by contract (a trace
    #: may use them with ``"error": true``); any other op is a format error
    refuses: tuple[str, ...] = ()
    #: ops of the trace kind this entry's implementation does not run, with
    #: the reason (replay exits 2 on them; campaigns never generate them)
    without: dict[str, str] = field(default_factory=dict)
    campaigns: tuple[tuple[str, bool], ...] = ()
    #: events (``Lockstep.reached`` labels) every ``kvspec verify`` campaign
    #: of the kind must reach: what the campaign exists to cover
    must_reach: tuple[str, ...] = ()
    #: ``(field, values)``: a cache field whose every value is a must_reach
    #: edge, which a campaign pins batch by batch (batch k: ``values[k %
    #: len]``, in batches of ``batch // len(values)`` examples) instead of
    #: leaving it to Hypothesis's draws, which skew to some values: every
    #: value then runs within the first ``batch`` examples, even on a device
    #: that runs only a few dozen in a verify campaign
    sweep: tuple[str, tuple[Any, ...]] | None = None
    lockstep: str = ""
    machine: str = ""
    bugs: str = ""
    #: whether ``KV_INPLACE_WRITE`` changes how the kind's fp16 implementation
    #: writes; False: ``kvspec fuzz`` runs one campaign (``--inplace`` on/off
    #: picks its label), not the same one twice
    inplace_switch: bool = True

    @property
    def kind(self) -> str:
        """The kvtrace ``cache.kind``."""
        return self.trace_kind or self.name

    # -- where the kind lives, one file per layer -------------------------------
    @property
    def files(self) -> dict[str, str]:
        """Layer -> path of the kind's file (relative to the repository)."""
        return {
            "spec": f"spec/{self.name}.py",
            "impl": f"impl/{self.name}.py",
            "proofs": f"proofs/{self.name}.py",
            "proof model": f"proofs/{self.name}_model.py",
            "harness": f"fuzz/{self.name}.py",
            "bugs": f"fuzz/bugs/{self.name}.py",
            "docs": f"docs/{self.name}.md",
        }

    @property
    def all_ops(self) -> tuple[str, ...]:
        return COMMON_OPS + self.ops

    @property
    def cache_fields(self) -> tuple[str, ...]:
        """Every cache field a trace of this kind may carry, ``kind`` first."""
        return ("kind", *COMMON_FIELDS, *OPTIONAL_FIELDS, *self.fields)

    def defaults(self) -> dict[str, Any]:
        """Defaults of the optional cache fields."""
        own = {k: field_default(v) for k, v in self.fields.items() if v is not REQUIRED}
        return {**COMMON_FIELDS, **own}

    def load(self, ref: str) -> Any:
        """Import ``"module:attribute"`` (one of this entry's references)."""
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)

    def lockstep_class(self) -> type:
        return self.load(self.lockstep)

    def machine_class(self) -> type:
        return self.load(self.machine)

    def bug_list(self) -> tuple[Any, ...]:
        return tuple(self.load(self.bugs))


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(
            "dense", "dense cache (KVCache): growth by step, logical trims, front trims with sinks, "
            "gathers, snapshots, detached handles",
            modes=("fp16", "int8"),
            ops=("trim_front", "gather_positions", "gather_within_tail", "detach", "install", "handle_trim_to",
                 *STATE_OPS, *LIFECYCLE_OPS),
            # Int8 never writes in place: the switch would change nothing
            campaigns=(("fp16", True), ("fp16", False), ("int8", True)),
            lockstep="kvspec.fuzz.dense:DenseLockstep", machine="kvspec.fuzz.dense:DenseMachine", bugs="kvspec.fuzz.bugs.dense:BUGS",
        ),
        Kind(
            "turbo", "Turbo quantized modes of the dense cache: V (and Turbo4's K) quantized per row, "
            "physical trims, copying writes, Delegated's cold/hot V with its fold schedule",
            modes=("turbo4asym", "turbo4", "turbo3asym", "turbo4delegated"),
            trace_kind="dense",
            fields={"hot_threshold": 256, "fold_block": 128},
            ops=("trim_front", "gather_positions", "gather_within_tail", "detach", "install", "handle_trim_to",
                 *STATE_OPS, *LIFECYCLE_OPS),
            without={op: "the Turbo modes have a state getter and from_state (prompt-cache files) but no state "
                         "setter: a saved state is loaded with from_state, not assigned" for op in STATE_OPS},
            # Turbo writes always copy: the in-place switch would change nothing
            campaigns=(("turbo4asym", True), ("turbo4", True), ("turbo3asym", True), ("turbo4delegated", True)),
            lockstep="kvspec.fuzz.turbo:TurboLockstep", machine="kvspec.fuzz.turbo:TurboMachine", bugs="kvspec.fuzz.bugs.turbo:BUGS",
        ),
        Kind(
            "rotating", "sliding-window ring (RotatingKVCache): window W, sinks K, warm-up and steady state",
            modes=("fp16",),
            # undo: the ring's undo depth U (rows a trim can take back after a wrap)
            fields={"max_size": REQUIRED, "keep": 0, "undo": 0},
            ops=(*STATE_OPS, *LIFECYCLE_OPS),
            # the ring has no front trim, gathers or detached handles
            refuses=("trim_front", "gather_positions", "gather_within_tail", "detach", "install", "handle_trim_to"),
            campaigns=(("fp16", True), ("fp16", False)),
            must_reach=("undo=0", "undo=1", "undo=2", "undo=3", "undo=4", "rollbacks after a wrap",
                        "rollbacks of exactly U rows", "rollbacks of a whole block", "restores over a non-empty undo log"),
            sweep=("undo", (0, 1, 2, 3, 4)),
            lockstep="kvspec.fuzz.rotating:RotatingLockstep", machine="kvspec.fuzz.rotating:RotatingMachine",
            bugs="kvspec.fuzz.bugs.rotating:BUGS",
        ),
        Kind(
            "layers", "prompt cache: a list of layers of mixed kinds (dense, rings of their own window and "
            "sinks); list-level append, atomic trim, snapshot and restore (semantics.md 6)",
            # mode: the storage of the dense layers (rings are fp16)
            modes=("fp16", "int8"),
            # build: "list" (the harness builds each layer) or
            # "make_prompt_cache" (kvspec.impl.models.make_prompt_cache builds the
            # list for a model whose make_cache() gives the layout: the
            # model-level configuration); num_draft_tokens: its argument
            fields={"layers": REQUIRED, "build": "list", "num_draft_tokens": 0},
            ops=("can_trim", "layer", "restore_mixed", "trim_refused_late", *LIFECYCLE_OPS),
            refuses=("trim_to",),
            campaigns=(("fp16", True), ("fp16", False), ("int8", True)),
            # hybrid lists (recurrent layers beside attention layers): list trims
            # that every layer honours (one landing on a recurrent layer's oldest
            # checkpoint) and one a recurrent layer's coverage refuses
            must_reach=("list trims with recurrent layers", "list trims of a recurrent layer's whole coverage",
                        "list trim refused by a recurrent layer"),
            lockstep="kvspec.fuzz.layers:LayersLockstep", machine="kvspec.fuzz.layers:LayersMachine",
            bugs="kvspec.fuzz.bugs.layers:BUGS",
        ),
        Kind(
            "models", "the model glue around a prompt cache: make_prompt_cache's settings, prompt-cache files "
            "with user metadata, to_quantized mid-stream, nbytes, masks on the host and device paths, the "
            "write layer's mechanism, the portable rows",
            # mode: the storage of the dense layers (rings are fp16)
            modes=("fp16", "int8"),
            fields={"layers": REQUIRED, "build": "make_prompt_cache", "num_draft_tokens": 0},
            ops=("can_trim", "layer", "restore_mixed", "trim_refused_late", *LIFECYCLE_OPS,
                 "build_probe", "save_load", "to_quantized", "mask", "mechanism", "rows"),
            refuses=("trim_to",),
            campaigns=(("fp16", True), ("int8", True)),
            lockstep="kvspec.fuzz.models:ModelsLockstep", machine="kvspec.fuzz.models:ModelsMachine",
            bugs="kvspec.fuzz.bugs.models:BUGS",
        ),
        Kind(
            "paged", "pool-backed cache (BlockPool): block tables by absolute position, refcounts, "
            "copy-on-write, forks, trims through the pool",
            modes=("fp16",),
            # max_blocks 0: no maximum; chunk: blocks per pool growth
            fields={"block_size": REQUIRED, "max_blocks": 0, "chunk": 1},
            ops=("trim_front", "fork", "release", "handle_reuse", "state_assign", *LIFECYCLE_OPS),
            # a paged cache snapshots by fork (its spec refuses snapshot, restore and drop too)
            refuses=("gather_positions", "gather_within_tail", "detach", "install", "handle_trim_to"),
            campaigns=(("fp16", True), ("fp16", False)),
            lockstep="kvspec.fuzz.paged:PagedLockstep", machine="kvspec.fuzz.paged:PagedMachine", bugs="kvspec.fuzz.bugs.paged:BUGS",
        ),
        Kind(
            "recurrent", "recurrent layer of a hybrid model (RecurrentCache): conv window and recurrent state, "
            "per-step checkpoints recorded by the step recorder, exact rollback within the depth",
            modes=("fp16",),
            # size: 2 (conv window + recurrent state) or 1 (conv window only,
            # lfm2); kernel: the causal conv's width (the window keeps
            # kernel - 1 input rows); depth: U, the tokens a rollback may take
            # back; channels: the conv window's C
            fields={"size": 2, "kernel": 4, "depth": 0, "channels": 4},
            ops=("append_unrecorded", "can_trim", *STATE_OPS, "copy", "reload"),
            refuses=("trim_to", "trim_front", "gather_positions", "gather_within_tail", "detach", "install",
                     "handle_trim_to"),
            # the in-place switch changes nothing: the layer replaces its arrays
            campaigns=(("fp16", True),),
            must_reach=("depth=0", "depth=1", "depth=2", "depth=3", "depth=4", "rollbacks of exactly the coverage",
                        "rollbacks beyond the coverage (refused)", "rollbacks after a multi-token call",
                        "restores over a non-empty checkpoint ring", "unrecorded steps"),
            sweep=("depth", (0, 1, 2, 3, 4)),
            lockstep="kvspec.fuzz.recurrent:RecurrentLockstep", machine="kvspec.fuzz.recurrent:RecurrentMachine",
            bugs="kvspec.fuzz.bugs.recurrent:BUGS", inplace_switch=False,
        ),
        Kind(
            "cells", "llama.cpp's KV memory (CellCache): cells shared by sequences, position shifts with lazy K "
            "re-rotation, sliding-window retention and the removals it refuses, per-sequence state save and restore",
            modes=("fp16",),
            # n_cells: cells per store; window: the window store's w (null
            # without one); stores: ["full"], ["full", "window"] (iSWA) or
            # ["window"]; n_seq: sequence ids 0..n_seq - 1; window_cells: the
            # window store's cells, 1..n_cells (default "n_cells": as many)
            fields={"n_cells": REQUIRED, "window": REQUIRED, "stores": ["full"], "n_seq": 4,
                    "window_cells": "n_cells"},
            ops=("decode", "seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "pos_min", "pos_max", "save",
                 "clear"),
            # one memory of many sequences: the one-sequence ops are not its ops
            without={op: "a cells memory is driven by decode, seq_* ops, save and restore (docs/cells.md)"
                     for op in COMMON_OPS if op not in ("restore", "expect")},
            campaigns=(("fp16", True),),
            must_reach=("decodes", "decodes without a slot", "windowed cells reused", "removals",
                        "windowed seq_rm refused", "shared cells", "seq_cp", "seq_keep", "seq_adds", "seq_divs",
                        "shifts composed before a read", "saves", "saves after a pending shift",
                        "restores into the same sequence", "restores into another sequence", "restores without room",
                        "clear", "refused decode", "refused seq_cp", "refused seq_add", "refused seq_div",
                        "windowed seq_rm refused after an iSWA window reuse"),
            lockstep="kvspec.fuzz.cells:CellsLockstep", machine="kvspec.fuzz.cells:CellsMachine", bugs="kvspec.fuzz.bugs.cells:BUGS",
            inplace_switch=False,
        ),
        Kind(
            "prefix", "prefix caching by content (PrefixCachePool, vLLM's KV-cache manager): full blocks found by "
            "the tokens they hold, hits capped one token short, cached-free blocks kept until evicted, the free "
            "queue's eviction order, refcounts, preemption",
            modes=("fp16",),
            # block_size: B; n_blocks: usable blocks (an engine's null block
            # not counted); window: null (the default: full attention) or
            # the sliding window w >= 1 in tokens
            fields={"block_size": REQUIRED, "n_blocks": REQUIRED, "window": NULL},
            ops=("admit", "decode", "free", "preempt", "resume", "lookup", "free_blocks", "reset"),
            # requests, not one sequence: the one-sequence ops are not its ops
            without={op: "a prefix cache is driven by admit, decode, free, preempt, resume, lookup, free_blocks "
                         "and reset (docs/prefix.md)" for op in COMMON_OPS if op != "expect"},
            campaigns=(("fp16", True),),
            must_reach=("hits", "whole-prompt hit capped", "evictions", "duplicate keys", "admit refused",
                        "decode refused", "cached-free block hit", "preempt then resume hit", "reset refused",
                        "reset", "free_blocks refused", "salted miss", "window releases", "windowed hits",
                        "windowed hit past a gap", "hit of two blocks or more", "salted hit",
                        "eviction of a non-root block", "chain stopped by a miss after a hit",
                        "decode of two new blocks"),
            lockstep="kvspec.fuzz.prefix:PrefixLockstep", machine="kvspec.fuzz.prefix:PrefixMachine", bugs="kvspec.fuzz.bugs.prefix:BUGS",
            inplace_switch=False,
        ),
    )
}


class UnknownKindError(KeyError):
    """A kind, or a mode of a kind, the registry does not have; ``field`` is
    the cache field at fault (``"kind"`` or ``"mode"``)."""

    def __init__(self, message: str, field: str = "kind"):
        super().__init__(message)
        self.field = field

    def __str__(self) -> str:
        return str(self.args[0])


def trace_kinds() -> tuple[str, ...]:
    """Every kvtrace ``cache.kind`` some entry runs, in registry order."""
    return tuple(dict.fromkeys(k.kind for k in KINDS.values()))


def get(kind: str, mode: str | None = None) -> Kind:
    """The entry that runs kvtrace ``kind`` in ``mode`` (None: the kind's
    first entry). Raises UnknownKindError naming the known kinds or the
    kind's implemented modes."""
    entries = [k for k in KINDS.values() if k.kind == kind]
    if not entries:
        raise UnknownKindError(f"kind {kind!r} has no implementation; known kinds: {', '.join(trace_kinds())}")
    if mode is None:
        return entries[0]
    for k in entries:
        if mode in k.modes:
            return k
    raise UnknownKindError(
        f"mode {mode!r} has no implementation for kind {kind} (implemented: {', '.join(modes_of(kind))})", "mode"
    )


def modes_of(kind: str) -> tuple[str, ...]:
    return tuple(m for k in KINDS.values() if k.kind == kind for m in k.modes)


def configs() -> list[tuple[str, str]]:
    """Every implemented ``(kind, mode)``, in registry order."""
    return [(k.kind, m) for k in KINDS.values() for m in k.modes]


def all_modes() -> tuple[str, ...]:
    return tuple(dict.fromkeys(m for k in KINDS.values() for m in k.modes))


def all_ops() -> tuple[str, ...]:
    return tuple(dict.fromkeys(op for k in KINDS.values() for op in k.all_ops))


# -- the JSON Schema, generated from the registry ------------------------------

SCHEMA_PATH = Path(__file__).with_name("kvtrace.schema.json")


def schema_from_registry(base: dict[str, Any]) -> dict[str, Any]:
    """``base`` (the schema file) with its registry-owned parts replaced: the
    ``kind``, ``mode`` and ``op`` enums, and per kind its required fields and
    its modes. (A field of another kind, e.g. ``max_size`` on a dense cache,
    is refused by ``kvspec.fuzz.trace.parse``, which can name the kind's fields.)"""
    doc = json.loads(json.dumps(base))
    cache = doc["$defs"]["cache"]
    cache["properties"]["kind"] = {"enum": list(trace_kinds())}
    cache["properties"]["mode"] = {"enum": list(all_modes())}
    doc["$defs"]["op"]["properties"]["op"] = {"enum": list(all_ops())}
    rules = []
    for kind in trace_kinds():
        entries = [k for k in KINDS.values() if k.kind == kind]
        rule: dict[str, Any] = {"if": {"required": ["kind"], "properties": {"kind": {"const": kind}}}, "then": {}}
        required = [f for f, v in entries[0].fields.items() if v is REQUIRED
                    and all(e.fields.get(f, 0) is REQUIRED for e in entries)]
        if required:
            rule["then"]["required"] = required
        rule["then"]["properties"] = {"mode": {"enum": list(modes_of(kind))}}
        rules.append(rule)
    cache["allOf"] = rules
    return doc


def write_schema(path: Path = SCHEMA_PATH) -> Path:
    base = json.loads(path.read_text())
    path.write_text(json.dumps(schema_from_registry(base), indent=2) + "\n")
    return path


if __name__ == "__main__":  # pragma: no cover - a maintenance command
    print(f"wrote {write_schema()}")
