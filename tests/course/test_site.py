"""The course's website (`make site`): built offline from the committed notebooks.

Every lesson has its page, every image a notebook stores is in the site, the front page
is the README's lesson table, and no link inside the site is broken.
"""

import base64
import hashlib
import html.parser
import json
import pathlib
import re
import sys
import urllib.parse

import pytest

pytest.importorskip("myst_nb", reason="the site tools are in the pinned and site extras")

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))
import build_site as site_build  # noqa: E402  (docs/build_site.py, not a package)

LESSONS = site_build.lessons(ROOT)
IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("site") / "html"
    assert site_build.build(out) == 0, "Sphinx failed; run `make site` to see why"
    return out


class _Page(html.parser.HTMLParser):
    """Links (href/src) and element ids of one HTML page."""

    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("href", "src") and value:
                self.links.append(value)
            if name in ("id", "name") and value:
                self.ids.add(value)


def _parse(path: pathlib.Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(errors="replace"))
    return page


def broken_links(site: pathlib.Path) -> list[str]:
    """Internal links of every page whose file, or whose #anchor, does not exist."""
    pages = {p: _parse(p) for p in site.rglob("*.html")}
    broken = []
    for path, page in pages.items():
        for link in page.links:
            parts = urllib.parse.urlsplit(link)
            if parts.scheme or parts.netloc:  # http(s), mailto, data: not this site's
                continue
            target = (path.parent / urllib.parse.unquote(parts.path)).resolve()
            if not parts.path:
                target = path
            elif target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{path.relative_to(site)}: {link}")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                # Furo's icons are <symbol id=...> in an inline SVG: ids too.
                if parts.fragment not in ids:
                    broken.append(f"{path.relative_to(site)}: {link} (no such anchor)")
    return broken


def site_image_digests(site: pathlib.Path) -> set[str]:
    """SHA-256 of every image file in the site and of every inline data: image."""
    digests = {hashlib.sha256(p.read_bytes()).hexdigest() for p in site.rglob("*") if p.is_file()}
    for page in site.rglob("*.html"):
        for data in re.findall(r"data:image/[a-z+]+;base64,([A-Za-z0-9+/=]+)", page.read_text()):
            digests.add(hashlib.sha256(base64.b64decode(data)).hexdigest())
    return digests


def notebook_images(path: pathlib.Path) -> list[tuple[int, str]]:
    """(cell index, SHA-256 of the decoded image) of every stored image output."""
    images = []
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        for output in cell.get("outputs", []):
            for mime in IMAGE_TYPES:
                if mime in output.get("data", {}):
                    data = output["data"][mime]
                    data = "".join(data) if isinstance(data, list) else data
                    images.append((index, hashlib.sha256(base64.b64decode(data)).hexdigest()))
    return images


def test_every_lesson_has_a_page_linked_from_the_front_page(site):
    assert LESSONS, "no notebooks/NN_*.ipynb"
    front = _parse(site / "index.html").links
    for notebook in LESSONS:
        page = site / "notebooks" / f"{notebook.stem}.html"
        assert page.exists(), f"no page for {notebook.name}"
        assert f"notebooks/{notebook.stem}.html" in front, f"front page misses {notebook.stem}"
        title = json.loads(notebook.read_text())["cells"][0]["source"]
        first_line = "".join(title).splitlines()[0].lstrip("# ").strip()
        assert first_line.split()[0] in page.read_text(), f"{page.name} lacks its title"


def test_lesson_pages_link_to_each_other_in_order(site):
    for before, after in zip(LESSONS, LESSONS[1:]):
        links = _parse(site / "notebooks" / f"{before.stem}.html").links
        assert f"{after.stem}.html" in links, f"{before.stem} has no link to {after.stem}"
        back = _parse(site / "notebooks" / f"{after.stem}.html").links
        assert f"{before.stem}.html" in back, f"{after.stem} has no link to {before.stem}"


def test_every_stored_image_is_in_the_site(site):
    digests = site_image_digests(site)
    missing = [
        f"{nb.name} cell {index}"
        for nb in LESSONS
        for index, digest in notebook_images(nb)
        if digest not in digests
    ]
    assert missing == []


def test_front_page_is_the_readmes_lesson_table(site):
    readme = (ROOT / "README.md").read_text()
    rows = [line for line in site_build.readme_section(readme, "The lessons").splitlines()]
    cells = [
        c.replace("`", "").strip() for row in rows if row.startswith("|") for c in row.split("|")
    ]
    front = html.unescape(re.sub(r"<[^>]+>", "", (site / "index.html").read_text()))
    assert [c for c in cells if c and set(c) != {"-"} and c not in front] == []
    # Generated, not copied by hand: the table lives in the README only.
    docs_text = "".join(p.read_text() for p in (ROOT / "docs").rglob("*") if p.is_file())
    assert rows[2] not in docs_text


def test_no_internal_link_is_broken(site):
    assert broken_links(site) == []


def test_checks_fail_on_a_broken_site(tmp_path):
    # The checkers themselves: a dangling link, a missing anchor, a missing image.
    (tmp_path / "a.html").write_text('<a href="b.html#x">b</a><a href="c.html">c</a><p id="y">')
    (tmp_path / "b.html").write_text('<p id="z"></p><a href="a.html#y">a</a>')
    assert broken_links(tmp_path) == ["a.html: b.html#x (no such anchor)", "a.html: c.html"]
    png = b"\x89PNG fake"
    (tmp_path / "img.png").write_bytes(png)
    assert hashlib.sha256(png).hexdigest() in site_image_digests(tmp_path)
    assert hashlib.sha256(png + b"!").hexdigest() not in site_image_digests(tmp_path)


class _Folds(html.parser.HTMLParser):
    """For each text 'Solution to exercise N' and each solution code cell: is it inside
    an open <details> element (folded until the reader opens it)?"""

    def __init__(self):
        super().__init__()
        self.depth, self.stack = 0, []
        self.titles: list[bool] = []
        self.code: list[bool] = []

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "details":
            self.depth += 1
        if tag == "div" and "tag_solution" in classes:
            # myst-nb folds a hide-cell cell's input and output in <details> inside the div.
            self.code.append("tag_hide-cell" in classes)

    def handle_endtag(self, tag):
        if tag == "details":
            self.depth -= 1

    def handle_data(self, data):
        if re.search(r"Solution to exercise \d+", data):
            self.titles.append(self.depth > 0)


def test_worked_solutions_are_folded_on_the_site(site):
    found = 0
    for path in LESSONS:
        if '"## Solutions\\n"' not in path.read_text():
            continue  # solutions not yet in the folded form (tests/course/test_exercises.py)
        folds = _Folds()
        folds.feed((site / "notebooks" / f"{path.stem}.html").read_text())
        assert all(folds.titles), f"{path.stem}: a solution's title outside <details>"
        assert all(folds.code), f"{path.stem}: a solution's code cell is not folded"
        found += len(folds.titles)
    assert found >= 11  # lessons 00, 01 and 08 have one per exercise
