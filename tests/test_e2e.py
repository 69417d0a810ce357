"""Real decoding (issue 7): kvspec caches inside mlx-lm models.

The scenarios of ``fuzz.e2e`` in their short form, the injected bugs that
must make them fail, and the list-level helpers of ``kvspec.impl.models``.
"""

from __future__ import annotations

import copy
import json

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from kvspec.fuzz.bugs import by_name as bug_by_name
from kvspec.fuzz.commands.e2e import (
    SCENARIOS,
    run_scenario,
    tiny_gemma3,
    tiny_llama,
)
from kvspec.impl.dense import KVCache
from kvspec.impl.models import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec.errors import InvalidArgumentError, UnsupportedOperationError


def rows(n: int, start: float = 0.0) -> mx.array:
    """``[1, 2, n, 4]`` float16 rows whose values name their position."""
    a = np.arange(start, start + n, dtype=np.float32)[None, None, :, None] * np.ones((1, 2, 1, 4), np.float32)
    return mx.array(a).astype(mx.float16)


def window_bytes(cache) -> bytes:
    k, v = cache.fetch()
    return np.array(k).tobytes() + np.array(v).tobytes()


# -- the scenarios ---------------------------------------------------------------
@pytest.mark.parametrize("name", [s.name for s in SCENARIOS])
def test_scenario_passes(name):
    result = run_scenario(name)
    assert result.ok, result.detail
    # Every compared stream reached min_distinct(len) distinct tokens (checked
    # inside the scenario); over the whole scenario:
    assert result.tokens >= 40 and result.distinct >= 30
    if name == "speculative":
        assert result.acceptance is not None and 0.1 < result.acceptance < 0.9
    if name == "turbo":  # speculative equals greedy in every Turbo mode, and the deviation is reported
        assert "speculative = greedy bytes in turbo4asym, turbo4, turbo3asym" in result.detail
        for mode in ("turbo4asym", "turbo4", "turbo3asym", "turbo4delegated"):
            assert f"{mode} vs fp16: max |dlogp|" in result.detail
        assert 0 < result.acceptance < 1


# -- injected bugs make the scenarios fail ---------------------------------------
def test_rollback_keeping_idx_breaks_speculative_window():
    """The draft's rollbacks undo decode steps: a cursor left behind shows
    in the draft's logits against the run that never had those rows."""
    result = run_scenario("speculative_window", factories=bug_by_name("rollback_keeps_idx").factories)
    assert not result.ok
    assert "draft model" in result.detail and "never had the rolled-back rows" in result.detail


def test_flagship_steady_state_inplace_breaks_sliding_window():
    result = run_scenario("sliding_window", factories=bug_by_name("steady_state_inplace").factories)
    assert not result.ok
    assert "after branch A: snapshot of layer(s)" in result.detail and "isolation" in result.detail


def test_float16_cast_breaks_bf16_models():
    result = run_scenario("bf16_models", factories=bug_by_name("fp16_casts_rows").factories)
    assert not result.ok
    assert "bf16 seed 0, in-place on: step 0" in result.detail and "log-probabilities differ" in result.detail


def test_inplace_after_trim_breaks_prompt_reuse():
    result = run_scenario("prompt_reuse", factories=bug_by_name("inplace_after_trim").factories)
    assert not result.ok
    assert "after conversation A: snapshot of layer(s)" in result.detail


def test_inplace_after_restore_breaks_prompt_reuse():
    # B and C restored from one snapshot both take its buffers for their own.
    result = run_scenario("prompt_reuse", factories=bug_by_name("inplace_after_restore").factories)
    assert not result.ok
    assert "after restore vs fresh" in result.detail


class DeepcopyKeepsMarker(KVCache):
    """The behaviour before ``kvspec.impl.dense.copy_without_marker``: a deep copy
    keeps an ownership marker for its aliased buffers."""

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new


def test_deepcopy_keeping_the_marker_breaks_lru_prompt_cache():
    result = run_scenario("lru_prompt_cache", factories={"dense": DeepcopyKeepsMarker})
    assert not result.ok
    assert "from the LRU cache vs fresh" in result.detail


def per_layer_trim(caches, n):
    """A non-atomic rollback: each layer trims what it can."""
    return [c.trim(n) for c in caches][-1]


def test_per_layer_trim_breaks_mixed_rollback():
    result = run_scenario("mixed_rollback", trim=per_layer_trim)
    assert not result.ok
    assert "refused for all layers together" in result.detail


def test_cli_json():
    import contextlib
    import io

    from kvspec.fuzz.commands.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["e2e", "--json", "--only", "mixed_rollback"])
    doc = json.loads(out.getvalue())
    assert code == 0 and doc["ok"]
    assert [s["scenario"] for s in doc["scenarios"]] == ["mixed_rollback"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["e2e", "--json", "--only", "sliding_window", "--bug", "steady_state_inplace"])
    # exit 1 = something diverged, as for replay and fuzz: the bug was caught
    assert code == 1 and not json.loads(out.getvalue())["scenarios"][0]["ok"]


# -- kvspec.impl.models --------------------------------------------------------------------
def test_make_prompt_cache_layout_follows_the_model():
    llama = tiny_llama(0)
    caches = make_prompt_cache(llama, mode="int8", step=8, inplace=False)
    assert [type(c) for c in caches] == [KVCache, KVCache]
    assert all(c.mode == "int8" and c.step == 8 and not c.inplace for c in caches)

    gemma = tiny_gemma3(0, window=6)  # layers 0, 1 sliding, layer 2 global
    caches = make_prompt_cache(gemma, step=4)
    assert [type(c) for c in caches] == [RotatingKVCache, RotatingKVCache, KVCache]
    assert [(c.max_size, c.keep, c.step) for c in caches[:2]] == [(6, 0, 4), (6, 0, 4)]
    # a quantized mode applies to the global layer; the sliding-window layers stay fp16 rings
    caches = make_prompt_cache(gemma, mode="int8", step=4)
    assert [type(c) for c in caches] == [RotatingKVCache, RotatingKVCache, KVCache] and caches[2].mode == "int8"


def test_make_prompt_cache_without_make_cache():
    class Bare:
        def __init__(self):
            self.layers = [object(), object(), object()]

    assert [type(c) for c in make_prompt_cache(Bare())] == [KVCache] * 3
    rings = make_prompt_cache(Bare(), max_kv_size=16)
    assert [(type(c), c.max_size, c.keep) for c in rings] == [(RotatingKVCache, 16, 4)] * 3


class _WithMakeCache:
    layers = (object(), object())

    def make_cache(self):
        from mlx_lm.models.cache import KVCache as LmKVCache
        from mlx_lm.models.cache import RotatingKVCache as LmRing

        return [LmRing(max_size=8, keep=2), LmKVCache()]


class _Bare:
    layers = (object(), object())


@pytest.mark.parametrize("model,kwargs", [(_WithMakeCache(), {}), (_Bare(), {"max_kv_size": 16}), (_Bare(), {})],
                         ids=["make_cache", "max_kv_size", "bare"])
@pytest.mark.parametrize("step,inplace,undo,drafts", [(8, False, 3, 5), (3, True, 1, 0), (256, None, 0, 2)])
def test_make_prompt_cache_passes_every_argument_on_every_layout(model, kwargs, step, inplace, undo, drafts,
                                                                 monkeypatch):
    """Each layout branch (the model's make_cache, max_kv_size rings, all
    dense) gives every layer the step, in-place switch and, for a ring, the
    undo depth (``max(undo, num_draft_tokens)``), window and sinks it was
    asked for: a branch that drops one (the max_kv_size rings built without
    undo or without num_draft_tokens, make_cache rings built without the
    layer's keep) is otherwise seen by no test, since every scenario and
    campaign builds its rings through one branch only, with keep 0."""
    monkeypatch.setenv("KV_INPLACE_WRITE", "0")
    caches = make_prompt_cache(model, step=step, inplace=inplace, undo=undo, num_draft_tokens=drafts, **kwargs)
    want_inplace = False if inplace is None else inplace
    want_window = (8, 2) if isinstance(model, _WithMakeCache) else (kwargs.get("max_kv_size"), 4)
    for c in caches:
        assert (c.step, c.inplace) == (step, want_inplace), c
        if isinstance(c, RotatingKVCache):
            assert (c.undo, c.max_size, c.keep) == (max(undo, drafts), *want_window), c
        else:
            assert c.mode == "fp16", c
    assert any(isinstance(c, RotatingKVCache) for c in caches) == (model.__class__ is _WithMakeCache
                                                                   or "max_kv_size" in kwargs)


def test_make_prompt_cache_refuses_unknown_layer_kinds():
    from mlx_lm.models.cache import ChunkedKVCache

    class Hybrid:
        def __init__(self):
            self.layers = [object(), object()]

        def make_cache(self):
            from mlx_lm.models.cache import KVCache as LmKVCache

            return [LmKVCache(), ChunkedKVCache(4)]  # (ArraysCache layers are RecurrentCache now)

    with pytest.raises(UnsupportedOperationError, match="layer 1 needs a ChunkedKVCache"):
        make_prompt_cache(Hybrid())


def test_trim_prompt_cache_trims_every_layer_by_the_same_count():
    a, b = KVCache(step=4), KVCache(step=4)
    a.update_and_fetch(rows(5), rows(5))
    b.update_and_fetch(rows(3), rows(3))
    assert can_trim_prompt_cache([a, b])
    assert trim_prompt_cache([a, b], 4) == 3  # the shortest layer can give back 3
    assert (a.offset, b.offset) == (2, 0)
    assert trim_prompt_cache([a], 0) == 0 and trim_prompt_cache([a], -2) == 0 and a.offset == 2
    assert trim_prompt_cache([], 3) == 0 and not can_trim_prompt_cache([])
    with pytest.raises(InvalidArgumentError, match="trim_prompt_cache: n must be an integer"):
        trim_prompt_cache([a], 1.5)


def test_trim_prompt_cache_refuses_atomically_after_a_wrap():
    ring, dense = RotatingKVCache(max_size=4, step=2), KVCache(step=4)
    for i in range(6):
        ring.update_and_fetch(rows(1, i), rows(1, i))
        dense.update_and_fetch(rows(1, i), rows(1, i))
    before = [(c.offset, window_bytes(c)) for c in (ring, dense)]
    assert not can_trim_prompt_cache([ring, dense])
    assert trim_prompt_cache([ring, dense], 2) == 0
    assert [(c.offset, window_bytes(c)) for c in (ring, dense)] == before


def test_trim_prompt_cache_with_an_undo_log_trims_within_the_bound_only():
    ring, dense = RotatingKVCache(max_size=4, step=2, undo=2), KVCache(step=4)
    for i in range(6):
        ring.update_and_fetch(rows(1, i), rows(1, i))
        dense.update_and_fetch(rows(1, i), rows(1, i))
    assert can_trim_prompt_cache([ring, dense]) and ring.trimmable_rows() == 2
    before = [(c.offset, window_bytes(c)) for c in (ring, dense)]
    assert trim_prompt_cache([ring, dense], 3) == 0  # beyond the ring's bound: nobody trims
    assert [(c.offset, window_bytes(c)) for c in (ring, dense)] == before
    assert trim_prompt_cache([ring, dense], 2) == 2 and (ring.offset, dense.offset) == (4, 4)


# -- copies are holders, not owners -------------------------------------------------
@pytest.mark.parametrize("make", [lambda: KVCache(step=8, inplace=True),
                                  lambda: RotatingKVCache(max_size=8, step=8, inplace=True)],
                         ids=["dense", "rotating"])
@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
def test_copies_of_a_cache_do_not_write_into_each_other(make, copier):
    cache = make()
    cache.update_and_fetch(rows(3), rows(3))
    cache.update_and_fetch(rows(1, 3), rows(1, 3))  # the marker now names the buffers
    a, b = copier(cache), copier(cache)
    a.update_and_fetch(rows(1, 10), rows(1, 10))
    seen = window_bytes(a)
    b.update_and_fetch(rows(1, 20), rows(1, 20))
    cache.update_and_fetch(rows(1, 30), rows(1, 30))
    assert not a.last_write_inplace and not b.last_write_inplace and cache.last_write_inplace
    assert window_bytes(a) == seen
    assert np.array(b.fetch()[0])[0, 0, -1, 0] == 20


def test_speculative_on_a_gpu_compares_with_mlx_lm_caches_and_still_catches_a_bad_trim(monkeypatch):
    """On a GPU a k-row verify rounds differently from one-row steps, so the
    speculative scenario's reference is speculative decoding with mlx-lm's
    caches (same shapes). Run here with the GPU branch forced: it passes,
    and a trim that keeps one rejected row is still caught."""
    from kvspec.fuzz.commands import e2e
    from kvspec.impl.dense import KVCache

    class TrimOneShort(KVCache):
        def trim(self, n):
            return super().trim(max(0, n - 1))

    monkeypatch.setattr(e2e.checks, "on_gpu", lambda: True)  # where the scenarios and registry look it up
    ok = e2e.run_scenario("speculative", e2e.SHORT)
    assert ok.ok and "mlx-lm's caches" in ok.detail, ok.detail
    bad = e2e.run_scenario("speculative", e2e.SHORT, factories={"dense": TrimOneShort})
    assert not bad.ok and "speculative vs mlx-lm's caches" in bad.detail, bad.detail
    assert [n for n, _ in e2e.gpu_skipped()] == ["prefix_sharing", "speculative_window", "turbo", "quantized_models",
                                                 "hybrid_speculative", "hybrid_prompt_reuse"]


def test_no_scenario_is_skipped_on_the_cpu():
    from kvspec.fuzz.commands import e2e

    assert e2e.gpu_skipped() == []
    assert all(s.cpu_only == "" or s.name in {"prefix_sharing", "speculative_window", "turbo", "quantized_models",
                                                                "hybrid_speculative", "hybrid_prompt_reuse"} for s in e2e.SCENARIOS)
