"""Injected bugs of the prefix cache (``impl.prefix.PrefixCachePool``).

See ``fuzz/bugs/__init__.py`` for the catalog and the entry type. Each bug
is a subclass of ``PrefixCachePool`` that replaces one method (or the one
helper that method calls) with a broken version; ``kvspec mutants`` and
``kvspec verify`` must catch each one, and ``tests/traces/<name>.json``
holds a minimal trace that passes on ``PrefixCachePool`` and diverges on
the bug.
"""

from __future__ import annotations

from fuzz.bugs import InjectedBug

BUGS: tuple[InjectedBug, ...] = ()
