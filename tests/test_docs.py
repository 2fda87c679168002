"""The docs point at what exists: every relative link in README.md and docs/ names an existing file or
folder (and, with an anchor, a heading of that page), docs/index.md links every docs page, and every
results folder that a doc, a results README, a comment or a test names is in bench/results/. A renamed
folder or a moved page fails here, not in a reader's browser. Pure text: no torch, no GPU."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RESULT_READMES = sorted(RESULTS.glob("*/README.md"))
SOURCES = sorted(p for d in ("sd_kernels", "patches", "tests", "bench") for p in (ROOT / d).rglob("*.py")
                 if RESULTS not in p.parents)

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), images included
RESULTS_PATH = re.compile(r"(?<!:)bench/results/([\w.-]+)((?:/[\w.-]+)*)/?(?=([^\w./-]|$))")
SIBLING = re.compile(r"\.\./(\d{4}-\d\d-\d\d-[\w.-]+)/")  # a results README naming another folder


def _prose(text: str, code: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks; inline code spans removed unless ``code``."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((n, line if code else re.sub(r"`[^`]*`", "", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().replace("`", "")).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    for _, line in _prose(page.read_text(), code=True):
        if m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
    return {f"{base}-{i}" if i else base for base, n in seen.items() for i in range(n)}


def broken_links(page: pathlib.Path) -> list[str]:
    bad = []
    for n, line in _prose(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            if not where.exists():
                bad.append(f"{page.relative_to(ROOT)}:{n}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                bad.append(f"{page.relative_to(ROOT)}:{n}: {target} (no such heading)")
    return bad


def missing_results(path: pathlib.Path) -> list[str]:
    bad = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        for folder, rest, after in RESULTS_PATH.findall(line):
            named = RESULTS / folder / rest.strip("/") if after not in ("*", "{", "…") else RESULTS / folder
            if not named.exists():
                bad.append(f"{path.relative_to(ROOT)}:{n}: bench/results/{folder}{rest}")
        if path.parent.parent == RESULTS:
            bad += [f"{path.relative_to(ROOT)}:{n}: ../{name}/" for name in SIBLING.findall(line)
                    if not (RESULTS / name).is_dir()]
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_existing_files_and_headings(page):
    assert broken_links(page) == []


def test_index_links_every_docs_page():
    index = ROOT / "docs" / "index.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for _, line in _prose(index.read_text())
              for t in LINK.findall(line)}
    pages = {p.resolve() for p in (ROOT / "docs").rglob("*.md")} - {index.resolve()}
    assert sorted(str(p.relative_to(ROOT)) for p in pages - linked) == []


@pytest.mark.parametrize("path", PAGES + RESULT_READMES + SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_results_folders_exist(path):
    assert missing_results(path) == []


def test_every_results_folder_says_what_it_holds():
    assert [d.name for d in sorted(RESULTS.iterdir()) if d.is_dir() and not (d / "README.md").is_file()] == []


def test_the_checks_fail_on_what_they_guard(tmp_path, monkeypatch):
    """A broken file link, a broken anchor and a missing results folder are each reported."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title: one `x`\n\n## Two, three\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#title-one-x) [ok](docs/a.md#two-three) [ok](#top)\n# Top\n"
                    "[gone](docs/b.md) [no heading](docs/a.md#four) `[code](nowhere.md)`\n"
                    "```\n[fenced](nowhere.md)\n```\n")
    assert [b.split(": ", 1)[1] for b in broken_links(page)] == [
        "docs/b.md (no such file)", "docs/a.md#four (no such heading)"]
    monkeypatch.setattr(__import__(__name__), "RESULTS", tmp_path / "bench" / "results")
    (tmp_path / "bench" / "results" / "2026-01-01-h100-x").mkdir(parents=True)
    src = tmp_path / "t.py"
    results = "bench/" + "results/"  # so that this file names no folder itself
    src.write_text(f'A = "{results}2026-01-01-h100-x/"  # fine\nB = "{results}2026-01-01-h100-y/z.csv"\n'
                   f'C = "abc123:{results}2026-01-01-h100-y/old.sh"  # a git show spec: history\n')
    assert missing_results(src) == [f"t.py:2: {results}2026-01-01-h100-y/z.csv"]
