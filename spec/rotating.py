"""Executable spec of the sliding-window (rotating) cache (semantics.md 3).

A ring of at most ``max_size`` (W) physical slots whose first ``keep`` (K)
slots hold the attention sinks, which are never evicted. The state is
physical on purpose: after a wrap a decode returns the buffer in *physical
ring order*, so the spec must say which entry sits in which slot.

* ``slots``: the buffer, one ``Entry`` or ``None`` (a zero row nobody wrote)
  per physical slot; ``len(slots)`` is the capacity.
* ``offset``: absolute count of rows ever written (RoPE position of the next).
* ``idx``: the physical write cursor.
* ``ident``/``marker``: buffer identity and ownership marker, as in the dense
  cache, for the warm-up in-place rule.

Valid rows are ``slots[:idx]`` while the ring is unwrapped (``idx ==
offset``), else every slot (a wrapped ring, or an oversized buffer after a
multi-row append).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from spec.dense import MAX_STEP, Entry, Mode
from spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError


def ring_slot(position: int, max_size: int, keep: int) -> int:
    """Slot of absolute ``position`` in a ring filled by decode steps only:
    sinks and the warm-up keep their position; afterwards non-sink positions
    cycle through ``[keep, max_size)``.

    pre: 0 <= keep < max_size
    pre: position >= 0
    post: 0 <= __return__ < max_size
    """
    if position < max_size:
        return position
    return keep + (position - keep) % (max_size - keep)


def visible_positions(offset: int, max_size: int, keep: int) -> tuple[int, ...]:
    """Absolute positions a decode-step reader sees once ``offset`` rows were
    written: the sinks ``[0, keep)`` and the latest ``max_size - keep``
    others, in increasing order.

    pre: 0 <= keep < max_size
    pre: offset >= 0
    post: len(__return__) == min(offset, max_size)
    """
    if offset <= max_size:
        return tuple(range(offset))
    return tuple(range(keep)) + tuple(range(offset - (max_size - keep), offset))


def chronological_order(n_slots: int, idx: int, keep: int, wrapped: bool) -> tuple[int, ...]:
    """Slot indices of the valid rows in chronological order: unwrapped,
    ``[0, idx)``; after a wrap, the sinks, then ``[idx, n_slots)`` (oldest
    non-sinks), then ``[keep, idx)``. Appending after a wrap in physical
    instead of this order is a known bug.

    pre: 0 <= keep <= idx <= n_slots
    post: len(__return__) == (n_slots if wrapped else idx)
    """
    if not wrapped:
        return tuple(range(idx))
    return tuple(range(keep)) + tuple(range(idx, n_slots)) + tuple(range(keep, idx))


def mask_visible(query: int, key: int, window: int, keep: int) -> bool:
    """May the query at absolute position ``query`` attend to the key at
    ``key``? Causal, and either a sink or among the ``window - keep`` latest
    positions. So each query sees exactly ``min(query + 1, window)`` keys
    when ``keep == 0`` (admitting ``window + 1`` is a known bug), and sinks
    stay visible to every later query of a chunk (hiding them is another).

    pre: 0 <= keep < window
    post: not __return__ or key <= query
    post: not __return__ or key < keep or query - key < window - keep
    post: __return__ or not (0 <= key < keep and key <= query)
    """
    return key <= query and (key < keep or query - key < window - keep)


@dataclass(frozen=True)
class RingMarker:
    """Ownership marker: buffer identity and the cursor after the cache's own
    last write."""

    buffer: int
    idx: int


@dataclass(frozen=True)
class RotatingCache:
    max_size: int
    keep: int = 0
    step: int = 256
    inplace: bool = True
    mode: Mode = Mode.FP16
    slots: tuple[Entry | None, ...] = ()
    offset: int = 0
    idx: int = 0
    ident: int | None = None
    marker: RingMarker | None = None
    next_ident: int = 0

    @property
    def capacity(self) -> int:
        return len(self.slots)

    @property
    def wrapped(self) -> bool:
        """Some valid row is not at ``slot == position``: the ring wrapped or
        a multi-row append dropped old rows."""
        return self.offset != self.idx

    @property
    def valid_len(self) -> int:
        """Number of valid slots from slot 0."""
        return self.capacity if self.wrapped else self.idx

    def window(self) -> tuple[int, ...]:
        """Token identities a fetch returns, in physical slot order."""
        return tuple(_valid(e).token for e in self.slots[: self.valid_len])

    def positions(self) -> tuple[int, ...]:
        return tuple(_valid(e).position for e in self.slots[: self.valid_len])


def _valid(e: Entry | None) -> Entry:
    """A valid slot always holds an entry (only slots past the cursor of an
    unwrapped ring are empty)."""
    assert e is not None
    return e


def new_cache(max_size: int, keep: int = 0, step: int = 256, inplace: bool = True,
              mode: Mode | str = Mode.FP16) -> RotatingCache:
    """An empty ring. Raises InvalidArgumentError unless ``max_size >= 1``,
    ``0 <= keep < max_size`` and ``1 <= step <= MAX_STEP``."""
    if max_size < 1:
        raise InvalidArgumentError(f"max_size: must be >= 1, got {max_size}")
    if keep < 0 or keep >= max_size:
        raise InvalidArgumentError(f"keep: must satisfy 0 <= keep < max_size ({max_size}), got {keep}")
    if step < 1 or step > MAX_STEP:
        raise InvalidArgumentError(f"step: must be in [1, {MAX_STEP}], got {step}")
    return RotatingCache(max_size=max_size, keep=keep, step=step, inplace=inplace, mode=Mode(mode))


def _new_buffer(cache: RotatingCache, slots: tuple[Entry | None, ...]) -> RotatingCache:
    return replace(cache, slots=slots, ident=cache.next_ident, next_ident=cache.next_ident + 1)


def rotating_inplace_allowed(cache: RotatingCache) -> bool:
    """Warm-up in-place rule for a decode row about to land at ``idx``: the
    window is not yet full (``offset < max_size``, so the slot was never
    valid), the ring is unwrapped (``idx == offset``), the switch is on, the
    mode is Fp16, and the marker says the cache's own last write produced
    these buffers and left the cursor here. In the steady state the write
    overwrites the oldest slot, which a snapshot may still hold: it must copy
    (writing in place there is the project's flagship injected bug).

    post: not __return__ or (cache.offset < cache.max_size and cache.idx == cache.offset)
    post: not __return__ or (cache.marker is not None and cache.marker.buffer == cache.ident)
    """
    return (
        cache.inplace
        and cache.mode is Mode.FP16
        and cache.offset < cache.max_size
        and cache.idx == cache.offset
        and cache.marker is not None
        and cache.ident is not None
        and cache.marker.buffer == cache.ident
        and cache.marker.idx == cache.idx
    )


@dataclass(frozen=True)
class RingAppendResult:
    window: tuple[int, ...]
    positions: tuple[int, ...]
    inplace: bool


def decode(cache: RotatingCache, token: int) -> tuple[RingAppendResult, RotatingCache]:
    """Single-row append (semantics.md 3, steps 1 to 5)."""
    W, K = cache.max_size, cache.keep
    if cache.capacity > W:
        # 1. cut an oversized buffer back to its sinks and latest W - K rows
        cache = replace(_new_buffer(cache, cache.slots[:K] + cache.slots[cache.capacity - (W - K):]), idx=W)
    if cache.idx >= cache.capacity and cache.capacity < W:
        # 2. grow by at most step, never past W
        grow = min(cache.step, W - cache.capacity)
        cache = _new_buffer(cache, cache.slots + (None,) * grow)
    if cache.idx >= W:
        cache = replace(cache, idx=K)  # 3. wrap
    inplace = rotating_inplace_allowed(cache)
    entry = Entry(cache.offset, token)
    slots = cache.slots[: cache.idx] + (entry,) + cache.slots[cache.idx + 1 :]
    cache = replace(cache, slots=slots) if inplace else _new_buffer(cache, slots)
    cache = replace(cache, offset=cache.offset + 1, idx=cache.idx + 1)
    assert cache.ident is not None
    cache = replace(cache, marker=RingMarker(cache.ident, cache.idx))
    return RingAppendResult(cache.window(), cache.positions(), inplace), cache


def prefill(cache: RotatingCache, tokens: tuple[int, ...]) -> tuple[RingAppendResult, RotatingCache]:
    """Multi-row append: put the valid rows in chronological order, keep the
    sinks and the latest others so that at most ``max_size - 1`` old rows
    remain, append every new row, store contiguously and return the whole
    concatenation (it may exceed ``max_size``: clamping it starves the
    earliest queries, a known bug)."""
    order = chronological_order(cache.capacity, cache.idx, cache.keep, cache.wrapped)
    old = tuple(cache.slots[i] for i in order)
    budget = cache.max_size - 1
    if len(old) > budget:
        sinks = min(cache.keep, len(old))
        old = old[:sinks] + old[len(old) - (budget - sinks):] if budget > sinks else old[:budget]
    new = tuple(Entry(cache.offset + i, t) for i, t in enumerate(tokens))
    cache = _new_buffer(cache, old + new)
    cache = replace(cache, offset=cache.offset + len(tokens), idx=len(old) + len(new))
    assert cache.ident is not None
    cache = replace(cache, marker=RingMarker(cache.ident, cache.idx))
    return RingAppendResult(cache.window(), cache.positions(), False), cache


def append(cache: RotatingCache, tokens: tuple[int, ...]) -> tuple[RingAppendResult, RotatingCache]:
    """``update_and_fetch``: :func:`decode` for one row, :func:`prefill` for
    more. Raises InvalidArgumentError when no rows are given."""
    if len(tokens) < 1:
        raise InvalidArgumentError(f"append: n must be >= 1, got {len(tokens)}")
    if len(tokens) == 1:
        return decode(cache, tokens[0])
    return prefill(cache, tokens)


def is_trimmable(cache: RotatingCache) -> bool:
    """Trim is exact only while the ring is unwrapped and not oversized.
    **Decision** (semantics.md 3): otherwise trim fails closed."""
    return cache.idx == cache.offset and cache.offset <= cache.max_size and cache.capacity <= cache.max_size


def trim(cache: RotatingCache, n: int) -> tuple[int, RotatingCache]:
    """Rewind ``n`` rows (clamped to ``[0, offset]``) by moving offset and idx;
    buffers stay. On a wrapped ring trims nothing and returns 0: moving the
    counters there makes idx negative and corrupts the window (a known
    public bug).

    post: __return__[0] == 0 or is_trimmable(cache)
    post: __return__[1].offset == cache.offset - __return__[0]
    post: __return__[1].idx == cache.idx - __return__[0]
    """
    if not is_trimmable(cache):
        return 0, cache
    n = max(0, min(n, cache.offset))
    if n == 0:
        return 0, cache
    cache = replace(cache, offset=cache.offset - n, idx=cache.idx - n)
    if cache.offset == 0:
        cache = replace(cache, slots=(), ident=None, marker=None)
    return n, cache


def trim_to(cache: RotatingCache, length: int) -> tuple[int, RotatingCache]:
    """``trim(offset - length)``. Raises InvalidArgumentError unless ``0 <=
    length <= offset``, StateError when the ring cannot trim exactly and
    ``length < offset``."""
    if length < 0 or length > cache.offset:
        raise InvalidArgumentError(f"trim_to: len must satisfy 0 <= len <= offset ({cache.offset}), got {length}")
    if length < cache.offset and not is_trimmable(cache):
        raise StateError(
            f"trim_to: cannot trim a wrapped sliding-window ring exactly (offset={cache.offset}, "
            f"idx={cache.idx}, max_size={cache.max_size}), got len={length}"
        )
    return trim(cache, cache.offset - length)


@dataclass(frozen=True)
class RingHolder:
    """A snapshot of a ring: the whole cache state at that moment."""

    cache: RotatingCache

    def window(self) -> tuple[int, ...]:
        return self.cache.window()


@dataclass(frozen=True)
class RotatingWorld:
    cache: RotatingCache
    holders: dict[str, RingHolder] = field(default_factory=dict)
    held: tuple[int, ...] | None = None
    returned: tuple[int, ...] | None = None
    next_token: int = 0


def w_append(world: RotatingWorld, n: int) -> tuple[RingAppendResult, RotatingWorld]:
    if n < 1:
        raise InvalidArgumentError(f"append: n must be >= 1, got {n}")
    tokens = tuple(range(world.next_token, world.next_token + n))
    result, cache = append(world.cache, tokens)
    return result, replace(world, cache=cache, returned=result.window, next_token=world.next_token + n)


def w_snapshot(world: RotatingWorld, name: str) -> tuple[None, RotatingWorld]:
    if name in world.holders:
        raise StateError(f"snapshot: name {name!r} is already in use")
    return None, replace(world, holders={**world.holders, name: RingHolder(world.cache)})


def w_restore(world: RotatingWorld, name: str) -> tuple[None, RotatingWorld]:
    """Adopt a snapshot's buffers, offset and cursor, with no marker."""
    snap = world.holders.get(name)
    if snap is None:
        raise StateError(f"restore: no snapshot or handle named {name!r}")
    s = snap.cache
    cache = replace(world.cache, slots=s.slots, offset=s.offset, idx=s.idx, ident=s.ident, marker=None)
    return None, replace(world, cache=cache)


def w_drop(world: RotatingWorld, name: str) -> tuple[None, RotatingWorld]:
    if name not in world.holders:
        raise StateError(f"drop: no snapshot or handle named {name!r}")
    return None, replace(world, holders={k: v for k, v in world.holders.items() if k != name})


def w_hold(world: RotatingWorld) -> tuple[None, RotatingWorld]:
    if world.returned is None:
        raise StateError("hold: no append has returned a window yet")
    return None, replace(world, held=world.returned)


def w_release_hold(world: RotatingWorld) -> tuple[None, RotatingWorld]:
    return None, replace(world, held=None)


def unsupported(op: str) -> UnsupportedOperationError:
    return UnsupportedOperationError(f"{op}: not an operation of the rotating cache")


def apply_op(world: RotatingWorld, op: dict) -> tuple[object, RotatingWorld]:
    """Run one kvtrace op on ``world``: ``(result, new world)``. Raises the
    spec's refusal, or UnsupportedOperationError for an op the ring does not
    have. Module functions are looked up at call time, so a test that
    patches one (a proof's negative control) reaches it here."""
    name = op["op"]
    if name == "append":
        return w_append(world, op["n"])
    if name == "fetch":
        return world.cache.window(), world
    if name == "hold":
        return w_hold(world)
    if name == "release_hold":
        return w_release_hold(world)
    if name == "trim":
        result, cache = trim(world.cache, op["n"])
        return result, replace(world, cache=cache)
    if name == "trim_to":
        result, cache = trim_to(world.cache, op["len"])
        return result, replace(world, cache=cache)
    if name == "snapshot":
        return w_snapshot(world, op["name"])
    if name == "restore":
        return w_restore(world, op["name"])
    if name == "drop":
        return w_drop(world, op["name"])
    raise unsupported(name)


def make_mask_spec(cache: RotatingCache, n: int, window_size: int | None = None) -> tuple[tuple[bool, ...], ...]:
    """The mask ``make_mask(n, window_size)`` must equal for the ``n`` queries
    about to be appended: row ``i`` (query position ``offset + i``), column
    ``j`` (the j-th key of the window the append will return, in its order).
    ``window_size`` defaults to ``max_size``."""
    window = cache.max_size if window_size is None else window_size
    result, _ = append(cache, tuple(range(-n, 0)))
    return tuple(
        tuple(mask_visible(cache.offset + i, p, window, cache.keep) for p in result.positions)
        for i in range(n)
    )
