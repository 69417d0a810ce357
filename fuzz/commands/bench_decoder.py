"""``kvspec bench --decoder`` and ``--e2e``: the caches as a decoder sees them,
each row beside mlx-lm's own caches in the same run.

Decoder rows (``--decoder``): one decode step over ``layers`` layers (28 by
default, a Qwen2.5-7B depth), each layer writing through its cache and then
reading the window with attention (``mlx_lm.models.base.
scaled_dot_product_attention``, 32 query heads over 8 KV heads of 128, the
model's dtype), all layers evaluated together as a decoder evaluates them.
The ``attention only`` row is the floor: the same attention over windows
nobody writes. Every other row is that plus the operation named:

* decode in place / copying (the previous step's windows held, as a
  pipelined decoder holds them);
* rollback k = 1..4: trim k rows, then append k rows (speculative decoding);
* ring warm-up (the window not yet full, writes in place) and steady state
  (a wrapped ring, writes copy);
* paged append beside a fork (the fork shares every full block);
* Int8 and Turbo4 appends (mlx-lm's ``QuantizedKVCache`` at 8 bits beside
  Int8).

End-to-end rows (``--e2e``): tokens per second through mlx-lm with
random-weight models at real shapes: greedy ``generate_step`` and
``speculative_generate_step`` (a 0.5B-shaped draft, 3 draft tokens) on a
28-layer Qwen2.5-7B-shaped target, at contexts of about 1k, 8k and 24k; and a
Gemma-3-1B-shaped sliding-window model decoding inside its window. The
draft is made to agree with the target on about three tokens in four
(:func:`agreeing_pair`), so speculative rounds both accept and roll back.
Every config's caches stay alive and the configs decode short blocks in
turn (:func:`interleaved_blocks`): each block is paired with mlx-lm's block
of the same round, seconds apart, which divides out the slow stretches of a
shared host that whole runs minutes apart could not.

Times are medians over rounds taken round-robin across the compared rows:
each comparison (ours, mlx-lm's, and the attention-only floor they are
measured against) at every context in one round-robin, so drift in the
machine's load or clocks falls on all of them alike; only ratios within one
run mean anything across machines.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

Q_HEADS, KV_HEADS, DIM = 32, 8, 128


# -- decoder micro rows -----------------------------------------------------------------
def _attend(q: mx.array, cache: Any, kv: tuple[mx.array, mx.array]) -> mx.array:
    from mlx_lm.models.base import scaled_dot_product_attention

    return scaled_dot_product_attention(q, kv[0], kv[1], cache=cache, scale=DIM**-0.5, mask=None)


def _rows(n: int, dtype: Any, seed: int) -> mx.array:
    a = mx.random.normal((1, KV_HEADS, n, DIM), key=mx.random.key(seed)).astype(dtype)
    mx.eval(a)
    return a


class _Step:
    """``layers`` caches holding ``context`` rows each; each call times one
    decoder step: ``op(cache)`` per layer (the write, returning what
    attention reads), attention per layer, one evaluation."""

    def __init__(self, make: Callable[[], Any], context: int, layers: int, dtype: Any,
                 op: Callable[[Any, mx.array], Any], queries: int = 1, hold: bool = False,
                 prefill: Callable[[Any, mx.array], Any] | None = None):
        self.caches = [make() for _ in range(layers)]
        pre = _rows(context, dtype, 1)
        for c in self.caches:
            out = (prefill or (lambda c, r: c.update_and_fetch(r, r)))(c, pre)
            mx.eval(out if out is not None else c.fetch())
        self.q = mx.random.normal((1, Q_HEADS, queries, DIM), key=mx.random.key(2)).astype(dtype)
        self.one = _rows(queries, dtype, 3)
        mx.eval(self.q)
        self.op, self.hold, self.held = op, hold, None

    def __call__(self) -> float:
        start = time.perf_counter()
        outs = [_attend(self.q, c, self.op(c, self.one)) for c in self.caches]
        mx.eval(outs)
        seconds = time.perf_counter() - start
        # a pipelined decoder still holds the last step's windows when it
        # writes the next row; dropping them lets MLX reuse the buffers
        self.held = outs if self.hold else None
        return seconds


def _floor(context: int, layers: int, dtype: Any, queries: int = 1) -> Callable[[], float]:
    """Attention only: the same attention over the same kind of windows (a
    cache's buffer of ``context + queries`` rows, read through its window),
    with no write, for ``queries`` queries (a rollback of k rows attends
    with k). Fresh arrays of exactly the window's length are a different
    layout from a cache's window and timed differently."""
    from kvspec.impl.dense import KVCache

    caches = [KVCache("fp16", step=256, inplace=False) for _ in range(layers)]
    pre = _rows(context + queries, dtype, 1)
    for c in caches:
        mx.eval(c.update_and_fetch(pre, pre))
    windows = [c.fetch() for c in caches]
    q = mx.random.normal((1, Q_HEADS, queries, DIM), key=mx.random.key(2)).astype(dtype)
    mx.eval(q)

    def tick() -> float:
        start = time.perf_counter()
        mx.eval([_attend(q, None, kv) for kv in windows])
        return time.perf_counter() - start

    return tick


def _steady(c: Any, rows: mx.array) -> Any:
    """One decode step (the cache grows by a row a call: a few dozen rows
    over a row's rounds, nothing beside the context)."""
    return c.update_and_fetch(rows, rows)


def _rollback(k: int) -> Callable[[Any, mx.array], Any]:
    def op(c: Any, rows: mx.array) -> Any:
        c.trim(k)
        return c.update_and_fetch(rows, rows)

    return op


def floor_of(name: str) -> str:
    """The attention-only row a decoder row is measured against: the floor
    with as many queries as the row attends with (rollback k: k queries)."""
    import re

    m = re.match(r"rollback k=(\d+):", name)
    if m and m.group(1) != "1":
        return f"attention only, {m.group(1)} queries (floor of rollback k={m.group(1)})"
    return "attention only (floor)"


def decoder_rows(context: int, layers: int, dtype: Any) -> dict[str, Callable[[], Callable[[], float]]]:
    """Row name -> a maker of its tick at ``context`` (built lazily: one
    row's caches at a time)."""
    from mlx_lm.models import cache as mc

    from kvspec.impl.dense import KVCache
    from kvspec.impl.paged import PagedKVCache
    from kvspec.impl.rotating import RotatingKVCache
    from kvspec.impl.turbo import TurboKVCache

    def ours(inplace: bool, mode: str = "fp16") -> Callable[[], Any]:
        return lambda: KVCache(mode, step=256, inplace=inplace)

    def paged_forked() -> Any:
        c = PagedKVCache(block_size=16, inplace=True)
        return c

    def fork_prefill(c: Any, r: mx.array) -> Any:
        out = c.update_and_fetch(r, r)
        c.bench_fork = c.fork("draft")  # the fork holds every block written so far
        return out

    rows: dict[str, Callable[[], Callable[[], float]]] = {
        "attention only (floor)": lambda: _floor(context, layers, dtype),
        "decode in place: ours": lambda: _Step(ours(True), context, layers, dtype, _steady),
        "decode in place: mlx-lm KVCache": lambda: _Step(mc.KVCache, context, layers, dtype, _steady),
        "decode copying, previous step held: ours": lambda: _Step(ours(False), context, layers, dtype, _steady, hold=True),
        "decode, previous step held: mlx-lm KVCache": lambda: _Step(mc.KVCache, context, layers, dtype, _steady, hold=True),
    }
    for k in (2, 3, 4):
        rows[f"attention only, {k} queries (floor of rollback k={k})"] = lambda k=k: _floor(context, layers, dtype, k)
    for k in (1, 2, 3, 4):
        rows[f"rollback k={k}: ours"] = lambda k=k: _Step(ours(True), context, layers, dtype, _rollback(k), queries=k)
        rows[f"rollback k={k}: mlx-lm KVCache"] = lambda k=k: _Step(mc.KVCache, context, layers, dtype, _rollback(k),
                                                                   queries=k)
    rows.update({
        "ring warm-up: ours": lambda: _Step(lambda: RotatingKVCache(max_size=2 * context + 4096, keep=4, step=256,
                                                                    inplace=True), context, layers, dtype, _steady),
        "ring warm-up: mlx-lm RotatingKVCache": lambda: _Step(
            lambda: mc.RotatingKVCache(max_size=2 * context + 4096, keep=4), context, layers, dtype, _steady),
        "ring steady state: ours": lambda: _Step(lambda: RotatingKVCache(max_size=context, keep=4, step=256,
                                                                         inplace=True), context, layers, dtype, _steady),
        "ring steady state: mlx-lm RotatingKVCache": lambda: _Step(
            lambda: mc.RotatingKVCache(max_size=context, keep=4), context, layers, dtype, _steady),
        "paged append beside a fork: ours": lambda: _Step(paged_forked, context, layers, dtype, _steady,
                                                          prefill=fork_prefill),
        "int8 append: ours": lambda: _Step(ours(True, "int8"), context, layers, dtype, _steady),
        "8-bit append: mlx-lm QuantizedKVCache": lambda: _Step(lambda: mc.QuantizedKVCache(group_size=64, bits=8),
                                                                context, layers, dtype, _steady),
        "turbo4 append: ours": lambda: _Step(lambda: TurboKVCache("turbo4", step=256), context, layers, dtype, _steady),
    })
    return rows


def comparison_of(name: str) -> str:
    """The comparison a decoder row belongs to: its name before the colon
    (``rollback k=2: ours`` and ``rollback k=2: mlx-lm KVCache`` are one);
    a floor row is its own."""
    return name.split(":")[0]


def groups(names: list[str]) -> list[list[str]]:
    """The rows measured together, each comparison with its floor: every
    row of one comparison (ours beside mlx-lm's) and the attention-only
    floor it is measured against (:func:`floor_of`), in one round-robin.
    A floor no chosen row is measured against forms its own group."""
    out: dict[str, list[str]] = {}
    for name in names:
        if name.startswith("attention only"):
            continue
        g = out.setdefault(comparison_of(name), [floor_of(name)])
        g.append(name)
    lone = [n for n in names if n.startswith("attention only") and not any(n == g[0] for g in out.values())]
    return [[n] for n in lone] + list(out.values())


def run_decoder(contexts: list[int], layers: int, rounds: int,
                interleave: Callable[[list[Callable[[], float]], int], list[float]], dtype: Any = mx.float16,
                only: list[str] | None = None, say: Callable[[str], None] = print,
                ) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
    """``(rows, floors)``: row -> context -> median ms per decoder step, and
    row -> context -> the median ms of the row's floor measured in the same
    round-robin (what its over-floor cost is taken against).

    Each comparison (:func:`groups`: ours, mlx-lm's, their floor) is
    measured at every context in one round-robin by ``interleave`` (ticks,
    rounds) -> median seconds per tick (kvspec.fuzz.commands.bench's), so drift in
    the machine's load or clocks falls on ours and mlx-lm's alike; one
    group's caches exist at a time (memory). A floor measured in several
    groups is reported as the median of its groups' medians."""
    names = list(decoder_rows(contexts[0], layers, dtype))
    if only:
        names = [n for n in names if any(o in n for o in only)]
    out: dict[str, dict[int, float]] = {}
    floors: dict[str, dict[int, float]] = {}
    floor_runs: dict[str, list[dict[int, float]]] = {}
    for group in groups(names):
        say(f"bench --decoder: {', '.join(group)} at {', '.join(map(str, contexts))} ...")
        ticks: list[Callable[[], float]] = []
        measured: list[str] = []
        for name in group:
            try:
                row = [decoder_rows(n, layers, dtype)[name]() for n in contexts]
                for tick in row:  # an op this backend lacks fails here (mlx-lm's 8-bit attention on CUDA)
                    tick()
            except RuntimeError as exc:
                say(f"bench --decoder: {name}: not measured on this backend: {str(exc).splitlines()[0]}")
                UNSUPPORTED[name] = str(exc).splitlines()[0]
                continue
            ticks += row
            measured.append(name)
        medians = interleave(ticks, rounds) if ticks else []
        by_row = {name: {n: medians[i * len(contexts) + j] * 1e3 for j, n in enumerate(contexts)}
                  for i, name in enumerate(measured)}
        ticks = []
        floor = group[0]
        if floor in by_row:
            floor_runs.setdefault(floor, []).append(by_row[floor])
        for name in measured:
            if name != floor:
                out[name] = by_row[name]
                if floor in by_row:
                    floors[name] = by_row[floor]
    for floor, runs in floor_runs.items():
        out[floor] = {n: statistics.median(r[n] for r in runs) for n in contexts}
        floors[floor] = out[floor]
    # the rows in decoder_rows' order
    return {n: out[n] for n in names if n in out}, floors


#: rows the last :func:`run_decoder` could not run here, with MLX's reason
UNSUPPORTED: dict[str, str] = {}


# -- end to end ------------------------------------------------------------------------
def qwen_args(kind: str) -> Any:
    """mlx-lm ModelArgs of a Qwen2.5-7B-shaped target or 0.5B-shaped draft."""
    from mlx_lm.models import qwen2

    if kind == "7b":
        return qwen2.ModelArgs(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
                               num_attention_heads=28, rms_norm_eps=1e-6, vocab_size=152064, num_key_value_heads=4,
                               rope_theta=1e6, tie_word_embeddings=False)
    if kind == "0.5b":
        return qwen2.ModelArgs(model_type="qwen2", hidden_size=896, num_hidden_layers=24, intermediate_size=4864,
                               num_attention_heads=14, rms_norm_eps=1e-6, vocab_size=152064, num_key_value_heads=2,
                               rope_theta=1e6, tie_word_embeddings=True)
    if kind == "tiny":  # the smoke test's
        return qwen2.ModelArgs(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                               num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=512, num_key_value_heads=2,
                               rope_theta=1e6, tie_word_embeddings=False)
    raise ValueError(f"qwen_args: kind must be 7b, 0.5b or tiny, got {kind!r}")


def random_model(module: Any, args: Any, dtype: Any = mx.bfloat16) -> Any:
    model = module.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


#: scale of every block's output projections (attention ``o_proj``, MLP
#: ``down_proj``) in :func:`agreeing_pair`: small enough that the residual
#: stream stays the token's embedding, so the next token is a function of the
#: current one that both models share
BLOCK_OUTPUT_SCALE = 1e-3
#: share of the vocabulary on which the draft's next token differs from the
#: target's in :func:`agreeing_pair` (pairs of lm_head rows swapped)
DRAFT_DISAGREES = 0.25


def _next_token_map(vocab: int) -> mx.array:
    """A fixed permutation ``g`` of the vocabulary (an affine map with a
    multiplier coprime to ``vocab``): the random-weight models' next token."""
    import math

    a = 7919
    while math.gcd(a, vocab) != 1:
        a += 2
    return (mx.arange(vocab) * a + 13) % vocab


def agreeing_pair(target: Any, draft: Any, disagree: float = DRAFT_DISAGREES,
                  scale: float = BLOCK_OUTPUT_SCALE) -> None:
    """Make a random-weight target and draft (mlx-lm qwen2 Models, untied
    heads, one vocabulary) predict the same next token on ``1 - disagree``
    of the vocabulary, keeping every shape and every FLOP of attention and
    MLP: each block's output projections are scaled by ``scale``, so the
    residual stream carries the current token's embedding ``e_x`` through
    the blocks (the blocks still compute everything; their output is small);
    the target's lm_head row ``y`` is ``e_{g^-1(y)}``, so its greedy next
    token is ``g(x)`` (random embeddings: ``<e_x, e_x>`` beats every
    ``<e_x, e_z>`` by a wide margin); the draft's lm_head is the target's
    rule on its own embedding with pairs of rows ``(y, y + 1)`` swapped for a
    ``disagree`` share of ``y``: there it proposes ``g(x) +- 1``. In place."""
    vocab = target.args.vocab_size
    g = _next_token_map(vocab)
    inv = mx.zeros((vocab,), dtype=mx.int32).at[g].add(mx.arange(vocab, dtype=mx.int32))  # g^-1
    period = max(2, round(2 / disagree)) if disagree > 0 else 0
    swap = mx.arange(vocab)
    if period:
        y = mx.arange(vocab)
        first = (y % period == 0) & (y + 1 < vocab)
        second = (y % period == 1)
        swap = mx.where(first, y + 1, mx.where(second, y - 1, y))
    for model, rows in ((target, inv), (draft, inv[swap])):
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * scale
            layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * scale
        model.lm_head.weight = model.model.embed_tokens.weight[rows]
        mx.eval(model.parameters())


def _prompt(n: int, vocab: int) -> mx.array:
    return (mx.arange(n) * 7919 + 13) % (vocab - 1)


def e2e_configs() -> dict[str, Callable[[Any], list[Any]]]:
    """Config name -> prompt-cache maker for a model."""
    from mlx_lm.models import cache as mc

    from kvspec.fuzz.bugs.dense import PhysicalTrimFp16
    from kvspec.impl.models import make_prompt_cache

    return {
        "mlx-lm caches": lambda m: mc.make_prompt_cache(m),
        "ours, in place": lambda m: make_prompt_cache(m, mode="fp16", inplace=True),
        "ours, inplace=False": lambda m: make_prompt_cache(m, mode="fp16", inplace=False),
        "ours, physical trim": lambda m: make_prompt_cache(m, mode="fp16", inplace=True,
                                                           classes={"dense": PhysicalTrimFp16}),
    }


def rotated(names: list[str], r: int) -> list[str]:
    """The round-robin order of repeat ``r``: ``names`` started ``r`` later."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def paired_ratios(samples: dict[str, dict[Any, list[float]]], name: str, base: str = "mlx-lm caches"
                  ) -> dict[Any, list[float]]:
    """``{context: [block r of name / block r of base]}``: each ratio from
    one round of :func:`interleaved_blocks`, the two blocks seconds apart at
    most, so a slow stretch of the host divides out (a ratio above 1:
    ``name`` was faster). Raises ValueError when the two have not as many
    blocks."""
    return {n: [a / b for a, b in zip(runs, samples[base][n], strict=True)]
            for n, runs in samples.get(name, {}).items() if n in samples.get(base, {})}


def _generator(model: Any, caches: list[Any], context: int, tokens: int, draft: Any = None,
               draft_caches: list[Any] | None = None) -> Any:
    """mlx-lm's greedy ``generate_step`` (or ``speculative_generate_step``
    with ``draft``, 3 draft tokens) over ``caches`` after a prefill of
    ``context`` tokens, for at most ``tokens`` tokens."""
    from mlx_lm.generate import generate_step, speculative_generate_step

    prompt = _prompt(context, model.args.vocab_size)
    if draft is not None:
        return speculative_generate_step(prompt, model, draft, num_draft_tokens=3, max_tokens=tokens,
                                         prompt_cache=caches + (draft_caches or []))
    return generate_step(prompt, model, max_tokens=tokens, prompt_cache=caches)


def _sync() -> None:
    """Wait for everything mlx-lm's generation stream has queued."""
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)


def interleaved_blocks(model: Any, makers: dict[str, Callable[[Any], list[Any]]], context: int, block: int,
                       blocks: int, draft: Any = None, warmup: int = 8) -> tuple[dict[str, list[float]],
                                                                                dict[str, float]]:
    """Tokens/s of every config in ``makers`` (name -> prompt-cache maker
    for a model), measured in ``blocks`` blocks of ``block`` tokens each,
    the configs taking turns: every config prefills ``context`` tokens and
    decodes ``warmup`` tokens unmeasured (MLX builds its kernels for the
    shapes on first use), then round ``r`` decodes one block of every
    config, in the order :func:`rotated` gives for ``r``, each block timed
    from an idle stream to an idle stream (the step mlx-lm's pipeline has
    already queued when the block ends is waited for and counted in it).
    Every config's caches and generator stay alive across the rounds, so
    block ``r`` of two configs is decoded seconds apart at most, at the
    same position in the same token stream (the caches give the same
    tokens): a slow stretch of a shared host falls on both, and their
    ratio (:func:`paired_ratios`) divides it out.

    Returns ``({name: [tokens/s of block r]}, {name: share of the measured
    tokens the draft proposed and the target accepted}``; the second is
    empty without a draft."""
    names = list(makers)
    gens = {}
    for name in names:
        make = makers[name]
        gens[name] = _generator(model, make(model), context, warmup + block * blocks + 1, draft,
                                make(draft) if draft is not None else None)
        for _ in range(warmup + 1):  # the prefill and the warm-up, unmeasured
            next(gens[name])
        _sync()
    samples: dict[str, list[float]] = {name: [] for name in names}
    accepted = dict.fromkeys(names, 0)
    for r in range(blocks):
        for name in rotated(names, r):
            gen = gens[name]
            start = time.perf_counter()
            for _ in range(block):
                item = next(gen)
                if draft is not None and item[2]:
                    accepted[name] += 1
            _sync()
            samples[name].append(block / (time.perf_counter() - start))
    for name in reversed(names):  # last opened, first closed: each generator's stream context unwinds in order
        gens[name].close()
    share = {name: accepted[name] / (block * blocks) for name in names} if draft is not None else {}
    return samples, share


def run_e2e(contexts: list[int], tokens: int, repeats: int, size: str = "7b",
            say: Callable[[str], None] = print, warmup: int = 8) -> dict[str, Any]:
    """Every end-to-end row: ``{"speculative": {config: {context: tps}},
    "greedy": ..., "sliding window": ..., "acceptance": ...}``; each figure
    the median over ``repeats`` blocks of ``tokens`` tokens, the configs
    decoding their blocks in turn from caches kept alive
    (:func:`interleaved_blocks`), and ``"samples"``: ``{row: {config:
    {context: [tps of block r]}}}``, block ``r`` of every config from round
    ``r``, so :func:`paired_ratios` divides block by block. On CUDA ``ours,
    in place`` and ``ours, inplace=False`` run the same write (the donated
    static slice update): their ratio shows what the host's noise leaves.

    The sliding-window model (a Gemma-3-1B shape, window 1024) prefills a
    quarter of its window and decodes inside it (warm-up writes), with
    blocks made shorter where ``repeats * tokens`` would leave the window."""
    from mlx_lm.models import gemma3_text, qwen2

    target = random_model(qwen2, qwen_args(size))
    dargs = qwen_args("0.5b" if size == "7b" else "tiny")
    dargs.tie_word_embeddings = False  # its own lm_head (same matmul as the tied one): agreeing_pair sets it
    draft = random_model(qwen2, dargs)
    if not target.args.tie_word_embeddings:
        agreeing_pair(target, draft)
    configs = e2e_configs()
    greedy_configs = {name: make for name, make in configs.items() if name != "ours, physical trim"}
    out: dict[str, Any] = {"speculative": {}, "greedy": {}, "sliding window": {}, "acceptance": {}}
    samples: dict[str, dict[str, dict[int, list[float]]]] = {}
    for context in contexts:
        say(f"bench --e2e: Qwen2.5-{size}-shaped target at context {context} ...")
        for row, makers, d in (("speculative", configs, draft), ("greedy", greedy_configs, None)):
            runs, share = interleaved_blocks(target, makers, context, tokens, repeats, d, warmup)
            for name, values in runs.items():
                out[row].setdefault(name, {})[context] = statistics.median(values)
                samples.setdefault(row, {}).setdefault(name, {})[context] = values
            for name, a in share.items():
                out["acceptance"].setdefault(name, {})[context] = a
    target = draft = None  # free the models before the next one
    say("bench --e2e: Gemma-3-1B-shaped sliding-window model inside its window ...")
    gargs = gemma3_text.ModelArgs(model_type="gemma3_text", sliding_window=1024) if size == "7b" else \
        gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                              num_attention_heads=2, head_dim=32, vocab_size=512, sliding_window=64)
    gemma = random_model(gemma3_text, gargs)
    window = gargs.sliding_window
    context = window // 4
    block = max(1, min(tokens, (window - context - warmup - 1) // repeats))  # stay inside the window
    runs, _ = interleaved_blocks(gemma, greedy_configs, context, block, repeats, None, warmup)
    out["sliding window"] = {name: {context: statistics.median(v)} for name, v in runs.items()}
    samples["sliding window"] = {name: {context: v} for name, v in runs.items()}
    out["samples"] = samples
    return out
