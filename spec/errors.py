"""Refusal types shared by the spec and the implementation.

The differential harness compares refusals by type, so the spec and the
implementation raise exactly these classes. Messages name the operation, the
argument, its value and the rule, e.g.
``gather_positions: positions must be strictly increasing, got [3, 1]``.
"""


class KVCacheError(Exception):
    """Base class of every refusal. A refused operation changes nothing."""


class InvalidArgumentError(KVCacheError, ValueError):
    """An argument breaks the operation's documented precondition."""


class UnsupportedOperationError(KVCacheError):
    """The operation is not defined for this cache mode or kind."""


class StateError(KVCacheError):
    """The operation is not allowed in the cache's current state
    (e.g. ``install`` into a non-empty cache, an unknown snapshot name)."""


class RollbackWarning(UserWarning):
    """A rollback that a layer cannot honour exactly (a sliding-window ring
    wrapped beyond its undo log, semantics.md 6): nothing was trimmed, so a
    loop that goes on decoding (mlx-lm's speculative decoding) leaves the
    stream it would have had without the rolled-back rows. Issued once per
    cache; ``kvspec.impl.models.trim_prompt_cache(..., strict=True)`` raises
    StateError instead."""
