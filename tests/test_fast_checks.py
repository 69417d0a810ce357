"""The cheaper forms of the harness's per-op checks (docs/fuzzing.md, "Where
a campaign's time goes") compute what the forms they replaced computed: the
expected bytes of unquantized rows without an MLX round trip, a bfloat16
data pointer without a second evaluation, masks compared as whole matrices.
Each replaced form is computed here beside the new one on the same inputs;
the injected-bug catalog (tests/test_bugs.py) shows the checks still fail on
the bugs they exist for. On a correct implementation a weakened check gives
the same bytes too, so these tests cannot see a weakening:
tests/test_harness_mutants.py can (each cheaper check against the bug only
it catches, and the Int8 oracle with kvspec.impl.quant swapped out)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvspec.fuzz import rows as rowgen
from kvspec.fuzz.dense import DenseLockstep
from kvspec.fuzz.lockstep import host_pointer
from kvspec.fuzz.masks import mask_as_rows, mask_matrix
from kvspec.impl.dense import KVCache, data_pointer


@pytest.mark.parametrize("dtype", rowgen.DTYPES)
@pytest.mark.parametrize("scheme", rowgen.SCHEMES)
def test_expected_rows_without_mlx_are_the_bytes_mlx_hands_back(dtype, scheme):
    """The host form of the rows (what ``expected_row`` now uses for
    unquantized storage) equals, byte for byte, ``host`` of the MLX rows
    the cache is given (what it used before), wide rows, zero rows and
    every row scheme included."""
    cfg = {"mode": "fp16", "step": 4, "batch": 2, "kv_heads": 3, "head_dim": 8, "v_head_dim": 4, "inplace": True,
           "dtype": dtype, "rows": scheme}
    lock = DenseLockstep(cfg)
    assert lock.stored_identity("fp16") and not lock.stored_identity("int8")
    for t in range(80):
        hk, hv = lock.host_rows([t])
        k, v = lock.input_rows([t])
        mk, mv = rowgen.host_many([lock.stored_form(k), lock.stored_form(v)])
        assert hk.dtype == mk.dtype and hk.shape == mk.shape and hk.tobytes() == mk.tobytes(), t
        assert hv.dtype == mv.dtype and hv.shape == mv.shape and hv.tobytes() == mv.tobytes(), t
        assert lock.expected_row(t) == (mk.tobytes(), mv.tobytes())


@pytest.mark.parametrize("dtype", rowgen.DTYPES)
def test_int8_expected_rows_on_the_host_are_the_oracle_through_mlx(dtype):
    """The Int8 oracle on the rows' host form (what ``expected_row`` and the
    stored-codes check now use) equals the oracle through MLX (what they
    used before), and the stored codes and scales the oracle's quantization
    of the MLX rows' float32 values."""
    from kvspec.fuzz.layers import LayersLockstep
    from kvspec.fuzz.quant_ref import quantize

    lock = DenseLockstep({"mode": "int8", "step": 4, "batch": 2, "kv_heads": 1, "head_dim": 8, "v_head_dim": 16,
                          "inplace": True, "dtype": dtype})
    layers = LayersLockstep({"mode": "int8", "step": 4, "batch": 2, "kv_heads": 1, "head_dim": 8, "v_head_dim": 16,
                             "inplace": True, "dtype": dtype, "layers": [{"kind": "dense"}]})
    for t in range(60):
        k, v = lock.input_rows([t])
        mk, mv = rowgen.host_many([lock.stored_form(k, "int8"), lock.stored_form(v, "int8")])
        assert lock.expected_row(t) == (mk.tobytes(), mv.tobytes()), t
        assert layers.expected_row(t, "int8") == (mk.tobytes(), mv.tobytes()), t
        codes = quantize(np.asarray(k.astype(mx.float32), dtype=np.float64))
        assert all(a.tobytes() == b.tobytes() for a, b in zip(lock.stored_int8(t)[:2], codes)), t
        if t % 7 != 3:  # every seventh K row is all zero: its form is the row itself
            assert lock.expected_row(t)[0] != lock.host_rows([t])[0].tobytes()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_host_pointer_is_data_pointer(dtype):
    """Contiguous arrays, offset views and windows of a longer buffer (not
    C-contiguous, read through data_pointer) of every float dtype."""
    a = mx.zeros((2, 2, 8, 4), dtype=dtype)
    mx.eval(a)
    for x in (a, a[:, :, :3, :], a[:, :, 2:5, :], a[1:, :, :, :], a[:, :, :, :]):
        assert host_pointer(x) == data_pointer(x)
    c = KVCache(step=4)
    c.update_and_fetch(mx.ones((1, 1, 2, 8), dtype=mx.bfloat16), mx.ones((1, 1, 2, 8), dtype=mx.bfloat16))
    assert host_pointer(c.buffers.keys) == data_pointer(c.buffers.keys)
    assert host_pointer(c.buffers.keys) != host_pointer(c.buffers.values)


def test_mask_matrix_expands_as_the_row_lists_did():
    """Every form ``make_mask`` may return, as the old row-by-row expansion
    read it (None, "causal", arrays, forms that denote no matrix)."""
    def old(mask, n, length):
        if mask is None:
            return None if n != 1 else [[True] * length]
        if isinstance(mask, str):
            return None if mask != "causal" else [[j <= length - n + i for j in range(length)] for i in range(n)]
        arr = np.asarray(mask)
        return None if arr.shape != (n, length) else arr.astype(bool).tolist()

    rng = np.random.default_rng(0)
    forms = [None, "causal", "other"]
    for n in (1, 2, 3):
        for length in (1, 3, 7):
            cases = forms + [rng.random((n, length)) < 0.5, mx.array(rng.random((n, length)) < 0.5),
                             np.zeros((n, length + 1), dtype=bool), mx.zeros((n, length), dtype=mx.float16)]
            for mask in cases:
                got = mask_matrix(mask, n, length)
                assert (None if got is None else got.tolist()) == old(mask, n, length)
                assert mask_as_rows(mask, n, length) == old(mask, n, length)


def test_a_batch_leaves_the_garbage_collector_as_it_found_it():
    """run_machine freezes what was alive before a batch and unfreezes it
    after, and leaves a process's own freezing alone."""
    import gc

    from kvspec.fuzz.campaign import machine_for, run_machine

    machine = machine_for("dense", "fp16", True)
    assert gc.get_freeze_count() == 0
    run_machine(machine, seed=1, max_examples=2, steps=5)
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        run_machine(machine, seed=1, max_examples=2, steps=5)
        # neither unfrozen nor frozen further (a frozen object freed during
        # the batch leaves the count)
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
