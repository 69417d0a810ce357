"""Hugging Face transformers' caches (``transformers.cache_utils``) as a
target of the target API (docs/targets.md), registered as ``transformers``
in ``kvspec.fuzz.targets.BUILTIN``. Needs the optional extra ``transformers``
(PyTorch and transformers; ``pip install -e .[transformers]``); without it
the target exits 2 saying so.

* dense fp16 -> ``DynamicCache()`` with one full-attention layer
  (``DynamicLayer``): ``update(k, v, layer_idx=0)`` concatenates and returns
  the whole window; the kvtrace ``trim n`` is transformers' rollback
  ``crop(-n)`` (a negative count removes that many tokens; a positive one is
  a legacy absolute length it refuses with ValueError). A snapshot is
  ``copy.deepcopy`` of the cache (how prefix caching reuses a prompt cache
  in transformers' docs), a restore a deep copy back.

The remaining caches are targets of their own (one class each; the end
of this module): ``transformers-static`` (``StaticCache``, dense, a fixed
capacity of the trace's ``step`` rows), ``transformers-sliding`` (a
sliding-window layer, the ring kind without sinks: it keeps
``sliding_window - 1`` rows), ``transformers-quanto``, ``-hqq`` and
``-fp8`` (``QuantizedCache``'s backends, dense, windows read within the
backend's error bound). ``kvspec conformance --target transformers`` runs
them all (:data:`CONFORMANCE_CLASSES`). Not run: the static sliding layer
(``StaticSlidingWindowLayer``) and ``reorder_cache`` /
``batch_select_indices``, which act on the batch axis, where no kvtrace op
does.
docs/conformance.md ("transformers") lists what the search found.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvspec.fuzz.targets import CacheClass, Target, TargetError

_NO_SUCH = {
    "trim_to": "no trim_to: callers crop by a count (crop(-n))",
    "trim_front": "no front trim with sinks",
    "gather_positions": "no gather of positions",
    "gather_within_tail": "no gather of positions",
    "detach": "no detached handles (a cache is a whole object)",
    "install": "no detached handles (a cache is a whole object)",
    "handle_trim_to": "no detached handles",
    "state_snapshot": "no mlx-lm state protocol (its prompt caches are deep-copied Cache objects)",
    "state_restore": "no mlx-lm state protocol (its prompt caches are deep-copied Cache objects)",
    "reload": "no prompt-cache file and no state/meta_state to load (a Cache is saved by pickling or "
              "copy.deepcopy, which snapshot already runs)",
}


def _torch(target: str = "transformers") -> Any:
    try:
        import torch
        import transformers  # noqa: F401 - the target needs both
    except ImportError as exc:
        raise TargetError(f"--target {target}: PyTorch and transformers are not installed ({exc}); "
                          "install the optional extra: pip install -e '.[transformers]'") from None
    return torch


def _to_torch(a: Any) -> Any:
    """An MLX array of rows as a torch tensor of the same dtype, bit for
    bit: float16 and float32 through NumPy, bfloat16 (which NumPy has not)
    through its float32 host form (``kvspec.fuzz.rows.host``, exact), then
    ``.to(torch.bfloat16)`` (exact: every value is a bfloat16)."""
    from kvspec.fuzz.rows import dtype_name, host

    torch = _torch()
    name = dtype_name(a)
    t = torch.from_numpy(np.array(host(a), copy=True))
    return t.to(getattr(torch, name)) if name == "bfloat16" else t


class _View:
    """A torch tensor as a reader sees it: ``numpy.asarray`` of it gives its
    host form (float16 and float32 as they are, bfloat16 as the float32 of
    each value, exact: ``kvspec.fuzz.rows.host``'s form), ``kvtrace_dtype`` its
    dtype's kvtrace name."""

    def __init__(self, t: Any):
        self.t = t

    @property
    def kvtrace_dtype(self) -> str:
        return str(self.t.dtype).rsplit(".", 1)[-1]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        t = self.t.detach().cpu()
        if self.kvtrace_dtype == "bfloat16":
            t = t.float()  # NumPy has no bfloat16: the exact float32 of each value
        out = t.numpy()
        return out if dtype is None else out.astype(dtype)


class _CropAndDeepCopy:
    """The rollback and snapshots every transformers cache adapter shares:
    ``trim n`` is ``crop(-n)`` (transformers' rollback by a count) and
    returns how far the length moved; a snapshot is a deep copy of the
    cache object, restored as another deep copy."""

    inner: Any
    offset: int

    def snapshot_type(self) -> type:
        return TransformersSnapshot

    def trim(self, n: int) -> int:
        before = self.offset
        self.inner.crop(-n)
        return before - self.offset

    def snapshot(self) -> Any:
        return self.snapshot_type()(copy.deepcopy(self.inner))

    def restore(self, snap: Any) -> None:
        self.inner = copy.deepcopy(snap.inner)


class DynamicCacheAdapter(_CropAndDeepCopy):
    """One ``DynamicCache`` layer (``layer_idx`` 0) through the target API."""

    live_start = 0

    def __init__(self, cfg: dict[str, Any]):
        _torch()
        from transformers import DynamicCache

        self.inner = DynamicCache()

    @property
    def offset(self) -> int:
        return int(self.inner.get_seq_length(0))

    @property
    def live_len(self) -> int:
        return self.offset

    def update_and_fetch(self, keys: Any, values: Any) -> Any:
        k, v = self.inner.update(_to_torch(keys), _to_torch(values), 0)
        return _View(k), _View(v)

    def fetch(self) -> Any:
        return self.window_of(self.inner)

    @staticmethod
    def window_of(inner: Any) -> Any:
        if not inner.layers or not inner.layers[0].is_initialized or inner.get_seq_length(0) == 0:
            return None
        layer = inner.layers[0]
        return _View(layer.keys), _View(layer.values)

    def __copy__(self) -> DynamicCacheAdapter:
        """``copy.copy`` of the cache a program holds: a new adapter around
        ``copy.copy(inner)`` (the DynamicCache object; its layers shared, as
        Python's shallow copy shares them), never a second wrapper around
        the same DynamicCache."""
        dup = object.__new__(type(self))
        dup.__dict__.update(self.__dict__)
        dup.inner = copy.copy(self.inner)
        return dup


class TransformersSnapshot:
    def __init__(self, inner: Any):
        self.inner = inner

    def fetch(self) -> Any:
        return DynamicCacheAdapter.window_of(self.inner)


DYNAMIC = CacheClass(
    "DynamicCache", "dense", "fp16", DynamicCacheAdapter, dict(_NO_SUCH),
    not_compared={"capacity": "no preallocation: torch.cat grows the tensors by exactly the rows written"},
    snapshot_class=TransformersSnapshot,
    note="one full-attention layer (DynamicLayer); trim n is crop(-n); snapshots are deep copies",
)
TRANSFORMERS = Target("transformers", "Hugging Face transformers' DynamicCache (dense fp16)", (DYNAMIC,))


def transformers_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"transformers {version('transformers')}, torch {version('torch')}"
    except PackageNotFoundError:
        return "transformers not installed"


# -- the recurrent kind: LinearAttentionLayer ------------------------------------
#
# transformers' hybrid models (qwen3_next, qwen3_5, mamba2, nemotron_h, lfm2,
# ...) keep each linear-attention layer's conv window and recurrent state in a
# ``LinearAttentionLayer`` (transformers.cache_utils); rollback is
# ``activate_past_recording(recurrent_states_to_keep=k)`` then ``crop(-n)``.
# docs/conformance.md ("transformers LinearAttentionLayer") reports it.

_LINEAR_NO_SUCH = {
    "append_unrecorded": "no write outside the layer: while recording, every forward goes through "
                         "update_conv_state / update_recurrent_state (the fused single-token conv update that "
                         "bypasses them runs only when not recording)",
    "state_snapshot": "no mlx-lm state protocol (a Cache is deep-copied or pickled: snapshot runs that)",
    "state_restore": "no mlx-lm state protocol (a Cache is deep-copied or pickled: snapshot runs that)",
    "reload": "no prompt-cache file and no state/meta_state to load",
    "hold": "update_recurrent_state returns the layer's live state tensor, written in place by the next "
            "forward by design (a static address for CUDA graphs); models do not keep it",
    "release_hold": "see hold",
    "can_trim": "is_croppable is a class attribute (True for every LinearAttentionLayer, recording or not): "
                "compared after every op as the trimmable observable, not as an op's return value",
}


def _linear_attention_layer() -> Any:
    _torch("transformers-linear")
    try:
        from transformers.cache_utils import LinearAttentionLayer
    except ImportError as exc:
        raise TargetError(f"--target transformers-linear: transformers.cache_utils has no LinearAttentionLayer "
                          f"({exc}); transformers >= 5.25 is needed") from None
    return LinearAttentionLayer


class _HostView:
    """A host array as a reader sees it (``numpy.asarray`` gives it,
    ``kvtrace_dtype`` names its dtype: bfloat16 values are held as their
    exact float32)."""

    def __init__(self, a: np.ndarray, dtype: str):
        self.a, self.kvtrace_dtype = a, dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.a.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.a if dtype is None else self.a.astype(dtype)


def _host_of(t: Any) -> np.ndarray:
    return _View(t).__array__()


class LinearAttentionAdapter:
    """One ``LinearAttentionLayer`` (``number_of_states=1``) as the recurrent
    kind's layer, driven the way transformers' models drive it
    (:meth:`forward`). The trace's ``depth`` U is
    ``activate_past_recording(recurrent_states_to_keep=U)`` at construction
    (recording from the first forward, as assisted decoding's loop has it;
    U = 0: never activated, so ``crop`` refuses with RuntimeError).

    Observables: ``offset`` is ``int(get_seq_length())``, ``depth`` the
    ``recurrent_states_to_keep`` it recorded with, ``is_trimmable()`` the
    class's ``is_croppable``; ``cache`` is ``[conv window, state]`` in the
    recurrent kind's layout: the conv window is the last ``kernel - 1``
    columns of ``conv_states[0]`` (B, C, columns), zero columns in front
    where it holds fewer, transposed to (B, kernel - 1, C); the state is
    ``recurrent_states[0]``; None before the first forward. ``trim(n)`` is
    ``crop(-n)`` and returns the tokens it took back."""

    def __init__(self, cfg: dict[str, Any]):
        self.layer = _linear_attention_layer()(number_of_states=1)
        self.kernel, self.size, self.dtype = cfg["kernel"], cfg["size"], cfg.get("dtype", "float16")
        if cfg["depth"] > 0:
            self.layer.activate_past_recording(recurrent_states_to_keep=cfg["depth"])

    @property
    def offset(self) -> int:
        return int(self.layer.get_seq_length())

    @property
    def depth(self) -> int:
        return int(getattr(self.layer, "recurrent_states_to_keep", 0) or 0) if self.layer.record_past else 0

    def is_trimmable(self) -> bool:
        return bool(self.layer.is_croppable)

    def live_state(self) -> np.ndarray | None:
        """The recurrent state the model continues from (None: zeros, before the first forward)."""
        if self.size == 1 or not self.layer.has_previous_state[0] or self.layer.recurrent_states[0] is None:
            return None
        return _host_of(self.layer.recurrent_states[0]).astype(np.float32)

    def forward(self, rows: np.ndarray, states: list[np.ndarray]) -> None:
        """A forward of S tokens as transformers' models make it (qwen3_next's
        GatedDeltaNet, mamba2's mixer): ``update_conv_state`` with the
        block's inputs (``rows``: (B, S, C) host form, handed as (B, C, S) in
        the trace's dtype) and ``conv_kernel_size=kernel``; then, with a
        recurrent state, ``update_recurrent_state`` with, while recording and
        S > 1, the list of the states after each of the last ``min(keep, S)``
        tokens (``states``: the S states, (B, 3) float32 each), else the state
        after the last token."""
        torch = _torch()
        x = torch.from_numpy(np.ascontiguousarray(rows.transpose(0, 2, 1)))
        if self.dtype == "bfloat16":
            x = x.to(torch.bfloat16)
        self.layer.update_conv_state(x, 0, conv_kernel_size=self.kernel)
        if self.size == 1:
            return
        tensors = [torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32)) for s in states]
        keep = getattr(self.layer, "recurrent_states_to_keep", 0) or 0
        m = min(keep, len(states)) if self.layer.record_past and len(states) > 1 else 0
        self.layer.update_recurrent_state(tensors[-m:] if m else tensors[-1], 0)

    @property
    def cache(self) -> list[Any]:
        layer, k = self.layer, self.kernel - 1
        if not layer.is_conv_states_initialized[0]:
            return [None] * self.size
        conv = _host_of(layer.conv_states[0])[..., -k:]
        pad = np.zeros((*conv.shape[:-1], k - conv.shape[-1]), dtype=conv.dtype)
        conv = np.ascontiguousarray(np.concatenate([pad, conv], axis=-1).transpose(0, 2, 1))
        out: list[Any] = [_HostView(conv, self.dtype)]
        if self.size == 2:
            state = layer.recurrent_states[0]
            out.append(None if state is None else _HostView(_host_of(state), _View(state).kvtrace_dtype))
        return out

    def trim(self, n: int) -> int:
        """``crop(-n)``: transformers' rollback by a count; returns the tokens it took back."""
        before = self.offset
        self.layer.crop(-n)
        return before - self.offset

    def snapshot(self) -> LinearAttentionSnapshot:
        return LinearAttentionSnapshot(copy.deepcopy(self))

    def restore(self, snap: Any) -> None:
        src = snap.adapter if isinstance(snap, LinearAttentionSnapshot) else snap
        self.layer = copy.deepcopy(src.layer)

    def __copy__(self) -> LinearAttentionAdapter:
        """``copy.copy`` of the layer a program holds: a new adapter around
        ``copy.copy(layer)`` (its dicts of conv and recurrent states shared,
        as Python's shallow copy shares them)."""
        dup = object.__new__(type(self))
        dup.__dict__.update(self.__dict__)
        dup.layer = copy.copy(self.layer)
        return dup


class LinearAttentionSnapshot:
    """A deep copy of the layer (how a prompt cache is kept in transformers)."""

    def __init__(self, adapter: LinearAttentionAdapter):
        self.adapter = adapter


def _linear_lockstep(base: type) -> type:
    """The recurrent kind's declared lockstep, playing transformers' model:
    an append is :meth:`LinearAttentionAdapter.forward` with the harness's
    rows and the states its recurrence gives from the layer's own state (so
    a wrong restored state propagates, as in a model); rollbacks are probed
    on deep copies (a shallow copy of the layer shares its state dicts)."""

    class LinearAttentionLockstep(base):  # type: ignore[misc, valid-type]
        def __init__(self, cache: dict[str, Any], cls: CacheClass, target: Target):
            super().__init__(cache, cls, target)
            self.cache_cls = LinearAttentionAdapter
            self._cfg = dict(cache)

        def fresh_cache(self) -> Any:
            if not hasattr(self, "_cfg"):
                return super().fresh_cache()
            return self.cls.factory(self._cfg)

        def _states_after(self, toks: list[int]) -> list[np.ndarray]:
            from kvspec.fuzz.recurrent import HASHES, STATE_WIDTH

            live = self.cache.live_state()
            B = self.cfg["batch"]
            cur = np.zeros((B, STATE_WIDTH), np.int64) if live is None else live.astype(np.int64)
            out = []
            for t in toks:
                self.rows.host_rows([t])
                v = np.array(self.rows._values[t], np.int64)
                nxt = cur.copy()
                nxt[:, 0] = cur[:, 0] + 1
                for j, (mul, mod) in enumerate(HASHES, start=1):
                    nxt[:, j] = (cur[:, j] * mul + v) % mod
                out.append(nxt.astype(np.float32))
                cur = nxt
            return out

        def _call(self, mixer: Any, n: int) -> Any:
            start = self.world.next_token
            toks = list(range(start, start + n))
            self.cache.forward(self.rows.host_rows(toks), self._states_after(toks))
            self.returned = tuple(self.cache.cache)
            return self.returned

        def _history(self, held: Any, coverage: int) -> list[Any]:
            from kvspec.fuzz.recurrent import _Probe

            try:
                layer = self._layer_of(held)
                out: list[Any] = [tuple(layer.cache)]
            except Exception as exc:  # noqa: BLE001 - reported by the comparison
                return [_Probe(exc)]
            for n in range(1, coverage + 1):
                try:
                    dup = copy.deepcopy(layer)
                    dup.trim(n)
                    out.append(tuple(dup.cache))
                except Exception as exc:  # noqa: BLE001 - reported by the comparison
                    out.append(_Probe(exc))
            return out

    LinearAttentionLockstep.__name__ = f"LinearAttention{base.__name__}"
    return LinearAttentionLockstep


@dataclass(frozen=True)
class LinearAttentionTarget(Target):
    """The target of ``LinearAttentionLayer``: the recurrent kind's lockstep
    playing transformers' model (:func:`_linear_lockstep`), and machines
    that roll back only within the spec's coverage (transformers' history is
    unbounded until a crop: a rollback the spec refuses for its depth it
    may honour, a difference of contract) and only after the first forward
    (before it, ``crop`` raises TypeError on ``-None`` after moving the
    length: tests/test_conformance_linear_attention.py asserts it); neither
    is generated, so the search's rounds reach the rollbacks a model makes.
    A replayed trace with one reports it."""

    def make_lockstep(self, cache: dict[str, Any]) -> Any:
        from kvspec.fuzz import kinds
        from kvspec.fuzz.targets import declared_lockstep
        from kvspec.fuzz.trace import TraceFormatError

        try:
            entry = kinds.get(cache["kind"], cache.get("mode", "fp16"))
        except kinds.UnknownKindError as exc:
            raise TraceFormatError(f"field cache.{exc.field}: {exc}") from None
        driver = entry.lockstep_class()
        driver.check_cache(cache)
        c = self.require_class(cache)
        return _linear_lockstep(declared_lockstep(driver))(cache, c, self)

    def machine_base(self, kind: str, mode: str, base: type) -> type:
        from hypothesis import strategies as st
        from hypothesis.stateful import precondition, rule

        full = super().machine_base(kind, mode, base)

        class WithinCoverage(full):  # type: ignore[misc, valid-type]
            def do(self, op: dict[str, Any]) -> None:
                if op["op"] == "trim" and self.lock is not None:
                    from kvspec.spec import recurrent as sr

                    c = self.lock.world.cache
                    if c.offset == 0 or op["n"] > sr.trimmable_rows(c):
                        self.lock.reached("skipped trim (before the first forward, or beyond the coverage)")
                        return
                super().do(op)

            @precondition(lambda self: self.lock is not None and self.lock.world.cache.offset > 0)
            @rule(data=st.data())
            def rollback(self, data: st.DataObject) -> None:
                c = self._cov
                n = data.draw(st.sampled_from(sorted({c, max(c - 1, 0), min(c, 1)})), label="n")
                self.do({"op": "trim", "n": n})

            @rule(data=st.data())
            def draft_steps(self, data: st.DataObject) -> None:
                depth = self.lock.world.cache.depth
                n = data.draw(st.integers(1, max(1, depth)), label="steps")
                for _ in range(n):
                    self.do({"op": "append", "n": 1})
                self.do({"op": "trim", "n": n})

        WithinCoverage.__name__ = f"{full.__name__}_within_coverage"
        return WithinCoverage


LINEAR_ATTENTION = CacheClass(
    "LinearAttentionLayer", "recurrent", "fp16", LinearAttentionAdapter, dict(_LINEAR_NO_SUCH),
    not_compared={"trimmable_rows": "no coverage query: the layer keeps every state handed to it since the last "
                                     "crop (recurrent_states_to_keep bounds only what a model hands over)"},
    snapshot_class=LinearAttentionSnapshot,
    note="one LinearAttentionLayer, driven as transformers' models drive it; depth U is "
         "activate_past_recording(recurrent_states_to_keep=U); trim n is crop(-n); snapshots are deep copies",
)
TRANSFORMERS_LINEAR = LinearAttentionTarget(
    "transformers-linear", "Hugging Face transformers' LinearAttentionLayer (recurrent)", (LINEAR_ATTENTION,))


# -- the remaining caches: StaticCache, sliding-window layers, QuantizedCache ------
#
# Each is a target of its own (one class per kind/mode), and
# ``kvspec conformance --target transformers`` runs them all
# (:data:`CONFORMANCE_CLASSES`). What each does differently on purpose is
# declared here, in its CacheClass and its lockstep, never guessed from a
# failure; docs/conformance.md ("transformers") tabulates it.


def _config(target: str, sliding_window: int | None = None) -> Any:
    """A one-layer model configuration for ``Cache(config=...)``: Llama's
    (full attention), or Mistral's with ``sliding_window`` (a sliding
    layer); the cache picks its layer class from it, as for a model."""
    _torch(target)
    from transformers import LlamaConfig, MistralConfig

    if sliding_window is None:
        return LlamaConfig(num_hidden_layers=1)
    return MistralConfig(num_hidden_layers=1, sliding_window=sliding_window)


@contextlib.contextmanager
def _building(target: str) -> Iterator[None]:
    """Build a transformers cache; an ImportError on the way (transformers
    without a PyTorch it accepts, a backend missing), or a TypeError or
    AttributeError from a transformers (or torch) without the API driven
    here, is the target's usage error (exit 2, naming it), never a tool
    failure. Only the construction: once built, every error is the cache's."""
    try:
        yield
    except (ImportError, TypeError, AttributeError) as exc:
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise TargetError(f"--target {target}: transformers cannot build this cache here ({first.strip()}); "
                          "install the optional extra: pip install -e '.[transformers]'") from None


def _seq_len(inner: Any) -> int:
    return int(inner.get_seq_length(0))


class StaticCacheAdapter(_CropAndDeepCopy):
    """``StaticCache(config, max_cache_len=step)``: one ``StaticLayer`` of
    the trace's ``step`` rows, allocated at the first update and never
    grown (the spec's first allocation of ``step`` rows, with no regrowth).

    ``update`` returns the whole preallocated buffer, rows past the length
    zero (a model's mask hides them: ``get_mask_sizes`` is
    ``max_cache_len``); a reader's window is its first
    ``get_seq_length()`` rows, a view of the buffer. ``offset`` is
    ``get_seq_length()`` (the layer's ``cumulative_length``), ``capacity``
    the buffer's rows (0 before the first update). ``trim n`` is
    ``crop(-n)``; snapshots are deep copies."""

    live_start = 0

    def __init__(self, cfg: dict[str, Any]):
        with _building("transformers-static"):
            from transformers import StaticCache

            self.inner = StaticCache(config=_config("transformers-static"), max_cache_len=cfg["step"])

    @property
    def offset(self) -> int:
        return _seq_len(self.inner)

    @property
    def live_len(self) -> int:
        return self.offset

    @property
    def capacity(self) -> int:
        layer = self.inner.layers[0]
        return int(layer.keys.shape[-2]) if layer.is_initialized else 0

    def update_and_fetch(self, keys: Any, values: Any) -> Any:
        self.inner.update(_to_torch(keys), _to_torch(values), 0)
        return self.fetch()

    def fetch(self) -> Any:
        return self.window_of(self.inner)

    @staticmethod
    def window_of(inner: Any) -> Any:
        layer = inner.layers[0]
        if not layer.is_initialized:
            return None
        n = _seq_len(inner)
        return _View(layer.keys[:, :, :n, :]), _View(layer.values[:, :, :n, :])

    def snapshot_type(self) -> type:
        return StaticSnapshot


class StaticSnapshot(TransformersSnapshot):
    def fetch(self) -> Any:
        return StaticCacheAdapter.window_of(self.inner)


def _static_lockstep(base: type) -> type:
    """The dense lockstep with ``StaticCache``'s declared capacity: an
    append that would take the length past ``max_cache_len`` (the trace's
    ``step``) is refused (a StateError on the spec side; transformers
    raises IndexError, declared a refusal of that category), and, as every
    refusal, changes nothing on either side."""

    class StaticLockstep(base):  # type: ignore[misc, valid-type]
        def spec_apply(self, op: dict[str, Any]) -> tuple[Any, Any]:
            if op["op"] == "append":
                from kvspec.spec.errors import StateError

                c = self.world.cache
                if c.offset + op["n"] > self.cfg["step"]:
                    raise StateError(f"append: {op['n']} rows do not fit a fixed capacity of max_cache_len = "
                                     f"{self.cfg['step']} rows holding {c.offset}")
            return super().spec_apply(op)

    StaticLockstep.__name__ = f"Static{base.__name__}"
    return StaticLockstep


class SlidingWindowAdapter(_CropAndDeepCopy):
    """``DynamicCache(config)`` of one sliding-attention layer
    (``DynamicSlidingWindowLayer(sliding_window=max_size)``) as the ring
    kind with no sinks and no undo log: ``update`` returns the layer's
    kept rows then the new ones (``torch.cat``, chronological order) and
    keeps the last ``sliding_window - 1`` of them; a reader's window is
    what it keeps. ``offset`` is ``get_seq_length()`` (its
    ``cumulative_length``), ``is_trimmable()`` the class's ``is_croppable``;
    ``trim n`` is ``crop(-n)``; snapshots are deep copies."""

    live_start = 0

    def __init__(self, cfg: dict[str, Any]):
        with _building("transformers-sliding"):
            from transformers import DynamicCache

            self.inner = DynamicCache(config=_config("transformers-sliding", cfg["max_size"]))

    @property
    def offset(self) -> int:
        return _seq_len(self.inner)

    def is_trimmable(self) -> bool:
        return bool(self.inner.layers[0].is_croppable)

    def update_and_fetch(self, keys: Any, values: Any) -> Any:
        k, v = self.inner.update(_to_torch(keys), _to_torch(values), 0)
        return _View(k), _View(v)

    def fetch(self) -> Any:
        return DynamicCacheAdapter.window_of(self.inner)



def _sliding_lockstep(base: type) -> type:
    """The ring lockstep with the sliding layer's declared retention: a
    window it returns holds the spec's rows in chronological order (it
    concatenates; the spec's ring returns physical order, and token
    identities grow with position within a window, so sorting them gives
    the order); a window it keeps (the live one, a snapshot's) holds the
    latest ``max_size - 1`` of them (the row the next decode evicts is
    already gone). Nothing else is relaxed."""

    class SlidingLockstep(base):  # type: ignore[misc, valid-type]
        _full = False

        def _keep(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
            ordered = tuple(sorted(tokens))
            if self._full:
                return ordered
            kept = self.cfg["max_size"] - 1
            return ordered[len(ordered) - kept:] if kept and len(ordered) > kept else ordered if kept else ()

        def window_matches(self, tokens: tuple[int, ...], arrays: Any, mode: str | None = None) -> bool:
            return super().window_matches(self._keep(tuple(tokens)), arrays, mode)

        def compare_append(self, index: int, op: dict[str, Any], s: Any, i: Any) -> None:
            self._full = True
            try:
                super().compare_append(index, op, s, i)
            finally:
                self._full = False

        def view_matches(self, name: str, tokens: tuple[int, ...], arrays: Any) -> bool:
            self._full = name == "held"  # the window an update returned
            try:
                return super().view_matches(name, tokens, arrays)
            finally:
                self._full = False

    SlidingLockstep.__name__ = f"Sliding{base.__name__}"
    return SlidingLockstep


#: the quantized backends as targets: backend -> (QuantizedCache arguments, a
#: window row's error bound, in words)
QUANTIZED_BACKENDS: dict[str, tuple[dict[str, Any], str]] = {
    "quanto": ({"nbits": 4, "q_group_size": 8}, "two quantization steps of the window's range: 2 (max - min) / 15"),
    "hqq": ({"nbits": 4, "q_group_size": 8}, "two quantization steps of the window's range: 2 (max - min) / 15"),
    "fp8": ({}, "float8_e4m3fn's rounding: |x| / 16, plus half its smallest step at the frozen scale"),
}


class QuantizedCacheAdapter(_CropAndDeepCopy):
    """``QuantizedCache(backend, config, ...)`` of one full-attention layer
    (quanto and HQQ: ``nbits=4, q_group_size=8, residual_length=step``, so
    the trace's ``step`` sets when the full-precision residual is flushed
    into the quantized rows; fp8 takes no arguments: a per-tensor scale
    frozen at the first update). ``update`` returns the dequantized rows,
    the residual, then the new rows; a reader's window is the same without
    writing (the backend's own ``_dequantize``). ``offset`` is
    ``get_seq_length()`` (its ``cumulative_length``); ``trim n`` is
    ``crop(-n)``; snapshots are deep copies."""

    live_start = 0
    backend = "quanto"

    def __init__(self, cfg: dict[str, Any]):
        target = f"transformers-{self.backend}"
        with _building(target):
            conf = _config(target)
            if self.backend == "quanto":
                _need(target, "optimum.quanto", "optimum-quanto")
            if self.backend == "hqq":
                _need(target, "hqq", "hqq")
            from transformers import QuantizedCache

            args = dict(QUANTIZED_BACKENDS[self.backend][0])
            if self.backend != "fp8":
                args["residual_length"] = cfg["step"]
            self.inner = QuantizedCache(self.backend, conf, **args)

    @property
    def offset(self) -> int:
        return _seq_len(self.inner)

    @property
    def live_len(self) -> int:
        return self.offset

    def update_and_fetch(self, keys: Any, values: Any) -> Any:
        k, v = self.inner.update(_to_torch(keys), _to_torch(values), 0)
        return _View(k), _View(v)

    def fetch(self) -> Any:
        return self.window_of(self.inner)

    @staticmethod
    def window_of(inner: Any) -> Any:
        torch = _torch()
        layer = inner.layers[0]
        if not layer.is_initialized or layer._quantized_keys is None:
            return None
        k, v = layer._dequantize(layer._quantized_keys), layer._dequantize(layer._quantized_values)
        if layer.keys is not None and layer.keys.dim() == 4:
            k, v = torch.cat([k, layer.keys], dim=-2), torch.cat([v, layer.values], dim=-2)
        return _View(k), _View(v)

    def snapshot_type(self) -> type:
        return QuantizedSnapshot


class QuantizedSnapshot(TransformersSnapshot):
    def fetch(self) -> Any:
        return QuantizedCacheAdapter.window_of(self.inner)


def _need(target: str, module: str, package: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
        raise TargetError(f"--target {target}: {package} is not installed; pip install {package}")


def _quantized_class(backend: str) -> type:
    return type(f"Quantized{backend.capitalize()}Adapter", (QuantizedCacheAdapter,), {"backend": backend})


def _quantized_lockstep(base: type, backend: str) -> type:
    """The dense lockstep reading a quantized window within the backend's
    declared error bound (:data:`QUANTIZED_BACKENDS`) instead of byte for
    byte: every row of the window is within the bound of the spec's row at
    that place (so a missing, extra, stale or reordered row still differs,
    and so does a row the quantizer cannot represent); a report names each
    row by the nearest token's row."""

    class QuantizedLockstep(base):  # type: ignore[misc, valid-type]
        #: largest magnitude of any row handed in (the fp8 scale's bound)
        _amax = 0.0

        def input_rows(self, tokens: list[int]) -> Any:
            k, v = self.host_rows(tokens)
            self._amax = max(self._amax, float(np.abs(k).max(initial=0)), float(np.abs(v).max(initial=0)))
            return super().input_rows(tokens)

        def _bound(self, want: np.ndarray) -> np.ndarray:
            w = want.astype(np.float64)
            if backend == "fp8":
                return np.abs(w) / 16 + self._amax / 448 * 2.0**-10 + np.abs(w) * 2.0**-10
            span = float(w.max(initial=0) - w.min(initial=0))
            return np.full_like(w, 2 * span / 15 + 1e-3)

        def _expected_host(self, tokens: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
            k, v = self.host_rows(list(tokens))
            return np.asarray(k, np.float64), np.asarray(v, np.float64)

        def window_matches(self, tokens: tuple[int, ...], arrays: Any, mode: str | None = None) -> bool:
            from kvspec.fuzz.lockstep import Unreadable
            from kvspec.fuzz.rows import dtype_name

            if arrays is None or not tokens:
                return super().window_matches(tokens, arrays, mode)
            if isinstance(arrays, Unreadable) or any(dtype_name(a) != self.dtype for a in arrays):
                return False
            got = [np.asarray(self.host(a), np.float64) for a in arrays]
            want = self._expected_host(tuple(tokens))
            for g, w in zip(got, want):
                if g.shape != w.shape or not np.all(np.isfinite(g)):
                    return False
                if np.any(np.abs(g - w) > self._bound(w)):
                    return False
            return True

        def identify(self, arrays: Any, mode: str | None = None) -> list[Any]:
            exact = super().identify(arrays, mode)
            if arrays is None or not exact or all(t != "?" for t in exact):
                return exact
            k, v = (np.asarray(self.host(a), np.float64) for a in arrays)
            n_tokens = getattr(self.world, "next_token", 0)
            if not n_tokens:
                return exact
            ek, ev = self._expected_host(tuple(range(n_tokens)))
            out: list[Any] = []
            for j, t in enumerate(exact):
                if t != "?" or j >= k.shape[2] or j >= v.shape[2]:
                    out.append(t)
                    continue
                dist = [max(np.abs(k[:, :, j] - ek[:, :, i]).max(), np.abs(v[:, :, j] - ev[:, :, i]).max())
                        for i in range(n_tokens)]
                best = int(np.argmin(dist))
                if not np.isfinite(dist[best]):
                    out.append("nan/inf")
                    continue
                ok = all(np.all(np.abs(g[:, :, j] - w[:, :, best]) <= self._bound(w[:, :, best]))
                         for g, w in ((k, ek), (v, ev)))
                out.append(best if ok else f"~{best}")
            return out

    QuantizedLockstep.__name__ = f"Quantized{backend.capitalize()}{base.__name__}"
    return QuantizedLockstep


@dataclass(frozen=True)
class _WrappedTarget(Target):
    """A transformers target whose lockstep is the kind's declared one
    wrapped by ``wrap(base) -> class`` (its declared differences), and
    whose machine pins the cache fields its class takes one value of."""

    wrap: Any = None
    pinned: tuple[tuple[str, Any], ...] = ()

    def make_lockstep(self, cache: dict[str, Any]) -> Any:
        from kvspec.fuzz import kinds
        from kvspec.fuzz.targets import declared_lockstep
        from kvspec.fuzz.trace import TraceFormatError

        try:
            entry = kinds.get(cache["kind"], cache.get("mode", "fp16"))
        except kinds.UnknownKindError as exc:
            raise TraceFormatError(f"field cache.{exc.field}: {exc}") from None
        driver = entry.lockstep_class()
        driver.check_cache(cache)
        c = self.require_class(cache)
        return _wrapped(self.wrap, declared_lockstep(driver))(cache, c, self)

    def machine_base(self, kind: str, mode: str, base: type) -> type:
        full = super().machine_base(kind, mode, base)
        if not self.pinned:
            return full
        pinned = dict(self.pinned)

        class Pinned(full):  # type: ignore[misc, valid-type]
            def setup(self, **cfg: Any) -> None:
                super().setup(**{**cfg, **pinned})

        Pinned.__name__ = f"{full.__name__}_" + "_".join(f"{k}{v}" for k, v in self.pinned)
        return Pinned


_WRAPPED: dict[tuple[Any, type], type] = {}


def _wrapped(wrap: Any, base: type) -> type:
    key = (wrap, base)
    if key not in _WRAPPED:
        _WRAPPED[key] = wrap(base)
    return _WRAPPED[key]


_STATIC_NO_SUCH = {
    **_NO_SUCH,
    "hold": "update returns the layer's preallocated buffer, written in place by the next update by design (a "
            "static address for torch.compile and CUDA graphs); a model reads it within the step and keeps none",
    "release_hold": "see hold",
}

STATIC = CacheClass(
    "StaticCache", "dense", "fp16", StaticCacheAdapter, _STATIC_NO_SUCH,
    refusals={IndexError: "state"},
    snapshot_class=StaticSnapshot,
    note="one StaticLayer, max_cache_len = the trace's step (allocated at the first update, never grown): an "
         "update past it is refused (IndexError, a refusal of the cache's state); update returns the whole "
         "buffer and the window is its first get_seq_length() rows; trim n is crop(-n); snapshots are deep copies",
)
TRANSFORMERS_STATIC = _WrappedTarget(
    "transformers-static", "Hugging Face transformers' StaticCache (dense fp16, fixed capacity)", (STATIC,),
    wrap=_static_lockstep)

_SLIDING_NO_SUCH = {
    op: why for op, why in _NO_SUCH.items() if op in ("trim_to", "state_snapshot", "state_restore", "reload")}

SLIDING = CacheClass(
    "DynamicSlidingWindowLayer", "rotating", "fp16", SlidingWindowAdapter, _SLIDING_NO_SUCH,
    not_compared={"idx": "no ring cursor: the layer concatenates and slices",
                  "capacity": "no ring buffer: the layer keeps sliding_window - 1 rows by slicing a concatenation"},
    fields={"keep": (0, "no attention sinks"),
            "undo": (0, "no undo log (activate_past_recording keeps every row until the next crop instead)")},
    snapshot_class=TransformersSnapshot,
    note="one sliding-attention layer of DynamicCache(config), sliding_window = max_size: keeps the last "
         "sliding_window - 1 rows; windows in chronological order; trim n is crop(-n); snapshots are deep copies",
)
TRANSFORMERS_SLIDING = _WrappedTarget(
    "transformers-sliding", "Hugging Face transformers' DynamicSlidingWindowLayer (rotating, keeps W - 1 rows)",
    (SLIDING,), wrap=_sliding_lockstep, pinned=(("keep", 0),))


#: backend -> the layer class transformers builds for it (the class's name in reports and trace files)
LAYER_NAMES = {"quanto": "QuantoQuantizedLayer", "hqq": "HQQQuantizedLayer", "fp8": "Fp8QuantizedLayer"}


def _quantized(backend: str) -> tuple[CacheClass, Target]:
    bound = QUANTIZED_BACKENDS[backend][1]
    cls = CacheClass(
        LAYER_NAMES[backend], "dense", "fp16", _quantized_class(backend), dict(_NO_SUCH),
        not_compared={"capacity": "quantized storage and a residual that torch.cat grows: no preallocation"},
        snapshot_class=QuantizedSnapshot, head_dims=(8, 16), dtypes=("float16",),
        note=f"QuantizedCache(backend={backend!r}): one quantized full-attention layer; float16 rows in, windows read within {bound}; "
             "trim n is crop(-n); snapshots are deep copies",
    )

    def wrap(base: type) -> type:
        return _quantized_lockstep(base, backend)

    wrap.__name__ = f"wrap_{backend}"
    return cls, _WrappedTarget(f"transformers-{backend}",
                               f"Hugging Face transformers' QuantizedCache, {backend} backend (dense)", (cls,),
                               wrap=wrap)


QUANTO, TRANSFORMERS_QUANTO = _quantized("quanto")
HQQ, TRANSFORMERS_HQQ = _quantized("hqq")
FP8, TRANSFORMERS_FP8 = _quantized("fp8")

#: what ``kvspec conformance --target transformers`` fuzzes: (class, target name)
CONFORMANCE_CLASSES: tuple[tuple[CacheClass, str], ...] = (
    (DYNAMIC, "transformers"), (STATIC, "transformers-static"), (SLIDING, "transformers-sliding"),
    (QUANTO, "transformers-quanto"), (HQQ, "transformers-hqq"), (FP8, "transformers-fp8"),
)
