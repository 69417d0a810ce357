"""A stand-in for PyTorch and transformers' DynamicCache, for machines
without torch (tests/test_target_property.py): just what the
``transformers`` target's adapter (fuzz/adapters/transformers.py) touches,
on NumPy, with torch's behaviours that matter to it:

* ``Tensor.numpy()`` of a bfloat16 tensor raises TypeError (NumPy has no
  bfloat16), as torch does; bfloat16 values are kept as float32 and
  rounded to bfloat16 on ``.to(torch.bfloat16)``;
* ``torch.cat`` skips empty 1-D tensors, promotes dtypes, and raises
  RuntimeError on a shape mismatch;
* ``DynamicLayer.update`` / ``crop`` / ``get_seq_length`` as in
  transformers' cache_utils (crop of a positive count raises ValueError,
  of 0 does nothing, of -n removes n rows);
* for transformers' own ``LinearAttentionLayer`` (:func:`install_cache_utils`
  loads the installed ``transformers/cache_utils.py`` itself against this
  stand-in: its code runs, not a copy): ``zeros``, ``zeros_like``,
  ``nn.functional.pad``, a 0-d int64 counter (``tensor(0, dtype=int)``,
  ``add_`` / ``sub_``, ``int()``), and torch's view semantics: basic
  slicing is a view of the same memory (NumPy's), ``copy_`` writes into
  it in place (broadcasting, RuntimeError where the shapes do not), and
  ``clone`` copies.

Not a model of torch: an aid to exercise the adapter's conversions, copies
and dispatch where the real library is not installed.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np


class _Dtype:
    def __init__(self, name: str, np_dtype: Any):
        self.name, self.np = name, np.dtype(np_dtype)

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    def __deepcopy__(self, memo: Any) -> _Dtype:
        return self  # torch's dtypes are singletons, under copies too

    __str__ = __repr__


float16 = _Dtype("float16", np.float16)
float32 = _Dtype("float32", np.float32)
bfloat16 = _Dtype("bfloat16", np.float32)  # held as float32 values that are bfloat16s
int64 = _Dtype("int64", np.int64)
long = int64
_BY_NP = {np.dtype(np.float16): float16, np.dtype(np.float32): float32, np.dtype(np.int64): int64}
#: Python types torch takes as dtypes (``torch.tensor(0, dtype=int)``)
_BY_PY = {int: int64, float: float32}


def _dtype(d: Any) -> _Dtype:
    return _BY_PY.get(d, d) if d is not None else float32


def _round_bf16(a: np.ndarray) -> np.ndarray:
    bits = np.asarray(a, np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


class Tensor:
    def __init__(self, a: np.ndarray, dtype: _Dtype):
        self.a, self.dtype = a, dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.a.shape

    device = "cpu"

    def numel(self) -> int:
        return int(self.a.size)

    def detach(self) -> Tensor:
        return self

    def cpu(self) -> Tensor:
        return self

    def numpy(self) -> np.ndarray:
        if self.dtype is bfloat16:
            raise TypeError("Got unsupported ScalarType BFloat16")
        return self.a

    def float(self) -> Tensor:
        return Tensor(self.a.astype(np.float32), float32)

    def to(self, dtype: Any, *args: Any, **kwargs: Any) -> Tensor:
        if not isinstance(dtype, _Dtype):
            return self  # a device: there is only the CPU here, and torch returns the tensor itself
        a = self.a.astype(dtype.np)
        return Tensor(_round_bf16(a) if dtype is bfloat16 else a, dtype)

    def __getitem__(self, key: Any) -> Tensor:
        return Tensor(self.a[key], self.dtype)  # basic slicing: a view of the same memory, as torch's

    # -- what transformers' LinearAttentionLayer calls --------------------------

    def clone(self) -> Tensor:
        return Tensor(self.a.copy(), self.dtype)

    def copy_(self, src: Tensor) -> Tensor:
        """In place, as torch's: ``src`` broadcast to this tensor's shape
        (RuntimeError where it cannot be), cast to its dtype."""
        try:
            np.copyto(self.a, np.broadcast_to(src.a, self.a.shape).astype(self.dtype.np))
        except ValueError as exc:
            raise RuntimeError(f"The size of tensor a {tuple(self.a.shape)} must match the size of tensor b "
                               f"{tuple(src.a.shape)}: {exc}") from None
        return self

    def add_(self, other: Any) -> Tensor:
        self.a += np.asarray(getattr(other, "a", other), self.dtype.np)
        return self

    def sub_(self, other: Any) -> Tensor:
        self.a -= np.asarray(getattr(other, "a", other), self.dtype.np)
        return self

    def zero_(self) -> Tensor:
        self.a[...] = 0
        return self

    def dim(self) -> int:
        return self.a.ndim

    def item(self) -> Any:
        return self.a.item()

    def __int__(self) -> int:
        return int(self.a)

    def __index__(self) -> int:
        return int(self.a)

    def __repr__(self) -> str:
        return f"tensor({self.a!r}, dtype={self.dtype})"


def from_numpy(a: np.ndarray) -> Tensor:
    return Tensor(a, _BY_NP[a.dtype])


def tensor(data: Any, dtype: Any = float32, device: Any = None) -> Tensor:
    dtype = _dtype(dtype)
    return Tensor(np.array(data, dtype=dtype.np), dtype)


def zeros(*shape: Any, dtype: Any = None, device: Any = None) -> Tensor:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    dtype = _dtype(dtype)
    return Tensor(np.zeros(tuple(int(d) for d in shape), dtype=dtype.np), dtype)


def zeros_like(t: Tensor, dtype: Any = None, device: Any = None) -> Tensor:
    dtype = t.dtype if dtype is None else _dtype(dtype)
    return Tensor(np.zeros(t.shape, dtype=dtype.np), dtype)


def _pad(t: Tensor, pad: tuple[int, ...], mode: str = "constant", value: float = 0) -> Tensor:
    """``torch.nn.functional.pad``: ``pad`` is (left, right) of the last
    dim, then of the one before, ..."""
    widths = [(0, 0)] * t.a.ndim
    for i in range(len(pad) // 2):
        widths[t.a.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    return Tensor(np.pad(t.a, widths, constant_values=value), t.dtype)


def _promote(a: _Dtype, b: _Dtype) -> _Dtype:
    return a if a is b else float32


def cat(tensors: list[Tensor], dim: int = 0) -> Tensor:
    parts = [t for t in tensors if not (t.a.ndim == 1 and t.a.size == 0)]
    if not parts:
        return tensors[0]
    dtype = parts[0].dtype
    for t in parts[1:]:
        dtype = _promote(dtype, t.dtype)
    try:
        return Tensor(np.concatenate([t.a.astype(dtype.np) for t in parts], axis=dim), dtype)
    except ValueError as exc:
        raise RuntimeError(f"Sizes of tensors must match: {exc}") from None


class DynamicLayer:
    def __init__(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.keys = tensor([], dtype=key_states.dtype)
            self.values = tensor([], dtype=value_states.dtype)
            self.is_initialized = True
        self.keys = cat([self.keys, key_states], dim=-2)
        self.values = cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        if not self.is_initialized or self.keys.numel() == 0:
            return 0
        return self.keys.shape[-2]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported.")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.keys = self.keys[..., : -abs(tokens_to_remove), :]
        self.values = self.values[..., : -abs(tokens_to_remove), :]


class DynamicCache:
    def __init__(self) -> None:
        self.layers: list[DynamicLayer] = []

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, cache_kwargs: Any = None) -> Any:
        while len(self.layers) <= layer_idx:
            self.layers.append(DynamicLayer())
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if layer_idx >= len(self.layers) else self.layers[layer_idx].get_seq_length()

    def crop(self, max_length: int) -> None:
        for layer in self.layers:
            layer.crop(max_length)


def _torch_module() -> types.ModuleType:
    torch = types.ModuleType("torch")
    for name in ("Tensor", "from_numpy", "tensor", "cat", "float16", "float32", "bfloat16", "int64", "long",
                 "zeros", "zeros_like"):
        setattr(torch, name, globals()[name])
    # names transformers' cache_utils evaluates in its signatures or calls on the way
    torch.LongTensor = Tensor
    torch.dtype = _Dtype
    torch.device = str
    torch.float = float32
    # evaluated in class bodies of layers the stand-in never runs (Fp8QuantizedLayer)
    torch.float8_e4m3fn = _Dtype("float8_e4m3fn", np.float32)
    torch.finfo = lambda dtype: types.SimpleNamespace(max=448.0, tiny=2.0 ** -6)
    torch._dynamo = types.SimpleNamespace(mark_static_address=lambda *a, **k: None)
    torch.compiler = types.SimpleNamespace(is_compiling=lambda: False, is_exporting=lambda: False)
    torch.nn = types.SimpleNamespace(functional=types.SimpleNamespace(pad=_pad))
    return torch


def install(monkeypatch: Any) -> None:
    """Put the stand-ins in ``sys.modules`` as ``torch`` and ``transformers``
    (only for the test's duration)."""
    import mlx_lm.models.cache  # noqa: F401 - mlx-lm imports transformers' tokenizers: before the stand-in

    torch = _torch_module()
    monkeypatch.setitem(sys.modules, "torch", torch)
    try:
        import transformers  # installed without torch: keep it, stand in its DynamicCache only
    except ImportError:
        transformers = types.ModuleType("transformers")
        monkeypatch.setitem(sys.modules, "transformers", transformers)
    monkeypatch.setattr(transformers, "DynamicCache", DynamicCache, raising=False)
    if hasattr(transformers, "__file__"):  # the installed library: its own cache_utils, run on the stand-in
        _load_cache_utils(monkeypatch, transformers)


def _load_cache_utils(monkeypatch: Any, transformers: Any) -> None:
    """The installed transformers' own ``cache_utils.py`` executed against
    the stand-in torch, in ``sys.modules`` as ``transformers.cache_utils``;
    it and every module it imports are taken out again when the test ends
    (no later test sees a transformers bound to the stand-in)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(transformers.__file__), "cache_utils.py")
    before = set(sys.modules)
    spec = importlib.util.spec_from_file_location("transformers.cache_utils", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "transformers.cache_utils", module)
    spec.loader.exec_module(module)
    for name in set(sys.modules) - before - {"transformers.cache_utils"}:
        monkeypatch.setitem(sys.modules, name, sys.modules[name])  # removed again at the test's end


def install_cache_utils(monkeypatch: Any) -> types.ModuleType:
    """:func:`install`, and return ``transformers.cache_utils``: the
    installed library's own code run on the stand-in (``from
    transformers.cache_utils import LinearAttentionLayer`` gives it)."""
    install(monkeypatch)
    module = sys.modules.get("transformers.cache_utils")
    if module is None:
        raise ImportError("transformers is not installed: there is no cache_utils.py to run on the stand-in")
    return module
