"""The built docs site in a real browser: Debian's headless Chromium driven by
Playwright (``executable_path=/usr/bin/chromium``; nothing is downloaded).

The site (tests/docsite.py, built once per session) is served on the
loopback address; each key page must load with no console error, show its
generated tables with their rows and every picture non-empty, search must
find "ownership rule", and a rendered counterexample must show its
highlighted op. Screenshots are kept in ``docs-artifacts/screenshots/``
(ignored by git). Where Chromium or Playwright is missing the tests skip and
say why (``.ci/run`` installs Chromium with apt-get before ``make test``).
"""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from collections.abc import Iterator

import pytest

from kvspec.fuzz import docgen, kinds
from tests.docsite import ARTIFACTS, REPO, browser_missing, build, chromium

SHOTS = ARTIFACTS / "screenshots"

if (_why := browser_missing()) is not None:  # pragma: no cover - depends on the machine
    pytest.skip(_why, allow_module_level=True)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    site, _ = build()
    # a counterexample rendered as `kvspec render --html` writes it, served beside the site
    from kvspec.fuzz.bugs import by_name
    from kvspec.fuzz.render import page, timeline
    from kvspec.fuzz.trace import load

    extra = site / "rendered"
    extra.mkdir(exist_ok=True)
    tl = timeline(load(REPO / "tests/traces/steady_state_inplace.json"), by_name("steady_state_inplace").factories,
                  "steady_state_inplace")
    (extra / "steady_state_inplace.html").write_text(page(tl, "tests/traces/steady_state_inplace.json"))
    handler = functools.partial(_Quiet, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if SHOTS.exists():
        shutil.rmtree(SHOTS)
    SHOTS.mkdir(parents=True)
    with chromium() as b:
        yield b


def open_page(browser: object, url: str, shot: str | None = None) -> tuple[object, list[str]]:
    """The page at ``url``, loaded with its images, with every console error,
    page error and failed request it logged; a screenshot of the first
    screen is kept as ``shot``.png."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})  # type: ignore[attr-defined]
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
    response = page.goto(url, wait_until="load")
    assert response is not None and response.ok, f"{url}: HTTP {response and response.status}"
    page.wait_for_function("() => [...document.images].every(i => i.complete)", timeout=15000)
    if shot:
        page.screenshot(path=str(SHOTS / f"{shot}.png"))
    return page, errors


KEY_PAGES = ["", "review/", "semantics/", "architecture/", "kvtrace/", "rotating/", "render/", "glossary/",
             "api/spec/"]


@pytest.mark.parametrize("path", KEY_PAGES)
def test_key_page_loads_clean_with_its_pictures(server, browser, path):
    page, errors = open_page(browser, f"{server}/{path}", (path.strip("/") or "index").replace("/", "_"))
    imgs = page.eval_on_selector_all(
        "img[src*='pictures/']", "els => els.map(e => [e.getAttribute('src'), e.complete, e.naturalWidth, "
        "e.naturalHeight])")
    for src, complete, w, h in imgs:
        assert complete and w > 0 and h > 0, f"{path}: picture {src} is empty or did not load"
    md = REPO / "docs" / (path.rstrip("/") + ".md" if path else "index.md")
    wanted = md.read_text().count("<!-- kvspec: picture ") if md.exists() else 0
    assert len(imgs) == wanted, f"{path}: {len(imgs)} pictures shown, the page asks for {wanted}"
    page.close()
    assert not errors, f"{path}: " + "\n".join(errors)


def first_cells(page: object) -> list[str]:
    """The first cell of every table body row of the page."""
    return page.evaluate(  # type: ignore[attr-defined]
        "() => [...document.querySelectorAll('table tbody tr')].map(r => r.cells[0] ? r.cells[0].innerText.trim() "
        ": '')")


def test_generated_tables_have_their_rows(server, browser):
    from kvspec.fuzz.bugs import catalog

    seen: dict[str, list[str]] = {}
    errors: list[str] = []
    for name in ("kvtrace", "architecture", "fuzzing", "proofs"):
        page, errs = open_page(browser, f"{server}/{name}/")
        seen[name] = first_cells(page)
        errors += errs
        page.close()
    for op in kinds.all_ops():
        assert op in seen["kvtrace"], f"kvtrace page: no table row for op {op}"
    for k in kinds.KINDS.values():
        for f in k.cache_fields:
            assert f in seen["kvtrace"], f"kvtrace page: no table row for field {f}"
        assert seen["architecture"].count(k.name) == 1, f"architecture page: kind {k.name}"
    for b in catalog():
        # >= 2: the catalog and the kill matrix (a hand-written table may name a bug too)
        assert seen["fuzzing"].count(b.name) >= 2, f"fuzzing page: bug {b.name} (catalog and kill matrix)"
    for o in docgen.obligations_record()["obligations"]:
        assert seen["proofs"].count(str(o["number"])) >= 1 + len(o["controls"]), f"proofs page: {o['number']}"
    assert not errors, errors


def test_search_finds_the_ownership_rule(server, browser):
    page, errors = open_page(browser, f"{server}/", "search_before")
    page.keyboard.press("/")  # Material's search shortcut
    page.locator("input.md-search__input").press_sequentially("ownership rule", delay=20)
    page.wait_for_selector(".md-search-result__item", timeout=15000)
    results = page.inner_text(".md-search-result")
    page.screenshot(path=str(SHOTS / "search_ownership_rule.png"))
    assert "ownership rule" in results.lower()
    links = page.eval_on_selector_all(".md-search-result__item a", "els => els.map(e => e.href)")
    assert any("semantics" in href or "dense" in href for href in links), links
    page.close()
    assert not errors, errors


def test_a_rendered_counterexample_shows_the_highlighted_op(server, browser):
    page, errors = open_page(browser, f"{server}/rendered/steady_state_inplace.html", "counterexample_steady_state")
    col = page.locator("g.opcol[data-diverged='true']")
    assert col.count() == 1 and col.get_attribute("data-op") == "2"
    box = col.locator("rect.col-diverged").bounding_box()
    assert box and box["width"] > 20 and box["height"] > 50
    stroke = col.locator("rect.col-diverged").evaluate("e => getComputedStyle(e).stroke")
    assert stroke.replace(" ", "") in ("rgb(221,0,0)", "#d00"), stroke
    assert "rotating_inplace_allowed" in page.inner_text("#divergence")
    assert page.locator("g.badge[data-badge='diverged']").count() == 1
    page.locator("div.scroll svg").screenshot(path=str(SHOTS / "counterexample_steady_state_picture.png"))
    page.close()
    assert not errors, errors


def test_every_picture_draws(server, browser):
    """Every generated SVG loads as an image with a non-empty size; each is
    kept as a screenshot (the ring wrap with an undo-log rollback among
    them)."""
    names = docgen.picture_names()
    site, _ = build()
    html = "".join(f'<p><img id="{n}" src="../pictures/{n}.svg"></p>' for n in names)
    (site / "rendered" / "pictures.html").write_text(f'<!DOCTYPE html><html><head><link rel="icon" href="data:,">'
                                                     f"</head><body>{html}</body></html>")
    page, errors = open_page(browser, f"{server}/rendered/pictures.html")
    for n in names:
        img = page.locator(f"img#{n}")
        w, h = img.evaluate("e => [e.naturalWidth, e.naturalHeight]")
        assert w > 100 and h > 50, f"picture {n}: {w}x{h}"
        img.screenshot(path=str(SHOTS / f"picture_{n}.png"))
    page.close()
    assert not errors, errors
