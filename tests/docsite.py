"""The docs site, built once per test session (tests/test_docs.py and
tests/test_docs_browser.py share it): ``mkdocs build --strict`` into
``docs-artifacts/site`` (ignored by git).

Under pytest-xdist (``make test``) the two files may run on two workers at
once: the build holds an exclusive lock on ``docs-artifacts/site.lock``, and
the worker that builds first records its run id (``PYTEST_XDIST_TESTRUNUID``,
the same in every worker of one run) with the build's exit status and log,
so the other worker waits for that build and reuses it instead of building
into the same folder at the same time."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "docs-artifacts"
#: Debian's Chromium (.ci/run installs it); Playwright drives it, nothing is downloaded
CHROMIUM = Path("/usr/bin/chromium")


def browser_missing() -> str | None:
    """Why a browser test cannot run here (Playwright or Chromium absent), or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:  # pragma: no cover - the docs extra is not installed
        return f"Playwright is not installed ({exc}); pip install -e '.[docs]'"
    if not CHROMIUM.exists():  # pragma: no cover - depends on the machine
        return f"{CHROMIUM} is absent: apt-get install -y chromium (.ci/run does)"
    return None


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless :data:`CHROMIUM` browser through Playwright, closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@functools.cache
def build() -> tuple[Path, str]:
    """(site folder, build log); raises AssertionError with the log when the
    strict build fails. (Not ``-q``: MkDocs' quiet mode also stops strict
    mode from counting warnings, so a broken link would pass.)"""
    out = ARTIFACTS / "site"
    ARTIFACTS.mkdir(exist_ok=True)
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    stamp = ARTIFACTS / "site.build.json"
    with open(ARTIFACTS / "site.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = json.loads(stamp.read_text()) if run_id and stamp.exists() else {}
        if done.get("run") == run_id and run_id:
            code, log = done["code"], done["log"]
        else:
            stamp.unlink(missing_ok=True)
            env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
            run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                                 check=False, cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
            code, log = run.returncode, run.stdout + run.stderr
            if run_id:
                stamp.write_text(json.dumps({"run": run_id, "code": code, "log": log}))
    assert code == 0, f"mkdocs build --strict failed:\n{log}"
    return out, log
