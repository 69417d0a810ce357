"""Executable spec of the Turbo modes' physical layout (semantics.md 2,
"Turbo modes").

The abstract window of every Turbo mode is the dense one: this module runs
``kvspec.spec.dense`` for it (entries, offset, capacity of the K buffer) and adds
what only the Turbo modes have:

* which arrays a cache keeps and how many rows each holds
  (:func:`array_rows`): in Turbo4Asym, Turbo4 and Turbo3Asym every buffer
  and sidecar has the capacity's rows, and a trim cuts them all to exactly
  the live rows (``kvspec.spec.dense.trim_is_logical`` is False for them);
* which rows are stored quantized (:func:`quantized_rows`);
* Turbo4Delegated's ``cold_offset``: V is a cold quantized prefix of
  ``cold_offset`` rows and a hot unquantized rest. Its evolution is
  :func:`fold_schedule` at an append (the handoff fold, then block folds
  while hot exceeds ``hot_threshold``) and :func:`trim_split` at a trim (hot
  rows first). Invariant: ``0 <= cold_offset <= offset``.

Pure functions over frozen dataclasses, standard library only. Holders
(snapshots, handles, the held window) keep the ``cold_offset`` of the moment
they were made, since it decides which of their rows are quantized.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvspec.spec import dense as sd
from kvspec.spec.errors import InvalidArgumentError

Mode = sd.Mode
TURBO_MODES = (Mode.TURBO4ASYM, Mode.TURBO4, Mode.TURBO3ASYM, Mode.TURBO4DELEGATED)
DEFAULT_HOT_THRESHOLD = 256
DEFAULT_FOLD_BLOCK = 128


def bits_of(mode: Mode) -> int:
    """Quantizer width: 3 bits in Turbo3Asym, 4 in the other Turbo modes."""
    return 3 if mode is Mode.TURBO3ASYM else 4


def keys_quantized(mode: Mode) -> bool:
    """Only Turbo4 quantizes K (with its own sign vectors)."""
    return mode is Mode.TURBO4


def array_names(mode: Mode) -> tuple[str, ...]:
    """Every array a non-empty cache of ``mode`` may keep, sorted (the
    implementation's names): the float K buffer or K's packed indices and
    sidecars; V's packed indices, its norm sidecar and, at 4 bits, its
    rescale sidecar; Delegated's cold V arrays and hot V buffer."""
    if mode is Mode.TURBO4DELEGATED:
        return ("cold_norm", "cold_packed", "cold_rescale", "hot", "keys")
    k = ("k_norm", "k_packed", "k_rescale") if keys_quantized(mode) else ("keys",)
    v = ("v_norm", "v_packed") + (("v_rescale",) if bits_of(mode) == 4 else ())
    return tuple(sorted(k + v))


def packed_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one packed row: ``bits * head_dim // 8``. Exact (no index
    lost) iff ``bits * head_dim % 8 == 0``; at 3 bits iff ``head_dim % 8 ==
    0`` (proofs/turbo.py)."""
    return bits * head_dim // 8


def head_dim_allowed(head_dim: int, bits: int) -> bool:
    """Shape rule: a power of two in ``[2, 8192]`` (the Walsh-Hadamard
    rotation), and at 3 bits a multiple of 8 (whole 24-bit words)."""
    power = 2 <= head_dim <= MAX_HEAD_DIM and head_dim & (head_dim - 1) == 0
    return power and (bits != 3 or head_dim % 8 == 0)


MAX_HEAD_DIM = 8192


def check_head_dim(name: str, head_dim: int, bits: int) -> None:
    """Shape rule of the quantizer (:func:`head_dim_allowed`), checked before
    an append changes anything. Raises InvalidArgumentError naming ``name``
    (``values``, or ``keys`` in Turbo4), the value and the rule."""
    if head_dim < 2 or head_dim > MAX_HEAD_DIM or head_dim & (head_dim - 1):
        raise InvalidArgumentError(
            f"{name}: head_dim must be a power of two in [2, {MAX_HEAD_DIM}] for the Walsh-Hadamard "
            f"rotation, got {head_dim}"
        )
    if bits == 3 and head_dim % 8:
        raise InvalidArgumentError(
            f"{name}: head_dim must be a multiple of 8 for 3-bit packing (8 indices per 3 bytes), got {head_dim}"
        )


def check_append_head_dims(mode: Mode, k_head_dim: int, v_head_dim: int) -> None:
    """The append's shape rules in ``mode``: Turbo4 needs equal K and V
    head dims; V's head dim (and K's in Turbo4) must suit the quantizer
    (:func:`check_head_dim`). Raises InvalidArgumentError."""
    bits = bits_of(mode)
    if keys_quantized(mode) and k_head_dim != v_head_dim:
        raise InvalidArgumentError(
            f"append: keys head_dim must equal values head_dim in mode {mode.value}, got {k_head_dim} and {v_head_dim}"
        )
    check_head_dim("values", v_head_dim, bits)
    if keys_quantized(mode):
        check_head_dim("keys", k_head_dim, bits)


def handoff_fold(cold_offset: int, live_len: int, n: int) -> bool:
    """Decision (a): the handoff fold happens at a single-row append when the
    cold part is empty and the cache already holds rows (the first decode
    after a prefill, or after a rollback that emptied the cold part)."""
    return n == 1 and cold_offset == 0 and live_len > 0


def fold_block_rows(hot: int, hot_threshold: int, fold_block: int) -> int:
    """Rows one block fold moves: ``min(fold_block, hot)`` while hot exceeds
    ``hot_threshold``, else 0 (decision (b))."""
    return min(fold_block, hot) if hot > hot_threshold else 0


def fold_schedule(cold_offset: int, live_len: int, n: int, hot_threshold: int, fold_block: int) -> int:
    """Rows of V that fold cold at an append of ``n`` rows to a Delegated
    cache holding ``live_len`` rows of which ``cold_offset`` are cold: every
    held row at a handoff, then block folds (of the oldest hot rows, old ones
    before new ones) until hot is at most ``hot_threshold``.

    CrossHair checks the contract with ``live_len + n <= 12`` and
    ``fold_block <= 4`` (the first ``pre:`` line); the bound loses nothing:
    both postconditions follow from a loop invariant that holds at any size
    (``0 <= hot`` and ``folded + hot`` constant: each block fold moves ``f <=
    hot`` rows) and from the exit test (``f == 0`` iff ``hot <=
    hot_threshold``, as ``fold_block >= 1``); the box runs every branch: with
    and without a handoff, zero, one and several block folds, a last fold of
    ``fold_block`` rows and one of fewer.

    pre: live_len + n <= 12 and fold_block <= 4
    pre: 0 <= cold_offset <= live_len and n >= 1 and hot_threshold >= 0 and fold_block >= 1
    post: 0 <= __return__ <= live_len - cold_offset + n
    post: live_len - cold_offset + n - __return__ <= hot_threshold
    """
    folded = live_len - cold_offset if handoff_fold(cold_offset, live_len, n) else 0
    hot = live_len - cold_offset - folded + n
    while True:
        f = fold_block_rows(hot, hot_threshold, fold_block)
        if f == 0:
            return folded
        folded += f
        hot -= f


def trim_split(cold_offset: int, live_len: int, n: int) -> tuple[int, int]:
    """``(from_hot, from_cold)`` for a trim of ``n`` rows (``0 <= n <=
    live_len``): the hot rows go first, then cold ones.

    pre: 0 <= cold_offset <= live_len and 0 <= n <= live_len
    post: __return__[0] + __return__[1] == n
    post: 0 <= __return__[0] <= live_len - cold_offset and 0 <= __return__[1] <= cold_offset
    """
    from_hot = min(n, live_len - cold_offset)
    return from_hot, n - from_hot


def cold_offset_ok(cold_offset: int, offset: int) -> bool:
    """The Delegated invariant ``0 <= cold_offset <= offset`` (semantics.md 5.6)."""
    return 0 <= cold_offset <= offset


def array_rows(mode: Mode, capacity: int, live_len: int, cold_offset: int) -> dict[str, int]:
    """Rows along the sequence axis of every array a cache keeps (arrays not
    kept are absent; nothing is kept without rows). Turbo4Asym/Turbo4/
    Turbo3Asym: every array has ``capacity`` rows (``live_len`` right after
    a trim or gather). Delegated: keys ``capacity``; cold arrays exactly
    ``cold_offset``; hot exactly ``live_len - cold_offset``."""
    if live_len == 0:
        return {}
    if mode is not Mode.TURBO4DELEGATED:
        return dict.fromkeys(array_names(mode), capacity)
    out = {"keys": capacity}
    if cold_offset:
        out.update({"cold_norm": cold_offset, "cold_packed": cold_offset, "cold_rescale": cold_offset})
    if live_len > cold_offset:
        out["hot"] = live_len - cold_offset
    return dict(sorted(out.items()))


def quantized_rows(mode: Mode, live_len: int, cold_offset: int) -> tuple[tuple[bool, bool], ...]:
    """For each live row, in fetch order, whether its (K, V) comes back
    quantized-then-dequantized: V in every Turbo mode but only the first
    ``cold_offset`` rows in Delegated; K only in Turbo4."""
    k = keys_quantized(mode)
    if mode is Mode.TURBO4DELEGATED:
        return tuple((False, i < cold_offset) for i in range(live_len))
    return tuple((k, True) for _ in range(live_len))


# ---------------------------------------------------------------------------
# The world: kvspec.spec.dense's world plus the cold offsets.


@dataclass(frozen=True)
class TurboWorld:
    """A dense world in a Turbo mode plus Delegated's counters: the cache's
    ``cold_offset``, each named holder's and the held/returned windows'
    (always 0 outside Delegated)."""

    dense: sd.DenseWorld
    hot_threshold: int = DEFAULT_HOT_THRESHOLD
    fold_block: int = DEFAULT_FOLD_BLOCK
    cold_offset: int = 0
    holder_cold: dict[str, int] = field(default_factory=dict)
    held_cold: int = 0
    returned_cold: int = 0
    #: the trace's V head dim and K head dim (None: rows are not checked;
    #: K's defaults to V's)
    head_dim: int | None = None
    k_head_dim: int | None = None

    @property
    def mode(self) -> Mode:
        return self.dense.cache.mode

    @property
    def cache(self) -> sd.DenseCache:
        return self.dense.cache

    @property
    def next_token(self) -> int:
        return self.dense.next_token

    @property
    def holders(self) -> dict[str, sd.Holder]:
        return self.dense.holders

    @property
    def held(self) -> sd.Holder | None:
        return self.dense.held

    @property
    def consumed(self) -> frozenset[str]:
        return self.dense.consumed

    @property
    def returned(self) -> sd.Holder | None:
        return self.dense.returned

    def rows(self) -> dict[str, int]:
        """The cache's :func:`array_rows`."""
        c = self.dense.cache
        return array_rows(self.mode, c.capacity, c.live_len, self.cold_offset)


def new_world(mode: Mode | str, step: int = 256, hot_threshold: int = DEFAULT_HOT_THRESHOLD,
              fold_block: int = DEFAULT_FOLD_BLOCK, head_dim: int | None = None,
              k_head_dim: int | None = None) -> TurboWorld:
    """An empty Turbo world whose appends bring V rows of ``head_dim`` and K
    rows of ``k_head_dim`` (default ``head_dim``; None: unchecked). A head_dim the quantizer cannot take is not refused
    here: every append is (:func:`check_append_head_dims`), as the
    implementation refuses it. Raises InvalidArgumentError for a non-Turbo
    mode, ``step < 1``, ``hot_threshold < 0`` or ``fold_block < 1``."""
    mode = Mode(mode)
    if mode not in TURBO_MODES:
        raise InvalidArgumentError(f"mode: must be a Turbo mode, got {mode.value}")
    if not isinstance(hot_threshold, int) or hot_threshold < 0:
        raise InvalidArgumentError(f"hot_threshold: must be an integer >= 0, got {hot_threshold!r}")
    if not isinstance(fold_block, int) or fold_block < 1:
        raise InvalidArgumentError(f"fold_block: must be an integer >= 1, got {fold_block!r}")
    # Turbo writes always copy: the in-place switch is irrelevant (off).
    return TurboWorld(sd.new_world(mode, step, inplace=False), hot_threshold, fold_block, head_dim=head_dim,
                      k_head_dim=k_head_dim)


def _after_trim(cold_offset: int, live_before: int, removed: int) -> int:
    return cold_offset - trim_split(cold_offset, live_before, removed)[1]


def holds_buffer(world: TurboWorld) -> bool:
    """Whether the cache holds arrays (then an append's rows must match them)."""
    return sd.holds_buffer(world.dense)


def apply_op(world: TurboWorld, op: dict) -> tuple[object, TurboWorld]:
    """Run one kvtrace op: ``kvspec.spec.dense.apply_op`` for the window and the K
    buffer, plus the cold offsets (Delegated): folds at appends, hot-first
    trims, and holders keeping theirs. Raises what kvspec.spec.dense raises."""
    name = op["op"]
    before = world.dense
    live = before.cache.live_len
    folded = 0
    if name == "append" and op["n"] >= 1 and world.head_dim is not None:
        check_append_head_dims(world.mode, world.k_head_dim or world.head_dim, world.head_dim)
    if name == "append" and world.mode is Mode.TURBO4DELEGATED and op["n"] >= 1:
        folded = fold_schedule(world.cold_offset, live, op["n"], world.hot_threshold, world.fold_block)
    result, dense = sd.apply_op(before, op)
    w = replace(world, dense=dense)
    if world.mode is not Mode.TURBO4DELEGATED:
        return result, w
    cold = world.cold_offset
    if name == "append":
        cold += folded
        w = replace(w, returned_cold=cold)
    elif name in ("trim", "trim_to"):
        cold = _after_trim(cold, live, int(result))  # type: ignore[arg-type]
    elif name == "hold":
        w = replace(w, held_cold=world.returned_cold)
    elif name in ("snapshot", "copy"):
        w = replace(w, holder_cold={**world.holder_cold, op["name"]: cold})
    elif name == "restore":
        cold = world.holder_cold[op["name"]]
    elif name == "detach":
        w = replace(w, holder_cold={**world.holder_cold, op["name"]: cold})
        cold = 0
    elif name == "install":
        cold = world.holder_cold[op["name"]]
        w = replace(w, holder_cold={k: v for k, v in world.holder_cold.items() if k != op["name"]})
    elif name == "drop":
        w = replace(w, holder_cold={k: v for k, v in world.holder_cold.items() if k != op["name"]})
    elif name == "handle_trim_to":
        h = before.holders[op["name"]]
        hc = _after_trim(world.holder_cold[op["name"]], h.live_len, int(result))  # type: ignore[arg-type]
        w = replace(w, holder_cold={**world.holder_cold, op["name"]: hc})
    if dense.cache.live_len == 0:
        cold = 0
    return result, replace(w, cold_offset=cold)


def view_cold(world: TurboWorld, view: str) -> int:
    """The cold offset of a view: ``"cache"``, ``"held"``, ``"returned"``
    (the window the last append returned) or ``"holder:<name>"``."""
    if view == "cache":
        return world.cold_offset
    if view == "held":
        return world.held_cold
    if view == "returned":
        return world.returned_cold
    return world.holder_cold.get(view.split(":", 1)[1], 0)


__all__ = [
    "TURBO_MODES", "TurboWorld", "apply_op", "array_names", "array_rows", "bits_of", "check_append_head_dims",
    "check_head_dim", "cold_offset_ok",
    "fold_block_rows", "fold_schedule", "handoff_fold", "head_dim_allowed", "keys_quantized", "new_world",
    "packed_bytes", "quantized_rows", "trim_split", "view_cold",
]
