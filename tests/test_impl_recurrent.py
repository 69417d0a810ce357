"""kvspec.impl.recurrent: RecurrentCache's checkpoint ring, its exact rollback and
the step recorder (docs/recurrent.md), on a fake mixer with an exact
fingerprint of the consumed prefix, and inside tiny random-weight qwen3_next
and lfm2 models under mlx-lm's speculative decoding."""

from __future__ import annotations

import copy
import random
import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx.utils import tree_flatten

from kvspec.impl.dense import KVCache
from kvspec.impl.models import (
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from kvspec.impl.recurrent import RecurrentCache, record_steps, unrecord_steps
from kvspec.spec.errors import (
    InvalidArgumentError,
    RollbackWarning,
    StateError,
    UnsupportedOperationError,
)

KERNEL = 4


class FakeMixer(nn.Module):
    """A recurrent mixer as mlx-lm writes one: reads cache[0] (conv window,
    zeros before the first token) and cache[1] (state), writes both, then
    advance(S). Input rows x[b, s] = (token, 0, ...); the state is (count,
    rolling hash (h * 31 + token) mod 65521), exact in float32. Records the
    size of every call it receives and the mask it was handed."""

    def __init__(self, size: int = 2, dtype=mx.float32, channels: int = 3):
        super().__init__()
        self.size, self.dtype, self.channels = size, dtype, channels
        self.calls: list[int] = []
        self.masks: list = []

    def __call__(self, x, mask=None, cache=None):
        B, S, _ = x.shape
        self.calls.append(S)
        self.masks.append(None if mask is None else tuple(mask.shape))
        if mask is not None:
            assert mask.shape == (B, S)
        conv = cache[0] if cache[0] is not None else mx.zeros((B, KERNEL - 1, self.channels), self.dtype)
        conv_in = mx.concatenate([conv, x.astype(self.dtype)], axis=1)
        cache[0] = conv_in[:, -(KERNEL - 1):, :]
        if self.size == 2:
            st = cache[1] if cache[1] is not None else mx.zeros((B, 2), mx.float32)
            cnt, h = st[:, 0], st[:, 1]
            for s in range(S):
                cnt = cnt + 1
                h = mx.remainder(h * 31 + x[:, s, 0].astype(mx.float32), 65521)
            cache[1] = mx.stack([cnt, h], axis=1)
        cache.advance(S)
        return x * 2


class FakeLayer(nn.Module):
    def __init__(self, mixer):
        super().__init__()
        self.mixer = mixer

    def __call__(self, x, mask=None, cache=None):
        return self.mixer(x, mask, cache=cache)


class FakeModel(nn.Module):
    def __init__(self, size=2, dtype=mx.float32):
        super().__init__()
        self.layers = [FakeLayer(FakeMixer(size, dtype))]

    def __call__(self, tokens, cache, mask=None):
        x = mx.zeros((tokens.shape[0], tokens.shape[1], 3), mx.float32)
        x[:, :, 0] = tokens.astype(mx.float32)
        return self.layers[0](x, mask, cache=cache)

    @property
    def mixer(self):
        return self.layers[0].mixer


def _model(size=2, dtype=mx.float32) -> FakeModel:
    m = FakeModel(size, dtype)
    assert record_steps(m) == 1
    return m


def feed(model, cache, toks, mask=False):
    t = mx.array([toks])
    model(t, cache, mx.ones((1, len(toks)), mx.bool_) if mask else None)


def arrays_bytes(arrays):
    return [None if a is None else (str(a.dtype), a.shape, np.array(a.astype(mx.float32)).tobytes()) for a in arrays]


def reference(toks, size=2, dtype=mx.float32):
    """A cache only ever shown ``toks``, one token per call, through the recorder."""
    m, c = _model(size, dtype), RecurrentCache(size=size, depth=1)
    for t in toks:
        feed(m, c, [t])
    return c


def expected_coverage(chunks, depth):
    c = 0
    for n in chunks:
        c = min(depth, c + n)
    return c


# -- the ring -----------------------------------------------------------------------
@pytest.mark.parametrize("depth", [0, 1, 2, 3, 4])
def test_ring_holds_the_state_of_every_covered_offset(depth):
    rng = random.Random(depth)
    m, c = _model(), RecurrentCache(depth=depth)
    toks: list[int] = []
    chunks: list[int] = []
    for _ in range(8):
        n = rng.randint(1, 6)
        new = [rng.randint(1, 50) for _ in range(n)]
        m.mixer.calls.clear()
        feed(m, c, new)
        toks += new
        chunks.append(n)
        # the call was split: the first S - U tokens as one block, the last min(S, U) one by one
        want_calls = [n] if depth == 0 else ([n - depth] if n > depth else []) + [1] * min(n, depth)
        assert m.mixer.calls == want_calls
        assert c.offset == len(toks)  # the recorder counts (depth 0: the model's own advance)
        cov = c.trimmable_rows()
        assert cov == expected_coverage(chunks, depth)
        assert arrays_bytes(c.cache) == arrays_bytes(reference(toks).cache)
        for t in range(len(toks) - cov, len(toks) + 1 if depth else 0):
            slot = c._ring[t % (depth + 1)]
            assert arrays_bytes(slot) == arrays_bytes(reference(toks[:t]).cache), (depth, t)


def test_depth_zero_passes_through_and_the_model_advance_counts():
    m, c = _model(), RecurrentCache(depth=0)
    feed(m, c, [1, 2, 3])
    assert m.mixer.calls == [3] and c.offset == 3 and c.trimmable_rows() == 0 and not c.is_trimmable()
    with pytest.raises(StateError, match="coverage"):
        c.trim(1)


# -- rollback -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("size", [1, 2])
def test_rollback_restores_conv_and_state_exactly(dtype, size):
    rng = random.Random(7)
    for depth in (1, 2, 4):
        m, c = _model(size, dtype), RecurrentCache(size=size, depth=depth)
        toks: list[int] = []
        for _ in range(10):
            new = [rng.randint(1, 50) for _ in range(rng.randint(1, depth + 2))]
            feed(m, c, new)
            toks += new
            n = rng.randint(0, c.trimmable_rows())
            assert c.trim(n) == n
            if n:
                toks = toks[:-n]
            ref = reference(toks, size, dtype)
            assert c.offset == len(toks)
            assert not toks or c[0].dtype == dtype  # stored as handed in
            assert arrays_bytes(c.cache) == arrays_bytes(ref.cache), (depth, toks)
        # and decoding on after the rollbacks equals the reference decoding on
        feed(m, c, [9, 8])
        assert arrays_bytes(c.cache) == arrays_bytes(reference(toks + [9, 8], size, dtype).cache)


def test_refusal_beyond_coverage_changes_nothing():
    m, c = _model(), RecurrentCache(depth=3)
    feed(m, c, [1, 2, 3, 4, 5])
    feed(m, c, [6])
    assert c.trimmable_rows() == 3
    before = (list(c.cache), c.offset, c._ring, c.trimmable_rows())
    for n in (4, 5, 100):
        with pytest.raises(StateError, match=rf"coverage\)?.*a rollback of {n} tokens"):
            c.trim(n)
        assert (list(c.cache), c.offset, c._ring, c.trimmable_rows()) == before
        assert all(a is b for a, b in zip(c.cache, before[0]))
    assert c.trim(0) == 0 and c.trim(-2) == 0
    for bad in (1.0, "1", True, None):
        with pytest.raises(InvalidArgumentError, match="n must be an integer"):
            c.trim(bad)
    assert (list(c.cache), c.offset, c.trimmable_rows()) == before[:2] + (3,)


def test_unrecorded_steps_clear_the_coverage():
    m, c = _model(), RecurrentCache(depth=2)
    feed(m, c, [1, 2, 3])
    assert c.trimmable_rows() == 2
    c[0] = mx.depends(c[0], c[1])  # qwen3_next's write of index 0 after the last layer: live value only
    assert c.trimmable_rows() == 2 and c.offset == 3
    c[1] = c[1] + 0  # a write of the last index outside the recorder: an unrecorded step
    assert c.trimmable_rows() == 0 and c.offset == 3
    feed(m, c, [4, 5])
    assert c.trimmable_rows() == 2
    c.advance(1)  # outside the recorder: counts, clears
    assert c.trimmable_rows() == 0 and c.offset == 6
    with pytest.raises(StateError):
        c.trim(1)
    # a cache of size 1: index 0 is the last index
    m1, c1 = _model(1), RecurrentCache(size=1, depth=2)
    feed(m1, c1, [1, 2])
    c1[-1] = c1[0]
    assert c1.trimmable_rows() == 0


def test_unsliceable_argument_runs_unsplit_with_coverage_zero():
    class Odd(FakeMixer):
        def __call__(self, x, mask=None, cache=None, extra=None):  # reads an array of another shape
            return super().__call__(x + extra.sum(), mask, cache)

    class L(nn.Module):
        def __init__(self):
            super().__init__()
            self.mixer = Odd()

        def __call__(self, x, cache=None):
            return self.mixer(x, cache=cache, extra=mx.zeros((5, 5)))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [L()]

    model, c = M(), RecurrentCache(depth=3)
    assert record_steps(model) == 1
    x = mx.ones((1, 4, 3))
    feed_calls = model.layers[0].mixer.calls
    model.layers[0](x, cache=c)
    assert feed_calls == [4] and c.offset == 4 and c.trimmable_rows() == 0


def test_an_argument_the_mixer_never_reads_is_handed_on():
    class Ignores(FakeMixer):  # as recurrent_gemma's RecurrentBlock ignores its attention mask
        def __call__(self, x, cache=None, mask=None):
            return super().__call__(x, None, cache)

    m = FakeModel()
    m.layers[0].mixer = Ignores()
    record_steps(m)
    c = RecurrentCache(depth=2)
    m.layers[0].mixer(mx.ones((1, 4, 3)), cache=c, mask=mx.zeros((4, 4)))
    assert m.mixer.calls == [2, 1, 1] and c.trimmable_rows() == 2


def test_mask_is_sliced_with_the_tokens():
    m, c = _model(), RecurrentCache(depth=2)
    feed(m, c, [1, 2, 3, 4, 5], mask=True)
    assert m.mixer.calls == [3, 1, 1] and m.mixer.masks == [(1, 3), (1, 1), (1, 1)]


def test_recorder_is_idempotent_and_undone():
    m = FakeModel()
    cls = type(m.mixer)
    assert record_steps(m) == 1 and record_steps(m) == 1
    assert type(m.mixer).__mro__[1] is cls and type(m.mixer).__name__ == cls.__name__
    keys = sorted(k for k, _ in tree_flatten(m.parameters()))
    assert unrecord_steps(m) == 1 and type(m.mixer) is cls and unrecord_steps(m) == 0
    c = RecurrentCache(depth=2)
    feed(m, c, [1, 2, 3])
    assert m.mixer.calls == [3] and c.trimmable_rows() == 0  # no recorder: an unrecorded step
    assert keys == sorted(k for k, _ in tree_flatten(m.parameters()))
    with pytest.raises(InvalidArgumentError, match="layers"):
        record_steps(object())


def test_a_mixer_error_leaves_the_cache_as_it_was():
    class Boom(FakeMixer):
        def __call__(self, x, mask=None, cache=None):
            if len(self.calls) == 2:
                raise RuntimeError("boom")
            return super().__call__(x, mask, cache)

    m = FakeModel()
    m.layers[0].mixer = Boom()
    record_steps(m)
    c = RecurrentCache(depth=3)
    feed(m, c, [1])
    before = (arrays_bytes(c.cache), c.offset, c.trimmable_rows())
    with pytest.raises(RuntimeError):
        feed(m, c, [2, 3, 4])
    assert (arrays_bytes(c.cache), c.offset, c.trimmable_rows()) == before


# -- snapshots, copies, state -------------------------------------------------------
def test_snapshot_isolation_and_restore_brings_back_coverage():
    m, c = _model(), RecurrentCache(depth=2)
    feed(m, c, [1, 2, 3, 4])
    snap = c.snapshot()
    held = arrays_bytes(snap.arrays)
    feed(m, c, [5, 6, 7])
    c.trim(2)
    c[1] = c[1] * 0
    assert arrays_bytes(snap.arrays) == held
    c.restore(snap)
    assert c.offset == 4 and c.trimmable_rows() == 2 and arrays_bytes(c.cache) == held
    assert c.trim(2) == 2
    assert arrays_bytes(c.cache) == arrays_bytes(reference([1, 2]).cache)
    with pytest.raises(InvalidArgumentError, match="RecurrentSnapshot"):
        c.restore(KVCache("fp16").snapshot())
    with pytest.raises(InvalidArgumentError, match="depth"):
        c.restore(RecurrentCache(depth=1).snapshot())


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy])
def test_copies_are_independent(how):
    m, c = _model(), RecurrentCache(depth=2)
    feed(m, c, [1, 2, 3])
    d = how(c)
    assert d.trimmable_rows() == 2 and arrays_bytes(d.cache) == arrays_bytes(c.cache)
    feed(m, d, [4])
    d[0] = d[0] * 0 + 1
    assert c.offset == 3 and arrays_bytes(c.cache) == arrays_bytes(reference([1, 2, 3]).cache)
    assert c.trim(2) == 2 and d.offset == 4
    assert arrays_bytes(c.cache) == arrays_bytes(reference([1]).cache)
    d.trim(1)
    assert d.offset == 3 and c.offset == 1


def test_state_setter_clears_the_checkpoints_and_held_state_is_isolated():
    m, c = _model(), RecurrentCache(depth=2)
    feed(m, c, [1, 2, 3])
    arrays, lp, lengths = c.state
    held = arrays_bytes(arrays)
    feed(m, c, [4])
    assert arrays_bytes(arrays) == held  # a held state never sees a later write
    meta = c.meta_state
    assert meta == ("4", "2", "2")
    c.state = (arrays, lp, lengths)
    assert c.trimmable_rows() == 0 and arrays_bytes(c.cache) == held
    with pytest.raises(StateError):
        c.trim(1)
    c.meta_state = ("3", "2", "2")
    assert c.offset == 3
    feed(m, c, [4])
    assert c.trim(1) == 1 and arrays_bytes(c.cache) == held
    with pytest.raises(InvalidArgumentError, match="entries"):
        c.state = ([None], None, None)
    with pytest.raises(InvalidArgumentError, match="meta_state"):
        c.meta_state = ("x",)


def test_bad_arguments_are_refused():
    for kw, rule in (({"size": 0}, "size must be >= 1"), ({"depth": -1}, "depth must be >= 0"),
                     ({"strict": 1}, "strict must be True or False"), ({"depth": 1.5}, "depth must be an integer")):
        with pytest.raises(InvalidArgumentError, match=rule):
            RecurrentCache(**kw)


# -- the list: atomic over attention + recurrent layers -----------------------------
def test_list_trim_is_atomic_over_mixed_layers():
    m = _model()
    kv, rc = KVCache("fp16"), RecurrentCache(depth=2)
    x = mx.ones((1, 1, 5, 4), mx.float16)
    kv.update_and_fetch(x, x)
    feed(m, rc, [1, 2, 3, 4, 5])
    before = (kv.offset, rc.offset, arrays_bytes(rc.cache))
    with pytest.warns(RollbackWarning, match="coverage") as rec:
        assert trim_prompt_cache([kv, rc], 3) == 0
    assert len(rec) == 1 and (kv.offset, rc.offset, arrays_bytes(rc.cache)) == before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trim_prompt_cache([kv, rc], 3) == 0  # once per cache
    with pytest.raises(StateError, match=r"layer\(s\) \[1\] can roll back \[2\] \(a recurrent layer beyond its "
                                          r"checkpoints' coverage\); nothing was trimmed"):
        trim_prompt_cache([kv, rc], 3, strict=True)
    strict = RecurrentCache(depth=2, strict=True)
    feed(m, strict, [1, 2, 3])
    with pytest.raises(StateError, match="strict|coverage"):
        strict.warn_refused_rollback(3)
    assert trim_prompt_cache([kv, rc], 2) == 2
    assert kv.offset == 3 and rc.offset == 3
    assert arrays_bytes(rc.cache) == arrays_bytes(reference([1, 2, 3]).cache)


# -- prompt-cache files ---------------------------------------------------------------
def test_prompt_cache_file_round_trip(tmp_path):
    m2, m1 = _model(2, mx.bfloat16), _model(1)
    a, b, e = RecurrentCache(depth=3, strict=True), RecurrentCache(size=1, depth=0), RecurrentCache(depth=2)
    feed(m2, a, [3, 1, 4, 1, 5])
    feed(m1, b, [9, 2])
    kv = KVCache("fp16")
    x = mx.ones((1, 1, 2, 4), mx.float16)
    kv.update_and_fetch(x, x)
    f = tmp_path / "p.safetensors"
    save_prompt_cache(f, [a, kv, b, e], {"k": "v"})
    (la, lkv, lb, le), meta = load_prompt_cache(f, return_metadata=True)
    assert meta == {"k": "v"} and type(la) is RecurrentCache and type(lkv) is KVCache
    for got, want in ((la, a), (lb, b), (le, e)):
        assert arrays_bytes(got.cache) == arrays_bytes(want.cache)
        assert (got.offset, got.depth, len(got.cache), got.strict) == (want.offset, want.depth, len(want.cache),
                                                                       want.strict)
        assert got.trimmable_rows() == 0  # a file holds no checkpoints
    assert la[0].dtype == mx.bfloat16
    feed(m2, la, [7])
    feed(m2, a, [7])
    assert arrays_bytes(la.cache) == arrays_bytes(a.cache) and la.trim(1) == 1
    # mlx-lm's writer cannot keep offset and depth: refused, nothing written
    from mlx_lm.models import cache as lm_cache
    g = tmp_path / "lm.safetensors"
    with pytest.raises(UnsupportedOperationError, match="kvspec.impl.models.save_prompt_cache"):
        lm_cache.save_prompt_cache(str(g), [a])
    assert not g.exists()
    # a file of mlx-lm's own ArraysCache loads as a RecurrentCache of depth 0
    lm = lm_cache.ArraysCache(size=2)
    lm[0], lm[1] = a[0], a[1]
    lm_cache.save_prompt_cache(str(g), [lm, lm_cache.KVCache()])
    (r, _) = load_prompt_cache(g)
    assert type(r) is RecurrentCache and r.depth == 0 and arrays_bytes(r.cache) == arrays_bytes(a.cache)


def test_make_prompt_cache_maps_arrays_caches_and_installs_the_recorder():
    from mlx_lm.models import cache as lm_cache

    class Hybrid(FakeModel):
        def make_cache(self):
            return [lm_cache.ArraysCache(size=2), lm_cache.KVCache(), lm_cache.ArraysCache(size=1)]

    model = Hybrid()
    caches = make_prompt_cache(model)
    assert [type(c).__name__ for c in caches] == ["RecurrentCache", "KVCache", "RecurrentCache"]
    # depth 0: the recorder is installed too (it counts the tokens of each call, never splits)
    assert [c.depth for c in caches[::2]] == [0, 0] and type(model.mixer) is not FakeMixer
    caches = make_prompt_cache(model, num_draft_tokens=3, undo=1, strict=True)
    assert [(len(c.cache), c.depth, c.strict) for c in caches[::2]] == [(2, 3, True), (1, 3, True)]
    assert type(model.mixer) is not FakeMixer and isinstance(model.mixer, FakeMixer)
    assert isinstance(caches[0], lm_cache.ArraysCache)  # the models' isinstance checks hold

    class Falcon(FakeModel):
        def make_cache(self):
            return [lm_cache.CacheList(lm_cache.ArraysCache(size=2), lm_cache.KVCache())]

    with pytest.raises(UnsupportedOperationError, match="CacheList.*falcon_h1"):
        make_prompt_cache(Falcon())


# -- inside mlx-lm's hybrid models --------------------------------------------------
def _scaled(model):
    """Random weights scaled up (x4 on every matrix) so greedy decoding moves
    between tokens instead of repeating one."""
    from mlx.utils import tree_map

    model.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, model.parameters()))
    model.eval()
    return model


def qwen3_next_model(seed):
    from mlx_lm.models import qwen3_next

    mx.random.seed(seed)
    return _scaled(qwen3_next.Model(qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=32, num_hidden_layers=4, intermediate_size=64, num_attention_heads=2,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=1, decoder_sparse_step=1,
        shared_expert_intermediate_size=64, mlp_only_layers=[0, 1, 2, 3], moe_intermediate_size=32, rms_norm_eps=1e-5,
        vocab_size=64, num_key_value_heads=1, rope_theta=10000.0, partial_rotary_factor=0.5,
        max_position_embeddings=256, head_dim=16, full_attention_interval=2)))


def lfm2_model(seed):
    from mlx_lm.models import lfm2

    mx.random.seed(seed)
    return _scaled(lfm2.Model(lfm2.ModelArgs(
        model_type="lfm2", vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
        block_dim=32, block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
        block_ff_dim=64, layer_types=["conv", "full_attention", "conv"])))


PROMPT = [1, 5, 9, 3, 7, 2, 8]
MAX_TOKENS = 14


def _greedy(model):
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache as lm_make_prompt_cache

    prompt = mx.array(PROMPT, mx.uint32)
    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=MAX_TOKENS,
                                             prompt_cache=lm_make_prompt_cache(model))]


def _speculative(model, draft, k):
    from mlx_lm.generate import speculative_generate_step

    caches = make_prompt_cache(model, num_draft_tokens=k)
    main = [c for c in caches if isinstance(c, RecurrentCache)]
    trimmed = []
    def counting(trim):
        def counted(n):
            trimmed.append(trim(n))
            return trimmed[-1]
        return counted

    for c in main:  # count the main model's rollbacks, so the test knows it exercised them
        c.trim = counting(c.trim)
    prompt = mx.array(PROMPT, mx.uint32)
    got = [int(t) for t, _, _ in speculative_generate_step(
        prompt, model, draft, num_draft_tokens=k, max_tokens=MAX_TOKENS,
        prompt_cache=caches + make_prompt_cache(draft, num_draft_tokens=k))]
    return got, sum(trimmed)


def recurrent_gemma_model(seed):
    """Its recurrent blocks call no advance (the recorder counts) and take
    the attention mask, which they never read."""
    from mlx_lm.models import recurrent_gemma

    mx.random.seed(seed)
    return _scaled(recurrent_gemma.Model(recurrent_gemma.ModelArgs(
        model_type="recurrent_gemma", attention_bias=False, conv1d_width=4, hidden_size=32, intermediate_size=64,
        logits_soft_cap=30.0, num_attention_heads=2, num_hidden_layers=3, num_key_value_heads=1, rms_norm_eps=1e-6,
        rope_theta=10000.0, attention_window_size=64, vocab_size=64, block_types=["recurrent", "recurrent", "attention"])))


@pytest.mark.parametrize("build", [qwen3_next_model, lfm2_model, recurrent_gemma_model],
                         ids=["qwen3_next", "lfm2", "recurrent_gemma"])
def test_speculative_decoding_of_hybrid_models_equals_greedy(build):
    model = build(0)
    want = _greedy(model)
    assert len(set(want)) > 3  # a stream that moves
    for k in (1, 2, 3, 4):
        got, _ = _speculative(model, model, k)
        assert got == want, f"draft = the model, k={k}"
    other = build(1)
    rolled_back = 0
    for k in (1, 2, 3, 4):
        got, trimmed = _speculative(model, other, k)
        assert got == want, f"another draft, k={k}"
        rolled_back += trimmed
    assert rolled_back > 0  # rejected drafts were rolled back in the recurrent layers
    assert record_steps(model) == 2 and unrecord_steps(model) == 2


def test_batch_generation_with_recurrent_caches_equals_mlx_lm():
    """A drop-in in mlx-lm's BatchGenerator too: merged (ArraysCache.merge,
    into a RecurrentCache of depth 0), extended by a sequence mid-stream,
    filtered as sequences finish, the same tokens as with mlx-lm's caches."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache as lm_make_prompt_cache

    model = lfm2_model(0)
    prompts = [[1, 5, 9, 3], [7, 2], [8, 8, 1, 2, 3]]
    outs = []
    for make in (lm_make_prompt_cache, make_prompt_cache):
        gen = BatchGenerator(model)
        uids = gen.insert(prompts[:2], max_tokens=[5, 3], caches=[make(model) for _ in prompts[:2]])
        got: dict[int, list[int]] = {u: [] for u in uids}
        for r in gen.next_generated():
            got[r.uid].append(r.token)
        uids += gen.insert(prompts[2:], max_tokens=[6], caches=[make(model)])  # the batch extended mid-stream
        got[uids[-1]] = []
        while responses := gen.next_generated():
            for r in responses:
                got[r.uid].append(r.token)
        outs.append([got[u] for u in uids])
    assert outs[0] == outs[1] and [len(o) for o in outs[1]] == [5, 3, 6]


def test_from_state_refuses_what_does_not_fit():
    conv, state = mx.zeros((1, 3, 4)), mx.zeros((2, 5))
    for arrays, meta, rule in (((conv,), ("0", "1", "2"), "needs 2 arrays or none"),
                               ((conv, state), ("0", "1", "2"), "disagree on the batch size"),
                               ((conv, mx.zeros((1, 5))), ("0", "-1", "2"), "meta_state"),
                               ((conv, mx.zeros((1, 5))), ("0", "1"), "meta_state"),
                               ((conv, mx.zeros((1, 5))), ("0", "1", "2", "7"), "meta_state"),
                               ((conv, "x"), ("0", "1", "2"), "mx.array")):
        with pytest.raises(InvalidArgumentError, match=rule):
            RecurrentCache.from_state(arrays, meta)
    c = RecurrentCache.from_state((conv, mx.zeros((1, 5))), ("7", "2", "2", "1"))
    assert (c.offset, c.depth, c.strict, c.trimmable_rows()) == (7, 2, True, 0)
