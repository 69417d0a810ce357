"""The Turbo modes inside a real mlx-lm model (scenario ``turbo`` of
``kvspec e2e``, short form) and ``make_prompt_cache`` in the Turbo modes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("mlx_lm")

from fuzz.commands.e2e import SHORT, run_scenario, tiny_gemma3, tiny_llama
from impl.models import make_prompt_cache
from impl.turbo import DelegatedKVCache, TurboKVCache
from spec.errors import UnsupportedOperationError


def test_make_prompt_cache_builds_turbo_layers():
    model = tiny_llama(0)
    caches = make_prompt_cache(model, mode="turbo4")
    assert len(caches) == 2 and all(type(c) is TurboKVCache and c.mode == "turbo4" for c in caches)
    caches = make_prompt_cache(model, mode="turbo4delegated", hot_threshold=5, fold_block=2)
    assert all(type(c) is DelegatedKVCache and (c.hot_threshold, c.fold_block) == (5, 2) for c in caches)
    gemma = make_prompt_cache(tiny_gemma3(0, 8), mode="turbo4asym")  # sliding layers stay rings
    assert [type(c).__name__ for c in gemma] == ["RotatingKVCache", "RotatingKVCache", "TurboKVCache"]
    with pytest.raises(UnsupportedOperationError, match="supports mode 'fp16' only"):
        make_prompt_cache(SimpleNamespace(layers=[None, None]), mode="turbo4asym", max_kv_size=8)


def test_turbo_scenario_speculative_equals_greedy_and_reports_deviation():
    r = run_scenario("turbo", SHORT)
    assert r.ok, r.detail
    assert "speculative = greedy bytes in turbo4asym, turbo4, turbo3asym" in r.detail
    for mode in ("turbo4asym", "turbo4", "turbo3asym", "turbo4delegated"):
        assert f"{mode} vs fp16: max |dlogp|" in r.detail
    assert 0 < r.acceptance < 1
