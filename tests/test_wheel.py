"""kvspec as a user installs it: the sdist built from this tree, the wheel built
from that sdist and installed alone
(with the extra ``test``, pytest for the plugin) into a fresh virtualenv,
runs from a scratch folder that holds the user's module ``mycache.py``:

* ``kvspec fuzz --target mycache:NegativeTrimCache`` catches the planted bug
  (exit 1) and prints a replay command;
* that replay command, run as printed from the same folder, reproduces it
  (exit 1): the target module is imported from the current folder;
* ``pytest --kvspec-target=...`` (the plugin, registered by the wheel's entry
  point) passes the correct class and fails the planted bug;
* the environment has no top-level ``spec``, ``impl``, ``proofs`` or ``fuzz``
  (kvspec's packages live under ``kvspec.``: an engine's own ``spec`` or
  ``fuzz`` is never shadowed), and ``kvspec prove`` without the extra
  ``proofs`` says what to install.

Cost: 2 to 6 minutes on two shared cores (130 s at a load average of 8, up
to 360 s at 14), almost all of it pip: the sdist and the wheel built from it, each with
build isolation (about 45 s together), the fresh virtualenv and its install of MLX, NumPy, SciPy,
Hypothesis and pytest from pip's cache (50 to 270 s); the runs take about 35 s. Where pip cannot install (no index
reachable and nothing cached) the test skips and says so; any other failure of
the build or the install fails it.

``test_every_package_is_listed`` is the cheap half: pyproject.toml lists every
package (folders with an ``__init__.py``) and maps the four folders.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

from tests.target_examples import CACHE_MODULE

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("spec", "impl", "proofs", "fuzz")
#: what pip says when it cannot reach an index or find a cached file
OFFLINE = re.compile(r"No matching distribution|Could not find a version|Failed to establish a new connection|"
                     r"Network is unreachable|Temporary failure in name resolution|ProxyError|"
                     r"Max retries exceeded|ConnectTimeout|ReadTimeout")


def _packages() -> list[str]:
    out = []
    for folder in FOLDERS:
        for init in sorted((REPO / folder).rglob("__init__.py")):
            if "__pycache__" not in init.parts:
                out.append(".".join(("kvspec", *init.parent.relative_to(REPO).parts)))
    return out


def test_every_package_is_listed():
    """A subpackage missing from ``[tool.setuptools] packages`` would be left
    out of the wheel (the editable install would still find it)."""
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(conf["packages"]) == sorted(_packages())
    assert conf["package-dir"] == {f"kvspec.{f}": f for f in FOLDERS}
    assert not (REPO / "kvspec" / "__init__.py").exists(), "kvspec is a namespace package"


def _pip(python: Path, *args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(python), "-m", "pip", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False, env=_env(python.parent))
    if proc.returncode != 0:
        if OFFLINE.search(proc.stdout + proc.stderr):
            pytest.skip(f"pip cannot install here (no index reachable, nothing cached): "
                        f"{OFFLINE.search(proc.stdout + proc.stderr).group(0)}")
        raise AssertionError(f"pip {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _env(bin_dir: Path) -> dict[str, str]:
    """The user's shell: the fresh environment's bin first, nothing of this tree."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTHONHOME")
           and not k.startswith(("PYTEST_XDIST", "COV_"))}
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(bin_dir.parent)
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtualenv holding only the wheel (and its dependencies, with
    the extra ``test``); returns its bin folder."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in FOLDERS:  # a copy: the build writes build/ and *.egg-info next to the sources
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = root / "dist"
    # the sdist first (build isolation: the build backend pyproject.toml names), then the wheel from
    # the sdist, as pip builds it for a user who installs from source
    built = subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(dist), str(src)], cwd=root,
                           capture_output=True, text=True, timeout=900, check=False)
    if built.returncode != 0 and OFFLINE.search(built.stdout + built.stderr):
        pytest.skip(f"the build backend cannot be installed here: {OFFLINE.search(built.stdout + built.stderr).group(0)}")
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    sdists = list(dist.glob("kvspec-*.tar.gz"))
    assert len(sdists) == 1, sdists
    with tarfile.open(sdists[0]) as tar:
        members = {"/".join(n.split("/")[1:]) for n in tar.getnames()}
    for folder in FOLDERS:  # every source file of the four folders is in the sdist
        for path in (src / folder).rglob("*.py"):
            assert str(path.relative_to(src)) in members, path
    assert {"pyproject.toml", "README.md"} <= members, sorted(members)[:20]
    _pip(Path(sys.executable), "wheel", "--no-deps", "-q", "-w", str(dist), str(sdists[0]), cwd=root, timeout=900)
    wheels = list(dist.glob("kvspec-*.whl"))
    assert len(wheels) == 1, wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"kvspec", next(t for t in tops if t.endswith(".dist-info"))}, tops
    inits = {".".join(n.split("/")[:-1]) for n in names if n.endswith("/__init__.py")}
    assert inits == set(_packages()), inits ^ set(_packages())
    assert "kvspec/fuzz/kvtrace.schema.json" in names and "kvspec/fuzz/schemas/fuzz.schema.json" in names
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    python = env_dir / "bin" / "python"
    _pip(python, "install", "-q", f"{wheels[0]}[test]", cwd=root, timeout=900)
    return env_dir / "bin"


def _run(bin_dir: Path, cwd: Path, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**_env(bin_dir), "COLUMNS": "200"})


@pytest.fixture
def scratch(tmp_path) -> Path:
    """A user's folder: ``mycache.py`` (ListCache correct, NegativeTrimCache
    with the planted bug) and nothing else."""
    (tmp_path / "mycache.py").write_text(CACHE_MODULE)
    return tmp_path


def test_the_installed_wheel_has_no_top_level_spec_impl_fuzz_proofs(installed, scratch):
    proc = _run(installed, scratch, str(installed / "python"), "-c",
                "import importlib.util as u, json, kvspec.fuzz.commands.cli as c; "
                "print(json.dumps([[n, bool(u.find_spec(n))] for n in ('spec', 'impl', 'proofs', 'fuzz')] "
                "+ [c.__file__]))")
    assert proc.returncode == 0, proc.stderr[-3000:]
    *found, where = json.loads(proc.stdout)
    assert not any(f for _, f in found), found
    assert "site-packages" in where and str(REPO) not in where, where
    site = Path(where).parents[3]
    assert not any((site / n).exists() for n in FOLDERS), sorted(p.name for p in site.iterdir())


def test_fuzz_a_target_and_its_printed_replay_from_a_scratch_folder(installed, scratch):
    proc = _run(installed, scratch, "kvspec", "fuzz", "--target", "mycache:NegativeTrimCache", "--examples", "50",
                "--seed", "1")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = re.search(r"replay it: (kvspec replay .*)", proc.stdout)
    assert m, proc.stdout[-3000:]
    again = _run(installed, scratch, *shlex.split(m.group(1)))
    assert again.returncode == 1, m.group(1) + "\n" + again.stdout[-3000:] + again.stderr[-3000:]
    assert "No module named" not in again.stdout + again.stderr
    # the correct class passes the same trace
    trace = shlex.split(m.group(1))[2]
    ok = _run(installed, scratch, "kvspec", "replay", trace, "--target", "mycache:ListCache")
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]


def test_the_pytest_plugin_from_a_scratch_folder(installed, scratch):
    proc = _run(installed, scratch, str(installed / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
                "--kvspec-target=mycache:ListCache", "--kvspec-target=mycache:NegativeTrimCache")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert re.search(r"\b1 failed, 1 passed\b|\b1 passed, 1 failed\b", out), out[-3000:]
    m = re.search(r"replay it: (kvspec replay \S+ --target mycache:NegativeTrimCache)", out)
    assert m, out[-3000:]
    again = _run(installed, scratch, *shlex.split(m.group(1)))
    assert again.returncode == 1, again.stdout[-3000:] + again.stderr[-3000:]


def test_prove_without_the_proofs_extra_says_what_to_install(installed, scratch):
    """The core install has no Z3: ``kvspec prove`` says so in a sentence
    (exit 2), never a traceback."""
    proc = _run(installed, scratch, "kvspec", "prove", "--only", "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert "proofs" in out and "z3" in out.lower(), out[-3000:]
