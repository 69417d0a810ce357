"""Every public method of every public class in ``impl/`` names the rule it
implements, and the rule exists (docs/review.md, "Which rules does the
change touch?": a reviewer goes from the method to its rule).

A docstring names a rule in one of two ways:

* a spec function, dotted from the package: ``kvspec.spec.dense.trim``,
  ``kvspec.spec.rotating.rotating_inplace_allowed``;
* a section of docs/semantics.md: ``semantics.md 3`` (the section's number),
  optionally with a rule of it in quotes, ``semantics.md 2, "Storage"`` or
  ``semantics.md 3 "steady state copies"``.

Every such reference in a public method's docstring must resolve (the spec
function is importable and callable; the section exists, and the quoted rule
is a row, a bold lead or a numbered item of it), and each public method has
at least one. Properties count as methods; a method inherited unchanged is
checked where it is defined.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import pytest

from kvspec import impl
from tests.test_docs import _rule_resolves, _sections

SPEC_REF = re.compile(r"\bspec\.(\w+)\.(\w+)\b")
SECTION_REF = re.compile(r"\bsemantics\.md,?\s+(?:section\s+)?(\d+)(?:,?\s+\"([^\"]+)\")?")


def public_methods() -> list[tuple[str, object]]:
    """(qualified name, function) of every public method and property defined
    by a public class of an ``impl`` module."""
    out = []
    for info in pkgutil.iter_modules(impl.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"kvspec.impl.{info.name}")
        for cname, cls in vars(mod).items():
            if cname.startswith("_") or not inspect.isclass(cls) or cls.__module__ != mod.__name__:
                continue
            for name, attr in vars(cls).items():
                if name.startswith("_"):
                    continue
                if isinstance(attr, property):
                    fn = attr.fget
                elif isinstance(attr, (staticmethod, classmethod)):
                    fn = attr.__func__
                elif inspect.isfunction(attr):
                    fn = attr
                else:
                    continue
                out.append((f"{mod.__name__}.{cname}.{name}", fn))
    return out


METHODS = public_methods()


def rule_references(doc: str) -> tuple[list[str], list[tuple[str, str | None]]]:
    """The spec functions (``spec.m.f``) and sections (number, quoted rule or
    None) a docstring names."""
    text = " ".join(doc.replace("``", "").split())
    return ([f"kvspec.spec.{m}.{f}" for m, f in SPEC_REF.findall(text)],
            [(n, r or None) for n, r in SECTION_REF.findall(text)])


def resolves(ref: str) -> bool:
    module, _, name = ref.rpartition(".")
    try:
        return callable(getattr(importlib.import_module(module), name, None))
    except ImportError:
        return False


def test_the_walk_finds_the_caches():
    names = {n for n, _ in METHODS}
    assert len(METHODS) > 100
    for want in ("kvspec.impl.dense.KVCache.trim", "kvspec.impl.rotating.RotatingKVCache.update_and_fetch",
                 "kvspec.impl.paged.PagedKVCache.fork", "kvspec.impl.dense.KVCache.state"):
        assert want in names


@pytest.mark.parametrize("qualname,fn", METHODS, ids=[n for n, _ in METHODS])
def test_every_public_method_names_a_rule_that_exists(qualname, fn):
    doc = inspect.getdoc(fn) or ""
    specs, sections = rule_references(doc)
    assert specs or sections, (f"{qualname}: its docstring names no rule (a spec function such as "
                               "kvspec.spec.dense.trim, or a section: semantics.md 2, \"trim(n)\")")
    for ref in specs:
        assert resolves(ref), f"{qualname}: {ref} is not a function of the spec"
    known = _sections()
    for number, rule in sections:
        assert number in known, f"{qualname}: docs/semantics.md has no section {number}"
        if rule is not None:
            assert _rule_resolves(number, rule), f"{qualname}: semantics.md {number} has no rule \"{rule}\""


def test_the_check_refuses_what_does_not_exist():
    """The checker itself: a missing function, section or rule is caught."""
    assert not resolves("kvspec.spec.dense.no_such_rule") and not resolves("spec.nowhere.trim")
    assert resolves("kvspec.spec.dense.trim") and resolves("kvspec.spec.rotating.rotating_inplace_allowed")
    page = "semantics" + ".md"  # spelled apart: the docs tests read every citation in the repository
    specs, sections = rule_references(f'Trims (``kvspec.spec.dense.trim``; {page} 2, "trim(n)"; {page} 99).')
    assert specs == ["kvspec.spec.dense.trim"] and sections == [("2", "trim(n)"), ("99", None)]
    assert "99" not in _sections() and not _rule_resolves("2", "no such rule here")
    assert _rule_resolves("3", "steady state copies") and _rule_resolves("2", "Storage")
