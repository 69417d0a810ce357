"""Scenarios 14 to 16: hybrid models, recurrent layers beside attention.

Tiny random-weight qwen3_next, nemotron_h, lfm2 and recurrent_gemma
(``models.tiny_hybrid``) decode through mlx-lm's own loops with
``kvspec.impl.recurrent.RecurrentCache`` for the recurrent layers (built by
``kvspec.impl.models.make_prompt_cache``, which installs the step recorder):

14. ``hybrid_speculative``: ``speculative_generate_step`` with
    ``num_draft_tokens`` k = 1..4 gives the greedy tokens of
    ``generate_step`` with mlx-lm's caches, and the log-probability bytes of
    greedy decoding with our caches of the same depth; the draft is the
    target itself (every draft accepted) or a draft whose weights are mixed
    with another seed's (rollbacks of every length 1..k happen, counted);
    after each run every recurrent layer's conv window and recurrent state
    (bytes) and every layer's offset equal a run fed the same tokens one at
    a time (the verify block runs the recurrent layers one token at a time).
15. ``hybrid_prompt_reuse``: on caches of depth ``REUSE_DEPTH``, trim
    (``kvspec.impl.models.trim_prompt_cache``) n = 1..depth tokens off a prompt
    prefilled in one call, and off a conversation between its turns: the
    states equal a run that never had the trimmed tokens (bytes), and so do
    the next turn's tokens and log-probability bytes; a trim beyond the
    depth is refused loudly and changes nothing (StateError with
    ``strict``, RollbackWarning and 0 without).
16. ``hybrid_mlx_lm``: the same calls on mlx-lm's own caches, observed:
    ``speculative_generate_step`` raises ValueError (``ArraysCache`` is not
    trimmable), ``trim_prompt_cache`` returns 0 without a word, and a
    rollback forced on (an ``ArraysCache`` that claims to trim) leaves the
    recurrent state after the rejected tokens: the stream drifts from
    greedy decoding and from a fresh run.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.fuzz.commands.e2e.checks import (
    DEFAULT,
    SHORT,
    VERIFY,
    Divergence,
    Size,
    Stream,
    Tally,
    compare,
    logprob_bytes,
    min_distinct,
    require,
)
from kvspec.fuzz.commands.e2e.models import (
    HYBRID_FAMILIES,
    Factories,
    hybrid_draft,
    mlx_lm_caches,
    tiny_hybrid,
    token_ids,
    twin,
)
from kvspec.fuzz.commands.e2e.streams import Speculation, _Logged, greedy
from kvspec.impl.models import make_prompt_cache, trim_prompt_cache
from kvspec.impl.recurrent import RecurrentCache
from kvspec.spec.errors import RollbackWarning, StateError

#: the draft lengths of scenario 14 (each run's caches have depth k)
DRAFT_LENGTHS = (1, 2, 3, 4)


#: the draft lengths at which scenario 14 also runs draft = target, by size
#: (the short, verify and default sizes keep the shortest and the longest;
#: the long size runs every k)
SELF_DRAFT_LENGTHS = {size: (DRAFT_LENGTHS[0], DRAFT_LENGTHS[-1]) for size in (SHORT, VERIFY, DEFAULT)}


#: the tokens of each speculative run of scenario 14, by size (the size's
#: ``tokens`` otherwise): 32 runs every draft length through about 15
#: rounds; more seeds, not longer runs, widen the default size
SPEC_TOKENS = {SHORT: 32, VERIFY: 32, DEFAULT: 32}


#: each family's draft mix (``models.hybrid_draft``): its draft agrees with
#: the target on about 60% of the tokens (measured teacher-forced over 160
#: tokens, seeds 0..3), so that rounds end after every number of accepted drafts
DRAFT_MIX = {"qwen3_next": 0.02, "nemotron_h": 0.02, "lfm2": 0.05, "recurrent_gemma": 0.04}


#: the families with a sliding-window ring: after the ring wraps, a verify
#: block reads its keys in chronological order and a one-token step in
#: physical order, so float sums round differently (docs/mlx-lm.md, scenario
#: 8): their speculative log-probabilities are compared by token, and the
#: largest deviation is reported
RING_FAMILIES = ("recurrent_gemma",)


#: the prompt length (11 tokens prefill, so a depth-k prefill call is a
#: block of 11 - k tokens and k one-token calls)
PROMPT = 12


#: the seeds (of the size's) scenario 16 observes mlx-lm's caches on, per family
MLX_LM_SEEDS = 1


#: the caches' depth in scenario 15, and the tokens generated before the trim
REUSE_DEPTH = 4


def turn_tokens(size: Size) -> int:
    """Tokens generated per turn in scenarios 15 and 16."""
    return max(8, size.tokens // 4)


def _draft_seed(seed: int) -> int:
    return seed + 1000


def _bytes(a: mx.array) -> bytes:
    """An array's bytes (bfloat16 as float32: exact)."""
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a).tobytes()


def _arrays_bytes(c: Any) -> bytes:
    """A recurrent layer's arrays (conv window, recurrent state), as bytes
    (bfloat16 as float32: exact)."""
    return b"".join(_bytes(a) for a in c.cache if a is not None)


def recurrent_states(caches: list[Any]) -> list[tuple[int, int, bytes]]:
    """(layer, offset, arrays' bytes) of every recurrent layer of a cache list."""
    return [(i, c.offset, _arrays_bytes(c)) for i, c in enumerate(caches) if isinstance(c, RecurrentCache)]


def _offsets(caches: list[Any]) -> list[int]:
    return [int(c.offset) for c in caches if hasattr(c, "offset")]


def teacher_run(model: Any, caches: list[Any], prompt: mx.array, tokens: list[int]) -> list[Any]:
    """Feed ``prompt`` as mlx-lm's loops prefill it (``prompt[:-1]`` in one
    call), then its last token and each of ``tokens`` one at a time: the
    calls plain greedy decoding makes. Returns ``caches``."""
    if prompt.size > 1:
        model(prompt[:-1][None], cache=caches)
    for t in [int(prompt[-1]), *tokens]:
        model(mx.array([[t]], dtype=mx.uint32), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


class States(Mapping[int, list[tuple[int, int, bytes]]]):
    """The states a run passed through, by offset: ``states[t]`` is
    ``recurrent_states`` of the caches when they reached offset ``t``.
    Each entry is kept as the arrays' handles (a recurrent layer's arrays
    are values: every step hands the cache new ones, nothing writes into
    them) and turned into bytes when read, once: a check reads the offsets
    a run ended at, not every offset passed."""

    def __init__(self) -> None:
        self._held: dict[int, list[tuple[int, int, tuple[Any, ...]]]] = {}
        self._bytes: dict[int, list[tuple[int, int, bytes]]] = {}

    def hold(self, caches: list[Any]) -> None:
        """Keep the recurrent layers' arrays of ``caches`` at their offset."""
        held = [(i, c.offset, tuple(c.cache)) for i, c in enumerate(caches) if isinstance(c, RecurrentCache)]
        self._held[held[0][1]] = held
        self._bytes.pop(held[0][1], None)

    def __getitem__(self, t: int) -> list[tuple[int, int, bytes]]:
        got = self._bytes.get(t)
        if got is None:
            held = self._held[t]
            mx.eval([a for _, _, arrays in held for a in arrays if a is not None])
            got = self._bytes[t] = [(i, off, b"".join(_bytes(a) for a in arrays if a is not None))
                                    for i, off, arrays in held]
        return got

    def __iter__(self) -> Iterator[int]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)


class StateLog:
    """A model that, after each call, keeps every recurrent layer's arrays
    (``recurrent_states``) of ``caches`` by the offset they reached
    (``at``, a :class:`States`): the states a run passes through."""

    def __init__(self, model: Any, caches: list[Any]):
        self.model, self.caches, self.at = model, caches, States()

    @property
    def layers(self) -> Any:
        return self.model.layers

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        out = self.model(inputs, cache=cache)
        self.at.hold(self.caches)
        return out


def states_along(model: Any, prompt: mx.array, tokens: list[int], depth: int) -> States:
    """The recurrent layers' arrays at every offset of ``teacher_run`` over
    ``prompt`` and ``tokens`` on fresh caches of ``depth``."""
    caches = build_hybrid(model, depth)
    log = StateLog(model, caches)
    teacher_run(log, caches, prompt, tokens)
    return log.at


def check_states(label: str, caches: list[Any], reference: Mapping[int, list[tuple[int, int, bytes]]]) -> int:
    """Every layer of ``caches`` is at one offset t, and every recurrent
    layer's conv window and recurrent state equal (bytes) those a
    one-token-at-a-time run had at t (``reference``, from ``StateLog``).
    Returns t."""
    offsets = _offsets(caches)
    require(len(set(offsets)) == 1, f"{label}: the layers' offsets differ after the run: {offsets} (desynchronised)")
    t = offsets[0]
    require(t in reference, f"{label}: offset {t} after the run; the one-token run reached {max(reference)}")
    got, want = recurrent_states(caches), reference[t]
    require(len(got) == len(want) > 0, f"{label}: {len(got)} recurrent layers, the reference {len(want)}")
    for (i, off, a), (_, _, b) in zip(got, want):
        require(a == b, f"{label}: layer {i}: conv window / recurrent state after {off} tokens differ (bytes) from "
                        f"a run fed the same tokens one at a time")
    return t


class _Lazy:
    """``make()``'s value, made on the first call and kept."""

    def __init__(self, make: Any):
        self.make, self.made = make, False

    def __call__(self) -> Any:
        if not self.made:
            self.value, self.made = self.make(), True
        return self.value


class _Rollbacks:
    """Counts the rollbacks mlx-lm's speculative loop asks of a cache list,
    by length (through its first recurrent layer's ``trim``)."""

    def __init__(self, caches: list[Any]):
        self.lengths: Counter[int] = Counter()
        layer = next(c for c in caches if isinstance(c, RecurrentCache))
        trim = layer.trim

        def counted(n: int) -> int:
            got = trim(n)
            if got:
                self.lengths[got] += 1
            return got

        layer.trim = counted  # type: ignore[method-assign]


def speculative_run(model: Any, draft: Any, caches: list[Any], prompt: mx.array, n: int,
                    k: int) -> Speculation:
    """mlx-lm's ``speculative_generate_step`` (``num_draft_tokens=k``) for
    ``n`` tokens; ``caches`` holds the model's layers then the draft's
    (``draft`` may be ``model`` itself). Returns the stream, the tokens
    drafted (one per draft call after the main model's prefill) and
    accepted."""
    from mlx_lm.generate import speculative_generate_step

    log: list[str] = []
    out, accepted = Stream(), 0
    for tok, logprobs, from_draft in speculative_generate_step(
        prompt, _Logged(model, "main", log), _Logged(draft, "draft", log), num_draft_tokens=k, max_tokens=n,
        prompt_cache=caches,
    ):
        out.tokens.append(int(tok))
        out.logprobs.append(logprob_bytes(logprobs))
        accepted += bool(from_draft)
    return Speculation(out, log[log.index("main"):].count("draft"), accepted)


def scenario_hybrid_speculative(size: Size, factories: Factories = None,
                                families: tuple[str, ...] = HYBRID_FAMILIES) -> tuple[Tally, float | None]:
    """Speculative decoding on hybrid models with
    ``make_prompt_cache(model, num_draft_tokens=k)`` for target and draft,
    k = 1..4: tokens = greedy decoding with mlx-lm's caches; log-probability
    bytes = greedy decoding with our caches of depth k; every recurrent
    layer's arrays after the run = a one-token-at-a-time run over the same
    tokens (bytes), all layers at one offset. With draft = target (at the
    k of ``SELF_DRAFT_LENGTHS``) every draft is accepted; with the mixed
    draft the main model's rollbacks of every length 1..k happen (counted)
    and drafts are both accepted and rejected; the main model never refuses
    a rollback."""
    tally = Tally()
    n = SPEC_TOKENS.get(size, size.tokens)
    drafted = accepted = 0
    ring_diff = 0.0
    draft_refusals: list[list[int]] = []
    notes = []
    for family in families:
        lengths: dict[int, Counter[int]] = {k: Counter() for k in DRAFT_LENGTHS}
        for seed in size.seeds:
            # the models under test (their caches built from ``factories``) and the references'
            # own instances (the same weights): a recorder bug is installed on a model instance
            model = tiny_hybrid(family, seed)
            draft = hybrid_draft(family, seed, _draft_seed(seed), DRAFT_MIX[family], target=model)
            ref_model, ref_draft = twin(model), twin(draft)
            prompt = token_ids(seed, PROMPT)
            ref = greedy(ref_model, mlx_lm_caches(ref_model), prompt, n)
            require(len(set(ref.tokens)) >= min_distinct(n), f"{family} seed {seed}: greedy stream collapsed")
            for k in DRAFT_LENGTHS:
                label = f"{family} seed {seed}, k={k}"
                plain_caches = build_hybrid(ref_model, k)  # the references use kvspec's own classes
                log = StateLog(ref_model, plain_caches)
                plain = greedy(log, plain_caches, prompt, n)
                # the mixed draft's reference, made when a run's draft is checked against it (a run whose
                # draft ring refused a rollback, most of recurrent_gemma's, is not)
                draft_states = _Lazy(partial(states_along, ref_draft, prompt, plain.tokens, k))
                require(plain.tokens == ref.tokens,
                        f"{label}: greedy with our caches (depth {k}) leaves mlx-lm's greedy tokens at step "
                        f"{_first_difference(plain.tokens, ref.tokens)}")
                drafts = (("draft = target", model),) if k in SELF_DRAFT_LENGTHS.get(size, DRAFT_LENGTHS) else ()
                for name, d in (*drafts, ("mixed draft", draft)):
                    caches = build_hybrid(model, k, factories) + build_hybrid(d, k, factories)
                    main = caches[: len(model.layers)]
                    counts = _Rollbacks(main)
                    with warnings.catch_warnings(record=True):
                        warnings.simplefilter("always", RollbackWarning)
                        run = speculative_run(model, d, caches, prompt, n, k)
                    got = run.stream
                    what = f"{label}, {name}: speculative vs greedy (our caches, depth {k})"
                    if family in RING_FAMILIES:
                        compare_tokens(what, got, plain, tally)
                        ring_diff = max(ring_diff, max_logprob_diff(got, plain))
                    else:
                        compare(what, got, plain, tally)
                    if d is model:
                        require(run.accepted == run.drafted,
                                f"{label}, draft = target: {run.accepted} of {run.drafted} drafts accepted (a verify "
                                f"step disagreed with plain decoding)")
                    else:
                        drafted, accepted = drafted + run.drafted, accepted + run.accepted
                        lengths[k].update(counts.lengths)
                    refused = [i for i, c in enumerate(main) if getattr(c, "rollback_warned", False)]
                    require(not refused, f"{label}, {name}: the main model's layer(s) {refused} refused a rollback")
                    check_states(f"{label}, {name}, main model", main, log.at)
                    draft_caches = caches[len(model.layers):]
                    if any(getattr(c, "rollback_warned", False) for c in draft_caches):
                        # the known limit (docs/mlx-lm.md): after an all-accepted round mlx-lm feeds the
                        # draft 2 tokens as one block; a wrapped ring then restarts its undo log and can
                        # refuse the draft's next rollback (warned). mlx-lm's trim_prompt_cache trims
                        # layer by layer, so the draft's recurrent layers roll back and its ring does
                        # not: the draft drafts from mixed contexts, which costs accepted drafts only
                        draft_refusals.append(_offsets(draft_caches))
                    else:
                        check_states(f"{label}, {name}, draft model", draft_caches,
                                     log.at if d is model else draft_states())
        for k in DRAFT_LENGTHS:
            missing = [m for m in range(1, k + 1) if not lengths[k][m]]
            require(not missing, f"{family}, k={k}: no main-model rollback of length {missing} with the mixed draft "
                                 f"(seen {dict(sorted(lengths[k].items()))}): the scenario would not exercise them")
        notes.append(f"{family} rollbacks by length " + ", ".join(
            f"k={k}: {dict(sorted(lengths[k].items()))}" for k in DRAFT_LENGTHS))
    require(0 < accepted < drafted, f"the mixed drafts must be both accepted and rejected: {accepted} of {drafted}")
    tally.note(f"{', '.join(families)}, k={DRAFT_LENGTHS[0]}..{DRAFT_LENGTHS[-1]}: speculative tokens = mlx-lm's "
               f"greedy tokens; log-prob bytes = greedy with our caches of depth k; draft = target (k in "
               f"{list(SELF_DRAFT_LENGTHS.get(size, DRAFT_LENGTHS))}): every draft accepted; mixed draft: "
               f"{accepted}/{drafted} accepted; recurrent conv windows and states after "
               f"each run = one-token-at-a-time runs (bytes), layers at one offset; "
               f"{', '.join(f for f in families if f in RING_FAMILIES) or 'no family'} with a ring: tokens compared, "
               f"max |log-prob - greedy| {ring_diff:.3g} (a verify block reads a wrapped ring in another order); "
               f"the main model refused no rollback; the draft's ring refused a rollback in {len(draft_refusals)} runs "
               f"(after a 2-token draft call, warned; the draft's layers left at offsets "
               f"{draft_refusals[:3]}{'...' if len(draft_refusals) > 3 else ''}: mlx-lm trims layer by layer); "
               + "; ".join(notes))
    return tally, accepted / max(drafted, 1)


def compare_tokens(label: str, got: Stream, want: Stream, tally: Tally) -> None:
    """The tokens equal at every step (not the log-probability bytes); the
    stream did not collapse."""
    step = _first_difference(got.tokens, want.tokens)
    require(step is None, f"{label}: step {step}: token "
                          f"{got.tokens[step] if step is not None and step < len(got.tokens) else None}, "
                          f"reference {want.tokens[step] if step is not None and step < len(want.tokens) else None}")
    require(len(set(got.tokens)) >= min_distinct(len(got.tokens)), f"{label}: stream collapsed")
    tally.tokens.extend(got.tokens)


def max_logprob_diff(a: Stream, b: Stream) -> float:
    """The largest |difference| of two streams' log-probabilities (float32 bytes)."""
    return max((float(np.abs(np.frombuffer(x, np.float32) - np.frombuffer(y, np.float32)).max())
                for x, y in zip(a.logprobs, b.logprobs)), default=0.0)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def build_hybrid(model: Any, depth: int, factories: Factories = None, strict: bool = False) -> list[Any]:
    """``kvspec.impl.models.make_prompt_cache(model, num_draft_tokens=depth)``:
    every recurrent layer a RecurrentCache of that depth, every ring an undo
    log of it, the step recorder installed. ``factories`` (an injected bug's
    classes, ``kvspec.fuzz.bugs``) builds the rings (``"rotating"``) and the
    recurrent layers (``"recurrent"``: a RecurrentCache subclass, called as
    ``cls(size=, depth=, strict=)``; or ``{"record_steps": f}``, a recorder
    bug, installed on ``model`` instead of the step recorder)."""
    _pristine(model)
    bug = (factories or {}).get("recurrent")
    caches = make_prompt_cache(model, num_draft_tokens=depth, strict=strict,
                               classes={k: v for k, v in (factories or {}).items() if k == "rotating"} or None)
    if isinstance(bug, dict):
        _pristine(model)
        bug["record_steps"](model)
    elif bug is not None:
        caches = [bug(size=len(c.cache), depth=depth, strict=strict) if isinstance(c, RecurrentCache) else c
                  for c in caches]
    return caches


def _pristine(model: Any) -> None:
    """Put each recurrent mixer of ``model`` back to mlx-lm's own class
    (whichever recorder, kvspec's or a recorder bug's, wrapped it)."""
    from kvspec.impl.recurrent import _mixers

    for m in _mixers(model):
        cls = type(m)
        while "_kvspec_unrecorded" in cls.__dict__ or not cls.__module__.startswith("mlx_lm."):
            cls = cls.__bases__[0]
        m.__class__ = cls


def _layer_bytes(caches: list[Any]) -> list[tuple[int, bytes]]:
    """Every layer's offset and arrays (a recurrent layer's conv window and
    state, an attention layer's ``state``), as bytes: what a refused trim
    must leave as it was."""
    out = []
    for c in caches:
        arrays = c.cache if isinstance(getattr(c, "cache", None), list) else \
            [a for a in c.state if isinstance(a, mx.array)]
        out.append((getattr(c, "offset", -1), b"".join(_bytes(a) for a in arrays if a is not None)))
    return out


def _refused_beyond_depth(label: str, model: Any, caches: list[Any], depth: int) -> str:
    """A trim of ``depth + 1`` tokens: ``kvspec.impl.models.trim_prompt_cache``
    returns 0 with a RollbackWarning, raises StateError with
    ``strict=True``; every layer unchanged (bytes, offsets) either way."""
    before = _layer_bytes(caches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RollbackWarning)
        got = trim_prompt_cache(caches, depth + 1)
    loud = [w for w in caught if issubclass(w.category, RollbackWarning)]
    require(got == 0, f"{label}: trim of {depth + 1} > depth {depth} returned {got}")
    require(bool(loud), f"{label}: trim of {depth + 1} > depth {depth} returned 0 silently (no RollbackWarning)")
    require(_layer_bytes(caches) == before, f"{label}: a refused trim changed a layer")
    try:
        trim_prompt_cache(caches, depth + 1, strict=True)
    except StateError as exc:
        raised = str(exc)
    else:
        raise AssertionError(f"{label}: trim_prompt_cache(strict=True) of {depth + 1} > depth {depth} did not raise")
    require(_layer_bytes(caches) == before, f"{label}: a refused strict trim changed a layer")
    return raised


def scenario_hybrid_prompt_reuse(size: Size, factories: Factories = None,
                                 families: tuple[str, ...] = HYBRID_FAMILIES) -> tuple[Tally, float | None]:
    """Prompt-cache reuse with rollbacks on hybrid models. A prompt cache
    made by one prefill call of the prompt, its last n = 1..U tokens taken
    back: every layer's offset and every recurrent layer's arrays equal
    (bytes) a run of the calls without them. Then one conversation
    on caches of depth ``U = REUSE_DEPTH`` (``make_prompt_cache(model,
    num_draft_tokens=U)``): a prompt and U generated tokens, then for n =
    1..U: ``kvspec.impl.models.trim_prompt_cache`` takes back n tokens (returns n),
    every layer's offset and every recurrent layer's arrays equal (bytes) a
    run that never had them, and the next turn (5 prompt tokens, ``size.tokens``
    generated) decodes the tokens and log-probability bytes of that run.
    Then a trim of ``U + 1`` is refused loudly and changes nothing:
    RollbackWarning and 0, StateError with ``strict=True``, and StateError
    from caches built with ``strict=True``."""
    tally = Tally()
    U = REUSE_DEPTH
    refusals = []
    for family in families:
        for seed in size.seeds:
            model = tiny_hybrid(family, seed)
            ref_model = twin(model)  # the references' own instance (a recorder bug is installed on model)
            prompt = token_ids(seed, PROMPT)
            for back in range(1, U + 1):
                # a prompt cache made by one prefill call (a cached system prompt), its tail taken back
                label = f"{family} seed {seed}, depth {U}, a {PROMPT}-token prefill call, trim {back}"
                caches = build_hybrid(model, U, factories)
                model(prompt[None], cache=caches)
                got = trim_prompt_cache(caches, back)
                require(got == back, f"{label}: trim_prompt_cache returned {got}")
                # the reference makes the prefill's block call (depth 0: unsplit), then its one-token calls
                never = build_hybrid(ref_model, 0)
                ref_model(prompt[None, : PROMPT - U], cache=never)
                for t in np.array(prompt[PROMPT - U: PROMPT - back]).tolist():
                    ref_model(mx.array([[t]], dtype=mx.uint32), cache=never)
                require(set(_offsets(caches)) == {PROMPT - back},
                        f"{label}: offsets {_offsets(caches)} after the trim, expected {PROMPT - back} in every layer")
                for (i, off, a), (_, _, b) in zip(recurrent_states(caches), recurrent_states(never)):
                    require(a == b, f"{label}: layer {i}: conv window / recurrent state at offset {off} differ "
                                    f"(bytes) from a run that never had the trimmed tokens")
            caches = build_hybrid(model, U, factories)
            kept = greedy(model, caches, prompt, U).tokens  # what the caches hold after the prompt
            for back in range(1, U + 1):
                label = f"{family} seed {seed}, depth {U}, trim {back}"
                got = trim_prompt_cache(caches, back)
                require(got == back, f"{label}: trim_prompt_cache returned {got}")
                kept = kept[: len(kept) - back]
                never = teacher_run(ref_model, build_hybrid(ref_model, U), prompt, kept)
                require(_offsets(caches) == _offsets(never),
                        f"{label}: offsets {_offsets(caches)} after the trim, a run that never had the tokens "
                        f"{_offsets(never)}")
                for (i, off, a), (_, _, b) in zip(recurrent_states(caches), recurrent_states(never)):
                    require(a == b, f"{label}: layer {i}: conv window / recurrent state at offset {off} differ "
                                    f"(bytes) from a run that never had the trimmed tokens")
                turn = token_ids(seed + 100 * back, 5)
                got_turn = greedy(model, caches, turn, turn_tokens(size))
                compare(f"{label}: next turn vs a run that never had the trimmed tokens", got_turn,
                        greedy(ref_model, never, turn, turn_tokens(size)), tally)
                kept = kept + [int(t) for t in np.array(turn)] + got_turn.tokens
            label = f"{family} seed {seed}"
            refusals.append(_refused_beyond_depth(label, model, caches, U))
            strict = build_hybrid(model, U, factories, strict=True)
            greedy(model, strict, prompt, U + 1)
            before = _layer_bytes(strict)
            try:
                trim_prompt_cache(strict, U + 1)
            except StateError:
                pass
            else:
                raise AssertionError(f"{label}: caches built strict: a trim of {U + 1} > depth {U} did not raise")
            require(_layer_bytes(strict) == before, f"{label}: caches built strict: a refused trim changed a layer")
    tally.note(f"{', '.join(families)}, depth {U}: trims of 1..{U} tokens of a prefill call and of a conversation "
               f"= runs that never had them (states, offsets; next turn's tokens and log-prob bytes); "
               f"a trim of {U + 1} refused loudly, nothing changed "
               f"(RollbackWarning + 0; StateError with strict): {refusals[0][:200]}")
    return tally, None


# -- mlx-lm's own caches ------------------------------------------------------------
def _pretend_class() -> type:
    from mlx_lm.models.cache import ArraysCache

    class PretendTrimmable(ArraysCache):  # type: ignore[misc]
        """mlx-lm's ``ArraysCache`` forced to claim a rollback: ``is_trimmable()``
        answers True and ``trim(n)`` returns n, but the conv window and the
        recurrent state stay those after the tokens it claims to have taken
        back (the model never handed over the states before them)."""

        def is_trimmable(self) -> bool:
            return True

        def trim(self, n: int) -> int:
            return n

    return PretendTrimmable


def forced_caches(model: Any, depth: int) -> list[Any]:
    """mlx-lm's caches with each ``ArraysCache`` replaced by one that
    pretends to trim; recurrent_gemma's ring is kvspec's ring with an undo
    log of ``depth`` (exact), so that a drift is the recurrent layers'."""
    from mlx_lm.models.cache import ArraysCache
    from mlx_lm.models.cache import RotatingKVCache as LmRing

    pretend = _pretend_class()
    ours = make_prompt_cache(model, num_draft_tokens=depth)
    return [pretend(len(c.cache)) if type(c) is ArraysCache else ours[i] if type(c) is LmRing else c
            for i, c in enumerate(mlx_lm_caches(model))]


def _first_token_difference(got: list[int], want: list[int]) -> str:
    step = _first_difference(got, want)
    return "none" if step is None else f"step {step}"


def _first_step_difference(got: Stream, want: Stream) -> int | None:
    """The first step whose token or log-probability bytes differ (None: none)."""
    for i, (a, b, x, y) in enumerate(zip(got.tokens, want.tokens, got.logprobs, want.logprobs)):
        if a != b or x != y:
            return i
    return None if len(got.tokens) == len(want.tokens) else min(len(got.tokens), len(want.tokens))


def scenario_hybrid_mlx_lm(size: Size, factories: Factories = None,
                           families: tuple[str, ...] = HYBRID_FAMILIES) -> tuple[Tally, float | None]:
    """What mlx-lm's own caches do on the calls of scenarios 14 and 15,
    observed (mlx-lm 0.32; docs/mlx-lm.md says it): ``speculative_generate_step``
    raises ValueError for every k (an ``ArraysCache`` is not trimmable);
    ``trim_prompt_cache`` returns 0 with no warning and keeps the tokens in
    every layer (the next turn is not the run that never had them); and
    forced (an ``ArraysCache`` that claims to trim, ``forced_caches``), the
    recurrent layers keep the states after the rejected or trimmed tokens:
    speculative decoding leaves mlx-lm's greedy tokens, and the next turn
    after a forced trim leaves the run that never had the trimmed tokens.
    Both forced drifts must show for every family: they show that the
    exactness checks of scenarios 14 and 15 would see a rollback that only
    pretends. ``factories`` does not apply (mlx-lm's caches)."""
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.models.cache import trim_prompt_cache as lm_trim_prompt_cache

    tally = Tally()
    U = REUSE_DEPTH
    k = DRAFT_LENGTHS[-1]
    errors: set[str] = set()
    notes = []
    for family in families:
        spec_drift, trim_drift, kept_drift = [], [], []
        for seed in size.seeds[:MLX_LM_SEEDS]:
            model = tiny_hybrid(family, seed)
            draft = hybrid_draft(family, seed, _draft_seed(seed), DRAFT_MIX[family], target=model)
            prompt = token_ids(seed, PROMPT)
            label = f"{family} seed {seed}"
            # speculative decoding on mlx-lm's caches: refused before the prefill
            for kk in DRAFT_LENGTHS:
                caches = mlx_lm_caches(model) + mlx_lm_caches(draft)
                try:
                    next(speculative_generate_step(prompt, model, draft, num_draft_tokens=kk, max_tokens=4,
                                                   prompt_cache=caches))
                except ValueError as exc:
                    errors.add(f"ValueError({str(exc)!r})")
                else:
                    raise Divergence(f"{label}, k={kk}: mlx-lm's speculative decoding ran on its ArraysCache "
                                     f"(docs/mlx-lm.md says it raises ValueError): update the docs")
            ref = greedy(model, mlx_lm_caches(model), prompt, size.tokens)
            # forced: speculative decoding with caches that pretend to roll back
            forced = forced_caches(model, k) + forced_caches(draft, k)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RollbackWarning)
                got = speculative_run(model, draft, forced, prompt, size.tokens, k)
            spec_drift.append(_first_token_difference(got.stream.tokens, ref.tokens))
            tally.tokens.extend(got.stream.tokens)
            # prompt reuse: mlx-lm's trim_prompt_cache on its own caches, then forced; both next turns
            # against one run that never had the U tokens (mlx-lm's caches, the prompt, the turn)
            turn = token_ids(seed + 100, 5)
            never = teacher_run(model, mlx_lm_caches(model), prompt, [])
            never_turn = greedy(model, never, turn, turn_tokens(size))
            for name, caches, out in (("mlx-lm's caches", mlx_lm_caches(model), kept_drift),
                                      ("forced", forced_caches(model, U), trim_drift)):
                greedy(model, caches, prompt, U)  # the first turn: U tokens, which the trim takes back
                before = _layer_bytes(caches)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    trimmed = lm_trim_prompt_cache(caches, U)
                if name == "forced":
                    require(trimmed == U, f"{label}, forced: trim_prompt_cache returned {trimmed}, expected {U}")
                else:
                    require(trimmed == 0 and not caught and _layer_bytes(caches) == before,
                            f"{label}: mlx-lm's trim_prompt_cache of {U} on its caches returned {trimmed} with "
                            f"{len(caught)} warnings (docs/mlx-lm.md says 0, silently, nothing trimmed): "
                            f"update the docs")
                got_turn = greedy(model, caches, turn, turn_tokens(size))
                step = _first_step_difference(got_turn, never_turn)
                out.append("none" if step is None else f"step {step}")
                tally.tokens.extend(got_turn.tokens)
        for what, drifts in (("forced speculative decoding", spec_drift), ("the turn after a forced trim", trim_drift)):
            require(any(d != "none" for d in drifts),
                    f"{family}: {what} never left the reference ({drifts}): the scenario cannot tell a rollback "
                    f"that only pretends from an exact one")
        notes.append(f"{family}: forced speculative (k={k}) leaves greedy at {', '.join(spec_drift)}; after "
                     f"trim_prompt_cache -> 0 the next turn leaves the run without the {U} tokens at "
                     f"{', '.join(kept_drift)}; after a forced trim at {', '.join(trim_drift)}")
    tally.note(f"mlx-lm's caches: speculative_generate_step raises {' / '.join(sorted(errors))} for k="
               f"{DRAFT_LENGTHS[0]}..{k}; trim_prompt_cache returns 0 silently; " + "; ".join(notes))
    return tally, None
