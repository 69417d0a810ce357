"""``kvspec bench --recurrent``: what exact rollback of a hybrid model's
recurrent layers costs (docs/recurrent.md).

The recurrent layers of a hybrid model (qwen3_next's GatedDeltaNet, lfm2's
short conv) roll back exactly through the checkpoints of
``kvspec.impl.recurrent.RecurrentCache``, which the **step recorder**
(``kvspec.impl.recurrent.record_steps``) fills: a verify block of ``k + 1`` tokens
on caches of depth ``k`` runs the recurrent layers one token at a time.
This bench measures that price, on random-weight models of realistic layer
shapes (:data:`SHAPES`; bfloat16 on a GPU, float32 on the CPU):

* **per speculative round**, at each context (the attention layers hold
  ``context`` rows of random keys and values, the recurrent layers the
  state after a short prompt: their cost does not grow with the context),
  for ``k`` = 2 and 4: the verify block of ``k + 1`` tokens through the
  whole model with our caches of depth ``k`` (recorder on), the same block
  with the recorder off (depth 0: one block call, no rollback possible),
  and plain decoding of the same ``k + 1`` tokens one call each (depth 0,
  recorder off, logits evaluated after every token as a greedy decoder
  needs them); the rollback itself (``kvspec.impl.models.trim_prompt_cache`` of
  ``n`` = 1..k tokens after a verify block, host time: it builds no
  arrays). Every row of one (model, context) is timed in one round-robin
  (round ``r`` starts at a different row), so each round's ratios divide
  out the host's slow stretches; each cell is the median of the rounds
  with a distribution-free 95 % interval of the median
  (``kvspec.fuzz.commands.bench.median_interval``), and each ratio the median of
  the rounds' ratios with its interval.
* **memory**: the bytes the checkpoint ring holds beyond the live arrays,
  per recurrent layer and in total (after a verify block: coverage ``k``),
  counted from the ring's arrays (``nbytes``) and measured as the drop of
  MLX's active memory when the rings are cleared, against the recurrent
  layers' own bytes and the whole cache list's bytes at each context.
* **end to end** (qwen3_next shape): tokens/s of mlx-lm's
  ``speculative_generate_step`` with our caches (``num_draft_tokens`` k =
  2), the draft the target itself (every draft token accepted) or a random
  model of the same shape (nearly every draft rejected: a rollback of k
  every round), against greedy ``generate_step`` with mlx-lm's caches and
  with ours (depth 0), in blocks the configs decode in turn from caches
  kept alive, paired block by block (``kvspec.fuzz.commands.bench.paired_table``).

Times are wall seconds of this machine (``time.perf_counter``); only
ratios within one run mean anything across machines. No verdict depends on
them. A rollback the caches refuse stops the bench with RuntimeError (a
tool failure, never a figure).
"""

from __future__ import annotations

import gc
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kvspec.fuzz.commands.bench import round_robin

#: the model shapes, per size: ``full`` (the GPU default: hidden 2048, a
#: Qwen3-Next-80B / LFM2-1.2B layer (Qwen3-Next's GatedDeltaNet heads and
#: dims; a dense MLP for its experts), fewer layers and a smaller
#: vocabulary), ``small`` (the CPU default: hidden 512, the same head dims)
#: and ``tiny`` (the smoke test's)
SIZES = ("full", "small", "tiny")

SHAPES: dict[str, dict[str, dict[str, Any]]] = {
    "qwen3_next": {
        "full": {"hidden_size": 2048, "num_hidden_layers": 8, "full_attention_interval": 4,
                 "linear_num_value_heads": 32, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
                 "linear_value_head_dim": 128, "num_attention_heads": 16, "num_key_value_heads": 2,
                 "head_dim": 256, "intermediate_size": 5632, "vocab_size": 32768},
        "small": {"hidden_size": 512, "num_hidden_layers": 4, "full_attention_interval": 4,
                  "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 128,
                  "linear_value_head_dim": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 128, "intermediate_size": 1408, "vocab_size": 4096},
        "tiny": {"hidden_size": 64, "num_hidden_layers": 4, "full_attention_interval": 2,
                 "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                 "linear_value_head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 16, "intermediate_size": 128, "vocab_size": 256},
    },
    "lfm2": {
        "full": {"hidden_size": 2048, "num_hidden_layers": 6, "full_attn_idxs": [2, 5], "num_attention_heads": 32,
                 "num_key_value_heads": 8, "block_ff_dim": 8192, "vocab_size": 32768},
        "small": {"hidden_size": 512, "num_hidden_layers": 3, "full_attn_idxs": [1], "num_attention_heads": 8,
                  "num_key_value_heads": 2, "block_ff_dim": 2048, "vocab_size": 4096},
        "tiny": {"hidden_size": 64, "num_hidden_layers": 3, "full_attn_idxs": [1], "num_attention_heads": 4,
                 "num_key_value_heads": 2, "block_ff_dim": 128, "vocab_size": 256},
    },
}

#: the draft lengths of the per-round rows
KS = (2, 4)
#: the draft length of the end-to-end rows
E2E_K = 2
#: tokens of the short prompt that gives the recurrent layers a state
PROMPT = 8
#: the baseline config of the end-to-end rows (``bench.paired_table``'s)
BASE = "mlx-lm caches"


def model_args(family: str, size: str) -> tuple[Any, Any]:
    """(mlx-lm model module, ModelArgs) of ``family`` (``SHAPES``' keys) at
    ``size`` (``SIZES``). Raises KeyError for an unknown family or size."""
    import importlib

    shape = SHAPES[family][size]
    mod = importlib.import_module(f"mlx_lm.models.{family}")
    if family == "qwen3_next":
        args = mod.ModelArgs(
            model_type=family, **shape, linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=1,
            decoder_sparse_step=1, shared_expert_intermediate_size=shape["intermediate_size"], mlp_only_layers=[],
            moe_intermediate_size=shape["intermediate_size"], rms_norm_eps=1e-6, rope_theta=10000.0,
            partial_rotary_factor=0.25, max_position_embeddings=131072, tie_word_embeddings=False)
    else:
        args = mod.ModelArgs(
            model_type=family, **shape, max_position_embeddings=131072, norm_eps=1e-5, conv_bias=False,
            conv_L_cache=3, block_dim=shape["hidden_size"], block_multiple_of=256, block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=False)
    return mod, args


def build_model(family: str, size: str, seed: int, dtype: Any) -> Any:
    """A random-weight model (``mx.random.seed(seed)``) in ``dtype``."""
    mod, args = model_args(family, size)
    mx.random.seed(seed)
    model = mod.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def _kv_shape(family: str, size: str) -> tuple[int, int]:
    """(kv heads, head dim) of the family's attention layers."""
    s = SHAPES[family][size]
    return s["num_key_value_heads"], s.get("head_dim") or s["hidden_size"] // s["num_attention_heads"]


def _tokens(n: int, vocab: int, salt: int = 0) -> mx.array:
    return ((mx.arange(n) + salt) * 7919 + 13) % (vocab - 1)


def _recurrent(caches: list[Any]) -> list[Any]:
    from kvspec.impl.recurrent import RecurrentCache

    return [c for c in caches if isinstance(c, RecurrentCache)]


def _recorder(model: Any, on: bool) -> None:
    """The step recorder on or off on this model instance (class swaps,
    outside every timed span)."""
    from kvspec.impl.recurrent import record_steps, unrecord_steps

    (record_steps if on else unrecord_steps)(model)


def _live(caches: list[Any]) -> list[Any]:
    """The recurrent layers' live arrays (a decoder needs them for the next
    step: evaluated with the logits)."""
    return [a for c in _recurrent(caches) for a in c.cache if a is not None]


def filled_caches(model: Any, family: str, size: str, context: int, depth: int, dtype: Any) -> list[Any]:
    """Our caches (``kvspec.impl.models.make_prompt_cache``, recurrent depth
    ``depth``), the attention layers holding ``context`` rows of random keys
    and values, then a prompt of ``PROMPT`` tokens through the model (the
    recurrent layers' state; recorder on iff ``depth > 0``)."""
    from kvspec.impl.models import make_prompt_cache

    caches = make_prompt_cache(model, num_draft_tokens=depth)
    heads, dim = _kv_shape(family, size)
    kv = mx.random.normal((1, heads, context, dim), key=mx.random.key(context)).astype(dtype)
    rec = {id(c) for c in _recurrent(caches)}
    for c in caches:
        if id(c) not in rec:
            mx.eval(c.update_and_fetch(kv, kv))
    _recorder(model, depth > 0)
    mx.eval(model(_tokens(PROMPT, model.args.vocab_size)[None], cache=caches), _live(caches))
    return caches


def _reset(caches: list[Any], snaps: list[Any], n: int) -> None:
    """Take back the ``n`` tokens a tick consumed: each recurrent layer's
    snapshot restored, each attention layer trimmed by ``n`` (logical)."""
    for c, s in zip(caches, snaps, strict=True):
        if s is not None:
            c.restore(s)
        elif n:
            c.trim(n)


def _snaps(caches: list[Any]) -> list[Any]:
    rec = set(map(id, _recurrent(caches)))
    return [c.snapshot() if id(c) in rec else None for c in caches]


def verify_tick(model: Any, caches: list[Any], block: mx.array, recorder: bool) -> Callable[[], float]:
    """Each call times one verify block of ``len(block)`` tokens (one model
    call; logits and recurrent arrays evaluated), then puts the caches back."""
    def tick() -> float:
        _recorder(model, recorder)
        snaps = _snaps(caches)
        start = time.perf_counter()
        mx.eval(model(block[None], cache=caches), _live(caches))
        seconds = time.perf_counter() - start
        _reset(caches, snaps, block.size)
        return seconds

    return tick


def plain_tick(model: Any, caches: list[Any], block: mx.array) -> Callable[[], float]:
    """Each call times plain decoding of the block's tokens, one model call
    each, the logits evaluated after each (recorder off)."""
    def tick() -> float:
        _recorder(model, False)
        snaps = _snaps(caches)
        start = time.perf_counter()
        for t in range(block.size):
            mx.eval(model(block[None, t:t + 1], cache=caches))
        mx.eval(_live(caches))
        seconds = time.perf_counter() - start
        _reset(caches, snaps, block.size)
        return seconds

    return tick


def rollback_tick(model: Any, caches: list[Any], block: mx.array, n: int) -> Callable[[], float]:
    """Each call runs a verify block (untimed, recorder on), then times
    ``kvspec.impl.models.trim_prompt_cache(caches, n)``; raises RuntimeError when
    the caches do not trim ``n`` tokens (a refused rollback is a failure of
    the bench's set-up, not a figure)."""
    from kvspec.impl.models import trim_prompt_cache

    def tick() -> float:
        _recorder(model, True)
        snaps = _snaps(caches)
        mx.eval(model(block[None], cache=caches), _live(caches))
        start = time.perf_counter()
        got = trim_prompt_cache(caches, n)
        seconds = time.perf_counter() - start
        if got != n:
            raise RuntimeError(f"bench --recurrent: trim_prompt_cache(caches, {n}) trimmed {got} tokens after a "
                               f"verify block of {block.size}: the caches refused the rollback")
        _reset(caches, snaps, block.size - n)
        return seconds

    return tick


def summary(values: list[float]) -> dict[str, Any]:
    """``{"median", "ci_low", "ci_high", "runs"}``: the median and its
    distribution-free 95 % interval (None with fewer than 6 values)."""
    from kvspec.fuzz.commands.bench import median_interval

    ci = median_interval(values)
    return {"median": statistics.median(values), "ci_low": ci[0] if ci else None, "ci_high": ci[1] if ci else None,
            "runs": len(values)}


def round_rows(model: Any, family: str, size: str, context: int, ks: tuple[int, ...], rounds: int, dtype: Any,
               warmup: int = 2) -> dict[str, Any]:
    """The per-round rows of one model at one context:
    ``{str(k): {"verify_recorder_on_ms", "verify_recorder_off_ms",
    "plain_decode_ms": summary, "rollback_ms": {str(n): summary},
    "on_over_off", "on_over_plain": summary of the rounds' ratios}}``."""
    flat = filled_caches(model, family, size, context, 0, dtype)
    ours = {k: filled_caches(model, family, size, context, k, dtype) for k in ks}
    names: list[tuple[int, str]] = []
    ticks: list[Callable[[], float]] = []
    for k in ks:
        block = _tokens(k + 1, model.args.vocab_size, salt=1)
        for name, tick in (("verify_recorder_on_ms", verify_tick(model, ours[k], block, True)),
                           ("verify_recorder_off_ms", verify_tick(model, flat, block, False)),
                           ("plain_decode_ms", plain_tick(model, flat, block)),
                           *((f"rollback {n}", rollback_tick(model, ours[k], block, n)) for n in range(1, k + 1))):
            names.append((k, name))
            ticks.append(tick)
    times = round_robin(ticks, rounds, warmup)
    _recorder(model, False)
    ms = {key: [s * 1e3 for s in t] for key, t in zip(names, times, strict=True)}
    out: dict[str, Any] = {}
    for k in ks:
        on, off, plain = (ms[(k, n)] for n in ("verify_recorder_on_ms", "verify_recorder_off_ms", "plain_decode_ms"))
        out[str(k)] = {
            "verify_recorder_on_ms": summary(on), "verify_recorder_off_ms": summary(off),
            "plain_decode_ms": summary(plain),
            "rollback_ms": {str(n): summary(ms[(k, f"rollback {n}")]) for n in range(1, k + 1)},
            "on_over_off": summary([a / b for a, b in zip(on, off, strict=True)]),
            "on_over_plain": summary([a / b for a, b in zip(on, plain, strict=True)]),
        }
    return out


def _bytes(caches: list[Any]) -> int:
    return sum(int(c.nbytes) for c in caches)


def memory_rows(model: Any, family: str, size: str, context: int, k: int, dtype: Any) -> dict[str, Any]:
    """The checkpoint ring's bytes after a verify block of ``k + 1`` tokens
    on caches of depth ``k`` (coverage k): per recurrent layer its live
    bytes and the bytes of the ring's arrays that are not live arrays
    (``nbytes``, each array counted once), their totals, and
    ``measured_checkpoint_bytes``: the drop of ``mx.get_active_memory()``
    when every ring is cleared (``meta_state`` reassigned: coverage 0)."""
    caches = filled_caches(model, family, size, context, k, dtype)
    block = _tokens(k + 1, model.args.vocab_size, salt=1)
    mx.eval(model(block[None], cache=caches), _live(caches))
    layers = []
    rec = {id(c) for c in _recurrent(caches)}
    for i, c in enumerate(caches):
        if id(c) not in rec:
            continue
        live = {id(a) for a in c.cache if a is not None}
        seen: dict[int, int] = {}
        for slot in c.snapshot().ring:
            for a in slot or ():
                if a is not None and id(a) not in live:
                    seen[id(a)] = int(a.nbytes)
        layers.append({"layer": i, "live_bytes": int(c.nbytes), "checkpoint_bytes": sum(seen.values()),
                       "coverage": c.trimmable_rows()})
    gc.collect()
    before = mx.get_active_memory()
    for c in _recurrent(caches):
        c.meta_state = c.meta_state  # a load's reset: the ring cleared, the live arrays kept
    gc.collect()
    measured = before - mx.get_active_memory()
    _recorder(model, False)
    return {"k": k, "per_layer": layers, "checkpoint_bytes_total": sum(x["checkpoint_bytes"] for x in layers),
            "live_recurrent_bytes_total": sum(x["live_bytes"] for x in layers),
            "measured_checkpoint_bytes": int(measured), "cache_list_bytes": _bytes(caches)}


# -- end to end --------------------------------------------------------------------
def e2e_rows(family: str, size: str, contexts: list[int], tokens: int, repeats: int, dtype: Any,
             k: int = E2E_K, warmup: int = 4, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Tokens/s of each config at each context, in ``repeats`` blocks of
    ``tokens`` tokens the configs decode in turn (round ``r`` in the order
    ``bench_decoder.rotated`` gives), every config's generator and caches
    kept alive: ``{"rows": {config: {context: median}}, "samples": {config:
    {context: [tps]}}, "acceptance": {config: {context: share}}}``. The
    configs: greedy ``generate_step`` with mlx-lm's caches (recorder off)
    and with ours (depth 0, recorder off); ``speculative_generate_step``
    with ours (depth ``k``, recorder on) and the draft the target itself or
    a random model of the same shape (seed 1)."""
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.models import cache as mc

    from kvspec.fuzz.commands import bench_decoder as bd
    from kvspec.impl.models import make_prompt_cache

    target = build_model(family, size, 0, dtype)
    other = build_model(family, size, 1, dtype)
    vocab = target.args.vocab_size

    def greedy(caches: Callable[[], list[Any]]) -> Callable[[mx.array, int], Any]:
        return lambda prompt, n: generate_step(prompt, target, max_tokens=n, prompt_cache=caches())

    def speculative(draft: Any) -> Callable[[mx.array, int], Any]:
        return lambda prompt, n: speculative_generate_step(
            prompt, target, draft, num_draft_tokens=k, max_tokens=n,
            prompt_cache=make_prompt_cache(target, num_draft_tokens=k) + make_prompt_cache(draft, num_draft_tokens=k))

    configs: dict[str, tuple[Callable[[mx.array, int], Any], bool]] = {
        BASE: (greedy(lambda: mc.make_prompt_cache(target)), False),
        "ours, greedy": (greedy(lambda: make_prompt_cache(target)), False),
        "ours, speculative, draft = target": (speculative(target), True),
        "ours, speculative, random draft": (speculative(other), True),
    }
    names = list(configs)
    rows: dict[str, dict[str, float]] = {n: {} for n in names}
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    acceptance: dict[str, dict[str, float]] = {n: {} for n in names}
    for context in contexts:
        say(f"bench --recurrent: end to end, {family} ({size}) at context {context} ...")
        prompt = _tokens(context, vocab)
        gens = {}
        for name in names:
            make, rec = configs[name]
            _recorder(target, rec)
            _recorder(other, rec)
            gens[name] = make(prompt, warmup + tokens * repeats + 1)
            for _ in range(warmup + 1):
                next(gens[name])
            bd._sync()
        per = {n: [] for n in names}
        accepted = dict.fromkeys(names, 0)
        for r in range(repeats):
            for name in bd.rotated(names, r):
                _recorder(target, configs[name][1])  # outside the timed block; the random draft's stays on
                _recorder(other, configs[name][1])
                gen = gens[name]
                start = time.perf_counter()
                for _ in range(tokens):
                    item = next(gen)
                    if configs[name][1] and item[2]:
                        accepted[name] += 1
                bd._sync()
                per[name].append(tokens / (time.perf_counter() - start))
        for name in reversed(names):
            gens[name].close()
        for name in names:
            rows[name][str(context)] = statistics.median(per[name])
            samples[name][str(context)] = per[name]
            acceptance[name][str(context)] = accepted[name] / (tokens * repeats)
    _recorder(target, False)
    return {"rows": rows, "samples": samples, "acceptance": acceptance}


# -- the run -----------------------------------------------------------------------
def default_size() -> str:
    from kvspec.fuzz.device import current

    return "full" if current() == "gpu" else "small"


def run(contexts: list[int], size: str | None = None, rounds: int | None = None, e2e_contexts: list[int] | None = None,
        tokens: int = 16, repeats: int = 12, families: tuple[str, ...] = ("qwen3_next", "lfm2"),
        as_json: bool = False, record: str | None = None, say: Callable[[str], None] | None = None) -> int:
    """Every row (module docstring) for each family; printed as tables or
    one JSON object, and with ``record`` written under that folder as
    ``<date>-<device>-recurrent-rollback.json`` and ``.md``. Exit 0."""
    import json
    from datetime import date

    from rich.console import Console

    from kvspec.fuzz.device import current

    err = Console(stderr=True, highlight=False, emoji=False)
    say = say or (lambda m: err.print(m, markup=False))
    gpu = current() == "gpu"
    size = size or default_size()
    rounds = rounds or (20 if gpu else 10)
    dtype = mx.bfloat16 if gpu else mx.float32
    e2e_contexts = e2e_contexts or ([1024] if size != "tiny" else [16])
    doc: dict[str, Any] = {"bench": "recurrent", "date": date.today().isoformat(), "device": current(),
                           "machine": platform.machine(), "mlx": mx.__version__, "size": size,
                           "dtype": "bfloat16" if dtype == mx.bfloat16 else "float32", "contexts": contexts,
                           "ks": list(KS), "rounds": rounds, "families": {}}
    try:
        import mlx_lm

        doc["mlx_lm"] = mlx_lm.__version__
    except ImportError:  # pragma: no cover - the e2e extra is installed by make
        doc["mlx_lm"] = None
    if gpu and hasattr(mx, "device_info"):
        doc["gpu"] = mx.device_info().get("device_name")
    for family in families:
        model = build_model(family, size, 0, dtype)
        caches = filled_caches(model, family, size, 1, 0, dtype)
        fam: dict[str, Any] = {"shape": SHAPES[family][size], "layers": len(caches),
                               "recurrent_layers": len(_recurrent(caches)), "rows": {}}
        for context in contexts:
            say(f"bench --recurrent: {family} ({size}, {doc['dtype']}) per round at context {context} ...")
            fam["rows"][str(context)] = round_rows(model, family, size, context, KS, rounds, dtype)
        mem = {str(k): memory_rows(model, family, size, contexts[0], k, dtype) for k in KS}
        for k in KS:
            mem[str(k)]["cache_list_bytes_by_context"] = {
                str(n): _bytes(filled_caches(model, family, size, n, k, dtype)) for n in contexts}
        _recorder(model, False)
        fam["memory"] = mem
        doc["families"][family] = fam
        del model, caches
        gc.collect()
    from kvspec.fuzz.commands.bench import paired_table

    e2e = e2e_rows("qwen3_next", size, e2e_contexts, tokens, repeats, dtype, say=say)
    doc["e2e"] = {"family": "qwen3_next", "k": E2E_K, "tokens": tokens, "repeats": repeats,
                  "contexts": e2e_contexts, **e2e,
                  "paired": paired_table({"qwen3_next": e2e["samples"]}).get("qwen3_next", {})}
    if as_json:
        print(json.dumps(doc))
    else:
        Console(highlight=False, emoji=False, soft_wrap=True).print("\n".join(markdown(doc)), markup=False)
    if record:
        path = write_record(doc, record)
        say(f"bench: record written: {path}")
    return 0


def _cell(s: dict[str, Any], digits: int = 3, unit: str = "") -> str:
    """``1.234 [1.200, 1.300]``: a median and its 95 % interval (left out
    with fewer than 6 rounds)."""
    ci = f" [{s['ci_low']:.{digits}f}, {s['ci_high']:.{digits}f}]" if s.get("ci_low") is not None else ""
    return f"{s['median']:.{digits}f}{unit}{ci}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"


def markdown(doc: dict[str, Any]) -> list[str]:
    """The record's tables, as Markdown lines."""
    from kvspec.fuzz.commands.bench import _paired_cell

    lines = [f"# kvspec bench --recurrent, {doc['date']}", "",
             f"- device: {doc['device']}" + (f", {doc['gpu']}" if doc.get("gpu") else "")
             + f"; machine {doc['machine']}; MLX {doc['mlx']}, mlx-lm {doc.get('mlx_lm')}",
             f"- models: random weights, size `{doc['size']}`, {doc['dtype']}; {doc['rounds']} rounds per row", ""]
    for family, fam in doc["families"].items():
        shape = ", ".join(f"{k} {v}" for k, v in fam["shape"].items())
        lines += [(f"## {family}: one speculative round ({fam['recurrent_layers']} recurrent of {fam['layers']} "
                  "layers), ms"), "", f"Shape: {shape}.", "",
                  ("| context | k | verify, recorder on | verify, recorder off | plain decoding of k+1 | "
                  "on / off | on / plain | rollback n=1..k |"), "| --- |" + " --- |" * 7]
        for n, by_k in fam["rows"].items():
            for k, r in by_k.items():
                rb = " / ".join(f"{r['rollback_ms'][m]['median'] * 1e3:.1f} us" for m in r["rollback_ms"])
                lines.append(f"| {n} | {k} | {_cell(r['verify_recorder_on_ms'])} | {_cell(r['verify_recorder_off_ms'])} "
                             f"| {_cell(r['plain_decode_ms'])} | {_cell(r['on_over_off'], unit='x')} "
                             f"| {_cell(r['on_over_plain'], unit='x')} | {rb} |")
        lines += ["", f"### {family}: the checkpoint ring's memory (after a verify block: coverage k)", "",
                  "| k | ring, counted (all layers) | per layer | ring, measured (active memory) | "
                  "recurrent layers' own | cache list at " + " / ".join(map(str, doc["contexts"]))
                  + " |", "| --- |" + " --- |" * 5]
        for k, m in fam["memory"].items():
            per = ", ".join(_mib(x["checkpoint_bytes"]) for x in m["per_layer"])
            lines.append(f"| {k} | {_mib(m['checkpoint_bytes_total'])} | {per} | {_mib(m['measured_checkpoint_bytes'])} "
                         f"| {_mib(m['live_recurrent_bytes_total'])} | "
                         + " / ".join(_mib(b) for b in m["cache_list_bytes_by_context"].values()) + " |")
        lines.append("")
    lines += [("Each ms cell: the median of the rounds, its distribution-free 95 % confidence interval in square "
              "brackets (none with fewer than 6 rounds); each ratio: the median of the rounds' ratios (every row of "
              "a context timed in one round-robin), with its interval. Rollback: host time of "
              "`kvspec.impl.models.trim_prompt_cache` (no arrays built)."), ""]
    e = doc["e2e"]
    ctxs = [str(n) for n in e["contexts"]]
    lines += [f"## End to end, {e['family']} (k = {e['k']}): tokens/s", "", "| config | " + " | ".join(ctxs)
              + " | draft tokens accepted |", "| --- |" + " --- |" * (len(ctxs) + 1)]
    for name, by in e["rows"].items():
        acc = " / ".join(f"{e['acceptance'][name][n]:.2f}" for n in ctxs) if "speculative" in name else "-"
        lines.append(f"| {name} | " + " | ".join(f"{by[n]:.1f}" for n in ctxs) + f" | {acc} |")
    lines += ["", "### Against greedy decoding with mlx-lm's caches in the same round", "",
              "| config | " + " | ".join(ctxs) + " |", "| --- |" + " --- |" * len(ctxs)]
    for name, by in e["paired"].items():
        lines.append(f"| {name} | " + " | ".join(_paired_cell(by.get(n)) for n in ctxs) + " |")
    lines += ["", (f"Each tokens/s cell: the median of {e['repeats']} blocks of {e['tokens']} tokens, the configs "
              "decoding their blocks in turn; each paired cell: the median of the block-by-block ratios to mlx-lm's "
              "greedy block of the same round, its 95 % interval, the range and in how many blocks the config was "
              "the faster. Speculative decoding here drafts with a model as large as the target, so it is slower "
              "than greedy by design: the rows measure what rollback costs, not a speed-up."), ""]
    return lines


def write_record(doc: dict[str, Any], folder: str) -> str:
    """``<folder>/<date>-<device>-recurrent-rollback.json`` and ``.md``.
    Returns the JSON path."""
    import json
    from pathlib import Path

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{doc['date']}-{doc['device']}-recurrent-rollback"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = markdown(doc)
    lines[1:1] = ["", f"Raw figures: `{stem.with_suffix('.json').name}`."]
    stem.with_suffix(".md").write_text("\n".join(lines))
    return str(stem.with_suffix(".json"))
