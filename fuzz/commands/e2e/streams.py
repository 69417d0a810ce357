"""Decoding through mlx-lm's own loops: greedy, interleaved conversations, speculative, teacher-forced."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.fuzz.commands.e2e.checks import Stream, logprob_bytes, require
from kvspec.fuzz.commands.e2e.models import NUM_DRAFT


def greedy(model: Any, caches: list[Any], prompt: mx.array, n: int) -> Stream:
    """mlx-lm's ``generate_step`` (greedy) for ``n`` tokens. Afterwards the
    caches hold the prompt and every yielded token."""
    from mlx_lm.generate import generate_step

    out = Stream()
    for tok, logprobs in generate_step(prompt, model, max_tokens=n, prompt_cache=caches):
        out.tokens.append(int(tok))
        out.logprobs.append(logprob_bytes(logprobs))
        out.inplace_writes += sum(bool(getattr(c, "last_write_inplace", False)) for c in caches)
    return out


def interleaved(model: Any, runs: dict[str, tuple[list[Any], mx.array]], n: int) -> dict[str, Stream]:
    """Greedy decoding of several conversations ``name -> (caches, prompt)``
    that take turns, one token each (two requests served together)."""
    from mlx_lm.generate import generate_step

    gens = {name: generate_step(prompt, model, max_tokens=n, prompt_cache=caches)
            for name, (caches, prompt) in runs.items()}
    out = {name: Stream() for name in runs}
    for steps in zip(*gens.values()):
        for name, (tok, logprobs) in zip(gens, steps):
            out[name].tokens.append(int(tok))
            out[name].logprobs.append(logprob_bytes(logprobs))
            out[name].inplace_writes += sum(bool(getattr(c, "last_write_inplace", False)) for c in runs[name][0])
    return out


class _Logged:
    """A model that logs its calls (speculative acceptance accounting)."""

    def __init__(self, model: Any, name: str, log: list[str]):
        self.model, self.name, self.log = model, name, log

    @property
    def layers(self) -> Any:
        return self.model.layers

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        self.log.append(self.name)
        return self.model(inputs, cache=cache)


@dataclass
class Speculation:
    stream: Stream
    drafted: int
    accepted: int

    @property
    def rejected(self) -> int:
        return self.drafted - self.accepted


def speculative(model: Any, draft: Any, caches: list[Any], prompt: mx.array, n: int) -> Speculation:
    """mlx-lm's ``speculative_generate_step`` for ``n`` tokens, ``NUM_DRAFT``
    draft tokens a round; ``caches`` holds the model's layers then the
    draft's. Every rejected draft token is a ``trim`` of both caches.
    ``prompt`` needs 2 tokens or more (the accounting starts after both
    models' prefill)."""
    from mlx_lm.generate import speculative_generate_step

    require(prompt.size > 1, f"speculative: the prompt needs >= 2 tokens, got {prompt.size}")

    log: list[str] = []
    logged_model: Any = _Logged(model, "main", log)
    logged_draft: Any = _Logged(draft, "draft", log)
    out, accepted = Stream(), 0
    for tok, logprobs, from_draft in speculative_generate_step(
        prompt, logged_model, logged_draft,
        num_draft_tokens=NUM_DRAFT, max_tokens=n, prompt_cache=caches,
    ):
        out.tokens.append(int(tok))
        out.logprobs.append(logprob_bytes(logprobs))
        accepted += bool(from_draft)
    # mlx-lm prefills the draft, then the main model; after that every
    # draft call drafts one token.
    drafted = log[log.index("main"):].count("draft")
    return Speculation(out, drafted, accepted)


def teacher_forced(model: Any, caches: list[Any], prompt: mx.array, tokens: list[int]) -> list[np.ndarray]:
    """Log-probabilities (float32) of each next token along a fixed stream:
    after the prompt, then after each of ``tokens[:-1]`` fed one by one."""
    out = []
    x = prompt
    for t in [None, *tokens[:-1]]:
        if t is not None:
            x = mx.array([t], dtype=mx.uint32)
        logits = model(x[None], cache=caches)[0, -1].astype(mx.float32)
        out.append(np.array(logits - mx.logsumexp(logits)))
    return out
