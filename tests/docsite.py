"""The docs site, built once per test session (tests/test_docs.py and
tests/test_docs_browser.py share it): ``mkdocs build --strict`` into
``docs-artifacts/site`` (ignored by git)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "docs-artifacts"


@functools.cache
def build() -> tuple[Path, str]:
    """(site folder, build log); raises AssertionError with the log when the
    strict build fails. (Not ``-q``: MkDocs' quiet mode also stops strict
    mode from counting warnings, so a broken link would pass.)"""
    out = ARTIFACTS / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                         check=False, cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    return out, log
