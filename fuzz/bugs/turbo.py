"""Injected bugs of the Turbo modes (``kvspec.impl.turbo``): kvtrace kind
``dense``, modes ``turbo4asym``, ``turbo4``, ``turbo3asym``,
``turbo4delegated``.

Each entry is a subclass of ``TurboKVCache`` or ``DelegatedKVCache`` that
breaks one rule of ``kvspec.spec.turbo`` / ``kvspec.spec.dense`` (the clause it names);
see ``fuzz/bugs/__init__.py``. The harness (``fuzz/turbo.py``) must catch
every one from every seed.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvspec.fuzz.bugs import InjectedBug
from kvspec.impl import turbo_quant as tq
from kvspec.impl.dense import _check_rows, write_rows_inplace
from kvspec.impl.turbo import DelegatedKVCache, Store, TurboKVCache, _check_int, _cut
from kvspec.spec.turbo import check_head_dim


class LogicalTrimTurbo(TurboKVCache):
    """A Turbo trim that rewinds logically, as Fp16/Int8 do: only the offset
    moves and every buffer keeps its capacity and stale rows."""

    def trim(self, n: int) -> int:
        n = max(0, min(_check_int("trim", "n", n), self.live_len))
        self.offset -= n
        if self.live_len == 0:
            self.store = None
            self._forget_layout()
        return n


class SidecarNotTrimmed(TurboKVCache):
    """A physical trim that cuts the packed indices and K but forgets the
    norm and rescale sidecars: they keep their rows, out of lockstep."""

    def trim(self, n: int) -> int:
        n = max(0, min(_check_int("trim", "n", n), self.live_len))
        if n == 0:
            return 0
        self.offset -= n
        if self.live_len == 0:
            self.store = None
            self._forget_layout()
            return n
        assert self.store is not None
        names = tuple(k for k in self.store if not k.endswith(("_norm", "_rescale")))
        self.store = _cut(self.store, names, self.live_len)
        return n


def _pack_truncating(idx: mx.array, bits: int) -> mx.array:
    """A 3-bit packer that writes ``3 * d // 8`` bytes: whole 24-bit words
    only, the indices of a partial last word silently dropped."""
    if bits != 3:
        return tq.pack_indices(idx, bits)
    whole = int(idx.shape[-1]) // 8 * 8
    return tq.pack_indices(idx[..., :whole], 3)


def _unpack_padding(packed: mx.array, bits: int, head_dim: int) -> mx.array:
    if bits != 3:
        return tq.unpack_indices(packed, bits, head_dim)
    whole = head_dim // 8 * 8
    got = tq.unpack_indices(packed, 3, whole)
    pad = mx.zeros((*got.shape[:-1], head_dim - whole), dtype=got.dtype)
    return mx.concatenate([got, pad], axis=-1)


class Pack3Truncates(TurboKVCache):
    """3-bit packing that accepts any power-of-two head_dim (no multiple-of-8
    check) and packs ``3 * d // 8`` bytes: at head_dim 4 that is one byte for
    twelve bits of indices, so coordinates are silently lost."""

    _pack = staticmethod(_pack_truncating)
    _unpack = staticmethod(_unpack_padding)

    def _check_new_rows(self, keys: Any, values: Any) -> int:
        n = _check_rows("append", keys, values)
        check_head_dim("values", int(values.shape[3]), 4)  # the power-of-two rule only
        return n


def _trim_cold_first(cache: DelegatedKVCache, n: int) -> None:
    """Cut ``n`` rows taking the cold rows first (the bug)."""
    live = cache.live_len
    keep = live - n
    store = cache.store
    assert store is not None
    from_cold = min(n, cache.cold_offset)
    cold = cache.cold_offset - from_cold
    hot = live - cache.cold_offset - (n - from_cold)
    out: Store = {"keys": store["keys"][:, :, :keep, :]}
    if cold:
        out.update({k: a[:, :, :cold, :] for k, a in store.items() if k.startswith("cold_")})
    if hot:
        out["hot"] = store["hot"][:, :, :hot, :]
    cache.store, cache.cold_offset = out, cold


class DelegatedTrimColdFirst(DelegatedKVCache):
    """A Delegated trim that removes cold rows before hot ones: the rows it
    drops are the oldest quantized ones, not the newest."""

    def trim(self, n: int) -> int:
        n = max(0, min(_check_int("trim", "n", n), self.live_len))
        if n == 0:
            return 0
        if n == self.live_len:
            self.store, self.cold_offset = None, 0
            self._forget_layout()
        else:
            _trim_cold_first(self, n)
        self.offset -= n
        return n


class FoldOneTooMany(DelegatedKVCache):
    """A fold that moves one hot row more than the schedule says (when one
    is left to move)."""

    def _fold_count(self, prev: int, n: int) -> int:
        f = super()._fold_count(prev, n)
        return min(f + 1, prev - self.cold_offset + n) if f else f


class FoldOneTooFew(DelegatedKVCache):
    """A fold that moves one hot row fewer than the schedule says."""

    def _fold_count(self, prev: int, n: int) -> int:
        return max(super()._fold_count(prev, n) - 1, 0)


class Turbo4SharedSigns(TurboKVCache):
    """Turbo4 rotating K with V's sign vectors (the same seed for both)."""

    def _encode_keys(self, keys: mx.array) -> Store:
        if self.quant_k:
            q = self._quantize(keys, tq.V_SEED)
            out = {"k_packed": q.packed, "k_norm": q.norm}
            if q.rescale is not None:
                out["k_rescale"] = q.rescale
            return out
        return super()._encode_keys(keys)


class TurboWriteInPlace(TurboKVCache):
    """A Turbo append that writes into the existing buffers' memory when the
    rows fit (as an Fp16 decode may), without an ownership check: a snapshot
    or held window sharing the buffer sees the write. It reports the write
    as in place (``last_write_inplace``), as an engine observing its write
    path would; the catalog's variant hides that, leaving isolation alone to
    catch it."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        fits = self.store is not None and self.live_len + int(keys.shape[2]) <= self.capacity
        out = super().update_and_fetch(keys, values)
        self.last_write_inplace = fits
        return out

    def _appended(self, keys: mx.array, values: mx.array, n: int) -> tuple[Store, int]:
        prev = self.live_len
        if self.store is None or prev + n > self.capacity:
            return super()._appended(keys, values, n)
        rows = {**self._encode_keys(keys)}
        q = self._quantize(values, tq.V_SEED)
        rows.update({"v_packed": q.packed, "v_norm": q.norm})
        if q.rescale is not None:
            rows["v_rescale"] = q.rescale
        mx.eval(*rows.values())
        for k, r in rows.items():
            write_rows_inplace(self.store[k], r, prev)
        return dict(self.store), 0


def _pack_high_first(idx: mx.array, bits: int) -> mx.array:
    """A 4-bit packer that puts the even coordinate in the high nibble."""
    if bits != 4:
        return tq.pack_indices(idx, bits)
    d = int(idx.shape[-1])
    q = idx.astype(mx.uint8).reshape(*idx.shape[:-1], d // 2, 2)
    return mx.left_shift(q[..., 0], 4) | q[..., 1]


def _unpack_high_first(packed: mx.array, bits: int, head_dim: int) -> mx.array:
    if bits != 4:
        return tq.unpack_indices(packed, bits, head_dim)
    p = packed.astype(mx.uint32)
    return mx.stack([mx.right_shift(p, 4), p & 0xF], axis=-1).reshape(*packed.shape[:-1], head_dim)


class NibbleOrderSwapped(TurboKVCache):
    """4-bit packing with the nibbles the other way round (even coordinate
    high), unpacked the same way: every window the cache hands back is
    right, but its stored rows (``state``, prompt-cache files) are not the
    format, so another reader of them gets the coordinates pairwise
    swapped. The byte oracle, which reads rows back through a quantizer,
    cannot see it; the reference's check of the stored bytes does."""

    _pack = staticmethod(_pack_high_first)
    _unpack = staticmethod(_unpack_high_first)


class NormScaledWrong(TurboKVCache):
    """The stored norm sidecar is the norm of ``x / max|x|`` (the scaled
    row the sum of squares is taken on), the peak's factor forgotten; the
    rescale is computed from the true norm. At 4 bits the window (which
    dequantizes by the rescale) stays right; the stored norm is wrong by
    ``max|x|`` in every nonzero row."""

    def _quantize(self, x: mx.array, seed: int) -> tq.Quantized:
        q = super()._quantize(x, seed)
        peak = mx.max(mx.abs(x.astype(mx.float32)), axis=-1, keepdims=True)
        return tq.Quantized(q.packed, q.norm / mx.where(peak == 0, 1, peak), q.rescale)


class SaveDropsFoldBlock(DelegatedKVCache):
    """A Delegated ``meta_state`` without ``fold_block`` (hot_threshold
    only); ``from_state`` takes a missing field as its default (128), so a
    file saved and loaded by this class round-trips its own counters (the
    reloaded meta_state equals the saved one: both lack the field) while
    the loaded cache folds in blocks of 128, not the saved cache's."""

    def _extra_meta(self) -> tuple[str, ...]:
        return (str(self.hot_threshold),)


CLAUSE_TRIM = "kvspec.spec.dense.trim / kvspec.spec.turbo.array_rows (Turbo trims are physical: every buffer cut to the live rows)"

BUGS: tuple[InjectedBug, ...] = (
    InjectedBug(
        "turbo_logical_trim", CLAUSE_TRIM, "seed 000: the Turbo modes keep the physical trim",
        "dense", ("turbo4asym", "turbo3asym"), "TurboKVCache.trim",
        "a Turbo trim rewinds logically: capacity and stale rows stay",
        {"dense": LogicalTrimTurbo},
    ),
    InjectedBug(
        "turbo_sidecar_not_trimmed", "kvspec.spec.turbo.array_rows (every sidecar cut in lockstep)",
        "semantics.md 2 'Trim family': every buffer and sidecar cut to exactly the live rows",
        "dense", ("turbo4asym",), "TurboKVCache.trim",
        "a trim cuts the packed indices but not the norm/rescale sidecars",
        {"dense": SidecarNotTrimmed},
    ),
    InjectedBug(
        "turbo3_pack_truncates", "kvspec.spec.turbo.check_head_dim (3-bit needs head_dim % 8 == 0)",
        "semantics.md 2 'Quantized storage': a size truncation in 3-bit packing is a known bug class",
        "dense", ("turbo3asym",), "TurboKVCache._check_new_rows, _pack, _unpack",
        "3-bit packing accepts head_dim 4 and packs 3 * 4 // 8 = 1 byte for 12 bits",
        {"dense": Pack3Truncates},
    ),
    InjectedBug(
        "delegated_trim_cold_first", "kvspec.spec.turbo.trim_split (hot rows first, then cold)",
        "semantics.md 2 'Trim family': Turbo4Delegated trims the hot part first",
        "dense", ("turbo4delegated",), "DelegatedKVCache.trim",
        "a Delegated trim removes cold rows before hot ones",
        {"dense": DelegatedTrimColdFirst},
    ),
    InjectedBug(
        "delegated_fold_one_too_many", "kvspec.spec.turbo.fold_schedule (min(fold_block, hot) rows per fold)",
        "semantics.md 2 'Quantized storage': Turbo4Delegated fold schedule",
        "dense", ("turbo4delegated",), "DelegatedKVCache._fold_count",
        "a fold moves one row more than the schedule",
        {"dense": FoldOneTooMany},
    ),
    InjectedBug(
        "delegated_fold_one_too_few", "kvspec.spec.turbo.fold_schedule (min(fold_block, hot) rows per fold)",
        "semantics.md 2 'Quantized storage': Turbo4Delegated fold schedule",
        "dense", ("turbo4delegated",), "DelegatedKVCache._fold_count",
        "a fold moves one row fewer than the schedule",
        {"dense": FoldOneTooFew},
    ),
    InjectedBug(
        "turbo4_shared_signs", "semantics.md 2, what is quantized (Turbo4 quantizes K with its own pair of sign vectors)",
        "semantics.md 2 'Quantized storage' (Turbo4: K with a different seed)",
        "dense", ("turbo4",), "TurboKVCache._encode_keys",
        "Turbo4 rotates K with V's sign vectors",
        {"dense": Turbo4SharedSigns},
    ),
    InjectedBug(
        "turbo_write_in_place", "kvspec.spec.dense.inplace_write_allowed (Turbo writes always copy)",
        "semantics.md 2 'The two write paths': Int8 and Turbo modes always copy",
        "dense", ("turbo4asym", "turbo4"), "TurboKVCache._appended",
        "a Turbo append writes into the shared buffers when the rows fit",
        {"dense": TurboWriteInPlace},
        variants=(("isolation only, step 8", {"step": 8}, False),),
    ),
    InjectedBug(
        "turbo_nibble_order", "semantics.md 2, Turbo row storage (4 bits: the even coordinate in the low nibble)",
        "a packer and unpacker written the same wrong way round agree with each other",
        "dense", ("turbo4asym", "turbo4"), "TurboKVCache._pack, _unpack",
        "4-bit indices packed even coordinate high, unpacked the same way: right windows, wrong stored rows",
        {"dense": NibbleOrderSwapped},
    ),
    InjectedBug(
        "turbo_norm_scaled", "semantics.md 2, Turbo row storage (the norm sidecar is the row's length)",
        "the sum of squares taken on x / max|x| for range, its factor forgotten",
        "dense", ("turbo4asym", "turbo4"), "TurboKVCache._quantize",
        "the stored norm is the row's length over max|x|; the rescale (which 4-bit windows use) stays right",
        {"dense": NormScaledWrong},
    ),
    InjectedBug(
        "delegated_save_drops_fold_block", "kvspec.spec.dense.w_reload (a load keeps every setting of the saved cache)",
        "a meta_state field dropped on both sides of a prompt-cache file round-trips its own counters",
        "dense", ("turbo4delegated",), "DelegatedKVCache._extra_meta",
        "a Delegated save drops fold_block and its load takes the default: the loaded cache folds other blocks",
        {"dense": SaveDropsFoldBlock},
    ),
)
