"""``kvspec campaign``: the state machines under HypoFuzz on every core.

HypoFuzz (``pip install 'kvspec[campaign]'``; AGPL-3.0, so an optional
extra that no kvspec module imports) is a coverage-guided, adaptive fuzzer
for Hypothesis tests: its workers spend their time on the tests that still
find new behaviour, and its dashboard (a web page) shows each test's
inputs, coverage (behaviours and fingerprints) and failures as they come.
This command starts it as a child process on the machines of
``fuzz/hypofuzz_targets.py`` (every campaign of the registry, or one bug's),
for ``--budget`` seconds (or until every machine has failed and HypoFuzz
has shrunk each failure), then stops it and reports: each failure is a
kvtrace in ``--out`` (the shortest failing run seen, written by the
machine itself) with the command that replays it. docs/campaigns.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

#: the extra that installs HypoFuzz (pyproject.toml)
EXTRA = "campaign"
#: what HypoFuzz's ``fuzz`` command is started with: workers in spawned
#: processes (MLX hangs in a forked child once its parent evaluated an array)
LAUNCH = ("import multiprocessing, sys\n"
          "multiprocessing.set_start_method('spawn', force=True)\n"
          "from hypofuzz.entrypoint import fuzz\n"
          "fuzz.main(args=sys.argv[1:], prog_name='kvspec campaign')\n")
#: what HypoFuzz prints when its workers stop because every test has failed
ALL_FAILED = "Found a failing input for every test"
#: seconds a search that ended by itself waits for its dashboard to report
#: (:func:`_final_progress`)
DASHBOARD_WAIT = 60.0
TARGETS = Path(__file__).resolve().parents[1] / "hypofuzz_targets.py"


def hypofuzz_missing() -> str | None:
    """Why HypoFuzz cannot run here (None: it can)."""
    if importlib.util.find_spec("hypofuzz") is None:
        return (f"kvspec campaign needs HypoFuzz, the optional extra '{EXTRA}' (AGPL-3.0, so not installed by "
                f"default): pip install 'kvspec[{EXTRA}]' (or pip install hypofuzz)")
    return None


def dashboard_progress(url: str, timeout: float = 5.0) -> dict[str, dict[str, Any]]:
    """Per test (its pytest node id): inputs run, behaviours and
    fingerprints (coverage) and failures, as the dashboard at ``url``
    reports them (its ``/api/tests/``: the latest report of each worker,
    summed). Raises OSError when it does not answer."""
    with urllib.request.urlopen(url.rstrip("/") + "/api/tests/", timeout=timeout) as resp:
        tests = json.loads(resp.read())
    out = {}
    for nodeid, test in tests.items():
        latest = [reports[-1] for reports in test.get("reports_by_worker", {}).values() if reports]
        out[nodeid] = {
            "inputs": sum(sum(r.get("status_counts", {}).values()) for r in latest),
            "behaviors": max((r.get("behaviors", 0) for r in latest), default=0),
            "fingerprints": max((r.get("fingerprints", 0) for r in latest), default=0),
            "failures": len(test.get("failures") or {}),
            # failures HypoFuzz has finished shrinking
            "shrunk": sum(1 for f in (test.get("failures") or {}).values() if f.get("state") == "shrunk"),
        }
    return out


def spawned_children(session: int) -> set[int]:
    """Process ids of the live processes of ``session`` that multiprocessing
    spawned (``spawn_main`` on their command line): HypoFuzz's workers, its
    manager and its dashboard, every one of which lives until the campaign
    stops it. Read from Linux's ``/proc`` (an empty set elsewhere, where
    no death can be seen); a zombie has no command line and is not live."""
    out: set[int] = set()
    root = Path("/proc")
    if not root.is_dir():
        return out
    for entry in root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # the fields after the command's closing parenthesis: state ppid pgrp session ...
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) != session:
                continue
            if b"spawn_main" in (entry / "cmdline").read_bytes():
                out.add(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _stop(proc: subprocess.Popen) -> None:
    """Stop HypoFuzz and its workers (their own process group): SIGINT,
    then SIGKILL after 10 s."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGINT, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_campaign(args: argparse.Namespace, console: Any, usage_error: Any, db_spec: str) -> int:
    """Exit 0: ran the budget and found nothing; 1: a failure (its kvtrace
    written); 2: bad arguments, HypoFuzz missing or failing to start, or a
    process HypoFuzz spawned dying during the run (:func:`spawned_children`);
    130: interrupted (what was found so far is reported). ``args.bug`` is
    a catalog name the caller checked."""
    from rich.markup import escape

    from kvspec.fuzz.hypofuzz_targets import configs

    only = ",".join(args.only or [])
    chosen = configs(only)
    if args.bug:  # a bug runs in its own configuration (fuzz/hypofuzz_targets.py)
        from kvspec.fuzz.bugs import by_name

        bug = by_name(args.bug)
        chosen = [(bug.kind, bug.modes[0], bug.inplace)]
    if not chosen:
        return usage_error(console, f"--only {only}: matches no campaign; have "
                                    + ", ".join(f"{k}/{m}/{'inplace' if ip else 'copy'}" for k, m, ip in configs(None)),
                           args.json)
    missing = hypofuzz_missing()
    if missing:
        return usage_error(console, missing, args.json)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    jobs = args.jobs or os.cpu_count() or 1
    run = time.strftime("%Y%m%d-%H%M%S")
    env = {**os.environ, "KVSPEC_CAMPAIGN_OUT": str(out), "KVSPEC_CAMPAIGN_DB": db_spec,
           "KVSPEC_CAMPAIGN_BUG": args.bug or "", "KVSPEC_CAMPAIGN_ONLY": only,
           "KVSPEC_CAMPAIGN_RUN": run,
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-c", LAUNCH, "-n", str(jobs)]
    url = None
    if args.dashboard:
        port = args.port if args.port else _free_port(args.host)
        url = f"http://{args.host}:{port}/"
        cmd += ["--dashboard", "--host", args.host, "--port", str(port)]
    else:
        cmd += ["--no-dashboard"]
    # the pytest arguments: our targets only, no cache folder, no plugins of the checkout's tests
    cmd += ["--", str(TARGETS), "-q", "-p", "no:cacheprovider", "--rootdir", str(TARGETS.parent.parent)]
    err = console if not args.json else None
    if err is not None:
        what = f"bug {args.bug}" if args.bug else f"{len(chosen)} campaign{'s' * (len(chosen) > 1)}"
        err.print(f"kvspec campaign: HypoFuzz on {jobs} process{'es' * (jobs > 1)}, {what}, {args.budget:g} s; "
                  f"example database {db_spec}; failures to {out}"
                  + (f"\n  dashboard (coverage and progress): {url}" if url else ""), markup=False)
    log_path = out / f"campaign-{run}.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=str(TARGETS.parent.parent))
    start = time.monotonic()
    progress: dict[str, dict[str, Any]] = {}
    interrupted = False
    # HypoFuzz's hub never looks at its workers: one that dies (killed for
    # memory, a crash in native code) leaves the hub waiting and the
    # campaign would report "no failure" for a search that stopped
    seen: set[int] = set()
    died: dict[int, float] = {}
    #: seconds into the run when every campaign had its failure's trace
    all_found: float | None = None
    try:
        while time.monotonic() - start < args.budget and proc.poll() is None:
            time.sleep(min(1.0, max(args.budget - (time.monotonic() - start), 0.05)))
            if all_found is None and len(list(out.glob(f"campaign-*-{run}.json"))) >= len(chosen):
                all_found = time.monotonic() - start
            if proc.poll() is None:
                live = spawned_children(proc.pid)
                died.update((pid, time.monotonic() - start) for pid in seen - live - set(died))
                seen |= live
            # every campaign has failed and a HypoFuzz worker has ended since (its shrinking
            # done): nothing is left to search. HypoFuzz's hub looks at its workers only once
            # a minute, and would keep the campaign waiting until then.
            if all_found is not None and any(t >= all_found for t in died.values()):
                break
            if url is not None:
                try:
                    progress = dashboard_progress(url, timeout=2.0) or progress
                except (OSError, ValueError):
                    pass
                # every machine has failed and its failure is shrunk: nothing is left to search
                if len(progress) >= len(chosen) and all(p["shrunk"] for p in progress.values()):
                    break
            # HypoFuzz's workers stop once every machine has failed (its dashboard stays up)
            if ALL_FAILED in log_path.read_text(errors="replace"):
                break
    except KeyboardInterrupt:
        interrupted = True
    finally:
        exited_early = proc.poll() is not None
        if url is not None and not exited_early:  # the progress at the end, before the dashboard stops
            progress = _final_progress(url, progress, len(chosen), wait=0.0 if interrupted else DASHBOARD_WAIT)
        _stop(proc)
        log.close()
    seconds = time.monotonic() - start
    log_text = log_path.read_text(errors="replace")
    # HypoFuzz exits by itself only when every machine has failed, or on an error of its own
    if exited_early and ALL_FAILED not in log_text:
        last = (log_text.strip().splitlines() or ["(empty)"])[-1]
        return usage_error(console, f"HypoFuzz stopped after {seconds:.0f} s (exit {proc.returncode}): {last} "
                                    f"(its log: {log_path})", args.json)
    found = sorted(out.glob(f"campaign-*-{run}.json"))
    extra = f" --bug {args.bug}" if args.bug else ""
    failures = [{"trace": str(p), "replay": f"kvspec replay {p}{extra}"} for p in found]
    if died and not failures and not interrupted:
        pids = ", ".join(f"{pid} after {t:.0f} s" for pid, t in sorted(died.items(), key=lambda kv: kv[1]))
        return usage_error(console, f"a HypoFuzz process died during the campaign (pid {pids}): the search did not "
                                    f"run its budget, so 'no failure' would be unfounded (its log: {log_path})",
                           args.json)
    code = 130 if interrupted else (1 if failures else 0)
    if args.json:
        print(json.dumps({"ok": code == 0, "exit": code, "seconds": round(seconds, 1), "jobs": jobs,
                          "interrupted": interrupted,
                          "dashboard": url, "database": db_spec, "bug": args.bug,
                          "campaigns": [f"{k}/{m}/{'inplace' if ip else 'copy'}" for k, m, ip in chosen],
                          "progress": progress, "failures": failures, "log": str(log_path)}))
        return code
    if progress:
        console.print("progress (HypoFuzz's dashboard: inputs run, behaviours and fingerprints covered):")
        for nodeid, p in sorted(progress.items()):
            console.print(f"  {escape(nodeid.split('::')[-1])}: {p['inputs']} inputs, {p['behaviors']} behaviours, "
                          f"{p['fingerprints']} fingerprints" + (f", [bold red]{p['failures']} failing[/]"
                                                                  if p["failures"] else ""))
    for f in failures:
        console.print(f"[bold red]failure[/]: trace {escape(f['trace'])}\n  replay it: {escape(f['replay'])}")
    if not failures:
        console.print(f"no failure in {seconds:.0f} s" + ("" if progress else
                                                          f" (HypoFuzz's log: {log_path})"))
    if interrupted:
        console.print("[bold yellow]interrupted[/]: the traces above are what was found")
    return code


def _final_progress(url: str, progress: dict[str, dict[str, Any]], tests: int,
                    wait: float) -> dict[str, dict[str, Any]]:
    """The dashboard's last word before the campaign stops it. A search can
    end (every machine failed and was shrunk) before the dashboard, a
    process of its own, has started on a busy machine; the report would
    then carry no progress at all. So wait up to ``wait`` seconds for the
    dashboard to report inputs for each of the ``tests`` campaigns (one
    read, no wait, after Ctrl-C)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            progress = dashboard_progress(url, timeout=2.0) or progress
        except (OSError, ValueError):
            pass
        except KeyboardInterrupt:
            return progress
        if len(progress) >= tests and all(p["inputs"] > 0 for p in progress.values()):
            return progress
        if time.monotonic() >= deadline:
            return progress
        try:
            time.sleep(0.5)
        except KeyboardInterrupt:
            return progress


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
