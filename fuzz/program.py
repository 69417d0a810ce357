"""The program engine: a state machine's rules run from one byte string.

Hypothesis's stateful engine pays for every rule step: it draws the swarm
flags, filters the enabled rules through a ``sampled_from``, draws each
argument through its strategy machinery and records a span per draw. On the
project's 2-core machine that is about 0.36 ms a step with no work in the
rules at all (2,800 steps per CPU-second; docs/fuzzing.md, "Hypothesis's
own floor"), more than the implementation and every check of a dense step
together. The program engine draws one byte string per example instead
(Hypothesis still generates it, replays it from the example database and
shrinks it) and decodes the machine's own rules from it: the same rules,
preconditions, bundles, invariants and lockstep checks, at a fraction of the
per-step cost.

Layout of an example's bytes (:data:`HEADER`, :data:`CHUNK`):

* ``SWARM`` bytes of swarm flags: the first picks how many rules the example
  leaves out (below 128: none), one byte per rule (in Hypothesis's rule
  order) says whether it is left out; zero bytes leave every rule in;
* ``INIT`` bytes for the initialize rules' arguments (a configuration);
* one fixed-size chunk per step: its first byte chooses the step (0: the
  program ends; 1: the step is skipped; otherwise rule ``(b - 2) mod k`` of
  the ``k`` rules that are enabled and valid now), the rest feed the rule's
  argument draws in order; a draw past the chunk's end reads zeros.

Fixed-size chunks keep a step's meaning when the shrinker changes another
step; the shrinker deletes a step by lowering its first byte to 1 and cuts
the program by lowering it to 0, and a zero byte is every draw's simplest
value (the first element, the integer nearest 0, False, the shortest
list), so what Hypothesis shrinks towards is the same as for its own
engine. Integers keep an edge bias (bytes 1 to 15 pick the range's ends).

The decoder understands the strategies the machines draw from (integers,
booleans, ``just``, ``sampled_from``, ``one_of``, lists and sets, ``map``
and ``filter``, ``@composite``, bundles, ``data()``); any other raises
TypeError naming it, when the rule first draws it (a machine change that
needs a new strategy fails every campaign at once, never silently).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from hypothesis import given, reject
from hypothesis import strategies as st
from hypothesis.internal.reflection import function_digest
from hypothesis.stateful import Bundle, RuleBasedStateMachine
from hypothesis.strategies._internal.collections import ListStrategy
from hypothesis.strategies._internal.core import CompositeStrategy, DataStrategy
from hypothesis.strategies._internal.lazy import LazyStrategy
from hypothesis.strategies._internal.misc import BooleansStrategy, JustStrategy
from hypothesis.strategies._internal.numbers import IntegersStrategy
from hypothesis.strategies._internal.strategies import (
    FilteredStrategy,
    MappedStrategy,
    OneOfStrategy,
    SampledFromStrategy,
)

#: swarm bytes: a level, then one flag per rule (machines have at most 63)
SWARM = 64
#: bytes for the initialize rules' draws (the configuration)
INIT = 64
HEADER = SWARM + INIT
#: bytes per step: the step's choice and its argument draws
CHUNK = 12
#: the first byte of a step: end of the program, a skipped step
STOP, SKIP = 0, 1
#: tries of a filtered strategy before the draw is refused (as Hypothesis's
#: filter gives up: the example is discarded)
FILTER_TRIES = 3


class ProgramExhausted(Exception):
    """A filtered draw found no value: the example is discarded, as
    Hypothesis discards one whose filter never passes."""


class Reader:
    """Draws values of Hypothesis strategies from a slice of bytes, one to
    four bytes a value; past the end every byte reads 0."""

    __slots__ = ("buf", "end", "pos")

    def __init__(self, buf: bytes, start: int, end: int) -> None:
        self.buf, self.pos, self.end = buf, start, end

    def byte(self) -> int:
        pos = self.pos
        self.pos = pos + 1
        return self.buf[pos] if pos < self.end else 0

    def uint(self, nbytes: int) -> int:
        v = 0
        for _ in range(nbytes):
            v = (v << 8) | self.byte()
        return v

    def integer(self, lo: int | None, hi: int | None) -> int:
        """An integer in ``[lo, hi]`` (None: unbounded, read as -128..127
        around the bound or 0): byte 0 is the value nearest 0, bytes 1-15
        the edges (lo, hi, lo+1, hi-1 in turn), the rest uniform."""
        if lo is None and hi is None:
            lo, hi = -128, 127
        elif lo is None:
            lo = hi - 255  # type: ignore[operator]
        elif hi is None:
            hi = lo + 255
        span = hi - lo + 1
        b = self.byte()
        if b == 0:
            return min(max(0, lo), hi)
        if b < 16:
            edges = (lo, hi, min(lo + 1, hi), max(hi - 1, lo))
            return edges[(b - 1) % 4]
        nbytes = 1 if span <= 256 else 2 if span <= 65536 else 4
        v = b - 16 if nbytes == 1 else ((b << (8 * (nbytes - 1))) | self.uint(nbytes - 1))
        return lo + v % span

    def draw(self, strategy: Any) -> Any:
        s = strategy
        while isinstance(s, LazyStrategy):
            s = s.wrapped_strategy
        if isinstance(s, IntegersStrategy):
            return self.integer(s.start, s.end)
        if isinstance(s, BooleansStrategy):
            return bool(self.byte() & 1)
        if isinstance(s, JustStrategy | SampledFromStrategy):
            value = s.elements[self.byte() % len(s.elements)] if len(s.elements) > 1 else s.elements[0]
            return self._transform(s, value)
        if isinstance(s, OneOfStrategy):
            branches = s.original_strategies
            return self.draw(branches[self.byte() % len(branches)])
        if isinstance(s, MappedStrategy):
            return s.pack(self.draw(s.mapped_strategy))
        if isinstance(s, FilteredStrategy):
            for _ in range(FILTER_TRIES):
                value = self.draw(s.filtered_strategy)
                if all(cond(value) for cond in s.flat_conditions):
                    return value
            raise ProgramExhausted(f"no value of {s!r} passed its filter")
        if isinstance(s, ListStrategy):
            return self._list(s)
        if isinstance(s, CompositeStrategy):
            return s.definition(self.draw, *s.args, **s.kwargs)
        raise TypeError(f"kvspec.fuzz.program: cannot draw from {strategy!r} ({type(s).__name__}); "
                        "extend kvspec.fuzz.program.Reader.draw for it")

    def _transform(self, s: SampledFromStrategy, value: Any) -> Any:
        for name, f, *_ in s._transformations:
            if name == "map":
                value = f(value)
            elif not f(value):
                raise ProgramExhausted(f"the drawn element of {s!r} did not pass its filter")
        return value

    def _list(self, s: ListStrategy) -> list[Any]:
        hi = s.max_size if s.max_size != float("inf") else s.min_size + 8
        size = self.integer(s.min_size, int(hi)) if hi > s.min_size else s.min_size
        keys = getattr(s, "keys", None)
        out: list[Any] = []
        seen: list[tuple[Any, ...]] = []
        tries = 0
        while len(out) < size and tries < size * 3:
            tries += 1
            value = self.draw(s.element_strategy)
            if keys is not None:
                key = tuple(k(value) for k in keys)
                if key in seen:
                    continue
                seen.append(key)
            out.append(value)
        if len(out) < s.min_size:
            raise ProgramExhausted(f"{s!r}: fewer than {s.min_size} unique elements drawn")
        return out


class ProgramData:
    """What a rule's ``st.data()`` argument is in the program engine:
    ``draw(strategy, label=None)`` reads the step's bytes."""

    __slots__ = ("reader",)

    def __init__(self, reader: Reader) -> None:
        self.reader = reader

    def draw(self, strategy: Any, label: Any = None) -> Any:
        return self.reader.draw(strategy)


def _rules(machine_cls: type[RuleBasedStateMachine]) -> tuple[list[Any], list[Any], list[Any]]:
    """The machine's rules in Hypothesis's order (targets, arguments, name),
    its initialize rules by name and its invariants."""
    state = machine_cls.setup_state()
    rules = sorted(state.rules, key=lambda r: (sorted(r.targets), len(r.arguments), r.function.__name__))
    inits = sorted(state.initializers, key=lambda r: r.function.__name__)
    if len(rules) > SWARM - 1:
        raise TypeError(f"{machine_cls.__name__}: {len(rules)} rules; the program engine's swarm flags "
                        f"hold {SWARM - 1}")
    return rules, inits, state.invariants


def program_size(steps: int) -> int:
    """Bytes of one example of at most ``steps`` steps."""
    return HEADER + CHUNK * steps


def _enabled(buf: bytes, count: int) -> list[bool]:
    """Swarm testing, as Hypothesis's feature flags: a level at or above 128
    leaves out each rule whose flag byte is above ``255 - p`` (p up to half
    of the byte range); zero bytes leave every rule in."""
    level = buf[0]
    if level < 128:
        return [True] * count
    cut = 255 - (level - 128)
    return [buf[1 + i] <= cut for i in range(count)]


def _argument(machine: RuleBasedStateMachine, reader: Reader, strategy: Any) -> Any:
    if isinstance(strategy, Bundle):
        refs = machine.bundle(strategy.name)
        i = reader.byte() % len(refs)
        ref = refs.pop(i) if strategy.consume else refs[i]
        return machine.names_to_values[ref.name]
    if isinstance(strategy, DataStrategy):
        return ProgramData(reader)
    return reader.draw(strategy)


def _valid(machine: RuleBasedStateMachine, rule: Any) -> bool:
    for b in rule.bundles:
        if not machine.bundle(b.name):
            return False
    return all(pred(machine) for pred in rule.preconditions)


def _invariants(machine: RuleBasedStateMachine, invariants: list[Any]) -> None:
    for inv in invariants:
        if all(pred(machine) for pred in inv.preconditions):
            inv.function(machine)


def run_program(machine_cls: type[RuleBasedStateMachine], program: bytes, steps: int,
                settings: Any = None) -> int:
    """Run one example: the machine's initialize rules, then up to ``steps``
    steps decoded from ``program`` (:func:`program_size` bytes), the
    invariants after each, ``teardown`` at the end whatever happens.
    Returns the steps run. A rule's exception propagates (it is the
    example's failure); :class:`ProgramExhausted` discards the example.
    ``settings``: what the machine's ``check_invariants`` is handed (its
    verbosity; None: Hypothesis's current default)."""
    if settings is None:
        from hypothesis import settings as hyp_settings
        settings = hyp_settings.default
    rules, inits, invariants = _rules(machine_cls)
    machine = machine_cls()
    enabled = _enabled(program, len(rules))
    run = 0
    try:
        # a machine that overrides check_invariants (kvspec.fuzz.machine.KVMachine
        # keeps an invariant's first failure) gets it called, as the
        # stateful engine calls it; the others get the same loop without
        # Hypothesis's printing, which needs a running Hypothesis test
        check = machine.check_invariants
        own = type(machine).check_invariants is not RuleBasedStateMachine.check_invariants
        runtimes: defaultdict[str, float] = defaultdict(float)

        def invariants_now() -> None:
            if own:
                check(settings, _quiet, runtimes)
            else:
                _invariants(machine, invariants)

        init_reader = Reader(program, SWARM, HEADER)
        for rule in inits:
            args = {k: _argument(machine, init_reader, s) for k, s in rule.arguments_strategies.items()}
            result = rule.function(machine, **args)
            if rule.targets:
                machine._add_results_to_targets(rule.targets, [result])
        machine._initialize_rules_to_run = []  # type: ignore[attr-defined]
        invariants_now()
        for step in range(steps):
            start = HEADER + CHUNK * step
            reader = Reader(program, start, start + CHUNK)
            choice = reader.byte()
            if choice == STOP:
                break
            if choice == SKIP:
                continue
            live = [r for r, on in zip(rules, enabled, strict=True) if on and _valid(machine, r)]
            if not live:
                live = [r for r in rules if _valid(machine, r)]
                if not live:
                    break
            rule = live[(choice - 2) % len(live)]
            args = {k: _argument(machine, reader, s) for k, s in rule.arguments_strategies.items()}
            result = rule.function(machine, **args)
            run += 1
            if rule.targets:
                machine._add_results_to_targets(rule.targets, [result])
            invariants_now()
    finally:
        machine.teardown()
    return run


def simplest_config(machine_cls: type[RuleBasedStateMachine]) -> dict[str, Any]:
    """The cache fields of the all-zero program: the machine's initialize
    rules with every draw at its simplest value (what Hypothesis's
    shrinking tends to), as the machine records them
    (``recorded_cfg()``). Runs them on a throwaway subclass, so the
    machine's own counters and records are untouched; no op runs."""
    scratch = type(machine_cls.__name__, (machine_cls,), {"stats": {}, "covered": {}, "runs": 0,
                                                          "last_run": None})
    _, inits, _ = _rules(scratch)
    machine = scratch()
    reader = Reader(bytes(INIT), 0, INIT)
    for rule in inits:
        rule.function(machine, **{k: _argument(machine, reader, s) for k, s in rule.arguments_strategies.items()})
    return machine.recorded_cfg()  # type: ignore[attr-defined]


def _quiet(text: str) -> None:
    """The stateful engine's step printer, silenced (the trace is the record)."""


def get_program_test(machine_cls: type[RuleBasedStateMachine], settings: Any, steps: int) -> Any:
    """The program engine's Hypothesis test for ``machine_cls``, run like
    ``hypothesis.stateful.get_state_machine_test``'s: ``settings`` (its
    ``stateful_step_count`` is ignored: ``steps`` is the program's length),
    ``@seed`` through the returned function's
    ``_hypothesis_internal_use_seed``, and an example-database key of its
    own (the machine's digest and ``program``), so a stateful example is
    never replayed as a program."""
    size = program_size(steps)

    @settings
    @given(st.binary(min_size=size, max_size=size))
    def run_program_test(program: bytes) -> None:
        try:
            run_program(machine_cls, program, steps, settings)
        except ProgramExhausted:
            reject()

    # the key is read only where there is a database to key: the machine's
    # digest reads its class's source (tens of ms for a class machine_for
    # made, whose source inspect searches for and does not find)
    run_program_test.hypothesis.inner_test._hypothesis_internal_add_digest = (  # type: ignore[attr-defined]
        (function_digest(machine_cls) if settings.database is not None else b"") + b" program"
    )
    return run_program_test


__all__ = ["CHUNK", "HEADER", "ProgramData", "ProgramExhausted", "Reader", "get_program_test", "program_size",
           "run_program", "simplest_config"]
