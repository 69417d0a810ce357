"""Scenarios 1 and 9: greedy decoding against mlx-lm's caches (float16, bfloat16)."""

from __future__ import annotations

import mlx.core as mx

from kvspec.fuzz.commands.e2e.checks import Size, Tally, compare, require
from kvspec.fuzz.commands.e2e.models import (
    Factories,
    build_caches,
    mlx_lm_caches,
    tiny_gemma3,
    tiny_llama,
    token_ids,
)
from kvspec.fuzz.commands.e2e.streams import greedy


def scenario_greedy(size: Size, factories: Factories = None) -> tuple[Tally, float | None]:
    """Greedy decode, two chat turns: our Fp16 caches give the tokens and
    byte-identical log-probabilities of mlx-lm's own KVCache, with in-place
    writes on and off, at the production step (256) and a tiny one (3, a
    growth every third row)."""
    tally = Tally()
    for seed in size.seeds:
        model = tiny_llama(seed)
        prompt, turn = token_ids(seed, 12), token_ids(seed + 1000, 5)
        ref_caches = mlx_lm_caches(model)
        ref = greedy(model, ref_caches, prompt, size.tokens) + greedy(model, ref_caches, turn, size.tokens)
        for inplace in (True, False):
            for step in (256, 3):
                caches = build_caches(model, "fp16", step, inplace, factories)
                got = greedy(model, caches, prompt, size.tokens) + greedy(model, caches, turn, size.tokens)
                compare(f"seed {seed}, in-place {'on' if inplace else 'off'}, step {step}", got, ref, tally)
                require(not inplace or got.inplace_writes > 0,
                        f"seed {seed}, step {step}: in-place switch on but no decode write went in place")
    tally.note("tokens and log-prob bytes = mlx-lm KVCache (in-place on/off, step 256/3)")
    return tally, None


def scenario_bf16_models(size: Size, factories: Factories = None) -> tuple[Tally, float | None]:
    """bfloat16 models (a llama, and a gemma3 with sliding-window layers):
    our caches store and return the model's bfloat16 rows, so tokens and
    log-probability bytes equal those with mlx-lm's own caches (KVCache;
    RotatingKVCache for gemma3's windowed layers), in-place writes on and
    off. A cache that cast rows to float16 decodes different tokens here."""
    tally = Tally()
    for seed in size.seeds:
        models = (("llama", tiny_llama(seed, dtype=mx.bfloat16)),
                  ("gemma3", tiny_gemma3(seed, size.window, dtype=mx.bfloat16)))
        for label, model in models:
            prompt, turn = token_ids(seed, 12), token_ids(seed + 1000, 5)
            ref_caches = mlx_lm_caches(model)
            ref = greedy(model, ref_caches, prompt, size.tokens) + greedy(model, ref_caches, turn, size.tokens)
            for inplace in (True, False):
                caches = build_caches(model, "fp16", 3, inplace, factories)
                got = greedy(model, caches, prompt, size.tokens) + greedy(model, caches, turn, size.tokens)
                compare(f"{label} bf16 seed {seed}, in-place {'on' if inplace else 'off'}", got, ref, tally)
                dtypes = {str(c.fetch()[0].dtype) for c in caches}
                require(dtypes == {"mlx.core.bfloat16"}, f"{label} bf16 seed {seed}: cached rows are {dtypes}")
    tally.note("bf16 llama and gemma3: tokens and log-prob bytes = mlx-lm's caches (in-place on/off)")
    return tally, None
