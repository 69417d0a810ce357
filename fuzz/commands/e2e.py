"""End-to-end scenarios: kvspec caches inside real mlx-lm models (issue 7).

Each scenario builds small mlx-lm models with random weights (fixed seeds, no
download), decodes through mlx-lm's own code (``generate_step``,
``speculative_generate_step``, ``LRUPromptCache``) with kvspec caches, and
compares every step *byte for byte*, the token and the whole float16
log-probability vector, with a reference run: mlx-lm's own caches, plain
greedy decoding, or a fresh run that never shared, rolled back or restored
anything.

1. ``greedy``: our Fp16 caches vs mlx-lm's ``KVCache`` (in-place on/off,
   small and production step), two chat turns.
2. ``speculative``: mlx-lm's speculative decoding (a one-layer early-exit
   draft; accept/reject drives ``trim``) vs plain greedy, fp16 and int8,
   in-place on and off.
3. ``prompt_reuse``: snapshot after a system prompt; conversation A rewinds
   the prompt's tail and decodes with in-place writes; restore into the live
   cache (B) and a second cache (C), decode both together; each equals a
   fresh run and the snapshot never changed.
4. ``sliding_window``: gemma3 with sliding-window layers decoding well past
   the window, snapshot in the steady state, restore later; equals fresh runs
   and mlx-lm's ``RotatingKVCache``.
5. ``mixed_rollback``: a model with rotating and dense layers; exact rollback
   before the wrap, an atomic refusal (nothing trimmed anywhere) after it.
6. ``lru_prompt_cache``: two conversations fetched from mlx-lm's
   ``LRUPromptCache`` (a deep copy each) decode interleaved; each equals a
   fresh run.
7. ``prefix_sharing``: three requests fork one prompt's pool sequence
   (paged cache, block size 4) and decode different continuations
   interleaved; each equals the request alone on a dense cache, the prompt's
   sequence never changes, and the pool holds fewer rows than dense caches.
8. ``speculative_window``: speculative decoding on gemma3 sliding-window
   layers whose rings wrap every few tokens, with an undo log: every
   rejected draft rolled back exactly after the wrap (tokens = greedy; each
   main-model call = a run that never had the rolled-back rows, logit
   bytes); mlx-lm's own caches drift there.
9. ``bf16_models``: bfloat16 llama and gemma3 (random weights): tokens and
   bfloat16 log-probability bytes equal those with mlx-lm's own caches.
10. ``turbo``: each Turbo mode (``impl.turbo``): speculative decoding equals
    greedy decoding under the same Turbo cache, byte for byte; the
    log-probabilities' deviation from the fp16 cache is reported per mode.

Random-weight models collapse under greedy decoding (a default-initialised
2-layer llama repeats one token), so every weight is scaled by
``WEIGHT_SCALE`` (the streams become chaotic: 45 to 55 distinct tokens in 60)
and every compared stream must reach ``len // 3`` distinct tokens.

The injected bugs of ``fuzz.bugs`` plug in through ``factories`` (cache kind
-> class), as in the rest of ``fuzz``: ``steady_state_inplace`` fails
scenario 4, ``inplace_after_trim`` and ``inplace_after_restore`` fail
scenario 3 (``kvspec e2e --bug NAME``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from impl.models import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from impl.paged import BlockPool, PagedKVCache, fork_prompt_cache
from impl.rotating import RotatingKVCache
from impl.turbo import DelegatedKVCache, TurboKVCache

VOCAB = 256
HIDDEN = 64
WEIGHT_SCALE = 2.0
# Scale of the main model's later layers' residual writes in the speculative
# scenario: the one-layer early-exit draft then has about 40% of its tokens
# accepted, so rounds end in every way (0 to NUM_DRAFT accepted).
LATE_LAYER_SCALE = 0.3
NUM_DRAFT = 3
MODEL_KEY = "kvspec-tiny"


class Divergence(AssertionError):
    """A scenario's check failed: streams differ, a holder's view changed,
    layers disagree, or the scenario did not reach what it must exercise."""


# -- sizes ---------------------------------------------------------------------
@dataclass(frozen=True)
class Size:
    """``tokens``: tokens per greedy stretch; ``window``: the sliding window;
    ``seeds``: one model per seed."""

    tokens: int
    window: int
    seeds: tuple[int, ...]


SHORT = Size(tokens=32, window=8, seeds=(0, 1))  # tests/test_e2e.py (make test)
DEFAULT = Size(tokens=64, window=16, seeds=(0, 1, 2))  # kvspec e2e
LONG = Size(tokens=160, window=48, seeds=(0, 1, 2, 3))  # kvspec e2e --long


# -- models ----------------------------------------------------------------------
def _finish(model: Any, dtype: mx.Dtype = mx.float16) -> Any:
    model.update(tree_map(lambda p: p * WEIGHT_SCALE, model.parameters()))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def tiny_llama(seed: int, *, layers: int = 2, layer_types: list[str] | None = None,
               sliding_window: int | None = None, late_scale: float = 1.0, dtype: mx.Dtype = mx.float16) -> Any:
    """A llama (float16 unless ``dtype``) (hidden 64, 4 query / 2 kv heads, vocab 256) with
    random weights from ``mx.random.seed(seed)``. ``layer_types`` /
    ``sliding_window`` make sliding-window layers; ``late_scale`` scales the
    residual writes of layers 1.. (so an early-exit draft can agree)."""
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=HIDDEN, num_hidden_layers=layers, intermediate_size=2 * HIDDEN,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
        tie_word_embeddings=False, layer_types=layer_types, sliding_window=sliding_window,
    )
    model = llama.Model(args)
    for layer in model.model.layers[1:]:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * late_scale
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * late_scale
    return _finish(model, dtype)


def early_exit_draft(model: Any) -> Any:
    """A one-layer draft sharing the llama ``model``'s embedding, first layer,
    final norm and head (self-speculative decoding by early exit)."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(**{**model.args.__dict__, "num_hidden_layers": 1, "layer_types": None})
    draft = llama.Model(args)
    draft.model.embed_tokens = model.model.embed_tokens
    draft.model.layers = model.model.layers[:1]
    draft.model.norm = model.model.norm
    draft.lm_head = model.lm_head
    return draft


def tiny_gemma3(seed: int, window: int, *, layers: int = 3, pattern: int = 3, dtype: mx.Dtype = mx.float16) -> Any:
    """A gemma3 (float16 unless ``dtype``) whose layers ``i % pattern != pattern - 1`` use a
    sliding window of ``window`` tokens (mlx-lm gives them a RotatingKVCache)."""
    from mlx_lm.models import gemma3_text

    mx.random.seed(seed)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=HIDDEN, num_hidden_layers=layers, intermediate_size=2 * HIDDEN,
        num_attention_heads=4, head_dim=16, num_key_value_heads=2, vocab_size=VOCAB, query_pre_attn_scalar=16,
        sliding_window=window, sliding_window_pattern=pattern, max_position_embeddings=4096,
    )
    return _finish(gemma3_text.Model(args), dtype)


def _scale_post_norms(layer: Any, scale: float) -> None:
    """Scale a gemma3 block's residual writes by ``scale``: its post-norms
    multiply by ``1 + weight``, so ``weight -> scale * (1 + weight) - 1``
    (0 makes the block the identity)."""
    for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
        norm.weight = (scale * (1.0 + norm.weight.astype(mx.float32)) - 1.0).astype(norm.weight.dtype)


def speculative_gemma3(seed: int, window: int, late_scale: float = LATE_LAYER_SCALE) -> tuple[Any, Any]:
    """A gemma3 main model (two sliding-window layers of ``window`` tokens,
    one global) whose later blocks write ``late_scale`` of their residual,
    and its early-exit draft: the same embedding, first block, norm and
    head, with blocks 1 and 2 made the identity (so the draft has the same
    layer kinds, hence rings of its own)."""
    from mlx_lm.models import gemma3_text

    model = tiny_gemma3(seed, window)
    for layer in model.layers[1:]:
        _scale_post_norms(layer, late_scale)
    draft = gemma3_text.Model(model.args)
    draft.set_dtype(mx.float16)
    for layer in draft.layers[1:]:
        _scale_post_norms(layer, 0.0)
    draft.model.embed_tokens = model.model.embed_tokens
    draft.model.layers = [model.layers[0], *draft.model.layers[1:]]
    draft.model.norm = model.model.norm
    draft.lm_head = model.lm_head
    mx.eval(model.parameters(), draft.parameters())
    return model, draft


def token_ids(seed: int, n: int) -> mx.array:
    """``n`` token ids drawn from a seeded NumPy generator, as uint32."""
    return mx.array(np.random.default_rng(seed).integers(0, VOCAB, n), dtype=mx.uint32)


# -- caches ----------------------------------------------------------------------
def build_caches(model: Any, mode: str = "fp16", step: int = 256, inplace: bool | None = True,
                 factories: dict[str, Callable[..., Any]] | None = None, undo: int = 0) -> list[Any]:
    """``impl.models.make_prompt_cache``, building each kind's layers from
    ``factories[kind]`` (an injected bug's classes) when given; ``undo`` is
    every ring's undo depth."""
    return make_prompt_cache(model, mode=mode, step=step, inplace=inplace, classes=factories, undo=undo)


def mlx_lm_caches(model: Any) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache as lm_make_prompt_cache

    return lm_make_prompt_cache(model)


def prefill(model: Any, caches: list[Any], tokens: mx.array) -> None:
    """Run ``tokens`` through the model in one chunk (a system prompt)."""
    model(tokens[None], cache=caches)
    mx.eval([c.state for c in caches])


def views(holders: Iterable[Any]) -> list[bytes]:
    """The bytes of every holder's window (snapshots or caches)."""
    out = []
    for h in holders:
        got = h.fetch()
        out.append(b"" if got is None else b"".join(np.array(a).tobytes() for a in got))
    return out


def layer_states(caches: list[Any]) -> list[tuple[int, bytes]]:
    return [(c.offset, v) for c, v in zip(caches, views(caches))]


# -- decoding ----------------------------------------------------------------------
@dataclass
class Stream:
    """Generated tokens and each step's float16 log-probabilities (raw
    bytes); ``inplace_writes`` counts decode steps whose last write went in
    place (summed over layers)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[bytes] = field(default_factory=list)
    inplace_writes: int = 0

    def __add__(self, other: Stream) -> Stream:
        return Stream(self.tokens + other.tokens, self.logprobs + other.logprobs,
                      self.inplace_writes + other.inplace_writes)


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


# -- checks ------------------------------------------------------------------------
@dataclass
class Tally:
    """What a scenario compared: the generated tokens checked against a
    reference (each with its log-probability vector)."""

    tokens: list[int] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        self.checks.append(text)


def logprob_bytes(logprobs: mx.array) -> bytes:
    """A step's log-probabilities as bytes: float16 as they are; bfloat16
    (NumPy has none) as the float32 of each value, exact and one-to-one."""
    if logprobs.dtype == mx.bfloat16:
        logprobs = logprobs.astype(mx.float32)
    return np.array(logprobs).tobytes()


def _first_diff(a: bytes, b: bytes) -> str:
    dtype = np.float16 if len(a) == 2 * VOCAB else np.float32
    x, y = np.frombuffer(a, dtype=dtype), np.frombuffer(b, dtype=dtype)
    if x.shape != y.shape:
        return f"shapes {x.shape} vs {y.shape}"
    d = np.abs(x.astype(np.float32) - y.astype(np.float32))
    bits = np.uint16 if dtype == np.float16 else np.uint32
    return f"{int((x.view(bits) != y.view(bits)).sum())} of {x.size} entries differ, max |diff| {np.nanmax(d):.3g}"


def min_distinct(n: int) -> int:
    """The fewest distinct tokens a stream of ``n`` tokens must show."""
    return n // 3


def compare(label: str, got: Stream, want: Stream, tally: Tally) -> None:
    """Tokens and log-probability bytes equal at every step; the stream did
    not collapse. Raises Divergence naming the first differing step."""
    for i, (a, b) in enumerate(zip(got.tokens, want.tokens)):
        if a != b:
            raise Divergence(f"{label}: step {i}: token {a}, reference {b}")
        if got.logprobs[i] != want.logprobs[i]:
            raise Divergence(f"{label}: step {i} (token {a}): log-probabilities differ: "
                             f"{_first_diff(got.logprobs[i], want.logprobs[i])}")
    if len(got.tokens) != len(want.tokens):
        raise Divergence(f"{label}: {len(got.tokens)} tokens, reference {len(want.tokens)}")
    distinct = len(set(got.tokens))
    if distinct < min_distinct(len(got.tokens)):
        raise Divergence(f"{label}: stream collapsed: {distinct} distinct tokens in {len(got.tokens)} "
                         f"(need {min_distinct(len(got.tokens))}); the scenario would not be sensitive")
    tally.tokens.extend(got.tokens)


def require(cond: bool, message: str) -> None:
    if not cond:
        raise Divergence(message)


def check_unchanged(label: str, before: list[bytes], after: list[bytes]) -> None:
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    require(not changed, f"{label}: snapshot of layer(s) {changed} changed (isolation)")


# -- scenarios ---------------------------------------------------------------------
Factories = dict[str, Callable[..., Any]] | None


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


def scenario_speculative(size: Size, factories: Factories = None) -> tuple[Tally, float | None]:
    """mlx-lm's speculative decoding with a one-layer early-exit draft gives
    exactly plain greedy decoding's tokens and log-probability bytes with the
    same cache mode (fp16, int8) and in-place setting; in-place on and off
    agree. Both accepts and rejects (trims) must happen."""
    tally = Tally()
    drafted = accepted = 0
    n = 2 * size.tokens
    gpu = on_gpu()
    for seed in size.seeds:
        model = tiny_llama(seed, late_scale=LATE_LAYER_SCALE)
        draft = early_exit_draft(model)
        prompt = token_ids(seed, 12)
        if gpu:
            # A GPU rounds a k-row verify differently from one-row steps, so
            # the reference is the same speculative decoding with mlx-lm's
            # caches: the same shapes, only the cache differs (fp16).
            ref = speculative(model, draft, mlx_lm_caches(model) + mlx_lm_caches(draft), prompt, n)
            for inplace in (True, False):
                caches = build_caches(model, "fp16", 4, inplace, factories) + build_caches(draft, "fp16", 4, inplace,
                                                                                           factories)
                spec = speculative(model, draft, caches, prompt, n)
                compare(f"seed {seed}, fp16, in-place {'on' if inplace else 'off'}: speculative vs mlx-lm's caches",
                        spec.stream, ref.stream, tally)
                drafted, accepted = drafted + spec.drafted, accepted + spec.accepted
            continue
        for mode in ("fp16", "int8"):
            plain = {ip: greedy(model, build_caches(model, mode, 4, ip, factories), prompt, n) for ip in (True, False)}
            compare(f"seed {seed}, {mode}: greedy in-place on vs off", plain[True], plain[False], tally)
            for inplace in (True, False):
                caches = build_caches(model, mode, 4, inplace, factories) + build_caches(draft, mode, 4, inplace, factories)
                spec = speculative(model, draft, caches, prompt, n)
                compare(f"seed {seed}, {mode}, in-place {'on' if inplace else 'off'}: speculative vs greedy",
                        spec.stream, plain[inplace], tally)
                drafted, accepted = drafted + spec.drafted, accepted + spec.accepted
    require(accepted > 0 and accepted < drafted,
            f"speculation must both accept and reject drafts, got {accepted} accepted of {drafted}")
    tally.note(f"{accepted}/{drafted} drafts accepted; " + (
        "speculative = speculative with mlx-lm's caches, bytes (GPU; fp16 x in-place on/off)" if gpu else
        "speculative = greedy bytes (fp16/int8 x in-place on/off)"))
    return tally, accepted / max(drafted, 1)


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


def _rotating(caches: list[Any]) -> list[RotatingKVCache]:
    return [c for c in caches if isinstance(c, RotatingKVCache)]


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
    layer changes; decoding goes on equal to a run that never asked."""
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
        require(not can_trim_prompt_cache(caches), f"{label}: a wrapped ring must make the list untrimmable")

        before = layer_states(caches)
        got = trim(caches, 2)
        after = layer_states(caches)
        require(got == 0 and after == before,
                f"{label}: rollback after the wrap must be refused for all layers together: returned {got}, "
                f"offsets {[o for o, _ in before]} -> {[o for o, _ in after]}, "
                f"layers changed: {[i for i, (p, q) in enumerate(zip(before, after)) if p != q]}")
        g2 = greedy(model, caches, turn, size.tokens)

        never = build_caches(model, "fp16", 4, True)
        greedy(model, never, prompt, 0)
        compare(f"{label}: after exact rollback vs never decoded", g1, greedy(model, never, x, W + 3), tally)
        compare(f"{label}: after refused rollback vs never asked", g2, greedy(model, never, turn, size.tokens), tally)
    tally.note("rollback exact before the wrap; refused atomically after it (0 trimmed, no layer changed)")
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


def paged_caches(model: Any, block_size: int, factories: Factories = None) -> list[Any]:
    """One block pool per layer (``factories["paged"]``, an injected bug,
    when given), each holding the ``main`` sequence: ``PagedKVCache``."""
    pool_class = (factories or {}).get("paged", BlockPool)
    return [PagedKVCache(pool_class(block_size, chunk=4)) for _ in model.layers]


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


#: the rings' undo depth in the speculative_window scenario, and its draft length
UNDO_DEPTH = 4
#: its window: small, so that the rings wrap every few tokens
SPEC_WINDOW = 6


class _Recorder:
    """A model that records each call's input tokens and output logits, and
    (through its first ring's ``trim``) how many of each call's rows were
    rolled back later, newest call first."""

    def __init__(self, model: Any, ring: RotatingKVCache):
        self.model, self.calls = model, []  # [tokens, logits, rows rolled back]
        self.rollbacks_after_wrap = 0
        trim = ring.trim

        def counted(k: int) -> int:
            wrapped = ring.wrapped
            got = trim(k)
            self.rollbacks_after_wrap += bool(got) and wrapped
            left = got
            for call in reversed(self.calls):
                take = min(left, len(call[0]) - call[2])
                call[2] += take
                left -= take
            return got

        ring.trim = counted  # type: ignore[method-assign]

    @property
    def layers(self) -> Any:
        return self.model.layers

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        out = self.model(inputs, cache=cache)
        self.calls.append([np.array(inputs)[0].tolist(), out, 0])
        return out

    def check_against_never(self, label: str) -> None:
        """Every call's logits, for the rows that stayed, equal (bytes) a run
        of the same calls without the rolled-back rows on fresh caches."""
        never = build_caches(self.model, "fp16", 4, True)
        for i, (tokens, logits, back) in enumerate(self.calls):
            kept = tokens[: len(tokens) - back]
            if not kept:
                continue
            want = self.model(mx.array(kept, dtype=mx.uint32)[None], cache=never)
            require(np.array(logits[:, : len(kept), :]).tobytes() == np.array(want).tobytes(),
                    f"{label}: call {i} ({len(tokens)} rows, {back} rolled back later): logits differ from a run "
                    f"that never had the rolled-back rows")


def _max_logprob_diff(a: list[bytes], b: list[bytes]) -> float:
    return max((float(np.abs(np.frombuffer(x, np.float16).astype(np.float32) - np.frombuffer(y, np.float16)).max())
                for x, y in zip(a, b)), default=0.0)


def scenario_speculative_window(size: Size, factories: Factories = None) -> tuple[Tally, float | None]:
    """mlx-lm's speculative decoding on gemma3 (two sliding-window layers of
    window 6, one global) with an early-exit draft of ``UNDO_DEPTH`` tokens
    a round, on rings with undo depth ``UNDO_DEPTH``: every rejected draft
    is rolled back exactly, also after the wrap. Checks: the tokens equal
    plain greedy decoding's; every call of the main model gives logits
    byte-identical to a run that was fed the same calls without the rows
    later rolled back (a run that never had them); the rings wrap many
    times and the rollbacks after a wrap are many. Log-probabilities are
    not byte-compared with single-step greedy: after a wrap a decode step
    reads the ring in physical order and a verification block reads it in
    chronological order, so float sums differ in the last bits for any ring;
    since every call equals the run that never rolled back, byte for byte,
    that difference (reported) comes from the chunking, not the rollback.
    The same scenario on mlx-lm's own caches is
    run for the record: its trim is refused after the wrap and the stream
    drifts (docs/mlx-lm.md)."""
    from mlx_lm.generate import speculative_generate_step

    tally = Tally()
    W, U = SPEC_WINDOW, UNDO_DEPTH
    n = 2 * size.tokens
    drafted = accepted = rollbacks = 0
    wraps: list[int] = []
    spec_diff = 0.0
    drift: list[str] = []
    for seed in size.seeds:
        model, draft = speculative_gemma3(seed, W)
        prompt = token_ids(seed, 12)
        label = f"seed {seed}, W={W}, U={U}"
        plain = greedy(model, build_caches(model, "fp16", 4, True), prompt, n)
        caches = build_caches(model, "fp16", 4, True, factories, U) + build_caches(draft, "fp16", 4, True, factories, U)
        main_rings = _rotating(caches[: len(model.layers)])
        require(len(main_rings) == 2 and len(_rotating(caches)) == 4, f"{label}: expected 2 rings per model")
        main = _Recorder(model, main_rings[0])
        drafter = _Recorder(draft, _rotating(caches[len(model.layers):])[0])
        got = Stream()
        for tok, logprobs, from_draft in speculative_generate_step(
            prompt, main, drafter, num_draft_tokens=U, max_tokens=n, prompt_cache=caches,
        ):
            got.tokens.append(int(tok))
            got.logprobs.append(np.array(logprobs).tobytes())
            accepted += bool(from_draft)
        drafted += len(drafter.calls) - 1  # the first draft call is its prefill
        rollbacks += main.rollbacks_after_wrap
        for i, (a, b) in enumerate(zip(got.tokens, plain.tokens)):
            require(a == b, f"{label}: step {i}: speculative token {a}, greedy {b}")
        require(len(got.tokens) == len(plain.tokens) == n, f"{label}: {len(got.tokens)} tokens, greedy {len(plain.tokens)}")
        require(len(set(got.tokens)) >= min_distinct(n), f"{label}: stream collapsed")
        tally.tokens.extend(got.tokens)
        main.check_against_never(f"{label}, main model")
        drafter.check_against_never(f"{label}, draft model")
        ring = main_rings[0]
        wraps.append((ring.offset - W) // (W - ring.keep) + 1)
        spec_diff = max(spec_diff, _max_logprob_diff(got.logprobs, plain.logprobs))

        # mlx-lm's own caches, same scenario (for the record)
        lm = mlx_lm_caches(model) + mlx_lm_caches(draft)
        lm_tokens = [int(t) for t, _, _ in speculative_generate_step(
            prompt, model, draft, num_draft_tokens=U, max_tokens=n, prompt_cache=lm)]
        first = next((i for i, (a, b) in enumerate(zip(lm_tokens, plain.tokens)) if a != b), None)
        drift.append("none" if first is None else f"step {first}")
    require(min(wraps) >= MIN_WRAPS.get(size, 20), f"the main rings wrapped {wraps} times (need {MIN_WRAPS.get(size, 20)} each)")
    need = MIN_ROLLBACKS.get(size, 100)
    require(rollbacks >= need, f"{rollbacks} rollbacks after a wrap (need {need})")
    require(0 < accepted < drafted, f"speculation must both accept and reject drafts, got {accepted} of {drafted}")
    tally.note(f"{accepted}/{drafted} drafts accepted; rings wrapped {min(wraps)}..{max(wraps)} times per seed; "
               f"{rollbacks} rollbacks after a wrap (main model); tokens = greedy; every call of both models = a run "
               f"that never had the rolled-back rows (logit bytes); max |log-prob - greedy| {spec_diff:.3g} (chunking, not rollback); "
               f"mlx-lm's own caches leave greedy at {', '.join(drift)}")
    return tally, accepted / max(drafted, 1)


#: the fewest wraps per seed and rollbacks after a wrap the scenario needs, by size
MIN_WRAPS = {SHORT: 8}
MIN_ROLLBACKS = {SHORT: 20}




# -- the Turbo modes ---------------------------------------------------------------
#: the Turbo modes and their cache parameters in the e2e runs (Delegated with
#: small thresholds so that handoff and block folds happen within a stretch)
TURBO_E2E: dict[str, dict[str, int]] = {
    "turbo4asym": {}, "turbo4": {}, "turbo3asym": {}, "turbo4delegated": {"hot_threshold": 6, "fold_block": 3},
}


def turbo_caches(model: Any, mode: str, factories: Factories = None) -> list[Any]:
    """``make_prompt_cache`` in a Turbo ``mode`` (step 4), built from
    ``factories["dense"]`` when that is a Turbo class of this mode (an
    injected Turbo bug; a bug of the Fp16/Int8 cache does not apply)."""
    bug = (factories or {}).get("dense")
    cls = DelegatedKVCache if mode == "turbo4delegated" else TurboKVCache
    fits = isinstance(bug, type) and issubclass(bug, cls)
    return make_prompt_cache(model, mode=mode, step=4, classes={"dense": bug} if fits else None, **TURBO_E2E[mode])


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


@dataclass
class Deviation:
    """Log-probability deviation of a cache mode from fp16 along one stream."""

    max_abs: float = 0.0
    mean_max_abs: float = 0.0
    top1: float = 1.0
    steps: int = 0

    def add(self, got: list[np.ndarray], ref: list[np.ndarray]) -> None:
        per_step = [float(np.max(np.abs(a - b))) for a, b in zip(got, ref)]
        agree = [int(np.argmax(a) == np.argmax(b)) for a, b in zip(got, ref)]
        n = self.steps + len(per_step)
        self.mean_max_abs = (self.mean_max_abs * self.steps + sum(per_step)) / n
        self.top1 = (self.top1 * self.steps + sum(agree)) / n
        self.max_abs = max(self.max_abs, *per_step)
        self.steps = n

    def __str__(self) -> str:
        return f"max |dlogp| {self.max_abs:.3f} (mean per step {self.mean_max_abs:.3f}), top-1 agreement {self.top1:.0%}"


def scenario_turbo(size: Size, factories: Factories = None) -> tuple[Tally, float | None]:
    """The Turbo modes inside a real model. Under a Turbo4Asym, Turbo4 or
    Turbo3Asym cache, mlx-lm's speculative decoding (drafts accepted and
    rejected: every reject is a physical trim) gives exactly the tokens and
    log-probability bytes of plain greedy decoding with the same cache mode:
    quantization is per row, so a rollback leaves exactly the rows a run
    that never drafted holds.

    Turbo4Delegated is reported, not compared byte for byte: which V rows
    are cold depends on the sizes of the appends (the handoff fold happens at
    a one-row append, the block folds after each append), and speculative
    decoding appends verification blocks where greedy decoding appends single
    rows, so the two runs hold the same rows with different ones quantized.
    Its speculative-vs-greedy deviation is reported instead.

    The log-probabilities' deviation from the fp16 cache along the fp16
    greedy stream (teacher-forced) is reported per mode."""
    tally = Tally()
    drafted = accepted = 0
    devs = {mode: Deviation() for mode in TURBO_E2E}
    delegated_max, delegated_prefix = 0.0, 1.0
    n = 2 * size.tokens
    for seed in size.seeds:
        model = tiny_llama(seed, late_scale=LATE_LAYER_SCALE)
        draft = early_exit_draft(model)
        prompt = token_ids(seed, 12)
        ref = greedy(model, build_caches(model, "fp16", 4, True), prompt, n)
        ref_lp = teacher_forced(model, build_caches(model, "fp16", 4, True), prompt, ref.tokens)
        for mode in TURBO_E2E:
            plain = greedy(model, turbo_caches(model, mode, factories), prompt, n)
            caches = turbo_caches(model, mode, factories) + turbo_caches(draft, mode, factories)
            spec = speculative(model, draft, caches, prompt, n)
            if mode == "turbo4delegated":
                same = 0  # steps until the two streams' tokens first differ
                while same < min(len(spec.stream.tokens), len(plain.tokens)) and \
                        spec.stream.tokens[same] == plain.tokens[same]:
                    same += 1
                as_f32 = [[np.frombuffer(b, np.float16).astype(np.float32) for b in st.logprobs[:same]]
                          for st in (spec.stream, plain)]
                delegated_max = max(delegated_max, *(float(np.max(np.abs(a - b))) for a, b in zip(*as_f32)), 0.0)
                delegated_prefix = min(delegated_prefix, same / max(len(plain.tokens), 1))
            else:
                compare(f"seed {seed}, {mode}: speculative vs greedy", spec.stream, plain, tally)
            drafted, accepted = drafted + spec.drafted, accepted + spec.accepted
            devs[mode].add(teacher_forced(model, turbo_caches(model, mode, factories), prompt, ref.tokens), ref_lp)
    require(accepted > 0 and accepted < drafted,
            f"speculation must both accept and reject drafts, got {accepted} accepted of {drafted}")
    tally.note(f"{accepted}/{drafted} drafts accepted; speculative = greedy bytes in turbo4asym, turbo4, turbo3asym")
    tally.note(f"turbo4delegated speculative vs greedy (reported): max |dlogp| {delegated_max:.3f} while the "
               f"tokens agree, shortest common prefix {delegated_prefix:.0%} of a stream")
    for mode, dev in devs.items():
        tally.note(f"{mode} vs fp16: {dev}")
    return tally, accepted / max(drafted, 1)


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    run: Callable[..., tuple[Tally, float | None]]
    #: why the scenario's reference does not hold on a GPU ("" when it does):
    #: it compares, bit for bit, outputs that a GPU computes with kernels of
    #: different shapes (GPU matmul and attention round by shape; measured on
    #: MLX 0.32 CUDA: log-probabilities 1 to 2 bfloat16 ulps apart with any
    #: cache, mlx-lm's own included)
    cpu_only: str = ""


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


SCENARIOS: list[Scenario] = [
    Scenario("greedy", "1 greedy", scenario_greedy),
    Scenario("speculative", "2 speculative", scenario_speculative),
    Scenario("prompt_reuse", "3 prompt_reuse", scenario_prompt_reuse),
    Scenario("sliding_window", "4 sliding_window", scenario_sliding_window),
    Scenario("mixed_rollback", "5 mixed_rollback", scenario_mixed_rollback),
    Scenario("lru_prompt_cache", "6 lru_prompt_cache", scenario_lru_prompt_cache),
    Scenario("prefix_sharing", "7 prefix_sharing", scenario_prefix_sharing,
             "compares a batch of forked sequences with each sequence alone, bit for bit"),
    Scenario("speculative_window", "8 speculative_window", scenario_speculative_window,
             "compares a verify block's logits with one-row steps', bit for bit"),
    Scenario("bf16_models", "9 bf16_models", scenario_bf16_models),
    Scenario("turbo", "10 turbo", scenario_turbo, "compares speculative (k-row verify) with greedy decoding, bit for bit"),
]


def on_gpu() -> bool:
    from fuzz.device import current

    return current() == "gpu"


def gpu_skipped(names: list[str] | None = None) -> list[tuple[str, str]]:
    """(name, reason) of the scenarios that do not run on this device."""
    if not on_gpu():
        return []
    return [(s.name, s.cpu_only) for s in SCENARIOS if s.cpu_only and (names is None or s.name in names)]


@dataclass
class ScenarioResult:
    name: str
    title: str
    ok: bool
    tokens: int
    distinct: int
    acceptance: float | None
    seconds: float
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.name, "ok": self.ok, "tokens": self.tokens, "distinct": self.distinct,
            "acceptance": None if self.acceptance is None else round(self.acceptance, 3),
            "seconds": round(self.seconds, 2), "detail": self.detail,
        }


def by_name(name: str) -> Scenario:
    for s in SCENARIOS:
        if s.name == name:
            return s
    raise KeyError(f"no e2e scenario named {name!r}; known: {[s.name for s in SCENARIOS]}")


def run_scenario(name: str, size: Size = SHORT, factories: Factories = None, **kwargs: Any) -> ScenarioResult:
    """Run one scenario; a failed check (Divergence) or any exception is a
    failed result whose detail says what differed."""
    scenario = by_name(name)
    start = time.perf_counter()
    try:
        tally, acceptance = scenario.run(size, factories, **kwargs)
        ok, detail = True, "; ".join(tally.checks)
    except Divergence as exc:
        tally, acceptance, ok, detail = Tally(), None, False, str(exc)
    except Exception as exc:  # noqa: BLE001 - a broken cache may raise anywhere inside the model
        tally, acceptance, ok, detail = Tally(), None, False, f"{type(exc).__name__}: {exc}"
    return ScenarioResult(scenario.name, scenario.title, ok, len(tally.tokens), len(set(tally.tokens)),
                          acceptance, time.perf_counter() - start, detail)


def run_all(size: Size = SHORT, factories: Factories = None, names: list[str] | None = None,
            progress: Callable[[ScenarioResult], None] | None = None) -> list[ScenarioResult]:
    """Run the scenarios (``names``: only these); ``progress(result)`` after each."""
    out = []
    skip = {name for name, _ in gpu_skipped()}
    for s in SCENARIOS:
        if (names is None or s.name in names) and s.name not in skip:
            out.append(run_scenario(s.name, size, factories))
            if progress is not None:
                progress(out[-1])
    return out


__all__ = [
    "DEFAULT", "LONG", "SCENARIOS", "SHORT", "Divergence", "ScenarioResult", "Size", "Stream",
    "build_caches", "early_exit_draft", "greedy", "run_all", "run_scenario", "speculative",
    "tiny_gemma3", "tiny_llama",
]


# -- the `kvspec e2e` command --------------------------------------------------------
def main(long: bool = False, as_json: bool = False, bug: str | None = None, only: list[str] | None = None) -> int:
    """Run the scenarios and print one table (or one JSON object). Exit 0
    when every scenario passes and 1 when any diverged, as replay and fuzz
    do; with ``bug`` (an injected bug of ``fuzz.bugs``) exit 1 therefore
    means the bug was caught, and the last line says by which scenarios."""
    import json

    from rich.console import Console
    from rich.table import Table

    factories = None
    if bug is not None:
        from fuzz.bugs import by_name as bug_by_name

        factories = bug_by_name(bug).factories
    for name in only or []:
        by_name(name)
    start = time.perf_counter()
    size = LONG if long else DEFAULT
    import sys

    print(f"kvspec e2e: {'long' if long else 'default'} size, seeds {list(size.seeds)}"
          + (f", bug {bug}" if bug else ""), file=sys.stderr, flush=True)
    results = run_all(size, factories, only or None,
                      lambda r: print(f"e2e: {r.name}: {'ok' if r.ok else 'DIVERGED'} ({r.seconds:.1f} s)",
                                      file=sys.stderr, flush=True))
    total = time.perf_counter() - start
    skipped = gpu_skipped(only or None)
    for name, reason in skipped:
        print(f"e2e: {name}: not run on the GPU: it {reason} (GPU kernels round by shape)", file=sys.stderr)
    ok = all(r.ok for r in results) and bool(results)
    if as_json:
        print(json.dumps({"ok": ok, "long": long, "bug": bug, "seconds": round(total, 1),
                          "scenarios": [r.to_json() for r in results],
                          "not_run_on_gpu": [{"scenario": n, "reason": r} for n, r in skipped]}))
        return 0 if ok else 1
    title = (f"kvspec e2e ({'long' if long else 'default'}: {size.tokens} tokens a stretch, window {size.window}, "
             f"{len(size.seeds)} seeds{', bug ' + bug if bug else ''}; {total:.0f} s)")
    table = Table(title=title)
    for col in ("scenario", "tokens", "distinct", "acceptance", "result", "seconds"):
        table.add_column(col, justify="left" if col in ("scenario", "result") else "right", no_wrap=True)
    for r in results:
        result = "[green]ok[/]" if r.ok else ("[yellow]diverged[/]" if bug else "[bold red]FAILED[/]")
        table.add_row(r.title, str(r.tokens), str(r.distinct),
                      "" if r.acceptance is None else f"{r.acceptance:.0%}", result, f"{r.seconds:.1f}")
    console = Console(highlight=False, soft_wrap=True)
    console.print(table)
    for r in results:
        console.print(f"{r.name}: {'' if r.ok else '[bold]'}{r.detail}{'' if r.ok else '[/]'}", markup=True)
    if bug:
        caught = [r.name for r in results if not r.ok]
        console.print(f"injected bug {bug}: " + (f"caught by {', '.join(caught)}" if caught else "[bold red]not caught[/]"))
    return 0 if ok else 1
