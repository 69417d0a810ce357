"""The e2e size ``kvspec verify`` runs (``VERIFY``): the short size's
streams on models the test suite does not build, with the short size's
minimums in every scenario that sets one."""

from __future__ import annotations

import importlib
import pkgutil

from kvspec.fuzz.commands import e2e
from kvspec.fuzz.commands.e2e import checks
from kvspec.fuzz.commands.e2e.checks import SHORT, VERIFY


def test_verify_size_is_the_short_streams_on_other_models():
    assert (VERIFY.tokens, VERIFY.window) == (SHORT.tokens, SHORT.window)
    assert len(VERIFY.seeds) >= 2
    assert not set(VERIFY.seeds) & set(SHORT.seeds), "verify would decode through the models make test already runs"


def _size_tables():
    """Every module-level dict of the e2e package keyed by a Size."""
    for info in pkgutil.iter_modules(e2e.__path__, e2e.__name__ + "."):
        mod = importlib.import_module(info.name)
        for name, value in vars(mod).items():
            if isinstance(value, dict) and value and all(isinstance(k, checks.Size) for k in value):
                yield f"{info.name}.{name}", value


def test_every_minimum_set_for_the_short_size_holds_at_the_verify_size():
    tables = dict(_size_tables())
    assert {"kvspec.fuzz.commands.e2e.speculative.MIN_WRAPS", "kvspec.fuzz.commands.e2e.speculative.MIN_ROLLBACKS",
            "kvspec.fuzz.commands.e2e.hybrid.SPEC_TOKENS"} <= set(tables)
    for name, table in tables.items():
        if SHORT in table:
            assert table.get(VERIFY) == table[SHORT], f"{name}: the verify size falls back to another minimum"


def test_verify_runs_the_scenarios_at_the_verify_size(monkeypatch):
    from kvspec.fuzz.commands import verify
    from kvspec.fuzz.commands.e2e import registry

    seen = []

    def fake_run_all(size, factories=None, names=None, progress=None):
        seen.append((size, checks.records(), names))
        return [registry.ScenarioResult("greedy", "1 greedy", True, 64, 40, None, 0.1, "ok")]

    monkeypatch.setattr("kvspec.fuzz.commands.e2e.run_all", fake_run_all)
    out = verify.check_e2e(["greedy"])
    assert seen == [(VERIFY, False, ["greedy"])] and out[0].ok
