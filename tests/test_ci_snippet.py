"""docs/ci/engine-pr.yml, the GitHub Actions workflow docs/review.md gives
an engine's repository, is run here step by step: its checkouts become two
local copies of mlx-lm (the head with a planted KVCache.trim fault), its
install step (which needs the network) becomes two environments that differ
only in where mlx_lm comes from, and every other ``run:`` step runs as
written, under the workflow's ``env``. The comparison must fail the job
(exit 1) and leave the JUnit report and the SARIF the upload steps send."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("mlx_lm")

REPO = Path(__file__).resolve().parents[1]
SNIPPET = REPO / "docs" / "ci" / "engine-pr.yml"
#: the workflow's env, made small enough for a test (the rest as written)
OVERRIDES = {"CLASSES": "--class KVCache", "EXAMPLES": "25"}


def workflow() -> dict[str, Any]:
    doc = yaml.safe_load(SNIPPET.read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the key `on` as true
    return doc


def steps() -> list[dict[str, Any]]:
    jobs = workflow()["jobs"]
    assert len(jobs) == 1
    return next(iter(jobs.values()))["steps"]


def test_the_snippet_runs_on_pull_requests_and_uploads_its_reports():
    doc = workflow()
    assert "pull_request" in doc["on"]
    uses = [s.get("uses", "") for s in steps()]
    checkouts = [s for s in steps() if s.get("uses", "").startswith("actions/checkout@")]
    assert {c["with"]["path"] for c in checkouts} == {"head", "base"}
    assert any("pull_request.base.sha" in str(c["with"].get("ref", "")) for c in checkouts)
    assert any(u.startswith("actions/upload-artifact@") for u in uses)
    assert any(u.startswith("github/codeql-action/upload-sarif@") for u in uses)
    for s in steps():
        if s.get("uses", "").startswith(("actions/upload-artifact@", "github/codeql-action/upload-sarif@")):
            assert str(s.get("if", "")).startswith("always()"), s  # reports go up when the comparison fails


def _copy_engine(dest: Path, planted: bool) -> None:
    import mlx_lm

    shutil.copytree(Path(mlx_lm.__file__).parent, dest / "mlx_lm", ignore=shutil.ignore_patterns("__pycache__"))
    if planted:
        cache = dest / "mlx_lm" / "models" / "cache.py"
        text = cache.read_text()
        start, end = text.index("class KVCache(_BaseCache):"), text.index("class RotatingKVCache")
        clamped = "        n = min(self.offset, n)\n        self.offset -= n\n        return n"
        cache.write_text(text[:start] + text[start:end].replace(clamped, "        self.offset -= n\n        return n")
                         + text[end:])


def _environment(venv: Path, engine: Path) -> None:
    """What ``python -m venv VENV; VENV/bin/pip install kvspec ENGINE``
    makes, without the network: this interpreter and its kvspec, with the
    engine's checkout first on the import path."""
    (venv / "bin").mkdir(parents=True)
    bindir = Path(sys.executable).parent
    for name, real in (("python", sys.executable), ("kvspec", str(bindir / "kvspec"))):
        script = venv / "bin" / name
        script.write_text(f'#!/bin/sh\nPYTHONPATH="{engine}" exec "{real}" "$@"\n')
        script.chmod(script.stat().st_mode | stat.S_IXUSR)


def _install(step: dict[str, Any], ws: Path) -> None:
    """Read the install step's venvs and what each gets, and make them."""
    text = step["run"]
    venvs = re.findall(r"python -m venv (\S+)", text)
    assert venvs, text
    for venv in venvs:
        m = re.search(rf"{re.escape(venv)}/bin/pip install .*?(\./\S+)\s*$", text, re.MULTILINE)
        assert m and '"$KVSPEC"' in m.group(0), f"{venv} must get kvspec and the engine's checkout: {text}"
        _environment(ws / venv, (ws / m.group(1)).resolve())


def test_the_snippet_steps_run_and_fail_the_job_on_an_added_divergence(tmp_path):
    ws = tmp_path / "workspace"
    ws.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({k: str(v) for k, v in workflow().get("env", {}).items()})
    env.update(OVERRIDES)
    ran: dict[str, int] = {}
    for step in steps():
        uses = step.get("uses", "")
        if uses.startswith("actions/checkout@"):
            _copy_engine(ws / step["with"]["path"], planted=step["with"]["path"] == "head")
        elif uses.startswith("actions/setup-python@"):
            continue
        elif step.get("id") == "install":
            _install(step, ws)
        elif "run" in step:
            p = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]], cwd=ws,
                               env={**env, **{k: str(v) for k, v in step.get("env", {}).items()}},
                               capture_output=True, text=True, timeout=600, check=False)
            ran[step.get("id", step.get("name", "?"))] = p.returncode
            if step.get("id") == "compare":
                assert p.returncode == 1, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
                assert "KVCache" in p.stdout and "trim n>0" in p.stdout and "added" in p.stdout, p.stdout
            else:
                assert p.returncode == 0, f"{step.get('name')}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
        elif uses.startswith("actions/upload-artifact@"):
            assert (ws / step["with"]["path"]).exists(), step
        elif uses.startswith("github/codeql-action/upload-sarif@"):
            sarif = json.loads((ws / step["with"]["sarif_file"]).read_text())
            rules = [r["ruleId"] for r in sarif["runs"][0]["results"]]
            assert rules == ["return-value-differs"], rules
        else:
            raise AssertionError(f"a step this test does not know how to run: {step}")
    assert ran.get("compare") == 1
    junit = next(ws.glob("**/junit.xml")).read_text()
    assert junit.count("<failure") == 1 and "trim n&gt;0" in junit


def test_the_review_page_shows_the_tested_file():
    page = (REPO / "docs" / "review.md").read_text()
    assert f"```yaml\n{SNIPPET.read_text()}```" in page, "docs/review.md's workflow differs from docs/ci/engine-pr.yml"
