"""The layout contract (docs/architecture.md): one file per layer per kind,
one registry of kinds, no import circles, layers spec < impl|proofs < fuzz."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.fuzz import kinds
from kvspec.fuzz.bugs import catalog

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"],
                          cwd=root, capture_output=True, text=True, check=False, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": ""})


def test_import_contracts_hold():
    proc = lint(REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


@pytest.fixture
def copy_of_repo(tmp_path: Path) -> Path:
    for pkg in ("spec", "impl", "proofs", "fuzz"):
        # the copy is found as kvspec.<pkg> (a portion of the kvspec namespace) before the tree
        shutil.copytree(REPO / pkg, tmp_path / "kvspec" / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.parametrize("module, line, contract", [
    ("spec/errors.py", "import kvspec.impl.dense  # noqa", "spec imports nothing of the project"),
    ("proofs/domain.py", "import kvspec.impl.quant  # noqa", "proofs never import the implementation"),
    ("impl/quant.py", "import kvspec.fuzz.rows  # noqa", "layers: fuzz over impl and proofs"),
    ("impl/layers.py", "from kvspec.spec.layers import list_trim_count  # noqa", "impl takes no rule from spec"),
    ("impl/turbo.py", "import kvspec.spec.turbo  # noqa", "impl takes no rule from spec"),
    ("impl/batch.py", "from kvspec.spec.batch import trim_count  # noqa", "impl takes no rule from spec"),
    ("fuzz/lockstep.py", "import kvspec.fuzz.replay  # noqa", "fuzz reads top-down"),
    ("fuzz/commands/mutants.py", "import kvspec.fuzz.commands.verify  # noqa", "no import circles"),
    ("fuzz/commands/e2e/models.py", "import kvspec.fuzz.commands.e2e.checks  # noqa", "e2e reads top-down"),
])
def test_a_reverse_import_breaks_a_contract(copy_of_repo: Path, module: str, line: str, contract: str):
    """Each contract is seen failing: one added import the wrong way."""
    path = copy_of_repo / "kvspec" / module
    path.write_text(line + "\n" + path.read_text())
    proc = lint(copy_of_repo)
    assert proc.returncode != 0, proc.stdout[-2000:]
    broken = [ln for ln in proc.stdout.splitlines() if ln.rstrip().endswith("BROKEN")]
    assert any(contract in ln for ln in broken), proc.stdout[-3000:]


def test_impl_is_forbidden_every_spec_module_but_errors():
    """The contract "impl takes no rule from spec" names spec's modules one by
    one (import-linter has no "all but"): a spec module added later and left
    off the list would let impl take its rule unseen."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"]
                    if c["name"].startswith("impl takes no rule from spec"))
    modules = {f"kvspec.spec.{p.stem}" for p in (REPO / "spec").glob("*.py") if p.stem not in ("__init__", "errors")}
    assert set(contract["forbidden_modules"]) == modules


def test_schema_file_is_generated_from_the_registry():
    base = json.loads(kinds.SCHEMA_PATH.read_text())
    assert kinds.schema_from_registry(base) == base, "run `python -m kvspec.fuzz.kinds` to regenerate the schema"
    cache = base["$defs"]["cache"]["properties"]
    assert cache["kind"]["enum"] == list(kinds.trace_kinds())


@pytest.mark.parametrize("name", list(kinds.KINDS))
def test_a_kind_is_one_file_per_layer(name: str):
    kind = kinds.KINDS[name]
    missing = [path for path in kind.files.values() if not (REPO / path).is_file()]
    assert not missing, f"kind {name}: missing {missing}"
    machine, lockstep = kind.machine_class(), kind.lockstep_class()
    assert machine.kind == kind.kind
    assert machine.__module__ == lockstep.__module__ == f"kvspec.fuzz.{name}"
    bugs = kind.bug_list()
    assert bugs and all(b.kind == kind.kind and set(b.modes) <= set(kind.modes) for b in bugs)
    assert {b.name for b in bugs} <= {b.name for b in catalog()}


def test_docs_index_every_kind():
    """The README's reading order and docs/architecture.md name every kind's page."""
    from kvspec.fuzz.docgen import expand

    for doc in ("README.md", "docs/architecture.md"):
        text = expand((REPO / doc).read_text(), doc)
        for kind in kinds.KINDS.values():
            assert kind.files["docs"] in text, f"{doc} does not name {kind.files['docs']}"


def test_architecture_table_matches_the_registry():
    """The page asks for the generated kinds table and picture; the table
    has one row per registry entry with its trace kind and modes."""
    from kvspec.fuzz.docgen import expand

    raw = (REPO / "docs/architecture.md").read_text()
    assert "<!-- kvspec: table kinds -->" in raw and "<!-- kvspec: picture architecture -->" in raw
    text = expand(raw, "architecture.md")
    for kind in kinds.KINDS.values():
        modes = ", ".join(f"`{m}`" for m in kind.modes)
        row = f"| `{kind.name}` | `{kind.kind}` | {modes} |"
        assert row in text, f"docs/architecture.md lacks the row {row}"


def test_unknown_kind_names_the_known_ones():
    with pytest.raises(kinds.UnknownKindError, match="known kinds: " + ", ".join(kinds.trace_kinds())):
        kinds.get("nosuch")
