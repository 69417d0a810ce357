"""llama.cpp's KV memory as a ``cells`` target (``--target llama.cpp``).

llama.cpp (through llama-cpp-python's ctypes layer) is driven as a
``CellsTarget`` (docs/cells.md, the protocol of ``kvspec.fuzz.cells``):

* **Models.** Two tiny random-weight models are written at run time with
  the ``gguf`` package into a temporary folder (:func:`write_gguf`): a
  2-layer ``llama`` (one store, ``"full"``) and a 2-layer ``gemma2`` whose
  layer 0 is a sliding-window layer (window ``w``, small) and layer 1 a
  full-attention layer, which llama.cpp loads as an iSWA memory (stores
  ``"full"`` and ``"window"``). The weights come from a seed. In the gemma2
  model layer 0's attention output and feed-forward down projection are
  zero, so layer 1's input is the token's embedding alone and its K row
  depends only on (token, position), as layer 0's does.
* **Context.** One context per target, ``n_seq_max`` sequences sharing one
  stream (``kv_unified``: ``seq_cp`` shares cells), an F16 K/V cache. The
  llama model: ``n_ctx`` 256 (llama.cpp pads every cache to 256 cells). The
  gemma2 model: ``n_ctx`` 512 and ``n_ubatch`` 128, so llama.cpp sizes the
  window store smaller than the full one (llama-kv-cache-iswa.cpp: ``n_swa
  * n_seq_max + n_ubatch`` padded to 256, at most the full size): 512 full
  and 256 window cells for the windows the target is run with. The sizes
  are read from llama.cpp itself (its log line per cache, "N cells"), never
  assumed (:func:`memory_sizes`); a trace's ``n_cells`` and
  ``window_cells`` must equal them.
* **Cells.** ``observe`` reads the whole memory through
  ``llama_state_get_data`` and parses its blob (:func:`parse_memory`, the
  layout of llama.cpp's ``llama_kv_cache::state_write``): per store, every
  used cell's position, its set of sequence ids, and its K and V rows per
  layer. Pending shifts (``seq_add``/``seq_div`` before a decode) are applied
  first, as a decode would: by a decode of one more token than the memory
  has cells, in a sequence id kept for it, which llama.cpp answers with
  "no slot" after its memory update has re-rotated the shifted K rows.
* **Row names.** A table made in a separate context on the same model by
  decoding each token at positions 0, 1, ... (the first layer of each store
  has K rows that depend only on (token, position), V rows only on the
  token) names every stored row: a K row is named (token, position) of the
  table row it equals within a tolerance (a re-rotation after a shift is not
  bit-exact: about 2e-3), a V row by its token; no match: None.
* **Return codes.** ``llama_decode``: 0 -> True, 1 (no memory slot) ->
  False, -1 (invalid batch) -> ``InvalidArgumentError``; anything else ->
  ``StateError``. Arguments that llama.cpp answers with an abort of the
  whole process (a sequence id outside ``[0, n_seq)``, a batch over
  ``n_batch`` tokens, ``seq_div`` by ``d < 1``) are refused here with
  ``InvalidArgumentError`` before any call: the process must survive them.
* **Limits, checked up front.** What the target cannot run at all (a
  token outside the model's vocabulary, a group of more than ``n_ubatch``
  tokens, sizes other than llama.cpp's, a layout without a model, ``n_seq``
  over 64, ``dtype``/``kv_heads``/``head_dim`` other than the model's) is
  found on the whole trace before any op runs (:func:`trace_limits`:
  ``kvspec replay`` exits 2, "not applicable", naming the field and the
  limit), never charged to llama.cpp as a divergence. A refusal the adapter
  makes itself before calling llama.cpp is recorded
  (:attr:`LlamaCppCells.refused_first`) so that a search can tell it from
  llama.cpp's: on an op the spec accepts it is the harness's failure.
* **Paranoid mode** (``paranoid=True``): every observation of rows forces
  llama.cpp's memory update first, whether or not the adapter saw a shift.
  A divergence that disappears there came from the adapter's bookkeeping of
  pending shifts, not from llama.cpp (``kvspec conformance`` confirms every
  finding in this mode).

Imports llama_cpp and gguf lazily; :func:`require` raises
:class:`NotInstalled` (the CLI: exit 2) without them.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvspec.fuzz.targets import CacheClass, Target, TargetCapabilityError
from kvspec.spec.errors import InvalidArgumentError, StateError

#: the llama-cpp-python release this target was built and checked against
LLAMA_CPP_PYTHON = "0.3.36"
#: the llama.cpp commit vendored in that release's sdist (its CHANGELOG)
VENDORED_LLAMA_CPP = "0c1e57098"
#: kvspec is installed from its repository (it is not on PyPI)
INSTALL_HINT = "pip install -e '.[llama-cpp]' (from the kvspec repository)"
#: llama.cpp pads every cache to a multiple of 256 cells
N_CELLS = 256
#: n_ctx per model architecture: the llama model's one store has 256 cells;
#: the gemma2 model's full store 512, so that its window store (sized from
#: n_swa, n_seq_max and n_ubatch, padded to 256) can be smaller
N_CTX = {"llama": 256, "gemma2": 512}
#: n_ubatch per model architecture (n_batch = n_ctx): the gemma2 model's
#: 128 keeps ``n_swa * n_seq_max + n_ubatch`` within 256 for small windows
N_UBATCH = {"llama": 256, "gemma2": 128}
#: K rows named within this absolute tolerance, scaled by the row's largest entry
K_TOLERANCE = 4e-3


class AdapterRefusal(InvalidArgumentError):
    """An argument the adapter refuses before calling llama.cpp (llama.cpp
    would abort the process, or the target has no model for it). A refusal
    like any other to the lockstep; a search checks that the spec refused
    the op too (else the harness, not llama.cpp, is at fault)."""


class NotInstalled(RuntimeError):
    """llama-cpp-python or gguf is missing (the CLI exits 2 with the hint)."""


def require() -> tuple[Any, Any]:
    """``(llama_cpp, gguf)`` modules; raises :class:`NotInstalled` naming
    the extra to install."""
    try:
        import gguf
        import llama_cpp
    except ImportError as e:  # pragma: no cover - depends on the install
        raise NotInstalled(f"--target llama.cpp: llama-cpp-python not installed ({e.name} missing): "
                           f"{INSTALL_HINT}") from None
    return llama_cpp, gguf


def installed() -> bool:
    """Whether :func:`require` would succeed."""
    try:
        require()
    except NotInstalled:
        return False
    return True


def llama_cpp_version() -> str:
    """``llama-cpp-python 0.3.36 (llama.cpp 0c1e57098)`` or ``not installed``."""
    try:
        llama_cpp, _ = require()
    except NotInstalled:
        return "llama-cpp-python not installed"
    version = getattr(llama_cpp, "__version__", "?")
    vendored = VENDORED_LLAMA_CPP if version == LLAMA_CPP_PYTHON else "unknown commit"
    return f"llama-cpp-python {version} (llama.cpp {vendored})"


# ---------------------------------------------------------------- models


@dataclass(frozen=True)
class TinyModel:
    """A random-weight model written as GGUF.

    ``arch``: ``"llama"`` (one store, ``("full",)``) or ``"gemma2"`` (layer 0
    windowed with ``window`` tokens, layer 1 full: ``("full", "window")``).
    ``hidden`` = ``n_head * head_dim``; K/V rows have ``n_head_kv * head_dim``
    entries (float16 in the cache). ``seed`` fixes every weight."""

    arch: str = "llama"
    n_vocab: int = 24
    hidden: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_layer: int = 2
    window: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "gemma2"):
            raise InvalidArgumentError(f"TinyModel: arch {self.arch!r} must be 'llama' or 'gemma2'")
        if (self.arch == "gemma2") != (self.window is not None):
            raise InvalidArgumentError("TinyModel: window is set exactly for arch 'gemma2'")
        if self.window is not None and self.window < 1:
            raise InvalidArgumentError(f"TinyModel: window {self.window} must be >= 1")
        if self.n_vocab < 4 or self.hidden % self.n_head or self.n_head % self.n_head_kv:
            raise InvalidArgumentError("TinyModel: n_vocab >= 4, hidden % n_head == 0, n_head % n_head_kv == 0")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head

    @property
    def stores(self) -> tuple[str, ...]:
        return ("full", "window") if self.arch == "gemma2" else ("full",)


LLAMA = TinyModel()
GEMMA2 = TinyModel(arch="gemma2", window=4, seed=1)


def write_gguf(path: str | Path, model: TinyModel) -> Path:
    """Write ``model`` as a GGUF file at ``path`` (float32 tensors, an
    SPM-style vocabulary of ``n_vocab`` tokens: 0 unknown, 1 BOS, 2 EOS)."""
    _, gguf = require()
    rng = np.random.default_rng(model.seed)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), model.arch)
    a = model.arch
    w.add_context_length(4096)
    w.add_embedding_length(model.hidden)
    w.add_block_count(model.n_layer)
    w.add_feed_forward_length(model.n_ff)
    w.add_head_count(model.n_head)
    w.add_head_count_kv(model.n_head_kv)
    w.add_rope_dimension_count(model.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_key_length(model.head_dim)
    w.add_value_length(model.head_dim)
    if a == "gemma2":
        w.add_sliding_window(int(model.window or 0))
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"t{i}".encode() for i in range(3, model.n_vocab)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * model.n_vocab)
    w.add_token_types([2, 3, 3] + [1] * (model.n_vocab - 3))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def t(name: str, *shape: int, scale: float = 0.5, zero: bool = False) -> None:
        arr = np.zeros(shape, np.float32) if zero else (rng.standard_normal(shape) * scale).astype(np.float32)
        w.add_tensor(name, arr)

    def ones(name: str) -> None:
        w.add_tensor(name, np.ones(model.hidden, np.float32))

    d, kv = model.hidden, model.n_head_kv * model.head_dim
    t("token_embd.weight", model.n_vocab, d, scale=1.0)
    ones("output_norm.weight")
    if a == "llama":
        t("output.weight", model.n_vocab, d, scale=0.2)
    for i in range(model.n_layer):
        # gemma2: layer 0 adds nothing to the residual stream (see the module docstring)
        silent = a == "gemma2" and i == 0
        ones(f"blk.{i}.attn_norm.weight")
        t(f"blk.{i}.attn_q.weight", d, d, scale=d ** -0.5)
        t(f"blk.{i}.attn_k.weight", kv, d, scale=d ** -0.5)
        t(f"blk.{i}.attn_v.weight", kv, d, scale=d ** -0.5)
        t(f"blk.{i}.attn_output.weight", d, d, scale=d ** -0.5, zero=silent)
        ones(f"blk.{i}.ffn_norm.weight")
        t(f"blk.{i}.ffn_gate.weight", model.n_ff, d, scale=d ** -0.5)
        t(f"blk.{i}.ffn_up.weight", model.n_ff, d, scale=d ** -0.5)
        t(f"blk.{i}.ffn_down.weight", d, model.n_ff, scale=model.n_ff ** -0.5, zero=silent)
        if a == "gemma2":
            ones(f"blk.{i}.post_attention_norm.weight")
            ones(f"blk.{i}.post_ffw_norm.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------- the state blob


@dataclass
class BlobCell:
    """One cell of a state blob: position, sequence ids, and per layer of its
    store the K row and V row (float32 copies, ``(n_embd_kv,)`` each)."""

    pos: int
    seqs: frozenset[int]
    k: list[np.ndarray] = field(default_factory=list)
    v: list[np.ndarray] = field(default_factory=list)


_DTYPES = {0: np.float32, 1: np.float16}


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise StateError(f"state blob: truncated at byte {self.at} (wants {n} more of {len(self.data)})")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def i32(self) -> int:
        return int(struct.unpack("<i", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])


def _parse_store(r: _Reader, has_ext: bool = False) -> list[BlobCell]:
    """One ``llama_kv_cache::state_write`` record (every stream)."""
    cells: list[BlobCell] = []
    n_stream = r.u32()
    for _ in range(n_stream):
        count = r.u32()
        if count == 0:
            continue
        mine: list[BlobCell] = []
        for _ in range(count):
            pos = r.i32()
            n_seq = r.u32()
            if has_ext:  # pragma: no cover - M-RoPE / PLE models only
                r.take(12)
            mine.append(BlobCell(pos, frozenset(r.i32() for _ in range(n_seq))))
        v_trans = r.u32()
        n_layer = r.u32()
        for _ in range(n_layer):
            dtype = _dtype(r.i32())
            size_row = r.u64()
            raw = np.frombuffer(r.take(size_row * count), dtype=dtype).reshape(count, -1)
            for c, row in zip(mine, raw):
                c.k.append(row.astype(np.float32))
        for _ in range(n_layer):
            dtype = _dtype(r.i32())
            if not v_trans:
                size_row = r.u64()
                raw = np.frombuffer(r.take(size_row * count), dtype=dtype).reshape(count, -1)
            else:
                r.u32()  # element size
                n_embd_v = r.u32()
                itemsize = np.dtype(dtype).itemsize
                raw = np.frombuffer(r.take(itemsize * count * n_embd_v), dtype=dtype).reshape(n_embd_v, count).T
            for c, row in zip(mine, raw):
                c.v.append(row.astype(np.float32))
        cells += mine
    return cells


def _dtype(code: int) -> Any:
    if code not in _DTYPES:
        raise StateError(f"state blob: K/V type {code} is not F32 (0) or F16 (1)")
    return _DTYPES[code]


def parse_memory(data: bytes, n_stores: int) -> list[list[BlobCell]]:
    """Parse a whole-context blob (``llama_state_get_data``): the
    architecture name, then ``n_stores`` cache records (an iSWA memory
    writes its full store, then its window store). Raises StateError on a
    truncated or unknown blob."""
    r = _Reader(data)
    r.take(r.u32())  # architecture name
    out = [_parse_store(r) for _ in range(n_stores)]
    if r.at != len(data):
        raise StateError(f"state blob: {len(data) - r.at} bytes left after {n_stores} stores")
    return out


SEQ_MAGIC = 0xAF143CD8


def parse_sequence(data: bytes, n_stores: int) -> tuple[int, list[list[BlobCell]]]:
    """Parse a per-sequence blob (``llama_state_seq_get_data``): magic, the
    sequence id it was saved from, then ``n_stores`` cache records."""
    r = _Reader(data)
    if r.u32() != SEQ_MAGIC:
        raise StateError("sequence blob: bad magic")
    seq = r.i32()
    out = [_parse_store(r) for _ in range(n_stores)]
    if r.at != len(data):
        raise StateError(f"sequence blob: {len(data) - r.at} bytes left after {n_stores} stores")
    return seq, out


# ---------------------------------------------------------------- engine


class _Loaded:
    """A model file loaded once, its row table built lazily."""

    def __init__(self, model: TinyModel, folder: Path) -> None:
        llama_cpp, _ = require()
        self.lib = llama_cpp
        self.model = model
        self.path = write_gguf(folder / f"{model.arch}-{model.seed}.gguf", model)
        _quiet(llama_cpp)
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        self.handle = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.handle:
            raise StateError(f"llama.cpp could not load the model written at {self.path.name}")
        self.table: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.table_positions = 0
        self._table_ctx: Context | None = None

    def rows(self, upto: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per store: K table ``(n_vocab, P, n_embd_kv)`` and V table
        ``(n_vocab, n_embd_kv)`` (float32), P >= ``upto`` positions, made by
        decoding each token alone at positions 0..P-1 in a scratch context."""
        while self.table_positions < upto:
            self._extend()
        return self.table

    def _extend(self) -> None:
        if self._table_ctx is None:
            self._table_ctx = Context(self, n_seq=1)
        ctx = self._table_ctx
        start, n = self.table_positions, N_CELLS
        stores = self.model.stores
        k_new = {s: np.zeros((self.model.n_vocab, n, 0), np.float32) for s in stores}
        v_new: dict[str, np.ndarray] = {}
        for tok in range(self.model.n_vocab):
            ctx.clear()
            rc = ctx.decode_raw([0], [tok] * n, start)
            if rc != 0:
                raise StateError(f"row table: llama_decode returned {rc} for token {tok} at {start}")
            for s, cells in zip(stores, ctx.read()):
                cells = sorted(cells, key=lambda c: c.pos)
                k = np.stack([c.k[0] for c in cells])
                if k_new[s].shape[2] == 0:
                    k_new[s] = np.zeros((self.model.n_vocab, n, k.shape[1]), np.float32)
                k_new[s][tok] = k
                v_new.setdefault(s, np.zeros((self.model.n_vocab, cells[0].v[0].shape[0]), np.float32))
                v_new[s][tok] = cells[0].v[0]
        ctx.clear()
        for s in stores:
            if s in self.table:
                k_old, v_old = self.table[s]
                self.table[s] = (np.concatenate([k_old, k_new[s]], axis=1), v_old)
            else:
                self.table[s] = (k_new[s], v_new[s])
        self.table_positions += n


#: where llama.cpp's log goes while :func:`_captured_log` is active (else nowhere)
_LOG_SINK: list[list[str]] = []


@contextlib.contextmanager
def _captured_log() -> Any:
    """The text llama.cpp logs inside the block, as a list of fragments."""
    got: list[str] = []
    _LOG_SINK.append(got)
    try:
        yield got
    finally:
        _LOG_SINK.remove(got)


def _quiet(llama_cpp: Any) -> None:
    """Silence llama.cpp's logging (a ctypes callback kept alive on the
    module); text logged inside :func:`_captured_log` is kept there."""
    if getattr(llama_cpp, "_kvspec_quiet", None) is None:
        @llama_cpp.llama_log_callback
        def _log(level: int, text: bytes, user: Any) -> None:
            if _LOG_SINK:
                _LOG_SINK[-1].append(text.decode("utf-8", "replace"))

        llama_cpp._kvspec_quiet = _log
        llama_cpp.llama_log_set(_log, ctypes.c_void_p(0))


_LOADED: dict[TinyModel, _Loaded] = {}
_FOLDER: tempfile.TemporaryDirectory[str] | None = None


def load(model: TinyModel) -> _Loaded:
    """The model, written and loaded once per process."""
    global _FOLDER
    if model not in _LOADED:
        if _FOLDER is None:
            _FOLDER = tempfile.TemporaryDirectory(prefix="kvspec-llama-cpp-")
        _LOADED[model] = _Loaded(model, Path(_FOLDER.name))
    return _LOADED[model]


class Context:
    """One llama.cpp context: ``n_seq`` usable sequence ids (plus one kept
    for forcing pending shifts) sharing one stream; ``sizes``: the cells of
    each store (model order: ``full``, then ``window``) as llama.cpp
    reported them when it built the memory."""

    def __init__(self, loaded: _Loaded, n_seq: int) -> None:
        lib = loaded.lib
        self.lib, self.loaded, self.n_seq = lib, loaded, n_seq
        arch = loaded.model.arch
        self.n_batch, self.n_ubatch = N_CTX[arch], N_UBATCH[arch]
        p = lib.llama_context_default_params()
        p.n_ctx = N_CTX[arch]
        p.n_batch = self.n_batch
        p.n_ubatch = self.n_ubatch
        p.n_seq_max = n_seq + 1
        p.kv_unified = True
        p.swa_full = False
        p.n_threads = 1
        p.n_threads_batch = 1
        p.type_k = lib.GGML_TYPE_F16
        p.type_v = lib.GGML_TYPE_F16
        p.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.no_perf = True
        with _captured_log() as log:
            self.ctx = lib.llama_init_from_model(loaded.handle, p)
        if not self.ctx:
            raise StateError("llama.cpp could not create a context")
        self.mem = lib.llama_get_memory(self.ctx)
        self.n_stores = len(loaded.model.stores)
        got = [int(n) for n in re.findall(r"\(\s*(\d+) cells,", "".join(log))]
        if len(got) != self.n_stores:
            raise StateError(f"llama.cpp reported {len(got)} KV cache sizes for the {loaded.model.arch} model's "
                             f"{self.n_stores} stores: {got}")
        #: store -> cells, as llama.cpp built them (the iSWA memory builds its full store first)
        self.sizes = dict(zip(loaded.model.stores, got, strict=True))

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:  # pragma: no cover - finaliser
        with contextlib.suppress(AttributeError, TypeError):  # a half-built or interpreter-exit object
            self.close()

    def decode_raw(self, seqs: list[int], tokens: list[int], pos0: int) -> int:
        """``llama_decode`` of one group: every token held by every sequence
        of ``seqs``, positions ``pos0, pos0+1, ...``; its return code."""
        lib = self.lib
        n = len(tokens)
        batch = lib.llama_batch_init(n, 0, max(1, len(seqs)))
        try:
            batch.n_tokens = n
            for i, tok in enumerate(tokens):
                batch.token[i] = tok
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = len(seqs)
                for j, s in enumerate(seqs):
                    batch.seq_id[i][j] = s
                batch.logits[i] = 1 if i == n - 1 else 0
            return int(lib.llama_decode(self.ctx, batch))
        finally:
            lib.llama_batch_free(batch)

    def update(self, used: bool) -> None:
        """Apply pending shifts: with a cell ``used``, a decode of as many
        tokens as the full store has cells (``n_batch``), in the kept
        sequence id, passes validation, runs llama.cpp's memory update (the
        K-shift), then finds no slot in the full store (return 1, no cell
        changed). An empty memory has nothing to shift."""
        if not used:
            return
        spare = self.n_seq
        if self.lib.llama_memory_seq_pos_max(self.mem, spare) >= 0:  # pragma: no cover - never decoded into
            raise StateError("the spare sequence id holds cells")
        rc = self.decode_raw([spare], [0] * self.n_batch, 0)
        if rc != 1:
            raise StateError(f"update: the oversize decode returned {rc}, expected 1 (no slot)")

    def read(self) -> list[list[BlobCell]]:
        """Every used cell per store, from the whole-context state blob."""
        lib = self.lib
        size = lib.llama_state_get_size(self.ctx)
        buf = (ctypes.c_uint8 * size)()
        got = lib.llama_state_get_data(self.ctx, buf, size)
        if got == 0:
            raise StateError("llama_state_get_data wrote nothing")
        return parse_memory(bytes(buf)[:got], self.n_stores)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.mem, True)


# ---------------------------------------------------------------- the target


@dataclass(frozen=True)
class Snapshot:
    """A sequence's state as llama.cpp saved it (``llama_state_seq_get_data``)."""

    seq: int
    blob: bytes


class LlamaCppCells:
    """llama.cpp's memory as a ``CellsTarget`` (docs/cells.md, section 4).

    ``window`` None: the llama model (store ``"full"``); an int ``w >= 1``:
    the gemma2 model with that sliding window (stores ``"full"``,
    ``"window"``). ``n_seq`` sequence ids 0..n_seq-1. ``sizes``: each
    store's cells as llama.cpp built them (:data:`N_CTX`: 256 for the llama
    model; 512 full and, for small windows, 256 window cells for gemma2).
    ``paranoid``: every observation of rows forces llama.cpp's memory update
    (pending shifts applied) whether or not a shift was seen (the module
    docstring). Raises NotInstalled without llama-cpp-python."""

    name = "llama.cpp"

    def __init__(self, window: int | None = None, n_seq: int = 4, seed: int | None = None,
                 paranoid: bool = False) -> None:
        if n_seq < 1 or n_seq > 64:
            raise InvalidArgumentError(f"llama.cpp target: n_seq {n_seq} must be in [1, 64]")
        base = LLAMA if window is None else TinyModel(arch="gemma2", window=window, seed=GEMMA2.seed)
        model = base if seed is None else TinyModel(base.arch, window=base.window, seed=seed)
        self.loaded = load(model)
        self.model = model
        self.stores: tuple[str, ...] = model.stores
        self.window = window
        self.n_seq = n_seq
        self.c = Context(self.loaded, n_seq)
        self.sizes = dict(self.c.sizes)
        self.n_cells = self.sizes["full"]
        self.lib = self.loaded.lib
        #: a seq_add/seq_div since the last memory update (a decode past
        #: validation, or an observation's forced update)
        self._shifted = False
        self.paranoid = paranoid
        #: the refusal the adapter made itself (before calling llama.cpp) in
        #: the last op, None when the op reached llama.cpp (or succeeded)
        self.refused_first: str | None = None

    def _refuse(self, message: str) -> AdapterRefusal:
        self.refused_first = message
        return AdapterRefusal(message)

    # -- arguments llama.cpp would abort the process on

    def _seq(self, op: str, name: str, seq: Any, allow_all: bool = False) -> int:
        """``seq`` as llama.cpp takes it; the first check of every op but
        ``clear`` (it clears :attr:`refused_first`). ``allow_all``: -1 (every sequence,
        ``seq_rm``) passes; any other negative id is refused as out of range."""
        self.refused_first = None
        if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)):
            raise self._refuse(f"{op}: {name} {seq!r} must be an int")
        if allow_all and seq == -1:
            return -1
        if not 0 <= seq < self.n_seq:
            raise self._refuse(f"{op}: {name} {seq} must be in [0, {self.n_seq})"
                               + (" or -1" if allow_all else "") + " (llama.cpp aborts the process otherwise)")
        return int(seq)

    @staticmethod
    def _pos(p: Any) -> int:
        return -1 if p is None else int(p)

    # -- ops

    def decode(self, seqs: Any, tokens: Any, pos0: int) -> bool:
        """One group (every token held by every sequence of ``seqs``); True,
        False (no slot: llama_decode 1); InvalidArgumentError for llama_decode -1."""
        self.refused_first = None
        seqs = [self._seq("decode", "seq", s) for s in seqs]
        tokens = [int(t) for t in tokens]
        if not tokens or len(tokens) > self.c.n_ubatch:
            raise self._refuse(f"decode: {len(tokens)} tokens must be in [1, {self.c.n_ubatch}] (n_ubatch: a "
                               "longer group is split into ubatches, each finding its own slot)")
        if not seqs:
            raise self._refuse("decode: seqs must not be empty")
        rc = self.c.decode_raw(seqs, tokens, int(pos0))
        if rc in (0, 1):  # past validation: llama.cpp's memory update ran
            self._shifted = False
        if rc == 0:
            return True
        if rc == 1:
            return False
        if rc == -1:
            raise InvalidArgumentError(f"decode: llama_decode returned -1 (invalid batch: seqs {seqs}, "
                                       f"{len(tokens)} tokens at {pos0})")
        raise StateError(f"decode: llama_decode returned {rc}")

    def seq_rm(self, seq: int, p0: int | None, p1: int | None) -> bool:
        s = self._seq("seq_rm", "seq", seq, allow_all=True)
        return bool(self.lib.llama_memory_seq_rm(self.c.mem, s, self._pos(p0), self._pos(p1)))

    def seq_cp(self, src: int, dst: int, p0: int | None, p1: int | None) -> None:
        s, d = self._seq("seq_cp", "src", src), self._seq("seq_cp", "dst", dst)
        self.lib.llama_memory_seq_cp(self.c.mem, s, d, self._pos(p0), self._pos(p1))

    def seq_keep(self, seq: int) -> None:
        self.lib.llama_memory_seq_keep(self.c.mem, self._seq("seq_keep", "seq", seq))

    def seq_add(self, seq: int, p0: int | None, p1: int | None, delta: int) -> None:
        s = self._seq("seq_add", "seq", seq)
        self.lib.llama_memory_seq_add(self.c.mem, s, self._pos(p0), self._pos(p1), int(delta))
        self._shifted = True

    def seq_div(self, seq: int, p0: int | None, p1: int | None, d: int) -> None:
        s = self._seq("seq_div", "seq", seq)
        if int(d) < 1:
            raise self._refuse(f"seq_div: d {d} must be >= 1 (llama.cpp divides by it)")
        self.lib.llama_memory_seq_div(self.c.mem, s, self._pos(p0), self._pos(p1), int(d))
        self._shifted = True

    def pos_min(self, seq: int) -> int:
        return int(self.lib.llama_memory_seq_pos_min(self.c.mem, self._seq("pos_min", "seq", seq)))

    def pos_max(self, seq: int) -> int:
        return int(self.lib.llama_memory_seq_pos_max(self.c.mem, self._seq("pos_max", "seq", seq)))

    def save(self, seq: int) -> Snapshot:
        s = self._seq("save", "seq", seq)
        lib = self.lib
        size = lib.llama_state_seq_get_size(self.c.ctx, s)
        buf = (ctypes.c_uint8 * size)()
        got = lib.llama_state_seq_get_data(self.c.ctx, buf, size, s)
        if got == 0:
            raise StateError(f"save: llama_state_seq_get_data wrote nothing for seq {s}")
        return Snapshot(s, bytes(buf)[:got])

    def restore(self, snapshot: Snapshot, dst: int) -> bool:
        d = self._seq("restore", "dst", dst)
        if not isinstance(snapshot, Snapshot):
            raise self._refuse(f"restore: snapshot {type(snapshot).__name__} is not a llama.cpp Snapshot")
        buf = (ctypes.c_uint8 * len(snapshot.blob)).from_buffer_copy(snapshot.blob)
        return bool(self.lib.llama_state_seq_set_data(self.c.ctx, buf, len(snapshot.blob), d))

    def clear(self) -> None:
        self.refused_first = None
        self.c.clear()

    # -- observation

    def observe(self, rows: bool = True) -> dict[str, list[tuple[int, frozenset[int], Any, Any]]]:
        """Per store ``(pos, seqs, k_name, v_name)`` of every used cell, pending
        shifts applied first (:meth:`Context.update`, when a shift was made
        since llama.cpp's last memory update; always in paranoid mode).
        ``rows=False``: the rows are not read and a pending shift stays
        pending (names None)."""
        if not rows:
            return {store: [(c.pos, c.seqs, None, None) for c in cells]
                    for store, cells in zip(self.stores, self.c.read())}
        if self._shifted or self.paranoid:
            # any used cell of any store (every sequence id, the spare one included)
            self.c.update(any(self.c.read()))
            self._shifted = False
        out: dict[str, list[tuple[int, frozenset[int], Any, Any]]] = {}
        cells_per_store = self.c.read()
        top = max((c.pos for cells in cells_per_store for c in cells), default=0)
        table = self.loaded.rows(top + 1)
        for store, cells in zip(self.stores, cells_per_store):
            out[store] = [(c.pos, c.seqs, *name_rows(table[store], c)) for c in cells]
        return out

    def observe_snapshot(self, snapshot: Snapshot) -> dict[str, list[tuple[int, Any, Any]]]:
        """Per store ``(pos, k_name, v_name)`` of the cells the snapshot holds."""
        _, stores = parse_sequence(snapshot.blob, len(self.stores))
        top = max((c.pos for cells in stores for c in cells), default=0)
        table = self.loaded.rows(top + 1)
        return {store: [(c.pos, *name_rows(table[store], c)) for c in cells]
                for store, cells in zip(self.stores, stores)}

    def close(self) -> None:
        self.c.close()


def name_rows(table: tuple[np.ndarray, np.ndarray], cell: BlobCell) -> tuple[Any, Any]:
    """``(k_name, v_name)`` of a cell's first-layer rows: the V row's token
    (exact up to float16 rounding), the K row's (token, position) within
    ``K_TOLERANCE``; None where no table row matches. The cell's own
    position is tried first, then every position of the table."""
    k_tab, v_tab = table
    v = cell.v[0]
    dv = np.abs(v_tab - v).max(axis=1)
    t = int(np.argmin(dv))
    v_name = t if dv[t] <= K_TOLERANCE * max(1.0, float(np.abs(v).max())) else None
    k = cell.k[0]
    tol = K_TOLERANCE * max(1.0, float(np.abs(k).max()))
    if (v_name is not None and 0 <= cell.pos < k_tab.shape[1]
            and np.abs(k_tab[v_name, cell.pos] - k).max() <= tol):
        return (v_name, cell.pos), v_name
    dk = np.abs(k_tab - k).max(axis=2)
    tok, pos = np.unravel_index(int(np.argmin(dk)), dk.shape)
    k_name = (int(tok), int(pos)) if dk[tok, pos] <= tol else None
    return k_name, v_name


#: the store layouts the target has a model for
LAYOUTS = (("full",), ("full", "window"))


_SIZES: dict[tuple[int | None, int], dict[str, int]] = {}


def memory_sizes(window: int | None, n_seq: int) -> dict[str, int]:
    """The cells of each store of the memory llama.cpp builds for the
    target's model with ``window`` (None: the llama model) and ``n_seq``
    sequences, as llama.cpp reports them (one context built and freed per
    pair, then remembered). NotInstalled without llama-cpp-python."""
    key = (window, n_seq)
    if key not in _SIZES:
        model = LLAMA if window is None else TinyModel(arch="gemma2", window=window, seed=GEMMA2.seed)
        ctx = Context(load(model), n_seq)
        try:
            _SIZES[key] = dict(ctx.sizes)
        finally:
            ctx.close()
    return _SIZES[key]


def cache_sizes(cache: dict[str, Any]) -> dict[str, int]:
    """``{"n_cells": ..., "window_cells": ...}``: the sizes a cells trace
    must carry to run on llama.cpp with its ``stores``, ``window`` and
    ``n_seq`` (:func:`memory_sizes`; ``window_cells`` = ``n_cells`` without
    a window store)."""
    stores = tuple(cache.get("stores", ("full",)))
    sizes = memory_sizes(cache.get("window") if "window" in stores else None, int(cache.get("n_seq", 4)))
    return {"n_cells": sizes["full"], "window_cells": sizes.get("window", sizes["full"])}


def _size_error(cache: dict[str, Any]) -> str | None:
    """Why ``cache``'s sizes are not llama.cpp's, naming the field; None if they are."""
    want = cache_sizes(cache)
    have = {"n_cells": cache.get("n_cells"), "window_cells": cache.get("window_cells")}
    if have["window_cells"] in (None, "n_cells"):
        have["window_cells"] = have["n_cells"]
    for name, value in want.items():
        if have[name] != value:
            return (f"field cache.{name}: llama.cpp builds this memory ({cache_text(cache)}) with "
                    f"{want['n_cells']} full and {want['window_cells']} window cells, the trace has "
                    f"{name} {have[name]!r}")
    return None


def cache_text(cache: dict[str, Any]) -> str:
    stores = list(cache.get("stores", ("full",)))
    return f"stores {stores}, window {cache.get('window')!r}, n_seq {cache.get('n_seq', 4)}"


#: the cache fields the target's models fix (TinyModel: 2 KV heads of 16, a float16 cache)
MODEL_FIELDS = {"dtype": "float16", "kv_heads": LLAMA.n_head_kv, "head_dim": LLAMA.head_dim}


def trace_limits(cache: dict[str, Any], ops: list[dict[str, Any]]) -> str | None:
    """Why the target cannot run this trace at all, naming the field and
    the limit (``"field cache.dtype: ..."``, ``"op 3 field 'tokens': ..."``),
    or None. Checked on the whole trace before any op runs, so that a
    limit of the target is never taken for llama.cpp's divergence: the
    cache's layout, ``n_seq`` (1..64), sizes (:func:`cache_sizes`) and
    :data:`MODEL_FIELDS`; every decode's tokens (ids in ``[0, n_vocab)`` of
    the model, at most ``n_ubatch`` of them: :data:`N_UBATCH`). Ops the
    spec refuses anyway (an empty group, a sequence id out of range) are
    left to the lockstep: both sides refuse them. NotInstalled without
    llama-cpp-python (the sizes are read from llama.cpp)."""
    stores = tuple(cache.get("stores", ("full",)))
    if stores not in LAYOUTS:
        return (f"field cache.stores: target llama.cpp has models for {[list(x) for x in LAYOUTS]}, this trace "
                f"has {list(stores)}")
    n_seq = cache.get("n_seq", 4)
    if isinstance(n_seq, bool) or not isinstance(n_seq, int) or not 1 <= n_seq <= 64:
        return f"field cache.n_seq: target llama.cpp takes 1 to 64 sequences, this trace has {n_seq!r}"
    for name, value in MODEL_FIELDS.items():
        if name in cache and cache[name] != value:
            return (f"field cache.{name}: the target's models have {name} {value!r}, this trace has "
                    f"{cache[name]!r} (a trace for llama.cpp sets dtype 'float16', kv_heads 2, head_dim 16; "
                    "left out, they take the kvtrace defaults)")
    why = _size_error(cache)
    if why is not None:
        return why
    arch = "gemma2" if "window" in stores else "llama"
    n_vocab, n_ubatch = LLAMA.n_vocab, N_UBATCH[arch]
    for i, op in enumerate(ops):
        if op.get("op") != "decode" or not isinstance(op.get("tokens"), list):
            continue
        toks = op["tokens"]
        if len(toks) > n_ubatch:
            return (f"op {i} field 'tokens': {len(toks)} tokens in one decode; target llama.cpp takes at most "
                    f"n_ubatch {n_ubatch} for this model (a longer group is split into ubatches, each finding its "
                    "own slot: not one group)")
        bad = [t for t in toks if isinstance(t, int) and not isinstance(t, bool) and not 0 <= t < n_vocab]
        if bad:
            return (f"op {i} field 'tokens': token {bad[0]} is outside the target's vocabulary [0, {n_vocab})")
    return None


def target_factory(cache: dict[str, Any], paranoid: bool = False) -> LlamaCppCells:
    """A fresh llama.cpp memory for a cells trace's ``cache`` fields
    (``kvspec.fuzz.cells``: ``{"target": target_factory}``). Raises
    InvalidArgumentError naming the field when llama.cpp cannot take the
    configuration: ``n_cells`` / ``window_cells`` other than the sizes
    llama.cpp builds (:func:`cache_sizes`), a window-only layout, ``n_seq``
    over 64; NotInstalled without llama-cpp-python. ``paranoid``: see
    :class:`LlamaCppCells`."""
    stores = tuple(cache.get("stores", ("full",)))
    if stores not in LAYOUTS:
        raise InvalidArgumentError(f"llama.cpp target: cache.stores {list(stores)} must be one of "
                                   f"{[list(x) for x in LAYOUTS]} (the llama and gemma2 models)")
    if not 1 <= int(cache.get("n_seq", 4)) <= 64:
        raise InvalidArgumentError(f"llama.cpp target: cache.n_seq {cache.get('n_seq')!r} must be in [1, 64]")
    why = _size_error(cache)
    if why is not None:
        raise InvalidArgumentError(f"llama.cpp target: {why}")
    return LlamaCppCells(window=cache.get("window") if "window" in stores else None, n_seq=int(cache["n_seq"]),
                         paranoid=paranoid)


def paranoid_factory(cache: dict[str, Any]) -> LlamaCppCells:
    """:func:`target_factory` in paranoid mode (every read forces the memory update)."""
    return target_factory(cache, paranoid=True)


# ---------------------------------------------------------------- as a --target


def _class(name: str) -> CacheClass:
    sizes = {"llama_kv_cache": (N_CTX["llama"], N_CTX["llama"]), "llama_kv_cache_iswa": (N_CTX["gemma2"], 256)}[name]
    return CacheClass(name, "cells", "fp16", target_factory,
                      fields={"n_cells": (sizes[0], "the full store's cells: llama.cpp pads every cache to 256"),
                              "window_cells": (sizes[1], ("the window store's cells, as llama.cpp sizes them "
                                                          "(window 4, 3 sequences)"))},
                      not_compared={"cell indices": "not observable: the spec's stores are multisets",
                                    "layers past the first of each store": "rows are named by each store's "
                                                                           "first layer"},
                      note="llama.cpp " + VENDORED_LLAMA_CPP)


@dataclass(frozen=True)
class LlamaCppTarget(Target):
    """``--target llama.cpp``: cells traces replayed on llama.cpp's memory
    (:func:`target_factory`) by ``kvspec.fuzz.cells.CellsLockstep``. A trace of
    another kind, a cache llama.cpp cannot build, an op past the target's
    limits (:func:`trace_limits`), or no llama-cpp-python:
    TargetCapabilityError naming why (``kvspec replay`` exit 2)."""

    def check(self, cache: dict[str, Any], ops: list[dict[str, Any]]) -> None:
        if cache.get("kind") != "cells":
            raise TargetCapabilityError(f"field cache.kind: target llama.cpp runs cells traces (llama.cpp's KV "
                                        f"memory), this trace is {cache.get('kind')!r}")
        try:
            require()
        except NotInstalled as exc:
            raise TargetCapabilityError(str(exc)) from None
        why = trace_limits(cache, ops)
        if why is not None:
            raise TargetCapabilityError(f"{why} (target llama.cpp)")

    def make_lockstep(self, cache: dict[str, Any]) -> Any:
        from kvspec.fuzz.cells import CellsLockstep

        CellsLockstep.check_cache(cache)
        self.check(cache, [])
        return CellsLockstep(cache, {"target": target_factory})


LLAMA_CPP = LlamaCppTarget(
    "llama.cpp", "llama.cpp's KV memory (llama_kv_cache, llama_kv_cache_iswa) through llama-cpp-python "
                 f"{LLAMA_CPP_PYTHON}: the cells kind", classes=(_class("llama_kv_cache"),
                                                                  _class("llama_kv_cache_iswa")),
    spec="llama.cpp")
