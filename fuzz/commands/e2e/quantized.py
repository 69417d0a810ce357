"""Scenario 12: quantized caches on a model with sliding-window layers
(gemma3): every quantized mode, and mlx-lm's ``kv_bits``."""

from __future__ import annotations

import warnings

from kvspec.fuzz.commands.e2e.checks import (
    DEFAULT,
    Size,
    Tally,
    check_unchanged,
    compare,
    require,
    views,
)
from kvspec.fuzz.commands.e2e.models import TURBO_E2E, Factories, _rotating, tiny_gemma3, token_ids
from kvspec.fuzz.commands.e2e.streams import greedy
from kvspec.impl.models import make_prompt_cache

#: the quantized modes of make_prompt_cache, each on gemma3
QUANT_MODES = ("int8", *TURBO_E2E)


def _caches(model, mode: str, factories: Factories):
    kw = TURBO_E2E.get(mode, {})
    return make_prompt_cache(model, mode=mode, step=4, classes=factories if mode == "int8" else None, **kw)


def scenario_quantized_models(size: Size, factories: Factories = None) -> tuple[Tally, float | None]:
    """gemma3 (two sliding-window layers of window W, one global layer)
    with ``make_prompt_cache(model, mode=M)`` for Int8 and every Turbo
    mode: the global layer stores M, the sliding-window layers are fp16
    rings; the model decodes 3W tokens (the rings wrap); a snapshot in the
    steady state, a branch, a restore and a second branch equal a fresh run
    of that branch byte for byte (tokens and log-probabilities), and the
    snapshot never changes. Then mlx-lm's ``kv_bits`` on gemma3 with our
    fp16 caches (``quantized_kv_start=0``): ``kv_bits=4`` makes the global
    layer mlx-lm's QuantizedKVCache from the first token and keeps the rings
    (one warning per ring), ``kv_bits=8`` makes it our Int8; mlx-lm's own
    caches raise at the first token on the same call (reported)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import QuantizedKVCache
    from mlx_lm.models.cache import make_prompt_cache as lm_make_prompt_cache

    tally = Tally()
    W = size.window
    lm_refusal = ""
    # the first seed only, but at the long size (make test and make verify stay fast)
    for seed in size.seeds if size.tokens > DEFAULT.tokens else size.seeds[:1]:
        model = tiny_gemma3(seed, W, head_dim=32)
        prompt, a_first, b_turn = token_ids(seed, 7), token_ids(seed + 1, 1), token_ids(seed + 2, 3)
        for mode in QUANT_MODES:
            label = f"seed {seed}, W={W}, mode {mode}"
            caches = _caches(model, mode, factories)
            rings = _rotating(caches)
            require(len(rings) == 2 and all(r.mode == "fp16" for r in rings), f"{label}: expected 2 fp16 rings")
            require(caches[2].mode == mode, f"{label}: the global layer stores {caches[2].mode}")
            history = greedy(model, caches, prompt, 3 * W)
            require(all(r.wrapped for r in rings), f"{label}: the rings did not wrap")
            snaps = [c.snapshot() for c in caches]
            before = views(snaps)
            greedy(model, caches, a_first, W)
            for c, s in zip(caches, snaps):
                c.restore(s)
            b = greedy(model, caches, b_turn, W)
            check_unchanged(f"{label}, after the branches", before, views(snaps))
            fresh = _caches(model, mode, None)
            compare(f"{label}: history vs a second run", history, greedy(model, fresh, prompt, 3 * W), tally)
            compare(f"{label}: branch after restore vs fresh", b, greedy(model, fresh, b_turn, W), tally)

        for bits, want in ((4, QuantizedKVCache), (8, None)):
            label = f"seed {seed}, kv_bits={bits}"
            caches = make_prompt_cache(model, step=4)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                toks = [int(t) for t, _ in generate_step(prompt, model, max_tokens=2 * W, prompt_cache=caches,
                                                          kv_bits=bits, kv_group_size=32, quantized_kv_start=0)]
            kept = [w for w in caught if "keeps its rows unquantized" in str(w.message)]
            require(len(kept) == 2, f"{label}: {len(kept)} ring warnings, want one per ring (2)")
            require(len(_rotating(caches)) == 2, f"{label}: the rings were replaced")
            glob = caches[2]
            ok = type(glob) is want if want is not None else getattr(glob, "mode", None) == "int8"
            require(ok, f"{label}: the global layer is {type(glob).__name__}")
            require(len(toks) == 2 * W and len(set(toks)) >= (2 * W) // 3, f"{label}: stream collapsed")
            tally.tokens.extend(toks)
        try:
            list(generate_step(prompt, model, max_tokens=2, prompt_cache=lm_make_prompt_cache(model), kv_bits=4,
                               kv_group_size=32, quantized_kv_start=0))
            lm_refusal = "mlx-lm's own caches took it"
        except NotImplementedError as exc:
            lm_refusal = f"mlx-lm's own caches raise NotImplementedError ({exc})"
    tally.note(f"gemma3 in {', '.join(QUANT_MODES)}: global layer quantized, rings fp16, restore = fresh bytes; "
               f"kv_bits 4/8 from the first token: global QuantizedKVCache/Int8, rings kept (one warning each); "
               f"{lm_refusal}")
    return tally, None
