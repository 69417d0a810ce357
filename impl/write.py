"""The write layer: every cache writes rows through these two functions.

Two writes, chosen by the caller's ownership rule (``kvspec.spec.dense.
inplace_write_allowed``, ``kvspec.spec.rotating.rotating_inplace_allowed``,
``kvspec.spec.paged.write_in_place``), which this module never second-guesses:

* :func:`write_inplace` writes rows into the memory of an evaluated buffer.
  Every array that shares that memory (a snapshot, a held window, a forked
  sequence) sees the write; the ownership rule is what makes that harmless.
  A read of cache memory the caller schedules without waiting goes through
  :func:`queue_read`, so that a write from the host comes after it.
* :func:`write_copy` returns a new array with the rows written, leaving the
  input array unchanged. It is a *static* slice update on a fresh handle of
  the input: when nothing else references the input's memory at evaluation
  time, MLX donates it and writes in place (no whole-buffer copy); when
  anything does (a snapshot, a held window, the graph of an unevaluated
  read), MLX copies. That is MLX's own ownership rule (reference counts) and
  it is always correct. A dynamic start (``mx.slice_update`` with an
  ``mx.array`` start) is never used: on MLX's CUDA backend it never reuses
  its input, so every write would copy the whole buffer.

Where the in-place write goes depends on where arrays live
(:func:`backend`, read at each call):

* ``"cpu"`` and ``"metal"`` (host or Apple unified memory): a writable NumPy
  view of the evaluated buffer (``np.array(a, copy=False)``, which raises
  rather than silently writing into a copy). Host and device share the
  pages, so the write is visible to every later reader. Metal kernels cannot
  be built or tested where this project is developed, so Apple GPUs keep
  this path.
* ``"cuda"`` (MLX's CUDA backend; arrays in managed memory): a host write
  through a NumPy view would migrate pages to the host and back (tens of ms a
  step), so it is never used there. Two mechanisms, chosen by
  ``KV_CUDA_INPLACE`` (read at each write; :func:`cuda_inplace`):

  - ``donate`` (the default): the static slice update of :func:`write_copy`.
    MLX writes into the buffer's own memory whenever nothing else references
    it at evaluation (a decoder's steady state: measured flat from 1k to 32k
    rows), and copies it otherwise. Always correct, ordered by MLX itself
    (the output *is* the buffer, so every later read depends on it), and as
    fast as mlx-lm's own cache; but beside a holder (a snapshot, a window the
    caller keeps) the write the ownership rule allows becomes one copy, after
    which the cache owns its memory again.
  - ``kernel``: a device kernel (``mx.fast.cuda_kernel``) writes the rows into
    the buffer's memory, beside holders too, exactly as on the CPU, and the
    kernel is **evaluated before this function returns**. That costs one
    host synchronisation per write (a decode step of a 28-layer model pays
    28), so it is for engines that keep snapshots of a prompt cache and must
    not copy it, not for plain decoding.

Why no read of the window can run before a CUDA kernel write (``kernel``). MLX's CUDA
backend orders work by the buffers each node declares it reads and writes.
The kernel can only declare the buffer as an *input* (the generated
signature says ``const T*``; the kernel casts that away), so MLX records no
write to it, and a read that depends on the kernel only through
``mx.depends`` gets no edge to it: such a read was measured missing the write
97-100% of the time on MLX 0.32 CUDA. So ordering is not left to the graph: ``mx.eval`` of
the kernel's token blocks the host until the kernel has completed, and every
read of the window is built by the caller after this function returned, so
it is enqueued after a finished write. Reads enqueued *before* the write
(an earlier step's attention not yet run) only read rows below the write:
the ownership rule guarantees that the written rows were valid for no
holder. The buffer itself is evaluated first, so no pending write to it
(growth, an earlier copying write) can land after the kernel's.

Shapes: an index is a tuple of Python ints and unit-step slices, one per
leading axis of ``dst`` (like ``dst[index]``); ``src`` must broadcast to the
region it selects and is cast to ``dst``'s dtype (float16, bfloat16, float32,
int8 or the unsigned integer types). Errors: IndexError from MLX or NumPy for
an index outside ``dst``; ValueError for a region ``src`` cannot fill.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.spec.errors import InvalidArgumentError

Index = tuple[Any, ...]

#: How many in-place writes each mechanism has made in this process
#: (``"numpy"``, ``"kernel"``, ``"donate"``); the dispatch tests and ``kvspec verify
#: --device gpu`` read it to show which path ran.
COUNTS = {"numpy": 0, "kernel": 0, "donate": 0}


#: backend()'s answer for a GPU device, worked out once (what a GPU's arrays
#: are does not change within a process; the default device may: it is read
#: at each call). Keyed on the string ``"gpu"``: ``mx.DeviceType`` is a
#: Python ``Enum``, whose hash is a Python-level call (about 90 ns, paid per
#: layer per decode step), while its members are singletons, so the device
#: type is told by identity; a Device object itself is no key at all (MLX
#: hands out a new one at each ``mx.default_device()``, with its own hash).
_BACKENDS: dict[str, str] = {}

_GPU = mx.DeviceType.gpu


def backend() -> str:
    """Where the default device's arrays live: ``"cuda"`` (MLX's CUDA backend,
    managed memory), ``"metal"`` (Apple unified memory) or ``"cpu"`` (every
    device type but the GPU). The default device is read at each call
    (``mx.set_default_device`` moves it); whether a GPU is CUDA's is asked
    once (the decode path asks per layer per step)."""
    if mx.default_device().type is not _GPU:
        return "cpu"
    found = _BACKENDS.get("gpu")
    if found is None:
        found = _BACKENDS["gpu"] = "cuda" if mx.cuda.is_available() else "metal"
    return found


def _region(dst: mx.array, index: Index) -> tuple[list[int], list[int]]:
    """(start, shape) of the region ``dst[index]`` selects, one entry per axis
    of ``dst`` (an int index selects one row: shape 1). Raises IndexError for
    a region outside ``dst``, ValueError for a stepped slice."""
    if len(index) > dst.ndim:
        raise IndexError(f"write: index has {len(index)} entries for an array of rank {dst.ndim}")
    starts, shape = [], []
    for axis, size in enumerate(dst.shape):
        ix = index[axis] if axis < len(index) else slice(None)
        if isinstance(ix, slice):
            lo, hi, step = ix.indices(size)
            if step != 1:
                raise ValueError(f"write: axis {axis}: only unit-step slices are written, got step {step}")
            starts.append(lo)
            shape.append(max(0, hi - lo))
        else:
            i = int(ix)
            if not 0 <= i < size:
                raise IndexError(f"write: axis {axis}: index {i} outside [0, {size})")
            starts.append(i)
            shape.append(1)
    return starts, shape


#: the reads of cache memory last scheduled through :func:`queue_read`,
#: which the next host write waits for (then cleared)
_QUEUED: tuple[mx.array, ...] = ()


def queue_read(*arrays: mx.array) -> None:
    """Schedule ``arrays``, reads of a cache's buffer (a ring's undo-log
    gather of the row the next write overwrites), without waiting
    (``mx.async_eval``): they run on MLX's stream thread while the caller
    builds the write. The host path of :func:`write_inplace` writes from
    the Python thread, so it waits for them first; a read scheduled with
    ``mx.async_eval`` directly would race that write and read the old
    bytes, the new ones or a mix, run by run (a verdict that was
    not a function of the trace). Only the last call's arrays are kept: a
    stream runs its work in order, so once they are done every read
    queued before them is too."""
    global _QUEUED
    mx.async_eval(*arrays)
    _QUEUED = arrays


def _host_operands(dst: mx.array, src: mx.array) -> tuple[mx.array, mx.array]:
    """(``dst``, the rows) as a host write copies them: the rows cast to
    ``dst``'s dtype; bfloat16, which NumPy lacks, as uint16 views of the same
    memory (a view of the same item size shares its input's buffer, so the
    bytes are copied exactly into ``dst`` itself)."""
    if dst.dtype == mx.bfloat16:
        return mx.view(dst, mx.uint16), mx.view(mx.contiguous(src.astype(mx.bfloat16)), mx.uint16)
    return dst, src if src.dtype == dst.dtype else src.astype(dst.dtype)


def write_inplace_numpy(dst: mx.array, src: mx.array, index: Index) -> None:
    """The host path of :func:`write_inplace`: through a writable NumPy view of
    ``dst``'s memory (bfloat16, which NumPy lacks, through uint16 views: the
    bytes are copied exactly). ``dst``, the rows (cast to ``dst``'s dtype)
    and the reads last queued by :func:`queue_read` are evaluated first, in
    one ``mx.eval`` (one round trip to MLX's stream thread; none when all are
    done): the write comes after them, as the ``kernel`` (one stream, in
    order) and ``donate`` (a graph node) mechanisms order themselves.
    (Waiting for the whole stream, ``mx.synchronize``, did the same at 6 to
    50 us a write on the 2-core machine, a round trip to the stream's
    thread.)"""
    global _QUEUED
    dst, rows = _host_operands(dst, src)
    mx.eval(dst, rows, *_QUEUED)
    _QUEUED = ()
    np.array(dst, copy=False)[index] = rows
    COUNTS["numpy"] += 1


def write_inplace_numpy_pair(keys: mx.array, new_keys: mx.array, values: mx.array, new_values: mx.array,
                             index: Index) -> None:
    """:func:`write_inplace_numpy` of a key buffer and a value buffer at one
    index: both buffers, both rows and the reads last queued by
    :func:`queue_read` evaluated in one ``mx.eval`` (one round trip to the
    stream thread for the pair, where two writes pay one each), then the two
    host copies. The rows are computed before either copy, so neither reads
    the other buffer's written rows."""
    global _QUEUED
    (keys, rk), (values, rv) = _host_operands(keys, new_keys), _host_operands(values, new_values)
    mx.eval(keys, values, rk, rv, *_QUEUED)
    _QUEUED = ()
    np.array(keys, copy=False)[index] = rk
    np.array(values, copy=False)[index] = rv
    COUNTS["numpy"] += 2


_KERNEL_SOURCE = """
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) token[0] = 1;
    size_t total = 1;
    for (int k = 0; k < src_ndim; ++k) total *= (size_t)src_shape[k];
    if (i >= total) return;
    int64_t so = 0, dof = 0;
    size_t rem = i;
    for (int k = src_ndim - 1; k >= 0; --k) {
        int64_t c = (int64_t)(rem % (size_t)src_shape[k]);
        rem /= (size_t)src_shape[k];
        so += c * src_strides[k];
        dof += (c + (int64_t)start[k]) * dst_strides[k];
    }
    const_cast<T*>(dst)[dof] = src[so];
"""

_KERNEL: Any = None


def kernel_write(dst: mx.array, src: mx.array, start: list[int]) -> mx.array:
    """Launch the CUDA row-write kernel: ``src`` (already the region's shape,
    ``dst``'s dtype and rank) goes into ``dst`` at ``start``, through
    ``dst``'s strides. Returns the kernel's one-element int32 token; the
    write has happened only once the token is evaluated."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = mx.fast.cuda_kernel(
            name="kvspec_write_rows", input_names=["dst", "src", "start"], output_names=["token"],
            source=_KERNEL_SOURCE, ensure_row_contiguous=False,
        )
    total = max(1, int(np.prod(src.shape)))
    (token,) = _KERNEL(
        inputs=[dst, src, mx.array(start, dtype=mx.int32)], template=[("T", dst.dtype)],
        grid=(total, 1, 1), threadgroup=(min(256, total), 1, 1),
        output_shapes=[(1,)], output_dtypes=[mx.int32],
    )
    return token


def write_inplace_kernel(dst: mx.array, src: mx.array, index: Index) -> None:
    """The CUDA path of :func:`write_inplace`: a device kernel writes into
    ``dst``'s memory, and is evaluated (completed) before this returns (the
    module docstring says why that ordering is required)."""
    starts, shape = _region(dst, index)
    rows = mx.broadcast_to(src.astype(dst.dtype), shape) if list(src.shape) != shape else src.astype(dst.dtype)
    mx.eval(dst, rows)
    complete(kernel_write(dst, rows, starts))
    COUNTS["kernel"] += 1


def complete(token: mx.array) -> None:
    """Block until the kernel that produced ``token`` has run (``mx.eval``
    waits for the device): the ordering rule of the module docstring."""
    mx.eval(token)


CUDA_MECHANISMS = ("donate", "kernel")

# os.environ.get costs about 2 us for an unset name (its Mapping fallback
# raises and catches KeyError), paid per layer per decode step; the mapping
# it reads is os.environ's own (its ``_data``, updated by every
# ``os.environ[...] = ...``, ``monkeypatch.setenv`` included), looked up
# directly under the encoded name. Where that layout is missing, the public
# path.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_ENCODE = getattr(os.environ, "encodekey", None)
_ENV_DECODE = getattr(os.environ, "decodevalue", None)


#: encoded names of the variables read per write
_ENV_KEYS = {} if _ENV_ENCODE is None else {"KV_CUDA_INPLACE": _ENV_ENCODE("KV_CUDA_INPLACE")}


def _env_value(name: str) -> str | None:
    """``os.environ.get(name)``, read at each call, without its exception
    path for an unset name."""
    if _ENV_DATA is None or _ENV_ENCODE is None or _ENV_DECODE is None:
        return os.environ.get(name)
    raw = _ENV_DATA.get(_ENV_KEYS.get(name) or _ENV_ENCODE(name))
    return None if raw is None else _ENV_DECODE(raw)


def cuda_inplace() -> str:
    """The CUDA in-place mechanism, from ``KV_CUDA_INPLACE``: ``donate``
    (unset or empty) or ``kernel``. Raises InvalidArgumentError for anything
    else, naming the variable and the allowed values."""
    value = _env_value("KV_CUDA_INPLACE")
    if not value:  # the common case, read per decode write: nothing to parse
        return "donate"
    value = value.strip().lower() or "donate"
    if value not in CUDA_MECHANISMS:
        raise InvalidArgumentError(
            f"KV_CUDA_INPLACE must be one of {', '.join(CUDA_MECHANISMS)} (unset: donate), got {value!r}"
        )
    return value


#: KV_CUDA_INPLACE's key in os.environ's own mapping (None without that layout)
_CUDA_KEY = _ENV_KEYS.get("KV_CUDA_INPLACE")


def inplace_mechanism() -> str:
    """Which mechanism :func:`write_inplace` uses now: ``numpy`` (CPU, Metal),
    ``kernel`` or ``donate`` (CUDA, :func:`cuda_inplace`)."""
    # backend() inlined (asked per decode write: one call fewer); a GPU
    # whose answer is not known yet asks backend()
    if mx.default_device().type is not _GPU or (_BACKENDS.get("gpu") or backend()) != "cuda":
        return "numpy"
    data = _ENV_DATA
    if data is not None and _CUDA_KEY is not None and _ENV_DECODE is not None and data.get(_CUDA_KEY) is None:
        # KV_CUDA_INPLACE unset, read as cuda_inplace reads it (the common
        # case, asked per decode write: two calls fewer)
        return "donate"
    return cuda_inplace()


def inplace_keeps_memory() -> bool:
    """Whether an in-place write is guaranteed to leave the buffer's memory
    where it was (``numpy`` and ``kernel``: yes; ``donate``: only when MLX
    finds nothing else referencing it)."""
    return inplace_mechanism() != "donate"


def write_inplace(dst: mx.array, src: mx.array, index: Index, mechanism: str | None = None) -> mx.array:
    """Write ``src`` into ``dst[index]`` in ``dst``'s own memory and return the
    array that now holds the rows: ``dst`` itself for the ``numpy`` and
    ``kernel`` mechanisms (every array sharing that memory sees the write),
    a donated update of it for ``donate`` (module docstring). The caller's
    ownership rule must have proved that no holder can see those rows, and
    must keep the returned array as its buffer. ``dst`` is evaluated first
    (a lazy array has no memory to write into). ``mechanism``: what
    :func:`inplace_mechanism` returned, when the caller read it once for
    several writes (None: read it now)."""
    mech = inplace_mechanism() if mechanism is None else mechanism
    if mech == "kernel":
        write_inplace_kernel(dst, src, index)
        return dst
    if mech == "donate":
        COUNTS["donate"] += 1
        return write_copy(dst, src, index)
    write_inplace_numpy(dst, src, index)
    return dst


def write_inplace_pair(keys: mx.array, new_keys: mx.array, values: mx.array, new_values: mx.array, index: Index,
                       mechanism: str | None = None) -> tuple[mx.array, mx.array]:
    """:func:`write_inplace` of a key buffer and a value buffer at one index
    (a dense or ring cache's decode write), the mechanism read once for
    both: returns the ``(keys, values)`` arrays that now hold the rows, which
    the caller keeps as its buffers. The same writes as two calls of
    :func:`write_inplace`, in fewer Python calls (on a GPU a 28-layer decode
    step pays this host time between its kernels); on the host path in one
    evaluation (:func:`write_inplace_numpy_pair`)."""
    mech = inplace_mechanism() if mechanism is None else mechanism
    if mech == "donate":
        COUNTS["donate"] += 2
        # write_copy's body, twice (module docstring: the static slice update
        # MLX donates)
        k = keys.__copy__()
        k[index] = new_keys
        v = values.__copy__()
        v[index] = new_values
        return k, v
    if mech == "numpy":
        write_inplace_numpy_pair(keys, new_keys, values, new_values, index)
        return keys, values
    return write_inplace(keys, new_keys, index, mech), write_inplace(values, new_values, index, mech)


def write_copy(dst: mx.array, src: mx.array, index: Index) -> mx.array:
    """A new array equal to ``dst`` with ``src`` written at ``dst[index]``
    (cast to ``dst``'s dtype); ``dst`` (and every array sharing its memory)
    is unchanged. A static slice update on a fresh handle: MLX writes into
    ``dst``'s memory only when nothing else references it at evaluation,
    else copies (module docstring)."""
    # a new handle on dst's memory (copy.copy adds no graph node, unlike
    # mx.array(dst), which is a copy): the assignment replaces this handle's
    # array, never dst's
    out = dst.__copy__()  # copy.copy's own dispatch costs ~1.5 us a call on the decode path
    # MLX's slice assignment casts the update to the array's dtype itself (an
    # explicit astype cost a dtype read and a call per write, tests/test_write.py)
    out[index] = src
    return out


_ALL = slice(None)


def seq_prefix(n: int) -> Index:
    """The index of rows ``[0, n)`` along the sequence axis of ``[B, H, T, D]``
    (a three-entry tuple: MLX parses it in about a third of the time of
    ``a[:, :, :n, :]``, which the decode path pays for every layer)."""
    return (_ALL, _ALL, slice(0, n))


def seq_index(at: int, n: int, axis: int = 2) -> Index:
    """The index of rows ``[at, at + n)`` along ``axis`` (the cache's sequence
    axis, 2 in ``[B, H, T, D]``)."""
    return (slice(None),) * axis + (slice(at, at + n),)
