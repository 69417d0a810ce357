"""Scenario 13: batched generation (mlx-lm's ``batch_generate`` and
``BatchGenerator``) with our caches, against mlx-lm's own caches."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from kvspec.fuzz.commands.e2e.checks import Size, Stream, Tally, compare, require
from kvspec.fuzz.commands.e2e.models import (
    Factories,
    build_caches,
    mlx_lm_caches,
    prefill,
    tiny_gemma3,
    tiny_llama,
    token_ids,
)
from kvspec.fuzz.commands.e2e.streams import greedy
from kvspec.impl.batch import BatchKVCache, batch_rotating_class
from kvspec.impl.dense import KVCache
from kvspec.impl.rotating import RotatingKVCache

#: the rows each sequence's caches hold before batch_generate (gemma3: only sequence 1 then wraps)
HISTORY = {"llama": (4, 0, 7), "gemma3": (0, 2, 1)}

#: a tokenizer for batch_generate: no end-of-sequence token (streams end by max_tokens), ids as text
TOKENIZER = SimpleNamespace(eos_token_ids=[], decode=lambda ids: " ".join(map(str, ids)))


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    return [[int(t) for t in np.array(token_ids(seed + 50 + i, n))] for i, n in enumerate(lengths)]


def _ours(model: Any, factories: Factories) -> list[Any]:
    return build_caches(model, "fp16", 256, True, factories)


def _generator(model: Any, prompts: list[list[int]], max_tokens: list[int], caches: list[list[Any]],
               late: tuple[int, list[int], int, list[Any]] | None = None) -> tuple[dict[int, Stream], list[str]]:
    """BatchGenerator over ``prompts``; ``late = (step, prompt, max_tokens,
    caches)`` inserts one more sequence after ``step`` steps. Returns each
    sequence's stream (tokens and log-probability bytes) by insertion order,
    and the batch caches' class names seen while decoding."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max(max_tokens), completion_batch_size=4, prefill_batch_size=4)
    uids = gen.insert(prompts, max_tokens=max_tokens, caches=caches)
    out: dict[int, Stream] = {}
    kinds: set[str] = set()
    step = 0
    while True:
        if late is not None and step == late[0]:
            uids += gen.insert([late[1]], max_tokens=[late[2]], caches=[late[3]])
        responses = gen.next_generated()
        kinds |= {"ours" if isinstance(c, (BatchKVCache, batch_rotating_class())) else f"{type(c).__module__}."
                  f"{type(c).__name__}" for c in gen._generation_batch.prompt_cache}
        if not responses:
            if late is not None and step < late[0]:
                step += 1
                continue
            break
        for r in responses:
            s = out.setdefault(r.uid, Stream())
            s.tokens.append(int(r.token))
            s.logprobs.append(np.array(r.logprobs).tobytes())
        step += 1
    gen.close()
    return {i: out[u] for i, u in enumerate(uids)}, sorted(kinds)


def scenario_batch(size: Size, factories: Factories = None) -> tuple[Tally, float | None]:
    """Batched generation with our caches equals it with mlx-lm's caches, byte
    for byte, on a llama (dense layers: our BatchKVCache) and a gemma3 (two
    sliding-window layers: the batch ring, one global):

    * ``batch_generate``, batch 3, ragged prompts, ``max_tokens`` differing
      so that sequences finish at different steps and are filtered out of
      the batch mid-stream, each sequence's caches already holding a ragged
      history (merge of filled caches): the same token ids and sampled log-probabilities;
      the returned prompt caches are ours (KVCache / RotatingKVCache), hold
      exactly the rows of mlx-lm's, and greedy decoding on from them equals
      decoding on from mlx-lm's. On gemma3 the ring wraps in one sequence
      only (the longest prompt decodes past the window; the others stay
      inside it).
    * ``BatchGenerator``: two sequences decode, a third is added mid-stream
      (the batch is extended), one finishes early (filtered): every step's
      token and whole log-probability vector equal mlx-lm's caches'; the
      batch caches in use are ours."""
    from mlx_lm.generate import batch_generate

    tally = Tally()
    W = size.window
    T = size.tokens
    for seed in size.seeds:
        models = (("llama", tiny_llama(seed), (5, 12, 2)), ("gemma3", tiny_gemma3(seed, W), (3, W - 2, 2)))
        for label_model, model, lengths in models:
            label = f"seed {seed}, {label_model}"
            prompts = _prompts(seed, lengths)
            max_tokens = [W // 2, W, W // 4] if label_model == "gemma3" else [T, T // 3, 2 * T // 3]
            runs = []
            for caches in ([_ours(model, factories) for _ in prompts], [mlx_lm_caches(model) for _ in prompts]):
                # batching with history: each sequence's caches already hold a ragged prefix
                for i, (c, n) in enumerate(zip(caches, HISTORY[label_model])):
                    if n:
                        prefill(model, c, token_ids(seed + 60 + i, n))
                runs.append(batch_generate(model, TOKENIZER, prompts, prompt_caches=caches, max_tokens=max_tokens,
                                           return_token_ids=True, return_logprobs=True, return_prompt_caches=True))
            ours, theirs = runs
            for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)):
                require(a == b, f"{label}: batch_generate sequence {i}: tokens {a[:8]}..., mlx-lm's caches {b[:8]}...")
                require(len(a) == max_tokens[i], f"{label}: sequence {i} gave {len(a)} tokens, max_tokens {max_tokens[i]}")
                tally.tokens.extend(a)
            require(ours.logprobs == theirs.logprobs, f"{label}: batch_generate's sampled log-probabilities differ")
            if label_model == "gemma3":
                wrapped = [c[0].offset > W for c in ours.caches]
                require(wrapped == [False, True, False], f"{label}: the ring must wrap in sequence 1 only, got {wrapped} "
                                                         f"(offsets {[c[0].offset for c in ours.caches]}, window {W})")
            for i, (mine, lm) in enumerate(zip(ours.caches, theirs.caches)):
                want = RotatingKVCache if label_model == "gemma3" else KVCache
                require(type(mine[0]) is want, f"{label}: sequence {i}'s returned cache is a {type(mine[0]).__name__}")
                for layer, (c, d) in enumerate(zip(mine, lm)):
                    got = [np.array(a).tobytes() for a in (c.fetch() or ())]
                    ref = [np.array(a[..., : min(a.shape[2], d.offset), :]).tobytes()
                           for a in d.keys_and_values()] if type(d).__name__ == "KVCache" else None
                    require(c.offset == d.offset, f"{label}: sequence {i} layer {layer}: offset {c.offset}, "
                                                  f"mlx-lm's {d.offset}")
                    if ref is not None:
                        require(got == ref, f"{label}: sequence {i} layer {layer}: extracted rows differ from mlx-lm's")
                turn = token_ids(seed + 70 + i, 2)
                compare(f"{label}: sequence {i} decoding on from its extracted cache", greedy(model, mine, turn, 8),
                        greedy(model, lm, turn, 8), tally)
            # BatchGenerator: a sequence added mid-stream, one filtered out early
            late_prompt = _prompts(seed + 5, (4,))[0]
            streams = []
            for make in (lambda m=model: _ours(m, factories), lambda m=model: mlx_lm_caches(m)):
                streams.append(_generator(model, prompts[:2], [T // 2, T // 4], [make(), make()],
                                          late=(3, late_prompt, T // 3, make())))
            (mine, kinds), (lm, _) = streams
            require(kinds == ["ours"], f"{label}: the generation batch used {kinds}, not our batch caches")
            for i in lm:
                compare(f"{label}: BatchGenerator sequence {i}{' (added mid-stream)' if i == 2 else ''}",
                        mine[i], lm[i], tally)
    tally.note(f"batch_generate and BatchGenerator (batch 3, ragged, filtered and added mid-stream; gemma3 ring "
               f"wrapping in one sequence) = mlx-lm's caches, bytes; extracted caches ours, = mlx-lm's rows; seeds "
               f"{list(size.seeds)}")
    return tally, None
