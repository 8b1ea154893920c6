"""The docs quote records, not hand-copied numbers, and their links resolve (CPU only)."""

import fnmatch
import re
from pathlib import Path

import pytest

from kforge import docs_tables

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _pages() -> list[Path]:
    return docs_tables.pages(REPO)


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_generated_tables_match_the_records(page):
    text = page.read_text()
    assert docs_tables.render(text, RESULTS) == text, (
        f"{page.relative_to(REPO)}: a generated table differs from what the records give; "
        "run `python -m kforge.docs_tables` and commit the result")


def test_every_table_is_used_and_every_marker_is_known():
    used = set()
    for page in _pages():
        used |= {m.group(2) for m in docs_tables.MARKER.finditer(page.read_text())}
    assert used <= set(docs_tables.TABLES)
    assert used == set(docs_tables.TABLES), f"tables no page shows: {set(docs_tables.TABLES) - used}"


def test_readme_headline_figures_are_generated():
    readme = (REPO / "README.md").read_text()
    assert "<!-- table:headlines -->" in readme


def test_render_replaces_a_hand_edited_figure():
    page = "intro\n<!-- table:ladder-fp32 -->\n| made up | 99.9% |\n<!-- /table -->\nafter\n"
    out = docs_tables.render(page, RESULTS)
    assert "made up" not in out and "`10_tuned`" in out and out.endswith("<!-- /table -->\nafter\n")


def test_latest_keeps_the_newest_record_of_each_pair():
    def rec(created, speedup):
        return {"problem": {"name": "p", "size": "s"}, "candidate": {"name": "c"}, "baseline": "eager",
                "created": created, "gate2": {"speedup": speedup}}
    out = docs_tables.latest([rec("2026-01-02", 2.0), rec("2026-01-01", 1.0)])
    assert len(out) == 1 and out[0]["gate2"]["speedup"] == 2.0


FENCED = re.compile(r"^(`{3,}|~{3,}).*?^\1[ \t]*$", re.M | re.S)  # a fence closes with the same run
INLINE_CODE = re.compile(r"(`+)[^`].*?\1", re.S)


def prose(text: str) -> str:
    """The page without its code: `kernel[grid](...)` in a fenced block or a code span is no link."""
    return INLINE_CODE.sub("", FENCED.sub("", text))


def test_code_is_not_read_as_links():
    page = "see [a](a.md)\n````\n```python\nk[grid](...)\n```\n````\n`x[i](j)` and [b](b.md)\n"
    assert LINK.findall(prose(page)) == ["a.md", "b.md"]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: links to missing files: {broken}"


def test_every_docs_page_is_in_the_site_nav():
    # mkdocs --strict fails CI on a page left out of the nav; this says so in seconds, not
    # after the whole suite (the nav is read as text: PyYAML is not a test dependency)
    config = (REPO / "mkdocs.yml").read_text()
    nav = set(re.findall(r"^\s*- (?:[^\n]*: )?([\w./-]+\.md)\s*$", config, re.M))
    excluded = re.findall(r"^  (\S+)/$", config.split("exclude_docs:", 1)[1].split("nav:")[0], re.M)
    docs = REPO / "docs"
    # fnmatch's * crosses "/", as mkdocs' gitignore-style exclude does for these patterns
    pages = {
        rel for rel in (str(p.relative_to(docs)) for p in docs.rglob("*.md"))
        if not any(fnmatch.fnmatch(rel, f"{pattern}/*") for pattern in excluded)
    }
    assert pages - nav == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    assert nav - pages == set(), f"nav entries with no page: {sorted(nav - pages)}"
