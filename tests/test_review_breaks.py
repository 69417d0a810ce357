"""Edges of ``--baseline`` (fuzz/commands/review.py, review_side.py), of
``kvspec verify``'s obligation processes (fuzz/commands/verify.py) and of
``kvspec.fuzz.targets.FROM_CWD`` that the end-to-end tests do not reach:
each test here failed under a plausible break of the code (a reviewer's
mutation) and passes on the real code. Fast: no engine search, no Z3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvspec.fuzz.commands import review, verify
from kvspec.fuzz.commands.review import Baseline, Divergences, Request, compare, divergences


def _conformance(*findings: tuple[str, dict, str | None]) -> dict:
    return {"classes": [{"cache_class": "KVCache", "findings": [
        {"what": what, "op": op, "trace": trace, "index": 3, "summary": what, "waived": []}
        for what, op, trace in findings]}]}


def test_only_fixed_rows_exit_0():
    # the head fixes a divergence and adds none: a pass (exit 0), never a failure
    base = divergences(_conformance(("offset differs", {"op": "trim", "n": -1}, None)), "conformance")
    comp = compare(Divergences(), base)
    assert comp.fixed and not comp.added and comp.exit_code == 0


def test_a_fixed_key_whose_base_trace_still_diverges_on_the_head_is_in_both(tmp_path, monkeypatch):
    trace = tmp_path / "KVCache_01.json"
    trace.write_text("{}")
    base = divergences(_conformance(("offset differs", {"op": "trim", "n": -1}, str(trace))), "conformance")
    comp = compare(Divergences(), base)
    assert len(comp.fixed) == 1
    seen = []

    def replay(request):
        seen.append(request)
        return {"replays": [{"status": "diverged", "what": "offset differs", "op": {"op": "trim", "n": -4}}]}

    monkeypatch.setattr(review, "replay_side", replay)
    review.cross_check(comp, Request("conformance", {}, tmp_path), Baseline("report", str(tmp_path / "r.json")),
                       sys.executable)
    assert seen and seen[0]["items"][0]["trace"] == str(trace)
    assert not comp.fixed and [e["key"] for e in comp.both] == [base.by_key.popitem()[0]]
    assert "the head diverges on the base's trace" in comp.both[0]["note"]


@pytest.mark.parametrize("code", [3, 0])
def test_a_side_that_could_not_run_is_a_side_failure(tmp_path, code):
    # review_side exits 3 with the error in its result: no verdict, never "no divergences"
    result, log = tmp_path / "base.result.json", tmp_path / "base.log"
    result.write_text(json.dumps({"error": "no module named mlx_lm", "classes": [], "runs": []}))
    log.write_text("")
    proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({code})"])
    with pytest.raises(review.SideFailure, match="no module named mlx_lm"):
        review.finish_side(proc, result, log, "base", time.monotonic() + 60)


def test_an_isolated_side_drops_the_current_folder_and_from_cwd(tmp_path, monkeypatch):
    from kvspec.fuzz import targets
    from kvspec.fuzz.commands import review_side

    monkeypatch.chdir(tmp_path)
    here = os.getcwd()
    monkeypatch.setattr(sys, "path", ["", ".", here, *sys.path])
    monkeypatch.setattr(targets, "FROM_CWD", True)
    seen = []
    monkeypatch.setattr(review, "serve", lambda request: seen.append((list(sys.path), targets.FROM_CWD)) or 0)
    base = tmp_path / "base"
    request = tmp_path / "req.json"
    request.write_text(json.dumps({"command": "replay", "items": [], "isolate": True, "path": [str(base)]}))
    assert review_side.main([str(request)]) == 0
    (path, from_cwd), = seen
    assert path[0] == str(base) and not {"", ".", here} & set(path) and from_cwd is False
    # the head's side (no isolate) keeps them
    seen.clear()
    monkeypatch.setattr(sys, "path", ["", ".", here, *sys.path])
    monkeypatch.setattr(targets, "FROM_CWD", True)
    request.write_text(json.dumps({"command": "replay", "items": []}))
    assert review_side.main([str(request)]) == 0
    assert here in seen[0][0] and seen[0][1] is True


def test_from_cwd_off_never_puts_the_current_folder_on_the_path(tmp_path, monkeypatch):
    from kvspec.fuzz import targets

    monkeypatch.chdir(tmp_path)
    here = os.getcwd()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and os.path.realpath(p) != here])
    monkeypatch.setattr(targets, "FROM_CWD", False)
    targets._cwd_on_path()
    assert here not in sys.path
    monkeypatch.setattr(targets, "FROM_CWD", True)
    targets._cwd_on_path()
    assert sys.path[0] == here


def _child(monkeypatch, stdout: str, returncode: int = 0, stderr: str = "") -> list:
    # the obligation's process is a child of the proof zygote (kvspec.fuzz.zygote): what it gives back is faked here
    from kvspec.fuzz import zygote

    calls = []

    class Fake:
        def run(self, func, args=()):
            calls.append((func, *args))
            return subprocess.CompletedProcess([func, *args], returncode, stdout, stderr)

    monkeypatch.setattr(zygote, "shared", lambda preload: Fake())
    return calls


@pytest.mark.parametrize("stdout,code", [("", 1), ("", 0), ("Traceback ...\nMemoryError\n", 1)],
                         ids=["silent-exit-1", "silent-exit-0", "traceback"])
def test_an_obligation_process_without_a_result_is_a_tool_failure(monkeypatch, stdout, code):
    calls = _child(monkeypatch, stdout, code, "killed")
    (check,) = verify.check_obligation(5)
    assert calls, "the obligation runs in a process of its own"
    assert not check.ok and check.tool_failure and "gave no result" in check.detail and f"exit {code}" in check.detail


def test_an_obligation_process_result_keeps_its_warnings_and_verdict(monkeypatch):
    row = {"name": "proof front trim", "ok": True, "detail": "proved", "seconds": 0.5, "trace": None,
           "warnings": ["one explained", "two"], "tool_failure": False, "unknown_field": 1}
    _child(monkeypatch, "z3 chatter\n" + json.dumps([row]) + "\n")
    (check,) = verify.check_obligation(5)
    assert check == verify.Check("proof front trim", True, "proved", 0.5, warnings=("one explained", "two"))
    _child(monkeypatch, json.dumps([{**row, "ok": False, "warnings": [], "tool_failure": True}]) + "\n")
    (check,) = verify.check_obligation(5)
    assert not check.ok and check.tool_failure and check.warnings == ()


@pytest.mark.parametrize("rc,out", [(0, ""), (1, ""), (0, "some chatter without a condition line\n")],
                         ids=["silent-0", "silent-1", "chatter"])
def test_crosshair_without_a_condition_line_and_without_a_traceback_is_no_verdict(monkeypatch, rc, out):
    # --report_all prints every condition it checked: none at all is CrossHair failing, even with no traceback
    from kvspec.proofs import crosshair_run

    monkeypatch.setattr(crosshair_run, "_run", lambda cmd, timeout: (rc, out))
    conds, errors = crosshair_run.check_targets(["spec/x.py"], 5)
    assert not conds and len(errors) == 1 and "no verdict" in errors[0], errors


def test_crosshair_targets_a_function_by_the_line_of_its_def(tmp_path, monkeypatch):
    # beside an explained function, each other one is named FILE:LINE with LINE its def's (not its docstring's)
    from kvspec.proofs import crosshair_run

    src = tmp_path / "contracts.py"
    src.write_text('import functools\n\n\ndef explained(x: int) -> int:\n    """\n    post: __return__ == x\n    """\n'
                   '    return x\n\n\n@functools.lru_cache\ndef checked(\n        x: int) -> int:\n\n'
                   '    """Checked.\n\n    post: __return__ > x\n    """\n    return x + 1\n')
    monkeypatch.setitem(crosshair_run.EXPLAINED, (str(src), "explained"), "a reason")
    seen = []
    monkeypatch.setattr(crosshair_run, "check_targets", lambda targets, t: seen.append(list(targets)) or ([], []))
    conds, errors = crosshair_run.check_file(src, 5)
    assert seen == [[f"{src}:12"]] and not errors
    assert [(c.function, c.line) for c in conds] == [("explained", 6)]
