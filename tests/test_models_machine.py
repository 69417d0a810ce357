"""The model-level machine (``kvspec.fuzz.models``, kind ``models``) and the rules it
checks against (``kvspec.spec.models``): a short campaign on the real
implementation agrees and reaches every op; the rules themselves; the
nbytes proof with its negative control. The injected bugs of issue 47 are
in the catalog (``fuzz/bugs/models.py``), so ``tests/test_bugs.py`` and
``tests/test_replay.py`` check each is caught and its trace diverges."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvspec.fuzz.models import MODEL_OPS
from kvspec.impl.dense import KVCache
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec import models as sm
from kvspec.spec.errors import InvalidArgumentError, UnsupportedOperationError


def test_a_short_campaign_agrees_and_reaches_every_model_op():
    """Bounded by examples, not seconds: batches of 25 from seed 1 until
    every op is checked, at most 100 examples."""
    from kvspec.fuzz.campaign import Campaign

    run = Campaign("models", "fp16", True, 1)
    while run.report.examples < 100 and not run.failed and \
            any(not run.report.stats.get(f"{op} checked") for op in MODEL_OPS):
        run.batch()
    rep = run.report
    assert rep.failure is None, rep.failure and rep.failure.error
    missed = [op for op in MODEL_OPS if not rep.stats.get(f"{op} checked")]
    assert not missed, f"never checked: {missed} ({rep.examples} examples)"


def test_layout_rule():
    ring = sm.prompt_cache_layout(None, 2, max_kv_size=6, undo=1, num_draft_tokens=3)
    assert ring == (sm.LayerSettings("rotating", "fp16", 256, 6, 4, 3),) * 2
    mixed = sm.prompt_cache_layout((("dense", 0, 0), ("rotating", 5, 1)), 0, "turbo4delegated", 4,
                                   max_kv_size=99, hot_threshold=3, fold_block=2)
    assert mixed == (sm.LayerSettings("dense", "turbo4delegated", 4, hot_threshold=3, fold_block=2),
                     sm.LayerSettings("rotating", "fp16", 4, 5, 1, 0))
    assert sm.prompt_cache_layout(None, 1, "int8")[0].hot_threshold is None
    with pytest.raises(UnsupportedOperationError, match="max_kv_size=4"):
        sm.prompt_cache_layout(None, 1, "int8", max_kv_size=4)
    with pytest.raises(InvalidArgumentError, match="num_draft_tokens must be >= 0"):
        sm.prompt_cache_layout(None, 1, num_draft_tokens=-1)


def test_metadata_rule_keeps_keys_and_refuses_what_a_file_cannot_hold():
    meta = {"0shot": "a", ".": "", "": "b", "模型": "c"}
    assert sm.loaded_metadata(meta) == meta
    with pytest.raises(InvalidArgumentError, match="reserved"):
        sm.loaded_metadata({"__kvspec__": "x"})
    with pytest.raises(InvalidArgumentError, match="str to str"):
        sm.loaded_metadata({"k": 1})  # type: ignore[dict-item]


def test_mechanism_rule():
    assert sm.inplace_mechanism("cpu", "kernel") == sm.inplace_mechanism("metal", "bogus") == "numpy"
    assert sm.inplace_mechanism("cuda", None) == sm.inplace_mechanism("cuda", " ") == "donate"
    assert sm.inplace_mechanism("cuda", " Kernel ") == "kernel"
    with pytest.raises(InvalidArgumentError, match="KV_CUDA_INPLACE"):
        sm.inplace_mechanism("cuda", "bogus")


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_nbytes_rule_matches_the_caches(mode, dtype):
    name = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}[dtype]
    c = KVCache(mode, step=4)
    assert c.nbytes == 0
    c.update_and_fetch(mx.ones((2, 3, 5, 8), dtype=dtype), mx.ones((2, 3, 5, 4), dtype=dtype))
    assert c.nbytes == sm.nbytes(mode, c.capacity, 2, 3, 8, 4, name)
    r = RotatingKVCache(max_size=4, keep=1, step=2)
    r.update_and_fetch(mx.ones((1, 2, 3, 8), dtype=dtype), mx.ones((1, 2, 3, 8), dtype=dtype))
    assert r.nbytes == sm.nbytes("fp16", r.capacity, 1, 2, 8, 8, name)


def test_to_quantized_rule():
    q = sm.to_quantized("dense", "fp16", 7, 2, 4, True, "bfloat16", True)
    assert q == sm.Quantized("int8", 7, 2, 4, True, "bfloat16", 5)
    assert sm.to_quantized("rotating", "fp16", 7, 0, 4, True, "float16", True) is None
    assert sm.to_quantized("dense", "int8", 7, 0, 4, True, "float16", True) is None
    with pytest.raises(InvalidArgumentError):
        sm.to_quantized("dense", "fp16", 7, 0, 4, True, "float32", False)


def _quantized_case(case):
    """(cache, kind, live_start, dtype name, head dims) of a named case."""
    dtype = mx.bfloat16 if case == "bf16" else mx.float16
    if case == "ring":
        c = RotatingKVCache(max_size=4, keep=1, step=2)
    else:
        c = KVCache("int8" if case == "int8" else "fp16", step=4)
    if case != "empty":
        c.update_and_fetch(mx.ones((1, 2, 3, 64), dtype=dtype), mx.ones((1, 2, 3, 32), dtype=dtype))
    if case == "front_trimmed":
        c.trim_front(1)
    kind = "rotating" if case == "ring" else "dense"
    return c, kind, getattr(c, "live_start", 0), "bfloat16" if case == "bf16" else "float16", (64, 32)


@pytest.mark.parametrize("case", ["fp16", "bf16", "int8", "ring", "front_trimmed", "empty"])
def test_to_quantized_rule_matches_the_caches_for_every_bits_and_group_size(case):
    import warnings

    for bits in (*sm.QUANTIZED_BITS, 1, 7, 16):
        for group_size in (*sm.QUANTIZED_GROUP_SIZES, 16, 256):
            c, kind, live_start, dtype, head_dims = _quantized_case(case)
            before = (c.offset, live_start, None if c.fetch() is None else [a.tolist() for a in c.fetch()])
            mode = getattr(c, "mode", "fp16")
            try:
                want = sm.to_quantized(kind, mode, c.offset, live_start, c.step, c.inplace, dtype, True,
                                       bits=bits, group_size=group_size, head_dims=head_dims)
            except UnsupportedOperationError:
                with pytest.raises(UnsupportedOperationError):
                    c.to_quantized(group_size=group_size, bits=bits)
                after = (c.offset, getattr(c, "live_start", 0),
                         None if c.fetch() is None else [a.tolist() for a in c.fetch()])
                assert after == before, (bits, group_size)
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                q = c.to_quantized(group_size=group_size, bits=bits)
            where = (case, bits, group_size)
            if want is None:
                assert q is c, where
            elif isinstance(want, sm.Quantized):
                assert (q.mode, q.offset, q.live_start, q.step, q.capacity) == (
                    want.mode, want.offset, want.live_start, want.step, want.capacity), where
            else:
                assert type(q).__name__ == "QuantizedKVCache", where
                assert (q.group_size, q.bits, q.offset, q.step) == (
                    want.group_size, want.bits, want.offset, want.step), where
                if q.keys is not None:
                    k = mx.dequantize(*q.keys, group_size=q.group_size, bits=q.bits)
                    assert k.dtype == {"float16": mx.float16, "bfloat16": mx.bfloat16}[want.dtype], where
                    assert q.offset - k.shape[2] == want.live_start, where


def test_nbytes_proof_and_its_negative_control():
    from kvspec.proofs.models import counted_once, keys_twice, spec_count

    assert all(v is None for v in counted_once(spec_count).values())
    assert all(v is not None for v in counted_once(keys_twice).values())
