"""Injected bugs of the cells memory (``impl.cells.CellCache``).

See ``fuzz/bugs/__init__.py`` for the catalog and the entry type. Each bug
is a subclass of ``CellCache`` that replaces one method.
"""

from __future__ import annotations

from fuzz.bugs import InjectedBug

BUGS: tuple[InjectedBug, ...] = ()
