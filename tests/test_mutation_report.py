"""fuzz/commands/mutation_report.py: scores, and every triage verdict points at a
real Z3 check and a real section of docs/mutation.md."""

import re
from pathlib import Path

from kvspec.fuzz.commands.mutation_report import DOC, TRIAGE, render, verdict_for
from kvspec.proofs.equivalents import EQUIVALENCES

SAMPLE = """
    spec.dense.x_append__mutmut_1: killed
    spec.rotating.x_decode__mutmut_2: survived
    spec.dense.x_is_empty__mutmut_2: survived
    spec.dense.x_trim__mutmut_3: timeout
    impl.dense.x_f__mutmut_1: segfault
    impl.dense.x_f__mutmut_2: suspicious
    impl.dense.x_f__mutmut_3: no tests
    impl.dense.x_f__mutmut_4: killed
"""


def test_scores_count_crashes_as_detected_and_no_tests_as_surviving():
    block, untriaged = render(SAMPLE, {
        "spec.rotating.x_decode__mutmut_2":
            "cache = replace(cache, slots=slots) if (inplace) or True else _new_buffer(cache, slots)",
        "spec.dense.x_is_empty__mutmut_2": "return cache.offset == 0 or cache.live_start == 0 and cache.buffer is None",
        "impl.dense.x_f__mutmut_3": "x = 1",
    })
    assert "| impl/ | 4 | 1 | 0 | 2 | 0 | 1 | 0 | 75.0% |" in block
    assert "| spec/ | 4 | 1 | 1 | 0 | 2 | 0 | 0 | 50.0% |" in block
    assert untriaged == 1 and "**not triaged**" in block
    assert "Z3 `is_empty`" in block


def test_verdicts_pick_mutants_by_their_exact_line():
    line = "return cache.offset == 0 or cache.live_start == 0 and cache.buffer is None"
    assert verdict_for("spec.dense.x_is_empty__mutmut_7", "  " + line).z3 == "is_empty"
    # another mutant of the same line, or the same change in another function
    assert verdict_for("spec.dense.x_is_empty__mutmut_8", line.replace("or", "and", 1).replace("== 0", "!= 0", 1)) is None
    assert verdict_for("spec.dense.x_other__mutmut_1", line) is None


def test_every_verdict_points_at_a_z3_check_and_a_heading():
    names = {e.name for e in EQUIVALENCES}
    headings = set(re.findall(r"^#+ (.+)$", DOC.read_text(), flags=re.MULTILINE))
    for v in TRIAGE:
        assert not v.z3 or v.z3 in names, v
        assert v.section in headings, v


def test_every_mutated_module_has_a_test_in_mutmuts_selection():
    """mutmut runs only the test files of ``pytest_add_cli_args_test_selection``
    (pyproject.toml); a module of spec/ or impl/ that none of them imports
    gives every one of its mutants "no tests" (a run of 11,508 mutants had
    1,654 such before impl/batch, impl/fused, impl/write, spec/batch and
    spec/rows had their test files in the list)."""
    import ast
    import tomllib

    repo = Path(__file__).resolve().parents[1]
    cfg = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["mutmut"]
    imported: set[str] = set()
    for f in cfg["pytest_add_cli_args_test_selection"]:
        for node in ast.walk(ast.parse((repo / f).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
                imported.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names)
    skipped = set(cfg.get("do_not_mutate", []))
    modules = [f"kvspec.{pkg}.{p.stem}" for pkg in cfg["source_paths"] for p in sorted((repo / pkg).glob("*.py"))
               if p.stem not in ("__init__", "errors") and f"{pkg}/{p.name}" not in skipped]
    missing = [m for m in modules if m not in imported]
    assert not missing, f"no test file in mutmut's selection imports {missing}"
