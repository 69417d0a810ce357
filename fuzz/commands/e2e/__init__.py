"""End-to-end scenarios: kvspec caches inside real mlx-lm models.

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
10. ``turbo``: each Turbo mode (``kvspec.impl.turbo``): speculative decoding equals
    greedy decoding under the same Turbo cache, byte for byte; the
    log-probabilities' deviation from the fp16 cache is reported per mode.
11. ``speculative_drift``: speculative decoding on rings whose undo log is
    shorter than ``num_draft_tokens``, and on default caches (no undo log)
    whose rings go past the window in the prefill: every refused rollback
    is loud (a ``RollbackWarning``, once per ring; the main model's rings
    warn at or before its first refused rollback).
12. ``quantized_models``: gemma3 in Int8 and every Turbo mode (global layer
    quantized, sliding-window layers fp16 rings); mlx-lm's ``kv_bits`` from
    the first token.
13. ``batch``: mlx-lm's ``batch_generate`` and ``BatchGenerator`` with our
    caches (batch 3, ragged prompts and histories, a ring wrapping in one
    sequence only, a sequence filtered out and one added mid-stream) =
    mlx-lm's caches, byte for byte.
14. ``hybrid_speculative``: hybrid models (qwen3_next, nemotron_h, lfm2,
    recurrent_gemma; recurrent layers on ``RecurrentCache``): speculative
    decoding, k = 1..4, = greedy decoding; recurrent states after each run =
    a one-token-at-a-time run, byte for byte; rollbacks of every length.
15. ``hybrid_prompt_reuse``: trims of 1..depth tokens = runs that never had
    them (states, next turn's bytes); a trim beyond the depth refused loudly.
16. ``hybrid_mlx_lm``: mlx-lm's own caches on the same calls, observed:
    ValueError, a silent 0, and drift when a rollback is forced.

Random-weight models collapse under greedy decoding (a default-initialised
2-layer llama repeats one token), so every weight is scaled by
``WEIGHT_SCALE`` (the streams become chaotic: 45 to 55 distinct tokens in 60)
and every compared stream must reach ``len // 3`` distinct tokens.

The injected bugs of ``kvspec.fuzz.bugs`` plug in through ``factories`` (cache kind
-> class), as in the rest of ``fuzz``: ``steady_state_inplace`` fails
scenario 4, ``inplace_after_trim`` and ``inplace_after_restore`` fail
scenario 3 (``kvspec e2e --bug NAME``).

The package, by what a reader looks for:

- ``models``: the model builders (``tiny_llama``, ``tiny_gemma3``, the
  early-exit drafts) and the cache lists they decode with;
- ``checks``: the comparison machinery (``Stream``, ``compare``, ``Tally``,
  ``Divergence``, the sizes);
- ``streams``: decoding through mlx-lm's loops (``greedy``, ``interleaved``,
  ``speculative``, ``teacher_forced``);
- one module per scenario family: ``greedy`` (1, 9), ``speculative`` (2, 8, 11),
  ``snapshots`` (3, 6, 7), ``windows`` (4, 5), ``turbo`` (10),
  ``quantized`` (12), ``batch`` (13), ``hybrid`` (14, 15, 16);
- ``registry``: ``SCENARIOS`` by name, ``run_scenario``, ``run_all``;
- ``command``: ``kvspec e2e``.
"""

from __future__ import annotations

from kvspec.fuzz.commands.e2e.checks import (
    DEFAULT,
    LONG,
    SHORT,
    VERIFY,
    Divergence,
    Size,
    Stream,
    Tally,
    compare,
    on_gpu,
    require,
)
from kvspec.fuzz.commands.e2e.command import main
from kvspec.fuzz.commands.e2e.models import (
    build_caches,
    early_exit_draft,
    mlx_lm_caches,
    speculative_gemma3,
    tiny_gemma3,
    tiny_llama,
    token_ids,
)
from kvspec.fuzz.commands.e2e.registry import (
    SCENARIOS,
    Scenario,
    ScenarioResult,
    by_name,
    gpu_skipped,
    run_all,
    run_scenario,
)
from kvspec.fuzz.commands.e2e.streams import greedy, interleaved, speculative, teacher_forced

__all__ = [
    "DEFAULT", "LONG", "SCENARIOS", "SHORT", "VERIFY", "Divergence", "Scenario", "ScenarioResult", "Size", "Stream", "Tally",
    "build_caches", "by_name", "compare", "early_exit_draft", "gpu_skipped", "greedy", "interleaved", "main",
    "mlx_lm_caches", "on_gpu", "require", "run_all", "run_scenario", "speculative", "speculative_gemma3",
    "teacher_forced", "tiny_gemma3", "tiny_llama", "token_ids",
]
