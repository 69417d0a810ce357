"""Edges of kvspec.impl.write (the CUDA paths stood in for on the CPU, the env
read, the backend answer), kvspec.impl.layers (exact refusals and the all-or-none
rollbacks), kvspec.impl.quant and kvspec.impl.fused (which path runs), and
kvspec.impl.codebooks (the generator and its command line, without SciPy's
cost where the rule is not the numbers)."""

import functools
import json
import math
import os
import re
import warnings

import mlx.core as mx
import numpy as np
import pytest

from kvspec.impl import codebooks, fused, quant
from kvspec.impl import write as W
from kvspec.impl.dense import KVCache
from kvspec.impl.layers import (
    can_trim_prompt_cache,
    copy_prompt_cache,
    restore_prompt_cache,
    trim_prompt_cache,
)
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec.errors import InvalidArgumentError, RollbackWarning, StateError
from tests._standin import stand_in


def rows(n, fill=1.0, d=4, h=2, dtype=mx.float16):
    return mx.full((1, h, n, d), fill, dtype=dtype)


def col(a):
    return [float(x) for x in np.array(a.astype(mx.float32))[0, 0, :, 0]]


class _FakeGPU:
    type = mx.DeviceType.gpu


# -- kvspec.impl.write: the backend ---------------------------------------------------

def test_a_gpu_without_cuda_is_metal_and_its_answer_is_worked_out_once(monkeypatch):
    asked = []

    def is_available():
        asked.append(1)
        return False

    monkeypatch.setattr(W, "_BACKENDS", {})
    monkeypatch.setattr(mx.cuda, "is_available", is_available)
    monkeypatch.setattr(mx, "default_device", lambda: _FakeGPU())
    assert [W.backend() for _ in range(3)] == ["metal"] * 3
    assert asked == [1] and W._BACKENDS == {"gpu": "metal"}


def test_a_cuda_gpu_is_asked_once_too(monkeypatch):
    asked = []
    monkeypatch.setattr(W, "_BACKENDS", {})
    monkeypatch.setattr(mx.cuda, "is_available", lambda: asked.append(1) or True)
    monkeypatch.setattr(mx, "default_device", lambda: _FakeGPU())
    assert W.backend() == "cuda" and W.backend() == "cuda" and asked == [1]


def test_inplace_mechanism_asks_what_an_unknown_gpu_is_and_reads_the_env_each_call(monkeypatch):
    asked = []
    monkeypatch.setattr(W, "_BACKENDS", {})
    monkeypatch.setattr(mx.cuda, "is_available", lambda: asked.append(1) or True)
    monkeypatch.setattr(mx, "default_device", lambda: _FakeGPU())
    monkeypatch.delenv("KV_CUDA_INPLACE", raising=False)
    assert W.inplace_mechanism() == "donate" and asked == [1]
    monkeypatch.setenv("KV_CUDA_INPLACE", "kernel")
    assert W.inplace_mechanism() == "kernel" and asked == [1]
    monkeypatch.setenv("KV_CUDA_INPLACE", "")
    assert W.inplace_mechanism() == "donate"
    monkeypatch.setenv("KV_CUDA_INPLACE", "copy")
    with pytest.raises(InvalidArgumentError, match="KV_CUDA_INPLACE must be one of donate, kernel"):
        W.inplace_mechanism()
    monkeypatch.setattr(W, "_BACKENDS", {"gpu": "metal"})
    assert W.inplace_mechanism() == "numpy"  # a Metal GPU: the NumPy view, whatever the variable says
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.DeviceType.cpu, 0))
    monkeypatch.setattr(W, "_BACKENDS", {"gpu": "cuda"})
    assert W.inplace_mechanism() == "numpy" and W.backend() == "cpu"


@pytest.mark.parametrize("missing", ["_ENV_DATA", "_ENV_DECODE", "_CUDA_KEY"])
def test_inplace_mechanism_without_os_environs_layout(missing, monkeypatch):
    monkeypatch.setattr(W, "_GPU", mx.default_device().type)
    monkeypatch.setattr(W, "_BACKENDS", {"gpu": "cuda"})
    monkeypatch.setattr(W, missing, None)
    monkeypatch.setenv("KV_CUDA_INPLACE", "kernel")
    assert W.inplace_mechanism() == "kernel"
    monkeypatch.delenv("KV_CUDA_INPLACE")
    assert W.inplace_mechanism() == "donate"


# -- kvspec.impl.write: the region of a kernel write ---------------------------------

def test_region_of_an_empty_slice_is_empty_and_index_0_is_inside():
    a = mx.zeros((2, 3))
    assert W._region(a, (slice(1, 1),)) == ([1, 0], [0, 3])
    assert W._region(a, (0, slice(None))) == ([0, 0], [1, 3])
    assert W._region(a, (1, 0)) == ([1, 0], [1, 1])


def test_region_refuses_an_index_longer_than_the_rank_and_a_negative_index():
    a = mx.zeros((2, 3))
    with pytest.raises(IndexError, match=re.escape("write: index has 3 entries for an array of rank 2")):
        W._region(a, (0, 0, 0))
    with pytest.raises(IndexError, match=re.escape("write: axis 1: index -1 outside [0, 3)")):
        W._region(a, (0, -1))


# -- kvspec.impl.write: the NumPy path -------------------------------------------------

@pytest.mark.parametrize("dst_dtype", [mx.float32, mx.float16])
def test_a_numpy_write_of_bfloat16_rows_into_another_dtype_casts_them(dst_dtype):
    dst = mx.zeros((1, 1, 3, 2), dtype=dst_dtype)
    mx.eval(dst)
    src = mx.array([[[[1.5, -2.25]]]], dtype=mx.bfloat16)
    assert W.write_inplace(dst, src, W.seq_index(1, 1), "numpy") is dst
    assert np.array(dst.astype(mx.float32))[0, 0].tolist() == [[0, 0], [1.5, -2.25], [0, 0]]


def test_write_inplace_takes_the_mechanism_it_is_given(monkeypatch):
    def no_read():
        raise AssertionError("the mechanism was given, not to be read")

    monkeypatch.setattr(W, "inplace_mechanism", no_read)
    dst = mx.zeros((1, 1, 2, 2))
    mx.eval(dst)
    before = W.COUNTS["numpy"]
    assert W.write_inplace(dst, mx.ones((1, 1, 1, 2)), W.seq_index(0, 1), "numpy") is dst
    assert col(dst) == [1, 0] and W.COUNTS["numpy"] == before + 1


# -- kvspec.impl.write: the kernel path, stood in for ---------------------------------

class _Kernel:
    """mx.fast.cuda_kernel stood in for: records how it is built and
    launched; a launch writes through NumPy and returns a fresh token."""

    def __init__(self, monkeypatch):
        self.built, self.launches = [], []
        monkeypatch.setattr(W, "_KERNEL", None)
        monkeypatch.setattr(mx.fast, "cuda_kernel", self.build, raising=False)

    def build(self, **kwargs):
        self.built.append(kwargs)
        return self.launch

    def launch(self, **kwargs):
        self.launches.append(kwargs)
        dst, src, start = kwargs["inputs"]
        index = tuple(slice(int(a), int(a) + n) for a, n in zip(np.array(start), src.shape))
        np.array(dst, copy=False)[index] = np.array(src)
        return [mx.array([len(self.launches)], dtype=mx.int32)]


def test_kernel_write_builds_the_kernel_once_and_launches_one_thread_per_element(monkeypatch):
    k = _Kernel(monkeypatch)
    dst = mx.zeros((1, 2, 300, 2), dtype=mx.float16)
    mx.eval(dst)
    small = mx.ones((1, 1, 1, 2), dtype=mx.float16)
    token = W.kernel_write(dst, small, [0, 1, 4, 0])
    big = mx.full((1, 1, 300, 1), 2.0, dtype=mx.float16)
    W.kernel_write(dst, big, [0, 0, 0, 1])
    assert k.built == [{"name": "kvspec_write_rows", "input_names": ["dst", "src", "start"],
                        "output_names": ["token"], "source": W._KERNEL_SOURCE, "ensure_row_contiguous": False}]
    first, second = k.launches
    assert first["inputs"][0] is dst and first["inputs"][1] is small
    start = first["inputs"][2]
    assert start.dtype == mx.int32 and start.tolist() == [0, 1, 4, 0]
    assert first["template"] == [("T", mx.float16)]
    assert first["grid"] == (2, 1, 1) and first["threadgroup"] == (2, 1, 1)
    assert second["grid"] == (300, 1, 1) and second["threadgroup"] == (256, 1, 1)
    assert first["output_shapes"] == [(1,)] and first["output_dtypes"] == [mx.int32]
    assert token.tolist() == [1]
    got = np.array(dst)
    assert got[0, 1, 4].tolist() == [1, 1] and got[0, 0, :, 1].tolist() == [2] * 300


def test_kernel_write_of_an_empty_region_launches_one_thread(monkeypatch):
    """The thread that sets the token runs even when no element is written."""
    k = _Kernel(monkeypatch)
    dst = mx.zeros((1, 1, 2, 2))
    mx.eval(dst)
    W.kernel_write(dst, mx.zeros((1, 1, 0, 2)), [0, 0, 2, 0])
    assert k.launches[0]["grid"] == (1, 1, 1) and k.launches[0]["threadgroup"] == (1, 1, 1)


def test_each_kernel_write_counts_once_and_is_completed(monkeypatch):
    _Kernel(monkeypatch)
    done = []
    monkeypatch.setattr(W, "complete", done.append)
    dst = mx.zeros((1, 1, 3, 2), dtype=mx.float16)
    mx.eval(dst)
    before = W.COUNTS["kernel"]
    assert W.write_inplace(dst, mx.full((1, 1, 1, 1), 3.0), W.seq_index(2, 1), "kernel") is dst
    assert W.COUNTS["kernel"] == before + 1 and len(done) == 1
    assert np.array(dst)[0, 0].tolist() == [[0, 0], [0, 0], [3, 3]]


# -- kvspec.impl.write: KV_CUDA_INPLACE ------------------------------------------------

def test_a_blank_cuda_mechanism_is_donate(monkeypatch):
    monkeypatch.setenv("KV_CUDA_INPLACE", "  ")
    assert W.cuda_inplace() == "donate"


def test_the_per_write_env_read_does_not_go_through_os_environ_get(monkeypatch):
    def no_get(*a, **k):
        raise AssertionError("os.environ.get on the decode path")

    monkeypatch.setenv("KV_CUDA_INPLACE", "kernel")
    monkeypatch.setattr(os.environ, "get", no_get, raising=False)
    assert W._env_value("KV_CUDA_INPLACE") == "kernel"
    assert W._env_value("KVSPEC_TEST_UNSET_NAME") is None


@pytest.mark.parametrize("missing", ["_ENV_DATA", "_ENV_ENCODE", "_ENV_DECODE"])
def test_without_os_environs_layout_the_env_is_read_the_public_way(missing, monkeypatch):
    monkeypatch.setenv("KV_CUDA_INPLACE", "kernel")
    monkeypatch.setattr(W, missing, None)
    assert W._env_value("KV_CUDA_INPLACE") == "kernel" and W.cuda_inplace() == "kernel"
    monkeypatch.delenv("KV_CUDA_INPLACE")
    assert W._env_value("KV_CUDA_INPLACE") is None


# -- kvspec.impl.quant ------------------------------------------------------------------

@pytest.mark.parametrize("shape,enabled,backend,compiled", [
    ((1, 2, 1, 4), True, "cuda", True),   # a decode step's rows on CUDA
    ((1, 4), True, "cuda", True),         # rank 2: one row
    ((2, 1, 4), True, "cuda", True),      # rank 3: the row axis is -2
    ((1, 2, 2, 4), True, "cuda", False),  # a prefill
    ((1, 2, 1, 4), False, "cuda", False),  # fusion off
    ((1, 2, 1, 4), True, "cpu", False),
    ((4,), True, "cuda", False),          # no row axis
])
def test_the_compiled_quantizer_runs_exactly_for_one_row_on_cuda(shape, enabled, backend, compiled, monkeypatch):
    used = []

    def decode_quantizer():
        used.append(1)
        return quant._quantize_int8

    monkeypatch.setattr(quant, "_decode_quantizer", decode_quantizer)
    monkeypatch.setattr(fused, "ENABLED", enabled)
    stand_in(monkeypatch, backend)
    x = mx.array(np.linspace(-3, 5, int(np.prod(shape)), dtype=np.float32).reshape(shape))
    q, s = quant.quantize_int8(x)
    wq, ws = quant._quantize_int8(x)
    assert bool(used) is compiled
    assert np.array_equal(np.array(q), np.array(wq)) and np.array_equal(np.array(s), np.array(ws))


def test_dequantize_uses_the_prebuilt_dequantizers_of_the_three_dtypes(monkeypatch):
    q, s = quant.quantize_int8(mx.array([[3.0, -1.0, 0.5]]))

    def no_build(dtype):
        raise AssertionError(f"a dequantizer built per call for {dtype}")

    monkeypatch.setattr(quant, "_dequantizer", no_build)
    for dtype in (mx.float16, mx.bfloat16, mx.float32):
        assert quant.dequantize_int8(q, s, dtype).dtype == dtype


def test_dequantize_to_another_float_dtype_builds_its_dequantizer():
    q, s = quant.quantize_int8(mx.array([[127.0, -127.0, 0.0]]))
    out = quant.dequantize_int8(q, s, mx.float64)
    assert out.dtype == mx.float64 and np.array(out).tolist() == [[127.0, -127.0, 0.0]]


# -- kvspec.impl.fused --------------------------------------------------------------------

def test_the_fused_form_is_traced_once_for_every_shape():
    """Shapeless: a window that grows by a row each step is not retraced
    (and recompiled) at every step."""
    traces = []

    def negate(x):
        traces.append(x.shape)
        return -x

    e = fused.Elementwise(negate)
    for n in (2, 3, 5):
        assert np.array(e.fused(mx.ones((n,)))).tolist() == [-1.0] * n
    assert len(traces) == 1


def test_an_elementwise_chain_is_named_after_its_function_or_elementwise():
    def dequantize(x):
        return x

    assert fused.Elementwise(dequantize).__name__ == "dequantize"
    assert fused.Elementwise(functools.partial(mx.multiply, 2.0)).__name__ == "elementwise"
    assert quant._DEQUANTIZERS[mx.float16].__name__ == "dequantize"


# -- kvspec.impl.layers ---------------------------------------------------------------------

def tokens(first, n, b=1):
    x = np.arange(first, first + n, dtype=np.float32)[None, None, :, None]
    return mx.array(np.broadcast_to(x, (b, 1, n, 3)).copy())


def window(c):
    got = c.fetch()
    return () if got is None else tuple(round(float(t)) for t in np.array(got[0].astype(mx.float32))[0, 0, :, 0])


def feed(caches, first, n, one_by_one=True):
    for t in range(first, first + n) if one_by_one else [first]:
        for c in caches:
            k = tokens(t, 1) if one_by_one else tokens(first, n)
            c.update_and_fetch(k, k)


def wrapped_list():
    """A dense layer of 4 rows beside a ring of 2 without an undo log that
    has wrapped: it can roll back no row exactly."""
    caches = [KVCache(step=4), RotatingKVCache(2, step=1)]
    feed(caches, 0, 4)
    return caches


def test_an_empty_list_cannot_trim():
    assert can_trim_prompt_cache([]) is False
    assert trim_prompt_cache([], 3) == 0


@pytest.mark.parametrize("n,shown", [(1.5, "1.5"), ("2", "'2'"), (True, "True")])
def test_trim_prompt_cache_refuses_a_non_integer_n(n, shown):
    caches = [KVCache(step=4)]
    with pytest.raises(InvalidArgumentError, match=re.escape(f"trim_prompt_cache: n must be an integer, got {shown}")):
        trim_prompt_cache(caches, n)


def test_trim_prompt_cache_refuses_a_strict_that_is_not_a_bool():
    with pytest.raises(InvalidArgumentError, match=re.escape("trim_prompt_cache: strict must be True or False, got 1")):
        trim_prompt_cache([KVCache()], 1, strict=1)


@pytest.mark.parametrize("n,want", [(1, 1), (4, 4)])
def test_a_strict_trim_over_a_wrapped_ring_names_only_the_refusing_layer(n, want):
    """At ``n`` = 4 the dense layer can roll back exactly the 4 rows asked:
    it is not refusing."""
    caches = wrapped_list()
    with pytest.raises(StateError, match=re.escape(
            f"trim_prompt_cache: cannot roll back {want} rows exactly: layer(s) [1] can roll back [0] "
            "(a sliding-window ring wrapped beyond its undo log); nothing was trimmed")):
        trim_prompt_cache(caches, n, strict=True)
    assert [c.offset for c in caches] == [4, 4] and window(caches[0]) == (0, 1, 2, 3)


def test_a_refused_trim_of_one_row_warns_through_the_rings_own_warning():
    caches = wrapped_list()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert trim_prompt_cache(caches, 1) == 0
    assert [(w.category, str(w.message)) for w in record] == [(RollbackWarning, (
        "RotatingKVCache(max_size=2, undo=0) has wrapped and can roll back exactly 0 rows: a rollback of 1 rows "
        "is refused (nothing trimmed), so a decoding loop that goes on leaves the stream it would have had; for "
        "speculative decoding build the caches with kvspec.impl.models.make_prompt_cache(model, num_draft_tokens=k) (an "
        "undo log of k rows per ring). Reported once per cache."))]
    assert [c.offset for c in caches] == [4, 4]


class ForeignLayer:
    """A layer of another library: an offset, ``is_trimmable`` and ``trim``,
    neither kvspec's live rows nor a ring's trimmable rows."""

    def __init__(self, offset, trimmable):
        self.offset, self.trimmable, self.trims = offset, trimmable, []

    def is_trimmable(self):
        return self.trimmable

    def trim(self, n):
        self.trims.append(n)
        self.offset -= n
        return n


@pytest.mark.parametrize("n", [1, 2])
def test_a_foreign_layer_that_is_not_trimmable_refuses_with_a_rollback_warning(n):
    """It can roll back no row exactly: not even one."""
    dense = KVCache(step=4)
    feed([dense], 0, 3)
    layer = ForeignLayer(3, trimmable=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert trim_prompt_cache([dense, layer], n) == 0
    assert [(w.category, str(w.message)) for w in record] == [
        (RollbackWarning, f"trim_prompt_cache: layer 1 cannot roll back {n} rows exactly; nothing was trimmed")]
    assert layer.trims == [] and dense.offset == 3


def test_a_foreign_layer_that_is_trimmable_trims_with_the_list():
    dense = KVCache(step=4)
    feed([dense], 0, 3)
    layer = ForeignLayer(5, trimmable=True)
    assert trim_prompt_cache([layer, dense], 2) == 2
    assert layer.trims == [2] and layer.offset == 3 and dense.offset == 1


class ShortTrim(KVCache):
    """Promises an exact trim and trims one row fewer."""

    def trim(self, n):
        return super().trim(n - 1)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_a_layer_that_trims_fewer_rows_than_promised_is_named_and_nothing_is_trimmed(position):
    caches = [KVCache(step=4), KVCache(step=4), KVCache(step=4)]
    caches[position] = ShortTrim(step=4)
    feed(caches, 0, 3)
    with pytest.raises(StateError, match=re.escape(
            f"trim_prompt_cache: layer {position} trimmed 1 rows, expected 2 (it broke its promise of an exact "
            "trim); nothing was trimmed in any layer")):
        trim_prompt_cache(caches, 2)
    assert [c.offset for c in caches] == [3, 3, 3] and [window(c) for c in caches] == [(0, 1, 2)] * 3


def test_the_default_copy_is_deep_with_one_memo_for_the_list():
    """A layer listed twice stays one layer in a deep copy of the list (one
    memo), two in a copy per layer."""
    c = KVCache(step=4)
    feed([c], 0, 2)
    deep = copy_prompt_cache([c, c])
    assert deep[0] is deep[1] and deep[0] is not c
    shallow = copy_prompt_cache([c, c], deep=False)
    assert shallow[0] is not shallow[1]


def test_restore_prompt_cache_refuses_a_layers_snapshot_with_the_layers_own_check():
    caches = [KVCache(step=4), KVCache("int8", step=4)]
    feed(caches, 0, 2)
    snaps = [c.snapshot() for c in reversed(caches)]
    with pytest.raises(InvalidArgumentError, match=re.escape("restore: mode must be 'fp16', got 'int8'")):
        restore_prompt_cache(caches, snaps)
    assert [window(c) for c in caches] == [(0, 1), (0, 1)]


class SnapshotOnly:
    """A layer with ``snapshot`` and ``restore`` but no check of its own."""

    def __init__(self):
        self.state, self.restored = "now", []

    def snapshot(self):
        return self.state

    def restore(self, snap):
        self.restored.append(snap)
        self.state = snap


def test_restore_prompt_cache_restores_a_layer_without_a_check_of_its_own():
    dense, other = KVCache(step=4), SnapshotOnly()
    feed([dense], 0, 2)
    snaps = [dense.snapshot(), "then"]
    feed([dense], 2, 1)
    restore_prompt_cache([dense, other], snaps)
    assert other.state == "then" and window(dense) == (0, 1)


class FailingRestore(KVCache):
    """Passes the check, then its first restore fails before changing
    anything (a later one, a put-back, would succeed)."""

    failed = False

    def restore(self, snapshot):
        if not self.failed:
            self.failed = True
            raise MemoryError("planted: the restore failed past its check")
        super().restore(snapshot)


@pytest.mark.parametrize("failing", [0, 2])
def test_a_restore_failing_past_the_checks_puts_back_exactly_the_layers_before_it(failing):
    """Every layer restored before the failing one is put back; the failing
    one and those after it are not touched (a put-back restore would drop
    their ownership: their next decode would copy)."""
    caches = [FailingRestore(step=8, inplace=True) if i == failing else KVCache(step=8, inplace=True)
              for i in range(3)]
    feed(caches, 0, 2)
    snaps = [c.snapshot() for c in caches]
    feed(caches, 2, 1)
    with pytest.raises(MemoryError, match="planted"):
        restore_prompt_cache(caches, snaps)
    assert [window(c) for c in caches] == [(0, 1, 2)] * 3
    for i, c in enumerate(caches):
        c.update_and_fetch(tokens(3, 1), tokens(3, 1))
        assert c.last_write_inplace is (i >= failing), i


# -- kvspec.impl.codebooks --------------------------------------------------------------------

def test_lloyd_max_of_one_bit_is_the_sign_quantizer():
    """Two levels at +-E|X| = +-sqrt(2/pi), distortion 1 - 2/pi."""
    c, mse = codebooks.lloyd_max(1)
    r = math.sqrt(2 / math.pi)
    assert c[0] == -c[1] and abs(c[1] - r) < 1e-12
    assert abs(mse - (1 - 2 / math.pi)) < 1e-12


def test_lloyd_max_of_two_bits_has_maxs_distortion():
    c, mse = codebooks.lloyd_max(2)
    assert len(c) == 4 and abs(c[2] - 0.4528) < 1e-4 and abs(c[3] - 1.5104) < 1e-4
    assert abs(mse - 0.1175) < 1e-4  # Max (1960), Table I


def test_matches_stored_takes_a_difference_of_exactly_tol(monkeypatch):
    monkeypatch.setattr(codebooks, "compute_all", lambda: {"3": [0.5, 1.0]})
    monkeypatch.setattr(codebooks, "_stored", lambda: {"3": (0.5, 1.25)})
    assert codebooks.matches_stored(tol=0.25) and not codebooks.matches_stored(tol=0.125)


def test_write_stores_the_generated_codebooks_as_indented_json(monkeypatch, tmp_path):
    path = tmp_path / "codebooks.json"
    monkeypatch.setattr(codebooks, "DATA", path)
    monkeypatch.setattr(codebooks, "compute_all", lambda: {"3": [-0.5, 0.5]})
    codebooks.write()
    text = path.read_text()
    doc = {"about": "Lloyd-Max codebooks of the unit Gaussian (impl/codebooks.py); scale by 1/sqrt(d) for N(0, 1/d).",
           "unit_gaussian": {"3": [-0.5, 0.5]}}
    assert text == json.dumps(doc, indent=1) + "\n"
    assert json.loads(text) == doc


@pytest.mark.parametrize("same,code,said", [(True, 0, "codebooks.json matches the generator"),
                                            (False, 1, "codebooks.json differs from the generator")])
def test_main_check_says_whether_the_stored_data_matches(same, code, said, monkeypatch, capsys):
    monkeypatch.setattr(codebooks, "matches_stored", lambda: same)
    monkeypatch.setattr("sys.argv", ["codebooks", "--check"])
    assert codebooks.main() == code
    assert capsys.readouterr().out == said + "\n"


def test_main_refuses_other_arguments_with_its_usage(monkeypatch, capsys):
    monkeypatch.setattr(codebooks, "write", lambda: pytest.fail("wrote the data"))
    assert codebooks.main(["--force"]) == 2
    out = capsys.readouterr()
    assert out.err == "usage: python -m kvspec.impl.codebooks [--check]\n" and out.out == ""


def test_main_without_arguments_rewrites_the_data_and_prints_each_distortion(monkeypatch, capsys):
    wrote = []
    monkeypatch.setattr(codebooks, "write", lambda: wrote.append(1))
    monkeypatch.setattr(codebooks, "lloyd_max", lambda b: ([], b / 1000))
    monkeypatch.setattr("sys.argv", ["codebooks"])
    assert codebooks.main() == 0
    assert wrote == [1] and capsys.readouterr().out == "3 bits: mse 0.003000\n4 bits: mse 0.004000\n"
