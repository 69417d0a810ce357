"""The cells kind's harness: llama.cpp's KV memory model (``kvspec.spec.cells``)
in lockstep with a cells target, and its state machine.

A **cells target** is anything that runs the memory's ops and shows its
cells (:class:`CellsTarget`, docs/cells.md): our MLX cache
(``kvspec.impl.cells.CellCache``, wrapped by :class:`OursTarget`) or llama.cpp
(``kvspec.fuzz.adapters.llama_cpp``). The lockstep (:class:`CellsLockstep`) runs
every op on the spec and on the target and compares, after every op:

* the op's result (a bool of ``decode``/``seq_rm``/``restore``, the
  refusal's type, and for our implementation its words);
* every observable of :data:`OBSERVABLES` for every sequence id
  (``pos_min``, ``pos_max``; ``lost`` on ours), the compared keys checked
  against the full list after every op;
* on ours, a copy of the cache taken before the op: everything observable
  on it (cells, rows, pending shifts, ``lost(s)``) unchanged after the op;
* each store's used cells as a multiset of ``(pos, seqs, k_name, v_name)``:
  every K row must be named ``(token, cell.pos)`` (a shift applied, or
  pending and applied before the read) and every V row ``token``;
* a save's snapshot (per store ``(pos, k_name, v_name)``, the K rows named
  by the save itself: no pending shift may survive into it) and, at a
  restore, what the restore wrote.

**Adoption** (which droppable windowed cells a decode reuses is the
target's choice): after a decode, cells of the window store that the spec
holds and the target does not are accepted only if each was droppable
before the decode (``kvspec.spec.cells.droppable``); the spec is then told to
drop them, and the op records them (``drops``) so that the trace replays to
the same state on the spec alone. A target that declares the spec's drop
policy must drop the spec's positions; no target drops cells of more
sequences than free cells lack. Any other missing cell, and any extra one,
is a divergence.

Plugging another engine in takes two calls (``kvspec.fuzz.cells_runs``, a runner
above this module): ``cells_campaign`` (a seeded campaign against
``target_factory(cache) -> CellsTarget``, a failure shrunk to a minimal
kvtrace) and ``replay_cells`` (one trace); both reach this lockstep through
the usual factories, ``{"cells": {"target": target_factory}}``
(:func:`target_factories`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, initialize, precondition, rule

from kvspec.fuzz.failures import Divergence
from kvspec.fuzz.lockstep import Outcome, error_text, same_value
from kvspec.fuzz.machine import KVMachine
from kvspec.fuzz.protocol import refusal_category
from kvspec.fuzz.trace import TraceFormatError
from kvspec.spec import cells as sc
from kvspec.spec.errors import KVCacheError, StateError

__all__ = ["CellRows", "CellsLockstep", "CellsMachine", "CellsTarget", "OursTarget", "target_factories"]


class CellsTarget(Protocol):
    """A KV memory of llama.cpp's kind, driven op by op (design of the
    ``cells`` kind, docs/cells.md). Positions are ints >= 0, sequence ids
    ``0..n_seq - 1`` (``-1`` in ``seq_rm``: every sequence), ``p1 None``:
    to infinity. Bad arguments raise ``kvspec.spec.errors.KVCacheError``
    subclasses (another engine may raise its own: refusals are compared by
    category), and a refusal changes nothing."""

    stores: tuple[str, ...]

    def decode(self, seqs: tuple[int, ...], tokens: tuple[int, ...], pos0: int) -> bool:
        """One group: ``tokens`` at ``pos0, pos0 + 1, ...`` held by every
        sequence in ``seqs``. False: no slot (nothing changed)."""

    def seq_rm(self, seq: int, p0: int, p1: int | None) -> bool: ...
    def seq_cp(self, src: int, dst: int, p0: int, p1: int | None) -> None: ...
    def seq_keep(self, seq: int) -> None: ...
    def seq_add(self, seq: int, p0: int, p1: int | None, delta: int) -> None: ...
    def seq_div(self, seq: int, p0: int, p1: int | None, d: int) -> None: ...
    def pos_min(self, seq: int) -> int: ...
    def pos_max(self, seq: int) -> int: ...

    def save(self, seq: int) -> Any:
        """An opaque snapshot of ``seq``'s cells (never aliasing the memory)."""

    def restore(self, snapshot: Any, dst: int) -> bool: ...
    def clear(self) -> None: ...

    def observe(self) -> dict[str, list[tuple[int, frozenset[int], Any, Any]]]:
        """Per store, every used cell as ``(pos, seqs, k_name, v_name)``
        (any order): ``k_name`` the ``(token, pos)`` whose K row the cell
        holds (None: no row matches), ``v_name`` the token of its V row.
        Pending shifts are applied first, as a decode would."""

    def observe_snapshot(self, snapshot: Any) -> dict[str, list[tuple[int, Any, Any]]]:
        """Per store, ``(pos, k_name, v_name)`` of the cells a snapshot holds."""


# -- rows -----------------------------------------------------------------------

#: positions the row table covers beyond the largest one seen so far
TABLE_MARGIN = 64
#: largest |difference| (per element, float32) for a K row to be named by a
#: table entry: a re-rotation by a shift is not bit-exact
K_TOLERANCE = {"float16": 2e-2, "bfloat16": 1.5e-1, "float32": 1e-3}


class CellRows:
    """The K and V rows of ``(token, pos)`` for one configuration and their
    names back. Per store and token a base K and V row, shape ``(kv_heads,
    head_dim)``, drawn from a generator seeded by (store, token, K or V),
    entries in [0.5, 1.5) with random signs (never near 0, so rotations
    are told apart); the K row at ``pos`` is the base rotated by ``pos``
    with ``rope`` (the target's rotate-half RoPE, ``kvspec.impl.cells.rope_shift``
    for ours), V is the base. Names are found by the nearest table entry
    within :data:`K_TOLERANCE`; the table grows to every position seen plus
    :data:`TABLE_MARGIN`."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: str, rope: Any):
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        self._rope = rope
        self._base: dict[tuple[str, int, str], np.ndarray] = {}
        #: (store, token) -> (P, H, D) float32 K rows at positions 0..P-1
        self._table: dict[tuple[str, int], np.ndarray] = {}
        self._positions = TABLE_MARGIN

    def base(self, store: str, token: int, which: str) -> np.ndarray:
        key = (store, token, which)
        got = self._base.get(key)
        if got is None:
            seed = [sum(map(ord, store)), token & 0xFFFFFFFF, 1 if which == "k" else 2, 49]
            rng = np.random.default_rng(seed)
            mag = rng.uniform(0.5, 1.5, (self.kv_heads, self.head_dim))
            sign = np.where(rng.integers(0, 2, (self.kv_heads, self.head_dim)) == 0, -1.0, 1.0)
            got = self._base[key] = self._cast(mag * sign).astype(np.float32)
        return got

    def _cast(self, x: np.ndarray) -> np.ndarray:
        from kvspec.fuzz.rows import round_to_bfloat16

        if self.dtype == "float16":
            return x.astype(np.float16).astype(np.float32)
        if self.dtype == "bfloat16":
            return round_to_bfloat16(x.astype(np.float32))
        return x.astype(np.float32)

    def _grow(self, store: str, token: int, upto: int) -> np.ndarray:
        have = self._table.get((store, token))
        n = max(self._positions, upto + 1)
        if have is not None and have.shape[0] >= n:
            return have
        base = self.base(store, token, "k")
        rows = np.repeat(base[None], n, axis=0)
        got = np.asarray(self._rope(rows, np.arange(n)), dtype=np.float32)
        self._table[(store, token)] = got
        return got

    def k_rows(self, store: str, tokens: tuple[int, ...], pos0: int) -> np.ndarray:
        """``(n, kv_heads, head_dim)`` float32 (holding ``dtype`` values):
        the K rows of ``tokens`` at ``pos0, pos0 + 1, ...``."""
        self._positions = max(self._positions, pos0 + len(tokens) + TABLE_MARGIN)
        return self._cast(np.stack([self._grow(store, t, pos0 + j)[pos0 + j] for j, t in enumerate(tokens)]))

    def v_rows(self, store: str, tokens: tuple[int, ...]) -> np.ndarray:
        return np.stack([self.base(store, t, "v") for t in tokens])

    def name_k(self, store: str, row: np.ndarray, tokens: Any, hint: int | None = None) -> tuple[int, int] | None:
        """The ``(token, pos)`` whose K row ``row`` is (within tolerance),
        over ``tokens``; None when no entry is that close."""
        row = np.asarray(row, dtype=np.float32)
        tol = K_TOLERANCE[self.dtype] * max(1.0, float(np.abs(row).max(initial=0.0)))
        best, best_err = None, np.inf
        upto = max(self._positions, (hint or 0) + 1)
        for t in tokens:
            table = self._grow(store, t, upto)
            err = np.abs(table - row[None]).reshape(table.shape[0], -1).max(axis=1)
            j = int(np.argmin(err))
            if err[j] < best_err:
                best, best_err = (t, j), float(err[j])
        return best if best is not None and best_err <= tol else None

    def name_v(self, store: str, row: np.ndarray, tokens: Any) -> int | None:
        row = np.asarray(row, dtype=np.float32)
        for t in tokens:
            if np.array_equal(self.base(store, t, "v"), row):
                return t
        return None


# -- our implementation as a target ---------------------------------------------


def _impl() -> Any:
    from kvspec.impl import cells

    return cells


def _host(a: Any) -> np.ndarray:
    """A row as float32: an ``mx.array``, or a NumPy copy from
    ``kvspec.impl.cells`` (bfloat16 as its uint16 bit pattern)."""
    import mlx.core as mx

    if isinstance(a, mx.array):
        return np.asarray(a.astype(mx.float32))
    a = np.asarray(a)
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


class OursTarget:
    """``kvspec.impl.cells.CellCache`` (or an injected bug's subclass, ``factory``)
    as a :class:`CellsTarget`: rows made and named by :class:`CellRows`
    with ``kvspec.impl.cells.rope_shift``."""

    def __init__(self, cfg: dict[str, Any], factory: Any = None):
        import mlx.core as mx

        impl = _impl()
        cls = factory or impl.CellCache
        self.cfg = cfg
        self.stores = tuple(cfg["stores"])
        self.dtype = cfg.get("dtype", "float16")
        self.cache = cls(cfg["n_cells"], cfg["kv_heads"], cfg["head_dim"], dtype=self.dtype,
                         window=cfg.get("window"), stores=self.stores, n_seq=cfg["n_seq"],
                         window_cells=window_cells(cfg))

        def rope(rows: np.ndarray, deltas: np.ndarray) -> np.ndarray:
            got = impl.rope_shift(mx.array(rows, dtype=mx.float32), mx.array(deltas.astype(np.int32)), 10000.0)
            return _host(got)

        self.rows = CellRows(cfg["kv_heads"], cfg["head_dim"], self.dtype, rope)
        #: every token handed in (what names are looked up among)
        self.tokens: set[int] = set()
        self._mx_dtype = getattr(mx, self.dtype)

    @property
    def drop_policy(self) -> str | None:
        """The cache's declared choice of droppable window cells
        (``kvspec.impl.cells.CellCache.drop_policy``)."""
        return getattr(self.cache, "drop_policy", None)

    def decode(self, seqs: tuple[int, ...], tokens: tuple[int, ...], pos0: int, drops: Any = None) -> bool:
        import mlx.core as mx

        self.tokens.update(t for t in tokens if isinstance(t, int))
        keys, values = {}, {}
        good = tokens and all(isinstance(t, int) for t in tokens) and isinstance(pos0, int) and pos0 >= 0
        for s in self.stores:
            if good:
                keys[s] = mx.array(self.rows.k_rows(s, tuple(tokens), pos0)).astype(self._mx_dtype)
                values[s] = mx.array(self.rows.v_rows(s, tuple(tokens))).astype(self._mx_dtype)
            else:  # a group the cache must refuse (no token, pos0 < 0): rows of that shape, whatever they hold
                shape = (len(tokens), self.cfg["kv_heads"], self.cfg["head_dim"])
                keys[s] = values[s] = mx.zeros(shape, dtype=self._mx_dtype)
        if drops:
            return self.cache.decode(tuple(seqs), keys, values, pos0, drops=drops)
        return self.cache.decode(tuple(seqs), keys, values, pos0)

    def seq_rm(self, seq: int, p0: int, p1: int | None) -> bool:
        return self.cache.seq_rm(seq, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int | None) -> None:
        return self.cache.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq: int) -> None:
        return self.cache.seq_keep(seq)

    def seq_add(self, seq: int, p0: int, p1: int | None, delta: int) -> None:
        return self.cache.seq_add(seq, p0, p1, delta)

    def seq_div(self, seq: int, p0: int, p1: int | None, d: int) -> None:
        return self.cache.seq_div(seq, p0, p1, d)

    def pos_min(self, seq: int) -> int:
        return self.cache.pos_min(seq)

    def pos_max(self, seq: int) -> int:
        return self.cache.pos_max(seq)

    def lost(self, seq: int) -> frozenset[int]:
        """The cache's lost positions of ``seq`` (``kvspec.impl.cells.CellCache.lost``)."""
        return self.cache.lost(seq)

    def save(self, seq: int) -> Any:
        return self.cache.save(seq)

    def restore(self, snapshot: Any, dst: int, drops: Any = None) -> bool:
        if drops:
            return self.cache.restore(snapshot, dst, drops=drops)
        return self.cache.restore(snapshot, dst)

    def clear(self) -> None:
        return self.cache.clear()

    def _name(self, store: str, k: Any, v: Any, pos: int) -> tuple[Any, Any]:
        return (self.rows.name_k(store, k, sorted(self.tokens), pos), self.rows.name_v(store, v, sorted(self.tokens)))

    def observe(self, rows: bool = True) -> dict[str, list[tuple[int, frozenset[int], Any, Any]]]:
        """Per store every used cell, rows named; ``rows=False``: names
        None and pending shifts left pending (read with ``apply_shifts``
        off)."""
        out: dict[str, list[tuple[int, frozenset[int], Any, Any]]] = {}
        for store in self.stores:
            cells = []
            for pos, seqs, k, v in self.cache.cells(store, apply_shifts=rows):
                kn, vn = self._name(store, _host(k), _host(v), int(pos)) if rows else (None, None)
                cells.append((int(pos), frozenset(int(s) for s in seqs), kn, vn))
            out[store] = cells
        return out

    def observe_snapshot(self, snapshot: Any) -> dict[str, list[tuple[int, Any, Any]]]:
        out: dict[str, list[tuple[int, Any, Any]]] = {}
        for store, (positions, keys, values) in snapshot.cells.items():
            got = []
            for j, pos in enumerate(np.asarray(positions).tolist()):
                kn, vn = self._name(store, _host(keys[j]), _host(values[j]), int(pos))
                got.append((int(pos), kn, vn))
            out[store] = got
        return out


# -- the spec side (kvspec.spec.cells: frozen states, each op a new state) -------------


@dataclass
class CellsWorld:
    """The spec's memory (a frozen ``kvspec.spec.cells.CellsState``) and the
    snapshots the trace saved, by name: ``(snapshot, the sequence saved)``."""

    memory: Any
    snapshots: dict[str, tuple[Any, int]] = field(default_factory=dict)


def window_cells(cfg: dict[str, Any]) -> int:
    """A trace's ``window_cells`` (cells of the window store): its value, or
    ``n_cells`` when the field is absent, null or ``"n_cells"`` (the
    registry's default)."""
    got = cfg.get("window_cells")
    return cfg["n_cells"] if got is None or got == "n_cells" else got


def spec_memory(cfg: dict[str, Any]) -> Any:
    """The spec's empty memory for a trace's cache fields."""
    return sc.empty(sc.CellsConfig(n_cells=cfg["n_cells"], window=cfg.get("window"),
                                   stores=tuple(cfg["stores"]), n_seq=cfg["n_seq"], window_cells=window_cells(cfg)))


def spec_cells(memory: Any, store: str) -> list[tuple[int, frozenset[int], int]]:
    """The spec store's used cells as ``(pos, seqs, token)``."""
    return [c.key for c in memory.present(store)]


#: the ops of the cells kind (kvtrace), besides the common ``restore``/``expect``
CELL_OPS = ("decode", "seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "pos_min", "pos_max", "save", "clear")
#: every op a cells trace may hold
ALL_CELL_OPS = (*CELL_OPS, "restore", "expect")


def _p1(op: dict[str, Any]) -> int | None:
    return op.get("p1")


def _spec_run(world: CellsWorld, op: dict[str, Any], index: int = -1) -> tuple[Any, CellsWorld]:
    """One op on the spec: (result, new world); ``world`` is not changed
    (the spec's states are frozen). Raises the spec's KVCacheError for a
    refused op, TraceFormatError for a trace that names no snapshot."""
    m, name = world.memory, op["op"]
    result: Any = None
    drops = recorded_drops(op, index)
    if drops:
        try:
            return _spec_run_dropping(world, op, index, drops)
        except StateError as exc:
            raise TraceFormatError(f"op {index} field 'drops': {exc}") from None
    if name == "decode":
        result, m = sc.decode(m, tuple(op["seqs"]), tuple(op["tokens"]), op["pos0"])
    elif name == "seq_rm":
        result, m = sc.seq_rm(m, op["seq"], op["p0"], _p1(op))
    elif name == "seq_cp":
        m = sc.seq_cp(m, op["src"], op["dst"], op["p0"], _p1(op))
    elif name == "seq_keep":
        m = sc.seq_keep(m, op["seq"])
    elif name == "seq_add":
        m = sc.seq_add(m, op["seq"], op["p0"], _p1(op), op["delta"])
    elif name == "seq_div":
        m = sc.seq_div(m, op["seq"], op["p0"], _p1(op), op["d"])
    elif name in ("pos_min", "pos_max"):
        result = getattr(sc, name)(m, op["seq"])
    elif name == "save":
        snap = sc.save(m, op["seq"])
        return None, CellsWorld(m, {**world.snapshots, op["name"]: (snap, op["seq"])})
    elif name == "restore":
        result, m = sc.restore(m, _named(world, op, index)[0], op["seq"])
    elif name == "clear":
        m = sc.clear(m)
    else:
        raise TraceFormatError(f"op {index} field 'op': kind cells has no op {name!r}; its ops: "
                               f"{', '.join(ALL_CELL_OPS)}")
    return result, CellsWorld(m, world.snapshots)


def _spec_run_dropping(world: CellsWorld, op: dict[str, Any], index: int, drops: list[Any]) -> tuple[Any, CellsWorld]:
    """A decode or restore with the trace's recorded ``drops`` (StateError
    for a drop the spec does not allow)."""
    m = world.memory
    if op["op"] == "decode":
        result, m = sc.decode(m, tuple(op["seqs"]), tuple(op["tokens"]), op["pos0"], drops=drops)
        n, seen = len(op["tokens"]), world.memory
    else:
        snap = _named(world, op, index)[0]
        result, m = sc.restore(m, snap, op["seq"], drops=drops)
        n, (_, seen) = len(snap.store("window")), sc.seq_rm(world.memory, op["seq"], -1, None)
    # recorded drops are held to the spec's permission (each cell droppable
    # or forgettable on the state the slot search saw) and to the write's
    # size: a trace does not say which drop policy made them, and
    # llama.cpp's head-order reuse may take an out-of-window cell while free
    # cells remain, so "only what free cells lack" is not asked here
    if result:
        why = drop_count_breach(seen, n, drops, free_first=False)
        if why:
            raise StateError(why)
    return result, CellsWorld(m, world.snapshots)


def recorded_drops(op: dict[str, Any], index: int) -> list[Any]:
    """An op's recorded ``drops`` (the window cells the target that ran
    the trace dropped, as ``kvspec.spec.cells.drop`` takes them: ``[pos, [seq,
    ...], token]`` or ``[[pos, [seq, ...], token], seq]``), checked for
    shape; [] when absent. Raises TraceFormatError naming the field."""
    if "drops" not in op:
        return []
    got = op["drops"]
    if op["op"] not in ("decode", "restore"):
        raise TraceFormatError(f"op {index} field 'drops': only a decode or a restore records dropped window "
                               f"cells, not {op['op']!r}")
    if not isinstance(got, list):
        raise TraceFormatError(f"op {index} field 'drops': a list of dropped window cells, got {got!r}")
    for item in got:
        try:
            sc.drop_item(item)
        except KVCacheError as exc:
            raise TraceFormatError(f"op {index} field 'drops': {exc}") from None
    return list(got)


def drops_json(items: list[Any]) -> list[Any]:
    """``kvspec.spec.cells.drop`` items as a kvtrace's ``drops`` field: a key
    ``[pos, [seq, ...], token]``, a pair ``[[pos, [seq, ...], token], seq]``."""
    out: list[Any] = []
    for item in items:
        key, seq = sc.drop_item(item)
        k = [key[0], sorted(key[1]), key[2]]
        out.append(k if seq is None else [k, seq])
    return out


def drop_count_breach(seen: Any, n: int, items: list[Any], free_first: bool = True) -> str | None:
    """Why ``items`` drop more than a write of ``n`` cells needs, or None.
    The window store may reuse cells only while free cells run short: at
    most ``n - free cells`` (``kvspec.spec.cells.free_cells`` on ``seen``, the
    state the slot search saw) cells are reused; more may go only as
    purges (llama.cpp's ``apply_ubatch`` removes a sequence from its
    cells at or below a reused one), so the sequences the drops take cells
    from number at most that many."""
    short = max(0, n - sc.free_cells(seen, "window")) if free_first else n
    holders = set()
    for item in items:
        key, seq = sc.drop_item(item)
        holders |= set(key[1]) if seq is None else {seq}
    if len(holders) > short:
        return (f"the window store dropped cells of {len(holders)} sequences ({sorted(holders)}) but a write of "
                f"{n} cells with {sc.free_cells(seen, 'window')} free may reuse cells of at most {short}")
    return None


def _named(world: CellsWorld, op: dict[str, Any], index: int) -> tuple[Any, int]:
    snap = world.snapshots.get(op["name"])
    if snap is None:
        names = ", ".join(sorted(world.snapshots)) or "none"
        raise TraceFormatError(f"op {index} field 'name': no snapshot named {op['name']!r} was saved before "
                               f"this op (saved: {names})")
    return snap


def adoption(before: Any, op: dict[str, Any], got: list[tuple[int, frozenset[int], Any, Any]],
             written: Any = None) -> list[Any]:
    """What a target's decode (or restore) dropped from the window store,
    as ``kvspec.spec.cells.drop`` items: a cell gone whole is its key ``(pos, seqs,
    token)`` when one sequence held it, else one ``(key, seq)`` per holder;
    a cell still there for fewer holders gives ``(key, seq)`` per holder
    gone. ``before``: the spec's state the target's slot search saw (before
    the decode; a restore's: after the clear of its destination); ``got``:
    the target's window store after the op; ``written``: the cells the op
    wrote as keys (default: the decode's group)."""
    new = Counter(written if written is not None else
                  ((op["pos0"] + j, frozenset(op["seqs"]), t) for j, t in enumerate(op["tokens"])))
    have = Counter((p, s, v if v is not None else (k[0] if k else None)) for p, s, k, v in got) - new
    had = Counter(c.key for c in before.present("window"))
    missing, extra = had - have, have - had
    items: list[Any] = []
    for key in sorted(missing.elements(), key=repr):
        pos, seqs, tok = key
        kept = next((e for e in extra.elements() if e[0] == pos and e[2] == tok and e[1] < seqs), None)
        if kept is not None:
            extra[kept] -= 1
            items += [(key, h) for h in sorted(seqs - kept[1])]
        elif len(seqs) == 1:
            items.append(key)
        else:
            items += [(key, h) for h in sorted(seqs)]
    return items


# -- the lockstep ---------------------------------------------------------------


def _observe(target: Any, rows: bool) -> dict[str, list[tuple[int, frozenset[int], Any, Any]]]:
    """``target.observe()``; with ``rows=False`` (after a shift: the rows
    are not read, so a pending shift stays pending, as it does in the
    engine until its next decode) where the target takes the argument."""
    if rows:
        return target.observe()
    try:
        return target.observe(rows=False)
    except TypeError:
        return target.observe()


def _show(cells: Any) -> list[str]:
    """Cells as a report shows them: ``pos 3 seqs {0,1} K (5, 3) V 5``."""
    out = []
    for c in sorted(cells, key=repr):
        if len(c) == 4:
            pos, seqs, k, v = c
            out.append(f"pos {pos} seqs {{{','.join(map(str, sorted(seqs)))}}} K {k} V {v}")
        else:
            pos, k, v = c
            out.append(f"pos {pos} K {k} V {v}")
    return out


#: the per-sequence reads the lockstep compares after every op, spec against
#: target (``lost`` only where the target has it): one list, from which the
#: compared set is made and against which it is checked
OBSERVABLES = ("pos_min", "pos_max", "lost")


def cache_view(cache: Any) -> dict[str, Any]:
    """Everything observable on an ``kvspec.impl.cells.CellCache`` without
    changing it: per store its cells ``(pos, seqs, K bytes, V bytes)`` as
    stored (pending shifts not applied) and its pending shifts, and
    ``lost(s)`` for every sequence id."""
    out: dict[str, Any] = {}
    for store in cache.stores:
        out[f"{store} cells"] = sorted((int(p), tuple(sorted(ss)), np.asarray(k).tobytes(), np.asarray(v).tobytes())
                                       for p, ss, k, v in cache.cells(store, apply_shifts=False))
        out[f"{store} pending shifts"] = sorted((p, tuple(sorted(ss)), d) for p, ss, d in cache.pending_shifts(store))
    for s in range(cache.n_seq):
        out[f"lost({s})"] = sorted(cache.lost(s))
    return out


#: ops that move positions without reading rows: the lockstep compares
#: cells and positions after them, not rows (a pending shift stays pending)
SHIFT_OPS = frozenset({"seq_add", "seq_div"})


class CellsLockstep:
    """The spec (``kvspec.spec.cells``) and a :class:`CellsTarget` in step, op by
    op (the module's doc lists what is compared). ``factory``: None (our
    ``kvspec.impl.cells.CellCache``), a subclass of it (an injected bug), or
    ``{"target": target_factory}`` with ``target_factory(cache) ->
    CellsTarget`` (another engine). :meth:`step` raises :class:`Divergence`
    at the first disagreement, TraceFormatError for a trace it cannot run."""

    spec_module = sc
    #: set by kvspec.fuzz.targets for our implementation: refusals compared by type
    #: and words (another target's by category)
    compare_messages = False
    check_inplace = True
    check_sharing = False
    impl_name = "impl"

    def __init__(self, cache: dict[str, Any], factory: Any = None):
        self.cfg = cache
        if isinstance(factory, dict) and "target" in factory:
            self.target: Any = factory["target"](cache)
            self.ours = False
            self.impl_name = getattr(self.target, "name", "target")
        else:
            self.target = OursTarget(cache, factory)
            self.ours = True
        self.world = CellsWorld(spec_memory(cache))
        self.snaps: dict[str, Any] = {}
        self.stats: dict[str, int] = {}
        self.refusals: list[tuple[int, str]] = []
        self.refused = False
        #: successful shifts since the rows were last read (a decode or a
        #: comparison of rows)
        self._pending_shifts = 0
        #: a decode of an iSWA memory (full and window stores) reused window cells
        self._iswa_reused = False
        #: the index of the op being run (errors name it)
        self._index = -1

    @classmethod
    def check_cache(cls, cache: dict[str, Any]) -> None:
        """The store list and the window agree (TraceFormatError naming the field)."""
        stores = tuple(cache.get("stores", ()))
        if stores not in sc.LAYOUTS:
            raise TraceFormatError(f"field cache.stores: {list(stores)} is not one of "
                                   f"{', '.join(str(list(x)) for x in sc.LAYOUTS)}")
        window = cache.get("window")
        if ("window" in stores) != (window is not None):
            raise TraceFormatError(f"field cache.window: {window!r} with stores {list(stores)}: a window store "
                                   "needs a window >= 1, and only a window store takes one")
        n, wc = cache.get("n_cells"), window_cells(cache) if "n_cells" in cache else None
        if isinstance(n, int) and (isinstance(wc, bool) or not isinstance(wc, int) or not 1 <= wc <= n
                                   or ("window" not in stores and wc != n)):
            raise TraceFormatError(f"field cache.window_cells: {cache.get('window_cells')!r} with n_cells {n} and "
                                   f"stores {list(stores)}: the window store's cells, 1 <= window_cells <= n_cells "
                                   "(n_cells, or null, without a window store)")

    def reached(self, event: str) -> None:
        self.stats[event] = self.stats.get(event, 0) + 1

    # -- the two sides ----------------------------------------------------------
    def spec_apply(self, op: dict[str, Any]) -> tuple[Any, CellsWorld]:
        """The op on the spec: (result, new world); nothing changes here."""
        return _spec_run(self.world, op, self._index)

    # -- what kvspec render draws (kvspec.fuzz.render.timeline) ------------------------------
    def spec_views(self) -> dict[str, list[int]]:
        """Per sequence (``seq:<id>``) and store, its tokens in position order."""
        out = {}
        for store in self.cfg["stores"]:
            for s in range(self.cfg["n_seq"]):
                cells = sorted((p, t) for p, seqs, t in spec_cells(self.world.memory, store) if s in seqs)
                out[f"seq:{s} {store}"] = [t for _, t in cells]
        return out

    def impl_views(self) -> dict[str, list[Any]]:
        got = _observe(self.target, rows=True)
        out = {}
        for store in self.cfg["stores"]:
            for s in range(self.cfg["n_seq"]):
                cells = sorted(((p, k) for p, seqs, k, _ in got.get(store, []) if s in seqs), key=lambda c: c[0])
                out[f"seq:{s} {store}"] = [f"{k[0]}@{k[1]}" if k else "?" for _, k in cells]
        return out

    def identify(self, view: Any, mode: Any = None) -> list[Any]:
        return list(view)

    def view_mode(self, name: str) -> None:
        return None

    def observables(self) -> tuple[str, ...]:
        """The per-sequence reads compared after every op (:data:`OBSERVABLES`;
        ``lost`` where the target can tell it, as ours does)."""
        return tuple(n for n in OBSERVABLES if n != "lost" or callable(getattr(self.target, "lost", None)))

    def observable_keys(self) -> frozenset[str]:
        """``name(seq)`` for every observable and every sequence id
        ``0 .. n_seq - 1``: what :meth:`compare_positions` must compare."""
        return frozenset(f"{name}({s})" for name in self.observables() for s in range(self.cfg["n_seq"]))

    def spec_observables(self) -> dict[str, Any]:
        """``name(seq)`` -> the spec's value, for every observable and sequence."""
        m = self.world.memory
        return {f"{name}({s})": getattr(sc, name)(m, s) for s in range(self.cfg["n_seq"])
                for name in self.observables()}

    def target_apply(self, op: dict[str, Any], index: int) -> Any:
        t, name = self.target, op["op"]
        drops = op.get("drops") if self.ours else None
        if name == "decode":
            if drops:
                return t.decode(tuple(op["seqs"]), tuple(op["tokens"]), op["pos0"], drops=drops)
            return t.decode(tuple(op["seqs"]), tuple(op["tokens"]), op["pos0"])
        if name == "seq_rm":
            return t.seq_rm(op["seq"], op["p0"], _p1(op))
        if name == "seq_cp":
            return t.seq_cp(op["src"], op["dst"], op["p0"], _p1(op))
        if name == "seq_keep":
            return t.seq_keep(op["seq"])
        if name == "seq_add":
            return t.seq_add(op["seq"], op["p0"], _p1(op), op["delta"])
        if name == "seq_div":
            return t.seq_div(op["seq"], op["p0"], _p1(op), op["d"])
        if name in ("pos_min", "pos_max"):
            return getattr(t, name)(op["seq"])
        if name == "save":
            self.snaps[op["name"]] = t.save(op["seq"])
            return None
        if name == "restore":
            if op["name"] not in self.snaps:
                _named(self.world, op, index)  # raises TraceFormatError naming the field
            if drops:
                return t.restore(self.snaps[op["name"]], op["seq"], drops=drops)
            return t.restore(self.snaps[op["name"]], op["seq"])
        if name == "clear":
            return t.clear()
        raise TraceFormatError(f"op {index} field 'op': kind cells has no op {name!r}")

    # -- the step ---------------------------------------------------------------
    def step(self, index: int, op: dict[str, Any]) -> None:
        """Run ``op`` on both sides and compare (Divergence on the first
        difference; its second line names :attr:`impl_name`)."""
        try:
            self._step(index, op)
        except Divergence as d:
            if self.impl_name != "impl":
                d.labels = tuple(f"{self.impl_name} did" if lab == "impl did" else lab  # type: ignore[assignment]
                                 for lab in d.labels)
            raise

    def _step(self, index: int, op: dict[str, Any]) -> None:
        self._index = index
        self.reached("ops")
        if op["op"] not in ALL_CELL_OPS:
            raise TraceFormatError(f"op {index} field 'op': kind cells has no op {op['op']!r}; its ops: "
                                   f"{', '.join(ALL_CELL_OPS)}")
        if op["op"] == "expect":
            self.check_expect(index, op)
            return
        if op["op"] == "restore":
            _named(self.world, op, index)
        before = self.world
        try:
            if op["op"] == "restore":
                _named(self.world, op, index)  # a trace's unknown name: TraceFormatError naming the field
            s_result, s_world = self.spec_apply(op)
            spec_out = Outcome(result=s_result)
        except KVCacheError as exc:
            spec_out, s_world = Outcome(error=exc), None
        prev = seen = None
        if self.ours:
            prev = self.target.cache.copy()
            seen = cache_view(prev)
        try:
            impl_out = Outcome(result=self.target_apply(op, index))
        except TraceFormatError:
            raise
        except Exception as exc:  # noqa: BLE001 - a refusal, or the target's crash (compared below)
            impl_out = Outcome(error=exc)
        self.compare_refusal(index, op, spec_out, impl_out)
        self.refused = spec_out.error is not None
        if self.refused:
            self.reached("refused " + op["op"])
            self.refusals.append((index, str(spec_out.error)))
        if op.get("error") is True and spec_out.error is None:
            raise Divergence(index, op, "trace expects a refusal", spec_out.describe(), "a refusal",
                             ("spec says", "trace expects"))
        if op.get("error") is False and spec_out.error is not None:
            raise Divergence(index, op, "trace expects success", spec_out.describe(), "success",
                             ("spec says", "trace expects"))
        if s_world is not None:
            self.world = s_world
            if not (spec_out.result is None and impl_out.result is None) and \
                    not same_value(spec_out.result, impl_out.result):
                raise Divergence(index, op, "return value differs", spec_out.result, impl_out.result)
            self.check_value(index, op, spec_out.result)
        rows = op["op"] not in SHIFT_OPS and op["op"] != "save"
        pending = self._pending_shifts
        if op["op"] in SHIFT_OPS:
            self._pending_shifts += 0 if self.refused else 1
        elif rows:
            self._pending_shifts = 0
        got = _observe(self.target, rows=rows)
        if op["op"] in ("decode", "restore") and spec_out.error is None and spec_out.result:
            self.adopt(index, op, before, got)
        self.compare_cells(index, op, got, rows=rows)
        self.compare_positions(index, op)
        if prev is not None:
            self.compare_copy(index, op, prev, seen)
        if op["op"] in ("save", "restore") and spec_out.error is None:
            self.compare_snapshot(index, op)
        self.note(op, before, spec_out, pending)

    def compare_refusal(self, index: int, op: dict[str, Any], spec_out: Outcome, impl_out: Outcome) -> None:
        """Both refuse or neither; ours with the spec's type (and, with
        :attr:`compare_messages`, words), another target in the same
        category (kvspec.fuzz.protocol.refusal_category; its own exception types
        through its ``refusal_categories``)."""
        s_err, i_err = spec_out.error, impl_out.error
        if s_err is None and i_err is None:
            return
        if (s_err is None) != (i_err is None):
            raise Divergence(index, op, "refusal differs", spec_out.describe(), impl_out.describe())
        if self.ours:
            if type(s_err) is not type(i_err):
                raise Divergence(index, op, "refusal differs", spec_out.describe(), impl_out.describe())
            if self.compare_messages and str(s_err) != str(i_err) and op["op"] not in self.OWN_WORDED_OPS:
                raise Divergence(index, op, "refusal message differs", spec_out.describe(), impl_out.describe())
            return
        cats = getattr(self.target, "refusal_categories", None)
        if refusal_category(s_err) != refusal_category(i_err, cats):  # type: ignore[arg-type]
            raise Divergence(index, op, "refusal category differs", spec_out.describe(),
                             f"{impl_out.describe()} ({refusal_category(i_err, cats) or 'not a refusal: a crash'})")

    #: ops whose refusals the implementation words its own way (only its type
    #: is compared): none, kvspec.impl.cells words every refusal as kvspec.spec.cells does
    OWN_WORDED_OPS: ClassVar[frozenset[str]] = frozenset()

    def check_value(self, index: int, op: dict[str, Any], result: Any) -> None:
        """The trace's own checks on the spec: a ``pos_min``/``pos_max``
        op's ``value``, a ``returns`` of decode, seq_rm or restore."""
        for key in ("value", "returns"):
            if key in op and op[key] != result:
                raise Divergence(index, op, f"trace's {key!r} check fails", result, op[key],
                                 ("spec says", "trace expects"))

    def adopt(self, index: int, op: dict[str, Any], before: CellsWorld,
              got: dict[str, list[tuple[int, frozenset[int], Any, Any]]]) -> None:
        """The adoption rule: when the target's window store differs from
        the spec's after a decode or a restore, the cells it no longer holds
        (whole, or for some holders) must each have been droppable
        (forgettable) on the state its slot search saw: before the decode,
        or after the restore's clear of its destination. The spec then runs
        the op again with those drops (``drops=``: the group validated on
        the state before them, as llama-batch.cpp validates a batch before
        find_slot), so the two stay in step. Any other difference is left
        to :meth:`compare_cells`."""
        if "window" not in self.target.stores:
            return
        want = Counter(spec_cells(self.world.memory, "window"))
        have = Counter((p, s, v if v is not None else (k[0] if k else None)) for p, s, k, v in got["window"])
        if want == have:
            return
        if op["op"] == "restore":
            snap = before.snapshots[op["name"]][0]
            _, seen = sc.seq_rm(before.memory, op["seq"], -1, None)
            items = adoption(seen, op, got["window"],
                             [(p, frozenset({op["seq"]}), t) for p, t in snap.store("window")])
            n = len(snap.store("window"))
        else:
            seen = before.memory
            items = adoption(before.memory, op, got["window"])
            n = len(op["tokens"])
        if not items:
            return
        policy = getattr(self.target, "drop_policy", None)
        # the count bound holds for a target that declares a drop policy
        # (reuse only while free cells run short); llama.cpp's find_slot
        # reuses an out-of-window cell met in head order even while free
        # cells remain further on, which the spec permits (any droppable
        # cell may go): a target with no declared policy is held to
        # droppability and to the write's size (a write reuses at most n cells)
        why = drop_count_breach(seen, n, items, free_first=policy is not None)
        if why:
            raise Divergence(index, op, "window store: more cells dropped than the write needs", why,
                             f"window store after the {op['op']}: {_show(got['window'])}")
        if policy == sc.DROP_POLICY and "drops" not in op:
            own = sorted((Counter(c.key for c in self.world.memory.store("window") if c.lost)
                          - Counter(c.key for c in seen.store("window") if c.lost)).elements(), key=repr)
            mine = sorted(sc.drop_item(i)[0][0] for i in items)
            if sorted(k[0] for k in own) != mine:
                raise Divergence(index, op, f"window store: the target declares the spec's drop policy ({policy}) "
                                 "but dropped other positions",
                                 f"drops positions {sorted(k[0] for k in own)}", f"dropped positions {mine}")
        try:
            if op["op"] == "restore":
                ok, memory = sc.restore(before.memory, snap, op["seq"], drops=items)
            else:
                ok, memory = sc.decode(before.memory, tuple(op["seqs"]), tuple(op["tokens"]), op["pos0"],
                                       drops=items)
        except KVCacheError as exc:
            raise Divergence(index, op, "window store: a cell dropped that was not droppable", str(exc),
                             f"window store after the {op['op']}: {_show(got['window'])}") from None
        if ok:
            self.world = CellsWorld(memory, self.world.snapshots)
            op["drops"] = drops_json(items)
            self.reached("windowed cells dropped by the target's choice")
            if op["op"] == "decode":
                self.reached("windowed cells dropped by the target's choice at a decode")
            elif any(op["seq"] in c.seqs for c in before.memory.present("window")):
                self.reached("windowed cells dropped by the target's choice at a restore into a sequence that "
                             "held window cells")

    def compare_cells(self, index: int, op: dict[str, Any], got: dict[str, list[Any]], rows: bool) -> None:
        """Every store as a multiset of ``(pos, seqs, K name, V name)``
        (``rows=False``: positions and holders only)."""
        for store in self.target.stores:
            want = [(p, s, (t, p), t) for p, s, t in spec_cells(self.world.memory, store)]
            have = list(got.get(store, []))
            if not rows:
                want = [(p, s, None, None) for p, s, _, _ in want]
                have = [(p, s, None, None) for p, s, _, _ in have]
            if Counter(want) != Counter(have):
                extra, missing = Counter(have) - Counter(want), Counter(want) - Counter(have)
                what = f"{store} store differs"
                if rows and Counter((p, s) for p, s, _, _ in want) == Counter((p, s) for p, s, _, _ in have):
                    what = f"{store} store: rows differ (K named (token, pos) by its rotation, V by token)"
                raise Divergence(index, op, what, f"{len(want)} cells; not on the {self.impl_name} side: "
                                 f"{_show(missing.elements()) or 'none'}",
                                 f"{len(have)} cells; not in the spec: {_show(extra.elements()) or 'none'}")

    def compare_positions(self, index: int, op: dict[str, Any]) -> None:
        """Every observable of every sequence (:meth:`spec_observables`:
        ``pos_min``, ``pos_max``, and ``lost`` on ours), then asserts that
        the keys compared are exactly :meth:`observable_keys` (a compared
        set that misses one, such as the last sequence id, is a harness
        defect: AssertionError)."""
        compared = set()
        for key, want in self.spec_observables().items():
            name, seq = key[:-1].split("(")
            try:
                have = getattr(self.target, name)(int(seq))
            except Exception as exc:  # noqa: BLE001 - a read that raises is the divergence
                raise Divergence(index, op, f"{key} raised", want, error_text(exc)) from None
            if name == "lost":
                want, have = sorted(want), sorted(have)
            if not same_value(want, have):
                raise Divergence(index, op, f"{key} differs", want, have)
            compared.add(key)
        if compared != self.observable_keys():
            raise AssertionError(f"cells lockstep: op {index} compared {sorted(compared)}, but the observables are "
                                 f"{sorted(self.observable_keys())}")

    def compare_copy(self, index: int, op: dict[str, Any], prev: Any, seen: Any) -> None:
        """A copy of our cache taken before the op (``prev``) must not have
        changed with it: its cells, rows, pending shifts and lost positions
        (``seen``: :func:`cache_view` of it before the op)."""
        now = cache_view(prev)
        if now != seen:
            what = [k for k in seen if seen[k] != now.get(k)]
            raise Divergence(index, op, "a copy taken before the op changed with it (copies not independent)",
                             f"unchanged {what}", f"changed {what}")

    def compare_snapshot(self, index: int, op: dict[str, Any]) -> None:
        """The snapshot saved (at ``save``) or restored (at ``restore``):
        per store the cells ``(pos, K name, V name)``, K named by the
        snapshot's own rows."""
        name = op["name"]
        want = sc.observe_snapshot(self.world.snapshots[name][0])
        try:
            got = self.target.observe_snapshot(self.snaps[name])
        except Exception as exc:  # noqa: BLE001 - an unreadable snapshot is the divergence
            raise Divergence(index, op, f"snapshot {name!r} cannot be read", want, error_text(exc)) from None
        for store in sorted(set(want) | set(got)):
            w, g = want.get(store, []), got.get(store, [])
            if Counter(w) != Counter(g):
                raise Divergence(index, op, f"snapshot {name!r}, {store} store differs", _show(w), _show(g))

    def check_expect(self, index: int, op: dict[str, Any]) -> None:
        """``expect``: ``window`` is the tokens of sequence ``seq``'s cells
        in position order in store ``store`` (default: the first), on the
        spec and on the target."""
        seq = op.get("seq")
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < self.cfg["n_seq"]:
            raise TraceFormatError(f"op {index} field 'seq': an expect of a cells cache names a sequence id "
                                   f"0..{self.cfg['n_seq'] - 1}, got {seq!r}")
        store = op.get("store", self.target.stores[0])
        if store not in self.target.stores:
            raise TraceFormatError(f"op {index} field 'store': {store!r} is not a store of this cache "
                                   f"({', '.join(self.target.stores)})")
        want = [t for _, t in sorted((p, t) for p, s, t in spec_cells(self.world.memory, store) if seq in s)]
        if want != list(op["window"]):
            raise Divergence(index, op, "trace's 'expect' fails on the spec", want, list(op["window"]),
                             ("spec says", "trace expects"))
        got = _observe(self.target, rows=True)[store]
        have = [k[0] if k else "?" for _, k in sorted(((p, k) for p, s, k, _ in got if seq in s), key=lambda c: c[0])]
        if have != want:
            raise Divergence(index, op, "trace's 'expect' fails on the implementation", want, have)

    def note(self, op: dict[str, Any], before: CellsWorld, out: Outcome, pending: int) -> None:
        """The events a campaign counts (``must_reach`` in fuzz/kinds.py)."""
        name = op["op"]
        if out.error is not None:
            return
        if name == "decode":
            self.reached("decodes" if out.result else "decodes without a slot")
            if out.result and "window" in self.target.stores and \
                    len(before.memory.present("window")) + len(op["tokens"]) > window_cells(self.cfg):
                self.reached("windowed cells reused")
                if "full" in self.target.stores:
                    self._iswa_reused = True
        elif name == "seq_rm":
            self.reached("removals" if out.result else "windowed seq_rm refused")
            if not out.result and self._iswa_reused:
                self.reached("windowed seq_rm refused after an iSWA window reuse")
        elif name == "restore":
            if not out.result:
                self.reached("restores without room")
            else:
                same = op["seq"] == before.snapshots[op["name"]][1]
                self.reached("restores into the same sequence" if same else "restores into another sequence")
        elif name == "save":
            self.reached("saves after a pending shift" if pending else "saves")
        elif name in SHIFT_OPS:
            self.reached(name + "s" if self.world.memory != before.memory else name + " no-ops")
            if pending and self.world.memory != before.memory:
                self.reached("shifts composed before a read")
        else:
            self.reached(name)
        if any(len(s) > 1 for st_ in self.target.stores for _, s, _ in spec_cells(self.world.memory, st_)):
            self.reached("shared cells")

    # -- kvtrace annotations (kvspec.fuzz.campaign.annotate) ----------------------------
    def predictions(self, op: dict[str, Any], result: Any) -> dict[str, Any]:
        if op["op"] in ("decode", "seq_rm", "restore") and isinstance(result, bool):
            return {"returns": result}
        if op["op"] in ("pos_min", "pos_max"):
            return {"value": result}
        return {}

    def expect_ops(self) -> list[dict[str, Any]]:
        """``expect`` ops pinning every sequence's tokens in every store."""
        out = []
        m = self.world.memory
        for store in self.cfg["stores"]:
            for s in range(self.cfg["n_seq"]):
                toks = [t for _, t in sorted((p, t) for p, seqs, t in spec_cells(m, store) if s in seqs)]
                op = {"op": "expect", "seq": s, "window": toks}
                if store != self.cfg["stores"][0]:
                    op["store"] = store
                out.append(op)
        return out


# -- the state machine ----------------------------------------------------------


class CellsMachine(KVMachine):
    """A cells memory's life, biased to its edges: 2 to 8 cells per store
    (an iSWA memory's window store smaller, 2 of 3 times: 1 to
    ``n_cells - 1`` cells), a window of 1 to 4 (iSWA, full only, or window
    only), 2 or 3
    sequences, a vocabulary of 4 to 6 tokens; decode groups of 1 to 3
    tokens (coupled sequences sometimes, wrong positions and sequence ids
    sometimes: refused); seq_cp after a seq_rm of the destination
    (sharing), shifts up, context shifts (seq_rm then seq_add down), two
    shifts before a read, seq_div, saves (after a pending shift too) and
    restores into the same and other sequences, tail removals a window
    must refuse, seq_keep and clear."""

    kind = "cells"
    saved = Bundle("saved")
    # the rules of the one-sequence kinds: not ops of a cells memory
    fetch = hold = release_hold = trim = trim_to = snapshot = restore = drop = branch = misuse_name = None  # type: ignore[assignment]

    def setup(self, **cfg: Any) -> None:
        from kvspec.fuzz.kinds import get as kind_entry

        type(self).runs += 1
        entry = kind_entry(self.kind, self.mode)
        self.cfg = {**entry.defaults(), "kind": self.kind, "mode": self.mode, "inplace": self.inplace, **cfg,
                    **self.fixed}
        if "window" not in self.cfg["stores"]:
            self.cfg["window"] = None
        elif self.cfg.get("window") is None:
            self.cfg["window"] = cfg.get("window") or 2
        self.cfg["window_cells"] = window_cells(self.cfg) if "window" in self.cfg["stores"] else self.cfg["n_cells"]
        self.cfg = {k: v for k, v in self.cfg.items() if v is not None or k == "window"}
        if self.make_lockstep is None:
            raise TypeError(f"{type(self).__name__}: build machines with kvspec.fuzz.campaign.machine_for")
        self.lock = self.make_lockstep(self.cfg, self.factories, self.check_inplace, self.target)
        self.without = entry.without

    @initialize(data=st.data())
    def init(self, data: st.DataObject) -> None:
        stores = data.draw(st.sampled_from([("full", "window"), ("full",), ("window",), ("full", "window")]),
                           label="stores")
        cfg: dict[str, Any] = {
            "stores": list(stores),
            "window": data.draw(st.integers(1, 4), label="window") if "window" in stores else None,
            "n_cells": data.draw(st.integers(2, 8), label="n_cells"),
            "n_seq": data.draw(st.integers(2, 3), label="n_seq"),
            "kv_heads": data.draw(st.integers(1, 2), label="kv_heads"),
            "head_dim": data.draw(st.sampled_from([8, 8, 16]), label="head_dim"),
            "dtype": data.draw(st.sampled_from(["float16", "float16", "bfloat16", "float32"]), label="dtype"),
        }
        if stores == ("full", "window") and data.draw(st.sampled_from([True, True, False]), label="smaller window"):
            # llama.cpp sizes an iSWA model's window store smaller than the full one: the window store reuses
            # cells while the full store has room, so its lost cells (and the removals refused for them) arise
            # from decodes, not only from restores
            # (at least the window when the full store allows it, as llama.cpp's n_swa * n_seq + n_ubatch does)
            n = cfg["n_cells"]
            cfg["window_cells"] = data.draw(st.integers(min(cfg["window"], n - 1), n - 1), label="window_cells")
        self.vocab = data.draw(st.integers(4, 6), label="vocab")
        self.setup(**cfg)

    # -- what the spec holds now (the rules draw from it) --------------------------
    @property
    def mem(self) -> Any:
        return self.lock.world.memory

    @property
    def n_seq(self) -> int:
        return self.cfg["n_seq"]

    def positions(self, seq: int) -> list[int]:
        return sorted(sc.logical_positions(self.mem, seq)) if seq >= 0 else sorted(
            {p for s in range(self.n_seq) for p in sc.logical_positions(self.mem, s)})

    def draw_pos(self, data: st.DataObject, seq: int, label: str) -> int:
        """A position near ``seq``'s: one it holds, one past its end, 0."""
        ps = self.positions(seq)
        return data.draw(st.sampled_from(sorted({0, *ps, (ps[-1] + 1) if ps else 1})), label=label)

    def next_pos(self, seq: int) -> int:
        return sc.logical_pos_max(self.mem, seq) + 1

    def tokens(self, data: st.DataObject, n: int) -> list[int]:
        return data.draw(st.lists(st.integers(0, self.vocab - 1), min_size=n, max_size=n), label="tokens")

    # -- rules ------------------------------------------------------------------
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        """A group of 1 to 3 tokens for one sequence, or for every sequence
        coupled with it (same pos_min, pos_max and next position); now and
        then with a wrong position or sequence id (refused)."""
        s = data.draw(st.integers(0, self.n_seq - 1), label="seq")
        key = (sc.pos_min(self.mem, s), sc.pos_max(self.mem, s), self.next_pos(s))
        mates = [o for o in range(self.n_seq)
                 if o != s and (sc.pos_min(self.mem, o), sc.pos_max(self.mem, o), self.next_pos(o)) == key]
        seqs = [s] + (mates if mates and data.draw(st.booleans(), label="coupled") else [])
        n = data.draw(st.integers(1, 3), label="n")
        pos0 = self.next_pos(s) if self.next_pos(s) > 0 else data.draw(st.sampled_from([0, 0, 2]), label="pos0")
        how = data.draw(st.sampled_from(["ok"] * 8 + ["gap", "back", "bad seq", "repeat", "uncoupled"]), label="how")
        if how == "gap":
            pos0 += 1 if self.next_pos(s) > 0 else 0
        elif how == "back":
            pos0 -= 1
        elif how == "bad seq":
            seqs = [self.n_seq]
        elif how == "repeat":
            seqs = [s, s]
        elif how == "uncoupled":
            seqs = [s] + [o for o in range(self.n_seq) if o != s][:1]
        self.do({"op": "decode", "seqs": seqs, "tokens": self.tokens(data, n), "pos0": pos0})

    @rule(data=st.data())
    def fill(self, data: st.DataObject) -> None:
        """Decodes of one sequence until the window store reuses cells or
        the memory has no slot."""
        s = data.draw(st.integers(0, self.n_seq - 1), label="seq")
        for _ in range(data.draw(st.integers(2, 4), label="groups")):
            n = data.draw(st.integers(1, 3), label="n")
            self.do({"op": "decode", "seqs": [s], "tokens": self.tokens(data, n), "pos0": max(self.next_pos(s), 0)})

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        """seq_rm of a whole sequence, its tail (a windowed memory refuses
        one that would leave a lost position in the next window), its head,
        a middle range or every sequence's range."""
        seq = data.draw(st.sampled_from([-1, *range(self.n_seq), *range(self.n_seq)]), label="seq")
        how = data.draw(st.sampled_from(["tail", "tail", "whole", "head", "middle"]), label="how")
        if how == "whole":
            p0, p1 = data.draw(st.sampled_from([(-1, -1), (0, None), (-1, None)]), label="range")
        elif how == "tail":
            p0, p1 = self.draw_pos(data, seq, "p0"), None
        elif how == "head":
            p0, p1 = 0, self.draw_pos(data, seq, "p1")
        else:
            p0 = self.draw_pos(data, seq, "p0")
            p1 = p0 + data.draw(st.integers(0, 2), label="width")
        self.do({"op": "seq_rm", "seq": seq, "p0": p0, "p1": p1})

    @precondition(lambda self: self.lock is not None and "window" in self.cfg["stores"])
    @rule(data=st.data())
    def window_then_trim(self, data: st.DataObject) -> None:
        """Decode one sequence until the window store has reused (lost)
        some of its cells, then remove its tail from 1 to w positions past
        its last lost position: the window rule refuses a removal that
        would bring a lost position back into the next decode's window
        (all but the last of those), and accepts the last."""
        s = data.draw(st.integers(0, self.n_seq - 1), label="seq")
        # one token at a time in a small window store smaller than the full one (it fills first), else (a
        # window store too large to fill here, as another engine's may be) four groups of 3
        n = 1 if self.cfg["window_cells"] < min(self.cfg["n_cells"], 12) else 3
        for _ in range(4 if n == 3 else self.cfg["window_cells"] + self.cfg["window"] + 1):
            if sc.lost(self.mem, s):
                break
            self.do({"op": "decode", "seqs": [s], "tokens": self.tokens(data, n), "pos0": self.next_pos(s)})
        lost = sc.lost(self.mem, s)
        if lost:  # p0 - 1 - q < w - 1 refuses; the last draw (j = w) is the first accepted
            p0 = max(lost) + data.draw(st.integers(1, self.cfg["window"]), label="past lost")
        else:
            p0 = max(self.next_pos(s) - data.draw(st.integers(1, self.cfg["window"] + 1), label="back"), 1)
        self.do({"op": "seq_rm", "seq": s, "p0": p0, "p1": None})

    @precondition(lambda self: self.lock is not None and "window" in self.cfg["stores"] and self.n_seq >= 2)
    @rule(data=st.data())
    def restore_crowded(self, data: st.DataObject) -> None:
        """A restore into a sequence that holds window cells while the
        window store is full of another sequence's cells: after the clear
        of the destination the snapshot's window part needs droppable
        cells, and a target may choose which (adoption at a restore);
        then a seq_cp of the source into it (the positions collide:
        refused)."""
        dst = data.draw(st.integers(0, self.n_seq - 1), label="dst")
        src = data.draw(st.integers(0, self.n_seq - 1).filter(lambda s: s != dst), label="src")
        if not any(dst in c.seqs for c in self.mem.present("window")):
            self.do({"op": "decode", "seqs": [dst], "tokens": self.tokens(data, 1), "pos0": self.next_pos(dst)})
        for _ in range(self.cfg["window_cells"] + self.cfg["window"]):
            if sc.free_cells(self.mem, "window") == 0 and len(sc.save(self.mem, src).store("window")) >= 2:
                break
            self.do({"op": "decode", "seqs": [src], "tokens": self.tokens(data, 1), "pos0": self.next_pos(src)})
        name = self.fresh_name("s")
        self.do({"op": "save", "seq": src, "name": name})
        self.do({"op": "restore", "name": name, "seq": dst})
        # dst now holds src's positions (or, without room, its own): sharing them again collides (refused)
        self.do({"op": "seq_cp", "src": src, "dst": dst, "p0": 0, "p1": None})

    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        """seq_rm of the destination, then seq_cp of the source's cells
        (all, or from a position on): cells shared by two sequences."""
        src = data.draw(st.integers(0, self.n_seq - 1), label="src")
        dst = data.draw(st.integers(0, self.n_seq - 1).filter(lambda d: d != src), label="dst")
        p0 = data.draw(st.sampled_from([-1, 0, self.draw_pos(data, src, "from")]), label="p0")
        self.do({"op": "seq_rm", "seq": dst, "p0": -1, "p1": -1})
        self.do({"op": "seq_cp", "src": src, "dst": dst, "p0": p0, "p1": -1})

    @rule(data=st.data())
    def copy_range(self, data: st.DataObject) -> None:
        """seq_cp of a range as drawn (dst may already hold those
        positions: refused)."""
        src = data.draw(st.integers(0, self.n_seq - 1), label="src")
        dst = data.draw(st.integers(0, self.n_seq - 1), label="dst")
        p0 = self.draw_pos(data, src, "p0")
        p1 = data.draw(st.sampled_from([None, p0 + 1, p0 + 2]), label="p1")
        self.do({"op": "seq_cp", "src": src, "dst": dst, "p0": p0, "p1": p1})

    @rule(data=st.data())
    def keep(self, data: st.DataObject) -> None:
        self.do({"op": "seq_keep", "seq": data.draw(st.integers(0, self.n_seq - 1), label="seq")})

    @rule(data=st.data())
    def shift(self, data: st.DataObject) -> None:
        """seq_add of a sequence's tail (up: never a collision within the
        sequence) or of a drawn range by -3..3 (may collide: refused)."""
        seq = data.draw(st.integers(0, self.n_seq - 1), label="seq")
        p0 = self.draw_pos(data, seq, "p0")
        if data.draw(st.booleans(), label="tail up"):
            self.do({"op": "seq_add", "seq": seq, "p0": p0, "p1": None,
                     "delta": data.draw(st.integers(1, 3), label="delta")})
        else:
            p1 = data.draw(st.sampled_from([None, p0 + 1, p0 + 2]), label="p1")
            self.do({"op": "seq_add", "seq": seq, "p0": p0, "p1": p1,
                     "delta": data.draw(st.integers(-3, 3), label="delta")})

    @rule(data=st.data())
    def context_shift(self, data: st.DataObject) -> None:
        """llama.cpp's context shift: keep the first ``k``, remove the
        next ``n``, move the rest down by ``n``; then decode one token."""
        seq = data.draw(st.integers(0, self.n_seq - 1), label="seq")
        k = data.draw(st.integers(0, 2), label="keep")
        n = data.draw(st.integers(1, 3), label="discard")
        self.do({"op": "seq_rm", "seq": seq, "p0": k, "p1": k + n})
        self.do({"op": "seq_add", "seq": seq, "p0": k + n, "p1": None, "delta": -n})
        if self.next_pos(seq) > 0:
            self.do({"op": "decode", "seqs": [seq], "tokens": self.tokens(data, 1), "pos0": self.next_pos(seq)})

    @rule(data=st.data())
    def shift_twice(self, data: st.DataObject) -> None:
        """Two shifts of one sequence before any read (their deltas must
        add up: llama.cpp #3825), then a decode or a save."""
        seq = data.draw(st.integers(0, self.n_seq - 1), label="seq")
        p0 = self.draw_pos(data, seq, "p0")
        self.do({"op": "seq_add", "seq": seq, "p0": p0, "p1": None, "delta": data.draw(st.integers(1, 2), label="a")})
        if data.draw(st.booleans(), label="div"):
            self.do({"op": "seq_div", "seq": seq, "p0": p0, "p1": None, "d": 2})
        else:
            self.do({"op": "seq_add", "seq": seq, "p0": p0, "p1": None,
                     "delta": data.draw(st.integers(1, 2), label="b")})
        if data.draw(st.booleans(), label="save"):
            self.do({"op": "save", "seq": seq, "name": self.fresh_name("s")})
        elif self.next_pos(seq) > 0:
            self.do({"op": "decode", "seqs": [seq], "tokens": self.tokens(data, 1), "pos0": self.next_pos(seq)})

    @rule(data=st.data())
    def divide(self, data: st.DataObject) -> None:
        """seq_div of a narrow range (often collision-free) by 1 to 3 (0:
        refused)."""
        seq = data.draw(st.integers(0, self.n_seq - 1), label="seq")
        p0 = self.draw_pos(data, seq, "p0")
        p1 = data.draw(st.sampled_from([p0 + 1, p0 + 2, None]), label="p1")
        self.do({"op": "seq_div", "seq": seq, "p0": p0, "p1": p1,
                 "d": data.draw(st.sampled_from([2, 3, 2, 1, 0]), label="d")})

    @rule(target=saved, data=st.data())
    def save(self, data: st.DataObject) -> str:
        """A sequence's state, now or after a pending shift of its tail."""
        seq = data.draw(st.integers(0, self.n_seq - 1), label="seq")
        if data.draw(st.booleans(), label="shift first"):
            self.do({"op": "seq_add", "seq": seq, "p0": self.draw_pos(data, seq, "p0"), "p1": None, "delta": 1})
        name = self.fresh_name("s")
        self.do({"op": "save", "seq": seq, "name": name})
        return name

    @rule(name=saved, data=st.data())
    def restore_into(self, name: str, data: st.DataObject) -> None:
        """A saved state into its own sequence or another (which may have
        no room: refused, nothing changes)."""
        self.do({"op": "restore", "name": name, "seq": data.draw(st.integers(0, self.n_seq - 1), label="dst")})

    @rule(data=st.data())
    def read_positions(self, data: st.DataObject) -> None:
        seq = data.draw(st.integers(0, self.n_seq - 1), label="seq")
        self.do({"op": data.draw(st.sampled_from(["pos_min", "pos_max"]), label="op"), "seq": seq})

    @precondition(lambda self: self.lock is not None and sum(len(self.mem.present(s)) for s in self.cfg["stores"]) > 4)
    @rule()
    def clear(self) -> None:
        self.do({"op": "clear"})


def target_factories(target_factory: Any) -> dict[str, Any] | None:
    """``kvspec.fuzz.replay.make_lockstep``'s factories for a cells target: None
    (ours), a subclass of ``kvspec.impl.cells.CellCache`` (an injected bug) or a
    callable ``cache -> CellsTarget`` (another engine)."""
    if target_factory is None:
        return None
    if isinstance(target_factory, type) and issubclass(target_factory, _impl().CellCache):
        return {"cells": target_factory}
    return {"cells": {"target": target_factory}}
