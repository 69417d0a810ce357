"""The GPU session's tools run here at toy sizes (a GPU session is short:
a tool that fails for a silly reason there costs the session)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_profile_measures_every_path_and_primitive_at_toy_sizes(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_profile", REPO / "tools/gpu_profile.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "profile.json"
    assert mod.main(["--device", "cpu", "--contexts", "16", "40", "--layers", "1", "--rounds", "1",
                     "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["paths"]) == set(mod.paths(16))
    for name, by in doc["paths"].items():
        for n, got in by.items():
            assert "error" not in got and got["step_ms"] > 0, (name, n, got)
    for n in ("16", "40"):
        prims = doc["primitives"][n]
        assert "error" not in prims, prims
        assert {"copy (floor)", "paged gather of blocks", "paged gather by runs (slices, one concatenate)",
                "table lookup by uint8 code", "hadamard transform"} == set(prims)
        assert all(p["ms"] > 0 and p["GB_per_s"] > 0 for p in prims.values())


def test_gpu_session_script_parses():
    proc = subprocess.run(["bash", "-n", str(REPO / "tools/gpu_session.sh")], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr


def test_gpu_extras_refuses_without_prepare_and_says_what_to_run(tmp_path):
    # a clone without .gpu/p2 (../shared/gpu/prepare not run): exit 2, named step
    import shutil

    subprocess.run(["git", "init", "-q", str(tmp_path / "c")], check=True)
    (tmp_path / "c/tools").mkdir()
    shutil.copy(REPO / "tools/gpu_extras.sh", tmp_path / "c/tools/gpu_extras.sh")
    r = subprocess.run(["bash", "tools/gpu_extras.sh"], cwd=tmp_path / "c", capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 2 and "prepare first" in r.stderr
    assert not (tmp_path / "c/.gpu/p3").exists()


def test_gpu_extras_looks_for_prepare_s_p2_and_goes_on_when_it_is_there(tmp_path):
    # .gpu/p1 alone is not enough; with .gpu/p2 the guard lets it through
    # (here to a PYTHON that fails at once, so nothing is downloaded)
    import shutil

    subprocess.run(["git", "init", "-q", str(tmp_path / "c")], check=True)
    (tmp_path / "c/tools").mkdir()
    shutil.copy(REPO / "tools/gpu_extras.sh", tmp_path / "c/tools/gpu_extras.sh")
    (tmp_path / "c/.gpu/p1").mkdir(parents=True)

    def run():
        return subprocess.run(["bash", "tools/gpu_extras.sh"], cwd=tmp_path / "c", capture_output=True, text=True,
                              timeout=60, check=False, env={**os.environ, "PYTHON": "false"})

    r = run()
    assert r.returncode == 2 and "prepare first" in r.stderr
    (tmp_path / "c/.gpu/p2").mkdir()
    r = run()
    assert r.returncode != 2 and "prepare first" not in r.stderr
