"""The quantized modes' window as a GPU computes it (kvspec.impl.fused), checked on
the CPU.

A quantized cache hands attention a float window, so every append
dequantizes every live row: the work is proportional to the context, and
its cost is the number of passes over the window (each pass a kernel and a
window-sized intermediate through device memory). On the H200 a Turbo4
decode step cost 25.7 / 34.1 / 93.0 ms at 1k / 8k / 32k rows (28 layers)
and Int8's grew 17.2 -> 33.8 ms; the floor (attention alone) grows
1.0 -> 1.6 ms. Here, with the write layer's backend stood in for ``cuda``:

* the window of an Int8, Turbo4 or Turbo4asym cache is built in few passes
  (kernels in its graph, counted from ``mx.export_to_dot``): 2, 8 and 4,
  where the op-by-op chains took 12, 24 and 12;
* the fused chains give the op-by-op bytes: Int8 on every int8 code times
  a sweep of float16 scales (against kvspec.fuzz.quant_ref, the NumPy rule), Turbo
  4-bit on ordinary, tiny, huge and strided rows (against the chain that
  unpacks, gathers centroids and rotates op by op).
"""

import re

import mlx.core as mx
import numpy as np
import pytest

from kvspec.fuzz import quant_ref
from kvspec.impl import fused
from kvspec.impl import turbo_quant as tq
from kvspec.impl.dense import KVCache
from kvspec.impl.quant import dequantize_int8
from kvspec.impl.turbo import TurboKVCache
from tests._standin import stand_in

#: primitives that are views (no kernel, no pass over the data)
VIEWS = {"Broadcast", "Slice", "Reshape", "ExpandDims", "Squeeze"}


def kernels(*arrays: mx.array, path) -> list[str]:
    """The non-view primitives of the graph that computes ``arrays``."""
    dot = path / "graph.dot"
    mx.export_to_dot(str(dot), *arrays)
    return [p for p in re.findall(r'label ="([^"]+)"', dot.read_text()) if p not in VIEWS]


@pytest.fixture
def on_cuda(monkeypatch):
    stand_in(monkeypatch, "cuda")


#: passes over the window one fetch makes (K and V together), on CUDA
WINDOW_PASSES = {
    "int8": (lambda: KVCache("int8", step=8), 2),
    "turbo4": (lambda: TurboKVCache("turbo4", step=8), 8),
    "turbo4asym": (lambda: TurboKVCache("turbo4asym", step=8), 4),
}


@pytest.mark.parametrize("kind", list(WINDOW_PASSES))
def test_a_quantized_window_is_built_in_few_passes_on_cuda(kind, on_cuda, tmp_path):
    make, bound = WINDOW_PASSES[kind]
    c = make()
    x = mx.random.normal((1, 2, 21, 16), key=mx.random.key(1)).astype(mx.float16)
    mx.eval(c.update_and_fetch(x, x))
    passes = kernels(*c.fetch(), path=tmp_path)  # the appended rows are evaluated: only the window's own work
    assert len(passes) <= bound, (kind, passes)


def test_on_the_cpu_the_chains_run_op_by_op(tmp_path):
    c = KVCache("int8", step=8)
    x = mx.random.normal((1, 2, 5, 16), key=mx.random.key(1)).astype(mx.float16)
    mx.eval(c.update_and_fetch(x, x))
    assert not any(p.startswith("Compiled") for p in kernels(*c.fetch(), path=tmp_path))


def _int8_grid() -> tuple[np.ndarray, np.ndarray]:
    """Every int8 code against float16 scales from the smallest subnormal to
    the largest finite (every 7th bit pattern, and the largest ones whose
    products reach float16's limit)."""
    bits = np.arange(1, 0x7BFF + 1, 7, dtype=np.uint16)
    scales = np.concatenate([bits.view(np.float16), np.array([515.5, 516.0, 65504.0], dtype=np.float16)])
    q = np.arange(-128, 128, dtype=np.int8)
    return np.broadcast_to(q[None, :], (len(scales), 256)), scales[:, None]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("path", ["eager", "fused"])
def test_int8_dequantization_is_the_rule_byte_for_byte(dtype, path, monkeypatch):
    if path == "fused":
        stand_in(monkeypatch, "cuda")
    q, scale = _int8_grid()
    got = dequantize_int8(mx.array(q), mx.array(scale), getattr(mx, dtype))
    want = quant_ref.dequantize(q, scale, dtype)
    have = np.array(got.astype(mx.float32)).astype(np.float64)
    bad = np.flatnonzero(have != want)
    assert bad.size == 0, f"{path} {dtype}: q={q.flat[bad[0]]} scale={scale.flat[bad[0] // 256]}: " \
                          f"{have.flat[bad[0]]} != {want.flat[bad[0]]}"


def _stepwise_dequantize4(q: tq.Quantized, seed: int, head_dim: int, dtype) -> mx.array:
    """The 4-bit rule op by op: unpack, centroids, D1 . H . D2, rescale,
    clip, cast (the chain the fused path replaced)."""
    _, _, centroids, _ = tq._constants(head_dim, 4, seed)
    unit = tq.inverse_rotate(mx.take(centroids, tq.unpack_indices(q.packed, 4, head_dim)), seed)
    top = float(mx.finfo(dtype).max)
    return mx.clip(unit * q.rescale, -top, top).astype(dtype)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("path", ["eager", "fused"])
def test_turbo4_dequantization_keeps_its_bytes(dtype, path, monkeypatch):
    if path == "fused":
        stand_in(monkeypatch, "cuda")
    for d in (2, 8, 64):
        for scale in (1e-42, 1e-20, 1.0, 6e4, 1e5, 3e38):
            x = (mx.random.normal((2, 3, 11, d), key=mx.random.key(d)) * scale).astype(dtype)
            full = tq.quantize(x, 4, tq.K_SEED)
            # a window is a strided cut of a capacity buffer
            q = tq.Quantized(full.packed[:, :, 2:9], full.norm[:, :, 2:9], full.rescale[:, :, 2:9])
            got = tq.dequantize(q, 4, tq.K_SEED, d, dtype)
            want = _stepwise_dequantize4(q, tq.K_SEED, d, dtype)
            assert got.dtype == dtype
            assert np.array(got.astype(mx.float32)).tobytes() == np.array(want.astype(mx.float32)).tobytes(), \
                (path, dtype, d, scale)


def test_the_fused_form_runs_only_on_cuda(monkeypatch):
    calls = []
    f = fused.Elementwise(lambda a: a * 2)
    monkeypatch.setattr(f, "fused", lambda a: calls.append("fused") or a * 2)
    monkeypatch.setattr(f, "eager", lambda a: calls.append("eager") or a * 2)
    f(mx.array([1.0]))
    stand_in(monkeypatch, "cuda")
    f(mx.array([1.0]))
    stand_in(monkeypatch, "metal")
    f(mx.array([1.0]))
    assert calls == ["eager", "fused", "eager"]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_a_decode_rows_compiled_quantizer_keeps_its_bytes(dtype, monkeypatch):
    """One row per head (a decode step) is quantized by one compiled
    function on CUDA: the packed codes, norms and rescales are the op-by-op
    ones, for ordinary, zero, tiny and huge rows, at 4 and 3 bits."""
    for bits, d in ((4, 2), (4, 64), (3, 8), (3, 32)):
        for scale in (0.0, 1e-42, 1e-20, 1.0, 6e4, 3e38):
            x = (mx.random.normal((2, 3, 1, d), key=mx.random.key(d + bits)) * scale).astype(dtype)
            stand_in(monkeypatch, "cpu")
            eager = tq.quantize(x, bits, tq.V_SEED)
            stand_in(monkeypatch, "cuda")
            compiled = tq.quantize(x, bits, tq.V_SEED)
            for a, b in zip(eager.arrays(), compiled.arrays(), strict=True):
                assert a.dtype == b.dtype and np.array(a).tobytes() == np.array(b).tobytes(), (dtype, bits, d, scale)


#: kernels in the graph of one decode append's window (its rows quantized,
#: written and the window dequantized), on CUDA: were 36 (Int8) and 86
#: (Turbo4), each a launch per layer per step
APPEND_KERNELS = {
    "int8": (lambda: KVCache("int8", step=8), 14),
    "turbo4": (lambda: TurboKVCache("turbo4", step=8), 50),
}


@pytest.mark.parametrize("kind", list(APPEND_KERNELS))
def test_a_decode_append_launches_few_kernels_on_cuda(kind, on_cuda, tmp_path):
    make, bound = APPEND_KERNELS[kind]
    c = make()
    x = mx.random.normal((1, 2, 21, 16), key=mx.random.key(1)).astype(mx.float16)
    one = mx.random.normal((1, 2, 1, 16), key=mx.random.key(2)).astype(mx.float16)
    mx.eval(c.update_and_fetch(x, x), one)
    launched = kernels(*c.update_and_fetch(one, one), path=tmp_path)
    assert len(launched) <= bound, (kind, len(launched), launched)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_int8s_compiled_decode_quantizer_keeps_its_bytes(dtype, monkeypatch):
    from kvspec.impl.quant import quantize_int8

    for scale in (0.0, 1e-7, 1.0, 300.0, 6.5e4):
        x = (mx.random.normal((2, 3, 1, 16), key=mx.random.key(7)) * scale).astype(dtype)
        stand_in(monkeypatch, "cpu")
        eager = quantize_int8(x)
        stand_in(monkeypatch, "cuda")
        compiled = quantize_int8(x)
        for a, b in zip(eager, compiled, strict=True):
            assert a.dtype == b.dtype and np.array(a).tobytes() == np.array(b).tobytes(), (dtype, scale)
