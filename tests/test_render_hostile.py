"""kvspec render on traces from strangers: every string a trace carries stays
data. Hostile snapshot names, titles and refusal messages are drawn as text,
escaped for where they stand; no event-handler attribute, no script element,
no ``javascript:`` link reaches the SVG or the HTML page; the page refuses
script by its Content-Security-Policy; the SVG stays well-formed XML (control
characters shown as escapes); very long strings are cut for the layout.

The same page is loaded in headless Chromium (Playwright, Debian's
``/usr/bin/chromium``; skipped with the reason where either is missing): its
elements are hovered and clicked, and no handler a trace planted runs.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.render import CSP, page, svg, timeline, visible
from kvspec.fuzz.trace import loads
from tests.docsite import browser_missing
from tests.docsite import chromium as docsite_chromium

#: names a bug report could carry: both quotes, angle brackets, a closing
#: script tag, javascript: URLs, an entity, unicode, a right-to-left override
HOSTILE = [
    'x" onmouseover="window.pwned=1" y="',
    "y' onclick='window.pwned=1' z='",
    "</script><script>window.pwned=1</script>",
    "<img src=x onerror=window.pwned=1>",
    "javascript:window.pwned=1",
    '<a href="javascript:window.pwned=1">go</a>',
    "<svg onload=window.pwned=1>",
    "&lt;b&gt; &amp; ]]> <!-- -->",
    "名前 ünïcødé \U0001f600",
]
CONTROL = "c\x00\x01\x07\x1b\x7f\x85\u202e\ud800"
LONG = "L" * 128  # the longest name kvtrace allows


def hostile_trace(kind: str = "dense") -> str:
    names = [*HOSTILE, CONTROL, LONG]
    ops: list[dict] = [{"op": "append", "n": 2}]
    ops += [{"op": "snapshot", "name": n} for n in names]
    ops.append({"op": "append", "n": 1})
    ops += [{"op": "restore", "name": n} for n in names]
    ops.append({"op": "restore", "name": HOSTILE[0] + "missing", "error": True})  # a refusal quoting the name
    ops.append({"op": "drop", "name": HOSTILE[2]})
    cache = {"kind": kind, "step": 2} if kind == "dense" else {"kind": kind, "max_size": 3, "step": 1}
    title = " ".join([*HOSTILE, CONTROL]) + " " + "T" * 3000
    return json.dumps({"kvtrace": 1, "title": title, "cache": cache, "ops": ops})


def _render(kind: str) -> tuple[str, str]:
    tl = timeline(loads(hostile_trace(kind)))
    assert tl.divergence is None, tl.divergence
    return svg(tl), page(tl, 'trace "<b>".json')


@pytest.fixture(scope="module", params=["dense", "rotating"])
def rendered(request) -> tuple[str, str]:
    return _render(request.param)


@pytest.fixture(scope="module")
def rendered_dense() -> tuple[str, str]:
    return _render("dense")


EVENT = re.compile(r"^on", re.IGNORECASE)


def _url_is_script(value: str) -> bool:
    squeezed = re.sub(r"[\x00-\x20]", "", value).lower()
    return squeezed.startswith(("javascript:", "vbscript:", "data:text/html"))


class _Elements(HTMLParser):
    """Every start tag of an HTML document with its attributes, and the text
    of each element (entities decoded)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, attrs))

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, attrs))

    def handle_data(self, data):
        self.text.append(data)


def test_the_svg_is_well_formed_and_inert(rendered):
    doc, _ = rendered
    assert doc.startswith("<?xml")
    root = ET.fromstring(doc.split("?>", 1)[1])  # control characters would make this raise
    for el in root.iter():
        tag = el.tag.rpartition("}")[2]
        assert tag not in ("script", "foreignObject", "iframe", "object", "embed", "a", "use", "image"), tag
        for attr, value in el.attrib.items():
            name = attr.rpartition("}")[2]
            assert not EVENT.match(name), (tag, attr, value)
            if name == "href":
                assert not _url_is_script(value), (tag, value)
    text = "".join(root.itertext())
    # every hostile name is drawn as text: a snapshot's row label (cut to the
    # gutter, whole in its tooltip) and the refusal quoting it
    for name in HOSTILE:
        assert visible(name) in text, name
    assert visible(CONTROL) in text and "\\x00\\x01\\x07\\x1b\\x7f\\x85\\u202e\\ud800" in visible(CONTROL)
    assert LONG in text


def test_long_strings_are_cut_for_the_layout(rendered):
    doc, _ = rendered
    root = ET.fromstring(doc.split("?>", 1)[1])
    ns = "{http://www.w3.org/2000/svg}"
    labels = [el for el in root.iter(f"{ns}text") if el.get("class") == "lab"]
    long_label = [el for el in labels if (el.findtext(f"{ns}title") or "").endswith(LONG)]
    assert long_label, "the long snapshot's row label is missing"
    for el in long_label:
        shown = el.find(f"{ns}title").tail or ""
        assert len(shown) <= 19 and shown.endswith("\u2026"), shown
    # the 3000-character title: at most four lines, the last one cut
    title = [el.text or "" for el in labels if "T" * 40 in (el.text or "")]
    assert 1 <= len(title) <= 4 and title[-1].endswith("\u2026")
    assert int(root.get("width")) < 20000


def test_the_html_page_is_inert(rendered):
    _, html = rendered
    parser = _Elements()
    parser.feed(html)
    parser.close()
    tags = [t for t, _ in parser.tags]
    assert "script" not in tags and "iframe" not in tags and "object" not in tags and "a" not in tags
    for tag, attrs in parser.tags:
        for attr, value in attrs:
            assert not EVENT.match(attr), (tag, attr, value)
            if attr in ("href", "src", "action", "xlink:href", "formaction"):
                assert not _url_is_script(value or ""), (tag, attr, value)
    csp = [dict(a) for t, a in parser.tags if t == "meta" and dict(a).get("http-equiv") == "Content-Security-Policy"]
    assert [c["content"] for c in csp] == [CSP]
    policy = {d.split()[0]: d.split()[1:] for d in CSP.split("; ")}
    assert policy["script-src"] == ["'none'"] and policy["default-src"] == ["'none'"]
    # the CSP comes before anything the trace wrote
    assert html.index("Content-Security-Policy") < html.index("<body>")
    text = "".join(parser.text)
    for name in HOSTILE:
        assert visible(name) in text, name
    assert 'trace "<b>".json' in text
    # the 3000-character title is cut for the page (the whole title is the trace's)
    title = re.search(r'<p class="title">(.*?)</p>', html, re.DOTALL).group(1)
    assert len(title) < 1400 and title.endswith("\u2026")


def test_cli_render_of_a_hostile_trace(tmp_path, capsys):
    """The command writes both pictures of a stranger's trace and exits 0;
    the SVG file parses as XML."""
    src = tmp_path / "hostile.json"
    src.write_text(hostile_trace("rotating"))
    assert main(["render", str(src), "-o", str(tmp_path / "h.svg")]) == 0
    assert main(["render", str(src), "--html", "-o", str(tmp_path / "h.html")]) == 0
    capsys.readouterr()
    ET.parse(tmp_path / "h.svg")
    assert "<script" not in (tmp_path / "h.html").read_text().lower()


def test_visible_escapes_only_what_is_not_text():
    assert visible("plain ünï 名 \U0001f600 <\"'>") == "plain ünï 名 \U0001f600 <\"'>"
    assert visible("a\tb\nc\r\x00\u202e\ufffe") == "a b c \\x00\\u202e\\ufffe"


# -- in a real browser ---------------------------------------------------------------

@pytest.fixture(scope="module")
def chromium():
    why = browser_missing()
    if why:  # pragma: no cover - depends on the machine
        pytest.skip(why)
    with docsite_chromium() as b:
        yield b


@pytest.mark.parametrize("form", ["html", "svg"])
def test_no_handler_runs_in_the_browser(chromium, rendered_dense, tmp_path, form):
    """Open the page (and the bare SVG), move a real pointer over it clicking,
    and dispatch every pointer, focus and load event to every element; no
    dialog opens, ``window.pwned`` stays unset, nothing breaks the CSP (a
    violation is a console error), and the timeline is visible with the
    names on it as text."""
    doc, html = rendered_dense
    path = tmp_path / f"hostile.{form}"
    path.write_text(html if form == "html" else doc, encoding="utf-8")
    pg = chromium.new_page(viewport={"width": 1400, "height": 900})
    dialogs: list[str] = []
    errors: list[str] = []
    pg.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    pg.on("pageerror", lambda e: errors.append(str(e)))
    # a CSP violation (anything the page tried to run or fetch) is a console error
    pg.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    pg.goto(path.as_uri(), wait_until="load")
    timeline_sel = "svg.kvr" if form == "html" else "svg"
    assert pg.locator(timeline_sel).first.is_visible()
    # a real pointer: moved over the whole timeline on a grid, clicking as it goes
    box = pg.locator(timeline_sel).first.bounding_box()
    assert box is not None
    for k in range(8):
        for m in range(4):
            x = box["x"] + (k + 0.5) * min(box["width"], 1400) / 8
            y = box["y"] + (m + 0.5) * min(box["height"], 900) / 4
            pg.mouse.move(x, y)
            pg.mouse.click(x, y)
    # and every pointer, focus and load event dispatched to every element, so
    # a handler anywhere would run (or, under the page's CSP, be refused)
    dispatched = pg.evaluate("""() => {
        const kinds = ['mouseover', 'mouseenter', 'mousemove', 'mousedown', 'mouseup', 'click', 'dblclick',
                       'focus', 'focusin', 'load', 'error', 'animationstart', 'pointerover'];
        let n = 0;
        for (const e of document.querySelectorAll('*')) {
            for (const t of kinds) { e.dispatchEvent(new Event(t, {bubbles: true})); }
            n += 1;
        }
        return n;
    }""")
    assert dispatched > 100
    assert pg.evaluate("() => window.pwned") is None
    assert dialogs == [] and errors == []
    # nothing the trace wrote became an element
    assert pg.evaluate("() => document.querySelectorAll('script, img, iframe, a, foreignObject').length") == 0
    shown = pg.evaluate("() => document.documentElement.textContent")
    for name in HOSTILE:
        assert visible(name) in shown, name
    pg.close()
