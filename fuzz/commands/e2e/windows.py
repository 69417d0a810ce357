"""Scenarios 4 and 5: sliding-window layers (rings) decoding past the window, and mixed-layer rollback."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from kvspec.fuzz.commands.e2e.checks import (
    Size,
    Tally,
    check_unchanged,
    compare,
    layer_states,
    require,
    views,
)
from kvspec.fuzz.commands.e2e.models import (
    Factories,
    _rotating,
    build_caches,
    mlx_lm_caches,
    tiny_gemma3,
    tiny_llama,
    token_ids,
)
from kvspec.fuzz.commands.e2e.streams import greedy
from kvspec.impl.models import can_trim_prompt_cache, trim_prompt_cache
from kvspec.spec.errors import RollbackWarning


def scenario_sliding_window(size: Size, factories: Factories = None) -> tuple[Tally, float | None]:
    """gemma3 (two sliding-window layers of window W, one global layer)
    decodes 3W tokens; a snapshot is taken in the steady state (every ring
    wrapped); branch A decodes W + 4 more single tokens right away (every
    ring slot overwritten); the snapshot is restored later and branch B
    decodes a turn and 2W tokens. History and A equal mlx-lm's own caches,
    B equals a fresh run, the snapshot never changed."""
    tally = Tally()
    W = size.window
    for seed in size.seeds:
        model = tiny_gemma3(seed, W)
        prompt, a_first, b_turn = token_ids(seed, 7), token_ids(seed + 1, 1), token_ids(seed + 2, 5)
        label = f"seed {seed}, W={W}"
        caches = build_caches(model, "fp16", 4, True, factories)
        require(len(_rotating(caches)) == 2, f"{label}: expected 2 sliding-window layers, got {caches}")
        history = greedy(model, caches, prompt, 3 * W)
        require(all(r.wrapped for r in _rotating(caches)), f"{label}: the rings did not wrap")
        snaps = [c.snapshot() for c in caches]
        before = views(snaps)
        a = greedy(model, caches, a_first, W + 4)
        require(a.inplace_writes > 0, f"{label}: branch A made no in-place write (dense layer)")
        check_unchanged(f"{label}, after branch A", before, views(snaps))

        lm = mlx_lm_caches(model)
        compare(f"{label}: history vs mlx-lm RotatingKVCache", history, greedy(model, lm, prompt, 3 * W), tally)
        compare(f"{label}: branch A vs mlx-lm RotatingKVCache", a, greedy(model, lm, a_first, W + 4), tally)

        for c, s in zip(caches, snaps):
            c.restore(s)
        b = greedy(model, caches, b_turn, 2 * W)
        fresh = build_caches(model, "fp16", 4, True)
        greedy(model, fresh, prompt, 3 * W)
        compare(f"{label}: branch B after restore vs fresh", b, greedy(model, fresh, b_turn, 2 * W), tally)
        check_unchanged(f"{label}, after branch B", before, views(snaps))
    tally.note("steady-state snapshot unchanged; restored B = fresh B; = mlx-lm RotatingKVCache")
    return tally, None


TrimFn = Callable[[list[Any], int], int]


def scenario_mixed_rollback(size: Size, factories: Factories = None,
                            trim: TrimFn = trim_prompt_cache) -> tuple[Tally, float | None]:
    """llama with a sliding-window layer (window W) and a dense layer. Before
    the ring wraps a rollback of 2 tokens trims every layer exactly (then
    decoding equals a run that never had them). After the wrap the same
    rollback is refused for all layers together: ``trim`` returns 0 and no
    layer changes, and the refusal is loud (one RollbackWarning, the ring's:
    ``can_trim_prompt_cache``'s False answer is its first refused rollback);
    decoding goes on equal to a run that never asked."""
    tally = Tally()
    W = size.window
    for seed in size.seeds:
        model = tiny_llama(seed, layer_types=["sliding_attention", "full_attention"], sliding_window=W)
        prompt, x, turn = token_ids(seed, 3), token_ids(seed + 1, 1), token_ids(seed + 2, 3)
        label = f"seed {seed}, W={W}"
        caches = build_caches(model, "fp16", 4, True, factories)
        require(len(caches) == 2 and len(_rotating(caches)) == 1,
                f"{label}: expected a rotating and a dense layer, got {caches}")

        greedy(model, caches, prompt, 2)
        require(can_trim_prompt_cache(caches), f"{label}: unwrapped caches must be trimmable")
        got = trim(caches, 2)
        offsets = [c.offset for c in caches]
        require(got == 2 and offsets == [3, 3], f"{label}: rollback before the wrap: trimmed {got}, offsets {offsets}")
        g1 = greedy(model, caches, x, W + 3)
        require(all(r.wrapped for r in _rotating(caches)), f"{label}: the ring did not wrap")
        before = layer_states(caches)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RollbackWarning)
            require(not can_trim_prompt_cache(caches), f"{label}: a wrapped ring must make the list untrimmable")
            got = trim(caches, 2)
        after = layer_states(caches)
        require(got == 0 and after == before,
                f"{label}: rollback after the wrap must be refused for all layers together: returned {got}, "
                f"offsets {[o for o, _ in before]} -> {[o for o, _ in after]}, "
                f"layers changed: {[i for i, (p, q) in enumerate(zip(before, after)) if p != q]}")
        loud = [w for w in caught if issubclass(w.category, RollbackWarning)]
        require(len(loud) == 1, f"{label}: the refused rollback gave {len(loud)} RollbackWarnings "
                                "(want one: the ring's, once per cache)")
        g2 = greedy(model, caches, turn, size.tokens)

        never = build_caches(model, "fp16", 4, True)
        greedy(model, never, prompt, 0)
        compare(f"{label}: after exact rollback vs never decoded", g1, greedy(model, never, x, W + 3), tally)
        compare(f"{label}: after refused rollback vs never asked", g2, greedy(model, never, turn, size.tokens), tally)
    tally.note("rollback exact before the wrap; refused atomically after it (0 trimmed, no layer changed), "
               "with one RollbackWarning")
    return tally, None
