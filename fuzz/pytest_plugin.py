"""kvspec's state machines inside a user's own pytest suite (docs/targets.md,
"Inside your test suite"). Registered as the ``pytest11`` entry point
``kvspec``, so it is active wherever kvspec is installed; it does nothing
unless asked:

* ``pytest --kvspec-target=mypkg.cache:MyCache`` adds one test per (kind,
  mode) the target runs (``kvspec[mypkg.cache:MyCache][dense/fp16]``);
* or one line in a test file of the user's:
  ``test_my_cache = kvspec_test("mypkg.cache:MyCache")``.

Either way the machines run under the Hypothesis settings in force (the
user's profile, ``--hypothesis-profile``, its ``max_examples``,
``stateful_step_count`` and example database: a failure found once is
replayed first next time), with no deadline (MLX compiles on first use).
``--kvspec-budget N`` searches N examples per (kind, mode) instead of the
profile's ``max_examples``; ``--kvspec-shrinks N`` (default
:data:`DEFAULT_SHRINKS`) stops shrinking a failure after N successful
shrinks, a count, not seconds, so neither the verdict nor the trace depends
on the clock; ``--kvspec-seed N`` fixes Hypothesis's seed (two runs with the
same seed and no example database draw the same examples and report the
same trace).

Every failure is shrunk by Hypothesis and written as a kvtrace under
``--kvspec-out`` (default ``kvspec-failures`` in the rootdir), and the test
fails with a short report: the divergence, the trace and the ``kvspec
replay`` command that reproduces it; the harness's own frames are not
shown. A target that cannot run a kind/mode is a skip with the reason; an
exception of the harness itself (not a divergence) fails with its full
traceback, never as a divergence.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

DEFAULT_OUT = "kvspec-failures"
#: successful shrinks of a failure at most (``--kvspec-shrinks``); Hypothesis's own limit is 500
DEFAULT_SHRINKS = 100


def _count(flag: str, least: int) -> Any:
    """An argparse type: an integer >= ``least``, or a usage error naming ``flag``."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: an integer is required, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{flag}: must be >= {least}, got {value}")
        return value

    return parse


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvspec", "kvspec: the KV-cache spec's state machines against a cache class")
    group.addoption("--kvspec-target", action="append", default=[], metavar="TARGET",
                    help="a kvspec target (mypkg.cache:MyCache, an entry-point name, mlx-lm, ...): add one "
                         "test per kind/mode it runs (repeatable)")
    group.addoption("--kvspec-out", default=DEFAULT_OUT, metavar="DIR",
                    help="folder (relative to the rootdir) for the shrunk kvtrace of every failure")
    group.addoption("--kvspec-budget", type=_count("--kvspec-budget", 1), default=None, metavar="EXAMPLES",
                    help="examples to search per kind/mode (default: the Hypothesis profile's max_examples)")
    group.addoption("--kvspec-shrinks", type=_count("--kvspec-shrinks", 0), default=DEFAULT_SHRINKS, metavar="N",
                    help=f"stop shrinking a failure after N successful shrinks (a count: the trace does not "
                         f"depend on the clock; default {DEFAULT_SHRINKS})")
    group.addoption("--kvspec-seed", type=_count("--kvspec-seed", 0), default=None, metavar="SEED",
                    help="Hypothesis's seed for the machines (default: random, or the profile's derandomize)")
    parser.addini("kvspec_out", "folder for kvspec failure traces", default=DEFAULT_OUT)


class KvspecFailure(AssertionError):
    """A state machine found a divergence; the message names the trace and
    the replay command, and is the whole failure report (no traceback)."""


@dataclass(frozen=True)
class RunOptions:
    """``--kvspec-budget`` (examples, None: the profile's), ``--kvspec-shrinks``
    and ``--kvspec-seed`` (None: Hypothesis's own)."""

    budget: int | None = None
    shrinks: int = DEFAULT_SHRINKS
    seed: int | None = None

    @classmethod
    def of(cls, config: pytest.Config) -> RunOptions:
        return cls(config.getoption("--kvspec-budget"), config.getoption("--kvspec-shrinks"),
                   config.getoption("--kvspec-seed"))


def out_dir(config: pytest.Config) -> Path:
    raw = config.getoption("--kvspec-out")
    if raw == DEFAULT_OUT:
        raw = config.getini("kvspec_out") or DEFAULT_OUT
    path = Path(raw)
    return path if path.is_absolute() else Path(config.rootpath) / path


def _settings(options: RunOptions | None = None) -> Any:
    """The settings in force (the user's profile), with what the machines
    need on top: no deadline, no health check about slow draws, no explain
    phase (it replays the failure many times to annotate a program the
    report does not print), ``max_examples`` from ``--kvspec-budget``."""
    from hypothesis import HealthCheck, Phase, settings

    current = settings.default
    slow = {HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much}
    extra: dict[str, Any] = {}
    if options is not None and options.budget is not None:
        extra["max_examples"] = options.budget
    return settings(current, deadline=None, phases=[p for p in current.phases if p != Phase.explain],
                    suppress_health_check=sorted(set(current.suppress_health_check) | slow, key=lambda h: h.value),
                    **extra)


@contextmanager
def _shrink_count(shrinks: int) -> Iterator[None]:
    """Within the block Hypothesis stops shrinking a failure after
    ``shrinks`` successful shrinks and reports the smallest failing example
    found by then. Hypothesis has no public setting for it: its engine reads
    the module constant ``MAX_SHRINKS`` (as kvspec.fuzz.campaign.shrink_limit does
    ``MAX_SHRINKING_SECONDS``)."""
    from hypothesis.internal.conjecture import engine

    if not isinstance(getattr(engine, "MAX_SHRINKS", None), int):
        raise TypeError("this Hypothesis has no MAX_SHRINKS: --kvspec-shrinks cannot be applied")
    old = engine.MAX_SHRINKS
    engine.MAX_SHRINKS = shrinks  # type: ignore[misc]
    try:
        yield
    finally:
        engine.MAX_SHRINKS = old  # type: ignore[misc]


def _is_divergence(exc: BaseException) -> bool:
    """A finding of the comparison (a Divergence, a machine's invariant: an
    AssertionError), or a group of them; anything else is the harness's."""
    from kvspec.fuzz.lockstep import Divergence

    if isinstance(exc, BaseExceptionGroup):
        return all(_is_divergence(e) for e in exc.exceptions)
    return isinstance(exc, (Divergence, AssertionError))


def _stem(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def run_target(target_name: str, kind: str, mode: str, out: Path,
               options: RunOptions | None = None) -> dict[str, Any]:
    """Run the kind's state machine against ``target_name`` under the
    settings in force and ``options``. Returns what it reached; raises
    KvspecFailure with the divergence and the replay command after writing
    the shrunk trace; a capability gap of the target (TargetCapabilityError)
    is a pytest skip with the reason; any other exception is the harness's
    own and propagates as it is."""
    __tracebackhide__ = True
    from hypothesis.stateful import run_state_machine_as_test

    from kvspec.fuzz.campaign import failure_trace, machine_for, save_failure
    from kvspec.fuzz.targets import TargetCapabilityError, resolve

    options = options or RunOptions()
    target = resolve(target_name)
    machine = machine_for(kind, mode, True, target=None if target.is_impl else target)
    # the example database keys a state machine by its name
    machine.__name__ = machine.__qualname__ = f"kvspec_{_stem(target.label)}_{kind}_{mode}"
    if options.seed is not None:
        machine._hypothesis_internal_use_seed = options.seed  # what hypothesis.seed() sets; run_state_machine reads it
    try:
        with _shrink_count(options.shrinks):
            run_state_machine_as_test(machine, settings=_settings(options))
    except TargetCapabilityError as exc:
        pytest.skip(f"not applicable: {exc}")
    except Exception as exc:  # sorted below: a finding, or the harness's own failure
        if not _is_divergence(exc):
            raise
        trace = failure_trace(machine, exc)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if trace is None:
            raise KvspecFailure(f"{target.label} {kind}/{mode}: {first} (no trace recorded)") from None
        trace.title = f"kvspec pytest plugin: {target.label} {kind}/{mode}: {first}"[:400]
        path = save_failure(trace, out, f"{_stem(target.label)}-{kind}-{mode}")
        raise KvspecFailure(f"{target.label} {kind}/{mode} diverges from the spec:\n{exc}\n"
                            f"shrunk kvtrace: {path}\n"
                            f"replay it: kvspec replay {path} --target {target.label}") from None
    if machine.runs == 0:
        raise KvspecFailure(f"{target.label} {kind}/{mode}: no example ran; nothing was checked")
    return dict(machine.stats)


def configs_of(target_name: str) -> list[tuple[str, str]]:
    from kvspec.fuzz.targets import resolve

    return resolve(target_name).configs()


def kvspec_test(target_name: str) -> Any:
    """A pytest test function, parametrized over every (kind, mode) the
    target runs, that runs kvspec's state machine against it::

        # tests/test_kvspec.py
        from kvspec.fuzz.pytest_plugin import kvspec_test
        test_my_cache = kvspec_test("mypkg.cache:MyCache")
    """
    configs = configs_of(target_name)

    @pytest.mark.parametrize("kvspec_config", configs, ids=[f"{k}/{m}" for k, m in configs])
    def test(kvspec_config: tuple[str, str], request: pytest.FixtureRequest) -> None:
        __tracebackhide__ = True
        kind, mode = kvspec_config
        run_target(target_name, kind, mode, out_dir(request.config), RunOptions.of(request.config))

    test.__doc__ = f"kvspec's state machines against {target_name}"
    return test


class KvspecItem(pytest.Item):
    """One (target, kind, mode) from ``--kvspec-target``."""

    def __init__(self, *, target_name: str, kind: str, mode: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.target_name, self.kind, self.mode = target_name, kind, mode

    def runtest(self) -> None:
        run_target(self.target_name, self.kind, self.mode, out_dir(self.config), RunOptions.of(self.config))

    def repr_failure(self, excinfo: Any, style: Any = None) -> Any:
        if isinstance(excinfo.value, KvspecFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, self.name


class KvspecCollector(pytest.Collector):
    """The tests ``--kvspec-target`` adds."""

    def collect(self) -> list[pytest.Item]:
        items: list[pytest.Item] = []
        for name in self.config.getoption("--kvspec-target"):
            try:
                configs = configs_of(name)
            except KeyError as exc:
                raise pytest.UsageError(f"--kvspec-target: {exc}") from None
            for kind, mode in configs:
                items.append(KvspecItem.from_parent(self, name=f"kvspec[{name}][{kind}/{mode}]",
                                                    target_name=name, kind=kind, mode=mode))
        return items


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A KvspecFailure's report is its message alone (the divergence, the
    trace, the replay command), in a ``kvspec_test`` function as in a
    ``--kvspec-target`` item: the harness's frames are not the user's."""
    report = yield
    if call.excinfo is not None and report.failed and isinstance(call.excinfo.value, KvspecFailure):
        report.longrepr = str(call.excinfo.value)
    return report


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--kvspec-target"):
        return
    collector = KvspecCollector.from_parent(session, name="kvspec")
    items.extend(collector.collect())
