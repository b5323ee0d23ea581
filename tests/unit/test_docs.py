"""The documents keep their shape: a short README.md that links every page, relative links (and their anchors) that
resolve, tables that fit a screen, and no dated measurement outside benchmarks/RESULTS.md."""
import re
from pathlib import Path

import pytest

# The repository root, wherever under tests/ this file sits.
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
README_MAX_LINES = 200
TABLE_ROW_MAX_CHARS = 200
# Pages that other branches of issue 27 write and README.md already links. Before the merge none of them exists, and
# links to them are allowed; once any of them exists (the merge), every one must, so a page that was renamed or never
# arrived fails here rather than leaving a dead link.
EXPECTED_PAGES = frozenset({
    "docs/protocol.md", "docs/serving.md", "docs/reliability.md", "docs/real-size.md", "docs/architecture.md"})

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
# A dated measurement: an ISO date, a clock time in UTC, or the machine's load.
_DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d(?::\d\d)? ?UTC\b|\bload average\b|\bload (?:about )?\d")
# The suite's count or time ("599 passed", "599 tests"): CI prints it, a document goes stale with it.
_SUITE_COUNT = re.compile(r"\b\d[\d,]* (?:passed|tests)\b")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and code spans: what renders as prose, links and tables."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), *([RESULTS] if RESULTS.is_file() else [])]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: code spans and links keep their text, punctuation goes, spaces become '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 suffixes for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path, root: Path = ROOT, allowed_missing: frozenset = frozenset()) -> list[str]:
    """The relative links of `path` whose file is missing (unless in `allowed_missing`, paths relative to `root`) or
    whose anchor is not a heading of the target."""
    problems = []
    for target in _LINK.findall(_prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            rel = dest.relative_to(root) if dest.is_relative_to(root) else dest
            if str(rel) not in allowed_missing:
                problems.append(f"{path.name}: {target} (no file {rel})")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{path.name}: {target} (no heading #{anchor} in {dest.name})")
    return problems


def _allowed_missing() -> frozenset:
    return EXPECTED_PAGES if not any((ROOT / p).exists() for p in EXPECTED_PAGES) else frozenset()


def test_readme_is_at_most_200_lines():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move sections to docs/"


@pytest.mark.parametrize("path", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert broken_links(path, allowed_missing=_allowed_missing()) == []


def test_expected_pages_arrive_together():
    """After the merge every page README.md links exists; before it, none of the other branches' pages does."""
    present = {p for p in EXPECTED_PAGES if (ROOT / p).exists()}
    assert present in (set(), set(EXPECTED_PAGES)), f"missing after the merge: {sorted(EXPECTED_PAGES - present)}"


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in _LINK.findall(_prose(README.read_text()))}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")} | {(ROOT / p).resolve() for p in EXPECTED_PAGES}
    assert sorted(str(p.relative_to(ROOT)) for p in pages - linked) == []
    assert RESULTS.resolve() in linked


@pytest.mark.parametrize("path", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_table_rows_fit_a_screen(path):
    long_rows = [f"{path.name}:{i}: {len(line)} characters" for i, line in enumerate(path.read_text().splitlines(), 1)
                 if line.startswith("|") and len(line) > TABLE_ROW_MAX_CHARS]
    assert long_rows == [], "move the long cells to text below the table"


@pytest.mark.parametrize("path", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_table_ends_at_a_blank_line(path):
    """GitHub reads a line right after a table as one more row: the paragraph would render inside the table."""
    lines = _FENCE.sub("", path.read_text()).splitlines()
    glued = [line[:60] for prev, line in zip(lines, lines[1:]) if prev.startswith("|") and line.strip()
             and not line.startswith("|")]
    assert glued == [], f"{path.name}: put a blank line between the table and {glued}"


@pytest.mark.parametrize("path", [README, *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dated_measurement_outside_results(path):
    """Dates, UTC times, loads and the suite's count belong to benchmarks/RESULTS.md or CI's log (link targets,
    which may name a RESULTS.md entry by its date, are not prose)."""
    prose = _LINK.sub("", _prose(path.read_text()))
    found = _DATED.findall(prose) + _SUITE_COUNT.findall(prose)
    assert found == [], f"{path.name}: {found}: move dated measurements to benchmarks/RESULTS.md"


def test_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## The demo's table\n\n```\n# not a heading\n```\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#the-demos-table) [top](#readme) [web](https://example.com/x.md)\n"
                    "[gone](docs/b.md) [bad](docs/a.md#not-a-heading) `[code](docs/c.md)`\n"
                    "[later](docs/later.md)\n\n# README\n")
    assert broken_links(page, root=tmp_path, allowed_missing=frozenset({"docs/later.md"})) == [
        "README.md: docs/b.md (no file docs/b.md)",
        "README.md: docs/a.md#not-a-heading (no heading #not-a-heading in a.md)",
    ]


def test_slug_follows_github():
    assert slug("The offline index (`index.py`)") == "the-offline-index-indexpy"
    assert slug("Compile-only: the D-BEiT-3 Full step (2026-11-25)") == "compile-only-the-d-beit-3-full-step-2026-11-25"
