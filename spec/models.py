"""Executable spec of the model glue around a prompt cache: what
``make_prompt_cache`` builds for a model, what a prompt-cache file gives
back, what ``to_quantized`` keeps, what ``nbytes`` counts and which in-place
mechanism the write layer picks (docs/models.md).

These are the observables of a prompt cache that live outside one layer's
write and trim path (:mod:`kvspec.spec.layers` has the list-level operations,
:mod:`kvspec.spec.dense` and :mod:`kvspec.spec.rotating` each layer's). Every function is
pure (standard library only); refusals raise :mod:`kvspec.spec.errors` types.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvspec.spec.errors import InvalidArgumentError, UnsupportedOperationError

#: Bytes per element of each dtype rows are handed in (and of Int8's codes).
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "int8": 1}
#: The dtype of an Int8 cache's per-row scales (one per row and head, for K
#: and for V), whatever the rows' dtype.
INT8_SCALE_DTYPE = "float16"
#: The sinks of every ring ``make_prompt_cache`` builds from ``max_kv_size``
#: (mlx-lm's choice).
MAX_KV_SIZE_KEEP = 4
#: The modes whose dense layers take ``hot_threshold`` and ``fold_block``.
DELEGATED_MODES = ("turbo4delegated",)
#: A prompt-cache file's metadata key reserved for kvspec's layer descriptions.
RESERVED_METADATA_KEY = "__kvspec__"
#: The in-place mechanisms of MLX's CUDA backend (``KV_CUDA_INPLACE``).
CUDA_MECHANISMS = ("donate", "kernel")


@dataclass(frozen=True)
class LayerSettings:
    """What one layer of a built prompt cache is: ``kind`` ``"dense"`` (a
    dense-kind cache in ``mode``; ``hot_threshold`` / ``fold_block`` for a
    Delegated mode, else None) or ``"rotating"`` (a ring of ``max_size``
    slots, ``keep`` sinks, an undo log of ``undo`` rows; always fp16), with
    the list's ``step``."""

    kind: str
    mode: str
    step: int
    max_size: int | None = None
    keep: int | None = None
    undo: int | None = None
    hot_threshold: int | None = None
    fold_block: int | None = None


def prompt_cache_layout(
    layout: tuple[tuple[str, int, int], ...] | None,
    n_layers: int,
    mode: str = "fp16",
    step: int = 256,
    max_kv_size: int | None = None,
    undo: int = 0,
    num_draft_tokens: int = 0,
    hot_threshold: int = 256,
    fold_block: int = 128,
) -> tuple[LayerSettings, ...]:
    """The layers ``make_prompt_cache`` builds for a model.

    ``layout``: the model's own ``make_cache()`` as ``(kind, max_size,
    keep)`` per layer (``("dense", 0, 0)`` for a full-attention layer,
    ``("rotating", W, K)`` for a sliding-window one), or None for a model
    without ``make_cache`` (``n_layers`` layers). The rule:

    * every ring's undo depth is ``max(undo, num_draft_tokens)`` (enough for
      every rollback of a speculative round to stay exact after a wrap);
    * with a layout, a dense layer is a dense cache in ``mode`` and a
      sliding-window layer a ring of its own window and sinks in every mode
      (a ring has no quantized storage); ``max_kv_size`` is ignored;
    * without one, every layer is a dense cache in ``mode``, or, with
      ``max_kv_size``, a ring of ``max_kv_size`` slots and
      :data:`MAX_KV_SIZE_KEEP` sinks (fp16 only: a quantized ``mode`` is
      refused with UnsupportedOperationError);
    * a Delegated mode's dense layers carry ``hot_threshold`` and
      ``fold_block``; every layer takes ``step``.

    Raises InvalidArgumentError for ``num_draft_tokens < 0``.
    """
    if num_draft_tokens < 0:
        raise InvalidArgumentError(f"make_prompt_cache: num_draft_tokens must be >= 0, got {num_draft_tokens}")
    depth = max(undo, num_draft_tokens)
    delegated = mode in DELEGATED_MODES
    dense = LayerSettings("dense", mode, step, hot_threshold=hot_threshold if delegated else None,
                          fold_block=fold_block if delegated else None)
    if layout is not None:
        return tuple(dense if kind == "dense" else LayerSettings("rotating", "fp16", step, w, k, depth)
                     for kind, w, k in layout)
    if max_kv_size is not None:
        if mode != "fp16":
            raise UnsupportedOperationError(
                f"make_prompt_cache: max_kv_size={max_kv_size} makes every layer a RotatingKVCache, "
                f"which supports mode 'fp16' only, got mode={mode!r}")
        return tuple(LayerSettings("rotating", "fp16", step, max_kv_size, MAX_KV_SIZE_KEEP, depth)
                     for _ in range(n_layers))
    return tuple(dense for _ in range(n_layers))


def loaded_metadata(metadata: dict[str, str]) -> dict[str, str]:
    """The user metadata a prompt-cache file's load returns
    (``load_prompt_cache(..., return_metadata=True)``) for the ``metadata``
    it was saved with: the same mapping, every key and value verbatim (a key
    that starts with ``"0"``, ``"."`` or ``"0."``, is empty, or is not
    ASCII comes back as it was: the file's ``"0."`` namespace prefix is
    removed once, never stripped as a set of characters). Raises
    InvalidArgumentError for a key or value that is not a string and for
    the reserved key :data:`RESERVED_METADATA_KEY`."""
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidArgumentError(f"save_prompt_cache: metadata must map str to str, got {k!r}: {v!r}")
        if k == RESERVED_METADATA_KEY:
            raise InvalidArgumentError(
                f"save_prompt_cache: metadata key {RESERVED_METADATA_KEY!r} is reserved for kvspec")
    return dict(metadata)


def nbytes(mode: str, capacity: int, batch: int, kv_heads: int, k_head_dim: int, v_head_dim: int,
           dtype: str) -> int:
    """Bytes a layer's ``nbytes`` counts: its stored arrays, each counted
    once, over the buffers' physical length ``capacity`` (rows allocated,
    not live rows; 0 when the cache holds no buffers).

    * ``"fp16"`` (a dense cache or a ring): keys ``[B, H, capacity, Dk]``
      and values ``[B, H, capacity, Dv]`` in the rows' ``dtype``;
    * ``"int8"``: int8 codes of the same shapes, plus one
      :data:`INT8_SCALE_DTYPE` scale per row and head for keys and for
      values (``[B, H, capacity, 1]`` each), whatever the rows' dtype.

    Raises UnsupportedOperationError for another mode (the Turbo stores
    count their packed codes: not stated here)."""
    rows = batch * kv_heads * capacity
    if mode == "fp16":
        return rows * (k_head_dim + v_head_dim) * ITEMSIZE[dtype]
    if mode == "int8":
        return rows * (k_head_dim + v_head_dim) * ITEMSIZE["int8"] + 2 * rows * ITEMSIZE[INT8_SCALE_DTYPE]
    raise UnsupportedOperationError(f"nbytes: no rule for mode {mode!r} (fp16, int8)")


@dataclass(frozen=True)
class Quantized:
    """What ``to_quantized(bits=8)`` gives for a dense Fp16 layer: a new
    Int8 cache with the same ``offset``, ``live_start`` and ``step`` and
    the in-place switch, holding the live rows quantized, that reads back
    in the rows' own ``dtype`` (bfloat16 stays bfloat16), its buffers
    exactly the live rows (``capacity == offset - live_start``)."""

    mode: str
    offset: int
    live_start: int
    step: int
    inplace: bool
    dtype: str
    capacity: int


#: The ``bits`` a dense layer's ``to_quantized`` takes (mlx's quantizer):
#: 8 is kvspec's own Int8 storage, the others mlx-lm's affine
#: ``QuantizedKVCache``.
QUANTIZED_BITS = (2, 3, 4, 5, 6, 8)
#: The ``group_size`` values a dense layer's ``to_quantized`` takes.
QUANTIZED_GROUP_SIZES = (32, 64, 128)
#: mlx-lm's ``QuantizedKVCache.step`` (its own, whatever the layer's step).
AFFINE_STEP = 256


@dataclass(frozen=True)
class AffineQuantized:
    """What ``to_quantized(group_size, bits)`` with ``bits`` other than 8
    gives for a dense Fp16 layer: mlx-lm's ``QuantizedKVCache`` (mode
    ``"affine"``) with exactly the requested ``group_size`` and ``bits``,
    the layer's ``offset``, ``live_start`` 0 (its offset counts its rows),
    mlx-lm's own ``step`` (:data:`AFFINE_STEP`), holding the live rows as
    ``mx.quantize(rows, group_size, bits)``: they dequantize (with that
    ``group_size`` and ``bits``) to exactly the quantize-dequantize round
    trip of the live rows, in the rows' own ``dtype``."""

    mode: str
    group_size: int
    bits: int
    offset: int
    live_start: int
    step: int
    dtype: str


def to_quantized(kind: str, mode: str, offset: int, live_start: int, step: int, inplace: bool, dtype: str,
                 finite_in_float16: bool, bits: int = 8, group_size: int = 64,
                 head_dims: tuple[int, int] = (0, 0)) -> Quantized | AffineQuantized | None:
    """The to_quantized rule: ``to_quantized(group_size, bits)`` of a layer
    (rows of ``dtype``; ``head_dims`` the K and V head dims; ``offset -
    live_start`` live rows). None when the layer is returned itself, else
    :class:`Quantized` (bits 8) or :class:`AffineQuantized` (other bits).

    * a ring (``kind == "rotating"``): itself, for every integer ``bits``
      and ``group_size`` (a ring stores its float rows; nothing refused);
    * a dense layer: UnsupportedOperationError unless ``bits`` is one of
      :data:`QUANTIZED_BITS` and ``group_size`` one of
      :data:`QUANTIZED_GROUP_SIZES` (checked first, in every mode);
    * ``bits == 8``: an Int8 layer is itself; an Fp16 one gives
      :class:`Quantized` (``group_size`` does not change Int8 storage), or
      InvalidArgumentError when a live row is not finite within float16's
      range (``finite_in_float16`` false: Int8 cannot hold it);
    * other ``bits``: an Int8 layer is itself (it keeps its int8 storage);
      an Fp16 one gives :class:`AffineQuantized`, refused
      (UnsupportedOperationError) when ``live_start != 0`` (mlx-lm's
      offset counts its rows) or, with live rows, when ``group_size`` does
      not divide both head dims.
    """
    if kind == "rotating":
        return None
    if bits not in QUANTIZED_BITS or group_size not in QUANTIZED_GROUP_SIZES:
        raise UnsupportedOperationError(
            f"to_quantized: bits must be one of {QUANTIZED_BITS} and group_size one of {QUANTIZED_GROUP_SIZES}, "
            f"got bits={bits}, group_size={group_size}")
    if mode == "int8":
        return None
    if bits != 8:
        if live_start != 0:
            raise UnsupportedOperationError(
                f"to_quantized: bits={bits} needs live_start 0 (mlx-lm's offset counts its rows), got {live_start}")
        if offset > live_start and any(d % group_size for d in head_dims):
            raise UnsupportedOperationError(
                f"to_quantized: group_size={group_size} must divide the head dims {head_dims}")
        return AffineQuantized("affine", group_size, bits, offset, 0, AFFINE_STEP, dtype)
    if not finite_in_float16:
        raise InvalidArgumentError("to_quantized: keys and values must be finite within float16's range")
    return Quantized("int8", offset, live_start, step, inplace, dtype, offset - live_start)


def inplace_mechanism(backend: str, kv_cuda_inplace: str | None) -> str:
    """The mechanism an in-place write uses (``kvspec.impl.write``): ``"numpy"``
    on every backend but CUDA (``"cpu"``, ``"metal"``), whatever
    ``KV_CUDA_INPLACE`` says (the variable is read only on CUDA); on CUDA
    ``"donate"`` when the variable is unset, empty or blank, else its value
    stripped and lowercased, which must be one of :data:`CUDA_MECHANISMS`
    (InvalidArgumentError naming the variable otherwise)."""
    if backend != "cuda":
        return "numpy"
    value = (kv_cuda_inplace or "").strip().lower()
    if not value:
        return "donate"
    if value not in CUDA_MECHANISMS:
        raise InvalidArgumentError(
            f"KV_CUDA_INPLACE must be one of {', '.join(CUDA_MECHANISMS)} (unset: donate), got {value!r}")
    return value


__all__ = [
    "AFFINE_STEP",
    "CUDA_MECHANISMS",
    "INT8_SCALE_DTYPE",
    "ITEMSIZE",
    "MAX_KV_SIZE_KEEP",
    "QUANTIZED_BITS",
    "QUANTIZED_GROUP_SIZES",
    "RESERVED_METADATA_KEY",
    "AffineQuantized",
    "LayerSettings",
    "Quantized",
    "inplace_mechanism",
    "loaded_metadata",
    "nbytes",
    "prompt_cache_layout",
    "to_quantized",
]
