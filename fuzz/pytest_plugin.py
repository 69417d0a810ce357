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
Every failure is shrunk by Hypothesis and written as a kvtrace under
``--kvspec-out`` (default ``kvspec-failures`` in the rootdir), and the test
fails with the divergence and the ``kvspec replay`` command that reproduces
it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

DEFAULT_OUT = "kvspec-failures"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvspec", "kvspec: the KV-cache spec's state machines against a cache class")
    group.addoption("--kvspec-target", action="append", default=[], metavar="TARGET",
                    help="a kvspec target (mypkg.cache:MyCache, an entry-point name, mlx-lm, ...): add one "
                         "test per kind/mode it runs (repeatable)")
    group.addoption("--kvspec-out", default=DEFAULT_OUT, metavar="DIR",
                    help="folder (relative to the rootdir) for the shrunk kvtrace of every failure")
    parser.addini("kvspec_out", "folder for kvspec failure traces", default=DEFAULT_OUT)


class KvspecFailure(AssertionError):
    """A state machine found a divergence; the message names the trace."""


def out_dir(config: pytest.Config) -> Path:
    raw = config.getoption("--kvspec-out")
    if raw == DEFAULT_OUT:
        raw = config.getini("kvspec_out") or DEFAULT_OUT
    path = Path(raw)
    return path if path.is_absolute() else Path(config.rootpath) / path


def _settings() -> Any:
    """The settings in force (the user's profile), with what the machines
    need on top: no deadline, and no health check about slow draws."""
    from hypothesis import HealthCheck, settings

    current = settings.default
    slow = {HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much}
    return settings(current, deadline=None,
                    suppress_health_check=sorted(set(current.suppress_health_check) | slow, key=lambda h: h.value))


def _stem(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def run_target(target_name: str, kind: str, mode: str, out: Path) -> dict[str, Any]:
    """Run the kind's state machine against ``target_name`` under the
    settings in force. Returns what it reached; raises KvspecFailure with
    the divergence and the replay command after writing the shrunk trace."""
    from hypothesis.stateful import run_state_machine_as_test

    from fuzz.campaign import failure_trace, machine_for, save_failure
    from fuzz.targets import resolve

    target = resolve(target_name)
    machine = machine_for(kind, mode, True, target=None if target.is_impl else target)
    # the example database keys a state machine by its name
    machine.__name__ = machine.__qualname__ = f"kvspec_{_stem(target.label)}_{kind}_{mode}"
    try:
        run_state_machine_as_test(machine, settings=_settings())
    except Exception as exc:  # a Divergence, an invariant, or the class crashing
        trace = failure_trace(machine, exc)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if trace is None:
            raise KvspecFailure(f"{target.label} {kind}/{mode}: {first} (no trace recorded)") from exc
        trace.title = f"kvspec pytest plugin: {target.label} {kind}/{mode}: {first}"[:400]
        path = save_failure(trace, out, f"{_stem(target.label)}-{kind}-{mode}")
        raise KvspecFailure(f"{target.label} {kind}/{mode} diverges from the spec:\n{exc}\n"
                            f"shrunk kvtrace: {path}\n"
                            f"replay it: kvspec replay {path} --target {target.label}") from exc
    if machine.runs == 0:
        raise KvspecFailure(f"{target.label} {kind}/{mode}: no example ran; nothing was checked")
    return dict(machine.stats)


def configs_of(target_name: str) -> list[tuple[str, str]]:
    from fuzz.targets import resolve

    return resolve(target_name).configs()


def kvspec_test(target_name: str) -> Any:
    """A pytest test function, parametrized over every (kind, mode) the
    target runs, that runs kvspec's state machine against it::

        # tests/test_kvspec.py
        from fuzz.pytest_plugin import kvspec_test
        test_my_cache = kvspec_test("mypkg.cache:MyCache")
    """
    configs = configs_of(target_name)

    @pytest.mark.parametrize("kvspec_config", configs, ids=[f"{k}/{m}" for k, m in configs])
    def test(kvspec_config: tuple[str, str], request: pytest.FixtureRequest) -> None:
        kind, mode = kvspec_config
        run_target(target_name, kind, mode, out_dir(request.config))

    test.__doc__ = f"kvspec's state machines against {target_name}"
    return test


class KvspecItem(pytest.Item):
    """One (target, kind, mode) from ``--kvspec-target``."""

    def __init__(self, *, target_name: str, kind: str, mode: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.target_name, self.kind, self.mode = target_name, kind, mode

    def runtest(self) -> None:
        run_target(self.target_name, self.kind, self.mode, out_dir(self.config))

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


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--kvspec-target"):
        return
    collector = KvspecCollector.from_parent(session, name="kvspec")
    items.extend(collector.collect())
