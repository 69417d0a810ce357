"""A legal cells target that chooses other droppable window cells than the
spec: ``HighestFirstCellCache``, our ``kvspec.impl.cells.CellCache`` reusing the
droppable window cell of the HIGHEST position first (at a decode and at a
restore). Which droppable cells a target reuses is its own choice
(adoption, ``kvspec.fuzz.cells.CellsLockstep.adopt``), so a campaign against it
must agree with the spec everywhere: it runs the adoption branches that a
target choosing as the spec does never reaches (tests/test_fuzz_cells.py)."""

from __future__ import annotations

from kvspec.impl.cells import CellCache, _Store

__all__ = ["HighestFirstCellCache"]


class HighestFirstCellCache(CellCache):
    """``CellCache`` whose window store reuses droppable cells highest
    position first (ties: the highest cell index); free cells still come
    first."""

    drop_policy = "highest position first"

    def _droppable(self, stores: dict[str, _Store], st: _Store) -> list[int]:
        return sorted(super()._droppable(stores, st), key=lambda i: (-st.pos[i], -i))
