"""Hugging Face transformers' caches (``transformers.cache_utils``) as a
target of the target API (docs/targets.md), registered as ``transformers``
in ``fuzz.targets.BUILTIN``. Needs the optional extra ``transformers``
(PyTorch and transformers; ``pip install -e .[transformers]``); without it
the target exits 2 saying so.

* dense fp16 -> ``DynamicCache()`` with one full-attention layer
  (``DynamicLayer``): ``update(k, v, layer_idx=0)`` concatenates and returns
  the whole window; the kvtrace ``trim n`` is transformers' rollback
  ``crop(-n)`` (a negative count removes that many tokens; a positive one is
  a legacy absolute length it refuses with ValueError). A snapshot is
  ``copy.deepcopy`` of the cache (how prefix caching reuses a prompt cache
  in transformers' docs), a restore a deep copy back.

Not run, and why: ``StaticCache`` needs a ``cache_position`` per update
(the model computes it; a cache-level trace has none), its sliding layer
and ``DynamicSlidingWindowLayer`` keep ``sliding_window - 1`` rows with no
sinks (not the ring kind's contract: a different kind, not a mode);
``QuantizedCache`` needs optimum-quanto or HQQ; ``reorder_cache`` /
``batch_select_indices`` act on the batch axis, where no kvtrace op does.
docs/conformance.md ("transformers") lists what the search found.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from fuzz.targets import CacheClass, Target, TargetError

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


def _torch() -> Any:
    try:
        import torch
        import transformers  # noqa: F401 - the target needs both
    except ImportError as exc:
        raise TargetError(f"--target transformers: PyTorch and transformers are not installed ({exc}); "
                          "install the optional extra: pip install -e '.[transformers]'") from None
    return torch


def _to_torch(a: Any) -> Any:
    """An MLX array of rows as a torch tensor of the same dtype, bit for
    bit: float16 and float32 through NumPy, bfloat16 (which NumPy has not)
    through its float32 host form (``fuzz.rows.host``, exact), then
    ``.to(torch.bfloat16)`` (exact: every value is a bfloat16)."""
    from fuzz.rows import dtype_name, host

    torch = _torch()
    name = dtype_name(a)
    t = torch.from_numpy(np.array(host(a), copy=True))
    return t.to(getattr(torch, name)) if name == "bfloat16" else t


class _View:
    """A torch tensor as a reader sees it: ``numpy.asarray`` of it gives its
    host form (float16 and float32 as they are, bfloat16 as the float32 of
    each value, exact: ``fuzz.rows.host``'s form), ``kvtrace_dtype`` its
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


class DynamicCacheAdapter:
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

    def trim(self, n: int) -> int:
        """``crop(-n)``: transformers' rollback by a count; returns the rows it removed."""
        before = self.offset
        self.inner.crop(-n)
        return before - self.offset

    def snapshot(self) -> Any:
        return TransformersSnapshot(copy.deepcopy(self.inner))

    def __copy__(self) -> DynamicCacheAdapter:
        """``copy.copy`` of the cache a program holds: a new adapter around
        ``copy.copy(inner)`` (the DynamicCache object; its layers shared, as
        Python's shallow copy shares them), never a second wrapper around
        the same DynamicCache."""
        dup = object.__new__(type(self))
        dup.__dict__.update(self.__dict__)
        dup.inner = copy.copy(self.inner)
        return dup

    def restore(self, snap: TransformersSnapshot) -> None:
        self.inner = copy.deepcopy(snap.inner)


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
