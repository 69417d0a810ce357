"""Dense MLX KV caches in the Turbo modes (spec: ``kvspec.spec.dense`` for the
abstract window, ``kvspec.spec.turbo`` for the physical layout).

* :class:`TurboKVCache`, modes ``turbo4asym`` and ``turbo3asym`` (K kept in
  the incoming float dtype, V quantized at 4 or 3 bits) and ``turbo4`` (K
  and V quantized at 4 bits, K rotated by its own sign vectors);
* :class:`DelegatedKVCache`, mode ``turbo4delegated``: K kept, V split into
  a cold quantized prefix of ``cold_offset`` rows and a hot float part.

Storage (sequence axis 2; ``T`` is the capacity, ``d`` the head dim)::

    keys        [B, H, T, Dk]     incoming float dtype (asym, delegated)
    k_packed    [B, H, T, Dk/2]   uint8 (turbo4)      k_norm/k_rescale [B, H, T, 1] f32
    v_packed    [B, H, T, w]      uint8, w = Dv/2 (4-bit) or 3*Dv/8 (3-bit)
    v_norm      [B, H, T, 1]      float32
    v_rescale   [B, H, T, 1]      float32 (4-bit modes)

Delegated keeps ``keys`` with capacity ``T``, the cold part (``cold_packed``,
``cold_norm``, ``cold_rescale``) with exactly ``cold_offset`` rows and
``hot`` with exactly ``offset - cold_offset`` rows.

Rules (semantics.md 2): every write copies (``last_write_inplace`` is always
False); trims are physical (every buffer and sidecar cut to exactly the live
rows, together); front trims return 0 and change nothing; gathers leave every
buffer cut to the live rows (Delegated refuses them). Rows are quantized
before any state changes, so a refused or failing append changes nothing.
Windows come back in the dtype the rows came in.

Use :func:`make_cache` to build any dense-mode cache by name.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import mlx.core as mx

from kvspec.impl import turbo_quant as tq
from kvspec.impl.dense import (
    SEQ_AXIS,
    KVCache,
    _check_index_list,
    _check_int,
    _check_list,
    _check_rows,
    _check_tensor,
    refuse_foreign_save,
    regrow_capacity,
    write_rows_copy,
)
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError

TURBO_MODES = ("turbo4asym", "turbo4", "turbo3asym")
DELEGATED = "turbo4delegated"
#: bits of the V quantizer and whether K is quantized too, by mode
_LAYOUT = {"turbo4asym": (4, False), "turbo4": (4, True), "turbo3asym": (3, False), DELEGATED: (4, False)}
_FLOATS = (mx.float16, mx.bfloat16, mx.float32)
Store = dict[str, mx.array]


def _cut(store: Store | None, names: tuple[str, ...], rows: int) -> Store | None:
    """The named arrays cut to ``[0, rows)`` (a view: no data copied)."""
    if store is None:
        return None
    return {k: (a[:, :, :rows, :] if k in names else a) for k, a in store.items()}


def _shared(store: Store | None) -> Store | None:
    """New handles to the same memory (an O(1) alias)."""
    return None if store is None else {k: a[:, :, :, :] for k, a in store.items()}


def _quantized(store: Store, prefix: str) -> tq.Quantized:
    return tq.Quantized(store[prefix + "packed"], store[prefix + "norm"], store.get(prefix + "rescale"))


def _as_store(q: tq.Quantized, prefix: str) -> Store:
    out = {prefix + "packed": q.packed, prefix + "norm": q.norm}
    if q.rescale is not None:
        out[prefix + "rescale"] = q.rescale
    return out


def _rows_of(store: Store, name: str) -> int:
    return int(store[name].shape[SEQ_AXIS])


class TurboSnapshot:
    """A prompt-cache snapshot of a Turbo cache: new handles to its arrays
    (no data copied), its counters and the dtype/head dims windows come back
    in. Its view never changes (every write of the cache copies)."""

    def __init__(self, mode: str, store: Store | None, offset: int, live_start: int, cold_offset: int,
                 dtype: mx.Dtype | None, k_dim: int | None, v_dim: int | None, unpack: Any = tq.unpack_indices):
        self.mode, self.store = mode, store
        self.offset, self.live_start, self.cold_offset = offset, live_start, cold_offset
        self.dtype, self.k_dim, self.v_dim = dtype, k_dim, v_dim
        self.unpack = unpack

    @property
    def live_len(self) -> int:
        """Rows the snapshot sees, ``offset - live_start``. Rule: ``kvspec.spec.dense.holder_of``
        (semantics.md 2, "snapshot")."""
        return self.offset - self.live_start

    @property
    def buffers(self) -> Store | None:
        """The stored arrays the snapshot shares with the cache it was taken from (packed codes,
        norms, rescales, unquantized rows), or None. Rule: ``kvspec.spec.turbo.array_names`` (semantics.md
        2, "Turbo row storage")."""
        return self.store

    def fetch(self) -> tuple[mx.array, mx.array] | None:
        """The window ``[B, H, live_len, D]`` in the stored dtype, or None.

        Rule: ``kvspec.spec.dense.view_of`` (semantics.md 5, "rule 3")."""
        if self.store is None:
            return None
        return window(self.mode, self.store, self.live_len, self.cold_offset, self.dtype, self.k_dim, self.v_dim,
                      self.unpack)


class TurboHandle(TurboSnapshot):
    """Arrays moved out of a cache by ``detach``; ``install`` consumes it."""

    consumed = False

    def trim_to(self, length: int) -> int:
        """Cut the handle's arrays physically so that ``offset == length``
        (Delegated: hot rows first, then cold). Returns the rows removed.
        Raises InvalidArgumentError unless ``0 <= length <= offset``.

        Rule: ``kvspec.spec.dense.handle_trim_to``, ``kvspec.spec.turbo.trim_split`` (semantics.md 2,
        "handle trim")."""
        length = _check_int("handle_trim_to", "len", length)
        if length < 0 or length > self.offset:
            raise InvalidArgumentError(
                f"handle_trim_to: len must satisfy 0 <= len <= offset ({self.offset}), got {length}"
            )
        n = min(self.offset - length, self.live_len)
        if n == 0:
            return 0
        self.store, self.cold_offset = physical_trim(self.mode, self.store, self.live_len, self.cold_offset, n)
        self.offset -= n
        return n


def window(mode: str, store: Store, live: int, cold_offset: int, dtype: mx.Dtype | None,
           k_dim: int | None, v_dim: int | None, unpack: Any = tq.unpack_indices) -> tuple[mx.array, mx.array]:
    """Attention-ready rows ``[0, live)`` of a store, in ``dtype``: stored K
    as is or dequantized (Turbo4), V dequantized (Delegated: ``dequant(cold)
    ++ hot``). ``unpack`` inverts the cache's packer."""
    bits, quant_k = _LAYOUT[mode]
    assert dtype is not None and k_dim is not None and v_dim is not None
    if quant_k:
        k = tq.dequantize(_quantized(_cut(store, tuple(store), live), "k_"), bits, tq.K_SEED, k_dim, dtype, unpack)
    else:
        k = store["keys"][:, :, :live, :]
    if mode == DELEGATED:
        parts = []
        if cold_offset:
            parts.append(tq.dequantize(_quantized(store, "cold_"), bits, tq.V_SEED, v_dim, dtype, unpack))
        if "hot" in store:
            parts.append(store["hot"])
        v = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=SEQ_AXIS)
    else:
        v = tq.dequantize(_quantized(_cut(store, tuple(store), live), "v_"), bits, tq.V_SEED, v_dim, dtype, unpack)
    return k, v


def physical_trim(mode: str, store: Store | None, live: int, cold_offset: int, n: int) -> tuple[Store | None, int]:
    """Remove the last ``n`` of ``live`` rows (``0 < n <= live``) by cutting
    every array to exactly the rows that stay; Delegated takes the hot rows
    first, then cold ones (kvspec.spec.turbo.trim_split; the rows left are
    kvspec.spec.turbo.array_rows). Returns (store or None when nothing stays, new
    cold_offset)."""
    keep = live - n
    if keep == 0 or store is None:
        return None, 0
    if mode != DELEGATED:
        return _cut(store, tuple(store), keep), 0
    hot = live - cold_offset
    from_hot = min(n, hot)
    cold = cold_offset - (n - from_hot)
    out = {"keys": store["keys"][:, :, :keep, :]}
    if cold:
        out.update({k: a[:, :, :cold, :] for k, a in store.items() if k.startswith("cold_")})
    if hot - from_hot:
        out["hot"] = store["hot"][:, :, : hot - from_hot, :]
    return out, cold


class _TurboBase:
    """What the Turbo caches share: counters, validation, holders and the
    mlx-lm protocol. Subclasses provide ``_appended`` (the new store after
    an append, computed without touching ``self``) and the trim/gathers."""

    mode: str

    def __init__(self, mode: str, step: int):
        step = _check_int(type(self).__name__, "step", step)
        if step < 1:
            raise InvalidArgumentError(f"{type(self).__name__}: step must be >= 1, got {step}")
        self.mode, self.step = mode, step
        # not ``bits``: mlx-lm's attention takes any cache with a ``bits``
        # attribute for its own QuantizedKVCache
        self.quant_bits, self.quant_k = _LAYOUT[mode]
        self._reset()

    def _reset(self) -> None:
        self.store: Store | None = None
        self.offset = 0
        self.live_start = 0
        self.cold_offset = 0
        self.dtype: mx.Dtype | None = None
        self.k_dim: int | None = None
        self.v_dim: int | None = None
        self.last_write_inplace = False

    # -- observables -------------------------------------------------------
    @property
    def live_len(self) -> int:
        return self.offset - self.live_start

    @property
    def capacity(self) -> int:
        """Physical rows of the K buffer along axis 2 (0 without buffers)."""
        if self.store is None:
            return 0
        return _rows_of(self.store, "keys" if "keys" in self.store else "k_packed")

    @property
    def buffers(self) -> Store | None:
        return self.store

    def row_counts(self) -> dict[str, int]:
        """Rows along axis 2 of every stored array, by name (the sidecar
        lockstep observable)."""
        return {} if self.store is None else {k: _rows_of(self.store, k) for k in self.store}

    # -- the write path ----------------------------------------------------
    def _check_new_rows(self, keys: Any, values: Any) -> int:
        """Shape and dtype rules, all before any work: rank 4, float, equal
        [B, H, S]; one dtype for K and V; V's head_dim (and K's in Turbo4)
        fit the quantizer; Turbo4 needs equal K/V head_dim; B, H, D and the
        dtype match rows already cached."""
        n = _check_rows("append", keys, values)
        if keys.dtype != values.dtype or keys.dtype not in _FLOATS:
            raise InvalidArgumentError(
                f"append: keys and values must share one of float16, bfloat16, float32 in mode {self.mode}, "
                f"got {keys.dtype} and {values.dtype}"
            )
        dk, dv = int(keys.shape[3]), int(values.shape[3])
        if self.quant_k and dk != dv:
            raise InvalidArgumentError(
                f"append: keys head_dim must equal values head_dim in mode {self.mode}, got {dk} and {dv}"
            )
        tq.check_head_dim("values", dv, self.quant_bits)
        if self.quant_k:
            tq.check_head_dim("keys", dk, self.quant_bits)
        if self.store is not None:
            have = (*self._bh(), self.k_dim, self.v_dim)
            got = (int(keys.shape[0]), int(keys.shape[1]), dk, dv)
            if have != got:
                raise InvalidArgumentError(f"append: [B, H, Dk, Dv] must match the cache's {have}, got {got}")
            if keys.dtype != self.dtype:
                raise InvalidArgumentError(f"append: dtype must be the cache's {self.dtype}, got {keys.dtype}")
        return n

    def _bh(self) -> tuple[int, int]:
        assert self.store is not None
        a = next(iter(self.store.values()))
        return int(a.shape[0]), int(a.shape[1])

    def _encode_keys(self, keys: mx.array) -> Store:
        if self.quant_k:
            return _as_store(self._quantize(keys, tq.K_SEED), "k_")
        return {"keys": keys}

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``S`` rows and return the window (kvspec.spec.dense.append; the
        physical layout follows kvspec.spec.turbo).

        ``keys``: ``[B, H, S, Dk]``, ``values``: ``[B, H, S, Dv]``, one of
        float16/bfloat16/float32 for both. Returns ``[B, H, live_len, D]``
        windows in that dtype (quantized parts dequantized). Raises
        InvalidArgumentError for a wrong rank or dtype, S < 1, a head_dim the
        quantizer cannot take (not a power of two; 3-bit: not a multiple of
        8; Turbo4: Dk != Dv), or rows that differ from those cached in B, H,
        D or dtype. Every check runs before the cache changes: a refused
        append leaves it as it was.

        The new arrays are left lazy (as a dense cache's are): evaluating
        them here, while ``self.store`` still held the old arrays, made MLX
        copy every array whole at each append (a static slice update reuses
        its input only when nothing else references it), and cost a host
        synchronisation per layer on a GPU.
        """
        n = self._check_new_rows(keys, values)
        store, cold_offset = self._appended(keys, values, n)
        self.store, self.cold_offset = store, cold_offset
        self.offset += n
        self.dtype, self.k_dim, self.v_dim = keys.dtype, int(keys.shape[3]), int(values.shape[3])
        self.last_write_inplace = False
        return self._window()

    def _appended(self, keys: mx.array, values: mx.array, n: int) -> tuple[Store, int]:
        raise NotImplementedError

    def _window(self) -> tuple[mx.array, mx.array]:
        assert self.store is not None
        return window(self.mode, self.store, self.live_len, self.cold_offset, self.dtype, self.k_dim, self.v_dim,
                      self._unpack)

    #: the index packer and its inverse (kvspec.impl.turbo_quant)
    _pack = staticmethod(tq.pack_indices)
    _unpack = staticmethod(tq.unpack_indices)

    def _quantize(self, x: mx.array, seed: int) -> tq.Quantized:
        """Quantize rows whose head dims ``_check_new_rows`` accepted."""
        return tq.quantize(x, self.quant_bits, seed, pack=self._pack, check=False)

    def fetch(self) -> tuple[mx.array, mx.array] | None:
        """The live window without writing, or None when empty."""
        return None if self.store is None else self._window()

    # -- the trim family ---------------------------------------------------
    def trim(self, n: int) -> int:
        """Remove ``n`` rows from the end, physically: every buffer and
        sidecar is cut to exactly the live rows (Delegated: hot rows first,
        then cold). ``n`` is clamped to ``[0, live_len]``. Returns the rows
        removed (kvspec.spec.dense.trim, kvspec.spec.turbo.trim)."""
        n = _check_int("trim", "n", n)
        n = max(0, min(n, self.live_len))
        if n == 0:
            return 0
        self.store, self.cold_offset = physical_trim(self.mode, self.store, self.live_len, self.cold_offset, n)
        self.offset -= n
        if self.store is None:
            self._forget_layout()
        return n

    def _forget_layout(self) -> None:
        self.dtype = self.k_dim = self.v_dim = None

    def trim_to(self, length: int) -> int:
        """``trim(offset - length)``. Raises InvalidArgumentError unless
        ``0 <= length <= offset``."""
        length = _check_int("trim_to", "len", length)
        if length < 0 or length > self.offset:
            raise InvalidArgumentError(
                f"trim_to: len must satisfy 0 <= len <= offset ({self.offset}), got {length}"
            )
        return self.trim(self.offset - length)

    def trim_front_keep_sink(self, n: int, keep: int = 0) -> int:
        """Not defined in the Turbo modes: returns 0 and changes nothing
        (kvspec.spec.dense.supports_front_trim). Raises InvalidArgumentError for
        non-integer arguments."""
        _check_int("trim_front", "n", n)
        _check_int("trim_front", "keep", keep)
        return 0

    def trim_front(self, n: int) -> int:
        return self.trim_front_keep_sink(n)

    # -- snapshot, restore, detach, install ---------------------------------
    def __copy__(self) -> Any:
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.store = _shared(self.store)
        return new

    def __deepcopy__(self, memo: dict) -> Any:
        """A copy sharing the arrays' memory (a deep copy of an mx.array is
        a new handle to it) and the counters by value. Safe because every
        write copies: neither cache can write into the other's rows."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.store = copy.deepcopy(self.store, memo)
        return new

    def _holder(self, cls: type) -> TurboSnapshot:
        return cls(self.mode, self.store, self.offset, self.live_start, self.cold_offset, self.dtype,
                   self.k_dim, self.v_dim, self._unpack)

    def snapshot(self) -> TurboSnapshot:
        """A prompt-cache snapshot sharing the arrays (O(1), no copy)."""
        snap = self._holder(TurboSnapshot)
        snap.store = _shared(self.store)
        return snap

    def _check_holder(self, op: str, h: Any) -> None:
        """Refuse a malformed snapshot/handle (wrong type or mode, counters
        out of range, arrays of the wrong rank, dtype or width, sidecars out
        of lockstep) with InvalidArgumentError naming the field."""
        if not isinstance(h, TurboSnapshot):
            raise InvalidArgumentError(f"{op}: expected a TurboSnapshot, got {type(h).__name__}")
        if h.mode != self.mode:
            raise InvalidArgumentError(f"{op}: mode must be {self.mode!r}, got {h.mode!r}")
        for name in ("offset", "live_start", "cold_offset"):
            _check_int(op, name, getattr(h, name))
        if h.live_start != 0:
            raise InvalidArgumentError(f"{op}: live_start must be 0 in mode {self.mode}, got {h.live_start}")
        if h.offset < 0:
            raise InvalidArgumentError(f"{op}: offset must be >= 0, got {h.offset}")
        if h.store is None:
            if h.offset != 0:
                raise InvalidArgumentError(f"{op}: live_len {h.offset} > 0 but no tensors")
            return
        check_store(op, self.mode, h.store, h.offset, h.cold_offset, h.dtype, h.k_dim, h.v_dim)

    def _adopt(self, h: TurboSnapshot) -> None:
        self.store = _shared(h.store)
        self.offset, self.live_start, self.cold_offset = h.offset, h.live_start, h.cold_offset
        self.dtype, self.k_dim, self.v_dim = h.dtype, h.k_dim, h.v_dim
        if self.store is None:
            self._forget_layout()

    def restore(self, snapshot: TurboSnapshot) -> None:
        """Adopt a snapshot's arrays and window (shared; the next write
        copies, as every write does). Raises InvalidArgumentError for a
        malformed snapshot."""
        self._check_holder("restore", snapshot)
        self._adopt(snapshot)

    def detach(self) -> TurboHandle:
        """Move every array into a detached handle; the cache becomes empty."""
        handle = self._holder(TurboHandle)
        self._reset()
        return handle  # type: ignore[return-value]

    def install(self, handle: TurboHandle) -> None:
        """Install a detached handle into this empty cache; the handle is
        consumed. Raises StateError when the cache is not empty or the handle
        was installed already, InvalidArgumentError for a malformed handle."""
        if not isinstance(handle, TurboHandle):
            raise InvalidArgumentError(f"install: expected a TurboHandle, got {type(handle).__name__}")
        if handle.consumed:
            raise StateError("install: the handle was already installed")
        if not self.empty() or self.offset != 0:
            raise StateError(f"install: requires an empty cache, got offset={self.offset}, live_len={self.live_len}")
        self._check_holder("install", handle)
        self._adopt(handle)
        handle.store, handle.offset, handle.cold_offset = None, 0, 0
        handle.consumed = True

    # -- mlx-lm cache protocol ---------------------------------------------
    def state_names(self) -> tuple[str, ...]:
        """Names of the arrays ``state`` holds, in order."""
        return tuple(sorted(self.store)) if self.store is not None else ()

    @property
    def state(self) -> tuple[mx.array, ...]:
        """The live arrays, sorted by name (see :meth:`state_names`); K's
        buffer is cut to the live rows. Empty when the cache is empty.
        Refused to mlx-lm's ``save_prompt_cache``
        (kvspec.impl.dense.refuse_foreign_save)."""
        refuse_foreign_save(self)
        if self.store is None:
            return ()
        # Delegated's cold and hot arrays hold exactly their rows already
        names = ("keys",) if self.mode == DELEGATED else tuple(self.store)
        cut = _cut(self.store, names, self.live_len)
        assert cut is not None
        return tuple(cut[k] for k in sorted(cut))

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(mode, step, offset, cold_offset, dtype, k_dim, v_dim, <names>)``
        plus, in Delegated, ``hot_threshold`` and ``fold_block``; ``names`` is
        a comma-separated list of the arrays in ``state``."""
        dtype = "" if self.dtype is None else str(self.dtype).removeprefix("mlx.core.")
        out = (self.mode, str(self.step), str(self.offset), str(self.cold_offset), dtype,
               str(self.k_dim or 0), str(self.v_dim or 0), ",".join(self.state_names()))
        return out + self._extra_meta()

    def _extra_meta(self) -> tuple[str, ...]:
        return ()

    @classmethod
    def from_state(cls, state: tuple[mx.array, ...], meta_state: tuple[str, ...], op: str = "from_state") -> Any:
        """Rebuild a cache from ``state`` and ``meta_state`` (as written by
        the properties of the same names), an instance of ``cls`` (a
        subclass's ``from_state`` builds the subclass). Raises
        InvalidArgumentError for a malformed meta_state or arrays that do not
        fit it."""
        if not isinstance(meta_state, (tuple, list)) or len(meta_state) < 8:
            raise InvalidArgumentError(f"{op}: meta_state must have at least 8 fields, got {meta_state!r}")
        mode = meta_state[0]
        try:
            step, offset, cold_offset, k_dim, v_dim = (int(meta_state[i]) for i in (1, 2, 3, 5, 6))
            extra = [int(x) for x in meta_state[8:]]
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"{op}: meta_state must hold integers, got {meta_state!r}") from None
        obj = make_cache(mode, step=step, **dict(zip(("hot_threshold", "fold_block"), extra)))
        if not isinstance(obj, cls):
            if not issubclass(cls, type(obj)):
                raise InvalidArgumentError(f"{op}: mode {mode!r} is not a mode of {cls.__name__}")
            obj.__class__ = cls  # a subclass's from_state builds the subclass
        names = tuple(x for x in meta_state[7].split(",") if x)
        if not isinstance(state, (tuple, list)) or len(state) != len(names):
            got = f"{len(state)} arrays" if isinstance(state, (tuple, list)) else type(state).__name__
            raise InvalidArgumentError(f"{op}: state must hold {len(names)} arrays {names}, got {got}")
        dtype = getattr(mx, meta_state[4], None) if meta_state[4] else None
        store = dict(zip(names, state)) if names else None
        holder = TurboSnapshot(mode, store, offset, 0, cold_offset, dtype, k_dim or None, v_dim or None)
        obj._check_holder(op, holder)
        obj._adopt(holder)
        return obj

    def is_trimmable(self) -> bool:
        return True

    def size(self) -> int:
        return self.offset

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> Any:
        """mlx-lm's ``kv_bits`` hook: a Turbo cache is quantized already
        (``quant_bits`` bits: 4 for the turbo4 modes, 3 for turbo3asym), so
        it returns ``self`` (``group_size`` does not apply: Turbo quantizes
        whole rotated rows). For ``bits`` other than ``quant_bits`` it warns
        once per cache (UserWarning) that the layer keeps its Turbo codes
        (re-quantizing them would lose rows): raising would fail late, as
        mlx-lm calls this hook only once the offset reaches
        ``quantized_kv_start`` (docs/mlx-lm.md, "Quantized caches").
        Raises InvalidArgumentError for a non-integer ``bits`` or
        ``group_size``."""
        bits = _check_int("to_quantized", "bits", bits)
        _check_int("to_quantized", "group_size", group_size)
        if bits != self.quant_bits and not self.__dict__.get("_quantize_warned"):
            self._quantize_warned = True
            warnings.warn(
                f"to_quantized(bits={bits}): this {type(self).__name__} stores mode {self.mode!r} "
                f"({self.quant_bits}-bit codes) and keeps them (build the layer with mode='fp16' to take kv_bits; "
                "reported once per cache)", UserWarning, stacklevel=2,
            )
        return self

    def empty(self) -> bool:
        return self.store is None

    @property
    def nbytes(self) -> int:
        return 0 if self.store is None else sum(a.nbytes for a in self.store.values())

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        """As :meth:`kvspec.impl.dense.KVCache.make_mask`."""
        return KVCache.make_mask(self, N, window_size, return_array)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(mode={self.mode}, offset={self.offset}, cold_offset={self.cold_offset}, "
                f"capacity={self.capacity})")


def _expected_arrays(mode: str, k_dim: int, v_dim: int) -> dict[str, tuple[mx.Dtype | None, int]]:
    """name -> (dtype, last dim) of every array a non-empty store of ``mode``
    may hold (dtype None: the cache's float dtype)."""
    bits, quant_k = _LAYOUT[mode]
    out: dict[str, tuple[mx.Dtype | None, int]] = {}
    if quant_k:
        out.update({"k_packed": (mx.uint8, tq.packed_width(k_dim, bits)), "k_norm": (mx.float32, 1),
                    "k_rescale": (mx.float32, 1)})
    else:
        out["keys"] = (None, k_dim)
    v = "cold_" if mode == DELEGATED else "v_"
    out.update({v + "packed": (mx.uint8, tq.packed_width(v_dim, bits)), v + "norm": (mx.float32, 1)})
    if bits == 4:
        out[v + "rescale"] = (mx.float32, 1)
    if mode == DELEGATED:
        out["hot"] = (None, v_dim)
    return out


def check_store(op: str, mode: str, store: Any, offset: int, cold_offset: int, dtype: Any,
                k_dim: Any, v_dim: Any) -> None:
    """Validate a holder's arrays against its counters (semantics.md 2,
    "Snapshot, restore"): the right names, rank 4, dtypes and widths, equal
    [B, H], and row counts: non-Delegated arrays all hold the same
    ``capacity >= offset`` rows; Delegated K ``>= offset`` rows, cold arrays
    exactly ``cold_offset``, hot exactly ``offset - cold_offset``.
    Raises InvalidArgumentError naming the field."""
    if not isinstance(store, dict):
        raise InvalidArgumentError(f"{op}: arrays must be a dict of name -> mx.array, got {type(store).__name__}")
    # `None in _FLOATS` raises TypeError in MLX (Dtype.__eq__ takes a Dtype only)
    if not isinstance(dtype, mx.Dtype) or dtype not in _FLOATS:
        raise InvalidArgumentError(f"{op}: dtype must be one of float16, bfloat16, float32, got {dtype!r}")
    for name, value in (("k_dim", k_dim), ("v_dim", v_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{op}: {name} must be a positive integer, got {value!r}")
    bits, quant_k = _LAYOUT[mode]
    tq.check_head_dim("values", v_dim, bits)
    if quant_k:
        tq.check_head_dim("keys", k_dim, bits)
    if mode == DELEGATED and not 0 <= cold_offset <= offset:
        raise InvalidArgumentError(
            f"{op}: cold_offset must satisfy 0 <= cold_offset <= offset ({offset}), got {cold_offset}"
        )
    if mode != DELEGATED and cold_offset != 0:
        raise InvalidArgumentError(f"{op}: cold_offset must be 0 in mode {mode}, got {cold_offset}")
    want = _expected_arrays(mode, k_dim, v_dim)
    if mode == DELEGATED:
        if cold_offset == 0:
            want = {k: v for k, v in want.items() if not k.startswith("cold_")}
        if offset == cold_offset:
            want.pop("hot")
    if set(store) != set(want):
        raise InvalidArgumentError(f"{op}: arrays must be {sorted(want)}, got {sorted(store)}")
    bh = None
    for name, (dt, last) in want.items():
        a = store[name]
        _check_tensor(op, name, a)
        dt = dtype if dt is None else dt
        if a.dtype != dt or int(a.shape[3]) != last:
            raise InvalidArgumentError(
                f"{op}: {name} must be {dt} with last dim {last}, got {a.dtype} {tuple(a.shape)}"
            )
        if bh is None:
            bh = tuple(a.shape[:2])
        elif tuple(a.shape[:2]) != bh:
            raise InvalidArgumentError(f"{op}: {name} must share [B, H] = {bh}, got {tuple(a.shape)}")
    rows = {k: int(a.shape[SEQ_AXIS]) for k, a in store.items()}
    if mode == DELEGATED:
        need = {k: cold_offset if k.startswith("cold_") else offset - cold_offset for k in rows if k != "keys"}
        bad = {k: r for k, r in rows.items() if k in need and r != need[k]}
        if bad or rows["keys"] < offset:
            raise InvalidArgumentError(
                f"{op}: rows out of step: cold arrays need cold_offset={cold_offset}, hot needs "
                f"{offset - cold_offset}, keys at least offset={offset}; got {rows}"
            )
        return
    if len(set(rows.values())) != 1 or next(iter(rows.values())) < offset:
        raise InvalidArgumentError(
            f"{op}: every array and sidecar must hold the same capacity >= offset ({offset}) rows, got {rows}"
        )


class TurboKVCache(_TurboBase):
    """Dense cache in mode ``turbo4asym``, ``turbo4`` or ``turbo3asym``.

    Args:
        mode: one of :data:`TURBO_MODES`.
        step: growth granularity in rows (>= 1); the regrow rule of
            kvspec.spec.dense applies to every buffer and sidecar at once.
        inplace: accepted for a uniform factory signature; ignored (Turbo
            writes always copy).

    Raises UnsupportedOperationError for another mode, InvalidArgumentError
    for a bad step.
    """

    def __init__(self, mode: str = "turbo4asym", step: int = 256, inplace: bool | None = None):
        if mode not in TURBO_MODES:
            raise UnsupportedOperationError(f"TurboKVCache: mode must be one of {TURBO_MODES}, got {mode!r}")
        super().__init__(mode, step)

    def _appended(self, keys: mx.array, values: mx.array, n: int) -> tuple[Store, int]:
        """Regrow rule (kvspec.spec.dense.regrow_needed/regrow_capacity) and a
        copying write of the encoded rows at ``[prev, prev + n)`` into every
        array."""
        rows = {**self._encode_keys(keys), **_as_store(self._quantize(values, tq.V_SEED), "v_")}
        prev = self.live_len
        old = self.store
        if old is None or prev + n > self.capacity:
            extra = regrow_capacity(prev, n, self.step) - prev - n
            out = {}
            for k, r in rows.items():
                pad = mx.zeros((*r.shape[:2], extra, r.shape[3]), dtype=r.dtype)
                head = [] if old is None else [old[k][:, :, :prev, :]]
                out[k] = mx.concatenate([*head, r, pad], axis=SEQ_AXIS)
            return out, 0
        return {k: write_rows_copy(old[k], r, prev) for k, r in rows.items()}, 0

    def gather_positions(self, positions: list[int]) -> int:
        """Keep exactly the listed live rows, in order; ``offset =
        len(positions)``; every array cut to exactly those rows. The identity
        list is a no-op. Returns the new live_len. Raises
        InvalidArgumentError unless the positions are non-empty, strictly
        increasing and inside ``[0, live_len)`` (kvspec.spec.dense.gather_positions)."""
        positions = [_check_int("gather_positions", "positions", p)
                     for p in _check_list("gather_positions", "positions", positions)]
        _check_index_list("gather_positions", "positions", positions, 0, self.live_len)
        if positions == list(range(self.live_len)):
            return self.live_len
        assert self.store is not None
        idx = mx.array(positions)
        self.store = {k: mx.take(a, idx, axis=SEQ_AXIS) for k, a in self.store.items()}
        self.offset = len(positions)
        return self.live_len

    def gather_within_tail(self, tail_len: int, kept: list[int]) -> int:
        """Of the last ``tail_len`` rows keep ``kept`` (indices into the
        tail), in order; every array cut to exactly the live rows. Returns
        the new live_len. Raises InvalidArgumentError unless ``0 < tail_len
        <= live_len`` and kept is non-empty, strictly increasing and inside
        ``[0, tail_len)`` (kvspec.spec.dense.gather_within_tail)."""
        tail_len = _check_int("gather_within_tail", "tail_len", tail_len)
        if tail_len <= 0 or tail_len > self.live_len:
            raise InvalidArgumentError(
                f"gather_within_tail: tail_len must satisfy 0 < tail_len <= live_len ({self.live_len}), got {tail_len}"
            )
        kept = [_check_int("gather_within_tail", "kept", k)
                for k in _check_list("gather_within_tail", "kept", kept)]
        _check_index_list("gather_within_tail", "kept", kept, 0, tail_len)
        assert self.store is not None
        start = self.live_len - tail_len
        idx = mx.array(list(range(start)) + [start + k for k in kept])
        self.store = {k: mx.take(a, idx, axis=SEQ_AXIS) for k, a in self.store.items()}
        self.offset -= tail_len - len(kept)
        return self.live_len


class DelegatedKVCache(_TurboBase):
    """Dense cache in mode ``turbo4delegated``: K in the incoming float
    dtype (capacity grows by ``step``), V as a cold 4-bit prefix of
    ``cold_offset`` rows plus a hot float part (kvspec.spec.turbo).

    Fold schedule (kvspec.spec.turbo.fold_schedule): at a single-row append when
    ``cold_offset == 0`` and the cache holds rows, every held row folds cold
    (the handoff after a prefill), then the new row is written hot; after
    every append, while hot exceeds ``hot_threshold`` the oldest
    ``min(fold_block, hot)`` rows fold cold.

    Args:
        step: K's growth granularity (>= 1).
        hot_threshold: hot rows allowed before folding (>= 0; default 256).
        fold_block: rows per fold (>= 1; default 128).
        inplace: ignored (writes always copy).
    """

    def __init__(self, mode: str = DELEGATED, step: int = 256, inplace: bool | None = None,
                 hot_threshold: int = 256, fold_block: int = 128):
        if mode != DELEGATED:
            raise UnsupportedOperationError(f"DelegatedKVCache: mode must be {DELEGATED!r}, got {mode!r}")
        hot_threshold = _check_int("DelegatedKVCache", "hot_threshold", hot_threshold)
        fold_block = _check_int("DelegatedKVCache", "fold_block", fold_block)
        if hot_threshold < 0:
            raise InvalidArgumentError(f"DelegatedKVCache: hot_threshold must be >= 0, got {hot_threshold}")
        if fold_block < 1:
            raise InvalidArgumentError(f"DelegatedKVCache: fold_block must be >= 1, got {fold_block}")
        self.hot_threshold, self.fold_block = hot_threshold, fold_block
        super().__init__(mode, step)

    @property
    def hot_len(self) -> int:
        """Live rows not yet folded cold (unquantized V), ``live_len - cold_offset``. Rule:
        ``kvspec.spec.turbo.fold_schedule`` (semantics.md 2, "Delegated fold schedule")."""
        return self.live_len - self.cold_offset

    def _extra_meta(self) -> tuple[str, ...]:
        return (str(self.hot_threshold), str(self.fold_block))

    def _appended(self, keys: mx.array, values: mx.array, n: int) -> tuple[Store, int]:
        """K: regrow rule and a copying write. V: ``kvspec.spec.turbo.fold_schedule``
        says how many of the oldest hot rows (old ones, then new ones) fold
        cold; those are quantized (each row on its own) and appended to the
        cold arrays, the rest stay hot."""
        prev = self.live_len
        old = self.store
        out: Store = {}
        if old is None or prev + n > self.capacity:
            extra = regrow_capacity(prev, n, self.step) - prev - n
            pad = mx.zeros((*keys.shape[:2], extra, keys.shape[3]), dtype=keys.dtype)
            head = [] if old is None else [old["keys"][:, :, :prev, :]]
            out["keys"] = mx.concatenate([*head, keys, pad], axis=SEQ_AXIS)
        else:
            out["keys"] = write_rows_copy(old["keys"], keys, prev)
        hot_parts = ([old["hot"]] if old is not None and "hot" in old else []) + [values]
        hot = hot_parts[0] if len(hot_parts) == 1 else mx.concatenate(hot_parts, axis=SEQ_AXIS)
        folded = self._fold_count(prev, n)
        cold_offset = self.cold_offset + folded
        cold: Store = {k: a for k, a in (old or {}).items() if k.startswith("cold_")}
        if folded:
            new = _as_store(self._quantize(hot[:, :, :folded, :], tq.V_SEED), "cold_")
            cold = {k: mx.concatenate([cold[k], a], axis=SEQ_AXIS) if k in cold else a for k, a in new.items()}
        out.update(cold)
        if int(hot.shape[SEQ_AXIS]) > folded:
            out["hot"] = hot[:, :, folded:, :]
        return out, cold_offset

    def _fold_count(self, prev: int, n: int) -> int:
        """Rows that fold cold at an append of ``n`` rows to ``prev`` live
        rows: the rule of kvspec.spec.turbo.fold_schedule (a loop of block folds
        there), in closed form here so that the two are written apart. At a
        handoff (``n == 1``, nothing cold, rows held) every held row folds;
        then, with ``hot`` rows hot, ``k = ceil((hot - T) / B)`` blocks
        fold when ``hot > T``, the last one possibly short:
        ``min(k * B, hot)`` rows."""
        cold, threshold, block = self.cold_offset, self.hot_threshold, self.fold_block
        handoff = prev - cold if (n == 1 and cold == 0 and prev > 0) else 0
        hot = prev - cold - handoff + n
        if hot <= threshold:
            return handoff
        blocks = -(-(hot - threshold) // block)
        return handoff + min(blocks * block, hot)

    def gather_positions(self, positions: list[int]) -> int:
        """Refused in Turbo4Delegated (UnsupportedOperationError), the
        identity list included; nothing changes.

        Rule: ``kvspec.spec.dense.supports_gather`` (semantics.md 2, "Delegated gathers")."""
        raise UnsupportedOperationError(f"gather_positions: not supported in mode {self.mode}")

    def gather_within_tail(self, tail_len: int, kept: list[int]) -> int:
        """Refused in Turbo4Delegated (UnsupportedOperationError).

        Rule: ``kvspec.spec.dense.supports_gather`` (semantics.md 2, "Delegated gathers")."""
        raise UnsupportedOperationError(f"gather_within_tail: not supported in mode {self.mode}")


def make_cache(mode: str = "fp16", step: int = 256, inplace: bool | None = None, **kw: Any) -> Any:
    """A dense-kind cache for any mode of semantics.md 2: ``fp16``/``int8``
    -> :class:`kvspec.impl.dense.KVCache`; ``turbo4asym``/``turbo4``/``turbo3asym``
    -> :class:`TurboKVCache`; ``turbo4delegated`` -> :class:`DelegatedKVCache`
    (``hot_threshold``, ``fold_block`` keywords). Raises
    UnsupportedOperationError for an unknown mode, InvalidArgumentError for
    keywords the mode does not take."""
    if mode == DELEGATED:
        return DelegatedKVCache(mode, step=step, inplace=inplace, **kw)
    if kw:
        raise InvalidArgumentError(f"make_cache: {sorted(kw)} apply to mode {DELEGATED} only, got mode {mode!r}")
    if mode in TURBO_MODES:
        return TurboKVCache(mode, step=step, inplace=inplace)
    return KVCache(mode=mode, step=step, inplace=inplace)


__all__ = ["DELEGATED", "TURBO_MODES", "DelegatedKVCache", "TurboHandle", "TurboKVCache", "TurboSnapshot",
           "make_cache"]
