"""The proofs: every obligation proved, every negative control refuted, and
every counterexample a valid kvtrace that a correct implementation passes and
the matching injected bug of the catalog fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kvspec.proofs import cli, dense
from kvspec.proofs.core import ObligationResult
from kvspec.proofs.dense_model import Rules
from kvspec.proofs.paged import available as paged_available
from kvspec.proofs.rotating import available as rotating_available

# kvtraces of negative controls -> the injected bug (fuzz/bugs/dense.py) that has
# the same broken rule in the implementation
SAME_BUG = {
    "inplace_after_trim": "inplace_after_trim",
    "inplace_after_restore": "inplace_after_restore",
    "old_regrow_guard": "old_regrow_guard",
}
RING_SAME_BUG = {
    "steady_state_inplace": "steady_state_inplace",
    "warmup_inplace_ignores_marker": "warmup_inplace_ignores_marker",
    "prefill_physical_order": "prefill_physical_order",
    "mask_admits_extra_key": "mask_admits_extra_key",
    "mask_hides_sinks": "mask_hides_sinks",
}
PAGED_SAME_BUG = {
    "paged_no_cow": "paged_no_cow",
    "paged_release_frees_shared": "paged_release_frees_shared",
}
ROTATING = rotating_available()
PAGED = paged_available()
PROVABLE = [1, 3, 4, 5] + ([2, 7, 8] if ROTATING else []) + ([6] if PAGED else [])


@pytest.fixture(scope="module")
def results() -> list[ObligationResult]:
    return cli.run_all()


def _by_number(results: list[ObligationResult], n: int) -> ObligationResult:
    return next(r for r in results if r.number == n)


@pytest.mark.parametrize("number", PROVABLE)
def test_obligation_proved_in_both_domains(results: list[ObligationResult], number: int) -> None:
    r = _by_number(results, number)
    assert r.status == "proved", [p.to_json() for p in r.parts if p.status != "proved"]
    assert {p.domain for p in r.parts} == {"int", "bv32"}
    assert all(p.status == "proved" for p in r.parts)


@pytest.mark.parametrize("number", PROVABLE)
def test_every_negative_control_refuted(results: list[ObligationResult], number: int) -> None:
    r = _by_number(results, number)
    assert r.controls, "an obligation without a negative control proves nothing"
    for c in r.controls:
        assert c.status == "refuted", c.to_json()
        assert all(v == "refuted" for v in c.domains.values()), c.to_json()


def test_paged_obligation_proved_with_confirmed_controls(results: list[ObligationResult]) -> None:
    r = _by_number(results, 6)
    assert r.name == "paged copy on write" and r.status == "proved"
    controls = {c.name: c for c in r.controls}
    assert set(controls) == {"paged_no_cow", "paged_table_from_visible_len", "paged_trim_keeps_tail",
                             "paged_release_frees_shared", "paged_cow_keeps_old_refcount"}
    # the required control is refuted where the write isolation is stated
    assert controls["paged_no_cow"].refuting_part.startswith("every block an append writes")
    assert controls["paged_no_cow"].confirmed.startswith("confirmed on spec with the bug: b's window becomes")
    assert controls["paged_release_frees_shared"].confirmed.startswith("confirmed")
    for name in ("paged_trim_keeps_tail", "paged_release_frees_shared", "paged_cow_keeps_old_refcount"):
        assert "refcount invariant: preserved by" in controls[name].refuting_part, name


@pytest.mark.skipif(ROTATING, reason="spec/rotating.py is there: obligations 2 and 7 run")
def test_rotating_obligations_wait_without_the_spec(results: list[ObligationResult]) -> None:
    for n in (2, 7):
        assert _by_number(results, n).status == "waits"


def _traces(results: list[ObligationResult]) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, c.trace) for r in results for c in r.controls if c.trace is not None]


def test_counterexample_traces_are_valid_kvtraces(results: list[ObligationResult]) -> None:
    from kvspec.fuzz.trace import validate

    traces = _traces(results)
    assert len(traces) >= 9
    for name, doc in traces:
        validate(doc)
        assert doc["ops"], name


def test_counterexample_traces_pass_on_the_implementation(results: list[ObligationResult]) -> None:
    from kvspec.fuzz.replay import replay
    from kvspec.fuzz.trace import parse

    ran = 0
    for name, doc in _traces(results):
        if doc["cache"].get("mode", "fp16") not in ("fp16", "int8"):
            continue
        res = replay(parse(doc))
        assert res.ok, (name, res.to_json())
        ran += 1
    assert ran >= 8


def test_counterexample_traces_catch_the_same_injected_bug(results: list[ObligationResult]) -> None:
    from kvspec.fuzz.bugs import by_name
    from kvspec.fuzz.replay import replay
    from kvspec.fuzz.trace import parse

    found = dict(_traces(results))
    for control, bug_name in {**SAME_BUG, **(RING_SAME_BUG if ROTATING else {}),
                              **(PAGED_SAME_BUG if PAGED else {})}.items():
        bug = by_name(bug_name)
        doc = found[control]
        res = replay(parse(doc), bug.factories)
        assert not res.ok, f"{control}'s counterexample does not catch injected bug {bug_name}"


def test_bmc_finds_nothing_with_the_spec_rules() -> None:
    # The search that refutes the negative controls finds no unsafe in-place
    # write with the correct rules (bounded; the proof covers every depth).
    assert dense.bmc(Rules(), max_depth=4) is None


def test_bmc_finds_the_trim_bug_quickly() -> None:
    found = dense.bmc(Rules(inplace="no_length_check"), max_depth=4)
    assert found is not None and found["ops"][-1]["op"] == "append"


def test_cli_json_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--json", "--only", "5"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (ob,) = doc["obligations"]
    assert ob["name"] == "front trim" and ob["status"] == "proved" and ob["negative_control"] == "refuted"
    for key in ("name", "status", "negative_control", "seconds"):
        assert key in ob
    assert all("kvtrace" in c for c in ob["negative_controls"])


def test_cli_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # the table fits the terminal: wide enough here that no name folds
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["--only", "4"]) == 0
    out = capsys.readouterr().out
    assert "trim then append" in out and "proved" in out and "kvtrace" in out


def test_cli_fails_when_a_negative_control_survives(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # A "buggy" rule equal to the spec cannot be refuted: the obligation must
    # then count as failed and the exit status be 1.
    monkeypatch.setattr(dense, "FRONT_CONTROLS", [("not_a_bug", "the spec itself", Rules())])
    assert cli.main(["--json", "--only", "5"]) == 1
    (ob,) = json.loads(capsys.readouterr().out)["obligations"]
    assert ob["status"] == "failed" and ob["negative_control"] == "not refuted"


def test_crosshair_runner_reports_a_counterexample(tmp_path: Path) -> None:
    from kvspec.proofs import crosshair_run

    bad = tmp_path / "bad_contract.py"
    bad.write_text(textwrap.dedent('''
        def grow(x: int) -> int:
            """
            pre: x >= 0
            post: __return__ > x
            """
            return x
    '''))
    conds, errors = crosshair_run.check_file(bad, 3)
    assert not errors
    assert [c.status for c in conds] == ["counterexample"] and conds[0].function == "grow"


def test_crosshair_confirms_the_unexplained_functions_of_a_file_with_explained_ones() -> None:
    """spec/dense.py mixes explained functions (left out) with ones CrossHair
    must confirm, checked one by one: each of those is confirmed, not lost
    (a target CrossHair cannot load gave no line at all and read as a pass)."""
    from kvspec.proofs import crosshair_run

    path = crosshair_run.ROOT / "spec" / "dense.py"
    conds, errors = crosshair_run.check_file(path, 10)
    assert not errors, errors
    checked = {c.function for c in conds if c.status != "explained"}
    expected = {name for name, _, _ in crosshair_run.contract_functions(path)
                if ("spec/dense.py", name) not in crosshair_run.EXPLAINED}
    assert expected and checked == expected, (checked, expected)
    assert all(c.status == "confirmed" for c in conds if c.status != "explained"), conds


def test_crosshair_that_gives_no_verdict_is_an_error() -> None:
    """CrossHair failing on a target (here a dotted name under the namespace
    package kvspec, whose options it cannot read; exit 1 with a traceback)
    is a tool error, never a target with nothing to report."""
    from kvspec.proofs import crosshair_run

    conds, errors = crosshair_run.check_targets(["kvspec.spec.dense.regrow_capacity"], 5)
    assert errors and "no verdict" in errors[0], (conds, errors)


def test_crosshair_explained_conditions_warn_and_unexplained_ones_fail() -> None:
    from kvspec.proofs.crosshair_run import (
        EXPLAINED,
        Condition,
        CrosshairResult,
        contract_files,
        contract_functions,
    )

    def result(*statuses: str) -> CrosshairResult:
        res = CrosshairResult(diff={"status": "same"}, diff_control={"status": "differ"})
        res.conditions = [Condition("spec/x.py", i, "f", "post: True", s, "why") for i, s in enumerate(statuses)]
        return res

    assert result("confirmed").ok and not result("confirmed").warnings
    warned = result("confirmed", "explained")
    assert warned.ok and warned.warnings == ["spec/x.py:1 f: post: True: not confirmed by CrossHair: why"]
    assert "1 explained (warnings)" in warned.summary()
    assert not result("confirmed", "not confirmed").ok
    assert not result("precondition unmet").ok
    # every explained function exists and has a contract
    have = {(str(p.relative_to(p.parents[1])), name) for p in contract_files() for name, _, _ in contract_functions(p)}
    assert set(EXPLAINED) <= have


def test_crosshair_diffbehavior_and_its_control() -> None:
    from kvspec.proofs import crosshair_run

    assert crosshair_run.diffbehavior(*crosshair_run.DIFF_TARGET, 5)["status"] == "same"
    assert crosshair_run.diffbehavior(*crosshair_run.DIFF_CONTROL, 5)["status"] == "differ"


def test_proofs_import_only_spec() -> None:
    import ast

    for path in Path(dense.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(("kvspec.impl", "kvspec.fuzz", "impl", "fuzz")), (path.name, node.module)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith(("kvspec.impl", "kvspec.fuzz", "impl", "fuzz")), (path.name, alias.name)


def test_the_docs_obligations_record_is_current(results: list[ObligationResult]) -> None:
    """docs/proofs.md's tables are drawn from docs/generated/obligations.json:
    it must name every obligation and control this run has, with its status."""
    from kvspec.fuzz.docgen import OBLIGATIONS_PATH, obligations_from

    recorded = json.loads(OBLIGATIONS_PATH.read_text())
    assert recorded == obligations_from(results), (
        "docs/generated/obligations.json is stale: python -m kvspec.fuzz.docgen obligations")


def test_titles_name_every_obligation_as_its_result_does(results: list[ObligationResult]) -> None:
    # kvspec verify labels one job per obligation with cli.TITLES before any runs
    assert {r.number: r.name for r in results} == {n: cli.TITLES[n] for n, _ in cli.obligations()}


def test_crosshair_on_some_files_without_the_diff() -> None:
    from kvspec.proofs import crosshair_run

    res = crosshair_run.run(files=["spec/paged.py"], diff=False, workers=1)
    assert res.ok and res.files == ["spec/paged.py"] and not res.with_diff and "diffbehavior" not in res.summary()
    assert res.count("confirmed") == len(res.conditions) > 0 and {c.file for c in res.conditions} == {"spec/paged.py"}
    # a whole run still requires the diff and its control
    res.with_diff = True
    assert not res.ok


def test_crosshair_runs_through_this_interpreter_keeping_pythonpath(monkeypatch: pytest.MonkeyPatch) -> None:
    # On the GPU machine CrossHair is a wheel on PYTHONPATH: no ``crosshair``
    # script on PATH, and a PYTHONPATH replaced by the checkout alone hides it.
    from kvspec.proofs import crosshair_run

    seen = {}

    def run(cmd, **kw):
        seen["cmd"], seen["env"] = cmd, kw["env"]
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("PYTHONPATH", "/wheels/crosshair")
    monkeypatch.setattr(crosshair_run.subprocess, "run", run)
    crosshair_run.diffbehavior(*crosshair_run.DIFF_TARGET, 1)
    assert seen["cmd"][:3] == [sys.executable, "-m", "crosshair"]
    assert seen["env"]["PYTHONPATH"].split(os.pathsep) == [str(crosshair_run.ROOT), "/wheels/crosshair"]
