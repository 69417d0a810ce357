"""Scenarios 3, 6 and 7: prompt reuse through snapshots, mlx-lm's LRUPromptCache, prefix sharing on a pool."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvspec.fuzz.commands.e2e.checks import Size, Tally, check_unchanged, compare, require, views
from kvspec.fuzz.commands.e2e.models import (
    MODEL_KEY,
    Factories,
    build_caches,
    paged_caches,
    prefill,
    tiny_llama,
    token_ids,
)
from kvspec.fuzz.commands.e2e.streams import greedy, interleaved
from kvspec.impl.models import trim_prompt_cache
from kvspec.impl.paged import fork_prompt_cache


def scenario_prompt_reuse(size: Size, factories: Factories = None) -> tuple[Tally, float | None]:
    """Snapshot after a shared system prompt. Conversation A rewinds the
    prompt's last 2 tokens (its template differs there, as when mlx-lm's
    server trims a reused prompt cache to the common prefix) and decodes
    with in-place writes on. Restore the snapshot into the live cache
    (conversation B) and into a second cache (conversation C), decode both
    together. B and C equal fresh runs; A equals a run that never had the 2
    tokens; the snapshot never changed."""
    tally = Tally()
    for seed in size.seeds:
        model = tiny_llama(seed)
        system = token_ids(seed + 10, 13)  # capacity 16 at step 8: decode steps fit
        a_first, a_turn = token_ids(seed + 11, 1), token_ids(seed + 12, 6)
        b_first, b_turn = token_ids(seed + 13, 1), token_ids(seed + 14, 6)
        c_first, c_turn = token_ids(seed + 15, 1), token_ids(seed + 16, 4)
        for mode in ("fp16", "int8"):
            label = f"seed {seed}, {mode}"
            caches = build_caches(model, mode, 8, True, factories)
            prefill(model, caches, system)
            snaps = [c.snapshot() for c in caches]
            before = views(snaps)

            require(trim_prompt_cache(caches, 2) == 2, f"{label}: rewinding 2 prompt tokens did not trim 2")
            a = greedy(model, caches, a_first, size.tokens) + greedy(model, caches, a_turn, size.tokens)
            require(mode != "fp16" or a.inplace_writes > 0, f"{label}: conversation A made no in-place write")
            check_unchanged(f"{label}, after conversation A", before, views(snaps))

            never = build_caches(model, mode, 8, True)
            prefill(model, never, system[:-2])
            compare(f"{label}: A after a rewind vs A that never had the tokens", a,
                    greedy(model, never, a_first, size.tokens) + greedy(model, never, a_turn, size.tokens), tally)

            # B in the restored cache and C in a second cache restored from the
            # same snapshot, served together: each starts with a single-token
            # step, so a restored cache that wrongly took the shared buffers for
            # its own would write into the other's rows.
            other = build_caches(model, mode, 8, True, factories)
            for live, second, s in zip(caches, other, snaps):
                live.restore(s)
                second.restore(s)
            got = interleaved(model, {"B": (caches, b_first), "C": (other, c_first)}, size.tokens)
            got["B"] += greedy(model, caches, b_turn, size.tokens)
            got["C"] += greedy(model, other, c_turn, size.tokens)
            for name, first, turn in (("B", b_first, b_turn), ("C", c_first, c_turn)):
                fresh = build_caches(model, mode, 8, True)
                prefill(model, fresh, system)
                compare(f"{label}: {name} after restore vs fresh {name}", got[name],
                        greedy(model, fresh, first, size.tokens) + greedy(model, fresh, turn, size.tokens), tally)
            check_unchanged(f"{label}, after conversations B and C", before, views(snaps))
    tally.note("B, C after restore = fresh runs; A after rewind = A without the tokens; snapshot unchanged")
    return tally, None


def scenario_lru_prompt_cache(size: Size, factories: Factories = None) -> tuple[Tally, float | None]:
    """mlx-lm's ``LRUPromptCache`` holds the caches of a system prompt; two
    conversations fetch it (``copy.deepcopy`` each, which aliases the
    buffers), add one token each and decode interleaved, step by step. Each
    equals a fresh run; the cached entry never changed."""
    from mlx_lm.models.cache import LRUPromptCache

    tally = Tally()
    for seed in size.seeds:
        model = tiny_llama(seed)
        system = [int(t) for t in np.array(token_ids(seed + 20, 16))]
        label = f"seed {seed}"
        entry = build_caches(model, "fp16", 256, True, factories)
        prefill(model, entry, mx.array(system, dtype=mx.uint32))
        lru = LRUPromptCache(max_size=4)
        lru.insert_cache(MODEL_KEY, system, entry)
        before = views(entry)

        convs = {name: [*system, int(np.array(token_ids(seed + 21 + i, 1))[0])] for i, name in enumerate(("A", "B"))}
        fetched = {name: lru.fetch_nearest_cache(MODEL_KEY, toks) for name, toks in convs.items()}
        for name, (caches, rest) in fetched.items():
            require(caches is not None and len(rest) == 1, f"{label}: {name}: LRU fetch missed ({rest})")
        got = interleaved(model, {name: (caches, mx.array(rest, dtype=mx.uint32))
                                  for name, (caches, rest) in fetched.items()}, size.tokens)
        require(sum(s.inplace_writes for s in got.values()) > 0, f"{label}: no in-place write happened")
        for name, (_, rest) in fetched.items():
            fresh = build_caches(model, "fp16", 256, True)
            prefill(model, fresh, mx.array(system, dtype=mx.uint32))
            compare(f"{label}: conversation {name} from the LRU cache vs fresh", got[name],
                    greedy(model, fresh, mx.array(rest, dtype=mx.uint32), size.tokens), tally)
        check_unchanged(f"{label}, the LRU entry", before, views(entry))
    tally.note("two deep copies decoding interleaved = fresh runs; LRU entry unchanged")
    return tally, None


def scenario_prefix_sharing(size: Size, factories: Factories = None) -> tuple[Tally, float | None]:
    """Prefix sharing on a pool: a 13-token prompt is prefilled once into
    ``main`` (block size 4: its last block is a shared, partly filled tail).
    Three requests fork ``main`` and decode different continuations,
    interleaved one token each, so every first write lands in the shared
    tail block (copy on write) and later ones go in place. Every stream's
    tokens and log-probability bytes equal the same request run alone on a
    dense cache; the prompt's own sequence never changes; the pool holds
    fewer blocks than the dense caches hold rows."""
    tally = Tally()
    blocks_used = dense_rows = 0
    for seed in size.seeds:
        model = tiny_llama(seed)
        system = token_ids(seed + 20, 13)
        firsts = {f"r{i}": token_ids(seed + 21 + i, 2) for i in range(3)}
        caches = paged_caches(model, 4, factories)
        prefill(model, caches, system)
        before = views(caches)
        forks = {name: fork_prompt_cache(caches, name) for name in firsts}
        got = interleaved(model, {name: (forks[name], first) for name, first in firsts.items()}, size.tokens)
        tail = 13 // 4  # the prompt's partly filled last block: each request's first write copied it
        for c, layer in zip(caches, zip(*forks.values())):
            shared = c.pool.seqs["main"].table[tail]
            require(all(f.pool.seqs[f.seq].table[tail] != shared for f in layer),
                    f"seed {seed}: a request still writes into the prompt's shared tail block")
        for name, first in firsts.items():
            dense = build_caches(model, "fp16", 256, True)
            prefill(model, dense, system)
            compare(f"seed {seed}, request {name} on forked pool sequences vs alone on a dense cache",
                    got[name], greedy(model, dense, first, size.tokens), tally)
            dense_rows += sum(c.offset for c in dense)
        blocks_used += sum(c.pool.in_use() for c in caches)
        for f in forks["r0"]:  # one request ends: only its own blocks go back to the pool
            f.release()
        check_unchanged(f"seed {seed}, the prompt's sequence", before, views(caches))
        for c in caches:
            bad = c.pool.broken_invariants()
            require(not bad, f"seed {seed}: pool invariants broken: {', '.join(bad)}")
    rows = blocks_used * 4
    require(rows < dense_rows, f"the pool holds {rows} rows in {blocks_used} blocks, dense caches {dense_rows}")
    tally.note(f"3 forks of one prompt = each request alone on a dense cache (tokens, log-prob bytes); prompt unchanged "
               f"after a release; pool {blocks_used} blocks in use ({rows} rows) vs {dense_rows} rows on dense caches")
    return tally, None
