"""Executable spec of the ``cells`` kind: llama.cpp's KV memory of cells
shared by sequences (semantics.md 10, docs/cells.md).

A **memory** is one or two **stores** that receive every op together:
``"full"`` (attention over every cell; it never drops a cell) and
``"window"`` (the sliding-window layers of an iSWA model, window ``w >= 1``:
a token at position p attends to positions q with ``p - q < w``). A memory
of a window store alone (every layer windowed) is allowed too.

A **cell** holds one position ``pos >= 0``, a non-empty set ``seqs`` of
sequence ids and the ``token`` whose K/V rows it holds. Cell indices are not
observable: a store is the multiset of ``(pos, seqs, token)``. A cell whose
set becomes empty is free.

Per sequence the spec also keeps its **logical positions**: what it would
hold if no windowed cell had been dropped. In the window store a dropped cell
is kept as a *lost* cell (``Cell.lost``): not present, not observable, no
capacity used, but it moves, is shared and is removed exactly as a present
one, so ``lost(s)`` = the positions of the lost cells held by ``s`` and, with
a full store, ``present_full(s) == present_window(s) | lost(s)``.

Rules (each refusal changes nothing: the state is frozen and an op builds a
new one, assigned only on success):

* per sequence, positions are unique among present cells and among logical
  positions (decode, seq_cp, seq_add, seq_div, restore refuse a collision);
* a cell is freed exactly when its set becomes empty (seq_rm, seq_keep, a
  seq_add below 0 frees the cell for every holder, clear);
* **window rule**: an accepted partial ``seq_rm`` never leaves a lost
  position ``q`` of the sequence in the next decode's window
  (``q > new_pos_max + 1 - w``); it returns False and changes nothing
  instead (llama.h: "Returns false if a partial sequence cannot be
  removed");
* capacity: a decode of n tokens needs n usable cells per store (free cells
  plus, in the window store, droppable ones), else it returns False.

The spec's K/V rows are always right (a shift is applied at once), so a K row
is named ``(token, pos)`` and a V row ``token`` (:meth:`CellsMemory.observe`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvspec.spec.errors import InvalidArgumentError, StateError

FULL, WINDOW = "full", "window"
#: the store layouts a memory may have
LAYOUTS = ((FULL,), (FULL, WINDOW), (WINDOW,))
#: ``(pos, seqs, token)``: how a present cell is named (its observable identity)
CellKey = tuple[int, frozenset[int], int]


# -- integer rules (CrossHair contracts) ------------------------------------------------


def norm_range(p0: int, p1: int | None) -> tuple[int, int | None]:
    """llama.h's range arguments: ``p0 < 0`` reads as 0, ``p1 < 0`` (or
    None) as "to infinity" (None).

    post: __return__[0] >= 0
    post: __return__[1] is None or __return__[1] >= 0
    post: p1 is None or p1 < 0 or __return__[1] == p1
    """
    return max(p0, 0), (None if p1 is None or p1 < 0 else p1)


def in_range(pos: int, p0: int, p1: int | None) -> bool:
    """``pos`` in ``[p0, p1)`` (``p1`` None: no upper bound); the range is
    normalised (:func:`norm_range`) first.

    post: __return__ == (pos >= max(p0, 0) and (p1 is None or p1 < 0 or pos < p1))
    """
    a, b = norm_range(p0, p1)
    return pos >= a and (b is None or pos < b)


def out_of_window(pos: int, pos_max: int, window: int) -> bool:
    """Whether a sequence whose largest position is ``pos_max`` no longer
    attends to a cell at ``pos`` from its next token on (position
    ``pos_max + 1``): ``(pos_max + 1) - pos >= window`` (llama.cpp's
    ``is_masked_swa`` for the standard window, as ``find_slot`` calls it).
    A windowed cell held by one sequence and out of its window is
    **droppable**.

    pre: window >= 1
    pre: 0 <= pos <= pos_max
    post: __return__ == (pos + window <= pos_max + 1)
    post: not __return__ or window > 1 or pos <= pos_max
    """
    return (pos_max + 1) - pos >= window


def in_next_window(q: int, pos_max: int, window: int) -> bool:
    """Whether position ``q`` lies in the window of the next decode of a
    sequence whose largest logical position is ``pos_max``: the next token
    is at ``pos_max + 1`` and sees ``q`` iff ``(pos_max + 1) - q < window``,
    i.e. ``q > pos_max + 1 - window``. The window rule refuses a removal
    that leaves a lost ``q`` there.

    pre: window >= 1
    post: __return__ == (not out_of_window(q, pos_max, window))
    """
    return q > pos_max + 1 - window


def shifted(pos: int, delta: int) -> int | None:
    """A cell's position after ``seq_add`` of ``delta``: ``pos + delta``, or
    None (the cell is freed) when it would be negative (llama-kv-cells.h
    ``pos_add``).

    pre: pos >= 0
    post: __return__ is None or __return__ >= 0
    post: (__return__ is None) == (pos + delta < 0)
    """
    p = pos + delta
    return None if p < 0 else p


def divided(pos: int, d: int) -> int:
    """A cell's position after ``seq_div`` by ``d >= 1``: ``pos // d``; its
    pending shift grows by ``pos // d - pos`` (llama-kv-cells.h ``pos_div``).

    pre: pos >= 0 and d >= 1
    post: 0 <= __return__ <= pos
    """
    return pos // d


# -- the state ---------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class CellsConfig:
    """A cells memory's shape.

    * ``n_cells`` (int >= 1): cells of the full store (and of the window
      store unless ``window_cells`` says otherwise);
    * ``window`` (int >= 1, or None): the window store's window ``w``; None
      exactly when there is no window store;
    * ``window_cells`` (int, ``1 <= window_cells <= n_cells``, or None for
      ``n_cells``): cells of the window store. llama.cpp sizes its
      sliding-window store smaller than the full one
      (llama-kv-cache-iswa.cpp: from ``n_swa``, ``n_seq_max`` and
      ``n_ubatch``, padded), so in an iSWA memory the window store runs out
      of free cells first and reuses droppable ones. Without a window store
      it must be None or ``n_cells``;
    * ``stores``: ``("full",)``, ``("full", "window")`` (iSWA) or
      ``("window",)``;
    * ``n_seq`` (int >= 1): sequence ids are ``0 .. n_seq - 1``.

    Raises InvalidArgumentError naming the field and the rule."""

    n_cells: int = 8
    window: int | None = None
    stores: tuple[str, ...] = (FULL,)
    n_seq: int = 4
    window_cells: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stores", tuple(self.stores))
        if self.window_cells is None and _is_int(self.n_cells):
            object.__setattr__(self, "window_cells", self.n_cells)
        if not _is_int(self.n_cells) or self.n_cells < 1:
            raise InvalidArgumentError(f"cells: n_cells must be an integer >= 1, got {self.n_cells!r}")
        if not _is_int(self.n_seq) or self.n_seq < 1:
            raise InvalidArgumentError(f"cells: n_seq must be an integer >= 1, got {self.n_seq!r}")
        if self.stores not in LAYOUTS:
            raise InvalidArgumentError(f"cells: stores must be one of {[list(s) for s in LAYOUTS]}, "
                                       f"got {list(self.stores)!r}")
        if WINDOW in self.stores:
            if not _is_int(self.window) or self.window < 1:  # type: ignore[operator]
                raise InvalidArgumentError(f"cells: window must be an integer >= 1 with a window store, "
                                           f"got {self.window!r}")
        elif self.window is not None:
            raise InvalidArgumentError(f"cells: window must be None without a window store, got {self.window!r}")
        wc = self.window_cells
        if not _is_int(wc) or not 1 <= wc <= self.n_cells:  # type: ignore[operator]
            raise InvalidArgumentError(f"cells: window_cells must be an integer with 1 <= window_cells <= n_cells "
                                       f"({self.n_cells}), got {wc!r}")
        if WINDOW not in self.stores and wc != self.n_cells:
            raise InvalidArgumentError(f"cells: window_cells must be None or n_cells ({self.n_cells}) without a "
                                       f"window store, got {wc!r}")

    def size(self, store: str) -> int:
        """Cells of ``store``: ``window_cells`` for the window store,
        ``n_cells`` for the full one."""
        return self.window_cells if store == WINDOW else self.n_cells  # type: ignore[return-value]


@dataclass(frozen=True)
class Cell:
    """One cell of a store: ``pos`` (int >= 0), ``seqs`` (non-empty
    frozenset of sequence ids), ``token`` (the token whose rows it holds),
    ``lost`` (window store only: dropped by a decode, kept for the logical
    positions; never observable, uses no capacity)."""

    pos: int
    seqs: frozenset[int]
    token: int
    lost: bool = False

    @staticmethod
    def make(pos: int, seqs: frozenset[int], token: int, lost: bool = False) -> Cell:
        return Cell(pos, frozenset(seqs), token, lost)

    @property
    def key(self) -> CellKey:
        """``(pos, seqs, token)``: the cell's observable identity (unique in a
        store: two cells at one position share no sequence)."""
        return (self.pos, self.seqs, self.token)


def _canon(cells: list[Cell] | tuple[Cell, ...]) -> tuple[Cell, ...]:
    return tuple(sorted(cells, key=lambda c: (c.lost, c.pos, sorted(c.seqs), c.token)))


@dataclass(frozen=True)
class CellsState:
    """The memory: ``config`` and, per store of ``config.stores`` (same
    order), its cells (present and lost) in a canonical order."""

    config: CellsConfig
    stores: tuple[tuple[Cell, ...], ...]

    def store(self, name: str) -> tuple[Cell, ...]:
        if name not in self.config.stores:
            raise InvalidArgumentError(f"cells: store must be one of {list(self.config.stores)}, got {name!r}")
        return self.stores[self.config.stores.index(name)]

    def present(self, name: str) -> tuple[Cell, ...]:
        """The store's used cells (what it observably holds)."""
        return tuple(c for c in self.store(name) if not c.lost)

    def with_store(self, name: str, cells: list[Cell] | tuple[Cell, ...]) -> CellsState:
        i = self.config.stores.index(name)
        return replace(self, stores=self.stores[:i] + (_canon(cells),) + self.stores[i + 1:])


def empty(config: CellsConfig) -> CellsState:
    """An empty memory of ``config``."""
    return CellsState(config, tuple(() for _ in config.stores))


# -- queries -----------------------------------------------------------------------------


def _check_seq(op: str, name: str, seq: object, config: CellsConfig, allow_all: bool = False) -> int:
    low = -1 if allow_all else 0
    if not _is_int(seq) or not (low <= seq < config.n_seq):  # type: ignore[operator]
        what = "-1 (every sequence) or " if allow_all else ""
        raise InvalidArgumentError(f"{op}: {name} must be {what}a sequence id in 0..{config.n_seq - 1}, got {seq!r}")
    return seq  # type: ignore[return-value]


def _check_range(op: str, p0: object, p1: object) -> tuple[int, int | None]:
    if not _is_int(p0):
        raise InvalidArgumentError(f"{op}: p0 must be an integer (< 0 reads as 0), got {p0!r}")
    if p1 is not None and not _is_int(p1):
        raise InvalidArgumentError(f"{op}: p1 must be an integer or None (< 0 or None: to infinity), got {p1!r}")
    return norm_range(p0, p1)  # type: ignore[arg-type]


def _reported_store(state: CellsState) -> str:
    return WINDOW if WINDOW in state.config.stores else FULL


def pos_min(state: CellsState, seq: int) -> int:
    """The smallest present position of ``seq``, -1 if it holds none. As
    llama.cpp's iSWA memory reports it: from the window store when there is
    one (llama-kv-cache-iswa.cpp: "the base cache is a superset of the SWA
    cache"), else the full store; so after a windowed drop it is the first
    position the window still holds. Raises InvalidArgumentError for a bad
    sequence id."""
    _check_seq("pos_min", "seq", seq, state.config)
    ps = [c.pos for c in state.present(_reported_store(state)) if seq in c.seqs]
    return min(ps) if ps else -1


def pos_max(state: CellsState, seq: int) -> int:
    """The largest present position of ``seq`` (same store as
    :func:`pos_min`), -1 if it holds none. Positions in between may be
    missing (holes: a middle ``seq_rm``; docs/cells.md, Decision 1)."""
    _check_seq("pos_max", "seq", seq, state.config)
    ps = [c.pos for c in state.present(_reported_store(state)) if seq in c.seqs]
    return max(ps) if ps else -1


def logical_positions(state: CellsState, seq: int) -> frozenset[int]:
    """The positions ``seq`` would hold had no windowed cell been dropped:
    its cells' positions in the first store, lost ones included (with a full
    store: its full-store positions)."""
    return frozenset(c.pos for c in state.stores[0] if seq in c.seqs)


def logical_pos_max(state: CellsState, seq: int) -> int:
    """The largest logical position of ``seq``, -1 if none: where its next
    decode must continue (``pos0 = logical_pos_max + 1``)."""
    ps = logical_positions(state, seq)
    return max(ps) if ps else -1


def lost(state: CellsState, seq: int) -> frozenset[int]:
    """Positions of ``seq`` the window store has dropped (empty without a
    window store)."""
    if WINDOW not in state.config.stores:
        return frozenset()
    return frozenset(c.pos for c in state.store(WINDOW) if c.lost and seq in c.seqs)


def window_breaches(state: CellsState, seq: int) -> tuple[int, ...]:
    """The lost positions of ``seq`` inside its next decode's window
    (:func:`in_next_window` of its logical pos_max), ascending; empty when
    the window rule holds. Only the window rule of ``seq_rm`` refuses to
    create one; a partial ``seq_add`` / ``seq_div`` / ``seq_cp`` may
    (docs/cells.md, hazard H2)."""
    w = state.config.window
    if w is None:
        return ()
    top = logical_pos_max(state, seq)
    return tuple(sorted(q for q in lost(state, seq) if in_next_window(q, top, w)))


def droppable(state: CellsState, store: str = WINDOW) -> frozenset[CellKey]:
    """The keys ``(pos, seqs, token)`` of the present cells of ``store`` a
    decode may reuse now: in the window store, a cell held by exactly one
    sequence h and :func:`out_of_window` of ``pos_max(h)`` (logical, before
    the decode; llama-kv-cache.cpp ``find_slot``). Empty for the full store.
    Raises InvalidArgumentError for a store the memory lacks."""
    cells = state.present(store)
    w = state.config.window
    if store != WINDOW or w is None:
        return frozenset()
    out = set()
    for c in cells:
        if len(c.seqs) == 1:
            (h,) = c.seqs
            if out_of_window(c.pos, max(logical_pos_max(state, h), c.pos), w):
                out.add(c.key)
    return frozenset(out)


def forgettable(state: CellsState, store: str = WINDOW) -> frozenset[tuple[CellKey, int]]:
    """``(key, seq)`` pairs: present cells of the window store out of the
    window of a holder ``seq`` (whatever the number of holders). llama.cpp's
    ``apply_ubatch``, after reusing a cell of sequence s, removes s from every
    cell of s at or below the reused position (a purge that keeps s's window
    positions contiguous); a shared cell then loses s but stays. Adoption
    accepts such a removal through :func:`drop` with a pair."""
    cells = state.present(store)
    w = state.config.window
    if store != WINDOW or w is None:
        return frozenset()
    return frozenset((c.key, h) for c in cells for h in c.seqs
                     if out_of_window(c.pos, max(logical_pos_max(state, h), c.pos), w))


def free_cells(state: CellsState, store: str) -> int:
    """The store's size (``n_cells``, or ``window_cells`` for the window
    store) minus its present cells."""
    return state.config.size(store) - len(state.present(store))


def usable(state: CellsState, store: str) -> int:
    """Cells a decode may write in ``store``: free ones plus droppable ones."""
    return free_cells(state, store) + len(droppable(state, store))


# -- ops (pure: each returns a new state; a refusal raises and changes nothing) ----------


def _lose(cells: tuple[Cell, ...], keys: frozenset[CellKey], pairs: frozenset[tuple[CellKey, int]]) -> list[Cell]:
    out: list[Cell] = []
    for c in cells:
        if c.lost:
            out.append(c)
            continue
        gone = set(c.seqs) if c.key in keys else {h for h in c.seqs if (c.key, h) in pairs}
        if gone:
            out.append(Cell.make(c.pos, frozenset(gone), c.token, lost=True))
            if c.seqs - gone:
                out.append(Cell.make(c.pos, c.seqs - gone, c.token))
        else:
            out.append(c)
    return out


def drop_item(item: Any) -> tuple[CellKey, int | None]:
    """One item of :func:`drop`'s ``cells`` read as ``(key, seq)``: a key
    ``(pos, seqs, token)`` gives ``(key, None)`` (the whole cell), a pair
    ``(key, seq)`` gives ``(key, seq)`` (``seq`` forgets it). Tuples or
    lists (a kvtrace's ``drops`` field: ``[pos, [seq, ...], token]`` or
    ``[[pos, [seq, ...], token], seq]``). Raises InvalidArgumentError for
    any other shape."""
    def key_of(k: Any) -> CellKey | None:
        if not isinstance(k, tuple | list) or len(k) != 3:
            return None
        pos, seqs, tok = k
        if not _is_int(pos) or pos < 0 or not _is_int(tok) or not isinstance(seqs, tuple | list | frozenset | set) \
                or not seqs or not all(_is_int(s) for s in seqs):
            return None
        return (pos, frozenset(seqs), tok)

    if isinstance(item, tuple | list) and len(item) == 2 and _is_int(item[1]):
        key = key_of(item[0])
        if key is not None:
            return key, item[1]
    key = key_of(item)
    if key is None:
        raise InvalidArgumentError(f"drop: a dropped cell must be [pos, [seq, ...], token] (the whole cell) or "
                                   f"[[pos, [seq, ...], token], seq] (seq forgets it), pos >= 0, got {item!r}")
    return key, None


def drop(state: CellsState, store: str, cells: Any) -> CellsState:
    """Adoption: the target dropped these windowed cells. ``cells``: an
    iterable of keys ``(pos, seqs, token)`` (each in :func:`droppable`:
    the cell becomes lost for its holder) or of pairs ``(key, seq)`` (each
    in :func:`forgettable`: ``seq`` forgets the cell; a shared cell stays
    for the other holders). The state is the one the target's slot search
    saw: before the decode (:func:`decode` takes the target's choice as
    ``drops`` and calls this after validating the group), or after a
    restore's clear of ``dst`` (:func:`restore`). Raises StateError naming the first cell that may not be
    dropped (nothing changes), InvalidArgumentError for a store the memory
    lacks."""
    state.store(store)
    keys: set[CellKey] = set()
    pairs: set[tuple[CellKey, int]] = set()
    may_drop, may_forget = droppable(state, store), forgettable(state, store)
    for item in cells:
        key, seq = drop_item(item)
        if seq is not None:
            if (key, seq) not in may_forget:
                raise StateError(f"drop: sequence {seq} may not forget the {store} cell (pos={key[0]}, "
                                 f"seqs={sorted(key[1])}, token={key[2]}): it is not a present cell out of that "
                                 f"sequence's window")
            pairs.add((key, seq))
        else:
            if key not in may_drop:
                raise StateError(f"drop: the {store} cell (pos={key[0]}, seqs={sorted(key[1])}, token={key[2]}) "
                                 f"is not droppable (a present window cell held by one sequence h with "
                                 f"pos_max(h) + 1 - pos >= window)")
            keys.add(key)
    if not keys and not pairs:
        return state
    return state.with_store(store, _lose(state.store(store), frozenset(keys), frozenset(pairs)))


#: the spec's own choice of droppable window cells when free cells run short
#: (:func:`_make_room`); a target that declares it must drop the same positions
DROP_POLICY = "lowest position first"


def _make_room(base: CellsState, need: dict[str, int], drops: Any) -> CellsState | None:
    """``base`` with room for ``need[store]`` new cells per store, or None
    (no slot). The window store may drop droppable cells of ``base``: first
    ``drops`` (the target's choice, :func:`drop`: StateError for a cell that
    may not go), then, while free cells run short, the droppable cells of
    lowest position. Droppable is read on ``base`` (the state the slot
    search sees), never on a state the drops already changed."""
    for name, n in need.items():
        if usable(base, name) < n:
            return None
    drops = list(drops or ())
    new = drop(base, WINDOW, drops) if drops else base
    for name, n in need.items():
        short = n - free_cells(new, name)
        if short > 0:
            here = {c.key for c in new.present(name)}
            order = sorted((k for k in droppable(base, name) if k in here), key=lambda k: (k[0], sorted(k[1]), k[2]))
            if len(order) < short:
                return None
            new = drop(new, name, order[:short])
    return new


def decode(state: CellsState, seqs: tuple[int, ...], tokens: tuple[int, ...], pos0: int,
           drops: Any = None) -> tuple[bool, CellsState]:
    """``llama_decode`` of one group: ``tokens`` (>= 1 token ids) at
    positions ``pos0, pos0 + 1, ...``, each held by every sequence of
    ``seqs`` (a shared prompt: one cell per token per store).

    Refused (InvalidArgumentError, nothing changes): ``seqs`` empty, repeated
    or out of range; ``tokens`` empty or not integers; ``pos0 < 0``; the
    sequences of the group differ in ``pos_min`` or ``pos_max`` (coupled
    sequences, llama-batch.cpp); a sequence that holds positions does not
    continue at ``logical_pos_max + 1`` (positions stay consecutive and
    unique).

    Returns ``(False, state)`` (llama_decode's 1, "no slot") when a store
    has fewer :func:`usable` cells than tokens. Else ``(True, new)``: new
    present cells in every store; in the window store, when free cells run
    short, the droppable cells of lowest position are dropped (become lost),
    as many as needed.

    ``drops`` (adoption: the windowed cells a target's decode dropped, as
    :func:`drop` takes them): the group is validated first, on ``state``
    (llama-batch.cpp validates a batch before ``find_slot`` reuses any
    cell, so a drop of a group member's cell never changes the pos_min /
    pos_max it is checked against); then the drops are applied (each
    checked droppable or forgettable on ``state``: StateError otherwise),
    then the cells are written (more droppable cells dropped if free cells
    still run short)."""
    cfg = state.config
    if not isinstance(seqs, tuple | list) or not seqs:
        raise InvalidArgumentError(f"decode: seqs must be a non-empty tuple of sequence ids, got {seqs!r}")
    for s in seqs:
        _check_seq("decode", "seqs", s, cfg)
    if len(set(seqs)) != len(seqs):
        raise InvalidArgumentError(f"decode: seqs must not repeat a sequence id, got {list(seqs)}")
    if isinstance(tokens, tuple | list) and not tokens:
        raise InvalidArgumentError("decode: tokens must hold n >= 1 tokens (one K and V row each), got 0")
    if not isinstance(tokens, tuple | list) or not all(_is_int(t) for t in tokens):
        raise InvalidArgumentError(f"decode: tokens must be a non-empty tuple of integer token ids, got {tokens!r}")
    if not _is_int(pos0) or pos0 < 0:
        raise InvalidArgumentError(f"decode: pos0 must be an integer >= 0, got {pos0!r}")
    bounds = {(pos_min(state, s), pos_max(state, s)) for s in seqs}
    if len(bounds) > 1:
        raise InvalidArgumentError(f"decode: the sequences {list(seqs)} of one group must have the same pos_min and "
                                   f"pos_max (coupled sequences), got {sorted(bounds)}")
    for s in seqs:
        top = logical_pos_max(state, s)
        if top >= 0 and pos0 != top + 1:
            raise InvalidArgumentError(f"decode: sequence {s} holds positions up to {top}, so pos0 must be {top + 1} "
                                       f"(positions stay consecutive), got {pos0}")
    n = len(tokens)
    made = _make_room(state, {name: n for name in cfg.stores}, drops)
    if made is None:
        return False, state
    new = made
    group = frozenset(seqs)
    for name in cfg.stores:
        added = [Cell.make(pos0 + i, group, t) for i, t in enumerate(tokens)]
        new = new.with_store(name, new.store(name) + tuple(added))
    return True, new


def _partial(p0: int, p1: int | None) -> bool:
    return not (p0 <= 0 and p1 is None)


def seq_rm(state: CellsState, seq: int, p0: int, p1: int | None) -> tuple[bool, CellsState]:
    """``llama_memory_seq_rm``: remove ``seq`` (-1: every sequence) from every
    cell (present or lost) with pos in ``[p0, p1)``; a cell whose set becomes
    empty is freed.

    **Window rule** (returns ``(False, state)``, nothing changes in any
    store): the memory has a window store, the removal is partial (not
    ``p0 <= 0`` and ``p1`` None), and afterwards a lost position q of a
    removed-from sequence lies in its next decode's window (``q >
    new_logical_pos_max + 1 - w``): that sequence could not continue with
    the attention its positions claim. Raises InvalidArgumentError for a bad
    sequence id or range."""
    cfg = state.config
    _check_seq("seq_rm", "seq", seq, cfg, allow_all=True)
    a, b = _check_range("seq_rm", p0, p1)
    targets = range(cfg.n_seq) if seq == -1 else (seq,)
    new = state
    for name in cfg.stores:
        out = []
        for c in new.store(name):
            if in_range(c.pos, a, b) and (seq == -1 or seq in c.seqs):
                rest = frozenset() if seq == -1 else c.seqs - {seq}
                if rest:
                    out.append(Cell.make(c.pos, rest, c.token, c.lost))
            else:
                out.append(c)
        new = new.with_store(name, out)
    if WINDOW in cfg.stores and _partial(a, b):
        for s in targets:
            if logical_positions(new, s) != logical_positions(state, s) and window_breaches(new, s):
                return False, state
    return True, new


def _collisions(cells: list[Cell]) -> tuple[int, int] | None:
    """``(seq, pos)``: the lowest position at which a sequence holds two
    cells (present or lost), the lowest such sequence; None if none."""
    seen: set[tuple[int, int]] = set()
    hits = []
    for c in cells:
        for s in c.seqs:
            if (s, c.pos) in seen:
                hits.append((c.pos, s))
            seen.add((s, c.pos))
    if not hits:
        return None
    pos, seq = min(hits)
    return seq, pos


def seq_cp(state: CellsState, src: int, dst: int, p0: int, p1: int | None) -> CellsState:
    """``llama_memory_seq_cp``: every cell (present or lost) of ``src`` with
    pos in ``[p0, p1)`` gets ``dst`` added to its set (sharing, no copy:
    one cell, one row). ``src == dst``: no-op. Refused
    (InvalidArgumentError, nothing changes) when ``dst`` would hold two cells
    at one position (``dst`` must be cleared of the range first, as llama.cpp's
    callers do with seq_rm). Raises InvalidArgumentError for bad ids or
    range."""
    cfg = state.config
    _check_seq("seq_cp", "src", src, cfg)
    _check_seq("seq_cp", "dst", dst, cfg)
    a, b = _check_range("seq_cp", p0, p1)
    if src == dst:
        return state
    new = state
    for name in cfg.stores:
        out = [Cell.make(c.pos, c.seqs | {dst}, c.token, c.lost) if src in c.seqs and in_range(c.pos, a, b) else c
               for c in new.store(name)]
        hit = _collisions(out)
        if hit is not None:
            raise InvalidArgumentError(f"seq_cp: sequence {dst} would hold two cells at position {hit[1]} "
                                       f"(src={src}, p0={p0}, p1={p1}); remove that range from dst first")
        new = new.with_store(name, out)
    return new


def seq_keep(state: CellsState, seq: int) -> CellsState:
    """``llama_memory_seq_keep``: every other sequence is removed from every
    cell; cells not held by ``seq`` are freed. Raises InvalidArgumentError for
    a bad sequence id."""
    cfg = state.config
    _check_seq("seq_keep", "seq", seq, cfg)
    new = state
    for name in cfg.stores:
        new = new.with_store(name, [Cell.make(c.pos, frozenset({seq}), c.token, c.lost)
                                    for c in new.store(name) if seq in c.seqs])
    return new


def _move(state: CellsState, op: str, seq: int, a: int, b: int | None, to: Any, what: str) -> CellsState:
    new = state
    for name in state.config.stores:
        out = []
        for c in new.store(name):
            if seq in c.seqs and in_range(c.pos, a, b):
                p = to(c.pos)
                if p is not None:
                    out.append(Cell.make(p, c.seqs, c.token, c.lost))
            else:
                out.append(c)
        hit = _collisions(out)
        if hit is not None:
            raise InvalidArgumentError(f"{op}: {what} would give sequence {hit[0]} two cells at position {hit[1]}; "
                                       f"remove the target range first")
        new = new.with_store(name, out)
    return new


def seq_add(state: CellsState, seq: int, p0: int, p1: int | None, delta: int) -> CellsState:
    """``llama_memory_seq_add``: the cells (present or lost) of ``seq`` with
    pos in ``[p0, p1)`` move by ``delta``. A cell has one position: a shared
    cell moves for every holder (as in llama.cpp; docs/cells.md, hazard H1).
    A cell whose position would be < 0 is freed (:func:`shifted`). ``delta
    == 0`` or an empty range: no-op. Refused (InvalidArgumentError, nothing
    changes) when some sequence would hold two cells at one position, or for
    bad arguments."""
    cfg = state.config
    _check_seq("seq_add", "seq", seq, cfg)
    a, b = _check_range("seq_add", p0, p1)
    if not _is_int(delta):
        raise InvalidArgumentError(f"seq_add: delta must be an integer, got {delta!r}")
    if delta == 0 or (b is not None and b <= a):
        return state
    return _move(state, "seq_add", seq, a, b, lambda p: shifted(p, delta), f"delta={delta} on [{a}, {b})")


def seq_div(state: CellsState, seq: int, p0: int, p1: int | None, d: int) -> CellsState:
    """``llama_memory_seq_div``: ``pos //= d`` for the cells of ``seq`` with
    pos in ``[p0, p1)`` (shared cells for every holder). ``d == 1`` or an
    empty range: no-op. Refused (InvalidArgumentError, nothing changes) for
    ``d < 1`` and when some sequence would hold two cells at one position
    (``d >= 2`` over two adjacent positions always does: the caller removes
    the range's duplicates first)."""
    cfg = state.config
    _check_seq("seq_div", "seq", seq, cfg)
    a, b = _check_range("seq_div", p0, p1)
    if not _is_int(d) or d < 1:
        raise InvalidArgumentError(f"seq_div: d must be an integer >= 1, got {d!r}")
    if d == 1 or (b is not None and b <= a):
        return state
    return _move(state, "seq_div", seq, a, b, lambda p: divided(p, d), f"d={d} on [{a}, {b})")


def clear(state: CellsState) -> CellsState:
    """``llama_memory_clear``: every cell of every store is freed."""
    return empty(state.config)


# -- per-sequence state ------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """``llama_state_seq_get_data``'s content: per store, the saved cells of
    one sequence as ``(pos, token)`` in position order (K rows named
    ``(token, pos)``: every shift applied before the save). The window store
    keeps only the live window (``pos_max - pos < w``)."""

    stores: tuple[str, ...]
    cells: tuple[tuple[tuple[int, int], ...], ...]

    def store(self, name: str) -> tuple[tuple[int, int], ...]:
        return self.cells[self.stores.index(name)] if name in self.stores else ()


def save(state: CellsState, seq: int) -> Snapshot:
    """The present cells of ``seq`` per store, ``(pos, token)`` by position;
    the window store keeps those with ``pos_max(seq) - pos < w`` (its live
    window; llama-kv-cache.cpp ``state_write``, which skips SWA-masked cells).
    Raises InvalidArgumentError for a bad sequence id."""
    cfg = state.config
    _check_seq("save", "seq", seq, cfg)
    out = []
    for name in cfg.stores:
        cells = sorted((c.pos, c.token) for c in state.present(name) if seq in c.seqs)
        if name == WINDOW and cells:
            top = cells[-1][0]
            cells = [(p, t) for p, t in cells if top - p < cfg.window]  # type: ignore[operator]
        out.append(tuple(cells))
    return Snapshot(cfg.stores, tuple(out))


def restore(state: CellsState, snapshot: Snapshot, dst: int, drops: Any = None) -> tuple[bool, CellsState]:
    """``llama_state_seq_set_data`` into ``dst``: ``dst`` is cleared (as
    ``seq_rm(dst, -1, -1)``), then the snapshot's cells are written as new
    cells held by ``dst`` alone. The logical positions of ``dst`` become the
    snapshot's full-store positions (when it has a full store), else the
    window's: full-store positions missing from the window snapshot become
    lost cells of the window store.

    Room is found as a decode finds it (llama.cpp's ``state_read_meta``
    calls ``find_slot`` after clearing ``dst``): free cells, and in the
    window store droppable cells of the cleared state (:func:`droppable`:
    held by one sequence, out of its window), lowest position first, or the
    target's choice ``drops`` (adoption, checked droppable or forgettable
    on the cleared state: StateError otherwise).

    Returns ``(False, state)`` (nothing changes, ``dst`` not cleared either;
    docs/cells.md, Decision 3) when a store lacks room (usable cells after
    the clear fewer than the snapshot's cells). Raises InvalidArgumentError for a
    snapshot of another store layout, a bad sequence id, or a snapshot whose
    positions repeat or are negative."""
    cfg = state.config
    _check_seq("restore", "dst", dst, cfg)
    if not isinstance(snapshot, Snapshot) or snapshot.stores != cfg.stores:
        raise InvalidArgumentError(f"restore: snapshot must be a Snapshot of stores {list(cfg.stores)}, "
                                   f"got {getattr(snapshot, 'stores', snapshot)!r}")
    for name in cfg.stores:
        ps = [p for p, _ in snapshot.store(name)]
        if len(set(ps)) != len(ps) or any(not _is_int(p) or p < 0 for p in ps):
            raise InvalidArgumentError(f"restore: the snapshot's {name} positions must be distinct integers >= 0, "
                                       f"got {ps}")
    _, cleared = seq_rm(state, dst, -1, None)
    made = _make_room(cleared, {name: len(snapshot.store(name)) for name in cfg.stores}, drops)
    if made is None:
        return False, state
    new = made
    me = frozenset({dst})
    for name in cfg.stores:
        cells = [Cell.make(p, me, t) for p, t in snapshot.store(name)]
        if name == WINDOW and FULL in cfg.stores:
            here = {p for p, _ in snapshot.store(WINDOW)}
            cells += [Cell.make(p, me, t, lost=True) for p, t in snapshot.store(FULL) if p not in here]
        new = new.with_store(name, new.store(name) + tuple(cells))
    return True, new


# -- observation -------------------------------------------------------------------------


def observe(state: CellsState) -> dict[str, list[tuple[int, frozenset[int], tuple[int, int], int]]]:
    """The protocol's observation: per store, ``(pos, seqs, k_name, v_name)``
    for every present cell, in canonical order; ``k_name = (token, pos)``
    (the spec's K rows are always rotated for their position) and ``v_name =
    token``."""
    return {name: [(c.pos, c.seqs, (c.token, c.pos), c.token) for c in state.present(name)]
            for name in state.config.stores}


def observe_snapshot(snapshot: Snapshot) -> dict[str, list[tuple[int, tuple[int, int], int]]]:
    """Per store, ``(pos, k_name, v_name)`` of the cells the snapshot holds,
    by position."""
    return {name: [(p, (t, p), t) for p, t in snapshot.store(name)] for name in snapshot.stores}


# -- the spec as a CellsTarget -----------------------------------------------------------


class CellsMemory:
    """The spec driven as a ``CellsTarget`` (fuzz/cells.py): the same
    methods and return values; each op replaces the frozen :attr:`state`
    only on success, so a refusal (a raised kvspec.spec.errors class or a False)
    changes nothing. ``save`` returns a :class:`Snapshot`."""

    def __init__(self, config: CellsConfig | None = None, **kwargs: Any) -> None:
        self.config = config if config is not None else CellsConfig(**kwargs)
        self.state = empty(self.config)

    @property
    def stores(self) -> tuple[str, ...]:
        return self.config.stores

    def decode(self, seqs: Any, tokens: Any, pos0: int, drops: Any = None) -> bool:
        ok, self.state = decode(self.state, tuple(seqs), tuple(tokens), pos0, drops)
        return ok

    def seq_rm(self, seq: int, p0: int, p1: int | None) -> bool:
        ok, self.state = seq_rm(self.state, seq, p0, p1)
        return ok

    def seq_cp(self, src: int, dst: int, p0: int, p1: int | None) -> None:
        self.state = seq_cp(self.state, src, dst, p0, p1)

    def seq_keep(self, seq: int) -> None:
        self.state = seq_keep(self.state, seq)

    def seq_add(self, seq: int, p0: int, p1: int | None, delta: int) -> None:
        self.state = seq_add(self.state, seq, p0, p1, delta)

    def seq_div(self, seq: int, p0: int, p1: int | None, d: int) -> None:
        self.state = seq_div(self.state, seq, p0, p1, d)

    def pos_min(self, seq: int) -> int:
        return pos_min(self.state, seq)

    def pos_max(self, seq: int) -> int:
        return pos_max(self.state, seq)

    def save(self, seq: int) -> Snapshot:
        return save(self.state, seq)

    def restore(self, snapshot: Snapshot, dst: int, drops: Any = None) -> bool:
        ok, self.state = restore(self.state, snapshot, dst, drops)
        return ok

    def clear(self) -> None:
        self.state = clear(self.state)

    def observe(self) -> dict[str, list[tuple[int, frozenset[int], Any, Any]]]:
        return observe(self.state)  # type: ignore[return-value]

    def observe_snapshot(self, snapshot: Snapshot) -> dict[str, list[tuple[int, Any, Any]]]:
        return observe_snapshot(snapshot)  # type: ignore[return-value]

    def droppable(self, store: str = WINDOW) -> frozenset[CellKey]:
        return droppable(self.state, store)

    def forgettable(self, store: str = WINDOW) -> frozenset[tuple[CellKey, int]]:
        return forgettable(self.state, store)

    def drop(self, store: str, cells: Any) -> None:
        self.state = drop(self.state, store, cells)
