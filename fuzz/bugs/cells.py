"""Injected bugs of the cells memory (``kvspec.impl.cells.CellCache``).

See ``fuzz/bugs/__init__.py`` for the catalog and the entry type. Each bug
is a subclass of ``CellCache`` that replaces one method (or the one helper
that method calls) with a broken version; ``kvspec mutants`` and ``kvspec
verify`` must catch each one, and ``tests/traces/<name>.json`` holds a
minimal trace that passes on ``CellCache`` and diverges on the bug.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.fuzz.bugs import InjectedBug
from kvspec.impl.cells import (
    _NAMES,
    CellCache,
    CellsSnapshot,
    _in,
    _range,
    _Store,
    from_host,
    to_host,
)


class ShiftDeltaNotAccumulated(CellCache):
    """A second shift before the rows are re-rotated overwrites the cell's
    pending delta instead of adding to it (llama.cpp #3825, fixed by PR
    #3835: ``cells[i].delta = delta`` for ``+=``): after two shifts the K
    row is rotated by the last one only."""

    def _move(self, op: str, seq: int, p0: int, p1: int | None, f: Any, *rest: Any) -> None:
        before = {name: (list(st.pos), list(st.shift)) for name, st in self._st.items()}
        super()._move(op, seq, p0, p1, f, *rest)
        for name, st in self._st.items():
            pos, shift = before[name]
            for i in st.used():
                if st.pos[i] != pos[i] and shift[i]:
                    st.shift[i] = st.pos[i] - pos[i]  # the delta of this move only


class SaveKeepsPendingShift(CellCache):
    """save writes the K rows as stored, without applying the pending
    shifts first: a restored cell claims the shifted position but holds a
    key rotated for the old one (a shift lost through state save and
    restore)."""

    def save(self, seq: int) -> CellsSnapshot:
        seq = self._seq("save", "seq", seq)
        out = {}
        for name, st in self._st.items():
            idxs = sorted(st.of(seq), key=lambda i: st.pos[i])
            if name == "window" and idxs:
                top = st.pos[idxs[-1]]
                idxs = [i for i in idxs if top - st.pos[i] < self.window]
            ix = mx.array(idxs, dtype=mx.int32)
            out[name] = (np.array([st.pos[i] for i in idxs], dtype=np.int64), to_host(st.k[ix]), to_host(st.v[ix]))
        return CellsSnapshot(self.stores, self.kv_heads, self.head_dim, _NAMES[self.dtype], out)


class WindowedRemovalNeverRefused(CellCache):
    """A partial seq_rm on a memory with a window store is always reported
    done, though the window already dropped positions the next decode
    would attend to (llama.cpp's kv cache returns true always): the sequence goes on with a hole in its window."""

    def seq_rm(self, seq: int, p0: int | None = 0, p1: int | None = None) -> bool:
        window = self.window
        if window is not None:
            self.window = -(1 << 40)  # no lost position is ever "in the next window"
        try:
            return super().seq_rm(seq, p0, p1)
        finally:
            self.window = window


class SeqCpCopies(CellCache):
    """seq_cp copies each cell (its rows into a free cell held by dst alone)
    instead of adding dst to the cell's set: the memory holds two cells
    where llama.cpp shares one, and runs out of room sooner."""

    def seq_cp(self, src: int, dst: int, p0: int | None = 0, p1: int | None = None) -> None:
        trial = self.copy()
        CellCache.seq_cp(trial, src, dst, p0, p1)  # the real one's checks and refusals
        if src == dst:
            return
        a, b = _range("seq_cp", p0, p1)
        for name, st in self._st.items():
            free = [i for i in range(len(st.pos)) if st.pos[i] < 0]
            for i in [i for i in st.of(src) if _in(st.pos[i], a, b) and dst not in st.seqs[i]]:
                if not free:
                    st.seqs[i] = st.seqs[i] | {dst}
                    continue
                j = free.pop(0)
                st.pos[j], st.seqs[j], st.shift[j] = st.pos[i], frozenset((dst,)), st.shift[i]
                st.write([j], st.k[i:i + 1], st.v[i:i + 1])
            st.lost = list(trial._st[name].lost)


class DecodeReusesSharedCell(CellCache):
    """The window store's reuse test asks whether the cell is out of the
    window of *a* holder, not whether exactly one sequence holds it: a
    shared cell is reused (overwritten) though another holder still
    attends to it (llama.cpp guards this with ``seq_count == 1``): a decode
    writes through a cell seq_cp shared."""

    def _droppable(self, stores: dict[str, _Store], st: _Store) -> list[int]:
        if st.name != "window":
            return []
        out = [i for i in st.used()
               if any((max(self._logical_max(stores, h), st.pos[i]) + 1) - st.pos[i] >= self.window
                      for h in st.seqs[i])]
        return sorted(out, key=lambda i: (st.pos[i], i))


class RemovalFreesSharedCell(CellCache):
    """seq_rm frees every cell of the sequence in range, whoever else holds
    it: a cell freed while another sequence holds it (the other sequence
    loses positions it never removed)."""

    def seq_rm(self, seq: int, p0: int | None = 0, p1: int | None = None) -> bool:
        valid = isinstance(seq, int) and not isinstance(seq, bool) and 0 <= seq < self.n_seq
        shared = {name: [i for i in st.of(seq) if len(st.seqs[i]) > 1] if valid else []
                  for name, st in self._st.items()}
        ok = super().seq_rm(seq, p0, p1)
        if ok:
            for name, st in self._st.items():
                for i in shared[name]:
                    if st.pos[i] >= 0 and seq not in st.seqs[i]:
                        st.free(i)
        return ok


class RestoreKeepsDstCells(CellCache):
    """restore writes the snapshot's cells without clearing dst first:
    dst keeps its old cells beside the restored ones."""

    def restore(self, snapshot: CellsSnapshot, dst: int) -> bool:
        dst = self._seq("restore", "dst", dst)
        self._check_snapshot("restore", snapshot)
        new = self._clone()
        slots = {}
        for name, st in new.items():
            n = len(snapshot.cells[name][0])
            if n:
                got = self._slots(new, st, n)
                if got is None:
                    return False
                slots[name] = got
        self.update()
        held = frozenset((dst,))
        for name, st in new.items():
            st.k, st.v, st.shift = self._st[name].k, self._st[name].v, [0] * len(st.pos)
            if name not in slots:
                continue
            pos, k, v = snapshot.cells[name]
            for j, i in enumerate(slots[name]):
                if st.pos[i] >= 0:  # a droppable window cell reused, as CellCache.restore does
                    st.lost.append((st.pos[i], st.seqs[i]))
                st.pos[i], st.seqs[i], st.shift[i] = int(pos[j]), held, 0
            st.write(slots[name], from_host(k, self.dtype), from_host(v, self.dtype))
            st.head = (slots[name][-1] + 1) % len(st.pos)
        self._st = new
        return True


class SeqKeepKeepsSharers(CellCache):
    """seq_keep frees the cells ``seq`` does not hold but leaves the other
    holders in the cells it shares: sequences seq_keep should have removed
    still see (and hold) those cells."""

    def seq_keep(self, seq: int) -> None:
        seq = self._seq("seq_keep", "seq", seq)
        for st in self._st.values():
            for i in st.used():
                if seq not in st.seqs[i]:
                    st.free(i)
            st.lost = [(p, ss) for p, ss in st.lost if seq in ss]


class PosMaxStaleAfterRemoval(CellCache):
    """pos_max is kept per sequence and refreshed by decode, shifts and
    restore, but not by seq_rm: after a tail removal it still reports the
    removed end."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._stale: dict[int, int] = {}

    def seq_rm(self, seq: int, p0: int | None = 0, p1: int | None = None) -> bool:
        before = {s: CellCache.pos_max(self, s) for s in range(self.n_seq)}
        ok = super().seq_rm(seq, p0, p1)
        if ok:
            for s, was in before.items():
                if was >= 0:
                    self._stale.setdefault(s, was)
        return ok

    def pos_max(self, seq: int) -> int:
        got = super().pos_max(seq)
        return self._stale.get(seq, got) if got >= 0 else got

    def _forget(self) -> None:
        self._stale = {}

    def decode(self, *args: Any, **kwargs: Any) -> bool:
        ok = super().decode(*args, **kwargs)
        if ok:
            self._forget()
        return ok

    def seq_add(self, *args: Any, **kwargs: Any) -> None:
        super().seq_add(*args, **kwargs)
        self._forget()

    def seq_div(self, *args: Any, **kwargs: Any) -> None:
        super().seq_div(*args, **kwargs)
        self._forget()

    def restore(self, *args: Any, **kwargs: Any) -> bool:
        ok = super().restore(*args, **kwargs)
        self._forget()
        return ok

    def clear(self) -> None:
        super().clear()
        self._forget()


class SeqDivRoundsUp(CellCache):
    """seq_div rounds the new positions up (``ceil(p / d)``) where llama.cpp
    floors them (``pos /= d`` on integers)."""

    _ceil_by: int | None = None

    def seq_div(self, seq: int, p0: int | None, p1: int | None, d: int) -> None:
        self._ceil_by = d if isinstance(d, int) and not isinstance(d, bool) and d >= 1 else None
        try:
            super().seq_div(seq, p0, p1, d)
        finally:
            self._ceil_by = None

    def _move(self, op: str, seq: int, p0: int, p1: int | None, f: Any, *rest: Any) -> None:
        d = self._ceil_by
        super()._move(op, seq, p0, p1, f if d is None else (lambda p: -(-p // d)), *rest)


class DroppableOneEarly(CellCache):
    """The window store's reuse test is off by one (``top + 1 - pos >= w -
    1``): a cell still inside its holder's window is overwritten."""

    def _droppable(self, stores: dict[str, _Store], st: _Store) -> list[int]:
        if st.name != "window":
            return []
        out = []
        for i in st.used():
            if len(st.seqs[i]) == 1:
                (h,) = st.seqs[i]
                if (max(self._logical_max(stores, h), st.pos[i]) + 1) - st.pos[i] >= self.window - 1:
                    out.append(i)
        return sorted(out, key=lambda i: (st.pos[i], i))


class PosMaxStaleForLastSequence(CellCache):
    """pos_max of the highest sequence id (``n_seq - 1``) is served from a
    per-sequence value refreshed only by decode: after a removal, a shift,
    a restore or a clear it still reports the old end. Only that sequence
    shows it: a compared set that skips the last sequence id misses it."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._last_max = -1

    def decode(self, *args: Any, **kwargs: Any) -> bool:
        ok = super().decode(*args, **kwargs)
        self._last_max = super().pos_max(self.n_seq - 1)
        return ok

    def pos_max(self, seq: int) -> int:
        got = super().pos_max(seq)
        return self._last_max if seq == self.n_seq - 1 else got


class CloneSharesLost(CellCache):
    """A copy of the cache shares its stores' lost lists with the original
    (the metadata copied, the lost cells not): a decode of the original
    that reuses a window cell changes the copy's lost positions too."""

    def _clone(self) -> dict[str, _Store]:
        new = super()._clone()
        for name, st in new.items():
            st.lost = self._st[name].lost
        return new


def _entry(name: str, clause: str, source: str, replaces: str, description: str, cls: type) -> InjectedBug:
    return InjectedBug(name, clause, source, "cells", ("fp16",), replaces, description, {"cells": cls})


BUGS: tuple[InjectedBug, ...] = (
    _entry("cells_shift_delta_not_accumulated", "semantics.md 10, shifts (pending deltas accumulate)",
           "llama.cpp #3825 (PR #3835): a K-shift delta overwritten by the next shift", "CellCache._move",
           "a second shift before the rows are read overwrites the pending delta", ShiftDeltaNotAccumulated),
    _entry("cells_save_keeps_pending_shift", "semantics.md 10, save (every saved K row named (token, pos))",
           "a pending seq_add shift lost through state save and restore", "CellCache.save",
           "save does not apply pending shifts: saved K rows rotated for the old positions", SaveKeepsPendingShift),
    _entry("cells_windowed_removal_never_refused", "semantics.md 10, seq_rm (the window rule: refused, nothing changes)",
           "seq_rm returns true after the window dropped cells (iSWA)", "CellCache.seq_rm",
           "a partial seq_rm the window cannot honour is reported done", WindowedRemovalNeverRefused),
    _entry("cells_seq_cp_copies", "semantics.md 10, seq_cp (sharing, no copy)",
           "seq_cp as a copy of rows (llama.cpp shares cells: one cell, several sequence ids)", "CellCache.seq_cp",
           "seq_cp copies each cell into a new one held by dst alone", SeqCpCopies),
    _entry("cells_decode_reuses_shared_cell", "semantics.md 10, decode (droppable: held by exactly one sequence)",
           "llama.cpp find_slot's seq_count == 1 guard missing: a decode writes through a shared cell",
           "CellCache._droppable", "the window reuses a shared cell out of one holder's window", DecodeReusesSharedCell),
    _entry("cells_removal_frees_shared_cell", "semantics.md 10, seq_rm (a cell is freed when its set is empty)",
           "a cell freed while another sequence holds it", "CellCache.seq_rm",
           "seq_rm frees a shared cell instead of removing the sequence from it", RemovalFreesSharedCell),
    _entry("cells_restore_keeps_dst_cells", "semantics.md 10, restore (dst cleared first)",
           "llama_state_seq_set_data without the seq_rm(dst) it starts with", "CellCache.restore",
           "restore keeps dst's old cells beside the restored ones", RestoreKeepsDstCells),
    _entry("cells_seq_keep_keeps_sharers", "semantics.md 10, seq_keep (every other sequence removed)",
           "seq_keep that frees the cells seq lacks but leaves other holders in shared cells", "CellCache.seq_keep",
           "seq_keep leaves the other holders of shared cells", SeqKeepKeepsSharers),
    _entry("cells_pos_max_stale_after_seq_rm", "semantics.md 10, pos_max (the largest present position)",
           "a cached per-sequence pos_max not refreshed by seq_rm", "CellCache.pos_max",
           "pos_max still reports positions seq_rm removed", PosMaxStaleAfterRemoval),
    _entry("cells_seq_div_rounds_up", "semantics.md 10, seq_div (pos // d)", "integer division rounded the wrong way",
           "CellCache.seq_div", "seq_div rounds positions up", SeqDivRoundsUp),
    _entry("cells_droppable_one_early", "semantics.md 10, decode (droppable: pos_max(h) + 1 - pos >= w)",
           "an off-by-one window test (the SWA mask's < against <=)", "CellCache._droppable",
           "the window reuses a cell one position early, still inside its holder's window", DroppableOneEarly),
    _entry("cells_pos_max_stale_last_seq", "semantics.md 10, pos_max (the largest present position)",
           "a per-sequence pos_max cache refreshed only by decode, read for the highest sequence id",
           "CellCache.pos_max", "pos_max of sequence n_seq - 1 keeps the value of its last decode",
           PosMaxStaleForLastSequence),
    _entry("cells_clone_shares_lost", "semantics.md 10, copies (a copy is independent)",
           "a copy whose lost-cell lists alias the original's", "CellCache._clone",
           "a copy shares the lost cells of the original: its lost positions change with it", CloneSharesLost),
)
