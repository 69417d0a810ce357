"""The docs are checked against the code (docs/review.md, "Before approving").

* The site builds with ``mkdocs build --strict`` (a broken link, anchor,
  picture or API reference fails), once per session (tests/docsite.py).
* Every registered kind, mode, cache field, op, injected bug, proof
  obligation, command and conformance class shows on its page: generic over
  the registry, so what other changes add is checked by itself.
* Every ``semantics.md N`` citation in the code, the docs and the traces
  names a section (and item) that exists; a cited rule (``semantics.md N,
  RULE`` in a bug's clause or a trace title, ``semantics.md N, "RULE"`` in
  prose) names a row of that section; every spec function the contract
  links to exists.
* A worked example's printed output (``<!-- output of: kvspec ... -->``
  before a fenced block) is what the command prints now.
* The pictures are drawn and every page that asks for one gets it.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from kvspec.fuzz import docgen, kinds
from kvspec.fuzz.bugs import catalog
from tests.docsite import REPO, build

SEMANTICS = (REPO / "docs" / "semantics.md").read_text()


# -- the site's pages as tables ---------------------------------------------------------
class _Tables(HTMLParser):
    """Cell texts of every <table> in a page, and the page's text."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: list[str] = []
        self.text: list[str] = []
        self._cell: list[str] | None = None
        self._depth = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "table":
            self._depth += 1
        if tag in ("td", "th") and self._depth:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._depth -= 1
        if tag in ("td", "th") and self._cell is not None:
            self.cells.append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)


def page(name: str) -> _Tables:
    site, _ = build()
    path = site / ("index.html" if name == "index" else f"{name}/index.html")
    assert path.exists(), f"the site has no page {name}"
    parser = _Tables()
    parser.feed(path.read_text())
    return parser


def in_a_table(name: str, needle: str) -> bool:
    return any(needle == c or needle in c.split(", ") or needle in c.split() for c in page(name).cells)


def test_site_builds_strict_without_warnings():
    _, log = build()
    assert "WARNING" not in log, log


def test_every_kind_and_mode_on_the_architecture_page():
    for k in kinds.KINDS.values():
        assert in_a_table("architecture", k.name), f"kind {k.name} missing from docs/architecture.md"
        for m in k.modes:
            assert in_a_table("architecture", m), f"mode {m} of {k.name} missing from docs/architecture.md"


def test_every_mode_named_on_the_contract_page():
    for m in kinds.all_modes():
        assert f"`{m}`" in SEMANTICS, f"mode {m} is not named on docs/semantics.md"


def test_every_field_and_op_on_the_kvtrace_page():
    for k in kinds.KINDS.values():
        for f in k.cache_fields:
            assert in_a_table("kvtrace", f), f"cache field {f} ({k.name}) missing from docs/kvtrace.md"
    for op in kinds.all_ops():
        assert in_a_table("kvtrace", op), f"op {op} missing from docs/kvtrace.md"
    schema = kinds.SCHEMA_PATH.read_text()
    for member in ("returns", "error", "inplace", "capacity", "seq"):
        assert member in schema and in_a_table("kvtrace", member), member


def test_every_bug_in_the_catalog_and_kill_matrix_tables():
    cells = page("fuzzing").cells
    for b in catalog():
        assert sum(c == b.name for c in cells) >= 2, f"bug {b.name} missing from docs/fuzzing.md's tables"


def test_every_obligation_and_control_on_the_proofs_page():
    from kvspec.proofs.cli import obligations

    cells = page("proofs").cells
    for number, _ in obligations():
        assert str(number) in cells, f"obligation {number} missing from docs/proofs.md"
    record = docgen.obligations_record()
    assert sorted(o["number"] for o in record["obligations"]) == sorted(n for n, _ in obligations())
    for o in record["obligations"]:
        for c in o["controls"]:
            assert c["name"] in cells, f"negative control {c['name']} missing from docs/proofs.md"


def test_every_command_and_exit_code_on_the_cli_page():
    from kvspec.fuzz.commands.cli import EXIT_CODES, build_parser

    parser = build_parser()
    commands = parser.get_default("_subparsers")
    for name in [*commands, "prove"]:
        assert in_a_table("cli", f"kvspec {name}") or f"kvspec {name}" in " ".join(page("cli").cells), name
    for name, text in EXIT_CODES.items():
        assert " ".join(text.removeprefix("exit status: ").split()) in page("cli").cells, name


def test_every_conformance_class_on_its_page():
    from kvspec.fuzz.commands.conformance import CLASSES

    for cls, _ in CLASSES:
        assert in_a_table("conformance", cls.name), cls.name


def test_latest_bench_record_rows_on_the_gpu_page():
    import json

    # the latest record that has decoder rows (an end-to-end-only one has none)
    recs = [json.loads(p.read_text()) for p in docgen.bench_records()]
    rec = [r for r in recs if r.get("decoder")][-1]
    cells = page("gpu").cells
    for name in rec["decoder"]["ms_per_step"]:
        assert name in cells, f"bench row {name!r} missing from docs/gpu.md"


def test_every_kind_page_is_in_the_nav():
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:", lambda loader, suffix, node: None)
    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=Loader)
    pages: list[str] = []

    def walk(x: object) -> None:
        if isinstance(x, str):
            pages.append(x)
        elif isinstance(x, list):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    walk(config["nav"])
    for k in kinds.KINDS.values():
        assert Path(k.files["docs"]).name in pages, f"{k.files['docs']} is not in mkdocs.yml's nav"
    for md in (REPO / "docs").glob("*.md"):
        assert md.name in pages, f"docs/{md.name} is not in mkdocs.yml's nav"


def test_every_benchmark_record_is_under_records_titled_by_what_it_measures():
    config = yaml.safe_load("nav:" + (REPO / "mkdocs.yml").read_text().split("\nnav:", 1)[1])
    sections = {k: v for item in config["nav"] if isinstance(item, dict) for k, v in item.items()}
    records = sections.get("Records")
    assert records, "mkdocs.yml's nav has no Records section"
    listed = {next(iter(e.values())): next(iter(e)) for e in records}
    assert listed.get("records.md"), "the Records section must open with records.md"
    for path in docgen.bench_records():
        page = f"benchmarks/{path.stem}.md"
        assert page in listed, f"{page} is not under Records in mkdocs.yml's nav"
        assert listed[page] == docgen.record_nav_title(path.stem), (
            f"{page}: nav title {listed[page]!r}, want {docgen.record_nav_title(path.stem)!r} (fuzz/docgen.py RECORDS)")
    other = [p for k, v in sections.items() if k != "Records" for p in re.findall(r"benchmarks/[^'\"\]}]+", str(v))]
    assert not other, f"benchmark records outside Records: {other}"


def test_a_record_without_a_description_fails(monkeypatch):
    monkeypatch.setattr(docgen, "RECORDS", {k: v for k, v in docgen.RECORDS.items() if k != "2026-12-02-gpu8"})
    with pytest.raises(docgen.DocsError, match="2026-12-02-gpu8"):
        docgen.records_table()


# -- generated parts fail on what they cannot describe -------------------------------------
def test_an_undescribed_op_or_field_fails_the_build(monkeypatch):
    entry = kinds.KINDS["paged"]
    from dataclasses import replace

    monkeypatch.setitem(kinds.KINDS, "paged", replace(entry, ops=(*entry.ops, "teleport")))
    with pytest.raises(docgen.DocsError, match="teleport"):
        docgen.ops_table()
    monkeypatch.setitem(kinds.KINDS, "paged", replace(entry, fields={**entry.fields, "warp": 1}))
    with pytest.raises(docgen.DocsError, match="warp"):
        docgen.fields_table()


def test_a_new_kind_appears_in_the_tables_and_the_picture(monkeypatch):
    from dataclasses import replace

    monkeypatch.setitem(kinds.KINDS, "chunked", replace(kinds.KINDS["dense"], name="chunked", trace_kind="chunked"))
    assert "`chunked`" in docgen.kinds_table()
    svg = docgen.architecture_svg()
    assert "spec/chunked.py" in svg and 'data-exists="false"' in svg


def test_unknown_markers_and_dead_links_fail():
    with pytest.raises(docgen.DocsError, match="no table"):
        docgen.expand("<!-- kvspec: table nosuch -->", "x.md")
    with pytest.raises(docgen.DocsError, match="no picture"):
        docgen.expand("<!-- kvspec: picture nosuch -->", "x.md")
    with pytest.raises(docgen.DocsError, match="no such file"):
        docgen.rewrite_links("see [x](../spec/nosuch.py)", "semantics.md")
    assert "api/spec.md#kvspec.spec.dense" in docgen.rewrite_links("[d](../spec/dense.py)", "semantics.md")


# -- the generated parts are written into the pages, and current ---------------------------
def test_the_generated_parts_of_the_pages_are_current():
    """Every table and picture region of docs/*.md, and every picture's SVG
    file, holds what the generators give now (a kind, op, field, bug or
    record added since shows here, with the file and the command)."""
    stale = [p.relative_to(REPO).as_posix() for p in docgen.stale()]
    assert not stale, f"generated parts out of date in {', '.join(stale)}: run {docgen.WRITE_COMMAND}"


def test_a_region_is_filled_once_and_a_hand_edit_is_stale(tmp_path, monkeypatch):
    raw = "# t\n\n<!-- kvspec: table checks -->\n\ntext after\n"
    once = docgen.expand(raw, "x.md")
    assert once.count(docgen.END) == 1 and "| `returns` |" in once and "text after" in once
    assert docgen.expand(once, "x.md") == once, "a second pass must change nothing (no table twice)"
    edited = once.replace("| `returns` |", "| `returned` |")
    assert docgen.expand(edited, "x.md") == once
    two = docgen.expand("<!-- kvspec: table checks -->\n<!-- kvspec: table checks -->\n", "x.md")
    assert two.count(docgen.END) == 2 and two.count("| `error` |") == 2
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "p.md").write_text(edited)
    monkeypatch.setattr(docgen, "ROOT", tmp_path)
    monkeypatch.setattr(docgen, "PICTURES_DIR", docs / "pictures")
    monkeypatch.setattr(docgen, "picture_names", lambda: ["mask_sinks"])
    assert docgen.stale() == [docs / "p.md", docs / "pictures" / "mask_sinks.svg"]
    assert docgen.write_pages() == [docs / "p.md", docs / "pictures" / "mask_sinks.svg"]
    assert docgen.stale() == []
    assert (docs / "p.md").read_text() == once


def test_kvtrace_read_as_plain_markdown_holds_the_op_and_field_tables():
    raw = (REPO / "docs" / "kvtrace.md").read_text()
    for op in kinds.all_ops():
        assert f"\n| `{op}` |" in raw, f"docs/kvtrace.md has no row for op {op}: run {docgen.WRITE_COMMAND}"
    for k in kinds.KINDS.values():
        for f in k.cache_fields:
            assert f"\n| `{f}` |" in raw, f"docs/kvtrace.md has no row for field {f}: run {docgen.WRITE_COMMAND}"
    for name in docgen.picture_names():
        assert (REPO / "docs" / "pictures" / f"{name}.svg").exists(), name


# -- docstring roles -------------------------------------------------------------------------
def test_docstring_roles_become_cross_references():
    html = ('<h2 id="kvspec.impl.write">m</h2><p>:func:<code>write_inplace</code></p>'
            '<h3 id="kvspec.impl.write.write_inplace" class="doc doc-heading">f</h3>'
            '<p>:class:<code>~kvspec.impl.dense.KVCache</code>, :mod:<code>kvspec.spec.errors</code>, :meth:<code>_private</code></p>')
    out = docgen.render_roles(html)
    assert '<autoref identifier="kvspec.impl.write.write_inplace" optional><code>write_inplace</code></autoref>' in out
    assert '<autoref identifier="kvspec.impl.dense.KVCache" optional><code>KVCache</code></autoref>' in out
    assert '<autoref identifier="kvspec.spec.errors" optional><code>kvspec.spec.errors</code></autoref>' in out
    assert not docgen.ROLE.search(out)


def test_the_api_reference_shows_no_raw_role():
    site, _ = build()
    for name in ("api/spec", "api/impl", "source"):
        text = (site / name / "index.html").read_text()
        raw = re.findall(r":(?:class|meth|func|mod|attr|data|exc|obj):(?:<code>|`)[^<`]*", text)
        assert not raw, f"{name}: raw docstring roles {raw[:5]} (fuzz/docgen.py render_roles)"
        assert "<autoref" not in text, f"{name}: a cross-reference left unresolved"


# -- citations ------------------------------------------------------------------------------
def _sections() -> dict[str, str]:
    """Section number -> its text, and "N.M" -> item M of section N's list."""
    out: dict[str, str] = {}
    parts = re.split(r"^## (\d+)\. ", SEMANTICS, flags=re.MULTILINE)
    for num, body in zip(parts[1::2], parts[2::2]):
        out[num] = body
        for m in re.finditer(r"^(\d+)\. \*\*([^*]+)\*\*", body, re.MULTILINE):
            out[f"{num}.{m.group(1)}"] = m.group(2)
    return out


def _rows(section: str) -> set[str]:
    """Rule names of a section: first cells of its tables, bold paragraph leads."""
    body = _sections()[section]
    names = set()
    for line in body.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            names.add(line.split("|")[1].strip().strip("`").lower())
        m = re.match(r"^\*\*([^*]+?)\.?\*\*", line)
        if m:
            names.add(m.group(1).lower())
    return names


def _rule_resolves(section: str, rule: str) -> bool:
    sections = _sections()
    if section not in sections:
        return False
    if "." in section:
        return rule.lower().startswith(sections[section].lower())
    item = re.match(r"rule (\d+)\b", rule)
    if item:  # "semantics.md 7, rule 2": item 2 of the section's numbered rules
        return f"{section}.{item.group(1)}" in sections
    cited = " ".join(rule.split()).strip("`").lower()
    head = cited.split(" (")[0]

    def bounded(text: str, prefix: str) -> bool:
        return text.startswith(prefix) and (len(text) == len(prefix) or text[len(prefix)] in " :,(;")

    return any(bounded(cited, r) or (len(head) >= 4 and bounded(r, head)) for r in _rows(section))


def _cited_text() -> list[tuple[str, str]]:
    files = [*REPO.glob("README.md"), *(REPO / "docs").rglob("*.md")]
    for pkg in ("spec", "impl", "fuzz", "proofs", "tests"):
        files += (REPO / pkg).rglob("*.py")
    files += (REPO / "tests" / "traces").rglob("*.json")
    return [(str(f.relative_to(REPO)), f.read_text()) for f in files if f.name != "test_docs.py"]


CITE = re.compile(r"semantics\.md[ ,]*(?:section )?(\d+(?:\.\d+)?)\b")


def test_every_cited_section_exists():
    sections = _sections()
    bad = [f"{path}: semantics.md {m.group(1)}" for path, text in _cited_text()
           for m in CITE.finditer(text) if m.group(1) not in sections]
    assert not bad, "citations of sections docs/semantics.md does not have:\n" + "\n".join(sorted(set(bad)))


def test_every_quoted_rule_citation_resolves():
    bad = []
    for path, text in _cited_text():
        for m in re.finditer(r'semantics\.md\s+(\d+(?:\.\d+)?),?\s+"([^"]+)"', text):
            if not _rule_resolves(m.group(1), m.group(2)):
                bad.append(f'{path}: semantics.md {m.group(1)}, "{m.group(2)}"')
    assert not bad, "citations of rules docs/semantics.md does not have:\n" + "\n".join(sorted(set(bad)))


def _clause_problems(clause: str) -> list[str]:
    problems = []
    refs = list(re.finditer(r"semantics\.md (\d+(?:\.\d+)?)[, ]+([^;]+?)(?=$|; )", clause))
    specs = re.findall(r"\bkvspec\.spec\.[a-z_]+\.[a-z_]+", clause)
    if not refs and not specs:
        problems.append("cites neither a semantics.md rule nor a spec function")
    for m in refs:
        if not _rule_resolves(m.group(1), m.group(2)):
            problems.append(f"semantics.md {m.group(1)} has no rule {m.group(2)!r}")
    for ref in specs:
        module, _, fn = ref.rpartition(".")
        if not callable(getattr(importlib.import_module(module), fn, None)):
            problems.append(f"{ref} does not exist")
    return problems


@pytest.mark.parametrize("bug", catalog(), ids=lambda b: b.name)
def test_every_bug_clause_resolves(bug):
    assert not _clause_problems(bug.clause), (bug.clause, _clause_problems(bug.clause))


def test_trace_titles_cite_rules_that_exist():
    """A bug's trace is titled ``injected bug NAME (CLAUSE): ...``; the
    clause must resolve as the catalog's do."""
    import json

    bad = []
    for path in sorted((REPO / "tests" / "traces").glob("*.json")):
        title = json.loads(path.read_text()).get("title", "")
        m = re.match(r"injected bug (\w+) \((.*?)\): ", title)
        if m and _clause_problems(m.group(2)):
            bad.append(f"{path.name}: {m.group(2)!r}: {_clause_problems(m.group(2))}")
    assert not bad, "\n".join(bad)


def test_a_bad_clause_is_caught():
    assert _clause_problems("semantics.md 3, single-row append 4 (steady state must copy)")
    assert _clause_problems("semantics.md 9, ownership rule")
    assert _clause_problems("kvspec.spec.dense.no_such_rule (x)")
    assert not _clause_problems("semantics.md 3, steady state copies")
    assert not _clause_problems("kvspec.spec.batch.visible (semantics.md 7, rule 2)")
    assert _clause_problems("kvspec.spec.batch.visible (semantics.md 7, rule 9)")


def test_every_spec_function_the_contract_links_exists():
    bad = []
    for m in re.finditer(r"\[([^\]\n]+)\]\(\.\./spec/([a-z_]+)\.py\)", SEMANTICS):
        module = importlib.import_module(f"kvspec.spec.{m.group(2)}")
        for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", m.group(1)):
            if not hasattr(module, name):
                bad.append(f"kvspec.spec.{m.group(2)}.{name}")
    assert not bad, f"docs/semantics.md links spec functions that do not exist: {bad}"


# -- worked examples ----------------------------------------------------------------------
EXAMPLE = re.compile(r"<!-- output of: (kvspec [^>]+?) -->\n```[a-z]*\n(.*?)```", re.DOTALL)


def _examples() -> list[tuple[str, str, str]]:
    out = []
    for md in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for m in EXAMPLE.finditer(md.read_text()):
            out.append((md.name, m.group(1), m.group(2)))
    return out


def test_the_docs_have_worked_examples():
    assert len(_examples()) >= 3


@pytest.mark.parametrize("where,command,shown", _examples(), ids=lambda x: x if "\n" not in x else "")
def test_worked_example_prints_what_the_page_shows(where, command, shown):
    from kvspec.fuzz.commands.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(shlex.split(command)[1:])
    got = "\n".join(line.rstrip() for line in buf.getvalue().strip().splitlines())
    want = "\n".join(line.rstrip() for line in shown.strip().splitlines())
    assert got == want, f"{where}: `{command}` now prints:\n{got}"


def test_turbo_page_claims_about_prompt_caches():
    """docs/turbo.md: a Turbo mode gives full-attention layers a Turbo cache
    and keeps sliding-window layers fp16 rings; with ``max_kv_size`` (every
    layer a ring) it is refused."""
    from mlx_lm.models import cache as lm

    from kvspec.impl.models import make_prompt_cache
    from kvspec.impl.rotating import RotatingKVCache
    from kvspec.impl.turbo import TurboKVCache
    from kvspec.spec.errors import UnsupportedOperationError

    class Sliding:
        layers = (0, 1)

        def make_cache(self):
            return [lm.KVCache(), lm.RotatingKVCache(max_size=4, keep=0)]

    class Full:
        layers = (0, 1)

    got = make_prompt_cache(Sliding(), mode="turbo4")
    assert isinstance(got[0], TurboKVCache) and type(got[1]) is RotatingKVCache and got[1].mode == "fp16"
    assert all(isinstance(c, TurboKVCache) for c in make_prompt_cache(Full(), mode="turbo4"))
    with pytest.raises(UnsupportedOperationError):
        make_prompt_cache(Full(), mode="turbo4", max_kv_size=8)
    text = " ".join((REPO / "docs" / "turbo.md").read_text().split())
    assert "sliding-window layers (gemma3, a llama with `layer_types`) stay fp16 rings" in text


# -- pictures -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", docgen.picture_names())
def test_every_picture_is_drawn_and_asked_for(name):
    site, _ = build()
    svg = (site / "pictures" / f"{name}.svg").read_text()
    root = ET.fromstring(svg.split("?>", 1)[-1])
    assert root.tag.endswith("svg") and len(list(root.iter())) > 20
    pages = [md for md in (REPO / "docs").rglob("*.md") if f"<!-- kvspec: picture {name} -->" in md.read_text()]
    assert pages, f"no page shows picture {name}"
    assert name in docgen.PICTURE_PAGES, f"picture {name}: say which pages must show it (docgen.PICTURE_PAGES)"
    for want in docgen.PICTURE_PAGES[name]:
        assert REPO / "docs" / want in pages, f"docs/{want} no longer shows picture {name}"
    for md in pages:
        html = (site / md.stem / "index.html").read_text()
        assert f"pictures/{name}.svg" in html
    if name in docgen.PICTURES:
        cols = [g for g in root.iter("{http://www.w3.org/2000/svg}g") if "opcol" in g.get("class", "")]
        assert cols, name


# -- the glossary and the API reference -----------------------------------------------
#: acronyms a reader of these pages is assumed to know (everything else used on a
#: page must be a glossary term)
COMMON_ACRONYMS = {"Z3", "MLX", "JSON", "GPU", "CUDA", "CPU", "API", "PR", "README", "CLI", "CI", "KV", "PNG",
                   "SVG", "HTML", "GB", "MB", "PEP", "PEP316", "C99", "H200", "B0", "L2", "URL", "RAM", "OS", "LLM",
                   "XML", "DIR", "SIZE", "RANDOM", "H100", "NVIDIA"}  # DIR, SIZE, RANDOM: metavars
#: the field's multi-word terms the pages use with a meaning of their own (docs/review.md, render.md)
GLOSSARY_TERMS = ("ownership rule", "ownership marker", "public fault kind", "the reference engine", "live window",
                  "dead tail", "holder", "copy-on-write", "undo log", "block table", "refcount", "fold", "sink",
                  "injected bug", "kill matrix", "negative control", "divergence", "token identity")


def _glossary_terms() -> set[str]:
    terms = set()
    for line in (REPO / "docs" / "glossary.md").read_text().splitlines():
        if line.startswith("| **"):
            terms |= {t.lower() for t in re.findall(r"\*\*([^*]+)\*\*", line)}
    return terms


def test_every_term_the_pages_use_is_in_the_glossary():
    """An acronym or a public fix number (``#1209``) used in a page's prose,
    and each of the field's terms, is a glossary row: removing a row the
    pages still use fails here."""
    terms = _glossary_terms()
    missing = set()
    generated = re.compile(r"^<!-- kvspec: (?:table|picture) [a-z0-9_]+ -->$.*?^<!-- /kvspec -->$",
                           re.MULTILINE | re.DOTALL)
    for md in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        # a generated table's words are the registry's, the catalog's and the records' (checked where they are made)
        text = generated.sub("", md.read_text())
        text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
        text = re.sub(r"`[^`\n]*`|\]\([^)]*\)|<[^>]*>", "", text)
        for word in re.findall(r"(?<![\w/#.-])(#\d{3,5}|[A-Z][A-Z0-9]{1,5})(?![\w/-])", text):
            if word not in COMMON_ACRONYMS and word.lower() not in terms:
                missing.add(f"{word} ({md.name})")
    missing |= {t for t in GLOSSARY_TERMS if t not in terms}
    assert not missing, f"used on a page but not in docs/glossary.md: {sorted(missing)}"


def test_the_api_reference_documents_every_module():
    """Every module of spec/ and impl/ has its section on the API pages, and
    every public function or class with a docstring defined in it is
    rendered there (mkdocstrings gives each its id)."""
    import ast

    site, _ = build()
    missing = []
    for package in ("spec", "impl"):
        html = (site / "api" / package / "index.html").read_text()
        for path in sorted((REPO / package).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            module = ".".join(("kvspec", *path.relative_to(REPO).with_suffix("").parts))
            if f'id="{module}"' not in html:
                missing.append(module)
                continue
            for node in ast.parse(path.read_text()).body:
                if (isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")
                        and ast.get_docstring(node) and f'id="{module}.{node.name}"' not in html):
                    missing.append(f"{module}.{node.name}")
    assert not missing, f"missing from the API reference: {missing}"


def _md_rows(table: str) -> list[list[str]]:
    lines = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| ---")]
    return [[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", ln)[1:-1]] for ln in lines[1:]]


def test_each_generated_row_describes_its_own_entry():
    """A row of a generated table carries its own entry's text, not a
    neighbour's: the op, field and check tables' descriptions, the bug
    table's clause and description."""
    ops = {r[0].strip("`"): r[-1] for r in _md_rows(docgen.ops_table())}
    assert ops == {op: docgen.OP_TEXT[op] for op in kinds.all_ops()}
    fields = {r[0].strip("`"): r[-1] for r in _md_rows(docgen.fields_table())}
    assert fields == {f: docgen.FIELD_TEXT[f] for f in fields} and len(fields) == len(
        {f for k in kinds.KINDS.values() for f in k.cache_fields})
    checks = {r[0].strip("`"): r[-1] for r in _md_rows(docgen.checks_table())}
    assert checks == {c: docgen.CHECK_TEXT[c] for c in checks}
    bugs = {r[0].strip("`"): (r[2], r[5]) for r in _md_rows(docgen.bugs_table())}
    assert bugs == {b.name: (b.clause, b.description) for b in catalog()}


def test_a_counterexample_picture_shows_its_divergence():
    """A picture drawn on an injected bug outlines exactly one divergent
    column (the op replay reports); a worked example's picture none."""
    from kvspec.fuzz.bugs import by_name
    from kvspec.fuzz.replay import replay
    from kvspec.fuzz.trace import load

    for name, (path, bug, _) in docgen.PICTURES.items():
        root = ET.fromstring(docgen.picture(name).split("?>", 1)[-1])
        flagged = [g.get("data-op") for g in root.iter("{http://www.w3.org/2000/svg}g")
                   if g.get("data-diverged") == "true"]
        if bug is None:
            assert flagged == [], name
        else:
            d = replay(load(REPO / path), by_name(bug).factories).divergence
            assert d is not None and flagged == [str(d.index)], (name, flagged)


def test_the_architecture_picture_marks_what_exists():
    """Each file box of the layers-by-kinds picture is dashed exactly when
    the registry's file is missing."""
    root = ET.fromstring(docgen.architecture_svg())
    boxes = [g for g in root.iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "file"]
    assert len(boxes) == sum(len(k.files) for k in kinds.KINDS.values()), len(boxes)
    for g in boxes:
        path = "".join(g.itertext()).strip()
        assert g.get("data-exists") == str((REPO / path).exists()).lower(), path


def test_the_bench_table_skips_a_later_record_without_decoder_rows(tmp_path, monkeypatch):
    # an end-to-end-only record (gpu_session DECODER=0) sorted last left the
    # GPU page's generated table without its decoder rows
    import json

    from kvspec.fuzz import docgen

    (tmp_path / "docs/benchmarks").mkdir(parents=True)
    rows = {"rows": [{"context": 16, "decode_inplace_ms": 1.0, "decode_copy_ms": 1.0, "rollback_logical_ms": 1.0,
                      "rollback_physical_ms": 1.0}]}
    full = {"machine": "m", "cache_rows": rows, "decoder": {"layers": 2, "ms_per_step": {"attention only": {"16": 1.5}}}}
    older = {**full, "decoder": {**full["decoder"], "layers": 3}}
    (tmp_path / "docs/benchmarks/2025-12-31-gpu.json").write_text(json.dumps(older))
    (tmp_path / "docs/benchmarks/2026-01-01-gpu.json").write_text(json.dumps(full))
    (tmp_path / "docs/benchmarks/2026-01-02-gpu-e2e.json").write_text(json.dumps({"machine": "m", "cache_rows": rows}))
    monkeypatch.setattr(docgen, "ROOT", tmp_path)
    out = docgen.bench_table()
    # the latest of the records with decoder rows, not the first
    assert "2026-01-01-gpu.json" in out and "Decoder step, 2 layers" in out
    # none has decoder rows: the latest record, not the first
    for name in ("2025-12-31-gpu.json", "2026-01-01-gpu.json"):
        (tmp_path / "docs/benchmarks" / name).write_text(json.dumps({"machine": "m", "cache_rows": rows}))
    assert "2026-01-02-gpu-e2e.json" in docgen.bench_table()
