"""Executable spec of the recurrent cache of a hybrid model's recurrent
layers (semantics.md 9, docs/recurrent.md).

A recurrent layer (qwen3_next's GatedDeltaNet, nemotron_h's and mamba2's
Mamba2 mixer, lfm2's short conv, recurrent_gemma's RG-LRU block) keeps, per
batch element, two arrays that are functions of the tokens it consumed:

* the **conv window** (array index 0): the inputs of the last ``kernel - 1``
  tokens of its causal conv, zero rows before the first token;
* the **recurrent state** (array index 1, absent when ``size == 1``: lfm2):
  the state after every token consumed so far.

The spec is chunking-independent: it keeps the consumed token identities
(``toks``), so the conv window is :func:`conv_window` and the state is named
by the prefix it summarises (:func:`state_of`). Rollback is exact only as far
as the kept **checkpoints** reach: the **depth** U is how many tokens a
rollback may take back, the **coverage** c (``0 <= c <= min(U, offset)``)
how many the checkpoints kept now cover. A recorded step of n tokens raises
the coverage to ``min(U, c + n)``; an unrecorded one (the model wrote the
arrays outside the step recorder) clears it: the cache cannot vouch for
states it was not shown. A trim of ``n <= c`` tokens restores the conv
window and the state of ``offset - n`` exactly; beyond the coverage it is
refused (StateError) and nothing changes.

The checkpoint ring in closed form: U + 1 slots, the checkpoint of offset x
in slot :func:`slot` ``(x, U) = x % (U + 1)``; the live offsets are
``[offset - c, offset]`` (:func:`live_offsets`), each in its own slot, so no
step in ``(x, offset]`` overwrote the slot of a live x (obligation 15,
``proofs/recurrent.py``).

Every function is pure; refusals raise :mod:`kvspec.spec.errors` types and change
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError

#: array indices of the cache: 0 the conv window, 1 the recurrent state
CONV, STATE = 0, 1


def _check_int(op: str, name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidArgumentError(f"{op}: {name} must be an integer >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class RecurrentCache:
    """One recurrent layer's cache.

    * ``size``: arrays it holds, 2 (conv window and recurrent state) or 1
      (conv window only, lfm2's short conv);
    * ``kernel``: the causal conv's width (>= 2); the conv window holds
      ``kernel - 1`` rows;
    * ``depth``: U, the most tokens a rollback may take back (0: none);
    * ``toks``: token identities consumed so far (``offset = len(toks)``);
    * ``coverage``: c, tokens the kept checkpoints can take back.
    """

    size: int = 2
    kernel: int = 4
    depth: int = 0
    toks: tuple[int, ...] = ()
    coverage: int = 0

    @property
    def offset(self) -> int:
        """Tokens consumed (the position of the next)."""
        return len(self.toks)

    def window(self) -> tuple[int, ...]:
        """What the harness observes of the layer: the consumed token
        identities (the name of the recurrent state; the conv window is their
        last ``kernel - 1``)."""
        return self.toks


def empty(size: int = 2, kernel: int = 4, depth: int = 0) -> RecurrentCache:
    """An empty layer: no token consumed, coverage 0. Raises
    InvalidArgumentError unless ``size`` is 1 or 2, ``kernel`` an integer
    >= 2 and ``depth`` an integer >= 0."""
    if isinstance(size, bool) or size not in (1, 2):
        raise InvalidArgumentError(f"recurrent: size must be 1 (conv window only) or 2 (conv window and "
                                   f"recurrent state), got {size!r}")
    _check_int("recurrent", "kernel", kernel, 2)
    _check_int("recurrent", "depth", depth, 0)
    return RecurrentCache(size=size, kernel=kernel, depth=depth)


def coverage_after(coverage: int, n: int, depth: int, recorded: bool = True) -> int:
    """The coverage after a step of ``n >= 1`` tokens: ``min(depth, coverage
    + n)`` when recorded (the recorder keeps a checkpoint per token of the
    step's last ``min(n, depth)`` and one at the end of its block), 0 when
    unrecorded.

    pre: 0 <= coverage <= depth
    pre: n >= 1
    post: 0 <= __return__ <= depth
    post: not recorded or __return__ >= min(coverage, depth)
    post: recorded or __return__ == 0
    """
    return min(depth, coverage + n) if recorded else 0


def step(cache: RecurrentCache, tokens: tuple[int, ...], recorded: bool = True) -> RecurrentCache:
    """The model's call of the layer with ``tokens`` (a tuple of at least one
    token identity): the layer consumes them; the conv window and the state
    become those after ``toks + tokens``, whatever the chunking. ``recorded``:
    the call went through the step recorder (coverage ``min(U, c + n)``),
    else the coverage is 0 (:func:`coverage_after`). Raises
    InvalidArgumentError for an empty or non-tuple ``tokens``."""
    if not isinstance(tokens, tuple) or len(tokens) < 1:
        raise InvalidArgumentError(f"step: tokens must be a tuple of at least one token, got {tokens!r}")
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidArgumentError(f"step: every token must be an integer identity, got {t!r}")
    return replace(cache, toks=cache.toks + tokens,
                   coverage=coverage_after(cache.coverage, len(tokens), cache.depth, recorded))


def trimmable_rows(cache: RecurrentCache) -> int:
    """The coverage c: how many tokens a trim takes back exactly (``0 <= c
    <= min(depth, offset)``)."""
    return cache.coverage


def is_trimmable(cache: RecurrentCache) -> bool:
    """The capability (what mlx-lm asks once before speculative decoding):
    ``depth > 0``. Whether a given trim is exact is :func:`trimmable_rows`."""
    return cache.depth > 0


def trim(cache: RecurrentCache, n: int) -> tuple[int, RecurrentCache]:
    """Take back the last ``n`` tokens: ``n <= 0`` trims nothing and
    returns 0; ``n <= coverage`` restores the conv window and the recurrent
    state of ``offset - n`` exactly (both: a state rolled back with a stale
    conv window is a known public bug) and lowers the coverage by ``n``;
    returns ``(n, cache)``. **Decision** (semantics.md 9): ``n`` beyond the
    coverage raises StateError naming it and changes nothing (a quiet 0
    would desynchronise a list whose other layers trim one by one). Raises
    InvalidArgumentError for a non-integer ``n``."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidArgumentError(f"trim: n must be an integer, got {n!r}")
    if n <= 0:
        return 0, cache
    if n > cache.coverage:
        raise StateError(f"trim: a recurrent layer rolls back at most its coverage of {cache.coverage} tokens "
                         f"(offset={cache.offset}, depth={cache.depth}: checkpoints of offsets "
                         f"{cache.offset - cache.coverage}..{cache.offset}), got n={n}; nothing changed")
    return n, replace(cache, toks=cache.toks[: cache.offset - n], coverage=cache.coverage - n)


def conv_window(cache: RecurrentCache) -> tuple[int | None, ...]:
    """The conv window's rows by token identity, oldest first: the last
    ``kernel - 1`` tokens consumed, ``None`` for each zero row before the
    first token (length ``kernel - 1``)."""
    k = cache.kernel - 1
    last = cache.toks[max(0, cache.offset - k):]
    return (None,) * (k - len(last)) + last


def state_of(cache: RecurrentCache) -> tuple[int, ...] | None:
    """The recurrent state by name: the prefix it summarises (the tokens
    consumed, in order); None for a layer of ``size`` 1, which has no
    state."""
    return cache.toks if cache.size == 2 else None


# -- the checkpoint ring, in closed form -------------------------------------------


def slot(offset: int, depth: int) -> int:
    """The ring slot that holds the checkpoint of ``offset`` in a ring of
    ``depth + 1`` slots.

    pre: offset >= 0 and depth >= 0
    post: 0 <= __return__ <= depth
    """
    return offset % (depth + 1)


def live_offsets(offset: int, coverage: int) -> tuple[int, ...]:
    """The offsets whose checkpoints the ring holds, oldest first:
    ``[offset - coverage, offset]`` (the current one included: the state a
    later rollback lands on needs its checkpoint).

    pre: 0 <= coverage <= offset <= 12
    post: len(__return__) == coverage + 1
    post: __return__[-1] == offset
    """
    return tuple(range(offset - coverage, offset + 1))


def ring(cache: RecurrentCache) -> tuple[int | None, ...]:
    """The checkpoint ring of a layer of ``depth >= 1``: for each of its
    ``depth + 1`` slots the live offset whose checkpoint it holds, or None.
    Live offsets are at most ``depth + 1`` consecutive integers, so each has
    its own slot. Raises UnsupportedOperationError at depth 0 (no ring)."""
    if cache.depth == 0:
        raise UnsupportedOperationError("ring: a recurrent layer of depth 0 keeps no checkpoints")
    slots: list[int | None] = [None] * (cache.depth + 1)
    for x in live_offsets(cache.offset, cache.coverage):
        slots[slot(x, cache.depth)] = x
    return tuple(slots)


# -- the layer with its holders ------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    """A snapshot of the layer (``kind``: ``"snapshot"``, or ``"state
    snapshot"``: ``saved = c.state``, taken back only by ``state_restore``)."""

    cache: RecurrentCache
    kind: str = "snapshot"

    def window(self) -> tuple[int, ...]:
        return self.cache.window()


@dataclass(frozen=True)
class RecurrentWorld:
    cache: RecurrentCache
    holders: dict[str, Holder] = field(default_factory=dict)
    held: tuple[object, ...] | None = None
    returned: tuple[object, ...] | None = None
    next_token: int = 0


def observe(cache: RecurrentCache) -> tuple[tuple[int | None, ...], tuple[int, ...] | None]:
    """What a call of the layer leaves: ``(conv_window, state_of)``."""
    return conv_window(cache), state_of(cache)


def w_append(world: RecurrentWorld, n: int, recorded: bool = True) -> tuple[object, RecurrentWorld]:
    """The model calls the layer with the next ``n`` token identities
    (:func:`step`); returns :func:`observe` after it. Raises
    InvalidArgumentError unless ``n >= 1``."""
    _check_int("append", "n", n, 1)
    cache = step(world.cache, tuple(range(world.next_token, world.next_token + n)), recorded)
    result = observe(cache)
    return result, replace(world, cache=cache, returned=result, next_token=world.next_token + n)


def _new_name(world: RecurrentWorld, op: str, name: str) -> None:
    if name in world.holders:
        raise StateError(f"{op}: name {name!r} is already in use")


def w_snapshot(world: RecurrentWorld, name: str) -> tuple[None, RecurrentWorld]:
    """O(1) snapshot: the arrays and the checkpoint ring (its coverage)."""
    _new_name(world, "snapshot", name)
    return None, replace(world, holders={**world.holders, name: Holder(world.cache)})


def w_state_snapshot(world: RecurrentWorld, name: str) -> tuple[None, RecurrentWorld]:
    """``saved = c.state`` (with ``c.meta_state``): arrays, offset, no
    history."""
    _new_name(world, "state_snapshot", name)
    return None, replace(world, holders={**world.holders, name: Holder(world.cache, "state snapshot")})


def _holder(world: RecurrentWorld, op: str, name: str, kind: str) -> Holder:
    snap = world.holders.get(name)
    if snap is None:
        raise StateError(f"{op}: no snapshot or handle named {name!r}")
    if snap.kind != kind:
        raise StateError(f"{op}: {name!r} is a {snap.kind}, not a {kind}")
    return snap


def snapshot_fits(cache: RecurrentCache, snap: RecurrentCache) -> bool:
    """Whether a layer ``cache`` takes a snapshot ``snap`` another layer
    (or this one) took (semantics.md 9, "restore across layers"): the same
    ``size`` and ``depth`` (the arrays and the checkpoint ring), and, when
    both hold a conv window (both have consumed a token: ``offset > 0``),
    the same ``kernel`` (the window's ``kernel - 1`` rows; the impl compares
    the window arrays' shape and dtype, which also covers channels and
    dtype, the same within a list here). A layer that has consumed nothing
    holds no conv window yet and cannot tell its width: the check is the
    one the cache can make, nothing more."""
    if (cache.size, cache.depth) != (snap.size, snap.depth):
        return False
    return cache.offset == 0 or snap.offset == 0 or cache.kernel == snap.kernel


def restore(cache: RecurrentCache, snap: RecurrentCache) -> RecurrentCache:
    """``c.restore(snap)``: the snapshot's arrays, offset and coverage (its
    checkpoints come back with it)."""
    return replace(cache, toks=snap.toks, coverage=snap.coverage)


def state_restore(cache: RecurrentCache, saved: RecurrentCache) -> RecurrentCache:
    """``c.state = saved``: the saved arrays and offset, coverage 0 (a saved
    state carries no history)."""
    return replace(cache, toks=saved.toks, coverage=0)


def copy(cache: RecurrentCache) -> RecurrentCache:
    """``copy.copy``/``copy.deepcopy``: an independent layer with the same
    arrays, offset and checkpoints (coverage kept)."""
    return replace(cache)


def reload(cache: RecurrentCache) -> RecurrentCache:
    """The layer saved to a prompt-cache file and loaded back: conv window,
    state, offset, depth and size kept; coverage 0 (a file holds no
    checkpoints)."""
    return replace(cache, coverage=0)


def w_restore(world: RecurrentWorld, name: str) -> tuple[None, RecurrentWorld]:
    """Raises StateError for an unknown name or a state snapshot."""
    snap = _holder(world, "restore", name, "snapshot")
    return None, replace(world, cache=restore(world.cache, snap.cache))


def w_state_restore(world: RecurrentWorld, name: str) -> tuple[None, RecurrentWorld]:
    """Raises StateError for an unknown name or a (plain) snapshot."""
    snap = _holder(world, "state_restore", name, "state snapshot")
    return None, replace(world, cache=state_restore(world.cache, snap.cache))


def w_copy(world: RecurrentWorld, name: str, live: str) -> tuple[None, RecurrentWorld]:
    """A copy held under ``name``; ``live == "copy"``: the trace goes on
    with the copy (the same values, coverage kept), the original held.
    Raises InvalidArgumentError for another ``live``, StateError for a name
    in use."""
    if live not in ("copy", "original"):
        raise InvalidArgumentError(f"copy: live must be 'copy' or 'original', got {live!r}")
    _new_name(world, "copy", name)
    return None, replace(world, cache=copy(world.cache), holders={**world.holders, name: Holder(world.cache)})


def w_reload(world: RecurrentWorld, via: str) -> tuple[None, RecurrentWorld]:
    """:func:`reload` (``via``: ``"file"`` or ``"state"``). Raises
    InvalidArgumentError for another ``via``."""
    if via not in ("file", "state"):
        raise InvalidArgumentError(f"reload: via must be 'file' or 'state', got {via!r}")
    return None, replace(world, cache=reload(world.cache))


def w_drop(world: RecurrentWorld, name: str) -> tuple[None, RecurrentWorld]:
    if name not in world.holders:
        raise StateError(f"drop: no snapshot or handle named {name!r}")
    return None, replace(world, holders={k: v for k, v in world.holders.items() if k != name})


def w_hold(world: RecurrentWorld) -> tuple[None, RecurrentWorld]:
    if world.returned is None:
        raise StateError("hold: no append has returned a window yet")
    return None, replace(world, held=world.returned)


def w_release_hold(world: RecurrentWorld) -> tuple[None, RecurrentWorld]:
    return None, replace(world, held=None)


def holds_buffer(world: RecurrentWorld) -> bool:
    """False: a recurrent layer takes no K/V rows, so no K/V row mismatch
    applies to it."""
    return False


def view_of(world: RecurrentWorld, name: str) -> tuple[int, ...]:
    """The window of the holder ``name``. Raises StateError for an unknown
    name."""
    if name not in world.holders:
        raise StateError(f"expect: no snapshot or handle named {name!r}")
    return world.holders[name].window()


def unsupported(op: str) -> UnsupportedOperationError:
    return UnsupportedOperationError(f"{op}: not an operation of the recurrent cache")


def apply_op(world: RecurrentWorld, op: dict) -> tuple[object, RecurrentWorld]:
    """Run one kvtrace op: ``append`` (a recorded call of ``n`` tokens),
    ``append_unrecorded``, ``fetch`` (:func:`observe`), ``trim``,
    ``can_trim``, ``snapshot``/``restore``, ``state_snapshot``/
    ``state_restore``, ``copy``, ``reload``, ``drop``, ``hold``,
    ``release_hold``. Raises the spec's refusal, or
    UnsupportedOperationError for an op the recurrent cache does not have."""
    name = op["op"]
    if name == "append":
        return w_append(world, op["n"])
    if name == "append_unrecorded":
        return w_append(world, op["n"], recorded=False)
    if name == "fetch":
        return observe(world.cache), world
    if name == "trim":
        count, cache = trim(world.cache, op["n"])
        return count, replace(world, cache=cache)
    if name == "can_trim":
        return is_trimmable(world.cache), world
    if name == "snapshot":
        return w_snapshot(world, op["name"])
    if name == "restore":
        return w_restore(world, op["name"])
    if name == "state_snapshot":
        return w_state_snapshot(world, op["name"])
    if name == "state_restore":
        return w_state_restore(world, op["name"])
    if name == "copy":
        return w_copy(world, op["name"], op.get("live", "original"))
    if name == "reload":
        return w_reload(world, op.get("via", "file"))
    if name == "drop":
        return w_drop(world, op["name"])
    if name == "hold":
        return w_hold(world)
    if name == "release_hold":
        return w_release_hold(world)
    raise unsupported(name)
