"""Scenarios 2 and 8: mlx-lm's speculative decoding, on dense caches and on wrapping rings."""

from __future__ import annotations

import warnings
from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.fuzz.commands.e2e import checks
from kvspec.fuzz.commands.e2e.checks import (
    SHORT,
    VERIFY,
    Size,
    Stream,
    Tally,
    _max_logprob_diff,
    compare,
    min_distinct,
    require,
)
from kvspec.fuzz.commands.e2e.models import (
    LATE_LAYER_SCALE,
    Factories,
    _rotating,
    build_caches,
    early_exit_draft,
    mlx_lm_caches,
    speculative_gemma3,
    tiny_llama,
    token_ids,
)
from kvspec.fuzz.commands.e2e.streams import greedy, speculative
from kvspec.impl.models import make_prompt_cache
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec.errors import RollbackWarning


def scenario_speculative(size: Size, factories: Factories = None) -> tuple[Tally, float | None]:
    """mlx-lm's speculative decoding with a one-layer early-exit draft gives
    exactly plain greedy decoding's tokens and log-probability bytes with the
    same cache mode (fp16, int8) and in-place setting; in-place on and off
    agree. Both accepts and rejects (trims) must happen."""
    tally = Tally()
    drafted = accepted = 0
    n = 2 * size.tokens
    gpu = checks.on_gpu()
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
        self.refused = 0  # rollbacks of rows the ring holds that it refused (trim returned 0)
        # is_trimmable() answered False: mlx-lm's trim_prompt_cache then skips
        # the rollback in every layer without calling trim (counted apart:
        # the refusal the trim count alone never saw)
        self.untrimmable = 0
        trim, is_trimmable = ring.trim, ring.is_trimmable

        def asked() -> bool:
            ok = is_trimmable()
            self.untrimmable += not ok
            return ok

        ring.is_trimmable = asked  # type: ignore[method-assign]

        def counted(k: int) -> int:
            wrapped = ring.wrapped
            got = trim(k)
            self.rollbacks_after_wrap += bool(got) and wrapped
            self.refused += 0 < k <= ring.offset and got == 0
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
    run for the record (not under ``checks.checks_only``: no check reads
    it): its trim is refused after the wrap and the stream drifts
    (docs/mlx-lm.md)."""
    from mlx_lm.generate import speculative_generate_step

    tally = Tally()
    W, U = SPEC_WINDOW, UNDO_DEPTH
    n = 2 * size.tokens
    drafted = accepted = rollbacks = draft_refused = 0
    wraps: list[int] = []
    spec_diff = 0.0
    drift: list[str] = []
    for seed in size.seeds:
        model, draft = speculative_gemma3(seed, W)
        prompt = token_ids(seed, 12)
        label = f"seed {seed}, W={W}, U={U}"
        plain = greedy(model, build_caches(model, "fp16", 4, True), prompt, n)
        # sized by num_draft_tokens (make_prompt_cache): every ring's undo log holds U rows
        caches = (build_caches(model, "fp16", 4, True, factories, num_draft_tokens=U)
                  + build_caches(draft, "fp16", 4, True, factories, num_draft_tokens=U))
        require(all(r.undo == U for r in _rotating(caches)), f"{label}: num_draft_tokens={U} did not size the undo logs")
        main_rings = _rotating(caches[: len(model.layers)])
        require(len(main_rings) == 2 and len(_rotating(caches)) == 4, f"{label}: expected 2 rings per model")
        main = _Recorder(model, main_rings[0])
        drafter = _Recorder(draft, _rotating(caches[len(model.layers):])[0])
        got = Stream()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RollbackWarning)
            for tok, logprobs, from_draft in speculative_generate_step(
                prompt, main, drafter, num_draft_tokens=U, max_tokens=n, prompt_cache=caches,
            ):
                got.tokens.append(int(tok))
                got.logprobs.append(np.array(logprobs).tobytes())
                accepted += bool(from_draft)
        loud = [w for w in caught if issubclass(w.category, RollbackWarning)]
        require(main.refused == 0 and main.untrimmable == 0,
                f"{label}: the main model's ring refused {main.refused} rollbacks and answered is_trimmable() "
                f"False {main.untrimmable} times")
        refusals = drafter.refused + drafter.untrimmable
        require(bool(loud) == bool(refusals),
                f"{label}: {drafter.refused} refused draft rollbacks and {drafter.untrimmable} is_trimmable() False, "
                f"{len(loud)} RollbackWarnings")
        draft_refused += refusals
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
        if checks.records():
            lm = mlx_lm_caches(model) + mlx_lm_caches(draft)
            lm_tokens = [int(t) for t, _, _ in speculative_generate_step(
                prompt, model, draft, num_draft_tokens=U, max_tokens=n, prompt_cache=lm)]
            first = next((i for i, (a, b) in enumerate(zip(lm_tokens, plain.tokens)) if a != b), None)
            drift.append("none" if first is None else f"step {first}")
        else:
            drift.append("not run (checks only)")
    require(min(wraps) >= MIN_WRAPS.get(size, 20), f"the main rings wrapped {wraps} times (need {MIN_WRAPS.get(size, 20)} each)")
    need = MIN_ROLLBACKS.get(size, 100)
    require(rollbacks >= need, f"{rollbacks} rollbacks after a wrap (need {need})")
    require(0 < accepted < drafted, f"speculation must both accept and reject drafts, got {accepted} of {drafted}")
    tally.note(f"{accepted}/{drafted} drafts accepted; rings wrapped {min(wraps)}..{max(wraps)} times per seed; "
               f"{rollbacks} rollbacks after a wrap (main model); tokens = greedy; every call of both models = a run "
               f"that never had the rolled-back rows (logit bytes); max |log-prob - greedy| {spec_diff:.3g} (chunking, not rollback); "
               f"mlx-lm's own caches leave greedy at {', '.join(drift)}; main rings refused no rollback; "
               f"draft rings refused {draft_refused} (after an all-accepted round, warned: docs/mlx-lm.md)")
    return tally, accepted / max(drafted, 1)


#: the fewest wraps per seed and rollbacks after a wrap the scenario needs, by size
MIN_WRAPS = {SHORT: 8, VERIFY: 8}


MIN_ROLLBACKS = {SHORT: 20, VERIFY: 20}


#: the short undo depths of the speculative_drift scenario (below UNDO_DEPTH,
#: the draft length): 0 (mlx-lm's loop sees is_trimmable() False) and 1 (it
#: asks trim(k) of a ring that can roll back 1 row)
SHORT_UNDO = (0, 1)


#: the modes of its prefill-wrap runs (default caches, a prompt longer than
#: the window): every sliding-window layer is a ring in each
PREFILL_WRAP_MODES = ("fp16", "int8", "turbo4asym", "turbo4delegated")


class _RollbackWatch:
    """The main model of a speculative run, watched at each verification
    call (every call after the prefill): mlx-lm's loop has then yielded
    ``yielded`` tokens, so with every earlier rollback honoured the caches
    hold ``prompt_len - 1 + yielded`` rows; more means a rollback was
    refused. ``first_refused`` is ``(call, warned)`` for the first such
    call: ``warned`` whether a main-model ring had issued its
    RollbackWarning by then (at or before that refused rollback)."""

    def __init__(self, model: Any, caches: list[Any], prompt_len: int):
        self.model, self.prompt_len, self.yielded, self.calls = model, prompt_len, 0, 0
        self.rings = _rotating(caches)
        self.layer = next(c for c in caches if not isinstance(c, RotatingKVCache))  # a global layer: its offset
        self.first_refused: tuple[int, bool] | None = None

    @property
    def layers(self) -> Any:
        return self.model.layers

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        if self.calls and self.first_refused is None and self.layer.offset != self.prompt_len - 1 + self.yielded:
            self.first_refused = (self.calls, any(r.rollback_warned for r in self.rings))
        self.calls += 1
        return self.model(inputs, cache=cache)


def _prefill_wrap_run(seed: int, mode: str, n: int, factories: Factories) -> tuple[str, list[int], int]:
    """One speculative run on caches built as a user builds them
    (``make_prompt_cache(model, mode)``: no undo log) after a prompt longer
    than the window, so the rings go past it in the prefill, before any
    trim. Requires that a main-model rollback is refused and that a main
    ring warned at or before the first one, at most one warning per ring.
    Returns the label, the tokens and the warnings."""
    from mlx_lm.generate import speculative_generate_step

    W, U = SPEC_WINDOW, UNDO_DEPTH
    model, draft = speculative_gemma3(seed, W)
    prompt = token_ids(seed, 2 * W)
    label = f"seed {seed}, {mode}, W={W}, prompt {2 * W} tokens, default caches"
    ring = {"rotating": factories["rotating"]} if factories and "rotating" in factories else None
    main_caches = make_prompt_cache(model, mode=mode, step=4, classes=ring)
    caches = main_caches + make_prompt_cache(draft, mode=mode, step=4, classes=ring)
    watch = _RollbackWatch(model, main_caches, len(prompt))
    tokens: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RollbackWarning)
        for tok, _, _ in speculative_generate_step(prompt, watch, draft, num_draft_tokens=U, max_tokens=n,
                                                   prompt_cache=caches):
            tokens.append(int(tok))
            watch.yielded += 1
    loud = [w for w in caught if issubclass(w.category, RollbackWarning)]
    require(watch.first_refused is not None, f"{label}: no main-model rollback was refused (nothing to check)")
    call, warned = watch.first_refused  # type: ignore[misc]
    require(warned, f"{label}: the main model's first refused rollback (before call {call}) came silently "
                    f"(no RollbackWarning from its rings; {len(loud)} in all)")
    require(len(loud) <= len(_rotating(caches)), f"{label}: {len(loud)} warnings for {len(_rotating(caches))} rings "
                                                 "(once per cache)")
    require(all("num_draft_tokens" in str(w.message) for w in loud),
            f"{label}: the warning does not say how to size the undo log: {loud[:1]}")
    return label, tokens, len(loud)


def scenario_speculative_drift(size: Size, factories: Factories = None) -> tuple[Tally, float | None]:
    """The speculative_window setting (gemma3, rings of window 6, drafts of
    ``UNDO_DEPTH`` tokens) with undo logs shorter than the draft
    (``SHORT_UNDO``): once a ring has wrapped, a rejected draft asks a
    rollback the ring cannot honour, and mlx-lm's loop goes on. Checks:
    that is loud: a ``RollbackWarning`` names the ring and
    ``num_draft_tokens``, at most one per ring (once per cache), in every
    run that wrapped; and the same model's caches built with
    ``make_prompt_cache(..., num_draft_tokens=UNDO_DEPTH)`` give no warning
    and greedy's tokens (scenario 8 checks those bytes).

    And the ordinary case: caches built with no undo log
    (``make_prompt_cache(model, mode)``) in each of ``PREFILL_WRAP_MODES``
    after a prompt longer than the window, so the rings go past it in the
    prefill, before any trim: the main model's first refused rollback is
    loud, a main ring warned at or before it (:func:`_prefill_wrap_run`).
    (The runs above, with a 3-token prompt, trim before the rings wrap:
    they passed while a ring wrapped by its prefill never warned.)"""
    from mlx_lm.generate import speculative_generate_step

    tally = Tally()
    W, U = SPEC_WINDOW, UNDO_DEPTH
    n = size.tokens
    warned_runs, rings_warned = 0, 0
    for seed in size.seeds[:2]:  # two seeds: each run checks the warning, not a stream
        model, draft = speculative_gemma3(seed, W)
        prompt = token_ids(seed, 3)  # rounds (and rollbacks) before the rings wrap
        for undo in SHORT_UNDO:
            label = f"seed {seed}, W={W}, undo={undo} < num_draft_tokens={U}"
            caches = build_caches(model, "fp16", 4, True, factories, undo) + build_caches(draft, "fp16", 4, True,
                                                                                        factories, undo)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", RollbackWarning)
                tokens = [int(t) for t, _, _ in speculative_generate_step(
                    prompt, model, draft, num_draft_tokens=U, max_tokens=n, prompt_cache=caches)]
            loud = [w for w in caught if issubclass(w.category, RollbackWarning)]
            rings = _rotating(caches)
            require(all(r.wrapped for r in rings), f"{label}: the rings did not wrap")
            require(loud, f"{label}: rollbacks were refused after the wrap, silently (no RollbackWarning)")
            require(len(loud) <= len(rings), f"{label}: {len(loud)} warnings for {len(rings)} rings (once per cache)")
            require(all("num_draft_tokens" in str(w.message) for w in loud),
                    f"{label}: the warning does not say how to size the undo log: {loud[:1]}")
            require(len(set(tokens)) >= min_distinct(n), f"{label}: stream collapsed")
            tally.tokens.extend(tokens)
            warned_runs += 1
            rings_warned += len(loud)
    wrap_runs, wrap_warnings = 0, 0
    for seed in size.seeds[:1]:
        for mode in PREFILL_WRAP_MODES:
            _, tokens, warned = _prefill_wrap_run(seed, mode, n, factories)
            require(len(set(tokens)) >= min_distinct(n), f"seed {seed}, {mode}: stream collapsed")
            tally.tokens.extend(tokens)
            wrap_runs, wrap_warnings = wrap_runs + 1, wrap_warnings + warned
    tally.note(f"undo {list(SHORT_UNDO)} < num_draft_tokens {U}: every run warned (RollbackWarning, "
               f"{rings_warned} warnings over {warned_runs} runs, at most one per ring); "
               f"rings past the window after a {2 * W}-token prompt, default caches ({', '.join(PREFILL_WRAP_MODES)}): "
               f"the first refused main rollback warned in each of {wrap_runs} runs ({wrap_warnings} warnings); "
               f"num_draft_tokens={U} sizes the undo logs and stays silent (scenario 8)")
    return tally, None
