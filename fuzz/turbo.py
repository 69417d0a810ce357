"""The Turbo modes' harness (kvtrace kind ``dense``, modes ``turbo4asym``,
``turbo4``, ``turbo3asym``, ``turbo4delegated``): the lockstep driver of
``kvspec.spec.turbo`` against ``kvspec.impl.turbo`` and its state machine.

Oracle (semantics.md 2, "Storage"): every fetched row is
byte-identical to the row of its token quantized and dequantized *on its
own* by the same quantizer (``kvspec.impl.turbo_quant.roundtrip``): V in every
Turbo mode, K too in Turbo4 (with K's sign vectors); in Delegated only the
first ``cold_offset`` rows of a view are quantized, the hot ones come back
exactly. Which rows are cold is the spec's prediction for that view (the
live cache, each snapshot and handle, the held window), so a fold of the
wrong rows shows up as bytes, and a wrong ``cold_offset`` as an observable.

That oracle is the implementation's own quantizer, so it cannot see a bug
the quantizer and the cache share. An independent one does
(:meth:`TurboLockstep.check_reference`, the NumPy reference of
``kvspec.fuzz.turbo_ref``): the first time a row is stored quantized, its stored
packed indices, norm and rescale are checked against the rule (the nibble
order, the norm's scaling, the rescale), and its values in the window the
append returned against the reference's dequantization, within the stated
tolerance. The machine draws the ``ranged`` rows (``kvspec.fuzz.rows``) as often
as the ordinary ones: tiny, huge (up to the dtype's largest value),
negative-zero and mixed-scale rows.

Observables after every op, besides the dense ones (offset, live_start,
live_len, capacity): ``cold_offset`` and the row count of every buffer and
sidecar (``kvspec.spec.turbo.array_rows``), so a sidecar that is not cut in
lockstep is caught even when the window it feeds stays right; and that a
save/load round trip (``from_state(state, meta_state)``) is a fixpoint of
meta_state and the state arrays.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvspec.fuzz import rows as rowgen
from kvspec.fuzz import turbo_ref
from kvspec.fuzz.dense import DenseMachine, DenseOps
from kvspec.fuzz.lockstep import Divergence, Lockstep
from kvspec.fuzz.machine import KV_HEADS, SMALL_STEPS
from kvspec.impl import turbo_quant as tq
from kvspec.impl.turbo import TurboHandle, TurboSnapshot, make_cache
from kvspec.spec import rows as portable_rows
from kvspec.spec import turbo as sturbo

TURBO_MODES = tuple(m.value for m in sturbo.TURBO_MODES)
DELEGATED = sturbo.Mode.TURBO4DELEGATED.value
#: hot_threshold and fold_block drawn by the machine: tiny, so folds,
#: handoffs and partial blocks all happen within a few appends
THRESHOLDS = st.integers(1, 6)
BLOCKS = st.integers(1, 6)


def _cache_kw(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg["mode"] != DELEGATED:
        return {}
    return {"hot_threshold": cfg.get("hot_threshold", sturbo.DEFAULT_HOT_THRESHOLD),
            "fold_block": cfg.get("fold_block", sturbo.DEFAULT_FOLD_BLOCK)}


class TurboLockstep(DenseOps, Lockstep):
    """Drives a ``kvspec.spec.turbo.TurboWorld`` and an ``kvspec.impl.turbo`` cache with
    the same ops. ``cache_factory(mode=, step=, inplace=, [hot_threshold=,
    fold_block=])`` builds the implementation under test (the injected-bug
    catalog passes a patched class)."""

    spec_module = sturbo
    snapshot_class = TurboSnapshot
    handle_class = TurboHandle
    #: memory sharing (data pointers) is not compared: Turbo writes always
    #: copy, so no holder can see a write whatever it shares; isolation and
    #: the in-place decision are compared instead
    check_sharing = False

    def __init__(self, cache: dict[str, Any], cache_factory: Any = make_cache):
        super().__init__(cache)
        self.mode = sturbo.Mode(cache["mode"])
        kw = _cache_kw(cache)
        _, _, dk, dv = self.shape
        self.world = sturbo.new_world(self.mode, cache["step"], head_dim=dv, k_head_dim=dk, **kw)
        self.prev_world = self.world
        self.cache = self.build(cache_factory, mode=cache["mode"], step=cache["step"], **kw)
        self._forms: dict[tuple[int, bool, bool], tuple[bytes, bytes]] = {}
        self._form_arrays: dict[tuple[int, bool, bool], tuple[np.ndarray, np.ndarray]] = {}
        self._window_forms: dict[tuple[tuple[int, ...], tuple[tuple[bool, bool], ...]], tuple[bytes, bytes]] = {}
        #: (token, stored array prefix) pairs the reference has checked
        self._checked: set[tuple[int, str]] = set()
        #: the view whose cold offset ``window_matches`` uses by default
        self._view = "cache"

    @classmethod
    def check_cache(cls, cache: dict[str, Any]) -> None:
        """Nothing to refuse up front: a head_dim the quantizer cannot take
        makes every append a refusal both sides must agree on."""

    # -- the oracle -------------------------------------------------------------
    def row_form(self, token: int, k_quant: bool, v_quant: bool) -> tuple[bytes, bytes]:
        """The bytes a reader must see for a token's K and V rows, each
        quantized and dequantized on its own where asked."""
        key = (token, k_quant, v_quant)
        got = self._forms.get(key)
        if got is None:
            self.row_forms([key])
            got = self._forms[key]
        return got

    def row_forms(self, keys: list[tuple[int, bool, bool]]) -> None:
        """:meth:`row_form` of every ``(token, k_quant, v_quant)`` of ``keys``
        not yet known, each row quantized on its own (one quantizer call per
        row, as one row at a time), read back in one MLX evaluation."""
        todo = [key for key in dict.fromkeys(keys) if key not in self._forms]
        if not todo:
            return
        # and the forms the next appends will ask for (the next tokens in
        # the forms asked for now), so that a decode loop's reads of them
        # share this evaluation instead of one each
        last = max(t for t, _, _ in todo)
        ahead = [(t, kq, vq) for t in range(last + 1, last + 1 + self.FORMS_AHEAD)
                 for kq, vq in dict.fromkeys((kq, vq) for _, kq, vq in todo)]
        todo += [key for key in ahead if key not in self._forms and (self.cfg.get("rows") != "portable"
                                                                     or key[0] < portable_rows.TOKEN_LIMIT)]
        bits = sturbo.bits_of(self.mode)
        lazy = []
        for token, k_quant, v_quant in todo:
            k, v = self.input_rows([token])
            if k_quant:
                k = tq.roundtrip(k, bits, tq.K_SEED)
            if v_quant:
                v = tq.roundtrip(v, bits, tq.V_SEED)
            lazy += [k, v]
        forms = rowgen.host_many(lazy)
        for j, key in enumerate(todo):
            hk, hv = forms[2 * j], forms[2 * j + 1]
            self._forms[key] = (hk.tobytes(), hv.tobytes())
            self._form_arrays[key] = (hk, hv)

    #: tokens past the last one asked for whose forms :meth:`row_forms` computes along
    FORMS_AHEAD = 8

    def window_form(self, tokens: tuple[int, ...], flags: tuple[tuple[bool, bool], ...]) -> tuple[bytes, bytes]:
        """The bytes of a whole window of ``tokens``' rows, row ``j`` in the
        form ``flags[j]`` (quantized K, quantized V) gives it: the rows of
        :meth:`row_form` concatenated in C order of ``[B, H, n, D]``, kept
        per window (a snapshot's recurs op after op)."""
        key = (tokens, flags)
        got = self._window_forms.get(key)
        if got is None:
            keys = [(t, kq, vq) for t, (kq, vq) in zip(tokens, flags)]
            self.row_forms(keys)
            ks = [self._form_arrays[k][0] for k in keys]
            vs = [self._form_arrays[k][1] for k in keys]
            got = (np.concatenate(ks, axis=2).tobytes(), np.concatenate(vs, axis=2).tobytes())
            if len(self._window_forms) > 4096:
                self._window_forms.clear()
            self._window_forms[key] = got
        return got

    def window_matches(self, tokens: tuple[int, ...], arrays: tuple[mx.array, mx.array] | None,
                       mode: str | None = None, view: str | None = None) -> bool:
        """The window holds ``tokens``' rows in the trace's dtype, each in the
        form the oracle gives for its place in ``view`` (default: the view
        being checked; ``mode`` is the base class's, one mode here)."""
        if arrays is None:
            return len(tokens) == 0
        if any(rowgen.dtype_name(a) != self.dtype for a in arrays):
            return False
        k, v = (self.host(a) for a in arrays)
        b, h, dk, dv = self.shape
        if k.shape != (b, h, len(tokens), dk) or v.shape != (b, h, len(tokens), dv):
            return False
        if not tokens:
            return True
        cold = sturbo.view_cold(self.world, view or self._view)
        flags = tuple((bool(kq), bool(vq)) for kq, vq in sturbo.quantized_rows(self.mode, len(tokens), cold))
        # one comparison of the whole window (tobytes() is C order whatever
        # the view's strides: row j is where row j of the expected rows is)
        ek, ev = self.window_form(tuple(tokens), flags)
        return k.tobytes() == ek and v.tobytes() == ev

    def identify(self, arrays: tuple[mx.array, mx.array] | None, mode: str | None = None) -> list[Any]:
        """Each row as ``token`` (quantized where the oracle quantizes),
        ``token~hot``/``token~cold`` when it has the other form, "zero" or "?"."""
        if arrays is None:
            return []
        k, v = (self.host(a) for a in arrays)
        out: list[Any] = []
        for j in range(k.shape[2]):
            pair = (k[:, :, j : j + 1, :].tobytes(), v[:, :, j : j + 1, :].tobytes())
            name: Any = "?"
            for (t, kq, vq), form in self._forms.items():
                if form == pair:
                    name = t if (kq, vq) == (sturbo.keys_quantized(self.mode), True) else f"{t}~{'cold' if vq else 'hot'}"
                    break
            if name == "?" and not k[:, :, j, :].any() and not v[:, :, j, :].any():
                name = "zero"
            out.append(name)
        return out

    # -- the comparisons, view by view --------------------------------------------
    def compare_append(self, index: int, op: dict[str, Any], s: Any, i: Any) -> None:
        if not self.window_matches(s.window, i, view="returned"):
            raise Divergence(index, op, "returned window differs", list(s.window), self.identify(i))
        if self.check_inplace and self.impl_last_inplace():
            raise Divergence(index, op, "in-place decision differs", "inplace=False (Turbo writes copy)",
                             "inplace=True")
        self.reached("copying writes")
        before = self.prev_world
        if self.mode is sturbo.Mode.TURBO4DELEGATED:
            moved = self.world.cold_offset - before.cold_offset
            if moved and sturbo.handoff_fold(before.cold_offset, before.cache.live_len, op["n"]):
                self.reached("handoff fold")
            elif moved:
                self.reached("block fold")
        if s.regrew and before.cache.buffer is not None:
            self.reached("regrow")
        self.check_reference(index, op, s.window, i)

    def check_reference(self, index: int, op: dict[str, Any], tokens: tuple[int, ...],
                        window: tuple[mx.array, mx.array]) -> None:
        """The independent oracle (``kvspec.fuzz.turbo_ref``): every row stored
        quantized for the first time (V's, Turbo4's K, Delegated's cold V)
        is checked in the cache's store (packed indices, norm, rescale) and
        in ``window``, the append's returned window of ``tokens``."""
        c, bits = self.cache, sturbo.bits_of(self.mode)
        store = c.store
        if store is None:
            return
        if self.mode is sturbo.Mode.TURBO4DELEGATED:
            plan = [("cold_", tq.V_SEED, "v", 1, tokens[: c.cold_offset])]
        else:
            plan = [("v_", tq.V_SEED, "v", 1, tokens)]
            if sturbo.keys_quantized(self.mode):
                plan.append(("k_", tq.K_SEED, "k", 0, tokens))
        b, h, dk, dv = self.shape
        for prefix, seed, which, at, toks in plan:
            todo = [j for j, t in enumerate(toks) if (t, prefix) not in self._checked]
            if not todo:
                continue
            d = dv if which == "v" else dk
            x = rowgen.rows([toks[j] for j in todo], which, b, h, d, self.dtype, self.wide_rows(),
                            self.cfg.get("rows", "numpy")).astype(np.float64)
            # the store as read after the op (prefetch evaluated it: no
            # round trip of its own), cut to the window's rows on the host
            got = [np.asarray(store[prefix + name])[:, :, : len(toks), :] if prefix + name in store else None
                   for name in ("packed", "norm", "rescale")]
            packed, norm, rescale = (None if a is None else a[:, :, todo, :] for a in got)
            self.reached("reference-checked rows")
            wrong = turbo_ref.check_stored(x, packed, norm, rescale, bits, seed)
            if wrong is None:
                values = self.host(window[at])[:, :, todo, :].astype(np.float64)
                idx = turbo_ref.unpack_rows(packed, bits, d)
                wrong = turbo_ref.check_values(x, idx, values, bits, seed, self.dtype)
            if wrong is not None:
                rows = [toks[j] for j in todo]
                raise Divergence(index, op, f"stored {which.upper()} rows differ from the reference quantizer",
                                 f"tokens {rows} quantized by kvspec.fuzz.turbo_ref", wrong)
            self._checked.update((toks[j], prefix) for j in todo)

    def view_matches(self, name: str, tokens: tuple[int, ...], arrays: Any) -> bool:
        return self.window_matches(tokens, arrays, view=name)

    def more_to_evaluate(self, views: dict[str, Any], state: Any) -> list[Any]:
        """The quantized store, which :meth:`check_reference` reads after an
        append: evaluated with the step's other reads."""
        store = getattr(self.cache, "store", None)
        return [a for a in store.values() if isinstance(a, mx.array)] if isinstance(store, dict) else []

    def compare_state(self, index: int, op: dict[str, Any]) -> None:
        super().compare_state(index, op)
        live = self.world.cache.live_len
        if op["op"] in ("trim", "trim_to") and 0 < live < self.prev_world.cache.live_len:
            self.reached("physical trim")

    def reload_class(self) -> type:
        """The class under test (its ``from_state`` builds that class, so a
        field dropped from ``meta_state`` and from its loading alike is the
        fixpoint's blind spot that the ``reload`` op covers)."""
        return type(self.cache)

    def check_expect(self, index: int, op: dict[str, Any]) -> None:
        self._view = "cache" if op.get("of") is None else self.view_key(op["of"])
        try:
            super().check_expect(index, op)
        finally:
            self._view = "cache"


    # -- observables ------------------------------------------------------------
    def spec_observables(self) -> dict[str, Any]:
        w = self.world
        c = w.cache
        return {"offset": c.offset, "live_start": c.live_start, "live_len": c.live_len, "capacity": c.capacity,
                "cold_offset": w.cold_offset, "rows": w.rows()}

    def impl_observables(self) -> dict[str, Any]:
        c = self.cache
        return {"offset": c.offset, "live_start": c.live_start, "live_len": c.live_len, "capacity": c.capacity,
                "cold_offset": c.cold_offset, "rows": dict(sorted(c.row_counts().items()))}


#: head dims the quantizer refuses, drawn now and then so that refused
#: appends are compared too (3-bit: a power of two that is not a multiple
#: of 8; 4-bit: not a power of two)
BAD_HEAD_DIMS = {"turbo3asym": 4}
BAD_HEAD_DIM = 12


class TurboMachine(DenseMachine):
    """The dense machine's rules (front trims and gathers included: the
    Turbo modes answer 0 or compact, Delegated refuses gathers) on a Turbo
    cache, with small ``hot_threshold`` and ``fold_block`` for Delegated
    and, in about one example in five (index 2 of the draw, away from the
    ends Hypothesis favours), a head_dim the quantizer refuses (rarer, and
    Hypothesis, which reuses earlier examples' choices, could go hundreds
    of examples without one)."""

    #: a prompt-cache file only: the Turbo classes load by ``from_state``
    #: (no ``state`` setter, so mlx-lm's load order is not theirs)
    reload_paths = ("file",)

    @initialize(step=SMALL_STEPS, head_dim=st.sampled_from([8, 16, 0, 16, 8]), kv_heads=KV_HEADS,
                hot_threshold=THRESHOLDS, fold_block=BLOCKS, rows=st.sampled_from(["ranged", "numpy"]),
                dtype=st.sampled_from(["float16", "bfloat16", "float32"]))
    def init(self, step: int, head_dim: int, kv_heads: int, hot_threshold: int, fold_block: int, rows: str,
             dtype: str) -> None:
        """Rows across the whole magnitude range (``ranged``) as often as
        ordinary ones, in every float dtype."""
        if head_dim == 0:
            head_dim = BAD_HEAD_DIMS.get(self.mode, BAD_HEAD_DIM)
        extra = {"hot_threshold": hot_threshold, "fold_block": fold_block} if self.mode == DELEGATED else {}
        self.setup(step=step, head_dim=head_dim, kv_heads=kv_heads, rows=rows, dtype=dtype, **extra)

    @rule(n=st.integers(2, 4), data=st.data())
    def speculative_round(self, n: int, data: st.DataObject) -> None:
        """A verification block and its rejection: append ``n`` rows, then
        trim 1 to ``n - 1`` of them (the physical trim the Turbo modes keep,
        and Delegated's folds right before it)."""
        self.do({"op": "append", "n": n})
        self.do({"op": "trim", "n": data.draw(st.integers(1, n - 1), label="rejected")})

    def recorded_cfg(self) -> dict[str, Any]:
        cfg = super().recorded_cfg()
        if self.mode != DELEGATED:
            # hot_threshold and fold_block are Delegated's fields only
            cfg = {k: v for k, v in cfg.items() if k not in ("hot_threshold", "fold_block")}
        return cfg

    @invariant()
    def cold_offset_in_range(self) -> None:
        """semantics.md 5.6 on the implementation: 0 <= cold_offset <= offset."""
        if self.lock is None:
            return
        c = self.lock.cache
        assert 0 <= c.cold_offset <= c.offset, (c.cold_offset, c.offset)
