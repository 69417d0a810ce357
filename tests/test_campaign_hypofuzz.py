"""``kvspec campaign``: the state machines under HypoFuzz (docs/campaigns.md).

A short campaign on one process with an injected bug: while it runs, its
dashboard serves the page and reports progress (inputs run) for our
machine; the failure comes out as a kvtrace that ``kvspec replay``
reproduces on the bug and that passes on the real implementation. Without
HypoFuzz the command exits 2 naming the extra. HypoFuzz is installed by
``make test`` (the Makefile installs the extra 'campaign'); the test skips,
saying so, only where it is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvspec.fuzz.commands.cli import main

REPO = Path(__file__).resolve().parent.parent
BUG = "negative_trim_grows_offset"
NODE = "fuzz/hypofuzz_targets.py::Test_dense_fp16_inplace::runTest"

needs_hypofuzz = pytest.mark.skipif(importlib.util.find_spec("hypofuzz") is None,
                                    reason="HypoFuzz (the extra 'campaign') is not installed: pip install -e '.[campaign]'")


def valid(doc: dict) -> dict:
    """``doc`` follows fuzz/schemas/campaign.schema.json (docs/json.md)."""
    import jsonschema

    schema = json.loads((REPO / "fuzz" / "schemas" / "campaign.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    return doc


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return resp.read()
    except OSError:
        return None


def _campaign(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, int, Path]:
    """``kvspec campaign`` on one process with its dashboard on a free port,
    its failures to ``tmp_path/out``, started as a user would."""
    port = _port()
    out, db = tmp_path / "out", tmp_path / "db"
    cmd = [sys.executable, "-m", "kvspec.fuzz.commands.cli", "campaign", "-j", "1", "--port", str(port),
           "--out", str(out), "--db", str(db), "--json", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # CI set as a CI service sets it: Hypothesis then loads its "ci"
                            # profile (derandomize=True), under which HypoFuzz collected no test
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "CI": "true"})
    return proc, port, out


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@needs_hypofuzz
def test_a_campaign_serves_its_dashboard_and_stops_on_ctrl_c(tmp_path):
    """A campaign with no bug runs its budget; meanwhile its dashboard
    serves the page and reports inputs run for our machine. Interrupted as
    a user would (Ctrl-C): exit 130, and the report carries that progress.
    (No bug, so the search cannot end by itself before the dashboard is
    read: that race failed this test on a loaded CI machine.)"""
    import signal

    proc, port, _ = _campaign(tmp_path, "--only", "dense/fp16/inplace", "--budget", "300")
    page, progress, stdout, stderr = None, None, "", ""
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and not (page and progress):
            page = page or _get(f"http://127.0.0.1:{port}/")
            raw = _get(f"http://127.0.0.1:{port}/api/tests/")
            if raw:
                tests = json.loads(raw)
                reports = [r for rs in tests.get(NODE, {}).get("reports_by_worker", {}).values() for r in rs]
                if reports and sum(reports[-1]["status_counts"].values()) > 0:
                    progress = reports[-1]
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
    finally:
        stdout, stderr = _finish(proc, 60)
    assert page is not None and b"<html" in page.lower(), (proc.returncode, page, stderr[-2000:])
    assert progress is not None, f"the dashboard never reported inputs for {NODE}; {stderr[-2000:]}"
    report = valid(json.loads(stdout))
    assert proc.returncode == 130 and report["exit"] == 130 and report["interrupted"], (report, stderr[-2000:])
    assert report["dashboard"] == f"http://127.0.0.1:{port}/"
    assert report["progress"][NODE]["inputs"] > 0, report["progress"]
    assert report["campaigns"] == ["dense/fp16/inplace"] and report["failures"] == [], report


@needs_hypofuzz
def test_a_campaign_on_a_bug_ends_by_itself_with_a_trace_that_replays(tmp_path, capsys):
    """With an injected bug the search ends by itself once HypoFuzz has
    found and shrunk the failure (exit 1); the report still carries the
    dashboard's progress (the campaign waits for a dashboard that started
    after the failure was found), and the failure is a kvtrace that
    ``kvspec replay`` reproduces on the bug and that passes on the real
    implementation. The trace is whatever failing run was last written, so
    it need not be minimal, but it must fail on the bug."""
    proc, port, _ = _campaign(tmp_path, "--bug", BUG, "--budget", "240")
    stdout, stderr = _finish(proc, 400)  # budget 240 s + the dashboard wait (60 s) + stopping
    report = valid(json.loads(stdout))
    assert proc.returncode == 1 and report["exit"] == 1 and not report["interrupted"], (report, stderr[-2000:])
    assert report["dashboard"] == f"http://127.0.0.1:{port}/"
    assert report["progress"][NODE]["inputs"] > 0 and report["progress"][NODE]["failures"] >= 1, report["progress"]
    assert report["campaigns"] == ["dense/fp16/inplace"] and len(report["failures"]) == 1, report
    trace = report["failures"][0]["trace"]
    assert report["failures"][0]["replay"] == f"kvspec replay {trace} --bug {BUG}"
    assert main(["replay", trace, "--bug", BUG]) == 1  # reproduced on the bug
    assert main(["replay", trace]) == 0  # and clean on the real implementation
    ops = [op for op in json.loads(Path(trace).read_text())["ops"] if op["op"] != "expect"]
    assert any(op["op"] == "trim" and op["n"] < 0 for op in ops), ops  # the bug needs a negative trim
    capsys.readouterr()


def test_without_hypofuzz_the_command_names_the_extra(monkeypatch, capsys, tmp_path):
    from kvspec.fuzz.commands import campaign

    real = importlib.util.find_spec
    monkeypatch.setattr(campaign.importlib.util, "find_spec", lambda name, *a: None if name == "hypofuzz" else real(name, *a))
    assert main(["campaign", "--budget", "1", "--db", str(tmp_path), "--json"]) == 2
    err = valid(json.loads(capsys.readouterr().out))["error"]
    assert "'campaign'" in err and "pip install 'kvspec[campaign]'" in err, err


def test_campaign_refuses_bad_arguments(capsys, tmp_path):
    assert main(["campaign", "--db", "none", "--budget", "1"]) == 2
    assert "needs an example database" in capsys.readouterr().out
    assert main(["campaign", "--only", "nosuchkind", "--budget", "1", "--db", str(tmp_path)]) == 2
    assert "matches no campaign" in capsys.readouterr().out
    assert main(["campaign", "--bug", "nosuchbug", "--budget", "1", "--db", str(tmp_path)]) == 2
    assert "nosuchbug" in capsys.readouterr().out


#: a stand-in for HypoFuzz's hub, as it behaves: spawned workers, and a hub
#: that never looks at them (worker 0 exits at once when told to die)
FAKE_HUB = """
import multiprocessing, os, sys, time

def worker(die):
    if die == 'found':  # a failure found and shrunk: its trace written, the worker ends
        out, run = os.environ['KVSPEC_CAMPAIGN_OUT'], os.environ['KVSPEC_CAMPAIGN_RUN']
        with open(os.path.join(out, f'campaign-dense-fp16-inplace-{run}.json'), 'w') as f:
            f.write('{}')
        time.sleep(1.5)
        os._exit(0)
    if die:
        time.sleep(1.5)
        os._exit(137)
    time.sleep(600)

if __name__ == '__main__':
    multiprocessing.set_start_method('spawn', force=True)
    die = os.environ.get('FAKE_HUB_DIE')
    procs = [multiprocessing.Process(target=worker, args=(i == 0 and die in ('worker', 'found') and die,))
             for i in range(2)]
    for p in procs:
        p.start()
    print('using 2 processes to fuzz 1 test', flush=True)
    if die == 'hub':
        time.sleep(1.5)
        print('Traceback (most recent call last): planted', flush=True)
        for p in procs:
            p.kill()
        sys.exit(3)
    while True:
        time.sleep(60)
"""


@pytest.mark.parametrize("die", ["worker", "hub", None, "found"])
def test_a_worker_that_dies_is_not_reported_as_no_failure(monkeypatch, capsys, tmp_path, die):
    """HypoFuzz's hub never checks its workers: one killed mid-run (for
    memory, a crash in native code) leaves it waiting, and the campaign
    said "no failure" (exit 0) for a search that had stopped. Here a
    stand-in hub whose first worker dies after 1.5 s: exit 2 naming the
    death; a hub that exits by itself (an error of its own) after 1.5 s:
    exit 2 naming its exit status (a check of that early exit could be
    dropped and every other test passed); the same hub whose workers live:
    exit 0. A worker that ends after every campaign's failure was written
    ends the search (exit 1) long before its budget: the hub would notice
    only at its next minute."""
    from kvspec.fuzz.commands import campaign

    script = tmp_path / "hub.py"
    script.write_text(FAKE_HUB)
    monkeypatch.setattr(campaign, "LAUNCH", f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    monkeypatch.setattr(campaign, "hypofuzz_missing", lambda: None)
    monkeypatch.setenv("FAKE_HUB_DIE", die or "")
    budget = ["--budget", "120", "--only", "dense/fp16/inplace"] if die == "found" else ["--budget", "5"]
    code = main(["campaign", *budget, "-j", "2", "--no-dashboard", "--db", str(tmp_path / "db"),
                 "--out", str(tmp_path / "out"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    if die == "found":
        assert code == 1 and len(doc["failures"]) == 1 and not doc["interrupted"], doc
        assert doc["seconds"] < 60, doc  # a bound far from both: the end came from the worker, not the budget
    elif die == "worker":
        assert code == 2, doc
        assert "HypoFuzz process died" in doc["error"] and "did not run its budget" in doc["error"], doc
    elif die == "hub":
        assert code == 2, doc
        assert "HypoFuzz stopped after" in doc["error"] and "(exit 3)" in doc["error"], doc
    else:
        assert code == 0 and doc["ok"] and doc["failures"] == [], doc
