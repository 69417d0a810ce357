"""Scenario 10: the Turbo modes inside a real model."""

from __future__ import annotations

import numpy as np

from kvspec.fuzz.commands.e2e.checks import Deviation, Size, Tally, compare, records, require
from kvspec.fuzz.commands.e2e.models import (
    LATE_LAYER_SCALE,
    TURBO_E2E,
    Factories,
    build_caches,
    early_exit_draft,
    tiny_llama,
    token_ids,
    turbo_caches,
)
from kvspec.fuzz.commands.e2e.streams import greedy, speculative, teacher_forced


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
    greedy stream (teacher-forced) is reported per mode (not measured under
    ``checks.checks_only``: no check reads it)."""
    tally = Tally()
    drafted = accepted = 0
    devs = {mode: Deviation() for mode in TURBO_E2E}
    delegated_max, delegated_prefix = 0.0, 1.0
    n = 2 * size.tokens
    measure = records()
    for seed in size.seeds:
        model = tiny_llama(seed, late_scale=LATE_LAYER_SCALE)
        draft = early_exit_draft(model)
        prompt = token_ids(seed, 12)
        if measure:  # the fp16 stream and its log-probabilities: what the deviations are measured against
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
            if measure:
                devs[mode].add(teacher_forced(model, turbo_caches(model, mode, factories), prompt, ref.tokens), ref_lp)
    require(accepted > 0 and accepted < drafted,
            f"speculation must both accept and reject drafts, got {accepted} accepted of {drafted}")
    tally.note(f"{accepted}/{drafted} drafts accepted; speculative = greedy bytes in turbo4asym, turbo4, turbo3asym")
    tally.note(f"turbo4delegated speculative vs greedy (reported): max |dlogp| {delegated_max:.3f} while the "
               f"tokens agree, shortest common prefix {delegated_prefix:.0%} of a stream")
    for mode, dev in devs.items():
        tally.note(f"{mode} vs fp16: {dev if measure else 'not measured (checks only)'}")
    return tally, accepted / max(drafted, 1)
