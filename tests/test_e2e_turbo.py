"""``make_prompt_cache`` in the Turbo modes. The Turbo modes inside a real
mlx-lm model (scenario ``turbo`` of ``kvspec e2e``, short form) are
tests/test_e2e.py's ``test_scenario_passes[turbo]``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("mlx_lm")

from kvspec.fuzz.commands.e2e import tiny_gemma3, tiny_llama
from kvspec.impl.models import make_prompt_cache
from kvspec.impl.turbo import DelegatedKVCache, TurboKVCache
from kvspec.spec.errors import UnsupportedOperationError


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
