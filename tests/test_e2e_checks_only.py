"""``kvspec verify`` runs the e2e scenarios without the figures they only
report (``kvspec.fuzz.commands.e2e.checks.checks_only``): every check is the same,
so the injected bugs that make a scenario fail still make it fail."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx_lm")

from kvspec.fuzz.bugs import by_name as bug_by_name
from kvspec.fuzz.commands.e2e import run_scenario
from kvspec.fuzz.commands.e2e.checks import checks_only, records
from kvspec.impl.turbo import TurboKVCache


def test_records_is_off_only_inside_checks_only():
    assert records()
    with checks_only():
        assert not records()
    assert records()
    with pytest.raises(RuntimeError), checks_only():
        raise RuntimeError("a scenario's crash")
    assert records()


def test_turbo_without_its_deviation_report_passes_and_says_so():
    with checks_only():
        result = run_scenario("turbo")
    assert result.ok, result.detail
    assert "speculative = greedy bytes in turbo4asym, turbo4, turbo3asym" in result.detail
    for mode in ("turbo4asym", "turbo4", "turbo3asym", "turbo4delegated"):
        assert f"{mode} vs fp16: not measured (checks only)" in result.detail
    assert 0 < result.acceptance < 1


class ClaimsTrim(TurboKVCache):
    """Answers a rollback of n rows with n and keeps them all: a rejected
    draft stays in the cache."""

    def trim(self, n):
        return n


def test_turbo_still_catches_a_trim_that_keeps_the_rows_without_its_report():
    with checks_only():
        result = run_scenario("turbo", factories={"dense": ClaimsTrim})
    assert not result.ok and "speculative vs greedy" in result.detail, result.detail


def test_speculative_window_without_the_mlx_lm_record_still_catches_a_kept_idx():
    with checks_only():
        ok = run_scenario("speculative_window")
        broken = run_scenario("speculative_window", factories=bug_by_name("rollback_keeps_idx").factories)
    assert ok.ok, ok.detail
    assert "mlx-lm's own caches leave greedy at not run (checks only)" in ok.detail
    assert not broken.ok


def test_verify_runs_the_scenarios_checks_only(monkeypatch):
    from kvspec.fuzz.commands import verify
    from kvspec.fuzz.commands.e2e import registry

    seen = []

    def fake_run_all(size, factories=None, names=None, progress=None):
        seen.append(records())
        return []

    monkeypatch.setattr(registry, "run_all", fake_run_all)
    monkeypatch.setattr("kvspec.fuzz.commands.e2e.run_all", fake_run_all)
    assert verify.check_e2e(["turbo"]) == [] and seen == [False]
    assert records()
