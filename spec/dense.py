"""Executable spec of the dense KV cache (semantics.md section 2).

Two levels live side by side in one frozen state:

* the **abstract** level: the live rows as ``Entry(position, token)`` values,
  ``offset`` and ``live_start``; ``live_len`` is always derived from them;
* the **physical** level, only as far as the cost contract and the ownership
  rule need it: the identity and capacity of the cache's buffers
  (``Buffer``) and the ownership ``Marker``.

Every operation is a pure function ``op(state, ...) -> (result, new_state)``
or raises one of :mod:`kvspec.spec.errors` and returns nothing (so a refusal cannot
change anything). Holders (snapshots, detached handles, the held in-flight
window) live in :class:`DenseWorld`, whose operations wrap the cache's.

Rows are token identities, not numbers: the spec says *which* rows a reader
sees; the harness turns identities into bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from itertools import pairwise

from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError


class Mode(str, Enum):
    """Storage modes of the dense cache (semantics.md section 2)."""

    FP16 = "fp16"
    INT8 = "int8"
    TURBO4ASYM = "turbo4asym"
    TURBO4 = "turbo4"
    TURBO3ASYM = "turbo3asym"
    TURBO4DELEGATED = "turbo4delegated"


#: Largest growth granularity a cache accepts (rows). Growth allocates
#: ``ceil(n / step) * step`` rows at once, so an unbounded step is an
#: allocation of any size; 2^20 rows is far beyond the 256 engines use.
MAX_STEP = 2**20


def trim_is_logical(mode: Mode) -> bool:
    """Trim rule: Fp16 and Int8 rewind logically (O(1), capacity kept);
    the Turbo modes cut every buffer to the live rows (their packed sidecars
    are read whole). Source: semantics.md 2 "trim(n)" (speculative
    decoding relies on the O(1) rewind)."""
    return mode in (Mode.FP16, Mode.INT8)


def supports_front_trim(mode: Mode) -> bool:
    """``trim_front_keep_sink`` moves rows only in Fp16 and Int8; other modes
    return 0 and change nothing (semantics.md 2)."""
    return mode in (Mode.FP16, Mode.INT8)


def supports_gather(mode: Mode) -> bool:
    """Gathers are refused in Turbo4Delegated (hot/cold split bookkeeping)."""
    return mode is not Mode.TURBO4DELEGATED


def inplace_switch(env_value: str | None) -> bool:
    """The ``KV_INPLACE_WRITE`` switch: on unless the variable is one of
    ``0``, ``false``, ``off``, ``no`` (any case, surrounding blanks ignored).

    post: env_value is not None or __return__
    post: not (__return__ and env_value is not None and env_value.strip().lower() == "off")
    """
    if env_value is None:
        return True
    return env_value.strip().lower() not in ("0", "false", "off", "no")


def check_window_size(op: str, window_size: object) -> int | None:
    """A mask's ``window_size``: None (no window) or an integer >= 1 (a
    window of 0 keys would hide even the query itself). Raises
    InvalidArgumentError naming the value otherwise (0, negative, a float,
    a bool). Shared by every cache's ``make_mask``."""
    if window_size is None:
        return None
    if isinstance(window_size, bool) or not isinstance(window_size, int):
        raise InvalidArgumentError(
            f"{op}: window_size must be None or an integer >= 1, got {window_size!r}"
        )
    if window_size < 1:
        raise InvalidArgumentError(f"{op}: window_size must be >= 1, got {window_size}")
    return window_size


def dense_mask_visible(query: int, key: int, window_size: int | None) -> bool:
    """Mask rule of the dense cache (mlx-lm's causal mask): the query at
    absolute position ``query`` sees the key at ``key`` iff ``key <= query``
    and, with a window, ``query - key < window_size`` (so each query sees
    ``min(query + 1, window_size)`` keys). A dense cache serving a windowed
    layer that ignores the window is a known bug class.

    pre: query >= 0 and key >= 0
    pre: window_size is None or window_size >= 1
    post: not __return__ or key <= query
    post: not __return__ or window_size is None or query - key < window_size
    """
    return key <= query and (window_size is None or query - key < window_size)


def dense_make_mask(live_len: int, n: int, window_size: int | None) -> tuple[tuple[bool, ...], ...]:
    """The mask ``make_mask(n, window_size)`` of a dense cache holding
    ``live_len`` rows must denote: row ``i`` (query ``live_len + i``),
    column ``j`` (key ``j`` of the ``live_len + n`` rows the append will
    return)."""
    return tuple(
        tuple(dense_mask_visible(live_len + i, j, window_size) for j in range(live_len + n))
        for i in range(n)
    )


def regrow_needed(has_buffer: bool, prev: int, capacity: int, n: int) -> bool:
    """Regrow rule, guard: grow iff there is no buffer or ``prev + n`` rows
    do not fit (semantics.md 2, step 2).

    pre: prev >= 0 and n >= 1
    post: __return__ or prev + n <= capacity
    post: has_buffer or __return__
    """
    return (not has_buffer) or prev + n > capacity


def regrow_capacity(prev: int, n: int, step: int) -> int:
    """Regrow rule, result: cut the buffer to the live prefix, then append
    ``ceil(n / step) * step`` zero rows. Not necessarily a multiple of step.
    The older guard (cut only when ``prev % step != 0``) keeps a stale tail
    after a logical trim: a known regression (public fix #1209).

    pre: prev >= 0
    pre: n >= 1
    pre: step >= 1
    post: prev + n <= __return__ < prev + n + step
    post: (__return__ - prev) % step == 0
    """
    return prev + -(-n // step) * step


@dataclass(frozen=True)
class Entry:
    """One live row: the absolute (RoPE) position it was written at and its
    token identity. Positions never change after the write."""

    position: int
    token: int


@dataclass(frozen=True)
class Buffer:
    """Abstract identity of the cache's K/V buffers (sidecars included) and
    their physical length along the sequence axis."""

    ident: int
    capacity: int


@dataclass(frozen=True)
class Marker:
    """Ownership marker: the buffers the cache's own last write produced and
    the live length right after that write (semantics.md 2)."""

    buffer: int
    live_len: int


@dataclass(frozen=True)
class DenseCache:
    """State of one dense cache. ``next_ident`` hands out buffer identities and
    never goes back, so identities are unique for the cache's lifetime."""

    mode: Mode = Mode.FP16
    step: int = 256
    inplace: bool = True
    entries: tuple[Entry, ...] = ()
    offset: int = 0
    live_start: int = 0
    buffer: Buffer | None = None
    marker: Marker | None = None
    next_ident: int = 0

    @property
    def live_len(self) -> int:
        """Number of valid rows, ``offset - live_start`` (the buffer index)."""
        return self.offset - self.live_start

    @property
    def capacity(self) -> int:
        """Physical length of the buffers, 0 when there are none."""
        return 0 if self.buffer is None else self.buffer.capacity

    def window(self) -> tuple[int, ...]:
        """Token identities a fetch returns, in order."""
        return tuple(e.token for e in self.entries)


def new_cache(mode: Mode | str = Mode.FP16, step: int = 256, inplace: bool = True) -> DenseCache:
    """An empty cache. Raises InvalidArgumentError unless ``1 <= step <=
    MAX_STEP``.

    pre: isinstance(mode, Mode) and 1 <= step <= MAX_STEP
    post: is_empty(__return__) and __return__.marker is None
    """
    if not isinstance(step, int) or step < 1 or step > MAX_STEP:
        raise InvalidArgumentError(f"step: must be an integer in [1, {MAX_STEP}], got {step!r}")
    return DenseCache(mode=Mode(mode), step=step, inplace=inplace)


def _with_new_buffer(cache: DenseCache, capacity: int) -> DenseCache:
    """The cache holding freshly produced private buffers of ``capacity`` rows."""
    return replace(cache, buffer=Buffer(cache.next_ident, capacity), next_ident=cache.next_ident + 1)


def inplace_write_allowed(cache: DenseCache, n: int) -> bool:
    """Ownership rule: may an append of ``n`` rows at ``cache.live_len`` go
    straight into the current buffers, which others may share?

    Only when the switch is on, it is a decode step (n == 1), the mode is
    Fp16, and the marker says the cache's own last write produced these very
    buffers and ended exactly here. Unchanged identity means nobody replaced
    the buffers (restore, install, growth, gather, physical trim); landing at
    the recorded length means no trim or rollback happened since. Every holder
    was made at an earlier moment and sees only rows below its live_len then,
    which is at most ``marker.live_len``; so the row written was never valid
    for any holder (semantics.md 2, "ownership rule").

    post: not __return__ or (n == 1 and cache.marker is not None and cache.live_len == cache.marker.live_len)
    post: not __return__ or (cache.buffer is not None and cache.marker.buffer == cache.buffer.ident)
    """
    return (
        cache.inplace
        and n == 1
        and cache.mode is Mode.FP16
        and cache.marker is not None
        and cache.buffer is not None
        and cache.marker.buffer == cache.buffer.ident
        and cache.live_len == cache.marker.live_len
    )


@dataclass(frozen=True)
class AppendResult:
    """What ``update_and_fetch`` of n rows returns and how it wrote."""

    window: tuple[int, ...]
    inplace: bool
    regrew: bool


def append(cache: DenseCache, tokens: tuple[int, ...]) -> tuple[AppendResult, DenseCache]:
    """``update_and_fetch`` of ``len(tokens)`` new rows (semantics.md 2).

    Regrows under :func:`regrow_needed` / :func:`regrow_capacity`, writes the
    rows at ``[prev, prev + n)`` (in place iff :func:`inplace_write_allowed`,
    else by a copying write that yields new private buffers), records the
    marker and returns the window ``[0, live_len)``.
    Raises InvalidArgumentError when no rows are given.

    pre: len(tokens) >= 1 and cache.step >= 1
    pre: 0 <= cache.live_start <= cache.offset and len(cache.entries) == cache.live_len
    pre: cache.buffer is None or cache.live_len <= cache.buffer.capacity
    post: __return__[1].live_len <= __return__[1].capacity
    post: __return__[1].offset == cache.offset + len(tokens)
    post: __return__[1].entries[: len(cache.entries)] == cache.entries
    post: __return__[0].window == __return__[1].window()
    """
    n = len(tokens)
    if n < 1:
        raise InvalidArgumentError(f"append: n must be >= 1, got {n}")
    prev = cache.live_len
    regrew = regrow_needed(cache.buffer is not None, prev, cache.capacity, n)
    if regrew:
        cache = _with_new_buffer(cache, regrow_capacity(prev, n, cache.step))
    inplace = inplace_write_allowed(cache, n)
    if not inplace:
        cache = _with_new_buffer(cache, cache.capacity)
    assert cache.buffer is not None
    new_entries = tuple(Entry(cache.offset + i, t) for i, t in enumerate(tokens))
    cache = replace(
        cache,
        entries=cache.entries + new_entries,
        offset=cache.offset + n,
        marker=Marker(cache.buffer.ident, prev + n),
    )
    return AppendResult(cache.window(), inplace, regrew), cache


def _dropped_if_empty(cache: DenseCache) -> DenseCache:
    """When live_len reaches 0 every buffer and sidecar is dropped."""
    if cache.live_len == 0:
        return replace(cache, buffer=None, marker=None)
    return cache


def _compacted(cache: DenseCache) -> DenseCache:
    """Fresh private buffers of exactly the live rows (a physical cut), or
    none at all when live_len is 0."""
    return _dropped_if_empty(cache) if cache.live_len == 0 else _with_new_buffer(cache, cache.live_len)


def trim(cache: DenseCache, n: int) -> tuple[int, DenseCache]:
    """Trim ``n`` rows from the end; returns how many were removed.

    ``n`` is clamped to ``[0, live_len]`` (a negative n trims nothing: growing
    the offset is a known mlx-lm fault). Fp16/Int8 rewind logically: buffers
    and capacity stay, O(1). Turbo modes cut every buffer to the live rows.

    pre: 0 <= cache.live_start <= cache.offset and len(cache.entries) == cache.live_len
    post: __return__[0] == max(0, min(n, cache.live_len))
    post: __return__[1].offset == cache.offset - __return__[0]
    post: __return__[1].live_start == cache.live_start
    post: __return__[1].entries == cache.entries[: cache.live_len - __return__[0]]
    """
    n = max(0, min(n, cache.live_len))
    if n == 0:
        return 0, cache
    cache = replace(cache, entries=cache.entries[: cache.live_len - n], offset=cache.offset - n)
    return n, _dropped_if_empty(cache) if trim_is_logical(cache.mode) else _compacted(cache)


def trim_to(cache: DenseCache, length: int) -> tuple[int, DenseCache]:
    """``trim(offset - length)``. Raises InvalidArgumentError unless
    ``0 <= length <= offset``.

    pre: 0 <= length <= cache.offset
    pre: 0 <= cache.live_start <= cache.offset and len(cache.entries) == cache.live_len
    post: __return__[1].offset == max(length, cache.live_start)
    """
    if length < 0 or length > cache.offset:
        raise InvalidArgumentError(
            f"trim_to: len must satisfy 0 <= len <= offset ({cache.offset}), got {length}"
        )
    return trim(cache, cache.offset - length)


def trim_front_keep_sink(cache: DenseCache, n: int, keep: int = 0) -> tuple[int, DenseCache]:
    """Evict ``n`` rows after the first ``keep`` sink rows (sliding-window
    eviction with attention sinks). Returns the number evicted.

    ``n = clamp(n, 0, live_len)``, ``keep = clamp(keep, 0, live_len - n)``;
    rows become ``rows[:keep] ++ rows[keep + n:]``; ``live_start += n``; the
    offset never decreases (each key keeps the RoPE of its write). The result
    is compacted into new buffers of exactly the live rows. Modes other than
    Fp16/Int8 return 0 and change nothing.

    pre: 0 <= cache.live_start <= cache.offset and len(cache.entries) == cache.live_len
    post: __return__[1].offset == cache.offset
    post: len(__return__[1].entries) == __return__[1].live_len == cache.live_len - __return__[0]
    post: __return__[1].entries[: max(0, min(keep, __return__[1].live_len))] == cache.entries[: max(0, min(keep, __return__[1].live_len))]
    """
    if not supports_front_trim(cache.mode):
        return 0, cache
    n = max(0, min(n, cache.live_len))
    if n == 0:
        return 0, cache
    keep = max(0, min(keep, cache.live_len - n))
    entries = cache.entries[:keep] + cache.entries[keep + n :]
    return n, _compacted(replace(cache, entries=entries, live_start=cache.live_start + n))


def check_strictly_increasing(op: str, name: str, values: tuple[int, ...], lo: int, hi: int) -> None:
    """Refuse an index list unless it is non-empty, strictly increasing and
    inside ``[lo, hi)``. Raises InvalidArgumentError naming ``op`` and ``name``."""
    shown = list(values)
    if not values:
        raise InvalidArgumentError(f"{op}: {name} must be non-empty, got []")
    for a, b in pairwise(values):
        if b <= a:
            raise InvalidArgumentError(f"{op}: {name} must be strictly increasing, got {shown}")
    if values[0] < lo or values[-1] >= hi:
        raise InvalidArgumentError(f"{op}: {name} must lie in [{lo}, {hi}), got {shown}")


def gather_positions(cache: DenseCache, positions: tuple[int, ...]) -> tuple[int, DenseCache]:
    """Keep exactly the listed rows (indices into the live window), in order;
    ``offset = len(positions)``. Returns the new live_len. The identity list
    is a no-op. The result is compacted into new buffers of exactly the kept
    rows.

    Raises UnsupportedOperationError in Turbo4Delegated, StateError when
    ``live_start != 0``, InvalidArgumentError when the list is empty, not
    strictly increasing, or outside ``[0, live_len)``.

    pre: supports_gather(cache.mode) and cache.live_start == 0 and len(positions) >= 1
    pre: all(0 <= p < cache.live_len for p in positions)
    pre: all(a < b for a, b in zip(positions, positions[1:]))
    pre: 0 <= cache.offset and len(cache.entries) == cache.live_len
    post: __return__[0] == __return__[1].live_len == len(positions)
    post: __return__[1].window() == tuple(cache.entries[p].token for p in positions)
    """
    if not supports_gather(cache.mode):
        raise UnsupportedOperationError(f"gather_positions: not supported in mode {cache.mode.value}")
    if cache.live_start != 0:
        raise StateError(
            f"gather_positions: requires live_start == 0 (no front trim), got live_start={cache.live_start}"
        )
    positions = tuple(positions)
    check_strictly_increasing("gather_positions", "positions", positions, 0, cache.live_len)
    if positions == tuple(range(cache.live_len)):
        return cache.live_len, cache
    entries = tuple(cache.entries[p] for p in positions)
    cache = replace(cache, entries=entries, offset=len(positions))
    return len(positions), _with_new_buffer(cache, len(positions))


def gather_within_tail(cache: DenseCache, tail_len: int, kept: tuple[int, ...]) -> tuple[int, DenseCache]:
    """Tree-speculation rollback: of the last ``tail_len`` rows keep those at
    ``kept`` (indices into the tail), written back at the tail's start.
    ``offset -= tail_len - len(kept)``; returns the new live_len. O(tail): the
    kept rows are written by a copying write into buffers of the same
    capacity (logical-trim modes) or cut to the live rows (Turbo modes).

    Raises UnsupportedOperationError in Turbo4Delegated, InvalidArgumentError
    unless ``0 < tail_len <= live_len`` and ``kept`` is non-empty, strictly
    increasing and inside ``[0, tail_len)``.

    pre: supports_gather(cache.mode) and 0 < tail_len <= cache.live_len and len(kept) >= 1
    pre: all(0 <= k < tail_len for k in kept) and all(a < b for a, b in zip(kept, kept[1:]))
    pre: 0 <= cache.live_start <= cache.offset and len(cache.entries) == cache.live_len
    post: __return__[0] == __return__[1].live_len == cache.live_len - tail_len + len(kept)
    post: __return__[1].entries[: cache.live_len - tail_len] == cache.entries[: cache.live_len - tail_len]
    """
    if not supports_gather(cache.mode):
        raise UnsupportedOperationError(f"gather_within_tail: not supported in mode {cache.mode.value}")
    if tail_len <= 0 or tail_len > cache.live_len:
        raise InvalidArgumentError(
            f"gather_within_tail: tail_len must satisfy 0 < tail_len <= live_len ({cache.live_len}), got {tail_len}"
        )
    kept = tuple(kept)
    check_strictly_increasing("gather_within_tail", "kept", kept, 0, tail_len)
    start = cache.live_len - tail_len
    tail = cache.entries[start:]
    entries = cache.entries[:start] + tuple(tail[k] for k in kept)
    cache = replace(cache, entries=entries, offset=cache.offset - (tail_len - len(kept)))
    capacity = cache.capacity if trim_is_logical(cache.mode) else cache.live_len
    return cache.live_len, _with_new_buffer(cache, capacity)


# ---------------------------------------------------------------------------
# Holders: snapshots, detached handles and the held in-flight window.


@dataclass(frozen=True)
class Holder:
    """Anything besides the cache that keeps a reference to its buffers.
    Its view (``entries``) is fixed for as long as it lives (isolation)."""

    kind: str  # "snapshot", "state snapshot", "handle" or "held"
    entries: tuple[Entry, ...]
    offset: int
    live_start: int
    buffer: Buffer | None

    @property
    def live_len(self) -> int:
        return self.offset - self.live_start

    def window(self) -> tuple[int, ...]:
        return tuple(e.token for e in self.entries)


def holder_of(cache: DenseCache, kind: str) -> Holder:
    """A holder sharing the cache's buffers (an O(1) lazy copy)."""
    return Holder(kind, cache.entries, cache.offset, cache.live_start, cache.buffer)


def adopt(cache: DenseCache, holder: Holder) -> DenseCache:
    """The cache adopting a holder's buffers and window, with no marker: the
    buffers are shared, so the next write must copy (semantics.md 2).

    post: __return__.marker is None and __return__.buffer == holder.buffer
    """
    return replace(
        cache,
        entries=holder.entries,
        offset=holder.offset,
        live_start=holder.live_start,
        buffer=holder.buffer,
        marker=None,
    )


def is_empty(cache: DenseCache) -> bool:
    """A cache that has never held a row or was reset: offset 0."""
    return cache.offset == 0 and cache.live_start == 0 and cache.buffer is None


def handle_trim_to(handle: Holder, length: int) -> tuple[int, Holder]:
    """A detached handle's ``trim_to``: cut its tensors physically to
    ``length - live_start`` live rows. Returns the rows removed.
    Raises InvalidArgumentError unless ``0 <= length <= offset``.

    pre: 0 <= length <= handle.offset
    pre: 0 <= handle.live_start <= handle.offset and len(handle.entries) == handle.live_len
    post: __return__[0] >= 0 and __return__[1].live_len == handle.live_len - __return__[0]
    post: len(__return__[1].entries) == __return__[1].live_len
    """
    if length < 0 or length > handle.offset:
        raise InvalidArgumentError(
            f"handle_trim_to: len must satisfy 0 <= len <= offset ({handle.offset}), got {length}"
        )
    n = min(handle.offset - length, handle.live_len)
    if n == 0:
        return 0, handle
    live = handle.live_len - n
    # The cut is a view of the same memory: same identity, shorter length.
    buffer = None if live == 0 or handle.buffer is None else Buffer(handle.buffer.ident, live)
    return n, replace(handle, entries=handle.entries[:live], offset=handle.offset - n, buffer=buffer)


@dataclass(frozen=True)
class DenseWorld:
    """The cache plus everything that may share its buffers.

    ``holders`` maps snapshot and handle names to holders (treated as
    immutable: every operation builds a new dict). ``returned`` is the window
    the last append returned (what ``hold`` keeps alive). ``next_token`` is the
    trace's token counter: identities are never reused.
    """

    cache: DenseCache
    holders: dict[str, Holder] = field(default_factory=dict)
    held: Holder | None = None
    returned: Holder | None = None
    next_token: int = 0
    #: names of handles ``install`` consumed: installing one again is
    #: refused (the handle is spent), not "no such name"
    consumed: frozenset[str] = frozenset()


def new_world(mode: Mode | str = Mode.FP16, step: int = 256, inplace: bool = True) -> DenseWorld:
    return DenseWorld(new_cache(mode, step, inplace))


def _require(world: DenseWorld, op: str, name: str, kind: str | None = None) -> Holder:
    holder = world.holders.get(name)
    if holder is None:
        raise StateError(f"{op}: no snapshot or handle named {name!r}")
    if kind is not None and holder.kind != kind:
        raise StateError(f"{op}: {name!r} is a {holder.kind}, not a {kind}")
    return holder


def _fresh_name(world: DenseWorld, op: str, name: str) -> None:
    if name in world.holders:
        raise StateError(f"{op}: name {name!r} is already in use")


def w_append(world: DenseWorld, n: int) -> tuple[AppendResult, DenseWorld]:
    """Append ``n`` rows with the next ``n`` token identities."""
    if n < 1:
        raise InvalidArgumentError(f"append: n must be >= 1, got {n}")
    tokens = tuple(range(world.next_token, world.next_token + n))
    result, cache = append(world.cache, tokens)
    returned = holder_of(cache, "held")
    return result, replace(world, cache=cache, returned=returned, next_token=world.next_token + n)


def w_hold(world: DenseWorld) -> tuple[None, DenseWorld]:
    """Keep the window the last append returned alive (a pipelined step)."""
    if world.returned is None:
        raise StateError("hold: no append has returned a window yet")
    return None, replace(world, held=world.returned)


def w_release_hold(world: DenseWorld) -> tuple[None, DenseWorld]:
    return None, replace(world, held=None)


def w_snapshot(world: DenseWorld, name: str) -> tuple[None, DenseWorld]:
    """Prompt-cache snapshot: new handles to the same buffers, O(1)."""
    _fresh_name(world, "snapshot", name)
    return None, replace(world, holders={**world.holders, name: holder_of(world.cache, "snapshot")})


def w_copy(world: DenseWorld, name: str, live: str) -> tuple[None, DenseWorld]:
    """``copy.copy`` or ``copy.deepcopy`` of the cache (mlx-lm's prompt-cache
    helpers; ``LRUPromptCache`` deep-copies on every fetch), held under
    ``name``. The snapshot rule: the copy shares the buffers (O(1); a deep
    copy of an array is a new handle to its memory) and the window, and
    owns nothing, so it carries no ownership marker. ``live`` says which of
    the two the trace goes on writing: ``"original"`` (the copy is held, a
    snapshot; the cache keeps its marker) or ``"copy"`` (the original is
    held; the live cache is the copy: no marker, its first write copies).
    Raises StateError for a name in use; then nothing changes."""
    if live not in ("copy", "original"):
        raise InvalidArgumentError(f"copy: live must be 'copy' or 'original', got {live!r}")
    _fresh_name(world, "copy", name)
    holders = {**world.holders, name: holder_of(world.cache, "snapshot")}
    cache = replace(world.cache, marker=None) if live == "copy" else world.cache
    return None, replace(world, cache=cache, holders=holders)


#: What an append's rows may differ in from the rows a cache holds
#: (kvtrace ``append_mismatch``'s ``differs``).
#: ``k_dtype`` / ``v_dtype``: only the keys' (values') dtype differs, the other
#: array's is the cached one (a check of one array's dtype passes them)
ROW_FIELDS = ("batch", "kv_heads", "k_head_dim", "v_head_dim", "dtype", "k_dtype", "v_dtype")


def w_append_mismatch(world: DenseWorld, n: int, differs: str) -> tuple[None, DenseWorld]:
    """An append of ``n`` rows whose ``differs`` (batch, kv heads, K or V
    head dim, dtype) is not that of the rows the cache holds: refused with
    InvalidArgumentError while the cache holds a buffer (a cast or a
    broadcast would change the rows silently, semantics.md 2 "Storage
    dtype"), and nothing changes. (A cache without a buffer takes any
    shape; a trace gives this op only on a cache holding one.)"""
    if differs not in ROW_FIELDS:
        raise InvalidArgumentError(f"append_mismatch: differs must be one of {', '.join(ROW_FIELDS)}, got {differs!r}")
    if n < 1:
        raise InvalidArgumentError(f"append: n must be >= 1, got {n}")
    raise InvalidArgumentError(f"append: {differs} must be the cached rows' (a cache holding rows keeps their shape and dtype)")


#: What the values of an append's K/V pair may differ in from its keys
#: (kvtrace ``append_pair_mismatch``'s ``differs``): the dtype, the batch,
#: the kv heads, or the rows S (the head dims may differ by design).
PAIR_FIELDS = ("dtype", "batch", "kv_heads", "rows")


def w_append_pair_mismatch(world: DenseWorld, n: int, differs: str) -> tuple[None, DenseWorld]:
    """An append of ``n`` rows whose keys are as the cache holds them (or,
    on an empty cache, as the trace's configuration says) and whose values
    disagree with the keys in ``differs`` (:data:`PAIR_FIELDS`: another
    dtype, one more batch row, kv head or row): refused with
    InvalidArgumentError on any cache, empty or not (a pair must agree with
    itself before it is compared with the cache: semantics.md 2 "Storage
    dtype"), and nothing changes."""
    if differs not in PAIR_FIELDS:
        raise InvalidArgumentError(
            f"append_pair_mismatch: differs must be one of {', '.join(PAIR_FIELDS)}, got {differs!r}")
    if n < 1:
        raise InvalidArgumentError(f"append: n must be >= 1, got {n}")
    raise InvalidArgumentError(f"append: keys and values must agree on {differs} (a K/V pair agrees with itself)")


def holds_buffer(world: DenseWorld) -> bool:
    """Whether the cache holds a buffer (then an append's rows must match it)."""
    return world.cache.buffer is not None


def w_reload(world: DenseWorld, via: str) -> tuple[None, DenseWorld]:
    """The cache saved and loaded back: ``via="file"`` through a prompt-cache
    file (``kvspec.impl.models.save_prompt_cache`` / ``load_prompt_cache``; the
    loaded cache replaces the live one), ``via="state"`` in mlx-lm's load
    order (``cache.state = saved``, then ``cache.meta_state = saved``).
    Either way the cache goes on with the same window, offset, live_start,
    mode, step and in-place switch, in fresh private buffers of exactly its
    live rows and with no ownership marker: a load acts as a restore from a
    copy (semantics.md 2), so its first write copies; holders keep theirs."""
    if via not in ("file", "state"):
        raise InvalidArgumentError(f"reload: via must be 'file' or 'state', got {via!r}")
    return None, replace(world, cache=replace(_compacted(world.cache), marker=None))


def w_restore(world: DenseWorld, name: str) -> tuple[None, DenseWorld]:
    """The live cache adopts the snapshot's buffers and window; no marker."""
    snap = _require(world, "restore", name, "snapshot")
    return None, replace(world, cache=adopt(world.cache, snap))


def w_state_snapshot(world: DenseWorld, name: str) -> tuple[None, DenseWorld]:
    """A snapshot taken through mlx-lm's protocol (``saved = c.state``, with
    ``c.meta_state`` where the class has one): the snapshot rule holds as
    for ``snapshot``, its rows never change (semantics.md 8, "The state
    protocol"); only ``state_restore`` takes it back."""
    _fresh_name(world, "state_snapshot", name)
    return None, replace(world, holders={**world.holders, name: state_of(world.cache)})


def state_of(cache: DenseCache) -> Holder:
    """What ``c.state`` hands out: the live rows only, never the buffer
    objects themselves (views of the same memory, so the same buffer
    identity, cut to ``live_len``): a cache loaded from it has capacity
    ``live_len``. ``None`` buffer for an empty cache (``state == ()``).

    post: __return__.buffer is None or __return__.buffer.capacity == cache.live_len
    """
    buf = None if cache.buffer is None or cache.live_len == 0 else Buffer(cache.buffer.ident, cache.live_len)
    return Holder("state snapshot", cache.entries, cache.offset, cache.live_start, buf)


def w_state_restore(world: DenseWorld, name: str) -> tuple[None, DenseWorld]:
    """``c.state = saved``: the live cache adopts the saved rows and window
    with no marker, exactly as ``restore`` (the adopted arrays are shared,
    so the next write must copy: a later write never reaches the saved
    rows)."""
    saved = _require(world, "state_restore", name, "state snapshot")
    return None, replace(world, cache=adopt(world.cache, saved))


def w_drop(world: DenseWorld, name: str) -> tuple[None, DenseWorld]:
    _require(world, "drop", name)
    holders = {k: v for k, v in world.holders.items() if k != name}
    return None, replace(world, holders=holders)


def w_detach(world: DenseWorld, name: str) -> tuple[None, DenseWorld]:
    """Move every tensor into a detached handle; the cache becomes empty."""
    _fresh_name(world, "detach", name)
    c = world.cache
    empty = DenseCache(mode=c.mode, step=c.step, inplace=c.inplace, next_ident=c.next_ident)
    holders = {**world.holders, name: holder_of(c, "handle")}
    return None, replace(world, cache=empty, holders=holders)


def w_install(world: DenseWorld, name: str) -> tuple[None, DenseWorld]:
    """Install a detached handle into the empty cache; the handle is
    consumed: installing it again is refused (StateError), whatever the
    cache holds then, and changes nothing."""
    if name in world.consumed and name not in world.holders:
        raise StateError("install: the handle was already installed")
    handle = _require(world, "install", name, "handle")
    if not is_empty(world.cache):
        raise StateError(
            f"install: requires an empty cache, got offset={world.cache.offset}, live_len={world.cache.live_len}"
        )
    holders = {k: v for k, v in world.holders.items() if k != name}
    return None, replace(world, cache=adopt(world.cache, handle), holders=holders,
                         consumed=world.consumed | {name})


def w_handle_trim_to(world: DenseWorld, name: str, length: int) -> tuple[int, DenseWorld]:
    handle = _require(world, "handle_trim_to", name, "handle")
    n, handle = handle_trim_to(handle, length)
    return n, replace(world, holders={**world.holders, name: handle})


def w_cache_op(world: DenseWorld, fn, *args):
    """Lift a cache operation ``fn(cache, *args) -> (result, cache)``."""
    result, cache = fn(world.cache, *args)
    return result, replace(world, cache=cache)


def apply_op(world: DenseWorld, op: dict) -> tuple[object, DenseWorld]:
    """Run one kvtrace op (``docs/kvtrace.md``; ``expect`` is
    not an op of the cache) on ``world``: ``(result, new world)``. Raises
    the spec's refusal, or InvalidArgumentError for an op the dense cache
    does not have. Module functions are looked up at call time, so a test
    that patches one (a proof's negative control) reaches it here."""
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
        return w_cache_op(world, trim, op["n"])
    if name == "trim_to":
        return w_cache_op(world, trim_to, op["len"])
    if name == "trim_front":
        return w_cache_op(world, trim_front_keep_sink, op["n"], op.get("keep", 0))
    if name == "gather_positions":
        return w_cache_op(world, gather_positions, tuple(op["positions"]))
    if name == "gather_within_tail":
        return w_cache_op(world, gather_within_tail, op["tail"], tuple(op["kept"]))
    if name == "snapshot":
        return w_snapshot(world, op["name"])
    if name == "restore":
        return w_restore(world, op["name"])
    if name == "drop":
        return w_drop(world, op["name"])
    if name == "state_snapshot":
        return w_state_snapshot(world, op["name"])
    if name == "state_restore":
        return w_state_restore(world, op["name"])
    if name == "copy":
        return w_copy(world, op["name"], op.get("live", "original"))
    if name == "append_mismatch":
        return w_append_mismatch(world, op["n"], op["differs"])
    if name == "append_pair_mismatch":
        return w_append_pair_mismatch(world, op["n"], op["differs"])
    if name == "reload":
        return w_reload(world, op.get("via", "file"))
    if name == "detach":
        return w_detach(world, op["name"])
    if name == "install":
        return w_install(world, op["name"])
    if name == "handle_trim_to":
        return w_handle_trim_to(world, op["name"], op["len"])
    raise InvalidArgumentError(f"{name}: not an operation of a dense cache")


def view_of(world: DenseWorld, name: str | None) -> tuple[int, ...]:
    """The window of the live cache (``name is None``) or of a named holder."""
    if name is None:
        return world.cache.window()
    return _require(world, "expect", name).window()
